"""The messages that cross between the service's roles: call plans, restore requests and their
statistics, call outcomes, handles of resident chunks, and the key every cached K/V carries.

Plain `slots` dataclasses, importable without Ray, torch or a model: the in-process transport passes
them as objects, the Ray transport pickles them. Every actor module takes its types from here, so no
actor module imports another to get a type. What each role does with them is in `actors.ports`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np


class CallInterruptedError(RuntimeError):
    """A call stopped by an actor failure (the actor restarts and rebuilds its state)."""

    code = "interrupted"


class PreemptedError(RuntimeError):
    """Low-priority work (the query predictor's, `RagCall.background`) gave the model executor up to
    a real call at a layer or token boundary; nothing of it was kept."""

    code = "preempted"


class CallTimeoutError(TimeoutError):
    """A call ran past its deadline (`time.time()` seconds); what it had done was rolled back."""

    code = "timeout"


def check_deadline(deadline: float | None, message: str) -> None:
    """`CallTimeoutError(message)` once `deadline` has passed (None: none)."""
    if deadline is not None and time.time() > deadline:
        raise CallTimeoutError(message)


# ---- keys ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KVKey:
    """What K/V was computed under. K/V made under one key is never attended under another: chunk
    records carry the key's model part (`record_tag`) and a reader refuses a record with another tag;
    contexts belong to one app, so no cached K/V crosses apps."""

    fingerprint: str
    """The model weights' identity (`engine.loader`'s fingerprint of the checkpoint)."""
    weight_format: str = "fp32"
    """The weights' format as computed with (`fp32`; quantized formats give other K/V)."""
    adapter: str = ""
    """The LoRA adapter applied, "" for the base model."""
    kv_format: str = "float"
    """How the working set held the K/V (`engine.kvformat`): a `kv8` set's chunks are its rows."""
    app: str = ""
    """The app the K/V belongs to, "" for the model part alone."""

    def model_part(self) -> "KVKey":
        """The key without its app: what a chunk store shared by every app checks."""
        return replace(self, app="")

    def record_tag(self) -> str:
        """The string chunk records carry. The base format (`fp32`, no adapter, float K/V) is the bare
        fingerprint, which is what records written before weight formats and adapters existed carry."""
        tag = self.fingerprint
        if self.weight_format != "fp32":
            tag += f";w={self.weight_format}"
        if self.adapter:
            tag += f";a={self.adapter}"
        if self.kv_format != "float":
            tag += f";kv={self.kv_format}"
        return tag


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """A LoRA adapter as a message names it: enough for a process of the node to load it from the
    adapter root (`engine.lora.AdapterSet.resolve`) and to check that it is the same one."""

    name: str
    """What callers select it by."""
    path: str
    """Its directory under the node's adapter root."""
    key: str
    """`name@digest` of its files (`KVKey.adapter`)."""

    @staticmethod
    def of(adapter) -> "AdapterRef | None":
        """The reference to a loaded `engine.lora.Adapter` (None for the base model)."""
        return AdapterRef(adapter.name, adapter.path, adapter.key) if adapter is not None else None


@dataclass(frozen=True, slots=True)
class PoolRef:
    """A resident chunk on Ray: where it is in the object store, and a small key for it. The executor
    puts the chunks of one write-back a few to an object (a list of `EncodedChunk`s,
    `actors.config.Tuning.object_chunks`: fewer object-store allocations), which lives while any of its
    chunks is resident. The governor holds the handle (the IO worker writes from it) and sends it
    back in plans; the executor finds its own zero-copy view of the chunk by the key."""

    key: int
    """Number the executor gave the chunk when it put it (unique per executor process)."""
    ref: Any
    """`ray.ObjectRef` of the list of encoded chunks the chunk was put with."""
    index: int
    """The chunk's position in that list."""


# ---- a call --------------------------------------------------------------------------------------


@dataclass(slots=True)
class CallPlan:
    """What the executor needs to make a context's K/V attendable, and to run the call (the governor's
    answer to `begin_call`)."""

    ctx: str
    """The context's id."""
    token_ids: np.ndarray
    """int32 token ids (the source of truth), including ids without K/V yet."""
    state: str | None
    """The executor's saved per-context state (JSON), None for a fresh context."""
    density: bytes
    """The context's saved attention-density sums (`actors.executor.density_blob`)."""
    kv_tokens: int
    """Tokens of the context that have K/V (chunks to restore cover them)."""
    resident: list[tuple[int, str, Any]]
    """(chunk index, level, handle) of chunks in the pool; on Ray the handle is a `PoolRef.key`."""
    load: list[tuple[int, str, str]]
    """(chunk index, level, file name) to read from disk."""
    recompute: list[int]
    """Chunk indices to recompute from token ids."""
    predicted_s: float = 0.0
    """Predicted restore (pipeline) time, seconds: the profile's models corrected online."""
    model_predicted_s: float = 0.0
    """The same restore as the one-shot profile alone predicts it, seconds (for comparison)."""
    evicted_for_restore: int = 0
    """Chunks evicted to make room for this restore."""
    wrote_on_demand: int = 0
    """Chunks written to disk during this call's switch (on-demand swap-out)."""
    adapter: str = ""
    """Key (`name@digest`) of the LoRA adapter the context is computed under, "" for none."""


@dataclass(slots=True)
class CommitReply:
    """The governor's answer to `commit_call`."""

    todo: dict[int, str]
    """Chunk index -> level, for every chunk the executor must encode and `admit` now."""
    repeated: bool = False
    """The call's request id had already been committed: nothing was appended this time."""
    write_through: bool = False
    """The executor writes the `todo` chunks to disk itself and `admit`s them as `stored`, not through
    the pool (asked for with `streamed_from`, given under a swap policy): a context larger than the memory
    budget never has all its encoded chunks in memory at once. The context's writes in flight are
    done, so none lands after the executor's. (Under the kill policy such a context is killed at once
    instead, and `todo` is empty.)"""


@dataclass(slots=True)
class RestoreRequest:
    """A restore handed to the recompute worker (Ray) or run by `actors.restore.restore`."""

    ctx: str
    """The context's id."""
    kv_tokens: int
    """Tokens to restore (the working set is reserved to this length)."""
    token_ids: np.ndarray
    """The context's token ids, for recompute."""
    resident: list[tuple[int, Any]]
    """(chunk index, handle) of chunks decoded from the pool."""
    load: list[int]
    """Chunk indices read from disk, layer group by layer group."""
    recompute: list[int]
    """Chunk indices recomputed from token ids."""
    groups: list[range]
    """Layer groups the IO worker streams."""
    shm_name: str = ""
    """The executor's working-set segment."""
    capacity: int = 0
    """Its capacity in tokens."""
    present: list[int] = field(default_factory=list)
    """Chunks the caller fills itself: concurrently with a restore that recomputes nothing (resident
    chunks the executor decodes while this restore loads others), or before it (a recompute reads them)."""
    adapter: AdapterRef | None = None
    """The LoRA adapter the context is computed under (recompute runs under it)."""
    recompute_failed: bool = True
    """Recompute loaded chunks whose file failed here; False: leave them missing, listed in `failed`,
    for the caller (whose concurrent `present` chunks a recompute would read half-filled)."""
    resident_layers: int | None = None
    """For a working set that streams layers (a context larger than its budget): layers at or past
    this one are written out of memory as the restore fills them. None: all stay."""


@dataclass(slots=True)
class RestoreStats:
    """What one restore did (in one process or on Ray); part of a call's outcome."""

    resident: int = 0
    """Chunks decoded from the pool."""
    loaded: int = 0
    """Chunks read from disk."""
    loaded_bytes: int = 0
    """Bytes of those chunks as stored."""
    recomputed: int = 0
    """Chunks recomputed from token ids (planned and faults)."""
    faults: int = 0
    """Chunks whose file was missing or corrupt, recomputed instead."""
    failed: dict[int, str] = field(default_factory=dict)
    """Those chunks' error codes."""
    seconds: float = 0.0
    """Wall time of the restore itself."""
    timeline: list = field(default_factory=list)
    """(what, layer or group, start, end) events, time.monotonic() seconds, for pipeline tests."""


@dataclass(slots=True)
class CallOutcome:
    """A call's reply and what it cost (the HTTP reply's fields come from here)."""

    text: str
    """The assistant turn's text."""
    token_ids: list[int]
    """Its token ids."""
    finish_reason: str
    """`stop`, `length` or the stop string's reason, as the engine gives it."""
    prompt_tokens: int
    """Tokens the user turn added."""
    completion_tokens: int
    """Tokens generated."""
    switch_ms: float
    """Context switching latency: from the call's arrival until every K/V of the context can be
    attended in the compute dtype (restore and any pending write-back; not the new prompt)."""
    restore: RestoreStats
    """What the restore did."""
    predicted_restore_ms: float
    """The planner's prediction of the restore, ms (0 for a hit)."""
    model_restore_ms: float
    """The one-shot profile's own prediction of it, without online correction, ms."""
    ttft_s: float
    """Time to first token from the call's arrival at the executor (switch included), seconds."""
    total_s: float
    """The call's wall time at the executor, seconds."""
    prefilled_tokens: int
    """Tokens prefilled by this call."""
    cached_tokens: int
    """Tokens whose K/V was restored rather than prefilled."""
    hit: bool = False
    """The working set still held the whole context: nothing was restored."""
    context_tokens: int = 0
    """Tokens the model attended when it began the reply (the conversation so far, after any overflow;
    the OpenAI route's `usage.prompt_tokens`)."""
    dropped_tokens: int = 0
    """Tokens the overflow rule cut from the context's start during this call."""
    prefill_plan: str = ""
    """How the prefill ran under `ServiceConfig.prefill_budget_bytes` (`none`, `moderate`, `severe`); ""
    without a budget."""
    streamed_bytes: int = 0
    """K/V bytes the call (prefill and decode) wrote out of memory layer by layer (a `severe` plan)."""


@dataclass(slots=True)
class WithReleases:
    """The governor actor's answer to a call from the executor on Ray: the call's own result, with the
    keys of the resident chunks the governor dropped since the executor last heard (their object refs
    can go) and the governor process's epoch (a new one holds none of the old keys)."""

    value: Any
    """What the `MemoryGovernor` method returned (a plan's resident chunks named by `PoolRef.key`)."""
    released: list[int]
    """`PoolRef.key`s of chunks no longer resident."""
    epoch: str
    """Random per governor process."""


# ---- RAG (PerCache; actors.rag) ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeSpan:
    """A node of the K/V tree as a RAG call moves it: the K/V of prompt slots `[start, end)`, kept as
    chunk records (16 tokens each, the last partial, always raw) under the node's own store key."""

    key: str
    """The node's chunk-store key (`actors.rag.node_key`: app, KV key and retrieval path)."""
    start: int
    """Its first slot in the prompt."""
    end: int
    """One past its last slot."""


@dataclass(frozen=True, slots=True)
class BlendSpan:
    """A passage whose K/V a RAG call takes from a node of another retrieval path (CacheBlend): the node
    computed it at slots `[source, source + end - start)` after another prefix; placed at `[start, end)`
    with its keys turned by the slots between, then partly recomputed. Approximate: never saved as a node."""

    key: str
    """The donor node's chunk-store key."""
    source: int
    """The donor's first slot in its own prompt."""
    start: int
    """The passage's first slot in this prompt."""
    end: int
    """One past its last slot."""


@dataclass(slots=True)
class RagCall:
    """What the executor runs for one RAG prompt: the K/V of `load` read into the first slots, the rest
    prefilled, a reply decoded, and the K/V of `save` written as new nodes."""

    app: str
    """The app the prompt belongs to (its nodes are its own)."""
    adapter: str
    """Key of the LoRA adapter computed under, "" for none (the records carry it)."""
    ids: list[int]
    """The prompt's token ids (`engine.rag.RagTemplate.build`)."""
    load: list[NodeSpan]
    """Cached nodes, in order, tiling `[0, load[-1].end)`: the head first, then the matched passages."""
    save: list[NodeSpan]
    """Nodes to write after the call (slots past `load`), in order."""
    params: dict
    """Sampling parameters (`engine.sampling.SamplingParams`'s fields)."""
    decode: bool = True
    """False: prefill only (populating the K/V tree ahead of a predicted query; no reply)."""
    background: bool = False
    """Low priority (the query predictor's idle work): it yields to any real call at the next layer of
    its prefill or token of its reply (`PreemptedError`), so a real call waits for one such slice."""
    deadline: float | None = None
    """`time.time()` past which the call stops before its next node, layer or token (`CallTimeoutError`;
    nothing is written). None: no deadline."""
    blend: list[BlendSpan] = field(default_factory=list)
    """Passages after `load` whose K/V comes from other paths' nodes, in order, tiling the slots from
    `load[-1].end`; `save` is then empty (`RagConfig.blend_ratio`)."""
    blend_ratio: float = 0.0
    """The share of each blended passage's tokens recomputed, from its first (`engine.rag.blend_rows`)."""


@dataclass(slots=True)
class RagOutcome:
    """What a `RagCall` did."""

    text: str
    """The reply ("" when not decoded)."""
    token_ids: list[int]
    """Its token ids."""
    finish_reason: str
    """As `CallOutcome.finish_reason`; "" when not decoded."""
    reused_tokens: int
    """Prompt tokens whose K/V came from cached nodes of this path (exact reuse)."""
    loaded: list[str]
    """Keys of the nodes read (a node that failed to read, and every node after it, is recomputed)."""
    saved: dict[str, int]
    """Key -> bytes written of each node saved (the failed loads among them)."""
    load_s: float
    """Seconds reading and placing cached K/V."""
    prefill_s: float
    """Seconds prefilling the rest of the prompt (to the first token)."""
    decode_s: float
    """Seconds decoding after the first token."""
    save_s: float
    """Seconds encoding and writing new nodes."""
    blended: list[str] = field(default_factory=list)
    """Keys of the donor nodes whose K/V was placed (`RagCall.blend`; a failed read ends the blend)."""
    blended_tokens: int = 0
    """Prompt tokens whose K/V came from donor nodes, recomputed ones included."""
    recomputed_tokens: int = 0
    """Of those, the tokens recomputed."""
    blend_s: float = 0.0
    """Seconds reading, moving and partly recomputing the donors' K/V."""
