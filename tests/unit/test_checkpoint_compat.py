"""check_compatible: refuse a different model/algorithm, allow re-layout and run-length changes."""

from __future__ import annotations

import pytest

from rhymerl.outputs.checkpoint import IncompatibleCheckpoint, check_compatible
from rhymerl.config import load_config, to_dict

pytestmark = pytest.mark.cpu


def _cfg(*overrides: str) -> dict:
    return to_dict(load_config(None, list(overrides)))


def test_same_config_is_compatible():
    check_compatible(_cfg(), _cfg())


@pytest.mark.parametrize("overrides", [
    ("parallel.tensor_parallel=2", "parallel.pipeline_parallel=2"),
    ("run.max_steps=100", "run.epochs=9", "tracking.wandb=disabled"),
    ("rollout.temperature=0.7", "histospec.epochs_kept=1", "checkpoint.keep_last=5"),
])
def test_relayout_and_run_length_changes_are_allowed(overrides):
    check_compatible(_cfg(), _cfg(*overrides))


def test_model_change_is_refused_with_every_key():
    with pytest.raises(IncompatibleCheckpoint) as e:
        check_compatible(_cfg("model.path=builtin:tiny"),
                         _cfg("model.path=builtin:tiny", "model.dtype=bfloat16", "algo.name=dapo"))
    msg = str(e.value)
    assert "algo.name: checkpoint has 'grpo', this config has 'dapo'" in msg
    assert "model.dtype: checkpoint has 'float32', this config has 'bfloat16'" in msg
    assert "model.path" not in msg


def test_algorithm_and_data_changes_are_refused():
    with pytest.raises(IncompatibleCheckpoint, match=r"algo.name(.|\n)*data.seed"):
        check_compatible(_cfg(), _cfg("algo.name=dapo", "data.seed=99"))


def test_zero_stage_matters_only_for_deepspeed():
    check_compatible(_cfg("parallel.zero_stage=1"), _cfg("parallel.zero_stage=2"))
    with pytest.raises(IncompatibleCheckpoint, match="parallel.zero_stage"):
        check_compatible(_cfg("parallel.backend=deepspeed", "parallel.zero_stage=1"),
                         _cfg("parallel.backend=deepspeed", "parallel.zero_stage=2"))


def test_key_missing_from_an_old_checkpoint_is_reported():
    saved = _cfg()
    del saved["data"]["shuffle"]
    with pytest.raises(IncompatibleCheckpoint, match="data.shuffle: checkpoint has '<unset>'"):
        check_compatible(saved, _cfg())
