"""GEMM template: `aten.mm` where the output's rows are not 16-byte aligned (an odd vocabulary).

cuBLAS runs a matmul at near peak when every leading dimension is a multiple of 16 bytes. An LM head
with an odd vocabulary (GPT-2: f16[1024,768] @ [768,50257]) leaves the output's row stride unaligned,
and cuBLAS falls back to an `align1` kernel: 842 µs on the H200, where the same product into a
padded buffer takes 124 µs (`tools/probe_layouts.py --only lmhead`). torch.compile computes the
transposed product W·xᵀ, whose rows are aligned, and copies it back transposed (121 + 35 µs,
`tools/probe_kernels.py`); this template computes into the output as it is.

Served: fp16/bf16 `mm(x, w.t())`, the product nn.Linear makes (both operands K-contiguous, "TN"),
into a contiguous output whose row is not a multiple of 8 elements. Aligned outputs are refused:
cuBLAS serves those at near peak, and no search budget should go to them.

The cuda kernel is a tensor-core GEMM (WMMA, 16x16x16 fragments, fp32 accumulation, rounded once to
the output dtype, as cuBLAS does): a `bm` x `bn` block tile, `bk`-deep slices of both operands
streamed through shared memory by `cp.async` in a `stages`-deep pipeline (rows past M or N are
zero-filled), warps arranged `wm` x (warps / `wm`), and the block's tile staged in shared memory
and stored row by row with consecutive lanes on consecutive elements, so the unaligned rows are
written coalesced. The cpu kernel is a plain loop with fp32 accumulation (correctness first).

On Hopper, `gemm.mm_unaligned_wgmma` serves the same cards (K a multiple of 64) with the warpgroup
MMA: per stage a 64-deep slice of both operands lands by `cp.async` in 128-byte-swizzled shared
memory, one `wgmma` per 16 of depth reads it there through matrix descriptors, each warpgroup of
128 threads owns 64 rows of the tile, and the epilogue is the same smem-staged coalesced store.
GPT-2's LM head: 218 µs (362 TFLOP/s) at its default point, against 358 µs for WMMA.
"""

from __future__ import annotations

from dataclasses import dataclass

from forgepack.cards import Card
from forgepack.needs import Align, Needs
from forgepack.templates import generic as generic_mod
from forgepack.templates.common import (
    FamilyPlan,
    Template,
    align_check,
    ceil_div,
    ctype,
    entry,
    launch_status,
    prelude,
)

TILES = ["128x128", "128x256", "256x128", "64x128"]
BKS = [32, 64]
STAGES = [3, 4, 2]
PAD = 8  # halves of padding per shared-memory row: keeps fragment loads off one bank
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one block may opt into on sm_90


@dataclass(frozen=True)
class GemmPlan:
    m: int
    n: int
    k: int
    lda: int
    ldb: int  # the weight's row stride: B[k, n] = w[n, k] at n * ldb + k
    dtype: str


def tn_plan(card: Card, aligned_rows: str | None = None) -> GemmPlan | str:
    """The product nn.Linear makes, `mm(x, w.t())` in fp16/bf16 into a contiguous output, or why not.
    `aligned_rows`: the refusal for an output whose rows are 16-byte aligned (None: accepted)."""
    a, b = card.tensor_inputs()[:2]
    out = card.outputs[0]
    if a.dtype not in ("float16", "bfloat16") or b.dtype != a.dtype or out.dtype != a.dtype:
        return "GEMM served on float16/bfloat16 operands and output of one dtype"
    if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[1] != b.shape[0]:
        return "not a 2-D matrix product"
    (m, k), n = a.shape, b.shape[1]
    if out.shape != (m, n) or not out.is_contiguous():
        return "GEMM served into a contiguous output"
    if aligned_rows and n % 8 == 0:
        return aligned_rows
    if a.stride[1] != 1 or a.stride[0] % 8 or a.storage_offset % 8:
        return "the first operand must be row-major with 16-byte aligned rows"
    if b.stride[0] != 1 or b.stride[1] % 8 or b.storage_offset % 8:
        return "the second operand must be a transposed K-contiguous weight (nn.Linear's mm(x, w.t()))"
    return GemmPlan(m, n, k, a.stride[0], b.stride[1], a.dtype)


class GemmTemplate(Template):
    def plan(self, card: Card, target: str):
        plan = tn_plan(card, "the output's rows are 16-byte aligned: cuBLAS serves this product at near peak")
        if isinstance(plan, str):
            return plan
        if plan.k % 16:
            return "K must be a multiple of 16"
        if ceil_div(plan.n, 128) > 65535:
            return "N is over the grid's limit"
        return plan

    def axes(self, plan: GemmPlan, target: str) -> dict[str, list]:
        if target == "cpu":
            return {"nb": [nb for nb in CPU_NBS if nb <= plan.n], "unroll": list(CPU_UNROLLS)}
        bks = [bk for bk in BKS if plan.k % bk == 0] or [16]
        return {"tile": TILES, "bk": bks, "stages": STAGES, "wm": [2, 4]}

    def pick_default(self, plan, axes, target):
        if target == "cpu":
            return {"nb": 1, "unroll": 1}
        return {"tile": "128x128", "bk": axes["bk"][0], "stages": 3, "wm": 2}

    def emit(self, card: Card, plan: GemmPlan, target: str, params: dict) -> str:
        if target == "cpu":
            return render_cpu(card, plan, params)
        return render_cuda(card, plan, params)


def smem_bytes(bm: int, bn: int, bk: int, stages: int, warps: int = 8) -> int:
    pipeline = stages * (bm + bn) * (bk + PAD) * 2
    epilogue = bm * (bn + PAD) * 2 + warps * 256 * 4  # output tile + each warp's fp32 fragment
    return max(pipeline, epilogue)  # the epilogue reuses the pipeline's memory


CPU_NBS = (1, 2, 4, 8)  # output columns computed together per row of A on the cpu target
CPU_UNROLLS = (1, 4)  # the reduction loop's unroll hint (1: none)


def render_cpu(card: Card, plan: GemmPlan, params: dict | None = None) -> str:
    """Plain loops; `nb` output columns share each load of A's row (nb independent accumulators, each
    summed over k in the same order as nb=1, so every point computes bit-identical results), with a
    one-column tail when nb does not divide N."""
    params = params or {"nb": 1, "unroll": 1}
    nb, unroll = params.get("nb", 1), params.get("unroll", 1)
    t = ctype(plan.dtype, "cpu")
    hint = f"#pragma GCC unroll {unroll}\n      " if unroll > 1 else ""
    if nb == 1:
        main = ""
        tail_from = "0"
    else:
        accs = " ".join(f"float acc{q} = 0.0f;" for q in range(nb))
        fmas = " ".join(f"acc{q} += av * fp_ld(b[(j + {q}) * {plan.ldb} + p]);" for q in range(nb))
        stores = " ".join(f"c[i * {plan.n} + j + {q}] = fp_st<{t}>(acc{q});" for q in range(nb))
        main = f"""    for (; j + {nb} <= {plan.n}; j += {nb}) {{
      {accs}
      {hint}for (int64_t p = 0; p < {plan.k}; ++p) {{ const float av = fp_ld(a[i * {plan.lda} + p]); {fmas} }}
      {stores}
    }}
"""
        tail_from = "j"
    loop = f"""
static void fp_gemm(const {t}* a, const {t}* b, {t}* c) {{
  for (int64_t i = 0; i < {plan.m}; ++i) {{
    int64_t j = 0;
{main}    for (j = {tail_from}; j < {plan.n}; ++j) {{
      float acc = 0.0f;
      {hint}for (int64_t p = 0; p < {plan.k}; ++p) acc += fp_ld(a[i * {plan.lda} + p]) * fp_ld(b[j * {plan.ldb} + p]);
      c[i * {plan.n} + j] = fp_st<{t}>(acc);
    }}
  }}
}}
"""
    body = (f"fp_gemm((const {t}*)call->inputs[0].data, (const {t}*)call->inputs[1].data, "
            f"({t}*)call->outputs[0].data);\n  return FP_OK;")
    return prelude("cpu") + loop + entry(card, "cpu", body)


def _launch(t: str, smem: int, grid_m: int, grid_n: int, threads: int, check: str = "") -> str:
    """The entry's body for both GEMM kernels: operand alignment, `check` (more refusals), the shared
    memory opt-in, the launch."""
    return f"""const {t}* a = (const {t}*)call->inputs[0].data;
  const {t}* w = (const {t}*)call->inputs[1].data;
  if (!({align_check([("a", 16), ("w", 16)])})) return FP_ERR_UNSUPPORTED;
  {check}cudaError_t err = cudaFuncSetAttribute(fp_gemm, cudaFuncAttributeMaxDynamicSharedMemorySize, {smem});
  if (err != cudaSuccess) return (int32_t)err;
  fp_gemm<<<dim3({grid_m}u, {grid_n}u), {threads}, {smem}, stream>>>(a, w, ({t}*)call->outputs[0].data);
  {launch_status("cuda")}"""


def render_cuda(card: Card, plan: GemmPlan, params: dict) -> str:
    bm, bn = (int(x) for x in params["tile"].split("x"))
    bk, stages, wm = params["bk"], params["stages"], params["wm"]
    warps = 8
    wn = warps // wm
    wtm, wtn = bm // wm, bn // wn  # one warp's tile
    if wtm % 16 or wtn % 16:
        raise ValueError(f"gemm: tile {bm}x{bn} does not split into {wm}x{wn} warps of 16x16 fragments")
    t = ctype(plan.dtype, "cuda")
    threads = warps * 32
    ld = bk + PAD
    smem = smem_bytes(bm, bn, bk, stages)
    if smem > SMEM_LIMIT:
        raise ValueError(f"gemm: {smem} bytes of shared memory is over the {SMEM_LIMIT} a block may use")
    chunks_a, chunks_b = bm * bk // 8, bn * bk // 8  # 16-byte chunks per stage
    kt = plan.k // bk
    grid_m, grid_n = ceil_div(plan.m, bm), ceil_div(plan.n, bn)
    kernel = f"""
#include <mma.h>
namespace wmma = nvcuda::wmma;

FP_FN void fp_cp16(void* smem, const void* gmem, bool valid) {{
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  const int bytes = valid ? 16 : 0;  // 0: the 16 bytes are zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\\n" :: "r"(s), "l"(gmem), "r"(bytes));
}}
FP_FN void fp_cp_commit() {{ asm volatile("cp.async.commit_group;\\n" ::); }}
template <int N> FP_TFN void fp_cp_wait() {{ asm volatile("cp.async.wait_group %0;\\n" :: "n"(N)); }}

// One stage: rows [m0, m0 + {bm}) of a and [n0, n0 + {bn}) of w, columns [k0, k0 + {bk}).
FP_FN void fp_load(const {t}* __restrict__ a, const {t}* __restrict__ w, {t}* as, {t}* bs,
                   int m0, int n0, int k0) {{
  for (int c = threadIdx.x; c < {chunks_a}; c += {threads}) {{
    const int r = c / {bk // 8}, col = (c % {bk // 8}) * 8;
    const bool ok = m0 + r < {plan.m};
    fp_cp16(as + r * {ld} + col, a + (size_t)(ok ? m0 + r : 0) * {plan.lda} + k0 + col, ok);
  }}
  for (int c = threadIdx.x; c < {chunks_b}; c += {threads}) {{
    const int r = c / {bk // 8}, col = (c % {bk // 8}) * 8;
    const bool ok = n0 + r < {plan.n};
    fp_cp16(bs + r * {ld} + col, w + (size_t)(ok ? n0 + r : 0) * {plan.ldb} + k0 + col, ok);
  }}
}}

__global__ void __launch_bounds__({threads}) fp_gemm(const {t}* __restrict__ a, const {t}* __restrict__ w,
                                                   {t}* __restrict__ c) {{
  extern __shared__ __align__(128) unsigned char fp_smem[];
  {t}* as = ({t}*)fp_smem;
  {t}* bs = as + {stages} * {bm} * {ld};
  // blockIdx.x walks M: the blocks that run together share one weight tile (read once) and the
  // activations, which are small, stay in L2.
  const int m0 = blockIdx.x * {bm}, n0 = blockIdx.y * {bn};
  const int warp = threadIdx.x / 32, wy = warp / {wn}, wx = warp % {wn};
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[{wtm // 16}][{wtn // 16}];
#pragma unroll
  for (int i = 0; i < {wtm // 16}; ++i)
#pragma unroll
    for (int j = 0; j < {wtn // 16}; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
#pragma unroll
  for (int s = 0; s < {stages - 1}; ++s) {{
    if (s < {kt}) fp_load(a, w, as + s * {bm * ld}, bs + s * {bn * ld}, m0, n0, s * {bk});
    fp_cp_commit();
  }}
  for (int kt = 0; kt < {kt}; ++kt) {{
    fp_cp_wait<{stages - 2}>();
    __syncthreads();  // stage kt is in; every warp is done with the stage about to be refilled
    const int next = kt + {stages - 1};
    if (next < {kt}) fp_load(a, w, as + (next % {stages}) * {bm * ld}, bs + (next % {stages}) * {bn * ld},
                             m0, n0, next * {bk});
    fp_cp_commit();
    const {t}* sa = as + (kt % {stages}) * {bm * ld} + wy * {wtm} * {ld};
    const {t}* sb = bs + (kt % {stages}) * {bn * ld} + wx * {wtn} * {ld};
#pragma unroll
    for (int kk = 0; kk < {bk}; kk += 16) {{
      wmma::fragment<wmma::matrix_a, 16, 16, 16, {t}, wmma::row_major> fa[{wtm // 16}];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, {t}, wmma::col_major> fb[{wtn // 16}];
#pragma unroll
      for (int i = 0; i < {wtm // 16}; ++i) wmma::load_matrix_sync(fa[i], sa + i * 16 * {ld} + kk, {ld});
#pragma unroll
      for (int j = 0; j < {wtn // 16}; ++j) wmma::load_matrix_sync(fb[j], sb + j * 16 * {ld} + kk, {ld});
#pragma unroll
      for (int i = 0; i < {wtm // 16}; ++i)
#pragma unroll
        for (int j = 0; j < {wtn // 16}; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }}
  }}
  fp_cp_wait<0>();
  __syncthreads();  // the pipeline's memory now holds the output tile and each warp's scratch
  {t}* ct = ({t}*)fp_smem;
  // bf16 has no 16-bit accumulator fragment: each fragment goes through fp32 scratch, then rounds.
  float* scratch = (float*)(fp_smem + {bm * (bn + PAD) * 2}) + warp * 256;
  const int lane = threadIdx.x % 32, fr = lane / 2, fc = (lane % 2) * 8;
#pragma unroll
  for (int i = 0; i < {wtm // 16}; ++i)
#pragma unroll
    for (int j = 0; j < {wtn // 16}; ++j) {{
      wmma::store_matrix_sync(scratch, acc[i][j], 16, wmma::mem_row_major);
      __syncwarp();
      {t}* dst = ct + (wy * {wtm} + i * 16 + fr) * {bn + PAD} + wx * {wtn} + j * 16 + fc;
#pragma unroll
      for (int e = 0; e < 8; ++e) dst[e] = fp_st<{t}>(scratch[fr * 16 + fc + e]);
      __syncwarp();
    }}
  __syncthreads();
  const int rows = min({bm}, {plan.m} - m0), cols = min({bn}, {plan.n} - n0);
  for (int r = warp; r < rows; r += {warps}) {{
    {t}* dst = c + (size_t)(m0 + r) * {plan.n} + n0;
    for (int col = threadIdx.x % 32; col < cols; col += 32) dst[col] = ct[r * {bn + PAD} + col];
  }}
}}
"""
    return prelude("cuda") + kernel + entry(card, "cuda", _launch(t, smem, grid_m, grid_n, threads))


# --- Hopper: warpgroup MMA (wgmma) ------------------------------------------------------------------

WG_TILES = ["128x256", "128x192", "256x128", "128x128", "64x256"]
WG_STAGES = [4, 5, 6, 3, 2]  # at 2 stages (double buffering) the smaller tiles fit two blocks per SM
WG_BK = 64  # one 128-byte swizzle row of fp16/bf16 per operand row


class WgmmaTemplate(GemmTemplate):
    """The same product on Hopper's warpgroup MMA: operands read by the tensor cores straight from
    128-byte-swizzled shared memory, which WMMA's register-fragment loads cannot match. The default
    is the fastest point measured on GPT-2's LM head (128x128, 3 stages, two blocks per SM).
    Hopper only (`archs`): the target's arch comes from the recipe or the profiled GPU, not this host."""

    def plan(self, card: Card, target: str):
        plan = super().plan(card, target)
        if isinstance(plan, GemmPlan) and plan.k % WG_BK:
            return f"K must be a multiple of {WG_BK}"
        return plan

    def axes(self, plan: GemmPlan, target: str) -> dict[str, list]:
        return {"tile": WG_TILES, "stages": WG_STAGES}

    def pick_default(self, plan, axes, target):
        return {"tile": "128x128", "stages": 3}

    def emit(self, card: Card, plan: GemmPlan, target: str, params: dict) -> str:
        return render_wgmma(card, plan, params)


def wgmma_smem_bytes(bm: int, bn: int, stages: int) -> int:
    pipeline = stages * (bm + bn) * WG_BK * 2
    epilogue = bm * (bn + PAD) * 2
    return max(pipeline, epilogue) + 1024  # + room to align the base to the 1024-byte swizzle atom


def _wgmma_asm(n: int, ab: str) -> str:
    """One m64n{n}k16 warpgroup MMA, fp32 accumulators in registers, both operands K-major in
    shared memory (the descriptors), scale-d = 1 (accumulate)."""
    regs = n // 2
    dlist = ", ".join(f"%{i}" for i in range(regs))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    return f"""FP_FN void fp_wgmma(float* d, uint64_t da, uint64_t db) {{
  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 2}, 0;\\n"
               "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ab}.{ab} {{{dlist}}}, "
               "%{regs}, %{regs + 1}, p, 1, 1, 0, 0;\\n}}\\n"
               : {outs}
               : "l"(da), "l"(db), "r"(1));
}}"""


def render_wgmma(card: Card, plan: GemmPlan, params: dict) -> str:
    bm, bn = (int(x) for x in params["tile"].split("x"))
    stages = params["stages"]
    if bm % 64 or bn % 8 or bn > 256:
        raise ValueError(f"gemm: tile {bm}x{bn} is not warpgroups of m64 by n<=256")
    smem = wgmma_smem_bytes(bm, bn, stages)
    if smem > SMEM_LIMIT:
        raise ValueError(f"gemm: {smem} bytes of shared memory is over the {SMEM_LIMIT} a block may use")
    t = ctype(plan.dtype, "cuda")
    ab = "f16" if plan.dtype == "float16" else "bf16"
    groups = bm // 64
    threads = groups * 128
    regs = bn // 2
    # One batch of MMAs left in flight across the loop's barrier. ptxas (CUDA 13.0) serialises the
    # MMAs of the narrower tiles when a batch is left in flight, so those wait for theirs.
    inflight = 1 if bn == 256 and stages > 2 else 0
    ahead = stages - 1 - inflight  # tiles loading ahead of the one computed (the rest are being read)
    # Two blocks per SM where both fit (shared memory, and registers capped at 128 for 256 threads):
    # one block's prologue and epilogue then overlap the other's MMAs, which matters at GPT-2's K
    # (12 slices per tile).
    blocks = 2 if 2 * smem <= SMEM_LIMIT and threads * bn // 2 <= 128 * 128 else 1
    kt = plan.k // WG_BK
    stage_bytes = (bm + bn) * WG_BK * 2
    grid_m, grid_n = ceil_div(plan.m, bm), ceil_div(plan.n, bn)
    kernel = f"""
FP_FN void fp_cp16(uint32_t smem, const void* gmem, bool valid) {{
  const int bytes = valid ? 16 : 0;  // 0: the 16 bytes are zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\\n" :: "r"(smem), "l"(gmem), "r"(bytes));
}}
FP_FN void fp_cp_commit() {{ asm volatile("cp.async.commit_group;\\n" ::); }}
template <int N> FP_TFN void fp_cp_wait() {{ asm volatile("cp.async.wait_group %0;\\n" :: "n"(N) : "memory"); }}
FP_FN void fp_wg_fence() {{ asm volatile("wgmma.fence.sync.aligned;\\n" ::: "memory"); }}
FP_FN void fp_wg_commit() {{ asm volatile("wgmma.commit_group.sync.aligned;\\n" ::: "memory"); }}
template <int N> FP_TFN void fp_wg_wait() {{
  asm volatile("wgmma.wait_group.sync.aligned %0;\\n" :: "n"(N) : "memory");
}}
// cp.async writes through the generic proxy, wgmma reads through the async proxy.
FP_FN void fp_proxy_fence() {{ asm volatile("fence.proxy.async.shared::cta;\\n" ::: "memory"); }}
// Keeps the compiler from reading the accumulators before the last MMA has retired (no instruction:
// in the main loop one would make ptxas serialise the MMAs).
FP_FN void fp_fence_regs(float* d) {{
#pragma unroll
  for (int i = 0; i < {regs}; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}}

// A K-major operand tile in 128-byte swizzle: rows of 64 elements (128 bytes), 8-row atoms of 1024
// bytes, 16-byte chunk c of row r stored at chunk c ^ (r % 8). Leading offset unused, stride 1024.
FP_FN uint64_t fp_desc(uint32_t addr) {{
  return (uint64_t)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}}

{_wgmma_asm(bn, ab)}

// One stage: rows [m0, m0 + {bm}) of a and [n0, n0 + {bn}) of w, columns [k0, k0 + {WG_BK}), swizzled.
FP_FN void fp_load(const {t}* __restrict__ a, const {t}* __restrict__ w, uint32_t as, uint32_t bs,
                   int m0, int n0, int k0) {{
  for (int c = threadIdx.x; c < {bm * 8}; c += {threads}) {{
    const int r = c / 8, q = c % 8;
    const bool ok = m0 + r < {plan.m};
    fp_cp16(as + r * 128 + ((q ^ (r % 8)) << 4), a + (size_t)(ok ? m0 + r : 0) * {plan.lda} + k0 + q * 8, ok);
  }}
  for (int c = threadIdx.x; c < {bn * 8}; c += {threads}) {{
    const int r = c / 8, q = c % 8;
    const bool ok = n0 + r < {plan.n};
    fp_cp16(bs + r * 128 + ((q ^ (r % 8)) << 4), w + (size_t)(ok ? n0 + r : 0) * {plan.ldb} + k0 + q * 8, ok);
  }}
}}

__global__ void __launch_bounds__({threads}, {blocks}) fp_gemm(const {t}* __restrict__ a,
                                                              const {t}* __restrict__ w, {t}* __restrict__ c) {{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) unsigned char fp_smem_raw[];
  unsigned char* fp_smem = fp_smem_raw + ((1024 - ((uint32_t)__cvta_generic_to_shared(fp_smem_raw) % 1024)) % 1024);
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(fp_smem);
  // blockIdx.x walks M: the blocks that run together share one weight tile (read once) and the
  // activations, which are small, stay in L2.
  const int m0 = blockIdx.x * {bm}, n0 = blockIdx.y * {bn};
  const int group = threadIdx.x / 128;
  float d[{regs}];
#pragma unroll
  for (int i = 0; i < {regs}; ++i) d[i] = 0.0f;
#pragma unroll
  for (int s = 0; s < {ahead}; ++s) {{
    if (s < {kt}) fp_load(a, w, base + s * {stage_bytes}, base + s * {stage_bytes} + {bm * 128}, m0, n0, s * {WG_BK});
    fp_cp_commit();
  }}
  for (int kt = 0; kt < {kt}; ++kt) {{
    fp_cp_wait<{ahead - 1}>();
    fp_proxy_fence();
    // Tile kt is in for every thread, and every warpgroup has retired the MMAs of tile
    // kt - 1 - inflight, whose stage the next load refills.
    __syncthreads();
    const int next = kt + {ahead};
    if (next < {kt}) fp_load(a, w, base + (next % {stages}) * {stage_bytes},
                             base + (next % {stages}) * {stage_bytes} + {bm * 128}, m0, n0, next * {WG_BK});
    fp_cp_commit();
    const uint32_t sa = base + (kt % {stages}) * {stage_bytes} + group * {64 * 128};
    const uint32_t sb = base + (kt % {stages}) * {stage_bytes} + {bm * 128};
    fp_wg_fence();
#pragma unroll
    for (int kk = 0; kk < {WG_BK // 16}; ++kk) fp_wgmma(d, fp_desc(sa + kk * 32), fp_desc(sb + kk * 32));
    fp_wg_commit();
    fp_wg_wait<{inflight}>();
  }}
  fp_wg_wait<0>();
  fp_fence_regs(d);
  fp_cp_wait<0>();
  __syncthreads();  // the pipeline's memory now holds the output tile
  {t}* ct = ({t}*)fp_smem;
  // The accumulator layout: warp w of the group holds rows 16w..16w+15; register 4j+2h+e is row
  // lane/4 + 8h, column 8j + 2(lane%4) + e.
  const int lane = threadIdx.x % 32, row0 = group * 64 + (threadIdx.x % 128) / 32 * 16 + lane / 4;
#pragma unroll
  for (int j = 0; j < {bn // 8}; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {{
      {t}* dst = ct + (row0 + 8 * h) * {bn + PAD} + j * 8 + (lane % 4) * 2;
      dst[0] = fp_st<{t}>(d[4 * j + 2 * h]);
      dst[1] = fp_st<{t}>(d[4 * j + 2 * h + 1]);
    }}
  __syncthreads();
  const int rows = min({bm}, {plan.m} - m0), cols = min({bn}, {plan.n} - n0);
  for (int r = threadIdx.x / 32; r < rows; r += {threads // 32}) {{
    {t}* dst = c + (size_t)(m0 + r) * {plan.n} + n0;
    for (int col = lane; col < cols; col += 32) dst[col] = ct[r * {bn + PAD} + col];
  }}
#endif  // built without sm_90a's features the kernel writes nothing, and verification rejects it
}}
"""
    # The sm_90a kernel runs only on compute capability 9: elsewhere the call falls back.
    hopper = """int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev)
      != cudaSuccess || major != 9) return FP_ERR_UNSUPPORTED;
  """
    return prelude("cuda") + kernel + entry(card, "cuda", _launch(t, smem, grid_m, grid_n, threads, hopper))


# --- decode: a few rows against a whole weight ------------------------------------------------------

GEMV_MAX_ROWS = 8


class GemvTemplate(Template):
    """A decode step's products: `mm(x, w.t())` with at most 8 rows, any width, aligned or not.

    Such a product reads the whole weight to produce a few outputs, so its time is the weight's bytes
    over the memory bandwidth, and what decides it is how many bytes are in flight. cuBLAS runs
    Llama-1B's one-row decode projections on 64x8 tiles (32 blocks for a 2048-wide output): the 112
    of a step take 917 µs on the H200, 2.1 TB/s for their 1.95 GB of weights, where this template
    takes 739 µs (`benchmarks/2026-11-30-h200-llama-decode-graphs`). Here each warp owns `cols`
    output columns for every row;
    its lanes walk K in 16-byte chunks (8 elements), issue `unroll` chunks of every column before
    using any (that many 16-byte weight loads in flight per lane, streamed past L1), accumulate in
    fp32 and reduce across the warp by shuffles; the result is rounded once, as cuBLAS rounds its fp32
    accumulator. The rows of x (at most 8 x K) are read through L1 and stay in L2."""

    def plan(self, card: Card, target: str):
        plan = tn_plan(card)
        if isinstance(plan, str):
            return plan
        if plan.m > GEMV_MAX_ROWS:
            return f"more than {GEMV_MAX_ROWS} rows: a tensor-core GEMM's product, not a weight stream"
        if plan.k % 8:
            return "K must be a multiple of 8 (16-byte loads)"
        return plan

    def axes(self, plan: GemmPlan, target: str) -> dict[str, list]:
        return {"warps": [8, 4, 16], "cols": [1, 2, 4], "unroll": [4, 2, 8]}

    def pick_default(self, plan, axes, target):
        # Enough warps to cover every SM several times over: two columns per warp only on wide outputs.
        return {"warps": 8, "cols": 2 if plan.n >= 8192 else 1, "unroll": 4}

    def emit(self, card: Card, plan: GemmPlan, target: str, params: dict) -> str:
        return render_gemv(card, plan, params)

    # A family whose row count varies with the batch (decode at batch 1..8): N, K and every stride fixed,
    # the kernel instantiated for each row count and picked at run time.
    generic = True

    def family_plan(self, card, plan, target):
        fam = card.family
        a, b, out = fam.inputs[0], fam.inputs[1], fam.outputs[0]
        if any(isinstance(size, str) for size in (a.shape[1], *b.shape, out.shape[1])):
            return "only the row count may vary across the family"
        if any(dims for lay in (a, b, out) for _, dims in lay.stride):
            return "the strides vary across the family"
        if isinstance(a.shape[0], str) and fam.dim(a.shape[0]).max > GEMV_MAX_ROWS:
            return f"more than {GEMV_MAX_ROWS} rows at the top of the range"
        return FamilyPlan(plan)

    def family_axes(self, plan, target):
        return self.axes(plan.base, target)

    def family_default(self, plan, axes, target):
        return self.pick_default(plan.base, axes, target)

    def family_emit(self, card, plan, target, params):
        return render_gemv(card, plan.base, params, generic=True)

    def needs(self, card, target, params):
        if card.family is None:
            return super().needs(card, target, params)
        return Needs((Align(16), Align(16)))  # uint4 loads of a and w; the output is the guard's allocation


def render_gemv(card: Card, plan: GemmPlan, params: dict, generic: bool = False) -> str:
    """`generic`: a family card's kernel, `template <int M>` on the row count, launched for the
    descriptor's rows (1..8); N, K and the strides stay constants (checked)."""
    warps, cols, unroll = params["warps"], params["cols"], params["unroll"]
    t = ctype(plan.dtype, "cuda")
    pair, to_float2 = (("__nv_bfloat162", "__bfloat1622float2") if plan.dtype == "bfloat16"
                       else ("__half2", "__half22float2"))
    m, n, k = ("M" if generic else plan.m), plan.n, plan.k
    tm = "template <int M>\n" if generic else ""
    threads = warps * 32
    grid = ceil_div(n, warps * cols)
    kernel = f"""
// 8 elements of a 16-byte chunk, as floats.
FP_FN void fp_unpack8(const uint4& v, float* f) {{
  const {pair}* p = reinterpret_cast<const {pair}*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {{
    const float2 two = {to_float2}(p[i]);
    f[2 * i] = two.x;
    f[2 * i + 1] = two.y;
  }}
}}

{tm}__global__ void __launch_bounds__({threads}) fp_gemv(const {t}* __restrict__ a, const {t}* __restrict__ w,
                                                   {t}* __restrict__ c) {{
  const int lane = threadIdx.x % 32;
  const int col0 = (blockIdx.x * {warps} + threadIdx.x / 32) * {cols};
  if (col0 >= {n}) return;  // the whole warp: no shuffle below misses a lane
  float acc[{cols}][{m}];
#pragma unroll
  for (int j = 0; j < {cols}; ++j)
#pragma unroll
    for (int r = 0; r < {m}; ++r) acc[j][r] = 0.0f;
  for (int k0 = lane * 8; k0 < {k}; k0 += {256 * unroll}) {{
    uint4 wv[{unroll}][{cols}];
#pragma unroll
    for (int u = 0; u < {unroll}; ++u)
#pragma unroll
      for (int j = 0; j < {cols}; ++j) {{
        const int kk = k0 + u * 256;
        const int col = min(col0 + j, {n - 1});  // a column past N reads a real row and is never stored
        wv[u][j] = kk < {k} ? __ldcs(reinterpret_cast<const uint4*>(w + (size_t)col * {plan.ldb} + kk))
                            : make_uint4(0u, 0u, 0u, 0u);
      }}
#pragma unroll
    for (int u = 0; u < {unroll}; ++u) {{
      const int kk = k0 + u * 256;
      if (kk >= {k}) break;
#pragma unroll
      for (int r = 0; r < {m}; ++r) {{
        float x[8];
        fp_unpack8(*reinterpret_cast<const uint4*>(a + (size_t)r * {plan.lda} + kk), x);
#pragma unroll
        for (int j = 0; j < {cols}; ++j) {{
          float wf[8];
          fp_unpack8(wv[u][j], wf);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[j][r] = fmaf(x[e], wf[e], acc[j][r]);
        }}
      }}
    }}
  }}
#pragma unroll
  for (int j = 0; j < {cols}; ++j)
#pragma unroll
    for (int r = 0; r < {m}; ++r)
#pragma unroll
      for (int off = 16; off > 0; off /= 2) acc[j][r] += __shfl_xor_sync(0xffffffffu, acc[j][r], off);
  if (lane == 0) {{
#pragma unroll
    for (int j = 0; j < {cols}; ++j)
      if (col0 + j < {n})
#pragma unroll
        for (int r = 0; r < {m}; ++r) c[(size_t)r * {n} + col0 + j] = fp_st<{t}>(acc[j][r]);
  }}
}}
"""
    body = f"""const {t}* a = (const {t}*)call->inputs[0].data;
  const {t}* w = (const {t}*)call->inputs[1].data;
  if (!({align_check([("a", 16), ("w", 16)])})) return FP_ERR_UNSUPPORTED;
  fp_gemv<<<{grid}u, {threads}, 0, stream>>>(a, w, ({t}*)call->outputs[0].data);
  {launch_status("cuda")}"""
    if not generic:
        return prelude("cuda") + kernel + entry(card, "cuda", body)
    b = card.tensor_inputs()[1]
    checks = ["const int64_t rows = call->inputs[0].sizes[0];",
              f"if (rows < 1 || rows > {GEMV_MAX_ROWS} || call->outputs[0].sizes[0] != rows) "
              "return FP_ERR_UNSUPPORTED;",
              f"if ((rows > 1 && call->inputs[0].strides[0] != {plan.lda}LL) || call->inputs[0].strides[1] != 1LL) "
              "return FP_ERR_UNSUPPORTED;",
              f"if ((rows > 1 && call->outputs[0].strides[0] != {n}LL) || call->outputs[0].strides[1] != 1LL) "
              "return FP_ERR_UNSUPPORTED;"]
    checks += [f"if (call->inputs[1].strides[{d}] != {st}LL) return FP_ERR_UNSUPPORTED;"
               for d, (size, st) in enumerate(zip(b.shape, b.stride, strict=True)) if size != 1]
    cases = " ".join(f"case {r}: fp_gemv<{r}><<<{grid}u, {threads}, 0, stream>>>(a, w, c); break;"
                     for r in range(1, GEMV_MAX_ROWS + 1))
    body = "\n  ".join([*checks, f"const {t}* a = (const {t}*)call->inputs[0].data;",
                        f"const {t}* w = (const {t}*)call->inputs[1].data;", f"{t}* c = ({t}*)call->outputs[0].data;",
                        f"if (!({align_check([('a', 16), ('w', 16)])})) return FP_ERR_UNSUPPORTED;",
                        f"switch (rows) {{ {cases} default: return FP_ERR_UNSUPPORTED; }}", launch_status("cuda")])
    return prelude("cuda") + generic_mod.helpers(1) + kernel + generic_mod.entry(card, "cuda", body)


TEMPLATES = (
    GemmTemplate("gemm.mm_unaligned", "gemm", ("cuda", "cpu"), ("aten.mm.default",)),
    WgmmaTemplate("gemm.mm_unaligned_wgmma", "gemm", ("cuda",), ("aten.mm.default",), archs=("sm_90",)),
    GemvTemplate("gemm.mv_rows", "gemm", ("cuda",), ("aten.mm.default",)),
)
