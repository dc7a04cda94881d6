"""Reading the JSON (and TOML) files users share: plans, cluster files, routing statistics,
measured runs.

Whatever such a file holds, reading it ends in the data or in one ``PlannerError`` line that
names the file and says how to get a good one; never in a traceback. The limits are generous
for any file soap-planner writes and stop the ones that would exhaust the reader:

* ``MAX_FILE_BYTES``: a file larger than this is refused before it is read (the largest plan
  of a 100-layer model is a few MB);
* ``MAX_NESTING``: arrays and objects nested deeper than this are refused (soap-planner's
  files nest fewer than 10 levels; Python's parser, and any code walking the data, would
  otherwise run out of stack);
* integers of more than ``MAX_INTEGER_DIGITS`` digits are refused by the parser (Python's
  own limit on int/str conversion), and a number too large for a float reads as ``inf``,
  which the field checks of each file refuse as not finite.

Once read, the data's fields are checked by each reader; two helpers serve them all:
``finite_number`` (the one test of a number: not a bool, not inf or nan, not an integer too
large for a float) and ``record_from_json`` (a flat dataclass whose every field is checked
against its annotation before it is built).

Vocabulary layer: standard library and ``planner.errors`` only.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
import sys
import typing
from pathlib import Path
from typing import Any, TypeVar

from planner.errors import PlannerError, one_line

T = TypeVar("T")

MAX_FILE_BYTES = 256 * 2**20
MAX_NESTING = 64
MAX_INTEGER_DIGITS = sys.get_int_max_str_digits() or 4300

__all__ = [
    "MAX_FILE_BYTES", "MAX_NESTING", "check_nesting", "finite_number", "parse_json", "peek_json", "read_json",
    "read_text", "record_from_json", "section_lists",
]


def read_text(
    path: Path, describe: str, fix: str, error: type[PlannerError], missing: str = "does not exist; check the path",
    kind: str = "a text file",
) -> str:
    """The text of ``path``, a UTF-8 file of at most ``MAX_FILE_BYTES``.

    Args:
        path: the file.
        describe: how messages name it (``"plan file 'p.json'"``).
        fix: what the user can do about a bad file (``"regenerate it with `planner plan`"``).
        error: the ``PlannerError`` subclass to raise.
        kind: what the file should be, for a message about bytes that are not UTF-8.
        missing: what messages say when the file does not exist (``"does not exist; ..."``).

    Raises:
        error: the file is missing, a folder, a pipe or device, unreadable, too large or not
            UTF-8 text.
    """
    try:
        status = os.stat(path)
        if stat.S_ISDIR(status.st_mode):
            raise error(f"{describe} is a folder; give the path of the file")
        if not stat.S_ISREG(status.st_mode):  # a FIFO or a device could block or never end
            raise error(f"{describe} is not a regular file (a pipe or a device); give the path of a file")
        size = status.st_size
        if size > MAX_FILE_BYTES:
            raise error(
                f"{describe} holds {size:,} bytes, more than the {MAX_FILE_BYTES // 2**20} MiB soap-planner reads; "
                f"it is not a file soap-planner wrote: {fix}"
            )
        with open(path, "rb") as stream:
            raw = stream.read(MAX_FILE_BYTES + 1)  # the file may have grown since stat
    except FileNotFoundError:
        raise error(f"{describe} {missing}") from None
    except OSError as problem:
        raise error(f"{describe} cannot be read ({one_line(problem.strerror or problem)}); {fix}") from None
    except ValueError:  # a NUL in the path
        raise error(f"{describe} is not a path a file can have (it holds a NUL character); check the path") from None
    if len(raw) > MAX_FILE_BYTES:
        raise error(f"{describe} is larger than the {MAX_FILE_BYTES // 2**20} MiB soap-planner reads; {fix}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as problem:
        raise error(f"{describe} is not {kind}: byte {problem.start} is not UTF-8 text; {fix}") from None


def parse_json(text: str, describe: str, fix: str, error: type[PlannerError]) -> Any:
    """``text`` parsed as JSON, nested at most ``MAX_NESTING`` levels.

    Raises:
        error: it is not JSON (the message says where), is nested too deeply, or holds an
            integer of more than ``MAX_INTEGER_DIGITS`` digits.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as problem:
        raise error(
            f"{describe} is not valid JSON: {problem.msg} (at line {problem.lineno}, column {problem.colno}); {fix}"
        ) from None
    except RecursionError:  # the C parser stops cleanly at Python's recursion limit
        raise error(f"{describe} is nested deeper than {MAX_NESTING} levels; {fix}") from None
    except ValueError:  # an integer longer than Python converts
        raise error(f"{describe} holds an integer of more than {MAX_INTEGER_DIGITS} digits; {fix}") from None
    check_nesting(data, describe, fix, error)
    return data


def read_json(
    path: str | os.PathLike, describe: str, fix: str, error: type[PlannerError], missing: str = "does not exist; check the path"
) -> Any:
    """The JSON data of file ``path`` (``read_text`` then ``parse_json``; their limits and
    errors)."""
    text = read_text(Path(path), describe, fix, error, missing, kind="valid JSON")
    return parse_json(text, describe, fix, error)


def peek_json(path: str | os.PathLike) -> Any:
    """The JSON data of ``path``, or ``None`` when it cannot be read within the limits above:
    for telling soap-planner's files apart from a user's, which must never fail."""
    try:
        return read_json(path, "file", "", PlannerError)
    except PlannerError:
        return None


def check_nesting(data: Any, describe: str, fix: str, error: type[PlannerError]) -> None:
    """Raise ``error`` when ``data`` (parsed JSON or TOML) nests lists and dicts deeper than
    ``MAX_NESTING`` levels; walks without recursion."""
    pending = [(data, 1)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_NESTING:
                raise error(f"{describe} is nested deeper than {MAX_NESTING} levels; {fix}")
            children = value.values() if isinstance(value, dict) else value
            pending.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def finite_number(value: Any) -> float | None:
    """``value`` as a float when it is a finite JSON number (an int or float, not a bool; an
    integer too large for a float is not), else None: one test for every reader, which
    ``math.isfinite`` alone is not (it raises OverflowError on 10**400)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def record_from_json(kind: type[T], data: Any, source: str, field: str, error: type[PlannerError]) -> T:
    """The flat dataclass ``kind`` built from JSON object ``data``, every field checked
    against its annotation first: ``str``, ``bool``, ``int`` (>= 0, not a bool; a float with
    an integer value is taken as one), ``float`` (any finite number >= 0: records hold counts,
    bytes, seconds and rates), ``dict[str, int]``.
    Messages name ``source`` (``"plan file 'p.json'"``) and the field (``summary.ops``).

    Raises:
        error: ``data`` is not an object, a key is unknown or missing, or a value has the
            wrong type or is negative, inf or nan.
    """
    if not isinstance(data, dict):
        raise error(f"{source}: field '{field}' must be a JSON object, got {type(data).__name__}")
    hints = typing.get_type_hints(kind)
    fields = {item.name: item for item in dataclasses.fields(kind)}
    values = {}
    for key, value in data.items():
        if key not in fields:
            raise error(f"{source}: field '{field}' has an unknown key {one_line(key)[:40]!r}; "
                        f"expected {', '.join(fields)}")
        if hints[key] is int and isinstance(value, float) and value.is_integer():
            value = int(value)  # a count written as 8e9 by hand
        problem = _type_problem(value, hints[key])
        if problem:
            raise error(f"{source}: field '{field}.{key}' must be {problem}, got {one_line(repr(value))[:40]}")
        values[key] = value
    missing = [name for name, item in fields.items() if name not in data
               and item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING]
    if missing:
        raise error(f"{source}: field '{field}.{missing[0]}' is missing")
    try:
        return kind(**values)
    except (TypeError, ValueError) as problem:
        raise error(f"{source}: field '{field}' is invalid: {one_line(problem)[:200]}") from None


def section_lists(data: Any, source: str, field: str, keys: tuple[str, ...], lists: tuple[str, ...],
                  example: str, error: type[PlannerError]) -> dict[str, Any]:
    """``data``, a plan section's JSON object, checked before its dataclass reads it: an
    object (``example`` shows one), no key outside ``keys``, the first of ``keys`` present,
    and the keys of ``lists`` lists where given. Messages name ``source`` and ``field``.

    Raises:
        error: one line naming the field and what it must be.
    """
    if not isinstance(data, dict):
        raise error(f"{source}: field '{field}' must be a JSON object such as {example}, got {type(data).__name__}")
    unknown = [key for key in data if key not in keys]
    if unknown:
        raise error(f"{source}: field '{field}' has an unknown key {one_line(str(unknown[0]))[:40]!r}; "
                    f"its keys are {', '.join(keys)}")
    if keys[0] not in data:
        raise error(f"{source}: field '{field}.{keys[0]}' is missing")
    for key in lists:
        if key in data and not isinstance(data[key], list):
            raise error(f"{source}: field '{field}.{key}' must be a list, got {type(data[key]).__name__}")
    return data


def _type_problem(value: Any, hint: Any) -> str:
    """What ``value`` must be to match ``hint``, or ``""`` when it does."""
    if hint is bool:
        return "" if isinstance(value, bool) else "true or false"
    if hint is str:
        return "" if isinstance(value, str) else "a string"
    if hint is int:
        return "" if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else "an integer >= 0"
    if hint is float:
        number = finite_number(value)
        return "" if number is not None and number >= 0 else "a finite number >= 0"
    if typing.get_origin(hint) is dict:
        key_hint, value_hint = typing.get_args(hint)
        if not isinstance(value, dict) or any(
            _type_problem(key, key_hint) or _type_problem(item, value_hint) for key, item in value.items()
        ):
            return f"an object of {key_hint.__name__} to {value_hint.__name__}"
        return ""
    raise TypeError(f"record_from_json cannot check fields of type {hint}")  # a bug: a new field kind
