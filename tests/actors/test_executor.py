"""The model executor's call steps against fake ports and a fake engine: no model, no Ray, no disk.
A call locks and plans, restores, runs the engine, commits, then writes back (which unlocks); a call
that fails or runs past its deadline after locking unlocks and commits nothing; a call on the context
the working set holds asks the governor without waiting and checks its answer before committing."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from actors.executor import ModelExecutor
from actors.messages import CallPlan, CallTimeoutError, CommitReply, RestoreStats
from engine.config import EngineConfig, ModelConfig
from engine.context import CallResult
from engine.kvcache import KVCache

CHUNK = 4
CFG = ModelConfig.from_hf({"num_attention_heads": 2, "hidden_size": 8, "vocab_size": 100, "intermediate_size": 16,
                           "num_hidden_layers": 2, "num_key_value_heads": 1, "max_position_embeddings": 64})


class FakeModel:
    cfg = CFG
    dtype = torch.float32

    def new_cache(self, capacity: int = 0, kv_format: str | None = None) -> KVCache:
        return KVCache(CFG, chunk_tokens=CHUNK, device=torch.device("cpu"), dtype=torch.float32, capacity=capacity,
                       kv_format=kv_format or "float")


class FakeTok:
    def system_ids(self, system_prompt):
        return [1, 2] if system_prompt else []

    def decode(self, ids):
        return " ".join(map(str, ids))


@dataclass
class FakeStream:
    """Two deltas, each one new token with K/V; `fail_after` raises after that many deltas."""

    ctx: object
    fail_after: int | None = None
    result: CallResult | None = None

    def __iter__(self):
        for k in range(2):
            if self.fail_after == k:
                raise RuntimeError("the engine failed")
            self.ctx.token_ids.append(10 + k)
            self.ctx.cache.reserve(len(self.ctx.token_ids))
            self.ctx.cache.length = len(self.ctx.token_ids)
            yield f"t{k}"
        self.result = CallResult("t0t1", [10, 11], "length", len(self.ctx.token_ids), 2, 0, 2, 0.0, 0.0)


class FakeEngine:
    def __init__(self, fail_after=None) -> None:
        self.model, self.tok = FakeModel(), FakeTok()
        self.cfg = EngineConfig(chunk_tokens=CHUNK, max_context_tokens=64)
        self.limit = 64
        self.fail_after = fail_after

    def tail_room(self) -> int:
        return 40

    def stream(self, ectx, prompt, **params):
        return FakeStream(ectx, self.fail_after)


@dataclass
class FakeGovernor:
    """`GovernorPort` recording what the executor asked, in order."""

    log: list = field(default_factory=list)
    saved: dict = field(default_factory=dict)
    refuse_cached: bool = False

    def app_adapter(self, app):
        return ""

    def new_ctx(self, app, system_prompt, token_ids, text, state, adapter=""):
        self.saved["c1"] = (list(token_ids), state)
        return "c1"

    def begin_call(self, ctx, app=None, cached=False):
        self.log.append("begin_call")
        ids, state = self.saved[ctx]
        return CallPlan(ctx, np.asarray(ids, np.int32), state, b"", 0, [], [], [])

    def begin_cached_call(self, ctx, app):
        self.log.append("begin_cached_call")

        def confirm():
            self.log.append("confirm")
            if self.refuse_cached:
                raise RuntimeError("the governor refused")

        return confirm

    def record_restore(self, ctx, measured_s, stages=None):
        self.log.append("record_restore")

    def commit_call(self, ctx, token_ids, text, state, density, kv_tokens, chunk_density, first_modified,
                    restored=None, request_id=None, unreadable=None, streamed_from=None):
        self.log.append("commit_call")
        self.saved[ctx] = (list(token_ids), state)
        return CommitReply({i: "raw" for i in range(-(-kv_tokens // CHUNK))})

    def admit(self, ctx, encoded, token_starts, stored=None):
        self.log.append(("admit", len(encoded)))

    def abort_call(self, ctx):
        self.log.append("abort_call")

    def loaded(self, ctx, chunks):
        self.log.append("loaded")


class FakeRestorer:
    def __init__(self) -> None:
        self.plans = []

    def restore(self, ws, plan):
        self.plans.append(plan)
        ws.missing = set()
        return RestoreStats(), []


def executor(engine=None, gov=None):
    gov = gov or FakeGovernor()
    ex = ModelExecutor(engine or FakeEngine(), gov, FakeRestorer(), background=False)
    ctx = ex.new_ctx("app", "Be brief.")
    return ex, gov, ctx


def run(gen):
    deltas = []
    while True:
        try:
            deltas.append(next(gen))
        except StopIteration as stop:
            return deltas, stop.value


def test_a_call_runs_its_steps_in_order():
    ex, gov, ctx = executor()
    deltas, out = run(ex.call("app", ctx, "Hi."))
    assert deltas == ["t0", "t1"] and out.text == "t0t1" and not out.hit
    assert gov.log == ["begin_call", "record_restore", "commit_call", ("admit", 1)]
    state = json.loads(gov.saved[ctx][1])
    assert state["kv_tokens"] == 4 and gov.saved[ctx][0] == [1, 2, 10, 11]
    assert ex.ws_ctx == ctx


def test_the_next_call_on_the_held_context_confirms_before_it_commits():
    ex, gov, ctx = executor()
    run(ex.call("app", ctx, "Hi."))
    gov.log.clear()
    _, out = run(ex.call("app", ctx, "Again."))
    assert out.hit and gov.log == ["begin_cached_call", "confirm", "commit_call", ("admit", 2)]
    gov.log.clear()
    gov.refuse_cached = True
    with pytest.raises(RuntimeError, match="refused"):
        run(ex.call("app", ctx, "Once more."))
    assert "commit_call" not in gov.log and gov.log[-1] == "abort_call" and ex.ws_ctx is None


def test_a_failing_engine_unlocks_and_commits_nothing():
    ex, gov, ctx = executor(FakeEngine(fail_after=1))
    with pytest.raises(RuntimeError, match="engine failed"):
        run(ex.call("app", ctx, "Hi."))
    assert gov.log == ["begin_call", "record_restore", "abort_call"] and ex.ws_ctx is None


def test_a_deadline_in_the_past_stops_the_call_before_anything_is_locked():
    ex, gov, ctx = executor()
    with pytest.raises(CallTimeoutError):
        run(ex.call("app", ctx, "Hi.", deadline=0.0))
    assert gov.log == []


class GatedGovernor(FakeGovernor):
    """Admits wait for `gate`; a call that begins on a context whose admit is still waiting is noted."""

    def __init__(self) -> None:
        super().__init__()
        import threading

        self.gate, self.admitting, self.pending, self.early = threading.Event(), threading.Event(), set(), []
        self._planned: dict = {}
        self.n = 0

    def app_adapter(self, app):
        return ""

    def new_ctx(self, app, system_prompt, token_ids, text, state, adapter=""):
        self.n += 1
        self.saved[f"c{self.n}"] = (list(token_ids), state)
        return f"c{self.n}"

    def begin_call(self, ctx, app=None, cached=False):
        if ctx in self.pending:
            self.early.append(ctx)
        plan = super().begin_call(ctx, app, cached)
        self.planned(ctx).set()
        return plan

    def planned(self, ctx):
        """Set once `begin_call` on `ctx` has answered."""
        import threading

        return self._planned.setdefault(ctx, threading.Event())

    def begin_cached_call(self, ctx, app):
        if ctx in self.pending:
            self.early.append(ctx)
        return super().begin_cached_call(ctx, app)

    def commit_call(self, ctx, *args, **kw):
        self.pending.add(ctx)
        return super().commit_call(ctx, *args, **kw)

    def admit(self, ctx, encoded, token_starts, stored=None):
        self.admitting.set()
        self.gate.wait()
        super().admit(ctx, encoded, token_starts, stored)
        self.pending.discard(ctx)


class StreamedEngine(FakeEngine):
    """A fake engine whose streams set `streamed` once they have produced their last token."""

    def __init__(self) -> None:
        import threading

        super().__init__()
        self.streamed = threading.Event()

    def stream(self, ectx, prompt, **params):
        inner = super().stream(ectx, prompt, **params)
        engine = self

        class Stream:
            result = None

            def __iter__(self):
                yield from inner
                self.result = inner.result
                engine.streamed.set()

        return Stream()


def call_in_background(ex, ctx: str, prompt: str):
    """`ex.call` on a thread of its own: (the started thread, the list its (deltas, outcome) goes to)."""
    import threading

    outcome: list = []
    thread = threading.Thread(target=lambda: outcome.append(run(ex.call("app", ctx, prompt))))
    thread.start()
    return thread, outcome


def hold_encoding(monkeypatch):
    """Make every chunk encoding wait for a gate: (gate, set once an encoding waits, the arrays encoded)."""
    import threading

    from storage import codecs

    gate, encoding, seen, real = threading.Event(), threading.Event(), [], codecs.encode

    def held_encode(kv, level, **kw):
        encoding.set()
        assert gate.wait(60)
        seen.append(np.array(kv))
        return real(kv, level, **kw)

    monkeypatch.setattr(codecs, "encode", held_encode)
    return gate, encoding, seen


def test_with_overlap_a_call_waits_for_the_last_write_back_only_until_it_has_encoded():
    """`overlap_admit`: the next call on another context goes on while the last call's admit is still
    under way (it waited only for the encoding, which reads the working set)."""
    gov = GatedGovernor()
    ex = ModelExecutor(FakeEngine(), gov, FakeRestorer(), background=True, overlap_admit=True)
    a, b = ex.new_ctx("app", "Be brief."), ex.new_ctx("app", "Be brief.")
    try:
        run(ex.call("app", a, "Hi."))
        assert gov.admitting.wait(60)  # a's write-back has encoded and waits in its admit
        done, _outcome = call_in_background(ex, b, "Hi.")
        done.join(60)  # a guard against a hang only: without overlap this call would wait for the gate
        assert not done.is_alive()
        assert [e for e in gov.log if isinstance(e, tuple)] == []  # a's admit is still waiting
    finally:
        gov.gate.set()
    ex.flush()
    assert [e for e in gov.log if isinstance(e, tuple)] == [("admit", 1)] * 2


def test_with_overlap_the_next_call_on_the_held_context_takes_the_lock_after_the_last_admit():
    """`overlap_admit`, a call on the context the working set holds: the model runs while the last
    call's admit (which releases the context's lock) is still under way; the call asks for the lock
    only once that admit is done, and commits after it."""
    gov, engine = GatedGovernor(), StreamedEngine()
    ex = ModelExecutor(engine, gov, FakeRestorer(), background=True, overlap_admit=True)
    b = ex.new_ctx("app", "Be brief.")
    try:
        run(ex.call("app", b, "Hi."))
        assert gov.admitting.wait(60)  # b's write-back has encoded and waits in its admit
        engine.streamed.clear()
        again, outcome = call_in_background(ex, b, "Again.")
        assert engine.streamed.wait(60)  # the model ran while b's admit still waited at the gate
        assert again.is_alive() and gov.log.count("commit_call") == 1 and gov.early == []
    finally:
        gov.gate.set()
    again.join(60)
    assert not again.is_alive() and gov.early == []  # it asked for the lock once b's admit was done
    assert outcome[0][1].hit
    ex.flush()
    log = [e for e in gov.log if e != "record_restore"]
    assert log == ["begin_call", "commit_call", ("admit", 1), "begin_cached_call", "confirm", "commit_call",
                   ("admit", 2)]


def test_with_overlap_the_next_call_on_the_held_context_does_not_wait_for_the_encoding(monkeypatch):
    """`overlap_admit` on the CPU: the last write-back encodes views of its chunks' slots taken at the
    commit, and the next call on the same context only appends past them, so its model runs while that
    encoding is still under way; what the write-back encodes is the chunk as committed."""
    gate, encoding, seen = hold_encoding(monkeypatch)
    gov, engine = FakeGovernor(), StreamedEngine()
    ex = ModelExecutor(engine, gov, FakeRestorer(), background=True, overlap_admit=True)
    b = ex.new_ctx("app", "Be brief.")
    try:
        run(ex.call("app", b, "Hi."))
        assert encoding.wait(60)  # its write-back is encoding chunk 0, held at the gate
        committed = np.array(ex.ws.chunk_array(0))
        engine.streamed.clear()
        again, outcome = call_in_background(ex, b, "Again.")
        assert engine.streamed.wait(60)  # the model ran while the last write-back still encoded
    finally:
        gate.set()
    again.join(60)
    ex.flush()
    assert not again.is_alive() and outcome[0][1].hit
    assert np.array_equal(seen[0], committed, equal_nan=True)
    assert [e for e in gov.log if isinstance(e, tuple)] == [("admit", 1), ("admit", 2)]


def test_with_overlap_a_call_on_another_context_plans_while_the_last_write_back_encodes(monkeypatch):
    """`overlap_admit`, a call on another context: its plan is asked for while the last write-back still
    encodes from the working set, and its restore (which writes there) waits for that encoding."""
    gate, encoding, _seen = hold_encoding(monkeypatch)
    gov, restorer = GatedGovernor(), FakeRestorer()
    gov.gate.set()  # admits go through; the encoding is what is held
    ex = ModelExecutor(FakeEngine(), gov, restorer, background=True, overlap_admit=True)
    a, b = ex.new_ctx("app", "Be brief."), ex.new_ctx("app", "Be brief.")
    try:
        run(ex.call("app", a, "Hi."))
        assert encoding.wait(60)  # a's write-back is encoding, held at the gate
        other, _outcome = call_in_background(ex, b, "Hi.")
        assert gov.planned(b).wait(60)  # b's plan was asked for while a's write-back encodes
        assert [p.ctx for p in restorer.plans] == [a]
    finally:
        gate.set()
    other.join(60)
    assert not other.is_alive() and [p.ctx for p in restorer.plans] == [a, b]
