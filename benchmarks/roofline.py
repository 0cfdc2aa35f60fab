"""HistoSpec's step-cost prior for a GPU rollout engine, from the decode roofline.

The goodput rule prices drafts with a step-time model (``histospec.step_cost_*``: fixed +
per request + per scored token). The dataclass defaults are measured on the 2-core CPU of
the embedded run, where a draft token costs about a row from 4 requests on; on a GPU decode is
memory-bound and a scored token costs little next to reading the weights, so a GPU config
states its own prior. This derives one from the same roofline the cluster simulator uses
(``histopipe.cost.DecodeCostModel.for_instance``): the fixed cost is one read of the
weights per step, a request adds the read of its KV cache (at ``context_tokens``), a scored
token adds its matmul FLOPs.

    python -m benchmarks.roofline /models/Qwen2.5-7B --tp 1 --context 4096

prints the keys for a config (the price of a draft token flat at every batch size).
``histospec.step_cost: measured`` then refits them from the engine's own steps as the run goes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rhymerl.histopipe.cost import DecodeCostModel
from rhymerl.distributed.memory_plan import DTYPE_BYTES, kv_bytes_per_token, model_params
from rhymerl.resharding.layout import ModelLayout


def gpu_step_cost_prior(layout: ModelLayout, dtype: str, tp: int, context_tokens: int, max_batch: int,
                        hbm_tb_s: float = 3.35, peak_tflops: float = 989.0, gpu_mem_gb: float = 80.0) -> dict:
    """``histospec.step_cost_*`` (ms) for an engine of ``tp`` GPUs (H100 SXM figures by default)."""
    nbytes = DTYPE_BYTES[dtype]
    params = model_params(layout)
    cm = DecodeCostModel.for_instance(tp=tp, max_batch=max_batch, weights_gb=params * nbytes / 1e9,
                                      kv_bytes_per_token=kv_bytes_per_token(layout, nbytes, 1), gpu_mem_gb=gpu_mem_gb,
                                      hbm_tb_s=hbm_tb_s, peak_tflops=peak_tflops, params_b=params / 1e9)
    return cm.goodput_prior(context_tokens)


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
        prior = gpu_step_cost_prior(layout, args.dtype, args.tp, args.context, args.max_batch, args.hbm_tb_s,
                                    args.peak_tflops)
    except (OSError, ValueError, KeyError) as e:
        print(f"roofline: {cfg_path}: {e}", file=sys.stderr)
        return 2
    print("histospec:")
    for k, v in prior.items():
        print(f"  {k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
