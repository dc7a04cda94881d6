"""What one configuration of the pipeline grid costs (``search.pipeline_search``): its step
time and its fullest device's bytes, from the segment costs the grid sliced into stages.

- Step time (``StepPricing.step_time``): 1F1B runs ``sum(stage times) + (m - 1) x slowest``
  plus the point-to-point transfers of the fill and drain; interleaved, the schedule walked
  pass by pass over each virtual stage's forward and backward seconds, a hop at each
  boundary (``cost_model.schedules.schedule_makespan``); DualPipe what
  ``cost_model.dualpipe_step.schedule_times`` gives on the slowest stage's passes; plus
  the optimizer step and the data-parallel communication that backward does not hide
  (DDP's gradient all-reduce beyond the last backward, ZeRO-1's weight all-gather, FSDP's
  gathers, counted in full inside a pipeline where the simulated schedules hide little of
  them). A DualPipe device also reduces and steps its second stage
  (``cost_model.dualpipe_step.second_stage_tail``), as the simulator prices a DualPipe plan.
- Memory (``StepPricing.device_memory``): the device's stages' weights, gradients and states,
  the peak of the activations its schedule holds, what recomputation briefly holds, and the
  fixed buffers; a DualPipe device holds two stages and ``pp + 1`` micro-batches of the
  larger's activations (DeepSeek-V3 report, table 2).
"""

from __future__ import annotations

from collections.abc import Callable

from cost_model import defaults
from cost_model.collectives import collective_time
from cost_model.compute import optimizer_implementation, optimizer_step_time
from cost_model.dualpipe_step import paired_stage, schedule_times, second_stage_tail
from cost_model.mixed_precision import unwrapped_collective_bytes
from cost_model.parameter_bytes import bytes_per_parameter
from cost_model.schedules import schedule_makespan
from cost_model.segments import SegmentProfile
from planner.cluster import Cluster
from planner.graph import OpGraph
from planner.strategy import DUALPIPE
from search.pipeline_configs import Configuration
from search.stage_slicing import SegmentCost, Slicing, held_at_peaks, stage_indices, stage_members


class StepPricing:
    """Prices configurations of one grid: ``profile(config)`` gives its segments' costs per
    micro-batch (``PipelineGrid``'s simulation, shared by the configurations alike)."""

    def __init__(self, graph: OpGraph, cluster: Cluster, precision: str,
                 profile: Callable[[Configuration], list[SegmentProfile] | None]):
        self.graph, self.cluster, self.precision, self.profile = graph, cluster, precision, profile
        self.device = cluster.device_of(0)
        self._collectives: dict[tuple, float] = {}

    def fixed_bytes(self, config: Configuration) -> float:
        """Communication buffers and buffers (as the simulator counts them), bounded from
        above so that the slicing's capacity is safe for every stage."""
        profiles = self.profile(config)
        weights, grads, _ = bytes_per_parameter(self.precision)
        fixed = float(sum(meta.nbytes for meta in self.graph.buffers.values()))
        if config.dp > 1 and config.flavour == "fsdp":
            fixed += 2 * max(p.param_elements for p in profiles) * weights
        elif config.dp > 1:
            fixed += min(defaults.DDP_BUCKET_BYTES, sum(p.param_elements for p in profiles) * grads)
        if config.pp > 1:
            fixed += 2 * max(p.input_bytes for p in profiles)
        # One MoE layer exchanges at a time: the largest dispatch buffers of one
        # (cost_model.step_memory counts them so).
        fixed += max(p.exchange_bytes for p in profiles)
        return fixed

    def device_memory(self, costs, slicing: Slicing, config: Configuration) -> float:
        """Bytes on the fullest device: its virtual stages' weights, gradients and states,
        the peak of the activations its schedule holds (walked as the simulator walks it),
        what recomputation briefly holds, and the fixed buffers."""
        pp, chunks = config.pp, config.virtual_stages
        members = stage_members(costs, slicing)
        fullest = 0.0
        for device in range(pp):
            mine = [members[chunk * pp + device] for chunk in range(chunks)]
            if config.schedule == DUALPIPE:
                mine.append(members[paired_stage(device, pp)])
            static = sum(c.static_bytes for stage in mine for c in stage)
            transient = max((c.transient_bytes for stage in mine for c in stage), default=0.0)
            kept = [sum(c.activation_bytes for c in stage) for stage in mine]
            if config.schedule == DUALPIPE:
                peak = min(pp + 1, config.micro_batches) * max(kept)  # table 2: PP + 1 in flight
            elif pp == 1:
                peak = kept[0]
            elif config.schedule == "1f1b":
                peak = min(pp - device, config.micro_batches) * kept[0]  # the warm-up's forwards
            else:
                peak = max(
                    sum(count * size for count, size in zip(counts, kept))
                    for counts in held_at_peaks(config.schedule, pp, config.micro_batches, chunks)[device]
                )
            fullest = max(fullest, static + peak + transient)
        return fullest + self.fixed_bytes(config)

    def step_time(self, config: Configuration, costs: list[SegmentCost], slicing: Slicing) -> float:
        pp, m = config.pp, config.micro_batches
        stage_times = [sum(c.time_s for c in members) for members in stage_members(costs, slicing)]
        device_times = [sum(stage_times[d::pp]) for d in range(pp)]
        hop = 0.0
        if pp > 1:
            boundary = max(p.input_bytes for p in self.profile(config))
            hop = self.collective("send_recv", boundary, (0, self.cluster.world_size // pp), 1)
        if config.schedule == "interleaved":
            # The schedule walked pass by pass (cost_model.schedules.schedule_makespan), each
            # virtual-stage boundary one hop. The closed form ``m x busiest device + (pp - 1)
            # x slowest virtual stage`` is exact for even stages only: on the uneven ones the
            # slicing makes (GPT of tests/test_pipeline_search.py, zero1, pp2 x dp2, 2
            # micro-batches of 8, a head as slow as five blocks alone on the last virtual
            # stage) it put the step 10% above the simulation (45.2 against 41.0 ms); walked,
            # 2.5% below it (40.0 ms). (1F1B keeps its closed form: walked, that grid's 72
            # 1F1B estimates were further from their simulations, median |error| 0.6% ->
            # 0.8%.)
            forward = [sum(c.forward_s for c in members) for members in stage_members(costs, slicing)]
            backward = [total - ahead for total, ahead in zip(stage_times, forward)]
            compute = schedule_makespan(config.schedule, pp, m, config.virtual_stages, forward, backward, hop)
        elif config.schedule == DUALPIPE:
            # The slowest stage's passes, its forward a third of them (backward = 2 x forward,
            # cost_model.defaults.BACKWARD_TO_FORWARD), as the simulator times a DualPipe plan.
            forward = max(stage_times) / (1 + defaults.BACKWARD_TO_FORWARD)
            compute = schedule_times(pp, m, forward, max(stage_times) - forward).dualpipe_s
        else:
            compute = sum(stage_times) + (m - 1) * max(stage_times)
        if pp > 1 and config.schedule != "interleaved":
            compute += 2 * (len(stage_times) - 1) * hop  # activations forward, gradients back
        profiles = self.profile(config)
        weights, grads, states = bytes_per_parameter(self.precision)
        # What the collectives move: a pipeline program's weights and gradients stay fp32 under
        # bf16 autocast (cost_model.mixed_precision), whatever the memory split above says.
        gathered, reduced = unwrapped_collective_bytes(self.precision)
        dp, flavour = config.dp, config.flavour
        shard = dp if flavour in ("zero1", "zero2", "fsdp") else 1
        tail = 0.0
        for device in range(pp):
            members = [
                profiles[i]
                for stage, indices in enumerate(stage_indices(slicing))
                if stage % pp == device
                for i in indices
            ]
            own = sum(p.per_rank_elements for p in members)  # never sharded (experts split by a layout)
            elements = sum(p.param_elements for p in members) - own
            after = self.optimizer_time(
                elements * (weights + grads + states) / shard + own * (weights + grads + states), members, config)
            if dp > 1 and flavour == "fsdp":
                # Each segment's gradients are reduce-scattered after its last backward:
                # the first segment's is left when the backward ends.
                first = members[0].synced_elements * reduced if members else 0.0
                after += self.dp_collective("reduce_scatter", first, config)
            elif dp > 1:
                # A graph program reduces each parameter's gradient in its own collective
                # during the last backward, which hides about its backward share (two thirds
                # of a micro-batch's time).
                reduce = sum(self.dp_collective("all_reduce", size * reduced, config)
                             for p in members for size in p.synced_tensors)
                after += max(0.0, reduce - device_times[device] * 2 / 3)
                if flavour == "zero1":
                    # ShardedStatesOptimizer: one all-gather per sliced weight, one after
                    # another (as the simulator's step tasks, cost_model.data_parallel_step).
                    after += sum(self.dp_collective("all_gather", size * gathered, config)
                                 for p in members for size in p.zero1_gathered_tensors(dp))
            if config.schedule == DUALPIPE:
                after += self._second_stage_tail(profiles, slicing, paired_stage(device, pp), config)
            tail = max(tail, after)
        return compute + tail

    def _second_stage_tail(self, profiles: list[SegmentProfile], slicing: Slicing, stage: int,
                           config: Configuration) -> float:
        """A DualPipe device's second stage (``stage``): its gradients reduced over dp and its
        optimizer step, after the first's (``cost_model.dualpipe_step.second_stage_tail``)."""
        weights, grads, states = bytes_per_parameter(self.precision)
        members = [profiles[i] for i in stage_indices(slicing)[stage]]
        shard = config.dp if config.flavour in ("zero1", "zero2", "fsdp") else 1
        own = sum(p.per_rank_elements for p in members)
        shared = sum(p.param_elements for p in members) - own
        state = (shared / shard + own) * (weights + grads + states)
        synced = sum(p.synced_elements for p in members) * unwrapped_collective_bytes(self.precision)[1]
        return second_stage_tail(synced, state, self.device,
                                 lambda size: self.dp_collective("all_reduce", size, config) if config.dp > 1 else 0.0)

    def optimizer_time(self, state_bytes: float, members: list, config: Configuration) -> float:
        """One device's AdamW step, as the simulator prices it (``cost_model.step_tasks``): on
        gloo, torch.optim's single-tensor loop over the device's parameter tensors, on
        DTensors (a graph program's parameters) except under ZeRO-1, which steps plain-tensor
        pieces of every one; elsewhere torch's default, foreach
        (``cost_model.compute.optimizer_implementation``)."""
        if self.cluster.backend != "gloo":
            return optimizer_step_time(state_bytes, self.device, optimizer_implementation(self.cluster.backend))
        tensors = sum(p.param_tensors for p in members)
        pieces = config.dp > 1 and config.flavour == "zero1"
        return optimizer_step_time(state_bytes, self.device, "single_tensor", tensors=tensors,
                                   dispatch_s=0.0 if pieces else self.device.dtensor_op_overhead_s or 0.0)

    def dp_collective(self, kind: str, size: float, config: Configuration) -> float:
        """A collective over one dp group of ``config``'s mesh (dp is outside tp: stride tp),
        while the other tp groups of its stage run theirs."""
        return self.collective(kind, size, tuple(k * config.tp for k in range(config.dp)), config.tp)

    def collective(self, kind: str, size: float, ranks: tuple[int, ...], concurrent: int) -> float:
        key = (kind, size, ranks, concurrent)
        if key not in self._collectives:
            self._collectives[key] = collective_time(kind, size, self.cluster, list(ranks), concurrent) if size else 0.0
        return self._collectives[key]
