"""Re-verify every kernel of this pack on this machine, against stock PyTorch.

For each variant: fresh random inputs drawn from the manifest's recorded metadata (`fresh.draw`, as
the build's verifier draws them: exact dtypes, sizes, strides and storage offsets; values with the
captured mean, spread and sign), plus one input with inf, -inf and NaN planted; the stock op runs
with the pack deactivated (strict fp32: no TF32), then the same call with the pack active must hit
the variant's kernel, give stock's output layout and match under the manifest's tolerance as the
verifier judged it (`compare.kernel_mismatch`): |out - ref| <= atol * m + rtol * |ref|, m the
largest finite magnitude of stock's output and the inputs; NaN and infinities in the same places
(a normalisation's mean or rstd: non-finite where stock's is); integers and bools exact.
Imports only torch and the standard library.
"""

from __future__ import annotations

import sys

import torch

from . import compare as judge
from . import stockcall
from .fresh import draw, generator
from .packinfo import OutputTolerance, VariantInfo
from .tolerances import Tolerance, is_statistic

FRESH_INPUTS = 3


def inputs(variant: VariantInfo, seed: int, device: torch.device, edge: bool) -> list[torch.Tensor | None]:
    """Tensor inputs in the kernel ABI's order (schema order, lists flattened, None kept)."""
    gen = generator(seed, device)
    out: list[torch.Tensor | None] = []
    for a in variant.args:
        if a.kind == "tensor":
            out.append(draw(a.tensor, gen, device, edge))
        elif a.kind == "tensors":
            out.extend(draw(t, gen, device, edge) for t in a.tensors)
        elif a.kind == "none":
            out.append(None)
    return out


def call_args(variant: VariantInfo, func, tensors: list, device: torch.device) -> tuple[list, dict]:
    return stockcall.call_args(func, [a.recorded() for a in variant.args], tensors, device)


def _layout(t: torch.Tensor) -> str:
    return f"{t.dtype}{list(t.shape)} strides {list(t.stride())}"


def compare(out: torch.Tensor, ref: torch.Tensor, tol: OutputTolerance, input_scale: float = 0.0,
            statistic: bool = False) -> tuple[str | None, float]:
    """(what is wrong or None, max abs error over finite elements): the layout stock gives, and the
    values under the manifest's tolerance, judged as the build's verifier judged them
    (`compare.kernel_mismatch`)."""
    if _layout(out) != _layout(ref):
        return f"got {_layout(out)}, stock gives {_layout(ref)}", float("inf")
    rule = None if tol.exact else Tolerance(tol.rtol, tol.atol)
    problem = judge.kernel_mismatch(out, ref, rule, input_scale, statistic)
    return problem or None, judge.max_abs_error(out, ref) if out.is_floating_point() else 0.0


# The reference's precision, as the build's verifier had it: no TF32, and fp16/bf16 products summed in
# fp32 (cuBLAS may otherwise reduce split-K partials in the half type, the less accurate side).
_STRICT = ((torch.backends.cuda.matmul, "allow_tf32"), (torch.backends.cudnn, "allow_tf32"),
           (torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction"),
           (torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction"))


def _strict_precision() -> list:
    saved = [getattr(owner, name) for owner, name in _STRICT]
    for owner, name in _STRICT:
        setattr(owner, name, False)
    return saved


def _restore_precision(saved: list) -> None:
    for (owner, name), value in zip(_STRICT, saved, strict=True):
        setattr(owner, name, value)


def check_variant(pack, variant: VariantInfo, device: torch.device, seeds: int) -> tuple[str, int, float]:
    """(problem or "", input sets checked, max abs error) for one variant."""
    func = stockcall.resolve(variant.op)
    sets = [(seed, False) for seed in range(seeds)] + [(seeds, True)]
    worst = 0.0
    for n, (seed, edge) in enumerate(sets, start=1):
        tensors = inputs(variant, 1000 + seed, device, edge)
        args, kwargs = call_args(variant, func, tensors, device)
        pack.deactivate()
        ref = stockcall.flatten_outputs(func(*args, **kwargs))
        pack.activate(strict=True)
        before = pack.stats()[variant.id]["hits"]
        got = stockcall.flatten_outputs(func(*args, **kwargs))
        if pack.stats()[variant.id]["hits"] != before + 1:
            return "the guard did not send its own variant to the kernel", n, worst
        scale = judge.input_scale(tensors)
        for j, (o, r) in enumerate(zip(got, ref, strict=True)):
            problem, err = compare(o, r, variant.tolerance[j], scale, is_statistic(variant.op, j))
            worst = max(worst, err)
            if problem:
                kind = "edge input" if edge else f"input {seed}"
                return f"output {j}, {kind}: {problem}", n, worst
    return "", len(sets), worst


def selftest(pack, seeds: int = FRESH_INPUTS, stream=None) -> int:
    """Print a table; 0 when every kernel passes here, 1 otherwise (or when the pack cannot run here)."""
    stream = stream or sys.stdout
    if pack.disabled():  # what the user asked for: nothing runs, so nothing is wrong
        print(f"selftest: {pack.__name__} is disabled (FORGEPACK_DISABLE is set): stock PyTorch runs, "
              "no kernel checked", file=stream)
        return 0
    try:
        pack.activate(strict=True)
    except pack.PackError as err:
        print(f"selftest: cannot activate: {err}", file=stream)
        return 1
    _, devices = pack.environment_problem()
    m = pack.manifest()
    device = torch.device("cuda", devices[0]) if m.device == "cuda" else torch.device("cpu")
    saved = _strict_precision()
    rows, failed = [], 0
    try:
        for v in m.variants:
            try:
                problem, checked, err = check_variant(pack, v, device, seeds)
            except Exception as exc:  # report every variant, whatever one of them does
                problem, checked, err = f"{type(exc).__name__}: {str(exc).splitlines()[0]}", 0, float("nan")
            failed += bool(problem)
            rows.append((v.id, v.signature, str(checked), f"{err:.2e}", problem or "ok"))
    finally:
        _restore_precision(saved)
        pack.deactivate()
    fused = pack.fused_kernels()
    # A fused kernel replaces a module's forward: it has no single stock op to be compared with here;
    # the build's gate checked it inside the model.
    rows += [(f["id"], f.get("signature", ""), "-", "-", "fused: not re-checked here (checked in the model "
              "by the build's gate)") for f in fused]
    _table(("variant", "signature", "inputs", "max abs err", "result"), rows, stream)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    n = len(rows) - len(fused)
    also = f"; {len(fused)} fused kernels not re-checked" if fused else ""
    print(f"{m.name} on {where}: {n - failed} of {n} kernels verified{also}", file=stream)
    return 1 if failed else 0


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]], stream) -> None:
    cut = [tuple(c if len(c) <= 60 else c[:59] + "…" for c in r) for r in rows]
    widths = [max(len(h), *(len(r[k]) for r in cut)) if cut else len(h) for k, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    print(line, file=stream)
    print("  ".join("-" * w for w in widths), file=stream)
    for r in cut:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)), file=stream)
