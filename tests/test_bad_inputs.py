"""Every bad input gets one clear line: a table of user mistakes, one row each.

Each row is a mistake a user can make, by class: command-line flags, API arguments, plan
files, cluster files and output paths (``launch.py`` flags and program folders:
``test_bad_launch_inputs.py``). Every row asserts exit status 2 (or, for API rows, the
``PlannerError`` subclass), exactly one stderr line starting ``error: ``, no traceback, no
"internal error", and fragments that name the problem. Rows run in-process
(``planner.cli.main``): every check fails before a search or a measurement starts.

Add a row whenever a new kind of mistake shows up.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

import planner
from codegen.runtime import load_program
from planner import baselines
from planner.cluster import Cluster
from planner.errors import ArgumentError, ClusterError, LaunchError, OutputError, PlanFileError, SpecError
from planner.model_spec import ModelSpec
from planner.plans import load_plan
from bad_inputs_context import MLP, ROOT, Context, make_context, set_fields  # on sys.path under pytest
from user_errors import assert_api_error, assert_user_error


NO_PARAMETERS = '''
import torch
from torch import nn

class Softmax(nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=-1).sum()

def build(batch_size: int = 4):
    return Softmax(), (torch.randn(batch_size, 8),)
'''

FROZEN = '''
import torch
from torch import nn

def build(batch_size: int = 4):
    model = nn.Linear(8, 8)
    model.requires_grad_(False)
    return model, (torch.randn(batch_size, 8),)
'''


@pytest.fixture(scope="module")
def ctx(tmp_path_factory) -> Context:
    return make_context(tmp_path_factory)

def _strategy(index: int, key: str, value) -> Callable[[dict], None]:
    def mutate(data: dict) -> None:
        data["strategies"][index][key] = value

    return mutate


def _first_param(data: dict) -> tuple[int, str]:
    """(strategy index, parameter name) of the first strategy that reads a parameter."""
    for index, strategy in enumerate(data["strategies"]):
        if strategy["params"]:
            return index, next(iter(strategy["params"]))
    raise AssertionError("the plan reads no parameter")


def _shard_param(dim: int) -> Callable[[dict], None]:
    def mutate(data: dict) -> None:
        index, name = _first_param(data)
        data["strategies"][index]["params"][name] = [f"S({dim})"]

    return mutate


def _drop_strategy(data: dict) -> None:
    del data["strategies"][-1]


def _duplicate_strategy(data: dict) -> None:
    data["strategies"].append(data["strategies"][0])


# ------------------------------------------------------------------- command-line flags

CLI_ROWS = [
    ("time-budget negative", lambda c: ["plan", MLP, "--time-budget", "-1"], ["--time-budget", "positive finite", "'-1'"]),
    ("time-budget zero", lambda c: ["plan", MLP, "--time-budget", "0"], ["--time-budget", "positive finite", "'0'"]),
    ("time-budget nan", lambda c: ["plan", MLP, "--time-budget", "nan"], ["--time-budget", "'nan'"]),
    ("time-budget inf", lambda c: ["plan", MLP, "--time-budget", "inf"], ["--time-budget", "'inf'"]),
    ("time-budget text", lambda c: ["plan", MLP, "--time-budget", "soon"], ["--time-budget", "'soon'"]),
    ("seed negative", lambda c: ["plan", MLP, "--seed", "-3"], ["--seed", "integer >= 0", "'-3'"]),
    ("seed float", lambda c: ["plan", MLP, "--seed", "1.5"], ["--seed", "integer >= 0", "'1.5'"]),
    ("seed text", lambda c: ["plan", MLP, "--seed", "abc"], ["--seed", "'abc'"]),
    ("search ilp with dp", lambda c: ["plan", MLP, "--search", "ilp", "--dp", "fsdp"], ["--dp fsdp", "--search ilp", "drop --search"]),
    ("search mcmc with dp", lambda c: ["plan", MLP, "--search", "mcmc", "--dp", "ddp"], ["--dp ddp", "--search mcmc"]),
    ("unknown search", lambda c: ["plan", MLP, "--search", "greedy"], ["--search", "invalid choice: 'greedy'"]),
    ("unknown precision", lambda c: ["plan", MLP, "--precision", "fp64"], ["--precision", "'fp64'"]),
    ("unknown dp flavour", lambda c: ["plan", MLP, "--dp", "zero3"], ["--dp", "'zero3'"]),
    ("unknown flag", lambda c: ["plan", MLP, "--budget", "3"], ["unrecognized arguments: --budget 3"]),
    ("no spec", lambda c: ["plan"], ["required: SPEC", "planner plan --help"]),
    ("no command", lambda c: [], ["required: COMMAND"]),
    ("unknown command", lambda c: ["plans"], ["invalid choice: 'plans'"]),
    ("compile without -o", lambda c: ["compile", c.plan_file()], ["required: -o/--output"]),
    ("profile nproc 0", lambda c: ["profile", "--nproc", "0", "-o", str(c.fresh("c.toml"))], ["--nproc", ">= 2", "'0'"]),
    ("profile nproc text", lambda c: ["profile", "--nproc", "two", "-o", str(c.fresh("c.toml"))], ["--nproc", "'two'"]),
    ("zero devices", lambda c: ["plan", MLP, "--cluster", "cpu:1x0"], ["zero nodes or devices"]),
    ("spec not python", lambda c: ["plan", c.write("model.txt", "x = 1\n")], ["neither 'path/to/file.py[:factory]'"]),
    ("no parameters", lambda c: ["plan", c.write("softmax.py", NO_PARAMETERS), "--cluster", "cpu:1x2"],
     ["the model has no parameters to train", "Softmax", "it has none"]),
    ("frozen parameters", lambda c: ["plan", c.write("frozen.py", FROZEN), "--cluster", "cpu:1x2"],
     ["no parameters to train", "requires_grad=False"]),
    ("empty sequence", lambda c: ["plan", str(ROOT / "examples" / "gpt.py"), "--set", "seq_len=0"],
     ["example positional input [0] is empty (shape (8, 0))", "seq_len"]),
    ("unknown hf model type", lambda c: ["plan", "hf:gpt3000"], ["unknown HuggingFace model type 'gpt3000'"]),
    ("cluster file suffix", lambda c: ["plan", MLP, "--cluster", c.write("lab.yaml", "name: lab\n")], ["must end in .toml or .json"]),
    ("empty batch", lambda c: ["plan", MLP, "--set", "batch_size=0"], ["the example batch is empty", "batch_size=8"]),
    ("override of wrong type", lambda c: ["plan", MLP, "--set", "batch_size=many"], ["building", "batch_size='many'"]),
]


@pytest.mark.parametrize(("name", "argv", "fragments"), CLI_ROWS, ids=[row[0] for row in CLI_ROWS])
def test_command_line_flags(capsys, ctx, name, argv, fragments):
    assert_user_error(capsys, argv(ctx), *fragments)


# ---------------------------------------------------------------------- API arguments


API_ROWS = [
    ("cluster of wrong type", lambda c: planner.plan(MLP, 42), ClusterError, ["cluster must be a Cluster", "got int"]),
    ("model of wrong type", lambda c: planner.plan(42, "cpu"), SpecError, ["expected an nn.Module", "got int"]),
    ("module without inputs", lambda c: planner.plan(nn.Linear(4, 2), "cpu:1x2"), SpecError, ["example_inputs"]),
    ("inputs with a spec", lambda c: planner.plan(MLP, "cpu:1x2", (torch.randn(8, 4),)), ArgumentError,
     ["example_inputs is only for a model passed as an nn.Module"]),
    ("spec of wrong type", lambda c: planner.plan(nn.Linear(4, 2), "cpu:1x2", (torch.randn(8, 4),), spec=3),
     ArgumentError, ["spec must be", "got int"]),
    ("precision", lambda c: planner.plan(MLP, "cpu:1x2", precision="fp64"), ArgumentError,
     ["precision must be one of", "'fp32'", "'fp64'"]),
    ("precision of wrong type", lambda c: planner.plan(MLP, "cpu:1x2", precision=16), ArgumentError, ["precision", "16"]),
    ("search", lambda c: planner.plan(MLP, "cpu:1x2", search="greedy"), ArgumentError, ["search must be one of", "'greedy'"]),
    ("dp flavour", lambda c: planner.plan(MLP, "cpu:1x2", dp_flavour="zero3"), ArgumentError, ["dp_flavour", "'zero3'"]),
    ("dp flavour with ilp", lambda c: planner.plan(MLP, "cpu:1x2", dp_flavour="fsdp", search="ilp"), ArgumentError,
     ["dp_flavour='fsdp'", "search='ilp'"]),
    ("seed bool", lambda c: planner.plan(MLP, "cpu:1x2", seed=True), ArgumentError, ["seed must be an integer >= 0", "True"]),
    ("seed float", lambda c: planner.plan(MLP, "cpu:1x2", seed=1.5), ArgumentError, ["seed", "1.5"]),
    ("seed negative", lambda c: planner.plan(MLP, "cpu:1x2", seed=-1), ArgumentError, ["seed", "-1"]),
    ("budget zero", lambda c: planner.plan(MLP, "cpu:1x2", time_budget_s=0), ArgumentError,
     ["time_budget_s must be a positive finite number of seconds", "got 0"]),
    ("budget nan", lambda c: planner.plan(MLP, "cpu:1x2", time_budget_s=math.nan), ArgumentError, ["time_budget_s", "nan"]),
    ("budget inf", lambda c: planner.plan(MLP, "cpu:1x2", time_budget_s=math.inf), ArgumentError, ["time_budget_s", "inf"]),
    ("budget text", lambda c: planner.plan(MLP, "cpu:1x2", time_budget_s="30"), ArgumentError, ["time_budget_s", "'30'"]),
    ("progress text", lambda c: planner.plan(MLP, "cpu:1x2", progress="yes"), ArgumentError, ["progress must be True or False"]),
    ("load_plan of int", lambda c: planner.load_plan(123), PlanFileError, ["load_plan takes the path", "got int"]),
    ("load_plan of None", lambda c: planner.load_plan(None), PlanFileError, ["got NoneType"]),
    ("compile to int", lambda c: planner.compile(c.plan_file(), 5), OutputError, ["output folder must be a path", "5"]),
    ("compile an int", lambda c: planner.compile(42, c.out()), ArgumentError, ["compile takes a Plan or the path", "got int"]),
    ("compile a missing path", lambda c: planner.compile(str(c.fresh("none.json")), c.out()), PlanFileError, ["does not exist"]),
    ("compile force text", lambda c: planner.compile(c.plan_file(), c.out(), force="yes"), ArgumentError, ["force must be True or False"]),
    ("simulate an int", lambda c: planner.simulate(42), ArgumentError, ["simulate takes a Plan or the path"]),
    ("simulate a corrupt path", lambda c: planner.simulate(c.write("bad.json", "{")), PlanFileError, ["is not valid JSON"]),
    ("cluster parse of int", lambda c: Cluster.parse(42), ClusterError, ["cannot read cluster 42"]),
    ("model spec of int", lambda c: ModelSpec(42), SpecError, ["model source must be"]),
    ("megatron tp of wrong type", lambda c: baselines.megatron(MLP, "cpu:1x2", tp="2"), ArgumentError,
     ["tp must be an integer >= 1, got '2'"]),
    ("megatron micro-batch zero", lambda c: baselines.megatron(MLP, "cpu:1x2", micro_batch=0), ArgumentError, ["micro_batch"]),
    ("megatron sequence_parallel text", lambda c: baselines.megatron(MLP, "cpu:1x2", sequence_parallel="yes"), ArgumentError,
     ["sequence_parallel must be True or False"]),
    ("ddp precision", lambda c: baselines.ddp(MLP, "cpu:1x2", precision="fp64"), ArgumentError, ["precision", "'fp64'"]),
    ("load_program of int", lambda c: load_program(123), LaunchError, ["load_program takes the path", "got int"]),
    ("spec with a spec", lambda c: planner.plan(MLP, "cpu:1x2", spec=MLP), ArgumentError, ["spec is only for a model passed as"]),
    ("inputs without a tensor", lambda c: planner.plan(nn.Linear(4, 2), "cpu:1x2", 42), SpecError,
     ["the example inputs (int) hold no tensor with a batch dimension"]),
]


@pytest.mark.parametrize(("name", "call", "kind", "fragments"), API_ROWS, ids=[row[0] for row in API_ROWS])
def test_api_arguments(ctx, name, call, kind, fragments):
    assert_api_error(lambda: call(ctx), kind, *fragments)


def test_api_accepts_plan_paths(ctx, tmp_path):
    """What the API rows refuse, it accepts in the right form: a saved plan's path (str or
    Path) compiles and simulates like the Plan itself."""
    path = ctx.plan_file()
    out = planner.compile(Path(path), tmp_path / "out")
    assert load_plan(out / "plan.json") == load_plan(path)
    assert planner.simulate(path).step_time_s == planner.simulate(load_plan(path)).step_time_s > 0


# ------------------------------------------------------------------------- plan files


def _compile(mutate) -> Callable[[Context], list[str]]:
    return lambda c: ["compile", c.plan_file(mutate), "-o", c.out()]


def _simulate(mutate) -> Callable[[Context], list[str]]:
    return lambda c: ["simulate", c.plan_file(mutate)]


def _changed_overrides(data: dict) -> None:
    data["model"]["overrides"] = {"hidden": 48}  # builds a wider MLP than the one planned


PLAN_ROWS = [
    ("batch zero", _compile(set_fields(batch_size=0)), ["batch_size (the global batch) must be a positive integer, got 0"]),
    ("batch negative", _compile(set_fields(batch_size=-16)), ["batch_size", "got -16"]),
    ("batch bool", _compile(set_fields(batch_size=True)), ["field 'batch_size' must be int, got bool"]),
    ("batch not the model's", _compile(set_fields(batch_size=8)), ["batch_size is 8", "example batch is 16", "re-plan"]),
    ("batch not the graph's", _simulate(set_fields(batch_size=8)), ["batch_size is 8", "global batch is 16", "re-plan"]),
    ("accumulation not dividing", _compile(set_fields(accumulation_steps=3)), ["micro-batches", "divides the batch"]),
    ("accumulation zero", _compile(set_fields(accumulation_steps=0)), ["accumulation_steps", "positive integer, got 0"]),
    ("accumulation text", _compile(set_fields(accumulation_steps="4")), ["field 'accumulation_steps' must be int, got str"]),
    ("mesh axis name", _compile(set_fields(mesh=[["data", 2]])), ["field 'mesh' is invalid", "'mesh[0]' names axis 'data', not one of dp, tp, pp"]),
    ("mesh axis size zero", _compile(set_fields(mesh=[["dp", 0]])), ["field 'mesh'", "positive integer size, got 0"]),
    ("mesh axis size bool", _compile(set_fields(mesh=[["dp", True]])), ["field 'mesh'", "got True"]),
    ("mesh not a list", _compile(set_fields(mesh="dp=2")), ["field 'mesh'", "[name, size] pairs"]),
    ("mesh bigger than cluster", _compile(set_fields(mesh=[["dp", 2], ["tp", 2]])), ["has 4 ranks but the cluster has 2 devices"]),
    ("pipeline without pp", _compile(set_fields(pipeline={"stages": 2, "schedule": "1f1b", "micro_batches": 2, "virtual_stages": 1})),
     ["a pipeline needs a 'pp' mesh axis"]),
    ("placements per axis", _compile(_strategy(0, "outputs", [["S(0)", "R"]])),
     ["field 'strategies[0].outputs[0]' has 2 placement(s)", "one placement per mesh axis"]),
    ("input placements per axis", _compile(lambda d: d["inputs"].update(inputs=[])), ["field 'inputs.inputs' has 0 placement(s)"]),
    ("input shard past its rank", _compile(lambda d: d["inputs"].update(inputs=["S(2)"])),
     ["field 'inputs.inputs'", "S(2) splits dimension 2", "has 2 dimension(s)"]),
    ("weight shard past its rank", _compile(_shard_param(3)), ["S(3) splits dimension 3", "parameter 'net.0."]),
    ("weight shard past its rank, simulate", _simulate(_shard_param(2)), ["S(2) splits dimension 2"]),
    ("output shard past its rank", _simulate(_strategy(-1, "outputs", [["S(1)"]])), ["S(1) splits a 0-dim tensor"]),
    ("not a placement", _compile(_strategy(0, "inputs", [["X(0)"]])), ["'X(0)' is not a placement"]),
    ("strategy missing", _simulate(_drop_strategy), ["no strategy for 1 op(s)", "re-plan"]),
    ("strategy duplicated", _simulate(_duplicate_strategy), ["second strategy for op"]),
    ("strategy for no op", _simulate(_strategy(0, "node", "ghost")), ["'ghost', which the traced model does not have"]),
    ("strategy of another op", _simulate(_strategy(0, "op", "aten.mm.default")), ["field 'strategies[0].op' is 'aten.mm.default'"]),
    ("precision", _compile(set_fields(precision="fp64")), ["field 'precision' must be one of", "'fp64'"]),
    ("optimizer", _compile(set_fields(optimizer="adam")), ["field 'optimizer' must be one of", "'adam'"]),
    ("fsdp units", _compile(set_fields(fsdp_units=[3])), ["field 'fsdp_units[0]' must be str, got int"]),
    ("warnings", _compile(set_fields(warnings=[None])), ["field 'warnings[0]' must be str"]),
    ("old version", _compile(set_fields(version=2)), ["field 'version' is 2", "re-run `planner plan`"]),
    ("fingerprint malformed", _compile(set_fields(model_fingerprint="abc")), ["'model_fingerprint' must be 64 hex digits"]),
    ("fingerprint empty", _compile(set_fields(model_fingerprint="")), ["records no model fingerprint"]),
    ("spec builds another model", _compile(_changed_overrides),
     ["now builds a different model than the one planned", "hidden=48", "re-plan"]),
    ("spec builds another model, simulate", _simulate(_changed_overrides), ["now builds a different model"]),
    ("model spec unknown key", _compile(lambda d: d["model"].update(path="x")), ["field 'model' is invalid", "unknown keys"]),
    ("cluster in plan", _compile(lambda d: d["cluster"].update(backend="mpi")), ["field 'cluster' is invalid"]),
    ("not an object", lambda c: ["simulate", c.write("list.json", "[1]")], ["top level must be a JSON object"]),
    ("a folder", lambda c: ["simulate", str(c.scratch)], ["is a folder", "pass the plan's JSON file"]),
    ("strategies not a list", _compile(set_fields(strategies={})), ["field 'strategies' must be list, got dict"]),
    ("input the model does not take", _simulate(lambda d: d.update(inputs={"x": ["S(0)"], "targets": ["S(0)"]})),
     ["places input 'x'", "inputs are inputs, targets"]),
    ("no model spec", _compile(set_fields(model=None)), ["no model spec", "torchrun cannot rebuild the model"]),
    ("model source empty", _compile(lambda d: d["model"].update(source="")), ["field 'model' is invalid", "model source must be"]),
    ("model file gone", _simulate(lambda d: d["model"].update(source="/nonexistent/model.py:build")),
     ["model file '/nonexistent/model.py' does not exist"]),
    ("estimate not a number", _compile(lambda d: d["estimate"].update(step_time_s=math.nan)),
     ["field 'estimate.step_time_s' must be a finite number >= 0, got nan"]),
    ("negative memory", _compile(lambda d: d["estimate"]["memory"].update(weights=-1)), ["'estimate.memory.weights'", "got -1"]),
    ("stage past the pipeline", _compile(_strategy(0, "stage", 1)), ["runs on pipeline stage 1", "1 stage(s)"]),
    ("stage negative", _compile(_strategy(0, "stage", -1)), ["field 'strategies[0].stage' must be a finite number >= 0"]),
]


@pytest.mark.parametrize(("name", "argv", "fragments"), PLAN_ROWS, ids=[row[0] for row in PLAN_ROWS])
def test_plan_files(capsys, ctx, name, argv, fragments):
    assert_user_error(capsys, argv(ctx), *fragments)


def test_edited_model_file_is_a_different_model(capsys, ctx):
    """The model file itself edited after planning: compile and simulate name the change."""
    model_file = ctx.model_copy()
    plan = planner.plan(str(model_file), "cpu:1x2", search="dp", progress=False)
    path = ctx.fresh("plan.json")
    plan.save(path)
    model_file.write_text(model_file.read_text().replace("hidden: int = 64", "hidden: int = 96"))
    line = assert_user_error(capsys, ["compile", str(path), "-o", ctx.out()], "now builds a different model", "mlp_copy.py")
    assert "planned MLP, 6,792 parameters" in line and "now MLP, " in line
    assert_user_error(capsys, ["simulate", str(path)], "now builds a different model")


# ------------------------------------------------------------------------ cluster files

CLUSTER_ROWS = [
    ("negative bandwidth", ("bandwidth = 1e9", "bandwidth = -1e9"), ["inter_node.bandwidth must be a positive finite number"]),
    ("zero bandwidth", ("[nodes.intra_node]\nbandwidth = 1e10", "[nodes.intra_node]\nbandwidth = 0"), ["intra_node.bandwidth", "got 0"]),
    ("nan bandwidth", ("bandwidth = 1e9", "bandwidth = nan"), ["inter_node.bandwidth", "nan"]),
    ("infinite latency", ("latency = 1e-5", "latency = inf"), ["inter_node.latency", "inf"]),
    ("zero memory", ("memory_bytes = 8000000000", "memory_bytes = 0"), ["memory_bytes must be a positive integer, got 0"]),
    ("fractional memory", ("memory_bytes = 8000000000", "memory_bytes = 1.5"), ["memory_bytes", "1.5"]),
    ("negative flops", ("float32 = 1e11", "float32 = -1e11"), ["peak_flops.float32 must be a positive finite number"]),
    ("unknown dtype", ("float32 = 1e11", "float33 = 1e11"), ["unknown key", "float33", "did you mean 'float32'"]),
    ("zero count", ("count = 1", "count = 0"), ["nodes[0].count must be a positive integer, got 0"]),
    ("negative devices", ("devices = 2", "devices = -2"), ["nodes[0].devices must be a positive integer, got -2"]),
    ("devices of wrong type", ("devices = 2", 'devices = "two"'), ["nodes[0].devices", "'two'"]),
    ("unknown key", ("backend = \"gloo\"", "backend = \"gloo\"\nbackends = 1"), ["unknown key backends", "did you mean 'backend'"]),
    ("name of wrong type", ('name = "lab"', "name = 3"), ["name must be a non-empty printable string, got 3"]),
    ("unknown backend", ('backend = "gloo"', 'backend = "mpi"'), ["backend must be", "'mpi'"]),
    ("efficiency above one", ("memory_bandwidth = 1e10", "memory_bandwidth = 1e10\ncalibration = { matmul_efficiency = 1.5 }"),
     ["calibration.matmul_efficiency must be a fraction in (0, 1], got 1.5"]),
    ("comment of wrong type", ('name = "lab"', 'name = "lab"\ncomment = 1'), ["comment must be a string"]),
    ("not TOML", ('name = "lab"', 'name = "lab'), ["is not valid TOML"]),
]


@pytest.mark.parametrize(("name", "change", "fragments"), CLUSTER_ROWS, ids=[row[0] for row in CLUSTER_ROWS])
def test_cluster_files(capsys, ctx, name, change, fragments):
    assert_user_error(capsys, ["plan", MLP, "--cluster", ctx.cluster_file(*change)], *fragments)


def test_the_cluster_file_the_rows_edit_is_valid(ctx):
    cluster = Cluster.parse(ctx.cluster_file())
    assert cluster.world_size == 2 and cluster.name == "lab"


# ------------------------------------------------------------------------- output paths


@pytest.fixture
def no_work(monkeypatch):
    """Every output-path row must fail before the search, the compile, the measurement or
    the simulation starts: each of them fails the test if it is reached."""
    import cost_model.profile
    import planner.api
    import planner.plans

    def reached(what):
        def fail(*args, **kwargs):
            raise AssertionError(f"{what} started despite a bad output path")

        return fail

    monkeypatch.setattr(planner.api, "plan", reached("the search"))
    monkeypatch.setattr(planner.api, "simulate", reached("the simulation"))
    monkeypatch.setattr(planner.plans, "load_plan", reached("compile (loading the plan)"))
    monkeypatch.setattr(cost_model.profile, "measure_machine", reached("the measurement"))


def _user_file(c: Context, name: str, text: str = "my notes\n") -> str:
    return c.write(name, text)


def _folder(c: Context, name: str) -> str:
    folder = c.fresh(name)
    folder.mkdir()
    return str(folder)


def _user_folder(c: Context) -> str:
    folder = c.fresh("mine")
    folder.mkdir()
    (folder / "launch.py").write_text("print('my own launcher')\n")
    return str(folder)


OUTPUT_ROWS = [
    ("plan -o missing folder", lambda c: ["plan", MLP, "-o", str(c.fresh("nowhere") / "p.json")],
     ["folder", "nowhere does not exist", "create it first"]),
    ("plan -o a folder", lambda c: ["plan", MLP, "-o", str(c.scratch)], ["is a folder", "give a file path"]),
    ("plan -o a user's file", lambda c: ["plan", MLP, "-o", _user_file(c, "notes.json")],
     ["refusing to overwrite", "notes.json", "not a soap-planner plan", "--force"]),
    ("plan -o a user's JSON", lambda c: ["plan", MLP, "-o", _user_file(c, "data.json", '{"format": "mine"}')],
     ["refusing to overwrite"]),
    ("plan -o below a file", lambda c: ["plan", MLP, "-o", str(Path(_user_file(c, "file")) / "p.json")], ["is not a folder"]),
    ("plan -o empty", lambda c: ["plan", MLP, "-o", ""], ["must be a path"]),
    ("compile -o a file", lambda c: ["compile", c.plan_file(), "-o", _user_file(c, "out.txt")], ["is a file", "folder path"]),
    ("compile -o a user's folder", lambda c: ["compile", c.plan_file(), "-o", _user_folder(c)],
     ["is not empty (launch.py)", "not written by `planner compile`", "--force"]),
    ("compile -o below a file", lambda c: ["compile", c.plan_file(), "-o", str(Path(_user_file(c, "f")) / "out")],
     ["is a file, not a folder"]),
    ("profile -o a user's file", lambda c: ["profile", "-o", _user_file(c, "lab.toml", 'name = "mine"\n')],
     ["refusing to overwrite", "lab.toml", "not a cluster file written by soap-planner", "--force"]),
    ("profile -o a folder", lambda c: ["profile", "-o", _folder(c, "dir.toml")], ["dir.toml is a folder"]),
    ("profile -o missing folder", lambda c: ["profile", "-o", str(c.fresh("gone") / "c.json")], ["gone does not exist"]),
    ("simulate --trace missing folder", lambda c: ["simulate", c.plan_file(), "--trace", str(c.fresh("gone") / "t.json")],
     ["gone does not exist"]),
    ("simulate --trace a user's file", lambda c: ["simulate", c.plan_file(), "--trace", _user_file(c, "t.json", "{}")],
     ["refusing to overwrite", "not a Chrome trace"]),
]


@pytest.mark.parametrize(("name", "argv", "fragments"), OUTPUT_ROWS, ids=[row[0] for row in OUTPUT_ROWS])
def test_output_paths(capsys, ctx, no_work, name, argv, fragments):
    assert_user_error(capsys, argv(ctx), *fragments)


def test_user_files_survive_refusals(capsys, ctx, no_work):
    notes = Path(_user_file(ctx, "notes.json"))
    folder = Path(_user_folder(ctx))
    assert_user_error(capsys, ["plan", MLP, "-o", str(notes)], "refusing to overwrite")
    assert_user_error(capsys, ["compile", ctx.plan_file(), "-o", str(folder)], "not empty")
    assert notes.read_text() == "my notes\n"
    assert [p.name for p in folder.iterdir()] == ["launch.py"]
    assert (folder / "launch.py").read_text() == "print('my own launcher')\n"
