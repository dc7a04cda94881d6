"""The bytes a compiled program moves equal the bytes its plan's simulator charged.

For each world size, every plan of ``tests/comm_audit_plans.py`` (DDP, ZeRO-1, ZeRO-2, FSDP2,
Megatron tp=2, a graph program of random placements, a 1F1B pipeline of two stages, an
expert-parallel MoE) is compiled and run for one training step in ONE torchrun launch of
``tests/comm_audit_many.py``, with every collective counted per mesh axis
(``codegen.runtime.comm_audit``). Per axis, the bytes the busiest rank sent must equal the
plan's ``SimResult.bytes_per_axis``:

- exactly (relative 1e-9) for every collective the plan decides: gradient buckets, FSDP
  gathers and reduce-scatters, ZeRO's broadcasts, tensor-parallel all-reduces and gathers,
  pipeline sends;
- plus ``SCALAR_SLACK_BYTES`` for the scalars a program shares to run at all and which no
  plan prices (a pipeline broadcasts its loss from the last stage: 4 bytes, 2 per device);
- within ``MOE_TOLERANCE`` on the MoE plan's axis, whose dispatch sizes follow the routing
  the step actually saw (the simulator assumes the uniform routing it was given).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import planner
from test_parity import Launch, _run

sys.path.insert(0, str(Path(__file__).resolve().parent))
from comm_audit_plans import plans  # noqa: E402

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).resolve().with_name("comm_audit_many.py")
REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT = 300  # seconds; a launch takes ~10 s on 2 cores, the limit only stops a hang
SCALAR_SLACK_BYTES = 64.0
MOE_TOLERANCE = 0.02
WORLD_SIZES = (2, 4)
CASES = ("mlp-ddp", "gpt-ddp", "gpt-zero1", "gpt-zero2", "gpt-fsdp", "gpt-pp2-1f1b")


@dataclass
class Audit:
    """One launch's AUDIT lines: {(case, axis): (predicted, counted)}, and the launch."""

    figures: dict[tuple[str, str], tuple[float, float]]
    launch: Launch
    plans: dict[str, planner.Plan]


def _audit(world: int, root: Path) -> Audit:
    chosen = {case: plan for case, plan in plans(world).items() if case in CASES}
    folders = {case: planner.compile(plan, root / case) for case, plan in chosen.items()}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), str(WORKER)]
    launch = _run([*command, *map(str, folders.values())], cwd=REPO, timeout=LAUNCH_TIMEOUT)
    assert launch.returncode == 0, launch.describe()
    case_of = {str(folder): case for case, folder in folders.items()}
    figures = {}
    for line in launch.stdout.splitlines():
        if line.startswith("AUDIT "):
            _, folder, axis, *rest = line.split(" ")
            assert axis != "FAILED", line
            figures[(case_of[folder], axis)] = (float(rest[0]), float(rest[1]))
    return Audit(figures, launch, chosen)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda world: f"world{world}")
def audit(request, tmp_path_factory) -> Audit:
    return _audit(request.param, tmp_path_factory.mktemp(f"comm_audit_{request.param}"))


def test_every_axis_moves_what_the_simulator_charged(audit: Audit) -> None:
    wrong = []
    for (case, axis), (predicted, counted) in sorted(audit.figures.items()):
        relative = MOE_TOLERANCE if case.startswith("moe") else 1e-9
        if abs(counted - predicted) > relative * predicted + SCALAR_SLACK_BYTES:
            wrong.append(f"{case} {axis}: predicted {predicted:.0f} B, counted {counted:.0f} B ({counted / max(predicted, 1):.4f}x)")
    assert not wrong, "\n".join(wrong) + "\n" + audit.launch.describe()


def test_every_case_was_audited(audit: Audit) -> None:
    assert {case for case, _ in audit.figures} == set(audit.plans)


def test_ddp_sends_its_gradients_ring_all_reduced(audit: Audit) -> None:
    """Worked by hand: DDP all-reduces every fp32 gradient once per step, 2(n-1)/n of them per device."""
    plan = audit.plans["gpt-ddp"]
    world = plan.world_size
    model = plan.model.build("meta")[0]
    gradient_bytes = 4 * sum(p.numel() for p in model.parameters())
    assert audit.figures[("gpt-ddp", "dp")][1] == pytest.approx(2 * (world - 1) / world * gradient_bytes)
