"""The Claude proposer: one Messages API call per proposal, through the `anthropic` SDK.

The prompt and the reply parsing are `forgepack.search.proposers.prompt`'s, shared with every LLM
proposer. The static block (rules, ABI header and documentation) is the system prompt, marked
``cache_control: ephemeral``: after the first call it is read from Anthropic's prompt cache at a tenth of
the input price. Rate limits (429), overload (529), server errors and timeouts are retried with
exponential backoff (honouring ``retry-after``); the SDK's own retries are off so every attempt is
seen and bounded. Tokens and dollars are recorded per call (`forgepack.search.prices`;
``FORGEPACK_LLM_PRICE`` prices a model the table does not know, e.g. a local one behind
``ANTHROPIC_BASE_URL``).

The SDK is imported lazily, and its client made at the first live call: the GPU host, the
templates-only path and a replayed build (`forgepack.search.cassette`) do not need it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
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
    extract_source,
    reply_proposal,
    static_prompt,
    worst_case_cost,
)

DEFAULT_MODEL = "claude-sonnet-4-6"
KEY_ENV = "ANTHROPIC_API_KEY"
BASE_URL_ENV = "ANTHROPIC_BASE_URL"
ABI_HEADER = Path(__file__).resolve().parents[2] / "abi" / "forgepack_abi.h"
__all__ = ["ABI_HEADER", "AnthropicProposer", "build_prompt", "extract_source"]


class AnthropicProposer(RequestReply):
    name = "anthropic"
    adaptive = True  # each call waits for the previous verdict on its card: the feedback is the point

    def __init__(
        self,
        target: str = "cuda",
        model: str | None = None,
        facts: dict[str, Any] | None = None,
        arch: str | None = None,  # in `facts` already (the prompt's device line)
        api_key: str | None = None,
        base_url: str | None = None,
        max_tokens: int = 8192,
        timeout_s: float = 300.0,
        max_attempts: int = 6,
        backoff_s: float = 2.0,
        max_backoff_s: float = 60.0,
        sleep: Callable[[float], None] = time.sleep,
        price: tuple[float, float] | None = None,  # $ per million tokens (in, out); default: the table
    ):
        self.target = target
        self.model = model or DEFAULT_MODEL
        self.facts = dict(facts or {})
        self.key = self.preflight(model=self.model, api_key=api_key, price=price)
        self.price = prices.price(self.model, price)
        self.paid = prices.is_paid(self.price)  # costs money: counts against --max-cost
        self.base_url = base_url or os.environ.get(BASE_URL_ENV) or None
        self.timeout_s = timeout_s
        self.max_tokens = max_tokens
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.sleep = sleep
        self._client: Any = None
        self._lock = threading.Lock()

    @classmethod
    def preflight(cls, model: str | None = None, api_key: str | None = None,
                  price: tuple[float, float] | None = None, **_options: Any) -> str | None:
        """The API key, once the model can be priced, the key is set and the SDK is installed (a replayed
        build, `FORGEPACK_LLM_REPLAY`, needs neither key nor SDK)."""
        prices.price(model or DEFAULT_MODEL, price)  # refuse a model we cannot price before spending anything
        if cassette.replay_dir() is not None:
            return api_key or os.environ.get(KEY_ENV)
        key = api_key or os.environ.get(KEY_ENV)
        if not key:
            raise ForgepackError(
                f"{KEY_ENV} is not set: export {KEY_ENV}=... (or use --proposer templates, which needs no key)"
            )
        try:
            import anthropic  # noqa: F401
        except ImportError:
            raise ForgepackError("the anthropic proposer needs the SDK: pip install 'forgepack[anthropic]'") from None
        return key

    @property
    def label(self) -> str:
        return f"anthropic:{self.model}"

    def unsupported(self, card: Card) -> str | None:
        return None  # an LLM can try any operator

    # --- one call, in three steps (the search runs `send` on its pool and records the exchange) ----

    def request(self, card: Card, parent: Parent | None, lineage: Sequence[Any], feedback: Sequence[str],
                context: Context | None = None) -> dict:
        """The Messages API body: the static block first, as the cached system prompt."""
        return {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "system": [{"type": "text", "text": static_prompt(self.target), "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": build_prompt(card, self.target, parent, lineage, feedback,
                                                                  self.facts, context)}],
        }

    def worst_case_cost(self, request: dict) -> float:
        """Every prompt byte a token written to the cache (the dearest input), and `max_tokens` out."""
        texts = [block["text"] for block in request["system"]] + [m["content"] for m in request["messages"]]
        return worst_case_cost(self.price, texts, request["max_tokens"], prices.CACHE_WRITE_FACTOR)

    def send(self, request: dict) -> tuple[dict, int]:
        """One Messages API call, retried on rate limits, overload and timeouts; (reply JSON, attempts)."""
        client, sdk = self._sdk_client()
        last = ""
        for attempt in range(1, self.max_attempts + 1):
            try:
                reply = client.messages.create(**request)
                return reply.model_dump(mode="json"), attempt
            except sdk.APIStatusError as err:
                if err.status_code in (401, 403):
                    raise ForgepackError(
                        f"the Anthropic API refused the key ({err.status_code}): check {KEY_ENV}"
                    ) from None
                if err.status_code not in RETRY_STATUSES:
                    raise ForgepackError(f"Anthropic API error {err.status_code}: {_message(err)}") from None
                last = f"{err.status_code} {_message(err)}"
                delay = _retry_after(err) or self._backoff(attempt)
            except sdk.APIConnectionError as err:  # includes APITimeoutError
                last = "timeout" if isinstance(err, sdk.APITimeoutError) else f"connection error: {err}"
                delay = self._backoff(attempt)
            if attempt < self.max_attempts:
                self.sleep(min(delay, self.max_backoff_s))
        raise ForgepackError(
            f"Anthropic API: gave up after {self.max_attempts} attempts ({last}); run the same command to resume"
        )

    def parse(self, request: dict, reply: dict, attempts: int, seconds: float) -> Proposal:
        usage = reply.get("usage") or {}
        tokens_in, tokens_out = int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0)
        cache_read = int(usage.get("cache_read_input_tokens") or 0)
        cache_write = int(usage.get("cache_creation_input_tokens") or 0)
        cost = prices.cost(self.model, tokens_in, tokens_out, cache_read, cache_write, per_mtok=self.price)
        body = "".join(block.get("text", "") for block in reply.get("content") or [] if block.get("type") == "text")
        return reply_proposal(self, body, reply.get("stop_reason"),
                              tokens=(tokens_in + cache_read + cache_write, tokens_out), cost=cost, seconds=seconds,
                              attempts=attempts, served_model=reply.get("model"), cache_read_tokens=cache_read,
                              cache_write_tokens=cache_write)

    def _sdk_client(self) -> tuple[Any, Any]:
        with self._lock:
            if self._client is None:
                if not self.key:
                    raise ForgepackError(f"{KEY_ENV} is not set: export {KEY_ENV}=... to call the API "
                                         f"(a replayed build, FORGEPACK_LLM_REPLAY=DIR, needs none)")
                import anthropic

                # The SDK's own retries are off: `send` retries, so attempts are bounded and visible.
                self._client = anthropic.Anthropic(api_key=self.key, base_url=self.base_url, max_retries=0,
                                                   timeout=self.timeout_s)
                self._sdk = anthropic
            return self._client, self._sdk

    def _backoff(self, attempt: int) -> float:
        return backoff(self.backoff_s, attempt)


def _message(err: Any) -> str:
    body = getattr(err, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
    return str(getattr(err, "message", err)).splitlines()[0][:200]


def _retry_after(err: Any) -> float | None:
    response = getattr(err, "response", None)
    value = response.headers.get("retry-after") if response is not None else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
