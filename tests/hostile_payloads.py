"""Payloads for the hostile-plan tests and the checks that a generated file holds them inertly.

Each payload is code that creates a marker file (``MARKER``...) if it ever runs, wrapped in
characters that try to break out of a docstring, a comment or a quoted string.
``test_hostile_plans.py`` puts them into plan fields and compiles; ``test_source_text_rules.py``
checks ``codegen.source_text``'s rules on them directly and shows the checks can fail.
"""

from __future__ import annotations

import ast
import io
import tempfile
import tokenize
import warnings
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
MARKER = "PWNED"


def touch_payload(tag: str) -> str:
    return f"__import__('pathlib').Path('{MARKER}_{tag}').touch()"


def shell_payload(tag: str) -> str:
    return f"__import__('os').system('touch {MARKER}_SH_{tag}')"


# Each payload takes the row's tag (so a marker file names the row that leaked) and holds
# code that creates a marker file if it ever runs.
PAYLOADS: dict[str, Callable[[str], str]] = {
    "triple_double_quotes": lambda tag: f'x"""\n{touch_payload(tag)}\n"""',
    "triple_single_quotes": lambda tag: f"x'''\n{touch_payload(tag)}\n'''",
    "newline": lambda tag: f"x\n{touch_payload(tag)}\n#",
    "carriage_return": lambda tag: f"x\r{touch_payload(tag)}\r#",
    "form_feed_separators_nul": lambda tag: f"x\x0c\x0b\x1c\x85\u2028\u2029\x00{touch_payload(tag)}",
    "quote_break": lambda tag: f'x"), {touch_payload(tag)}, ("',
    "backslash": lambda tag: f"x\\\n{touch_payload(tag)}\n#\\",
    "hash_and_shell": lambda tag: f'x # ")\n{shell_payload(tag)}\n#',
}
# The payloads that run when pasted raw into one of RAW_CONTEXTS (the others make the file
# fail to parse there): the controls at the end prove it.
LIVE_PAYLOADS = ("triple_double_quotes", "triple_single_quotes", "newline", "carriage_return", "quote_break", "hash_and_shell")
# Characters that must never appear raw in a generated file: each ends a line for Python,
# for str.splitlines or for an editor, or cannot be in source at all.
RAW_FORBIDDEN = "\r\x0b\x0c\x00\x1c\x1d\x1e\x85\u2028\u2029"


def printable(text: str) -> bool:
    return text.isprintable()


def breakouts(source: str) -> list[str]:
    """Why ``source`` is not inert (empty when it is): it does not parse, holds a raw
    forbidden character, or a token outside strings and comments holds a piece of a payload."""
    problems = [f"raw {character!r}" for character in RAW_FORBIDDEN if character in source]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a raw backslash payload warns of invalid escapes
            ast.parse(source)
    except (SyntaxError, ValueError) as error:
        return [*problems, f"does not parse: {error}"]
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if (MARKER in token.string or "__import__" in token.string) and token.type not in (tokenize.STRING, tokenize.COMMENT):
            problems.append(f"line {token.start[0]}: {tokenize.tok_name[token.type]} token {token.string!r}")
    return problems


def marker_files(*places: Path) -> list[Path]:
    """Marker files under ``places`` (recursively), in the temporary folder and the repo."""
    found = []
    for place in places:
        if place.is_dir():
            found += [p for p in place.rglob(f"{MARKER}*")]
    for top in (Path(tempfile.gettempdir()), REPO, Path.cwd()):
        found += list(top.glob(f"{MARKER}*"))
    return sorted(set(found))
