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
"""

from __future__ import annotations

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
from codegen.runtime.program import Program
from codegen.runtime.randomness import NoDropout, switch_off_dropout_attributes, switch_off_dropout_modules
from planner.model_spec import extract_loss


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
    local_optimizer.step()

    diffs = [compare_tensor("loss", loss.detach(), ref_loss.detach(), atol, rtol)]
    expected_grads = {name for name in owned if name in ref_grads}
    missing = sorted(expected_grads ^ set(grads))
    if missing:
        diffs.append(TensorDiff(f"gradient presence of {missing[0]} (stage {stage.index})", float("inf"), float("inf")))
    diffs += [
        compare_tensor(f"grad of {name} (stage {stage.index})", grads[name], ref_grads[name], atol, rtol)
        for name in sorted(set(grads) & expected_grads)
    ]
    expected = optimizer_step_from(optimizer, lr, {name: initial[name] for name in owned}, grads)
    diffs += [
        compare_tensor(f"updated {name} (stage {stage.index})", full_tensor(p.detach()), expected[name], atol, rtol)
        for name, p in owned.items()
    ]
    return verdict_across_ranks(diffs, randomness.line())
