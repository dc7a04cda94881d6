"""Checkpoints of a compiled program through ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a folder ``<root>/step-<N>`` that DCP writes (one file per rank and a
``.metadata``) plus ``soap-checkpoint.json``, written by rank 0 once every rank has finished
writing: a folder without it is incomplete (the run died while saving) and never resumed.
The folders, their checks and pruning are ``codegen.runtime.checkpoint_folders``; the run a
folder belongs to (recorded in every checkpoint) is ``codegen.runtime.checkpoint_runs``.

What is saved, each under a name that does not depend on the plan, so that a checkpoint
resumes onto any other plan (mesh, world size, data-parallel flavour, pipeline split) and
DCP reshards every tensor to the placements the new program holds it in:

- ``model.<name>``: every parameter this rank holds (a DTensor shard or a whole tensor),
  under its qualified name in the model built from the spec (a tied weight under its first
  name), and ``buffer.<name>``: the model's persistent buffers. An MoE program's runtime
  layers hold parts of the model's parameters (a rank's own experts, a copied hot expert on
  several ranks, a slice of every expert): each is saved under the name of the model
  parameter it is part of, as the chunks of it this rank holds
  (``codegen.runtime.derived_checkpoint``), so it reshards like any other;
- ``optim.<name>.<state>``: the optimizer's state of that parameter (AdamW's ``step``,
  ``exp_avg``, ``exp_avg_sq``), laid out like the parameter; under ZeRO-1
  (``ShardedStatesOptimizer``) a rank holds the states of its piece of each
  weight only, saved as that piece's box of the whole weight (``derived_checkpoint.BoxPart``);
- ``train.step``: the number of steps taken, which is also the data position (the loop
  draws step ``s``'s batch from seed ``1000 + s``); ``rng.rank<r>``: each rank's RNG state,
  restored when the world size is unchanged.

Saving is asynchronous (``dcp.async_save`` on a process group of its own, so its
collectives never interleave with the step's): the state is first copied (a transient copy
of the weights and optimizer state), then written while training continues; the next save,
or the end of the run, waits for it and marks it complete.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import (
    compute_local_shape_and_global_offset,  # DTensor's shard maths
)

from codegen.runtime.derived_checkpoint import (
    BoxPart,
    DerivedLoadPlanner,
    DerivedPart,
    DerivedSavePlanner,
    as_saved,
    saved_parameters,
)
from codegen.runtime.checkpoint_folders import (
    FORMAT_VERSION,
    INFO_FILE,
    Found,
    SafeReader,
    check_whole,
    latest_checkpoint,
    mark_writing,
    marked_folders,
    newest_checkpoint,
    prune_checkpoints,
    read_info,
    step_folder,
    write_info,
)
from codegen.runtime.checkpoint_runs import RunIdentity, check_no_other_writer, check_same_run
from codegen.runtime.init_file import check_fits, check_init_file, read_state_dict_file
from codegen.runtime.materialize import parameter_names
from planner.errors import LaunchError, one_line

__all__ = ["Checkpointer", "check_init_file", "export_checkpoint", "init_from", "latest_checkpoint", "model_tensors",
           "optimizer_tensors", "prime_optimizer", "prune_checkpoints", "read_info", "step_folder", "INFO_FILE"]


def model_tensors(model: nn.Module, module: nn.Module) -> dict[str, torch.Tensor | DerivedPart]:
    """``model.<name>`` -> every parameter of ``module`` (this rank's, as ``parallelize``
    returned it), named as in ``model``, a part of a model parameter (MoE experts) as a
    ``DerivedPart`` under its source's name; ``buffer.<name>`` -> the model's persistent buffers.

    Raises:
        LaunchError: ``module`` holds a parameter the model does not hold and that is not
            recorded as a part of one of its parameters, or two that are saved under one name.
    """
    entries = saved_parameters(model)
    tensors: dict[str, torch.Tensor | DerivedPart] = {}
    for param in module.parameters():
        if id(param) not in entries:
            raise LaunchError(
                f"this program holds a parameter of shape {tuple(param.shape)} that the model built from the spec does "
                f"not, and that is not recorded as a part of one of its parameters (materialize.set_derived_parameter); "
                f"such a program cannot be checkpointed: make its runtime layers derive their weights from the model's"
            )
        name, derivation = entries[id(param)]
        if f"model.{name}" in tensors:
            raise LaunchError(f"this program holds two parameters saved as {name}; a checkpoint keeps one tensor per name")
        tensors[f"model.{name}"] = as_saved(param, derivation)
    for name, buffer in model.named_buffers():
        owner, _, key = name.rpartition(".")
        holder = model.get_submodule(owner) if owner else model
        if key not in holder._non_persistent_buffers_set and buffer.device.type != "meta":
            tensors[f"buffer.{name}"] = buffer
    return tensors


def optimizer_tensors(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, torch.Tensor | DerivedPart]:
    """``optim.<parameter name>.<state>`` -> each tensor of the optimizer's state (a part
    of a model parameter's states under the source's name, as ``model_tensors`` names it;
    under ZeRO-1, the box of the weight this rank steps).

    Raises:
        LaunchError: a state the checkpoint cannot name (a piece of a derived parameter).
    """
    entries = saved_parameters(model)
    pieces = {id(piece.piece): piece for piece in getattr(optimizer, "pieces", ())}
    tensors: dict[str, torch.Tensor | DerivedPart] = {}
    for param, state in optimizer.state.items():
        piece = pieces.get(id(param))
        owner = piece.param if piece is not None else param
        if id(owner) not in entries:
            continue
        name, derivation = entries[id(owner)]
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            if piece is None or piece.dim is None or value.dim() == 0:
                if piece is not None and derivation is not None and isinstance(piece.param, DTensor) and value.dim():
                    # ZeRO-1 steps a rank's own expert shard (sharded over its copies by FSDP2) as
                    # a plain view of the shard: its states are that shard's, named as FSDP's are.
                    value = DTensor.from_local(value, piece.param.device_mesh, piece.param.placements,
                                               shape=piece.param.shape, stride=piece.param.stride())
                tensors[f"optim.{name}.{key}"] = as_saved(value, derivation)
            elif derivation is not None:
                raise LaunchError(
                    f"{name}: ZeRO-1 steps a piece of a part of this parameter, which a checkpoint cannot name; "
                    f"plan the MoE layers' experts whole per rank (rank_local) or use another data-parallel flavour"
                )
            else:
                tensors[f"optim.{name}.{key}"] = _piece_box(value, piece, name)
    return tensors


def _piece_box(value: torch.Tensor, piece, name: str) -> BoxPart:
    """``value``, a state shaped like ZeRO-1's ``piece`` (``ShardedStatesOptimizer.pieces``: the
    narrow ``[start, start + length)`` on ``dim`` of the weight's local tensor), as its box of
    the whole weight ``name``."""
    param = piece.param
    if isinstance(param, DTensor):
        _, offsets = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    else:
        offsets = (0,) * param.dim()
    offsets = list(offsets)
    offsets[piece.dim] += piece.start
    return BoxPart(value.detach(), name, tuple(param.shape), offsets=tuple(offsets))


def prime_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's (lazy) state tensors so a checkpoint can be loaded into them:
    one step with zero gradients at learning rate 0, which changes no weight."""
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    # ZeRO-1 steps pieces of the weights, taking their gradients from the
    # weights themselves: those get the zeros.
    pieces = getattr(optimizer, "pieces", None)
    params = [piece.param for piece in pieces] if pieces is not None else [
        param for group in optimizer.param_groups for param in group["params"]]
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate


@dataclass
class Checkpointer:
    """Saves and resumes one training run's checkpoints under ``root`` (see module doc).

    Args:
        root: the ``--checkpoint-dir`` folder (created on first save).
        model: the model built from the spec (``parallelize`` changed it in place).
        module: this rank's module (what ``parallelize`` returned).
        optimizer: the step's optimizer (``Program.make_optimizer``).
        identity: the run's identity (``checkpoint_runs.run_identity``; a resumed run's
            carries the id of the checkpoint it resumed), recorded in every checkpoint.
        plan_name: recorded in ``soap-checkpoint.json``, for people.
        keep: how many complete checkpoints of this run to keep (older ones are deleted
            once a newer one is complete); 0 keeps them all.
    """

    root: Path
    model: nn.Module
    module: nn.Module
    optimizer: torch.optim.Optimizer
    identity: RunIdentity
    plan_name: str = ""
    keep: int = 0

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        # DCP's own collectives on a group of their own: an asynchronous save runs them in a
        # thread while the step runs its collectives on the default group.
        self._group = dist.new_group(backend="gloo")
        self._pending: tuple[object, int, Path] | None = None
        # Before the first step, not at the first save: a program whose parameters a
        # checkpoint cannot name (LaunchError) must not spend steps it cannot keep.
        model_tensors(self.model, self.module)
        self._known = {folder.name for _, folder in marked_folders(self.root)}  # what this run was let in with

    def _state(self, step: int) -> dict[str, torch.Tensor | DerivedPart]:
        state = {**model_tensors(self.model, self.module), **optimizer_tensors(self.optimizer, self.model)}
        state["train.step"] = torch.tensor(step, dtype=torch.int64, device="cpu")
        state[f"rng.rank{dist.get_rank()}"] = torch.get_rng_state()
        return state

    def save(self, step: int, asynchronous: bool = True) -> Path | None:
        """Start writing the checkpoint of ``step``, after waiting for the previous one.
        Returns the folder of the checkpoint this call completed (the previous one when
        asynchronous, this one otherwise), or None."""
        completed = self.wait()
        folder = step_folder(self.root, step)
        if dist.get_rank() == 0:  # before any rank writes: DCP's planning waits for rank 0
            check_no_other_writer(self.root, self.identity.id, folder, self._known)
            mark_writing(folder, self.identity.id)
        with torch.no_grad():  # a snapshot: training goes on changing the live tensors
            snapshot = {key: value.detach().clone() for key, value in self._state(step).items()}
        if asynchronous:
            response = dcp.async_save(snapshot, checkpoint_id=str(folder), process_group=self._group,
                                      planner=DerivedSavePlanner())
            self._pending = (getattr(response, "upload_completion", response), step, folder)
        else:
            dcp.save(snapshot, checkpoint_id=str(folder), process_group=self._group, planner=DerivedSavePlanner())
            self._pending = (None, step, folder)
            completed = self.wait()
        return completed

    def wait(self) -> Path | None:
        """Finish the save in flight, if any, and mark it complete; returns its folder."""
        if self._pending is None:
            return None
        future, step, folder = self._pending
        self._pending = None
        if future is not None:
            future.result()
        dist.barrier(group=self._group)  # every rank's files are written
        if dist.get_rank() == 0:
            aliases = {
                name: first
                for name, param in self.model.named_parameters(remove_duplicate=False)
                if (first := parameter_names(self.model)[id(param)]) != name
            }
            write_info(folder, {
                "format": FORMAT_VERSION, "step": step, "world_size": dist.get_world_size(), "plan": self.plan_name,
                "optimizer": self.identity.optimizer, "run": self.identity.to_json(), "aliases": aliases,
            })
            if self.keep:
                prune_checkpoints(self.root, self.keep, self.identity.id)
        dist.barrier(group=self._group)
        return folder

    def resume(self, found: Found) -> int:
        """Load checkpoint ``found`` (``checkpoint_runs.resume_decision``'s, checked before
        the process group started) into this rank's weights and optimizer state, resharded
        to this program's placements; returns the step it was taken at.

        Raises:
            LaunchError: it lacks a tensor this run needs, or a tensor does not load.
        """
        folder, info = found.folder, found.info
        check_same_run(found, self.identity)
        prime_optimizer(self.optimizer)
        state = {key: value.detach() for key, value in self._state(0).items()}
        saved = SafeReader(str(folder)).read_metadata().state_dict_metadata
        rng_key = f"rng.rank{dist.get_rank()}"
        if info.get("world_size") != dist.get_world_size() or rng_key not in saved:
            state.pop(rng_key)  # another world size: each step reseeds; the old ranks' states do not map
        missing = sorted(key for key in state if key not in saved)
        if missing:
            raise LaunchError(
                f"checkpoint '{folder}' has no {missing[0]} ({len(missing)} tensor(s) missing; it was saved with "
                f"{one_line(str(info.get('optimizer', '?'))[:20])} by plan '{one_line(str(info.get('plan', '?'))[:60])}'): "
                f"resume with the same "
                f"model and optimizer, or start a new run from its weights with --init-from"
            )
        try:
            with torch.no_grad():
                dcp.load(state, storage_reader=SafeReader(str(folder)), process_group=self._group,
                         planner=DerivedLoadPlanner())
        except (Exception, CheckpointException) as error:  # DCP wraps every rank's failure: say it in one line
            raise LaunchError(
                f"cannot load checkpoint '{folder}' into this program ({_first_failure(error)[:200]}): its shard files "
                f"are damaged or not this model's; move that folder out of --checkpoint-dir to resume from the one "
                f"before it, or start a new run with --init-from"
            ) from error
        if rng_key in state:
            torch.set_rng_state(state[rng_key])
        return int(state["train.step"])


def _first_failure(error: BaseException) -> str:
    """What went wrong, in one line: DCP's ``CheckpointException`` holds each rank's
    exception (its own text is every rank's traceback); the lowest rank's first sentence
    is said."""
    if isinstance(error, CheckpointException) and error.failures:
        error = error.failures[min(error.failures)][0]
    return one_line(" ".join(f"{type(error).__name__}: {error}".split()).split(". ")[0])


def export_checkpoint(folder: Path, output: Path) -> tuple[int, int]:
    """Write the weights of checkpoint ``folder`` (a ``step-<N>`` folder or a root, whose
    latest complete checkpoint is taken) as one plain ``state_dict`` file that
    ``model.load_state_dict(torch.load(output, weights_only=True))`` loads into the model
    built from the spec (tied weights under each of their names). Runs in one process, no
    process group. Returns ``(step, number of entries)``.

    Raises:
        LaunchError: no complete checkpoint there, or it is damaged (a file, an alias).
    """
    from codegen.runtime.exported_weights import save_exported

    folder = Path(folder)
    if not (folder / INFO_FILE).is_file():
        found = newest_checkpoint(folder)
        folder = found.folder if found is not None else folder
    info = check_whole(folder)
    metadata = SafeReader(str(folder)).read_metadata().state_dict_metadata
    state = {
        key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype, device="cpu")  # exported on the host
        for key, entry in metadata.items()
        if key.startswith(("model.", "buffer.")) and hasattr(entry, "size")
    }
    try:
        with warnings.catch_warnings():  # DCP says it assumes one process: that is the intent
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=SafeReader(str(folder)), no_dist=True)
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - a damaged file: one line
        raise LaunchError(
            f"cannot read checkpoint '{folder}': {_first_failure(error)[:200]}; its files are damaged: export an "
            f"earlier step-<N> folder"
        ) from error
    plain = {key.partition(".")[2]: value for key, value in state.items()}
    for alias, first in info.get("aliases", {}).items():
        if first not in plain:
            raise LaunchError(
                f"checkpoint '{folder / INFO_FILE}' is damaged (alias '{one_line(alias[:80])}' names "
                f"'{one_line(first[:80])}', which it does not hold); export an earlier step-<N> folder"
            )
        plain[alias] = plain[first]
    save_exported(plain, output)  # marked as ours, written atomically
    return int(info["step"]), len(plain)


def init_from(path: Path, model: nn.Module, module: nn.Module) -> int:
    """Overwrite this rank's weights (and the model's buffers) with a plain ``state_dict``
    file (``export-checkpoint``'s, or ``torch.save(model.state_dict())`` of the original
    model): each rank keeps its own shard of every tensor (an MoE program's rank its own
    experts' rows or slices). The file is memory-mapped, so a rank reads only the parts it
    keeps. Returns the number of tensors set.

    Raises:
        LaunchError: the file is missing, not a weights-only state_dict, or lacks a tensor of
            the model or has one of another shape or dtype.
    """
    loaded = read_state_dict_file(path)
    targets = {key.partition(".")[2]: target for key, target in model_tensors(model, module).items()}
    for name, target in targets.items():  # all checked before any is copied: never half a model
        dtype = target.local.dtype if isinstance(target, DerivedPart) else target.dtype
        check_fits(path, name, loaded.get(name), tuple(target.size()), dtype)
    count = 0
    with torch.no_grad():
        for name, target in targets.items():
            value = loaded[name]
            if isinstance(target, DerivedPart):  # this rank's experts (rows) or slices only
                target.copy_from_whole(value)
            elif isinstance(target, DTensor):  # this rank's block only: the other pages of the file stay unread
                local_shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
                block = value[tuple(slice(start, start + size) for start, size in zip(offset, local_shape))]
                target.to_local().copy_(block)
            else:
                target.copy_(value)
            count += 1
    return count
