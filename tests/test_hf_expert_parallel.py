"""Expert parallelism for HuggingFace MoE decoders at run time
(``codegen.runtime.expert_dispatch``): tiny Mixtral and Qwen2-MoE (shared expert) with their
stacked experts split over the ranks, round-robin and with a copied expert, against the same
model on one device: the loss, every dense gradient, and every expert's gathered weights and
gradients equal, at worlds 2 and 4 (one launch each, ``tests/hf_expert_parallel_worker.py``).
The control leaves the expert gradients as sums over ranks and must fail."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from planner.model_spec import ModelSpec
from planner.moe_blocks import find_moe_blocks
from test_parity import REPO

CASES = [f"{model} {placement}" for model in ("mixtral", "qwen2_moe") for placement in ("round-robin", "copied")]
CONTROL = "mixtral copied, gradients not scaled (control)"


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def results(request):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(request.param),
         str(REPO / "tests/hf_expert_parallel_worker.py")],
        capture_output=True, text=True, timeout=600, env=env, cwd=REPO,
    )
    found = dict(re.findall(r"^RESULT (.+?): (.*)$", run.stdout, re.MULTILINE))
    assert run.returncode == 0 and len(found) == len(CASES) + 1, run.stdout[-2000:] + run.stderr[-3000:]
    return found


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_split_experts_compute_the_single_device_step(results, case):
    assert results[case].startswith("ok worst"), f"{case}: {results[case]}"


@pytest.mark.distributed
def test_expert_gradients_left_as_sums_over_ranks_fail(results):
    assert results[CONTROL].startswith("FAILED"), results[CONTROL]


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"])
def test_huggingface_moe_blocks_are_found_with_their_shape(model_type):
    overrides = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                 "vocab_size": 64, "intermediate_size": 48}
    experts_key = {"mixtral": "num_local_experts", "deepseek_v3": "n_routed_experts"}.get(model_type, "num_experts")
    overrides |= {experts_key: 4, "num_experts_per_tok": 2}
    if model_type not in ("mixtral", "olmoe"):  # their experts are intermediate_size wide
        overrides["moe_intermediate_size"] = 40
    if model_type == "deepseek_v3":
        overrides |= {"first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}
    model, _, _ = ModelSpec(f"hf:{model_type}", overrides).build("meta")
    blocks = find_moe_blocks(model)
    ffn = 48 if model_type in ("mixtral", "olmoe") else 40
    dense_first = 1 if model_type == "deepseek_v3" else 0
    assert [b.module for b in blocks] == [f"model.layers.{i}.mlp" for i in range(dense_first, 2)]
    assert all((b.experts, b.top_k, b.hidden, b.ffn, b.matmuls, b.capacity_factor) == (4, 2, 32, ffn, 3, 0.0) for b in blocks)
