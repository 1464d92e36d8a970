"""RMSNorm of rows: `rms_norm` in torch operators (the reference, and the path off the CPU or in other
dtypes) and `compiled_rms_norm`, one pass of engine/rmsnorm.c for float32 rows on the CPU (a decode
step of the default model runs 61 of them on one row each, where six operators' dispatch was the cost;
docs/benchmarks.md, "Tuning at the edge").

This module deliberately knows nothing about the model: it is given rows, a weight and an epsilon.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.threads import load_on_torch_team

_KERNEL: list = []  # [library or None]: engine/rmsnorm.c, built on first use


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    r = xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()  # [n, 1]
    return (xf * r).to(x.dtype).mul_(w)


def norm_kernel():
    """engine/rmsnorm.c with its signature declared, or None (native kernels off, or no compiler)."""
    if not _KERNEL:
        lib = load_on_torch_team("rmsnorm", Path(__file__).with_name("rmsnorm.c"))
        if lib is not None:
            i64, ptr = ctypes.c_int64, ctypes.c_void_p
            lib.rms_norm_rows.argtypes = (ptr, i64, i64, i64, ptr, ctypes.c_float, ptr, i64, ctypes.c_int)
            lib.rms_norm_rows.restype = ctypes.c_int
        _KERNEL.append(lib)
    return _KERNEL[0]


def compiled_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` of rows `x` `[n, d]`, in engine/rmsnorm.c where it applies (float32 rows with
    contiguous columns and a float32 weight on the CPU, the kernel built), else in torch operators;
    a new tensor either way (the same up to float32 summation order)."""
    lib = norm_kernel() if x.device.type == "cpu" else None
    if lib is None or x.dtype != torch.float32 or w.dtype != torch.float32 or x.dim() != 2 or x.stride(-1) != 1:
        return rms_norm(x, w, eps)
    y = torch.empty(x.shape, dtype=torch.float32)
    lib.rms_norm_rows(x.data_ptr(), x.shape[0], x.stride(0), x.shape[1], w.data_ptr(), eps, y.data_ptr(), y.stride(0),
                      torch.get_num_threads())
    return y
