"""Long prompts on the default model: plain prefill, layer-major row partitions, and K/V streamed layer
by layer under a budget (engine/kvspill.py), and the longest prompt each fits in a memory budget.

- TTFT: one prefill of `L` tokens of the held-out text (information density on, as the service runs it)
  and its first token, plain (`prefill_partition_rows=0`), in partitions of `--rows`, and streamed as
  scheduler/prefill.py plans it for `--stream-budget` MiB (a mapped working set: the streamed layers
  written to disk and unmapped after each layer, the hidden state spilled when the plan says so), with
  those writes overlapped with the next layer's compute and in line, alternated for `--rounds`
  rounds (medians).
- Peak: the most bytes of tensors alive during the prefill (`engine.memtrack.TensorTracker`, the torch
  attention kernel so that every byte is a tensor), the context's K/V excluded, and the estimate of
  scheduler/prefill.py for the same run; for the streamed run, also the most bytes of the mapped K/V
  and hidden state in this process's memory (`/proc/self/smaps`, after each layer's partitions).
- Longest prompt within each `--budgets` (MiB, transient tensors and the context's K/V in float32), by
  the estimate (checked against the tracker within 1% in tests/engine/test_memtrack.py): plain, row
  partitions with every layer's K/V resident (`moderate`), and streamed (`severe`, where the model's
  8,192 positions stop it).
- Decode over the longest streamed context: ms per token with 0%, 25%, 50% and 100% of the layers
  resident, with the streamed layers' pages dropped from the page cache before every token (cold: each
  token reads them from disk) and without (warm).
- Baseline: token-chunked prefill (chunks of `--rows` tokens) with each finished chunk's K/V swapped out
  through the chunk store and read back for the next (the baseline built from this project's pieces).
- Baseline: Hugging Face `accelerate` offloading transformers' model of the same checkpoint to disk
  under `--accelerate-mib` of `max_memory` (one run per length): TTFT and the tensors its forward made.

    python -m bench.long_prompt [--lengths 1024 2048 4096 6000 8000] [--rows 512] [--rounds 3] [--stream-budget 32]
                                [--modes plain partitions streamed streamed-inline swap]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


MODES = ("plain", "partitions", "streamed", "streamed-inline", "swap")
"""What `--modes` chooses from: the three prefills, the streamed one with its writes in line, and the
chunked-swap baseline."""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 6000, 8000])
    ap.add_argument("--rows", type=int, default=512, help="rows per partition (default 512)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256], help="MiB (default 64 128 256)")
    ap.add_argument("--stream-budget", type=int, default=32, help="MiB for the streamed prefill (default 32)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), metavar="MODE",
                    help=f"prefills to run: {', '.join(MODES)} (default all; at 16K-32K tokens each is minutes, "
                         "so choose; decode is measured when streamed or streamed-inline runs)")
    ap.add_argument("--decode-tokens", type=int, default=8, help="tokens per decode measurement (0: none)")
    ap.add_argument("--no-swap-baseline", dest="swap_baseline", action="store_false",
                    help="skip the chunked-swap baseline")
    ap.add_argument("--accelerate-mib", type=int, default=64,
                    help="max_memory of the accelerate offload baseline, MiB (default 64; 0 skips it)")
    ap.add_argument("--weights", default="fp32", metavar="FORMAT", help="weight format (default fp32)")
    ap.add_argument("--weights-resident", type=int, default=None, metavar="MIB",
                    help="stream the weights beyond this many MiB of resident fragments (engine/weightpager.py): "
                         "the run with a total budget, weights included (default: every weight resident)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shape", choices=["qwen2.5-0.5b"], default=None,
                    help="run on a random model of Qwen2.5-0.5B's shape and 32,768 positions (written once under "
                         "the cache folder; bench/model_files.py) instead of the default model")
    ap.add_argument("--longest-only", action="store_true",
                    help="print only the longest prompt under each budget (the estimate; no prefill is run)")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    import torch

    from bench.accuracy import machine_line, real_text_ids
    from engine.config import EngineConfig
    from engine.context import ContextEngine
    import os
    import tempfile

    from engine.kvcache import KVCache
    from engine.kvspill import mapped_rss
    from engine.memtrack import TensorTracker
    from actors.admission import prefill_shape
    from scheduler.prefill import estimate_steps, plan_prefill

    torch.set_num_threads(a.threads)
    resident = None if a.weights_resident is None else a.weights_resident << 20
    path = None
    if a.shape:
        from bench.model_files import SHAPE_QWEN_05B, random_model
        from engine.loader import cache_root

        path = random_model(cache_root() / "bench-models" / a.shape, **SHAPE_QWEN_05B, gguf_types=()) / "hf"
    engine = ContextEngine.load(path, EngineConfig(weights=a.weights, copy_weights=False,
                                                   weights_resident_bytes=resident), progress=False)
    model, cfg = engine.model, engine.model.cfg
    if a.longest_only:
        print(f"Command: `python -m bench.long_prompt {' '.join(argv if argv is not None else sys.argv[1:])}`. "
              f"{machine_line()}. Model: {a.shape or 'default'} ({cfg.n_layers} layers, {cfg.max_positions:,} "
              "positions).\n")
        _print_longest(model, cfg, a.budgets, a.rows)
        return 0
    ids = real_text_ids(engine.tok)
    if max(a.lengths) > min(len(ids), cfg.max_positions):
        ap.error(f"lengths up to {min(len(ids), cfg.max_positions)} tokens")
    streamed = f"streamed, {a.stream_budget} MiB"
    every = {"plain": ("plain", 0), "partitions": (f"partitions of {a.rows}", a.rows), "streamed": (streamed, -1),
             "streamed-inline": (streamed + ", writes in line", -2)}
    modes = {label: rows for key, (label, rows) in every.items() if key in a.modes}
    folder = tempfile.mkdtemp(prefix="long-prompt-", dir=".")  # on the disk: a tmpfs would hold it in memory
    prefix = os.path.abspath(folder)  # its files' mappings are what the streamed runs hold
    native_shape = prefill_shape(model, "float")
    plans = {n: plan_prefill(native_shape, n, 0, a.stream_budget << 20) for n in a.lengths}
    fits = [n for n in a.lengths if plans[n].kind != "refuse"]  # what the streamed runs can take
    runs_streamed = fits if min(modes.values(), default=0) < 0 else []

    def new_cache(n: int, rows: int, hook=None):
        """A cache for `n` tokens and the partition rows: streamed (`rows` -1; -2 without the overlap of
        the writes with the compute) as planned for the budget."""
        if rows >= 0:
            return model.new_cache(n + 1), rows, None
        plan = plans[n]
        fd, path = tempfile.mkstemp(prefix="ws-", dir=folder)
        os.close(fd)
        cache = KVCache.mapped(cfg, path, n + 1 + a.decode_tokens, chunk_tokens=model.engine_cfg.chunk_tokens,
                               dtype=model.dtype)
        cache.pager.file.unlink()  # the mapping keeps it until the cache goes
        cache.pager.set_resident(plan.resident_layers)
        cache.pager.spill_hidden = plan.spill_hidden
        cache.pager.overlap = rows == -1
        return cache, plan.partition_rows if plan.kind != "none" else 0, plan

    def prefill(n: int, rows: int) -> float:
        cache, rows, _plan = new_cache(n, rows)
        model.engine_cfg.prefill_partition_rows = rows
        density = torch.zeros(n + 1)
        t = time.perf_counter()
        logits = model.forward(cache, ids[:n], density=density)
        int(logits.argmax())
        took = time.perf_counter() - t
        if cache.pager is not None:
            cache.pager.settle()
        return took

    ttft: dict[tuple[int, str], list[float]] = {}
    prefill(256, 0)  # warm the kernels
    for r in range(a.rounds):
        for n in a.lengths:
            for name in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
                if modes[name] >= 0 or n in fits:
                    ttft.setdefault((n, name), []).append(prefill(n, modes[name]))

    peaks: dict[tuple[int, str], tuple[int, int]] = {}
    mapped: dict[int, tuple] = {}  # streamed: most mapped bytes, mapped + tracked, plan, most tracked
    model.engine_cfg.native_attention = False
    shape = prefill_shape(model, "float")  # the torch attention kernel's estimate, as the tracker sees it
    for n in a.lengths:
        for name, rows in modes.items():
            if rows < 0:
                continue
            model.engine_cfg.prefill_partition_rows = rows
            cache, density = model.new_cache(n), torch.zeros(n)
            tracker = TensorTracker(ignore=[cache.kv, density])
            model.step_hook = tracker.mark
            with tracker:
                model.forward(cache, ids[:n], density=density)
            model.step_hook = None
            p = min(rows or n, n)
            est = max(e.peak for e in estimate_steps(shape, p, n - p)) + 4 * cfg.hidden_size * (n - p)
            peaks[(n, name)] = (max(s.peak for s in tracker.steps), est)
    model.engine_cfg.native_attention = True
    for n in runs_streamed:  # the streamed run as it runs (compiled attention: its scratch is not a tensor)
        cache, rows, plan = new_cache(n, -1)
        model.engine_cfg.prefill_partition_rows = rows
        density = torch.zeros(n + 1)
        tracker = TensorTracker(ignore=[cache.kv, density])
        most = [0, 0, 0, 0]

        def hook(step, layer, cache=cache, tracker=tracker, most=most):
            tracker.mark(step, layer)
            most[2] = max(most[2], tracker.steps[-1].peak)
            if step == "mlp":  # K/V and spilled rows mapped now (smaps covers every mapping of ours)
                m = mapped_rss(lambda _lo, _hi, path: path.startswith(prefix))
                w = model.weight_pager.mapped_bytes() if model.weight_pager is not None else 0
                most[0] = max(most[0], m)
                most[1] = max(most[1], m + max(s.peak for s in tracker.steps[-3:]))
                most[3] = max(most[3], m + w + max(s.peak for s in tracker.steps[-3:]))

        model.step_hook = hook
        with tracker:
            model.forward(cache, ids[:n], density=density)
        model.step_hook = None
        cache.pager.settle()
        mapped[n] = (most[0], most[1], plan, most[2], most[3])

    decode: dict[tuple[int, bool], float] = {}
    dn = max(runs_streamed, default=0)
    if dn and a.decode_tokens > 0:
        decode = decode_times(model, new_cache(dn, -1), ids, dn, a.decode_tokens)
    swapped = {n: chunked_swap_baseline(model, ids, n, a.rows, folder) for n in a.lengths
               if a.swap_baseline and "swap" in a.modes}
    offload = accelerate_baseline(ids, a.lengths, a.accelerate_mib, folder) if a.accelerate_mib else {}

    cmd = "python -m bench.long_prompt " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"Command: `{cmd.strip()}`. {machine_line()}. Total runtime {time.perf_counter() - t_start:.0f} s.\n")
    print("| prompt, tokens | prefill | TTFT, s (median) | tracked peak, MiB | estimate, MiB |\n|---:|---|---:|---:|---:|")
    for n in a.lengths:
        for name in modes:
            if modes[name] < 0 and n not in fits:
                print(f"| {n} | {name} | refused: {plans[n].describe()} | | |")
                continue
            if modes[name] < 0:  # the tracker's part of it, K/V excluded as above (the whole is below)
                tracked, est = mapped[n][3], None
            else:
                tracked, est = peaks[(n, name)]
            print(f"| {n} | {name} | {statistics.median(ttft[(n, name)]):.2f} | {tracked / 2**20:.1f} | "
                  f"{'-' if est is None else f'{est / 2**20:.1f}'} |")
    print(f"\nStreamed under {a.stream_budget} MiB (compiled attention; mapped: K/V and spilled rows in this "
          "process's memory; with tracked: plus the tensors alive at that step):\n")
    print("| prompt, tokens | plan | most mapped, MiB | most mapped + tracked, MiB | estimate, MiB |\n"
          "|---:|---|---:|---:|---:|")
    for n in runs_streamed:
        most, both, plan, _tracked, _all = mapped[n]
        print(f"| {n} | {plan.describe().split(';')[0]} | {most / 2**20:.1f} | {both / 2**20:.1f} | "
              f"{plan.peak / 2**20:.1f} |")
    if model.weight_pager is not None:
        wp = model.weight_pager.plan
        print(f"\nWeights streamed: {wp.resident_bytes / 2**20:.1f} MiB of fragments resident (limit "
              f"{a.weights_resident} MiB), {wp.streamed_bytes / 2**20:.1f} MiB streamed per pass, at most "
              f"{wp.peak_bytes / 2**20:.1f} MiB of weights mapped by the plan. Everything of the streamed runs "
              "(K/V and spilled rows mapped, weights mapped, tensors alive):\n")
        print("| prompt, tokens | most of everything, MiB |\n|---:|---:|")
        for n in runs_streamed:
            print(f"| {n} | {mapped[n][4] / 2**20:.1f} |")
    print()
    _print_longest(model, cfg, a.budgets, a.rows, native_shape, shape)
    if decode:
        print(f"\nDecode over the streamed {dn}-token context, ms per token (median of {a.decode_tokens}):\n")
        print("| layers resident | cold (page cache dropped) | warm |\n|---:|---:|---:|")
        for frac in (0, 25, 50, 100):
            print(f"| {frac}% | {decode[(frac, True)] * 1e3:.0f} | {decode[(frac, False)] * 1e3:.0f} |")
    if swapped:
        print(f"\nBaseline: token-chunked prefill in chunks of {a.rows} tokens, each finished chunk's K/V written "
              "raw to the chunk store and dropped, all earlier K/V read back before the next chunk (one run "
              "each; its K/V in memory at the last chunk is the whole context's, as plain prefill's):\n")
        print("| prompt, tokens | TTFT, s | streamed TTFT ÷ this |\n|---:|---:|---:|")
        for n, took in swapped.items():
            ratio = f"{statistics.median(ttft[(n, streamed)]) / took:.2f}x" if (n, streamed) in ttft else "-"
            print(f"| {n} | {took:.2f} | {ratio} |")
    if offload:
        print(f"\nBaseline: transformers' model under accelerate (device_map auto, max_memory cpu "
              f"{a.accelerate_mib} MiB, the rest offloaded to disk), one run each; tracked: tensors made "
              "during the forward (weights brought in from the offload, activations, its K/V cache):\n")
        print(f"Placement (modules per device): {offload.pop('placement')}\n")
        print("| prompt, tokens | TTFT, s | tracked peak, MiB |\n|---:|---:|---:|")
        for n, (took, peak) in offload.items():
            print(f"| {n} | {took:.2f} | {peak / 2**20:.1f} |")
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    return 0


def decode_times(model, made, ids: list[int], n: int, tokens: int) -> dict[tuple[int, bool], float]:
    """Median seconds per token decoded over a streamed `n`-token context (`made`: the mapped cache
    with its partition rows and plan), with 0, 25, 50 and 100% of the layers resident, cold (the
    streamed layers' pages dropped from the page cache before every token) and warm."""
    cache, rows, _plan = made
    model.engine_cfg.prefill_partition_rows = rows
    int(model.forward(cache, ids[:n]).argmax())
    cache.pager.settle()
    out = {}
    for frac in (0, 25, 50, 100):
        for cold in (True, False):
            cache.truncate(n)
            cache.pager.set_resident(model.cfg.n_layers * frac // 100)
            times = []
            for i in range(tokens):
                if cold:
                    cache.pager.file.drop_cache()
                t = time.perf_counter()
                int(model.forward(cache, [ids[(n + i) % len(ids)]]).argmax())
                times.append(time.perf_counter() - t)
            cache.pager.settle()
            out[(frac, cold)] = statistics.median(times)
    return out


def chunked_swap_baseline(model, ids: list[int], n: int, rows: int, folder: str) -> float:
    """TTFT of the baseline a user would build from this project's pieces: prefill `rows` tokens at a
    time; after each, write the finished 16-token chunks raw through the chunk store
    (`storage.chunkstore.ChunkStore`) and drop them; before the next, read every earlier chunk back
    (attention needs them all)."""
    import os

    from storage import codecs
    from storage.chunkstore import ChunkStore

    store = ChunkStore(os.path.join(folder, f"chunks-{n}"), fingerprint="bench")
    key = f"{n:08x}"
    cache = model.new_cache(n + 1)
    c = cache.chunk_tokens
    written = 0  # chunks in the store
    t = time.perf_counter()
    for s0 in range(0, n, rows):
        for i, enc in store.read(key, range(written)):
            cache.put_chunk(i, codecs.decode(enc))
        logits = model.forward(cache, ids[s0 : min(n, s0 + rows)])
        full = cache.length // c if s0 + rows < n else cache.n_chunks  # the last partial chunk at the end
        store.write_many(key, [(i, codecs.encode(cache.chunk_array(i), "raw", dtype="float32"), i * c)
                               for i in range(written, full)])
        for i in range(full):
            cache.drop_chunk(i)
        written = full
    int(logits.argmax())
    return time.perf_counter() - t


def accelerate_baseline(ids: list[int], lengths: list[int], mib: int, folder: str) -> dict:
    """Hugging Face transformers' model of the same checkpoint dispatched by accelerate under
    `max_memory={"cpu": mib MiB}` with the rest offloaded to disk (`device_map="auto"`, which runs
    `infer_auto_device_map` and `dispatch_model`): {length: (TTFT s, tracked peak bytes)} for each
    length it completes, and "placement": how many modules accelerate put on each device."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from engine.loader import resolve_model
    from engine.memtrack import TensorTracker

    model = AutoModelForCausalLM.from_pretrained(
        resolve_model(None).directory, dtype=torch.float32, device_map="auto", max_memory={"cpu": mib << 20},
        offload_folder=os.path.join(folder, "offload"))
    from collections import Counter

    out = {"placement": dict(Counter(model.hf_device_map.values()))}  # modules per device
    for n in lengths:
        tracker = TensorTracker()
        t = time.perf_counter()
        try:
            with torch.no_grad(), tracker:
                int(model(torch.tensor([ids[:n]]), use_cache=True).logits[0, -1].argmax())
        except (MemoryError, RuntimeError) as e:  # where it does not complete
            print(f"accelerate baseline at {n} tokens: {e}", file=sys.stderr)
            continue
        out[n] = (time.perf_counter() - t, tracker.peak)
    return out


def _print_longest(model, cfg, budgets: list[int], rows: int, native_shape=None, shape=None) -> None:
    """The longest prompt whose estimated peak fits each budget (MiB): plain, in row partitions with
    every layer's K/V resident, and streamed (any plan but `refuse`); the model's positions cap them.
    `shape`: the torch attention kernel's view (what the tracker checks), `native_shape` the planner's."""
    from actors.admission import prefill_shape
    from scheduler.prefill import peak_bytes, plan_prefill

    native_shape = native_shape or prefill_shape(model, "float")
    if shape is None:
        native = model.engine_cfg.native_attention
        model.engine_cfg.native_attention = False
        shape = prefill_shape(model, "float")
        model.engine_cfg.native_attention = native

    def longest(budget: int, rows: int) -> int:
        lo, hi = 0, cfg.max_positions
        while lo < hi:  # the most tokens whose estimated peak fits (rows -1: any plan but refuse)
            mid = (lo + hi + 1) // 2
            if rows < 0:
                fits = plan_prefill(native_shape, mid, 0, budget).kind != "refuse"
            else:
                fits = peak_bytes(shape, mid, 0, rows or mid, severe=False, spill=False) <= budget
            if fits:
                lo = mid
            else:
                hi = mid - 1
        return lo

    print("| budget, MiB | longest prompt, plain | longest, partitions (all K/V resident) | longest, streamed |\n"
          "|---:|---:|---:|---:|")
    for mib in budgets:
        plain = longest(mib << 20, 0)
        parts, streamed = longest(mib << 20, rows), longest(mib << 20, -1)
        print(f"| {mib} | {plain:,} | {parts:,} ({parts / plain:.2f}x) | {streamed:,} ({streamed / plain:.1f}x"
              f"{'; the model' + chr(39) + 's positions' if streamed == cfg.max_positions else ''}) |")


if __name__ == "__main__":
    sys.exit(main())
