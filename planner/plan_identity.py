"""Which program a plan compiles to, as one short string: the plan fingerprint.

A measured file (``launch.py --profile``) records the fingerprint of the plan it measured, so
``planner compare PLAN MEASURED`` can refuse a measurement of another plan instead of setting
unrelated figures side by side. The fingerprint covers what decides the program a plan
compiles to: the model's fingerprint (``planner.fingerprint``), the mesh (hence the world
size), the data-parallel flavour, recomputation, the pipeline, accumulation, precision,
optimizer, batch, input placements, FSDP units, expert layouts and every op's strategy. It
leaves out what only describes or predicts: the cluster's speeds (a plan moved to a
calibrated cluster is the same program), the estimate, runners-up, warnings, timings, the
label, and where the model's source file lives (``compile`` rewrites it relative to the
program folder).

It is computed from the plan's JSON form (``Plan.to_dict``), so a plan file, a compiled
folder's ``plan.json`` and the copy inside a measured file give the same fingerprint.

Vocabulary layer: standard library only.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

PLAN_FINGERPRINT_LENGTH = 16
# The fields of the plan's JSON form that decide the compiled program.
PROGRAM_FIELDS = (
    "mesh", "dp_flavour", "recompute", "pipeline", "accumulation_steps", "precision", "optimizer", "batch_size",
    "inputs", "fsdp_units", "expert_layouts", "fused_splits_local", "model_fingerprint", "strategies",
)


def plan_fingerprint(plan_data: Mapping[str, Any]) -> str:
    """The fingerprint (``PLAN_FINGERPRINT_LENGTH`` hex digits) of a plan in its JSON form.

    A plan without a model fingerprint (saved before plans had one) is identified by its
    model's factory arguments instead.
    """
    identity = {name: plan_data.get(name) for name in PROGRAM_FIELDS}
    if not identity["model_fingerprint"]:
        model = plan_data.get("model")
        identity["model_overrides"] = model.get("overrides") if isinstance(model, Mapping) else None
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:PLAN_FINGERPRINT_LENGTH]


def plan_world_size(plan_data: Mapping[str, Any]) -> int | None:
    """The number of ranks of a plan's mesh (None when its mesh is not a list of [name, size])."""
    size = 1
    mesh = plan_data.get("mesh")
    if not isinstance(mesh, list) or not mesh:
        return None
    for axis in mesh:
        if not (isinstance(axis, list) and len(axis) == 2 and isinstance(axis[1], int) and not isinstance(axis[1], bool)):
            return None
        size *= axis[1]
    return size
