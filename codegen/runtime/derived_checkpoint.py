"""Checkpoints of runtime parameters that hold a part of a model parameter: an MoE program's
experts (``codegen.runtime.moe``, ``moe_modes``, ``expert_dispatch``), which each rank keeps
as its own experts (dim-0 rows of the model's stacked expert weight, a hot expert's copy on
more than one rank) or its slice of every expert (a range of the hidden dim).

An expert-parallel layer with sharded copies (``codegen.runtime.expert_copies``) holds its
experts as FSDP2 shards over the ranks holding the same experts: each rank's shard is the
part of the source its rows (a shard on dim 0) or a range of another dim of them is.

Such a parameter is saved under the name of the model parameter it is part of (its
``materialize.Derivation``'s ``source_name``), as the chunks of that whole tensor this rank
holds, so that the checkpoint looks like any other plan's: ``torch.distributed.checkpoint``
(DCP) reshards it onto any placement of the same model (other experts per rank, sliced
experts, plain FSDP, one device) and ``export-checkpoint`` rebuilds the whole tensor.

``DerivedPart`` describes a rank's part in DCP's own protocol: ``__create_write_items__`` (the
chunks to write, with their offsets in the whole tensor) and ``__create_chunk_list__`` (the
chunks to read into). Each kept row is a chunk of its own: two ranks holding copies of the
same expert then describe identical chunks, and DCP's save planner keeps one writer for
each (it drops write items of the same name and offset from all but one rank), while both
read it back. (Runs of consecutive rows would be fewer chunks, but a rank's run could
overlap another rank's different run, which DCP refuses.) A slice is one chunk.

DCP's default planners find a tensor's chunk by offset only for tensors and DTensors, so
``DerivedSavePlanner`` and ``DerivedLoadPlanner`` extend their lookup (the extension points
DCP documents) to return the chunk's view of the rank's tensor: a load writes straight into
the parameter or optimizer state. The load planner also keeps parts away from the default
set-up, which replaces values it does not know with None.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import (
    compute_local_shape_and_global_offset,  # DTensor's shard maths
)

from codegen.runtime.materialize import Derivation, derived_parameters, parameter_names
from planner.errors import LaunchError

__all__ = ["BoxPart", "DerivedLoadPlanner", "DerivedPart", "DerivedSavePlanner", "as_saved", "saved_parameters"]


@dataclass
class DerivedPart:
    """``local`` (a rank's runtime parameter, or an optimizer state shaped like it) as a part
    of the whole model parameter ``name`` of shape ``whole_shape``: the dim-0 ``rows`` (None:
    every row) narrowed to ``[start, stop)`` on ``dim`` (None: whole), as a
    ``materialize.Derivation`` records it (see the module docstring). Plain values only:
    DCP's asynchronous save deep-copies what a state dict holds."""

    local: torch.Tensor
    name: str
    whole_shape: tuple[int, ...]
    rows: tuple[int, ...] | None = None
    dim: int | None = None
    start: int = 0
    stop: int = 0

    def __post_init__(self) -> None:
        if self.rows is not None and self.dim == 0:
            raise ValueError(f"{self.name}: a part narrows dim 0 by its rows, not by a range")
        if self.rows is not None and len(set(self.rows)) != len(self.rows):
            raise ValueError(f"{self.name}: a part holds row(s) twice: {self.rows}")
        expected = list(self.whole_shape)
        if self.rows is not None:
            expected[0] = len(self.rows)
        if self.dim is not None:
            expected[self.dim] = self.stop - self.start
        if tuple(self.local.shape) != tuple(expected):
            raise ValueError(
                f"{self.name}: a tensor of shape {tuple(self.local.shape)} is not the part of shape {tuple(expected)} "
                f"it is recorded as"
            )

    @classmethod
    def of(cls, local: torch.Tensor, derivation: Derivation) -> DerivedPart:
        """``local`` as the part of its source that ``derivation`` records."""
        return cls(local, derivation.source_name, tuple(derivation.source.shape), derivation.rows, derivation.dim,
                   derivation.start, derivation.stop)

    def size(self) -> torch.Size:
        """The whole tensor's shape (what DCP checks a saved tensor against)."""
        return torch.Size(self.whole_shape)

    def chunks(self) -> list[tuple[ChunkStorageMetadata, torch.Tensor]]:
        """Each chunk of the whole tensor this part holds, with its view of ``local``."""
        offsets, sizes = [0] * len(self.whole_shape), list(self.whole_shape)
        if self.dim is not None:
            offsets[self.dim], sizes[self.dim] = self.start, self.stop - self.start
        if self.rows is None:
            return [(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)), self.local)]
        found = []
        for position, row in enumerate(self.rows):
            chunk = ChunkStorageMetadata(torch.Size([row, *offsets[1:]]), torch.Size([1, *sizes[1:]]))
            found.append((chunk, self.local[position : position + 1]))
        return found

    def chunk(self, index: MetadataIndex) -> torch.Tensor:
        """The view of ``local`` of the chunk at ``index.offset`` (``index.index`` tried first)."""
        chunks = self.chunks()
        if index.index is not None and index.index < len(chunks) and chunks[index.index][0].offsets == index.offset:
            return chunks[index.index][1]
        for chunk, view in chunks:
            if chunk.offsets == index.offset:
                return view
        raise ValueError(f"{index.fqn}: this rank holds no chunk at offset {tuple(index.offset or ())}")

    def __create_write_items__(self, fqn: str, _object: object) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=self.size()),
            )
            for chunk, _ in self.chunks()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [chunk for chunk, _ in self.chunks()]

    def detach(self) -> DerivedPart:
        """The same part of ``local`` detached (as a tensor's ``detach``)."""
        return dataclasses.replace(self, local=self.local.detach())

    def clone(self) -> DerivedPart:
        """The same part over a copy of ``local`` (a snapshot to save while training goes on)."""
        return dataclasses.replace(self, local=self.local.clone())

    def copy_from_whole(self, whole: torch.Tensor) -> None:
        """Set ``local`` to its part of ``whole`` (the model parameter's full tensor, which may
        be memory-mapped: only the rows of the part are read)."""
        if self.rows is not None:
            whole = whole[list(self.rows)]
        if self.dim is not None:
            whole = whole.narrow(self.dim, self.start, self.stop - self.start)
        self.local.copy_(whole)


@dataclass
class BoxPart(DerivedPart):
    """``local`` as the box ``[offsets, offsets + local.shape)`` of the whole tensor ``name``:
    an optimizer state of the piece of a weight that ZeRO-1 of graph and pipeline programs
    steps on this rank (``codegen.runtime.sharded_states``), a narrow of the weight's own
    local shard. Saved as one chunk; ranks holding the same box (replicas over an axis the
    weight is whole on) describe identical chunks, written once."""

    offsets: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.whole_shape) or any(
            start < 0 or start + size > whole for start, size, whole in zip(self.offsets, self.local.shape, self.whole_shape)
        ):
            raise ValueError(
                f"{self.name}: a box of shape {tuple(self.local.shape)} at {self.offsets} does not fit in "
                f"{tuple(self.whole_shape)}"
            )

    def chunks(self) -> list[tuple[ChunkStorageMetadata, torch.Tensor]]:
        return [(ChunkStorageMetadata(torch.Size(self.offsets), torch.Size(self.local.shape)), self.local)]

    def copy_from_whole(self, whole: torch.Tensor) -> None:
        for dim, (start, size) in enumerate(zip(self.offsets, self.local.shape)):
            whole = whole.narrow(dim, start, size)
        self.local.copy_(whole)


class DerivedSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, which also finds the chunks of a ``DerivedPart``."""

    def lookup_object(self, index: MetadataIndex) -> object:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, DerivedPart):
            return value.chunk(index)
        return super().lookup_object(index)


class DerivedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, which also finds the chunks of a ``DerivedPart`` (views
    of the rank's tensor: what is read lands in the parameter or state itself)."""

    def set_up_planner(self, state_dict: dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        # The default set-up replaces every value it does not know (not a tensor, DTensor,
        # number or container) with None while it allocates meta tensors: parts skip it.
        parts = {key: value for key, value in state_dict.items() if isinstance(value, DerivedPart)}
        others = {key: value for key, value in state_dict.items() if key not in parts}
        super().set_up_planner(others, metadata, is_coordinator)
        self.state_dict.update(parts)
        self.original_state_dict.update(parts)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, DerivedPart):
            return value.chunk(index)
        return super().lookup_tensor(index)


def saved_parameters(model: nn.Module) -> dict[int, tuple[str, Derivation | None]]:
    """id of each parameter of ``model`` (as ``parallelize`` changed it) -> the name it is
    checkpointed under and, for a part of a model parameter, its derivation: a parameter of
    the model its own (first) name; a derived one the name of its source (the part is None
    when it is the whole source, which is then saved as any parameter is).

    Raises:
        LaunchError: a derived parameter whose source was never named (a program whose
            module was not built by ``Program.build_module``).
    """
    derived = derived_parameters(model)
    found: dict[int, tuple[str, Derivation | None]] = {}
    for param_id, name in parameter_names(model).items():
        derivation = derived.get(name)
        if derivation is None:
            found[param_id] = (name, None)
        elif not derivation.source_name:
            raise LaunchError(
                f"{name} holds a part of a model parameter whose name was not recorded; build this rank's module with "
                f"Program.build_module (as launch.py does) to checkpoint it"
            )
        else:
            found[param_id] = (derivation.source_name, None if derivation.whole else derivation)
    return found


def as_saved(value: torch.Tensor, derivation: Derivation | None) -> torch.Tensor | DerivedPart:
    """``value`` (a parameter or an optimizer state of it) as a checkpoint holds it: itself,
    or for a part of a model parameter, a ``DerivedPart`` over its values (a 0-dim state,
    AdamW's ``step``, is the same for every part and stays itself)."""
    if derivation is None or value.dim() == 0:
        return value
    if isinstance(value, DTensor):
        return _sharded_part(value, derivation)
    return DerivedPart.of(value.detach(), derivation)


def _sharded_part(value: DTensor, derivation: Derivation) -> DerivedPart:
    """``value``, a part of a model parameter that FSDP2 shards again over a 1-D mesh (an
    expert-parallel layer's experts sharded over their copies, ``codegen.runtime.expert_copies``),
    as the part of the source this rank's shard is: a shard on dim 0 holds a run of the
    part's rows, a shard on another dim a range of that dim of all of them. Its ``local`` is
    the DTensor's local tensor, so a load writes into the shard itself."""
    whole = tuple(derivation.source.shape)
    if value.device_mesh.ndim != 1 or not value.placements[0].is_shard() or derivation.dim is not None:
        raise LaunchError(
            f"{derivation.source_name}: a part of a model parameter placed {value.placements} by a wrapper cannot be "
            f"checkpointed; build the program so that per-rank expert weights stay outside FSDP"
        )
    dim = value.placements[0].dim
    shape, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    start, size = offsets[dim], shape[dim]
    rows = derivation.rows if derivation.rows is not None else tuple(range(whole[0]))
    if size == 0:  # FSDP2 left this rank an empty (padding) shard: it holds nothing of the source
        return DerivedPart(value.to_local().new_empty((0, *whole[1:])), derivation.source_name, whole, rows=())
    local = value.to_local().detach()
    if dim == 0:
        return DerivedPart(local, derivation.source_name, whole, rows=tuple(rows[start : start + size]))
    return DerivedPart(local, derivation.source_name, whole, rows=tuple(rows), dim=dim, start=start, stop=start + size)

