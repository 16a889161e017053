"""What a kernel needs of its inputs beyond its card: pointer alignment and size divisibility.

A kernel states its needs when it is rendered (`Template.needs`); they travel with the accepted kernel
(`accepted.json`) into the pack's manifest, and the pack's guard checks exactly them. The card
(exact or a shape family) says which sizes and strides a kernel serves; the needs say which data
pointers and which of those sizes its fast paths rely on.

A kernel that states nothing needs what it was verified with (`default`): each input's data pointer
at the captured offset modulo 16 bytes, today's rule for every exact-shape kernel. A size-generic
kernel states what it really uses (a 4-byte scalar path: `Align(4)`, so a weight at 8 mod 16 still
hits; a 16-byte vector path over the last dim: `Align(16)` and that dim a multiple of 16 / itemsize).
So does every template's CPU render, exact or not: plain loops over element pointers (`natural`). A
statement looser than the default is used only where the kernel was also verified with its inputs
moved one element along (`familyeval.element_aligned`); else the guard keeps the default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from forgepack.cards import Card, TensorMeta

LEGACY_ALIGN = 16  # today's guard modulus: fp_guard.h kAlignBytes
MAX_ALIGN = 4096


@dataclass(frozen=True)
class Align:
    """The data pointer sits `offset` bytes past a multiple of `bytes` (a power of two; 1: anywhere)."""

    bytes: int = 1
    offset: int = 0

    def admits(self, address: int) -> bool:
        return address % self.bytes == self.offset


@dataclass(frozen=True)
class Needs:
    """A kernel's conditions on its inputs (ABI order, `card.tensor_inputs()`; `Align()` for None)."""

    align: tuple[Align, ...]
    dim_multiple: tuple[tuple[str, int], ...] = ()  # (family dim, k): the dim's value is a multiple of k
    numel_multiple: tuple[tuple[int, int], ...] = ()  # (input index, k): its element count a multiple of k


def default(card: Card) -> Needs:
    """Today's rule: every input at the offset modulo 16 bytes it was captured (and verified) at."""
    return Needs(tuple(legacy_align(m) for m in card.tensor_inputs()))


def natural(card: Card) -> Needs:
    """Each tensor input at its element alignment only: a kernel with no vector paths (a CPU render's
    plain loops) or whose vector paths are chosen at run time. Outputs are the guard's own allocations,
    so it checks inputs only."""
    return Needs(tuple(Align() if m is None else Align(m.itemsize) for m in card.tensor_inputs()))


def legacy_align(m: TensorMeta | None) -> Align:
    """Today's need of one input: the offset modulo 16 bytes it was captured at (`Align()` for None)."""
    if m is None:
        return Align()
    return Align(LEGACY_ALIGN, (m.storage_offset * m.itemsize) % LEGACY_ALIGN)


def aligned(card: Card, bytes_: int) -> Needs:
    """Every tensor input's data pointer at a multiple of `bytes_` (a kernel's plain vector need)."""
    return Needs(tuple(Align() if m is None else Align(bytes_) for m in card.tensor_inputs()))


def validate(needs: Needs, card: Card) -> None:
    """Raise ValueError where the needs cannot belong to this card (the guard would be wrong)."""
    inputs = card.tensor_inputs()
    if len(needs.align) != len(inputs):
        raise ValueError(f"needs state {len(needs.align)} alignments, {card.id} has {len(inputs)} tensor inputs")
    for a in needs.align:
        if a.bytes < 1 or a.bytes > MAX_ALIGN or a.bytes & (a.bytes - 1) or not 0 <= a.offset < a.bytes:
            raise ValueError(f"alignment {a} is not a power of two up to {MAX_ALIGN} with 0 <= offset < bytes")
    dims = {d.name for d in card.family.dims} if card.family is not None else set()
    for name, k in needs.dim_multiple:
        if name not in dims:
            raise ValueError(f"needs name dim {name!r}, {card.id} has {sorted(dims) or 'no dims'}")
        if k < 1:
            raise ValueError(f"dim {name} must be a multiple of {k}: not a positive number")
    for i, k in needs.numel_multiple:
        if not 0 <= i < len(inputs) or inputs[i] is None or k < 1:
            raise ValueError(f"numel of input {i} a multiple of {k}: no such tensor input, or k < 1")


def pointers_ok(needs: Needs, addresses: list[int | None]) -> bool:
    """The Python twin of the guard's pointer checks (addresses in ABI order; None for a None input)."""
    return all(a is None or need.admits(a) for need, a in zip(needs.align, addresses, strict=True))


def sizes_ok(needs: Needs, values: dict[str, int], metas: list[TensorMeta | None]) -> bool:
    """The Python twin of the guard's divisibility checks at these dim values and input sizes."""
    if any(values[name] % k for name, k in needs.dim_multiple):
        return False
    return all(math.prod(metas[i].shape) % k == 0 for i, k in needs.numel_multiple)


# --- JSON / TOML round trip ---------------------------------------------------------------------------


def to_json(needs: Needs) -> dict[str, Any]:
    return {
        "align": [[a.bytes, a.offset] for a in needs.align],
        "dim_multiple": [[n, k] for n, k in needs.dim_multiple],
        "numel_multiple": [[i, k] for i, k in needs.numel_multiple],
    }


def from_json(d: dict[str, Any]) -> Needs:
    return Needs(
        align=tuple(Align(int(b), int(o)) for b, o in d["align"]),
        dim_multiple=tuple((str(n), int(k)) for n, k in d.get("dim_multiple", ())),
        numel_multiple=tuple((int(i), int(k)) for i, k in d.get("numel_multiple", ())),
    )
