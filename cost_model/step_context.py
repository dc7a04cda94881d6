"""What every part of one simulated step reads: the plan's facts, taken once.

``Simulator`` builds one ``StepContext`` per plan and hands it to each part explicitly
(``cost_model.node_costs``, ``cost_model.segments``, ``cost_model.step_tasks``,
``cost_model.deepspeed_pipeline``, ``cost_model.step_memory`` and the step contributors listed by
``cost_model.contributor_registry``); no part reads another's state through a shared ``self``.

Which part reads which field (taken from the former mixins' ``self.`` reads and writes;
"terms" are the node-cost contributors: SUMMA, vocabulary-parallel loss, split gathers,
replica gradients). Only ``strategies`` (written by ``Simulator.assign`` and the search's cost
tables) and the collective-time cache change after ``build``.

=========================  =====  ========  =====  ======  =========  =======  =====
field                      node   segments  tasks  memory  deepspeed  dp step  terms
                           costs
=========================  =====  ========  =====  ======  =========  =======  =====
plan                       x      x         x      x       x          x        x
graph                      x      x                x                           x
mesh                       x      x         x              x                   x
cluster                                     x              x          x        x
device                     x                x
strategies                 x      x                x
nodes, consumers           x      x                x
pp, chunks, schedule_name                   x      x       x
micro_batches              x      x         x      x       x          x        x
dp                                                                    x
activation_scale           x      x                x                           x
graph_program                               x                         x
dtensor_dispatch           x
redistribute_overhead_s    x                                                   x
host                       x      x
moe_layers, moe_layer_of   x      x                x
overlap_slowdown           (``Simulator.run``)
collective() (groups,      x                x                         x        x
  comm_cache)
p2p_seconds()                               x              x
output_bytes(),            x      x                x
  shard_factor()
reduced_gradient_bytes()                                   x          x
=========================  =====  ========  =====  ======  =========  =======  =====

The parts pass their results on explicitly: node costs (``NodeCosts.costs``) to the segments
and the memory, the segments to the task graph and the memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.tensor import Shard

from cost_model.collectives import collective_time
from cost_model.compute import PRECISIONS, check_precision
from cost_model.host_dispatch import HostDispatch, dtensor_dispatch, host_dispatch
from cost_model.megatron_grad_sync import gradient_bytes, runs_megatron_sync
from cost_model.mixed_precision import reduced_gradient_bytes
from cost_model.moe_layers import LaidOutLayer, laid_out_layers
from cost_model.nccl import nccl_profile
from cost_model.parameter_bytes import FP32_GRADIENT_BYTES
from planner.graph import OpGraph, OpNode
from planner.program_shape import is_data_parallel
from planner.strategy import DUALPIPE, NodeStrategy


@dataclass(eq=False)  # compared by identity: it holds the whole graph
class StepContext:
    """The facts of one plan every part of its simulated step reads (module docstring).

    ``strategies`` is the plan's current per-node strategies (a delta simulation changes it
    in place); ``comm_cache`` memoises collective times. Everything else is fixed once built.
    """

    plan: object
    graph: OpGraph
    mesh: object
    cluster: object
    device: object  # the slowest device: every rank is simulated as it
    strategies: dict[str, NodeStrategy]
    nodes: dict[str, OpNode]
    consumers: dict[str, list[str]]
    pp: int
    chunks: int  # virtual stages per device
    micro_batches: int
    schedule_name: str
    dp: int
    activation_scale: float  # bytes of an activation element / 4
    # A program that replays the traced graph on DTensors (not a plain data-parallel module).
    graph_program: bool
    # DTensor's own dispatch per op (forward, backward) on CPUs, where it adds to each op.
    dtensor_dispatch: HostDispatch
    redistribute_overhead_s: float
    host: HostDispatch | None
    overlap_slowdown: float
    moe_layers: dict[str, LaidOutLayer]
    moe_layer_of: dict[str, LaidOutLayer]
    groups: dict[str, tuple[list[int], int, int]]
    comm_cache: dict[tuple, float]

    @classmethod
    def build(cls, plan, graph: OpGraph, nodes: dict[str, OpNode], consumers: dict[str, list[str]]) -> StepContext:
        """The context of ``plan`` on ``graph`` (``nodes`` and ``consumers``: the graph's facts,
        ``cost_model.simulation_cache.graph_facts``)."""
        check_precision(plan.precision)
        mesh, cluster, pipeline = plan.mesh, plan.cluster, plan.pipeline
        # Gradient accumulation without a pipeline is a one-stage 1F1B: each micro-batch's
        # forward then its backward, one micro-batch's activations held at a time.
        micro_batches = pipeline.micro_batches if pipeline else plan.accumulation_steps
        device = min(
            (cluster.device_of(r) for r in range(cluster.world_size)),
            key=lambda d: d.flops_for(PRECISIONS[plan.precision][0]),
        )
        # A program that replays the traced graph on DTensors pays DTensor's dispatch on every
        # op (planner.cluster: dtensor_op_overhead_s); a plain data-parallel module does not.
        graph_program = not is_data_parallel(plan)
        pp = mesh.axis_size("pp") if "pp" in mesh.names else 1
        profile = nccl_profile(cluster)
        moe_layers = laid_out_layers(plan, graph, micro_batches)
        return cls(
            plan=plan, graph=graph, mesh=mesh, cluster=cluster, device=device,
            strategies={s.node: s for s in plan.strategies}, nodes=nodes, consumers=consumers,
            pp=pp, chunks=pipeline.virtual_stages if pipeline else 1, micro_batches=micro_batches,
            # A DualPipe plan is simulated as its 1F1B twin, its schedule then priced by
            # cost_model.dualpipe_step (the Simulator does both).
            schedule_name=pipeline.schedule if pipeline and pipeline.schedule != DUALPIPE else "1f1b",
            dp=mesh.axis_size("dp") if "dp" in mesh.names else 1,
            activation_scale=PRECISIONS[plan.precision][1] / 4,
            graph_program=graph_program,
            # Uncalibrated, the measured default (cost_model.host_dispatch), as on GPUs: a CPU
            # device without a calibration still pays it, and a graph program (a pipeline's
            # stages among them) runs every op on DTensors where a plain DDP module does not.
            dtensor_dispatch=dtensor_dispatch(device) if graph_program else HostDispatch(0.0, 0.0),
            # ... and pays DTensor's redistribute machinery on every collective it issues in line.
            redistribute_overhead_s=(device.redistribute_overhead_s or 0.0) if graph_program else 0.0,
            # On GPUs the host issues ops ahead of the kernels (its time bounds a segment's from
            # below); on CPUs it runs them, and DTensor's dispatch adds to each op. A plan that
            # prices Megatron-Core's distributed optimizer describes Megatron-Core's own program
            # (compile refuses it, codegen/plan_checks.py), whose ops run on plain tensors: its
            # host pays each op's launch, not DTensor's dispatch.
            host=host_dispatch(cluster, device, graph_program and not plan.megatron_distributed_optimizer),
            overlap_slowdown=profile.overlap_slowdown if profile is not None else 0.0,
            # MoE layers with a layout are priced by it (cost_model.moe_layers), not by placements.
            moe_layers=moe_layers,
            moe_layer_of={name: layer for layer in moe_layers.values() for name in layer.nodes},
            groups={axis: axis_group(mesh, cluster, pp, axis) for axis in mesh.names},
            comm_cache={},
        )

    def collective(self, kind: str, size_bytes: float, axis: str) -> float:
        """Seconds of one ``kind`` collective of ``size_bytes`` over ``axis``'s process group,
        beside the other groups of that axis that share its links."""
        key = (kind, size_bytes, axis)
        if key not in self.comm_cache:
            ranks, concurrent, _ = self.groups[axis]
            self.comm_cache[key] = collective_time(kind, size_bytes, self.cluster, ranks, concurrent)
        return self.comm_cache[key]

    def p2p_seconds(self, vs: int, size_bytes: float) -> float:
        """Seconds to send ``size_bytes`` from (virtual) stage ``vs`` to the next."""
        stride = self.mesh.size // self.pp
        src, dst = (vs % self.pp) * stride, ((vs + 1) % self.pp) * stride
        key = ("send_recv", size_bytes, src, dst)
        if key not in self.comm_cache:
            self.comm_cache[key] = collective_time("send_recv", size_bytes, self.cluster, [src, dst]) if src != dst else 0.0
        return self.comm_cache[key]

    def reduced_gradient_bytes(self) -> int:
        """Bytes per gradient element that gradient reductions move: the buffer the
        micro-batches accumulated into, fp32 under ``"fp32-copy"`` (DeepSpeed's
        BF16_Optimizer all-reduces its fp32 gradients: ``_bf16_reduce_grads`` in
        deepspeed/runtime/pipe/engine.py) and under Megatron's distributed optimizer
        (``Plan.megatron_distributed_optimizer``), else what the program's gradients are
        (``cost_model.mixed_precision.reduced_gradient_bytes``: fp32 in every bf16 program,
        FSDP2's included, whose policy reduces in fp32)."""
        pipeline = self.plan.pipeline
        if pipeline is not None and pipeline.gradient_accumulation == "fp32-copy":
            return FP32_GRADIENT_BYTES
        if runs_megatron_sync(self):  # its fp32 gradient buffer
            return gradient_bytes()
        return reduced_gradient_bytes(self.plan)

    def shard_factor(self, placements) -> int:
        """Ranks a tensor is split over: a Partial tensor is whole-size on every rank."""
        return math.prod(
            size for (axis, size), p in zip(self.mesh.axes, placements) if axis != "pp" and isinstance(p, Shard)
        )

    def output_bytes(self, node: OpNode, strategy: NodeStrategy) -> float:
        """Bytes of one micro-batch of ``node``'s floating-point outputs on one device."""
        return sum(
            meta.nbytes * self.activation_scale / self.shard_factor(placements) / self.micro_batches
            for meta, placements in zip(node.output_meta, strategy.outputs)
            if meta.dtype.is_floating_point
        )


def axis_group(mesh, cluster, pp: int, axis: str) -> tuple[list[int], int, int]:
    """Ranks of the first group along ``axis``, how many such groups run at once, size."""
    names, shape = mesh.names, mesh.shape
    index = names.index(axis)
    stride = math.prod(shape[index + 1:])
    size = shape[index]
    ranks = [k * stride for k in range(size)]
    concurrent = mesh.size // size // (pp if axis != "pp" else 1)
    # Groups share a node's network only where they have members on that node: at most as
    # many as the groups of this axis that touch any one node (the axes inside this one may
    # span nodes, e.g. a SUMMA grid on single-GPU nodes, where every node holds one rank of
    # one group), as cost_model.summa's _Pricer counts them.
    touching: dict[int, set[int]] = {}
    for rank in range(min(mesh.size, cluster.world_size)):
        group = rank - (rank // stride) % size * stride
        touching.setdefault(cluster.node_of(rank), set()).add(group)
    concurrent = min(concurrent, max((len(groups) for groups in touching.values()), default=1))
    return ranks, max(1, concurrent), size
