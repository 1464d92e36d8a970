"""Local Hugging Face checkpoints other than the default: Qwen2 (q/k/v biases) and an untied Llama with
Llama 3 rope scaling, built here from random weights with transformers and saved as safetensors."""

from __future__ import annotations

import json

import pytest
import torch

from engine.config import EngineConfig, ModelConfig
from engine.loader import ModelNotFoundError, resolve_model
from engine.model import Transformer

SMALL = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def build(tmp_path, kind):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if kind == "qwen2":
        cfg = Qwen2Config(**SMALL, tie_word_embeddings=True, rope_theta=10000.0)
        model = Qwen2ForCausalLM(cfg)
    else:
        cfg = LlamaConfig(
            **SMALL,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=500000.0,
        )
        model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # random init leaves biases at zero; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    d = tmp_path / kind
    model.eval().save_pretrained(d)
    return d, model


@pytest.mark.parametrize("kind", ["qwen2", "llama3-untied"])
def test_local_checkpoint_matches_transformers(tmp_path, kind):
    d, ref_model = build(tmp_path, kind)
    resolved = resolve_model(d)
    assert resolved.directory == d and len(resolved.fingerprint) == 32
    m = Transformer.from_directory(d, EngineConfig(device="cpu"))
    if kind == "qwen2":
        assert m.w.layers[0].wqkv.bias is not None
    else:
        assert m.w.lm_head.weight is not m.w.embed.table and m.cfg.rope.kind == "llama3"
    ids = torch.randint(0, 300, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ref = ref_model(torch.tensor([ids])).logits[0]
    cache = m.new_cache(90)
    got = m.forward(cache, ids, all_logits=True)
    assert (got - ref).abs().max().item() < 1e-4
    k0 = cache.k[:, :, :90].clone()
    cache.drop_chunk(1)
    cache.drop_chunk(4)
    m.recompute(cache, ids, [1, 4])
    assert (cache.k[:, :, :90] - k0).abs().max().item() < 1e-5


def test_bad_model_paths_are_clear_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="gguf"):
        resolve_model(tmp_path / "weights.bin")


def test_unsupported_architecture_is_refused():
    with pytest.raises(ValueError, match="unsupported model_type"):
        ModelConfig.from_hf(
            {"model_type": "gpt2", "vocab_size": 1, "hidden_size": 8, "intermediate_size": 8,
             "num_hidden_layers": 1, "num_attention_heads": 1}
        )


def test_default_model_conversion_is_cached(resolved_model, monkeypatch):
    """A second start reads the converted cache: the GGUF is not de-quantized again."""
    import engine.loader as loader

    def boom(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(loader, "_convert_gguf", boom)
    again = resolve_model()
    assert again.directory == resolved_model.directory
    assert (again.directory / "model.safetensors").is_file()


def test_a_cached_conversion_follows_its_gguf_when_the_first_copy_is_gone(resolved_model, tmp_path):
    """The conversion cache is keyed by the GGUF's content, so another venv's copy hits it; when the
    copy it was made from is removed, the manifest names the copy in use (the int4 formats repack the
    GGUF's own blocks from it)."""
    import shutil

    from engine.loader import MANIFEST
    from engine.weightcache import _Gguf

    copy = tmp_path / resolved_model.source.name
    shutil.copyfile(resolved_model.source, copy)
    manifest = resolved_model.directory / MANIFEST
    saved = manifest.read_text()
    try:
        assert resolve_model(copy).directory == resolved_model.directory  # the copy hits the cache
        manifest.write_text(json.dumps({**json.loads(saved), "source": str(copy)}))  # as if it converted
        copy.unlink()  # the venv that converted it is gone
        assert resolve_model().directory == resolved_model.directory
        assert json.loads(manifest.read_text())["source"] == str(resolved_model.source.resolve())
        cfg = json.loads((resolved_model.directory / "config.json").read_text())
        assert _Gguf.of(resolved_model.directory, cfg["num_attention_heads"], cfg["num_key_value_heads"]) is not None
    finally:
        resolve_model()


def test_fused_cache_follows_a_changed_directory(tmp_path, monkeypatch):
    """The fused-weights cache is keyed by fingerprint but stamped with its source: when the directory
    is rewritten (re-converted, edited) under the same fingerprint, the next load rebuilds it."""
    monkeypatch.setenv("LLMAAS_CACHE_DIR", str(tmp_path / "cache"))
    d, first = build(tmp_path, "qwen2")
    ids = list(range(1, 40))
    m1 = Transformer.from_directory(d, EngineConfig(device="cpu"), fingerprint="f" * 32)
    with torch.inference_mode():
        ref1 = first(torch.tensor([ids])).logits[0]
    assert (m1.forward(m1.new_cache(40), ids, all_logits=True) - ref1).abs().max().item() < 1e-4
    with torch.no_grad():  # the same checkpoint, re-saved with other weights
        for p in first.parameters():
            p.mul_(1.1)
    first.save_pretrained(d)
    with torch.inference_mode():
        ref2 = first(torch.tensor([ids])).logits[0]
    m2 = Transformer.from_directory(d, EngineConfig(device="cpu"), fingerprint="f" * 32)
    assert (m2.forward(m2.new_cache(40), ids, all_logits=True) - ref2).abs().max().item() < 1e-4
    assert (ref2 - ref1).abs().max().item() > 1e-2  # the change is visible, so the check can fail
