"""Decode's layers in one compiled call (engine.fused_decode) against the torch layer they replace:
the same logits, K/V and information density up to float32 rounding, one row and several, in every
weight format; and the passes it must leave to the torch layer."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from engine import fused_decode
from engine.qlinear import kernels

PROMPT = list(range(300, 556))


def _model(resolved, weights, **opts):
    from engine.config import EngineConfig
    from engine.model import Transformer

    return Transformer.from_directory(resolved.directory, EngineConfig(device="cpu", weights=weights, **opts),
                                      fingerprint=resolved.fingerprint)


def _torch_layers(m):
    """The same model with the fused layers switched off (the same weights: nothing is reloaded)."""
    off = copy.copy(m)
    off.engine_cfg = dataclasses.replace(m.engine_cfg, fused_decode=False)
    return off


def _decode(m, steps, rows=1):
    """Greedy decode after PROMPT, `rows` tokens a pass (the next token and copies of it, as a lookup
    pass checks a guess): the logits of each pass, the tokens, the working set and density."""
    cache, density = m.new_cache(len(PROMPT) + steps * rows + 8), torch.zeros(len(PROMPT) + steps * rows + 8)
    with torch.inference_mode():
        logits = m.forward(cache, PROMPT, density=density)
        out, tokens = [], []
        for _ in range(steps):
            tok = int(logits.argmax() if logits.dim() == 1 else logits[-1].argmax())
            tokens.append(tok)
            logits = m.forward(cache, [tok] * rows, density=density, all_logits=rows > 1)
            out.append(logits)
    return torch.stack(out), tokens, cache, density


@pytest.fixture(scope="module")
def int4_float_rows(resolved_model):
    if kernels() is None:
        pytest.skip("no C compiler here")
    return _model(resolved_model, "int4", int8_activations=False)


@pytest.mark.parametrize("rows", [1, 3])
def test_fused_layers_equal_the_torch_layer(int4_float_rows, resolved_model, engine, rows):
    """fp32 (the session's engine), bf16, int8 and int4 (float rows) weights: 12 passes of greedy decode
    fused and in torch give the same tokens, logits, K/V and density within float32 rounding; the
    fused layers really ran."""
    for m in (engine.model, _model(resolved_model, "bf16"), _model(resolved_model, "int8"), int4_float_rows):
        got = _decode(m, 12, rows)
        assert fused_decode._BUILT.get(m) is not None
        want = _decode(_torch_layers(m), 12, rows)
        assert got[1] == want[1]
        assert float((got[0] - want[0]).abs().max()) <= 1e-4 * float(want[0].abs().max())
        n = got[2].length
        assert n == want[2].length == len(PROMPT) + 12 * rows
        kv_got, kv_want = got[2].kv[:, :, :, :n], want[2].kv[:, :, :, :n]
        assert float((kv_got - kv_want).abs().max()) <= 1e-4 * float(kv_want.abs().max())
        assert torch.allclose(got[3], want[3], rtol=1e-4, atol=1e-6)


def _rms(a: torch.Tensor) -> float:
    return float(a.double().pow(2).mean().sqrt())


def test_fused_layers_with_int8_activations_stay_within_their_rounding(int4_float_rows, resolved_model):
    """W4A8 rounds each row to int8 per 32 inputs, so a difference in the last bit of a normed row
    (the fused RMSNorm sums in another order than torch's) can round an activation one step apart:
    fused and torch layers then agree to about the activations' rounding, not to float32's. A decode
    pass from the same working set, for each of three tokens: logits within 1% relative RMS of each
    other on average, and each on average within 2% of the same weights with float rows (W4A8's own
    error: 0.5-1.5% a pass on this model)."""
    m = _model(resolved_model, "int4")
    models = {"fused": m, "torch": _torch_layers(m), "float rows": int4_float_rows}
    apart, errors = [], {"fused": [], "torch": []}
    with torch.inference_mode():
        for tok in (42, 7, 1000):
            out = {}
            for name, model in models.items():
                cache = model.new_cache(300)
                model.forward(cache, PROMPT)
                out[name] = model.forward(cache, [tok])
            apart.append(_rms(out["fused"] - out["torch"]) / _rms(out["torch"]))
            for name in errors:
                errors[name].append(_rms(out[name] - out["float rows"]) / _rms(out["float rows"]))
    assert fused_decode._BUILT.get(m) is not None
    assert sum(apart) / 3 < 0.01, apart
    assert all(sum(e) / 3 < 0.02 for e in errors.values()), errors


def test_passes_the_fused_layers_leave_to_torch(int4_float_rows):
    """Only what `fd_layer` computes exactly as the torch layer would is fused: more rows than the
    products take, one of several partitions, an adapter, torch attention, a kv8 working set, a step
    hook and the switch off go to the torch layer."""
    m = int4_float_rows
    cache = m.new_cache(64)
    step = fused_decode.fused_step
    assert step(m, cache, 1, sdpa=False, adapter=None, partitions=1) is not None
    assert step(m, cache, 8, sdpa=False, adapter=None, partitions=1) is not None
    assert step(m, cache, 9, sdpa=False, adapter=None, partitions=1) is None
    assert step(m, cache, 4, sdpa=False, adapter=None, partitions=2) is None
    assert step(m, cache, 1, sdpa=True, adapter=None, partitions=1) is None
    assert step(m, cache, 1, sdpa=False, adapter=object(), partitions=1) is None
    assert step(m, m.new_cache(64, kv_format="kv8"), 1, sdpa=False, adapter=None, partitions=1) is None
    assert step(_torch_layers(m), cache, 1, sdpa=False, adapter=None, partitions=1) is None
    m.step_hook = lambda *a: None
    try:
        assert step(m, cache, 1, sdpa=False, adapter=None, partitions=1) is None
    finally:
        m.step_hook = None
