"""The rules ``codegen.source_text`` applies to every plan string that enters generated code,
checked on the hostile payloads directly, and controls that show the payload checks can fail:
pasted raw into a generated file's contexts, the payloads break out and the live ones run.
"""

from __future__ import annotations

import ast
import io
import tokenize

import pytest

from codegen.source_text import comment, derived_identifier, identifier, literal, number, with_comment
from hostile_payloads import LIVE_PAYLOADS, PAYLOADS, breakouts, marker_files  # this folder is on sys.path under pytest
from planner.errors import PlannerError


# --------------------------------------------------------------------------------- controls

RAW_CONTEXTS = (
    '"""Docstring: {}."""\n',
    "'''Docstring: {}.'''\n",
    "# comment: {}\n",
    'fully_shard(model.get_submodule("{}"), mesh=dp_mesh)\n',  # the FSDP emitter's line on main
)
# What RAW_CONTEXTS' code needs to run outside a program.
STUBS = "def fully_shard(*args, **kwargs): pass\nclass model:\n    get_submodule = staticmethod(str)\ndp_mesh = None\n"


@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_control_payloads_pasted_raw_are_caught(payload):
    """The checks above can fail: pasted unescaped into some context of a generated file (as
    the compiler once did), every payload breaks out."""
    text = PAYLOADS[payload]("control")
    assert any(breakouts(context.format(text)) for context in RAW_CONTEXTS)


@pytest.mark.parametrize("payload", LIVE_PAYLOADS)
def test_control_live_payloads_run_when_pasted_raw(payload, tmp_path, monkeypatch):
    """The marker scan sees a payload that ran: pasted raw, each live payload runs in some
    context and leaves its marker file."""
    monkeypatch.chdir(tmp_path)
    text = PAYLOADS[payload]("control")
    for context in RAW_CONTEXTS:
        try:
            exec(compile(STUBS + context.format(text), "raw paste", "exec"), {})  # noqa: S102 - the control: it must run
        except SyntaxError:
            continue
    assert marker_files(tmp_path), f"{payload} ran nowhere"
    for marker in marker_files(tmp_path):
        marker.unlink()


# ------------------------------------------------------------------------------- the rules


@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_a_comment_is_one_inert_line_whatever_it_holds(payload):
    text = PAYLOADS[payload]("rule")
    line = comment(text)
    assert "\n" not in line and line.isprintable()
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(line + "\n").readline) if t.type == tokenize.COMMENT]
    assert [t.string for t in tokens] == [line]
    assert not breakouts(with_comment("x = 1", text) + "\n")
    assert ast.literal_eval(literal(text)) == text  # a literal is the same text back


@pytest.mark.parametrize("name", ["class", "None", "a b", "1x", "x-y", "", 3, "x\ny", "é\u2028"])
def test_identifier_refuses_what_is_not_a_python_name(name):
    with pytest.raises(PlannerError, match="not a Python identifier"):
        identifier(name, "a test name")


@pytest.mark.parametrize(
    "text, expected", [("blocks.0", "_blocks_0"), ("model.layers", "_model_layers"), ('"""\n', "_value"), ("a-b.3", "_a_b_3")]
)
def test_derived_identifiers_are_always_names(text, expected):
    assert derived_identifier(text) == expected
    assert derived_identifier("3D", prefix="", fallback="Model") == "_3D"


def test_numbers_and_literals_take_plain_values_only():
    assert number(8, "batch_size") == "8"
    for value in ("8", True, None):
        with pytest.raises(PlannerError, match="plan field 'batch_size' must be a number"):
            number(value, "batch_size")
    with pytest.raises(TypeError):
        literal(object())
