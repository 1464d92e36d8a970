"""The model executor: holds the active context's working set and runs calls (docs/design.md §4, steps 1-6).

One call: wait for the previous call's write-back, ask the governor to lock and plan, restore the
context's K/V into the working set (resident chunks decoded, swapped chunks loaded, the rest
recomputed), run the engine's prefill and decode, commit the new token ids, then encode the modified
chunks and hand them to the governor (after the reply: ahead-of-time swap-out happens there).

`switch_ms` is measured from the call's arrival until every K/V of the context can be attended in the
compute dtype: it includes waiting for a pending write-back, eviction and on-demand writes done for
this restore, reading, de-quantizing and recomputing; it excludes the new prompt's prefill and decode.

The restore itself is delegated to a `restorer` (`actors.local_restore.InProcessRestorer` in one
process; `actors.ray_actors` has the one on Ray). A plain class implementing
`actors.ports.ExecutorPort`: `actors.service.wire_local` calls it directly,
`actors.ray_actors.ExecutorActor` makes it a Ray actor. What it deliberately does not
know: policies (the governor's), how chunks are stored (the IO worker's), HTTP.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from actors.admission import admit_prefill, apply_plan, prefill_shape, restore_layers
from actors.messages import (CallOutcome, CallPlan, CommitReply, RagCall, RagOutcome, RestoreStats,
                             check_deadline)
from actors.priority import PriorityLock
from actors.recompute import stage_seconds
from actors.restore import streamed_from
from engine.chat import Conversation, Turn
from engine.context import ContextEngine, LiveContext
from engine.density import DensityTracker
from engine.kvcache import KVCache
from engine.kvspill import trim_heap
from engine.lora import Adapter, AdapterError, AdapterSet
from engine.sampling import BadRequestError
from engine.threads import single_threaded_torch
from storage import codecs


def density_blob(tr: DensityTracker) -> bytes:
    return tr.sums.astype("<f8").tobytes() + tr.rows.astype("<i8").tobytes()


def density_from_blob(blob: bytes, tr: DensityTracker) -> None:
    n = len(blob) // 16
    tr.sums = np.frombuffer(blob[: 8 * n], "<f8").copy()
    tr.rows = np.frombuffer(blob[8 * n :], "<i8").copy()


@dataclass(slots=True)
class _Step:
    """A call between locking its context and committing it."""

    plan: CallPlan
    """The governor's plan (a placeholder with no chunks when the working set holds the context)."""
    cached: bool
    """The working set holds the whole context: nothing to restore."""
    ectx: "LiveContext | None"
    """The engine context kept from the last call, when it is this context's."""
    confirm: Callable[[], None] | None
    """Waits for a deferred `begin_cached_call` (None once done or when not deferred)."""
    loaded: list = field(default_factory=list)
    """(index, encoded chunk, bytes) of the chunks the restore read whole from disk: the write-back
    makes them resident (`MemoryGovernor.loaded`), after the reply."""


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
        overlap_admit: bool = False,
        adapters: AdapterSet | None = None,
        prefill_budget: int = 0,
        io=None,
    ) -> None:
        """`background`: write back after the reply on a thread of its own. `overlap_admit`: a call
        waits for the previous write-back only until it has encoded its chunks from the working set,
        unless both are on the same context (`ServiceConfig.overlap_admit`); the governor port must
        then take calls from two threads at once (the Ray stub's actor serialises them). `adapters`:
        the LoRA adapters this process has loaded (engine.lora), shared with an in-process restorer.
        `prefill_budget`: bytes a call's prefill may take (`ServiceConfig.prefill_budget_bytes`, 0: none).
        `io`: the swap/IO port RAG calls read and write their nodes through."""
        self.io = io
        self.engine = engine
        self.model = engine.model
        self.adapters = adapters or AdapterSet(None, engine.model.cfg)
        self._adapters_lock = threading.Lock()  # a context is not bound to an adapter being removed
        self.gov = governor
        self.restorer = restorer
        self.put = put
        """Handles for encoded chunks, one per chunk, in order (on Ray: object refs, put in one go)."""
        self.chunk = engine.cfg.chunk_tokens
        self.ws = working_set or self.model.new_cache(engine.limit, engine.cfg.kv_format)
        self._last: tuple[str, str | None, LiveContext, str] | None = None
        """(context, app, engine context, state JSON committed) of the last call, while the working set
        holds it: a call the working set answers gets no state with its plan, and checks its request
        id against this one (`_committed_outcome`)."""
        self.level_dtype = self.ws.storage_name  # how the codecs type its chunks (a kv8 set's rows: "kv8")
        self._bg = (ThreadPoolExecutor(1, thread_name_prefix="writeback", initializer=single_threaded_torch)
                    if background else None)
        self._pending: Future | None = None
        self._pending_ctx: str | None = None  # the context of the last write-back scheduled
        self._encoded = threading.Event()  # set once that write-back no longer reads the working set
        self._encoded.set()
        self._pending_views = False  # that write-back reads views of its chunks taken at the commit
        self.overlap_admit = overlap_admit and background
        self.prefill_budget = prefill_budget
        self._shape = prefill_shape(self.model, engine.cfg.kv_format) if prefill_budget else None
        self._lock = PriorityLock()
        """Real calls in turn; the query predictor's work only when none waits, and it yields at once."""

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
                history: list[tuple[str, str]] | None = None, adapter: str | None = None) -> str:
        """Create a context; `history` seeds it with earlier (role, text) turns, `user` or `assistant`:
        their ids are prefilled with the next call. `adapter`: the name of a loaded LoRA adapter the
        context is computed under, for its life ("" for the base model; None: the app's default)."""
        tok = self.engine.tok
        turns, ids = self._seed(system_prompt, history)
        state = {"system_prompt": system_prompt, "turns": [{"role": t.role, "text": t.text} for t in turns] if history else [],
                 "kv_tokens": 0, "overflows": 0}
        if adapter is None:
            adapter = self.gov.app_adapter(app)
        with self._adapters_lock:
            key = self.adapters.get(adapter).key if adapter else ""
            return self.gov.new_ctx(app, system_prompt or "", np.asarray(ids, dtype=np.int64), tok.decode(ids),
                                    json.dumps(state), adapter=key)

    # ---- adapters (engine.lora): loaded here, recorded at the governor, restored at start --------------
    def add_adapter(self, name: str, path: str) -> dict:
        """Load the adapter at `path` (under the adapter root) as `name` and record it, so the node
        loads it again at start; refused with nothing changed when it does not load."""
        with self._adapters_lock:
            a = self.adapters.add(name, path)
            try:
                self.gov.add_adapter(name, a.path, a.key)
            except BaseException:
                self.adapters.remove(name)
                raise
        return adapter_info(a)

    def remove_adapter(self, name: str) -> None:
        """Forget an adapter (refused at the governor while a context is computed under it)."""
        with self._adapters_lock:
            self.gov.remove_adapter(name)
            if name in self.adapters:
                self.adapters.remove(name)
            try:  # a restorer with adapters of its own (the recompute worker on Ray) drops its copy
                self.restorer.forget_adapter(name)
            except Exception:  # noqa: BLE001 - the removal stands; the copy goes with the worker's restart
                logging.getLogger(__name__).exception("the restorer kept adapter %r", name)

    def list_adapters(self) -> list[dict]:
        with self._adapters_lock:
            return [adapter_info(self.adapters.get(n)) for n in self.adapters.names()]

    def load_recorded_adapters(self) -> list[str]:
        """Load the adapters the governor records (at start); returns the names that failed to load
        (logged: their contexts answer `adapter_unavailable` until the files are back)."""
        failed = []
        for row in self.gov.adapters():
            try:
                self.adapters.resolve(row.name, row.path, row.key)
            except AdapterError as e:
                failed.append(row.name)
                logging.getLogger(__name__).warning("adapter %r not loaded at start: %s", row.name, e)
        return failed

    def _seed(self, system_prompt: str | None, history) -> tuple[list[Turn], list[int]]:
        """The turns and token ids of a conversation's start (system prompt, earlier turns)."""
        from engine.context import PromptTooLongError

        tok = self.engine.tok
        turns = [Turn("system", system_prompt)] if system_prompt is not None else []
        for role, text in history or []:
            if role not in ("user", "assistant") or not isinstance(text, str):
                raise BadRequestError("history turns are (user|assistant, text)")
            turns.append(Turn(role, text, tok.encode(text) if role == "assistant" else None))
        ids = tok.conversation_ids(Conversation(turns)) if history else tok.system_ids(system_prompt)
        if len(ids) > self.engine.tail_room():
            raise PromptTooLongError(f"the conversation of {len(ids)} tokens does not fit the context limit "
                                     f"of {self.engine.limit} tokens")
        return turns, list(ids)

    def call_stateless(self, system_prompt: str | None, history, prompt: str, deadline: float | None = None,
                       adapter: str | None = None, **params):
        """A call on no context (an OpenAI-style call without `context_id`): the conversation so far is
        prefilled into the working set and answered; nothing is stored, locked or counted against the
        app's contexts. Generator of text deltas; returns a `CallOutcome`."""
        with self._lock.real():
            check_deadline(deadline, "the call waited past its deadline before it started")
            t0 = time.perf_counter()
            self.flush()
            self._last = None  # the working set is taken: the next call restores its context
            turns, ids = self._seed(system_prompt, history)
            self.ws.truncate(0)
            self.ws.missing = set()
            ectx = LiveContext(id="", system_prompt=system_prompt, token_ids=ids, conv=Conversation(turns),
                               cache=self.ws, density=DensityTracker(self.model.cfg.n_heads, self.model.cfg.n_layers),
                               adapter=self.adapters.get(adapter) if adapter else None)
            prefill, engine_params = self._admit(ectx, prompt, params)
            written = self._written()
            stream = self.engine.stream(ectx, prompt, **engine_params)
            for delta in stream:
                check_deadline(deadline, "the call ran past its deadline")
                yield delta
            r = stream.result
        return CallOutcome(
            text=r.text, token_ids=r.token_ids, finish_reason=r.finish_reason, prompt_tokens=r.prompt_tokens,
            completion_tokens=r.completion_tokens, switch_ms=0.0, restore=RestoreStats(), predicted_restore_ms=0.0,
            model_restore_ms=0.0, ttft_s=r.ttft_s, total_s=time.perf_counter() - t0,
            prefilled_tokens=r.prefilled_tokens, cached_tokens=r.cached_tokens, context_tokens=r.context_tokens,
            dropped_tokens=r.dropped_tokens, prefill_plan=prefill, streamed_bytes=self._written() - written)

    def stream_stateless(self, system_prompt: str | None, history, prompt: str, params: dict):
        """`call_stateless` as the port has it: text deltas, then the `CallOutcome` as the last item."""
        outcome = yield from self.call_stateless(system_prompt, history, prompt, **params)
        yield outcome

    def rag_call(self, call: RagCall) -> RagOutcome:
        """`rag_stream` run to its end: its outcome."""
        *_, outcome = self.rag_stream(call)
        return outcome

    def rag_stream(self, call: RagCall):
        """A RAG prompt (`actors.rag.stream_rag_call`) in the working set, which it takes as a call on no
        context does (the next call restores its context); its nodes go through the IO worker. Text
        deltas, then the `RagOutcome` as the last item. A `call.background` one yields to any real call
        (`PreemptedError`) before it starts and at each layer or token."""
        from actors.rag import stream_rag_call

        with self._lock.background() if call.background else self._lock.real():
            check_deadline(call.deadline, "the RAG call waited past its deadline before it started")
            self.flush()
            self._last = None
            yield from stream_rag_call(self.engine, self.io, call, self.adapters.by_key(call.adapter), cache=self.ws,
                                       should_stop=self._lock.should_yield if call.background else None)

    def activity(self) -> tuple[float, int]:
        """`ExecutorPort.activity`: when the last real call began or ended, and how many run or wait."""
        return self._lock.last_call, self._lock.in_flight

    def flush(self) -> None:
        """Wait for the last call's write-back. Its failure is the service's business, not the next
        call's: the turn was committed before the reply, and chunks that were not written come back by
        recompute from the token ids; it is logged."""
        if self._pending is not None:
            pending, self._pending, self._pending_ctx = self._pending, None, None
            try:
                pending.result()
            except Exception:  # noqa: BLE001 - logged with its traceback; nothing committed is lost
                logging.getLogger(__name__).exception("the write-back after a committed call failed; its "
                                                      "chunks will be recomputed from the token ids")

    def forget(self, ctx: str) -> None:
        """`ctx` is being deleted: its write-back must end first, and the working set lets it go."""
        self.flush()
        if self.ws_ctx == ctx:
            self.ws_ctx = None

    def ready(self) -> None:
        """In one process the executor is always ready (`ExecutorPort.ready`)."""

    def stream(self, app: str | None, ctx: str, prompt: str, params: dict):
        """`call` as the port has it: text deltas, then the `CallOutcome` as the last item."""
        outcome = yield from self.call(app, ctx, prompt, **params)
        yield outcome

    # ---- a call -----------------------------------------------------------------------------------
    def call(self, app: str | None, ctx_id: str, prompt: str, deadline: float | None = None,
             request_id: str | None = None, **params):
        """Generator of text deltas; returns a `CallOutcome` (StopIteration.value). `deadline`
        (`time.time()` seconds): past it the call stops, rolls back and raises `CallTimeoutError`.
        `request_id`: a call retried with the id of one already committed runs nothing and returns
        the committed turn (a retry after the executor stopped between the commit and the reply)."""
        with self._lock.real():
            check_deadline(deadline, "the call waited past its deadline before it started")
            t0 = time.perf_counter()
            behind, reading = self._await_write_back(ctx_id, app)  # inside switch_ms
            step = self._lock_and_plan(app, ctx_id, behind)
            if reading:  # the plan was asked for meanwhile; the restore and the model write the working set
                self._encoded.wait()
            try:
                replay = self._committed_outcome(step, request_id)
                if replay is not None:
                    self.gov.abort_call(ctx_id)
                    return replay
                stats = self._restore_step(step)
                switch_ms = (time.perf_counter() - t0) * 1000
                if not step.cached:  # the measurement goes to the governor's cost models, outside the switch
                    self.gov.record_restore(ctx_id, stats.seconds, stage_seconds(stats.timeline))
                t_engine, written = time.perf_counter(), self._written()
                ectx, first_modified, r, prefill = yield from self._run_engine(step, prompt, deadline, params)
                if step.confirm is not None:
                    step.confirm()  # the deferred begin_call's errors surface here, before anything is committed
                    step.confirm = None
                reply, state_json = self._commit(step.plan, ectx, first_modified, list(step.plan.recompute),
                                                 request_id, r, unreadable=sorted(stats.failed))
                todo = reply.todo
            except BaseException:
                self._abort(step)
                raise
            self._last = (ctx_id, app, ectx, state_json)
            # read whole and unchanged by the call: resident as read, not encoded again
            loaded = [c for c in step.loaded if c[0] < first_modified and c[0] not in todo]
            through = step.plan.adapter if reply.write_through else None
            if streamed_from(self.ws) is not None:  # the pool is no place for a context this large
                loaded = []
                trim_heap()  # the prefill's freed transients leave the process before the write-back
            self._schedule_write_back(ctx_id, todo, loaded, through=through)
        return CallOutcome(
            text=r.text, token_ids=r.token_ids, finish_reason=r.finish_reason, prompt_tokens=r.prompt_tokens,
            completion_tokens=r.completion_tokens, switch_ms=switch_ms, restore=stats,
            predicted_restore_ms=step.plan.predicted_s * 1000 if not step.cached else 0.0,
            model_restore_ms=step.plan.model_predicted_s * 1000 if not step.cached else 0.0,
            ttft_s=t_engine - t0 + r.ttft_s,  # from the call's arrival: the switch is inside
            total_s=time.perf_counter() - t0, prefilled_tokens=r.prefilled_tokens,
            cached_tokens=r.cached_tokens, hit=step.cached, context_tokens=r.context_tokens,
            dropped_tokens=r.dropped_tokens, prefill_plan=prefill, streamed_bytes=self._written() - written)

    # ---- the call's steps ---------------------------------------------------------------------------
    def _lock_and_plan(self, app: str | None, ctx_id: str, behind: bool = False) -> "_Step":
        """Lock the context at the governor and get its plan. When the working set holds this context
        from the same app's last call there is nothing to restore, and the governor's answer may come
        while the call runs (`begin_cached_call`): it is checked before the commit. `behind`: this
        context's last write-back is still admitting (`_await_write_back`), so it still holds the
        lock: the lock is asked for once that write-back is done, before the commit."""
        held = self._held(ctx_id, app)
        if held is not None:
            if behind:
                def confirm() -> None:
                    self.flush()
                    self.gov.begin_cached_call(ctx_id, app)()
            else:
                confirm = self.gov.begin_cached_call(ctx_id, app)
            plan = CallPlan(ctx=ctx_id, token_ids=np.zeros(0, np.int32), state=None, density=b"",
                            kv_tokens=self.ws.length, resident=[], load=[], recompute=[])
            return _Step(plan, True, held, confirm)
        if behind:  # not a call the working set answers: wait for the lock as before
            self.flush()
        cached = self.ws_ctx == ctx_id and not self.ws.missing
        return _Step(self.gov.begin_call(ctx_id, app, cached=cached), cached, None, None)

    def _held(self, ctx: str, app: str | None) -> LiveContext | None:
        """The engine context of `ctx` when the working set holds it whole from this app's last call."""
        if self._last is not None and self._last[:2] == (ctx, app) and not self.ws.missing:
            return self._last[2]
        return None

    def _committed_outcome(self, step: "_Step", request_id: str | None) -> CallOutcome | None:
        """The outcome of the call `request_id` names when the context's last commit was that call."""
        if request_id is None:
            return None
        # a call the working set answers (`ectx`): the state its last call committed (`_held`)
        state_json = step.plan.state if step.ectx is None else self._last[3]
        if not state_json or json.dumps(request_id) not in state_json:  # the usual case, without parsing
            return None
        state = json.loads(state_json)
        done = state.get("request") or {}
        if done.get("id") != request_id:
            return None
        if step.confirm is not None:  # the governor's lock, before anything is answered
            step.confirm()
            step.confirm = None
        text = state["turns"][-1]["text"] if state.get("turns") else ""
        return CallOutcome(text=text, token_ids=list(done.get("token_ids", [])),
                           finish_reason=done.get("finish_reason", "stop"),
                           prompt_tokens=done.get("prompt_tokens", 0), completion_tokens=done.get("completion_tokens", 0),
                           switch_ms=0.0, restore=RestoreStats(), predicted_restore_ms=0.0, model_restore_ms=0.0,
                           ttft_s=0.0, total_s=0.0, prefilled_tokens=0, cached_tokens=0, hit=True,
                           context_tokens=done.get("context_tokens", 0), dropped_tokens=done.get("dropped_tokens", 0))

    def _restore_step(self, step: "_Step") -> RestoreStats:
        """Make the context's K/V attendable (nothing to do on a hit); the restore's own wall time is
        in `RestoreStats.seconds`."""
        if step.cached:
            return RestoreStats()
        tr = time.perf_counter()
        stats, step.loaded = self._restore(step.plan)
        stats.seconds = time.perf_counter() - tr
        return stats

    def _admit(self, ectx: LiveContext, prompt: str, params: dict) -> tuple[str, dict]:
        """The prefill's plan under the budget ("" without one) and the engine's call parameters (the
        plan's row partitions); `PromptTooLongError` with the estimate when it does not fit."""
        if not self.prefill_budget:
            return "", params
        plan = admit_prefill(self._shape, self.engine.new_tokens(ectx, prompt), ectx.cache.length,
                             self.prefill_budget, streaming=ectx.cache.pager is not None)
        return plan.kind, dict(params, **apply_plan(ectx.cache, plan))

    def _written(self) -> int:
        """K/V bytes the working set has streamed out so far (`engine.kvspill.LayerPager.written_bytes`)."""
        return self.ws.pager.written_bytes if self.ws.pager is not None else 0

    def _run_engine(self, step: "_Step", prompt: str, deadline: float | None, params: dict):
        """Prefill and decode against the restored context (a generator of deltas); returns the engine
        context, the first chunk the call changed, the engine's result and the prefill's plan."""
        ectx = step.ectx if step.ectx is not None else self._engine_context(step.plan)
        old_kv, old_overflows = ectx.cache.length, ectx.overflows
        prefill, engine_params = self._admit(ectx, prompt, params)
        stream = self.engine.stream(ectx, prompt, **engine_params)
        for delta in stream:
            check_deadline(deadline, "the call ran past its deadline; its turn was rolled back")
            yield delta
        if ectx.cache is not self.ws:  # an overflow re-prefilled into a new cache: take it over
            self._encoded.wait()  # the last write-back may still read the slots about to be overwritten
            n = ectx.cache.length
            self.ws.truncate(0)
            self.ws.reserve(n)
            self.ws.kv[:, :, :, :n].copy_(ectx.cache.kv[:, :, :, :n])
            ectx.cache = self.ws
        first_modified = 0 if ectx.overflows != old_overflows else old_kv // self.chunk
        return ectx, first_modified, stream.result, prefill

    def _abort(self, step: "_Step") -> None:
        """A call failed: the working set may hold half of it (restore next time); unlock the context."""
        self._last = None
        if step.confirm is not None:
            with contextlib.suppress(Exception):
                step.confirm()
        self.gov.abort_call(step.plan.ctx)

    def _schedule_write_back(self, ctx: str, todo: dict[int, str], loaded: list | None = None,
                             through: str | None = None) -> None:
        """Encode and admit the call's chunks after the reply (on the write-back thread when there is
        one); `through`: written to disk by the executor under that adapter key (`_write_through`)."""
        encoded = threading.Event()
        # on the CPU, views of the chunks' slots as they are now: the next call on this context only
        # writes past them (`_await_write_back`); elsewhere the write-back copies them itself
        arrays = {i: self.ws.chunk_array(i) for i in todo} if self.ws.device.type == "cpu" else None
        job = lambda: self._write_back(ctx, todo, encoded, loaded or [], arrays, through)  # noqa: E731
        if self._bg is not None:
            self._pending, self._pending_ctx, self._encoded = self._bg.submit(job), ctx, encoded
            self._pending_views = arrays is not None
        else:
            job()

    def _await_write_back(self, ctx: str, app: str | None) -> tuple[bool, bool]:
        """Before a call: unless `overlap_admit`, the last write-back must be done altogether (waited
        for here); else it must be done with the working set before the call writes there. Returns
        whether it may still be admitting chunks of `ctx` (whose lock its `admit` releases:
        `_lock_and_plan` waits for it where it must), and whether the call must wait for its
        encoding (`_encoded`) before writing the working set: not when the working set holds `ctx`
        and the write-back reads views taken at its commit, since the call only appends past them."""
        if self.overlap_admit and self._pending is not None:
            same = self._pending_ctx == ctx
            return same, not (same and self._held(ctx, app) is not None and self._pending_views)
        self.flush()
        return False, False

    def _restore(self, plan: CallPlan) -> tuple[RestoreStats, list]:
        self.adapters.by_key(plan.adapter)  # `adapter_unavailable` before the working set is touched
        ws = self.ws
        self.ws_ctx = None
        if ws.pager is not None and self.prefill_budget:  # a context larger than the budget: the
            # restore writes the layers it cannot keep out of memory as it fills them
            ws.pager.set_resident(restore_layers(self._shape, plan.kv_tokens, self.prefill_budget))
        ws.truncate(0)
        ws.reserve(plan.kv_tokens)
        ws.missing = set(range(ws.n_chunks))
        stats, loaded = self.restorer.restore(ws, plan)
        if ws.missing:
            raise RuntimeError(f"restore left chunks {sorted(ws.missing)} missing")
        return stats, loaded

    def _engine_context(self, plan: CallPlan) -> LiveContext:
        state = json.loads(plan.state) if plan.state else {"system_prompt": None, "turns": [], "overflows": 0}
        conv = Conversation([Turn(t["role"], t["text"]) for t in state["turns"]])
        if state.get("system_prompt") is not None and not conv.turns:
            conv.turns.append(Turn("system", state["system_prompt"]))
        tr = DensityTracker(self.model.cfg.n_heads, self.model.cfg.n_layers)
        density_from_blob(plan.density, tr)
        return LiveContext(
            id=plan.ctx,
            system_prompt=state.get("system_prompt"),
            token_ids=[int(t) for t in plan.token_ids],
            conv=conv,
            cache=self.ws,
            density=tr,
            overflows=state.get("overflows", 0),
            adapter=self.adapters.by_key(plan.adapter),
        )

    def _commit(self, plan: CallPlan, ectx: LiveContext, first_modified: int, restored: list[int],
                request_id: str | None, r, unreadable: list[int] = ()) -> tuple[CommitReply, str]:
        """Make the turn durable at the governor (once per `request_id`); returns its reply (the chunks
        to encode) and the state JSON saved."""
        state = {
            "system_prompt": ectx.system_prompt,
            "turns": [{"role": t.role, "text": t.text} for t in ectx.conv.turns],
            "kv_tokens": ectx.cache.length,
            "overflows": ectx.overflows,
        }
        if request_id is not None:  # what a retry of this call is answered with
            state["request"] = {"id": request_id, "finish_reason": r.finish_reason, "token_ids": list(r.token_ids),
                                "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                                "context_tokens": r.context_tokens, "dropped_tokens": r.dropped_tokens}
        text = self.engine.tok.decode(ectx.token_ids)
        state_json, density = json.dumps(state), density_blob(ectx.density)
        reply = self.gov.commit_call(plan.ctx, ectx.token_ids, text, state_json, density, ectx.cache.length,
                                     ectx.density.chunk_density(self.chunk), first_modified, restored,
                                     request_id=request_id, unreadable=list(unreadable),
                                     streamed_from=streamed_from(self.ws))
        if reply.repeated:  # not expected (`_committed_outcome` answered such a call before it ran)
            raise RuntimeError(f"call {request_id} on {plan.ctx} was committed twice")
        return reply, state_json

    def _write_back(self, ctx: str, todo: dict[int, str], done_reading: threading.Event | None = None,
                    loaded: list | None = None, arrays: dict | None = None, through: str | None = None) -> None:
        """Encode the chunks the governor asked for and admit them to the pool (after the reply), with
        the `loaded` chunks the restore read whole (index, encoded chunk, bytes). The chunks are encoded
        straight from the working set (`arrays`: views of their slots taken at the commit): the next
        call waits for that part (`done_reading`, `_await_write_back`) before it writes there.
        `through` (an adapter key): written to disk here instead (`_write_through`)."""
        try:
            order = sorted(todo.items())
            if through is not None:
                try:
                    stored = self._write_through(ctx, order, arrays, through)
                finally:
                    if done_reading is not None:
                        done_reading.set()
                self.gov.admit(ctx, [], {}, stored)
                return
            try:
                encs = [codecs.encode(arrays[i] if arrays is not None else self.ws.chunk_array(i), level,
                                      dtype=self.level_dtype) for i, level in order]
            finally:
                if done_reading is not None:
                    done_reading.set()
                if self.ws.pager is not None and self.ws.pager.streaming:  # the reads faulted them in
                    self.ws.pager.unmap_streamed()
            loaded = loaded or []
            handles = self.put(encs + [enc for _i, enc, _n in loaded])
            if loaded:
                self.gov.loaded(ctx, [(i, h, n) for (i, _enc, n), h in zip(loaded, handles[len(encs):])])
            encoded = [(i, level, h, enc.nbytes) for (i, level), enc, h in zip(order, encs, handles)]
            self.gov.admit(ctx, encoded, {i: i * self.chunk for i, _ in order})
        except BaseException:
            with contextlib.suppress(Exception):  # admit unlocks even when it fails; before it, this does
                self.gov.abort_call(ctx)
            raise

    def _write_through(self, ctx: str, order: list[tuple[int, str]], arrays: dict | None,
                       adapter: str) -> list[tuple[int, str, dict]]:
        """A streamed context's chunks (index, level) encoded and written to disk by the IO worker a
        batch at a time, each batch at most one layer's K/V of the context in bytes (memory the
        prefill's plan already counted for a streamed layer): never all of them in memory, nor in the
        object store, at once. Each batch is a pack on disk, so smaller batches would make the store
        compact the context (`storage/compaction.py`; past `max_packs`). Each chunk is copied out of
        the mapped file by reads (`engine/kvspill.py:MappedFile.copy_out`), which map nothing. Returns
        (index, level, meta) each."""
        pager = self.ws.pager
        limit = pager.slab_bytes(self.ws.length)
        stored: list[tuple[int, str, dict]] = []
        batch: list[tuple[int, str, codecs.EncodedChunk]] = []
        held = 0

        def write() -> None:
            metas = self.io.write(ctx, [(i, enc, i * self.chunk) for i, _level, enc in batch], adapter)
            stored.extend((i, level, meta) for (i, level, _enc), meta in zip(batch, metas))
            batch.clear()

        for i, level in order:
            view = arrays[i] if arrays is not None else self.ws.chunk_array(i)
            enc = codecs.encode(pager.file.copy_out(view), level, dtype=self.level_dtype)
            batch.append((i, level, enc))
            held += enc.nbytes
            if held >= limit:
                write()
                held = 0
        if batch:
            write()
        return stored


def adapter_info(a: Adapter) -> dict:
    """What `GET /v1/adapters` shows of a loaded adapter."""
    return {"name": a.name, "path": a.path, "key": a.key, "rank": a.rank, "targets": list(a.targets),
            "nbytes": a.nbytes()}
