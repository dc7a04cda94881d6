"""Which kernels run an MoE layer's expert GEMMs (``Plan.expert_implementation``).

The cost of an MoE layer's experts depends on how the program launches their GEMMs, not only
on their FLOPs, so a plan names the implementation its simulation prices:

- ``te_grouped_gemm``: Transformer Engine's ``GroupedLinear``, as Megatron-Core runs the
  experts (one cuBLAS GEMM per local expert, round-robin on four streams, a launch each;
  ``cost_model.grouped_gemm``). Compiled programs do not run it: a plan naming it is for
  simulating Megatron-Core's runs (``benchmarks/fidelity_runs_moe.py``), and ``planner
  compile`` refuses it.
- ``torch_bmm``: one ``torch.bmm`` over the local experts' buffers, each padded to the
  expert's capacity (``codegen.runtime.moe.gelu_experts``, ``codegen.runtime.moe_modes``):
  what compiled programs run for ``examples/moe.py``'s routed GELU layers, in every mode.
- ``per_expert_loop``: a Python loop of one GEMM per local expert and projection on one
  stream, on the rows that expert received (``codegen.runtime.expert_dispatch.
  ExpertParallelExperts``): what compiled programs run for HuggingFace stacked experts laid
  out expert parallel (also folded, and in pipeline stages).
- ``model_experts``: the model's own experts module, left as the model wrote it: compiled
  programs keep a HuggingFace block's experts so when the layer is data parallel.

Empty (the default): per layer, what the compiled program runs for it
(``emitted_expert_kernel``), which is also what ``codegen`` branches on to write the layer:
one decision, read by the simulator and the compiler alike.
"""

from __future__ import annotations

from planner.moe_blocks import HF_STACKED_EXPERTS

TE_GROUPED_GEMM = "te_grouped_gemm"
BATCHED_MATMUL = "torch_bmm"
PER_EXPERT_LOOP = "per_expert_loop"
MODEL_EXPERTS = "model_experts"
# The values of ``Plan.expert_implementation``; "" is each layer's compiled kernel.
EXPERT_IMPLEMENTATIONS = ("", TE_GROUPED_GEMM, BATCHED_MATMUL, PER_EXPERT_LOOP, MODEL_EXPERTS)
# The ones compiled programs run (``emitted_expert_kernel`` gives one of them).
COMPILED_EXPERT_KERNELS = (BATCHED_MATMUL, PER_EXPERT_LOOP, MODEL_EXPERTS)


def emitted_expert_kernel(runtime: str, mode: str) -> str:
    """The kernel a compiled program runs the experts of a layer with: ``runtime`` is the
    block's ``planner.moe_blocks.MoEBlock.runtime``, ``mode`` its layout's mode.

    A routed GELU layer is replaced whole by a runtime layer whose experts are one batched
    matmul over capacity-padded buffers in every mode; a HuggingFace block keeps its router
    and, expert parallel (or expert sliced, which compiled programs refuse for such blocks),
    has its experts replaced by a loop over the local experts; data parallel, its experts
    module is left as the model wrote it."""
    if runtime != HF_STACKED_EXPERTS:
        return BATCHED_MATMUL
    return MODEL_EXPERTS if mode == "data_parallel" else PER_EXPERT_LOOP


def expert_kernel(implementation: str, runtime: str, mode: str) -> str:
    """The kernel a plan whose ``expert_implementation`` is ``implementation`` prices a layer
    (of block runtime ``runtime``, layout mode ``mode``) with: the named one, or where the
    field is empty the compiled program's (``emitted_expert_kernel``)."""
    return implementation or emitted_expert_kernel(runtime, mode)
