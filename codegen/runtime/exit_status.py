"""How ``launch.py`` ends: its exit statuses and its one failure line, under torchrun.

Every rank that ends on its own exits with the same status for the same outcome:

==== =====================================================================================
0    done
1    ``--check`` ran and the sharded step does not match one device
2    a user error (a flag, the plan or model files, the data, a checkpoint): ``error: ...``
3    an internal error (a bug in soap-planner, or an exception from the model's own code):
     ``internal error: ...`` (``--debug`` prints the traceback); also a rank whose
     collective lost another rank that stopped first (that rank's line is the root cause)
130  interrupted (Ctrl-C)
143  stopped by SIGTERM/SIGUSR1, after saving a checkpoint of the step in progress (with
     ``--checkpoint-dir``)
==== =====================================================================================

The failure line is printed once, by rank 0, on stderr after everything else rank 0 printed;
other ranks print nothing, and wait ``GRACE_S`` before they exit, so that torchrun, which
stops every rank once one has failed, does not stop rank 0 before it has printed (torchrun
usually ends them in that wait: ``exitcode -15`` in its summary). torchrun itself then exits 1 and prints its ``ChildFailedError``
summary: each failed rank's ``traceback :`` field would say "To enable traceback see ...",
so every rank also writes its line into the error file torchrun gives it
(``TORCHELASTIC_ERROR_FILE``, the file ``torch.distributed.elastic``'s ``@record`` writes),
and the summary shows that line instead, including for a rank that failed alone.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

from planner.errors import one_line
from planner.messages import exception_line
from planner.terminal import inert_line

DONE = 0
PARITY_FAILED = 1
USER_ERROR = 2
INTERNAL_ERROR = 3
INTERRUPTED = 130
# STOPPED (143) lives in codegen.runtime.stop_request, beside the signals it answers.

# A failing rank other than 0 waits this long before it exits: torchrun stops every rank as
# soon as one exits non-zero, and rank 0 must have printed the line first. Ranks start a few
# hundred milliseconds apart (each imports torch), so a flag refused on every rank can be
# refused on rank 1 well before rank 0; a failure every rank shares ends sooner anyway
# (torchrun stops the waiting ranks as soon as rank 0 exits).
GRACE_S = 2.0


# What gloo and NCCL say when a collective loses a rank that exited (torch.distributed's
# DistError subclasses cover NCCL's; gloo raises a plain RuntimeError).
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing")


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective failing because another rank stopped."""
    import torch.distributed as dist

    return isinstance(error, getattr(dist, "DistNetworkError", ())) or any(marker in str(error) for marker in PEER_LOST)


def internal_error_line(error: BaseException) -> str:
    """The one line of an exception that is not a user error: a collective that lost another
    rank (whose own line is torchrun's root cause), or a bug."""
    if is_peer_failure(error):
        return ("internal error: another rank stopped while this one waited for it in a collective; that rank's own "
                "line is in torchrun's summary below")
    return (f"internal error: {one_line(exception_line(error))} (a bug in soap-planner, or an exception in the model's "
            f"own code; rerun with --debug for the traceback, and report it)")


def report_failure(line: str, rank: int, debug: bool = False) -> None:
    """Print ``line`` (rank 0 only, after flushing stdout) and put it in torchrun's error file.

    ``debug``: print the traceback of the exception being handled first (every rank)."""
    if debug:
        traceback.print_exc()
    line = inert_line(line)  # keeps backslashes: text one_line escaped is not escaped twice
    write_elastic_error_file(line)
    if rank == 0:
        sys.stdout.flush()
        print(line, file=sys.stderr, flush=True)


def write_elastic_error_file(line: str) -> None:
    """Write ``line`` to ``TORCHELASTIC_ERROR_FILE`` when torchrun set it, in the form
    ``ErrorHandler.record_exception`` writes (torchrun's summary shows ``py_callstack``, here
    the line itself, and can still set the rank's exit code in it); never raises."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as handle:
            json.dump(record, handle)
    except OSError:
        pass  # torchrun's summary then says what it says without us; the line is still printed


def exit_now(status: int, rank: int) -> None:
    """Leave the process with ``status`` once its output is flushed, skipping the
    interpreter's teardown: after the process group is destroyed, gloo's and autograd's
    native threads can still be joinable while C++ statics are destroyed, which now and then
    aborts a rank ("terminate called without an active exception", exit -6) and would replace
    the status. A failing rank other than 0 first waits ``GRACE_S`` (see there)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if status != 0 and rank != 0:
        time.sleep(GRACE_S)
    os._exit(status)


__all__ = ["DONE", "PARITY_FAILED", "USER_ERROR", "INTERNAL_ERROR", "INTERRUPTED", "internal_error_line",
           "report_failure", "write_elastic_error_file", "exit_now"]
