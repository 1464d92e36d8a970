"""The RAG cache's policy: the K/V tree (prefix matching, removal, rows), LFU eviction, QA bank matching,
refresh and deletion, the cache scheduler's decisions, idle detection, prediction triggers and slices.
All times are injected; nothing sleeps."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from scheduler.ragcache import (DEFAULT_TAU_SCHEDULER, REASONS, CacheScheduler, Conversion, IdlePolicy,
                                IdleState, KVTree, Populate, PredictRound, QAEntry, Slice, UnknownNodeError,
                                dropped_by_deletion, match_query, missing_kv, plan_qa_eviction,
                                plan_tree_eviction, refresh_candidates, slices)

DAY = 86400.0


def chunks(nodes):
    return [n.chunk_id for n in nodes]


# -- K/V tree ---------------------------------------------------------------------------------------


def test_match_is_the_longest_cached_prefix():
    t = KVTree()
    t.insert([1, 2, 3], 16, 100, now=0.0)
    assert chunks(t.match([1, 2, 3, 4])) == [1, 2, 3]
    assert chunks(t.match([1, 5, 3])) == [1]  # 3 is cached, but after [1, 2], not after [1, 5]
    assert t.match([2, 3]) == [] and t.match([]) == []


def test_the_same_chunk_after_two_prefixes_is_two_nodes():
    t = KVTree()
    a = t.insert([1, 3], 16, 100, now=0.0)
    b = t.insert([2, 3], 16, 100, now=0.0)
    assert a[1].chunk_id == b[1].chunk_id == 3 and a[1].node_id != b[1].node_id
    assert len(t) == 4 and t.bytes() == 400
    assert t.path_of(a[1].node_id) == [1, 3] and t.path_of(b[1].node_id) == [2, 3]
    t.check()


def test_a_donor_is_a_stored_node_of_the_chunk_after_any_prefix_most_reused_first():
    t = KVTree()
    a = t.insert([1, 3], [10, 20], 100, now=0.0)
    b = t.insert([2, 5, 3], [11, 12, 20], [100, 0, 100], now=1.0)
    assert t.donor(4) is None and t.donor(5) is None  # none, and one not stored (no bytes)
    assert t.donor(3) is b[2]  # no reuse yet: the later use
    t.touch([a[1]], now=0.5)
    assert t.donor(3) is a[1] and t.donor(1) is a[0]  # the more reused
    assert t.offset(a[1].node_id) == 10 and t.offset(b[2].node_id) == 23 and t.offset(a[0].node_id) == 0


def test_insert_adds_only_the_missing_suffix():
    t = KVTree()
    first = t.insert([1, 2], [10, 20], [100, 200], now=1.0)
    new = t.insert([1, 2, 3], [99, 99, 30], [999, 999, 300], now=2.0)  # the cached prefix's values unread
    assert [(n.chunk_id, n.tokens, n.nbytes, n.parent, n.hits, n.last_use) for n in new] == [
        (3, 30, 300, first[1].node_id, 0, 2.0)]
    assert t.match([1, 2, 3]) == first + new
    assert t.insert([1, 2, 3], 1, 1, now=3.0) == [] and t.bytes() == 600
    with pytest.raises(ValueError, match="2 values for a path of 3"):
        t.insert([4, 5, 6], [1, 2], 10, now=0.0)
    with pytest.raises(ValueError):
        t.insert([4], 0, 10, now=0.0)  # a chunk holds at least one token
    assert len(t) == 3
    assert [(n.tokens, n.nbytes) for n in t.insert([7, 8], np.array([3, 4]), np.int64(5), now=0.0)] == [(3, 5), (4, 5)]
    t.check()


def test_touch_counts_reuse():
    t = KVTree()
    t.insert([1, 2], 16, 100, now=0.0)
    t.touch(t.match([1, 2]), now=5.0)
    t.touch(t.match([1]), now=7.0)
    assert [(n.hits, n.last_use) for n in t] == [(2, 7.0), (1, 5.0)]


def test_remove_chunk_removes_every_node_of_it_and_their_descendants():
    t = KVTree()
    t.insert([1, 2, 3], 16, 10, now=0.0)
    t.insert([1, 4], 16, 10, now=0.0)
    t.insert([2, 5], 16, 10, now=0.0)
    t.insert([6, 7, 2], 16, 10, now=0.0)
    ids = {tuple(t.path_of(n.node_id)): n.node_id for n in t}
    removed = t.remove_chunk(2)
    assert removed == sorted(ids[p] for p in [(1, 2), (1, 2, 3), (2,), (2, 5), (6, 7, 2)])
    assert sorted(tuple(t.path_of(n.node_id)) for n in t) == [(1,), (1, 4), (6,), (6, 7)]
    assert chunks(t.match([1, 2, 3])) == [1] and t.bytes() == 40
    assert t.remove_chunk(2) == [] and t.remove_chunk(99) == []
    t.check()
    with pytest.raises(UnknownNodeError):
        t.node(ids[(2,)])


def test_rows_round_trip_in_any_order():
    t = KVTree()
    t.insert([1, 2, 3], [5, 6, 7], [50, 60, 70], now=1.5)
    t.insert([1, 4], 8, 80, now=2.5)
    t.touch(t.match([1, 4]), now=3.5)
    last = t.insert([9], 1, 1, now=4.0)[0]
    t.remove(last.node_id)  # the highest id is gone
    rows = json.loads(json.dumps(t.to_rows()))  # plain values only
    random.Random(0).shuffle(rows)
    u = KVTree.from_rows(rows, next_id=t.next_id)
    u.check()
    assert u.to_rows() == t.to_rows() and u.bytes() == t.bytes()
    assert chunks(u.match([1, 2, 3])) == [1, 2, 3]
    assert u.insert([8], 1, 1, now=5.0)[0].node_id == t.insert([8], 1, 1, now=5.0)[0].node_id == last.node_id + 1
    assert KVTree.from_rows(rows).next_id == last.node_id  # without next_id: after the highest row


@pytest.mark.parametrize("change, error", [
    (lambda rows: rows[0].pop("hits"), "lacks"),
    (lambda rows: rows[1].update(parent=5), "not a lower node id"),
    (lambda rows: rows[2].update(parent=None, chunk_id=1), "one chunk after one prefix"),
    (lambda rows: rows.append(dict(rows[0])), "twice"),
])
def test_bad_rows_are_refused(change, error):
    t = KVTree()
    t.insert([1, 2, 3], 16, 10, now=0.0)
    rows = t.to_rows()
    change(rows)
    with pytest.raises(ValueError, match=error):
        KVTree.from_rows(rows)


# -- LFU eviction -----------------------------------------------------------------------------------


def lfu_tree():
    """[1, 2, 3] hit 3 / 1 / 0 times, [1, 4] hit 0 times (used later), [5] hit 2 times; 100 bytes each."""
    t = KVTree()
    t.insert([1, 2, 3], 16, 100, now=0.0)
    t.insert([1, 4], 16, 100, now=1.0)
    t.insert([5], 16, 100, now=0.0)
    for path, times in (([1, 2], 1), ([1], 2), ([5], 2)):
        for _ in range(times):
            t.touch(t.match(path), now=2.0)
    return t, {tuple(t.path_of(n.node_id)): n.node_id for n in t}


def test_lfu_evicts_leaves_only_and_cascades_to_a_parent():
    t, ids = lfu_tree()
    assert t.bytes() == 500
    # leaves: 3 (0 hits, used 0.0), 4 (0 hits, used 1.0), 5 (2 hits): 3 first, by the older use
    assert plan_tree_eviction(t, 400) == [ids[(1, 2, 3)]]
    # 2 becomes a leaf with 1 hit and goes before 5 (2 hits); 1 (3 hits) is nobody's leaf until 2 and 4 go
    everything = [ids[p] for p in [(1, 2, 3), (1, 4), (1, 2), (5,), (1,)]]
    assert plan_tree_eviction(t, 0) == everything
    assert plan_tree_eviction(t, 250) == everything[:3]  # stops as soon as bytes <= cap
    assert plan_tree_eviction(t, 500) == []
    for nid in everything[:3]:  # carrying it out in order removes a leaf each time
        assert t.remove(nid) == [nid]
    assert t.bytes() == 200
    t.check()


def test_lfu_ties_go_to_the_older_use_then_the_lower_id():
    t = KVTree()
    a, b, c = (t.insert([k], 16, 10, now=now)[0] for k, now in ((1, 5.0), (2, 5.0), (3, 4.0)))
    assert plan_tree_eviction(t, 0) == [c.node_id, a.node_id, b.node_id]


def test_lfu_never_plans_a_kept_node_or_its_ancestors():
    t, ids = lfu_tree()
    plan = plan_tree_eviction(t, 0, keep={ids[(1, 2, 3)]})
    assert plan == [ids[(1, 4)], ids[(5,)]]  # 1 and 2 stay above the kept leaf; the cap is not reached


def test_lfu_matches_a_sort_everything_reference():
    rng = random.Random(1)
    for _ in range(30):
        t = KVTree()
        for _ in range(12):
            path = [rng.randrange(5) for _ in range(rng.randrange(1, 4))]
            if len(set(path)) == len(path):
                t.insert(path, 16, rng.randrange(1, 50), now=float(rng.randrange(4)))
                t.touch(t.match(path)[: rng.randrange(len(path) + 1)], now=float(rng.randrange(4)))
        cap = rng.randrange(t.bytes() + 1)
        ref, left, gone = [], t.bytes(), set()
        while left > cap:  # the cheapest current leaf, recomputed from scratch each time
            leaves = [n for n in t if n.node_id not in gone and all(k in gone for k in n.children.values())]
            victim = min(leaves, key=lambda n: (n.hits, n.last_use, n.node_id))
            ref.append(victim.node_id)
            gone.add(victim.node_id)
            left -= victim.nbytes
        assert plan_tree_eviction(t, cap) == ref


def test_qa_eviction_is_lfu_under_the_cap():
    entries = [QAEntry(1, 40, hits=2, last_use=1.0), QAEntry(2, 40, hits=0, last_use=3.0),
               QAEntry(3, 40, hits=0, last_use=2.0), QAEntry(4, 40, hits=5, last_use=0.0)]
    assert plan_qa_eviction(entries, 160) == []
    assert plan_qa_eviction(entries, 100) == [3, 2]
    assert plan_qa_eviction(entries, 0) == [3, 2, 1, 4]


# -- QA bank ----------------------------------------------------------------------------------------


def test_query_matches_at_the_threshold_and_not_just_below():
    bank = np.array([[0.6, 0.8], [0.0, 1.0]])
    query = np.array([2.0, 0.0])  # any norm: cosine 0.6 with row 0, 0.0 with row 1
    assert match_query(query, bank, 0.6) == (0, 0.6)
    assert match_query(query, bank, float(np.nextafter(0.6, 1.0))) == (None, 0.6)
    assert match_query(np.array([0.0, 1.0]), bank, 0.85) == (1, 1.0)
    assert match_query(query, np.zeros((0, 2)), 0.5) == (None, -1.0)
    with pytest.raises(ValueError):
        match_query(np.zeros(2), bank, 0.5)
    with pytest.raises(ValueError):
        match_query(np.ones(3), bank, 0.5)


def test_refresh_when_a_new_chunk_ranks_in_the_top_k():
    rankings = {10: [7, 1, 2], 11: [1, 2, 7], 12: [3, 4, 5], 13: []}
    assert refresh_candidates([7], rankings, k_refresh=2) == [10]
    assert refresh_candidates([7], rankings, k_refresh=3) == [10, 11]
    assert refresh_candidates([8, 9], rankings, k_refresh=3) == []
    with pytest.raises(ValueError):
        refresh_candidates([7], rankings, k_refresh=0)


def test_deleted_chunks_drop_the_entries_that_retrieved_them():
    sources = {1: [4, 5], 2: [6], 3: (5, 9), 4: []}
    assert dropped_by_deletion(sources, [5]) == [1, 3]
    assert dropped_by_deletion(sources, {6, 9}) == [2, 3]
    assert dropped_by_deletion(sources, []) == []


def test_missing_kv_finds_entries_whose_path_was_evicted():
    t = KVTree()
    t.insert([1, 2], 16, 10, now=0.0)
    whole, cut, none = QAEntry(1, 10, chunks=(1, 2)), QAEntry(2, 10, chunks=(1, 3)), QAEntry(3, 10)
    assert missing_kv([whole, cut, none], t) == [cut]


# -- cache scheduler --------------------------------------------------------------------------------


def test_population_is_prefill_only_above_the_cutoff():
    s = CacheScheduler()
    assert s.tau_scheduler == DEFAULT_TAU_SCHEDULER == 0.85
    assert s.populate(0.90) == Populate(prefill=True, decode=False)  # PerCache §5.5.1's raised threshold
    assert s.populate(0.85) == Populate(prefill=True, decode=True)
    assert s.populate(0.60) == Populate(prefill=True, decode=True)
    assert CacheScheduler(tau_scheduler=0.5).populate(0.6).decode is False
    with pytest.raises(ValueError):
        CacheScheduler(tau_scheduler=1.5)


def test_population_decodes_nothing_without_a_qa_bank_nor_before_the_passages_are_covered():
    s = CacheScheduler()
    assert s.answers_after_coverage
    assert s.populate(0.85, qa_bank=False) == Populate(prefill=True, decode=False)
    assert s.populate(0.85, from_passages=True) == Populate(prefill=True, decode=False)  # the conversion answers
    assert s.populate(0.85, from_passages=False).decode  # the history's questions, the conversion's decodes
    assert s.populate(0.85, kv_tree=False, from_passages=True).decode  # no tree keeps a prefill: decode at once
    assert s.populate(0.90, from_passages=False).decode is False
    own = CacheScheduler(answers_after_coverage=False)  # PerCache's rule alone
    assert own.populate(0.85, from_passages=True).decode and not own.populate(0.90, from_passages=True).decode
    assert CacheScheduler.from_dict(own.to_dict()).answers_after_coverage is False


def test_conversion_decodes_unanswered_entries_when_tau_falls_to_the_cutoff():
    s = CacheScheduler()
    unanswered = [QAEntry(1, 10, hits=0, last_use=1.0), QAEntry(2, 10, hits=3), QAEntry(3, 10, hits=0, last_use=2.0)]
    assert s.convert(0.90, 0.85, unanswered, [], storage_grew=False) == [
        Conversion("decode", 2), Conversion("decode", 3), Conversion("decode", 1)]  # most hit, then newest
    assert s.convert(0.85, 0.80, unanswered, [], storage_grew=False) == []  # was below already
    assert s.convert(0.80, 0.90, unanswered, [], storage_grew=False) == []  # rose


def test_conversion_prefills_evicted_entries_when_storage_grows():
    s = CacheScheduler()
    evicted = [QAEntry(4, 10, hits=1, answered=True), QAEntry(5, 10, hits=7, answered=True), QAEntry(6, 10)]
    assert s.convert(0.9, 0.9, [], evicted, storage_grew=False) == []
    assert s.convert(0.9, 0.9, [], evicted, storage_grew=True) == [
        Conversion("prefill", 5), Conversion("prefill", 4), Conversion("prefill", 6)]
    # entry 6 is also unanswered: it is decoded (which prefills it), listed once
    both = s.convert(0.9, 0.8, [evicted[2]], evicted, storage_grew=True)
    assert both == [Conversion("prefill", 5), Conversion("prefill", 4), Conversion("decode", 6)]


def test_observe_compares_with_what_it_saw_last_and_survives_a_restart():
    s = CacheScheduler()
    e = [QAEntry(1, 10)]
    assert s.observe(0.9, 1000, e, e) == []  # first sight: nothing changed
    assert s.observe(0.9, 2000, e, e) == [Conversion("prefill", 1)]
    s = CacheScheduler.from_dict(json.loads(json.dumps(s.to_dict())))
    assert (s.tau_query, s.cap_bytes) == (0.9, 2000)
    assert s.observe(0.8, 2000, e, []) == [Conversion("decode", 1)]
    assert s.observe(0.8, 1000, e, e) == []
    with pytest.raises(ValueError, match="version"):
        CacheScheduler.from_dict({**s.to_dict(), "version": 99})


# -- idle detection ---------------------------------------------------------------------------------


def test_a_real_call_resets_idleness():
    st = IdleState(IdlePolicy(idle_after_s=100.0))
    assert st.may_work("mail", 0.0).ok  # no call yet: idle
    st.call_started(10.0)
    assert st.may_work("mail", 500.0).reason == "busy"
    st.call_ended(20.0)
    assert st.may_work("mail", 119.0).reason == "not_idle"
    assert st.may_work("mail", 120.0).ok
    with pytest.raises(ValueError):
        st.call_ended(130.0)
    assert {"ok", "busy", "not_idle", "on_battery", "budget_spent"} == set(REASONS)


def test_the_budget_is_per_app_and_per_day():
    st = IdleState(IdlePolicy(budget_model_s_per_day=60.0))
    st.spend("mail", 40.0, now=DAY + 10)
    assert st.may_work("mail", DAY + 11).ok
    st.spend("mail", 20.0, now=DAY + 12)
    assert st.may_work("mail", DAY + 13).reason == "budget_spent"
    assert st.may_work("notes", DAY + 13).ok
    assert st.may_work("mail", 2 * DAY).ok and st.spent_today("mail", 2 * DAY) == 0.0
    days = IdleState(IdlePolicy(budget_model_s_per_day=60.0), day_of=lambda t: int(t // 3600))  # hourly "days"
    days.spend("mail", 60.0, now=0.0)
    assert days.may_work("mail", 3599.0).reason == "budget_spent" and days.may_work("mail", 3600.0).ok


def test_power():
    required = IdleState(IdlePolicy(require_mains_power=True))
    assert required.may_work("mail", 0.0).ok  # unknown counts as mains by default
    required.set_power(False)
    assert required.may_work("mail", 0.0).reason == "on_battery"
    required.set_power(True)
    assert required.may_work("mail", 0.0).ok
    strict = IdleState(IdlePolicy(require_mains_power=True, unknown_power_is_mains=False))
    assert strict.may_work("mail", 0.0).reason == "on_battery"
    relaxed = IdleState()
    relaxed.set_power(False)
    assert relaxed.may_work("mail", 0.0).ok  # not required


# -- prediction triggers ----------------------------------------------------------------------------


def test_history_rounds_follow_a_burst_and_a_quiet_period():
    st = IdleState(IdlePolicy(idle_after_s=0.0, history_quiet_s=30.0, burst_queries=3, stride=2))
    for t in (0.0, 5.0):
        st.query_seen("mail", t)
    assert not st.due_history("mail", 100.0)  # two queries are no burst
    st.query_seen("mail", 10.0)
    assert not st.due_history("mail", 39.0) and st.next_work("mail", 39.0) is None
    r = st.next_work("mail", 40.0)
    assert r == PredictRound("mail", "history", 2, 3)
    st.query_seen("mail", 41.0)  # arrives during the round
    st.round_done(r)
    assert not st.due_history("mail", 200.0)  # one left over, not a burst yet
    assert st.next_work("notes", 200.0) is None


def test_knowledge_rounds_follow_documents_and_a_quiet_period_and_go_first():
    st = IdleState(IdlePolicy(idle_after_s=0.0, abstract_quiet_s=60.0, history_quiet_s=0.0, burst_queries=1))
    st.documents_added("mail", 0.0, n=2)
    st.documents_added("mail", 30.0)
    st.query_seen("mail", 30.0)
    assert not st.due_abstract("mail", 89.0)
    assert st.next_work("mail", 89.0) == PredictRound("mail", "history", 5, 1)
    r = st.next_work("mail", 90.0)
    assert r == PredictRound("mail", "knowledge", 5, 3)  # the default stride is carried
    st.documents_added("mail", 95.0)  # after the round began: still due afterwards
    st.round_done(r)
    assert st.due_abstract("mail", 155.0) and st.next_work("mail", 155.0).covered == 1
    st.call_started(156.0)
    assert st.next_work("mail", 157.0) is None  # busy: no round even though one is due


# -- slices -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefill, decode", [(0, 0), (1, 0), (64, 2), (65, 1), (200, 3), (0, 4)])
def test_slices_cover_exactly_the_work(prefill, decode):
    out = slices(prefill, decode)
    pre = [s for s in out if s.kind == "prefill"]
    assert all(0 < s.size <= 64 for s in pre)
    assert [i for s in pre for i in range(s.start, s.start + s.size)] == list(range(prefill))
    assert out[len(pre):] == [Slice("decode", i, 1) for i in range(decode)]
    assert slices(10, 0, max_prefill=4) == [Slice("prefill", 0, 4), Slice("prefill", 4, 4), Slice("prefill", 8, 2)]


# -- state across a restart -------------------------------------------------------------------------


def test_idle_state_round_trip():
    policy = IdlePolicy(idle_after_s=10.0, abstract_quiet_s=5.0, burst_queries=2, history_quiet_s=5.0)
    st = IdleState(policy)
    st.call_started(0.0)
    st.call_ended(1.0)
    st.documents_added("mail", 2.0, n=4)
    st.query_seen("notes", 3.0)
    st.query_seen("notes", 4.0)
    st.spend("notes", 12.5, now=4.0)
    st.set_power(False)
    back = IdleState.from_dict(json.loads(json.dumps(st.to_dict())), policy)
    assert back.to_dict() == st.to_dict()
    assert back.on_mains is None  # read again after a restart, not persisted
    assert back.may_work("mail", 10.5).reason == "not_idle"
    assert back.next_work("mail", 11.0) == PredictRound("mail", "knowledge", 5, 4)
    assert back.next_work("notes", 11.0) == PredictRound("notes", "history", 5, 2)
    assert back.spent_today("notes", 11.0) == 12.5
    with pytest.raises(ValueError, match="version"):
        IdleState.from_dict({**st.to_dict(), "version": 0})


def test_calls_seen_by_another_counter_decide_idleness():
    s = IdleState(IdlePolicy(idle_after_s=10))
    s.documents_added("a", 0.0)
    s.calls_seen(100.0, 1)
    assert s.may_work("a", 200.0).reason == "busy"
    s.calls_seen(150.0, 0)
    assert s.may_work("a", 155.0).reason == "not_idle" and s.may_work("a", 161.0).ok
    s.calls_seen(0.0, 0)  # "none yet" from a restarted counter keeps what was seen
    assert s.may_work("a", 155.0).reason == "not_idle"
