"""A graceful stop of the training loop on a signal.

A cluster scheduler that preempts or times out a job sends SIGTERM first (Slurm, Kubernetes;
torchrun, itself terminated, forwards it to every rank and waits before it kills them), and
Slurm's ``--signal=USR1@SECONDS`` sends SIGUSR1 as an earlier warning. Either one asks the
loop to finish the step it is in, save a checkpoint of that step and leave, so the job
resumes (``--resume``) from where it stopped instead of from its last periodic checkpoint.

The ranks must stop at the same step (a checkpoint is a collective), though each receives
the signal at its own moment: every step already all-reduces its loss for the log, and the
stop flag rides in the same tensor, so agreeing costs no collective of its own.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Self

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# What launch.py exits with after such a stop: the status of a process ended by SIGTERM, so
# job scripts see that the run did not finish.
STOPPED_EXIT_STATUS = 128 + int(signal.SIGTERM)


class StopRequest:
    """Catches ``STOP_SIGNALS`` between ``install`` and ``restore`` (or as a context manager)
    on the main thread, the only one Python lets set handlers (elsewhere it catches nothing),
    and remembers the first."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> Self:
        """Catch the signals from now on; returns itself."""
        if threading.current_thread() is threading.main_thread():
            for number in STOP_SIGNALS:
                self._previous[number] = signal.signal(number, self._catch)
        return self

    def restore(self) -> None:
        """Put back the handlers ``install`` replaced."""
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def __enter__(self) -> Self:
        return self.install()

    def __exit__(self, *_exc) -> None:
        self.restore()

    def _catch(self, number: int, _frame: FrameType | None) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(number).name

    @property
    def requested(self) -> bool:
        """Whether this rank has received a stop signal."""
        return self.signal_name is not None


def mean_loss_and_stop(loss: torch.Tensor, request: StopRequest) -> tuple[float, bool]:
    """The loss's mean over all ranks, and whether any rank has been asked to stop: one
    all-reduce of both, so every rank gets the same answers."""
    # On the loss's device: NCCL reduces only GPU tensors.
    flag = torch.tensor(1.0 if request.requested else 0.0, dtype=torch.float64, device=loss.device)
    both = torch.stack([loss.detach().reshape(()).to(torch.float64), flag])
    dist.all_reduce(both)
    return float(both[0]) / dist.get_world_size(), bool(both[1] > 0)


__all__ = ["STOPPED_EXIT_STATUS", "STOP_SIGNALS", "StopRequest", "mean_loss_and_stop"]
