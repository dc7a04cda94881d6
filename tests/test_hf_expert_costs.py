"""HuggingFace's stacked experts in data-parallel plans: each rank runs the experts on its
own tokens, so their compute per rank is the whole batch's divided by dp.

HF's MoE blocks (transformers 5) sort each token's expert choices and gather the tokens by
that order (``hidden[perm // top_k]``) before the grouped matmuls
(``transformers::grouped_mm_fallback``). The gather has as many rows as its index (tokens x
top-k), not as its source (tokens); a data-parallel program runs it, and the grouped
matmuls after it, on each rank's slice (``search.propagation`` with ``batch_local``). The
simulator once kept the gather whole, so the experts ran on the global batch on every rank
(the issue's Mixtral-8x7B: 358 s of expert compute at dp=1 and still at dp=8).

Arithmetic (the device of tests/test_moe_plan_costs.py: 1 TFLOP/s, memory traffic free):
batch 8 x 8 = 64 tokens, top-2: 128 routed rows. Mixtral (width 32, expert FFN 48):
gate_up (128 x 32) @ (32 x 96) is 2 x 128 x 32 x 96 = 786,432 FLOPs forward, down
(128 x 48) @ (48 x 32) is 393,216; backward is twice forward (input and weight gradients),
so 3 x those per step. Qwen3-MoE (expert FFN 40): 2 x 128 x 32 x 80 = 655,360 and
2 x 128 x 40 x 32 = 327,680.
"""

from __future__ import annotations

import pytest

from moe_plans import HF_MOE, HF_TINY
from planner.api import prepare_model
from planner.cluster import Cluster, NodeSpec
from planner.model_spec import ModelSpec
from search.data_parallel import data_parallel_plan
from test_moe_plan_costs import DEVICE, LINK

QWEN3_MOE = {**HF_TINY, "intermediate_size": 48, "moe_intermediate_size": 40, "num_experts": 4,
             "num_experts_per_tok": 2}
ROWS = 8 * 8 * 2  # tokens x top-k
# (model, its tiny config, forward FLOPs of the two grouped matmuls of one layer)
MODELS = [
    ("mixtral", HF_MOE["mixtral"], (2 * ROWS * 32 * 96, 2 * ROWS * 48 * 32)),
    ("qwen3_moe", QWEN3_MOE, (2 * ROWS * 32 * 80, 2 * ROWS * 40 * 32)),
]


def grouped_matmul_seconds(model_type: str, config: dict, world: int) -> list[float]:
    """Compute seconds per step of each grouped matmul of a DDP plan on ``world`` devices."""
    cluster = Cluster(name="arith", nodes=(NodeSpec(DEVICE, world, LINK),), inter_link=LINK, backend="gloo")
    graph, spec, name, _ = prepare_model(ModelSpec(f"hf:{model_type}", config), cluster)
    plan = data_parallel_plan(graph, cluster, spec, name, "ddp")
    return [s.cost.compute_s for s in plan.strategies if "grouped_mm" in s.op]


@pytest.mark.parametrize("model_type, config, flops", MODELS, ids=[m[0] for m in MODELS])
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_expert_compute_per_rank_is_the_batch_over_dp(model_type, config, flops, dp):
    seconds = grouped_matmul_seconds(model_type, config, dp)
    layers = HF_TINY["num_hidden_layers"]
    expected = [3 * f / 1e12 / dp for _ in range(layers) for f in flops]  # forward + backward, 1/dp of the rows
    assert seconds == pytest.approx(expected, rel=1e-9)
