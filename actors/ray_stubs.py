"""Typed stubs of the Ray actors: each implements its role's port (`actors.ports`) by calling the
actor's method of the same name.

Steering calls wait for their answer (retried while the actor restarts, `actors.retry`). Calls that
move K/V or text return the actor's streaming generator of object refs, for the consumer to resolve
as it goes. The executor's view of the governor also keeps the object refs of the chunks it put
(`ResidentRefs`), since a plan names them by key.

What this module deliberately does not know: what the actors do with the calls.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import numpy as np
import ray

from actors import retry
from actors.config import Tuning
from actors.messages import (CallInterruptedError, CallPlan, CommitReply, PoolRef, RagCall, RagOutcome, RestoreRequest,
                             RestoreStats, WithReleases)
from storage import codecs


NAMESPACE = "llmaas"
"""The Ray namespace of the service's actors."""


def peer(prefix: str, role: str):
    """The handle of this node's actor `role` (`<prefix>-<role>`, in `NAMESPACE`). Actors
    find their peers by name rather than taking handles as constructor arguments: Ray keeps a handle
    argument in the object store, where a restart needs it again (ray-project/ray#53727)."""
    return ray.get_actor(f"{prefix}-{role}", namespace=NAMESPACE)


def resolve_chunks(handles: list[PoolRef | codecs.EncodedChunk]) -> list[codecs.EncodedChunk]:
    """The chunks behind resident handles, in order; each object they are in is fetched once. A chunk
    given by value (a RAG node's record, `actors.rag.save_node`) is itself."""
    refs = list({h.ref: None for h in handles if isinstance(h, PoolRef)})
    objects = dict(zip(refs, ray.get(refs)))
    return [h if isinstance(h, codecs.EncodedChunk) else objects[h.ref][h.index] for h in handles]


def resolve_call_item(ref):
    """An item of the executor's `stream`, fetched; `CallInterruptedError` when the executor stopped."""
    try:
        return ray.get(ref)
    except (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError) as e:
        raise CallInterruptedError(
            "the model executor stopped during the call and is being restarted; the turn was recorded "
            "only if its reply had finished (see the context's history before retrying)") from e


def resolved_items(gen) -> Iterator[Any]:
    """The items of an actor's streaming generator of text deltas and a last outcome, fetched in order
    (`resolve_call_item`). Closed before the outcome (its consumer stopped), it cancels the actor's
    call, whose generator then stops at its next item."""
    finished = False
    try:
        for ref in gen:
            item = resolve_call_item(ref)
            finished = not isinstance(item, str)
            yield item
        finished = True
    finally:
        if not finished:
            with contextlib.suppress(Exception):
                ray.cancel(gen, recursive=False)


class ResidentRefs:
    """The executor's handles of the chunks it put, by `PoolRef.key`, each with a zero-copy view of
    the chunk (its arrays map the object store's memory), dropped as the governor releases them. An
    object holds up to `object_chunks` chunks of one `put` and is freed once the last is dropped.

    Dropping an object costs ~0.1-0.2 ms (the object store frees it), and a switch that evicts room
    for a large load releases many chunks, so the drops wait for the next `put` (the call's
    write-back, after the reply), which frees them before it puts anything new: the object store
    never holds both the evicted chunks and their replacements.

    `put` puts its chunks `object_chunks` to an object: one object-store allocation costs about as
    much as copying a few hundred KB, so one per chunk made a write-back's puts cost several times its
    encoding. An object lives while any of its chunks is resident, so released chunks leave holes:
    `put` puts the resident chunks of the sparsest objects again with the new ones until the holes
    are at most `MAX_HOLES` of the resident bytes, and tells the governor their new handles
    (`rehome`); the old objects are freed once nothing holds them (a write in flight may, until it
    ends). Small objects keep that re-packing small."""

    MAX_HOLES = 0.25

    def __init__(self, object_chunks: int | None = None) -> None:
        self.object_chunks = Tuning().object_chunks if object_chunks is None else object_chunks
        """Chunks put to one object (`actors.config.Tuning.object_chunks`)."""
        self.held: dict[int, PoolRef] = {}
        self.views: dict[int, codecs.EncodedChunk] = {}
        self.sizes: dict[bytes, int] = {}
        """Object id (`ObjectRef.binary()`, which holds nothing) -> bytes of the chunks put in it."""
        self.rehome: Callable[[list[PoolRef]], None] = lambda handles: None
        """Where the new handles of chunks put again go (`GovernorStub.rehome`)."""
        self._dropped: list = []  # released refs and views, freed by the next `put`
        self._next_key = 0
        self._epoch: str | None = None
        self._lock = threading.Lock()  # the call and the write-back thread both use it

    def put(self, encs: list) -> list[PoolRef]:
        with self._lock:
            dropped, self._dropped = self._dropped, []
        del dropped  # the object store frees them here
        if not encs:
            return []
        with self._lock:
            moving = self._sparse()
        chunks = list(encs) + [view for _key, view in moving]
        n = self.object_chunks
        objects = [ray.put(chunks[a:a + n]) for a in range(0, len(chunks), n)]
        slots = [(ref, index, view) for ref, views in zip(objects, ray.get(objects)) for index, view in enumerate(views)]
        out, moved = [], []
        with self._lock:
            for ref in objects:
                self.sizes[ref.binary()] = 0
            for ref, _index, view in slots:
                self.sizes[ref.binary()] += view.nbytes
            for ref, index, view in slots[:len(encs)]:
                self._next_key += 1
                handle = PoolRef(self._next_key, ref, index)
                self.held[self._next_key], self.views[self._next_key] = handle, view
                out.append(handle)
            for (key, _old), (ref, index, view) in zip(moving, slots[len(encs):]):
                if key in self.held:  # not released meanwhile
                    self.held[key], self.views[key] = PoolRef(key, ref, index), view
                    moved.append(self.held[key])
        if moved:
            self.rehome(moved)
        return out

    def _sparse(self) -> list[tuple[int, codecs.EncodedChunk]]:
        """(key, view) of the resident chunks to put again: those of the sparsest objects, until the
        rest hold at most `MAX_HOLES` of the resident bytes in holes. Forgets objects left empty."""
        live: dict[bytes, list[tuple[int, codecs.EncodedChunk]]] = {}
        for key, handle in self.held.items():
            live.setdefault(handle.ref.binary(), []).append((key, self.views[key]))
        self.sizes = {oid: n for oid, n in self.sizes.items() if oid in live}
        used = {oid: sum(v.nbytes for _k, v in chunks) for oid, chunks in live.items()}
        holes = sum(self.sizes[oid] - used[oid] for oid in live)
        budget = self.MAX_HOLES * sum(used.values())
        moving = []
        for oid in sorted(live, key=lambda o: used[o] / self.sizes[o]):
            if holes <= budget:
                break
            holes -= self.sizes[oid] - used[oid]
            moving += live[oid]
        return moving

    def drop_released(self, released: list[int], epoch: str) -> None:
        """Drop what the governor released; forget everything when it is a new governor process."""
        with self._lock:
            if epoch != self._epoch:
                if self._epoch is not None:
                    self.held.clear()
                    self.views.clear()
                    self.sizes.clear()
                self._epoch = epoch
            for key in released:
                self._dropped += (self.held.pop(key, None), self.views.pop(key, None))


class GovernorStub:
    """`GovernorPort` over the governor actor. `refs`: the executor's resident refs, updated with
    every plan (None for the other callers)."""

    def __init__(self, handle, refs: ResidentRefs | None = None) -> None:
        self.handle = handle
        self.refs = refs

    def bind_app(self, app: str, adapter: str = "") -> str:
        return retry.call(self.handle.bind_app, app, adapter)

    def app_adapter(self, app: str) -> str:
        return retry.call(self.handle.app_adapter, app)

    def app_for_token(self, token: str) -> str:
        return retry.call(self.handle.app_for_token, token)

    def list_contexts(self, app: str) -> list:
        return retry.call(self.handle.list_contexts, app)

    def delete_app(self, app: str) -> None:
        retry.call(self.handle.delete_app, app)

    def new_ctx(self, app: str, system_prompt: str = "", token_ids=None, text: str = "",
                state: str | None = None, adapter: str = "") -> str:
        return retry.call(self.handle.new_ctx, app, system_prompt, token_ids, text, state, adapter)

    def adapters(self) -> list:
        return retry.call(self.handle.adapters)

    def add_adapter(self, name: str, path: str, key: str) -> None:
        retry.call(self.handle.add_adapter, name, path, key)

    def remove_adapter(self, name: str) -> None:
        retry.call(self.handle.remove_adapter, name)

    def describe(self, ctx: str, app: str | None = None) -> dict:
        return retry.call(self.handle.describe, ctx, app)

    def delete_ctx(self, ctx: str, app: str | None = None) -> None:
        retry.call(self.handle.delete_ctx, ctx, app)

    def begin_call(self, ctx: str, app: str | None = None, cached: bool = False) -> CallPlan:
        return self._unwrap(retry.call(self.handle.begin_call, ctx, app, cached))

    def begin_cached_call(self, ctx: str, app: str | None) -> Callable[[], None]:
        """Sent without waiting; the returned function waits for it and raises its error."""
        ref = self.handle.begin_call.remote(ctx, app, True)

        def confirm() -> None:
            try:
                reply = ray.get(ref)
            except ray.exceptions.ActorUnavailableError:  # the governor is restarting: ask the new one
                reply = retry.call(self.handle.begin_call, ctx, app, True)
            self._unwrap(reply)

        return confirm

    def _unwrap(self, reply: WithReleases):
        """The call's result, after dropping the refs the governor released (the executor's view)."""
        if self.refs is not None:
            self.refs.drop_released(reply.released, reply.epoch)
        return reply.value

    def record_restore(self, ctx: str, measured_s: float, stages: dict[str, float] | None = None) -> None:
        self._unwrap(retry.call(self.handle.record_restore, ctx, measured_s, stages))

    def loaded(self, ctx: str, chunks: list[tuple[int, Any, int]]) -> None:
        self._unwrap(retry.call(self.handle.loaded, ctx, chunks))

    def rehome(self, handles: list[PoolRef]) -> None:
        """Tell the governor the new handles of resident chunks put again (`ResidentRefs.put`)."""
        self._unwrap(retry.call(self.handle.rehome, handles))

    def commit_call(self, ctx: str, token_ids, text: str, state: str, density: bytes, kv_tokens: int,
                    chunk_density: np.ndarray, first_modified: int, restored: list[int] | None = None,
                    request_id: str | None = None, unreadable: list[int] | None = None,
                    streamed_from: int | None = None) -> CommitReply:
        return self._unwrap(retry.call(self.handle.commit_call, ctx, token_ids, text, state, density, kv_tokens,
                                       chunk_density, first_modified, restored, request_id, unreadable, streamed_from))

    def admit(self, ctx: str, encoded: list[tuple[int, str, Any, int]], token_starts: dict[int, int],
              stored: list[tuple[int, str, dict]] | None = None) -> None:
        self._unwrap(retry.call(self.handle.admit, ctx, encoded, token_starts, stored))

    def abort_call(self, ctx: str) -> None:
        self._unwrap(retry.call(self.handle.abort_call, ctx))

    def executor_started(self) -> int:
        return self._unwrap(retry.call(self.handle.executor_started))

    def set_profile(self, profile_json: str) -> None:
        retry.call(self.handle.set_profile, profile_json)

    def held_nbytes(self) -> int:
        return retry.call(self.handle.held_nbytes)

    def drain(self) -> None:
        retry.call(self.handle.drain)


def _bounded(method, ahead: int | None):
    """An actor's streaming-generator method whose items run at most `ahead` ahead of the consumer
    (Ray's generator backpressure: the actor pauses until the consumer has taken them)."""
    return method if ahead is None else method.options(_generator_backpressure_num_objects=max(1, ahead))


class SwapIOStub:
    """`SwapIOPort` over the IO worker actor; reads return its streaming generators (object refs)."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def write(self, ctx: str, todo: list[tuple[int, Any, int]], adapter: str = "") -> list[dict]:
        return retry.call(self.handle.write, ctx, todo, adapter)

    def write_async(self, ctx: str, todo: list[tuple[int, Any, int]], adapter: str = ""):
        """The write's object ref as a future (a restart in between fails it: the governor logs it,
        and the chunks are written on demand if evicted)."""
        return self.handle.write.remote(ctx, todo, adapter).future()

    def read(self, ctx: str, indices: list[int], adapter: str = "") -> tuple[dict[int, Any], dict[int, str]]:
        return retry.call(self.handle.read, ctx, indices, adapter)

    def read_batches(self, ctx: str, indices: list[int], batch: int, adapter: str = "", ahead: int | None = None):
        return _bounded(self.handle.read_batches, ahead).remote(ctx, indices, batch, adapter)

    def read_groups(self, ctx: str, indices: list[int], groups: list[range], adapter: str = "",
                    ahead: int | None = None):
        return _bounded(self.handle.read_groups, ahead).remote(ctx, indices, groups, adapter)

    def delete(self, ctx: str, index: int) -> None:
        retry.call(self.handle.delete, ctx, index)

    def delete_context(self, ctx: str) -> None:
        retry.call(self.handle.delete_context, ctx)

    def usage_bytes(self) -> int:
        return retry.call(self.handle.usage_bytes)


class RecomputeStub:
    """`RecomputePort` over the recompute worker actor (the K/V itself crosses in shared memory)."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def restore(self, req: RestoreRequest) -> RestoreStats:
        return retry.call(self.handle.restore, req)

    def forget_adapter(self, name: str) -> bool:
        return retry.call(self.handle.forget_adapter, name)


class ExecutorStub:
    """`ExecutorPort` over the executor actor; `call` returns its streaming generator (object refs of
    text deltas, then of the outcome as a dict)."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def new_ctx(self, app: str, system_prompt: str | None, history: list | None = None,
                adapter: str | None = None) -> str:
        return retry.call(self.handle.new_ctx, app, system_prompt, history, adapter)

    def add_adapter(self, name: str, path: str) -> dict:
        return retry.call(self.handle.add_adapter, name, path)

    def remove_adapter(self, name: str) -> None:
        retry.call(self.handle.remove_adapter, name)

    def list_adapters(self) -> list[dict]:
        return retry.call(self.handle.list_adapters)

    def stream(self, app: str | None, ctx: str, prompt: str, params: dict):
        return self.handle.stream.remote(app, ctx, prompt, params)

    def stream_stateless(self, system_prompt: str | None, history: list | None, prompt: str, params: dict):
        return self.handle.stream_stateless.remote(system_prompt, history, prompt, params)

    def rag_call(self, call: RagCall) -> RagOutcome:
        return retry.call(self.handle.rag_background if call.background else self.handle.rag_call, call)

    def rag_stream(self, call: RagCall):
        return self.handle.rag_stream.remote(call)

    def activity(self) -> tuple[float, int]:
        return retry.call(self.handle.activity)

    def forget(self, ctx: str) -> None:
        retry.call(self.handle.forget, ctx)

    def flush(self) -> None:
        retry.call(self.handle.flush)

    def ready(self) -> None:
        retry.call(self.handle.__ray_ready__)


class PredictorStub:
    """`PredictorPort` over the query predictor actor (the RAG cache)."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def create_collection(self, app: str, name: str) -> str:
        return retry.call(self.handle.create_collection, app, name)

    def collections(self, app: str) -> list[dict]:
        return retry.call(self.handle.collections, app)

    def delete_collection(self, app: str, collection: str) -> None:
        retry.call(self.handle.delete_collection, app, collection)

    def add_document(self, app: str, collection: str, content: str, name: str = "", kind: str = "text") -> str:
        return retry.call(self.handle.add_document, app, collection, content, name, kind)

    def documents(self, app: str, collection: str) -> list[dict]:
        return retry.call(self.handle.documents, app, collection)

    def delete_document(self, app: str, document: str) -> int:
        return retry.call(self.handle.delete_document, app, document)

    def query(self, app: str, collection: str, question: str, params: dict):
        return retry.call(self.handle.query, app, collection, question, params)

    def query_stream(self, app: str, collection: str, question: str, params: dict):
        return self.handle.query_stream.remote(app, collection, question, params)

    def embed(self, texts: list[str]):
        return retry.call(self.handle.embed, texts)
