"""A HuggingFace MoE decoder whose experts run expert parallel inside pipeline stages trains,
clips, checkpoints and resumes on another MoE layout exactly like one device.

(The parity of one step of these programs, tiny Mixtral and DeepSeek-V3 on pp2 x dp4 and
Qwen3-MoE folded on pp2 x dp2 x tp2, is in ``test_pipeline_parity.py``'s world-8 launch.)

Tiny ``hf:mixtral`` (2 layers, hidden 32, 4 experts, top-2) on ``pp=2 x dp=2`` (world 4,
two micro-batches under 1F1B), expert 0 copied on both dp ranks of each stage, trains 2 steps
with ``--clip-grad-norm`` and saves; a data-parallel HF MoE program (world 2, expert 0 copied
on both ranks, no pipeline) resumes that checkpoint for 2 more. Every step's gradient norm
(expert 0 counted once over its copies, each stage's weights once over its dp ranks) and loss
equal one device's loop with torch's clipping, and the last checkpoint, exported whole, loads
strictly into the model built from the spec with one device's weights.
"""

from __future__ import annotations

import json

import pytest
import torch

import planner
from codegen.runtime.checkpoint import export_checkpoint
from codegen.runtime.launcher import random_like
from codegen.runtime.pipeline_parity import micro_batch_loss
from codegen.runtime.program import load_program
from planner.model_spec import ModelSpec
from moe_plans import HF_MOE, hf_moe_plan, moe_pipeline_plan, with_copied_expert
from test_checkpoint import _losses, _ok, _torchrun

pytestmark = pytest.mark.distributed

WORLD = 4  # the smallest pipeline with expert parallelism in its stages (4 processes start faster than 8)
STEPS = 4  # 2 in the pipeline, 2 resumed without it
CLIP = 0.05  # below every step's norm on one device (checked in the test), so clipping acts each step


def _single_device(folder) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Losses, gradient norms (before clipping) and the final weights of launch.py's loop on
    one device with torch's clipping: same init, batches (seeded 1000 + step), the
    pipeline's micro-batches (dropless routing: the same loss as the whole batch), AdamW at
    lr 1e-3."""
    program = load_program(folder)
    model, args, kwargs = program.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, norms = [], []
    for step in range(STEPS):
        torch.manual_seed(1000 + step)
        loss = micro_batch_loss(model, random_like(args), random_like(kwargs), program.plan.mesh.axis_size("dp"),
                                program.plan.pipeline.micro_batches)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, {name: value.detach() for name, value in model.state_dict().items()}


def test_clipped_steps_checkpoint_and_resume_without_the_pipeline_as_one_device(tmp_path):
    plan = with_copied_expert(moe_pipeline_plan(ModelSpec("hf:mixtral", HF_MOE["mixtral"]), WORLD))
    assert plan.pipeline is not None and all(layout.mode == "expert_parallel" for layout in plan.expert_layouts)
    pipeline = planner.compile(plan, tmp_path / "pipeline")
    source = (pipeline / "model_spmd.py").read_text()
    # the stacked experts run by the layout (one block function serves both layers); the router stays a traced op
    assert "= self.moe_experts(" in source and "transformers.grouped_mm" not in source, source
    data_parallel = planner.compile(hf_moe_plan(2, "mixtral", "expert_parallel", "skewed"), tmp_path / "dp2")
    losses, norms, weights = _single_device(pipeline)
    assert min(norms) > CLIP  # clipping acted on every step: a wrong norm changes the losses too

    saved = tmp_path / "checkpoints"
    flags = ("--clip-grad-norm", str(CLIP), "--metrics", "metrics.jsonl", "--checkpoint-dir", str(saved))
    first = _losses(_ok(_torchrun(WORLD, str(pipeline / "launch.py"), "--steps", "2", *flags, cwd=tmp_path)))
    resumed = _losses(_ok(_torchrun(2, str(data_parallel / "launch.py"), "--steps", str(STEPS), "--resume", *flags,
                                    cwd=tmp_path)))
    assert sorted(first) == [1, 2] and sorted(resumed) == [3, 4]
    assert [first[1], first[2], resumed[3], resumed[4]] == pytest.approx(losses, rel=1e-5, abs=1e-5)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 2, 3, 4]
    assert [record["grad_norm"] for record in records] == pytest.approx(norms, rel=1e-5)
    assert [record["loss"] for record in records] == pytest.approx(losses, rel=1e-5, abs=1e-6)

    exported = tmp_path / "whole.pt"
    assert export_checkpoint(saved / "step-00000004", exported)[0] == STEPS
    whole = torch.load(exported, weights_only=True)
    model = load_program(pipeline).build_model()[0]
    model.load_state_dict(whole)  # strict: every name of the model built from the spec
    # AdamW moves a weight whose gradient is near eps by ~lr whatever its last bits (see
    # codegen/runtime/parity.py): the weights agree to lr / 10.
    for name, value in weights.items():
        torch.testing.assert_close(whole[name], value, atol=1e-4, rtol=0, msg=name)
