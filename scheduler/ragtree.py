"""The K/V tree of knowledge chunks (PerCache §4.1.1, after RAGCache's knowledge tree) and Least
Frequently Used eviction of both cache layers under a storage cap.

This module deliberately knows nothing about tensors, files, clocks, embeddings or retrieval: chunk
ids, token counts, byte sizes and times (seconds on the caller's clock) are given to it, and it
answers which cached K/V a retrieval can reuse and what to evict, in order; the caller loads, writes
and deletes the tensors and persists the tree (:meth:`KVTree.to_rows`).

**Tree.** A retrieval gives a *path*: the ids of the knowledge chunks it retrieved, in retrieval
order, which is the order they follow the system prompt in the prompt. A node holds the K/V of its
chunk's tokens computed after the prefix its path gives (the system prompt, then the chunks before it
on the path). The same chunk after another prefix attended to other tokens, so it is another node:
the tree is keyed by the whole path. The root is implicit (the system prompt alone: a caller keeps one
tree per system prompt, e.g. per app). Reuse must be a prefix (PerCache §4.2.2): a chunk's K/V is
valid only after exactly its prefix, so :meth:`KVTree.match` stops at the first chunk with no node; a
node deeper than a miss is of no use to that retrieval. A deleted knowledge chunk takes every node
of it and all their descendants with it (:meth:`KVTree.remove_chunk`): their K/V was computed after
it.

How a node's tokens meet its neighbours' at a boundary (PerCache appendix B.2: a tokenizer may merge
across chunk boundaries) is the caller's business: a node's ``tokens`` is what it holds.

**Eviction.** PerCache keeps a retrieval count per cached item and evicts the least frequently used
to keep storage under the configured limit (§4.1.1). :func:`plan_tree_eviction` evicts leaves only: a
node with a cached descendant stays, since the descendant is useless without it; evicting a leaf may
make its parent a leaf, which then competes too. :func:`plan_lfu_eviction` (the QA bank's) has no
structure. Both order by :func:`lfu_key`: fewest hits, then least recently used, then the id, so the
plan is deterministic; both stop as soon as the bytes left are within the cap.

Invariants (checked by :meth:`KVTree.check`): every node's parent is in the tree and lists it as its
child under its chunk id (the root's children likewise), so every node is reachable from the root and
no two siblings share a chunk; ``bytes()`` is the sum of the nodes' ``nbytes``; node ids are unique,
never reused during a tree's life (across a restart too when :attr:`KVTree.next_id` is saved with the
rows) and a parent's is lower than its children's.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NewType, Protocol

from scheduler.errors import SchedulerError
from scheduler.keys import count

#: a knowledge chunk's id in the knowledge bank
ChunkId = NewType("ChunkId", int)
#: a node of the K/V tree, assigned by the tree
NodeId = NewType("NodeId", int)

#: the keys of one row of :meth:`KVTree.to_rows` (a node's persisted fields)
ROW_FIELDS = ("node_id", "parent", "chunk_id", "tokens", "nbytes", "hits", "last_use")


class UnknownNodeError(SchedulerError, KeyError):
    """A node id is not in the K/V tree asked about."""

    code = "unknown_kv_node"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


@dataclass(slots=True)
class KVNode:
    """The cached K/V of one knowledge chunk after one prefix."""

    node_id: NodeId
    """Assigned by the tree; unique and never reused during the tree's life."""
    chunk_id: ChunkId
    """The knowledge chunk whose tokens it holds."""
    parent: NodeId | None
    """The node of the chunk before it on its path; None: it follows the system prompt directly."""
    tokens: int
    """Tokens of the chunk it holds."""
    nbytes: int
    """Bytes its K/V takes where it is stored, bytes."""
    hits: int = 0
    """Retrievals that reused it (the LFU count)."""
    last_use: float = 0.0
    """When it was inserted or last reused, seconds on the caller's clock."""
    children: dict[ChunkId, NodeId] = field(default_factory=dict)
    """The node of the next chunk, by chunk id, for each cached path that continues after it."""


class LFUItem(Protocol):
    """What LFU eviction reads of a cached item."""

    nbytes: int
    hits: int
    last_use: float


def lfu_key(item: LFUItem, item_id: int) -> tuple:
    """Sort key of LFU eviction, smallest first: fewest hits, then oldest use, then lowest id."""
    return (item.hits, item.last_use, item_id)


class KVTree:
    """Cached K/V of knowledge chunks, one node per chunk and prefix (see the module docstring)."""

    def __init__(self) -> None:
        self._nodes: dict[NodeId, KVNode] = {}  # every node, in increasing id order
        self._roots: dict[ChunkId, NodeId] = {}  # children of the implicit root, by chunk id
        self._by_chunk: dict[ChunkId, set[NodeId]] = {}  # every node of a chunk (remove_chunk)
        self._bytes = 0  # sum of the nodes' nbytes, bytes
        self._next = 0  # the id the next node gets

    # -- queries -----------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[KVNode]:
        """Every node, in increasing id order (a parent before its children)."""
        return iter(list(self._nodes.values()))

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._nodes

    def bytes(self) -> int:
        """Bytes of all cached K/V."""
        return self._bytes

    def node(self, node_id: int) -> KVNode:
        """The node ``node_id``; :class:`UnknownNodeError` if the tree has none."""
        try:
            return self._nodes[NodeId(node_id)]
        except KeyError:
            raise UnknownNodeError(f"no K/V node {node_id!r}") from None

    def path_of(self, node_id: int) -> list[ChunkId]:
        """The chunk ids from the root to ``node_id``, inclusive."""
        out, node = [], self.node(node_id)
        while True:
            out.append(node.chunk_id)
            if node.parent is None:
                return out[::-1]
            node = self._nodes[node.parent]

    def match(self, path: Sequence[int]) -> list[KVNode]:
        """The nodes of the longest cached prefix of ``path``, root first (empty on a first miss)."""
        out: list[KVNode] = []
        kids = self._roots
        for chunk in path:
            nid = kids.get(ChunkId(chunk))
            if nid is None:
                break
            node = self._nodes[nid]
            out.append(node)
            kids = node.children
        return out

    def donor(self, chunk_id: int) -> KVNode | None:
        """A stored node of ``chunk_id`` after any prefix, for a retrieval that reaches the chunk after
        another one (CacheBlend's reuse, approximate: the caller recomputes part of it): the most
        reused, then the most recently used, then the lowest id; None when the tree has none."""
        nodes = [self._nodes[n] for n in self._by_chunk.get(ChunkId(chunk_id), ()) if self._nodes[n].nbytes > 0]
        return max(nodes, key=lambda n: (n.hits, n.last_use, -n.node_id), default=None)

    def offset(self, node_id: int) -> int:
        """Tokens of the chunks before ``node_id`` on its path: where its K/V starts after the root."""
        node, total = self.node(node_id), 0
        while node.parent is not None:
            node = self._nodes[node.parent]
            total += node.tokens
        return total

    # -- updates -----------------------------------------------------------------------------------

    def insert(self, path: Sequence[int], tokens: int | Sequence[int], nbytes: int | Sequence[int],
               now: float) -> list[KVNode]:
        """Add the nodes of ``path`` past its longest cached prefix, last used ``now``, with no hits.

        ``tokens`` and ``nbytes`` are per chunk of ``path`` (values for the cached prefix are not
        read) or one value for every chunk. Returns the new nodes, root side first; nodes already
        cached are left as they are (:meth:`touch` counts their reuse).
        """
        chunks = [ChunkId(count("chunk id", c)) for c in path]
        toks = _per_chunk("tokens", tokens, len(chunks), 1)
        sizes = _per_chunk("nbytes", nbytes, len(chunks), 0)
        now = float(now)
        have = self.match(chunks)
        parent = have[-1].node_id if have else None
        kids = have[-1].children if have else self._roots
        new = []
        for i in range(len(have), len(chunks)):
            node = KVNode(NodeId(self._next), chunks[i], parent, toks[i], sizes[i], 0, now)
            self._next += 1
            self._add(node, kids)
            new.append(node)
            parent, kids = node.node_id, node.children
        return new

    def touch(self, nodes: Iterable[KVNode], now: float) -> None:
        """Count one reuse of each of ``nodes`` (as :meth:`match` returned them), used at ``now``."""
        found = [self.node(n.node_id) for n in nodes]  # all checked before any changes
        for node in found:
            node.hits += 1
            node.last_use = float(now)

    def remove(self, node_id: int) -> list[NodeId]:
        """Remove ``node_id`` and its descendants (their K/V was computed after it); returns their
        ids, parents before children."""
        top = self.node(node_id)
        siblings = self._roots if top.parent is None else self._nodes[top.parent].children
        del siblings[top.chunk_id]
        out, stack = [], [top.node_id]
        while stack:
            node = self._nodes.pop(stack.pop())
            out.append(node.node_id)
            self._bytes -= node.nbytes
            same = self._by_chunk[node.chunk_id]
            same.discard(node.node_id)
            if not same:
                del self._by_chunk[node.chunk_id]
            stack.extend(sorted(node.children.values(), reverse=True))
        return out

    def remove_chunk(self, chunk_id: int) -> list[NodeId]:
        """Remove every node of a deleted knowledge chunk and all their descendants; returns the
        removed ids, ascending (none if the chunk has no node)."""
        out: list[NodeId] = []
        for nid in sorted(self._by_chunk.get(ChunkId(chunk_id), ())):
            if nid in self._nodes:  # not removed already as a descendant of an earlier one
                out += self.remove(nid)
        return sorted(out)

    # -- persistence -------------------------------------------------------------------------------

    def to_rows(self) -> list[dict[str, Any]]:
        """One plain dict per node (keys :data:`ROW_FIELDS`), parents before children: what a caller
        stores in a table and gives back to :meth:`from_rows`."""
        return [{"node_id": n.node_id, "parent": n.parent, "chunk_id": n.chunk_id, "tokens": n.tokens,
                 "nbytes": n.nbytes, "hits": n.hits, "last_use": n.last_use} for n in self._nodes.values()]

    @property
    def next_id(self) -> int:
        """The id the next new node gets (persist it beside the rows: see :meth:`from_rows`)."""
        return self._next

    @classmethod
    def from_rows(cls, rows: Iterable[Mapping[str, Any]], next_id: int = 0) -> KVTree:
        """The tree :meth:`to_rows` gave, rows in any order; ``ValueError`` for a row with missing
        keys or bad values, a parent that is not a lower node id, or two siblings of one chunk.

        New ids resume after the highest row's, or at ``next_id`` (the saved :attr:`next_id`) if that
        is higher: without it, the id of a node removed before the save may be handed out again.
        """
        tree = cls()
        nodes: dict[NodeId, KVNode] = {}
        for row in rows:
            missing = set(ROW_FIELDS) - row.keys()
            if missing:
                raise ValueError(f"K/V tree row {dict(row)!r} lacks {sorted(missing)}")
            nid = NodeId(count("node_id", row["node_id"]))
            if nid in nodes:
                raise ValueError(f"K/V tree rows hold node {nid} twice")
            parent = None if row["parent"] is None else NodeId(count("parent", row["parent"]))
            nodes[nid] = KVNode(nid, ChunkId(count("chunk_id", row["chunk_id"])), parent,
                                count("tokens", row["tokens"], 1), count("nbytes", row["nbytes"]),
                                count("hits", row["hits"]), float(row["last_use"]))
        for nid in sorted(nodes):  # parents first: a parent's id is lower (which also rules out cycles)
            node = nodes[nid]
            if node.parent is not None and node.parent not in tree._nodes:
                raise ValueError(f"K/V node {nid} has parent {node.parent}, which is not a lower node id")
            kids = tree._roots if node.parent is None else tree._nodes[node.parent].children
            if node.chunk_id in kids:
                raise ValueError(f"K/V nodes {kids[node.chunk_id]} and {nid} are one chunk after one prefix")
            tree._add(node, kids)
        tree._next = max(max(nodes, default=-1) + 1, count("next_id", next_id))
        return tree

    def check(self) -> None:
        """Raise ``RuntimeError`` if an invariant of the module docstring is broken."""
        if self._bytes != sum(n.nbytes for n in self._nodes.values()):
            raise RuntimeError("tree bytes differ from the sum of its nodes")
        for chunk, nid in self._roots.items():
            if self._nodes[nid].parent is not None or self._nodes[nid].chunk_id != chunk:
                raise RuntimeError(f"root child {nid} is misfiled")
        for node in self._nodes.values():
            for chunk, kid in node.children.items():
                if self._nodes[kid].parent != node.node_id or self._nodes[kid].chunk_id != chunk:
                    raise RuntimeError(f"child {kid} of node {node.node_id} is misfiled")
            if node.node_id >= self._next or node.node_id not in self._by_chunk.get(node.chunk_id, ()):
                raise RuntimeError(f"node {node.node_id} is not indexed")
            if node.parent is not None and node.parent >= node.node_id:
                raise RuntimeError(f"node {node.node_id} has a parent with a higher id")
        if len(self._reachable()) != len(self._nodes) or sum(map(len, self._by_chunk.values())) != len(self):
            raise RuntimeError("tree holds unreachable or stale nodes")

    # -- internals ---------------------------------------------------------------------------------

    def _add(self, node: KVNode, siblings: dict[ChunkId, NodeId]) -> None:
        siblings[node.chunk_id] = node.node_id
        self._nodes[node.node_id] = node
        self._by_chunk.setdefault(node.chunk_id, set()).add(node.node_id)
        self._bytes += node.nbytes

    def _reachable(self) -> set[NodeId]:
        seen: set[NodeId] = set()
        stack = list(self._roots.values())
        while stack:
            nid = stack.pop()
            if nid not in seen:
                seen.add(nid)
                stack.extend(self._nodes[nid].children.values())
        return seen


def plan_tree_eviction(tree: KVTree, cap_bytes: int, keep: Collection[int] = ()) -> list[NodeId]:
    """Node ids to evict, in order, so that the tree's bytes fall to ``cap_bytes`` or below.

    Leaves only, LFU first (:func:`lfu_key`); a parent whose last cached child goes competes from then
    on. Nodes in ``keep`` (in use by a running call) are never planned, so neither are their
    ancestors; when they hold more than the cap the plan frees what it can. Carrying it out in order
    with :meth:`KVTree.remove` removes a leaf each time.
    """
    cap = count("cap_bytes", cap_bytes)
    left = tree.bytes()
    if left <= cap:
        return []
    kids = {n.node_id: len(n.children) for n in tree}
    heap = [(lfu_key(n, n.node_id), n.node_id) for n in tree if not n.children and n.node_id not in keep]
    heapq.heapify(heap)
    out: list[NodeId] = []
    while left > cap and heap:
        _, nid = heapq.heappop(heap)
        node = tree.node(nid)
        out.append(nid)
        left -= node.nbytes
        if node.parent is not None:
            kids[node.parent] -= 1
            if not kids[node.parent] and node.parent not in keep:
                parent = tree.node(node.parent)
                heapq.heappush(heap, (lfu_key(parent, parent.node_id), parent.node_id))
    return out


def plan_lfu_eviction(items: Mapping[int, LFUItem], cap_bytes: int) -> list[int]:
    """Ids of ``items`` (id -> item) to evict, in LFU order, so that their bytes fall to ``cap_bytes``
    or below (none if they already are)."""
    cap = count("cap_bytes", cap_bytes)
    left = sum(item.nbytes for item in items.values())
    out = []
    for _, item_id in sorted((lfu_key(item, i), i) for i, item in items.items()):
        if left <= cap:
            break
        out.append(item_id)
        left -= items[item_id].nbytes
    return out


def _per_chunk(name: str, value: int | Sequence[int], n: int, minimum: int) -> list[int]:
    """``value`` for each of ``n`` chunks: one int for all, or ``n`` of them (a list, an array)."""
    if not isinstance(value, Iterable):  # one int (numpy's included)
        return [count(name, value, minimum)] * n
    values = [count(name, v, minimum) for v in value]
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} values for a path of {n} chunks")
    return values
