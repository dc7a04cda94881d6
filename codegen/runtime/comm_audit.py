"""``launch.py --comm-audit``: the bytes one training step of a compiled program sends,
counted per mesh axis, beside the bytes the plan's simulator charged for it.

Every plan carries ``SimResult.bytes_per_axis`` (bytes a device sends per step, by mesh axis
and ``"pp"``). This module runs one step of the program (all micro-batches' forward and
backward, then the optimizer step) with every collective it issues counted, so that the two
can be compared. Counting happens at the dispatcher, in one ``TorchDispatchMode``: plain
``torch.distributed`` calls (``c10d::allreduce_``, ``_allgather_base_``, ``broadcast_``,
``send``, ``alltoall_base_`` ...), functional collectives (``_c10d_functional::*``, which
DTensor's redistributes and the runtime's autograd collectives issue) and the collectives
DDP's C++ reducer, FSDP2 and ZeRO-1's ``ShardedStatesOptimizer`` launch all pass through it (the
reducer calls ``ProcessGroup::allreduce``, which dispatches ``c10d::allreduce_``); a call is
seen once, at the outermost op, since the mode is off while it runs the op. Ops on DTensors
are handed back to DTensor first, so the collectives its sharding propagation issues inside
an op come back on local tensors and are counted too.

Bytes sent per device follow the simulator's conventions (``cost_model.simulator``'s
``_SENT_FRACTION``, ``cost_model.collectives``), for a group of n ranks and a collective of
S bytes:

  all-reduce              2(n-1)/n · S      (ring: reduce-scatter then all-gather)
  all-gather              (n-1)/n · S       (S = the gathered, whole tensor)
  reduce-scatter          (n-1)/n · S       (S = the whole input)
  all-to-all              the bytes sent to other ranks (the input less this rank's own chunk;
                          (n-1)/n · S with even splits)
  broadcast               (n-1)/n · S       (the group's average: the root sends S to each of
                          n-1 ranks, or a chain forwards it: n broadcasts of 1/n of a
                          tensor then add up to an all-gather's)
  send                    S; a receive sends nothing
  anything else           S, named "(no convention: its size)" in the table

Each process group is named by the mesh axis it spans (``DeviceMesh.get_group``), the groups
of ranks holding the same experts (``codegen.runtime.expert_copies``) ``expert-copies``; a
group spanning several axes, or none of the mesh's (the world group of a program whose mesh
has two axes), is named ``other(n=<size>)``. The table reports the busiest rank's figure per
axis, as ``bytes_per_axis`` does (``cost_model.step_memory``). Asked for sites, the audit
also ties each collective to the line of ``model_spmd.py`` that issued it
(``codegen.runtime.comm_sites``).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from codegen.runtime.comm_sites import collective_site
from codegen.runtime.expert_copies import copy_group_names
from codegen.runtime.program import Program
from planner.strategy import EXPERT_COPIES_AXIS

# Dispatcher namespaces whose ops are collectives; every other op runs uncounted.
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
# Ops of those namespaces that move no data of their own (waits, wrappers, barriers of a
# monitored kind), or that only receive.
_NOT_SENDING = ("wait_tensor", "_wrap_tensor_autograd", "recv_", "recv_any_source_", "barrier", "monitored_barrier_")


@dataclass
class CollectiveCall:
    """One collective this rank issued: its op, the axis of its group, the group's size, the
    collective's size in bytes (S above) and the bytes this rank sent for it."""

    op: str
    axis: str
    group_size: int
    size_bytes: int
    sent_bytes: float
    site: str = ""  # the line that issued it (codegen.runtime.comm_sites), when asked for


@dataclass
class CollectiveCounter(TorchDispatchMode):
    """Records every collective dispatched while it is active (see the module docstring).

    Args:
        axis_of_group: group name -> mesh axis (``mesh_group_axes``).
        with_sites: record each call's site (``codegen.runtime.comm_sites``).
    """

    axis_of_group: dict[str, str]
    calls: list[CollectiveCall] = field(default_factory=list)
    with_sites: bool = False

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(kind, DTensor) for kind in types):
            # Let DTensor run the op first: the collectives its sharding propagation issues
            # inside the op (a gather before a split, say) then come back here on local
            # tensors. A mode runs before subclasses and is off while it runs the op, so
            # running it here would hide them (CommDebugMode does the same).
            return NotImplemented
        kwargs = kwargs or {}
        if func.namespace in _COLLECTIVE_NAMESPACES:
            call = self._describe(func, args, kwargs)
            if call is not None:
                if self.with_sites:
                    call.site = collective_site()
                self.calls.append(call)
        return func(*args, **kwargs)

    def _describe(self, func, args, kwargs) -> CollectiveCall | None:
        name = func.__name__.split(".")[0]
        if name in _NOT_SENDING:
            return None
        group_name, size = _group_of(func, args, kwargs)
        axis = self.axis_of_group.get(group_name, f"other(n={size})")
        tensors = _tensors_of(args)
        if name in ("allreduce_", "allreduce_coalesced_", "all_reduce", "all_reduce_coalesced"):
            total = sum(_nbytes(t) for t in tensors)
            return CollectiveCall(name, axis, size, total, 2 * (size - 1) / size * total)
        if name in ("_allgather_base_", "all_gather_into_tensor", "all_gather_into_tensor_coalesced",
                    "allgather_", "allgather_into_tensor_coalesced_"):
            whole = sum(_nbytes(t) for t in tensors) * size \
                if name in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced") else _gathered_bytes(name, args, size)
            return CollectiveCall(name, axis, size, whole, (size - 1) / size * whole)
        if name in ("_reduce_scatter_base_", "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced",
                    "reduce_scatter_", "reduce_scatter_tensor_coalesced_"):
            whole = _scattered_bytes(name, args, size)
            return CollectiveCall(name, axis, size, whole, (size - 1) / size * whole)
        if name in ("broadcast_", "broadcast"):
            total = sum(_nbytes(t) for t in tensors)
            return CollectiveCall(name, axis, size, total, (size - 1) / size * total)
        if name in ("alltoall_base_", "all_to_all_single"):
            return _all_to_all(func, name, axis, size, args)
        total = sum(_nbytes(t) for t in tensors)
        if name == "send":
            return CollectiveCall(name, axis, size, total, float(total))
        # A collective without a convention here (reduce, gather, scatter, ...) is counted at
        # the size of its first tensor argument and marked, so the table names it.
        return CollectiveCall(f"{name} (no convention: its size)", axis, size, total, float(total))


def mesh_group_axes(mesh: DeviceMesh) -> dict[str, str]:
    """{process group name: mesh axis} for every axis of ``mesh`` (the first axis wins when
    two axes share a group, as a 1-D mesh over the world shares the default group)."""
    axes: dict[str, str] = {}
    for axis in mesh.mesh_dim_names or ():
        axes.setdefault(mesh.get_group(axis).group_name, axis)
    return axes


@dataclass(frozen=True)
class AuditResult:
    """One audited step: bytes the busiest rank sent per axis, and every rank's calls
    summarised as {(axis, op, group size): (calls, bytes sent)} of the busiest rank per axis;
    when asked for, the same rank's calls by site, {(axis, site, op): (calls, bytes sent)}."""

    counted: dict[str, float]
    calls: dict[tuple[str, str, int], tuple[int, float]]
    sites: dict[tuple[str, str, str], tuple[int, float]] = field(default_factory=dict)


def audit_step(
    program: Program, mesh: DeviceMesh, lr: float = 1e-3, optimizer: str | None = None, with_sites: bool = False
) -> AuditResult:
    """Run one training step of ``program`` on the spec's example batch, from the weights
    ``build_module`` gives every plan, with every collective counted (and tied to its site,
    under autograd's anomaly mode, if ``with_sites``). Collective: every rank calls it."""
    from codegen.runtime.optimizers import optimizer_class

    _, module, args, kwargs = program.build_module(mesh)
    step_optimizer = program.make_optimizer(module, mesh, optimizer_class(optimizer or program.plan.optimizer), lr=lr)
    if program.is_pipeline:
        pipeline = program.module.make_pipeline(module, mesh)
        local_args, local_kwargs = program.shard_batch(args, kwargs, mesh)
    # The groups of ranks holding the same experts (sharded copies) are sub-groups of "dp",
    # priced under their own key (planner.strategy.EXPERT_COPIES_AXIS).
    copies = {name: EXPERT_COPIES_AXIS for name in copy_group_names()}
    counter = CollectiveCounter({**copies, **mesh_group_axes(mesh)}, with_sites=with_sites)
    anomaly = torch.autograd.set_detect_anomaly(True, check_nan=False) if with_sites else contextlib.nullcontext()
    with anomaly, counter:
        if program.is_pipeline:
            pipeline.step(local_args, local_kwargs)
        else:
            program.forward_backward(module, args, kwargs, mesh)
        step_optimizer.step()
    mine: dict[str, float] = defaultdict(float)
    summary: dict[tuple[str, str, int], list] = defaultdict(lambda: [0, 0.0])
    by_site: dict[tuple[str, str, str], list] = defaultdict(lambda: [0, 0.0])
    for call in counter.calls:
        mine[call.axis] += call.sent_bytes
        for entry in (summary[(call.axis, call.op, call.group_size)], by_site[(call.axis, call.site, call.op)]):
            entry[0] += 1
            entry[1] += call.sent_bytes
    gathered: list = [None] * dist.get_world_size()
    mine_summarised = (dict(mine), {key: tuple(value) for key, value in summary.items()},
                       {key: tuple(value) for key, value in by_site.items()} if with_sites else {})
    dist.all_gather_object(gathered, mine_summarised)
    counted: dict[str, float] = {}
    busiest: dict[str, int] = {}
    for rank, (sent, _, _) in enumerate(gathered):
        for axis, value in sent.items():
            if value > counted.get(axis, -1.0):
                counted[axis], busiest[axis] = value, rank
    calls = {key: value for axis, rank in busiest.items() for key, value in gathered[rank][1].items() if key[0] == axis}
    sites = {key: value for axis, rank in busiest.items() for key, value in gathered[rank][2].items() if key[0] == axis}
    return AuditResult(counted=counted, calls=calls, sites=sites)


def audit_table(predicted: dict[str, float], result: AuditResult) -> str:
    """The audit as text: per axis, predicted and counted bytes and their ratio, then the
    busiest rank's collectives by op."""
    lines = [f"{'axis':<12} {'predicted B':>14} {'counted B':>14} {'counted/predicted':>18}"]
    for axis in sorted(set(predicted) | set(result.counted)):
        want, got = predicted.get(axis, 0.0), result.counted.get(axis, 0.0)
        ratio = f"{got / want:.4f}" if want else ("-" if not got else "unpriced")
        lines.append(f"{axis:<12} {want:>14.0f} {got:>14.0f} {ratio:>18}")
    for (axis, op, size), (count, sent) in sorted(result.calls.items()):
        lines.append(f"  {axis}: {count} x {op} (n={size}) {sent:.0f} B")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ helpers


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _tensors_of(args) -> list[torch.Tensor]:
    """The tensors of the first argument that holds any (a tensor or a list of them)."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return [arg]
        if isinstance(arg, (list, tuple)) and arg and all(isinstance(t, torch.Tensor) for t in arg):
            return list(arg)
    return []


def _group_of(func, args, kwargs) -> tuple[str, int]:
    """(group name, group size) of a c10d op (its ``process_group`` argument, a boxed
    ProcessGroup) or of a functional collective (its ``group_name`` argument)."""
    group = _group_argument(func, args, kwargs)
    return group.group_name, group.size()


def _group_argument(func, args, kwargs) -> dist.ProcessGroup:
    values = dict(zip((argument.name for argument in func._schema.arguments), args)) | dict(kwargs)
    if "process_group" in values:
        return dist.ProcessGroup.unbox(values["process_group"])
    if isinstance(values.get("group_name"), str):
        # How functional collectives themselves find their group by name (no public API).
        return dist.distributed_c10d._resolve_process_group(values["group_name"])
    raise NotImplementedError(f"comm audit: cannot find the process group of {func}")


def _gathered_bytes(name: str, args, size: int) -> int:
    if name == "_allgather_base_":  # (output, input, group, ...): output is the whole tensor
        return _nbytes(args[0])
    if name == "allgather_":  # (output lists, input list, group): one rank's inputs x n
        return sum(_nbytes(t) for t in args[1]) * size
    return sum(_nbytes(t) for t in args[0])  # coalesced into tensors: outputs


def _scattered_bytes(name: str, args, size: int) -> int:
    if name == "_reduce_scatter_base_":  # (output, input, group, ...)
        return _nbytes(args[1])
    if name == "reduce_scatter_":  # (outputs, input lists, group, ...)
        return sum(_nbytes(t) for chunks in args[1] for t in chunks)
    if name == "reduce_scatter_tensor_coalesced_":  # (outputs, inputs, group, ...)
        return sum(_nbytes(t) for t in args[1])
    if name == "reduce_scatter_tensor_coalesced":  # (inputs, op, group_size, group_name)
        return sum(_nbytes(t) for t in args[0])
    return _nbytes(args[0])  # reduce_scatter_tensor(input, op, group_size, group_name)


def _all_to_all(func, name: str, axis: str, size: int, args) -> CollectiveCall:
    """Bytes to other ranks: the input less this rank's own chunk (by the input split sizes)."""
    if name == "alltoall_base_":  # (output, input, group, output_split_sizes, input_split_sizes, ...)
        source, splits = args[1], list(args[4])
    else:  # all_to_all_single(input, output_split_sizes, input_split_sizes, group_name)
        source, splits = args[0], list(args[2])
    total = _nbytes(source)
    row = _nbytes(source[0]) if source.dim() and source.shape[0] else 0
    own = total // size if not splits else splits[_local_index(func, args)] * row
    return CollectiveCall(name, axis, size, total, float(total - own))


def _local_index(func, args) -> int:
    """This rank's index in the all-to-all's group."""
    return _group_argument(func, args, {}).rank()
