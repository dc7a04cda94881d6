"""``launch.py --check`` for pipeline programs (``codegen.pipeline_emit``; ``--steps`` runs
through ``codegen.runtime.training_loop.train``).

The check is ``codegen.runtime.parity``'s (its comparison: ``codegen.runtime.parity_compare``), through the schedule: every rank builds the model
and the global batch with the same seed and runs the single-device step on its own; then
this rank's stage runs one step of the pipeline (``make_pipeline(stage, mesh).step``: all
micro-batches forward and backward) and one optimizer step. Compared, on every rank:

- the loss: the mean of the micro-batches' losses, computed on the last stage and broadcast
  over ``pp``, against the single-device loss (the model's output is not compared otherwise:
  only the last stage has it, one micro-batch at a time);
- the gradient of every parameter this rank's stage holds (gathered over the stage mesh),
  tied weights after their gradients were summed over the stages that hold them;
- every such parameter after the optimizer step, against the single-device step applied to
  the pipeline's own gradients (as ``parity`` explains).

A model with MoE layers routes every micro-batch on its own (the capacity, drops and balance
loss are a micro-batch's), so its single-device step runs the same micro-batches: the samples
rank r of dp takes for micro-batch i, for every r in rank order (the group's routing order),
each micro-batch's loss, and their mean back-propagated. The expert weights of the MoE layers
of this rank's stages (``codegen.runtime.pipeline_moe``) are compared whole: gathered over the
stage's dp ranks, gradients and updated values.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

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
from codegen.runtime.pipeline_moe import stage_moe_layers
from codegen.runtime.program import Program
from codegen.runtime.randomness import NoDropout, switch_off_dropout_attributes, switch_off_dropout_modules
from planner.model_loss import extract_loss
from planner.moe_blocks import find_moe_blocks


def check_pipeline_parity(
    program: Program, mesh: DeviceMesh, atol: float = 1e-5, rtol: float = 1e-4, lr: float = 1e-3, optimizer: str = "adamw"
) -> ParityResult:
    """One pipeline step against one device (see the module docstring)."""
    model, args, kwargs = program.build_model()
    randomness = switch_off_dropout_modules(model)
    reference = single_device_reference(program, model, mesh)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}

    no_dropout = NoDropout(randomness)
    with no_dropout:
        if find_moe_blocks(model):
            ref_loss = micro_batch_loss(reference, args, kwargs, _dp_size(mesh), program.module.MICRO_BATCHES)
        else:
            ref_loss = extract_loss(reference(*args, **kwargs))
        ref_loss.backward()
    switch_off_dropout_attributes(model, no_dropout.attributes_in(reference), randomness)  # see parity.check_parity
    ref_grads = {name: p.grad.detach().clone() for name, p in reference.named_parameters() if p.grad is not None}

    stage = program.parallelize(model, mesh)
    pipeline = program.module.make_pipeline(stage, mesh)
    local_args, local_kwargs = program.shard_batch(args, kwargs, mesh)
    local_optimizer = program.make_optimizer(stage, mesh, optimizer_class(optimizer), lr=lr)
    with NoDropout(counting=False):
        loss = pipeline.step(local_args, local_kwargs)
    owned = dict(stage.named_model_parameters())
    grads = {name: full_tensor(p.grad) for name, p in owned.items() if p.grad is not None}
    layers = stage_moe_layers(stage)
    experts = {name: entry for layer in layers for name, entry in layer.full_experts().items()}
    grads.update({name: grad for name, (_, grad) in experts.items() if grad is not None})
    local_optimizer.step()
    updated = {name: full_tensor(p.detach()) for name, p in owned.items()}
    updated.update({name: value for layer in layers for name, (value, _) in layer.full_experts().items()})

    diffs = [compare_tensor("loss", loss.detach(), ref_loss.detach(), atol, rtol)]
    expected_grads = {name for name in owned if name in ref_grads}
    expected_grads |= {name for name in experts if name in ref_grads}
    missing = sorted(expected_grads ^ set(grads))
    if missing:
        diffs.append(TensorDiff(f"gradient presence of {missing[0]} (stage {stage.index})", float("inf"), float("inf")))
    diffs += [
        compare_tensor(f"grad of {name} (stage {stage.index})", grads[name], ref_grads[name], atol, rtol)
        for name in sorted(set(grads) & expected_grads)
    ]
    expected = optimizer_step_from(optimizer, lr, {name: initial[name] for name in updated}, grads)
    diffs += [
        compare_tensor(f"updated {name} (stage {stage.index})", value, expected[name], atol, rtol)
        for name, value in updated.items()
    ]
    return verdict_across_ranks(diffs, randomness.line())


def micro_batch_loss(model: torch.nn.Module, args: tuple, kwargs: dict, dp: int, micro_batches: int) -> torch.Tensor:
    """The mean of ``model``'s losses on the pipeline's micro-batches of one global batch (see
    the module docstring): micro-batch i holds, for each dp rank r in order, the i-th of the
    ``micro_batches`` equal parts of rank r's contiguous share of the batch. Inputs whose
    first dim is not the batch pass whole."""
    first = next(value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor) and value.dim())
    batch, device = first.size(0), first.device
    share = batch // dp
    size = share // micro_batches
    losses = []
    for micro in range(micro_batches):
        index = torch.cat([
            torch.arange(rank * share + micro * size, rank * share + (micro + 1) * size, device=device) for rank in range(dp)
        ])

        def part(value):
            if isinstance(value, torch.Tensor) and value.dim() and value.size(0) == batch:
                return value.index_select(0, index.to(value.device))
            return value

        losses.append(extract_loss(model(*(part(a) for a in args), **{k: part(v) for k, v in kwargs.items()})))
    return torch.stack(losses).mean()


def _dp_size(mesh: DeviceMesh) -> int:
    names = tuple(mesh.mesh_dim_names or ())
    return mesh.size(names.index("dp")) if "dp" in names else 1
