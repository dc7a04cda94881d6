"""Text sized to the terminal it is printed in.

The report's tables and paragraphs are laid out for a width: ``terminal_width`` is the
terminal's (``COLUMNS`` when set, else the terminal's size, else ``DEFAULT_WIDTH`` when the
output is a file or a pipe), kept between ``NARROWEST`` and ``WIDEST`` so a very narrow
window still gets a readable table and a very wide one does not spread a table across a
screen. ``wrap_command`` breaks a shell command across lines with ``\\`` continuations, so a
command longer than the terminal can still be pasted as it is.

Vocabulary layer: standard library only.
"""

from __future__ import annotations

import shutil

__all__ = ["DEFAULT_WIDTH", "NARROWEST", "WIDEST", "terminal_width", "wrap_command"]

# Width when the output is not a terminal (a log, a pipe, a test) and COLUMNS is not set.
DEFAULT_WIDTH = 100
# Below 60 columns the strategy table's five columns wrap into one word per line.
NARROWEST = 60
# Beyond 160 columns a table's lines are longer than the eye follows.
WIDEST = 160


def terminal_width() -> int:
    """Columns to lay text out in: the terminal's width (``COLUMNS`` first), clamped to
    [``NARROWEST``, ``WIDEST``]; ``DEFAULT_WIDTH`` when there is no terminal."""
    columns = shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns
    if columns <= 0:  # some CI runners report a zero-sized terminal
        columns = DEFAULT_WIDTH
    return max(NARROWEST, min(WIDEST, columns))


def wrap_command(command: str, width: int, indent: str = "") -> list[str]:
    """``command`` (one shell line, arguments already quoted) as lines of at most ``width``
    columns where the words allow: broken between arguments with `` \\`` continuations, the
    continuation lines indented four more spaces; a trailing ``# comment`` goes on its own
    line first (a comment cannot follow a continuation). A single argument longer than the
    line is kept whole: breaking it would change the command."""
    words, comment = _shell_words(command)
    lines = [f"{indent}{line}" for line in _wrap_comment(comment, width - len(indent))] if comment else []
    current = indent
    continuation = indent + "    "
    for word in words:
        start = current in (indent, continuation)
        candidate = current + word if start else f"{current} {word}"
        # Room for " \" at the end of every line but the last.
        if not start and len(candidate) + 2 > width:
            lines.append(current + " \\")
            current = continuation + word
        else:
            current = candidate
    lines.append(current)
    return lines


def _shell_words(command: str) -> tuple[list[str], str]:
    """The words of ``command`` as written (quotes kept) and its trailing comment, if any."""
    words: list[str] = []
    word = ""
    quote = ""
    for position, character in enumerate(command):
        if quote:
            word += character
            if character == quote:
                quote = ""
        elif character in "'\"":
            word += character
            quote = character
        elif character == "#" and not word:  # '#' at a word's start begins a comment
            return words, command[position:].strip()
        elif character.isspace():
            if word:
                words.append(word)
                word = ""
        else:
            word += character
    if word:
        words.append(word)
    return words, ""


def _wrap_comment(comment: str, width: int) -> list[str]:
    import textwrap

    text = comment.lstrip("#").strip()
    return textwrap.wrap(text, width=max(20, width - 2), initial_indent="# ", subsequent_indent="# ",
                         break_on_hyphens=False, break_long_words=False)
