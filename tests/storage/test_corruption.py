"""Torn, truncated, bit-flipped and hostile chunk files are detected, fast and without big allocations."""

from __future__ import annotations

import os
import struct
import time
import tracemalloc
import zlib

import lz4.frame
import msgpack
import numpy as np
import pytest

from storage import chunkformat as fmt
from storage import codecs as C
from storage.chunkfile import ChunkStore
from storage.errors import ChunkVersionError, CorruptChunkError
from tests.storage.helpers import synthetic_kv

KEY = "feedfacecafebeef"
FP = "test-model"
SMALL = (3, 2, 1, 16, 8)


@pytest.fixture
def store(tmp_path):
    return ChunkStore(tmp_path, fingerprint=FP)


def put(store: ChunkStore, data: bytes, index: int = 0) -> None:
    os.makedirs(os.path.dirname(store.path(KEY, index)), exist_ok=True)
    with open(store.path(KEY, index), "wb") as f:
        f.write(data)


def assert_rejected(store: ChunkStore, index: int = 0) -> CorruptChunkError:
    try:  # not pytest.raises: this runs thousands of times and must stay cheap
        store.read(KEY, index)
    except CorruptChunkError as e:
        assert e.code in ("chunk_corrupt", "chunk_version")
        return e
    raise AssertionError("a damaged chunk file was read as data")


@pytest.mark.parametrize("level", ["raw", "fp16", "q8", "q2"])
def test_single_byte_flips_are_detected(store, level):
    """Every byte of the prefix, the header and each frame's descriptor and trailer, and 400
    random payload bytes (every byte of a small file), flipped one at a time: 500-800 each."""
    kv = synthetic_kv(SMALL, seed=3)
    meta = store.write(KEY, 0, C.encode(kv, level), 0)
    good = open(store.path(KEY, 0), "rb").read()
    h = meta.header
    base = len(good) - h.payload_nbytes
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
    np.testing.assert_array_equal(store.read(KEY, 0).payload, C.encode(kv, level).payload)


def test_truncation_zero_length_wrong_magic_and_version(store):
    kv = synthetic_kv(SMALL, seed=4)
    store.write(KEY, 0, C.encode(kv, "q4"), 0)
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
    a = C.encode(synthetic_kv(SMALL, seed=5), "q8")
    b = C.encode(synthetic_kv(SMALL, seed=6), "q8")
    store.write(KEY, 0, a, 0)
    first = open(store.path(KEY, 0), "rb").read()
    store.write(KEY, 0, b, 0)
    second = open(store.path(KEY, 0), "rb").read()
    assert len(first) == len(second)
    half = len(first) // 2
    put(store, first[:half] + second[half:])
    assert_rejected(store)


def test_swapped_file_of_another_chunk_is_detected(store):
    store.write(KEY, 0, C.encode(synthetic_kv(SMALL), "raw"), 0)
    os.replace(store.path(KEY, 0), store.path(KEY, 1))
    assert "holds chunk 0" in str(assert_rejected(store, 1))


# -- hostile files: a writer who computes valid crcs for malicious content ----------------------------


def file_with_header(body: bytes, payload: bytes = b"", hlen: int | None = None) -> bytes:
    hlen = len(body) if hlen is None else hlen
    return fmt._PREFIX.pack(fmt.MAGIC, fmt.FORMAT_VERSION, 0, hlen, zlib.crc32(body)) + body + payload


def valid_header_fields(store: ChunkStore) -> tuple[dict, bytes]:
    store.write(KEY, 0, C.encode(synthetic_kv(SMALL), "raw"), 0)
    data = open(store.path(KEY, 0), "rb").read()
    hlen = struct.unpack_from("<I", data, 12)[0]
    body = data[fmt.PREFIX_NBYTES:fmt.PREFIX_NBYTES + hlen]
    return msgpack.unpackb(body), data[fmt.PREFIX_NBYTES + hlen:]


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
    ("rec", 2**40), ("len", [2**40, 1, 1]), ("off", [0, 2**40, 2**41]), ("tok", [0, 2**40]),
    ("level", "q3"), ("dtype", "float64"), ("ctx", "../../etc"), ("idx", -1), ("idx", True),
    ("cv", 99), ("sum", [2**33, 0, 0]), ("params", "f64"),
])
def test_header_fields_out_of_range_are_rejected(store, field, value):
    fields, payload = valid_header_fields(store)
    fields[field] = value
    put(store, file_with_header(msgpack.packb(fields), payload))
    elapsed, peak = bounded(lambda: assert_rejected(store))
    assert elapsed < 0.5 and peak < 2_000_000, (elapsed, peak)


def _frame_claiming(size: int, data: bytes) -> bytes:
    """An lz4 frame whose header claims ``size`` bytes but whose blocks hold ``data``."""
    head = lz4.frame.LZ4FrameCompressor(content_checksum=True, block_linked=False,
                                        block_size=lz4.frame.BLOCKSIZE_MAX1MB).begin(size)
    c = lz4.frame.LZ4FrameCompressor(content_checksum=True, block_linked=False,
                                     block_size=lz4.frame.BLOCKSIZE_MAX1MB)
    c.begin()
    return head + c.compress(data) + c.flush()


def hostile_frame_file(store: ChunkStore, frame: bytes) -> bytes:
    fields, _ = valid_header_fields(store)
    n = fields["shape"][0]
    fields["off"] = list(range(0, n * len(frame), len(frame)))
    fields["len"] = [len(frame)] * n
    fields["sum"] = [int.from_bytes(frame[-4:], "little")] * n
    return file_with_header(msgpack.packb(fields), frame * n)


def test_lz4_frame_claiming_a_huge_size_is_rejected_before_decompressing(store):
    frame = _frame_claiming(2**40, bytes(1000))
    put(store, hostile_frame_file(store, frame))
    elapsed, peak = bounded(lambda: assert_rejected(store))
    assert elapsed < 0.5 and peak < 2_000_000


def test_lz4_bomb_with_an_honest_looking_size_is_cut_off(store):
    """The frame claims the record size but decompresses to 64 MiB: output is bounded."""
    rec = C.CODECS["raw"].record_nbytes(SMALL[1:], "float32")
    frame = _frame_claiming(rec, bytes(64 << 20))
    assert lz4.frame.get_frame_info(frame)["content_size"] == rec and len(frame) < 400_000
    put(store, hostile_frame_file(store, frame))
    elapsed, peak = bounded(lambda: assert_rejected(store))
    assert elapsed < 0.5 and peak < 4_000_000, (elapsed, peak)


def test_frame_without_content_size_is_rejected(store):
    rec = C.CODECS["raw"].record_nbytes(SMALL[1:], "float32")
    frame = lz4.frame.compress(bytes(rec), store_size=False, content_checksum=True)
    put(store, hostile_frame_file(store, frame))
    assert "content size" in str(assert_rejected(store))


def test_oversized_file_is_refused_unread(tmp_path):
    from storage.chunkfile import ChunkStoreConfig

    store = ChunkStore(tmp_path, ChunkStoreConfig(max_file_bytes=1 << 20), fingerprint=FP)
    put(store, b"")
    with open(store.path(KEY, 0), "r+b") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB claimed, nothing allocated
    elapsed, peak = bounded(lambda: assert_rejected(store))
    assert elapsed < 0.5 and peak < 100_000
