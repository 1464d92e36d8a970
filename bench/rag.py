"""The RAG cache against its baselines (PerCache §5.2-5.7): end-to-end latency, QA and K/V hit rates,
idle model time, cache bytes and answer quality, per system, on the frozen users of `bench.rag_data`.

Systems are configurations of the same code (`RagConfig` switches; the same k, max_tokens, tau_query,
stride and idle budget for all):

- `Naive`: neither cache level, no prediction;
- `RAGCache-like`: the K/V tree alone; `MeanCache-like`: the QA bank alone;
- `Sleep-time-compute-like`: the QA bank filled by the query predictor in idle time;
- `RAGCache+MeanCache`: both levels, no prediction;
- `RAGCache+SC`: both levels, the K/V tree filled by real queries alone and the QA bank by the predictor
  too (PerCache: "We use RAGCache to update the KV cache tensor tree and Sleep-time Compute to update
  the QA bank"; `RagConfig.predict_tree` off);
- `PerCache`: both levels and prediction.

PerCache §5.6's ablation, run by default and never a baseline: `PerCache-no-QA-bank` (the K/V tree and
prediction); its other two variants are baselines already (no K/V tree: `Sleep-time-compute-like`; no
prediction: `RAGCache+MeanCache`).

Run only when named (this project's variants, never a baseline): `PerCache-answers-at-once` (a question
predicted from a passage decoded at once, PerCache's own rule, `RagConfig.answers_after_coverage` off),
`PerCache-paths-only` (no passage's path prefilled, `RagConfig.passage_depth` 0), `PerCache-roots-only` (each
passage prefilled alone, `passage_depth` 1), `RAGCache+blend` and
`PerCache+blend` (passages cached after another prefix blended, `--blend-ratio`).

Each (question set, user, system) runs in a fresh data directory: the user's documents go into one
collection through the query predictor, then the user's questions are asked in their order, one every
`--gap` seconds of a virtual clock (the benchmark never sleeps), the systems alternating question by
question so that the host's drift over a run does not favour one (`bench.rag_session.run_group`).
Where the system predicts, the predictor's `tick` runs between questions once the device counts as
idle, round after round while any is due, the gap lasts and the day's budget allows (`--rounds-per-gap`
caps the rounds); its model-seconds are counted apart from the queries' latency, which is the wall time of
`QueryPredictor.query`.

Quality: ROUGE-L F1 of each answer against the Naive system's answer to the same question, and the
paraphrase baseline, the mean ROUGE-L between Naive's own answers within a paraphrase group. Floors
(printed PASS/FAIL, not asserted): PerCache's mean latency at least 15% below the best other system's
(goal 30%); prediction raises the K/V hit rate by at least 10 points (PerCache against
RAGCache+MeanCache); the QA-served answers' mean ROUGE-L at least 0.9 x the paraphrase baseline;
exact reuse never changes an answer (RAGCache-like's reply ids equal Naive's).

    python -m bench.rag [--users user0 ...] [--which main|heldout|both] [--systems ...] [--limit N]
                        [--sensitivity [SWEEP ...]] [--plot] [--out docs/results/rag] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import re
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

NAME = "rag"
HEADING = "## RAG cache (PerCache)"
APP = "bench"
SYSTEMS = {  # name -> RagConfig switches (qa_bank, kv_tree) and whether the predictor ticks
    "Naive": dict(qa_bank=False, kv_tree=False, predict=False),
    "RAGCache-like": dict(qa_bank=False, kv_tree=True, predict=False),
    "MeanCache-like": dict(qa_bank=True, kv_tree=False, predict=False),
    "Sleep-time-compute-like": dict(qa_bank=True, kv_tree=False, predict=True),
    "RAGCache+MeanCache": dict(qa_bank=True, kv_tree=True, predict=False),
    "RAGCache+SC": dict(qa_bank=True, kv_tree=True, predict=True, predict_tree=False),
    "PerCache": dict(qa_bank=True, kv_tree=True, predict=True),
    # PerCache's ablation (`ablation`: run by default, never a baseline)
    "PerCache-no-QA-bank": dict(qa_bank=False, kv_tree=True, predict=True, ablation=True),
    # this project's variants (`extra`: run when named, never a baseline): PerCache's own population rule
    "PerCache-answers-at-once": dict(qa_bank=True, kv_tree=True, predict=True, answers_after_coverage=False,
                                     extra=True),
    "PerCache-paths-only": dict(qa_bank=True, kv_tree=True, predict=True, passage_depth=0, extra=True),
    "PerCache-roots-only": dict(qa_bank=True, kv_tree=True, predict=True, passage_depth=1, extra=True),
    # beyond PerCache (CacheBlend): passages cached after another prefix, moved and partly recomputed
    "RAGCache+blend": dict(qa_bank=False, kv_tree=True, predict=False, blend=True, extra=True),
    "PerCache+blend": dict(qa_bank=True, kv_tree=True, predict=True, blend=True, extra=True),
}
DEFAULT_SYSTEMS = [s for s, knobs in SYSTEMS.items() if not knobs.get("extra")]
"""PerCache §5.2's systems and §5.6's ablation (the variants run when asked: `--systems`)."""
NAIVE, OURS, NO_PREDICTION, EXACT = "Naive", "PerCache", "RAGCache+MeanCache", "RAGCache-like"
BASELINES = [s for s in DEFAULT_SYSTEMS if s != OURS and not SYSTEMS[s].get("ablation")]
"""The systems PerCache's latency floor compares against (§5.2's baselines)."""
LATENCY_FLOOR, LATENCY_GOAL = 0.15, 0.30
"""PerCache's mean latency below the best other system's, as a fraction of the latter."""
KV_FLOOR = 0.10
"""K/V hit rate points that prediction adds (PerCache against RAGCache+MeanCache)."""
ROUGE_FLOOR = 0.9
"""QA-served answers' mean ROUGE-L against the paraphrase baseline."""
T0 = 20000 * 86400.0
"""Virtual start, a UTC midnight: a run's idle budget is one day's."""
STRIDES = (1, 2, 3, 4, 5)
TAUS = (0.6, 0.7, 0.8, 0.85, 0.9, 0.95)
ROUNDS = (0, 1, 4)
SWEEPS = ("stride", "tau_query", "tree_cap", "rounds_per_gap")
"""PerCache's sensitivity sweeps (Fig. 17-19) and this benchmark's idle rounds between questions, as
`--sensitivity` names them."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- ROUGE-L ----------------------------------------------------------------------------------------


def words(text: str) -> list[str]:
    """Lower-cased alphanumeric tokens (rouge-score's default tokenizer, without stemming)."""
    return re.findall(r"[a-z0-9]+", text.lower())


def lcs(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence of `a` and `b`."""
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l_f1(reference: str, candidate: str) -> float:
    """ROUGE-L F1 over `words`; 0.0 when either side has no word (as rouge-score scores it)."""
    ref, cand = words(reference), words(candidate)
    n = lcs(ref, cand)
    if not n:
        return 0.0
    p, r = n / len(cand), n / len(ref)
    return 2 * p * r / (p + r)


def rouge_scorer():
    """(score(reference, candidate) -> F1, its name): rouge-score's ROUGE-L when installed (the bench
    extra), else `rouge_l_f1`."""
    try:
        from rouge_score import rouge_scorer as rs
    except ImportError:
        return rouge_l_f1, "ROUGE-L F1 by this script's LCS over lower-cased words (rouge-score not installed)"
    scorer = rs.RougeScorer(["rougeL"], use_stemmer=False)
    return (lambda ref, cand: scorer.score(ref, cand)["rougeL"].fmeasure), "rouge-score's ROUGE-L F1, no stemmer"


# ---- a run's results --------------------------------------------------------------------------------------


@dataclass(slots=True)
class Query:
    """One user question as a system answered it."""

    question: str  # its id in bench.rag_data
    group: str  # its paraphrase group ("" for a distinct question)
    level: str  # RagAnswer.level: qa_bank, kv_tree or miss
    e2e_s: float  # wall seconds of QueryPredictor.query
    reused_tokens: int  # passage tokens whose K/V came from the tree
    retrieved_tokens: int  # passage tokens in the prompt (0 for a QA bank answer)
    prompt_tokens: int  # ids of the prompt (0 for a QA bank answer)
    answer: str
    stages: dict = field(default_factory=dict)  # RagAnswer.latency: seconds by stage (embed, retrieve, ...)
    token_ids: list[int] = field(default_factory=list)  # the reply's ids (empty from the QA bank)
    blended_tokens: int = 0  # passage tokens whose K/V came from other paths' nodes (RagAnswer's)
    recomputed_tokens: int = 0  # of those, recomputed


@dataclass(slots=True)
class Run:
    """One system over one user's question set, in a fresh data directory."""

    which: str  # question set: main or heldout
    user: str
    system: str  # a key of SYSTEMS
    setting: str  # "" for the default knobs, else the sensitivity setting (e.g. "stride=3")
    queries: list[Query]
    idle_model_s: float = 0.0  # sum of the predictor's rounds' model_s
    idle_tick_s: float = 0.0  # wall seconds of every tick (rounds that produced no question included)
    rounds: int = 0  # prediction rounds reported by tick
    predicted: int = 0  # questions those rounds predicted
    cache_bytes: dict = field(default_factory=dict)  # RagStore.total_bytes() at the end
    wall_s: float = 0.0  # this run's own time, ingestion included (not the other systems' turns)


def rag_config(args, system: str, **overrides):
    from actors.config import RagConfig

    switches = {k: v for k, v in SYSTEMS[system].items() if k not in ("blend", "extra", "ablation")}
    knobs = dict(k=args.k, max_tokens=args.max_tokens, tau_query=args.tau_query, stride=args.stride,
                 idle_after_s=args.idle_after, predict_budget_s=args.budget, **switches,
                 blend_ratio=args.blend_ratio if SYSTEMS[system].get("blend") else 0.0)
    if args.tree_cap_mib:
        knobs["tree_cap_bytes"] = args.tree_cap_mib << 20
    return RagConfig(**{**knobs, **overrides})


# ---- summaries -------------------------------------------------------------------------------------------


def percentile(xs: list[float], q: float) -> float:
    """The `q` quantile (0..1) of `xs`, linear between ranks (numpy's default)."""
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def mean(xs) -> float | None:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


def reference(runs: list[Run]) -> dict[tuple[str, str], Query]:
    """(user, question id) -> the Naive system's answer (default knobs)."""
    return {(r.user, q.question): q for r in runs if r.system == NAIVE and not r.setting for q in r.queries}


def stats(runs: list[Run], ref: dict, score) -> dict:
    """One system's numbers pooled over its runs (users)."""
    pairs = [(r.user, q) for r in runs for q in r.queries]
    qs = [q for _, q in pairs]
    scored = [(q, score(ref[(u, q.question)].answer, q.answer)) for u, q in pairs if (u, q.question) in ref]
    exact = [q.token_ids == ref[(u, q.question)].token_ids for u, q in pairs
             if (u, q.question) in ref and q.level != "qa_bank"]
    retrieved = sum(q.retrieved_tokens for q in qs)
    return {
        "queries": len(qs),
        "mean_s": mean(q.e2e_s for q in qs), "p90_s": percentile([q.e2e_s for q in qs], 0.9),
        "qa_hit": mean(q.level == "qa_bank" for q in qs),
        "kv_hit": sum(q.reused_tokens for q in qs) / retrieved if retrieved else 0.0,
        "blend_hit": sum(q.blended_tokens for q in qs) / retrieved if retrieved else 0.0,
        "idle_model_s": sum(r.idle_model_s for r in runs), "idle_tick_s": sum(r.idle_tick_s for r in runs),
        "rounds": sum(r.rounds for r in runs), "predicted": sum(r.predicted for r in runs),
        "cache_bytes": sum(sum(r.cache_bytes.values()) for r in runs),
        "kv_bytes": sum(r.cache_bytes.get("kv_tree", 0) for r in runs),
        "qa_bytes": sum(r.cache_bytes.get("qa_bank", 0) for r in runs),
        "rouge_l": mean(s for _, s in scored),
        "qa_rouge_l": mean(s for q, s in scored if q.level == "qa_bank"),
        "qa_served": sum(q.level == "qa_bank" for q, _ in scored),
        "identical": sum(exact), "compared": len(exact),
    }


def paraphrase_baseline(ref: dict, score) -> float | None:
    """Mean ROUGE-L between Naive's answers to two questions of one paraphrase group (every pair)."""
    by_group: dict[tuple[str, str], list[str]] = {}
    for (user, _qid), q in ref.items():
        if q.group:
            by_group.setdefault((user, q.group), []).append(q.answer)
    return mean(score(a[i], a[j]) for a in by_group.values() for i in range(len(a)) for j in range(i + 1, len(a)))


def floors(per: dict[str, dict], baseline: float | None) -> list[dict]:
    """The four floors: `{"name", "ok"` (True, False, or None where a system or number is missing),
    `"detail"}`."""
    out = []
    ours = per.get(OURS)
    others = {s: v for s, v in per.items() if s in BASELINES and v["mean_s"] is not None}
    if ours and others:
        best = min(others, key=lambda s: others[s]["mean_s"])
        cut = 1 - ours["mean_s"] / others[best]["mean_s"]
        goal = "goal met" if cut >= LATENCY_GOAL else f"goal {LATENCY_GOAL:.0%} not met"
        out.append({"name": "latency", "ok": cut >= LATENCY_FLOOR,
                    "detail": f"PerCache {ours['mean_s']:.3f} s vs best other {best} {others[best]['mean_s']:.3f} s: "
                              f"cut {cut:.1%} (floor {LATENCY_FLOOR:.0%}; {goal})"})
    else:
        out.append({"name": "latency", "ok": None, "detail": "needs PerCache and another system"})
    if ours and NO_PREDICTION in per:
        gain = ours["kv_hit"] - per[NO_PREDICTION]["kv_hit"]
        out.append({"name": "prediction", "ok": gain >= KV_FLOOR,
                    "detail": f"K/V hit rate {ours['kv_hit']:.1%} vs {NO_PREDICTION} {per[NO_PREDICTION]['kv_hit']:.1%}: "
                              f"{gain * 100:+.1f} points (floor +{KV_FLOOR * 100:.0f})"})
    else:
        out.append({"name": "prediction", "ok": None, "detail": f"needs PerCache and {NO_PREDICTION}"})
    if ours and ours["qa_rouge_l"] is not None and baseline:
        ok = ours["qa_rouge_l"] >= ROUGE_FLOOR * baseline
        out.append({"name": "quality", "ok": ok,
                    "detail": f"QA-served ROUGE-L {ours['qa_rouge_l']:.3f} over {ours['qa_served']} answers vs "
                              f"{ROUGE_FLOOR} x paraphrase baseline {baseline:.3f} = {ROUGE_FLOOR * baseline:.3f}"})
    else:
        out.append({"name": "quality", "ok": None,
                    "detail": "needs Naive, PerCache with QA bank answers, and two questions of a group"})
    ex = per.get(EXACT)
    if ex and ex["compared"]:
        out.append({"name": "exact reuse", "ok": ex["identical"] == ex["compared"],
                    "detail": f"{EXACT}: {ex['identical']}/{ex['compared']} replies token for token Naive's"})
    else:
        out.append({"name": "exact reuse", "ok": None, "detail": f"needs Naive and {EXACT}"})
    return out


def summarise(runs: list[Run], score) -> dict:
    """Per question set: per system stats, the paraphrase baseline, the floors, and the sensitivity
    settings' stats (`"sensitivity": {setting: stats}`)."""
    out = {}
    for which in dict.fromkeys(r.which for r in runs):
        mine = [r for r in runs if r.which == which]
        ref = reference(mine)
        per = {s: stats([r for r in mine if r.system == s and not r.setting], ref, score)
               for s in dict.fromkeys(r.system for r in mine if not r.setting)}
        base = paraphrase_baseline(ref, score)
        sens = {st: stats([r for r in mine if r.setting == st], ref, score)
                for st in dict.fromkeys(r.setting for r in mine if r.setting)}
        out[which] = {"systems": per, "paraphrase_rouge_l": base, "floors": floors(per, base), "sensitivity": sens}
    return out


# ---- output ------------------------------------------------------------------------------------------------

STAGES = ("embed", "retrieve", "load", "blend", "prefill", "decode", "save")
CSV_FIELDS = ("which", "user", "system", "setting", "question", "group", "level", "e2e_s", "reused_tokens",
              "blended_tokens", "recomputed_tokens", "retrieved_tokens", "prompt_tokens", *(f"{k}_s" for k in STAGES),
              "answer")


def write_results(runs: list[Run], summary: dict, meta: dict, out: Path) -> None:
    """`queries.csv` (every query) and `summary.json` (settings, per-run totals and `summarise`)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "queries.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in runs:
            for q in r.queries:
                row = {k: v for k, v in asdict(q).items() if k in CSV_FIELDS}
                row.update({f"{k}_s": q.stages.get(k, "") for k in STAGES})
                w.writerow({**row, "which": r.which, "user": r.user, "system": r.system, "setting": r.setting})
    per_run = [{k: v for k, v in asdict(r).items() if k != "queries"} | {"queries": len(r.queries)} for r in runs]
    (out / "summary.json").write_text(json.dumps({**meta, "runs": per_run, "results": summary}, indent=1) + "\n")


def _num(x, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def table(per: dict[str, dict], first: str = "system") -> list[str]:
    blend = any(s.get("blend_hit") for s in per.values())  # columns of the blending systems, when run
    lines = [f"| {first} | mean s | p90 s | QA hit | K/V hit | idle model-s | cache MiB (K/V + QA) | ROUGE-L vs Naive |"
             + (" blend hit | replies = Naive's |" if blend else ""),
             "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if blend else "")]
    for name, s in per.items():
        lines.append(f"| {name} | {_num(s['mean_s'], '.3f')} | {_num(s['p90_s'], '.3f')} | {_num(s['qa_hit'], '.1%')} | "
                     f"{s['kv_hit']:.1%} | {s['idle_model_s']:.1f} | {s['kv_bytes'] / 2**20:.1f} + "
                     f"{s['qa_bytes'] / 2**20:.2f} | {_num(s['rouge_l'], '.3f')} |"
                     + (f" {s['blend_hit']:.1%} | {s['identical']}/{s['compared']} |" if blend else ""))
    return lines


def rounds_text(most: int) -> str:
    return f"at most {most} prediction rounds" if most else "prediction rounds while any is due"


def markdown(summary: dict, meta: dict) -> str:
    verdict = {True: "PASS", False: "FAIL", None: "n/a"}
    lines = [f"Command: `{meta['command']}`. Date: {meta['date']}. Machine: {meta['machine']}. "
             f"Run took {meta['runtime_s'] / 60:.1f} min.", "",
             f"Users {', '.join(meta['users'])}; k {meta['k']}, max_tokens {meta['max_tokens']}, tau_query "
             f"{meta['tau_query']}, stride {meta['stride']}, a question every {meta['gap_s']:g} virtual s, idle after "
             f"{meta['idle_after_s']:g} s, {rounds_text(meta.get('rounds_per_gap', 0))} between questions, "
             f"idle budget {meta['budget_s']:g} model-s per day, K/V tree cap "
             f"{meta['tree_cap_mib']} MiB per user; greedy decoding"
             + (f" with lookup decoding (up to {meta['lookup_draft']} guessed tokens a pass)" if meta.get("lookup_draft")
                else "") + ". Latency: "
             f"wall time of `QueryPredictor.query` (embedding, retrieval, model). K/V hit: reused passage tokens / "
             f"retrieved passage tokens. Idle model-s: the predictor's rounds, apart from the latency. Quality: "
             f"{meta['rouge']}.", ""]
    if any(st.get("blend_hit") for s in summary.values() for st in s["systems"].values()):
        lines += [f"The +blend systems place passages cached after another prefix at this prompt's slots (keys turned "
                  f"by RoPE) and recompute the first {meta.get('blend_ratio', 0):.0%} of each passage's tokens "
                  f"(CacheBlend). Blend hit: such tokens / retrieved passage tokens. Replies = Naive's: "
                  f"token-identical replies among those not served by the QA bank.", ""]
    for which, s in summary.items():
        lines += [f"Question set `{which}`:", "", *table(s["systems"]), "",
                  f"Paraphrase baseline (Naive against Naive within a group): {_num(s['paraphrase_rouge_l'], '.3f')}.", ""]
        lines += [f"- {verdict[f['ok']]} {f['name']}: {f['detail']}" for f in s["floors"]]
        lines.append("")
        if s["sensitivity"]:
            lines += [f"PerCache sensitivity on `{which}` (PerCache Fig. 17-19):", "",
                      *table(s["sensitivity"], "setting"), ""]
    return "\n".join(lines).rstrip()


def plot(summary: dict, folder: Path) -> list[Path]:
    """PerCache Fig. 14 style (mean latency per system, p90 as a tick) and Fig. 16 style (QA and K/V hit
    rates and the latency cut against Naive, per system), one pair per question set."""
    from bench.plots import _pyplot, _save

    plt, paths = _pyplot(), []
    for which, s in summary.items():
        per = s["systems"]
        names = list(per)
        fig, ax = plt.subplots(figsize=(1.1 * len(names) + 2.5, 3.6), dpi=120)
        for i, n in enumerate(names):
            ax.bar(i, per[n]["mean_s"], width=0.6, color="#d62728" if n == OURS else "#1f77b4", alpha=0.8)
            ax.hlines(per[n]["p90_s"], i - 0.3, i + 0.3, color="black", linewidth=1.5, label="p90" if i == 0 else None)
            ax.annotate(f"{per[n]['mean_s']:.2f}", (i, per[n]["mean_s"]), textcoords="offset points", xytext=(0, 3),
                        ha="center", fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=25, ha="right", fontsize=8)
        ax.set_ylabel("end-to-end latency, s (mean; tick: p90)")
        ax.set_title(f"RAG query latency per system ({which})", fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(_save(fig, folder / f"rag-latency-{which}.png"))
        fig, ax = plt.subplots(figsize=(1.1 * len(names) + 2.5, 3.6), dpi=120)
        naive = per.get(NAIVE, {}).get("mean_s")
        bars = {"QA hit": [per[n]["qa_hit"] for n in names], "K/V hit": [per[n]["kv_hit"] for n in names]}
        if naive:
            bars["latency cut vs Naive"] = [1 - per[n]["mean_s"] / naive for n in names]
        w = 0.8 / len(bars)
        for j, (lab, ys) in enumerate(bars.items()):
            ax.bar([i + (j - (len(bars) - 1) / 2) * w for i in range(len(names))], ys, width=w, label=lab)
        ax.set_xticks(range(len(names)), names, rotation=25, ha="right", fontsize=8)
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_ylabel("fraction")
        ax.set_title(f"Ablation: what each level and prediction adds ({which})", fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(_save(fig, folder / f"rag-ablation-{which}.png"))
    return paths


def machine() -> str:
    from bench.quantized import cpu_line

    return f"{platform.platform()}, {os.cpu_count()} cores, {cpu_line()}"


# ---- driver -------------------------------------------------------------------------------------------------


def sensitivity_settings(args) -> list[tuple[str, dict]]:
    """PerCache's sensitivity sweeps (Fig. 17-19): stride, tau_query, and the K/V tree's cap (QA
    entries are a few KiB each and keep their default cap); and the most idle rounds between two
    questions (a knob of this benchmark, not of the cache: `bench.rag_session.Session` takes it). The
    default knobs' point is the main run."""
    sweeps = args.sensitivity or SWEEPS
    out = [(f"stride={s}", {"stride": s}) for s in STRIDES if s != args.stride and "stride" in sweeps]
    out += [(f"tau_query={t}", {"tau_query": t}) for t in TAUS if t != args.tau_query and "tau_query" in sweeps]
    out += [(f"tree_cap={c}MiB", {"tree_cap_bytes": c << 20}) for c in args.caps_mib if "tree_cap" in sweeps]
    out += [(f"rounds_per_gap={n}", {"rounds_per_gap": n}) for n in ROUNDS
            if n != args.rounds_per_gap and "rounds_per_gap" in sweeps]
    return out


def main(argv=None) -> int:
    from actors.config import Tuning

    from bench import rag_data

    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(
        prog="python -m bench.rag", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Systems: " + ", ".join(SYSTEMS) + " (the last four only when named). Progress goes to stderr; "
               "the results section to stdout.")
    ap.add_argument("--users", nargs="+", default=rag_data.users(), choices=rag_data.users(),
                    help="users of bench.rag_data (default all)")
    ap.add_argument("--which", choices=["main", "heldout", "both"], default="both",
                    help="question set; the floors are checked on each (default both)")
    ap.add_argument("--systems", nargs="+", default=DEFAULT_SYSTEMS, choices=list(SYSTEMS), metavar="SYSTEM",
                    help="systems to run (default all but the variants); Naive is the answers' reference")
    ap.add_argument("--blend-ratio", type=float, default=0.15,
                    help="share of blended passage tokens recomputed by the +blend systems (default 0.15)")
    ap.add_argument("--k", type=int, default=3, help="passages retrieved per query (default 3)")
    ap.add_argument("--max-tokens", type=int, default=32, help="reply length, tokens (default 32)")
    ap.add_argument("--tau-query", type=float, default=0.85, help="QA bank similarity threshold (default 0.85)")
    ap.add_argument("--stride", type=int, default=5, help="queries predicted per round (default 5)")
    ap.add_argument("--gap", type=float, default=600.0, help="virtual seconds between questions (default 600)")
    ap.add_argument("--rounds-per-gap", type=int, default=0, metavar="N",
                    help="most prediction rounds between two questions; 0: as many as are due within the gap "
                         "and the day's budget (default 0)")
    ap.add_argument("--idle-after", type=float, default=120.0,
                    help="seconds without a real call before the predictor works (default 120)")
    ap.add_argument("--budget", type=float, default=600.0, help="predictor model-seconds per user per day (default 600)")
    ap.add_argument("--tree-cap-mib", type=int, default=0,
                    help="K/V tree cap per user, MiB (default 0: RagConfig.tree_cap_bytes)")
    ap.add_argument("--limit", type=int, default=0, help="first N questions per user (default 0: all)")
    ap.add_argument("--sensitivity", nargs="*", choices=SWEEPS, metavar="SWEEP",
                    help="also sweep PerCache's stride 1..5, tau_query 0.6..0.95, K/V tree cap (--caps-mib) and the "
                         "idle rounds between questions (0, 1, 4), on "
                         "the main set; name some of " + ", ".join(SWEEPS) + " to run only those (each setting is a "
                         "PerCache run with its idle work: about 10 min on a 2-core VM)")
    ap.add_argument("--caps-mib", type=int, nargs=3, default=[128, 512, 2048],
                    help="K/V tree caps of the sensitivity sweep, MiB (default 128 512 2048)")
    ap.add_argument("--lookup-draft", type=int, default=Tuning().lookup_draft, metavar="N",
                    help="lookup decoding in every system, up to N guessed tokens a pass (EngineConfig.lookup_draft; "
                         f"default {Tuning().lookup_draft}, the service's; 0: off)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--tmp", default=None,
                    help="where the runs' data directories go, created if missing (default: the system's temp)")
    ap.add_argument("--out", type=Path, default=Path("docs/results/rag"),
                    help="folder for queries.csv and summary.json (default docs/results/rag)")
    ap.add_argument("--write", type=Path, help="replace or add the RAG cache section of this markdown file")
    ap.add_argument("--plot", action="store_true", help="PNG figures (matplotlib) into --img")
    ap.add_argument("--img", type=Path, default=Path("docs/img"), help="folder of the figures (default docs/img)")
    args = ap.parse_args(argv)
    if args.tree_cap_mib < 0:
        ap.error("--tree-cap-mib must be at least 0")
    if not 0 <= args.blend_ratio <= 1:
        ap.error("--blend-ratio must be within [0, 1]")
    if args.rounds_per_gap < 0:
        ap.error("--rounds-per-gap must be at least 0")
    if args.gap <= 0 or args.limit < 0 or args.k < 1 or args.max_tokens < 1 or args.stride < 1 or args.lookup_draft < 0:
        ap.error("--gap, --k, --max-tokens and --stride must be positive, --limit and --lookup-draft at least 0")
    if args.sensitivity is not None and OURS not in args.systems:
        ap.error("--sensitivity sweeps PerCache: include it in --systems")
    t_start = time.perf_counter()
    import torch

    from engine.config import EngineConfig
    from engine.context import ContextEngine
    from engine.embed import Embedder

    torch.set_num_threads(args.threads)
    score, rouge_name = rouge_scorer()
    log(f"bench.rag: {rouge_name}; loading the model and the embedder")
    engine = ContextEngine.load(None, EngineConfig(lookup_draft=args.lookup_draft), progress=False)
    embedder = Embedder()
    embedder.embed(["warm up"])
    systems = [NAIVE] + [s for s in args.systems if s != NAIVE] if NAIVE in args.systems else args.systems
    sets = ["main", "heldout"] if args.which == "both" else [args.which]
    from bench.rag_session import run_group

    runs: list[Run] = []
    for which in sets:
        for user in args.users:
            variants = [(system, "", {}) for system in systems]
            if args.sensitivity is not None and which == "main":
                variants += [(OURS, setting, knobs) for setting, knobs in sensitivity_settings(args)]
            runs += run_group(engine, embedder, user, which, variants, args)
    summary = summarise(runs, score)
    runtime = time.perf_counter() - t_start
    meta = {"command": "python -m bench.rag " + shlex.join(argv), "date": datetime.date.today().isoformat(),
            "machine": machine(), "runtime_s": runtime, "users": args.users, "k": args.k, "max_tokens": args.max_tokens,
            "tau_query": args.tau_query, "stride": args.stride, "gap_s": args.gap, "idle_after_s": args.idle_after,
            "budget_s": args.budget, "tree_cap_mib": rag_config(args, NAIVE).tree_cap_bytes >> 20, "limit": args.limit,
            "rouge": rouge_name, "fingerprint": engine.fingerprint, "blend_ratio": args.blend_ratio,
            "lookup_draft": args.lookup_draft, "rounds_per_gap": args.rounds_per_gap}
    write_results(runs, summary, meta, args.out)
    log(f"bench.rag: wrote {args.out / 'queries.csv'} and {args.out / 'summary.json'}")
    if args.plot:
        for p in plot(summary, args.img):
            log(f"bench.rag: wrote {p}")
    from bench.markdown import publish

    publish(markdown(summary, meta), args.write, NAME, HEADING)
    print(f"\nTotal runtime: {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
