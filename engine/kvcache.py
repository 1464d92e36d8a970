"""A context's K/V working buffer, addressed in fixed-size chunks.

This module deliberately knows nothing about tokens, compression or files.

K and V live in one tensor `kv: [L, 2, Hkv, capacity, D]`, so attention reads one strided view per layer
(`k[layer]`, `v[layer]`) and a chunk's slots `kv[:, :, :, s:e]` have exactly the layout of the storage
codecs, which decode straight into them. The slot of a token is its position in the context. The
tensor may wrap an external buffer (e.g. shared memory that a recompute worker in another process
writes into); such a cache has a fixed capacity. The buffer is divided into chunks of
`chunk_tokens` slots. A chunk can be exported as a numpy array `[L, 2, Hkv, T, D]` (the layout the storage
codecs use), dropped, and put back whole (or written layer by layer into `kv` and marked present).

In the `kv8` format (engine/kvformat.py) the same tensor is uint8 `[L, 2, Hkv, capacity, D + 4]`: each
slot holds its quantized row and the row's scale, so every chunk move above works on bytes unchanged,
and K/V enter and leave as floats only through `write` and `layer_kv`.

Invariant: attention only ever reads slots `< length` of chunks that are present. Dropped chunks are
filled with NaN (in `kv8`, their scales) so that a read of missing K/V poisons the output instead of
passing silently.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from engine import kvformat
from engine.config import ModelConfig, ceil_div, check_kv_format, round_up


def buffer_shape(cfg: ModelConfig, capacity: int, kv_format: str) -> tuple[int, ...]:
    """The shape of a working set's buffer: `[L, 2, Hkv, capacity, D]`, rows of `D + 4` bytes in kv8."""
    d = kvformat.row_bytes(cfg.head_dim) if kv_format == "kv8" else cfg.head_dim
    return (cfg.n_layers, 2, cfg.n_kv_heads, capacity, d)


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        chunk_tokens: int,
        device: torch.device,
        dtype: torch.dtype,
        capacity: int = 0,
        kv_format: str = "float",
    ) -> None:
        self.cfg = cfg
        self.chunk_tokens = chunk_tokens
        self.device = device
        self.dtype = dtype
        """The compute dtype: what `layer_kv` gives and `write` takes."""
        self.kv_format = check_kv_format(kv_format)
        if kv_format == "kv8" and cfg.head_dim % 4:
            raise ValueError(f"the kv8 format needs a head dim divisible by 4, not {cfg.head_dim}")
        cap = round_up(max(capacity, chunk_tokens), chunk_tokens)
        self.kv = torch.empty(self._shape(cap), device=device, dtype=self._storage_dtype())
        """[L, 2, Hkv, cap, D] in the compute dtype, or uint8 [L, 2, Hkv, cap, D + 4] in kv8."""
        self.fixed = False
        """True when `kv` wraps an external buffer: no growth."""
        self.length = 0
        """Slots in use (tokens of the context with K/V here or missing), in tokens."""
        self.missing: set[int] = set()
        """Chunk indices whose slots hold no valid K/V."""
        self.pager = None
        """For a working set over a mapped file (`mapped`): which layers stay in memory
        (engine.kvspill.LayerPager); None: all of them, always."""

    @classmethod
    def wrap(cls, cfg: ModelConfig, buffer: torch.Tensor, *, chunk_tokens: int,
             dtype: torch.dtype | None = None) -> "KVCache":
        """A cache over an existing `[L, 2, Hkv, capacity, D]` tensor (not copied, never grown). A uint8
        buffer with rows of `D + 4` is a `kv8` working set computed in `dtype` (default float32)."""
        kv8 = buffer.dtype == torch.uint8
        expect = buffer_shape(cfg, buffer.shape[3], "kv8" if kv8 else "float")
        if tuple(buffer.shape) != expect:
            raise ValueError(f"KV buffer shape {tuple(buffer.shape)} does not match {expect}")
        c = cls.__new__(cls)
        c.cfg, c.chunk_tokens, c.device = cfg, chunk_tokens, buffer.device
        c.dtype = (dtype or torch.float32) if kv8 else buffer.dtype
        c.kv_format = "kv8" if kv8 else "float"
        c.kv, c.fixed, c.length, c.missing, c.pager = buffer, True, 0, set(), None
        return c

    @classmethod
    def mapped(cls, cfg: ModelConfig, path: str | os.PathLike, capacity: int, *, chunk_tokens: int,
               dtype: torch.dtype, kv_format: str = "float", create: bool = True) -> "KVCache":
        """A CPU working set of `capacity` tokens over the file at `path` mapped shared (engine/kvspill.py;
        `create`: a new sparse file, else one another process made): the pages of its layers can leave
        memory for the file and come back per layer (`pager`), and another process can map the same file
        (`create=False`)."""
        from engine.kvspill import LayerPager, MappedFile

        shape = buffer_shape(cfg, round_up(max(capacity, chunk_tokens), chunk_tokens), check_kv_format(kv_format))
        storage = torch.uint8 if kv_format == "kv8" else dtype
        nbytes = storage.itemsize
        for s in shape:
            nbytes *= s
        f = MappedFile(path, nbytes, create=create)
        c = cls.wrap(cfg, f.tensor(shape, storage), chunk_tokens=chunk_tokens, dtype=dtype)
        row = shape[1] * shape[2] * shape[4] * storage.itemsize  # one token's K/V in one layer
        c.pager = LayerPager(f, cfg.n_layers, nbytes // cfg.n_layers, row, os.path.dirname(os.path.abspath(path)))
        return c

    def _shape(self, cap: int) -> tuple[int, ...]:
        return buffer_shape(self.cfg, cap, self.kv_format)

    def _storage_dtype(self) -> torch.dtype:
        return torch.uint8 if self.kv_format == "kv8" else self.dtype

    @property
    def storage_name(self) -> str:
        """How a chunk's array is typed for the storage codecs (`storage.codecs.COMPUTE_DTYPES`):
        the compute dtype's name, or `kv8`."""
        return "kv8" if self.kv_format == "kv8" else str(self.dtype).removeprefix("torch.")

    @property
    def k(self) -> torch.Tensor:
        """Keys `[L, Hkv, cap, D]` of a float working set (a view)."""
        self._check_float()
        return self.kv[:, 0]

    @property
    def v(self) -> torch.Tensor:
        """Values `[L, Hkv, cap, D]` of a float working set (a view)."""
        self._check_float()
        return self.kv[:, 1]

    def _check_float(self) -> None:
        if self.kv_format != "float":
            raise TypeError(f"a {self.kv_format} working set has no float view; use layer_kv")

    # ---- K/V of a layer as floats -------------------------------------------------------------------
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, contiguous: bool) -> None:
        """Store K and V `[Hkv, n, D]` of rows at positions `pos` (`contiguous`: `pos` is one run)."""
        if self.kv_format == "kv8":
            k, v = kvformat.pack_keys(k), kvformat.pack_values(v)
        if contiguous:
            s = int(pos[0])
            n = k.shape[1]
            self.kv[layer, 0, :, s : s + n] = k
            self.kv[layer, 1, :, s : s + n] = v
        else:
            self.kv[layer, 0].index_copy_(1, pos, k)
            self.kv[layer, 1].index_copy_(1, pos, v)

    def layer_kv(self, layer: int, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[Hkv, n_tokens, D]` of slots `[0, n_tokens)` of `layer` in the compute dtype:
        views of a float working set, de-quantized copies of a `kv8` one."""
        k, v = self.kv[layer, 0, :, :n_tokens], self.kv[layer, 1, :, :n_tokens]
        if self.kv_format == "kv8":
            return kvformat.unpack_keys(k, self.dtype), kvformat.unpack_values(v, self.dtype)
        return k, v

    # ---- geometry -------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.kv.shape[3]

    @property
    def n_chunks(self) -> int:
        return ceil_div(self.length, self.chunk_tokens)

    def chunk_range(self, i: int) -> tuple[int, int]:
        """Token range [start, end) of chunk `i`; the last chunk may be partial."""
        if not 0 <= i < self.n_chunks:
            raise IndexError(f"chunk {i} out of range (context has {self.n_chunks} chunks)")
        s = i * self.chunk_tokens
        return s, min(s + self.chunk_tokens, self.length)

    def nbytes(self) -> int:
        """Bytes of the buffer as allocated (both K and V)."""
        return self.kv.numel() * self.kv.element_size()

    def chunk_nbytes(self) -> int:
        """Bytes of one chunk's slots in the buffer (every layer, K and V)."""
        return self.nbytes() // self.capacity * self.chunk_tokens

    def ensure_capacity(self, n_tokens: int) -> None:
        """Grow (by doubling, in whole chunks) so that `n_tokens` slots fit."""
        if n_tokens <= self.capacity:
            return
        if self.fixed:
            raise ValueError(f"context of {n_tokens} tokens exceeds the working set of {self.capacity}")
        cap = round_up(max(n_tokens, 2 * self.capacity), self.chunk_tokens)
        kv = torch.empty(self._shape(cap), device=self.device, dtype=self._storage_dtype())
        kv[:, :, :, : self.length].copy_(self.kv[:, :, :, : self.length])
        self.kv = kv

    def reserve(self, n_tokens: int) -> int:
        """Extend `length` by `n_tokens` slots (to be written by a forward pass); return the first slot."""
        start = self.length
        self.ensure_capacity(start + n_tokens)
        self.length = start + n_tokens
        return start

    def truncate(self, n_tokens: int) -> None:
        """Forget slots from `n_tokens` on (e.g. after a failed forward)."""
        self.length = min(self.length, n_tokens)
        self.missing = {i for i in self.missing if i < self.n_chunks}

    # ---- chunk moves --------------------------------------------------------------------------
    def chunk_view(self, i: int) -> torch.Tensor:
        """Chunk `i`'s slots as a view `[L, 2, Hkv, T, D]` (no copy)."""
        s, e = self.chunk_range(i)
        return self.kv[:, :, :, s:e]

    def export_chunk(self, i: int) -> np.ndarray:
        """A copy of chunk `i` as `[L, 2, Hkv, T, D]` in the compute dtype (bf16 as a uint16 view; kv8 as
        its uint8 rows)."""
        self._check_present(i)
        return _to_numpy(self.chunk_view(i))

    def chunk_array(self, i: int) -> np.ndarray:
        """Chunk `i` as a numpy `[L, 2, Hkv, T, D]` for encoding: on the CPU a view of the slots (no copy;
        valid until they are next written), elsewhere a copy in host memory."""
        self._check_present(i)
        v = self.chunk_view(i).detach()
        if v.device.type != "cpu":
            return _to_numpy(v)
        return (v.view(torch.uint16) if v.dtype == torch.bfloat16 else v).numpy()

    def drop_chunk(self, i: int) -> None:
        """Mark chunk `i` missing and poison its slots."""
        if self.kv_format == "kv8":
            kvformat.poison(self.chunk_view(i))
        else:
            self.chunk_view(i).fill_(float("nan"))
        self.missing.add(i)

    def put_chunk(self, i: int, kv: np.ndarray | torch.Tensor) -> None:
        """Write chunk `i` from `[L, 2, Hkv, T, D]` (in a kv8 working set: its uint8 rows, or floats,
        which are packed) and mark it present."""
        view = self.chunk_view(i)
        if self.kv_format == "kv8" and kv.dtype not in (np.uint8, torch.uint8):
            t = torch.from_numpy(kv) if isinstance(kv, np.ndarray) else kv
            expect = tuple(view.shape[:-1]) + (self.cfg.head_dim,)
            if tuple(t.shape) != expect:
                raise ValueError(f"chunk shape {tuple(t.shape)} does not match expected {expect}")
            kvformat.pack(t.to(view.device), out=view)
        else:
            view.copy_(self._as_tensor(kv, tuple(view.shape)))
        self.missing.discard(i)

    def mark_present(self, chunks) -> None:
        self.missing.difference_update(chunks)

    def _check_present(self, i: int) -> None:
        if i in self.missing:
            raise KeyError(f"chunk {i} is missing; restore it before exporting")

    def _as_tensor(self, kv, shape) -> torch.Tensor:
        if isinstance(kv, np.ndarray):
            if kv.dtype == np.uint16 and self.dtype == torch.bfloat16:
                t = torch.from_numpy(kv).view(torch.bfloat16)
            else:
                t = torch.from_numpy(kv)
        else:
            t = kv
        if tuple(t.shape) != shape:
            raise ValueError(f"chunk shape {tuple(t.shape)} does not match expected {shape}")
        return t


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """A contiguous numpy copy of `t`. On the CPU numpy makes the copy, not torch: callers include the
    executor's write-back thread, and a torch op that runs in parallel from a second thread gives that
    thread an OpenMP team of its own, which stays alive with it and slows every later parallel op
    of the main thread's team (see engine/threads.py)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.uint16)
    if t.device.type == "cpu":
        return np.array(t.numpy(), order="C", copy=True)
    return t.contiguous().cpu().numpy()
