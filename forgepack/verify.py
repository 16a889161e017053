"""Verify and benchmark one compiled kernel against stock PyTorch. Runs inside the worker process.

`verify` (DESIGN.md "Evaluation", step 4), for every input set: each captured sample, five or more
fresh random inputs drawn like them, and one edge input with inf, -inf and NaN planted (seeds are
random per evaluation, so no kernel can know them in advance):

1. Inputs are placed in guarded buffers (guard zones before and after the storage window) and a copy
   of every buffer is kept. The reference is the stock op, computed before the kernel runs, with TF32
   off and fp16/bf16 products summed in fp32, and kept alive (a kernel cannot find it in freed
   memory).
2. Three runs, each into new output buffers that hold the card's exact layout inside a larger buffer,
   every byte poisoned first with a run-specific pattern (NaN payloads for floats, sentinels for ints):
   canary zones and stride gaps must keep the poison (else "wrote outside its output"); no element of
   the view may keep it (else unwritten); inputs must be bitwise unchanged (else mutates-input);
   outputs must pass `forgepack.runtime.tolerances` with NaN/Inf positions matching (else mismatch; for a
   normalisation's mean/rstd outputs NaN and inf are interchangeable, see STATISTICS_OUTPUTS); the three
   runs must be bitwise identical (else nondeterministic).
3. Reuse: one set of buffers is refilled with every set's values in turn and the kernel run again on
   the same pointers, which catches results cached by pointer. On CUDA that run is a CUDA graph
   captured once and replayed: work launched on another stream or after return is not in the graph,
   and host synchronisation fails the capture.

On CUDA everything runs on a side stream that is PyTorch's current stream, and the legacy default
stream is kept busy (a sleep kernel) while the kernel runs, so work a kernel puts there lands after
the snapshot of its outputs taken on the side stream: it shows as unwritten.

`bench` times stock vs kernel with `timing.compare` (interleaved, L2 flushed, bootstrap interval) on
one guarded input set and the same stream as verification, with the kernel's descriptors built once
outside the timed call; one more call after the timed ones is checked like a verification run, so a
kernel cannot behave in the benchmark otherwise than it did when verified.

Results are plain dicts (JSON for the parent): ``{"ok": True, ...}`` or ``{"ok": False, "category":
..., "reason": ..., "diagnostics": {...}}``. A failure of the stock op itself raises `StockOpError`.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from forgepack import opcall, timing
from forgepack import samples as samples_mod
from forgepack.cards import DTYPE_CODES, Card, TensorMeta
from forgepack.runtime import tolerances

ABI_VERSION = 1
MAX_DIMS = 8
FRESH_INPUTS = 5
RUNS = 3
GUARD_BYTES = 64 << 10  # canary zone on each side of every buffer (a multiple of 512: alignment kept)
INPUT_GUARD_BYTE = 0x3C
BENCH_REPS = 100  # interleaved pairs; cheap next to a proposer call, and tightens the interval
SLEEP_CYCLES = 2_000_000  # about 1 ms on an H200: longer than a snapshot copy takes to run

# Poison bit patterns per run, by element size: NaNs with unusual payloads for floats (a computed NaN
# is canonical, so a poisoned element is recognisable), byte sentinels otherwise.
_FLOAT_POISON = {
    "float32": (0x7FA5A5A5, 0xFFB5A5A5, 0x7FD5A5A5),
    "float16": (0x7E5A, 0xFD5A, 0x7D6B),
    "bfloat16": (0x7FA5, 0xFFB5, 0x7FD5),
    "float64": (0x7FF5A5A5A5A5A5A5, 0xFFF6A5A5A5A5A5A5, 0x7FFDA5A5A5A5A5A5),
}
_BYTE_POISON = (0xA5, 0x5A, 0xC3)
_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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
    """One prepared call: descriptors built once, so calling it costs only the foreign call."""

    def __init__(self, fn, inputs: list[torch.Tensor | None], outputs: list[torch.Tensor], scalars: list[Any],
                 stream: int | None):
        self.fn = fn
        self._inputs = (FpTensor * max(len(inputs), 1))(*[descriptor(t) for t in inputs])
        self._outputs = (FpTensor * max(len(outputs), 1))(*[descriptor(t) for t in outputs])
        self._scalars = scalar_array(scalars)
        self.call = FpCall(ABI_VERSION, len(inputs), len(outputs), len(scalars), self._inputs, self._outputs,
                           self._scalars, stream or None)
        self.ref = ctypes.byref(self.call)

    def __call__(self) -> int:
        return self.fn(self.ref)


# --- guarded buffers -----------------------------------------------------------------------------


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


def guarded(meta: TensorMeta, device: torch.device) -> Guarded:
    dtype = samples_mod.torch_dtype(meta.dtype)
    guard = GUARD_BYTES // meta.itemsize
    buf = torch.empty(guard + meta.storage_offset + meta.span() + guard, dtype=dtype, device=device)
    view = torch.as_strided(buf, meta.shape, meta.stride, guard + meta.storage_offset)
    return Guarded(meta, buf, view, guard + meta.storage_offset)


def poison_value(dtype: str, run: int) -> int:
    """The run's poison as a signed integer of the dtype's width (what `.fill_` on its bits takes)."""
    size = samples_mod.torch_dtype(dtype).itemsize
    if dtype in _FLOAT_POISON:
        raw = _FLOAT_POISON[dtype][run % 3]
    else:
        raw = int.from_bytes(bytes([_BYTE_POISON[run % 3]]) * size, "little")
    if size > 1 and raw >= 1 << (8 * size - 1):
        raw -= 1 << (8 * size)
    return raw


def poisoned_output(meta: TensorMeta, device: torch.device, run: int) -> Guarded:
    g = guarded(meta, device)
    g.bits.fill_(poison_value(meta.dtype, run))
    return g


def placed_input(meta: TensorMeta, source: torch.Tensor, device: torch.device) -> Guarded:
    """`source` (a tensor in meta's layout) copied into a guarded buffer."""
    g = guarded(meta, device)
    g.buf.view(torch.uint8).fill_(INPUT_GUARD_BYTE)
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


# --- checks --------------------------------------------------------------------------------------


def fail(category: str, reason: str, **diagnostics: Any) -> dict:
    return {"ok": False, "category": category, "reason": reason, "diagnostics": diagnostics}


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


# Outputs that are statistics of a normalisation (op -> output indices): mean and rstd/invstd. Over a
# row holding inf or NaN such a statistic is NaN or +-inf depending on the algorithm (Welford gives
# inf - inf = NaN where a two-pass sum gives inf), and the row's normalised output is NaN either way.
# There, the only promise is "not finite where stock is not finite" (see `compare`'s `stats`).
STATISTICS_OUTPUTS = {
    "aten.native_layer_norm.default": (1, 2),
    "aten.native_group_norm.default": (1, 2),
    "aten.native_batch_norm.default": (1, 2),
    "aten._native_batch_norm_legit_no_training.default": (1, 2),
    "aten.cudnn_batch_norm.default": (1, 2),
}


def is_statistic(op: str, output: int) -> bool:
    return output in STATISTICS_OUTPUTS.get(op, ())


def compare(out: torch.Tensor, ref: torch.Tensor, dtype: str, stats: bool = False) -> dict | None:
    """None when `out` matches `ref` under the dtype's tolerance; else diagnostics. `stats`: a
    normalisation statistic, where NaN and +-inf are interchangeable (both non-finite) but finite
    values must still match and non-finite must stay non-finite."""
    if out.shape != ref.shape:
        return {"problem": "shape", "expected": list(ref.shape), "got": list(out.shape)}
    if out.numel() == 0:
        return None
    tol = tolerances.tolerance(dtype)
    if tol is None:
        a = out.contiguous().view(_BITS_DTYPE[out.element_size()]) if dtype == "bool" else out
        b = ref.contiguous().view(_BITS_DTYPE[ref.element_size()]) if dtype == "bool" else ref.to(out.dtype)
        bad = a != b
    else:
        o, r = out.to(torch.float64), ref.to(torch.float64)
        close = (o - r).abs() <= tol.atol + tol.rtol * r.abs()
        same_class = ~torch.isfinite(o) & ~torch.isfinite(r) if stats else torch.isnan(o) & torch.isnan(r)
        ok = (o == r) | same_class | (torch.isfinite(o) & torch.isfinite(r) & close)
        bad = ~ok
    count = int(bad.sum())
    if count == 0:
        return None
    flat = int(bad.reshape(-1).nonzero()[0])
    where = _index(flat, tuple(out.shape))
    diag = {
        "problem": "values",
        "mismatched": count,
        "of": out.numel(),
        "tolerance": tolerances.describe(dtype),
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
    o, r = out.to(torch.float64), ref.to(torch.float64)
    both = torch.isfinite(o) & torch.isfinite(r)
    return float((o - r).abs()[both].max()) if bool(both.any()) else 0.0


# --- the harness ---------------------------------------------------------------------------------


@dataclass
class InputSet:
    label: str
    inputs: list[Guarded | None]
    snapshot: list[torch.Tensor | None]  # bitwise copies of the input buffers
    reference: list[torch.Tensor]
    first_run: list[torch.Tensor] | None = None  # run 0's outputs, for comparing later runs


class Harness:
    def __init__(self, card: Card, fn, device: torch.device):
        self.card, self.fn, self.device = card, fn, device
        self.cuda = device.type == "cuda"
        self.scalars = card.scalars()
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self.max_err: dict[int, float] = {}

    # input sets
    def input_sets(self, samples_path: Path | None, seed: int) -> list[tuple[str, list[torch.Tensor | None]]]:
        sets = []
        if samples_path is not None and Path(samples_path).exists():
            for k, (inputs, _) in enumerate(samples_mod.load_samples(self.card, Path(samples_path), self.device)):
                sets.append((f"captured sample {k}", inputs))
        for k in range(FRESH_INPUTS):
            s = seed + k
            sets.append((f"fresh input (seed {s})", samples_mod.fresh_inputs(self.card, s, self.device)))
        s = seed + FRESH_INPUTS
        edge = samples_mod.fresh_inputs(self.card, s, self.device, edge=True)
        sets.append((f"edge input with inf/-inf/NaN (seed {s})", edge))
        return sets

    def prepare(self, label: str, tensors: list[torch.Tensor | None]) -> InputSet:
        metas = self.card.tensor_inputs()
        placed = [None if m is None or t is None else placed_input(m, t, self.device)
                  for m, t in zip(metas, tensors, strict=True)]
        snapshot = [None if g is None else g.buf.clone() for g in placed]
        try:
            ref = opcall.run_stock(self.card, [None if g is None else g.view for g in placed], self.device)
        except Exception as err:
            raise StockOpError(f"the stock op failed on the {label}: {err}") from err
        if len(ref) != len(self.card.outputs):
            raise StockOpError(f"the stock op returned {len(ref)} outputs, the card has {len(self.card.outputs)}")
        for j, (r, m) in enumerate(zip(ref, self.card.outputs, strict=True)):
            if tuple(r.shape) != m.shape or samples_mod.dtype_name(r.dtype) != m.dtype:
                raise StockOpError(f"the stock op's output {j} is {samples_mod.meta_of(r).signature()}, "
                                     f"the card says {m.signature()}")
        # kept alive, and cloned so a kernel writing into the op's own result memory changes nothing
        return InputSet(label, placed, snapshot, [r.clone() for r in ref])

    def call(self, inputs: list[Guarded | None], outputs: list[Guarded]) -> KernelCall:
        stream = self.side.cuda_stream if self.cuda else None
        return KernelCall(self.fn, [None if g is None else g.view for g in inputs], [g.view for g in outputs],
                          self.scalars, stream)

    # one run: poisoned outputs, the call, a snapshot of the outputs taken right after it on the stream
    def run(self, s: InputSet, run: int) -> tuple[int, list[Guarded], list[torch.Tensor]]:
        outs = [poisoned_output(m, self.device, run) for m in self.card.outputs]
        call = self.call(s.inputs, outs)
        if self.cuda:
            with torch.cuda.stream(torch.cuda.default_stream(self.device)):
                torch.cuda._sleep(SLEEP_CYCLES)
        rc = call()
        snaps = [o.buf.clone() for o in outs] if self.cuda else [o.buf for o in outs]
        if self.cuda:
            self.side.synchronize()
        return rc, outs, snaps

    def check_run(self, s: InputSet, run: int, outs: list[Guarded], snaps: list[torch.Tensor],
                  inputs: list[Guarded | None], snapshot: list[torch.Tensor | None], what: str) -> dict | None:
        where = f"{s.label}, {what}"
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
        for j, (o, snap) in enumerate(zip(outs, snaps, strict=True)):
            poison = poison_value(o.meta.dtype, run)
            bits = _bits_of(snap)
            mask = view_mask(o)
            outside = int((bits[~mask] != poison).sum())
            if outside:
                before = int((bits[: o.start] != poison).sum())
                return fail("mismatch", f"wrote outside its output: {outside} elements around output {j} changed "
                                        f"({before} before it) on the {where}", output=j, written_outside=outside,
                            input_set=s.label)
            view = torch.as_strided(snap, o.meta.shape, o.meta.stride, o.start)
            unwritten = (_bits_of(view) == poison) & (_bits_of(s.reference[j].to(view.dtype)) != poison)
            count = int(unwritten.sum())
            if count:
                flat = int(unwritten.reshape(-1).nonzero()[0])
                return fail("mismatch", f"left {count} of {o.meta.numel} elements of output {j} unwritten on the "
                                        f"{where}", output=j, unwritten=count, of=o.meta.numel,
                            first_index=_index(flat, o.meta.shape), input_set=s.label)
            diag = compare(view, s.reference[j], o.meta.dtype, is_statistic(self.card.op, j))
            if diag is not None:
                return fail("mismatch", _mismatch_reason(j, diag, where), output=j, input_set=s.label, **diag)
            self.max_err[j] = max(self.max_err.get(j, 0.0), _max_error(view, s.reference[j], o.meta.dtype))
        return None

    def check_same(self, s: InputSet, snaps: list[torch.Tensor], outs: list[Guarded], what: str) -> dict | None:
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

    def eager_runs(self, s: InputSet) -> dict | None:
        alive = []  # every run's buffers stay allocated, so each run writes to new addresses
        for run in range(RUNS):
            rc, outs, snaps = self.run(s, run)
            alive.append((outs, snaps))
            what = f"run {run + 1}"
            if rc != 0:
                return fail("crash", f"returned {rc} on the {s.label} ({what}): the caller would fall back",
                            returned=rc, input_set=s.label)
            bad = self.check_run(s, run, outs, snaps, s.inputs, s.snapshot, what)
            if bad:
                return bad
            if s.first_run is None:
                s.first_run = [torch.as_strided(sn, o.meta.shape, o.meta.stride, o.start).clone()
                               for o, sn in zip(outs, snaps, strict=True)]
                continue
            bad = self.check_same(s, snaps, outs, f"{what} on the same inputs")
            if bad:
                return bad
        if self.cuda:
            # stray work on the legacy stream finishes here, while `alive` still holds its buffers
            torch.cuda.synchronize(self.device)
        return None

    def reuse_runs(self, sets: list[InputSet]) -> dict | None:
        """Same pointers, new values: on CUDA through a CUDA graph captured once and replayed."""
        metas = self.card.tensor_inputs()
        first = sets[0]
        inputs = [None if g is None else placed_input(m, g.view, self.device)
                  for m, g in zip(metas, first.inputs, strict=True)]
        outs = [poisoned_output(m, self.device, 0) for m in self.card.outputs]
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
        order = sets[1:] + sets[:1]  # the first refill changes the values
        for k, s in enumerate(order):
            run = k + 1
            for g, src in zip(inputs, s.inputs, strict=True):
                if g is not None:
                    g.window.copy_(src.window)
            snapshot = [None if g is None else g.buf.clone() for g in inputs]
            for o in outs:
                o.bits.fill_(poison_value(o.meta.dtype, run))
            rc = replay()
            snaps = [o.buf.clone() for o in outs] if self.cuda else [o.buf for o in outs]
            if self.cuda:
                self.side.synchronize()
            if rc != 0:
                return fail("crash", f"returned {rc} on the {s.label} ({what})", returned=rc, input_set=s.label)
            bad = self.check_run(s, run, outs, snaps, inputs, snapshot, what)
            if bad:
                bad["diagnostics"]["reused_buffers"] = True
                return bad
            bad = self.check_same(s, snaps, outs, what)
            if bad:
                return bad
        return None


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
    every such kernel was rejected (`benchmarks/2026-11-30-h200-session5/`). `bench` times the stock op
    as users run it (reduced reductions allowed) and checks against the exact-sum reference."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = not exact_sums
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = not exact_sums


# --- entry points --------------------------------------------------------------------------------


def verify(card: Card, fn, samples_path: Path | None, device: torch.device | str, seed: int) -> dict:
    """Verify `fn` (a loaded `forgepack_kernel`) on the card; see the module docstring."""
    device = torch.device(device)
    strict_precision()
    h = Harness(card, fn, device)
    with torch.no_grad(), _on(h.side):
        sets = []
        for label, tensors in h.input_sets(samples_path, seed):
            s = h.prepare(label, tensors)
            bad = h.eager_runs(s)
            if bad:
                return bad
            sets.append(s)
        bad = h.reuse_runs(sets)
        if bad:
            return bad
        if h.cuda:
            torch.cuda.synchronize(device)
    return {
        "ok": True,
        "input_sets": [s.label for s in sets],
        "max_abs_err": {str(j): e for j, e in h.max_err.items()},
        "tolerances": {str(j): tolerances.describe(m.dtype) for j, m in enumerate(card.outputs)},
    }


def bench(card: Card, fn, samples_path: Path | None, device: torch.device | str, seed: int,
          reps: int = BENCH_REPS) -> dict:
    """Stock op vs kernel, interleaved (`timing.compare`), on a captured sample (else a fresh input).

    Both run on the same guarded inputs and, on CUDA, on the side stream verification uses, so a kernel
    cannot tell a timed call from a verified one. One more call after the timed ones is checked exactly
    like a verification run (poisoned outputs, legacy stream kept busy, snapshot on the stream).
    """
    device = torch.device(device)
    strict_precision()
    h = Harness(card, fn, device)
    with torch.no_grad(), _on(h.side):
        have = samples_path is not None and Path(samples_path).exists()
        sets = samples_mod.load_samples(card, Path(samples_path), device) if have else []
        label = "captured sample 0" if sets else f"fresh input (seed {seed})"
        s = h.prepare(label, sets[0][0] if sets else samples_mod.fresh_inputs(card, seed, device))
        stock_call = opcall.stock_call(card, [None if g is None else g.view for g in s.inputs], device)
        call = h.call(s.inputs, [poisoned_output(m, device, 0) for m in card.outputs])

        def stock() -> None:
            stock_call()

        def kernel() -> None:
            rc = call()
            if rc != 0:
                raise KernelFailed(rc)

        strict_precision(exact_sums=False)  # the stock op is timed as users run it
        try:
            result = timing.compare(stock, kernel, device, reps=reps, seed=seed % (1 << 31))
        except KernelFailed as err:
            return fail("crash", f"returned {err.code} during the benchmark", returned=err.code)
        finally:
            strict_precision()
        if h.cuda:
            torch.cuda.synchronize(device)
        rc, outs, snaps = h.run(s, 1)
        if rc != 0:
            return fail("crash", f"returned {rc} after the timed calls", returned=rc)
        bad = h.check_run(s, 1, outs, snaps, s.inputs, s.snapshot, "call after the timed ones")
        if bad:
            bad["diagnostics"]["during"] = "benchmark"
            return bad
        if h.cuda:
            torch.cuda.synchronize(device)
    return {
        "ok": True,
        "eager_us": result.a_us,
        "kernel_us": result.b_us,
        "speedup": result.speedup,
        "ci_low": result.ci_low,
        "ci_high": result.ci_high,
        "reps": result.reps,
        "input": label,
    }


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
