"""Configuration dataclasses for the transformer engine.

This module deliberately knows nothing about files, Ray or tokenization: it is values and their checks.

`ModelConfig` describes a Llama-family architecture (Llama, SmolLM, Qwen2) as read from a Hugging Face
`config.json` (already parsed into a dict by the caller); `EngineConfig` says where and how the engine
runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.quant import WeightFormat

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
KV_FORMATS = ("float", "kv8")
"""How a working set holds K/V (engine/kvformat.py): the compute dtype, or int8 keys and fp8 values."""
KV8_SCALE_BYTES = 4
"""A kv8 row is a head's D values and then one float32 scale."""

WEIGHT_PREFETCH_ROWS = 4
"""Rows of a quantized weight ahead of the current one that the compiled decode products prefetch
where they do (`EngineConfig.weight_prefetch_rows`; docs/benchmarks.md, "Tuning at the edge")."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    """Rotary base frequency."""
    kind: str = "default"
    """One of `default`, `linear`, `llama3`."""
    factor: float = 1.0
    """Position scaling factor (`linear`, `llama3`)."""
    low_freq_factor: float = 1.0
    """`llama3` only."""
    high_freq_factor: float = 4.0
    """`llama3` only."""
    original_max_positions: int = 8192
    """`llama3` only: context length the base model was trained with, in tokens."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    """Hugging Face `model_type` (`llama`, `qwen2`, `mistral`)."""
    vocab_size: int
    """Number of token ids."""
    hidden_size: int
    """Residual stream width."""
    intermediate_size: int
    """SwiGLU inner width."""
    n_layers: int
    """Transformer blocks."""
    n_heads: int
    """Query heads."""
    n_kv_heads: int
    """Key/value heads (grouped-query attention when fewer than `n_heads`)."""
    head_dim: int
    """Width of one head."""
    rms_norm_eps: float
    """RMSNorm epsilon."""
    rope: RopeConfig
    """Rotary embedding parameters."""
    max_positions: int
    """Longest sequence the model was trained for, in tokens."""
    tie_embeddings: bool
    """LM head shares the input embedding matrix."""
    bos_token_id: int | None = None
    """Beginning-of-sequence id, if the model has one."""
    eos_token_ids: tuple[int, ...] = ()
    """Ids that end generation."""
    group: int = field(init=False)
    """Query heads per KV head (derived)."""

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        object.__setattr__(self, "group", self.n_heads // self.n_kv_heads)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Read a Hugging Face `config.json` dict (transformers 4.x or 5.x spelling)."""
        n_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rp = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or {}
        rp.update({k: v for k, v in scaling.items() if v is not None})
        theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
        kind = rp.get("rope_type", rp.get("type", "default")) or "default"
        if kind not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope type {kind!r}; supported: default, linear, llama3")
        rope = RopeConfig(
            theta=float(theta),
            kind=kind,
            factor=float(rp.get("factor", 1.0)),
            low_freq_factor=float(rp.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rp.get("high_freq_factor", 4.0)),
            original_max_positions=int(rp.get("original_max_position_embeddings", 8192)),
        )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            model_type=cfg.get("model_type", "llama"),
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or hidden // n_heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=rope,
            max_positions=int(cfg.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


@dataclass(slots=True)
class EngineConfig:
    device: str = "auto"
    """torch device string; `auto` picks `cuda` when available, else `cpu`."""
    dtype: str = "auto"
    """Compute dtype: `float32`, `bfloat16`, `float16`; `auto` is float32 on CPU, bfloat16 on CUDA."""
    chunk_tokens: int = 16
    """Tokens per KV chunk."""
    max_context_tokens: int = 0
    """Longest context before overflow handling, in tokens; 0 means the model's `max_positions`."""
    overflow_keep_fraction: float = 0.75
    """On overflow keep the first chunk plus the newest chunks up to this fraction of the limit."""
    attention_block_rows: int = 0
    """Query rows per attention block in prefill; 0 sizes blocks to keep scores near 4.5 MiB."""
    threads: int = 0
    """torch intra-op threads; 0 leaves torch's default."""
    weights: str = "fp32"
    """Weight format (engine.quant.WeightFormat.tag): `fp32` (the checkpoint as converted), `bf16`,
    `int8`, `int4` (group 32, int8 LM head), `int4-g128`, ...; converted once into the model cache."""
    int8_activations: bool = True
    """int4 weights: products of few rows (decode) quantize the rows to int8 per 32 inputs and
    multiply in integers where AVX-512 VNNI is compiled (engine/qmatmul.c); False: float rows."""
    quantized_prefill_bf16: bool = True
    """int4 and int8 weights on the CPU: products of more rows than decode's (prefill, recompute)
    de-quantize the weight to bfloat16 and multiply in bfloat16 (float32 accumulation, result back in
    float32) where the CPU multiplies bfloat16 itself (AVX-512 BF16, AMX; engine/qlinear.py); False,
    or elsewhere: de-quantized to float32 (docs/benchmarks.md, "Tuning at the edge")."""
    native_attention: bool = True
    """Prefill attention (with density) in the compiled kernel of `engine/attention.c` on CPU float32
    when it builds here; False keeps the torch blockwise kernel (the reference in tests)."""
    bf16_attention: bool = True
    """With bf16 weights (or int4/int8 under `quantized_prefill_bf16`) on a CPU with bfloat16 products (AMX
    tiles, else AVX-512 BF16 dot products),
    prefill and recompute attention (16 rows or more) take their two products, Q K^T and P V, in
    bfloat16 (engine/attention_bf16.c; softmax, sums and density stay float32); False keeps them float32
    (engine/attention.c)."""
    weight_prefetch_rows: int | None = None
    """int4 and int8 products of few rows on the CPU (decode) ask for the weight's row this many rows
    ahead of the one they multiply to come into the cache (engine/qmatmul.c); 0: no software prefetch;
    None: the host's default (`engine.qlinear.host_prefetch_rows`): `WEIGHT_PREFETCH_ROWS` on Intel
    CPUs (the Xeon's int8 decode of the default model 22 against 29 ms a token), 0 on AMD ones (the
    EPYC's decode at the 1.2B shape 1-2 ms a token faster in int4 without it, 4-7 in int8;
    docs/benchmarks.md, "Tuning at the edge")."""
    symmetric_int4: bool = True
    """int4 weights repacked from Q4_0 blocks are read without minimums (each is -8 times its scale:
    18 bytes a block of 32 instead of 20, so decode streams a tenth less); False gives them their
    minimums at load, as an asymmetric weight (docs/benchmarks.md, "Tuning at the edge")."""
    fused_decode: bool = True
    """Decode passes (up to 8 rows) on the CPU in float32 run each layer in one compiled
    call (engine/fused_decode.py: the norms, RoPE, the K/V write and SiLU in C between the compiled
    products and attention) instead of about 40 torch operators; False keeps the torch layer, which
    also serves adapters, a streamed working set or weights, kv8 and the memory tracker's hooks."""
    lookup_draft: int = 0
    """Lookup decoding (engine/lookup.py): with greedy sampling, guess up to this many next tokens from
    where the reply's last tokens occurred before in the context, and check the guess in the pass that
    computes the next token, keeping what greedy decoding would have chosen (the reply is the plain
    decode's up to float summation order); 0: one token a pass."""
    copy_weights: bool = True
    """On the CPU, quantized weights (int4, int8 layers and LM head) are copied out of the mapped
    cache file into this process's memory at load: int4 decode at the 1.2B shape ran 1.17-1.27x
    faster from the copy on this project's VM (docs/benchmarks.md, "Tuning at the edge"; why mapped
    pages read slower there was not established; the default model's decode did not change). False
    keeps them mapped, one copy in the page cache shared by every process on the node (the service's
    choice: `actors.service.components`). Float weights and an untied embedding table stay mapped."""
    prefill_partition_rows: int = 512
    """A prefill of more new tokens runs layer by layer in partitions of this many rows (each
    partition's rows through a whole layer before the next partition: exact under the causal mask),
    so that its transient tensors are those of this many rows, not of the whole prompt
    (scheduler/prefill.py estimates both); 0: always one pass."""
    kv_format: str = "float"
    """How contexts' K/V is held in memory (engine/kvformat.py): `float` (the compute dtype) or `kv8`
    (keys int8 and values fp8 e4m3, one scale per token and head: about a quarter of float32's
    memory; lossy, so never under a lossless policy)."""
    weights_resident_bytes: int | None = None
    """Weights larger than memory (HyperGen §3.1, engine/weightpager.py): keep the smallest weight
    fragments (each matrix, scale, norm and bias of each block; the final norm and LM head) resident
    up to this many bytes and stream the rest from the mapped weight file per block, the next
    block's read ahead while one computes; None: every weight resident (the default). CPU only, with
    the weights used as stored (float32 compute on fp32 weights, int4, int8; quantized weights stay
    mapped then, whatever `copy_weights` says)."""
    weights_read_ahead: bool = True
    """Streamed weights: read the next block's fragments on a background thread while a block computes
    (False: each block's fragments are read in line as it starts)."""

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise ValueError("chunk_tokens must be >= 1")
        if not 0.0 < self.overflow_keep_fraction < 1.0:
            raise ValueError("overflow_keep_fraction must be in (0, 1)")
        if self.max_context_tokens < 0:
            raise ValueError("max_context_tokens must be >= 0")
        if self.prefill_partition_rows < 0:
            raise ValueError("prefill_partition_rows must be >= 0")
        if self.lookup_draft < 0:
            raise ValueError("lookup_draft must be >= 0 (0: no lookup decoding)")
        if self.weight_prefetch_rows is not None and self.weight_prefetch_rows < 0:
            raise ValueError("weight_prefetch_rows must be >= 0 (0: no prefetch)")
        if self.weights_resident_bytes is not None and self.weights_resident_bytes < 0:
            raise ValueError("weights_resident_bytes must be >= 0 (None: every weight resident)")
        self.weights = WeightFormat.parse(self.weights).tag  # validates; one spelling per format
        check_kv_format(self.kv_format)


def check_kv_format(name: str) -> str:
    """`name` if it is one of `KV_FORMATS`; ValueError listing them otherwise."""
    if name not in KV_FORMATS:
        raise ValueError(f"unknown KV format {name!r}; valid: {', '.join(KV_FORMATS)}")
    return name


def resolve_device_dtype(cfg: EngineConfig):
    """Return (torch.device, torch.dtype) for `cfg`, resolving `auto` against what this machine has."""
    import torch

    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if cfg.dtype == "auto":
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    elif cfg.dtype in names:
        dtype = names[cfg.dtype]
    else:
        raise ValueError(f"unknown dtype {cfg.dtype!r}; valid: auto, {', '.join(names)}")
    return dev, dtype


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return ceil_div(a, b) * b


__all__ = ["ModelConfig", "RopeConfig", "EngineConfig", "resolve_device_dtype", "ceil_div", "round_up", "KV_FORMATS",
           "KV8_SCALE_BYTES", "WEIGHT_PREFETCH_ROWS", "check_kv_format"]
