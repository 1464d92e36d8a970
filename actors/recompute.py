"""The recompute worker (LLMS §3.3, Fig. 8; docs/design.md §4 step 3), and the shared-memory working
set it and the executor both map (made, sized, and its dead executors' segments removed here).

The worker holds the model (weights memory-mapped read-only, shared with the executor) and maps the
executor's working set, a shared-memory buffer `[L, 2, Hkv, capacity, D]`. For a restore it decodes the
resident chunks, then consumes the KV swap/IO worker's per-layer-group stream: as soon as the layers of
group `g` of every loaded chunk have arrived and been decoded, it recomputes those layers of the
planned chunks (`Transformer.recompute_layer`), while the IO worker already reads group `g+1`.
Nothing but encoded chunk bytes crosses processes (numpy arrays out of the object store, zero-copy); the
decoded K/V are written in place, where the executor attends to them.

The restore itself is `actors.restore.restore`, the same algorithm the executor runs. A chunk whose
file turns out missing or corrupt is recomputed instead, so a restore never yields wrong K/V.

torch, the restore and the K/V buffer are imported where they are used: `actors.ray_actors` imports
this module in the governor's and IO worker's processes too, which then never load torch (about
180 MiB of memory each).
"""

from __future__ import annotations

import logging
import os
from multiprocessing import shared_memory
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from actors.config import Tuning, private_files
from actors.messages import RestoreRequest, RestoreStats
from engine.config import ModelConfig

if TYPE_CHECKING:
    import torch

    from engine.kvcache import KVCache


_STAGE_OF = {"resident": "decode", "decode": "decode", "read": "io", "recompute": "recompute"}


def stage_seconds(timeline) -> dict[str, float]:
    """Seconds of each restore stage (scheduler.pipeline.STAGES) from a restore's timeline: reads,
    de-quantizing (resident and loaded chunks), recompute. Reads overlap the consumer's work in a
    pipelined restore; each stage is summed on its own."""
    out = {"io": 0.0, "decode": 0.0, "recompute": 0.0}
    for what, _where, a, b in timeline:
        stage = _STAGE_OF.get(what)
        if stage is not None and b > a:
            out[stage] += b - a
    return out


def _working_set_shape(cfg: ModelConfig, capacity: int, kv_format: str) -> tuple[tuple[int, ...], type]:
    from engine.kvcache import buffer_shape

    return buffer_shape(cfg, capacity, kv_format), np.uint8 if kv_format == "kv8" else np.float32


def working_set_nbytes(cfg: ModelConfig, capacity: int, kv_format: str = "float") -> int:
    """Bytes of a float32 (or `kv8`) working set of `capacity` tokens."""
    shape, dtype = _working_set_shape(cfg, capacity, kv_format)
    return int(np.prod(shape)) * np.dtype(dtype).itemsize


class FileSegment:
    """A working set in a file on disk (a streamable one, `actors.admission.streamable_working_set`),
    closed and unlinked as a `shared_memory.SharedMemory` segment is."""

    def __init__(self, file) -> None:
        self.file = file
        self.name = file.path

    def close(self) -> None:
        """The mapping goes with the last view of it."""

    def unlink(self) -> None:
        self.file.unlink()


def shared_working_set(cfg: ModelConfig, capacity: int, name: str, create: bool,
                       kv_format: str = "float") -> tuple[shared_memory.SharedMemory, torch.Tensor]:
    """A float32 `[L, 2, Hkv, capacity, D]` tensor (`kv8`: uint8 rows of D + 4) over POSIX shared
    memory `name`. Pages cost memory only once written. (A streamable working set is a file instead:
    `actors.admission.streamable_working_set`, mapped by `engine.kvcache.KVCache.mapped`.)"""
    import torch

    from actors.swapio import attach_segment

    shape, dtype = _working_set_shape(cfg, capacity, kv_format)
    if create:
        try:  # a segment left by a crashed executor of the same name
            old = shared_memory.SharedMemory(name=name)
            old.close()
            old.unlink()
        except FileNotFoundError:
            pass
        shm = shared_memory.SharedMemory(name=name, create=True,
                                         size=working_set_nbytes(cfg, capacity, kv_format))
    else:
        shm = attach_segment(name)
    arr = np.ndarray(shape, dtype=dtype, buffer=shm.buf)
    return shm, torch.from_numpy(arr)


class RecomputeWorker:
    """Actor body: the model plus a view of the executor's shared working set."""

    def __init__(self, model_dir: str, fingerprint: str, engine_cfg, io=None, threads: int = 1,
                 tuning: Tuning = Tuning(), adapter_root: str | None = None) -> None:
        import torch

        from engine.lora import AdapterSet
        from engine.model import Transformer

        torch.set_num_threads(max(1, threads))
        private_files()
        self.streaming_stores = tuning.streaming_stores
        self.model = Transformer.from_directory(model_dir, engine_cfg, fingerprint=fingerprint)
        self.chunk_tokens = engine_cfg.chunk_tokens
        self.adapters = AdapterSet(adapter_root, self.model.cfg, device=self.model.device, dtype=self.model.dtype)
        """Loaded as restores name them (`AdapterSet.resolve`): the executor's registry is the node's."""
        if io is not None:
            from actors.ray_stubs import SwapIOStub

            io = SwapIOStub(io)
        self.io = io
        self.shm = None
        self.shm_name = ""
        self.ws: KVCache | None = None

    def _attach(self, name: str, capacity: int) -> KVCache:
        """Map the executor's working set; again after the executor restarted with a new segment."""
        from engine.kvcache import KVCache

        if self.shm is None or self.shm_name != name:
            if self.shm is not None:
                self.shm.close()
            kv_format = self.model.engine_cfg.kv_format
            if os.sep in name:  # a file (a streamable working set): mapped with a pager of its own, so
                # a restore can write the layers it streams out of this process's memory too
                self.ws = KVCache.mapped(self.model.cfg, name, capacity, chunk_tokens=self.chunk_tokens,
                                         dtype=self.model.dtype, kv_format=kv_format, create=False)
                self.shm = FileSegment(self.ws.pager.file)
            else:
                self.shm, buf = shared_working_set(self.model.cfg, capacity, name, create=False, kv_format=kv_format)
                self.ws = KVCache.wrap(self.model.cfg, buf, chunk_tokens=self.chunk_tokens, dtype=self.model.dtype)
            self.shm_name = name
        return self.ws

    def forget_adapter(self, name: str) -> bool:
        """Unload adapter `name` if a restore loaded it here (the executor removed it from the node)."""
        if name not in self.adapters:
            return False
        self.adapters.remove(name)
        return True

    def loaded_adapters(self) -> list[str]:
        """Names of the adapters this worker holds."""
        return self.adapters.names()

    def restore(self, req: RestoreRequest) -> RestoreStats:
        """Run `req` (`actors.restore.restore`) on the executor's working set, consuming the IO
        worker's stream of layer groups as it reads them."""
        import ray

        from actors.ray_stubs import resolve_chunks
        from actors.restore import STREAMED_AHEAD, restore

        ws = self._attach(req.shm_name, req.capacity)
        ahead = STREAMED_AHEAD if req.resident_layers is not None else None  # a bounded stream
        adapter_key = req.adapter.key if req.adapter else ""
        items = (ray.get(ref) for ref in self.io.read_groups(req.ctx, req.load, req.groups, adapter_key, ahead)
                 ) if req.load else ()
        a = req.adapter
        adapter = self.adapters.resolve(a.name, a.path, a.key) if a is not None else None
        res, _whole = restore(ws, req, items, model=self.model, adapter=adapter, resolve=resolve_chunks,
                              streaming_stores=self.streaming_stores)
        return res


def unlink_stale_segments(prefix: str, folder: Path = Path("/dev/shm")) -> None:
    """Remove working-set segments (`<prefix>-ws-<pid>`, in `folder`) left by executors that died
    without closing them: this service's prefix, or any `llmaas*` one; a segment of a live process is
    left alone."""
    from actors.metrics import pid_alive

    for seg in folder.glob("*-ws-*"):
        owner, _, pid = seg.name.rpartition("-ws-")
        if pid.isdigit() and (owner == prefix or owner.startswith("llmaas")) and not pid_alive(int(pid)):
            seg.unlink(missing_ok=True)


def warn_if_shm_small(nbytes: int) -> None:
    """The working set is pages of /dev/shm, taken as they are first written: a
    tmpfs smaller than that (a container's default is 64 MB) would kill the executor with SIGBUS
    mid-restore, so say so at start."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        logging.getLogger(__name__).warning(
            "/dev/shm has %.0f MB free, less than the working set (%.0f MB): lower "
            "max_context_tokens, or give the container more (docker --shm-size)",
            free / 1e6, nbytes / 1e6)
