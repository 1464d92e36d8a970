"""Admitting a call's prefill under the service's prefill budget (`ServiceConfig.prefill_budget_bytes`):
HyperGen's estimate (scheduler/prefill.py) of the model's steps and the context's K/V, before any
prefill work, and the partitions it runs in.

A plan that fits in one pass or in row partitions (`none`, `moderate`) runs; one that needs K/V moved
out of memory layer by layer (`severe`, not built) or cannot fit at all (`refuse`) is refused with
`prompt_too_long` (HTTP 413) and the estimate, leaving the context as it was.
"""

from __future__ import annotations

from engine import kvformat
from engine.context import PromptTooLongError
from engine.qlinear import FloatLinear
from scheduler.prefill import PrefillPlan, PrefillShape, plan_prefill


def prefill_shape(model, kv_format: str) -> PrefillShape:
    """The estimate's view of `model` (engine.model.Transformer) with a working set in `kv_format`."""
    cfg = model.cfg
    a = model.dtype.itemsize
    w = model.w.layers[0]
    quantized = not isinstance(w.wqkv, FloatLinear)  # de-quantized per product of many rows
    kv8 = kv_format == "kv8"
    return PrefillShape(
        cfg.hidden_size, cfg.intermediate_size, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
        act_bytes=a, kv8=kv8, native_attention=model.compiled_attention,
        kv_row_bytes=2 * cfg.n_kv_heads * (kvformat.row_bytes(cfg.head_dim) if kv8 else cfg.head_dim * a),
        qkv_weight_bytes=a * w.wqkv.n * w.wqkv.k if quantized else 0,
        mlp_weight_bytes=a * max(w.w_gate_up.n * w.w_gate_up.k, w.w_down.n * w.w_down.k) if quantized else 0)


def admit_prefill(shape: PrefillShape, new: int, cached: int, budget: int) -> PrefillPlan:
    """The plan a prefill of `new` tokens onto `cached` runs with, or `PromptTooLongError` with the
    estimate when it cannot run within `budget` bytes."""
    plan = plan_prefill(shape, new, cached, budget)
    if plan.kind == "refuse":
        raise PromptTooLongError(f"{plan.describe()} (prefill_budget_bytes)")
    if plan.kind == "severe":
        raise PromptTooLongError(
            f"a prefill of {new} tokens onto {cached} fits {budget / (1 << 20):.1f} MiB only with its K/V moved "
            f"out of memory layer by layer, which this version does not do; estimated "
            f"{plan.peak / (1 << 20):.1f} MiB so ({plan.partitions} partitions of {plan.partition_rows} rows)")
    return plan
