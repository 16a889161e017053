"""Which calls the pack's guards sent to stock, by signature: `pack.record_misses()`.

    with pack.record_misses() as rec:
        model.generate(...)
    rec.top(20)      # [(op, signature, count)], most frequent first
    rec.top(20, fold=True)  # the same, views that differ only in where they lie in memory as one row
    rec.hits, rec.misses
    print(rec.table())

A `TorchDispatchMode` sees every aten call above the backend key where the pack's C++ guards sit. For
a call of an op the pack overrides it reads the shim's hit counters before and after running the call;
no variant of that op gaining a hit makes the call a miss, kept under a compact signature of its
arguments (a tensor: dtype, sizes, strides, storage offset, device type), the facts a guard checks, so
that the signature says how to widen the envelope. Calls of other ops run untouched. The counters are
the process's: calls made by another thread while recording can turn a miss into a hit. A call an op
makes inside its own kernel (`1 - t` is `rsub.Scalar`, whose CPU and CUDA kernels call `sub.Tensor`)
runs below the mode: `stats()` counts it, the recorder never sees it.

Decode steps slice views out of tensors that grow by a token a step (the last column of the ids, a row
of the cache): the same miss then has a new stride and offset every step. `fold=True` shows such strides
and offsets as `*` (`folded`), so such a miss is one row with its total count.

The fused module sites (`modules.py`) decline under any dispatch mode but this one (its class carries
`MARK`), so recording does not change what runs.

This file imports only torch and the standard library.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MARK = "__forgepack_miss_recorder__"  # on the class: every pack's copy of this file is a recorder to them all
VALUE_CHARS = 40  # a non-tensor argument's repr, cut to this


def _tensor(t: torch.Tensor) -> str:
    dtype = str(t.dtype).removeprefix("torch.")
    sizes = ",".join(map(str, t.shape))
    if t.layout != torch.strided:  # sparse and friends have no strides
        return f"{dtype}[{sizes}] {t.layout} {t.device.type}"
    strides = ",".join(map(str, t.stride()))
    return f"{dtype}[{sizes}] s({strides}) +{t.storage_offset()} {t.device.type}"


def describe(value: Any) -> str:
    """One argument as a signature shows it."""
    if isinstance(value, torch.Tensor):
        return _tensor(value)
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return "[" + "; ".join(describe(v) for v in value) + "]"
    text = repr(value)
    return text if len(text) <= VALUE_CHARS else text[:VALUE_CHARS - 3] + "..."


_PLACED = re.compile(r"\[([\d,]*)\] s\(([\d,]*)\) \+(\d+)")  # sizes, strides, offset in `_tensor`'s form


def _contiguous(sizes: list[int]) -> list[int]:
    out, step = [], 1
    for n in reversed(sizes):
        out.append(step)
        step *= max(n, 1)
    return out[::-1]


def _starred(match: re.Match) -> str:
    sizes = [int(v) for v in match.group(1).split(",")] if match.group(1) else []
    strides = match.group(2).split(",") if match.group(2) else []
    dense = _contiguous(sizes)
    kept = [st if st in ("0", "1") or int(st) == d else "*" for st, d in zip(strides, dense, strict=True)]
    return f"[{match.group(1)}] s({','.join(kept)}) +{'0' if match.group(3) == '0' else '*'}"


def folded(sig: str) -> str:
    """`sig` with where each view lies in a larger tensor as `*`: a stride that is none of 0, 1 and the
    contiguous stride of its dim, and an offset that is not 0. What the guards check of a layout (dense,
    broadcast, unit-stride dims) stays."""
    return _PLACED.sub(_starred, sig)


def signature(args: tuple, kwargs: dict) -> str:
    parts = [describe(a) for a in args] + [f"{k}={describe(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


class MissRecorder(TorchDispatchMode):
    """`variants`: per overridden op (`str(func)`, e.g. "aten.cat.default"), the indices of its variants'
    hit counters in `counters()` (the shim's raw `stats()`)."""

    __forgepack_miss_recorder__ = True  # MARK, which modules._busy reads

    def __init__(self, variants: dict[str, tuple[int, ...]], counters: Callable[[], list[int]]):
        super().__init__()
        self.variants = variants
        self.counters = counters
        self.hits = 0
        self.misses = 0
        self.counts: Counter[tuple[str, str]] = Counter()
        self._by_func: dict[Any, tuple[int, ...] | None] = {}  # str(func) costs more than a dict lookup

    def _indices(self, func: Any) -> tuple[int, ...] | None:
        if func not in self._by_func:
            self._by_func[func] = self.variants.get(str(func))
        return self._by_func[func]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        indices = self._indices(func)
        if indices is None:
            return func(*args, **kwargs)
        before = self.counters()
        out = func(*args, **kwargs)
        after = self.counters()
        if any(after[k] != before[k] for k in indices):
            self.hits += 1
        else:
            self.misses += 1
            self.counts[(str(func), signature(args, kwargs))] += 1
        return out

    def top(self, n: int | None = 20, op: str | None = None, fold: bool = False) -> list[tuple[str, str, int]]:
        """The missed (op, signature, count), most frequent first (`op`: only that op's; `n` None: all;
        `fold`: signatures that differ only in where their views lie as one, by `folded`)."""
        counts = self.counts
        if fold:
            counts = Counter()
            for (o, s), c in self.counts.items():
                counts[(o, folded(s))] += c
        rows = [(o, s, c) for (o, s), c in counts.most_common() if op is None or o == op]
        return rows if n is None else rows[:n]

    def table(self, n: int | None = 20, fold: bool = False) -> str:
        """`top(n, fold=fold)` as plain text, after the totals."""
        calls = self.hits + self.misses
        head = f"{calls} calls of the pack's ops: {self.hits} served, {self.misses} missed"
        rows = [(str(c), o, s) for o, s, c in self.top(n, fold=fold)]
        if not rows:
            return head
        widths = [max(len(r[k]) for r in [("count", "op", "signature"), *rows]) for k in range(2)]
        lines = [f"{'count':>{widths[0]}}  {'op':<{widths[1]}}  signature"]
        lines += [f"{c:>{widths[0]}}  {o:<{widths[1]}}  {s}" for c, o, s in rows]
        return "\n".join([head, *lines])
