"""How text from a plan, a spec or a trace may enter generated Python source.

Plans are shared between people, so every string in one (and in the model spec it names,
and in the graph traced from that model) is untrusted data. It reaches a generated file in
one of three ways only:

- as a **literal**, written with ``repr()`` (``literal``): a string stays a string whatever
  it holds (quotes, newlines, backslashes);
- as a **comment**, made one inert line first (``one_line``, from ``planner.errors``;
  ``comment``, ``with_comment``): every character Python or an editor could take for a line
  break (``\\n``, ``\\r``, form feed, NUL, ``\\x85``, ``\\u2028``...) and every other
  unprintable one is written as its ``repr()`` escape, and backslashes are doubled, so the
  text cannot end the comment;
- as a **name** (a variable, a parameter, a function), only once checked to be a Python
  identifier that is not a keyword (``identifier``), or derived from text into one
  (``derived_identifier``).

Untrusted text never goes inside a docstring (a ``\"\"\"`` in it would end the string): the
emitters write it in comments or constants below the docstring. Numbers the program uses
(batch sizes, micro-batches) go through ``number``, which refuses anything but an int or a
float, so a string smuggled into a numeric field cannot become code either.

Which names must exist in the model (module paths, inputs, parameters, mesh axes) is checked
in ``codegen.plan_checks``; this module only knows about text.
"""

from __future__ import annotations

import keyword
import re
from typing import Any

from planner.errors import PlanningError, one_line

__all__ = ["comment", "derived_identifier", "identifier", "literal", "number", "one_line", "with_comment"]


def comment(text: Any) -> str:
    """A whole-line comment holding ``text`` (``# ...``), one line whatever ``text`` holds."""
    text = one_line(text)
    return f"# {text}" if text else "#"


def with_comment(code: str, text: Any) -> str:
    """``code`` followed by an end-of-line comment holding ``text`` (none when it is empty)."""
    return f"{code}  # {one_line(text)}" if str(text) else code


def literal(value: Any) -> str:
    """Python source of a plain value: ``str``, ``int``, ``float``, ``bool``, ``None`` and
    tuples/lists of them, written with ``repr()``. Anything else is refused: its ``repr``
    need not be valid (or inert) source."""
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return f'float("{value}")'
        return repr(value)
    if isinstance(value, tuple):
        inner = ", ".join(literal(item) for item in value)
        return f"({inner}{',' if len(value) == 1 else ''})"
    if isinstance(value, list):
        return "[" + ", ".join(literal(item) for item in value) + "]"
    raise TypeError(f"cannot write a {type(value).__name__} as a Python literal")


def number(value: Any, field: str) -> str:
    """Source of a number the program uses (an int or a float; never a bool or a string).

    Raises:
        PlanningError: ``value`` is not a number; the message names the plan ``field``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanningError(f"plan field '{field}' must be a number, got {type(value).__name__} {one_line(repr(value))}")
    return literal(value)


def identifier(name: Any, field: str) -> str:
    """``name`` itself, once checked to be usable as a Python name: a ``str`` for which
    ``str.isidentifier()`` holds and that is not a keyword (``class``, ``None``, ...).

    Raises:
        PlanningError: it is not; the message names where the name came from (``field``).
    """
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise PlanningError(
            f"{field} is {one_line(repr(name))}, which is not a Python identifier; generated code can only use "
            f"names made of letters, digits and underscores (re-plan, or rename it in the model)"
        )
    return name


def derived_identifier(text: Any, prefix: str = "_", fallback: str = "value") -> str:
    """A Python name made from ``text`` (``"blocks.0"`` -> ``"_blocks_0"``): every character
    that cannot appear in a name becomes ``_``; ``fallback`` stands in for text with no
    usable character. The result is always a valid identifier, never a keyword."""
    body = re.sub(r"\W", "_", str(text), flags=re.ASCII).strip("_") or fallback
    name = f"{prefix}{body}"
    if not name.isidentifier() or keyword.iskeyword(name):
        name = f"_{name}"
    return identifier(name, "a derived name")


def torch_imports(checkpointing: bool) -> list[str]:
    """The opening import lines every generated program shares (``checkpoint`` only when some
    block is recomputed)."""
    return [
        "from __future__ import annotations",
        "",
        "import torch",
        "from torch.distributed.device_mesh import DeviceMesh",
        "from torch.distributed.tensor import Partial, Replicate, Shard",
        *(["from torch.utils.checkpoint import checkpoint"] if checkpointing else []),
        "",
    ]
