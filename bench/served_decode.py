"""Decode and prefill on the served path (the actors on a local Ray) against the bare engine in this
process, and what the executor's torch threads buy (`Tuning.executor_threads`, docs/benchmarks.md
"Tuning at the edge").

Arms: (engine) the bare `ContextEngine` in this process, on every core, with the service's lookup
decoding; (ray N) a fresh local Ray with the service's actors (`actors.ray_service.wire_ray`, policy `llms`, a KV budget of a quarter of the
context at q8), its executor on N torch threads (0: `Tuning.executor_threads`'s default, every CPU).
Each arm runs the calls of `bench.decode_overhead`: a ~1.5K-token real-text prompt decoding up to
`--max-tokens` greedy tokens, a call on another context (which takes the working set), then a short
follow-up on the first context, which restores it first. Per call the outcome's figures: decode
tokens/s = (completion_tokens - 1) / (total_s - ttft_s - switch_s), the first call's prefill (its
ttft_ms) and the follow-up's switch_ms. The arms' order rotates from round to round; medians of the
rounds, and each Ray arm's decode over the engine's of the same round (paired; prefill: the
engine's time over the arm's).

`--spins` adds arms by the executor's OpenMP spin (`Tuning.executor_spin`) and `--busy K` runs K
busy-looping processes beside every arm, as on a box with other work.

    python -m bench.served_decode [--rounds 3] [--threads 0 1] [--spins 10000 0] [--busy 1]
                                  [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.accuracy import machine_line
from bench.markdown import publish

NAME, HEADING = "served-decode", "## Decode speed with context management"


def outcome_rates(res) -> dict:
    """Decode tokens/s, prefill ms and switch ms of one call's outcome."""
    switch_s = getattr(res, "switch_ms", 0.0) / 1000
    span = res.total_s - res.ttft_s - switch_s
    return {"decode": (res.completion_tokens - 1) / span if res.completion_tokens > 1 and span > 0 else 0.0,
            "ttft_ms": (res.ttft_s - switch_s) * 1000, "switch_ms": switch_s * 1000,
            "tokens": res.completion_tokens, "ids": list(res.token_ids)}


def run_engine(engine, p1: str, p2: str, max_tokens: int) -> list[dict]:
    ctx = engine.new_ctx()
    try:
        return [outcome_rates(engine.call(ctx, p, max_tokens=max_tokens)) for p in (p1, p2)]
    finally:
        engine.delete_ctx(ctx)


def run_ray(threads: int, engine, p1: str, p2: str, max_tokens: int, pool: int, tmp: str,
            spin: int | None = None) -> list[dict]:
    import ray

    from actors.ray_actors import RAY_SYSTEM_CONFIG
    from bench.switching import open_service, wait_idle

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, _system_config=RAY_SYSTEM_CONFIG)
    try:
        tuning = {"executor_threads": threads} | ({} if spin is None else {"executor_spin": spin})
        svc = open_service("llms", engine, pool, 0.0, True, tmp, options={"tuning": tuning, "rag": {"predict": False}})
        tok = svc.bind("bench")
        ctx, other = svc.new_ctx(tok), svc.new_ctx(tok)
        svc.call(tok, other, p2, max_tokens=8)  # warm-up: the actors' first call, untimed
        wait_idle(svc)
        first = outcome_rates(svc.call(tok, ctx, p1, max_tokens=max_tokens))
        wait_idle(svc)
        svc.call(tok, other, "Say hello.", max_tokens=1)  # takes the working set: the next call restores
        wait_idle(svc)
        second = outcome_rates(svc.call(tok, ctx, p2, max_tokens=max_tokens))
        svc.close()
        return [first, second]
    finally:
        ray.shutdown()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each arm once a round (default 3)")
    ap.add_argument("--threads", type=int, nargs="+", default=[0, 1],
                    help="executor torch threads of the Ray arms (0: the default, every CPU; default: 0 1)")
    ap.add_argument("--spins", type=int, nargs="+",
                    help="arms by the executor's OpenMP spin (`Tuning.executor_spin`; 0: libgomp's default) "
                         "for each thread count (default: the default spin only)")
    ap.add_argument("--busy", type=int, default=0,
                    help="busy-looping processes running beside every arm: a box with other work (default 0)")
    ap.add_argument("--prompt-tokens", type=int, default=1536, help="first prompt's length in tokens (default 1536)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens to decode per call (default 128)")
    ap.add_argument("--write", type=Path, help=f"replace the {NAME} section of this markdown file")
    args = ap.parse_args(argv)

    from actors.config import Tuning
    from bench.decode_overhead import prompts
    from bench.switching import quarter_q8_budget
    from engine.config import EngineConfig
    from engine.context import ContextEngine

    # the service's decoding (lookup decoding as `Tuning` sets it): the same replies, the same passes
    engine = ContextEngine.load(None, EngineConfig(max_context_tokens=4096, lookup_draft=Tuning().lookup_draft))
    p1, p2 = prompts(engine, args.prompt_tokens, 64)
    pool, tokens = quarter_q8_budget(engine, [p1])
    arms = ["engine"] + [f"ray {n}" + ("" if s is None else f" spin {s}") for n in args.threads
                         for s in (args.spins or [None])]
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    t0 = time.perf_counter()
    try:
        res = run_arms(args, arms, engine, p1, p2, pool, t0)
    finally:
        for b in busy:
            b.kill()
    return report(args, arms, res, pool, tokens, t0)


def ray_arm(arm: str) -> tuple[int, int | None]:
    """A Ray arm's executor threads and OpenMP spin (None: the default) from its name, `ray N [spin S]`."""
    words = arm.split()
    return int(words[1]), int(words[3]) if len(words) > 3 else None


def run_arms(args, arms: list[str], engine, p1: str, p2: str, pool: int, t0: float) -> dict[str, list]:
    res: dict[str, list[list[dict]]] = {a: [] for a in arms}
    run_engine(engine, p1, p2, 8)  # warm-up
    with tempfile.TemporaryDirectory(dir=os.environ.get("LLMAAS_BENCH_DIR")) as tmp:
        for k in range(args.rounds):
            for arm in arms[k % len(arms):] + arms[:k % len(arms)]:
                if arm == "engine":
                    got = run_engine(engine, p1, p2, args.max_tokens)
                else:
                    threads, spin = ray_arm(arm)
                    got = run_ray(threads, engine, p1, p2, args.max_tokens, pool,
                                  str(Path(tmp) / f"{k}-{arm.replace(' ', '')}"), spin=spin)
                res[arm].append(got)
                print(f"round {k + 1} {arm}: decode {got[0]['decode']:.1f} / {got[1]['decode']:.1f} tok/s, "
                      f"prefill {got[0]['ttft_ms']:.0f} ms, switch {got[1]['switch_ms']:.0f} ms "
                      f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return res


def report(args, arms: list[str], res: dict[str, list], pool: int, tokens: int, t0: float) -> int:
    med = statistics.median
    cmd = (f"python -m bench.served_decode --rounds {args.rounds} --threads {' '.join(map(str, args.threads))} "
           + (f"--spins {' '.join(map(str, args.spins))} " if args.spins else "")
           + (f"--busy {args.busy} " if args.busy else "")
           + f"--prompt-tokens {args.prompt_tokens} --max-tokens {args.max_tokens}")
    lines = [
        f"Command: `{cmd}`. {machine_line()}. Default model, float32, greedy; "
        f"{(time.perf_counter() - t0) / 60:.1f} min.",
        "",
        f"The served path (a fresh local Ray per run: the service's actors, policy `llms`, KV budget "
        f"{pool / 1e6:.1f} MB, a quarter of the context at q8) against the bare engine in this process "
        f"({os.cpu_count()} torch threads){f', {args.busy} busy process(es) beside every arm' if args.busy else ''}"
        f": a {tokens}-token prompt decoding up to {args.max_tokens} tokens, a "
        "call on another context, then a 64-token follow-up that restores the context first. Decode "
        "tokens/s from each call's outcome ((completion_tokens - 1) / (total_s - ttft_s - switch_s)); the "
        f"arms' order rotated over {args.rounds} rounds; medians, and decode over the engine's of the same "
        "round (paired; prefill: the engine's time over the arm's). `executor threads` 0 is "
        "`Tuning.executor_threads`'s default (every CPU).",
        "",
        "| arm | first call decode, tok/s | vs engine | its prefill, ms | vs engine | follow-up decode, tok/s | "
        "follow-up switch_ms | replies as the engine's: first, follow-up |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    base = res["engine"]
    for arm in arms:
        rows = res[arm]
        decode = med(r[0]["decode"] / b[0]["decode"] for r, b in zip(rows, base))
        prefill = med(b[0]["ttft_ms"] / r[0]["ttft_ms"] for r, b in zip(rows, base))
        same = [sum(r[t]["ids"] == b[t]["ids"] for r, b in zip(rows, base)) for t in (0, 1)]
        threads, spin = ray_arm(arm) if arm != "engine" else (0, None)
        label = "engine (this process)" if arm == "engine" else f"Ray, executor threads {threads}" + (
            "" if spin is None else f", spin {spin}")
        lines.append(f"| {label} | {med(r[0]['decode'] for r in rows):.1f} | {decode:.2f}x | "
                     f"{med(r[0]['ttft_ms'] for r in rows):.0f} | {prefill:.2f}x | {med(r[1]['decode'] for r in rows):.1f} | "
                     f"{med(r[1]['switch_ms'] for r in rows):.1f} | {same[0]}, {same[1]} of {len(rows)} |")
    lines += ["", "The follow-up's reply is the engine's only where the restored context is exact; the service "
              "compresses it under this budget, so its reply, and how many tokens lookup decoding guesses "
              "right, differ: its decode rate is not compared with the engine's."]
    return publish("\n".join(lines), args.write, NAME, HEADING)


if __name__ == "__main__":
    sys.exit(main())
