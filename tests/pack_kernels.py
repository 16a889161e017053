"""Hand-written, correct C++ kernels for a few tiny-llama variants (cpu target), for the pack tests.

Each entry: (op, a predicate on the card's signature, kernel source). The kernels honour the ABI in
forgepack/abi/forgepack_abi.h and read every input through its strides.
"""

from __future__ import annotations

_HEAD = '#include "forgepack_abi.h"\n#include <math.h>\n#include <stdint.h>\n'

# Element i of a descriptor, through its sizes and strides (row-major logical order).
_OFFSET = """
static inline int64_t fp_offset(const fp_tensor* t, int64_t i) {
  int64_t off = 0;
  for (int d = t->ndim - 1; d >= 0; --d) {
    off += (i % t->sizes[d]) * t->strides[d];
    i /= t->sizes[d];
  }
  return off;
}
static inline int64_t fp_numel(const fp_tensor* t) {
  int64_t n = 1;
  for (int d = 0; d < t->ndim; ++d) n *= t->sizes[d];
  return n;
}
"""


def unary(expr: str) -> str:
    return _HEAD + _OFFSET + f"""
FP_EXPORT int32_t forgepack_kernel(const fp_call* c) {{
  if (c->abi_version != FP_ABI_VERSION || c->n_inputs != 1 || c->n_outputs != 1) return FP_ERR_ABI;
  const float* x = (const float*)c->inputs[0].data;
  float* y = (float*)c->outputs[0].data;
  int64_t n = fp_numel(&c->outputs[0]);
  for (int64_t i = 0; i < n; ++i) {{
    float v = x[fp_offset(&c->inputs[0], i)];
    y[fp_offset(&c->outputs[0], i)] = {expr};
  }}
  return FP_OK;
}}
"""


def binary(expr: str) -> str:
    return _HEAD + _OFFSET + f"""
FP_EXPORT int32_t forgepack_kernel(const fp_call* c) {{
  if (c->abi_version != FP_ABI_VERSION || c->n_inputs != 2 || c->n_outputs != 1) return FP_ERR_ABI;
  const float* a = (const float*)c->inputs[0].data;
  const float* b = (const float*)c->inputs[1].data;
  float* y = (float*)c->outputs[0].data;
  int64_t n = fp_numel(&c->outputs[0]);
  for (int64_t i = 0; i < n; ++i) {{
    float u = a[fp_offset(&c->inputs[0], i)], v = b[fp_offset(&c->inputs[1], i)];
    y[fp_offset(&c->outputs[0], i)] = {expr};
  }}
  return FP_OK;
}}
"""


# x + other * alpha, `other` a Python number (scalar 0) and alpha scalar 1
ADD_SCALAR = _HEAD + _OFFSET + """
FP_EXPORT int32_t forgepack_kernel(const fp_call* c) {
  if (c->abi_version != FP_ABI_VERSION || c->n_inputs != 1 || c->n_outputs != 1 || c->n_scalars != 2) return FP_ERR_ABI;
  const float* x = (const float*)c->inputs[0].data;
  float* y = (float*)c->outputs[0].data;
  float add = (float)(c->scalars[0].f * c->scalars[1].f);
  int64_t n = fp_numel(&c->outputs[0]);
  for (int64_t i = 0; i < n; ++i) y[fp_offset(&c->outputs[0], i)] = x[fp_offset(&c->inputs[0], i)] + add;
  return FP_OK;
}
"""

# mean over the last dim, keepdim: [..., n] -> [..., 1]
MEAN_LAST = _HEAD + _OFFSET + """
FP_EXPORT int32_t forgepack_kernel(const fp_call* c) {
  if (c->abi_version != FP_ABI_VERSION || c->n_inputs != 1 || c->n_outputs != 1) return FP_ERR_ABI;
  const fp_tensor* in = &c->inputs[0];
  const float* x = (const float*)in->data;
  float* y = (float*)c->outputs[0].data;
  int64_t n = in->sizes[in->ndim - 1];
  int64_t rows = fp_numel(in) / n;
  for (int64_t r = 0; r < rows; ++r) {
    double s = 0;
    for (int64_t k = 0; k < n; ++k) s += x[fp_offset(in, r * n + k)];
    y[fp_offset(&c->outputs[0], r)] = (float)(s / n);
  }
  return FP_OK;
}
"""

# cat of two 4-d tensors along the last dim
CAT_LAST = _HEAD + _OFFSET + """
FP_EXPORT int32_t forgepack_kernel(const fp_call* c) {
  if (c->abi_version != FP_ABI_VERSION || c->n_inputs != 2 || c->n_outputs != 1) return FP_ERR_ABI;
  const fp_tensor* o = &c->outputs[0];
  float* y = (float*)o->data;
  int64_t n = fp_numel(o), last = o->sizes[o->ndim - 1], split = c->inputs[0].sizes[o->ndim - 1];
  for (int64_t i = 0; i < n; ++i) {
    int64_t row = i / last, col = i % last;
    const fp_tensor* src = col < split ? &c->inputs[0] : &c->inputs[1];
    int64_t w = src->sizes[o->ndim - 1];
    int64_t j = row * w + (col < split ? col : col - split);
    y[fp_offset(o, i)] = ((const float*)src->data)[fp_offset(src, j)];
  }
  return FP_OK;
}
"""

SLOW_MUL = _HEAD + _OFFSET + """
#include <time.h>
FP_EXPORT int32_t forgepack_kernel(const fp_call* c) {
  if (c->abi_version != FP_ABI_VERSION || c->n_inputs != 2 || c->n_outputs != 1) return FP_ERR_ABI;
  struct timespec t = {0, 3000000};  /* correct, but 3 ms slower than it needs to be */
  nanosleep(&t, 0);
  const float* a = (const float*)c->inputs[0].data;
  const float* b = (const float*)c->inputs[1].data;
  float* y = (float*)c->outputs[0].data;
  int64_t n = fp_numel(&c->outputs[0]);
  for (int64_t i = 0; i < n; ++i)
    y[fp_offset(&c->outputs[0], i)] = a[fp_offset(&c->inputs[0], i)] * b[fp_offset(&c->inputs[1], i)];
  return FP_OK;
}
"""

# A kernel that always declines: the shim must then serve the call with the stock kernel.
DECLINE = _HEAD + """
FP_EXPORT int32_t forgepack_kernel(const fp_call* c) { (void)c; return FP_ERR_UNSUPPORTED; }
"""

SILU = unary("v / (1.0f + expf(-v))")
WRONG_SILU = unary("1.02f * v / (1.0f + expf(-v))")  # 2% off: a kernel the gate must refuse
RSQRT = unary("1.0f / sqrtf(v)")
POW2 = unary("v * v")
MUL = binary("u * v")

# (op, signature the card must have, source): the tiny-llama variants these kernels serve
KERNELS = [
    ("aten.silu.default", "f32[1,32,128]", SILU),
    ("aten.mul.Tensor", "f32[1,32,128], f32[1,32,128]", MUL),
    ("aten.rsqrt.default", "f32[1,32,1]", RSQRT),
    ("aten.add.Tensor", "f32[1,32,1], other=1e-06, alpha=1", ADD_SCALAR),
    ("aten.mean.dim", "f32[1,32,64], dim=[-1], keepdim=True", MEAN_LAST),
    ("aten.pow.Tensor_Scalar", "f32[1,32,64], exponent=2", POW2),
    ("aten.cat.default", "[f32[1,4,32,8]:(1024,8,32,1),f32[1,4,32,8]:(2048,16,64,1)], dim=-1", CAT_LAST),
]


# CUDA kernels for the same variants (contiguous fp32), for the GPU tests
_CUDA_HEAD = '#include "forgepack_abi.h"\n#include <cuda_runtime.h>\n'


def cuda_elementwise(n_inputs: int, expr: str) -> str:
    params = ", ".join(f"const float* __restrict__ x{i}" for i in range(n_inputs))
    loads = " ".join(f"float v{i} = x{i}[i];" for i in range(n_inputs))
    args = ", ".join(f"(const float*)c->inputs[{i}].data" for i in range(n_inputs))
    return _CUDA_HEAD + f"""
__global__ void k({params}, float* __restrict__ y, int n) {{
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {{ {loads} y[i] = {expr}; }}
}}
FP_EXPORT int32_t forgepack_kernel(const fp_call* c) {{
  if (c->abi_version != FP_ABI_VERSION || c->n_inputs != {n_inputs} || c->n_outputs != 1) return FP_ERR_ABI;
  int n = 1;
  for (int d = 0; d < c->outputs[0].ndim; ++d) n *= (int)c->outputs[0].sizes[d];
  k<<<(n + 255) / 256, 256, 0, (cudaStream_t)c->stream>>>({args}, (float*)c->outputs[0].data, n);
  return (int32_t)cudaGetLastError();
}}
"""


CUDA_KERNELS = [
    ("aten.silu.default", "f32[1,32,128]", cuda_elementwise(1, "v0 / (1.0f + expf(-v0))")),
    ("aten.mul.Tensor", "f32[1,32,128], f32[1,32,128]", cuda_elementwise(2, "v0 * v1")),
    ("aten.rsqrt.default", "f32[1,32,1]", cuda_elementwise(1, "1.0f / sqrtf(v0)")),
]

# A correct silu that spins first: 16 dependent FMAs per output element in every thread (about 150 us on
# an H100 for the tiny Llama's 4096 elements, against a few us for stock's), so a model served with it is
# slower by construction; `acc` never reaches -1, but the compiler cannot know it and keeps the loop.
SLOW_CUDA_SILU = _CUDA_HEAD + """
__global__ void k(const float* __restrict__ x, float* __restrict__ y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  float acc = 0.0f;
  for (int j = 0; j < n * 16; ++j) acc = fmaf(acc, 0.9999999f, 1e-7f);
  if (i < n) { float v = x[i]; y[i] = acc == -1.0f ? 0.0f : v / (1.0f + expf(-v)); }
}
FP_EXPORT int32_t forgepack_kernel(const fp_call* c) {
  if (c->abi_version != FP_ABI_VERSION || c->n_inputs != 1 || c->n_outputs != 1) return FP_ERR_ABI;
  int n = 1;
  for (int d = 0; d < c->outputs[0].ndim; ++d) n *= (int)c->outputs[0].sizes[d];
  const float* x = (const float*)c->inputs[0].data;
  k<<<(n + 255) / 256, 256, 0, (cudaStream_t)c->stream>>>(x, (float*)c->outputs[0].data, n);
  return (int32_t)cudaGetLastError();
}
"""


# --- a tiny-llama workspace with accepted kernels ---------------------------------------------------------


def tiny_llama_workspace(root, entries=KERNELS, margin: float = -0.99, target: str = "cpu"):
    """Capture tiny-llama into a fresh workspace, then run each kernel through the real evaluator
    (verify + benchmark; a negative margin accepts correct kernels however fast) and write accepted.json
    the way the search does: the verified object copied into the workspace."""
    import dataclasses
    from pathlib import Path

    from forgepack import capture, models, samples
    from forgepack import recipe as recipe_mod
    from forgepack.accepted import save_all
    from forgepack.evaluate import Evaluator
    from forgepack.workspace import Workspace

    recipe = recipe_mod.resolve("tiny-llama")
    if target != recipe.target.device:
        recipe = recipe.replace(target={"device": target})
    ws = Workspace(Path(root)).create()
    with models.quiet_transformers():
        lm = models.load(recipe)
        cap = capture.capture(lm.model, lm.forward)
    cards = []
    for card in cap.cards:
        kept = samples.save_samples(ws.sample_path(card.id), cap.samples[card.id])
        cards.append(dataclasses.replace(card, samples=kept))
        ws.save_card(cards[-1])
    accepted = []
    with Evaluator(target) as evaluator:
        for op, sig, source in entries:
            card = find_card(cards, op, sig)
            verdict = evaluator.evaluate(card, source, samples_path=ws.sample_path(card.id), margin=margin)
            assert verdict.accepted, f"{card.id}: {verdict.reason}"
            accepted.append(_record(ws, card, source, verdict.binary, verdict.source_hash, verdict.speedup,
                                    verdict.ci_low, verdict.ci_high, verdict.eager_us, verdict.kernel_us,
                                    target=target))
    save_all(ws.root, accepted)
    return ws, recipe, cards


def find_card(cards, op: str, signature: str):
    found = [c for c in cards if c.op == op and c.signature() == signature]
    assert len(found) == 1, f"no single tiny-llama card {op} {signature}"
    return found[0]


def _record(ws, card, source, binary, digest, speedup, ci_low, ci_high, eager_us, kernel_us, proposer="manual",
            target="cpu"):
    import shutil

    from forgepack.accepted import AcceptedKernel
    from forgepack.compile import default_arch

    rel_bin = f"kernels/{card.id}/{digest[:16]}.so"
    rel_src = f"kernels/{card.id}/{digest[:16]}{'.cu' if target == 'cuda' else '.cpp'}"
    (ws.root / rel_bin).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(binary, ws.root / rel_bin)
    (ws.root / rel_src).write_text(source)
    arch = default_arch() if target == "cuda" else None
    return AcceptedKernel(card.id, target, arch, rel_src, rel_bin, digest, speedup, ci_low, ci_high, eager_us,
                          kernel_us, proposer)


def add_unchecked(ws, card, source: str, speedup: float = 2.0, proposer: str = "manual:unchecked"):
    """An accepted record for a kernel that did NOT go through the evaluator: how the gate's own checks
    are tested (a kernel that slipped past per-op verification must still not break the model)."""
    import hashlib

    from forgepack.accepted import load_all, save_all
    from forgepack.compile import compile_kernel

    compiled = compile_kernel(source, "cpu")
    assert compiled.ok, compiled.log
    digest = hashlib.sha256(source.encode()).hexdigest()
    rest = [k for k in load_all(ws.root) if k.card_id != card.id]
    save_all(ws.root, [*rest, _record(ws, card, source, compiled.binary, digest, speedup, speedup, speedup,
                                      10.0, 10.0 / speedup, proposer)])


# --- ops with many kinds of arguments, for the guard code generation --------------------------------------


def signature_cases():
    """(name, op, args, kwargs, args and kwargs of a call the guard must reject). Deterministic."""
    import torch

    g = torch.Generator().manual_seed(0)

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    aten = torch.ops.aten
    x, y = r(4, 8), r(4, 8)
    w = r(8)
    q, k, v = r(1, 2, 4, 8), r(1, 2, 4, 8), r(1, 2, 4, 8)
    idx = torch.tensor([2, 0, 3])
    emb = r(16, 8)
    ids = torch.tensor([[1, 2, 3], [4, 5, 15]])
    return [
        ("gelu str", aten.gelu.default, (x,), {"approximate": "tanh"}, (x,), {"approximate": "none"}),
        ("layer_norm SymInt[] Tensor? float 3 outputs", aten.native_layer_norm.default, (x, [8], w, None, 1e-5), {},
         (x, [8], w, None, 1e-6), {}),
        ("_to_copy ScalarType? Layout? Device? bool?", aten._to_copy.default, (x,), {"dtype": torch.float16},
         (x,), {"dtype": torch.bfloat16}),
        ("clamp Scalar?", aten.clamp.default, (x, -0.5, 0.5), {}, (x, -0.5, 0.6), {}),
        ("div str?", aten.div.Tensor_mode, (x, y), {"rounding_mode": "floor"}, (x, y), {"rounding_mode": "trunc"}),
        ("sum int[1]? ScalarType?", aten.sum.dim_IntList, (x, [1], True), {"dtype": torch.float64},
         (x, [0], True), {"dtype": torch.float64}),
        ("addmm Scalar beta alpha", aten.addmm.default, (w, r(4, 16), r(16, 8)), {"beta": 0.5, "alpha": 2},
         (w, r(4, 16), r(16, 8)), {"beta": 0.5, "alpha": 1}),
        ("where bool tensor", aten.where.self, (x > 0, x, y), {}, (x > 0, x, y.double()), {}),
        ("index_select int64 tensor", aten.index_select.default, (x, 0, idx), {}, (x, 1, idx), {}),
        ("embedding SymInt bool", aten.embedding.default, (emb, ids), {}, (emb, ids, 3), {}),
        ("cat Tensor[]", aten.cat.default, ([x, y], 1), {}, ([x, y, x], 1), {}),
        ("add wrapped number", aten.add.Tensor, (x, 2.5), {}, (x, 3.5), {}),
        ("mul int Scalar", aten.mul.Scalar, (x, 2), {}, (x, 2.0), {}),
        ("pow float Scalar", aten.pow.Tensor_Scalar, (x.abs(), 0.5), {}, (x.abs(), 0.25), {}),
        ("amax int[1]", aten.amax.default, (x, [1], False), {}, (x, [1], True), {}),
        ("_softmax", aten._softmax.default, (x, -1, False), {}, (x.t(), -1, False), {}),
        ("sdpa cpu float? Tensor? 2 outputs", aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v),
         {"is_causal": True}, (q, k, v), {"is_causal": False}),
    ]
