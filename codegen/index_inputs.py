"""Which integer inputs of a model index something, and how far: ``INDEX_INPUTS`` of ``model_spmd.py``.

Token ids feed an embedding (valid ids: 0 .. rows - 1) and class targets feed a loss (0 ..
classes - 1, or its ``ignore_index``). An id outside that range raises an ``IndexError`` on
the rank whose slice holds it (a device-side assert on a GPU) while the other ranks wait in a
collective; ``launch.py --data`` checks each global batch against these ranges first
(``codegen.runtime.user_data``), on every rank alike.

Read from the traced graph at compile time: a user input, through view-like ops (a target's
``.view(-1)``, a shifted ``labels[:, 1:]``), read as the indices of ``aten.embedding`` or the
target of ``aten.cross_entropy_loss`` / ``aten.nll_loss*``. Inputs read elsewhere too are
still checked against the range of each reader found (the tightest).
"""

from __future__ import annotations

from planner.graph import OpGraph, OpNode

# Ops that pass their first input's values through unchanged (views, copies).
PASS_THROUGH = frozenset({
    "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.flatten.using_ints",
    "aten.slice.Tensor", "aten.select.int", "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims",
    "aten.squeeze.default", "aten.transpose.int", "aten.t.default", "aten.permute.default", "aten.expand.default",
    "aten.contiguous.default", "aten.clone.default", "aten.alias.default", "aten.detach.default",
    "aten.lift_fresh_copy.default",
})
# Loss ops: (position of ignore_index among the positional arguments, its default).
LOSS_TARGETS = {
    "aten.cross_entropy_loss.default": (4, -100),
    "aten.nll_loss.default": (4, -100),
    "aten.nll_loss_forward.default": (4, -100),
    "aten.nll_loss2d.default": (4, -100),
    "aten.nll_loss2d_forward.default": (4, -100),
    "aten.nll_loss_nd.default": (4, -100),
}


def index_inputs(graph: OpGraph) -> dict[str, tuple[int, tuple[int, ...], str]]:
    """User input name -> (bound, allowed extra values, what reads it): every value must lie
    in [0, bound) or be one of the extras; only integer inputs, and only readers found."""
    sources = {item.name: item.name for item in graph.inputs if item.meta is not None and not item.meta.dtype.is_floating_point}
    ranges: dict[str, tuple[int, tuple[int, ...], str]] = {}
    for node in graph.nodes:
        if not node.inputs:
            continue
        if node.op in PASS_THROUGH and node.inputs[0] in sources:
            sources[node.name] = sources[node.inputs[0]]
            continue
        found = _reader_range(node, sources)
        if found is None:
            continue
        name, bound, extras, reader = found
        if name not in ranges or bound < ranges[name][0]:
            ranges[name] = (bound, extras, reader)
    return ranges


def _reader_range(node: OpNode, sources: dict[str, str]) -> tuple[str, int, tuple[int, ...], str] | None:
    """(input, bound, extras, reader) when ``node`` indexes with a user input, else None."""
    if len(node.inputs) < 2 or node.inputs[1] not in sources or len(node.input_meta) < 2:
        return None
    source = sources[node.inputs[1]]
    table = node.input_meta[0].shape
    if node.op == "aten.embedding.default" and table:
        where = f"embedding '{node.module}'" if node.module else "an embedding"
        return source, int(table[0]), (), f"{where} ({table[0]} rows)"
    if node.op in LOSS_TARGETS and table:
        position, default = LOSS_TARGETS[node.op]
        ignore = node.attrs[position] if len(node.attrs) > position and isinstance(node.attrs[position], int) else default
        classes = int(table[0] if len(table) == 1 else table[1])
        where = f"the loss in '{node.module}'" if node.module else "the loss"
        return source, classes, (int(ignore),), f"{where} ({classes} classes, ignore_index {ignore})"
    return None


def index_inputs_source(graph: OpGraph | None) -> str:
    """The ``INDEX_INPUTS`` assignment for ``model_spmd.py`` (every value a literal)."""
    ranges = index_inputs(graph) if graph is not None else {}
    lines = "".join(f"    {name!r}: ({bound!r}, {extras!r}, {reader!r}),\n" for name, (bound, extras, reader) in ranges.items())
    return (
        "\n\n# Integer inputs that index something: name -> (bound, allowed extra values, what reads them).\n"
        "# launch.py --data refuses a batch holding a value outside [0, bound) that is not an extra.\n"
        f"INDEX_INPUTS = {{\n{lines}}}\n"
    )


__all__ = ["index_inputs", "index_inputs_source", "PASS_THROUGH", "LOSS_TARGETS"]
