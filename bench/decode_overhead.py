"""Decode tokens/s with and without context management (LLMS §5.5, Fig. 15a; issue 6 target: within 5%).

(A) the bare engine: a new `ContextEngine` context, one call with a ~1.5K-token real-text prompt (a
reference-manual passage to translate, `bench.passages`) decoding up to 128 greedy tokens, then a
second call with a short prompt on the same context. (B) the same two calls through the service in
this process (the in-process wiring (`wire_local`), policy `llms`, opened as `bench.switching` does) with a KV budget of a
quarter of the context at q8, so that the first call's write-back swaps most of the context out;
between the two calls a call on another context takes the working set, so the second call first
restores the context (resident chunks decoded, the rest read or recomputed) and then decodes on the
mixed-precision K/V. The service's background write-back is waited for after every call (the idle
gap of a real trace), so it never overlaps the other variant.

Decode tokens/s, the same definition for A and B: the model's decode forward passes (counted by
`Transformer.forward_rows`) between the first and the last text delta the stream yields, divided by
the wall time between those two deltas: what a streaming client sees once the first token is out,
excluding prefill, the restore and the bookkeeping after the last token. The call's outcome gives a
cross-check: (completion_tokens - 1) / (total_s - ttft_s), less `switch_ms` for B, whose `total_s`
starts at the call's arrival; that one also counts the commit after the last token (the token ids
made durable, the compression plan).

A and B alternate (A first in even repetitions, B first in odd ones) after one untimed warm-up of
each, so load from other processes affects both alike; medians over ``--reps``.

    python -m bench.decode_overhead [--reps 5] [--prompt-tokens 1536] [--max-tokens 128] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.accuracy import machine_line
from bench.markdown import publish

NAME = "decode-overhead"
HEADING = "## Decode speed with context management"
TARGET = 0.95  # issue 6: decode tokens/s with context management within 5% of without
TURNS = ("first call (long prompt)", "second call (after a switch away and back)")


@dataclass(slots=True)
class Timed:
    """One call's decode timing."""

    decode_tok_s: float
    """Decode forwards between the first and last streamed delta per second of that span."""
    decode_steps: int
    """Those forwards."""
    outcome_tok_s: float
    """(completion_tokens - 1) / (total_s - ttft_s [- switch_s]) from the call's result."""
    completion_tokens: int
    ttft_s: float
    after_last_s: float
    """From the last delta until the call returned (commit and bookkeeping)."""
    token_ids: list[int]
    switch_ms: float = 0.0
    """B only: the call's switch_ms."""


def timed_stream(stream, model) -> Timed:
    """Drain a stream of text deltas (an engine `CallStream` or the service's generator), stamping
    each delta with the time and the model's forward-row counter."""
    it = iter(stream)
    marks = []
    while True:
        try:
            next(it)
        except StopIteration as stop:
            res = stop.value
            break
        marks.append((time.perf_counter(), model.forward_rows))
    end = time.perf_counter()
    if len(marks) < 2 or marks[-1][1] == marks[0][1]:
        raise RuntimeError(f"reply too short to time its decode ({res.completion_tokens} tokens)")
    (t1, r1), (t2, r2) = marks[0], marks[-1]
    switch_ms = getattr(res, "switch_ms", 0.0)  # the service's total_s starts at the call's arrival
    out_span = res.total_s - res.ttft_s - switch_ms / 1000
    return Timed((r2 - r1) / (t2 - t1), r2 - r1, (res.completion_tokens - 1) / out_span,
                 res.completion_tokens, res.ttft_s, end - t2, list(res.token_ids), switch_ms)


def prompts(engine, prompt_tokens: int, follow_tokens: int) -> tuple[str, str]:
    """A translate prompt of about `prompt_tokens` tokens as a first user turn, and a follow-up of
    about `follow_tokens` (the passages that come next in the manual): both ask for long replies."""
    from bench.passages import PassageStream, build_prompt, load_passages
    from engine.chat import Conversation

    fams = load_passages()
    passages = [p for fam in fams.values() for p in fam]  # every family in turn: long enough for 1.5K
    count = lambda s: len(engine.tok.user_turn_ids(Conversation(), s))  # noqa: E731  the whole user turn
    stream = PassageStream(passages, 0, lambda s: len(engine.tok.encode(s)))  # the passage text alone
    return (build_prompt("translate", stream, prompt_tokens, count),
            build_prompt("translate", stream, follow_tokens, count))


def run_a(engine, p1: str, p2: str, max_tokens: int) -> list[Timed]:
    ctx = engine.new_ctx()
    try:
        return [timed_stream(engine.stream(ctx, p, max_tokens=max_tokens), engine.model) for p in (p1, p2)]
    finally:
        engine.delete_ctx(ctx)


def run_b(svc, tok: str, other: str, engine, p1: str, p2: str, max_tokens: int) -> list[Timed]:
    from bench.switching import wait_idle

    ctx = svc.new_ctx(tok)
    try:
        first = timed_stream(svc.stream(tok, ctx, p1, max_tokens=max_tokens), engine.model)
        wait_idle(svc)
        svc.call(tok, other, "Say hello.", max_tokens=1)  # takes the working set: the next call restores
        wait_idle(svc)
        second = timed_stream(svc.stream(tok, ctx, p2, max_tokens=max_tokens), engine.model)
        wait_idle(svc)
        return [first, second]
    finally:
        svc.delete_ctx(tok, ctx)


def med(xs) -> float:
    return statistics.median(xs)


def markdown(res: dict[str, list[list[Timed]]], args, extra: dict, seconds: float) -> str:
    cmd = (f"python -m bench.decode_overhead --reps {args.reps} --prompt-tokens {args.prompt_tokens} "
           f"--follow-tokens {args.follow_tokens} --max-tokens {args.max_tokens} --max-context {args.max_context}")
    lines = [
        f"Command: `{cmd}`. {machine_line()}. Default model (SmolLM2-135M-Instruct), float32, greedy; "
        f"{seconds:.0f} s.",
        "",
        f"Measured: (A) the bare engine, a new context, a call with a {extra['p1_tokens']}-token real-text prompt "
        f"(a reference-manual passage to translate) decoding up to {args.max_tokens} tokens, then a second call "
        f"({extra['p2_tokens']}-token prompt) on the same context; (B) the same two calls through the in-process wiring (`wire_local`) in "
        f"this process, policy `llms`, KV budget {extra['pool'] / 1e6:.1f} MB (a quarter of the context at q8), "
        f"with a call on another context between them, so the second call restores the context first "
        f"({extra['restore']}). Decode tokens/s: the decode forward passes between the first and the last "
        f"streamed text delta over the wall time between them (prefill, restore and the commit after the "
        f"last token excluded), the same for A and B. Cross-check from the call's result: (completion_tokens "
        f"- 1) / (total_s - ttft_s), less switch_ms for B, which also counts B's commit after the last token. "
        f"A and B alternate over {args.reps} repetitions after a warm-up; medians, and for B / A the median "
        f"of the per-repetition ratios (A and B of one repetition run back to back).",
        "",
        "| call | A engine tok/s | B service tok/s | B / A (paired) | cross-check A | cross-check B | "
        "B / A (paired) | decode steps A, B | after last token ms A, B |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    ratios = []
    for t, turn in enumerate(TURNS):
        a = [r[t] for r in res["A"]]
        b = [r[t] for r in res["B"]]
        # paired: B over A of the same repetition (adjacent in time), then the median
        ratio = med(y.decode_tok_s / x.decode_tok_s for x, y in zip(a, b))
        ratios.append(ratio)
        lines.append(f"| {turn} | {med(x.decode_tok_s for x in a):.2f} | {med(x.decode_tok_s for x in b):.2f} | "
                     f"{ratio:.3f} | {med(x.outcome_tok_s for x in a):.2f} | {med(x.outcome_tok_s for x in b):.2f} | "
                     f"{med(y.outcome_tok_s / x.outcome_tok_s for x, y in zip(a, b)):.3f} | "
                     f"{med(x.decode_steps for x in a):.0f}, {med(x.decode_steps for x in b):.0f} | "
                     f"{med(x.after_last_s for x in a) * 1000:.1f}, {med(x.after_last_s for x in b) * 1000:.1f} |")
    same = sum(ra[0].token_ids == rb[0].token_ids for ra, rb in zip(res["A"], res["B"]))
    lines += [
        "",
        f"First-call replies of A and B identical (greedy, exact K/V on both sides): {same} of {args.reps}. "
        f"Second call of B: switch_ms median {med(r[1].switch_ms for r in res['B']):.1f}.",
        "",
        f"Target (issue 6, LLMS §5.5): decode tokens/s with context management within 5% of without "
        f"(B / A >= {TARGET}): " + ", ".join(f"{turn.split(' (')[0]} {x:.3f}" for turn, x in zip(TURNS, ratios))
        + f": **{'held' if min(ratios) >= TARGET else 'missed'}**.",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.decode_overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions of A and of B (default 5)")
    ap.add_argument("--prompt-tokens", type=int, default=1536, help="first prompt's length in tokens (default 1536)")
    ap.add_argument("--follow-tokens", type=int, default=64, help="second prompt's length in tokens (default 64)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens to decode per call (default 128)")
    ap.add_argument("--max-context", type=int, default=4096, help="the engine's and service's context limit")
    ap.add_argument("--write", type=Path, help=f"replace the {NAME} section of this markdown file")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.max_tokens < 3:
        ap.error("need --reps >= 1 and --max-tokens >= 3")

    from bench.switching import close_service, open_service, quarter_q8_budget, wait_idle
    from engine.config import EngineConfig
    from engine.context import ContextEngine

    t0 = time.perf_counter()
    engine = ContextEngine.load(None, EngineConfig(max_context_tokens=args.max_context), progress=False)
    p1, p2 = prompts(engine, args.prompt_tokens, args.follow_tokens)
    pool, p1_tokens = quarter_q8_budget(engine, [p1])
    extra = {"pool": pool, "p1_tokens": p1_tokens, "p2_tokens": len(engine.tok.encode(p2))}
    res: dict[str, list[list[Timed]]] = {"A": [], "B": []}
    with tempfile.TemporaryDirectory(prefix="decode-bench-", dir=os.environ.get("LLMAAS_BENCH_DIR")) as tmp:
        svc = open_service("llms", engine, pool, 0.0, False, str(Path(tmp) / "llms"),
                           max_context_tokens=args.max_context)
        try:
            tok = svc.bind("bench")
            other = svc.new_ctx(tok)
            svc.call(tok, other, "Say hello.", max_tokens=1)
            wait_idle(svc)
            run = {"A": lambda: run_a(engine, p1, p2, args.max_tokens),
                   "B": lambda: run_b(svc, tok, other, engine, p1, p2, args.max_tokens)}
            for name in ("A", "B"):  # warm-up, untimed
                run[name]()
            base = dict(svc.governor.stats)
            for rep in range(args.reps):
                for name in (("A", "B") if rep % 2 == 0 else ("B", "A")):
                    res[name].append(run[name]())
                a, b = res["A"][-1], res["B"][-1]
                print(f"rep {rep + 1}/{args.reps}: decode tok/s A {a[0].decode_tok_s:.1f}/{a[1].decode_tok_s:.1f}, "
                      f"B {b[0].decode_tok_s:.1f}/{b[1].decode_tok_s:.1f} (first/second call; {a[0].decode_steps}/"
                      f"{b[0].decode_steps} steps; B switch {b[1].switch_ms:.0f} ms) "
                      f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
            st = {k: v - base[k] for k, v in svc.governor.stats.items()}
            extra["restore"] = (f"over the timed repetitions the service swapped out "
                                f"{st['swap_out_bytes'] / 1e6:.1f} MB, read back {st['swap_in_bytes'] / 1e6:.1f} MB "
                                f"and recomputed {st['recomputed_chunks']} chunks")
        finally:
            close_service(svc)
    text = markdown(res, args, extra, time.perf_counter() - t0)
    return publish(text, args.write, NAME, HEADING)


if __name__ == "__main__":
    sys.exit(main())
