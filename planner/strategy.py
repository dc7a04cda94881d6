"""Strategy vocabulary: meshes, placements, per-node strategies and their cost parts.

Placements are PyTorch DTensor's own ``Shard``, ``Replicate`` and ``Partial`` (frozen,
hashable, printed ``S(0)``, ``R``, ``P``). A tensor's sharding is a tuple with one placement
per mesh axis, DTensor's convention. Everything validates itself at construction; JSON
conversion lives at the edges (``to_dict``/``from_dict``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from planner.errors import PlanFileError, one_line
from planner.cost_parts import CostParts  # re-exported: the vocabulary's
from planner.expert_layouts import (  # re-exported: the vocabulary's
    ALL_TO_ALL_ALGORITHMS,
    EXPERT_COPIES_AXIS,
    EXPERT_MODE_WORDS,
    EXPERT_MODES,
    ExpertLayout,
    ExpertPlacement,
    FOLDED_DP_TP,
    expert_axes,
    expert_axis_size,
    expert_modes_summary,
)
from planner.summa_types import SUMMA_AXES, SUMMA_FAMILIES, SummaLayout  # re-exported: the vocabulary's

Placements = tuple[Placement, ...]

DP_FLAVOURS = ("ddp", "zero1", "zero2", "fsdp")
# Activation recomputation of the repeated blocks (``cost_model.recompute`` prices each), in
# order of how much a block recomputes. ``full_keep_a2a`` is full recomputation for MoE
# blocks that keeps what crossed the network: the block runs its forward again in backward,
# but each MoE layer's exchanges (the dispatch and combine all-to-alls, the routing counts'
# all-gather) hand back the outputs kept from forward instead of communicating again
# (``codegen.runtime.kept_exchanges``). In a block without MoE layer it is ``full``.
KEEP_A2A = "full_keep_a2a"
# Megatron-Core's ``--recompute-granularity selective --recompute-modules layernorm moe_act``
# (NVIDIA/Megatron-LM megatron/core/transformer/transformer_config.py, ``recompute_modules``:
# "layernorm": the input_layernorm and pre_mlp_layernorm; "moe_act": the MoE MLP activation
# function; both "use output-discarding checkpointing"): each block's own norms keep only
# their input and the experts' activation function only its input, both run again in
# backward (``cost_model.recompute``). Priced, not compiled (``planner.api``).
NORMS_MOE_ACT = "norms_moe_act"
RECOMPUTE_MODES = ("none", NORMS_MOE_ACT, "selective", KEEP_A2A, "full")
# The modes that checkpoint whole blocks (keep the block's input, run its forward again).
WHOLE_BLOCK_RECOMPUTE = (KEEP_A2A, "full")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved")
# The schedules a plan may name: the compiled ones above and DeepSeek-V3's DualPipe, which the
# pipeline search and the simulator price (``cost_model.dualpipe_step``) and compile refuses.
DUALPIPE = "dualpipe"
PLAN_SCHEDULES = (*PIPELINE_SCHEDULES, DUALPIPE)
# How each micro-batch's weight gradients join the step's gradients (``PipelineConfig``).
GRADIENT_ACCUMULATION_MODES = ("in-gemm", "autograd", "fp32-copy")
# DeepSpeed's activation-checkpointing options, by the keys of its config's
# ``activation_checkpointing`` section (deepspeed/runtime/activation_checkpointing/config.py;
# Megatron-DeepSpeed's ``--partition-activations``, ``--contigious-checkpointing``,
# ``--synchronize-each-layer``, ``--profile-backward``): ``PipelineConfig.deepspeed_checkpointing``.
PARTITION_ACTIVATIONS = "partition_activations"
CONTIGUOUS_CHECKPOINTING = "contiguous_memory_optimization"
DEEPSPEED_CHECKPOINTING_OPTIONS = (PARTITION_ACTIVATIONS, CONTIGUOUS_CHECKPOINTING, "synchronize_checkpoint_boundary",
                                   "profile")

_SHARD = re.compile(r"^S\((\d+)\)$")
_PARTIAL = re.compile(r"^P(?:\((sum|avg|max|min)\))?$")


def placement_to_str(placement: Placement) -> str:
    """``Shard(1)`` -> ``"S(1)"``, ``Replicate()`` -> ``"R"``, ``Partial()`` -> ``"P"``."""
    if isinstance(placement, Shard):
        return f"S({placement.dim})"
    if isinstance(placement, Replicate):
        return "R"
    if isinstance(placement, Partial):
        return "P" if placement.reduce_op == "sum" else f"P({placement.reduce_op})"
    raise ValueError(f"unsupported placement {placement!r}")


def placement_from_str(text: str) -> Placement:
    """Inverse of ``placement_to_str``; raises ``ValueError`` on anything else."""
    if text == "R":
        return Replicate()
    if match := _SHARD.match(text):
        return Shard(int(match[1]))
    if match := _PARTIAL.match(text):
        return Partial(match[1] or "sum")
    raise ValueError(f"'{text}' is not a placement (expected S(<dim>), R, P or P(<op>))")


def placements_str(placements: Placements) -> str:
    """``(Shard(0), Replicate())`` -> ``"(S(0), R)"``."""
    return "(" + ", ".join(placement_to_str(p) for p in placements) + ")"


@dataclass(frozen=True)
class Mesh:
    """Named mesh axes over the cluster's ranks, outermost first.

    The innermost (last) axis maps to devices inside a node, so axes that talk most go last.
    ``Mesh((("dp", 16), ("tp", 8)))`` has 128 ranks; rank ``r`` has coordinate
    ``(r // 8, r % 8)``.
    """

    axes: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        names = [name for name, _ in self.axes]
        if not self.axes:
            raise ValueError("a mesh needs at least one axis, e.g. (('dp', 2),)")
        if len(set(names)) != len(names):
            raise ValueError(f"mesh axis names must be unique, got {names}")
        for name, size in self.axes:
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh axis '{name}' must have a positive integer size, got {size!r}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.axes)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis_size(self, name: str) -> int:
        return dict(self.axes)[name]

    def __str__(self) -> str:
        return " x ".join(f"{name}={size}" for name, size in self.axes)


@dataclass(frozen=True)
class NodeStrategy:
    """How one op of the graph runs on the mesh.

    Attributes:
        node: the OpGraph node name.
        op: the op (``"aten.mm.default"``), kept so a plan explains itself without the graph.
        module: module path that issued the op.
        inputs: placements of each tensor input (one placement per mesh axis).
        outputs: placements of each tensor output.
        params: placements of each parameter the op reads, by qualified name.
        layout: a non-sharding layout (SUMMA, experts), if any.
        stage: pipeline stage that runs the op.
        cost: predicted cost parts of this choice.
        produced: when set, what the op computes before its output is resharded into
            ``outputs`` (e.g. partial sums reduce-scattered into a sequence shard).
    """

    node: str
    op: str
    module: str
    inputs: tuple[Placements, ...]
    outputs: tuple[Placements, ...]
    params: Mapping[str, Placements] = field(default_factory=dict)
    layout: SummaLayout | ExpertLayout | None = None
    stage: int = 0
    cost: CostParts = CostParts()
    produced: tuple[Placements, ...] | None = None

    def replaced(self, **changes) -> "NodeStrategy":
        """``dataclasses.replace(self, **changes)``, several times faster: a strategy has
        nothing to validate, so its fields are copied rather than passed through
        ``__init__`` (searches copy hundreds of thousands: clones for repeated blocks,
        cost annotations of every simulated plan)."""
        unknown = set(changes) - set(self.__dataclass_fields__)
        if unknown:
            raise TypeError(f"NodeStrategy has no field(s) {', '.join(sorted(unknown))}")
        copy = object.__new__(NodeStrategy)
        copy.__dict__.update(self.__dict__)
        copy.__dict__.update(changes)
        return copy

    def describe(self) -> str:
        """``(S(0), R) -> (S(0))``-style summary of inputs and outputs."""
        ins = ", ".join(placements_str(p) for p in self.inputs)
        outs = ", ".join(placements_str(p) for p in self.outputs)
        return f"{ins} -> {outs}"


@dataclass(frozen=True)
class PipelineConfig:
    """Pipeline parallelism: stages over the ``pp`` mesh axis and the schedule that runs them.

    ``stage_recompute`` gives each stage module (``stages x virtual_stages`` of them, in the
    numbering of ``NodeStrategy.stage``) its own recomputation mode; empty when every stage
    recomputes as the plan's ``recompute`` says. Early stages of a 1F1B pipeline hold more
    micro-batches in flight than late ones, so they may need to recompute where later
    stages need not.

    ``blocking_p2p``: each send and its matching receive hold both stages' compute streams
    from when the later of the two reaches it until the transfer ends, as in DeepSpeed's
    pipeline engine (``deepspeed/runtime/pipe/p2p.py``: ``send`` asserts ``async_op == False``),
    in the order of DeepSpeed's ``TrainSchedule`` for a 1F1B schedule
    (``cost_model.deepspeed_pipeline``; other schedules: the send holds the sender's stream
    after the pass that produced it); False: sends run on their own streams beside the
    compute (Megatron-LM's overlapped p2p).

    ``partitioned_p2p``: a boundary tensor leaves each tensor-parallel rank as its 1/tp slice
    and the receiver all-gathers it over ``tp`` (DeepSpeed's pipeline engine with tensor
    parallelism, ``is_pipe_partitioned`` / ``is_grad_partitioned``; the sender also gathers its
    own output back before the backward that needs it); False: every rank sends the tensor it
    holds.

    ``gradient_accumulation``: how a micro-batch's weight gradients are added to the step's
    (``GRADIENT_ACCUMULATION_MODES``): ``"in-gemm"`` costs nothing beyond the weight-gradient
    GEMM (it writes into the accumulator: Megatron-LM's ``--gradient-accumulation-fusion``);
    ``"autograd"``: PyTorch's AccumulateGrad adds each new 16-bit gradient into ``param.grad``
    (DeepSpeed's fp16 pipeline engine); ``"fp32-copy"``: each micro-batch's 16-bit gradient is
    cast to fp32 and added into an fp32 buffer (DeepSpeed's ``BF16_Optimizer``). Costs in
    ``cost_model.compute.gradient_accumulation_time``.

    ``overlap_grad_reduce``: the data-parallel gradient reduction starts as the last
    micro-batch's backward fills each bucket (Megatron-LM's ``--overlap-grad-reduce``, DDP);
    False: it starts after that backward ends (DeepSpeed's pipeline engine runs its
    ``ReduceGrads`` instruction after the schedule's last step, deepspeed/runtime/pipe/schedule.py).

    ``block_overhead_s``: seconds each repeated block (a transformer layer) costs per
    micro-batch beyond its own kernels and collectives, forward, recomputation and backward
    together: a training engine's fixed per-layer cost, which does not grow with the layer's
    work. The step graph charges it on the compute stream, split between the block's forward
    and backward in proportion to their kernel time. 0 for the programs this planner
    compiles; ``benchmarks/fidelity_sweep.py`` measures it for Megatron-DeepSpeed of 2021-22.

    ``deepspeed_checkpointing``: the options of DeepSpeed's own activation checkpointing
    (``deepspeed.checkpointing``, which DeepSpeed's ``PipelineModule`` wraps each recomputed
    layer in) that the run turned on, among ``DEEPSPEED_CHECKPOINTING_OPTIONS``: what each
    recomputed block then does per micro-batch beyond its kernels (partitioning its input over
    tp and all-gathering it before the recomputation, copies, ``torch.cuda.synchronize()``) is
    priced in ``cost_model.deepspeed_checkpointing``. Empty: none (DeepSpeed's defaults, and
    every program this planner compiles).
    """

    stages: int
    schedule: str = "1f1b"
    micro_batches: int = 1
    virtual_stages: int = 1
    stage_recompute: tuple[str, ...] = ()
    blocking_p2p: bool = False
    partitioned_p2p: bool = False
    gradient_accumulation: str = "in-gemm"
    overlap_grad_reduce: bool = True
    block_overhead_s: float = 0.0
    deepspeed_checkpointing: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.schedule not in PLAN_SCHEDULES:
            raise ValueError(f"pipeline schedule must be one of {PLAN_SCHEDULES}, got '{self.schedule}'")
        if self.stages < 1 or self.micro_batches < 1 or self.virtual_stages < 1:
            raise ValueError("pipeline stages, micro_batches and virtual_stages must be >= 1")
        if self.schedule == DUALPIPE and (self.stages % 2 or self.micro_batches % 2 or self.virtual_stages != 1
                                          or self.micro_batches < 2 * self.stages):
            raise ValueError(f"a DualPipe pipeline needs an even number of stages, one virtual stage and an even number "
                             f"of micro-batches, at least twice the stages; got {self.stages} stages, "
                             f"{self.virtual_stages} virtual, {self.micro_batches} micro-batches")
        if not isinstance(self.blocking_p2p, bool):
            raise ValueError(f"pipeline blocking_p2p must be true or false, got {str(self.blocking_p2p)[:40]!r}")
        if not isinstance(self.partitioned_p2p, bool):
            raise ValueError(f"pipeline partitioned_p2p must be true or false, got {str(self.partitioned_p2p)[:40]!r}")
        if not isinstance(self.overlap_grad_reduce, bool):
            raise ValueError(f"pipeline overlap_grad_reduce must be true or false, got {str(self.overlap_grad_reduce)[:40]!r}")
        overhead = self.block_overhead_s
        if isinstance(overhead, bool) or not isinstance(overhead, (int, float)) or not 0 <= overhead < math.inf:
            raise ValueError(f"pipeline block_overhead_s must be a number of seconds >= 0, got {str(overhead)[:40]!r}")
        options = self.deepspeed_checkpointing
        if (not isinstance(options, tuple) or any(option not in DEEPSPEED_CHECKPOINTING_OPTIONS for option in options)
                or len(set(options)) != len(options)):
            raise ValueError(f"pipeline deepspeed_checkpointing must list distinct options among "
                             f"{', '.join(DEEPSPEED_CHECKPOINTING_OPTIONS)}, got {str(options)[:80]!r}")
        if CONTIGUOUS_CHECKPOINTING in options and PARTITION_ACTIVATIONS not in options:
            # deepspeed.checkpointing.configure asserts the same ("Contiguous Checkpointing is
            # only available with partitioned activations").
            raise ValueError(f"pipeline deepspeed_checkpointing: {CONTIGUOUS_CHECKPOINTING} needs "
                             f"{PARTITION_ACTIVATIONS} (DeepSpeed refuses it alone); add it or drop the first")
        if self.gradient_accumulation not in GRADIENT_ACCUMULATION_MODES:
            raise ValueError(f"pipeline gradient_accumulation must be one of {', '.join(GRADIENT_ACCUMULATION_MODES)}, "
                             f"got {str(self.gradient_accumulation)[:40]!r}")
        modes = self.stage_recompute
        if not isinstance(modes, tuple) or any(mode not in RECOMPUTE_MODES for mode in modes):
            raise ValueError(f"pipeline stage_recompute must list modes among {RECOMPUTE_MODES}, got {modes!r}")
        if modes and len(modes) != self.stages * self.virtual_stages:
            raise ValueError(
                f"pipeline stage_recompute has {len(modes)} modes but there are {self.stages * self.virtual_stages} "
                f"stage modules (stages x virtual_stages); give one mode per stage module"
            )


@dataclass(frozen=True)
class MemoryBreakdown:
    """Predicted bytes per device, by kind."""

    weights: int = 0
    gradients: int = 0
    optimizer_states: int = 0
    activations: int = 0
    communication_buffers: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer_states + self.activations + self.communication_buffers


class TimelineEvent(NamedTuple):
    """One task of a simulated step, for the Chrome/Perfetto trace (a tuple: cheap in bulk)."""

    device: str
    stream: str
    name: str
    start_s: float
    duration_s: float


@dataclass(frozen=True)
class SimResult:
    """Predicted behaviour of one training step of a plan.

    Attributes:
        step_time_s: one training step (forward, backward, optimizer) on the slowest device.
        compute_s: busy time of the busiest device's compute stream (collectives excluded).
        communication_s: exposed communication: how much longer the step is than the same
            schedule with every collective free.
        memory: bytes by kind on the fullest device (where ranks hold different amounts,
            uneven tensor shares: the rank nearest its own device's capacity).
        device_memory_bytes: capacity of the smallest device (or of that rank's device).
        method: ``"simulator"`` or ``"analytic"``.
        stage_memory: bytes by kind on a device of each pipeline stage.
        samples_per_s, tokens_per_s: throughput (tokens: samples x sequence length, 0 if
            the inputs have no sequence).
        model_flops: FLOPs of one step as Megatron-LM counts them for MFU: forward and
            backward matmuls (3x the forward's), attention scores and logits included,
            recomputation excluded.
        tflops_per_device: model_flops / step time / devices, in TFLOP/s.
        mfu: tflops_per_device over the device's dense peak for the plan's precision.
        bytes_per_axis: bytes each device sends per step, by mesh axis (and ``"pp"``).
        bubble_fraction: idle share of the compute stream in the pipeline schedule.
        host_wait_s: of ``compute_s``, the seconds the busiest device waits for the host to
            issue ops whose kernels are shorter than their dispatch (GPU clusters,
            ``cost_model.host_dispatch``; one wait per micro-batch and segment pass).
        timeline: the simulated tasks (not saved in plans); see ``to_chrome_trace``.
    """

    step_time_s: float
    compute_s: float
    communication_s: float
    memory: MemoryBreakdown
    device_memory_bytes: int
    method: str = "simulator"
    stage_memory: tuple[MemoryBreakdown, ...] = ()
    samples_per_s: float = 0.0
    tokens_per_s: float = 0.0
    model_flops: float = 0.0
    tflops_per_device: float = 0.0
    mfu: float = 0.0
    bytes_per_axis: Mapping[str, float] = field(default_factory=dict)
    bubble_fraction: float = 0.0
    host_wait_s: float = 0.0
    timeline: tuple[TimelineEvent, ...] = field(default=(), compare=False, repr=False)

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.device_memory_bytes

    def to_chrome_trace(self, path: str, *, force: bool = False) -> None:
        """Write the timeline as a Chrome trace (opens in Perfetto / chrome://tracing):
        one process per device, one thread per stream, times in microseconds. An existing
        file is replaced only when it is a trace soap-planner wrote, unless ``force``."""
        write_chrome_trace(self.timeline, path, force=force)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the timeline is not included)."""
        return {
            "step_time_s": self.step_time_s,
            "compute_s": self.compute_s,
            "communication_s": self.communication_s,
            "memory": vars(self.memory),
            "device_memory_bytes": self.device_memory_bytes,
            "method": self.method,
            "stage_memory": [vars(m) for m in self.stage_memory],
            "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "model_flops": self.model_flops,
            "tflops_per_device": self.tflops_per_device,
            "mfu": self.mfu,
            "bytes_per_axis": dict(self.bytes_per_axis),
            "bubble_fraction": self.bubble_fraction,
            "host_wait_s": self.host_wait_s,
        }


@dataclass(frozen=True)
class Alternative:
    """A runner-up plan, summarised for the report: its name, predicted step time, memory
    on the fullest device, whether it fits, why it lost to the chosen plan (``note``), its
    MFU, and its route (``planner.verdict.plan_route``: data parallel, Megatron grid,
    searched without pipeline; plans saved before the field was renamed call it ``family``)."""

    name: str
    step_time_s: float
    memory_bytes: int
    fits: bool
    note: str = ""
    mfu: float = 0.0
    route: str = ""

    def __post_init__(self) -> None:
        # A plan file's runners-up are rendered into the report: wrong types must be refused
        # on load (as a TypeError the plan reader names), not crash the report later.
        for field_name in ("name", "note", "route"):
            if not isinstance(getattr(self, field_name), str):
                raise TypeError(f"runner-up field '{field_name}' must be a string, got {getattr(self, field_name)!r}")
        for field_name in ("step_time_s", "memory_bytes", "mfu"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"runner-up field '{field_name}' must be a number, got {value!r}")
        if not isinstance(self.fits, bool):
            raise TypeError(f"runner-up field 'fits' must be true or false, got {self.fits!r}")


def placements_to_json(placements: Sequence[Placement]) -> list[str]:
    return [placement_to_str(p) for p in placements]


TRACE_GENERATOR = "soap-planner simulate"


def write_chrome_trace(timeline: Sequence[TimelineEvent], path: str, *, force: bool = False) -> None:
    """Write ``timeline`` as a Chrome trace (opens in Perfetto / chrome://tracing): one
    process per device, one thread per stream, times in microseconds. An existing file is
    replaced only when it is a trace soap-planner wrote, unless ``force``."""
    import json

    from planner.outputs import check_output_file, write_text_atomically

    path = check_output_file(path, what="Chrome trace", is_ours=is_chrome_trace, force=force)
    devices = sorted({event.device for event in timeline})
    streams = sorted({(event.device, event.stream) for event in timeline})
    pid = {device: index for index, device in enumerate(devices)}
    tid = {key: index for index, key in enumerate(streams)}
    events: list[dict[str, Any]] = []
    for device in devices:
        events.append({"ph": "M", "name": "process_name", "pid": pid[device], "args": {"name": device}})
    for device, stream in streams:
        events.append(
            {"ph": "M", "name": "thread_name", "pid": pid[device], "tid": tid[(device, stream)], "args": {"name": stream}}
        )
    for event in timeline:
        events.append(
            {
                "ph": "X",
                "name": event.name,
                "cat": event.stream,
                "pid": pid[event.device],
                "tid": tid[(event.device, event.stream)],
                "ts": event.start_s * 1e6,
                "dur": event.duration_s * 1e6,
            }
        )
    trace = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"generator": TRACE_GENERATOR}}
    write_text_atomically(path, json.dumps(trace))


def is_chrome_trace(path: Any) -> bool:
    """Whether ``path`` holds a Chrome trace written by ``SimResult.to_chrome_trace``."""
    import json

    from planner.json_files import peek_json
    from planner.outputs import file_tail

    data = peek_json(path)
    if data is None:  # too large to parse here (or not JSON): ours end with their generator
        return file_tail(path).endswith(json.dumps({"otherData": {"generator": TRACE_GENERATOR}})[1:])
    return isinstance(data, dict) and isinstance(data.get("otherData"), dict) and (
        data["otherData"].get("generator") == TRACE_GENERATOR
    )


def check_trace_output(path: Any, inputs: Sequence[Any], *, force: bool = False) -> None:
    """Check a ``--trace`` path before any work: it replaces only a trace soap-planner wrote
    (unless ``force``) and is none of the command's ``inputs`` (``planner.outputs``)."""
    from planner.outputs import check_output_file, refuse_input_as_output

    check_output_file(path, what="Chrome trace", is_ours=is_chrome_trace, force=force)
    refuse_input_as_output(path, "--trace", list(inputs))


def placements_from_json(items: Any, where: str) -> Placements:
    if not isinstance(items, list):
        raise PlanFileError(f"{where} must be a list of placements like [\"S(0)\", \"R\"], got {one_line(repr(items))}")
    try:
        return tuple(placement_from_str(str(item)) for item in items)
    except ValueError as error:
        raise PlanFileError(f"{where}: {one_line(error)}") from None
