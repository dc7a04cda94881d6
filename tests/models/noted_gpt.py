"""``examples/gpt.py`` with one more factory argument, a free-text ``note`` (as a run label
might be): the model the hostile-plan test compiles, so that a string override value can
reach the generated program's header. The note changes nothing in the model.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

GPT_FILE = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"

_spec = importlib.util.spec_from_file_location("_noted_gpt_examples_gpt", GPT_FILE)
_gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gpt)


def build(batch_size: int = 8, n_layer: int = 2, note: str = ""):
    """``examples/gpt.py``'s ``build``; ``note`` is carried in the spec only."""
    del note  # a label, not a model setting
    return _gpt.build(batch_size=batch_size, n_layer=n_layer)
