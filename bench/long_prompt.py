"""Long prompts on the default model: plain prefill against layer-major row partitions (issue 28's
first steps), and the longest prompt each fits in a memory budget by the estimate.

- TTFT: one prefill of `L` tokens of the held-out text (information density on, as the service runs it)
  and its first token, plain (`prefill_partition_rows=0`) and in partitions of `--rows`, alternated for
  `--rounds` rounds (medians).
- Peak: the most bytes of tensors alive during the prefill (`engine.memtrack.TensorTracker`, the torch
  attention kernel so that every byte is a tensor), the context's K/V excluded, and the estimate of
  scheduler/prefill.py for the same run.
- Longest prompt within each `--budgets` (MiB, transient tensors and the context's K/V in float32), by
  the estimate (checked against the tracker within 1% in tests/engine/test_memtrack.py): plain, and
  row partitions with every layer's K/V resident (`moderate`). Moving K/V out layer by layer
  (`severe`), which issue 28's floors need, is not built.

    python -m bench.long_prompt [--lengths 1024 2048 4096 8000] [--rows 512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8000])
    ap.add_argument("--rows", type=int, default=512, help="rows per partition (default 512)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256], help="MiB (default 64 128 256)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    import torch

    from bench.accuracy import machine_line, real_text_ids
    from engine.config import EngineConfig
    from engine.context import ContextEngine
    from engine.memtrack import TensorTracker
    from actors.admission import prefill_shape
    from scheduler.prefill import estimate_steps, peak_bytes

    torch.set_num_threads(a.threads)
    engine = ContextEngine.load(None, EngineConfig(), progress=False)
    model, cfg = engine.model, engine.model.cfg
    ids = real_text_ids(engine.tok)
    if max(a.lengths) > min(len(ids), cfg.max_positions):
        ap.error(f"lengths up to {min(len(ids), cfg.max_positions)} tokens")
    modes = {"plain": 0, f"partitions of {a.rows}": a.rows}

    def prefill(n: int, rows: int) -> float:
        model.engine_cfg.prefill_partition_rows = rows
        cache, density = model.new_cache(n + 1), torch.zeros(n + 1)
        t = time.perf_counter()
        logits = model.forward(cache, ids[:n], density=density)
        int(logits.argmax())
        return time.perf_counter() - t

    ttft: dict[tuple[int, str], list[float]] = {}
    prefill(256, 0)  # warm the kernels
    for r in range(a.rounds):
        for n in a.lengths:
            for name in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
                ttft.setdefault((n, name), []).append(prefill(n, modes[name]))

    peaks: dict[tuple[int, str], tuple[int, int]] = {}
    model.engine_cfg.native_attention = False
    shape = prefill_shape(model, "float")  # the torch attention kernel's estimate, as the tracker sees it
    for n in a.lengths:
        for name, rows in modes.items():
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

    def longest(budget: int, rows: int) -> int:
        lo, hi = 0, cfg.max_positions
        while lo < hi:  # the most tokens whose estimated peak (K/V of all layers resident) fits
            mid = (lo + hi + 1) // 2
            if peak_bytes(shape, mid, 0, rows or mid, severe=False, spill=False) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo

    cmd = "python -m bench.long_prompt " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"Command: `{cmd.strip()}`. {machine_line()}. Total runtime {time.perf_counter() - t_start:.0f} s.\n")
    print("| prompt, tokens | prefill | TTFT, s (median) | tracked peak, MiB | estimate, MiB |\n|---:|---|---:|---:|---:|")
    for n in a.lengths:
        for name in modes:
            tracked, est = peaks[(n, name)]
            print(f"| {n} | {name} | {statistics.median(ttft[(n, name)]):.2f} | {tracked / 2**20:.1f} | "
                  f"{est / 2**20:.1f} |")
    print("\n| budget, MiB | longest prompt, plain | longest, partitions (all K/V resident) |\n|---:|---:|---:|")
    for mib in a.budgets:
        print(f"| {mib} | {longest(mib << 20, 0)} | {longest(mib << 20, a.rows)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
