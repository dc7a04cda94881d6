"""What a program generated from the traced graph imports: ``SpmdModule`` and its helpers.

The generated ``model_spmd.py`` replays the model's exported ATen graph op by op on
DTensors (``torch.distributed.tensor``): every parameter and every input is a DTensor placed
as the plan says (one placement per mesh axis), each op runs through DTensor's sharding
rules, and ``SpmdModule._to`` redistributes a value wherever the plan says its consumer
reads it differently (the collective is named in a comment next to each call). Values no
DTensor ever touches (masks and positions built from ``arange``) stay plain tensors, the
same on every rank.

Two things DTensor does not do for us are done here:

- gradients end in their parameter's planned placements: a replicated weight used on
  batch-split activations gets partial-sum gradients, which a hook all-reduces (or
  reduce-scatters, for a sharded weight) before they are accumulated;
- an op DTensor has no sharding rule for runs on replicated inputs (``_replicated``) or
  as its ATen decomposition (``_decomposed``), never crashing and never silently wrong.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement
from torch.utils._pytree import tree_map

from codegen.runtime.loss_parallel import vocabulary_parallel_cross_entropy

Placements = tuple[Placement, ...]

__all__ = ["SpmdModule", "as_partial_sums", "contiguous_local", "keep_whole", "shard_inputs", "same_placements"]


def same_placements(left: Sequence[Placement], right: Sequence[Placement]) -> bool:
    """Whether two placement tuples lay a tensor out alike (any partial sum equals ``Partial``
    of the same reduce op, e.g. the masked partial sums of a vocabulary-parallel embedding)."""
    if len(left) != len(right):
        return False
    for a, b in zip(left, right):
        if isinstance(a, Partial) and isinstance(b, Partial):
            if a.reduce_op != b.reduce_op:
                return False
        elif a != b:
            return False
    return True


def replicate_partials(placements: Sequence[Placement]) -> Placements:
    """Parameters and inputs are whole values: a ``Partial`` among their planned placements
    is held replicated (a DTensor cannot be built from a whole tensor as partial sums)."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


class SpmdModule(nn.Module):
    """This rank's module of a graph program: the model's parameters as DTensors, and the
    helpers the generated ``forward`` calls.

    Args:
        model: the whole model, built identically on every rank (same seed). Its parameters
            are replaced in place by DTensor parameters, so ``model.named_parameters()`` and
            this module's ``parameters()`` are the sharded ones the optimizer steps.
        mesh: the device mesh of the plan.
        parameters: qualified name -> planned placements of every parameter the graph reads.
        dropout_modules: dropout op (node name) -> path of the ``nn.Dropout`` whose ``p`` it
            reads at run time (so ``module.p = 0`` or ``eval()`` switch it off as in the model),
            or ``(module path, attribute)`` of the float attribute it reads.
    """

    def __init__(
        self,
        model: nn.Module,
        mesh: DeviceMesh,
        parameters: Mapping[str, Placements],
        dropout_modules: Mapping[str, str | tuple[str, str]] | None = None,
        local_parameters: Sequence[str] = (),
    ) -> None:
        super().__init__()
        self.model = model
        self.mesh = mesh
        cuda = mesh.device_type == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device(mesh.device_type)
        self._dropout_modules = dict(dropout_modules or {})
        self.params = distribute_parameters(model, mesh, parameters, keep_local=local_parameters)
        self.train(model.training)

    # ------------------------------------------------------------------ generated-code API

    @staticmethod
    def local(value: Any) -> Any:
        """The local tensor of a replicated DTensor (the whole value); a plain tensor as is."""
        return value.to_local() if isinstance(value, DTensor) else value

    def input(self, value: Any, placements: Placements, traced_shape: Sequence[int] | None = None) -> Any:
        """A user input: this rank's local slice (from ``shard_batch``) as a DTensor. Its global
        shape is the traced one when this rank's slice of it has the local shape (so an
        uneven split is exact); otherwise DTensor infers it from an even split."""
        if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
            return value
        placements = replicate_partials(placements)
        shape = None
        if traced_shape is not None and len(traced_shape) == value.dim():
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            local, _ = compute_local_shape_and_global_offset(torch.Size(traced_shape), self.mesh, placements)
            if tuple(local) == tuple(value.shape):
                shape = torch.Size(traced_shape)
        if shape is None:
            return DTensor.from_local(value, self.mesh, placements, run_check=False)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(value, self.mesh, placements, run_check=False, shape=shape, stride=stride)

    def _to(self, value: Any, placements: Placements) -> Any:
        """``value`` laid out as ``placements``: a DTensor is redistributed when its
        placements differ (the collective follows from the change on each axis); a plain
        tensor (computed locally, the same on every rank) becomes a replicated DTensor first,
        then keeps its slice. Anything else passes unchanged."""
        if not isinstance(value, torch.Tensor):
            return value
        if not isinstance(value, DTensor):
            value = DTensor.from_local(value, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False)
        placements = keep_whole(value.placements, placements)
        if same_placements(value.placements, placements):
            return value
        value = as_partial_sums(value)
        return redistribute(value, keep_whole(value.placements, placements))

    def dropout_p(self, node: str, traced_p: float) -> float:
        """The probability of dropout op ``node`` now: its ``nn.Dropout``'s ``p`` (0 after
        ``module.p = 0``), or the float attribute it was read from (``(path, attribute)``),
        or the traced value when neither is known."""
        owner = self._dropout_modules.get(node)
        if owner is None:
            return traced_p
        path, attribute = (owner, "p") if isinstance(owner, str) else owner
        return float(getattr(self.model.get_submodule(path), attribute))

    def attention(self, op: Callable, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs) -> Any:
        """Scaled dot-product attention on DTensors. DTensor shards CUDA's flash and
        efficient kernels (batch and heads split); it has no rule for the CPU flash kernel,
        so on CPU the math kernel runs (its matmuls and softmax shard the same way), with
        ``is_causal`` given as an explicit lower-triangular mask (the math kernel would
        build that mask as a plain tensor, which cannot meet DTensors)."""
        if self.device.type == "cuda" or not isinstance(query, DTensor):
            return op(query, key, value, attn_mask, dropout_p, is_causal, **kwargs)
        if split_by_batch_and_heads(query, key, value) and not dropout_p:
            # Every (sample, head) attends alone: run the local shards with the fast kernel
            # (DTensor's own propagation is also slow on meshes of three axes and more); a
            # mask is cut like the query where it is not broadcast (a local slice).
            mask = None if attn_mask is None else local_mask(attn_mask, query)
            local = op(query.to_local(), key.to_local(), value.to_local(), mask, 0.0, is_causal, **kwargs)
            # Laid out (B, S, heads, head_dim) in memory, as the fused kernels return it and as
            # the traced graph assumes (it views ``out.transpose(1, 2)`` without a copy).
            local = local.transpose(1, 2).contiguous().transpose(1, 2)
            batch, heads, length, width = (*query.shape[:-1], value.shape[-1])
            return DTensor.from_local(local, query.device_mesh, query.placements, run_check=False,
                                      shape=torch.Size((batch, heads, length, width)),
                                      stride=(length * heads * width, width, heads * width, 1))
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if is_causal:
            causal = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=self.device).tril()
            attn_mask, is_causal = self._to(causal, tuple(Replicate() for _ in range(self.mesh.ndim))), False
        with sdpa_kernel([SDPBackend.MATH]):
            return op(query, key, value, attn_mask, dropout_p, is_causal, **kwargs)

    def _replicated(self, op: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run ``op`` on whole tensors: every DTensor argument is gathered to ``Replicate``
        (its local value is then the full tensor), the op runs locally, and its tensor
        results become replicated DTensors. Correct for any op; communication-heavy."""
        replicate = [Replicate()] * self.mesh.ndim
        # An in-place op (FNet's ``embeddings += positions``) writes into its input; the local
        # tensor of a DTensor is a view made by a custom autograd Function, which autograd
        # forbids writing into, so it writes into a copy. Later ops read the write's result
        # (planner.functionalize leaves only writes nothing else reads through), not the input.
        in_place = getattr(getattr(op, "_schema", None), "is_mutable", False)

        def whole(value: Any) -> Any:
            if isinstance(value, DTensor):
                local = redistribute(value, replicate).to_local()
                return local.clone() if in_place else local
            return value

        result = op(*tree_map(whole, args), **tree_map(whole, kwargs))
        return tree_map(
            lambda value: DTensor.from_local(value, self.mesh, replicate, run_check=False)
            if isinstance(value, torch.Tensor) else value,
            result,
        )

    def _decomposed(self, op: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run ``op``'s ATen decomposition (``torch._decomp``) on the DTensors, so its parts
        use DTensor's rules; if a part has no rule either, fall back to ``_replicated``."""
        from torch._decomp import decomposition_table

        decomposition = decomposition_table.get(op)
        if decomposition is not None:
            try:
                return decomposition(*args, **kwargs)
            except NotImplementedError as error:  # every rank fails alike (SPMD): no collective is left waiting
                _warn_once(f"{op}: its decomposition has no DTensor rule either ({error}); running it replicated")
        return self._replicated(op, *args, **kwargs)

    @staticmethod
    def token_mean_cross_entropy(op: Callable, input: Any, target: Any, weight: Any = None, reduction: int = 1,
                                 ignore_index: int = -100, label_smoothing: float = 0.0) -> Any:
        """``cross_entropy(..., reduction="mean")`` on targets split over ranks, exactly: the
        loss summed over this rank's targets and the count of its targets that are not
        ``ignore_index``, each summed over the ranks, then divided. DTensor's own rule gives
        the average of each rank's mean, which is the mean only when every rank holds as many
        counted targets (Hugging Face's causal LMs ignore the last position of every
        sequence, so a split of the flattened tokens gives ranks different counts)."""
        if reduction != 1 or weight is not None:  # sums, and weighted means, are left to DTensor
            return op(input, target, weight, reduction, ignore_index, label_smoothing)
        total = op(input, target, None, 2, ignore_index, label_smoothing)  # 2: reduction "sum"
        counted = (target != ignore_index).sum()
        return total / counted

    @staticmethod
    def vocabulary_parallel_cross_entropy(op: Callable, *args: Any, **kwargs: Any) -> Any:
        """``cross_entropy`` on logits split over the classes, gathering nothing
        (``codegen.runtime.loss_parallel``)."""
        return vocabulary_parallel_cross_entropy(op, *args, **kwargs)

    @staticmethod
    def unmasked(value: Any) -> Any:
        """A vocabulary-parallel embedding's result as plain partial sums. DTensor leaves it
        as masked partial sums (each rank looked its out-of-shard tokens up in row 0) that only
        its first reduction corrects; here the rows of tokens outside this rank's shard are
        zeroed now, so the value can be summed later, by more than one consumer."""
        if not isinstance(value, DTensor):
            return value
        masked = [p for p in value.placements if isinstance(p, Partial) and hasattr(p, "mask_buffer")]
        if not masked or masked[0].mask_buffer.data is None:
            return value
        mask = masked[0].mask_buffer.data
        # d(sum of partial sums)/d(each summand) is the whole gradient, on every rank.
        local = value.to_local(grad_placements=[Replicate() if isinstance(p, Partial) else p for p in value.placements])
        local = local.masked_fill(mask.reshape(*mask.shape, *([1] * (local.dim() - mask.dim()))), 0)
        for placement in masked:
            placement.mask_buffer.release_mask()
        placements = [Partial(p.reduce_op) if isinstance(p, Partial) else p for p in value.placements]
        return DTensor.from_local(local, value.device_mesh, placements, run_check=False, shape=value.shape, stride=value.stride())

    @staticmethod
    def loss(value: Any) -> Any:
        """A scalar result (the loss) as a plain tensor holding the full value on every rank:
        partial sums are all-reduced, and backward starts from the same gradient everywhere."""
        return as_partial_sums(value).full_tensor() if isinstance(value, DTensor) else value


def split_by_batch_and_heads(query: Any, key: Any, value: Any) -> bool:
    """Whether attention's q, k, v (B, heads, S, head_dim) are DTensors laid out alike and
    split only on the batch and heads dims, so each rank's shards attend on their own."""
    tensors = (query, key, value)
    if not all(isinstance(t, DTensor) and t.dim() == 4 for t in tensors):
        return False
    if not all(same_placements(t.placements, query.placements) for t in tensors):
        return False
    return all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim % 4 in (0, 1)) for p in query.placements)


def local_mask(mask: Any, query: DTensor) -> torch.Tensor:
    """This rank's part of an attention mask (broadcastable to the scores (B, heads, S, S))
    for ``query``'s shards: split where the query is, on dims the mask does not broadcast."""
    mesh = query.device_mesh
    if not isinstance(mask, DTensor):
        mask = DTensor.from_local(mask, mesh, [Replicate()] * mesh.ndim, run_check=False)
    offset = 4 - mask.dim()
    wanted = []
    for placement in query.placements:
        dim = placement.dim % 4 - offset if isinstance(placement, Shard) else -1
        wanted.append(Shard(dim) if dim >= 0 and mask.shape[dim] > 1 else Replicate())
    return mask.redistribute(mesh, wanted).to_local()


def as_partial_sums(value: DTensor) -> DTensor:
    """``value`` with partial averages (``P(avg)``, from a mean over a split dim) held as
    partial sums of ``local / n``: the same value. DTensor redistributes ``P(avg)`` forward but
    fails in backward when the gradient arrives as ``P(sum)`` ("Redistribution from one
    partial type to another is unsupported"); partial sums have no such gap."""
    if not any(isinstance(p, Partial) and p.reduce_op == "avg" for p in value.placements):
        return value
    return _AverageAsSum.apply(value)


class _AverageAsSum(torch.autograd.Function):
    """Identity on the global value: ``P(avg)`` axes become ``P(sum)`` of ``local / n``."""

    @staticmethod
    def forward(ctx, value: DTensor) -> DTensor:  # type: ignore[override]
        mesh, local, placements = value.device_mesh, value.to_local(), []
        for axis, placement in enumerate(value.placements):
            if isinstance(placement, Partial) and placement.reduce_op == "avg":
                local = local / mesh.size(axis)
                placement = Partial("sum")
            placements.append(placement)
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=value.shape, stride=value.stride())

    @staticmethod
    def backward(ctx, grad: DTensor) -> DTensor:  # type: ignore[override]
        return grad  # the identity's gradient, in whatever layout it arrives


def keep_whole(source: Sequence[Placement], target: Sequence[Placement]) -> Placements:
    """``target``, except where it asks for partial values: DTensor does not make partial
    values on request (only its ops do, inside). There a partial value stays as it is
    (whatever its reduce op: a reader of partial values takes sums or averages alike), a
    whole value stays whole, and a split value is gathered whole."""

    def settle(held: Placement, wanted: Placement) -> Placement:
        if not isinstance(wanted, Partial):
            return wanted
        if isinstance(held, (Partial, Replicate)):
            return held
        return Replicate()

    return tuple(settle(s, t) for s, t in zip(source, target))


def redistribute(value: DTensor, placements: Sequence[Placement]) -> DTensor:
    """``value.redistribute`` to ``placements``, through ``Replicate`` on the axes where
    DTensor cannot go directly (e.g. ``Shard`` -> ``Partial``)."""
    placements = tuple(placements)
    if value.grad_fn is not None:  # an activation (a hook on a parameter would stay for good)
        value.register_hook(_contiguous_gradient)
    try:
        return contiguous_local(value.redistribute(value.device_mesh, placements), gathered_from=value.placements)
    except (RuntimeError, NotImplementedError, AssertionError, ValueError):
        whole = tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
        value = value.redistribute(value.device_mesh, whole)
        return contiguous_local(value.redistribute(value.device_mesh, placements))


def _contiguous_gradient(grad: Any) -> Any:
    """The gradient of a redistributed value, contiguous on this rank: backward redistributes
    gradients the other way, with the same uneven all-to-all (see ``contiguous_local``)."""
    return contiguous_local(grad) if isinstance(grad, DTensor) else grad


def contiguous_local(value: DTensor, gathered_from: Sequence[Placement] | None = None) -> DTensor:
    """``value`` with a contiguous local tensor on this rank. DTensor's all-to-all of an
    uneven split (``S(2)`` -> ``S(1)`` of 5 rows over 2 ranks) leaves the ranks with the short
    piece a slice of a padded buffer; a local ``view`` of it (``linear`` on a 3-D input
    flattens it with one) then fails on those ranks only, and the others wait in the next
    collective. A contiguous copy takes every view the whole value takes. ``redistribute``
    returns such values, and hands their producers such gradients.

    ``gathered_from``: the placements ``value`` was redistributed from. On an axis where it
    was gathered whole (``Shard`` -> ``Replicate``), a gradient that arrives as partial sums
    (a column-parallel matmul's input gradient) is handed on as such, so that the gather's
    backward reduce-scatters it into the producer's shards, as ``cost_model.resharding``
    prices it; made whole here, it was all-reduced (twice the bytes) and sliced after."""
    gathered = tuple(
        gathered_from is not None and isinstance(source, Shard) and isinstance(target, Replicate)
        for source, target in zip(gathered_from or value.placements, value.placements)
    )
    return _ContiguousLocal.apply(value, gathered)


class _ContiguousLocal(torch.autograd.Function):
    """``contiguous_local``'s copy. Backward redistributes the gradient into the value's
    placements (a partial value's gradient is whole), except that it stays partial on the
    ``gathered`` axes where it arrives so."""

    @staticmethod
    def forward(ctx, value: DTensor, gathered: tuple[bool, ...]) -> DTensor:  # noqa: D102
        ctx.placements, ctx.gathered = value.placements, gathered
        local = value.to_local().contiguous()
        # The global strides too: DTensor decides between a view and a copy (reshape) from
        # them, and after a gather they can differ between ranks (a rank with an empty piece
        # computes others), so ranks would disagree on the decision.
        contiguous = _contiguous_strides(value.shape)
        return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=contiguous)

    @staticmethod
    def backward(ctx, grad: Any):  # noqa: D102
        if not isinstance(grad, DTensor):
            return grad, None
        # Every rank runs this alike (placements are the same on every rank of an axis).
        wanted = tuple(
            arrived if kept and isinstance(arrived, Partial) else (Replicate() if isinstance(held, Partial) else held)
            for held, kept, arrived in zip(ctx.placements, ctx.gathered, grad.placements)
        )
        if not same_placements(grad.placements, wanted):
            grad = grad.redistribute(grad.device_mesh, wanted)
        return grad, None


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def distribute_parameters(
    model: nn.Module, mesh: DeviceMesh, parameters: Mapping[str, Placements], keep_local: Sequence[str] = ()
) -> dict[str, nn.Parameter]:
    """Replace every parameter of ``model`` named in ``parameters`` by a DTensor parameter
    with those placements (each rank keeps its own shard of the whole weight it built; no
    communication), keeping tied weights tied. Parameters the graph does not read are
    replicated; those named in ``keep_local`` stay plain tensors. Returns qualified name ->
    parameter.

    A gradient hook keeps each gradient in its parameter's placements: a replicated weight
    used on batch-split activations gets partial sums over ``dp``, all-reduced here before
    they are accumulated (a sharded weight's are reduce-scattered)."""
    replicate = tuple(Replicate() for _ in range(mesh.ndim))
    placement_of: dict[int, Placements] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        placement_of.setdefault(id(param), replicate)
    for name, placements in parameters.items():
        param = model.get_parameter(name)
        placement_of[id(param)] = replicate_partials(placements)
    # Weights only ever read whole, by ops that run on local tensors, stay plain: unless
    # another name of the same (tied) weight is read as a DTensor.
    local = {id(model.get_parameter(name)) for name in keep_local}
    local -= {id(model.get_parameter(name)) for name in parameters if name not in keep_local}
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is None or isinstance(param, DTensor) or id(param) in local:
                continue
            if id(param) not in replaced:
                shard = distribute_tensor(param.detach(), mesh, placement_of[id(param)], src_data_rank=None)
                new = nn.Parameter(shard, requires_grad=param.requires_grad)
                if new.requires_grad:
                    new.register_hook(keep_placements(new))
                replaced[id(param)] = new
            module._parameters[key] = replaced[id(param)]
    return {name: model.get_parameter(name) for name in parameters}


def keep_placements(param: DTensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A gradient hook for ``param`` that hands its gradient on in ``param``'s own placements
    (partial sums reduced, whole axes chunked first), as a sharded optimizer step needs."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if isinstance(grad, DTensor) and not same_placements(grad.placements, param.placements):
            # Take this rank's chunk on every axis where the gradient is whole and the weight
            # split (no communication) before reducing the partial sums: DTensor would
            # otherwise all-reduce the whole gradient over dp and chunk it after
            # (tests/test_comm_audit.py counts the difference).
            chunked = tuple(
                want if isinstance(have, Replicate) and isinstance(want, Shard) else have
                for have, want in zip(grad.placements, param.placements)
            )
            if not same_placements(chunked, grad.placements):
                grad = grad.redistribute(param.device_mesh, chunked)
            return grad.redistribute(param.device_mesh, param.placements)
        return grad

    return hook


def shard_inputs(
    args: tuple, kwargs: dict, mesh: DeviceMesh, placements: Mapping[str, Placements | None]
) -> tuple[tuple, dict]:
    """Each rank's local slice of one global batch: an input named in ``placements`` keeps
    the part its placements give this rank (``Shard(d)`` on an axis: this rank's chunk of dim
    ``d``); every rank holds the whole batch, so no communication. Positional inputs take
    the names in order, keyword inputs their keys; non-tensors pass unchanged."""
    names = list(placements)

    def local(name: str, value: Any) -> Any:
        wanted = placements.get(name)
        if wanted is None or not isinstance(value, torch.Tensor):
            return value
        wanted = replicate_partials(wanted)
        if all(isinstance(p, Replicate) for p in wanted):
            return value
        return distribute_tensor(value, mesh, wanted, src_data_rank=None).to_local()

    local_args = tuple(local(names[i] if i < len(names) else "", value) for i, value in enumerate(args))
    local_kwargs = {key: local(key, value) for key, value in kwargs.items()}
    return local_args, local_kwargs


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)
