"""Model files the quantized-weights benchmark runs on, written here (nothing is downloaded):

- the default model's GGUF re-quantized to another GGUF type (Q4_0, Q8_0) with all its metadata, so
  llama.cpp and the engine run the same weights in the same quantization;
- a random model of a pinned shape (by default Llama-3.2-1B's dimensions with SmolLM2's vocabulary)
  as a Hugging Face checkpoint directory (safetensors, SmolLM2's tokenizer files) and as GGUFs of
  the same values. Speed does not depend on the values; the files let every system load the shape;
- random LoRA adapters in the PEFT format for a model's shapes (`random_adapter`), for the adapter
  benchmark and tests.

    python -m bench.model_files requantize Q4_0 OUT.gguf
    python -m bench.model_files random OUT_DIR [--hidden 2048 --layers 16 --heads 32 --kv-heads 8 --mlp 8192 --positions 8192]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

SHAPE_1B = dict(hidden=2048, layers=16, heads=32, kv_heads=8, mlp=8192)
"""Llama-3.2-1B's dimensions (its vocabulary is SmolLM2's here)."""

SHAPE_QWEN_05B = dict(hidden=896, layers=24, heads=14, kv_heads=2, mlp=4864, positions=32768)
"""Qwen2.5-0.5B's dimensions and positions (a Llama block: no Q/K/V biases; SmolLM2's vocabulary),
for prompts beyond the default model's 8,192 positions (bench/long_prompt.py)."""


def _copy_metadata(reader, writer, changes: dict | None = None) -> None:
    import gguf

    changes = changes or {}
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        value = changes.get(field.name, field.contents())
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, vtype, sub_type=sub)


def requantize(src: Path, dst: Path, qtype_name: str) -> Path:
    """`src`'s tensors, its 2-D quantized ones re-quantized to `qtype_name` (from their de-quantized
    values, in the GGUF's own layout), every metadata field copied."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    reader = gguf.GGUFReader(str(src))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    writer = gguf.GGUFWriter(str(dst), arch)
    _copy_metadata(reader, writer, {"general.file_type": _file_type(qtype_name)})
    for t in reader.tensors:
        shape = [int(s) for s in reversed(t.shape)]  # numpy order: rows first
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) or len(shape) < 2:
            writer.add_tensor(t.name, np.asarray(t.data).reshape(shape))
            continue
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
        writer.add_tensor(t.name, gguf.quants.quantize(values.astype(np.float32), qtype), raw_dtype=qtype)
    _finish(writer)
    return dst


def _file_type(qtype_name: str) -> int:
    import gguf

    return int(getattr(gguf.LlamaFileType, f"MOSTLY_{qtype_name}"))


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()


def random_model(out: Path, *, hidden: int, layers: int, heads: int, kv_heads: int, mlp: int,
                 positions: int = 8192, gguf_types: tuple[str, ...] = ("Q4_0", "Q8_0"), seed: int = 0) -> Path:
    """A Llama of this shape (`positions`: its position limit) with SmolLM2's vocabulary and random
    weights (std 0.02; norms 1), untied: `out/hf` (config.json, model.safetensors, tokenizer files) and
    `out/model-<TYPE>.gguf` per type. Existing files are kept (writing a 1.2B model takes minutes)."""
    import gguf
    from safetensors.numpy import save_file

    from engine.loader import default_model_path, resolve_model

    base = resolve_model(progress=False)
    vocab = json.loads((base.directory / "config.json").read_text())["vocab_size"]
    hf = out / "hf"
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)

    names: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
                                         "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        names.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                      p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                      p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                      p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                      p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                      p + "mlp.gate_proj.weight": (mlp, hidden), p + "mlp.up_proj.weight": (mlp, hidden),
                      p + "mlp.down_proj.weight": (hidden, mlp)})

    def value(name: str) -> np.ndarray:
        shape = names[name]
        return np.ones(shape, np.float32) if len(shape) == 1 else matrix(*shape)

    if not (hf / "model.safetensors").is_file():
        hf.mkdir(parents=True, exist_ok=True)
        cfg = json.loads((base.directory / "config.json").read_text())
        cfg.update(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                   intermediate_size=mlp, head_dim=head_dim, tie_word_embeddings=False, max_position_embeddings=positions)
        (hf / "config.json").write_text(json.dumps(cfg, indent=2))
        for f in base.directory.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
                shutil.copy(f, hf / f.name)
        save_file({n: value(n) for n in names}, str(hf / "model.safetensors"), metadata={"format": "pt"})
    from safetensors.numpy import load_file

    tensors = load_file(str(hf / "model.safetensors"))
    reader = gguf.GGUFReader(str(default_model_path()))
    for qname in gguf_types:
        dst = out / f"model-{qname}.gguf"
        if dst.is_file():
            continue
        qtype = gguf.GGMLQuantizationType[qname]
        writer = gguf.GGUFWriter(str(dst), "llama")
        changes = {"llama.embedding_length": hidden, "llama.block_count": layers, "llama.attention.head_count": heads,
                   "llama.attention.head_count_kv": kv_heads, "llama.feed_forward_length": mlp,
                   "llama.rope.dimension_count": head_dim, "llama.context_length": positions,
                   "general.file_type": _file_type(qname)}
        _copy_metadata(reader, writer, changes)

        def permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's rope row order for Q and K
            return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

        def add(name: str, w: np.ndarray) -> None:
            if w.ndim == 1:
                writer.add_tensor(name, w.astype(np.float32))
            else:
                writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(w), qtype), raw_dtype=qtype)

        add("token_embd.weight", tensors["model.embed_tokens.weight"])
        add("output_norm.weight", tensors["model.norm.weight"])
        add("output.weight", tensors["lm_head.weight"])
        for i in range(layers):
            p = f"model.layers.{i}."
            add(f"blk.{i}.attn_norm.weight", tensors[p + "input_layernorm.weight"])
            add(f"blk.{i}.ffn_norm.weight", tensors[p + "post_attention_layernorm.weight"])
            add(f"blk.{i}.attn_q.weight", permute(tensors[p + "self_attn.q_proj.weight"], heads))
            add(f"blk.{i}.attn_k.weight", permute(tensors[p + "self_attn.k_proj.weight"], kv_heads))
            add(f"blk.{i}.attn_v.weight", tensors[p + "self_attn.v_proj.weight"])
            add(f"blk.{i}.attn_output.weight", tensors[p + "self_attn.o_proj.weight"])
            add(f"blk.{i}.ffn_gate.weight", tensors[p + "mlp.gate_proj.weight"])
            add(f"blk.{i}.ffn_up.weight", tensors[p + "mlp.up_proj.weight"])
            add(f"blk.{i}.ffn_down.weight", tensors[p + "mlp.down_proj.weight"])
        _finish(writer)
    return out


def random_adapter(directory: Path, cfg, seed: int, rank: int = 8,
                   targets=("q_proj", "v_proj", "down_proj")) -> Path:
    """A PEFT-format LoRA adapter for a model of `cfg` (engine.config.ModelConfig) with random A and B
    (B is not zero, so it changes the outputs), alpha = 2 rank."""
    import torch
    from safetensors.torch import save_file

    from engine.lora import module_shapes

    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(cfg)
    tensors = {}
    for layer in range(cfg.n_layers):
        for m in targets:
            out_f, in_f = shapes[m]
            part = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{m}"
            tensors[key + ".lora_A.weight"] = torch.randn(rank, in_f, generator=g) / in_f**0.5
            tensors[key + ".lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.05
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets), "bias": "none"}))
    return directory


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    rq = sub.add_parser("requantize", help="the default GGUF in another quantization type")
    rq.add_argument("qtype", choices=["Q4_0", "Q4_1", "Q8_0"])
    rq.add_argument("out", type=Path)
    rm = sub.add_parser("random", help="a random model of a pinned shape (safetensors and GGUF)")
    rm.add_argument("out", type=Path)
    for k, v in dict(SHAPE_1B, positions=8192).items():
        rm.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    args = ap.parse_args(argv)
    if args.what == "requantize":
        from engine.loader import default_model_path

        print(requantize(default_model_path(), args.out, args.qtype))
    else:
        print(random_model(args.out, hidden=args.hidden, layers=args.layers, heads=args.heads,
                           kv_heads=args.kv_heads, mlp=args.mlp, positions=args.positions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
