"""Which reused tokens a blended RAG prompt should recompute, and what blending buys (CacheBlend's idea;
`RagConfig.blend_ratio`).

For each question of a user's set (bench.rag_data), the collection's top-3 passages are retrieved and
each passage's K/V is computed after another of them (a node of another retrieval path), then moved to
the question's prompt (`engine.rag.shift_span`) and a share of its tokens recomputed, chosen by each
strategy below. Against the prompt prefilled whole, each strategy is scored by the reply: the greedy
reply of 32 tokens fed back (teacher forcing), the share of positions whose most likely token is the
exact one's and the mean KL divergence from the exact next-token distribution, and whether the
greedy reply itself is the same. The strategies:

- first tokens: each passage's first tokens, where it meets the text before it (`engine.rag.blend_rows`)
- layer-1 deviation: CacheBlend's choice, the tokens whose layer-1 K/V moves most when recomputed
- density, this query: the attention the rest of the prompt pays each token (one extra prefill of it)
- density, donor: the information density the donor's own prompt gave each token
- random; none (moved, nothing recomputed)

The prefill with the implemented strategy (placing the passages, recomputing, prefilling the tail) is
timed against prefilling the passages and the tail, alternated per question.

    python -m bench.rag_blend [--user user0] [--questions 24] [--ratios 0.15 0.3] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

NAME = "rag-blend"
HEADING = "## RAG cache (PerCache)"
REPLY = 32
STRATEGIES = ("first tokens", "layer-1 deviation", "density, this query", "density, donor", "random", "none")


def _top(rows, score, n):
    import numpy as np

    return np.sort(rows[np.argsort(-score, kind="stable")[:n]])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--user", default="user0", help="user of bench.rag_data (default user0)")
    ap.add_argument("--questions", type=int, default=24, help="first N questions of its main set (default 24)")
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.15, 0.3], help="shares recomputed (default 0.15 0.3)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--write", type=Path, help="replace this benchmark's section of a markdown file")
    args = ap.parse_args(argv)
    if args.questions < 1 or not all(0 < r <= 1 for r in args.ratios):
        ap.error("--questions must be positive and --ratios within (0, 1]")

    import numpy as np
    import torch

    from bench import rag_data
    from bench.quantized import cpu_line
    from engine.context import ContextEngine
    from engine.embed import Embedder
    from engine.model import RecomputeJob
    from engine.rag import RagTemplate, blend_rows, put_span, shift_span, span_kv
    from storage.knowledge import KnowledgeBank

    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    eng = ContextEngine.load(progress=False)
    m, template = eng.model, RagTemplate(eng.tok)
    bank = KnowledgeBank(tempfile.mkdtemp(prefix="rag-blend-") + "/bank.db", tokenize=eng.tok.encode,
                         embed=Embedder().embed)
    col = bank.create_collection("bench", "documents")
    for topic, text in rag_data.documents(args.user):
        bank.add_document("bench", col, text, name=topic)

    def cache_for(pr):
        return m.new_cache(len(pr.ids) + REPLY + 16)

    def score(cache, pr, ref, ref_logits):
        logits = m.forward(cache, pr.ids[pr.question:] + ref[:-1], all_logits=True)[-REPLY:]
        agree = (logits.argmax(-1) == torch.tensor(ref)).float().mean().item()
        p, q = torch.log_softmax(ref_logits, -1), torch.log_softmax(logits, -1)
        return agree, (p.exp() * (p - q)).sum(-1).mean().item()

    def greedy(cache, tail):
        out, logits = [], m.forward(cache, tail)
        for _ in range(REPLY):
            out.append(int(logits.argmax()))
            logits = m.forward(cache, [out[-1]])
        return out

    results = {(s, r): [] for r in args.ratios for s in STRATEGIES}
    timing = {"whole": [], "blended": []}
    questions = rag_data.questions(args.user, "main")[: args.questions]
    for i, question in enumerate(questions):
        passages = [list(h.token_ids) for h in bank.search("bench", col, question["text"], 3)]
        pr = template.build(passages, question["text"])
        exact = cache_for(pr)
        m.forward(exact, pr.ids[: pr.question])
        head = span_kv(exact, 0, pr.head)
        ref = greedy(exact, pr.ids[pr.question:])
        exact.truncate(pr.question)
        ref_logits = m.forward(exact, pr.ids[pr.question:] + ref[:-1], all_logits=True)[-REPLY:]
        donors = []  # passage j after passage j+1: (K/V, its first slot there, its density there)
        for j in range(len(passages)):
            other = template.build([passages[(j + 1) % len(passages)], passages[j]], "x")
            cache, density = cache_for(other), torch.zeros(len(other.ids))
            m.forward(cache, other.ids, density=density)
            a, b = other.spans[1]
            seen_by = len(other.ids) - torch.arange(a, b).float()  # rows that attend to each token
            donors.append((span_kv(cache, a, b), a, (density[a:b] / seen_by).numpy()))

        def move_passages(cache):  # after the head: each donor's K/V at this prompt's slots
            for (kv, src, _d), (a, _b) in zip(donors, pr.spans):
                put_span(cache, a, shift_span(m, kv, a - src))

        def placed():
            cache = cache_for(pr)
            put_span(cache, 0, head)
            move_passages(cache)
            return cache

        rows = np.arange(pr.head, pr.question)
        probe, density = placed(), torch.zeros(len(pr.ids))
        m.forward(probe, pr.ids[pr.question:], density=density)
        deviation = placed()  # layer 0 is exact after the move; layer 1 shows where the prefix mattered
        before = deviation.kv[1, :, :, rows].clone()
        job = RecomputeJob(chunks=[], x=m.w.embed(torch.as_tensor(np.asarray(pr.ids)[rows])), pos=torch.as_tensor(rows))
        for layer in (0, 1):
            m.recompute_layer(deviation, job, layer)
        moved = ((deviation.kv[1, :, :, rows] - before) ** 2).sum(dim=(0, 1, 3)).numpy()
        for r in args.ratios:
            n = int(np.ceil(r * len(rows)))
            first = placed()
            picks = {"first tokens": blend_rows(m, first, pr.ids, pr.spans, r),
                     "layer-1 deviation": _top(rows, moved, n),
                     "density, this query": _top(rows, density.numpy()[rows], n),
                     "density, donor": _top(rows, np.concatenate([d for _kv, _s, d in donors]), n),
                     "random": np.sort(np.random.default_rng(i).choice(rows, n, replace=False)), "none": []}
            for s, pick in picks.items():
                cache = first if s == "first tokens" else placed()
                if s != "first tokens" and len(pick):
                    m.recompute_rows(cache, pr.ids, list(pick))
                agree, kl = score(cache, pr, ref, ref_logits)
                cache.truncate(pr.question)
                results[s, r].append((agree, kl, greedy(cache, pr.ids[pr.question:]) == ref))
        for order in (("whole", "blended"), ("blended", "whole"))[i % 2]:
            cache = cache_for(pr)
            put_span(cache, 0, head)
            t = time.perf_counter()
            if order == "blended":
                move_passages(cache)
                blend_rows(m, cache, pr.ids, pr.spans, args.ratios[0])
                m.forward(cache, pr.ids[pr.question:])
            else:
                m.forward(cache, pr.ids[pr.head:])
            timing[order].append(time.perf_counter() - t)
        print(f"[{i + 1}/{len(questions)}] {question['id']}: " + ", ".join(
            f"{s} {results[s, args.ratios[0]][-1][1]:.3f}" for s in STRATEGIES), file=sys.stderr, flush=True)

    runtime = time.perf_counter() - t_start
    cmd = "python -m bench.rag_blend " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"Command: `{cmd}`. Date: {datetime.date.today().isoformat()}. Machine: {cpu_line()}. "
             f"Run took {runtime / 60:.1f} min.", "",
             f"{len(questions)} questions of {args.user}'s main set, top-3 passages, each passage's K/V computed "
             f"after another of them, moved, then partly recomputed; scored against the prompt prefilled whole by its "
             f"{REPLY}-token greedy reply: agreement of the most likely token (teacher-forced), mean KL divergence "
             f"(nats) of the next-token distribution, and greedy replies that are the same.", "",
             "| recomputed | strategy | agreement | KL, mean | KL, median | same reply |",
             "|---:|---|---:|---:|---:|---:|"]
    for r in args.ratios:
        for s in STRATEGIES:
            v = results[s, r]
            lines.append(f"| {r:.0%} | {s} | {statistics.mean(a for a, _k, _s in v):.3f} | "
                         f"{statistics.mean(k for _a, k, _s in v):.4f} | "
                         f"{statistics.median(k for _a, k, _s in v):.4f} | "
                         f"{sum(same for *_x, same in v)}/{len(v)} |")
    whole, blended = statistics.median(timing["whole"]), statistics.median(timing["blended"])
    lines += ["", f"Prefill after the head (passages and question): {whole * 1e3:.0f} ms whole against "
              f"{blended * 1e3:.0f} "
              f"ms moved with the first {args.ratios[0]:.0%} of each passage recomputed (medians, alternated per "
              f"question): {whole / blended:.2f}x."]
    from bench.markdown import publish

    return publish("\n".join(lines), args.write, NAME, HEADING)


if __name__ == "__main__":
    sys.exit(main())
