"""The context service on Ray: the memory governor, KV swap/IO worker, recompute worker and model
executor as separate actors exchanging object refs (the user's design card), behind the one front
(`actors.service.ContextService`).

`wire_ray` starts the actors of one node from a `ServiceConfig` (the components' configurations come
from `actors.service.components`, as in one process). The actor bodies are in `actors.ray_actors`.

What this module deliberately does not know: what the actors do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from actors.config import ServiceConfig, openmp_env, prepare_data_dir
from actors.ray_actors import HEALTH_GROUPS, ExecutorActor, GovernorActor, IOActor, RecomputeActor
from actors.ray_predictor import PredictorActor
from actors.ray_stubs import NAMESPACE, ExecutorStub, GovernorStub, PredictorStub, resolve_call_item, resolve_chunks
from actors.messages import KVKey
from actors.service import ContextService, components

MAX_RESTARTS = -1
"""Restarts Ray grants each actor: as many as it fails (a crash loop slows down by
`actors.ray_actors.RESTART_BACKOFF_S`)."""


@dataclass(slots=True)
class RayParts:
    """The actor handles of one node's service."""

    io: Any
    gov: Any
    recompute: Any
    executor: Any
    predictor: Any

    def by_role(self) -> dict[str, Any]:
        """The handles by the name of their role, as errors and readiness replies name them."""
        return {"memory governor": self.gov, "KV swap/IO worker": self.io, "recompute worker": self.recompute,
                "model executor": self.executor, "query predictor": self.predictor}


def _actor(cls):
    """`cls` as a Ray actor class with the service's concurrency groups (`HEALTH_GROUPS`: the probe
    `alive` answers on a thread of its own while a call runs) and its own (`cls.GROUPS`)."""
    return ray.remote(concurrency_groups={**HEALTH_GROUPS, **getattr(cls, "GROUPS", {})})(cls)


def wire_ray(config: ServiceConfig, *, model_path: str | None = None, prefix: str = "llmaas",
             max_restarts: int = MAX_RESTARTS, executor_actor: type = ExecutorActor,
             io_actor: type = IOActor, recompute_actor: type = RecomputeActor) -> ContextService:
    """Start the actors of one node (named `<prefix>-<role>`) and return the front over them once every
    one has started (a first call does not share the cores with the query predictor's start). The
    working set is shared memory, so the executor and recompute worker compute on the CPU.
    `executor_actor`, `io_actor`, `recompute_actor`: those actors' bodies, the service's or
    subclasses (a test's, failing at a chosen step or holding a step until another began)."""
    from engine.config import ModelConfig
    from engine.loader import resolve_model

    resolved = resolve_model(model_path, progress=True)
    model_cfg = ModelConfig.from_hf(json.loads((Path(resolved.directory) / "config.json").read_text()))
    parts = components(config, model_cfg, "float32", device="cpu")
    prepare_data_dir(config.data_dir)
    common = dict(namespace=NAMESPACE, max_restarts=max_restarts, lifetime=None)
    key = KVKey(resolved.fingerprint, parts.engine.weights, kv_format=parts.engine.kv_format)
    io = _actor(io_actor).options(name=f"{prefix}-io", num_cpus=0, **common).remote(
        str(Path(config.data_dir) / "chunks"), key, parts.store,
        config.data_dir, tuning=parts.tuning, resolve=resolve_chunks)
    gov = _actor(GovernorActor).options(name=f"{prefix}-governor", num_cpus=0, **common).remote(
        config, parts, prefix, resolved.fingerprint)
    recompute = _actor(recompute_actor).options(name=f"{prefix}-recompute", num_cpus=1, **common).remote(
        str(resolved.directory), resolved.fingerprint, parts.engine, prefix, 1, parts.tuning, config.adapter_dir())
    executor = _actor(executor_actor).options(name=f"{prefix}-executor", num_cpus=1,
                                              runtime_env=executor_env(parts.tuning), **common).remote(
        config, parts, str(resolved.directory), resolved.fingerprint, prefix)
    ray.get([executor.__ray_ready__.remote(), recompute.__ray_ready__.remote()])
    if not config.profile:
        ray.get(gov.set_profile.remote(ray.get(executor.profile.remote(config.read_bytes_per_s))))
    predictor = _actor(PredictorActor).options(name=f"{prefix}-predictor", num_cpus=0, **common).remote(
        config, str(resolved.directory), key, prefix)
    ray.get(predictor.__ray_ready__.remote())
    return _front(RayParts(io, gov, recompute, executor, predictor), model_name(resolved), config)


def executor_env(tuning) -> dict | None:
    """The executor's `runtime_env`: its OpenMP spin (`Tuning.executor_spin`, `actors.config.openmp_env`),
    or None (the environment of the process that starts it)."""
    env = openmp_env(tuning.executor_spin)
    return {"env_vars": env} if env else None


def _front(parts: RayParts, model_id: str, config: ServiceConfig | None) -> ContextService:
    def close() -> None:
        try:
            ray.get(parts.executor.close.remote())
        finally:
            for h in (parts.predictor, parts.executor, parts.recompute, parts.gov, parts.io):
                ray.kill(h)

    return ContextService(GovernorStub(parts.gov), ExecutorStub(parts.executor), config=config,
                          resolve=resolve_call_item, parts=parts, close=close, model_id=model_id,
                          predictor=PredictorStub(parts.predictor))


def model_name(resolved) -> str:
    """The id clients see for the model (OpenAI `model`): the checkpoint's file or folder name."""
    src = Path(resolved.source)
    return src.stem if src.suffix == ".gguf" else src.name
