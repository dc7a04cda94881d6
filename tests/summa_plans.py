"""Forced SUMMA-layout plans (``search.summa_layout``) for the compiler's parity tests.

``summa_plan`` builds the plan the search would hand the compiler for a whole-model 2-D,
2.5-D or 3-D layout: the traced model, a ``dp``-less mesh of the family's axes in its order
(2-D ``row x col``, 2.5-D ``dep x row x col``, 3-D ``row x col x dep``), the strategies of
``summa_layout`` and DDP for replicated parameters, as ``search.plan_builder`` makes them.
"""

from __future__ import annotations

from pathlib import Path

from planner.api import prepare_model
from planner.model_spec import ModelSpec
from planner.plans import Plan
from planner.strategy import Mesh
from search.plan_builder import unsimulated_plan
from search.summa_layout import summa_layout

REPO = Path(__file__).resolve().parents[1]
GPT = str(REPO / "examples" / "gpt.py")
# A GPT small enough for 8 CPU processes, wide enough that q = 2 and q^2 = 4 divide every width.
GPT_SMALL = {"n_layer": 2, "n_head": 4, "n_embd": 32, "vocab_size": 64, "seq_len": 8, "batch_size": 8}
GPT_BLOCK = {**GPT_SMALL, "n_layer": 1}
LLAMA_TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 4, "vocab_size": 64, "batch_size": 8, "seq_len": 8}


def family_mesh(family: str, q: int = 2, d: int = 2, dp: int = 1) -> Mesh:
    """The mesh of a SUMMA family, axes in the order ``SummaLayout`` checks (``dp`` outermost)."""
    axes = {"2d": (("row", q), ("col", q)), "2.5d": (("dep", d), ("row", q), ("col", q)),
            "3d": (("row", q), ("col", q), ("dep", q))}[family]
    return Mesh(((("dp", dp),) if dp > 1 else ()) + axes)


def summa_plan(spec: ModelSpec, family: str, q: int = 2, d: int = 2, dp: int = 1, flavour: str = "ddp",
               recompute: str = "none", keep_gathered: bool = False) -> Plan:
    """A plan of ``spec`` with every linear in the SUMMA ``family`` (module docstring); with
    ``dp`` > 1 the replicated parameters in the data-parallel ``flavour``; 3-D linears keep
    their gathered operands for the backward when ``keep_gathered``."""
    mesh = family_mesh(family, q, d, dp)
    graph, spec, name, cluster = prepare_model(spec, f"cpu:1x{mesh.size}")
    strategies, inputs = summa_layout(graph, mesh, family, keep_gathered)
    return unsimulated_plan(graph, cluster, spec, name, mesh, strategies, inputs, label=f"summa-{family}",
                            dp_flavour=flavour, recompute=recompute)
