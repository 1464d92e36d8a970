"""How a working set stores K/V: `float` (the compute dtype) or `kv8` (MNN-LLM §4.2's quantized KV).

This module deliberately knows nothing about chunks, contexts or files: it converts rows of K and V.

`kv8` keeps one row of `D + 4` bytes per token and KV head: the head's `D` values, then one float32
scale (little-endian) for the row. Keys are int8, symmetric over the head dimension (scale = max |k| /
127, so the largest value is exact); values are fp8 e4m3 (scale = max |v| / 448, e4m3's largest
finite value). One row of a 64-wide head takes 68 bytes against 256 in float32, 26.6%. Both
conversions are idempotent: packing the unpacked values of a row gives the same bytes (the largest
value of a row comes back as exactly the scale times 127 or 448; checked by tests/engine/test_kvformat.py),
so a chunk stored from a `kv8` working set and read back is the same bytes whether it travelled as
bytes or as values.
"""

from __future__ import annotations

import torch

from engine.config import KV8_SCALE_BYTES as SCALE_BYTES

KEY_MAX = 127.0  # int8
VALUE_MAX = 448.0  # float8 e4m3fn's largest finite value


def row_bytes(head_dim: int) -> int:
    """Bytes of one `kv8` row: the values and their scale."""
    return head_dim + SCALE_BYTES


def _scales(x: torch.Tensor, top: float) -> torch.Tensor:
    """Per-row scales `[..., 1]` in float32; 1 for a row of zeros (which then packs to zeros)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    return torch.where(amax > 0, amax / top, torch.ones_like(amax))


def pack_keys(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `[..., D]` of keys -> uint8 `[..., D + 4]` (int8 values, float32 scale)."""
    s = _scales(x, KEY_MAX)
    q = torch.round(x.float() / s).clamp_(-KEY_MAX, KEY_MAX).to(torch.int8)
    return _join(q.view(torch.uint8), s, out)


def pack_values(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `[..., D]` of values -> uint8 `[..., D + 4]` (fp8 e4m3 values, float32 scale)."""
    s = _scales(x, VALUE_MAX)
    q = (x.float() / s).clamp_(-VALUE_MAX, VALUE_MAX).to(torch.float8_e4m3fn)
    return _join(q.view(torch.uint8), s, out)


def _join(q: torch.Tensor, s: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    d = q.shape[-1]
    if out is None:
        out = torch.empty(*q.shape[:-1], d + SCALE_BYTES, dtype=torch.uint8, device=q.device)
    out[..., :d] = q
    out[..., d:] = s.view(torch.uint8)
    return out


def scales(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scales `[..., 1]` of uint8 rows `[..., D + 4]` (a view)."""
    return rows[..., -SCALE_BYTES:].view(torch.float32)


def unpack_keys(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 `[..., D + 4]` -> keys `[..., D]` in `dtype` (a new tensor)."""
    q = rows[..., :-SCALE_BYTES].view(torch.int8)
    return (q.float() * scales(rows)).to(dtype)


def unpack_values(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 `[..., D + 4]` -> values `[..., D]` in `dtype` (a new tensor)."""
    q = rows[..., :-SCALE_BYTES].view(torch.float8_e4m3fn)
    return (q.float() * scales(rows)).to(dtype)


def pack(kv: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A chunk `[L, 2, Hkv, T, D]` of floats -> uint8 `[L, 2, Hkv, T, D + 4]`."""
    if out is None:
        out = torch.empty(*kv.shape[:-1], row_bytes(kv.shape[-1]), dtype=torch.uint8, device=kv.device)
    pack_keys(kv[:, 0], out[:, 0])
    pack_values(kv[:, 1], out[:, 1])
    return out


def unpack(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 `[L, 2, Hkv, T, D + 4]` -> floats `[L, 2, Hkv, T, D]` in `dtype`."""
    return torch.stack([unpack_keys(rows[:, 0], dtype), unpack_values(rows[:, 1], dtype)], dim=1)


def poison(rows: torch.Tensor) -> None:
    """Make rows read as NaN (their scales), as a float working set's dropped slots do."""
    scales(rows).fill_(float("nan"))
