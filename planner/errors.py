"""Errors a user can act on.

Every exception in this module is about the user's input (a model, a cluster, a plan file,
a launch), never about our internals. The CLI prints ``str(error)`` as one line on stderr and
exits non-zero, so each message names the problem and the fix in one sentence.
"""

from __future__ import annotations


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
