"""The step-cost prior for the device an engine runs on: ``CPU_PRIOR``, or a GPU's decode roofline."""

from __future__ import annotations

import logging

from rhymerl.distributed.memory_plan import DTYPE_BYTES, kv_bytes_per_token, model_params
from rhymerl.histopipe.cost import DecodeCostModel
from rhymerl.histospec.step_costs import CPU_PRIOR, StepCosts, roofline_costs
from rhymerl.resharding.layout import LayoutError, ModelLayout

log = logging.getLogger(__name__)

# Spec-sheet (name, TB/s, dense 16-bit TFLOP/s, GB); an unlisted device is priced as the first.
GPU_KINDS = (("H100", 3.35, 989.0, 80.0), ("H200", 4.8, 989.0, 141.0), ("GH200", 4.0, 989.0, 96.0),
             ("B200", 8.0, 2250.0, 180.0), ("A100", 2.04, 312.0, 80.0), ("L40S", 0.864, 362.0, 48.0))


def gpu_prior(layout: ModelLayout, dtype: str, tp: int, context_tokens: float, max_batch: int,
              hbm_tb_s: float = 3.35, peak_tflops: float = 989.0, gpu_mem_gb: float = 80.0) -> StepCosts:
    """The decode roofline's step costs for ``tp`` GPUs (H100 SXM by default) at ``context_tokens`` per row."""
    if not context_tokens >= 1:
        raise ValueError(f"context_tokens must be >= 1, got {context_tokens}")
    nbytes = DTYPE_BYTES[dtype]
    params = model_params(layout)
    cm = DecodeCostModel.for_instance(tp=tp, max_batch=max_batch, weights_gb=params * nbytes / 1e9,
                                      kv_bytes_per_token=kv_bytes_per_token(layout, nbytes, 1), gpu_mem_gb=gpu_mem_gb,
                                      hbm_tb_s=hbm_tb_s, peak_tflops=peak_tflops, params_b=params / 1e9)
    return roofline_costs(cm, context_tokens)


def gpu_kind(device_name: str) -> tuple[str, float, float, float]:
    """(kind, TB/s, TFLOP/s, GB) of a CUDA device name; the first kind where none matches."""
    name = device_name.upper()
    # Longest names first: "GH200" must not be read as "H200".
    for kind in sorted(GPU_KINDS, key=lambda k: -len(k[0])):
        if kind[0] in name:
            return kind
    return GPU_KINDS[0]


def for_engine(on_cpu: bool, hf_config: dict, dtype: str, tp: int, max_tokens: int, max_batch: int,
               device_name: str = "") -> StepCosts:
    """The CPU's prior, or the GPU roofline (the CPU's where unreadable: it overprices, never at a loss)."""
    if on_cpu:
        return CPU_PRIOR
    kind, bw, flops, mem = gpu_kind(device_name)
    context = max(1.0, max_tokens / 2)
    try:
        layout = ModelLayout.from_hf_config(hf_config)
        costs = gpu_prior(layout, dtype if dtype in DTYPE_BYTES else "bfloat16", tp, context, max_batch, bw, flops, mem)
    except (LayoutError, KeyError, ValueError) as e:
        log.warning("histospec: no decode roofline for this model (%s); drafts are priced at the CPU prior", e)
        return CPU_PRIOR
    return StepCosts(costs.fixed_ms, costs.per_request_ms, costs.per_token_ms,
                     source=f"the {kind} decode roofline (tp {tp}, {int(context)}-token context)")
