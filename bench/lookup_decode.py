"""What lookup decoding buys (`EngineConfig.lookup_draft`, engine/lookup.py): greedy decode time per
reply token, with guesses of up to N tokens a pass and without, on prompts whose replies copy from
them and on prompts whose replies do not.

Two prompt sets from the repository's RAG corpus (bench.rag_data): RAG prompts (a user's question
after its top-3 passages, as the RAG cache builds them: `engine.rag.RagTemplate`) and the same
questions asked bare, as chat turns with nothing to copy from. Per weight format one model is loaded
and shared by one engine per variant (lookup off, then each draft length); every round decodes every
prompt's greedy reply in each variant, the variants in an order rotated from round to round. A
round's figure is the variant's decode time over all its reply tokens (time to first token excluded)
divided by them; medians over the rounds, with the round-to-round spread (median absolute deviation):
a switch is worth keeping where it buys more than twice the spread (the project's rule for speed-only
optimisations). Replies are compared with the variant off, token for token.

    python -m bench.lookup_decode [--formats fp32 int4] [--drafts 4 8] [--questions 8] [--rounds 6]
        [--max-tokens 128] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

NAME = "lookup-decode"
HEADING = "## Tuning at the edge"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lookup_decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", nargs="+", default=["fp32", "int4"], help="weight formats (default fp32 int4)")
    ap.add_argument("--drafts", type=int, nargs="+", default=[4, 8],
                    help="draft lengths to compare with lookup off (default 4 8)")
    ap.add_argument("--user", default="user0", help="user of bench.rag_data whose questions and documents (default user0)")
    ap.add_argument("--questions", type=int, default=8, help="first N questions of its main set (default 8)")
    ap.add_argument("--rounds", type=int, default=6, help="rounds; the variant order rotates (default 6)")
    ap.add_argument("--max-tokens", type=int, default=128, help="reply length, tokens (default 128)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--write", type=Path, help="replace this benchmark's section of a markdown file")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.questions < 1 or args.max_tokens < 1 or min(args.drafts) < 1:
        ap.error("--rounds, --questions, --max-tokens and --drafts must be >= 1")

    import torch

    from bench import rag_data
    from bench.quantized import cpu_line
    from bench.tuning import mad, verdict
    from engine.chat import Conversation
    from engine.config import EngineConfig
    from engine.context import ContextEngine
    from engine.embed import Embedder
    from engine.rag import RagTemplate
    from engine.sampling import SamplingParams
    from storage.knowledge import KnowledgeBank

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    questions = [q["text"] for q in rag_data.questions(args.user, "main")[: args.questions]]
    sp = SamplingParams(max_tokens=args.max_tokens)
    labels = ["off"] + [f"lookup_draft {n}" for n in args.drafts]
    tables = []
    for fmt in args.formats:
        base = ContextEngine.load(None, EngineConfig(weights=fmt), progress=False)
        engines = {"off": base} | {f"lookup_draft {n}": ContextEngine(base.model, base.tok,
                                                                      EngineConfig(weights=fmt, lookup_draft=n))
                                   for n in args.drafts}
        bank = KnowledgeBank(tempfile.mkdtemp(prefix="lookup-decode-") + "/bank.db", tokenize=base.tok.encode,
                             embed=Embedder().embed)
        col = bank.create_collection("bench", "documents")
        for topic, text in rag_data.documents(args.user):
            bank.add_document("bench", col, text, name=topic)
        template = RagTemplate(base.tok)
        prompts = {"RAG": [template.build([list(h.token_ids) for h in bank.search("bench", col, q, 3)], q).ids
                           for q in questions],
                   "chat": [base.tok.system_ids(None) + base.tok.user_turn_ids(Conversation(), q) for q in questions]}
        times = {(v, kind): [] for v in labels for kind in prompts}
        same = {(v, kind): 0 for v in labels for kind in prompts}
        replies = {kind: len(prompts[kind]) for kind in prompts}
        with torch.inference_mode():
            for r in range(-1, args.rounds):  # round -1 warms every variant, untimed
                for kind, ids_list in prompts.items():
                    spent = {v: [0.0, 0] for v in labels}
                    out = {v: [] for v in labels}
                    for label in labels[r % len(labels):] + labels[: r % len(labels)]:
                        eng = engines[label]
                        for ids in ids_list:
                            stream = eng.generate(eng.throwaway(ids, args.max_tokens), sp)
                            t = time.perf_counter()
                            for _ in stream:
                                pass
                            res = stream.result
                            spent[label][0] += time.perf_counter() - t - res.ttft_s
                            spent[label][1] += max(1, len(res.token_ids) - 1)
                            out[label].append(res.token_ids)
                    if r >= 0:
                        for label in labels:
                            times[label, kind].append(spent[label][0] / spent[label][1] * 1e3)
                            same[label, kind] += sum(a == b for a, b in zip(out[label], out["off"]))
                if r >= 0:
                    print(f"{fmt} round {r + 1}: " + ", ".join(f"{v} {k} {times[v, k][-1]:.1f}" for v in labels
                                                            for k in prompts), file=sys.stderr)
        kept = {label: engines[label].lookup for label in labels[1:]}
        tables.append((fmt, times, same, replies, kept))
        del engines, base

    lines = [f"Command: `python -m bench.lookup_decode --formats {' '.join(args.formats)} --drafts "
             f"{' '.join(map(str, args.drafts))} --questions {args.questions} --rounds {args.rounds} --max-tokens "
             f"{args.max_tokens}`. Date: {datetime.date.today()}. Machine: {cpu_line()}; {args.threads} threads. "
             f"One process; {args.questions} questions of {args.user}'s main set, each after its top-3 passages "
             f"(RAG) and bare (chat); every round each variant decodes every prompt's greedy reply of up to "
             f"{args.max_tokens} tokens, the order rotated over {args.rounds} rounds; per round the decode time "
             f"over the reply tokens after the first; the median and the round-to-round spread (median absolute "
             f"deviation). Run took {(time.perf_counter() - t0) / 60:.1f} min.", "",
             "| weights | variant | RAG, ms/token (spread) | vs off | chat, ms/token (spread) | vs off | replies "
             "as off's | guessed tokens kept |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    verdicts = []
    for fmt, times, same, replies, kept in tables:
        med = {k: statistics.median(v) for k, v in times.items()}
        for label in labels:
            cells = []
            for kind in ("RAG", "chat"):
                cells.append(f"{med[label, kind]:.1f} ({mad(times[label, kind]):.1f}) | "
                             f"{med['off', kind] / med[label, kind]:.2f}x")
            n = sum(replies.values()) * args.rounds
            lk = kept.get(label)
            share = f"{lk.kept / lk.guessed:.0%} of {lk.guessed}" if lk is not None and lk.guessed else "-"
            lines.append(f"| {fmt} | {label} | {cells[0]} | {cells[1]} | "
                         f"{sum(same[label, k] for k in replies)} of {n} | {share} |")
            if label == "off":
                continue
            for kind in ("RAG", "chat"):
                v = verdict(times[label, kind], times["off", kind])
                verdicts.append(f"- {fmt}, {label}, {kind}: buys {v['gain']:.1f} ms/token (spread {v['spread']:.1f}): "
                                f"{'keep' if v['keep'] else 'less than twice the spread'}.")
    lines += [""] + verdicts
    from bench.markdown import publish

    return publish("\n".join(lines), args.write, NAME, HEADING)


if __name__ == "__main__":
    sys.exit(main())
