"""Distributed parity of the recomputation modes and pipeline shapes the simulator prices
beyond the basic ones: selective recomputation (``codegen.attention_core``) in graph, pipeline
and data-parallel programs, pipelines whose stages hold different numbers of blocks (1+3 and
3+1 blocks of a 4-layer GPT), and the interleaved 1F1B schedule (2 virtual stages per rank,
``ScheduleInterleaved1F1B``; ``codegen.pipeline_schedules``) on pp=2, pp=2 x tp=2 and
pp=2 x dp=2, also with weights tied across virtual stages (below). Real gloo processes; one step (all micro-batches
forward and backward, then AdamW) equals one device's step: loss, gradients and updated
parameters (``codegen.runtime.parity`` / ``pipeline_parity``, behind ``launch.py --check``).

GPT (``examples/gpt.py``) with ``attention="eager"`` has an explicit attention core (its
(seq, seq) scores are what selective recomputation drops); with the default fused SDPA it has
none, and selective compiles as no recomputation (``tests/test_recompute.py`` checks the
memory side of both).

Tied weights under the interleaved schedule (``tests/models/shared_norm_gpt.py``, fp32 so a
gradient off by a fraction of itself shows): the token embedding is the output head (stages 0
and 3: pp ranks 0 and 1) and all blocks share one LayerNorm (all 4 stages: stages 0 and 2 on
rank 0, 1 and 3 on rank 1). Torch's schedules divide each stage's gradients by the number of
micro-batches when that stage's backward ends, which divided a weight that two stages of one
rank share twice (the norm's gradient was off by 2.5e-3); ``codegen.runtime.pipeline`` divides
each parameter once. ``test_composed_dp.py`` runs this model interleaved on pp x dp x tp.

As in ``test_pipeline_parity.py``, each world size compiles its programs first and checks
them all in ONE torchrun launch of ``tests/dist_check_many.py``. The negative controls must
fail: a selective program whose attention core hands its output on detached (the
projections before it then get no gradient through attention), and the tied program with its
stages no longer summing the shared weights' gradients.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import planner
from planner.api import prepare_model
from planner.model_spec import ModelSpec
from search.megatron import megatron_plan
from launch_groups import register_group
from test_parity import REPO, result_of

pytestmark = pytest.mark.distributed

GPT = str(REPO / "examples/gpt.py")
SHARED_NORM_GPT = ModelSpec(str(REPO / "tests/models/shared_norm_gpt.py"), {"batch_size": 8, "n_layer": 4})
EAGER = {"batch_size": 8, "attention": "eager"}
FOUR_LAYERS = {"batch_size": 8, "n_layer": 4}
# (world, case) -> (GPT's overrides or another model, megatron_plan keyword arguments, blocks per stage or None)
CASES = {
    2: {
        "uneven-pp2-1f1b-1+3": (FOUR_LAYERS, dict(pp=2), (1, 3)),
        "uneven-pp2-gpipe-3+1-selective": ({**FOUR_LAYERS, **EAGER}, dict(pp=2, schedule="gpipe", recompute="selective"), (3, 1)),
        "interleaved-pp2-v2": (FOUR_LAYERS, dict(pp=2, schedule="interleaved", virtual_stages=2), None),
        "per-stage-pp2-1f1b-full+none": (FOUR_LAYERS, dict(pp=2), None),
        "tied-interleaved-pp2-v2": (SHARED_NORM_GPT, dict(pp=2, schedule="interleaved", virtual_stages=2), None),
    },
    4: {
        "selective-tp2xdp2": (EAGER, dict(tp=2, recompute="selective"), None),
        "selective-pp2xtp2-1f1b": (EAGER, dict(pp=2, tp=2, recompute="selective"), None),
        "selective-ddp": (EAGER, dict(recompute="selective", dp_flavour="ddp"), None),
        "selective-fsdp-sdpa": ({"batch_size": 8}, dict(recompute="selective", dp_flavour="fsdp"), None),
        "uneven-pp2xtp2-1f1b-1+3-full": (FOUR_LAYERS, dict(pp=2, tp=2, recompute="full"), (1, 3)),
        "interleaved-pp2xtp2-v2": (FOUR_LAYERS, dict(pp=2, tp=2, schedule="interleaved", virtual_stages=2), None),
        "interleaved-pp2xdp2-v2-selective": (
            {**FOUR_LAYERS, **EAGER}, dict(pp=2, dp=2, schedule="interleaved", virtual_stages=2, recompute="selective"), None
        ),
        "per-stage-interleaved-pp2xtp2-v2": (
            {**FOUR_LAYERS, **EAGER}, dict(pp=2, tp=2, schedule="interleaved", virtual_stages=2), None
        ),
    },
}
# Cases whose stages recompute differently (PipelineConfig.stage_recompute, chosen per stage
# by the pipeline grid when the first stages hold more micro-batches than fit).
STAGE_RECOMPUTE = {
    "per-stage-pp2-1f1b-full+none": ("full", "none"),
    "per-stage-interleaved-pp2xtp2-v2": ("full", "selective", "none", "selective"),
}
ALL_CASES = [(world, case) for world, cases in CASES.items() for case in cases]


def restage(plan: planner.Plan, graph, blocks_per_stage: tuple[int, ...]) -> planner.Plan:
    """``plan`` with its ops moved so stage ``s`` holds ``blocks_per_stage[s]`` blocks (the ops
    before the first block on the first stage, those after the last on the last)."""
    first_block = [sum(blocks_per_stage[:s]) for s in range(len(blocks_per_stage))]
    nodes = {node.name: node for node in graph.nodes}
    strategies, seen_block = [], False
    for strategy in plan.strategies:
        block = nodes[strategy.node].block
        if block is not None:
            seen_block = True
            stage = max(s for s, first in enumerate(first_block) if block[1] >= first)
        else:
            stage = len(blocks_per_stage) - 1 if seen_block else 0
        strategies.append(dataclasses.replace(strategy, stage=stage))
    return dataclasses.replace(plan, strategies=tuple(strategies))


def with_stage_recompute(plan: planner.Plan, modes: tuple[str, ...]) -> planner.Plan:
    """``plan`` with each pipeline stage module recomputing as ``modes`` says."""
    heaviest = max(modes, key=("none", "selective", "full").index)
    pipeline = dataclasses.replace(plan.pipeline, stage_recompute=modes)
    return dataclasses.replace(plan, pipeline=pipeline, recompute=heaviest)


def make_plan(world: int, model: dict | ModelSpec, options: dict, blocks_per_stage=None, case: str = "") -> planner.Plan:
    spec = model if isinstance(model, ModelSpec) else ModelSpec(GPT, model)
    options = dict(options)
    flavour = options.pop("dp_flavour", None)
    if flavour is not None:  # a data-parallel program (DDP/ZeRO/FSDP around the model)
        plan = planner.plan(spec, f"cpu:1x{world}", dp_flavour=flavour, precision="fp32")
        return dataclasses.replace(plan, recompute=options.get("recompute", "none"))
    graph, spec, name, cluster = prepare_model(spec, f"cpu:1x{world}")
    options.setdefault("micro_batch", 2 if options.get("pp", 1) > 1 else 1)
    plan = megatron_plan(graph, cluster, spec, name, precision="fp32", **options)
    if case in STAGE_RECOMPUTE:
        plan = with_stage_recompute(plan, STAGE_RECOMPUTE[case])
    return restage(plan, graph, blocks_per_stage) if blocks_per_stage else plan


def detach_attention_output(folder: Path) -> Path:
    """Negative control: the first checkpointed attention core's output goes on detached."""
    source = folder / "model_spmd.py"
    text = source.read_text()
    match = re.search(r"^(\s+)\((\w+),\) = checkpoint\(_blocks_0_attention, use_reentrant=False\)$", text, re.MULTILINE)
    assert match, f"{source} checkpoints no attention core"
    detached = f"{match[0]}\n{match[1]}{match[2]} = {match[2]}.detach()"
    source.write_text(text[: match.start()] + detached + text[match.end() :])
    return folder


def stop_summing_shared_gradients(folder: Path) -> Path:
    """Negative control: the stages that hold a tied weight keep their own gradients."""
    source = folder / "model_spmd.py"
    text = source.read_text()
    assert re.search(r"^SHARED_PARAMETERS = \{\(0, 1, 2, 3\): ", text, re.MULTILINE), f"{source} shares nothing over 4 stages"
    source.write_text(re.sub(r"^SHARED_PARAMETERS = .*$", "SHARED_PARAMETERS = {}", text, flags=re.MULTILINE))
    return folder


def _world_programs(root: Path, world: int):
    folders = {
        case: planner.compile(make_plan(world, overrides, options, stages, case), root / case)
        for case, (overrides, options, stages) in CASES[world].items()
    }
    broken = {}
    if world == 2:
        model, options, _ = CASES[2]["tied-interleaved-pp2-v2"]
        broken["unsummed tied gradients"] = stop_summing_shared_gradients(
            planner.compile(make_plan(world, model, options), root / "broken_unsummed_tied")
        )
    if world == 4:
        overrides, options, _ = CASES[4]["selective-tp2xdp2"]
        broken["detached attention"] = detach_attention_output(
            planner.compile(make_plan(world, overrides, options), root / "broken_detached_attention")
        )
    return (folders, broken), [*folders.values(), *broken.values()]


# Checked in the session's launch of each world size (tests/launch_groups.py).
WORLD_GROUPS = {world: register_group(world, _world_programs) for world in (2, 4)}


@pytest.fixture(scope="module")
def world2_run(parity_launches):
    (folders, broken), launch = parity_launches.result(WORLD_GROUPS[2])
    return folders, broken, launch


@pytest.fixture(scope="module")
def world4_run(parity_launches):
    (folders, broken), launch = parity_launches.result(WORLD_GROUPS[4])
    return folders, broken, launch


@pytest.mark.parametrize(("world", "case"), ALL_CASES, ids=[f"world{w}-{c}" for w, c in ALL_CASES])
def test_step_equals_single_device(request, world: int, case: str) -> None:
    folders, _, launch = request.getfixturevalue(f"world{world}_run")
    result = result_of(launch, folders[case])
    assert result.startswith("ok parity ok: "), f"{case} at world size {world}: {result}"


@pytest.mark.parametrize(("world", "control"), [(4, "detached attention"), (2, "unsummed tied gradients")])
def test_broken_program_is_reported(request, world: int, control: str) -> None:
    _, broken, launch = request.getfixturevalue(f"world{world}_run")
    result = result_of(launch, broken[control])
    assert result.startswith("FAILED parity FAILED: worst tensor "), f"{control}: {result}"


def test_programs_say_what_they_recompute_and_where_stages_cut(world2_run, world4_run) -> None:
    folders2, _, _ = world2_run
    folders4, _, _ = world4_run
    uneven = (folders2["uneven-pp2-1f1b-1+3"] / "model_spmd.py").read_text()
    assert "Stage 0 holds wte, wpe, blocks.0 " in uneven and "Stage 1 holds blocks.1, blocks.2, blocks.3, ln_f, lm_head " in uneven
    selective = (folders4["selective-pp2xtp2-1f1b"] / "model_spmd.py").read_text()
    assert "attention core is recomputed in backward (selective recomputation)" in selective
    assert selective.count("checkpoint(_blocks_") == 2
    ddp = (folders4["selective-ddp"] / "model_spmd.py").read_text()
    assert "    'blocks.0.attn.core',\n    'blocks.1.attn.core',\n" in ddp and "recompute_in_backward(model.get_submodule(path))" in ddp
    interleaved = (folders2["interleaved-pp2-v2"] / "model_spmd.py").read_text()
    assert "ScheduleInterleaved1F1B" in interleaved and "rank p holds stages p, p + 2)" in interleaved
    assert "Stage 1 holds blocks.1 " in interleaved and "Stage 3 holds blocks.3, ln_f, lm_head " in interleaved
    assert re.search(r"^STAGES = \(GPTStage0, GPTStage1, GPTStage2, GPTStage3\)  # stage s runs on the ranks at pp coordinate s % 2", interleaved, re.MULTILINE)
    tied = (folders2["tied-interleaved-pp2-v2"] / "model_spmd.py").read_text()
    shared = re.search(r"^SHARED_PARAMETERS = (.*)$", tied, re.MULTILINE)[1]
    assert shared == "{(0, 1, 2, 3): ('blocks.0.ln_1.weight', 'blocks.0.ln_1.bias'), (0, 3): ('wte.weight',)}"
    fused = (folders4["selective-fsdp-sdpa"] / "model_spmd.py").read_text()
    assert "RECOMPUTED_BLOCKS = ()" in fused and "attention is one fused op, e.g. scaled_dot_product_attention" in fused


def test_stages_recompute_as_their_modes_say(world2_run, world4_run) -> None:
    """Only the stages whose mode says so checkpoint, and the header lists each stage's mode."""
    folders2, _, _ = world2_run
    folders4, _, _ = world4_run
    two = (folders2["per-stage-pp2-1f1b-full+none"] / "model_spmd.py").read_text()
    assert "    stage 0: every repeated block recomputed in backward" in two and "    stage 1: no recomputation" in two
    stage0, stage1 = two.split("class GPTStage1")[0].split("class GPTStage0")[1], two.split("class GPTStage1")[1]
    assert stage0.count("= checkpoint(blocks_block, self, 'blocks.") == 2 and "checkpoint(" not in stage1.split("\nSTAGES = ")[0]
    four = (folders4["per-stage-interleaved-pp2xtp2-v2"] / "model_spmd.py").read_text()
    classes = re.split(r"^class GPTStage\d", four, flags=re.MULTILINE)[1:]
    calls = [c.split("\nSTAGES = ")[0].count("= checkpoint(") for c in classes]
    assert calls == [1, 1, 0, 1], calls  # full (block 0), selective (block 1's core), none, selective
    assert "checkpoint(_blocks_1_attention" in classes[1] and "checkpoint(_blocks_3_attention" in classes[3]
