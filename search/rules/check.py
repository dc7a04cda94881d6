"""Brute-force check of one rule candidate on tiny real tensors, in one process.

``check_rule(node, candidate, axis_size)`` plays ``axis_size`` virtual ranks:

1. random whole inputs with the node's shapes (scaled down when large), in float64 so the
   comparison is tight; integer inputs that index something (embedding ids, gather/index
   positions, class targets) stay inside the range they index;
2. each rank's local inputs per the candidate's input placements: ``Shard(d)`` is DTensor's
   ``torch.chunk`` split (ranks past the last chunk get an empty piece), ``Replicate`` a copy,
   ``Partial`` random pieces that reduce (sum/avg/max/min) to the value;
3. the same ATen op on each rank's local inputs; size arguments (view/reshape/expand sizes,
   split sizes, new_* sizes) become that rank's local sizes, read off the output placement;
4. each rank's outputs combined per the output placements (``Shard``: concatenated, and each
   piece must be the piece ``torch.chunk`` gives, so the next op sees a standard layout;
   ``Partial``: reduced; ``Replicate``: every rank equal) and compared with the op on the
   whole inputs.

Random ops run deterministically (dropout off): the random stream across shards is the
runtime's business, not the rule's. The node keeps only positional arguments (``attrs``),
so keyword arguments the program passed (``scale=``, ``approximate=``) take their defaults on
both sides of the comparison.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from planner.graph import OpNode, TensorMeta
from search.rules.registry import AxisCandidate

# Nodes with a tensor bigger than this many elements are scaled down (see _scaled_metas).
_MAX_ELEMENTS = 4096
_SMALL = 24  # sizes above this are mapped to 12..23 when scaling down
# (rtol, atol) of a comparison by result dtype: float64 unless the op casts down.
_FLOAT_TOL = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (2e-2, 1e-2),
}

# attrs position of a size list that must become the rank's local output shape.
_OUTPUT_SIZE_ARG = {
    "aten.view.default": 1,
    "aten._unsafe_view.default": 1,
    "aten.reshape.default": 1,
    "aten.expand.default": 1,
    "aten.new_ones.default": 1,
    "aten.new_zeros.default": 1,
    "aten.new_empty.default": 1,
    "aten.new_full.default": 1,
}
_DROPOUTS = {"aten.dropout.default": 2, "aten.native_dropout.default": 2, "aten.feature_dropout.default": 2}
# Ops whose size-free attrs let them run on scaled-down shapes (norms map normalized_shape).
_SCALABLE_PREFIXES = (
    "aten.linear.", "aten.mm.", "aten.addmm.", "aten.bmm.", "aten.matmul.", "aten.baddbmm.", "aten.add.",
    "aten.sub.", "aten.mul.", "aten.div.", "aten.gelu.", "aten.relu.", "aten.silu.", "aten.tanh.", "aten.neg.",
    "aten.pow.", "aten.rsqrt.", "aten.exp.", "aten.softmax.", "aten._softmax.", "aten.log_softmax.",
    "aten._log_softmax.", "aten.mean.", "aten.sum.", "aten.amax.", "aten.cross_entropy_loss.", "aten.mse_loss.",
    "aten.layer_norm.", "aten.rms_norm.", "aten.embedding.", "aten.scaled_dot_product_attention.",
    "aten.dropout.", "aten.clone.", "aten.contiguous.", "aten.to.", "aten._to_copy.", "aten.transpose.",
    "aten.t.", "aten.permute.", "aten.unsqueeze.", "aten.where.", "aten.masked_fill.",
)


def check_rule(node: OpNode, candidate: AxisCandidate, axis_size: int = 2, seed: int = 0) -> str | None:
    """Verify ``candidate`` for ``node`` on ``axis_size`` virtual ranks.

    Args:
        node: the traced op (its op name, tensor metas and positional ``attrs``).
        candidate: the placements to verify, one per tensor input and output.
        axis_size: number of virtual ranks (2 or 3; 3 makes most sizes uneven).
        seed: seed of the random inputs.

    Returns:
        ``None`` when the local results combine into the op's result and every ``Shard``
        output piece has the standard ``torch.chunk`` layout; else a one-line message naming
        the op, the candidate and what went wrong (``"cannot check: ..."`` when the op could
        not be run at all, e.g. a higher-order op or a tensor passed twice).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only contend (5x slower on a busy machine)
    try:
        return _check(node, candidate, axis_size, seed)
    finally:
        torch.set_num_threads(threads)


def _check(node: OpNode, candidate: AxisCandidate, axis_size: int, seed: int) -> str | None:
    where = f"{node.op} {candidate} on {axis_size} ranks ({', '.join(str(m) for m in node.input_meta)})"
    if len(candidate.inputs) != len(node.input_meta) or len(candidate.outputs) != len(node.output_meta):
        ours = f"{len(candidate.inputs)} input and {len(candidate.outputs)} output placements"
        theirs = f"{len(node.input_meta)} inputs and {len(node.output_meta)} outputs"
        return f"{where}: the candidate has {ours}, the node {theirs}"
    try:
        op = resolve_op(node.op)
    except LookupError as error:
        return f"{where}: cannot check: {error}"
    generator = torch.Generator().manual_seed(seed)
    in_metas, out_metas, size_map = _scaled_metas(node)
    attrs = _scaled_attrs(node, size_map)
    attrs = _deterministic(node.op, attrs)
    try:
        full_inputs = [_random_input(node, i, meta, in_metas, attrs, generator) for i, meta in enumerate(in_metas)]
        expected = _run(op, attrs, full_inputs)
    except Exception as error:  # noqa: BLE001 - the checker's own setup must not hide as a wrong rule
        return f"{where}: cannot check: the op fails on whole inputs: {type(error).__name__}: {_first_line(error)}"
    if len(expected) != len(out_metas):
        return f"{where}: op gave {len(expected)} tensor outputs, node records {len(out_metas)}"

    local_inputs: list[list[torch.Tensor]] = [[] for _ in range(axis_size)]
    for index, (tensor, placement) in enumerate(zip(full_inputs, candidate.inputs)):
        pieces = _distribute(tensor, placement, axis_size, generator)
        if isinstance(pieces, str):
            return f"{where}: input {index}: {pieces}"
        for rank in range(axis_size):
            local_inputs[rank].append(pieces[rank])

    local_outputs = []
    for rank in range(axis_size):
        local_attrs = _local_attrs(node.op, attrs, out_metas, candidate.outputs, rank, axis_size)
        try:
            local_outputs.append(_run(op, local_attrs, local_inputs[rank]))
        except Exception as error:  # noqa: BLE001 - a rule that makes the op fail is a wrong rule
            failure = f"{type(error).__name__}: {_first_line(error)}"
            return f"{where}: rank {rank} cannot run the op on its local inputs: {failure}"
        if len(local_outputs[-1]) != len(expected):
            return f"{where}: rank {rank} gave {len(local_outputs[-1])} outputs, expected {len(expected)}"

    for index, (full, placement) in enumerate(zip(expected, candidate.outputs)):
        pieces = [outputs[index] for outputs in local_outputs]
        problem = _compare(full, pieces, placement, axis_size)
        if problem:
            return f"{where}: output {index} ({placement}): {problem}"
    return None


def resolve_op(name: str) -> Any:
    """``"aten.mm.default"`` -> ``torch.ops.aten.mm.default``; ``"getitem"`` -> identity."""
    if name == "getitem":
        return None
    parts = name.split(".")
    if len(parts) != 3:
        raise LookupError(f"'{name}' is not an ATen op name of the form 'aten.<op>.<overload>'")
    namespace, packet, overload = parts
    try:
        return getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    except (AttributeError, RuntimeError) as error:
        raise LookupError(f"torch.ops has no '{name}' ({_first_line(error)})") from error


def local_shape(shape: tuple[int, ...], placement: Placement, rank: int, axis_size: int) -> tuple[int, ...]:
    """The shape rank ``rank`` holds of a tensor of ``shape`` placed as ``placement``."""
    if not isinstance(placement, Shard):
        return tuple(shape)
    dim = placement.dim
    chunk = math.ceil(shape[dim] / axis_size) if shape[dim] else 0
    size = max(0, min(chunk, shape[dim] - rank * chunk))
    return tuple(shape[:dim]) + (size,) + tuple(shape[dim + 1 :])


def shard_pieces(tensor: torch.Tensor, dim: int, axis_size: int) -> list[torch.Tensor]:
    """DTensor's split of ``tensor`` along ``dim``: ``torch.chunk``, padded with empty pieces."""
    chunks = list(torch.chunk(tensor, axis_size, dim=dim)) if tensor.shape[dim] else []
    while len(chunks) < axis_size:
        chunks.append(tensor.narrow(dim, tensor.shape[dim], 0) if tensor.shape[dim] else tensor)
    return [chunk.clone() for chunk in chunks]


# ------------------------------------------------------------------------ whole inputs


def _random_input(
    node: OpNode, index: int, meta: TensorMeta, metas: tuple[TensorMeta, ...], attrs: tuple, generator: torch.Generator
) -> torch.Tensor:
    if meta.dtype == torch.bool:
        return torch.rand(meta.shape, generator=generator) < 0.6
    if meta.dtype.is_floating_point or meta.dtype.is_complex:
        return torch.randn(meta.shape, generator=generator, dtype=torch.float64)
    high = _index_range(node, index, metas, attrs)
    return torch.randint(0, max(1, high), meta.shape, generator=generator, dtype=meta.dtype)


def _index_range(node: OpNode, index: int, metas: tuple[TensorMeta, ...], attrs: tuple) -> int:
    """Exclusive upper bound of an integer input: the size of what it indexes, else 5."""
    op = node.op
    if op.startswith("aten.embedding.") and index == 1:
        return metas[0].shape[0]
    if op.startswith(("aten.cross_entropy_loss.", "aten.nll_loss")) and index == 1:
        logits = metas[0].shape
        return logits[1] if len(logits) > 1 else logits[0]
    if op.startswith("aten.gather.") and index == 1:
        rank = len(metas[0].shape)
        return metas[0].shape[attrs[1] % rank] if rank else 1
    if op.startswith("aten.index.Tensor") and index >= 1:
        return metas[0].shape[index - 1]
    if op.startswith("aten.index_select.") and index == 1:
        return metas[0].shape[attrs[1] % len(metas[0].shape)]
    return 5


def _deterministic(op: str, attrs: tuple) -> tuple:
    """Random ops with their randomness off (train=False / dropout_p=0)."""
    attrs = list(attrs)
    if op in _DROPOUTS and len(attrs) > _DROPOUTS[op]:
        attrs[_DROPOUTS[op]] = False
    if op.startswith("aten.scaled_dot_product_attention") and len(attrs) > 4:
        attrs[4] = 0.0
    return tuple(attrs)


# ---------------------------------------------------------------------- scaling down


def _scaled_metas(node: OpNode) -> tuple[tuple[TensorMeta, ...], tuple[TensorMeta, ...], dict[int, int]]:
    """The node's metas, with every size above ``_SMALL`` mapped below it when some input is
    larger than ``_MAX_ELEMENTS`` and the op carries no sizes we cannot map. The same size
    always maps to the same smaller size (contractions and broadcasts still line up), and a
    size keeps its remainder modulo 12 (64 -> 16, 192 -> 12, 50 -> 14), so whether 2, 3, 4
    or 6 ranks divide it does not change, while the sizes stay varied and mostly uneven."""
    metas = node.input_meta + node.output_meta
    if all(meta.numel <= _MAX_ELEMENTS for meta in metas) or not node.op.startswith(_SCALABLE_PREFIXES):
        return node.input_meta, node.output_meta, {}
    sizes = {size for meta in metas for size in meta.shape if size > _SMALL}
    size_map = {size: 12 + size % 12 for size in sizes}

    def scaled(meta: TensorMeta) -> TensorMeta:
        return TensorMeta(tuple(size_map.get(size, size) for size in meta.shape), meta.dtype)

    return tuple(scaled(m) for m in node.input_meta), tuple(scaled(m) for m in node.output_meta), size_map


def _scaled_attrs(node: OpNode, size_map: dict[int, int]) -> tuple:
    attrs = tuple(node.attrs)
    if size_map and node.op.startswith(("aten.layer_norm.", "aten.rms_norm.")) and len(attrs) > 1:
        attrs = (attrs[0], [size_map.get(s, s) for s in attrs[1]]) + attrs[2:]
    return attrs


# ------------------------------------------------------------------ placing and running


def _distribute(tensor: torch.Tensor, placement: Placement, axis_size: int, generator: torch.Generator):
    if isinstance(placement, Replicate):
        return [tensor.clone() for _ in range(axis_size)]
    if isinstance(placement, Shard):
        if placement.dim >= tensor.dim():
            return f"{placement} of a tensor of rank {tensor.dim()}"
        return shard_pieces(tensor, placement.dim, axis_size)
    if isinstance(placement, Partial):
        if tensor.dtype == torch.bool:
            return f"{placement} of a bool tensor has no meaning"
        noise = [_noise_like(tensor, generator) for _ in range(axis_size)]
        reduce_op = placement.reduce_op
        if reduce_op in ("sum", "avg"):
            mean = sum(noise) / axis_size if tensor.is_floating_point() else None
            if reduce_op == "avg":  # pieces whose mean is the value
                if mean is None:
                    return f"{placement} of an integer tensor cannot be split into a mean"
                return [tensor + n - mean for n in noise]
            pieces = noise[:-1]  # pieces whose sum is the value
            return pieces + [tensor - sum(pieces)] if pieces else [tensor.clone()]
        if reduce_op in ("max", "min"):
            sign = -1 if reduce_op == "max" else 1
            return [tensor.clone()] + [tensor + sign * n.abs() for n in noise[1:]]
        return f"unsupported partial reduction '{reduce_op}'"
    return f"unsupported placement {placement!r}"


def _noise_like(tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    if tensor.is_floating_point():
        return torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
    return torch.randint(-3, 4, tensor.shape, generator=generator, dtype=tensor.dtype)


def _local_attrs(
    op: str, attrs: tuple, out_metas: tuple[TensorMeta, ...], outputs: tuple[Placement, ...], rank: int, axis_size: int
) -> tuple:
    """``attrs`` with size arguments turned into this rank's local sizes."""
    if not out_metas:
        return attrs
    local = [local_shape(m.shape, p, rank, axis_size) for m, p in zip(out_metas, outputs)]
    attrs = list(attrs)
    if op in _OUTPUT_SIZE_ARG and len(attrs) > _OUTPUT_SIZE_ARG[op]:
        attrs[_OUTPUT_SIZE_ARG[op]] = list(local[0])
    elif op == "aten.unflatten.int":
        dim = attrs[1] % len(out_metas[0].shape)
        attrs[2] = list(local[0][dim : dim + len(attrs[2])])
    elif op in ("aten.split.Tensor", "aten.split_with_sizes.default"):
        in_rank = len(out_metas[0].shape)
        dim = (attrs[2] if len(attrs) > 2 else 0) % in_rank
        sizes = [shape[dim] for shape in local]
        attrs[1] = sizes if op == "aten.split_with_sizes.default" else max(sizes[0], 1)
    return tuple(attrs)


def _run(op: Any, attrs: tuple, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    if op is None:  # getitem: the node's input is already the element it picks
        return [tensors[0]]
    args = _fill_tensors(op, attrs, tensors)
    with torch.no_grad():
        result = op(*args)
    return [leaf for leaf in torch.utils._pytree.tree_leaves(result) if isinstance(leaf, torch.Tensor)]


def _fill_tensors(op: Any, attrs: tuple, tensors: list[torch.Tensor]) -> list:
    """Put the tensors back where ``attrs`` has ``None``, in order, guided by the schema:
    a ``Tensor`` slot always takes the next tensor, an optional one (``Tensor?``) only when
    more tensors remain than the required slots after it need.

    A tensor passed twice is recorded once (``cat((x, x))``, ``mul(x, x)``): when the op has
    one tensor input and more required slots, that tensor fills them all. With several
    inputs and a repeat, which slot repeats which is lost, and this raises."""
    schema_args = op._schema.arguments
    slots: list[tuple[int, int | None, bool]] = []  # (arg position, list index, required)
    for position, value in enumerate(attrs):
        kind = str(schema_args[position].type) if position < len(schema_args) else ""
        optional = "?" in kind or "Optional" in kind  # "Tensor?" / "Optional[Tensor]", "List[Optional[Tensor]]"
        if isinstance(value, (list, tuple)):
            slots += [(position, item, not optional) for item, element in enumerate(value) if element is None]
        elif value is None:
            slots.append((position, None, not optional))
    args = [list(a) if isinstance(a, (list, tuple)) else a for a in attrs]
    required = sum(1 for _, _, req in slots if req)
    remaining = list(tensors) * required if len(tensors) == 1 and required > 1 else list(tensors)
    for number, (position, item, required) in enumerate(slots):
        required_after = sum(1 for _, _, req in slots[number + 1 :] if req)
        if not remaining or (not required and len(remaining) <= required_after):
            continue
        tensor = remaining.pop(0)
        if item is None:
            args[position] = tensor
        else:
            args[position][item] = tensor
    if remaining:
        raise ValueError(
            f"{len(remaining)} tensor inputs found no slot in attrs {attrs!r} (a tensor passed twice is recorded once)"
        )
    return args


# ---------------------------------------------------------------------- comparing


def _close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    if actual.shape != expected.shape:
        return False
    if not expected.is_floating_point():
        return torch.equal(actual.to(expected.dtype), expected)
    rtol, atol = _FLOAT_TOL.get(expected.dtype, (1e-4, 1e-5))
    return torch.allclose(actual.to(expected.dtype), expected, rtol=rtol, atol=atol, equal_nan=True)


def _compare(full: torch.Tensor, pieces: list[torch.Tensor], placement: Placement, axis_size: int) -> str | None:
    if isinstance(placement, Replicate):
        for rank, piece in enumerate(pieces):
            if not _close(piece, full):
                return f"rank {rank} holds {_describe(piece)}, not the whole result {_describe(full)}"
        return None
    if isinstance(placement, Shard):
        dim = placement.dim
        if dim >= full.dim():
            return f"{placement} of a rank-{full.dim()} result"
        if any(piece.dim() != full.dim() for piece in pieces):
            return f"local results have ranks {[p.dim() for p in pieces]}, the result has rank {full.dim()}"
        try:
            joined = torch.cat(pieces, dim=dim)
        except RuntimeError as error:
            return f"local results do not concatenate along dim {dim}: {_first_line(error)}"
        if not _close(joined, full):
            return f"concatenated local results {_describe(joined)} differ from the result {_describe(full)}"
        standard = shard_pieces(full, dim, axis_size)
        for rank, (piece, want) in enumerate(zip(pieces, standard)):
            if piece.shape != want.shape:
                return (
                    f"values right but layout not standard: rank {rank} holds {tuple(piece.shape)}, "
                    f"torch.chunk gives {tuple(want.shape)}"
                )
        return None
    if isinstance(placement, Partial):
        if any(piece.shape != full.shape for piece in pieces):
            return f"partial pieces have shapes {[tuple(p.shape) for p in pieces]}, the result {tuple(full.shape)}"
        stacked = torch.stack([piece.to(full.dtype) for piece in pieces])
        reduce_op = placement.reduce_op
        if not full.is_floating_point() and reduce_op == "avg":
            return "an average of integer pieces"
        reduced = {
            "sum": lambda: stacked.sum(0),
            "avg": lambda: stacked.mean(0),
            "max": lambda: stacked.amax(0),
            "min": lambda: stacked.amin(0),
        }.get(reduce_op)
        if reduced is None:
            return f"unsupported partial reduction '{reduce_op}'"
        value = reduced()
        if not _close(value, full):
            return f"{reduce_op} of the local results {_describe(value)} differs from the result {_describe(full)}"
        return None
    return f"unsupported placement {placement!r}"


def _describe(tensor: torch.Tensor) -> str:
    if tensor.numel() == 0 or not tensor.is_floating_point():
        return f"{tuple(tensor.shape)}"
    return f"{tuple(tensor.shape)} (sum {tensor.double().nansum().item():.6g})"


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    line = lines[0] if lines else type(error).__name__
    return line if len(line) <= 160 else line[:157] + "..."


def valid_candidates(
    node: OpNode, axis_size: int = 2, max_inputs: int = 3, partial_flavours: tuple[str, ...] = ("sum", "avg")
) -> list[AxisCandidate]:
    """Every single-axis candidate of ``node`` that ``check_rule`` accepts, found by trying
    each combination of input placements (``Replicate``, ``Shard`` of each dim at least
    ``axis_size`` long, ``Partial`` of floating tensors) against each output placement
    (the same kind for every output). DTensor's strategy validation does the same to find
    *missing* rules: valid candidates a rule does not offer.

    Slow (one op run per rank per try): meant for tests and audits of small nodes. Nodes
    with more than ``max_inputs`` tensor inputs return ``[]``.
    """
    if len(node.input_meta) > max_inputs or not node.output_meta:
        return []
    partials = [Partial(f) for f in partial_flavours]

    def options(meta: TensorMeta) -> list[Placement]:
        found: list[Placement] = [Replicate()]
        found += [Shard(d) for d, size in enumerate(meta.shape) if size > 1 and size >= axis_size]
        return found + (partials if meta.dtype.is_floating_point else [])

    out_rank = min(len(m.shape) for m in node.output_meta)
    out_options: list[Placement] = [Replicate()] + [Shard(d) for d in range(out_rank)]
    if all(m.dtype.is_floating_point for m in node.output_meta):
        out_options += partials + [Partial("max"), Partial("min")]
    valid = []
    for incoming in itertools.product(*(options(m) for m in node.input_meta)):
        if all(isinstance(p, Replicate) for p in incoming):
            continue
        for placement in out_options:
            candidate = AxisCandidate(tuple(incoming), tuple(placement for _ in node.output_meta))
            if check_rule(node, candidate, axis_size) is None:
                valid.append(candidate)
    return valid
