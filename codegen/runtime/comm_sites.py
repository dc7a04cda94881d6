"""Where a collective came from: the line of the generated ``model_spmd.py`` that issued it.

``codegen.runtime.comm_audit`` counts collectives per mesh axis; to say which op of the
program moved bytes the plan did not price, each collective can be tied to a line:

- in forward, the innermost frame of ``model_spmd.py`` on the Python stack (an op whose
  DTensor rule gathers inside it, a ``_to`` redistribution, a runtime helper it called);
- in backward, the autograd node running (``torch._C._current_autograd_node``, the engine's
  own record) and the line of ``model_spmd.py`` that made it in forward, which autograd's
  anomaly mode keeps on every node (``torch.autograd.set_detect_anomaly``; slower, so the
  audit turns it on only when asked for sites);
- otherwise the runtime function that ran it (the optimizer step, a gradient hook).
"""

from __future__ import annotations

import os
import traceback

import torch

PROGRAM_FILE = "model_spmd.py"
_TORCH = os.path.dirname(torch.__file__) + os.sep
_AUDIT_FILES = ("comm_sites.py", "comm_audit.py")


def collective_site() -> str:
    """The site of the collective being issued now (module docstring), one line of text:
    ``forward L<line>: <source>``, ``backward <autograd node> of L<line>: <source>`` or
    ``<file>:<function>``."""
    frames = traceback.extract_stack()
    for frame in reversed(frames):
        if os.path.basename(frame.filename) == PROGRAM_FILE:
            return f"forward L{frame.lineno}: {_code(frame.line)}"
    node = torch._C._current_autograd_node()
    if node is not None:
        return f"backward {node.name()} of {_forward_line(node.metadata.get('traceback_') or [])}"
    for frame in reversed(frames):  # the innermost caller outside PyTorch and the audit
        if not frame.filename.startswith(_TORCH) and not frame.filename.endswith(_AUDIT_FILES):
            return f"{os.path.basename(frame.filename)}:{frame.name}"
    return "unknown"


def _forward_line(recorded: list[str]) -> str:
    """The ``model_spmd.py`` line of a forward traceback that anomaly mode recorded (strings
    of ``File "...", line N, in f`` and the source line), or ``?`` and why there is none."""
    if not recorded:
        return "? (no forward traceback recorded: anomaly mode was off)"
    for entry in reversed(recorded):
        lines = entry.strip().splitlines()
        if lines and f"{PROGRAM_FILE}\"" in lines[0] and ", line " in lines[0]:
            number = lines[0].split(", line ")[1].split(",")[0]
            return f"L{number}: {_code(lines[1] if len(lines) > 1 else '')}"
    return f"? (made in forward outside {PROGRAM_FILE})"


def _code(line: str | None) -> str:
    """A source line without its comment, collapsed to one space between words."""
    return " ".join((line or "").split("  #")[0].split())
