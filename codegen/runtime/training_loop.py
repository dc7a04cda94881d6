"""The training loop of ``launch.py --steps N`` / ``--data module.py:function``.

Each step: the next GLOBAL batch (every rank draws the same one; ``shard_batch`` gives each
rank its slice, as for the example batch), forward and backward through the program,
optional gradient clipping by the global norm, the optimizer step, the learning-rate
schedule. Rank 0 prints per step the loss (the mean over data-parallel ranks), the step
time, tokens/s, model TFLOP/s per device, MFU and peak memory beside the simulator's
prediction for the plan, and writes the same figures as JSON lines with ``--metrics FILE``
(replaced when the run ends: ``codegen.runtime.run_outputs``).
On a terminal a progress bar (``rich``) follows the run. SIGTERM or SIGUSR1 (a scheduler
preempting the job) stops the run after the step in progress, with a checkpoint of that step
(``codegen.runtime.stop_request``); launch.py then exits with status 143.

User data: ``--data path/to/data.py:function``. ``function(batch_size)`` is called once on
every rank with the plan's global batch size and returns an iterable of global batches, each
a tensor (the model's only positional input), a tuple of tensors (its positional inputs, as
the model spec's example ``args``) or a dict (its keyword inputs). Every rank must yield the
same batches (seed any randomness): every batch is compared across ranks, and a failing or
empty data function stops the run with one line (``codegen.runtime.user_data``). Without
``--steps`` the loop runs until the data ends.

Model FLOPs and MFU use the plan's ``SimResult.model_flops`` (Megatron-LM's count) and the
cluster's dense peak for the plan's precision, so measured and predicted MFU are comparable.
"""

from __future__ import annotations

import dataclasses
import json
import math
import resource
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from codegen.runtime.held_parts_norm import HeldPartsNorm
from codegen.runtime.program import Program
from codegen.runtime.run_outputs import open_metrics
from codegen.runtime.stop_request import StopRequest, mean_loss_and_stop
from codegen.runtime.user_data import DataFeed, as_inputs, load_data, skip_batches  # noqa: F401 - as_inputs, load_data re-exported
from planner.errors import LaunchError

SCHEDULES = ("constant", "cosine", "linear")
# The plan's precision -> the cluster's peak_flops key (the same mapping as cost_model.compute,
# which codegen may not import).
PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class LoopOptions:
    """What ``launch.py`` asked of the loop.

    Attributes:
        steps: optimizer steps to run; 0 with ``data`` means until the data ends.
        lr: peak learning rate.
        optimizer: ``adamw`` or ``sgd``.
        schedule: ``constant``, ``cosine`` or ``linear`` decay after warm-up (``SCHEDULES``).
        warmup_steps: steps of linear warm-up from lr/warmup_steps to lr.
        min_lr_ratio: the schedule's final learning rate as a fraction of ``lr``.
        clip_grad_norm: clip gradients to this global L2 norm (None: no clipping).
        data: ``module.py:function`` of the user's batches (None: synthetic batches).
        log_every: print one line every N steps (the first and last are always printed).
        metrics: JSON-lines file of per-step figures written by rank 0 (None: none).
        record_routing: write the MoE layers' routing here (``routing_record``).
        checkpoint_dir: save checkpoints under this folder (``codegen.runtime.checkpoint``).
        save_every: save every N steps (0: only after the last step).
        keep: keep only the N newest complete checkpoints (0: all).
        resume: continue from the latest complete checkpoint in ``checkpoint_dir``: its
            weights, optimizer state, step, RNG state and data position.
        init_from: start from the weights of a plain state_dict file.
        slowdown: 0 for none; else each op a rank runs lasts this many times its CPU
            seconds, times how much slower its device is than the cluster's fastest
            (``codegen.runtime.slowdown``).
        run_identity, resume_from: what ``checkpoint_runs.prepare_checkpoints`` decided
            before the process group started (None: decided here, by the same rules).
    """

    steps: int = 0
    lr: float = 1e-3
    optimizer: str = "adamw"
    schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    clip_grad_norm: float | None = None
    data: str | None = None
    log_every: int = 1
    metrics: str | None = None
    record_routing: str | None = None
    checkpoint_dir: str | None = None
    save_every: int = 0
    keep: int = 0
    resume: bool | str = False
    init_from: str | None = None
    slowdown: float = 0.0
    run_identity: Any = None
    resume_from: Any = None


@dataclass
class StepRecord:
    """The measured figures of one step (what ``--metrics`` writes)."""

    step: int
    loss: float
    lr: float
    step_time_s: float
    tokens_per_s: float
    tflops_per_device: float
    mfu: float
    peak_memory_bytes: int
    grad_norm: float | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class TrainingRun:
    """What ``train`` returns: every step's record, in order."""

    records: list[StepRecord] = field(default_factory=list)
    stopped_by: str | None = None  # the signal that stopped the run early (stop_request), if any

    @property
    def step_times(self) -> list[float]:
        return [record.step_time_s for record in self.records]


def schedulable(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` whose groups' ``lr`` a schedule sets: ``optimizer``, or
    for ZeRO-1 (``ShardedStatesOptimizer``, not an Optimizer itself) the inner optimizer
    that holds its groups."""
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer.inner


def learning_rate_factor(step: int, schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The multiplier of the peak learning rate at optimizer step ``step`` (0-based): linear
    warm-up over ``warmup_steps`` (step s gets (s + 1) / warmup_steps), then ``schedule``
    from 1 down to ``min_lr_ratio`` at the last step (``constant`` stays at 1). With no
    known total (``total_steps`` = 0: until the data ends) decay schedules hold at 1."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= 0:
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if schedule == "linear":
        shape = 1.0 - progress
    else:  # cosine (Loshchilov & Hutter, SGDR, ICLR 2017), without restarts
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def clip_gradients(parameters: Iterable[torch.nn.Parameter], max_norm: float, sum_group=None,
                   holders: Callable[[torch.nn.Parameter], int] | None = None) -> float:
    """Scale the gradients so their global L2 norm is at most ``max_norm`` (as
    ``torch.nn.utils.clip_grad_norm_`` on one device); returns the norm before clipping.

    A plain gradient is whole on this rank. A DTensor gradient sharded on one mesh axis adds
    its local squared norm to that axis's sum, so one all-reduce per axis covers every such
    gradient (rather than one per parameter); any other DTensor's norm is taken by DTensor.
    ``sum_group``: the process group whose ranks hold DIFFERENT parameters (a pipeline's
    stages), over which the squared norms are summed; None when every rank holds them all.
    ``holders(param)``: how many ranks of ``sum_group`` hold that parameter's whole gradient
    (tied weights on several stages; a stage several ranks wide); each adds its squared norm
    divided by that count, so every gradient counts once. None: one each.
    """
    held = [param for param in parameters if param.grad is not None]
    grads = [param.grad for param in held]
    whole = torch.zeros((), dtype=torch.float64, device="cpu")  # summed on the host
    per_axis: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}  # (mesh id, axis) -> (group, local sum)
    for param, grad in zip(held, grads):
        share = 1.0 / holders(param) if holders is not None else 1.0
        if isinstance(grad, DTensor):
            sharded = [axis for axis, placement in enumerate(grad.placements) if not placement.is_replicate()]
            if len(sharded) == 1 and grad.placements[sharded[0]].is_shard():
                key = (id(grad.device_mesh), sharded[0])
                group, total = per_axis.get(key, (grad.device_mesh.get_group(sharded[0]), 0.0))
                local = torch.linalg.vector_norm(grad.to_local(), 2).detach().to(torch.float64).cpu() ** 2
                per_axis[key] = (group, total + local * share)
                continue
            norm = torch.linalg.vector_norm(grad, 2)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        else:
            norm = torch.linalg.vector_norm(grad, 2)
        whole = whole + norm.detach().to(torch.float64).cpu() ** 2 * share
    device = grads[0].device if grads else torch.device("cpu")
    for group, local in per_axis.values():
        local = torch.as_tensor(local, dtype=torch.float64, device=device)
        dist.all_reduce(local, group=group)
        whole = whole + local.cpu()
    if sum_group is not None:
        summed = whole.to(device)
        dist.all_reduce(summed, group=sum_group)
        whole = summed.cpu()
    total = float(whole.sqrt())
    coefficient = max_norm / (total + 1e-6)
    if coefficient < 1.0:
        for grad in grads:
            grad.mul_(coefficient)
    return total


@dataclass(frozen=True)
class NormSum:
    """Where a pipeline's gradient norms are summed: ``group`` (its stages' ranks) and
    ``holders(param)``, how many of them hold that parameter's gradient (``clip_gradients``)."""

    group: Any
    holders: Callable[[torch.nn.Parameter], int]


def gradient_clipper(program: Program, model: torch.nn.Module, module: torch.nn.Module,
                     norm_sum: NormSum | None) -> Callable[[float], float]:
    """What clips this program's gradients to a global norm (returning the norm before):
    ``clip_gradients`` by mesh axes, or for a program with MoE expert layouts, whose ranks
    hold experts and their copies in shapes no mesh describes, ``HeldPartsNorm`` (each
    expert counted once). A collective: every rank calls it before the first step."""
    if program.plan.expert_layouts:
        return HeldPartsNorm(model, module).clip
    if norm_sum is None:
        return lambda max_norm: clip_gradients(module.parameters(), max_norm)
    return lambda max_norm: clip_gradients(module.parameters(), max_norm, norm_sum.group, norm_sum.holders)


def random_like(tree):
    """A batch with the structure of ``tree``: floats ~ N(0, 1), integers in the example's range."""
    if isinstance(tree, torch.Tensor):
        if tree.is_floating_point():
            return torch.randn_like(tree)
        high = int(tree.max().item()) + 1 if tree.numel() else 1
        return torch.randint_like(tree, 0, max(high, 1))
    if isinstance(tree, dict):
        return {key: random_like(value) for key, value in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(random_like(value) for value in tree)
    return tree


def synthetic_batches(args: tuple, kwargs: dict) -> Iterator[tuple[tuple, dict]]:
    """Random global batches shaped like the example, the same on every rank (seeded per step)."""
    step = 0
    while True:
        torch.manual_seed(1000 + step)
        yield random_like(args), random_like(kwargs)
        step += 1


class StepMeter:
    """Turns a measured step time into the figures the plan predicted (tokens/s, model
    TFLOP/s per device, MFU), from the plan's ``SimResult`` and cluster."""

    def __init__(self, program: Program) -> None:
        plan = program.plan
        estimate = plan.estimate
        self.predicted_step_s = estimate.step_time_s
        self.tokens_per_step = estimate.tokens_per_s * estimate.step_time_s if estimate.tokens_per_s else 0.0
        self.samples_per_step = plan.batch_size
        self.model_flops = estimate.model_flops
        self.world = plan.world_size
        device = plan.cluster.device_of(0)
        self.peak_flops = device.flops_for(PRECISION_DTYPES.get(plan.precision, "float32"))
        self.predicted_mfu = estimate.mfu

    def throughput(self, step_time_s: float) -> tuple[float, float, float]:
        """(tokens/s (samples/s when the inputs have no sequence), TFLOP/s per device, MFU)."""
        per_step = self.tokens_per_step or self.samples_per_step
        flops_per_device = self.model_flops / step_time_s / self.world
        return per_step / step_time_s, flops_per_device / 1e12, flops_per_device / self.peak_flops


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: the CUDA caching allocator's peak on a GPU, else the
    peak resident set size (Linux reports it in KiB)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()


def _say(text: str) -> None:
    if dist.get_rank() == 0:
        print(text, flush=True)


def _format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def build_step(program: Program, mesh) -> tuple[torch.nn.Module, Callable, Any, tuple, dict, Any]:
    """This rank's module, its forward-backward on a global batch, where gradient norms are
    summed (a pipeline's ``NormSum``; None otherwise), the example batch, and the full model."""
    model, module, args, kwargs = program.build_module(mesh)  # this rank's shards only
    if program.is_pipeline:
        pipeline = program.module.make_pipeline(module, mesh)

        def forward_backward(batch_args, batch_kwargs):  # every micro-batch, through the schedule
            local_args, local_kwargs = program.shard_batch(batch_args, batch_kwargs, mesh)
            return pipeline.step(local_args, local_kwargs)

        norm_sum = NormSum(pipeline.pp_group, pipeline.gradient_holders)
    else:
        # Under uneven batch shares a rank's loss counts b_r * dp / B in the mean over the ranks
        # that the loop logs (Program.loss_weight; 1 for even rows): the whole batch's loss.
        weight = program.loss_weight(mesh)

        def forward_backward(batch_args, batch_kwargs):  # in the plan's micro-batches, if it accumulates
            return program.forward_backward(module, batch_args, batch_kwargs, mesh)[0] * weight

        norm_sum = None
    return module, forward_backward, norm_sum, args, kwargs, model


StepHook = Callable[[int, torch.nn.Module, torch.optim.Optimizer], None]


def train(program: Program, mesh, options: LoopOptions, after_step: list[StepHook] | None = None,
          profiler: Any = None) -> TrainingRun:
    """Run the loop (see the module docstring); returns the per-step records.

    ``after_step`` hooks run after each optimizer step with (step number from 1, module,
    optimizer): the place for checkpointing. ``profiler``: a started ``torch.profiler``
    session whose ``step()`` is called after each step (``codegen.runtime.profiling``).
    """
    module, forward_backward, norm_sum, args, kwargs, model = build_step(program, mesh)
    optimizer, schedule, checkpointer, first_step = start_optimizing(program, mesh, options, model, module)
    clip = gradient_clipper(program, model, module, norm_sum) if options.clip_grad_norm is not None else None
    next_batch = batch_source(program, options, args, kwargs)
    skip_batches(next_batch, first_step)  # the data position: the batches the checkpointed run consumed
    meter = StepMeter(program)
    device = program.device()
    metrics = open_metrics(options.metrics, dist.get_rank(), first_step)  # checked before the run (run_outputs)
    progress = _progress_bar(options.steps)
    run = TrainingRun()
    stop_request = StopRequest().install()
    pacer = _pacer(program, options)
    try:
        if pacer is not None:
            pacer.__enter__()
        step = first_step
        while options.steps == 0 or step < options.steps:
            batch = next_batch()
            if batch is None:
                if options.steps:
                    _say(f"the data ended after {step} of {options.steps} steps")
                break
            batch_args, batch_kwargs = batch
            _synchronize()
            start = time.perf_counter()
            loss = forward_backward(batch_args, batch_kwargs)
            norm = clip(options.clip_grad_norm) if clip is not None else None
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
            _synchronize()
            elapsed = time.perf_counter() - start
            step += 1
            tokens, tflops, mfu = meter.throughput(elapsed)
            mean_loss, stopping = mean_loss_and_stop(loss, stop_request)
            record = StepRecord(step, mean_loss, lr, elapsed, tokens, tflops, mfu, peak_memory_bytes(device), norm)
            run.records.append(record)
            stop_on_non_finite(record, checkpointer)
            for hook in after_step or ():
                hook(step, module, optimizer)
            saving = step == options.steps or (options.save_every and step % options.save_every == 0)
            if checkpointer is not None and (saving or stopping):
                _said_complete(checkpointer.save(step))
            if profiler is not None:
                profiler.step()
            if metrics is not None:
                metrics.write_line(json.dumps(record.to_json()))
            last = options.steps and step == options.steps
            if step == 1 or last or step % options.log_every == 0:
                _say(_step_line(record, options.steps, meter))
            if progress is not None:
                progress.advance()
            if stopping:
                run.stopped_by = stop_request.signal_name or "a signal to another rank"
                break
        if checkpointer is not None and options.steps == 0 and run.records and not options.save_every:
            _said_complete(checkpointer.save(step))  # the data ended: keep where it ended
    finally:
        if pacer is not None:
            pacer.__exit__(None, None, None)
            print(pacer.summary(dist.get_rank(), len(run.records)), flush=True)  # every rank: each its own
        stop_request.restore()
        if checkpointer is not None:
            _said_complete(checkpointer.wait())
        if metrics is not None:
            metrics.publish()  # the steps that ran, also after an error or a signal
        if progress is not None:
            progress.close()
    _say(_summary(run, meter))
    if run.stopped_by is not None:
        kept = f"its checkpoint is in {options.checkpoint_dir}; continue with --resume" if checkpointer is not None \
            else "nothing was saved (no --checkpoint-dir)"
        _say(f"stopped by {run.stopped_by} after step {step}: {kept}")
    if options.record_routing is not None:
        from codegen.runtime.routing_record import write_recorded_routing

        stats = write_recorded_routing(model, len(run.records), options.record_routing)
        _say(f"routing of {len(stats.layers)} MoE layer(s) written to {options.record_routing} ({stats.source})")
    return run


def _pacer(program: Program, options: LoopOptions):
    """With ``--slowdown-from-cluster``: the mode that stretches every op of this rank to its
    device's speed (``codegen.runtime.slowdown``); else None."""
    if not options.slowdown:
        return None
    from codegen.runtime.slowdown import paced, slowdown_factor

    return paced(slowdown_factor(program.plan, dist.get_rank(), options.slowdown))


def batch_source(program: Program, options: LoopOptions, args: tuple, kwargs: dict) -> Callable[[], tuple[tuple, dict] | None]:
    """A function returning each step's global batch (None when the data ended): the user's
    ``--data``, checked on every rank alike (``codegen.runtime.user_data.DataFeed``), or
    synthetic batches shaped like the example."""
    if options.data is None:
        synthetic = synthetic_batches(args, kwargs)
        return lambda: next(synthetic)
    ranges = getattr(program.module, "INDEX_INPUTS", {})  # programs compiled before it existed check no ranges
    feed = DataFeed(options.data, program.plan.batch_size, args, kwargs, program.device(), list(program.plan.inputs), ranges)
    return feed.next


def start_optimizing(program: Program, mesh, options: LoopOptions, model, module):
    """The optimizer of ``module``, its learning-rate schedule, the checkpointer (or None) and
    the step to start from: 0, or the step of the checkpoint resumed, with the schedule
    stepped to where that run left it. ``train`` and co-located jobs start alike."""
    from codegen.runtime.optimizers import optimizer_class

    optimizer = program.make_optimizer(module, mesh, optimizer_class(options.optimizer), lr=options.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        schedulable(optimizer),
        lambda step: learning_rate_factor(step, options.schedule, options.warmup_steps, options.steps, options.min_lr_ratio),
    )
    checkpointer, first_step = start_checkpoints(program, options, model, module, optimizer)
    for _ in range(first_step):
        schedule.step()  # the learning rate where the checkpointed run left it
    return optimizer, schedule, checkpointer, first_step


def start_checkpoints(program: Program, options: LoopOptions, model, module, optimizer):
    """The run's ``Checkpointer`` (None without a checkpoint folder) and its first step: the
    checkpoint's when resuming, else 0 (after loading ``init_from``'s weights, if given: with
    ``resume="auto"``, only when there is no checkpoint to resume)."""
    from codegen.runtime.checkpoint import Checkpointer, init_from
    from codegen.runtime.checkpoint_runs import prepare_checkpoints

    identity, found = options.run_identity, options.resume_from
    if identity is None and options.checkpoint_dir is not None:  # not decided by launch.py (a user's own loop)
        identity, found = prepare_checkpoints(program, options.checkpoint_dir, options.resume, options.init_from,
                                              options.optimizer)
    if options.init_from is not None and found is None:  # with --resume auto, a checkpoint supersedes the file
        count = init_from(Path(options.init_from), model, module)
        _say(f"initialised {count} tensors from {options.init_from}")
    if options.checkpoint_dir is None:
        return None, 0
    checkpointer = Checkpointer(Path(options.checkpoint_dir), model, module, optimizer, identity, program.plan.name,
                                options.keep)
    if found is None:
        auto = "--resume auto: no checkpoint there yet; " if options.resume else ""
        _say(f"{auto}checkpoints of run {identity.id[:8]} go to {options.checkpoint_dir}")
        return checkpointer, 0
    step = checkpointer.resume(found)
    _say(f"resumed from {found.folder} at step {step} (run {identity.id[:8]})")
    return checkpointer, step


def stop_on_non_finite(record: StepRecord, checkpointer) -> None:
    """Stop the run when a step's loss (or its gradients' norm) is not finite, before that
    step is checkpointed: training on would write NaN weights over good checkpoints (and
    ``--keep`` would then delete those). Every rank sees the same figures (the loss is the
    mean over ranks, the norm global), so every rank stops at the same step.

    Raises:
        LaunchError: naming the step, the figure and the checkpoint to resume from.
    """
    figures = {"loss": record.loss, "gradient norm": record.grad_norm}
    bad = next(((name, value) for name, value in figures.items() if value is not None and not math.isfinite(value)), None)
    if bad is None:
        return
    if checkpointer is None:
        where = "no checkpoint was being saved (add --checkpoint-dir DIR --save-every N to keep one)"
    else:
        from codegen.runtime.checkpoint import latest_checkpoint

        pending = checkpointer.wait()  # a save still being written is of an earlier, finite step
        _said_complete(pending)
        latest = latest_checkpoint(checkpointer.root)
        where = f"resume from {latest} with --resume" if latest is not None else "no checkpoint was complete yet"
    raise LaunchError(
        f"the {bad[0]} is {bad[1]} at step {record.step}: stopped before saving it; {where}, with a lower --lr, "
        f"--clip-grad-norm or warm-up (--warmup-steps)"
    )


def _said_complete(folder) -> None:
    if folder is not None:
        _say(f"checkpoint complete: {folder}")


def _step_line(record: StepRecord, steps: int, meter: StepMeter) -> str:
    total = f"/{steps}" if steps else ""
    norm = f"  grad norm {record.grad_norm:.3f}" if record.grad_norm is not None else ""
    unit = "tokens/s" if meter.tokens_per_step else "samples/s"
    return (
        f"step {record.step}{total}: {record.step_time_s * 1e3:.2f} ms  loss {record.loss:.6f}  lr {record.lr:.3g}{norm}  "
        f"(predicted {meter.predicted_step_s * 1e3:.2f} ms)  {record.tokens_per_s:,.0f} {unit}  "
        f"{record.tflops_per_device:.3g} TFLOP/s/device  MFU {record.mfu:.1%} (predicted {meter.predicted_mfu:.1%})  "
        f"peak mem {_format_bytes(record.peak_memory_bytes)}"
    )


def _summary(run: TrainingRun, meter: StepMeter) -> str:
    """The mean step time after the first step (which includes one-off set-up) and the
    median, beside the prediction; ratios say how far off the simulator was."""
    if not run.records:
        return "no steps ran"
    steady = run.step_times[1:] or run.step_times
    mean = sum(steady) / len(steady)
    median = sorted(steady)[len(steady) // 2]
    return (
        f"mean step time: {mean * 1e3:.2f} ms over {len(steady)} steps (first step excluded); median "
        f"{median * 1e3:.2f} ms; predicted {meter.predicted_step_s * 1e3:.2f} ms "
        f"(measured/predicted {median / meter.predicted_step_s:.2f})"
    )


class _Progress:
    """A rich progress bar on rank 0's terminal (nothing when stdout is not a terminal)."""

    def __init__(self, total: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

        self._bar = Progress("training", BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), transient=True)
        self._task = self._bar.add_task("steps", total=total or None)
        self._bar.start()

    def advance(self) -> None:
        self._bar.advance(self._task)

    def close(self) -> None:
        self._bar.stop()


def _progress_bar(steps: int) -> _Progress | None:
    if dist.get_rank() != 0 or not sys.stdout.isatty():
        return None
    return _Progress(steps)


__all__ = ["LoopOptions", "StepRecord", "TrainingRun", "train", "learning_rate_factor", "clip_gradients", "gradient_clipper", "stop_on_non_finite",
           "load_data", "as_inputs", "random_like", "SCHEDULES"]
