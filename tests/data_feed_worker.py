"""The ``--data`` agreement of every rank (``codegen.runtime.user_data.DataFeed``), case by
case, in ONE torchrun launch (starting gloo processes costs seconds)::

    torchrun --nproc_per_node 2 tests/data_feed_worker.py DATA_FILE CASE [CASE ...]

Each CASE names a function of DATA_FILE. Every rank feeds it until the data ends or the feed
refuses, and rank 0 prints one line per case::

    RESULT <case> ok <batches>
    RESULT <case> error <the LaunchError's message>

A case that left a rank waiting in a collective would hang the launch (the caller's timeout).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from codegen.runtime.user_data import DataFeed
from planner.errors import LaunchError
from codegen.runtime.launcher import exit_now

# The example batch the feed checks each batch against: features and token ids.
EXAMPLE = (torch.zeros(4, 3), torch.zeros(4, 5, dtype=torch.long))
NAMES = ["x", "ids"]
RANGES = {"ids": (10, (), "embedding 'emb' (10 rows)")}


def run_case(data_file: str, case: str) -> str:
    """Feed ``case`` to the end; returns the RESULT line's tail."""
    feed = DataFeed(f"{data_file}:{case}", 4, EXAMPLE, {}, torch.device("cpu"), NAMES, RANGES)
    try:
        while feed.next() is not None:
            pass
    except LaunchError as error:
        return f"error {error}"
    return f"ok {feed.fetched}"


def main(argv: list[str]) -> int:
    dist.init_process_group("gloo")
    data_file, cases = argv[0], argv[1:]
    for case in cases:
        line = run_case(data_file, case)
        if dist.get_rank() == 0:
            print(f"RESULT {case} {line}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]) or 0)  # not sys.exit: see codegen.runtime.exit_status.exit_now
