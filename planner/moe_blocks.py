"""Which modules of a model are Mixture-of-Experts layers, and their shape.

The planner decides how each MoE layer runs (``ExpertLayout``); the cost model needs its
shape (experts, top-k, capacity factor, widths) and the compiler needs to know which of its
parameters are the router and which the stacked expert weights. ``find_moe_blocks`` reads
both off the model (on meta tensors or real ones) by the layer's structure, so a model
written by someone else with the same structure is recognised too.

Recognised today:

- ``examples/moe.py``'s ``MoE`` (and any module with its attributes: a ``router``
  ``nn.Linear`` without bias, ``experts.w_in`` (E, C, F) and ``experts.w_out`` (E, F, C) GELU
  experts, ``top_k``, ``capacity_factor``);
- HuggingFace's sparse MoE blocks of transformers 5 (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
  DeepSeek-V3, ...): a ``gate`` router (``weight`` (E, C), ``top_k``) and a stacked-experts
  module ``experts`` (``gate_up_proj`` (E, 2F, C), ``down_proj`` (E, C, F): SwiGLU, no
  bias), dropless. Shared experts, where a block has them, are dense parts of the block;
- gpt-oss's ``GptOssMLP`` (transformers 5): a ``router`` with a bias (``weight`` (E, C),
  ``bias`` (E), ``top_k``) and ``experts`` stored transposed with biases (``gate_up_proj``
  (E, C, 2F) whose gate and up columns interleave, ``gate_up_proj_bias`` (E, 2F),
  ``down_proj`` (E, F, C), ``down_proj_bias`` (E, C)), run as a clamped SwiGLU (``alpha``,
  ``limit``), dropless. The block returns (output, router scores).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


# How compiled programs run a recognised block by its layout (codegen.moe_emit): the whole
# block replaced by a runtime layer that routes (examples/moe.py's structure), or only the
# block's stacked experts replaced, its own router kept (HuggingFace's structure).
ROUTED_GELU = "routed_gelu"
HF_STACKED_EXPERTS = "hf_stacked_experts"


@dataclass(frozen=True)
class MoEBlock:
    """One MoE layer of a model: its module path and shape, and its parameters' names
    (relative to the module) by role."""

    module: str
    experts: int
    top_k: int
    capacity_factor: float  # 0: dropless
    hidden: int  # the width tokens enter and leave with
    ffn: int  # each expert's hidden width
    matmuls: int  # matmuls per expert (2: a GELU MLP, 3: SwiGLU)
    router: str  # the router's weight, (experts, hidden)
    expert_weights: tuple[str, ...]  # stacked expert weights, experts first
    kind: str  # which structure it was recognised as, for messages
    runtime: str = ROUTED_GELU  # how a compiled program runs it: ROUTED_GELU or HF_STACKED_EXPERTS
    # Group-limited routing (DeepSeek-V3's router: ``n_group`` groups of consecutive experts,
    # each token's experts chosen among ``topk_group`` of them), as (groups, groups per token);
    # () when every token may pick any expert. The cost model's node fan-out reads it
    # (``cost_model.all_to_all``).
    routing_groups: tuple[int, ...] = ()

    @property
    def expert_parameters(self) -> int:
        """Parameters of all the experts together."""
        return self.experts * self.matmuls * self.hidden * self.ffn


def find_moe_blocks(model: torch.nn.Module) -> tuple[MoEBlock, ...]:
    """The MoE layers of ``model`` in module order (see the module docstring); an MoE layer
    inside another is not looked for."""
    found: list[MoEBlock] = []
    for path, module in model.named_modules():
        if any(path.startswith(block.module + ".") for block in found):
            continue
        block = _gelu_moe(path, module) or _hf_stacked_experts(path, module) or _gpt_oss_experts(path, module)
        if block is not None:
            found.append(block)
    return tuple(found)


def _gelu_moe(path: str, module: torch.nn.Module) -> MoEBlock | None:
    """``examples/moe.py``'s ``MoE`` by structure (see the module docstring)."""
    router = getattr(module, "router", None)
    experts = getattr(module, "experts", None)
    w_in, w_out = getattr(experts, "w_in", None), getattr(experts, "w_out", None)
    top_k, capacity_factor = getattr(module, "top_k", None), getattr(module, "capacity_factor", None)
    if not (isinstance(router, torch.nn.Linear) and router.bias is None):
        return None
    if not (isinstance(w_in, torch.nn.Parameter) and isinstance(w_out, torch.nn.Parameter)):
        return None
    if w_in.dim() != 3 or w_out.dim() != 3 or not isinstance(top_k, int) or not isinstance(capacity_factor, (int, float)):
        return None
    count, hidden, ffn = w_in.shape
    if tuple(w_out.shape) != (count, ffn, hidden) or tuple(router.weight.shape) != (count, hidden):
        return None
    return MoEBlock(
        module=path,
        experts=count,
        top_k=top_k,
        capacity_factor=float(capacity_factor),
        hidden=hidden,
        ffn=ffn,
        matmuls=2,
        router="router.weight",
        expert_weights=("experts.w_in", "experts.w_out"),
        kind="top-k GELU experts (examples/moe.py's MoE)",
    )


def _hf_stacked_experts(path: str, module: torch.nn.Module) -> MoEBlock | None:
    """A HuggingFace sparse MoE block with stacked SwiGLU experts (see the module docstring)."""
    gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
    router, top_k = getattr(gate, "weight", None), getattr(gate, "top_k", None)
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not all(isinstance(p, torch.nn.Parameter) for p in (router, gate_up, down)) or not isinstance(top_k, int):
        return None
    layout = {name: getattr(experts, name, None) for name in ("is_concatenated", "has_gate", "is_transposed", "has_bias")}
    if layout != {"is_concatenated": True, "has_gate": True, "is_transposed": False, "has_bias": False}:
        return None  # another storage of the weights than the one the runtime reads
    if router.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        return None
    count, hidden = router.shape
    ffn = down.shape[2]
    if tuple(gate_up.shape) != (count, 2 * ffn, hidden) or tuple(down.shape) != (count, hidden, ffn):
        return None
    return _dropless_swiglu(path, count, top_k, hidden, ffn, "gate.weight", ("experts.gate_up_proj", "experts.down_proj"),
                            f"HuggingFace stacked SwiGLU experts ({type(module).__name__}, dropless)",
                            _routing_groups(gate, count))


def _dropless_swiglu(path: str, count: int, top_k: int, hidden: int, ffn: int, router: str,
                     expert_weights: tuple[str, ...], kind: str, routing_groups: tuple[int, ...] = ()) -> MoEBlock:
    """A HuggingFace block whose own router picks ``top_k`` of ``count`` SwiGLU experts,
    dropless; its experts are what compiled programs replace. A SwiGLU expert costs three
    ``hidden x ffn`` matmuls (gate, up, down; gpt-oss's biases are adds)."""
    return MoEBlock(module=path, experts=count, top_k=min(top_k, count), capacity_factor=0.0, hidden=hidden, ffn=ffn,
                    matmuls=3, router=router, expert_weights=expert_weights, kind=kind, runtime=HF_STACKED_EXPERTS,
                    routing_groups=routing_groups)


# The storage HuggingFace's experts declare (``use_experts_implementation``) for gpt-oss:
# gate and up columns interleaved, weights (in, out), a bias per projection.
_GPT_OSS_STORAGE = {"is_concatenated": False, "has_gate": True, "is_transposed": True, "has_bias": True}


def _gpt_oss_experts(path: str, module: torch.nn.Module) -> MoEBlock | None:
    """gpt-oss's MoE block: biased router, transposed biased experts with a clamped SwiGLU
    (see the module docstring)."""
    router, experts = getattr(module, "router", None), getattr(module, "experts", None)
    weight, bias, top_k = (getattr(router, name, None) for name in ("weight", "bias", "top_k"))
    names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    stacked = [getattr(experts, name, None) for name in names]
    if not all(isinstance(p, torch.nn.Parameter) for p in (weight, bias, *stacked)) or not isinstance(top_k, int):
        return None
    if {name: getattr(experts, name, None) for name in _GPT_OSS_STORAGE} != _GPT_OSS_STORAGE:
        return None
    if not all(isinstance(getattr(experts, name, None), (int, float)) for name in ("alpha", "limit")):
        return None  # the clamped SwiGLU's constants the runtime reads
    if weight.dim() != 2:
        return None
    count, hidden = weight.shape
    down = stacked[2]
    ffn = down.shape[1] if down.dim() == 3 else -1
    shapes = [tuple(p.shape) for p in (bias, *stacked)]
    if shapes != [(count,), (count, hidden, 2 * ffn), (count, 2 * ffn), (count, ffn, hidden), (count, hidden)]:
        return None
    return _dropless_swiglu(path, count, top_k, hidden, ffn, "router.weight", tuple(f"experts.{name}" for name in names),
                            f"gpt-oss biased experts with a clamped SwiGLU ({type(module).__name__}, dropless)")


def _routing_groups(gate: torch.nn.Module, experts: int) -> tuple[int, ...]:
    """(groups, groups per token) of a HuggingFace router that limits each token to some
    groups of experts (DeepSeek-V3's ``DeepseekV3TopkRouter``: ``num_group`` and
    ``topk_group``, from the config's ``n_group``/``topk_group``); () when it does not, or
    when the limit excludes no expert (one group, or every group chosen)."""
    groups, chosen = getattr(gate, "num_group", None), getattr(gate, "topk_group", None)
    if not (isinstance(groups, int) and isinstance(chosen, int)) or not 1 <= chosen < groups or experts % groups:
        return ()
    return (groups, chosen)
