"""What a fidelity row's norms cost as the traced eager program runs them, and as one fused
kernel each (``Plan.fused_chains``, ``cost_model.fused_chains``), module by module; then the
row simulated with its norms fused, and with its norms and rotary embeddings fused: a what-if,
not a change to any row's prediction (``python benchmarks/fidelity.py --fused-chains norms_rope``
gives the same re-simulated rows with the fidelity table's columns).

    python benchmarks/fused_norm_whatif.py --runs 'Qwen3-235B-*'

Why: the Qwen3 rows trace transformers' eager ``Qwen3MoeRMSNorm`` (``hidden_states.to(float32)``,
``pow(2)``, ``mean``, ``+ eps``, ``rsqrt``, ``*``, ``.to(bf16)``, ``weight *``: ten ATen ops,
each a kernel that streams the whole tensor), and the simulator prices each of them
(``cost_model.memory_kernels``). The runs they stand for ran Megatron-Core with Transformer
Engine, whose RMSNorm is one kernel (``TENorm``, TransformerEngine
transformer_engine/pytorch/module/rmsnorm.py), for the block's two norms and for the q/k norms
alike. Public measurements put the eager chain far above one fused kernel: Liger-Kernel's
eager Hugging Face RMSNorm against its fused one (linkedin/Liger-Kernel
benchmark/data/all_benchmark_data.csv at ead96b61, "rms_norm", A100-SXM4-80GB, bf16, M 2,048,
H 4,096: forward 0.2799 ms against 0.0311 ms, 9.0x; forward and backward 1.0114 ms against
0.2883 ms, 3.5x).

For each run: the simulator's own costs (one micro-batch on one device) of every op of a
block's norm modules, against the fused kernel ``cost_model.fused_chains`` prices in their
place; both times the forwards a pass runs (two where the plan recomputes the block, or the
block's own norms under ``norms_moe_act``), the backward, the blocks of the busiest pipeline
rank and the micro-batches. That difference is compute-stream time only; the re-simulated
rows also move what the shorter compute slows beside collectives and hides of the EP
overlap's exchanges. Only the time is re-priced: the saved activations stay as traced.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import Counter, defaultdict
from dataclasses import dataclass

from cost_model.fused_chains import chain_kernels, fused_kernel_times
from cost_model.op_share import work_split
from cost_model.segments import is_block_norm
from cost_model.simulator import Simulator
from planner.graph import OpNode
from planner.strategy import NORMS_MOE_ACT, WHOLE_BLOCK_RECOMPUTE

try:  # run as a script (python benchmarks/fused_norm_whatif.py) or imported as benchmarks.fused_norm_whatif
    from benchmarks.fidelity import simulate
    from benchmarks.fidelity_runs import chosen_runs
except ModuleNotFoundError:  # pragma: no cover - the script's own folder is on sys.path instead
    from fidelity import simulate
    from fidelity_runs import chosen_runs


@dataclass(frozen=True)
class NormCost:
    """Seconds of one norm module for one micro-batch on one device, as traced and as fused;
    ``block_norm``: one of the block's own norms (``cost_model.segments.is_block_norm``), which
    ``norms_moe_act`` recomputes, not one nested deeper (Qwen3's q_norm and k_norm)."""

    module: str
    block_norm: bool
    eager_forward_s: float
    eager_backward_s: float
    fused_forward_s: float
    fused_backward_s: float


def forwards_per_pass(recompute: str, block_norm: bool) -> int:
    """How often a norm runs forward per micro-batch: twice where its block is recomputed
    whole (``full``, ``full_keep_a2a``), or where it is one of the block's own norms and those
    are recomputed (``norms_moe_act``: Megatron-Core's ``--recompute-modules layernorm``, the
    input and pre-MLP norms), else once (``selective`` recomputes only core attention)."""
    if recompute in WHOLE_BLOCK_RECOMPUTE or (recompute == NORMS_MOE_ACT and block_norm):
        return 2
    return 1


def step_seconds(forward_s: float, backward_s: float, forwards: int, blocks: int, micro_batches: int) -> float:
    """Seconds a step spends in a norm of ``forward_s`` / ``backward_s`` a micro-batch run
    forward ``forwards`` times a pass, over ``blocks`` blocks and ``micro_batches`` micro-batches."""
    return (forwards * forward_s + backward_s) * blocks * micro_batches


def norm_costs(simulator: Simulator, block: str, block_nodes: list[str]) -> list[NormCost]:
    """The eager and fused cost of each norm module among ``block_nodes`` (the block segment
    named ``block``): its ops as the simulator priced them, and the fused kernel
    ``cost_model.fused_chains`` prices in their place."""
    context = simulator.context
    kernels = chain_kernels(context.graph, "norms")
    members: dict[str, list[OpNode]] = defaultdict(list)
    for name in block_nodes:
        if name in kernels:
            members[context.nodes[name].module].append(context.nodes[name])
    found = []
    for module, ops in members.items():
        eager_forward = sum(simulator.costs[op.name].forward_s for op in ops)
        eager_backward = sum(simulator.costs[op.name].backward_s for op in ops)
        carrier = next(op for op in ops if kernels[op.name] is not None)
        work = 1.0 / (work_split(context.mesh, context.strategies[carrier.name]) * context.micro_batches)
        fused_forward, fused_backward = fused_kernel_times(kernels[carrier.name], work, context.device,
                                                           context.plan.precision)
        found.append(NormCost(module, is_block_norm(ops[0], block), eager_forward, eager_backward,
                              fused_forward, fused_backward))
    return found


def busiest_rank_blocks(segments, pp: int) -> tuple[int, list]:
    """(blocks on the pipeline rank holding the most, one of its block segments): virtual
    stage ``v`` runs on rank ``v % pp`` (Megatron-LM's interleaved order)."""
    blocks = [segment for segment in segments if segment.block]
    per_rank = Counter(segment.stage % pp for segment in blocks)
    rank, count = per_rank.most_common(1)[0]
    middle = [segment for segment in blocks if segment.stage % pp == rank]
    return count, middle[len(middle) // 2]


def report(run) -> list[str]:
    """The printed lines of one run: the step's norm seconds eager and fused, then each norm."""
    plan, _ = simulate(dataclasses.replace(run, fused_chains=""))  # every traced op priced, whatever the row's default
    simulator = Simulator(plan, plan.graph)
    micro_batches = simulator.context.micro_batches
    blocks, segment = busiest_rank_blocks(simulator.segments(), simulator.context.pp)
    recompute = plan.recompute_at(segment.stage)
    costs = norm_costs(simulator, segment.name, segment.nodes)
    if not costs:
        return [f"{run.name}: no norm module of more than one kernel in its blocks"]
    forwards = {c.module: forwards_per_pass(recompute, c.block_norm) for c in costs}
    eager = sum(step_seconds(c.eager_forward_s, c.eager_backward_s, forwards[c.module], blocks, micro_batches)
                for c in costs)
    fused = sum(step_seconds(c.fused_forward_s, c.fused_backward_s, forwards[c.module], blocks, micro_batches)
                for c in costs)
    step = plan.estimate.step_time_s
    resimulated = [simulate(dataclasses.replace(run, fused_chains=setting))[0].estimate.step_time_s
                   for setting in ("norms", "norms_rope")]
    published = run.published_step_s
    lines = [f"{run.name}: {blocks} blocks x {micro_batches} micro-batches, recompute {recompute}; norms eager "
             f"{eager:.2f} s, fused {fused:.2f} s a step; predicted {step:.2f} s ({step / published - 1:+.1%}), "
             f"less the difference {step - eager + fused:.2f} s, re-simulated with fused norms {resimulated[0]:.2f} s "
             f"({resimulated[0] / published - 1:+.1%}), norms and RoPE {resimulated[1]:.2f} s "
             f"({resimulated[1] / published - 1:+.1%}); published {published:.2f} s"]
    for c in costs:
        lines.append(f"  {c.module.rsplit('.', 1)[-1]:<26} x{forwards[c.module]} forward; eager forward "
                     f"{c.eager_forward_s * 1e3:7.3f} ms backward {c.eager_backward_s * 1e3:7.3f} ms; fused forward "
                     f"{c.fused_forward_s * 1e3:7.3f} ms backward {c.fused_backward_s * 1e3:7.3f} ms")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", required=True,
                        help="run names or shell patterns (fidelity.py --rows-only)")
    options = parser.parse_args(argv)
    chosen = chosen_runs(parser, options.runs)
    for run in chosen:
        print("\n".join(report(run)), flush=True)


if __name__ == "__main__":
    main()
