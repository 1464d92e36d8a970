"""Decode throughput of the service with LoRA adapters in use, against none (MNN-LLM §5.5: adapters
computed beside the base weights, `B (A x)`, never merged).

One one-process service (`wire_local`) on the default model holds `--contexts` contexts on the base
model and as many bound to distinct random adapters (`bench.model_files.random_adapter`, all seven
projections at `--rank`). Each round calls every context of one set, then of the other (the order
alternates from round to round); a set's decode rate is its completion tokens over its decode
seconds (a call's time after its first token, so switches and prefill stay out). Medians over
rounds, and the ratio adapters / base, are printed as a markdown table.

    python -m bench.lora [--contexts 4] [--rank 8] [--rounds 6] [--max-tokens 32] [--weights fp32]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import tempfile
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = ["Name three rivers.", "Describe a lighthouse.", "List uses of copper.", "Why do cats purr?",
           "Name a bridge.", "What is rain?", "Tell me about owls.", "Define a prime number."]


def run(contexts: int, rank: int, rounds: int, max_tokens: int, weights: str, threads: int) -> dict:
    import torch

    from actors.service import ServiceConfig, wire_local
    from bench.model_files import random_adapter
    from engine.config import EngineConfig
    from engine.context import ContextEngine

    torch.set_num_threads(threads)
    tmp = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    engine = ContextEngine.load(None, EngineConfig(max_context_tokens=2048, weights=weights))
    for i in range(contexts):
        random_adapter(tmp / "adapters" / f"a{i}", engine.model.cfg, seed=i, rank=rank, targets=TARGETS)
    svc = wire_local(ServiceConfig(data_dir=str(tmp / "data"), adapter_root=str(tmp / "adapters"), weights=weights,
                                   pool_bytes=1 << 30, max_context_tokens=2048), engine=engine)
    try:
        token = svc.bind("bench")
        sets = {"base": [svc.new_ctx(token, "You are terse.") for _ in range(contexts)]}
        for i in range(contexts):
            svc.add_adapter(f"a{i}", f"a{i}")
        sets["adapters"] = [svc.new_ctx(token, "You are terse.", adapter=f"a{i}") for i in range(contexts)]
        for ctxs in sets.values():  # warm: first prefill of each context
            for c in ctxs:
                svc.call(token, c, "Hello.", max_tokens=2)
        rates: dict[str, list[float]] = {name: [] for name in sets}
        for r in range(rounds):
            order = list(sets) if r % 2 == 0 else list(sets)[::-1]
            for name in order:
                tokens, seconds = 0, 0.0
                for k, c in enumerate(sets[name]):
                    o = svc.call(token, c, PROMPTS[(r + k) % len(PROMPTS)], max_tokens=max_tokens)
                    tokens += max(0, o.completion_tokens - 1)  # the first token is the prefill's
                    seconds += o.total_s - o.ttft_s
                rates[name].append(tokens / seconds if seconds > 0 else 0.0)
            print(f"round {r + 1}/{rounds}: " + ", ".join(f"{n} {rates[n][-1]:.1f} tok/s" for n in sets),
                  file=sys.stderr)
        return rates
    finally:
        svc.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, default=4, help="contexts per set = adapters in use (default 4)")
    ap.add_argument("--rank", type=int, default=8, help="adapter rank (default 8)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--weights", default="fp32", help="weight format of the base model (default fp32)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    rates = run(a.contexts, a.rank, a.rounds, a.max_tokens, a.weights, a.threads)
    med = {n: statistics.median(v) for n, v in rates.items()}
    spread = {n: max(v) - min(v) for n, v in rates.items()}
    cmd = "python -m bench.lora " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"Command: `{cmd.strip()}`. Date: {datetime.date.today()}. Machine: {platform.machine()}, "
          f"{a.threads} threads. Medians of {a.rounds} rounds (order alternating).\n")
    print("| contexts | decode, tok/s | spread, tok/s |\n|---|---:|---:|")
    print(f"| {a.contexts} on the base model | {med['base']:.1f} | {spread['base']:.1f} |")
    print(f"| {a.contexts}, each under its own rank-{a.rank} adapter (all 7 projections) | {med['adapters']:.1f} | "
          f"{spread['adapters']:.1f} |")
    print(f"\nadapters / base: {med['adapters'] / med['base']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
