"""Small helpers that word one-line error messages (shared by the model-spec builders)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["did_you_mean", "exception_line", "settings_text"]


def exception_line(exc: BaseException | None) -> str:
    """``"Type: message"`` on one line, cut to 300 characters (``planner.errors.one_line``
    escapes any text; this words an exception for a message)."""
    if exc is None:
        return "unknown error"
    # Multi-line messages (e.g. huggingface_hub's validation errors put the cause on the
    # second line) are joined, and long ones cut, so the CLI still prints one line.
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def did_you_mean(key: str, names: Iterable[str]) -> str:
    """``" (did you mean 'a' or 'b'?)"`` for names spelled like ``key``, else ``""``."""
    close = difflib.get_close_matches(key, list(names), n=3)
    return f" (did you mean {' or '.join(repr(name) for name in close)}?)" if close else ""


def settings_text(overrides: Mapping[str, Any]) -> str:
    """``"a=1, b='x'"``, or ``"no overrides"``."""
    return ", ".join(f"{key}={value!r}" for key, value in overrides.items()) or "no overrides"


def value_kind(value: Any) -> str:
    """What a value is, for a message: ``a tuple (Tensor, dict)``, ``a NoneType``."""
    if isinstance(value, (tuple, list)):
        inner = ", ".join(type(item).__name__ for item in value[:4])
        return f"a {type(value).__name__} ({inner}{', ...' if len(value) > 4 else ''})"
    return f"a {type(value).__name__}"
