"""Admitting a call's prefill under the service's prefill budget (`ServiceConfig.prefill_budget_bytes`):
HyperGen's estimate (scheduler/prefill.py) of the model's steps and the context's K/V, before any
prefill work, and the partitions it runs in.

A plan that fits in one pass or in row partitions (`none`, `moderate`) runs; one that needs K/V moved
out of memory layer by layer (`severe`) runs on a working set whose layers can stream
(`streamable_working_set`: K/V in a file mapped shared, engine/kvspill.py), its streamed layers
and spilled hidden state set per call (`apply_plan`); a plan that cannot fit at all (`refuse`), or a
`severe` one without such a working set, is refused with `prompt_too_long` (HTTP 413) and the
estimate, leaving the context as it was.
"""

from __future__ import annotations

import os
import tempfile

from engine import kvformat
from engine.context import PromptTooLongError
from engine.kvcache import KVCache
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
        mlp_weight_bytes=a * max(w.w_gate_up.n * w.w_gate_up.k, w.w_down.n * w.w_down.k) if quantized else 0,
        bf16_products=quantized and a == 4 and getattr(w.wqkv, "bf16_rows", False))


def admit_prefill(shape: PrefillShape, new: int, cached: int, budget: int, streaming: bool = True) -> PrefillPlan:
    """The plan a prefill of `new` tokens onto `cached` runs with, or `PromptTooLongError` with the
    estimate when it cannot run within `budget` bytes (`streaming`: the working set can stream layers,
    which a `severe` plan needs)."""
    plan = plan_prefill(shape, new, cached, budget)
    if plan.kind == "refuse":
        raise PromptTooLongError(f"{plan.describe()} (prefill_budget_bytes)")
    if plan.kind == "severe" and not streaming:
        raise PromptTooLongError(
            f"a prefill of {new} tokens onto {cached} fits {budget / (1 << 20):.1f} MiB only with its K/V moved "
            f"out of memory layer by layer, which a working set on this device cannot do; estimated "
            f"{plan.peak / (1 << 20):.1f} MiB so ({plan.partitions} partitions of {plan.partition_rows} rows)")
    return plan


def apply_plan(ws: KVCache, plan: PrefillPlan) -> dict:
    """Set up `ws` for `plan` (its streamed layers and spilled hidden state, when it can stream) and return
    the engine's call parameters for it (the row partitions)."""
    if ws.pager is not None:
        ws.pager.set_resident(plan.resident_layers)
        ws.pager.spill_hidden = plan.spill_hidden
    return {"partition_rows": plan.partition_rows if plan.kind in ("moderate", "severe") else None}


def restore_layers(shape: PrefillShape, kv_tokens: int, budget: int) -> int:
    """Layers of a context of `kv_tokens` a restore into a streamable working set keeps in memory
    under `budget`: those that decoding one token onto it keeps (the call's own plan may keep fewer)."""
    plan = plan_prefill(shape, 1, kv_tokens, budget)
    return plan.resident_layers if plan.kind == "severe" else shape.n_layers


def streamable_working_set(model, capacity: int, kv_format: str, directory: str, name: str = "") -> KVCache | None:
    """A working set of `capacity` tokens whose layers can leave memory: K/V in a file under `directory`
    mapped shared (`name`: a file another process can map by its path, unlinked by the caller; empty: a
    private one, unlinked at once). None off the CPU (there the budget would be the device's memory
    and partial results pinned host buffers: not built)."""
    if model.device.type != "cpu":
        return None
    os.makedirs(directory, mode=0o700, exist_ok=True)
    if name:
        path = os.path.join(directory, name)
    else:
        fd, path = tempfile.mkstemp(prefix="ws-", dir=directory)
        os.close(fd)
    ws = KVCache.mapped(model.cfg, path, capacity, chunk_tokens=model.engine_cfg.chunk_tokens, dtype=model.dtype,
                        kv_format=kv_format)
    if not name:
        ws.pager.file.unlink()
    return ws
