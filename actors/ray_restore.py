"""The model executor's restorer on Ray: where a restore runs (the recompute worker when it
recomputes, this executor otherwise), how the IO worker's stream is cut (layer groups or chunk
batches sized by what a hand-over costs).

What this module deliberately does not know: the restore algorithm itself (`actors.restore`, shared
with the one-process path) and the policies that planned it (the governor's).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import ray

from actors.config import Tuning
from actors.messages import AdapterRef, RestoreRequest
from actors.ray_stubs import resolve_chunks
from actors.restore import STREAMED_AHEAD, restore, streamed_batch, streamed_from
from actors.swapio import ChunkBatch, layer_groups
from engine.threads import single_threaded_torch
from scheduler.pipeline import layer_group_size
from storage import codecs


class RayRestorer:
    """A restore on Ray. With recompute planned, the recompute worker does it, consuming the IO worker's
    stream of layer groups, sized per restore so that handing a group over (one object ref) costs
    under a tenth of reading it (scheduler.pipeline.layer_group_size), at the read rate last observed
    and the hand-over cost measured at start (`per_ref_seconds`). Without, this executor does it
    (`_restore_here`)."""

    def __init__(self, worker, cfg, shm_name: str, capacity: int, chunk_tokens: int, per_ref_s: float,
                 read_rate, io, held: dict, views: dict, threads: int = 2, tuning: Tuning = Tuning(),
                 adapters=None, storage_name: str = "float32") -> None:
        self.worker = worker
        self.adapters = adapters  # the executor's `engine.lora.AdapterSet`: the worker is told the context's
        self.tuning = tuning
        self.io = io
        self.held = held  # key -> `PoolRef` of the resident chunks (`ResidentRefs.held`)
        self.views = views  # key -> zero-copy view of the same chunk
        self.cfg = cfg
        self.chunk_shape = (cfg.n_layers, 2, cfg.n_kv_heads, chunk_tokens, cfg.head_dim)
        self.storage_name = storage_name  # the working set's chunks as the codecs type them
        self.shm_name, self.capacity = shm_name, capacity
        self.per_ref_s = per_ref_s
        self.read_rate = read_rate
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="decode", initializer=single_threaded_torch)

    def forget_adapter(self, name: str) -> bool:
        """The recompute worker unloads `name` (loaded there by the restores that named it)."""
        return self.worker.forget_adapter(name)

    def _load_nbytes(self, plan) -> int:
        return sum(codecs.stored_nbytes(level, self.chunk_shape, self.storage_name) for _, level, _ in plan.load)

    def group_size(self, plan) -> int:
        if not plan.recompute:  # nothing to overlap the reads with: one group, one hand-over
            return self.cfg.n_layers
        return layer_group_size(self.cfg.n_layers, self.per_ref_s, self.read_rate.s_per_byte,
                                self._load_nbytes(plan))

    def batch_size(self, plan) -> int:
        """Loaded chunks per streamed batch of `_restore_here`: the rule of `group_size`, over chunks."""
        n = len(plan.load)
        return layer_group_size(n, self.per_ref_s, self.read_rate.s_per_byte, self._load_nbytes(plan)) if n else 1

    def restore(self, ws, plan):
        # by key: the executor's own handle and zero-copy view of each (`ResidentRefs`)
        resident = [(i, h.key) for i, _level, h in plan.resident]
        lost = [i for i, key in resident if key not in self.held]
        if lost:  # not expected (the governor reports every handle it drops): recompute rather than fail
            plan.recompute = sorted(set(plan.recompute) | set(lost))
        keys = [(i, key) for i, key in resident if key in self.held]
        if not plan.recompute:  # nothing reads other chunks' K/V: restore here
            return self._restore_here(ws, plan, keys)
        size = self.group_size(plan) if streamed_from(ws) is None else 1  # one layer at a time in memory
        groups = layer_groups(self.cfg.n_layers, size)
        req = RestoreRequest(plan.ctx, plan.kv_tokens, plan.token_ids, [(i, self.held[key]) for i, key in keys],
                             [i for i, _, _ in plan.load], list(plan.recompute), groups,
                             self.shm_name, self.capacity, adapter=self._adapter(plan),
                             resident_layers=streamed_from(ws))
        res = self.worker.restore(req)
        return self._finish(ws, plan, res, size)

    def _adapter(self, plan) -> AdapterRef | None:
        return AdapterRef.of(self.adapters.by_key(plan.adapter)) if self.adapters is not None else None

    def _restore_here(self, ws, plan, keys):
        """Without recompute no chunk waits for another, so this executor runs the restore
        (`actors.restore.restore`) on a pool of `threads` threads: resident chunks from the views kept
        at `put` (nothing fetched), then each batch of loaded chunks as the IO worker streams it in.
        The recompute worker is idle meanwhile, so the pool uses the core it would. Chunks whose file
        fails are recomputed by the worker once every other chunk is in (they attend to them)."""
        loads = [i for i, _, _ in plan.load]
        # ask for the reads before the decode threads take both cores: the IO worker's request (and the
        # worker itself, which requests no CPU) would otherwise wait behind them
        streamed = streamed_from(ws) is not None  # a bounded stream, one layer's K/V of the context a batch
        batch = streamed_batch(ws, plan.kv_tokens) if streamed else self.batch_size(plan)
        refs = (self.io.read_batches(plan.ctx, loads, batch, plan.adapter, ahead=STREAMED_AHEAD if streamed else None)
                if loads else None)
        req = RestoreRequest(plan.ctx, plan.kv_tokens, plan.token_ids, keys, loads, [],
                             [range(self.cfg.n_layers)], recompute_failed=False, resident_layers=streamed_from(ws))
        items = self._batches(refs, plan.ctx, loads, plan.adapter) if loads else ()
        res, whole = restore(ws, req, items, pool=self.pool, resolve=self._resolve_keys,
                             streaming_stores=self.tuning.streaming_stores)
        if res.failed:  # files found missing or corrupt: recompute them now that every other chunk is in
            n = -(-plan.kv_tokens // self.chunk_shape[3])
            fix = RestoreRequest(plan.ctx, plan.kv_tokens, plan.token_ids, [], [], sorted(res.failed),
                                 [range(self.cfg.n_layers)], self.shm_name, self.capacity,
                                 present=[i for i in range(n) if i not in res.failed], adapter=self._adapter(plan),
                                 resident_layers=streamed_from(ws))
            again = self.worker.restore(fix)
            res.recomputed = again.recomputed
            res.timeline += again.timeline
        res, _ = self._finish(ws, plan, res, self.cfg.n_layers, whole=[i for i, _enc in whole])
        # resident after the reply as read (`ModelExecutor._write_back`); their payloads map the
        # object store's objects of the stream, which they keep until the write-back has put them
        return res, [(i, enc, enc.nbytes) for i, enc in whole]

    def _resolve_keys(self, keys: list[int]) -> list:
        """The resident chunks of `keys`: the views kept at `put`, fetched where one is missing."""
        views = [self.views.get(k) for k in keys]
        missing = [k for k, v in zip(keys, views) if v is None]
        fetched = iter(resolve_chunks([self.held[k] for k in missing]) if missing else ())
        return [v if v is not None else next(fetched) for v in views]

    def _batches(self, refs, ctx: str, loads: list[int], adapter: str):
        """The IO worker's batches, fetched; if the worker stops mid-stream, the restarted one reads
        the rest in one go (a batch of index -1)."""
        got: set[int] = set()
        failed: dict[int, str] = {}
        try:
            for ref in refs:
                batch = ray.get(ref)
                got.update(i for i, _c in batch.chunks)
                failed.update(batch.failed)
                yield batch
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.ActorDiedError):
            rest = [i for i in loads if i not in got and i not in failed]
            t = time.monotonic()
            chunks, more = self.io.read(ctx, rest, adapter)
            yield ChunkBatch(-1, list(chunks.items()), {**failed, **more}, t, time.monotonic())

    def _finish(self, ws, plan, res, size, whole: list[int] = ()):
        reads = [(a, b) for what, _g, a, b in res.timeline if what == "read"]
        if reads and res.loaded_bytes:
            self.read_rate.observe(sum(b - a for a, b in reads), res.loaded_bytes)
        res.timeline.append(("group_layers", size, 0.0, 0.0))
        ws.missing = set()
        # chunks not read whole (layer by layer, or not at all) are encoded from the working set after the call
        plan.recompute = sorted(set(plan.recompute) | set(res.failed) | ({i for i, _, _ in plan.load} - set(whole)))
        return res, []


def per_ref_seconds(io_handle, n: int = 32) -> float:
    """What one streamed object ref costs between two actors here: a streaming generator of `n` tiny
    items, timed end to end (median of three runs)."""
    import statistics

    runs = []
    for _ in range(3):
        t = time.perf_counter()
        for ref in io_handle.ping.remote(n):
            ray.get(ref)
        runs.append((time.perf_counter() - t) / n)
    return statistics.median(runs)
