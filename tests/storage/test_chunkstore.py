"""ChunkStore: round trips, layer reads, durability order, path confinement, disk cap, throttle, and
the one read API (whole chunks, some layers) with its per-chunk results."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from storage import codecs
from storage.chunkstore import ChunkStore, ChunkStoreConfig
from storage.errors import (ChunkNotFoundError, DiskCapExceededError, FingerprintMismatchError,
                            InvalidKeyError, PathConfinementError)
from storage.fileops import FileOps
from tests.storage.helpers import read_all, read_one, synthetic_kv

KEY = "0123456789abcdef0123456789abcdef"
FP = "smollm2-135m-test"


class RecordingOps(FileOps):
    """Records (operation, path basename) of every mutating file operation."""

    def __init__(self):
        self.log: list[tuple[str, ...]] = []
        self.names: dict[int, str] = {}

    def open(self, path, flags, mode=0o600):
        fd = super().open(path, flags, mode)
        self.names[fd] = os.path.basename(path)
        if flags & os.O_CREAT:
            self.log.append(("open", self.names[fd]))
        return fd

    def write(self, fd, buffers):
        self.log.append(("write", self.names[fd]))
        return super().write(fd, buffers)

    def fsync(self, fd):
        self.log.append(("fsync", self.names[fd]))
        super().fsync(fd)

    def close(self, fd):
        name = self.names.pop(fd)
        if name.endswith(".tmp"):
            self.log.append(("close", name))
        super().close(fd)

    def rename(self, src, dst):
        self.log.append(("rename", os.path.basename(src), os.path.basename(dst)))
        super().rename(src, dst)

    def fsync_dir(self, path):
        self.log.append(("fsync_dir", os.path.basename(path)))
        super().fsync_dir(path)


@pytest.fixture
def store(tmp_path):
    return ChunkStore(tmp_path / "chunks", fingerprint=FP)


@pytest.mark.parametrize("level", sorted(codecs.CODECS))
def test_write_read_round_trip(store, level):
    kv = synthetic_kv()
    enc = codecs.encode(kv, level)
    meta = store.write(KEY, 5, enc, token_start=80)
    assert meta.name == f"{KEY}/00000005.kvc" and os.path.getsize(store.path(KEY, 5)) == meta.nbytes
    h = meta.header
    assert (h.token_start, h.token_end, h.level, h.shape) == (80, 96, level, kv.shape)
    back = read_one(store, KEY, 5)
    assert back.level == level and back.params == enc.params
    np.testing.assert_array_equal(back.payload, enc.payload)
    assert store.check(KEY, 5, deep=False).checksum == meta.checksum == store.check(KEY, 5).checksum


def test_read_layers_reads_only_those_layers(tmp_path):
    class CountingOps(FileOps):
        read = 0

        def pread(self, fd, n, offset):
            data = super().pread(fd, n, offset)
            CountingOps.read += len(data)
            return data

        def pread_into(self, fd, buf, offset):
            n = super().pread_into(fd, buf, offset)
            CountingOps.read += n
            return n

    store = ChunkStore(tmp_path, fingerprint=FP, fs=CountingOps())
    kv = synthetic_kv()
    enc = codecs.encode(kv, "raw")
    meta = store.write(KEY, 0, enc, 0)
    CountingOps.read = 0
    part = read_one(store, KEY, 0, range(10, 13))
    assert part.first_layer == 10 and part.shape == (3, 2, 3, 16, 64)
    np.testing.assert_array_equal(codecs.decode(part), kv[10:13])
    assert CountingOps.read == 3 * enc.record_nbytes  # 3 layers: the header was parsed at the write
    CountingOps.read = 0
    read_one(store, KEY, 0)
    assert CountingOps.read == meta.nbytes  # a full read reads the file once
    with pytest.raises(ValueError):
        read_one(store, KEY, 0, range(28, 31))


def test_durability_order_write_fsync_rename_fsync_dir(tmp_path):
    ops = RecordingOps()
    store = ChunkStore(tmp_path, fingerprint=FP, fs=ops)
    store.write(KEY, 3, codecs.encode(synthetic_kv((2, 2, 1, 16, 8)), "q4"), 48)
    tmp = ops.log[1][1]
    assert tmp.startswith(".000000000000.") and tmp.endswith(".tmp")
    assert ops.log == [
        ("fsync_dir", os.path.basename(store.root)),  # the new context folder (first write only)
        ("open", tmp), ("write", tmp), ("fsync", tmp), ("close", tmp),
        ("rename", tmp, "000000000000.00000003-00000003.kvp"), ("fsync_dir", KEY)]
    ops.log.clear()
    store.write_many(KEY, [(i, codecs.encode(synthetic_kv((2, 2, 1, 16, 8)), "q2"), 16 * i) for i in (3, 4)])
    tmp = ops.log[0][1]  # one pack for both chunks, the same order; the old pack is then removed
    assert ops.log == [("open", tmp), ("write", tmp), ("fsync", tmp), ("close", tmp),
                       ("rename", tmp, "000000000001.00000003-00000004.kvp"), ("fsync_dir", KEY)]
    assert os.listdir(os.path.join(store.root, KEY)) == ["000000000001.00000003-00000004.kvp"]


def test_stale_temporaries_are_removed_when_opened(tmp_path, store):
    store.write(KEY, 0, codecs.encode(synthetic_kv((2, 2, 1, 16, 8)), "raw"), 0)
    d = os.path.dirname(store.path(KEY, 0))
    stale = os.path.join(d, ".00000001.deadbeef.tmp")
    with open(stale, "wb") as f:
        f.write(b"half a chunk")
    foreign = os.path.join(d, "notes.txt")
    open(foreign, "w").close()
    again = ChunkStore(store.root, fingerprint=FP)
    assert again.removed_temporaries == [f"{KEY}/.00000001.deadbeef.tmp"]
    assert not os.path.exists(stale) and os.path.exists(foreign)
    assert again.usage_bytes() == store.usage_bytes() == os.path.getsize(store.path(KEY, 0))


@pytest.mark.parametrize("key", ["", "ABCDEF12", "../../etc", "abc", "0123456789abcdeg",
                                 "a" * 65, "abcdef12/..", "abcdef12\x00", 123])
def test_context_keys_are_validated(store, key):
    enc = codecs.encode(synthetic_kv((1, 2, 1, 16, 8)), "raw")
    with pytest.raises(InvalidKeyError) as e:
        store.write(key, 0, enc, 0)
    assert e.value.code == "invalid_key"
    with pytest.raises(InvalidKeyError):
        read_one(store, key, 0)


@pytest.mark.parametrize("index", [-1, 10**8, 1.5, "3", True])
def test_chunk_indices_are_validated(store, index):
    with pytest.raises(InvalidKeyError):
        store.write(KEY, index, codecs.encode(synthetic_kv((1, 2, 1, 16, 8)), "raw"), 0)


def test_symlinked_context_folder_is_refused(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    store = ChunkStore(root, fingerprint=FP)
    os.symlink(outside, root / KEY)
    enc = codecs.encode(synthetic_kv((1, 2, 1, 16, 8)), "raw")
    with pytest.raises(PathConfinementError) as e:
        store.write(KEY, 0, enc, 0)
    assert e.value.code == "path_confinement"
    with pytest.raises(PathConfinementError):
        read_one(store, KEY, 0)
    assert list(outside.iterdir()) == []
    assert ChunkStore(root, fingerprint=FP).usage_bytes() == 0  # startup scan does not follow it


def test_symlinked_pack_file_is_not_followed(tmp_path, store):
    enc = codecs.encode(synthetic_kv((1, 2, 1, 16, 8)), "raw")
    store.write(KEY, 0, enc, 0)
    target = tmp_path / "secret"
    target.write_bytes(b"not yours")
    os.symlink(target, os.path.join(store.root, KEY, "000000000007.00000001-00000001.kvp"))
    again = ChunkStore(store.root, fingerprint=FP)
    with pytest.raises(PathConfinementError):
        read_one(again, KEY, 1)  # a pack it cannot read decides chunk 1: refused, not "missing"
    np.testing.assert_array_equal(read_one(again, KEY, 0).payload, enc.payload)
    again.write(KEY, 1, enc, 16)  # a newer pack: the link is neither written through nor followed
    np.testing.assert_array_equal(read_one(again, KEY, 1).payload, enc.payload)
    assert target.read_bytes() == b"not yours"
    assert again.delete_context(KEY) == 2 and target.read_bytes() == b"not yours"


def test_fingerprint_mismatch_is_refused(tmp_path, store):
    store.write(KEY, 0, codecs.encode(synthetic_kv((1, 2, 1, 16, 8)), "q8"), 0)
    other = ChunkStore(store.root, fingerprint="another-model")
    with pytest.raises(FingerprintMismatchError) as e:
        read_one(other, KEY, 0)
    assert e.value.code == "chunk_fingerprint"


def test_disk_cap_is_honoured(tmp_path):
    enc = codecs.encode(synthetic_kv(), "q4")
    probe = ChunkStore(tmp_path / "probe", fingerprint=FP)
    one = probe.write(KEY, 0, enc, 0).nbytes
    store = ChunkStore(tmp_path / "capped", ChunkStoreConfig(disk_cap_bytes=3 * one + 10),
                       fingerprint=FP)
    for i in range(3):
        store.write(KEY, i, enc, 16 * i)
    assert store.usage_bytes() == 3 * one
    with pytest.raises(DiskCapExceededError) as e:
        store.write(KEY, 3, enc, 48)
    assert e.value.code == "disk_cap_exceeded"
    assert store.usage_bytes() == 3 * one and store.indices(KEY) == [0, 1, 2]
    assert not [n for n in os.listdir(os.path.dirname(store.path(KEY, 0))) if n.endswith(".tmp")]
    store.write(KEY, 2, enc, 32)  # replacing a chunk in place fits
    smaller = codecs.encode(synthetic_kv(), "q2")
    store.write(KEY, 1, smaller, 16)  # shrinking one frees room ...
    assert store.usage_bytes() < 3 * one
    store.delete(KEY, 0)  # ... and deleting frees more
    store.write(KEY, 3, enc, 48)
    sizes = sum(os.path.getsize(store.path(KEY, i)) for i in store.indices(KEY))
    assert store.usage_bytes() == sizes <= 3 * one + 10
    assert ChunkStore(store.root, fingerprint=FP).usage_bytes() == sizes


def test_failed_write_leaves_nothing_behind(tmp_path):
    class FailingFsync(FileOps):
        def fsync(self, fd):
            raise OSError(5, "EIO")

    store = ChunkStore(tmp_path, fingerprint=FP, fs=FailingFsync())
    with pytest.raises(OSError):
        store.write(KEY, 0, codecs.encode(synthetic_kv((1, 2, 1, 16, 8)), "raw"), 0)
    assert store.usage_bytes() == 0
    assert os.listdir(os.path.join(store.root, KEY)) == []


def test_delete_chunk_and_context(store):
    enc = codecs.encode(synthetic_kv((2, 2, 1, 16, 8)), "q8")
    for i in range(4):
        store.write(KEY, i, enc, 16 * i)
    assert store.delete(KEY, 2) and not store.delete(KEY, 2)
    assert store.indices(KEY) == [0, 1, 3]
    with pytest.raises(ChunkNotFoundError) as e:
        read_one(store, KEY, 2)
    assert e.value.code == "chunk_not_found"
    assert store.delete_names([f"{KEY}/00000001.kvc"]) == 1
    assert store.delete_context(KEY) == 2
    assert store.usage_bytes() == 0 and store.contexts() == [] and store.indices(KEY) == []


class FakeClock:
    """A clock whose sleep advances it: throttled reads take exact fake time."""

    def __init__(self):
        self.now = 100.0
        self.slept = 0.0

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.now += s
        self.slept += s


def test_throttle_with_an_injected_clock(tmp_path):
    clock = FakeClock()
    rate = 2_000_000
    store = ChunkStore(tmp_path, ChunkStoreConfig(read_bytes_per_s=rate, read_burst_bytes=65536),
                       fingerprint=FP, clock=clock, sleep=clock.sleep)
    kv = synthetic_kv()
    for i in range(4):
        store.write(KEY, i, codecs.encode(kv, "raw"), 16 * i)
    clock.now += 10  # bucket full
    start, total = clock.now, 0
    for i in range(4):
        read_one(store, KEY, i)
        total += os.path.getsize(store.path(KEY, i))
    elapsed = clock.now - start
    expected = (total - 65536) / rate
    assert abs(elapsed - expected) <= 0.02 * expected + 4096 * 4 / rate


def test_throttle_with_the_real_clock(tmp_path):
    """About 4 MB at 20 MB/s takes about 0.2 s (within 10%)."""
    rate = 20e6
    store = ChunkStore(tmp_path, ChunkStoreConfig(read_bytes_per_s=rate, read_burst_bytes=32768),
                       fingerprint=FP)
    enc = codecs.encode(synthetic_kv(), "raw")
    for i in range(6):
        store.write(KEY, i, enc, 16 * i)
    t0 = time.monotonic()
    for i in range(6):
        read_one(store, KEY, i)
    elapsed = time.monotonic() - t0
    total = store.usage_bytes()
    expected = (total - 32768) / rate
    assert total > 4e6
    assert 0.9 * expected <= elapsed <= 1.1 * expected, (elapsed, expected)


def test_unthrottled_by_default(tmp_path):
    clock = FakeClock()
    store = ChunkStore(tmp_path, fingerprint=FP, clock=clock, sleep=clock.sleep)
    store.write(KEY, 0, codecs.encode(synthetic_kv(), "raw"), 0)
    read_one(store, KEY, 0)
    assert clock.slept == 0


def test_read_keeps_the_order_asked_and_prefetch_advises(tmp_path):
    class AdviceOps(FileOps):
        advised: list[int] = []

        def fadvise_willneed(self, fd, offset=0, length=0):
            AdviceOps.advised.append(fd)
            super().fadvise_willneed(fd, offset, length)

    store = ChunkStore(tmp_path, fingerprint=FP, fs=AdviceOps())
    encs = [codecs.encode(synthetic_kv(seed=i), "q8") for i in range(5)]
    for i, e in enumerate(encs):
        store.write(KEY, i, e, 16 * i)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as ex:
        for executor in (None, ex):
            AdviceOps.advised.clear()
            got = (read_all(store, KEY, [4, 0, 2], executor=executor) if executor else
                   read_all(store, KEY, [4, 0, 2]))
            assert AdviceOps.advised == []  # whole reads prime readahead instead (see _read_run)
            for g, i in zip(got, [4, 0, 2]):
                np.testing.assert_array_equal(g.payload, encs[i].payload)
    assert store.prefetch(KEY, [0, 7, 2]) == 2 and len(AdviceOps.advised) == 2  # missing: skipped


@pytest.mark.parametrize("level", ["raw", "q8"])
def test_compressible_layers_are_stored_lz4_and_read_back(tmp_path, level):
    """Layers lz4 shrinks by an eighth or more are stored compressed, the others as is."""
    store = ChunkStore(tmp_path, fingerprint=FP)
    kv = synthetic_kv()
    kv[3:7] = 0.0  # four constant layers: lz4 stores them in a few dozen bytes
    enc = codecs.encode(kv, level)
    meta = store.write(KEY, 0, enc, 0)
    lens = meta.header.lengths
    assert all(n < enc.record_nbytes // 8 for n in lens[3:7])
    assert all(n == enc.record_nbytes for i, n in enumerate(lens) if not 3 <= i < 7)
    np.testing.assert_array_equal(read_one(store, KEY, 0).payload, enc.payload)
    for layers in (range(2, 8), range(4, 5), range(7, 9)):
        part = read_one(store, KEY, 0, layers)
        np.testing.assert_array_equal(part.payload, enc.payload[layers.start:layers.stop])
    never = ChunkStore(tmp_path / "plain", ChunkStoreConfig(lz4_level=-1), fingerprint=FP)
    assert set(never.write(KEY, 0, enc, 0).header.lengths) == {enc.record_nbytes}


def test_read_payload_is_writable_and_aligned(store):
    """Decoders use the records in place (torch wraps writable arrays only)."""
    store.write(KEY, 0, codecs.encode(synthetic_kv(), "fp16"), 0)
    for enc in (read_one(store, KEY, 0), read_one(store, KEY, 0, range(3, 9))):
        assert enc.payload.flags.writeable and enc.payload.flags.c_contiguous
        assert enc.payload.ctypes.data % 16 == 0  # numpy aligns buffers; the file pads the payload to 64
