"""The trainer's step logic (rollout bookkeeping, rewards, DAPO dynamic sampling) driven by
scripted engine outputs, in milliseconds: no vLLM, no training backend.

The scripted engine behaves like vLLM's seeded sampling where the step logic depends on it:
a request's tokens are a function of its seed (same seed, same response), and ``metrics()``
returns the figures of the engine's last ``generate()`` call.
"""

from __future__ import annotations

import pytest

from rhymerl.distributed.collectives import WorldComm
from rhymerl.distributed.colocation import Colocation
from rhymerl.config import load_config
from rhymerl.data import EpochSampler, PromptRecord
from rhymerl.histopipe import LengthPredictor, NoopPlanner
from rhymerl.histospec import HistoryStore, prompt_key
from rhymerl.rewards import RewardPool, RewardResult
from rhymerl.rollout.engine import Response, RolloutResult
from rhymerl.outputs.progress import PhaseProgress
from rhymerl.rollout.placement import engine_placement
from rhymerl.rollout.planned import PlannedRollout
from rhymerl.trainer import Trainer

pytestmark = pytest.mark.cpu


class ScriptedEngine:
    """Responses derived from the request seed; lengths alternate within a call (1, 2, 1, ...)."""

    cpu_threads = None  # not a CPU vLLM engine: no threads to report

    def __init__(self):
        self.calls: list[dict] = []
        self._metrics: dict = {}

    def generate(self, prompts, n, spec, group_ids=None, epoch=0, record_history=True, predicted_lengths=None):
        out = []
        for j, p in enumerate(prompts):
            seed = spec.seed + j
            toks = [10 + seed % 89] * (1 + j % 2)
            out.append(RolloutResult(p, prompt_key(p), group_ids[j],
                                     [Response(toks, [-0.5] * len(toks), "stop", forwards=len(toks))]))
        gen = sum(len(r.responses[0].token_ids) for r in out)
        self.calls.append({"seed": spec.seed, "group_ids": list(group_ids), "tokens": gen})
        self._metrics = {"generated_tokens": gen, "target_forwards": gen, "draft_proposed": 0, "draft_accepted": 0}
        return out

    def metrics(self) -> dict:
        return dict(self._metrics)


class TextTokenizer:
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def parity_reward(item):
    """Constant for answer "same" (a group DAPO drops), the response length's parity otherwise."""
    if item.answer == "same":
        return RewardResult(score=1.0, correct=True)
    return float(len(item.response_text.split()) % 2)


def make_trainer(answers: list[str], *overrides: str, rank: int = 0, instances: int = 1) -> Trainer:
    cfg = load_config(None, ["rollout.n=4", f"data.prompts_per_step={len(answers)}", "data.shuffle=false",
                             "reward.workers=0", f"reward.function={__name__}:parity_reward",
                             *overrides])
    t = Trainer.__new__(Trainer)
    t.cfg, t.comm, t.step, t.last_batch_records = cfg, WorldComm(rank=rank, world_size=1), 0, []
    t.records = [PromptRecord(id=f"p{i}", prompt=f"q{i}", answer=a) for i, a in enumerate(answers)]
    t.prompt_ids = [[1, 2, 100 + i] for i in range(len(answers))]
    t.prompt_keys = [prompt_key(p) for p in t.prompt_ids]
    t.sampler = EpochSampler(len(answers), cfg.data.prompts_per_step, cfg.run.seed, cfg.data.shuffle)
    t.history = HistoryStore(cfg.histospec, vocab_size=128)
    t.predictor = LengthPredictor(cfg.histopipe, cfg.rollout.max_tokens)
    t.engine, t.tokenizer = ScriptedEngine(), TextTokenizer()
    # Dispatch by plan: the scripted engine answers whole calls (the live scheduler's dispatch
    # runs real engines in test_histopipe_live). One engine per rank (rollout TP 1).
    t.placement = engine_placement(instances, rank, rank, 1)
    t.rollout = PlannedRollout(cfg.rollout, cfg.run.seed, t.comm, t.engine, t.placement, NoopPlanner(instances),
                               t.predictor, t.history)
    t.rewards = RewardPool(cfg.reward, preload=())
    t.ds_buffer = None
    if cfg.algo.dynamic_sampling:
        from rhymerl.algorithms import DynamicSamplingBuffer

        t.ds_buffer = DynamicSamplingBuffer.from_config(cfg.algo, cfg.data.prompts_per_step)
    t.trained = []
    t._train = lambda samples, adv: t.trained.append((samples, adv)) or {"time/train_s": 0.0}
    t._reshard = lambda: {}
    t.colocation = Colocation(None, sleep_level=0)  # no sleep/wake, no offload: nothing to release
    t.colocation.attach_engine(t.engine)
    t.progress = PhaseProgress(enabled=False)
    return t


DAPO = ("algo.name=dapo", "algo.dynamic_sampling=true", "algo.max_refill_rounds=2")


def test_dapo_refill_rounds_sample_with_their_own_seeds_and_groups():
    t = make_trainer(["same", "same"], *DAPO)  # nothing is ever informative: every round runs
    out = t.train_step()
    calls = t.engine.calls
    assert len(calls) == 3 and out.metrics["dapo/rounds"] == 3
    # The refills draw the same two prompts again: with round 0's seeds they replayed its responses.
    assert len({c["seed"] for c in calls}) == 3, calls
    assert len({g for c in calls for g in c["group_ids"]}) == 3 * 2, calls
    assert out.samples == [] and t.trained == []


def test_dapo_step_metrics_count_every_round():
    t = make_trainer(["same", "same"], *DAPO)
    m = t.train_step().metrics
    generated = sum(c["tokens"] for c in t.engine.calls)
    assert m["histospec/generated_tokens"] == generated
    assert m["rollout/generated_tokens"] == generated and m["rollout/responses"] == 3 * 2 * 4
    assert m["histospec/tokens_per_forward"] == 1.0


def test_dapo_keeps_the_callers_samples_and_renumbers_copies():
    t = make_trainer(["same", "odd"], *DAPO)
    rollouts = []
    rollout = t._rollout
    t._rollout = lambda *a: rollouts.append(rollout(*a)) or rollouts[-1]
    out = t.train_step()
    # Round 0 keeps group 1 ("odd"), one refill keeps it again: two kept groups, both prompt 1.
    assert out.metrics["dapo/rounds"] == 2 and [r.answer for r in t.last_batch_records] == ["odd", "odd"]
    assert [s.group for s in out.samples] == [0] * 4 + [1] * 4
    # The rollouts' own samples keep their batch's group numbers (prompt 1 is group 1 in both).
    assert [[s.group for s in ss] for ss, _ in rollouts] == [[0] * 4 + [1] * 4] * 2
    assert not {id(s) for s in out.samples} & {id(s) for ss, _ in rollouts for s in ss}


# Alone, this process gathers only its own (empty) share of the step: the length means are empty.
@pytest.mark.filterwarnings("ignore:Mean of empty slice", "ignore:invalid value encountered")
def test_idle_instance_reports_no_engine_figures():
    t = make_trainer(["odd", "odd"], rank=1, instances=2)
    _, busy = t._rollout([0, 1], 0)
    assert busy["histospec/generated_tokens"] == 6
    # One group for two instances: this rank generates nothing and must not repeat its last call's figures.
    _, idle = t._rollout([0], 0)
    assert len(t.engine.calls) == 1
    assert idle["histospec/generated_tokens"] == 0 and idle["histospec/target_forwards"] == 0


def test_reward_error_rate_above_threshold_stops_the_step():
    from rhymerl.rewards.pool import RewardErrorRate

    t = make_trainer(["odd", "odd"], "reward.max_error_rate=0.2")
    t.rewards = RewardPool(t.cfg.reward.__class__(workers=0, kind="math_verify"), scorers={"math_verify": _broken},
                           preload=())
    with pytest.raises(RewardErrorRate, match="8 of 8 rewards"):
        t.train_step()


def _broken(item):
    raise ImportError("math_verify is broken")
