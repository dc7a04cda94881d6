"""The kernel facts the simulator assumes, measured: bf16 GEMMs of 7B-70B layers, fused
attention at 2k-8k tokens, memory-bound ops (norms, SwiGLU, AdamW foreach and fused) and
the per-kernel launch overhead, each beside the simulator's own prediction.

Predictions come from the cost model exactly as a plan's simulation gets them: each
measured module is traced on meta tensors by the planner's tracer and every traced op is
priced by ``cost_model.compute.op_times`` (which uses ``cost_model.gpu_kernels``' tile and
FlashAttention model on known GPUs, the roofline elsewhere); AdamW by
``compute.optimizer_step_time``; launches by the device's kernel overhead
(``compute.efficiencies``). The modules run in bf16 on the device, forward without autograd
and backward as ``torch.autograd.grad`` (no gradient accumulation kernel), each in a loop of
``measure_s`` seconds after ``warm_s`` of warm-up (on a GPU, seconds: clocks settle under
the power cap before the figure is taken).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from cost_model.compute import efficiencies, op_times, optimizer_step_time
from cost_model.gpu_kernels import ATTENTION_BACKWARD_TO_FORWARD
from planner.cluster import DeviceSpec
from planner.trace import trace

PRECISION = "bf16"  # the simulator's precision for every kernel item (the measurements behind it are bf16)


@dataclass(frozen=True)
class Timing:
    """How long each measurement loops: ``warm_s`` first (discarded), then ``measure_s``;
    ``settle_s`` once per section before its first item (clocks reach their sustained level)."""

    warm_s: float
    measure_s: float
    settle_s: float


GPU_TIMING = Timing(warm_s=0.3, measure_s=1.5, settle_s=3.0)
DRY_TIMING = Timing(warm_s=0.005, measure_s=0.02, settle_s=0.0)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sustained_s(run: Callable[[], Any], device: torch.device, warm_s: float, measure_s: float) -> tuple[float, int]:
    """Seconds per call of ``run`` sustained over ``measure_s``, after ``warm_s`` of calls in
    doubling batches (which also estimate how many calls ``measure_s`` takes). Returns the
    seconds per call and the calls timed."""
    calls, start = 1, time.perf_counter()
    while True:
        begin = time.perf_counter()
        for _ in range(calls):
            run()
        synchronize(device)
        batch = time.perf_counter() - begin
        if time.perf_counter() - start >= warm_s:
            break
        if batch < warm_s / 8:
            calls *= 2
    per_call = max(batch / calls, 1e-9)
    timed = max(3, math.ceil(measure_s / per_call))
    synchronize(device)
    begin = time.perf_counter()
    for _ in range(timed):
        run()
    synchronize(device)
    return (time.perf_counter() - begin) / timed, timed


# ---------------------------------------------------------------- the measured modules


class Linear(nn.Module):
    """One GEMM as ``nn.Linear`` issues it: (tokens x in) @ (in x out)."""

    def __init__(self, tokens: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features) * in_features ** -0.5)
        self.input_shapes = [(tokens, in_features)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Attention(nn.Module):
    """PyTorch's fused attention (FlashAttention on GPUs) over (batch, heads, seq, head dim)."""

    def __init__(self, batch: int, heads: int, seq: int, head_dim: int, causal: bool) -> None:
        super().__init__()
        self.causal = causal
        self.input_shapes = [(batch, heads, seq, head_dim)] * 3

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


class LlamaRMSNorm(nn.Module):
    """RMSNorm as HuggingFace's Llama writes it (eager ops, variance in fp32)."""

    def __init__(self, tokens: int, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps
        self.input_shapes = [(tokens, hidden)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Normalised(nn.Module):
    """A torch norm module (``nn.LayerNorm``, ``nn.RMSNorm``) over (tokens, hidden)."""

    def __init__(self, norm: type[nn.Module], tokens: int, hidden: int) -> None:
        super().__init__()
        self.norm = norm(hidden)
        self.input_shapes = [(tokens, hidden)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


class SwiGLU(nn.Module):
    """The gate of a SwiGLU MLP, silu(gate) * up, over (tokens, ffn)."""

    def __init__(self, tokens: int, ffn: int) -> None:
        super().__init__()
        self.input_shapes = [(tokens, ffn)] * 2

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


# ---------------------------------------------------------------------- the items


@dataclass(frozen=True)
class ModuleItem:
    """One module measured forward and backward: ``build()`` makes it (on the current
    default device), ``flops`` is its forward's useful FLOPs (0 when memory-bound) and
    ``backward_flops`` its backward's over its forward's."""

    name: str
    build: Callable[[], nn.Module]
    flops: float = 0.0
    backward_flops: float = 2.0  # a GEMM's input and weight gradients
    note: str = ""


def layer_shapes(dry_run: bool) -> list[tuple[str, int, int, int, int]]:
    """(model, hidden, ffn, heads, kv heads) of the layers whose GEMMs are measured: Llama 2
    7B and 13B, Llama 3 70B (their published configs); tiny stand-ins on a dry run."""
    shapes = [("7B", 4096, 11008, 32, 32), ("13B", 5120, 13824, 40, 40), ("70B", 8192, 28672, 64, 8)]
    if dry_run:
        return [(name, hidden // 64, ffn // 64, heads // 8 or 1, kv // 8 or 1) for name, hidden, ffn, heads, kv in shapes[::2]]
    return shapes


def gemm_items(dry_run: bool) -> list[ModuleItem]:
    """The forward GEMMs of a layer (fused QKV, attention output, MLP up, MLP down) over
    4096 tokens (64 on a dry run); backward is the input and weight gradients."""
    tokens = 64 if dry_run else 4096
    items = []
    for model, hidden, ffn, heads, kv in layer_shapes(dry_run):
        qkv = hidden + 2 * kv * (hidden // heads)
        for op, out_features, in_features in (("qkv", qkv, hidden), ("o", hidden, hidden), ("up", ffn, hidden),
                                              ("down", hidden, ffn)):
            items.append(ModuleItem(
                f"{model} {op} {tokens}x{out_features}x{in_features}",
                lambda t=tokens, o=out_features, i=in_features: Linear(t, o, i),
                flops=2.0 * tokens * out_features * in_features,
            ))
    return items


def attention_items(dry_run: bool) -> list[ModuleItem]:
    """Fused attention, head dim 128 and 32 heads (a 7B layer), 16k tokens per call at 2k,
    4k and 8k sequence, causal and not (dry run: 2 heads of 16 at 64 and 128 tokens)."""
    heads, head_dim, tokens = (2, 16, 256) if dry_run else (32, 128, 16384)
    items = []
    for seq in ((64, 128) if dry_run else (2048, 4096, 8192)):
        batch = max(1, tokens // seq)
        for causal in (True, False):
            flops = 4.0 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
            items.append(ModuleItem(
                f"sdpa b{batch} h{heads} s{seq} d{head_dim}{' causal' if causal else ''}",
                lambda b=batch, s=seq, c=causal: Attention(b, heads, s, head_dim, c), flops=flops,
                backward_flops=ATTENTION_BACKWARD_TO_FORWARD,
            ))
    return items


def memory_items(dry_run: bool) -> list[ModuleItem]:
    """Norms over (4096 tokens x 8192), a 70B layer's width, and SwiGLU over its FFN width
    (28672); tiny on a dry run."""
    tokens, hidden, ffn = (64, 128, 448) if dry_run else (4096, 8192, 28672)
    return [
        ModuleItem(f"layer_norm {tokens}x{hidden}", lambda: Normalised(nn.LayerNorm, tokens, hidden)),
        ModuleItem(f"rms_norm {tokens}x{hidden}", lambda: Normalised(nn.RMSNorm, tokens, hidden),
                   note="nn.RMSNorm"),
        ModuleItem(f"llama rms_norm {tokens}x{hidden}", lambda: LlamaRMSNorm(tokens, hidden),
                   note="HF Llama's eager ops"),
        ModuleItem(f"swiglu {tokens}x{ffn}", lambda: SwiGLU(tokens, ffn)),
    ]


# ------------------------------------------------------------------ measure, predict


def predicted_times(item: ModuleItem, device_spec: DeviceSpec) -> tuple[float, float, int]:
    """(forward s, backward s, traced ops) the simulator charges ``item``'s module: the
    module traced on meta tensors, each op priced by ``cost_model.compute.op_times``."""
    with torch.device("meta"):
        module = item.build()
        inputs = tuple(torch.empty(shape) for shape in module.input_shapes)
    graph = trace(module, inputs)
    forward = backward = 0.0
    for node in graph.nodes:
        node_forward, node_backward = op_times(node, 1.0, device_spec, PRECISION)
        forward, backward = forward + node_forward, backward + node_backward
    return forward, backward, sum(1 for node in graph.nodes if not node.is_view)


def measured_times(item: ModuleItem, device: torch.device, timing: Timing) -> tuple[float, float]:
    """(forward s, backward s) of ``item``'s module in bf16 on ``device``."""
    with torch.device(device):
        module = item.build().to(torch.bfloat16)
        inputs = [torch.randn(shape, dtype=torch.bfloat16, requires_grad=True) for shape in module.input_shapes]

    def forward() -> None:
        with torch.no_grad():
            module(*inputs)

    forward_s, _ = sustained_s(forward, device, timing.warm_s, timing.measure_s)
    output = module(*inputs)
    gradient = torch.randn_like(output)
    wrt = [*inputs, *module.parameters()]

    def backward() -> None:
        torch.autograd.grad(output, wrt, gradient, retain_graph=True)

    backward_s, _ = sustained_s(backward, device, timing.warm_s, timing.measure_s)
    return forward_s, backward_s


def module_results(item: ModuleItem, device: torch.device, device_spec: DeviceSpec, timing: Timing) -> list[dict[str, Any]]:
    """Two result rows for ``item``: forward and backward, measured beside predicted."""
    predicted_forward, predicted_backward, ops = predicted_times(item, device_spec)
    measured_forward, measured_backward = measured_times(item, device, timing)
    rows = []
    for part, predicted, measured, flop_factor in (("fwd", predicted_forward, measured_forward, 1.0),
                                                    ("bwd", predicted_backward, measured_backward, item.backward_flops)):
        row: dict[str, Any] = {"name": f"{item.name} {part}", "predicted_s": predicted, "measured_s": measured,
                               "traced_ops": ops}
        notes = [item.note] if item.note else []
        if item.flops:
            flops = item.flops * flop_factor
            row["measured_tflops"], row["predicted_tflops"] = flops / measured / 1e12, flops / predicted / 1e12
            notes.append(f"{row['measured_tflops']:.3g} TFLOP/s measured, {row['predicted_tflops']:.3g} predicted")
        row["note"] = "; ".join(notes)
        rows.append(row)
    return rows


def adamw_results(implementation: str, dry_run: bool, device: torch.device, device_spec: DeviceSpec,
                  timing: Timing) -> dict[str, Any]:
    """One AdamW step (``foreach`` or ``fused``) over the weights of a 7B layer (a tiny one
    on a dry run) in fp32, against ``compute.optimizer_step_time``."""
    _, hidden, ffn, _, _ = layer_shapes(dry_run)[0]
    shapes = [(hidden, hidden)] * 4 + [(ffn, hidden), (ffn, hidden), (hidden, ffn), (hidden,), (hidden,)]
    with torch.device(device):
        parameters = [nn.Parameter(torch.randn(shape)) for shape in shapes]
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter)
    optimizer = torch.optim.AdamW(parameters, lr=1e-4, **{implementation: True})
    measured, _ = sustained_s(optimizer.step, device, timing.warm_s, timing.measure_s)
    elements = sum(parameter.numel() for parameter in parameters)
    state_bytes = elements * 16  # fp32 weight, gradient and AdamW's two states
    predicted = optimizer_step_time(state_bytes, device_spec, implementation, tensors=len(parameters))
    # Compiled programs build torch.optim.AdamW with its defaults, which on CUDA is foreach,
    # and a simulated GPU step prices that (cost_model.compute.optimizer_implementation);
    # fused is what other systems' rows of benchmarks/fidelity.py name.
    which = ("what compiled programs run on CUDA, and their simulated step prices" if implementation == "foreach"
             else "what Megatron-LM's and DeepSpeed's rows of benchmarks/fidelity.py price")
    return {"name": f"adamw {implementation} {elements:,} params", "predicted_s": predicted, "measured_s": measured,
            "note": f"{state_bytes / measured / 1e9:.3g} GB/s of state measured; {which}"}


def launch_results(device: torch.device, device_spec: DeviceSpec, timing: Timing) -> list[dict[str, Any]]:
    """The cost of one tiny kernel: issued back to back (what a host-bound step pays per op)
    and one at a time with a synchronisation (launch latency), against the simulator's
    per-kernel overhead."""
    with torch.device(device):
        tiny = torch.zeros(1)
    overhead = efficiencies(device_spec)[2]

    def issued() -> None:
        tiny.add_(1.0)

    def synchronised() -> None:
        tiny.add_(1.0)
        synchronize(device)

    back_to_back, _ = sustained_s(issued, device, timing.warm_s, timing.measure_s)
    round_trip, _ = sustained_s(synchronised, device, timing.warm_s, timing.measure_s)
    return [
        {"name": "tiny op, back to back", "predicted_s": overhead, "measured_s": back_to_back,
         "note": "host dispatch + launch per op"},
        {"name": "tiny op + synchronize", "predicted_s": overhead, "measured_s": round_trip,
         "note": "launch latency round trip"},
    ]


def settle(device: torch.device, seconds: float) -> None:
    """Keep the device busy with large GEMMs for ``seconds`` so clocks and power reach their
    sustained state before a section's first figure."""
    if seconds <= 0 or device.type != "cuda":
        return
    with torch.device(device):
        a = torch.randn(8192, 8192, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(8):
            a @ a
        synchronize(device)


__all__ = ["Timing", "GPU_TIMING", "DRY_TIMING", "ModuleItem", "gemm_items", "attention_items", "memory_items",
           "module_results", "adamw_results", "launch_results", "predicted_times", "measured_times", "settle",
           "sustained_s", "layer_shapes"]
