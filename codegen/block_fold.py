"""Each repeated block written once: a function called per layer with that layer's parameters.

The emitters write a program's forward block by block (``codegen.spmd_recompute.block_runs``);
this module then compares the blocks' code. Two blocks are alike when their code is the same
up to the names of their values: the same ops on the same shapes, the same redistributions
(so the same placements), the same parameters relative to the block's own module path
(``attn.c_attn.weight`` under ``blocks.0.`` and under ``blocks.3.``), reading the same number
of values from outside. Blocks alike to another become one module-level function, written
once with the first block's names, and each such block becomes one call line::

    add_9 = blocks_block(self, 'blocks.1.', add_5, ('dropout_4', 'dropout_5'))

``self`` is the module on this rank (graph program or pipeline stage), the string the block's
parameter prefix (the function reads ``params[prefix + 'attn.c_attn.weight']``), then the values
the block reads from the rest of the forward, then (when the block has dropout) the names of
its dropout ops, by which the runtime finds each one's module. A block alike to no other (a
plan that lays one layer out otherwise, a last layer of another structure) stays written out.

Comparing the code, not the plan, keeps this exact: whatever the emitter wrote for one block
(redistributions, fallbacks, inlined autocast regions, the shapes and placements noted at
the end of each line) is what runs, and what those notes say, for every block that calls the
function. Blocks under ``recompute="full"`` are called through
``checkpoint`` (``codegen.spmd_recompute`` checkpoints the blocks left written out).
"""

from __future__ import annotations

import ast
import io
import itertools
import keyword
import re
import textwrap
import tokenize
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch.fx

from codegen.source_text import comment, derived_identifier
from codegen.spmd_recompute import KEEPING_ARGUMENT, block_runs, checkpoint_blocks, names_in, require_blocks
from planner.strategy import KEEP_A2A, WHOLE_BLOCK_RECOMPUTE

if TYPE_CHECKING:
    from codegen.spmd_emit import GraphEmitter

Run = tuple[Any, list[str]]  # (block or None, its lines), as the emitters write them
_PAD = " " * 8  # the forward's body
_BODY = " " * 4  # a module-level function's body
_SKIPPED = (tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER)
_PROVIDED = ("_to", "params")
_REDISTRIBUTION = re.compile(r"^(?P<target>\w+) = _to\((?P<source>\w+), \w+\)(  #.*)?$")
_MAX_MOVED = 4  # redistributions tried for moving out of a block (every subset of them is tried)  # the forward's own shorthands; the function sets them itself


@dataclass
class _Written:
    """One block's code, read as tokens: its canonical form (``key``) and what a call of the
    block function passes for it."""

    block: tuple[str, int]
    lines: list[str]
    key: tuple
    stored: list[str]  # names the block assigns, in canonical order
    free: list[str]  # values it reads from the rest of the forward, in canonical order
    strings: list[str]  # its per-layer strings (dropout op names), in canonical order
    outputs: set[int] = field(default_factory=set)  # canonical indices of ``stored`` read elsewhere
    hoisted: list[str] = field(default_factory=list)  # redistributions moved before the call

    @property
    def prefix(self) -> str:
        return f"{self.block[0]}.{self.block[1]}."


@dataclass
class _Function:
    name: str
    members: list[_Written]
    parameters: dict[str, str]  # placeholder in the first block -> relative name


class BlockFolder:
    """Folds the alike blocks of one program (all pipeline stages together, so stages share
    the functions). ``placeholders`` maps the forward's parameter and buffer placeholders to
    ``("param" | "buffer", qualified name)``; ``forward_locals`` names every value the program's
    forwards define (the rest of a block's free names are globals: ``aten``, ``self``, constants);
    ``prelude`` maps each placeholder to its line in the forward (reused, made relative, in the
    function)."""

    def __init__(self, placeholders: dict[str, tuple[str, str]], prelude: dict[str, str], forward_locals: set[str], used_names: set[str]):
        self.placeholders = placeholders
        self.prelude = prelude
        self.forward_locals = set(forward_locals) - set(_PROVIDED)
        self.used_names = used_names
        self.functions: list[_Function] = []
        self.moved: set[str] = set()  # placeholders read inside a block function

    # ------------------------------------------------------------------------ folding

    def fold(self, stages: Sequence[Sequence[Run]], also_read: Sequence[set[str]], recompute: Sequence[str]) -> list[list[Run]]:
        """``stages``' runs with every block alike to another replaced by a call of its
        function (a run labelled ``None``). ``also_read[s]``: names stage ``s``'s own
        lines outside its runs read (the loss line, sends), and those other stages read."""
        written: dict[tuple[int, int], _Written] = {}
        loaded = [[names_in(lines, ast.Load) for _, lines in runs] for runs in stages]
        for s, runs in enumerate(stages):
            for r, (block, lines) in enumerate(runs):
                if block is None or len(block) != 2 or recompute[s] == "selective":
                    continue
                found = self._read(block, lines)
                if found is None:
                    continue
                elsewhere = set(also_read[s]).union(*(loaded[s][i] for i in range(len(runs)) if i != r))
                found.outputs = {i for i, name in enumerate(found.stored) if name in elsewhere}
                written[s, r] = found
        by_key: dict[tuple, list[_Written]] = {}
        for found in written.values():
            by_key.setdefault(found.key, []).append(found)
        for place, found in list(written.items()):  # a block alike to others once it redistributes its inputs before
            if len(by_key.get(found.key, ())) == 1:
                joined = self._hoisting(found, set(by_key) - {found.key})
                if joined is not None:
                    joined.outputs = {i for i, name in enumerate(joined.stored) if name in found.stored and
                                      found.stored.index(name) in found.outputs}
                    del by_key[found.key]
                    by_key[joined.key].append(joined)
                    written[place] = joined
        function_of: dict[int, _Function] = {}
        place_of = {id(found): place for place, found in written.items()}
        groups = [sorted(members, key=lambda m: place_of[id(m)]) for members in by_key.values() if len(members) > 1]
        groups.sort(key=lambda members: place_of[id(members[0])])
        for members in groups:
            function = self._function(members, several=sum(g[0].block[0] == members[0].block[0] for g in groups) > 1)
            self.functions.append(function)
            for member in members:
                function_of[id(member)] = function
        folded: list[list[Run]] = []
        for s, runs in enumerate(stages):
            out: list[Run] = []
            previous = None
            for r, (block, lines) in enumerate(runs):
                found = written.get((s, r))
                function = function_of.get(id(found)) if found is not None else None
                if function is None:
                    out.append((block, lines))
                elif previous is not None and previous is function and not found.hoisted:
                    out[-1][1].extend(self._call(function, found, recompute[s]))
                else:
                    out.append((None, self._call(function, found, recompute[s], first=True)))
                previous = function if function is None or lines else None
            folded.append(out)
        return folded

    def _hoisting(self, found: _Written, keys: set[tuple]) -> _Written | None:
        """``found`` with some of the redistributions of values it reads from outside
        (``x_tp_s1 = _to(x, TP_S1)`` with their comments) moved before it, if that makes it
        alike to other blocks (``keys``: their forms): the first layer of a stack often
        receives its input in another layout than the others (e.g. the embedding's partial
        sums), and redistributes it itself. ``None`` when no such form is found."""
        movable = _movable_redistributions(found.lines, set(found.stored))
        if not movable or len(movable) > _MAX_MOVED:
            return None
        for size in range(1, len(movable) + 1):
            for chosen in itertools.combinations(movable, size):
                taken = {row for rows in chosen for row in rows}
                remaining = [line for row, line in enumerate(found.lines) if row not in taken]
                candidate = self._read(found.block, remaining)
                if candidate is not None and candidate.key in keys:
                    candidate.hoisted = [_PAD + found.lines[row].strip() for row in sorted(taken)]
                    return candidate
        return None

    def _read(self, block: tuple[str, int], lines: list[str]) -> _Written | None:
        """The block's canonical form: its tokens, comments left out, with the names it
        assigns numbered in order of appearance, the values it reads from outside numbered
        likewise, its own parameters named relative to its prefix, and string literals naming
        its values (dropout ops) numbered. ``None`` when the code cannot be read so."""
        text = textwrap.dedent("\n".join(lines))
        try:
            tokens = [t for t in tokenize.generate_tokens(io.StringIO(text + "\n").readline) if t.type not in _SKIPPED]
            assigned = names_in(lines, ast.Store)
        except (tokenize.TokenError, SyntaxError, IndentationError):
            return None
        prefix = f"{block[0]}.{block[1]}."
        stored: dict[str, int] = {}
        free: dict[str, int] = {}
        strings: dict[str, int] = {}
        key: list[Any] = []
        depth = 0
        for position, token in enumerate(tokens):
            kind, text_ = token.type, token.string
            if kind == tokenize.OP:
                depth += text_ in "([{"
                depth -= text_ in ")]}"
                key.append(text_)
            elif kind == tokenize.NAME:
                after_dot = position > 0 and tokens[position - 1].string == "."
                keyword_argument = depth > 0 and position + 1 < len(tokens) and tokens[position + 1].string == "="
                if after_dot or keyword_argument or keyword.iskeyword(text_):
                    key.append(text_)
                elif text_ in assigned:
                    key.append(("s", stored.setdefault(text_, len(stored))))
                elif text_ in self.placeholders and self.placeholders[text_][1].startswith(prefix):
                    kind_, name = self.placeholders[text_]
                    key.append(("p", kind_, name[len(prefix):]))
                elif text_ in self.forward_locals:
                    key.append(("f", free.setdefault(text_, len(free))))
                else:
                    key.append(text_)  # a global: aten, torch, self, a placements constant
            elif kind == tokenize.STRING:
                try:
                    value = ast.literal_eval(text_)
                except (ValueError, SyntaxError):
                    return None
                if isinstance(value, str) and value in assigned:
                    key.append(("str", strings.setdefault(text_, len(strings)), stored.setdefault(value, len(stored))))
                else:
                    key.append(text_)
            elif kind == tokenize.COMMENT:
                # An end-of-line note (shape and placements, no names) must match too, so the
                # function's comments hold for every block that calls it; whole-line comments
                # (module paths, names) are left out.
                if not token.line.lstrip().startswith("#"):
                    key.append(text_)
            elif kind in (tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE):
                key.append(kind)
            else:
                key.append(text_)
        if not stored:
            return None
        return _Written(block, lines, tuple(key), list(stored), list(free), list(strings))

    # ------------------------------------------------------------------------ writing

    def _function(self, members: list[_Written], several: bool) -> _Function:
        first = members[0]
        group = first.block[0]
        base = f"{group}_block" + (f"_{first.block[1]}" if several else "")
        name = derived_identifier(base, prefix="", fallback="block")
        while name in self.used_names:
            name += "_"
        self.used_names.add(name)
        parameters: dict[str, str] = {}
        for placeholder, (_kind, qualified) in self.placeholders.items():
            if qualified.startswith(first.prefix) and placeholder not in first.stored:
                parameters[placeholder] = qualified[len(first.prefix):]
        for member in members:  # their placeholders now live in the function
            for placeholder, (_kind, qualified) in self.placeholders.items():
                if qualified.startswith(member.prefix):
                    self.moved.add(placeholder)
        return _Function(name, members, parameters)

    def _call(self, function: _Function, member: _Written, recompute: str, first: bool = False) -> list[str]:
        checkpointed = recompute in WHOLE_BLOCK_RECOMPUTE
        outputs = sorted(set().union(*(m.outputs for m in function.members)))
        targets = ", ".join(member.stored[i] for i in outputs)
        arguments = ["self", repr(member.prefix), *member.free]
        if member.strings:
            arguments.append("(" + ", ".join(member.strings) + ("," if len(member.strings) == 1 else "") + ")")
        where = f"{member.block[0]}.{member.block[1]}"
        assign = f"{targets} = " if targets else ""
        if checkpointed:
            keeping = KEEPING_ARGUMENT if recompute == KEEP_A2A else ""
            call = f"{assign}checkpoint({function.name}, {', '.join(arguments)}, use_reentrant=False{keeping})"
        else:
            call = f"{assign}{function.name}({', '.join(arguments)})"
        head = []
        if first:
            how = "recomputed in backward (activation checkpointing: backward keeps only what each block reads)" if checkpointed else ""
            head += ["", _PAD + comment(f"---- {where} on: {function.name} (below the class) per block, with its parameters' prefix"
                                        + (f"; {how}" if how else ""))]
        if member.hoisted:
            head += [_PAD + comment(f"{where} reads these laid out as {function.name} reads them:"), *member.hoisted]
        return [*head, _PAD + call]

    def source(self) -> str:
        """The block functions, for the program's module level ("" when none)."""
        return "".join("\n\n" + "\n".join(self._source(function)) + "\n" for function in self.functions)

    def _source(self, function: _Function) -> list[str]:
        first = function.members[0]
        outputs = sorted(set().union(*(m.outputs for m in function.members)))
        renamed: dict[str, str] = {}
        prelude: list[str] = []
        for placeholder in dict.fromkeys(t for t in _names(first.lines) if t in function.parameters):
            relative = function.parameters[placeholder]
            kind, qualified = self.placeholders[placeholder]
            new = derived_identifier(("p_" if kind == "param" else "b_") + relative, prefix="", fallback="weight")
            while new in self.used_names and new != placeholder:
                new += "_"
            self.used_names.add(new)
            renamed[placeholder] = new
            line = self.prelude[placeholder].strip()
            reader = f"params[{qualified!r}]" if kind == "param" else f"self.model.get_buffer({qualified!r})"
            relative_reader = reader.replace(repr(qualified), f"prefix + {relative!r}")
            if not line.startswith(f"{placeholder} = {reader}"):
                raise AssertionError(f"unexpected placeholder line {line!r}")  # the emitters write them so
            prelude.append(_BODY + f"{new} = {relative_reader}" + line[len(f"{placeholder} = {reader}"):])
        for stored in first.stored:  # copies named after a placeholder (p_blocks_0_w_local) follow it
            for old, new in list(renamed.items()):
                if stored.startswith(old + "_") and stored not in renamed:
                    candidate = new + stored[len(old):]
                    if candidate not in self.used_names:
                        self.used_names.add(candidate)
                        renamed[stored] = candidate
        strings = {text: f"op_names[{i}]" for i, text in enumerate(first.strings)}
        body = _rewrite(textwrap.indent(textwrap.dedent("\n".join(first.lines)), _BODY), renamed, strings)
        signature = ["self", "prefix: str", *first.free, *(["op_names: tuple[str, ...]"] if first.strings else [])]
        where = _blocks_text([m.block for m in function.members])
        returned = ", ".join(first.stored[i] for i in outputs)
        return [
            comment(f"One repeated block, written once; called for {where}."),
            f"def {function.name}({', '.join(signature)}):",
            '    """One block of the model, the same code for each block that calls it (written with the',
            "    first caller's names): ``self`` is the module on this rank, ``prefix`` the block's module",
            "    path (its parameters are read as ``params[prefix + name]``), then the values it reads from",
            "    the rest of the forward" + (", and its dropout ops' names (their modules give their p)" if first.strings else "") + '."""',
            _BODY + "_to, params = self._to, self.params",
            *prelude,
            *body.split("\n"),
            _BODY + f"return {returned}" if returned else _BODY + "return None",
        ]


def _blocks_text(blocks: list[tuple[str, int]]) -> str:
    """``blocks.0 to blocks.79 (80 blocks)``, or the blocks listed when not one unbroken run."""
    group, first = blocks[0]
    if all(b == (group, first + i) for i, b in enumerate(blocks)):
        return f"{group}.{first} to {group}.{first + len(blocks) - 1} ({len(blocks)} blocks)"
    return ", ".join(f"{g}.{i}" for g, i in blocks)


def _movable_redistributions(lines: list[str], stored: set[str]) -> list[tuple[int, ...]]:
    """Rows of ``lines`` (each with the comment rows just above it) that redistribute a value
    the block reads from outside (``x_tp_r = _to(x, TP_R)``) at the block's own indentation."""
    indent = min((len(line) - len(line.lstrip()) for line in lines if line.strip()), default=0)
    found = []
    for row, line in enumerate(lines):
        match = _REDISTRIBUTION.match(line[indent:]) if len(line) - len(line.lstrip()) == indent else None
        if match is None or match["source"] in stored:
            continue
        rows = [row]
        while rows[0] > 0 and lines[rows[0] - 1].strip().startswith("#") and not lines[rows[0] - 1].strip().startswith("# ----"):
            rows.insert(0, rows[0] - 1)
        found.append(tuple(rows))
    return found


def _names(lines: list[str]) -> list[str]:
    """Every name token of ``lines``, in order."""
    text = textwrap.dedent("\n".join(lines))
    return [t.string for t in tokenize.generate_tokens(io.StringIO(text + "\n").readline) if t.type == tokenize.NAME]


def _rewrite(text: str, names: dict[str, str], strings: dict[str, str]) -> str:
    """``text`` with the name tokens in ``names`` and the string tokens in ``strings`` replaced
    (attributes and keyword arguments left alone; comments untouched)."""
    lines = text.split("\n")
    tokens = list(tokenize.generate_tokens(io.StringIO(text + "\n").readline))
    edits: list[tuple[int, int, int, str]] = []
    for position, token in enumerate(tokens):
        if token.type == tokenize.NAME and token.string in names:
            if position > 0 and tokens[position - 1].string == ".":
                continue
            if position + 1 < len(tokens) and tokens[position + 1].string == "=" and tokens[position - 1].string in "(,":
                continue
            edits.append((token.start[0], token.start[1], token.end[1], names[token.string]))
        elif token.type == tokenize.STRING and token.string in strings and token.start[0] == token.end[0]:
            edits.append((token.start[0], token.start[1], token.end[1], strings[token.string]))
    for row, start, end, new in sorted(edits, reverse=True):
        line = lines[row - 1]
        lines[row - 1] = line[:start] + new + line[end:]
    return "\n".join(lines)


def forward_locals(pieces: Sequence[Sequence[str]]) -> set[str]:
    """Names assigned anywhere in ``pieces`` (each a run of lines at one indentation: a
    program's forward preludes and runs)."""
    return set().union(*(names_in(list(lines), ast.Store) for lines in pieces if lines))


def emit_block_runs(emitter: "GraphEmitter", nodes: Sequence[torch.fx.Node], gm: torch.fx.GraphModule, checkpointed: bool) -> list[Run]:
    """``nodes`` written as runs of one repeated block (or none). Each block redistributes
    what it reads itself (no copy shared with another block), so alike blocks write alike
    code; with ``checkpointed``, block runs are written one level deeper (to become nested
    functions where they stay written out)."""
    written: list[Run] = []
    for block, run in block_runs(emitter.graph, nodes):
        if block is not None:
            emitter.resharded, emitter.localized, emitter.module = {}, {}, None
        written.append((block, emitter._emit_nodes(run, gm, indent=2 + (checkpointed and block is not None))))
        if block is not None:
            emitter.resharded, emitter.localized, emitter.module = {}, {}, None
    return written


def placeholder_table(emitter: "GraphEmitter", lines: Sequence[str]) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
    """From the forward's parameter lines: placeholder -> ("param" | "buffer", qualified name),
    and placeholder -> its line."""
    kinds: dict[str, tuple[str, str]] = {}
    prelude: dict[str, str] = {}
    for line in lines:
        name = line.split("=", 1)[0].strip()
        qualified = emitter.param_of_placeholder.get(name)
        if qualified in emitter.graph.parameters:
            kinds[name] = ("param", qualified)
        elif qualified in emitter.graph.buffers:
            kinds[name] = ("buffer", qualified)
        else:
            continue
        prelude[name] = line
    return kinds, prelude


def folded_body(
    emitter: "GraphEmitter", gm: torch.fx.GraphModule, input_names: list[str], input_lines: list[str], param_lines: list[str]
) -> tuple[list[str], list[str], str]:
    """A graph program's forward body with alike blocks folded (``recompute`` "none" or
    "full"), the parameter lines it still needs, and the block functions' source."""
    full = emitter.recompute == "full"
    runs = emit_block_runs(emitter, list(gm.graph.nodes), gm, checkpointed=full)
    if full:
        require_blocks(runs)
    placeholders, prelude = placeholder_table(emitter, param_lines)
    known = forward_locals([input_lines, param_lines, *(lines for _, lines in runs)]) | set(input_names)
    folder = BlockFolder(placeholders, prelude, known, emitter.used_names)
    runs = folder.fold([runs], [set()], [emitter.recompute])[0]
    body = checkpoint_blocks(runs) if full else [line for _, lines in runs for line in lines]
    read = names_in(body, ast.Load)
    kept = [line for line in param_lines if line.split("=", 1)[0].strip() not in folder.moved or line.split("=", 1)[0].strip() in read]
    return body, kept, folder.source()
