"""A property-based fuzzer of the files users share: plans, cluster files, routing
statistics and measured runs, damaged at random and given to the real command line
(``planner.cli.main``, in this process).

Whatever the file holds, the run ends in exit 0, or in exit 2 with exactly one ``error:``
line on stderr (``user_errors.assert_one_error_line``): never a traceback, never "internal
error", never a character a terminal acts on in the output, and never more memory than a
bound: the process's peak resident size grows by less than ``MEMORY_BOUND`` over the whole
run, and its address space is capped ``ADDRESS_SPACE_HEADROOM`` above its start while the
fuzzer runs, so a file that asks for a huge allocation fails the test (MemoryError is an
internal error) instead of exhausting the machine.

Files start from real ones: a plan ``planner plan -o`` wrote for examples/mlp.py on cpu:1x2,
a preset's cluster file (JSON and TOML, as ``Cluster.save`` writes them), a routing
statistics file and a measured run of the plan. Half the examples change one value within
its type (an extreme number, hostile text), which the reader mostly accepts; the others
apply one to three mutations: a value at a random path replaced by an extreme value of its
type or by a generated JSON value (huge and tiny numbers, inf, nan, 45-digit integers,
hostile text, wrong types, small nested structures), a key deleted, a value nested 100
levels deep, or the text cut or given a stray character. Valid plans are simulated and
valid measured runs compared (the model is traced once); valid cluster and routing files
reach the model, which is missing on purpose, so they cost nothing. Examples are
derandomized: CI runs the same 100 per file kind every time, in about 10 s
(``SOAP_FUZZ_EXAMPLES=1500`` runs 1500 random ones instead, for a deeper search).
"""

from __future__ import annotations

import json
import os
import random
import resource
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from cost_model.calibration import MEASURED_FORMAT, MEASURED_VERSION
from file_samples import cluster_data, routing_data, run_cli, write_real_plan
from planner.cluster import Cluster
from user_errors import assert_one_error_line

MEMORY_BOUND = 1 * 2**30  # bytes of peak resident memory the whole fuzz run may add
ADDRESS_SPACE_HEADROOM = 4 * 2**30  # bytes of address space above the start while fuzzing
MISSING_MODEL = "/no/such/model.py"
HOSTILE = ["\x1b[2Jall good", "\x1b]8;;file:///etc/passwd\x07x\x1b]8;;\x07", "[link=file:///x]y[/link]", "\r", "\u202e",
           "\x00", "a" * 300, "../../etc/passwd", "__import__('os').system('true')"]

SCALARS = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.sampled_from([0, -1, 1, 2, 3, 10**9, 10**18, 10**45, 2**63])
    | st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([1e300, 1e-300, 0.5, -0.0])
    | st.text(max_size=12) | st.sampled_from(HOSTILE)
)
JSON_VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


def _paths(data: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside ``data`` (keys and indices), the root excluded."""
    found = []
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        found.append(prefix + (key,))
        found += _paths(value, prefix + (key,))
    return found


def _same_type(value: Any, choose: random.Random) -> Any:
    """An extreme value of ``value``'s JSON type (a container keeps its type, shuffled or cut)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return choose.choice([0, 1, -1, value * 2, value + 1, 10**9, 10**18, 10**45])
    if isinstance(value, float):
        return choose.choice([0.0, -value, value * 1e6, 1e300, 1e-300, 5e-324, 1.7e308, value / 3])
    if isinstance(value, str):
        return choose.choice(HOSTILE + [value * 3, "", value[::-1]])
    if isinstance(value, list):
        return choose.choice([value[: len(value) // 2], value + value[:1], list(reversed(value))])
    return value


def _mutated(base: Any, draw) -> str:
    """``base`` as JSON text after 1 to 3 random mutations."""
    data = json.loads(json.dumps(base))
    # Choices from a drawn seed (hypothesis's sampled_from favours the first paths: "format").
    choose = random.Random(draw(st.integers(0, 2**64 - 1)))
    # Half the examples change one value within its type, which the reader mostly accepts, so
    # the simulator and the report see extreme numbers and hostile text.
    gentle = draw(st.booleans())
    for _ in range(1 if gentle else draw(st.integers(1, 3))):
        paths = _paths(data)
        if not paths:
            break
        path = choose.choice(paths)
        parent = data
        for key in path[:-1]:
            parent = parent[key]
        kind = "same type" if gentle else choose.choice(["same type"] * 8 + ["replace"] * 8 + ["delete"] * 3 + ["nest"])
        if kind == "same type":  # mostly accepted: the numbers and text reach the simulator and the report
            parent[path[-1]] = _same_type(parent[path[-1]], choose)
        elif kind == "delete":
            del parent[path[-1]]
        elif kind == "nest":
            parent[path[-1]] = json.loads("[" * 100 + "1" + "]" * 100)
        else:
            parent[path[-1]] = draw(JSON_VALUES)
    text = json.dumps(data)
    cut = "none" if gentle else choose.choice(["none"] * 8 + ["truncate", "insert"])
    if cut != "none":
        at = draw(st.integers(0, len(text)))
        text = text[:at] if cut == "truncate" else text[:at] + draw(st.sampled_from(list('{}[]",:\\\x00\xff'))) + text[at:]
    return text


def assert_clean(status: int, out: str, err: str) -> None:
    """Exit 0, or exit 2 with one ``error:`` line; never a terminal-acting character."""
    assert "Traceback" not in err and "internal error" not in err, err
    if status != 0:
        assert_one_error_line(status, out, err, [])
    for text in (out, err):
        acting = {character for character in text if not character.isprintable() and character != "\n"}
        assert not acting, f"printed {acting!r}:\n{text[-2000:]}"


def _virtual_memory() -> int | None:
    """This process's address-space size in bytes (Linux), or None."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@pytest.fixture(scope="module")
def bounded(tmp_path_factory):
    """The real files, a warm-up simulation (so imports and the first trace are not counted),
    then the memory bounds for the fuzz run."""
    folder = tmp_path_factory.mktemp("fuzz")
    plan = write_real_plan(folder)
    status, _, err = run_cli(["simulate", str(folder / "plan.json")])
    assert status == 0, err
    start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    old_limit = resource.getrlimit(resource.RLIMIT_AS)
    size = _virtual_memory()
    if size is not None and old_limit[0] == resource.RLIM_INFINITY:
        resource.setrlimit(resource.RLIMIT_AS, (size + ADDRESS_SPACE_HEADROOM, old_limit[1]))
    try:
        yield {"folder": folder, "plan": plan}
    finally:
        resource.setrlimit(resource.RLIMIT_AS, old_limit)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - start_rss
    assert grown < MEMORY_BOUND, f"the fuzz run grew the peak resident memory by {grown / 2**20:.0f} MiB"


# SOAP_FUZZ_EXAMPLES=N runs more examples (and new ones: derandomize follows the count).
EXAMPLES = int(os.environ.get("SOAP_FUZZ_EXAMPLES", "100"))
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES == 100, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)


@FUZZ
@given(data=st.data())
def test_damaged_plans_are_run_or_refused_in_one_line(bounded, data):
    path = bounded["folder"] / "fuzzed_plan.json"
    path.write_text(_mutated(bounded["plan"], data.draw))
    note(path.read_text()[:3000])
    assert_clean(*run_cli(["simulate", str(path)]))


@FUZZ
@given(data=st.data(), suffix=st.sampled_from([".json", ".toml"]))
def test_damaged_cluster_files_are_read_or_refused_in_one_line(bounded, data, suffix):
    path = bounded["folder"] / f"fuzzed_cluster{suffix}"
    if suffix == ".json":
        path.write_text(_mutated(cluster_data(), data.draw))
    else:  # TOML holds no null and no nesting of our kind: damage the text Cluster.save writes
        Cluster.from_dict(cluster_data()).save(path, force=True)
        text = path.read_text()
        at = data.draw(st.integers(0, len(text)))
        replacement = data.draw(st.sampled_from(["", "1e999", "-1", "[[", '"\\u001b[2J"', "0", "nan", "1e300", "\x1b"]))
        text = text[:at] + replacement + text[at + data.draw(st.integers(0, 12)):]
        path.write_text(text)
    note(path.read_text()[:3000])  # shown when the example fails
    assert_clean(*run_cli(["plan", MISSING_MODEL, "--cluster", str(path)]))


@FUZZ
@given(data=st.data())
def test_damaged_routing_files_are_read_or_refused_in_one_line(bounded, data):
    path = bounded["folder"] / "fuzzed_routing.json"
    path.write_text(_mutated(routing_data(), data.draw))
    note(path.read_text()[:3000])
    assert_clean(*run_cli(["plan", MISSING_MODEL, "--routing", str(path)]))


@FUZZ
@given(data=st.data())
def test_damaged_measured_files_are_compared_or_refused_in_one_line(bounded, data):
    measured = {
        "format": MEASURED_FORMAT, "version": MEASURED_VERSION, "plan": bounded["plan"], "world_size": 2,
        "step_time_s": 0.01, "step_times_s": [0.01, 0.011],
        "ops": {"aten::mm": {"count": 2, "time_s": 0.002, "flops": 1e8}, "optimizer.step": {"count": 1, "time_s": 1e-3}},
        "collectives": [{"kind": "all_reduce", "bytes": 4096, "count": 1, "time_s": 0.001}],
    }
    path = bounded["folder"] / "fuzzed_measured.json"
    path.write_text(_mutated(measured, data.draw))
    note(path.read_text()[:3000])
    assert_clean(*run_cli(["compare", str(bounded["folder"] / "plan.json"), str(path)]))
