"""LoRA adapters (engine.lora) against peft + transformers on the same weights.

The base model is a small random Llama written by transformers; two adapters are made here with
`peft` with `init_lora_weights=False` (peft's default makes B zero, and an adapter that changes
nothing proves nothing): one of rank 8 on q and v, one of rank 4 with rsLoRA on all seven
projections. Each test first shows that the adapters change the outputs, then that the engine
computes what peft computes.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from engine.config import EngineConfig
from engine.lora import AdapterError, AdapterSet, merged
from engine.model import Transformer

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("private_model_cache")  # the random base's int8/int4 conversions

CFG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, initializer_range=0.08)
ADAPTERS = {
    "qv8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all4": dict(r=4, lora_alpha=8, use_rslora=True,
                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}
N = 90
TOL = 1e-3


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, CFG["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(base checkpoint dir, adapter root, transformers base, {name: peft model})."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**CFG, tie_word_embeddings=True)).eval()
    base.save_pretrained(root / "base")
    adapters = root / "adapters"
    peft_models = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(10 + i)
        model = LlamaForCausalLM(LlamaConfig(**CFG, tie_word_embeddings=True))
        model.load_state_dict(base.state_dict())
        pm = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0, **kw)).eval()
        pm.save_pretrained(adapters / name)
        peft_models[name] = pm
    return root / "base", adapters, base, peft_models


@pytest.fixture(scope="module")
def engine(made):
    d, adapters, _base, _pm = made
    m = Transformer.from_directory(d, EngineConfig(device="cpu", dtype="float32"))
    loaded = AdapterSet(adapters, m.cfg)
    for name in ADAPTERS:
        loaded.add(name, name)
    return m, loaded


def _hf(model, seq) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([seq])).logits[0].float()


def test_engine_with_each_adapter_matches_peft(made, engine):
    _d, _root, base, peft_models = made
    m, loaded = engine
    seq = _ids(N, 1)
    ref_base = _hf(base, seq)
    refs = {name: _hf(pm, seq) for name, pm in peft_models.items()}
    # the adapters matter: far from the base and from each other
    assert (refs["qv8"] - ref_base).abs().max() > 100 * TOL and (refs["all4"] - ref_base).abs().max() > 100 * TOL
    assert (refs["qv8"] - refs["all4"]).abs().max() > 100 * TOL
    got_base = m.forward(m.new_cache(N), seq, all_logits=True)
    assert (got_base - ref_base).abs().max() < TOL
    for name, ref in refs.items():
        a = loaded.get(name)
        got = m.forward(m.new_cache(N), seq, all_logits=True, adapter=a)
        err = (got - ref).abs().max().item()
        print(f"{name}: max |logit diff| to peft {err:.2e}")
        assert err < TOL, name
        # decode through the chunked cache follows the same logits
        cache = m.new_cache(16)
        logits = m.forward(cache, seq[:60], adapter=a)
        for k, t in enumerate(seq[60:]):
            assert (logits - ref[59 + k]).abs().max() < TOL
            logits = m.forward(cache, [t], adapter=a)
    assert loaded.get("qv8").key.startswith("qv8@") and loaded.get("qv8").rank == 8
    assert set(loaded.get("all4").targets) == set(ADAPTERS["all4"]["target_modules"])


def test_recompute_runs_under_the_contexts_adapter(engine):
    m, loaded = engine
    a = loaded.get("all4")
    ids = _ids(N, 2)
    cache = m.new_cache(N)
    m.forward(cache, ids, adapter=a)
    k0, v0 = cache.k[:, :, :N].clone(), cache.v[:, :, :N].clone()
    for adapter, same in ((a, True), (None, False)):
        for i in (1, 3):
            cache.drop_chunk(i)
        m.recompute(cache, ids, [1, 3], adapter=adapter)
        diff = max((cache.k[:, :, :N] - k0).abs().max().item(), (cache.v[:, :, :N] - v0).abs().max().item())
        assert (diff < 1e-4) == same, (adapter, diff)


def test_a_merged_float_model_equals_the_adapter_beside_it(made, engine):
    d, adapters, _b, _pm = made
    m, loaded = engine
    a = loaded.get("qv8")
    seq = _ids(40, 3)
    mm = merged(m, a)
    assert mm.fingerprint != m.fingerprint and mm.fingerprint.endswith(a.key)
    want = m.forward(m.new_cache(40), seq, all_logits=True, adapter=a)
    assert (mm.forward(mm.new_cache(40), seq, all_logits=True) - want).abs().max() < 1e-4
    assert (m.forward(m.new_cache(40), seq, all_logits=True) - want).abs().max() > 100 * TOL  # base untouched
    q = Transformer.from_directory(d, EngineConfig(device="cpu", weights="int8"))
    with pytest.raises(AdapterError) as e:
        merged(q, AdapterSet(adapters, q.cfg).add("qv8", "qv8"))
    assert e.value.code == "adapter_merge_quantized"


def _dequantized_hf(q: Transformer, base):
    """A transformers copy of `base` holding the engine's de-quantized weights (the fused tensors split
    back into q/k/v and gate/up)."""
    import copy

    hf = copy.deepcopy(base)
    cfg, sd = q.cfg, {}
    widths = {"wqkv": [cfg.n_heads * cfg.head_dim] + [cfg.n_kv_heads * cfg.head_dim] * 2,
              "w_gate_up": [cfg.intermediate_size] * 2}
    names = {"wqkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "wo": ["self_attn.o_proj"],
             "w_gate_up": ["mlp.gate_proj", "mlp.up_proj"], "w_down": ["mlp.down_proj"]}
    for i, w in enumerate(q.w.layers):
        for t, parts in names.items():
            full = getattr(w, t).dequantized()
            for name, piece in zip(parts, full.split(widths.get(t, [full.shape[0]]))):
                sd[f"model.layers.{i}.{name}.weight"] = piece
    sd["lm_head.weight"] = q.w.lm_head.dequantized()  # tied: the embedding rows come from it too
    hf.load_state_dict(sd, strict=False)
    return hf


def test_an_adapter_on_quantized_weights_matches_peft_on_the_same_values(made):
    """int8 and int4 bases: the engine with the adapter equals peft over a transformers model holding
    the engine's de-quantized weights."""
    d, adapters, base, _pm = made
    seq = _ids(N, 4)
    for weights in ("int8", "int4"):
        q = Transformer.from_directory(d, EngineConfig(device="cpu", weights=weights, int8_activations=False,
                                                         quantized_prefill_bf16=False))  # float products, as peft's
        a = AdapterSet(adapters, q.cfg).add("all4", "all4")
        hf = _dequantized_hf(q, base)
        ref_base = _hf(hf, seq)
        assert (q.forward(q.new_cache(N), seq, all_logits=True) - ref_base).abs().max() < TOL
        ref = _hf(peft.PeftModel.from_pretrained(hf, str(adapters / "all4")).eval(), seq)  # wraps hf in place
        assert (ref - ref_base).abs().max() > 100 * TOL
        err = (q.forward(q.new_cache(N), seq, all_logits=True, adapter=a) - ref).abs().max().item()
        print(f"{weights} base with all4: max |logit diff| to peft on the same values {err:.2e}")
        assert err < TOL, weights


def _copy(adapters, name, to):
    dst = adapters / to
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(adapters / name, dst)
    return dst


def _edit_tensors(path, fn):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "adapter_model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "adapter_model.safetensors"))


def _edit_config(path, **changes):
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def test_broken_or_hostile_adapters_are_refused_and_change_nothing(made, engine, tmp_path):
    _d, adapters, _b, _pm = made
    m, _loaded = engine
    s = AdapterSet(adapters, m.cfg)
    good = s.add("qv8", "qv8")
    first = next(k for k in ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",))

    bad = {}
    bad["missing"] = ("nowhere", "adapter_not_found")
    p = _copy(adapters, "qv8", "no-weights")
    (p / "adapter_model.safetensors").unlink()
    bad["no weights file"] = ("no-weights", "adapter_not_found")
    p = _copy(adapters, "qv8", "wrong-shape")
    _edit_tensors(p, lambda t: t.__setitem__(first, torch.randn(8, 128)))
    bad["wrong shapes"] = ("wrong-shape", "bad_adapter")
    p = _copy(adapters, "qv8", "rank0")
    _edit_config(p, r=0)
    bad["rank 0 in the config"] = ("rank0", "bad_adapter")
    p = _copy(adapters, "qv8", "rank0-tensors")
    _edit_tensors(p, lambda t: [t.__setitem__(k, v[:0] if "lora_A" in k else v[:, :0]) for k, v in list(t.items())])
    bad["rank 0 tensors"] = ("rank0-tensors", "bad_adapter")
    p = _copy(adapters, "qv8", "nan")
    _edit_tensors(p, lambda t: t[first].view(-1).__setitem__(5, float("nan")))
    bad["NaN"] = ("nan", "bad_adapter")
    p = _copy(adapters, "qv8", "unknown-target")
    _edit_config(p, target_modules=["q_proj", "v_proj", "lm_head"])
    bad["unknown target module"] = ("unknown-target", "bad_adapter")
    p = _copy(adapters, "qv8", "unknown-tensor")
    _edit_tensors(p, lambda t: t.__setitem__("base_model.model.model.layers.0.self_attn.rotary.lora_A.weight",
                                             torch.zeros(8, 256)))
    bad["unknown tensor"] = ("unknown-tensor", "bad_adapter")
    p = _copy(adapters, "qv8", "dora")
    _edit_config(p, use_dora=True)
    bad["DoRA"] = ("dora", "bad_adapter")
    p = _copy(adapters, "qv8", "bad-json")
    (p / "adapter_config.json").write_text("{not json")
    bad["unreadable config"] = ("bad-json", "bad_adapter")
    outside = tmp_path / "outside"
    shutil.copytree(adapters / "qv8", outside)
    bad["a path outside the root"] = (os.path.relpath(outside, adapters), "adapter_outside_root")
    bad["an absolute path outside the root"] = (str(outside), "adapter_outside_root")
    link = adapters / "link-out"
    if not link.exists():
        link.symlink_to(outside, target_is_directory=True)
    bad["a symlink out of the root"] = ("link-out", "adapter_outside_root")
    p = _copy(adapters, "qv8", "file-link-out")
    (p / "adapter_model.safetensors").unlink()
    (p / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    bad["a file symlinked out of the root"] = ("file-link-out", "adapter_outside_root")

    for what, (path, code) in bad.items():
        with pytest.raises(AdapterError) as e:
            s.add("x", path)
        assert e.value.code == code, (what, e.value.code, str(e.value))
        assert s.names() == ["qv8"] and s.get("qv8") is good, what
    for name, code in (("qv8", "adapter_exists"), ("../evil", "bad_adapter"), ("", "bad_adapter")):
        with pytest.raises(AdapterError) as e:
            s.add(name, "all4")
        assert e.value.code == code
    with pytest.raises(AdapterError) as e:
        s.get("none")
    assert e.value.code == "unknown_adapter"
    s.remove("qv8")
    assert s.names() == []
