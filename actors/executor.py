"""The model executor: holds the active context's working set and runs calls (DESIGN.md §4 steps 1-6).

One call: wait for the previous call's write-back, ask the governor to lock and plan, restore the
context's K/V into the working set (resident chunks decoded, swapped chunks loaded, the rest
recomputed), run the engine's prefill and decode, commit the new token ids, then encode the modified
chunks and hand them to the governor (after the reply: ahead-of-time swap-out happens there).

`switch_ms` is measured from the call's arrival until every K/V of the context can be attended in the
compute dtype: it includes waiting for a pending write-back, eviction and on-demand writes done for
this restore, reading, de-quantizing and recomputing; it excludes the new prompt's prefill and decode.

The restore itself is delegated to a `restorer` (`InProcessRestorer` here; `actors.recompute` has the
pipelined one). A plain class: `actors.service` makes it a Ray actor or calls it directly.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from actors.governor import CallPlan
from actors.recompute import RestoreStats, stage_seconds
from engine.chat import Conversation, Turn
from engine.context import ContextEngine, Context as EngineContext
from engine.density import DensityTracker
from engine.kvcache import KVCache
from engine.sampling import BadRequestError
from engine.threads import single_threaded_torch
from storage import codecs


@dataclass(slots=True)
class CallOutcome:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    switch_ms: float
    """Context switching latency (DESIGN.md §1)."""
    restore: RestoreStats
    predicted_restore_ms: float
    """The planner's prediction of the restore, ms (0 for a hit)."""
    model_restore_ms: float
    """The one-shot profile's own prediction of it, without online correction, ms."""
    ttft_s: float
    """Time to first token from the call's arrival at the executor (switch included), seconds."""
    total_s: float
    prefilled_tokens: int
    cached_tokens: int
    hit: bool = False
    """The working set still held the whole context: nothing was restored."""


def density_blob(tr: DensityTracker) -> bytes:
    return tr.sums.astype("<f8").tobytes() + tr.rows.astype("<i8").tobytes()


def density_from_blob(blob: bytes, tr: DensityTracker) -> None:
    n = len(blob) // 16
    tr.sums = np.frombuffer(blob[: 8 * n], "<f8").copy()
    tr.rows = np.frombuffer(blob[8 * n :], "<i8").copy()


SAVED_CONTEXTS = 64
"""Contexts whose token ids and state an executor keeps from its own commits (a few tens of KB each),
so that `begin_call` need not read or send them: on Ray a 2K-token context's plan is ~40 KB with
them and ~3 KB without."""


class CallTimeoutError(TimeoutError):
    code = "timeout"


STREAM_MIN_BYTES = 48 << 20
"""A restore that de-quantizes at least this many bytes of K/V writes them with non-temporal stores
(`codecs.decode(..., stream=True)`). On the 2-core Xeon test VM a write-then-read of 48 MB took 6.5 ms
that way against 7.5 ms with ordinary stores, of 32 MB 5.2 against 4.6 (the caches still help), and
a 74 MB restore's de-quantizing 4.2 against 8.2 ms (docs/benchmarks.md, "Context switching", session 17)."""


def streams(ws: KVCache, n_chunks: int) -> bool:
    """Whether de-quantizing `n_chunks` chunks into `ws` is large enough for non-temporal stores."""
    per_chunk = ws.nbytes() // ws.capacity * ws.chunk_tokens
    return ws.device.type == "cpu" and n_chunks * per_chunk >= STREAM_MIN_BYTES


class InProcessRestorer:
    """Restore in the executor's own process: decode resident chunks, read and decode loaded ones,
    recompute the rest through all layers. The baseline the actor pipeline is compared against.

    Without recompute, de-quantizing runs on a pool of `threads` threads (the compiled codecs and lz4
    release the GIL) and is handed each loaded chunk as soon as the store has read and checked it,
    while this thread goes on reading: the pool decodes the resident chunks, then the loaded ones,
    beside the reads, and both cores work. Each chunk's decode is its own ("decode", index) event of
    the timeline, so the decode stage counts the work done, not the part the reads left visible."""

    def __init__(self, model, io, resolve: Callable[[Any], codecs.EncodedChunk] = lambda h: h,
                 threads: int = 2, group_layers: int = 6) -> None:
        self.model = model
        self.threads = threads
        self.group_layers = group_layers
        self.io = io
        self.resolve = resolve
        self.pool = (ThreadPoolExecutor(threads, thread_name_prefix="decode", initializer=single_threaded_torch)
                     if threads > 1 else None)

    def restore(self, ws: KVCache, plan: CallPlan) -> tuple[RestoreStats, list[tuple[int, Any, int]]]:
        """Fill `ws`; returns what was done and the chunks read whole from disk (index, enc, bytes)."""
        if plan.recompute and plan.load and ws.device.type == "cpu":
            return self._pipelined(ws, plan), []
        stats = RestoreStats()
        kv = ws.kv.numpy() if ws.device.type == "cpu" else None
        events = stats.timeline

        stream = streams(ws, len(plan.resident) + len(plan.load))

        def submit(i: int, enc: codecs.EncodedChunk):
            if self.pool is None or kv is None:  # off the CPU the device's own queue orders the copies
                decode_timed(ws, kv, i, enc, events)
                return None
            return self.pool.submit(decode_timed, ws, kv, i, enc, events, stream)

        jobs = [submit(i, self.resolve(handle)) for i, _level, handle in plan.resident]
        stats.resident += len(plan.resident)
        loaded = []
        recompute = list(plan.recompute)
        try:
            if plan.load:
                t = time.monotonic()
                got, failed = self.io.read_stream(plan.ctx, [i for i, _, _ in plan.load])
                for i, enc in got:
                    jobs.append(submit(i, enc))
                    loaded.append((i, enc, enc.nbytes))
                    stats.loaded_bytes += enc.nbytes
                events.append(("read", -1, t, time.monotonic()))
                stats.loaded += len(loaded)
                stats.faults += len(failed)
                stats.failed.update(failed)
                recompute += list(failed)
        finally:
            for j in jobs:  # every decode ends before the working set is touched again, even on an error
                if j is not None:
                    j.result()
        if recompute:
            t = time.monotonic()
            self.model.recompute(ws, plan.token_ids, sorted(recompute))
            events.append(("recompute", -1, t, time.monotonic()))
            stats.recomputed += len(recompute)
        return stats, loaded

    def _pipelined(self, ws: KVCache, plan: CallPlan) -> RestoreStats:
        """Loads and recompute overlapped as on Ray (Fig. 8): a reader thread streams layer groups
        (file reads and lz4 release the GIL) while this thread decodes and recomputes layer by layer."""
        import queue

        from actors.recompute import RestoreRequest, pipelined_restore
        from actors.swapio import layer_groups

        groups = layer_groups(self.model.cfg.n_layers, self.group_layers)
        load = [i for i, _, _ in plan.load]
        q: queue.Queue = queue.Queue()

        def reader():
            single_threaded_torch()
            try:
                for grp in self.io.read_groups(plan.ctx, load, groups):
                    q.put(grp)
            except BaseException as e:  # handed to the consumer, raised there
                q.put(e)
            q.put(None)

        def stream():
            while (item := q.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item

        t = threading.Thread(target=reader, name="kv-reader", daemon=True)
        t.start()
        req = RestoreRequest(plan.ctx, plan.kv_tokens, plan.token_ids, [(i, h) for i, _, h in plan.resident],
                             load, list(plan.recompute), groups)
        try:
            res = pipelined_restore(self.model, ws, req, stream(), lambda hs: [self.resolve(h) for h in hs])
        finally:
            t.join()
        plan.recompute = sorted(set(plan.recompute) | set(res.failed) | set(load))  # re-encode after the call
        return res


def decode_timed(ws: KVCache, kv: np.ndarray | None, i: int, enc: codecs.EncodedChunk, events: list,
                 stream: bool = False) -> None:
    """De-quantize chunk `i` into the working set (`kv`: its numpy view on the CPU, else None) and
    add its ("decode", i, start, end) event to `events` (safe from several threads). `stream`: see
    `streams`."""
    a = time.monotonic()
    _decode_into(ws, kv, i, enc, stream)
    events.append(("decode", i, a, time.monotonic()))  # list.append is atomic under the GIL


def _decode_into(ws: KVCache, kv: np.ndarray | None, i: int, enc: codecs.EncodedChunk, stream: bool = False) -> None:
    s, e = ws.chunk_range(i)
    if kv is not None:
        codecs.decode(enc, out=kv[:, :, :, s:e], stream=stream)
    else:
        ws.put_chunk(i, codecs.decode(enc))
    ws.missing.discard(i)  # set.discard is atomic under the GIL


class ModelExecutor:
    def __init__(
        self,
        engine: ContextEngine,
        governor,
        restorer,
        *,
        working_set: KVCache | None = None,
        put: Callable[[list[codecs.EncodedChunk]], list[Any]] = list,
        background: bool = True,
    ) -> None:
        self.engine = engine
        self.model = engine.model
        self.gov = governor
        self.restorer = restorer
        self.put = put
        """Handles for encoded chunks, one per chunk, in order (on Ray: object refs, put in one go)."""
        self.chunk = engine.cfg.chunk_tokens
        self.ws = working_set or self.model.new_cache(engine.limit)
        self._last: tuple[str, str | None, EngineContext] | None = None
        """(context, app, engine context) of the last call, while the working set holds it."""
        self.level_dtype = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[
            self.model.dtype
        ]
        self._bg = (ThreadPoolExecutor(1, thread_name_prefix="writeback", initializer=single_threaded_torch)
                    if background else None)
        self._pending: Future | None = None
        self._lock = threading.Lock()
        self._saved: OrderedDict[str, tuple[int, np.ndarray, str, bytes]] = OrderedDict()
        """Context -> (version, token ids, state, density) as this executor last committed them, the
        most recent `SAVED_CONTEXTS`: `begin_call` leaves them out of the plan while still current."""

    @property
    def ws_ctx(self) -> str | None:
        """The context the working set holds whole, from its last call (None: restore next time)."""
        return self._last[0] if self._last is not None else None

    @ws_ctx.setter
    def ws_ctx(self, value: None) -> None:
        if value is not None:
            raise ValueError("the working set's context is set by a call, not assigned")
        self._last = None

    # ---- contexts ---------------------------------------------------------------------------------
    def new_ctx(self, app: str, system_prompt: str | None = None,
                history: list[tuple[str, str]] | None = None) -> str:
        """Create a context; `history` seeds it with earlier (role, text) turns, `user` or `assistant`
        (a stateless OpenAI-style call): their ids are prefilled with the next call."""
        from engine.context import PromptTooLongError

        tok = self.engine.tok
        turns = [Turn("system", system_prompt)] if system_prompt is not None else []
        for role, text in history or []:
            if role not in ("user", "assistant") or not isinstance(text, str):
                raise BadRequestError("history turns are (user|assistant, text)")
            turns.append(Turn(role, text, tok.encode(text) if role == "assistant" else None))
        if history:
            ids = tok.conversation_ids(Conversation(turns))
        else:
            ids = tok.system_ids(system_prompt)
        if len(ids) > self.engine.tail_room():
            raise PromptTooLongError(f"the conversation of {len(ids)} tokens does not fit the context limit "
                                     f"of {self.engine.limit} tokens")
        ctx = self.gov.new_ctx(app, system_prompt or "")
        state = {"system_prompt": system_prompt, "turns": [{"role": t.role, "text": t.text} for t in turns] if history else [],
                 "kv_tokens": 0, "overflows": 0}
        self.gov.registry.save_state(ctx, np.asarray(ids, dtype=np.int64), tok.decode(ids), json.dumps(state), b"")
        return ctx

    def flush(self) -> None:
        """Wait for the last call's write-back."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    # ---- a call -----------------------------------------------------------------------------------
    def call(self, app: str | None, ctx_id: str, prompt: str, deadline: float | None = None, **params):
        """Generator of text deltas; returns a `CallOutcome` (StopIteration.value). `deadline`
        (`time.time()` seconds): past it the call stops, rolls back and raises `CallTimeoutError`."""
        with self._lock:
            if deadline is not None and time.time() > deadline:
                raise CallTimeoutError("the call waited past its deadline before it started")
            t0 = time.perf_counter()
            self.flush()  # a pending write-back is waited for inside switch_ms
            cached = self.ws_ctx == ctx_id and not self.ws.missing
            # the working set holds this context from the same app's last call: nothing to restore, and
            # a governor one hop away (Ray) takes the lock while the call runs, checked before the commit
            last = self._last if cached and self._last[1] == app else None
            nowait = getattr(self.gov, "begin_call_nowait", None) if last is not None else None
            confirm = None
            if nowait is not None:
                confirm = nowait(ctx_id, app)
                plan = CallPlan(ctx=ctx_id, token_ids=np.zeros(0, np.int32), state=None, density=b"",
                                kv_tokens=self.ws.length, resident=[], load=[], recompute=[])
            else:
                saved = self._saved.get(ctx_id)
                plan = self.gov.begin_call(ctx_id, app, cached=cached, known=saved[0] if saved else None)
                if plan.reused:
                    if saved is None or saved[0] != plan.version:  # not expected: the governor checked
                        self.gov.abort_call(ctx_id)
                        raise RuntimeError(f"the plan of {ctx_id} reuses version {plan.version}, which this "
                                           "executor does not hold")
                    _v, plan.token_ids, plan.state, plan.density = saved
            try:
                stats = RestoreStats()
                if not cached:
                    tr = time.perf_counter()
                    stats = self._restore(plan)
                    stats.seconds = time.perf_counter() - tr
                switch_ms = (time.perf_counter() - t0) * 1000
                if not cached:
                    self.gov.record_restore(ctx_id, stats.seconds, stage_seconds(stats.timeline))
                ectx = last[2] if confirm is not None else self._engine_context(plan)
                old_kv, old_overflows = ectx.cache.length, ectx.overflows
                t_engine = time.perf_counter()
                stream = self.engine.stream(ectx, prompt, **params)
                for delta in stream:
                    if deadline is not None and time.time() > deadline:
                        raise CallTimeoutError("the call ran past its deadline; its turn was rolled back")
                    yield delta
                r = stream.result
                if ectx.cache is not self.ws:  # an overflow re-prefilled into a new cache: take it over
                    n = ectx.cache.length
                    self.ws.truncate(0)
                    self.ws.reserve(n)
                    self.ws.kv[:, :, :, :n].copy_(ectx.cache.kv[:, :, :, :n])
                    ectx.cache = self.ws
                first_modified = 0 if ectx.overflows != old_overflows else old_kv // self.chunk
                if confirm is not None:
                    confirm()  # the deferred begin_call's errors surface here, before anything is committed
                    confirm = None
                todo = self._commit(plan, ectx, first_modified, restored=list(plan.recompute))
            except BaseException:
                self._last = None  # the working set may hold a half call: restore next time
                if confirm is not None:
                    with contextlib.suppress(Exception):
                        confirm()
                self.gov.abort_call(ctx_id)
                raise
            self._last = (ctx_id, app, ectx)
            job = lambda: self._write_back(ctx_id, todo)  # noqa: E731
            if self._bg is not None:
                self._pending = self._bg.submit(job)
            else:
                job()
        return CallOutcome(
            text=r.text,
            token_ids=r.token_ids,
            finish_reason=r.finish_reason,
            prompt_tokens=r.prompt_tokens,
            completion_tokens=r.completion_tokens,
            switch_ms=switch_ms,
            restore=stats,
            predicted_restore_ms=plan.predicted_s * 1000 if not cached else 0.0,
            model_restore_ms=plan.model_predicted_s * 1000 if not cached else 0.0,
            ttft_s=t_engine - t0 + r.ttft_s,  # from the call's arrival: the switch is inside
            total_s=time.perf_counter() - t0,
            prefilled_tokens=r.prefilled_tokens,
            cached_tokens=r.cached_tokens,
            hit=cached,
        )

    def _restore(self, plan: CallPlan) -> RestoreStats:
        ws = self.ws
        self.ws_ctx = None
        ws.truncate(0)
        ws.reserve(plan.kv_tokens)
        ws.missing = set(range(ws.n_chunks))
        stats, loaded = self.restorer.restore(ws, plan)
        if ws.missing:
            raise RuntimeError(f"restore left chunks {sorted(ws.missing)} missing")
        if loaded:
            fresh = [enc for _i, enc, _n in loaded if not _is_handle(enc)]
            handles = iter(self.put(fresh))
            self.gov.loaded(plan.ctx, [(i, next(handles) if not _is_handle(enc) else enc, n) for i, enc, n in loaded])
        return stats

    def _engine_context(self, plan: CallPlan) -> EngineContext:
        state = json.loads(plan.state) if plan.state else {"system_prompt": None, "turns": [], "overflows": 0}
        conv = Conversation([Turn(t["role"], t["text"]) for t in state["turns"]])
        if state.get("system_prompt") is not None and not conv.turns:
            conv.turns.append(Turn("system", state["system_prompt"]))
        tr = DensityTracker(self.model.cfg.n_heads, self.model.cfg.n_layers)
        density_from_blob(plan.density, tr)
        return EngineContext(
            id=plan.ctx,
            system_prompt=state.get("system_prompt"),
            token_ids=[int(t) for t in plan.token_ids],
            conv=conv,
            cache=self.ws,
            density=tr,
            overflows=state.get("overflows", 0),
        )

    def _commit(self, plan: CallPlan, ectx: EngineContext, first_modified: int, restored: list[int]) -> dict[int, str]:
        state = {
            "system_prompt": ectx.system_prompt,
            "turns": [{"role": t.role, "text": t.text} for t in ectx.conv.turns],
            "kv_tokens": ectx.cache.length,
            "overflows": ectx.overflows,
        }
        text = self.engine.tok.decode(ectx.token_ids)
        state_json, density = json.dumps(state), density_blob(ectx.density)
        todo, version = self.gov.commit_call(
            plan.ctx,
            ectx.token_ids,
            text,
            state_json,
            density,
            ectx.cache.length,
            ectx.density.chunk_density(self.chunk),
            first_modified,
            restored,
        )
        self._saved[plan.ctx] = (version, np.asarray(ectx.token_ids, dtype=np.int32), state_json, density)
        self._saved.move_to_end(plan.ctx)
        while len(self._saved) > SAVED_CONTEXTS:
            self._saved.popitem(last=False)
        return todo

    def _write_back(self, ctx: str, todo: dict[int, str]) -> None:
        """Encode the chunks the governor asked for and admit them to the pool (after the reply). The
        chunks are encoded straight from the working set: the next call waits for this (`flush`)
        before it writes there."""
        order = sorted(todo.items())
        encs = [codecs.encode(self.ws.chunk_array(i), level, dtype=self.level_dtype) for i, level in order]
        encoded = [(i, level, h, enc.nbytes) for (i, level), enc, h in zip(order, encs, self.put(encs))]
        self.gov.admit(ctx, encoded, {i: i * self.chunk for i, _ in order})


def _is_handle(x) -> bool:
    return not isinstance(x, codecs.EncodedChunk)
