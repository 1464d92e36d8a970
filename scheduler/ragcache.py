"""Policy of the RAG cache (PerCache §4.1-4.3): the QA bank's matching, refresh and eviction, the cache
scheduler's population and conversions, idle detection and the query predictor's triggers.

This module deliberately knows nothing about models, tokenizers, embedding models, files, clocks or
Ray: vectors, chunk ids, sizes and times (seconds on the caller's clock) are given to it, and it
returns decisions (dataclasses) that the caller, the RAG cache and query predictor actors, carries
out. The K/V tree of knowledge chunks and LFU eviction live in :mod:`scheduler.ragtree` and are
re-exported here.

**QA bank.** An entry packs a query (its embedding, its retrieved chunks) and, once decoded, the
answer (PerCache §4.1.1). A user query reuses the answer of the most similar entry when the cosine
similarity is at least ``tau_query`` (§4.2.1: :func:`match_query`). A new document makes an answer
stale when one of its chunks now ranks in the top ``k_refresh`` for the entry's query (§4.1.3:
:func:`refresh_candidates`); a deleted chunk drops the entries that retrieved it
(:func:`dropped_by_deletion`). The bank stays under its cap by LFU (:func:`plan_qa_eviction`).

**Cache scheduler** (§4.3.2, §4.3.3: :class:`CacheScheduler`). A high ``tau_query`` makes QA hits rare,
so decoding predicted queries would be wasted: above the cutoff ``tau_scheduler`` a predicted query is
only prefilled (its K/V enters the tree; its entry is stored without an answer); at or below it, it is
prefilled and decoded. When ``tau_query`` falls to the cutoff or below, the stored queries without an
answer are decoded; when the K/V cap is raised, the entries whose K/V was evicted are prefilled again.
Beyond PerCache, two rules spend the idle budget where it buys most: nothing is decoded for a QA bank
that is off, and (``answers_after_coverage``, with a K/V tree) a question predicted from a passage is
prefilled only, so the budget first covers every passage's K/V; its answer is decoded by the
conversion, which runs when no prediction round is due (every passage has its question), if decoding
pays.

**Idle work** (§4.1.2: :class:`IdleState`). The predictor runs only while no real call is in flight,
none ended for ``idle_after_s``, the app's daily budget of model time is not spent and, optionally,
the device is on mains power. It predicts ``stride`` queries per round, from the knowledge abstract
once documents arrived and none arrived for a quiet period, or from the query history once a burst
of user queries was followed by a quiet period. It drives the one executor at low priority in
slices (:func:`slices`) so that a real call waits at most one slice.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NewType

import numpy as np

from scheduler.keys import count
from scheduler.ragtree import (ROW_FIELDS, ChunkId, KVNode, KVTree, NodeId, UnknownNodeError, lfu_key,
                               plan_lfu_eviction, plan_tree_eviction)

__all__ = [
    "ROW_FIELDS", "ChunkId", "KVNode", "KVTree", "NodeId", "UnknownNodeError", "lfu_key", "plan_lfu_eviction",
    "plan_tree_eviction", "EntryId", "QAEntry", "match_query", "refresh_candidates", "dropped_by_deletion",
    "missing_kv", "plan_qa_eviction", "DEFAULT_TAU_SCHEDULER", "CONVERSION_KINDS", "Populate", "Conversion",
    "CacheScheduler", "REASONS", "PREDICT_KINDS", "IdlePolicy", "Decision", "PredictRound", "IdleState", "utc_day",
    "MAX_PREFILL_SLICE", "Slice", "slices", "STATE_VERSION",
]

#: a QA bank entry's id
EntryId = NewType("EntryId", int)

#: the version of :meth:`CacheScheduler.to_dict` and :meth:`IdleState.to_dict`
STATE_VERSION = 1


# -- QA bank ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class QAEntry:
    """One QA bank entry as the policies see it (the query's text, embedding and answer are the
    caller's)."""

    entry_id: EntryId
    """The QA bank's id of the entry."""
    nbytes: int
    """Bytes it takes in the QA bank (query, embedding, answer), bytes."""
    hits: int = 0
    """User queries it answered (the LFU count)."""
    last_use: float = 0.0
    """When it was stored or last answered a query, seconds on the caller's clock."""
    answered: bool = False
    """It holds an answer; False: stored by a prefill-only population (PerCache §4.3.2)."""
    chunks: tuple[int, ...] = ()
    """The knowledge chunks its query retrieved, in retrieval order: its path in the K/V tree."""


def match_query(query_vec: np.ndarray, bank_vecs: np.ndarray, tau_query: float) -> tuple[int | None, float]:
    """The row of ``bank_vecs`` (``[n, d]``, rows of unit norm) most similar to ``query_vec``
    (``[d]``, any non-zero norm) by cosine, and that similarity; the row is None when the similarity
    is below ``tau_query`` (at least ``tau_query`` matches) or the bank is empty (similarity -1.0,
    the lowest a cosine takes). Ties go to the lowest row."""
    q = np.asarray(query_vec, dtype=np.float64).reshape(-1)  # q: [d]
    bank = np.asarray(bank_vecs, dtype=np.float64)  # bank: [n, d]
    if bank.ndim != 2 or bank.shape[1] != q.shape[0]:
        raise ValueError(f"bank_vecs must be [n, {q.shape[0]}], got {list(bank.shape)}")
    norm = float(np.linalg.norm(q))
    if not norm > 0 or not math.isfinite(norm):
        raise ValueError(f"query_vec must have a finite non-zero norm, got {norm}")
    if not bank.shape[0]:
        return None, -1.0
    sims = bank @ (q / norm)  # sims: [n]
    best = int(np.argmax(sims))
    sim = float(sims[best])
    return (best if sim >= tau_query else None), sim


def refresh_candidates(new_chunks: Iterable[int], rankings: Mapping[int, Sequence[int]],
                       k_refresh: int) -> list[EntryId]:
    """Entries whose answer a new document made stale (PerCache §4.1.3), in the order of ``rankings``.

    ``rankings`` maps an entry id to the chunk ids ranked most similar to its query now that the
    document's chunks are in the knowledge bank, best first; an entry is stale when one of
    ``new_chunks`` is among its first ``k_refresh``. Pass the retrieval's own top-k as ``k_refresh``:
    then a stale entry is exactly one whose query would now retrieve other context.
    """
    k = count("k_refresh", k_refresh, 1)
    new = set(new_chunks)
    return [EntryId(e) for e, ranked in rankings.items() if new.intersection(ranked[:k])]


def dropped_by_deletion(sources: Mapping[int, Iterable[int]], deleted: Iterable[int]) -> list[EntryId]:
    """Entries (id -> the chunk ids its answer came from) that retrieved a deleted chunk: their
    answer drew on text that is gone. In the order of ``sources``."""
    gone = set(deleted)
    return [EntryId(e) for e, chunks in sources.items() if not gone.isdisjoint(chunks)]


def missing_kv(entries: Iterable[QAEntry], tree: KVTree) -> list[QAEntry]:
    """The entries whose path is not wholly cached in ``tree`` (evicted K/V), in their order."""
    return [e for e in entries if len(tree.match(e.chunks)) < len(e.chunks)]


def plan_qa_eviction(entries: Iterable[QAEntry], cap_bytes: int) -> list[EntryId]:
    """Entry ids to evict, LFU first (:func:`lfu_key`), so that the bank's bytes fall to ``cap_bytes``
    or below (PerCache §4.1.1)."""
    return [EntryId(i) for i in plan_lfu_eviction({e.entry_id: e for e in entries}, cap_bytes)]


# -- cache scheduler --------------------------------------------------------------------------------

DEFAULT_TAU_SCHEDULER = 0.85
"""The cutoff: decode predicted queries when ``tau_query <= 0.85``. PerCache §5.5 runs the scheduler at
``tau_query`` 0.85 (decoding pays) and 0.90 (prefill only); the lower of the two as the cutoff, with
"at or below decodes", reproduces both of its cases."""

CONVERSION_KINDS = ("decode", "prefill")


@dataclass(frozen=True, slots=True)
class Populate:
    """How a predicted query populates the cache (PerCache §4.3.2). Its QA entry is stored either way,
    without an answer when it is not decoded. A user's own query is always prefilled and decoded."""

    prefill: bool
    """Run its prefill and insert the new K/V into the tree (always True: the K/V layer is the one
    every retrieval can use)."""
    decode: bool
    """Decode its answer and store it in the QA entry."""


@dataclass(frozen=True, slots=True)
class Conversion:
    """One entry to convert between the cache layers in idle time (PerCache §4.3.3)."""

    kind: str
    """``decode``: decode the entry's query (prefilling what of its K/V is not cached) and store the
    answer; ``prefill``: prefill its query again to restore its evicted K/V."""
    entry_id: EntryId
    """The QA entry."""


class CacheScheduler:
    """Adaptive population and cross-layer conversion (see the module docstring)."""

    def __init__(self, tau_scheduler: float = DEFAULT_TAU_SCHEDULER, *, answers_after_coverage: bool = True) -> None:
        self.tau_scheduler = _similarity("tau_scheduler", tau_scheduler)
        self.answers_after_coverage = bool(answers_after_coverage)
        """Prefill only the questions predicted from passages (their answers come from the conversion's
        decode, after every passage has its question); off: PerCache's rule alone."""
        self.tau_query: float | None = None  # the tau_query :meth:`observe` saw last
        self.cap_bytes: int | None = None  # the K/V cap :meth:`observe` saw last, bytes

    def populate(self, tau_query: float, *, qa_bank: bool = True, kv_tree: bool = True,
                 from_passages: bool = False) -> Populate:
        """Prefill only above the cutoff; prefill and decode at or below it. Prefill only as well when
        there is no QA bank to keep the answer (`qa_bank` False), and, with ``answers_after_coverage``,
        for questions predicted from passages (`from_passages`: a knowledge round's) when a K/V tree
        keeps what the prefill computes (`kv_tree`; without one, deferring would prefill twice)."""
        pays = _similarity("tau_query", tau_query) <= self.tau_scheduler
        deferred = self.answers_after_coverage and from_passages and kv_tree
        return Populate(prefill=True, decode=pays and qa_bank and not deferred)

    def convert(self, tau_query_before: float, tau_query_now: float, entries_without_answer: Iterable[QAEntry],
                evicted_entries: Iterable[QAEntry], storage_grew: bool) -> list[Conversion]:
        """Conversions due after a change of ``tau_query`` or of the K/V cap, most hit first (then the
        most recently used, then the lowest id).

        ``decode`` for each entry without an answer when ``tau_query`` fell from above the cutoff to
        at or below it; ``prefill`` for each entry whose K/V was evicted (:func:`missing_kv`) when
        the cap was raised. An entry due both is listed once, as ``decode`` (which prefills what is
        missing). The trigger is the change: the caller keeps a list it has not finished.
        """
        before = _similarity("tau_query_before", tau_query_before)
        now = _similarity("tau_query_now", tau_query_now)
        due: dict[EntryId, tuple[str, QAEntry]] = {}
        if before > self.tau_scheduler >= now:
            due.update((e.entry_id, ("decode", e)) for e in entries_without_answer)
        if storage_grew:
            for e in evicted_entries:
                due.setdefault(e.entry_id, ("prefill", e))
        order = sorted(due.values(), key=lambda ke: (-ke[1].hits, -ke[1].last_use, ke[1].entry_id))
        return [Conversion(kind, e.entry_id) for kind, e in order]

    def observe(self, tau_query: float, cap_bytes: int, entries_without_answer: Iterable[QAEntry],
                evicted_entries: Iterable[QAEntry]) -> list[Conversion]:
        """:meth:`convert` against the ``tau_query`` and K/V cap seen last (none on the first call),
        which this then remembers (:meth:`to_dict` keeps them across a restart)."""
        tau, cap = _similarity("tau_query", tau_query), count("cap_bytes", cap_bytes)
        before = tau if self.tau_query is None else self.tau_query
        grew = self.cap_bytes is not None and cap > self.cap_bytes
        out = self.convert(before, tau, entries_without_answer, evicted_entries, grew)
        self.tau_query, self.cap_bytes = tau, cap
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain values for JSON or a table row; :meth:`from_dict` reads them back."""
        return {"version": STATE_VERSION, "tau_scheduler": self.tau_scheduler, "tau_query": self.tau_query,
                "cap_bytes": self.cap_bytes, "answers_after_coverage": self.answers_after_coverage}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CacheScheduler:
        _version(d)
        s = cls(d["tau_scheduler"], answers_after_coverage=d.get("answers_after_coverage", True))
        s.tau_query = None if d["tau_query"] is None else _similarity("tau_query", d["tau_query"])
        s.cap_bytes = None if d["cap_bytes"] is None else count("cap_bytes", d["cap_bytes"])
        return s


# -- idle detection and the predictor's triggers ----------------------------------------------------

#: reasons of :class:`Decision`, stable (logs and metrics use them as labels)
OK, BUSY, NOT_IDLE, ON_BATTERY, BUDGET_SPENT = "ok", "busy", "not_idle", "on_battery", "budget_spent"
REASONS = (OK, BUSY, NOT_IDLE, ON_BATTERY, BUDGET_SPENT)
PREDICT_KINDS = ("knowledge", "history")


@dataclass(frozen=True, slots=True)
class IdlePolicy:
    """When the query predictor may work, and how much (PerCache §4.1.2)."""

    idle_after_s: float = 120.0
    """Seconds after the last real call ends before the device counts as idle."""
    require_mains_power: bool = False
    """Work only on mains power (PerCache §5.8: "configurable to charging-only")."""
    unknown_power_is_mains: bool = True
    """Where the power state is unknown (no battery reported, e.g. a wall-powered box), count it as
    mains, so ``require_mains_power`` has no effect there rather than disabling the predictor."""
    budget_model_s_per_day: float = 600.0
    """Model seconds the predictor may spend per app per day, seconds."""
    abstract_quiet_s: float = 60.0
    """Seconds without a new document before the abstract is updated from the new ones."""
    history_quiet_s: float = 60.0
    """Seconds without a user query before a burst of them triggers history-based prediction."""
    burst_queries: int = 3
    """User queries since the last history round needed to trigger the next one."""
    stride: int = 5
    """Queries predicted per round (PerCache §5.7.1 evaluates 1-5; 5 had the lowest latency)."""

    def __post_init__(self) -> None:
        for name in ("idle_after_s", "budget_model_s_per_day", "abstract_quiet_s", "history_quiet_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)!r}")
        count("burst_queries", self.burst_queries, 1)
        count("stride", self.stride, 1)


@dataclass(frozen=True, slots=True)
class Decision:
    """Whether the predictor may work now, and why not."""

    ok: bool
    """It may run its next slice."""
    reason: str
    """``ok``, ``busy`` (a real call is in flight), ``not_idle`` (one ended less than ``idle_after_s``
    ago), ``on_battery`` or ``budget_spent`` (the app's model time for today)."""


@dataclass(frozen=True, slots=True)
class PredictRound:
    """One round of query prediction for an app; :meth:`IdleState.round_done` records it."""

    app: str
    """The app (its knowledge bank and query history)."""
    kind: str
    """``knowledge``: merge the new documents into the abstract, then predict from it; ``history``:
    predict from the recent user queries."""
    stride: int
    """Queries to predict."""
    covered: int
    """New documents (``knowledge``) or user queries (``history``) the round accounts for."""


@dataclass(slots=True)
class _AppState:
    """One app's prediction triggers (what arrived since its last rounds) and budget."""

    docs_pending: int = 0
    """Documents added since the last knowledge round."""
    last_doc: float | None = None
    """When the last document was added, seconds."""
    queries_pending: int = 0
    """User queries since the last history round."""
    last_query: float | None = None
    """When the last user query came, seconds."""
    spent_day: int | None = None
    """The day ``spent_s`` counts (a key of the ``day_of`` function)."""
    spent_s: float = 0.0
    """Model seconds the predictor spent for the app on ``spent_day``, seconds."""


def utc_day(now: float) -> int:
    """The day of ``now`` seconds since the epoch, UTC (the default ``day_of``)."""
    return math.floor(now / 86400)


class IdleState:
    """Idleness, power, per-app budgets and prediction triggers, from the events the caller reports.

    ``day_of`` maps a time to the day whose budget it spends (default :func:`utc_day`; a caller with a
    local calendar passes its own). The power state is ``True`` (mains), ``False`` (battery) or ``None``
    (unknown), as the caller last read it; it and the calls in flight are not persisted (they are
    read again after a restart). With no real call yet, the device counts as idle.
    """

    def __init__(self, policy: IdlePolicy | None = None, *, day_of: Callable[[float], int] = utc_day) -> None:
        self.policy = policy or IdlePolicy()
        self.on_mains: bool | None = None  # the power state the caller last read; None: unknown
        self._day_of = day_of
        self._in_flight = 0  # real calls started and not ended
        self._last_call: float | None = None  # when the last real call started or ended, seconds
        self._apps: dict[str, _AppState] = {}

    # -- events --------------------------------------------------------------------------------------

    def call_started(self, now: float) -> None:
        """A real call began: the predictor yields after its current slice."""
        self._in_flight += 1
        self._last_call = float(now)

    def call_ended(self, now: float) -> None:
        """A real call ended: idleness counts from ``now``."""
        if not self._in_flight:
            raise ValueError("call_ended without a call in flight")
        self._in_flight -= 1
        self._last_call = float(now)

    def calls_seen(self, last_call: float, in_flight: int) -> None:
        """The real calls as another counter saw them (the model executor's): when the last one began or
        ended (0: none yet) and how many run now. Replaces what `call_started`/`call_ended` counted."""
        self._in_flight = count("in_flight", in_flight)
        if last_call > 0:
            self._last_call = max(float(last_call), self._last_call or 0.0)

    def set_power(self, on_mains: bool | None) -> None:
        """The power state read now (``None``: unknown)."""
        if on_mains not in (True, False, None):
            raise ValueError(f"on_mains must be True, False or None, got {on_mains!r}")
        self.on_mains = on_mains

    def spend(self, app: str, seconds: float, now: float) -> None:
        """The predictor used the model ``seconds`` for ``app``, ending at ``now``."""
        if not seconds >= 0:
            raise ValueError(f"seconds must be >= 0, got {seconds!r}")
        self._app(app).spent_s = self.spent_today(app, now) + float(seconds)

    def documents_added(self, app: str, now: float, n: int = 1) -> None:
        """``n`` documents entered ``app``'s knowledge bank at ``now``."""
        t = self._app(app)
        t.docs_pending += count("n", n, 1)
        t.last_doc = float(now)

    def query_seen(self, app: str, now: float) -> None:
        """A user query of ``app`` came at ``now`` (for history-based prediction)."""
        t = self._app(app)
        t.queries_pending += 1
        t.last_query = float(now)

    def round_done(self, round_: PredictRound) -> None:
        """``round_`` finished: what it covered no longer triggers a round (what came meanwhile does)."""
        t = self._app(round_.app)
        if round_.kind == "knowledge":
            t.docs_pending = max(0, t.docs_pending - round_.covered)
        else:
            t.queries_pending = max(0, t.queries_pending - round_.covered)

    # -- decisions -----------------------------------------------------------------------------------

    def spent_today(self, app: str, now: float) -> float:
        """Model seconds spent for ``app`` on ``now``'s day."""
        t = self._app(app)
        if t.spent_day != self._day_of(now):
            t.spent_day, t.spent_s = self._day_of(now), 0.0
        return t.spent_s

    def may_work(self, app: str, now: float) -> Decision:
        """Whether the predictor may run a slice for ``app`` now; the first reason against it wins,
        in the order ``busy``, ``not_idle``, ``on_battery``, ``budget_spent``."""
        p = self.policy
        if self._in_flight:
            return Decision(False, BUSY)
        if self._last_call is not None and now - self._last_call < p.idle_after_s:
            return Decision(False, NOT_IDLE)
        mains = p.unknown_power_is_mains if self.on_mains is None else self.on_mains
        if p.require_mains_power and not mains:
            return Decision(False, ON_BATTERY)
        if self.spent_today(app, now) >= p.budget_model_s_per_day:
            return Decision(False, BUDGET_SPENT)
        return Decision(True, OK)

    def due_abstract(self, app: str, now: float) -> bool:
        """Documents arrived since the last knowledge round and none for ``abstract_quiet_s``."""
        t = self._app(app)
        return bool(t.docs_pending) and now - t.last_doc >= self.policy.abstract_quiet_s

    def due_history(self, app: str, now: float) -> bool:
        """At least ``burst_queries`` user queries since the last history round and none for
        ``history_quiet_s``."""
        t = self._app(app)
        return t.queries_pending >= self.policy.burst_queries and now - t.last_query >= self.policy.history_quiet_s

    def next_work(self, app: str, now: float) -> PredictRound | None:
        """The round to run for ``app`` now, if the predictor may work and one is due; knowledge first
        (new documents are what a user is likely to ask about next)."""
        if not self.may_work(app, now).ok:
            return None
        t = self._app(app)
        if self.due_abstract(app, now):
            return PredictRound(app, "knowledge", self.policy.stride, t.docs_pending)
        if self.due_history(app, now):
            return PredictRound(app, "history", self.policy.stride, t.queries_pending)
        return None

    def apps(self) -> list[str]:
        """Apps with any recorded event, in the order first seen."""
        return list(self._apps)

    # -- persistence ---------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain values for JSON or a table row (not the policy, the power state or calls in flight)."""
        apps = {a: {"docs_pending": t.docs_pending, "last_doc": t.last_doc, "queries_pending": t.queries_pending,
                    "last_query": t.last_query, "spent_day": t.spent_day, "spent_s": t.spent_s}
                for a, t in self._apps.items()}
        return {"version": STATE_VERSION, "last_call": self._last_call, "apps": apps}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], policy: IdlePolicy | None = None, *,
                  day_of: Callable[[float], int] = utc_day) -> IdleState:
        _version(d)
        s = cls(policy, day_of=day_of)
        s._last_call = None if d["last_call"] is None else float(d["last_call"])
        for app, t in d["apps"].items():
            s._apps[str(app)] = _AppState(
                count("docs_pending", t["docs_pending"]), _opt_float(t["last_doc"]),
                count("queries_pending", t["queries_pending"]), _opt_float(t["last_query"]),
                None if t["spent_day"] is None else int(t["spent_day"]), float(t["spent_s"]))
        return s

    def _app(self, app: str) -> _AppState:
        if not isinstance(app, str) or not app:
            raise ValueError(f"app must be a non-empty str, got {app!r}")
        return self._apps.setdefault(app, _AppState())


# -- slices -----------------------------------------------------------------------------------------

MAX_PREFILL_SLICE = 64
"""Most prefill tokens in one slice of the predictor's work (four 16-token chunks): a real call that
arrives meanwhile waits for at most one such slice, or one decode step."""


@dataclass(frozen=True, slots=True)
class Slice:
    """One step of the predictor's work on the executor, between which a real call may take over."""

    kind: str
    """``prefill`` or ``decode``."""
    start: int
    """The first prompt token (``prefill``) or the decode step's index (``decode``)."""
    size: int
    """Prompt tokens (``prefill``, at most the cap) or 1 (``decode``)."""


def slices(prefill_tokens: int, decode_steps: int, max_prefill: int = MAX_PREFILL_SLICE) -> list[Slice]:
    """The slices of a prefill of ``prefill_tokens`` tokens then ``decode_steps`` decode steps: prefill
    in runs of ``max_prefill`` tokens (the last may be shorter), then one slice per decode step."""
    n, steps = count("prefill_tokens", prefill_tokens), count("decode_steps", decode_steps)
    cap = count("max_prefill", max_prefill, 1)
    return ([Slice("prefill", s, min(cap, n - s)) for s in range(0, n, cap)]
            + [Slice("decode", i, 1) for i in range(steps)])


# -- helpers ------------------------------------------------------------------------------------------


def _similarity(name: str, value: float) -> float:
    v = float(value)
    if not -1.0 <= v <= 1.0:
        raise ValueError(f"{name} must be a cosine similarity in [-1, 1], got {value!r}")
    return v


def _opt_float(value: float | None) -> float | None:
    return None if value is None else float(value)


def _version(d: Mapping[str, Any]) -> None:
    if d.get("version") != STATE_VERSION:
        raise ValueError(f"state version {d.get('version')!r} is not {STATE_VERSION}")
