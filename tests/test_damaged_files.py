"""Damaged and absurd files are one line: plans, cluster files (TOML and JSON), routing
statistics and measured runs, one test per class of damage, each through the real command
line (``planner.cli.main``) and each file kind the class applies to.

A refusal is exit 2 and one ``error:`` line naming the file and what to do, never a
traceback or "internal error" (``user_errors.assert_one_error_line``). The classes:

- structure the parser cannot take: nesting deeper than ``MAX_NESTING``, integers longer
  than Python converts, bytes that are not UTF-8, a file larger than ``MAX_FILE_BYTES``;
- numbers out of range in a cluster (1e300 or 1e-300 FLOP/s, bandwidths, memory, latencies,
  inf and nan), named with the documented range;
- resource-sized fields (nodes, devices, micro-batches, virtual stages) bounded before
  anything is allocated: run in a child process whose address space is capped, so a
  regression fails the test instead of exhausting the machine;
- output paths the filesystem cannot hold (300-character names, NUL).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cost_model.calibration import MEASURED_FORMAT, MEASURED_VERSION
from file_samples import MLP, REPO, cluster_data, routing_data, run_cli, write_real_plan
from planner.cluster import FILE_RANGES, MAX_RANKS
from planner.json_files import MAX_FILE_BYTES, MAX_NESTING
from planner.routing import synthetic
from user_errors import assert_one_error_line


@pytest.fixture(scope="module")
def real_plan(tmp_path_factory) -> dict:
    return write_real_plan(tmp_path_factory.mktemp("real"))


def _measured(plan: dict) -> dict:
    return {
        "format": MEASURED_FORMAT, "version": MEASURED_VERSION, "plan": plan, "world_size": 2,
        "step_time_s": 0.01, "step_times_s": [0.01, 0.011],
        "ops": {"aten::mm": {"count": 2, "time_s": 0.002, "flops": 1e8}},
        "collectives": [{"kind": "all_reduce", "bytes": 4096, "count": 1, "time_s": 0.001}],
    }


def _argv(kind: str, path: Path, folder: Path, real_plan: dict) -> list[str]:
    """The command that reads a file of ``kind`` at ``path`` (the other inputs valid)."""
    plan = folder / "valid_plan.json"
    if not plan.exists():
        plan.write_text(json.dumps(real_plan))
    return {
        "plan": ["simulate", str(path)],
        "cluster": ["plan", MLP, "--cluster", str(path)],
        "routing": ["plan", MLP, "--routing", str(path)],
        "measured": ["compare", str(plan), str(path)],
    }[kind]


def _refused(argv: list[str], *fragments: str) -> str:
    status, out, err = run_cli(argv)
    return assert_one_error_line(status, out, err, fragments)


# ----------------------------------------------------------------------------- structure

def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("kind", ["plan", "cluster", "routing", "measured"])
def test_structure_the_parser_cannot_take_is_one_line(tmp_path, real_plan, kind):
    name = f"damaged_{kind}.json"
    path = tmp_path / name
    valid = {"plan": real_plan, "cluster": cluster_data(), "routing": routing_data(), "measured": _measured(real_plan)}[kind]
    argv = _argv(kind, path, tmp_path, real_plan)
    cases = {
        # The C parser's own recursion limit (~1000), and a depth it takes but we refuse.
        "deeply nested": (_nested(100_000), [name, "nested deeper than"]),
        "nested in a field": (json.dumps({**valid, "extra": json.loads(_nested(MAX_NESTING + 1))}),
                              [name, f"nested deeper than {MAX_NESTING} levels"]),
        "5000-digit integer": (json.dumps(valid)[:-1] + ', "extra": ' + "9" * 5000 + "}", [name, "digits"]),
        "truncated": (json.dumps(valid)[: len(json.dumps(valid)) // 2], [name, "is not valid JSON", "line 1"]),
        "empty": ("", [name, "is not valid JSON"]),
        "not an object": ("[1, 2]", [name]),
    }
    for text, fragments in cases.values():
        path.write_text(text)
        _refused(argv, *fragments)
    path.write_bytes(b'{"format": "\xff\xfe"}')
    _refused(argv, name, "UTF-8")
    path.unlink()
    os.mkfifo(path)  # reading a pipe nobody writes would never end
    _refused(argv, name, "not a regular file")
    path.unlink()
    path.mkdir()
    _refused(argv, name, "folder")


def test_toml_cluster_files_get_the_same_limits(tmp_path):
    path = tmp_path / "deep.toml"
    for text in (f"x = {_nested(100_000)}\n", f"x = {_nested(MAX_NESTING + 1)}\n"):
        path.write_text(text)
        _refused(["plan", MLP, "--cluster", str(path)], "deep.toml", "nested deeper than")
    path.write_text("name = 'x'\nbackend = \n")
    _refused(["plan", MLP, "--cluster", str(path)], "deep.toml", "is not valid TOML", "line 2")


def test_files_larger_than_the_limit_are_refused_before_reading(tmp_path, real_plan):
    path = tmp_path / "huge.json"
    with open(path, "wb") as stream:  # sparse: no disk space, no time
        stream.truncate(MAX_FILE_BYTES + 1)
    for kind in ("plan", "cluster", "routing", "measured"):
        _refused(_argv(kind, path, tmp_path, real_plan), "huge.json", f"{MAX_FILE_BYTES // 2**20} MiB")


# ------------------------------------------------------------------------------- numbers

CLUSTER_FIELDS = [
    (("nodes", 0, "device", "peak_flops", "bfloat16"), "peak_flops"),
    (("nodes", 0, "device", "memory_bytes"), "memory_bytes"),
    (("nodes", 0, "device", "memory_bandwidth"), "memory_bandwidth"),
    (("nodes", 0, "intra_node", "bandwidth"), "bandwidth"),
    (("nodes", 0, "intra_node", "latency"), "latency"),
    (("inter_node", "bandwidth"), "bandwidth"),
    (("inter_node", "latency"), "latency"),
]


def _set(data: dict, path: tuple, value) -> dict:
    data = copy.deepcopy(data)
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return data


@pytest.mark.parametrize("path, key", CLUSTER_FIELDS, ids=[".".join(map(str, p)) for p, _ in CLUSTER_FIELDS])
def test_cluster_numbers_out_of_range_are_named_with_the_range(tmp_path, real_plan, path, key):
    low, high, words = FILE_RANGES[key]
    field = ".".join(str(part) if isinstance(part, str) else f"[{part}]" for part in path).replace(".[", "[")
    cluster_file = tmp_path / "lab.json"
    for value in (1e300, high * 10, 1e-300, low / 10):
        cluster_file.write_text(json.dumps(_set(cluster_data(), path, value)))
        # A byte count that is not a whole number is refused for that before its range.
        in_words = [words] if key != "memory_bytes" or float(value).is_integer() else []
        _refused(["plan", MLP, "--cluster", str(cluster_file)], "lab.json", field, *in_words)
    for value in ("Infinity", "NaN", "-1", '"fast"', "true"):
        cluster_file.write_text(json.dumps(_set(cluster_data(), path, "@")).replace('"@"', value))
        _refused(["plan", MLP, "--cluster", str(cluster_file)], "lab.json", field)
    # The same numbers inside a plan file's cluster are checked the same way.
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps({**real_plan, "cluster": _set(real_plan["cluster"], path, 1e300)}))
    _refused(["simulate", str(plan_file)], "plan.json", field, words)


def test_numbers_beyond_float_in_every_file_are_refused(tmp_path, real_plan):
    """1e999 parses as inf, and an integer of 400 digits converts to no float: both are
    refused as not finite wherever a number is read (math.isfinite once raised on the second)."""
    for huge in ("1e999", "1" + "0" * 400):
        cases = {
            "plan": (json.dumps(_set(real_plan, ("estimate", "step_time_s"), "@")).replace('"@"', huge), "step_time_s"),
            "cluster": (json.dumps(_set(cluster_data(), ("inter_node", "bandwidth"), "@")).replace('"@"', huge),
                        "inter_node.bandwidth"),
            "routing": (json.dumps(routing_data()).replace("0.4", huge), "token_share"),
            "measured": (json.dumps(_measured(real_plan)).replace('"step_time_s": 0.01', f'"step_time_s": {huge}'),
                         "step_time_s"),
        }
        for kind, (text, field) in cases.items():
            path = tmp_path / f"{kind}.json"
            path.write_text(text)
            line = _refused(_argv(kind, path, tmp_path, real_plan), f"{kind}.json", field)
            assert len(line) < 400, line  # the number is shown short


def test_measured_fields_of_the_wrong_type_are_named(tmp_path, real_plan):
    path = tmp_path / "measured.json"
    for change, field in (
        (("world_size",), "world_size"), (("step_times_s",), "step_times_s"), (("ops",), "ops"),
        (("ops", "aten::mm", "time_s"), "ops.aten::mm.time_s"), (("collectives", 0, "bytes"), "collectives[0].bytes"),
        (("collectives", 0, "kind"), "collectives[0].kind"),
    ):
        values = ("x", None, [1] if field != "step_times_s" else ["x"], -1.0 if field != "world_size" else 0)
        for value in values if not field.endswith("kind") else (None, 1, ["x"]):
            path.write_text(json.dumps(_set(_measured(real_plan), change, value)))
            _refused(_argv("measured", path, tmp_path, real_plan), "measured.json", field)


def test_a_zipf_exponent_of_any_size_gives_shares():
    """``--routing zipf:<45 digits>`` once overflowed: the shares are 1, 0, 0, ... instead."""
    stats = synthetic("zipf:" + "9" * 45, {"blocks.0.moe": (8, 2)})
    assert stats.layers["blocks.0.moe"].token_share == (1.0,) + (0.0,) * 7
    status, out, err = run_cli(["plan", MLP, "--routing", "zipf:" + "9" * 400])  # inf: refused
    assert_one_error_line(status, out, err, ["finite exponent"])


# ---------------------------------------------------------------- resource-sized fields

# Imports first (torch maps much address space, more with CUDA), then the cap: 3 GiB above.
BOUNDED = textwrap.dedent("""
    import json, re, resource, sys
    sys.path.insert(0, sys.argv[1])
    import planner.api, planner.plans
    from file_samples import run_cli
    size = int(re.search(r"VmSize:\\s+(\\d+)", open("/proc/self/status").read())[1]) * 1024
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    cap = size + 3 * 2**30 if hard == resource.RLIM_INFINITY else min(hard, size + 3 * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    print(json.dumps([run_cli(argv) for argv in json.loads(sys.argv[2])]))
""")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the address-space size from Linux's /proc")
def test_resource_sized_fields_are_bounded_before_any_allocation(tmp_path, real_plan):
    """Each of these once allocated per node, per rank or per micro-batch until killed (24
    GB): now one line, in a child process (Linux) whose address space is capped at 3 GiB more
    than it holds once its imports are done."""
    cluster = cluster_data()
    files = {
        "nodes.json": _set(cluster, ("nodes", 0, "count"), 10**9),
        "devices.json": _set(cluster, ("nodes", 0, "devices"), 10**9),
        "groups.json": {**cluster, "nodes": [cluster["nodes"][0]] * 2**14},  # 2**14 x 8 devices = 2**17: fine
    }
    pipeline = {"stages": 2, "schedule": "1f1b", "micro_batches": 10**18}
    plans = {
        "micro_batches.json": {**real_plan, "mesh": [["pp", 2]], "pipeline": pipeline},
        "virtual_stages.json": {**real_plan, "mesh": [["pp", 2]],
                                "pipeline": {**pipeline, "micro_batches": 2, "virtual_stages": 10**18}},
        "many_nodes_plan.json": {**real_plan, "cluster": files["nodes.json"]},
    }
    for name, data in {**files, **plans}.items():
        (tmp_path / name).write_text(json.dumps(data))
    runs = {
        "nodes.json": (["plan", MLP, "--cluster", str(tmp_path / "nodes.json")], ["nodes.json", f"{MAX_RANKS:,}"]),
        "devices.json": (["plan", MLP, "--cluster", str(tmp_path / "devices.json")], ["devices.json", f"{MAX_RANKS:,}"]),
        "preset string": (["plan", MLP, "--cluster", "dgx-h100:1000000000x8"], ["dgx-h100", f"{MAX_RANKS:,}"]),
        "micro_batches.json": (["simulate", str(tmp_path / "micro_batches.json")], ["micro-batches", "batch_size"]),
        "virtual_stages.json": (["simulate", str(tmp_path / "virtual_stages.json")], ["virtual_stages", "ops"]),
        "many_nodes_plan.json": (["simulate", str(tmp_path / "many_nodes_plan.json")], ["cluster", f"{MAX_RANKS:,}"]),
    }
    child = subprocess.run(
        [sys.executable, "-c", BOUNDED, str(Path(__file__).parent), json.dumps([argv for argv, _ in runs.values()])],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
    )
    assert child.returncode == 0, child.stderr[-2000:]
    for (name, (_, fragments)), (status, out, err) in zip(runs.items(), json.loads(child.stdout)):
        assert_one_error_line(status, out, err, fragments)
    # A cluster file of many node groups within the limit still loads.
    status, out, err = run_cli(["plan", "/no/such/model.py", "--cluster", str(tmp_path / "groups.json")])
    assert_one_error_line(status, out, err, ["model file", "does not exist"])


# ----------------------------------------------------------------------------- outputs

@pytest.mark.parametrize("name", ["a" * 300, "x/" + "b" * 256, "n\x00ul"], ids=["300 characters", "256 in a folder", "NUL"])
def test_output_paths_the_filesystem_cannot_hold_are_one_line(tmp_path, real_plan, name):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(real_plan))
    target = str(tmp_path / name)
    for argv in (
        ["plan", MLP, "-o", target + ".json"],
        ["compile", str(plan), "-o", target],
        ["simulate", str(plan), "--trace", target + ".json"],
        ["profile", "-o", target + ".toml"],
        ["calibrate", str(plan), "--cluster", "cpu", "-o", target + ".toml"],
        ["export-checkpoint", str(tmp_path), "-o", target + ".pt"],
    ):
        _refused(argv, "choose")
    for argv in (["simulate", target], ["plan", MLP, "--cluster", target + ".toml"], ["compare", str(plan), target]):
        _refused(argv)


def test_plan_records_are_type_checked_field_by_field(tmp_path, real_plan):
    """A plan's summary, runners-up and costs were built unchecked (a list for forward_flops
    crashed the report): each field is now checked against its type, and a count written as
    an integral float by hand still loads."""
    path = tmp_path / "plan.json"
    for where, value, field in (
        (("summary", "forward_flops"), [], "summary.forward_flops"),
        (("summary", "blocks"), {"x": "many"}, "summary.blocks"),
        (("runners_up", 0, "step_time_s"), -1.0, "runners_up[0].step_time_s"),
        (("strategies", 0, "cost", "compute_s"), "fast", "strategies[0].cost.compute_s"),
        (("strategies", 0, "cost", "memory_bytes"), 1.5, "strategies[0].cost.memory_bytes"),
        (("estimate", "bytes_per_axis"), {"tp": [1]}, "estimate.bytes_per_axis.tp"),
    ):
        path.write_text(json.dumps(_set(real_plan, where, value)))
        _refused(["simulate", str(path)], "plan.json", field)
    path.write_text(json.dumps(_set(real_plan, ("summary", "parameters"), float(real_plan["summary"]["parameters"]))))
    status, out, err = run_cli(["simulate", str(path)])
    assert status == 0, err
