"""Errors a user can act on.

Every exception in this module is about the user's input (a model, a cluster, a plan file,
a launch), never about our internals. The CLI prints ``str(error)`` as one line on stderr and
exits non-zero, so each message names the problem and the fix in one sentence.
"""

from __future__ import annotations

from typing import Any


class PlannerError(Exception):
    """Base class of errors caused by the user's input; the message is one line."""


class TraceError(PlannerError):
    """The model could not be traced into an OpGraph."""


class ClusterError(PlannerError):
    """A cluster preset, string or file is unknown or invalid."""


class SpecError(PlannerError):
    """A model spec (``file.py:factory`` or ``hf:<type>``) could not be loaded or built."""


class PlanFileError(PlannerError):
    """A plan file is corrupt, of another version, or fails validation."""


class PlanningError(PlannerError):
    """The planner cannot produce a plan for this model on this cluster (e.g. batch too small)."""


class LaunchError(PlannerError):
    """A compiled program was launched in a way that does not match its plan."""


class ArgumentError(PlannerError):
    """An argument of the API or the command line has the wrong type, is out of range, or
    conflicts with another argument."""


class OutputError(PlannerError):
    """An output path cannot be written (missing folder, a folder where a file is expected),
    or holds files soap-planner did not write (overwritten only with ``--force``)."""
def one_line(text: Any) -> str:
    """``text`` as one printable line, for messages and generated comments: printable
    characters as they are, backslashes doubled, everything else (newline, carriage return,
    form feed, NUL, ``\\x85``, ``\\u2028``, control and bidirectional-override characters) as
    its ``repr()`` escape. Plan files are shared, so a name quoted from one cannot add a
    line to a message or end a comment in generated code."""
    return "".join(_escaped(character) for character in str(text))


def _escaped(character: str) -> str:
    if character == "\\":
        return "\\\\"
    if character.isprintable():
        return character
    return repr(character)[1:-1]  # "\\n", "\\x0c", "\\u2028"...
