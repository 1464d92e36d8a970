"""The RAG cache of one node (PerCache): retrieval, the QA bank, the K/V tree and their bookkeeping,
Ray-free. The model runs elsewhere, through `run` (the executor port's `rag_call`); node records are
deleted through `delete_node` (the IO port's `delete_context`). On Ray the query predictor actor hosts
it (`actors.ray_predictor`); in one process the service does.

A query is embedded once; a stored question at least `tau_query` similar (QA bank) answers at once;
otherwise the collection is searched (hybrid BM25 + cosine), the prompt assembled from the passages'
token ids (`engine.rag.RagTemplate`), the longest cached prefix of the retrieved path matched in the
app's K/V tree (`scheduler.ragtree.KVTree`), and the executor loads those nodes, prefills the rest and
decodes. New nodes enter the tree (LFU eviction under the app's cap), the answer the QA bank. The
baselines of PerCache §5.2 are configurations: `RagConfig.qa_bank`, `RagConfig.kv_tree` and
`RagConfig.predict_tree` off or on.
The QA bank holds greedy answers (`banked_sampling`); a stored answer longer than a query's
`max_tokens` is cut to it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import numpy as np

from actors.config import RagConfig
from actors.messages import BlendSpan, KVKey, NodeSpan, RagCall, RagOutcome
from actors.rag import node_key
from scheduler.ragcache import QAEntry, match_query, missing_kv, plan_qa_eviction, refresh_candidates
from scheduler.ragtree import KVTree, plan_tree_eviction
from storage.ragstore import QAEntryNotFoundError

ROOT_QUESTION = "What does this passage say?"
"""The question after a passage's path prefilled in idle time (`RagCache.cache_passage`): the prompt
needs one, and the K/V of what follows the path is not kept."""
BLENDED_PATHS = 1024
"""Blended retrieval paths remembered (`RagCache._plan`), per service."""
LEVELS = ("qa_bank", "kv_tree", "miss")
"""What served a reply: a stored answer, cached K/V of at least one passage, or neither."""


def banked_sampling(params: dict) -> bool:
    """Whether a query with sampling `params` takes and leaves QA bank answers: the bank holds greedy
    answers with no stop strings and no repetition penalties (as the query predictor makes them); a
    query asking for another kind of reply (sampled, cut at a stop string, penalized) gets its own."""
    from engine.sampling import SamplingParams  # here: the governor and IO worker import this module, not torch

    sp = SamplingParams(**params)
    return sp.greedy and not sp.stop and not sp.penalized


@dataclass(slots=True)
class RagAnswer:
    """A RAG query's reply (the HTTP route's body comes from here)."""

    answer: str
    """The reply's text."""
    token_ids: list[int]
    """Its ids (empty for an answer from the QA bank)."""
    finish_reason: str
    """As a call's; `qa_bank` answers say `stop`."""
    level: str
    """Which level served it (`LEVELS`)."""
    sources: list[dict]
    """`{"document", "chunk", "score"}` of each passage, in retrieval order (for a QA bank answer, the
    passages its stored answer came from)."""
    reused_chunks: int
    """Passages whose K/V came from the tree."""
    reused_tokens: int
    """Passage tokens whose K/V came from the tree, exactly (nodes of this retrieval path)."""
    retrieved_tokens: int
    """Passage tokens in the prompt (the K/V hit rate's denominator)."""
    prompt_tokens: int
    """Ids of the prompt (0 for a QA bank answer)."""
    latency: dict[str, float] = field(default_factory=dict)
    """Seconds by stage: `embed`, `retrieve`, `load`, `prefill`, `decode` (and `save`)."""
    similarity: float | None = None
    """For a QA bank answer, the stored question's cosine similarity."""
    blended_tokens: int = 0
    """Passage tokens whose K/V came from nodes of other paths, moved and partly recomputed
    (`RagConfig.blend_ratio`; approximate, unlike `reused_tokens`)."""
    recomputed_tokens: int = 0
    """Of `blended_tokens`, those recomputed."""


class RagCache:
    def __init__(self, bank, store, embed: Callable[[list[str]], np.ndarray], template, run: Callable[[RagCall], RagOutcome],
                 delete_node: Callable[[str], Any], model_key: KVKey, config: RagConfig | None = None,
                 clock: Callable[[], float] = time.time, *, run_stream: Callable[[RagCall], Iterator[Any]]) -> None:
        """`bank`: `storage.knowledge.KnowledgeBank`; `store`: `storage.ragstore.RagStore`; `embed`: the
        embedding model's (`engine.embed.Embedder.embed`); `template`: `engine.rag.RagTemplate`;
        `model_key`: the model part of the KV key (the app and adapter are added per query); `run`:
        the executor port's `rag_call`; `run_stream`: its `rag_stream` with the items resolved (text
        deltas, then the `RagOutcome`), for `query_stream`."""
        self.bank, self.store, self.embed, self.template = bank, store, embed, template
        self.run, self.run_stream, self.delete_node = run, run_stream, delete_node
        self.model_key = model_key
        self.config = config or RagConfig()
        self.clock = clock
        self._trees: dict[tuple[str, str], KVTree] = {}
        self._tree_lock = threading.RLock()
        self._heads: dict[tuple[str, str], int] = {}
        """(app, adapter) -> bytes of the stored head's K/V (0: not stored), as the store has it."""
        self._blended: dict[tuple, None] = {}
        """(app, adapter, path) of recent blended calls, oldest first (at most `BLENDED_PATHS`): a path
        retrieved again is prefilled exactly and saved, so that its next retrieval reuses it exactly."""

    # ---- the K/V tree of an app and adapter --------------------------------------------------------
    def tree(self, app: str, adapter: str = "") -> KVTree:
        t = self._trees.get((app, adapter))
        if t is None:
            rows = self.store.load_tree(app, adapter)
            t = self._trees[(app, adapter)] = KVTree.from_rows(rows.rows, rows.next_id)
            self._heads[(app, adapter)] = rows.head_nbytes
        return t

    def _key(self, app: str, adapter: str) -> KVKey:
        return replace(self.model_key, adapter=adapter, app=app)

    # ---- a query -------------------------------------------------------------------------------------
    def query(self, app: str, collection: str, question: str, **kwargs) -> RagAnswer:
        """Answer `question` over `collection` (an id of `app`'s); the arguments as `query_stream`'s.
        The model's call is the executor port's `rag_call` (retried while the executor restarts)."""
        *_, answer = self._query(app, collection, question, streamed=False, **kwargs)
        return answer

    def query_stream(self, app: str, collection: str, question: str, **kwargs) -> Iterator[str | RagAnswer]:
        """`query` as the reply is decoded: its text deltas (a QA bank answer as one), then the
        `RagAnswer` as the last item. Closed early, the model's call stops and nothing is stored."""
        return self._query(app, collection, question, streamed=True, **kwargs)

    def _query(self, app: str, collection: str, question: str, *, streamed: bool, k: int | None = None,
               tau_query: float | None = None, adapter: str = "", decode: bool = True, predicted: bool = False,
               background: bool = False, replaces: int | None = None, deadline: float | None = None,
               **params) -> Iterator[str | RagAnswer]:
        """`params`: sampling (`max_tokens`, `temperature`, ...). `decode=False` populates the K/V tree
        only (a predicted query, PerCache §4.3.2); `predicted` marks what it stores as the predictor's;
        `background` runs the model at low priority (`RagCall.background`: `PreemptedError` when a real
        call comes); `replaces`: the QA entry of the same question that this answer replaces (its answer
        was stale); `deadline`: `time.time()` past which the model's call stops (`RagCall.deadline`)."""
        cfg = self.config
        k = cfg.k if k is None else k
        tau = cfg.tau_query if tau_query is None else tau_query
        params.setdefault("max_tokens", cfg.max_tokens)
        qa_bank = cfg.qa_bank and banked_sampling(params)
        lat: dict[str, float] = {}
        t = time.perf_counter()
        q = np.asarray(self.embed([question]), np.float32)[0]
        lat["embed"] = time.perf_counter() - t
        if qa_bank and decode and not predicted:
            hit = self._qa_hit(app, collection, adapter, q, tau, lat, params["max_tokens"])
            if hit is not None:
                if hit.answer:
                    yield hit.answer
                yield hit
                return
        t = time.perf_counter()
        hits = self.bank.search(app, collection, question, k, vector=q)
        lat["retrieve"] = time.perf_counter() - t
        path = [int(h.chunk) for h in hits]
        prompt = self.template.build([list(h.token_ids) for h in hits], question)
        use_tree = self.uses_tree(background)
        with self._tree_lock:  # not held while the model runs: a real query never waits for idle work's
            # idle work populates exact nodes; only a real reply may take other paths' K/V
            call, matched, donors = self._plan(app, adapter, path, prompt, decode, params, use_tree=use_tree,
                                               blend=decode and not background and not predicted)
            call.background, call.deadline = background, deadline
        # a node evicted meanwhile fails to read and is recomputed (`actors.rag.stream_rag_call`)
        out = (yield from self._streamed(call)) if streamed else self.run(call)
        reused_nodes = max(0, len(out.loaded) - 1)  # the head is loaded first
        with self._tree_lock:
            used = [d for d, b in zip(donors, call.blend) if b.key in out.blended]
            if use_tree:
                self._update_tree(app, adapter, path[:len(matched)] if call.blend else path, prompt, out,
                                  matched[:reused_nodes] + used)
        lat.update(load=out.load_s, prefill=out.prefill_s, decode=out.decode_s, save=out.save_s)
        if out.blended:
            lat["blend"] = out.blend_s
        passage_tokens = prompt.question - prompt.head
        reused_tokens = max(0, out.reused_tokens - prompt.head) if reused_nodes else 0
        if qa_bank and (decode or predicted):
            self._remember(app, collection, adapter, question, q, out.text if decode else None, path, predicted)
            if replaces is not None:
                self.store.delete_qa(app, [replaces])
        yield RagAnswer(
            answer=out.text, token_ids=out.token_ids, finish_reason=out.finish_reason,
            level="kv_tree" if reused_nodes or out.blended else "miss",
            sources=[{"document": h.document, "chunk": int(h.chunk), "score": float(h.score)} for h in hits],
            reused_chunks=reused_nodes, reused_tokens=reused_tokens, retrieved_tokens=passage_tokens,
            prompt_tokens=len(prompt.ids), latency=lat, blended_tokens=out.blended_tokens,
            recomputed_tokens=out.recomputed_tokens)

    def cache_passage(self, app: str, collection: str, chunk: int, *, adapter: str = "",
                      background: bool = True) -> bool:
        """Prefill the path a question about passage `chunk` (an id of `app`'s `collection`) most likely
        retrieves, unless the tree has it whole: the passage right after the prompt's head, then the
        passages a search with its own text ranks next, `RagConfig.passage_depth` passages in all
        (`passage_path`). A question whose best passage it is then reuses at least that passage's
        node, and the next one's when that is its nearest passage. Prefill only (the question after
        the path is a placeholder, not kept). Idle work: returns whether it prefilled (False where
        idle work does not populate the tree, `uses_tree`, or `passage_depth` is 0)."""
        if not self.uses_tree(background=True) or self.config.passage_depth < 1:
            return False
        path = self.passage_path(app, collection, chunk)
        with self._tree_lock:
            if len(self.tree(app, adapter).match(path)) == len(path):
                return False
        prompt = self.template.build([list(self.bank.chunk(app, c).token_ids) for c in path], ROOT_QUESTION)
        with self._tree_lock:
            call, matched, _ = self._plan(app, adapter, path, prompt, False, {"max_tokens": 1},
                                          use_tree=True, blend=False)
            call.background = background
        out = self.run(call)
        with self._tree_lock:
            self._update_tree(app, adapter, path, prompt, out, matched[:max(0, len(out.loaded) - 1)])
        return True

    def passage_path(self, app: str, collection: str, chunk: int) -> list[int]:
        """Passage `chunk`, then the passages a search of `collection` with its text ranks highest
        besides it: `RagConfig.passage_depth` ids in all (fewer in a smaller collection)."""
        depth = self.config.passage_depth
        if depth <= 1:
            return [chunk]
        hits = self.bank.search(app, collection, self.bank.chunk(app, chunk).text, depth)
        return [chunk, *[int(h.chunk) for h in hits if int(h.chunk) != chunk][:depth - 1]]

    def _streamed(self, call: RagCall):
        """The model's call through `run_stream`: yields its text deltas, returns its `RagOutcome`."""
        items = self.run_stream(call)
        try:
            for item in items:
                if not isinstance(item, str):
                    return item
                yield item
        finally:
            close = getattr(items, "close", None)
            if close is not None:  # stopped early (the client went away): the call stops too
                close()
        raise RuntimeError("the executor's RAG stream ended without an outcome")

    def _qa_hit(self, app, collection, adapter, q, tau, lat, max_tokens: int) -> RagAnswer | None:
        ids, vecs = self.store.qa_vectors(app, collection, adapter)
        i, sim = match_query(q, vecs, tau) if len(ids) else (None, -1.0)
        if i is None:
            return None
        try:
            entry = self.store.qa_entry(app, int(ids[i]))
        except QAEntryNotFoundError:  # deleted since the vectors were read
            return None
        if entry.answer is None:  # stored by prefill only: answered once decoded
            return None
        self.store.count_qa_hit(app, entry.id, self.clock())
        answer, finish = entry.answer, "stop"
        ids = self.template.tok.encode(answer)
        if len(ids) > max_tokens:  # stored under a larger max_tokens: the query's limit holds
            answer, finish = self.template.tok.decode_reply(ids[:max_tokens]), "length"
        return RagAnswer(
            answer=answer, token_ids=[], finish_reason=finish, level="qa_bank",
            sources=[{"document": None, "chunk": int(c), "score": None} for c in entry.chunks],
            reused_chunks=0, reused_tokens=0, retrieved_tokens=0, prompt_tokens=0, latency=lat,
            similarity=float(sim))

    def uses_tree(self, background: bool) -> bool:
        """Whether a query reads and populates the K/V tree: with the tree on, every real query does,
        idle work (`background`) only with `RagConfig.predict_tree`."""
        return self.config.kv_tree and (self.config.predict_tree or not background)

    def _plan(self, app, adapter, path, prompt, decode, params, *, use_tree: bool,
              blend: bool) -> tuple[RagCall, list, list]:
        """The call: the head and the longest cached prefix of `path` to load, the rest to save (`use_tree`
        off: neither, the whole prompt prefilled, nothing kept); with
        `blend` and `RagConfig.blend_ratio`, when every passage past the prefix has a node on another
        path, those nodes' K/V instead (and nothing saved), unless the same path was blended last time
        it came. Returns the call, the matched nodes and the donor nodes."""
        key = self._key(app, adapter)
        spans = [NodeSpan(node_key(key, path[:i + 1]), a, b) for i, (a, b) in enumerate(prompt.spans)]
        head = NodeSpan(node_key(key, ()), 0, prompt.head)
        if not use_tree:
            return RagCall(app, adapter, prompt.ids, [], [], params, decode), [], []
        tree = self.tree(app, adapter)
        cached_head = self._heads[(app, adapter)] > 0
        matched = tree.match(path) if cached_head else []
        load = [head, *spans[:len(matched)]] if cached_head else []
        save = ([] if cached_head else [head]) + spans[len(matched):]
        call = RagCall(app, adapter, prompt.ids, load, save, params, decode)
        rest = list(zip(path[len(matched):], prompt.spans[len(matched):]))
        if not (blend and cached_head and rest and self.config.blend_ratio > 0):
            return call, matched, []
        seen = (app, adapter, tuple(path))
        if seen in self._blended:  # blended before: this time prefilled exactly and saved
            del self._blended[seen]
            return call, matched, []
        donors = [tree.donor(c) for c, _ in rest]
        if not all(d is not None and d.tokens == b - a for d, (_c, (a, b)) in zip(donors, rest)):
            return call, matched, []
        self._blended[seen] = None
        while len(self._blended) > BLENDED_PATHS:
            del self._blended[next(iter(self._blended))]
        call.blend = [BlendSpan(node_key(key, tree.path_of(d.node_id)), prompt.head + tree.offset(d.node_id), a, b)
                      for d, (_c, (a, b)) in zip(donors, rest)]
        call.blend_ratio, call.save = self.config.blend_ratio, []
        return call, matched, donors

    def _update_tree(self, app, adapter, path, prompt, out: RagOutcome, reused) -> None:
        key, tree, now = self._key(app, adapter), self.tree(app, adapter), self.clock()
        head = node_key(key, ())
        if head in out.saved:
            self.store.set_head(app, adapter, out.saved[head])
            self._heads[(app, adapter)] = out.saved[head]
        sizes = [out.saved.get(node_key(key, path[:i + 1]), 0) for i in range(len(path))]
        new = tree.insert(path, [b - a for a, b in prompt.spans[:len(path)]], sizes, now)
        for n in tree.match(path):  # nodes saved again after a failed load carry their new size
            size = out.saved.get(node_key(key, tree.path_of(n.node_id)))
            if size:
                n.nbytes = size
        reused = [n for n in reused if n.node_id in tree]  # not evicted while the call ran
        tree.touch(reused, now)
        changed = {n.node_id: n for n in [*new, *reused, *tree.match(path)]}
        self.store.upsert_nodes(app, adapter, [r for r in tree.to_rows() if r["node_id"] in changed], tree.next_id)
        keep = [n.node_id for n in tree.match(path)]
        victims = plan_tree_eviction(tree, max(0, self.config.tree_cap_bytes - self._heads[(app, adapter)]), keep)
        self._drop_nodes(app, adapter, victims)

    def _drop_nodes(self, app: str, adapter: str, node_ids) -> None:
        key, tree = self._key(app, adapter), self.tree(app, adapter)
        gone = []
        for v in node_ids:
            if v not in tree:
                continue
            paths = {n: tree.path_of(n) for n in self._subtree(tree, v)}
            for n in tree.remove(v):
                self.delete_node(node_key(key, paths[n]))
                gone.append(n)
        if gone:
            self.store.delete_nodes(app, adapter, gone)

    @staticmethod
    def _subtree(tree: KVTree, node_id) -> list:
        out, todo = [], [node_id]
        while todo:
            n = todo.pop()
            out.append(n)
            todo.extend(tree.node(n).children.values())
        return out

    def _remember(self, app, collection, adapter, question, q, answer, path, predicted) -> None:
        self.store.add_qa(app, collection, adapter, question, q, answer, path, predicted=predicted)
        entries = [QAEntry(e.id, e.nbytes, e.hits, e.last_use, e.answer is not None, tuple(e.chunks))
                   for e in self.store.qa_entries(app, collection, adapter)]
        victims = plan_qa_eviction(entries, self.config.qa_cap_bytes)
        if victims:
            self.store.delete_qa(app, victims)

    # ---- documents arriving and leaving ------------------------------------------------------------
    def refresh(self, app: str, collection: str, new_chunks) -> list[int]:
        """New passages of `collection`: the stored answers whose question now retrieves one of them in
        its top k lose their answer (PerCache §4.1.3); the question stays, to be decoded again
        (`unanswered`). Returns the entries made stale."""
        stale = []
        for adapter in {"", *self.store.trees(app)}:
            ids, vecs = self.store.qa_vectors(app, collection, adapter)
            answered = {e.id: e for e in self.store.qa_entries(app, collection, adapter) if e.answer is not None}
            rankings = {int(i): [int(h.chunk) for h in self.bank.search(app, collection, answered[int(i)].question,
                                                                         self.config.k, vector=v)]
                        for i, v in zip(ids, vecs) if int(i) in answered}
            for e in refresh_candidates([int(c) for c in new_chunks], rankings, self.config.k):
                self.store.set_answer(app, e, None)
                stale.append(int(e))
        return stale

    def unanswered(self, app: str) -> list:
        """The app's stored questions without an answer, most hit first (`storage.ragstore.QAEntryRow`)."""
        rows = [e for c in self.bank.collections(app) for adapter in {"", *self.store.trees(app)}
                for e in self.store.qa_entries(app, c.id, adapter) if e.answer is None]
        return sorted(rows, key=lambda e: (-e.hits, e.id))

    def evicted(self, app: str) -> list[QAEntry]:
        """The app's stored questions whose retrieval path is no longer wholly in its K/V tree (nodes
        evicted under the cap), as the cache scheduler sees them (`scheduler.ragcache.missing_kv`)."""
        out = []
        with self._tree_lock:
            for adapter in {"", *self.store.trees(app)}:
                tree = self.tree(app, adapter)
                rows = [e for c in self.bank.collections(app) for e in self.store.qa_entries(app, c.id, adapter)]
                out += missing_kv([QAEntry(e.id, e.nbytes, e.hits, e.last_use, e.answer is not None, tuple(e.chunks))
                                   for e in rows], tree)
        return out


    def chunks_deleted(self, app: str, chunk_ids) -> None:
        """Knowledge chunks of `app` were deleted: every node of them (and below them) goes, with the
        QA entries whose answers came from them (PerCache §4.1.3)."""
        chunk_ids = {int(c) for c in chunk_ids}
        if not chunk_ids:
            return
        with self._tree_lock:
            for adapter in self.store.trees(app):
                tree = self.tree(app, adapter)
                roots = [n.node_id for n in list(tree) if int(n.chunk_id) in chunk_ids]
                self._drop_nodes(app, adapter, roots)
        self.store.delete_qa(app, self.store.qa_using_chunks(app, chunk_ids))
