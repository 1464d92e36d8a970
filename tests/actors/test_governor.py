"""The memory governor's invariants against a fake KV swap/IO port: no model, no Ray, a real SQLite
registry in a temporary folder. A random trace of calls (plan, loads, commit, admit) over several
contexts, for every policy, checks after every step:

- the pool never holds more than its budget once a call's chunks are admitted;
- a context in a call (locked) loses no resident chunk while other calls run;
- a chunk is never reclaimed before its bytes are safe: what leaves the pool has a file unless the
  policy kills (then it is recomputed from its token ids);
- the eviction queue's own invariants hold (its order is tested in tests/scheduler/test_eviction.py);
- a chunk's level never rises except by recompute.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest

from actors.governor import GovernorConfig, MemoryGovernor
from scheduler.policies import POLICIES
from storage.registry import Registry

CHUNK = 16
RAW = 4096  # bytes of a raw chunk in this fake; levels scale it by their bits
BITS = {"raw": 32, "fp16": 16, "bf16": 16, "q8": 8, "q4": 4, "q2": 2}


@dataclass(frozen=True)
class Handle:
    """A resident chunk as the executor would hand it over."""

    ctx: str
    index: int
    level: str


class FakeWrite:
    """A write ahead of time in flight: done when the test says (`finish`), or when the governor
    waits for it (`result`), which it records."""

    def __init__(self, io: "FakeIO", ctx: str, todo) -> None:
        self.io, self.ctx, self.todo, self.metas = io, ctx, todo, None

    def done(self) -> bool:
        return self.metas is not None

    def finish(self) -> None:
        if self.metas is None:
            self.metas = self.io.write(self.ctx, self.todo)

    def result(self, timeout=None):
        if self.metas is None:
            self.io.waited.append((self.ctx, sorted(i for i, _h, _t in self.todo)))
            self.finish()
        return self.metas


class FakeIO:
    """`SwapIOPort` in memory: files are dict entries; records every write and delete, and which
    writes ahead of time the governor had to wait for."""

    def __init__(self) -> None:
        self.files: dict[tuple[str, int], Handle] = {}
        self.writes = 0
        self.in_flight: list[FakeWrite] = []
        self.waited: list[tuple[str, list[int]]] = []

    def write_async(self, ctx, todo, adapter=""):
        w = FakeWrite(self, ctx, todo)
        self.in_flight.append(w)
        return w

    def finish_some(self, rng) -> None:
        for w in self.in_flight:
            if rng.random() < 0.5:
                w.finish()
        self.in_flight = [w for w in self.in_flight if not w.done()]

    def write(self, ctx, todo, adapter=""):
        out = []
        for i, h, _start in todo:
            self.files[(ctx, i)] = h
            self.writes += 1
            out.append({"name": f"{ctx}-{i}", "nbytes": nbytes(h.level), "checksum": f"{ctx}{i}{h.level}"})
        return out

    def delete(self, ctx, index):
        self.files.pop((ctx, index), None)

    def delete_context(self, ctx):
        for k in [k for k in self.files if k[0] == ctx]:
            del self.files[k]


def nbytes(level: str) -> int:
    return RAW * BITS[level] // 32


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def check_books(gov: MemoryGovernor, policy) -> None:
    gov.queue.check()
    for ctx, book in gov.books.items():
        for i, ch in book.chunks.items():
            if ch.handle is None and policy.on_pressure == "swap":
                assert ch.file is not None, f"{policy.name}: chunk {ctx}/{i} left the pool without a file"
            if ch.handle is not None:
                assert ch.handle.level == ch.level and ch.nbytes == nbytes(ch.level)


@pytest.mark.parametrize("raw_chunk_bytes", [0, RAW], ids=["configured-ratio", "pressure-aware"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_invariants_hold_over_a_random_trace(policy, raw_chunk_bytes, tmp_path):
    pol = POLICIES[policy]
    rng = random.Random(policy)
    reg = Registry(str(tmp_path / "registry.db"))
    io = FakeIO()
    released: list[Handle] = []
    budget = 40 * RAW // 4  # about 40 chunks at q8
    gov = MemoryGovernor(reg, io, GovernorConfig(pool_bytes=budget, chunk_tokens=CHUNK, policy=policy,
                                                 raw_chunk_bytes=raw_chunk_bytes),
                         clock=Clock(), release=released.append)
    reg.create_app("app")
    ctxs = [gov.new_ctx("app", "", np.zeros(0, np.int64), "", "{}") for _ in range(6)]
    tokens = {c: 0 for c in ctxs}
    levels: dict[tuple[str, int], str] = {}
    for step in range(60):
        ctx = rng.choice(ctxs)
        plan = gov.begin_call(ctx, "app")
        assert ctx in gov.locked
        resident_before = {i for i, _lv, _h in plan.resident}
        # while this call runs, another context's call comes and goes (admit evicts): ours keeps its chunks
        other = rng.choice([c for c in ctxs if c != ctx])
        if rng.random() < 0.3 and other not in gov.locked:
            gov.begin_call(other, "app")
            gov.admit(other, [], {})
            mine = {i for i, ch in gov.books[ctx].chunks.items() if ch.handle is not None}
            assert resident_before <= mine, f"{policy}: a locked context lost resident chunks"
        # loads come back whole and become resident as far as the budget allows
        gov.loaded(ctx, [(i, Handle(ctx, i, lv), nbytes(lv)) for i, lv, _f in plan.load])
        new = tokens[ctx] + rng.randint(5, 60)
        n_chunks = -(-new // CHUNK)
        reply = gov.commit_call(ctx, list(range(new)), "x", "{}", b"", new,
                                np.array([rng.random() for _ in range(n_chunks)]), tokens[ctx] // CHUNK,
                                list(plan.recompute) + [i for i, _lv, _f in plan.load])
        first_modified, tokens[ctx] = tokens[ctx] // CHUNK, new
        for i, lv in reply.todo.items():  # an unchanged chunk never rises, unless restored by recompute
            old = levels.get((ctx, i))
            if old is not None and i < first_modified and i not in plan.recompute:
                assert BITS[lv] <= BITS[old], (policy, ctx, i, old, lv)
            levels[(ctx, i)] = lv
        encoded = [(i, lv, Handle(ctx, i, lv), nbytes(lv)) for i, lv in sorted(reply.todo.items())]
        gov.admit(ctx, encoded, {i: i * CHUNK for i, *_ in encoded})
        assert ctx not in gov.locked
        over = gov.pool_used - gov.writing_nbytes()  # being written: they leave as their writes end
        assert over <= budget, f"{policy}: {over} bytes resident over a budget of {budget}"
        check_books(gov, pol)
        io.finish_some(rng)  # writes ahead of time end in their own time
    assert gov.stats["evictions"] > 0, "the trace never filled the pool"
    if pol.on_pressure == "swap":
        assert io.writes > 0
    reg.close()


def test_chunks_stay_raw_while_the_contexts_in_the_pool_fit_at_raw(tmp_path):
    """Pressure: the raw bytes of the contexts with K/V against the pool. Under it nothing is
    lowered; as contexts join, the planner lowers chunks, never below the configured ratio."""
    reg = Registry(str(tmp_path / "registry.db"))
    gov = MemoryGovernor(reg, FakeIO(), GovernorConfig(pool_bytes=8 * RAW, chunk_tokens=CHUNK, policy="llms",
                                                       raw_chunk_bytes=RAW), clock=Clock())
    reg.create_app("app")
    ctxs = [gov.new_ctx("app", "", np.zeros(0, np.int64), "", "{}") for _ in range(4)]
    rng = random.Random(0)

    def call(ctx, tokens):
        gov.begin_call(ctx, "app")
        n = tokens // CHUNK
        reply = gov.commit_call(ctx, list(range(tokens)), "x", "{}", b"", tokens,
                                np.array([rng.random() for _ in range(n)]), 0)
        gov.admit(ctx, [(i, lv, Handle(ctx, i, lv), nbytes(lv)) for i, lv in sorted(reply.todo.items())],
                  {i: i * CHUNK for i in reply.todo})
        return [gov.books[ctx].chunks[i].level for i in range(n)]

    assert gov.room() is None  # no chunks yet: nothing to weigh
    assert call(ctxs[0], 8 * CHUNK) == ["raw"] * 8  # 8 raw chunks fill the pool exactly: no pressure
    assert gov.room() == 4.0
    second = call(ctxs[1], 8 * CHUNK)  # 16 chunks at raw in a pool of 8: the mean ratio may be 2
    assert set(second) == {"raw", "q8"} and sum(BITS[lv] for lv in second) / 8 / len(second) <= 2.0
    for c in ctxs[2:]:
        levels = call(c, 16 * CHUNK)
        assert sum(BITS[lv] for lv in levels) / 8 / len(levels) <= max(gov.room(), 0.5) + 1e-9
    # every context with K/V weighs in, in the pool or on disk: 8 + 8 + 16 + 16 chunks
    assert gov.room() == 4.0 * 8 / 48
    assert call(ctxs[3], 16 * CHUNK)  # a new version: planned at that bound
    reg.close()


def test_a_call_waits_only_for_the_writes_its_own_room_needs(tmp_path):
    """Writes ahead of time are started by `admit` and not waited for: chunks being written go last
    among victims, and the pool stands over budget by them until their writes end, rather than make
    the next call wait. A restore's room waits only for the writes of the victims it must evict."""
    reg = Registry(str(tmp_path / "registry.db"))
    io = FakeIO()
    q8 = nbytes("q8")  # llms-no-compress: every chunk q8
    gov = MemoryGovernor(reg, io, GovernorConfig(pool_bytes=12 * q8, chunk_tokens=CHUNK, policy="llms-no-compress"),
                         clock=Clock())
    reg.create_app("app")
    a, b, c = (gov.new_ctx("app", "", np.zeros(0, np.int64), "", "{}") for _ in range(3))

    def call(ctx, n, first=0):
        plan = gov.begin_call(ctx, "app")
        gov.loaded(ctx, [(i, Handle(ctx, i, lv), nbytes(lv)) for i, lv, _f in plan.load])
        reply = gov.commit_call(ctx, list(range(n * CHUNK)), "x", "{}", b"", n * CHUNK, np.ones(n), first,
                                [i for i, _lv, _f in plan.load])
        gov.admit(ctx, [(i, lv, Handle(ctx, i, lv), nbytes(lv)) for i, lv in sorted(reply.todo.items())],
                  {i: i * CHUNK for i in reply.todo})
        return plan

    call(a, 4)
    call(b, 4)  # a's write is still in flight: b's call did not wait for it
    assert len(io.in_flight) == 2 and io.waited == [] and len(gov.writes) == 2
    assert {r.state.value for r in reg.chunks(a)} == {"resident"}  # no file yet, as far as anyone knows
    io.in_flight[1].finish()  # b's write ends; the next call's steps record it (`reap`)
    call(c, 4)  # the pool is full now
    assert {r.state.value for r in reg.chunks(b)} == {"both"}
    call(c, 8, first=4)  # 4 chunks over: b's go (written); a's, older but being written, stay
    assert io.waited == [] and gov.pool_used == 12 * q8
    assert all(gov.books[b].chunks[i].handle is None for i in range(4))
    assert gov.writing_nbytes() == 12 * q8  # a's 4 and c's 8: all the pool holds is being written
    plan = call(b, 4)  # b comes back from disk: its 4 chunks need room that only chunks being written hold
    assert [i for i, _lv, _f in plan.load] == [0, 1, 2, 3]
    assert io.waited == [(a, [0, 1, 2, 3])]  # a's write (the least recently used) was waited for, only it
    assert all(gov.books[a].chunks[i].file and gov.books[a].chunks[i].handle is None for i in range(4))
    gov.drain()
    assert len(gov.writes) == 0 and gov.pool_used <= 12 * q8
    assert {r.state.value for r in reg.chunks(c)} <= {"both", "swapped"}
    reg.close()


def test_chunks_whose_files_could_not_be_read_are_written_again(tmp_path):
    """A restore that could not use some files (missing, corrupt, or written under another KV key,
    such as another weight format) recomputes those chunks; the commit voids their files, so they are
    encoded and written again rather than failing at every later restore."""
    reg = Registry(str(tmp_path / "registry.db"))
    io = FakeIO()
    q8 = nbytes("q8")
    gov = MemoryGovernor(reg, io, GovernorConfig(pool_bytes=4 * q8, chunk_tokens=CHUNK, policy="llms-no-compress"),
                         clock=Clock())
    reg.create_app("app")
    a, b = (gov.new_ctx("app", "", np.zeros(0, np.int64), "", "{}") for _ in range(2))

    def call(ctx, n, unreadable=()):
        plan = gov.begin_call(ctx, "app")
        for w in io.in_flight:
            w.finish()
        reply = gov.commit_call(ctx, list(range(n * CHUNK)), "x", "{}", b"", n * CHUNK, np.ones(n), n,
                                [i for i, _lv, _f in plan.load], unreadable=list(unreadable))
        gov.admit(ctx, [(i, lv, Handle(ctx, i, lv), nbytes(lv)) for i, lv in sorted(reply.todo.items())],
                  {i: i * CHUNK for i in reply.todo})
        return plan, reply

    call(a, 4)
    call(b, 4)  # a's chunks leave the pool for their files
    plan, _ = call(a, 4, unreadable=[1, 2])  # a comes back; pretend chunks 1 and 2 failed to read
    assert [i for i, _lv, _f in plan.load] == [0, 1, 2, 3]
    assert (a, 1) not in io.files and (a, 2) not in io.files  # the unusable files are deleted
    assert {i for i, ch in gov.books[a].chunks.items() if ch.handle is not None} == {0, 1, 2, 3}
    call(b, 4)  # a leaves the pool again: 1 and 2 are written anew, 0 and 3 kept their files
    assert all(gov.books[a].chunks[i].file is not None for i in range(4))
    reg.close()
