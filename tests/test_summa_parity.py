"""Compiled SUMMA programs train exactly like one device (``codegen.summa_emit``,
``codegen.runtime.summa_layouts``, forced layouts from ``search.summa_layout``).

Plans with every linear in a SUMMA layout compile to a program whose ``launch.py --check``
step (outputs, loss, every gradient and every updated parameter) equals one device's: at
world 4 a 2 x 2 grid (2-D SUMMA) for the two-block ``examples/gpt.py`` and tiny
``hf:llama``; at world 8 a 2 x 2 x 2 grid as 2.5-D (q = 2, d = 2: one GPT block, tiny
``hf:llama``) and as 3-D (q = 2: the two-block GPT, tiny ``hf:llama``, and tiny ``hf:llama``
again with its 3-D linears keeping their gathered operands for the backward), and one GPT block in
2-D SUMMA under ``dp`` = 2 (the weights' gradients summed over ``dp`` too), also with FSDP2
holding the weights split over ``dp`` and every block recomputed; and at world 8
the plan the search picks for the two-block GPT with SUMMA forced on (``tp_layouts="summa"``).
Each world size checks all its programs in ONE torchrun launch (``tests/dist_check_many.py``).
The controls are the 2-D GPT and the 2.5-D GPT block with the gradients of replicated shards
left unsummed (bias and norm chunks over the ranks holding other rows; 2.5-D's weights over
``dep``): their check must fail in a gradient. Without launches: the forced layout's
placements (3-D alternates ``swapped`` so each block returns to its input's layout), the
program's comments naming the collectives, and plans refused in one line: a SUMMA layout on
an op the program cannot run, a SUMMA linear read in other placements, a SUMMA op the
compile-time dry run could not run.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
from pathlib import Path

import pytest
from torch.distributed.tensor import Replicate, Shard

import planner
from planner.errors import PlanningError
from planner.model_spec import ModelSpec
from planner.strategy import SummaLayout
from summa_plans import GPT, GPT_BLOCK, GPT_SMALL, LLAMA_TINY, summa_plan
from launch_groups import register_group
from test_parity import result_of

GPT_SPEC, BLOCK_SPEC, LLAMA_SPEC = ModelSpec(GPT, GPT_SMALL), ModelSpec(GPT, GPT_BLOCK), ModelSpec("hf:llama", LLAMA_TINY)
# name -> (spec, family, dp); every case of one world size runs in one launch.
CASES = {
    4: {"gpt_2d": (GPT_SPEC, "2d", 1), "llama_2d": (LLAMA_SPEC, "2d", 1)},
    8: {
        "gpt_block_2.5d": (BLOCK_SPEC, "2.5d", 1), "llama_2.5d": (LLAMA_SPEC, "2.5d", 1),
        "gpt_3d": (GPT_SPEC, "3d", 1), "llama_3d": (LLAMA_SPEC, "3d", 1),
        "llama_3d_gathers_kept": (LLAMA_SPEC, "3d", 1),
        "gpt_block_dp2_2d": (BLOCK_SPEC, "2d", 2),
    },
}
# Cases whose 3-D linears keep the forward's gathered x and W for the backward.
GATHERS_KEPT = {"llama_3d_gathers_kept"}
# Cases whose replicated weights are held split over dp (FSDP2), every block recomputed in
# backward (the SUMMA collectives run again inside the checkpoint): name -> (spec, family, dp).
FSDP_CASES = {4: {}, 8: {"gpt_dp2_2d_fsdp_recompute": (GPT_SPEC, "2d", 2)}}
# Plans the search picks with SUMMA forced on (``tp_layouts="summa"``): name -> spec.
SEARCHED = {4: {}, 8: {"gpt_searched_summa": GPT_SPEC}}
# control name -> the case whose program it breaks.
CONTROLS = {4: {"gpt_2d_replica_gradients_unsummed": "gpt_2d"},
            8: {"gpt_block_2.5d_replica_gradients_unsummed": "gpt_block_2.5d"}}
# Replaces the runtime's gradient marking: every replicated shard's local gradient is taken
# as its whole gradient (no sum over the ranks that saw other rows).
_UNSUMMED = (
    "\nsumma_layouts._local_with_partial_gradient = lambda param, rows_split: param.to_local()"
    "  # CONTROL: replica gradients not summed\n"
)


@functools.cache
def block_plan(family: str):
    """A forced-layout plan of one GPT block (traced once per family for the tests without launches)."""
    return summa_plan(BLOCK_SPEC, family)


def _world_programs(root, world):
    """Compile every program of one world size and break the controls."""
    folders = {}
    for name, (spec, family, dp) in CASES[world].items():
        folders[name] = root / name
        planner.compile(summa_plan(spec, family, dp=dp, keep_gathered=name in GATHERS_KEPT), folders[name])
    for name, (spec, family, dp) in FSDP_CASES[world].items():
        folders[name] = root / name
        planner.compile(summa_plan(spec, family, dp=dp, flavour="fsdp", recompute="full"), folders[name])
    for name, spec in SEARCHED[world].items():
        plan = planner.plan(spec, f"cpu:1x{world}", tp_layouts="summa", effort=0.25, progress=False)
        assert any(isinstance(s.layout, SummaLayout) for s in plan.strategies), f"{name}: no SUMMA layout in {plan.mesh}"
        folders[name] = root / name
        planner.compile(plan, folders[name])
    for control, base in CONTROLS[world].items():
        folders[control] = root / control
        shutil.copytree(folders[base], folders[control])
        program = folders[control] / "model_spmd.py"
        text = program.read_text()
        assert "summa_layouts._local_with_partial_gradient" not in text
        program.write_text(text + _UNSUMMED)
    return folders, list(folders.values())


# Checked in the session's launch of each world size (tests/launch_groups.py).
WORLD_GROUPS = {world: register_group(world, _world_programs) for world in sorted(CASES)}


@pytest.fixture(scope="module", params=sorted(CASES))
def world_run(request, parity_launches):
    world = request.param
    folders, launch = parity_launches.result(WORLD_GROUPS[world])
    return world, {name: result_of(launch, folder) for name, folder in folders.items()}, folders


def test_summa_programs_train_like_one_device(world_run):
    world, results, _ = world_run
    failed = {name: results[name] for name in [*CASES[world], *FSDP_CASES[world], *SEARCHED[world]] if not results[name].startswith("ok")}
    assert not failed, failed


def test_unsummed_replica_gradients_fail(world_run):
    world, results, _ = world_run
    for control in CONTROLS[world]:
        verdict = results[control]
        assert verdict.startswith("FAILED") and "grad" in verdict, f"{control}: {verdict}"


def test_program_names_its_collectives(world_run):
    world, _, folders = world_run
    name = "gpt_2d" if world == 4 else "gpt_3d"
    source = (folders[name] / "model_spmd.py").read_text()
    assert "summa_layouts.summa_linear(" in source and "summa_layouts.block_layer_norm(" in source
    if world == 4:
        assert "broadcasts x's block l along 'col'" in source and "W's block l along 'row'" in source
    else:
        assert "all-gather W over 'dep'" in source and "reduce-scatter y over 'col'" in source
        assert "swapped=True" in source and "reduce-scatter y over 'row'" in source
        assert "keep_gathered" not in source
        kept = (folders["llama_3d_gathers_kept"] / "model_spmd.py").read_text()
        assert "keep_gathered=True" in kept and "reuse the forward's gathered x and W" in kept


@pytest.mark.parametrize("family", ["2.5d", "3d"])
def test_forced_layout_returns_each_block_to_its_input_layout(family):
    plan = block_plan(family)
    axes = plan.mesh.names
    linears = [s for s in plan.strategies if s.op.startswith("aten.linear.")]
    assert linears and all(isinstance(s.layout, SummaLayout) and s.layout.family == family for s in linears)
    rows = [axes.index(a) for a in (("dep", "row") if family == "2.5d" else ("row", "dep"))]
    for strategy in linears:
        x = strategy.inputs[0]
        assert all(x[i] == Shard(0) for i in rows) or strategy.layout.swapped
    if family == "3d":
        # c_attn, attn.c_proj, c_fc, mlp.c_proj, lm_head: swapped alternates by data flow.
        assert [s.layout.swapped for s in linears] == [False, True, False, True, False]
        weight = linears[0].params["blocks.0.attn.c_attn.weight"]
        assert weight == (Shard(0), Shard(1), Shard(1))  # row S(0) (N), col and dep S(1) (K)
    else:
        weight = linears[0].params["blocks.0.attn.c_attn.weight"]
        assert weight == (Replicate(), Shard(1), Shard(0))  # dep R, row S(1) (K), col S(0) (N)


def test_summa_layout_on_an_unsupported_op_is_refused(tmp_path: Path):
    plan = block_plan("2d")
    layout = next(s.layout for s in plan.strategies if s.layout is not None)
    strategies = tuple(
        dataclasses.replace(s, layout=layout) if s.op.startswith("aten.gelu.") else s for s in plan.strategies
    )
    with pytest.raises(PlanningError, match=r"gelu.*SUMMA layouts on linears and layer norms only") as error:
        planner.compile(dataclasses.replace(plan, strategies=strategies), tmp_path / "out")
    assert "\n" not in str(error.value)


def test_summa_linear_read_in_other_placements_is_refused(tmp_path: Path):
    plan = block_plan("2d")
    first = next(s for s in plan.strategies if s.op.startswith("aten.linear."))
    wrong = dataclasses.replace(first, inputs=((Shard(0), Replicate()), *first.inputs[1:]))  # hidden dim not split on col
    strategies = tuple(wrong if s is first else s for s in plan.strategies)
    with pytest.raises(PlanningError, match=r"reads x as \(S\(0\), R\): the runtime needs S\(2\) on 'col'") as error:
        planner.compile(dataclasses.replace(plan, strategies=strategies), tmp_path / "out")
    assert "\n" not in str(error.value)


def test_summa_op_failing_the_dry_run_is_refused_not_run_whole():
    # The dry run "forces" an op DTensor fails on to run on whole inputs; for a SUMMA node
    # that would silently drop the algorithm, so compile refuses instead.
    from codegen.summa_emit import refuse_forced

    plan = block_plan("2d")
    first = next(s.node for s in plan.strategies if s.op.startswith("aten.linear."))
    refuse_forced(plan, {"gelu": "ValueError: not a SUMMA node"})  # other ops may fall back
    with pytest.raises(PlanningError, match=rf"node '{first}' has a 2-D SUMMA q=2 layout .* dry run failed on it \(ValueError: bad\)"):
        refuse_forced(plan, {first: "ValueError: bad"})
