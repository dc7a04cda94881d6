"""Which attention ops of a traced program are causal: read from the mask the model builds.

Traced on meta, transformers 5 passes ``scaled_dot_product_attention`` an explicit
(B, 1, S, S) mask and no ``is_causal`` (its ``create_causal_mask``/``sdpa_mask`` builds the
mask from ``arange`` comparisons of query and key positions, and-ed with a packed-sequence
test on the positions); on a real run without padding it takes the causal kernel. Priced or
compiled as the mask it is, such attention costs twice the FLOPs and runs without the flash
kernel.

``attention_mask_kinds`` decides, for every attention op, one of ``MASK_KINDS``:

- ``"none"``: full attention: no mask and not causal, or a mask proven to allow every pair;
- ``"causal"``: ``is_causal=True``, or a mask proven to allow exactly ``j <= i`` for every
  sample and head (query i, key j);
- ``"sliding:W"``: a mask proven to allow exactly ``i - W < j <= i`` (W < S);
- ``"arbitrary"``: a mask not proven to be either (it reads a user input, a parameter, a
  buffer or random numbers; or it is too large to check; or it is another pattern).

The proof is an evaluation, not a guess: a mask whose producers read only constants
(``arange``, literals, lifted tensor constants with values) has one value for the traced
shapes, and that value is computed on the CPU. To keep (B, 1, S, S) masks of long sequences
and large batches cheap, values are held *compact* (a dim along which every slice is equal is
kept as size 1, which broadcasting restores) and elementwise ops whose compact result would
still be large are left lazy. A lazy mask that is an ``and`` of comparisons between sorted key
positions and query positions (HF's are) is decided row by row from where each comparison
cuts the keys (``searchsorted``: O(S log S), any length); any other mask is compared with the
pattern element by element, a block of query rows at a time, up to ``MAX_CHECKED_ELEMENTS``
(S x S) and left ``"arbitrary"`` above.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

__all__ = ["ATTENTION_OPS", "DROPOUT_ARGUMENT", "MASK_KINDS", "attention_mask_kinds", "is_causal_kind", "sliding_window"]

# The fused attention ops (their ATen names without overload).
ATTENTION_OPS = (
    "aten.scaled_dot_product_attention", "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_cudnn_attention",
)
# Index of each attention op's ``is_causal`` and (where it has one) its mask, in its
# positional arguments (ATen schemas).
CAUSAL_ARGUMENT = {
    "aten.scaled_dot_product_attention": 5, "aten._scaled_dot_product_flash_attention": 4,
    "aten._scaled_dot_product_efficient_attention": 6, "aten._scaled_dot_product_cudnn_attention": 6,
}
# Index of each attention op's ``dropout_p`` in its positional arguments (ATen schemas): the
# probability the fused kernel drops attention weights with, drawing its own random numbers.
DROPOUT_ARGUMENT = {
    "aten.scaled_dot_product_attention": 4, "aten._scaled_dot_product_flash_attention": 3,
    "aten._scaled_dot_product_efficient_attention": 5, "aten._scaled_dot_product_cudnn_attention": 5,
}
MASK_ARGUMENT = {
    "aten.scaled_dot_product_attention": 3, "aten._scaled_dot_product_efficient_attention": 3,
    "aten._scaled_dot_product_cudnn_attention": 3,
}
MASK_KEYWORDS = ("attn_mask", "attn_bias")
MASK_KINDS = ("none", "causal", "sliding:W", "arbitrary")

# Largest S x S mask compared element by element (O(S^2) work: about a second at S = 8192
# on one core, 16 times that at 32768); comparisons of positions are decided at any length.
MAX_CHECKED_ELEMENTS = 2 ** 28
# Elementwise results above this many (compact) elements stay lazy; structural ops (index,
# cumsum, diff, ...) may not produce more than STRUCTURAL_LIMIT (a (global batch, S) position
# table of 2048 x 8192 is 2^24).
EAGER_ELEMENTS = 2 ** 22
STRUCTURAL_LIMIT = 2 ** 25

# Ops computed element by element with broadcasting: they can run on compact operands.
_ELEMENTWISE = frozenset({
    "add", "sub", "rsub", "mul", "div", "le", "lt", "ge", "gt", "eq", "ne", "__and__", "__or__", "__xor__",
    "__invert__", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "logical_and", "logical_or",
    "logical_not", "logical_xor", "where", "masked_fill", "to", "_to_copy", "clone", "neg", "abs", "remainder",
    "fmod", "floor_divide", "minimum", "maximum", "clamp", "clamp_min", "clamp_max", "sign", "alias",
    "contiguous", "detach", "lift_fresh_copy", "type_as",
})
_AND = ("__and__", "bitwise_and", "logical_and")
# Ops that only give a value a larger (broadcast) shape: a compact value is already that.
_BROADCASTS = frozenset({"expand", "expand_as"})
# Ops whose results are random: a mask that reads them has no value to prove anything by.
_RANDOM = ("rand", "bernoulli", "dropout", "normal", "multinomial", "uniform", "exponential")


def is_causal_kind(kind: str | None) -> bool:
    """Whether ``kind`` (an ``OpNode.attention_mask_kind``) is plain causal attention."""
    return kind == "causal"


def sliding_window(kind: str | None) -> int | None:
    """The window W of a ``"sliding:W"`` kind, else None."""
    if kind is None or not kind.startswith("sliding:"):
        return None
    return int(kind.split(":", 1)[1])


def attention_mask_kinds(graph_module: torch.fx.GraphModule, constants: dict[str, torch.Tensor]) -> dict[str, str]:
    """Node name -> mask kind (module docstring) of every attention op of ``graph_module``.

    Args:
        graph_module: an exported (ATen) program, with ``meta["val"]`` on its nodes.
        constants: placeholder name -> value of its lifted tensor constants (the only
            placeholders a provable mask may read).
    """
    kinds: dict[str, str] = {}
    decided: dict[tuple[str, int, int], str] = {}  # (mask node, Sq, Sk) -> kind: one mask serves many layers
    for node in graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        op = str(node.target).rsplit(".", 1)[0]
        if op not in CAUSAL_ARGUMENT:
            continue
        causal_index = CAUSAL_ARGUMENT[op]
        if (len(node.args) > causal_index and node.args[causal_index] is True) or node.kwargs.get("is_causal") is True:
            kinds[node.name] = "causal"
            continue
        mask = _mask_argument(node, op)
        if mask is None:
            kinds[node.name] = "none"
            continue
        lengths = _query_key_lengths(node)
        if not isinstance(mask, torch.fx.Node) or lengths is None:
            kinds[node.name] = "arbitrary"
            continue
        key = (mask.name, *lengths)
        if key not in decided:
            decided[key] = _mask_kind(mask, *lengths, constants)
        kinds[node.name] = decided[key]
    return kinds


def _mask_argument(node: torch.fx.Node, op: str) -> Any:
    index = MASK_ARGUMENT.get(op)
    if index is not None and len(node.args) > index:
        return node.args[index]
    return next((node.kwargs[name] for name in MASK_KEYWORDS if node.kwargs.get(name) is not None), None)


def _query_key_lengths(node: torch.fx.Node) -> tuple[int, int] | None:
    query, key = (arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None for arg in node.args[:2])
    if not isinstance(query, torch.Tensor) or not isinstance(key, torch.Tensor) or query.dim() < 2 or key.dim() < 2:
        return None
    return int(query.shape[-2]), int(key.shape[-2])


class _Unprovable(Exception):
    """The mask reads something without a value here, or is too large to check."""


@dataclass(frozen=True)
class _Lazy:
    """An elementwise op not computed yet (its compact result would be large): ``target``
    applied to ``args``/``kwargs`` (whose tensors are compact values or other ``_Lazy``)."""

    target: Any
    args: tuple
    kwargs: dict
    shape: tuple[int, ...]
    dtype: torch.dtype | None


def _mask_kind(mask: torch.fx.Node, q_len: int, kv_len: int, constants: dict[str, torch.Tensor]) -> str:
    shape = _shape_of(mask)
    if q_len != kv_len or len(shape) < 2 or shape[-2:] != (q_len, kv_len):
        return "arbitrary"  # a mask that broadcasts over the query rows is no causal mask
    try:
        value = _MaskEvaluator(constants).value_of(mask)
        intervals = _row_intervals(value, q_len) if _dtype_of(mask) == torch.bool else None
        if intervals is not None:
            return _pattern_of_intervals(*intervals, q_len)
        if q_len * kv_len > MAX_CHECKED_ELEMENTS:
            return "arbitrary"
        return _pattern_of(value, _dtype_of(mask), q_len)
    except _Unprovable:
        return "arbitrary"
    except Exception:  # noqa: BLE001 - an op that cannot run here proves nothing; tracing goes on
        return "arbitrary"


def _shape_of(node: torch.fx.Node) -> tuple[int, ...]:
    value = node.meta.get("val")
    return tuple(int(d) for d in value.shape) if isinstance(value, torch.Tensor) else ()


def _dtype_of(node: torch.fx.Node) -> torch.dtype | None:
    value = node.meta.get("val")
    return value.dtype if isinstance(value, torch.Tensor) else None


class _MaskEvaluator:
    """Computes the value of a node that depends on constants only (compact or lazy)."""

    def __init__(self, constants: dict[str, torch.Tensor]) -> None:
        self.constants = constants
        self.values: dict[str, Any] = {}

    def value_of(self, node: torch.fx.Node) -> Any:
        """The node's value; ``_Unprovable`` when it reads data without a value here."""
        order: list[torch.fx.Node] = []
        seen: set[str] = set()
        stack: list[tuple[torch.fx.Node, bool]] = [(node, False)]
        while stack:  # producers first (iterative: masks of deep graphs)
            current, expanded = stack.pop()
            if expanded:
                order.append(current)
                continue
            if current.name in seen:
                continue
            seen.add(current.name)
            stack.append((current, True))
            stack.extend((arg, False) for arg in current.all_input_nodes if arg.name not in seen)
        for current in order:
            if current.name not in self.values:
                self.values[current.name] = self._compute(current)
        return self.values[node.name]

    def _compute(self, node: torch.fx.Node) -> Any:
        if node.op == "placeholder":
            if node.name not in self.constants:
                raise _Unprovable(f"reads input {node.name}")
            return _compact(self.constants[node.name])
        if node.op != "call_function":
            raise _Unprovable(f"{node.op} {node.target}")
        if node.target is operator.getitem:
            return self.values[node.args[0].name][node.args[1]]
        if not isinstance(node.target, torch._ops.OpOverload):
            raise _Unprovable(f"calls {node.target}")
        name = node.target.overloadpacket.__name__
        if any(word in name for word in _RANDOM):
            raise _Unprovable(f"random op {name}")
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda arg: self.values[arg.name])
        kwargs = _on_cpu(kwargs)
        shape = _shape_of(node)
        if name in _BROADCASTS:
            value = args[0]
            return _Lazy(value.target, value.args, value.kwargs, shape, value.dtype) if isinstance(value, _Lazy) else value
        if name in _ELEMENTWISE:
            return _elementwise(node.target, args, kwargs, shape, _dtype_of(node))
        # Any other op reads its operands at their full (traced) shapes: broadcast views.
        if math.prod(shape) > STRUCTURAL_LIMIT:
            raise _Unprovable(f"{name} makes {math.prod(shape)} elements")
        full_args, full_kwargs = _full_tree(node.args, args), _full_tree(node.kwargs, kwargs)
        result = node.target(*full_args, **full_kwargs)
        return tuple(_compact(r) for r in result) if isinstance(result, (tuple, list)) else _compact(result)


def _on_cpu(kwargs: dict) -> dict:
    """The op's keyword arguments with any device replaced by the CPU (the traced program
    names meta or the accelerator; the values are computed here)."""
    return {key: (torch.device("cpu") if key == "device" else value) for key, value in kwargs.items()}


def _full_tree(traced: Any, values: Any) -> Any:
    """The values of an op's arguments (``values``, laid out as ``traced``, its fx arguments)
    with each tensor at its traced shape: a broadcast view of its compact value, no copy."""
    if isinstance(traced, torch.fx.Node):
        value = values
        if isinstance(value, _Lazy):
            if math.prod(value.shape) > STRUCTURAL_LIMIT:
                raise _Unprovable("a large lazy value read whole")
            value = _rows(value, None)
        shape = _shape_of(traced)
        return value.expand(shape) if isinstance(value, torch.Tensor) and tuple(value.shape) != shape else value
    if isinstance(traced, (list, tuple)):
        return type(traced)(_full_tree(t, v) for t, v in zip(traced, values))
    if isinstance(traced, dict):
        return {key: _full_tree(traced[key], values[key]) for key in traced}
    return values


def _elementwise(target: Any, args: tuple, kwargs: dict, shape: tuple[int, ...], dtype: torch.dtype | None) -> Any:
    tensors = [value for value in (*args, *kwargs.values()) if isinstance(value, (torch.Tensor, _Lazy))]
    compact = torch.broadcast_shapes(*(_compact_shape(value) for value in tensors)) if tensors else ()
    if any(isinstance(value, _Lazy) for value in tensors) or math.prod(compact) > EAGER_ELEMENTS:
        same = _identity_operand(target, tensors, dtype)
        if same is not None:  # skip a pass over every (query, key) pair
            return _Lazy(same.target, same.args, same.kwargs, shape, dtype)
        return _Lazy(target, tuple(args), dict(kwargs), shape, dtype)
    return _compact(target(*args, **kwargs))


def _identity_operand(target: Any, tensors: list, dtype: torch.dtype | None) -> _Lazy | None:
    """The lazy operand an op returns unchanged, if any: a cast of a lazy boolean value to
    bool, or a boolean ``and`` of it with a compact all-true tensor (HF's ``new_ones`` and its
    packed-sequence test of positions 0..S-1)."""
    name = target.overloadpacket.__name__
    lazy = [value for value in tensors if isinstance(value, _Lazy)]
    if dtype != torch.bool or len(lazy) != 1 or lazy[0].dtype != torch.bool:
        return None
    others = [value for value in tensors if value is not lazy[0]]
    if name in ("to", "_to_copy") and not others:
        return lazy[0]
    if name in _AND and len(others) == 1 and others[0].dtype == torch.bool and bool(others[0].all()):
        return lazy[0]
    return None


def _compact_shape(value: Any) -> tuple[int, ...]:
    if isinstance(value, _Lazy):
        shapes = [_compact_shape(v) for v in (*value.args, *value.kwargs.values()) if isinstance(v, (torch.Tensor, _Lazy))]
        return tuple(torch.broadcast_shapes(*shapes)) if shapes else ()
    return tuple(value.shape)


def _compact(value: Any) -> Any:
    """``value`` with every dim along which all slices are equal cut to size 1."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.numel() > STRUCTURAL_LIMIT:
        raise _Unprovable("a value too large to hold")
    for dim in range(value.dim()):
        if value.shape[dim] > 1:
            first = value.narrow(dim, 0, 1)
            if torch.equal(value, first.expand_as(value)):
                value = first
    return value.contiguous()


def _rows(value: Any, rows: tuple[int, int] | None) -> Any:
    """``value`` (compact or lazy) for query rows ``rows`` (dim -2; all rows when None)."""
    if isinstance(value, _Lazy):
        args = tuple(_rows(arg, rows) for arg in value.args)
        kwargs = {key: _rows(arg, rows) for key, arg in value.kwargs.items()}
        return value.target(*args, **kwargs)
    if isinstance(value, torch.Tensor) and rows is not None and value.dim() >= 2 and value.shape[-2] > 1:
        return value[..., rows[0]:rows[1], :]
    return value


def _pattern_of(value: Any, dtype: torch.dtype | None, length: int) -> str:
    """``"causal"``, ``"sliding:W"`` or ``"arbitrary"``: what ``value`` (a mask of (..., S, S))
    allows, checked a block of query rows at a time against the band its last row gives."""
    last = _allowed(_rows(value, (length - 1, length)), dtype, 1, length)
    window = int(last.reshape(-1, length)[0].sum())
    if window == 0:
        return "arbitrary"
    block = max(1, EAGER_ELEMENTS // length)
    # The band allows (i, j) when 0 <= i - j < W: with the keys reversed (j' = S-1-j), row i
    # is band[i : i + S] of one vector, so every block is a strided view of it (no copy).
    offsets = torch.arange(2 * length - 1) - (length - 1)  # i - j for i + j' = 0 .. 2S-2
    band = (offsets >= 0) & (offsets < window)
    banded, full = True, window == length  # full: every pair allowed, as no mask at all
    for start in range(0, length, block):
        stop = min(length, start + block)
        allowed = _allowed(_rows(value, (start, stop)), dtype, stop - start, length)
        expected = band.as_strided((stop - start, length), (1, 1), start)
        banded = banded and torch.equal(allowed.flip(-1), expected.expand(allowed.shape))
        full = full and bool(allowed.all())
        if not (banded or full):
            return "arbitrary"
    if full:
        return "none"
    return "causal" if window >= length else f"sliding:{window}"


def _allowed(block: Any, dtype: torch.dtype | None, rows: int, length: int) -> torch.Tensor:
    """Which (query, key) pairs a mask block of ``rows`` query rows lets through, as a boolean
    tensor of (..., rows, length): a boolean mask as it is; an additive float mask's zeros,
    provided every other entry blocks (-inf or the dtype's lowest value, which softmax turns
    into exact zeros), else ``_Unprovable``."""
    block = torch.as_tensor(block)
    block = block.reshape((1,) * max(0, 2 - block.dim()) + tuple(block.shape))
    block = block.expand(*block.shape[:-2], rows, length)
    if dtype == torch.bool:
        return block.to(torch.bool)
    if dtype is None or not dtype.is_floating_point:
        raise _Unprovable(f"a mask of {dtype}")
    allowed = block == 0
    blocked = (block == float("-inf")) | (block <= torch.finfo(dtype).min)
    if not bool((allowed | blocked).all()):
        raise _Unprovable("an additive mask with biases other than 0 and -inf")
    return allowed


# ------------------------------------------------------- masks that compare position vectors

# A comparison of key position k_j with query position q_i, and the same with the operands
# swapped (q_i > k_j is k_j < q_i).
_COMPARISONS = ("le", "lt", "ge", "gt")
_SWAPPED = {"le": "ge", "lt": "gt", "ge": "le", "gt": "lt"}


def _row_intervals(value: Any, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(lo, hi)``: for each query row i, the keys a lazy boolean mask allows are exactly
    ``lo[i] <= j < hi[i]``; or None when the mask is not an ``and`` of comparisons between a
    non-decreasing vector of key positions and a vector of query positions (HF's masks are:
    ``kv_idx <= q_idx``, and ``kv_idx > q_idx - W`` for a window), which the caller then checks
    pair by pair. Exact: with k sorted, ``{j : k_j <= t}`` is the prefix ``searchsorted(k, t,
    right=True)`` long, and so on for the other comparisons."""
    if not isinstance(value, _Lazy):
        return None
    name = value.target.overloadpacket.__name__
    if name in _AND and len(value.args) == 2 and not value.kwargs:
        parts = [_row_intervals(arg, length) for arg in value.args]
        if any(part is None for part in parts):
            return None
        (lo_a, hi_a), (lo_b, hi_b) = parts
        return torch.maximum(lo_a, lo_b), torch.minimum(hi_a, hi_b)
    if name not in _COMPARISONS or len(value.args) != 2 or value.kwargs:
        return None
    first, second = value.args
    keys, queries, op = _position_vector(first, -1, length), _position_vector(second, -2, length), name
    if keys is None or queries is None:  # q_i op k_j: the swapped test of k_j against q_i
        keys, queries, op = _position_vector(second, -1, length), _position_vector(first, -2, length), _SWAPPED[name]
    if keys is None or queries is None or not bool((keys[1:] >= keys[:-1]).all()):
        return None
    cut = torch.searchsorted(keys, queries, right=op in ("le", "gt"))
    if op in ("le", "lt"):  # a prefix of the keys
        return torch.zeros_like(cut), cut
    return cut, torch.full_like(cut, length)  # a suffix


def _position_vector(value: Any, dim: int, length: int) -> torch.Tensor | None:
    """A compact tensor that varies along ``dim`` only (size ``length`` there, 1 elsewhere), as
    a vector of ``length`` integer positions; None for anything else."""
    if not isinstance(value, torch.Tensor) or value.dtype.is_floating_point or value.dtype == torch.bool:
        return None
    if value.dim() < -dim or value.shape[dim] != length or value.numel() != length:
        return None
    return value.reshape(length).to(torch.int64)


def _pattern_of_intervals(lo: torch.Tensor, hi: torch.Tensor, length: int) -> str:
    """The kind of a mask whose row i allows keys ``lo[i] <= j < hi[i]``."""
    rows = torch.arange(length)
    if bool((lo <= 0).all()) and bool((hi >= length).all()):
        return "none"
    if not torch.equal(hi.clamp(max=length), rows + 1):
        return "arbitrary"
    lo = lo.clamp(min=0)
    if bool((lo == 0).all()):
        return "causal"
    window = int(hi[-1] - lo[-1])
    return f"sliding:{window}" if torch.equal(lo, (rows + 1 - window).clamp(min=0)) else "arbitrary"

