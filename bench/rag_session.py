"""One system's run of `bench.rag` over a user's question set, in process: a fresh data directory, the
user's documents ingested through the query predictor, the questions asked one at a time on a virtual
clock, the predictor's idle rounds between them; and the groups of runs whose systems alternate
question by question (`run_group`)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from bench.rag import APP, SYSTEMS, T0, Query, Run, log, rag_config


class Clock:
    """The virtual clock every part of a run reads (seconds)."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Executor:
    """The executor port's `rag_call` and `activity`, in process: the model runs here, and the last
    real call is the last user question, on the virtual clock (0.0: none yet)."""

    def __init__(self, engine, io) -> None:
        self.engine, self.io, self.last = engine, io, 0.0

    def rag_call(self, call):
        from actors.rag import run_rag_call

        return run_rag_call(self.engine, self.io, call, should_stop=None)

    def activity(self) -> tuple[float, int]:
        return self.last, 0


class Session:
    """One system's run over one user's question set, a question at a time (`ask`), so that the
    systems of a set alternate question by question (`run_group`): a host whose speed drifts over a
    run then slows every system alike instead of the ones that happened to run in a slow stretch."""

    def __init__(self, engine, embedder, user: str, which: str, system: str, args, setting: str = "",
                 **overrides) -> None:
        """Ingest `user`'s documents into a fresh data directory. `overrides`: RagConfig's knobs, and
        `rounds_per_gap` (the most idle rounds between two questions; `args.rounds_per_gap` without it)."""
        from actors.messages import KVKey
        from actors.predictor import QueryPredictor
        from actors.swapio import KVSwapIO
        from bench import rag_data

        t_run = time.perf_counter()
        self.rounds = overrides.pop("rounds_per_gap", args.rounds_per_gap)  # the bench's knob, not the cache's
        cfg = rag_config(args, system, **overrides)
        self.run, self.gap = Run(which, user, system, setting, []), args.gap
        if args.tmp:
            os.makedirs(args.tmp, exist_ok=True)
        self.folder = tempfile.mkdtemp(prefix="rag-bench-", dir=args.tmp)
        self.clock = Clock(T0)
        io = KVSwapIO(os.path.join(self.folder, "chunks"), KVKey(engine.fingerprint))
        self.ex = Executor(engine, io)
        self.pred = QueryPredictor(self.folder, engine.tok, self.ex, io.delete_context, io.key, cfg,
                                   embed=embedder.embed, clock=self.clock, power=lambda: None)
        try:
            self.col = self.pred.create_collection(APP, "documents")
            for topic, text in rag_data.documents(user):  # one a second: the bank orders them by arrival
                self.clock.t += 1.0
                self.pred.add_document(APP, self.col, text, name=topic)
        except BaseException:
            self.close()
            raise
        self.t_docs = self.clock.t
        policy = self.pred.idle.policy  # after a question, idle work may start this much later
        self.wait = max(cfg.idle_after_s, policy.abstract_quiet_s, policy.history_quiet_s) + 1.0
        self.questions = rag_data.questions(user, which)[:args.limit or None]
        self.label = f"{which} {user} {system}{' ' + setting if setting else ''}"
        self.run.wall_s += time.perf_counter() - t_run

    def ask(self, i: int) -> None:
        """Question `i`, `gap` virtual seconds after the one before, after idle time's predictions
        where the system predicts."""
        t_run = time.perf_counter()
        pred, clock, out, q = self.pred, self.clock, self.run, self.questions[i]
        t_q = self.t_docs + (i + 1) * self.gap
        if SYSTEMS[out.system]["predict"]:
            idle(pred, clock, out, max(self.ex.last, self.t_docs) + self.wait, t_q, self.rounds)
        clock.t = t_q
        t = time.perf_counter()
        ans = pred.query(APP, self.col, q["text"], {})
        e2e = time.perf_counter() - t
        self.ex.last = clock.t
        out.queries.append(Query(q["id"], q["group"] or "", ans.level, e2e, ans.reused_tokens,
                                 ans.retrieved_tokens, ans.prompt_tokens, ans.answer, dict(ans.latency),
                                 list(ans.token_ids), ans.blended_tokens, ans.recomputed_tokens))
        log(f"[{self.label}] {i + 1}/{len(self.questions)} {q['id']}: {ans.level}, {e2e:.2f} s ("
            + ", ".join(f"{k} {v:.2f}" for k, v in ans.latency.items()) + f"), reused "
            f"{ans.reused_tokens}/{ans.retrieved_tokens} tokens"
            + (f", blended {ans.blended_tokens} ({ans.recomputed_tokens} recomputed)"
               if ans.blended_tokens else ""))
        out.wall_s += time.perf_counter() - t_run

    def close(self) -> Run:
        """The run, with its cache bytes; the data directory goes."""
        try:
            self.run.cache_bytes = self.pred.store.total_bytes()
            self.pred.close()
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)
        return self.run


def run_group(engine, embedder, user: str, which: str, variants: list[tuple[str, str, dict]], args, *,
              session=None) -> list[Run]:
    """`user`'s `which` question set on each variant (`(system, setting, RagConfig overrides)`): every
    variant's documents ingested, then question by question on every variant, the variants' order
    turned by one each question (none always first). `session`: what opens one variant's run
    (`Session`'s signature; a test's stand-in)."""
    session = session or Session
    sessions: list[Session] = []
    try:
        for system, setting, knobs in variants:
            sessions.append(session(engine, embedder, user, which, system, args, setting, **knobs))
        n = len(sessions[0].questions) if sessions else 0
        for i in range(n):
            for k in range(len(sessions)):
                sessions[(i + k) % len(sessions)].ask(i)
    finally:
        runs = [s.close() for s in sessions]
    return runs


def idle(pred, clock: Clock, out: Run, start: float, deadline: float, most: int = 0) -> None:
    """Idle time from `start` to `deadline` (virtual): prediction rounds while any is due (at most
    `most` of them; 0: no cap but the deadline and the predictor's budget), the clock moving on by
    each round's model time."""
    now, rounds = start, 0
    while now < deadline and (not most or rounds < most):
        clock.t = now
        t = time.perf_counter()
        done = pred.tick(now)
        out.idle_tick_s += time.perf_counter() - t
        if not done:
            return
        spent = sum(d["model_s"] for d in done)
        out.idle_model_s += spent
        out.rounds += len(done)
        out.predicted += sum(len(d["questions"]) for d in done)
        rounds += len(done)
        now += max(1.0, spent)
