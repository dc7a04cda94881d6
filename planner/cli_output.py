"""What the command line prints: every line inert (``planner.terminal``), sized to the
terminal (``planner.terminal_width``); reports as text or JSON, shell commands broken with
continuations, a spinner on stderr while work runs.

Vocabulary layer: the CLI's output, no tracing, search or simulation.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

from planner.terminal import inert, inert_text
from planner.terminal_width import terminal_width, wrap_command

__all__ = ["print_report", "report_data", "say", "say_command", "say_json", "say_named_lines", "status"]


def print_report(plan, output_format: str) -> None:
    """The plan's report on stdout: text sized to the terminal, or the same sections as JSON."""
    if output_format == "json":
        say_json(report_data(plan))
    else:
        say(plan.report(width=terminal_width()))


def report_data(plan) -> dict:
    """The plan's report as JSON data (``planner.report.report_data``)."""
    from planner.report import report_data as data

    return data(plan)


def say_json(data: dict) -> None:
    """``data`` as JSON on stdout, every non-ASCII character escaped (``\\u202e``...), so a
    file's string reaches a script whole and a terminal nothing it acts on."""
    import json

    print(json.dumps(data, indent=2, ensure_ascii=True))


def say_command(prefix: str, command: str) -> None:
    """A shell command after ``prefix``, broken with backslash continuations to fit the
    terminal's width, its later lines aligned under the first."""
    lines = wrap_command(command, terminal_width() - len(prefix))
    for position, line in enumerate(lines):
        say((prefix if position == 0 else " " * len(prefix)) + line)


def say_named_lines(rows: list[tuple[str, str]]) -> None:
    """``name  description``, one line per row (scripts read them with ``split()``), names in one column."""
    name_width = max(len(name) for name, _ in rows)
    for name, description in rows:
        say(f"{name:<{name_width}}  {description}")


def say(text: object = "") -> None:
    """Print ``text`` on stdout, inert: plan, cluster, routing and measured files are shared, and
    their strings reach this output (``planner.terminal``)."""
    print(inert(text))


@contextlib.contextmanager
def status(text: str) -> Iterator[None]:
    """A spinner on stderr while tracing and searching, only when stderr is a terminal."""
    if not sys.stderr.isatty():
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(inert_text(text)):
        yield
