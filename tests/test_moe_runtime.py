"""MoE layers at run time (``codegen.runtime.moe``, ``codegen.runtime.moe_modes``) against
``examples/moe.py``'s MoE layer on one device: the same routing, the same drops, the same
balance loss; outputs, loss, and the gradients of the router and of every expert (gathered by
each layer's ``full_parameters``) equal, at worlds 2 and 4, in each mode: expert parallel
with round-robin experts and with two experts copied on two ranks each (unequal shares),
data parallel, and expert-sliced; at capacity factors 1.25 and 0.5 (drops) and dropless;
and with each rank's loss a mean over its own tokens (``rank_losses_averaged``: expert
gradients scaled and copies summed in backward), also with every expert on rank 0 (the
other ranks hold none), and with rows moved by the two-level all-to-all
(``codegen.runtime.moe_exchange``: nodes of two ranks at world 4, of one at world 2). One launch per world
(``tests/moe_parity_worker.py``). The control skips summing the copies' gradients and must
fail. The same launch steps a multi-tensor AdamW over plain weights and experts sharded over
their copies (``codegen.runtime.expert_copies``) in separate groups."""

from __future__ import annotations

import re

import pytest

from test_parity import REPO, run_ranks

pytestmark = pytest.mark.distributed
CAPACITIES = (1.25, 0.5, 0.0)
CASES = [f"{layout} capacity {capacity}" for layout in ("round-robin", "copied", "data_parallel", "expert_sliced")
         for capacity in CAPACITIES]
CASES += ["copied capacity 1.25, averaged rank losses", "expert_sliced capacity 0.5, averaged rank losses",
          "one rank capacity 0.5, averaged rank losses",
          "round-robin capacity 0.5, two-level all-to-all", "copied capacity 0.5, two-level all-to-all"]
CONTROL = "copied capacity 1.25, copies not summed (control)"


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def results(request):
    world = request.param
    run = run_ranks(world, REPO / "tests/moe_parity_worker.py", [], REPO, 600, {"PYTHONPATH": str(REPO)})
    found = dict(re.findall(r"^RESULT (.+?): (.*)$", run.stdout, re.MULTILINE))
    assert run.returncode == 0 and len(found) == len(CASES) + 3, run.stdout[-2000:] + run.stderr[-3000:]
    return found


@pytest.mark.parametrize("case", CASES)
def test_expert_parallel_step_equals_one_device(results, case):
    assert results[case].startswith("ok worst"), f"{case}: {results[case]}"


def test_capacity_drops_choices_and_dropless_does_not(results):
    dropped = {case: float(results[case].rsplit(" ", 1)[1]) for case in CASES}
    for layout in ("round-robin", "copied", "data_parallel", "expert_sliced"):
        assert dropped[f"{layout} capacity 0.5"] > 0.1 and dropped[f"{layout} capacity 0.0"] == 0.0


def test_copies_must_have_their_gradients_summed(results):
    assert results[CONTROL].startswith("FAILED worst expert"), results[CONTROL]


def test_two_level_all_to_all_delivers_what_the_flat_one_does(results):
    assert results["two-level all-to-all equals flat"].startswith("ok"), results["two-level all-to-all equals flat"]


def test_sharded_experts_take_a_foreach_step_in_their_own_group(results):
    assert results["sharded experts foreach step"].startswith("ok"), results["sharded experts foreach step"]
