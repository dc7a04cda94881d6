"""Audit the collectives of many compiled programs in one torchrun launch.

    torchrun --nproc_per_node 2 tests/comm_audit_many.py [--sites] out/mlp_ddp out/gpt_fsdp ...

For each folder every rank loads the program and runs one counted training step
(``codegen.runtime.comm_audit.audit_step``); rank 0 prints, per mesh axis of more than one
rank and any axis the plan predicts or the step used, one line::

    AUDIT <folder> <axis> <predicted bytes> <counted bytes>

then ``CALLS <folder> <axis> <op> <group size> <calls> <bytes>`` lines for the busiest rank,
with ``--sites`` also ``SITE <folder> <axis> <op> <calls> <bytes> <site>`` lines (the line of
``model_spmd.py`` behind them, ``codegen.runtime.comm_sites``), or ``AUDIT <folder> FAILED
<error>`` when the program could not run. Exits 0 once every folder
has its lines (the pytest side parses them).
"""

from __future__ import annotations

import os
import sys
import traceback

from codegen.runtime import load_program
from codegen.runtime.comm_audit import audit_step
from codegen.runtime.launcher import exit_now
from dist_check_many import tear_down_process_group  # this folder is sys.path[0] under torchrun


def audit_folder(folder: str, with_sites: bool = False) -> list[str]:
    """The AUDIT and CALLS lines of one program folder (and its SITE lines, if asked)."""
    try:
        program = load_program(folder)
        mesh = program.build_mesh()
        result = audit_step(program, mesh, with_sites=with_sites)
    except Exception as error:  # noqa: BLE001 - reported as this folder's FAILED line
        last = traceback.extract_tb(error.__traceback__)[-1]
        return [f"AUDIT {folder} FAILED {type(error).__name__}: {' '.join(str(error).split())} (at {last.filename}:{last.lineno})"]
    predicted = program.plan.estimate.bytes_per_axis if program.plan.estimate else {}
    lines = [
        f"AUDIT {folder} {axis} {predicted.get(axis, 0.0)!r} {result.counted.get(axis, 0.0)!r}"
        for axis in sorted(set(predicted) | set(result.counted) | {a for a, n in program.plan.mesh.axes if n > 1})
    ]
    lines += [f"CALLS {folder} {axis} {op} {size} {count} {sent!r}" for (axis, op, size), (count, sent) in sorted(result.calls.items())]
    lines += [f"SITE {folder} {axis} {op} {count} {sent!r} {site}" for (axis, site, op), (count, sent) in sorted(result.sites.items())]
    return lines


def main(argv: list[str]) -> int:
    try:
        with_sites = "--sites" in argv
        for folder in (arg for arg in argv if arg != "--sites"):
            lines = audit_folder(folder, with_sites)
            if os.environ.get("RANK", "0") == "0":
                print("\n".join(lines), flush=True)
    finally:
        tear_down_process_group()
    return 0


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
