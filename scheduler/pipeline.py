"""Swap-recompute pipeline planner (LLMS §3.3, Eq. 4): which missing chunks to read, which to recompute.

Cost models fitted from a one-shot profile (:class:`CostProfile`), corrected online from the restores
the service runs (:class:`OnlineCosts`), and the planner over them (:func:`plan_restore`). This module
deliberately knows nothing about disks, files, the model, actors or clocks: the caller measures
(profile points, stage seconds), keeps profiles where it likes (as :meth:`CostProfile.to_json` text;
``actors.profiling`` caches them in files) and carries the plan out.

Restoring a context, the IO worker reads some missing chunks from disk while the recompute worker
recomputes the others from their token ids, layer by layer, overlapped (Fig. 8). The paper's planner
minimises

    pipelineDelay = max(T_re(#recomputed), T_io(bytes loaded))                              (Eq. 4)

with linear cost models fitted from a one-shot profile (§3.3 i): ``T_re(x) = a + b*x`` seconds
for ``x`` chunks and ``T_io(m) = c + d*m`` seconds for ``m`` bytes as stored on disk. Doing no work
costs nothing: ``T(0) = 0`` (the intercept is the fixed cost of starting a side of the pipeline,
not paid when that side is idle). Fits are non-negative least squares, so both are non-decreasing.

The paper's T_io counts reading only. Here every chunk read, and every resident chunk, must also be
de-quantized into the compute dtype before the switch ends (docs/design.md §1), and that cost goes by
the chunk more than by the byte: its output is a whole chunk of compute-dtype K/V whatever the
level, while the stored bytes shrink 8x from raw to q2 (and q2 de-quantizes slowest). So the profile
also measures ``T_dec``, a cost per chunk for each level, and a restore's predicted time adds
``T_dec`` of its resident chunks (decoded before the pipeline starts).

Which side of the pipeline pays ``T_dec`` follows the implementation (actors/recompute.py): the
reader only reads; the consumer de-quantizes each streamed layer group and then recomputes the same
layers, one after the other on one thread. So the two stages are

    A = T_io(bytes loaded)                       (the reader)
    B = T_re(#recomputed) + T_dec(chunks loaded)  (the consumer)

and with the layers streamed in ``G`` groups a two-stage pipeline takes

    T = max(A, B) + min(A, B) / G                                                    (Eq. 4')

(the faster stage hides behind the slower one except for one group's worth: the first group's read
before the consumer can start, or the last group's decode and recompute after the reads end).
``G = 1`` is no overlap (``A + B``); ``G -> inf`` is the paper's ``max``, which underestimates a
streamed restore by the one group it cannot hide.

Planning (§3.4 ii: recompute the heaviest, least-compressed chunks first). Chunks whose file is
missing or corrupt are always recomputed (``must_recompute``: the Fault primitive). The others are
sorted by what loading each one costs, ``d*nbytes + T_dec(its level)`` (with no decode costs:
by stored bytes), largest first (ties: heavier level, then chunk index), and ``x = 0..n`` is
scanned: recompute the first ``x``, load the rest, keep the ``x`` of least Eq. 4'. With no decode
costs ``B`` depends only on the count and ``A`` only on the bytes loaded, so for every count the
largest chunks are the best ones to recompute and the scan is optimal over *all* subsets
(property-tested). With decode costs a chunk weighs on both stages and no single order is optimal
for every instance; the scan is then a heuristic, tested never to be worse than recomputing
nothing or everything. On a slow disk the dearest to load are the heaviest chunks, as the paper
says; from a fast one they can be the lightest (q2 de-quantizes slowest). Ties between counts go to
the smaller ``x`` (less CPU taken from the model). With ``allow_recompute=False`` (pipeline off:
``llms-no-pipeline`` and the swap baselines) everything with a file is loaded.

Deliberately not modelled: recompute of a late chunk attends to more tokens than an early one
(``T_re`` is linear in the count only, as in the paper).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from scheduler import levels as L
from scheduler.keys import count

#: format version of serialised profiles; a profile of another version does not parse
#: (2: T_io is reading only, plus the de-quantization model T_dec)
PROFILE_VERSION = 2


@dataclass(frozen=True, slots=True)
class LinearCost:
    """``T(x) = intercept + slope * x`` for ``x > 0``, ``T(0) = 0``; seconds."""

    intercept: float  # fixed cost of doing any work at all, seconds (>= 0)
    slope: float  # cost per unit, seconds per chunk (recompute) or per byte (IO) (>= 0)

    def __post_init__(self) -> None:
        for name in ("intercept", "slope"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {v!r}")

    def __call__(self, x: float) -> float:
        return 0.0 if x <= 0 else self.intercept + self.slope * x

    def many(self, xs: np.ndarray) -> np.ndarray:
        """Vectorised ``__call__``."""
        xs = np.asarray(xs, dtype=np.float64)
        return np.where(xs > 0, self.intercept + self.slope * xs, 0.0)


def _points(points: Iterable[Sequence[float]], what: str) -> tuple[tuple[float, float], ...]:
    pts = tuple((float(x), float(y)) for x, y in points)
    if any(not (math.isfinite(x) and math.isfinite(y)) or x < 0 or y < 0 for x, y in pts):
        raise ValueError(f"{what} points must be finite (x, seconds) pairs >= 0")
    if len({x for x, _ in pts}) < 2:
        raise ValueError(f"{what} profile needs points at two or more distinct sizes, got {pts}")
    return pts


def fit_linear(points: Iterable[Sequence[float]], what: str = "cost") -> LinearCost:
    """Least-squares ``y = a + b*x`` with ``a, b >= 0`` from ``(x, y)`` points (two distinct x or more).

    Non-negative least squares in two unknowns is exact by faces: the unconstrained fit when it is
    non-negative, else the better of the fits with ``a = 0`` or ``b = 0`` (each clamped at 0).
    """
    pts = np.array(_points(points, what), dtype=np.float64)
    x, y = pts[:, 0], pts[:, 1]
    (a, b), *_ = np.linalg.lstsq(np.column_stack([np.ones_like(x), x]), y, rcond=None)
    if a >= 0 and b >= 0:
        return LinearCost(float(a), float(b))
    faces = [(0.0, max(0.0, float(x @ y / (x @ x)))), (max(0.0, float(y.mean())), 0.0)]
    a, b = min(faces, key=lambda ab: float(((ab[0] + ab[1] * x - y) ** 2).sum()))
    return LinearCost(a, b)


@dataclass(frozen=True, slots=True)
class DecodeCost:
    """``T_dec`` = the sum over chunks of a per-level cost: de-quantizing one chunk into the compute
    dtype (seconds). No intercept: decoding is per chunk, there is nothing to start."""

    per_level: tuple[tuple[str, float], ...] = ()  # (level, seconds per chunk), each >= 0

    def __post_init__(self) -> None:
        for level, v in self.per_level:
            L.check_level(level)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"decode cost of {level} must be finite and >= 0, got {v!r}")

    def chunk(self, level: str) -> float:
        """Seconds to de-quantize one chunk stored at ``level``; a level the profile did not
        measure costs as much as the dearest one measured (0 with no measurements)."""
        for lv, v in self.per_level:
            if lv == level:
                return v
        return max((v for _, v in self.per_level), default=0.0)

    def __call__(self, levels: Iterable[str]) -> float:
        return sum(self.chunk(lv) for lv in levels)


def fit_decode(points: Iterable[Sequence]) -> DecodeCost:
    """Per-level cost per chunk from ``(level, chunks, seconds)`` points: least squares through
    the origin, ``sum(k*y) / sum(k*k)`` over each level's points."""
    acc: dict[str, list[float]] = {}
    for level, k, y in points:
        L.check_level(level)
        k, y = float(k), float(y)
        if not (math.isfinite(k) and math.isfinite(y) and k > 0 and y >= 0):
            raise ValueError(f"decode points must be (level, chunks > 0, seconds >= 0), got {(level, k, y)}")
        a = acc.setdefault(level, [0.0, 0.0])
        a[0] += k * y
        a[1] += k * k
    return DecodeCost(tuple((lv, ky / kk) for lv, (ky, kk) in sorted(acc.items())))


@dataclass(frozen=True, slots=True)
class CostProfile:
    """Fitted pipeline cost models of one machine, model and storage throttle."""

    recompute: LinearCost  # T_re(x): seconds to recompute x chunks
    io: LinearCost  # T_io(m): seconds to read m bytes as stored on disk
    recompute_points: tuple[tuple[float, float], ...] = ()  # measured (chunks, seconds)
    io_points: tuple[tuple[float, float], ...] = ()  # measured (bytes, seconds)
    decode: DecodeCost = DecodeCost()  # T_dec: seconds to de-quantize chunks, by level
    decode_points: tuple[tuple[str, float, float], ...] = ()  # measured (level, chunks, seconds)

    @classmethod
    def fit(cls, recompute_points: Iterable[Sequence[float]], io_points: Iterable[Sequence[float]],
            decode_points: Iterable[Sequence[float]] = ()) -> CostProfile:
        """Fit the models from measured points (see :func:`fit_linear`, :func:`fit_decode`); no
        decode points: de-quantization is taken as free (or folded into ``io_points``)."""
        rp, ip = _points(recompute_points, "recompute"), _points(io_points, "io")
        dp = tuple((str(lv), float(k), float(y)) for lv, k, y in decode_points)
        dec = fit_decode(dp)
        return cls(fit_linear(rp, "recompute"), fit_linear(ip, "io"), rp, ip, dec, dp)

    def to_json(self) -> str:
        return json.dumps({
            "version": PROFILE_VERSION,
            "recompute": {**asdict(self.recompute), "points": self.recompute_points},
            "io": {**asdict(self.io), "points": self.io_points},
            "decode": {"per_level": dict(self.decode.per_level), "points": self.decode_points},
        }, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CostProfile:
        """Parse :meth:`to_json` output; ``ValueError`` on another version or a malformed document."""
        try:
            doc = json.loads(text)
            if doc.get("version") != PROFILE_VERSION:
                raise ValueError(f"profile version {doc.get('version')!r}, this code reads "
                                 f"{PROFILE_VERSION}")
            parts = {}
            for side in ("recompute", "io"):
                d = doc[side]
                pts = tuple((float(x), float(y)) for x, y in d["points"])
                parts[side] = (LinearCost(float(d["intercept"]), float(d["slope"])), pts)
            d = doc["decode"]
            dec = DecodeCost(tuple((str(lv), float(v)) for lv, v in sorted(d["per_level"].items())))
            dpts = tuple((str(lv), float(k), float(y)) for lv, k, y in d["points"])
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
            raise ValueError(f"malformed cost profile: {e}") from e
        return cls(parts["recompute"][0], parts["io"][0], parts["recompute"][1], parts["io"][1], dec, dpts)


@dataclass(frozen=True, slots=True)
class MissingChunk:
    """A chunk of the context being restored that is not resident."""

    index: int  # chunk index in its context
    level: str  # level of its on-disk copy (what loading it gives back)
    nbytes: int  # bytes as stored on disk, what reading it costs; bytes


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """Which missing chunks to read and which to recompute, and the predicted times."""

    load: tuple[int, ...]  # chunk indices to read from disk, ascending
    recompute: tuple[int, ...]  # chunk indices to recompute from token ids, ascending
    load_bytes: int  # bytes read, as stored; bytes
    t_recompute: float  # predicted T_re(len(recompute)), seconds
    t_io: float  # predicted T_io(load_bytes): reading, seconds
    t_decode: float  # predicted T_dec(loaded chunks): de-quantizing them on the consumer, seconds
    predicted: float  # predicted pipeline delay, Eq. 4' over t_io and t_recompute + t_decode; seconds
    forced: int  # how many of ``recompute`` had no usable file (must_recompute)
    groups: int = 1  # layer groups the pipeline was planned with


def pipeline_delay(reader, consumer, groups: int):
    """Eq. 4': a two-stage pipeline of ``groups`` equal groups, stage totals ``reader`` and
    ``consumer`` (seconds; numpy arrays work elementwise)."""
    return np.maximum(reader, consumer) + np.minimum(reader, consumer) / groups


def plan_restore(missing: Sequence[MissingChunk], profile: CostProfile, *,
                 must_recompute: Iterable[int] = (), allow_recompute: bool = True,
                 groups: int = 1) -> RestorePlan:
    """Split ``missing`` into load and recompute minimising Eq. 4' over ``groups`` streamed layer
    groups (see the module docstring)."""
    count("groups", groups, 1)
    by_index: dict[int, MissingChunk] = {}
    for c in missing:
        i = count("chunk index", c.index)
        L.check_level(c.level)
        count("nbytes", c.nbytes)
        if i in by_index:
            raise ValueError(f"chunk {i} listed twice")
        by_index[i] = c
    forced = {count("chunk index", i) for i in must_recompute}
    if not forced <= by_index.keys():
        raise ValueError(f"must_recompute names chunks that are not missing: "
                         f"{sorted(forced - by_index.keys())}")
    d = profile.io.slope
    optional = sorted((c for i, c in by_index.items() if i not in forced),
                      key=lambda c: (-(d * c.nbytes + profile.decode.chunk(c.level)), -c.nbytes,
                                     -L.rank(c.level), c.index))
    sizes = np.array([c.nbytes for c in optional], dtype=np.float64)
    decs = np.array([profile.decode.chunk(c.level) for c in optional], dtype=np.float64)
    # xs[j] = j optional chunks recomputed (the j dearest to load); what is loaded shrinks as j grows
    xs = np.arange(len(optional) + 1) if allow_recompute else np.zeros(1, dtype=np.int64)
    left = sizes.sum() - np.concatenate([[0.0], np.cumsum(sizes)])[xs]
    left_dec = decs.sum() - np.concatenate([[0.0], np.cumsum(decs)])[xs]
    loading = len(optional) - xs > 0
    t_io = np.where(loading, profile.io.many(left), 0.0)
    t_cons = profile.recompute.many(xs + len(forced)) + np.where(loading, left_dec, 0.0)
    x = int(xs[int(np.argmin(pipeline_delay(t_io, t_cons, groups)))])  # first minimum: fewest recomputed
    recompute = sorted(forced | {c.index for c in optional[:x]})
    load = sorted(c.index for c in optional[x:])
    load_bytes = sum(by_index[i].nbytes for i in load)
    t_r = profile.recompute(len(recompute))
    t_i = profile.io(load_bytes) if load else 0.0
    t_d = profile.decode(by_index[i].level for i in load)
    return RestorePlan(tuple(load), tuple(recompute), load_bytes, t_r, t_i, t_d,
                       float(pipeline_delay(t_i, t_r + t_d, groups)), len(forced), groups)


class RestoreLog:
    """(predicted, measured) restore times, for judging the cost model; seconds.

    Keeps the last ``max_records`` pairs (all when ``None``).
    """

    __slots__ = ("_pairs",)

    def __init__(self, max_records: int | None = None) -> None:
        if max_records is not None:
            count("max_records", max_records, 1)
        self._pairs: deque[tuple[float, float]] = deque(maxlen=max_records)  # (predicted, measured)

    def __len__(self) -> int:
        return len(self._pairs)

    @property
    def pairs(self) -> tuple[tuple[float, float], ...]:
        return tuple(self._pairs)

    def record(self, predicted: float, measured: float) -> None:
        """Add one restore's predicted and measured seconds (both > 0: a ratio is taken)."""
        p, m = float(predicted), float(measured)
        if not (math.isfinite(p) and math.isfinite(m) and p > 0 and m > 0):
            raise ValueError(f"predicted and measured must be finite seconds > 0, got {p!r}, {m!r}")
        self._pairs.append((p, m))

    def median_abs_log_error(self) -> float | None:
        """Median of ``|ln(measured / predicted)|`` (0.1 ~ 10 % off); ``None`` with no records."""
        if not self._pairs:
            return None
        return statistics.median(abs(math.log(m / p)) for p, m in self._pairs)


def layer_group_size(n_layers: int, per_ref_s: float, io_s_per_byte: float, load_bytes: int,
                     ref_share: float = 0.1) -> int:
    """Layers per streamed group for a restore that loads ``load_bytes``: the fewest layers whose read
    takes at least ``per_ref_s / ref_share`` (so handing a group over costs under a tenth of reading
    it), which keeps the most groups, and so the most IO/recompute overlap, at that cost.

    One group of everything when nothing is loaded or the costs are unknown (zero). The same rule
    sizes the batches of whole chunks an executor's restore streams in (``n_layers``: the chunks)."""
    count("n_layers", n_layers, 1)
    if load_bytes <= 0 or io_s_per_byte <= 0 or per_ref_s <= 0:
        return n_layers
    per_layer_s = io_s_per_byte * load_bytes / n_layers
    return max(1, min(n_layers, math.ceil(per_ref_s / ref_share / per_layer_s)))


class ReadRate:
    """Seconds per byte of the IO worker's reads as last observed (exponentially weighted), seeded by
    the profile: the profile's throttle may not match the running store's."""

    def __init__(self, s_per_byte: float, weight: float = 0.3) -> None:
        self.s_per_byte = max(0.0, float(s_per_byte))
        self.weight = weight

    def observe(self, seconds: float, nbytes: int) -> None:
        if seconds > 0 and nbytes > 0:
            x = seconds / nbytes
            self.s_per_byte = x if self.s_per_byte <= 0 else (1 - self.weight) * self.s_per_byte + self.weight * x


#: the stages of a restore whose cost models :class:`OnlineCosts` corrects
STAGES = ("io", "decode", "recompute")


def restore_shape(resident: int, loaded: int, recomputed: int) -> str:
    """Which parts a restore has: a subset of "m" (chunks decoded from memory), "l" (loaded),
    "r" (recomputed), in that order; "" for nothing to restore."""
    return "m" * (resident > 0) + "l" * (loaded > 0) + "r" * (recomputed > 0)


class OnlineCosts:
    """The profile's cost models, corrected online from the restores the service actually runs.

    The one-shot profile (§3.3 i) is measured once, on a quiet machine with a throwaway context; later
    the machine may be busier or quieter (on a shared host, memory bandwidth and so de-quantizing
    moves from one hour to the next), the stored chunks differ from the profile's, and composing the stages
    has overheads the formula leaves out. Two corrections, each the median of a log ratio over the
    last ``window`` restores that measured it:

    * a factor per stage (T_io, T_dec, T_re): measured stage seconds over the profile's prediction
      of that stage. :meth:`profile` scales the profile by them, so *planning* follows the machine
      as it is now (if de-quantizing slows down, recomputing becomes relatively cheaper);
    * a residual per restore shape (:func:`restore_shape`): the whole restore's measured seconds over
      the stage-corrected prediction, for what the stage sum misses (overlap, hand-over, waits).
      :meth:`predict` applies it to the planned total; planning does not use it.

    Why a median, not a mean: a restore now and then takes several times its usual time (a lone slow
    read, a neighbour on a shared host), and a mean moved by it mispredicts the next few restores the
    other way; the median ignores a lone outlier and still follows a lasting change within
    ``window // 2 + 1`` restores. Why 25 restores: the slow ones come in spells, which move a short
    median and make it mispredict the usual restores among them; a median of 25 rides out up to 12
    slow ones (the comparison of windows on the same restores is in docs/benchmarks.md). The profile
    counts as one observation of "no correction" until ``window`` restores have pushed it out, so the
    first restore moves the estimate half way. Stages measured under ``min_stage_s`` are not used
    (timer noise), and every log ratio is clamped to ``±ln(max_factor)``. Ray-free, no clock.
    """

    def __init__(self, window: int = 25, *, min_stage_s: float = 2e-4, max_factor: float = 8.0) -> None:
        if not max_factor > 1:
            raise ValueError(f"max_factor must be > 1, got {max_factor!r}")
        self.window = count("window", window, 1)
        self.min_stage_s = float(min_stage_s)
        self.bound = math.log(max_factor)
        self.stage_log: dict[str, float] = {s: 0.0 for s in STAGES}  # ln(measured / profile)
        self.residual_log: dict[str, float] = {}  # shape -> ln(measured / stage-corrected)
        self._seen: dict[str, deque] = {}  # stage or "shape:" + shape -> recent clamped log ratios
        self.observed = 0  # restores observed

    def _update(self, key: str, x: float) -> float:
        """The median of ``key``'s recent clamped log ratios, ``x`` the newest."""
        seen = self._seen.setdefault(key, deque([0.0], maxlen=self.window))
        seen.append(max(-self.bound, min(self.bound, x)))
        return statistics.median(seen)

    def factor(self, stage: str) -> float:
        """The current multiplier of ``stage``'s profile model."""
        return math.exp(self.stage_log[stage])

    def profile(self, base: CostProfile) -> CostProfile:
        """``base`` with T_io, T_dec and T_re scaled by the stage factors (points kept as measured)."""
        fi, fd, fr = (self.factor(s) for s in STAGES)
        if fi == fd == fr == 1.0:
            return base
        scale = lambda c, f: LinearCost(c.intercept * f, c.slope * f)  # noqa: E731
        dec = DecodeCost(tuple((lv, v * fd) for lv, v in base.decode.per_level))
        return CostProfile(scale(base.recompute, fr), scale(base.io, fi), base.recompute_points,
                           base.io_points, dec, base.decode_points)

    def predict(self, shape: str, stage_corrected_s: float) -> float:
        """A restore's prediction: the stage-corrected total times the shape's residual factor (1 for
        a shape not seen yet)."""
        return stage_corrected_s * math.exp(self.residual_log.get(shape, 0.0))

    def observe(self, shape: str, predicted_stages: dict[str, float], measured_stages: dict[str, float],
                stage_corrected_s: float, measured_s: float) -> None:
        """Learn from one restore. ``predicted_stages``: each stage's seconds as planned with
        :meth:`profile` (scaled by the factors in force then, which must be these: no other restore
        observed in between); ``measured_stages``: what each stage took; ``stage_corrected_s``: the
        planned total before the residual; ``measured_s``: the whole restore's wall time."""
        for s in STAGES:
            p, m = predicted_stages.get(s, 0.0), measured_stages.get(s, 0.0)
            if p > 0 and m >= self.min_stage_s:
                raw = p / self.factor(s)  # the profile's own prediction of this stage
                self.stage_log[s] = self._update(s, math.log(m / raw))
        if stage_corrected_s > 0 and measured_s > 0:
            self.residual_log[shape] = self._update("shape:" + shape, math.log(measured_s / stage_corrected_s))
        self.observed += 1

    def state(self) -> dict:
        """The current factors, for metrics and logs."""
        return {"stages": {s: self.factor(s) for s in STAGES},
                "residual": {k: math.exp(v) for k, v in sorted(self.residual_log.items())},
                "observed": self.observed}
