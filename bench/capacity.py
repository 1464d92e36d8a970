"""The most active contexts a policy keeps within a mean switch latency bound (LLMS Fig. 10's metric),
from an experiment set's runs at a few context counts, and issue 6's check of `llms` against the best
baseline.

This module computes counts and verdicts (as short table cells); the tables around them are
`bench.tables`', the bar chart `bench.plots`'. It reads no files.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from bench import grid as G
from bench.results import SetResults

BOUNDS_MS = (10.0, 25.0)  # LLMS Fig. 10's switch latency bounds
# Issue 6: llms' most active contexts over the best baseline's, by bound, where that baseline supports >= 2
CAPACITY_TARGETS = {10.0: 2.0, 25.0: 3.0}


@dataclass(frozen=True, slots=True)
class MaxContexts:
    """The most active contexts meeting a mean switch latency bound, from runs at a few counts."""

    count: int  # the largest tested count meeting the bound with every smaller tested count (0: none)
    interpolated: float  # between that count and the next, linear in mean switch_ms (= count otherwise)
    at_limit: bool  # every tested count meets the bound: the true maximum may be higher
    complete: bool  # no run the answer depends on is missing

    def label(self, smallest: int) -> str:
        if self.count == 0:
            text = f"<{smallest}" if self.complete else ""
        elif self.at_limit:
            text = f">={self.count}"
        else:
            text = f"{self.count} ({self.interpolated:.1f})" if self.interpolated != self.count else str(self.count)
        return text + ("" if self.complete or self.count == 0 else "*")


def max_active_contexts(points: Mapping[int, float | None], bound_ms: float) -> MaxContexts:
    """LLMS Fig. 10's metric from mean switch_ms by tested context count (None: run missing). Counts
    are walked upwards and the walk stops at the first count over the bound (or missing): a count
    after a failure does not count even if it happens to meet the bound."""
    last = None  # (count, ms) of the last count meeting the bound
    for n in sorted(points):
        ms = points[n]
        if ms is None:
            return MaxContexts(last[0] if last else 0, float(last[0]) if last else 0.0, False, False)
        if ms > bound_ms:
            if last is None:
                return MaxContexts(0, 0.0, False, True)
            (n0, ms0) = last
            frac = (bound_ms - ms0) / (ms - ms0) if ms > ms0 else 0.0
            return MaxContexts(n0, n0 + frac * (n - n0), False, True)
        last = (n, ms)
    return MaxContexts(last[0] if last else 0, float(last[0]) if last else 0.0, last is not None, True)


def capacity_counts(sr: SetResults) -> dict[tuple[float, float], dict[str, MaxContexts]]:
    """(budget, bound) -> policy -> MaxContexts over the set's context counts."""
    out = {}
    for budget in dict.fromkeys(r.budget_contexts for r in sr.runs):
        for bound in BOUNDS_MS:
            out[(budget, bound)] = {
                p: max_active_contexts({r.contexts: sr.mean(r) for r in sr.find(budget_contexts=budget, policy=p)}, bound)
                for p in dict.fromkeys(r.policy for r in sr.runs)}
    return out


def capacity_check(counts: Mapping[str, MaxContexts], bound_ms: float) -> tuple[str, str]:
    """(llms / best baseline, issue 6 target) for one budget and bound, as table cells."""
    base = {p: counts[p] for p in G.BASELINES if p in counts}
    if "llms" not in counts or not base:
        return "-", "-"
    best_name = max(base, key=lambda p: (base[p].interpolated, base[p].count))
    best, llms = base[best_name], counts["llms"]
    partial = "" if llms.complete and all(c.complete for c in base.values()) else " (partial)"
    if best.count < 2:
        return "-", f"no baseline meets it at 2 contexts: counts only{partial}"
    if best.at_limit:
        return "-", f"n/a: {best_name} meets the bound at every count{partial}"
    ratio = llms.interpolated / best.interpolated
    lower = ">=" if llms.at_limit else ""
    goal = CAPACITY_TARGETS.get(bound_ms)
    if goal is None:
        verdict = "-"
    elif ratio >= goal or not lower:
        verdict = f">= {goal:g}x: {'met' if ratio >= goal else 'missed'}"
    else:  # llms meets the bound at every tested count: more contexts would be needed to tell
        verdict = f">= {goal:g}x: open (llms meets it at every tested count)"
    return f"{lower}{ratio:.2f}x ({best_name})", verdict + partial
