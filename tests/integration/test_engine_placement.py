"""Every rank of the shipped cluster layouts builds its rollout engine on its own GPU, as an
independent instance: the arguments the trainer gives ``vllm.LLM`` are handed to vLLM's own
config and executor selection (no GPU needed for either), and vLLM's answer is checked.

- 7B config: 8 ranks on one node, rollout TP 1 (eight one-GPU engines);
- 32B config: 32 ranks on 4 nodes of 8, rollout TP 4 (eight four-GPU engines).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rhymerl.config import load_config
from rhymerl.rollout.engine import vllm_engine_args
from rhymerl.rollout.placement import EnginePlacementError, engine_placement

pytestmark = [pytest.mark.cpu, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
QWEN2 = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", max_position_embeddings=32768,
             rope_theta=1000000.0, torch_dtype="bfloat16", tie_word_embeddings=False, vocab_size=152064)
LAYOUTS = [
    ("qwen2.5-7b-dapo-math-8xh100.yaml", dict(QWEN2, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                                              num_key_value_heads=4, intermediate_size=18944), 8, 8),
    ("qwen2.5-32b-grpo-math-4x8xh100.yaml", dict(QWEN2, hidden_size=5120, num_hidden_layers=64,
                                                 num_attention_heads=40, num_key_value_heads=8,
                                                 intermediate_size=27648), 32, 8),
]


@pytest.fixture
def launcher_env():
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "VLLM_ENABLE_V1_MULTIPROCESSING")
    saved = {k: os.environ.get(k) for k in keys}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.mark.parametrize("name,shape,world,per_node", LAYOUTS)
def test_each_rank_builds_an_independent_engine_on_its_own_gpu(name, shape, world, per_node, tmp_path, launcher_env):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.executor.abstract import Executor

    cfg = load_config(REPO / "configs" / name)
    (tmp_path / "config.json").write_text(json.dumps(shape))
    rtp = cfg.rollout.tensor_parallel
    instances = {}
    for rank in range(world):
        local = rank % per_node
        layout = engine_placement(world, rank, local, rtp, ranks_per_node=per_node)
        os.environ.update(layout.launcher_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
        kwargs = vllm_engine_args(cfg.rollout, tmp_path, shape, 0, cfg.model.dtype, layout, on_cpu=False)
        assert kwargs["gpu_memory_utilization"] == cfg.rollout.gpu_memory_utilization and kwargs["enable_sleep_mode"]
        # Sleep mode and the HistoSpec plug-in need a CUDA platform to be configured; the
        # parallel layout does not depend on them.
        vc = EngineArgs(**{**kwargs, "enable_sleep_mode": False, "speculative_config": None}).create_engine_config()
        pc = vc.parallel_config
        # Independent instances: no vLLM data parallelism (no lock-step), one TP group each.
        assert (pc.distributed_executor_backend, pc.data_parallel_size, pc.tensor_parallel_size, pc.world_size) \
            == ("external_launcher", 1, rtp, rtp), (rank, pc)
        # The worker vLLM would start binds cuda:LOCAL_RANK: this rank's GPU, not GPU 0.
        executor = Executor.get_class(vc)
        init_method, vllm_rank, vllm_local_rank = executor._distributed_args(None)
        assert (vllm_rank, vllm_local_rank) == (rank, local), (name, rank, executor)
        instances.setdefault(layout.instance, []).append((rank, rank // per_node))
    # vLLM groups TP ranks in consecutive blocks ("external DP x DP x PP x TP"): each instance
    # is rtp consecutive ranks on one node.
    assert len(instances) == world // rtp
    for ranks in instances.values():
        assert [r for r, _ in ranks] == list(range(ranks[0][0], ranks[0][0] + rtp))
        assert len({node for _, node in ranks}) == 1


def test_a_single_process_engine_uses_vllms_own_executor():
    layout = engine_placement(1, 0, 0, 1)
    assert layout.vllm_args() == {"tensor_parallel_size": 1} and not layout.external_launcher


def test_layouts_that_cannot_be_formed_are_refused():
    with pytest.raises(EnginePlacementError, match="does not divide the world size 8"):
        engine_placement(8, 0, 0, 3)
    with pytest.raises(EnginePlacementError, match="would span two nodes"):
        engine_placement(12, 0, 0, 4, ranks_per_node=6)
