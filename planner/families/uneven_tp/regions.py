"""The linear layers a plan may split, and where a split activation may stay split between two
layers (vocabulary layer: graph reading).

ACCPAR prices the switch between consecutive layers' partitions (Song et al., HPCA 2020,
section IV-B, the inter-layer communication). With activations made whole after every split
layer, each switch costs a gather-v. One switch needs none: a ``column`` split's output
features are exactly a ``row`` split's input features when the ops between are elementwise
and the two layers give every rank the same shares (ACCPAR's output-feature partition
followed by an input-feature one at the same ratio; Megatron-LM's MLP). The rank then keeps
its slice, runs the elementwise ops on it (on its share, not the whole), and the row layer's
all-reduce is the only collective of the forward.

``fusable_groups(graph)`` finds those places: for a linear layer R (``split_dimensions``),
the ops computing its input, walked back through elementwise ops of that input's shape, must
end at linear layers (the columns) of as many output features as R has input features, and
nothing outside the walk may read what the walk passed through. GPT's MLP gives
``c_fc -> gelu -> c_proj``; LLaMA's ``gate_proj, up_proj -> silu, mul -> down_proj``.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.graph import OpGraph

__all__ = ["FusableGroup", "ELEMENTWISE_OPS", "fusable_groups", "split_dimensions"]

# Ops that act on each element alone (or two same-shape tensors element by element), so a
# slice of the features in gives that slice out. Not dropout: its mask is drawn from the
# random stream, which one device draws for the whole tensor.
ELEMENTWISE_OPS = frozenset({
    "aten.gelu.default", "aten.relu.default", "aten.silu.default", "aten.tanh.default", "aten.sigmoid.default",
    "aten.mul.Tensor", "aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Scalar", "aten.div.Scalar",
    "aten.neg.default",
})


def split_dimensions(graph) -> dict[str, dict[str, int]]:
    """For every ``nn.Linear`` of the traced graph (an ``aten.linear`` op reading its module's
    weight, of a 2-D weight, the only op reading it): the size of the dimension each kind
    splits: ``batch`` the input's dim 0, ``column`` the output features, ``row`` the input
    features. Layers whose weight another op also reads (tied embeddings) are left out."""
    readers: dict[str, int] = {}
    for node in graph.nodes:
        for param in node.params:
            readers[param] = readers.get(param, 0) + 1
    dims = {}
    for node in graph.nodes:
        weight = f"{node.module}.weight"
        if (node.op == "aten.linear.default" and node.module_type == "Linear" and node.params[:1] == (weight,)
                and readers.get(weight) == 1 and len(node.input_meta) >= 2 and len(node.input_meta[1].shape) == 2
                and len(node.input_meta[0].shape) >= 2 and node.module not in dims):
            out_features, in_features = node.input_meta[1].shape
            dims[node.module] = {"batch": node.input_meta[0].shape[0], "column": out_features, "row": in_features}
    return dims


@dataclass(frozen=True)
class FusableGroup:
    """Linear layers whose split activation may stay split: ``columns`` (module paths, in graph
    order) feed ``row`` through the elementwise ops ``between`` (node names), over a feature
    dimension of ``dim``."""

    columns: tuple[str, ...]
    row: str
    between: tuple[str, ...]
    dim: int

    @property
    def modules(self) -> tuple[str, ...]:
        """Every layer of the group, the row last."""
        return (*self.columns, self.row)


def fusable_groups(graph: OpGraph) -> tuple[FusableGroup, ...]:
    """Every ``FusableGroup`` of ``graph`` (module docstring), in graph order of their rows."""
    dims = split_dimensions(graph)
    by_name = {node.name: node for node in graph.nodes}
    readers: dict[str, list[str]] = {}
    for node in graph.nodes:
        for source in node.inputs:
            if isinstance(source, str):
                readers.setdefault(source, []).append(node.name)
    linear_of = {node.name: node.module for node in graph.nodes
                 if node.op == "aten.linear.default" and node.module in dims}
    groups = []
    for node in graph.nodes:
        if node.name not in linear_of or not node.inputs or not isinstance(node.inputs[0], str):
            continue
        row_dim = dims[node.module]["row"]
        shape = node.input_meta[0].shape
        columns, between, inside = [], [], {node.name}
        frontier, ok = [node.inputs[0]], True
        while frontier and ok:
            name = frontier.pop()
            if name in inside:
                continue
            source = by_name.get(name)
            if source is None or tuple(source.output_meta[0].shape if source.output_meta else ()) != tuple(shape):
                ok = False
            elif name in linear_of:
                ok = dims[source.module]["column"] == row_dim
                columns.append(name)
            elif source.op in ELEMENTWISE_OPS:
                between.append(name)
                tensors = [i for i in source.inputs if isinstance(i, str)]
                ok = all(i in by_name for i in tensors)  # a parameter or buffer read whole: not sliceable
                frontier.extend(tensors)
            else:
                ok = False
            inside.add(name)
        # Nothing outside may read a tensor of the group but the row layer's output.
        if ok and columns and all(set(readers.get(name, ())) <= inside for name in (*columns, *between)):
            order = {n.name: i for i, n in enumerate(graph.nodes)}
            columns.sort(key=order.__getitem__)
            between.sort(key=order.__getitem__)
            groups.append(FusableGroup(tuple(linear_of[c] for c in columns), node.module, tuple(between), row_dim))
    return tuple(groups)
