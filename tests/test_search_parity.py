"""Plans the search picks, compiled and checked against one device; and a 2 x 4 mesh.

``test_spmd_parity.py`` forces each rule family; here the planner chooses: the default
search's plan for cnn, hf:gpt2 and mlp (whatever family it picks: a data-parallel flavour
or a SOAP plan), all checked in one world-2 launch; the issue's small llama and GPT searched
on 4 devices, in one world-4 launch; and Megatron on a dp=2 x tp=4 mesh at world
size 8, so every mesh shape of the issue (2, 2x2, 2x4) runs for real.
"""

from __future__ import annotations

import pytest

import planner
from search.data_parallel import data_parallel_plan
from search.megatron import megatron_plan
from planner.api import prepare_model
from planner.model_spec import ModelSpec
from launch_groups import register_group
from test_parity import REPO, result_of

pytestmark = pytest.mark.distributed

EXAMPLES = REPO / "examples"
SEARCHED = {
    "cnn": ModelSpec(str(EXAMPLES / "cnn.py"), {"batch_size": 8}),
    "gpt2": ModelSpec("hf:gpt2", {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 128, "n_positions": 64, "batch_size": 4, "seq_len": 16}),
    "mlp": ModelSpec(str(EXAMPLES / "mlp.py"), {}),
}


def _searched(root, world):
    plans = {name: planner.plan(spec, f"cpu:1x{world}", progress=False) for name, spec in SEARCHED.items()}
    folders = {name: planner.compile(plan, root / name) for name, plan in plans.items()}
    return (plans, folders), list(folders.values())


SEARCHED_GROUP = register_group(2, _searched)  # checked in the session's world-2 launch (launch_groups.py)


@pytest.fixture(scope="module")
def searched(parity_launches):
    (plans, folders), launch = parity_launches.result(SEARCHED_GROUP)
    return plans, folders, launch


@pytest.mark.parametrize("name", sorted(SEARCHED))
def test_searched_plan_matches_one_device(searched, name):
    plans, folders, launch = searched
    assert plans[name].search_summary.startswith("auto search")
    assert result_of(launch, folders[name]).startswith("ok"), f"{name} ({plans[name].name}): {result_of(launch, folders[name])}"


# The done-when model (a small llama with grouped-query attention) and GPT, searched
# on 4 devices: the plans the planner picks there (SOAP on a 2x2 or 1x4 mesh, or a
# data-parallel flavour) must train like one device.
HF_MOE = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}
SEARCHED_WORLD4 = {
    "llama": ModelSpec("hf:llama", {
        "num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
        "num_key_value_heads": 4,
    }),
    "gpt": ModelSpec(str(EXAMPLES / "gpt.py"), {"batch_size": 8}),
    # The quick start's model (examples/llama.py: RoPE through stack, grouped-query attention), tiny.
    "llama-example": ModelSpec(str(EXAMPLES / "llama.py"), {"size": "tiny"}),
    # Top-2 MoE with a capacity and a balance loss: its samples mix (search.batch_coupling), so
    # the search keeps to programs over the whole batch.
    "moe": ModelSpec(str(EXAMPLES / "moe.py"), {}),
    # HuggingFace MoE decoders (transformers' fused experts): their compile-time forward on
    # meta tensors must not take grouped_mm, whose meta kernel takes bf16 only.
    "mixtral": ModelSpec("hf:mixtral", {**HF_MOE, "intermediate_size": 128, "num_local_experts": 4}),
    "qwen2_moe": ModelSpec("hf:qwen2_moe", {
        **HF_MOE, "intermediate_size": 128, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
        "num_experts": 4, "num_experts_per_tok": 2,
    }),
}


def _searched_world4(root, world):
    # The default effort, as the done-when command plans.
    plans = {name: planner.plan(spec, f"cpu:1x{world}", progress=False) for name, spec in SEARCHED_WORLD4.items()}
    folders = {name: planner.compile(plan, root / name) for name, plan in plans.items()}
    # Control: the MoE model under DDP (each rank routing its own slice, with its own capacity
    # and balance loss), which the planner refuses to plan: built directly, it must fail.
    graph, spec, name, cluster = prepare_model(SEARCHED_WORLD4["moe"], f"cpu:1x{world}")
    ddp = data_parallel_plan(graph, cluster, spec, name, "ddp")
    folders["moe-ddp-control"] = planner.compile(ddp, root / "moe-ddp-control")
    return (plans, folders), list(folders.values())


SEARCHED_WORLD4_GROUP = register_group(4, _searched_world4)


@pytest.fixture(scope="module")
def searched_world4(parity_launches):
    (plans, folders), launch = parity_launches.result(SEARCHED_WORLD4_GROUP)
    return plans, folders, launch


@pytest.mark.parametrize("name", sorted(SEARCHED_WORLD4))
def test_searched_plan_on_four_devices_matches_one_device(searched_world4, name):
    plans, folders, launch = searched_world4
    assert result_of(launch, folders[name]).startswith("ok"), f"{name} ({plans[name].name}): {result_of(launch, folders[name])}"


def test_a_model_whose_samples_mix_is_planned_over_the_whole_batch(searched_world4):
    plans, folders, launch = searched_world4
    moe = plans["moe"]
    assert moe.label and moe.pipeline is None and moe.accumulation_steps == 1, moe.name
    assert any("mixes the samples of its batch in blocks.0.moe, blocks.1.moe" in w for w in moe.warnings)
    assert all(not alt.name.startswith(("ddp", "zero", "fsdp", "baseline ddp")) for alt in moe.runners_up)
    # Why: the same model run by DDP on slices of the batch trains differently.
    assert result_of(launch, folders["moe-ddp-control"]).startswith("FAILED parity FAILED")


def _megatron_2x4(root, world):
    graph, spec, name, cluster = prepare_model(ModelSpec(str(EXAMPLES / "gpt.py"), {}), f"cpu:1x{world}")
    plan = megatron_plan(graph, cluster, spec, name, tp=4, dp=2, precision="fp32")
    folder = planner.compile(plan, root / "gpt_2x4")
    return (plan, folder), [folder]


MEGATRON_2X4_GROUP = register_group(8, _megatron_2x4)


def test_megatron_on_a_two_by_four_mesh(parity_launches):
    (plan, folder), launch = parity_launches.result(MEGATRON_2X4_GROUP)
    assert plan.mesh.axes == (("dp", 2), ("tp", 4))
    assert result_of(launch, folder).startswith("ok"), launch.describe()
