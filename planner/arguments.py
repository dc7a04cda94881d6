"""Checks of arguments at the edges: the API's keyword arguments, the CLI's and ``launch.py``'s flags.

Each check returns the value in its canonical type or raises ``ArgumentError`` with one line
naming the argument, the rule and the value. ``flag_type`` turns a check into an argparse
``type=`` so a flag says the same thing, and ``OneLineParser`` makes argparse's own errors
(unknown flag, missing argument) one line too, instead of usage text.

Vocabulary layer: standard library and ``planner.errors`` only (``launch.py`` imports it
inside every torchrun rank).
"""

from __future__ import annotations

import argparse
import math
import numbers
from typing import Any, Callable, Sequence, TypeVar

from planner.errors import ArgumentError

T = TypeVar("T")


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors raise ``ArgumentError`` (one line: the problem and
    where to read the flags) instead of printing usage and exiting; ``--help`` is unchanged."""

    def error(self, message: str):  # type: ignore[override]
        raise ArgumentError(f"{message}; see {self.prog} --help")


def positive_finite(value: Any, name: str, unit: str = "") -> float:
    """A real number > 0 that is neither nan nor infinite (bools are not numbers here)."""
    if not _is_real(value) or not math.isfinite(value) or value <= 0:
        raise ArgumentError(f"{name} must be a positive finite number{unit and ' of ' + unit}, got {value!r}")
    return float(value)


def non_negative_finite(value: Any, name: str) -> float:
    """A real number >= 0 that is neither nan nor infinite."""
    if not _is_real(value) or not math.isfinite(value) or value < 0:
        raise ArgumentError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def integer_at_least(value: Any, name: str, minimum: int) -> int:
    """An int (not a bool, not a float) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ArgumentError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def one_of(value: Any, choices: Sequence[str], name: str, *, optional: bool = False) -> Any:
    """A string among ``choices`` (or None when ``optional``)."""
    if optional and value is None:
        return None
    if not isinstance(value, str) or value not in choices:
        allowed = ", ".join(repr(choice) for choice in choices) + (" or None" if optional else "")
        raise ArgumentError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def boolean(value: Any, name: str) -> bool:
    """True or False, nothing else (``1`` or ``"no"`` is probably a mistake)."""
    if not isinstance(value, bool):
        raise ArgumentError(f"{name} must be True or False, got {value!r}")
    return value


def flag_type(parse: Callable[[str], T], check: Callable[[T, str], Any], what: str) -> Callable[[str], Any]:
    """An argparse ``type=`` that parses the text with ``parse`` (``float``, ``int``) and then
    applies ``check``; argparse prefixes the message with the flag's name."""

    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        try:
            return check(value, "value")
        except ArgumentError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None

    return convert


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
