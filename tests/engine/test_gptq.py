"""Calibrated int4 (engine/gptq.py, the `-gptq` formats): GPTQ keeps a layer's outputs closer than
rounding each weight does, in the same stored layout; a checkpoint converts to a calibrated format
end to end (the default model's tokenizer, a small random Llama written here) and runs closer to its
float model than the rounded format. The default model's perplexity under int4-g128-gptq is checked
in tests/engine/test_quant.py."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from engine import quant
from engine.gptq import gptq_int4

pytestmark = pytest.mark.usefixtures("private_model_cache")


def test_gptq_keeps_outputs_closer_than_rounding_in_the_same_layout():
    gen = torch.Generator().manual_seed(0)
    n, k, group = 96, 256, 64
    w = torch.randn(n, k, generator=gen)
    # inputs with correlated channels and a few large ones, as a layer's activations have
    x = torch.randn(4096, 32, generator=gen) @ torch.randn(32, k, generator=gen) + 0.1 * torch.randn(4096, k, generator=gen)
    x[:, :4] *= 8
    h = x.double().T @ x.double()
    triple = gptq_int4(w, h, group)
    packed, scale, lo = triple
    rtn = quant.quantize_int4(w.numpy(), group)
    assert packed.shape == rtn[0].shape and packed.dtype == np.uint8
    # the groups' ranges are the range search's with each input's error weighed by its diag(H)
    ranges = quant.quantize_int4(w.numpy(), group, importance=torch.diag(h).float().numpy())
    assert np.array_equal(scale, ranges[1]) and np.array_equal(lo, ranges[2])
    assert not np.array_equal(ranges[1], rtn[1])  # the weights changed some ranges
    err = {name: float((x @ (torch.from_numpy(quant.dequantize_int4(*t, group)) - w).T).norm())
           for name, t in (("gptq", triple), ("rtn", rtn))}
    assert err["gptq"] < 0.7 * err["rtn"], err


def test_a_checkpoint_converts_to_a_calibrated_format(resolved_model, tmp_path, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.config import EngineConfig
    from engine.model import Transformer

    torch.manual_seed(0)
    root = tmp_path / "llama"
    cfg = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True)
    LlamaForCausalLM(cfg).eval().save_pretrained(root)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (resolved_model.directory / name).exists():
            shutil.copy(resolved_model.directory / name, root / name)
    models = {w: Transformer.from_directory(root, EngineConfig(weights=w)) for w in ("fp32", "int4-g64", "int4-g64-gptq")}
    assert models["int4-g64-gptq"].weight_format == "int4-g64-gptq"
    ids = list(range(1000, 1300))
    ref = models["fp32"].forward(models["fp32"].new_cache(300), ids, all_logits=True)
    err = {w: float((models[w].forward(models[w].new_cache(300), ids, all_logits=True) - ref).norm())
           for w in ("int4-g64", "int4-g64-gptq")}
    assert err["int4-g64-gptq"] < err["int4-g64"], err
    wq = {w: models[w].w.layers[0].wqkv.dequantized() for w in ("int4-g64", "int4-g64-gptq")}
    assert not torch.equal(wq["int4-g64"], wq["int4-g64-gptq"])  # really calibrated, not rounded
    # the file is reused while its calibration is current, converted again when the calibration changed
    import engine.gptq as eg
    import engine.weightcache as wc

    built, build = [], wc._build
    monkeypatch.setattr(wc, "_build", lambda *a: (built.append(a[3].tag), build(*a))[1])
    Transformer.from_directory(root, EngineConfig(weights="int4-g64-gptq"))
    assert built == []
    monkeypatch.setattr(eg, "CALIBRATION_VERSION", "gptq-older")
    Transformer.from_directory(root, EngineConfig(weights="int4-g64-gptq"))
    assert built == ["int4-g64-gptq"]
