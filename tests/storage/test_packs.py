"""Pack files: one pack per write-back, generations, deletion markers, compaction, damage kept local."""

from __future__ import annotations

import os

import numpy as np
import pytest

from storage import chunkformat as fmt
from storage import codecs
from storage.chunkstore import ChunkStore, ChunkStoreConfig
from storage.errors import ChunkNotFoundError, CorruptChunkError, StorageError
from storage.fileops import FileOps
from tests.storage.helpers import read_all, read_one, synthetic_kv

KEY = "00112233445566778899aabbccddeeff"
FP = "pack-test-model"
SMALL = (3, 2, 1, 16, 8)


def encs(n: int, level: str = "q8", seed: int = 0) -> list[codecs.EncodedChunk]:
    return [codecs.encode(synthetic_kv(SMALL, seed=seed + i), level) for i in range(n)]


def folder(store: ChunkStore) -> list[str]:
    return sorted(os.listdir(os.path.join(store.root, KEY)))


def reopen(store: ChunkStore, **kw) -> ChunkStore:
    return ChunkStore(store.root, kw.get("config", store.config), fingerprint=FP)


def same(a: codecs.EncodedChunk, b: codecs.EncodedChunk) -> bool:
    return (a.level, a.shape, a.params) == (b.level, b.shape, b.params) and np.array_equal(a.payload, b.payload)


class CountingOps(FileOps):
    def __init__(self):
        self.reads = 0
        self.opens = 0

    def open(self, path, flags, mode=0o600):
        self.opens += 1
        return super().open(path, flags, mode)

    def pread(self, fd, n, offset):
        self.reads += 1
        return super().pread(fd, n, offset)

    def pread_into(self, fd, buf, offset):
        self.reads += 1
        return super().pread_into(fd, buf, offset)


def test_a_write_back_is_one_pack_and_comes_back_in_one_read(tmp_path):
    ops = CountingOps()
    store = ChunkStore(tmp_path, fingerprint=FP, fs=ops)
    e = encs(10)
    metas = store.write_many(KEY, [(i, x, 16 * i) for i, x in enumerate(e)])
    assert folder(store) == ["000000000000.00000000-00000009.kvp"]
    assert store.usage_bytes() == os.path.getsize(store.files(KEY)[0])
    assert [m.name for m in metas] == [store.file_name(KEY, i) for i in range(10)]
    again = ChunkStore(tmp_path, fingerprint=FP, fs=ops)
    assert again.indices(KEY) == list(range(10))  # the scan: one open, a header read per record
    ops.reads = ops.opens = 0
    got = list(again.read(KEY, range(10)))
    assert [i for i, _ in got] == list(range(10)) and all(same(g, x) for (_, g), x in zip(got, e))
    assert (ops.opens, ops.reads) == (1, 2)  # the scan parsed the headers: one open, 4 KiB, the rest
    assert [again.check(KEY, i, deep=False).checksum for i in range(10)] == [m.checksum for m in metas]


def test_chunks_that_are_not_consecutive_get_a_pack_per_run(tmp_path):
    store = ChunkStore(tmp_path, fingerprint=FP)
    e = encs(6)
    store.write_many(KEY, [(5, e[5], 80), (0, e[0], 0), (1, e[1], 16), (3, e[3], 48)])
    assert folder(store) == ["000000000000.00000000-00000001.kvp", "000000000001.00000003-00000003.kvp",
                             "000000000002.00000005-00000005.kvp"]
    got = dict(reopen(store).read(KEY, [5, 3, 1, 0, 2]))
    assert isinstance(got[2], ChunkNotFoundError)
    assert all(same(got[i], e[i]) for i in (0, 1, 3, 5))
    with pytest.raises(ValueError):
        store.write_many(KEY, [(1, e[1], 16), (1, e[2], 16)])


def test_a_large_write_back_is_cut_into_packs_of_pack_bytes(tmp_path):
    e = encs(10)
    one = ChunkStore(tmp_path / "probe", fingerprint=FP).write(KEY, 0, e[0], 0).nbytes
    store = ChunkStore(tmp_path / "s", ChunkStoreConfig(pack_bytes=3 * one + 200), fingerprint=FP)
    store.write_many(KEY, [(i, x, 16 * i) for i, x in enumerate(e)])
    assert folder(store) == ["000000000000.00000000-00000002.kvp", "000000000001.00000003-00000005.kvp",
                             "000000000002.00000006-00000008.kvp", "000000000003.00000009-00000009.kvp"]
    assert all(same(g, x) for g, x in zip(read_all(reopen(store), KEY, range(10)), e))


def test_newer_records_win_and_replaced_packs_go(tmp_path):
    store = ChunkStore(tmp_path, fingerprint=FP)
    old, new = encs(4), encs(4, "q4", seed=10)
    store.write_many(KEY, [(i, x, 16 * i) for i, x in enumerate(old)])
    store.write_many(KEY, [(3, new[3], 48)])  # the partial last chunk, rewritten
    store.write_many(KEY, [(1, new[1], 16), (2, new[2], 32)])
    for s in (store, reopen(store)):
        got = read_all(s, KEY, range(4))
        assert [g.level for g in got] == ["q8", "q4", "q4", "q4"]
        assert all(same(g, x) for g, x in zip(got, [old[0], *new[1:]]))
    store.write_many(KEY, [(0, new[0], 0)])  # now the first pack holds nothing current: removed
    assert "000000000000.00000000-00000003.kvp" not in folder(store)
    assert store.usage_bytes() == sum(os.path.getsize(p) for p in store.files(KEY))


def test_a_deleted_chunk_stays_deleted_after_a_restart(tmp_path):
    store = ChunkStore(tmp_path, fingerprint=FP)
    e = encs(5)
    store.write_many(KEY, [(i, x, 16 * i) for i, x in enumerate(e)])
    assert store.delete(KEY, 2) and not store.delete(KEY, 2)
    assert folder(store) == ["000000000000.00000000-00000004.kvp", "000000000001.00000002-00000002.kvd"]
    again = reopen(store)
    assert again.indices(KEY) == [0, 1, 3, 4]
    with pytest.raises(ChunkNotFoundError):
        read_one(again, KEY, 2)
    again.write_many(KEY, [(i, e[i], 16 * i) for i in (0, 1, 3, 4)])  # the old pack is now dead ...
    assert folder(again) == ["000000000002.00000000-00000001.kvp", "000000000003.00000003-00000004.kvp"]
    assert reopen(store).indices(KEY) == [0, 1, 3, 4]  # ... and so is the marker: both removed


def test_compaction_bounds_the_packs_and_keeps_every_record(tmp_path):
    cfg = ChunkStoreConfig(max_packs=4)
    store = ChunkStore(tmp_path, cfg, fingerprint=FP)
    e = encs(40)
    metas = store.write_many(KEY, [(i, e[i], 16 * i) for i in range(20)])  # a prefill
    sums = {i: m.checksum for i, m in enumerate(metas)}
    for i in range(19, 40):  # then turns: the partial chunk and a new one each time
        turn = [j for j in (i, i + 1) if j < 40]
        for j, m in zip(turn, store.write_many(KEY, [(j, e[j], 16 * j) for j in turn])):
            sums[j] = m.checksum
        assert len(folder(store)) <= 5
    assert store.compactions > 0
    assert "000000000000.00000000-00000019.kvp" in folder(store)  # the big pack was kept
    for s in (store, reopen(store)):
        assert s.indices(KEY) == list(range(40))
        assert all(same(g, e[i]) for i, g in enumerate(read_all(s, KEY, range(40))))
        assert {i: s.check(KEY, i, deep=False).checksum for i in range(40)} == sums  # copied verbatim
    assert store.usage_bytes() == sum(os.path.getsize(p) for p in store.files(KEY))


class HeldOps(FileOps):
    """The bytes compaction has read and not yet written: the most it held at once."""

    def __init__(self):
        self.held = self.most = 0

    def pread(self, fd, n, offset):
        data = super().pread(fd, n, offset)
        self.held += len(data)
        self.most = max(self.most, self.held)
        return data

    def write(self, fd, buffers):
        self.held = 0
        return super().write(fd, buffers)


def test_compaction_holds_one_new_pack_of_records_at_a_time(tmp_path):
    e = encs(24)
    one = ChunkStore(tmp_path / "probe", fingerprint=FP).write(KEY, 0, e[0], 0).nbytes
    ops = HeldOps()
    store = ChunkStore(tmp_path / "s", ChunkStoreConfig(max_packs=12, pack_bytes=4 * one + 300), fingerprint=FP, fs=ops)
    for i, x in enumerate(e):  # a write-back a chunk at a time: a pack each, then compacted
        store.write_many(KEY, [(i, x, 16 * i)])
    assert store.compactions > 0
    assert 0 < ops.most <= 4 * one + 300 < len(e) * one  # not the context's records at once
    assert all(same(g, x) for g, x in zip(read_all(reopen(store), KEY, range(24)), e))


def test_mostly_superseded_packs_are_compacted(tmp_path):
    store = ChunkStore(tmp_path, ChunkStoreConfig(compact_min_bytes=0), fingerprint=FP)
    e = encs(8)
    store.write_many(KEY, [(i, x, 16 * i) for i, x in enumerate(e)])
    for i in range(5):  # dropped one at a time: the pack is soon mostly superseded
        store.delete(KEY, i)
        live = sum(store.check(KEY, j, deep=False).nbytes for j in store.indices(KEY))
        assert store.usage_bytes() <= 2 * live + 64 * 8
    assert store.compactions == 1 and store.indices(KEY) == [5, 6, 7]
    again = reopen(store)
    assert again.indices(KEY) == [5, 6, 7]
    assert all(same(g, x) for g, x in zip(read_all(again, KEY, range(5, 8)), e[5:]))


def test_damage_in_a_pack_is_kept_to_its_range(tmp_path):
    store = ChunkStore(tmp_path, fingerprint=FP)
    e = encs(8)
    store.write_many(KEY, [(i, e[i], 16 * i) for i in range(4)])
    store.write_many(KEY, [(i, e[i], 16 * i) for i in range(4, 8)])
    first = store.path(KEY, 0)
    data = bytearray(open(first, "rb").read())
    data[fmt.PREFIX_NBYTES + 5] ^= 0x10  # chunk 0's header
    open(first, "wb").write(bytes(data))
    again = reopen(store)
    for i in range(4):  # the whole pack: its contents are unknown
        with pytest.raises(CorruptChunkError, match="is damaged"):
            read_one(again, KEY, i)
    assert all(same(read_one(again, KEY, i), e[i]) for i in range(4, 8))
    again.write(KEY, 2, e[2], 32)  # a newer record of chunk 2 is readable again
    assert same(read_one(again, KEY, 2), e[2]) and first in again.files(KEY)  # the damaged pack stays
    got = dict(again.read(KEY, range(8)))
    assert [type(got[i]).__name__ for i in range(8)] == ["CorruptChunkError"] * 2 + ["EncodedChunk"] + \
        ["CorruptChunkError"] + ["EncodedChunk"] * 4


def test_no_flipped_byte_or_cut_of_a_pack_returns_wrong_data(tmp_path):
    """Every byte of a three-chunk pack flipped in turn, and every cut: each chunk then either
    reads back exactly or raises a storage error."""
    store = ChunkStore(tmp_path, fingerprint=FP)
    e = encs(3, "q2", seed=5)
    store.write_many(KEY, [(i, x, 16 * i) for i, x in enumerate(e)])
    path = store.path(KEY, 0)
    good = open(path, "rb").read()
    rng = np.random.default_rng(0)
    trials = [(pos, None) for pos in range(len(good))] + [(None, cut) for cut in range(0, len(good), 7)]
    rejected = 0
    for pos, cut in trials:
        bad = bytearray(good)
        if pos is not None:
            bad[pos] ^= int(rng.integers(1, 256))
        else:
            bad = bad[:cut]
        open(path, "wb").write(bytes(bad))
        for i, got in reopen(store).read(KEY, range(3)):
            if isinstance(got, StorageError):
                rejected += 1
            else:
                assert same(got, e[i]), (pos, cut, i)
    assert len(trials) > 1000 and rejected >= len(trials)  # every damage is seen by at least one chunk


def test_format_2_chunk_files_are_read_and_then_replaced(tmp_path):
    store = ChunkStore(tmp_path, fingerprint=FP)
    e = encs(2)
    store.write(KEY, 1, e[1], 16)
    d = os.path.join(store.root, KEY)
    os.replace(store.path(KEY, 1), os.path.join(d, "00000001.kvc"))  # what session 11's store wrote
    again = reopen(store)
    assert again.indices(KEY) == [1] and same(read_one(again, KEY, 1), e[1])
    again.write(KEY, 1, e[0], 16)
    assert folder(again) == ["000000000000.00000001-00000001.kvp"]
    assert same(read_one(reopen(store), KEY, 1), e[0])


def test_a_crash_before_the_old_packs_go_leaves_them_to_the_next_open(tmp_path):
    class NoUnlink(FileOps):
        def unlink(self, path):
            raise KeyboardInterrupt  # the process dies right after the rename

    store = ChunkStore(tmp_path, fingerprint=FP)
    e, f = encs(3), encs(3, "q4", seed=7)
    store.write_many(KEY, [(i, x, 16 * i) for i, x in enumerate(e)])
    dying = ChunkStore(store.root, fingerprint=FP, fs=NoUnlink())
    with pytest.raises(KeyboardInterrupt):
        dying.write_many(KEY, [(i, x, 16 * i) for i, x in enumerate(f)])
    assert len(folder(store)) == 2
    again = reopen(store)
    assert all(same(g, x) for g, x in zip(read_all(again, KEY, range(3)), f))
    assert folder(again) == ["000000000001.00000000-00000002.kvp"]
    assert again.usage_bytes() == os.path.getsize(again.files(KEY)[0])
