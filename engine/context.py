"""Contexts in one process: the LLMS Table 1 interface (`new_ctx`, `call`, `delete_ctx`) over the engine.

This module deliberately knows nothing about memory management (which chunks stay resident,
compression, swapping: the memory governor drives `KVCache` and `Transformer.recompute*` directly),
about storage or Ray: a `LiveContext` lives and dies in this process.

A context owns its token ids (the source of truth), its conversation turns, a KV working buffer and the
information density of its tokens. A call appends one user turn (rendered with the model's chat
template), prefills only the ids whose K/V are not computed yet, and decodes a reply. When a context
would pass its maximum length, the first chunk (the attention sink) and the newest chunks up to
`overflow_keep_fraction` of the limit (or, for a longer new turn, the whole turn) are kept and
re-prefilled as a fresh sequence, so that positions stay consistent and recompute stays exact. A turn
may take the limit less three chunks (`ContextEngine.tail_room`).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from engine.chat import ChatTokenizer, Conversation, Turn
from engine.config import EngineConfig, round_up
from engine.density import DensityTracker
from engine.kvcache import KVCache
from engine.lookup import LookupStats, draft
from engine.lora import Adapter
from engine.model import Transformer
from engine.qlinear import decode_rows
from engine.sampling import BadRequestError, Penalties, SamplingParams, find_stop, holdback, sample


class PromptTooLongError(BadRequestError):
    code = "prompt_too_long"


class UnknownContextError(KeyError):
    code = "not_found"


@dataclass(slots=True)
class LiveContext:
    """A context as the engine runs it in this process: its ids, turns, K/V working buffer and densities.

    "Live" because its K/V are attendable here, now; what outlives the process (the registry's record,
    the governor's books, chunk files) is held elsewhere, under other names."""

    id: str
    """Opaque id: made by `new_ctx`, or given by whoever builds the context; "" for a throwaway one."""
    system_prompt: str | None
    token_ids: list[int]
    """Every token of the context, including ids not prefilled yet (the tail past `cache.length`)."""
    conv: Conversation
    """The turns the ids were rendered from."""
    cache: KVCache
    """The K/V working buffer; slots `< cache.length` are computed."""
    density: DensityTracker
    """Information density of the computed tokens (LLMS Eq. 1)."""
    prefilled_tokens: int = 0
    """Tokens this context ran through prefill or decode (a second call prefills only new tokens)."""
    overflows: int = 0
    """Times the context was cut back to its sink and newest chunks."""
    dropped_tokens: int = 0
    """Tokens those cuts removed, over the context's life."""
    created: float = field(default_factory=time.time)
    adapter: Adapter | None = None
    """The LoRA adapter its K/V is computed under (engine.lora), None for the base model."""


@dataclass(slots=True)
class CallResult:
    text: str
    """The reply as shown to a user (stop string and special tokens excluded)."""
    token_ids: list[int]
    """Generated ids, EOS included when the model ended the reply."""
    finish_reason: str
    """`stop` (EOS or a stop string) or `length` (max_tokens)."""
    prompt_tokens: int
    """Ids the user turn added."""
    prefilled_tokens: int
    """Ids prefilled for this call before decoding (pending ids from earlier turns included; after an
    overflow, every id kept)."""
    cached_tokens: int
    """Ids whose K/V were reused from before the call."""
    completion_tokens: int
    ttft_s: float
    """Seconds from the call's start to the first generated token."""
    total_s: float
    context_tokens: int = 0
    """Ids the model attended when it began the reply: the conversation so far, after any overflow
    (what an OpenAI `usage.prompt_tokens` counts)."""
    dropped_tokens: int = 0
    """Ids the overflow rule cut from the context's start during this call (0 when it fitted)."""


@dataclass(frozen=True, slots=True)
class PrefillProgress:
    """A stream's event while a long prompt is prefilled (`ContextEngine.stream(..., progress=True)`)."""

    layers_done: int
    """Layers every new token has passed."""
    layers: int
    """Layers in all."""
    tokens: int
    """Tokens being prefilled."""


PROGRESS_MIN_TOKENS = 128
"""Prefills of fewer tokens send no progress events."""


@dataclass(slots=True)
class _Snapshot:
    """What a call may change in a context, to put back if the call does not complete."""

    token_ids: list[int]
    n_turns: int
    cache: KVCache
    cache_length: int
    density: tuple
    overflows: int
    prefilled_tokens: int
    dropped_tokens: int

    @classmethod
    def take(cls, ctx: "LiveContext") -> "_Snapshot":
        return cls(
            list(ctx.token_ids), len(ctx.conv.turns), ctx.cache, ctx.cache.length,
            (ctx.density.sums.copy(), ctx.density.rows.copy()), ctx.overflows, ctx.prefilled_tokens,
            ctx.dropped_tokens,
        )

    def restore(self, ctx: "LiveContext") -> None:
        ctx.token_ids = self.token_ids
        del ctx.conv.turns[self.n_turns :]
        ctx.cache = self.cache
        ctx.cache.truncate(self.cache_length)
        ctx.density.sums, ctx.density.rows = self.density
        ctx.overflows = self.overflows
        ctx.prefilled_tokens = self.prefilled_tokens
        ctx.dropped_tokens = self.dropped_tokens


class CallStream:
    """Iterates over text deltas of a reply; `result` is set once iteration ends."""

    def __init__(self, gen: Iterator[str]) -> None:
        self._gen = gen
        self.result: CallResult | None = None

    def __iter__(self):
        self.result = yield from self._gen
        return self.result


class ContextEngine:
    def __init__(self, model: Transformer, tokenizer: ChatTokenizer, config: EngineConfig | None = None) -> None:
        self.model = model
        self.tok = tokenizer
        self.cfg = config or model.engine_cfg
        self.limit = min(self.cfg.max_context_tokens or model.cfg.max_positions, model.cfg.max_positions)
        self.eos_ids = set(model.cfg.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.contexts: dict[str, LiveContext] = {}
        self.fingerprint = model.fingerprint
        """Identity of the loaded weights (see `engine.loader.ResolvedModel`)."""
        self.lookup = LookupStats()
        """Lookup decoding's counts (`EngineConfig.lookup_draft`)."""
        self.pass_rows = decode_rows([model.w.lm_head] + [getattr(layer, name) for layer in model.w.layers
                                                          for name in ("wqkv", "wo", "w_gate_up", "w_down")])
        """Most rows a lookup pass checks (0: no bound)."""

    @classmethod
    def load(cls, model_path=None, config: EngineConfig | None = None, *, progress: bool = True) -> "ContextEngine":
        """Load a model (the embedded default when `model_path` is None) with its tokenizer."""
        from engine.loader import resolve_model

        resolved = resolve_model(model_path, progress=progress)
        model = Transformer.from_directory(resolved.directory, config, fingerprint=resolved.fingerprint)
        engine = cls(model, ChatTokenizer(resolved.directory), config)
        model.warmup()
        return engine

    # ---- LLMS Table 1 ------------------------------------------------------------------------------
    def new_ctx(self, system_prompt: str | None = None, adapter: Adapter | None = None) -> LiveContext:
        """A context; `adapter`: the LoRA adapter it is computed under (engine.lora), for its life."""
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise BadRequestError("system_prompt must be a string")
        conv = Conversation([Turn("system", system_prompt)] if system_prompt is not None else [])
        ids = self.tok.system_ids(system_prompt)
        if len(ids) > self.tail_room():
            raise PromptTooLongError(f"system prompt of {len(ids)} tokens exceeds the context limit")
        ctx = LiveContext(
            id=secrets.token_hex(16),
            system_prompt=system_prompt,
            token_ids=ids,
            conv=conv,
            cache=self.model.new_cache(round_up(len(ids) + 256, self.cfg.chunk_tokens), self.cfg.kv_format),
            density=DensityTracker(self.model.cfg.n_heads, self.model.cfg.n_layers),
            adapter=adapter,
        )
        self.contexts[ctx.id] = ctx
        return ctx

    def get(self, ctx_id: str) -> LiveContext:
        try:
            return self.contexts[ctx_id]
        except KeyError:
            raise UnknownContextError(ctx_id) from None

    def delete_ctx(self, ctx: LiveContext | str) -> None:
        ctx_id = ctx if isinstance(ctx, str) else ctx.id
        if self.contexts.pop(ctx_id, None) is None:
            raise UnknownContextError(ctx_id)

    def call(self, ctx: LiveContext, prompt: str, **params) -> CallResult:
        stream = self.stream(ctx, prompt, **params)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(self, ctx: LiveContext, prompt: str, progress: bool = False, partition_rows: int | None = None,
               **params) -> CallStream:
        """Start a call; iterate the returned stream for text deltas (and, with `progress`, a
        `PrefillProgress` after each layer of a prefill of `PROGRESS_MIN_TOKENS` or more, before the
        first delta). `partition_rows`: the prefill's row partitions (`Transformer.forward_steps`).
        Arguments are checked here, before anything in the context changes."""
        if not isinstance(prompt, str):
            raise BadRequestError("prompt must be a string")
        sp = SamplingParams(**params)
        new_ids = self.tok.user_turn_ids(ctx.conv, prompt)
        if len(new_ids) + 1 > self.tail_room():
            raise PromptTooLongError(
                f"prompt of {len(new_ids)} tokens does not fit the context limit of {self.limit} tokens"
            )
        return CallStream(self._run(ctx, prompt, new_ids, sp, progress, partition_rows))

    # ---- internals ---------------------------------------------------------------------------------
    def tail_room(self) -> int:
        """Most tokens a fresh turn may take: the limit less the sink chunk and two chunks of room (the
        previous reply's closing ids, and the first tokens of the reply). Overflow keeps such a turn
        whole after the sink, cutting only older tokens (`_overflow`)."""
        return self.limit - 3 * self.cfg.chunk_tokens

    def new_tokens(self, ctx: LiveContext, prompt: str) -> int:
        """Tokens a call with `prompt` would prefill on `ctx` (pending ids and the user turn)."""
        return len(ctx.token_ids) - ctx.cache.length + len(self.tok.user_turn_ids(ctx.conv, prompt))

    def _step(self, ctx: LiveContext, progress: bool = False, partition_rows: int | None = None,
              all_logits: bool = False):
        """Prefill every pending id of `ctx` (overflowing first if needed): a generator of
        `PrefillProgress` events (with `progress`, for a long prefill) returning the last id's logits
        (`[n, V]`, a row per pending id, with `all_logits`)."""
        if len(ctx.token_ids) > self.limit:
            self._overflow(ctx)
        pending = ctx.token_ids[ctx.cache.length :]
        start = ctx.cache.length
        acc = torch.zeros(start + len(pending), dtype=torch.float32, device=self.model.device)
        steps = self.model.forward_steps(ctx.cache, pending, density=acc, adapter=ctx.adapter,
                                         partition_rows=partition_rows, all_logits=all_logits)
        report = progress and len(pending) >= PROGRESS_MIN_TOKENS
        try:
            while True:
                try:
                    done = next(steps)
                except StopIteration as stop:
                    logits = stop.value
                    break
                if report:
                    yield PrefillProgress(done, self.model.cfg.n_layers, len(pending))
        finally:  # a stream closed mid-prefill: the forward pass undoes its rows now, not when collected
            steps.close()
        ctx.density.add(start, len(pending), acc.cpu().numpy())
        ctx.prefilled_tokens += len(pending)
        return logits

    def _overflow(self, ctx: LiveContext) -> None:
        c = self.cfg.chunk_tokens
        keep = int(self.limit * self.cfg.overflow_keep_fraction)
        ids = ctx.token_ids
        tail_start = round_up(max(c, len(ids) - (keep - c)), c)  # newest whole chunks
        turn_start = ctx.cache.length  # what is not prefilled yet: the new turn (or the token just sampled)
        if tail_start > turn_start and c + (len(ids) - turn_start) + c <= self.limit:
            # a turn longer than what overflow keeps is kept whole, after the sink: only older tokens go
            tail_start = max(c, turn_start // c * c)
        ctx.token_ids = ids[:c] + ids[tail_start:]
        ctx.cache = self.model.new_cache(round_up(len(ctx.token_ids) + 256, c), self.cfg.kv_format)
        ctx.density.reset()
        ctx.overflows += 1
        ctx.dropped_tokens += len(ids) - len(ctx.token_ids)

    def _run(self, ctx: LiveContext, prompt: str, new_ids: list[int], sp: SamplingParams, progress: bool = False,
             partition_rows: int | None = None):
        t0 = time.perf_counter()
        saved = _Snapshot.take(ctx)
        try:
            ctx.conv.turns.append(Turn("user", prompt))
            ctx.token_ids.extend(new_ids)
            out, text, finish, ttft, seen, prefilled = yield from self._decode(ctx, sp, t0, progress,
                                                                               partition_rows)
        except BaseException:
            # a failed or abandoned call (error, client gone, generator closed) leaves no half turn
            saved.restore(ctx)
            raise
        closing = self.tok.reply_closing_ids(ctx.conv)
        if closing and out[-1] in self.eos_ids and closing[0] == out[-1]:
            closing = closing[1:]
        ctx.token_ids.extend(closing)  # prefilled with the next turn
        ctx.conv.turns.append(Turn("assistant", text, list(out)))
        return CallResult(
            text=text,
            token_ids=out,
            finish_reason=finish,
            prompt_tokens=len(new_ids),
            prefilled_tokens=prefilled,
            cached_tokens=seen - prefilled,
            completion_tokens=len(out),
            ttft_s=ttft,
            total_s=time.perf_counter() - t0,
            context_tokens=seen,
            dropped_tokens=ctx.dropped_tokens - saved.dropped_tokens,
        )

    def complete(self, prompt: str, adapter: Adapter | None = None, progress: bool = False, **params) -> CallStream:
        """Plain completion of `prompt` (no chat template) in a throwaway context, under the LoRA
        `adapter` when given (`progress` as for `stream`)."""
        if not isinstance(prompt, str) or not prompt:
            raise BadRequestError("prompt must be a non-empty string")
        sp = SamplingParams(**params)
        ids = self.tok.encode_document(prompt)
        if len(ids) + 1 > self.tail_room():
            raise PromptTooLongError(f"prompt of {len(ids)} tokens does not fit the context limit of {self.limit} tokens")
        return self.generate(self.throwaway(ids, sp.max_tokens, adapter), sp, progress)

    def throwaway(self, ids: list[int], room: int = 0, adapter: Adapter | None = None,
                  cache: KVCache | None = None) -> LiveContext:
        """A context of no conversation holding `ids`, none prefilled yet, with slots for `room` more
        tokens; the caller may fill its first slots with K/V computed before (`engine.rag`). `cache`: a
        working set to use (emptied) instead of a new one."""
        if cache is not None:
            cache.truncate(0)
            cache.missing = set()
            cache.ensure_capacity(round_up(len(ids) + room, self.cfg.chunk_tokens))
        return LiveContext(
            id="",
            system_prompt=None,
            token_ids=list(ids),
            conv=Conversation(),
            cache=cache if cache is not None else self.model.new_cache(round_up(len(ids) + room, self.cfg.chunk_tokens),
                                                                       self.cfg.kv_format),
            density=DensityTracker(self.model.cfg.n_heads, self.model.cfg.n_layers),
            adapter=adapter,
        )

    def generate(self, ctx: LiveContext, sp: SamplingParams, progress: bool = False) -> CallStream:
        """Prefill what `ctx` holds past its computed slots and decode a reply (no turn is recorded)."""
        n_ids = len(ctx.token_ids)
        if len(ctx.density) < ctx.cache.length:  # slots filled with K/V computed before: no densities
            ctx.density.skip(ctx.cache.length - len(ctx.density))

        def run():
            t0 = time.perf_counter()
            out, text, finish, ttft, seen, prefilled = yield from self._decode(ctx, sp, t0, progress)
            return CallResult(text, out, finish, n_ids, prefilled, seen - prefilled, len(out), ttft,
                              time.perf_counter() - t0, context_tokens=seen, dropped_tokens=ctx.dropped_tokens)

        return CallStream(run())

    def _decode(self, ctx: LiveContext, sp: SamplingParams, t0: float, progress: bool = False,
                partition_rows: int | None = None):
        """Prefill what is pending and decode a reply, yielding text deltas; returns (generated ids, text,
        finish reason, seconds to first token, ids attended for the first token, ids prefilled for it)."""
        gen = sp.generator(self.model.device)
        out: list[int] = []
        emitted = 0
        finish = "length"
        ttft = 0.0
        text = ""
        before = ctx.prefilled_tokens
        logits = yield from self._step(ctx, progress, partition_rows)
        seen, prefilled = len(ctx.token_ids), ctx.prefilled_tokens - before
        pen = Penalties(sp, ctx.token_ids, logits.shape[-1], logits.device) if sp.penalized else None
        ahead: list[int] = []  # tokens a lookup pass checked: already in the context and its cache
        while True:
            if ahead:
                tok = ahead.pop(0)
            else:
                tok = sample(logits if pen is None else pen.apply(logits), sp, gen)
                ctx.token_ids.append(tok)
            if pen is not None:
                pen.add(tok)
            if not out:
                ttft = time.perf_counter() - t0
            out.append(tok)
            text = self.tok.decode_reply(out)
            if tok in self.eos_ids:
                finish = "stop"
                break
            cut = find_stop(text, sp.stop) if sp.stop else -1
            if cut >= 0:
                text, finish = text[:cut], "stop"
                break
            if len(out) >= sp.max_tokens:
                break
            safe = len(text) - holdback(text, sp.stop)
            if safe > emitted:
                yield text[emitted:safe]
                emitted = safe
            if ctx.cache.length < len(ctx.token_ids):  # a sampled token: compute it (and what it guesses)
                logits, ahead = yield from self._next(ctx, sp, len(out), pen)
        if ahead or ctx.cache.length >= len(ctx.token_ids):
            # the reply ended inside what a lookup pass computed: leave the context as a plain decode
            # does, the reply's last token pending (its K/V is computed with the next turn)
            del ctx.token_ids[len(ctx.token_ids) - len(ahead):]
            self._uncache(ctx, len(ctx.token_ids) - 1)
        if len(text) > emitted:
            yield text[emitted:]
        return out, text, finish, ttft, seen, prefilled

    def _next(self, ctx: LiveContext, sp: SamplingParams, produced: int, pen: Penalties | None = None):
        """Compute the K/V of the context's last token: returns the logits after it, and with lookup
        decoding the guessed tokens that follow it as greedy decoding would choose them (computed in
        the same pass, so already in the context and its cache; the logits are then after the last of
        them; `pen`, the reply's penalties, counts each guess before the next is checked)."""
        cache = ctx.cache
        room = min(self.cfg.lookup_draft, sp.max_tokens - produced, self.limit - len(ctx.token_ids))
        if cache.fixed:
            room = min(room, cache.capacity - cache.length - 1)
        if self.pass_rows:  # the guess and the last token in one pass of decode's products
            room = min(room, self.pass_rows - 1)
        guess = draft(ctx.token_ids, room) if room > 0 and sp.greedy and cache.pager is None else []
        if not guess:
            logits = yield from self._step(ctx)
            return logits, []
        start = cache.length  # the last token's slot
        ctx.token_ids.extend(guess)
        rows = yield from self._step(ctx, all_logits=True)
        kept = 0
        while kept < len(guess):
            if sample(rows[kept] if pen is None else pen.apply(rows[kept]), sp, None) != guess[kept]:
                break
            if pen is not None:
                pen.add(guess[kept])
            kept += 1
        for tok in guess[:kept] if pen is not None else ():  # counted again as the reply takes them
            pen.remove(tok)
        self.lookup.passes += 1
        self.lookup.guessed += len(guess)
        self.lookup.kept += kept
        del ctx.token_ids[start + 1 + kept :]
        self._uncache(ctx, start + 1 + kept)
        return rows[kept], guess[:kept]

    @staticmethod
    def _uncache(ctx: LiveContext, n_tokens: int) -> None:
        """Forget the cache's slots (and their densities) from `n_tokens` on."""
        ctx.prefilled_tokens -= max(0, ctx.cache.length - n_tokens)
        ctx.cache.truncate(n_tokens)
        ctx.density.truncate(n_tokens)
