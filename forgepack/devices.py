"""Device facts and measured ceilings, measured once per device and cached.

Roofline times need two ceilings: memory bandwidth (a large device-to-device copy, bytes read plus
bytes written) and matmul rate per dtype (a large product on random data: zeros run faster and would
flatter the ceiling). Datasheet numbers are leads; these are measured on the machine at hand.
Cached in `$FORGEPACK_CACHE/devices/<key>.json` (default `~/.cache/forgepack`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from forgepack import timing


def cache_dir() -> Path:
    return Path(os.environ.get("FORGEPACK_CACHE", Path.home() / ".cache" / "forgepack"))


@dataclass(frozen=True)
class DeviceFacts:
    kind: str  # "cuda" | "cpu"
    name: str
    arch: str | None  # "sm_90" for CUDA
    sm_count: int  # multiprocessors (cuda) or logical cores (cpu)
    l2_bytes: int
    memory_bytes: int
    copy_gbps: float  # measured, bytes read + written per second / 1e9
    matmul_tflops: dict[str, float]  # measured per dtype name
    torch_version: str
    cuda_version: str | None

    def peak_tflops(self, dtype: str) -> float:
        return self.matmul_tflops.get(dtype) or self.matmul_tflops.get("float32", 1.0)

    def summary(self) -> str:
        rates = ", ".join(f"{k} {v:.3g}" for k, v in self.matmul_tflops.items())
        return f"{self.name} ({self.arch or self.kind}): copy {self.copy_gbps:.0f} GB/s, matmul TFLOP/s {rates}"


def _key(device: torch.device) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{platform.machine()}-{platform.processor() or 'cpu'}-{os.cpu_count()}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{device.type}-{name}-torch{torch.__version__}")


def facts(device: torch.device | str, refresh: bool = False) -> DeviceFacts:
    device = torch.device(device)
    path = cache_dir() / "devices" / f"{_key(device)}.json"
    if path.exists() and not refresh:
        return DeviceFacts(**json.loads(path.read_text()))
    found = measure(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dataclasses.asdict(found), indent=1) + "\n")
    return found


def measure(device: torch.device) -> DeviceFacts:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return DeviceFacts(
            kind="cuda",
            name=props.name,
            arch=f"sm_{props.major}{props.minor}",
            sm_count=props.multi_processor_count,
            l2_bytes=getattr(props, "L2_cache_size", 0),
            memory_bytes=props.total_memory,
            copy_gbps=_copy_gbps(device, 1 << 30),
            matmul_tflops={dt: _matmul_tflops(device, dt, 8192 if dt != "float32" else 4096)
                           for dt in ("bfloat16", "float16", "float32")},
            torch_version=torch.__version__,
            cuda_version=torch.version.cuda,
        )
    return DeviceFacts(
        kind="cpu",
        name=platform.processor() or platform.machine(),
        arch=None,
        sm_count=os.cpu_count() or 1,
        l2_bytes=0,
        memory_bytes=0,
        copy_gbps=_copy_gbps(device, 128 << 20),
        matmul_tflops={"float32": _matmul_tflops(device, "float32", 768)},
        torch_version=torch.__version__,
        cuda_version=None,
    )


def _copy_gbps(device: torch.device, nbytes: int) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    us = timing.median(timing.time_us(lambda: dst.copy_(src), device, reps=10, warmup=2, flush=False))
    return 2 * nbytes / (us * 1e-6) / 1e9


def _matmul_tflops(device: torch.device, dtype: str, n: int) -> float:
    dt = getattr(torch, dtype)
    a = torch.randn(n, n, device=device).to(dt)
    b = torch.randn(n, n, device=device).to(dt)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 ceiling is true fp32, like the verifier's reference
    try:
        us = timing.median(timing.time_us(lambda: a @ b, device, reps=5, warmup=2, flush=False))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return 2 * n**3 / (us * 1e-6) / 1e12


def kernel_names(fn: Callable[[], Any]) -> list[str]:
    """The names of the CUDA kernels one call of `fn` launches, in launch order (CUPTI, through
    torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
