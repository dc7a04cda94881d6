"""ZeRO-1, ZeRO-2 and FSDP on the ``dp`` axis composed with tensor and pipeline parallelism.

Graph and pipeline programs hold every parameter as a DTensor over the whole mesh. Under
``zero2``/``fsdp`` a parameter is also split over ``dp`` between uses
(``codegen.spmd_placements.held_over_dp``): each reader gathers it over ``dp`` (an
all-gather in forward), whose backward reduce-scatters the gradient's partial sums, so each
rank keeps 1/dp of the weights, gradients and AdamW states. Inside a recomputed block the
gather runs again in backward and the gathered weight is not kept: FSDP. Without
recomputation the gathered weights are kept until backward: ZeRO-2's memory (so ZeRO-2 does
not compose with pipelines, whose micro-batches in flight would each keep a copy). ZeRO-1
keeps weights and gradients whole over ``dp`` and steps each rank's 1/dp of every weight
(``codegen.runtime.sharded_states``), then all-gathers the updated pieces.

Here: the held placements worked out by hand, the bytes each rank really holds and saves (a
fake process group on real CPU tensors), what compile refuses, what the search offers, and
parity with one device at worlds 4 and 8 (FSDP x TP, ZeRO-2 x TP, ZeRO-1 x TP, FSDP x PP,
ZeRO-1 x PP, FSDP x TP x PP, ZeRO-1 x TP x PP, and the plans the search picks on two nodes),
each world in one torchrun launch, with a ZeRO-1 program that never shares its updated
pieces as a negative control.

At world 8 one program takes every axis and schedule option at once: ZeRO-1 on
``pp=2 x dp=2 x tp=2`` under the interleaved 1F1B schedule (2 virtual stages per rank) in bf16
mixed precision (both sides under the same autocast; bf16's tolerances), on a model whose
weights are tied across virtual stages (``tests/models/shared_norm_gpt.py``: its embedding
on stages 0 and 3, one LayerNorm on all 4; ``test_schedule_parity.py`` checks it in fp32 at
world 2). The searched plans (GPT and the small llama on ``cpu:2x2`` and ``cpu:2x4``) are
checked whatever the search picks; the test prints the picks (``pytest -s``) and names them
when it fails.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import planner
from codegen.spmd_placements import held_over_dp
from planner.api import compile_blocker, prepare_model
from planner.errors import PlanningError
from planner.model_spec import ModelSpec
from planner.verdict import strategy_words
from search.auto import search_plan
from search.plan_variants import composed_flavours
from search.megatron import megatron_plan
from fake_group import graph_program_on_rank0
from launch_groups import register_group
from test_parity import REPO, result_of

R, S0, S1 = Replicate(), Shard(0), Shard(1)
GPT = ModelSpec(str(REPO / "examples/gpt.py"), {"batch_size": 8})
GPT4 = ModelSpec(str(REPO / "examples/gpt.py"), {"batch_size": 8, "n_layer": 4})
SHARED_NORM_GPT = ModelSpec(str(REPO / "tests/models/shared_norm_gpt.py"), {"batch_size": 8, "n_layer": 4})
LLAMA = ModelSpec("hf:llama", {
    "num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 512,
    "num_attention_heads": 8, "num_key_value_heads": 4,
})


# ------------------------------------------------------------------- held placements by hand


@pytest.mark.parametrize(
    ("planned", "shape", "flavour", "held"),
    [
        ((R, S0), (192, 64), "zero2", (S1, S0)),  # column-parallel weight: dp takes the other dim
        ((R, S1), (64, 256), "fsdp", (S0, S1)),  # row-parallel weight
        ((R, R), (64,), "fsdp", (S0, R)),  # a norm's weight, whole on tp
        ((R, S0), (192,), "zero2", (R, S0)),  # a tp-split bias has no dimension left: whole on dp
        ((R, R), (1, 64), "zero2", (S1, R)),  # dim 0 shorter than dp: the next one
        ((R, S0), (192, 64), "ddp", (R, S0)),  # DDP keeps weights as their readers want them
    ],
)
def test_weights_are_held_split_over_dp_on_a_dimension_no_other_axis_splits(planned, shape, flavour, held):
    assert held_over_dp(planned, shape, ("dp", "tp"), (2, 2), flavour) == held


def test_a_mesh_without_a_real_dp_axis_holds_weights_as_planned():
    assert held_over_dp((R, S0), (192, 64), ("pp", "tp"), (2, 2), "fsdp") == (R, S0)
    assert held_over_dp((R, S0), (192, 64), ("dp", "tp"), (1, 2), "fsdp") == (R, S0)


# ------------------------------------------------------------- what each rank holds and saves


@pytest.fixture(scope="module")
def gpt_world4():
    return prepare_model(GPT, "cpu:1x4")


def _held_and_saved(plan) -> tuple[int, int]:
    """Run the graph program of ``plan`` forward as rank 0 of a fake process group (no
    communication; real CPU tensors): the parameter elements this rank holds, and the bytes
    of the storages autograd keeps for backward outside checkpointed regions that are not
    the parameters' own (gathered weights, activations)."""
    with graph_program_on_rank0(plan, "cpu") as (spmd, local_args, local_kwargs):
        locals_ = [p.to_local() if hasattr(p, "to_local") else p for p in spmd.parameters()]
        held = sum(t.numel() for t in locals_)
        storages = {t.untyped_storage().data_ptr() for t in locals_}
        saved = 0

        def pack(tensor):
            nonlocal saved
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            storage = local.untyped_storage()
            if storage.data_ptr() not in storages:
                storages.add(storage.data_ptr())  # each storage once
                saved += storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            spmd(*local_args, **local_kwargs)
        return held, saved


def test_zero2_and_fsdp_hold_half_the_weights_and_fsdp_keeps_no_gathered_block_weight(gpt_world4):
    graph, spec, name, cluster = gpt_world4
    base = megatron_plan(graph, cluster, spec, name, tp=2, precision="fp32")  # dp=2 x tp=2
    held = {}
    for flavour, recompute in (("ddp", "none"), ("zero2", "none"), ("ddp", "full"), ("fsdp", "full")):
        held[flavour, recompute] = _held_and_saved(dataclasses.replace(base, dp_flavour=flavour, recompute=recompute))
    # Every weight matrix is split over dp too; only 1-D tensors split on tp stay whole there.
    assert held["zero2", "none"][0] < 0.52 * held["ddp", "none"][0]
    assert held["fsdp", "full"][0] == held["zero2", "none"][0]
    # The blocks' weight matrices, as each tp rank reads them (fp32): what ZeRO-2 keeps gathered.
    block_weights = sum(
        meta.numel // 2 * 4 for param, meta in graph.parameters.items() if param.startswith("blocks.") and len(meta.shape) == 2
    )
    assert held["zero2", "none"][1] - held["ddp", "none"][1] >= block_weights
    # FSDP re-gathers them in backward: only the weights around the blocks stay gathered.
    assert held["fsdp", "full"][1] - held["ddp", "full"][1] < block_weights / 4


def test_zero1_keeps_optimizer_states_for_its_piece_only():
    """AdamW's moments of a (6, 4) and a (5,) weight over dp = 2 (rank 1 of a fake group):
    rows 3..5 of the first (12 of 24 elements), all of the second (5 does not split)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from codegen.runtime.sharded_states import ShardedStatesOptimizer

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        matrix, vector = torch.nn.Parameter(torch.zeros(6, 4)), torch.nn.Parameter(torch.zeros(5))
        optimizer = ShardedStatesOptimizer([matrix, vector], mesh, "dp", torch.optim.AdamW, lr=0.1)
        matrix.grad, vector.grad = torch.ones(6, 4), torch.ones(5)
        optimizer.step()
        moments = sorted(state["exp_avg"].numel() for state in optimizer.state.values())
        assert moments == [5, 12]
        assert (matrix[3:] != 0).all() and (vector != 0).all()  # its piece stepped in place
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------- compile and the search


def test_compile_refuses_fsdp_without_recomputation_and_zero2_with_pipelines_in_one_line(gpt_world4):
    graph, spec, name, cluster = gpt_world4
    base = megatron_plan(graph, cluster, spec, name, tp=2, precision="fp32")
    pipelined = megatron_plan(graph, cluster, spec, name, pp=2, micro_batch=2, precision="fp32")
    for plan, words in (
        (dataclasses.replace(base, dp_flavour="fsdp"), "recompute full"),
        (dataclasses.replace(pipelined, dp_flavour="zero2"), "micro-batch in flight"),
    ):
        blocker = compile_blocker(plan)
        assert blocker and "\n" not in blocker and words in blocker
        with pytest.raises(PlanningError, match=words):
            planner.compile(plan, "unused")
    assert compile_blocker(dataclasses.replace(base, dp_flavour="zero2")) is None
    assert compile_blocker(dataclasses.replace(base, dp_flavour="zero1")) is None
    assert compile_blocker(dataclasses.replace(pipelined, dp_flavour="zero1")) is None
    assert compile_blocker(dataclasses.replace(base, dp_flavour="fsdp", recompute="full")) is None


def test_composed_flavours_shard_gradients_and_states_over_dp(gpt_world4):
    graph, spec, name, cluster = gpt_world4
    base = megatron_plan(graph, cluster, spec, name, tp=2, precision="fp32")
    variants = {(p.dp_flavour, p.recompute): p for p in composed_flavours(base, graph)}
    assert set(variants) == {("zero2", "none"), ("zero2", "full"), ("fsdp", "full")}
    ddp, zero2, fsdp = base.estimate.memory, variants["zero2", "none"].estimate.memory, variants["fsdp", "full"].estimate.memory
    assert zero2.weights == ddp.weights
    assert zero2.gradients == pytest.approx(ddp.gradients / 2, abs=1)
    assert zero2.optimizer_states == pytest.approx(ddp.optimizer_states / 2, abs=1)
    assert fsdp.weights < ddp.weights and fsdp.gradients == zero2.gradients
    assert variants["zero2", "none"].name == "megatron (dp=2 x tp=2; zero2)"
    assert "tensor parallelism on 4 processes (dp=2 x tp=2), ZeRO-2 data parallelism on dp" in strategy_words(variants["zero2", "none"])
    assert composed_flavours(megatron_plan(graph, cluster, spec, name, tp=4, precision="fp32"), graph) == []


def test_search_weighs_composed_flavours_and_the_megatron_baseline(gpt_world4):
    graph, spec, name, cluster = gpt_world4
    plan = search_plan(graph, cluster, spec, name, search="ilp")
    names = [alt.name for alt in plan.runners_up] + [plan.name]
    assert any("; zero2)" in n for n in names) and any("; fsdp)" in n for n in names), names
    # The Megatron baseline competes: whatever is chosen is no slower than it, when it fits.
    megatron = [alt for alt in plan.runners_up if alt.name.startswith("baseline megatron") and alt.fits]
    assert all(plan.estimate.step_time_s <= alt.step_time_s for alt in megatron)


# ------------------------------------------------------------------------------- parity

CASES = {
    4: {
        "gpt-zero2-dp2xtp2": (GPT, dict(tp=2, dp_flavour="zero2")),
        "gpt-fsdp-dp2xtp2-recompute": (GPT, dict(tp=2, dp_flavour="fsdp", recompute="full")),
        "gpt-zero1-dp2xtp2": (GPT, dict(tp=2, dp_flavour="zero1")),
        "gpt-zero2-dp2xtp2-accumulate2": (GPT, dict(tp=2, dp_flavour="zero2"), 2),
        "gpt-zero1-dp2xtp2-accumulate4": (GPT, dict(tp=2, dp_flavour="zero1"), 4),
        "gpt-zero1-pp2xdp2": (GPT, dict(pp=2, dp_flavour="zero1", micro_batch=2)),
        "gpt-fsdp-pp2xdp2-recompute": (GPT, dict(pp=2, dp_flavour="fsdp", recompute="full", micro_batch=2)),
        "llama-fsdp-dp2xtp2-sp-recompute": (LLAMA, dict(tp=2, dp_flavour="fsdp", recompute="full", sequence_parallel=True)),
        "gpt-searched-2x2": (GPT, "searched"),
        "llama-searched-2x2": (LLAMA, "searched"),
    },
    8: {
        "gpt-fsdp-pp2xdp2xtp2-recompute": (GPT4, dict(pp=2, tp=2, dp_flavour="fsdp", recompute="full", micro_batch=2)),
        "gpt-zero1-pp2xdp2xtp2": (GPT4, dict(pp=2, tp=2, dp_flavour="zero1", micro_batch=2)),
        "tied-zero1-interleaved-pp2xdp2xtp2-v2-bf16": (
            SHARED_NORM_GPT,
            dict(pp=2, tp=2, dp_flavour="zero1", schedule="interleaved", virtual_stages=2, micro_batch=2, precision="bf16"),
        ),
        "llama-searched-2x4": (LLAMA, "searched"),
        "gpt-searched-2x4": (GPT, "searched"),
    },
}
ALL = [(world, case) for world, cases in CASES.items() for case in cases]


def _plan(world: int, spec: ModelSpec, options, accumulation_steps: int = 1) -> planner.Plan:
    if options == "searched":
        return planner.plan(spec, f"cpu:2x{world // 2}")
    graph, spec, name, cluster = prepare_model(spec, f"cpu:1x{world}")
    options = {"precision": "fp32", **options}
    plan = megatron_plan(graph, cluster, spec, name, **options)
    return dataclasses.replace(plan, accumulation_steps=accumulation_steps)


def _never_share_updated_pieces(folder: Path) -> Path:
    """Negative control: a ZeRO-1 program whose ranks never all-gather their updated pieces."""
    source = folder / "model_spmd.py"
    text = source.read_text()
    call = '    return ShardedStatesOptimizer(module.parameters(), mesh, "dp", optimizer_class, **kwargs)'
    assert call in text, f"{source} builds no ShardedStatesOptimizer"
    broken = (
        '    optimizer = ShardedStatesOptimizer(module.parameters(), mesh, "dp", optimizer_class, **kwargs)\n'
        "    for piece in optimizer.pieces:\n"
        "        piece.gather = lambda group, ranks: None\n"
        "    return optimizer"
    )
    source.write_text(text.replace(call, broken))
    return folder


def _world(root: Path, world: int):
    plans = {case: _plan(world, *how) for case, how in CASES[world].items()}
    folders = {case: planner.compile(plan, root / case) for case, plan in plans.items()}
    for case, plan in plans.items():
        if CASES[world][case][1] == "searched":
            print(f"the search picked for {case}: {plan.name} ({plan.precision}, {plan.recompute} recomputation)")
    if world == 4:
        plan = _plan(4, GPT, dict(tp=2, dp_flavour="zero1"))
        folders["unshared-zero1"] = _never_share_updated_pieces(planner.compile(plan, root / "unshared-zero1"))
    return (plans, folders), list(folders.values())


# Checked in the session's launch of each world size (tests/launch_groups.py).
WORLD_GROUPS = {world: register_group(world, _world) for world in (4, 8)}


@pytest.fixture(scope="module")
def world4(parity_launches):
    (plans, folders), launch = parity_launches.result(WORLD_GROUPS[4])
    return plans, folders, launch


@pytest.fixture(scope="module")
def world8(parity_launches):
    (plans, folders), launch = parity_launches.result(WORLD_GROUPS[8])
    return plans, folders, launch


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "case"), ALL, ids=[f"world{w}-{c}" for w, c in ALL])
def test_composed_step_equals_single_device(request, world: int, case: str) -> None:
    plans, folders, launch = request.getfixturevalue(f"world{world}")
    result = result_of(launch, folders[case])
    assert result.startswith("ok parity ok: "), f"{case} ({plans[case].name}) at world size {world}: {result}"


@pytest.mark.distributed
def test_zero1_that_never_shares_its_updated_pieces_fails_parity(world4) -> None:
    _, folders, launch = world4
    result = result_of(launch, folders["unshared-zero1"])
    assert result.startswith("FAILED parity FAILED: worst tensor "), result


@pytest.mark.distributed
def test_program_says_weights_are_gathered_over_dp(world4) -> None:
    _, folders, _ = world4
    source = (folders["gpt-zero2-dp2xtp2"] / "model_spmd.py").read_text()
    assert "'blocks.0.attn.c_attn.weight': DP_S1_TP_S0," in source
    assert "all-gather over dp" in source


@pytest.mark.distributed
def test_the_every_axis_program_is_what_its_case_names(world8) -> None:
    plans, folders, _ = world8
    case = "tied-zero1-interleaved-pp2xdp2xtp2-v2-bf16"
    plan = plans[case]
    assert plan.mesh.axes == (("pp", 2), ("dp", 2), ("tp", 2))
    assert (plan.dp_flavour, plan.precision, plan.pipeline.schedule, plan.pipeline.virtual_stages) == ("zero1", "bf16", "interleaved", 2)
    source = (folders[case] / "model_spmd.py").read_text()
    assert "ScheduleInterleaved1F1B" in source and "ShardedStatesOptimizer(" in source and "autocast" in source
    assert "SHARED_PARAMETERS = {(0, 1, 2, 3): ('blocks.0.ln_1.weight', 'blocks.0.ln_1.bias'), (0, 3): ('wte.weight',)}" in source
