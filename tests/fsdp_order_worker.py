"""Print the collectives over "dp" of one compiled program's forward and backward, in the
order rank 0 issued them (for ``tests/test_fsdp_schedule.py``).

    torchrun --nproc_per_node 2 tests/fsdp_order_worker.py <program folder>

Rank 0 prints one ``CALL <op> <size bytes>`` line per collective
(``codegen.runtime.comm_audit.CollectiveCounter``: the op as dispatched, the collective's
whole size), then ``DONE``.
"""

from __future__ import annotations

import os
import sys

from codegen.runtime import load_program
from codegen.runtime.comm_audit import CollectiveCounter, mesh_group_axes
from dist_check_many import tear_down_process_group  # this folder is sys.path[0] under torchrun
from codegen.runtime.launcher import exit_now


def main(folder: str) -> int:
    try:
        program = load_program(folder)
        mesh = program.build_mesh()
        _, module, args, kwargs = program.build_module(mesh)
        counter = CollectiveCounter(mesh_group_axes(mesh))
        with counter:
            program.forward_backward(module, args, kwargs, mesh)
        if os.environ.get("RANK", "0") == "0":
            lines = [f"CALL {call.op} {call.size_bytes}" for call in counter.calls if call.axis == "dp"]
            print("\n".join([*lines, "DONE"]), flush=True)
    finally:
        tear_down_process_group()
    return 0


if __name__ == "__main__":
    exit_now(main(sys.argv[1]) or 0)  # not sys.exit: see codegen.runtime.exit_status.exit_now
