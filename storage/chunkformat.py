"""The on-disk format of one chunk file: a fixed prefix, a msgpack header, per-layer lz4 frames.

Layout (little-endian)::

    0   8 B  magic b"KVCHUNK\\n"
    8   2 B  format version (FORMAT_VERSION)
    10  2 B  reserved, zero
    12  4 B  header length in bytes (<= the reader's cap)
    16  4 B  crc32 of the header bytes
    20  header: msgpack map, see ChunkHeader
    20+header_len  payload: one lz4 frame per layer, back to back; layer i at payload offset off[i]

Every lz4 frame stores its content size and an xxh32 content checksum; the header repeats each
frame's checksum (the frame's last 4 bytes), so a frame from another file or another write does not
pass. The file's identity checksum (what the registry stores) is the crc32 of the header bytes, which
covers the codec, shape, token range and every layer checksum.

Reading is defensive: the prefix is checked before the header is parsed; the header length is
capped; msgpack is parsed with explicit limits and then checked field by field; frame sizes are
checked against the header before anything is decompressed, and decompression output is bounded.
Anything that does not match raises CorruptChunkError (or ChunkVersionError), never returns data.

This module deliberately knows nothing about paths, directories, caps or throttles: it turns
headers and frames into bytes and validates bytes that come back.
"""

from __future__ import annotations

import itertools
import re
import struct
import zlib
from dataclasses import dataclass

import lz4.frame
import msgpack
import numpy as np

from storage.codecs import CODECS, COMPUTE_DTYPES, PARAM_DTYPES
from storage.errors import ChunkVersionError, CorruptChunkError

MAGIC = b"KVCHUNK\n"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sHHII")
PREFIX_NBYTES = _PREFIX.size  # 20
_LZ4_MAGIC = b"\x04\x22\x4d\x18"
_MAX_LAYERS = 4096  # a sanity bound on the header's arrays, far above any real model
_MAX_DIM = 1 << 20  # per-dimension sanity bound of a chunk shape

_FIELDS = {  # header key -> accepted python type(s) after msgpack decoding
    "fp": str, "ctx": str, "idx": int, "tok": list, "level": str, "cv": int, "dtype": str,
    "params": str, "shape": list, "rec": int, "off": list, "len": list, "sum": list,
}
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
    record_nbytes: int  # decompressed bytes of one layer record
    offsets: tuple[int, ...]  # per-layer frame offset within the payload
    lengths: tuple[int, ...]  # per-layer frame length
    checksums: tuple[int, ...]  # per-layer lz4 content checksum (xxh32 of the record)

    @property
    def payload_nbytes(self) -> int:
        return sum(self.lengths)


def pack(h: ChunkHeader) -> tuple[bytes, int]:
    """(prefix + header bytes, header crc32)."""
    body = msgpack.packb({
        "fp": h.fingerprint, "ctx": h.context, "idx": h.index, "tok": [h.token_start, h.token_end],
        "level": h.level, "cv": h.codec_version, "dtype": h.dtype, "params": h.params,
        "shape": list(h.shape), "rec": h.record_nbytes, "off": list(h.offsets),
        "len": list(h.lengths), "sum": list(h.checksums),
    }, use_bin_type=True)
    crc = zlib.crc32(body)
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(body), crc) + body, crc


def compress_record(record: memoryview, level: int) -> tuple[bytes, int]:
    """(lz4 frame with size and content checksum, that checksum)."""
    frame = lz4.frame.compress(record, compression_level=level, content_checksum=True,
                               store_size=True, block_linked=False,
                               block_size=lz4.frame.BLOCKSIZE_MAX1MB)
    return frame, int.from_bytes(frame[-4:], "little")


def parse_prefix(prefix: bytes, file_nbytes: int, max_header_nbytes: int) -> tuple[int, int]:
    """Validate the fixed prefix; returns (header length, header crc32)."""
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
    if PREFIX_NBYTES + hlen > file_nbytes:
        raise CorruptChunkError("file ends inside its header (truncated)")
    return hlen, crc


def parse_header(body: bytes, crc: int, max_record_nbytes: int) -> ChunkHeader:
    """Check the crc, parse the msgpack map with limits, validate every field."""
    if zlib.crc32(body) != crc:
        raise CorruptChunkError("header checksum mismatch")
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, use_list=True,
                                max_buffer_size=max(len(body), 1), max_str_len=4096,
                                max_bin_len=0, max_ext_len=0, max_array_len=_MAX_LAYERS,
                                max_map_len=len(_FIELDS))
    try:
        unpacker.feed(body)
        raw = unpacker.unpack()
        extra = unpacker.tell() != len(body)
    except Exception as e:  # msgpack raises a zoo of ValueError/OutOfData/StackError subclasses
        raise CorruptChunkError(f"header is not valid msgpack: {type(e).__name__}") from e
    if extra:
        raise CorruptChunkError("header has trailing bytes")
    if not isinstance(raw, dict) or set(raw) != set(_FIELDS):
        raise CorruptChunkError("header does not have the expected fields")
    for key, typ in _FIELDS.items():
        if type(raw[key]) is not typ:  # exact: bool is not an int here
            raise CorruptChunkError(f"header field {key!r} has type {type(raw[key]).__name__}")
    return _validate(raw, max_record_nbytes)


def _ints(values: list, lo: int, hi: int, what: str) -> tuple[int, ...]:
    # map/min/max run in C: this is checked for every chunk read (bool is not an int here)
    if values and (set(map(type, values)) != {int} or min(values) < lo or max(values) > hi):
        raise CorruptChunkError(f"header {what} out of range")
    return tuple(values)


def _validate(raw: dict, max_record_nbytes: int) -> ChunkHeader:
    shape = _ints(raw["shape"], 1, _MAX_DIM, "shape")
    if len(shape) != 5 or shape[1] != 2 or shape[0] > _MAX_LAYERS:
        raise CorruptChunkError(f"header shape {shape} is not [L, 2, Hkv, T, D]")
    tok = _ints(raw["tok"], 0, 1 << 40, "token range")
    if len(tok) != 2 or tok[1] - tok[0] != shape[3]:
        raise CorruptChunkError("header token range does not match the shape's T")
    if raw["level"] not in CODECS or raw["dtype"] not in COMPUTE_DTYPES:
        raise CorruptChunkError(f"header names unknown level {raw['level'][:32]!r} or dtype")
    codec = CODECS[raw["level"]]
    if raw["cv"] != codec.version:
        raise ChunkVersionError(f"{raw['level']} codec version {raw['cv']}; this code reads "
                                f"{codec.version}")
    if raw["params"] not in ("",) + tuple(PARAM_DTYPES):
        raise CorruptChunkError("header names unknown parameter dtype")
    if not CONTEXT_KEY_RE.match(raw["ctx"]) or raw["idx"] < 0:
        raise CorruptChunkError("header context key or chunk index malformed")
    rec = codec.record_nbytes(shape[1:], raw["dtype"], raw["params"] or "f16")
    if raw["rec"] != rec or rec > max_record_nbytes:
        raise CorruptChunkError(f"header record size {raw['rec']} (expected {rec}, cap "
                                f"{max_record_nbytes})")
    nl = shape[0]
    off = _ints(raw["off"], 0, 1 << 40, "offsets")
    lens = _ints(raw["len"], 1, 1 << 40, "lengths")
    sums = _ints(raw["sum"], 0, 0xFFFFFFFF, "checksums")
    if not len(off) == len(lens) == len(sums) == nl:
        raise CorruptChunkError("header per-layer arrays do not have one entry per layer")
    if list(itertools.accumulate(lens[:-1], initial=0)) != list(off):
        raise CorruptChunkError("header layer frames are not contiguous")
    return ChunkHeader(raw["fp"], raw["ctx"], raw["idx"], tok[0], tok[1], raw["level"], raw["cv"],
                       raw["dtype"], raw["params"], shape, rec, off, lens, sums)  # type: ignore[arg-type]


def decompress_records(blob: memoryview, h: ChunkHeader, layers: range, base: int) -> np.ndarray:
    """Decompress the frames of ``layers`` from ``blob`` (which starts at payload offset ``base``).

    Returns uint8 [len(layers), record_nbytes] (read-only). Each frame must be an lz4 frame that
    declares exactly the record size and ends with the content checksum the header names; this is
    checked on every frame's descriptor (vectorised) before anything is decompressed, and the
    output of each frame is bounded to the record size whatever the frame holds.
    """
    rec = h.record_nbytes
    starts = np.asarray(h.offsets[layers.start:layers.stop], np.int64) - base
    lens = np.asarray(h.lengths[layers.start:layers.stop], np.int64)
    if lens.min() < 23:  # descriptor (15 B with content size) + end mark + checksum
        raise CorruptChunkError("layer frame too short to be an lz4 frame")
    raw = np.frombuffer(blob, np.uint8)
    desc = raw[starts[:, None] + np.arange(14)]  # [n, 14]: magic, FLG, BD, content size
    magic_ok = (desc[:, :4] == np.frombuffer(_LZ4_MAGIC, np.uint8)).all(axis=1)
    # FLG: version 01, content size and content checksum present, no dictionary id
    flg_ok = (desc[:, 4] & 0xCD) == 0x4C
    claimed = desc[:, 6:14].copy().view("<u8")[:, 0]
    trailer = raw[(starts + lens - 4)[:, None] + np.arange(4)].copy().view("<u4")[:, 0]
    bad = ~(magic_ok & flg_ok & (claimed == rec)
            & (trailer == np.asarray(h.checksums[layers.start:layers.stop], np.uint32)))
    if bad.any():
        i = layers.start + int(np.argmax(bad))
        raise CorruptChunkError(f"layer {i}: not an lz4 frame with content size and checksum "
                                f"declaring {rec} bytes and the header's checksum")
    # The low-level frame API takes the memoryview as is (LZ4FrameDecompressor.decompress copies
    # it first); a context is ready for the next frame once a frame ends.
    ctx = lz4.frame.create_decompression_context()
    parts = []
    for i, o, n in zip(layers, starts.tolist(), lens.tolist()):
        try:
            data, used, ended = lz4.frame.decompress_chunk(ctx, blob[o:o + n], max_length=rec)
        except Exception as e:  # lz4 reports bad data and checksum mismatches as RuntimeError
            raise CorruptChunkError(f"layer {i}: frame does not decompress: {e}") from e
        if len(data) != rec or not ended or used != n:
            raise CorruptChunkError(f"layer {i}: frame decompresses to the wrong size or has "
                                    "trailing data")
        parts.append(data)
    return np.frombuffer(b"".join(parts), np.uint8).reshape(len(parts), rec)
