"""A working set larger than its budget (engine/kvspill.py): K/V in a mapped file whose streamed layers
leave this process's memory after each layer and come back per layer. The result is the in-memory
one's exactly (same buffer, same arithmetic), with the hidden state spilled too; what stays mapped
is measured from /proc/self/smaps; and each layer's write to disk begins before the next layer's
compute ends (the order of recorded events, driven by a gate)."""

from __future__ import annotations

import platform
import threading

import pytest
import torch

from engine.kvcache import KVCache
from engine.kvspill import PAGE, TRIM_SWITCH, MappedFile, trim_heap
from tests.conftest import SAMPLE_TEXT


def _mapped(model, tmp_path, capacity, name="ws"):
    return KVCache.mapped(model.cfg, tmp_path / name, capacity, chunk_tokens=model.engine_cfg.chunk_tokens,
                          dtype=model.dtype)


def _run(model, cache, ids, cached_ids, decode=6):
    if cached_ids:
        model.forward(cache, cached_ids)
    density = torch.zeros(cache.capacity)
    logits = model.forward(cache, ids, density=density)
    out, nxt = [], int(logits.argmax())
    for _ in range(decode):
        out.append(nxt)
        nxt = int(model.forward(cache, [nxt]).argmax())
    return logits, density, out


@pytest.mark.parametrize("resident, spill, cached", [(0, False, 0), (3, True, 0), (5, True, 40)])
def test_streamed_layers_give_the_in_memory_result(engine, tmp_path, monkeypatch, resident, spill, cached):
    model = engine.model
    monkeypatch.setattr(model.engine_cfg, "prefill_partition_rows", 48)
    doc = engine.tok.encode_document(SAMPLE_TEXT * 3)
    cached_ids, ids = doc[:cached], doc[cached : cached + 150]
    ref = _run(model, model.new_cache(256), ids, cached_ids)
    cache = _mapped(model, tmp_path, 256)
    cache.pager.set_resident(resident)
    cache.pager.spill_hidden = spill
    got = _run(model, cache, ids, cached_ids)
    cache.pager.settle()
    assert torch.equal(got[0], ref[0]) and got[2] == ref[2]
    assert torch.allclose(got[1], ref[1], rtol=1e-5, atol=1e-4)  # the kernel's threads sum density in any order
    writes = [e for e in cache.pager.events if e[0] == "write"]
    assert {e[1] for e in writes} == set(range(resident, model.cfg.n_layers))
    assert cache.pager.written_bytes == (cached + 150 + 6) * cache.pager.row_bytes * (model.cfg.n_layers - resident)


def test_streamed_layers_leave_memory(engine, tmp_path):
    """After a pass, only the resident layers' pages stay mapped here (measured, not estimated)."""
    model = engine.model
    n = 320
    cache = _mapped(model, tmp_path, n + 16)
    pager = cache.pager
    layer_used = n * pager.row_bytes  # the slab's rows in use
    pager.set_resident(2)
    model.forward(cache, list(range(300, 300 + n)))
    pager.settle()
    assert pager.file.resident_bytes() <= 2 * pager.layer_bytes + 4 * PAGE
    assert pager.file.resident_bytes() >= 2 * layer_used
    pager.set_resident(model.cfg.n_layers)  # all kept: the next pass leaves every layer mapped
    model.forward(cache, [7])
    assert pager.file.resident_bytes() >= model.cfg.n_layers * layer_used


def test_a_layers_write_overlaps_the_next_layers_compute(engine, tmp_path, monkeypatch):
    """Layer l + 1's compute does not end until layer l's write has begun (a gate in the step hook): a
    write run after the pass, or in line after the next layer, would never let it, and the recorded
    order would show it."""
    model = engine.model
    cache = _mapped(model, tmp_path, 128)
    pager = cache.pager
    pager.set_resident(0)
    order: list[tuple[str, int]] = []
    begun = {layer: threading.Event() for layer in range(model.cfg.n_layers)}

    def write_begins(layer):
        order.append(("write-begin", layer))
        begun[layer].set()

    def hook(step, layer):
        if step == "mlp":
            if layer > 0:
                begun[layer - 1].wait(60)  # a guard against a hang, never reached when the pass overlaps
            order.append(("compute-end", layer))

    pager.bg.before_write = write_begins
    monkeypatch.setattr(model, "step_hook", hook)
    model.forward(cache, list(range(100, 196)))
    pager.settle()
    for layer in range(model.cfg.n_layers - 1):
        assert order.index(("write-begin", layer)) < order.index(("compute-end", layer + 1))


def test_mapped_file_round_trip(tmp_path):
    f = MappedFile(tmp_path / "m", 3 * PAGE)
    t = f.tensor((3 * PAGE // 4,), torch.float32)
    t.fill_(1.5)
    assert f.resident_bytes() >= 3 * PAGE
    f.write_out(0, 3 * PAGE)
    f.unmap(0, 3 * PAGE)
    assert f.resident_bytes() == 0
    f.drop_cache()
    assert float(t.sum()) == 1.5 * t.numel()  # read back from the file
    other = MappedFile(tmp_path / "m", 3 * PAGE, create=False)  # a second mapping sees the same bytes
    assert float(other.tensor((4,), torch.float32, offset=PAGE)[0]) == 1.5
    with pytest.raises(ValueError):
        f.tensor((PAGE,), torch.float32)


def test_a_view_is_copied_out_by_reads_that_map_nothing(tmp_path):
    shape = (3, 2, 2, 64 * PAGE // 64, 16)  # [L, 2, H, tokens, D] of float32 rows: 64 tokens a page
    f = MappedFile(tmp_path / "m", 4 * (3 * 2 * 2 * 64 * PAGE // 64 * 16))
    t = f.tensor(shape, torch.float32)
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(shape))
    f.write_out(0, f.nbytes)
    f.unmap(0, f.nbytes)
    chunk = t[:, :, :, 100:116].numpy()  # one chunk's rows: 12 strided pieces of 1 KiB
    got = f.copy_out(chunk)
    assert f.resident_bytes() == 0  # read from the page cache, not faulted into this process
    assert got.flags.c_contiguous and (got == chunk).all()  # (the comparison reads through the mapping)
    assert f.resident_bytes() > 0
    assert (f.copy_out(t[1].numpy()) == t[1].numpy()).all()  # contiguous: one read
    assert f.copy_out(t[:, :, :, 5:5].numpy()).shape == (3, 2, 2, 0, 16)
    with pytest.raises(ValueError, match="not one of this mapping"):
        f.copy_out(torch.zeros(4).numpy())


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_the_heap_is_trimmed_unless_switched_off(monkeypatch):
    assert trim_heap()
    monkeypatch.setenv(TRIM_SWITCH, "0")
    assert not trim_heap()
