import dataclasses
from pathlib import Path

import numpy as np
import pytest

from rhymerl.config import HistoSpecConfig, load_config
from rhymerl.histospec import HistoryStore
from rhymerl.histospec.budget import VisitBudget, plan_token_budget

pytestmark = pytest.mark.cpu

REPO = Path(__file__).resolve().parents[2]
DAPO_MATH_17K_PROMPTS = 17_917
GiB = 1 << 30


def _replay_epochs(budget: VisitBudget, num_prompts: int, n: int, max_tokens: int, epochs: int, epochs_kept: int,
                   seed: int = 0) -> int:
    """Replay visits through the store's eviction policy (token counts only); returns how
    many prompts came back to find their previous visit gone."""
    rng = np.random.default_rng(seed)
    last_seen: dict[int, int] = {}
    lost = 0
    for ep in range(epochs):
        for key in rng.permutation(num_prompts).tolist():
            if key in last_seen and (key, last_seen[key]) not in budget:
                lost += 1
            old = ep - epochs_kept
            if old >= 0:
                budget.remove(key, old)  # the store keeps only the last epochs_kept visits of a prompt
            # Reasoning lengths: long-tailed (log-normal around 2.5K tokens), clipped at max_tokens.
            lens = np.minimum(max_tokens, rng.lognormal(np.log(2500), 0.6, size=n).astype(np.int64) + 1)
            budget.add(key, ep, int(lens.sum()))
            last_seen[key] = ep
    return lost


def test_dapo_sized_epoch_keeps_every_prompts_previous_visit():
    cfg = load_config(REPO / "configs/qwen2.5-7b-dapo-math-8xh100.yaml")
    h, r = cfg.histospec, cfg.rollout
    assert h.token_budget == 0  # sized automatically
    # One 8x H100 node: 8 ranks sharing ~1.5 TiB of available host memory.
    plan = plan_token_budget(DAPO_MATH_17K_PROMPTS, r.n, r.max_tokens, h.epochs_kept, available_bytes=1536 * GiB,
                             ranks_per_node=cfg.slurm.tasks_per_node, memory_fraction=h.memory_fraction)
    assert plan.covers_dataset and plan.token_budget == plan.needed_tokens
    assert plan.token_budget > 10 * 50_000_000  # the old fixed default fell an order of magnitude short
    lost = _replay_epochs(VisitBudget(plan.token_budget), DAPO_MATH_17K_PROMPTS, r.n, r.max_tokens, epochs=3,
                          epochs_kept=h.epochs_kept)
    assert lost == 0
    # The old fixed budget loses most prompts' history before they come back.
    assert _replay_epochs(VisitBudget(50_000_000), DAPO_MATH_17K_PROMPTS, r.n, r.max_tokens, epochs=2,
                          epochs_kept=h.epochs_kept) > DAPO_MATH_17K_PROMPTS // 2


def test_memory_bound_budget_says_so():
    plan = plan_token_budget(1000, 16, 8192, 1, available_bytes=8 * GiB, ranks_per_node=8, memory_fraction=0.25)
    assert not plan.covers_dataset and plan.token_budget == plan.memory_tokens == GiB // 4 // 4
    assert "memory-bound" in plan.describe()
    with pytest.raises(ValueError):
        plan_token_budget(10, 4, 32, 1, GiB, memory_fraction=0.0)


def test_visit_budget_evicts_oldest_first_and_keeps_the_newest():
    b = VisitBudget(10)
    assert b.add(1, 0, 4) == [] and b.add(2, 0, 4) == []
    assert b.add(3, 0, 4) == [(1, 0)]
    assert b.add(4, 1, 30) == [(2, 0), (3, 0)]  # larger than the budget alone: kept, everything older goes
    assert list(b) == [(4, 1)] and b.num_tokens == 30


def test_store_builds_indexes_lazily_or_in_the_background_and_reports_cost():
    cfg = dataclasses.replace(HistoSpecConfig(), token_budget=1000)
    s = HistoryStore(cfg)
    s.add_group(1, 0, [[1, 2, 3, 4, 5] * 10, [1, 2, 9, 9] * 5])
    s.add_group(2, 0, [[7, 8] * 20])
    assert all(e.index is None for e in s._entries.values())  # nothing built on the critical path
    s.prebuild([1, 99]).join()  # unknown prompts are skipped
    assert s._entries[1].index is not None and s._entries[2].index is None
    cost = s.build_cost()
    assert cost["index_build_us_per_token"] > 0 and cost["index_bytes_per_token"] > 0 and cost["stored_bytes_per_token"] == 4
    assert s.index(2).num_tokens == 41  # 40 tokens and the START marker
    s.add_group(1, 1, [[1, 2, 3]])
    assert s._entries[1].index is None  # a new visit drops the stale index
