"""Storage of KV chunks and contexts: codecs, chunk packs, the SQLite registry.

This package deliberately knows nothing about policies, the model or Ray: it encodes, stores,
checks and returns bytes, and records who owns what.

- :mod:`storage.codecs`: per-level encode/decode of a chunk's KV (raw, fp16, bf16, q8, q4, q2);
  :mod:`storage.quantize` the quantized levels, :mod:`storage.floatcast` the float conversions
- :mod:`storage.chunkstore`: ``ChunkStore``, crash-safe checksummed chunk records in per-context
  pack files (one per write-back) under one root; its parts :mod:`storage.packindex` (names and
  which record is current), :mod:`storage.packwriter`, :mod:`storage.compaction`,
  :mod:`storage.packreader`
- :mod:`storage.chunkformat`: the format of one chunk record (prefix, msgpack header, per-layer
  records); a pack is such records back to back
- :mod:`storage.registry`: ``Registry``, apps, contexts (token ids) and chunk states in SQLite
- :mod:`storage.errors`: the storage exceptions, each with a stable ``code``
- :mod:`storage.fileops`, :mod:`storage.throttle`, :mod:`storage.heap`: injectable file operations,
  a token bucket, process heap and collector settings

Imports numpy, msgpack, lz4, the standard library and :mod:`engine.native` (a standard-library leaf
that builds the C kernels) only, never torch or ray, so a process that only stores and loads KV
starts fast; the codecs use torch for float16 casts only when the process has already imported it.
This package does not re-export anything: import the module.
"""
