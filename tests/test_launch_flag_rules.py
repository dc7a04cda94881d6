"""``launch.py`` flags that parse one by one but do not fit together are refused with one line
before anything starts (``codegen.runtime.flag_rules``), and the combinations users run are
still accepted."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from codegen.runtime.flag_rules import check_flag_combinations
from codegen.runtime.launcher import build_parser, main
from user_errors import assert_one_error_line

REFUSED = [
    (["--steps", "10", "--warmup-steps", "50"], ["--warmup-steps 50 is more than --steps 10", "at most 10 warm-up steps"]),
    (["--steps", "10", "--lr-schedule", "cosine", "--warmup-steps", "10"],
     ["--lr-schedule cosine decays after the --warmup-steps 10", "no step to decay over"]),
    (["--steps", "10", "--lr-schedule", "cosine", "--min-lr-ratio", "1.5"], ["--min-lr-ratio 1.5 is above 1"]),
    (["--data", "d.py:f", "--min-lr-ratio", "2"], ["--min-lr-ratio 2 is above 1"]),
    (["--steps", "10", "--min-lr-ratio", "0.1"], ["--min-lr-ratio 0.1 says where a decay ends", "--lr-schedule cosine"]),
    (["--check", "--warmup-steps", "5"], ["--warmup-steps acts on training steps", "add --steps N", "leave it out"]),
    (["--check", "--metrics", "m.jsonl", "--clip-grad-norm", "1"],
     ["--clip-grad-norm and --metrics act on training steps", "leave them out"]),
    (["--comm-audit", "--log-every", "5"], ["--log-every acts on training steps"]),
    (["--check", "--profile", "m.json"], ["--profile acts on training steps"]),
    (["--steps", "3", "--atol", "1e-3"], ["--atol and --rtol are the tolerances of --check", "add --check"]),
    (["--steps", "3", "--rtol", "1e-3"], ["--atol and --rtol are the tolerances of --check"]),
]


@pytest.mark.parametrize(("argv", "fragments"), REFUSED, ids=[" ".join(row[0]) for row in REFUSED])
def test_incoherent_flags_are_one_line_before_anything_starts(capsys, tmp_path: Path, monkeypatch, argv, fragments) -> None:
    monkeypatch.setenv("RANK", "0")
    assert_one_error_line(main(tmp_path, argv), *capsys.readouterr(), fragments)  # no program here: refused first


@pytest.mark.parametrize("argv", [
    ["--steps", "10", "--warmup-steps", "9", "--lr-schedule", "cosine", "--min-lr-ratio", "1"],
    ["--steps", "10", "--warmup-steps", "10"],  # warm-up over the whole run, constant after
    ["--data", "d.py:f", "--warmup-steps", "100"],  # no known total: warm-up still applies
    ["--check", "--atol", "1e-3", "--steps", "2", "--metrics", "m.jsonl", "--log-every", "2", "--clip-grad-norm", "1"],
    ["--steps", "12", "--lr-schedule", "linear", "--min-lr-ratio", "0", "--profile", "m.json"],
])
def test_coherent_flags_pass(argv) -> None:
    options: argparse.Namespace = build_parser().parse_args(argv)
    check_flag_combinations(options)  # raises LaunchError if refused
