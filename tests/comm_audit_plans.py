"""The plans whose collectives ``tests/test_comm_audit.py`` counts: one per way the compiled
programs communicate, on small example models, each with the simulator's own prediction.

Importable by the test and by ``benchmarks/comm_audit.py`` (which prints the table)."""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import planner
from planner import baselines
from planner.api import prepare_model
from planner.model_spec import ModelSpec

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

GPT = {"batch_size": 8, "n_layer": 2}
# An odd width: ZeRO-1 steps the weights with no dimension dp divides whole and gathers only
# the others (planner.sharded_states_layout).
ODD_GPT = {"batch_size": 8, "n_layer": 1, "n_head": 3, "n_embd": 63}
MLP = {"batch_size": 8}


def _spec(source: str, overrides: dict) -> ModelSpec:
    return ModelSpec(source if source.startswith("hf:") else str(REPO / source), overrides)


def _resimulated(plan: planner.Plan) -> planner.Plan:
    """``plan`` with the simulator's estimate of the plan as it is now (after a test edited it)."""
    return dataclasses.replace(plan, estimate=planner.simulate(plan))


def random_layout(world: int) -> planner.Plan:
    """A graph program of the MLP whose every op's placements were drawn at random
    (``test_spmd_parity.random_placements``): resharding between almost every pair of ops."""
    from test_spmd_parity import random_placements

    graph, spec, name, cluster = prepare_model(_spec("examples/mlp.py", MLP), f"cpu:1x{world}")
    from search.megatron import megatron_plan

    base = megatron_plan(graph, cluster, spec, name, tp=world, precision="fp32")
    return _resimulated(random_placements(base, graph, random.Random(2)))


def moe_expert_parallel(world: int) -> planner.Plan:
    """``examples/moe.py`` (4 experts) with each MoE layer expert parallel over dp, round robin, DDP."""
    from moe_plans import moe_plan

    return _resimulated(moe_plan(world, "expert_parallel", placement="round-robin"))


def moe_keeping_exchanges(world: int) -> planner.Plan:
    """``moe_expert_parallel`` with every block recomputed in backward keeping its MoE layers'
    exchanges (``full_keep_a2a``): the recomputation sends nothing, so the step moves what
    the plan without recomputation moves, as the simulator prices it."""
    from moe_plans import moe_plan

    return _resimulated(moe_plan(world, "expert_parallel", placement="round-robin", recompute="full_keep_a2a"))


def hf_moe_bf16(world: int) -> planner.Plan:
    """Tiny ``hf:mixtral`` with its stacked experts expert parallel over dp (round robin) in
    bf16: its all-to-alls move bf16 rows, as priced (``codegen.runtime.expert_dispatch``)."""
    from moe_plans import hf_moe_plan

    return _resimulated(hf_moe_plan(world, "mixtral", "expert_parallel", "round-robin", precision="bf16"))


def moe_sharded_copies(world: int, precision: str = "fp32") -> planner.Plan:
    """``examples/moe.py`` (4 experts) expert parallel over dp, every expert on 2 ranks and
    sharded over them (FSDP2 on the copy groups), DDP; in bf16 the copies gather bf16 weights
    and reduce-scatter fp32 gradients (``planner.program_shape.shards_expert_copies_in_bf16``)."""
    from moe_plans import moe_plan

    return _resimulated(moe_plan(world, "expert_parallel", placement="grid", precision=precision,
                                 sharded_copies=True))


# The searched plan of test_search_parity's small HuggingFace llama on 4 devices: Megatron's
# layout on tp=4, a vocabulary-parallel loss included.
HF_LLAMA = {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
            "num_key_value_heads": 4}


def plans(world: int) -> dict[str, planner.Plan]:
    """{case name: plan} of one world size."""
    cluster = f"cpu:1x{world}"
    gpt = _spec("examples/gpt.py", GPT)
    cases = {
        "mlp-ddp": baselines.ddp(_spec("examples/mlp.py", MLP), cluster),
        "gpt-ddp": baselines.ddp(gpt, cluster),
        "gpt-zero1": baselines.zero(gpt, cluster, stage=1),
        "gpt-odd-zero1": baselines.zero(_spec("examples/gpt.py", ODD_GPT), cluster, stage=1),
        "gpt-zero2": baselines.zero(gpt, cluster, stage=2),
        "gpt-fsdp": baselines.fsdp(gpt, cluster),
        # bf16 programs: ZeRO-2's FSDP2 units gather bf16 and reduce-scatter fp32 gradients
        # (codegen.runtime.precision.BF16_FSDP_POLICY); DDP all-reduces fp32 gradients.
        "gpt-zero2-bf16": baselines.zero(gpt, cluster, stage=2, precision="bf16"),
        "gpt-ddp-bf16": baselines.ddp(gpt, cluster, precision="bf16"),
        "gpt-megatron-tp2": baselines.megatron(gpt, cluster, tp=2, precision="fp32"),
        "mlp-random": random_layout(world),
        "gpt-pp2-1f1b": baselines.megatron(gpt, cluster, pp=2, micro_batch=2, schedule="1f1b", precision="fp32"),
        "moe-ep": moe_expert_parallel(world),
        "moe-ep-keep-a2a": moe_keeping_exchanges(world),
        # What the search picks for the MLP: a SOAP layout on tp whose ops need no collective.
        "mlp-searched": planner.plan(_spec("examples/mlp.py", {}), cluster, progress=False),
    }
    if world == 4:
        # At world 2 the copy pair is the whole dp group (one process group): counted as dp.
        cases["moe-ep-sharded-copies"] = moe_sharded_copies(world)
        cases["moe-ep-sharded-copies-bf16"] = moe_sharded_copies(world, "bf16")
        cases["moe-hf-mixtral-bf16"] = hf_moe_bf16(world)  # world 2 measured 0.980x, at the tolerance's edge
        cases["llama-searched"] = planner.plan(_spec("hf:llama", HF_LLAMA), cluster, progress=False)
        # A graph program's ZeRO-1: DTensor weights on dp=2 x tp=2, each rank's tp shard sliced over dp.
        cases["gpt-megatron-tp2-zero1"] = baselines.megatron(gpt, cluster, tp=2, precision="fp32", dp_flavour="zero1")
    # Gradient accumulation over two micro-batches: DDP reduces once (no_sync), FSDP2 gathers
    # and reduce-scatters every micro-batch, a graph program reduces in every backward.
    for case in ("gpt-ddp", "gpt-fsdp", "gpt-megatron-tp2"):
        cases[f"{case}-accum2"] = _resimulated(dataclasses.replace(cases[case], accumulation_steps=2))
    return cases


if __name__ == "__main__":
    world, root = int(sys.argv[1]), Path(sys.argv[2])
    for case, plan in plans(world).items():
        planner.compile(plan, root / case, force=True)
        print(root / case)
