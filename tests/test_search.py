"""Search: golden plans where the answer is known, and optimality against enumeration.

Golden plans (as autoparallel's and Alpa's tests): a small model with a large batch gets
data parallelism; layers too large for one device with a small batch get Megatron-style
tensor parallelism inside the node; a memory-tight model gets its weights sharded; a model
whose optimizer states alone keep DDP out of memory gets ZeRO, not FSDP. CP-SAT
must find the exhaustive optimum of its own objective on graphs small enough to enumerate,
and MCMC must come within 2% of the simulator's exhaustive optimum at its default budget.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import planner
from cost_model.simulator import Simulator
from planner.api import prepare_model
from planner.cluster import Cluster
from planner.errors import PlanningError
from planner.model_spec import ModelSpec
from planner.strategy import Mesh
from planner.trace import trace
from search.auto import candidate_meshes, search_plan
from search.node_candidates import node_strategies
from search.budget import SearchBudget
from search.cost_tables import build_cost_tables
from search.ilp import solve
from search.layouts import combine, data_parallel_layout
from search.plan_builder import unsimulated_plan
from search.mcmc import mcmc, score


def _skeleton(graph, cluster, mesh):
    strategies, inputs = data_parallel_layout(graph, mesh) if "dp" in mesh.names else combine(graph, mesh, {})
    return unsimulated_plan(graph, cluster, None, "M", mesh, strategies, inputs)


def _tables(graph, cluster, mesh):
    return build_cost_tables(_skeleton(graph, cluster, mesh), graph, node_strategies(graph, mesh))


class TwoLayers(nn.Module):
    """Linear -> ReLU -> Linear -> mean: small enough to enumerate on a 1-axis mesh."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.up = nn.Linear(width, 2 * width, bias=False)
        self.down = nn.Linear(2 * width, width, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))).pow(2).mean()


@pytest.fixture(scope="module")
def two_layers():
    with torch.device("meta"):
        model, x = TwoLayers(), torch.randn(8, 64)
    return trace(model, (x,))


# ------------------------------------------------------------------------- optimality


@pytest.mark.parametrize("axis", ["dp", "tp"])
def test_cp_sat_finds_the_exhaustive_optimum(two_layers, axis):
    cluster = Cluster.preset("cpu", 1, 2)
    tables = _tables(two_layers, cluster, Mesh(((axis, 2),)))
    sizes = {name: len(options) for name, options in tables.candidates.items()}
    assert math.prod(sizes.values()) <= 200_000, sizes  # small enough to enumerate
    names = list(sizes)
    best = min(
        tables.objective(dict(zip(names, combo))) for combo in itertools.product(*(range(sizes[n]) for n in names))
    )
    result = solve(tables, memory_bytes=None, work=20)
    assert result.optimal and result.gap == 0
    # CP-SAT works in integer nanoseconds: one rounding per term at most.
    assert result.objective_s == pytest.approx(best, abs=1e-9 * (len(names) + len(tables.edges) + 2))
    assert tables.objective(result.choice) == pytest.approx(best, abs=1e-8)


def test_cp_sat_respects_the_memory_constraint(two_layers):
    cluster = Cluster.preset("cpu", 1, 2)
    tables = _tables(two_layers, cluster, Mesh((("tp", 2),)))
    sizes = {name: len(options) for name, options in tables.candidates.items()}
    names = list(sizes)
    assignments = [dict(zip(names, combo)) for combo in itertools.product(*(range(sizes[n]) for n in names))]
    unconstrained = min(assignments, key=tables.objective)
    # A budget just below the unconstrained optimum's memory forces a leaner assignment.
    budget = tables.memory(unconstrained) - 1024
    feasible = [a for a in assignments if math.ceil(tables.memory(a) / 1024) * 1024 <= budget]
    if not feasible:
        pytest.fail("the test graph should have leaner assignments than its fastest one")
    best = min(feasible, key=tables.objective)
    result = solve(tables, memory_bytes=budget, work=20)
    assert tables.memory(result.choice) <= budget + 1024 * len(names)  # kilobyte rounding per term
    assert tables.objective(result.choice) == pytest.approx(tables.objective(best), rel=1e-6)


def test_cp_sat_reports_no_fit(two_layers):
    tables = _tables(two_layers, Cluster.preset("cpu", 1, 2), Mesh((("tp", 2),)))
    with pytest.raises(PlanningError, match="fits in device memory"):
        solve(tables, memory_bytes=1024, work=5)


# A tiny Llama (2 layers, hidden 256): 131 modelled nodes, 32 candidates on most of them.
TINY_LLAMA = ModelSpec("hf:llama", {
    "num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4,
})


def _llama_tables(cluster_name: str, mesh: Mesh):
    """Cost tables and starting layout of the tiny Llama on ``mesh``, as the search builds them."""
    from search.mesh_search import dp_axis_placements, starting_layout
    from search.blocks import block_representatives

    graph, spec, name, cluster = prepare_model(TINY_LLAMA, cluster_name)
    representative = block_representatives(graph)
    strategies_of = node_strategies(graph, mesh, only=set(representative.values()))
    seed, inputs = combine(graph, mesh, {"dp": dp_axis_placements(graph, mesh.axis_size("dp"))} if "dp" in mesh.names else {})
    skeleton = unsimulated_plan(graph, cluster, spec, name, mesh, seed, inputs, precision="fp32")
    tables = build_cost_tables(skeleton, graph, strategies_of, representative)
    return tables, starting_layout(graph, mesh, tables), cluster.min_device_memory


@pytest.mark.parametrize("cluster_name, axes", [
    ("cpu:1x4", (("dp", 4),)),
    ("cpu:1x4", (("dp", 2), ("tp", 2))),  # 27% gap before the reductions and the LP start
    ("cpu:1x4", (("tp", 4),)),
    ("cpu:2x4", (("dp", 2), ("tp", 4))),
    ("cpu:2x4", (("dp", 2), ("tp", 2), ("tp2", 2))),  # a third axis: 32 to 64 candidates a node
])
def test_cp_sat_closes_its_gap_on_a_tiny_llama_at_the_default_budget(cluster_name, axes):
    # The budget counts CP-SAT's deterministic work, not seconds: this holds on any machine.
    tables, hint, memory = _llama_tables(cluster_name, Mesh(axes))
    result = solve(tables, memory_bytes=memory, work=SearchBudget().ilp_work(), hint=hint)
    assert result.gap <= 0.01, result
    assert result.objective_s <= tables.objective(hint) + 1e-9  # never worse than the layout built directly
    # The reported objective is the plan's (integer nanoseconds, one rounding per term).
    assert tables.objective(result.choice) == pytest.approx(result.objective_s, rel=1e-6)


def test_cp_sat_gives_the_same_plan_twice():
    tables, hint, memory = _llama_tables("cpu:1x4", Mesh((("dp", 2), ("tp", 2))))
    first, second = (solve(tables, memory_bytes=memory, work=SearchBudget().ilp_work(), hint=hint) for _ in range(2))
    assert first.choice == second.choice and first.objective_s == second.objective_s and first.work == second.work


def test_mcmc_within_two_percent_of_the_exhaustive_simulated_optimum(two_layers):
    cluster = Cluster.preset("cpu", 1, 2)
    mesh = Mesh((("tp", 2),))
    skeleton = _skeleton(two_layers, cluster, mesh)
    tables = build_cost_tables(skeleton, two_layers, node_strategies(two_layers, mesh))
    sizes = {name: len(options) for name, options in tables.candidates.items()}
    names = list(sizes)
    assert math.prod(sizes.values()) <= 5_000, sizes
    simulator = Simulator(skeleton, two_layers)
    best = math.inf
    for combo in itertools.product(*(range(sizes[n]) for n in names)):
        strategies = tuple(tables.candidates[n][c].strategy for n, c in zip(names, combo))
        simulator = Simulator(dataclasses.replace(skeleton, strategies=strategies), two_layers)
        best = min(best, score(simulator.run(trace=False)))
    found = mcmc(skeleton, tables, seed=0)  # default budget
    assert found.cost <= 1.02 * best


def test_mcmc_is_deterministic_for_a_seed(two_layers):
    cluster = Cluster.preset("cpu", 1, 2)
    mesh = Mesh((("tp", 2),))
    skeleton = _skeleton(two_layers, cluster, mesh)
    tables = build_cost_tables(skeleton, two_layers, node_strategies(two_layers, mesh))
    first = mcmc(skeleton, tables, seed=7, iterations=200)
    second = mcmc(skeleton, tables, seed=7, iterations=200)
    assert first.choice == second.choice and first.cost == second.cost
    assert first.iterations == 200


# ------------------------------------------------------------------------ golden plans


def _gpt(cluster: str, **overrides):
    spec = ModelSpec("examples/gpt.py", overrides)
    return prepare_model(spec, cluster)


def test_small_model_large_batch_gets_data_parallelism():
    graph, spec, name, cluster = prepare_model(
        ModelSpec("examples/mlp.py", {"batch_size": 8192, "hidden": 128, "layers": 3}), "dgx-a100-80g:1"
    )
    plan = search_plan(graph, cluster, spec, name, search="ilp")
    assert plan.mesh.names == ("dp",) and plan.mesh.axis_size("dp") == 8
    for strategy in plan.strategies:
        for placements in strategy.params.values():
            assert all(isinstance(p, Replicate) for p in placements)  # weights replicated
    assert all(p == (Shard(0),) for p in plan.inputs.values() if p is not None)  # the batch split


def test_huge_layers_small_batch_get_tensor_parallelism_inside_a_node():
    graph, spec, name, cluster = _gpt("dgx-a100-80g:1", n_layer=2, n_embd=8192, n_head=64, vocab_size=1024, seq_len=512, batch_size=8)
    plan = search_plan(graph, cluster, spec, name, search="ilp", precision="bf16")
    assert "tp" in plan.mesh.names and plan.mesh.axis_size("tp") >= 2
    tp = plan.mesh.names.index("tp")
    placements = {s.module.rsplit(".", 1)[-1]: s.params for s in plan.strategies if s.module.startswith("blocks.0") and s.params}
    # Megatron: the first projection of attention and MLP splits its output features
    # (weight dim 0 of nn.Linear), the second its input features (weight dim 1).
    assert placements["c_attn"]["blocks.0.attn.c_attn.weight"][tp] == Shard(0)
    assert placements["c_fc"]["blocks.0.mlp.c_fc.weight"][tp] == Shard(0)
    assert placements["c_proj"][next(iter(placements["c_proj"]))][tp] == Shard(1)


def test_memory_tight_model_gets_sharded_weights():
    from search.data_parallel import data_parallel_plan

    graph, spec, name, cluster = _gpt("cpu:1x4", n_layer=4, n_embd=512, n_head=8, vocab_size=8192, seq_len=64, batch_size=8)
    ddp = data_parallel_plan(graph, cluster, spec, name, "ddp").estimate.memory.total
    fsdp = data_parallel_plan(graph, cluster, spec, name, "fsdp").estimate.memory.total
    assert fsdp < ddp
    capacity = (fsdp + ddp) // 2  # DDP cannot fit; sharding the weights can
    tight = dataclasses.replace(
        cluster, nodes=tuple(dataclasses.replace(n, device=dataclasses.replace(n.device, memory_bytes=capacity)) for n in cluster.nodes)
    )
    plan = search_plan(graph, tight, spec, name, search="ilp")
    assert plan.estimate.fits
    sharded = any(
        any(isinstance(p, Shard) for p in placements) for s in plan.strategies for placements in s.params.values()
    )
    assert plan.dp_flavour in ("zero1", "zero2", "fsdp") or sharded
    assert any(alt.name == "ddp (dp=4)" and not alt.fits for alt in plan.runners_up)


class Blocks(nn.Module):
    """``depth`` blocks of Linear(width, width) + ReLU, then the mean square: FSDP units by block."""

    def __init__(self, width: int = 128, depth: int = 8):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return x.pow(2).mean()


def test_memory_between_zero_and_ddp_gets_ddp_in_two_micro_batches():
    # Blocks(128, 8) on a (256, 128) batch, cpu:1x2 (dp = 2), fp32 AdamW.
    # P = 8 * (128 * 128 + 128) = 132,096 parameters; weights W = 4 P = 528,384 B, gradients
    # G = 528,384 B, AdamW states S = 8 P = 1,056,768 B. Per device, besides activations (the
    # same for every flavour: 128 rows per rank):
    #   DDP:    W + G + S     + bucket (min(25 MiB, G) = G)          = 2,641,920 B
    #   ZeRO-1: W + G + S / 2 + bucket                               = 2,113,536 B
    #   ZeRO-2: W + G / 2 + S / 2 + bucket                           = 1,849,344 B
    #   FSDP:   (W + G + S) / 2 + two gathered blocks (2 * 66,048)   = 1,188,864 B
    # Activations, as autograd keeps them: each ReLU's (128, 128) fp32 output (65,536 B; the
    # next linear and the square read it) x 8 + the 4 B loss = 524,292 B (a linear's output is
    # read only by ReLU, which keeps its own output instead). A 3,000,000 B device leaves
    # 2,475,708 B beside them: DDP needs 166,212 B more, every ZeRO/FSDP flavour fits.
    # DDP over two micro-batches of 64 rows keeps half the activations (262,146 B): 2,904,066 B,
    # which fits. Speed, on gloo (the cpu preset): FSDP2 issues its collectives with
    # async_op=False, which holds the thread that runs the model, so ZeRO-2's per-unit weight
    # gathers in forward and gradient all-reduces (gloo has no reduce-scatter) add to the step;
    # ZeRO-1 all-reduces the gradient as DDP does, then all-gathers each of the 16 updated
    # tensors in its own call, one after another (ShardedStatesOptimizer). DDP's bucketed
    # all-reduce runs on gloo's worker threads beside the second micro-batch's backward, and
    # two half passes cost about what one whole one does: DDP in two micro-batches is the
    # fastest that fits. Tensor parallelism (tp = 2) moves activations of the whole 256-row
    # batch per block.
    with torch.device("meta"):
        model, x = Blocks(), torch.randn(256, 128)
    graph = trace(model, (x,))
    cluster = Cluster.preset("cpu", 1, 2)
    tight = dataclasses.replace(
        cluster, nodes=tuple(dataclasses.replace(n, device=dataclasses.replace(n.device, memory_bytes=3_000_000)) for n in cluster.nodes)
    )
    plan = search_plan(graph, tight, None, "Blocks", search="ilp")
    assert plan.name == "ddp (dp=2; 2 micro-batches)" and plan.estimate.fits
    memory = plan.estimate.memory
    assert (memory.weights, memory.gradients, memory.optimizer_states) == (528_384, 528_384, 1_056_768)
    assert memory.communication_buffers == 528_384 and memory.activations == 524_292 / 2
    assert memory.total == 2_641_920 + 262_146
    by_name = {alt.name: alt for alt in plan.runners_up}
    assert not by_name["ddp (dp=2)"].fits and by_name["ddp (dp=2)"].memory_bytes == 2_641_920 + 524_292
    assert by_name["zero1 (dp=2)"].memory_bytes == 2_113_536 + 524_292
    assert by_name["zero2 (dp=2)"].memory_bytes == 1_849_344 + 524_292
    for name in ("zero1 (dp=2)", "zero2 (dp=2)", "soap (tp=2)"):
        assert by_name[name].fits and by_name[name].step_time_s > plan.estimate.step_time_s, by_name[name]
    assert all(alt.step_time_s > plan.estimate.step_time_s for alt in plan.runners_up if alt.fits)


def test_model_that_cannot_fit_anywhere():
    graph, spec, name, cluster = _gpt("cpu:1x2", n_layer=2, n_embd=256, n_head=4, vocab_size=1024, seq_len=64)
    tiny = dataclasses.replace(
        cluster, nodes=tuple(dataclasses.replace(n, device=dataclasses.replace(n.device, memory_bytes=10_000)) for n in cluster.nodes)
    )
    with pytest.raises(PlanningError, match="does not fit"):
        search_plan(graph, tiny, spec, name, search="ilp")


def test_search_keeps_runners_up_and_baselines():
    graph, spec, name, cluster = _gpt("cpu:1x4", batch_size=8)
    plan = search_plan(graph, cluster, spec, name, search="auto")
    assert plan.search_summary.startswith("auto search (effort 1) over")
    names = [alt.name for alt in plan.runners_up]
    assert len(names) >= 2
    assert all(alt.step_time_s >= plan.estimate.step_time_s or not alt.fits for alt in plan.runners_up)
    assert any(name.startswith("baseline") for name in names) or {"ddp (dp=4)", "fsdp (dp=4)"} & set(names)


def test_ops_with_two_outputs_get_a_placement_for_each():
    """``max.dim`` (values and indices) over a batch-split input: search.propagation gave it
    one output placement, and combining the axes raised an IndexError."""
    from pathlib import Path

    from search.layouts import batch_input_placements
    from search.propagation import propagate

    spec = ModelSpec(f"{Path(__file__).resolve().with_name('zoo_models.py')}:multi_output", {})
    graph, _, _, _ = prepare_model(spec, "cpu:1x4")
    per_axis = propagate(graph, 4, batch_input_placements(graph), {})
    maximum = next(n for n in graph.nodes if n.op == "aten.max.dim")
    assert per_axis[maximum.name].outputs == (Shard(0), Shard(0))
    strategies, _ = data_parallel_layout(graph, Mesh((("dp", 4),)))
    assert all(len(s.outputs) == len(graph.node(s.node).output_meta) for s in strategies)


# ------------------------------------------------------------- deterministic budgets


def test_the_same_search_gives_the_same_plan_twice():
    graph, spec, name, cluster = _gpt("cpu:1x4", batch_size=8)
    first = search_plan(graph, cluster, spec, name, search="auto", budget=SearchBudget(effort=0.25))
    second = search_plan(graph, cluster, spec, name, search="auto", budget=SearchBudget(effort=0.25))
    assert first.to_dict() == second.to_dict()
    assert "effort 0.25" in first.search_summary and " s;" not in first.search_summary  # no seconds in it


def test_a_budget_too_small_to_search_still_gives_every_mesh_a_plan():
    # So little CP-SAT work that it cannot search: every mesh still gets a plan, the best of
    # the layout built directly and the rounded LP relaxation (search.ilp_start), which on
    # this small model is already optimal.
    graph, spec, name, cluster = _gpt("cpu:1x4", batch_size=8)
    plan = search_plan(graph, cluster, spec, name, search="ilp", budget=SearchBudget(effort=1e-6))
    assert plan.estimate.fits
    assert plan.search_summary.count("CP-SAT") == 3, plan.search_summary


def test_the_wall_clock_cap_says_when_it_cut_the_search_short():
    plan = planner.plan(ModelSpec("examples/gpt.py", {"batch_size": 8}), "cpu:1x4", time_budget_s=0.01, progress=False)
    assert plan.estimate.fits  # the cap never leaves a user without a plan
    cut = [w for w in plan.warnings if "wall-clock cap of 0.01 s stopped the search" in w]
    assert len(cut) == 1 and "another machine may find a different plan" in cut[0], plan.warnings
    assert "wall-clock cap" in plan.report()


def test_no_cap_warning_when_the_work_budget_ends_the_search():
    plan = planner.plan(ModelSpec("examples/gpt.py", {"batch_size": 8}), "cpu:1x4", effort=0.25, progress=False)
    assert not any("wall-clock cap" in w for w in plan.warnings)
    assert set(plan.timings) == {"trace_s", "search_s", "total_s"}


class _FakeClock:
    """``time`` for ``search.budget`` whose clock moves only when a test advances it."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def _record_mesh_work(monkeypatch, clock: _FakeClock, spends_s: float | None = None):
    """Wrap the ILP and MCMC entry points of ``search.mesh_search``: record, per mesh being searched,
    the work and wall-clock cap each solve and walk was given, and let each spend ``spends_s``
    seconds of the fake clock, or its whole cap when None (the worst case: every solve is cut)."""
    import search.mesh_search as mesh_search

    given: dict[str, list[tuple[str, float, float | None]]] = {}
    current = []
    real_solve, real_mcmc = mesh_search.solve, mesh_search.mcmc

    def solve(tables, memory_bytes, work=10.0, wall_clock_cap_s=None, hint=None):
        given.setdefault(current[-1], []).append(("ilp", work, wall_clock_cap_s))
        result = real_solve(tables, memory_bytes, work=work, hint=hint)
        clock.now += (wall_clock_cap_s or 0.0) if spends_s is None else spends_s
        return result

    def walk(plan, tables, *, iterations, wall_clock_cap_s=None, **options):
        given.setdefault(current[-1], []).append(("mcmc", iterations, wall_clock_cap_s))
        result = real_mcmc(plan, tables, iterations=iterations, **options)
        clock.now += (wall_clock_cap_s or 0.0) if spends_s is None else spends_s
        return result

    monkeypatch.setattr(mesh_search, "solve", solve)
    monkeypatch.setattr(mesh_search, "mcmc", walk)

    def on_progress(what: str, fraction: float) -> None:
        if what.startswith("searching mesh "):
            current.append(what.removeprefix("searching mesh ").split(" (")[0])

    return given, on_progress


def test_every_solve_may_run_until_the_whole_calls_cap_never_a_share_of_it(monkeypatch):
    # Every solve and walk takes 10 s of a 90 s cap. With the cap split between the 3 meshes
    # (as it once was), the first mesh's CP-SAT had 30 s, and a machine slow enough to need
    # more cut an ordinary search; now each gets what is left of the whole call's 90 s.
    import search.budget

    clock = _FakeClock()
    monkeypatch.setattr(search.budget, "time", clock)
    graph, spec, name, cluster = _gpt("cpu:1x4", batch_size=8)
    meshes = [str(mesh) for mesh in candidate_meshes(cluster, graph.batch_size)]
    assert len(meshes) == 3
    given, on_progress = _record_mesh_work(monkeypatch, clock, spends_s=10.0)
    budget = SearchBudget(wall_clock_cap_s=90.0, started=0.0)
    search_plan(graph, cluster, spec, name, search="auto", budget=budget, on_progress=on_progress)
    assert list(given) == meshes
    caps = [cap for mesh in meshes for _, _, cap in given[mesh]]
    # The n-th solve or walk (n = 0, 1, ...) starts after n x 10 s: 90, 80, 70, ... s left.
    assert caps[:3] == [pytest.approx(90.0), pytest.approx(80.0), pytest.approx(70.0)], given
    assert caps == [pytest.approx(max(0.01, 90.0 - 10.0 * n)) for n in range(len(caps))], given
    assert budget.cut_short == []


def test_no_candidate_mesh_gets_zero_work_even_at_a_tiny_effort(monkeypatch):
    import search.auto as auto

    graph, spec, name, cluster = _gpt("cpu:1x4", batch_size=8)
    meshes = [str(mesh) for mesh in auto.candidate_meshes(cluster, graph.batch_size)]
    given, on_progress = _record_mesh_work(monkeypatch, _FakeClock())
    search_plan(graph, cluster, spec, name, search="auto", budget=SearchBudget(effort=0.01), on_progress=on_progress)
    assert list(given) == meshes
    for mesh in meshes:
        kinds = {kind: work for kind, work, _ in given[mesh]}
        assert set(kinds) == {"ilp", "mcmc"}, given[mesh]
        assert kinds["ilp"] == pytest.approx(0.02) and kinds["mcmc"] >= 1, given[mesh]


def test_the_wall_clock_net_counts_from_the_start_of_the_call(monkeypatch):
    import search.budget

    clock = _FakeClock()
    monkeypatch.setattr(search.budget, "time", clock)
    budget = SearchBudget(effort=2.0, wall_clock_cap_s=10.0, started=0.0)
    clock.now = 4.0
    assert budget.seconds_left() == pytest.approx(6.0)  # 10 s - 4 s spent
    clock.now = 25.0
    assert budget.seconds_left() == pytest.approx(0.01)  # spent: the floor, never 0 or less
    assert SearchBudget(wall_clock_cap_s=None).seconds_left() is None
    budget.note_cut("CP-SAT on mesh dp=4")
    assert "10 s" in budget.cut_warning() and "CP-SAT on mesh dp=4" in budget.cut_warning()
