"""Prometheus metrics (docs/design.md §7), exported with prometheus-client by the actors that know them.

Each process that exports (the HTTP ingress, the model executor, the memory governor, the KV swap/IO
worker) serves its own registry on a loopback port chosen by the kernel and lists it in a Prometheus
file_sd targets file, `<data_dir>/metrics/<role>-<pid>.json`. `dashboards/prometheus.yml` reads
`<data_dir>/metrics/*.json`; targets of processes that died are removed by the next exporter to start.
(Ray's own `ray.util.metrics` would rename the series to `ray_*`, hence prometheus-client.)

No Ray here: the actors call `Metrics.start(role, data_dir)` and update the series.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

SWITCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """The service's series in one registry of this process (only the ones a role updates get data)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = "llmaas_"
        self.switch = Histogram(p + "context_switch_seconds", "Context switching latency (docs/design.md §1): from "
                                "the call's arrival until every K/V can be attended", ["policy", "outcome"],
                                buckets=SWITCH_BUCKETS, registry=r)
        self.ttft = Histogram(p + "ttft_seconds", "Time to first token, from the call's arrival at the executor",
                              ["policy"], buckets=TTFT_BUCKETS, registry=r)
        self.tokens = Counter(p + "tokens_generated_total", "Tokens generated", ["policy"], registry=r)
        self.decode_seconds = Counter(p + "decode_seconds_total", "Seconds spent after the first token "
                                      "(tokens/s = rate(tokens) / rate(decode seconds))", ["policy"], registry=r)
        self.calls = Counter(p + "calls_total", "Model calls by outcome", ["policy", "outcome"], registry=r)
        self.prefill_tokens = Counter(p + "prefill_tokens_total", "Tokens prefilled, by how the prefill ran under "
                                      "the prefill budget (none; moderate: row partitions; severe: K/V streamed layer "
                                      "by layer; unbudgeted: no budget)",
                                      ["plan"], registry=r)
        self.streamed = Counter(p + "streamed_kv_bytes_total", "K/V bytes written out of memory layer by layer "
                                "by calls whose context streams (severe plans under the prefill budget)",
                                registry=r)
        self.weights_read = Counter(p + "weights_streamed_bytes_total", "Weight bytes the model executor brought "
                                    "into memory for fragments beyond the resident limit (weights_resident_bytes)",
                                    registry=r)
        self.lookup = Counter(p + "lookup_tokens_total", "Lookup decoding's guessed tokens (guessed) and those "
                              "greedy decoding chose (kept: each a pass of the model saved)", ["kind"], registry=r)
        self.weights = Gauge(p + "weights_bytes", "The executor's weight fragments: resident, streamed per forward "
                             "pass, and the streaming window (at most in memory besides the resident ones)",
                             ["part"], registry=r)
        self.recompute = Counter(p + "recompute_chunks_total", "Chunks recomputed from token ids",
                                 ["policy", "reason"], registry=r)
        self.io_fraction = Gauge(p + "pipeline_io_fraction", "Of the last restore's missing chunks, the "
                                 "fraction loaded from disk (the rest recomputed)", ["policy"], registry=r)
        self.restore_error = Gauge(p + "restore_prediction_log_error", "Median |ln(measured / predicted)| "
                                   "restore time over recent restores", ["policy"], registry=r)
        self.cost_factor = Gauge(p + "restore_cost_factor", "Online correction of the profile's restore cost "
                                 "models: measured over profiled seconds of each stage (io, decode, recompute), "
                                 "the median over recent restores", ["policy", "stage"], registry=r)
        self.active = Gauge(p + "active_contexts", "Contexts known to the memory governor", ["policy"], registry=r)
        self.pool = Gauge(p + "kv_pool_bytes", "KV pool: resident bytes as stored, the budget, and bytes on disk",
                          ["state"], registry=r)
        self.chunks = Gauge(p + "kv_chunks", "KV chunks by state and bit level", ["state", "bits"], registry=r)
        self.evictions = Counter(p + "evictions_total", "Chunks evicted from the KV pool", ["policy"], registry=r)
        self.swap = Counter(p + "swap_bytes_total", "Chunk file bytes read (in) and written (out)",
                            ["direction"], registry=r)
        self.swap_seconds = Counter(p + "swap_seconds_total", "Seconds spent reading (in) and writing (out) "
                                    "chunk files", ["direction"], registry=r)
        self.requests = Counter(p + "requests_total", "HTTP requests by route and status code", ["route", "code"],
                                registry=r)
        self.restarts = Counter(p + "actor_restarts_total", "Restarts of a service actor after it failed (each "
                                "restarted process counts its own start)", ["role"], registry=r)
        self.rag_queries = Counter(p + "rag_queries_total", "RAG queries by the cache level that served them "
                                   "(qa_bank, kv_tree, miss)", ["level"], registry=r)
        self.qa_hits = Counter(p + "qa_bank_hits_total", "RAG queries answered from the QA bank", registry=r)
        self.tree_hits = Counter(p + "kv_tree_hits_total", "RAG queries that reused passages' K/V from the K/V tree",
                                 registry=r)
        self.tree_tokens = Counter(p + "kv_tree_tokens_reused_total", "Passage tokens whose K/V came from the "
                                   "K/V tree", registry=r)
        self.blended_tokens = Counter(p + "kv_tree_tokens_blended_total", "Passage tokens whose K/V came from "
                                      "nodes of other retrieval paths, moved and partly recomputed (rag.blend_ratio)",
                                      registry=r)
        self.retrieved_tokens = Counter(p + "rag_retrieved_tokens_total", "Passage tokens in RAG prompts (the "
                                        "K/V hit rate's denominator)", registry=r)
        self.rag_bytes = Gauge(p + "rag_cache_bytes", "RAG cache bytes by level (qa_bank, kv_tree)", ["level"],
                               registry=r)
        self.predicted = Counter(p + "predictor_queries_total", "Queries the query predictor ran in idle time",
                                 registry=r)
        self.predictor_seconds = Counter(p + "predictor_model_seconds_total", "Model seconds the query "
                                         "predictor used in idle time", registry=r)
        self.port = 0

    def start(self, role: str, data_dir: str) -> int:
        """Serve this registry on a loopback port and list it as a scrape target; returns the port."""
        server, _thread = start_http_server(0, addr="127.0.0.1", registry=self.registry)
        self.port = server.server_port
        register_target(data_dir, role, self.port)
        return self.port


SWITCH_OUTCOMES = ("hit", "resident", "swap", "recompute")
"""The outcomes `switch_outcome` names; calls may also end in `error`."""
OUTCOMES = SWITCH_OUTCOMES + ("error",)


def init_executor_series(m: Metrics, policy: str) -> None:
    """Create the executor's labelled series at zero, so that rates exist before the first event."""
    for o in OUTCOMES:
        m.calls.labels(policy, o)
    for o in SWITCH_OUTCOMES:
        m.switch.labels(policy, o)
    m.ttft.labels(policy)
    m.tokens.labels(policy)
    m.prefill_tokens.labels("unbudgeted")
    m.decode_seconds.labels(policy)
    for reason in ("planned", "fault"):
        m.recompute.labels(policy, reason)
    for kind in ("guessed", "kept"):
        m.lookup.labels(kind)


def init_predictor_series(m: Metrics) -> None:
    """The query predictor's labelled series at zero."""
    for level in ("qa_bank", "kv_tree", "miss"):
        m.rag_queries.labels(level)
    for level in ("qa_bank", "kv_tree"):
        m.rag_bytes.labels(level)


def targets_dir(data_dir: str) -> Path:
    return Path(data_dir) / "metrics"


def register_target(data_dir: str, role: str, port: int) -> Path:
    """Write this process's file_sd entry (atomically) and drop entries of processes that are gone."""
    d = targets_dir(data_dir)
    d.mkdir(parents=True, exist_ok=True)
    for old in d.glob("*.json"):
        pid = old.stem.rsplit("-", 1)[-1]
        if pid.isdigit() and not pid_alive(int(pid)):
            old.unlink(missing_ok=True)
    path = d / f"{role}-{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([{"targets": [f"127.0.0.1:{port}"], "labels": {"role": role}}]))
    os.replace(tmp, path)
    return path


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (on this node)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def switch_outcome(cached: bool, restore: dict) -> str:
    """`hit` (the working set still held the context), `resident` (decoded from the pool only),
    `swap` (some chunks read from disk), `recompute` (some recomputed)."""
    if cached:
        return "hit"
    if restore.get("recomputed"):
        return "recompute"
    if restore.get("loaded"):
        return "swap"
    return "resident"
