"""``benchmarks/components.py``: the component table runs, and every row names its source."""

from __future__ import annotations

from benchmarks.components import component_rows, main


def test_fast_table_has_a_sourced_row_per_component(capsys):
    main(["--fast"])
    printed = capsys.readouterr().out
    rows = component_rows(fast=True)
    assert {row.component for row in rows} == {"GEMM", "attention", "collective"}
    for row in rows:
        assert row.source and row.published > 0 and row.predicted > 0
        assert row.source in printed  # each printed line carries its source
    assert "median |error|" in printed


def test_full_table_checks_gemms_against_measurements_no_constant_came_from():
    # A table of only the figures the constants were read from would check nothing.
    rows = component_rows()
    independent = [row for row in rows if not row.sets_constant]
    assert {row.component for row in independent} >= {"GEMM", "collective"}
    assert len({row.source for row in rows}) >= 8
