"""The context service's one front (LLMS Table 1: `bind`, `new_ctx`, `call`, `delete_ctx`) over the
ports of one node, and the configuration every component is built from.

`ContextService` speaks only to a `GovernorPort` and an `ExecutorPort`: it runs the same in one
process (`wire_local`, here) and on Ray (`actors.ray_service.wire_ray`). Both wirings take their
components' configurations from `components`, so the two cannot drift apart.

What this module deliberately does not know: HTTP (`deploy/`), and how a transport moves data.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from actors.config import ServiceConfig, Tuning, prepare_data_dir
from actors.governor import GovernorConfig
from actors.messages import CallInterruptedError, CallOutcome, KVKey
from actors.ports import ExecutorPort, GovernorPort, PredictorPort
from engine.config import EngineConfig, ModelConfig
from storage import codecs
from storage.chunkstore import ChunkStoreConfig
from storage.registry import RegistryConfig


def drain(gen):
    """Run a generator of text deltas to its end; return its return value (the call's outcome)."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


# ---- one configuration for every component ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Components:
    """What each component of a node is built with, derived from one `ServiceConfig`."""

    engine: EngineConfig
    """The model executor's and recompute worker's engine."""
    registry: RegistryConfig
    """The governor's registry."""
    store: ChunkStoreConfig
    """The KV swap/IO worker's chunk store."""
    governor: GovernorConfig
    """The memory governor."""
    tuning: Tuning
    """The speed-only optimisations each component switches on or off."""


def components(config: ServiceConfig, model: ModelConfig, dtype: str, device: str = "auto") -> Components:
    """The components' configurations for a model of shape `model` computing in `dtype` (the governor
    and the codecs see `kv8` when the working set holds that format)."""
    from actors.local_restore import GROUP_LAYERS
    from actors.swapio import layer_groups

    if config.kv_format == "kv8":  # the working set's chunks are its rows: that is `raw` then
        dtype = "kv8"
    raw_chunk_bytes = codecs.stored_nbytes(
        "raw", (model.n_layers, 2, model.n_kv_heads, config.chunk_tokens, model.head_dim), dtype)

    return Components(
        engine=EngineConfig(max_context_tokens=config.max_context_tokens, chunk_tokens=config.chunk_tokens,
                            device=device, weights=config.weights, copy_weights=False,  # one mapped copy a node
                            kv_format=config.kv_format, weights_resident_bytes=config.weights_resident_bytes,
                            lookup_draft=config.tuning.lookup_draft),
        registry=RegistryConfig(max_contexts_per_app=config.max_contexts_per_app, chunk_tokens=config.chunk_tokens),
        store=ChunkStoreConfig(disk_cap_bytes=config.disk_cap_bytes, read_bytes_per_s=config.read_bytes_per_s,
                               read_burst_bytes=config.read_burst_bytes),
        governor=GovernorConfig(pool_bytes=config.pool_bytes, chunk_tokens=config.chunk_tokens, policy=config.policy,
                                dtype=dtype, pipeline_groups=len(layer_groups(model.n_layers, GROUP_LAYERS)),
                                raw_chunk_bytes=raw_chunk_bytes),
        tuning=config.tuning,
    )


def dtype_name(torch_dtype) -> str:
    """`torch.float32` -> "float32": the compute dtype as codecs and configs name it."""
    return str(torch_dtype).removeprefix("torch.")


# ---- the front -----------------------------------------------------------------------------------------


class ContextService:
    """The front of one node's service. `resolve` turns an item of the executor's stream into its
    value (identity in one process, a fetch on Ray); `parts` holds the transport's own objects (the
    plain components, or the actor handles) for tests, benchmarks and shutdown."""

    def __init__(self, governor: GovernorPort, executor: ExecutorPort, *, config: ServiceConfig | None = None,
                 resolve: Callable[[Any], Any] = lambda x: x, parts: Any = None,
                 close: Callable[[], None] | None = None, model_id: str = "",
                 predictor: PredictorPort | None = None) -> None:
        self.config = config
        """What the node was wired from (None when attached to a running one)."""
        self.governor = governor
        self.executor = executor
        self.predictor = predictor
        """The RAG cache (None: a node without one)."""
        self.resolve = resolve
        self.parts = parts
        self.model_id = model_id
        self._close = close
        self._executor_down = False  # the last call saw the executor stop: wait for it before the next one

    # ---- apps
    def bind(self, app: str, adapter: str = "") -> str:
        """Register an app whose contexts default to the loaded LoRA adapter `adapter` ("" for the
        base model); returns its token (shown once, stored hashed)."""
        return self.governor.bind_app(app, adapter)

    def app_of(self, token: str) -> str:
        return self.governor.app_for_token(token)

    # ---- contexts
    def new_ctx(self, token: str, system_prompt: str | None = None, history: list | None = None,
                adapter: str | None = None) -> str:
        """A context of the token's app, computed under the loaded LoRA adapter `adapter` for its life
        ("" for the base model; None: the app's default)."""
        return self.executor.new_ctx(self.app_of(token), system_prompt, history, adapter)

    def list_ctx(self, token: str) -> list:
        return self.governor.list_contexts(self.app_of(token))

    def describe(self, token: str, ctx: str) -> dict:
        return self.governor.describe(ctx, self.app_of(token))

    def delete_ctx(self, token: str, ctx: str) -> None:
        self.remove_ctx(self.app_of(token), ctx)

    def remove_ctx(self, app: str, ctx: str) -> None:
        """Delete `app`'s context `ctx`: the executor lets it go (after its write-back), then the governor
        deletes its books, rows and files. The one place a context is deleted (the HTTP route too)."""
        self.governor.describe(ctx, app)  # unknown to this app: refused before the executor is touched
        self.executor.forget(ctx)
        self.governor.delete_ctx(ctx, app)

    # ---- LoRA adapters (engine.lora; the HTTP layer admits only the admin here)
    def add_adapter(self, name: str, path: str) -> dict:
        """Load the adapter at `path` under the adapter root as `name`; it is loaded again at start."""
        return self.executor.add_adapter(name, path)

    def remove_adapter(self, name: str) -> None:
        """Forget an adapter; refused (`adapter_in_use`) while a context is computed under it."""
        self.executor.remove_adapter(name)

    def list_adapters(self) -> list[dict]:
        return self.executor.list_adapters()

    # ---- RAG (the query predictor's port, `actors.predictor`; the token names the app)
    def _rag(self) -> PredictorPort:
        if self.predictor is None:
            raise RuntimeError("this node runs no RAG cache")
        return self.predictor

    def create_collection(self, token: str, name: str) -> str:
        return self._rag().create_collection(self.app_of(token), name)

    def collections(self, token: str) -> list[dict]:
        return self._rag().collections(self.app_of(token))

    def delete_collection(self, token: str, collection: str) -> None:
        self._rag().delete_collection(self.app_of(token), collection)

    def add_document(self, token: str, collection: str, content: str, name: str = "", kind: str = "text") -> str:
        return self._rag().add_document(self.app_of(token), collection, content, name, kind)

    def documents(self, token: str, collection: str) -> list[dict]:
        return self._rag().documents(self.app_of(token), collection)

    def delete_document(self, token: str, document: str) -> int:
        return self._rag().delete_document(self.app_of(token), document)

    def rag_query(self, token: str, collection: str, question: str, **params):
        """Answer `question` over the app's `collection` (`actors.ragfront.RagAnswer`): `k`,
        `tau_query`, `adapter` and sampling parameters."""
        return self._rag().query(self.app_of(token), collection, question, params)

    def embed(self, token: str, texts: list[str]):
        self.app_of(token)
        return self._rag().embed(texts)

    # ---- calls
    def stream(self, token: str, ctx: str, prompt: str, request_id: str | None = None, **params):
        """Generator of text deltas; returns the `CallOutcome` (StopIteration.value). `request_id`
        (one is made when None): a call sent again with the id of one already committed appends
        nothing and returns the committed turn. Raises `CallInterruptedError` when the executor stops
        during the call; the next call waits until it is back."""
        app = self.app_of(token)
        if self._executor_down:
            self.executor.ready()
            self._executor_down = False
        params = dict(params, request_id=request_id or uuid.uuid4().hex)
        try:
            for item in self.executor.stream(app, ctx, prompt, params):
                item = self.resolve(item)
                if isinstance(item, CallOutcome):
                    return item
                yield item
        except CallInterruptedError:
            self._executor_down = True
            raise
        raise RuntimeError("the executor's stream ended without an outcome")

    def call(self, token: str, ctx: str, prompt: str, **params) -> CallOutcome:
        return drain(self.stream(token, ctx, prompt, **params))

    def stream_stateless(self, token: str, system_prompt: str | None, history: list | None, prompt: str,
                         **params):
        """A call on no context: `history` ((role, text) turns) and `prompt` are answered, nothing is
        stored or counted against the app's contexts. Generator of text deltas; returns the outcome."""
        self.app_of(token)  # the app must exist, though nothing of it is touched
        for item in self.executor.stream_stateless(system_prompt, history, prompt, params):
            item = self.resolve(item)
            if isinstance(item, CallOutcome):
                return item
            yield item
        raise RuntimeError("the executor's stream ended without an outcome")

    def call_stateless(self, token: str, system_prompt: str | None, history: list | None, prompt: str,
                       **params) -> CallOutcome:
        return drain(self.stream_stateless(token, system_prompt, history, prompt, **params))

    def flush(self) -> None:
        """Wait for the last call's write-back, its chunk writes included (what an idle gap between
        calls gives; benchmarks and tests wait here)."""
        self.executor.flush()
        self.governor.drain()

    def close(self) -> None:
        if self._close is not None:
            self._close()


# ---- one process ------------------------------------------------------------------------------------------


@dataclass(slots=True)
class LocalParts:
    """The plain components `wire_local` built."""

    engine: Any
    registry: Any
    io: Any
    governor: Any
    executor: Any
    components: Components
    predictor: Any = None


def wire_local(config: ServiceConfig, engine=None, profile=None) -> ContextService:
    """Everything in this process, no Ray: the reference for the actor path. `engine` may be passed to
    share an already loaded model; `profile` (a `CostProfile`) skips measuring one."""
    from actors.admission import streamable_working_set
    from actors.executor import ModelExecutor
    from actors.local_restore import InProcessRestorer
    from actors.governor import MemoryGovernor
    from actors.predictor import QueryPredictor
    from actors.swapio import KVSwapIO
    from engine.context import ContextEngine
    from engine.lora import AdapterSet
    from storage.registry import Registry

    root = Path(config.data_dir)
    prepare_data_dir(root)
    if engine is None:
        engine = ContextEngine.load(None, EngineConfig(max_context_tokens=config.max_context_tokens,
                                                       chunk_tokens=config.chunk_tokens, weights=config.weights,
                                                       kv_format=config.kv_format,
                                                       weights_resident_bytes=config.weights_resident_bytes,
                                                       lookup_draft=config.tuning.lookup_draft))
    elif engine.model.engine_cfg.chunk_tokens != config.chunk_tokens:
        raise ValueError(f"the engine passed cuts {engine.model.engine_cfg.chunk_tokens}-token chunks but the "
                         f"service is configured for {config.chunk_tokens}; load a model with that chunk size")
    elif engine.model.weight_format != config.weights:
        raise ValueError(f"the engine passed runs {engine.model.weight_format} weights but the service is "
                         f"configured for {config.weights}; load the model in that format")
    if config.weights_resident_bytes is not None and engine.model.weight_pager is None:
        raise ValueError("the service streams weights (weights_resident_bytes) but the engine passed holds "
                         "them all resident; load it with EngineConfig.weights_resident_bytes")
    parts = components(config, engine.model.cfg, dtype_name(engine.model.dtype))
    fingerprint = engine.fingerprint or "unknown-model"
    if ((engine.cfg.max_context_tokens, engine.cfg.kv_format, engine.cfg.lookup_draft)
            != (config.max_context_tokens, config.kv_format, config.tuning.lookup_draft)):
        engine = ContextEngine(engine.model, engine.tok, parts.engine)
        engine.fingerprint = fingerprint
    registry = Registry(str(root / "registry.db"), config=parts.registry)
    io = KVSwapIO(str(root / "chunks"), KVKey(fingerprint, engine.model.weight_format, kv_format=config.kv_format), parts.store)
    if profile is None:
        profile = _local_profile(config, engine, fingerprint)
    governor = MemoryGovernor(registry, io, parts.governor, profile=profile, clock=time.monotonic)
    t = parts.tuning
    m = engine.model
    adapters = AdapterSet(config.adapter_dir(), m.cfg, device=m.device, dtype=m.dtype)
    restorer = InProcessRestorer(m, io, streaming_stores=t.streaming_stores, adapters=adapters)
    ws = (streamable_working_set(m, engine.limit, config.kv_format, str(root / "ws"))
          if config.prefill_budget_bytes else None)
    executor = ModelExecutor(engine, governor, restorer, adapters=adapters, working_set=ws,
                             prefill_budget=config.prefill_budget_bytes, io=io)
    executor.load_recorded_adapters()
    predictor = QueryPredictor(str(root), engine.tok, executor, io.delete_context, io.key, config.rag)
    predictor.start()

    def close() -> None:
        executor.flush()
        governor.drain()
        predictor.close()
        registry.close()

    return ContextService(governor, executor, config=config, close=close, model_id=fingerprint, predictor=predictor,
                          parts=LocalParts(engine, registry, io, governor, executor, parts, predictor))


def _local_profile(config: ServiceConfig, engine, fingerprint: str):
    from scheduler.pipeline import CostProfile

    if config.profile:
        return CostProfile.from_json(config.profile)
    from actors.profiling import load_or_measure

    return load_or_measure(engine.model, fingerprint, read_bytes_per_s=config.read_bytes_per_s)
