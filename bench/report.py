"""Replay results (`bench.replay`) as markdown tables and PNG plots.

For each results directory: a table of switch latency per policy (mean, median, p95, restores by
outcome, data moved, restore prediction error), the ratios of each baseline's switch latency to
`llms`', and a plot in the style of LLMS Fig. 9 (switch latency by policy on a symmetric log scale:
one bar per policy for the mean, every call as a dot, the median as a tick). With `--write FILE`, the
tables replace what lies between `<!-- replay:begin -->` and `<!-- replay:end -->` in FILE (the pair
is appended under a "Trace replay" heading when missing).

LLMS Fig. 10 (the most active contexts meeting a 10 ms / 25 ms mean switch latency, for three budgets)
needs a grid of replays per budget and context count: not here yet.

    python -m bench.report RESULTS_DIR [RESULTS_DIR ...] [--write docs/benchmarks.md] [--img-dir docs/img]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.replay import CALLS_CSV, SUMMARY_FORMAT, SUMMARY_JSON

BEGIN, END = "<!-- replay:begin -->", "<!-- replay:end -->"
SECTION = "## Trace replay"
BASELINE_FOR_RATIOS = "llms"  # the policy every other one is compared with
# Issue 6 targets: llms' mean switch_ms lower than each baseline's by at least this factor (Markov,
# 8 contexts, a budget holding a quarter of them at q8); shown only for runs of that setting.
TARGETS = {"lmk": 100.0, "swap": 5.0, "vllm-sq": 2.0}
COLOURS = {"lmk": "#7f7f7f", "swap": "#1f77b4", "vllm-s": "#ff7f0e", "vllm-sq": "#2ca02c", "llms": "#d62728"}


class ResultsError(ValueError):
    """A results directory is missing a file or holds one this reader does not understand."""


@dataclass(slots=True)
class Results:
    """One replay's summary and its per-call rows."""

    directory: Path  # the results directory
    summary: dict  # summary.json
    rows: list[dict]  # calls.csv, numbers as float (call and counts as int)

    def switch_ms(self, policy: str) -> list[float]:
        return [r["switch_ms"] for r in self.rows if r["policy"] == policy]

    @property
    def name(self) -> str:
        """A file-name-safe label of the setting: pattern, contexts, throttle, mode."""
        s, t = self.summary, self.summary["trace"]
        parts = [f"replay-{t['pattern']}-{t['contexts']}ctx"]
        if s["throttle_mbps"]:
            parts.append(f"{s['throttle_mbps']:g}mbps")
        if s["mode"] == "ray":
            parts.append("ray")
        return "-".join(parts)

    @property
    def title(self) -> str:
        s, t = self.summary, self.summary["trace"]
        thr = f"{s['throttle_mbps']:g} MB/s read throttle" if s["throttle_mbps"] else "no read throttle"
        mode = "Ray actors" if s["mode"] == "ray" else "one process"
        return f"{t['pattern'].capitalize()}, {t['contexts']} contexts, {mode}, {thr}"


_INT_FIELDS = {"call", "context", "resident_chunks", "loaded_chunks", "loaded_bytes", "recomputed_chunks",
               "prompt_tokens", "completion_tokens"}
_STR_FIELDS = {"policy", "outcome"}


def load_results(directory: str | Path) -> Results:
    """Read a results directory written by `bench.replay.write_results` (raises ResultsError)."""
    d = Path(directory)
    try:
        summary = json.loads((d / SUMMARY_JSON).read_text())
        with open(d / CALLS_CSV, newline="", encoding="utf-8") as f:
            raw = list(csv.DictReader(f))
    except (OSError, json.JSONDecodeError) as e:
        raise ResultsError(f"{d}: not a replay results directory ({e})") from e
    if summary.get("format") != SUMMARY_FORMAT:
        raise ResultsError(f"{d / SUMMARY_JSON}: not a replay summary (format {summary.get('format')!r})")
    rows = [{k: v if k in _STR_FIELDS else int(v) if k in _INT_FIELDS else float(v) for k, v in r.items()}
            for r in raw]
    return Results(d, summary, rows)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def ratios(results: Results) -> dict[str, float]:
    """Mean switch_ms of each other policy over `llms`' ({} when llms is not among the policies)."""
    pols = results.summary["policies"]
    if BASELINE_FOR_RATIOS not in pols:
        return {}
    base = pols[BASELINE_FOR_RATIOS]["mean_switch_ms"]
    return {p: s["mean_switch_ms"] / base for p, s in pols.items() if p != BASELINE_FOR_RATIOS}


def _targets_apply(s: dict) -> bool:
    t = s["trace"]
    return t["pattern"] == "markov" and t["contexts"] == 8 and s["budget_rule"] != "given"


def markdown(results: Results, image: str | None = None) -> str:
    """The tables of one replay (and a link to its plot, a path relative to the markdown file)."""
    s, t = results.summary, results.summary["trace"]
    m = s["machine"]
    lines = [
        f"### {results.title}",
        "",
        f"Command: `{s['command']}`. Date: {s['date']}. Machine: {m['cpu_count']} cores, {m['machine']}, "
        f"{m['platform']}. Trace: {t['pattern']}, {t['contexts']} contexts, {t['calls']} calls (seed "
        f"{t['seed']}, {t['rate_per_s']:g} calls/s; gaps compressed to at most {s['max_gap_s']:g} s once the "
        f"service's background work is done). Histories: "
        f"{s['history_tokens']} tokens in all. KV budget {s['kv_budget_bytes'] / 1e6:.2f} MB "
        f"({s['budget_rule']}). max_tokens {s['max_tokens']}.",
        "",
        "| policy | mean switch_ms | median | p95 | mean e2e ms | hit / resident / swap / recompute "
        "| MB loaded | chunks recomputed | median abs ln(measured/predicted) restore |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for p, x in s["policies"].items():
        o = x["outcomes"]
        err = "-" if x["restore_pred_error"] is None else f"{x['restore_pred_error']:.2f} (n={x['restore_pred_n']})"
        lines.append(f"| {p} | {_ms(x['mean_switch_ms'])} | {_ms(x['median_switch_ms'])} | "
                     f"{_ms(x['p95_switch_ms'])} | {_ms(x['mean_e2e_ms'])} | "
                     f"{o['hit']} / {o['resident']} / {o['swap']} / {o['recompute']} | {x['loaded_mb']:.1f} | "
                     f"{x['recomputed_chunks']} | {err} |")
    if r := ratios(results):
        with_targets = _targets_apply(s)
        lines += ["", f"Mean switch_ms of each policy divided by `{BASELINE_FOR_RATIOS}`'"
                  + (" (issue 6 targets for this setting in brackets):" if with_targets else ":"), "",
                  "| policy | ratio |" + (" target |" if with_targets else ""),
                  "|---|---:|" + ("---|" if with_targets else "")]
        for p, v in r.items():
            row = f"| {p} | {v:.1f}x |"
            if with_targets:
                goal = TARGETS.get(p)
                row += " - |" if goal is None else f" >= {goal:g}x: {'met' if v >= goal else 'missed'} |"
            lines.append(row)
    if image:
        lines += ["", f"![switch latency by policy, {results.title}]({image})"]
    return "\n".join(lines)


def plot_switch_latency(results: Results, path: str | Path) -> Path:
    """LLMS Fig. 9 style: per policy, a bar of the mean switch_ms, every call as a dot and the median
    as a tick, on a symmetric log y axis (linear below 1 ms, so hits near zero still show)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    pols = list(results.summary["policies"])
    fig, ax = plt.subplots(figsize=(1.2 * len(pols) + 2.5, 3.6), dpi=120)
    rng = np.random.default_rng(0)  # the dots' horizontal jitter only
    for i, p in enumerate(pols):
        sw = np.array(results.switch_ms(p))
        s = results.summary["policies"][p]
        ax.bar(i, s["mean_switch_ms"], width=0.6, color=COLOURS.get(p, "#9467bd"), alpha=0.75,
               label="mean" if i == 0 else None)
        ax.scatter(i + rng.uniform(-0.18, 0.18, len(sw)), sw, s=8, color="black", alpha=0.5, linewidths=0,
                   label="one call" if i == 0 else None, zorder=3)
        ax.hlines(s["median_switch_ms"], i - 0.3, i + 0.3, color="black", linewidth=1.5,
                  label="median" if i == 0 else None, zorder=4)
        ax.annotate(_ms(s["mean_switch_ms"]), (i, s["mean_switch_ms"]), textcoords="offset points",
                    xytext=(0, 3), ha="center", fontsize=8)
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_ylim(bottom=0)
    ax.set_xticks(range(len(pols)), pols)
    ax.set_ylabel("switch latency (ms)")
    ax.set_title(f"Switch latency by policy\n{results.title}", fontsize=9)
    ax.grid(axis="y", which="major", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    plt.close(fig)
    return out


def replace_section(doc: str, text: str) -> str:
    """`doc` with the text between the replay markers replaced by `text` (markers kept); the
    markers are appended under the "Trace replay" heading (made when missing) the first time."""
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in doc and END in doc and doc.index(BEGIN) < doc.index(END):
        return doc[: doc.index(BEGIN)] + block + doc[doc.index(END) + len(END):]
    if BEGIN in doc or END in doc:
        raise ResultsError(f"unbalanced replay markers: want {BEGIN} then {END}")
    if SECTION not in doc:
        doc = doc.rstrip("\n") + f"\n\n{SECTION}\n"
    return doc.rstrip("\n") + "\n\n" + block + "\n"


def report(dirs: list[str | Path], img_dir: str | Path, md_dir: str | Path) -> str:
    """Tables of every results directory, each with its plot saved in `img_dir` and linked relative
    to `md_dir` (where the markdown will live)."""
    parts = []
    for d in dirs:
        res = load_results(d)
        png = plot_switch_latency(res, Path(img_dir) / f"{res.name}.png")
        parts.append(markdown(res, Path(os.path.relpath(png, md_dir)).as_posix()))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None, prog: str = "python -m bench.report") -> int:
    ap = argparse.ArgumentParser(prog=prog, description="Replay results as markdown tables and PNG plots "
                                 "(LLMS Fig. 9 style); the markdown goes to stdout, or into a file with --write.")
    ap.add_argument("dirs", nargs="+", metavar="RESULTS_DIR", help="written by deploy.jobs.replay --out")
    ap.add_argument("--write", type=Path, metavar="FILE",
                    help=f"replace the text between {BEGIN} and {END} in this markdown file")
    ap.add_argument("--img-dir", type=Path, default=None, metavar="DIR",
                    help="where the PNGs go (default: img/ next to --write's file, else docs/img)")
    args = ap.parse_args(argv)
    img_dir = args.img_dir or (args.write.parent / "img" if args.write else Path("docs/img"))
    md_dir = args.write.parent if args.write else Path.cwd()
    try:
        text = report(args.dirs, img_dir, md_dir)
        if args.write:
            doc = args.write.read_text() if args.write.exists() else "# Benchmarks\n"
            args.write.write_text(replace_section(doc, text))
    except ResultsError as e:
        ap.error(str(e))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
