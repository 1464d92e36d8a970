"""The restore algorithm (`actors.restore.restore`) on its own, Ray-free, on the real model: a reader
thread stands in for the IO worker and may read layer group g+1 only once the restore has recomputed
group g's layers (a gate the test holds), so a restore that did not interleave reads and recompute
could not finish; the order of the recorded events shows the interleaving, and the restored K/V
equal a plain recompute's bit for bit. A corrupt file is recomputed instead. (The same cases on Ray are in
tests/actors/test_ray_service.py.)"""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest
import torch

from actors.messages import RestoreRequest
from actors.restore import restore
from actors.swapio import KVSwapIO, LayerGroup, layer_groups
from engine.kvcache import KVCache
from storage import codecs

TOKENS = 80  # 5 chunks of 16
CTX = "c" * 32
LOADED, RECOMPUTED = [0, 2, 4], [1, 3]
GATE_S = 60.0  # the reader gives up after this long waiting for the restore (a deadlock, not a timing)


@pytest.fixture(scope="module")
def prefilled(engine):
    """The context's K/V from a prefill, and what a plain recompute of the planned chunks over the
    other chunks' K/V gives (the restore must reproduce it bit for bit)."""
    ids = engine.tok.encode_document("The lighthouse keeper climbed the stairs every evening. " * 12)[:TOKENS]
    assert len(ids) == TOKENS
    ref = engine.model.new_cache(TOKENS)
    engine.model.forward(ref, ids)
    want = engine.model.new_cache(TOKENS)
    want.reserve(TOKENS)
    want.kv[:, :, :, :TOKENS].copy_(ref.kv[:, :, :, :TOKENS])
    engine.model.recompute(want, ids, RECOMPUTED)
    return ids, ref, want


class Recorder:
    """The model, recording each recomputed layer in the shared event log and opening the gate."""

    def __init__(self, model, log: list, done: dict[int, threading.Event]) -> None:
        self.model, self.log, self.done = model, log, done
        self.cfg = model.cfg

    def recompute_start(self, *a, **kw):
        return self.model.recompute_start(*a, **kw)

    def recompute_layer(self, ws, job, layer):
        self.model.recompute_layer(ws, job, layer)
        self.log.append(("recompute", layer))
        self.done[layer].set()


def gated_groups(io, groups, log, done, corrupt: int | None = None):
    """Layer groups of the loaded chunks, read from their files by a thread of their own; group g+1
    is read only once the last layer of group g has been recomputed (no gate once a file failed: the
    restore then rightly waits for every group before it recomputes)."""
    q: queue.Queue = queue.Queue()

    def reader():
        for g, layers in enumerate(groups):
            if g and corrupt is None and not done[groups[g - 1][-1]].wait(GATE_S):
                q.put(RuntimeError(f"group {g} was never asked for: the restore waited for all reads"))
                return
            t = time.monotonic()
            chunks, failed = {}, {}
            for i, enc in io.store.read_layers(CTX, LOADED, layers):
                if i == corrupt:  # as the store reports a chunk whose checksum fails
                    failed[i] = "chunk_corrupt"
                else:
                    chunks[i] = enc
            log.append(("read", g))
            q.put(LayerGroup(g, layers, chunks, failed, t, time.monotonic(), 0))
        q.put(None)

    threading.Thread(target=reader, daemon=True).start()
    while (item := q.get()) is not None:
        if isinstance(item, BaseException):
            raise item
        yield item


def run(engine, prefilled, tmp_path, corrupt=None):
    ids, ref, _want = prefilled
    io = KVSwapIO(str(tmp_path), "fp")
    io.write(CTX, [(i, codecs.encode(ref.chunk_array(i), "raw", dtype="float32"), 16 * i) for i in LOADED])
    n_layers = engine.model.cfg.n_layers
    groups = layer_groups(n_layers, 6)
    log: list = []
    done = {layer: threading.Event() for layer in range(n_layers)}
    ws = engine.model.new_cache(TOKENS)
    req = RestoreRequest(CTX, TOKENS, np.asarray(ids, np.int32), [], LOADED, RECOMPUTED, groups)
    stats, _ = restore(ws, req, gated_groups(io, groups, log, done, corrupt), model=Recorder(engine.model, log, done))
    return ws, ref, stats, log, groups


def test_reads_and_recompute_interleave_and_the_kv_is_exact(engine, prefilled, tmp_path):
    ws, ref, stats, log, groups = run(engine, prefilled, tmp_path)
    assert stats.loaded == len(LOADED) and stats.recomputed == len(RECOMPUTED) and not stats.failed
    # read g, then g's layers recomputed, then read g+1: in that order, group after group
    want = []
    for g, layers in enumerate(groups):
        want += [("read", g)] + [("recompute", layer) for layer in layers]
    assert log == want
    assert torch.equal(ws.kv[:, :, :, :TOKENS], prefilled[2].kv[:, :, :, :TOKENS])


def test_a_corrupt_file_is_recomputed_with_everything_planned(engine, prefilled, tmp_path):
    ws, ref, stats, log, groups = run(engine, prefilled, tmp_path, corrupt=2)
    assert stats.failed == {2: "chunk_corrupt"} and stats.faults == 1
    assert stats.loaded == len(LOADED) - 1 and stats.recomputed == len(RECOMPUTED) + 1
    n_layers = engine.model.cfg.n_layers  # one full pass once every other chunk was in
    assert log[-n_layers:] == [("recompute", layer) for layer in range(n_layers)]
    assert log[:-n_layers] == [("read", g) for g in range(len(groups))]
    want = engine.model.new_cache(TOKENS)
    want.reserve(TOKENS)
    want.kv[:, :, :, :TOKENS].copy_(ref.kv[:, :, :, :TOKENS])
    engine.model.recompute(want, prefilled[0], sorted(RECOMPUTED + [2]))
    assert torch.equal(ws.kv[:, :, :, :TOKENS], want.kv[:, :, :, :TOKENS])


@pytest.mark.parametrize("pipelined", [True, False], ids=["groups-and-recompute", "whole-chunks"])
def test_a_working_set_that_streams_layers_is_filled_within_its_budget(engine, prefilled, tmp_path, pipelined):
    """A restore into a working set that streams layers (a context larger than its budget) writes each
    streamed layer out of memory once filled: layer groups as their layers are recomputed, whole
    chunks about one layer's slab at a time. Measured from the mapping's pages in memory just before
    each release (what the restore held at its highest), against all layers; the K/V is exact."""
    ids, ref, want = prefilled
    cfg = engine.model.cfg
    io = KVSwapIO(str(tmp_path / "chunks"), "fp")
    load = LOADED if pipelined else sorted(LOADED + RECOMPUTED)
    io.write(CTX, [(i, codecs.encode(ref.chunk_array(i), "raw", dtype="float32"), 16 * i) for i in load])
    ws = KVCache.mapped(cfg, tmp_path / "ws", TOKENS, chunk_tokens=16, dtype=engine.model.dtype)
    held, release = [], ws.pager.release
    ws.pager.release = lambda layers: (held.append(ws.pager.file.resident_bytes()), release(layers))[1]
    groups = layer_groups(cfg.n_layers, 6) if pipelined else [range(cfg.n_layers)]
    items = io.read_groups(CTX, load, groups) if pipelined else io.read_batches(CTX, load, 1)
    req = RestoreRequest(CTX, TOKENS, np.asarray(ids, np.int32), [], load, RECOMPUTED if pipelined else [],
                         groups, resident_layers=2)
    stats, whole = restore(ws, req, items, model=engine.model if pipelined else None)
    assert stats.loaded == len(load) and not stats.failed and whole == []  # nothing kept whole either
    every_layer = cfg.n_layers * 2 * cfg.n_kv_heads * TOKENS * cfg.head_dim * 4
    assert held and max(held) < every_layer / 2, (held, every_layer)
    assert ws.pager.file.resident_bytes() < every_layer / 4  # the two resident layers, about
    assert torch.equal(ws.kv[:, :, :, :TOKENS], (want if pipelined else ref).kv[:, :, :, :TOKENS])


def test_a_bounded_read_ahead_stays_bounded_and_ends_when_its_consumer_stops():
    """`_read_ahead(..., ahead=1)` (a restore into a working set that streams layers): while the
    consumer holds item k the reader has made at most k + 3 items (one queued, one waiting for room);
    a consumer that stops early leaves no reader blocked."""
    from actors.local_restore import _read_ahead

    made = []

    def read():
        for k in range(20):
            made.append(k)
            yield k

    items = _read_ahead(read, ahead=1)
    for k in range(5):
        assert next(items) == k
        assert len(made) <= k + 3, made
    items.close()  # the consumer stops: the reader is unblocked and ends
    assert len(made) < 20
