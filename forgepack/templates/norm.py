"""Normalisation templates: inference batch norm and group norm.

Inference batch norm is a pointwise job with the four per-channel tensors broadcast along dim 1
(`elementwise.render_pointwise`): on an NCHW tensor the channel's values are one scalar load per
vector, and the per-channel rsqrt is hoisted out of the vector loop by the compiler. The ops seen for
`F.batch_norm` in eval mode are `native_batch_norm(training=False)` on CPU, `cudnn_batch_norm`
(training=False) on CUDA with cuDNN, and `_native_batch_norm_legit_no_training` from export-style
decompositions; their saved-statistics outputs are empty in eval mode and are required to be.

Group norm is a row program (`rowreduce.render_rows`): a row is one (sample, group), i.e.
C/G * HxW contiguous elements; weight and bias are gathered per channel.
"""

from __future__ import annotations

from forgepack.cards import Card, TensorMeta
from forgepack.templates.common import FLOATS, Template, View, arg, coalesce, ctype, flit, value
from forgepack.templates.elementwise import Job, pointwise_axes, pointwise_default, render_pointwise
from forgepack.templates.rowreduce import (
    Param,
    RowProgram,
    RowTemplate,
    Step,
    build_rows,
    mean_output_steps,
    norm_steps,
)


class BatchNormTemplate(Template):
    def plan(self, card: Card, target: str):
        ins = card.tensor_inputs()
        x, w, b, rm, rv = ins[:5]
        out = card.outputs[0]
        if arg(card, "training") is not None and value(card, "training") is not False:
            return "training-mode batch norm (batch statistics) not served"
        if rm is None or rv is None:
            return "batch norm without running statistics"
        if x.dtype not in FLOATS or out.dtype != x.dtype or out.shape != x.shape:
            return "batch norm served on float32/float16/bfloat16 with output like the input"
        if len(x.shape) < 2:
            return "batch norm input needs a channel dim"
        if any(o.numel for o in card.outputs[1:]):
            return "eval batch norm whose saved statistics are not empty"
        channels = x.shape[1]
        metas, exprs = [x], {}
        for _slot, m, name in ((1, w, "w"), (2, b, "b"), (3, rm, "m"), (4, rv, "v")):
            if m is None:
                continue
            if m.dtype not in FLOATS or m.shape != (channels,):
                return f"batch norm {name} is not a float [C] tensor"
            exprs[name] = f"a{len(metas)}"
            metas.append(m)
        eps = value(card, "eps", value(card, "epsilon"))
        if not isinstance(eps, int | float) or isinstance(eps, bool):
            return "eps is not a number"
        one, zero = "1.0f", "0.0f"
        w_, b_ = exprs.get("w", one), exprs.get("b", zero)
        invstd = f"(1.0f / sqrtf({exprs['v']} + {flit(eps)}))"
        # Two ways aten computes it: CUDA's batch_norm_elementwise ((x - mean) * invstd * w + b) and
        # CPU's per-channel scale and shift (x * alpha + beta). They differ where a statistic is
        # infinite, so both are offered on cuda (cuDNN's is not documented) and the verifier picks.
        forms = {
            "sub_mul": f"(((a0 - {exprs['m']}) * {invstd}) * {w_} + {b_})",
            # aten's CPU build contracts both into FMAs (x * alpha + beta, bias - mean * alpha); with a
            # tiny running_var alpha is large and only the same rounding matches.
            "scale_shift": f"fmaf(a0, {invstd} * {w_}, fmaf(-{exprs['m']}, {invstd} * {w_}, {b_}))",
        }
        shape = x.shape
        views = [View(out.dtype, tuple(0 if n == 1 else s for n, s in zip(shape, out.stride, strict=True)), 0,
                      out.storage_offset),
                 View(x.dtype, tuple(0 if n == 1 else s for n, s in zip(shape, x.stride, strict=True)), 0,
                      x.storage_offset)]
        for m in metas[1:]:
            strides = tuple(m.stride[0] if d == 1 and shape[1] != 1 else 0 for d in range(len(shape)))
            views.append(View(m.dtype, strides, 0, m.storage_offset))
        cshape, cviews = coalesce(shape, views)
        slots = [0] + [s for s, m in ((1, w), (2, b), (3, rm), (4, rv)) if m is not None]
        return {f: [Job(cshape, cviews[0], 0, tuple(cviews[1:]), tuple(slots), e)] for f, e in forms.items()}

    def axes(self, plan, target):
        if target == "cpu":
            return {}
        return {"form": list(plan), **pointwise_axes(plan["sub_mul"], target)}

    def pick_default(self, plan, axes, target):
        if target == "cpu":
            return {}
        return {"form": "sub_mul", **pointwise_default(plan["sub_mul"], axes, target)}

    def emit(self, card, plan, target, params):
        jobs = plan[params.pop("form", "scale_shift")]
        return render_pointwise(card, target, jobs, params)


class GroupNormTemplate(RowTemplate):  # the row engine's axes, defaults and renderer
    def plan(self, card: Card, target: str):
        ins = card.tensor_inputs()
        x, w, b = ins[:3]
        out, mean, rstd = card.outputs
        if x.dtype not in FLOATS or out.dtype != x.dtype:
            return "group norm served on float32/float16/bfloat16"
        n, c, hw, g = (value(card, k) for k in ("N", "C", "HxW", "group"))
        eps = value(card, "eps")
        if not all(isinstance(v, int) and v > 0 for v in (n, c, hw, g)) or c % g:
            return "bad group norm sizes"
        if not isinstance(eps, int | float) or isinstance(eps, bool):
            return "eps is not a number"
        if not (x.is_contiguous() and out.is_contiguous() and x.numel == n * c * hw):
            return "group norm served on contiguous NC(HW) input and output"
        if mean.shape != (n, g) or rstd.shape != (n, g) or not (mean.is_contiguous() and rstd.is_contiguous()):
            return "unexpected mean/rstd outputs"
        cpg = c // g
        row = cpg * hw

        def grouped(m: TensorMeta) -> TensorMeta:
            return TensorMeta(m.dtype, (n, g, row), (c * hw, row, 1), m.storage_offset, m.device)

        built = build_rows(grouped(x), 0, 1, [(0, grouped(out))], [(1, mean), (2, rstd)])
        if isinstance(built, str):
            return built
        outer, xv, outs, routs, size, rows = built
        params, gamma, beta = [], "", ""
        for slot, m, name in ((1, w, "weight"), (2, b, "bias")):
            if m is None:
                continue
            if m.dtype not in FLOATS or m.shape != (c,):
                return f"group norm {name} is not a float [C] tensor"
            params.append(Param(slot, m.dtype, f"(g_ * {cpg}u + col / {hw}u) * {m.stride[0]}u", m.storage_offset))
            k = f"w{len(params) - 1}"
            gamma, beta = (f" * {k}", beta) if name == "weight" else (gamma, f" + {k}")
        # aten (both devices) folds the statistics into a per-channel scale and shift: x * a + b with
        # a = rstd * gamma, b = -a * mean + beta; this matters where gamma or beta is infinite. Its CUDA
        # kernel reads mean and rstd back from the outputs, in their dtype (bf16/fp16 rounding: up to
        # several output ulps where x * a and b nearly cancel, seen on the H200).
        mean_e, rstd_e = "mean_", "rstd_"
        if target == "cuda" and mean.dtype != "float32":
            t = ctype(mean.dtype, "cuda")
            mean_e, rstd_e = f"fp_ld(fp_st<{t}>(mean_))", f"fp_ld(fp_st<{t}>(rstd_))"
        scale = f"({rstd_e}{gamma})"
        affine = f"(x * {scale} + (-{scale} * {mean_e}{beta}))"
        regs, loop = norm_steps(size, float(eps), affine)
        tail = (*mean_output_steps(target, "group", size, x.dtype, 1, 1), Step("rowwrite", expr="rstd_", slot=2))
        lets = (f"const uint32_t g_ = (uint32_t)(row % {g}u); (void)g_;",
                "const float sh_ = fp_ld(p.in0[xo_]); (void)sh_;")
        return RowProgram(rows, size, outer, xv, 0, outs, routs, tuple(params), regs + tail, loop + tail, lets)


TEMPLATES = (
    BatchNormTemplate("norm.batch_norm", "norm", ("cuda", "cpu"),
                      ("aten.native_batch_norm.default", "aten._native_batch_norm_legit_no_training.default",
                       "aten.cudnn_batch_norm.default")),
    GroupNormTemplate("norm.group_norm", "norm", ("cuda", "cpu"), ("aten.native_group_norm.default",)),
)
