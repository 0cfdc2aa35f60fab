"""Decode cost model of a rollout instance: step_time(B, K) = a + b * B + c * K, prefill ``p`` per token."""

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
    def for_instance(cls, tp: int = 4, max_batch: int = 64, weights_gb: float = 64.0,
                     kv_bytes_per_token: float = 256 * 1024, gpu_mem_gb: float = 80.0, mem_util: float = 0.9,
                     hbm_tb_s: float = 3.35, peak_tflops: float = 989.0, params_b: float = 32.0) -> "DecodeCostModel":
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
        """Seconds of instance time one response of ``length`` tokens adds among ``occupancy`` others."""
        occ = float(self.max_batch if occupancy is None else max(1.0, occupancy))
        w = length * (self.a / occ + self.b) + self.c * length * (prompt_len + 0.5 * length)
        return w + (self.p * prompt_len if prefill else 0.0)

    def solo_time(self, length: float, prompt_len: float, occupancy: float | None = None, mean_ctx: float = 0.0) -> float:
        """Wall time of one response's decode among ``occupancy`` sequences of mean context ``mean_ctx``."""
        occ = float(self.max_batch if occupancy is None else max(1.0, occupancy))
        per_step = self.a + self.b * occ + self.c * (occ - 1) * mean_ctx
        return length * per_step + self.c * length * (prompt_len + 0.5 * length)

    def instance_time(self, lengths, prompt_lens, prefills: float | None = None) -> float:
        """Predicted wall time of an instance running ``lengths`` longest first: max(total work, longest span)."""
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

    def to_dict(self) -> dict:
        return asdict(self)
