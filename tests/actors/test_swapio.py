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


def test_read_groups_yield_each_groups_layers_of_every_chunk_in_turn(tmp_path):
    from actors.swapio import layer_groups

    io = KVSwapIO(str(tmp_path), "fp-test")
    encs = {i: codecs.encode(synthetic_kv(seed=i), "q4") for i in range(3)}
    io.write(KEY, [(i, enc, 16 * i) for i, enc in encs.items()])
    groups = layer_groups(encs[0].shape[0], 3)
    got = list(io.read_groups(KEY, [2, 0, 1], groups))
    assert [g.layers for g in got] == groups and [g.index for g in got] == list(range(len(groups)))
    for g in got:
        assert sorted(g.chunks) == [0, 1, 2] and not g.failed
        for i, enc in g.chunks.items():  # each the same layers as a direct read
            ((_, want),) = io.store.read_layers(KEY, [i], g.layers)
            assert enc.first_layer == g.layers.start and np.array_equal(enc.payload, want.payload)
    assert sum(g.nbytes for g in got) == io.bytes_read
