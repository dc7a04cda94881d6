"""Tests of the command line (planner/cli.py): in-process through ``main`` (fast), plus one
``python -m planner`` subprocess for the module entry point.

Every user error must be exit status 2 and exactly one line on stderr starting ``error:``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from planner.cli import main
from planner.cluster import preset_names
from planner.plans import PLAN_VERSION, load_plan
from user_errors import assert_user_error

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "examples" / "mlp.py")


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    """A plan of examples/mlp.py on cpu:1x2, written by the CLI itself."""
    path = tmp_path_factory.mktemp("plan") / "p.json"
    assert main(["plan", MLP, "--cluster", "cpu:1x2", "-o", str(path)]) == 0
    return path


# ----------------------------------------------------------------------- commands



def _unwrapped(out: str) -> str:
    """``out`` with the commands broken to the terminal's width (shell continuations) joined."""
    return re.sub(r" \\\n +", " ", out)

def test_presets_lists_every_preset(capsys):
    assert main(["presets"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == preset_names()
    assert len(lines) == len(preset_names())  # one line each
    assert {"dgx-a100-80g", "dgx-h100", "hgx-h800", "p3.16xlarge", "cpu", "p3.2xlarge", "a2-highgpu-1g", "g4dn.8xlarge",
            "a2-highgpu-4g", "a2-highgpu-8g", "p3dn.24xlarge", "h100", "a100-40g", "p5", "nd-h100-v5"} <= set(preset_names())
    assert "H800" in next(line for line in lines if line.startswith("hgx-h800"))


def test_plan_prints_report_and_writes_file(capsys, tmp_path):
    path = tmp_path / "p.json"
    assert main(["plan", MLP, "--cluster", "cpu:1x2", "--search", "dp", "-o", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    out = _unwrapped(out)
    for expected in (
        "soap-planner plan for",
        "cluster   cpu: 1 node x 2 cpu-process",
        "mesh      dp=2  (2 ranks)",
        "batch     global 16, 8 per data-parallel rank",
        "Memory per device",
        "optimizer states",
        "memory: fits",
        "Time per step",
        "exposed communication",
        "Why this plan: the runners-up",
        f"saved the plan to {path}",
        f"python -m planner compile {path} -o out",
        "torchrun --nproc_per_node 2 out/launch.py --check",
    ):
        assert expected in out, expected
    plan = load_plan(path)
    assert plan.world_size == 2 and plan.batch_size == 16
    assert plan.model.source == f"{MLP}:build"


def test_default_search_explains_itself(capsys, tmp_path):
    path = tmp_path / "searched.json"
    assert main(["plan", MLP, "--cluster", "cpu:1x2", "--time-budget", "5", "-o", str(path)]) == 0
    out = capsys.readouterr().out
    assert "search    auto search (effort 1) over 2 mesh(es)" in out and "CP-SAT" in out
    plan = load_plan(path)
    assert plan.search_summary.startswith("auto search") and plan.estimate.fits
    assert len(plan.runners_up) >= 2


def test_plan_overrides_and_forced_flavour(capsys, tmp_path):
    path = tmp_path / "p.json"
    argv = ["plan", MLP, "--cluster", "cpu:1x4", "--set", "batch_size=8", "--set", "hidden=16", "--dp", "fsdp"]
    assert main([*argv, "-o", str(path)]) == 0
    out, _ = capsys.readouterr()
    assert "mesh      dp=4" in out and "FSDP (ZeRO-3)" in out
    plan = load_plan(path)
    assert plan.dp_flavour == "fsdp"
    assert dict(plan.model.overrides) == {"batch_size": 8, "hidden": 16}


@pytest.mark.parametrize(
    ("flavour", "report_text", "program_text"),
    [
        ("zero1", "ZeRO-1: optimizer states sharded over dp", "ShardedStatesOptimizer("),
        ("zero2", "ZeRO-2: optimizer states and gradients sharded over dp", "reshard_after_forward=False)"),
    ],
)
def test_plan_and_compile_forced_zero_flavour(capsys, tmp_path, flavour, report_text, program_text):
    path = tmp_path / "p.json"
    assert main(["plan", MLP, "--cluster", "cpu:1x2", "--dp", flavour, "-o", str(path)]) == 0
    out, _ = capsys.readouterr()
    assert report_text in out
    assert load_plan(path).dp_flavour == flavour
    assert main(["compile", str(path), "-o", str(tmp_path / "out")]) == 0
    source = (tmp_path / "out" / "model_spmd.py").read_text()
    assert program_text in source
    compile(source, "model_spmd.py", "exec")


def test_compile_writes_three_files(capsys, plan_file, tmp_path):
    out_dir = tmp_path / "out"
    assert main(["compile", str(plan_file), "-o", str(out_dir)]) == 0
    out, _ = capsys.readouterr()
    assert sorted(p.name for p in out_dir.iterdir()) == [".soap-planner-program", "launch.py", "model_spmd.py", "plan.json"]
    assert load_plan(out_dir / "plan.json") == load_plan(plan_file)
    for name in ("launch.py", "model_spmd.py"):
        compile(  # the emitted programs are valid Python
            (out_dir / name).read_text(), name, "exec"
        )
    assert f"torchrun --nproc_per_node 2 {out_dir}/launch.py --check" in _unwrapped(out)


@pytest.mark.parametrize("command", [[], ["plan"], ["compile"], ["presets"]])
def test_help_exits_zero(capsys, command):
    with pytest.raises(SystemExit) as info:
        main([*command, "--help"])
    assert info.value.code == 0
    assert "usage: planner" in capsys.readouterr().out


# -------------------------------------------------------------------- user errors


def test_unknown_preset(capsys):
    line = assert_user_error(capsys, ["plan", MLP, "--cluster", "nosuch"], "unknown cluster preset 'nosuch'")
    for name in preset_names():
        assert name in line


def test_malformed_cluster_string(capsys):
    assert_user_error(capsys, ["plan", MLP, "--cluster", "cpu:1x"], "cannot read cluster 'cpu:1x'", "PRESET:NODESxDEVICES")


def test_missing_cluster_file(capsys, tmp_path):
    missing = tmp_path / "missing.toml"
    assert_user_error(capsys, ["plan", MLP, "--cluster", str(missing)], f"cluster file {missing} not found")


def test_malformed_cluster_file(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\nnodes = [\n')
    assert_user_error(capsys, ["plan", MLP, "--cluster", str(bad)], "is not valid TOML")


def test_invalid_cluster_file(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x", "backend": "gloo", "nodes": [{"preset": "cpu", "devices": 0}]}))
    assert_user_error(capsys, ["plan", MLP, "--cluster", str(bad)], "nodes[0].devices must be a positive integer")


def test_missing_spec_file(capsys, tmp_path):
    missing = tmp_path / "nothing.py"
    assert_user_error(capsys, ["plan", str(missing), "--cluster", "cpu:1x2"], "model file", "does not exist")


def test_missing_factory(capsys):
    assert_user_error(capsys, ["plan", f"{MLP}:nofactory", "--cluster", "cpu:1x2"], "has no factory 'nofactory'", "build")


def test_unknown_override(capsys):
    assert_user_error(capsys, ["plan", MLP, "--cluster", "cpu:1x2", "--set", "hiden=8"], "'hiden'", "did you mean 'hidden'")


@pytest.mark.parametrize(
    "item, fragment",
    [("batch_size", "has no '='"), ("=3", "not a Python identifier"), ("batch_size=", "empty value")],
)
def test_bad_set_syntax(capsys, item, fragment):
    assert_user_error(capsys, ["plan", MLP, "--cluster", "cpu:1x2", "--set", item], fragment)


def test_batch_not_divisible_by_dp(capsys):
    assert_user_error(
        capsys,
        ["plan", MLP, "--set", "batch_size=6", "--cluster", "cpu:1x4", "--search", "dp"],
        "global batch of 6 is not divisible by the data-parallel degree 4",
        "--set batch_size=8",
    )


def test_compile_missing_plan(capsys, tmp_path):
    assert_user_error(capsys, ["compile", str(tmp_path / "none.json"), "-o", str(tmp_path / "out")], "does not exist")


def test_compile_corrupt_plan(capsys, tmp_path):
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"format": "soap-planner-plan", "version": ')
    assert_user_error(capsys, ["compile", str(corrupt), "-o", str(tmp_path / "out")], "is not valid JSON")
    assert not (tmp_path / "out").exists()


def test_compile_wrong_version(capsys, plan_file, tmp_path):
    data = json.loads(plan_file.read_text())
    data["version"] = PLAN_VERSION + 41
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    assert_user_error(
        capsys, ["compile", str(old), "-o", str(tmp_path / "out")], f"field 'version' is {PLAN_VERSION + 41}"
    )
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------- module entry


def test_python_dash_m_planner(tmp_path):
    """``python -m planner`` runs ``main`` and passes its exit status to the shell."""
    result = subprocess.run(
        [sys.executable, "-m", "planner", "plan", MLP, "--cluster", "cpu:1x"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "error: cannot read cluster 'cpu:1x'; use PRESET, PRESET:NODES, PRESET:NODESxDEVICES "
        "(e.g. cpu:1x4) or a .toml/.json file"
    ]


def test_tensor_parallel_plan_with_fsdp_but_no_recomputation_is_refused(capsys, tmp_path):
    from planner import baselines

    plan = baselines.megatron("examples/gpt.py", "cpu:1x4", tp=2, dp_flavour="fsdp")
    plan.save(tmp_path / "fsdp_tp.json")
    assert_user_error(
        capsys, ["compile", str(tmp_path / "fsdp_tp.json"), "-o", str(tmp_path / "p")],
        "FSDP beside tensor or pipeline parallelism", "recompute full", "dp_flavour zero2",
    )


def test_bf16_compiles_under_autocast_and_fp16_is_refused(capsys, tmp_path):
    out = tmp_path / "bf16.json"
    assert main(["plan", "examples/mlp.py", "--cluster", "cpu:1x2", "--precision", "bf16", "-o", str(out)]) == 0
    report = capsys.readouterr().out
    assert "precision bf16" in report
    assert load_plan(out).precision == "bf16"
    assert main(["compile", str(out), "-o", str(tmp_path / "prog")]) == 0
    capsys.readouterr()
    assert "torch.bfloat16)" in (tmp_path / "prog" / "model_spmd.py").read_text()  # run_in_autocast(..., torch.bfloat16)
    fp16 = tmp_path / "fp16.json"
    assert main(["plan", "examples/mlp.py", "--cluster", "cpu:1x2", "--precision", "fp16", "-o", str(fp16)]) == 0
    capsys.readouterr()
    assert_user_error(capsys, ["compile", str(fp16), "-o", str(tmp_path / "p16")], "fp16 mixed precision", "loss scaling", "--precision bf16")


def test_simulate_prints_report_and_writes_trace(capsys, plan_file, tmp_path):
    trace = tmp_path / "trace.json"
    assert main(["simulate", str(plan_file), "--trace", str(trace)]) == 0
    report = capsys.readouterr().out
    assert "Time per step (simulator)" in report and "MFU" in report
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(event["ph"] == "X" and event["name"].startswith("F0") for event in events)


def test_report_names_the_stage_that_does_not_fit():
    import dataclasses

    from planner import baselines
    from planner.cluster import Cluster

    cluster = Cluster.preset("cpu", 1, 2)
    plan = baselines.megatron("examples/gpt.py", cluster, pp=2, micro_batch=2, precision="fp32")
    tiny = dataclasses.replace(plan.estimate, device_memory_bytes=1000)
    report = dataclasses.replace(plan, estimate=tiny).report()
    assert "DOES NOT FIT" in report and "pipeline stage(s) 0, 1" in report


def test_interleaved_pipeline_plans_compile_and_fp16_ones_do_not(capsys, tmp_path):
    # Interleaved 1F1B plans compile (parity: tests/test_schedule_parity.py); fp16 needs loss scaling, which is not compiled.
    from planner import baselines
    from planner.model_spec import ModelSpec

    spec = ModelSpec("examples/gpt.py", {"n_layer": 4})
    plan = baselines.megatron(spec, "cpu:1x2", pp=2, micro_batch=2, schedule="interleaved", virtual_stages=2, precision="fp32")
    path = tmp_path / "pp.json"
    plan.save(path)
    assert main(["compile", str(path), "-o", str(tmp_path / "prog")]) == 0
    assert "ScheduleInterleaved1F1B" in (tmp_path / "prog" / "model_spmd.py").read_text()
    plan = baselines.megatron(spec, "cpu:1x2", pp=2, micro_batch=2, schedule="interleaved", virtual_stages=2, precision="fp16")
    plan.save(path)
    assert_user_error(capsys, ["compile", str(path), "-o", str(tmp_path / "fp16")], "fp16", "not compiled")


def test_recomputation_compiles_only_for_repeated_blocks(capsys, tmp_path):
    import dataclasses

    from planner import baselines

    # Selective recomputation (attention cores only) needs repeated blocks too.
    plan = dataclasses.replace(baselines.ddp("examples/mlp.py", "cpu:1x2"), recompute="selective")
    plan.save(tmp_path / "selective.json")
    assert_user_error(capsys, ["compile", str(tmp_path / "selective.json"), "-o", str(tmp_path / "p1")], "no repeated blocks")
    # Full recomputation checkpoints repeated blocks: the MLP has none.
    plan = dataclasses.replace(baselines.ddp("examples/mlp.py", "cpu:1x2"), recompute="full")
    plan.save(tmp_path / "mlp.json")
    assert_user_error(capsys, ["compile", str(tmp_path / "mlp.json"), "-o", str(tmp_path / "p2")], "no repeated blocks")


# ----------------------------------------------------------------------- --routing

MOE = str(ROOT / "examples" / "moe.py")


@pytest.mark.parametrize(
    "value, fragment",
    [
        ("zipf:x", "unknown synthetic routing 'zipf:x'"),
        ("zipf:-1", "unknown synthetic routing 'zipf:-1'"),
        ("nosuch.json", "is neither 'uniform', 'zipf:ALPHA'"),
    ],
)
def test_bad_routing_is_one_line(capsys, value, fragment):
    assert_user_error(capsys, ["plan", MOE, "--cluster", "cpu:1x4", "--routing", value], fragment)


def test_routing_file_for_layers_the_model_lacks_is_one_line(capsys, tmp_path):
    path = tmp_path / "routing.json"
    layer = {"experts": 4, "top_k": 2, "token_share": [0.4, 0.3, 0.2, 0.1]}
    path.write_text(json.dumps({"format": "soap-planner-routing", "version": 1, "layers": {"blocks.9.moe": layer}}))
    assert_user_error(capsys, ["plan", MOE, "--cluster", "cpu:1x4", "--routing", str(path)],
                      "'blocks.9.moe', which is not an MoE layer of this model", "blocks.0.moe")
    path.write_text(json.dumps({"format": "soap-planner-routing", "version": 1, "layers": {"blocks.0.moe": "x"}}))
    assert_user_error(capsys, ["plan", MOE, "--cluster", "cpu:1x4", "--routing", str(path)], "layer 'blocks.0.moe'")


def test_routing_file_is_recorded_in_the_plan(capsys, tmp_path):
    path = tmp_path / "routing.json"
    layer = {"experts": 4, "top_k": 2, "token_share": [0.7, 0.1, 0.1, 0.1]}
    path.write_text(json.dumps({
        "format": "soap-planner-routing", "version": 1, "source": "my logs", "layers": {"blocks.0.moe": layer},
    }))
    out_path = tmp_path / "p.json"
    assert main(["plan", MOE, "--cluster", "cpu:1x4", "--routing", str(path), "-o", str(out_path)]) == 0
    out, _ = capsys.readouterr()
    plan = load_plan(out_path)
    assert plan.label == "moe"
    first, second = plan.expert_layouts
    assert (first.routing, first.expert_loads) == ("my logs", (0.7, 0.1, 0.1, 0.1))
    assert second.expert_loads == (0.25,) * 4 and second.routing.startswith("uniform")  # not in the file
    assert "--routing" not in out.split("next:")[1]  # saved with -o: the next step compiles the file
