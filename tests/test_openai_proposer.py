"""The OpenAI-compatible proposer against a real local HTTP server speaking chat-completions.

The unit tests drive the proposer directly; the last one runs `forgepack build tiny-llama --proposer
openai` as a user would against a local "model" that answers with real kernels (`pack_kernels`) for the
variants it knows and one that does not compile for the others, so every verdict is the evaluator's.
"""

# ruff: noqa: F811  (the fixtures `card` and `profiled` are shared from the anthropic and build tests)

from __future__ import annotations

import fnmatch
import itertools
import os
import re
from importlib import resources
from pathlib import Path

import pytest
import tomllib
from test_anthropic_proposer import KERNEL, MessagesServer, card, error  # noqa: F401
from test_build import BROKEN, cli, fresh_workspace, known_kernels, profiled, store_rows  # noqa: F401

from forgepack.errors import ForgepackError, UsageError
from forgepack.evaluate import CATEGORIES
from forgepack.search import cassette, prices
from forgepack.search.proposers import Parent, make
from forgepack.search.proposers import prompt as prompt_mod
from forgepack.search.proposers.openai import OpenAIProposer

ROOT = Path(__file__).resolve().parents[1]


def completion(text: str, finish: str = "stop", tokens=(1500, 400), model: str = "local-coder") -> dict:
    return {
        "id": "chatcmpl-test", "object": "chat.completion", "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
        "usage": {"prompt_tokens": tokens[0], "completion_tokens": tokens[1], "total_tokens": sum(tokens)},
    }


def ok(text: str, **kw) -> tuple:
    return (200, completion(text, **kw), {}, 0.0)


@pytest.fixture
def server():
    s = MessagesServer()  # path-agnostic: it answers any POST from its script and records it
    yield s
    s.close()


def local(server, monkeypatch, **kw) -> tuple[OpenAIProposer, list[float]]:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv(prices.PRICE_ENV, raising=False)
    slept: list[float] = []
    options = dict(target="cuda", base_url=f"{server.url}/v1", model="local-coder", price=(0.0, 0.0),
                   facts={"name": "H100", "arch": "sm_90"}, sleep=slept.append, backoff_s=0.01, timeout_s=5.0)
    options.update(kw)
    return make("openai", **options), slept


def test_local_server_gets_the_full_prompt_and_no_key(server, monkeypatch, card):
    server.script = [ok(f"Here.\n```cuda\n{KERNEL}```\nOne warp per row.")]
    p, slept = local(server, monkeypatch)
    parent = Parent(candidate_id=3, source="// the parent kernel\n", params={}, proposer="openai:x", speedup=1.2)
    out = p.propose(card, parent, [], ["candidate #4: compile: error: expected ';'"])
    assert out.source == KERNEL and out.feedback is None
    assert out.tokens == (1500, 400) and out.cost == 0.0 and not p.paid and p.adaptive
    assert out.label == "openai:local-coder" and out.meta["attempts"] == 1 and slept == []
    [req] = server.requests
    assert req["path"] == "/v1/chat/completions"
    assert "authorization" not in req["headers"]  # a local server needs no key, and none is invented
    body = req["body"]
    assert body["model"] == "local-coder" and body["max_tokens"] == 8192
    system, user = body["messages"]
    assert system["role"] == "system" and "forgepack_kernel" in system["content"]
    # the same static block as every LLM proposer, first: the rules, the ABI header and its documentation
    assert system["content"] == prompt_mod.static_prompt("cuda")
    assert system["content"].startswith(prompt_mod.system_prompt("cuda"))
    for needle in ("aten._softmax.default", "[4, 512, 2048]", "41.50 us", "H100", "the parent kernel",
                   "expected ';'", "#3"):
        assert needle in user["content"], needle


def test_the_prompt_carries_the_abi_doc_from_the_installed_package(server, monkeypatch, card):
    shipped = resources.files("forgepack").joinpath("abi", "kernel-abi.md")
    text = shipped.read_text()
    assert "## The entry point" in text and "fp_call" in text
    server.script = [ok(f"```cuda\n{KERNEL}```")]
    p, _ = local(server, monkeypatch)
    p.propose(card, None, [], [])
    static = server.requests[0]["body"]["messages"][0]["content"]
    assert text in static and prompt_mod.abi_header() in static
    # and it is package data: the wheel's glob matches it, so an installed forgepack sends it too
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["forgepack"]
    assert any(fnmatch.fnmatch("abi/kernel-abi.md", g) for g in globs)


def test_a_key_is_sent_as_a_bearer_token_and_the_table_prices_a_known_model(server, monkeypatch, card):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-test")
    monkeypatch.delenv(prices.PRICE_ENV, raising=False)
    server.script = [ok(f"```cuda\n{KERNEL}```", tokens=(10_000, 2_000), model="gpt-5-2025-08-07")]
    p = OpenAIProposer(target="cuda", base_url=f"{server.url}/v1", model="gpt-5", sleep=lambda s: None)
    out = p.propose(card, None, [], [])
    assert server.requests[0]["headers"]["authorization"] == "Bearer sk-openai-test"
    assert p.paid and out.cost == pytest.approx((10_000 * 1.25 + 2_000 * 10.0) / 1e6)
    assert out.meta["model"] == "gpt-5-2025-08-07"


def test_openais_own_api_gets_max_completion_tokens_and_a_bound_on_its_cost(monkeypatch, card):
    """api.openai.com's reasoning models refuse `max_tokens`; every other server reads it. The worst case
    checked before a call counts every prompt byte a token and the whole output allowance."""
    monkeypatch.delenv(prices.PRICE_ENV, raising=False)
    p = OpenAIProposer(target="cuda", model="gpt-5", api_key="sk-test", max_tokens=1000)
    request = p.request(card, None, [], [])
    assert request["max_completion_tokens"] == 1000 and "max_tokens" not in request
    prompt_bytes = sum(len(m["content"].encode()) for m in request["messages"])
    assert p.worst_case_cost(request) >= prices.cost("gpt-5", prompt_bytes, 1000)
    local_request = OpenAIProposer(target="cuda", model="m", base_url="http://127.0.0.1:9/v1",
                                   price=(1.0, 1.0)).request(card, None, [], [])
    assert local_request["max_tokens"] == 8192 and "max_completion_tokens" not in local_request


def test_missing_key_for_a_remote_server_says_how_to_set_it(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with pytest.raises(ForgepackError, match=r"OPENAI_API_KEY is not set for https://api\.openai\.com/v1: "
                                             r"export OPENAI_API_KEY=\.\.\.") as err:
        OpenAIProposer(target="cpu")
    assert "\n" not in str(err.value)


def test_an_unknown_model_needs_a_price_and_the_environment_can_give_one(monkeypatch):
    monkeypatch.delenv(prices.PRICE_ENV, raising=False)
    with pytest.raises(UsageError, match=r"no price for model 'local-coder'.*--llm-price IN,OUT"):
        OpenAIProposer(target="cpu", base_url="http://127.0.0.1:9/v1", model="local-coder")
    monkeypatch.setenv(prices.PRICE_ENV, "0.5,1.5")
    p = OpenAIProposer(target="cpu", base_url="http://127.0.0.1:9/v1", model="local-coder")
    assert p.price == (0.5, 1.5) and p.paid
    with pytest.raises(UsageError, match="IN,OUT"):
        prices.parse_price("free")
    with pytest.raises(UsageError, match="negative"):
        prices.parse_price("-1,0")


def test_rate_limits_and_server_errors_are_retried(server, monkeypatch, card):
    server.script = [error(429, "rate_limit_exceeded", {"retry-after": "2"}), error(502, "bad_gateway"),
                     ok(f"```cpp\n{KERNEL}```")]
    p, slept = local(server, monkeypatch, target="cpu")
    out = p.propose(card, None, [], [])
    assert out.source == KERNEL and out.meta["attempts"] == 3 and len(server.requests) == 3
    assert slept[0] == 2.0 and 0 < slept[1] <= 0.02
    assert "```cpp" in server.requests[0]["body"]["messages"][0]["content"]


def test_bad_requests_and_refused_keys_are_not_retried(server, monkeypatch, card):
    server.script = [error(400, "invalid_request_error"), error(401, "invalid_api_key")]
    p, slept = local(server, monkeypatch)
    with pytest.raises(ForgepackError, match="400: invalid_request_error from the test server"):
        p.propose(card, None, [], [])
    with pytest.raises(ForgepackError, match="refused the key"):
        p.propose(card, None, [], [])
    assert slept == []


def test_gives_up_after_the_attempts_with_a_clear_error(server, monkeypatch, card):
    server.script = [error(503, "overloaded") for _ in range(2)]
    p, slept = local(server, monkeypatch, max_attempts=2)
    with pytest.raises(ForgepackError, match=r"gave up after 2 attempts \(503 .*resume"):
        p.propose(card, None, [], [])
    assert len(slept) == 1


def test_a_reply_cut_at_the_token_limit_is_feedback(server, monkeypatch, card):
    server.script = [ok("```cuda\nFP_EXPORT int32_t forgepack_kernel(", finish="length")]
    p, _ = local(server, monkeypatch)
    out = p.propose(card, None, [], [])
    assert out.source is None and "token limit" in out.feedback


# --- the whole command against a local server ---------------------------------------------------


def chat_llm(kernels: dict[str, str]):
    """A chat-completions reply: the known kernel of the prompt's variant, else one that fails to compile;
    each reply is distinct (a numbered comment) so every call makes a new candidate."""
    counter = itertools.count(1)

    def reply(body: dict) -> tuple:
        prompt = body["messages"][-1]["content"]
        card_id = re.search(r"^Variant: (\S+)$", prompt, re.M).group(1)
        source = f"// reply {next(counter)}\n{kernels.get(card_id, BROKEN)}"
        return ok(f"Here:\n```cpp\n{source}```", tokens=(3000, 600))

    return reply


def test_build_with_a_local_openai_compatible_server(profiled, tmp_path):
    ws = fresh_workspace(profiled, tmp_path / "ws")
    kernels = known_kernels(ws)
    server = MessagesServer()
    server.script = [chat_llm(kernels)] * 50
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "OPENAI_BASE_URL", prices.PRICE_ENV)}
    budget = 6
    # the gate off: this test is about the client and its verdicts; whether the one accepted kernel pays end
    # to end is the real clock's to say on a loaded runner (it once read 0.998x, and no wheel was written)
    try:
        result = cli(["build", "tiny-llama", "--target", "cpu", "--proposer", "openai",
                      "--llm-base-url", f"{server.url}/v1", "--llm-model", "local-coder", "--llm-price", "0,0",
                      "--budget", str(budget), "--workspace", str(ws.root), "--out", str(tmp_path / "packs"),
                      "--no-gate"],
                     cwd=tmp_path, env=env)
    finally:
        server.close()
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    calls, cands = store_rows(ws)
    assert len(calls) == budget == len(server.requests)
    for req in server.requests:
        assert req["path"] == "/v1/chat/completions" and req["body"]["model"] == "local-coder"
        assert "authorization" not in req["headers"]
        assert "Variant: " in req["body"]["messages"][-1]["content"]
    assert all(c["proposer"] == "openai" and c["model"] == "local-coder" for c in calls)
    assert all(c["tokens_in"] == 3000 and c["cost"] == 0 for c in calls)
    # a verdict per call: every call made a candidate and every candidate was evaluated
    by_call = {c["call_id"]: c for c in cands}
    assert sorted(by_call) == [c["id"] for c in calls]
    assert all(c["state"] == "evaluated" and c["category"] in CATEGORIES for c in cands)
    for c in cands:  # the verdicts are the evaluator's: the broken kernel fails to compile, a known one does not
        assert (c["category"] == "compile") == (c["card_id"] not in kernels), c
    # every exchange is saved with the build, in call order, without the key
    recorded = cassette.Cassette.of_workspace(ws.root).exchanges()
    assert [(e.card_id, e.proposer) for e in recorded] == [(c["card_id"], "openai") for c in calls]
    assert [e.request for e in recorded] == [r["body"] for r in server.requests]
    assert all(e.reply["choices"][0]["message"]["content"].startswith("Here:") for e in recorded)
