"""The OpenAI-compatible proposer: one ``POST {base}/chat/completions`` per proposal, with urllib.

Any server that speaks the chat-completions API works: OpenAI itself, or a local model served by
Ollama, llama.cpp, vLLM or LiteLLM (``--llm-base-url http://127.0.0.1:PORT/v1``). The key comes from
``OPENAI_API_KEY``; a server on this host may not need one. The prompt and the reply parsing are the
ones every LLM proposer shares (`forgepack.search.proposers.prompt`); the static block is the system
message, first, so OpenAI's automatic prefix cache serves it (cached input tokens are recorded in the
proposal's meta and billed here at the full input price: the recorded cost never undercounts). Rate
limits, server errors and timeouts are retried with exponential backoff (honouring ``retry-after``). A
model the price table does not know is priced with ``--llm-price IN,OUT`` (``0,0`` for a local server:
free, not ``paid``). OpenAI's own API takes the output limit as ``max_completion_tokens`` (its reasoning
models refuse ``max_tokens``); other servers get ``max_tokens``, which they all read.

No SDK: the standard library's urllib is enough for one JSON POST, and nothing is installed for it.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from forgepack.cards import Card
from forgepack.errors import ForgepackError
from forgepack.search import cassette, prices
from forgepack.search.proposers import Context, Parent, Proposal
from forgepack.search.proposers.prompt import (
    RETRY_STATUSES,
    RequestReply,
    backoff,
    build_prompt,
    reply_proposal,
    static_prompt,
    worst_case_cost,
)

DEFAULT_MODEL = "gpt-5"
DEFAULT_BASE_URL = "https://api.openai.com/v1"
KEY_ENV = "OPENAI_API_KEY"
BASE_URL_ENV = "OPENAI_BASE_URL"
OPENAI_HOST = "api.openai.com"
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0"})
CLAUDE_DEFAULT = "claude-sonnet-4-6"  # the recipe's default llm_model, meant for the anthropic proposer


def base_url_of(base_url: str | None) -> str:
    return (base_url or os.environ.get(BASE_URL_ENV) or DEFAULT_BASE_URL).rstrip("/")


def is_local(base_url: str) -> bool:
    """A server on this host: it may serve without a key (Ollama, llama.cpp)."""
    return (urllib.parse.urlparse(base_url).hostname or "") in LOCAL_HOSTS


def model_of(model: str | None) -> str:
    # the recipe's default names a Claude model; an OpenAI-compatible server is asked for its own default
    return DEFAULT_MODEL if not model or model == CLAUDE_DEFAULT else model


class OpenAIProposer(RequestReply):
    name = "openai"
    adaptive = True  # each call waits for the previous verdict on its card: the feedback is the point

    def __init__(
        self,
        target: str = "cuda",
        model: str | None = None,
        facts: dict[str, Any] | None = None,
        arch: str | None = None,  # in `facts` already (the prompt's device line)
        api_key: str | None = None,
        base_url: str | None = None,
        price: tuple[float, float] | None = None,  # $ per million tokens (in, out); default: the table
        max_tokens: int = 8192,
        timeout_s: float = 300.0,
        max_attempts: int = 6,
        backoff_s: float = 2.0,
        max_backoff_s: float = 60.0,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.target = target
        self.model = model_of(model)
        self.facts = dict(facts or {})
        self.base_url = base_url_of(base_url)
        self.key = self.preflight(model=self.model, api_key=api_key, base_url=self.base_url, price=price)
        self.price = prices.price(self.model, price)
        self.paid = prices.is_paid(self.price)  # costs money: counts against --max-cost
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.sleep = sleep

    @classmethod
    def preflight(cls, model: str | None = None, api_key: str | None = None, base_url: str | None = None,
                  price: tuple[float, float] | None = None, **_options: Any) -> str | None:
        """The API key (None for a local server without one), once the model can be priced."""
        prices.price(model_of(model), price)  # refuse a model we cannot price before spending anything
        url = base_url_of(base_url)
        key = api_key or os.environ.get(KEY_ENV)
        if not key and not is_local(url) and cassette.replay_dir() is None:
            raise ForgepackError(
                f"{KEY_ENV} is not set for {url}: export {KEY_ENV}=... (a server on this host, "
                f"--llm-base-url http://127.0.0.1:PORT/v1, needs none; or use --proposer templates)"
            )
        return key or None

    @property
    def label(self) -> str:
        return f"openai:{self.model}"

    def unsupported(self, card: Card) -> str | None:
        return None  # an LLM can try any operator

    # --- one call, in three steps (the search runs `send` on its pool and records the exchange) ----

    def request(self, card: Card, parent: Parent | None, lineage: Sequence[Any], feedback: Sequence[str],
                context: Context | None = None) -> dict:
        """The chat-completions body: the static block first, as the system message."""
        limit = "max_completion_tokens" if urllib.parse.urlparse(self.base_url).hostname == OPENAI_HOST \
            else "max_tokens"
        return {
            "model": self.model,
            limit: self.max_tokens,
            "messages": [{"role": "system", "content": static_prompt(self.target)},
                         {"role": "user", "content": build_prompt(card, self.target, parent, lineage, feedback,
                                                                  self.facts, context)}],
        }

    def worst_case_cost(self, request: dict) -> float:
        limit = request.get("max_completion_tokens", request.get("max_tokens", self.max_tokens))
        return worst_case_cost(self.price, [m["content"] for m in request["messages"]], limit)

    def send(self, request: dict) -> tuple[dict, int]:
        """One chat-completions call, retried on rate limits, server errors and timeouts; (reply, attempts)."""
        last = ""
        for attempt in range(1, self.max_attempts + 1):
            try:
                with urllib.request.urlopen(self._http_request(request), timeout=self.timeout_s) as response:
                    return json.loads(response.read()), attempt
            except urllib.error.HTTPError as err:
                detail = _message(err)
                if err.code in (401, 403):
                    raise ForgepackError(f"{self.base_url} refused the key ({err.code}): check {KEY_ENV}") from None
                if err.code not in RETRY_STATUSES:
                    raise ForgepackError(f"chat-completions error {err.code}: {detail}") from None
                last = f"{err.code} {detail}"
                delay = _retry_after(err) or self._backoff(attempt)
            except TimeoutError:  # the reply did not come in time
                last, delay = "timeout", self._backoff(attempt)
            except urllib.error.URLError as err:  # refused, reset, DNS; a timeout while connecting too
                last, delay = f"connection error: {err.reason}", self._backoff(attempt)
            except json.JSONDecodeError:
                last, delay = "a reply that is not JSON", self._backoff(attempt)
            if attempt < self.max_attempts:
                self.sleep(min(delay, self.max_backoff_s))
        raise ForgepackError(
            f"{self.base_url}: gave up after {self.max_attempts} attempts ({last}); run the same command to resume"
        )

    def parse(self, request: dict, reply: dict, attempts: int, seconds: float) -> Proposal:
        usage = reply.get("usage") or {}
        tokens_in, tokens_out = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        choice = (reply.get("choices") or [{}])[0]
        body = (choice.get("message") or {}).get("content") or ""
        stop = "max_tokens" if choice.get("finish_reason") == "length" else choice.get("finish_reason")
        return reply_proposal(self, body, stop, tokens=(tokens_in, tokens_out),
                              cost=prices.cost(self.model, tokens_in, tokens_out, per_mtok=self.price),
                              seconds=seconds, attempts=attempts, served_model=reply.get("model"),
                              base_url=self.base_url, cached_tokens=cached)

    def _http_request(self, request: dict) -> urllib.request.Request:
        headers = {"content-type": "application/json"}
        if self.key:
            headers["authorization"] = f"Bearer {self.key}"
        return urllib.request.Request(f"{self.base_url}/chat/completions", data=json.dumps(request).encode(),
                                      headers=headers, method="POST")

    def _backoff(self, attempt: int) -> float:
        return backoff(self.backoff_s, attempt)


def _message(err: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(err.read() or b"{}")
    except (json.JSONDecodeError, OSError):
        return str(err.reason)[:200]
    inner = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(inner, dict) and inner.get("message"):
        return str(inner["message"])[:200]
    return str(err.reason)[:200]


def _retry_after(err: urllib.error.HTTPError) -> float | None:
    value = err.headers.get("retry-after") if err.headers is not None else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
