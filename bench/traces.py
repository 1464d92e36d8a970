"""Context-switching traces for the benchmark, after LLMS §4 (Eq. 5, Table 3).

A trace is a list of calls ``(time_s, context_id, prompt, delta_tokens_target)`` across a fixed set
of active contexts: Eq. 5 without its ground truth, which a latency benchmark does not need.

- **Calling times** are a Poisson process of rate ``rate_per_s``: independent exponential gaps of
  mean ``1 / rate_per_s`` seconds; the first call comes one gap after time 0.
- **Contexts** each get one dataset-like profile of :data:`PROFILES` (LLMS Table 3) and one topic
  family of :data:`bench.passages.FAMILIES`, dealt round-robin from seeded shuffles so that every
  profile and family appears once the number of contexts allows it.
- **Delta lengths** (tokens a context grows by in one call: prompt plus reply) are drawn uniformly
  from the context's profile range, Table 3's range times ``delta_scale``, floored at
  ``min_delta_tokens``. The default scale 0.5 maps Table 3, measured with 4K-token Llama2 contexts,
  onto our 2K-token benchmark context; the floor keeps room for an instruction plus a sentence.
  With the defaults the ranges are (tokens): agnews 100-250, xsum 500-1000, samsum 50-150,
  cnn_dailymail 250-500, wmt17 50-250, sst2 32-50 (Table 3's 10-100 scales to 5-50, floored).
- **Switching patterns** (LLMS §4), by name in :data:`PATTERNS`:
  ``random``: every call picks a context uniformly.
  ``markov``: the state is the recency order of the contexts (rank 0 = the context called last).
  The next call picks the context at recency rank ``r`` with probability
  ``p_r = d**r / sum_{k<n} d**k`` (``d = markov_decay``, ``n`` contexts); it moves to rank 0.
  The chain is first-order in the recency order and ``p`` is its transition row by rank; the
  repeat probability is ``p_0 = (1 - d) / (1 - d**n)``, against ``1/n`` for ``random``. The
  initial order is a seeded permutation.
  ``gaussian``: every call picks context ``c`` independently with probability proportional to
  ``exp(-(x_c - m)**2 / (2 s**2))``, where ``x_c = ln sqrt(lo_c * hi_c)`` is the log of the
  geometric middle of its delta range, ``m`` the midpoint of the smallest and largest ``x_c`` and
  ``s`` is ``gaussian_width`` times half their spread: contexts of moderate workload are called
  most, the lightest and heaviest ``exp(-1 / (2 w**2))`` times as often as one at the centre
  (0.135 at the default ``w = 0.5``). Contexts all of one workload: uniform.
- **Prompts** are reference-manual passages in task instructions (:mod:`bench.passages`), each
  context reading its family's passages in order from a seeded start. A prompt aims at
  ``delta * (1 - reply_share)`` tokens of its profile, leaving the rest for the reply: a replayer
  asks for ``delta_tokens_target - count_tokens(prompt)`` new tokens to make the context grow by
  about the target.

Traces are reproducible: the same config, seed and token counter give the same trace; timing, the
choice of contexts and delta lengths draw from separate seeded streams, so two patterns with one
seed share their calling times. Saved as JSON lines: a header (format, version, config, seed,
contexts), then one call per line.

This module deliberately knows nothing about the service, the model, its tokenizer (lengths are
approximate unless a ``count_tokens`` callable is given) or chat template, or replay: it only
makes, saves and loads traces.

    python -m bench.traces --pattern markov --contexts 8 --calls 30 --rate 0.5 --out t.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from bench.passages import (
    FAMILIES,
    CountTokens,
    PassageStream,
    approx_tokens,
    build_prompt,
    load_passages,
)

FORMAT = "llmaas-trace"  # the header's "format" value
FORMAT_VERSION = 1  # bumped on any change to the header or record fields
MIN_CONTEXTS, MAX_CONTEXTS = 2, 64  # active contexts a trace may have (count)


class TraceConfigError(ValueError):
    """A trace configuration value is out of range or unknown; the message names the valid ones."""


class UnknownPatternError(TraceConfigError):
    """A switching pattern name is not in :data:`PATTERNS`; the message lists the valid names."""

    def __init__(self, name: object) -> None:
        valid = ", ".join(sorted(PATTERNS))
        super().__init__(f"unknown switching pattern {name!r}; valid: {valid}")


class UnknownProfileError(TraceConfigError):
    """A profile name is not in :data:`PROFILES`; the message lists the valid names."""

    def __init__(self, name: object) -> None:
        super().__init__(f"unknown delta-length profile {name!r}; valid: {', '.join(PROFILES)}")


class TraceFormatError(ValueError):
    """A trace file is malformed; the message says where (``source:line``) and what is wrong."""


# -- profiles (LLMS Table 3) -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Profile:
    """A dataset-like workload of LLMS Table 3: its task and the delta length of one call."""

    task: str  # key of bench.passages.TASKS used for its prompts
    delta_min_tokens: int  # Table 3 lower bound, at the paper's scale (tokens)
    delta_max_tokens: int  # Table 3 upper bound, at the paper's scale (tokens)
    reply_share: float  # share of the delta left for the reply, ours (fraction of delta, 0..1)
    dataset: str  # the Table 3 dataset it stands for


PROFILES: dict[str, Profile] = {
    # Classification replies are a label; a translation's reply is as long as its source.
    "agnews": Profile("classify", 200, 500, 0.02, "AGnews (news classification)"),
    "xsum": Profile("summarise", 1000, 2000, 0.05, "Xsum (document summary)"),
    "samsum": Profile("summarise_notes", 100, 300, 0.2, "Samsum (chat history summary)"),
    "cnn_dailymail": Profile("answer", 500, 1000, 0.1, "cnn dailymail (text comprehension)"),
    "wmt17": Profile("translate", 100, 500, 0.5, "WMT17-de-en (translation)"),
    "sst2": Profile("sentiment", 10, 100, 0.05, "SST-2 (sentiment classification)"),
}


# -- config and records ----------------------------------------------------------------------------


@dataclass(slots=True)
class TraceConfig:
    """What trace to synthesise; with a seed it determines the trace."""

    pattern: str = "random"  # switching pattern, a key of PATTERNS
    contexts: int = 8  # active contexts (count, 2..64)
    calls: int = 100  # calls in the trace (count)
    rate_per_s: float = 0.2  # Poisson calling rate (calls per second); LLMS §5: one per 5 s
    delta_scale: float = 0.5  # factor on Table 3's delta ranges (dimensionless): 2K over 4K tokens
    min_delta_tokens: int = 32  # floor of every delta range (tokens)
    markov_decay: float = 0.5  # markov: probability ratio of recency rank r+1 to r (0 < d <= 1)
    gaussian_width: float = 0.5  # gaussian: sigma over half the spread of log deltas (> 0)
    profiles: tuple[str, ...] = tuple(PROFILES)  # profiles dealt to contexts (names of PROFILES)

    def __post_init__(self) -> None:
        if self.pattern not in PATTERNS:
            raise UnknownPatternError(self.pattern)
        _check_int("contexts", self.contexts, MIN_CONTEXTS, MAX_CONTEXTS)
        _check_int("calls", self.calls, 1, None)
        _check_int("min_delta_tokens", self.min_delta_tokens, 1, None)
        _check_positive("rate_per_s", self.rate_per_s)
        _check_positive("delta_scale", self.delta_scale)
        _check_positive("gaussian_width", self.gaussian_width)
        _check_positive("markov_decay", self.markov_decay)
        if self.markov_decay > 1:
            raise TraceConfigError(f"markov_decay must be in (0, 1], got {self.markov_decay!r}")
        if isinstance(self.profiles, str) or not self.profiles:
            raise TraceConfigError(
                f"profiles must be a non-empty sequence of names; valid: {', '.join(PROFILES)}"
            )
        self.profiles = tuple(self.profiles)
        for name in self.profiles:
            if name not in PROFILES:
                raise UnknownProfileError(name)

    def delta_range(self, profile: str) -> tuple[int, int]:
        """(min, max) delta tokens of ``profile`` in this config: scaled, floored, min <= max."""
        p = PROFILES[profile]
        lo = max(self.min_delta_tokens, round(p.delta_min_tokens * self.delta_scale))
        return lo, max(lo, round(p.delta_max_tokens * self.delta_scale))


def _check_int(name: str, value: object, lo: int, hi: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TraceConfigError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bounds = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise TraceConfigError(f"{name} must be {bounds}, got {value}")


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TraceConfigError(f"{name} must be a finite number, got {value!r}")
    if value <= 0:
        raise TraceConfigError(f"{name} must be > 0, got {value}")


@dataclass(frozen=True, slots=True)
class ContextSpec:
    """One active context of a trace: its workload profile and the passages it reads."""

    context_id: int  # index in the trace, 0..contexts-1 (the replayer maps it to a service id)
    profile: str  # key of PROFILES
    family: str  # key of bench.passages.FAMILIES its prompts are drawn from
    delta_min_tokens: int  # smallest delta of its calls (tokens)
    delta_max_tokens: int  # largest delta of its calls (tokens)


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One call of LLMS Eq. 5, without ground truth."""

    time_s: float  # calling time since the start of the trace (seconds)
    context_id: int  # the context called (index into Trace.contexts)
    prompt: str  # the user turn's text
    delta_tokens_target: int  # how much the context should grow: prompt plus reply (tokens)


@dataclass(frozen=True, slots=True)
class Trace:
    """A synthesised trace: how it was made, its contexts and its calls in time order."""

    config: TraceConfig  # what was asked for
    seed: int  # the seed it was generated from
    token_counter: str  # name of the count_tokens callable the prompt lengths were fitted with
    contexts: tuple[ContextSpec, ...]  # context_id i at index i
    records: tuple[TraceRecord, ...] = field(repr=False)  # calls, time_s non-decreasing

    def mean_gap_s(self) -> float:
        """Mean time between consecutive calls, counting the first from 0 (seconds)."""
        return self.records[-1].time_s / len(self.records)

    def mean_delta_tokens(self) -> float:
        """Mean delta target over calls (tokens)."""
        return sum(r.delta_tokens_target for r in self.records) / len(self.records)

    def summary(self) -> str:
        """One line: calls, contexts, pattern, mean gap and mean delta."""
        return (
            f"calls={len(self.records)} contexts={len(self.contexts)} pattern={self.config.pattern}"
            f" mean_gap_s={self.mean_gap_s():.3f} mean_delta_tokens={self.mean_delta_tokens():.1f}"
        )


# -- switching patterns ----------------------------------------------------------------------------


class RandomPattern:
    """Every call picks a context uniformly (LLMS "Random")."""

    __slots__ = ("_n",)

    def __init__(
        self, contexts: Sequence[ContextSpec], config: TraceConfig, rng: np.random.Generator
    ) -> None:
        self._n = len(contexts)  # number of contexts

    def choose(self, rng: np.random.Generator) -> int:
        """The next context id."""
        return int(rng.integers(self._n))


def markov_rank_probabilities(n: int, decay: float) -> np.ndarray:
    """[n] probability of calling the context at recency rank r next: decay**r, normalised."""
    p = decay ** np.arange(n, dtype=np.float64)
    return p / p.sum()


class MarkovPattern:
    """A first-order Markov chain over the recency order favouring recent contexts (LLMS "Markov").

    The next context is the one at recency rank r with probability
    :func:`markov_rank_probabilities` ``[r]``; it then becomes rank 0.
    """

    __slots__ = ("_order", "_p")

    def __init__(
        self, contexts: Sequence[ContextSpec], config: TraceConfig, rng: np.random.Generator
    ) -> None:
        # A list, not a deque: the chosen rank is popped from anywhere, n <= 64.
        self._order = [int(c) for c in rng.permutation(len(contexts))]  # ids, most recent first
        self._p = markov_rank_probabilities(len(contexts), config.markov_decay)  # [n] by rank

    def probabilities(self) -> np.ndarray:
        """[n] probability of each context id being called next, given the current state."""
        out = np.empty_like(self._p)
        out[self._order] = self._p
        return out

    def choose(self, rng: np.random.Generator) -> int:
        """The next context id; it moves to the front of the recency order."""
        c = self._order.pop(int(rng.choice(len(self._p), p=self._p)))
        self._order.insert(0, c)
        return c


def gaussian_weights(ranges: Sequence[tuple[int, int]], width: float) -> np.ndarray:
    """[n] call probabilities of contexts with these delta ranges (tokens), as the module says."""
    x = np.array([0.5 * (math.log(lo) + math.log(hi)) for lo, hi in ranges])
    half = 0.5 * (x.max() - x.min())
    if half == 0:
        return np.full(len(x), 1.0 / len(x))
    w = np.exp(-((x - 0.5 * (x.max() + x.min())) ** 2) / (2 * (width * half) ** 2))
    return w / w.sum()


class GaussianPattern:
    """Every call picks a context with a Gaussian weight over its log delta (LLMS "Gaussian")."""

    __slots__ = ("_p",)

    def __init__(
        self, contexts: Sequence[ContextSpec], config: TraceConfig, rng: np.random.Generator
    ) -> None:
        ranges = [(c.delta_min_tokens, c.delta_max_tokens) for c in contexts]
        self._p = gaussian_weights(ranges, config.gaussian_width)  # [n] by context id

    def probabilities(self) -> np.ndarray:
        """[n] probability of each context id being called."""
        return self._p.copy()

    def choose(self, rng: np.random.Generator) -> int:
        """The next context id."""
        return int(rng.choice(len(self._p), p=self._p))


PATTERNS: dict[str, type[RandomPattern] | type[MarkovPattern] | type[GaussianPattern]] = {
    "random": RandomPattern,
    "markov": MarkovPattern,
    "gaussian": GaussianPattern,
}


def make_pattern(
    name: str, contexts: Sequence[ContextSpec], config: TraceConfig, rng: np.random.Generator
) -> RandomPattern | MarkovPattern | GaussianPattern:
    """The switching pattern ``name`` over ``contexts`` (raises :class:`UnknownPatternError`)."""
    try:
        cls = PATTERNS[name]
    except KeyError as e:
        raise UnknownPatternError(name) from e
    return cls(contexts, config, rng)


# -- generation ------------------------------------------------------------------------------------


def generate_trace(
    config: TraceConfig,
    seed: int,
    *,
    count_tokens: CountTokens = approx_tokens,
    topics: Mapping[str, str] | None = None,
) -> Trace:
    """The trace ``config`` describes, drawn from ``seed``.

    ``count_tokens`` measures prompt lengths (default: about four characters per token); ``topics``
    replaces ``pydoc_data.topics.topics`` as the source of passages (tests).
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise TraceConfigError(f"seed must be a non-negative integer, got {seed!r}")
    setup, timing, switching, deltas = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(4)
    )
    passages = load_passages(topics)
    families = sorted(passages)
    if not families:
        raise TraceConfigError(f"no passages found; topic families: {', '.join(FAMILIES)}")
    profile_order = [config.profiles[i] for i in setup.permutation(len(config.profiles))]
    family_order = [families[i] for i in setup.permutation(len(families))]
    contexts, streams = [], []
    for i in range(config.contexts):
        profile, family = profile_order[i % len(profile_order)], family_order[i % len(family_order)]
        lo, hi = config.delta_range(profile)
        contexts.append(ContextSpec(i, profile, family, lo, hi))
        start = int(setup.integers(len(passages[family])))
        streams.append(PassageStream(passages[family], start, count_tokens))

    times = np.cumsum(timing.exponential(1.0 / config.rate_per_s, size=config.calls))
    pattern = make_pattern(config.pattern, contexts, config, switching)
    labels = tuple(FAMILIES)
    records = []
    for t in times:
        c = pattern.choose(switching)
        spec = contexts[c]
        delta = int(deltas.integers(spec.delta_min_tokens, spec.delta_max_tokens + 1))
        profile = PROFILES[spec.profile]
        target = max(1, round(delta * (1.0 - profile.reply_share)))
        prompt = build_prompt(profile.task, streams[c], target, count_tokens, labels=labels)
        records.append(TraceRecord(float(t), c, prompt, delta))
    name = getattr(count_tokens, "__qualname__", type(count_tokens).__name__)
    return Trace(config, seed, name, tuple(contexts), tuple(records))


# -- JSON lines ------------------------------------------------------------------------------------


def dump_lines(trace: Trace) -> Iterator[str]:
    """The trace as JSON lines (without newlines): the header, then one line per call."""
    config = asdict(trace.config)
    config["profiles"] = list(trace.config.profiles)
    header = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "seed": trace.seed,
        "token_counter": trace.token_counter,
        "config": config,
        "contexts": [asdict(c) for c in trace.contexts],
    }
    yield json.dumps(header, sort_keys=True)
    for r in trace.records:
        yield json.dumps(asdict(r), sort_keys=True)


def save_trace(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` to ``path`` as JSON lines (UTF-8, ASCII-escaped)."""
    with open(path, "w", encoding="utf-8") as f:
        for line in dump_lines(trace):
            f.write(line + "\n")


def load_trace(path: str | Path) -> Trace:
    """Read a trace written by :func:`save_trace` (raises :class:`TraceFormatError`)."""
    with open(path, encoding="utf-8") as f:
        return parse_lines(f, source=str(path))


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _object(line: str, where: str, kind: str, names: Iterable[str]) -> dict:
    """The JSON object on ``line`` with exactly the fields ``names``."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{where}: not JSON ({e.msg} at column {e.colno})") from e
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: {kind} must be a JSON object, got {type(obj).__name__}")
    _check_fields(obj, set(names), where, kind)
    return obj


def _check_fields(obj: dict, names: set[str], where: str, kind: str) -> None:
    if missing := names - obj.keys():
        raise TraceFormatError(f"{where}: {kind} lacks field(s) {', '.join(sorted(missing))}")
    if extra := obj.keys() - names:
        raise TraceFormatError(f"{where}: {kind} has unknown field(s) {', '.join(sorted(extra))}")


def _type_error(where: str, name: str, want: str, got: object) -> TraceFormatError:
    return TraceFormatError(f"{where}: field {name!r} must be {want}, got {got!r}")


def _parse_header(line: str, where: str) -> tuple[TraceConfig, int, str, tuple[ContextSpec, ...]]:
    try:
        head = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{where}: header is not JSON ({e.msg})") from e
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise TraceFormatError(f"{where}: not a trace header (want \"format\": {FORMAT!r})")
    if head.get("version") != FORMAT_VERSION:
        raise TraceFormatError(
            f"{where}: unsupported trace version {head.get('version')!r}; this reader reads "
            f"{FORMAT_VERSION}"
        )
    _check_fields(head, {"format", "version", "seed", "token_counter", "config", "contexts"},
                  where, "header")
    if not _is_int(head["seed"]) or head["seed"] < 0:
        raise _type_error(where, "seed", "a non-negative integer", head["seed"])
    if not isinstance(head["token_counter"], str):
        raise _type_error(where, "token_counter", "a string", head["token_counter"])
    raw = head["config"]
    if not isinstance(raw, dict):
        raise _type_error(where, "config", "an object", raw)
    _check_fields(raw, {f.name for f in fields(TraceConfig)}, where, "config")
    if not isinstance(raw["profiles"], list):
        raise _type_error(where, "profiles", "a list", raw["profiles"])
    try:
        config = TraceConfig(**raw)
    except TraceConfigError as e:
        raise TraceFormatError(f"{where}: bad config: {e}") from e
    specs = head["contexts"]
    if not isinstance(specs, list) or len(specs) != config.contexts:
        raise TraceFormatError(f"{where}: \"contexts\" must list {config.contexts} contexts")
    contexts = []
    for i, s in enumerate(specs):
        kind = f"context {i}"
        if not isinstance(s, dict):
            raise TraceFormatError(f"{where}: {kind} must be an object")
        _check_fields(s, {f.name for f in fields(ContextSpec)}, where, kind)
        if s["context_id"] != i or not _is_int(s["context_id"]):
            raise _type_error(where, "context_id", f"{i} (contexts in id order)", s["context_id"])
        if s["profile"] not in PROFILES:
            raise TraceFormatError(f"{where}: {kind}: {UnknownProfileError(s['profile'])}")
        if not isinstance(s["family"], str):
            raise _type_error(where, "family", "a string", s["family"])
        lo, hi = s["delta_min_tokens"], s["delta_max_tokens"]
        if not (_is_int(lo) and _is_int(hi) and 1 <= lo <= hi):
            raise _type_error(where, "delta_min_tokens/delta_max_tokens",
                              "integers 1 <= min <= max", (lo, hi))
        contexts.append(ContextSpec(**s))
    return config, head["seed"], head["token_counter"], tuple(contexts)


def _parse_record(line: str, where: str, n_contexts: int, last_time: float) -> TraceRecord:
    r = _object(line, where, "record", (f.name for f in fields(TraceRecord)))
    t, c, prompt, delta = r["time_s"], r["context_id"], r["prompt"], r["delta_tokens_target"]
    if not _is_number(t) or t < 0:
        raise _type_error(where, "time_s", "a finite number >= 0 (seconds)", t)
    if t < last_time:
        raise TraceFormatError(f"{where}: time_s {t} is before the previous call's {last_time}")
    if not _is_int(c) or not 0 <= c < n_contexts:
        raise _type_error(where, "context_id", f"an integer in 0..{n_contexts - 1}", c)
    if not isinstance(prompt, str) or not prompt:
        raise _type_error(where, "prompt", "a non-empty string", prompt)
    if not _is_int(delta) or delta < 1:
        raise _type_error(where, "delta_tokens_target", "an integer >= 1 (tokens)", delta)
    return TraceRecord(float(t), c, prompt, delta)


def parse_lines(lines: Iterable[str], source: str = "<trace>") -> Trace:
    """The trace in ``lines`` (header first); every field is checked (raises TraceFormatError)."""
    it = iter(lines)
    first = next(it, None)
    if first is None or not first.strip():
        raise TraceFormatError(f"{source}:1: empty trace (expected a header line)")
    config, seed, counter, contexts = _parse_header(first, f"{source}:1")
    records: list[TraceRecord] = []
    last = 0.0
    for lineno, line in enumerate(it, start=2):
        record = _parse_record(line, f"{source}:{lineno}", len(contexts), last)
        records.append(record)
        last = record.time_s
    if len(records) != config.calls:
        raise TraceFormatError(
            f"{source}: header promises {config.calls} calls, found {len(records)} (truncated?)"
        )
    return Trace(config, seed, counter, contexts, tuple(records))


# -- command line ----------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Generate a trace and write it as JSON lines; print a one-line summary to stderr."""
    d = TraceConfig()
    parser = argparse.ArgumentParser(
        prog="python -m bench.traces",
        description="Synthesise a context-switching trace (LLMS §4, Eq. 5) as JSON lines: a "
        "header, then one call per line {time_s, context_id, prompt, delta_tokens_target}. "
        "Prompts are Python reference-manual passages (pydoc_data) in task instructions. "
        "Prints a one-line summary to stderr.",
    )
    parser.add_argument("--pattern", default=d.pattern, choices=sorted(PATTERNS),
                        help="switching pattern (default: %(default)s)")
    parser.add_argument("--contexts", type=int, default=d.contexts,
                        help=f"active contexts, {MIN_CONTEXTS}..{MAX_CONTEXTS} "
                        "(default: %(default)s)")
    parser.add_argument("--calls", type=int, default=d.calls, help="calls (default: %(default)s)")
    parser.add_argument("--rate", type=float, default=d.rate_per_s,
                        help="Poisson calling rate, calls per second (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    parser.add_argument("--out", default="-",
                        help="output file, '-' for stdout (default: %(default)s)")
    parser.add_argument("--delta-scale", type=float, default=d.delta_scale,
                        help="factor on LLMS Table 3 delta ranges (default: %(default)s)")
    parser.add_argument("--min-delta", type=int, default=d.min_delta_tokens,
                        help="floor of every delta range, tokens (default: %(default)s)")
    parser.add_argument("--markov-decay", type=float, default=d.markov_decay,
                        help="markov: probability ratio of recency rank r+1 to r "
                        "(default: %(default)s)")
    parser.add_argument("--gaussian-width", type=float, default=d.gaussian_width,
                        help="gaussian: sigma over half the spread of log deltas "
                        "(default: %(default)s)")
    parser.add_argument("--profiles", default=",".join(d.profiles),
                        help="comma-separated delta-length profiles (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        config = TraceConfig(
            pattern=args.pattern, contexts=args.contexts, calls=args.calls, rate_per_s=args.rate,
            delta_scale=args.delta_scale, min_delta_tokens=args.min_delta,
            markov_decay=args.markov_decay, gaussian_width=args.gaussian_width,
            profiles=tuple(p.strip() for p in args.profiles.split(",") if p.strip()),
        )
        trace = generate_trace(config, args.seed)
    except TraceConfigError as e:
        parser.error(str(e))
    if args.out == "-":
        for line in dump_lines(trace):
            sys.stdout.write(line + "\n")
    else:
        save_trace(trace, args.out)
    print(trace.summary(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
