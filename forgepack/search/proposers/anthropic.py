"""The Claude proposer: one Messages API call per proposal, through the `anthropic` SDK.

The prompt carries everything a kernel engineer would ask for: the operator variant (op, schema,
inputs in ABI order with dtypes, shapes, strides; scalars; outputs), what the profile measured (eager
time, roofline, bytes, FLOPs, baseline class and the kernels PyTorch launched), the device, the ABI
header and `docs/kernel-abi.md`, the parent's source, the lineage with verdicts and timings, and the
feedback on earlier attempts (compiler errors, mismatch diagnostics, malformed replies).

The kernel is taken from the reply's fenced code block that defines ``forgepack_kernel``; a reply
without one is a call that produced nothing (it counts, its feedback goes into the next prompt).
Rate limits (429), overload (529), server errors and timeouts are retried with exponential backoff
(honouring ``retry-after``); the SDK's own retries are off so every attempt is seen and bounded.
Tokens and dollars are recorded per call (`forgepack.search.prices`).

The SDK is imported lazily: the GPU host and the templates-only path do not need it.
"""

from __future__ import annotations

import os
import random
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from forgepack.cards import Card, TensorMeta
from forgepack.errors import ForgepackError
from forgepack.search import prices
from forgepack.search.proposers import Parent, Proposal

DEFAULT_MODEL = "claude-sonnet-4-6"
KEY_ENV = "ANTHROPIC_API_KEY"
BASE_URL_ENV = "ANTHROPIC_BASE_URL"
RETRY_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504, 529})
ABI_HEADER = Path(__file__).resolve().parents[2] / "abi" / "forgepack_abi.h"
ABI_DOC = Path(__file__).resolve().parents[3] / "docs" / "kernel-abi.md"

_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)```", re.DOTALL)

SYSTEM = """\
You are an expert GPU kernel engineer. You write one kernel at a time for one exact PyTorch operator
variant, against a small C ABI (header below), never PyTorch. Rules the verifier enforces:
- include only "forgepack_abi.h" and the {runtime}; no PyTorch/ATen, no allocation, no streams,
  events, threads or device synchronisation; keep no state between calls;
- export `FP_EXPORT int32_t forgepack_kernel(const fp_call* call)` and return 0 on success;
- {stream_rule}
- write every element of every output and nothing else; inputs are read-only;
- the dtypes, sizes, strides and scalars below are the only ones the kernel will ever see (a guard
  enforces them): specialise on them as compile-time constants;
- outputs are compared against PyTorch with dtype-aware tolerances on real and fresh random inputs
  (NaN/Inf positions must match), then timed against PyTorch's kernel with the L2 cache flushed.
Reply with exactly one fenced code block (```{fence}) holding the complete source file, then at most
three sentences on what you changed and why."""


class AnthropicProposer:
    name = "anthropic"
    paid = True

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
    ):
        self.target = target
        self.model = model or DEFAULT_MODEL
        self.facts = dict(facts or {})
        key = self.preflight(model=self.model, api_key=api_key)
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
    def preflight(cls, model: str | None = None, api_key: str | None = None, **_options: Any) -> str:
        """The API key, once the model can be priced, the key is set and the SDK is installed."""
        prices.price(model or DEFAULT_MODEL)  # refuse a model we cannot price before spending anything
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
        cost = prices.cost(self.model, tokens_in, tokens_out, cache_read, cache_write)
        body = "".join(getattr(block, "text", "") for block in reply.content if block.type == "text")
        source, problem = extract_source(body, reply.stop_reason)
        meta = {
            "model": reply.model or self.model,
            "stop_reason": reply.stop_reason,
            "attempts": attempts,
            "seconds": round(time.monotonic() - started, 3),
        }
        return Proposal(
            source=source,
            params={"model": self.model},
            meta=meta,
            tokens=(tokens_in + cache_read + cache_write, tokens_out),
            cost=cost,
            feedback=problem,
            label=self.label,
            model=self.model,
        )

    def _create(self, text: str) -> tuple[Any, int]:
        """One Messages API call, retried on rate limits, overload and timeouts; (reply, attempts)."""
        sdk = self._sdk
        last = ""
        for attempt in range(1, self.max_attempts + 1):
            try:
                reply = self.client.messages.create(
                    model=self.model,
                    max_tokens=self.max_tokens,
                    system=SYSTEM.format(**_target_words(self.target)),
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
        # exponential with jitter, so parallel builds do not retry in lockstep
        return self.backoff_s * 2 ** (attempt - 1) * (0.5 + random.random() / 2)


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


# --- reply parsing -------------------------------------------------------------------------------


def extract_source(reply: str, stop_reason: str | None = None) -> tuple[str | None, str | None]:
    """(source, None) from the fenced block that defines forgepack_kernel, or (None, feedback)."""
    blocks = [body for _lang, body in _FENCE.findall(reply)]
    with_entry = [b for b in blocks if "forgepack_kernel" in b]
    if with_entry:
        return max(with_entry, key=len).strip() + "\n", None
    if stop_reason == "max_tokens":
        return None, "the reply was cut off at the token limit before the code block closed: write a shorter kernel"
    if blocks:
        return None, "the reply's code block does not define `forgepack_kernel`: export that entry point"
    return None, "the reply had no fenced code block: put the whole source in one ``` block"


# --- the prompt ----------------------------------------------------------------------------------


def _target_words(target: str) -> dict[str, str]:
    if target == "cuda":
        return {
            "runtime": "CUDA runtime headers (cuda_runtime.h, cuda_fp16.h, cuda_bf16.h)",
            "stream_rule": "launch all work on `(cudaStream_t)call->stream` and return without synchronising;",
            "fence": "cuda",
        }
    return {
        "runtime": "C++ standard library (no threads)",
        "stream_rule": "run synchronously on the calling thread (`call->stream` is NULL);",
        "fence": "cpp",
    }


def _tensor_line(index: int, name: str, meta: TensorMeta | None) -> str:
    if meta is None:
        return f"  in[{index}] {name}: None (data == NULL, dtype == FP_NONE)"
    layout = "contiguous" if meta.is_contiguous() else "non-contiguous"
    return (
        f"  in[{index}] {name}: {meta.dtype} sizes={list(meta.shape)} strides={list(meta.stride)} "
        f"storage_offset={meta.storage_offset} ({layout}, {meta.nbytes} bytes)"
    )


def describe_card(card: Card) -> str:
    """The variant in ABI order: inputs, scalars, outputs."""
    lines = [f"Operator: {card.op}", f"Variant: {card.id}", f"Schema: {card.schema}",
             f"Calls per forward: {card.calls}"]
    if card.modules:
        lines.append(f"Called from: {', '.join(card.modules[:4])}")
    if card.kind == "fusion":
        lines.append(f"Fusion of: {', '.join(e.op for e in card.chain)}")
    lines.append("Inputs (call->inputs, in this order):")
    index = 0
    for arg in card.args:
        if arg.kind == "tensor":
            lines.append(_tensor_line(index, arg.name, arg.tensor))
            index += 1
        elif arg.kind == "tensors":
            for k, meta in enumerate(arg.tensors):
                lines.append(_tensor_line(index, f"{arg.name}[{k}]", meta))
                index += 1
        elif arg.kind == "none":
            lines.append(_tensor_line(index, arg.name, None))
            index += 1
    scalars = [
        (a.name, a.value) for a in card.args
        if a.kind == "value" and isinstance(a.value, int | float | bool | list | tuple)
    ]
    lines.append(f"Scalars (call->scalars, in this order; int lists flattened): {card.scalars()}")
    if scalars:
        lines.append("  from: " + ", ".join(f"{n}={v!r}" for n, v in scalars))
    other = [(a.name, a.value) for a in card.args if a.kind == "value" and (a.name, a.value) not in scalars]
    if other:
        lines.append("Other fixed arguments: " + ", ".join(f"{n}={v!r}" for n, v in other))
    lines.append("Outputs (call->outputs, allocated by the caller):")
    for j, meta in enumerate(card.outputs):
        lines.append(f"  out[{j}]: {meta.dtype} sizes={list(meta.shape)} strides={list(meta.stride)}")
    return "\n".join(lines)


def describe_profile(card: Card) -> str:
    prof = card.profile
    if prof is None:
        return "Profile: not measured"
    lines = [
        f"Eager PyTorch time: {prof.eager_us:.2f} us per call ({prof.share:.1%} of the model's operator time)",
        f"Roofline time on this device: {prof.roofline_us:.2f} us ({prof.bytes} bytes moved, {prof.flops} FLOPs); "
        f"headroom {prof.headroom:.1f}x",
        f"Baseline class: {prof.baseline}" + (f" (kernels: {', '.join(prof.kernels[:4])})" if prof.kernels else ""),
    ]
    return "\n".join(lines)


def _verdict_line(entry: Any) -> str:
    verdict = "accepted" if entry.accepted else (entry.category or "?")
    timing = ""
    if entry.speedup is not None:
        timing = f", {entry.speedup:.3f}x vs eager"
    if entry.kernel_us is not None:
        timing += f", {entry.kernel_us:.2f} us"
    return f"#{entry.candidate_id} ({entry.proposer} {entry.params}): {verdict}{timing}"


def build_prompt(
    card: Card,
    target: str,
    parent: Parent | None,
    lineage: Sequence[Any],
    feedback: Sequence[str],
    facts: dict[str, Any] | None = None,
) -> str:
    parts = [describe_card(card), describe_profile(card)]
    facts = facts or {}
    if facts:
        parts.append("Device: " + ", ".join(f"{k}={v}" for k, v in facts.items()))
    parts.append(f"Target: {target}")
    parts.append("The kernel ABI header, forgepack_abi.h:\n```c\n" + ABI_HEADER.read_text() + "```")
    if ABI_DOC.is_file():
        parts.append("The ABI documentation (docs/kernel-abi.md):\n" + ABI_DOC.read_text())
    if lineage:
        rows = "\n".join(_verdict_line(e) for e in lineage)
        parts.append(f"Lineage of the kernel to improve (oldest first):\n{rows}")
    if parent is not None:
        timing = f" ({parent.speedup:.3f}x vs eager)" if parent.speedup else ""
        fence = _target_words(target)["fence"]
        code = f"```{fence}\n{parent.source}```"
        parts.append(f"The kernel to improve, candidate #{parent.candidate_id}{timing}:\n{code}")
    if feedback:
        items = "\n".join(f"- {f}" for f in feedback)
        parts.append(f"What went wrong with earlier attempts from this kernel:\n{items}")
    prof = card.profile
    goal = "Write a correct kernel for this variant that is faster than PyTorch's."
    if parent is not None:
        goal = "Write a faster version of the kernel above (it must stay correct)."
    if prof is not None and prof.roofline_us > 0:
        goal += f" Eager takes {prof.eager_us:.2f} us; the roofline is {prof.roofline_us:.2f} us."
    parts.append(goal)
    return "\n\n".join(parts)
