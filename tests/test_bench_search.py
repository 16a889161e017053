"""tools/bench_search.py keeps a reader's figures and no per-candidate dump: a rerun's results stay small."""

from __future__ import annotations

import json
from pathlib import Path

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def _search_result(cards: int, calls: int) -> dict:
    """A search's `run.result_json` as a tiny-llama build gives it: a row per card, the plan, the kernels."""
    rows = [{"card_id": f"op-{k:03d}", "op": "op", "signature": "f32[1,32,64], f32[1,32,64]" * 3, "share": 0.01,
             "baseline": "native", "calls": 1 if k < calls else 0, "counts": {"accepted": 1} if k < calls else {},
             "best_speedup": 1.5 if k < calls else None, "best_candidate": k, "kernel_us": 2.0,
             "roofline_us": 0.04, "eager_us": 3.0, "fused_away": 0, "gain": 0.003, "roofline_pct": 2.0}
            for k in range(cards)]
    accepted = [{"card_id": f"op-{k:03d}", "speedup": 1.5123456, "ci_low": 1.4, "ci_high": 1.6,
                 "proposer": "templates:t", "candidate_id": k, "source": "x" * 2000} for k in range(calls)]
    return {"calls": calls, "new_calls": calls, "evaluated": calls, "tokens": [0, 0], "cost": 0.0, "wall_s": 14.0,
            "stopped": "budget spent", "estimated_gain": 0.38, "cards": rows, "accepted": accepted,
            "plan": [{"card_id": r["card_id"], "why": "y" * 200} for r in rows]}


def test_a_rerun_keeps_the_figures_and_drops_the_dumps(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    import bench_search

    arm = bench_search.compact(_search_result(cards=76, calls=16))
    assert "plan" not in arm and arm["estimated_gain"] == 0.38 and arm["stopped"] == "budget spent"
    assert arm["accepted"][0] == ["op-000", 1.5123]  # card and speed-up: what the summary and a reader use
    assert len(arm["cards"]) == 16 and set(arm["cards"][0]) == set(bench_search.CARD_KEYS)  # called cards only

    rounds = [{"allocator": dict(arm), "uniform": dict(arm)} for _ in range(7)]
    kept = bench_search.trim(rounds)
    assert all("cards" not in rd[a] for rd in kept[:-1] for a in rd)
    assert kept[-1]["allocator"]["cards"] == arm["cards"]  # the markdown's last-round table reads them
    summary = bench_search.summary(kept)
    assert summary["allocator"]["accepted"] == 16 and summary["difference"]["allocator_ahead_in"] == 0
    # seven rounds of two arms, 76 cards: under 20 KB, where the whole results are over 400 KB
    full = [{"allocator": _search_result(76, 16), "uniform": _search_result(76, 16)} for _ in range(7)]
    assert len(json.dumps(full)) > 400_000
    assert len(json.dumps(kept)) < 20_000, len(json.dumps(kept))
