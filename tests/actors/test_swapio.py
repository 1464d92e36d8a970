"""The KV swap/IO worker's batched reads (what a Ray executor's restore streams in), Ray-free."""

from __future__ import annotations

import numpy as np
import pytest

from actors.swapio import KVSwapIO
from storage import codecs
from tests.storage.helpers import synthetic_kv

KEY = "0123456789abcdef0123456789abcdef"


def test_read_batches_yields_every_chunk_once_in_order_and_reports_bad_files(tmp_path):
    io = KVSwapIO(str(tmp_path), "fp-test")
    encs = {i: codecs.encode(synthetic_kv(seed=i), "q4") for i in range(7)}
    io.write(KEY, [(i, enc, 16 * i) for i, enc in encs.items()])
    pack = sorted(tmp_path.glob(f"{KEY}/*.kvp"))[-1]  # one payload byte of the last chunk flipped
    b = bytearray(pack.read_bytes())
    b[-100] ^= 0xFF
    pack.write_bytes(bytes(b))

    batches = list(io.read_batches(KEY, [5, 0, 6, 1, 2, 3, 4], 3))
    assert [bt.index for bt in batches] == list(range(len(batches)))
    got = [i for bt in batches for i, _ in bt.chunks]
    assert got == [5, 0, 1, 2, 3, 4]  # in the order asked, the unreadable one left out
    assert all(len(bt.chunks) <= 3 for bt in batches) and len(batches[0].chunks) == 3
    assert batches[-1].failed == {6: "chunk_corrupt"}  # the failures so far travel with every batch
    assert all(bt.read_start <= bt.read_end for bt in batches)
    for bt in batches:
        for i, enc in bt.chunks:
            assert np.array_equal(enc.payload, encs[i].payload)
    assert io.bytes_read == sum(encs[i].nbytes for i in got)
    with pytest.raises(ValueError):
        next(io.read_batches(KEY, [0], 0))


def test_ping_payload_yields_one_stamped_item_of_the_size_asked(tmp_path):
    import time

    io = KVSwapIO(str(tmp_path), "fp-test")
    before = time.monotonic()
    items = list(io.ping_payload(3000))
    assert len(items) == 1
    stamp, payload = items[0]
    assert before <= stamp <= time.monotonic()
    assert payload.nbytes == 3000 and payload.dtype == np.uint8 and payload.all()


def test_read_batches_stages_what_fits_in_the_consumers_shared_memory_and_hands_the_rest_over_whole(tmp_path):
    from multiprocessing import resource_tracker, shared_memory

    from actors.swapio import STAGING_ALIGN, StagedChunk

    def unlink(seg):  # one process plays both sides here: the worker's attach undid the creator's
        resource_tracker.register(seg._name, "shared_memory")  # tracker registration
        seg.close()
        seg.unlink()

    io = KVSwapIO(str(tmp_path), "fp-test")
    encs = {i: codecs.encode(synthetic_kv(seed=i), "q8") for i in range(5)}
    io.write(KEY, [(i, enc, 16 * i) for i, enc in encs.items()])
    n = encs[0].nbytes
    offset, size = 4096, 3 * n + 2 * STAGING_ALIGN  # room for three aligned payloads, not four
    seg = shared_memory.SharedMemory(create=True, size=offset + size + 100)
    try:
        area = np.ndarray(size, np.uint8, buffer=seg.buf, offset=offset)
        before = bytes(seg.buf[:offset])
        batches = list(io.read_batches(KEY, [3, 0, 4, 1, 2], 2, staging=(seg.name, offset, size)))
        got = [(i, c) for bt in batches for i, c in bt.chunks]
        assert [i for i, _ in got] == [3, 0, 4, 1, 2]
        staged = [c for _, c in got if isinstance(c, StagedChunk)]
        assert len(staged) == 3 and all(isinstance(c, codecs.EncodedChunk) for _, c in got[3:])
        ends = [(c.offset, c.offset + c.nbytes) for c in staged]
        assert all(a % STAGING_ALIGN == 0 for a, _ in ends)
        assert all(b1 <= a2 for (_, b1), (a2, _) in zip(ends, ends[1:])) and ends[-1][1] <= size
        for i, c in got:
            enc = c.take(area) if isinstance(c, StagedChunk) else c
            assert (enc.level, enc.shape, enc.dtype) == (encs[i].level, encs[i].shape, encs[i].dtype)
            assert np.array_equal(enc.payload, encs[i].payload)
            assert np.array_equal(codecs.decode(enc), codecs.decode(encs[i]))
        assert bytes(seg.buf[:offset]) == before  # nothing written outside the range given
        with pytest.raises(ValueError, match="outside segment"):
            next(io.read_batches(KEY, [0], 1, staging=(seg.name, offset, seg.size)))
    finally:
        unlink(seg)
    # a consumer restarted with a new segment: the worker maps that one
    seg2 = shared_memory.SharedMemory(create=True, size=2 * n)
    try:
        (bt,) = io.read_batches(KEY, [2], 1, staging=(seg2.name, 0, 2 * n))
        ((i, c),) = bt.chunks
        assert isinstance(c, StagedChunk)
        assert np.array_equal(c.take(np.ndarray(2 * n, np.uint8, buffer=seg2.buf)).payload, encs[2].payload)
    finally:
        unlink(seg2)


def test_read_groups_stage_each_groups_layers_in_turn_and_the_worker_takes_them_back(tmp_path):
    from multiprocessing import resource_tracker, shared_memory

    from actors.recompute import _unstaged_group
    from actors.swapio import StagedChunk, layer_groups

    io = KVSwapIO(str(tmp_path), "fp-test")
    encs = {i: codecs.encode(synthetic_kv(seed=i), "q4") for i in range(3)}
    io.write(KEY, [(i, enc, 16 * i) for i, enc in encs.items()])
    n_layers = encs[0].shape[0]
    groups = layer_groups(n_layers, 3)
    seg = shared_memory.SharedMemory(create=True, size=1 << 20)
    try:
        area = np.ndarray(seg.size, np.uint8, buffer=seg.buf)
        got = list(io.read_groups(KEY, [2, 0, 1], groups, staging=(seg.name, 0, seg.size)))
        assert [g.layers for g in got] == groups
        staged = [0]
        offsets = []
        for g in got:
            assert all(isinstance(c, StagedChunk) for c in g.chunks.values())
            offsets += [c.offset for c in g.chunks.values()]
            back = _unstaged_group(g, area, staged)
            for i, enc in back.chunks.items():  # each the same layers as a direct read
                ((_, want),) = io.store.read_layers(KEY, [i], g.layers)
                assert enc.first_layer == g.layers.start and np.array_equal(enc.payload, want.payload)
        assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)  # never overwritten
        assert staged[0] == sum(g.nbytes for g in got) == io.bytes_read
    finally:
        resource_tracker.register(seg._name, "shared_memory")  # undone by the worker's attach
        seg.close()
        seg.unlink()


def test_writes_ahead_of_time_wait_while_a_restore_runs_and_writes_on_demand_do_not(tmp_path, monkeypatch):
    import actors.swapio as swapio

    monkeypatch.setattr(swapio, "HOLD_MAX_S", 120.0)  # only the restore's end releases it here
    io = KVSwapIO(str(tmp_path), "fp-test")
    encs = {i: codecs.encode(synthetic_kv(seed=i), "q8") for i in range(4)}
    io.hold_writes(True)  # a restore begins
    ahead = io.write_async(KEY, [(i, encs[i], 16 * i) for i in (0, 1)])
    now = io.write(KEY, [(2, encs[2], 32)])  # on demand: goes on
    assert len(now) == 1 and not ahead.done()
    assert sorted(io.read(KEY, [0, 1, 2])[0]) == [2]  # the held write has not started
    io.hold_writes(False)  # the restore ends
    assert len(ahead.result(timeout=120)) == 2
    got, failed = io.read(KEY, [0, 1, 2])
    assert sorted(got) == [0, 1, 2] and not failed
