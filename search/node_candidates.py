"""Each op's candidate strategies on a mesh, from the rule registry.

The one place the per-op candidates of the search are made: the outer search
(``search.auto``) and the pipeline grid's per-stage layouts (``search.stage_layouts``) both
ask here, so neither imports the other.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate

from planner.graph import OpGraph
from planner.strategy import Mesh, NodeStrategy
from search.rules import candidates
from search.rules.summa import LINEAR_OPS, summa_candidates


def node_strategies(graph: OpGraph, mesh: Mesh, only: set[str] | None = None,
                    tp_layouts: str = "auto", weights_split_on_dp: bool = False) -> dict[str, list[NodeStrategy]]:
    """Candidate strategies on ``mesh`` from the rule registry (all-replicate first), for
    every node or for the nodes in ``only``. On the ``dp`` axis weights stay replicated:
    sharding them there is what the FSDP/ZeRO flavours do; weights split on ``tp``.

    On a mesh with SUMMA axes the block-layout strategies (``search.rules.summa``) are
    added; with ``tp_layouts="summa"`` a linear that has SUMMA strategies gets only those,
    with ``tp_layouts="1d"`` no op gets a SUMMA layout (plain per-axis shardings only).
    ``weights_split_on_dp`` lifts the dp rule (``planner explain`` shows what it excludes)."""
    dp = mesh.names.index("dp") if "dp" in mesh.names else None
    strategies: dict[str, list[NodeStrategy]] = {}
    for node in graph.nodes:
        if only is not None and node.name not in only:
            continue
        weight_positions = [node.inputs.index(source) for source in node.param_inputs]

        def weights_whole_on_dp(per_axis, positions=weight_positions) -> bool:
            return weights_split_on_dp or dp is None or all(isinstance(per_axis[dp].inputs[i], Replicate) for i in positions)

        options = []
        for per_axis in candidates(node, mesh, keep=weights_whole_on_dp):
            inputs = tuple(tuple(c.inputs[i] for c in per_axis) for i in range(len(node.inputs)))
            outputs = tuple(tuple(c.outputs[i] for c in per_axis) for i in range(len(node.output_meta)))
            params = {
                param: inputs[node.inputs.index(source)]
                for param, source in zip(node.params, node.param_inputs)
            }
            options.append(NodeStrategy(node=node.name, op=node.op, module=node.module, inputs=inputs, outputs=outputs, params=params))
        summa = summa_candidates(node, mesh)
        if tp_layouts == "1d":
            summa = [s for s in summa if s.layout is None]
        if summa and tp_layouts == "summa" and node.op in LINEAR_OPS:
            options = summa
        else:
            known = {(s.inputs, s.outputs) for s in options}
            options += [s for s in summa if s.layout is not None or (s.inputs, s.outputs) not in known]
        strategies[node.name] = options
    return strategies
