"""Pure pieces of the rollout engine: the torch expand used by the CPU patch, SamplingSpec."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.cpu


def test_torch_expand_matches_kernel_contract():
    torch = pytest.importorskip("torch")
    from rhymerl.rollout.vllm_patches import expand_batch_to_tokens_torch

    # x = [a, b, c, d], cu = [2, 2, 5, 6]: a twice, b never, c three times, d once; 0 -> 1.
    x = torch.tensor([0.5, 2.0, 0.0, 0.25])
    cu = torch.tensor([2, 2, 5, 6], dtype=torch.int32)
    out = expand_batch_to_tokens_torch(x, cu, 6, replace_from=0, replace_to=1)
    assert out.tolist() == [0.5, 0.5, 1.0, 1.0, 1.0, 0.25]
    assert out.dtype == x.dtype
    ints = expand_batch_to_tokens_torch(torch.tensor([3, -1]), torch.tensor([1, 3]), 3)
    assert ints.tolist() == [3, -1, -1]


def test_sampling_spec_from_config():
    from rhymerl.config import RolloutConfig
    from rhymerl.rollout.engine import SamplingSpec

    cfg = RolloutConfig(temperature=0.7, top_p=0.9, top_k=20, max_tokens=33)
    s = SamplingSpec.from_config(cfg, max_tokens=5)
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens) == (0.7, 0.9, 20, 5)
    with pytest.raises(TypeError):
        SamplingSpec.from_config(cfg, nonsense=1)
