"""The search store: one SQLite file per workspace (`store.sqlite`) that a killed build resumes from.

Tables:
- ``calls``: every proposer call, in order: the card it went to, the allocator's reason, the parent
  candidate, tokens and dollars, and what came of it (``new`` candidate, ``duplicate`` of one already
  in the store, ``malformed`` reply with no kernel in it). The budget counts these rows.
- ``candidates``: every distinct kernel source per card (unique by source hash), its parent, proposer,
  parameters, source path under ``kernels/``, and once evaluated its verdict, timings and feedback.
  ``state`` is ``pending`` until its verdict is written.

Writes happen in the order that makes a `kill -9` safe: the source file is written first, then the
call and its pending candidate in one transaction, then (after evaluation) the verdict. On restart, a
pending candidate is evaluated, never re-proposed; an evaluated one is never evaluated again. WAL mode
with ``synchronous=NORMAL`` survives a killed process (only a power cut can lose the last commits).
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS calls (
    id INTEGER PRIMARY KEY,
    card_id TEXT NOT NULL,
    parent_id INTEGER,
    proposer TEXT NOT NULL,
    model TEXT,
    reason TEXT NOT NULL,
    decision TEXT,
    outcome TEXT NOT NULL,
    candidate_id INTEGER,
    feedback TEXT,
    tokens_in INTEGER NOT NULL DEFAULT 0,
    tokens_out INTEGER NOT NULL DEFAULT 0,
    cost REAL NOT NULL DEFAULT 0,
    seconds REAL NOT NULL DEFAULT 0,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS candidates (
    id INTEGER PRIMARY KEY,
    card_id TEXT NOT NULL,
    parent_id INTEGER,
    call_id INTEGER,
    proposer TEXT NOT NULL,
    params TEXT NOT NULL,
    source_hash TEXT NOT NULL,
    source_path TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',
    accepted INTEGER,
    category TEXT,
    reason TEXT,
    speedup REAL,
    ci_low REAL,
    ci_high REAL,
    eager_us REAL,
    kernel_us REAL,
    compile_s REAL,
    verify_s REAL,
    bench_s REAL,
    binary_path TEXT,
    feedback TEXT,
    verdict TEXT,
    created REAL NOT NULL,
    evaluated REAL,
    UNIQUE (card_id, source_hash)
);
CREATE INDEX IF NOT EXISTS calls_by_card ON calls (card_id);
CREATE INDEX IF NOT EXISTS candidates_by_state ON candidates (state);
"""

OUTCOMES = ("new", "duplicate", "malformed")


@dataclass(frozen=True)
class CallRecord:
    id: int
    card_id: str
    parent_id: int | None
    proposer: str
    model: str | None
    reason: str
    decision: dict | None
    outcome: str  # "new" | "duplicate" | "malformed"
    candidate_id: int | None
    feedback: str | None
    tokens_in: int
    tokens_out: int
    cost: float
    seconds: float
    created: float


@dataclass(frozen=True)
class CandidateRecord:
    id: int
    card_id: str
    parent_id: int | None
    call_id: int | None
    proposer: str
    params: dict
    source_hash: str
    source_path: str  # relative to the workspace
    state: str  # "pending" | "evaluated"
    accepted: bool | None = None
    category: str | None = None
    reason: str | None = None
    speedup: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    eager_us: float | None = None
    kernel_us: float | None = None
    compile_s: float | None = None
    verify_s: float | None = None
    bench_s: float | None = None
    binary_path: str | None = None
    feedback: str | None = None
    verdict: dict | None = None
    created: float = 0.0
    evaluated: float | None = None

    @property
    def failed(self) -> bool:
        """Evaluated and not a working kernel (did not compile, crashed, wrong...): never a parent."""
        return self.state == "evaluated" and not self.accepted and self.category != "slower"


@dataclass(frozen=True)
class VerdictRow:
    """The columns of a verdict the store keeps; `verdict` is the evaluator's full JSON."""

    accepted: bool
    category: str | None
    reason: str | None
    speedup: float | None
    ci_low: float | None
    ci_high: float | None
    eager_us: float | None
    kernel_us: float | None
    compile_s: float | None
    verify_s: float | None
    bench_s: float | None
    feedback: str
    verdict: dict
    binary_path: str | None = None


class Store:
    """A connection to a workspace's store. Not shared between threads: the build loop owns it."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, isolation_level=None, timeout=30.0)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # --- meta ------------------------------------------------------------------------------------

    def set_meta(self, key: str, value: Any) -> None:
        with self.transaction() as db:
            db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, json.dumps(value)))

    def get_meta(self, key: str, default: Any = None) -> Any:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return json.loads(row["value"]) if row else default

    # --- writes ----------------------------------------------------------------------------------

    def find_candidate(self, card_id: str, source_hash: str) -> CandidateRecord | None:
        row = self.db.execute(
            "SELECT * FROM candidates WHERE card_id = ? AND source_hash = ?", (card_id, source_hash)
        ).fetchone()
        return _candidate(row) if row else None

    def record_call(
        self,
        *,
        card_id: str,
        parent_id: int | None,
        proposer: str,
        reason: str,
        decision: dict | None = None,
        model: str | None = None,
        tokens_in: int = 0,
        tokens_out: int = 0,
        cost: float = 0.0,
        seconds: float = 0.0,
        source_hash: str | None = None,
        source_path: str | None = None,
        params: dict | None = None,
        candidate_proposer: str | None = None,
        feedback: str | None = None,
    ) -> tuple[CallRecord, CandidateRecord | None]:
        """Record one proposer call and, when it produced a source new for this card, its candidate.

        The outcome follows from the arguments: no source -> ``malformed`` (feedback says why); a source
        already in the store for this card -> ``duplicate`` (the existing candidate is linked, nothing
        is evaluated again); otherwise ``new`` with a pending candidate. One transaction for both rows.
        """
        now = time.time()
        with self.transaction() as db:
            candidate = None
            if source_hash is None:
                outcome = "malformed"
            else:
                existing = db.execute(
                    "SELECT * FROM candidates WHERE card_id = ? AND source_hash = ?", (card_id, source_hash)
                ).fetchone()
                outcome = "duplicate" if existing else "new"
                if existing:
                    candidate = _candidate(existing)
                    feedback = feedback or f"identical to candidate #{candidate.id}"
            cur = db.execute(
                "INSERT INTO calls (card_id, parent_id, proposer, model, reason, decision, outcome, feedback,"
                " tokens_in, tokens_out, cost, seconds, created) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    card_id, parent_id, proposer, model, reason, _dumps(decision), outcome, feedback,
                    tokens_in, tokens_out, cost, seconds, now,
                ),
            )
            call_id = cur.lastrowid
            if outcome == "new":
                cur = db.execute(
                    "INSERT INTO candidates (card_id, parent_id, call_id, proposer, params, source_hash,"
                    " source_path, state, created) VALUES (?,?,?,?,?,?,?,'pending',?)",
                    (
                        card_id, parent_id, call_id, candidate_proposer or proposer,
                        json.dumps(params or {}, sort_keys=True), source_hash, source_path, now,
                    ),
                )
                candidate = self._get_candidate(db, cur.lastrowid)
            if candidate is not None:
                db.execute("UPDATE calls SET candidate_id = ? WHERE id = ?", (candidate.id, call_id))
            call = _call(db.execute("SELECT * FROM calls WHERE id = ?", (call_id,)).fetchone())
        return call, candidate

    def record_verdict(self, candidate_id: int, row: VerdictRow) -> CandidateRecord:
        with self.transaction() as db:
            db.execute(
                "UPDATE candidates SET state = 'evaluated', accepted = ?, category = ?, reason = ?, speedup = ?,"
                " ci_low = ?, ci_high = ?, eager_us = ?, kernel_us = ?, compile_s = ?, verify_s = ?,"
                " bench_s = ?, binary_path = ?, feedback = ?, verdict = ?, evaluated = ? WHERE id = ?",
                (
                    int(row.accepted), row.category, row.reason, row.speedup, row.ci_low, row.ci_high,
                    row.eager_us, row.kernel_us, row.compile_s, row.verify_s, row.bench_s, row.binary_path,
                    row.feedback, _dumps(row.verdict), time.time(), candidate_id,
                ),
            )
            return self._get_candidate(db, candidate_id)

    # --- reads -----------------------------------------------------------------------------------

    def calls(self, card_id: str | None = None) -> list[CallRecord]:
        if card_id is None:
            rows = self.db.execute("SELECT * FROM calls ORDER BY id").fetchall()
        else:
            rows = self.db.execute("SELECT * FROM calls WHERE card_id = ? ORDER BY id", (card_id,)).fetchall()
        return [_call(r) for r in rows]

    def candidates(self, card_id: str | None = None, state: str | None = None) -> list[CandidateRecord]:
        query, args = "SELECT * FROM candidates", []
        clauses = []
        if card_id is not None:
            clauses.append("card_id = ?")
            args.append(card_id)
        if state is not None:
            clauses.append("state = ?")
            args.append(state)
        if clauses:
            query += " WHERE " + " AND ".join(clauses)
        return [_candidate(r) for r in self.db.execute(query + " ORDER BY id", args).fetchall()]

    def candidate(self, candidate_id: int) -> CandidateRecord:
        return self._get_candidate(self.db, candidate_id)

    def calls_spent(self, proposer: str | None = None) -> int:
        if proposer is None:
            return self.db.execute("SELECT COUNT(*) FROM calls").fetchone()[0]
        return self.db.execute("SELECT COUNT(*) FROM calls WHERE proposer = ?", (proposer,)).fetchone()[0]

    def spend(self) -> tuple[int, int, float]:
        """Input tokens, output tokens and dollars over all calls."""
        row = self.db.execute(
            "SELECT COALESCE(SUM(tokens_in),0), COALESCE(SUM(tokens_out),0), COALESCE(SUM(cost),0) FROM calls"
        ).fetchone()
        return int(row[0]), int(row[1]), float(row[2])

    def mean_cost(self, proposer: str) -> float | None:
        """Mean dollars of `proposer`'s calls (None before the first)."""
        return self.db.execute("SELECT AVG(cost) FROM calls WHERE proposer = ?", (proposer,)).fetchone()[0]

    @staticmethod
    def _get_candidate(db: sqlite3.Connection, candidate_id: int) -> CandidateRecord:
        row = db.execute("SELECT * FROM candidates WHERE id = ?", (candidate_id,)).fetchone()
        if row is None:
            raise KeyError(f"no candidate #{candidate_id} in the store")
        return _candidate(row)


def _dumps(value: Any) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True, default=str)


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _loads_or_none(text: str | None) -> Any:
    """A snapshot reader's JSON: unreadable text (a newer or damaged store) reads as absent."""
    try:
        return _loads(text)
    except ValueError:
        return None


def _known(cls: type, data: dict[str, Any]) -> Any:
    """`cls(**data)` keeping only its fields, so a store written by a newer forgepack still reads."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


def _call(row: sqlite3.Row, loads=_loads) -> CallRecord:
    data = dict(row)
    data["decision"] = loads(data.get("decision"))
    return _known(CallRecord, data)


def _candidate(row: sqlite3.Row, loads=_loads) -> CandidateRecord:
    data = dict(row)
    data["params"] = loads(data.get("params")) or {}
    data["verdict"] = loads(data.get("verdict"))
    if data.get("accepted") is not None:
        data["accepted"] = bool(data["accepted"])
    return _known(CandidateRecord, data)


# --- a read-only snapshot, for readers beside a running build -------------------------------------


def read_snapshot(path: str | Path) -> tuple[tuple[CallRecord, ...], tuple[CandidateRecord, ...]]:
    """The store's calls and candidates, read-only, in one read transaction (a snapshot of a running build).

    WAL lets this read alongside the build's writer. A store on a read-only filesystem, whose shared
    memory file cannot be created, is opened as immutable instead. A store without the tables (not yet
    written) reads as empty.
    """
    uri = Path(path).resolve().as_uri()
    try:
        db = sqlite3.connect(f"{uri}?mode=ro", uri=True, timeout=10.0, isolation_level=None)
        db.execute("SELECT 1 FROM sqlite_master").fetchone()
    except sqlite3.OperationalError:
        db = sqlite3.connect(f"{uri}?immutable=1", uri=True, isolation_level=None)
    db.row_factory = sqlite3.Row
    try:
        db.execute("BEGIN")
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        calls = db.execute("SELECT * FROM calls ORDER BY id").fetchall() if "calls" in tables else []
        cands = db.execute("SELECT * FROM candidates ORDER BY id").fetchall() if "candidates" in tables else []
        db.execute("COMMIT")
    finally:
        db.close()
    return (tuple(_call(r, _loads_or_none) for r in calls), tuple(_candidate(r, _loads_or_none) for r in cands))
