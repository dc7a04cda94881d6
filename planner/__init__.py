"""soap-planner: find, explain and compile the fastest way to train a PyTorch model on a cluster.

    >>> import planner
    >>> plan = planner.plan("examples/gpt.py", "cpu:1x2")
    >>> print(plan.report())
    >>> planner.compile(plan, "out")   # then: torchrun --nproc_per_node 2 out/launch.py --check

The names below are imported lazily (PEP 562) so that importing a vocabulary module, or
``search``/``cost_model``/``codegen``, never drags in the API and its dependencies.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "baselines": "planner.baselines",
    "plan": "planner.api",
    "compile": "planner.api",
    "compile_colocated": "planner.api",
    "simulate": "planner.api",
    "colocate": "planner.colocation",
    "SimResult": "planner.strategy",
    "load_plan": "planner.plans",
    "Plan": "planner.plans",
    "Cluster": "planner.cluster",
    "ModelSpec": "planner.model_spec",
    "PlannerError": "planner.errors",
    "TraceError": "planner.errors",
    "ClusterError": "planner.errors",
    "SpecError": "planner.errors",
    "PlanFileError": "planner.errors",
    "PlanningError": "planner.errors",
    "LaunchError": "planner.errors",
    "ArgumentError": "planner.errors",
    "OutputError": "planner.errors",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        return module if module.__name__ == f"planner.{name}" else getattr(module, name)
    raise AttributeError(f"module 'planner' has no attribute '{name}'")


def __dir__() -> list[str]:
    return __all__
