"""Two training jobs in one process, interleaved so that one job's gradient all-reduces run
while the other job computes (CrossoverScheduler's crossover synchronisation).

A job's step is split in two halves:

- ``compute``: its next global batch, forward and backward. DDP launches each gradient
  bucket's all-reduce as soon as the bucket is full, as it always does, but through a comm
  hook (``DeferredReduction``) that does not wait for it: backward returns with the
  all-reduces still in flight on the job's own process group.
- ``finish``: wait for those all-reduces, then the optimizer step, the learning-rate
  schedule, the step's mean loss, the non-finite check and the checkpoint.

In crossover order the halves interleave as A.compute, B.finish (of the previous round),
B.compute, A.finish, A.compute, ...: A's all-reduces are in flight while B computes and the
reverse. Each job still runs compute -> reduce -> step -> compute, the same arithmetic as
alone: the hook divides every bucket by the group size and sums it over the group, which is
what DDP's own reduction does, on the same buckets. Synthetic batches reseed the generator
every step (``training_loop.synthetic_batches``), and a job draws its batch right before its
forward, so its dropout draws the same numbers as alone.
"""

from __future__ import annotations

import time
from pathlib import Path
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from codegen.runtime.program import Program
from codegen.runtime.training_loop import (
    LoopOptions,
    batch_source,
    build_step,
    clip_gradients,
    start_optimizing,
    stop_on_non_finite,
    StepRecord,
)
from codegen.runtime.user_data import skip_batches
from planner.errors import LaunchError, one_line


@dataclass
class DeferredReduction:
    """A DDP comm hook that starts each bucket's all-reduce and returns at once.

    ``hook(state, bucket)`` divides the bucket by the group size and all-reduces it (sum) with
    ``async_op=True``, as DDP's default reduction does, and hands DDP a future that is
    already complete, holding the bucket itself: DDP's end of backward then waits for nothing,
    and the gradients (views of the bucket, ``gradient_as_bucket_view=True``) become the
    averaged ones when the all-reduce lands. ``wait`` must run before anything reads them.
    """

    group: dist.ProcessGroup
    works: list = field(default_factory=list)

    def hook(self, state, bucket):  # unannotated: DDP checks annotations, which this file's are strings
        buffer = bucket.buffer()
        buffer.div_(self.group.size())
        self.works.append(dist.all_reduce(buffer, group=self.group, async_op=True))
        done = torch.futures.Future()
        done.set_result(buffer)
        return done

    @property
    def in_flight(self) -> bool:
        return bool(self.works)

    def wait(self) -> None:
        """Block until every all-reduce started since the last wait has landed."""
        works, self.works = self.works, []
        for work in works:
            work.wait()


class Job:
    """One job of a co-located program: its module, optimizer, schedule, batches and
    checkpoints, on its own mesh (and so its own process group), stepped in two halves."""

    def __init__(self, label: str, program: Program, mesh, options: LoopOptions) -> None:
        self.label, self.program, self.mesh, self.options = label, program, mesh, options
        # How failures name the job: its plan and model file ("zero1 (dp=2) of cnn.py").
        source = program.plan.model.source if program.plan.model is not None else ""
        model_file = source if source.startswith("hf:") else Path(source.split(":")[0]).name
        self.name = f"{program.plan.name} of {model_file}" if model_file else program.plan.name
        module, self._forward_backward, _, args, kwargs, model = build_step(program, mesh)
        if not isinstance(module, DistributedDataParallel):  # compile refuses other plans; a hand-edited folder
            raise LaunchError(f"job {label} ({self.name}): its program does not wrap the model in DDP; "
                              f"compile the co-located program again with `planner compile --colocate`")
        self.module, self.model = module, model
        self.group = mesh.get_group()
        self.reduction = DeferredReduction(self.group)
        module.register_comm_hook(None, self.reduction.hook)
        self.optimizer, self.schedule, self.checkpointer, self.step = start_optimizing(program, mesh, options, model,
                                                                                        module)
        self._next_batch = batch_source(program, options, args, kwargs)
        skip_batches(self._next_batch, self.step)
        self._loss: torch.Tensor | None = None
        self.completed = None  # a checkpoint folder completed since the caller last looked
        self.losses: list[tuple[int, float]] = []  # (step, mean loss over the job's ranks)

    @property
    def done(self) -> bool:
        return self.step >= self.options.steps

    def compute(self) -> None:
        """Forward and backward of the next step; its gradient all-reduces are left in flight."""
        with self._named("step", self.step + 1):
            batch_args, batch_kwargs = self._next_batch()
            self._loss = self._forward_backward(batch_args, batch_kwargs)

    def finish(self) -> None:
        """Wait for the step's all-reduces, step the optimizer and schedule, check the loss
        and save a checkpoint when one is due."""
        with self._named("step", self.step + 1):
            self.reduction.wait()
            if self.options.clip_grad_norm is not None:  # DDP's gradients are whole on every rank: no collective
                norm = clip_gradients(self.module.parameters(), self.options.clip_grad_norm)
            else:
                norm = None
            lr = self.optimizer.param_groups[0]["lr"]
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.schedule.step()
            self.step += 1
            loss = self._loss.detach().reshape(()).to(torch.float64)
            dist.all_reduce(loss, group=self.group)  # the mean over this job's ranks, as launch.py logs it
            mean = float(loss) / self.group.size()
            self.losses.append((self.step, mean))
            stop_on_non_finite(StepRecord(self.step, mean, lr, 0.0, 0.0, 0.0, 0.0, 0, norm), self.checkpointer)
            saving = self.step == self.options.steps or (self.options.save_every and self.step % self.options.save_every == 0)
            if self.checkpointer is not None and saving:
                self.completed = self.checkpointer.save(self.step)  # the previous save, now complete (or None)

    def close(self) -> list:
        """Let every all-reduce still in flight land and every checkpoint being written
        complete; returns the folders of checkpoints completed now."""
        self.reduction.wait()
        return [self.checkpointer.wait()] if self.checkpointer is not None else []

    def parameters(self) -> dict[str, torch.Tensor]:
        """A copy of every parameter of this rank's module, by the model's names."""
        return {name: param.detach().clone() for name, param in self.module.module.named_parameters()}

    def _named(self, what: str, step: int) -> "_JobContext":
        return _JobContext(self, f"{what} {step}")


class _JobContext:
    """Turns a failure inside a job into one line naming the job (both jobs stop with it)."""

    def __init__(self, job: Job, where: str) -> None:
        self.job, self.where = job, where

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        if error is None or isinstance(error, (KeyboardInterrupt, JobFailed)):
            return False
        user = isinstance(error, LaunchError)
        detail = str(error) if user else f"{type(error).__name__}: {one_line(str(error))[:300]}"
        raise JobFailed(f"job {self.job.label} ({self.job.name}) failed at {self.where}, which stops both jobs: "
                        f"{detail}", user_error=user) from error


class JobFailed(Exception):
    """One job of a co-located program failed; the message names it. ``user_error``: it
    failed on something the user can change (a non-finite loss, its data), rather than an
    exception in the model's code or ours."""

    def __init__(self, message: str, *, user_error: bool) -> None:
        super().__init__(message)
        self.user_error = user_error


def run_rounds(jobs: list[Job], crossover: bool, say) -> list[float]:
    """Train every job to its ``options.steps``: in crossover order (one job's all-reduces in
    flight while the next computes), or one after the other (each job's step whole, its
    all-reduces waited for at once). Returns each round's seconds (a round: one step of every
    job, between two barriers)."""
    rounds: list[float] = []
    pending: Job | None = None  # the job whose all-reduces are in flight
    logged = {job.label: 0 for job in jobs}  # each job's losses already printed
    try:
        while not all(job.done for job in jobs):
            _synchronize()
            start = time.perf_counter()
            for job in jobs:
                job.compute()
                if not crossover:
                    job.finish()
                    continue
                if pending is not None:
                    pending.finish()  # its all-reduces ran under this job's compute
                pending = job
            if pending is not None and all(job.done or job is pending and job.step + 1 >= job.options.steps
                                           for job in jobs):
                pending.finish()  # the last round: nothing left to hide it under
                pending = None
            _synchronize()
            rounds.append(time.perf_counter() - start)
            # The steps each job finished in this round (in crossover order B's step k finishes in round k + 1).
            finished = "  ".join(f"{job.label} step {step} loss {loss:.6f}" for job in jobs
                                 for step, loss in job.losses[logged[job.label]:])
            logged.update({job.label: len(job.losses) for job in jobs})
            for job in jobs:
                if job.completed is not None:
                    say(f"job {job.label}: checkpoint complete: {job.completed}")
                    job.completed = None
            say(f"round {len(rounds)}: {rounds[-1] * 1e3:.2f} ms  {finished}")
    finally:
        for job in jobs:
            for folder in job.close():
                if folder is not None:
                    say(f"job {job.label}: checkpoint complete: {folder}")
    return rounds


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()
