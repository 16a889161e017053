"""tools/probe_overhead.py: per op, the host time a pack's forward adds over stock's."""

from __future__ import annotations

from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def test_compare_gives_each_op_its_added_milliseconds_largest_first(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    import probe_overhead

    stock = {"wall_ms": 10.0, "ops": {"aten::mul": {"calls": 100, "us": 900.0}, "aten::add": {"calls": 50, "us": 400.0},
                                      "aten::div_": {"calls": 5, "us": 80.0}}}
    pack = {"wall_ms": 10.5, "ops": {"aten::mul": {"calls": 100, "us": 1500.0},
                                     "aten::add": {"calls": 50, "us": 350.0}}}
    rows = probe_overhead.compare(stock, pack)
    assert [r["op"] for r in rows] == ["aten::mul", "aten::div_", "aten::add"]
    mul = rows[0]
    assert mul["added_ms"] == pytest.approx(0.6) and mul["stock_us_per_call"] == 9.0 and mul["pack_us_per_call"] == 15.0
    div = rows[1]  # served inside a fused kernel: the pack no longer calls it
    assert div["calls"] == 0 and div["pack_us_per_call"] is None and div["added_ms"] == pytest.approx(-0.08)
