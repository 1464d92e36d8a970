"""The restore in the executor's own process: `InProcessRestorer`, the one-process transport of
`actors.restore.restore` (docs/design.md §4), which `actors.service.wire_local` wires and the Ray
restorer is checked against. A reader thread stands in for the IO worker's streaming generator.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator

from actors.messages import CallPlan, RestoreRequest, RestoreStats
from actors.restore import STREAMED_AHEAD, host_view, restore, streamed_from
from engine.kvcache import KVCache
from engine.lora import AdapterSet
from engine.threads import single_threaded_torch
from storage import codecs

GROUP_LAYERS = 6
"""Layers per group a pipelined restore streams in one process (the Ray restorer sizes its groups per
restore); the governor plans with the resulting number of groups (Eq. 4')."""


class InProcessRestorer:
    """A restore in the executor's own process (`actors.restore.restore`), the reference for the actor
    path. With recompute planned, a reader thread streams layer groups (file reads and lz4 release the
    GIL) while this thread decodes and recomputes layer by layer; without, the store's reads are
    consumed chunk by chunk and de-quantized on a pool of `threads` threads (the compiled codecs and
    lz4 release the GIL too), so both cores work."""

    def __init__(self, model, io, resolve: Callable[[Any], codecs.EncodedChunk] = lambda h: h,
                 threads: int = 2, group_layers: int = GROUP_LAYERS, streaming_stores: bool = True,
                 adapters: AdapterSet | None = None) -> None:
        self.model = model
        self.adapters = adapters or AdapterSet(None, model.cfg)
        """The executor's adapters (the same object): recompute runs under the context's."""
        self.streaming_stores = streaming_stores
        self.threads = threads
        self.group_layers = group_layers
        self.io = io
        self.resolve = resolve
        self.pool = (ThreadPoolExecutor(threads, thread_name_prefix="decode", initializer=single_threaded_torch)
                     if threads > 1 else None)

    def forget_adapter(self, name: str) -> bool:
        """Nothing to drop: this restorer uses the executor's own adapters."""
        return False

    def restore(self, ws: KVCache, plan: CallPlan) -> tuple[RestoreStats, list[tuple[int, Any, int]]]:
        """Fill `ws`; returns what was done and the chunks read whole from disk (index, enc, bytes)."""
        from actors.swapio import layer_groups

        load = [i for i, _, _ in plan.load]
        pipelined = bool(plan.recompute and load) and host_view(ws) is not None
        streamed = streamed_from(ws)  # then groups of one layer, one read ahead (`STREAMED_AHEAD`)
        size = (1 if streamed is not None else self.group_layers) if pipelined else self.model.cfg.n_layers
        groups = layer_groups(self.model.cfg.n_layers, size)
        req = RestoreRequest(plan.ctx, plan.kv_tokens, plan.token_ids, [(i, h) for i, _, h in plan.resident],
                             load, list(plan.recompute), groups, resident_layers=streamed)
        ahead = STREAMED_AHEAD if streamed is not None else None
        items = (_read_ahead(lambda: self.io.read_groups(plan.ctx, load, groups, plan.adapter), ahead) if pipelined
                 else self.io.read_batches(plan.ctx, load, 1, plan.adapter))
        stats, whole = restore(ws, req, items, model=self.model, adapter=self.adapters.by_key(plan.adapter),
                               pool=self.pool,
                               resolve=lambda hs: [self.resolve(h) for h in hs],
                               streaming_stores=self.streaming_stores)
        if pipelined:  # loaded layer by layer: re-encoded from the working set after the call
            plan.recompute = sorted(set(plan.recompute) | set(stats.failed) | set(load))
            return stats, []
        return stats, [(i, enc, enc.nbytes) for i, enc in whole]


def _read_ahead(read: Callable[[], Iterable], ahead: int | None = None) -> Iterator:
    """The items of `read()`, produced by a thread of their own (one item ahead of the consumer at
    least; at most `ahead` when given)."""
    import queue

    q: queue.Queue = queue.Queue(maxsize=max(1, ahead) if ahead is not None else 0)
    stop = threading.Event()

    def reader() -> None:
        single_threaded_torch()
        try:
            for item in read():
                if stop.is_set():
                    return
                q.put(item)
        except BaseException as e:  # handed to the consumer, raised there
            q.put(e)
        q.put(None)

    t = threading.Thread(target=reader, name="kv-reader", daemon=True)
    t.start()
    try:
        while (item := q.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while t.is_alive():  # a consumer that stopped early: unblock a reader waiting for room
            with contextlib.suppress(queue.Empty):
                q.get_nowait()
            t.join(0.01)
