"""Prefill in bfloat16 against the float32 engine, and what its speed switches buy: with bf16 weights,
attention's products in bfloat16, on AMX tiles or in AVX-512 BF16 dot products
(`EngineConfig.bf16_attention`); with int8 and int4 weights, products of many rows in bfloat16
(`EngineConfig.quantized_prefill_bf16`, attention with them).

One process, the default model loaded once per variant (float32; bf16 with the switch on and off;
int8 and int4 with theirs on and off), every round timing each variant's prefill (information density
on, as the service runs it) at each prompt length, the variants in an order rotated from round to
round; medians over the rounds, with the round-to-round spread (median absolute deviation). A switch
is worth keeping where it buys more than twice that spread. With `--write`, the results replace this machine's kind's block
(`bench.quantized.host_kind`).

    python -m bench.bf16_prefill [--rounds 6] [--lengths 512 2048] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

NAME = "bf16-prefill"
HEADING = "## Quantized weights"
VARIANTS = {
    "fp32": {"weights": "fp32"},
    "bf16": {"weights": "bf16"},
    "bf16, bf16_attention off": {"weights": "bf16", "bf16_attention": False},
    "int8": {"weights": "int8"},
    "int8, quantized_prefill_bf16 off": {"weights": "int8", "quantized_prefill_bf16": False},
    "int4": {"weights": "int4"},
    "int4, quantized_prefill_bf16 off": {"weights": "int4", "quantized_prefill_bf16": False},
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6, help="rounds; the variant order rotates (default 6)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048], metavar="N",
                    help="prompt lengths (default 512 2048)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--write", type=Path, help="replace this benchmark's section of a markdown file")
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    from bench.quantized import cpu_line, host_kind
    from bench.tuning import mad
    from engine.config import EngineConfig
    from engine.loader import resolve_model
    from engine.attention import bf16_attention_mode
    from engine.model import Transformer
    from engine.qlinear import bf16_products_here

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    resolved = resolve_model(progress=False)
    models = {}
    for label, opts in VARIANTS.items():
        models[label] = Transformer.from_directory(resolved.directory, EngineConfig(device="cpu", **opts),
                                                   fingerprint=resolved.fingerprint)
        models[label].warmup()
    ids = {n: np.random.default_rng(0).integers(100, 40000, n).tolist() for n in args.lengths}
    times: dict[tuple[str, int], list[float]] = {(v, n): [] for v in VARIANTS for n in args.lengths}
    labels = list(VARIANTS)
    with torch.inference_mode():
        for r in range(-1, args.rounds):  # round -1 warms every variant at every length, untimed
            for label in labels[r % len(labels):] + labels[: r % len(labels)]:
                m = models[label]
                for n in args.lengths:
                    cache = m.new_cache(n)
                    t = time.perf_counter()
                    m.forward(cache, ids[n], density=torch.zeros(n))
                    if r >= 0:
                        times[label, n].append(time.perf_counter() - t)
            print(f"round {r + 1}: " + ", ".join(f"{v} {times[v, n][-1] * 1e3:.0f} ms at {n}"
                                                for v in labels for n in args.lengths if r >= 0), file=sys.stderr)
    how = bf16_attention_mode() if models["bf16"].bf16_attention else "none"
    lines = [f"Command: `python -m bench.bf16_prefill --rounds {args.rounds} --lengths "
             f"{' '.join(map(str, args.lengths))}`. Date: {datetime.date.today()}. Machine: {cpu_line()}; "
             f"{args.threads} threads; bfloat16 products in hardware: {'yes' if bf16_products_here() else 'no'}; "
             f"bf16 attention's products: {how}. "
             f"One process, the variants rotated over {args.rounds} rounds; per prompt length the median prefill "
             f"time (information density on) and the round-to-round spread (median absolute deviation). "
             f"Run took {(time.perf_counter() - t0) / 60:.1f} min.", "",
             "| variant | " + " | ".join(f"prefill {n}, ms (spread) | vs fp32" for n in args.lengths) + " |",
             "|---|" + "---:|---:|" * len(args.lengths)]
    med = {k: statistics.median(v) for k, v in times.items()}
    for label in labels:
        lines.append(f"| {label} | " + " | ".join(
            f"{med[label, n] * 1e3:.0f} ({mad(times[label, n]) * 1e3:.0f}) | {med['fp32', n] / med[label, n]:.2f}x"
            for n in args.lengths) + " |")
    lines.append("")
    for label in (v for v in labels if ", " in v):  # "FORMAT, SWITCH off" against "FORMAT"
        base = label.split(", ")[0]
        for n in args.lengths:
            gain = med[label, n] - med[base, n]
            spread = max(mad(times[label, n]), mad(times[base, n]))
            lines.append(f"- {base}: {label.split(', ')[1]} at {n} tokens: the switch buys {gain * 1e3:.0f} ms "
                         f"(spread {spread * 1e3:.0f} ms): {'keep' if gain > 2 * spread else 'less than twice the spread'}.")
    from bench.markdown import publish

    return publish("\n".join(lines), args.write, f"{NAME}:{host_kind()}", HEADING)


if __name__ == "__main__":
    sys.exit(main())
