"""Layer-major partitioned prefill (`EngineConfig.prefill_partition_rows`; HyperGen's partitions): the
rows of a long prompt pass each layer a partition at a time. The logits equal the one-pass prefill's
within 1e-4 at lengths that are and are not multiples of the partition, on a fresh context and on one
that already holds chunks; the greedy continuation is the same; density agrees up to summation order;
and the tracked peak of the transient tensors is that of a partition, as the estimate says."""

from __future__ import annotations

import pytest
import torch

from engine.memtrack import TensorTracker
from actors.admission import prefill_shape
from scheduler.prefill import estimate_steps
from tests.conftest import SAMPLE_TEXT


def _prefill(model, ids, cached_ids, rows, monkeypatch):
    monkeypatch.setattr(model.engine_cfg, "prefill_partition_rows", rows)
    cache = model.new_cache(len(cached_ids) + len(ids) + 16)
    if cached_ids:
        model.forward(cache, cached_ids)
    density = torch.zeros(cache.capacity)
    logits = model.forward(cache, ids, density=density, all_logits=True)
    out, nxt = [], int(logits[-1].argmax())
    for _ in range(8):
        out.append(nxt)
        nxt = int(model.forward(cache, [nxt]).argmax())
    return logits, density, out


@pytest.mark.parametrize("n, cached", [(144, 0), (150, 0), (150, 37)])
def test_partitioned_prefill_equals_one_pass(engine, n, cached, monkeypatch):
    model = engine.model
    doc = engine.tok.encode_document(SAMPLE_TEXT * 3)
    cached_ids, ids = doc[:cached], doc[cached : cached + n]
    ref_logits, ref_density, ref_out = _prefill(model, ids, cached_ids, 0, monkeypatch)
    logits, density, out = _prefill(model, ids, cached_ids, 48, monkeypatch)  # 3 or 4 partitions
    assert (logits - ref_logits).abs().max().item() < 1e-4
    assert out == ref_out
    assert torch.allclose(density, ref_density, rtol=1e-4, atol=1e-4)


def test_a_partition_bounds_the_transient_memory(engine, monkeypatch):
    """The torch attention kernel (every byte a tensor the tracker sees): one pass holds the steps of
    all 768 rows, partitions of 256 the last partition's steps beside the hidden state of the rest."""
    model = engine.model
    cfg = model.cfg
    monkeypatch.setattr(model.engine_cfg, "native_attention", False)
    shape = prefill_shape(model, "float")
    assert not shape.native_attention
    ids = list(range(200, 200 + 768))
    peaks = {}
    for rows in (0, 256):
        monkeypatch.setattr(model.engine_cfg, "prefill_partition_rows", rows)
        cache, density = model.new_cache(768), torch.zeros(768)
        tracker = TensorTracker(ignore=[cache.kv, density])
        monkeypatch.setattr(model, "step_hook", tracker.mark)
        with tracker:
            model.forward(cache, ids, density=density)
        peaks[rows] = max(s.peak for s in tracker.steps)
    one = max(e.peak for e in estimate_steps(shape, 768, 0))
    part = max(e.peak for e in estimate_steps(shape, 256, 512)) + 4 * 512 * cfg.hidden_size
    assert abs(one / peaks[0] - 1) < 0.2 and abs(part / peaks[256] - 1) < 0.2, (one, part, peaks)
    assert peaks[256] < 0.5 * peaks[0]


def test_a_short_density_is_refused_before_any_work(engine):
    """The kernels add into `density[:length + n]`: a shorter tensor is refused, the context unchanged
    (the compiled kernel would have written past its end)."""
    model = engine.model
    cache = model.new_cache(64)
    model.forward(cache, [5, 6, 7], density=torch.zeros(3))
    with pytest.raises(ValueError, match="density of 3 entries for a context of 4 tokens"):
        model.forward(cache, [8], density=torch.zeros(3))
    assert cache.length == 3
    model.forward(cache, [8], density=torch.zeros(4))
    assert cache.length == 4
