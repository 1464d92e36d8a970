"""Streamed weight fragments (HyperGen §3.1, engine/weightpager.py) on the default model: the same
results as resident weights bit for bit, the weights' memory in this process bounded by the plan (read
from /proc/self/smaps), the next block read while a block computes (by the order of events, under a
gate), and clear refusals where weights cannot be streamed."""

import copy
import dataclasses
import threading

import pytest
import torch

from engine.config import EngineConfig
from engine.model import Transformer
from engine.kvspill import PAGE

LIMIT = 64 << 20
IDS = list(range(200, 520))  # 320 tokens


@pytest.fixture(scope="module")
def streamed(resolved_model):
    model = Transformer.from_directory(resolved_model.directory, EngineConfig(weights_resident_bytes=LIMIT),
                                       fingerprint=resolved_model.fingerprint)
    yield model
    model.weight_pager.close()


def slack(model) -> int:
    """Pages the bound may miss by: each fragment's two edge pages (shared with a neighbour, so never
    released) and the embedding rows a pass reads from a tied head's table."""
    return 2 * PAGE * (len(model.weight_pager.plan.resident) + sum(map(len, model.weight_pager.plan.streamed))) + (1 << 20)


def test_the_plan_keeps_small_fragments_and_streams_the_head(streamed):
    plan = streamed.weight_pager.plan
    assert plan.resident_bytes <= LIMIT
    assert "layers.0.attn_norm" in plan.resident and "norm" in plan.resident
    head = [n for n in plan.streamed[streamed.cfg.n_layers]]
    assert head == ["embed"]  # the default model ties its head to the embedding table: its largest fragment


def test_streamed_weights_give_the_same_logits_bit_for_bit(engine, streamed):
    # the resident model on the torch layer for decode too: streamed weights never take the fused one
    # (engine.fused_decode), which sums in another order
    base = copy.copy(engine.model)
    base.engine_cfg = dataclasses.replace(base.engine_cfg, fused_decode=False)
    c1, c2 = base.new_cache(512), streamed.new_cache(512)
    assert torch.equal(base.forward(c1, IDS), streamed.forward(c2, IDS))
    for tok in (17, 4321):  # decode steps: every stage streamed again
        assert torch.equal(base.forward(c1, [tok]), streamed.forward(c2, [tok]))
    for c in (c1, c2):
        c.drop_chunk(2)
        c.drop_chunk(5)
    ids = IDS + [17, 4321]
    base.recompute(c1, ids, [2, 5])
    streamed.recompute(c2, ids, [2, 5])
    n = c1.length  # the slots past it were never written
    assert torch.equal(c1.k[:, :, :n], c2.k[:, :, :n]) and torch.equal(c1.v[:, :, :n], c2.v[:, :, :n])


def test_the_weights_memory_stays_within_the_plan(streamed):
    pager = streamed.weight_pager
    plan = pager.plan
    total = plan.resident_bytes + plan.streamed_bytes
    cache = streamed.new_cache(512)
    streamed.forward(cache, IDS)
    streamed.forward(cache, [9])
    during = pager.mapped_bytes()
    assert during <= plan.peak_bytes + slack(streamed) < total  # released after use, or this is all of it
    pager.release_all()
    assert pager.mapped_bytes() <= plan.resident_bytes + slack(streamed)


def test_the_next_block_is_read_while_a_block_computes(streamed, monkeypatch):
    """Each block's `mlp` step (its last) waits, under a gate, until the read of the next stage has begun
    on the background thread: the read starts before the block's compute ends, every block."""
    pager = streamed.weight_pager
    pager.release_all()
    started = [threading.Event() for _ in range(pager.stages)]
    read = pager.read

    def recorded_read(stage):
        started[stage].set()
        read(stage)

    monkeypatch.setattr(pager, "read", recorded_read)
    seen = []

    def hook(step, layer):
        if step == "mlp":
            seen.append((layer, started[layer + 1].wait(timeout=120)))

    streamed.step_hook = hook
    try:
        streamed.forward(streamed.new_cache(64), IDS[:40])
    finally:
        streamed.step_hook = None
    assert seen == [(layer, True) for layer in range(streamed.cfg.n_layers)]
    events = list(pager.events)
    for layer in range(streamed.cfg.n_layers):  # read ahead, then used; a stage two back released
        assert events.index(("read", layer + 1)) < events.index(("use", layer + 1))


def test_weights_that_are_copied_cannot_be_streamed(resolved_model):
    with pytest.raises(ValueError, match="not used in place"):
        Transformer.from_directory(resolved_model.directory,
                                   EngineConfig(dtype="bfloat16", weights_resident_bytes=LIMIT),
                                   fingerprint=resolved_model.fingerprint)
    with pytest.raises(ValueError, match="weights_resident_bytes"):
        EngineConfig(weights_resident_bytes=-1)


def test_int4_weights_stream_in_place(resolved_model):
    """Quantized arrays (values, scales, minimums) are fragments of their own, used mapped."""
    cfg = dict(weights="int4", copy_weights=False)
    # the torch layer for decode too: streamed weights never take the fused one (engine.fused_decode),
    # whose W4A8 rows round apart from the torch layer's in the last bits
    base = Transformer.from_directory(resolved_model.directory, EngineConfig(**cfg, fused_decode=False),
                                      fingerprint=resolved_model.fingerprint)
    model = Transformer.from_directory(resolved_model.directory, EngineConfig(**cfg, weights_resident_bytes=8 << 20),
                                       fingerprint=resolved_model.fingerprint)
    try:
        streamed_names = {n for names in model.weight_pager.plan.streamed for n in names}
        assert {"layers.3.wqkv.q", "layers.3.w_gate_up.q"} <= streamed_names
        c1, c2 = base.new_cache(64), model.new_cache(64)
        assert torch.equal(base.forward(c1, IDS[:48]), model.forward(c2, IDS[:48]))
        assert torch.equal(base.forward(c1, [5]), model.forward(c2, [5]))
    finally:
        model.weight_pager.close()
