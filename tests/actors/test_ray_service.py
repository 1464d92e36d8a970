"""The context service as Ray actors on one local Ray: lossless equality, persistence across a full Ray
restart, the fault primitive, and the swap-recompute pipeline overlapping IO with recompute."""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from pathlib import Path

import pytest
import ray

from actors.service import ServiceConfig, components
from engine.config import EngineConfig, ModelConfig
from engine.context import ContextEngine
from scheduler.pipeline import CostProfile
from tests.conftest import restart_ray

PROMPTS = [
    "Describe a lighthouse at night in two sentences.",
    "List three uses of copper.",
    "Why do cats purr? Answer briefly.",
    "Name a famous bridge and its city.",
]
FOLLOW = ["Now say it in fewer words.", "Which one is most common?", "Is that always true?", "How old is it?"]
LAST = "Thank you. Summarise our talk in five words."


@pytest.fixture(scope="module")
def reference(engine):
    e = ContextEngine(engine.model, engine.tok, EngineConfig(max_context_tokens=512))
    ctxs = [e.new_ctx("You are terse.") for _ in PROMPTS]
    out = [[e.call(c, p, max_tokens=8).token_ids for c, p in zip(ctxs, PROMPTS)]]
    out.append([e.call(c, p, max_tokens=8).token_ids for c, p in zip(ctxs, FOLLOW)])
    out.append([e.call(c, LAST, max_tokens=8).token_ids for c in ctxs])
    return out


def start(tmp, policy, prefix, actors=None, **kw):
    from actors.ray_service import wire_ray

    kw.setdefault("profile", CostProfile.fit([(1, 0.078), (8, 0.233)], [(3.0e6, 0.018), (14.1e6, 0.032)]).to_json())
    cfg = ServiceConfig(data_dir=str(tmp), policy=policy, max_context_tokens=512, **kw)
    return wire_ray(cfg, prefix=prefix, **(actors or {}))


def test_lossless_on_ray_survives_executor_kills_a_full_ray_restart_and_lost_files(ray_cluster, reference,
                                                                                     resolved_model, tmp_path):
    """One service through the faults that need a whole executor (one start for all: each costs seconds).
    Lossless replies equal the engine's with chunks read back from disk. The executor killed while it
    decodes a reply: the call fails with `CallInterruptedError`, Ray restarts the executor, the governor
    drops the dead process's locks and resident chunks (objects it owned) and rebuilds from the registry;
    the interrupted turn leaves no trace, nothing stays locked, nothing is read from a dead object. Its
    process ending between a call's commit and its reply (the fault injected at that step): the call
    sent again with the same request id gets the committed turn, appended once. Killed a third time, it
    answers again (before, the third failure was permanent), and each restart is counted. Then a full
    Ray restart with a context's oldest pack lost meanwhile: the fault primitive recomputes its chunks
    from their token ids."""
    from actors.messages import CallInterruptedError
    from actors.ray_actors import ExecutorActor

    marker = tmp_path / "died-once"  # present: the executor lives on past its commits

    class DiesAfterCommit(ExecutorActor):
        """Ends its process right after the governor committed a call's turn, before the reply leaves,
        once the test removed `marker` (and makes it again, so only once)."""

        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, **kw)
            schedule = self.ex._schedule_write_back  # the step right after the commit

            def die_once(*args, **kw):
                if not marker.exists():
                    marker.write_text("")
                    os._exit(1)
                schedule(*args, **kw)

            self.ex._schedule_write_back = die_once

    marker.write_text("")
    svc = start(tmp_path / "data", "vllm-s", "t-lossless", pool_bytes=3 << 20,  # about 1 of 4 contexts raw
                actors={"executor_actor": DiesAfterCommit})
    tok = svc.bind("app")
    ctxs = [svc.new_ctx(tok, "You are terse.") for _ in PROMPTS]
    more = [svc.new_ctx(tok, "You are terse.") for _ in range(2)]  # first turns after the later kills
    assert [svc.call(tok, c, p, max_tokens=8).token_ids for c, p in zip(ctxs, PROMPTS)] == reference[0]
    # both wirings build their components from the same function: the governor actor got what the
    # in-process wiring gives the governor for the same configuration and model (30 layers, float32)
    got = ray.get(svc.parts.gov.components.remote())
    model_cfg = ModelConfig.from_hf(json.loads((Path(resolved_model.directory) / "config.json").read_text()))
    want = components(svc.config, model_cfg, "float32")
    assert (got.governor, got.registry, got.store) == (want.governor, want.registry, want.store)
    assert got.governor.pipeline_groups == 5 and got.governor.dtype == "float32"

    # the executor killed mid-call
    svc.flush()
    held = ray.get(svc.parts.gov.held_nbytes.remote())
    assert held > 0, "nothing resident: the test would not cover the dead executor's objects"
    gen = svc.stream(tok, ctxs[0], "Tell me a very long story about a lighthouse keeper.", max_tokens=400)
    next(gen)  # the executor is decoding this call
    ray_cluster.kill(svc.parts.executor, no_restart=False)
    with pytest.raises(CallInterruptedError):
        for _ in gen:
            pass
    outs = [svc.call(tok, c, p, max_tokens=8) for c, p in zip(ctxs, FOLLOW)]
    assert [o.token_ids for o in outs] == reference[1]
    assert sum(o.restore.loaded for o in outs) > 0  # chunks really came back from disk
    assert all(o.switch_ms > 0 for o in outs)
    assert outs[0].restore.resident == 0  # nothing came from the old objects
    # the executor holds the refs of exactly the chunks the governor counts resident (none leaked)
    held = ray.get(svc.parts.executor.held_refs.remote())
    assert held == len(ray.get(svc.parts.gov.held_handles.remote())) and held > 0
    # the governor's and IO worker's processes never imported torch (about 180 MiB of memory each)
    for role in ("gov", "io"):
        assert not ray.get(getattr(svc.parts, role).__ray_call__.remote(lambda _actor: "torch" in sys.modules)), role

    # the executor's process ends right after the governor committed a call's turn, before the reply
    # leaves: the client sees the call interrupted and sends it again with the same request id; it
    # gets the committed turn, appended once
    c = more[0]
    before = svc.describe(tok, c)["turns"]
    marker.unlink()
    with pytest.raises(CallInterruptedError):
        svc.call(tok, c, PROMPTS[1], request_id="r-1", max_tokens=8)
    assert marker.exists()  # it died where it should, and only once
    committed = svc.describe(tok, c)["turns"]
    assert len(committed) == len(before) + 2  # the turn was durable before the reply
    again = svc.call(tok, c, PROMPTS[1], request_id="r-1", max_tokens=8)
    assert svc.describe(tok, c)["turns"] == committed
    assert again.text == committed[-1]["text"] and again.completion_tokens > 0
    svc.call(tok, c, FOLLOW[1], request_id="r-2", max_tokens=8)  # another id: another turn
    assert len(svc.describe(tok, c)["turns"]) == len(committed) + 2

    # killed once more, between calls: the third restart (before, the third failure was permanent)
    ray_cluster.kill(svc.parts.executor, no_restart=False)
    for _attempt in range(3):  # a call may still meet the dying process; the next waits for the new one
        try:
            out = svc.call(tok, more[1], PROMPTS[2], max_tokens=8)
            break
        except CallInterruptedError:
            continue
    else:
        pytest.fail("no answer after the third restart")
    assert out.token_ids == reference[0][2]  # a first turn: exactly the engine's
    assert len((tmp_path / "data" / "restarts" / "executor").read_text().split()) == 3
    svc.close()

    # a full Ray restart (nothing of the old cluster survives: actors, object store, GCS), and the
    # oldest pack of the first context lost meanwhile
    restart_ray()
    files = sorted((tmp_path / "data" / "chunks" / ctxs[0]).glob("*.kvp"))
    assert files
    files[0].unlink()
    svc = start(tmp_path / "data", "vllm-s", "t-lossless2", pool_bytes=3 << 20)
    outs = [svc.call(tok, c, LAST, max_tokens=8) for c in ctxs]
    assert [o.token_ids for o in outs] == reference[2]
    assert outs[0].restore.recomputed >= 1 or outs[0].restore.faults >= 1
    svc.close()


def test_corrupt_loads_beside_resident_chunks_are_recomputed(ray_cluster, reference, tmp_path):
    """The Fault primitive in a restore that also decodes resident chunks and loads others: the files
    of the loaded ones are corrupt, so they are recomputed after the resident ones are in (recompute
    attends to them); the replies are still exactly the engine's. The executor and the recompute worker
    stream their weights beyond 32 MiB of resident fragments (weights_resident_bytes), which changes no
    value, and the executor's metrics count what it read."""
    # ~9 raw chunks: 4 contexts don't fit
    svc = start(tmp_path, "vllm-s", "t-mixed", pool_bytes=7 << 20, weights_resident_bytes=32 << 20)
    tok = svc.bind("app")
    ctxs = [svc.new_ctx(tok, "You are terse.") for _ in PROMPTS]
    assert [svc.call(tok, c, p, max_tokens=8).token_ids for c, p in zip(ctxs, PROMPTS)] == reference[0]
    mixed = []
    for k, c in enumerate(ctxs):
        svc.flush()  # the last write-back done: nothing rewrites the files corrupted here
        for f in (tmp_path / "chunks" / c).glob("*.kvp"):  # a payload byte of each pack's last chunk
            b = bytearray(f.read_bytes())
            b[-100] ^= 0xFF
            f.write_bytes(bytes(b))
        o = svc.call(tok, c, FOLLOW[k], max_tokens=8)
        assert o.token_ids == reference[1][k]
        r = o.restore
        assert r.recomputed >= r.faults
        mixed.append(r.resident >= 1 and r.faults >= 1)
        # the executor de-quantized every chunk that came back whole, each once; the worker recomputed
        decoded = [i for what, i, *_ in r.timeline if what == "decode"]
        assert len(decoded) == len(set(decoded)) == r.resident + r.loaded
        assert not set(decoded) & set(int(i) for i in r.failed)
    assert any(mixed), "no restore had both resident chunks and a failing load"
    [target] = json.loads(next((tmp_path / "metrics").glob("executor-*.json")).read_text())[0]["targets"]
    scraped = urllib.request.urlopen(f"http://{target}/metrics", timeout=30).read().decode()
    series = dict(line.rsplit(" ", 1) for line in scraped.splitlines()
                  if line.startswith(("llmaas_weights", "llmaas_lookup")))
    assert float(series["llmaas_weights_streamed_bytes_total"]) > 0
    assert 0 < float(series['llmaas_weights_bytes{part="resident"}']) <= 32 << 20
    # lookup decoding is on by default: what it guessed and kept in these greedy replies
    guessed, kept = (float(series[f'llmaas_lookup_tokens_total{{kind="{k}"}}']) for k in ("guessed", "kept"))
    assert 0 <= kept <= guessed
    svc.close()


def gated_pipeline_actors(gate: Path) -> dict:
    """The IO worker and recompute worker of `wire_ray`, with a gate between them the test holds by
    files: the recompute worker leaves `gate/layer-<l>` as it begins recomputing layer `l`, and the IO
    worker ends the read of a layer group that is not the first only once some layer before the group
    has begun (or after 60 s: a restore that read every group before recomputing then fails the check
    below rather than hanging). So a pipelined restore records the overlap whatever the host's speed."""
    import time

    from actors.ray_actors import IOActor, RecomputeActor

    class MarksLayers(RecomputeActor):
        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, **kw)
            recompute_layer = self.model.recompute_layer

            def marked(ws, job, layer):
                (gate / f"layer-{layer}").touch()
                return recompute_layer(ws, job, layer)

            self.model.recompute_layer = marked

    class GatedReads(IOActor):
        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, **kw)
            read_layers = self.store.read_layers

            def gated(key, indices, layers, tag=None):
                out = list(read_layers(key, indices, layers, tag=tag))
                if layers.start == 0:  # a new restore: the marks of the last one are void
                    for f in gate.glob("layer-*"):
                        f.unlink()
                else:
                    give_up = time.monotonic() + 60
                    while not any((gate / f"layer-{lay}").exists() for lay in range(layers.start)):
                        if time.monotonic() > give_up:
                            break
                        time.sleep(0.002)
                return iter(out)

            self.store.read_layers = gated

    gate.mkdir(exist_ok=True)
    return {"io_actor": GatedReads, "recompute_actor": MarksLayers}


def test_pipeline_overlaps_io_and_recompute_with_slow_storage(ray_cluster, tmp_path):
    # slow storage (8 MB/s) and a profile that makes recomputing some chunks cheaper than reading
    profile = CostProfile.fit([(0, 0.0), (10, 0.15)], [(0, 0.0), (8e6, 1.0)]).to_json()
    # the reads of a group end only once the recompute of an earlier layer began (`gated_pipeline_actors`):
    # the overlap is checked by the order of recorded events, never by how fast either side ran; a
    # hand-over's cost is given (0.5 ms, as measured on an idle 2-core VM), not measured at start, where
    # a busy host made it large enough for one group of every layer
    svc = start(tmp_path / "data", "llms", "t-pipe", pool_bytes=1 << 20, read_bytes_per_s=8e6, read_burst_bytes=0,
                profile=profile, per_ref_s=5e-4, actors=gated_pipeline_actors(tmp_path / "gate"))
    tok = svc.bind("app")
    ctxs = [svc.new_ctx(tok, "You are terse.") for _ in PROMPTS]
    for c, p in zip(ctxs, PROMPTS):
        svc.call(tok, c, p + " " + p, max_tokens=4)
    overlapped, sizes = [], []
    for c, p in zip(ctxs, FOLLOW):
        svc.flush()  # an idle gap: the writes ahead of time end and the pool is back within its 1 MB
        o = svc.call(tok, c, p, max_tokens=4)
        r = o.restore
        if r.loaded and r.recomputed:
            assert r.loaded_bytes > 0
            tl = r.timeline
            reads = {g: (s, e) for what, g, s, e in tl if what == "read"}
            recs = {l: s for what, l, s, e in tl if what == "recompute" and l >= 0}
            size = next(n for what, n, _s, _e in tl if what == "group_layers")
            sizes.append(size)
            group_of = lambda layer, k=size: layer // k  # noqa: E731
            overlapped += [l for l, s in recs.items() if group_of(l) + 1 in reads and s < reads[group_of(l) + 1][1]]
    assert overlapped, "no restore recomputed layer l before the read of layer l+1's group finished"
    # groups were sized from the hand-over's cost and the slow reads: several per restore
    assert sizes and all(1 <= k < 30 for k in sizes), sizes

    # actors killed between calls come back (max_restarts) and rebuild from the registry and files
    ray_cluster.kill(svc.parts.gov, no_restart=False)
    ray_cluster.kill(svc.parts.recompute, no_restart=False)
    outs = [svc.call(tok, c, "One more word?", max_tokens=3) for c in ctxs]
    assert all(o.completion_tokens >= 1 for o in outs)
    assert sum(o.restore.loaded + o.restore.recomputed for o in outs) > 0
    svc.close()


def test_actor_killed_mid_restore_is_retried_exactly(ray_cluster, reference, tmp_path):
    """Each actor other than the executor killed while a context is read back (storage throttled to
    1 MB/s, so the restore takes seconds; one victim per follow-up call): Ray restarts it, the
    executor hands its part over again (recompute worker, IO worker) or asks the new governor, which
    rebuilds its books from the registry; the call completes with the right answer, and so do the
    calls after it. Before, a dead recompute worker's resource tracker unlinked the executor's
    working-set segment and the restarted worker could not attach. The recompute worker's restore
    has a corrupt file, so that it gets work (recomputing it) after it was killed; the call without
    a victim shows the executor de-quantizing loaded chunks while later ones are still read."""
    import signal
    import threading
    import time

    victims = ("recompute", "io", "gov")
    svc = start(tmp_path, "vllm-s", "t-kill", pool_bytes=1 << 20, read_bytes_per_s=1e6, read_burst_bytes=16 << 10)
    tok = svc.bind("app")
    ctxs = [svc.new_ctx(tok, "You are terse.") for _ in PROMPTS]
    assert [svc.call(tok, c, p, max_tokens=8).token_ids for c, p in zip(ctxs, PROMPTS)] == reference[0]
    outs = []
    for k, (c, p) in enumerate(zip(ctxs, FOLLOW)):
        if k >= len(victims):
            outs.append(svc.call(tok, c, p, max_tokens=8))
            continue
        svc.flush()
        if victims[k] == "recompute":  # a payload byte of the context's last pack: a fault to recompute
            f = sorted((tmp_path / "chunks" / c).glob("*.kvp"))[-1]
            b = bytearray(f.read_bytes())
            b[-100] ^= 0xFF
            f.write_bytes(bytes(b))
        handle = getattr(svc.parts, victims[k])
        pid = lambda h=handle: ray.get(h.__ray_call__.remote(lambda self: os.getpid()))  # noqa: E731
        before = pid()
        done: dict = {}
        call = threading.Thread(target=lambda: done.update(o=svc.call(tok, c, p, max_tokens=8)))
        call.start()
        # the gate: the call holds its context at the governor (its restore has begun, and at 1 MB/s
        # lasts seconds); then the victim dies, as under the OOM killer
        deadline = time.monotonic() + 120
        while not svc.governor.describe(c, "app")["busy"]:
            assert call.is_alive() and time.monotonic() < deadline, victims[k]
            time.sleep(0.01)
        assert call.is_alive(), victims[k]  # the kill lands inside the call
        os.kill(before, signal.SIGKILL)
        call.join()
        o = done["o"]
        assert o.restore.loaded >= 1, victims[k]
        assert pid() != before, victims[k]  # and restarted
        assert o.restore.faults >= (victims[k] == "recompute"), victims[k]
        outs.append(o)
    assert [x.token_ids for x in outs] == reference[1]
    # 1 MB/s: a raw chunk a batch, each read in ~0.7 s; a decode that starts after the first batch is
    # read (so of a loaded chunk) and before the last one is must have overlapped the reads
    tl = outs[-1].restore.timeline
    reads = sorted(b for what, _k, _a, b in tl if what == "read")
    assert len(reads) >= 2, tl
    assert any(reads[0] <= a < reads[-1] for what, _i, a, _b in tl if what == "decode"), \
        "no loaded chunk was de-quantized while later ones were still read"
    svc.close()


def test_resident_chunks_are_put_a_few_to_an_object_and_repacked_past_the_holes(ray_cluster):
    """`ResidentRefs`: the chunks of one `put` share objects; once released chunks leave holes over
    `MAX_HOLES` of the resident bytes, the next `put` puts the sparsest objects' resident chunks again
    and hands their new handles to the governor; every chunk still reads what was put."""
    import numpy as np

    from actors.ray_stubs import ResidentRefs, resolve_chunks
    from storage import codecs

    def chunk(seed):
        return codecs.encode(np.random.default_rng(seed).standard_normal((2, 2, 1, 4, 8), dtype=np.float32), "q8",
                             dtype="float32")

    refs, rehomed = ResidentRefs(), []
    refs.rehome = rehomed.extend
    assert refs.object_chunks >= 4
    a = refs.put([chunk(s) for s in range(4)])
    b = refs.put([chunk(s) for s in range(4, 8)])
    assert len({h.ref for h in a}) == 1 and len({h.ref for h in b}) == 1 and a[0].ref != b[0].ref
    assert rehomed == []
    refs.drop_released([h.key for h in a[:3]], "epoch")  # a keeps one of four: its holes are 3 chunks
    c = refs.put([chunk(8)])
    assert [h.key for h in rehomed] == [a[3].key]  # a's last chunk moved in with c's
    assert rehomed[0].ref == c[0].ref and refs.held[a[3].key] == rehomed[0]
    live = [refs.held[k] for k in sorted(refs.held)]
    got = resolve_chunks(live)
    want = [chunk(s) for s in (3, 4, 5, 6, 7, 8)]
    assert all(np.array_equal(g.payload, w.payload) for g, w in zip(got, want))
    assert len({h.ref.binary() for h in live}) == 2  # b, and c with a's last chunk: no holes left
