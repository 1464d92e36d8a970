"""The restore algorithm (LLMS §3.3, Fig. 8), written once for both transports.

A restore fills the executor's working set with a context's K/V: resident chunks are de-quantized,
loaded chunks are consumed from a stream of items as the KV swap/IO worker reads them, and planned
chunks are recomputed from their token ids layer by layer, interleaved with the stream:

- an item is a layer group (`actors.swapio.LayerGroup`: some layers of every loaded chunk) or a batch
  of whole chunks (`actors.swapio.ChunkBatch`); as soon as a group's layers of every loaded chunk are
  in, the same layers of the planned chunks are recomputed, while the IO worker reads the next group;
- without recompute, nothing waits for anything: chunks are de-quantized on a thread pool as they
  come (both cores work, the reads go on beside them);
- a chunk whose file turns out missing or corrupt is recomputed instead, with every planned chunk,
  through all layers, once every other chunk is in (recompute attends to them), or left to the caller
  (`RestoreRequest.recompute_failed`).

`restore` runs in the executor (one process, or a Ray restore without recompute) and in the recompute
worker (a Ray restore with recompute); the caller hands it the items, resolved to `EncodedChunk`s.
What this module deliberately does not know: where the items come from (a reader thread, a Ray
streaming generator), and policies.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from actors.messages import RestoreRequest, RestoreStats
from engine.kvcache import KVCache
from storage import codecs

STREAM_MIN_BYTES = 48 << 20
"""A restore that de-quantizes at least this many bytes of K/V on a pool writes them with
non-temporal stores (`codecs.decode(..., stream=True)`): below it the caches still help ordinary
stores (the measured crossover is in docs/benchmarks.md, "Tuning at the edge")."""


def host_view(ws: KVCache) -> np.ndarray | None:
    """The working set as a numpy array when it can be written in place (float32 or float16 on the
    CPU), else None: a device's, or bfloat16, which numpy has no type for; those take whole chunks
    decoded on the host (`KVCache.put_chunk`)."""
    return ws.kv.numpy() if ws.device.type == "cpu" and ws.kv.dtype != torch.bfloat16 else None


STREAMED_AHEAD = 1
"""Items (layer groups of one layer, or one layer's slab of whole chunks) a reader may run ahead of a
restore into a working set that streams layers: the next layer read ahead, as the severe prefill plan
counts it (scheduler/prefill.py), so neither memory nor the object store holds more of the context."""


def streamed_batch(ws: KVCache, tokens: int) -> int:
    """Whole chunks per read batch for a restore of a context of `tokens` tokens into a working set that
    streams layers: one layer's K/V of the context in bytes (what `_Streamed` writes out at a time)."""
    return max(1, ws.pager.slab_bytes(tokens) // ws.chunk_nbytes())


def streamed_from(ws: KVCache) -> int | None:
    """The first layer a working set that streams layers writes out of memory (its pager's resident
    count), None when it keeps all: a restore's `RestoreRequest.resident_layers`."""
    return ws.pager.resident if ws.pager is not None and ws.pager.streaming else None


def use_streaming_stores(ws: KVCache, n_chunks: int, enabled: bool = True) -> bool:
    """Whether de-quantizing `n_chunks` chunks into `ws` is large enough for non-temporal stores
    (`enabled`: `actors.config.Tuning.streaming_stores`)."""
    return enabled and host_view(ws) is not None and n_chunks * ws.chunk_nbytes() >= STREAM_MIN_BYTES


def decode_timed(ws: KVCache, kv: np.ndarray | None, i: int, layers: range, enc: codecs.EncodedChunk,
                 events: list, stream: bool = False) -> None:
    """De-quantize `layers` of chunk `i` into the working set (`kv`: its numpy view on the CPU, else
    None) and add a ("decode", i, start, end) event to `events` (safe from several threads)."""
    a = time.monotonic()
    if kv is not None:
        s, e = ws.chunk_range(i)
        codecs.decode(enc, out=kv[layers.start:layers.stop, :, :, s:e], stream=stream)
    else:  # off the CPU the device's own queue orders the copies
        ws.put_chunk(i, codecs.decode(enc))
    events.append(("decode", i, a, time.monotonic()))  # list.append is atomic under the GIL


def handed_over(items: Iterable, events: list) -> Iterator:
    """`items` (layer groups or chunk batches: each has `index` and `read_end`) as they come, adding a
    ("handover", index, ready, got) event for each to `events`: from when both it was read and this
    consumer was waiting for it, to when the consumer had it (one host: one monotonic clock, across
    processes too)."""
    it = iter(items)
    while True:
        waiting = time.monotonic()
        item = next(it, None)
        if item is None:
            return
        events.append(("handover", item.index, max(waiting, item.read_end), time.monotonic()))
        yield item


class _Decodes:
    """De-quantizing, on `pool` (None: in this thread). `wait` returns once every submitted chunk is in
    and re-raises the first failure."""

    def __init__(self, ws: KVCache, events: list, pool: ThreadPoolExecutor | None, stream: bool) -> None:
        self.ws, self.events, self.pool, self.stream = ws, events, pool, stream
        self.kv = host_view(ws)
        if self.kv is None:
            self.pool = None
        self.jobs: list[Future] = []

    def submit(self, i: int, layers: range, enc: codecs.EncodedChunk) -> None:
        if self.pool is None:
            decode_timed(self.ws, self.kv, i, layers, enc, self.events)
        else:
            self.jobs.append(self.pool.submit(decode_timed, self.ws, self.kv, i, layers, enc, self.events,
                                              self.stream))

    def wait(self) -> None:
        jobs, self.jobs = self.jobs, []
        error = None
        for j in jobs:  # every decode ends before the working set is touched again, even on an error
            try:
                j.result()
            except BaseException as e:  # noqa: BLE001 - the first one is raised below
                error = error or e
        if error is not None:
            raise error


class _Streamed:
    """The streamed layers of a working set that streams them (`req.resident_layers` set and a
    `LayerPager`; else every call is a no-op): `release` writes filled layers out of memory,
    `filled` counts whole chunks de-quantized and releases every layer once they add up to one
    layer's K/V of the context's `tokens` (what the prefill's plan counts for a streamed layer), so a
    restore of whole chunks holds about that much more than the resident layers."""

    def __init__(self, ws: KVCache, resident_layers: int | None, tokens: int) -> None:
        self.pager = ws.pager if resident_layers is not None else None
        if self.pager is not None:
            self.pager.set_resident(resident_layers)
            if not self.pager.streaming:
                self.pager = None
        self.chunk_bytes = ws.chunk_nbytes()
        self.limit = self.pager.slab_bytes(tokens) if self.pager is not None else 0
        self.pending = 0

    def release(self, decodes: _Decodes, layers: range) -> None:
        if self.pager is not None:
            decodes.wait()
            self.pager.release(layers)
            self.pending = 0

    def filled(self, decodes: _Decodes, chunks: int) -> None:
        if self.pager is not None:
            self.pending += chunks * self.chunk_bytes
            if self.pending >= self.limit:
                self.release(decodes, range(self.pager.n_layers))


def restore(ws: KVCache, req: RestoreRequest, items: Iterable, *, model=None, adapter=None,
            resolve: Callable[[list], list] = lambda handles: handles,
            pool: ThreadPoolExecutor | None = None,
            streaming_stores: bool = True) -> tuple[RestoreStats, list[tuple[int, Any]]]:
    """Fill `ws` for `req` from the stream `items` (what the IO worker reads of `req.load`, resolved);
    `resolve` turns the resident chunks' handles into `EncodedChunk`s. `model` recomputes (None: the
    caller has no recompute planned and takes failed chunks back), under the LoRA `adapter` the
    context is computed with (`engine.lora.Adapter`, which the caller resolves from `req.adapter`).
    `pool` de-quantizes when nothing is recomputed; `streaming_stores`: large restores de-quantize
    with non-temporal stores (`use_streaming_stores`). Returns the statistics and the loaded chunks
    that came whole, (index, chunk).

    A working set that streams layers (`req.resident_layers`; its `engine.kvspill.LayerPager`) has each
    streamed layer written out of memory once it is filled (`_Streamed`), and keeps no loaded chunk
    whole for the caller: the restore of a context larger than its budget stays within it."""
    res = RestoreStats()
    events = res.timeline
    n_layers = ws.kv.shape[0]
    all_layers = range(n_layers)
    out = _Streamed(ws, req.resident_layers, req.kv_tokens)
    ws.truncate(0)
    ws.reserve(req.kv_tokens)
    ws.missing = set(range(ws.n_chunks))
    if req.present:
        ws.mark_present(req.present)
    if req.recompute and model is None:
        raise ValueError("a restore that recomputes needs the model")
    stream = use_streaming_stores(ws, len(req.resident) + len(req.load), streaming_stores)
    decodes = _Decodes(ws, events, None if req.recompute else pool, stream)
    whole: list[tuple[int, Any]] = []
    loads = set(req.load)
    try:
        for (i, _), enc in zip(req.resident, resolve([h for _, h in req.resident])):
            decodes.submit(i, all_layers, enc)
            out.filled(decodes, 1)
        res.resident = len(req.resident)
        if req.recompute:  # decoded in this thread: in before a recompute attends to them
            ws.mark_present([i for i, _ in req.resident])
            out.release(decodes, all_layers)
        job = model.recompute_start(ws, req.token_ids, req.recompute, adapter=adapter) if req.recompute else None
        for item in handed_over(items if req.load else (), events):
            events.append(("read", item.index, item.read_start, item.read_end))
            layers = getattr(item, "layers", all_layers)
            pairs = item.chunks.items() if isinstance(item.chunks, dict) else item.chunks
            for i, enc in pairs:
                decodes.submit(i, layers, enc)
                res.loaded_bytes += enc.nbytes
                if layers is all_layers and out.pager is None:
                    whole.append((i, enc))
            res.failed.update(item.failed)
            # a layer group brings those layers of every loaded chunk: recompute them now, unless a
            # file failed (then everything planned is recomputed once the rest is in)
            if job is not None and not res.failed and layers is not all_layers and len(item.chunks) == len(loads):
                for layer in layers:
                    t = time.monotonic()
                    model.recompute_layer(ws, job, layer)
                    events.append(("recompute", layer, t, time.monotonic()))
            if layers is all_layers:
                out.filled(decodes, len(pairs))
            else:
                out.release(decodes, layers)
        decodes.wait()
        out.release(decodes, all_layers)
    finally:
        decodes.wait()
    present = loads - set(res.failed)
    res.loaded = len(present)
    ws.mark_present(present)
    ws.mark_present([i for i, _ in req.resident])
    res.faults = len(res.failed)
    if res.failed and (model is None or not req.recompute_failed):
        ws.missing -= set(res.failed)  # the caller's to recompute
    elif res.failed:  # some file failed: recompute it and everything planned, all layers, exactly
        chunks = sorted(set(req.recompute) | set(res.failed))
        t = time.monotonic()
        job = model.recompute_start(ws, req.token_ids, chunks, adapter=adapter)
        for layer in all_layers:
            model.recompute_layer(ws, job, layer)
            out.release(decodes, range(layer, layer + 1))
        events.append(("recompute", -1, t, time.monotonic()))
        res.recomputed = len(chunks)
    elif job is not None:
        for layer in range(job.next_layer, n_layers):
            t = time.monotonic()
            model.recompute_layer(ws, job, layer)
            events.append(("recompute", layer, t, time.monotonic()))
            out.release(decodes, range(layer, layer + 1))
        res.recomputed = len(req.recompute)
    if ws.missing:
        raise RuntimeError(f"restore left chunks {sorted(ws.missing)} missing")
    return res, [(i, enc) for i, enc in whole if i not in res.failed]
