"""Distributed parity of pipeline programs (``codegen.pipeline_emit``), real gloo processes.

Megatron-LM pipeline plans (``search.megatron.megatron_plan`` with ``pp``) compile to a
program with one stage module per pipeline stage, run by ``torch.distributed.pipelining``
(``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B``). One pipeline step (all
micro-batches forward and backward, then AdamW) must equal one device's step: the loss, the
gradient of every parameter each stage holds and every updated parameter
(``codegen.runtime.pipeline_parity``, behind ``launch.py --check``).

- world 2: GPT (``examples/gpt.py``) on ``pp=2`` with 1F1B and with GPipe, and with 1F1B in
  bf16 mixed precision (stages under autocast, fp32 across boundaries); HF GPT-2 (tied
  embeddings: the token embedding on stage 0 and the output head on stage 1) with the plan
  the search's pipeline grid finds fastest on two nodes (``pp=2``, 1F1B, two micro-batches);
- world 4: GPT with the grid's fastest pipeline plan on ``cpu:2x2`` (``pp=2 x dp=2``, ZeRO-1
  over dp), GPT on ``pp=2 x tp=2`` with
  sequence parallelism (the value crossing the stages is split on the sequence over tp), GPT
  on ``pp=2 x dp=2``, HF GPT-2 on ``pp=2 x tp=2`` with GPipe, and a 4-layer tied GPT on
  ``pp=4`` (middle stages that receive and send; the labels travel through three
  boundaries; a tied weight on stages 0 and 3);
- world 8: GPT and a tiny Llama on ``pp=2 x dp=2 x tp=2`` with the per-op placements CP-SAT
  searched on the stage mesh (``search.stage_layouts``), which differ from Megatron's; and
  ``examples/moe.py`` (8 experts) as ``planner plan --mesh pp=2`` plans it on ``cpu:2x4``:
  two stages of ``dp=4``, each MoE layer expert parallel over its stage's 4 ranks (2 experts
  each), two micro-batches each routed on its own (``codegen.runtime.pipeline_moe``; the
  single-device reference runs the same micro-batches); and a 4-layer one on the same mesh
  under the interleaved schedule (two virtual stages per rank, four micro-batches), its MoE
  layers expert parallel; and the 2-layer one with every block recomputed in backward (the
  MoE layers route again there, every rank of the stage at once), and with stage 0's block
  recomputed keeping its MoE layer's exchanges (``full_keep_a2a``), stage 1's not; and a tiny 4-layer HF
  Mixtral as ``--mesh pp=2`` plans it there (its MoE blocks laid out replicated over each
  stage's 4 ranks, run as their traced ops); and tiny 2-layer HF MoE decoders with their
  stacked experts expert parallel in the stages (``codegen.runtime.pipeline_stacked_experts``;
  router, top-k and weighting stay traced ops): Mixtral on ``pp=2 x dp=4`` with expert 0
  copied on two ranks of each stage (its gradient summed over the copies), DeepSeek-V3 (MLA,
  2 dense layers then 3 MoE ones, the first stage holding both kinds, every block
  recomputed) on ``pp=2 x dp=4`` round-robin, and Qwen3-MoE folded on ``pp=2 x dp=2 x
  tp=2`` (attention tensor parallel, EP2 x EDP2 over each stage's 4 ranks).

As in ``test_spmd_parity.py``, each world size compiles its programs first and checks them
all in ONE launch of ``tests/dist_check_many.py`` (shared with other modules: ``tests/launch_groups.py``). Two negative controls must fail:
a program whose last stage drops the gradient of the activation it receives (stage 0 then
learns nothing), and a tied GPT-2 program whose stages do not sum the tied weight's gradients.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

import planner
from planner.api import prepare_model
from planner.errors import PlanningError
from planner.model_spec import ModelSpec
from search.megatron import megatron_plan
from moe_plans import HF_MOE, folded_pipeline_plan, moe_pipeline_plan, with_copied_expert
from launch_groups import register_group
from test_parity import HF_GPT2_TINY, REPO, Launch, result_of

pytestmark = pytest.mark.distributed

MODELS = {
    "gpt": ("examples/gpt.py", {"batch_size": 8}),
    "gpt2": ("hf:gpt2", HF_GPT2_TINY),
    "gpt4tied": ("examples/gpt.py", {"batch_size": 8, "n_layer": 4, "tie_weights": True}),
    "moe": ("examples/moe.py", {"batch_size": 16, "n_expert": 8, "ffn": 512, "capacity_factor": 1.0}),
    "moe4": ("examples/moe.py", {"batch_size": 16, "n_layer": 4, "n_expert": 8, "ffn": 256, "capacity_factor": 1.0}),
    "mixtral": ("hf:mixtral", {**HF_MOE["mixtral"], "num_hidden_layers": 4, "batch_size": 16}),
    "mixtral2": ("hf:mixtral", HF_MOE["mixtral"]),
    # 2 dense layers, then 3 MoE ones: two runs of blocks of one stack (planner.graph.BlockRun)
    "deepseek_v3": ("hf:deepseek_v3", {**HF_MOE["deepseek_v3"], "num_hidden_layers": 5, "first_k_dense_replace": 2}),
    "qwen3_moe": ("hf:qwen3_moe", HF_MOE["qwen3_moe"]),
    "llama": ("hf:llama", {
        "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "batch_size": 8,
    }),
}
SEARCHED = "searched"  # the pipeline plan the search itself proposes (search.pipeline_search.pipeline_plans)
# (model, case) -> megatron_plan keyword arguments, or SEARCHED. micro_batch=2: micro-batches of 2 samples
# per dp rank (4 micro-batches for GPT's batch of 8 on pp=2).
CASES = {
    2: {
        ("gpt", "pp2-1f1b"): dict(pp=2, schedule="1f1b"),
        ("gpt", "pp2-gpipe"): dict(pp=2, schedule="gpipe"),
        ("gpt", "pp2-1f1b-bf16"): dict(pp=2, schedule="1f1b", precision="bf16"),  # under bf16 autocast
        ("gpt2", "searched"): SEARCHED,
    },
    4: {
        ("gpt", "searched"): SEARCHED,
        ("gpt", "pp2xtp2-sp-1f1b"): dict(pp=2, tp=2, schedule="1f1b", sequence_parallel=True),
        ("gpt", "pp2xdp2-gpipe"): dict(pp=2, dp=2, schedule="gpipe"),
        ("gpt2", "pp2xtp2-gpipe"): dict(pp=2, tp=2, schedule="gpipe"),
        ("gpt4tied", "pp4-1f1b"): dict(pp=4, schedule="1f1b"),
    },
    8: {  # (pp, dp, tp) of the searched layout's mesh
        ("gpt", "soap-pp2xdp2xtp2"): dict(searched_layout=(2, 2, 2)),
        ("llama", "soap-pp2xdp2xtp2"): dict(searched_layout=(2, 2, 2)),
        ("moe", "searched-pp2xdp4-expert-parallel"): dict(mesh_pp=2),
        ("moe4", "pp2xdp4-interleaved-expert-parallel"): dict(moe_interleaved=True),
        ("moe", "pp2xdp4-1f1b-recompute-full"): dict(moe_recompute="full"),
        ("moe", "pp2xdp4-1f1b-stage0-recompute-keep-a2a"): dict(moe_recompute="full_keep_a2a", stage_modes=("full_keep_a2a", "none")),
        ("mixtral", "searched-pp2xdp4-hf-experts-replicated"): dict(hf_stages=2),
        ("mixtral2", "pp2xdp4-hf-experts-parallel-expert0-copied"): dict(hf_experts="copied"),
        ("deepseek_v3", "pp2xdp4-hf-experts-parallel-dense-and-moe-stage-recompute-full"): dict(dense_and_moe=True),
        ("qwen3_moe", "folded-pp2xdp2xtp2-ep2-edp2"): dict(hf_folded=2),
    },
}
ALL_CASES = [(world, model, case) for world, cases in CASES.items() for model, case in cases]


def make_plan(model: str, world: int, precision: str = "fp32", **options) -> planner.Plan:
    source, overrides = MODELS[model]
    spec = ModelSpec(source if source.startswith("hf:") else str(REPO / source), overrides)
    if options.get("searched"):
        # The fastest pipeline plan of the search's pipeline grid on two nodes
        # (search.pipeline_search: stages, schedule, micro-batches, dp flavour, recomputation).
        from search.budget import SearchBudget
        from search.pipeline_search import pipeline_plans

        graph, spec, name, cluster = prepare_model(spec, f"cpu:2x{world // 2}")
        plans = pipeline_plans(graph, cluster, spec, name, precision, SearchBudget(effort=16))
        return next(plan for plan in plans if plan.pipeline is not None)
    if options.get("searched_layout"):
        return searched_layout_plan(spec, world, *options["searched_layout"])
    if options.get("mesh_pp"):
        return moe_stages_plan(spec, world, options["mesh_pp"])
    if options.get("hf_stages"):
        return hf_moe_stages_plan(spec, world, options["hf_stages"])
    if options.get("hf_experts"):
        plan = moe_pipeline_plan(spec, world)
        return with_copied_expert(plan) if options["hf_experts"] == "copied" else plan
    if options.get("dense_and_moe"):
        return dense_and_moe_stage_plan(spec, world)
    if options.get("hf_folded"):
        return folded_pipeline_plan(spec, world, options["hf_folded"])
    if options.get("moe_interleaved"):
        return moe_pipeline_plan(spec, world, "interleaved", virtual_stages=2)
    if options.get("moe_recompute"):
        plan = moe_pipeline_plan(spec, world, recompute=options["moe_recompute"])
        if options.get("stage_modes"):
            plan = dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, stage_recompute=options["stage_modes"]))
        return plan
    graph, spec, name, cluster = prepare_model(spec, f"cpu:1x{world}")
    options.setdefault("micro_batch", 2)
    return megatron_plan(graph, cluster, spec, name, precision=precision, **options)


def searched_layout_plan(spec: ModelSpec, world: int, pp: int, dp: int, tp: int) -> planner.Plan:
    """The pipeline grid's plan on ``pp x dp x tp`` (1F1B, two micro-batches, DDP) with the
    layout CP-SAT searched on the stage mesh, which must differ from Megatron's."""
    from search.pipeline_search import PipelineGrid, PipelineSpace
    from search.stage_layouts import same_placements

    graph, spec, name, cluster = prepare_model(spec, f"cpu:2x{world // 2}")
    space = PipelineSpace(searched_layout="every", flavours=("ddp",), recompute=("none",), virtual_stages=())
    grid = PipelineGrid(graph, cluster, "fp32", space)
    config = next(
        c for c in grid.configurations()
        if (c.pp, c.dp, c.tp, c.layout, c.schedule, c.micro_batches) == (pp, dp, tp, "soap", "1f1b", 2)
    )
    estimate = grid.estimate(config)
    plan = grid.plan(estimate, spec, name)
    megatron = grid.plan(dataclasses.replace(estimate, config=dataclasses.replace(config, layout="megatron")), spec, name)
    assert plan.label == "soap" and not same_placements(plan.strategies, megatron.strategies)
    return plan


def dense_and_moe_stage_plan(spec: ModelSpec, world: int) -> planner.Plan:
    """The MoE pipeline grid's plan of a model with dense blocks before MoE ones, every block
    recomputed in backward: a stage must hold blocks of both kinds (the dense ones folded into
    one checkpointed function, the MoE ones into another)."""
    plan = moe_pipeline_plan(spec, world, recompute="full")
    graph = plan.graph
    assert len({run.kind for run in graph.block_runs}) == 2, graph.block_runs
    kinds_on: dict[int, set[int]] = {}
    for strategy in plan.strategies:
        block = graph.node(strategy.node).block
        if block is not None:
            kinds_on.setdefault(strategy.stage, set()).add(graph.block_run_of(block).kind)
    assert {0, 1} in kinds_on.values(), kinds_on
    return plan


def moe_stages_plan(spec: ModelSpec, world: int, pp: int) -> planner.Plan:
    """The plan of ``planner plan <spec> --cluster cpu:2x<world/2> --mesh pp=<pp>``, which
    must run its MoE layers expert parallel inside the stages, over several micro-batches."""
    from planner.constraints import SearchConstraints

    plan = planner.plan(spec, f"cpu:2x{world // 2}", constraints=SearchConstraints(mesh={"pp": pp}), progress=False)
    assert plan.pipeline is not None and plan.pipeline.micro_batches > 1, plan.name
    assert plan.expert_layouts and all(layout.mode == "expert_parallel" for layout in plan.expert_layouts), plan.name
    return plan


def hf_moe_stages_plan(spec: ModelSpec, world: int, pp: int) -> planner.Plan:
    """The plan of ``planner plan <hf MoE spec> --cluster cpu:2x<world/2> --mesh pp=<pp>``:
    the search lays its HuggingFace MoE blocks out over each stage's dp ranks; at this size it
    keeps the experts replicated, which the pipeline program runs as the blocks' traced ops."""
    from planner.constraints import SearchConstraints

    plan = planner.plan(spec, f"cpu:2x{world // 2}", constraints=SearchConstraints(mesh={"pp": pp}), progress=False)
    assert plan.pipeline is not None and plan.mesh.names == ("pp", "dp"), plan.name
    assert plan.expert_layouts and all(layout.mode == "data_parallel" for layout in plan.expert_layouts), plan.name
    return plan


# ------------------------------------------------------------------------ negative controls


def drop_boundary_gradient(folder: Path) -> Path:
    """The last stage receives its float activation as ``x * 0 + x.detach()``: the same value,
    but the gradient sent back to the previous stage is zeros."""
    source = folder / "model_spmd.py"
    text = source.read_text()
    pattern = re.compile(r"^(\s+)(\w+) = self\.receive\(\2, (\w+), (\([^)]*\))\)(.*)$", re.MULTILINE)
    floats = [m for m in pattern.finditer(text) if not m[2].startswith(("targets", "labels", "idx", "input_ids"))]
    assert floats, f"{source} receives no activation"
    match = floats[-1]
    name = match[2]
    replaced = f"{match[1]}{name} = self.receive({name} * 0 + {name}.detach(), {match[3]}, {match[4]}){match[5]}"
    source.write_text(text[: match.start()] + replaced + text[match.end() :])
    return folder


def untie_gradients(folder: Path) -> Path:
    """Stages that hold the same (tied) weight no longer sum its gradients."""
    source = folder / "model_spmd.py"
    text = source.read_text()
    assert re.search(r"^SHARED_PARAMETERS = \{\(0, 1\): ", text, re.MULTILINE), f"{source} shares no parameter"
    source.write_text(re.sub(r"^SHARED_PARAMETERS = .*$", "SHARED_PARAMETERS = {}", text, flags=re.MULTILINE))
    return folder


# ------------------------------------------------------------------------- one launch per world


@dataclass(frozen=True)
class WorldRun:
    """One torchrun launch of dist_check_many.py over every pipeline program of one world size."""

    world: int
    folders: dict[tuple[str, str], Path]
    broken: dict[str, Path]
    launch: Launch

    def result(self, folder: Path) -> str:
        return result_of(self.launch, folder)


def _world_programs(root: Path, world: int) -> tuple:
    folders = {
        (model, case): planner.compile(
            make_plan(model, world, **({"searched": True} if options == SEARCHED else options)), root / f"{model}_{case}"
        )
        for (model, case), options in CASES[world].items()
    }
    broken = {}
    if world == 2:
        broken["dropped boundary gradient"] = drop_boundary_gradient(
            planner.compile(make_plan("gpt", 2, pp=2), root / "gpt_dropped_boundary_gradient")
        )
        broken["untied gradients"] = untie_gradients(planner.compile(make_plan("gpt2", 2, pp=2), root / "gpt2_untied"))
    programs = [*folders.values(), *broken.values()]
    return (folders, broken), programs


# Checked in the session's launch of each world size (tests/launch_groups.py).
WORLD_GROUPS = {world: register_group(world, _world_programs) for world in (2, 4, 8)}


def _world_run(world: int, parity_launches) -> WorldRun:
    (folders, broken), launch = parity_launches.result(WORLD_GROUPS[world])
    return WorldRun(world, folders, broken, launch)


@pytest.fixture(scope="module")
def world2_run(parity_launches) -> WorldRun:
    return _world_run(2, parity_launches)


@pytest.fixture(scope="module")
def world4_run(parity_launches) -> WorldRun:
    return _world_run(4, parity_launches)


@pytest.fixture(scope="module")
def world8_run(parity_launches) -> WorldRun:
    return _world_run(8, parity_launches)


@pytest.mark.parametrize(("world", "model", "case"), ALL_CASES, ids=[f"world{w}-{m}-{c}" for w, m, c in ALL_CASES])
def test_pipeline_step_equals_single_device(request, world: int, model: str, case: str) -> None:
    run: WorldRun = request.getfixturevalue(f"world{world}_run")
    result = run.result(run.folders[model, case])
    assert result.startswith("ok parity ok: "), f"{model} {case} at world size {world}: {result}"


@pytest.mark.parametrize("control", ["dropped boundary gradient", "untied gradients"])
def test_broken_pipeline_is_reported(world2_run: WorldRun, control: str) -> None:
    result = world2_run.result(world2_run.broken[control])
    assert result.startswith("FAILED parity FAILED: worst tensor "), f"{control}: {result}"


# --------------------------------------------------------------------- the generated code itself


def test_program_says_what_crosses_each_boundary(world2_run: WorldRun, world4_run: WorldRun) -> None:
    """The header names each stage's modules and each boundary's values with their shapes;
    labels the last stage needs cross as int64; the tied embedding is held by both stages."""
    gpt = (world2_run.folders["gpt", "pp2-1f1b"] / "model_spmd.py").read_text()
    assert "Stage 0 holds wte, wpe, blocks.0 " in gpt and "Stage 1 holds blocks.1, ln_f, lm_head " in gpt
    assert "    targets: (2, 32): R on dp (int64)" in gpt
    assert re.search(r"    add_[0-9a-f]{6}: \(2, 32, 64\): R on dp\n", gpt), gpt  # op names digest the op
    assert "class GPTStage0(PipelineStageModule):" in gpt and "SCHEDULE = '1f1b'" in gpt
    gpt2 = (world2_run.folders["gpt2", "searched"] / "model_spmd.py").read_text()
    assert "SHARED_PARAMETERS = {(0, 1): ('transformer.wte.weight',)}" in gpt2
    recomputed = json.loads((world2_run.folders["gpt2", "searched"] / "plan.json").read_text())["recompute"] == "full"
    # Both layers (alike: one function, transformer_h_block), checkpointed when the plan recomputes.
    assert gpt2.count("def transformer_h_block(self, prefix: str, ") == 1
    assert gpt2.count("= checkpoint(transformer_h_block, self, ") == (2 if recomputed else 0)
    sp = (world4_run.folders["gpt", "pp2xtp2-sp-1f1b"] / "model_spmd.py").read_text()
    assert "(2, 32, 64) -> (2, 16, 64) per rank: S(1) on tp" in sp  # the sequence split crosses as is


def test_unknown_virtual_stages_are_refused_in_one_line() -> None:
    """1F1B with virtual stages is not a schedule torch runs (the interleaved one is)."""
    plan = make_plan("gpt4tied", 2, pp=2, schedule="1f1b")
    plan = dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, virtual_stages=2))
    with pytest.raises(PlanningError) as error:
        planner.compile(plan, "unused")
    message = str(error.value)
    assert "\n" not in message and "virtual stages" in message and "interleaved schedule" in message
