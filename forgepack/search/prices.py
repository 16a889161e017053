"""LLM prices, the one table: US dollars per million tokens, (input, output).

Model ids carry dated suffixes (`claude-sonnet-4-5-20250929`); the longest table key that prefixes the
id wins. An id with no price is refused up front rather than recorded as free, because `--max-cost`
could not cap what it cannot count. Add new models here.
"""

from __future__ import annotations

from forgepack.errors import UsageError

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
}

# Prompt-cache reads and writes, as multiples of the input price.
CACHE_READ_FACTOR = 0.1
CACHE_WRITE_FACTOR = 1.25


def price(model: str) -> tuple[float, float]:
    """(input, output) dollars per million tokens for `model`."""
    matches = [key for key in PRICES_PER_MTOK if model == key or model.startswith(key + "-")]
    if not matches:
        known = ", ".join(sorted(PRICES_PER_MTOK))
        raise UsageError(f"no price for model {model!r} in forgepack/search/prices.py (known: {known})")
    return PRICES_PER_MTOK[max(matches, key=len)]


def cost(model: str, input_tokens: int, output_tokens: int, cache_read: int = 0, cache_write: int = 0) -> float:
    """Dollars for one call.

    >>> round(cost("claude-sonnet-4-5-20250929", 10_000, 2_000), 4)
    0.06
    """
    p_in, p_out = price(model)
    billed_in = input_tokens + CACHE_READ_FACTOR * cache_read + CACHE_WRITE_FACTOR * cache_write
    return (billed_in * p_in + output_tokens * p_out) / 1e6
