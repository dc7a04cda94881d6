"""Distributed parity of programs generated from the traced graph (any plan on a dp/tp mesh).

Plans whose placements are not plain data parallelism compile to a ``model_spmd.py`` that
replays the exported ATen graph op by op on DTensors (``codegen.spmd_emit``). For every
model (MLP, GPT, tiny HuggingFace GPT-2 and Llama) and every strategy family below, one
sharded training step (outputs, loss, every gradient, every updated parameter) must equal
the same step on one device (``codegen.runtime.parity.check_parity``, behind
``launch.py --check``):

- Megatron tensor parallelism on ``tp=2`` (world 2) and on ``dp=2 x tp=2`` (world 4), with and
  without sequence parallelism (``search.megatron.megatron_plan``);
- a partial-sums family: the MLP's input split on its features over ``tp`` and its first
  weight split on input features, so the first matmul leaves partial sums (``P``) that are
  all-reduced before the ReLU;
- a batch family: GPT-2's batch split over both ``dp`` and ``tp`` (``(S(0), S(0))``), every
  weight replicated, so gradients are partial sums over the whole mesh, reduced by the
  program's gradient hooks;
- recomputation: Megatron plans (GPT at world 2, Llama with SP at world 4) whose blocks are
  recomputed in backward (``torch.utils.checkpoint`` around each block's replay);
- bf16 mixed precision: Llama with Megatron SP at world 2 under bf16 autocast;
- a random family: GPT (world 2) and the MLP (world 4) with every input, output and parameter
  of every op placed at random (``S(d)``, ``R``, ``P`` per axis), the strongest form of "any
  plan": DTensor must redistribute wherever placements disagree, and where its rules cannot
  run an op (forward or backward) the compile-time dry run makes it run on whole inputs.

As in ``test_parity.py``, each world size compiles its programs first and checks them all in
ONE torchrun launch of ``tests/dist_check_many.py``; each parametrized test reads the
``RESULT`` line of its own program. A negative control (a Megatron MLP program that treats
partial sums as whole values, skipping one all-reduce) proves the check fails, and the
generated code is checked for the collectives Megatron-LM places (STYLE.md item 8).
"""

from __future__ import annotations

import dataclasses
import random
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

import planner
from planner.api import prepare_model
from planner.model_spec import ModelSpec
from search.layouts import batch_input_placements, combine
from search.megatron import megatron_plan
from search.propagation import propagate
from launch_groups import register_group
from test_parity import HF_GPT2_TINY, REPO, Launch, result_of

pytestmark = pytest.mark.distributed


HF_LLAMA_TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "batch_size": 4,
    "seq_len": 16,
}
MODELS = {
    "mlp": ("examples/mlp.py", {"batch_size": 8}),
    "gpt": ("examples/gpt.py", {"batch_size": 8}),
    "gpt2": ("hf:gpt2", HF_GPT2_TINY),
    "llama": ("hf:llama", HF_LLAMA_TINY),
}
WORLD_SIZES = (2, 4)  # mesh tp=2, and dp=2 x tp=2
MEGATRON = ("megatron", "megatron-sp")  # sequence_parallel off, on
# "+recompute": the family's plan with every block recomputed in backward (checkpointed).
EXTRA = {
    2: [("mlp", "partial"), ("gpt", "random"), ("gpt", "megatron+recompute"), ("llama", "megatron-sp+bf16")],
    4: [("gpt2", "batch"), ("mlp", "random"), ("llama", "megatron-sp+recompute")],
}
# Placements of the "random" family. With this seed a dry-run round of GPT's program fails at
# a (8, 32, 64) -> (8, 32, 4, 16) view of a value an earlier round saw split; the next round
# is written from what the failing one saw (the value gathered first) and the view runs on
# DTensors (codegen.dry_run.refine). Ops DTensor cannot run at all are run on whole inputs:
# tests/test_inplace_writes.py checks one (select_scatter, whose backward DTensor fails).
# (Seed 4's view, whose backward DTensor failed on, runs since graph programs keep
# redistributed values contiguous.)
RANDOM_SEED = 2


def cases(world: int) -> list[tuple[str, str]]:
    return [(model, family) for model in MODELS for family in MEGATRON] + EXTRA[world]


ALL_CASES = [(world, model, family) for world in WORLD_SIZES for model, family in cases(world)]


# --------------------------------------------------------------------------------- plans


def _graph(model: str, world: int):
    source, overrides = MODELS[model]
    spec = ModelSpec(source if source.startswith("hf:") else str(REPO / source), overrides)
    return prepare_model(spec, f"cpu:1x{world}")


def make_plan(model: str, family: str, world: int) -> planner.Plan:
    """The plan of one case: Megatron-LM's layout, or a family built by per-axis propagation."""
    if family.endswith("+recompute"):
        return dataclasses.replace(make_plan(model, family.removesuffix("+recompute"), world), recompute="full")
    if family.endswith("+bf16"):  # bf16 mixed precision: forward under autocast, looser --check tolerances
        return dataclasses.replace(make_plan(model, family.removesuffix("+bf16"), world), precision="bf16")
    graph, spec, name, cluster = _graph(model, world)
    plan = megatron_plan(graph, cluster, spec, name, tp=2, sequence_parallel=family == "megatron-sp", precision="fp32")
    if family.startswith("megatron"):
        return plan
    if family == "partial":  # the MLP's input features and first weight's input features split over tp
        per_axis = {"tp": propagate(graph, plan.mesh.axis_size("tp"), {"inputs": Shard(1), "targets": Replicate()}, {"net.0.weight": Shard(1)})}
    elif family == "batch":  # the batch split over every mesh axis, every weight replicated
        per_axis = {axis: propagate(graph, plan.mesh.axis_size(axis), batch_input_placements(graph), {}) for axis in plan.mesh.names}
    elif family == "random":
        return random_placements(plan, graph, random.Random(RANDOM_SEED))
    else:
        raise ValueError(family)
    strategies, inputs = combine(graph, plan.mesh, per_axis)
    return dataclasses.replace(plan, strategies=strategies, inputs=inputs)


def random_placements(plan: planner.Plan, graph, rng: random.Random) -> planner.Plan:
    """``plan`` with every input, output and parameter of every op placed at random: on each
    mesh axis ``R``, ``P`` (not for parameters and inputs) or ``S(d)`` of a dim the axis
    divides. Whatever the placements, the program must train exactly like one device."""

    def draw(shape: tuple[int, ...], partial: bool = True) -> tuple:
        choices = []
        for size in plan.mesh.shape:
            options = [Replicate(), *(Shard(d) for d, n in enumerate(shape) if n % size == 0)]
            choices.append(rng.choice(options + ([Partial()] if partial else [])))
        return tuple(choices)

    strategies = []
    for node, strategy in zip(graph.nodes, plan.strategies):
        params = {name: draw(graph.parameters[name].shape, False) for name in strategy.params if name in graph.parameters}
        param_of = dict(zip(node.param_inputs, node.params))
        inputs = tuple(params.get(param_of.get(name), draw(meta.shape)) for name, meta in zip(node.inputs, node.input_meta))
        outputs = tuple(draw(meta.shape) for meta in node.output_meta)
        params = {**strategy.params, **params}
        strategies.append(dataclasses.replace(strategy, inputs=inputs, outputs=outputs, params=params, produced=None))
    inputs = {i.name: draw(i.meta.shape, False) if i.meta else None for i in graph.inputs}
    return dataclasses.replace(plan, strategies=tuple(strategies), inputs=inputs)


# Turns one all-reduce of partial sums into a relabelling: each rank keeps its own partial
# sum and calls it the whole value, so the step is wrong while every shape still fits.
SKIPPED_ALL_REDUCE = "DTensor.from_local({value}.to_local(), {value}.device_mesh, {placements}, run_check=False)"


def skip_first_all_reduce(folder: Path) -> Path:
    source = folder / "model_spmd.py"
    lines = source.read_text().splitlines()
    for index, line in enumerate(lines[:-1]):
        match = re.search(r"_to\((\w+), (\w+)\)", lines[index + 1])
        if line.strip().startswith("# all-reduce over tp") and match:
            value, placements = match.groups()
            lines[index + 1] = lines[index + 1].replace(match[0], SKIPPED_ALL_REDUCE.format(value=value, placements=placements))
            break
    else:
        raise AssertionError(f"{source} has no all-reduce to skip")
    source.write_text("\n".join(lines + ["from torch.distributed.tensor import DTensor"]) + "\n")
    return folder


# ------------------------------------------------------------------------- one launch per world


@dataclass(frozen=True)
class WorldRun:
    """One torchrun launch of dist_check_many.py over every program of one world size."""

    world: int
    folders: dict[tuple[str, str], Path]
    broken: Path | None
    launch: Launch

    def result(self, folder: Path) -> str:
        return result_of(self.launch, folder)


def _world_programs(root: Path, world: int) -> tuple:
    """Compile every program of world size ``world``, checked in the session's launch of that
    size (``tests/launch_groups.py``)."""
    folders = {}
    for model, family in cases(world):
        folders[model, family] = planner.compile(make_plan(model, family, world), root / f"{model}_{family}")
    broken = None
    if world == 2:
        broken = skip_first_all_reduce(planner.compile(make_plan("mlp", "megatron", world), root / "mlp_skipped_all_reduce"))
    programs = [*folders.values(), *([broken] if broken else [])]
    return (folders, broken), programs


WORLD_GROUPS = {world: register_group(world, _world_programs) for world in WORLD_SIZES}


def _world_run(world: int, parity_launches) -> WorldRun:
    (folders, broken), launch = parity_launches.result(WORLD_GROUPS[world])
    return WorldRun(world, folders, broken, launch)


# One fixture per world size (not one parametrized fixture), so each is built exactly once
# however pytest orders the tests that read it.
@pytest.fixture(scope="module")
def world2_run(parity_launches) -> WorldRun:
    return _world_run(2, parity_launches)


@pytest.fixture(scope="module")
def world4_run(parity_launches) -> WorldRun:
    return _world_run(4, parity_launches)


@pytest.fixture(params=WORLD_SIZES, ids=lambda world: f"world{world}")
def world_run(request) -> WorldRun:
    return request.getfixturevalue(f"world{request.param}_run")


@pytest.mark.parametrize(("world", "model", "family"), ALL_CASES, ids=[f"world{w}-{m}-{f}" for w, m, f in ALL_CASES])
def test_sharded_step_equals_single_device(request, world: int, model: str, family: str) -> None:
    run: WorldRun = request.getfixturevalue(f"world{world}_run")
    result = run.result(run.folders[model, family])
    assert result.startswith("ok parity ok: "), f"{model} {family} at world size {world}: {result}"


def test_every_program_reports_a_result(world_run: WorldRun) -> None:
    # The launch is shared with other modules' programs: each of ours has exactly one line.
    for folder in [*world_run.folders.values(), *([world_run.broken] if world_run.broken else [])]:
        assert world_run.result(folder).startswith(("ok ", "FAILED ")), world_run.result(folder)


def test_skipped_all_reduce_is_reported(world2_run: WorldRun) -> None:
    result = world2_run.result(world2_run.broken)
    assert result.startswith("FAILED parity FAILED: worst tensor "), result


# --------------------------------------------------------------------- the generated code itself


def _per_step(source: str, pattern: str) -> dict[str, int]:
    """How many times each match of ``pattern`` (its groups joined) runs in one forward: a
    match inside a block function (written once, ``codegen.block_fold``) runs once per call."""
    functions = list(re.finditer(r"^def (\w+)\(self, prefix.*?\n.*?(?=^\S)", source, re.MULTILINE | re.DOTALL))
    counts: dict[str, int] = {}
    for match in re.finditer(pattern, source, re.MULTILINE):
        inside = [f[1] for f in functions if f.start() <= match.start() < f.end()]
        runs = len(re.findall(rf"(?<!def ){inside[0]}\(self, |checkpoint\({inside[0]}, ", source)) if inside else 1
        key = " ".join(match.groups())
        counts[key] = counts.get(key, 0) + runs
    return counts


def _collectives(source: str) -> dict[str, int]:
    """How many redistributions of each kind the program's comments announce, by axis."""
    return _per_step(source, r"^\s*# (all-reduce|reduce-scatter|all-gather|all-to-all) over (\w+)")


def _gathers_inside_ops(source: str) -> dict[str, int]:
    """Ops whose DTensor rule gathers an input the plan keeps split (noted in the program)."""
    return _per_step(source, r"^\s*# DTensor's (\w+) gives .*: it all-gathers ")


def test_megatron_program_places_megatron_collectives(world_run: WorldRun) -> None:
    """GPT (2 blocks): the vocabulary-parallel embedding and each block's attention and MLP
    outputs are all-reduced over tp (1 + 2 x 2); with sequence parallelism they become
    reduce-scatters, and each column-parallel input (4 in the blocks, the head) is
    all-gathered. Batch splitting over dp costs no forward collective. Where DTensor's rules
    gather inside an op the program says so: the split of the fused q|k|v projection (each
    rank holds whole rows of the weight, not Megatron's per-rank q|k|v layout; the simulator
    prices that gather, cost_model.split_gather). The cross entropy over vocabulary-split
    logits gathers nothing (loss_parallel)."""
    plain = (world_run.folders["gpt", "megatron"] / "model_spmd.py").read_text()
    sequence = (world_run.folders["gpt", "megatron-sp"] / "model_spmd.py").read_text()
    assert _collectives(plain) == {"all-reduce tp": 5}, plain
    assert _collectives(sequence) == {"reduce-scatter tp": 5, "all-gather tp": 5}, sequence
    for source in (plain, sequence):
        assert _gathers_inside_ops(source) == {"split": 2}, source
        assert "self.vocabulary_parallel_cross_entropy(aten.cross_entropy_loss.default, " in source, source


def test_program_is_readable(world_run: WorldRun) -> None:
    """Names from the model, shapes global -> per rank, one line per op."""
    source = (world_run.folders["gpt", "megatron"] / "model_spmd.py").read_text()
    compile(source, "model_spmd.py", "exec")
    assert "# ---- blocks.0.mlp.c_fc (Linear)" in source
    # Each block written once (both blocks are alike), called with its parameters' prefix.
    assert source.count("def blocks_block(self, prefix: str, ") == 1
    # Op names end in a digest of what the op computes (planner.node_names).
    assert re.search(r"add_\w+ = blocks_block\(self, 'blocks\.1\.', add_\w+, \('dropout_\w+', 'dropout_\w+'\)\)", source)
    assert "p_mlp_c_fc_weight = params[prefix + 'mlp.c_fc.weight']" in source
    line = r"linear_\w+ = aten\.linear\.default\(layer_norm_\w+, p_mlp_c_fc_weight, p_mlp_c_fc_bias\)"
    assert re.search(line + r"  # \(\d+, 32, 256\) -> \(\d+, 32, 128\) per rank", source), source
