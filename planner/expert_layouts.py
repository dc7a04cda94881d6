"""How each Mixture-of-Experts layer runs: which devices hold which experts
(``ExpertPlacement``) and the layer's mode, all-to-all and sharding (``ExpertLayout``).

Part of the plan vocabulary (``planner.strategy`` re-exports every name here); validated at
construction, JSON conversion in ``planner.plans``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from planner.cost_parts import CostParts
from planner.errors import one_line


@dataclass(frozen=True)
class ExpertPlacement:
    """Which devices hold each expert of one MoE layer, and what share of the expert's tokens
    each copy takes: ``replicas[e]`` lists ``(device, share)`` with shares summing to 1
    (devices numbered within the expert-parallel group). An expert with several copies (a
    hot expert given redundant replicas) has its tokens split among them by those shares and
    its gradients summed over them. ``method`` names how it was found, for reports."""

    devices: int
    replicas: tuple[tuple[tuple[int, float], ...], ...]
    method: str = ""

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ValueError(f"an expert placement needs at least one device, got {self.devices}")
        checked = None
        for expert, copies in enumerate(self.replicas):
            if copies is checked:
                continue  # the tuple the expert before holds (copied_grid shares one per group)
            checked = copies
            if not copies:
                raise ValueError(f"expert {expert} has no device")
            if any(not 0 <= device < self.devices or share < 0 for device, share in copies):
                raise ValueError(f"expert {expert}: devices must be in 0..{self.devices - 1} and shares >= 0")
            if len({device for device, _ in copies}) != len(copies):
                raise ValueError(f"expert {expert} has two copies on one device")
            if abs(sum(share for _, share in copies) - 1.0) > 1e-6:
                raise ValueError(f"expert {expert}: the shares of its copies sum to {sum(s for _, s in copies):.6g}, not 1")

    @classmethod
    def round_robin(cls, experts: int, devices: int) -> "ExpertPlacement":
        """Expert ``e`` whole on device ``e % devices``, one copy each."""
        return cls(devices, tuple(((e % devices, 1.0),) for e in range(experts)), "round-robin")

    @classmethod
    def copied_grid(cls, experts: int, devices: int, experts_per_device: int) -> "ExpertPlacement":
        """Every expert copied on ``r = devices x experts_per_device / experts`` devices: the
        experts split into ``experts / experts_per_device`` groups of consecutive experts,
        group ``g`` held whole by the ``r`` consecutive devices ``g*r .. g*r + r - 1`` (a copy
        group inside a node where ``r`` divides the node's devices), each copy taking 1/r of
        the expert's tokens. Its ``copy_groups`` are those device ranges.

        Raises:
            ValueError: ``experts_per_device`` does not divide ``experts``, or the groups do
                not divide ``devices``.
        """
        if experts_per_device < 1 or experts % experts_per_device:
            raise ValueError(f"{experts_per_device} experts per device do not divide {experts} experts")
        groups = experts // experts_per_device
        if devices % groups:
            raise ValueError(f"{groups} groups of {experts_per_device} expert(s) do not divide {devices} devices")
        copies = devices // groups
        # One tuple per group, held by each of its experts: a placement of 256 experts copied
        # over 2,048 devices is then 2,048 pairs, not 524,288 (58 MiB and a second to build).
        by_group = [tuple((group * copies + copy, 1.0 / copies) for copy in range(copies)) for group in range(groups)]
        replicas = tuple(by_group[expert // experts_per_device] for expert in range(experts))
        return cls(devices, replicas, f"{experts_per_device} per device x {copies} copies")

    @property
    def experts(self) -> int:
        return len(self.replicas)

    def experts_on(self, device: int) -> tuple[int, ...]:
        """The experts with a copy on ``device``."""
        return self._experts_by_device[device]

    @property
    def most_experts_per_device(self) -> int:
        """Copies on the fullest device (what its expert weights are sized by)."""
        return max(len(held) for held in self._experts_by_device)

    @functools.cached_property
    def _experts_by_device(self) -> tuple[tuple[int, ...], ...]:
        # Computed once: searches ask for every device of every placement many times.
        held: list[list[int]] = [[] for _ in range(self.devices)]
        for expert, copies in enumerate(self.replicas):
            for device, _ in copies:
                held[device].append(expert)
        return tuple(tuple(experts) for experts in held)

    @functools.cached_property
    def copy_groups(self) -> tuple[tuple[int, ...], ...] | None:
        """The devices grouped by the experts they hold, when the copies form a grid: every
        device holds at least one expert, the devices holding a copy of an expert all hold the
        same experts, and every group has as many devices. Groups are ordered by their first
        device, devices within a group ascending. Such a placement is a DeviceMesh of
        (groups x copies), over whose ``copies`` dim each expert's weights can be sharded
        (``ExpertLayout.sharded_copies``). None for any other placement."""
        held = self._experts_by_device
        if any(not experts for experts in held):
            return None
        groups: dict[tuple[int, ...], list[int]] = {}
        for device, experts in enumerate(held):
            groups.setdefault(experts, []).append(device)
        for experts, devices in groups.items():
            if any({device for device, _ in self.replicas[expert]} != set(devices) for expert in experts):
                return None
        if len({len(devices) for devices in groups.values()}) != 1:
            return None
        return tuple(sorted(tuple(devices) for devices in groups.values()))

    @property
    def copies_per_expert(self) -> int:
        """Copies of the most copied expert (r of a grid placement)."""
        return max(len(copies) for copies in self.replicas)

    def device_loads(self, expert_loads: Sequence[float]) -> list[float]:
        """Tokens (or any load) each device processes when expert ``e`` receives
        ``expert_loads[e]``, split among its copies by their shares."""
        loads = [0.0] * self.devices
        if self._disjoint_copy_sets is None:
            for expert, copies in enumerate(self.replicas):
                for device, share in copies:
                    loads[device] += expert_loads[expert] * share
            return loads
        # Each device holds the experts of one copy set: its load is the sum, in expert order,
        # of their loads times its share, the very additions the loop above makes, computed
        # once per (set, share) and not once per device (2,048 copies of 256 experts).
        for copies, experts in self._disjoint_copy_sets:
            by_share: dict[float, float] = {}
            for device, share in copies:
                if share not in by_share:
                    total = 0.0
                    for expert in experts:
                        total += expert_loads[expert] * share
                    by_share[share] = total
                loads[device] = by_share[share]
        return loads

    @functools.cached_property
    def _disjoint_copy_sets(self) -> tuple[tuple[tuple[tuple[int, float], ...], tuple[int, ...]], ...] | None:
        """The experts grouped by their copies (devices and shares), in order of first
        expert, when no device is in two groups (a round-robin or grid placement); None
        otherwise (a hot expert's extra copy beside other experts)."""
        groups: dict[tuple[tuple[int, float], ...], list[int]] = {}
        for expert, copies in enumerate(self.replicas):
            groups.setdefault(copies, []).append(expert)
        devices = [device for copies in groups for device, _ in copies]
        if len(devices) != len(set(devices)):
            return None
        return tuple((copies, tuple(experts)) for copies, experts in groups.items())


EXPERT_MODES = ("expert_parallel", "data_parallel", "expert_sliced")
# The key of ``SimResult.bytes_per_axis`` for the collectives over the groups of ranks holding
# the same experts (``ExpertLayout.sharded_copies``): sub-groups of "dp", not a mesh axis.
EXPERT_COPIES_AXIS = "expert-copies"
ALL_TO_ALL_ALGORITHMS = ("flat", "hierarchical", "deduplicated")
# Those a compiled program runs (``codegen.runtime.moe``, ``moe_exchange``); ``deduplicated``
# (DeepEP's dispatch, ``cost_model.all_to_all``) is priced for planning only.
COMPILED_ALL_TO_ALLS = ("flat", "hierarchical")
# The ``axis`` of an expert-parallel layout folded over several mesh axes, as Megatron-Core's
# "MoE parallel folding" folds expert parallelism over the data- and tensor-parallel ranks
# (arXiv 2504.14960; megatron/core/parallel_state.py, the expert groups): the axes joined by
# ``FOLDED_AXIS_JOIN``, outermost first.
FOLDED_AXIS_JOIN = "*"
FOLDED_DP_TP = "dp*tp"
# How a search may price expert-parallel layers' all-to-alls (``planner plan --moe-dispatch``):
# ``compiled``, the exchanges a compiled program runs; ``deduplicated``, DeepEP's dispatch as
# well, for a team whose trainer runs it (its plans do not compile); ``overlapped``, DeepEP's
# dispatch and each layer's all-to-alls under another micro-batch's compute too
# (``Plan.moe_a2a_overlap``: Megatron-Core's EP overlap, DualPipe's chunk; simulated only).
MOE_DISPATCHES = ("compiled", "deduplicated", "overlapped")


@dataclass(frozen=True)
class ExpertLayout:
    """How one MoE layer runs (Tutel's three modes; DESIGN.md, "Mixture-of-Experts").

    ``mode``:
      - ``expert_parallel``: the experts are split over the ranks of mesh axis ``axis`` by
        ``placement`` (a hot expert may have copies); each token travels to a device holding
        its expert and back with two all-to-alls (``all_to_all``: ``flat``;
        ``hierarchical``: inside a node, then across nodes; ``deduplicated``: DeepEP's, each
        token across the network once per destination node, then forwarded inside it,
        priced only: compiled programs run the other two).
      - ``data_parallel``: every rank holds every expert and runs its own tokens; the expert
        gradients are averaged over ``axis`` like any replicated weight.
      - ``expert_sliced``: every expert's FFN is sliced over ``axis`` (its hidden width);
        tokens are gathered, each rank computes its slice for all of them, and the partial
        outputs are reduce-scattered back.

    ``sharded_copies`` (expert parallel, a placement whose copies form a grid,
    ``ExpertPlacement.copy_groups``, with at least 2 copies per expert): each expert's
    weights, gradients and optimizer states are sharded over the devices holding its copies,
    FSDP-style (expert data parallelism, as Megatron-Core's distributed optimizer over its
    expert-data-parallel group and torchtitan's FSDP2 over the expert-replica mesh dim): the
    weights are all-gathered over the copy group before forward and again before backward,
    and the gradients reduce-scattered there, instead of whole copies whose gradients are
    all-reduced. False: every copy holds whole weights and states. On a folded axis
    (``"dp*tp"``) the copies are the ``EDP = ranks / (EP x ETP)`` expert-data-parallel ranks
    holding the same experts, not the placement's (which places over EP only): each expert
    sharded over its EDP group, as Megatron-FSDP shards expert parameters over
    ``expert_data_parallel_group`` (``cost_model.moe_folding``); EDP >= 2 and ETP 1 are
    checked with the mesh (``planner.families.moe_folding.section``).

    ``tensor_parallel`` (expert tensor parallelism, ETP; expert parallel only): each expert's
    hidden width split over this many ranks, as Megatron-Core's ``expert_tensor_parallel_size``
    splits w1 by columns and w2 by rows: the tokens an expert receives are all-gathered over
    those ranks, each computes its slice, and the partial outputs are reduce-scattered. 1: whole
    experts. ``axis`` may name several mesh axes joined by ``*`` (``"dp*tp"``): the layer's
    ranks are those of all of them, EP x ETP folded over them (``expert_axes``).

    ``capacity_factor`` is the layer's own (0: dropless). ``expert_loads`` is each expert's
    share of the routed choices the layer was planned with (summing to 1), from ``routing``
    (``"uniform"``, ``"zipf:1.2"`` or ``"file:<name>"``; one line, report text only).
    ``cost`` is the simulated forward + backward of the layer per step;
    ``exposed_all_to_all_s`` the part of its all-to-alls (dispatch and combine, both
    directions, all micro-batches) left on the critical path, less what runs under another
    micro-batch's compute (``Plan.moe_a2a_overlap``), plus what that compute loses to the
    exchange's SMs meanwhile (``cost_model.moe_overlap``); None where not simulated (a plan file
    written before it). Both are annotations: layouts compare without them.
    """

    module: str
    mode: str
    experts: int
    top_k: int
    capacity_factor: float
    axis: str = "dp"
    all_to_all: str = "flat"
    placement: ExpertPlacement | None = None
    routing: str = "uniform"
    expert_loads: tuple[float, ...] = ()
    cost: CostParts = field(default_factory=lambda: CostParts())
    sharded_copies: bool = False
    tensor_parallel: int = 1
    exposed_all_to_all_s: float | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in EXPERT_MODES:
            raise ValueError(f"expert mode must be one of {EXPERT_MODES}, got {str(self.mode)[:80]!r}")
        if self.all_to_all not in ALL_TO_ALL_ALGORITHMS:
            raise ValueError(f"all_to_all must be one of {ALL_TO_ALL_ALGORITHMS}, got {str(self.all_to_all)[:80]!r}")
        if self.experts < 1 or not 1 <= self.top_k <= self.experts:
            raise ValueError(f"an MoE layer needs experts >= 1 and 1 <= top_k <= experts, got {self.experts}, {self.top_k}")
        if not (self.capacity_factor >= 0 and math.isfinite(self.capacity_factor)):
            raise ValueError(f"capacity_factor must be >= 0 (0: dropless), got {self.capacity_factor}")
        if (self.placement is not None) != (self.mode == "expert_parallel"):
            raise ValueError(f"an expert_parallel layer needs a placement and other modes none (mode {self.mode})")
        if self.placement is not None and self.placement.experts != self.experts:
            raise ValueError(f"the placement covers {self.placement.experts} experts but the layer has {self.experts}")
        if self.expert_loads:
            if len(self.expert_loads) != self.experts:
                raise ValueError(f"expert_loads has {len(self.expert_loads)} entries but the layer has {self.experts} experts")
            if any(not (load >= 0 and math.isfinite(load)) for load in self.expert_loads):
                raise ValueError("expert_loads must be finite shares >= 0")
            if abs(sum(self.expert_loads) - 1.0) > 1e-6:
                raise ValueError(f"expert_loads must sum to 1, got {sum(self.expert_loads):.6g}")
        if not isinstance(self.sharded_copies, bool):
            raise ValueError(f"sharded_copies must be true or false, got {str(self.sharded_copies)[:40]!r}")
        if self.sharded_copies:
            groups = self.placement.copy_groups if self.placement is not None else None
            folded = FOLDED_AXIS_JOIN in self.axis and self.placement is not None  # copies: the EDP ranks
            if not folded and (groups is None or len(groups[0]) < 2):
                raise ValueError(
                    "sharded_copies needs an expert_parallel layout whose placement gives every expert the same "
                    "number (>= 2) of copies, on devices that hold the same experts (a grid: groups x copies); "
                    "this layout's placement does not; set sharded_copies to false"
                )
        etp = self.tensor_parallel
        if isinstance(etp, bool) or not isinstance(etp, int) or etp < 1:
            raise ValueError(f"tensor_parallel must be an integer >= 1 (1: whole experts), got {str(etp)[:40]!r}")
        if self.tensor_parallel > 1 and (self.mode != "expert_parallel" or self.sharded_copies):
            raise ValueError(
                f"tensor_parallel={self.tensor_parallel} splits the experts of an expert_parallel layout without "
                f"sharded copies; this layout is {self.mode}{' with sharded copies' if self.sharded_copies else ''}: "
                f"set tensor_parallel to 1"
            )
        if not self.axis or any(not name.isidentifier() for name in self.axis.split(FOLDED_AXIS_JOIN)):
            raise ValueError(
                f"the layout runs over axis {str(self.axis)[:40]!r}, which is not mesh axis names joined by "
                f"'{FOLDED_AXIS_JOIN}' (e.g. 'dp', 'dp*tp')"
            )
        if "\n" in self.routing or "\r" in self.routing or len(self.routing) > 200:
            raise ValueError("routing must be one line of at most 200 characters")


def expert_axes(axis: str) -> tuple[str, ...]:
    """The mesh axes an expert layout's ``axis`` spans, outermost first: ``("dp",)`` or, folded,
    ``("dp", "tp")``."""
    return tuple(axis.split(FOLDED_AXIS_JOIN))


def expert_axis_size(mesh, axis: str) -> int:
    """Ranks of one group along ``axis`` on ``mesh`` (the product of its axes' sizes).

    Raises:
        KeyError: an axis ``mesh`` does not have.
    """
    return math.prod(mesh.axis_size(name) for name in expert_axes(axis))


EXPERT_MODE_WORDS = {"expert_parallel": "expert parallel", "data_parallel": "experts replicated",
                     "expert_sliced": "experts sliced"}


def expert_modes_summary(layouts: tuple[ExpertLayout, ...]) -> str:
    """How a plan's MoE layers run, in a few words: ``expert parallel (balanced, flat)``
    (``..., copies sharded`` with ``sharded_copies``) when every layer runs one way, else
    the count of layers per mode."""
    ways = {(layout.mode, layout.placement.method if layout.placement else "", layout.all_to_all
             if layout.mode == "expert_parallel" else "", "copies sharded" if layout.sharded_copies else "")
            for layout in layouts}
    if len(ways) == 1:
        mode, method, algorithm, sharded = next(iter(ways))
        details = ", ".join(part for part in (method, algorithm, sharded) if part)
        return one_line(EXPERT_MODE_WORDS[mode] + (f" ({details})" if details else ""))[:120]
    counts = {mode: sum(1 for layout in layouts if layout.mode == mode) for mode in EXPERT_MODE_WORDS}
    return ", ".join(f"{count} {EXPERT_MODE_WORDS[mode]}" for mode, count in counts.items() if count)
