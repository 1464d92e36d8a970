"""What each speed-only optimisation buys (docs/benchmarks.md, "Tuning at the edge"): the mean switch
of `bench.switching`'s trace with the optimisation on and off, in alternated rounds of one script run.

Each round runs the trace twice, on a fresh service each time (and, with `--ray`, on a fresh local
Ray): once as configured by default and once with the one switch turned off, the order alternating
from round to round so that a drift of the machine favours neither. Calls come with an idle gap in
which the previous call's write-back finishes (as in `bench.switching`), or back to back
(`--back-to-back`), where a call may wait for it. Per switch it reports the
median of the per-round means of each version, the gain (off less on), and the round-to-round
spread: the larger of the two versions' median absolute deviations of their per-round means. A
switch is worth keeping where the gain is more than twice that spread.

    python -m bench.tuning streaming_stores object_chunks [--rounds 6] [--ray] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.markdown import publish

NAME, HEADING = "tuning", "## Tuning at the edge"
"""The page's blocks are `NAME:<mode>` (`bench.markdown.markers`) under HEADING."""

SWITCHES: dict[str, tuple[dict, str]] = {
    "streaming_stores": ({"tuning": {"streaming_stores": False}}, "any"),
    "object_chunks": ({"tuning": {"object_chunks": 1}}, "ray"),
    "executor_threads": ({"tuning": {"executor_threads": 1}}, "ray"),
    "executor_spin": ({"tuning": {"executor_spin": 0}}, "ray"),
}
"""Switch name -> (the `ServiceConfig` options that turn it off, where it acts: "ray" or "any")."""


def mad(xs: list[float]) -> float:
    """Median absolute deviation from the median."""
    m = statistics.median(xs)
    return statistics.median(abs(x - m) for x in xs)


def verdict(on: list[float], off: list[float]) -> dict:
    """The comparison of per-round means (ms) with the switch on and off."""
    med_on, med_off = statistics.median(on), statistics.median(off)
    spread = max(mad(on), mad(off))
    gain = med_off - med_on
    return {"median_on": med_on, "median_off": med_off, "gain": gain, "spread": spread,
            "keep": gain > 2 * spread}


def run_once(args, engine, prompts, order, pool, options: dict, tmp: str) -> float:
    """One run of the trace on a fresh service; its mean switch_ms over the policies given."""
    from bench.switching import run_policy, summarise

    if args.ray:
        import ray

        from actors.ray_actors import RAY_SYSTEM_CONFIG

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config=RAY_SYSTEM_CONFIG)
    try:
        means = [summarise(run_policy(pol, engine, prompts, order, pool, 0.0, args.ray, tmp, options,
                                      idle=not args.back_to_back))["mean_switch_ms"] for pol in args.policies]
    finally:
        if args.ray:
            ray.shutdown()
    return statistics.mean(means)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("switches", nargs="+", choices=sorted(SWITCHES), metavar="SWITCH",
                    help=f"optimisations to measure: {', '.join(sorted(SWITCHES))}")
    ap.add_argument("--rounds", type=int, default=6, help="alternated rounds per switch (default 6)")
    ap.add_argument("--ray", action="store_true", help="run on a local Ray (the actor path) instead of one process")
    ap.add_argument("--back-to-back", action="store_true",
                    help="no idle gap between calls: a call may wait for the previous call's write-back")
    ap.add_argument("--calls", type=int, default=30, help="switching calls per run (default 30)")
    ap.add_argument("--contexts", type=int, default=8, help="active contexts (default 8)")
    ap.add_argument("--policies", nargs="+", default=["llms"], help="policies each run (default llms)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", type=Path, help="replace this script's section of a markdown file")
    args = ap.parse_args(argv)
    for name in args.switches:
        if SWITCHES[name][1] == "ray" and not args.ray:
            ap.error(f"{name} acts on the actor path only: add --ray")
    if args.rounds < 2:
        ap.error("--rounds must be at least 2")

    from bench.switching import long_prompts, markov_order, quarter_q8_budget
    from engine.config import EngineConfig
    from engine.context import ContextEngine

    engine = ContextEngine.load(None, EngineConfig(max_context_tokens=4096))
    prompts = long_prompts(engine, args.contexts, args.seed)
    order = markov_order(args.contexts, args.calls, args.seed)
    pool, tokens = quarter_q8_budget(engine, prompts)
    rows = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=os.environ.get("LLMAAS_BENCH_DIR")) as tmp:
        for name in args.switches:
            off_options = SWITCHES[name][0]
            on, off = [], []
            for k in range(args.rounds):
                arms = [("on", {}), ("off", off_options)]
                for arm, options in arms if k % 2 == 0 else arms[::-1]:
                    ms = run_once(args, engine, prompts, order, pool, options, str(Path(tmp) / f"{name}-{k}-{arm}"))
                    (on if arm == "on" else off).append(ms)
                    print(f"{name} round {k + 1} {arm}: mean switch {ms:.2f} ms "
                          f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
            v = verdict(on, off)
            rows.append((name, on, off, v))
            print(f"{name}: on {v['median_on']:.2f} ms, off {v['median_off']:.2f} ms, gain {v['gain']:.2f} ms, "
                  f"spread {v['spread']:.2f} ms: {'keep' if v['keep'] else 'buys less than the noise'}",
                  file=sys.stderr, flush=True)
    mode = ("Ray actors" if args.ray else "one process") + (", back to back" if args.back_to_back else "")
    cmd = (f"python -m bench.tuning {' '.join(args.switches)} --rounds {args.rounds}" + (" --ray" if args.ray else "")
           + (" --back-to-back" if args.back_to_back else "")
           + (f" --calls {args.calls}" if args.calls != 30 else "") + (f" --contexts {args.contexts}" if args.contexts != 8 else "")
           + (f" --policies {' '.join(args.policies)}" if args.policies != ["llms"] else ""))
    lines = [
        f"Command: `{cmd}`. Date: {datetime.date.today().isoformat()}. Machine: {os.cpu_count()} cores, "
        f"{platform.machine()}. {mode}; {args.contexts} contexts, {tokens} prompt tokens, pool {pool / 1e6:.1f} MB, "
        f"{args.calls} Markov calls a run, policies {', '.join(args.policies)}. Per round and version the mean "
        "switch_ms; medians of the rounds; spread: the larger median absolute deviation of the two versions' "
        "round means.",
        "",
        "| switch | on: median (rounds), ms | off: median (rounds), ms | gain, ms | spread, ms | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for name, on, off, v in rows:
        lines.append(f"| {name} | {v['median_on']:.2f} ({' '.join(f'{x:.1f}' for x in on)}) | "
                     f"{v['median_off']:.2f} ({' '.join(f'{x:.1f}' for x in off)}) | {v['gain']:.2f} | "
                     f"{v['spread']:.2f} | {'keep' if v['keep'] else 'less than twice the spread'} |")
    return publish("\n".join(lines), args.write, f"{NAME}:{mode}", HEADING)


if __name__ == "__main__":
    sys.exit(main())
