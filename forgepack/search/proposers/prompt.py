"""What every LLM proposer shares: the prompt, the reply parsing and the retry backoff.

The prompt carries everything a kernel engineer would ask for, the part that never changes first:

- the static block (`static_prompt`, the system prompt): the rules, the ABI header and its
  documentation (both package data, so an installed forgepack sends them too). It is byte-identical
  for every call of a target, so a provider's prompt cache serves it (Anthropic: ``cache_control`` on
  that block; OpenAI caches a repeated prefix by itself);
- the call's text (`build_prompt`): the operator variant (op, schema, inputs in ABI order with dtypes,
  shapes, strides; scalars; outputs), the reference program, what the profile measured (eager time,
  roofline, bytes, FLOPs, baseline class and the kernels PyTorch launched), the device, the parent's
  source, the lineage with verdicts, timings and (CUDA) register and spill counts, the feedback on
  earlier attempts (raw compiler logs, mismatch diagnostics, a family member that failed, malformed
  replies), and the search's `Context`: the card's other evaluated kernels (the parent's siblings
  among them), its best kernel and accepted kernels of similar cards.

The kernel is taken from the reply's fenced code block that defines ``forgepack_kernel``; a reply
without one is a call that produced nothing (it counts, its feedback goes into the next prompt).
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Sequence
from importlib import resources
from typing import Any

from forgepack.cards import Card, TensorMeta
from forgepack.search.proposers import Context, Parent, Proposal
from forgepack.search.proposers.reference import family_lines, reference_program

# Statuses worth another attempt: timeouts, conflicts, rate limits, server errors, Anthropic's overload.
RETRY_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504, 529})

_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)```", re.DOTALL)

SYSTEM = """\
You are an expert GPU kernel engineer. You write one kernel at a time for one exact PyTorch operator
variant, against a small C ABI (header below), never PyTorch. Rules the verifier enforces:
- include only "forgepack_abi.h" and the {runtime}; no PyTorch/ATen, no allocation, no streams,
  events, threads or device synchronisation; keep no state between calls;
- export `FP_EXPORT int32_t forgepack_kernel(const fp_call* call)` and return 0 on success;
- {stream_rule}
- write every element of every output and nothing else; inputs are read-only;
- the dtypes and scalars below are the only ones the kernel will ever see (a guard enforces them); so
  are the sizes and strides of a single variant: specialise on them as compile-time constants. A shape
  family's free dims (named with their ranges) vary, and the strides with them: read those sizes and
  strides from the descriptors at run time;
- the reference program below is what the outputs are compared against;
- outputs are compared against PyTorch with dtype-aware tolerances on real and fresh random inputs
  (NaN/Inf positions must match), then timed against PyTorch's kernel with the L2 cache flushed.
Reply with exactly one fenced code block (```{fence}) holding the complete source file, then at most
three sentences on what you changed and why."""


def system_prompt(target: str) -> str:
    """The rules alone (`static_prompt` is what is sent)."""
    return SYSTEM.format(**_target_words(target))


def static_prompt(target: str) -> str:
    """What every call of `target` sends first and unchanged: the rules, the ABI header, its documentation."""
    return (system_prompt(target) + "\n\nThe kernel ABI header, forgepack_abi.h:\n```c\n" + abi_header() + "```\n\n"
            + "The ABI documentation (kernel-abi.md):\n" + abi_doc())


# Chat formats wrap each message in a few tokens of their own (role markers, separators).
MESSAGE_OVERHEAD_TOKENS = 16


def worst_case_cost(per_mtok: tuple[float, float], texts: Sequence[str], max_tokens: int,
                    input_factor: float = 1.0) -> float:
    """Dollars one call can cost at most: every UTF-8 byte of its texts one input token (a byte-level
    tokenizer never makes a token of less than one byte), plus each message's framing, times
    `input_factor` (a prompt-cache write costs more than a plain input token), and `max_tokens` of output.

    >>> round(worst_case_cost((3.0, 15.0), ["x" * 1000], 1000), 6)
    0.018048
    """
    tokens_in = sum(len(t.encode()) + MESSAGE_OVERHEAD_TOKENS for t in texts)
    return (tokens_in * input_factor * per_mtok[0] + max_tokens * per_mtok[1]) / 1e6


def abi_header() -> str:
    """`forgepack_abi.h`, read from the installed package."""
    return resources.files("forgepack").joinpath("abi", "forgepack_abi.h").read_text()


def abi_doc() -> str:
    """The ABI documentation, read from the installed package (package data, not the source tree)."""
    return resources.files("forgepack").joinpath("abi", "kernel-abi.md").read_text()


def backoff(base_s: float, attempt: int) -> float:
    """Exponential with jitter, so parallel builds do not retry in lockstep."""
    return base_s * 2 ** (attempt - 1) * (0.5 + random.random() / 2)


# --- reply parsing -------------------------------------------------------------------------------


def reply_proposal(proposer: Any, body: str, stop: str | None, *, tokens: tuple[int, int], cost: float,
                   seconds: float, attempts: int, served_model: str | None, **meta: Any) -> Proposal:
    """The Proposal of one LLM reply, whichever API it came from: the source parsed out of `body`, the
    call's tokens, cost and timing (`seconds`: the round trip, retries included)."""
    source, problem = extract_source(body, stop)
    meta = {"model": served_model or proposer.model, "stop_reason": stop, "attempts": attempts,
            "seconds": round(seconds, 3), **meta}
    return Proposal(source=source, params={"model": proposer.model}, meta=meta, tokens=tokens, cost=cost,
                    feedback=problem, label=proposer.label, model=proposer.model)


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
    lines.extend(family_lines(card))
    return "\n".join(lines)


def describe_reference(card: Card) -> str:
    return ("The reference computation (PyTorch; the kernel's outputs must match it):\n```python\n"
            + reference_program(card) + "```")


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
    resources = getattr(entry, "resources", None)
    if resources:
        timing += f"; {resources}"
    return f"#{entry.candidate_id} ({entry.proposer} {entry.params}): {verdict}{timing}"


def _item(text: str) -> str:
    """A feedback item as a list entry: its first line after the dash, the rest (a raw compiler log,
    diagnostics) indented under it, line for line."""
    first, _, rest = text.partition("\n")
    lines = [f"- {first}"]
    lines += [f"    {line}" if line else "" for line in rest.splitlines()]
    return "\n".join(lines)


def _code(source: str, target: str) -> str:
    body = source if source.endswith("\n") else source + "\n"
    return f"```{_target_words(target)['fence']}\n{body}```"


def describe_context(context: Any, target: str) -> list[str]:
    """The `Context` as prompt sections (none for an empty one)."""
    if context is None:
        return []
    parts = []
    if context.evaluated:
        rows = "\n".join(f"{_verdict_line(e)} [from {f'#{e.parent_id}' if e.parent_id else 'scratch'}]"
                         for e in context.evaluated)
        parts.append("Other kernels already evaluated for this variant (fastest first, then the failed; do not "
                     f"repeat them):\n{rows}")
    if context.best is not None:
        best = context.best
        timing = f", {best.speedup:.3f}x vs eager" if best.speedup else ""
        parts.append(f"The best kernel for this variant so far, candidate #{best.candidate_id} ({best.verdict}"
                     f"{timing}):\n{_code(best.source, target)}")
    if context.attempt:
        others = f"{context.attempt} other attempt{'s' if context.attempt > 1 else ''}"
        parts.append(f"This is attempt {context.attempt + 1} from this starting point: {others} from it came "
                     "before this one (some may still be under evaluation). Write a kernel that differs from "
                     "theirs: another approach, not a copy.")
    for ex in context.similar:
        timing = f" at {ex.speedup:.3f}x vs eager" if ex.speedup else ""
        parts.append(f"An accepted kernel of a similar variant ({ex.card_id}: {ex.signature}), candidate "
                     f"#{ex.candidate_id}{timing}; its shapes are not this variant's:\n{_code(ex.source, target)}")
    return parts


def build_prompt(
    card: Card,
    target: str,
    parent: Parent | None,
    lineage: Sequence[Any],
    feedback: Sequence[str],
    facts: dict[str, Any] | None = None,
    context: Any = None,
) -> str:
    """The call's own text (the static block, `static_prompt`, goes before it as the system prompt)."""
    parts = [describe_card(card), describe_reference(card), describe_profile(card)]
    facts = facts or {}
    if facts:
        parts.append("Device: " + ", ".join(f"{k}={v}" for k, v in facts.items()))
    parts.append(f"Target: {target}")
    if lineage:
        rows = "\n".join(_verdict_line(e) for e in lineage)
        parts.append(f"Lineage of the kernel to improve (oldest first):\n{rows}")
    if parent is not None:
        timing = f" ({parent.speedup:.3f}x vs eager)" if parent.speedup else ""
        code = _code(parent.source, target)
        parts.append(f"The kernel to improve, candidate #{parent.candidate_id}{timing}:\n{code}")
    parts.extend(describe_context(context, target))
    if feedback:
        items = "\n".join(_item(f) for f in feedback)
        parts.append(f"What went wrong with earlier attempts from this kernel:\n{items}")
    prof = card.profile
    goal = "Write a correct kernel for this variant that is faster than PyTorch's."
    if parent is not None:
        goal = "Write a faster version of the kernel above (it must stay correct)."
    if prof is not None and prof.roofline_us > 0:
        goal += f" Eager takes {prof.eager_us:.2f} us; the roofline is {prof.roofline_us:.2f} us."
    parts.append(goal)
    return "\n\n".join(parts)


class RequestReply:
    """`propose` of a proposer that asks an LLM: build the request, send it (retries, cassettes), parse
    the reply into a proposal. The Anthropic and OpenAI-compatible proposers differ in those three."""

    def propose(
        self,
        card: Card,
        parent: Parent | None,
        lineage: Sequence[Any],
        feedback: Sequence[str],
        tried: frozenset[str] = frozenset(),
        context: Context | None = None,
    ) -> Proposal:
        request = self.request(card, parent, lineage, feedback, context)
        started = time.monotonic()
        reply, attempts = self.send(request)
        return self.parse(request, reply, attempts, time.monotonic() - started)
