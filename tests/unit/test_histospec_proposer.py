import dataclasses

import numpy as np
import pytest

from rhymerl.config import HistoSpecConfig
from rhymerl.histospec import Draft, DraftProposer, HistoryStore
from rhymerl.histospec.proposer import Drafting
from rhymerl.histospec.step_costs import StepCosts

pytestmark = pytest.mark.cpu

# Drafts priced at almost nothing, so every chain is drafted whole: these tests read chains.
FREE = StepCosts(fixed_ms=1e3, per_request_ms=0.0, per_token_ms=1e-6)


def drafting(**kw):
    # Chains uncapped and sources compared unscaled: match_length_factor and
    # match_confidence_tokens have tests of their own.
    base = dict(sources=("history", "group"), match_length_factor=0.0, match_confidence_tokens=0.0)
    base.update(kw)
    return Drafting(**base)


def proposer(responses, **kw):
    c = HistoSpecConfig()
    s = HistoryStore(c)
    s.add_group(1, 0, responses)
    return DraftProposer(s, c, FREE, drafting(**kw))


def test_chain_copies_history_continuation():
    r = list(range(10, 40))
    p = proposer([r])
    p.begin("a", 1)
    d = p.propose("a", r[:5], 8)
    assert d.tokens == r[5:13] and d.probs == [1.0] * 8
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
    c = HistoSpecConfig()
    store = HistoryStore(c)
    store.add_group(1, 0, [[1, 2, 3, 4, 5, 6, 7, 8]])  # the prompt's own history
    store.add_group(2, 0, [[20, 21, 22, 3, 40, 41, 42]])  # another prompt's, in the shared index
    gen = [20, 21, 22, 3]  # matches 1 token of the history ("3") and 4 of the shared index
    got = {}
    for k in (0.0, 4.0):
        p = DraftProposer(store, c, FREE, drafting(sources=("history", "group", "global"), match_confidence_tokens=k))
        p.begin("a", 1)
        got[k] = p.propose("a", gen, 8).tokens
    # Unscaled, the history's longer chain (5 certain tokens against 3) wins; at K = 4 the
    # 1-token match counts 1/5 of that and the 4-token one 4/8.
    assert got == {0.0: [4, 5, 6, 7, 8], 4.0: [40, 41, 42]}


def test_no_match_and_unknown_prompt_give_empty_drafts():
    p = proposer([[1, 2, 3, 4, 5, 6]])
    p.begin("a", 1)
    assert p.propose("a", [1, 2, 3], 4).tokens == [4, 5, 6]
    assert p.propose("a", [9, 9, 9, 8], 4).tokens == []  # nothing matches
    p.begin("b", 12345)  # no history for this prompt
    assert p.propose("b", [1, 2, 3], 4) == Draft()
    assert p.propose("a", [1, 2, 3], 0).tokens == []


def test_window_and_back_off_to_a_shorter_match():
    p = proposer([[7, 1, 2, 3, 4, 5, 6]], match_window=4)
    p.begin("b", 1)
    assert p.propose("b", [9, 1, 2, 3], 3).tokens == [4, 5, 6]
    assert p.propose("b", [9, 1, 2, 3, 4, 5], 3).tokens == [6]  # window 4: "2 3 4 5"
    # The longest match ("1 2 3" of the first response) ends its response: no continuation;
    # the shorter "3" continues in the second one.
    q = proposer([[1, 2, 3], [9, 3, 4]])
    q.begin("a", 1)
    d = q.propose("a", [1, 2, 3], 4)
    assert d.tokens == [4] and d.probs == [0.5]


def test_frequency_branch_and_min_prob_pruning():
    hist = [[1, 2, 3, 4, 5]] * 3 + [[1, 2, 8, 9, 9]]
    p = proposer(hist)
    p.begin("a", 1)
    d = p.propose("a", [1, 2], 8)
    assert d.tokens == [3, 4, 5] and d.probs == [0.75, 1.0, 1.0]
    p2 = proposer(hist, min_prob=0.8)
    p2.begin("a", 1)
    assert p2.propose("a", [1, 2], 8).tokens == []  # 0.75 < min_prob
    tie = proposer([[1, 2, 3, 4], [1, 2, 8, 9]])
    tie.begin("a", 1)
    assert tie.propose("a", [1, 2], 4).tokens == [3, 4]  # tie on counts: smaller token id


def test_siblings_join_the_group_index_when_they_finish():
    c = HistoSpecConfig()
    s = HistoryStore(c)
    p = DraftProposer(s, c, FREE, drafting())
    sib = [5, 6, 7, 8, 9, 10]
    for rid in ("a", "b"):
        p.begin(rid, 42, group="g")
    assert p.propose("b", [5, 6], 4).tokens == []
    p.end("a", sib)
    assert p.propose("b", [5, 6], 4).tokens == [7, 8, 9, 10]
    p.end("b", [1])
    assert p.stats()["active_groups"] == 0
    off = DraftProposer(s, c, FREE, drafting(sources=("history",)))
    off.begin("a", 42, group="g")
    off.begin("b", 42, group="g")
    off.end("a", sib)
    assert off.propose("b", [5, 6], 4).tokens == []


def test_unknown_sources_are_refused():
    with pytest.raises(ValueError, match="unknown draft sources"):
        DraftProposer(HistoryStore(HistoSpecConfig()), HistoSpecConfig(), FREE, Drafting(sources=("history", "tree")))


def test_incremental_matching_equals_fresh_matching():
    rng = np.random.default_rng(0)
    hist = [rng.integers(0, 6, size=80).tolist() for _ in range(4)]
    target = rng.integers(0, 6, size=120).tolist()
    c = HistoSpecConfig()
    d_cfg = drafting(sources=("history",), match_window=5)
    s = HistoryStore(c)
    s.add_group(1, 0, hist)
    inc = DraftProposer(s, c, FREE, d_cfg)
    inc.begin("a", 1)
    pos = 0
    while pos < len(target):
        d = inc.propose("a", target[:pos], 8)
        fresh = DraftProposer(s, c, FREE, d_cfg)
        fresh.begin("a", 1)
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


def test_drafting_is_not_a_setting():
    """How chains are found is the product's choice, not a config key: the schema holds only
    what a user sizes (history kept, memory) or chooses (how drafts are priced)."""
    keys = {f.name for f in dataclasses.fields(HistoSpecConfig)}
    assert keys == {"epochs_kept", "token_budget", "memory_fraction", "global_token_budget", "step_cost",
                    "min_goodput_gain"}


def test_drafts_are_as_long_as_the_match_allows_past_the_old_window():
    r = list(range(100, 160))
    p = proposer([r], match_length_factor=1.0)
    p.begin("a", 1)
    # A 31-token match (the START marker and 30 tokens): a 24-token draft, whole.
    assert p.propose("a", r[:30], 24).tokens == r[30:54]
    # The window grows with what the engine allows: no ceiling below num_speculative_tokens.
    q = proposer([r], match_length_factor=1.0, match_window=8)
    q.begin("a", 1)
    assert q.propose("a", r[:30], 24).tokens == r[30:54]


def test_every_response_of_the_rollout_drafts_for_other_prompts_in_the_first_epoch():
    c = HistoSpecConfig()
    store = HistoryStore(c)  # the first epoch: nothing stored
    p = DraftProposer(store, c, FREE, drafting(sources=("global",)))
    p.begin("x", 1, group="g1")
    p.begin("y", 2, group="g2")
    # x is in flight: its tokens are indexed as they arrive, for every prompt (y's first step
    # already drafts x's start).
    assert p.propose_step([("x", [7, 8, 9, 10, 11, 12], 4), ("y", [], 4)])[1].tokens == [7, 8, 9, 10]
    assert p.propose("y", [8, 9], 4).tokens == [10, 11, 12]
    assert p.stats()["source/global/drafts"] == 2
    p.end("x", [7, 8, 9, 10, 11, 12, 13, 14])  # its last tokens arrive with its end
    assert p.propose("y", [8, 9, 10, 11, 12], 4).tokens == [13, 14]
    # The store's shared index, once rebuilt, holds what finished before: the rollout's index
    # starts afresh for the requests that begin after it.
    store.add_group(1, 0, [[7, 8, 9, 10, 11, 12, 13, 14]])
    p.begin("z", 3)
    assert p._rollout.num_tokens == 0
    assert p.propose("z", [8, 9], 4).tokens == [10, 11, 12, 13]  # from the shared index now
    off = DraftProposer(HistoryStore(c), dataclasses.replace(c, global_token_budget=0), FREE, drafting())
    off.begin("x", 1, group="g1")
    off.begin("y", 2, group="g2")
    off.propose_step([("x", [7, 8, 9, 10, 11, 12], 4), ("y", [], 4)])
    assert off.propose("y", [8, 9], 4).tokens == []  # no cross-prompt drafts at all


def test_the_rollout_index_stops_growing_at_the_shared_index_budget():
    c = dataclasses.replace(HistoSpecConfig(), global_token_budget=10)
    p = DraftProposer(HistoryStore(c), c, FREE, drafting(sources=("global",)))
    p.begin("x", 1)
    p.propose("x", list(range(20, 40)), 4)
    p.begin("y", 2)
    p.propose("y", list(range(50, 70)), 4)
    assert 10 <= p._rollout.num_tokens <= 22  # x's 20 tokens and its marker went in; y's did not


def test_verified_drafts_are_counted_by_predicted_acceptance():
    r = list(range(50))
    p = proposer([r])
    p.begin("a", 1)
    d = p.propose("a", r[:3], 4)
    p.feedback("a", len(d), 2)
    st = p.stats()
    assert sum(st[f"calibration/{b / 10:.1f}/tokens"] for b in range(10)) == 3  # 2 accepted, 1 rejected
    assert sum(st[f"calibration/{b / 10:.1f}/accepted"] for b in range(10)) == 2
    p.reset_stats()
    assert sum(p.stats()[f"calibration/{b / 10:.1f}/tokens"] for b in range(10)) == 0
