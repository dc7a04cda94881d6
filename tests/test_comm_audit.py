"""The bytes a compiled program moves equal the bytes its plan's simulator charged.

For each world size, every plan of ``tests/comm_audit_plans.py`` (DDP, ZeRO-1, ZeRO-2, FSDP2,
Megatron tp=2 (with dp=2 at world 4), a graph program of random placements, the search's
plans of the MLP (SOAP on tp, no collective) and, at world 4, of a small HuggingFace llama
(Megatron's layout on tp=4), a 1F1B pipeline
of two stages (with dp=2 at world 4), an expert-parallel MoE, and at world 4 one whose
experts are sharded over their 2 copies each (FSDP2 on the copy groups, counted as
``expert-copies``); DDP, FSDP and Megatron again
with gradients accumulated over two micro-batches) is compiled and run for one
training step in ONE torchrun launch of ``tests/comm_audit_many.py``, with every collective
counted per mesh axis (``codegen.runtime.comm_audit``). Per axis, the bytes the busiest rank
sent must equal the plan's ``SimResult.bytes_per_axis``:

- exactly (relative 1e-9) for every collective the plan decides: gradient buckets, FSDP
  gathers and reduce-scatters (the expert copies' too), ZeRO's broadcasts, tensor-parallel
  all-reduces, pipeline sends;
- plus ``SCALAR_SLACK_BYTES`` for the scalars a program shares to run at all and which no
  plan prices (a pipeline broadcasts its loss from the last stage, 2 B per device; a graph
  program all-reduces its loss and token count over dp, 20 B);
- within ``MOE_TOLERANCE`` on the MoE plan's axis: its all-to-alls send the tokens the step
  actually routed (the busiest rank's share), where the simulator assumes the uniform routing
  it was given; at worlds 2 and 4 the axis measured 0.997x and 1.011x;
- within ``COPIED_ALL_TO_ALL_TOLERANCE`` on dp of the MoE plan whose experts have 2 copies:
  besides the routing, a copy's slots are filled in the batch's order, so a rank's choices
  land mostly in its own copy and stay on it, which the simulator's all-to-all (every copy
  leaves its rank with probability (n-1)/n) does not see: 1.062x at world 4.

``KNOWN_GAPS`` are axes where the program moves more than the plan says, for reasons the
simulator cannot see today: DTensor's own sharding propagation gathers inside an op where the
plan keeps a value split (the fused QKV projection's ``split``, the vocabulary-parallel
``cross_entropy``, which gathers the whole logits: 6.1 of the searched llama's 7.4 MB;
``codegen.spmd_emit`` says so in a comment at each), ops whose random placements DTensor
runs through another strategy, and DTensor on gloo running an all-to-all as an all-gather. There the program must still move at least the
predicted bytes (every priced collective runs), and the gap is printed by
``benchmarks/comm_audit.py``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from comm_audit_plans import plans
from test_parity import Launch, _run

import planner

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).resolve().with_name("comm_audit_many.py")
REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT = 300  # seconds; a launch takes ~10 s on 2 cores, the limit only stops a hang
SCALAR_SLACK_BYTES = 64.0
MOE_TOLERANCE = 0.02
COPIED_ALL_TO_ALL_TOLERANCE = 0.08
WORLD_SIZES = (2, 4)
KNOWN_GAPS = {("gpt-megatron-tp2", "tp"), ("gpt-megatron-tp2-accum2", "tp"), ("mlp-random", "tp"), ("llama-searched", "tp")}


@dataclass
class Audit:
    """One launch's AUDIT lines: {(case, axis): (predicted, counted)}, and the launch."""

    figures: dict[tuple[str, str], tuple[float, float]]
    launch: Launch
    plans: dict[str, planner.Plan]
    folders: dict[str, Path]


def _audit(world: int, root: Path) -> Audit:
    chosen = plans(world)
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
    return Audit(figures, launch, chosen, folders)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda world: f"world{world}")
def audit(request, tmp_path_factory) -> Audit:
    return _audit(request.param, tmp_path_factory.mktemp(f"comm_audit_{request.param}"))


def test_every_axis_moves_what_the_simulator_charged(audit: Audit) -> None:
    wrong = []
    for (case, axis), (predicted, counted) in sorted(audit.figures.items()):
        if (case, axis) in KNOWN_GAPS:
            continue  # test_known_gaps_move_at_least_the_predicted_bytes
        relative = MOE_TOLERANCE if case.startswith("moe") and axis == "dp" else 1e-9
        if (case, axis) == ("moe-ep-sharded-copies", "dp"):
            relative = COPIED_ALL_TO_ALL_TOLERANCE
        if abs(counted - predicted) > relative * predicted + SCALAR_SLACK_BYTES:
            wrong.append(f"{case} {axis}: predicted {predicted:.0f} B, counted {counted:.0f} B ({counted / max(predicted, 1):.4f}x)")
    assert not wrong, "\n".join(wrong) + "\n" + audit.launch.describe()


def test_known_gaps_move_at_least_the_predicted_bytes(audit: Audit) -> None:
    for case, axis in sorted(KNOWN_GAPS):
        if case not in audit.plans:
            continue  # a world-4 case
        predicted, counted = audit.figures[(case, axis)]
        assert predicted > 0 and counted >= predicted, f"{case} {axis}: predicted {predicted:.0f} B, counted {counted:.0f} B"


def test_every_case_was_audited(audit: Audit) -> None:
    assert {case for case, _ in audit.figures} == set(audit.plans)


def test_ddp_sends_its_gradients_ring_all_reduced(audit: Audit) -> None:
    """Worked by hand: DDP all-reduces every fp32 gradient once per step, 2(n-1)/n of them per device."""
    plan = audit.plans["gpt-ddp"]
    world = plan.world_size
    model = plan.model.build("meta")[0]
    gradient_bytes = 4 * sum(p.numel() for p in model.parameters())
    assert audit.figures[("gpt-ddp", "dp")][1] == pytest.approx(2 * (world - 1) / world * gradient_bytes)


def test_launch_prints_the_audit(audit: Audit) -> None:
    """``launch.py --comm-audit``, as a user runs it: the table's row for dp says 1.0000."""
    folder, world = audit.folders["gpt-zero1"], audit.plans["gpt-zero1"].world_size
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), str(folder / "launch.py"), "--comm-audit"]
    launch = _run(command, cwd=REPO, timeout=LAUNCH_TIMEOUT)
    assert launch.returncode == 0, launch.describe()
    predicted = audit.plans["gpt-zero1"].estimate.bytes_per_axis["dp"]
    rows = [line.split() for line in launch.stdout.splitlines() if line.startswith("dp ")]
    assert rows == [["dp", f"{predicted:.0f}", f"{predicted:.0f}", "1.0000"]], launch.describe()
    assert f"x broadcast_ (n={world})" in launch.stdout and f"x allreduce_ (n={world})" in launch.stdout, launch.describe()
