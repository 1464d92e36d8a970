"""The transformer forward pass, written here: Llama-family decoder (Llama, SmolLM, Qwen2) over a chunked
KV cache.

This module deliberately knows nothing about tokenization, chat templates, files, memory management
or Ray: it turns token ids at positions into K/V and logits.

Pieces: RMSNorm, rotary embedding at arbitrary (global) positions, grouped-query attention against the
context's K/V with a causal mask expressed in positions, SwiGLU MLP, tied or untied LM head. Every
forward is a list of query rows at given positions; prefill, decode and recompute of interleaved chunks
(LLMS §3.3, Fig. 7) are all that one operation with different rows:

- prefill/decode: the new tokens, at the end of the context; their attention row sums are accumulated
  as information density (LLMS Eq. 1), blockwise so no full attention matrix is ever held;
- recompute: the tokens of the missing chunks, at their own positions; density is left untouched.

`recompute_layer` is the per-layer step a recompute worker drives while later layers are still being
loaded.

Attention of 16 or more rows on the CPU in float32 runs in the compiled kernel of `engine/attention.c`
(built at first use by `engine.native`; one fused pass per block of rows: scores, softmax, density
column sums, P V, with blocks sized for the caches, on torch's own OpenMP threads), which prefills
with density faster than the torch kernel (docs/benchmarks.md, "Engine speed"); fewer rows (decode)
run its `attn_rows`. With bf16 weights on a CPU with bfloat16 products (AMX tiles or AVX-512 BF16), 16
rows or more run `engine/attention_bf16.c` instead (its two products in bfloat16, softmax and density
in float32). Elsewhere (CUDA, no compiler, `EngineConfig.native_attention=False`) the torch blockwise
kernel runs; all are tested against a naive full-matrix reference (the kernels and their libraries:
`engine.attention`). Decode passes on the CPU run each layer in one compiled call
(`engine.fused_decode`, `EngineConfig.fused_decode`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from engine import attention
from engine.config import EngineConfig, ModelConfig, resolve_device_dtype
from engine.fused_decode import fused_step
from engine.kvcache import KVCache
from engine.kvspill import RowSpill
from engine.loader import copy_out
from engine.lora import Adapter
from engine.qlinear import Embedding, FloatLinear, Int4Linear, Int8Linear, Linear
from engine.quant import WeightFormat, symmetric_minimums

_NO_DELTAS: dict = {}  # a layer's adapter deltas without an adapter (read only; not made anew per layer)


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    wqkv: Linear  # [(Hq + 2 Hkv) D, hidden], with Qwen2's bias
    wo: Linear  # [hidden, Hq D]
    mlp_norm: torch.Tensor  # [hidden]
    w_gate_up: Linear  # [2 I, hidden]
    w_down: Linear  # [hidden, I]


@dataclass(slots=True)
class Weights:
    embed: Embedding  # token rows, [V, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: Linear  # [V, hidden]; over the embedding table itself when tied (float formats)


@dataclass(slots=True)
class RecomputeJob:
    """State of an in-progress recompute: the hidden states of the missing rows between layers."""

    chunks: list[int]
    """Chunk indices being recomputed, ascending."""
    x: torch.Tensor  # [m, hidden]: hidden states of the missing rows entering `next_layer`
    pos: torch.Tensor  # [m] positions (== slots) of the missing rows, ascending
    adapter: Adapter | None = None  # the LoRA adapter the context's K/V is computed under
    next_layer: int = 0


def load_weights(arrays: dict[str, np.ndarray], cfg: ModelConfig, device, dtype,
                 fmt: WeightFormat | None = None, *, int8_activations: bool = True, copy: bool = False,
                 prefetch_rows: int | None = None, bf16_rows: bool = False, symmetric_int4: bool = True) -> Weights:
    """Build engine weights from engine-layout arrays (float ones from `fuse_hf`, or a weight format's
    from engine.weightcache). On the CPU nothing already in its compute type is copied: the tensors
    view the arrays (a read-only mmap shares its pages with every process on the node). bf16 weights
    stay bf16 under a float32 compute dtype; the embedding table stays in its stored type. `copy`, `bf16_rows`,
    `symmetric_int4`: `EngineConfig.copy_weights`, `.quantized_prefill_bf16`, `.symmetric_int4`."""
    fmt = fmt or WeightFormat()
    own = (lambda a: torch.from_numpy(copy_out(a))) if copy else (lambda a: a)

    def stored(name: str) -> torch.Tensor | None:
        a = arrays.get(name)
        if a is None:
            return None
        with warnings.catch_warnings():  # read-only mmap: torch warns, we never write to it
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(a)
        return t.view(torch.bfloat16) if a.dtype == np.uint16 else t

    def get(name: str) -> torch.Tensor | None:
        t = stored(name)
        return None if t is None else t.to(device=device, dtype=dtype)

    def linear(name: str, bias: str | None = None) -> Linear:
        b = get(bias) if bias else None
        if name + ".q" in arrays and arrays[name + ".q"].dtype == np.uint8:  # int4 (no .min: symmetric)
            lo = arrays.get(name + ".min")
            if lo is None and not symmetric_int4:
                lo = symmetric_minimums(arrays[name + ".scale"])
            lo = lo if lo is None else own(lo)
            return Int4Linear(own(arrays[name + ".q"]), own(arrays[name + ".scale"]), lo, fmt.group,
                              bias=b, device=device, int8_activations=int8_activations,
                              device_pack=dtype == torch.bfloat16, prefetch_rows=prefetch_rows, bf16_rows=bf16_rows)
        if name + ".q" in arrays:
            return Int8Linear(own(arrays[name + ".q"]), own(arrays[name + ".scale"]), bias=b, device=device,
                              prefetch_rows=prefetch_rows, bf16_rows=bf16_rows)
        w = stored(name)
        if w is None:
            raise KeyError(f"weights lack {name!r}")
        keep = w.dtype == torch.bfloat16 and fmt.name == "bf16"  # bf16 weights stay bf16
        return FloatLinear(w.to(device=device, dtype=w.dtype if keep else dtype), b)

    layers = [
        LayerWeights(
            attn_norm=get(f"layers.{i}.attn_norm"),
            wqkv=linear(f"layers.{i}.wqkv", f"layers.{i}.bqkv"),
            wo=linear(f"layers.{i}.wo", f"layers.{i}.bo"),
            mlp_norm=get(f"layers.{i}.mlp_norm"),
            w_gate_up=linear(f"layers.{i}.w_gate_up"),
            w_down=linear(f"layers.{i}.w_down"),
        )
        for i in range(cfg.n_layers)
    ]
    table = stored("embed")
    head = linear("lm_head") if any(k.startswith("lm_head") for k in arrays) else None
    if table is not None:
        # in the compute type when that costs no copy (fp32 on the CPU: the mapped array itself)
        same = table.dtype == dtype or (fmt.name == "bf16" and table.dtype == torch.bfloat16)
        table = table.to(device=device, dtype=table.dtype if same or fmt.quantized else dtype)
        embed = Embedding(dtype, table=table)
        if head is None:
            head = FloatLinear(table if table.dtype in (dtype, torch.bfloat16) else table.to(dtype))
    elif isinstance(head, Int8Linear):
        embed = Embedding(dtype, head=head)
    else:
        raise KeyError("weights hold neither an embedding table nor an int8 head to read it from")
    return Weights(embed=embed, layers=layers, norm=get("norm"), lm_head=head)


def rope_tables(cfg: ModelConfig, n_positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables `[n_positions, D]` in float32 (half-rotation layout, as Hugging Face Llama)."""
    return rope_angles(cfg, torch.arange(n_positions, dtype=torch.int64).float(), device)


def rope_angles(cfg: ModelConfig, t: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[len(t), D]` of positions `t` (float, any sign: a rotation by `-p` undoes one by `p`,
    since the angles are linear in the position under every scaling kind here)."""
    r = cfg.rope
    d = cfg.head_dim
    inv = 1.0 / (r.theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))  # [D/2]
    if r.kind == "linear":
        inv = inv / r.factor
    elif r.kind == "llama3":
        low_wl = r.original_max_positions / r.low_freq_factor
        high_wl = r.original_max_positions / r.high_freq_factor
        wl = 2 * math.pi / inv
        smooth = (r.original_max_positions / wl - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
        scaled = torch.where(wl > low_wl, inv / r.factor, inv)
        mid = (wl <= low_wl) & (wl >= high_wl)
        inv = torch.where(mid, (1 - smooth) * inv / r.factor + smooth * inv, scaled)
    freqs = torch.outer(t, inv)  # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    return emb.cos().to(device), emb.sin().to(device)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    r = xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()  # [n, 1]
    return (xf * r).to(x.dtype).mul_(w)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_half: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[n, H, D]` by `cos` `[n, 1, D]` and `sin_half` `[n, 1, D/2]` (the half-rotation
    layout repeats its angles, so half the sine table is all of it). The same as
    `x * cos + cat(-x2, x1) * sin` without materialising the rotated copy."""
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], sin_half, value=-1)
    out[..., half:].addcmul_(x[..., :half], sin_half)
    return out


class Transformer:
    """A decoder-only transformer with its weights, running forward passes against `KVCache`s."""

    def __init__(self, cfg: ModelConfig, weights: Weights, engine_cfg: EngineConfig | None = None) -> None:
        self.cfg = cfg
        self.engine_cfg = engine_cfg or EngineConfig()
        self.device, self.dtype = resolve_device_dtype(self.engine_cfg)
        self.w = weights
        n_pos = max(cfg.max_positions, self.engine_cfg.max_context_tokens)
        cos, sin = rope_tables(cfg, n_pos, self.device)
        self.cos = cos.to(self.dtype)  # [P, D]
        self.sin_half = sin[:, : cfg.head_dim // 2].to(self.dtype).contiguous()  # [P, D/2]; both halves equal
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.forward_rows = 0
        """Query rows computed by `forward` (prefill and decode), a counter for tests and metrics."""
        self.recomputed_rows = 0
        """Query rows computed by recompute."""
        self.fingerprint = ""
        """Identity of the weights when loaded from a resolved model (`engine.loader.ResolvedModel`)."""
        self.weight_pager = None
        """An `engine.weightpager.WeightPager` when weight fragments are streamed (told as each block
        and the LM head start); None when every weight is resident."""
        self.step_hook = None
        """Called as `step_hook(step, layer)` after each step of a block (`qkv`, `attention`, `mlp`):
        where `engine.memtrack.TensorTracker.mark` measures the prefill memory estimate's steps."""


    @property
    def weight_format(self) -> str:
        """The weights' format (engine.quant.WeightFormat.tag, as `EngineConfig` spells it): K/V
        computed under it is keyed by it."""
        return self.engine_cfg.weights

    @classmethod
    def from_directory(
        cls, directory: str | Path, engine_cfg: EngineConfig | None = None, *, fingerprint: str | None = None,
        progress: bool = False,
    ) -> "Transformer":
        """Load a checkpoint directory in `engine_cfg.weights`' format. With a `fingerprint`, the fp32
        layout is written once to the model cache and memory-mapped read-only, so every process on the
        node shares one copy; other formats are always converted once into the cache
        (engine.weightcache) and mapped the same way."""
        engine_cfg = engine_cfg or EngineConfig()
        if engine_cfg.threads:
            torch.set_num_threads(engine_cfg.threads)
        device, dtype = resolve_device_dtype(engine_cfg)
        fmt = WeightFormat.parse(engine_cfg.weights)
        from engine.weightcache import engine_arrays

        if engine_cfg.weights_resident_bytes is not None and device.type != "cpu":
            raise ValueError("streamed weights (weights_resident_bytes) run on the CPU only; on "
                             f"{device.type} every weight is resident")
        cfg, arrays = engine_arrays(directory, fingerprint, fmt, progress=progress)
        weights = load_weights(arrays, cfg, device, dtype, fmt, int8_activations=engine_cfg.int8_activations,
                               copy=engine_cfg.copy_weights and device.type == "cpu"
                               and engine_cfg.weights_resident_bytes is None,  # streamed weights stay mapped
                               prefetch_rows=engine_cfg.weight_prefetch_rows, bf16_rows=engine_cfg.quantized_prefill_bf16,
                               symmetric_int4=engine_cfg.symmetric_int4)
        model = cls(cfg, weights, engine_cfg)
        model.fingerprint = fingerprint or ""
        if engine_cfg.weights_resident_bytes is not None:
            from engine.weightpager import WeightPager

            model.weight_pager = WeightPager.of_model(arrays, weights, cfg.n_layers, engine_cfg.weights_resident_bytes,
                                                      prefetch=engine_cfg.weights_read_ahead)
        return model

    def new_cache(self, capacity: int = 0, kv_format: str | None = None) -> KVCache:
        """An empty working set for a context (`kv_format`: `EngineConfig.kv_format` unless given)."""
        return KVCache(
            self.cfg,
            chunk_tokens=self.engine_cfg.chunk_tokens,
            device=self.device,
            dtype=self.dtype,
            capacity=capacity,
            kv_format=kv_format or self.engine_cfg.kv_format,
        )

    def warmup(self) -> None:
        """Run a short throwaway forward so the first real call does not pay for kernel setup."""
        cache = self.new_cache(64)
        self.forward(cache, [0] * 48, density=torch.zeros(48, device=self.device))
        self.forward(cache, [0], density=torch.zeros(49, device=self.device))
        self.forward_rows -= 49

    # ---- prefill / decode -------------------------------------------------------------------------
    def forward(self, cache: KVCache, token_ids, *, density: torch.Tensor | None = None, all_logits: bool = False,
                sdpa: bool = False, adapter: Adapter | None = None) -> torch.Tensor:
        """`forward_steps` run to its end: the logits."""
        steps = self.forward_steps(cache, token_ids, density=density, all_logits=all_logits, sdpa=sdpa,
                                   adapter=adapter)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    @torch.no_grad()
    def forward_steps(
        self,
        cache: KVCache,
        token_ids,
        *,
        density: torch.Tensor | None = None,
        all_logits: bool = False,
        sdpa: bool = False,
        adapter: Adapter | None = None,
        partition_rows: int | None = None,
    ):
        """Append `token_ids` to the context in `cache`: a generator that yields the number of layers done
        after each layer (a long prefill's progress) and returns the logits (`StopIteration.value`).

        Returns `[V]` for the last row, or `[n, V]` with `all_logits`. When `density` (a float32 tensor
        with at least `cache.length + n` entries) is given, the attention each key receives from the new
        rows, summed over heads and layers, is added into it. `sdpa` uses torch's fused attention instead
        (no density; for measuring what density costs). `adapter`: a LoRA adapter (engine.lora) added to
        the products; the cache's K/V must have been computed under the same one. Requires every chunk
        to be present. More than `EngineConfig.prefill_partition_rows` tokens run in partitions of that
        many, layer by layer: a partition attends to the K/V its layer wrote for the rows before it, so
        the result is the one-pass result up to float summation order (`partition_rows` sets the
        partition for this pass instead; 0 is one pass).
        """
        if cache.missing:
            raise RuntimeError(f"forward over a context with missing chunks {sorted(cache.missing)}")
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).reshape(-1)
        n = ids.numel()
        if n == 0:
            raise ValueError("forward needs at least one token")
        if density is not None and density.numel() < cache.length + n:  # the kernels write density[:length + n]
            raise ValueError(f"density of {density.numel()} entries for a context of {cache.length + n} tokens")
        start = cache.reserve(n)
        if start + n > self.cos.shape[0]:
            cache.truncate(start)
            raise ValueError(f"position {start + n} beyond the model's {self.cos.shape[0]} positions")
        pos = torch.arange(start, start + n, device=self.device)
        p = self.engine_cfg.prefill_partition_rows if partition_rows is None else partition_rows
        parts = [(r, min(n, r + p)) for r in range(0, n, p)] if 0 < p < n else [(0, n)]
        pager = cache.pager if cache.pager is not None and cache.pager.streaming else None
        spill = None
        try:
            if pager is not None and pager.spill_hidden and len(parts) > 1 and not all_logits:
                spill = RowSpill(pager.spill_dir, n, self.cfg.hidden_size, self.dtype, pager.overlap)
                for r0, r1 in parts:
                    spill.enter(r0, r1).copy_(self.w.embed(ids[r0:r1]))
                    spill.leave(r0, r1)
                x = spill.x
            else:
                x = self.w.embed(ids)  # [n, hidden]
            step = fused_step(self, cache, n, sdpa=sdpa, adapter=adapter, partitions=len(parts)) or self._layer
            for layer in range(self.cfg.n_layers):
                if pager is not None:  # a streamed layer is read in (the next one ahead)
                    pager.enter(layer)
                for r0, r1 in parts:  # layer-major: every partition through this layer, then the next
                    rows = x[r0:r1] if spill is None else spill.enter(r0, r1)
                    step(layer, rows, pos[r0:r1], cache, contiguous=True, density=density, sdpa=sdpa,
                         adapter=adapter)  # updates its rows of x in place
                    if spill is not None:
                        spill.leave(r0, r1)
                    if self.step_hook is not None:  # after the block's locals are gone
                        self.step_hook("mlp", layer)
                if pager is not None:  # written out and unmapped while the next layer computes
                    pager.leave(layer, n * pager.row_bytes)
                yield layer + 1
            if spill is not None:
                x = spill.enter(n - 1, n).clone()
        except BaseException:  # an error, or the consumer closed the generator: nothing half-written stays
            cache.truncate(start)
            raise
        finally:
            if spill is not None:
                spill.close()
        self.forward_rows += n
        if not all_logits:
            x = x[-1:]
        if self.weight_pager is not None:
            self.weight_pager.use(self.cfg.n_layers)
        logits = self.w.lm_head(rms_norm(x, self.w.norm, self.cfg.rms_norm_eps)).float()
        return logits if all_logits else logits[0]

    # ---- recompute (LLMS Fig. 7) -------------------------------------------------------------------
    @torch.no_grad()
    def recompute_start(self, cache: KVCache, token_ids, chunks, *, adapter: Adapter | None = None) -> RecomputeJob:
        """Begin recomputing `chunks` of `cache` from the context's full `token_ids`, under the LoRA
        `adapter` the context's K/V is computed with."""
        chunks = sorted(set(chunks))
        if not chunks:
            raise ValueError("nothing to recompute")
        if len(token_ids) < cache.length:
            raise ValueError(f"{len(token_ids)} token ids for a context of {cache.length} slots")
        rows = [torch.arange(*cache.chunk_range(i)) for i in chunks]
        pos = torch.cat(rows).to(self.device)
        ids = torch.as_tensor(np.asarray(token_ids)[pos.cpu().numpy()], dtype=torch.long, device=self.device)
        return RecomputeJob(chunks=chunks, x=self.w.embed(ids), pos=pos, adapter=adapter)

    @torch.no_grad()
    def recompute_layer(self, cache: KVCache, job: RecomputeJob, layer: int) -> None:
        """Recompute layer `layer` of the job's chunks.

        Needs, for this layer, the K/V of every present chunk up to the last recomputed position (loaded
        chunks may arrive layer by layer, written into `cache.kv[layer]` at their slots and marked with
        `KVCache.mark_present` once whole). Layers run in order.
        """
        if layer != job.next_layer:
            raise RuntimeError(f"recompute layer {layer} out of order (expected {job.next_layer})")
        job.x = self._layer(layer, job.x, job.pos, cache, contiguous=False, density=None, sdpa=False,
                            adapter=job.adapter)
        job.next_layer += 1
        if job.next_layer == self.cfg.n_layers:
            self.recomputed_rows += job.pos.numel()
            cache.mark_present(job.chunks)

    @torch.no_grad()
    def recompute_rows(self, cache: KVCache, token_ids, positions, *, adapter: Adapter | None = None) -> None:
        """Recompute the K/V of the rows at `positions` (ascending, below `cache.length`) through every
        layer, each row attending at each layer to the cache's K/V as it then is: the rows' own, just
        written, and the rest's as given (CacheBlend's selective recompute over reused K/V). With every
        row of a span given, the span's K/V is that of a prefill after what the cache holds before it."""
        pos = torch.as_tensor(positions, dtype=torch.long, device=self.device).reshape(-1)
        if pos.numel() == 0:
            return
        if bool((pos[1:] <= pos[:-1]).any()) or int(pos[0]) < 0 or int(pos[-1]) >= cache.length:
            raise ValueError(f"rows to recompute must ascend within the {cache.length} computed slots")
        ids = torch.as_tensor(np.asarray(token_ids)[pos.cpu().numpy()], dtype=torch.long, device=self.device)
        job = RecomputeJob(chunks=[], x=self.w.embed(ids), pos=pos, adapter=adapter)  # no chunk was missing
        for layer in range(self.cfg.n_layers):
            self.recompute_layer(cache, job, layer)

    def recompute(self, cache: KVCache, token_ids, chunks, *, adapter: Adapter | None = None) -> None:
        """Recompute `chunks` through all layers, exactly (global positions, causal mask)."""
        job = self.recompute_start(cache, token_ids, chunks, adapter=adapter)
        for layer in range(self.cfg.n_layers):
            self.recompute_layer(cache, job, layer)

    # ---- one layer -------------------------------------------------------------------------------
    def _layer(self, layer, x, pos, cache, *, contiguous, density, sdpa, adapter=None):
        """One decoder layer over rows `x` `[n, hidden]`; returns the new rows, updating `x` in place
        (callers pass hidden states they own). An adapter's deltas are added after each base product."""
        if self.weight_pager is not None:
            self.weight_pager.use(layer)
        cfg, w = self.cfg, self.w.layers[layer]
        lora = adapter.layers[layer] if adapter is not None else _NO_DELTAS
        n = x.shape[0]
        hq, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        h = rms_norm(x, w.attn_norm, cfg.rms_norm_eps)
        qkv = w.wqkv(h)  # [n, (Hq + 2 Hkv) D]
        if "wqkv" in lora:
            lora["wqkv"].add_into(qkv, h)
        v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
        cos, sin_half = self.cos[pos].unsqueeze(1), self.sin_half[pos].unsqueeze(1)  # [n, 1, D], [n, 1, D/2]
        qk = apply_rope(qkv[:, : (hq + hkv) * d].view(n, hq + hkv, d), cos, sin_half)  # [n, Hq + Hkv, D]
        q, k = qk[:, :hq], qk[:, hq:]  # [n, Hq, D], [n, Hkv, D]
        cache.write(layer, k.transpose(0, 1), v.transpose(0, 1), pos, contiguous)
        if self.step_hook is not None:
            self.step_hook("qkv", layer)
        if sdpa:
            attn = self._attend_sdpa(layer, q, pos, cache)
        elif self.compiled_attention:
            attn = self._attend_native(layer, q, pos, cache, density)
        else:
            attn = self._attend(layer, q, pos, cache, density)
        # residual adds folded into the products (GEMMs with beta = 1), SiLU and the gate product in
        # place: fewer passes over [n, I] activations and fewer fresh allocations
        w.wo.add_into(x, attn)
        if "wo" in lora:
            lora["wo"].add_into(x, attn)
        if self.step_hook is not None:
            self.step_hook("attention", layer)
        h = rms_norm(x, w.mlp_norm, cfg.rms_norm_eps)
        gate_up = w.w_gate_up(h)  # [n, 2 I]
        if "w_gate_up" in lora:
            lora["w_gate_up"].add_into(gate_up, h)
        gate, up = gate_up.chunk(2, dim=-1)  # [n, I] each, views of one [n, 2 I]
        act = F.silu(gate, inplace=True).mul_(up)
        w.w_down.add_into(x, act)
        if "w_down" in lora:
            lora["w_down"].add_into(x, act)
        return x

    def _attend(self, layer, q, pos, cache, density) -> torch.Tensor:
        """Attention in torch, blockwise (`engine.attention.attend_blockwise`)."""
        return attention.attend_blockwise(self.cfg, layer, q, pos, cache, density, self.scale,
                                self.engine_cfg.attention_block_rows)

    @property
    def compiled_attention(self) -> bool:
        """Whether attention runs in the compiled kernels (engine/attention.c): switched on, CPU float32,
        head dim a multiple of 16 (at most 256), and they build."""
        return (self.engine_cfg.native_attention and self.device.type == "cpu" and self.dtype == torch.float32
                and self.cfg.head_dim % 16 == 0 and self.cfg.head_dim <= 256
                and attention.attention_kernel() is not None)

    @property
    def bf16_attention(self) -> bool:
        """Whether 16 rows or more take `attn_forward_bf16` (engine/attention_bf16.c: the two products in
        bfloat16, on AMX tiles or in AVX-512 BF16 dot products, softmax and density float32) instead of
        `attn_forward`: the other products of many rows in bfloat16 too (bf16 weights, or quantized ones
        under `quantized_prefill_bf16`), switched on (`EngineConfig.bf16_attention`), head dim a multiple of 64."""
        bf16 = self.engine_cfg.weights == "bf16" or getattr(self.w.layers[0].wqkv, "bf16_rows", False)
        return (self.engine_cfg.bf16_attention and bf16 and self.compiled_attention
                and self.cfg.head_dim % 64 == 0 and attention.bf16_attention_kernel() is not None)

    def _attend_native(self, layer, q, pos, cache, density) -> torch.Tensor:
        """Attention in the compiled kernels (`engine.attention.attend_native`)."""
        return attention.attend_native(self.cfg, layer, q, pos, cache, density, self.scale, self.bf16_attention)

    def _attend_sdpa(self, layer, q, pos, cache) -> torch.Tensor:
        return attention.attend_sdpa(self.cfg, layer, q, pos, cache)
