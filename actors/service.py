"""The context service's Python front (LLMS Table 1: `bind`, `new_ctx`, `call`, `delete_ctx`), wiring the
memory governor, KV swap/IO worker, recompute worker and model executor together.

`LocalService` wires the plain classes in one process (no Ray): the reference for the actor path and
what the Ray-free policy tests drive. The Ray wiring lives in `actors.ray_service`.
"""

from __future__ import annotations

import time
from pathlib import Path

from actors.config import ServiceConfig
from actors.executor import CallOutcome, InProcessRestorer, ModelExecutor
from actors.governor import GovernorConfig, MemoryGovernor
from actors.swapio import KVSwapIO, layer_groups
from engine.config import EngineConfig
from engine.context import ContextEngine
from scheduler.pipeline import CostProfile
from storage.chunkfile import ChunkStoreConfig
from storage.registry import Registry, RegistryConfig


def drain(gen):
    """Run a generator of text deltas to its end; return its return value (the call's outcome)."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


class LocalService:
    """Everything in this process. `engine` may be passed to share an already loaded model."""

    def __init__(self, config: ServiceConfig, engine: ContextEngine | None = None,
                 profile: CostProfile | None = None) -> None:
        self.cfg = config
        root = Path(config.data_dir)
        root.mkdir(parents=True, exist_ok=True)
        if engine is None:
            engine = ContextEngine.load(None, EngineConfig(max_context_tokens=config.max_context_tokens,
                                                           chunk_tokens=config.chunk_tokens))
        elif engine.model.engine_cfg.chunk_tokens != config.chunk_tokens:
            raise ValueError(f"the engine passed cuts {engine.model.engine_cfg.chunk_tokens}-token chunks but the "
                             f"service is configured for {config.chunk_tokens}; load a model with that chunk size")
        elif engine.cfg.max_context_tokens != config.max_context_tokens:
            engine = ContextEngine(engine.model, engine.tok, EngineConfig(
                max_context_tokens=config.max_context_tokens, chunk_tokens=config.chunk_tokens))
        self.engine = engine
        fingerprint = getattr(engine, "fingerprint", "") or "unknown-model"
        self.registry = Registry(str(root / "registry.db"), config=RegistryConfig(
            max_contexts_per_app=config.max_contexts_per_app, chunk_tokens=config.chunk_tokens))
        self.io = KVSwapIO(str(root / "chunks"), fingerprint, ChunkStoreConfig(
            disk_cap_bytes=config.disk_cap_bytes, read_bytes_per_s=config.read_bytes_per_s,
            read_burst_bytes=config.read_burst_bytes))
        restorer = InProcessRestorer(engine.model, self.io)
        self.governor = MemoryGovernor(
            self.registry, self.io,
            GovernorConfig(pool_bytes=config.pool_bytes, chunk_tokens=config.chunk_tokens, policy=config.policy,
                           dtype="float32" if engine.model.dtype.is_floating_point and engine.model.dtype.itemsize == 4 else "bfloat16",
                           pipeline_groups=len(layer_groups(engine.model.cfg.n_layers, restorer.group_layers))),
            profile=profile or self._profile(config, engine, fingerprint),
            clock=time.monotonic)
        self.executor = ModelExecutor(engine, self.governor, restorer)

    @staticmethod
    def _profile(config: ServiceConfig, engine: ContextEngine, fingerprint: str) -> CostProfile:
        if config.profile:
            return CostProfile.from_json(config.profile)
        from actors.profiling import load_or_measure

        return load_or_measure(engine.model, fingerprint, read_bytes_per_s=config.read_bytes_per_s)

    # ---- LLMS Table 1 ----------------------------------------------------------------------------
    def bind(self, app: str) -> str:
        """Register an app; returns its token (shown once, stored hashed)."""
        return self.registry.create_app(app)

    def app_of(self, token: str) -> str:
        return self.registry.app_for_token(token)

    def new_ctx(self, token: str, system_prompt: str | None = None) -> str:
        return self.executor.new_ctx(self.app_of(token), system_prompt)

    def stream(self, token: str, ctx: str, prompt: str, **params):
        """Generator of text deltas; its return value is the `CallOutcome`."""
        return self.executor.call(self.app_of(token), ctx, prompt, **params)

    def call(self, token: str, ctx: str, prompt: str, **params) -> CallOutcome:
        return drain(self.stream(token, ctx, prompt, **params))

    def delete_ctx(self, token: str, ctx: str) -> None:
        self.executor.flush()
        if self.executor.ws_ctx == ctx:
            self.executor.ws_ctx = None
        self.governor.delete_ctx(ctx, self.app_of(token))

    def close(self) -> None:
        self.executor.flush()
        self.registry.close()
