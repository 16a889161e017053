"""The Claude proposer: one Messages API call per proposal, through the `anthropic` SDK.

The prompt and the reply parsing are `forgepack.search.proposers.prompt`'s, shared with every LLM
proposer. Rate limits (429), overload (529), server errors and timeouts are retried with exponential
backoff (honouring ``retry-after``); the SDK's own retries are off so every attempt is seen and bounded.
Tokens and dollars are recorded per call (`forgepack.search.prices`; ``FORGEPACK_LLM_PRICE`` prices a
model the table does not know, e.g. a local one behind ``ANTHROPIC_BASE_URL``).

The SDK is imported lazily: the GPU host and the templates-only path do not need it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from forgepack.cards import Card
from forgepack.errors import ForgepackError
from forgepack.search import prices
from forgepack.search.proposers import Parent, Proposal
from forgepack.search.proposers.prompt import (
    RETRY_STATUSES,
    backoff,
    build_prompt,
    extract_source,
    reply_proposal,
    system_prompt,
)

DEFAULT_MODEL = "claude-sonnet-4-6"
KEY_ENV = "ANTHROPIC_API_KEY"
BASE_URL_ENV = "ANTHROPIC_BASE_URL"
ABI_HEADER = Path(__file__).resolve().parents[2] / "abi" / "forgepack_abi.h"
__all__ = ["ABI_HEADER", "AnthropicProposer", "build_prompt", "extract_source"]

class AnthropicProposer:
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
        key = self.preflight(model=self.model, api_key=api_key, price=price)
        self.price = prices.price(self.model, price)
        self.paid = prices.is_paid(self.price)  # costs money: counts against --max-cost
        import anthropic

        self._sdk = anthropic
        # The SDK's own retries are off: `_create` retries, so attempts are bounded and visible.
        self.client = anthropic.Anthropic(
            api_key=key,
            base_url=base_url or os.environ.get(BASE_URL_ENV) or None,
            max_retries=0,
            timeout=timeout_s,
        )
        self.max_tokens = max_tokens
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.sleep = sleep

    @classmethod
    def preflight(cls, model: str | None = None, api_key: str | None = None,
                  price: tuple[float, float] | None = None, **_options: Any) -> str:
        """The API key, once the model can be priced, the key is set and the SDK is installed."""
        prices.price(model or DEFAULT_MODEL, price)  # refuse a model we cannot price before spending anything
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

    def propose(
        self,
        card: Card,
        parent: Parent | None,
        lineage: Sequence[Any],
        feedback: Sequence[str],
        tried: frozenset[str] = frozenset(),
    ) -> Proposal:
        text = build_prompt(card, self.target, parent, lineage, feedback, self.facts)
        started = time.monotonic()
        reply, attempts = self._create(text)
        usage = reply.usage
        tokens_in, tokens_out = int(usage.input_tokens or 0), int(usage.output_tokens or 0)
        cache_read = int(getattr(usage, "cache_read_input_tokens", 0) or 0)
        cache_write = int(getattr(usage, "cache_creation_input_tokens", 0) or 0)
        cost = prices.cost(self.model, tokens_in, tokens_out, cache_read, cache_write, per_mtok=self.price)
        body = "".join(getattr(block, "text", "") for block in reply.content if block.type == "text")
        return reply_proposal(self, body, reply.stop_reason, tokens=(tokens_in + cache_read + cache_write, tokens_out),
                              cost=cost, started=started, attempts=attempts, served_model=reply.model)

    def _create(self, text: str) -> tuple[Any, int]:
        """One Messages API call, retried on rate limits, overload and timeouts; (reply, attempts)."""
        sdk = self._sdk
        last = ""
        for attempt in range(1, self.max_attempts + 1):
            try:
                reply = self.client.messages.create(
                    model=self.model,
                    max_tokens=self.max_tokens,
                    system=system_prompt(self.target),
                    messages=[{"role": "user", "content": text}],
                )
                return reply, attempt
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
