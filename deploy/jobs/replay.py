"""Replay a context-switching trace against memory policies (issue 6): the `bench.replay` job.

    python -m deploy.jobs.replay [--trace FILE | --pattern markov --contexts 8 --calls 30]
        [--policies lmk swap vllm-s vllm-sq llms] [--kv-budget BYTES] [--throttle-mbps MB/s]
        [--max-tokens 8] [--max-gap-s 0 | --think-ms MS] [--chunk-tokens 16] [--ray] --out RESULTS_DIR

Also `llmaas bench replay ...`, and `ray job submit -- python -m deploy.jobs.replay --ray ...`: under
`ray job submit` (RAY_ADDRESS set) `--ray` attaches to that cluster (`ray.init(address="auto")`) and
starts one set of service actors per policy there, which need two free CPUs; otherwise `--ray` starts a
local Ray for the run. Without `--ray` every policy runs in this process (the in-process wiring (`wire_local`)), the fastest.

Writes RESULTS_DIR/calls.csv (one row per call per policy), RESULTS_DIR/summary.json and the trace it
replayed (RESULTS_DIR/trace.jsonl); `llmaas bench report RESULTS_DIR` turns them into tables and plots.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from pathlib import Path

PROG = "python -m deploy.jobs.replay"
DEFAULT_CALLS = 30  # calls of a generated trace when --calls is not given (count)


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    from bench.replay import CHUNK_TOKENS_RANGE, DEFAULT_CHUNK_TOKENS
    from bench.switching import POLICIES
    from bench.traces import PATTERNS, TraceConfig

    lo, hi = CHUNK_TOKENS_RANGE

    d = TraceConfig()
    p = argparse.ArgumentParser(prog=prog, description="Replay a context-switching trace against memory "
                                "policies, each on a fresh service; per-call CSV and a summary JSON.")
    t = p.add_argument_group("trace (loaded with --trace, else generated)")
    t.add_argument("--trace", type=Path, metavar="FILE", help="a trace written by bench.traces (JSON lines)")
    t.add_argument("--pattern", default="markov", choices=sorted(PATTERNS), help="switching pattern (default markov)")
    t.add_argument("--contexts", type=int, default=8, help="active contexts (default 8)")
    t.add_argument("--rate", type=float, default=d.rate_per_s, help="Poisson calling rate, calls/s (default %(default)s)")
    t.add_argument("--seed", type=int, default=0, help="seed of the trace and the histories (default 0)")
    t.add_argument("--calls", type=int, default=None, metavar="N",
                   help=f"at most N calls (a generated trace has N; default {DEFAULT_CALLS} generated, all loaded)")
    r = p.add_argument_group("replay")
    r.add_argument("--policies", nargs="+", default=list(POLICIES), metavar="NAME",
                   help=f"policy sets, each on a fresh data directory (default: {' '.join(POLICIES)})")
    r.add_argument("--kv-budget", type=int, default=0, metavar="BYTES",
                   help="KV pool budget, bytes as stored (default: a quarter of the contexts' histories at q8)")
    r.add_argument("--throttle-mbps", type=float, default=0.0, metavar="MBPS", help="chunk read throttle, MB/s (0: off)")
    r.add_argument("--max-tokens", type=int, default=8, help="most reply tokens per call (default 8)")
    r.add_argument("--max-gap-s", type=float, default=0.0, metavar="S",
                   help="longest idle gap kept between calls, s; the service's background work always "
                        "finishes first (default 0: back to back once it has)")
    r.add_argument("--think-ms", type=float, default=None, metavar="MS",
                   help="send each call MS after the previous reply instead, whether or not the service's "
                        "background work has finished (0: truly back to back, as when several apps are "
                        "busy); replaces the trace's gaps and --max-gap-s"),
    r.add_argument("--history-tokens", type=int, nargs=2, default=(1000, 1900), metavar=("LO", "HI"),
                   help="each context's starting history of real text, tokens (default 1000 1900)")
    r.add_argument("--max-context", type=int, default=4096, metavar="TOKENS", help="context limit (default 4096)")
    r.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS, metavar="N",
                   help=f"tokens per K/V chunk, a power of two from {lo} to {hi} (LLMS §5.4; default %(default)s)")
    r.add_argument("--tuning", action="append", default=[], metavar="NAME=VALUE",
                   help="a switch of actors.config.Tuning for the services, e.g. streaming_stores=false (repeatable)")
    r.add_argument("--weights", default="fp32", metavar="FORMAT",
                   help="weight format: fp32 (default), bf16, int8, int4, int4-g128, ... (README, 'The model')")
    r.add_argument("--ray", action="store_true", help="the service's Ray actors instead of one process")
    r.add_argument("--address", default=None,
                   help="with --ray: the cluster to attach to (default: $RAY_ADDRESS, as under ray job "
                        "submit, else a new local Ray)")
    r.add_argument("--work-dir", default=os.environ.get("LLMAAS_BENCH_DIR"), metavar="DIR",
                   help="where the policies' data directories are made, then removed (default: a temp dir)")
    p.add_argument("--out", type=Path, required=True, metavar="RESULTS_DIR", help="where the results go")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return p


def _trace(args, engine):
    from bench.traces import TraceConfig, generate_trace, load_trace

    if args.trace is not None:
        return load_trace(args.trace)

    def model_tokens(text: str) -> int:  # the name lands in the trace header
        return len(engine.tok.encode(text))

    cfg = TraceConfig(pattern=args.pattern, contexts=args.contexts, calls=args.calls or DEFAULT_CALLS,
                      rate_per_s=args.rate)
    return generate_trace(cfg, args.seed, count_tokens=model_tokens)


def _pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise ValueError(f"--tuning takes NAME=VALUE, got {text!r}")
    return name, value


def _init_ray(address: str | None) -> None:
    import ray

    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address or "auto", log_to_driver=False)
    else:
        from actors.ray_actors import RAY_SYSTEM_CONFIG

        ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False,
                 _system_config=RAY_SYSTEM_CONFIG)


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    from bench.replay import ReplayConfig, replay, run_meta, write_results
    from engine.config import EngineConfig
    from engine.context import ContextEngine
    from scheduler.policies import get_policy

    try:  # bad arguments and policy names fail here, before seconds of model loading
        config = ReplayConfig(policies=tuple(args.policies), kv_budget_bytes=args.kv_budget,
                              throttle_mbps=args.throttle_mbps, max_tokens=args.max_tokens,
                              max_gap_s=args.max_gap_s, think_ms=args.think_ms, calls=args.calls or 0,
                              history_tokens=tuple(args.history_tokens), max_context_tokens=args.max_context,
                              use_ray=args.ray, seed=args.seed, chunk_tokens=args.chunk_tokens,
                              tuning=tuple(_pair(t) for t in args.tuning), weights=args.weights)
        for name in config.policies:
            get_policy(name)
    except (ValueError, KeyError) as e:
        parser.error(str(e))
    engine = ContextEngine.load(None, EngineConfig(max_context_tokens=args.max_context, weights=config.weights))
    trace = _trace(args, engine)
    print(trace.summary(), file=sys.stderr)
    if args.ray:
        _init_ray(args.address)
    try:
        with tempfile.TemporaryDirectory(prefix="llmaas-replay-", dir=args.work_dir) as tmp:
            result = replay(trace, config, engine, tmp, progress=not args.quiet,
                            log=lambda s: print(s, file=sys.stderr))
    finally:
        if args.ray:
            import ray

            ray.shutdown()
    out = write_results(args.out, result, trace, run_meta(f"{prog} {shlex.join(argv)}"))
    print(f"results in {out}/ (calls.csv, summary.json, trace.jsonl)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
