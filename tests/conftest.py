"""Session-wide fixtures: the default model is loaded once per test session (engine and, as the oracle,
Hugging Face transformers over the same de-quantized weights)."""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


# Test modules that start Ray (they use the `ray_cluster` or `server` fixture). `make test` runs two
# pytest workers (pytest-xdist) and these modules all go to one of them, so that the whole run has one
# Ray cluster and one Serve application; the other worker takes the modules without Ray, a module at a
# time. Collection fails when a module that uses Ray is not listed.
RAY_MODULES = {
    "tests/actors/test_adapters_service.py", "tests/actors/test_kv8_service.py", "tests/actors/test_ray_service.py",
    "tests/deploy/test_adapters_http.py", "tests/deploy/test_cli_remote.py", "tests/deploy/test_http.py",
    "tests/deploy/test_long_calls.py", "tests/deploy/test_metrics.py", "tests/deploy/test_openai.py",
    "tests/deploy/test_rag_http.py",
}

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one torch thread per pytest worker (and per Ray actor it starts, but the executor, whose calls take
    # every CPU as when served): two workers with a 2-thread OpenMP team each on 2 cores spin against
    # each other
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Modules that need no Ray run first, then those that start Ray actors, then those of the session's
    Serve application (so `restart_ray` comes before it), in collection order within each group. Whole
    modules move, so module fixtures are made once. In one process this keeps an idle Ray (about a
    tenth of a 2-core machine: GCS, raylet, Serve's controller, the actors' heartbeats) off the model
    tests; in two workers the Ray modules' worker runs them in this order."""

    module_items: dict = {}
    for item in items:
        module_items.setdefault(item.module, []).append(item)
    group = {}
    for module, its in module_items.items():
        names = {n for item in its for n in item.fixturenames}
        group[module] = 2 if "server" in names else 1 if "ray_cluster" in names else 0
    order = sorted(module_items, key=group.__getitem__)  # stable: collection order within a group
    items[:] = [item for module in order for item in module_items[module]]
    unlisted = {module_items[m][0].nodeid.split("::", 1)[0] for m in order if group[m] > 0} - RAY_MODULES
    if unlisted:  # two workers would start a Ray each
        raise pytest.UsageError(f"add {sorted(unlisted)} to RAY_MODULES in tests/conftest.py: they use Ray")


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: unknown where it is not installed
def pytest_xdist_make_scheduler(config, log):
    """Scopes of pytest-xdist's scheduling: every Ray module in one ("ray"), each other module its own."""
    from xdist.scheduler import LoadScopeScheduling

    class OneRayWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "ray" if path in RAY_MODULES else path

    return OneRayWorker(config, log)


@pytest.fixture(scope="session")
def resolved_model():
    from engine.loader import resolve_model

    return resolve_model(progress=False)


@pytest.fixture(scope="session")
def engine(resolved_model):
    """The in-process context engine on the default model (float32, CPU unless CUDA is present)."""
    from engine.chat import ChatTokenizer
    from engine.context import ContextEngine
    from engine.model import Transformer

    model = Transformer.from_directory(resolved_model.directory, fingerprint=resolved_model.fingerprint)
    return ContextEngine(model, ChatTokenizer(resolved_model.directory))


@pytest.fixture(scope="session")
def hf_model(resolved_model, engine):
    """transformers' Llama on the same weights, as the correctness oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(resolved_model.directory), dtype=torch.float32)
    return m.to(engine.model.device).eval()


@pytest.fixture(scope="session")
def embedder():
    """all-MiniLM-L6-v2 (engine.embed), loaded once per session."""
    from engine.embed import Embedder

    return Embedder()


@pytest.fixture(scope="module")
def private_model_cache(tmp_path_factory):
    """A model cache of the module's own (`LLMAAS_CACHE_DIR`), for modules that convert checkpoints
    they wrote themselves: their conversions never pile up in the user's cache."""
    old = os.environ.get("LLMAAS_CACHE_DIR")
    os.environ["LLMAAS_CACHE_DIR"] = str(tmp_path_factory.mktemp("model-cache"))
    yield
    if old is None:
        os.environ.pop("LLMAAS_CACHE_DIR")
    else:
        os.environ["LLMAAS_CACHE_DIR"] = old


SAMPLE_TEXT = (
    "The Python reference manual describes the syntax and core semantics of the language. It is terse, "
    "but attempts to be exact and complete. The semantics of non-essential built-in object types and of "
    "the built-in functions and modules are described in the library reference. For an informal "
    "introduction to the language, see the tutorial. For C or C++ programmers, two additional manuals "
    "exist: extending and embedding describes how to write extension modules, and the API reference "
    "describes the interfaces available to extension writers in detail."
)


@pytest.fixture(scope="session")
def real_kv(engine):
    """Real K/V of the default model over a real English passage: float32 `[L, 2, Hkv, T, D]`, T = 96."""
    import numpy as np

    ids = engine.tok.encode_document(SAMPLE_TEXT)[:96]
    assert len(ids) == 96
    cache = engine.model.new_cache(96)
    engine.model.forward(cache, ids)
    kv = np.concatenate([cache.export_chunk(i) for i in range(cache.n_chunks)], axis=3)
    return np.ascontiguousarray(kv, dtype=np.float32)


# Four logical CPUs: the session's Serve application holds two (executor, recompute worker) while other
# tests start their own actors; each actor still runs one torch thread.
RAY_INIT = dict(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)


RESTART_WAIT_S = "600"
"""`LLMAAS_RESTART_WAIT_S` in the tests' Ray: a call waits this long for an actor the test killed. A
restart loads the model again, which took over the default minute on 2 cores beside two busy
processes; the tests wait for the restart, not for a time."""


def _init_ray(ray) -> None:
    """`ray.init` as the tests start it: `RAY_INIT`, the system settings and Serve proxy timeouts `llmaas
    serve` starts Ray with, and `RESTART_WAIT_S` (the actors inherit this process's environment)."""
    from actors.ray_actors import RAY_SYSTEM_CONFIG
    from deploy.settings import set_serve_timeouts

    set_serve_timeouts()
    os.environ.setdefault("LLMAAS_RESTART_WAIT_S", RESTART_WAIT_S)
    ray.init(**RAY_INIT, _system_config=RAY_SYSTEM_CONFIG)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray for the whole test session (no dashboard)."""
    import ray

    if not ray.is_initialized():
        _init_ray(ray)
    yield ray
    ray.shutdown()


def restart_ray() -> None:
    """Stop the session's local Ray (GCS, raylet, object store, every actor) and start a new one, for
    the test that contexts outlive a full Ray restart. Refused once the session's Serve application
    runs (it would not survive); the default test order runs tests/actors before tests/deploy."""
    import ray

    names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    if "SERVE_CONTROLLER_ACTOR" in names:
        pytest.fail("restart_ray() would stop the session's Serve application; run tests/actors first")
    node = ray.get_runtime_context().get_node_id()
    ray.shutdown()
    _init_ray(ray)
    assert ray.get_runtime_context().get_node_id() != node  # a new cluster, not a reconnect
