"""What the query predictor's idle work costs a real call (PerCache §4.1.2; the predictor yields at the
next layer or token, `actors.priority.PriorityLock`).

In one process (`actors.service.wire_local`), pairs of contexts get the same two calls: the first call
prefills a passage, the second ("And then?") is measured. In the baseline the executor is left alone
between the two; in the other run a low-priority RAG call over a long prompt (`RagCall.background`, as
the predictor makes them) is started in a loop before the second call, so that call arrives while
the background work holds the executor: it waits for the work to stop at its next slice, then
restores its context (the background work used the working set). The added time to first token is
the difference, pair by pair (the runs alternate); the replies must be the same token for token.

    python -m bench.predictor_yield [--pairs 20] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

NAME = "predictor-yield"
HEADING = "## Query predictor: what it costs a real call"


def background_loop(svc, ids: list[int], stop: threading.Event, started: threading.Event, counts: dict) -> None:
    """Low-priority RAG calls over `ids`, again and again until `stop`: the predictor's kind of work."""
    from actors.messages import PreemptedError, RagCall

    call = RagCall("bench", "", ids, [], [], {"max_tokens": 64}, background=True)
    while not stop.is_set():
        started.set()
        try:
            svc.executor.rag_call(call)
            counts["finished"] += 1
        except PreemptedError:
            counts["preempted"] += 1
            time.sleep(0.005)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.predictor_yield", description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=20, help="measured calls per run (default 20)")
    p.add_argument("--lead-s", type=float, default=0.3,
                   help="seconds the background work runs before the measured call (default 0.3)")
    p.add_argument("--write", type=Path, default=None, help="write the section into this markdown file")
    args = p.parse_args(argv)

    from actors.config import RagConfig, ServiceConfig
    from actors.service import wire_local
    from bench.markdown import publish
    from bench.passages import load_passages
    from bench.quantized import cpu_line

    texts = [x.text for family in load_passages().values() for x in family if len(x.text) > 300]

    def passage(i: int) -> str:
        return texts[i % len(texts)]

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="predictor-yield-") as d:
        svc = wire_local(ServiceConfig(data_dir=d, max_context_tokens=4096, rag=RagConfig(predict=False)))
        tok = svc.bind("bench")
        long_ids = svc.parts.engine.tok.encode(" ".join(passage(i) for i in range(40)))[:1500]
        added, base, with_bg, same, counts = [], [], [], 0, {"finished": 0, "preempted": 0}
        for k in range(args.pairs):
            outs = {}
            for run in (("alone", "busy") if k % 2 == 0 else ("busy", "alone")):  # alternate the order
                ctx = svc.new_ctx(tok, "You are terse.")
                svc.call(tok, ctx, "Summarise: " + passage(k % 8), max_tokens=8)
                stop, started = threading.Event(), threading.Event()
                th = None
                if run == "busy":
                    th = threading.Thread(target=background_loop, args=(svc, long_ids, stop, started, counts))
                    th.start()
                    started.wait()
                    time.sleep(args.lead_s)
                out = svc.call(tok, ctx, "And then?", max_tokens=8)
                stop.set()
                if th is not None:
                    th.join()
                outs[run] = out
                svc.delete_ctx(tok, ctx)
            base.append(outs["alone"].ttft_s)
            with_bg.append(outs["busy"].ttft_s)
            added.append(outs["busy"].ttft_s - outs["alone"].ttft_s)
            same += outs["busy"].token_ids == outs["alone"].token_ids
            print(f"pair {k + 1}/{args.pairs}: ttft alone {outs['alone'].ttft_s * 1000:.0f} ms, with background "
                  f"{outs['busy'].ttft_s * 1000:.0f} ms (switch {outs['busy'].switch_ms:.0f} ms)", file=sys.stderr)
        svc.close()
    a = np.array(added) * 1000
    cmd = "python -m bench.predictor_yield " + shlex.join(argv if argv is not None else sys.argv[1:])
    text = "\n".join([
        f"Command: `{cmd.strip()}`. Date: {datetime.date.today()}. Machine: {cpu_line()}. "
        f"Run took {(time.perf_counter() - t_start) / 60:.1f} min.",
        "",
        f"{args.pairs} pairs of contexts, the second call of each measured with the executor idle and with a "
        f"low-priority RAG call over {len(long_ids)} tokens running for {args.lead_s:.1f} s before it "
        f"(background calls finished {counts['finished']}, preempted {counts['preempted']}).",
        "",
        "| | median ms | p90 ms | max ms |",
        "|---|---:|---:|---:|",
        f"| time to first token, executor idle | {np.median(base) * 1000:.0f} | "
        f"{np.percentile(base, 90) * 1000:.0f} | {max(base) * 1000:.0f} |",
        f"| time to first token, background work running | {np.median(with_bg) * 1000:.0f} | "
        f"{np.percentile(with_bg, 90) * 1000:.0f} | {max(with_bg) * 1000:.0f} |",
        f"| added, pair by pair | {np.median(a):.0f} | {np.percentile(a, 90):.0f} | {a.max():.0f} |",
        "",
        f"Replies the same token for token: {same}/{args.pairs}. Floor: the added latency under 150 ms at p99 "
        f"({'PASS' if np.percentile(a, 99) < 150 else 'FAIL'}: p99 {np.percentile(a, 99):.0f} ms over "
        f"{args.pairs} pairs).",
    ])
    return publish(text, args.write, NAME, HEADING)


if __name__ == "__main__":
    raise SystemExit(main())
