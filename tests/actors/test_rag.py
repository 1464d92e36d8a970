"""The RAG cache's moving parts: node K/V through chunk records, and the executor's side of a call."""

from __future__ import annotations

import os

import numpy as np
import pytest

from actors.messages import KVKey, NodeSpan, RagCall
from actors.rag import load_node, node_key, run_rag_call, save_node
from actors.swapio import KVSwapIO
from engine.rag import RagTemplate

PASSAGES = [
    "The Eiffel Tower in Paris was finished in 1889 for the World's Fair.",
    "Mount Fuji is the highest mountain in Japan, at 3,776 metres.",
    "The Nile flows north through eleven countries into the Mediterranean Sea.",
]


@pytest.fixture
def io(tmp_path, engine):
    return KVSwapIO(str(tmp_path / "chunks"), KVKey(engine.model.fingerprint or "m"))


def test_node_keys_differ_by_app_model_adapter_and_path():
    key = KVKey("f" * 16, app="a")
    keys = {node_key(key, ()), node_key(key, (1,)), node_key(key, (1, 2)), node_key(key, (2, 1)),
            node_key(KVKey("f" * 16, app="b"), (1,)), node_key(KVKey("f" * 16, adapter="x@1", app="a"), (1,)),
            node_key(KVKey("f" * 16, "int4", app="a"), (1,)), node_key(KVKey("e" * 16, app="a"), (1,))}
    assert len(keys) == 8 and all(len(k) == 40 for k in keys)
    assert node_key(key, (1, 2)) == node_key(KVKey("f" * 16, app="a"), [1, 2])  # a function of them alone


def test_a_node_is_read_back_bit_for_bit_and_refused_under_another_adapter(io, engine):
    cfg = engine.model.cfg
    kv = np.random.default_rng(0).standard_normal((cfg.n_layers, 2, cfg.n_kv_heads, 37, cfg.head_dim)
                                                  ).astype(np.float32)
    node = NodeSpan("ab" * 20, 21, 58)
    assert save_node(io, node, kv, "x@1") > kv.nbytes  # three records of 16, 16 and 5 slots
    assert sorted(io.store.indices(node.key)) == [0, 1, 2]
    assert np.array_equal(load_node(io, node, "x@1"), kv)
    assert load_node(io, node, "") is None and load_node(io, node, "x@2") is None
    assert load_node(io, NodeSpan("cd" * 20, 0, 16), "x@1") is None  # never written


def _call(prompt, load, save, **kw):
    return RagCall("app", "", prompt.ids, load, save, {"max_tokens": 12}, **kw)


def test_a_call_from_cached_nodes_answers_as_the_whole_prefill_and_recomputes_what_fails(io, engine):
    t = RagTemplate(engine.tok)
    key = KVKey(engine.model.fingerprint or "m", app="app")
    ids = [engine.tok.encode(p) for p in PASSAGES]
    path = [7, 8, 9]
    pr = t.build(ids, "How tall is Mount Fuji?")
    nodes = [NodeSpan(node_key(key, ()), 0, pr.head)] + [
        NodeSpan(node_key(key, path[:i + 1]), a, b) for i, (a, b) in enumerate(pr.spans)]

    first = run_rag_call(engine, io, _call(pr, [], nodes))
    assert first.reused_tokens == 0 and first.loaded == [] and set(first.saved) == {n.key for n in nodes}

    again = run_rag_call(engine, io, _call(pr, nodes, []))
    assert again.token_ids == first.token_ids and again.reused_tokens == pr.spans[-1][1]
    assert again.loaded == [n.key for n in nodes] and again.saved == {}

    # a corrupt record of the second passage's node: it and the node after it are recomputed and rewritten
    p = io.store.path(nodes[2].key, 0)
    data = bytearray(open(p, "rb").read())
    data[-9] ^= 0x10
    open(p, "wb").write(bytes(data))
    fixed = run_rag_call(engine, io, _call(pr, nodes, []))
    assert fixed.token_ids == first.token_ids and fixed.reused_tokens == pr.spans[0][1]
    assert fixed.loaded == [nodes[0].key, nodes[1].key] and set(fixed.saved) == {nodes[2].key, nodes[3].key}
    assert run_rag_call(engine, io, _call(pr, nodes, [])).loaded == [n.key for n in nodes]

    # prefill only: the tree is populated, no reply
    other = t.build([ids[1]], "Where is Mount Fuji?")
    node = NodeSpan(node_key(key, [8]), other.spans[0][0], other.spans[0][1])
    ahead = run_rag_call(engine, io, _call(other, nodes[:1], [node], decode=False))
    assert ahead.text == "" and ahead.token_ids == [] and set(ahead.saved) == {node.key}
    assert os.path.exists(io.store.path(node.key, 0))


def test_a_blended_call_moves_other_paths_nodes_and_recomputes_its_share(io, engine):
    """Passages cached after another prefix (CacheBlend): placed at this prompt's slots and partly
    recomputed; all of them recomputed, the reply is the whole prefill's. Nothing blended is saved."""
    from actors.messages import BlendSpan

    t = RagTemplate(engine.tok)
    key = KVKey(engine.model.fingerprint or "m", app="app")
    ids = [engine.tok.encode(p) for p in PASSAGES]
    first = t.build(ids, "How tall is Mount Fuji?")  # path [7, 8, 9]
    nodes = [NodeSpan(node_key(key, ()), 0, first.head)] + [
        NodeSpan(node_key(key, [7, 8, 9][:i + 1]), a, b) for i, (a, b) in enumerate(first.spans)]
    run_rag_call(engine, io, _call(first, [], nodes))
    pr = t.build([ids[2], ids[0]], "Where does the Nile flow?")  # path [9, 7]: neither node's prefix
    whole = run_rag_call(engine, io, _call(pr, [], []))
    blend = [BlendSpan(nodes[3].key, first.spans[2][0], *pr.spans[0]),
             BlendSpan(nodes[1].key, first.spans[0][0], *pr.spans[1])]
    n = pr.question - pr.head
    full = run_rag_call(engine, io, _call(pr, nodes[:1], [], blend=blend, blend_ratio=1.0))
    assert full.token_ids == whole.token_ids
    assert full.blended == [b.key for b in blend] and full.blended_tokens == n and full.recomputed_tokens == n
    assert full.reused_tokens == pr.head and full.saved == {}
    part = run_rag_call(engine, io, _call(pr, nodes[:1], [], blend=blend, blend_ratio=0.2))
    first = sum(-(-(b - a) // 5) for a, b in pr.spans)  # the first fifth of each passage
    assert part.blended_tokens == n and part.recomputed_tokens == first and part.saved == {}
    assert part.token_ids and part.blend_s > 0
    # a donor that fails to read ends the blend there: the rest is prefilled
    gone = [BlendSpan("ef" * 20, 0, *pr.spans[0]), blend[1]]
    none = run_rag_call(engine, io, _call(pr, nodes[:1], [], blend=gone, blend_ratio=0.2))
    assert none.blended == [] and none.token_ids == whole.token_ids
