"""int4 weights repacked from Q4_0 blocks are stored symmetric (no minimums: 18 bytes a block of 32,
not 20) and compute exactly what the same weights with their minimums compute, on every CPU path."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.usefixtures("private_model_cache")


CFG = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, initializer_range=0.08)


def _written(root, q4_1: tuple[str, ...] = ()):
    """A small random Llama checkpoint converted "from" a GGUF whose layers are Q4_0 blocks (Q4_1 for the
    GGUF names in `q4_1`); the manifest names the GGUF as its source, as engine.loader's conversion
    writes it. Returns (checkpoint directory, {GGUF name: the GGUF's de-quantized values})."""
    gguf = pytest.importorskip("gguf")
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.loader import MANIFEST
    from engine.weightcache import _GGUF_NAMES as GGUF_NAMES  # checkpoint module -> llama.cpp's tensor name

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CFG, tie_word_embeddings=False)).eval()
    model.save_pretrained(root / "llama")
    writer = gguf.GGUFWriter(str(root / "model.gguf"), "llama")
    values = {}
    for name, t in model.state_dict().items():
        parts = name.split(".")
        gname = GGUF_NAMES.get(f"{parts[3]}.{parts[4]}") if len(parts) == 6 else None
        if gname is not None:
            qtype = gguf.GGMLQuantizationType.Q4_1 if gname in q4_1 else gguf.GGMLQuantizationType.Q4_0
            raw = gguf.quants.quantize(t.float().numpy(), qtype)
            values[f"blk.{parts[2]}.{gname}.weight"] = gguf.quants.dequantize(raw, qtype)
            writer.add_tensor(f"blk.{parts[2]}.{gname}.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    (root / "llama" / MANIFEST).write_text(json.dumps({"source": str(root / "model.gguf")}))
    return root / "llama", values


@pytest.fixture(scope="module")
def q4_0_model(tmp_path_factory):
    return _written(tmp_path_factory.mktemp("q4_0"))[0]


def _load(directory, fingerprint: str = "q4-0-test", **options):
    from engine.config import EngineConfig
    from engine.model import Transformer

    return Transformer.from_directory(directory, EngineConfig(device="cpu", weights="int4", **options),
                                      fingerprint=fingerprint)


def test_q4_0_fused_with_q4_1_rows_is_stored_with_minimums(tmp_path):
    """Q, K and V are one engine matrix: with V in Q4_1 it keeps minimums, Q4_0's rows given theirs
    (-8 scale), every value the GGUF's; the layer's other matrices stay symmetric."""
    directory, values = _written(tmp_path, q4_1=("attn_v",))
    m = _load(directory, fingerprint="q4-mixed-test")
    heads, kv_heads = CFG["num_attention_heads"], CFG["num_key_value_heads"]

    def rope_order(w, h):  # the rows as engine.weightcache un-permutes llama.cpp's rope order
        n = w.shape[0]
        return w[np.arange(n).reshape(h, n // h // 2, 2).swapaxes(2, 1).reshape(n)]

    for i, layer in enumerate(m.w.layers):
        want = np.concatenate([rope_order(values[f"blk.{i}.attn_q.weight"], heads),
                               rope_order(values[f"blk.{i}.attn_k.weight"], kv_heads),
                               values[f"blk.{i}.attn_v.weight"]])
        assert layer.wqkv.mins is not None and layer.wo.mins is None and layer.w_down.mins is None
        assert np.array_equal(layer.wqkv.dequantized().numpy(), want), i
        assert np.array_equal(layer.wo.dequantized().numpy(), values[f"blk.{i}.attn_output.weight"]), i


def test_q4_0_layers_are_stored_and_read_without_minimums(q4_0_model):
    from engine.loader import cache_root, read_safetensors

    sym, asym = _load(q4_0_model), _load(q4_0_model, symmetric_int4=False)
    stored = read_safetensors(cache_root() / "fused", only="q4-0-test-int4-g32.safetensors")
    assert "layers.0.wqkv.q" in stored and "layers.0.wqkv.scale" in stored
    assert not any(name.endswith(".min") for name in stored), sorted(n for n in stored if n.endswith(".min"))
    for a, b in zip(sym.w.layers, asym.w.layers):
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            s, m = getattr(a, name), getattr(b, name)
            assert s.mins is None and m.mins is not None, name
            assert torch.equal(m.mins.float(), -8 * s.scale.float()), name
            assert s.resident_bytes() * 20 == m.resident_bytes() * 18, name
            assert torch.equal(s.dequantized(), m.dequantized()), name
            assert torch.equal(s.dequantized(torch.bfloat16), m.dequantized(torch.bfloat16)), name


@pytest.mark.parametrize("fused", [True, False])
def test_symmetric_and_asymmetric_forms_give_the_same_logits(q4_0_model, fused):
    """Prefill (many rows) and decode passes of one and three rows, fused layers and the torch layer:
    the minimums' term is computed from the scales in the same float32 arithmetic, so bit for bit."""
    sym, asym = _load(q4_0_model, fused_decode=fused), _load(q4_0_model, fused_decode=fused, symmetric_int4=False)
    prompt = np.random.default_rng(3).integers(0, CFG["vocab_size"], 40).tolist()
    caches = [m.new_cache(64) for m in (sym, asym)]
    outs = [m.forward(c, prompt) for m, c in zip((sym, asym), caches)]
    assert torch.equal(outs[0], outs[1])
    for step in ([int(outs[0].argmax())], [5, 6, 7]):
        outs = [m.forward(c, step) for m, c in zip((sym, asym), caches)]
        assert torch.equal(outs[0], outs[1]), step
    assert not torch.equal(outs[0], torch.zeros_like(outs[0]))
