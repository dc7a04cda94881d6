"""The folders of a ``--checkpoint-dir`` on disk: which are complete checkpoints of ours,
whether one is whole, and pruning that deletes only what soap-planner wrote.

A checkpoint is ``<root>/step-<N>`` holding the files ``torch.distributed.checkpoint`` (DCP)
wrote (``.metadata`` and one or more ``__<rank>_<n>.distcp`` per rank) and
``soap-checkpoint.json`` (``INFO_FILE``), which rank 0 writes atomically once every rank has
finished writing. The info file records the step, the world size, the plan, the run the
checkpoint belongs to (``codegen.runtime.checkpoint_runs``), the tied-weight aliases and the
list of files DCP wrote. While a save is being written the folder holds ``WRITING_FILE``
instead, naming the run: a folder without either was not written by soap-planner.

Everything read from these files is checked (they are shared, copied, and sometimes
damaged): a damaged checkpoint is a ``LaunchError`` naming the file and the fix, never a
traceback, and never taken as the latest. Vocabulary and ``torch.distributed.checkpoint``
only.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from planner.errors import LaunchError, one_line
from planner.messages import exception_line
from planner.outputs import write_text_atomically

INFO_FILE = "soap-checkpoint.json"
WRITING_FILE = "soap-checkpoint.writing.json"
FORMAT_VERSION = 2  # 2 added "run" (the run's identity) and "files" (what DCP wrote)
READABLE_FORMATS = (1, 2)
_STEP_FOLDER = re.compile(r"step-(\d{1,18})$")
# The names DCP's FileSystemWriter gives its files (and their temporary names while writing).
_DCP_FILE = re.compile(r"(\.metadata|__\d+_\d+\.distcp|__\d+\.metadata)(\.tmp)?$")
_INFO_LIMIT = 1 << 20  # bytes: an info file is a few hundred; a bigger one is not ours


# What DCP's ``.metadata`` pickle may name. DCP reads it with ``pickle.load``, which runs any
# code a crafted file names: a checkpoint shared by a stranger must not run code on
# --resume or export-checkpoint, so it is read with only these (module, name) pairs.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size", *(name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype))},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        if name not in _METADATA_GLOBALS.get(module, ()):
            raise pickle.UnpicklingError(f"it names {module[:60]}.{name[:60]}, which DCP metadata never holds")
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """DCP's ``FileSystemReader``, reading ``.metadata`` with only the classes DCP metadata
    holds (see ``_METADATA_GLOBALS``) and refusing non-tensor entries, whose loading
    unpickles (``DefaultLoadPlanner.load_bytes``): soap-planner saves tensors only."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        with open(Path(self.path) / ".metadata", "rb") as stream:
            metadata = _MetadataUnpickler(io.BytesIO(stream.read(1 << 30))).load()
        if not isinstance(metadata, Metadata):
            raise ValueError(f"it holds a {type(metadata).__name__}, not DCP metadata")
        odd = next((key for key, entry in metadata.state_dict_metadata.items()
                    if not isinstance(entry, TensorStorageMetadata)), None)
        if odd is not None:
            raise ValueError(f"{str(odd)[:80]!r} is not a tensor (soap-planner saves tensors only)")
        if getattr(metadata, "storage_meta", None) is None:  # as DCP's own reader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def step_folder(root: Path, step: int) -> Path:
    """The folder of the checkpoint taken after ``step`` steps."""
    return Path(root) / f"step-{step:08d}"


def step_of(folder: Path) -> int | None:
    """The step number a ``step-<N>`` folder name says, or None for any other name."""
    match = _STEP_FOLDER.fullmatch(Path(folder).name)
    return int(match.group(1)) if match else None


def step_folders(root: Path) -> list[tuple[int, Path]]:
    """Every ``step-<N>`` folder under ``root`` with its step, oldest first (none when
    ``root`` is missing)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(step, folder) for folder in root.iterdir() if (step := step_of(folder)) is not None and folder.is_dir()]
    return sorted(found)


def marked_folders(root: Path) -> list[tuple[int, Path]]:
    """The ``step-<N>`` folders that claim to be complete checkpoints (they hold
    ``INFO_FILE``), oldest first, whether or not the claim holds."""
    return [(step, folder) for step, folder in step_folders(root) if (folder / INFO_FILE).is_file()]


def read_info(folder: Path) -> dict:
    """The checked ``soap-checkpoint.json`` of a checkpoint folder.

    Raises:
        LaunchError: the folder is not a complete checkpoint, or its info file is damaged
            (not JSON, truncated, fields of the wrong type, a step other than its name's).
    """
    folder = Path(folder)
    path = folder / INFO_FILE
    if not path.is_file():
        raise LaunchError(
            f"'{folder}' is not a complete soap-planner checkpoint (no {INFO_FILE}); "
            f"give a step-<N> folder written by launch.py --checkpoint-dir, or the --checkpoint-dir itself"
        )
    fix = _damage_fix(folder)
    try:
        if path.stat().st_size > _INFO_LIMIT:
            raise ValueError(f"{path.stat().st_size} bytes, far more than soap-planner writes")
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:
        raise LaunchError(f"checkpoint '{path}' is damaged ({one_line(exception_line(error))[:160]}); {fix}") from error
    problem = _info_problem(info, step_of(folder))
    if problem:
        raise LaunchError(f"checkpoint '{path}' is damaged ({problem}); {fix}")
    return info


def _info_problem(info: object, folder_step: int | None) -> str:
    """What is wrong with a parsed info file ('' when nothing is)."""
    if not isinstance(info, dict):
        return f"it holds a {type(info).__name__}, not an object"
    if "format" not in info:
        return "it has no format field"
    if info.get("format") not in READABLE_FORMATS:
        return f"format {_shown(info.get('format'))} is not one this version reads ({', '.join(map(str, READABLE_FORMATS))})"
    step, world = info.get("step"), info.get("world_size")
    if not _is_count(step, 0) or (folder_step is not None and step != folder_step):
        return f"step {_shown(step)} is not the folder's step {folder_step}"
    if not _is_count(world, 1):
        return f"world_size {_shown(world)} is not a positive integer"
    aliases = info.get("aliases", {})
    if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
        return "aliases is not an object of names"
    files = info.get("files", [])
    if not isinstance(files, list) or not all(isinstance(name, str) and _DCP_FILE.fullmatch(name) for name in files):
        return "files lists names DCP does not write"
    run = info.get("run", {})
    if not isinstance(run, dict) or not all(isinstance(value, (str, dict)) for value in run.values()):
        return "run is not an object of texts"
    return ""


def _shown(value: object) -> str:
    """A value read from a file, short, as JSON would write it."""
    return json.dumps(value)[:20]


def _is_count(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and least <= value < 1 << 62


def _damage_fix(folder: Path) -> str:
    """How to get past a damaged checkpoint folder: the one before it, if any."""
    step = step_of(folder)
    earlier = [other for number, other in marked_folders(folder.parent) if step is not None and number < step]
    before = f" (the newest before it is {earlier[-1].name})" if earlier else ""
    return f"move that folder out of --checkpoint-dir to resume from the checkpoint before it{before}"


def check_whole(folder: Path) -> dict:
    """``read_info(folder)`` after checking that DCP's files are whole: ``.metadata`` reads,
    and every shard file it names exists and is as long as the data it is said to hold (a
    truncated copy is the common damage). Cheap: one small read and a stat per file.

    Raises:
        LaunchError: naming the damaged file and the fix.
    """
    info = read_info(folder)
    fix = _damage_fix(Path(folder))
    metadata_file = Path(folder) / ".metadata"
    try:
        metadata = SafeReader(str(folder)).read_metadata()
        storage = metadata.storage_data
        needed: dict[str, int] = {}
        for entry in storage.values():
            needed[entry.relative_path] = max(needed.get(entry.relative_path, 0), int(entry.offset) + int(entry.length))
        if "train.step" not in metadata.state_dict_metadata:
            raise ValueError("it holds no train.step")
        claimed = sum(_tensor_bytes(entry) for entry in metadata.state_dict_metadata.values())
        if claimed > sum(needed.values()):  # export allocates what it claims: bounded by the files
            raise ValueError(f"its tensors claim {claimed:,} bytes, more than its shard files hold")
    except Exception as error:  # noqa: BLE001 - DCP unpickles a file we did not necessarily write: any failure is damage
        raise LaunchError(f"checkpoint '{metadata_file}' is damaged or missing ({one_line(exception_line(error))[:160]}); {fix}") from error
    for name, length in sorted(needed.items()):
        shard = Path(folder) / name
        if Path(name).name != name or not _DCP_FILE.fullmatch(name):
            raise LaunchError(f"checkpoint '{metadata_file}' is damaged (it names a data file '{one_line(name[:80])}'); {fix}")
        size = shard.stat().st_size if shard.is_file() else None
        if size is None or size < length:
            said = "is missing" if size is None else f"is truncated ({size} of {length} bytes)"
            raise LaunchError(f"checkpoint shard '{shard}' {said}; {fix}")
    return info


def _tensor_bytes(entry: TensorStorageMetadata) -> int:
    """The bytes of a tensor DCP's metadata describes (ValueError when it is not a tensor's)."""
    dtype, size = entry.properties.dtype, entry.size
    if not isinstance(dtype, torch.dtype) or not all(isinstance(dim, int) and dim >= 0 for dim in size):
        raise ValueError("a tensor entry has no valid dtype or shape")
    count = 1
    for dim in size:
        count *= dim
    return count * dtype.itemsize


@dataclass(frozen=True)
class Found:
    """The newest complete checkpoint under a root, and the run it belongs to."""

    folder: Path
    info: dict

    @property
    def step(self) -> int:
        return int(self.info["step"])

    @property
    def run(self) -> dict:
        return self.info.get("run", {})


def latest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint of most steps under ``root`` (None when there is none).

    Raises:
        LaunchError: that newest folder claims to be complete (holds ``INFO_FILE``) but is
            damaged: it is never taken as the latest, nor silently passed over.
    """
    found = newest_checkpoint(root)
    return found.folder if found is not None else None


def newest_checkpoint(root: Path) -> Found | None:
    """``latest_checkpoint`` with its checked info (see there)."""
    marked = marked_folders(root)
    if not marked:
        return None
    folder = marked[-1][1]
    return Found(folder, check_whole(folder))


def write_info(folder: Path, info: dict) -> None:
    """Mark ``folder`` complete: ``info`` plus the list of DCP's files in it, written
    atomically; the writing marker goes."""
    files = sorted(path.name for path in Path(folder).iterdir() if _DCP_FILE.fullmatch(path.name))
    write_text_atomically(Path(folder) / INFO_FILE, json.dumps({**info, "files": files}, indent=1) + "\n")
    with contextlib.suppress(FileNotFoundError):
        (Path(folder) / WRITING_FILE).unlink()


def mark_writing(folder: Path, run_id: str) -> None:
    """Say, before DCP writes into ``folder``, which run is writing it (``prune_checkpoints``
    may then delete it if the write never completes)."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    write_text_atomically(Path(folder) / WRITING_FILE, json.dumps({"run": run_id}) + "\n")


def writer_of(folder: Path) -> str | None:
    """The run id a folder's writing marker names, or None."""
    try:
        marker = json.loads((Path(folder) / WRITING_FILE).read_text(encoding="utf-8")[:1000])
    except (OSError, ValueError):
        return None
    return marker.get("run") if isinstance(marker, dict) and isinstance(marker.get("run"), str) else None


def prune_checkpoints(root: Path, keep: int, run_id: str) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints of run ``run_id`` under
    ``root``, and that run's abandoned writes older than its newest complete one.

    Only what soap-planner wrote goes: the files a checkpoint's info lists (DCP's) and the
    info file itself, then the folder if nothing else is left in it. Another run's
    checkpoints, damaged ones, folders soap-planner did not mark, and a user's files inside
    a step folder all stay. Returns the folders emptied of our files."""
    ours: list[tuple[int, Path, list[str]]] = []  # complete, of this run: (step, folder, files)
    abandoned: list[tuple[int, Path]] = []
    for step, folder in step_folders(root):
        if folder.is_symlink():
            continue  # a link to a folder elsewhere: never delete through it
        if (folder / INFO_FILE).is_file():
            try:
                info = read_info(folder)
            except LaunchError:
                continue  # damaged: not provably ours, kept
            if info.get("run", {}).get("id") == run_id:
                ours.append((step, folder, [INFO_FILE, *info.get("files", [])]))  # the mark first: never half a "complete" one
        elif writer_of(folder) == run_id:
            abandoned.append((step, folder))
    if not ours:
        return []
    newest = ours[-1][0]
    doomed = [(folder, files) for _, folder, files in ours[:-keep]]
    for step, folder in abandoned:
        if step < newest:
            names = [path.name for path in folder.iterdir() if _DCP_FILE.fullmatch(path.name)]
            doomed.append((folder, [WRITING_FILE, *names]))
    for folder, files in doomed:
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                (folder / name).unlink()
        with contextlib.suppress(OSError):  # not empty: a user's file stays, and so does its folder
            folder.rmdir()
    return sorted(folder for folder, _ in doomed)
