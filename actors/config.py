"""The context service's configuration: plain data, importable without torch or Ray (the CLI checks
it before starting anything)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from engine.config import check_kv_format
from engine.quant import WeightFormat


OPENMP_SPIN = 10000
"""The OpenMP spin (`GOMP_SPINCOUNT`) the model runs with: the executor's on Ray (`Tuning.executor_spin`)
and `llmaas generate` and `chat`'s (`deploy.cli`). In one process it cost nothing on an idle box and
made a 1.5K-token prompt prefill 2.1x and decode 5.2x as fast beside one busy process
(docs/benchmarks.md, "Tuning at the edge")."""


RESTART_WAIT_S = 60.0
"""How long a call is retried while its actor restarts, seconds, unless `LLMAAS_RESTART_WAIT_S` says."""


def restart_wait_s() -> float:
    """How long a call is retried while its actor restarts: `LLMAAS_RESTART_WAIT_S` (seconds) where it is
    set in this process's environment (the service's actors inherit it from the process that starts
    Ray), else `RESTART_WAIT_S`. A restart loads the model again: on a box busy with other work it may take
    longer than a minute."""
    raw = os.environ.get("LLMAAS_RESTART_WAIT_S", "")
    try:
        value = float(raw) if raw else RESTART_WAIT_S
    except ValueError:
        raise ValueError(f"LLMAAS_RESTART_WAIT_S must be a number of seconds, not {raw!r}") from None
    if not value > 0:
        raise ValueError(f"LLMAAS_RESTART_WAIT_S must be positive, not {raw!r}")
    return value


@dataclass(slots=True)
class Tuning:
    """Optimisations that exist for speed alone, each switchable here (True: on). What each buys,
    measured with it on and off in alternated rounds (`python -m bench.tuning NAME`), is one
    line of docs/benchmarks.md, "Tuning at the edge"."""

    streaming_stores: bool = True
    """De-quantize a restore of `actors.restore.STREAM_MIN_BYTES` or more with non-temporal stores."""
    object_chunks: int = 16
    """On Ray: resident chunks put to one object-store object (`actors.ray_stubs.ResidentRefs`); 1: an
    object per chunk."""
    lookup_draft: int = 4
    """Lookup decoding in the model executor (`engine.config.EngineConfig.lookup_draft`): greedy replies
    guess up to this many tokens a pass from the context and keep what greedy decoding chooses, the
    reply unchanged (RAG replies decoded 1.4-1.5x faster, docs/benchmarks.md "Tuning at the edge"); 0: off."""

    executor_threads: int = 0
    """On Ray: torch threads of the model executor's calls (prefill and decode). 0: every CPU this process
    may run on (`os.sched_getaffinity`), since the recompute worker's core is idle while a call
    computes: on 2 cores a 1.5K-token prompt prefilled 1.85x and its reply decoded 1.56x as fast as on
    one thread (docs/benchmarks.md, "Tuning at the edge"); 1: one thread."""
    executor_spin: int = OPENMP_SPIN
    """On Ray: how long the executor's OpenMP threads spin at a barrier before they sleep
    (`GOMP_SPINCOUNT`, set in its process's environment unless `GOMP_SPINCOUNT` or `OMP_WAIT_POLICY` is
    set already); 0: libgomp's default (300,000). Beside one busy process 10000 decoded 4.7x and
    prefilled 2.3x as fast as the default (a waiting thread no longer keeps the core its descheduled
    teammate needs); on an idle box prefill and switches took as long and decode 2-8% longer
    (docs/benchmarks.md, "Tuning at the edge")."""

    def __post_init__(self) -> None:
        if self.executor_threads < 0:
            raise ValueError(f"executor_threads must be >= 0, got {self.executor_threads!r}")
        if self.executor_spin < 0:
            raise ValueError(f"executor_spin must be >= 0, got {self.executor_spin!r}")
        if self.object_chunks < 1:
            raise ValueError(f"object_chunks must be >= 1, got {self.object_chunks!r}")
        if self.lookup_draft < 0:
            raise ValueError(f"lookup_draft must be >= 0, got {self.lookup_draft!r}")


def openmp_env(spin: int) -> dict[str, str]:
    """The environment that gives a process an OpenMP spin of `spin` (`GOMP_SPINCOUNT`; libgomp reads it
    as it loads, before torch runs): nothing when `spin` is 0 (libgomp's default) or the user's
    environment already says how OpenMP threads wait."""
    if not spin or {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & set(os.environ):
        return {}
    return {"GOMP_SPINCOUNT": str(spin)}


@dataclass(frozen=True, slots=True)
class RagConfig:
    """The RAG cache's knobs (`ServiceConfig.rag`; actors.ragfront)."""

    passage_tokens: int = 128
    """Most tokens of one knowledge chunk (documents are split on paragraphs and sentences)."""
    k: int = 5
    """Passages retrieved per query."""
    tau_query: float = 0.85
    """Cosine similarity at or above which a stored question's answer is reused (PerCache §4.2.1)."""
    qa_bank: bool = True
    """Answer similar questions from the QA bank (off: the RAGCache-like and Naive baselines)."""
    kv_tree: bool = True
    """Reuse passages' K/V from the K/V tree (off: the MeanCache-like and Naive baselines)."""
    blend_ratio: float = 0.0
    """Off (0): a passage's K/V is reused only after exactly its cached prefix, so replies equal a whole
    prefill's. Above 0 (CacheBlend): when every passage past the cached prefix has a node on another
    path, their K/V is moved to this prompt's slots and this share of each passage's tokens, its first,
    recomputed; replies may differ (docs/benchmarks.md, "RAG cache"). Float32 K/V only (elsewhere the
    passages are prefilled)."""
    tree_cap_bytes: int = 2 << 30
    """Bytes of node K/V kept per app, on disk or in the pool (LFU eviction past it, PerCache §4.1.1).
    Nodes are raw (pinned exact): for the default model about 46 KB a token, 17 MB a three-passage
    path, so 2 GiB keeps about 120 paths; at 512 MiB predicted and real paths evicted each other and
    prediction gained 7 points of K/V hits instead of 14 (docs/benchmarks.md, "RAG cache")."""
    qa_cap_bytes: int = 16 << 20
    """Bytes of QA entries kept per app and collection."""
    max_tokens: int = 128
    """Default reply length."""
    predict: bool = True
    """Predict queries in idle time (the query predictor; off: the caches fill only from real queries)."""
    predict_tree: bool = True
    """Predicted queries, and the rest of idle work, populate the K/V tree (PerCache §4.1.2). Off, the
    tree fills from real queries alone, as RAGCache's does, and idle work answers predicted questions
    into the QA bank only: PerCache §5.2's RAGCache + Sleep-time Compute baseline."""
    idle_after_s: float = 120.0
    """Seconds without a real call before the predictor may work."""
    predict_budget_s: float = 600.0
    """Model seconds the predictor may spend per app per day."""
    stride: int = 5
    """Queries predicted per round (PerCache's prediction stride)."""
    passage_depth: int = 2
    """Beyond PerCache: a knowledge round also prefills, for each of its passages, the path a question
    about it most likely retrieves, where the tree lacks it (`actors.ragfront.RagCache.cache_passage`):
    the passage right after the prompt's head, then the passages that a search with its own text ranks
    next, this many passages in all. A question whose best passage had its round then reuses that
    passage's K/V (a predicted question about a passage often retrieves another first), and its next
    passage's too when that is the nearest one. 1: the passage alone; 0: off (the tree holds the
    predicted questions' paths only). About 0.2 s of idle time and 6 MB a passage and level for the
    default model; docs/benchmarks.md ("RAG cache") says what each level buys."""
    answers_after_coverage: bool = True
    """Beyond PerCache: with the K/V tree on, a question predicted from a passage is prefilled only, and
    answered (when the cache scheduler says decoding pays) once every passage has its question, so a
    day's budget covers the passages' K/V first (`scheduler.ragcache.CacheScheduler.populate`). Off:
    decoded at once."""
    mains_only: bool = False
    """Predict only on mains power (where the system reports a battery)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.blend_ratio <= 1.0:
            raise ValueError(f"rag.blend_ratio must be within [0, 1], got {self.blend_ratio!r}")
        if self.passage_depth < 0:
            raise ValueError(f"rag.passage_depth must be >= 0, got {self.passage_depth!r}")


@dataclass(slots=True)
class ServiceConfig:
    data_dir: str = field(default_factory=lambda: os.environ.get("LLMAAS_DATA_DIR", "./data"))
    """Registry and chunk files live here."""
    policy: str = "llms"
    """Memory policy set (scheduler.policies.POLICIES)."""
    pool_bytes: int = 256 << 20
    """KV pool budget: resident chunks as stored, bytes."""
    max_context_tokens: int = 0
    """Longest context before overflow handling, tokens (also the working set's size); 0: the model's
    position limit (8,192 for the default model)."""
    prefill_budget_bytes: int = 0
    """Memory a call's prefill may take, bytes: its transient tensors and the context's K/V in the working
    set, as estimated before it runs (`actors.admission`); a prompt that does not fit even in row
    partitions answers 413 before any work. 0: no budget."""
    max_contexts_per_app: int = 0
    """Per-app limit K of contexts; 0 for none."""
    read_bytes_per_s: float = 0.0
    """Chunk read throttle emulating slow storage, bytes/s; 0 for none."""
    read_burst_bytes: int = 256 * 1024
    """Bytes the throttle lets through at once after an idle spell (token bucket depth)."""
    disk_cap_bytes: int = 0
    """Chunk file disk cap, bytes; 0 for none."""
    chunk_tokens: int = 16
    """Tokens per KV chunk."""
    overlap_admit: bool = True
    """On Ray: a call waits only until the previous call's write-back has encoded its chunks from the
    working set; the rest (putting them in the object store, the governor's `admit`) overlaps the call.
    A call on the context the working set holds does not wait even for the encoding (it only appends
    past the slots encoded), and asks for the context's lock (which that `admit` releases) once the
    write-back is done, before its commit. False: a call waits for the whole write-back."""
    weights: str = "fp32"
    """Weight format the model runs in (engine.quant.WeightFormat: `fp32`, `bf16`, `int8`, `int4`,
    `int4-g128`, ...); converted once into the model cache. Part of every chunk's `KVKey`: K/V made
    under one format is never restored under another."""
    weights_resident_bytes: int | None = None
    """Weights larger than memory: the smallest weight fragments stay resident up to this many bytes,
    the rest are streamed per block from the mapped weight file in every process that runs the model
    (engine/weightpager.py; CPU only). None: every weight resident."""
    kv_format: str = "float"
    """How contexts' K/V is held in the working set (engine.kvformat): `float` (the compute dtype) or
    `kv8` (keys int8, values fp8 e4m3, one scale per token and head: about a quarter of float32). A kv8
    chunk is swapped as its bytes; the planner lowers it to q4/q2 only. Lossy, so refused under a
    lossless policy. Part of every chunk's `KVKey`."""
    adapter_root: str = ""
    """Folder the LoRA adapters are loaded from (PEFT directories, engine.lora); a path or symlink
    leading out of it is refused. Empty: `<data_dir>/adapters`."""
    tuning: Tuning = field(default_factory=Tuning)
    """Speed-only optimisations, each switchable (`Tuning`)."""
    rag: RagConfig = field(default_factory=RagConfig)
    """The RAG cache (the query predictor's): retrieval depth, QA bank and K/V tree, their caps."""
    profile: str = ""
    """Pipeline cost profile as JSON (scheduler.pipeline.CostProfile); empty: measured once per machine,
    model and throttle, then cached (`llmaas profile` re-runs it)."""
    per_ref_s: float = 0.0
    """On Ray: what handing one streamed object ref from the IO worker to its consumer costs, seconds,
    which sizes a restore's layer groups and chunk batches (`scheduler.pipeline.layer_group_size`); 0:
    measured when the executor starts (`actors.ray_restore.per_ref_seconds`)."""

    def __post_init__(self) -> None:
        if isinstance(self.tuning, dict):  # from a config file or a Serve application's arguments
            self.tuning = tuning_from(self.tuning)
        if isinstance(self.rag, dict):
            self.rag = RagConfig(**self.rag)
        self.weights = WeightFormat.parse(self.weights).tag  # validates; one spelling per format
        if self.prefill_budget_bytes < 0:
            raise ValueError("prefill_budget_bytes must be >= 0 (0: no budget)")
        if self.weights_resident_bytes is not None and self.weights_resident_bytes < 0:
            raise ValueError("weights_resident_bytes must be >= 0 (None: every weight resident)")
        if not self.per_ref_s >= 0:
            raise ValueError(f"per_ref_s must be >= 0 (0: measured at start), got {self.per_ref_s!r}")
        check_working_set(self.kv_format, self.policy)

    def adapter_dir(self) -> str:
        """The adapter root in effect (`adapter_root`, or `<data_dir>/adapters`)."""
        return self.adapter_root or os.path.join(self.data_dir, "adapters")


def check_working_set(kv_format: str, policy: str) -> None:
    """ValueError for an unknown KV format, or a lossy one (kv8) under a policy that promises lossless
    K/V."""
    from scheduler.policies import get_policy

    check_kv_format(kv_format)
    if kv_format != "float" and get_policy(policy).compression == "none":
        raise ValueError(f"policy {policy!r} is lossless: it cannot run on a {kv_format} working set "
                         "(use kv_format float, or a policy that compresses, e.g. llms)")


def tuning_from(options: dict) -> Tuning:
    """`Tuning` from a mapping of its field names (values as booleans, numbers or their strings, as a
    config file or `serve run ... tuning.NAME=VALUE` gives them); unknown names are an error."""
    from dataclasses import fields

    known = {f.name: f for f in fields(Tuning)}
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"unknown tuning options {unknown}; valid: {sorted(known)}")
    out = {}
    for name, v in options.items():
        default = getattr(Tuning(), name)
        if isinstance(default, bool):
            if isinstance(v, bool):
                out[name] = v
            elif str(v).lower() in ("1", "true", "yes", "on"):
                out[name] = True
            elif str(v).lower() in ("0", "false", "no", "off"):
                out[name] = False
            else:
                raise ValueError(f"tuning option {name} takes true or false, got {v!r}")
        else:
            out[name] = int(v)
    return Tuning(**out)


def prepare_data_dir(path: str | os.PathLike) -> None:
    """Make the data directory owner-only: it holds every app's conversations. Creates it 0700, makes
    this process create files 0600 and folders 0700 from now on (umask 077), and tightens what is
    already there (an older version left the registry 0644 in a 0755 folder). Every process of the
    service that writes under it calls this, or `private_files` when the folder exists already."""
    private_files()
    root = os.fspath(path)
    os.makedirs(root, mode=0o700, exist_ok=True)
    for dirpath, _dirs, files in os.walk(root):
        _tighten(dirpath, 0o700)
        for name in files:
            _tighten(os.path.join(dirpath, name), 0o600)


def private_files() -> None:
    """Files and folders this process creates are its owner's alone (umask 077)."""
    os.umask(0o077)


def _tighten(path: str, mode: int) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:  # removed meanwhile (another process's temp file)
        return
    import stat

    if not stat.S_ISLNK(st.st_mode) and stat.S_IMODE(st.st_mode) & ~mode:
        os.chmod(path, stat.S_IMODE(st.st_mode) & mode)
