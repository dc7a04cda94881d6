"""The state_dict file ``planner export-checkpoint -o FILE`` writes, and how to tell it from a
user's own weights.

The file is an ordinary ``torch.save`` of an ``OrderedDict`` of tensors, so
``model.load_state_dict(torch.load(FILE, weights_only=True))`` loads it. It is marked as
soap-planner's in the dict's ``_metadata`` (the per-module version table that
``nn.Module.state_dict`` attaches and ``load_state_dict`` reads by module prefix): one entry
under ``EXPORT_MARKER``, a key no module prefix can equal (it holds a space), so loading
ignores it. ``-o`` replaces a marked file without ``--force``; a user's own weights (say the
pretrained ``model.pt`` a run started from) are refused unless ``--force``.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch

from planner.outputs import staged_file

EXPORT_MARKER = "soap-planner export-checkpoint"


def save_exported(state: dict[str, torch.Tensor], output: Path) -> None:
    """``torch.save`` ``state`` to ``output``, marked (``EXPORT_MARKER``), through a temporary
    file beside it renamed into place: a failure leaves the old file whole."""
    marked = OrderedDict(state)
    marked._metadata = OrderedDict({EXPORT_MARKER: {"version": 1}})  # type: ignore[attr-defined]
    with staged_file(output) as temporary:
        torch.save(marked, temporary)


def is_exported_state_dict(path: Path) -> bool:
    """Whether ``path`` holds a state_dict written by ``save_exported`` (read memory-mapped,
    weights only: nothing is executed and the tensors are not read)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - any file torch cannot read as weights is not ours
        return False
    metadata = getattr(state, "_metadata", None)
    return isinstance(state, dict) and isinstance(metadata, dict) and EXPORT_MARKER in metadata
