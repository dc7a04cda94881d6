"""Uneven data parallelism's program: the plan's data-parallel program with uneven batch
slices and share-weighted losses.

The compiled ``model_spmd.py`` is the program of the plan's flavour
(``codegen.emit.render_data_parallel_program``: DDP, ZeRO-1, ZeRO-2 or FSDP2, unchanged) with
its ``shard_batch`` written here: rank r takes ``BATCH_SHARES[r]`` consecutive rows of the
global batch (``planner.families.uneven_dp.runtime.uneven_shard_batch``). ``BATCH_SHARES``
also tells the runtime (``codegen.runtime.program.Program.loss_weight``) to scale rank r's
loss by ``BATCH_SHARES[r] * dp / B`` before backward: the flavour's reduction averages the
ranks' gradients, so the result is ``sum_r (b_r / B) grad_r``, one device's gradient of the
whole batch for a loss that averages over samples. A ZeRO-1 plan with ``state_shares``
gets its own ``parallelize`` and ``make_optimizer`` instead of DDP's: the weights stay whole
and unwrapped, the gradients are reduced with the uneven split of the flat parameters and
each rank steps its own part (``state_runtime``). A plan that accumulates gradients also
gets ``forward_backward``: each rank over its own micro-batches of its share
(``runtime.uneven_forward_backward``), each micro-batch's loss weighted by its rows.

Codegen layer: imports the planner's vocabulary and ``codegen``, never search or cost_model.
Plan values reach the source only as ``repr()`` literals (``codegen.source_text``).
"""

from __future__ import annotations

from codegen.emit import preparation_lines, render_data_parallel_program
from codegen.source_text import comment
from planner.families.uneven_dp.shares import micro_batch_sizes
from planner.plans import Plan
from planner.strategy import placements_str


def compile_uneven_plan(plan: Plan) -> str:
    """The emitter part of the ``uneven`` family (``planner.families``): the program of a plan
    with an ``"uneven"`` section (checked when the plan was made)."""
    state_shares = plan.sections["uneven"].state_shares
    return render_data_parallel_program(plan, parallelize=_state_shards_body if state_shares else None,
                                        shard_batch=_shard_batch_source)


def _state_shards_body(plan: Plan, dp: int) -> str:
    """``parallelize`` and ``make_optimizer`` of a plan whose optimizer states are split by
    ``state_shares`` (``state_runtime``)."""
    weights = tuple(int(weight) for weight in plan.sections["uneven"].state_shares)
    listed = "\n".join(comment(f"  rank {rank}: {weight} of {sum(weights)}") for rank, weight in enumerate(weights))
    return f'''from planner.families.uneven_dp.state_runtime import UnevenStatesOptimizer, attach_state_shards

# Each dp rank's part of the flat vector of trainable parameters: it reduces their gradients
# (reduce-scatter-v), holds their optimizer states and steps them, by its device's memory:
{listed}
STATE_SHARES = {weights!r}


def parallelize(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    """This rank's module: the whole model, its weights whole on the {dp} ranks of "dp" (no
    wrapper: gradients are reduced by the optimizer's reduce-scatter-v of STATE_SHARES)."""
    dp_mesh = mesh["dp"]
{preparation_lines(plan)}    return attach_state_shards(model, mesh, STATE_SHARES)


def make_optimizer(module: torch.nn.Module, mesh: DeviceMesh, optimizer_class, **kwargs):
    """optimizer_class(**kwargs) over this rank's STATE_SHARES part of the flat parameters;
    the updated parts are all-gathered (all-gather-v) into every rank's whole weights."""
    return UnevenStatesOptimizer(module.state_shards, optimizer_class, **kwargs)

'''


def _shard_batch_source(plan: Plan, dp: int) -> str:
    """``BATCH_SHARES`` and ``shard_batch`` of the uneven program."""
    shares = tuple(int(share) for share in plan.sections["uneven"].shares)
    sharded = tuple(str(name) for name, placements in plan.inputs.items()
                    if placements is not None and placements_str(placements) == "(S(0))")
    names = tuple(str(name) for name in plan.inputs)
    listed = "\n".join(comment(f"  rank {rank}: {share} of {plan.batch_size} rows") for rank, share in enumerate(shares))
    return f'''
from planner.families.uneven_dp.runtime import uneven_shard_batch

# Each dp rank's share of the global batch of {plan.batch_size} (by its device's speed and memory):
{listed}
BATCH_SHARES = {shares!r}
BATCH_SHARDED_INPUTS = {sharded!r}
INPUT_NAMES = {names!r}


def shard_batch(args: tuple, kwargs: dict, mesh: DeviceMesh) -> tuple[tuple, dict]:
    """This rank's slice of one global batch: inputs sharded on dim 0 over "dp" keep this
    rank's BATCH_SHARES rows, consecutive (rank 0 first); the others are passed whole."""
    return uneven_shard_batch(args, kwargs, mesh.get_local_rank("dp"), BATCH_SHARES, BATCH_SHARDED_INPUTS,
                              INPUT_NAMES)
''' + (_accumulation_source(plan, shares) if plan.accumulation_steps > 1 else "")


def _accumulation_source(plan: Plan, shares: tuple[int, ...]) -> str:
    """``forward_backward`` of an uneven program that accumulates: each rank over its own
    micro-batches (``Program.forward_backward`` calls it in place of equal cuts of the batch)."""
    steps = int(plan.accumulation_steps)
    listed = "\n".join(comment(f"  rank {rank}: {list(micro_batch_sizes(share, steps))}")
                       for rank, share in enumerate(shares))
    return f'''
from planner.families.uneven_dp.runtime import uneven_forward_backward

# Each rank cuts its own share into the ACCUMULATION_STEPS micro-batches, the same count on
# every rank (the sharded flavours reduce every micro-batch's gradients), smaller ones on a
# rank of fewer rows:
{listed}


def forward_backward(module, args: tuple, kwargs: dict, mesh: DeviceMesh):
    """This rank's forward and backward of one global batch over its ACCUMULATION_STEPS
    micro-batches, each loss weighted by its rows x dp / B: this rank's loss and no output."""
    return uneven_forward_backward(module, args, kwargs, mesh.get_local_rank("dp"), BATCH_SHARES,
                                   ACCUMULATION_STEPS, BATCH_SHARDED_INPUTS, INPUT_NAMES)
'''
