"""The context service on Ray: the memory governor, KV swap/IO worker, recompute worker and model
executor as separate actors exchanging object refs (the user's design card).

- governor and IO worker request no CPU; executor and recompute worker one each, with one torch thread
  each, so torch threads add up to at most 2 on a 2-core node;
- a restore that recomputes runs in the recompute worker, which consumes the IO worker's stream of
  layer groups (a Ray streaming generator) and decodes and recomputes into the executor's working
  set in shared memory; one that does not runs in the executor, which de-quantizes on a pool of two
  threads while the IO worker streams it batches of chunks (the worker is idle then);
- resident chunks are `EncodedChunk`s in the object store: the executor puts them, the governor holds
  the refs and the budget, the IO worker writes them to disk ahead of time;
- every actor restarts on failure (`max_restarts`) and rebuilds its state from the registry and the
  chunk files; an interrupted call fails with an error, never with a wrong answer.

`RayService` is the Python front (`bind`, `new_ctx`, `call`, `stream`, `delete_ctx`), usable from a
Ray job. The actor bodies are the plain classes of `actors.governor`, `actors.swapio`,
`actors.recompute` and `actors.executor`.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import ray

from actors.executor import decode_timed, streams
from actors.recompute import (RecomputeWorker, RestoreRequest, RestoreStats, handed_over, shared_working_set,
                              working_set_nbytes)
from actors.service import ServiceConfig, drain
from actors.swapio import KVSwapIO, layer_groups, unstaged
from engine.threads import single_threaded_torch
from scheduler.pipeline import HandoverCost, layer_group_size
from storage import codecs

NAMESPACE = "llmaas"


@dataclass(frozen=True, slots=True)
class PoolRef:
    """A resident chunk on Ray: the object ref the executor put, and a small key for it. The governor
    keeps the whole handle (the IO worker writes from the ref); a call plan carries only the key, which
    the executor maps back to the ref it holds, so `begin_call`'s reply carries no object refs (~90 of
    them cost ~2 ms a restore on the way back)."""

    key: int
    ref: object


def _ray_get(h):
    return ray.get(h.ref if isinstance(h, PoolRef) else h)


def call_retrying(method, *args, deadline_s: float = 60.0, **kwargs):
    """`ray.get(method.remote(...))`, retried while the actor is restarting. Safe for our actors:
    a restarted actor rebuilds its state from the registry and files, so nothing half-done survives."""
    delay, end = 0.05, time.monotonic() + deadline_s
    while True:
        try:
            return ray.get(method.remote(*args, **kwargs))
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > end:
                raise
            time.sleep(delay)
            delay = min(1.0, delay * 2)


class _Remote:
    """Calls a Ray actor's methods synchronously, as if it were the plain object."""

    def __init__(self, handle) -> None:
        self._h = handle

    def __getattr__(self, name):
        method = getattr(self._h, name)
        return lambda *a, **k: call_retrying(method, *a, **k)


class IOActor(KVSwapIO):
    """The KV swap/IO worker actor: the plain worker plus its metrics (bytes and seconds each way)."""

    def __init__(self, root: str, fingerprint: str, config, data_dir: str, **kw) -> None:
        from actors.metrics import Metrics
        from storage.heap import freeze_startup_objects, retain_freed_memory

        retain_freed_memory()  # fresh read buffers and payloads: keep freed memory, no page faults

        super().__init__(root, fingerprint, config, **kw)
        m = Metrics()
        m.start("io", data_dir)
        for direction in ("in", "out"):
            m.swap.labels(direction)
            m.swap_seconds.labels(direction)

        def observe(direction: str, nbytes: int, seconds: float) -> None:
            m.swap.labels(direction).inc(nbytes)
            m.swap_seconds.labels(direction).inc(seconds)

        self.observe = observe
        freeze_startup_objects()  # no full collection walks Ray's and the store's objects mid-restore


class GovernorActor:
    def __init__(self, cfg: dict, io_handle, fingerprint: str) -> None:
        from actors.governor import GovernorConfig, MemoryGovernor
        from storage.heap import retain_freed_memory
        from storage.registry import Registry, RegistryConfig

        retain_freed_memory()
        c = ServiceConfig(**cfg)
        reg = Registry(str(Path(c.data_dir) / "registry.db"), config=RegistryConfig(
            max_contexts_per_app=c.max_contexts_per_app, chunk_tokens=c.chunk_tokens))
        from scheduler.pipeline import CostProfile

        if c.profile:
            profile = CostProfile.from_json(c.profile)
        else:  # what the executor measured (one torch thread), if it has already: after a restart
            from actors.profiling import profile_key
            from engine.loader import cache_root
            from scheduler.pipeline import ProfileCache

            profile = ProfileCache(cache_root() / "profiles").get(
                profile_key(fingerprint, 1, c.chunk_tokens, c.read_bytes_per_s))
        # Eq. 4' groups: RayRestorer sizes them per restore (one when nothing is recomputed), so the
        # governor, which holds no model, plans with the in-process restorer's count for the default
        # model (30 layers in groups of 6)
        self._released: list[int] = []  # keys of handles dropped since the executor last heard
        self.epoch = os.urandom(8).hex()  # this governor process: a new one knows none of the old keys
        self.gov = MemoryGovernor(reg, _Remote(io_handle), GovernorConfig(
            pool_bytes=c.pool_bytes, chunk_tokens=c.chunk_tokens, policy=c.policy, pipeline_groups=5),
            profile=profile, release=self._release)
        self.registry = reg
        from actors.metrics import Metrics

        self.metrics = Metrics()
        self.metrics.start("governor", c.data_dir)
        self.metrics.evictions.labels(c.policy)
        self._evictions = 0
        self._publish()
        # the gauges are published by a thread of their own, PUBLISH_DELAY_S after a change, so that
        # their ~1 ms is not inside the reply of the call that made it (a switch's `begin_call`)
        self._lock = threading.Lock()  # the governor's books: one method or one publish at a time
        self._changed = threading.Event()
        threading.Thread(target=self._publisher, name="publish-gauges", daemon=True).start()
        from storage.heap import freeze_startup_objects

        freeze_startup_objects()  # no full collection walks the start-up's objects inside a `begin_call`

    PUBLISH_DELAY_S = 0.05

    def call(self, method: str, *args, **kwargs):
        try:
            with self._lock:
                return getattr(self.gov, method)(*args, **kwargs)
        finally:
            self._changed.set()

    def _publisher(self) -> None:
        while True:
            self._changed.wait()
            time.sleep(self.PUBLISH_DELAY_S)  # the other calls of the same switch come meanwhile
            self._changed.clear()
            with self._lock:
                self._publish()

    def call_from_executor(self, method: str, *args, **kwargs):
        """`call` for the executor: returns (result, keys of the handles dropped since its last call,
        this governor's epoch). A plan's resident chunks carry their keys, not their object refs."""
        out = self.call(method, *args, **kwargs)
        if method == "begin_call":
            out.resident = [(i, level, h.key if isinstance(h, PoolRef) else h) for i, level, h in out.resident]
        released, self._released = self._released, []
        return out, released, self.epoch

    def _release(self, handle) -> None:
        if isinstance(handle, PoolRef):
            self._released.append(handle.key)

    def _publish(self) -> None:
        """Gauges from the governor's books after every change (cheap: one pass over the chunk rows)."""
        from actors.metrics import BITS

        m, g, policy = self.metrics, self.gov, self.gov.cfg.policy
        counts: dict[tuple[str, str], int] = {}
        disk = 0
        for book in g.books.values():
            for ch in book.chunks.values():
                state = "resident" if ch.handle is not None else ("swapped" if ch.file else "missing")
                key = (state, BITS.get(ch.level, ch.level))
                counts[key] = counts.get(key, 0) + 1
                disk += ch.file_nbytes if ch.file else 0
        m.chunks.clear()
        for (state, bits), n in counts.items():
            m.chunks.labels(state, bits).set(n)
        m.pool.labels("resident").set(g.pool_used)
        m.pool.labels("budget").set(g.cfg.pool_bytes)
        m.pool.labels("disk").set(disk)
        m.active.labels(policy).set(len(g.books))
        ev = g.stats["evictions"]
        if ev > self._evictions:
            m.evictions.labels(policy).inc(ev - self._evictions)
        self._evictions = ev
        err = g.restore_error()
        if err is not None:
            m.restore_error.labels(policy).set(err)
        for stage, f in g.online.state()["stages"].items():
            m.cost_factor.labels(policy, stage).set(f)

    def registry_call(self, method: str, *args, **kwargs):
        with self._lock:
            return getattr(self.registry, method)(*args, **kwargs)

    def held_nbytes(self) -> int:
        return self.gov.pool_used


class _GovernorProxy:
    """The executor's view of the governor actor: attribute calls become actor calls. Holds the object
    refs of the chunks the executor put (`put`), by key, each with a zero-copy view of the object (its
    arrays map the object store's memory: no second copy), and drops both as the governor releases
    the chunk. The views let this executor de-quantize resident chunks without fetching them.

    Dropping an object costs ~0.1-0.2 ms (the object store frees it), and a switch that evicts room
    for a large load releases ~90 chunks, so the drops wait for the next `put` (the call's
    write-back, after the reply), which frees them before it puts anything new: the object store
    never holds both the evicted chunks and their replacements."""

    def __init__(self, handle) -> None:
        self._h = handle
        self.registry = _RegistryProxy(handle)
        self.held: dict[int, object] = {}
        self.views: dict[int, codecs.EncodedChunk] = {}
        self._dropped: list = []  # released refs and views, freed by the next `put`
        self._next_key = 0
        self._epoch: str | None = None
        self._lock = threading.Lock()  # the call and the write-back thread both call the governor

    def put(self, encs: list) -> list[PoolRef]:
        with self._lock:
            dropped, self._dropped = self._dropped, []
        del dropped  # the object store frees them here
        refs = [ray.put(enc) for enc in encs]
        views = ray.get(refs)  # one fetch for all: ~0.08 ms a chunk, against ~0.2 ms one by one
        out = []
        with self._lock:
            for ref, view in zip(refs, views):
                self._next_key += 1
                self.held[self._next_key], self.views[self._next_key] = ref, view
                out.append(PoolRef(self._next_key, ref))
        return out

    def __getattr__(self, name):
        return lambda *a, **k: self._settle(*call_retrying(self._h.call_from_executor, name, *a, **k))

    def begin_call_nowait(self, ctx: str, app: str | None):
        """`begin_call(ctx, app, cached=True)` sent without waiting (a call on the context the working
        set holds); returns the function that waits for it and raises its error."""
        ref = self._h.call_from_executor.remote("begin_call", ctx, app, cached=True)

        def confirm():
            try:
                out = ray.get(ref)
            except ray.exceptions.ActorUnavailableError:  # the governor is restarting: ask the new one
                out = call_retrying(self._h.call_from_executor, "begin_call", ctx, app, cached=True)
            return self._settle(*out)

        return confirm

    def _settle(self, out, released: list[int], epoch: str):
        with self._lock:
            if epoch != self._epoch:  # a new governor process: it holds none of the old chunks
                if self._epoch is not None:
                    self.held.clear()
                    self.views.clear()
                self._epoch = epoch
            for key in released:
                self._dropped += (self.held.pop(key, None), self.views.pop(key, None))
        return out


class _RegistryProxy:
    def __init__(self, handle) -> None:
        self._h = handle

    def __getattr__(self, name):
        return lambda *a, **k: call_retrying(self._h.registry_call, name, *a, **k)


class RayRestorer:
    """A restore on Ray. With recompute planned, the recompute worker does it, consuming the IO worker's
    stream of layer groups, sized per restore so that handing a group over (one object ref) costs
    under a tenth of reading it (scheduler.pipeline.layer_group_size), at the read rate last observed
    and the hand-over cost observed in recent restores (`HandoverCost`; never below the cost measured
    at start). Without, this executor does it (`_restore_here`)."""

    def __init__(self, worker, cfg, shm_name: str, capacity: int, chunk_tokens: int, per_ref_s: float,
                 read_rate, io, held: dict, views: dict, threads: int = 2,
                 staging: tuple[memoryview, int, int] | None = None) -> None:
        self.worker = worker
        self.io = io
        self.held = held  # key -> object ref of the resident chunks (the governor proxy's)
        self.views = views  # key -> zero-copy view of the same chunk
        self.cfg = cfg
        self.chunk_shape = (cfg.n_layers, 2, cfg.n_kv_heads, chunk_tokens, cfg.head_dim)
        self.shm_name, self.capacity = shm_name, capacity
        self.per_ref_s = per_ref_s
        self.handover = HandoverCost(per_ref_s)  # what a hand-over costs during restores, >= the idle figure
        self.read_rate = read_rate
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="decode", initializer=single_threaded_torch)
        self.staging: tuple[str, int, int] | None = None
        """(segment, offset, size) of the staging area the IO worker copies loaded chunks into."""
        self.stage_area: np.ndarray | None = None
        if staging is not None:
            buf, offset, size = staging
            self.staging = (shm_name, offset, size)
            self.stage_area = np.ndarray(size, np.uint8, buffer=buf, offset=offset)

    def _load_nbytes(self, plan) -> int:
        return sum(codecs.stored_nbytes(level, self.chunk_shape) for _, level, _ in plan.load)

    def group_size(self, plan) -> int:
        if not plan.recompute:  # nothing to overlap the reads with: one group, one hand-over
            return self.cfg.n_layers
        return layer_group_size(self.cfg.n_layers, self.handover.seconds, self.read_rate.s_per_byte,
                                self._load_nbytes(plan))

    def batch_size(self, plan) -> int:
        """Loaded chunks per streamed batch of `_restore_here`: the rule of `group_size`, over chunks."""
        n = len(plan.load)
        return layer_group_size(n, self.handover.seconds, self.read_rate.s_per_byte, self._load_nbytes(plan)) if n else 1

    def restore(self, ws, plan):
        lost = [i for i, _level, key in plan.resident if key not in self.held]
        if lost:  # not expected (the governor reports every handle it drops): recompute rather than fail
            plan.recompute = sorted(set(plan.recompute) | set(lost))
        keys = [(i, key) for i, _level, key in plan.resident if key in self.held]
        if not plan.recompute:  # nothing reads other chunks' K/V: restore here
            return self._restore_here(ws, plan, keys)
        size = self.group_size(plan)
        groups = layer_groups(self.cfg.n_layers, size)
        req = RestoreRequest(plan.ctx, plan.kv_tokens, plan.token_ids, [(i, self.held[key]) for i, key in keys],
                             [i for i, _, _ in plan.load], list(plan.recompute), groups,
                             self.shm_name, self.capacity, self.staging[1:] if self.staging else None)
        res = call_retrying(self.worker.restore, req)
        return self._finish(ws, plan, res, size)

    def _restore_here(self, ws, plan, keys):
        """Without recompute no chunk waits for another, so this executor does it all, as the one-process
        restorer does: a pool of `threads` threads de-quantizes the resident chunks, from the views kept
        at `put` (nothing fetched), then each batch of loaded chunks as the IO worker streams it in.
        The recompute worker is idle meanwhile, so the pool uses the core it would. Chunks whose file
        fails are recomputed by the worker once every other chunk is in (they attend to them)."""
        kv = ws.kv.numpy()
        res = RestoreStats(resident=len(keys))
        events = res.timeline
        stream = streams(ws, len(keys) + len(plan.load))
        decode = lambda i, enc: self.pool.submit(decode_timed, ws, kv, i, enc, events, stream)  # noqa: E731
        loads = [i for i, _, _ in plan.load]
        # ask for the reads before the decode threads take both cores: the IO worker's request (and the
        # worker itself, which requests no CPU) would otherwise wait behind them
        batches = (self.io.read_batches.remote(plan.ctx, loads, self.batch_size(plan), self.staging)
                   if loads else None)
        jobs = [decode(i, self.views.get(key) or ray.get(self.held[key])) for i, key in keys]
        got: set[int] = set()
        try:
            if loads:
                def take(chunks, failed, a, b, k):
                    for i, c in chunks:
                        enc, staged = unstaged(c, self.stage_area)
                        res.staged_bytes += staged
                        jobs.append(decode(i, enc))
                        got.add(i)
                        res.loaded_bytes += enc.nbytes
                    res.failed.update(failed)
                    events.append(("read", k, a, b))

                try:
                    for batch in handed_over((ray.get(ref) for ref in batches), events):
                        take(batch.chunks, batch.failed, batch.read_start, batch.read_end, batch.index)
                except (ray.exceptions.ActorUnavailableError, ray.exceptions.ActorDiedError):
                    # the IO worker stopped mid-stream: ask the restarted one for the rest
                    rest = [i for i in loads if i not in got and i not in res.failed]
                    t = time.monotonic()
                    chunks, failed = call_retrying(self.io.read, plan.ctx, rest)
                    take(chunks.items(), failed, t, time.monotonic(), -1)
        finally:
            for j in jobs:  # every decode ends before the working set is touched again, even on an error
                j.result()
        res.loaded, res.faults = len(got), len(res.failed)
        if res.failed:  # files found missing or corrupt: recompute them now that every other chunk is in
            n = -(-plan.kv_tokens // self.chunk_shape[3])
            fix = RestoreRequest(plan.ctx, plan.kv_tokens, plan.token_ids, [], [], sorted(res.failed),
                                 [range(self.cfg.n_layers)], self.shm_name, self.capacity,
                                 present=[i for i in range(n) if i not in res.failed])
            again = call_retrying(self.worker.restore, fix)
            res.recomputed = again.recomputed
            res.timeline += again.timeline
        return self._finish(ws, plan, res, self.cfg.n_layers)

    def _finish(self, ws, plan, res, size):
        reads = [(a, b) for what, _g, a, b in res.timeline if what == "read"]
        if reads and res.loaded_bytes:
            self.read_rate.observe(sum(b - a for a, b in reads), res.loaded_bytes)
        for what, _g, a, b in res.timeline:
            if what == "handover":
                self.handover.observe(b - a)
        res.timeline.append(("group_layers", size, 0.0, 0.0))
        ws.missing = set()
        plan.recompute = sorted(set(plan.recompute) | set(res.failed) | {i for i, _, _ in plan.load})
        return res, []  # loaded chunks are re-encoded from the working set after the call


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


class ExecutorActor:
    def __init__(self, cfg: dict, model_dir: str, fingerprint: str, gov_handle, recompute_handle, io_handle,
                 prefix: str, threads: int) -> None:
        import torch

        from actors.executor import ModelExecutor
        from engine.chat import ChatTokenizer
        from engine.config import EngineConfig
        from engine.context import ContextEngine
        from engine.kvcache import KVCache
        from engine.model import Transformer
        from storage.heap import retain_freed_memory

        torch.set_num_threads(max(1, threads))
        retain_freed_memory()  # write-back encodes into fresh payloads: keep freed memory, no page faults
        c = ServiceConfig(**cfg)
        ecfg = EngineConfig(max_context_tokens=c.max_context_tokens, chunk_tokens=c.chunk_tokens, device="cpu")
        model = Transformer.from_directory(model_dir, ecfg, fingerprint=fingerprint)
        engine = ContextEngine(model, ChatTokenizer(model_dir), ecfg)
        engine.fingerprint = fingerprint
        # a new segment per executor process: a restarted executor never shares a stale one
        shm_name = f"{prefix}-ws-{os.getpid()}"
        _unlink_stale_segments(prefix)
        ws_nbytes = working_set_nbytes(model.cfg, engine.limit)
        staging = ws_nbytes if c.staging_bytes < 0 else c.staging_bytes
        _warn_if_shm_small(ws_nbytes + staging)
        self.shm, buf = shared_working_set(model.cfg, engine.limit, shm_name, create=True, staging_bytes=staging)
        ws = KVCache.wrap(model.cfg, buf, chunk_tokens=c.chunk_tokens)
        from scheduler.pipeline import CostProfile, ReadRate

        prof = CostProfile.from_json(c.profile) if c.profile else None
        self.read_rate = ReadRate(prof.io.slope if prof else 0.0)
        self.per_ref_s = per_ref_seconds(io_handle)
        gov = _GovernorProxy(gov_handle)
        restorer = RayRestorer(recompute_handle, model.cfg, shm_name, engine.limit, c.chunk_tokens,
                               self.per_ref_s, self.read_rate, io_handle, gov.held, gov.views,
                               staging=(self.shm.buf, ws_nbytes, staging) if staging else None)
        self.ex = ModelExecutor(engine, gov, restorer,
                                working_set=ws, put=gov.put, background=True)  # write-back after the reply
        # after a restart: the call in flight died with the old process, whose objects (the resident
        # chunks) are gone; the governor unlocks and rebuilds from the registry (a no-op at first start)
        interrupted = self.ex.gov.executor_started()
        if interrupted:
            import logging

            logging.getLogger(__name__).warning("executor restarted: %d call(s) in flight were interrupted", interrupted)
        model.warmup()
        from actors.metrics import Metrics, init_executor_series

        self.policy = c.policy
        self.metrics = Metrics()
        self.metrics.start("executor", c.data_dir)
        init_executor_series(self.metrics, self.policy)
        from storage.heap import freeze_startup_objects

        freeze_startup_objects()  # no full collection walks torch's, Ray's and the model's objects in a call

    def _observe(self, out: dict) -> None:
        from actors.metrics import switch_outcome

        m, p, r = self.metrics, self.policy, out["restore"]
        outcome = switch_outcome(out["hit"], r)
        m.switch.labels(p, outcome).observe(out["switch_ms"] / 1000)
        m.calls.labels(p, outcome).inc()
        m.ttft.labels(p).observe(out["ttft_s"])
        m.tokens.labels(p).inc(out["completion_tokens"])
        m.decode_seconds.labels(p).inc(max(0.0, out["total_s"] - out["ttft_s"]))
        if r["recomputed"]:
            m.recompute.labels(p, "fault").inc(r["faults"])
            m.recompute.labels(p, "planned").inc(r["recomputed"] - r["faults"])
        missing = r["loaded"] + r["recomputed"]
        if missing:
            m.io_fraction.labels(p).set(r["loaded"] / missing)

    def new_ctx(self, app: str, system_prompt: str | None, history: list | None = None) -> str:
        return self.ex.new_ctx(app, system_prompt, history)

    def call(self, app: str | None, ctx: str, prompt: str, params: dict):
        """Streaming generator: text deltas (str), then the outcome as a dict."""
        try:
            out = asdict((yield from self.ex.call(app, ctx, prompt, **params)))
        except BaseException:
            self.metrics.calls.labels(self.policy, "error").inc()
            raise
        self._observe(out)
        yield out

    def profile(self, read_bytes_per_s: float) -> str:
        """Measure (or read the cached) pipeline cost profile with this process's model and threads."""
        from actors.profiling import load_or_measure

        prof = load_or_measure(self.ex.model, self.ex.engine.fingerprint, read_bytes_per_s=read_bytes_per_s,
                               progress=False)
        if self.read_rate.s_per_byte <= 0:
            self.read_rate.s_per_byte = prof.io.slope
        return prof.to_json()

    def held_refs(self) -> int:
        """Object refs of resident chunks this executor holds (equal to the governor's resident chunks
        once a call's write-back is done: tests check that none leaks)."""
        self.ex.flush()
        return len(self.ex.gov.held)

    def per_ref_cost(self) -> float:
        """Seconds one streamed object ref costs (measured at start)."""
        return self.per_ref_s

    def flush(self) -> None:
        """Wait for the last call's write-back (benchmarks wait here between calls, as an idle gap would)."""
        self.ex.flush()

    def forget(self, ctx: str) -> None:
        self.ex.flush()  # the context's write-back must finish before it can be deleted
        if self.ex.ws_ctx == ctx:
            self.ex.ws_ctx = None

    def close(self) -> None:
        try:  # the last write-back encodes from the working set: it must end before the segment goes
            self.ex.flush()
        except Exception:
            import logging

            logging.getLogger(__name__).exception("the last write-back failed at shutdown")
        self.shm.close()
        self.shm.unlink()


class CallInterruptedError(RuntimeError):
    """A call stopped by an actor failure (the service restarts the actor and rebuilds its state)."""

    code = "interrupted"


class RayService:
    """Start (or attach to) the actors of one node and call them (LLMS Table 1)."""

    _executor_down = False  # the last call saw the executor stop: wait for it before the next one

    def __init__(self, config: ServiceConfig, *, model_path: str | None = None,
                 prefix: str = "llmaas", max_restarts: int = 2) -> None:
        from engine.loader import resolve_model

        self.cfg = config
        resolved = resolve_model(model_path, progress=True)
        self.model_id = model_name(resolved)
        Path(config.data_dir).mkdir(parents=True, exist_ok=True)
        cfgd = asdict(config)
        common = dict(namespace=NAMESPACE, max_restarts=max_restarts, lifetime=None)
        self.io = ray.remote(IOActor).options(name=f"{prefix}-io", num_cpus=0, **common).remote(
            str(Path(config.data_dir) / "chunks"), resolved.fingerprint, _store_cfg(config), config.data_dir,
            resolve=_ray_get)
        self.gov = ray.remote(GovernorActor).options(name=f"{prefix}-governor", num_cpus=0, **common).remote(
            cfgd, self.io, resolved.fingerprint)
        from engine.config import EngineConfig

        ecfg = EngineConfig(max_context_tokens=config.max_context_tokens, chunk_tokens=config.chunk_tokens, device="cpu")
        self.recompute = ray.remote(RecomputeWorker).options(name=f"{prefix}-recompute", num_cpus=1, **common).remote(
            str(resolved.directory), resolved.fingerprint, ecfg, self.io, 1)
        self.executor = ray.remote(ExecutorActor).options(name=f"{prefix}-executor", num_cpus=1, **common).remote(
            cfgd, str(resolved.directory), resolved.fingerprint, self.gov, self.recompute, self.io, prefix, 1)
        ray.get([self.executor.__ray_ready__.remote(), self.recompute.__ray_ready__.remote()])
        if not config.profile:
            ray.get(self.gov.call.remote("set_profile", ray.get(self.executor.profile.remote(config.read_bytes_per_s))))

    @classmethod
    def attach(cls, config: ServiceConfig, prefix: str = "llmaas") -> "RayService":
        """The front of a service already running on this Ray cluster (e.g. from a `ray job submit`
        job): its actors are found by name, nothing is started."""
        self = cls.__new__(cls)
        self.cfg = config
        get = lambda role: ray.get_actor(f"{prefix}-{role}", namespace=NAMESPACE)  # noqa: E731
        self.io, self.gov, self.recompute, self.executor = get("io"), get("governor"), get("recompute"), get("executor")
        return self

    # ---- LLMS Table 1 --------------------------------------------------------------------------------
    def bind(self, app: str) -> str:
        return call_retrying(self.gov.registry_call, "create_app", app)

    def app_of(self, token: str) -> str:
        return call_retrying(self.gov.registry_call, "app_for_token", token)

    def new_ctx(self, token: str, system_prompt: str | None = None) -> str:
        return call_retrying(self.executor.new_ctx, self.app_of(token), system_prompt)

    def stream(self, token: str, ctx: str, prompt: str, **params):
        """Generator of text deltas; returns the outcome dict (StopIteration.value). Raises
        `CallInterruptedError` when the executor stops during the call; the next call waits until
        Ray has restarted it."""
        app = self.app_of(token)
        if self._executor_down:
            call_retrying(self.executor.__ray_ready__)
            self._executor_down = False
        try:
            for ref in self.executor.call.remote(app, ctx, prompt, params):
                item = ray.get(ref)
                if isinstance(item, dict):
                    return item
                yield item
        except (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError) as e:
            self._executor_down = True
            raise CallInterruptedError(
                "the model executor stopped during the call and is being restarted; the turn was recorded "
                "only if its reply had finished (see the context's history before retrying)") from e

    def call(self, token: str, ctx: str, prompt: str, **params) -> dict:
        return drain(self.stream(token, ctx, prompt, **params))

    def delete_ctx(self, token: str, ctx: str) -> None:
        app = self.app_of(token)
        call_retrying(self.executor.forget, ctx)
        call_retrying(self.gov.call, "delete_ctx", ctx, app)

    def shutdown(self) -> None:
        try:
            ray.get(self.executor.close.remote())
        finally:
            for h in (self.executor, self.recompute, self.gov, self.io):
                ray.kill(h)


def model_name(resolved) -> str:
    """The id clients see for the model (OpenAI `model`): the checkpoint's file or folder name."""
    src = Path(resolved.source)
    return src.stem if src.suffix == ".gguf" else src.name


def _unlink_stale_segments(prefix: str) -> None:
    """Remove working-set segments (`<prefix>-ws-<pid>`) left by executors that died without closing
    them: this service's prefix, or any `llmaas*` one; a segment of a live process is left alone."""
    from actors.metrics import pid_alive

    for seg in Path("/dev/shm").glob("*-ws-*"):
        owner, _, pid = seg.name.rpartition("-ws-")
        if pid.isdigit() and (owner == prefix or owner.startswith("llmaas")) and not pid_alive(int(pid)):
            seg.unlink(missing_ok=True)


def _warn_if_shm_small(nbytes: int) -> None:
    """The working set and staging area are pages of /dev/shm, taken as they are first written: a
    tmpfs smaller than that (a container's default is 64 MB) would kill the executor with SIGBUS
    mid-restore, so say so at start."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        import logging

        logging.getLogger(__name__).warning(
            "/dev/shm has %.0f MB free, less than the working set and staging area (%.0f MB): lower "
            "max_context_tokens or staging_bytes, or give the container more (docker --shm-size)",
            free / 1e6, nbytes / 1e6)


def _store_cfg(c: ServiceConfig):
    from storage.chunkfile import ChunkStoreConfig

    return ChunkStoreConfig(disk_cap_bytes=c.disk_cap_bytes, read_bytes_per_s=c.read_bytes_per_s,
                            read_burst_bytes=c.read_burst_bytes)
