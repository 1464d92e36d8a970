"""Replay results read back from disk: one replay's directory (`bench.replay.write_results`: summary.json
and calls.csv) and an experiment set of `bench.grid` (its manifest `OUT/set-<name>.json` and the
summary of each run done so far).

This module knows the files' layout and checks their format; it knows nothing of markdown, plots or
the results page (`bench.tables`, `bench.plots`, `bench.report`).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

from bench import grid as G
from bench.replay import CALLS_CSV, DEFAULT_CHUNK_TOKENS, SUMMARY_FORMAT, SUMMARY_JSON


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
        if s.get("chunk_tokens", DEFAULT_CHUNK_TOKENS) != DEFAULT_CHUNK_TOKENS:
            parts.append(f"c{s['chunk_tokens']}")
        if s["mode"] == "ray":
            parts.append("ray")
        return "-".join(parts)

    @property
    def title(self) -> str:
        s, t = self.summary, self.summary["trace"]
        thr = f"{s['throttle_mbps']:g} MB/s read throttle" if s["throttle_mbps"] else "no read throttle"
        mode = "Ray actors" if s["mode"] == "ray" else "one process"
        chunks = s.get("chunk_tokens", DEFAULT_CHUNK_TOKENS)
        chunks = "" if chunks == DEFAULT_CHUNK_TOKENS else f", {chunks}-token chunks"
        return f"{t['pattern'].capitalize()}, {t['contexts']} contexts, {mode}, {thr}{chunks}"


_INT_FIELDS = {"call", "context", "resident_chunks", "loaded_chunks", "loaded_bytes", "recomputed_chunks",
               "prompt_tokens", "completion_tokens"}
_STR_FIELDS = {"policy", "outcome"}


def _summary(path: Path) -> dict:
    """A replay's summary.json (ResultsError when unreadable or of another format)."""
    try:
        s = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ResultsError(f"{path}: {e}") from e
    if s.get("format") != SUMMARY_FORMAT:
        raise ResultsError(f"{path}: not a replay summary (format {s.get('format')!r})")
    return s


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


@dataclass(slots=True)
class SetResults:
    """One experiment set: its manifest, its runs and the summaries of those done."""

    name: str  # the set (bench.grid.SETS)
    out: Path  # the grid's results root
    manifest: dict  # OUT/set-<name>.json
    runs: list  # bench.grid.RunSpec, in the manifest's order
    summaries: dict[str, dict]  # summary.json of each run done, by run name

    def stats(self, spec) -> dict | None:
        """The run's policy summary (bench.replay.summarise plus wall_s), None when it is missing."""
        s = self.summaries.get(spec.name)
        return None if s is None else s["policies"].get(spec.policy)

    def mean(self, spec) -> float | None:
        x = self.stats(spec)
        return None if x is None else x["mean_switch_ms"]

    @property
    def missing(self) -> int:
        return sum(r.name not in self.summaries for r in self.runs)

    def find(self, **params) -> list:
        """The runs whose parameters equal `params`."""
        return [r for r in self.runs if all(getattr(r, k) == v for k, v in params.items())]


def load_set(out: str | Path, name: str) -> SetResults:
    """The set `name` as `bench.grid` wrote it under `out` (ResultsError without its manifest)."""
    try:
        manifest, runs = G.read_manifest(G.manifest_path(out, name))
    except G.GridError as e:
        raise ResultsError(str(e)) from e
    summaries = {r.name: _summary(path) for r in runs if (path := Path(out) / r.name / SUMMARY_JSON).exists()}
    return SetResults(name, Path(out), manifest, runs, summaries)
