import dataclasses

import numpy as np
import pytest

from rhymerl.config import HistoSpecConfig
from rhymerl.histospec import Draft, DraftProposer, HistoryStore

pytestmark = pytest.mark.cpu


def cfg(**kw):
    # Chains uncapped and sources compared unscaled: these tests read whole continuations;
    # match_length_factor and match_confidence_tokens have tests of their own.
    base = dict(start_after=0, min_match=1, draft_rule="fixed", fixed_len=8, max_draft=16, include_global=False,
                match_length_factor=0.0, match_confidence_tokens=0.0)
    base.update(kw)
    return dataclasses.replace(HistoSpecConfig(), **base)


def proposer(responses, rewards=None, **kw):
    c = cfg(**kw)
    s = HistoryStore(c)
    s.add_group(1, 0, responses, rewards)
    return DraftProposer(s, c)


def test_chain_copies_history_continuation():
    r = list(range(10, 40))
    p = proposer([r])
    p.begin("a", 1)
    d = p.propose("a", r[:5], 8)
    assert d.tokens == r[5:13] and d.parents == list(range(-1, 7)) and d.is_chain
    assert d.probs == [1.0] * 8
    # Drafting starts at the first token thanks to the response-start marker.
    assert p.propose("a", [], 4).tokens == r[:4]
    assert p.propose("a", r[:28], 8).tokens == r[28:]  # stops at the end of the response


def test_match_length_factor_caps_a_chain_at_that_multiple_of_its_match():
    r = list(range(10, 40))
    for factor, want in ((0.0, 8), (1.0, 2), (1.5, 3), (0.2, 1)):
        p = proposer([r], match_length_factor=factor)
        p.begin("a", 1)
        # Only "15 16" matches: a match of 2 tokens.
        assert p.propose("a", [99, 98, 15, 16], 8).tokens == r[7:7 + want], factor
    p = proposer([r], match_length_factor=1.0)
    p.begin("a", 1)
    # Behind the response-start marker the whole prefix matches: 6 tokens, so 6 drafted.
    assert p.propose("a", r[:5], 8).tokens == r[5:11]


def test_match_confidence_tokens_lets_a_longer_match_in_another_source_win():
    c0 = cfg(include_global=True)
    store = HistoryStore(c0)
    store.add_group(1, 0, [[1, 2, 3, 4, 5, 6, 7, 8]])  # the prompt's own history
    store.add_group(2, 0, [[20, 21, 22, 3, 40, 41, 42]])  # another prompt's, in the shared index
    gen = [20, 21, 22, 3]  # matches 1 token of the history ("3") and 4 of the shared index
    got = {}
    for k in (0.0, 4.0):
        p = DraftProposer(store, dataclasses.replace(c0, match_confidence_tokens=k))
        p.begin("a", 1)
        got[k] = p.propose("a", gen, 8).tokens
    # Unscaled, the history's longer chain (5 certain tokens against 3) wins; at K = 4 the
    # 1-token match counts 1/5 of that and the 4-token one 4/8.
    assert got == {0.0: [4, 5, 6, 7, 8], 4.0: [40, 41, 42]}


def test_no_match_unknown_prompt_and_start_after_give_empty_drafts():
    p = proposer([[1, 2, 3, 4, 5, 6]], min_match=2, start_after=3)
    p.begin("a", 1)
    assert p.propose("a", [1, 2], 4).tokens == []  # before start_after
    assert p.propose("a", [1, 2, 3], 4).tokens == [4, 5, 6]
    assert p.propose("a", [9, 9, 9, 8], 4).tokens == []  # nothing matches
    p.begin("b", 12345)  # no history for this prompt
    assert p.propose("b", [1, 2, 3], 4) == Draft()
    assert p.propose("a", [1, 2, 3], 0).tokens == []


def test_min_match_and_window_back_off():
    hist = [[7, 1, 2, 3, 4, 5, 6]]
    p = proposer(hist, min_match=3, match_window=4)
    p.begin("a", 1)
    p.begin("b", 1)
    assert p.propose("a", [9, 9, 2, 3], 3).tokens == []  # match "2 3" is shorter than 3
    assert p.propose("b", [9, 1, 2, 3], 3).tokens == [4, 5, 6]
    assert p.propose("b", [9, 1, 2, 3, 4, 5], 3).tokens == [6]  # window 4: "2 3 4 5"


def test_frequency_branch_and_min_prob_pruning():
    hist = [[1, 2, 3, 4, 5]] * 3 + [[1, 2, 8, 9, 9]]
    p = proposer(hist)
    p.begin("a", 1)
    d = p.propose("a", [1, 2], 8)
    assert d.tokens == [3, 4, 5] and d.probs == [0.75, 1.0, 1.0]
    p2 = proposer(hist, min_prob=0.8)
    p2.begin("a", 1)
    assert p2.propose("a", [1, 2], 8).tokens == []  # 0.75 < min_prob


def test_reward_branch_prefers_rewarded_continuation():
    hist = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 8, 9], [1, 2, 8, 9]]
    rewards = [0.0, 0.0, 1.0, 1.0]
    f = proposer(hist, rewards)
    f.begin("a", 1)
    assert f.propose("a", [1, 2], 4).tokens == [3, 4]  # tie on counts: smaller token id
    r = proposer(hist, rewards, branch="reward")
    r.begin("a", 1)
    d = r.propose("a", [1, 2], 4)
    assert d.tokens == [8, 9] and d.probs[0] == 0.5  # probs stay frequency estimates


def test_tree_keeps_chain_as_spine_and_respects_budget():
    hist = [[1, 2, 3, 4, 5, 6]] * 3 + [[1, 2, 7, 8, 9]] * 2 + [[1, 2, 3, 4, 0, 0]]
    p = proposer(hist, tree=True, tree_nodes=7, tree_topk=2, fixed_len=4)
    p.begin("a", 1)
    d = p.propose("a", [1, 2], 16)
    assert d.tokens[:4] == [3, 4, 5, 6] and d.parents[:4] == [-1, 0, 1, 2]
    assert len(d) == 7 and not d.is_chain
    # The most probable side branch (7 8 ... from the root) comes next.
    assert d.tokens[4:6] == [7, 8] and d.parents[4:6] == [-1, 4]
    assert all(-1 <= par < i for i, par in enumerate(d.parents))
    kids = {}
    for i, par in enumerate(d.parents):
        assert d.tokens[i] not in kids.setdefault(par, set())  # siblings are distinct tokens
        kids[par].add(d.tokens[i])
    assert len(p.propose("a", [1, 2], 3)) == 3  # engine limit caps the node budget


def test_length_rules():
    r = list(range(100, 200))

    def windows(rule, outcomes, **kw):
        p = proposer([r], draft_rule=rule, **kw)
        p.begin("a", 1)
        out = []
        for full in outcomes:
            d = p.propose("a", r[:10], 64)
            p.feedback("a", len(d), len(d) if full else 0)
            out.append(len(d))
        return out

    seq = [True, True, True, True, False, True, False]
    assert windows("aimd", seq, max_draft=32) == [2, 4, 6, 8, 10, 2, 4]
    assert windows("mimd", seq, max_draft=16) == [2, 4, 8, 16, 16, 8, 16]
    assert windows("fixed", seq, fixed_len=5) == [5] * 7
    # adaptive: the mimd window, but a unanimous history may run past it.
    assert windows("adaptive", [False, False], max_draft=16) == [16, 16]


def test_adaptive_stops_at_window_when_history_disagrees():
    hist = [[1, 2, 3, 4, 5, 6, 7, 8, 9]] + [[1, 2, 3, 4, 5, 6, 7, 8, 9]] + [[1, 2, 0, 0, 0, 0, 0]]
    p = proposer(hist, draft_rule="adaptive")
    p.begin("a", 1)
    d = p.propose("a", [1, 2], 16)  # path prob 2/3 >= 0.6: keeps going
    assert d.tokens == [3, 4, 5, 6, 7, 8, 9]
    p2 = proposer(hist * 2 + [[1, 2, 0, 0, 0]], draft_rule="adaptive")
    p2.begin("a", 1)
    assert p2.propose("a", [1, 2], 16).tokens == [3, 4]  # 4/7 < 0.6: stops at the window (2)


def test_siblings_join_the_group_index_when_they_finish():
    c = cfg(include_siblings=True)
    s = HistoryStore(c)
    p = DraftProposer(s, c)
    sib = [5, 6, 7, 8, 9, 10]
    for rid in ("a", "b"):
        p.begin(rid, 42, group="g")
    assert p.propose("b", [5, 6], 4).tokens == []
    p.end("a", sib)
    assert p.propose("b", [5, 6], 4).tokens == [7, 8, 9, 10]
    p.end("b", [1])
    assert p.stats()["active_groups"] == 0
    off = DraftProposer(s, cfg(include_siblings=False))
    off.begin("a", 42, group="g")
    off.begin("b", 42, group="g")
    off.end("a", sib)
    assert off.propose("b", [5, 6], 4).tokens == []


def test_incremental_matching_equals_fresh_matching():
    rng = np.random.default_rng(0)
    hist = [rng.integers(0, 6, size=80).tolist() for _ in range(4)]
    target = rng.integers(0, 6, size=120).tolist()
    c = cfg(min_match=2, match_window=5, draft_rule="mimd")
    s = HistoryStore(c)
    s.add_group(1, 0, hist)
    inc = DraftProposer(s, c)
    inc.begin("a", 1)
    pos = 0
    while pos < len(target):
        d = inc.propose("a", target[:pos], 8)
        fresh = DraftProposer(s, c)
        fresh.begin("a", 1)
        fresh._reqs["a"].window = inc._reqs["a"].window
        assert fresh.propose("a", target[:pos], 8) == d
        acc = 0
        while acc < len(d) and pos + acc < len(target) and d.tokens[acc] == target[pos + acc]:
            acc += 1
        inc.feedback("a", len(d), acc)
        pos += acc + 1


def test_stats_count_calls_and_acceptance():
    r = list(range(50))
    p = proposer([r])
    p.begin("a", 1)
    d = p.propose("a", r[:3], 4)
    p.feedback("a", len(d), 3)
    st = p.stats()
    assert st["calls"] == 1 and st["proposed"] == 4 and st["accepted"] == 3 and st["draft_time_s"] > 0
    p.end("a")
    assert not p.has_request("a")
