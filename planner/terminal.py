"""Text from files, made inert before it reaches a terminal.

Plans, cluster files, routing statistics and measured files are shared between strangers,
and every string in them (a plan's warnings, its runners-up names, a cluster's name, module
and op names, notes) ends up in what ``planner`` prints. A terminal acts on some characters:
ESC starts sequences that clear the screen, move the cursor over a verdict, set the window
title or hide a link (OSC 8); ``\\r`` overwrites a line; bidirectional overrides reorder what
is shown. rich acts on ``[bold]``/``[link=...]`` markup and ``:emoji:`` codes.

This module is the one place that neutralises them:

* ``inert`` escapes every character a terminal could act on (as Python's ``repr`` writes
  it: ``\\x1b``, ``\\r``, ``\\u202e``...), keeping newlines (``inert_line`` escapes those too);
* ``InertConsole`` is a rich ``Console`` whose strings (printed, table cells, titles) pass
  through ``inert`` and are never parsed as markup or emoji codes, so widths are measured on
  what is shown;
* ``inert_text`` makes one string into a rich ``Text`` for other rich widgets (a spinner).

The report, the CLI's output and its error line use them; a string in a file can change
what a line says, never what the terminal does.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.text import Text

__all__ = ["InertConsole", "inert", "inert_line", "inert_text"]


def inert(text: Any) -> str:
    """``text`` with every character a terminal acts on escaped (``repr``'s escapes), except
    newlines, which stay line breaks."""
    return "\n".join(inert_line(line) for line in str(text).split("\n"))


def inert_line(text: Any) -> str:
    """``text`` as one inert line: as ``inert``, with newlines escaped too (``\\n``).
    Backslashes are left as they are: only what a terminal acts on is escaped."""
    return "".join(character if character.isprintable() else repr(character)[1:-1] for character in str(text))


def inert_text(text: Any) -> Text:
    """``text`` as a rich ``Text``: one inert line, never parsed as markup."""
    return Text(inert_line(text))


class InertConsole(Console):
    """A rich ``Console`` for text that holds strings from files: markup, emoji codes and
    highlighting off, and every string it renders made ``inert`` first."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**{**options, "markup": False, "emoji": False, "highlight": False})

    def render_str(self, text: str, **options: Any) -> Text:  # noqa: D102 - rich's hook
        return super().render_str(inert(text), **{**options, "markup": False, "emoji": False})
