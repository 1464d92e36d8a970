"""The engine's tensor layout: which checkpoint (Hugging Face) tensors make each engine tensor (q/k/v
and gate/up concatenated along rows), and the float fusing of a checkpoint into it.

This module deliberately knows nothing about torch, files or weight formats' arithmetic: it is names
and, for the float layout, numpy concatenation. engine.weightcache converts the same pieces into
other weight formats; engine.model loads either.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.config import ModelConfig
from engine.quant import WeightFormat


@dataclass(frozen=True, slots=True)
class Piece:
    """One engine tensor and the checkpoint tensors whose rows, concatenated, make it."""

    name: str
    """Engine name (`layers.3.wqkv`, `lm_head`, `norm`, ...)."""
    sources: tuple[str, ...]
    """Checkpoint (Hugging Face) tensor names, concatenated along rows."""
    kind: str
    """`linear` (a layer's matrix), `head` (the LM head), `embed` (the token table) or `vector`."""


def layout(cfg: ModelConfig, names, fmt: WeightFormat | None = None) -> list[Piece]:
    """The engine's tensors for a checkpoint holding tensors `names`: q/k/v and gate/up concatenated.
    A tied model's head is its embedding table; under a quantized format with an int8 head that
    table is stored once, as the head (`embed` is then not stored: engine.weightcache)."""
    fmt = fmt or WeightFormat()
    names = set(names)

    def need(name: str) -> str:
        if name not in names:
            raise KeyError(f"checkpoint lacks tensor {name!r}")
        return name

    embed = need("model.embed_tokens.weight")
    out = [Piece("embed", (embed,), "embed"), Piece("norm", (need("model.norm.weight"),), "vector")]
    if not cfg.tie_embeddings and "lm_head.weight" in names:
        out.append(Piece("lm_head", ("lm_head.weight",), "head"))
    elif fmt.quantized and fmt.head == "int8":
        out.append(Piece("lm_head", (embed,), "head"))
    for i in range(cfg.n_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        out.append(Piece(o + "attn_norm", (need(p + "input_layernorm.weight"),), "vector"))
        out.append(Piece(o + "wqkv", tuple(need(p + f"self_attn.{n}_proj.weight") for n in "qkv"), "linear"))
        if all(p + f"self_attn.{n}_proj.bias" in names for n in "qkv"):
            out.append(Piece(o + "bqkv", tuple(p + f"self_attn.{n}_proj.bias" for n in "qkv"), "vector"))
        out.append(Piece(o + "wo", (need(p + "self_attn.o_proj.weight"),), "linear"))
        if p + "self_attn.o_proj.bias" in names:
            out.append(Piece(o + "bo", (p + "self_attn.o_proj.bias",), "vector"))
        out.append(Piece(o + "mlp_norm", (need(p + "post_attention_layernorm.weight"),), "vector"))
        out.append(Piece(o + "w_gate_up", (need(p + "mlp.gate_proj.weight"), need(p + "mlp.up_proj.weight")), "linear"))
        out.append(Piece(o + "w_down", (need(p + "mlp.down_proj.weight"),), "linear"))
    return out


def fuse_hf(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Hugging Face parameter names -> the engine's fused float layout (q/k/v and gate/up concatenated)."""
    out = {}
    for piece in layout(cfg, tensors):
        parts = [tensors[s] for s in piece.sources]
        out[piece.name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return out


__all__ = ["Piece", "layout", "fuse_hf"]
