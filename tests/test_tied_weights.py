"""A weight tied between the token embedding and the output layer is one tensor: the optimizer
steps it once (``cost_model.step_memory.device_parameters``), and llm-foundry's MPT rows are
built tied, as ``MPTForCausalLM`` requires (``benchmarks/fidelity_runs._mpt``)."""

from __future__ import annotations

import types
from pathlib import Path

from cost_model.segments import Segment
from cost_model.step_contributor import ParameterSharding
from cost_model.step_memory import device_parameters, optimizer_state_bytes
from planner.model_spec import ModelSpec

try:
    from benchmarks.fidelity_runs import runs
except ModuleNotFoundError:  # pragma: no cover
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from fidelity_runs import runs

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _segment(name: str, params: dict[str, float], block: bool = False) -> Segment:
    segment = Segment(name=name, stage=0, block=block)
    segment.params.update(params)
    return segment


def test_a_tied_weight_read_by_two_segments_is_stepped_once():
    # The embedding segment and the output segment both read "wte.weight" (1000 elements);
    # a block holds 300 more and the final norm 200. Held once: 1000 + 300 + 200 = 1500
    # elements; sharded over 4 ranks, 375 per rank, each with bf16 weight and gradient and
    # fp32 master weight and two moments: 2 + 2 + 12 = 16 bytes -> 375 x 16 = 6000 bytes.
    # (Counted once per segment it would be 2500 / 4 x 16 = 10000.)
    segments = [_segment("pre", {"wte.weight": 1000.0}), _segment("block 0", {"blocks.0.w": 300.0}, block=True),
                _segment("post", {"ln_f.weight": 200.0, "wte.weight": 1000.0})]
    context = types.SimpleNamespace(plan=types.SimpleNamespace(precision="bf16"))
    assert optimizer_state_bytes(context, segments, ParameterSharding(weights=4, gradients=4, states=4)) == 6000.0
    held = device_parameters(segments)
    assert held.params == {"wte.weight": 1000.0, "blocks.0.w": 300.0, "ln_f.weight": 200.0}


def test_mpt_rows_are_built_tied_with_the_parameters_llm_foundry_counts():
    # MPT-7B as the benchmark yaml builds it (d_model 4096, 32 layers, vocabulary 50,368,
    # learned positions over 2048 tokens, biases everywhere, tied output layer):
    #   per block: Wqkv 4096 x 12288 + 12288, out_proj 4096^2 + 4096, up 4096 x 16384 + 16384,
    #   down 16384 x 4096 + 4096, two norms 2 x 2 x 4096 = 12 x 4096^2 + 13 x 4096 = 201,379,840;
    #   x 32 = 6,444,154,880; token embedding 50,368 x 4096 = 206,307,328; positions
    #   2048 x 4096 = 8,388,608; final norm 8192: 6,658,859,008 (untied: + 206,307,328).
    run = next(run for run in runs() if run.name == "MPT-7B@8xA100")
    assert run.overrides["tie_weights"] is True
    spec = ModelSpec(str(EXAMPLES / run.example), run.overrides).resolved()
    model, _, _ = spec.build("meta")
    assert sum(p.numel() for p in model.parameters()) == 6_658_859_008
