"""Pipeline plans: the (pp x dp x tp) grid, with stages sliced by dynamic programming.

The grid (``PipelineSpace``): meshes ``pp x dp x tp`` with ``tp`` dividing the devices of a
node (Megatron-LM's layout on tp, ``search.layouts.megatron_layout``, or the per-op
placements CP-SAT finds on the stage mesh, ``search.stage_layouts``), ``pp`` any divisor of
``world / tp`` up to the number of blocks, ``dp`` the rest (dividing the batch); 1, 2, 4 or 8
samples per micro-batch per dp rank; 1F1B, and interleaved 1F1B with 2 or 4 virtual stages
per device when the micro-batches are a multiple of pp; for an MoE model planned with
``--moe-dispatch overlapped`` (``PipelineSpace.dualpipe``) DualPipe on even pipelines with at
least twice as many micro-batches (simulated, not compiled); DDP, ZeRO-1 or FSDP on dp;
recomputation none, selective or full on every stage, or chosen per stage (``PER_STAGE``);
with tp, sequence parallelism or not. For an MoE model (``PipelineSpace.expert_layouts``,
``search.stage_experts``) every configuration with a dp axis is also priced with each
variant of the MoE layers' layouts over its stages' dp ranks (``Configuration.experts``).

Costs. One simulation per (tp, sequence parallelism, micro-batch size) gives every
segment's time and memory per micro-batch (``Simulator.segment_profiles``; a segment is the
ops before the first block, one block, or the ops after the last block). A segment costs the same on any stage, so every
split of every pipeline depth is priced from that one simulation:

- Stage slicing (``search.stage_slicing.slice_stages``), dynamic programming over the segments in order::

      best[s][j] = min over i < j of max(best[s-1][i], time(i..j)),  if memory_s(i..j) <= capacity
      best[0][0] = 0;  answer best[S][n], cuts recovered from the argmins

  ``time(i..j)`` is the forward + backward seconds per micro-batch of segments i..j-1 (tensor
  parallel collectives included); ``memory_s`` their weights, gradients and optimizer states
  under the dp flavour, plus the activations of the micro-batches stage s holds in flight
  under the schedule, plus what recomputation briefly holds. It minimises the slowest stage,
  so the stages holding the embedding and the head get fewer blocks when those are heavy.
  Under ``PER_STAGE`` every (i, j) also takes the fastest recomputation mode that fits it
  there: a 1F1B pipeline's first stage holds ``pp`` micro-batches in flight and its last
  one, so the first stages may recompute fully while the last recompute nothing.
- Step time and memory (``search.pipeline_step.StepPricing``): the schedule's compute (1F1B,
  interleaved, or DeepSeek-V3's DualPipe for an MoE pipeline, whose devices hold two stages
  each and hide the all-to-alls under the other micro-batch's compute), the fill and drain's
  point-to-point transfers, the optimizer step and the data-parallel communication backward
  does not hide.

Search (``pipeline_plans``). Configurations are visited in increasing order of a lower bound
on their step time (the average device's passes of every micro-batch, plus under 1F1B the
fill and drain with every stage as slow as the average one). One is skipped when its memory
lower bound overflows the device, or when the same configuration with less recomputation
already fits (dominated: recomputing only adds time). Past the k-th best estimate a
configuration is priced only while its bound is below the best estimate of its schedule
kind (no pipeline, 1F1B, interleaved, DualPipe) or its kind has none yet. The k finalists
(``SearchBudget.pipeline_candidates``) are the best estimate of each kind, then the best of
the rest; they are simulated in full and compete with every other plan. Every count depends
only on the inputs, never on the clock.
"""

from __future__ import annotations

import dataclasses
import heapq

from cost_model.parameter_bytes import bytes_per_parameter
from cost_model.simulator import SegmentProfile, Simulator, simulated
from planner.cluster import Cluster
from planner.errors import PlanningError
from planner.graph import OpGraph
from planner.model_spec import ModelSpec
from planner.plans import Plan
from planner.strategy import DUALPIPE, KEEP_A2A, ExpertLayout, Mesh, PipelineConfig
from search.budget import SearchBudget
from search.layouts import megatron_layout, nearly_even_layers, restrict_axes, uneven_stages
from search.plan_builder import unsimulated_plan
from search.pipeline_configs import (
    PER_STAGE,
    Configuration,
    Estimate,
    PipelineSpace,
    grid_mesh,
    schedule_kind,
    stage_recompute_order,
)
from search.pipeline_step import StepPricing
from search.stage_layouts import SearchedLayouts
from search.stage_slicing import (
    SegmentCost,
    Slicing,
    in_flight_per_stage,
    slice_stages,
    stage_indices,
    stage_members,
    stage_memory,
)

# Visiting order for dominance: once a mode fits, the modes after it only add time (per
# stage chooses among all of them, so it is never slower than a uniform mode that fits).
_DOMINANCE = {"none": 0, PER_STAGE: 1, "selective": 2, KEEP_A2A: 3, "full": 4}


def pipeline_plans(
    graph: OpGraph,
    cluster: Cluster,
    spec: ModelSpec | None,
    model_name: str,
    precision: str,
    budget: SearchBudget | None = None,
    space: PipelineSpace | None = None,
) -> list[Plan]:
    """The best configurations of the grid, each with the faster of its layouts
    (``PipelineGrid.with_searched_layout``), simulated (label ``"megatron"`` or ``"soap"``),
    fastest estimate first; empty when the grid does not apply (no repeated blocks, heterogeneous
    nodes, a model Megatron's layout cannot split) or nothing in it fits."""
    budget = budget or SearchBudget()
    grid = PipelineGrid(graph, cluster, precision, space or PipelineSpace(), budget)
    plans = []
    chosen: list[Estimate] = []
    for estimate in grid.best(budget.pipeline_candidates()):
        searched = grid.with_searched_layout(estimate)
        # Two finalists differing only in sequence parallelism share one searched twin.
        chosen.append(estimate if any(searched.config == other.config for other in chosen) else searched)
    for estimate in sorted(chosen, key=lambda e: (e.step_s, e.config)):
        plans.append(grid.plan(estimate, spec, model_name))
    return plans


class PipelineGrid:
    """The grid of one model on one cluster, with the per-(tp, micro-batch) segment costs
    it prices configurations from."""

    def __init__(
        self, graph: OpGraph, cluster: Cluster, precision: str, space: PipelineSpace, budget: SearchBudget | None = None
    ):
        self.graph, self.cluster, self.precision, self.space = graph, cluster, precision, space
        self.stage_modes = stage_recompute_order(space)  # what each stage chooses among under PER_STAGE
        self.budget = budget or SearchBudget()
        self.blocks = sum(graph.blocks.values())
        self.device = cluster.device_of(0)
        self.capacity = cluster.min_device_memory
        self._layouts: dict[tuple, tuple | None] = {}
        self._experts: dict[tuple, dict[str, tuple[ExpertLayout, ...]]] = {}  # (mesh, micro-batches) -> variants
        self._searched = SearchedLayouts(
            graph, cluster, precision, self.budget, megatron=lambda tp, names: self._layout(tp, False, names)
        )
        self._profiles: dict[tuple, list[SegmentProfile]] = {}
        self.pricing = StepPricing(graph, cluster, precision, self._profile)
        self.priced = 0  # configurations priced by stage slicing (for reports and tests)

    # ------------------------------------------------------------------ grid

    def configurations(self) -> list[Configuration]:
        """Every configuration of the space on this cluster and batch, in a fixed order."""
        cluster, batch, space = self.cluster, self.graph.batch_size, self.space
        if not self.blocks or not cluster.is_homogeneous:
            return []
        world, per_node = cluster.world_size, cluster.devices_per_node
        found = []
        layouts = [
            (tp, split, "megatron")
            for tp in _divisors(per_node)
            if space.tensor_parallel is None or tp in space.tensor_parallel
            for split in (space.sequence_parallel if tp > 1 else (False,))
            if world % tp == 0 and self._layout(tp, split, ("tp",) if tp > 1 else ()) is not None
        ]
        if space.searched_layout == "every":
            layouts += [(tp, False, "soap") for tp in _divisors(per_node) if world % tp == 0]
        for tp, split, layout in layouts:
            for pp in _divisors(world // tp):
                dp = world // (tp * pp)
                if pp > self.blocks or batch % dp:
                    continue
                if space.allows_mesh is not None and not space.allows_mesh(grid_mesh(pp, dp, tp)):
                    continue
                names = tuple(name for name, size in (("pp", pp), ("dp", dp), ("tp", tp)) if size > 1) or ("dp",)
                if layout == "soap" and not self._searched.differs(tp, names):
                    continue  # no layout searched for these axes, or Megatron's again: priced already
                local = batch // dp
                sizes = [local] if pp == 1 else [size for size in space.micro_batch_sizes if local % size == 0]
                for size in sizes:
                    micro_batches = local // size
                    schedules = [("1f1b", 1)]
                    if pp > 1:
                        schedules += [
                            ("interleaved", v) for v in space.virtual_stages
                            if micro_batches % pp == 0 and pp * v <= self.blocks
                        ]
                    if self._tries_dualpipe(pp, micro_batches):
                        schedules.append((DUALPIPE, 1))
                    variants = self._expert_variants(grid_mesh(pp, dp, tp), micro_batches)
                    if tp > 1 and space.expert_layouts is not None and variants == ("",):
                        continue  # MoE layers beside tensor parallelism run only by a folded layout
                    for schedule, chunks in schedules:
                        for flavour in space.flavours if dp > 1 else ("ddp",):
                            per_stage = (PER_STAGE,) if space.per_stage_recompute and pp > 1 else ()
                            for recompute in (*space.recompute, *per_stage):
                                if flavour == "fsdp" and recompute != "full":
                                    # Compiled FSDP beside other axes frees gathered weights only
                                    # in recomputed blocks (planner.api.composed_flavour_blocker).
                                    continue
                                found += [Configuration(
                                    tp, pp, dp, size, micro_batches, schedule, chunks, flavour, recompute, split, layout,
                                    experts,
                                ) for experts in variants]
        return found

    def best(self, count: int) -> list[Estimate]:
        """``count`` configurations that fit, fastest first: the fastest estimate of each
        schedule kind (no pipeline, 1F1B, interleaved, DualPipe; ``schedule_kind``), then
        the fastest of the rest (branch and bound over the lower bounds; see the module
        docstring). An estimate errs differently by schedule (FSDP's gathers are counted in
        full, the point-to-point streams as never busy), so a kind is not left out of the
        simulations because another's estimates run a few percent lower."""
        bounded = []
        for config in self.configurations():
            bound = self._time_lower_bound(config)
            if bound is not None:
                bounded.append((bound, config))
        bounded.sort()
        # A max-heap of the kept estimates by (time, visiting order): on a tie the one
        # visited later leaves first, and the visiting order is fixed by the inputs.
        kept: list[tuple[float, int, Estimate]] = []
        leaders: dict[str, tuple[float, int, Estimate]] = {}  # schedule kind -> its fastest (time, order, estimate)
        fitting: dict[tuple, list[int]] = {}
        twins: dict[Configuration, Estimate] = {}  # configuration without its layout -> kept estimate
        for order, (bound, config) in enumerate(bounded):
            kind = schedule_kind(config)
            leader = leaders.get(kind)
            # Past the k-th best estimate, a configuration can only still lead its kind.
            if len(kept) >= count and bound > -kept[0][0] and leader is not None and bound > leader[0]:
                continue
            # Recomputation only adds time: once a configuration fits, the same one
            # recomputing more is dominated. (Flavours are not ordered so: ZeRO-1's sharded
            # optimizer step can beat DDP's despite its extra all-gather.)
            group = dataclasses.replace(config, recompute="")
            rank = _DOMINANCE[config.recompute]
            if any(fitted <= rank for fitted in fitting.get(group, ())):
                continue
            if self._memory_lower_bound(config) > self.capacity:
                continue
            estimate = self.estimate(config)
            if estimate is None:
                continue
            fitting.setdefault(group, []).append(rank)
            if leader is None or estimate.step_s < leader[0]:
                leaders[kind] = (estimate.step_s, order, estimate)
            # A configuration priced with both layouts keeps the faster one only, so the
            # two do not take two of the ``count`` simulations.
            twin = dataclasses.replace(config, layout="")
            other = twins.get(twin)
            if other is not None:
                if other.step_s <= estimate.step_s:
                    continue
                kept = [item for item in kept if item[2] is not other]
                heapq.heapify(kept)
            twins[twin] = estimate
            heapq.heappush(kept, (-estimate.step_s, -order, estimate))
            if len(kept) > count:
                heapq.heappop(kept)
        chosen = [estimate for _, _, estimate in sorted(leaders.values(), key=lambda item: item[:2])][:count]
        for _, _, estimate in sorted(kept, key=lambda item: (-item[0], -item[1])):
            if len(chosen) >= count:
                break
            if not any(estimate is other for other in chosen):
                chosen.append(estimate)
        return sorted(chosen, key=lambda e: (e.step_s, e.config))

    # ----------------------------------------------------------------- plans

    def with_searched_layout(self, estimate: Estimate) -> Estimate:
        """``estimate``, or its configuration priced with CP-SAT's layout when that
        estimates faster (``space.searched_layout`` not ``"off"``; ``search.stage_layouts``).
        The searched layout has no sequence-parallel switch: it splits what it finds worth
        splitting, so a sequence-parallel configuration's twin is the one without."""
        config = estimate.config
        if self.space.searched_layout == "off" or config.layout == "soap":
            return estimate
        if not self._searched.differs(config.tp, config.mesh.names):
            return estimate
        searched = self.estimate(dataclasses.replace(config, layout="soap", sequence_parallel=False))
        return searched if searched is not None and searched.step_s < estimate.step_s else estimate

    def plan(self, estimate: Estimate, spec: ModelSpec | None, model_name: str) -> Plan:
        """The estimated configuration as a simulated plan, with the layout it was priced
        with (label ``"megatron"`` or ``"soap"``)."""
        return simulated(self.unsimulated(estimate, spec, model_name), self.graph)

    def unsimulated(self, estimate: Estimate, spec: ModelSpec | None, model_name: str) -> Plan:
        """The estimated configuration as a plan not yet simulated (``plan`` simulates it):
        for a caller that changes it first (``planner.families.hetero_pipeline`` puts it
        on a cluster of several device types)."""
        config = estimate.config
        mesh = config.mesh
        strategies, inputs = self._layout(config.tp, config.sequence_parallel, mesh.names, config.layout)
        pipeline = None
        recompute, per_stage = config.recompute, estimate.stage_recompute
        stages = config.pp * config.virtual_stages
        stage_of = uneven_stages(self.graph, estimate.layers_per_stage, stages=stages) if config.pp > 1 else None
        if per_stage and stage_of is not None:
            per_stage = self._keeping_only_with_moe(per_stage, stage_of)
        if per_stage:
            # The plan's mode is the heaviest any stage uses; stages that differ are listed.
            # A stage without blocks recomputes nothing whatever its mode (only blocks are
            # checkpointed), so it takes the plan's mode rather than look different.
            recompute = max(per_stage, key=self.stage_modes.index)
            per_stage = tuple(
                mode if blocks else recompute for mode, blocks in zip(per_stage, estimate.layers_per_stage)
            )
            per_stage = per_stage if len(set(per_stage)) > 1 else ()
        if stage_of is not None:
            strategies = tuple(dataclasses.replace(s, stage=stage_of[s.node]) for s in strategies)
            pipeline = PipelineConfig(
                stages=config.pp, schedule=config.schedule, micro_batches=config.micro_batches,
                virtual_stages=config.virtual_stages, stage_recompute=per_stage,
            )
        return self._built(config, spec, model_name, mesh, strategies, inputs, dp_flavour=config.flavour,
                           recompute=recompute, pipeline=pipeline, label=config.layout)

    def _built(self, config: Configuration, spec: ModelSpec | None, model_name: str, mesh: Mesh, strategies: tuple,
               inputs: dict, **settings) -> Plan:
        """The unsimulated plan of ``config`` with its MoE layers' layouts, put on it by the
        space's ``lay_out_experts`` when it has one (the folded MoE family's)."""
        layouts, overlap = self._experts_of(config), self._overlaps_all_to_alls(config)
        if self.space.lay_out_experts is None or not layouts:
            return unsimulated_plan(self.graph, self.cluster, spec, model_name, mesh, strategies, inputs,
                                    precision=self.precision, expert_layouts=layouts, moe_a2a_overlap=overlap,
                                    **settings)
        plan = unsimulated_plan(self.graph, self.cluster, spec, model_name, mesh, strategies, inputs,
                                precision=self.precision, **settings)
        return self.space.lay_out_experts(plan, layouts, overlap)

    def _keeping_only_with_moe(self, per_stage: tuple[str, ...], stage_of: dict[str, int]) -> tuple[str, ...]:
        """``per_stage`` with ``full_keep_a2a`` named ``full`` on stages that hold no MoE op:
        with no exchange to keep the two are one (and priced alike), and the plan says what
        such a stage does."""
        if KEEP_A2A not in per_stage:
            return per_stage
        with_moe = {stage_of[node.name] for block in self.graph.moe_blocks for node in self.graph.moe_nodes(block.module)}
        return tuple("full" if mode == KEEP_A2A and stage not in with_moe else mode for stage, mode in enumerate(per_stage))

    # ------------------------------------------------------------- estimates

    def estimate(self, config: Configuration) -> Estimate | None:
        """The configuration's step time and memory with its stages sliced by
        ``slice_stages`` (or Megatron's split, whichever is faster; only Megatron's without
        ``space.uneven``), or None when no slicing fits in memory. Under ``PER_STAGE`` each
        stage also takes the least recomputation that fits it (``Estimate.stage_recompute``)."""
        self.priced += 1
        modes = self.stage_modes if config.recompute == PER_STAGE else (config.recompute,)
        by_mode = {mode: self._segment_costs(config, mode) for mode in modes}
        to_slice = by_mode if config.recompute == PER_STAGE else by_mode[config.recompute]
        stages = config.pp * config.virtual_stages
        capacity = self.capacity - self.pricing.fixed_bytes(config)
        if config.schedule == DUALPIPE:
            # A device holds two stages and pp + 1 micro-batches in flight: slice each stage
            # against half the device; StepPricing.device_memory checks the pair.
            in_flight = ((config.pp + 2) // 2,) * config.pp
            capacity /= 2
        else:
            in_flight = in_flight_per_stage(config.schedule, config.pp, config.micro_batches, config.virtual_stages)
        slicings = [self._even_slicing(config, by_mode, stages, capacity, in_flight)]
        if self.space.uneven:
            # Interleaved: a device holds several virtual stages; slice against the whole
            # device, and against an equal share in case some device overflows. The
            # recurrence balances virtual stages, not devices, so Megatron's split stays a
            # candidate: on interleaved schedules it can balance the devices better.
            for share in (1, config.virtual_stages) if config.virtual_stages > 1 else (1,):
                slicings.append(slice_stages(to_slice, stages, capacity / share, in_flight))
        best = None
        for slicing in slicings:
            if slicing is None:
                continue
            costs = _costs_as_sliced(by_mode, slicing)
            memory = self.pricing.device_memory(costs, slicing, config)
            if memory > self.capacity:
                continue
            seconds = self.pricing.step_time(config, costs, slicing)
            estimate = Estimate(seconds, config, self._layers_per_stage(config, slicing), memory, slicing.modes)
            if best is None or estimate.step_s < best.step_s:
                best = estimate
        return best

    def lower_bounds(self, config: Configuration) -> tuple[float, float] | None:
        """``config``'s step-time and memory lower bounds (seconds, bytes), the ones ``best``
        prunes by, for a caller pricing its own configurations (``search.megatron_moe``);
        None when Megatron's layout does not split the model on its tp or pp."""
        bound = self._time_lower_bound(config)
        return None if bound is None else (bound, self._memory_lower_bound(config))

    def segment_costs(self, config: Configuration, recompute: str) -> list[SegmentCost] | None:
        """Each segment's cost per micro-batch under ``config`` recomputing as ``recompute``
        says (the ops before the first block, each block, the ops after the last), priced on
        this grid's cluster; None when Megatron's layout does not split the model on its tp."""
        return None if self._profile(config) is None else self._segment_costs(config, recompute)

    def block_flags(self, config: Configuration) -> tuple[bool, ...]:
        """Whether each segment of ``config`` (as ``segment_costs`` lists them) is a block."""
        return tuple(profile.block for profile in self._profile(config) or ())

    def boundary_bytes(self, config: Configuration) -> float:
        """Bytes of the largest activation one rank sends between stages per micro-batch."""
        return float(max((profile.input_bytes for profile in self._profile(config) or ()), default=0.0))

    def fixed_bytes(self, config: Configuration) -> float:
        """Bytes every device of ``config`` holds besides its segments' (buffers, bounded from above)."""
        return self.pricing.fixed_bytes(config)

    def _segment_costs(self, config: Configuration, recompute: str) -> list[SegmentCost]:
        """Each segment's cost under ``config`` when it recomputes as ``recompute`` says."""
        weights, grads, states = bytes_per_parameter(self.precision)
        dp, flavour = config.dp, config.flavour
        per_element = (
            weights / (dp if flavour == "fsdp" else 1)
            + grads / (dp if flavour in ("zero2", "fsdp") else 1)
            + states / (dp if flavour in ("zero1", "zero2", "fsdp") else 1)
        )
        gathered = flavour == "fsdp" and dp > 1
        whole = weights + grads + states  # a weight no rank shares (an expert split by its layout) is never sharded
        costs = []
        for profile in self._profile(config):
            seconds, forward = profile.time_s[recompute], profile.forward_s
            if gathered:
                # FSDP gathers a segment's weights before its forward and again before its
                # backward (for every micro-batch), one segment ahead. The simulated
                # schedules hide little of them (GPT 76B, tp=4, dp=256: 13.2 s simulated
                # against 10.5 s with the gathers hidden), so they are counted in full: an
                # upper bound, which simulation of the finalists corrects.
                gather = self.pricing.dp_collective("all_gather", profile.param_elements * weights, config)
                seconds, forward = seconds + 2 * gather, forward + gather
            costs.append(SegmentCost(
                time_s=seconds,
                forward_s=forward,
                static_bytes=(profile.param_elements - profile.per_rank_elements) * per_element
                + profile.per_rank_elements * whole,
                activation_bytes=profile.kept_bytes[recompute],
                transient_bytes=profile.transient_bytes[recompute],
            ))
        return costs

    def _even_slicing(self, config: Configuration, by_mode: dict[str, list[SegmentCost]], stages: int,
                      capacity: float, in_flight: tuple[int, ...]) -> Slicing:
        """Megatron's split (``nearly_even_layers``), the ops around the blocks with the end
        stages; with several modes (``PER_STAGE``), each stage takes the fastest that fits it
        (the heaviest when none does, which the device check then refuses)."""
        flags = [p.block for p in self._profile(config)]
        head = flags.index(True) if True in flags else 0
        per_stage = list(nearly_even_layers(self.blocks, stages))
        per_stage[0] += head
        per_stage[-1] += len(flags) - self.blocks - head
        counts = tuple(per_stage)
        if len(by_mode) == 1:
            (costs,) = by_mode.values()
            members = stage_members(costs, Slicing(counts, 0.0))
            return Slicing(counts, max(sum(c.time_s for c in m) for m in members))
        modes, slowest = [], 0.0
        members_by_mode = {mode: stage_members(costs, Slicing(counts, 0.0)) for mode, costs in by_mode.items()}
        for stage in range(stages):
            fitting = [
                (sum(c.time_s for c in members[stage]), position, mode)
                for position, (mode, members) in enumerate(members_by_mode.items())
                if stage_memory(members[stage], in_flight[stage]) <= capacity
            ]
            seconds, _, mode = min(fitting) if fitting else (
                sum(c.time_s for c in members_by_mode[self.stage_modes[-1]][stage]), 0, self.stage_modes[-1]
            )
            modes.append(mode)
            slowest = max(slowest, seconds)
        return Slicing(counts, slowest, tuple(modes))

    def _layers_per_stage(self, config: Configuration, slicing: Slicing) -> tuple[int, ...]:
        profiles = self._profile(config)
        layers, position = [], 0
        for count in slicing.segments_per_stage:
            layers.append(sum(1 for p in profiles[position:position + count] if p.block))
            position += count
        return tuple(layers)

    def _time_lower_bound(self, config: Configuration) -> float | None:
        """The average device's passes of every micro-batch (the busiest device runs at least
        as many), plus under 1F1B its fill and drain with every stage as slow as the average
        one (the slowest is at least the average): below any estimate."""
        profiles = self._profile(config)
        if profiles is None or len(profiles) < config.pp * config.virtual_stages:
            return None
        least = "none" if config.recompute == PER_STAGE else config.recompute  # per stage may recompute nothing
        per_device = sum(p.time_s[least] for p in profiles) / config.pp
        # 1F1B's fill and drain take pp - 1 stages' passes on top of the m micro-batches'.
        # DualPipe hides its fill in part, and an interleaved schedule over uneven virtual
        # stages may fill in less than (pp - 1) / chunks of a device's micro-batch
        # (cost_model.schedules.schedule_makespan walks it: virtual stages of 3, 3, 3 and
        # 1.5 s, forwards a third of each, on pp 2 x 2 chunks with 2 micro-batches take
        # 12.5 s, below 5.25 s x (2 + 1/2)), so only the micro-batches' own passes bound
        # those two: the busiest device runs at least the average device's m passes.
        fill = (config.pp - 1) if config.schedule == "1f1b" else 0.0
        return per_device * (config.micro_batches + fill)

    def _memory_lower_bound(self, config: Configuration) -> float:
        """The average device's bytes (one micro-batch in flight, the least any mode it may
        use keeps): below the fullest's."""
        modes = self.stage_modes if config.recompute == PER_STAGE else (config.recompute,)
        by_mode = [self._segment_costs(config, mode) for mode in modes]
        static = sum(c.static_bytes for c in by_mode[0])
        kept = sum(min(costs[i].activation_bytes for costs in by_mode) for i in range(len(by_mode[0])))
        copies = 2 if config.schedule == DUALPIPE else 1  # DualPipe keeps every stage's weights twice
        return (copies * static + kept) / config.pp

    # ------------------------------------------------------------------ caches

    def _layout(self, tp: int, sequence_parallel: bool, names: tuple[str, ...], layout: str = "megatron"):
        """Megatron's placements for a mesh with these axis names (sizes other than tp do
        not change them), every op on stage 0 (``plan`` restages them); None when the
        model does not split over tp. Built once per (tp, sequence parallelism) on every
        axis; a mesh with fewer axes takes their columns (each axis is propagated alone).
        With ``layout="soap"``, CP-SAT's placements instead (``SearchedLayouts.layout``)."""
        if layout == "soap":
            return self._searched.layout(tp, names)
        full = ("pp", "dp", "tp") if tp > 1 else ("pp", "dp")
        if (tp, sequence_parallel, full) not in self._layouts:
            sizes = {"pp": 2, "dp": 2, "tp": tp}
            try:
                strategies, inputs = megatron_layout(
                    self.graph, Mesh(tuple((name, sizes[name]) for name in full)),
                    sequence_parallel=sequence_parallel, layers_per_stage=(self.blocks, 0),
                )
                built = (tuple(dataclasses.replace(s, stage=0) for s in strategies), inputs)
            except PlanningError:
                built = None
            self._layouts[(tp, sequence_parallel, full)] = built
        key = (tp, sequence_parallel, names)
        if key not in self._layouts:
            base = self._layouts[(tp, sequence_parallel, full)]
            self._layouts[key] = None if base is None else restrict_axes(*base, [full.index(n) for n in names])
        return self._layouts[key]

    def _profile(self, config: Configuration) -> list[SegmentProfile] | None:
        """Segment costs per micro-batch of ``config.micro_batch`` samples on its tp, from one
        simulation shared by every configuration with the same tp, axes, micro-batch and
        layout."""
        mesh = config.mesh
        key = (config.tp, config.sequence_parallel, mesh.names, config.micro_batch, config.layout)
        if config.experts:
            # Expert layouts run over the dp group and route each micro-batch: their costs
            # depend on the group's size and the micro-batches, not only on the axis names.
            key += (mesh, config.micro_batches, config.experts, self._overlaps_all_to_alls(config))
        if key not in self._profiles:
            layout = self._layout(config.tp, config.sequence_parallel, mesh.names, config.layout)
            if layout is None:
                self._profiles[key] = None
                return None
            strategies, inputs = layout
            pipeline = PipelineConfig(stages=config.pp, micro_batches=config.micro_batches) if config.pp > 1 else None
            probe = self._built(config, None, "probe", mesh, strategies, inputs, pipeline=pipeline)
            self._profiles[key] = Simulator(probe, self.graph).segment_profiles()
        return self._profiles[key]

    def _tries_dualpipe(self, pp: int, micro_batches: int) -> bool:
        """Whether an MoE grid prices DualPipe on ``pp`` stages and ``micro_batches``: it needs an
        even pipeline and an even number of micro-batches, at least twice the stages
        (``cost_model.dualpipe.dualpipe_order``)."""
        return (self.space.dualpipe and self.space.expert_layouts is not None and pp > 1 and pp % 2 == 0
                and micro_batches % 2 == 0 and micro_batches >= 2 * pp)

    def _overlaps_all_to_alls(self, config: Configuration) -> bool:
        """A DualPipe configuration runs each expert-parallel layer's all-to-alls under the other
        micro-batch's compute (its overlapped chunk, ``cost_model.moe_overlap``)."""
        return config.schedule == DUALPIPE and any(
            layout.mode == "expert_parallel" for layout in self._experts_of(config))

    def _expert_variants(self, mesh: Mesh, micro_batches: int) -> tuple[str, ...]:
        """The variants of expert layouts a configuration on ``mesh`` is priced with: ``("",)``
        (none) for a dense model or a mesh without dp."""
        if self.space.expert_layouts is None:
            return ("",)
        return tuple(self._expert_table(mesh, micro_batches)) or ("",)

    def _expert_table(self, mesh: Mesh, micro_batches: int) -> dict[str, tuple[ExpertLayout, ...]]:
        key = (mesh, micro_batches)
        if key not in self._experts:
            self._experts[key] = self.space.expert_layouts(mesh, micro_batches)
        return self._experts[key]

    def _experts_of(self, config: Configuration) -> tuple[ExpertLayout, ...]:
        """The MoE layers' layouts of ``config`` (none without a variant)."""
        if not config.experts:
            return ()
        return self._expert_table(config.mesh, config.micro_batches)[config.experts]


def _divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


def _costs_as_sliced(by_mode: dict[str, list[SegmentCost]], slicing: Slicing) -> list[SegmentCost]:
    """Each segment's cost under the mode its stage recomputes with (``slicing.modes``), or
    under the one mode there is."""
    if not slicing.modes:
        (costs,) = by_mode.values()
        return costs
    mixed = []
    for mode, indices in zip(slicing.modes, stage_indices(slicing)):
        mixed += [by_mode[mode][i] for i in indices]
    return mixed
