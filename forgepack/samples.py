"""Sample inputs: the real tensors capture kept, and fresh ones drawn like them, in the exact layout.

A card fixes each input's dtype, shape, stride and storage offset. `materialize` builds a tensor with
exactly that layout (a storage with the same offset in front, so pointer alignment matches too).
Samples are kept as the storage window each view touches, in one safetensors file per card:
``s{k}.in{i}`` for input i of sample k and ``s{k}.out{j}`` for the eager output j.
"""

from __future__ import annotations

from pathlib import Path

import torch

from forgepack.cards import FLOAT_DTYPES, Card, TensorMeta, ValueStats

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
    span = _span(t.shape, t.stride())
    return torch.as_strided(t, (span,), (1,), t.storage_offset()).clone()


def _span(shape, stride) -> int:
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * abs(s) for n, s in zip(shape, stride, strict=True))


def materialize(meta: TensorMeta, values: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """A tensor with meta's exact layout whose storage window holds `values` (1-D, meta.span() long)."""
    dtype = torch_dtype(meta.dtype)
    storage = torch.empty(meta.storage_offset + meta.span(), dtype=dtype, device=device)
    if meta.span():
        storage[meta.storage_offset :].copy_(values.reshape(-1).to(dtype))
    return torch.as_strided(storage, meta.shape, meta.stride, meta.storage_offset)


def draw(meta: TensorMeta, gen: torch.Generator, device: str | torch.device) -> torch.Tensor:
    """Fresh values like the captured ones (same range and spread), in meta's exact layout."""
    n = meta.span()
    stats = meta.stats or ValueStats()
    if meta.dtype == "bool":
        values = torch.rand(n, generator=gen) < 0.5
    elif meta.dtype in FLOAT_DTYPES:
        std = stats.std if stats.std > 0 else max(abs(stats.mean), 1.0)
        values = torch.randn(n, generator=gen, dtype=torch.float64) * std + stats.mean
        if stats.min >= 0:  # e.g. variances, probabilities, rsqrt inputs: keep the sign
            values = values.abs()
    else:
        lo, hi = int(stats.min), int(stats.max)
        values = torch.randint(lo, hi + 1, (n,), generator=gen, dtype=torch.int64)
    return materialize(meta, values, device)


def draw_edge(meta: TensorMeta, gen: torch.Generator, device: str | torch.device) -> torch.Tensor:
    """Like `draw`, with a few inf, -inf and NaN planted in float inputs: their positions must match."""
    t = draw(meta, gen, device)
    if meta.dtype not in FLOAT_DTYPES or meta.span() < 8:
        return t
    flat = torch.as_strided(t, (meta.span(),), (1,), meta.storage_offset)
    idx = torch.randint(0, meta.span(), (3,), generator=gen)
    for i, value in zip(idx.tolist(), (float("inf"), float("-inf"), float("nan")), strict=True):
        flat[i] = value
    return t


def fresh_inputs(card: Card, seed: int, device: str | torch.device, edge: bool = False) -> list:
    gen = torch.Generator().manual_seed(seed)
    make = draw_edge if edge else draw
    return [None if m is None else make(m, gen, device) for m in card.tensor_inputs()]


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
