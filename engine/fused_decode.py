"""Decode's layers in one compiled call each (engine/fused_decode.c).

This module deliberately knows nothing about files, formats on disk or the service: it is given a
loaded `engine.model.Transformer` whose products are the compiled ones of `engine.qlinear` (fp32,
bf16, int8 or int4 weights on the CPU, float32 rows, no biases) and the compiled attention library,
describes each layer once to `fd_layer`, and runs a layer over up to 8 rows (a decode step, a lookup
pass) in one call. Between the products and attention a decode row is a few thousand floats, and in
torch a layer of them was about 40 operators and their Python: at the default model's 30 layers
about 3.7 of 9.6 ms an int4 token (docs/benchmarks.md, "Tuning at the edge"). `fused_step` says
when it applies; otherwise the Transformer runs its torch layer (adapters, a streamed working set or
weights, kv8, hooks).
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from pathlib import Path

import torch

from engine import native
from engine.qlinear import FloatLinear, Int4Linear, Int8Linear, kernels

MAX_ROWS = 8
"""Rows one call takes (the compiled products' limit)."""

_i64, _ptr, _int, _float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class _Lin(ctypes.Structure):
    """`lin_t`: one weight."""

    _fields_ = [("kind", _int), ("int8_activations", _int), ("prefetch_rows", _int), ("pad", _int),
                ("q", _ptr), ("scale", _ptr), ("mins", _ptr), ("n", _i64), ("k", _i64), ("group", _i64)]


class _Layer(ctypes.Structure):
    """`layer_t`: one decoder layer and the kernels it runs on."""

    _fields_ = [("hidden", _i64), ("hq", _i64), ("hkv", _i64), ("d", _i64), ("inter", _i64), ("eps", _float),
                ("attn_scale", _float), ("attn_norm", _ptr), ("mlp_norm", _ptr), ("qkv", _Lin), ("o", _Lin),
                ("gate_up", _Lin), ("down", _Lin), ("cos", _ptr), ("sin_half", _ptr), ("q4", _ptr), ("q8", _ptr),
                ("fm", _ptr), ("attn", _ptr)]


_LIB: list = []  # [library or None]
_BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Transformer -> FusedDecode or None


def _library():
    if not _LIB:
        lib = native.load("fused_decode", Path(__file__).with_name("fused_decode.c"), native.FAST_FLAGS)
        if lib is not None:
            lib.fd_layer.argtypes = (ctypes.POINTER(_Layer), _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _int)
            lib.fd_layer.restype = _int
            lib.fd_scratch_floats.argtypes = (_i64,) * 6
            lib.fd_scratch_floats.restype = _i64
        _LIB.append(lib)
    return _LIB[0]


def _lin(lin) -> _Lin | None:
    """A compiled product's description, or None where the layer's product is not one."""
    if lin.bias is not None:
        return None
    if isinstance(lin, FloatLinear):
        if lin.lib is None:
            return None
        return _Lin(32 if lin.weight.dtype == torch.float32 else 16, 0, 0, 0, lin.weight.data_ptr(), None, None,
                    lin.n, lin.k, 0)
    if not isinstance(lin, (Int4Linear, Int8Linear)) or lin.lib is None:
        return None
    if isinstance(lin, Int4Linear):
        if lin.packed is not None:
            return None
        return _Lin(4, int(lin.int8_activations), lin.prefetch_rows, 0, lin.q.data_ptr(), lin.scale.data_ptr(),
                    lin.mins_address(), lin.n, lin.k, lin.group)
    return _Lin(8, 0, lin.prefetch_rows, 0, lin.q.data_ptr(), lin.scale.data_ptr(), None, lin.n, lin.k, 0)


def _address(f) -> int:
    """The address of a ctypes function of a loaded library."""
    return ctypes.cast(f, ctypes.c_void_p).value


class FusedDecode:
    """A Transformer's layers described to `fd_layer`; `step` has `Transformer._layer`'s signature."""

    def __init__(self, model, lib, structs: list[_Layer]) -> None:
        self.model, self.lib, self.structs = model, lib, structs
        cfg = model.cfg
        self.scratch_floats = lib.fd_scratch_floats(cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                                                    structs[0].inter, MAX_ROWS)
        self._local = threading.local()  # one scratch buffer per calling thread

    @classmethod
    def build(cls, model, attention_lib) -> FusedDecode | None:
        """The fused layers of `model`, or None where any layer is not one `fd_layer` runs."""
        lib, qm = _library(), kernels()
        cfg = model.cfg
        if lib is None or qm is None or attention_lib is None or model.dtype != torch.float32:
            return None
        structs = []
        for w in model.w.layers:
            lins = [_lin(x) for x in (w.wqkv, w.wo, w.w_gate_up, w.w_down)]
            norms = (w.attn_norm, w.mlp_norm)
            if (any(x is None for x in lins) or lins[2].n % 2
                    or any(t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu" for t in norms)):
                return None
            structs.append(_Layer(cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, lins[2].n // 2,
                                  cfg.rms_norm_eps, model.scale, w.attn_norm.data_ptr(), w.mlp_norm.data_ptr(),
                                  *lins, model.cos.data_ptr(), model.sin_half.data_ptr(), _address(qm.q4_matmul),
                                  _address(qm.q8_matmul), _address(qm.f_matmul), _address(attention_lib.attn_rows)))
        return cls(model, lib, structs)

    def step(self, layer, x, pos, cache, *, contiguous, density, sdpa, adapter=None):
        """`Transformer._layer` over rows `x` `[n, hidden]` (n <= MAX_ROWS), in one call (the torch layer for
        rows or a density it cannot take as they are)."""
        if not x.is_contiguous() or (density is not None and not density.is_contiguous()):
            return self.model._layer(layer, x, pos, cache, contiguous=contiguous, density=density, sdpa=sdpa)
        ws = getattr(self._local, "ws", None)
        if ws is None:
            ws = self._local.ws = torch.empty(self.scratch_floats, dtype=torch.float32)
        kv = cache.kv  # [L, 2, Hkv, T, D], float32; re-read each call: the working set may have grown
        base, item = kv.data_ptr(), kv.element_size()
        k = base + layer * kv.stride(0) * item
        rc = self.lib.fd_layer(self.structs[layer], ws.data_ptr(), x.data_ptr(), x.shape[0], pos.data_ptr(), k,
                               k + kv.stride(1) * item, kv.stride(2),
                               density.data_ptr() if density is not None else None, torch.get_num_threads())
        if rc:
            raise RuntimeError(f"fused decode layer {layer} failed ({rc})")
        return x


def fused_step(model, cache, n: int, *, sdpa: bool, adapter, partitions: int):
    """`FusedDecode.step` where it applies to this pass (switched on, at most MAX_ROWS rows in one
    partition, no adapter, no torch attention asked for, no hooks, resident weights, a resident float
    working set, every product a compiled one on the CPU and the compiled attention), else None."""
    if not (model.engine_cfg.fused_decode and 1 <= n <= MAX_ROWS and partitions == 1 and not sdpa
            and adapter is None and model.step_hook is None and model.weight_pager is None
            and cache.kv_format == "float" and cache.pager is None and model.compiled_attention):
        return None
    if model not in _BUILT:
        from engine.attention import attention_kernel

        _BUILT[model] = FusedDecode.build(model, attention_kernel())
    built = _BUILT[model]
    return built.step if built is not None else None
