"""The roles of the service as typed ports: what each one offers the others, by name.

Each role is a `Protocol`. Two transports implement them: the plain objects in one process
(`MemoryGovernor`, `KVSwapIO`, `RecomputeWorker`, `ModelExecutor`), and Ray actors reached through the
typed stubs of `actors.ray_stubs`, which call the actor's method of the same name. A reader goes from
a call site to the code it runs by the method's name; nothing is dispatched by a string.

Methods that only steer (plans, commits, bookkeeping) return values on both transports. Methods that
move K/V return what a consumer can overlap with its own work: iterators of layer groups or chunk
batches, whose items are the values themselves in one process and object refs on Ray; the consumer
resolves each item when it needs it (`resolve` in `actors.restore`). No stub hides a `ray.get` of
moving data.

A fifth role, the query predictor of the RAG cache, gets its port here when it is built.

This module knows no Ray and no model: only the shape of the conversation between the roles.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Protocol

import numpy as np

from actors.messages import CallOutcome, CallPlan, CommitReply, RagCall, RagOutcome, RestoreRequest, RestoreStats


class GovernorPort(Protocol):
    """The memory governor: owner of the apps, the contexts' books, the pool, locks and plans."""

    # ---- apps and contexts (the registry it owns)
    def bind_app(self, app: str, adapter: str = "") -> str:
        """Register an app whose contexts default to the loaded LoRA adapter named `adapter` ("" for
        the base model); returns its token (shown once, stored hashed)."""

    def app_adapter(self, app: str) -> str:
        """The adapter an app's contexts default to ("" for the base model)."""

    def app_for_token(self, token: str) -> str:
        """The app a bearer token belongs to (`UnknownAppError` otherwise)."""

    def list_contexts(self, app: str) -> list:
        """The app's contexts (`storage.registry` summaries)."""

    def delete_app(self, app: str) -> None:
        """Remove an app that has no contexts left."""

    def new_ctx(self, app: str, system_prompt: str, token_ids: np.ndarray, text: str, state: str,
                adapter: str = "") -> str:
        """Create a context with its first token ids and state, computed under the LoRA adapter of key
        `adapter` ("" for the base model); returns its id."""

    def describe(self, ctx: str, app: str | None = None) -> dict:
        """A context's metadata (`GET /v1/contexts/{id}`)."""

    def delete_ctx(self, ctx: str, app: str | None = None) -> None:
        """Delete a context, its chunks and files."""

    # ---- LoRA adapters (the registry's record of what the node loads)
    def adapters(self) -> list:
        """The recorded adapters (`storage.records.AdapterRow`s)."""

    def add_adapter(self, name: str, path: str, key: str) -> None:
        """Record an adapter the executor loaded (`adapter_exists` for a taken name)."""

    def remove_adapter(self, name: str) -> None:
        """Forget an adapter (`adapter_in_use` while a context is computed under it)."""

    # ---- a call
    def begin_call(self, ctx: str, app: str | None = None, cached: bool = False) -> CallPlan:
        """Lock the context and plan its restore."""

    def begin_cached_call(self, ctx: str, app: str | None) -> Callable[[], None]:
        """`begin_call(ctx, app, cached=True)` for a context the executor's working set holds whole;
        returns the function that waits for it (and raises its error), so a transport one hop away
        can let the call run meanwhile."""

    def record_restore(self, ctx: str, measured_s: float, stages: dict[str, float] | None = None) -> None:
        """The executor's measurement of the restore it was planned."""

    def loaded(self, ctx: str, chunks: list[tuple[int, Any, int]]) -> None:
        """Chunks read whole from disk become resident: (index, handle, nbytes)."""

    def commit_call(self, ctx: str, token_ids, text: str, state: str, density: bytes, kv_tokens: int,
                    chunk_density: np.ndarray, first_modified: int, restored: list[int] | None = None,
                    request_id: str | None = None, unreadable: list[int] | None = None,
                    streamed_from: int | None = None) -> CommitReply:
        """Make the call's turn durable (once per request id) and plan the chunks to encode
        (`streamed_from`: the first layer the executor's working set streams, None when it keeps all)."""

    def admit(self, ctx: str, encoded: list[tuple[int, str, Any, int]], token_starts: dict[int, int],
              stored: list[tuple[int, str, dict]] | None = None) -> None:
        """Take the call's encoded chunks into the pool, and the chunks it wrote itself (`stored`:
        index, level, the write's meta; `CommitReply.write_through`) as on disk; unlock the context."""

    def abort_call(self, ctx: str) -> None:
        """Unlock a context whose call failed."""

    # ---- service
    def executor_started(self) -> int:
        """The executor (re)started: unlock and rebuild; returns the calls that were in flight."""

    def set_profile(self, profile_json: str) -> None:
        """Replace the restore cost profile."""

    def held_nbytes(self) -> int:
        """Bytes of resident chunks in the pool."""

    def drain(self) -> None:
        """Wait for the writes ahead of time in flight and record them (an idle gap's worth)."""


class SwapIOPort(Protocol):
    """The KV swap/IO worker: chunk records to and from disk."""

    # `adapter` (a key, "" for none) is the LoRA adapter the context's K/V is computed under: records
    # carry it in their tag (`KVKey.record_tag`), and a read under another adapter fails the chunk.

    def write(self, ctx: str, todo: list[tuple[int, Any, int]], adapter: str = "") -> list[dict]:
        """Write chunks (index, handle, token start); returns each record's name, bytes, checksum."""

    def write_async(self, ctx: str, todo: list[tuple[int, Any, int]], adapter: str = "") -> Any:
        """`write` started and not waited for: something with `done()` and `result()` (a future)."""

    def read(self, ctx: str, indices: list[int], adapter: str = "") -> tuple[dict[int, Any], dict[int, str]]:
        """Read whole chunks: ({index: EncodedChunk}, {index: error code})."""

    # `ahead`: how many items the reader may run ahead of its consumer (None: no bound), which bounds
    # the memory (on Ray, the object store) a restore into a working set that streams layers holds.

    def read_batches(self, ctx: str, indices: list[int], batch: int, adapter: str = "",
                     ahead: int | None = None) -> Iterator[Any]:
        """Whole chunks in batches of `batch` (`ChunkBatch` items, object refs on Ray)."""

    def read_groups(self, ctx: str, indices: list[int], groups: list[range], adapter: str = "",
                    ahead: int | None = None) -> Iterator[Any]:
        """The chunks layer group by layer group (`LayerGroup` items, object refs on Ray)."""

    def delete(self, ctx: str, index: int) -> None:
        """Forget one chunk's record."""

    def delete_context(self, ctx: str) -> None:
        """Forget every record of a context."""

    def usage_bytes(self) -> int:
        """Bytes of chunk records on disk."""


class RecomputePort(Protocol):
    """The recompute worker: restores that recompute, pipelined with the IO worker's reads."""

    def restore(self, req: RestoreRequest) -> RestoreStats:
        """Fill the executor's working set for `req`."""

    def forget_adapter(self, name: str) -> bool:
        """Unload the LoRA adapter `name` if a restore loaded it (the node removed it); whether it was."""


class ExecutorPort(Protocol):
    """The model executor: the working set and the calls."""

    def new_ctx(self, app: str, system_prompt: str | None, history: list | None = None,
                adapter: str | None = None) -> str:
        """Create a context, optionally seeded with earlier (role, text) turns, computed under the
        loaded LoRA adapter named `adapter` (None: the base model)."""

    def add_adapter(self, name: str, path: str) -> dict:
        """Load and record a LoRA adapter (`engine.lora`'s refusals change nothing); its description."""

    def remove_adapter(self, name: str) -> None:
        """Forget a LoRA adapter no context is computed under."""

    def list_adapters(self) -> list[dict]:
        """The loaded adapters' descriptions."""

    def stream(self, app: str | None, ctx: str, prompt: str, params: dict) -> Iterator[Any]:
        """Text deltas (str), then the `CallOutcome` as the last item (object refs on Ray)."""

    def stream_stateless(self, system_prompt: str | None, history: list | None, prompt: str,
                         params: dict) -> Iterator[Any]:
        """`stream` on no context: nothing stored, locked or counted against the app's contexts."""

    def rag_call(self, call: RagCall) -> RagOutcome:
        """Run a RAG prompt in the working set from cached K/V nodes (`actors.rag.stream_rag_call`); like
        a call on no context, nothing of a context is stored. A `call.background` one yields to real
        calls (`PreemptedError`)."""

    def rag_stream(self, call: RagCall) -> Iterator[Any]:
        """`rag_call` as it decodes: text deltas, then the `RagOutcome` as the last item (object refs on
        Ray). Closed early, the call stops and writes nothing."""

    def activity(self) -> tuple[float, int]:
        """(`time.time()` of the last real call's start or end, real calls running or waiting): how
        long the executor has been idle, for the query predictor."""

    def forget(self, ctx: str) -> None:
        """The context is being deleted: finish its write-back and drop it from the working set."""

    def flush(self) -> None:
        """Wait for the last call's write-back."""

    def ready(self) -> None:
        """Return once the executor takes calls (after a restart on Ray)."""


class PredictorPort(Protocol):
    """The query predictor: the node's RAG cache (knowledge bank, QA bank, K/V tree; `actors.predictor`).
    Every method takes the app; ids of another app's collections and documents are not found."""

    def create_collection(self, app: str, name: str) -> str:
        """A new, empty collection; its id."""

    def collections(self, app: str) -> list[dict]:
        """The app's collections (id, name, documents, chunks, created)."""

    def delete_collection(self, app: str, collection: str) -> None:
        """Delete a collection, its documents, and the nodes and answers that came from them."""

    def add_document(self, app: str, collection: str, content: str, name: str = "", kind: str = "text") -> str:
        """Split, embed and store a document (`text`, `markdown` or `html`); its id (the same id again
        for the same text)."""

    def documents(self, app: str, collection: str) -> list[dict]:
        """The collection's documents (id, name, kind, bytes, chunks, created)."""

    def delete_document(self, app: str, document: str) -> int:
        """Delete a document with the nodes and answers that came from it; its chunks deleted."""

    def query(self, app: str, collection: str, question: str, params: dict) -> Any:
        """Answer a question over a collection (`actors.ragfront.RagAnswer`)."""

    def query_stream(self, app: str, collection: str, question: str, params: dict) -> Iterator[Any]:
        """`query` as it decodes: text deltas, then the `RagAnswer` as the last item (object refs on
        Ray). Closed early, the model's call stops and nothing is stored."""

    def embed(self, texts: list[str]) -> Any:
        """Unit embedding rows of `texts` (numpy float32 `[n, d]`)."""


__all__ = ["CallOutcome", "ExecutorPort", "GovernorPort", "PredictorPort", "RecomputePort", "SwapIOPort"]
