"""LoRA adapters in the one-process service (`wire_local`): loaded under the adapter root, recorded
and loaded again after a restart, a context bound to one for its life, its K/V restored (from the
pool, from disk, by recompute) under that adapter only, and refusals that change nothing; then the
same on Ray, where that service also checks a prompt streamed under a prefill budget (one service start
for both).

The adapters are written here for the default model's shapes (random A and B on q, v and down), so
the replies of an adapted context differ from the base model's; the reference is the in-process
engine (`ContextEngine`) with the same adapter, never constrained for memory.
"""

from __future__ import annotations

import shutil

import pytest

from actors.service import ServiceConfig, wire_local
from engine.config import EngineConfig
from engine.context import ContextEngine
from bench.model_files import random_adapter
from engine.lora import AdapterError, AdapterSet
from scheduler.pipeline import CostProfile

PROFILE = CostProfile.fit([(1, 0.078), (8, 0.233)], [(3.0e6, 0.018), (14.1e6, 0.032)]).to_json()
SYSTEM = "You are a concise assistant."
PROMPTS = ["Name three rivers.", "Which one is longest?", "Say it again in French."]
LONG = "Summarise this list: " + " ".join(f"item {i} is a {['red', 'blue', 'green'][i % 3]} box," for i in range(120))
"""A prompt whose prefill fits 8 MiB only with its K/V streamed layer by layer (`severe`)."""


@pytest.fixture(scope="module")
def small_engine(engine):
    return ContextEngine(engine.model, engine.tok, EngineConfig(max_context_tokens=512))


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory, engine):
    root = tmp_path_factory.mktemp("adapter-root")
    random_adapter(root / "tutor", engine.model.cfg, seed=1)
    random_adapter(root / "poet", engine.model.cfg, seed=2, rank=4, targets=("k_proj", "o_proj", "up_proj"))
    return root


@pytest.fixture(scope="module")
def reference(small_engine, adapter_root):
    """Replies of three contexts (base, tutor, poet) run in the plain engine, in memory."""
    loaded = AdapterSet(adapter_root, small_engine.model.cfg)
    out = {}
    for name in (None, "tutor", "poet"):
        ctx = small_engine.new_ctx(SYSTEM, adapter=loaded.add(name, name) if name else None)
        out[name] = [small_engine.call(ctx, p, max_tokens=8).token_ids for p in PROMPTS]
        small_engine.delete_ctx(ctx)
    return out


def config(tmp_path, adapter_root, **kw):
    kw.setdefault("max_context_tokens", 512)
    return ServiceConfig(data_dir=str(tmp_path / "data"), adapter_root=str(adapter_root), profile=PROFILE, **kw)


def test_adapted_contexts_answer_as_the_engine_does_under_memory_pressure_and_restarts(
        small_engine, adapter_root, reference, tmp_path):
    assert reference["tutor"] != reference[None] and reference["poet"] != reference[None]  # the adapters matter
    # a pool of a few chunks and the kill policy: every switch recomputes, the rest comes from disk
    svc = wire_local(config(tmp_path, adapter_root, policy="lmk", pool_bytes=1 << 20), engine=small_engine)
    try:
        info = svc.add_adapter("tutor", "tutor")
        assert info["name"] == "tutor" and info["key"].startswith("tutor@") and info["rank"] == 8
        svc.add_adapter("poet", "poet")
        token = svc.bind("app")
        ctxs = {name: svc.new_ctx(token, SYSTEM, adapter=name) for name in (None, "tutor", "poet")}
        assert svc.describe(token, ctxs["tutor"])["adapter"] == "tutor"
        for turn in range(2):
            for name, ctx in ctxs.items():
                got = svc.call(token, ctx, PROMPTS[turn], max_tokens=8)
                assert got.token_ids == reference[name][turn], (name, turn)
        assert svc.parts.governor.stats["killed_contexts"] + svc.parts.governor.stats["recomputed_chunks"] > 0
        with pytest.raises(Exception) as e:
            svc.remove_adapter("tutor")
        assert getattr(e.value, "code", "") == "adapter_in_use"
    finally:
        svc.close()
    # a restart loads the recorded adapters again; the contexts go on under theirs
    svc = wire_local(config(tmp_path, adapter_root), engine=small_engine)
    try:
        assert [a["name"] for a in svc.list_adapters()] == ["poet", "tutor"]
        for name, ctx in ctxs.items():
            assert svc.call(token, ctx, PROMPTS[2], max_tokens=8).token_ids == reference[name][2], name
        svc.parts.governor.drain()
        io = svc.parts.io
        written = {name: io.store.indices(ctx) for name, ctx in ctxs.items()}
        assert written["tutor"], written  # the default policy wrote the contexts switched away from
        tutor = next(a["key"] for a in svc.list_adapters() if a["name"] == "tutor")
        for i in written["tutor"]:  # the records name the adapter; read as the base model's, they fail
            assert io.store.check(ctxs["tutor"], i, deep=False, tag=io.tag(tutor)).header.fingerprint == io.tag(tutor)
        assert io.read(ctxs["tutor"], written["tutor"])[1] == {i: "chunk_fingerprint" for i in written["tutor"]}
        svc.delete_ctx(token, ctxs["poet"])
        svc.remove_adapter("poet")
        assert [a["name"] for a in svc.list_adapters()] == ["tutor"]
    finally:
        svc.close()


def test_a_context_whose_adapter_files_changed_is_refused_not_mixed(small_engine, adapter_root, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(adapter_root / "tutor", root / "tutor")
    svc = wire_local(config(tmp_path, root), engine=small_engine)
    try:
        svc.add_adapter("tutor", "tutor")
        token = svc.bind("app")
        ctx = svc.new_ctx(token, SYSTEM, adapter="tutor")
        svc.call(token, ctx, PROMPTS[0], max_tokens=4)
    finally:
        svc.close()
    random_adapter(root / "tutor", small_engine.model.cfg, seed=9)  # other weights under the same name
    svc = wire_local(config(tmp_path, root), engine=small_engine)
    try:
        assert svc.list_adapters() == []  # not loaded: its files are not the recorded ones
        with pytest.raises(AdapterError) as e:
            svc.call(token, ctx, PROMPTS[1], max_tokens=4)
        assert e.value.code == "adapter_unavailable"
        assert svc.describe(token, ctx)["busy"] is False  # unlocked, nothing appended
    finally:
        svc.close()


def test_refused_adapters_change_nothing(small_engine, adapter_root, tmp_path):
    svc = wire_local(config(tmp_path, adapter_root), engine=small_engine)
    try:
        svc.add_adapter("tutor", "tutor")
        token = svc.bind("app")
        for name, path, code in (("x", "../../etc", "adapter_outside_root"), ("x", "nowhere", "adapter_not_found"),
                                 ("tutor", "poet", "adapter_exists")):
            with pytest.raises(Exception) as e:
                svc.add_adapter(name, path)
            assert getattr(e.value, "code", "") == code
        assert [a["name"] for a in svc.list_adapters()] == ["tutor"]
        with pytest.raises(AdapterError) as e:
            svc.new_ctx(token, SYSTEM, adapter="nobody")
        assert e.value.code == "unknown_adapter" and svc.list_ctx(token) == []
        # an app bound to an adapter: its contexts are computed under it unless they name another
        with pytest.raises(Exception) as e:
            svc.bind("tutored", adapter="poet")  # not loaded
        assert getattr(e.value, "code", "") == "unknown_adapter"
        tutored = svc.bind("tutored", adapter="tutor")
        adapted, plain = svc.new_ctx(tutored, SYSTEM), svc.new_ctx(tutored, SYSTEM, adapter="")
        assert (svc.describe(tutored, adapted)["adapter"], svc.describe(tutored, plain)["adapter"]) == ("tutor", None)
        svc.delete_ctx(tutored, adapted)
        with pytest.raises(Exception) as e:
            svc.remove_adapter("tutor")  # still the app's default
        assert getattr(e.value, "code", "") == "adapter_in_use"
    finally:
        svc.close()


def test_on_ray_the_recompute_worker_recomputes_under_the_adapter_and_into_a_mapped_working_set(
        ray_cluster, engine, adapter_root, reference, tmp_path):
    """The same on the actors, under the kill policy (every switch recomputes, in the recompute worker)
    and a prefill budget. With the budget the executor's working set is a file under `<data_dir>/ws`
    that the worker maps by its path: a long prompt runs streamed and answers as the engine does, the
    context is killed at once, none of its chunks put in the pool, and once another context took the
    working set the worker recomputes it into that file. Then the worker loads the adapter each restore
    request names, and unloads one the node removes."""
    import ray

    from actors.ray_service import wire_ray

    wide = ContextEngine(engine.model, engine.tok, EngineConfig(max_context_tokens=2048))
    first, other = wide.new_ctx(SYSTEM), wide.new_ctx(SYSTEM)
    want = [wide.call(first, LONG, max_tokens=8).token_ids, wide.call(other, "Hi.", max_tokens=4).token_ids,
            wide.call(first, "Thanks.", max_tokens=4).token_ids]
    svc = wire_ray(config(tmp_path, adapter_root, policy="lmk", pool_bytes=1 << 20, max_context_tokens=2048,
                          prefill_budget_bytes=8 << 20), prefix="t-lora")
    ws_dir = tmp_path / "data" / "ws"
    try:
        token = svc.bind("app")
        a, b = svc.new_ctx(token, SYSTEM), svc.new_ctx(token, SYSTEM)
        out = svc.call(token, a, LONG, max_tokens=8)
        assert out.prefill_plan == "severe" and out.streamed_bytes > 0 and out.token_ids == want[0]
        assert list(ws_dir.glob("t-lora-ws-*"))  # the working set's file, mapped by both
        svc.flush()  # after the reply: killed at once, none of its chunks put in the pool (and evicted)
        chunks = svc.describe(token, a)["chunks"]
        assert chunks["resident"] == {} and chunks["to_recompute"] == chunks["total"] > 0, chunks
        stats = ray.get(svc.parts.gov.__ray_call__.remote(lambda actor: dict(actor.gov.stats)))
        assert (stats["killed_contexts"], stats["evictions"]) == (1, 0), stats
        assert svc.call(token, b, "Hi.", max_tokens=4).token_ids == want[1]
        back = svc.call(token, a, "Thanks.", max_tokens=4)
        assert back.restore.recomputed > 0 and back.token_ids == want[2]

        svc.add_adapter("tutor", "tutor")
        svc.add_adapter("poet", "poet")
        ctxs = {name: svc.new_ctx(token, SYSTEM, adapter=name) for name in (None, "tutor", "poet")}
        recomputed = 0
        for turn in range(3):
            for name, ctx in ctxs.items():
                got = svc.call(token, ctx, PROMPTS[turn], max_tokens=8)
                assert got.token_ids == reference[name][turn], (name, turn)
                recomputed += got.restore.recomputed if name else 0
        assert recomputed > 0
        worker = svc.parts.recompute  # it loaded each adapter a restore named
        assert sorted(ray.get(worker.loaded_adapters.remote())) == ["poet", "tutor"]
        svc.delete_ctx(token, ctxs["poet"])
        svc.remove_adapter("poet")  # and unloads it when the node removes it
        assert ray.get(worker.loaded_adapters.remote()) == ["tutor"]
    finally:
        svc.close()
    assert not list(ws_dir.glob("t-lora-ws-*"))  # unlinked at close
