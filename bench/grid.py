"""The full experiment sets of issue 6 (LLMS §5.1, §5.3, §5.4: Fig. 9, 10, 13, 14) as sequences of trace
replays, one policy per run, resumable.

    python -m bench.grid --set grid capacity ablation chunks [--out docs/results/grid] [--calls 30]

Sets (`--set`, several or `all`; the policies are `scheduler.policies` names):

- `grid` (Fig. 9): 2/4/8/12/16 contexts x lmk swap vllm-s vllm-sq llms x markov/random/gaussian x no
  read throttle and 50 MB/s; KV budget 2 average contexts at q8.
- `capacity` (Fig. 10): budgets of 1, 2 and 4 average contexts at q8 x 2/4/8/12/16 contexts x the five
  policies, markov, no throttle; the report finds the most contexts meeting 10 ms and 25 ms.
- `ablation` (Fig. 13): llms and llms-no-compress/-no-lctru/-no-aot/-no-pipeline, 8 contexts, markov,
  with and without the 50 MB/s throttle; budget 2 average contexts.
- `chunks` (Fig. 14): llms with 4, 8, 16, 32 and 64-token chunks, 8 contexts, markov, budget 2.

Budgets are fixed bytes per budget, not per context count, as LLMS' fixed memory: an "average context"
is the mean of the first 16 seeded histories (`bench.switching.long_prompts`; an n-context run's
histories are the first n of them) as one user turn each, at q8 as stored with its scales. 2 average
contexts is a quarter of 8, the issue's target setting, so the grid's 8-context Markov runs are that
setting too. Same bytes at every chunk size: smaller chunks pay more q8 scales in the same pool.

Every run (a setting and one policy) writes a results directory of `bench.replay` named by its
parameters, `OUT/<pattern>-<n>ctx-b<budget>-<disk|T mbps>-c<chunk>-<policy>/`, through a temporary
directory renamed when complete: a directory with its `summary.json` is done and skipped, so an
interrupted grid continues where it stopped when run again, and sets share their common runs (the
grid's 8-context Markov llms run is also the ablation's and the chunk sweep's). A finished run whose
options differ (calls, histories, budget, ...) stops the grid instead of being mixed in. Each set's
manifest, `OUT/set-<name>.json`, lists its runs; `python -m bench.report --grid OUT` renders the sets
from it, blanks for missing runs. The model is loaded once per process; runs are in one process
(the in-process wiring (`wire_local`)), one after the other.

Duration on 2 cores, from an 8-context, 30-call llms run (103 s with another benchmark running, ~70 s
quiet) and make bench's per-policy times: grid ~3.8 h quiet (~5.7 h under load), capacity ~1.7 h
alone or ~1.1 h after the grid (25 runs shared), ablation ~12 min, chunks ~6 min; all four (212
runs) ~5 h quiet, ~8 h under load. Throttled runs of swap and vllm-s add ~35 s per 8 contexts (their
~1.7 GB read at 50 MB/s). `--dry-run` lists the runs left with an estimate.

This module knows the sets and how to run them; the tables and plots are `bench.report`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.replay import DEFAULT_CHUNK_TOKENS, SUMMARY_JSON

SET_FORMAT, SET_VERSION = "llmaas-grid-set", 1  # a manifest's "format" and "version"
SETS = ("grid", "capacity", "ablation", "chunks")
BASELINES = ("lmk", "swap", "vllm-s", "vllm-sq")
FIVE = (*BASELINES, "llms")  # the five policies
ABLATIONS = ("llms", "llms-no-compress", "llms-no-lctru", "llms-no-aot", "llms-no-pipeline")
PATTERNS = ("markov", "random", "gaussian")
CONTEXTS = (2, 4, 8, 12, 16)  # active contexts of the grid and capacity sets (count)
AT_CONTEXTS = 8  # active contexts of the ablation and chunk sets (count)
THROTTLE_MBPS = 50.0  # the slow-storage setting, MB/s
BUDGETS = (1.0, 2.0, 4.0)  # capacity: KV budgets, average contexts at q8
MAIN_BUDGET = 2.0  # grid, ablation, chunks: average contexts at q8 (a quarter of 8)
CHUNK_SIZES = (4, 8, 16, 32, 64)  # chunks: tokens per chunk
BUDGET_REF_CONTEXTS = 16  # an average context is the mean of this many seeded histories
DEFAULT_OUT = Path("docs/results/grid")
PARTIAL = ".partial"  # suffix of a run directory being written

# Prior of a run's wall time, before any run of this process has finished: seconds per history token
# prefilled at set-up and per call (lmk recomputes whole contexts on a miss). From 8-context, 30-call
# Markov runs on 2 cores: set-up 21 s for 12147 history tokens; per call 1.5 s (lmk 3.9 s) on a quiet
# machine (make bench, 2026-11-22), 2.7 s for llms with another benchmark running.
PRIOR_S_PER_HISTORY_TOKEN = 0.0018
PRIOR_S_PER_CALL = {"lmk": 3.9}
PRIOR_S_PER_CALL_DEFAULT = 1.5


class GridError(RuntimeError):
    """A results directory or manifest that cannot be continued with these options."""


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One run: one policy replaying one setting."""

    pattern: str  # switching pattern (bench.traces.PATTERNS)
    contexts: int  # active contexts (count)
    policy: str  # policy set name
    budget_contexts: float  # KV budget, average contexts at q8
    throttle_mbps: float = 0.0  # chunk read throttle, MB/s; 0 for none
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS  # tokens per K/V chunk

    @property
    def name(self) -> str:
        """The run's directory name: every parameter, so sets can share runs."""
        thr = f"{self.throttle_mbps:g}mbps" if self.throttle_mbps else "disk"
        return (f"{self.pattern}-{self.contexts:02d}ctx-b{self.budget_contexts:g}-{thr}"
                f"-c{self.chunk_tokens}-{self.policy}")


@dataclass(frozen=True, slots=True)
class GridOptions:
    """What every run of a grid shares; a finished run made with other values is not reused."""

    calls: int = 30
    """Calls per run (count): a generated trace of this many calls."""
    max_tokens: int = 8
    """Most reply tokens of a call (tokens)."""
    history_tokens: tuple[int, int] = (1000, 1900)
    """Each context's starting history: at least a target drawn from [lo, hi) tokens."""
    max_context_tokens: int = 4096
    """Context limit of the service (tokens)."""
    seed: int = 0
    """Seed of the traces and the histories."""

    def __post_init__(self) -> None:
        if self.calls < 1 or self.max_tokens < 1:
            raise ValueError("calls and max_tokens must be >= 1")
        lo, hi = self.history_tokens
        if not 1 <= lo < hi:
            raise ValueError(f"history_tokens must be 1 <= lo < hi, got {self.history_tokens}")


def set_runs(name: str, *, contexts: Sequence[int] = CONTEXTS, at_contexts: int = AT_CONTEXTS,
             throttle_mbps: float = THROTTLE_MBPS) -> list[RunSpec]:
    """The runs of set `name` (one of SETS; ValueError lists them), in the order they run."""
    thr = (0.0, throttle_mbps)
    if name == "grid":
        return [RunSpec(p, n, pol, MAIN_BUDGET, t) for p in PATTERNS for t in thr for n in contexts for pol in FIVE]
    if name == "capacity":
        return [RunSpec("markov", n, pol, b) for b in BUDGETS for n in contexts for pol in FIVE]
    if name == "ablation":
        return [RunSpec("markov", at_contexts, pol, MAIN_BUDGET, t) for t in thr for pol in ABLATIONS]
    if name == "chunks":
        return [RunSpec("markov", at_contexts, "llms", MAIN_BUDGET, 0.0, c) for c in CHUNK_SIZES]
    raise ValueError(f"unknown set {name!r}; valid: {', '.join(SETS)}")


# -- manifests --------------------------------------------------------------------------------------


def manifest_path(out: str | Path, set_name: str) -> Path:
    return Path(out) / f"set-{set_name}.json"


def write_manifest(out: str | Path, set_name: str, runs: Sequence[RunSpec], opts: GridOptions,
                   meta: dict, budget: dict) -> Path:
    """`OUT/set-<name>.json`: the set's runs (names and parameters), options, budget rule and `meta`
    (command, date, machine of this invocation)."""
    path = manifest_path(out, set_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": SET_FORMAT, "version": SET_VERSION, "set": set_name, **meta,
           "options": asdict(opts), "budget": budget,
           "runs": [{"name": r.name, **asdict(r)} for r in runs]}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def read_manifest(path: str | Path) -> tuple[dict, list[RunSpec]]:
    """A manifest and its runs (GridError when it is not one)."""
    try:
        doc = json.loads(Path(path).read_text())
        if doc.get("format") != SET_FORMAT or doc.get("version") != SET_VERSION:
            raise GridError(f"{path}: not a grid set manifest (format {doc.get('format')!r})")
        runs = [RunSpec(**{k: v for k, v in r.items() if k != "name"}) for r in doc["runs"]]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise GridError(f"{path}: unreadable grid set manifest ({e})") from e
    return doc, runs


def done(out: str | Path, spec: RunSpec) -> bool:
    return (Path(out) / spec.name / SUMMARY_JSON).exists()


def check_done(summary: dict, spec: RunSpec, opts: GridOptions, budget_bytes: int | None = None) -> None:
    """GridError when a finished run's summary was made with other options than `opts` (or another
    budget, when `budget_bytes` is given): its numbers would not be comparable."""
    t = summary["trace"]
    have = {"calls": t["calls"], "max_tokens": summary["max_tokens"],
            "history_tokens": tuple(summary["history_tokens_range"]),
            "max_context_tokens": summary["max_context_tokens"], "seed": t["seed"],
            "pattern": t["pattern"], "contexts": t["contexts"], "throttle_mbps": summary["throttle_mbps"],
            "chunk_tokens": summary.get("chunk_tokens", DEFAULT_CHUNK_TOKENS),
            "policies": list(summary["policies"])}
    want = {**{k: v for k, v in asdict(opts).items()}, "pattern": spec.pattern, "contexts": spec.contexts,
            "throttle_mbps": spec.throttle_mbps, "chunk_tokens": spec.chunk_tokens, "policies": [spec.policy]}
    if budget_bytes is not None:
        have["kv_budget_bytes"], want["kv_budget_bytes"] = summary["kv_budget_bytes"], budget_bytes
    diff = [f"{k} {have[k]!r} (want {want[k]!r})" for k in want if have[k] != want[k]]
    if diff:
        raise GridError(f"run {spec.name} is done with other settings: {', '.join(diff)}; use another "
                        "--out, other options, or remove that directory to run it again")


# -- time estimate ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Eta:
    """Remaining time: each run's prior (histories prefilled + calls, by policy) scaled by how long the
    runs of this process took against their priors."""

    opts: GridOptions
    actual_s: float = 0.0  # wall time of the runs finished in this process (s)
    prior_s: float = 0.0  # their priors (s)
    per_run: list[tuple[str, float]] = field(default_factory=list)  # (run name, seconds)

    def prior(self, spec: RunSpec) -> float:
        hist = spec.contexts * sum(self.opts.history_tokens) / 2
        per_call = PRIOR_S_PER_CALL.get(spec.policy, PRIOR_S_PER_CALL_DEFAULT)
        return hist * PRIOR_S_PER_HISTORY_TOKEN + self.opts.calls * per_call

    def observe(self, spec: RunSpec, seconds: float) -> None:
        self.actual_s += seconds
        self.prior_s += self.prior(spec)
        self.per_run.append((spec.name, seconds))

    def remaining(self, todo: Iterable[RunSpec]) -> float:
        scale = self.actual_s / self.prior_s if self.prior_s else 1.0
        return scale * sum(self.prior(s) for s in todo)


def hms(seconds: float) -> str:
    """`1h02m`, `5m07s`, `42s`."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


# -- running ----------------------------------------------------------------------------------------


def average_context(engine, opts: GridOptions) -> dict:
    """What "one average context at q8" is: the mean of BUDGET_REF_CONTEXTS seeded histories, each as
    one user turn, at q8 as stored (`bench.switching.quarter_q8_budget`)."""
    from bench.switching import long_prompts, quarter_q8_budget

    histories = long_prompts(engine, BUDGET_REF_CONTEXTS, opts.seed, opts.history_tokens)
    quarter, tokens = quarter_q8_budget(engine, histories)
    return {"rule": f"the mean of the first {BUDGET_REF_CONTEXTS} seeded histories (an n-context run's "
                    "are the first n), each as one user turn, as stored at q8 with its scales",
            "reference_contexts": BUDGET_REF_CONTEXTS,
            "average_context_tokens": tokens / BUDGET_REF_CONTEXTS,
            "average_context_q8_bytes": quarter * 4 / BUDGET_REF_CONTEXTS}


def replay_command(spec: RunSpec, opts: GridOptions, budget_bytes: int, out_dir: Path) -> str:
    """The `deploy.jobs.replay` command that makes the same run on its own."""
    args = ["--pattern", spec.pattern, "--contexts", str(spec.contexts), "--calls", str(opts.calls),
            "--seed", str(opts.seed), "--policies", spec.policy, "--kv-budget", str(budget_bytes),
            "--throttle-mbps", f"{spec.throttle_mbps:g}", "--chunk-tokens", str(spec.chunk_tokens),
            "--max-tokens", str(opts.max_tokens), "--history-tokens", *map(str, opts.history_tokens),
            "--max-context", str(opts.max_context_tokens), "--out", str(out_dir)]
    return f"python -m deploy.jobs.replay {shlex.join(args)}"


@dataclass(slots=True)
class Runner:
    """Runs specs into `out` with one loaded engine; traces are generated once per pattern and count."""

    engine: object  # engine.context.ContextEngine
    opts: GridOptions
    out: Path
    budget: dict  # average_context()
    grid_command: str
    work_dir: str | None = None  # parent of the policies' temporary data directories
    bars: bool = False  # tqdm bar per run
    log: Callable[[str], None] = lambda s: None
    _traces: dict = field(default_factory=dict)

    def budget_bytes(self, spec: RunSpec) -> int:
        return int(spec.budget_contexts * self.budget["average_context_q8_bytes"])

    def trace(self, pattern: str, contexts: int):
        from bench.traces import TraceConfig, generate_trace

        key = (pattern, contexts)
        if key not in self._traces:
            def model_tokens(text: str) -> int:  # the name lands in the trace header, as in deploy.jobs.replay
                return len(self.engine.tok.encode(text))

            cfg = TraceConfig(pattern=pattern, contexts=contexts, calls=self.opts.calls)
            self._traces[key] = generate_trace(cfg, self.opts.seed, count_tokens=model_tokens)
        return self._traces[key]

    def run(self, spec: RunSpec, set_name: str) -> dict:
        """Replay `spec` and write its results directory; returns the policy's summary."""
        from bench.replay import ReplayConfig, replay, run_meta, summarise, write_results

        trace = self.trace(spec.pattern, spec.contexts)
        budget = self.budget_bytes(spec)
        o = self.opts
        cfg = ReplayConfig(policies=(spec.policy,), kv_budget_bytes=budget, throttle_mbps=spec.throttle_mbps,
                           max_tokens=o.max_tokens, history_tokens=o.history_tokens,
                           max_context_tokens=o.max_context_tokens, seed=o.seed, chunk_tokens=spec.chunk_tokens)
        final = self.out / spec.name
        partial = self.out / (spec.name + PARTIAL)
        shutil.rmtree(partial, ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix="llmaas-grid-", dir=self.work_dir) as tmp:
            result = replay(trace, cfg, self.engine, tmp, progress=self.bars, log=self.log)
        meta = run_meta(replay_command(spec, o, budget, final))
        meta["grid"] = {"set": set_name, "run": spec.name, "command": self.grid_command, **asdict(spec),
                        "budget_rule": f"{spec.budget_contexts:g} average contexts at q8"}
        try:
            write_results(partial, result, trace, meta)
            if final.exists():  # a directory without summary.json: an earlier run's leftovers
                shutil.rmtree(final)
            os.replace(partial, final)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        return summarise(result.records[spec.policy])


def run_sets(set_names: Sequence[str], runner: Runner, *, contexts: Sequence[int], at_contexts: int,
             throttle_mbps: float, meta: dict, print_fn: Callable[[str], None] = print) -> int:
    """Write every set's manifest, then run what is not done yet, in order; returns runs made."""
    out, opts = runner.out, runner.opts
    plan: list[tuple[str, RunSpec]] = []
    seen: set[str] = set()
    by_set = {name: set_runs(name, contexts=contexts, at_contexts=at_contexts, throttle_mbps=throttle_mbps)
              for name in set_names}
    for name, runs in by_set.items():
        for spec in runs:
            if spec.name not in seen:
                seen.add(spec.name)
                plan.append((name, spec))
    for _, spec in plan:  # before anything is written: a mismatch stops the grid untouched
        if done(out, spec):
            check_done(json.loads((out / spec.name / SUMMARY_JSON).read_text()), spec, opts, runner.budget_bytes(spec))
    for name, runs in by_set.items():
        write_manifest(out, name, runs, opts, meta, runner.budget)
    eta = Eta(opts)
    todo = [spec for _, spec in plan if not done(out, spec)]
    print_fn(f"{len(plan)} runs in {', '.join(set_names)}: {len(plan) - len(todo)} done, {len(todo)} to run "
             f"(~{hms(eta.remaining(todo))} at the prior rate); results in {out}/")
    t_start = time.perf_counter()
    made = 0
    width = len(str(len(plan)))
    for k, (set_name, spec) in enumerate(plan, 1):
        head = f"[{k:>{width}}/{len(plan)}] {set_name:<8} {spec.name}"
        if done(out, spec):
            print_fn(f"{head}: done, skipped")
            continue
        t0 = time.perf_counter()
        s = runner.run(spec, set_name)
        dt = time.perf_counter() - t0
        eta.observe(spec, dt)
        todo.remove(spec)
        made += 1
        print_fn(f"{head}: mean switch {s['mean_switch_ms']:.1f} ms, {s['loaded_mb']:.0f} MB loaded, "
                 f"{s['recomputed_chunks']} chunks recomputed ({hms(dt)}); {hms(time.perf_counter() - t_start)} "
                 f"elapsed, ~{hms(eta.remaining(todo))} left")
    return made


def build_parser(prog: str = "python -m bench.grid") -> argparse.ArgumentParser:
    d = GridOptions()
    p = argparse.ArgumentParser(prog=prog, description="Run issue 6's experiment sets (LLMS Fig. 9, 10, 13, "
                                "14) as trace replays, one results directory per run; resumable.")
    p.add_argument("--set", nargs="+", required=True, choices=[*SETS, "all"], dest="sets",
                   help="grid (Fig. 9), capacity (Fig. 10), ablation (Fig. 13), chunks (Fig. 14), or all")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results root (default %(default)s)")
    p.add_argument("--calls", type=int, default=d.calls, help="calls per run (default %(default)s)")
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS), metavar="N",
                   help="active contexts of the grid and capacity sets (default: 2 4 8 12 16)")
    p.add_argument("--at-contexts", type=int, default=AT_CONTEXTS, metavar="N",
                   help="active contexts of the ablation and chunks sets (default %(default)s)")
    p.add_argument("--throttle-mbps", type=float, default=THROTTLE_MBPS, metavar="MBPS",
                   help="the slow-storage read throttle of the grid and ablation sets, MB/s (default %(default)g)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="most reply tokens per call (default %(default)s)")
    p.add_argument("--history-tokens", type=int, nargs=2, default=d.history_tokens, metavar=("LO", "HI"),
                   help="each context's starting history, tokens (default 1000 1900)")
    p.add_argument("--max-context", type=int, default=d.max_context_tokens, metavar="TOKENS",
                   help="context limit (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of traces and histories (default %(default)s)")
    p.add_argument("--work-dir", default=os.environ.get("LLMAAS_BENCH_DIR"), metavar="DIR",
                   help="where the runs' data directories are made, then removed (default: a temp dir)")
    p.add_argument("--dry-run", action="store_true", help="list the runs, done or not, and a prior time estimate")
    p.add_argument("--bars", action="store_true", help="a progress bar per run (default: one line per run)")
    return p


def main(argv: list[str] | None = None, prog: str = "python -m bench.grid") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    sets = list(SETS) if "all" in args.sets else list(dict.fromkeys(args.sets))
    try:
        from bench.traces import MAX_CONTEXTS, MIN_CONTEXTS

        opts = GridOptions(calls=args.calls, max_tokens=args.max_tokens, history_tokens=tuple(args.history_tokens),
                           max_context_tokens=args.max_context, seed=args.seed)
        for n in [*args.contexts, args.at_contexts]:
            if not MIN_CONTEXTS <= n <= MAX_CONTEXTS:
                raise ValueError(f"active contexts must be {MIN_CONTEXTS}..{MAX_CONTEXTS}, got {n}")
        if args.throttle_mbps <= 0:
            raise ValueError("--throttle-mbps must be > 0 (the sets run with and without it)")
    except ValueError as e:
        parser.error(str(e))
    contexts = sorted(set(args.contexts))
    kw = {"contexts": contexts, "at_contexts": args.at_contexts, "throttle_mbps": args.throttle_mbps}
    if args.dry_run:
        eta, seen = Eta(opts), set()
        for name in sets:
            runs = [r for r in set_runs(name, **kw) if r.name not in seen]
            seen.update(r.name for r in runs)
            todo = [r for r in runs if not done(args.out, r)]
            for r in runs:
                print(f"{name:<8} {r.name}: {'done' if r not in todo else 'to run'}")
            print(f"{name}: {len(runs)} new runs, {len(todo)} to run, ~{hms(eta.remaining(todo))} at the prior rate")
        return 0

    from bench.replay import run_meta
    from engine.config import EngineConfig
    from engine.context import ContextEngine

    command = f"{prog} {shlex.join(argv)}"
    engine = ContextEngine.load(None, EngineConfig(max_context_tokens=opts.max_context_tokens))
    runner = Runner(engine, opts, args.out, average_context(engine, opts), command, work_dir=args.work_dir,
                    bars=args.bars, log=(lambda s: print(s, file=sys.stderr)) if args.bars else (lambda s: None))
    b = runner.budget
    print(f"average context: {b['average_context_tokens']:.0f} tokens, {b['average_context_q8_bytes'] / 1e6:.2f} MB "
          f"at q8; budgets {', '.join(f'{k:g}' for k in BUDGETS)} of them", file=sys.stderr)
    try:
        run_sets(sets, runner, meta=run_meta(command), print_fn=lambda s: print(s, flush=True), **kw)
    except GridError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; run the same command again to continue", file=sys.stderr)
        return 130
    print(f"done; python -m bench.report --grid {args.out} --write docs/benchmarks.md renders the sets", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
