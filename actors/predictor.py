"""The query predictor (the design card's fifth actor): the node's RAG cache (PerCache). It holds the
knowledge bank, the embedding model, the QA bank and the K/V tree (`actors.ragfront.RagCache`), and
drives the one model executor for RAG prompts through its port (`rag_call`; `rag_stream` for a user's
query whose answer is streamed as it decodes). A plain class; on Ray
`actors.ray_predictor.PredictorActor` hosts it with one torch thread and no CPU of its own.

In idle time it predicts queries (PerCache §4.1.2) and runs them through the same path as real ones
(`tick`): after documents arrive and a quiet period passes, the model updates the collection's
abstract (topics, names, terms) from the new passages and writes a question about each of them, `stride`
passages a round in the order they arrived, until every passage has one; after a burst
of user queries and a quiet period, it writes questions in their style. Each predicted question
populates the K/V tree (each passage of a knowledge round also heads a path of the passages nearest
it, where the tree lacks that path, `RagConfig.passage_depth`), and the QA bank with an answer when the cache scheduler
says decoding pays (`scheduler.ragcache.CacheScheduler.populate`; a question about a passage is
prefilled only at first, `RagConfig.answers_after_coverage`). When no round is due it converts across levels (PerCache
§4.3.3): it decodes stored questions that lack an answer, and once the K/V tree's cap has grown, it
prefills again the stored questions whose nodes were evicted. The work is low priority (`RagCall.background`): it
runs only when the executor has been idle `IdlePolicy.idle_after_s`, within a per-app daily budget of
model-seconds, optionally on mains power only, and it yields to any real call at the next layer or
token (`actors.priority.PriorityLock`). What it knows (abstracts, recent queries, what is pending,
the budgets) is saved in the RAG store after each round and survives a restart.

The embedding model (all-MiniLM-L6-v2, `engine.embed`) loads on first use: a node that never sees a
RAG request never pays for it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from actors.config import RagConfig
from actors.messages import KVKey, PreemptedError, RagCall
from actors.ragfront import RagAnswer, RagCache
from scheduler.ragcache import CacheScheduler, IdlePolicy, IdleState, PredictRound
from storage.ragstore import QAEntryNotFoundError

PREDICT_SYSTEM = "You help a user with their own documents. Answer briefly."
ABSTRACT_PROMPT = ("List the main topics, names and terms of these passages from the user's documents, "
                   "separated by commas.\n\n{passages}")
KNOWLEDGE_PROMPT = ("The user's documents are about: {abstract}\n\nPassage:\n{passage}\n\nWrite one short "
                    "question the user might ask about this passage.")
HISTORY_PROMPT = ("Questions the user asked recently:\n{queries}\n\nWrite {n} more questions in the same "
                  "style about the same subjects, one per line.")
ABSTRACT_CHARS = 1200
"""Longest abstract kept per collection (the newest terms win)."""
RECENT_QUERIES = 8
"""User queries kept per collection for history-based prediction."""


def parse_questions(text: str, n: int) -> list[str]:
    """Up to `n` distinct questions from the model's lines: numbering and bullets stripped, and a
    lead-in such as `The user might ask: "..."` with its quotes; a line ending in a colon is a
    heading, not a question."""
    out: list[str] = []
    for line in text.splitlines():
        q = re.sub(r"^\s*(?:[-*\u2022]|\d+[.)]|Q\d*[:.])\s*", "", line).strip()
        q = re.sub(r"(?i)^[^:?\"]{0,60}\b(?:ask|asks|asked|question|questions)\b[^:?\"]*:\s*", "", q)
        q = q.strip("\"'\u201c\u201d ").strip()
        if len(q) >= 8 and not q.endswith(":") and q.lower() not in {x.lower() for x in out}:
            out.append(q)
        if len(out) == n:
            break
    return out


def mains_power(root: str = "/sys/class/power_supply") -> bool | None:
    """True on mains power, False on battery, None where the system says neither (no supplies)."""
    kinds = []
    for d in sorted(Path(root).glob("*")) if Path(root).is_dir() else []:
        try:
            online = (d / "online").read_text().strip() if (d / "online").exists() else ""
            kinds.append(((d / "type").read_text().strip(), online))
        except OSError:
            continue
    if any(k == "Mains" and online == "1" for k, online in kinds):
        return True
    if any(k == "Battery" for k, _ in kinds):
        return False
    return None


class QueryPredictor:
    def __init__(self, data_dir: str, tokenizer, executor, delete_node: Callable[[str], Any], model_key: KVKey,
                 config: RagConfig | None = None, *, embed: Callable[[list[str]], np.ndarray] | None = None,
                 clock: Callable[[], float] = time.time, idle: IdlePolicy | None = None,
                 power: Callable[[], bool | None] = mains_power,
                 resolve_stream: Callable[[Iterator[Any]], Iterator[Any]] = iter) -> None:
        """`tokenizer`: the model's `engine.chat.ChatTokenizer`; `executor`: an `ExecutorPort`;
        `delete_node`: the IO port's `delete_context`; `embed`: an embedding function (default: the
        packaged all-MiniLM-L6-v2, loaded on first use); `idle`: when and how much to predict;
        `power`: reads whether the node is on mains power; `resolve_stream`: the items of the
        executor's `rag_stream` from what it returns (itself in one process; on Ray its object refs
        fetched, `actors.ray_stubs.resolved_items`)."""
        from engine.rag import RagTemplate
        from storage.knowledge import KnowledgeBank, KnowledgeConfig
        from storage.ragstore import RagStore

        self._embedder = None
        self._embed_lock = threading.Lock()
        self._embed = embed
        db = str(Path(data_dir) / "registry.db")
        self.bank = KnowledgeBank(db, tokenize=tokenizer.encode, embed=self.embed, clock=clock,
                                  config=KnowledgeConfig(chunk_tokens=(config or RagConfig()).passage_tokens))
        self.store = RagStore(db, clock=clock)
        self.rag = RagCache(self.bank, self.store, self.embed, RagTemplate(tokenizer), executor.rag_call,
                            delete_node, model_key, config, clock=clock,
                            run_stream=lambda call: resolve_stream(executor.rag_stream(call)))
        self.tok, self.executor, self.clock, self.power = tokenizer, executor, clock, power
        self.scheduler = CacheScheduler(answers_after_coverage=self.rag.config.answers_after_coverage)
        self._lock = threading.RLock()  # the idle bookkeeping, shared by `tick` and the routes (never held
        # while the model runs)
        cfg = self.rag.config
        self.idle = IdleState(idle or IdlePolicy(idle_after_s=cfg.idle_after_s, require_mains_power=cfg.mains_only,
                                                 budget_model_s_per_day=cfg.predict_budget_s, stride=cfg.stride))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.known: dict[str, dict] = {}
        """App -> what the predictor keeps of it: per collection the abstract, the documents it covers,
        the recent user queries, and the collections with documents not yet predicted from."""
        self._load_state()

    def embed(self, texts: list[str]) -> np.ndarray:
        """Unit rows of `texts` (the OpenAI embeddings route and retrieval use the same model)."""
        if self._embed is not None:
            return self._embed(texts)
        with self._embed_lock:
            if self._embedder is None:
                from engine.embed import Embedder

                self._embedder = Embedder()
        return self._embedder.embed(texts)

    # ---- collections and documents (`storage.knowledge`) ------------------------------------------
    def create_collection(self, app: str, name: str) -> str:
        return self.bank.create_collection(app, name)

    def collections(self, app: str) -> list[dict]:
        return [_info(c) for c in self.bank.collections(app)]

    def delete_collection(self, app: str, collection: str) -> None:
        self.rag.chunks_deleted(app, self.bank.delete_collection(app, collection))
        self.store.delete_collection_qa(app, collection)
        with self._lock:  # nothing left to predict from
            known = self._app(app)
            for part in ("pending", "collections", "recent"):
                known[part].pop(collection, None)
            self._save(app)

    def add_document(self, app: str, collection: str, content: str, name: str = "", kind: str = "text") -> str:
        """Add a document; stored answers whose questions would now retrieve its passages lose their
        answer (PerCache §4.1.3), to be decoded again in idle time."""
        known = {d["id"] for d in self.documents(app, collection)}
        doc = self.bank.add_document(app, collection, content, name=name, kind=kind)
        if doc not in known:
            self.rag.refresh(app, collection, [c.id for c in self.bank.chunks(app, doc)])
            with self._lock:
                self.idle.documents_added(app, self.clock())
                self._app(app)["pending"][collection] = True
                self._save(app)
        return doc

    def documents(self, app: str, collection: str) -> list[dict]:
        return [_info(d) for d in self.bank.documents(app, collection)]

    def delete_document(self, app: str, document: str) -> int:
        """Delete a document; its passages' K/V nodes and the answers they gave go with it."""
        gone = self.bank.delete_document(app, document)
        self.rag.chunks_deleted(app, gone)
        return len(gone)

    # ---- queries ------------------------------------------------------------------------------------
    def query(self, app: str, collection: str, question: str, params: dict) -> RagAnswer:
        """Answer `question` over `app`'s `collection` (`RagCache.query`; `params`: `k`, `tau_query`,
        `adapter`, `deadline` and sampling)."""
        answer = self.rag.query(app, collection, question, **params)
        self._query_seen(app, collection, question)
        return answer

    def query_stream(self, app: str, collection: str, question: str, params: dict):
        """`query` as it decodes (`RagCache.query_stream`): text deltas, then the `RagAnswer`."""
        with contextlib.closing(self.rag.query_stream(app, collection, question, **params)) as items:
            for item in items:
                if not isinstance(item, str):
                    self._query_seen(app, collection, question)
                yield item

    def _query_seen(self, app: str, collection: str, question: str) -> None:
        """A user's query was answered: the idle clock restarts, and the query joins the recent ones
        that history rounds predict from."""
        with self._lock:
            self.idle.query_seen(app, self.clock())
            recent = self._app(app)["recent"].setdefault(collection, [])
            recent[:] = (recent + [question])[-RECENT_QUERIES:]
            self._save(app)

    # ---- idle work (PerCache §4.1.2) -----------------------------------------------------------------
    def tick(self, now: float | None = None) -> list[dict]:
        """One round of query prediction for each app that is due and may work now; what each round
        did (`app`, `kind`, `collection`, `questions`, `model_s`; `passage_paths`: how many passages'
        paths a knowledge round prefilled; `prefilled`: the questions a conversion prefilled again; and
        `preempted` when a real call took the executor back midway: the round is left pending). Cheap
        when nothing is due."""
        now = self.clock() if now is None else now
        with self._lock:  # not held while the model runs: a real query's bookkeeping never waits for it
            self.idle.calls_seen(*self.executor.activity())
            self.idle.set_power(self.power())
            todo = [(app, self.idle.next_work(app, now)) for app in self.idle.apps() if self.idle.may_work(app, now).ok]
        done = []
        for app, work in todo:
            done.append(self._round(app, work, now) if work is not None else self._convert(app, now))
            if done[-1].get("preempted"):
                break
        return [d for d in done
                if d["questions"] or d.get("prefilled") or d.get("passage_paths") or d.get("preempted")]

    def _convert(self, app: str, now: float) -> dict:
        """Cross-layer conversion (PerCache §4.3.3), up to `stride` questions of each kind: decode stored
        questions without an answer (refreshed ones, and predicted ones prefilled only) when the cache
        scheduler says decoding pays; and once the K/V tree's cap has grown, prefill again the stored
        questions whose nodes were evicted (their answers stay; `prefilled` lists them)."""
        out = {"app": app, "kind": "answers", "collection": None, "questions": [], "prefilled": [], "model_s": 0.0}
        decode = self.scheduler.populate(self.rag.config.tau_query, qa_bank=self.rag.config.qa_bank).decode
        with self._lock:  # nodes prefilled again by idle work only where idle work populates the tree
            again = self._reprefill_due(app)[:self.idle.policy.stride] if self.rag.uses_tree(background=True) else []
        if not decode and not again:
            return out
        t0 = time.perf_counter()
        try:
            for e in self.rag.unanswered(app)[:self.idle.policy.stride] if decode else []:
                self.rag.query(app, e.collection, e.question, adapter=e.adapter, predicted=e.predicted,
                               background=True, replaces=e.id)
                out["questions"].append(e.question)
            # listed earlier, a path may be whole again since (a question asked along it)
            still = {int(c.entry_id) for c in self.rag.evicted(app)} if again else set()
            for entry_id in again:
                try:
                    e = self.store.qa_entry(app, entry_id) if entry_id in still else None
                except QAEntryNotFoundError:  # evicted or deleted since
                    e = None
                if e is not None:  # decode=False: the tree only, no QA entry is written
                    self.rag.query(app, e.collection, e.question, adapter=e.adapter, decode=False, background=True)
                    out["prefilled"].append(e.question)
                with self._lock:
                    self._app(app)["reprefill"].remove(entry_id)
        except PreemptedError:
            out["preempted"] = True
        out["model_s"] = time.perf_counter() - t0
        if out["questions"] or out["prefilled"] or out.get("preempted"):
            with self._lock:
                self.idle.spend(app, out["model_s"], now)
                self._save(app)
        return out

    def _reprefill_due(self, app: str) -> list[int]:
        """QA entries of `app` whose K/V to prefill again: those with evicted nodes when the tree's cap
        has grown since the app's last look (`CacheScheduler.convert`), most hit first, kept (and
        saved) until done. The first look only notes the cap."""
        known = self._app(app)
        cap, seen = self.rag.config.tree_cap_bytes, known.get("tree_cap")
        todo = known.setdefault("reprefill", [])
        if seen is not None and cap > seen:
            tau = self.rag.config.tau_query
            due = self.scheduler.convert(tau, tau, [], self.rag.evicted(app), storage_grew=True)
            todo[:] = list(dict.fromkeys(todo + [int(c.entry_id) for c in due]))
        if seen != cap:
            known["tree_cap"] = cap
            self._save(app)
        return list(todo)

    def _round(self, app: str, work: PredictRound, now: float) -> dict:
        known = self._app(app)
        col = (next(iter(known["pending"]), None) if work.kind == "knowledge"
               else max(known["recent"], key=lambda c: len(known["recent"][c]), default=None))
        out = {"app": app, "kind": work.kind, "collection": col, "questions": [], "model_s": 0.0}
        cursor = None  # a knowledge round: the last passage it wrote a question about
        t0 = time.perf_counter()
        try:
            if col is not None:
                questions, cursor, passages = (self._from_knowledge(app, col, work.stride) if work.kind == "knowledge"
                                               else (self._from_history(app, col, work.stride), None, []))
                cfg = self.rag.config
                for chunk in passages:
                    if self.rag.cache_passage(app, col, chunk):
                        out["passage_paths"] = out.get("passage_paths", 0) + 1
                pop = self.scheduler.populate(cfg.tau_query, qa_bank=cfg.qa_bank,
                                              kv_tree=self.rag.uses_tree(background=True),
                                              from_passages=work.kind == "knowledge")
                for q in questions:
                    self.rag.query(app, col, q, predicted=True, decode=pop.decode, background=True)
                    out["questions"].append(q)
        except PreemptedError:
            out["preempted"] = True
        out["model_s"] = time.perf_counter() - t0
        with self._lock:
            self.idle.spend(app, out["model_s"], now)
            if not out.get("preempted"):
                self.idle.round_done(work)
                if work.kind == "knowledge" and col is not None:
                    if cursor is not None:
                        known["collections"][col]["cursor"] = cursor
                    if cursor is None or not self.bank.chunks_after(app, col, cursor):
                        known["pending"].pop(col, None)  # every passage has its question
                    if known["pending"]:  # passages or collections wait: the next round takes them
                        self.idle.documents_added(app, now - self.idle.policy.abstract_quiet_s, 1)
            self._save(app)
        return out

    def _generate(self, app: str, prompt: str, max_tokens: int) -> str:
        """A low-priority completion through the executor (`RagCall.background`, nothing cached)."""
        from engine.chat import Conversation, Turn

        conv = Conversation([Turn("system", PREDICT_SYSTEM)])
        ids = self.tok.system_ids(PREDICT_SYSTEM) + self.tok.user_turn_ids(conv, prompt)
        return self.executor.rag_call(RagCall(app, "", ids, [], [], {"max_tokens": max_tokens},
                                              background=True)).text

    def _from_knowledge(self, app: str, collection: str, n: int) -> tuple[list[str], int | None, list[int]]:
        """The next `n` passages without a question (after the collection's cursor): the terms of the
        first four merged into its abstract, then one question about each, framed by the abstract.
        Returns the questions, the last passage's id, the cursor once the round is done (None when
        none was left), and the passages' ids."""
        c = self._app(app)["collections"].setdefault(collection, {"abstract": "", "cursor": 0})
        passages = self.bank.chunks_after(app, collection, c.get("cursor", 0), n)
        if not passages:
            return [], None, []
        terms = self._generate(app, ABSTRACT_PROMPT.format(passages="\n\n".join(p.text for p in passages[:4])), 32)
        abstract = (c["abstract"] + ", " + terms.strip()).strip(", ")[-ABSTRACT_CHARS:]
        questions: list[str] = []
        for p in passages:
            text = self._generate(app, KNOWLEDGE_PROMPT.format(abstract=abstract, passage=p.text), 24)
            questions += [q for q in parse_questions(text, 1) if q.lower() not in {x.lower() for x in questions}]
        c["abstract"] = abstract  # not before: a round preempted midway merges the same terms again
        return questions, passages[-1].id, [p.id for p in passages]

    def _from_history(self, app: str, collection: str, n: int) -> list[str]:
        recent = self._app(app)["recent"].get(collection, [])
        if not recent:
            return []
        return parse_questions(self._generate(app, HISTORY_PROMPT.format(queries="\n".join(recent), n=n), 20 * n), n)

    # ---- state that survives a restart -----------------------------------------------------------------
    def _app(self, app: str) -> dict:
        return self.known.setdefault(app, {"collections": {}, "recent": {}, "pending": {}})

    def _save(self, app: str) -> None:
        idle = self.idle.to_dict()
        idle["apps"] = {app: idle["apps"][app]} if app in idle["apps"] else {}
        self.store.save_state(app, "predictor", json.dumps({"known": self._app(app), "idle": idle}))

    def _load_state(self) -> None:
        """Every app's saved state."""
        merged: dict[str, Any] = {"version": 1, "last_call": None, "apps": {}}
        for app in self.store.state_apps("predictor"):
            blob = self.store.load_state(app, "predictor")
            if blob is None:
                continue
            d = json.loads(blob)
            self.known[app] = d["known"]
            merged["apps"].update(d["idle"]["apps"])
            merged["version"] = d["idle"]["version"]
            last = d["idle"]["last_call"]
            if last is not None and (merged["last_call"] is None or last > merged["last_call"]):
                merged["last_call"] = last
        if merged["apps"]:
            self.idle = IdleState.from_dict(merged, self.idle.policy)

    def start(self, poll_s: float = 5.0) -> None:
        """Run `tick` every `poll_s` seconds on a thread of its own (when `RagConfig.predict`)."""
        if not self.rag.config.predict or self._thread is not None:
            return

        def loop() -> None:
            while not self._stop.wait(poll_s):
                try:
                    self.tick()
                except Exception:  # noqa: BLE001 - logged; the next tick tries again
                    logging.getLogger(__name__).exception("query prediction failed")

        self._thread = threading.Thread(target=loop, name="query-predictor", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)  # a round in progress ends at its next question
        self.bank.close()
        self.store.close()


def _info(record) -> dict:
    return {name: getattr(record, name) for name in record.__slots__}
