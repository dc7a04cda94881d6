"""What a fidelity row's RMSNorms (and rotary embeddings) cost as the traced eager program runs
them, and what they would cost as one fused kernel each: a what-if, not a change to any row's
prediction.

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

For each run: the simulator's own costs (one micro-batch on one device) of every op inside a
block's ``*norm`` module, against one ``aten.rms_norm`` op of the same input as the simulator
prices a fused norm (``cost_model.memory_kernels.FUSED_NORM_EFFICIENCY``); both times the
forwards a pass runs (two where the plan recomputes the block, or the block's own norms under
``norms_moe_act``), the backward, the blocks of the busiest pipeline rank and the
micro-batches. That difference is compute-stream
time only; the row is then simulated again with each norm (the blocks' and the final one)
priced as the fused kernel on one op and nothing on its others (``norms_fused``), which also
moves what the shorter compute slows beside collectives and hides of the EP overlap's
exchanges; and once more with each rotary embedding also one kernel (``rope_chains``:
transformers' eager ``apply_rotary_pos_emb``, five kernels for q and five for k, where
Megatron-Core runs Transformer Engine's fused RoPE by default). Only the time is re-priced: the
saved activations stay as traced.
"""

from __future__ import annotations

import argparse
import contextlib
from collections import Counter, defaultdict
from dataclasses import dataclass

import cost_model.moe_overlap
import cost_model.node_costs
from cost_model.compute import op_times
from cost_model.op_share import work_split
from cost_model.segments import is_block_norm
from cost_model.simulation_cache import RECENTLY_COSTED, graph_facts
from cost_model.simulator import Simulator
from planner.graph import OpNode, TensorMeta
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


def fused_norm_node(first: OpNode, weight: TensorMeta | None) -> OpNode:
    """One ``aten.rms_norm`` op reading what the eager chain's first op reads (``first``'s
    first input) and the weight, writing a tensor of that shape and dtype: the bytes one fused
    kernel moves (input, output, weight)."""
    x = first.input_meta[0]
    inputs = (x,) if weight is None else (x, weight)
    moved = 2 * x.numel * x.dtype.itemsize + (0 if weight is None else weight.numel * weight.dtype.itemsize)
    return OpNode(name=f"{first.name}_fused_rms_norm", op="aten.rms_norm.default", inputs=(), input_meta=inputs,
                  output_meta=(x,), module=first.module, bytes_moved=moved)


def norm_modules(graph) -> dict[str, list[OpNode]]:
    """The ops of each ``*norm`` module (the blocks' and the final one), in graph order."""
    members: dict[str, list[OpNode]] = defaultdict(list)
    for node in graph.nodes:
        if node.module.rsplit(".", 1)[-1].endswith("norm"):
            members[node.module].append(node)
    return members


def norm_weight(graph, ops: list[OpNode]) -> TensorMeta | None:
    """The weight a norm module's ``ops`` read (its first parameter), or None without one."""
    weights = [graph.parameters[p] for op in ops for p in op.params if p in graph.parameters]
    return TensorMeta(tuple(weights[0].shape), weights[0].dtype) if weights else None


def fused_replacements(graph) -> dict[str, OpNode | None]:
    """Op name -> what prices it when each norm is one fused kernel: the op reading the weight
    (the chain's last) -> the fused ``aten.rms_norm`` of the chain's input (``fused_norm_node``),
    every other op of the module -> None (no kernel of its own). The weight's op carries it
    because the simulator shares one cost among ops of equal signature (op, shapes, bytes,
    parameters: ``cost_model.simulation_cache.graph_facts``), and only that op has a parameter:
    a module's two ``_assert_tensor_metadata`` ops, say, are alike."""
    replacements: dict[str, OpNode | None] = {}
    for ops in norm_modules(graph).values():
        carrier = next((op for op in ops if op.params), ops[-1])
        replacements.update({op.name: None for op in ops})
        replacements[carrier.name] = fused_norm_node(ops[0], norm_weight(graph, ops))
    return replacements


# The ops of transformers' eager ``apply_rotary_pos_emb`` (q * cos + rotate_half(q) * sin, with
# rotate_half a slice, a negation and a concatenation), by ATen op up to its overload.
ROPE_OPS = ("aten.mul", "aten.neg", "aten.cat", "aten.add")


def rope_chains(graph) -> list[list[OpNode]]:
    """Each rotary embedding a block applies in its attention module (one for q, one for k):
    an ``add`` of the attention module's own ops (not a submodule's) on a 4-D tensor, with the
    ``ROPE_OPS`` of that module it is computed from, walked back through their inputs (views
    between them followed)."""
    nodes = {node.name: node for node in graph.nodes}

    def rope_op(node: OpNode, module: str) -> bool:
        return (node.module == module and node.op.rsplit(".", 1)[0] in ROPE_OPS
                and bool(node.input_meta) and len(node.input_meta[0].shape) == 4)

    chains = []
    for end in graph.nodes:
        if end.block is None or not end.module.endswith("attn") or not end.op.startswith("aten.add") \
                or not rope_op(end, end.module):
            continue
        chain, frontier = {end.name: end}, [end]
        while frontier:
            for source in frontier.pop().inputs:
                node = nodes.get(source)
                if node is None or node.name in chain or node.module != end.module:
                    continue
                if node.is_view or rope_op(node, end.module):
                    chain[node.name] = node
                    frontier.append(node)
        ops = [node for node in graph.nodes if node.name in chain and not node.is_view]
        if len(ops) > 1:
            chains.append(ops)
    return chains


def fused_rope_node(end: OpNode) -> OpNode:
    """One kernel that reads the rotated tensor (``end``'s output's shape and dtype) and writes
    the result, as Transformer Engine's fused RoPE does (Megatron-LM ``apply_rope_fusion``, on
    by default: ``--no-rope-fusion`` turns it off, megatron/training/arguments.py at 1e057005;
    the cos/sin table it also reads is small). Priced as the simulator prices one contiguous
    pointwise kernel (``cost_model.memory_kernels`` "streaming"): no public measurement of the
    fused kernel is used."""
    x = end.output_meta[0]
    return OpNode(name=f"{end.name}_fused_rope", op="aten.mul.Tensor", inputs=(), input_meta=(x,),
                  output_meta=(x,), module=end.module, bytes_moved=2 * x.nbytes)


def rope_replacements(graph) -> dict[str, OpNode | None]:
    """Op name -> what prices it when each rotary embedding is one fused kernel: the chain's
    ``add`` (its end) -> ``fused_rope_node``, its other ops -> None."""
    replacements: dict[str, OpNode | None] = {}
    for ops in rope_chains(graph):
        replacements.update({op.name: None for op in ops})
        replacements[ops[-1].name] = fused_rope_node(ops[-1])
    return replacements


def signature_collisions(graph, replacements: dict[str, OpNode | None]) -> list[str]:
    """Ops outside ``replacements`` whose signature a replaced op shares: the simulator would
    price them as the replacement too (or the replaced op as them), so a what-if with any is
    not exact."""
    signature = graph_facts(graph).signature
    replaced = {signature[name] for name in replacements}
    return [node.name for node in graph.nodes if node.name not in replacements and signature[node.name] in replaced]


def priced_with(replacements: dict[str, OpNode | None], priced=op_times):
    """``priced`` (``cost_model.compute.op_times``'s signature) with the ops of
    ``replacements`` priced as their replacement, or as nothing where it is None."""
    def times(node: OpNode, work_fraction: float, *args, **kwargs) -> tuple[float, float]:
        if node.name not in replacements:
            return priced(node, work_fraction, *args, **kwargs)
        replacement = replacements[node.name]
        return (0.0, 0.0) if replacement is None else priced(replacement, work_fraction, *args, **kwargs)
    return times


@contextlib.contextmanager
def norms_fused(graph, replacements: dict[str, OpNode | None] | None = None):
    """Within it, the simulator prices ``graph``'s norms as one fused kernel each, or the ops
    of ``replacements`` as it says (the op-time function its node costs and the EP overlap's
    beside-compute read, swapped for ``priced_with``); the cache of costed plans is emptied on
    entry and exit, so no plan costed one way is reused the other."""
    times = priced_with(fused_replacements(graph) if replacements is None else replacements)
    RECENTLY_COSTED.clear()
    cost_model.node_costs.op_times = cost_model.moe_overlap.op_times = times
    try:
        yield
    finally:
        cost_model.node_costs.op_times = cost_model.moe_overlap.op_times = op_times
        RECENTLY_COSTED.clear()


def norm_costs(simulator: Simulator, block: str, block_nodes: list[str]) -> list[NormCost]:
    """The eager and fused cost of each ``*norm`` module among ``block_nodes`` (the block
    segment named ``block``)."""
    context, graph = simulator.context, simulator.context.graph
    nodes = {node.name: node for node in graph.nodes}
    members: dict[str, list[OpNode]] = defaultdict(list)
    for name in block_nodes:
        node = nodes[name]
        if node.module.rsplit(".", 1)[-1].endswith("norm"):
            members[node.module].append(node)
    found = []
    for module, ops in members.items():
        eager_forward = sum(simulator.costs[op.name].forward_s for op in ops)
        eager_backward = sum(simulator.costs[op.name].backward_s for op in ops)
        first = ops[0]
        work = 1.0 / (work_split(context.mesh, context.strategies[first.name]) * context.micro_batches)
        fused = fused_norm_node(first, norm_weight(graph, ops))
        fused_forward, fused_backward = op_times(fused, work, context.device, context.plan.precision)
        found.append(NormCost(module, is_block_norm(first, block), eager_forward, eager_backward,
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
    plan, _ = simulate(run)
    simulator = Simulator(plan, plan.graph)
    micro_batches = simulator.context.micro_batches
    blocks, segment = busiest_rank_blocks(simulator.segments(), simulator.context.pp)
    recompute = plan.recompute_at(segment.stage)
    costs = norm_costs(simulator, segment.name, segment.nodes)
    if not costs:
        return [f"{run.name}: no *norm module in its blocks"]
    forwards = {c.module: forwards_per_pass(recompute, c.block_norm) for c in costs}
    eager = sum(step_seconds(c.eager_forward_s, c.eager_backward_s, forwards[c.module], blocks, micro_batches)
                for c in costs)
    fused = sum(step_seconds(c.fused_forward_s, c.fused_backward_s, forwards[c.module], blocks, micro_batches)
                for c in costs)
    step = plan.estimate.step_time_s
    norms = fused_replacements(plan.graph)
    both = {**norms, **rope_replacements(plan.graph)}
    collisions = signature_collisions(plan.graph, both)
    resimulated = []
    for replacements in (norms, both):
        with norms_fused(plan.graph, replacements):
            fused_plan, _ = simulate(run)
        resimulated.append(fused_plan.estimate.step_time_s)
    published = run.published_step_s
    lines = [f"{run.name}: {blocks} blocks x {micro_batches} micro-batches, recompute {recompute}; norms eager "
             f"{eager:.2f} s, fused {fused:.2f} s a step; predicted {step:.2f} s ({step / published - 1:+.1%}), "
             f"less the difference {step - eager + fused:.2f} s, re-simulated with fused norms {resimulated[0]:.2f} s "
             f"({resimulated[0] / published - 1:+.1%}), norms and RoPE {resimulated[1]:.2f} s "
             f"({resimulated[1] / published - 1:+.1%}); published {published:.2f} s"
             + (f"; not exact: {len(collisions)} other ops share a replaced op's signature" if collisions else "")]
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
