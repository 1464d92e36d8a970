"""The RAG cache's moving parts (PerCache §4.1): node K/V to and from chunk records, and the executor's
side of a RAG call. Ray-free; the executor (one process or its actor) runs `stream_rag_call`.

A node of the K/V tree is the K/V of one passage computed after the prefix its retrieval path gives
(`scheduler.ragtree`); the prompt's fixed head is the node of the empty path. A node is stored through
the IO worker as chunk records under a key of its own (`node_key`): 16 tokens a record, the last
partial, always raw, so what is read back is bit for bit what was computed, and a reply that reuses it
is the reply of the same prompt prefilled whole. The key hashes the app, the model part of the KV key
(fingerprint, weight format, KV format), the adapter and the path, so nothing is shared between apps
or adapters; the records carry the adapter's tag as well (`KVKey.record_tag`).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import replace
from typing import Callable, Iterator, Sequence

import numpy as np

from actors.messages import BlendSpan, KVKey, NodeSpan, PreemptedError, RagCall, RagOutcome, check_deadline
from storage import codecs

RECORD_TOKENS = 16
"""Tokens per chunk record of a node (the service's chunk size)."""
NODE_KEY_HEX = 40
"""Length of a node's store key: longer than a context id (32), so the two never collide."""


def node_key(key: KVKey, path: Sequence[int]) -> str:
    """The chunk-store key of the node reached by `path` (knowledge chunk ids in retrieval order; the
    empty path is the prompt's head) for the app, model and adapter of `key`."""
    text = "\0".join([key.app, replace(key, app="").record_tag(), ",".join(str(int(c)) for c in path)])
    return hashlib.sha256(text.encode()).hexdigest()[:NODE_KEY_HEX]


def _pieces(start: int, end: int) -> list[tuple[int, int, int]]:
    """(record index, first slot, end slot) of a node's records."""
    return [(j, a, min(a + RECORD_TOKENS, end)) for j, a in enumerate(range(start, end, RECORD_TOKENS))]


def save_node(io, node: NodeSpan, kv: np.ndarray, adapter: str) -> int:
    """Write a node's K/V (`engine.rag.span_kv` of its slots) as raw records; returns the bytes written."""
    if kv.shape[3] != node.end - node.start:
        raise ValueError(f"K/V of {kv.shape[3]} slots for a node of {node.end - node.start}")
    todo = [(j, codecs.encode(np.ascontiguousarray(kv[:, :, :, a - node.start:b - node.start]), "raw"), a)
            for j, a, b in _pieces(node.start, node.end)]
    return sum(m["nbytes"] for m in io.write(node.key, todo, adapter))


def load_node(io, node: NodeSpan, adapter: str) -> np.ndarray | None:
    """A node's K/V as `save_node` wrote it, or None when a record is missing or fails its checks (or
    was computed under another adapter or model): the caller recomputes the node."""
    pieces = _pieces(node.start, node.end)
    chunks, failed = io.read(node.key, [j for j, _a, _b in pieces], adapter)
    if failed or len(chunks) != len(pieces):
        return None
    parts = []
    for j, a, b in pieces:
        enc = chunks[j]
        if enc.level != "raw" or enc.shape[3] != b - a:
            return None
        parts.append(codecs.decode(enc))
    return np.concatenate(parts, axis=3)


def run_rag_call(engine, io, call: RagCall, adapter=None, cache=None,
                 should_stop: Callable[[], bool] | None = None) -> RagOutcome:
    """`stream_rag_call` run to its end: its outcome."""
    *_, outcome = stream_rag_call(engine, io, call, adapter, cache, should_stop)
    return outcome


def stream_rag_call(engine, io, call: RagCall, adapter=None, cache=None,
                    should_stop: Callable[[], bool] | None = None) -> Iterator[str | RagOutcome]:
    """The executor's side of a RAG call on `engine` (`engine.context.ContextEngine`): read the cached
    nodes into the first slots of a throwaway working set (stopping at the first that fails), place
    `call.blend`'s passages from other paths' nodes after them (`_blend`), prefill the rest, decode,
    then write the new nodes (and those that failed). Yields the reply's text deltas
    as they are decoded, then the `RagOutcome` as the last item. `adapter`: the loaded LoRA adapter
    named by `call.adapter` (`engine.lora.Adapter`), None for the base model. `cache`: the working set
    to compute in (the executor's), a new one when None. `should_stop`: asked before each node read,
    each layer of the prefill and each token of the reply; True stops the call with `PreemptedError`.
    Past `call.deadline` it stops with `CallTimeoutError`. Stopped, or closed by its consumer, the
    call writes nothing."""
    def check() -> None:
        if should_stop is not None and should_stop():
            raise PreemptedError("low-priority work gave the executor up to a real call")
        check_deadline(call.deadline, "the RAG call ran past its deadline")

    from engine.rag import put_span, span_kv
    from engine.sampling import SamplingParams

    sp = SamplingParams(**(call.params if call.decode else {**call.params, "max_tokens": 1}))
    t0 = time.perf_counter()
    ctx = engine.throwaway(call.ids, sp.max_tokens, adapter, cache)
    loaded: list[str] = []
    for node in call.load:
        check()
        kv = load_node(io, node, call.adapter)
        if kv is None:
            break
        put_span(ctx.cache, node.start, kv)
        loaded.append(node.key)
    redo = call.load[len(loaded):]
    t_blend = time.perf_counter()
    blended, picked = [], []
    if call.blend and not redo:
        blended, picked = _blend(engine.model, ctx, io, call, adapter, check)
    t1 = time.perf_counter()
    # progress: an event per layer, so that `check` runs between layers of a long prefill
    stream = engine.generate(ctx, sp, progress=should_stop is not None or call.deadline is not None)
    items = iter(stream)
    try:
        for item in items:
            check()
            if call.decode and isinstance(item, str):
                yield item
    finally:
        items.close()  # stopped midway: the forward pass undoes its rows now
    res = stream.result
    blended_tokens = sum(b.end - b.start for b in blended)
    t2 = time.perf_counter()
    saved = {node.key: save_node(io, node, span_kv(ctx.cache, node.start, node.end), call.adapter)
             for node in [*redo, *call.save]}
    t3 = time.perf_counter()
    yield RagOutcome(
        text=res.text if call.decode else "",
        token_ids=res.token_ids if call.decode else [],
        finish_reason=res.finish_reason if call.decode else "",
        reused_tokens=res.cached_tokens - blended_tokens,
        loaded=loaded,
        saved=saved,
        load_s=t_blend - t0,
        prefill_s=res.ttft_s,
        decode_s=(t2 - t1) - res.ttft_s,
        save_s=t3 - t2,
        blended=[b.key for b in blended],
        blended_tokens=blended_tokens,
        recomputed_tokens=len(picked),
        blend_s=t1 - t_blend,
    )


def _blend(model, ctx, io, call: RagCall, adapter, check) -> tuple[list[BlendSpan], list[int]]:
    """Place the donors' K/V of `call.blend` after the loaded nodes, moved to their slots, until one
    fails to read; then recompute `call.blend_ratio` of their tokens (`engine.rag.blend_rows`)."""
    from engine.rag import blend_rows, put_span, shift_span

    done: list[BlendSpan] = []
    for b in call.blend:
        check()
        kv = load_node(io, NodeSpan(b.key, b.source, b.source + b.end - b.start), call.adapter)
        if kv is None or kv.dtype != np.float32 or ctx.cache.length != b.start:
            break
        put_span(ctx.cache, b.start, shift_span(model, kv, b.start - b.source))
        done.append(b)
    picked = blend_rows(model, ctx.cache, ctx.token_ids, [(b.start, b.end) for b in done], call.blend_ratio,
                        adapter) if done else []
    return done, picked
