"""Verify and benchmark one compiled kernel against stock PyTorch. Runs inside the worker process.

The protocol, and what each step defends against, is written down in docs/verification.md. In short:

`verify`, for every input set: each captured sample, five or more fresh random inputs drawn like them,
an edge input with inf, -inf and NaN planted, the adversarial sets of `samples.adversarial_inputs`
(large magnitudes, a large offset, denormals, runs of non-finite values, structured values) and a
near-duplicate twin of a fresh input (seeds and fill patterns are drawn per evaluation):

1. Inputs are placed in guarded buffers (guard bytes drawn per evaluation) and a copy of every buffer
   is kept. The reference is the stock op, computed before the kernel runs, in strict precision, and
   kept alive (a kernel cannot find it in freed memory).
2. Three runs, each into new output buffers that hold the card's exact layout inside a larger buffer
   filled first with that run's pattern (`Poison`): a NaN with a drawn payload, random finite values,
   or another input set's correct result, so a kernel can neither recognise a verification call by
   its output's contents nor skip work when the output already looks right. Guard zones and stride
   gaps must keep the pattern (else "wrote outside its output"); no element of the view may keep it
   (else unwritten); inputs and the call descriptors must be bitwise unchanged (else mutates-input);
   outputs must pass `forgepack.runtime.tolerances` (else mismatch); the runs must be bitwise identical (else
   nondeterministic).
3. Reuse: one set of buffers is refilled with every set's values in turn (a near-duplicate right after
   its twin) and the kernel run again on the same pointers; on CUDA as a CUDA graph captured once.
4. Late: every run's buffers stay allocated and are checked again at the end, after a device-wide
   synchronisation: writes that land after a call returned (into its output, around it, or into an
   input) are caught.

`bench` times stock vs kernel with `timing.compare` (interleaved, L2 flushed, bootstrap interval) on one
guarded input set. Every kernel call, timed or not, gets freshly filled output buffers (rotated among a
few sets, or new ones) and fresh descriptors, and its output is compared bitwise with the verified
result (on CUDA the legacy stream is held busy across every call, the stock op's too, so work outside
the caller's stream is missing when the end event completes); a random subset of the timed calls is
verified in full with new buffers.
Calls continue after the timed ones until the kernel has been called `MIN_CALLS` times in this
evaluation (fewer if its own time for them passes `LATE_CALLS_BUDGET_S`) and `LATE_AFTER_S` seconds
have passed since its first call; then one last fresh call is
verified and every kept buffer re-checked.

Results are `forgepack.outcomes` values (`Verified`, `Timed`, `Failure`), which round-trip JSON. A
failure of the stock op itself raises `StockOpError`.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import math
import random
import select
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from forgepack import opcall, timing
from forgepack import samples as samples_mod
from forgepack.cards import DTYPE_CODES, FLOAT_DTYPES, Card, TensorMeta, judged_dtypes
from forgepack.outcomes import STOCK_DIFFERS, STOCK_FAILED, Failure, Timed, Verified
from forgepack.runtime import compare as judge
from forgepack.runtime import tolerances
from forgepack.runtime.tolerances import is_statistic

ABI_VERSION = 1
MAX_DIMS = 8
FRESH_INPUTS = 5
RUNS = 3
GUARD_BYTES = 64 << 10  # canary zone on each side of every buffer (a multiple of 512: alignment kept)
BENCH_REPS = 100  # interleaved pairs; cheap next to a proposer call, and tightens the interval
SLEEP_CYCLES = 2_000_000  # about 1 ms on an H200: longer than a snapshot copy takes to run
RING = 4  # output buffer sets the unchecked timed calls rotate through (each refilled before its call)
FULL_CHECKS = 12  # timed calls verified in full, with new buffers, chosen at random
MIN_CALLS = 400  # kernel calls per evaluation, at least: state that turns wrong after ~200 calls shows
LATE_AFTER_S = 1.5  # the last check is at least this long after the kernel's first call
LATE_CALLS_BUDGET_S = 0.5  # kernel time the extra calls may take (a slow kernel gets fewer of them)
KEEP_BYTES = 256 << 20  # output buffers kept alive for the late re-check, at most

_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# mantissa bits per float dtype (for drawing NaN payloads)
_MANTISSA = {"float32": 23, "float16": 10, "bfloat16": 7, "float64": 52}


class StockOpError(Exception):
    """The stock op could not produce a reference for this card."""


class KernelFailed(Exception):
    """The kernel returned nonzero; `code` is its return value."""

    def __init__(self, code: int):
        super().__init__(f"returned {code}")
        self.code = code


# --- the C ABI, mirrored -------------------------------------------------------------------------


class FpTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("sizes", ctypes.c_int64 * MAX_DIMS),
        ("strides", ctypes.c_int64 * MAX_DIMS),
    ]


class FpScalar(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("reserved", ctypes.c_int32), ("i", ctypes.c_int64), ("f", ctypes.c_double)]


class FpCall(ctypes.Structure):
    _fields_ = [
        ("abi_version", ctypes.c_int32),
        ("n_inputs", ctypes.c_int32),
        ("n_outputs", ctypes.c_int32),
        ("n_scalars", ctypes.c_int32),
        ("inputs", ctypes.POINTER(FpTensor)),
        ("outputs", ctypes.POINTER(FpTensor)),
        ("scalars", ctypes.POINTER(FpScalar)),
        ("stream", ctypes.c_void_p),
    ]


def load_kernel(binary: str | Path):
    """The `forgepack_kernel` entry of a compiled object, callable with a `ctypes.byref(FpCall)`."""
    lib = ctypes.CDLL(str(binary), mode=ctypes.RTLD_LOCAL)
    fn = lib.forgepack_kernel
    fn.restype = ctypes.c_int32
    fn.argtypes = [ctypes.POINTER(FpCall)]
    fn._forgepack_lib = lib  # keep the library loaded as long as the function lives
    return fn


def descriptor(t: torch.Tensor | None) -> FpTensor:
    d = FpTensor()
    if t is None:
        d.data, d.dtype, d.ndim = None, -1, 0
        return d
    if t.dim() > MAX_DIMS:
        raise ValueError(f"a {t.dim()}-dimensional tensor does not fit the kernel ABI (at most {MAX_DIMS})")
    d.data = t.data_ptr() or None
    d.dtype = DTYPE_CODES[samples_mod.dtype_name(t.dtype)]
    d.ndim = t.dim()
    for k, (n, s) in enumerate(zip(t.shape, t.stride(), strict=True)):
        d.sizes[k], d.strides[k] = n, s
    return d


def scalar_array(values: list[Any]):
    arr = (FpScalar * max(len(values), 1))()
    for k, v in enumerate(values):
        if isinstance(v, bool):
            arr[k].kind, arr[k].i, arr[k].f = 2, int(v), float(v)
        elif isinstance(v, int):
            arr[k].kind, arr[k].i, arr[k].f = 0, v, float(v)
        else:
            arr[k].kind, arr[k].f = 1, float(v)
    return arr


class KernelCall:
    """One prepared call: descriptors built once, so calling it costs only the foreign call.

    It holds its tensors: a descriptor is only an address, and the buffers it names must live as long as
    the call can be made (a timed call once wrote into a freed temporary and corrupted the heap).
    Unused descriptor slots are zero, as the pack's shim leaves them; `unchanged` says whether the
    kernel left its descriptors as it got them (they are `const`: no place to keep state)."""

    def __init__(self, fn, inputs: list[torch.Tensor | None], outputs: list[torch.Tensor], scalars: list[Any],
                 stream: int | None):
        self.fn = fn
        self.tensors = (list(inputs), list(outputs))
        self._inputs = (FpTensor * max(len(inputs), 1))(*[descriptor(t) for t in inputs])
        self._outputs = (FpTensor * max(len(outputs), 1))(*[descriptor(t) for t in outputs])
        self._scalars = scalar_array(scalars)
        self.call = FpCall(ABI_VERSION, len(inputs), len(outputs), len(scalars), self._inputs, self._outputs,
                           self._scalars, stream or None)
        self.ref = ctypes.byref(self.call)
        self._as_made = self._bytes()

    def __call__(self) -> int:
        return self.fn(self.ref)

    def _bytes(self) -> bytes:
        return b"".join(bytes(part) for part in (self.call, self._inputs, self._outputs, self._scalars))

    def unchanged(self) -> bool:
        return self._bytes() == self._as_made


def load_count(fn) -> dict:
    """Per loaded kernel, across requests: how often it was called and when first (for the late checks)."""
    if not hasattr(fn, "_forgepack_history"):
        fn._forgepack_history = {"calls": 0, "first": None}
    return fn._forgepack_history


# --- guarded buffers and their fill patterns -------------------------------------------------------


@dataclass
class Guarded:
    """A tensor with the card's exact layout inside a larger buffer: guard | offset | window | guard."""

    meta: TensorMeta
    buf: torch.Tensor  # 1-D
    view: torch.Tensor
    start: int  # buffer index of the view's storage window

    @property
    def bits(self) -> torch.Tensor:
        return self.buf.view(_BITS_DTYPE[self.buf.element_size()])

    @property
    def window(self) -> torch.Tensor:
        return self.buf[self.start : self.start + self.meta.span()]

    @property
    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()


def guarded(meta: TensorMeta, device: torch.device) -> Guarded:
    dtype = samples_mod.torch_dtype(meta.dtype)
    guard = GUARD_BYTES // meta.itemsize
    buf = torch.empty(guard + meta.storage_offset + meta.span() + guard, dtype=dtype, device=device)
    view = torch.as_strided(buf, meta.shape, meta.stride, guard + meta.storage_offset)
    return Guarded(meta, buf, view, guard + meta.storage_offset)


Fill = int | torch.Tensor  # what an output buffer's bits were set to: one value, or one per element


class Poison:
    """The fill patterns of output buffers, drawn per evaluation (no constant a kernel could look for).

    Kinds: `nan`, a NaN whose payload no computation produces (a computed NaN is canonical), one per
    (dtype, run); `garbage`, random finite values (random bits for ints), as a served output's fresh
    allocation holds whatever was there; `stale`, another input's correct result in the view, so that
    an output that already looks right is no sign that work may be skipped.
    """

    def __init__(self, rng: random.Random):
        self.rng = rng
        self._nan: dict[tuple[str, int], int] = {}

    def nan(self, dtype: str, run: int) -> int:
        """The run's NaN (or byte sentinel) as a signed integer of the dtype's width."""
        key = (dtype, run)
        if key not in self._nan:  # differs from the runs just before (a byte sentinel has only 254 values)
            taken = {self._nan.get((dtype, r)) for r in range(run - 3, run)}
            value = _draw_sentinel(dtype, self.rng)
            while value in taken:
                value = _draw_sentinel(dtype, self.rng)
            self._nan[key] = value
        return self._nan[key]

    def fill(self, g: Guarded, run: int, kind: str = "nan", stale: torch.Tensor | None = None) -> Fill:
        """Fill `g` for `run`; returns the bits to expect wherever the kernel must not write."""
        if kind == "garbage":
            gen = torch.Generator(device=g.buf.device).manual_seed(self.rng.getrandbits(62))
            if g.meta.dtype in FLOAT_DTYPES:
                g.buf.copy_(torch.randn(g.buf.numel(), generator=gen, device=g.buf.device))
            else:
                size = g.buf.element_size()
                low, high = (0, 256) if size == 1 else (-(1 << (8 * size - 1)), (1 << (8 * size - 1)) - 1)
                g.bits.copy_(torch.randint(low, high, (g.buf.numel(),), generator=gen, device=g.buf.device,
                                           dtype=torch.int64).to(g.bits.dtype))
            return g.bits.clone()
        g.bits.fill_(self.nan(g.meta.dtype, run))
        if kind == "stale" and stale is not None:
            # guards and gaps must keep the NaN; in the view an element left stale is judged by the
            # tolerance (a correct value may equal the stale one bitwise: no "unwritten" verdict there)
            g.view.copy_(stale)
        return self.nan(g.meta.dtype, run)


def _draw_sentinel(dtype: str, rng: random.Random) -> int:
    size = samples_mod.torch_dtype(dtype).itemsize
    if dtype in _MANTISSA:
        m = _MANTISSA[dtype]
        payload = rng.randrange(1, 1 << m)
        while payload in (1 << (m - 1), (1 << (m - 1)) | 1):  # the canonical quiet NaN (and its neighbour)
            payload = rng.randrange(1, 1 << m)
        raw = (rng.getrandbits(1) << (8 * size - 1)) | (((1 << (8 * size - 1 - m)) - 1) << m) | payload
    else:
        byte = rng.randrange(2, 256)  # never a bool's 0 or 1
        raw = int.from_bytes(bytes([byte]) * size, "little")
    if size > 1 and raw >= 1 << (8 * size - 1):
        raw -= 1 << (8 * size)
    return raw


_DEFAULT_POISON = Poison(random.Random())


def poison_value(dtype: str, run: int) -> int:
    """This process's NaN sentinel for `run` (drawn once per process; harnesses draw their own)."""
    return _DEFAULT_POISON.nan(dtype, run)


def poisoned_output(meta: TensorMeta, device: torch.device, run: int, poison: Poison | None = None) -> Guarded:
    g = guarded(meta, device)
    g.bits.fill_((poison or _DEFAULT_POISON).nan(meta.dtype, run))
    return g


def placed_input(meta: TensorMeta, source: torch.Tensor, device: torch.device, guard_byte: int = 0x3C) -> Guarded:
    """`source` (a tensor in meta's layout) copied into a guarded buffer."""
    g = guarded(meta, device)
    g.buf.view(torch.uint8).fill_(guard_byte)
    if meta.span():
        g.window.copy_(samples_mod.window(source))
    return g


_MASKS: dict[tuple, torch.Tensor] = {}


def view_mask(g: Guarded) -> torch.Tensor:
    """Which buffer elements belong to the view (cached per layout)."""
    key = (g.meta.shape, g.meta.stride, g.start, g.buf.numel(), str(g.buf.device))
    if key not in _MASKS:
        mask = torch.zeros(g.buf.numel(), dtype=torch.bool, device=g.buf.device)
        if g.meta.numel:
            every = torch.arange(g.buf.numel(), device=g.buf.device)
            idx = torch.as_strided(every, g.meta.shape, g.meta.stride, g.start)
            mask[idx.reshape(-1)] = True
        _MASKS.clear() if len(_MASKS) > 64 else None
        _MASKS[key] = mask
    return _MASKS[key]


_OUTSIDE: dict[tuple, torch.Tensor] = {}


def outside_mask(g: Guarded) -> torch.Tensor:
    """The complement of `view_mask`: guard zones, the storage offset and stride gaps."""
    key = (g.meta.shape, g.meta.stride, g.start, g.buf.numel(), str(g.buf.device))
    if key not in _OUTSIDE:
        _OUTSIDE.clear() if len(_OUTSIDE) > 64 else None
        _OUTSIDE[key] = ~view_mask(g)
    return _OUTSIDE[key]


def _view_of(g: Guarded, t: Fill) -> Fill:
    return t if isinstance(t, int) else torch.as_strided(t, g.meta.shape, g.meta.stride, g.start)


# --- checks --------------------------------------------------------------------------------------


def fail(category: str, reason: str, **diagnostics: Any) -> Failure:
    return Failure(category, reason, diagnostics)


def _bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS_DTYPE[t.element_size()])


def _index(flat: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for n in reversed(shape):
        out.append(flat % n if n else 0)
        flat = flat // n if n else 0
    return out[::-1]


def _scalar(t: torch.Tensor) -> float | int | bool | str:
    v = t.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _close_to(out: torch.Tensor, ref: torch.Tensor, dtype: str, input_scale: float) -> torch.Tensor:
    """Elements of `out` within the dtype's tolerance of `ref`: a correct value that equals the fill's
    bitwise by chance (random finite "garbage": about one element in 10^7 for fp32) was written, not left."""
    tol = tolerances.tolerance(dtype)
    if tol is None:
        return torch.zeros(out.shape, dtype=torch.bool, device=out.device)
    got, want = out.double(), ref.to(out.device).double()
    finite = want[torch.isfinite(want)]
    magnitude = max(float(finite.abs().max()) if finite.numel() else 0.0, input_scale)
    return (got - want).abs() <= tolerances.scaled_atol(tol, magnitude) + tol.rtol * want.abs()


def _exact_reference(card: Card, s: InputSet, device: torch.device) -> list[torch.Tensor | None]:
    views = [None if g is None else g.view for g in s.inputs]
    wide = [t.double() if t is not None and t.is_floating_point() else t for t in views]
    try:
        outs = opcall.run_wide(card, wide, device)
    except Exception:  # an op without a float64 kernel: no exact reference, nothing forgiven
        return [None] * len(card.outputs)
    if len(outs) != len(card.outputs):
        return [None] * len(card.outputs)
    return [o if o.dtype == torch.float64 and tuple(o.shape) == m.shape and m.dtype in FLOAT_DTYPES else None
            for o, m in zip(outs, card.outputs, strict=True)]


def _input_scale(s: InputSet) -> float:
    """The largest finite |value| among a set's float inputs (0 without any)."""
    if s.scale is None:
        s.scale = judge.input_scale(g.view for g in s.inputs if g is not None)
    return s.scale


def compare(out: torch.Tensor, ref: torch.Tensor, dtype: str, stats: bool = False,
            input_scale: float = 0.0, exact: torch.Tensor | None = None) -> dict | None:
    """None when `out` matches `ref` under the dtype's tolerance; else diagnostics. `stats`: a
    normalisation statistic, where NaN and +-inf are interchangeable (both non-finite) but finite
    values must still match and non-finite must stay non-finite. `input_scale`: the largest finite
    |value| of the float inputs: the absolute term scales with the larger of it and the output's own
    magnitude, since a result that cancels (a mean near zero of values near one) carries the rounding
    of its inputs' scale, while a result computed at a lower precision than its inputs' still fails."""
    if out.shape != ref.shape:
        return {"problem": "shape", "expected": list(ref.shape), "got": list(out.shape)}
    if out.numel() == 0:
        return None
    tol = tolerances.tolerance(dtype)
    bad, atol = judge.kernel_mismatches(out, ref, tol, input_scale, stats, exact)
    count = int(bad.sum())
    if count == 0:
        return None
    flat = int(bad.reshape(-1).nonzero()[0])
    where = _index(flat, tuple(out.shape))
    diag = {
        "problem": "values",
        "mismatched": count,
        "of": out.numel(),
        "tolerance": tolerances.describe(dtype) + ("" if tol is None else f" (atol scaled: {atol:.3g})"),
        "first_index": where,
        "expected": _scalar(ref[tuple(where)]),
        "got": _scalar(out[tuple(where)]),
    }
    if tol is not None:
        o, r = out.to(torch.float64), ref.to(torch.float64)
        both = torch.isfinite(o) & torch.isfinite(r)
        if bool(both.any()):
            err = (o - r).abs()[both]
            diag["max_abs_err"] = float(err.max())
            diag["max_rel_err"] = float((err / r.abs()[both].clamp_min(1e-30)).max())
        diag["nan_mismatch"] = int((torch.isnan(o) != torch.isnan(r)).sum())
        diag["inf_mismatch"] = int((torch.isinf(o) != torch.isinf(r)).sum())
    return diag


def _max_error(out: torch.Tensor, ref: torch.Tensor, dtype: str) -> float:
    if tolerances.tolerance(dtype) is None or out.numel() == 0:
        return 0.0
    return judge.max_abs_error(out, ref)


# --- the harness ---------------------------------------------------------------------------------


@dataclass
class InputSet:
    label: str
    inputs: list[Guarded | None]
    snapshot: list[torch.Tensor | None]  # bitwise copies of the input buffers (as bits: a bool copy would canonicalise)
    reference: list[torch.Tensor]
    first_run: list[torch.Tensor] | None = None  # run 0's outputs, for comparing later runs
    twin_of: str | None = None  # a near-duplicate's original (the reuse runs put them side by side)
    exact: list[torch.Tensor | None] | None = None  # stock in float64, drawn on a first mismatch only
    scale: float | None = None  # `_input_scale`, once: every run is checked for not changing the inputs first


@dataclass
class Kept:
    """A checked call's buffers, kept allocated, and the bits they held right after the check."""

    where: str
    outs: list[Guarded]
    bits: list[torch.Tensor]


@dataclass
class Late:
    """Buffers to look at again at the end; bounded by KEEP_BYTES."""

    kept: list[Kept] = field(default_factory=list)
    nbytes: int = 0

    def keep(self, where: str, outs: list[Guarded], snaps: list[torch.Tensor]) -> None:
        size = sum(o.nbytes for o in outs)
        if self.nbytes + size > KEEP_BYTES:
            return
        self.nbytes += size
        self.kept.append(Kept(where, outs, [_bits_of(sn).clone() for sn in snaps]))

    def check(self, sets: list[InputSet]) -> Failure | None:
        """Every kept output buffer and every input still holds what it held when it was checked."""
        for k in self.kept:
            for j, (o, before) in enumerate(zip(k.outs, k.bits, strict=True)):
                changed = int((o.bits != before).sum())
                if changed:
                    inside = int((o.bits != before)[view_mask(o)].sum())
                    return fail("mismatch", f"wrote into output {j} of an earlier call after it returned ({inside} "
                                            f"elements of the tensor, {changed - inside} around it; {k.where})",
                                output=j, late_writes=changed, call=k.where)
        for s in sets:
            for i, (g, before) in enumerate(zip(s.inputs, s.snapshot, strict=True)):
                if g is not None and not torch.equal(g.bits, _bits_of(before)):
                    return fail("mutates-input", f"changed input {i} of the {s.label} after the calls returned",
                                input=i, input_set=s.label, late=True)
        return None


def lifted(card: Card) -> Card:
    """A card whose chain writes some inputs in place (a decode block's KV cache), as verification sees
    it: each written input is also an output, the input as the chain leaves it. The kernel gets that
    output's buffer, holding a copy of the input, where the input was (`LiftedCall`): it writes there,
    every check on outputs applies to what it wrote (and around it), and the real inputs stay as they
    were (any change to them is a mutation)."""
    writes = card.fusion.writes if card.fusion is not None else ()
    if not writes:
        return card
    ins = card.tensor_inputs()
    fusion = dataclasses.replace(card.fusion, outputs=(*card.fusion.outputs, *(("in", i) for i in writes)))
    return dataclasses.replace(card, outputs=(*card.outputs, *(ins[i] for i in writes)), fusion=fusion)


class LiftedCall(KernelCall):
    """A call of a kernel that writes inputs in place, verified through `lifted`: the written inputs' slots
    point at their output buffers, each filled with a copy of its input just before the call."""

    def __init__(self, fn, inputs, outputs, scalars, stream, writes: tuple[int, ...]):
        real = len(outputs) - len(writes)
        self.copies = [(inputs[i], outputs[real + k]) for k, i in enumerate(writes)]
        slots = list(inputs)
        for k, i in enumerate(writes):
            slots[i] = outputs[real + k]
        super().__init__(fn, slots, outputs[:real], scalars, stream)
        self.tensors = (list(inputs), list(outputs))

    def __call__(self) -> int:
        for src, dst in self.copies:
            dst.copy_(src)
        return self.fn(self.ref)


class Harness:
    def __init__(self, card: Card, fn, device: torch.device, seed: int = 0):
        self.writes = card.fusion.writes if card.fusion is not None else ()
        self.source = card  # as captured: its samples hold its own outputs
        # a block whose stock backends disagree on NaN, inf and denormals (attention: the CPU flash kernel,
        # the math path and the CUDA kernels each differ) is verified on finite, normal values only
        # (docs/verification.md)
        self.finite = bool(card.fusion is not None and card.fusion.block.get("finite"))
        card = lifted(card)
        self.card, self.fn, self.device = card, fn, device
        self.cuda = device.type == "cuda"
        self.scalars = card.scalars()
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self.max_err: dict[int, float] = {}
        self.judged = judged_dtypes(card)  # the dtype whose tolerance judges each output
        self.rng = random.Random(seed * 2654435761 + 97)
        self.poison = Poison(self.rng)
        self.guard_byte = self.rng.randrange(256)
        self.history = load_count(fn)
        self.late = Late()
        self.calls = 0

    # input sets
    def input_sets(self, samples_path: Path | None, seed: int) -> list[tuple[str, list[torch.Tensor | None]]]:
        sets = []
        if samples_path is not None and Path(samples_path).exists():
            for k, (inputs, _) in enumerate(samples_mod.load_samples(self.source, Path(samples_path), self.device)):
                sets.append((f"captured sample {k}", inputs))
        for k in range(FRESH_INPUTS):
            s = seed + k
            sets.append((f"fresh input (seed {s})", samples_mod.fresh_inputs(self.card, s, self.device)))
        s = seed + FRESH_INPUTS
        if not self.finite:
            edge = samples_mod.fresh_inputs(self.card, s, self.device, edge=True)
            sets.append((f"edge input with inf/-inf/NaN (seed {s})", edge))
        return sets

    def adversarial_sets(self, seed: int) -> list[tuple[str, list[torch.Tensor | None]]]:
        sets = samples_mod.adversarial_inputs(self.card, seed + FRESH_INPUTS + 1, self.device)
        return [(label, t) for label, t in sets if not (self.finite and label.startswith(("nonfinite", "denormal")))]

    def near_duplicate(self, s: InputSet, seed: int) -> tuple[str, list[torch.Tensor | None]]:
        views = [None if g is None else g.view for g in s.inputs]
        twin = samples_mod.near_duplicate(self.card.tensor_inputs(), views, seed)
        return f"near-duplicate of the {s.label}", twin

    def prepare(self, label: str, tensors: list[torch.Tensor | None]) -> InputSet:
        metas = self.card.tensor_inputs()
        tensors = samples_mod.as_served(self.card, tensors)
        placed = [None if m is None or t is None else placed_input(m, t, self.device, self.guard_byte)
                  for m, t in zip(metas, tensors, strict=True)]
        snapshot = [None if g is None else _bits_of(g.buf).clone() for g in placed]
        try:
            ref = opcall.run_stock(self.card, [None if g is None else g.view for g in placed], self.device)
        except Exception as err:
            raise StockOpError(f"{STOCK_FAILED} on the {label}: {err}") from err
        if len(ref) != len(self.card.outputs):
            raise StockOpError(f"{STOCK_DIFFERS} {len(ref)} outputs, the card has {len(self.card.outputs)}")
        for j, (r, m) in enumerate(zip(ref, self.card.outputs, strict=True)):
            if tuple(r.shape) != m.shape or samples_mod.dtype_name(r.dtype) != m.dtype:
                raise StockOpError(f"{STOCK_DIFFERS} {samples_mod.meta_of(r).signature()} as output {j}, "
                                     f"the card says {m.signature()}")
        # kept alive, and cloned so a kernel writing into the op's own result memory changes nothing
        # a mask's excluding values (-inf, the dtype's lowest) say which slots count, not how large the
        # outputs may be: the tolerance's scale leaves them out
        rule = (self.card.fusion.block if self.card.fusion is not None else {}).get("masked_reads") or {}
        scale = judge.input_scale(g.view for k, g in enumerate(placed) if g is not None and k != rule.get("mask"))
        return InputSet(label, placed, snapshot, [r.clone() for r in ref], scale=scale)

    def exact_of(self, s: InputSet) -> list[torch.Tensor | None]:
        """Stock's outputs computed in float64 from the same inputs (`judge.kernel_mismatches` says why),
        once per input set; None for an output float64 cannot give (the op refuses float64, changes
        dtype on its own, or is not float)."""
        if s.exact is None:
            s.exact = _exact_reference(self.card, s, self.device)
        return s.exact

    def call(self, inputs: list[Guarded | None], outputs: list[Guarded]) -> KernelCall:
        stream = self.side.cuda_stream if self.cuda else None
        views = [None if g is None else g.view for g in inputs]
        if self.writes:
            return LiftedCall(self.fn, views, [g.view for g in outputs], self.scalars, stream, self.writes)
        return KernelCall(self.fn, views, [g.view for g in outputs], self.scalars, stream)

    def counted(self, n: int = 1) -> None:
        """Counts calls, in this harness and for the loaded kernel across requests."""
        self.calls += n
        self.history["calls"] += n
        if self.history["first"] is None:
            self.history["first"] = time.monotonic()

    def fill(self, outs: list[Guarded], run: int, kind: str, stale: list[torch.Tensor] | None = None) -> list[Fill]:
        return [self.poison.fill(o, run, kind, None if stale is None else stale[j]) for j, o in enumerate(outs)]

    def hold_legacy_stream(self, cycles: int = SLEEP_CYCLES) -> None:
        """CUDA: keep the legacy default stream (and with it the per-thread one) busy, so that work a
        kernel puts there lands after the snapshot of its outputs taken on the caller's stream."""
        if self.cuda:
            with torch.cuda.stream(torch.cuda.default_stream(self.device)):
                torch.cuda._sleep(cycles)

    # one run: filled outputs, the call, a snapshot of the outputs taken right after it on the stream
    def run(self, s: InputSet, run: int, kind: str = "nan", stale: list[torch.Tensor] | None = None
            ) -> tuple[int, list[Guarded], list[torch.Tensor], list[Fill], KernelCall]:
        outs = [guarded(m, self.device) for m in self.card.outputs]
        fills = self.fill(outs, run, kind, stale)
        call = self.call(s.inputs, outs)
        self.hold_legacy_stream()
        rc = call()
        self.counted()
        snaps = [o.buf.clone() for o in outs] if self.cuda else [o.buf for o in outs]
        if self.cuda:
            self.side.synchronize()
        return rc, outs, snaps, fills, call

    def check_run(self, s: InputSet, fills: list[Fill], outs: list[Guarded], snaps: list[torch.Tensor],
                  inputs: list[Guarded | None], snapshot: list[torch.Tensor | None], what: str,
                  call: KernelCall | None = None) -> Failure | None:
        where = f"{s.label}, {what}"
        if call is not None and not call.unchanged():
            return fail("mutates-input", f"changed its call descriptor (tensor, scalar or call struct) on the {where}: "
                                         "descriptors are const", input_set=s.label, descriptor=True)
        for i, (g, before) in enumerate(zip(inputs, snapshot, strict=True)):
            if g is None:
                continue
            changed = g.bits != _bits_of(before)
            if bool(changed.any()):
                inside = int(changed[view_mask(g)].sum())
                outside = int(changed.sum()) - inside
                return fail("mutates-input", f"changed input {i} ({inside} elements of the tensor, {outside} around "
                                             f"it) on the {where}", input=i, changed_inside=inside,
                            changed_around=outside, input_set=s.label)
        for j, (o, snap, filled) in enumerate(zip(outs, snaps, fills, strict=True)):
            bits = _bits_of(snap)
            outside = int(((bits != filled) & outside_mask(o)).sum())  # elementwise: cheaper than a masked select
            if outside:
                before = int((bits[: o.start] != (filled if isinstance(filled, int) else filled[: o.start])).sum())
                return fail("mismatch", f"wrote outside its output: {outside} elements around output {j} changed "
                                        f"({before} before it) on the {where}", output=j, written_outside=outside,
                            input_set=s.label)
            view = torch.as_strided(snap, o.meta.shape, o.meta.stride, o.start)
            pview = _view_of(o, filled)
            unwritten = (_bits_of(view) == pview) & (_bits_of(s.reference[j].to(view.dtype)) != pview)
            if bool(unwritten.any()):
                unwritten &= ~_close_to(view, s.reference[j], self.judged[j], _input_scale(s))
            count = int(unwritten.sum())
            if count:
                flat = int(unwritten.reshape(-1).nonzero()[0])
                return fail("mismatch", f"left {count} of {o.meta.numel} elements of output {j} unwritten on the "
                                        f"{where}", output=j, unwritten=count, of=o.meta.numel,
                            first_index=_index(flat, o.meta.shape), input_set=s.label)
            diag = compare(view, s.reference[j], self.judged[j], is_statistic(self.card.op, j), _input_scale(s))
            if diag is not None and o.meta.dtype in FLOAT_DTYPES:
                diag = compare(view, s.reference[j], self.judged[j], is_statistic(self.card.op, j), _input_scale(s),
                               self.exact_of(s)[j])
            if diag is not None:
                return fail("mismatch", _mismatch_reason(j, diag, where), output=j, input_set=s.label, **diag)
            self.max_err[j] = max(self.max_err.get(j, 0.0), _max_error(view, s.reference[j], self.judged[j]))
        return None

    def check_same(self, s: InputSet, snaps: list[torch.Tensor], outs: list[Guarded], what: str) -> Failure | None:
        for j, (o, snap) in enumerate(zip(outs, snaps, strict=True)):
            view = torch.as_strided(snap, o.meta.shape, o.meta.stride, o.start)
            differ = _bits_of(view) != _bits_of(s.first_run[j])
            count = int(differ.sum())
            if count:
                flat = int(differ.reshape(-1).nonzero()[0])
                idx = tuple(_index(flat, o.meta.shape))
                return fail("nondeterministic", f"{what} gave different bits in {count} elements of output {j} on "
                                                f"the {s.label}", output=j, differing=count, first_index=list(idx),
                            first=_scalar(s.first_run[j][idx]), then=_scalar(view[idx]), input_set=s.label)
        return None

    def eager_runs(self, s: InputSet, stale: list[torch.Tensor] | None, runs: int = RUNS) -> Failure | None:
        """`runs` runs into new buffers: a NaN fill first, then random values, then another set's result."""
        kinds = ("nan", "garbage", "stale" if stale is not None else "garbage")
        for run in range(runs):
            rc, outs, snaps, fills, call = self.run(s, run, kinds[run % len(kinds)], stale)
            what = f"run {run + 1}"
            if rc != 0:
                return fail("crash", f"returned {rc} on the {s.label} ({what}): the caller would fall back",
                            returned=rc, input_set=s.label)
            bad = self.check_run(s, fills, outs, snaps, s.inputs, s.snapshot, what, call)
            if bad:
                return bad
            self.late.keep(f"{s.label}, {what}", outs, snaps)
            if s.first_run is None:
                s.first_run = [torch.as_strided(sn, o.meta.shape, o.meta.stride, o.start).clone()
                               for o, sn in zip(outs, snaps, strict=True)]
                continue
            bad = self.check_same(s, snaps, outs, f"{what} on the same inputs")
            if bad:
                return bad
        return None

    def reuse_runs(self, sets: list[InputSet]) -> Failure | None:
        """Same pointers, new values: on CUDA through a CUDA graph captured once and replayed."""
        metas = self.card.tensor_inputs()
        first = sets[0]
        inputs = [None if g is None else placed_input(m, g.view, self.device, self.guard_byte)
                  for m, g in zip(metas, first.inputs, strict=True)]
        outs = [guarded(m, self.device) for m in self.card.outputs]
        self.fill(outs, 0, "nan")
        call = self.call(inputs, outs)
        replay, what = call, "a second call with the same buffers"
        if self.cuda:
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, stream=self.side):
                    rc = call()
            except Exception as err:
                return fail("crash", f"failed under CUDA graph capture (host synchronisation, a copy, or work "
                                     f"outside the caller's stream): {_first_line(err)}", error=str(err))
            if rc != 0:
                return fail("crash", f"returned {rc} under CUDA graph capture", returned=rc)
            replay, what = _Replay(graph), "CUDA graph replay"
        for k, s in enumerate(_reuse_order(sets)):
            run = k + 1
            for g, src in zip(inputs, s.inputs, strict=True):
                if g is not None:
                    g.window.copy_(src.window)
            snapshot = [None if g is None else _bits_of(g.buf).clone() for g in inputs]
            fills = self.fill(outs, run, self.rng.choice(("nan", "garbage")))
            self.hold_legacy_stream()
            rc = replay()
            self.counted()
            snaps = [o.buf.clone() for o in outs] if self.cuda else [o.buf for o in outs]
            if self.cuda:
                self.side.synchronize()
            if rc != 0:
                return fail("crash", f"returned {rc} on the {s.label} ({what})", returned=rc, input_set=s.label)
            bad = self.check_run(s, fills, outs, snaps, inputs, snapshot, what, call if not self.cuda else None)
            if bad:
                return bad.with_diagnostics(reused_buffers=True)
            bad = self.check_same(s, snaps, outs, what)
            if bad:
                return bad
        return None


def _reuse_order(sets: list[InputSet]) -> list[InputSet]:
    """Every set once, starting with a change of values; a near-duplicate right after its original."""
    order = [s for s in sets[1:] + sets[:1] if s.twin_of is None]
    for twin in (s for s in sets if s.twin_of is not None):
        at = next((k for k, s in enumerate(order) if s.label == twin.twin_of), len(order) - 1)
        order.insert(at + 1, twin)
    return order


class _Replay:
    def __init__(self, graph):
        self.graph = graph

    def __call__(self) -> int:
        self.graph.replay()
        return 0


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:300] if text else type(err).__name__


def _mismatch_reason(j: int, diag: dict, where: str) -> str:
    if diag.get("problem") == "shape":
        return f"output {j} has shape {diag['got']}, expected {diag['expected']}"
    text = (f"output {j} differs from PyTorch in {diag['mismatched']} of {diag['of']} elements on the {where} "
            f"(at {diag['first_index']}: expected {diag['expected']}, got {diag['got']}; {diag['tolerance']}")
    if "max_abs_err" in diag:
        text += f"; max abs err {diag['max_abs_err']:.3g}"
    return text + ")"


def strict_precision(exact_sums: bool = True) -> None:
    """Stock PyTorch in strict precision: no TF32 anywhere in the reference, and with `exact_sums` no
    reduced-precision reductions in fp16/bf16 products either. By default cuBLAS may sum split-K
    partials in the half type, and the reference is then the less accurate side: on GPT-2's LM head
    at 64 rows it is 0.0037 from the fp32 product, where an fp32-accumulating kernel is 0.0020, and
    every such kernel was rejected (`benchmarks/2026-11-30-h200-packs-budget48/`). `bench` times the stock op
    as users run it (reduced reductions allowed) and checks against the exact-sum reference."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = not exact_sums
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = not exact_sums


# --- entry points --------------------------------------------------------------------------------


def verify(card: Card, fn, samples_path: Path | None, device: torch.device | str, seed: int) -> Verified | Failure:
    """Verify `fn` (a loaded `forgepack_kernel`) on the card; see the module docstring."""
    device = torch.device(device)
    strict_precision()
    h = Harness(card, fn, device, seed)
    # one intra-op thread on cpu: on a loaded machine, waking a pool for each small check costs milliseconds
    with torch.no_grad(), _on(h.side), timing.one_thread_on_cpu(device):
        sets, skipped, stale = [], [], None
        regular = h.input_sets(samples_path, seed)
        for k, (label, tensors) in enumerate(regular + h.adversarial_sets(seed)):
            try:
                s = h.prepare(label, tensors)
            except StockOpError:
                if k < len(regular):
                    raise
                skipped.append(label)  # the stock op itself refuses such values: nothing to compare with
                continue
            # an adversarial set is about its values: one run (NaN-filled) and its reuse run suffice
            bad = h.eager_runs(s, stale, RUNS if k < len(regular) else 1)
            if bad:
                return bad
            sets.append(s)
            stale = s.reference  # every set of a card has the same output layouts
            # the last two fresh inputs get near-duplicate twins: a kernel keying a cache on a sample of
            # elements escapes one twin only when a changed element lies in its sample (a few in a hundred)
            if k in (len(regular) - 3, len(regular) - 2):
                twin = h.prepare(*h.near_duplicate(s, seed + 7919 + k))
                twin.twin_of = s.label
                bad = h.eager_runs(twin, stale, 1)
                if bad:
                    return bad
                sets.append(twin)
        bad = h.reuse_runs(sets)
        if bad:
            return bad
        if h.cuda:
            torch.cuda.synchronize(device)
        bad = h.late.check(sets)
        if bad:
            return bad
    return Verified(
        input_sets=tuple(s.label for s in sets),
        max_abs_err={str(j): e for j, e in h.max_err.items()},
        tolerances={str(j): tolerances.describe(d) for j, d in enumerate(judged_dtypes(card))},
        calls=h.calls,
        skipped_sets=tuple(skipped),
    )


class TimedCalls:
    """The kernel side of the benchmark: every call, timed or not, looks like a verification call.

    Before each call (outside the timed region) its output buffers are filled with a fresh pattern and
    its descriptors built anew; after it, the output is compared bitwise with the verified result and
    the descriptors with what was passed; on CUDA the legacy stream is held busy across each call. The
    calls in `full` (a random subset) get new buffers and the complete verification check, and their
    buffers are kept for the late re-check; the others rotate through RING buffer sets.
    """

    def __init__(self, h: Harness, s: InputSet, total: int, stale: list[torch.Tensor]):
        self.h, self.s, self.stale = h, s, stale
        self.ring = [[guarded(m, h.device) for m in h.card.outputs] for _ in range(RING)]
        self.full = set(h.rng.sample(range(total), min(FULL_CHECKS, total)))
        self.i = 0
        self.checked = 0
        self.outs: list[Guarded] = []
        self.fills: list[Fill] = []
        self.prepared: KernelCall | None = None
        self.sleep = SLEEP_CYCLES

    def before(self) -> None:
        full = self.i in self.full
        self.outs = [guarded(m, self.h.device) for m in self.h.card.outputs] if full else self.ring[self.i % RING]
        kind = self.h.rng.choice(("nan", "nan", "garbage", "stale"))
        self.fills = self.h.fill(self.outs, 1000 + self.i, kind, self.stale)
        self.prepared = self.h.call(self.s.inputs, self.outs)
        self.hold()

    def hold(self) -> None:
        """Every call, the stock op's too: work a kernel puts on the legacy or per-thread default stream
        is still missing when the call's end event completes and its output is snapshotted."""
        self.h.hold_legacy_stream(self.sleep)

    def __call__(self) -> None:
        rc = self.prepared()
        if rc != 0:
            raise KernelFailed(rc)

    def after(self, timed_us: float | None = None) -> None:
        """Checks the call just made; raises `CheckFailed` with the failure."""
        h, s, i = self.h, self.s, self.i
        h.counted()
        snaps = [o.buf.clone() for o in self.outs] if h.cuda else [o.buf for o in self.outs]
        if h.cuda:
            h.side.synchronize()
        if timed_us is not None:  # the held legacy stream outlasts flush, call and snapshot (~2000 cycles a us)
            self.sleep = max(self.sleep, SLEEP_CYCLES + int(timed_us * 4000))
        what = f"timed call {i + 1}" if timed_us is not None else f"call {i + 1} of the benchmark"
        if i in self.full:
            bad = h.check_run(s, self.fills, self.outs, snaps, s.inputs, s.snapshot, what, self.prepared)
            bad = bad or h.check_same(s, snaps, self.outs, what)
            if bad is None:
                self.checked += 1
                h.late.keep(f"{s.label}, {what}", self.outs, snaps)
        else:
            bad = self._bitwise(snaps, what)
        self.i += 1
        if bad:
            raise CheckFailed(bad.with_diagnostics(during="benchmark", call=i + 1))

    def _bitwise(self, snaps: list[torch.Tensor], what: str) -> Failure | None:
        """The output equals the verified result bit for bit, the guards kept their fill, inputs and
        descriptors are unchanged (cheap: no tolerance, no masks)."""
        if not self.prepared.unchanged():
            return fail("mutates-input", f"changed its call descriptor on the {self.s.label}, {what}: descriptors "
                                         "are const", input_set=self.s.label, descriptor=True)
        for j, (o, snap, filled) in enumerate(zip(self.outs, snaps, self.fills, strict=True)):
            view = torch.as_strided(snap, o.meta.shape, o.meta.stride, o.start)
            if not torch.equal(_bits_of(view), _bits_of(self.s.first_run[j])):
                return self.h.check_run(self.s, self.fills, self.outs, snaps, self.s.inputs, self.s.snapshot, what) \
                    or self.h.check_same(self.s, snaps, self.outs, what)
            bits, end = _bits_of(snap), o.start + o.meta.span()
            head = filled if isinstance(filled, int) else filled[: o.start]
            tail = filled if isinstance(filled, int) else filled[end:]
            if bool((bits[: o.start] != head).any()) or bool((bits[end:] != tail).any()):
                return self.h.check_run(self.s, self.fills, self.outs, snaps, self.s.inputs, self.s.snapshot, what)
        for g, before in zip(self.s.inputs, self.s.snapshot, strict=True):
            if g is not None and not torch.equal(g.bits, _bits_of(before)):
                return self.h.check_run(self.s, self.fills, self.outs, snaps, self.s.inputs, self.s.snapshot, what)
        return None

    def untimed(self) -> None:
        self.before()
        self()
        self.after()


class CheckFailed(Exception):
    def __init__(self, failure: Failure):
        super().__init__(failure.reason)
        self.failure = failure


def bench(card: Card, fn, samples_path: Path | None, device: torch.device | str, seed: int,
          reps: int = BENCH_REPS, placement: int = 0, serving_us: float = 0.0) -> Timed | Failure:
    """Stock op vs kernel, interleaved (`timing.compare`), on a captured sample (else a fresh input).

    Both run on the same guarded inputs and, on CUDA, on the side stream verification uses. Every
    kernel call is checked (`TimedCalls`); then come the late calls and checks (module docstring).
    `placement` > 0 puts this benchmark's buffers elsewhere in memory (`_placed_apart`). `serving_us`
    (a CPU fusion card's serving cost, `forgepack.servecost`) is added to every timed kernel call.
    """
    device = torch.device(device)
    strict_precision()
    h = Harness(card, fn, device, seed)
    card = h.card  # written inputs lifted to outputs (`lifted`): the stock chain returns them too
    with torch.no_grad(), _on(h.side), timing.one_thread_on_cpu(device), _placed_apart(placement, seed, device):
        have = samples_path is not None and Path(samples_path).exists()
        sets = samples_mod.load_samples(h.source, Path(samples_path), device) if have else []
        label = "captured sample 0" if sets else f"fresh input (seed {seed})"
        s = h.prepare(label, sets[0][0] if sets else samples_mod.fresh_inputs(card, seed, device))
        bad = h.eager_runs(s, None)  # the verified result every benchmark call must reproduce bitwise
        if bad:
            return bad.with_diagnostics(during="benchmark")
        stock_call = opcall.served_stock_call(card, [None if g is None else g.view for g in s.inputs], device)
        other = opcall.run_stock(card, samples_mod.fresh_inputs(card, seed + 1, device), device)
        warmup = 3
        calls = TimedCalls(h, s, reps + warmup, other)  # another input's result: "stale" outputs

        def stock() -> None:
            stock_call()

        strict_precision(exact_sums=False)  # the stock op is timed as users run it
        try:
            result = timing.compare(stock, calls, device, reps=reps, warmup=warmup, seed=seed % (1 << 31),
                                    before_b=calls.before, after_b=calls.after, before_a=calls.hold,
                                    b_added_us=serving_us)
        except KernelFailed as err:
            return fail("crash", f"returned {err.code} during the benchmark", returned=err.code)
        except CheckFailed as err:
            return err.failure
        finally:
            strict_precision()
        bad = _late_phase(h, s, calls, result.b_us - serving_us)
        if bad:
            return bad.with_diagnostics(during="after the benchmark")
    return Timed(result.a_us, result.b_us, result.speedup, result.ci_low, result.ci_high, result.reps, label,
                 checked=calls.checked, calls=h.history["calls"], serving_us=serving_us)


def _late_phase(h: Harness, s: InputSet, calls: TimedCalls, kernel_us: float) -> Failure | None:
    """More calls until the kernel has made MIN_CALLS in this evaluation (fewer for a kernel whose own
    time for them would pass LATE_CALLS_BUDGET_S), a wait until LATE_AFTER_S after its first call,
    one more fully checked call, then every kept buffer again."""
    calls.full = set()
    affordable = int(LATE_CALLS_BUDGET_S * 1e6 / max(kernel_us, 1.0))  # by the kernel's time: load-independent
    try:
        for _ in range(min(MIN_CALLS - h.history["calls"], affordable)):
            calls.untimed()
        wait = h.history["first"] + LATE_AFTER_S - time.monotonic()
        if wait > 0:
            select.select([], [], [], wait)  # not a sleep syscall: the worker's sandbox forbids those
        calls.full = {calls.i}
        calls.untimed()
    except KernelFailed as err:
        return fail("crash", f"returned {err.code} after the timed calls", returned=err.code)
    except CheckFailed as err:
        return err.failure
    if h.cuda:
        torch.cuda.synchronize(h.device)
    return h.late.check([s])


@contextlib.contextmanager
def _placed_apart(placement: int, seed: int, device: torch.device):
    """Holds a spacer of a drawn size (1-9 MiB, page-granular) while the benchmark allocates, so its inputs
    and outputs land at other addresses than the last benchmark of the same sizes got (the caching
    allocator would hand back the same blocks). The same small op timed in two H200 builds moved by up
    to a quarter while each build's interval stayed tight, and one benchmark's interval cannot see that;
    so `familyeval` times a point that loses again, placed elsewhere and on fresh inputs, before acting
    on the loss (benchmarks/2026-12-04-h200-envelope-confirmed-loss: stock's time moved most)."""
    if placement <= 0:
        yield
        return
    rng = random.Random(seed * 7919 + placement)
    spacer = torch.empty(rng.randrange(1 << 20, 9 << 20, 4096), dtype=torch.uint8, device=device)
    try:
        yield
    finally:
        del spacer


class _on:
    """`torch.cuda.stream(side)` when there is a side stream; nothing on cpu."""

    def __init__(self, stream):
        self.ctx = torch.cuda.stream(stream) if stream is not None else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)
        return False
