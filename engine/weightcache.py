"""The engine-layout weights of a checkpoint in a weight format other than the checkpoint's float32:
converted once into the model cache, memory-mapped read-only after (engine.quant says what each
format stores).

This module deliberately knows nothing about running the model (no torch at import): engine.layout
says which checkpoint tensors make each engine tensor, engine.quant how to quantize a matrix, and
engine.loader where the cache lives. `engine_arrays` is the one entry point for every format, fp32
included. The calibrated formats (`-gptq`) are the exception that runs it: their layer matrices come
from engine/gptq.py (imported then), which runs the float model on calibration text once.

Conversion streams. The output file's header is written first from the tensors' shapes; then one
source tensor (or, for the embedding table, one slice of rows) at a time is read with plain file
reads, converted and written at its offset, so the memory a conversion takes stays near the output's
size plus one tensor, whatever the checkpoint's size. When the checkpoint was converted from a GGUF
whose tensors are Q4_0 or Q4_1 and the format is int4 at group 32, those blocks are repacked as they
are (no value changes; Q4_0's symmetric, without minimums); everything else is quantized from the
checkpoint's float values.
"""

from __future__ import annotations

import fcntl
import json
import os
import struct
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from engine import quant
from engine.config import ModelConfig
from engine.layout import Piece, fuse_hf, layout
from engine.loader import (MANIFEST, cache_root, fused_weights, publish, read_safetensors, safetensors_metadata,
                           source_stamp)
from engine.quant import WeightFormat

WEIGHTS_FORMAT = "llmaas-weights-2"
"""The converted file's format tag (2: Q4_0 sources stored without minimums; files of 1 are rebuilt)."""
EMBED_SLICE_ROWS = 4096
"""Rows of a large table converted at a time (bounds conversion memory)."""

_ST_NAMES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.uint16): "BF16",
             np.dtype(np.uint8): "U8", np.dtype(np.int8): "I8"}

# checkpoint tensor -> GGUF tensor (the Llama-family names llama.cpp writes)
_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


# ---- reading the checkpoint ------------------------------------------------------------------------


class _Checkpoint:
    """The checkpoint directory's tensors by name: shapes from the headers, values by plain reads."""

    def __init__(self, directory: Path) -> None:
        self.info: dict[str, tuple[Path, int, str, tuple[int, ...]]] = {}
        for f in sorted(directory.glob("*.safetensors")):
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            for name, t in header.items():
                if name != "__metadata__":
                    self.info[name] = (f, 8 + n + t["data_offsets"][0], t["dtype"], tuple(t["shape"]))

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info[name][3]

    def read(self, name: str, r0: int = 0, r1: int | None = None) -> np.ndarray:
        """Rows `r0:r1` of a tensor as float32 (a fresh array; nothing stays mapped)."""
        path, offset, dtype, shape = self.info[name]
        dt = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}.get(dtype)
        if dt is None:
            raise quant.WeightFormatError(f"{name}: cannot convert a {dtype} tensor")
        rows = shape[0] if len(shape) > 1 else 1
        r1 = rows if r1 is None else r1
        width = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
        item = np.dtype(dt).itemsize
        with open(path, "rb") as fh:
            raw = os.pread(fh.fileno(), (r1 - r0) * width * item, offset + r0 * width * item)
        a = np.frombuffer(raw, dtype=dt)
        if dtype == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        a = a.astype(np.float32, copy=False)
        return a.reshape((r1 - r0, width)) if len(shape) > 1 else a


class _Gguf:
    """The Q4_0/Q4_1 blocks of the GGUF a checkpoint was converted from, when it is still there."""

    def __init__(self, path: Path, architecture: str, heads: int, kv_heads: int) -> None:
        import gguf

        reader = gguf.GGUFReader(str(path))
        self.path = path
        self.tensors = {t.name: (int(t.tensor_type), t.data_offset, int(t.n_bytes), [int(s) for s in t.shape])
                        for t in reader.tensors}
        self.permute = architecture == "llama"  # llama.cpp permutes Llama's Q/K rows for its rope
        self.heads, self.kv_heads = heads, kv_heads

    @classmethod
    def of(cls, directory: Path, heads: int, kv_heads: int) -> "_Gguf | None":
        try:
            source = Path(json.loads((directory / MANIFEST).read_text())["source"])
            cfg = json.loads((directory / "config.json").read_text())
        except (OSError, ValueError, KeyError):
            return None
        if not source.is_file():
            return None
        return cls(source, cfg.get("model_type", ""), heads, kv_heads)

    def _tensor(self, hf_name: str, rows: int, k: int):
        """(GGUF name, its entry) of a checkpoint tensor held as Q4_0/Q4_1 blocks of its shape, or None."""
        parts = hf_name.split(".")  # model.layers.{i}.{module}.{proj}.weight
        if len(parts) != 6 or parts[1] != "layers":
            return None
        name = _GGUF_NAMES.get(f"{parts[3]}.{parts[4]}")
        t = self.tensors.get(f"blk.{parts[2]}.{name}.weight") if name else None
        if t is None or t[0] not in (quant.GGUF_Q4_0, quant.GGUF_Q4_1) or t[3] != [k, rows]:
            return None
        return name, t

    def symmetric(self, hf_name: str, rows: int, k: int) -> bool:
        """Whether the tensor is Q4_0 blocks (repacked as a symmetric int4 triple: no minimums)."""
        found = self._tensor(hf_name, rows, k)
        return found is not None and found[1][0] == quant.GGUF_Q4_0

    def int4(self, hf_name: str, rows: int, k: int):
        """The int4 triple of a checkpoint tensor from its Q4_0/Q4_1 blocks, or None."""
        found = self._tensor(hf_name, rows, k)
        if found is None:
            return None
        name, t = found
        with open(self.path, "rb") as fh:
            raw = np.frombuffer(os.pread(fh.fileno(), t[2], t[1]), dtype=np.uint8)
        triple = quant.int4_from_gguf(raw.reshape(rows, -1), t[0], k)
        if self.permute and name in ("attn_q", "attn_k"):
            heads = self.heads if name == "attn_q" else self.kv_heads
            order = np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(2, 1).reshape(rows)
            triple = tuple(None if a is None else np.ascontiguousarray(a[order]) for a in triple)
        return triple


# ---- writing -----------------------------------------------------------------------------------------


class _Writer:
    """A safetensors file whose header is written first and whose tensors are filled in by rows."""

    def __init__(self, path: Path, specs: list[tuple[str, np.dtype, tuple[int, ...]]], meta: dict[str, str]):
        # widest items first, so every tensor's offset is aligned to its item size with no gaps
        specs = sorted(specs, key=lambda s: -np.dtype(s[1]).itemsize)
        header, offset = {"__metadata__": meta}, 0
        self.where: dict[str, tuple[int, int]] = {}
        for name, dt, shape in specs:
            size = int(np.prod(shape)) * np.dtype(dt).itemsize
            header[name] = {"dtype": _ST_NAMES[np.dtype(dt)], "shape": list(shape), "data_offsets": [offset, offset + size]}
            self.where[name] = (offset, 0)
            offset += size
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.base = 8 + len(blob)
        self.fh = open(path, "wb")
        self.fh.write(struct.pack("<Q", len(blob)) + blob)
        self.fh.truncate(self.base + offset)

    def append(self, name: str, rows: np.ndarray) -> None:
        """Write `rows` after what `name` already holds."""
        start, done = self.where[name]
        data = np.ascontiguousarray(rows).tobytes()
        os.pwrite(self.fh.fileno(), data, self.base + start + done)
        self.where[name] = (start, done + len(data))

    def close(self) -> None:
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()


def _symmetric(piece: Piece, ck: _Checkpoint, gguf: _Gguf | None) -> bool:
    """Whether an int4 piece is stored symmetric: every source is Q4_0 blocks in the GGUF (repacked)."""
    return gguf is not None and all(gguf.symmetric(s, *ck.shape(s)) for s in piece.sources)


def _specs(piece: Piece, ck: _Checkpoint, fmt: WeightFormat, tied: bool,
           gguf: _Gguf | None) -> list[tuple[str, np.dtype, tuple]]:
    shapes = [ck.shape(s) for s in piece.sources]
    rows = sum(s[0] for s in shapes)
    if piece.kind == "vector":
        return [(piece.name, np.float32, (rows,))]
    k = shapes[0][1]
    kind = _stored_as(piece, fmt, tied, ck)
    if kind == "int4":
        g = quant.groups_of(k, fmt.group)
        specs = [(f"{piece.name}.q", np.uint8, (rows, k // 2)), (f"{piece.name}.scale", np.float16, (rows, g))]
        return specs if _symmetric(piece, ck, gguf) else specs + [(f"{piece.name}.min", np.float16, (rows, g))]
    if kind == "int8":
        return [(f"{piece.name}.q", np.int8, (rows, k)), (f"{piece.name}.scale", np.float32, (rows,))]
    if kind == "bf16":
        return [(piece.name, np.uint16, (rows, k))]
    if kind == "fp16":
        return [(piece.name, np.float16, (rows, k))]
    if kind == "none":
        return []
    return [(piece.name, np.float32, (rows, k))]


def _stored_as(piece: Piece, fmt: WeightFormat, tied: bool, ck: _Checkpoint) -> str:
    """How one engine tensor is stored: `int4`, `int8`, `bf16`, `fp16`, `fp32` or `none` (not stored)."""
    if piece.kind == "vector":
        return "fp32"
    if piece.kind == "embed":
        # a tied model under a quantized head reads its rows from that head (no second copy); other
        # tables stay in the checkpoint's own float type (MNN-LLM §4.1: read per token, never whole)
        if tied and fmt.quantized and fmt.head == "int8":
            return "none"
        if fmt.name == "bf16":
            return "bf16"
        return {"BF16": "bf16", "F16": "fp16"}.get(ck.info[piece.sources[0]][2], "fp32")
    if piece.kind == "head":
        return fmt.head if fmt.quantized else fmt.name
    return fmt.name


def _to_bf16(a: np.ndarray) -> np.ndarray:
    u = a.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _convert(pieces: list[Piece], ck: _Checkpoint, gguf: _Gguf | None, fmt: WeightFormat, tied: bool,
             writer: _Writer, progress: Callable[[int], None], given: dict | None = None) -> str:
    """Fill the writer; returns `repacked` when every int4 matrix came from GGUF blocks as they are.
    `given`: int4 triples already made for some pieces (by name), written as they are. A piece whose
    sources are all Q4_0 is written symmetric (no `.min`, as `_specs` laid it out)."""
    repacked = fmt.name == "int4" and fmt.group == quant.BLOCK and gguf is not None
    for i, piece in enumerate(pieces):
        kind = _stored_as(piece, fmt, tied, ck)
        if kind == "int4" and given and piece.name in given:
            for suffix, a in zip((".q", ".scale", ".min"), given[piece.name]):
                writer.append(piece.name + suffix, a)
            progress(i + 1)
            continue
        for src in piece.sources if kind != "none" else ():
            shape = ck.shape(src)
            step = EMBED_SLICE_ROWS if len(shape) > 1 else 1
            rows = shape[0] if len(shape) > 1 else 1
            triple = gguf.int4(src, shape[0], shape[1]) if kind == "int4" and gguf is not None else None
            if kind == "int4":
                repacked = repacked and triple is not None
            if triple is not None:
                q, scale, lo = triple
                if lo is None and piece.name + ".min" in writer.where:  # Q4_0 fused with Q4_1 rows
                    lo = quant.symmetric_minimums(scale)
                for suffix, a in zip((".q", ".scale", ".min"), (q, scale, lo)):
                    if a is not None:
                        writer.append(piece.name + suffix, a)
                continue
            for r0 in range(0, rows, step):
                a = ck.read(src, r0, min(rows, r0 + step)) if len(shape) > 1 else ck.read(src)
                if kind == "int4":
                    for suffix, part in zip((".q", ".scale", ".min"), quant.quantize_int4(a, fmt.group)):
                        writer.append(piece.name + suffix, part)
                elif kind == "int8":
                    q, scale = quant.quantize_int8(a)
                    writer.append(piece.name + ".q", q)
                    writer.append(piece.name + ".scale", scale)
                elif kind == "bf16":
                    writer.append(piece.name, _to_bf16(a))
                elif kind == "fp16":
                    writer.append(piece.name, a.astype(np.float16))
                else:
                    writer.append(piece.name, a.astype(np.float32, copy=False))
        progress(i + 1)
    if given:
        return "calibrated (GPTQ)"
    return "repacked from the GGUF" if repacked else "converted"


def _calibration(fmt: WeightFormat) -> str:
    """The calibration's version a cache file of `fmt` must record ("" for formats without one)."""
    if not fmt.calibrated:
        return ""
    from engine.gptq import CALIBRATION_VERSION

    return CALIBRATION_VERSION


def converted_weights(directory: Path, fingerprint: str, fmt: WeightFormat, pieces: list[Piece], *,
                      tied: bool, heads: int, kv_heads: int, progress: bool = True) -> dict[str, np.ndarray]:
    """The engine tensors of `directory` in `fmt` (not fp32: that is engine.loader.fused_weights), from
    a cache file written once (atomically, one converter per machine) and memory-mapped read-only.
    The file records the stamp of the directory it was built from and is rebuilt when that changed."""
    target = cache_root() / "fused" / f"{fingerprint}-{fmt.tag}.safetensors"
    stamp = source_stamp(directory)
    calibration = _calibration(fmt)

    def current() -> bool:
        meta = safetensors_metadata(target)
        return (meta.get("format") == WEIGHTS_FORMAT and meta.get("source") == stamp and meta.get("weights") == fmt.tag
                and meta.get("calibration", "") == calibration)

    if not current():
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.parent / f".{target.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not current():
                _build(directory, target, fingerprint, fmt, pieces, tied, heads, kv_heads, stamp, progress)
    return read_safetensors(target.parent, only=target.name)


def _build(directory, target, fingerprint, fmt, pieces, tied, heads, kv_heads, stamp, progress) -> None:
    t0 = time.perf_counter()
    ck = _Checkpoint(directory)
    gguf = (_Gguf.of(directory, heads, kv_heads) if fmt.name == "int4" and fmt.group == quant.BLOCK
            and not fmt.calibrated else None)
    specs = [s for p in pieces for s in _specs(p, ck, fmt, tied, gguf)]
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    meta = {"format": WEIGHTS_FORMAT, "weights": fmt.tag, "fingerprint": fingerprint, "source": stamp}
    if fmt.calibrated:
        meta["calibration"] = _calibration(fmt)
    if progress:
        print(f"llmaas: converting the weights to {fmt.tag} once -> {target}", file=sys.stderr)
    tty = progress and sys.stderr.isatty()

    def step(done: int) -> None:
        if tty:
            print(f"\rllmaas: {done}/{len(pieces)} tensors", end="", file=sys.stderr, flush=True)

    given = None
    if fmt.calibrated:
        from engine.gptq import calibrated_int4

        given = calibrated_int4(directory, fingerprint, fmt.group, progress=progress)
    writer = _Writer(tmp, specs, meta)
    try:
        origin = _convert(pieces, ck, gguf, fmt, tied, writer, step, given)
        for name, (start, done) in writer.where.items():
            spec = next(s for s in specs if s[0] == name)
            if done != int(np.prod(spec[2])) * np.dtype(spec[1]).itemsize:
                raise RuntimeError(f"conversion wrote {done} bytes of {name}")
        writer.close()
    except BaseException:
        writer.fh.close()
        tmp.unlink(missing_ok=True)
        raise
    publish(tmp, target)
    if tty:
        print(file=sys.stderr)
    if progress:
        print(f"llmaas: {fmt.tag} weights ({origin}) written in {time.perf_counter() - t0:.1f} s", file=sys.stderr)


def engine_arrays(directory: str | Path, fingerprint: str | None, fmt: WeightFormat, *,
                  progress: bool = False) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """The model's configuration and its engine-layout arrays in `fmt`: fp32 from the fused cache
    (with a fingerprint) or fused here; other formats converted once into the model cache
    (engine.weightcache). Servers call it before starting the processes that load the model, so
    conversion happens once, with progress shown, and they only map the file."""
    directory = Path(directory)
    cfg = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    if fmt.name != "fp32":
        names = read_safetensors(directory).keys()
        return cfg, converted_weights(directory, fingerprint or source_stamp(directory), fmt, layout(cfg, names, fmt),
                                      tied=cfg.tie_embeddings, heads=cfg.n_heads, kv_heads=cfg.n_kv_heads,
                                      progress=progress)
    if fingerprint:
        return cfg, fused_weights(directory, fingerprint, lambda t: fuse_hf(t, cfg))
    return cfg, fuse_hf(read_safetensors(directory), cfg)


__all__ = ["converted_weights", "engine_arrays", "WEIGHTS_FORMAT"]
