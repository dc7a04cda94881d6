"""The files ``launch.py`` writes, checked before any work and written atomically.

``--metrics FILE`` (JSON lines), ``--profile FILE`` (measured.json) and ``--record-routing
FILE`` (routing statistics) follow the rule of every soap-planner output
(``planner.outputs``): an existing file is replaced only when soap-planner wrote it (each
writer recognises its own format), unless ``--force``; a folder that is missing or not
writable, or a path that is a folder, is refused. Whatever ``--force`` says, a run never
writes over its own program (``plan.json``, ``launch.py``, ``model_spmd.py``), over any
soap-planner plan, over the files it reads (``--data``, ``--init-from``), or two outputs
into one file. All of it is checked on every rank before the process group starts (each
rank reads the same flags and files; rank 0 prints the one line), so a refused run costs
nothing.

The metrics file is written as the run goes into a temporary file beside FILE
(``planner.outputs.StagedLines``: ``tail -f`` that one to follow a run) and renamed onto
FILE when the run ends, also when it stops early on an error or a signal; with ``--resume``
it starts with the earlier file's lines up to the step resumed from. The other two are
written whole at the end.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from planner.errors import LaunchError, OutputError
from planner.outputs import PROGRAM_MARKER, StagedLines, check_output_file

# What a program folder holds that a run must never replace.
PROGRAM_FILES = ("plan.json", "launch.py", "model_spmd.py", PROGRAM_MARKER)
METRICS_KEYS = frozenset({"step", "loss", "step_time_s"})  # in every line --metrics writes


def is_metrics_file(path: Path) -> bool:
    """Whether ``path`` holds per-step figures written by ``--metrics``: its first line is a
    JSON object with a step, a loss and a step time. An empty file counts (a run that ended
    before its first step writes one, and it holds nothing to lose)."""
    try:
        with open(path, encoding="utf-8") as stream:
            first = stream.readline(1 << 16)
    except (OSError, UnicodeDecodeError):
        return False
    if not first:
        return True
    try:
        record = json.loads(first)
    except (ValueError, RecursionError):
        return False
    return isinstance(record, dict) and METRICS_KEYS <= record.keys()


def _writers() -> dict[str, tuple[str, object]]:
    """flag -> (what it writes, how to recognise a file it wrote)."""
    from codegen.runtime.profiling import is_measured_file
    from planner.routing import is_routing_file

    return {
        "--metrics": ("metrics file (JSON lines)", is_metrics_file),
        "--profile": ("measured file", is_measured_file),
        "--record-routing": ("routing statistics file", is_routing_file),
    }


def check_run_outputs(options: argparse.Namespace, folder: Path) -> None:
    """Refuse, with one line naming the flag, any output of ``launch.py`` that must not be
    written (see the module docstring). ``folder``: the program folder.

    Raises:
        LaunchError: naming the flag, the file and the fix.
    """
    from planner.plans import is_plan_file

    paths = {"--metrics": options.metrics, "--profile": options.profile, "--record-routing": options.record_routing}
    protected = {(folder / name).resolve(): f"this program's {name}" for name in PROGRAM_FILES}
    for flag, value in (("--data", (options.data or "").rpartition(":")[0]), ("--init-from", options.init_from)):
        if value:
            protected[Path(value).resolve()] = f"the file {flag} reads"
    taken: dict[Path, str] = {}
    writers = _writers()
    for flag, value in paths.items():
        if value is None:
            continue
        what, is_ours = writers[flag]
        try:
            path = check_output_file(value, what=what, is_ours=is_ours, force=options.force)
        except OutputError as error:
            raise LaunchError(f"{flag}: {error}") from None
        resolved = path.resolve()
        if resolved in protected:
            raise LaunchError(f"{flag}: {value} is {protected[resolved]}; write the {what} to another file")
        if resolved in taken:
            raise LaunchError(f"{flag} and {taken[resolved]} both write {value}; give each its own file")
        if path.is_file() and is_plan_file(path):
            raise LaunchError(f"{flag}: {value} is a soap-planner plan; write the {what} to another file (even --force "
                              f"does not replace a plan)")
        taken[resolved] = flag


def open_metrics(path: str | None, rank: int, resumed_at: int = 0) -> StagedLines | None:
    """Rank 0's metrics file, staged beside ``path`` until the run ends (None elsewhere, or
    without ``--metrics``). A run resumed at step ``resumed_at`` > 0 keeps the lines of steps
    up to it from the metrics file already there (the run it continues; later steps are
    being run again), so one file holds the whole run."""
    if path is None or rank != 0:
        return None
    lines = StagedLines(Path(path))
    if resumed_at > 0 and Path(path).is_file() and is_metrics_file(Path(path)):
        for line in earlier_steps(Path(path), resumed_at):
            lines.write_line(line)
    return lines


def earlier_steps(path: Path, through: int) -> list[str]:
    """The lines of metrics file ``path`` whose step is at most ``through``, in order (lines
    that are not such a record are dropped)."""
    kept = []
    with open(path, encoding="utf-8", errors="replace") as stream:
        for line in stream:
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                continue
            step = record.get("step") if isinstance(record, dict) else None
            if isinstance(step, int) and not isinstance(step, bool) and 0 < step <= through:
                kept.append(line.rstrip("\n"))
    return kept
