"""``examples/moe.py``'s model with one parameter that no op reads (as DeepSeek-V4's compressors
are at a short sequence), for the MoE compiler's test of DDP's ``find_unused_parameters``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch import nn

_SPEC = importlib.util.spec_from_file_location(
    "moe_example_for_unused", Path(__file__).resolve().parents[1] / "examples" / "moe.py")
_MOE = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_MOE)


def build(**overrides):
    """The example's model and batch, plus ``unused_scale``, which forward never reads."""
    model, batch = _MOE.build(**overrides)
    model.unused_scale = nn.Parameter(torch.ones(4))
    return model, batch
