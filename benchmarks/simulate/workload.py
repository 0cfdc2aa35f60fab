"""One RL step's rollout workload for the simulator: the step's prompt groups, their true
response lengths, and the earlier epochs' lengths (the history HistoPipe plans from).

Built either from a rollout trace (``rhymerl.outputs.traces`` JSONL: the last epoch is the step,
earlier epochs are history) or synthetically: per-prompt log-mean lengths follow an AR(1)
process across epochs with correlation ``corr`` (0 = the last epoch says nothing about
this one), responses within a group are lognormal around it, clipped at ``max_tokens``.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from rhymerl.histopipe.planner import PromptGroup
from rhymerl.outputs.traces import TraceError, by_epoch, read_trace

# The simulator's synthetic workload: a response-length cap and a prompt length when a trace has none.
DEFAULT_MAX_TOKENS = 16384
DEFAULT_PROMPT_LEN = 256


@dataclass
class Workload:
    groups: list[PromptGroup]  # the step; group i has index i
    lengths: np.ndarray  # true lengths, request id = offsets[i] + sample
    offsets: np.ndarray  # len(groups) + 1
    history: dict[int, list[list[int]]]  # key -> earlier epochs' lengths, oldest first
    # Earlier steps replayed to train the predictor online: (history before, actual lengths).
    warmup: list[tuple[dict[int, list[list[int]]], dict[int, list[int]]]] = field(default_factory=list)
    max_tokens: int = 16384
    source: str = "synthetic"

    @property
    def num_requests(self) -> int:
        return int(self.offsets[-1])

    def group_of(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.groups)), np.diff(self.offsets))

    def prompt_lens(self) -> np.ndarray:
        return np.repeat(np.array([g.prompt_len for g in self.groups]), np.diff(self.offsets))

    def true_group_mean(self) -> dict[int, float]:
        sums = np.add.reduceat(self.lengths, self.offsets[:-1]) if len(self.groups) else np.zeros(0)
        return {g.index: float(sums[g.index] / g.n) for g in self.groups}

    def request_id(self, group_index: int, sample: int) -> int:
        return int(self.offsets[group_index]) + sample


def _build(keys, prompt_lens, epochs: list[list[np.ndarray]], max_tokens: int, source: str) -> Workload:
    """epochs[e][k] = lengths of prompt k in epoch e (last epoch = the step)."""
    cur = epochs[-1]
    groups = [PromptGroup(key=int(k), index=i, prompt_len=int(pl), n=len(cur[i])) for i, (k, pl) in enumerate(zip(keys, prompt_lens))]
    offsets = np.zeros(len(groups) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([g.n for g in groups])
    lengths = np.concatenate(cur).astype(np.int64) if groups else np.zeros(0, dtype=np.int64)
    lists = [[e[i].tolist() for e in epochs] for i in range(len(groups))]
    history = {int(k): [x for x in lists[i][:-1] if x] for i, k in enumerate(keys)}
    warmup = []
    for e in range(1, len(epochs) - 1):
        hist = {int(k): [x for x in lists[i][:e] if x] for i, k in enumerate(keys)}
        actual = {int(k): lists[i][e] for i, k in enumerate(keys) if lists[i][e]}
        warmup.append((hist, actual))
    return Workload(groups, lengths, offsets, history, warmup, max_tokens, source)


def synthetic(
    num_groups: int,
    n: int = 16,
    epochs: int = 3,
    corr: float = 0.9,
    max_tokens: int = 16384,
    median: float = 2500.0,
    sigma_prompt: float = 0.9,
    sigma_sample: float = 0.45,
    drift: float = 0.05,
    prompt_len: tuple[int, int] = (100, 800),
    seed: int = 0,
) -> Workload:
    if not 0.0 <= corr <= 1.0:
        raise ValueError(f"corr must be in [0, 1], got {corr}")
    if epochs < 1 or num_groups < 1 or n < 1:
        raise ValueError("epochs, num_groups and n must be >= 1")
    rng = np.random.default_rng(seed)
    z = rng.standard_normal(num_groups)
    eps_all = []
    for e in range(epochs):
        if e:
            z = corr * z + math.sqrt(1.0 - corr * corr) * rng.standard_normal(num_groups)
        mu = math.log(median) + drift * e + sigma_prompt * z
        L = np.exp(mu[:, None] + sigma_sample * rng.standard_normal((num_groups, n)))
        L = np.clip(np.rint(L), 16, max_tokens).astype(np.int64)
        eps_all.append(list(L))
    keys = np.arange(num_groups) + 1_000_000 * (seed + 1)
    pls = rng.integers(prompt_len[0], prompt_len[1] + 1, size=num_groups)
    return _build(keys.tolist(), pls.tolist(), eps_all, max_tokens, f"synthetic(corr={corr}, n={n}, max={max_tokens})")


def from_trace(path: str | Path, default_prompt_len: int = 256, max_tokens: Optional[int] = None) -> Workload:
    recs = read_trace(path)
    ep = by_epoch(recs)
    order = sorted(ep)
    last = ep[order[-1]]
    pids = sorted(last)
    if not pids:
        raise TraceError(f"{path}: the last epoch has no prompts")
    plen = {}
    for e in order:
        for pid, rs in ep[e].items():
            if pid not in plen and rs[0].prompt_token_ids is not None:
                plen[pid] = len(rs[0].prompt_token_ids)
    epochs = [[np.array([max(1, len(r.token_ids)) for r in ep[e].get(pid, [])], dtype=np.int64) for pid in pids] for e in order]
    keys = [zlib.crc32(pid.encode()) for pid in pids]
    if len(set(keys)) != len(keys):
        keys = list(range(len(pids)))
    mt = max_tokens or int(max(int(x.max()) for e in epochs for x in e if len(x)))
    return _build(keys, [plen.get(pid, default_prompt_len) for pid in pids], epochs, mt, f"trace {path}")


def reorder(w: Workload, perm: list[int]) -> Workload:
    """The same step with its prompts in the order ``perm`` (group i of the result = group perm[i])."""
    groups, chunks = [], []
    for i, j in enumerate(perm):
        g = w.groups[j]
        groups.append(PromptGroup(key=g.key, index=i, prompt_len=g.prompt_len, n=g.n))
        chunks.append(w.lengths[w.offsets[j]:w.offsets[j + 1]])
    offsets = np.zeros(len(groups) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([g.n for g in groups])
    lengths = np.concatenate(chunks) if chunks else w.lengths[:0]
    return Workload(groups, lengths, offsets, w.history, w.warmup, w.max_tokens, w.source)


def tile(w: Workload, num_groups: int, seed: int = 0) -> Workload:
    """Repeat a (small) trace's prompts, as distinct prompts, until it has ``num_groups``.

    The copies are interleaved in a seeded random order: repeated in turn, every copy of
    one long prompt would sit at the same position modulo the trace size, and a
    round-robin deal would put them all on one instance when the instance count divides it.
    """
    if len(w.groups) >= num_groups:
        return w
    reps = math.ceil(num_groups / len(w.groups))
    keys, pls = [], []
    hist_epochs = max((len(v) for v in w.history.values()), default=0)
    epochs: list[list[np.ndarray]] = [[] for _ in range(hist_epochs + 1)]
    for rep in range(reps):
        for g in w.groups:
            if len(keys) == num_groups:
                break
            keys.append(g.key * 131 + rep if rep else g.key)
            pls.append(g.prompt_len)
            h = w.history.get(g.key, [])
            pad = [[]] * (hist_epochs - len(h)) + h
            for e in range(hist_epochs):
                epochs[e].append(np.array(pad[e], dtype=np.int64))
            epochs[-1].append(w.lengths[w.offsets[g.index]:w.offsets[g.index + 1]].copy())
    out = _build(keys, pls, epochs, w.max_tokens, w.source + f" tiled x{reps}")
    perm = np.random.default_rng(seed + 7).permutation(len(out.groups)).tolist()
    return reorder(out, perm)
