"""The memory governor: owner of the chunk table, locks, the eviction queue, the pool budget and the
compression and restore plans (docs/design.md §4, steps 2 and 5; LLMS §3.2-3.4).

It is a plain class implementing `actors.ports.GovernorPort`: `actors.service.wire_local` uses it
directly in one process, `actors.ray_actors.GovernorActor` makes it a Ray actor (requesting no CPU).
Policies come from `scheduler/` and storage from `storage/`; this class only keeps the books and asks
them. It never touches K/V data: a resident chunk is an opaque *handle* given by the executor (an
`EncodedChunk` in one process, a `PoolRef` to one under Ray), and its size in bytes as stored. Chunk
files are written by the KV swap/IO worker, which the governor is handed as `io` (a
`actors.ports.SwapIOPort`).

Writes ahead of time (`admit`) are started and not waited for: the next call's plan does not wait for
the previous call's fsyncs. A chunk whose write is in flight is waited for only when it must leave the
pool or its file is void (eviction, a new version, deletion); `reap` applies finished writes.

Invariants:
- the bytes of resident handles the governor holds never exceed the pool budget after `admit`, but
  for chunks whose writes ahead of time are in flight, which leave the pool as those writes end;
- a chunk of a locked context (one a call is using) is never evicted;
- a chunk's level only goes down; the way back up is recompute;
- a chunk with state `swapped`/`both` has a file as far as the registry knows; a file found missing
  or corrupt when read is recomputed from the token ids instead.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, Iterable

import numpy as np

from actors.books import Chunk, CtxBook, GovernorConfig, describe_context
from actors.messages import CallPlan, CommitReply
from actors.writeback import Write, WritesInFlight
from scheduler import levels as L
from scheduler.compression import CompressionPlanner
from scheduler.errors import CapacityError
from scheduler.eviction import EvictionQueue
from scheduler.pipeline import CostProfile, MissingChunk, OnlineCosts, RestoreLog, pipeline_delay, plan_restore, restore_shape
from scheduler.policies import PolicySet, get_policy
from storage.registry import Registry


class ContextBusyError(RuntimeError):
    code = "context_busy"


class MemoryGovernor:
    def __init__(
        self,
        registry: Registry,
        io,
        config: GovernorConfig | None = None,
        *,
        profile: CostProfile | None = None,
        clock: Callable[[], float] = time.monotonic,
        release: Callable[[Any], None] | None = None,
        wake: Callable[[], None] | None = None,
    ) -> None:
        """`wake` is called, from any thread, when a write ahead of time finishes: an actor calls
        `reap` then, so that the registry follows without waiting for the next call."""
        self.cfg = config or GovernorConfig()
        self.policy: PolicySet = get_policy(self.cfg.policy)
        self.registry = registry
        self.io = io
        self.clock = clock
        self.release = release or (lambda handle: None)
        self.wake = wake
        self.queue = EvictionQueue(self.policy.eviction_strategy())
        self.planner = CompressionPlanner(self.policy.compression_config(self.cfg.dtype))
        self.profile = profile or CostProfile.fit([(1, 0.01), (100, 1.0)], [(1 << 20, 0.001), (100 << 20, 0.1)])
        self.books: dict[str, CtxBook] = {}
        self.locked: set[str] = set()
        self.restores = RestoreLog(max_records=10_000)  # (predicted, measured) as planned
        self.model_restores = RestoreLog(max_records=10_000)  # (the profile alone, measured)
        self.online = OnlineCosts()
        self._pending: dict[str, tuple[str, dict[str, float], float, float, float]] = {}  # ctx -> planned restore
        self._unsaved: dict[str, set[int]] = {}  # ctx -> chunks evicted in a switch, rows not yet written
        self.writes = WritesInFlight()  # writes ahead of time started by `admit`, not yet applied
        self.working_set: tuple[str, int | None] | None = None  # (ctx, `streamed_from`) as last committed
        self.stats = {"swap_out_bytes": 0, "swap_in_bytes": 0, "evictions": 0, "recomputed_chunks": 0,
                      "fault_recomputes": 0, "killed_contexts": 0, "interrupted_calls": 0, "failed_writes": 0}
        self._rebuild()

    # ---- start-up --------------------------------------------------------------------------------
    def _rebuild(self) -> None:
        """Rebuild the books from the registry after a start or restart: nothing is resident."""
        self.registry.drop_resident()
        for app in self.registry.apps():
            for summary in self.registry.list_contexts(app):
                book = CtxBook(app, summary.adapter)
                saved = self.registry.load_state(summary.id)
                if saved is not None:
                    state = json.loads(saved[0])
                    book.kv_tokens = int(state.get("kv_tokens", 0))
                    book.request_id = (state.get("request") or {}).get("id")  # the executor writes it there
                for r in self.registry.chunks(summary.id):
                    ch = Chunk(level=r.level, density=r.density, pinned_exact=r.pinned)
                    if r.state.on_disk:
                        ch.file, ch.file_nbytes, ch.checksum = r.file, r.nbytes, r.checksum
                    book.chunks[r.index] = ch
                self.books[summary.id] = book

    def executor_started(self) -> int:
        """The model executor (re)started. A call in flight died with the old process (its context is
        still locked here, and its turn was committed only if the reply had finished), and every
        resident chunk was an object that process owned, now gone. Unlock everything and rebuild the
        books from the registry, as after this governor's own restart: chunks on disk are read again,
        the rest recomputed from their token ids. Returns the number of calls that were in flight."""
        in_flight = len(self.locked)
        for w in self.writes.all():  # what was written is on disk: keep it (writes of the dead
            self._finish(w)  # process's objects fail)
        for handle in self.held_handles():
            self.release(handle)
        self.locked.clear()
        self._pending.clear()
        self._unsaved.clear()
        self.queue = EvictionQueue(self.policy.eviction_strategy())
        self.books, self.working_set = {}, None
        self._rebuild()
        self.stats["interrupted_calls"] += in_flight
        return in_flight

    # ---- apps (the registry's, on behalf of the front) ----------------------------------------------
    def bind_app(self, app: str, adapter: str = "") -> str:
        return self.registry.create_app(app, adapter)

    def app_adapter(self, app: str) -> str:
        return self.registry.app_adapter(app)

    def app_for_token(self, token: str) -> str:
        return self.registry.app_for_token(token)

    def list_contexts(self, app: str) -> list:
        return self.registry.list_contexts(app)

    def delete_app(self, app: str) -> None:
        self.registry.delete_app(app)

    # ---- adapters: the registry's record of what the node loads (`GovernorPort` says what each does)
    def adapters(self) -> list:
        return self.registry.adapters()

    def add_adapter(self, name: str, path: str, key: str) -> None:
        self.registry.add_adapter(name, path, key)

    def remove_adapter(self, name: str) -> None:
        self.registry.remove_adapter(name)

    # ---- contexts ---------------------------------------------------------------------------------
    def new_ctx(self, app: str, system_prompt: str = "", token_ids=None, text: str = "",
                state: str | None = None, adapter: str = "") -> str:
        """Create a context computed under the LoRA adapter of key `adapter` ("" for none); with
        `state`, also save its first token ids, text and state (the executor's), in the same
        transaction: a failure (a full disk) leaves no half-made context."""
        with self.registry.transaction():
            ctx = self.registry.create_context(app, system_prompt, adapter)
            if state is not None:
                self.registry.save_state(ctx, np.asarray(token_ids, dtype=np.int64), text, state, b"")
        self.books[ctx] = CtxBook(app, adapter)
        return ctx

    def delete_ctx(self, ctx: str, app: str | None = None) -> None:
        """Delete a context: its chunk files first, then its rows and books. Deleting files needs no
        space and gives some back, while the rows' transaction needs some (SQLite's WAL), so this
        works on a full disk. Should the rows' transaction still fail (DiskFullError), the context
        stays, without files: a call on it recomputes its chunks from its token ids, and deleting it
        again works once there is room. UnknownContextError for another app's context."""
        if ctx in self.locked:
            raise ContextBusyError("context is in use by a call")
        self.registry.get_context(ctx, app)  # refused before a file is touched
        self._settle(ctx)
        self.io.delete_context(ctx)
        book = self.books.get(ctx)
        for ch in book.chunks.values() if book is not None else ():
            ch.file, ch.file_nbytes, ch.checksum = None, 0, None
        self.registry.delete_context(ctx, app)
        self.books.pop(ctx, None)
        self.working_set = None if self.working_set and self.working_set[0] == ctx else self.working_set
        self._unsaved.pop(ctx, None)
        if book is not None:
            for i, ch in book.chunks.items():
                self._drop_resident(ctx, i, ch)

    def pin_exact(self, ctx: str, indices: Iterable[int]) -> None:
        """Pin chunks of `ctx` exact: no policy lowers them below raw from now on, so K/V reused from
        them equals a fresh prefill's. A chunk already lowered loses its copies (a level only comes back
        by recompute): the next restore recomputes it from its token ids, raw."""
        if ctx in self.locked:
            raise ContextBusyError("context is in use by a call")
        book = self.books[ctx]
        indices = sorted(set(indices))
        self._settle(ctx, indices)
        for i in indices:
            if i not in book.chunks:
                raise ValueError(f"context {ctx} has no chunk {i} yet (pin after the call that computes it)")
        for i in indices:
            ch = book.chunks[i]
            if ch.level != "raw":
                self._drop_resident(ctx, i, ch)
                if ch.file:
                    self._delete_file(ctx, i)
                ch.level, ch.file, ch.file_nbytes, ch.checksum = "raw", None, 0, None
            ch.pinned_exact = True
        self._persist_rows(ctx, book, indices)

    def describe(self, ctx: str, app: str | None = None) -> dict:
        """A context's metadata: length, conversation turns, chunks by state and level
        (the HTTP API's `GET /v1/contexts/{id}`). UnknownContextError for another app's context."""
        row = self.registry.get_context(ctx, app)
        saved = self.registry.load_state(ctx)
        book = self.books.get(ctx) or CtxBook(row.app, row.adapter)
        ws = self.working_set[1:] if self.working_set and self.working_set[0] == ctx else None
        return describe_context(row, json.loads(saved[0]) if saved else {}, book, self.cfg.chunk_tokens,
                                busy=ctx in self.locked, working_set=ws)

    # ---- a call -----------------------------------------------------------------------------------
    def begin_call(self, ctx: str, app: str | None = None, cached: bool = False) -> CallPlan:
        """Lock `ctx` and plan its restore (making room in the pool for what will be loaded).
        `cached`: the executor's working set still holds this context whole, nothing to restore."""
        row = self.registry.get_context(ctx, app)  # UnknownContextError for another app's context
        if ctx in self.locked:
            raise ContextBusyError("context is in use by another call")
        book = self.books[ctx]
        self.locked.add(ctx)
        self.queue.lock(ctx)
        if not cached:  # the working set is about to hold this context instead, from its commit on
            self.working_set = None
        try:
            return self._plan(ctx, book, row, cached)
        except BaseException:
            self.abort_call(ctx)
            raise

    def begin_cached_call(self, ctx: str, app: str | None) -> Callable[[], None]:
        """`begin_call(ctx, app, cached=True)`, done now: in one process there is nothing to overlap."""
        self.begin_call(ctx, app, cached=True)
        return lambda: None

    def _plan(self, ctx: str, book: CtxBook, row, cached: bool) -> CallPlan:
        """`row`: the context's registry row."""
        saved = self.registry.load_state(ctx)
        n_chunks = 0 if cached else -(-book.kv_tokens // self.cfg.chunk_tokens)
        resident, missing, forced = [], [], []
        for i in range(n_chunks):
            ch = book.chunks.get(i)
            if ch is not None and ch.handle is not None:
                resident.append((i, ch.level, ch.handle))
                self.queue.touch((ctx, i), ch.level, ch.nbytes, self.clock())
            elif ch is not None and ch.file is not None:
                missing.append(MissingChunk(i, ch.level, ch.file_nbytes))
            else:
                missing.append(MissingChunk(i, ch.level if ch else "raw", 0))
                forced.append(i)
                if ch is not None and self.policy.on_pressure != "kill":
                    self.stats["fault_recomputes"] += 1
        prof = self.online.profile(self.profile)
        plan = plan_restore(missing, prof, must_recompute=forced, allow_recompute=self.policy.recompute,
                            groups=self.cfg.pipeline_groups)
        # loaded chunks become resident: make room now (on-demand writes happen here, in the switch)
        need = sum(book.chunks[i].file_nbytes for i in plan.load)
        evicted, wrote = self._make_room(need, defer=True)
        self.stats["swap_in_bytes"] += plan.load_bytes
        self.stats["recomputed_chunks"] += len(plan.recompute)
        # the pipeline (Eq. 4') plus de-quantizing the resident chunks, decoded before it starts
        t_res = prof.decode(level for _, level, _ in resident)
        stages = {"io": plan.t_io, "decode": plan.t_decode + t_res, "recompute": plan.t_recompute}
        shape = restore_shape(len(resident), len(plan.load), len(plan.recompute))
        corrected = plan.predicted + t_res
        f = {s: self.online.factor(s) for s in stages}
        model = (float(pipeline_delay(plan.t_io / f["io"], plan.t_recompute / f["recompute"]
                                      + plan.t_decode / f["decode"], plan.groups)) + t_res / f["decode"])
        predicted = self.online.predict(shape, corrected)
        if shape:
            self._pending[ctx] = (shape, stages, corrected, model, predicted)
        return CallPlan(
            ctx=ctx,
            adapter=row.adapter,
            token_ids=np.array(row.token_ids, dtype=np.int32),
            state=saved[0] if saved else None,
            density=saved[1] if saved else b"",
            kv_tokens=book.kv_tokens,
            resident=resident,
            load=[(i, book.chunks[i].level, book.chunks[i].file) for i in plan.load],
            recompute=list(plan.recompute),
            predicted_s=predicted,
            model_predicted_s=model,
            evicted_for_restore=evicted,
            wrote_on_demand=wrote,
        )

    def set_profile(self, profile_json: str) -> None:
        """Replace the pipeline cost profile (measured by the executor at start); the online
        corrections were relative to the old one and start over."""
        self.profile = CostProfile.from_json(profile_json)
        self.online = OnlineCosts()

    def restore_error(self) -> float | None:
        """Median |ln(measured / predicted)| over the recorded restores."""
        return self.restores.median_abs_log_error()

    def record_restore(self, ctx: str, measured_s: float, stages: dict[str, float] | None = None) -> None:
        """The executor's measurement of the restore `begin_call(ctx)` planned: its wall time and,
        when known, the seconds of each stage (scheduler.pipeline.STAGES). Feeds the error logs and
        the online correction of the cost models."""
        pending = self._pending.pop(ctx, None)
        if pending is None or not measured_s > 0:
            return
        shape, predicted_stages, corrected, model, predicted = pending
        if predicted > 0:
            self.restores.record(predicted, measured_s)
        if model > 0:
            self.model_restores.record(model, measured_s)
        self.online.observe(shape, predicted_stages, stages or {}, corrected, measured_s)

    def loaded(self, ctx: str, chunks: list[tuple[int, Any, int]]) -> None:
        """Chunks read from disk during a restore become resident, as far as the budget allows (room
        was made in `begin_call`; what still does not fit stays on disk only): (index, handle, nbytes)."""
        book = self.books[ctx]
        for i, handle, nbytes in chunks:
            if self.pool_used + nbytes > self.cfg.pool_bytes:
                self.release(handle)
                continue
            ch = book.chunks[i]
            self._set_resident(ctx, i, ch, handle, nbytes)

    def commit_call(self, ctx: str, token_ids, text: str, state: str, density: bytes, kv_tokens: int,
                    chunk_density: np.ndarray, first_modified: int, restored: list[int] | None = None,
                    request_id: str | None = None, unreadable: list[int] | None = None,
                    streamed_from: int | None = None) -> CommitReply:
        """Make the call's new token ids durable (before the reply completes) and plan compression.

        `first_modified` is the first chunk whose K/V the call changed (the old partial chunk, or 0
        after an overflow). The reply lists {chunk index: level} for every chunk the executor must
        encode now (the modified ones, those whose planned level dropped, and recomputed ones,
        `restored`).

        `unreadable`: chunks whose file the restore could not use (missing, corrupt, written under
        another `KVKey`, e.g. another weight format) and recomputed: their files are void like those
        of changed chunks, so they are encoded and written again under this service's key.

        `request_id` makes the commit idempotent: when the context's last commit carried the same id
        (a call retried after its executor stopped between the commit and the reply), nothing is
        saved and the reply says `repeated`. The id is kept in the saved state too (the executor
        writes it there), so a governor rebuilt from the registry knows it.

        `streamed_from`: the first layer the executor's working set streams (the context is larger than
        its memory budget; None: every layer in memory); `describe` shows it. None of its chunks then
        enters the pool: under a swap policy the reply says `write_through` (the executor writes them to
        disk itself, a batch at a time: `admit`'s `stored`); under the kill policy the context is killed
        at once and the reply asks for nothing."""
        book = self.books[ctx]
        if request_id is not None and request_id == book.request_id:
            return CommitReply({}, repeated=True)
        self.registry.save_state(ctx, np.asarray(token_ids, dtype=np.int64), text, state, density)
        book.request_id = request_id
        n_chunks = -(-kv_tokens // self.cfg.chunk_tokens)
        void_files = set(unreadable or ())
        stale = [i for i in book.chunks if i >= first_modified or i >= n_chunks or i in void_files]
        self._settle(ctx, stale)
        void = []
        for i in stale:  # their content changed: old resident copies and files are void
            ch = book.chunks.pop(i)
            self._drop_resident(ctx, i, ch)
            if ch.file:
                void.append(i)
        book.kv_tokens = kv_tokens
        for i in void:  # after the books: a failed delete leaves a stale record, never stale books
            self._delete_file(ctx, i)
        if streamed_from is not None and self.policy.on_pressure == "kill":  # killed now: nothing to plan
            self.working_set = (ctx, streamed_from)
            self.stats["killed_contexts"] += 1
            self._evict(ctx, list(book.chunks))
            return CommitReply({})
        partial = kv_tokens % self.cfg.chunk_tokens != 0
        current = [book.chunks[i].level if i in book.chunks else None for i in range(n_chunks)]
        pinned = [i for i in range(n_chunks) if i in book.chunks and book.chunks[i].pinned_exact]
        plan = self.planner.plan(chunk_density[:n_chunks], current, partial_last=partial, pinned=pinned,
                                 room=self.room())
        todo = {}
        for i in range(n_chunks):
            ch = book.chunks.get(i)
            if ch is None or i in (restored or ()) and ch.handle is None or plan.levels[i] != ch.level:
                todo[i] = plan.levels[i]
            if ch is not None:
                ch.density = float(chunk_density[i])
        self.working_set = (ctx, streamed_from)
        through = streamed_from is not None and self.policy.on_pressure == "swap"
        if through:  # a write ahead of time of an older copy must not land after the executor's
            self._settle(ctx, list(todo))
        return CommitReply(todo, write_through=through)

    def room(self) -> float | None:
        """The mean compression ratio the pool allows now (None when `raw_chunk_bytes` is unknown): the
        pool against the raw bytes of every context with K/V, times raw's ratio (4 for float32). At or
        above raw's ratio there is no pressure; the planner never goes below the policy's ratio. Every
        context, not only those in the pool now: counting those alone made the measure swing as they
        left and came back, so chunks were kept heavy, written heavy and lowered later (the replay of
        docs/benchmarks.md loaded 448 MB against 289 MB)."""
        n = sum(-(-b.kv_tokens // self.cfg.chunk_tokens) for b in self.books.values())
        if self.cfg.raw_chunk_bytes <= 0 or n == 0:
            return None
        return L.ratio("raw", self.cfg.dtype) * self.cfg.pool_bytes / (n * self.cfg.raw_chunk_bytes)

    def admit(self, ctx: str, encoded: list[tuple[int, str, Any, int]], token_starts: dict[int, int],
              stored: list[tuple[int, str, dict]] | None = None) -> None:
        """Take the call's newly encoded chunks into the pool: (index, level, handle, nbytes). Evicts
        to stay within budget, writes ahead of time when the policy says so, then unlocks `ctx`.
        `stored`: chunks the executor wrote to disk itself (`CommitReply.write_through`): (index,
        level, the IO worker's meta), on disk only; each write replaced the chunk's older record."""
        book = self.books[ctx]
        try:
            self.reap()
            self._settle(ctx, [i for i, *_ in encoded])
            for i, level, meta in stored or ():
                ch = book.chunks.setdefault(i, Chunk(level=level))
                self._drop_resident(ctx, i, ch)
                ch.level = level
                self.stats["swap_out_bytes"] += ch.written(meta)
            for i, level, handle, nbytes in encoded:
                ch = book.chunks.get(i)
                if ch is None:
                    ch = book.chunks[i] = Chunk(level=level)
                elif ch.file and ch.level != level:  # re-quantized: the old file no longer matches
                    ch.file, ch.file_nbytes, ch.checksum = None, 0, None
                    self._delete_file(ctx, i)
                self._drop_resident(ctx, i, ch)
                ch.level = level
                self._set_resident(ctx, i, ch, handle, nbytes)
            if self.policy.on_pressure == "swap" and self.policy.aot_swap_out:
                todo = [(i, book.chunks[i].handle, token_starts[i]) for i, *_ in encoded if book.chunks[i].file is None]
                if todo:  # started, not waited for: the next call's plan need not wait for its fsyncs
                    w = self.writes.start(ctx, todo, self.io.write_async(ctx, todo, book.adapter))
                    if self.wake is not None:
                        w.pending.add_done_callback(lambda _f: self.wake())
            self._persist_rows(ctx, book)
        finally:
            self.abort_call(ctx)  # unlock; a governor restarted since begin_call holds no lock
        self._make_room(0, wait=False)  # what is being written leaves when written (`reap`)
        self._save_evicted()

    def abort_call(self, ctx: str) -> None:
        self._pending.pop(ctx, None)
        if ctx in self.locked:
            self.queue.unlock(ctx)
            self.locked.discard(ctx)

    # ---- pool ---------------------------------------------------------------------------------------
    @property
    def pool_used(self) -> int:
        return self.queue.resident_bytes

    def held_nbytes(self) -> int:
        """Bytes of resident chunks in the pool (`pool_used`, as a port method)."""
        return self.pool_used

    def held_handles(self) -> list[Any]:
        return [ch.handle for b in self.books.values() for ch in b.chunks.values() if ch.handle is not None]

    def replace_handles(self, new: Callable[[Any], Any]) -> None:
        """Resident chunks whose content moved (the transport re-packed it): `new(handle)` gives a
        chunk's new handle, or None where it did not move."""
        for book in self.books.values():
            for ch in book.chunks.values():
                if ch.handle is not None and (h := new(ch.handle)) is not None:
                    ch.handle = h

    def _set_resident(self, ctx: str, i: int, ch: Chunk, handle: Any, nbytes: int) -> None:
        ch.handle, ch.nbytes = handle, int(nbytes)
        self.queue.touch((ctx, i), ch.level, ch.nbytes, self.clock())

    def _drop_resident(self, ctx: str, i: int, ch: Chunk) -> None:
        if ch.handle is not None:
            if (ctx, i) in self.queue:
                self.queue.remove((ctx, i))
            self.release(ch.handle)
            ch.handle, ch.nbytes = None, 0

    def _make_room(self, need: int, defer: bool = False, wait: bool = True) -> tuple[int, int]:
        """Evict until `need` more bytes fit the budget. Returns (chunks evicted, chunks written).
        Chunks whose writes ahead of time are in flight go last: `wait` says whether to wait for
        them when the others do not free enough (a restore's room must be there), or to leave the
        pool over budget by them until their writes end (`reap` evicts them then).

        `defer` (inside a switch): the rows of chunks evicted without writing a file are written by
        the call's `admit`, after the reply, not here. Such an eviction turns `both` into `swapped`
        (or drops a killed chunk), which is also what a restart makes of the old rows
        (`Registry.drop_resident`), so a crash in between loses nothing; it takes the SQLite
        transaction (2-9 ms on the test VM, most of `begin_call`) out of `switch_ms`."""
        over = self.pool_used + need - self.cfg.pool_bytes
        if over <= 0:
            return 0, 0
        writing = (lambda key: key in self.writes) if len(self.writes) else None
        victims = self._pop_victims(over, writing)
        if wait and writing is not None:
            freed = sum(self.books[c].chunks[i].nbytes for c, i in victims)
            if freed < over:
                victims += self._pop_victims(over - freed)
        by_ctx: dict[str, list[int]] = {}
        for c, i in victims:
            by_ctx.setdefault(c, []).append(i)
        wrote = 0
        for n, (c, idxs) in enumerate(by_ctx.items()):
            book = self.books[c]
            todo = []
            if self.policy.on_pressure == "swap":
                try:
                    self._settle(c, idxs, defer=defer)  # victims written ahead of time: their writes must be done
                    todo = [(i, book.chunks[i].handle, i * self.cfg.chunk_tokens) for i in idxs
                            if book.chunks[i].file is None]
                    self._write(c, todo)  # on demand: inside this switch
                except BaseException:  # not evicted after all (a full disk, say): back in the queue
                    for c2, idxs2 in list(by_ctx.items())[n:]:
                        for i in idxs2:
                            ch = self.books[c2].chunks[i]
                            self.queue.touch((c2, i), ch.level, ch.nbytes, self.clock())
                    raise
                wrote += len(todo)
            else:
                self.stats["killed_contexts"] += 1
            self._evict(c, idxs)
            # only the evicted rows changed; without a new file, nothing a restart would keep
            if defer and not todo:
                self._unsaved.setdefault(c, set()).update(idxs)
            else:
                self._persist_rows(c, book, idxs, durable=bool(todo))
        return len(victims), wrote

    def _evict(self, ctx: str, idxs: Iterable[int]) -> None:
        """Chunks of `ctx` out of the pool; those without a file leave the books (killed: nothing is left
        but the token ids, recomputed when next needed)."""
        book = self.books[ctx]
        for i in idxs:
            ch = book.chunks[i]
            self.stats["evictions"] += ch.handle is not None
            self._drop_resident(ctx, i, ch)
            if ch.file is None:
                book.chunks.pop(i)

    def _pop_victims(self, need: int, skip=None) -> list[tuple[str, int]]:
        try:
            return self.queue.pop_victims(need, skip)
        except CapacityError:  # locked contexts hold the rest: free what can be freed
            return self.queue.pop_victims(self.queue.evictable_bytes, skip) if self.queue.evictable_bytes else []

    def writing_nbytes(self) -> int:
        """Bytes of resident chunks whose writes ahead of time are in flight (by which the pool may
        stand over its budget after `admit`, until they end)."""
        return sum(ch.nbytes for w in self.writes.all() for i, _h, _t in w.todo
                   if (ch := self.books[w.ctx].chunks.get(i)) is not None and ch.handle is not None)

    def _save_evicted(self) -> None:
        """Write the rows `_make_room(defer=True)` left (their state as the books have it now)."""
        while self._unsaved:
            c, idxs = self._unsaved.popitem()
            book = self.books.get(c)
            if book is not None:
                self._persist_rows(c, book, sorted(idxs), durable=False)

    # ---- writes ahead of time -------------------------------------------------------------------------
    def reap(self) -> int:
        """Apply the writes ahead of time that have finished (file names into the books, rows into the
        registry), and evict the chunks they let go; returns how many. `admit` calls it, and an actor
        whenever a write finishes (`wake`)."""
        done = self.writes.finished()
        for w in done:
            self._finish(w)
        if done:  # chunks left over budget while written can go now
            self._make_room(0, wait=False)
            self._save_evicted()
        return len(done)

    def drain(self) -> None:
        """Wait for every write ahead of time, apply it, and evict down to the budget (what an idle
        gap gives: before a close or a check)."""
        for w in self.writes.all():
            self._finish(w)
        self._make_room(0)
        self._save_evicted()

    def _settle(self, ctx: str, indices: Iterable[int] | None = None, defer: bool = False) -> None:
        """Wait for the writes holding `ctx`'s chunks `indices` (all when None) and apply them: those
        chunks are about to leave the pool, or their files to become void."""
        for w in self.writes.of(ctx, indices):
            self._finish(w, defer)

    def _finish(self, w: Write, defer: bool = False) -> None:
        """Apply one write's result. A failed write is logged; its chunks stay without a file (written
        on demand if evicted, recomputed from their token ids after a restart). `defer` (inside a
        switch): the rows are written after the reply (`_save_evicted`), as `_make_room`'s are."""
        try:
            metas = w.pending.result()
        except Exception:  # noqa: BLE001 - the service's business, not the next call's
            self.writes.remove(w)
            self.stats["failed_writes"] += 1
            logging.getLogger(__name__).exception("a write ahead of time of %d chunks of %s failed; they "
                                                  "stay in memory only", len(w.todo), w.ctx)
            return
        self.writes.remove(w)
        book = self.books.get(w.ctx)
        if book is None:  # not expected: a deletion settles the context's writes first
            return
        for (i, _h, _t), meta in zip(w.todo, metas):
            if (ch := book.chunks.get(i)) is not None:  # always, as every change of a chunk settles first
                self.stats["swap_out_bytes"] += ch.written(meta)
        if defer:
            self._unsaved.setdefault(w.ctx, set()).update(i for i, _h, _t in w.todo)
            return
        try:  # not durable: a power loss that undoes it leaves the chunks without files as far as
            # the registry knows (recomputed after a restart), never naming a file that is not there
            self._persist_rows(w.ctx, book, [i for i, _h, _t in w.todo], durable=False)
        except Exception:  # noqa: BLE001 - a full disk: the rows follow with the context's next write
            logging.getLogger(__name__).exception("the rows of %d chunks written for %s were not saved",
                                                  len(w.todo), w.ctx)

    def _delete_file(self, ctx: str, i: int) -> None:
        """Forget chunk `i`'s record on disk, which the books no longer name. A failure (a full disk)
        is logged, not raised: the registry never names the stale record again, and the chunk's next
        write supersedes it."""
        try:
            self.io.delete(ctx, i)
        except Exception:  # noqa: BLE001
            logging.getLogger(__name__).exception("deleting the stale record of chunk %d of %s failed", i, ctx)

    def _write(self, ctx: str, todo: list[tuple[int, Any, int]]) -> None:
        if not todo:
            return
        book = self.books[ctx]
        metas = self.io.write(ctx, todo, book.adapter)
        for (i, _, _), meta in zip(todo, metas):
            self.stats["swap_out_bytes"] += book.chunks[i].written(meta)

    def _persist_rows(self, ctx: str, book: CtxBook, indices: Iterable[int] | None = None,
                      durable: bool = True) -> None:
        """Write the rows of `ctx`'s chunks (all, or those of `indices` still in the book) to the
        registry in one transaction (`Registry.upsert_chunks`)."""
        rows = [book.chunks[i].row(i) for i in (book.chunks if indices is None else indices) if i in book.chunks]
        self.registry.upsert_chunks(ctx, rows, durable=durable)
