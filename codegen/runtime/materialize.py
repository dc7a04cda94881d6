"""Per-shard initialisation: build the model with its parameters on the meta device, then give
each rank only the values of the parameter shards it holds.

The initial value of every parameter is a function of its qualified name and shape only, so
a run starts from the same weights whatever the plan, mesh or world size (and the
single-device reference of ``launch.py --check`` uses the same function):

- The distribution is PyTorch's default ``reset_parameters`` distribution of the module that
  owns the parameter (:func:`init_rule`): ``nn.Linear``/``nn.Conv*`` weights and biases
  ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, ``nn.Embedding`` ``N(0, 1)`` (its ``padding_idx`` row
  0), norm layers' weights 1 and biases 0. A parameter of any other module is drawn as a
  Linear weight of the same fan-in when it has 2 or more dims, else 0 when its name ends in
  ``bias`` and 1 otherwise. A HuggingFace model (one whose ``config`` has
  ``initializer_range``) gets what its ``_init_weights`` does in most architectures: every
  parameter of 2 or more dims ``N(0, initializer_range)`` (an embedding's padding row 0),
  biases 0, other 1-D parameters 1. Any other custom init of a model is NOT reproduced:
  rank-local shards cannot run a module's init code on the whole tensor.
- The values are drawn in fixed chunks of :data:`CHUNK_ELEMENTS` elements of the flattened
  tensor, each chunk from its own generator seeded by ``sha256(seed, name, chunk index)``;
  a shard draws only the chunks of the rows it covers (dim 0), a block of rows at a time,
  and keeps its columns. So the value at an index never depends on who draws it, and a rank
  holds at most its shards plus one block of :data:`CHUNK_ELEMENTS` elements.

A program that replaces a layer with a runtime one (an MoE layer keeping this rank's experts)
gives it parameters made from the model's with :func:`set_derived_parameter` (rows of dim 0
and/or a range of one dim of a model parameter): on real tensors a copy of that part; on
meta an empty parameter that :func:`materialize` fills with the values that part of the model
parameter gets, drawn like any shard, so the rank never holds the rest. Either way the part
is recorded (a :class:`Derivation`), and :func:`name_derived_sources` notes which model
parameter it is part of: checkpoints save it under that name (``codegen.runtime.derived_checkpoint``).

Buffers are not parameters: the model's constructor computes them (causal masks, rotary
frequencies), so ``planner.model_spec.parameters_on_meta`` keeps them real while it sends parameters to meta.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

# Elements per independently seeded chunk of a flattened parameter (4 MiB of fp32): large
# enough that seeding costs nothing, small enough to bound a rank's transient memory.
CHUNK_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class InitRule:
    """How a parameter's initial values are distributed: ``kind`` is ``"uniform"`` (on
    ``[low, high)``), ``"normal"`` (mean ``low``, standard deviation ``high``) or ``"constant"``
    (every value ``low``). ``zero_row`` is a dim-0 index set to 0 (an embedding's padding row)."""

    kind: str
    low: float
    high: float = 0.0
    zero_row: int | None = None


def init_rule(owner: nn.Module | None, key: str, shape: tuple[int, ...]) -> InitRule:
    """The distribution of parameter ``key`` of module ``owner`` with full ``shape`` (see the
    module docstring): PyTorch's default ``reset_parameters`` distribution for its type."""
    if isinstance(owner, nn.Embedding):
        return InitRule("normal", 0.0, 1.0, owner.padding_idx)
    norms = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase, getattr(nn, "RMSNorm", nn.LayerNorm))
    if isinstance(owner, norms) or (len(shape) < 2 and not isinstance(owner, (nn.Linear, nn.modules.conv._ConvNd))):
        return InitRule("constant", 0.0 if key.endswith("bias") else 1.0)
    if isinstance(owner, (nn.Linear, nn.modules.conv._ConvNd)):
        weight = owner.weight
        fan_in = math.prod(weight.shape[1:])
    else:
        fan_in = math.prod(shape[1:])
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    return InitRule("uniform", -bound, bound)


def _chunk_seed(seed: int, name: str, chunk: int) -> int:
    digest = hashlib.sha256(f"{seed}:{name}:{chunk}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _draw_flat(rule: InitRule, seed: int, name: str, numel: int, start: int, stop: int) -> torch.Tensor:
    """Elements ``[start, stop)`` of the flattened parameter ``name`` (``numel`` elements), fp32."""
    if rule.kind == "constant":
        return torch.full((stop - start,), rule.low, device="cpu")
    pieces = []
    for chunk in range(start // CHUNK_ELEMENTS, (stop - 1) // CHUNK_ELEMENTS + 1):
        first = chunk * CHUNK_ELEMENTS
        count = min(CHUNK_ELEMENTS, numel - first)
        generator = torch.Generator().manual_seed(_chunk_seed(seed, name, chunk))
        if rule.kind == "uniform":
            values = torch.rand(count, generator=generator, device="cpu") * (rule.high - rule.low) + rule.low
        else:
            values = torch.randn(count, generator=generator, device="cpu") * rule.high + rule.low
        pieces.append(values[max(start - first, 0) : min(stop - first, count)])
    return torch.cat(pieces)


def draw_region(
    rule: InitRule, seed: int, name: str, shape: tuple[int, ...], offset: tuple[int, ...], local_shape: tuple[int, ...]
) -> Iterator[tuple[int, torch.Tensor]]:
    """The initial values of the block of parameter ``name`` (full ``shape``) starting at
    ``offset`` with ``local_shape``, in pieces of whole dim-0 rows of at most about
    :data:`CHUNK_ELEMENTS` elements: yields ``(first local row, values)``."""
    if len(shape) == 0:
        yield 0, _draw_flat(rule, seed, name, 1, 0, 1).reshape(())
        return
    if math.prod(local_shape) == 0:
        return
    row = math.prod(shape[1:])
    rows_per_block = max(1, CHUNK_ELEMENTS // max(row, 1))
    inner = tuple(slice(o, o + n) for o, n in zip(offset[1:], local_shape[1:]))
    numel = math.prod(shape)
    for first in range(0, local_shape[0], rows_per_block):
        last = min(first + rows_per_block, local_shape[0])
        start, stop = (offset[0] + first) * row, (offset[0] + last) * row
        block = _draw_flat(rule, seed, name, numel, start, stop).reshape(last - first, *shape[1:])
        if rule.zero_row is not None and offset[0] + first <= rule.zero_row < offset[0] + last:
            block[rule.zero_row - offset[0] - first].zero_()
        yield first, block[(slice(None), *inner)]


@dataclass(frozen=True)
class Derivation:
    """Which part of a model parameter (``source``) a runtime parameter holds: the dim-0
    ``rows`` in that order (None: every row), narrowed to ``[start, stop)`` on dim ``dim``
    (None: whole). ``source`` is a meta tensor of the model parameter's shape and dtype (the
    parameter itself when it was on meta): a record holds no values."""

    source: torch.Tensor
    rows: tuple[int, ...] | None = None
    dim: int | None = None
    start: int = 0
    stop: int = 0
    source_name: str = ""  # the source's name in the model as built (name_derived_sources)
    source_id: int = 0  # id() of the model parameter it was made from, until it is named

    @property
    def whole(self) -> bool:
        """Whether the part is the whole source (the same values, under the source's name)."""
        return self.rows is None and self.dim is None

    def part_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This part of ``tensor`` (a tensor shaped like the source), a view where possible."""
        if self.rows is not None:
            tensor = tensor[list(self.rows)]
        if self.dim is not None:
            tensor = tensor.narrow(self.dim, self.start, self.stop - self.start)
        return tensor


# The attribute of a module that maps its derived parameters' names to their derivations.
DERIVED_ATTRIBUTE = "derived_parameters"


def set_derived_parameter(module: nn.Module, attribute: str, source: torch.Tensor, rows: Sequence[int] | None = None,
                          dim: int | None = None, start: int = 0, stop: int | None = None) -> nn.Parameter:
    """Register on ``module`` a new parameter ``attribute`` holding ``source[rows]`` (every row
    when None), narrowed to ``[start, stop)`` on ``dim`` when given, and return it. On real
    tensors it is a copy of those values; on meta an empty meta parameter that
    :func:`materialize` fills with what that part of ``source`` (a model parameter) is
    initialised with. The derivation is kept in ``module.derived_parameters`` by attribute
    name, which wrappers such as FSDP2 leave in place when they replace the parameter; it
    keeps only the source's shape and dtype, never its values."""
    if dim is not None and stop is None:
        stop = source.shape[dim]
    shape_only = source if source.device.type == "meta" else torch.empty(source.shape, dtype=source.dtype, device="meta")
    derivation = Derivation(shape_only, None if rows is None else tuple(int(r) for r in rows), dim, start,
                            0 if stop is None else stop, source_id=id(source))
    param = nn.Parameter(derivation.part_of(source.detach()).clone())
    setattr(module, attribute, param)
    module.__dict__.setdefault(DERIVED_ATTRIBUTE, {})[attribute] = derivation
    return param


def derived_parameters(model: nn.Module) -> dict[str, Derivation]:
    """Qualified name -> derivation of every derived parameter in ``model``."""
    return {
        f"{path}.{attribute}" if path else attribute: derivation
        for path, module in model.named_modules()
        for attribute, derivation in module.__dict__.get(DERIVED_ATTRIBUTE, {}).items()
    }


def name_derived_sources(model: nn.Module, sources: dict[str, torch.Tensor]) -> int:
    """Note in every derivation in ``model`` the name of the model parameter it is part of.
    ``sources`` maps each name to its parameter in the model as the spec built it, before
    ``parallelize`` replaced layers (``dict(model.named_parameters())`` taken then, and held
    until this call, so no parameter's id() was reused meanwhile). Returns how many were named."""
    by_id: dict[int, str] = {}
    for name, tensor in sources.items():
        by_id.setdefault(id(tensor), name)
    return _name_sources_by_id(model, by_id)


def _name_sources_by_id(model: nn.Module, by_id: dict[int, str]) -> int:
    named = 0
    for module in model.modules():
        derived = module.__dict__.get(DERIVED_ATTRIBUTE, {})
        for attribute, derivation in derived.items():
            source = by_id.get(derivation.source_id)
            if source is not None and not derivation.source_name:
                derived[attribute] = dataclasses.replace(derivation, source_name=source)
                named += 1
    return named


def parameter_names(model: nn.Module) -> dict[int, str]:
    """id of each parameter of ``model`` -> its qualified name (a tied weight: its first name)."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    return names


def _owner_rules(model: nn.Module, shapes: dict[str, tuple[int, ...]]) -> dict[str, InitRule]:
    rules = {}
    for name, shape in shapes.items():
        path, _, key = name.rpartition(".")
        owner = model.get_submodule(path) if path else model
        rules[name] = init_rule(owner, key, shape)
    return rules


def init_rules(model: nn.Module) -> dict[str, InitRule]:
    """Qualified name -> :class:`InitRule` of every (distinct) parameter of ``model``: the
    owning module's PyTorch default, or a HuggingFace model's ``initializer_range`` normal."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    std = getattr(getattr(model, "config", None), "initializer_range", None)
    if not isinstance(std, (int, float)) or isinstance(std, bool):
        return _owner_rules(model, shapes)
    rules = {}
    for name, shape in shapes.items():
        path, _, key = name.rpartition(".")
        owner = model.get_submodule(path) if path else model
        if len(shape) >= 2:
            rules[name] = InitRule("normal", 0.0, float(std), getattr(owner, "padding_idx", None))
        else:
            rules[name] = InitRule("constant", 0.0 if key.endswith("bias") else 1.0)
    return rules


def materialize(module: nn.Module, model: nn.Module, device: torch.device, rules: dict[str, InitRule], seed: int = 0,
                source_names: dict[int, str] | None = None) -> int:
    """Give every meta parameter of ``module`` (what ``parallelize`` returned, or the model
    itself) real storage on ``device`` holding its initial values: a DTensor parameter only
    its local shard, a plain one the whole tensor. ``model`` is the model built from the spec
    (``parallelize`` changed it in place, so its names are the parameters' names); ``rules``
    come from :func:`init_rules` on the model as built. The parameter objects are kept (their
    storage swapped in, hooks registered again), so optimizers, FSDP2 and tied weights that
    hold them stay valid. Returns the number of bytes materialised on this rank.

    Derived parameters (:func:`set_derived_parameter`) are initialised as their part of the
    model parameter :func:`name_derived_sources` named, or that ``source_names``
    (:func:`parameter_names` of the model before ``parallelize``) names.

    Raises:
        ValueError: a meta parameter of ``module`` that the model does not hold and that was
            not derived from one of its parameters (a program that rebuilt a weight in
            another form must be built from the whole model), or a part of a parameter that
            a wrapper then sharded again.
    """
    if source_names:
        _name_sources_by_id(model, source_names)
    with _weak_references_released(module):
        return _materialize_all(module, model, device, rules, seed)


def _materialize_all(module: nn.Module, model: nn.Module, device: torch.device, rules: dict[str, InitRule],
                     seed: int) -> int:
    names = parameter_names(model)
    derived = derived_parameters(model)
    done: set[int] = set()
    total = 0
    for param in module.parameters():
        if id(param) in done or param.device.type != "meta":
            continue
        done.add(id(param))
        name = names.get(id(param))
        derivation = derived.get(name) if name is not None else None
        if derivation is not None and derivation.source_name:
            source = derivation.source_name
            if derivation.whole:  # the same values as the source, however a wrapper shards them
                total += _materialize_parameter(param, source, device, rules[source], seed)
            elif isinstance(param, DTensor) and derivation.dim is not None:
                raise ValueError(f"{name}: a range of {source} sharded again by a wrapper cannot be materialised; "
                                 "build this program from the whole model")
            else:
                total += _materialize_derived(param, source, device, rules[source], seed, derivation)
            continue
        if name is None or name not in rules:
            raise ValueError(f"a meta parameter of shape {tuple(param.shape)} is not a parameter of the model built from the spec")
        total += _materialize_parameter(param, name, device, rules[name], seed)
    return total


def _materialize_derived(param: nn.Parameter, name: str, device: torch.device, rule: InitRule, seed: int,
                         derivation: Derivation) -> int:
    """Fill a derived parameter with its part of model parameter ``name`` (full shape from
    the source): one region per kept row, or one for all rows, each drawn as a shard is. A
    derived parameter that a wrapper sharded again (a DTensor: rows of the source, an expert
    sharded over its copies by FSDP2) gets only its local shard of those rows."""
    shape = tuple(derivation.source.shape)
    rows = list(derivation.rows) if derivation.rows is not None else list(range(shape[0]))
    inner_offset, inner_extent = [0] * (len(shape) - 1), list(shape[1:])
    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import (
            compute_local_shape_and_global_offset,  # DTensor's own shard maths
        )

        local_shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        rows = rows[offset[0] : offset[0] + local_shape[0]]
        inner_offset, inner_extent = list(offset[1:]), list(local_shape[1:])
        local = torch.empty(tuple(local_shape), dtype=param.dtype, device=device)
        value = DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    else:
        local = value = torch.empty(tuple(param.shape), dtype=param.dtype, device=device)
    if derivation.rows is None and not isinstance(param, DTensor):
        regions = [(0, 0, shape[0])]  # (first local row, first source row, rows)
    else:
        regions = [(position, row, 1) for position, row in enumerate(rows)]
    for position, row, count in regions:
        offset, extent = [row, *inner_offset], [count, *inner_extent]
        if derivation.dim is not None:
            if derivation.dim == 0:
                raise ValueError(f"{name}: a derived part narrows dim 0 by its rows, not by a range")
            offset[derivation.dim], extent[derivation.dim] = derivation.start, derivation.stop - derivation.start
        with torch.no_grad():
            for first, block in draw_region(rule, seed, name, shape, tuple(offset), tuple(extent)):
                local[position + first : position + first + block.shape[0]].copy_(block)
    _swap_storage(param, value)
    return local.numel() * local.element_size()


@contextlib.contextmanager
def _weak_references_released(module: nn.Module) -> Iterator[None]:
    """Drop the weak references recurrent layers keep to their weights while they are swapped.

    ``torch.utils.swap_tensors`` refuses a tensor that has a weak reference, and every
    ``nn.LSTM``/``nn.GRU``/``nn.RNN`` (``nn.RNNBase``) keeps one to each of its weights (for
    cuDNN's flattened copy). The references are dropped for the swap and rebuilt afterwards
    by the layer itself (``_init_flat_weights``, which reads the same parameter objects), so
    the layer runs on the materialised values."""
    recurrent = [layer for layer in module.modules() if isinstance(layer, nn.RNNBase)]
    for layer in recurrent:
        layer._flat_weight_refs = []
    try:
        yield
    finally:
        for layer in recurrent:
            if all(weight is None or weight.device.type != "meta" for weight in layer._flat_weights):
                layer._init_flat_weights()
            else:  # still on meta (a failure above): references back, nothing to flatten
                layer._flat_weight_refs = [None if w is None else weakref.ref(w) for w in layer._flat_weights]


def _swap_storage(param: nn.Parameter, value: torch.Tensor) -> None:
    """Swap ``value`` into the existing parameter object: everything holding it (FSDP2, tied
    modules, the program's tables) sees it. Tensor hooks live on the swapped-out storage, so
    they are registered again."""
    hooks = list(param._backward_hooks.values()) if param._backward_hooks else []
    torch.utils.swap_tensors(param, nn.Parameter(value, requires_grad=param.requires_grad))
    param._backward_hooks = None
    for hook in hooks:
        param.register_hook(hook)


def _materialize_parameter(param: nn.Parameter, name: str, device: torch.device, rule: InitRule, seed: int) -> int:
    shape = tuple(param.shape)
    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import (
            compute_local_shape_and_global_offset,  # DTensor's own shard maths
        )

        local_shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        local = torch.empty(tuple(local_shape), dtype=param.dtype, device=device)
        value = DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    else:
        local_shape, offset = shape, (0,) * len(shape)
        local = value = torch.empty(shape, dtype=param.dtype, device=device)
    with torch.no_grad():
        for first, block in draw_region(rule, seed, name, shape, tuple(offset), tuple(local_shape)):
            if local.dim() == 0:
                local.copy_(block)
            else:
                local[first : first + block.shape[0]].copy_(block)
    _swap_storage(param, value)
    return local.numel() * local.element_size()
