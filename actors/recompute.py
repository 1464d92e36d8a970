"""The recompute worker and the pipelined restore (LLMS §3.3, Fig. 8; docs/design.md §4 step 3).

The worker holds the model (weights memory-mapped read-only, shared with the executor) and maps the
executor's working set, a shared-memory buffer `[L, 2, Hkv, capacity, D]`. For a restore it decodes the
resident chunks, then consumes the KV swap/IO worker's per-layer-group stream: as soon as the layers of
group `g` of every loaded chunk have arrived and been decoded, it recomputes those layers of the
planned chunks (`Transformer.recompute_layer`), while the IO worker already reads group `g+1`.
Nothing but encoded chunk bytes crosses processes (numpy, zero-copy: the IO worker copies them into the
staging area after the working set in the same segment, or, past its end, they come out of the object
store); the decoded K/V are written in place, where the executor attends to them.

A chunk whose file turns out missing or corrupt is recomputed instead (a second, full pass if the fault
shows up after its first layers were used), so a restore never yields wrong K/V.
"""

from __future__ import annotations

import time
from multiprocessing import shared_memory
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from actors.messages import RestoreRequest, RestoreStats
from engine.config import ModelConfig
from engine.kvcache import KVCache
from storage import codecs


_STAGE_OF = {"resident": "decode", "decode": "decode", "read": "io", "recompute": "recompute"}


def stage_seconds(timeline) -> dict[str, float]:
    """Seconds of each restore stage (scheduler.pipeline.STAGES) from a restore's timeline: reads,
    de-quantizing (resident and loaded chunks), recompute. Reads overlap the consumer's work in a
    pipelined restore; each stage is summed on its own."""
    out = {"io": 0.0, "decode": 0.0, "recompute": 0.0}
    for what, _where, a, b in timeline:
        stage = _STAGE_OF.get(what)
        if stage is not None and b > a:
            out[stage] += b - a
    return out


def working_set_nbytes(cfg: ModelConfig, capacity: int) -> int:
    """Bytes of a float32 working set of `capacity` tokens, rounded up to whole cache lines (a
    staging area may follow it in the same segment)."""
    from actors.swapio import STAGING_ALIGN

    n = cfg.n_layers * 2 * cfg.n_kv_heads * capacity * cfg.head_dim * 4
    return -(-n // STAGING_ALIGN) * STAGING_ALIGN


def shared_working_set(cfg: ModelConfig, capacity: int, name: str, create: bool,
                       staging_bytes: int = 0) -> tuple[shared_memory.SharedMemory, torch.Tensor]:
    """A float32 `[L, 2, Hkv, capacity, D]` tensor over POSIX shared memory `name`; the creator can
    add `staging_bytes` after it (the IO worker's staging area, `actors.swapio.StagedChunk`). Pages
    cost memory only once written."""
    from actors.swapio import attach_segment

    shape = (cfg.n_layers, 2, cfg.n_kv_heads, capacity, cfg.head_dim)
    if create:
        try:  # a segment left by a crashed executor of the same name
            old = shared_memory.SharedMemory(name=name)
            old.close()
            old.unlink()
        except FileNotFoundError:
            pass
        shm = shared_memory.SharedMemory(name=name, create=True,
                                         size=working_set_nbytes(cfg, capacity) + max(0, staging_bytes))
    else:
        shm = attach_segment(name)
    arr = np.ndarray(shape, dtype=np.float32, buffer=shm.buf)
    return shm, torch.from_numpy(arr)


def handed_over(items: Iterable, events: list) -> Iterator:
    """`items` (layer groups or chunk batches: each has `index` and `read_end`) as they come, adding a
    ("handover", index, ready, got) event for each to `events`: from when both it was read and this
    consumer was waiting for it, to when the consumer had it (one host: one monotonic clock, across
    processes too). What a hand-over costs, for `scheduler.pipeline.HandoverCost`."""
    it = iter(items)
    while True:
        waiting = time.monotonic()
        item = next(it, None)
        if item is None:
            return
        events.append(("handover", item.index, max(waiting, item.read_end), time.monotonic()))
        yield item


def pipelined_restore(model, ws: KVCache, req: RestoreRequest, stream: Iterable, resolve: Callable[[list], list]) -> RestoreStats:
    """Fill `ws` for `req`: decode resident chunks, decode each streamed layer group of the loaded
    chunks and recompute the same layers of the planned chunks right after."""
    res = RestoreStats()
    kv = ws.kv.numpy()
    ws.truncate(0)
    ws.reserve(req.kv_tokens)
    ws.missing = set(range(ws.n_chunks))
    if req.present:
        ws.mark_present(req.present)
    if req.resident:
        t = time.monotonic()
        for (i, _), enc in zip(req.resident, resolve([h for _, h in req.resident])):
            s, e = ws.chunk_range(i)
            codecs.decode(enc, out=kv[:, :, :, s:e])
            res.resident += 1
        ws.mark_present([i for i, _ in req.resident])
        res.timeline.append(("resident", -1, t, time.monotonic()))
    job = model.recompute_start(ws, req.token_ids, req.recompute) if req.recompute else None
    if req.load:
        for grp in handed_over(stream, res.timeline):
            t = time.monotonic()
            res.timeline.append(("read", grp.index, grp.read_start, grp.read_end))
            a, b = grp.layers.start, grp.layers.stop
            for i, enc in grp.chunks.items():
                s, e = ws.chunk_range(i)
                codecs.decode(enc, out=kv[a:b, :, :, s:e])
                res.loaded_bytes += enc.nbytes
            res.failed.update(grp.failed)
            res.timeline.append(("decode", grp.index, t, time.monotonic()))
            if job is not None and not res.failed:
                for layer in grp.layers:
                    t = time.monotonic()
                    model.recompute_layer(ws, job, layer)
                    res.timeline.append(("recompute", layer, t, time.monotonic()))
        res.loaded = len(set(req.load) - set(res.failed))
        ws.mark_present(set(req.load) - set(res.failed))
    res.faults = len(res.failed)
    if res.failed and not req.recompute_failed:
        ws.missing -= set(res.failed)  # the caller's to recompute
    elif res.failed:  # some file failed: recompute it and everything planned, all layers, exactly
        chunks = sorted(set(req.recompute) | set(res.failed))
        t = time.monotonic()
        model.recompute(ws, req.token_ids, chunks)
        res.timeline.append(("recompute", -1, t, time.monotonic()))
        res.recomputed = len(chunks)
    elif job is not None:
        for layer in range(job.next_layer, model.cfg.n_layers):
            t = time.monotonic()
            model.recompute_layer(ws, job, layer)
            res.timeline.append(("recompute", layer, t, time.monotonic()))
        res.recomputed = len(req.recompute)
    if ws.missing:
        raise RuntimeError(f"restore left chunks {sorted(ws.missing)} missing")
    return res


class RecomputeWorker:
    """Actor body: the model plus a view of the executor's shared working set."""

    def __init__(self, model_dir: str, fingerprint: str, engine_cfg, io=None, threads: int = 1) -> None:
        from engine.model import Transformer
        from storage.heap import retain_freed_memory

        torch.set_num_threads(max(1, threads))
        retain_freed_memory()
        self.model = Transformer.from_directory(model_dir, engine_cfg, fingerprint=fingerprint)
        self.chunk_tokens = engine_cfg.chunk_tokens
        if io is not None:
            from actors.ray_stubs import SwapIOStub

            io = SwapIOStub(io)
        self.io = io
        self.shm = None
        self.ws: KVCache | None = None
        from storage.heap import freeze_startup_objects

        freeze_startup_objects()  # no full collection walks torch's and the model's objects mid-restore

    def _attach(self, name: str, capacity: int) -> KVCache:
        """Map the executor's working set; again after the executor restarted with a new segment."""
        if self.shm is None or self.shm.name.lstrip("/") != name:
            if self.shm is not None:
                self.shm.close()
            self.shm, buf = shared_working_set(self.model.cfg, capacity, name, create=False)
            self.ws = KVCache.wrap(self.model.cfg, buf, chunk_tokens=self.chunk_tokens)
        return self.ws

    def restore(self, req: RestoreRequest) -> RestoreStats:
        import ray

        ws = self._attach(req.shm_name, req.capacity)
        stream = ()
        staged = [0]
        if req.load:
            staging = (req.shm_name, *req.staging) if req.staging else None
            gen = self.io.read_groups(req.ctx, req.load, req.groups, staging)
            stream = (ray.get(ref) for ref in gen)
            if staging is not None:
                area = np.ndarray(req.staging[1], np.uint8, buffer=self.shm.buf, offset=req.staging[0])
                stream = (unstage(grp, area, staged) for grp in stream)
        res = pipelined_restore(self.model, ws, req, stream, ray.get)
        res.staged_bytes = staged[0]
        return res


def unstage(grp, area: np.ndarray, staged: list[int]):
    """`grp` (a `LayerGroup`) with its staged chunks taken from `area`; adds their bytes to staged[0]."""
    import dataclasses

    from actors.swapio import unstaged

    chunks = {}
    for i, c in grp.chunks.items():
        chunks[i], n = unstaged(c, area)
        staged[0] += n
    return dataclasses.replace(grp, chunks=chunks)
