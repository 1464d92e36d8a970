"""The engine's linear layers and embedding table over each weight format (engine.quant).

This module deliberately knows nothing about the model's architecture, files or conversion: a layer
is given its stored arrays (memory-mapped where the loader mapped them) and computes `y = x W^T + b`.

- float (fp32, bf16): up to `qm_max_rows()` float32 rows on the CPU in the compiled `f_matmul` of
  `engine/qmatmul.c` (float32 sums; torch's one-row GEMM streamed the weight at about half its
  rate), more with `F.linear` on the weight tensor (bf16 weights under a float32 compute dtype: the
  rows are cast to bfloat16 for the product, whose result comes back as float32).
- int4, int8, on the CPU with float32 rows: up to `qm_max_rows()` rows (decode, short turns) run in
  the compiled products of `engine/qmatmul.c`, which read the stored values in their stored layout
  (no repacked copy: mapped, processes on a node share one; or a plain copy of them,
  `EngineConfig.copy_weights`); int4 products quantize their rows to int8 per
  32 inputs where AVX-512 VNNI is compiled (`EngineConfig.int8_activations`). torch's own
  `_weight_int8pack_mm` took 161 us for a 960x576 weight at one row against 20 us here, and its int4
  CPU op was slower still at hundreds of rows (docs/benchmarks.md, "Quantized weights"). More rows
  (prefill, recompute) de-quantize the weight and run one GEMM: in bfloat16 (rows cast, result back
  in float32, as a bf16 weight's) where the CPU multiplies bfloat16 itself (`bf16_products_here`:
  AVX-512 BF16 or AMX; `EngineConfig.quantized_prefill_bf16`), else in float32.
- On CUDA under a bfloat16 compute dtype, int4 weights are packed once at load for torch's
  `_weight_int4pack_mm` (sm80 and later; group 32-256): on an H100, 13-28 us for a one-row product
  of Llama-3.2-1B's MLP shapes against 206-214 us de-quantizing per product, 1.13x slower at 512
  rows; only the packed copy is on the device (docs/benchmarks.md, "Quantized weights"). int8
  weights are converted to the rows' type and scaled after the product (torch's
  `_weight_int8pack_mm` was slower on CUDA from 16 rows on). Float32 compute on CUDA de-quantizes
  int4 per product, so its results equal the CPU's up to summation order.
- Elsewhere (no C compiler, `LLMAAS_NATIVE=0`, an older GPU) the weight is de-quantized with torch
  ops for every product: correct everywhere, slower.

An `Embedding` reads its rows per token: from a float table (a read-only mapping of the checkpoint
for an untied model, never read whole), or from the int8 LM head of a tied model (no second copy).
"""

from __future__ import annotations

import ctypes
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from engine import native
from engine.config import WEIGHT_PREFETCH_ROWS
from engine.threads import load_on_torch_team
from engine.quant import BLOCK, groups_of

_KERNELS: list = []  # [library or None]: engine/qmatmul.c, built on first use


def bf16_products_here() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (Linux's flags `avx512_bf16` or `amx_bf16`), so
    a bfloat16 GEMM runs about 2x (AVX-512 BF16) to 7x (AMX) a float32 one; elsewhere oneDNN converts and
    gains nothing. False where /proc/cpuinfo cannot be read."""
    flags = native.cpu_model_and_flags()[1]
    return "avx512_bf16" in flags or "amx_bf16" in flags


def host_prefetch_rows() -> int:
    """Rows ahead the decode products prefetch by default here (`EngineConfig.weight_prefetch_rows`
    None): `WEIGHT_PREFETCH_ROWS`, but none on AMD CPUs, where it made decode slower (measured on an
    EPYC; docs/benchmarks.md, "Tuning at the edge")."""
    return 0 if "AMD" in native.cpu_model_and_flags()[0].split() else WEIGHT_PREFETCH_ROWS


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.q4_matmul.argtypes = (ptr, i64, i64, i64, ptr, ptr, ptr, i64, i64, ptr, i64, c_int, c_int, c_int, c_int)
    lib.q8_matmul.argtypes = (ptr, i64, i64, i64, ptr, ptr, i64, ptr, i64, c_int, c_int, c_int)
    lib.f_matmul.argtypes = (ptr, i64, i64, i64, ptr, c_int, i64, ptr, i64, c_int, c_int, c_int)
    lib.q4_dequantize.argtypes = (ptr, ptr, ptr, i64, i64, i64, ptr, i64, c_int, c_int)
    lib.q8_dequantize.argtypes = (ptr, ptr, i64, i64, ptr, i64, c_int, c_int)
    for f in (lib.q4_matmul, lib.q8_matmul, lib.f_matmul, lib.q4_dequantize, lib.q8_dequantize, lib.qm_max_rows,
              lib.qm_openmp, lib.qm_int8_activations):
        f.restype = c_int
    lib.qm_max_rows.argtypes = lib.qm_openmp.argtypes = lib.qm_int8_activations.argtypes = ()
    return lib


def kernels():
    """engine/qmatmul.c with its signatures declared, or None (native kernels off, or no compiler); its
    threads are torch's own OpenMP team where they can be (`engine.threads.load_on_torch_team`)."""
    if not _KERNELS:
        lib = load_on_torch_team("qmatmul", Path(__file__).with_name("qmatmul.c"))
        _KERNELS.append(_declare(lib) if lib is not None else None)
    return _KERNELS[0]


def decode_rows(linears) -> int:
    """Most rows one pass may give all of `linears` with each row computed in decode's way: the compiled
    products (fp32, bf16, int8, int4) take up to their `max_rows` float32 rows, and more go through
    torch's GEMM or de-quantized weights (sums in another order, or rounded); 0 where none sets a bound
    (devices, no compiled kernels)."""
    return min((n for n in (getattr(lin, "max_rows", 0) for lin in linears) if n), default=0)


def _tensor(a: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A tensor over `a` without copying (read-only mappings: torch warns; nothing writes to them)."""
    if isinstance(a, torch.Tensor):
        return a
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


class Linear:
    """`y = x W^T + b` for one weight matrix `[n, k]`. Subclasses hold the weight in one format; those
    with a compiled product of few rows (`lib`, up to `max_rows` float32 rows on the CPU; 0: none)
    dispatch to it through `_compiled_rows` and `_compiled`."""

    __slots__ = ("n", "k", "bias", "lib", "max_rows")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def add_into(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`out += x W^T + b` in place (the residual adds of a decoder layer); returns `out`."""
        return out.add_(self(x))

    def _compiled_rows(self, x: torch.Tensor) -> bool:
        """Whether the compiled product takes rows `x`: float32, at most `max_rows` of them."""
        return x.dtype == torch.float32 and x.dim() == 2 and 0 < x.shape[0] <= self.max_rows

    def _compiled(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`x W^T` by the compiled product: a new float32 tensor, or added into `out` (float32, rows
        contiguous), which is returned."""
        x = x if x.stride(-1) == 1 else x.contiguous()
        if out is None:
            out = torch.empty(x.shape[0], self.n, dtype=torch.float32)
            self._product(x, out, accumulate=False)
        else:
            self._product(x, out, accumulate=True)
        return out

    def _compiled_into(self, out: torch.Tensor, x: torch.Tensor) -> bool:
        """`add_into`'s compiled way where it applies (no bias, rows it takes, a float32 `out` whose
        rows are contiguous): done, True; else False."""
        if self.bias is None and self._compiled_rows(x) and out.dtype == torch.float32 and out.stride(-1) == 1:
            self._compiled(x, out)
            return True
        return False

    def _product(self, x: torch.Tensor, y: torch.Tensor, *, accumulate: bool) -> None:
        """The compiled product (CPU, float32 rows with contiguous inputs): `y = x W^T`, or `y += x W^T`."""
        raise NotImplementedError

    def dequantized(self, dtype=torch.float32) -> torch.Tensor:
        """The weight as a float tensor `[n, k]` (a copy for quantized formats)."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    def resident_bytes(self) -> int:
        """Bytes of the stored weight (what decode reads per token)."""
        raise NotImplementedError


class FloatLinear(Linear):
    """A float weight (fp32 or bf16). Up to `qm_max_rows()` float32 rows on the CPU (decode) run the
    compiled product of engine/qmatmul.c (`f_matmul`: float32 sums, a bf16 weight widened exactly),
    which streams the weight at about twice the rate of torch's one-row GEMM on this project's VMs
    (docs/benchmarks.md, "Tuning at the edge"); more rows run `F.linear`, where under a float32
    compute dtype a bf16 weight takes bf16 rows."""

    __slots__ = ("weight",)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias
        self.n, self.k = weight.shape
        compiled = (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
                    and weight.is_contiguous() and self.k % 16 == 0)
        self.lib = kernels() if compiled else None
        self.max_rows = self.lib.qm_max_rows() if self.lib is not None else 0

    def _product(self, x: torch.Tensor, y: torch.Tensor, *, accumulate: bool) -> None:
        rc = self.lib.f_matmul(x.data_ptr(), x.shape[0], x.stride(0), self.k, self.weight.data_ptr(),
                               int(self.weight.dtype == torch.bfloat16), self.n, y.data_ptr(), y.stride(0),
                               int(accumulate), torch.get_num_threads(), 0)
        if rc:
            raise RuntimeError("float product refused its arguments")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._compiled_rows(x):
            y = self._compiled(x)
            return y if self.bias is None else y.add_(self.bias)
        if x.dtype != self.weight.dtype:
            y = F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)
            return y if self.bias is None else y.add_(self.bias)
        return F.linear(x, self.weight, self.bias)

    def add_into(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self._compiled_into(out, x):
            return out
        if self.bias is None and x.dtype == self.weight.dtype == out.dtype:
            return out.addmm_(x, self.weight.t())
        return out.add_(self(x))

    def dequantized(self, dtype=torch.float32) -> torch.Tensor:
        return self.weight.to(dtype)

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def resident_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class _QuantLinear(Linear):
    """Shared dispatch of the quantized formats: few float32 rows on the CPU to the compiled product,
    the rest through a de-quantized weight."""

    __slots__ = ("threads_fn", "prefetch_rows", "bf16_rows")

    def _setup(self, device: torch.device, bias, prefetch_rows: int | None, bf16_rows: bool) -> None:
        prefetch_rows = host_prefetch_rows() if prefetch_rows is None else prefetch_rows
        if prefetch_rows < 0:
            raise ValueError(f"prefetch_rows must be >= 0, not {prefetch_rows}")
        self.bias = bias
        self.prefetch_rows = prefetch_rows
        self.lib = kernels() if device.type == "cpu" else None
        self.threads_fn = torch.get_num_threads
        self.max_rows = self.lib.qm_max_rows() if self.lib is not None else 0  # rows the compiled product takes
        # more float32 rows than that: a bfloat16 GEMM where the CPU has one
        self.bf16_rows = bool(bf16_rows and self.lib is not None and bf16_products_here())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.lib is None:
            y = self._torch_product(x)
        elif self._compiled_rows(x):
            y = self._compiled(x)
        else:
            y = self._many(x)
        return y if self.bias is None else y.add_(self.bias)

    def add_into(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.lib is None or self.bias is not None or x.dtype != out.dtype:
            return out.add_(self(x))
        if self._compiled_into(out, x):
            return out
        if x.dtype == torch.float32 and self.bf16_rows:
            return out.add_(self._many(x))
        return out.addmm_(x, self.dequantized(x.dtype).t())

    def _many(self, x: torch.Tensor) -> torch.Tensor:
        """`x W^T` for more rows than the compiled product takes: the weight de-quantized, one GEMM."""
        if x.dtype == torch.float32 and self.bf16_rows:
            return F.linear(x.to(torch.bfloat16), self.dequantized(torch.bfloat16)).to(torch.float32)
        return F.linear(x, self.dequantized(x.dtype))

    def _torch_product(self, x: torch.Tensor) -> torch.Tensor:
        """`x W^T` with torch ops (devices, or no compiled kernels)."""
        return F.linear(x, self.dequantized(x.dtype))


class Int4Linear(_QuantLinear):
    """Group-wise int4 (engine.quant's stored layout): asymmetric, or symmetric with `mins` None (each
    minimum -8 times its scale, not stored: Q4_0's blocks). `int8_activations`: the compiled
    product quantizes its rows to int8 per 32 inputs and multiplies in integers where AVX-512 VNNI
    was compiled (MNN-LLM §4.2's W4A8; about 0.5% relative error per product on top of the
    weights'); False keeps float rows. `device_pack`: on CUDA, pack the weight for torch's
    `_weight_int4pack_mm` (bfloat16 rows) when the device and shape allow; the stored values then
    stay in host memory (the mapped file) and only the packed copy is on the device."""

    __slots__ = ("q", "scale", "mins", "group", "int8_activations", "packed", "scales_zeros")

    def __init__(self, q, scale, mins, group: int, *, bias=None, device=torch.device("cpu"),
                 int8_activations: bool = True, device_pack: bool = False,
                 prefetch_rows: int | None = None, bf16_rows: bool = False) -> None:
        device = torch.device(device)
        self.q, self.scale = _tensor(q), _tensor(scale)  # uint8 [n, k/2], fp16 [n, G]
        self.mins = None if mins is None else _tensor(mins)  # fp16 [n, G], or None: symmetric
        self.group = group
        self.n, half = self.q.shape
        self.k = 2 * half
        if self.scale.shape != (self.n, groups_of(self.k, group)) or (self.mins is not None
                                                                      and self.mins.shape != self.scale.shape):
            raise ValueError(f"int4 scales of shape {tuple(self.scale.shape)} do not fit a [{self.n}, {self.k}] "
                             f"weight at group {group}")
        self.packed = self.scales_zeros = None
        if device.type == "cuda" and device_pack:
            self._pack_for(device)
        if self.packed is None:
            self.q, self.scale = self.q.to(device), self.scale.to(device)
            self.mins = None if self.mins is None else self.mins.to(device)
        self._setup(device, bias, prefetch_rows, bf16_rows)
        self.int8_activations = bool(int8_activations and self.lib is not None and self.lib.qm_int8_activations())

    def _pack_for(self, device: torch.device) -> None:
        """torch's CUDA int4 layout: values two per byte (even index high), `_convert_weight_to_int4pack`
        with the most inner k-tiles the width allows, and per group `[scale, zero]` in bfloat16 for
        `(q - 8) * scale + zero` (so zero = min + 8 * scale). Leaves `packed` None where torch refuses
        (compute capability below 8.0, a width or group it does not take)."""
        n, k, g = self.n, self.k, self.group
        tiles = next((t for t in (8, 4, 2) if k % (16 * t) == 0), None)
        if g not in (32, 64, 128, 256) or k % g or n % 8 or tiles is None:
            return
        b = self.q.to(device).view(n, k // BLOCK, 1, BLOCK // 2)
        vals = torch.cat((b & 15, b >> 4), dim=2).view(n, k).to(torch.int32)
        scale = self.scale.to(device).float()
        zero = torch.zeros_like(scale) if self.mins is None else self.mins.to(device).float() + 8 * scale
        try:
            packed = torch._convert_weight_to_int4pack(((vals[:, ::2] << 4) | vals[:, 1::2]).to(torch.uint8), tiles)
            sz = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
            torch._weight_int4pack_mm(torch.zeros(1, k, dtype=torch.bfloat16, device=device), packed, g, sz)
        except (RuntimeError, NotImplementedError, AttributeError):
            return
        self.packed, self.scales_zeros = packed, sz

    def _torch_product(self, x):
        if self.packed is None:
            return super()._torch_product(x)
        rows = x.reshape(-1, self.k).to(torch.bfloat16).contiguous()
        y = torch._weight_int4pack_mm(rows, self.packed, self.group, self.scales_zeros)
        return y.to(x.dtype).view(*x.shape[:-1], self.n)

    def _product(self, x, y, *, accumulate):
        rc = self.lib.q4_matmul(x.data_ptr(), x.shape[0], x.stride(0), self.k, self.q.data_ptr(),
                                self.scale.data_ptr(), self.mins_address(), self.n, self.group, y.data_ptr(),
                                y.stride(0), int(accumulate), self.threads_fn(), int(self.int8_activations),
                                self.prefetch_rows)
        if rc:
            raise RuntimeError("int4 product refused its arguments")

    def dequantized(self, dtype=torch.float32) -> torch.Tensor:
        if self.lib is not None and dtype in (torch.float32, torch.bfloat16):
            out = torch.empty(self.n, self.k, dtype=dtype)
            rc = self.lib.q4_dequantize(self.q.data_ptr(), self.scale.data_ptr(), self.mins_address(), self.n,
                                        self.k, self.group, out.data_ptr(), self.k, int(dtype == torch.bfloat16),
                                        self.threads_fn())
            if rc:
                raise RuntimeError("int4 de-quantize refused its arguments")
            return out
        n, k = self.n, self.k
        b = self.q.view(n, k // BLOCK, 1, BLOCK // 2)
        vals = torch.cat((b & 15, b >> 4), dim=2).view(n, k).float()
        scale = self.scale.float().repeat_interleave(self.group, dim=1)[:, :k]
        mins = -8 * scale if self.mins is None else self.mins.float().repeat_interleave(self.group, dim=1)[:, :k]
        return vals.mul_(scale).add_(mins).to(device=self.device, dtype=dtype)

    def mins_address(self) -> int:
        """The minimums' address for the compiled kernels (0: symmetric)."""
        return 0 if self.mins is None else self.mins.data_ptr()

    @property
    def device(self) -> torch.device:
        return self.q.device if self.packed is None else self.packed.device

    def resident_bytes(self) -> int:
        if self.packed is not None:
            return self.packed.numel() * self.packed.element_size() + 2 * self.scales_zeros.numel()
        return self.q.numel() + 2 * self.scale.numel() + (0 if self.mins is None else 2 * self.mins.numel())


class Int8Linear(_QuantLinear):
    """Per-row symmetric int8."""

    __slots__ = ("q", "scale")

    def __init__(self, q, scale, *, bias=None, device=torch.device("cpu"), prefetch_rows: int | None = None,
                 bf16_rows: bool = False) -> None:
        self.q = _tensor(q).to(device)  # [n, k] int8
        self.scale = _tensor(scale).to(device)  # [n] float32
        self.n, self.k = self.q.shape
        if self.scale.shape != (self.n,):
            raise ValueError(f"int8 scales of shape {tuple(self.scale.shape)} for a [{self.n}, {self.k}] weight")
        self._setup(torch.device(device), bias, prefetch_rows, bf16_rows)

    def _product(self, x, y, *, accumulate):
        rc = self.lib.q8_matmul(x.data_ptr(), x.shape[0], x.stride(0), self.k, self.q.data_ptr(),
                                self.scale.data_ptr(), self.n, y.data_ptr(), y.stride(0), int(accumulate),
                                self.threads_fn(), self.prefetch_rows)
        if rc:
            raise RuntimeError("int8 product refused its arguments")

    def dequantized(self, dtype=torch.float32) -> torch.Tensor:
        if self.lib is not None and dtype in (torch.float32, torch.bfloat16):
            out = torch.empty(self.n, self.k, dtype=dtype)
            rc = self.lib.q8_dequantize(self.q.data_ptr(), self.scale.data_ptr(), self.n, self.k, out.data_ptr(),
                                        self.k, int(dtype == torch.bfloat16), self.threads_fn())
            if rc:
                raise RuntimeError("int8 de-quantize refused its arguments")
            return out
        return (self.q.float() * self.scale.float()[:, None]).to(dtype)

    def _torch_product(self, x):
        return F.linear(x, self.q.to(x.dtype)).mul_(self.scale.to(x.dtype))

    def rows(self, ids: torch.Tensor, dtype) -> torch.Tensor:
        """Rows `ids` of the de-quantized weight (a tied model's embeddings)."""
        return (self.q[ids].float() * self.scale[ids].unsqueeze(1)).to(dtype)

    @property
    def device(self) -> torch.device:
        return self.q.device

    def resident_bytes(self) -> int:
        return self.q.numel() + 4 * self.scale.numel()


class Embedding:
    """Token rows, read per token: from a float table (kept in its stored type, converted per row) or
    from a tied model's int8 LM head."""

    __slots__ = ("table", "head", "dtype")

    def __init__(self, dtype, *, table: torch.Tensor | None = None, head: Int8Linear | None = None) -> None:
        if (table is None) == (head is None):
            raise ValueError("an embedding reads a table or an int8 head")
        self.table, self.head, self.dtype = table, head, dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.head is not None:
            return self.head.rows(ids, self.dtype)
        rows = self.table[ids.to(self.table.device)]
        return rows.to(device=ids.device, dtype=self.dtype)

    @property
    def device(self) -> torch.device:
        return self.table.device if self.table is not None else self.head.device


__all__ = ["Linear", "FloatLinear", "Int4Linear", "Int8Linear", "Embedding", "kernels"]
