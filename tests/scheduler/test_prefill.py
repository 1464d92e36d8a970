"""The prefill memory estimate (HyperGen Table 1 generalised) and the partition planner, on a small
shape worked out by hand: H 64, I 128, 4 layers, 4 query and 2 K/V heads of 16, float32, the torch
attention kernel. For p rows against S keys (blocks of b rows):

    qkv       x + h + QKV + rope + QK         = (256 + 256 + 512 + 96 + 384) p       = 1504 p
    attention 1504 p + 3 out + scores/probs + column sums = 2272 p + 32 b S + 8 S
    mlp       1504 p + out + gate/up          = 1760 p + 1024 p                       = 2784 p

and K/V is 256 bytes a token a layer.
"""

from __future__ import annotations

import pytest

from scheduler.prefill import PrefillShape, estimate_steps, kv_bytes, peak_bytes, plan_prefill, streamed_decode_bytes

SHAPE = PrefillShape(hidden=64, intermediate=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16)


def test_steps_of_a_block_by_hand():
    steps = {s.name: s for s in estimate_steps(SHAPE, 64, 0)}
    assert steps["qkv"].peak == steps["qkv"].retained == 1504 * 64
    assert steps["attention"].peak == 2272 * 64 + 32 * 64 * 64 + 8 * 64
    assert steps["attention"].retained == 1760 * 64
    assert steps["mlp"].peak == 2784 * 64 and steps["mlp"].retained == 256 * 64  # only x stays
    assert kv_bytes(SHAPE, 64) == 1024 * 64 and kv_bytes(SHAPE, 64, 1) == 256 * 64


def test_weights_and_kv8_add_their_transients():
    q = PrefillShape(**{**_fields(SHAPE), "qkv_weight_bytes": 10**6, "mlp_weight_bytes": 2 * 10**6, "kv8": True})
    steps = {s.name: s for s in estimate_steps(q, 64, 0)}
    assert steps["qkv"].peak == (256 + 256 + 512) * 64 + 10**6  # the weight is freed before the rotation
    assert steps["mlp"].peak == 2784 * 64 + 2 * 10**6
    assert steps["attention"].peak == 2272 * 64 + 32 * 64 * 64 + 8 * 64 + 2 * 4 * 2 * 64 * 16
    few = {s.name: s for s in estimate_steps(q, 8, 0)}  # 8 rows run the products from the stored weights
    assert few["mlp"].peak == 2784 * 8


def _fields(shape):
    return {f: getattr(shape, f) for f in shape.__slots__}


@pytest.mark.parametrize("budget, kind, rows, spill, peak, resident", [
    (342528, "none", 64, False, 276992 + 65536, 4),  # the attention step beside all K/V
    (342527, "moderate", 32, False, 212480, 4),  # 2 partitions: 138752 + x of the other 32 rows 8192 + K/V 65536
    (200000, "moderate", 16, False, 147456, 4),  # 69632 + x of 48 rows 12288 + K/V 65536
    (140000, "severe", 16, False, 131072, 1),  # 69632 + 12288 + two layers' K/V 32768, one more resident
    (130000, "severe", 16, False, 114688, 0),
    (110000, "severe", 16, True, 106496, 0),  # the hidden state spilled: 69632 + x of 16 rows 4096 + 32768
    # 8 rows (attention 2272 p + 32 b S + 8 S = 35072): 35072 + x of 56 rows 14336 + 32768
    (90000, "severe", 8, False, 82176, 0),
    (80000, "severe", 8, True, 69888, 0),  # the hidden state spilled: 35072 + x of 8 rows 2048 + 32768
    (60000, "refuse", 8, True, 69888, 0),
])
def test_the_planner_picks_the_lightest_plan_that_fits(budget, kind, rows, spill, peak, resident):
    plan = plan_prefill(SHAPE, 64, 0, budget)
    assert (plan.kind, plan.partition_rows, plan.spill_hidden, plan.peak) == (kind, rows, spill, peak)
    assert plan.resident_layers == resident
    assert plan.partitions == 64 // rows
    assert ("over the budget" in plan.describe()) == (kind == "refuse")


def test_a_streamed_context_counts_its_window_and_its_decode():
    """Onto cached tokens a severe prefill also holds the next layer's cached K/V (read ahead), and the
    plan must leave room to decode the result: a row's steps beside three layers."""
    plan = plan_prefill(SHAPE, 64, 1000, 4 << 20)
    assert plan.kind == "none"
    per_layer = kv_bytes(SHAPE, 1064, 1)
    decode = streamed_decode_bytes(SHAPE, 1064)
    assert decode == max(st.peak for st in estimate_steps(SHAPE, 1, 1063)) + 3 * per_layer
    steps = max(st.peak for st in estimate_steps(SHAPE, 8, 1056))
    window = 2 * per_layer + kv_bytes(SHAPE, 1000, 1)  # computing, written out; the next layer's cached part
    assert peak_bytes(SHAPE, 64, 1000, 8, severe=True, spill=False) == steps + 256 * 56 + window
    budget = max(decode, steps + 256 * 56 + window) + per_layer
    severe = plan_prefill(SHAPE, 64, 1000, budget)
    assert (severe.kind, severe.partition_rows, severe.resident_layers) == ("severe", 8, 1)
    refused = plan_prefill(SHAPE, 64, 1000, decode - 1)  # the decode after it would not fit either
    assert refused.kind == "refuse" and not refused.decode_bound and "8 rows" in refused.describe()
    native = PrefillShape(**{**_fields(SHAPE), "native_attention": True})  # its row path holds little
    refused = plan_prefill(native, 640, 0, streamed_decode_bytes(native, 640) - 1)
    assert refused.kind == "refuse" and refused.decode_bound and "to decode after it" in refused.describe()


def test_cached_tokens_count_as_keys_and_as_kv():
    alone = plan_prefill(SHAPE, 64, 0, 10**9)
    after = plan_prefill(SHAPE, 64, 1000, 10**9)
    assert after.kind == "none" and after.peak > alone.peak + kv_bytes(SHAPE, 1000)
    with pytest.raises(ValueError, match="new"):
        plan_prefill(SHAPE, 0, 0, 10**6)
