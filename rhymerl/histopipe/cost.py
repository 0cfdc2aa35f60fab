"""Decode cost model: how long a rollout instance takes, as a function of batch occupancy
and context length.

One decode step of a continuous-batching engine reads the weights once (fixed cost ``a``),
does per-sequence compute (``b`` per running sequence) and reads every running sequence's
KV cache (``c`` per context token in the batch):

    step_time(B, K) = a + b * B + c * K         B = running sequences, K = their total context

A prefill costs ``p`` seconds per prompt token (compute-bound). The defaults describe a
32B-class dense model (64 GB of bf16 weights, 256 KiB of KV per token: Qwen2.5-32B's GQA
shape) on H100-class GPUs, split over ``tp`` GPUs. Only ratios between schedulers matter,
so the absolute constants need only be plausible; what matters is that a long response
costs more than linearly (its KV reads grow with its length) and that the per-step fixed
cost is shared by the whole batch (a half-empty batch wastes the GPU).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class DecodeCostModel:
    a: float  # s per decode step (weights read + TP all-reduce latency)
    b: float  # s per running sequence per step
    c: float  # s per KV token in the batch per step
    p: float  # s per prefilled token
    max_batch: int  # engine max_num_seqs
    kv_capacity: int  # KV tokens that fit on the instance

    @classmethod
    def for_instance(
        cls,
        tp: int = 4,
        max_batch: int = 64,
        weights_gb: float = 64.0,
        kv_bytes_per_token: float = 256 * 1024,
        gpu_mem_gb: float = 80.0,
        mem_util: float = 0.9,
        hbm_tb_s: float = 3.35,
        peak_tflops: float = 989.0,
        params_b: float = 32.0,
    ) -> "DecodeCostModel":
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        bw = hbm_tb_s * 1e12 * 0.7  # achievable fraction of HBM bandwidth
        a = weights_gb * 1e9 / (tp * bw) + (0.4e-3 * math.log2(tp) if tp > 1 else 0.0)
        b = 2 * params_b * 1e9 / (tp * peak_tflops * 1e12 * 0.4)
        c = kv_bytes_per_token / (tp * bw)
        p = 2 * params_b * 1e9 / (tp * peak_tflops * 1e12 * 0.6)
        free = tp * gpu_mem_gb * mem_util * 1e9 - weights_gb * 1e9
        if free <= 0:
            raise ValueError(f"a {weights_gb} GB model does not fit on tp={tp} GPUs of {gpu_mem_gb} GB")
        return cls(a=a, b=b, c=c, p=p, max_batch=max_batch, kv_capacity=int(free / kv_bytes_per_token))

    def step_time(self, batch: float, context_tokens: float) -> float:
        return self.a + self.b * batch + self.c * context_tokens

    def prefill_time(self, tokens: float) -> float:
        return self.p * tokens

    def request_work(self, length: float, prompt_len: float, occupancy: float | None = None, prefill: bool = True) -> float:
        """Seconds of instance time one response of ``length`` tokens adds when it shares
        the instance with ``occupancy`` others: its share of the fixed step cost, its own
        per-sequence compute, and the KV reads of its growing context."""
        occ = float(self.max_batch if occupancy is None else max(1.0, occupancy))
        w = length * (self.a / occ + self.b) + self.c * length * (prompt_len + 0.5 * length)
        return w + (self.p * prompt_len if prefill else 0.0)

    def solo_time(self, length: float, prompt_len: float, occupancy: float | None = None, mean_ctx: float = 0.0) -> float:
        """Wall time of one response's decode while ``occupancy`` sequences of mean context
        ``mean_ctx`` share each step: a lower bound on the makespan of any instance holding it."""
        occ = float(self.max_batch if occupancy is None else max(1.0, occupancy))
        per_step = self.a + self.b * occ + self.c * (occ - 1) * mean_ctx
        return length * per_step + self.c * length * (prompt_len + 0.5 * length)

    def instance_time(self, lengths, prompt_lens, prefills: float | None = None) -> float:
        """Predicted wall time of an instance that runs ``lengths`` (longest first, so the
        longest starts at t=0): max of the total work and the longest request's own span."""
        n = len(lengths)
        if n == 0:
            return 0.0
        occ = min(self.max_batch, n)
        tot = 0.0
        lmax = 0.0
        pmax = 0.0
        ctx = 0.0
        for L, P in zip(lengths, prompt_lens):
            tot += self.request_work(L, P, occ, prefill=prefills is None)
            ctx += P + 0.5 * L
            if L > lmax:
                lmax, pmax = L, P
        if prefills is not None:
            tot += prefills
        return max(tot, self.solo_time(lmax, pmax, occ, ctx / n))

    def goodput_prior(self, context_tokens: float) -> dict:
        """HistoSpec's step-cost prior (``histospec.step_cost_*``, ms) for this engine: the
        fixed cost is a step's weights read, a request adds its KV read at ``context_tokens``,
        a scored token its matmul, the same at every batch size, and no cost of its own for a
        drafting row (the CPU defaults' ramp and drafting-row cost describe a CPU engine)."""
        if not context_tokens >= 1:
            raise ValueError(f"context_tokens must be >= 1, got {context_tokens}")
        return {"step_cost_fixed_ms": round(1e3 * self.a, 3), "step_cost_per_request_ms": round(1e3 * self.c * context_tokens, 4),
                "step_cost_per_token_ms": round(1e3 * self.b, 4), "step_cost_per_drafting_request_ms": 0.0,
                "step_cost_draft_ramp_requests": 1}

    def to_dict(self) -> dict:
        return asdict(self)
