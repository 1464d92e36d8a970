"""Tolerance-aware compression planner (LLMS §3.2, Eq. 1-3): which level each chunk of a context gets.

This module deliberately knows nothing about codecs, KV data, bytes on disk, files or when to
compress: it maps densities and current levels to a plan, and the caller quantizes and writes the
chunks whose level changes.

Input is one context's per-chunk information densities ``D`` (Eq. 1, measured by the engine; one per
chunk, chunk order), each chunk's current level, and whether the last chunk is partial. Output is a
:class:`CompressionPlan`: a level per chunk and the chunks whose level changes.

Tolerance mode (``llms``). Chunks are ranked by density, highest first; ties keep chunk order (a
stable sort, so the earlier chunk ranks higher). With levels ``w = 0..m-1`` heaviest first (default
q8, q4, q2, i.e. ratios 8/8, 4/8, 2/8), thresholds ``0 <= t1 <= ... <= t_{m-1} <= n`` cut the ranking:
ranks ``[0, t1)`` target ``levels[0]``, ``[t1, t2)`` target ``levels[1]``, the rest the last level
(Eq. 2). The thresholds maximise the density-weighted fidelity

    ctxInfo = sum_i F(level_i) * D_i     subject to     mean_i ratio(level_i) <= ratio_global

by exact enumeration of every threshold tuple: per level a cumulative sum over the ranking gives
each segment's fidelity and ratio in O(1), so all ``(n+1)^(m-1)`` tuples (O(n^2) for three levels,
263k for n = 512) are scored with a few broadcast numpy operations.

The fidelity ``F`` of a level (``weights``): ``measured`` (default) is ``scheduler.levels.FIDELITY``,
1 minus the relative error of the level's codec on real K/V; ``ratio`` is ``F = ratio_w``, a weight
linear in the bits. Why not the paper's ``1/ratio_w`` (Eq. 3): with ``ratio_w = bits/8`` it rewards
putting the *densest* chunks at 2 bits, the opposite of the paper's own intent (dense chunks are the
least tolerant). Why measured and not ``ratio_w``: the objective is linear in the weights, so with
weights linear in the bits the optimum sits at the extremes (at a 50% bound: a third of the chunks
at q8 and two thirds at q2, almost none at q4), while q2 loses far more than q4 and q4 almost nothing
(`python -m bench.accuracy`, 16 windows: perplexity +25% at q2, +0.9% at q4, and +3.0% for that
q8/q2 mix). Measured weights keep most chunks at q4 and spend q8 only on chunks much denser than
those they push to q2. The paper's constraint is an equality; we use ``<=`` (an exact fit rarely
exists, and spending less memory for the same fidelity is never worse).

Levels never rise except by recompute: a chunk already at q4 can stay q4 or drop to q2 but never
return to q8; ``raw``/``fp16``/``bf16`` count as above q8. So a chunk targeted at level ``w`` ends at
the lighter of ``levels[w]`` and its current level, and the enumeration scores exactly that (the
current level's ratio is used when it is the lighter). A new chunk (current ``None``) is ``raw``.

The last chunk, when partial, stays at its current level (``raw`` for a chunk still being written)
and is excluded from the ranking and the budget: it is still growing and will be planned once full.

Budget infeasible (``ratio_global`` below the lightest reachable mean, e.g. 0.2 with q2 = 0.25): the
plan puts every chunk at its lightest allowed level, the least mean ratio there is, and says
``feasible=False``. Ties between threshold tuples (equal fidelity up to rounding): the lower mean
ratio wins, then the lexicographically smallest thresholds, so plans are deterministic.

Pressure (``room``). The configured ratio is a floor, not a target: while memory holds every
context in use at ``raw``, lowering chunks loses accuracy for nothing. The caller passes the mean
ratio memory allows now (the pool against the raw bytes of the contexts it serves); the plan's bound is
the larger of that and the configured ratio. Without pressure nothing is lowered; between ``raw``
and ``q8`` the densest chunks stay raw and the rest go to q8 (:func:`plan_roomy`); below ``q8``'s
ratio the tolerance enumeration runs at that bound, reaching the configured ratio at full pressure.

Static mode (baselines): every chunk at one level (``q8`` for ``vllm-sq`` and ``llms-no-compress``,
``raw`` for lossless), still never rising. Mode ``none`` is static ``raw``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

import numpy as np

from scheduler import levels as L
from scheduler.errors import UnknownCompressionModeError
from scheduler.keys import count

#: upper bound on scored threshold tuples ((n+1)^(m-1)); 3 levels: up to 1023 chunks (16K tokens)
MAX_GRID = 1 << 20
#: slack when comparing a mean ratio to the global ratio (ratios are dyadic: sums are exact)
_RATIO_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class CompressionConfig:
    """How a context's chunk levels are chosen (one per policy; see ``scheduler.policies``)."""

    mode: str = "tolerance"
    """a key of :data:`MODES`: ``tolerance`` (LLMS), ``static`` (one level), ``none`` (static raw)"""
    global_ratio: float = 0.5
    """tolerance mode: bound on the mean ratio (nominal bits / 8) over a context's full chunks"""
    levels: tuple[str, ...] = L.DEFAULT_PLAN_LEVELS
    """tolerance mode: the levels a chunk may get, strictly heaviest first"""
    static_level: str = "raw"
    """static mode: the one level every chunk gets (unless already lighter)"""
    dtype: str = "float32"
    """compute dtype name; only gives ``raw`` its nominal bits (32 for float32)"""
    weights: str = "measured"
    """tolerance mode: the fidelity of a level, a key of :data:`WEIGHTS` (see the module docstring)"""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise UnknownCompressionModeError("compression mode", self.mode, MODES)
        _weight_fn(self.weights)
        if not (np.isfinite(self.global_ratio) and self.global_ratio > 0):
            raise ValueError(f"global_ratio must be a finite number > 0, got {self.global_ratio!r}")
        object.__setattr__(self, "levels", L.check_plan_levels(self.levels))
        L.check_level(self.static_level)
        L.nominal_bits("raw", self.dtype)  # validates dtype


@dataclass(frozen=True, slots=True)
class CompressionPlan:
    """A level for every chunk of one context, and what it costs and keeps."""

    levels: tuple[str, ...]
    """level per chunk, chunk order, including a partial last chunk"""
    changed: tuple[int, ...]
    """chunk indices whose level differs from the current one (``None`` counts as ``raw``): the
    caller re-quantizes and rewrites exactly these"""
    thresholds: tuple[int, ...]
    """rank cut points ``(t1, ..., t_{m-1})`` chosen (ranks ``[0, t1)`` target the heaviest level);
    ``()`` in static mode"""
    objective: float
    """density-weighted fidelity ``sum F(level_i) * D_i`` over budgeted chunks (density units)"""
    mean_ratio: float
    """mean ratio (nominal bits / 8) over budgeted chunks; 0.0 when there are none"""
    global_ratio: float | None
    """the bound planned under; ``None`` in static mode"""
    feasible: bool
    """``mean_ratio <= global_ratio``; False only when no threshold tuple meets it (always True in
    static mode)"""
    n_budget: int
    """chunks counted in the ranking and the budget (all but a partial last one)"""
    mode: str
    """the mode that made the plan (a key of :data:`MODES`)"""


#: fidelity weights by name: level, compute dtype -> F(level)
WEIGHTS: dict[str, Callable[[str, str], float]] = {
    "measured": lambda level, dtype: L.fidelity(level),
    "ratio": L.ratio,
}


def _weight_fn(name: str) -> Callable[[str, str], float]:
    try:
        return WEIGHTS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown fidelity weights {name!r}; valid: {', '.join(WEIGHTS)}") from None


def _as_densities(densities: Sequence[float] | np.ndarray) -> np.ndarray:
    d = np.asarray(densities, dtype=np.float64)
    if d.ndim != 1:
        raise ValueError(f"densities must be 1-D (one per chunk), got shape {d.shape}")
    if not np.all(np.isfinite(d)) or np.any(d < 0):
        raise ValueError("densities must be finite and >= 0")
    return d


def _as_current(current: Sequence[str | None] | None, n: int) -> list[str]:
    if current is None:
        return ["raw"] * n
    cur = ["raw" if c is None else L.check_level(c) for c in current]
    if len(cur) != n:
        raise ValueError(f"{len(cur)} current levels for {n} chunks")
    return cur


def _budget_count(n: int, partial_last: bool) -> int:
    if partial_last and n == 0:
        raise ValueError("partial_last=True needs at least one chunk")
    return n - 1 if partial_last else n


def evaluate(levels: Sequence[str], densities: Sequence[float] | np.ndarray, *,
             partial_last: bool = False, dtype: str = "float32", weights: str = "measured"
             ) -> tuple[float, float]:
    """``(objective, mean_ratio)`` of a level assignment, over budgeted chunks (see module docs)."""
    d = _as_densities(densities)
    if len(levels) != len(d):
        raise ValueError(f"{len(levels)} levels for {len(d)} densities")
    nb = _budget_count(len(d), partial_last)
    f = _weight_fn(weights)
    w = np.array([f(lv, dtype) for lv in levels[:nb]], dtype=np.float64)
    r = np.array([L.ratio(lv, dtype) for lv in levels[:nb]], dtype=np.float64)
    return float(w @ d[:nb]), (float(r.mean()) if nb else 0.0)


def _finish(mode: str, out: list[str], cur: list[str], d: np.ndarray, nb: int,
            thresholds: tuple[int, ...], global_ratio: float | None, feasible: bool,
            dtype: str, weights: str = "measured") -> CompressionPlan:
    objective, mean_ratio = evaluate(out, d, partial_last=nb < len(d), dtype=dtype, weights=weights)
    changed = tuple(i for i, (a, b) in enumerate(zip(out, cur)) if a != b)
    return CompressionPlan(tuple(out), changed, thresholds, objective, mean_ratio, global_ratio,
                           feasible, nb, mode)


def _best_thresholds(d: np.ndarray, eff: np.ndarray, budget: float, wts: np.ndarray | None = None
                     ) -> tuple[tuple[int, ...], bool]:
    """Exact search over threshold tuples.

    ``d``: [n] densities in rank order; ``eff``: [m, n] ratio the chunk at each rank ends at when
    targeted at level ``w`` (already the lighter of target and current); ``wts``: [m, n] the
    fidelity of that level (default ``eff``). ``budget`` is the bound on the *sum* of ratios
    (``global_ratio * n``). Returns (thresholds, feasible).
    """
    m, n = eff.shape
    k, size = m - 1, n + 1
    if size ** k > MAX_GRID:
        raise ValueError(f"{n} chunks x {m} levels is {size ** k} threshold tuples, over the exact-"
                         f"enumeration limit {MAX_GRID}; plan a shorter context or fewer levels")
    # fid[w, t]: fidelity of ranks [0, t) all targeted at level w; cnt[w, t]: their ratio sum
    fid = np.zeros((m, size))
    np.cumsum((eff if wts is None else wts) * d, axis=1, out=fid[:, 1:])
    cnt = np.zeros((m, size))
    np.cumsum(eff, axis=1, out=cnt[:, 1:])

    def axis(j: int) -> np.ndarray:  # threshold t_{j+1} varying along axis j of the grid
        shape = [1] * k
        shape[j] = size
        return np.arange(size).reshape(shape)

    bounds: list[np.ndarray | int] = [0, *(axis(j) for j in range(k)), n]
    grid = (size,) * k
    obj = np.zeros(grid)
    tot = np.zeros(grid)
    for w in range(m):  # segment w: ranks [bounds[w], bounds[w+1])
        lo, hi = bounds[w], bounds[w + 1]
        obj = obj + (fid[w][hi] - fid[w][lo])
        tot = tot + (cnt[w][hi] - cnt[w][lo])
    ok = np.ones(grid, dtype=bool)
    for j in range(k - 1):
        ok &= axis(j) <= axis(j + 1)
    obj, tot, ok = obj.ravel(), tot.ravel(), ok.ravel()
    feas = ok & (tot <= budget + _RATIO_EPS)
    if not feas.any():
        return (0,) * k, False  # every chunk at its lightest allowed level: the least mean there is
    best = obj[feas].max()
    tol = 1e-9 * float(d.sum())  # cumulative sums differ from exact sums by rounding only
    cand = np.flatnonzero(feas & (obj >= best - tol))
    pick = int(cand[np.argmin(tot[cand])])  # first minimum: smallest thresholds lexicographically
    return tuple(int(t) for t in np.unravel_index(pick, grid)), True


def plan_tolerance(densities: Sequence[float] | np.ndarray, *, global_ratio: float = 0.5,
                   levels: Sequence[str] = L.DEFAULT_PLAN_LEVELS,
                   current: Sequence[str | None] | None = None, partial_last: bool = False,
                   dtype: str = "float32", weights: str = "measured") -> CompressionPlan:
    """Tolerance-aware plan (LLMS Eq. 2-3 with fidelity weights; see the module docstring).

    ``densities``: one per chunk in chunk order (a partial last chunk included, flagged by
    ``partial_last``); ``current``: each chunk's level now (``None`` = new, raw).
    """
    d = _as_densities(densities)
    cur = _as_current(current, len(d))
    lv = L.check_plan_levels(levels)
    if not (np.isfinite(global_ratio) and global_ratio > 0):
        raise ValueError(f"global_ratio must be a finite number > 0, got {global_ratio!r}")
    nb = _budget_count(len(d), partial_last)
    order = np.argsort(-d[:nb], kind="stable")  # rank -> chunk index; equal densities keep chunk order
    cur_rank = np.array([L.rank(cur[i]) for i in order], dtype=np.int64)
    cur_ratio = np.array([L.ratio(cur[i], dtype) for i in order], dtype=np.float64)
    f = _weight_fn(weights)
    cur_fid = np.array([f(cur[i], dtype) for i in order], dtype=np.float64)
    eff = np.stack([np.where(L.rank(w) <= cur_rank, L.ratio(w, dtype), cur_ratio) for w in lv]) \
        if nb else np.zeros((len(lv), 0))
    wts = np.stack([np.where(L.rank(w) <= cur_rank, f(w, dtype), cur_fid) for w in lv]) \
        if nb else np.zeros((len(lv), 0))
    thresholds, feasible = _best_thresholds(d[order], eff, global_ratio * nb, wts)
    out = list(cur)  # a partial last chunk keeps its level
    target = np.searchsorted(np.array(thresholds, dtype=np.int64), np.arange(nb), side="right")
    for r, i in enumerate(order):
        out[int(i)] = L.lighter(lv[int(target[r])], cur[int(i)])
    return _finish("tolerance", out, cur, d, nb, thresholds, global_ratio, feasible, dtype, weights)


def plan_roomy(densities: Sequence[float] | np.ndarray, *, room: float, levels: Sequence[str] = L.DEFAULT_PLAN_LEVELS,
               current: Sequence[str | None] | None = None, partial_last: bool = False,
               dtype: str = "float32", weights: str = "measured") -> CompressionPlan:
    """A plan when memory allows a mean ratio ``room`` above the heaviest planned level's (``q8``):
    every chunk at ``levels[0]`` or lighter, then, densest first, chunks heavier than that keep their
    level (``raw`` for a new chunk) while the mean stays within ``room``. At ``room >= ratio(raw)``
    nothing is lowered.

    Why this order: per unit of ratio spent, lifting a chunk from q4 to q8 buys ten times the measured
    fidelity that lifting it from q8 to raw does (:data:`scheduler.levels.FIDELITY`), so the budget goes
    to q8 everywhere before it goes to raw anywhere, and raw goes to the densest chunks first.
    """
    d = _as_densities(densities)
    cur = _as_current(current, len(d))
    lv = L.check_plan_levels(levels)
    nb = _budget_count(len(d), partial_last)
    out = list(cur)
    for i in range(nb):
        out[i] = L.lighter(lv[0], cur[i])
    spare = room * nb - sum(L.ratio(out[i], dtype) for i in range(nb))
    for i in (int(j) for j in np.argsort(-d[:nb], kind="stable")):
        lift = L.ratio(cur[i], dtype) - L.ratio(out[i], dtype)
        if lift > 0 and lift <= spare + _RATIO_EPS:
            out[i] = cur[i]  # kept at its level (raw for a new chunk)
            spare -= lift
    return _finish("tolerance", out, cur, d, nb, (), room, True, dtype, weights)


def plan_static(level: str, n_chunks: int, *, densities: Sequence[float] | np.ndarray | None = None,
                current: Sequence[str | None] | None = None, partial_last: bool = False,
                dtype: str = "float32", mode: str = "static") -> CompressionPlan:
    """Every chunk at ``level`` unless already lighter (baselines: ``q8``, or ``raw`` = lossless).

    ``densities`` only feed the reported objective (zeros when omitted). A partial last chunk keeps
    its level, as in tolerance mode.
    """
    L.check_level(level)
    n_chunks = count("n_chunks", n_chunks)
    d = np.zeros(n_chunks) if densities is None else _as_densities(densities)
    if len(d) != n_chunks:
        raise ValueError(f"{len(d)} densities for {n_chunks} chunks")
    cur = _as_current(current, n_chunks)
    nb = _budget_count(n_chunks, partial_last)
    out = [L.lighter(level, c) for c in cur[:nb]] + cur[nb:]
    return _finish(mode, out, cur, d, nb, (), None, True, dtype)


def _tolerance(cfg: CompressionConfig, d: np.ndarray, current, partial_last: bool,
               room: float | None = None) -> CompressionPlan:
    if room is not None and room > L.ratio(cfg.levels[0], cfg.dtype):
        return plan_roomy(d, room=room, levels=cfg.levels, current=current, partial_last=partial_last,
                          dtype=cfg.dtype, weights=cfg.weights)
    ratio = cfg.global_ratio if room is None else max(cfg.global_ratio, room)
    return plan_tolerance(d, global_ratio=ratio, levels=cfg.levels, current=current,
                          partial_last=partial_last, dtype=cfg.dtype, weights=cfg.weights)


def _static(cfg: CompressionConfig, d: np.ndarray, current, partial_last: bool,
            room: float | None = None) -> CompressionPlan:
    return plan_static(cfg.static_level, len(d), densities=d, current=current,
                       partial_last=partial_last, dtype=cfg.dtype)


def _none(cfg: CompressionConfig, d: np.ndarray, current, partial_last: bool,
          room: float | None = None) -> CompressionPlan:
    return plan_static("raw", len(d), densities=d, current=current, partial_last=partial_last,
                       dtype=cfg.dtype, mode="none")


#: compression mode name -> planner (config, densities, current levels, partial_last, room) -> plan;
#: only tolerance mode reads ``room`` (the baselines keep their one level whatever memory allows)
MODES: dict[str, Callable[[CompressionConfig, np.ndarray, Sequence[str | None] | None, bool, float | None],
                          CompressionPlan]] = {
    "tolerance": _tolerance,
    "static": _static,
    "none": _none,
}


class CompressionPlanner:
    """A :class:`CompressionConfig` bound to its mode: ``plan(...)`` for one context at a time."""

    __slots__ = ("config", "_fn")

    def __init__(self, config: CompressionConfig | None = None) -> None:
        self.config = config or CompressionConfig()  # validated in its __post_init__
        self._fn = MODES[self.config.mode]

    def plan(self, densities: Sequence[float] | np.ndarray,
             current: Sequence[str | None] | None = None, *,
             partial_last: bool = False, pinned: Collection[int] = (),
             room: float | None = None) -> CompressionPlan:
        """Plan levels for one context's chunks (see :func:`plan_tolerance` / :func:`plan_static`).

        ``room``: the mean ratio memory allows now (the pool against the raw bytes of what is in it,
        the caller's measure of pressure); ``None`` plans at the configured ratio. In tolerance mode
        the plan's bound is the larger of the two: at ``room >= ratio(raw)`` (no pressure) nothing is
        lowered, above ``q8``'s ratio :func:`plan_roomy` keeps the densest chunks raw, below it
        :func:`plan_tolerance` plans at ``room``, down to the configured ratio as pressure rises.

        ``pinned``: indices of chunks pinned exact. They stay ``raw`` whatever the mode, outside the
        ranking and the budget (as a partial last chunk is); their current level must be ``raw``, since
        a lowered chunk only comes back by recompute (the caller's to arrange)."""
        d = _as_densities(densities)
        if not pinned:
            return self._fn(self.config, d, current, partial_last, room)
        n = len(d)
        cur = _as_current(current, n)
        pins = set(pinned)
        for i in pins:
            if not (type(i) is int and 0 <= i < n):
                raise ValueError(f"pinned chunk {i!r} is not one of the {n} chunks")
            if cur[i] != "raw":
                raise ValueError(f"pinned chunk {i} is at {cur[i]}: a pinned-exact chunk is never lowered")
        keep = [i for i in range(n) if i not in pins]
        if not keep:
            return CompressionPlan(tuple(cur), (), (), 0.0, 0.0, None, True, 0, self.config.mode)
        sub = self._fn(self.config, d[keep], [cur[i] for i in keep], partial_last and keep[-1] == n - 1, room)
        levels = list(cur)
        for k, i in enumerate(keep):
            levels[i] = sub.levels[k]
        return replace(sub, levels=tuple(levels), changed=tuple(keep[k] for k in sub.changed))
