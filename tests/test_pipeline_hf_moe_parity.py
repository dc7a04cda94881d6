"""HuggingFace MoE decoders compiled with their experts parallel inside pipeline stages train
exactly like one device (``codegen.pipeline_moe_emit``, ``codegen.runtime.pipeline_stacked_experts``).

Tiny ``hf:mixtral``, ``hf:deepseek_v3`` (MLA attention, every layer MoE) and ``hf:qwen3_moe``
(2 layers, hidden 32, 4 experts, top-2) at world 8 on ``cpu:2x4``, 2 micro-batches under 1F1B:

- Mixtral on pp2 x dp4, expert 0 copied on two dp ranks of each stage (0.6 / 0.4 of its
  choices), whose gradient must be summed over its copies, the others one per rank;
- DeepSeek-V3 on pp2 x dp4, each stage's experts round-robin over its 4 dp ranks;
- Qwen3-MoE folded on pp2 x dp2 x tp2 (Megatron-Core's MoE parallel folding): attention
  tensor parallel, the experts EP2 x EDP2 over each stage's 4 ranks (each expert on two).

The blocks keep their own router, top-k and weighting as traced DTensor ops; only their
stacked experts are replaced by the expert-parallel call. ``launch.py --check``'s step
(outputs, loss, every gradient, every updated parameter, the experts gathered whole) must
equal one device's on the same micro-batches. All programs are checked in ONE torchrun
launch (``tests/dist_check_many.py``). (Switching the copies' gradient sums off makes the
Mixtral program fail naming ``experts.gate_up_proj``: checked by hand, not in the suite, to
keep its time.)

Training and checkpoints, in one world-8 and one world-2 launch: the same Mixtral program
trains 2 steps with ``--clip-grad-norm`` and saves; a data-parallel HF MoE program (world 2,
expert 0 copied on both ranks, no pipeline) resumes that checkpoint for 2 more; every step's
gradient norm (expert 0 counted once over its copies, each stage's weights once over its dp
ranks) and loss equal one device's loop with torch's clipping, and the last checkpoint,
exported whole, loads into the model built from the spec with one device's weights.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import planner
from planner.api import prepare_model
from planner.model_spec import ModelSpec
from planner.strategy import Mesh
from search.moe_folding import folded_plan
from codegen.runtime.checkpoint import export_checkpoint
from codegen.runtime.launcher import random_like
from codegen.runtime.pipeline_parity import micro_batch_loss
from codegen.runtime.program import load_program
from moe_plans import HF_MOE, hf_moe_plan, moe_pipeline_plan, skewed_placement
from test_checkpoint import _losses, _ok, _torchrun
from test_parity import check_many, result_of

pytestmark = pytest.mark.distributed

WORLD = 8
MIXTRAL = ModelSpec("hf:mixtral", HF_MOE["mixtral"])
DEEPSEEK_V3 = ModelSpec("hf:deepseek_v3", {
    **{key: value for key, value in HF_MOE["mixtral"].items() if key != "num_local_experts"},
    "n_routed_experts": 4, "moe_intermediate_size": 40, "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1,
})
QWEN3_MOE = ModelSpec("hf:qwen3_moe", {
    **{key: value for key, value in HF_MOE["mixtral"].items() if key != "num_local_experts"},
    "num_experts": 4, "moe_intermediate_size": 40,
})
PROGRAMS = ("mixtral_pp2_dp4_copied_expert", "deepseek_v3_pp2_dp4_ep4", "qwen3_moe_pp2_dp2_tp2_ep2_edp2")
STEPS = 4  # 2 in the pipeline, 2 resumed without it
CLIP = 0.05  # below every step's norm on one device (checked in the test), so clipping acts each step


def _with_copied_expert(plan: planner.Plan) -> planner.Plan:
    """``plan`` with every MoE layer's expert 0 copied on stage ranks 0 and 1 (``skewed_placement``)."""
    layouts = tuple(dataclasses.replace(layout, placement=skewed_placement(layout.experts, layout.placement.devices))
                    for layout in plan.expert_layouts)
    return dataclasses.replace(plan, expert_layouts=layouts)


def _folded(spec: ModelSpec, ep: int) -> planner.Plan:
    graph, spec, name, cluster = prepare_model(spec, f"cpu:2x{WORLD // 2}")
    return folded_plan(graph, cluster, spec, name, Mesh((("pp", 2), ("dp", 2), ("tp", 2))), ep, micro_batches=2)


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline_hf_moe")
    plans = {
        PROGRAMS[0]: _with_copied_expert(moe_pipeline_plan(MIXTRAL, WORLD)),
        PROGRAMS[1]: moe_pipeline_plan(DEEPSEEK_V3, WORLD),
        PROGRAMS[2]: _folded(QWEN3_MOE, 2),
    }
    folders = {name: planner.compile(plan, root / name) for name, plan in plans.items()}
    return plans, folders, check_many(WORLD, list(folders.values()), root)


@pytest.mark.parametrize("name", PROGRAMS)
def test_hf_experts_parallel_in_stages_train_like_one_device(launch, name):
    plans, folders, run = launch
    plan = plans[name]
    assert plan.pipeline is not None and plan.pipeline.stages == 2 and plan.pipeline.micro_batches == 2
    assert plan.expert_layouts and all(layout.mode == "expert_parallel" for layout in plan.expert_layouts)
    source = (folders[name] / "model_spmd.py").read_text()
    # the experts run by the layout (one block function serves every layer); the router stays a traced op
    assert "= self.moe_experts(" in source, source
    assert "transformers.grouped_mm" not in source
    result = result_of(run, folders[name])
    assert result.startswith("ok parity ok: "), f"{name} ({plan.name}): {result}"


def test_the_folded_plan_puts_each_expert_on_two_ranks_of_each_stage(launch):
    """EP2 x EDP2 over a stage's dp2 x tp2 ranks: STAGE_EXPERTS gives every expert two holders."""
    _, folders, _ = launch
    source = (folders[PROGRAMS[2]] / "model_spmd.py").read_text()
    table = source[source.index("STAGE_EXPERTS = {"):]
    rows = [line for line in table.splitlines()[1:] if line.startswith("    'model.layers.")]
    assert len(rows) == 2, table
    for row in rows:
        assert "'hf_stacked_experts'" in row and "'expert_parallel'" in row, row
        assert row.count("0.5)") == 8, row  # 4 experts x 2 holders, each with half of its choices


def _single_device(folder) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Losses, gradient norms (before clipping) and the final weights of launch.py's loop on
    one device with torch's clipping: same init, batches (seeded 1000 + step), the
    pipeline's micro-batches (dropless routing: the same loss as the whole batch), AdamW at
    lr 1e-3."""
    program = load_program(folder)
    model, args, kwargs = program.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, norms = [], []
    for step in range(STEPS):
        torch.manual_seed(1000 + step)
        loss = micro_batch_loss(model, random_like(args), random_like(kwargs), program.plan.mesh.axis_size("dp"),
                                program.plan.pipeline.micro_batches)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, {name: value.detach() for name, value in model.state_dict().items()}


def test_clipped_steps_checkpoint_and_resume_without_the_pipeline_as_one_device(launch, tmp_path):
    _, folders, _ = launch
    pipeline = folders[PROGRAMS[0]]
    data_parallel = planner.compile(hf_moe_plan(2, "mixtral", "expert_parallel", "skewed"), tmp_path / "dp2")
    losses, norms, weights = _single_device(pipeline)
    assert min(norms) > CLIP  # clipping acted on every step: a wrong norm changes the losses too
    saved = tmp_path / "checkpoints"
    flags = ("--clip-grad-norm", str(CLIP), "--metrics", "metrics.jsonl", "--checkpoint-dir", str(saved))
    first = _losses(_ok(_torchrun(WORLD, str(pipeline / "launch.py"), "--steps", "2", *flags, cwd=tmp_path)))
    resumed = _losses(_ok(_torchrun(2, str(data_parallel / "launch.py"), "--steps", str(STEPS), "--resume", *flags,
                                    cwd=tmp_path)))
    assert sorted(first) == [1, 2] and sorted(resumed) == [3, 4]
    assert [first[1], first[2], resumed[3], resumed[4]] == pytest.approx(losses, rel=1e-5, abs=1e-5)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 2, 3, 4]
    assert [record["grad_norm"] for record in records] == pytest.approx(norms, rel=1e-5)
    assert [record["loss"] for record in records] == pytest.approx(losses, rel=1e-5, abs=1e-6)

    exported = tmp_path / "whole.pt"
    assert export_checkpoint(saved / "step-00000004", exported)[0] == STEPS
    whole = torch.load(exported, weights_only=True)
    model = load_program(pipeline).build_model()[0]
    model.load_state_dict(whole)  # strict: every name of the model built from the spec
    # AdamW moves a weight whose gradient is near eps by ~lr whatever its last bits (see
    # codegen/runtime/parity.py): the weights agree to lr / 10.
    for name, value in weights.items():
        torch.testing.assert_close(whole[name], value, atol=1e-4, rtol=0, msg=name)
