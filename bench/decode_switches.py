"""What the engine's decode-speed switches buy: decode ms/token of a model (the default one unless
`--model`) with each switch on (the default) and off, per weight format, in one process.

Per weight format the model is loaded once per variant (the default configuration, then each switch
turned off alone); every round prefills the same prompt into a fresh cache of each variant and times
its greedy decode, the variants in an order rotated from round to round; medians over the rounds,
with the round-to-round spread (median absolute deviation). A switch is worth keeping where it buys
more than twice that spread (the project's rule for speed-only optimisations).

The switches: `weight_prefetch_rows` (the int4 and int8 products of engine/qmatmul.c prefetching the
weight's rows ahead; acts on quantized formats only; the variant is the other side of the host's
default, `engine.qlinear.host_prefetch_rows`: 0 where it prefetches, `WEIGHT_PREFETCH_ROWS` where not), `int8_activations` (int4 products with their
rows quantized to int8, W4A8, where AVX-512 VNNI is compiled; int4 only), `symmetric_int4` (int4
repacked from Q4_0 blocks read without minimums; acts only on a Q4_0 GGUF's int4, e.g. bench.quantized's
`default-Q4_0.gguf` or the 1.2B shape's `model-Q4_0.gguf`) and `fused_decode` (each layer of a decode
pass in one compiled call, engine/fused_decode.py; every format). A compiled RMSNorm was
measured here and deleted (docs/benchmarks.md, "Tuning at the edge").

    python -m bench.decode_switches [--model GGUF] [--formats int4 int8] [--rounds 8] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

NAME = "decode-switches"
HEADING = "## Tuning at the edge"
SWITCHES = {
    "int8_activations off": ({"int8_activations": False}, ("int4",)),
    "symmetric_int4 off": ({"symmetric_int4": False}, ("int4",)),
    "fused_decode off": ({"fused_decode": False}, ("fp32", "bf16", "int4", "int8")),
}
"""Variant label -> (the `EngineConfig` options that turn one switch off, the weight formats (by prefix)
it acts on). `prefetch_switch` adds `weight_prefetch_rows`, whose variant depends on the host."""


def prefetch_switch() -> dict:
    """`weight_prefetch_rows`'s variant as a `SWITCHES` entry: the other side of this host's default
    (`engine.qlinear.host_prefetch_rows`)."""
    from engine.config import WEIGHT_PREFETCH_ROWS
    from engine.qlinear import host_prefetch_rows

    rows = 0 if host_prefetch_rows() else WEIGHT_PREFETCH_ROWS
    return {f"weight_prefetch_rows {rows}": ({"weight_prefetch_rows": rows}, ("int4", "int8"))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.decode_switches", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF or checkpoint directory (default: the default model; "
                    "bench.quantized's 1.2B shape is written by bench.model_files)")
    ap.add_argument("--formats", nargs="+", default=["int4", "int8"], help="weight formats (default int4 int8)")
    ap.add_argument("--rounds", type=int, default=8, help="rounds; the variant order rotates (default 8)")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="prompt before the decode (default 256)")
    ap.add_argument("--decode-tokens", type=int, default=32, help="greedy tokens timed per run (default 32)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--write", type=Path, help="replace this benchmark's section of a markdown file")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.decode_tokens < 1 or args.prompt_tokens < 1:
        ap.error("--rounds, --decode-tokens and --prompt-tokens must be >= 1")

    import numpy as np
    import torch

    from bench.quantized import cpu_line
    from bench.tuning import mad, verdict
    from engine.config import EngineConfig
    from engine.loader import resolve_model
    from engine.model import Transformer

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    resolved = resolve_model(args.model, progress=False)
    prompt = np.random.default_rng(0).integers(100, 40000, args.prompt_tokens).tolist()
    capacity = args.prompt_tokens + args.decode_tokens + 16

    def decode(model) -> tuple[float, list[int]]:
        """ms per greedy token after the prompt, and the tokens."""
        cache, density = model.new_cache(capacity), torch.zeros(capacity)
        tok = int(model.forward(cache, prompt, density=density).argmax())
        out = [tok]
        t = time.perf_counter()
        for _ in range(args.decode_tokens):
            tok = int(model.forward(cache, [tok], density=density).argmax())
            out.append(tok)
        return (time.perf_counter() - t) / args.decode_tokens * 1e3, out

    switches = prefetch_switch() | SWITCHES
    tables = []
    for fmt in args.formats:
        variants = {"default": {}} | {k: opts for k, (opts, formats) in switches.items() if fmt.startswith(formats)}
        models = {label: Transformer.from_directory(resolved.directory, EngineConfig(device="cpu", weights=fmt, **opts),
                                                    fingerprint=resolved.fingerprint)
                  for label, opts in variants.items()}
        labels = list(variants)
        times: dict[str, list[float]] = {v: [] for v in labels}
        same = {v: 0 for v in labels}
        with torch.inference_mode():
            for r in range(-1, args.rounds):  # round -1 warms every variant, untimed
                tokens = {}
                for label in labels[r % len(labels):] + labels[: r % len(labels)]:
                    ms, tokens[label] = decode(models[label])
                    if r >= 0:
                        times[label].append(ms)
                if r >= 0:
                    for label in labels:
                        same[label] += tokens[label] == tokens["default"]
                print(f"{fmt} round {r + 1}: " + ", ".join(f"{v} {times[v][-1]:.2f}" for v in labels if r >= 0),
                      file=sys.stderr)
        tables.append((fmt, labels, times, same))
        del models

    model_arg = f" --model {args.model}" if args.model else ""
    lines = [f"Command: `python -m bench.decode_switches{model_arg} --formats {' '.join(args.formats)} --rounds {args.rounds}"
             f" --prompt-tokens {args.prompt_tokens} --decode-tokens {args.decode_tokens}`. Date: "
             f"{datetime.date.today()}. Machine: {cpu_line()}; {args.threads} threads. One process; per weight "
             f"format the model loaded once per variant, each round a {args.prompt_tokens}-token prompt "
             f"then {args.decode_tokens} greedy tokens timed in every variant, the order rotated over "
             f"{args.rounds} rounds; the median ms/token and the round-to-round spread (median absolute "
             f"deviation). Run took {(time.perf_counter() - t0) / 60:.1f} min.", "",
             "| weights | variant | decode, ms/token (spread) | vs default | same tokens as default |",
             "|---|---|---:|---:|---:|"]
    verdicts = []
    for fmt, labels, times, same in tables:
        med = {v: statistics.median(times[v]) for v in labels}
        for v in labels:
            lines.append(f"| {fmt} | {v} | {med[v]:.2f} ({mad(times[v]):.2f}) | {med[v] / med['default']:.2f}x | "
                         f"{same[v]} of {args.rounds} |")
        for v in labels[1:]:
            k = verdict(times["default"], times[v])
            verdicts.append(f"- {fmt}, {v}: the switch buys {k['gain']:.2f} ms/token (spread {k['spread']:.2f}): "
                            f"{'keep' if k['keep'] else 'less than twice the spread'}.")
    lines += [""] + verdicts
    from bench.markdown import publish

    return publish("\n".join(lines), args.write, NAME, HEADING)


if __name__ == "__main__":
    sys.exit(main())
