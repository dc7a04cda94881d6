"""Compiled folded MoE programs train exactly like one device (``codegen.moe_folding_emit``).

``examples/moe.py`` at world 4, attention (and dense MLPs) tensor parallel on ``tp``, the
embedding vocabulary parallel, the head column parallel, every MoE layer's experts over all
``dp x tp`` ranks (Megatron-Core's MoE parallel folding): dp2 x tp2 with EP4, with EP2 x
EDP2 (each expert copied on two ranks), and with EP2 x ETP2 (each expert's width split over
two ranks, with a capacity and dropless); dropless EP4; every other block a dense MLP (column then
row parallel); two micro-batches per step (each routed on its own); dp1 x tp4 (one head per
rank); and the plan the search picks for ``--mesh dp=2,tp=2``. At world 8 on two nodes of 4,
pipelines of 2 stages over dp2 x tp2 (issue 26's first composed configuration): the plan the
search picks for ``--mesh pp=2,dp=2,tp=2`` (EP2 x EDP2) and EP4; each stage replays its graph
on DTensors (attention tensor parallel) and runs its MoE layers folded over its 4 ranks.
``launch.py --check``'s step (outputs, loss, every gradient, every updated parameter) must
equal one device's (in the plan's micro-batches). Tiny HuggingFace ``hf:mixtral`` and
``hf:qwen3_moe`` at dp2 x tp2 with EP4 and no pipeline: attention heads split over tp (Qwen3's
per-head q/k norms with their gradients summed over tp, its first layer a dense SwiGLU MLP),
each block's own router on 1/tp of the tokens, its stacked experts over all 4 ranks. Each world size checks all its programs in
ONE torchrun launch (``tests/dist_check_many.py``).

Negative controls must fail, naming what they break: expert gradients divided by dp x tp
(every rank's loss counted as a distinct one) and router gradients not summed over tp.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import planner
from planner.api import prepare_model
from planner.errors import PlanningError
from planner.model_spec import ModelSpec
from planner.strategy import Mesh
from search.moe_folding import folded_plan
from moe_plans import HF_MOE
from launch_groups import register_group
from test_moe_folding_pipelines import searched_folded_pipeline
from test_parity import LAUNCH_TIMEOUT, _run, _torchrun, result_of

pytestmark = pytest.mark.distributed

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "moe.py"
WORLD = 4
# name: (model overrides, dp, tp, EP, accumulation steps, ETP)
CASES = {
    "dp2tp2_ep4": ({}, 2, 2, 4, 1, 1),
    "dp2tp2_ep2_edp2": ({}, 2, 2, 2, 1, 1),
    "dp2tp2_ep2_etp2": ({}, 2, 2, 2, 1, 2),
    "dropless_ep2_etp2": ({"capacity_factor": 0}, 2, 2, 2, 1, 2),
    "dropless_ep4": ({"capacity_factor": 0}, 2, 2, 4, 1, 1),
    "dense_mlp_every_other_block": ({"moe_every": 2, "n_layer": 2}, 2, 2, 4, 1, 1),
    "two_micro_batches_ep2": ({}, 2, 2, 2, 2, 1),
    "dp1tp4_ep4": ({}, 1, 4, 4, 1, 1),
}
# name: (tiny HuggingFace MoE decoder, its overrides), folded dp2 x tp2 with EP4; Qwen3-MoE's
# first layer a dense SwiGLU MLP (gate/up column parallel, down row parallel).
HF_CASES = {"hf_mixtral_dp2tp2_ep4": ("mixtral", HF_MOE["mixtral"]),
            "hf_qwen3_moe_dense_first_dp2tp2_ep4": ("qwen3_moe", {**HF_MOE["qwen3_moe"], "mlp_only_layers": [0]})}
SEARCHED = "searched_dp2tp2"
EXPERT_SCALE_CONTROL = "control_expert_gradients_over_dp_x_tp"
ROUTER_CONTROL = "control_router_gradients_not_summed_over_tp"


def plan_of(overrides: dict, dp: int, tp: int, ep: int, steps: int, etp: int = 1, source: str = str(EXAMPLE)):
    graph, spec, name, cluster = prepare_model(ModelSpec(source, overrides), f"cpu:1x{WORLD}")
    plan = folded_plan(graph, cluster, spec, name, Mesh((("dp", dp), ("tp", tp))), ep, etp)
    return dataclasses.replace(plan, accumulation_steps=steps)


def _divide_expert_gradients_by_every_rank(folder: Path) -> Path:
    program = folder / "model_spmd.py"
    text = program.read_text()
    assert "        tensor_parallel=2,\n" in text
    program.write_text(text.replace("        tensor_parallel=2,\n", "        tensor_parallel=1,\n"))
    return folder


def _leave_router_gradients_unsummed(folder: Path) -> Path:
    program = folder / "model_spmd.py"
    text = program.read_text()
    marker = "    EXPERT_WEIGHTS_OUTSIDE_DDP = "
    assert marker in text
    unhook = ("    for layer in model.modules():\n"
              "        if isinstance(layer, FoldedMoE):\n"
              "            layer.layer.router._backward_hooks.clear()\n")
    program.write_text(text.replace(marker, unhook + marker, 1))
    return folder


def _programs(root, world):
    folders = {name: planner.compile(plan_of(*case), root / name) for name, case in CASES.items()}
    for name, (model, overrides) in HF_CASES.items():
        folders[name] = planner.compile(plan_of(overrides, 2, 2, 4, 1, source=f"hf:{model}"), root / name)
    searched = planner.plan(ModelSpec(str(EXAMPLE), {}), f"cpu:1x{WORLD}", constraints={"mesh": {"dp": 2, "tp": 2}})
    assert "moe-folding" in searched.sections, searched.name
    folders[SEARCHED] = planner.compile(searched, root / SEARCHED)
    controls = {
        EXPERT_SCALE_CONTROL: _divide_expert_gradients_by_every_rank(
            planner.compile(plan_of({}, 2, 2, 4, 1), root / EXPERT_SCALE_CONTROL)),
        ROUTER_CONTROL: _leave_router_gradients_unsummed(
            planner.compile(plan_of({}, 2, 2, 4, 1), root / ROUTER_CONTROL)),
    }
    return (folders, controls), [*folders.values(), *controls.values()]


PROGRAMS = register_group(WORLD, _programs)  # checked in the session's launch (launch_groups.py)


@pytest.fixture(scope="module")
def run(parity_launches):
    (folders, controls), launch = parity_launches.result(PROGRAMS)
    return folders, controls, launch


@pytest.mark.parametrize("case", [*CASES, *HF_CASES, SEARCHED])
def test_folded_step_equals_one_device(run, case):
    folders, _, launch = run
    result = result_of(launch, folders[case])
    assert result.startswith("ok parity ok: "), f"{case}: {result}"


@pytest.mark.parametrize("control, broken", [(EXPERT_SCALE_CONTROL, r"experts\.w_(in|out)"),
                                             (ROUTER_CONTROL, r"router\.weight")])
def test_broken_folding_gradients_are_reported(run, control, broken):
    _, controls, launch = run
    result = result_of(launch, controls[control])
    assert result.startswith("FAILED parity FAILED: worst tensor "), result
    assert re.search(broken, result), result


PIPELINED = "searched_pp2dp2tp2"
PIPELINED_EP4 = "pp2dp2tp2_ep4"
# The folded pipeline the search picks for tiny hf:mixtral under --mesh pp=2,tp=2 (the pipeline
# grid's micro-batches and dp flavour; tests/test_moe_folding_pipelines.py checks its speed).
PIPELINED_HF = "searched_hf_mixtral_pp2dp2tp2"


def _programs8(root, world):
    spec = ModelSpec(str(EXAMPLE), {})
    searched = planner.plan(spec, "cpu:2x4", constraints={"mesh": {"pp": 2, "dp": 2, "tp": 2}})
    assert "moe-folding" in searched.sections and searched.pipeline is not None, searched.name
    hf = searched_folded_pipeline()
    assert "moe-folding" in hf.sections and hf.pipeline is not None, hf.name
    graph, spec, name, cluster = prepare_model(spec, "cpu:2x4")
    ep4 = folded_plan(graph, cluster, spec, name, Mesh((("pp", 2), ("dp", 2), ("tp", 2))), 4, micro_batches=2)
    folders = {PIPELINED: planner.compile(searched, root / PIPELINED), PIPELINED_EP4: planner.compile(ep4, root / PIPELINED_EP4),
               PIPELINED_HF: planner.compile(hf, root / PIPELINED_HF)}
    return folders, list(folders.values())


PROGRAMS8 = register_group(8, _programs8)


@pytest.fixture(scope="module")
def run8(parity_launches):
    return parity_launches.result(PROGRAMS8)


@pytest.mark.parametrize("case", [PIPELINED, PIPELINED_EP4, PIPELINED_HF])
def test_folded_pipeline_step_equals_one_device(run8, case):
    folders, launch = run8
    result = result_of(launch, folders[case])
    assert result.startswith("ok parity ok: "), f"{case}: {result}"
    source = (folders[case] / "model_spmd.py").read_text()
    assert "STAGE_AXES = (('dp', 2), ('tp', 2))" in source


def test_the_program_names_its_layers_and_placement(run):
    folders, _, _ = run
    source = (folders["dp2tp2_ep2_edp2"] / "model_spmd.py").read_text()
    assert "replace_layer(model, 'blocks.0.attn', HeadParallelSelfAttention(" in source
    assert "replace_layer(model, 'lm_head', ColumnParallelLinear(model.get_submodule('lm_head'), tp_group, " \
           "gather_output=True))" in source
    assert "replace_layer(model, 'wte', VocabParallelEmbedding(" in source
    # EP2 x EDP2: expert e on folded ranks e % 2 and 2 + e % 2, half its slots each.
    assert ("EXPERT_PLACEMENT_0 = (((0, 0.5), (2, 0.5)), ((1, 0.5), (3, 0.5)), ((0, 0.5), (2, 0.5)), "
            "((1, 0.5), (3, 0.5)))") in source
    dense = (folders["dense_mlp_every_other_block"] / "model_spmd.py").read_text()
    assert "replace_layer(model, 'blocks.0.mlp.0', ColumnParallelLinear(model.get_submodule('blocks.0.mlp.0'), " \
           "tp_group))" in dense
    assert "replace_layer(model, 'blocks.0.mlp.2', RowParallelLinear(" in dense


def test_huggingface_blocks_keep_their_router_and_names(run):
    """The folded HuggingFace program replaces only the stacked experts (the block keeps its
    path and router), splits attention heads, and sums Qwen3's per-head norms over tp."""
    folders, _, _ = run
    source = (folders["hf_qwen3_moe_dense_first_dp2tp2_ep4"] / "model_spmd.py").read_text()
    assert "replace_layer(model, 'model.layers.1.mlp.experts', FoldedStackedExperts(" in source
    assert "fold_block_tokens(model.get_submodule('model.layers.1.mlp'), tp_group, " in source
    assert "replace_layer(model, 'model.layers.0.mlp.up_proj', ColumnParallelLinear(" \
           "model.get_submodule('model.layers.0.mlp.up_proj'), tp_group))" in source
    assert "replace_layer(model, 'model.layers.0.mlp.down_proj', RowParallelLinear(" in source
    assert "replace_layer(model, 'model.layers.1.self_attn.q_proj', ColumnParallelLinear(" \
           "model.get_submodule('model.layers.1.self_attn.q_proj'), tp_group))" in source
    assert "sum_gradients_over(model.get_submodule('model.layers.1.self_attn.k_norm'), tp_group)" in source
    # EP4 over dp2 x tp2: expert e whole on folded rank e.
    assert "EXPERT_PLACEMENT_0 = (((0, 1.0),), ((1, 1.0),), ((2, 1.0),), ((3, 1.0),))" in source


def test_what_is_not_compiled_is_refused_in_one_line(tmp_path):
    graph, spec, name, cluster = prepare_model(ModelSpec(str(EXAMPLE), {}), "cpu:2x4")
    pipelined = folded_plan(graph, cluster, spec, name, Mesh((("pp", 2), ("dp", 2), ("tp", 2))), 2, 2, micro_batches=2)
    with pytest.raises(PlanningError, match=r"inside pipeline stages run whole experts \(ETP 1\).*re-plan with ETP 1") as error:
        planner.compile(pipelined, tmp_path / "etp")
    assert "\n" not in str(error.value)
    graph, spec, name, cluster = prepare_model(ModelSpec(str(EXAMPLE), {}), f"cpu:1x{WORLD}")
    mesh = Mesh((("dp", 2), ("tp", 2)))
    zero2 = dataclasses.replace(folded_plan(graph, cluster, spec, name, mesh, 4), dp_flavour="zero2")
    with pytest.raises(PlanningError, match="plan with --dp ddp"):
        planner.compile(zero2, tmp_path / "zero2")
    # HuggingFace blocks: whole experts only; attention heads whole on each tp rank.
    sliced = plan_of(HF_MOE["mixtral"], 2, 2, 2, 1, etp=2, source="hf:mixtral")
    with pytest.raises(PlanningError, match=r"HuggingFace MoE block 'model.layers.0.mlp' with whole experts.*ETP=2"):
        planner.compile(sliced, tmp_path / "hf_etp")
    two_kv_heads = plan_of({**HF_MOE["mixtral"], "num_key_value_heads": 2}, 1, 4, 4, 1, source="hf:mixtral")
    with pytest.raises(PlanningError, match=r"4 query and 2 key/value heads, which do not split over tp=4") as error:
        planner.compile(two_kv_heads, tmp_path / "hf_heads")
    assert "\n" not in str(error.value)
    sinks = plan_of(HF_MOE["gpt_oss"], 2, 2, 4, 1, source="hf:gpt_oss")
    with pytest.raises(PlanningError, match=r"attention 'model.layers.0.self_attn' has parameters of its own \(sinks\)"):
        planner.compile(sinks, tmp_path / "hf_sinks")


def _step_losses(stdout: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in re.findall(r"^step (\d+)/\d+: .*?loss ([0-9.]+)", stdout, re.M)}


def test_a_folded_checkpoint_resumes_on_a_data_parallel_program(run, tmp_path):
    """Three steps of the EP2 x EDP2 folded program, against two of them checkpointed and the
    third resumed by a dp=4 program of the same model: the third step's loss is the same (the
    tensor-parallel slices, the experts and their copies saved as parts of the whole weights)."""
    folders, _, _ = run
    folded = folders["dp2tp2_ep2_edp2"]
    dp4 = planner.compile(planner.plan(ModelSpec(str(EXAMPLE), {}), f"cpu:1x{WORLD}",
                                       constraints={"mesh": {"dp": 4}}), tmp_path / "dp4")
    whole = _run([*_torchrun(WORLD), str(folded / "launch.py"), "--steps", "3"], tmp_path, LAUNCH_TIMEOUT)
    assert whole.returncode == 0, whole.describe()
    saved = _run([*_torchrun(WORLD), str(folded / "launch.py"), "--steps", "2", "--checkpoint-dir",
                  str(tmp_path / "ckpt")], tmp_path, LAUNCH_TIMEOUT)
    assert saved.returncode == 0, saved.describe()
    resumed = _run([*_torchrun(WORLD), str(dp4 / "launch.py"), "--steps", "3", "--checkpoint-dir",
                    str(tmp_path / "ckpt"), "--resume"], tmp_path, LAUNCH_TIMEOUT)
    assert resumed.returncode == 0, resumed.describe()
    assert _step_losses(resumed.stdout)[3] == pytest.approx(_step_losses(whole.stdout)[3], abs=2e-6), resumed.stdout
