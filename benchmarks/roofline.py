"""HistoSpec's GPU step-cost prior, printed: what an engine on a CUDA device prices drafts at.

An engine picks its prior when it starts (``rhymerl.histospec.device_costs.for_engine``: the
decode roofline of its model, tensor-parallel split and device kind at half of
``rollout.max_tokens``); this prints that prior for a model folder and a split, to compare
with ``bench step --calibrate`` on a real node, and names the presets the offline replays
price drafts at (``bench histospec --costs``).

    python -m benchmarks.roofline /models/Qwen2.5-7B --tp 1 --context 4096
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from rhymerl.distributed.memory_plan import DTYPE_BYTES
from rhymerl.histospec.device_costs import gpu_prior
from rhymerl.histospec.step_costs import CPU_PRIOR, StepCosts
from rhymerl.resharding.layout import ModelLayout

# Published config.json values of the models the shipped GPU configs name.
QWEN25_7B = dict(architectures=["Qwen2ForCausalLM"], hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False)
QWEN25_32B = dict(architectures=["Qwen2ForCausalLM"], hidden_size=5120, num_hidden_layers=64, num_attention_heads=40,
                  num_key_value_heads=8, intermediate_size=27648, vocab_size=152064, tie_word_embeddings=False)


def preset(name: str) -> StepCosts:
    """Step costs by name: ``cpu`` (the CPU prior), or a shipped GPU config's engine on H100s
    (its model, split and half its ``rollout.max_tokens``), as the engine would derive them."""
    if name == "cpu":
        return CPU_PRIOR
    if name == "qwen2.5-7b-h100":
        return gpu_prior(ModelLayout.from_hf_config(QWEN25_7B), "bfloat16", 1, 4096, 256)
    if name == "qwen2.5-32b-h100":
        return gpu_prior(ModelLayout.from_hf_config(QWEN25_32B), "bfloat16", 4, 8192, 256)
    raise ValueError(f"unknown step-cost preset {name!r}; known: {', '.join(PRESETS)}")


PRESETS = ("cpu", "qwen2.5-7b-h100", "qwen2.5-32b-h100")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.roofline", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="HF model folder (its config.json)")
    ap.add_argument("--tp", type=int, default=1, help="GPUs per rollout engine (rollout.tensor_parallel)")
    ap.add_argument("--context", type=int, required=True, help="a typical row's context in tokens (prompt + half a response)")
    ap.add_argument("--max-batch", type=int, default=256, help="rollout.max_num_seqs")
    ap.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16")
    ap.add_argument("--hbm-tb-s", type=float, default=3.35)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    args = ap.parse_args(argv)
    cfg_path = Path(args.model) / "config.json"
    try:
        layout = ModelLayout.from_hf_config(json.loads(cfg_path.read_text()))
        prior = gpu_prior(layout, args.dtype, args.tp, args.context, args.max_batch, args.hbm_tb_s, args.peak_tflops)
    except (OSError, ValueError, KeyError) as e:
        print(f"roofline: {cfg_path}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(prior), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
