"""HSDP's plan section and compiled program (``planner/families/hsdp/``).

- The section: saved and read back unchanged; every malformed or hostile ``hsdp.shard`` is
  one line naming the field, read from a file (``PlanFileError``) or checked against a plan
  (``ValueError``: not an fsdp plan on ``dp`` alone, not a divisor of dp, all of dp, wider
  than a node).
- The program is the fsdp program of the plan with its own ``parallelize``: FSDP2's
  ``fully_shard`` on a 2-D ``replicate x shard`` mesh; its comments name only what its code
  calls (negative controls: a "DDP" comment, and the all-reduce claimed without the 2-D mesh).
- In real gloo processes, world 4 as 2 x 2 (one launch): ``launch.py --check`` prints
  ``parity ok``, the step's collectives run in groups of 2 (all-gathers and reduce-scatters
  in the shard groups, all-reduces of the scattered gradients across them, none over the 4
  ranks), and 2 steps train and checkpoint; a second launch resumes that checkpoint on the
  plain fsdp program (dp=4). All 4 losses are those of one device.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import json
import re
import tokenize
from pathlib import Path

import pytest
import torch

import planner
from codegen.emit import render_model_spmd
from codegen.runtime.program import load_program
from codegen.runtime.training_loop import random_like
from planner.cluster import MAX_RANKS, Cluster
from planner.errors import PlanFileError, PlanningError
from planner.families.hsdp.emit import render_hsdp_program
from planner.families.hsdp.section import HsdpSection
from planner.model_loss import extract_loss
from planner.model_spec import ModelSpec
from tests.torchrun_run import torchrun

REPO = Path(__file__).resolve().parents[1]
GPT = ModelSpec(str(REPO / "examples/gpt.py"), {"batch_size": 8})
SOURCE = "plan file 'p.json'"
STEP_LINE = re.compile(r"^step (\d+)/\d+: [\d.]+ ms  loss ([-\d.]+) ", re.M)
# launch.py --comm-audit's line per collective: "  <group>: <count> x <op> (n=<ranks>) <bytes> B".
AUDIT_LINE = re.compile(r"^\s+\S+: (\d+) x (\S+) \(n=(\d+)\) (\d+) B$", re.M)


@pytest.fixture(scope="module")
def fsdp_plan() -> planner.Plan:
    """GPT on 2 nodes of 2 CPU devices as FSDP over dp=4: the plan HSDP 2 x 2 extends."""
    return planner.plan(GPT, "cpu:2x2", dp_flavour="fsdp", precision="fp32")


def compile_hsdp(plan: planner.Plan, section: HsdpSection, folder: Path) -> Path:
    """``plan`` with ``section`` as its ``"hsdp"`` section, compiled into ``folder`` by
    ``planner.compile`` (the family registry gives it to HSDP's emitter)."""
    return planner.compile(dataclasses.replace(plan, sections={"hsdp": section}), folder)


# ------------------------------------------------------------------------------ the section


def test_the_section_round_trips_and_names_itself(fsdp_plan) -> None:
    section = HsdpSection(2)
    saved = json.loads(json.dumps(section.to_json()))
    assert saved == {"shard": 2}
    assert HsdpSection.from_json(saved, SOURCE) == section
    section.check(fsdp_plan)  # 2 divides dp=4, fits a node of 2
    assert section.replicate(fsdp_plan) == 2
    assert section.describe(fsdp_plan) == "hsdp 2 x 2"


@pytest.mark.parametrize(
    ("data", "field", "why"),
    [
        ([2], "hsdp", "must be a JSON object"),
        ("shard=2", "hsdp", "must be a JSON object"),
        ({}, "hsdp.shard", "is missing"),
        ({"shard": 2, "replicate": 2}, "hsdp", "unknown key 'replicate'"),
        ({"shard": True}, "hsdp.shard", "got True"),
        ({"shard": "2"}, "hsdp.shard", "got '2'"),
        ({"shard": 2.0}, "hsdp.shard", "got 2.0"),
        ({"shard": None}, "hsdp.shard", "got None"),
        ({"shard": [2]}, "hsdp.shard", "got [2]"),
        ({"shard": -2}, "hsdp.shard", "got -2"),
        ({"shard": 0}, "hsdp.shard", "got 0"),
        ({"shard": 1}, "hsdp.shard", "got 1"),
        ({"shard": MAX_RANKS + 1}, "hsdp.shard", f"got {MAX_RANKS + 1}"),
        ({"shard": 10**4000}, "hsdp.shard", "got an integer of 13288 bits"),
        ({"shard": "\n\u2028x"}, "hsdp.shard", "got '"),  # escaped: one line (asserted below)
    ],
)
def test_a_malformed_section_is_one_line_naming_the_field(data, field, why) -> None:
    with pytest.raises(PlanFileError) as raised:
        HsdpSection.from_json(data, SOURCE)
    message = str(raised.value)
    assert message.startswith(f"{SOURCE}: field '{field}' ") and why in message, message
    if field == "hsdp.shard" and why.startswith("got"):  # a value: what the field must be
        assert f"must be an integer from 2 to {MAX_RANKS}" in message, message
    assert len(message.splitlines()) == 1 and len(message) < 400, message


@pytest.mark.parametrize("shard", [True, 1, 0, -4, 2.0, "2", None, MAX_RANKS + 1])
def test_a_section_made_in_python_refuses_a_bad_shard(shard) -> None:
    with pytest.raises(ValueError, match=r"^field 'hsdp\.shard' must be an integer from 2 to \d+ .*, got "):
        HsdpSection(shard)


def test_a_section_that_does_not_fit_its_plan_says_which_field_and_the_fix(fsdp_plan) -> None:
    def problem(section: HsdpSection, plan: planner.Plan) -> str:
        with pytest.raises(ValueError) as raised:
            section.check(plan)
        message = str(raised.value)
        assert message.startswith("field 'hsdp.shard' ") and len(message.splitlines()) == 1, message
        return message

    assert "that is plain fsdp" in problem(HsdpSection(4), fsdp_plan)
    assert "does not divide dp=4" in problem(HsdpSection(3), fsdp_plan)
    # Four nodes of one device each: a shard group of 2 would span two nodes.
    one_per_node = dataclasses.replace(fsdp_plan, cluster=Cluster.preset("cpu", nodes=4, devices_per_node=1))
    assert "smallest node of cluster 'cpu' has 1 device(s)" in problem(HsdpSection(2), one_per_node)
    for flavour in ("ddp", "zero1", "zero2"):
        other = dataclasses.replace(fsdp_plan, dp_flavour=flavour)
        assert f"needs an fsdp plan on a mesh of dp alone, without pipeline or expert layouts, but the plan is {flavour} (dp=4)" \
            in problem(HsdpSection(2), other)
    with pytest.raises(PlanningError, match=r"^field 'hsdp\.shard' is 4, all the dp=4 ranks"):
        render_hsdp_program(fsdp_plan, HsdpSection(4))


# ------------------------------------------------------------------------------ the program


def comments_and_code(source: str) -> tuple[str, str]:
    """The ``#`` comments and function docstrings of ``source`` (what it tells a reader about
    itself), and its code with both taken out. The module docstring is left out: it describes
    the interface every data-parallel program shares, not what this one calls."""
    comments = [token.string for token in tokenize.generate_tokens(io.StringIO(source).readline)
                if token.type == tokenize.COMMENT]
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            if not isinstance(node, ast.Module):
                comments.append(body[0].value.value)
            node.body = body[1:] or [ast.Pass()]
    return "\n".join(comments), ast.unparse(tree)


# A word a comment may use -> the calls, one of which the code must make for it to be true.
CLAIMS = {
    "DDP": ("DistributedDataParallel(",),
    "DistributedDataParallel": ("DistributedDataParallel(",),
    "ShardedStatesOptimizer": ("ShardedStatesOptimizer(",),
    "FSDP2": ("fully_shard(",),
    "all-gather": ("fully_shard(",),
    "reduce-scatter": ("fully_shard(",),
    "all-reduce": ("hybrid_mesh(", "DistributedDataParallel(", "synchronise_batch_norm("),
    '"replicate"': ("hybrid_mesh(",),
    '"shard"': ("hybrid_mesh(",),
    "all-to-all": ("all_to_all",),
    "broadcast": ("DistributedDataParallel(", "broadcast("),
}


def untrue_claims(source: str) -> list[str]:
    """The words of ``CLAIMS`` that ``source``'s comments use while its code calls none of
    what would make them true."""
    comments, code = comments_and_code(source)
    return [word for word, calls in CLAIMS.items()
            if word.lower() in comments.lower() and not any(call in code for call in calls)]


def test_the_program_is_the_fsdp_program_with_parallelize_on_a_2d_mesh(fsdp_plan) -> None:
    program = render_hsdp_program(fsdp_plan, HsdpSection(2))
    fsdp = render_model_spmd(fsdp_plan)
    # Header, constants and shard_batch are the fsdp program's; parallelize and the plan's name differ.
    assert program.split("\nfrom torch.distributed.fsdp import")[0] == \
        fsdp.split("\nfrom torch.distributed.fsdp import")[0].replace("# Plan: fsdp (dp=4)", "# Plan: fsdp (dp=4; hsdp 2 x 2)")
    assert program.split("\n# Inputs of one step")[1] == fsdp.split("\n# Inputs of one step")[1]
    _, code = comments_and_code(program)
    units = [f"fully_shard(model.get_submodule({unit!r}), mesh=hsdp_mesh)" for unit in fsdp_plan.fsdp_units]
    assert units and all(unit in code for unit in units)
    assert "fully_shard(model, mesh=hsdp_mesh)" in code and "mesh=dp_mesh" not in code
    assert "hsdp_mesh = hybrid_mesh(dp_mesh, SHARD_GROUP)" in code and "SHARD_GROUP = 2" in code
    compile(program, "model_spmd.py", "exec")


def test_parallelize_prepares_the_model_as_the_fsdp_program_does_before_sharding_it(fsdp_plan) -> None:
    """Recomputation and mixed precision are set up before ``fully_shard`` wraps the model
    (the wrapper's hooks stay outside the recomputed forward), as in the fsdp program."""
    plan = dataclasses.replace(fsdp_plan, recompute="full", precision="bf16")
    program = render_hsdp_program(plan, HsdpSection(2))
    parallelize = program[program.index("def parallelize("):program.index("    return model")]
    fsdp = render_model_spmd(plan)
    for call in ("recompute_in_backward(", "run_in_autocast("):
        assert call in fsdp and call in parallelize, call
        assert parallelize.index(call) < parallelize.index("hybrid_mesh(") < parallelize.index("fully_shard(")
    assert "RECOMPUTED_BLOCKS = (" in program
    assert "from codegen.runtime.precision import BF16_FSDP_POLICY, run_in_autocast" in program
    # bf16: every unit and the root gather bf16 and reduce fp32, as the fsdp program's do.
    for unit in (*(f"model.get_submodule({unit!r})" for unit in plan.fsdp_units), "model"):
        assert f"fully_shard({unit}, mesh=hsdp_mesh, mp_policy=BF16_FSDP_POLICY)" in parallelize, unit
        assert f"fully_shard({unit}, mesh=dp_mesh, mp_policy=BF16_FSDP_POLICY)" in fsdp, unit
    compile(program, "model_spmd.py", "exec")


def test_the_comments_name_only_what_the_code_calls(fsdp_plan) -> None:
    program = render_hsdp_program(fsdp_plan, HsdpSection(2))
    comments, _ = comments_and_code(program)
    for word in ("FSDP2", "all-gather", "reduce-scatter", "all-reduce", '"replicate"', '"shard"'):
        assert word in comments  # the comments say what runs ...
    assert untrue_claims(program) == []  # ... and nothing the code does not call
    # Negative controls: the check finds a wrapper the code does not call (the MoE program's
    # "DDP averages" under fully_shard), and an all-reduce across groups without the 2-D mesh.
    wrong_wrapper = program.replace("    return model\n", "    # DDP averages the gradients.\n    return model\n", 1)
    assert untrue_claims(wrong_wrapper) == ["DDP"]
    without_2d_mesh = program.replace("hybrid_mesh(dp_mesh, SHARD_GROUP)", "dp_mesh")
    assert set(untrue_claims(without_2d_mesh)) == {"all-reduce", '"replicate"', '"shard"'}


# ---------------------------------------------------------------------- in gloo processes


def _losses(text: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in STEP_LINE.findall(text)}


def _one_device_losses(folder: Path, steps: int) -> dict[int, float]:
    """The losses launch.py's loop gives on one device: the same initial weights (built from
    the spec), batches (seed 1000 + step), AdamW and learning rate."""
    model, args, kwargs = load_program(folder).build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = {}
    for step in range(1, steps + 1):
        torch.manual_seed(1000 + step - 1)
        loss = extract_loss(model(*random_like(args), **random_like(kwargs)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = loss.item()
    return losses


@pytest.mark.distributed
def test_hsdp_2x2_matches_one_device_and_resumes_on_plain_fsdp(fsdp_plan, tmp_path) -> None:
    hsdp = compile_hsdp(fsdp_plan, HsdpSection(2), tmp_path / "hsdp")
    fsdp = planner.compile(fsdp_plan, tmp_path / "fsdp")
    saved = tmp_path / "ckpt"

    first = torchrun(4, str(hsdp / "launch.py"), "--check", "--comm-audit", "--steps", "2",
                      "--checkpoint-dir", str(saved), "--save-every", "2", cwd=tmp_path)
    assert "parity ok" in first and "parity FAILED" not in first, first[-3000:]
    # One step's collectives: all in groups of 2 ranks (a shard group, or one rank of each
    # group), none over the 4 ranks of dp. Weights are all-gathered and gradients
    # reduce-scattered in the shard groups, and each rank all-reduces across the groups
    # exactly the gradient shard its reduce-scatter left it: as many bytes, by the audit's
    # conventions (a reduce-scatter sends half its input, an all-reduce of half the input
    # twice half of that).
    audited: dict[str, tuple[int, int]] = {}
    for count, op, ranks, sent in AUDIT_LINE.findall(first):
        assert ranks == "2", first[-3000:]
        audited[op] = (int(count), int(sent))
    assert {"_allgather_base_", "_reduce_scatter_base_", "allreduce_"} <= set(audited), audited
    assert audited["allreduce_"] == audited["_reduce_scatter_base_"], audited
    assert sorted(p.name for p in saved.iterdir()) == ["step-00000002"]

    resumed = torchrun(4, str(fsdp / "launch.py"), "--steps", "4", "--checkpoint-dir", str(saved), "--resume",
                        cwd=tmp_path)
    assert "resumed from" in resumed and "at step 2" in resumed, resumed[-3000:]
    losses = {**_losses(first), **_losses(resumed)}
    assert sorted(_losses(first)) == [1, 2] and sorted(_losses(resumed)) == [3, 4]
    for step, expected in _one_device_losses(fsdp, 4).items():
        assert losses[step] == pytest.approx(expected, abs=1e-5), step
