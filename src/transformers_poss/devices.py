"""Device kinds: what a tuned drafting budget is measured on, and so what it is valid for.

A kind is `"HARDWARE/DTYPE"`: `cpu:avx512_bf16`, `cpu:avx512`, `cpu:avx2` or `cpu:default` for CPUs, as torch's
dispatch reports their capability (so `ATEN_CPU_CAPABILITY=avx2` makes an AVX-512 CPU an `avx2` one, as it computes),
with `_bf16` where bf16 products run natively (AVX-512 BF16 or AMX); `cuda:DEVICE NAME` for GPUs; and the dtype the
target runs in, e.g. `cpu:avx512_bf16/bfloat16`, `cpu:avx2/float32`, `cuda:NVIDIA H100 80GB HBM3/bfloat16`.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch


def cpu_capability() -> str:
    """torch's CPU dispatch level in lower case (`avx512`, `avx2`, `default`, ...)."""
    return torch.backends.cpu.get_cpu_capability().lower()


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls natively: AVX-512 BF16 or AMX in its flags, and torch dispatching at
    AVX-512 (not held to AVX2 by `ATEN_CPU_CAPABILITY`). Elsewhere bf16 is emulated and slow."""
    if not cpu_capability().startswith("avx512"):
        return False
    flags = _cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The CPU's flags as /proc/cpuinfo lists them (empty where there is none); read once per process."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def device_kind(device: torch.device | str, dtype: torch.dtype) -> str:
    """The kind of `device` running in `dtype` (module docstring)."""
    device = torch.device(device)
    dtype_name = str(dtype).removeprefix("torch.")
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}/{dtype_name}"
    if device.type == "cpu":
        capability = cpu_capability()
        return f"cpu:{capability}{'_bf16' if cpu_has_native_bf16() else ''}/{dtype_name}"
    return f"{device.type}/{dtype_name}"


def local_device_kinds() -> list[str]:
    """The kinds a target on this machine runs as in its usual dtypes: the CPU in bf16 and fp32, and the first GPU in
    bf16 and fp16 where there is one."""
    kinds = [device_kind("cpu", torch.bfloat16), device_kind("cpu", torch.float32)]
    if torch.cuda.is_available():
        kinds += [device_kind("cuda:0", torch.bfloat16), device_kind("cuda:0", torch.float16)]
    return kinds
