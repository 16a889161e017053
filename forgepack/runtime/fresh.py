"""Fresh inputs drawn like recorded ones, in the recorded layout: the one drawing of the build's
verifier (`forgepack.samples`, from a card's `TensorMeta`) and the pack's self-test (from the
manifest's `TensorRecord`), so a kernel meets the same kind of values at build time and on the
serving machine.

A tensor keeps its recorded dtype, sizes, strides and storage offset (a storage with the same offset
in front, so pointer alignment matches too). Values: floats with the captured mean and spread (and
sign, when nothing negative was seen), integers in the captured range, bools at random; an edge
draw plants inf, -inf and NaN in float inputs, whose positions a kernel must reproduce, and in integer
inputs the range's ends and its values with zero low bits. Part of the
pack runtime: torch and the standard library only.
"""

from __future__ import annotations

import torch

from .packinfo import TensorRecord

FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")
_EDGE_VALUES = (float("inf"), float("-inf"), float("nan"))


def span(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements of storage a view touches, from its first element (0 for an empty view)."""
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * abs(s) for n, s in zip(shape, stride, strict=True))


def generator(seed: int, device: str | torch.device) -> torch.Generator:
    """The seeded generator draws use: on the device itself for CUDA, where drawing a large input on the
    host (float64, one thread) and copying it over took seconds per call and dominated an envelope
    profile's timing; on the host otherwise. Values are reproducible per seed and device type."""
    device = torch.device(device)
    return torch.Generator(device=device if device.type == "cuda" else "cpu").manual_seed(seed)


def materialize(meta: TensorRecord, values: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """A tensor with meta's exact layout whose storage window holds `values` (its span long)."""
    dtype = getattr(torch, meta.dtype)
    n = span(meta.shape, meta.stride)
    storage = torch.empty(meta.storage_offset + n, dtype=dtype, device=device)
    if n:
        storage[meta.storage_offset:].copy_(values.reshape(-1).to(dtype))
    return torch.as_strided(storage, meta.shape, meta.stride, meta.storage_offset)


def draw_values(meta: TensorRecord, gen: torch.Generator, edge: bool = False) -> torch.Tensor:
    """The storage window's values (1-D; float64, int64 or bool) for a draw like the recorded one."""
    n, stats = span(meta.shape, meta.stride), meta.stats
    if meta.dtype == "bool":
        return torch.rand(n, generator=gen, device=gen.device) < 0.5
    if meta.dtype not in FLOAT_DTYPES:
        lo, hi = int(stats.get("min", -1)), int(stats.get("max", 1))
        values = torch.randint(lo, hi + 1, (n,), generator=gen, dtype=torch.int64, device=gen.device)
        return _plant(values, _int_edges(lo, hi), gen) if edge else values
    mean = stats.get("mean", 0.0)
    std = stats.get("std", 1.0) or max(abs(mean), 1.0)  # a constant input: its own magnitude
    values = torch.randn(n, generator=gen, dtype=torch.float64, device=gen.device) * std + mean
    if stats.get("min", -1.0) >= 0:  # e.g. variances, probabilities, rsqrt inputs: keep the sign
        values = values.abs()
    return _plant(values, _EDGE_VALUES, gen) if edge else values


def _int_edges(lo: int, hi: int) -> tuple[int, ...]:
    """The range's ends, and the values in it nearest zero whose low 8, 16 or 32 bits are all zero: a
    kernel that reads an int64 through a narrower type (a cast to bool that kept the low byte) gets
    those wrong, and a uniform draw over a range of a few hundred rarely holds one."""
    wide = [m for k in (8, 16, 32) for m in (1 << k, -(1 << k)) if lo <= m <= hi]
    return tuple(dict.fromkeys((lo, hi, *wide)))


def _plant(values: torch.Tensor, specials: tuple, gen: torch.Generator) -> torch.Tensor:
    """`values` with each special value at its own random position (none in a window of fewer than 8)."""
    if values.numel() < max(8, len(specials)):
        return values
    spots = torch.randint(0, values.numel(), (len(specials),), generator=gen, device=gen.device).tolist()
    if len(set(spots)) < len(spots):  # a later value would overwrite an earlier one: draw distinct spots
        spots = torch.randperm(values.numel(), generator=gen, device=gen.device)[:len(specials)].tolist()
    for i, special in zip(spots, specials, strict=True):
        values[i] = special
    return values


def draw(meta: TensorRecord, gen: torch.Generator, device: str | torch.device, edge: bool = False) -> torch.Tensor:
    """Fresh values like the recorded ones, in meta's exact layout (`edge`: inf, -inf, NaN planted)."""
    return materialize(meta, draw_values(meta, gen, edge), device)
