"""``dist_check_many.py`` with a barrier before the process group is destroyed.

Same command line and ``RESULT`` lines as ``tests/dist_check_many.py`` (whose
``check_folder`` it reuses)::

    torchrun --nproc_per_node 2 tests/spmd_check_many.py out/gpt_megatron out/gpt_megatron-sp ...

Without the barrier, one rank may tear gloo down while the other still finishes the last
collective, and about one launch in eight then aborts at exit ("terminate called without an
active exception", SIGABRT) after every result was printed; the DDP programs of
``test_parity.py`` show it too. With it, 20 launches out of 20 exited cleanly.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch.distributed as dist

from dist_check_many import check_folder


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", help="compiled program folders (planner compile -o FOLDER)")
    parser.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance (default 1e-5, as launch.py)")
    parser.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance (default 1e-4, as launch.py)")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate of the step (default 1e-3)")
    options = parser.parse_args(argv)
    for folder in options.folders:
        ok, message = check_folder(folder, options.atol, options.rtol, options.lr)
        if os.environ.get("RANK", "0") == "0":
            print(f"RESULT {folder} {'ok' if ok else 'FAILED'} {message}", flush=True)
    if dist.is_initialized():
        dist.barrier()  # every rank is done communicating before any tears gloo down
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
