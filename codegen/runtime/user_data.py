"""The user's batches of ``launch.py --data path/to/data.py:function``, drawn in step on every rank.

``function(batch_size)`` is called once on every rank with the plan's global batch size and
returns an iterable of GLOBAL batches: a tensor (the model's only positional input), a tuple
of tensors (its positional inputs, as the model spec's example ``args``) or a dict (its
keyword inputs). Every rank must draw the same batches (each takes its own slice), so each
step, before the batch is used:

- every rank fetches its batch and notes what happened: a batch, the end of the data, or a
  failure (the function raised, or yielded something the plan cannot take);
- one all-gather of a few int64s per rank (the outcome and a CRC-32 of each input's bytes,
  in order, so a rank-seeded shuffle of the same rows differs and identical batches holding
  a NaN agree) lets every rank reach the same verdict: a failure anywhere, data that ended
  on some ranks only (or yielded nothing at all), or batches that differ stop every rank
  with the same ``LaunchError``
  naming the step, the rank and the input; so no rank is left waiting in a collective;
- integer inputs the compiled program knows the range of (``INDEX_INPUTS`` of
  ``model_spmd.py``: token ids feeding an embedding, class targets of a loss) are checked on
  the global batch, which is the same everywhere by then, so an id outside the vocabulary is
  one line on every rank instead of an ``IndexError`` on the one rank whose slice holds it
  (or a device-side assert on a GPU).
"""

from __future__ import annotations

import importlib.util
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from planner.errors import LaunchError, one_line
from planner.messages import exception_line
from planner.outputs import path_kind

# What a rank's fetch of a step's batch ended in (the first int64 a rank contributes).
BATCH, ENDED, FAILED = 0, 1, 2
# Data functions imported in this process, by reference: launch.py checks --data before the
# process group starts and the training loop then calls the same function (the user's file
# runs once).
_LOADED: dict[str, tuple[Callable[[int], Any], str]] = {}


def load_data_function(reference: str) -> tuple[Callable[[int], Any], str]:
    """Import ``path/to/module.py:function``; returns the function and its name for messages.

    Raises:
        LaunchError: the reference is malformed, the file is missing or fails to import, or
            it defines no such function.
    """
    if reference in _LOADED:
        return _LOADED[reference]
    path_text, _, name = reference.rpartition(":")
    if not path_text or not name.isidentifier():
        raise LaunchError(f"--data takes path/to/module.py:function, got {reference!r}; e.g. --data data.py:batches")
    path = Path(path_text)
    if path_kind(path, "--data") != "file":
        raise LaunchError(f"--data: no file '{one_line(path)}'; give the path of a Python file, e.g. --data data.py:batches")
    spec = importlib.util.spec_from_file_location(f"soap_user_data_{abs(hash(str(path.resolve())))}", path)
    if spec is None:  # importlib loads only Python source and extension files
        raise LaunchError(f"--data: '{one_line(path)}' is not a Python file; give a .py file, e.g. --data data.py:batches")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as error:  # noqa: BLE001 - the user's file: one line, not a traceback per rank
        raise LaunchError(f"--data: {one_line(path)} fails to import: {one_line(exception_line(error))}; fix the file") from error
    function = getattr(module, name, None)
    if not callable(function):
        raise LaunchError(f"--data: {one_line(path)} defines no function {name}(); define {name}(batch_size) returning batches")
    _LOADED[reference] = function, name
    return function, name


def load_data(reference: str, batch_size: int) -> Iterator[Any]:
    """Import ``path/to/module.py:function`` and return ``iter(function(batch_size))``.

    Raises:
        LaunchError: as ``load_data_function``, or the call fails or returns something that
            is not iterable.
    """
    function, name = load_data_function(reference)
    return _start(function, name, batch_size)


def _start(function: Callable[[int], Any], name: str, batch_size: int) -> Iterator[Any]:
    try:
        batches = function(batch_size)
    except (Exception, SystemExit) as error:  # noqa: BLE001 - the user's function: one line naming it
        raise LaunchError(
            f"--data: {name}({batch_size}) raised {one_line(exception_line(error))}; fix the data function"
        ) from error
    try:
        return iter(batches)
    except TypeError as error:
        raise LaunchError(
            f"--data: {name}({batch_size}) returned an object of type {type(batches).__name__}, not an iterable; define "
            f"{name}(batch_size) returning an iterable of global batches"
        ) from error


def check_batch(batch: Any, example_args: tuple, example_kwargs: dict, names: list[str] = (), step: int | None = None
                ) -> tuple[tuple, dict]:
    """A user batch as (args, kwargs), checked against the example batch the program was
    compiled for (same structure, shapes and dtypes); LaunchError naming the difference (and
    the input by ``names``, the model's input names, and the ``step``, when given)."""
    at = f" at step {step}" if step is not None else ""
    if isinstance(batch, torch.Tensor):
        args, kwargs = (batch,), {}
    elif isinstance(batch, dict):
        args, kwargs = (), dict(batch)
    elif isinstance(batch, (tuple, list)):
        args, kwargs = tuple(batch), {}
    else:
        raise LaunchError(f"--data yielded a {type(batch).__name__}{at}; yield a tensor, a tuple of tensors or a dict of them")
    if len(args) != len(example_args) or set(kwargs) != set(example_kwargs):
        shown = sorted(one_line(key) for key in kwargs)
        raise LaunchError(
            f"--data yielded {len(args)} positional input(s) and keywords {shown}{at}, but the model was planned "
            f"with {len(example_args)} and {sorted(example_kwargs)}; yield batches shaped like the plan's example"
        )
    labels = input_names(example_args, example_kwargs, names)
    wanted = [*example_args, *(example_kwargs[key] for key in sorted(example_kwargs))]
    for label, got, want in zip(labels, [*args, *(kwargs[key] for key in sorted(kwargs))], wanted):
        if isinstance(want, torch.Tensor):
            if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
                shown = f"{tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else type(got).__name__
                raise LaunchError(
                    f"--data: {label}{at} is {shown}, but the plan was made for {tuple(want.shape)} {want.dtype} (the "
                    f"global batch); yield global batches of that shape, or plan again for this batch"
                )
    return args, kwargs


def place(args: tuple, kwargs: dict, example_args: tuple, example_kwargs: dict) -> tuple[tuple, dict]:
    """The batch on the example's device, and contiguous: a user's slices (idx[:, 1:]) are
    views whose strides the traced program's reshapes cannot take."""
    device = next((value.device for value in [*example_args, *example_kwargs.values()] if isinstance(value, torch.Tensor)), None)

    def placed(value: Any) -> Any:
        return value.to(device).contiguous() if isinstance(value, torch.Tensor) else value

    return tuple(placed(value) for value in args), {key: placed(value) for key, value in kwargs.items()}


def as_inputs(batch: Any, example_args: tuple, example_kwargs: dict) -> tuple[tuple, dict]:
    """``check_batch``, then ``place``: the batch as the program's (args, kwargs)."""
    args, kwargs = check_batch(batch, example_args, example_kwargs)
    return place(args, kwargs, example_args, example_kwargs)


def input_names(example_args: tuple, example_kwargs: dict, names: list[str] = ()) -> list[str]:
    """How messages name each input of a batch, in digest order: ``input 'idx'`` (``names``:
    the model's input names, positional ones first), ``input 0`` when unnamed."""
    positional = [f"input '{one_line(names[index])}'" if index < len(names) else f"input {index}"
                  for index in range(len(example_args))]
    return positional + [f"input '{one_line(key)}'" for key in sorted(example_kwargs)]


def tensor_digest(value: Any) -> int:
    """A CRC-32 of a tensor's dtype, shape and bytes in memory order (so equal bytes, NaNs
    included, agree, and the same rows in another order do not); 0 for a non-tensor."""
    if not isinstance(value, torch.Tensor):
        return 0
    flat = value.detach().contiguous().reshape(-1).cpu()
    header = f"{flat.dtype}{tuple(value.shape)}".encode()
    data = flat.view(torch.uint8).numpy() if flat.numel() else b""
    return zlib.crc32(data, zlib.crc32(header))


def batch_digests(args: tuple, kwargs: dict) -> list[int]:
    """``tensor_digest`` of each input, positional ones then keywords by name."""
    return [tensor_digest(value) for value in [*args, *(kwargs[key] for key in sorted(kwargs))]]


def first_index_error(value: torch.Tensor, bound: int, allowed: tuple[int, ...]) -> int | None:
    """The first value of ``value`` outside ``[0, bound)`` and not in ``allowed`` (a loss's
    ``ignore_index``), or None when all lie inside."""
    outside = (value < 0) | (value >= bound)
    for extra in allowed:
        outside &= value != extra
    if not bool(outside.any()):
        return None
    return int(value[outside].reshape(-1)[0])


def check_index_ranges(args: tuple, kwargs: dict, names: list[str], ranges: Mapping[str, tuple], step: int) -> None:
    """LaunchError when an integer input holds a value its consumer cannot index with.

    ``names``: the program's input names, positional inputs first (the model's signature);
    ``ranges``: ``INDEX_INPUTS`` of the program, input name -> (bound, allowed extra values,
    what reads it)."""
    values = dict(zip(names, args))
    values.update(kwargs)
    for name, (bound, allowed, reader) in ranges.items():
        value = values.get(name)
        if not isinstance(value, torch.Tensor) or value.is_floating_point() or value.is_complex():
            continue
        bad = first_index_error(value, bound, tuple(allowed))
        if bad is not None:
            extra = f" or {', '.join(str(v) for v in allowed)}" if allowed else ""
            raise LaunchError(
                f"--data: input '{one_line(name)}' at step {step} holds {bad}, but {one_line(reader)} takes values in "
                f"[0, {bound}){extra}; fix the data, or plan a model of the size the data needs"
            )


class DataFeed:
    """The user's batches, one per step, agreed on by every rank (see the module docstring).

    ``names``: the program's input names in the model's signature order (for
    ``index_ranges``); ``index_ranges``: ``INDEX_INPUTS`` of the compiled program."""

    def __init__(self, reference: str, batch_size: int, example_args: tuple, example_kwargs: dict, device: torch.device,
                 names: list[str] | None = None, index_ranges: Mapping[str, tuple] | None = None) -> None:
        self.function, self.name = load_data_function(reference)
        self.batch_size = batch_size
        self.example_args, self.example_kwargs = example_args, example_kwargs
        self.device = device  # the process group's (NCCL gathers only GPU tensors)
        self.names = names or []
        self.index_ranges = dict(index_ranges or {})
        self.fetched = 0  # batches every rank has agreed on so far
        self._batches: Iterator[Any] | None = None

    def next(self) -> tuple[tuple, dict] | None:
        """The next global batch on this rank's device, or None when the data ended on every rank.

        Raises:
            LaunchError: on every rank alike, when any rank's fetch failed, the data ended on
                some ranks only, the ranks drew different batches, or an index is out of range.
        """
        step = self.fetched + 1
        outcome, message, batch, digests = self._fetch(step)
        table = self._gather([outcome, *digests])
        if any(row[0] == FAILED for row in table):
            raise LaunchError(self._failure(table, message))
        ended = [rank for rank, row in enumerate(table) if row[0] == ENDED]
        if ended and len(ended) < len(table):
            raise LaunchError(
                f"--data ended after {self.fetched} batches on rank(s) {_ranks(ended)} but not on the others; every "
                f"rank must yield the same global batches"
            )
        if ended:
            if self.fetched == 0:
                raise LaunchError(
                    f"--data: {self.name}({self.batch_size}) yielded no batches; yield global batches (check the "
                    f"function's files and filters)"
                )
            return None
        self._check_same(table, step)
        args, kwargs = batch
        check_index_ranges(args, kwargs, self.names, self.index_ranges, step)
        self.fetched = step
        return place(args, kwargs, self.example_args, self.example_kwargs)

    def _fetch(self, step: int) -> tuple[int, str, tuple[tuple, dict] | None, list[int]]:
        """(outcome, failure message, checked batch, its digests) of this rank's next fetch."""
        none = [0] * (len(self.example_args) + len(self.example_kwargs))
        try:
            if self._batches is None:
                self._batches = _start(self.function, self.name, self.batch_size)
            raw = next(self._batches)
        except StopIteration:
            return ENDED, "", None, none
        except LaunchError as error:
            return FAILED, str(error), None, none
        except (Exception, SystemExit) as error:  # noqa: BLE001 - the user's generator: one line, not a traceback per rank
            return FAILED, (f"--data: {self.name}({self.batch_size}) raised {one_line(exception_line(error))} while "
                            f"yielding the batch of step {step}; fix the data function"), None, none
        try:
            batch = check_batch(raw, self.example_args, self.example_kwargs, self.names, step)
        except LaunchError as error:
            return FAILED, str(error), None, none
        try:
            return BATCH, "", batch, batch_digests(*batch)
        except Exception as error:  # noqa: BLE001 - a tensor whose bytes cannot be read (meta, sparse)
            return FAILED, (f"--data: the batch of step {step} cannot be read as plain tensors "
                            f"({one_line(exception_line(error))}); yield dense tensors on the CPU or this rank's GPU"), None, none

    def _gather(self, row: list[int]) -> list[list[int]]:
        mine = torch.tensor(row, dtype=torch.int64, device=self.device)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine)
        return [[int(value) for value in gathered.tolist()] for gathered in rows]

    def _failure(self, table: list[list[int]], message: str) -> str:
        """The first failing rank's message (every rank learns it: one object all-gather, on
        this path only), naming the ranks when not all failed."""
        messages: list[str] = [""] * len(table)
        dist.all_gather_object(messages, message)
        failed = [rank for rank, row in enumerate(table) if row[0] == FAILED]
        first = messages[failed[0]]
        return first if len(failed) == len(table) else f"{first} (on rank(s) {_ranks(failed)})"

    def _check_same(self, table: list[list[int]], step: int) -> None:
        names = input_names(self.example_args, self.example_kwargs, self.names)
        for column, name in enumerate(names, start=1):
            differing = [rank for rank, row in enumerate(table) if row[column] != table[0][column]]
            if differing:
                raise LaunchError(
                    f"--data gave the ranks different batches at step {step}: {name} on rank(s) {_ranks(differing)} "
                    f"differs from rank 0's; every rank must yield the same global batches (seed any shuffling with a "
                    f"fixed seed, not the rank): each rank takes its own slice"
                )


def skip_batches(next_batch: Callable[[], Any], count: int) -> None:
    """Draw and drop the ``count`` batches a checkpointed run consumed (its data position).

    Raises:
        LaunchError: the data ends first: it is not the data the checkpointed run trained on.
    """
    for skipped in range(count):
        if next_batch() is None:
            raise LaunchError(f"--data ended after {skipped} batches, before step {count} where the checkpoint resumes; "
                              f"resume with the data the checkpointed run trained on")


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(rank) for rank in ranks[:8])
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


__all__ = ["DataFeed", "skip_batches", "load_data", "load_data_function", "check_batch", "place", "as_inputs", "batch_digests",
           "tensor_digest", "first_index_error", "check_index_ranges", "input_names"]
