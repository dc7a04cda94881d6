"""``examples/gpt.py`` with weights shared across blocks as well as the usual tied embedding:
every block's first LayerNorm is one module (ALBERT-style cross-layer sharing), and the
token embedding is the output head. Cut into ``pp x virtual_stages`` pipeline stages, the
shared norm is read by every stage, two of them on the same rank under the interleaved
schedule, and the embedding by the first and last stages, on different ranks: the
pipeline tests' case for tied weights whose gradients must be summed over stages.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

GPT_FILE = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"

_spec = importlib.util.spec_from_file_location("_shared_norm_gpt_examples_gpt", GPT_FILE)
_gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gpt)


def build(batch_size: int = 8, n_layer: int = 4):
    """``examples/gpt.py``'s tied GPT whose blocks all use block 0's ``ln_1``."""
    model, batch = _gpt.build(batch_size=batch_size, n_layer=n_layer, tie_weights=True)
    for block in model.blocks[1:]:
        block.ln_1 = model.blocks[0].ln_1
    return model, batch
