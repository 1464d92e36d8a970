"""Replay results as PNG plots in the style of the LLMS figures: switch latency by policy for one
replay (Fig. 9: the mean as a bar, every call as a dot, the median as a tick, on a symmetric log
scale), mean switch latency against active contexts for the grid set (Fig. 9), and the most active
contexts within each bound for the capacity set (Fig. 10).

This module draws and saves figures (matplotlib, imported only when a plot is drawn); it writes no
markdown and does not decide file names or where the links go (`bench.report`).
"""

from __future__ import annotations

from pathlib import Path

from bench.capacity import BOUNDS_MS, capacity_counts
from bench.results import Results, SetResults
from bench.tables import fmt_ms, throttle_label

COLOURS = {"lmk": "#7f7f7f", "swap": "#1f77b4", "vllm-s": "#ff7f0e", "vllm-sq": "#2ca02c", "llms": "#d62728"}


def _pyplot():
    """matplotlib's pyplot on the file-only backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    """Write `fig` as a PNG at `path` (folders made as needed) and release it."""
    plt = _pyplot()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    plt.close(fig)
    return out


def plot_switch_latency(results: Results, path: str | Path) -> Path:
    """LLMS Fig. 9 style: per policy, a bar of the mean switch_ms, every call as a dot and the median
    as a tick, on a symmetric log y axis (linear below 1 ms, so hits near zero still show)."""
    import numpy as np

    plt = _pyplot()
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
        ax.annotate(fmt_ms(s["mean_switch_ms"]), (i, s["mean_switch_ms"]), textcoords="offset points",
                    xytext=(0, 3), ha="center", fontsize=8)
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_ylim(bottom=0)
    ax.set_xticks(range(len(pols)), pols)
    ax.set_ylabel("switch latency (ms)")
    ax.set_title(f"Switch latency by policy\n{results.title}", fontsize=9)
    ax.grid(axis="y", which="major", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return _save(fig, path)


def plot_grid(sr: SetResults, path: str | Path) -> Path:
    """Mean switch_ms against active contexts, one line per policy, log y; a panel per pattern (columns)
    and throttle (rows)."""
    plt = _pyplot()
    patterns = list(dict.fromkeys(r.pattern for r in sr.runs))
    thrs = list(dict.fromkeys(r.throttle_mbps for r in sr.runs))
    fig, axes = plt.subplots(len(thrs), len(patterns), figsize=(3.4 * len(patterns), 2.9 * len(thrs)),
                             dpi=120, squeeze=False, sharex=True, sharey=True)
    for i, thr in enumerate(thrs):
        for j, pattern in enumerate(patterns):
            ax = axes[i][j]
            for p in dict.fromkeys(r.policy for r in sr.runs):
                pts = sorted((r.contexts, sr.mean(r)) for r in sr.find(pattern=pattern, throttle_mbps=thr, policy=p)
                             if sr.mean(r) is not None)
                if pts:
                    ax.plot(*zip(*pts), marker="o", markersize=3, color=COLOURS.get(p, "#9467bd"), label=p)
            ax.set_yscale("log")
            ax.set_xticks(sorted({r.contexts for r in sr.runs}))
            ax.set_title(f"{pattern}, {throttle_label(thr)}", fontsize=8)
            ax.grid(which="major", alpha=0.3)
            if i == len(thrs) - 1:
                ax.set_xlabel("active contexts")
            if j == 0:
                ax.set_ylabel("mean switch latency (ms)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, fontsize=7, loc="upper center", ncol=len(labels))
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return _save(fig, path)


def plot_capacity(sr: SetResults, path: str | Path) -> Path:
    """LLMS Fig. 10 style: per bound a panel, per budget a group of bars (interpolated counts), one per policy."""
    plt = _pyplot()
    counts = capacity_counts(sr)
    pols = list(dict.fromkeys(r.policy for r in sr.runs))
    budgets = list(dict.fromkeys(r.budget_contexts for r in sr.runs))
    smallest = min(r.contexts for r in sr.runs)
    fig, axes = plt.subplots(1, len(BOUNDS_MS), figsize=(4.2 * len(BOUNDS_MS), 3.2), dpi=120, sharey=True,
                             squeeze=False)
    w = 0.8 / len(pols)
    for ax, bound in zip(axes[0], BOUNDS_MS):
        for k, p in enumerate(pols):
            xs = [i + (k - (len(pols) - 1) / 2) * w for i in range(len(budgets))]
            mcs = [counts[(b, bound)][p] for b in budgets]
            ax.bar(xs, [m.interpolated for m in mcs], width=w, color=COLOURS.get(p, "#9467bd"), label=p)
            for x, m in zip(xs, mcs):  # 16+ at the limit, <2 for none: the bar alone would hide it
                text = f"<{smallest}" if m.count == 0 else f"{m.count}+" if m.at_limit else f"{m.interpolated:.1f}"
                ax.annotate(text, (x, m.interpolated), textcoords="offset points", xytext=(0, 2), ha="center",
                            fontsize=5.5)
        ax.set_xticks(range(len(budgets)), [f"{b:g} avg ctx" for b in budgets])
        ax.set_title(f"mean switch latency <= {bound:g} ms", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("most active contexts")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, path)
