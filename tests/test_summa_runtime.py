"""2-D SUMMA, 2.5-D and 3-D matmuls at run time (``codegen.runtime.summa``) against one device:
a single product [T, K] x [K, N] and a GPT MLP block (LayerNorm -> Linear -> GELU -> Linear ->
residual) in the block layout; output, loss, input gradient and every weight gradient equal at
1e-5. World 4 is a 2 x 2 grid (2-D); world 8 a 2 x 2 x 2 grid run as 2.5-D (d = 2) and as 3-D
(q = 2), the 3-D product also keeping its gathered operands for the backward. One launch per world (``tests/summa_parity_worker.py``). The controls skip the
all-reduce of replicated shards' gradients (norm and bias chunks, 2.5-D's weight blocks over
depth) and must fail."""

from __future__ import annotations

import functools
import re

import pytest
from test_parity import REPO, run_ranks

pytestmark = pytest.mark.distributed
CASES = {4: ["2d matmul", "2d mlp"], 8: ["2.5d matmul", "2.5d mlp", "3d matmul", "3d mlp", "3d matmul, gathers kept"]}
CONTROLS = {4: ["2d mlp, replica gradients not summed (control)"],
            8: ["2.5d mlp, replica gradients not summed (control)", "2.5d matmul, depth all-reduce skipped (control)"]}


@functools.cache
def launch(world: int) -> dict[str, str]:
    """One launch of the worker at ``world`` ranks (``test_parity.run_ranks``): {case: verdict},
    every case present."""
    run = run_ranks(world, REPO / "tests/summa_parity_worker.py", [], REPO, 600, {"PYTHONPATH": str(REPO)})
    found = dict(re.findall(r"^RESULT (.+?): (.*)$", run.stdout, re.MULTILINE))
    expected = CASES[world] + CONTROLS[world]
    assert run.returncode == 0 and sorted(found) == sorted(expected), run.stdout[-2000:] + run.stderr[-3000:]
    return found


@pytest.mark.parametrize("world,case", [(world, case) for world, cases in CASES.items() for case in cases])
def test_block_layout_equals_one_device(world, case):
    verdict = launch(world)[case]
    assert verdict.startswith("ok worst"), f"{case}: {verdict}"


@pytest.mark.parametrize("world,control", [(world, case) for world, cases in CONTROLS.items() for case in cases])
def test_skipping_the_replica_gradient_reduction_fails(world, control):
    # Wrong by far more than rounding, and in a gradient, not in the forward pass.
    verdict = launch(world)[control]
    assert verdict.startswith("FAILED worst") and " grad " in verdict, f"{control}: {verdict}"
    assert float(verdict.rsplit(" ", 1)[1]) > 1e-2, f"{control}: {verdict}"
