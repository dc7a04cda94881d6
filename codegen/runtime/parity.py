"""``launch.py --check``: one training step sharded against the same step on one device.

Every rank builds the model and the global batch from the plan's spec with the same seed,
runs the reference step (forward, loss, backward, optimizer) on the whole batch on its own
(in the plan's micro-batches when it accumulates gradients), then the sharded step through
``model_spmd``, and compares outputs, the loss, every gradient and every updated parameter.
Dropout is switched off in both (modules, functional calls and attention's ``dropout_p``:
``codegen.runtime.randomness``): its random masks cannot match between a sharded and an
unsharded run; the result says what was switched off.

Parameters are compared under their names in the model built from the spec, whole
(``full_parameters``): DTensors are gathered, and a module ``parallelize`` put in place of
one of the model's holding its parameters in another form (an MoE layer's experts, a slice
per rank) gathers them through its ``full_parameters()`` hook.

Updated parameters are compared with the single-device optimizer step applied to the
sharded run's own (gathered) gradients, which were compared with the reference just
before: this checks the sharded optimizer step exactly, without amplifying rounding noise.
Comparing with the reference's step would: AdamW's first step moves each weight by about
``lr * g / (|g| + eps)``, so a gradient element near ``eps`` (1e-8) that differs by 1e-9
between two correct summation orders (tensor parallelism all-reduces partial matmuls)
moves its weight by a few 1e-5 more or less.

In float64 (``launch.py --check --fp64``), both steps run with the model and its floating
inputs cast to float64, for fp32 plans of models whose fp32 rounding is amplified past any
useful tolerance: in HuggingFace's MobileNet-V1/V2 and LeViT built at 32-64 pixels (their
last batch norms normalise over 4 values per channel; most of MobileNet's channels have a
batch variance below batch norm's eps), the single-device fp32 step is itself 50-180x the fp32 tolerance away from the same step in float64, so no
sharded fp32 program can be judged against it. Rounding in float64 is 2**29 times smaller,
so the same tolerance then tests the program's arithmetic: a missing or doubled collective,
or statistics over the wrong batch, still fail at full size.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_leaves, tree_map

from codegen.runtime.accumulation import forward_backward
from codegen.runtime.optimizers import optimizer_class
from codegen.runtime.parity_compare import (
    ParityResult,
    TensorDiff,
    compare_tensor,
    full_tensor,
    optimizer_step_from,
    single_device_reference,
    verdict_across_ranks,
)
from codegen.runtime.pipeline_parity import check_pipeline_parity
from codegen.runtime.program import Program
from codegen.runtime.randomness import NoDropout, switch_off_dropout_attributes, switch_off_dropout_modules
from planner.errors import LaunchError


def check_float64_applies(program: Program) -> None:
    """Raise ``LaunchError`` (one line) when ``program`` cannot be checked in float64: only
    fp32 plans that are not pipelines can (a bf16 plan's point is its autocast)."""
    if program.plan.precision != "fp32":
        raise LaunchError(f"--fp64 checks fp32 plans; this plan computes in {program.plan.precision}: leave --fp64 out")
    if program.is_pipeline:
        raise LaunchError("--fp64 does not check pipeline programs yet; leave --fp64 out")


def check_parity(
    program: Program,
    mesh: DeviceMesh,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    lr: float = 1e-3,
    optimizer: str = "adamw",
    float64: bool = False,
) -> ParityResult:
    """Run one sharded step and one single-device step and compare them (see module doc).
    A pipeline program runs its step through its schedule (``codegen.runtime.pipeline_parity``).

    Args:
        float64: run both steps with the model and its floating inputs in float64 (fp32,
            non-pipeline plans: ``check_float64_applies``), for models whose fp32 rounding
            the tolerance cannot judge (module docstring).
    """
    if float64:
        check_float64_applies(program)
    if program.is_pipeline:

        return check_pipeline_parity(program, mesh, atol, rtol, lr, optimizer)
    model, args, kwargs = program.build_model()
    if float64:
        model.to(torch.float64)  # parameters and floating buffers (batch norm's running statistics)
        args, kwargs = tree_map(_to_float64, (args, kwargs))
    randomness = switch_off_dropout_modules(model)
    reference = single_device_reference(program, model, mesh)

    # Single device: the whole global batch on this rank alone, in the plan's micro-batches
    # when it accumulates (an MoE layer routes each micro-batch on its own, so its capacity,
    # drops and balance loss are the micro-batch's: the reference must cut the batch alike).
    # Backward too runs without dropout: recomputed blocks replay their forward there.
    no_dropout = NoDropout(randomness)
    with no_dropout:
        # Uneven shares cut micro-batches per rank (planner.families.uneven_dp): their
        # reference is the whole batch in one piece, one device's step.
        steps = 1 if program.batch_shares else program.plan.accumulation_steps
        ref_loss, ref_output = forward_backward(reference, args, kwargs, steps, program.plan.batch_size, _whole_batch)
    # The float attributes functional dropout read its probability from, off at the source:
    # the sharded step reads 0 in forward and when backward recomputes a block alike.
    switch_off_dropout_attributes(model, no_dropout.attributes_in(reference), randomness)
    ref_grads = {name: p.grad.detach() for name, p in reference.named_parameters() if p.grad is not None}
    # The initial weights: the reference's, which no optimizer has stepped (a clone of the
    # model's would be one more copy of the weights on every rank: 0.5 GB for VGG-16).
    initial = {name: p.detach() for name, p in reference.named_parameters()}
    del reference

    # Sharded: this rank's module on this rank's slice of the batch.
    local_module = program.parallelize(model, mesh)
    # Through the program's optimizer hook when it has one (ZeRO-1: a ShardedStatesOptimizer).
    local_optimizer = program.make_optimizer(local_module, mesh, optimizer_class(optimizer), lr=lr)
    program_run = NoDropout(counting=False)
    with program_run:
        # In the plan's micro-batches when it accumulates gradients (no single output then).
        loss, output = program.forward_backward(local_module, args, kwargs, mesh)
    randomness.note_program_random_ops(program_run.report)
    grads = {name: grad for name, (_, grad) in full_parameters(model).items() if grad is not None}

    # The whole batch's loss: the mean over the ranks of theirs, each weighted by b_r * dp / B
    # under uneven shares (Program.loss_weight; 1 for even rows).
    weighted = loss.detach() * program.loss_weight(mesh)
    diffs = [compare_tensor("loss", _global_mean(weighted), ref_loss.detach(), atol, rtol)]
    if output is not None:
        diffs += _compare_outputs(output, ref_output, mesh, program.plan.batch_size, atol, rtol, program.batch_shares)
    missing = sorted(set(ref_grads) ^ set(grads))
    if missing:
        diffs.append(TensorDiff(f"gradient presence of {missing[0]}", float("inf"), float("inf")))
    diffs += [compare_tensor(f"grad of {n}", grads[n], ref_grads[n], atol, rtol) for n in sorted(set(grads) & set(ref_grads))]
    del ref_grads
    # The expected step before the program's own, so the reference's gradients and the
    # initial weights are gone before the program's optimizer states come (memory).
    expected = optimizer_step_from(optimizer, lr, initial, grads)
    del initial, grads
    local_optimizer.step()
    diffs += [
        compare_tensor(f"updated {name}", value, expected[name], atol, rtol) if name in expected
        else TensorDiff(f"parameter {name} (not in the model built from the spec)", float("inf"), float("inf"))
        for name, (value, _) in full_parameters(model).items()
    ]
    result = verdict_across_ranks(diffs, randomness.line(), float64)
    return dataclasses.replace(result, float64_possible=program.plan.precision == "fp32")


def full_parameters(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Every parameter of ``model`` (as ``parallelize`` left it) as one device holds it, by its
    name in the model built from the spec: (value, gradient or None). Collective: every rank
    calls it, in the same order.

    DTensors are gathered whole. A submodule that ``parallelize`` put in place of one of the
    model's modules, holding that module's parameters in another form (a slice of the experts
    per rank, other names), defines the hook

        full_parameters() -> {name relative to the replaced module: (value, gradient or None)}

    which gathers them whole under their original names (the MoE runtime layers do, by their
    placement: ``codegen.runtime.moe``); its own parameters are then not read directly.
    """
    owners = {}
    for path, module in model.named_modules():
        if callable(getattr(module, "full_parameters", None)) and not any(path.startswith(o + ".") for o in owners):
            owners[path] = module
    found = {}
    for name, param in model.named_parameters():
        if not any(name.startswith(owner + ".") for owner in owners):
            found[name] = (full_tensor(param.detach()), None if param.grad is None else full_tensor(param.grad))
    for path, module in owners.items():
        for name, (value, grad) in module.full_parameters().items():  # FSDP2 may shard the replicated ones
            found[f"{path}.{name}" if path else name] = (full_tensor(value), None if grad is None else full_tensor(grad))
    return found


def _compare_outputs(output, ref_output, mesh: DeviceMesh, global_batch: int, atol: float, rtol: float,
                     shares: tuple[int, ...] | None = None) -> list[TensorDiff]:
    """Compare every tensor of the output; batch-sharded ones against their slice of the
    reference (this rank's rows of ``shares`` when the ranks take uneven rows); a scalar
    against the mean over the ranks, weighted by their shares when uneven."""
    leaves = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
    ref_leaves = [t for t in tree_leaves(ref_output) if isinstance(t, torch.Tensor)]
    if len(leaves) != len(ref_leaves):
        return [TensorDiff("output structure", float("inf"), float("inf"))]
    if "dp" in (mesh.mesh_dim_names or ()):
        rank, size = mesh.get_local_rank("dp"), mesh.size(mesh.mesh_dim_names.index("dp"))
    else:  # no batch axis: every output is whole (DTensor outputs are gathered by full_tensor)
        rank, size = 0, 1
    diffs = []
    for index, (local, ref) in enumerate(zip(leaves, ref_leaves)):
        local, ref = full_tensor(local.detach()), ref.detach()
        if local.dim() == 0:
            local = _global_mean(local * (shares[rank] * size / global_batch if shares else 1.0))
        elif shares and ref.dim() > 0 and ref.shape[0] == global_batch and local.shape[0] == shares[rank]:
            start = sum(shares[:rank])
            ref = ref[start : start + shares[rank]]
        elif ref.dim() > 0 and ref.shape[0] == global_batch and local.shape[0] == global_batch // size:
            ref = ref.chunk(size, dim=0)[rank]
        diffs.append(compare_tensor(f"output[{index}]", local, ref, atol, rtol))
    return diffs


def _whole_batch(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The single device's part of a (micro-)batch: all of it."""
    return args, kwargs


def _to_float64(value):
    return value.to(torch.float64) if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def _global_mean(value: torch.Tensor) -> torch.Tensor:
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / dist.get_world_size()

