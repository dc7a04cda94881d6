"""What a user error looks like, for every test of bad input.

A user mistake is exit status 2 and exactly one line on stderr, ``error: <what is wrong and
how to fix it>``: no usage text, no traceback, never "internal error" (exit 3 is for bugs).
"""

from __future__ import annotations

from typing import Callable

from planner.cli import EXIT_USAGE, main


def assert_one_error_line(status: int, out: str, err: str, fragments: tuple[str, ...] | list[str]) -> str:
    """Check one finished run: exit 2, nothing on stdout, one ``error:`` line on stderr that
    contains every fragment; returns the line."""
    assert "Traceback" not in err, err
    assert "internal error" not in err, err
    assert status == EXIT_USAGE == 2, f"exit status {status}, stderr:\n{err}"
    assert out == "", out
    # Commands that import a plan's model file name it first (one line, before the import).
    lines = [line for line in err.splitlines() if not line.startswith("importing model file /")]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err}"
    assert lines[0].startswith("error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    return lines[0]


def assert_user_error(capsys, argv: list[str], *fragments: str) -> str:
    """Run ``planner`` in-process (``main(argv)``); expect exit 2 and one ``error:`` line
    containing ``fragments``."""
    capsys.readouterr()  # what earlier steps of the test printed is not this command's
    status = main(argv)
    out, err = capsys.readouterr()
    return assert_one_error_line(status, out, err, fragments)


def assert_api_error(call: Callable[[], object], kind: type[Exception], *fragments: str) -> str:
    """Call ``call``; expect ``kind`` (a ``PlannerError`` subclass) with a one-line message
    containing ``fragments``; returns the message."""
    from planner.errors import PlannerError

    assert issubclass(kind, PlannerError)
    try:
        call()
    except PlannerError as error:
        message = str(error)
        assert isinstance(error, kind), f"expected {kind.__name__}, got {type(error).__name__}: {message}"
        assert "\n" not in message and message, repr(message)
        for fragment in fragments:
            assert fragment in message, f"{fragment!r} not in {message!r}"
        return message
    raise AssertionError(f"expected {kind.__name__}, nothing was raised")
