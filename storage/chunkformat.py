"""The on-disk format of one chunk record: a fixed prefix, a msgpack header, per-layer records.

This module deliberately knows nothing about paths, directories, caps or throttles: it turns
headers and records into bytes and validates bytes that come back.

A pack file (:mod:`storage.packindex`) holds such records back to back, each at a multiple of 64
bytes; offsets below are from the record's start. A pack of one chunk is what format 2 stored as
one file per chunk, byte for byte.

Layout (format version 2, little-endian)::

    0   8 B  magic b"KVCHUNK\\n"
    8   2 B  format version (FORMAT_VERSION)
    10  2 B  reserved, zero
    12  4 B  header length in bytes (<= the reader's cap)
    16  4 B  crc32 of the header bytes
    20  header: msgpack map, see ChunkHeader
        zero padding up to payload_start(header length), the next multiple of 64
    payload: one stored record per layer, back to back; layer i at payload offset sum(len[:i])

A layer's stored record is its codec record as is (``len == rec``) or, when lz4 saves at least an
eighth of it, one lz4 block (``len < rec``) that decompresses to exactly ``rec`` bytes. The header
holds the crc32 of every stored record (a partial read checks the layers it reads) and the crc32 of
the whole payload (a full read checks the payload in one pass). The file's identity checksum (what
the registry stores) is the crc32 of the header bytes, which covers the codec, shape, token range and
every payload checksum.

Why not lz4 frames with xxh32 content checksums (format version 1): lz4 saves almost nothing on K/V
records while per-layer frames made the checked read CPU-bound (a frame call per layer, an xxh32
pass and two copies of every byte). A full read is one read into a fresh buffer, one crc32 pass
(GIL released) and a zero-copy view when no layer is compressed; the 64-byte alignment lets decoders
use the records in place. Version 1 files are refused with ChunkVersionError (the registry's
verify() marks them for recompute).

Reading is defensive: the prefix is checked before the header is parsed; the header length is
capped; msgpack is parsed with explicit limits and then checked field by field; the file size must
equal the header's promise before the payload is touched; lz4 output is bounded to the record size.
Anything that does not match raises CorruptChunkError (or ChunkVersionError), never returns data.
"""

from __future__ import annotations

import ctypes
import itertools
import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import lz4.block
import msgpack
import numpy as np

from storage.codecs import CODECS, COMPUTE_DTYPES, EncodedChunk
from storage.errors import ChunkVersionError, CorruptChunkError
from storage.quantize import PARAM_DTYPES

MAGIC = b"KVCHUNK\n"
FORMAT_VERSION = 2
_PREFIX = struct.Struct("<8sHHII")
PREFIX_NBYTES = _PREFIX.size  # 20
PAYLOAD_ALIGN = 64  # payload start alignment in the file (bytes)
_MAX_LAYERS = 4096  # a sanity bound on the header's arrays, far above any real model
_MAX_DIM = 1 << 20  # per-dimension sanity bound of a chunk shape
_LZ4_MAX_RATIO = 256  # lz4 never expands data more than ~255x: a shorter block is hostile

_FIELDS = {  # header key -> accepted python type after msgpack decoding
    "fp": str, "ctx": str, "idx": int, "tok": list, "level": str, "cv": int, "dtype": str,
    "params": str, "shape": list, "rec": int, "len": list, "sum": list, "psum": int,
}
_FIELD_SET = frozenset(_FIELDS)
CONTEXT_KEY_RE = re.compile(r"^[0-9a-f]{8,64}$")


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """What a chunk file says about itself (all sizes in bytes)."""

    fingerprint: str  # model fingerprint given by the writer; readers refuse another model's chunks
    context: str  # context key, ^[0-9a-f]{8,64}$
    index: int  # chunk index within the context
    token_start: int  # first token position covered (inclusive)
    token_end: int  # last token position covered (exclusive); T = token_end - token_start
    level: str  # codec name
    codec_version: int  # codec version of the records
    dtype: str  # compute dtype name of the source
    params: str  # quantization parameter dtype ("f16", "f32" or "")
    shape: tuple[int, int, int, int, int]  # [L, 2, Hkv, T, D] of the whole chunk
    record_nbytes: int  # decoded bytes of one layer record
    lengths: tuple[int, ...]  # per-layer stored length (== record_nbytes: as is; less: lz4 block)
    checksums: tuple[int, ...]  # per-layer crc32 of the stored bytes
    payload_checksum: int  # crc32 of the whole payload (every stored layer, in order)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Per-layer offset within the payload (derived from the lengths, not stored)."""
        return tuple(itertools.accumulate(self.lengths[:-1], initial=0))

    @property
    def payload_nbytes(self) -> int:
        return sum(self.lengths)


#: compute crc32 of large buffers with storage/crc32.c (PCLMULQDQ) when it builds here (tests switch it off)
USE_NATIVE_CRC = True
_crc_lib: list = []  # [the crc32_update function or None], filled on first use
_NATIVE_CRC_MIN = 4096  # below this zlib is as fast as the call through ctypes
_CRC32_C = Path(__file__).with_name("crc32.c")


def _crc_fn():
    if not _crc_lib:
        from engine import native  # imported on first use, as the kernel is built

        lib = native.load("crc32", _CRC32_C)
        fn = None
        if lib is not None and lib.crc32_fast():
            fn = lib.crc32_update
            fn.argtypes = (ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t)
            fn.restype = ctypes.c_uint32
        _crc_lib.append(fn)
    return _crc_lib[0]


def crc32(data, value: int = 0) -> int:
    """``zlib.crc32(data, value)``, the same number, at memory speed for large buffers where the CPU
    has carry-less multiplication (storage/crc32.c, several times zlib's speed). ``data``: a
    contiguous uint8 numpy array, bytes or a memoryview of bytes."""
    n = len(data)
    if n < _NATIVE_CRC_MIN or not USE_NATIVE_CRC:
        return zlib.crc32(data, value)
    fn = _crc_fn()
    if fn is None:
        return zlib.crc32(data, value)
    arr = data if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
    if not arr.flags.c_contiguous:
        return zlib.crc32(data, value)
    return fn(value, arr.__array_interface__["data"][0], arr.nbytes)


def payload_start(header_nbytes: int) -> int:
    """File offset of the payload after a header of that length (64-byte aligned)."""
    return -(-(PREFIX_NBYTES + header_nbytes) // PAYLOAD_ALIGN) * PAYLOAD_ALIGN


def pack(h: ChunkHeader) -> tuple[bytes, int]:
    """(prefix + header bytes + zero padding up to the payload, header crc32)."""
    body = msgpack.packb({
        "fp": h.fingerprint, "ctx": h.context, "idx": h.index, "tok": [h.token_start, h.token_end],
        "level": h.level, "cv": h.codec_version, "dtype": h.dtype, "params": h.params,
        "shape": list(h.shape), "rec": h.record_nbytes, "len": list(h.lengths),
        "sum": list(h.checksums), "psum": h.payload_checksum,
    }, use_bin_type=True)
    crc = zlib.crc32(body)
    head = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(body), crc) + body
    return head + bytes(payload_start(len(body)) - len(head)), crc


def store_records(enc: EncodedChunk, lz4_level: int) -> tuple[list, list[int], list[int], int]:
    """(stored record per layer, their lengths, their crc32s, crc32 of them all in order).

    A layer is stored lz4-compressed only when that saves at least an eighth of its bytes
    (``lz4_level`` < 0: never tried; 0-2: fast mode; 3-16: high-compression level).
    """
    rec = enc.record_nbytes
    keep_below = rec - rec // 8
    parts, lens, sums, total = [], [], [], 0
    for i in range(enc.shape[0]):
        part = enc.layer(i)
        if lz4_level >= 0:
            packed = (lz4.block.compress(part, store_size=False) if lz4_level < 3 else
                      lz4.block.compress(part, store_size=False, mode="high_compression",
                                         compression=lz4_level))
            if len(packed) <= keep_below:
                part = packed
        parts.append(part)
        lens.append(len(part))
        sums.append(crc32(part))
        total = crc32(part, total)
    return parts, lens, sums, total


def parse_prefix(prefix, file_nbytes: int, max_header_nbytes: int) -> tuple[int, int]:
    """Validate the fixed prefix (any buffer); returns (header length, header crc32)."""
    if len(prefix) < PREFIX_NBYTES:
        raise CorruptChunkError(f"chunk file of {file_nbytes} bytes is shorter than its prefix")
    magic, version, reserved, hlen, crc = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise CorruptChunkError("not a chunk file (wrong magic)")
    if version != FORMAT_VERSION:
        raise ChunkVersionError(f"chunk format version {version}; this code reads {FORMAT_VERSION}")
    if reserved != 0:
        raise CorruptChunkError("reserved prefix bytes are not zero")
    if hlen == 0 or hlen > max_header_nbytes:
        raise CorruptChunkError(f"header length {hlen} outside (0, {max_header_nbytes}]")
    if payload_start(hlen) > file_nbytes:
        raise CorruptChunkError("file ends inside its header (truncated)")
    return hlen, crc


def parse_header(body: bytes | memoryview, crc: int, max_record_nbytes: int) -> ChunkHeader:
    """Check the crc, parse the msgpack map with limits, validate every field."""
    if zlib.crc32(body) != crc:
        raise CorruptChunkError("header checksum mismatch")
    try:  # limits: no string, array or map can claim more than the header could hold
        raw = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True,
                              max_str_len=4096, max_bin_len=0, max_ext_len=0,
                              max_array_len=_MAX_LAYERS, max_map_len=len(_FIELDS))
    except Exception as e:  # msgpack raises ValueError/ExtraData/StackError/...; all mean corrupt
        raise CorruptChunkError(f"header is not valid msgpack: {type(e).__name__}") from e
    if type(raw) is not dict or raw.keys() != _FIELD_SET:
        raise CorruptChunkError("header does not have the expected fields")
    for key, typ in _FIELDS.items():
        if type(raw[key]) is not typ:  # exact: bool is not an int here
            raise CorruptChunkError(f"header field {key!r} has type {type(raw[key]).__name__}")
    return _validate(raw, max_record_nbytes)


def _bounded(values: list, lo: int, hi: int, what: str) -> tuple[int, ...]:
    # min/max run in C: this is checked for every chunk read (types were checked by the caller)
    if values and (min(values) < lo or max(values) > hi):
        raise CorruptChunkError(f"header {what} out of range")
    return tuple(values)


def _validate(raw: dict, max_record_nbytes: int) -> ChunkHeader:
    shape, tok, lens, sums = raw["shape"], raw["tok"], raw["len"], raw["sum"]
    if set(map(type, shape + tok + lens + sums)) - {int}:  # exact: bool is not an int here
        raise CorruptChunkError("header arrays hold something other than integers")
    shape = _bounded(shape, 1, _MAX_DIM, "shape")
    if len(shape) != 5 or shape[1] != 2 or shape[0] > _MAX_LAYERS:
        raise CorruptChunkError(f"header shape {shape} is not [L, 2, Hkv, T, D]")
    tok = _bounded(tok, 0, 1 << 40, "token range")
    if len(tok) != 2 or tok[1] - tok[0] != shape[3]:
        raise CorruptChunkError("header token range does not match the shape's T")
    codec = CODECS.get(raw["level"])
    if codec is None or raw["dtype"] not in COMPUTE_DTYPES:
        raise CorruptChunkError(f"header names unknown level {raw['level'][:32]!r} or dtype")
    if raw["cv"] != codec.version:
        raise ChunkVersionError(f"{raw['level']} codec version {raw['cv']}; this code reads "
                                f"{codec.version}")
    if raw["params"] and raw["params"] not in PARAM_DTYPES:
        raise CorruptChunkError("header names unknown parameter dtype")
    if not CONTEXT_KEY_RE.match(raw["ctx"]) or raw["idx"] < 0:
        raise CorruptChunkError("header context key or chunk index malformed")
    rec = codec.record_nbytes(shape[1:], raw["dtype"], raw["params"] or "f16")
    if raw["rec"] != rec or rec > max_record_nbytes:
        raise CorruptChunkError(f"header record size {raw['rec']} (expected {rec}, cap "
                                f"{max_record_nbytes})")
    nl = shape[0]
    lens = _bounded(lens, -(-rec // _LZ4_MAX_RATIO), rec, "record lengths")
    sums = _bounded(sums, 0, 0xFFFFFFFF, "checksums")
    if not len(lens) == len(sums) == nl or not 0 <= raw["psum"] <= 0xFFFFFFFF:
        raise CorruptChunkError("header per-layer arrays do not have one entry per layer")
    return ChunkHeader(raw["fp"], raw["ctx"], raw["idx"], tok[0], tok[1], raw["level"], raw["cv"],
                       raw["dtype"], raw["params"], shape, rec, lens, sums,  # type: ignore[arg-type]
                       raw["psum"])


def check_padding(pad: memoryview) -> None:
    """The bytes between the header and the payload must be zero."""
    if pad != bytes(len(pad)):
        raise CorruptChunkError("padding after the header is not zero")


def records(blob: np.ndarray, h: ChunkHeader, layers: range, checked: bool) -> np.ndarray:
    """Records [len(layers), record_nbytes] of ``layers`` from ``blob``, their stored bytes in order.

    ``checked``: the caller already verified ``blob`` (the whole payload against the header's
    payload crc32); otherwise each layer is checked against its own crc32 here. ``blob`` is a
    writable uint8 array; when no layer is compressed the result is a zero-copy view of it.
    """
    rec = h.record_nbytes
    lens = h.lengths[layers.start:layers.stop]
    if len(blob) != sum(lens):
        raise CorruptChunkError("file ends inside its payload (truncated)")
    plain = min(lens) == rec  # every layer stored as is (lengths are validated <= rec)
    if checked and plain:
        return blob.reshape(len(lens), rec)
    out = blob.reshape(len(lens), rec) if plain else np.empty((len(lens), rec), np.uint8)
    o = 0
    for i, n in zip(layers, lens):
        part = blob[o:o + n]
        o += n
        if not checked and crc32(part) != h.checksums[i]:
            raise CorruptChunkError(f"layer {i}: checksum mismatch")
        if n == rec:
            if not plain:
                out[i - layers.start] = part
            continue
        try:
            data = lz4.block.decompress(part, uncompressed_size=rec)
        except Exception as e:  # lz4 reports bad data as LZ4BlockError
            raise CorruptChunkError(f"layer {i}: lz4 block does not decompress: {e}") from e
        if len(data) != rec:
            raise CorruptChunkError(f"layer {i}: lz4 block decompresses to {len(data)} bytes, "
                                    f"not {rec}")
        out[i - layers.start] = np.frombuffer(data, np.uint8)
    return out
