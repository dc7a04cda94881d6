"""Memory of one device in a step: weights, gradients and optimizer states after the dp
flavour's sharding, activations held by the micro-batches in flight, communication buffers;
and the bytes each mesh axis carries (a part of ``cost_model.simulator.Simulator``).
"""

from __future__ import annotations

from cost_model import defaults
from cost_model.compute import check_precision
from cost_model.recompute import activation_bytes
from cost_model.schedules import schedule as pipeline_schedule
from cost_model.segments import Segment
from planner.strategy import MemoryBreakdown

# bytes per parameter by precision: (weights, gradients, optimizer states). Mixed
# precision keeps fp16/bf16 weights and gradients and fp32 master weights plus Adam's two
# moments: 2 + 2 + 12 bytes (ZeRO, Rajbhandari et al. SC'20, section 3.1, K = 12).
PARAM_BYTES = {"fp32": (4, 4, 8), "bf16": (2, 2, 12), "fp16": (2, 2, 12)}
FP32_GRADIENT_BYTES = 4  # an fp32 gradient element


def bytes_per_parameter(precision: str) -> tuple[int, int, int]:
    """Bytes per parameter element of (weights, gradients, optimizer states) before any
    sharding, for mixed-precision Adam at ``precision``."""
    check_precision(precision)
    return PARAM_BYTES[precision]


class StepMemory:
    """Memory and bytes per axis of a step (uses ``Simulator``'s plan, mesh and segments)."""

    def _optimizer_state_bytes(self, segments: list[Segment]) -> float:
        weights, grads, states = PARAM_BYTES[self.plan.precision]
        elements = sum(sum(s.params.values()) for s in segments)
        shardable = sum(s.shardable_elements() for s in segments)
        shard = self.dp if self.plan.dp_flavour in ("zero1", "zero2", "fsdp") else 1
        return (shardable / shard + elements - shardable) * (weights + grads + states)

    def _stage_memory(self, all_segments: list[Segment], stage: int, segments: list[Segment]) -> MemoryBreakdown:
        weight_b, grad_b, state_b = PARAM_BYTES[self.plan.precision]
        if self.plan.pipeline is not None and self.plan.pipeline.gradient_accumulation == "fp32-copy":
            # DeepSpeed's BF16_Optimizer keeps an fp32 gradient the size of the whole 16-bit
            # group (deepspeed/runtime/bf16_optimizer.py: fp32_groups_gradients_flat, zeros_like
            # the bf16 flat group, in fp32) beside the 16-bit gradients each backward writes.
            grad_b = FP32_GRADIENT_BYTES + grad_b
        params: dict[str, float] = {}
        per_rank: set[str] = set()
        for segment in segments:
            params.update(segment.params)
            per_rank |= segment.per_rank
        elements = sum(params.values())
        own = sum(count for name, count in params.items() if name in per_rank)  # never sharded over dp
        shared = elements - own
        flavour, dp = self.plan.dp_flavour, self.dp
        weights = shared * weight_b / (dp if flavour == "fsdp" else 1) + own * weight_b
        grads = shared * grad_b / (dp if flavour in ("zero2", "fsdp") else 1) + own * grad_b
        states = shared * state_b / (dp if flavour in ("zero1", "zero2", "fsdp") else 1) + own * state_b
        buffers_state = sum(meta.nbytes for meta in self.graph.buffers.values()) if stage == 0 else 0
        activations = self._peak_activations(stage, segments)
        if flavour == "fsdp" and dp > 1:
            # The unit being used and the next one, prefetched, are gathered at once.
            comm = 2 * self._largest_fsdp_unit(segments) * weight_b
        elif dp > 1:
            comm = min(defaults.DDP_BUCKET_BYTES, elements * grad_b)
        else:
            comm = 0.0
        if self.pp > 1:
            comm += 2 * max((s.input_bytes for s in segments), default=0.0)
        # One MoE layer dispatches at a time: the largest of their buffers, with (sharded
        # copies) its experts' gathered weights and those of the layer prefetched.
        comm += max((layer.buffer_bytes + 2 * layer.gathered_bytes for layer in self.moe_layers.values()), default=0.0)
        # One op runs at a time: the largest transient buffer of one (a SUMMA matmul's blocks).
        comm += max((self.costs[name].buffer_bytes for segment in segments for name in segment.nodes), default=0.0)
        return MemoryBreakdown(
            weights=int(weights + buffers_state),
            gradients=int(grads),
            optimizer_states=int(states),
            activations=int(activations),
            communication_buffers=int(comm),
        )

    def _largest_fsdp_unit(self, segments: list[Segment]) -> float:
        """Local parameter elements of the largest FSDP unit: a repeated block (a segment),
        or, in a model without blocks whose plan wraps each layer (``Plan.fsdp_units``), the
        largest of those layers and the root's remaining parameters."""
        largest = max((s.shardable_elements() for s in segments), default=0.0)
        units = self.plan.fsdp_units
        if not units or any(s.block for s in segments):
            return largest
        sizes = dict.fromkeys((*units, ""), 0.0)
        for segment in segments:
            for name, count in segment.params.items():
                if name not in segment.per_rank:
                    sizes[next((u for u in units if name.startswith(u + ".")), "")] += count
        return max(sizes.values())

    def _peak_activations(self, stage: int, segments: list[Segment]) -> float:
        """Peak bytes held for backward by the micro-batches in flight on this device."""
        chunk_bytes: dict[int, float] = {}
        transient = 0.0
        for segment in segments:
            chunk = segment.stage // self.pp
            kept, recomputed = activation_bytes(segment, self.plan.recompute_at(segment.stage))
            transient = max(transient, recomputed)
            chunk_bytes[chunk] = chunk_bytes.get(chunk, 0.0) + kept
        held = peak = 0.0
        for kind, _, chunk in pipeline_schedule(self.schedule_name, stage, self.pp, self.micro_batches, self.chunks):
            held += chunk_bytes.get(chunk, 0.0) if kind == "F" else -chunk_bytes.get(chunk, 0.0)
            peak = max(peak, held)
        return peak + transient

    def fsdp_root_elements(self, segment: Segment) -> float:
        """Local elements of ``segment``'s shardable parameters that FSDP2's root unit holds:
        those under none of ``Plan.fsdp_units`` (all of them when the plan names no units).
        FSDP2 never reshards its root after forward (backward starts right after it), so the
        root's weights are gathered once per micro-batch and the units' twice, in forward and
        again in backward (``codegen.emit``'s FSDP program; counted by
        ``codegen.runtime.comm_audit``)."""
        units = tuple(unit + "." for unit in self.plan.fsdp_units)
        return sum(count for name, count in segment.params.items()
                   if name not in segment.per_rank and not name.startswith(units))

    def fsdp_regathered_elements(self, segment: Segment) -> float:
        """Local elements of ``segment``'s dp-sharded weights that FSDP gathers a second time,
        for backward. A program that wraps modules (``Plan.fsdp_units``: FSDP2 over the model's
        own modules) regathers its units but not its root (``fsdp_root_elements``). A graph
        program (no units) gathers each weight where an op reads it and autograd keeps the
        gathered weight for backward, except in a fully recomputed block, whose replay in
        backward gathers its weights again (``codegen`` compiles FSDP graph programs with full
        recomputation only). A pipeline's stages gather for both passes."""
        shardable = segment.shardable_elements()
        if self.plan.pipeline is not None:
            return shardable
        if self.plan.fsdp_units:
            return shardable - self.fsdp_root_elements(segment)
        return shardable if segment.block and self.plan.recompute_at(segment.stage) == "full" else 0.0

    def pipeline_boundary_bytes(self) -> list[tuple[float, float]]:
        """Per boundary between (virtual) stages k and k+1, the bytes of one micro-batch one
        device sends over it: (forward: every value made by stage k or before that a later
        stage reads, integer ones and graph inputs such as the targets included, as
        ``codegen.pipeline_emit`` relays them; backward: the gradients of its floating-point
        values made by ops). Parameters are not sent (each stage holds its own)."""
        stages = self.pp * self.chunks
        forward, backward = [0.0] * (stages - 1), [0.0] * (stages - 1)
        params = set(self.graph.parameters)
        graph_inputs = {graph_input.name: graph_input for graph_input in self.graph.inputs}
        last_reader: dict[str, int] = {}
        for node in self.graph.nodes:
            stage = self.strategies[node.name].stage
            for name in node.inputs:
                if name not in params:
                    last_reader[name] = max(last_reader.get(name, -1), stage)
        for name, reader in sorted(last_reader.items()):
            if name in graph_inputs:
                meta, made = graph_inputs[name].meta, 0
                local = meta.nbytes / self._shard_factor(self.plan.inputs.get(name) or ()) / self.micro_batches if meta else 0.0
                float_bytes = 0.0  # a graph input gets no gradient
            elif name in self.strategies:
                node, strategy = self.nodes[name], self.strategies[name]
                made = strategy.stage
                local = float_bytes = 0.0
                for meta, placements in zip(node.output_meta, strategy.outputs):
                    scale = self.activation_scale if meta.dtype.is_floating_point else 1.0
                    size = meta.nbytes * scale / self._shard_factor(placements) / self.micro_batches
                    local += size
                    float_bytes += size if meta.dtype.is_floating_point else 0.0
            else:
                continue
            for boundary in range(made, min(reader, stages - 1)):
                forward[boundary] += local
                backward[boundary] += float_bytes
        return list(zip(forward, backward))

    def _bytes_per_axis(self, segments: list[Segment]) -> dict[str, float]:
        """Bytes a device of the busiest stage sends per step, by mesh axis."""
        totals: dict[str, float] = {}
        by_stage: dict[int, dict[str, float]] = {}
        for segment in segments:
            stage_totals = by_stage.setdefault(segment.stage % self.pp, {})
            for axis, sent in segment.axis_bytes.items():
                stage_totals[axis] = stage_totals.get(axis, 0.0) + sent * self.micro_batches
            if self.dp > 1 and segment.dp_synced:
                grads = sum(segment.params[n] for n in segment.dp_synced) * PARAM_BYTES[self.plan.precision][1]
                # fsdp: all-gather twice + reduce-scatter; zero1: all-reduce + all-gather of the
                # updated weights; ddp: all-reduce; zero2: reduce-scatter + all-gather. Gradient
                # accumulation (no pipeline) repeats FSDP's gathers and FSDP2's reduce-scatters
                # for every micro-batch.
                flavour = self.plan.dp_flavour
                gathers = self.micro_batches if self.plan.pipeline is None else 1  # FSDP's, per micro-batch
                reductions = self.micro_batches if self._syncs_every_micro_batch() else 1
                units = {"fsdp": 2 * gathers + reductions, "zero1": 2 * reductions + 1, "zero2": reductions + 1, "ddp": 2 * reductions}[flavour]
                factor = units * (self.dp - 1) / self.dp
                stage_totals["dp"] = stage_totals.get("dp", 0.0) + grads * factor
                if flavour == "fsdp":  # what is not gathered again for backward
                    kept = (segment.shardable_elements() - self.fsdp_regathered_elements(segment)) * PARAM_BYTES[self.plan.precision][1]
                    stage_totals["dp"] -= kept * gathers * (self.dp - 1) / self.dp
        if self.pp > 1:
            for boundary, (forward, backward) in enumerate(self.pipeline_boundary_bytes()):
                # The sender of the activations is stage k's device; stage k+1's device
                # sends their gradients back.
                for device, sent in ((boundary % self.pp, forward), ((boundary + 1) % self.pp, backward)):
                    stage_totals = by_stage.setdefault(device, {})
                    stage_totals["pp"] = stage_totals.get("pp", 0.0) + sent * self.micro_batches
        for stage_totals in by_stage.values():
            for axis, sent in stage_totals.items():
                totals[axis] = max(totals.get(axis, 0.0), sent)
        return totals


