"""The search store: every call and candidate round-trips, dedupe by source hash, WAL, budget counts."""

from __future__ import annotations

import sqlite3

import pytest

from forgepack.search.store import Store, VerdictRow


def _verdict(accepted: bool, category: str | None, speedup: float | None) -> VerdictRow:
    return VerdictRow(
        accepted=accepted, category=category, reason="because", speedup=speedup, ci_low=1.1, ci_high=1.3,
        eager_us=10.0, kernel_us=8.0, compile_s=1.5, verify_s=0.2, bench_s=0.4, feedback="fb",
        verdict={"accepted": accepted, "category": category}, binary_path="kernels/x.so" if accepted else None,
    )


def test_round_trip_through_a_reopened_file(tmp_path):
    path = tmp_path / "store.sqlite"
    with Store(path) as store:
        call, cand = store.record_call(
            card_id="mul-1", parent_id=None, proposer="templates", reason="top share",
            decision={"card_id": "mul-1"}, source_hash="a" * 64, source_path="kernels/mul-1/a.cpp",
            params={"template": "ew", "params": {"vec": 4}}, candidate_proposer="templates:ew",
        )
        assert call.outcome == "new" and cand.state == "pending" and call.candidate_id == cand.id
        store.record_verdict(cand.id, _verdict(True, None, 1.25))
        store.set_meta("plan", {"mul-1": 3})
    with Store(path) as store:
        [call2] = store.calls()
        [cand2] = store.candidates()
        assert call2 == call
        assert cand2.state == "evaluated" and cand2.accepted is True and cand2.speedup == 1.25
        assert cand2.params == {"template": "ew", "params": {"vec": 4}}
        assert cand2.proposer == "templates:ew" and cand2.binary_path == "kernels/x.so"
        assert cand2.verdict == {"accepted": True, "category": None}
        assert store.get_meta("plan") == {"mul-1": 3}
        assert store.get_meta("missing", 7) == 7
        mode = store.db.execute("PRAGMA journal_mode").fetchone()[0]
        assert mode == "wal"


def test_dedupe_by_source_hash_per_card(tmp_path):
    with Store(tmp_path / "s.sqlite") as store:
        _, first = store.record_call(card_id="c1", parent_id=None, proposer="anthropic", reason="r",
                                     source_hash="h", source_path="p", tokens_in=100, tokens_out=50, cost=0.01)
        dup, again = store.record_call(card_id="c1", parent_id=first.id, proposer="anthropic", reason="r",
                                       source_hash="h", source_path="p", tokens_in=10, tokens_out=5, cost=0.002)
        other, elsewhere = store.record_call(card_id="c2", parent_id=None, proposer="anthropic", reason="r",
                                             source_hash="h", source_path="q")
        assert dup.outcome == "duplicate" and again.id == first.id and dup.candidate_id == first.id
        assert "identical to candidate" in dup.feedback
        assert other.outcome == "new" and elsewhere.id != first.id  # same source, another card: evaluated
        assert len(store.candidates()) == 2
        assert store.calls_spent() == 3 and store.calls_spent("anthropic") == 3 and store.calls_spent("templates") == 0
        tokens_in, tokens_out, cost = store.spend()
        assert (tokens_in, tokens_out) == (110, 55) and cost == pytest.approx(0.012)


def test_malformed_call_counts_and_keeps_feedback(tmp_path):
    with Store(tmp_path / "s.sqlite") as store:
        call, cand = store.record_call(card_id="c1", parent_id=None, proposer="anthropic", reason="r",
                                       feedback="no code block", tokens_in=5, tokens_out=7, cost=0.001)
        assert call.outcome == "malformed" and cand is None and call.candidate_id is None
        assert call.feedback == "no code block"
        assert store.calls_spent("anthropic") == 1 and store.candidates() == []


def test_pending_and_filters(tmp_path):
    with Store(tmp_path / "s.sqlite") as store:
        ids = []
        for i in range(3):
            _, cand = store.record_call(card_id="c1" if i < 2 else "c2", parent_id=None, proposer="templates",
                                        reason="r", source_hash=f"h{i}", source_path=f"p{i}")
            ids.append(cand.id)
        store.record_verdict(ids[0], _verdict(False, "compile", None))
        assert [c.id for c in store.candidates(state="pending")] == ids[1:]
        assert [c.id for c in store.candidates(card_id="c1")] == ids[:2]
        failed = store.candidate(ids[0])
        assert failed.failed and failed.accepted is False
        slow = store.record_verdict(ids[1], _verdict(False, "slower", 0.9))
        assert not slow.failed  # a correct kernel that was too slow can still be refined
        with pytest.raises(KeyError):
            store.candidate(999)


def test_a_failed_transaction_leaves_nothing(tmp_path):
    with Store(tmp_path / "s.sqlite") as store:
        with pytest.raises(sqlite3.IntegrityError), store.transaction() as db:
            db.execute("INSERT INTO meta (key, value) VALUES ('a', '1')")
            db.execute("INSERT INTO meta (key, value) VALUES ('a', '2')")
        assert store.get_meta("a") is None
