"""Compiled MoE programs train exactly like one device (``codegen.moe_emit``).

For ``examples/moe.py`` (4 experts, top-2, every block MoE) at world sizes 2 and 4, plans
with expert layouts in every mode compile to a program whose ``launch.py --check`` step
(outputs, loss, every gradient and every updated parameter, the experts gathered whole by
each layer's ``full_parameters``) equals the single-device step: expert parallel with
round-robin experts and with a skewed placement copying expert 0 on two ranks, data
parallel, expert-sliced; capacity factor 0.5 (choices dropped: fewer slots than choices),
1.25 and dropless; in bf16 autocast (one case per mode); with the rest of the model in FSDP2
units (``fsdp``, ``zero2``) rather than DDP, the per-rank expert weights left out of them, or
in DDP with ZeRO-1 optimizer states (each rank's experts stepped whole on it); with the
two-level all-to-all on a cluster of two nodes; with every block recomputed in backward (also
keeping its MoE layers' exchanges, ``full_keep_a2a``: here and for tiny HF Mixtral in bf16,
whose rows travel in bf16); and with gradient accumulation over 2 micro-batches (each routed on its own; expert parallel with
a copied expert under DDP, sharded copies under FSDP2, and HF Mixtral).
Tiny HuggingFace Mixtral and Qwen2-MoE (their router and shared experts kept, only the
stacked SwiGLU experts replaced, ``codegen.runtime.expert_dispatch``): expert parallel
round-robin and with a copied expert (DDP, and FSDP2 around the rest), and replicated; tiny
gpt-oss (biased router and experts, transposed weights, clamped SwiGLU) expert parallel with a
copied expert (its expert biases split, gathered and summed over copies like the weights).
Experts on a grid of 2 copies each, sharded over their copies (expert data parallelism,
``codegen.runtime.expert_copies``): routed experts 2 per rank and 1 per rank (shards of
their width), under DDP (also with the two-level all-to-all on two nodes), FSDP2 (also with
blocks recomputed), ZeRO-2 in bf16 and ZeRO-1 (each rank's shard stepped as its own); HF
Mixtral under DDP and ZeRO-1, Qwen2-MoE under FSDP2.
Each world size checks all its programs in ONE torchrun launch (``tests/dist_check_many.py``).
Negative controls must fail, naming an expert weight: expert-parallel and expert-sliced
layers whose gradients are not divided by the group size (nor copies summed), a
data-parallel layer whose replicated experts are kept out of DDP, and a ZeRO-1 optimizer
that splits the states of each rank's own experts as if they were replicated, and a
HuggingFace expert-parallel program whose expert gradients stay sums over the ranks, and a
program whose experts FSDP2 shards over their copies with its default averaging.

Then the CLI path as a user types it, at world 4: ``planner compile p.json -o out`` of a
hand-built expert-parallel plan saved to JSON, ``torchrun out/launch.py --check``; and at
world 2 ``launch.py --steps 2 --record-routing routing.json`` (blocks recomputed: routed
again in backward, counted once), whose file loads with
``planner.routing.load_routing`` and whose shares and co-selections equal those counted on
one device training the same two steps.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import planner
from codegen.runtime.launcher import random_like
from codegen.runtime.program import BUILD_SEED
from moe_plans import hf_moe_plan, moe_plan
from planner.model_spec import ModelSpec
from planner.routing import load_routing
from launch_groups import register_group
from test_parity import REPO, Launch, _run, _torchrun, result_of

pytestmark = pytest.mark.distributed

# (name, mode, placement, capacity factor, precision, dp flavour of the rest of the model)
CASES = [
    ("ep_round_robin_drops", "expert_parallel", "round-robin", 0.5, "fp32", "ddp"),
    ("ep_round_robin_dropless", "expert_parallel", "round-robin", 0.0, "fp32", "ddp"),
    ("ep_skewed_copied", "expert_parallel", "skewed", 1.25, "fp32", "ddp"),
    ("ep_skewed_copied_drops", "expert_parallel", "skewed", 0.5, "fp32", "ddp"),
    ("ep_skewed_copied_bf16", "expert_parallel", "skewed", 1.25, "bf16", "ddp"),
    ("data_parallel_drops", "data_parallel", None, 0.5, "fp32", "ddp"),
    ("data_parallel_dropless", "data_parallel", None, 0.0, "fp32", "ddp"),
    ("expert_sliced_drops", "expert_sliced", None, 0.5, "fp32", "ddp"),
    ("expert_sliced_dropless", "expert_sliced", None, 0.0, "fp32", "ddp"),
    ("expert_sliced_bf16", "expert_sliced", None, 1.25, "bf16", "ddp"),
    ("data_parallel_bf16", "data_parallel", None, 1.25, "bf16", "ddp"),
    ("fsdp_ep_skewed_copied_drops", "expert_parallel", "skewed", 0.5, "fp32", "fsdp"),
    ("fsdp_data_parallel", "data_parallel", None, 1.25, "fp32", "fsdp"),
    ("fsdp_expert_sliced_dropless", "expert_sliced", None, 0.0, "fp32", "fsdp"),
    ("zero2_ep_round_robin", "expert_parallel", "round-robin", 1.25, "fp32", "zero2"),
    ("zero1_ep_skewed_copied", "expert_parallel", "skewed", 0.5, "fp32", "zero1"),
    ("zero1_expert_sliced", "expert_sliced", None, 1.25, "fp32", "zero1"),
    ("zero1_data_parallel", "data_parallel", None, 0.0, "fp32", "zero1"),
]
# Tiny HuggingFace decoders (their own router kept, only the stacked experts replaced):
# (name, model type, mode, placement, dp flavour of the rest of the model).
HF_CASES = [
    ("hf_mixtral_ep_round_robin", "mixtral", "expert_parallel", "round-robin", "ddp"),
    ("hf_mixtral_ep_skewed_copied", "mixtral", "expert_parallel", "skewed", "ddp"),
    ("hf_mixtral_fsdp_ep_skewed_copied", "mixtral", "expert_parallel", "skewed", "fsdp"),
    ("hf_qwen2_moe_ep_skewed_copied", "qwen2_moe", "expert_parallel", "skewed", "ddp"),
    ("hf_qwen2_moe_data_parallel", "qwen2_moe", "data_parallel", None, "ddp"),
    # gpt-oss: biased router, experts transposed with biases, clamped SwiGLU over interleaved gate/up
    ("hf_gpt_oss_ep_skewed_copied", "gpt_oss", "expert_parallel", "skewed", "ddp"),
]
# Expert data parallelism: every expert on 2 ranks (a grid), its weights, gradients and
# optimizer states sharded over them by FSDP2 (codegen.runtime.expert_copies):
# (name, experts, capacity factor, precision, dp flavour of the rest). At world 4, 4 experts
# put 2 on each rank (shards of dim 0) and 2 experts 1 on each rank (shards of its width).
SHARDED_CASES = [
    ("ep_sharded_copies", 4, 1.25, "fp32", "ddp"),
    ("fsdp_ep_sharded_copies_one_expert_each_drops", 2, 0.5, "fp32", "fsdp"),
    ("zero2_ep_sharded_copies_bf16", 4, 0.0, "bf16", "zero2"),
    ("zero1_ep_sharded_copies_drops", 4, 0.5, "fp32", "zero1"),  # ZeRO-1 steps each rank's expert shard
]
# Sharded copies inside blocks recomputed in backward (FSDP2 gathers the experts again there).
SHARDED_RECOMPUTED = "fsdp_ep_sharded_copies_recompute_full"
# Sharded copies with the two-level all-to-all on two nodes.
SHARDED_TWO_LEVEL = "ep_sharded_copies_two_level_two_nodes"
# (name, model type, dp flavour of the rest): HuggingFace experts sharded over 2 copies.
HF_SHARDED_CASES = [
    ("hf_mixtral_ep_sharded_copies", "mixtral", "ddp"),
    ("hf_qwen2_moe_fsdp_ep_sharded_copies", "qwen2_moe", "fsdp"),
    ("hf_mixtral_zero1_ep_sharded_copies", "mixtral", "zero1"),
]
# Gradient accumulation over 2 micro-batches, each routed on its own (capacity, drops and
# balance loss per micro-batch; launch.py --check's reference runs the same micro-batches):
# (name, placement, capacity factor, dp flavour, experts sharded over their copies).
ACCUMULATED_CASES = [
    ("ep_skewed_copied_drops_accumulated", "skewed", 0.5, "ddp", False),
    ("fsdp_ep_sharded_copies_drops_accumulated", "grid", 0.5, "fsdp", True),
]
HF_ACCUMULATED = "hf_mixtral_ep_skewed_copied_accumulated"
# Expert parallel with the two-level all-to-all on two nodes (of world / 2 ranks each).
TWO_LEVEL = "ep_skewed_two_level_two_nodes"
# Expert parallel with every block recomputed in backward (the MoE layers route and move again).
RECOMPUTED = "ep_skewed_recompute_full"
# The same, and tiny hf:mixtral in bf16 (its rows exchanged in bf16), recomputing every block
# but its MoE layers' exchanges, whose outputs forward keeps (recompute "full_keep_a2a").
KEPT_EXCHANGES = "ep_skewed_recompute_keep_a2a"
HF_KEPT_EXCHANGES_BF16 = "hf_mixtral_bf16_recompute_keep_a2a"
LAUNCH_TIMEOUT = 300


@dataclass(frozen=True)
class WorldRun:
    world: int
    folders: dict[str, Path]
    controls: dict[str, Path]  # negative controls: each must fail
    launch: Launch


def _unscale_expert_gradients(folder: Path) -> Path:
    """A control: expert gradients neither divided by the group size nor copies summed."""
    source = folder / "model_spmd.py"
    text = source.read_text()
    assert "rank_losses_averaged=True" in text, text
    source.write_text(text.replace("rank_losses_averaged=True", "rank_losses_averaged=False"))
    return folder


def _keep_replicated_experts_out_of_ddp(folder: Path) -> Path:
    """A control: a data-parallel layer's (replicated) experts kept out of DDP, so their
    gradients stay each rank's own."""
    source = folder / "model_spmd.py"
    text = source.read_text()
    wrap = "    return DistributedDataParallel(\n"
    assert wrap in text and "DataParallelMoE(" in text, text
    ignore = "    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ('blocks.0.moe.w_in',))\n"
    source.write_text(text.replace(wrap, ignore + wrap))
    return folder


def _split_experts_states(folder: Path) -> Path:
    """A control: a ZeRO-1 optimizer that treats each rank's own experts as replicated
    weights, stepping a piece of them and gathering the other ranks' pieces over them."""
    source = folder / "model_spmd.py"
    text = source.read_text()
    assert "rank_local=rank_local_parameters(module), " in text, text
    source.write_text(text.replace("rank_local=rank_local_parameters(module), ", ""))
    return folder


EXPERT_WEIGHT = r"blocks\.[01]\.moe\.experts\.w_(in|out):"
# control -> (mode, placement, dp flavour, how it is broken, the tensor its failure must name: a pattern)
CONTROLS = {
    # Unscaled expert gradients are wrong gradients and, from them, wrong updates: which of
    # the two is furthest past its tolerance depends on the initial weights.
    "ep_unscaled": ("expert_parallel", "skewed", "ddp", _unscale_expert_gradients, rf"(grad of|updated) {EXPERT_WEIGHT}"),
    "sliced_unscaled": ("expert_sliced", None, "ddp", _unscale_expert_gradients, rf"grad of {EXPERT_WEIGHT}"),
    # Round-robin: every rank holds as many experts, so the wrong gather runs (and overwrites).
    "zero1_experts_split": ("expert_parallel", "round-robin", "zero1", _split_experts_states, rf"updated {EXPERT_WEIGHT}"),
    "dp_experts_unaveraged": (
        "data_parallel", None, "ddp", _keep_replicated_experts_out_of_ddp, r"grad of blocks\.0\.moe\.experts\.w_in:",
    ),
}


# A HuggingFace expert-parallel program whose expert gradients stay sums over the ranks.
HF_CONTROL = "hf_experts_unscaled"
# A program whose experts are sharded over their copies by FSDP2's default, which averages
# the copies' gradients where the step needs their sum.
SHARDED_CONTROL = "sharded_copies_averaged"


def _average_sharded_copies(folder: Path) -> Path:
    source = folder / "model_spmd.py"
    text = source.read_text()
    assert text.count("    shard_over_copies(model.get_submodule(") == 2, text
    averaging = (
        "\n\ndef averaged_over_copies(module, mesh):\n"
        "    from torch.distributed.fsdp import fully_shard\n"
        "    return fully_shard(module, mesh=mesh)\n\n\ndef replace_layer("
    )
    text = text.replace("    shard_over_copies(", "    averaged_over_copies(").replace("\n\ndef replace_layer(", averaging, 1)
    source.write_text(text)
    return folder


def _unscale_hf_expert_gradients(folder: Path) -> Path:
    source = folder / "model_spmd.py"
    text = source.read_text()
    assert "        group=group,\n    ))" in text
    source.write_text(text.replace("        group=group,\n    ))", "        group=group,\n        rank_losses_averaged=False,\n    ))"))
    return folder


def test_sharded_copies_averaged_fail(world_run) -> None:
    result = result_of(world_run.launch, world_run.controls[SHARDED_CONTROL])
    assert result.startswith("FAILED parity FAILED: worst tensor "), result
    assert re.search(rf"(grad of|updated) {EXPERT_WEIGHT}", result), result


@pytest.mark.parametrize("control", [HF_CONTROL])
def test_hf_expert_gradients_left_as_sums_fail(world_run, control: str) -> None:
    result = result_of(world_run.launch, world_run.controls[control])
    assert result.startswith("FAILED parity FAILED: worst tensor "), result
    assert re.search(r"experts\.(gate_up_proj|down_proj)", result), result


def _world_programs(root: Path, world: int) -> tuple:
    folders = {}
    for name, mode, placement, capacity, precision, flavour in CASES:
        plan = moe_plan(world, mode, placement, capacity, precision, flavour=flavour)
        folders[name] = planner.compile(plan, root / name)
    for name, model_type, mode, placement, flavour in HF_CASES:
        folders[name] = planner.compile(hf_moe_plan(world, model_type, mode, placement, flavour), root / name)
    for name, experts, capacity, precision, flavour in SHARDED_CASES:
        plan = moe_plan(world, "expert_parallel", "grid", capacity, precision, experts, flavour, sharded_copies=True)
        folders[name] = planner.compile(plan, root / name)
    recomputed_sharded = moe_plan(world, "expert_parallel", "grid", 0.5, flavour="fsdp", recompute="full",
                                  sharded_copies=True)
    folders[SHARDED_RECOMPUTED] = planner.compile(recomputed_sharded, root / SHARDED_RECOMPUTED)
    two_level_sharded = moe_plan(world, "expert_parallel", "grid", 0.5, nodes=2, all_to_all="hierarchical",
                                 sharded_copies=True)
    folders[SHARDED_TWO_LEVEL] = planner.compile(two_level_sharded, root / SHARDED_TWO_LEVEL)
    for name, model_type, flavour in HF_SHARDED_CASES:
        plan = hf_moe_plan(world, model_type, "expert_parallel", "grid", flavour, sharded_copies=True)
        folders[name] = planner.compile(plan, root / name)
    for name, placement, capacity, flavour, sharded in ACCUMULATED_CASES:
        plan = moe_plan(world, "expert_parallel", placement, capacity, flavour=flavour, sharded_copies=sharded,
                        accumulation_steps=2)
        folders[name] = planner.compile(plan, root / name)
    hf_accumulated = hf_moe_plan(world, "mixtral", "expert_parallel", "skewed", accumulation_steps=2)
    folders[HF_ACCUMULATED] = planner.compile(hf_accumulated, root / HF_ACCUMULATED)
    two_level = moe_plan(world, "expert_parallel", "skewed", 0.5, nodes=2, all_to_all="hierarchical")
    folders[TWO_LEVEL] = planner.compile(two_level, root / TWO_LEVEL)
    recomputing = moe_plan(world, "expert_parallel", "skewed", 0.5, recompute="full")
    folders[RECOMPUTED] = planner.compile(recomputing, root / RECOMPUTED)
    keeping = moe_plan(world, "expert_parallel", "skewed", 0.5, recompute="full_keep_a2a")
    folders[KEPT_EXCHANGES] = planner.compile(keeping, root / KEPT_EXCHANGES)
    hf_keeping = hf_moe_plan(world, "mixtral", "expert_parallel", "skewed", precision="bf16", recompute="full_keep_a2a")
    folders[HF_KEPT_EXCHANGES_BF16] = planner.compile(hf_keeping, root / HF_KEPT_EXCHANGES_BF16)
    controls = {
        name: breaking(planner.compile(moe_plan(world, mode, placement, flavour=flavour), root / name))
        for name, (mode, placement, flavour, breaking, _) in CONTROLS.items()
    }
    hf_unscaled = planner.compile(hf_moe_plan(world, "mixtral", "expert_parallel", "skewed"), root / HF_CONTROL)
    controls[HF_CONTROL] = _unscale_hf_expert_gradients(hf_unscaled)
    averaged = moe_plan(world, "expert_parallel", "grid", sharded_copies=True)
    controls[SHARDED_CONTROL] = _average_sharded_copies(planner.compile(averaged, root / SHARDED_CONTROL))
    return (folders, controls), [*folders.values(), *controls.values()]


# Checked in the session's launch of each world size (tests/launch_groups.py).
WORLD_GROUPS = {world: register_group(world, _world_programs) for world in (2, 4)}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda world: f"world{world}")
def world_run(request, parity_launches) -> WorldRun:
    world = request.param
    (folders, controls), launch = parity_launches.result(WORLD_GROUPS[world])
    return WorldRun(world, folders, controls, launch)


@pytest.mark.parametrize("case", [c[0] for c in CASES] + [c[0] for c in HF_CASES] + [c[0] for c in SHARDED_CASES]
                         + [c[0] for c in HF_SHARDED_CASES] + [c[0] for c in ACCUMULATED_CASES]
                         + [HF_ACCUMULATED, SHARDED_RECOMPUTED, SHARDED_TWO_LEVEL, TWO_LEVEL, RECOMPUTED, KEPT_EXCHANGES,
                            HF_KEPT_EXCHANGES_BF16])
def test_compiled_moe_step_equals_one_device(world_run: WorldRun, case: str) -> None:
    result = result_of(world_run.launch, world_run.folders[case])
    assert result.startswith("ok parity ok: "), f"{case} at world {world_run.world}: {result}"


@pytest.mark.parametrize("control", list(CONTROLS))
def test_broken_expert_gradients_are_reported(world_run: WorldRun, control: str) -> None:
    result = result_of(world_run.launch, world_run.controls[control])
    assert result.startswith("FAILED parity FAILED: worst tensor "), result
    assert re.search(CONTROLS[control][4], result), result


def test_programs_say_what_moves(world_run: WorldRun) -> None:
    source = {name: (folder / "model_spmd.py").read_text() for name, folder in world_run.folders.items()}
    skewed = source["ep_skewed_copied"]
    # The placement is a literal of the plan's; the paths are repr()'d.
    assert "EXPERT_PLACEMENT_0 = (((0, 0.6), (1, 0.4)), " in skewed
    assert "replace_layer(model, 'blocks.0.moe', ExpertParallelMoE(" in skewed
    assert "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, EXPERT_WEIGHTS_OUTSIDE_DDP)" in skewed
    assert "replace_layer(model, 'blocks.1.moe', DataParallelMoE(" in source["data_parallel_drops"]
    assert "EXPERT_WEIGHTS_OUTSIDE_DDP" not in source["data_parallel_drops"]  # replicated experts stay in DDP
    assert "replace_layer(model, 'blocks.1.moe', ExpertSlicedMoE(" in source["expert_sliced_drops"]
    assert "run_in_autocast(model, dp_mesh.device_type, torch.bfloat16)" in source["ep_skewed_copied_bf16"]
    assert "RECOMPUTED_BLOCKS = (\n    'blocks.0',\n    'blocks.1',\n)" in source[RECOMPUTED]
    assert "        recompute_in_backward_counting_once(model.get_submodule(path))" in source[RECOMPUTED]
    for kept in (KEPT_EXCHANGES, HF_KEPT_EXCHANGES_BF16):
        assert "        recompute_in_backward_counting_once(model.get_submodule(path), keep_exchanges=True)" in source[kept]
    two_level = source[TWO_LEVEL]
    assert f"two_level = TwoLevelExchange(group, ranks_per_node={world_run.world // 2})" in two_level
    assert two_level.count("exchange=two_level,") == 2  # both layers
    assert "exchange=" not in skewed  # flat: the default
    # ZeRO-1: DDP, and an optimizer splitting the replicated weights' states, experts stepped whole.
    zero1 = source["zero1_ep_skewed_copied"]
    assert "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, EXPERT_WEIGHTS_OUTSIDE_DDP)" in zero1
    assert "module.parameters(), mesh, \"dp\", optimizer_class, rank_local=rank_local_parameters(module), **kwargs" in zero1
    # FSDP2 around the rest, the per-rank expert weights left out of every unit.
    fsdp = source["fsdp_ep_skewed_copied_drops"]
    assert "fully_shard(model.get_submodule('blocks.0'), mesh=dp_mesh, ignored_params=expert_weights)" in fsdp
    assert "EXPERT_WEIGHTS_OUTSIDE_FSDP = ('blocks.0.moe.w_in', 'blocks.0.moe.w_out', " in fsdp
    assert "DistributedDataParallel" not in fsdp
    assert "fully_shard(model, mesh=dp_mesh)\n" in source["fsdp_data_parallel"]  # every expert weight sharded too
    assert "fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, ignored_params=expert_weights)" in (
        source["zero2_ep_round_robin"]
    )
    # Experts sharded over their 2 copies: the copy groups a literal, one copy mesh, each
    # layer's experts (a child module of the routed layer, the HF experts module itself) sharded.
    sharded, hf_sharded = source["ep_sharded_copies"], source["hf_mixtral_ep_sharded_copies"]
    groups = "((0, 1), (2, 3))" if world_run.world == 4 else "((0, 1),)"
    for text in (sharded, hf_sharded):
        assert f"EXPERT_COPY_GROUPS_0 = {groups}\n" in text and "EXPERT_COPY_GROUPS_1" not in text
        assert text.count("copies_mesh_0 = copy_mesh(dp_mesh, EXPERT_COPY_GROUPS_0)") == 1
        assert text.count("        sharded_copies=True,\n") == 2
    assert "shard_over_copies(model.get_submodule('blocks.1.moe.sharded_experts'), copies_mesh_0)" in sharded
    assert "'blocks.0.moe.sharded_experts.w_in', 'blocks.0.moe.sharded_experts.w_out'," in sharded  # outside DDP
    assert "shard_over_copies(model.get_submodule('model.layers.1.mlp.experts'), copies_mesh_0)" in hf_sharded
    # Accumulating programs say so; each micro-batch is routed on its own.
    for name in [c[0] for c in ACCUMULATED_CASES] + [HF_ACCUMULATED]:
        assert "\nACCUMULATION_STEPS = 2\n" in source[name], name
    assert "\nACCUMULATION_STEPS = 1\n" in skewed
    # DDP programs step the replicated weights and the expert shards in separate groups.
    assert "return optimizer_class(plain_and_sharded_groups(module.parameters()), **kwargs)" in sharded
    assert "plain_and_sharded_groups" not in source["fsdp_ep_sharded_copies_one_expert_each_drops"]


@pytest.mark.parametrize("capacity_factor", [0.5, 0.0])
def test_capacity_cases_drop_and_dropless_does_not(capacity_factor):
    """What the parity cases exercise: at factor 0.5 the experts have fewer slots in all than
    the batch has choices (so some are dropped, whatever the routing); dropless has a slot
    for every token in every expert."""
    model, (idx, _) = _build(capacity_factor)
    layer = model.blocks[0].moe
    tokens = idx.numel()
    if capacity_factor == 0:
        assert layer.capacity(tokens) == tokens
    else:
        assert layer.capacity(tokens) * layer.n_expert < tokens * layer.top_k


def _build(capacity_factor: float = 1.25):
    spec = ModelSpec(str(REPO / "examples" / "moe.py"), {"n_expert": 4, "capacity_factor": capacity_factor})
    torch.manual_seed(BUILD_SEED)
    model, args, _ = spec.build("cpu")
    return model, args


# ------------------------------------------------------------------------- the CLI path


def test_cli_compile_and_check_an_expert_parallel_plan(tmp_path):
    plan_file = tmp_path / "p.json"
    moe_plan(4, "expert_parallel", "skewed", 0.5).save(plan_file)
    compiled = _run([sys.executable, "-m", "planner", "compile", str(plan_file), "-o", str(tmp_path / "out")], tmp_path, 120)
    assert compiled.returncode == 0, compiled.describe()
    check = _run([*_torchrun(4), str(tmp_path / "out" / "launch.py"), "--check"], tmp_path, LAUNCH_TIMEOUT)
    assert check.returncode == 0 and "parity ok: " in check.stdout, check.describe()


STEPS = 2


def test_recorded_routing_matches_one_device(tmp_path):
    # Blocks recomputed in backward: their MoE layers route again there, and must not count
    # it again (the co-selection counts would double).
    folder = planner.compile(moe_plan(2, "expert_parallel", "skewed", 0.5, recompute="full"), tmp_path / "out")
    routing_file = tmp_path / "routing.json"
    command = [*_torchrun(2), str(folder / "launch.py"), "--steps", str(STEPS), "--record-routing", str(routing_file)]
    launch = _run(command, tmp_path, LAUNCH_TIMEOUT)
    assert launch.returncode == 0 and "routing of 2 MoE layer(s) written to" in launch.stdout, launch.describe()
    recorded = load_routing(routing_file)
    assert recorded.source.startswith(f"recorded by launch.py --record-routing over {STEPS} training steps on 2 ranks")

    expected = _one_device_routing(STEPS, folder)
    assert set(recorded.layers) == set(expected) == {"blocks.0.moe", "blocks.1.moe"}
    for name, (counts, pairs) in expected.items():
        layer = recorded.layers[name]
        assert layer.top_k == 2
        assert layer.token_share == pytest.approx(tuple(float(c) / float(counts.sum()) for c in counts), abs=1e-12)
        assert layer.coselection == tuple(tuple(float(v) for v in row) for row in pairs)
        assert max(layer.token_share) > 1 / 4  # not uniform: something was measured


def _one_device_routing(steps: int, folder) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """What ``launch.py --steps`` routes, counted on one device: the same model (the
    program's own build, weights initialised by name) and random batches, AdamW at lr 1e-3
    on the whole batch, each MoE layer's choices (before drops) counted from its input by
    the model's own router."""
    from codegen.runtime.program import load_program

    model, args, _ = load_program(folder).build_model()
    found: dict[str, list[torch.Tensor]] = {}

    def counter(name):
        def hook(module, inputs):
            tokens = inputs[0].reshape(-1, inputs[0].size(-1))
            chosen = F.softmax(module.router(tokens).float(), dim=-1).topk(module.top_k, dim=-1).indices
            per_token = F.one_hot(chosen, module.n_expert).sum(dim=1).double()  # (n, E)
            pairs = per_token.t() @ per_token
            counts, coselected = found.setdefault(name, [torch.zeros(module.n_expert, dtype=torch.float64),
                                                         torch.zeros(module.n_expert, module.n_expert, dtype=torch.float64)])
            counts += per_token.sum(dim=0)
            coselected += pairs - torch.diag(torch.diagonal(pairs))
        return hook

    for name, module in model.named_modules():
        if name in ("blocks.0.moe", "blocks.1.moe"):
            module.register_forward_pre_hook(counter(name))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps):
        torch.manual_seed(1000 + step)  # launch.py's batches
        batch = random_like(args)
        model(*batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {name: (c[0], c[1]) for name, c in found.items()}
