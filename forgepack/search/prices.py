"""LLM prices, the one table: US dollars per million tokens, (input, output).

Model ids carry dated suffixes (`claude-sonnet-4-5-20250929`); the longest table key that prefixes the
id wins. An id with no price is refused up front rather than recorded as free, because `--max-cost`
could not cap what it cannot count. Add new models here. A model the table cannot know (a local server,
a proxy's alias) is priced by the caller (`--llm-price IN,OUT`, or ``FORGEPACK_LLM_PRICE``); ``0,0``
says it is free, so it never counts against ``--max-cost``.
"""

from __future__ import annotations

import os

from forgepack.errors import UsageError

PRICE_ENV = "FORGEPACK_LLM_PRICE"

# Anthropic list prices per million tokens (input, output), standard tier, no batch or cache discount,
# from platform.claude.com/docs/about-claude/pricing.
PRICES_PER_MTOK: dict[str, tuple[float, float]] = {
    "claude-opus-4-6": (5.00, 25.00),
    "claude-sonnet-4-6": (3.00, 15.00),
    "claude-opus-4-5": (5.00, 25.00),
    "claude-opus-4-1": (15.00, 75.00),
    "claude-opus-4": (15.00, 75.00),
    "claude-sonnet-4-5": (3.00, 15.00),
    "claude-sonnet-4": (3.00, 15.00),
    "claude-3-7-sonnet": (3.00, 15.00),
    "claude-haiku-4-5": (1.00, 5.00),
    "claude-3-5-haiku": (0.80, 4.00),
    "claude-3-haiku": (0.25, 1.25),
    # OpenAI list prices, standard tier, from openai.com/api/pricing
    "gpt-5": (1.25, 10.00),
    "gpt-5-mini": (0.25, 2.00),
    "gpt-4.1": (2.00, 8.00),
    "gpt-4o": (2.50, 10.00),
}

# Prompt-cache reads and writes, as multiples of the input price.
CACHE_READ_FACTOR = 0.1
CACHE_WRITE_FACTOR = 1.25


def parse_price(text: str) -> tuple[float, float]:
    """`IN,OUT` dollars per million tokens, e.g. "3,15" or "0,0" for a local server.

    >>> parse_price("0.25, 2")
    (0.25, 2.0)
    """
    try:
        p_in, p_out = (float(part) for part in text.split(","))
    except ValueError:
        raise UsageError(f"a price is IN,OUT dollars per million tokens (e.g. 3,15 or 0,0), got {text!r}") from None
    if p_in < 0 or p_out < 0:
        raise UsageError(f"a price cannot be negative, got {text!r}")
    return p_in, p_out


def is_paid(per_mtok: tuple[float, float]) -> bool:
    return per_mtok[0] > 0 or per_mtok[1] > 0


def price(model: str, override: tuple[float, float] | None = None) -> tuple[float, float]:
    """(input, output) dollars per million tokens for `model`: `override`, else ``FORGEPACK_LLM_PRICE``,
    else the table."""
    if override is not None:
        return override
    if os.environ.get(PRICE_ENV):
        return parse_price(os.environ[PRICE_ENV])
    matches = [key for key in PRICES_PER_MTOK if model == key or model.startswith(key + "-")]
    if not matches:
        known = ", ".join(sorted(PRICES_PER_MTOK))
        raise UsageError(f"no price for model {model!r} in forgepack/search/prices.py (known: {known}); "
                         f"give one with --llm-price IN,OUT ($ per million tokens, 0,0 for a local server)")
    return PRICES_PER_MTOK[max(matches, key=len)]


def cost(model: str, input_tokens: int, output_tokens: int, cache_read: int = 0, cache_write: int = 0,
         per_mtok: tuple[float, float] | None = None) -> float:
    """Dollars for one call.

    >>> round(cost("claude-sonnet-4-5-20250929", 10_000, 2_000), 4)
    0.06
    """
    p_in, p_out = price(model, per_mtok)
    billed_in = input_tokens + CACHE_READ_FACTOR * cache_read + CACHE_WRITE_FACTOR * cache_write
    return (billed_in * p_in + output_tokens * p_out) / 1e6
