"""Torn, truncated, bit-flipped and hostile chunk files are detected, fast and without big allocations."""

from __future__ import annotations

import os
import struct
import time
import tracemalloc
import zlib

import lz4.block
import msgpack
import numpy as np
import pytest

from storage import chunkformat as fmt
from storage import codecs
from storage.chunkstore import ChunkStore
from storage.errors import ChunkVersionError, CorruptChunkError
from tests.storage.helpers import read_one, synthetic_kv

KEY = "feedfacecafebeef"
FP = "test-model"
SMALL = (3, 2, 1, 16, 8)


@pytest.fixture
def store(tmp_path):
    return ChunkStore(tmp_path, fingerprint=FP)


def pack_path(store: ChunkStore, index: int = 0, gen: int = 1) -> str:
    """Where a pack of generation ``gen`` deciding chunk ``index`` alone lives."""
    return os.path.join(store.root, KEY, f"{gen:012d}.{index:08d}-{index:08d}.kvp")


def put(store: ChunkStore, data: bytes, index: int = 0) -> None:
    """Make ``data`` the context's only file: a one-chunk pack for chunk ``index``."""
    d = os.path.join(store.root, KEY)
    os.makedirs(d, exist_ok=True)
    for name in os.listdir(d):
        os.unlink(os.path.join(d, name))
    with open(pack_path(store, index), "wb") as f:
        f.write(data)


def fresh(store: ChunkStore) -> ChunkStore:
    """A store opened on the same root, as after a restart (it scans the files as they are now)."""
    return ChunkStore(store.root, store.config, fingerprint=FP)


def assert_rejected(store: ChunkStore, index: int = 0) -> CorruptChunkError:
    try:  # not pytest.raises: this runs thousands of times and must stay cheap
        read_one(fresh(store), KEY, index)
    except CorruptChunkError as e:
        assert e.code in ("chunk_corrupt", "chunk_version")
        return e
    raise AssertionError("a damaged chunk file was read as data")


def written(store, level, seed):
    """Write one chunk of synthetic K/V; its pack's bytes, header and payload offset."""
    meta = store.write(KEY, 0, codecs.encode(synthetic_kv(SMALL, seed=seed), level), 0)
    good = open(store.path(KEY, 0), "rb").read()
    return good, meta.header, len(good) - meta.header.payload_nbytes


@pytest.mark.parametrize("level", ["raw", "fp16", "q8", "q2"])
def test_single_byte_flips_are_detected(store, level):
    """Every byte of the prefix, the header and each frame's descriptor and trailer, and 400
    random payload bytes (every byte of a small file), flipped one at a time: 500-800 each."""
    good, h, base = written(store, level, seed=3)
    rng = np.random.default_rng(1)
    positions = set(range(base))  # prefix and header
    for o, n in zip(h.offsets, h.lengths):
        positions |= set(range(base + o, base + o + 15)) | set(range(base + o + n - 8, base + o + n))
    positions |= set(rng.integers(base, len(good), 400).tolist())
    if len(good) < 1000:
        positions = set(range(len(good)))
    for pos in sorted(positions):
        bad = bytearray(good)
        bad[pos] ^= int(rng.integers(1, 256))
        put(store, bytes(bad))
        assert_rejected(store)
    assert len(positions) > 500
    put(store, good)
    np.testing.assert_array_equal(read_one(fresh(store), KEY, 0).payload,
                                  codecs.encode(synthetic_kv(SMALL, seed=3), level).payload)


@pytest.mark.parametrize("level", ["raw", "q4"])
def test_flips_are_detected_by_partial_reads_of_that_layer(store, level):
    """A layer read alone is checked against its own crc32: 300 random flips inside layers 1-2
    are each caught by a read of the layers they hit; a read of layer 0 alone is unaffected."""
    good, h, base = written(store, level, seed=7)
    rng = np.random.default_rng(3)
    for pos in rng.integers(base + h.offsets[1], len(good), 300).tolist():
        bad = bytearray(good)
        bad[pos] ^= int(rng.integers(1, 256))
        put(store, bytes(bad))
        layer = 1 if pos < base + h.offsets[2] else 2
        reopened = fresh(store)
        with pytest.raises(CorruptChunkError, match=f"layer {layer}: checksum"):
            read_one(reopened, KEY, 0, range(layer, layer + 1))
        assert read_one(reopened, KEY, 0, range(0, 1)).payload.shape[0] == 1


def test_truncation_zero_length_wrong_magic_and_version(store):
    kv = synthetic_kv(SMALL, seed=4)
    store.write(KEY, 0, codecs.encode(kv, "q4"), 0)
    good = open(store.path(KEY, 0), "rb").read()
    rng = np.random.default_rng(2)
    cuts = sorted(set(rng.integers(0, len(good), 300).tolist()) | {0, 1, 19, 20, len(good) - 1})
    for cut in cuts:
        put(store, good[:cut])
        assert_rejected(store)
    put(store, good + b"\0")  # appended garbage: the size no longer matches the header
    assert_rejected(store)
    put(store, b"")
    assert "shorter" in str(assert_rejected(store))
    put(store, b"NOTCHUNK" + good[8:])
    assert "magic" in str(assert_rejected(store))
    put(store, good[:8] + struct.pack("<H", fmt.FORMAT_VERSION + 1) + good[10:])
    err = assert_rejected(store)
    assert isinstance(err, ChunkVersionError) and err.code == "chunk_version"
    assert len(cuts) > 200


def test_a_torn_write_mixing_two_versions_is_detected(store):
    """Header of one write, payload of another (same sizes): the frame checksums differ."""
    a = codecs.encode(synthetic_kv(SMALL, seed=5), "q8")
    b = codecs.encode(synthetic_kv(SMALL, seed=6), "q8")
    store.write(KEY, 0, a, 0)
    first = open(store.path(KEY, 0), "rb").read()
    store.write(KEY, 0, b, 0)
    second = open(store.path(KEY, 0), "rb").read()
    assert len(first) == len(second)
    half = len(first) // 2
    put(store, first[:half] + second[half:])
    assert_rejected(store)


def test_pack_holding_a_chunk_outside_its_range_is_detected(store):
    store.write(KEY, 0, codecs.encode(synthetic_kv(SMALL), "raw"), 0)
    os.replace(store.path(KEY, 0), pack_path(store, 1))
    assert "holds chunk 0, outside 1..1" in str(assert_rejected(store, 1))


# -- hostile files: a writer who computes valid crcs for malicious content ----------------------------


def file_with_header(body: bytes, payload: bytes = b"", hlen: int | None = None) -> bytes:
    hlen = len(body) if hlen is None else hlen
    head = fmt._PREFIX.pack(fmt.MAGIC, fmt.FORMAT_VERSION, 0, hlen, zlib.crc32(body)) + body
    return head + bytes(max(0, fmt.payload_start(len(body)) - len(head))) + payload


def valid_header_fields(store: ChunkStore) -> tuple[dict, bytes]:
    store.write(KEY, 0, codecs.encode(synthetic_kv(SMALL), "raw"), 0)
    data = open(store.path(KEY, 0), "rb").read()
    hlen = struct.unpack_from("<I", data, 12)[0]
    body = data[fmt.PREFIX_NBYTES:fmt.PREFIX_NBYTES + hlen]
    return msgpack.unpackb(body), data[fmt.payload_start(hlen):]


def bounded(fn) -> tuple[float, int]:
    """(seconds, peak traced bytes) of fn()."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        fn()
    finally:
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return elapsed, peak


HOSTILE_HEADERS = {
    "array claims 2^32-1 items": b"\xdd\xff\xff\xff\xff" + b"\x00" * 64,
    "map claims 2^32-1 pairs": b"\xdf\xff\xff\xff\xff" + b"\x00" * 64,
    "str claims 4 GiB": b"\xdb\xff\xff\xff\xff" + b"a" * 64,
    "bin claims 4 GiB": b"\xc6\xff\xff\xff\xff" + b"a" * 64,
    "ext claims 4 GiB": b"\xc9\xff\xff\xff\xff\x01" + b"a" * 64,
    "nesting 60000 deep": b"\x91" * 60000 + b"\x00",
    "nested maps 30000 deep": b"\x81\xa1k" * 20000 + b"\x00",
    "not a map": msgpack.packb([1, 2, 3]),
    "trailing data": msgpack.packb({"a": 1}) + b"\x00",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_HEADERS))
def test_hostile_msgpack_headers_are_rejected_quickly(store, name):
    put(store, file_with_header(HOSTILE_HEADERS[name]))
    elapsed, peak = bounded(lambda: assert_rejected(store))
    assert elapsed < 0.5 and peak < 2_000_000, (elapsed, peak)


def test_header_length_beyond_the_cap_is_rejected_before_reading(store):
    put(store, file_with_header(b"\x80", hlen=2**32 - 1))
    elapsed, peak = bounded(lambda: assert_rejected(store))
    assert elapsed < 0.5 and peak < 200_000


@pytest.mark.parametrize("field,value", [
    ("shape", [2**31, 2, 1, 16, 8]), ("shape", [3, 2, 1, 16]), ("shape", [3, 2, 1, 16, 2**20]),
    ("rec", 2**40), ("len", [2**40, 1, 1]), ("len", [0, 1024, 1024]), ("tok", [0, 2**40]),
    ("level", "q3"), ("dtype", "float64"), ("ctx", "../../etc"), ("idx", -1), ("idx", True),
    ("cv", 99), ("sum", [2**33, 0, 0]), ("params", "f64"), ("psum", 2**33), ("psum", -1),
])
def test_header_fields_out_of_range_are_rejected(store, field, value):
    fields, payload = valid_header_fields(store)
    fields[field] = value
    put(store, file_with_header(msgpack.packb(fields), payload))
    elapsed, peak = bounded(lambda: assert_rejected(store))
    assert elapsed < 0.5 and peak < 2_000_000, (elapsed, peak)


def hostile_block_file(store: ChunkStore, block: bytes) -> bytes:
    """Every layer stored as ``block`` with honest checksums: only the lz4 content is hostile."""
    fields, _ = valid_header_fields(store)
    n = fields["shape"][0]
    fields["len"] = [len(block)] * n
    fields["sum"] = [zlib.crc32(block)] * n
    fields["psum"] = zlib.crc32(block * n)
    return file_with_header(msgpack.packb(fields), block * n)


RAW_REC = codecs.CODECS["raw"].record_nbytes(SMALL[1:], "float32")  # 1024 B


@pytest.mark.parametrize("full", [True, False])
def test_lz4_bomb_is_cut_off_at_the_record_size(store, full):
    """A block within the record's size that expands to ~200 KB: the output is bounded."""
    block = lz4.block.compress(bytes(200_000), store_size=False)
    assert len(block) < RAW_REC
    put(store, hostile_block_file(store, block))
    reopened = fresh(store)
    read = (lambda: read_one(reopened, KEY, 0)) if full else (lambda: read_one(reopened, KEY, 0, range(1, 2)))
    elapsed, peak = bounded(lambda: pytest.raises(CorruptChunkError, read))
    assert elapsed < 0.5 and peak < 2_000_000, (elapsed, peak)


def test_lz4_block_shorter_than_its_record_is_rejected(store):
    put(store, hostile_block_file(store, lz4.block.compress(bytes(RAW_REC // 2), store_size=False)))
    assert "decompresses to" in str(assert_rejected(store))


def test_lz4_block_of_garbage_is_rejected(store):
    put(store, hostile_block_file(store, bytes([0xF0]) + bytes(range(200))))
    assert "lz4" in str(assert_rejected(store))


def test_layer_longer_than_its_record_is_rejected_unread(store):
    put(store, hostile_block_file(store, bytes(RAW_REC + 1)))
    assert "record lengths" in str(assert_rejected(store))


def test_records_larger_than_the_file_cap_are_refused_before_decompressing(tmp_path):
    """Small lz4 blocks could claim up to ~255x their size: the decoded total is capped too."""
    from storage.chunkstore import ChunkStoreConfig

    store = ChunkStore(tmp_path, ChunkStoreConfig(max_file_bytes=2 * RAW_REC), fingerprint=FP)
    put(store, hostile_block_file(store, lz4.block.compress(bytes(RAW_REC), store_size=False)))
    elapsed, peak = bounded(lambda: assert_rejected(store))
    assert "file cap" in str(assert_rejected(store)) and elapsed < 0.5 and peak < 200_000


def test_version_1_files_are_refused_with_a_typed_error(store):
    store.write(KEY, 0, codecs.encode(synthetic_kv(SMALL), "q8"), 0)
    good = open(store.path(KEY, 0), "rb").read()
    put(store, good[:8] + struct.pack("<H", 1) + good[10:])
    err = assert_rejected(store)
    assert isinstance(err, ChunkVersionError) and "version 1" in str(err)


def test_oversized_file_is_refused_unread(tmp_path):
    from storage.chunkstore import ChunkStoreConfig

    store = ChunkStore(tmp_path, ChunkStoreConfig(max_file_bytes=1 << 20), fingerprint=FP)
    put(store, b"")
    with open(pack_path(store), "r+b") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB claimed, nothing allocated
    elapsed, peak = bounded(lambda: assert_rejected(store))
    assert elapsed < 0.5 and peak < 100_000
