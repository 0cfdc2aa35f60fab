"""vLLM round trip for tests/integration/test_resharding_vllm.py (own process: vLLM and megatron's
CPU patches stay out of the pytest process).

An engine starts from HF folder A and generates greedily. It then loads folder B's weights (the
outputs must change), then the weights that Megatron, loaded from A, streams out of its
exporter in small buckets: the outputs must be A's again, token for token.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    folder_a, folder_b, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    from safetensors.torch import load_file

    from rhymerl.config import AlgorithmConfig, HistoSpecConfig, ParallelConfig, RolloutConfig
    from rhymerl.rollout import RolloutEngine, SamplingSpec
    from rhymerl.training import build_backend, init_process_groups

    engine = RolloutEngine(RolloutConfig(speculative="none", max_model_len=128, max_num_seqs=8), HistoSpecConfig(),
                           folder_a, seed=0, cpu_kv_cache_bytes=256 << 20)
    prompts = [[5, 17, 42, 7], [100, 3, 9], [250, 251, 252, 253, 254]]
    greedy = SamplingSpec(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=False)

    def run():
        return [r.responses[0].token_ids for r in engine.generate(prompts, 1, greedy)]

    from_a = run()
    engine.load_weights(iter(load_file(str(folder_b / "model.safetensors")).items()))
    from_b = run()
    pc = ParallelConfig()
    backend = build_backend(pc, AlgorithmConfig(), folder_a, init_process_groups(pc, 1, 0), train=False)
    buckets = 0

    def stream():
        nonlocal buckets
        for bucket in backend.export_hf_weights(64 << 10):
            buckets += 1
            yield from bucket

    engine.load_weights(stream())
    from_export = run()
    out.write_text(json.dumps({"from_a": from_a, "from_b": from_b, "from_export": from_export, "buckets": buckets}))
    engine.shutdown()


if __name__ == "__main__":
    main()
