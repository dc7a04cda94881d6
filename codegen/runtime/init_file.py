"""``--init-from FILE``: a plain ``state_dict`` file (``planner export-checkpoint``'s, or
``torch.save(model.state_dict())``), read weights-only and memory-mapped, and checked against
the model before the process group starts: every parameter and persistent buffer present with
its shape and dtype (a wrong dtype is refused, never cast), each mistake one line naming the
tensor. ``codegen.runtime.checkpoint.init_from`` then copies each rank's part.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from codegen.runtime.materialize import parameter_names
from planner.errors import LaunchError, one_line
from planner.messages import exception_line

__all__ = ["check_fits", "check_init_file", "read_state_dict_file"]


def read_state_dict_file(path: Path) -> dict:
    """A plain ``state_dict`` file, memory-mapped (a rank then reads only the parts it keeps).

    Raises:
        LaunchError: unreadable, not weights-only (a pickle of other objects, which
            ``weights_only=True`` refuses to run), or not a dict of tensors by name.
    """
    if Path(path).is_file() and Path(path).stat().st_size == 0:
        raise LaunchError(f"--init-from: '{path}' is empty; give a file written by `planner export-checkpoint` or "
                          f"torch.save(model.state_dict())")
    try:
        loaded = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except Exception as error:  # noqa: BLE001 - any failure to read a user's file is one line
        said = one_line(exception_line(error).split(". ")[0][:160])
        raise LaunchError(
            f"--init-from: cannot read '{path}' as a weights-only state_dict ({said}); give a file written by "
            f"`planner export-checkpoint` or torch.save(model.state_dict())"
        ) from error
    if not isinstance(loaded, dict) or not all(isinstance(key, str) for key in loaded):
        raise LaunchError(f"--init-from: '{path}' holds a {type(loaded).__name__}, not a state_dict (a dict of tensors by name)")
    return loaded


def check_fits(path: Path, name: str, value: object, shape: tuple, dtype: torch.dtype) -> None:
    """LaunchError unless ``value`` is a tensor of ``shape`` and ``dtype`` (no silent cast)."""
    if not isinstance(value, torch.Tensor):
        found = "no such tensor" if value is None else f"a {type(value).__name__}"
    elif tuple(value.shape) != tuple(shape):
        found = f"shape {tuple(value.shape)}"
    elif value.dtype != dtype:
        found = f"dtype {value.dtype}"
    else:
        return
    raise LaunchError(
        f"--init-from: '{path}' does not fit this model: {name[:120]} is {tuple(shape)} {dtype} and the file has {found}; "
        f"export the checkpoint of a run of the same model (or convert the file's tensors to the model's dtypes)"
    )


def check_init_file(path: Path, model: nn.Module) -> None:
    """Check, before the process group starts, that state_dict file ``path`` holds every
    parameter and persistent buffer of ``model`` (as the spec builds it; meta is fine) with
    its shape and dtype.

    Raises:
        LaunchError: naming the first tensor that is missing or does not fit.
    """
    loaded = read_state_dict_file(path)
    params = {id(param): param for param in model.parameters()}
    for param_id, name in parameter_names(model).items():
        param = params[param_id]
        check_fits(path, name, loaded.get(name), tuple(param.shape), param.dtype)
    for name, buffer in model.named_buffers():
        owner, _, key = name.rpartition(".")
        if key not in (model.get_submodule(owner) if owner else model)._non_persistent_buffers_set:
            check_fits(path, name, loaded.get(name), tuple(buffer.shape), buffer.dtype)
