"""The bodies of the service's Ray actors: the memory governor, the KV swap/IO worker, the recompute
worker and the model executor, each a thin shell around the plain class of its role (the recompute
worker's, `actors.recompute.RecomputeWorker`, only gains the probe). The executor's restorer on Ray is
`actors.ray_restore.RayRestorer`; the query predictor's actor is `actors.ray_predictor`.

- governor and IO worker request no CPU; executor and recompute worker one each; the recompute worker
  runs torch on one thread, the executor's calls on every CPU (`Tuning.executor_threads`: the
  recompute worker's core is idle while a call decodes); governor and IO worker never load
  torch (this module imports what needs it inside the model actors' constructors): about 180 MiB of
  memory each;
- a restore that recomputes runs in the recompute worker, which consumes the IO worker's stream of
  layer groups (a Ray streaming generator) and decodes and recomputes into the executor's working
  set in shared memory; one that does not runs in the executor, which de-quantizes on a pool of two
  threads while the IO worker streams it batches of chunks (the worker is idle then);
- resident chunks are `EncodedChunk`s in the object store: the executor puts them, the governor holds
  the refs and the budget, the IO worker writes them to disk ahead of time;
- every actor restarts on failure and rebuilds its state from the registry and the chunk files; an
  interrupted call fails with an error, never with a wrong answer;
- every actor answers `alive` on a thread of its own (the `health` concurrency group), so a readiness
  probe is answered while a long call holds the actor's one working thread.

The actors reach each other through the typed stubs of `actors.ray_stubs`. What this module
deliberately does not know: policies (the governor's), the model's internals (the engine's), the
HTTP API (`deploy/`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import ray

from actors.config import ServiceConfig, Tuning, private_files
from actors.service import Components
from actors.messages import PoolRef, WithReleases
from actors.ray_stubs import GovernorStub, RecomputeStub, ResidentRefs, SwapIOStub, peer
from actors.recompute import RecomputeWorker
from actors.swapio import KVSwapIO
from engine.threads import torch_threads


RESTART_BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0)
"""Pause before a restarted actor starts again, by its restarts in the last `RESTART_WINDOW_S`: a
crash-looping actor slows down instead of spinning, one that failed once comes straight back."""
RESTART_WINDOW_S = 60.0

RAY_SYSTEM_CONFIG = {"free_objects_period_milliseconds": 50}
"""`ray.init(_system_config=...)` for a Ray the service starts itself (`llmaas serve`, a local replay):
freed objects are deleted every 50 ms instead of once a second, so the pages of a streamed context's
layers passing through the object store are reused instead of piling up in /dev/shm (docs/design.md,
step 5; `bench/serve_long_prompt.py` measures it). A Ray cluster the service joins keeps its own
setting (`deploy/serve_config.yaml` says how to start one with it)."""

HEALTH_GROUPS = {"health": 1}
"""The concurrency groups every actor of the service is made with (`ray.remote(concurrency_groups=...)`):
besides the default group, where the actor's work runs one call at a time, a `health` group with a
thread of its own for `Health.alive`. Calls still run in the order they were sent (max_concurrency
stays 1, so Ray keeps an actor's calls in order); only the probe overtakes them."""


class Health:
    """Mixed into every actor body: a probe that answers while a long call runs."""

    @ray.method(concurrency_group="health")
    def alive(self) -> bool:
        """True, at once: the process is up and past its start (a restarting actor does not answer).
        Runs in the `health` group (`HEALTH_GROUPS`), never queued behind a call."""
        return True


def restarted(role: str, data_dir: str, metrics) -> bool:
    """Call early in an actor's start: when Ray is restarting it after a failure, count the restart
    (`llmaas_actor_restarts_total{role}`; a file per role under `<data_dir>/restarts` keeps the times of
    the last 1,000) and pause by `RESTART_BACKOFF_S`. Returns whether this start is a restart."""
    with warnings.catch_warnings(action="ignore", category=DeprecationWarning):  # Ray's own property
        if not ray.get_runtime_context().was_current_actor_reconstructed:  # reads a deprecated one
            return False
    log, now = Path(data_dir) / "restarts" / role, time.time()
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        times = [float(x) for x in log.read_text().split()][-999:]
    except (FileNotFoundError, ValueError):
        times = []
    recent = [t for t in times if now - t < RESTART_WINDOW_S]
    log.write_text(" ".join(map(str, times + [now])))
    metrics.restarts.labels(role).inc()
    time.sleep(RESTART_BACKOFF_S[min(len(recent), len(RESTART_BACKOFF_S) - 1)])
    return True


class IOActor(KVSwapIO, Health):
    """The KV swap/IO worker actor: the plain worker plus its metrics (bytes and seconds each way).
    Writes run in a concurrency group of their own (`GROUPS`), one at a time and in order, so that a
    restore's reads never queue behind the previous call's writes ahead of time and their fsyncs."""

    GROUPS = {"write": 1}

    @ray.method(concurrency_group="write")
    def write(self, ctx: str, todo: list, adapter: str = "") -> list[dict]:
        return super().write(ctx, todo, adapter)

    def __init__(self, root: str, key, config, data_dir: str, tuning: Tuning = Tuning(), **kw) -> None:
        from actors.metrics import Metrics

        private_files()
        super().__init__(root, key, config, **kw)
        m = Metrics()
        m.start("io", data_dir)
        restarted("io", data_dir, m)
        for direction in ("in", "out"):
            m.swap.labels(direction)
            m.swap_seconds.labels(direction)

        def observe(direction: str, nbytes: int, seconds: float) -> None:
            m.swap.labels(direction).inc(nbytes)
            m.swap_seconds.labels(direction).inc(seconds)

        self.observe = observe


class GovernorActor(Health):
    """The memory governor actor: `MemoryGovernor` behind a lock (one method or one gauge publish at a
    time), its Prometheus gauges, and the keys of the handles released since the executor last heard."""

    PUBLISH_DELAY_S = 0.05

    def __init__(self, config: ServiceConfig, parts: Components, prefix: str, fingerprint: str) -> None:
        from actors.governor import MemoryGovernor
        from actors.metrics import Metrics
        from actors.profiling import ProfileCache, profile_key
        from engine.loader import cache_root
        from scheduler.pipeline import CostProfile
        from storage.registry import Registry

        private_files()
        c = config
        self.parts = parts
        reg = Registry(str(Path(c.data_dir) / "registry.db"), config=parts.registry)
        if c.profile:
            profile = CostProfile.from_json(c.profile)
        else:  # what the executor measured (one torch thread), if it has already: after a restart
            profile = ProfileCache(cache_root() / "profiles").get(
                profile_key(fingerprint, 1, c.chunk_tokens, c.read_bytes_per_s, weights=parts.engine.weights,
                            weights_resident=parts.engine.weights_resident_bytes))
        self._released: list[int] = []  # keys of handles dropped since the executor last heard
        self.epoch = os.urandom(8).hex()  # this governor process: a new one knows none of the old keys
        self._changed = threading.Event()  # set by every change, and by every write ahead of time done
        self.gov = MemoryGovernor(reg, SwapIOStub(peer(prefix, "io")), parts.governor, profile=profile,
                                  release=self._release, wake=self._changed.set)
        self.metrics = Metrics()
        self.metrics.start("governor", c.data_dir)
        restarted("governor", c.data_dir, self.metrics)
        self.metrics.evictions.labels(c.policy)
        self._evictions = 0
        self._publish()
        # the gauges are published by a thread of their own, PUBLISH_DELAY_S after a change, so that
        # their cost is not inside the reply of the call that made it (a switch's `begin_call`)
        self._lock = threading.Lock()
        threading.Thread(target=self._publisher, name="publish-gauges", daemon=True).start()

    def components(self) -> Components:
        """What this actor was built with (a test compares the two wirings)."""
        return self.parts

    @contextlib.contextmanager
    def _books(self):
        """The governor's books, one method at a time; the gauges follow each change."""
        try:
            with self._lock:
                yield self.gov
        finally:
            self._changed.set()

    # ---- GovernorPort ------------------------------------------------------------------------------
    def bind_app(self, app: str, adapter: str = "") -> str:
        with self._books() as g:
            return g.bind_app(app, adapter)

    def app_adapter(self, app: str) -> str:
        with self._lock:
            return self.gov.app_adapter(app)

    def app_for_token(self, token: str) -> str:
        with self._lock:  # reads nothing the gauges show
            return self.gov.app_for_token(token)

    def list_contexts(self, app: str) -> list:
        with self._lock:
            return self.gov.list_contexts(app)

    def delete_app(self, app: str) -> None:
        with self._books() as g:
            g.delete_app(app)

    def new_ctx(self, app: str, system_prompt: str, token_ids, text: str, state: str | None,
                adapter: str = "") -> str:
        with self._books() as g:
            return g.new_ctx(app, system_prompt, token_ids, text, state, adapter)

    def adapters(self) -> list:
        with self._lock:
            return self.gov.adapters()

    def add_adapter(self, name: str, path: str, key: str) -> None:
        with self._lock:
            self.gov.add_adapter(name, path, key)

    def remove_adapter(self, name: str) -> None:
        with self._lock:
            self.gov.remove_adapter(name)

    def describe(self, ctx: str, app: str | None = None) -> dict:
        with self._lock:
            return self.gov.describe(ctx, app)

    def delete_ctx(self, ctx: str, app: str | None = None) -> None:
        with self._books() as g:
            g.delete_ctx(ctx, app)

    # the executor's calls: each answer carries the keys released since the executor last heard
    def begin_call(self, ctx: str, app: str | None, cached: bool = False) -> WithReleases:
        """The plan, its resident chunks as their handles (`PoolRef`s of objects the executor put)."""
        with self._books() as g:
            return self._with_releases(g.begin_call(ctx, app, cached=cached))

    def record_restore(self, ctx: str, measured_s: float, stages: dict[str, float] | None = None) -> WithReleases:
        with self._books() as g:
            return self._with_releases(g.record_restore(ctx, measured_s, stages))

    def loaded(self, ctx: str, chunks: list) -> WithReleases:
        with self._books() as g:
            return self._with_releases(g.loaded(ctx, chunks))

    def commit_call(self, *args) -> WithReleases:
        with self._books() as g:
            return self._with_releases(g.commit_call(*args))

    def admit(self, ctx: str, encoded: list, token_starts: dict[int, int], stored: list | None = None) -> WithReleases:
        with self._books() as g:
            return self._with_releases(g.admit(ctx, encoded, token_starts, stored))

    def rehome(self, handles: list) -> WithReleases:
        """Resident chunks the executor put again (`ResidentRefs.put`): their new handles, by key."""
        moved = {h.key: h for h in handles}
        with self._books() as g:
            return self._with_releases(g.replace_handles(lambda h: moved.get(h.key) if isinstance(h, PoolRef) else None))

    def abort_call(self, ctx: str) -> WithReleases:
        with self._books() as g:
            return self._with_releases(g.abort_call(ctx))

    def executor_started(self) -> WithReleases:
        with self._books() as g:
            return self._with_releases(g.executor_started())

    def _with_releases(self, value) -> WithReleases:
        released, self._released = self._released, []
        return WithReleases(value, released, self.epoch)

    def set_profile(self, profile_json: str) -> None:
        with self._books() as g:
            g.set_profile(profile_json)

    def held_nbytes(self) -> int:
        return self.gov.pool_used

    def drain(self) -> None:
        with self._books() as g:
            g.drain()

    def held_handles(self) -> list:
        """The resident chunks' handles (tests check that the executor holds a ref for each)."""
        with self._lock:
            return self.gov.held_handles()

    # ---- internals -----------------------------------------------------------------------------------
    def _release(self, handle) -> None:
        if isinstance(handle, PoolRef):
            self._released.append(handle.key)

    def _publisher(self) -> None:
        while True:
            self._changed.wait()
            time.sleep(self.PUBLISH_DELAY_S)  # the other calls of the same switch come meanwhile
            self._changed.clear()
            with self._lock:
                try:  # writes ahead of time that finished: their rows into the registry
                    self.gov.reap()
                except Exception:  # noqa: BLE001 - an eviction's write on a full disk: the next call retries
                    logging.getLogger(__name__).exception("applying finished writes failed")
                self._publish()

    def _publish(self) -> None:
        """Gauges from the governor's books after every change (cheap: one pass over the chunk rows)."""
        from scheduler.levels import nominal_bits

        m, g, policy = self.metrics, self.gov, self.gov.cfg.policy
        counts: dict[tuple[str, str], int] = {}
        disk = 0
        for book in g.books.values():
            for ch in book.chunks.values():
                state = "resident" if ch.handle is not None else ("swapped" if ch.file else "missing")
                key = (state, str(nominal_bits(ch.level, g.cfg.dtype)))  # raw: the working set's bits
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


class RecomputeActor(RecomputeWorker, Health):
    """The recompute worker actor: the plain worker (`actors.recompute.RecomputeWorker`) and the probe."""

    def __init__(self, model_dir: str, fingerprint: str, engine_cfg, prefix: str, *args, **kw) -> None:
        super().__init__(model_dir, fingerprint, engine_cfg, peer(prefix, "io"), *args, **kw)


class ExecutorActor(Health):
    GROUPS = {"background": 1, "contexts": 1}
    """The query predictor's low-priority calls run in a group of their own, so that a real call reaches
    the executor while one runs and makes it yield (`actors.priority.PriorityLock`); creating a context
    and listing the adapters (no model state) in another, not waiting for a call."""

    def __init__(self, config: ServiceConfig, parts: Components, model_dir: str, fingerprint: str,
                 prefix: str) -> None:
        from actors.admission import streamable_working_set
        from actors.executor import ModelExecutor
        from actors.ray_restore import RayRestorer, per_ref_seconds
        from actors.recompute import (FileSegment, shared_working_set, unlink_stale_segments, warn_if_shm_small,
                                      working_set_nbytes)
        from engine.chat import ChatTokenizer
        from engine.context import ContextEngine
        from engine.kvcache import KVCache
        from engine.lora import AdapterSet
        from engine.model import Transformer

        # one thread runs torch on several (`engine.threads.torch_threads`): the calls' thread, which each
        # call sets (`_on_call_thread`); the constructor, the background group and helpers run on one
        self.threads = parts.tuning.executor_threads or len(os.sched_getaffinity(0))
        torch_threads(1)
        private_files()
        c, ecfg = config, parts.engine
        model = Transformer.from_directory(model_dir, ecfg, fingerprint=fingerprint)
        engine = ContextEngine(model, ChatTokenizer(model_dir), ecfg)
        # a new segment per executor process: a restarted executor never shares a stale one
        shm_name = f"{prefix}-ws-{os.getpid()}"
        unlink_stale_segments(prefix)
        ws = None
        if c.prefill_budget_bytes:  # K/V that can leave memory layer by layer: a file on disk
            ws_dir = os.path.join(c.data_dir, "ws")
            unlink_stale_segments(prefix, Path(ws_dir))
            ws = streamable_working_set(model, engine.limit, ecfg.kv_format, ws_dir, shm_name)
        if ws is not None:
            self.shm = FileSegment(ws.pager.file)
            shm_name = self.shm.name
        else:
            warn_if_shm_small(working_set_nbytes(model.cfg, engine.limit, ecfg.kv_format))
            self.shm, buf = shared_working_set(model.cfg, engine.limit, shm_name, create=True,
                                               kv_format=ecfg.kv_format)
            ws = KVCache.wrap(model.cfg, buf, chunk_tokens=c.chunk_tokens, dtype=model.dtype)
        from scheduler.pipeline import CostProfile, ReadRate

        prof = CostProfile.from_json(c.profile) if c.profile else None
        self.read_rate = ReadRate(prof.io.slope if prof else 0.0)
        io_handle = peer(prefix, "io")
        self.per_ref_s = c.per_ref_s or per_ref_seconds(io_handle)
        t = parts.tuning
        refs = ResidentRefs(t.object_chunks)
        gov = GovernorStub(peer(prefix, "governor"), refs)
        refs.rehome = gov.rehome
        adapters = AdapterSet(c.adapter_dir(), model.cfg, device=model.device, dtype=model.dtype)
        restorer = RayRestorer(RecomputeStub(peer(prefix, "recompute")), model.cfg, shm_name, engine.limit,
                               c.chunk_tokens, self.per_ref_s, self.read_rate, SwapIOStub(io_handle), refs.held,
                               refs.views, tuning=t, adapters=adapters, storage_name=ws.storage_name)
        self.refs = refs
        self.ex = ModelExecutor(engine, gov, restorer,
                                working_set=ws, put=refs.put, background=True,  # write-back after the reply
                                overlap_admit=c.overlap_admit, adapters=adapters,
                                prefill_budget=c.prefill_budget_bytes, io=restorer.io)
        self.ex.load_recorded_adapters()
        # after a restart: the call in flight died with the old process, whose objects (the resident
        # chunks) are gone; the governor unlocks and rebuilds from the registry (a no-op at first start)
        interrupted = self.ex.gov.executor_started()
        if interrupted:
            logging.getLogger(__name__).warning("executor restarted: %d call(s) in flight were interrupted", interrupted)
        model.warmup()
        from actors.metrics import Metrics, init_executor_series

        self.policy = c.policy
        self.metrics = Metrics()
        self.metrics.start("executor", c.data_dir)
        init_executor_series(self.metrics, self.policy)
        restarted("executor", c.data_dir, self.metrics)
        self._weights_seen = 0  # the weight pager's bytes read, as last counted
        self._lookup_seen = (0, 0)  # lookup decoding's (guessed, kept), as last counted
        if model.weight_pager is not None:
            plan = model.weight_pager.plan
            for part, n in (("resident", plan.resident_bytes), ("streamed", plan.streamed_bytes),
                            ("window", plan.window_bytes)):
                self.metrics.weights.labels(part).set(n)

    def _observe(self, out: dict) -> None:
        from actors.metrics import switch_outcome

        m, p, r = self.metrics, self.policy, out["restore"]
        outcome = switch_outcome(out["hit"], r)
        m.switch.labels(p, outcome).observe(out["switch_ms"] / 1000)
        m.calls.labels(p, outcome).inc()
        m.ttft.labels(p).observe(out["ttft_s"])
        m.tokens.labels(p).inc(out["completion_tokens"])
        m.prefill_tokens.labels(out["prefill_plan"] or "unbudgeted").inc(out["prefilled_tokens"])
        m.streamed.inc(out["streamed_bytes"])
        pager = self.ex.engine.model.weight_pager
        if pager is not None:
            read = pager.bytes_read
            m.weights_read.inc(read - self._weights_seen)
            self._weights_seen = read
        m.decode_seconds.labels(p).inc(max(0.0, out["total_s"] - out["ttft_s"]))
        self._count_lookup()
        if r["recomputed"]:
            m.recompute.labels(p, "fault").inc(r["faults"])
            m.recompute.labels(p, "planned").inc(r["recomputed"] - r["faults"])
        missing = r["loaded"] + r["recomputed"]
        if missing:
            m.io_fraction.labels(p).set(r["loaded"] / missing)

    def _on_call_thread(self) -> None:
        """Every call's first step: torch runs on `self.threads` threads in this thread, the only one of
        the process that runs it on more than one."""
        torch_threads(self.threads)

    @ray.method(concurrency_group="contexts")
    def new_ctx(self, app: str, system_prompt: str | None, history: list | None = None,
                adapter: str | None = None) -> str:
        return self.ex.new_ctx(app, system_prompt, history, adapter)

    def add_adapter(self, name: str, path: str) -> dict:
        self._on_call_thread()
        return self.ex.add_adapter(name, path)

    def remove_adapter(self, name: str) -> None:
        self.ex.remove_adapter(name)

    @ray.method(concurrency_group="contexts")
    def list_adapters(self) -> list[dict]:
        return self.ex.list_adapters()

    def stream(self, app: str | None, ctx: str, prompt: str, params: dict):
        """Streaming generator: text deltas (str), then the `CallOutcome`."""
        self._on_call_thread()
        try:
            out = yield from self.ex.call(app, ctx, prompt, **params)
        except BaseException:
            self.metrics.calls.labels(self.policy, "error").inc()
            raise
        self._observe(asdict(out))
        yield out

    def rag_call(self, call):
        """`ModelExecutor.rag_call` (a RAG prompt from cached K/V nodes), with the call metrics."""
        self._on_call_thread()
        out = self.ex.rag_call(call)
        self._observe_rag(call, out)
        return out

    def rag_stream(self, call):
        """Streaming generator: `ModelExecutor.rag_stream`'s text deltas, then the `RagOutcome`."""
        self._on_call_thread()
        with contextlib.closing(self.ex.rag_stream(call)) as items:  # closed early: the call stops now
            for item in items:
                if not isinstance(item, str):
                    self._observe_rag(call, item)
                yield item

    def _observe_rag(self, call, out) -> None:
        if call.decode and not call.background:
            m, p = self.metrics, self.policy
            m.ttft.labels(p).observe(out.load_s + out.prefill_s)
            m.tokens.labels(p).inc(len(out.token_ids))
            m.decode_seconds.labels(p).inc(out.decode_s)
            self._count_lookup()

    def _count_lookup(self) -> None:
        """Lookup decoding's counts since the last call observed (background RAG calls' included)."""
        now = self.ex.engine.lookup
        self.metrics.lookup.labels("guessed").inc(now.guessed - self._lookup_seen[0])
        self.metrics.lookup.labels("kept").inc(now.kept - self._lookup_seen[1])
        self._lookup_seen = (now.guessed, now.kept)

    @ray.method(concurrency_group="background")
    def rag_background(self, call):
        """A low-priority `rag_call` (`RagCall.background`), beside the real calls' group, on one torch
        thread (`_on_call_thread`)."""
        torch_threads(1)
        return self.ex.rag_call(call)

    @ray.method(concurrency_group="health")
    def activity(self) -> tuple[float, int]:
        """`ExecutorPort.activity`, answered while a call runs."""
        return self.ex.activity()

    def stream_stateless(self, system_prompt: str | None, history: list | None, prompt: str, params: dict):
        """Streaming generator: text deltas (str), then the `CallOutcome` of a call on no context."""
        self._on_call_thread()
        try:
            out = yield from self.ex.call_stateless(system_prompt, history, prompt, **params)
        except BaseException:
            self.metrics.calls.labels(self.policy, "error").inc()
            raise
        m, p = self.metrics, self.policy
        m.ttft.labels(p).observe(out.ttft_s)
        m.tokens.labels(p).inc(out.completion_tokens)
        m.decode_seconds.labels(p).inc(max(0.0, out.total_s - out.ttft_s))
        self._count_lookup()
        yield out

    def profile(self, read_bytes_per_s: float) -> str:
        """Measure (or read the cached) pipeline cost profile with this process's model, on one torch
        thread: the recompute worker's, which runs the recomputation the profile prices."""
        from actors.profiling import load_or_measure

        torch_threads(1)  # the next call sets its own
        prof = load_or_measure(self.ex.model, self.ex.engine.fingerprint, read_bytes_per_s=read_bytes_per_s,
                               progress=False)
        if self.read_rate.s_per_byte <= 0:
            self.read_rate.s_per_byte = prof.io.slope
        return prof.to_json()

    def held_refs(self) -> int:
        """Object refs of resident chunks this executor holds (equal to the governor's resident chunks
        once a call's write-back is done: tests check that none leaks)."""
        self.ex.flush()
        return len(self.refs.held)

    def per_ref_cost(self) -> float:
        """Seconds one streamed object ref costs (measured at start)."""
        return self.per_ref_s

    def flush(self) -> None:
        """Wait for the last call's write-back (benchmarks wait here between calls, as an idle gap would)."""
        self.ex.flush()

    def forget(self, ctx: str) -> None:
        self.ex.forget(ctx)

    def close(self) -> None:
        try:  # the last write-back encodes from the working set: it must end before the segment goes
            self.ex.flush()
        except Exception:
            logging.getLogger(__name__).exception("the last write-back failed at shutdown")
        self.shm.close()
        self.shm.unlink()

