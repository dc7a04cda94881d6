"""The experts' GEMMs of one MoE layer as Transformer Engine's grouped GEMM runs them.

Megatron-Core runs an expert-parallel rank's local experts with Transformer Engine's
``GroupedLinear`` (``TEGroupedMLP``; ``--moe-grouped-gemm``): the tokens a rank received are
split by local expert (``torch.split(inp, m_splits)``) and every projection is one
``general_grouped_gemm`` call (NVIDIA/TransformerEngine at cd37379d24f5, 2025-05-27, the main
branch the day the Megatron MoE model zoo published its first Qwen3 rows:
transformer_engine/pytorch/module/grouped_linear.py, forward and backward). That call is not
one kernel: ``nvte_multi_stream_cublas_gemm`` (transformer_engine/common/gemm/cublaslt_gemm.cu,
same commit) loops over the experts and launches one cuBLAS GEMM per expert, round-robin on
``num_streams`` compute streams (transformer_engine/common/include/transformer_engine/gemm.h:
``constexpr int num_streams = 4``), then joins them. Per projection and pass, so:

  * forward: ``E`` GEMMs of (rows x K) @ (K x N), rows being one expert's routed copies;
  * backward: ``E`` input-gradient GEMMs (rows x N) @ (N x K) and ``E`` weight-gradient GEMMs
    (K x rows) @ (rows x N), whose reduction is the expert's rows;

with ``E`` the rank's local experts, K x N = hidden x (matmuls - 1) ffn for the first
projection (SwiGLU's gate and up fused, or a GELU MLP's up) and ffn x hidden for the second.

Priced here with ``cost_model.gpu_kernels``' shape model: up to four GEMMs (one per stream) run
at once and share the SMs, so each projection's GEMMs are timed as a batch of
``min(E, 4)`` for tile and wave quantisation; each GEMM is a launch and pays the device's
launch overhead (``cost_model.compute.efficiencies``: ``defaults.KERNEL_OVERHEAD_S`` unless the
device states its own), as every kernel of the simulator does. A rank with 16 local
experts and 512 rows each (TP4 EP8 with 1,024 tokens a rank, top-8) thus runs 96 GEMMs a pass
whose weight gradients reduce over 512 rows; one with 4 experts of 4,096 rows (EP32), 24 GEMMs
at the large-GEMM fraction. Before, the experts were one roofline kernel at the best-shape
fraction whatever their shape (``cost_model.moe``).

The host issues those GEMMs one by one (the loop above runs on the CPU), so it spends a
launch on each as the device does: ``expert_gemm_launches`` counts them (for any of the kernels
below), and the MoE layer's anchor op charges the host that many launches beside its own op
(``cost_model.node_costs``, ``cost_model.moe_layers.LaidOutLayer.expert_launches``), which binds
where the GEMMs are shorter than their issue, and after the dispatch's host sync
(``cost_model.host_syncs``).

Not modelled: the rows of each expert are the busiest device's mean (its copies over its
experts); a micro-batch's per-expert counts scatter around it, so their tile counts do too.
And the host's work beyond the launch: at that commit each per-expert GEMM also builds its
cuBLASLt descriptors and queries ``cublasLtMatmulAlgoGetHeuristic`` (cublaslt_gemm.cu,
``cublas_gemm``) before it launches, host time no public measurement found for H100 hosts
prices (``docs/fidelity_log.md``, session 14); only the simulator's launch cost is charged.

The planner's own compiled programs run experts otherwise (``planner.expert_kernels``, the
plan's ``expert_implementation``), and each is priced as it runs:

  * ``torch_bmm`` (``codegen/runtime/moe.py``'s ``gelu_experts``, ``moe_modes.py``): per
    projection and pass one batched GEMM over the ``E`` local experts' buffers, each padded to
    the capacity (the caller gives those padded rows): the shape model's batch of ``E``
    (all of them share one kernel's waves) and one launch. Its backward, as autograd runs
    ``bmm``'s: one batched input-gradient GEMM and one batched weight-gradient GEMM.
  * ``per_expert_loop`` (``codegen/runtime/expert_dispatch.py``, HuggingFace experts): ``E``
    GEMMs one after another on one stream, each alone on the GPU (a batch of one), a launch each.

``model_experts`` (a HuggingFace block left as the model wrote it) has no price here: the
caller keeps its roofline (transformers runs it with ``torch._grouped_mm`` where that
dispatches, an eager loop elsewhere; neither is modelled).

Applies on a GPU of known generation in 16-bit precision (the shape model's measurements are
bf16); elsewhere ``expert_gemm_times`` returns None and the caller keeps its roofline.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_model import defaults
from cost_model.compute import efficiencies
from cost_model.gpu_kernels import SIXTEEN_BIT, GpuGeneration, generation_of
from planner.cluster import DeviceSpec
from planner.expert_kernels import BATCHED_MATMUL, PER_EXPERT_LOOP, TE_GROUPED_GEMM

# Compute streams Transformer Engine's grouped GEMM launches its per-expert GEMMs on
# (transformer_engine/common/include/transformer_engine/gemm.h at cd37379d24f5:
# ``constexpr int num_streams = 4``; cublaslt_gemm.cu's loop uses stream ``i % num_streams``).
GROUPED_GEMM_STREAMS = 4


@dataclass(frozen=True)
class ExpertShape:
    """One rank's experts for one pass: ``local_experts`` experts of ``rows`` routed copies each
    (fractional: an average), ``hidden`` wide, ``ffn`` the hidden width of the expert (already
    divided by ETP where the experts are sliced), ``matmuls`` per expert (3 SwiGLU, 2 GELU)."""

    local_experts: int
    rows: float
    hidden: int
    ffn: float
    matmuls: int

    def projections(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """(K, N) of the first and second projection of one expert."""
        return (self.hidden, (self.matmuls - 1) * self.ffn), (self.ffn, self.hidden)


def call_concurrency(implementation: str, gemms: int) -> int:
    """GEMMs of one projection's call that share the SMs at once: ``GROUPED_GEMM_STREAMS`` for
    Transformer Engine, all of them for one ``bmm``, one for a loop."""
    return {TE_GROUPED_GEMM: min(gemms, GROUPED_GEMM_STREAMS), BATCHED_MATMUL: gemms,
            PER_EXPERT_LOOP: 1}[implementation]


def call_launches(implementation: str, gemms: int) -> int:
    """Kernels one projection's call of ``gemms`` expert GEMMs launches: one ``bmm``, else one per GEMM."""
    return 1 if implementation == BATCHED_MATMUL else gemms


def expert_gemm_call_time(implementation: str, gemms: int, m: float, n: float, k: float, device: DeviceSpec,
                          dtype: str, element_bytes: int, generation: GpuGeneration) -> float:
    """Seconds for one projection's ``gemms`` GEMMs (m x k) @ (k x n), one per local expert,
    as ``implementation`` runs them (module docstring): the GEMMs sharing the SMs at once
    (``GROUPED_GEMM_STREAMS`` of them for Transformer Engine, all for one ``bmm``, one for a
    loop) set the shape model's batch; every kernel pays a launch (one ``bmm``, else one per GEMM)."""
    if gemms <= 0 or min(m, n, k) <= 0:
        return 0.0
    concurrent, launches = call_concurrency(implementation, gemms), call_launches(implementation, gemms)
    efficiency = generation.matmul_efficiency(concurrent, m, n, k)
    compute = 2.0 * gemms * m * n * k / (device.flops_for(dtype) * efficiency)
    moved = element_bytes * gemms * (m * k + k * n + m * n)
    memory = moved / (device.memory_bandwidth * defaults.MEMORY_EFFICIENCY)
    return max(compute, memory) + launches * efficiencies(device, dtype)[2]


def expert_gemm_launches(shape: ExpertShape | None, implementation: str) -> tuple[int, int]:
    """(forward, backward) kernels the host launches for ``shape``'s expert GEMMs a pass as
    ``implementation`` runs them (as ``expert_gemm_times`` counts them: a call per projection
    forward, two backward); (0, 0) where the experts are not priced here."""
    if shape is None or shape.local_experts <= 0 or implementation not in (TE_GROUPED_GEMM, BATCHED_MATMUL,
                                                                           PER_EXPERT_LOOP):
        return 0, 0
    per_call = call_launches(implementation, shape.local_experts)
    return 2 * per_call, 4 * per_call


def expert_gemm_times(shape: ExpertShape, implementation: str, device: DeviceSpec, dtype: str,
                      element_bytes: int) -> tuple[float, float] | None:
    """(forward, backward) seconds of ``shape``'s expert GEMMs as ``implementation``
    (``planner.expert_kernels``) runs them (module docstring), or None where none of these
    prices applies (``model_experts``, not a GPU of known generation, or not 16-bit): the
    caller keeps its roofline there."""
    generation = generation_of(device)
    if implementation not in (TE_GROUPED_GEMM, BATCHED_MATMUL, PER_EXPERT_LOOP):
        return None
    if generation is None or dtype not in SIXTEEN_BIT:
        return None
    if shape.local_experts <= 0 or shape.rows <= 0:
        return 0.0, 0.0
    forward = backward = 0.0
    for k, n in shape.projections():
        def call(m: float, n_: float, k_: float) -> float:
            return expert_gemm_call_time(implementation, shape.local_experts, m, n_, k_, device, dtype,
                                         element_bytes, generation)
        forward += call(shape.rows, n, k)
        # Input gradient (rows x N) @ (N x K), weight gradient (K x rows) @ (rows x N).
        backward += call(shape.rows, k, n) + call(k, n, shape.rows)
    return forward, backward

