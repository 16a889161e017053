"""Bytes, FLOPs and roofline time of one call of a card, from its metadata alone.

Bytes: each input's touched storage read once plus each output written once (the fewest bytes any
kernel must move). Inputs with equal metadata count once each: a card does not record whether two
inputs alias, a kernel served for it cannot assume they do, and in models they rarely do (a residual
add, the halves of a cat). Counting them once made a binary add's roofline a third too fast.
FLOPs: exact for matrix products, convolutions and attention (where arithmetic can
dominate); one per output element otherwise (memory-bound ops, where bytes dominate anyway).
Roofline time = max(bytes / bandwidth, FLOPs / peak) on the measured ceilings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from forgepack.cards import Card, TensorMeta
from forgepack.devices import DeviceFacts

MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "_addmm_activation")
CONV_OPS = ("convolution", "_convolution", "cudnn_convolution", "mkldnn_convolution", "_slow_conv2d_forward")


@dataclass(frozen=True)
class Roofline:
    bytes: int
    flops: int
    us: float
    bound: str  # "memory" | "compute"


def _span_bytes(t: TensorMeta) -> int:
    return t.span() * t.itemsize


def card_bytes(card: Card) -> int:
    reads = sum(_span_bytes(t) for t in card.tensor_inputs() if t is not None)
    return reads + sum(o.nbytes for o in card.outputs)


def card_flops(card: Card) -> int:
    name = card.op_name.split(".")[0]
    tensors = [t for t in card.tensor_inputs() if t is not None]
    out = card.outputs[0] if card.outputs else None
    if name in MATMUL_OPS and out is not None:
        a = tensors[-2] if name in ("addmm", "baddbmm", "_addmm_activation") else tensors[0]
        k = a.shape[-1]
        return 2 * out.numel * k
    if name in CONV_OPS and out is not None and len(tensors) >= 2:
        weight = tensors[1]
        per_output = math.prod(weight.shape[1:])  # Cin/groups * kernel volume
        return 2 * out.numel * per_output
    if "scaled_dot_product" in name and len(tensors) >= 3:
        q, k = tensors[0], tensors[1]
        batch_heads = math.prod(q.shape[:-2])
        flops = 4 * batch_heads * q.shape[-2] * k.shape[-2] * q.shape[-1]
        causal = any(a.name == "is_causal" and a.value for a in card.args)
        return flops // 2 if causal else flops
    return sum(o.numel for o in card.outputs)


def roofline(card: Card, device: DeviceFacts) -> Roofline:
    nbytes, flops = card_bytes(card), card_flops(card)
    dtype = card.outputs[0].dtype if card.outputs else "float32"
    mem_us = nbytes / (device.copy_gbps * 1e9) * 1e6
    comp_us = flops / (device.peak_tflops(dtype) * 1e12) * 1e6
    return Roofline(nbytes, flops, max(mem_us, comp_us), "memory" if mem_us >= comp_us else "compute")
