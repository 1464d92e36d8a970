"""Restore prediction with other online-correction windows, judged on the same restores.

Runs `bench.switching` in one process with shadow `scheduler.pipeline.OnlineCosts` beside the
governor's own. Each shadow plans every restore with its own stage factors (the same
`plan_restore` call, its own scaled profile), predicts it with its own residuals, and learns from the
same measurements, so the windows are compared on identical restores rather than across runs of a
noisy host. The comparison is exact where a shadow would plan what was executed: always for the
policies that never recompute by choice (`lmk`, `swap`, `vllm-s`, `vllm-sq`); for `llms` the output
counts the restores whose shadow plan differed (their prediction is of a plan that did not run).

    python -m bench.online_window --windows 9 25 -- --calls 100 --contexts 8

prints, per policy and window, the median |ln(measured / predicted)| over the restores and the
number of differing plans. The window in use is `OnlineCosts`'s default.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys


def _install(windows: list[int], results: dict) -> None:
    import actors.governor as gov_mod
    from scheduler import pipeline

    plan_restore = gov_mod.plan_restore
    orig_plan, orig_record, orig_init = (gov_mod.MemoryGovernor._plan, gov_mod.MemoryGovernor.record_restore,
                                         gov_mod.MemoryGovernor.__init__)
    last_call: dict = {}

    def spy(missing, prof, **kw):
        last_call["args"] = (list(missing), kw)
        return plan_restore(missing, prof, **kw)

    def init(self, *a, **k):
        orig_init(self, *a, **k)
        self._shadows = {w: pipeline.OnlineCosts(window=w) for w in windows}
        self._shadow_pending = {}
        results.setdefault(self.cfg.policy, {w: {"pairs": [], "differing": 0} for w in windows})

    def plan(self, ctx, book, row, cached):
        out = orig_plan(self, ctx, book, row, cached)
        args = last_call.pop("args", None)
        if ctx in self._pending and args is not None:
            missing, kw = args
            levels = [lv for _, lv, _ in out.resident]
            per = {}
            for w, sh in self._shadows.items():
                prof = sh.profile(self.profile)
                p = plan_restore(missing, prof, **kw)
                t_res = prof.decode(levels)
                stages = {"io": p.t_io, "decode": p.t_decode + t_res, "recompute": p.t_recompute}
                corrected = p.predicted + t_res
                shape = pipeline.restore_shape(len(out.resident), len(p.load), len(p.recompute))
                same = sorted(p.recompute) == sorted(out.recompute)
                per[w] = (shape, stages, corrected, sh.predict(shape, corrected), same)
            self._shadow_pending[ctx] = per
        return out

    def record(self, ctx, measured_s, stages=None):
        per = self._shadow_pending.pop(ctx, None)
        if per is not None and measured_s > 0:
            for w, (shape, st, corrected, predicted, same) in per.items():
                r = results[self.cfg.policy][w]
                r["pairs"].append((predicted, measured_s))
                r["differing"] += not same
                self._shadows[w].observe(shape, st, stages or {}, corrected, measured_s)
        return orig_record(self, ctx, measured_s, stages)

    gov_mod.plan_restore = spy
    gov_mod.MemoryGovernor._plan = plan
    gov_mod.MemoryGovernor.record_restore = record
    gov_mod.MemoryGovernor.__init__ = init


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Arguments after -- go to bench.switching (python -m bench.switching --help), e.g. "
               "python -m bench.online_window --windows 9 25 -- --calls 100 --contexts 8")
    ap.add_argument("--windows", type=int, nargs="+", default=[9, 25], help="windows to compare (default 9 25)")
    args = ap.parse_args(own)
    if "--ray" in rest:
        ap.error("the shadows live in the governor's process: run without --ray")
    if any(w < 1 for w in args.windows):
        ap.error("windows must be at least 1")
    results: dict = {}
    _install(args.windows, results)
    from bench import switching

    switching.main(rest)
    print("policy | " + " | ".join(f"window {w}: median abs ln (restores, differing plans)" for w in args.windows))
    for policy, by_w in results.items():
        cells = []
        for w in args.windows:
            pairs = [(p, m) for p, m in by_w[w]["pairs"] if p > 0 and m > 0]
            med = statistics.median(abs(math.log(m / p)) for p, m in pairs) if pairs else float("nan")
            cells.append(f"{med:.3f} ({len(pairs)}, {by_w[w]['differing']})")
        print(f"{policy} | " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
