"""What the bad-input tables (``test_bad_inputs.py``, ``test_bad_launch_inputs.py``) build
their rows from: a valid plan of ``examples/mlp.py`` on ``cpu:1x2``, the program compiled from
it, a valid cluster file, and a scratch folder for the rows' edited copies."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import planner

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "examples" / "mlp.py")

CLUSTER_TOML = '''name = "lab"
backend = "gloo"

[inter_node]
bandwidth = 1e9
latency = 1e-5

[[nodes]]
count = 1
devices = 2

[nodes.device]
name = "cpu-worker"
memory_bytes = 8000000000
memory_bandwidth = 1e10

[nodes.device.peak_flops]
float32 = 1e11

[nodes.intra_node]
bandwidth = 1e10
latency = 1e-6
'''


@dataclass
class Context:
    """Files the rows are built from: a valid plan of examples/mlp.py on cpu:1x2 (a dict),
    a program compiled from it, and a scratch folder."""

    scratch: Path
    plan_dict: dict
    program_folder: Path
    counter: list[int] = field(default_factory=lambda: [0])

    def fresh(self, name: str) -> Path:
        """A new path in the scratch folder (nothing there yet)."""
        self.counter[0] += 1
        return self.scratch / f"{self.counter[0]}-{name}"

    def write(self, name: str, text: str) -> str:
        path = self.fresh(name)
        path.write_text(text)
        return str(path)

    def plan_file(self, mutate: Callable[[dict], Any] | None = None) -> str:
        """The valid plan, changed by ``mutate`` (which edits the dict in place)."""
        data = json.loads(json.dumps(self.plan_dict))
        if mutate is not None:
            mutate(data)
        return self.write("plan.json", json.dumps(data))

    def cluster_file(self, old: str = "", new: str = "", suffix: str = ".toml") -> str:
        """The valid cluster file with ``old`` replaced by ``new``."""
        assert old in CLUSTER_TOML, old
        return self.write(f"cluster{suffix}", CLUSTER_TOML.replace(old, new, 1))

    def out(self) -> str:
        return str(self.fresh("out"))

    def program(self) -> Path:
        """A private copy of the compiled program."""
        folder = self.fresh("program")
        shutil.copytree(self.program_folder, folder)
        return folder

    def model_copy(self) -> Path:
        """A private copy of examples/mlp.py (rows edit it after planning)."""
        path = self.fresh("mlp_copy.py")
        shutil.copy(MLP, path)
        return path


def make_context(tmp_path_factory) -> Context:
    """Plan ``examples/mlp.py`` on ``cpu:1x2`` (plain DDP) and compile it, in a fresh scratch folder."""
    scratch = tmp_path_factory.mktemp("bad_inputs")
    plan = planner.plan(MLP, "cpu:1x2", search="dp", dp_flavour="ddp", progress=False)
    program = planner.compile(plan, scratch / "program")
    return Context(scratch, json.loads(json.dumps(plan.to_dict())), program)


def set_fields(**fields) -> Callable[[dict], None]:
    """A plan edit that sets top-level fields."""
    return lambda data: data.update(fields)
