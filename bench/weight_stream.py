"""Weights larger than memory (HyperGen §3.1): prefill and decode of the default model with its weight
fragments resident up to a limit, smallest first, and the rest streamed per block from the mapped
weight file (engine/weightpager.py), the next block read ahead while one computes, and without the
read ahead.

- For each `--limits` (MiB; `all` keeps every weight resident, the baseline) and each of warm reads
  (streamed fragments come back from the page cache) and cold ones (each released block also dropped
  from the page cache, so every pass reads it from the disk: what a box whose memory cannot hold the
  weights sees): the time to first token of a `--prompt`-token prefill and the median ms per decode
  token over `--decode-tokens` tokens after it, and the most bytes of the weights' mapping in this
  process's memory (`/proc/self/smaps` after each block of one more, untimed, token), beside the
  plan's bound.
- Each measurement loads the model afresh (a mapping: no copy), alone in the process, so no other
  mapping keeps a dropped page in the page cache; configurations alternate over `--rounds` rounds
  (medians).

    python -m bench.weight_stream [--weights fp32] [--limits all 256 128 64 0] [--prompt 1024] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.weight_stream", description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", default="fp32", help="weight format (default fp32)")
    ap.add_argument("--limits", nargs="+", default=["all", "256", "128", "64", "0"],
                    help="resident limits in MiB, or `all` (default: all 256 128 64 0)")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens (default 1024)")
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-cold", dest="cold", action="store_false", help="warm reads only")
    a = ap.parse_args(argv)

    import torch

    from bench.accuracy import real_text_ids
    from engine.chat import ChatTokenizer
    from engine.config import EngineConfig
    from engine.loader import resolve_model
    from engine.model import Transformer

    torch.set_num_threads(a.threads)
    resolved = resolve_model(progress=True)
    ids = real_text_ids(ChatTokenizer(resolved.directory))[: a.prompt]
    modes = [(lim, ahead, cold) for lim in a.limits for cold in ((False, True) if a.cold else (False,))
             for ahead in ((True, False) if lim != "all" else (True,)) if not (lim == "all" and cold)]

    def run(limit: str, ahead: bool, cold: bool) -> tuple[float, float, int, int]:
        cfg = EngineConfig(weights=a.weights, copy_weights=False, weights_read_ahead=ahead,
                           weights_resident_bytes=None if limit == "all" else int(float(limit) * (1 << 20)))
        model = Transformer.from_directory(resolved.directory, cfg, fingerprint=resolved.fingerprint)
        pager = model.weight_pager
        if pager is not None:
            pager.drop_cache = cold
        model.warmup()
        if pager is not None:
            pager.release_all()
        cache = model.new_cache(len(ids) + a.decode_tokens + 2)
        t = time.perf_counter()
        tok = int(model.forward(cache, ids).argmax())
        ttft = time.perf_counter() - t
        steps = []
        for _ in range(a.decode_tokens):
            t = time.perf_counter()
            tok = int(model.forward(cache, [tok]).argmax())
            steps.append(time.perf_counter() - t)
        most = [0]
        if pager is not None:  # one more token, untimed, measuring the mapping after each block (reading
            # /proc/self/smaps takes milliseconds, so not in the timed passes)

            def hook(step, layer, pager=pager):
                if step == "mlp":
                    most[0] = max(most[0], pager.mapped_bytes())

            model.step_hook = hook
            model.forward(cache, [tok])
            model.step_hook = None
        bound = pager.plan.peak_bytes if pager is not None else 0
        if pager is not None:
            pager.close()
        del model, cache, pager
        gc.collect()  # the mapping goes with its last view: the next model's pages are its own
        return ttft, statistics.median(steps) * 1e3, most[0], bound

    results: dict[tuple, list] = {}
    t0 = time.perf_counter()
    for r in range(a.rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            results.setdefault(mode, []).append(run(*mode))
            print(".", end="", flush=True)
    print()
    base_ttft = statistics.median(x[0] for x in results[("all", True, False)]) if ("all", True, False) in results else None
    base_tok = statistics.median(x[1] for x in results[("all", True, False)]) if base_ttft else None
    print(f"{a.weights} weights, {len(ids)}-token prompt, {a.decode_tokens} decode tokens, {a.rounds} rounds "
          f"(medians), {time.perf_counter() - t0:.0f} s")
    print("| resident limit | read ahead | reads | TTFT, s | vs all | decode, ms/token | vs all "
          "| weights mapped, most MiB | plan's bound, MiB |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for (limit, ahead, cold), xs in results.items():
        ttft = statistics.median(x[0] for x in xs)
        tok = statistics.median(x[1] for x in xs)
        most = max(x[2] for x in xs)
        bound = xs[0][3]
        name = "all (no streaming)" if limit == "all" else f"{limit} MiB"
        rel = (f"{ttft / base_ttft:.2f}x", f"{tok / base_tok:.2f}x") if base_ttft else ("", "")
        print(f"| {name} | {'yes' if ahead else 'no'} | {'cold' if cold else 'warm'} | {ttft:.2f} | {rel[0]} | "
              f"{tok:.1f} | {rel[1]} | {f'{most / 2**20:.1f}' if bound else '-'} | "
              f"{f'{bound / 2**20:.1f}' if bound else '-'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
