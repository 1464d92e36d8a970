"""Attention of query rows against a context's K/V: the three kernels a forward pass picks from, and the
compiled libraries behind the first. This module deliberately knows nothing of weights, layers or the
model's other steps (`engine.model` picks the kernel), and knows the cache only through
`KVCache.layer_kv` and its stored rows.

- `attend_native`: `engine/attention.c` (and `engine/attention_bf16.c` for bf16 products of 16 rows or
  more), built at first use by `engine.native` on torch's own OpenMP team: CPU, float32 compute.
- `attend_blockwise`: the torch kernel in blocks of query rows (other devices, no compiler,
  `EngineConfig.native_attention=False`); both accumulate information density (LLMS Eq. 1).
- `attend_sdpa`: torch's fused kernel without density, for comparisons.

Rows `q` are `[n, Hq, D]` at ascending positions `pos` (query heads grouped over `Hkv` K/V heads); each
returns `[n, Hq D]`.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.kvcache import KVCache
from engine.threads import load_on_torch_team

SCORE_BUDGET_BYTES = 9 << 19  # attention scores per row block in prefill: 64-row blocks at 2048 tokens. 64-row
# blocks beat 32- and 48-row ones at 2048 tokens, and under load from other processes fewer, larger blocks
# suffer less from OpenMP barrier waits; blocks of hundreds of rows spill a 2 MiB L2 and cost more
NATIVE_MIN_ROWS = 16  # fewer query rows (decode, a short turn) run attn_rows: attn_forward copies K
# transposed once per call, which pays off from 16 rows on (0.45 against 0.70 ms at 1,024 keys, 3.7 against
# 6.8 ms at 6,000, on this project's VM)
MAX_BLOCK_ROWS = 64  # so shorter prompts get 64-row blocks too (the budget alone gives 256 rows at 512 tokens:
# 2 blocks, a third of the scores masked, which is slower)

_ATTENTION: list = []  # [library or None]: engine/attention.c, built on first use
_ATTENTION_BF16: list = []  # [library or None, mode]: engine/attention_bf16.c, built on first use
BF16_ATTENTION_MODES = ("none", "AVX-512 BF16 dot products", "AMX tiles")  # by attn_bf16_init's answer


def declare_attention(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the C signatures of a loaded engine/attention.c."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.attn_forward.argtypes = (ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, ctypes.c_float,
                                 ptr, i64, ptr, ctypes.c_int)
    lib.attn_forward.restype = ctypes.c_int
    lib.attn_rows.argtypes = lib.attn_forward.argtypes
    lib.attn_rows.restype = ctypes.c_int
    lib.attn_rows_kv8.argtypes = lib.attn_forward.argtypes
    lib.attn_rows_kv8.restype = ctypes.c_int
    lib.attn_openmp.argtypes = ()
    lib.attn_openmp.restype = ctypes.c_int
    return lib


def attention_kernel():
    """The compiled attention kernel with its signature declared, or None (off, or no compiler); its
    threads are torch's own OpenMP team where they can be (`engine.threads.load_on_torch_team`)."""
    if not _ATTENTION:
        lib = load_on_torch_team("attention", Path(__file__).with_name("attention.c"))
        _ATTENTION.append(declare_attention(lib) if lib is not None else None)
    return _ATTENTION[0]


def bf16_attention_kernel():
    """engine/attention_bf16.c with its signature declared where it builds with AVX-512 BF16, else None; on AMX
    tiles where the build has them and Linux grants this process the tile state (`bf16_attention_mode`)."""
    if not _ATTENTION_BF16:
        lib = load_on_torch_team("attention_bf16", Path(__file__).with_name("attention_bf16.c"))
        mode = 0
        if lib is not None and attention_kernel() is not None:  # it takes attn_forward's arguments
            lib.attn_bf16_init.argtypes, lib.attn_bf16_init.restype = (ctypes.c_int,), ctypes.c_int
            lib.attn_forward_bf16.argtypes, lib.attn_forward_bf16.restype = attention_kernel().attn_forward.argtypes, ctypes.c_int
            mode = lib.attn_bf16_init(1)
        _ATTENTION_BF16.extend((lib if mode else None, BF16_ATTENTION_MODES[mode]))
    return _ATTENTION_BF16[0]


def bf16_attention_mode() -> str:
    """How `bf16_attention_kernel` multiplies here: "AMX tiles", "AVX-512 BF16 dot products" or "none"."""
    bf16_attention_kernel()
    return _ATTENTION_BF16[1]


def attend_blockwise(cfg: ModelConfig, layer: int, q: torch.Tensor, pos: torch.Tensor, cache: KVCache,
                     density: torch.Tensor | None, scale: float, block_rows: int = 0) -> torch.Tensor:
    """Attention of rows `q` over the cache in torch, blockwise (`block_rows`: rows per block, 0: sized
    from `SCORE_BUDGET_BYTES`).

    Query rows are processed in blocks of about `SCORE_BUDGET_BYTES` of scores, through two buffers
    reused by every block (fresh multi-MiB tensors per block cost page faults). Within a
    block, keys before the block's first position are visible to every row, so only the columns from
    there on need a mask; for prefill that is a `b x b` triangle. With `density`, the column sums of
    the probabilities are accumulated per KV head with one GEMV per block and added once per layer.
    """
    n, hkv, g, d = q.shape[0], cfg.n_kv_heads, cfg.group, cfg.head_dim
    dev = q.device
    qg = (q * scale).view(n, hkv, g, d).transpose(0, 1).reshape(hkv, n * g, d)  # [Hkv, n G, D]
    s_all = int(pos[-1]) + 1
    keys, vals = cache.layer_kv(layer, s_all)  # [Hkv, S, D] each
    rows = block_rows or max(
        16, min(MAX_BLOCK_ROWS, SCORE_BUDGET_BYTES // (4 * cfg.n_heads * s_all)))
    rows = -(-n // -(-n // rows))  # equal blocks: no short last block
    out = torch.empty(hkv, n * g, d, device=dev, dtype=q.dtype)  # [Hkv, n G, D], rows ordered (n, G)
    size = hkv * min(n, rows) * g * s_all
    s_buf = torch.empty(size, device=dev, dtype=q.dtype)
    p_buf = torch.empty(size, device=dev, dtype=torch.float32)
    if density is not None:
        col = torch.zeros(hkv, 1, s_all, device=dev, dtype=torch.float32)  # [Hkv, 1, S]
        ones = torch.ones(hkv, 1, min(n, rows) * g, device=dev, dtype=torch.float32)
    pos_list = pos.tolist()
    prefill = pos_list[-1] - pos_list[0] == n - 1  # contiguous rows: every block's mask is one triangle
    tri = None
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        b = r1 - r0
        p0, sb = pos_list[r0], pos_list[r1 - 1] + 1
        m = hkv * b * g * sb
        scores = s_buf[:m].view(hkv, b * g, sb)  # [Hkv, b G, Sb]
        torch.bmm(qg[:, r0 * g : r1 * g], keys[:, :sb].transpose(1, 2), out=scores)
        if b > 1:
            if not prefill:
                kpos = torch.arange(p0, sb, device=dev)
                masked = (kpos.unsqueeze(0) > pos[r0:r1].unsqueeze(1)).unsqueeze(1)  # [b, 1, Sb - p0]
            elif tri is None or tri.shape[0] != b:
                tri = masked = torch.ones(b, b, dtype=torch.bool, device=dev).triu_(1).unsqueeze(1)
            else:
                masked = tri
            scores.view(hkv, b, g, sb)[..., p0:].masked_fill_(masked, float("-inf"))
        probs = torch.softmax(scores, -1, dtype=torch.float32, out=p_buf[:m].view(hkv, b * g, sb))
        if density is not None:
            col[..., :sb] += torch.bmm(ones[..., : b * g], probs)  # column sums of P, per KV head
        torch.bmm(probs.to(vals.dtype), vals[:, :sb], out=out[:, r0 * g : r1 * g])
    if density is not None:
        density[:s_all] += col.sum(dim=(0, 1))
    return out.view(hkv, n, g, d).transpose(0, 1).reshape(n, cfg.n_heads * d)


def attend_native(cfg: ModelConfig, layer: int, q: torch.Tensor, pos: torch.Tensor, cache: KVCache,
                  density: torch.Tensor | None, scale: float, bf16: bool = False) -> torch.Tensor:
    """`attend_blockwise` in engine/attention.c: the same result up to float32 rounding (tested against the
    naive reference) on the process's torch thread count. 16 rows or more run `attn_forward` (one
    fused pass per block of rows against the keys transposed once per call: faster than
    `attn_rows` from 16 rows on, against 1,024 keys as against 6,000), or `attn_forward_bf16` where
    `bf16` says the model's products of many rows are bfloat16 (`Transformer.bf16_attention`); fewer
    (decode, short turns) run `attn_rows` (dot products with each key row, one item per row and query head)."""
    n, d = q.shape[0], cfg.head_dim
    lib = attention_kernel()
    many = n >= NATIVE_MIN_ROWS
    kernel = lib.attn_forward if many else lib.attn_rows
    if many and cache.kv_format == "float" and bf16:
        kernel = bf16_attention_kernel().attn_forward_bf16
    if cache.kv_format == "float":
        k, v = cache.k[layer], cache.v[layer]  # [Hkv, T, D]
    elif many:  # one layer de-quantized: attn_forward copies the keys (transposed) anyway
        k, v = cache.layer_kv(layer, int(pos[-1]) + 1)
    else:  # rows of D + 4 bytes, de-quantized as they are read
        k, v, kernel = cache.kv[layer, 0], cache.kv[layer, 1], lib.attn_rows_kv8
    width = k.shape[-1]
    if q.stride(2) != 1 or q.stride(1) != d or k.stride(1) != width or v.stride(1) != width:
        raise RuntimeError("attention kernel needs rows of contiguous heads")
    pos = pos if pos.dtype == torch.int64 and pos.is_contiguous() else pos.to(torch.int64).contiguous()
    if density is not None and not (density.dtype == torch.float32 and density.is_contiguous()):
        raise RuntimeError("density must be a contiguous float32 tensor")
    out = torch.empty(n, cfg.n_heads * d, dtype=q.dtype, device=q.device)
    rc = kernel(
        q.data_ptr(), q.stride(0), pos.data_ptr(), n, k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        cfg.n_kv_heads, cfg.group, d, scale, out.data_ptr(), out.stride(0),
        density.data_ptr() if density is not None else None, torch.get_num_threads())
    if rc != 0:
        raise MemoryError("attention kernel could not allocate its scratch")
    return out


def attend_sdpa(cfg: ModelConfig, layer: int, q: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Attention in torch's `scaled_dot_product_attention`; no density."""
    n = q.shape[0]
    s_all = int(pos[-1]) + 1
    keys, vals = (t.unsqueeze(0) for t in cache.layer_kv(layer, s_all))  # [1, Hkv, S, D] each
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    mask, causal = None, False
    if n == s_all:  # a prefill from position 0: the fused kernel's own causal mask fits
        causal = n > 1
    elif n > 1:
        mask = torch.arange(s_all, device=q.device).unsqueeze(0) <= pos.unsqueeze(1)  # [n, S]
    o = F.scaled_dot_product_attention(
        qh, keys, vals, attn_mask=mask, is_causal=causal, enable_gqa=True
    )  # [1, Hq, n, D]
    return o[0].transpose(0, 1).reshape(n, cfg.n_heads * cfg.head_dim)
