"""DeepSpeed's pipeline engine as it runs: its ``TrainSchedule`` instruction by instruction,
every send and receive a rendezvous (a part of ``cost_model.step_tasks.StepTaskGraph``).

DeepSpeed's pipeline sends are synchronous (deepspeed/runtime/pipe/p2p.py: ``send`` asserts
``async_op == False``; a ``dist.send``/``recv`` pair, or a two-rank ``dist.broadcast``, on
the default stream): a send cannot start before the receiving stage has reached the matching
receive, and both stages' compute streams hold until the transfer ends. Which receive matches
which send, and what each stage does before it, is fixed by ``TrainSchedule``
(``cost_model.schedules.deepspeed_train_steps``).

In the task graph each exchange is, on each of the two stages' compute streams, a
zero-length "ready" task followed by the transfer; each side's transfer also waits for the
other side's ready task, so both start when the later of the two stages arrives:

    start(transfer) = max(sender ready, receiver ready);  both end at start + seconds

The passes, their tensor-parallel gathers of partitioned tensors, gradient accumulation and
the data-parallel reduction are the step graph's own (``StepTaskGraph._forward`` etc.).
"""

from __future__ import annotations

from cost_model.scheduler import TaskGraph
from cost_model.schedules import deepspeed_train_steps
from cost_model.segments import Segment

# Which side of a stage boundary each instruction is on: the boundary below (between the
# previous stage and this one) or above (this one and the next).
_BOUNDARY_BELOW = ("recv act", "send grad")


class DeepSpeedPipelineTasks:
    """Adds the passes and rendezvous exchanges of DeepSpeed's ``TrainSchedule``."""

    def _deepspeed_schedule(self, graph: TaskGraph, chunk_segments: dict[int, list[Segment]],
                            boundary: dict[int, float], sync_after: dict[str, list[int]], fsdp: bool,
                            sync_every: bool) -> None:
        """Every stage's instructions in order; the exchanges are linked after all exist."""
        parts = self._p2p_parts()
        pipeline = self.plan.pipeline
        # (tensor, micro-batch, lower stage of the boundary) -> {stage: (ready id, transfer id)}
        exchanges: dict[tuple[str, int, int], dict[int, tuple[int, int]]] = {}
        for stage in range(self.pp):
            device = f"stage {stage}"
            segments = chunk_segments[stage]
            for what, mb in deepspeed_train_steps(stage, self.pp, self.micro_batches):
                if what == "F":
                    deps = []
                    if stage > 0 and parts > 1:  # PartitionedTensor.full() of the received slice
                        deps = [self._gather_parts(graph, device, boundary[stage - 1], [], f"gather act mb{mb}")]
                    self._forward(graph, device, segments, mb, deps, fsdp)
                elif what == "B":
                    deps = []
                    if stage < self.pp - 1 and parts > 1:  # the gradient's slices, then its own output
                        gathered = self._gather_parts(graph, device, boundary[stage], [], f"gather grad mb{mb}")
                        deps = [self._gather_parts(graph, device, boundary[stage], [gathered], f"gather output mb{mb}")]
                    sync = sync_every or mb == self.micro_batches - 1
                    deferred = None if pipeline.overlap_grad_reduce else []
                    done = self._backward(graph, device, segments, mb, deps, self.plan.recompute_at(stage), fsdp,
                                          fsdp or sync, sync_after, sync, deferred)
                    done = self._accumulate_gradients(graph, device, segments, mb, pipeline.gradient_accumulation, done)
                    for name, ready in deferred or ():
                        sync_after.setdefault(device, []).append(self._gradient_sync(graph, device, name, ready, done))
                else:
                    lower = stage - 1 if what in _BOUNDARY_BELOW else stage
                    seconds = self._p2p_seconds(lower, boundary[lower] / parts)
                    ready = graph.add(f"ready to {what} mb{mb}", (device, "compute"), 0.0, kind="p2p")
                    transfer = graph.add(f"{what} mb{mb}", (device, "compute"), seconds, kind="p2p")
                    exchanges.setdefault((what.split(" ")[1], mb, lower), {})[stage] = (ready, transfer)
        for key, sides in exchanges.items():
            if len(sides) != 2:
                raise RuntimeError(f"DeepSpeed schedule: exchange {key} has no partner")
            (_, (ready_a, transfer_a)), (_, (ready_b, transfer_b)) = sides.items()
            graph.add_dependency(transfer_a, ready_b)
            graph.add_dependency(transfer_b, ready_a)
