"""How far a walk over the per-op registry is from the layouts' walk over ``op_rule``.

    python benchmarks/registry_walk_gap.py                       # GPT, hf:llama, hf:gpt2, hf:bert on 4 ranks
    python benchmarks/registry_walk_gap.py --ranks 2 --conventions --models hf:bert

The whole-model layouts (``search.layouts``: data parallel, Megatron-LM) walk the graph with
``search.propagation.propagate``, which asks ``op_rule`` (``search.rules.op_families``) what
each op does with its incoming placements. One sharding-rule engine (issue 24) means asking
the per-op registry (``search.rules.axis_candidates``) instead. This script builds each
layout both ways (the registry walk plugs into ``propagate``'s ``answer``) and prints, per
model and layout, how many nodes are placed differently, the commonest differences as
``op: op_rule's answer => the registry walk's``, and the time of each build. A layout the
registry walk places differently is a different plan: the switch waits until this prints 0
everywhere, or every difference is argued better and the golden plans are re-derived.

The registry walk's choice rule, stated so it can be argued with: of the op's candidates on
an axis of the layout's size, take the one whose inputs the incoming placements reach most
cheaply, input by input: kept as they come (0), a replicated input sliced (1, no
communication), partial sums reduce-scattered (10), anything gathered whole (100); a
candidate needing another move (a split moved to another dim, partial sums made) is out.
Ties go to the registry's order. The all-replicate candidate is always reachable, so there
is always an answer. With ``--conventions``, where that rule can only gather everything and
``op_rule`` does better, ``op_rule``'s answer stands: that isolates the Megatron-LM program
conventions the registry refuses for the plain op (vocabulary-parallel embedding and cross
entropy, the fused q|k|v split, the row-parallel bias) from the choice rule's own effect.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections import Counter
from pathlib import Path
from unittest import mock

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from planner.api import prepare_model
from planner.errors import PlanningError
from planner.graph import OpNode, TensorMeta
from planner.model_spec import ModelSpec
from planner.strategy import Mesh, placements_str
from search import layouts
from search.propagation import propagate
from search.rules import axis_candidates
from search.rules.op_families import op_rule

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MODELS = {"gpt": str(EXAMPLES / "gpt.py"), "hf:llama": "hf:llama", "hf:gpt2": "hf:gpt2", "hf:bert": "hf:bert"}
_NOT_REACHABLE = None


def move_cost(have: Placement, want: Placement) -> int | None:
    """What turning ``have`` into ``want`` costs in the choice rule (see the module)."""
    if have == want:
        return 0
    if isinstance(want, Shard) and isinstance(have, Replicate):
        return 1
    if isinstance(want, Shard) and isinstance(have, Partial):
        return 10
    if isinstance(want, Replicate):
        return 100
    return _NOT_REACHABLE


def _normalised(placements: tuple[Placement, ...], metas: tuple[TensorMeta, ...]) -> tuple[Placement, ...]:
    return tuple(Shard(p.dim % len(m.shape)) if isinstance(p, Shard) and m.shape else p for p, m in zip(placements, metas))


def registry_answer(node: OpNode, incoming: tuple[Placement, ...], axis_size: int, conventions: bool):
    """The registry candidate ``incoming`` reaches most cheaply (the choice rule above)."""
    incoming = _normalised(incoming, node.input_meta)
    best = None
    for order, candidate in enumerate(axis_candidates(node, axis_size)):
        costs = [move_cost(have, want) for have, want in zip(incoming, candidate.inputs)]
        if _NOT_REACHABLE in costs:
            continue
        if best is None or (sum(costs), order) < best[0]:
            best = ((sum(costs), order), candidate)
    chosen = best[1]
    if conventions and chosen.is_replicated:
        wanted, outputs = op_rule(node, incoming)
        if not all(isinstance(p, Replicate) for p in (*wanted, *outputs)):
            return wanted, outputs
    return chosen.inputs, chosen.outputs


def _layouts(graph, ranks: int):
    yield "data parallel", lambda: layouts.data_parallel_layout(graph, Mesh((("dp", ranks),)))
    yield "megatron", lambda: layouts.megatron_layout(graph, Mesh((("tp", ranks),)))
    yield "megatron + sp", lambda: layouts.megatron_layout(graph, Mesh((("tp", ranks),)), sequence_parallel=True)


def _placed(layout) -> dict[str, tuple]:
    strategies, _ = layout
    return {s.node: (s.inputs, s.outputs) for s in strategies}


def _describe(placements) -> str:
    """One axis's placements of a node's tensors: ``(S(0), R)``."""
    return placements_str(tuple(per_axis[0] for per_axis in placements))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), help=f"of {', '.join(MODELS)}, or a spec")
    parser.add_argument("--ranks", type=int, default=4, help="the size of the layout's one mesh axis")
    parser.add_argument("--conventions", action="store_true", help="let op_rule answer where the registry only gathers")
    parser.add_argument("--show", type=int, default=6, help="differences listed per layout")
    args = parser.parse_args()
    answer = functools.partial(registry_answer, axis_size=args.ranks, conventions=args.conventions)
    registry_walk = functools.partial(propagate, answer=answer)
    for model in args.models:
        graph, *_ = prepare_model(ModelSpec(MODELS.get(model, model), {}), f"cpu:1x{args.ranks}")
        for name, build in _layouts(graph, args.ranks):
            try:
                start = time.perf_counter()
                today = _placed(build())
                today_s = time.perf_counter() - start
                with mock.patch.object(layouts, "propagate", registry_walk):
                    start = time.perf_counter()
                    walked = _placed(build())
                    walked_s = time.perf_counter() - start
            except PlanningError as error:
                print(f"{model:10} {name:14} not built: {error}")
                continue
            differences = Counter(
                f"{graph.node(node).op}: {_describe(today[node][0])} -> {_describe(today[node][1])} => "
                f"{_describe(walked[node][0])} -> {_describe(walked[node][1])}"
                for node in today
                if today[node] != walked[node]
            )
            print(
                f"{model:10} {name:14} {sum(differences.values()):5} of {len(today)} nodes differ; "
                f"op_rule walk {today_s * 1000:.0f} ms, registry walk {walked_s * 1000:.0f} ms"
            )
            for line, count in differences.most_common(args.show):
                print(f"{'':12}{count:4} x {line}")


if __name__ == "__main__":
    main()
