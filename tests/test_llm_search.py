"""The LLM search loop on the cpu, against local stub servers for both APIs (no network, no key).

- Calls run in parallel (`concurrency`), several on one card (best-of-k), and replies that arrive in any
  order give the same calls, candidates and verdicts; a build recorded in its cassette replays offline
  to the same calls, candidates and verdicts (`FORGEPACK_LLM_REPLAY`), through the search and the CLI.
- A stub that bakes one family member's sizes into its kernel is rejected by the family verifier, and
  the next prompt names the member that failed.
- Prompts carry the search's context: evaluated siblings, the card's best kernel, accepted kernels of
  similar cards.

Verdicts come from the real evaluator. Where two runs must meet the same verdicts (timings on a loaded
two-core machine differ between runs), each distinct kernel is evaluated for real once and its verdict
given again after (`Measured`, the `Executor` seam every executor implements).
"""

# ruff: noqa: F811  (the fixtures `profiled` and `card` are shared from the build and anthropic tests)

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import threading
import time
from concurrent.futures import Future

import pytest
from test_anthropic_proposer import MessagesServer, message
from test_build import BROKEN, cli, favour, fresh_workspace, known_kernels, profiled, store_rows  # noqa: F401
from test_families import _captured, _tiny_llama

from forgepack import families
from forgepack.cards import Profile
from forgepack.search import cassette, prices, run
from forgepack.search.executor import LocalExecutor
from forgepack.search.proposers import make
from forgepack.search.proposers import prompt as prompt_mod
from forgepack.search.store import Store
from forgepack.workspace import Workspace

_VARIANT = re.compile(r"^Variant: (\S+)$", re.M)
_PARENT = re.compile(r"The kernel to improve, candidate #(\d+)")
_ATTEMPT = re.compile(r"This is attempt (\d+) from this starting point")


MUL_4096 = ('#include "forgepack_abi.h"\n'
            "FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {\n"
            "  const float* a = (const float*)call->inputs[0].data;\n"
            "  const float* b = (const float*)call->inputs[1].data;\n"
            "  float* y = (float*)call->outputs[0].data;\n"
            "  for (int i = 0; i < 4096; ++i) y[i] = a[i] * b[i];\n"
            "  return 0;\n}\n")


def completion(text: str, tokens=(3000, 600)) -> dict:
    return {"id": "chatcmpl-test", "object": "chat.completion", "model": "local-coder",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": tokens[0], "completion_tokens": tokens[1], "total_tokens": sum(tokens)}}


def user_text(body: dict) -> str:
    return body["messages"][-1]["content"]


class Model:
    """A stub LLM: its reply is a function of the request alone (the variant, the parent, the attempt
    from that parent), so the same calls get the same replies in any order; each comes after a delay
    drawn from `seed` and the request, so replies to parallel calls arrive in another order per seed."""

    def __init__(self, kernels: dict[str, str], api: str = "openai", seed: int = 0, delay_s: float = 0.3,
                 default: str = BROKEN):
        self.kernels, self.api, self.seed, self.delay_s, self.default = kernels, api, seed, delay_s, default
        self.spans: list[tuple[float, float]] = []
        self.prompts: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, body: dict) -> tuple:
        prompt = user_text(body)
        card_id = _VARIANT.search(prompt).group(1)
        parent = _PARENT.search(prompt)
        attempt = _ATTEMPT.search(prompt)
        tag = f"{card_id} from {parent.group(1) if parent else 'scratch'} attempt {attempt.group(1) if attempt else 1}"
        digest = hashlib.sha256(f"{self.seed} {tag}".encode()).digest()
        delay = self.delay_s * random.Random(digest).random()
        with self.lock:
            now = time.monotonic()
            self.spans.append((now, now + delay))
            self.prompts.append(prompt)
        text = f"Here:\n```cpp\n// {tag}\n{self.kernels.get(card_id, self.default)}```"
        reply = completion(text) if self.api == "openai" else message(text, tokens=(3000, 600))
        return (200, reply, {}, delay)

    def most_in_flight(self) -> int:
        return max(sum(1 for a, b in self.spans if a <= t < b) for t, _ in self.spans)


def serve(model: Model, calls: int = 200) -> MessagesServer:
    server = MessagesServer()
    server.script = [model] * calls
    return server


def llm(api: str, url: str, monkeypatch) -> object:
    monkeypatch.delenv(prices.PRICE_ENV, raising=False)
    options = dict(target="cpu", model="local-coder", price=(0.0, 0.0), sleep=lambda s: None, backoff_s=0.01,
                   timeout_s=30.0)
    if api == "openai":
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        return make("openai", base_url=f"{url}/v1", **options)
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test")
    return make("anthropic", base_url=url, **options)


class Measured:
    """`inner`'s verdicts, each distinct (card, source) evaluated for real once, then given again. A kernel
    the evaluator verified is timed as 1.5x [1.4, 1.6] (`steady`): which card the allocator refines then
    depends on the replies alone, not on how loaded the machine was when the kernel was timed."""

    def __init__(self, inner, verdicts: dict):
        self.inner, self.verdicts = inner, verdicts
        self.slots = inner.slots
        self.evaluated = 0

    def submit(self, card, source, samples_path=None) -> Future:
        key = (card.id, source)
        if key in self.verdicts:
            done: Future = Future()
            done.set_result(self.verdicts[key])
            return done
        out: Future = Future()
        self.evaluated += 1

        def keep(future: Future) -> None:
            if future.exception() is not None:
                out.set_exception(future.exception())
            else:
                self.verdicts[key] = steady(future.result())
                out.set_result(self.verdicts[key])

        self.inner.submit(card, source, samples_path).add_done_callback(keep)
        return out

    def summary(self) -> str:
        return self.inner.summary()

    def close(self) -> None:
        pass


def steady(verdict):
    """A verified kernel's verdict with a fixed timing (accepted at 1.5x); any other verdict as it is."""
    if verdict.category not in (None, "slower") or not verdict.eager_us:
        return verdict
    return dataclasses.replace(verdict, accepted=True, category=None, reason="verified; 1.500x (timing fixed)",
                               kernel_us=verdict.eager_us / 1.5, speedup=1.5, ci_low=1.4, ci_high=1.6)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FORGEPACK_CACHE", str(tmp_path_factory.mktemp("cache")))
        with LocalExecutor("cpu", devices=[0], compile_workers=1) as executor:
            yield executor


def outcome(ws: Workspace) -> tuple[list, list]:
    """(calls: card, parent, outcome; candidates: card, parent, source hash, verdict category, accepted)."""
    calls, cands = store_rows(ws)
    return ([(c["card_id"], c["parent_id"], c["outcome"], c["candidate_id"]) for c in calls],
            [(c["card_id"], c["parent_id"], c["source_hash"], c["category"], c["accepted"]) for c in cands])


def pin(ws: Workspace) -> dict[str, str]:
    """The known kernels' cards get most of the measured time (cpu timings of tiny ops are noisy), the
    first of them most of all: a round of calls puts its two samples there."""
    kernels = known_kernels(ws)
    favour(ws, kernels)
    first = min(kernels)
    card = next(c for c in ws.load_cards() if c.id == first)
    ws.save_card(card.with_profile(dataclasses.replace(card.profile, share=0.6)))
    return kernels


def search(ws: Workspace, proposer, executor, **settings) -> run.SearchResult:
    found = run.Search(ws, ws.load_cards(), proposer, executor, run.Settings(target="cpu", **settings))
    try:
        return found.run()
    finally:
        found.store.close()


# --- parallel calls, best-of-k, record and replay ---------------------------------------------------


def test_parallel_calls_in_any_order_and_their_replay_give_the_same_search(profiled, local, tmp_path, monkeypatch):
    """Three calls in flight, two on one card: two live runs whose replies arrive in different orders,
    and an offline replay of the first's cassette, make the same calls, candidates and verdicts."""
    settings = dict(budget=9, concurrency=3, samples=2)
    verdicts: dict = {}
    runs, models = [], []
    for seed in (1, 2):
        ws = fresh_workspace(profiled, tmp_path / f"live{seed}")
        model = Model(pin(ws), seed=seed)
        server = serve(model)
        try:
            search(ws, llm("openai", server.url, monkeypatch), Measured(local, verdicts), **settings)
        finally:
            server.close()
        runs.append(outcome(ws))
        models.append(model)
    assert all(m.most_in_flight() >= 2 for m in models), "the calls never overlapped"
    live = fresh_workspace(profiled, tmp_path / "replay")
    pin(live)
    monkeypatch.setenv(cassette.REPLAY_ENV, str(tmp_path / "live1"))
    result = search(live, llm("openai", "http://127.0.0.1:9", monkeypatch), Measured(local, verdicts), **settings)
    runs.append(outcome(live))
    (calls, cands), *others = runs
    assert len(calls) == 9 and result.calls == 9
    assert any(c[3] in (None, "slower") for c in cands), "no kernel verified: nothing to refine"
    for other in others:
        assert other == (calls, cands)
    # best-of-k: a card had two calls from the same starting point; later calls refined working kernels
    starts = [(card, parent) for card, parent, _, _ in calls]
    assert any(starts.count(s) >= 2 for s in starts)
    working = {(c[0], i + 1) for i, c in enumerate(cands) if c[3] in (None, "slower")}
    assert any(parent is not None for _, parent in starts)
    assert all((card, parent) in working for card, parent in starts if parent is not None)
    # the exchanges: one per call, in call order, the static block stored once for all of them
    recorded = cassette.Cassette.of_workspace(tmp_path / "live1").exchanges()
    assert [(e.card_id, e.occurrence) for e in recorded] == [
        (card, starts[:i].count((card, parent))) for i, (card, parent, _, _) in enumerate(calls)]
    static = prompt_mod.static_prompt("cpu")
    assert all(e.request["messages"][0]["content"] == static for e in recorded)
    blob = tmp_path / "live1" / cassette.DIRNAME / cassette.BLOBS / f"{hashlib.sha256(static.encode()).hexdigest()}.txt"
    assert blob.read_text() == static  # stored once, not in each of the nine lines
    assert (tmp_path / "live1" / cassette.DIRNAME / cassette.EXCHANGES).stat().st_size < 2 * len(static)
    assert "authorization" not in json.dumps(recorded[0].request)
    # the replay recorded its own cassette, asked nothing of the network, and was told so
    assert len(cassette.Cassette.of_workspace(live.root).exchanges()) == 9


def test_a_replay_that_leaves_the_recorded_path_stops_with_where(profiled, local, tmp_path, monkeypatch):
    ws = fresh_workspace(profiled, tmp_path / "rec")
    server = serve(Model({}, delay_s=0.0))
    try:
        search(ws, llm("openai", server.url, monkeypatch), local, budget=2)
    finally:
        server.close()
    again = fresh_workspace(profiled, tmp_path / "more")
    monkeypatch.setenv(cassette.REPLAY_ENV, str(ws.root))
    with pytest.raises(Exception, match=r"the recording has no call \d+ to \S+ .*left the recorded path"):
        search(again, llm("openai", "http://127.0.0.1:9", monkeypatch), local, budget=3)
    calls, _ = store_rows(again)
    assert len(calls) == 2  # the two recorded calls replayed, then it stopped


def test_a_recorded_build_replays_offline_through_the_cli(profiled, tmp_path):
    """`forgepack build` records its exchanges; FORGEPACK_LLM_REPLAY=<that workspace> builds the same
    search again with no server and no key, priced as this command says (--explain shows gain per $)."""
    recorded = fresh_workspace(profiled, tmp_path / "recorded")
    server = serve(Model({}, delay_s=0.2))
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENAI_API_KEY", "OPENAI_BASE_URL", prices.PRICE_ENV, cassette.REPLAY_ENV)}
    args = ["build", "tiny-llama", "--target", "cpu", "--proposer", "openai", "--llm-model", "local-coder",
            "--budget", "6", "--llm-concurrency", "3", "--no-gate", "--out", str(tmp_path / "packs")]
    try:
        first = cli([*args, "--llm-base-url", f"{server.url}/v1", "--llm-price", "0,0",
                     "--workspace", str(recorded.root)], cwd=tmp_path, env=env)
    finally:
        server.close()
    assert first.returncode == 0, first.stderr[-3000:]
    replayed = fresh_workspace(profiled, tmp_path / "replayed")
    second = cli([*args, "--llm-price", "1,2", "--explain", "--workspace", str(replayed.root)], cwd=tmp_path,
                 env={**env, cassette.REPLAY_ENV: str(recorded.root)})
    assert second.returncode == 0, second.stderr[-3000:]
    text = second.stdout + second.stderr
    assert "replaying the LLM's replies" in text and "est. gain/$" in text
    assert outcome(replayed) == outcome(recorded)
    calls, cands = store_rows(replayed)
    assert len(calls) == 6 and all(c["category"] == "compile" for c in cands)
    assert all(c["cost"] == pytest.approx((3000 * 1 + 600 * 2) / 1e6) for c in calls)


# --- the family verifier's verdict reaches the next prompt, both APIs ------------------------------


@pytest.fixture(scope="module")
def silu_family() -> object:
    card = next(c for c in families.fold(_captured(_tiny_llama())) if c.family is not None
                and c.op == "aten.silu.default")
    return card.with_profile(Profile(eager_us=5.0, total_us=50.0, share=0.5, bytes=4096, roofline_us=0.5,
                                     headroom=10.0, baseline="native"))


def baked(card) -> str:
    """A SiLU correct at the representative member alone: its element count is a constant."""
    numel = 1
    for n in card.tensor_inputs()[0].shape:
        numel *= n
    return ('#include "forgepack_abi.h"\n#include <math.h>\n'
            "FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {\n"
            "  const float* x = (const float*)call->inputs[0].data;\n"
            "  float* y = (float*)call->outputs[0].data;\n"
            f"  for (long i = 0; i < {numel}L; ++i) y[i] = x[i] / (1.0f + expf(-x[i]));\n"
            "  return 0;\n}\n")


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_a_kernel_baking_one_members_sizes_fails_and_the_next_prompt_names_where(api, silu_family, local, tmp_path,
                                                                                monkeypatch):
    ws = Workspace(tmp_path / "ws")
    ws.save_card(silu_family)
    model = Model({silu_family.id: baked(silu_family)}, api=api, delay_s=0.0)
    server = serve(model)
    try:
        search(ws, llm(api, server.url, monkeypatch), local, budget=2)
    finally:
        server.close()
    with Store(ws.store_path) as store:
        first = store.candidates()[0]
    assert first.category in ("mismatch", "crash") and not first.accepted, first.reason
    failed_at = first.verdict["diagnostics"]["family"]["failed_at"]
    assert failed_at != families.bind(silu_family, silu_family.tensor_inputs())  # right where it was baked
    where = "at " + ", ".join(f"{n}={v}" for n, v in failed_at.items())
    assert first.reason.startswith(where)
    assert len(model.prompts) == 2
    assert "Shape family: " in model.prompts[0] and "read every size named by a dim" in model.prompts[0]
    assert f"- candidate #{first.id}: {first.category}: {where}" in model.prompts[1]


# --- what else the prompt shows ---------------------------------------------------------------------


def test_prompts_show_the_cards_other_kernels_its_best_and_similar_cards_kernels(profiled, tmp_path, monkeypatch):
    """Two mul variants: one has a known kernel (accepted), the other gets kernels that do not compile.
    The second's prompts show the first's accepted kernel (a similar card's); the first's later prompts
    show its other evaluated kernels (outside the parent's lineage), and its best kernel where the parent
    is not it. Each section lists only kernels that are what it says."""
    ws = fresh_workspace(profiled, tmp_path / "ws")
    kernels = known_kernels(ws)
    cards = ws.load_cards()
    known = next(c for c in cards if c.id in kernels and c.op == "aten.mul.Tensor")
    other = next(c for c in cards if c.op == "aten.mul.Tensor" and c.id not in kernels)
    assert known.signature() == "f32[1,32,128], f32[1,32,128]"  # contiguous: one plain loop is right
    kernels = {known.id: MUL_4096}
    known, other = (c.with_profile(dataclasses.replace(c.profile, share=share, roofline_us=c.profile.eager_us / 4))
                    for c, share in ((known, 0.3), (other, 0.2)))
    model = Model(kernels, delay_s=0.0)
    server = serve(model)
    try:
        with LocalExecutor("cpu", margin=-0.9, devices=[0], compile_workers=1) as executor:
            found = run.Search(ws, [known, other], llm("openai", server.url, monkeypatch), executor,
                               run.Settings(target="cpu", budget=8, margin=-0.9, concurrency=2, samples=2))
            found.run()
    finally:
        server.close()
    # a kernel refined from a parent that is not the card's best is shown the best, with its source
    tree = found.trees[known.id]
    best = tree.best()
    parent = next(n for n in tree.ranked() if n is not best)
    context = found._context(known, tree, parent)
    found.store.close()
    assert context.best.candidate_id == best.id and context.best.source.startswith(f"// {known.id} from")
    assert f"The best kernel for this variant so far, candidate #{best.id} (accepted" in prompt_mod.build_prompt(
        known, "cpu", None, [], [], context=context)
    assert parent.id not in [e.candidate_id for e in context.evaluated]
    _, cands = store_rows(ws)
    by_id = {c["id"]: c for c in cands}
    assert any(c["card_id"] == known.id and c["accepted"] for c in cands)
    sections: dict[str, list] = {"evaluated": [], "best": [], "similar": []}
    for prompt in model.prompts:
        card_id = _VARIANT.search(prompt).group(1)
        parent = _PARENT.search(prompt)
        parent_id = int(parent.group(1)) if parent else None
        lineage, walk = set(), parent_id
        while walk is not None:
            lineage.add(walk)
            walk = by_id[walk]["parent_id"]
        if "Other kernels already evaluated for this variant" in prompt:
            block = prompt.split("Other kernels already evaluated for this variant", 1)[1].split("\n\n")[0]
            rows = re.findall(r"^#(\d+) .*\[from (#\d+|scratch)\]$", block, re.M)
            assert rows and all(by_id[int(i)]["card_id"] == card_id and int(i) not in lineage for i, _ in rows)
            assert all(frm == (f"#{by_id[int(i)]['parent_id']}" if by_id[int(i)]["parent_id"] else "scratch")
                       for i, frm in rows)
            sections["evaluated"].append(card_id)
        if m := re.search(r"The best kernel for this variant so far, candidate #(\d+)", prompt):
            shown = by_id[int(m.group(1))]
            assert shown["card_id"] == card_id and shown["id"] != parent_id and shown["category"] in (None, "slower")
            sections["best"].append(card_id)
        for m in re.finditer(r"An accepted kernel of a similar variant \((\S+): .*?candidate #(\d+)", prompt):
            shown = by_id[int(m.group(2))]
            assert shown["card_id"] == m.group(1) != card_id and shown["accepted"]
            assert f"// {shown['card_id']} from" in prompt  # its source, as the model wrote it
            sections["similar"].append(card_id)
    assert known.id in sections["evaluated"] and other.id in sections["similar"], sections
