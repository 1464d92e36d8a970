"""Trace replay (LLMS §4-5): the calls of a trace (`bench.traces`) against one or more policies, each
on a fresh service and data directory, with one KV budget; per-call records and a summary per policy.

Every trace context starts with a history of real text (`bench.switching.long_prompts`, 1-2K tokens
by default), sent as its first user turn before the replay (not recorded). The trace's calls then go
to their contexts in order. Time is compressed: a call is sent `min(trace gap, max_gap_s)` after the
previous one was, but never before the service's background work (the previous call's write-back,
which does the ahead-of-time swap-out) has finished, so that work is never counted inside a
`switch_ms` it would not hit in real time, and never skipped either. A reply asks for the tokens the
trace's delta leaves after the prompt, capped at `max_tokens`.

The chunk size is a replay setting (`ReplayConfig.chunk_tokens`, LLMS §5.4): the K/V chunk size lives
in the model's engine config as well as the service's, so a service with another size than the loaded
model's runs on a sibling model sharing the same weights (`engine_with_chunks`, no reload), with a cost
profile measured for that size.

What a call's numbers mean is docs/design.md §1 (`switch_ms`) and `actors.messages.CallOutcome`; the
outcome names are `actors.metrics.switch_outcome`. This module knows nothing about argument parsing,
Ray start-up or plotting: `deploy.jobs.replay` is the entry point, `bench.report` the tables and plots.
"""

from __future__ import annotations

import csv
import datetime
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from functools import partial
from pathlib import Path

import numpy as np

from actors.metrics import SWITCH_OUTCOMES, switch_outcome
from bench.switching import (
    POLICIES,
    close_service,
    freeze_startup_objects,
    long_prompts,
    open_service,
    outcome_dict,
    quarter_q8_budget,
    wait_idle,
)
from bench.traces import Trace, TraceRecord

SUMMARY_FORMAT, SUMMARY_VERSION = "llmaas-replay", 1  # summary.json's "format" and "version"
CALLS_CSV, SUMMARY_JSON, TRACE_JSONL = "calls.csv", "summary.json", "trace.jsonl"  # file names in a results dir
DEFAULT_CHUNK_TOKENS = 16  # LLMS' chunk size and the service's default (actors.config.ServiceConfig)
# LLMS §5.4 sweeps 4-64 tokens. The engine takes any size >= 1, but q2's sub-byte packing is token-major
# only for a multiple of 4 tokens (storage.codecs), and a power of two keeps 4K-token contexts whole chunks.
CHUNK_TOKENS_RANGE = (4, 64)


def check_chunk_tokens(n: object) -> int:
    """`n` if it is a chunk size the replay supports (a power of two in CHUNK_TOKENS_RANGE), else ValueError."""
    lo, hi = CHUNK_TOKENS_RANGE
    if not isinstance(n, int) or isinstance(n, bool) or not lo <= n <= hi or n & (n - 1):
        sizes = ", ".join(str(1 << k) for k in range(lo.bit_length() - 1, hi.bit_length()))
        raise ValueError(f"chunk_tokens must be a power of two from {lo} to {hi} ({sizes}), got {n!r}")
    return n


@dataclass(slots=True)
class ReplayConfig:
    """How to replay a trace (the trace itself says which calls)."""

    policies: tuple[str, ...] = tuple(POLICIES)
    """Policy sets to replay, each on a fresh service (scheduler.policies.POLICIES names)."""
    kv_budget_bytes: int = 0
    """KV pool budget, bytes of resident chunks as stored; 0: a quarter of the histories at q8."""
    throttle_mbps: float = 0.0
    """Chunk read throttle emulating slow storage, MB/s (1e6 bytes); 0 for none."""
    max_tokens: int = 8
    """Most reply tokens of a call (tokens)."""
    max_gap_s: float = 0.0
    """Longest idle gap kept between two calls, seconds; the background work may make it longer."""
    think_ms: float | None = None
    """Think time instead of the trace's gaps: each call is sent this long after the previous reply,
    whether or not the service's background work has finished (0: back to back, as when several apps
    are busy). None: the trace's gaps, compressed by `max_gap_s`, after the background work."""
    calls: int = 0
    """Replay only the first `calls` calls of the trace (count); 0 for all."""
    history_tokens: tuple[int, int] = (1000, 1900)
    """Each context's starting history: at least a target drawn from [lo, hi) tokens."""
    max_context_tokens: int = 4096
    """Context limit of the service (tokens); a longer context overflows as the engine handles it."""
    use_ray: bool = False
    """The service's Ray actors (ray must be initialised) instead of one process."""
    seed: int = 0
    """Seed of the histories' text."""
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    """Tokens per K/V chunk of the services (a power of two, 4..64; LLMS §5.4)."""
    tuning: tuple[tuple[str, str], ...] = ()
    """Switches of `actors.config.Tuning` the services get, as (name, value); none: the defaults."""
    weights: str = "fp32"
    """Weight format of the model (engine.quant.WeightFormat); the engine passed must run it."""

    def __post_init__(self) -> None:
        from actors.config import tuning_from

        tuning_from(dict(self.tuning))  # unknown names and bad values fail here
        from engine.quant import WeightFormat

        self.weights = WeightFormat.parse(self.weights).tag
        if not self.policies:
            raise ValueError("at least one policy is needed")
        if self.kv_budget_bytes < 0 or self.throttle_mbps < 0 or self.max_gap_s < 0 or self.calls < 0:
            raise ValueError("kv_budget_bytes, throttle_mbps, max_gap_s and calls must be >= 0")
        if self.think_ms is not None and not (math.isfinite(self.think_ms) and self.think_ms >= 0):
            raise ValueError(f"think_ms must be a finite number >= 0, got {self.think_ms!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        lo, hi = self.history_tokens
        if not 1 <= lo < hi:
            raise ValueError(f"history_tokens must be 1 <= lo < hi, got {self.history_tokens}")
        check_chunk_tokens(self.chunk_tokens)


@dataclass(slots=True)
class CallRecord:
    """One replayed call, as measured by the client and reported by the service."""

    policy: str  # policy set name
    call: int  # index of the call in the (capped) trace
    time_s: float  # the call's time in the trace (seconds since its start)
    sent_s: float  # when the replay sent it (seconds since the policy's first call)
    context: int  # trace context id
    switch_ms: float  # context switching latency (docs/design.md §1), ms
    e2e_ms: float  # client-side time of the whole call: switch, prefill, decode, hops; ms
    outcome: str  # hit, resident, swap or recompute (actors.metrics.switch_outcome)
    resident_chunks: int  # chunks decoded from the pool
    loaded_chunks: int  # chunks read from disk
    loaded_bytes: int  # bytes of those chunk files
    recomputed_chunks: int  # chunks recomputed from token ids (planned and faults)
    predicted_restore_ms: float  # the planner's restore time (0 for a hit), ms
    model_restore_ms: float  # the one-shot profile's own prediction, before online correction, ms
    measured_restore_ms: float  # the restore's wall time (0 for a hit), ms
    ttft_ms: float  # time to first token, from the call's arrival at the executor, ms
    prompt_tokens: int  # tokens the call prefilled as its prompt
    completion_tokens: int  # tokens generated


CSV_FIELDS = tuple(f.name for f in fields(CallRecord))


@dataclass(slots=True)
class ReplayResult:
    """Records of every policy and what the replay was run with."""

    config: ReplayConfig
    kv_budget_bytes: int  # the budget used (bytes)
    history_tokens: int  # tokens of all starting histories, as one user turn each
    records: dict[str, list[CallRecord]] = field(default_factory=dict)  # by policy, in call order
    wall_s: dict[str, float] = field(default_factory=dict)  # by policy: set-up, histories, replay (s)


def reply_tokens(record: TraceRecord, prompt_tokens: int, max_tokens: int) -> int:
    """Tokens to ask for: what the trace's delta leaves after the prompt, in [1, max_tokens]."""
    return max(1, min(max_tokens, record.delta_tokens_target - prompt_tokens))


def replay_calls(svc, token: str, ctx_ids: Sequence[str], calls: Sequence[TraceRecord], *, policy: str,
                 max_tokens: int, max_gap_s: float, count_tokens: Callable[[str], int],
                 idle: Callable[[], None], clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep, progress=None,
                 think_ms: float | None = None) -> list[CallRecord]:
    """Send `calls` to `svc` (contexts `ctx_ids` by trace id) in compressed time; `idle()` blocks until
    the service's background work is done and is called before every call. With `think_ms`, each call
    goes that long after the previous reply instead, and `idle()` only after the last. `progress`: a
    tqdm bar."""
    out: list[CallRecord] = []
    start = prev_sent = None
    prev_time = 0.0
    for k, rec in enumerate(calls):
        if think_ms is not None:
            if prev_sent is not None and think_ms > 0:
                sleep(think_ms / 1000)
        else:
            idle()  # never compressed away: the background work of the previous call finishes first
            if prev_sent is not None:
                due = prev_sent + min(max(0.0, rec.time_s - prev_time), max_gap_s)
                if (now := clock()) < due:
                    sleep(due - now)
        sent = clock()
        start = sent if start is None else start
        n = reply_tokens(rec, count_tokens(rec.prompt), max_tokens)
        r = outcome_dict(svc.call(token, ctx_ids[rec.context_id], rec.prompt, max_tokens=n))
        e2e = clock() - sent
        rs = r["restore"]
        hit = bool(r["hit"])
        out.append(CallRecord(
            policy=policy, call=k, time_s=rec.time_s, sent_s=sent - start, context=rec.context_id,
            switch_ms=r["switch_ms"], e2e_ms=e2e * 1000, outcome=switch_outcome(hit, rs),
            resident_chunks=rs["resident"], loaded_chunks=rs["loaded"], loaded_bytes=rs["loaded_bytes"],
            recomputed_chunks=rs["recomputed"], predicted_restore_ms=r["predicted_restore_ms"],
            model_restore_ms=r.get("model_restore_ms", 0.0),
            measured_restore_ms=0.0 if hit else rs["seconds"] * 1000, ttft_ms=r["ttft_s"] * 1000,
            prompt_tokens=r["prompt_tokens"], completion_tokens=r["completion_tokens"]))
        prev_sent, prev_time = sent, rec.time_s
        if progress is not None:
            progress.update(1)
            progress.set_postfix(switch_ms=f"{r['switch_ms']:.1f}", refresh=False)
    idle()
    return out


def replay(trace: Trace, config: ReplayConfig, engine, data_root: str | Path, *, progress: bool = True,
           log: Callable[[str], None] = lambda s: None) -> ReplayResult:
    """Replay `trace` against every policy of `config`, each on a fresh directory under `data_root`.

    `engine` (an `engine.context.ContextEngine`) tokenizes, sizes the budget and, in one process, is
    the model the services share; on Ray the actors load their own.
    """
    calls = trace.records[: config.calls or None]
    n_ctx = len(trace.contexts)
    histories = long_prompts(engine, n_ctx, config.seed, config.history_tokens)
    budget, hist_tokens = quarter_q8_budget(engine, histories)
    budget = config.kv_budget_bytes or budget
    result = ReplayResult(config, budget, hist_tokens)

    def count_tokens(text: str) -> int:
        return len(engine.tok.encode(text))

    chunks = "" if config.chunk_tokens == DEFAULT_CHUNK_TOKENS else f", {config.chunk_tokens}-token chunks"
    log(f"{n_ctx} contexts, {hist_tokens} history tokens, {len(calls)} calls, "
        f"KV budget {budget / 1e6:.2f} MB{chunks}, {'Ray actors' if config.use_ray else 'one process'}")
    for policy in config.policies:
        t0 = time.perf_counter()
        svc = open_replay_service(policy, engine, budget, config, str(Path(data_root) / policy),
                                  prefix=f"replay{os.getpid()}")
        try:
            token = svc.bind("replay")
            ctx_ids = []
            for text in histories:
                ctx_ids.append(svc.new_ctx(token, None))
                svc.call(token, ctx_ids[-1], text, max_tokens=1)
                wait_idle(svc)
            # no full collection of this process's objects (torch, the model, earlier policies'; 80-120 ms)
            # lands inside a replayed call; one did once, a 102 ms `llms` switch in a 30-call run
            freeze_startup_objects()
            bar = _bar(len(calls), policy) if progress else None
            try:
                result.records[policy] = replay_calls(
                    svc, token, ctx_ids, calls, policy=policy, max_tokens=config.max_tokens,
                    max_gap_s=config.max_gap_s, count_tokens=count_tokens, idle=partial(wait_idle, svc),
                    progress=bar, think_ms=config.think_ms)
            finally:
                if bar is not None:
                    bar.close()
        finally:
            close_service(svc)
        result.wall_s[policy] = time.perf_counter() - t0
        s = summarise(result.records[policy])
        log(f"{policy:>8}: mean switch {s['mean_switch_ms']:.1f} ms, median {s['median_switch_ms']:.1f}, "
            f"p95 {s['p95_switch_ms']:.1f}; {s['outcomes']} ({result.wall_s[policy]:.0f} s)")
    return result


def engine_with_chunks(engine, chunk_tokens: int):
    """`engine` when its model already cuts K/V into `chunk_tokens`-token chunks, else a sibling engine
    on a sibling model that shares the weight tensors and the tokenizer (no reload, no copy).

    Why a sibling: `wire_local` takes a passed engine as it is, and the model's own engine config
    sizes every cache's chunks (`Transformer.new_cache`), so a service configured for another chunk
    size would bookkeep chunks the model does not cut."""
    if engine.cfg.chunk_tokens == engine.model.engine_cfg.chunk_tokens == chunk_tokens:
        return engine
    from engine.context import ContextEngine
    from engine.model import Transformer

    m = engine.model
    model = Transformer(m.cfg, m.w, replace(m.engine_cfg, chunk_tokens=chunk_tokens))
    sibling = ContextEngine(model, engine.tok, replace(engine.cfg, chunk_tokens=chunk_tokens))
    sibling.fingerprint = engine.fingerprint
    return sibling


def chunk_profile(engine, read_bytes_per_s: float):
    """The pipeline cost profile of `engine`'s model at its chunk size (measured once, then cached;
    `actors.profiling` keys its cache by machine, model, threads, chunk size and throttle)."""
    from actors.profiling import load_or_measure

    return load_or_measure(engine.model, engine.fingerprint or "unknown-model", read_bytes_per_s=read_bytes_per_s)


def open_replay_service(policy: str, engine, budget: int, config: ReplayConfig, data_dir: str, *,
                        prefix: str):
    """A fresh service for one policy of `config`: `bench.switching.open_service` at the default chunk
    size; at another, the same `ServiceConfig` with `chunk_tokens` set, on `engine_with_chunks` and
    its cost profile (in one process; the Ray actors load and profile their own model)."""
    throttle = config.throttle_mbps * 1e6
    if config.chunk_tokens == DEFAULT_CHUNK_TOKENS and engine.model.engine_cfg.chunk_tokens == DEFAULT_CHUNK_TOKENS:
        return open_service(policy, engine, budget, throttle, config.use_ray, data_dir,
                            max_context_tokens=config.max_context_tokens, prefix=prefix,
                            options={"tuning": dict(config.tuning), "weights": config.weights})
    from actors.service import ServiceConfig, wire_local

    cfg = ServiceConfig(data_dir=data_dir, policy=policy, pool_bytes=budget, read_bytes_per_s=throttle,
                        max_context_tokens=config.max_context_tokens, chunk_tokens=config.chunk_tokens,
                        tuning=dict(config.tuning), weights=config.weights)
    if config.use_ray:
        from actors.ray_service import wire_ray

        return wire_ray(cfg, prefix=f"{prefix}-{policy}")
    sibling = engine_with_chunks(engine, config.chunk_tokens)
    cfg.profile = chunk_profile(sibling, throttle).to_json()
    return wire_local(cfg, engine=sibling)


def _bar(total: int, policy: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=f"{policy:>8}", unit="call", file=sys.stderr, leave=True)


# -- summary and files ------------------------------------------------------------------------------


def summarise(records: Sequence[CallRecord]) -> dict:
    """One policy's figures: switch_ms mean/median/p95, mean e2e, calls by outcome, data moved, and
    the restore prediction error median |ln(measured / predicted)| over restores (None without any),
    also of the one-shot profile's own predictions (``restore_model_error``)."""
    sw = np.array([r.switch_ms for r in records])
    restores = [r for r in records if r.outcome != "hit"]
    pairs = [(r.predicted_restore_ms, r.measured_restore_ms) for r in restores
             if r.predicted_restore_ms > 0 and r.measured_restore_ms > 0]
    model = [(r.model_restore_ms, r.measured_restore_ms) for r in restores
             if r.model_restore_ms > 0 and r.measured_restore_ms > 0]
    return {
        "calls": len(records),
        "mean_switch_ms": float(sw.mean()),
        "median_switch_ms": float(np.median(sw)),
        "p95_switch_ms": float(np.percentile(sw, 95)),
        "mean_restore_switch_ms": statistics.mean(r.switch_ms for r in restores) if restores else None,
        "mean_e2e_ms": statistics.mean(r.e2e_ms for r in records),
        "mean_ttft_ms": statistics.mean(r.ttft_ms for r in records),
        "outcomes": {o: sum(r.outcome == o for r in records) for o in SWITCH_OUTCOMES},
        "loaded_mb": sum(r.loaded_bytes for r in records) / 1e6,
        "recomputed_chunks": sum(r.recomputed_chunks for r in records),
        "restore_pred_error": (statistics.median(abs(math.log(m / p)) for p, m in pairs) if pairs else None),
        "restore_pred_n": len(pairs),
        "restore_model_error": (statistics.median(abs(math.log(m / p)) for p, m in model) if model else None),
    }


def code_version() -> str:
    """The project's git commit (12 hex digits, ``+dirty`` with uncommitted changes to tracked
    files outside ``docs/``, where results are written), or ``unknown`` outside a git checkout:
    results of a resumed set may come from several."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs"],
                               cwd=root, capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def run_meta(command: str) -> dict:
    """What a summary records about the run: the exact command line, the date, the machine and the
    code's commit."""
    return {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "machine": platform.machine(),
                    "processor": platform.processor(), "cpu_count": os.cpu_count(),
                    "python": platform.python_version()},
        "code": code_version(),
    }


def write_results(out_dir: str | Path, result: ReplayResult, trace: Trace, meta: dict) -> Path:
    """Write `calls.csv` (one row per call per policy), `summary.json` and the trace replayed
    (`trace.jsonl`) into `out_dir`; `meta` (command, date, machine, ...) goes into the summary."""
    import json

    from bench.traces import save_trace

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / CALLS_CSV, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for recs in result.records.values():
            for r in recs:  # microseconds are below what the figures can resolve
                w.writerow({k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(r).items()})
    save_trace(trace, out / TRACE_JSONL)
    c = result.config
    summary = {
        "format": SUMMARY_FORMAT,
        "version": SUMMARY_VERSION,
        **meta,
        "mode": "ray" if c.use_ray else "one process",
        "trace": {"pattern": trace.config.pattern, "contexts": len(trace.contexts),
                  "calls": len(next(iter(result.records.values()), [])), "trace_calls": len(trace.records),
                  "rate_per_s": trace.config.rate_per_s, "seed": trace.seed, "file": TRACE_JSONL},
        "kv_budget_bytes": result.kv_budget_bytes,
        "budget_rule": "given" if c.kv_budget_bytes else "a quarter of the contexts' histories at q8",
        "history_tokens": result.history_tokens,
        "history_tokens_range": list(c.history_tokens),
        "throttle_mbps": c.throttle_mbps,
        "max_tokens": c.max_tokens,
        "max_gap_s": c.max_gap_s,
        "think_ms": c.think_ms,
        "max_context_tokens": c.max_context_tokens,
        "chunk_tokens": c.chunk_tokens,
        "policies": {p: {**summarise(recs), "wall_s": result.wall_s.get(p)} for p, recs in result.records.items()},
    }
    (out / SUMMARY_JSON).write_text(json.dumps(summary, indent=1, sort_keys=False) + "\n")
    return out
