"""Where output goes: checked before any work starts, written atomically, a user's files kept.

Two kinds of output:

* **A file**: a plan (``plan -o``), a cluster file (``profile -o``, ``calibrate -o``), a
  timeline (``simulate --trace``), a state_dict (``export-checkpoint -o``), and what
  ``launch.py`` writes (``--metrics``, ``--profile``, ``--record-routing``).
  ``check_output_file`` runs before the search, the measurement or the first training step:
  the folder exists and is writable, the path is not a folder, and a file already there was
  written by soap-planner (the caller says how to recognise one) unless ``force``. The file
  is then written beside its path and renamed into place, so a reader never sees half a file
  and a failure leaves the old one whole: ``write_text_atomically`` for text,
  ``staged_file`` for writers that take a path (``torch.save``), ``StagedLines`` for a file
  written line by line over a run (``--metrics``).
* **A program folder** (``compile -o``): ``program_folder`` stages the new program in a
  fresh temporary folder beside the target and moves it into place only when every file was
  written. A marker file (``PROGRAM_MARKER``, listing the files it wrote) tells soap-planner's
  own output apart from a user's folder:

  ====================================  ============================================
  the target folder                     what happens
  ====================================  ============================================
  missing or empty                      the staged folder is renamed into place
  our output, nothing else in it        old folder moved aside, new one moved in, old
                                        one removed (a failure puts the old one back)
  our output plus a user's files        our files are replaced one by one; the user's
                                        files stay
  a user's folder, not empty            refused, unless ``force``: then our files are
                                        written into it and the user's other files stay
  a file                                refused
  ====================================  ============================================

Vocabulary layer: standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from planner.errors import OutputError

PROGRAM_MARKER = ".soap-planner-program"
# Staged beside the target as ".<name>.<8 random characters>.tmp" (a file) or ".soap-tmp" /
# ".soap-old" (a program folder): the longest suffix, in bytes.
_STAGING_EXTRA = len("..") + 8 + len(".soap-tmp")
# Longest file name and path, in bytes, the usual filesystems take (POSIX's NAME_MAX and
# Linux's PATH_MAX); a longer output path is refused before any work, not when writing.
_NAME_MAX = 255
_PATH_MAX = 4096
# Python's bytecode cache of a program's modules, written when the program runs: ours too.
_REGENERATED = frozenset({"__pycache__"})
# Files of a program folder written before the marker existed (soap-planner <= 0.1.0 main).
_LEGACY_PROGRAM_FILES = frozenset({"launch.py", "model_spmd.py", "plan.json"})


def as_path(value: object, what: str) -> Path:
    """``value`` as a ``Path``; ``OutputError`` unless it is a str or ``os.PathLike`` that
    names a path the filesystem can hold (no NUL, no name longer than it allows)."""
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise OutputError(f"{what} must be a path (str or pathlib.Path), got {value!r}")
    path = Path(value)
    text = os.fspath(path)
    if isinstance(text, bytes) or "\0" in text:
        raise OutputError(f"{what} {_shortened(text)}: a path cannot hold a NUL character; choose another path")
    # The last name is checked against its own folder's limit, staging included, by
    # _check_name_fits; here the folders above it and the whole path.
    longest = max(path.parent.parts or ("",), key=lambda part: len(os.fsencode(part)))
    if len(os.fsencode(longest)) > _NAME_MAX or len(os.fsencode(str(path.absolute()))) > _PATH_MAX:
        raise OutputError(
            f"{what} {_shortened(text)} is too long for the filesystem (names of at most {_NAME_MAX} "
            f"bytes, paths of at most {_PATH_MAX}); choose a shorter path"
        )
    return path


def _shortened(text: str) -> str:
    """A path for a message: its first 60 characters, quoted and escaped by ``repr``."""
    return repr(text[:60]) + ("..." if len(text) > 60 else "")


# ------------------------------------------------------------------------------ files


def check_output_file(
    path: str | os.PathLike, *, what: str, is_ours: Callable[[Path], bool], force: bool = False, flag: str = "--force"
) -> Path:
    """Check, before any work, that ``path`` can be written.

    Args:
        path: the file to write.
        what: what the file is, for messages (``"soap-planner plan"``).
        is_ours: whether an existing file at ``path`` was written by soap-planner (then it
            may be replaced).
        force: replace any existing file.
        flag: how the user says ``force`` (``--force`` on the command line).

    Returns:
        ``path`` as a ``Path``.

    Raises:
        OutputError: the folder is missing or not writable, ``path`` is a folder or not a
            regular file, or it holds a file that is not ours and ``force`` is not set.
    """
    path = as_path(path, f"the output path of the {what}")
    try:
        return _check_output_file(path, what, is_ours, force, flag)
    except (OSError, ValueError) as error:  # a name too long for the filesystem, a loop of links, a NUL (API) ...
        detail = getattr(error, "strerror", None) or error
        raise OutputError(f"cannot write {_shown(path)!r}: {detail}; choose another path") from None


def _check_output_file(path: Path, what: str, is_ours: Callable[[Path], bool], force: bool, flag: str) -> Path:
    _check_name_fits(path, staged=True)
    if path.is_dir():
        raise OutputError(f"output {path} is a folder; give a file path, e.g. {path / (path.name or 'output')}.json")
    folder = path.parent
    if not folder.is_dir():
        problem = "is not a folder" if folder.exists() else "does not exist"
        raise OutputError(f"cannot write {path}: folder {folder} {problem}; create it first or choose another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {path}: folder {folder} is not writable; choose another path")
    if path.exists() or path.is_symlink():
        if not path.is_file():
            raise OutputError(f"cannot write {path}: it exists and is not a regular file; choose another path")
        if not force and not is_ours(path):
            raise OutputError(
                f"refusing to overwrite {path}: it is not a {what} written by soap-planner; choose another path, "
                f"or pass {flag} to overwrite it"
            )
        if not os.access(path, os.W_OK):
            raise OutputError(f"cannot write {path}: the file is read-only; choose another path")
    return path


def file_head(path: str | os.PathLike, size: int = 4096) -> str:
    """The first ``size`` bytes of ``path`` as text ("" when it cannot be read)."""
    try:
        with open(path, "rb") as stream:
            return stream.read(size).decode("utf-8", errors="replace")
    except OSError:
        return ""


def file_tail(path: str | os.PathLike, size: int = 4096) -> str:
    """The last ``size`` bytes of ``path`` as text ("" when it cannot be read): how a large
    file that soap-planner marks at its end (a Chrome trace) is recognised without reading it."""
    try:
        with open(path, "rb") as stream:
            stream.seek(max(0, os.stat(path).st_size - size))
            return stream.read(size).decode("utf-8", errors="replace")
    except OSError:
        return ""


def path_kind(path: str | os.PathLike, flag: str) -> str:
    """What is at ``path`` a flag names: ``"file"``, ``"folder"``, ``"other"`` or ``"missing"``;
    ``OutputError`` (one line naming ``flag``) when the filesystem refuses to look (a name
    too long for it, a NUL, a folder it may not search), where ``pathlib`` would raise."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    except (OSError, ValueError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise OutputError(f"{flag} {_shown(Path(path))}: the filesystem refuses this path ({reason}); give another path") from None
    if stat.S_ISDIR(mode):
        return "folder"
    return "file" if stat.S_ISREG(mode) else "other"


def refuse_input_as_output(output: str | os.PathLike, flag: str, inputs: list[str | os.PathLike]) -> None:
    """OutputError when ``output`` is one of the files the same command reads (``simulate
    plan.json --trace plan.json --force`` would replace the plan with its timeline)."""
    target = Path(output).resolve()
    for source in inputs:
        if source and Path(source).resolve() == target:
            raise OutputError(f"{flag} {output} is a file this command reads; write the output to another file")


def _check_name_fits(path: Path, *, staged: bool) -> None:
    """OutputError when ``path``'s name (or, ``staged``, its temporary sibling's, which is
    longer by ``_STAGING_EXTRA`` bytes) is longer than its folder's filesystem allows: found
    now, not when the file is written after the work."""
    if "\x00" in str(path):  # only the API can pass one (argv cannot hold it); pathlib answers "no such file"
        raise OutputError(f"cannot write {str(path)!r}: a path cannot hold a NUL character; choose another path")
    folder = _existing_ancestor_or_none(path)
    limit = 255
    if folder is not None:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            limit = os.pathconf(folder, "PC_NAME_MAX")
    needed = len(os.fsencode(path.name)) + (_STAGING_EXTRA if staged else 0)
    if needed > limit:
        raise OutputError(
            f"cannot write {_shown(path)}: its name has {len(os.fsencode(path.name))} bytes and this filesystem "
            f"allows {limit - (_STAGING_EXTRA if staged else 0)} here; choose a shorter name"
        )


def _existing_ancestor_or_none(path: Path) -> Path | None:
    with contextlib.suppress(OSError):
        parent = path.absolute().parent
        while not parent.exists():
            parent = parent.parent
        return parent
    return None


def _shown(path: Path) -> str:
    """``path`` for a message: cut to its first and last characters when it is very long."""
    text = str(path)
    return text if len(text) <= 120 else f"{text[:60]}...{text[-40:]}"


def write_text_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename:
    the old file (if any) stays whole until the new one is complete."""
    with staged_file(path) as temporary:
        temporary.write_text(text, encoding="utf-8")


@contextlib.contextmanager
def staged_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` for a writer that wants a path (``torch.save``,
    ``RoutingStats.save``); when the block ends without an exception it is renamed onto
    ``path`` (with the mode ``open(path, "w")`` would give), else removed. A reader never
    sees half a file, and a failed write leaves the old file whole."""
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(descriptor)
    try:
        yield Path(temporary)
        os.chmod(temporary, _new_file_mode(path))
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


class StagedLines:
    """A text file written line by line over a long run (``launch.py --metrics``) that
    replaces ``path`` only when ``publish`` is called: the lines go to a temporary file beside
    it, flushed as they come, and ``publish`` renames it into place, so the old file stays
    whole until then."""

    def __init__(self, path: Path) -> None:
        self.path = path
        descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        self.temporary = Path(temporary)
        self._stream = os.fdopen(descriptor, "w", encoding="utf-8")

    def write_line(self, line: str) -> None:
        """Append one line (a newline is added) and flush it."""
        self._stream.write(line + "\n")
        self._stream.flush()

    def publish(self) -> None:
        """Close the temporary file and rename it onto ``path``."""
        self._stream.close()
        os.chmod(self.temporary, _new_file_mode(self.path))
        os.replace(self.temporary, self.path)


def _new_file_mode(path: Path) -> int:
    """The mode ``open(path, "w")`` would give: the old file's, else 0o666 less the umask
    (``mkstemp`` creates files 0o600)."""
    with contextlib.suppress(OSError):
        return path.stat().st_mode & 0o777
    return 0o666 & ~_umask()


def _umask() -> int:
    umask = os.umask(0)  # the only way to read it is to set it: put it back at once
    os.umask(umask)
    return umask


# ------------------------------------------------------------------ program folders


def check_program_folder(target: str | os.PathLike, *, force: bool = False) -> Path:
    """Check, before compiling, that a program can be written to folder ``target``.

    Raises:
        OutputError: ``target`` is a file, its nearest existing parent is not a writable
            folder, or it is a non-empty folder soap-planner did not write and ``force`` is
            not set.
    """
    target = as_path(target, "the output folder")
    _state(target, force)
    return target


@contextlib.contextmanager
def program_folder(target: Path, *, force: bool = False, version: str = "") -> Iterator[Path]:
    """Stage a program: yields an empty temporary folder to write the files into; when the
    block ends without an exception the files are moved into ``target`` (see the module
    docstring); on an exception nothing in ``target`` changes. No temporary folder is left
    behind either way.

    Raises:
        OutputError: as ``check_program_folder``, checked again before anything moves.
    """
    _state(target, force)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".soap-tmp", dir=_existing_ancestor(target)))
    try:
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp makes it 0o700; a folder from mkdir would not be
        yield staging
        files = sorted(entry.name for entry in staging.iterdir())
        marker = {"generator": "soap-planner", "version": version, "files": files}
        (staging / PROGRAM_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        _publish(staging, target, force)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _state(target: Path, force: bool) -> str:
    """``"missing"``, ``"empty"``, ``"ours"`` (our output only), ``"mixed"`` (our output and
    other files) or ``"user"`` (non-empty, not ours, ``force`` given); ``OutputError`` for
    anything that must not be written."""
    try:
        return _folder_state(target, force)
    except (OSError, ValueError) as error:  # a name too long for the filesystem, a loop of links, a NUL (API) ...
        detail = getattr(error, "strerror", None) or error
        raise OutputError(f"cannot write the program to {_shown(target)!r}: {detail}; choose another path") from None


def _folder_state(target: Path, force: bool) -> str:
    # The folder is staged as ".<name>.<8 characters>.soap-tmp" (and ".soap-old") beside it.
    _check_name_fits(target, staged=True)
    if target.exists() and not target.is_dir():
        raise OutputError(f"output folder {target} is a file; choose a folder path (it is created if missing)")
    parent = _existing_ancestor(target)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write the program to {target}: folder {parent} is not writable; choose another path")
    if not target.exists():
        return "missing"
    entries = {entry.name for entry in target.iterdir()}
    if not entries:
        return "empty"
    listed = _our_files(target, entries)
    if listed is not None:
        return "ours" if entries - listed - {PROGRAM_MARKER} - _REGENERATED == set() else "mixed"
    if not force:
        shown = ", ".join(sorted(entries)[:3]) + (", ..." if len(entries) > 3 else "")
        raise OutputError(
            f"output folder {target} is not empty ({shown}) and was not written by `planner compile`; "
            f"choose a new or empty folder, or pass --force (force=True) to write the program's files into it "
            f"(your other files are kept)"
        )
    return "user"


def _our_files(target: Path, entries: set[str]) -> set[str] | None:
    """The files soap-planner wrote into ``target`` (from its marker, or a program folder
    from before the marker existed), or None when it is not our output."""
    if PROGRAM_MARKER in entries:
        try:
            marker = json.loads((target / PROGRAM_MARKER).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(marker, dict):
            return None
        files = marker.get("files")
        if marker.get("generator") == "soap-planner" and isinstance(files, list):
            return {name for name in files if isinstance(name, str)}
        return None
    if _LEGACY_PROGRAM_FILES <= entries:
        with contextlib.suppress(OSError, UnicodeDecodeError):
            if "Generated by soap-planner" in (target / "launch.py").read_text():
                return set(_LEGACY_PROGRAM_FILES)
    return None


def _publish(staging: Path, target: Path, force: bool) -> None:
    state = _state(target, force)  # again: the folder may have changed while we compiled
    if state in ("missing", "empty"):
        if state == "empty":
            target.rmdir()
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(staging, target)
    elif state == "ours":
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".soap-old", dir=target.parent))
        old.rmdir()  # only the unique name is needed: rename the old program there
        os.rename(target, old)
        try:
            os.rename(staging, target)
        except BaseException:
            os.rename(old, target)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:  # "mixed" or "user" (forced): replace our files one by one, keep everything else
        listed = _our_files(target, {entry.name for entry in target.iterdir()}) or set()
        marker = json.loads((staging / PROGRAM_MARKER).read_text())
        marker["files"] = sorted(listed | set(marker["files"]))
        (staging / PROGRAM_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        entries = sorted(staging.iterdir(), key=lambda path: path.name == PROGRAM_MARKER)  # marker last
        for entry in entries:  # every clash first, so that nothing is half written
            destination = target / entry.name
            if destination.is_dir() and not destination.is_symlink():
                raise OutputError(
                    f"cannot write {destination}: it is a folder in {target}; move it away or choose another folder"
                )
        for entry in entries:
            os.replace(entry, target / entry.name)


def _existing_ancestor(path: Path) -> Path:
    """The nearest folder at or above ``path``'s parent that exists (where staging happens,
    on the same filesystem as the target, so the final rename is atomic)."""
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"cannot write the program to {path}: {parent} is a file, not a folder; choose another path")
    return parent
