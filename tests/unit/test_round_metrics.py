import pytest

from rhymerl.rollout.metrics import merge_round_metrics

pytestmark = pytest.mark.cpu


def _round(requests, with_history, steps, bypassed, searches, skipped, proposed, accepted, tokens, forwards):
    counts = {"requests": requests, "requests_with_history": with_history, "steps": steps,
              "steps_without_drafts": bypassed, "searches": searches, "searches_skipped": skipped,
              "draft_proposed": proposed, "draft_accepted": accepted, "generated_tokens": tokens,
              "target_forwards": forwards, "draft_time_s": 0.01}
    m = {f"histospec/{k}": v for k, v in counts.items()}
    m.update({"histospec/history_served_fraction": with_history / requests,
              "histospec/steps_without_drafts_fraction": bypassed / steps,
              "histospec/searches_skipped_fraction": skipped / (searches + skipped),
              "histospec/acceptance": accepted / proposed, "histospec/tokens_per_forward": tokens / forwards,
              "histospec/source/history/drafts": 3, "histospec/source/history/accepted": accepted // 2,
              "histospec/history_tokens_per_forward": accepted // 2 / forwards, "time/rollout_s": 2.0})
    return m


def test_refill_rounds_recompute_every_ratio_from_the_summed_counts():
    """DAPO refills add rounds to a step: the step's fractions are those of all its rounds,
    not of the first."""
    step = _round(8, 8, 10, 1, 60, 20, 40, 20, 120, 60)
    merge_round_metrics(step, _round(8, 0, 30, 27, 10, 90, 10, 1, 100, 90), 1)
    assert step["histospec/requests"] == 16 and step["time/rollout_s"] == 4.0
    assert step["histospec/history_served_fraction"] == 0.5
    assert step["histospec/steps_without_drafts_fraction"] == 28 / 40
    assert step["histospec/searches_skipped_fraction"] == 110 / 180
    assert step["histospec/acceptance"] == 21 / 50 and step["histospec/tokens_per_forward"] == 220 / 150
    assert step["histospec/source/history/drafts"] == 6  # per-source counts add up too
    assert step["histospec/history_tokens_per_forward"] == (10 + 0) / 150


def test_instances_sum_their_counts_by_source():
    from rhymerl.rollout.metrics import sum_engine_metrics as _sum_engine_metrics

    a = {"requests": 4, "searches": 10, "searches_skipped": 0, "source/history/drafts": 5,
         "source/group/accepted": 2, "search_us_per_request": 40.0}
    b = {"requests": 4, "searches": 5, "searches_skipped": 5, "source/history/drafts": 1,
         "search_us_per_request": 60.0}
    out = _sum_engine_metrics([a, b])
    assert out["source/history/drafts"] == 6 and out["source/group/accepted"] == 2
    assert out["searches_skipped_fraction"] == 0.25 and out["search_us_per_request"] == 50.0


def test_history_tokens_per_forward_counts_only_the_history_source():
    from rhymerl.rollout.metrics import sum_engine_metrics

    a = {"target_forwards": 30, "generated_tokens": 60, "source/history/accepted": 12, "source/group/accepted": 18}
    b = {"target_forwards": 10, "generated_tokens": 10, "source/history/accepted": 0}
    assert sum_engine_metrics([a, b])["history_tokens_per_forward"] == 12 / 40
    # A method without HistoSpec's sources has no such figure (not a zero that reads as "history never paid").
    assert "history_tokens_per_forward" not in sum_engine_metrics([{"target_forwards": 10, "generated_tokens": 20}])


def test_each_instance_reports_its_steps_with_and_without_tokens():
    """An engine step that emits nothing (a dummy batch run in lock-step with busier instances)
    is counted apart per instance, and refill rounds add up both counts."""
    from rhymerl.rollout.batch import InstanceReport, Sample
    from rhymerl.rollout.metrics import rollout_metrics

    samples = [Sample(group=0, sample_idx=0, prompt_ids=[1], token_ids=[2, 3], logprobs=[0.0, 0.0],
                      finish_reason="stop")]
    reports = [InstanceReport(engine_steps=192, idle_steps=0, busy_s=2.0),
               InstanceReport(engine_steps=96, idle_steps=3, busy_s=1.0)]
    step = rollout_metrics(samples, reports, 2.0, {})
    assert (step["rollout/engine_steps/0"], step["rollout/idle_steps/0"]) == (192, 0)
    assert (step["rollout/engine_steps/1"], step["rollout/idle_steps/1"]) == (96, 3)
    merge_round_metrics(step, rollout_metrics(samples, reports, 2.0, {}), 1)
    assert step["rollout/idle_steps/1"] == 6 and step["rollout/engine_steps/0"] == 384
