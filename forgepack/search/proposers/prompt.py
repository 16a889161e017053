"""What every LLM proposer shares: the prompt, the reply parsing and the retry backoff.

The prompt carries everything a kernel engineer would ask for: the operator variant (op, schema,
inputs in ABI order with dtypes, shapes, strides; scalars; outputs), what the profile measured (eager
time, roofline, bytes, FLOPs, baseline class and the kernels PyTorch launched), the device, the ABI
header and its documentation (both package data, so an installed forgepack sends them too), the
parent's source, the lineage with verdicts and timings, and the feedback on earlier attempts
(compiler errors, mismatch diagnostics, malformed replies).

The kernel is taken from the reply's fenced code block that defines ``forgepack_kernel``; a reply
without one is a call that produced nothing (it counts, its feedback goes into the next prompt).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from importlib import resources
from typing import Any

from forgepack.cards import Card, TensorMeta
from forgepack.search.proposers import Parent, Proposal
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
    return SYSTEM.format(**_target_words(target))


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
                   started: float, attempts: int, served_model: str | None, **meta: Any) -> Proposal:
    """The Proposal of one LLM reply, whichever API it came from: the source parsed out of `body`, the
    call's tokens, cost and timing (`started`: time.monotonic() before the call)."""
    import time

    source, problem = extract_source(body, stop)
    meta = {"model": served_model or proposer.model, "stop_reason": stop, "attempts": attempts,
            "seconds": round(time.monotonic() - started, 3), **meta}
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
    return f"#{entry.candidate_id} ({entry.proposer} {entry.params}): {verdict}{timing}"


def build_prompt(
    card: Card,
    target: str,
    parent: Parent | None,
    lineage: Sequence[Any],
    feedback: Sequence[str],
    facts: dict[str, Any] | None = None,
) -> str:
    parts = [describe_card(card), describe_reference(card), describe_profile(card)]
    facts = facts or {}
    if facts:
        parts.append("Device: " + ", ".join(f"{k}={v}" for k, v in facts.items()))
    parts.append(f"Target: {target}")
    parts.append("The kernel ABI header, forgepack_abi.h:\n```c\n" + abi_header() + "```")
    parts.append("The ABI documentation (kernel-abi.md):\n" + abi_doc())
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
