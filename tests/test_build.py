"""`forgepack build` on cpu, for real: profile, allocator, tree, proposers, compile, verify, bench, store.

The LLM path runs against a local Messages API server (`test_anthropic_proposer.MessagesServer`) that
answers with real kernels (the hand-written ones in `pack_kernels`) for the variants it knows, a kernel
that does not compile for the others, so every verdict comes from the real evaluator.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pack_kernels
import pytest
from test_anthropic_proposer import MessagesServer, ok

from forgepack import accepted as accepted_mod
from forgepack import pipeline
from forgepack import recipe as recipe_mod
from forgepack.evaluate import CATEGORIES, evaluate
from forgepack.search import run
from forgepack.search.executor import LocalExecutor
from forgepack.search.proposers import Proposal, make
from forgepack.search.store import Store
from forgepack.search.tree import Node, clearly_faster
from forgepack.workspace import Workspace

BROKEN = '#include "forgepack_abi.h"\nFP_EXPORT int32_t forgepack_kernel(const fp_call* call) { return oops; }\n'
MODEL = "claude-haiku-4-5"


@pytest.fixture(scope="session")
def profiled(tmp_path_factory) -> Path:
    """tiny-llama profiled on cpu once; tests copy the workspace."""
    root = tmp_path_factory.mktemp("profiled")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FORGEPACK_CACHE", str(root / "cache"))
        ws = Workspace(root / "ws")
        pipeline.profile(recipe_mod.resolve("tiny-llama"), ws)
    return ws.root


def fresh_workspace(profiled: Path, dest: Path) -> Workspace:
    shutil.copytree(profiled, dest)
    return Workspace(dest)


def known_kernels(ws: Workspace) -> dict[str, str]:
    """card id -> a correct hand-written kernel, for the variants `pack_kernels` covers."""
    by_sig = {(op, sig): src for op, sig, src in pack_kernels.KERNELS}
    return {c.id: by_sig[(c.op, c.signature())] for c in ws.load_cards() if (c.op, c.signature()) in by_sig}


def favour(ws: Workspace, card_ids) -> None:
    """Give `card_ids` most of the measured time (cpu timings of tiny ops are noisy; this pins the test)."""
    for card in ws.load_cards():
        share = 0.12 if card.id in card_ids else card.profile.share * 0.01
        ws.save_card(card.with_profile(dataclasses.replace(card.profile, share=share)))


def llm(kernels: dict[str, str]):
    """A Messages API reply for a prompt: the known kernel of its variant, else one that fails to compile."""

    def reply(body: dict) -> tuple:
        prompt = body["messages"][0]["content"]
        card_id = re.search(r"^Variant: (\S+)$", prompt, re.M).group(1)
        return ok(f"Here:\n```cpp\n{kernels.get(card_id, BROKEN)}```", tokens=(2000, 500))

    return reply


def cli(args: list[str], cwd: Path, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "forgepack", *args], cwd=cwd, env=env or dict(os.environ),
                          capture_output=True, text=True, timeout=600, **kw)


def store_rows(ws: Workspace) -> tuple[list[dict], list[dict]]:
    """(calls, candidates) read with a plain connection, as another process would."""
    if not ws.store_path.exists():
        return [], []
    db = sqlite3.connect(f"file:{ws.store_path}?mode=ro", uri=True, timeout=10)
    db.row_factory = sqlite3.Row
    try:
        calls = [dict(r) for r in db.execute("SELECT * FROM calls ORDER BY id")]
        cands = [dict(r) for r in db.execute("SELECT * FROM candidates ORDER BY id")]
    except sqlite3.OperationalError:  # tables not created yet
        return [], []
    finally:
        db.close()
    return calls, cands


# --- the whole command ---------------------------------------------------------------------------


def test_build_tiny_llama_with_templates(profiled, tmp_path):
    ws = fresh_workspace(profiled, tmp_path / "ws")
    result = cli(["build", "--budget", "5", "--target", "cpu", "--workspace", str(ws.root), "--explain",
                  "--no-gate"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    text = result.stdout + result.stderr
    assert "plan: 5 calls to spend" in text and "p(success)" in text
    assert "est. gain/call" in text  # --explain: why each call went where it did
    assert "search results" in text and "estimated end-to-end gain" in text
    with Store(ws.store_path) as store:
        calls, cands = store.calls(), store.candidates()
        assert len(calls) == 5 and all(c.proposer == "templates" and c.reason for c in calls)
        assert all(c.state == "evaluated" and c.category in (None, *CATEGORIES) for c in cands)
        assert all(c.proposer.startswith("templates:") for c in cands)
        assert all((ws.root / c.source_path).is_file() for c in cands)
    kept = accepted_mod.load_all(ws.root)
    by_card: dict = {}  # the best accepted candidate per card: the earliest unless a later one is clearly faster
    for c in sorted(cands, key=lambda c: c.id):
        node = Node(c.id, speedup=c.speedup, ci_low=c.ci_low, ci_high=c.ci_high)
        if c.accepted and (c.card_id not in by_card or clearly_faster(node, by_card[c.card_id])):
            by_card[c.card_id] = node
    assert {k.card_id: k.speedup for k in kept} == {card: n.speedup for card, n in by_card.items()}
    for k in kept:
        assert (ws.root / k.binary).is_file() and (ws.root / k.source).is_file() and k.target == "cpu"
    # the same command again: nothing left to spend, nothing evaluated again
    again = cli(["build", "--budget", "5", "--target", "cpu", "--workspace", str(ws.root), "--json",
                 "--no-gate"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    doc = json.loads(again.stdout)
    assert doc["new_calls"] == 0 and doc["evaluated"] == 0 and doc["calls"] == 5
    with Store(ws.store_path) as store:
        assert [c.evaluated for c in store.candidates()] == [c.evaluated for c in cands]


def test_kill_9_mid_build_then_resume(profiled, tmp_path):
    """SIGKILL the build while a paid proposal is still being evaluated; the same command continues."""
    ws = fresh_workspace(profiled, tmp_path / "ws")
    kernels = known_kernels(ws)
    favour(ws, kernels)  # correct kernels take long enough to verify and time that a kill lands mid-way
    server = MessagesServer()
    server.script = [llm(kernels)] * 500
    env = {**os.environ, "ANTHROPIC_API_KEY": "sk-test", "ANTHROPIC_BASE_URL": server.url}
    budget = 8
    args = ["build", "tiny-llama", "--target", "cpu", "--proposer", "anthropic", "--llm-model", MODEL,
            "--budget", str(budget), "--workspace", str(ws.root), "--no-gate"]
    try:
        killed_with_pending = None
        for _attempt in range(4):  # the kill must land while a candidate is pending; retry if it raced past
            proc = subprocess.Popen([sys.executable, "-m", "forgepack", *args], cwd=tmp_path, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            deadline = time.monotonic() + 300
            while True:
                calls, cands = store_rows(ws)
                states = [c["state"] for c in cands]
                new_eval = sum(1 for c in cands if c["state"] == "evaluated")
                if new_eval >= 1 and "pending" in states:
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    out = proc.stdout.read() if proc.stdout else ""
                    pytest.fail(f"the build ended before it could be killed: rc={proc.returncode}\n{out[-3000:]}")
                time.sleep(0.01)
            os.killpg(proc.pid, signal.SIGKILL)  # the build, its evaluation worker, everything it started
            proc.wait()
            proc.stdout.close()
            killed_at = time.time()
            calls, cands = store_rows(ws)
            if any(c["state"] == "pending" for c in cands):
                killed_with_pending = (killed_at, calls, cands, len(server.requests))
                break
        assert killed_with_pending, "could not kill the build while a candidate was pending"
        killed_at, calls_before, cands_before, requests_before = killed_with_pending
        assert len(calls_before) < budget

        result = cli(args, cwd=tmp_path, env=env)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        assert "resuming: " in result.stderr
        calls_after, cands_after = store_rows(ws)
    finally:
        server.close()

    # the budget counts every paid call exactly once, across the kill
    assert len(calls_after) == budget
    assert calls_after[: len(calls_before)] == calls_before
    new_calls = calls_after[len(calls_before):]
    assert len(server.requests) - requests_before == len(new_calls)  # every request after the kill is a new call
    after = {c["id"]: c for c in cands_after}
    for c in cands_before:
        if c["state"] == "evaluated":  # evaluated before the kill: never evaluated again
            assert after[c["id"]]["evaluated"] == c["evaluated"] and after[c["id"]]["verdict"] == c["verdict"]
        else:  # paid for, not evaluated: evaluated on resume, from the same call (not proposed again)
            assert after[c["id"]]["state"] == "evaluated" and after[c["id"]]["evaluated"] > killed_at
            assert after[c["id"]]["call_id"] == c["call_id"]
    evaluated_on_resume = [c for c in cands_after if c["evaluated"] > killed_at]
    pending_at_kill = sum(1 for c in cands_before if c["state"] == "pending")
    made_on_resume = sum(1 for c in new_calls if c["outcome"] == "new")
    assert len(evaluated_on_resume) == pending_at_kill + made_on_resume
    assert all(c["state"] == "evaluated" for c in cands_after)
    assert sum(c["tokens_in"] for c in calls_after) == 2000 * budget
    assert (ws.root / "accepted.json").is_file()


# --- the search loop in-process --------------------------------------------------------------------


class Counting:
    """A proposer that records what it was asked and answers from a list (for loop mechanics)."""

    name = "counting"
    paid = True
    adaptive = True  # it is told each verdict, as an LLM is: one call in flight per card

    def __init__(self, answers):
        self.answers, self.asked = list(answers), []

    def unsupported(self, card):
        return None

    def worst_case_cost(self, card, parent, lineage, feedback):
        return 0.5  # every call costs exactly this

    def propose(self, card, parent, lineage, feedback, tried=frozenset()):
        self.asked.append((card.id, parent, list(feedback)))
        source = self.answers.pop(0)
        return Proposal(source=source, params={"n": len(self.asked)}, tokens=(10, 5), cost=0.5,
                        feedback=None if source else "no code block", label="counting")


def _one_card(ws: Workspace, kernels: dict[str, str]):
    card_id = sorted(kernels)[0]
    return ws.load_card(card_id), kernels[card_id]


def test_pending_candidates_are_evaluated_on_resume_not_reproposed(profiled, tmp_path):
    ws = fresh_workspace(profiled, tmp_path / "ws")
    card, source = _one_card(ws, known_kernels(ws))
    # a previous run paid for a proposal and died before evaluating it
    path = ws.root / "kernels" / card.id / "k.cpp"
    path.parent.mkdir(parents=True)
    path.write_text(source)
    with Store(ws.store_path) as store:
        _, pending = store.record_call(card_id=card.id, parent_id=None, proposer="counting", reason="earlier run",
                                       source_hash=run.source_hash(source), source_path="kernels/" + card.id + "/k.cpp",
                                       params={"n": 0}, cost=0.5)
    proposer = Counting([])
    with LocalExecutor("cpu", compile_workers=1) as executor:
        result = run.Search(ws, [card], proposer, executor, run.Settings(budget=1, target="cpu")).run()
    assert proposer.asked == []  # the budget was already spent by the paid call
    assert result.new_calls == 0 and result.evaluated == 1 and result.calls == 1
    with Store(ws.store_path) as store:
        evaluated = store.candidate(pending.id)
    assert evaluated.state == "evaluated" and evaluated.category in (None, *CATEGORIES)
    assert evaluated.verdict["source_hash"] == run.source_hash(source)


def test_feedback_and_lineage_reach_the_next_proposal(profiled, tmp_path):
    ws = fresh_workspace(profiled, tmp_path / "ws")
    card, good = _one_card(ws, known_kernels(ws))
    proposer = Counting([None, BROKEN, good])
    settings = run.Settings(budget=3, target="cpu")
    with LocalExecutor("cpu", compile_workers=1) as executor:
        result = run.Search(ws, [card], proposer, executor, settings).run()
    assert [parent for _, parent, _ in proposer.asked] == [None, None, None]  # nothing worked yet: from scratch
    assert proposer.asked[1][2] == ["no code block"]
    third = proposer.asked[2][2]
    assert third[0].startswith("candidate #1: compile: does not compile") and "oops" in third[0]
    assert third[1] == "no code block"
    assert result.calls == 3 and result.cost == pytest.approx(1.5) and result.tokens == (30, 15)
    with Store(ws.store_path) as store:
        assert [c.outcome for c in store.calls()] == ["malformed", "new", "new"]
        assert store.candidates()[0].category == "compile"


def _stopping_search(profiled, tmp_path, settings, clock=None):
    """A one-card search whose proposer answers nothing usable (each call is spent at once, $0.50): for
    the stop conditions. `clock`: the search's clock, given the proposer. Returns (ws, card, result)."""
    ws = fresh_workspace(profiled, tmp_path / "ws")
    card, _ = _one_card(ws, known_kernels(ws))
    proposer = Counting([None] * 10)
    with LocalExecutor("cpu", compile_workers=1) as executor:
        search = run.Search(ws, [card], proposer, executor, settings)
        if clock is not None:
            search.clock = lambda: clock(proposer)
        return ws, card, search.run()


def test_max_cost_caps_spend(profiled, tmp_path):
    _, _, result = _stopping_search(profiled, tmp_path, run.Settings(budget=10, target="cpu", max_cost=1.2))
    # $0.50 per call: a third call would pass $1.20
    assert result.calls == 2 and result.cost == pytest.approx(1.0) and "cost cap" in result.stopped


def test_a_time_limit_starts_no_call_that_would_end_past_it_and_a_later_run_continues(profiled, tmp_path):
    settings = run.Settings(budget=10, target="cpu", deadline=25.0)
    ws, card, result = _stopping_search(profiled, tmp_path, settings, clock=lambda p: 10.0 * len(p.asked))
    # every call takes 10 s: after two it is t=20, and a third would end at 30, past the deadline of 25
    assert result.calls == 2 and result.stopped.startswith("time limit: 2 of 10 counting calls spent")
    with LocalExecutor("cpu", compile_workers=1) as executor:
        again = run.Search(ws, [card], Counting([None] * 10), executor, run.Settings(budget=4, target="cpu")).run()
    assert again.new_calls == 2 and again.calls == 4 and again.stopped.startswith("budget spent")


def test_build_time_limit_counts_the_profile_and_the_build_says_why_it_stopped(profiled, tmp_path):
    """`--time-limit` covers profile and search: here the time is gone before the first call."""
    ws = fresh_workspace(profiled, tmp_path / "ws")
    result = cli(["build", "--budget", "5", "--target", "cpu", "--workspace", str(ws.root), "--no-gate",
                  "--time-limit", "0.001"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    text = result.stdout + result.stderr
    assert "stopped: time limit: 0 of 5 templates calls spent" in text
    assert "no pack written" in text
    with Store(ws.store_path) as store:
        assert store.calls() == []


def test_templates_proposer_walks_defaults_then_neighbours(profiled):
    from forgepack.templates import on_device

    # cuda sources render without a GPU; cpu templates have one point each, cuda ones a space to walk
    proposer = make("templates", target="cuda")
    cards = [on_device(c, "cuda") for c in Workspace(profiled).load_cards()]
    served = [c for c in cards if proposer.unsupported(c) is None]
    assert served, "no tiny-llama variant has a cuda template"
    assert any(proposer.unsupported(c) for c in cards)  # mm has no template: vendor territory
    card = max(served, key=lambda c: (c.op == "aten.mul.Tensor", c.profile.share))
    first = proposer.propose(card, None, [], [])
    assert first.source and first.params["template"] and first.label.startswith("templates:")
    again = proposer.propose(card, None, [], [])
    assert again == first  # deterministic
    from forgepack.search.proposers import NothingToPropose, Parent
    from forgepack.search.tree import params_key

    roots = []
    tried = set()
    while True:
        try:
            p = proposer.propose(card, None, [], [], frozenset(tried))
        except NothingToPropose:
            break
        roots.append(p)
        tried.add(params_key(p.params))
    templates = list(dict.fromkeys(r.params["template"] for r in roots))
    assert [r.params["template"] for r in roots[: len(templates)]] == templates  # each template's default first
    assert len(roots) > len(templates)  # then the points next to them
    step = roots[len(templates)]  # one step from a default: its own neighbours go one step further
    parent = Parent(candidate_id=1, source=step.source, params=step.params, proposer=step.label)
    child = proposer.propose(card, parent, [], [], frozenset(tried))
    assert child.params["template"] == step.params["template"] and params_key(child.params) not in tried


def test_the_search_imports_no_llm_sdk_until_asked(tmp_path):
    code = ("import sys, forgepack.cli.build, forgepack.search.run, forgepack.search.proposers.templates; "
            "assert 'anthropic' not in sys.modules, 'anthropic imported eagerly'")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_executor_map_evaluates_in_order(profiled, tmp_path):
    ws = fresh_workspace(profiled, tmp_path / "ws")
    kernels = known_kernels(ws)
    jobs = [(ws.load_card(cid), src, ws.sample_path(cid)) for cid, src in sorted(kernels.items())[:2]]
    jobs.append((jobs[0][0], BROKEN, None))
    with LocalExecutor("cpu", compile_workers=2) as executor:
        verdicts = list(executor.map(jobs))
    assert [v.source_hash for v in verdicts] == [run.source_hash(src) for _, src, _ in jobs]
    assert verdicts[2].category == "compile" and all(v.category != "compile" for v in verdicts[:2])


# --- bad input -----------------------------------------------------------------------------------


def test_bad_input_is_one_line_and_nonzero(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "ANTHROPIC_API_KEY"}
    for args, needle in (
        (["build", "no-such-recipe-xyz"], "is not a recipe file"),
        (["build", "--budget", "-1"], "--budget must be 0 or more"),
        (["build", "--proposer", "anthropic"], "export ANTHROPIC_API_KEY=..."),
        (["build", "--proposer", "gpt"], "build.proposer"),
        (["build", "--time-limit", "0"], "'build.time_limit' must be a number of seconds above 0"),
    ):
        result = cli(args, cwd=tmp_path, env=env)
        assert result.returncode != 0, args
        assert needle in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr


@pytest.mark.gpu
def test_build_on_the_gpu(tmp_path):
    """The same command on cuda: templates rendered for the GPU, verified and timed on it. The margin
    admits any verified kernel (speed is the benchmarks' business), so an accepted kernel is required, and
    each one, run again by a fresh evaluator from its shipped source, still matches eager."""
    ws = tmp_path / "ws"
    result = cli(["build", "tiny-llama", "--target", "cuda", "--budget", "8", "--workspace", str(ws), "--json",
                  "--no-gate", "--margin", "-0.9"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(result.stdout)
    assert doc["calls"] == 8 and doc["evaluated"] >= 1
    with Store(Workspace(ws).store_path) as store:
        cands = store.candidates()
    assert cands and all(c.state == "evaluated" and c.source_path.endswith(".cu") for c in cands)
    kept = accepted_mod.load_all(ws)
    assert kept, [(c.card_id, c.category, c.reason) for c in cands]  # none verified: the CUDA path is broken
    workspace = Workspace(ws)
    for k in kept:
        assert k.target == "cuda" and k.arch and (ws / k.binary).is_file()
        source = (ws / k.source).read_text()
        again = evaluate(workspace.load_card(k.card_id), source, target="cuda",
                         samples_path=workspace.sample_path(k.card_id), bench=False)
        assert again.accepted and again.category is None, (k.card_id, again.reason)
        assert again.source_hash == k.source_hash
