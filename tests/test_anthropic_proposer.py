"""The Claude proposer against a local HTTP server that speaks the Messages API (through the real SDK)."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from forgepack.cards import Arg, Card, Profile, TensorMeta
from forgepack.errors import ForgepackError, UsageError
from forgepack.search import prices
from forgepack.search.proposers import Parent, make
from forgepack.search.proposers import prompt as prompt_mod
from forgepack.search.proposers.anthropic import ABI_HEADER, AnthropicProposer, extract_source
from forgepack.search.tree import LineageEntry

KERNEL = """#include "forgepack_abi.h"
FP_EXPORT int32_t forgepack_kernel(const fp_call* call) { return 0; }
"""


def message(text: str, stop: str = "end_turn", tokens=(1200, 300)) -> dict:
    return {
        "id": "msg_test", "type": "message", "role": "assistant", "model": "claude-sonnet-4-6",
        "content": [{"type": "text", "text": text}], "stop_reason": stop, "stop_sequence": None,
        "usage": {"input_tokens": tokens[0], "output_tokens": tokens[1]},
    }


def error(status: int, kind: str, headers: dict | None = None) -> tuple:
    return (status, {"type": "error", "error": {"type": kind, "message": f"{kind} from the test server"}},
            headers or {}, 0.0)


def ok(text: str, delay: float = 0.0, **kw) -> tuple:
    return (200, message(text, **kw), {}, delay)


class MessagesServer:
    """Replies to POST /v1/messages from a script of (status, body, headers, delay) tuples, or of functions
    of the request body giving one; records every request."""

    def __init__(self):
        self.script: list[tuple] = []
        self.requests: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("content-length", 0))
                body = json.loads(self.rfile.read(length))
                headers = {k.lower(): v for k, v in self.headers.items()}
                server.requests.append({"path": self.path, "headers": headers, "body": body})
                step = server.script.pop(0)
                status, reply, headers, delay = step(body) if callable(step) else step
                time.sleep(delay)
                data = json.dumps(reply).encode()
                try:
                    self.send_response(status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
                    pass

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = MessagesServer()
    yield s
    s.close()


@pytest.fixture
def card() -> Card:
    x = TensorMeta("bfloat16", (4, 512, 2048), (1048576, 2048, 1))
    return Card(
        op="aten._softmax.default",
        schema="aten::_softmax(Tensor self, int dim, bool half_to_float) -> Tensor",
        args=(
            Arg("self", "tensor", tensor=x), Arg("dim", "value", value=-1),
            Arg("half_to_float", "value", value=False),
        ),
        outputs=(x,), calls=16, modules=("model.layers.*.self_attn",),
        profile=Profile(eager_us=41.5, share=0.12, roofline_us=9.8, headroom=4.2, baseline="native",
                        bytes=16777216, kernels=("softmax_warp_forward",)),
    )


def proposer(server, monkeypatch, **kw) -> tuple[AnthropicProposer, list[float]]:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test")
    slept: list[float] = []
    options = dict(target="cuda", base_url=server.url, facts={"name": "H200", "arch": "sm_90"},
                   sleep=slept.append, backoff_s=0.01, timeout_s=5.0)
    options.update(kw)
    return make("anthropic", **options), slept


def test_good_reply_gives_the_source_tokens_and_cost(server, monkeypatch, card):
    server.script = [ok(f"Here it is.\n```cuda\n{KERNEL}```\nIt uses one warp per row.", tokens=(1200, 300))]
    p, slept = proposer(server, monkeypatch)
    parent = Parent(candidate_id=7, source="// the parent kernel\n", params={"model": "x"}, proposer="anthropic:x",
                    speedup=1.3, kernel_us=31.9)
    lineage = [LineageEntry(7, "anthropic:x", {}, None, True, 1.3, 31.9, 41.5, "accepted: 1.300x")]
    feedback = ["candidate #9: compile: error: identifier \"__shfl\" is undefined"]
    out = p.propose(card, parent, lineage, feedback)
    assert out.source == KERNEL and out.feedback is None
    assert out.tokens == (1200, 300)
    assert out.cost == pytest.approx(prices.cost("claude-sonnet-4-6", 1200, 300))
    assert out.meta["attempts"] == 1 and slept == []
    assert out.label == "anthropic:claude-sonnet-4-6" and out.model == "claude-sonnet-4-6"
    [req] = server.requests
    assert req["path"] == "/v1/messages"
    # the key travels as x-api-key or as a bearer token, depending on the SDK version
    assert "sk-test" in (req["headers"].get("x-api-key", ""), req["headers"].get("authorization", "")[7:])
    body = req["body"]
    assert body["model"] == "claude-sonnet-4-6" and body["max_tokens"] == 8192
    prompt = body["messages"][0]["content"]
    for needle in ("aten._softmax.default", "aten::_softmax(Tensor self", "bfloat16", "[4, 512, 2048]",
                   "[1048576, 2048, 1]", "41.50 us", "9.80 us", "native", "softmax_warp_forward", "H200",
                   "sm_90", "the parent kernel", "__shfl", "#7", "1.300x", "half_to_float=False"):
        assert needle in prompt, needle
    # the static block (rules, ABI header, its documentation) is the system prompt, first and cached;
    # the call's own text leaves it out
    [static] = body["system"]
    assert static["cache_control"] == {"type": "ephemeral"} and static["text"] == prompt_mod.static_prompt("cuda")
    assert ABI_HEADER.read_text().strip() in static["text"] and "forgepack_kernel" in static["text"]
    assert "call->stream" in static["text"] and ABI_HEADER.read_text().strip() not in prompt


def test_the_static_block_is_the_same_for_every_call_so_the_cache_serves_it(server, monkeypatch, card):
    """Two calls for different variants and parents send a byte-identical system block, marked for the
    prompt cache; a reply that read it from the cache is billed at the cache-read price."""
    usage = {"input_tokens": 900, "output_tokens": 300, "cache_read_input_tokens": 5000,
             "cache_creation_input_tokens": 0}
    cached = message(f"```cuda\n{KERNEL}```")
    cached["usage"] = usage
    server.script = [ok(f"```cuda\n{KERNEL}```"), (200, cached, {}, 0.0)]
    p, _ = proposer(server, monkeypatch)
    other = dataclasses.replace(card, outputs=(TensorMeta("bfloat16", (2, 512, 2048), (1048576, 2048, 1)),))
    p.propose(card, None, [], [])
    out = p.propose(other, Parent(1, "// parent\n", {}, "anthropic:x", 1.1), [], ["candidate #2: compile: x"])
    first, second = (r["body"] for r in server.requests)
    assert first["system"] == second["system"] and first["messages"] != second["messages"]
    assert out.tokens == (5900, 300) and out.meta["cache_read_tokens"] == 5000
    assert out.cost == pytest.approx(prices.cost("claude-sonnet-4-6", 900, 300, cache_read=5000))
    assert out.cost < prices.cost("claude-sonnet-4-6", 5900, 300)


def test_the_worst_case_of_a_call_bounds_what_it_is_billed(server, monkeypatch, card):
    """The bound checked against --max-cost before a call: every prompt byte a token written to the
    cache, and the whole output allowance; the real bill of the same call, at its most, stays under it."""
    p, _ = proposer(server, monkeypatch, max_tokens=1000)
    request = p.request(card, None, [], [])
    worst = p.worst_case_cost(request)
    prompt_bytes = sum(len(b["text"].encode()) for b in request["system"]) + len(
        request["messages"][0]["content"].encode())
    assert worst >= prices.cost("claude-sonnet-4-6", 0, 1000, cache_write=prompt_bytes)
    assert worst < 2 * prices.cost("claude-sonnet-4-6", 0, 1000, cache_write=prompt_bytes + 1000)


def test_malformed_reply_is_a_counted_call_with_feedback(server, monkeypatch, card):
    server.script = [ok("I would use shared memory here.", tokens=(900, 40))]
    p, _ = proposer(server, monkeypatch)
    out = p.propose(card, None, [], [])
    assert out.source is None and "no fenced code block" in out.feedback
    assert out.cost == pytest.approx(prices.cost("claude-sonnet-4-6", 900, 40))
    assert out.cost > 0


def test_rate_limit_and_overload_are_retried_with_backoff(server, monkeypatch, card):
    server.script = [
        error(429, "rate_limit_error", {"retry-after": "3"}),
        error(529, "overloaded_error"),
        error(503, "api_error"),
        ok(f"```cpp\n{KERNEL}```"),
    ]
    p, slept = proposer(server, monkeypatch)
    out = p.propose(card, None, [], [])
    assert out.source == KERNEL and out.meta["attempts"] == 4
    assert len(server.requests) == 4
    assert slept[0] == 3.0  # the server's retry-after is honoured
    assert 0 < slept[1] < slept[2] <= 0.04  # then exponential backoff (jittered)


def test_timeouts_are_retried(server, monkeypatch, card):
    server.script = [ok("late", delay=1.5), ok(f"```cuda\n{KERNEL}```")]
    p, slept = proposer(server, monkeypatch, timeout_s=0.5)
    out = p.propose(card, None, [], [])
    assert out.source == KERNEL and out.meta["attempts"] == 2 and len(slept) == 1


def test_gives_up_with_a_clear_error(server, monkeypatch, card):
    server.script = [error(529, "overloaded_error") for _ in range(3)]
    p, slept = proposer(server, monkeypatch, max_attempts=3)
    with pytest.raises(ForgepackError, match=r"gave up after 3 attempts .*529.*resume"):
        p.propose(card, None, [], [])
    assert len(slept) == 2


def test_bad_key_and_bad_request_are_not_retried(server, monkeypatch, card):
    server.script = [error(401, "authentication_error"), error(400, "invalid_request_error")]
    p, slept = proposer(server, monkeypatch)
    with pytest.raises(ForgepackError, match="refused the key"):
        p.propose(card, None, [], [])
    with pytest.raises(ForgepackError, match="400: invalid_request_error from the test server"):
        p.propose(card, None, [], [])
    assert slept == [] and len(server.requests) == 2


def test_missing_key_says_how_to_set_it(monkeypatch):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    with pytest.raises(ForgepackError, match=r"export ANTHROPIC_API_KEY=\.\.\.") as err:
        AnthropicProposer(target="cpu")
    assert "\n" not in str(err.value)


def test_unpriced_model_is_refused_before_any_call(monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test")
    with pytest.raises(UsageError, match="no price for model 'claude-unknown-9'"):
        AnthropicProposer(target="cpu", model="claude-unknown-9")
    assert prices.price("claude-opus-4-5-20251101") == prices.PRICES_PER_MTOK["claude-opus-4-5"]
    assert prices.price("claude-opus-4-20250514") == prices.PRICES_PER_MTOK["claude-opus-4"]


def test_base_url_from_the_environment_and_model_option(server, monkeypatch, card):
    monkeypatch.setenv("ANTHROPIC_BASE_URL", server.url)
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-env")
    server.script = [ok(f"```cuda\n{KERNEL}```")]
    p = AnthropicProposer(target="cpu", model="claude-haiku-4-5", sleep=lambda s: None)
    out = p.propose(card, None, [], [])
    assert out.source == KERNEL and server.requests[0]["body"]["model"] == "claude-haiku-4-5"
    assert "```cpp" in server.requests[0]["body"]["system"][0]["text"]  # the cpu target asks for C++
    assert out.cost == pytest.approx(prices.cost("claude-haiku-4-5", 1200, 300))


def test_extract_source_picks_the_block_with_the_entry_point():
    reply = f"Before:\n```text\nnotes\n```\n```cuda\n{KERNEL}```\n```bash\nnvcc x.cu\n```"
    assert extract_source(reply) == (KERNEL, None)
    src, problem = extract_source("```cuda\n__global__ void k() {}\n```")
    assert src is None and "does not define `forgepack_kernel`" in problem
    src, problem = extract_source("```cuda\nFP_EXPORT int32_t forgepack_kernel(", stop_reason="max_tokens")
    assert src is None and "token limit" in problem


def test_a_local_model_behind_the_base_url_is_priced_by_the_override(server, monkeypatch, card):
    """Ollama, llama.cpp and LiteLLM serve the Messages API too: a model the table does not know runs once
    it is priced (0,0: free, so not `paid`), and the override prices a known model as well."""
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-local")
    monkeypatch.delenv(prices.PRICE_ENV, raising=False)
    server.script = [ok(f"```cuda\n{KERNEL}```", tokens=(5000, 1000)), ok(f"```cuda\n{KERNEL}```")]
    p = AnthropicProposer(target="cuda", model="qwen2.5-coder:32b", base_url=server.url, price=(0.0, 0.0))
    out = p.propose(card, None, [], [])
    assert out.source == KERNEL and out.cost == 0.0 and not p.paid and p.adaptive
    monkeypatch.setenv(prices.PRICE_ENV, "1,2")
    q = AnthropicProposer(target="cuda", model="claude-sonnet-4-6", base_url=server.url)
    assert q.paid and q.propose(card, None, [], []).cost == pytest.approx((1200 * 1 + 300 * 2) / 1e6)
