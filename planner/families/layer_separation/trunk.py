"""Where layer separation cuts a traced CNN: its convolutional trunk, as one module.

The trunk is the smallest module holding every parameter that the graph reads up to its
last convolution; the cut is that module's output (a CNN flattens it into the fully
connected head). A model qualifies when the trunk holds no parameter read after the cut,
everything after the cut (the head) holds parameters (fully connected layers), and the
model's first op with parameters is in the trunk (the model's first input enters it).

Vocabulary layer: reads the traced ``OpGraph`` only.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.graph import OpGraph

CONVOLUTIONS = ("aten.convolution", "aten.conv1d", "aten.conv2d", "aten.conv3d", "aten._convolution")


@dataclass(frozen=True)
class Trunk:
    """The trunk's module path, the names of the graph nodes in it, its last node (whose
    output is the cut) and the bytes of one sample's activations at the cut (what a trunk
    rank sends a head rank per sample)."""

    path: str
    nodes: frozenset[str]
    last: str
    cut_bytes_per_sample: float


def in_module(module: str, path: str) -> bool:
    """Whether an op issued by ``module`` runs inside module ``path``."""
    return module == path or module.startswith(path + ".")


def find_trunk(graph: OpGraph) -> Trunk | None:
    """The convolutional trunk of ``graph`` (module docstring), or None for a model that
    has none: no convolution, no parameter after the last one, or parameters that do not
    split at one module's output."""
    nodes = graph.nodes
    last_conv = max((i for i, node in enumerate(nodes) if node.op.startswith(CONVOLUTIONS)), default=None)
    if last_conv is None:
        return None
    before = [name for node in nodes[:last_conv + 1] for name in node.params]
    after = {name for node in nodes[last_conv + 1:] for name in node.params}
    path = _common_module(before)
    if not path or not after:
        return None
    if any(name.startswith(path + ".") for name in after) or any(not name.startswith(path + ".") for name in before):
        return None
    inside = [node for node in nodes if in_module(node.module, path)]
    first_with_params = next((node for node in nodes if node.params), None)
    if first_with_params is None or not in_module(first_with_params.module, path):
        return None
    # The trunk's output: its last op's first output; per sample, over the batch's rows.
    output = inside[-1].output_meta[0]
    batch = graph.batch_size
    if not output.shape or output.shape[0] != batch:
        return None
    numel = 1
    for size in output.shape:
        numel *= size
    element = output.dtype.itemsize if hasattr(output.dtype, "itemsize") else 4
    return Trunk(path, frozenset(node.name for node in inside), inside[-1].name, numel * element / batch)


def _common_module(names: list[str]) -> str:
    """The longest module path every parameter name of ``names`` lies under."""
    if not names:
        return ""
    parts = [name.split(".")[:-1] for name in names]
    common = parts[0]
    for other in parts[1:]:
        size = 0
        while size < min(len(common), len(other)) and common[size] == other[size]:
            size += 1
        common = common[:size]
    return ".".join(common)
