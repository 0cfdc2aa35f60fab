"""HistoSpec offline benchmark: target forward passes per generated token, per drafter.

Replays rollout traces: epoch e's responses are the history, epoch e+1's responses
are the sequences to generate. All requests of an epoch decode in lockstep (one
verification forward per request per round, as in continuous batching), so a
request finishing early becomes a sibling draft source (HistoSpec include_siblings,
SuffixDecoding's global cache) only for requests still running, as in a real engine.

Acceptance is replayed exactly against the recorded tokens: a draft's accepted
length is its longest prefix that equals the recorded continuation. For one-hot (history) drafts this is also exact for *sampled*
decoding: conditioned on the recorded token y being emitted, the lossless rule
(accept x w.p. p(x), else sample from p without x) accepts iff x == y, so trace
log-probabilities do not change the counts (see rhymerl/histospec/acceptance.py).

Methods: none; ngram (vLLM's prompt-lookup rule over prompt + generated);
suffix (vLLM's ``suffix`` through arctic-inference, or a re-implementation of SuffixDecoding
where it is not installed); histospec_chain. The
``hindsight_ceiling`` ablation says what the text allows: at each step the longest
continuation any occurrence of the last token (or the last two) offers, picked knowing the
answer (``HindsightMethod``); with one token, no chain that continues the last token in the
same text accepts more at that step.
Figures: tokens_per_forward (hardware independent), mean_accepted_len (accepted
draft tokens per forward), acceptance_rate, draft_tokens_per_forward (verification
work), draft_us_per_token / draft_us_per_call (measured here), index_kb_per_1k_tokens,
and modelled_speedup = tokens_per_forward / (1 + verify_cost * draft_tokens_per_forward),
where verify_cost is the assumed cost of one extra verified token relative to a decode
step (--verify-cost). Drafting cost is compared with a measured forward of the tiny
model (torch) when torch is importable.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import zlib
from typing import Optional

from benchmarks.baselines import NgramDrafter, SuffixDecodingDrafter
from benchmarks.roofline import PRESETS, preset
from benchmarks.synthetic import synthetic_trace
from rhymerl.config import HistoSpecConfig
from rhymerl.histospec import DraftProposer, HistoryStore, draft_calibration, prompt_key
from rhymerl.histospec.acceptance import accepted_prefix
from rhymerl.histospec.goodput import StepCostModel
from rhymerl.histospec.proposer import DRAFTING, SOURCES, Drafting
from rhymerl.histospec.step_costs import CPU_PRIOR, StepCosts
from rhymerl.outputs.traces import TraceRecord, by_epoch, read_trace

# -- methods: one interface over every drafter ------------------------------------------


class Method:
    name = "none"

    def observe(self, epoch: int, groups: dict[str, list[TraceRecord]]) -> None:
        """Epoch finished: its responses become history."""

    def begin(self, rid: str, rec: TraceRecord) -> None:
        pass

    def propose(self, rid: str, generated: list[int], max_len: int) -> list[int]:
        return []

    def feedback(self, rid: str, proposed: int, accepted: int) -> None:
        pass

    def end(self, rid: str, rec: TraceRecord) -> None:
        pass

    def index_bytes_per_token(self) -> float:
        return 0.0

    def extra(self) -> dict:
        return {}


def _prompt_tokens(rec: TraceRecord) -> list[int]:
    if rec.prompt_token_ids is not None:
        return rec.prompt_token_ids
    # Traces without prompt tokens: a stand-in derived from the prompt id (stable).
    return [zlib.crc32(rec.prompt_id.encode()) & 0x7FFFFFFF]


class NgramMethod(Method):
    def __init__(self, min_n: int, max_n: int):
        self.name = f"ngram[{min_n},{max_n}]"
        self.min_n, self.max_n = min_n, max_n
        self._d: dict[str, NgramDrafter] = {}
        self._seen: dict[str, int] = {}

    def begin(self, rid, rec):
        d = NgramDrafter(self.min_n, self.max_n, k=1 << 30)
        d.begin(_prompt_tokens(rec))
        self._d[rid] = d
        self._seen[rid] = 0

    def propose(self, rid, generated, max_len):
        new = generated[self._seen[rid]:]
        self._seen[rid] = len(generated)
        return self._d[rid].propose(new, max_len)

    def end(self, rid, rec):
        self._d.pop(rid)


class SuffixMethod(Method):
    name = "suffix"

    def __init__(self, max_len: int):
        self.d = SuffixDecodingDrafter(k=max_len)
        self._seen: dict[str, int] = {}

    def observe(self, epoch, groups):
        if self.d.global_index.num_tokens == 0:  # later epochs were added as requests ended
            for recs in groups.values():
                for r in recs:
                    self.d.add_response(r.token_ids)

    def begin(self, rid, rec):
        self.d.begin(rid, _prompt_tokens(rec))
        self._seen[rid] = 0

    def propose(self, rid, generated, max_len):
        new = generated[self._seen[rid]:]
        self._seen[rid] = len(generated)
        return self.d.propose(rid, new, max_len)

    def end(self, rid, rec):
        self.d.end(rid, rec.token_ids)

    def index_bytes_per_token(self):
        g = self.d.global_index
        return g.memory_bytes() / max(1, g.num_tokens)


class ArcticSuffixMethod(Method):
    """vLLM's ``suffix`` method exactly: arctic-inference's SuffixDecodingCache driven as
    ``vllm/v1/spec_decode/suffix_decoding.py`` drives it (per-request tree over prompt +
    output, global tree over every request's output added as it is generated, at most
    ``max_cached_requests`` responses, pattern = the last ``max_tree_depth`` tokens of
    prompt + output, vLLM's defaults)."""

    name = "suffix"

    def __init__(self, max_len: int, max_tree_depth: int = 24, max_cached_requests: int = 10000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=max_tree_depth, max_cached_requests=max_cached_requests)
        self.depth, self.factor, self.min_prob = max_tree_depth, max_spec_factor, min_token_prob
        self._ctx: dict[str, list[int]] = {}
        self._seen: dict[str, int] = {}
        self._warm = False

    def observe(self, epoch, groups):
        if self._warm:
            return  # later epochs entered the cache while they were generated
        self._warm = True
        for pid, recs in groups.items():
            for r in recs:
                rid = f"warm:{epoch}:{pid}:{r.sample_idx}"
                self.cache.start_request(rid, _prompt_tokens(r))
                self.cache.add_active_response(rid, r.token_ids)
                self.cache.stop_request(rid)

    def begin(self, rid, rec):
        prompt = _prompt_tokens(rec)
        self.cache.start_request(rid, prompt)
        self._ctx[rid] = list(prompt)
        self._seen[rid] = 0

    def propose(self, rid, generated, max_len):
        new = generated[self._seen[rid]:]
        self._seen[rid] = len(generated)
        ctx = self._ctx[rid]
        if new:
            self.cache.add_active_response(rid, new)
            ctx.extend(new)
        d = self.cache.speculate(rid, ctx[-self.depth:], max_spec_tokens=max_len, max_spec_factor=self.factor,
                                 min_token_prob=self.min_prob)
        return list(d.token_ids)

    def end(self, rid, rec):
        new = rec.token_ids[self._seen.pop(rid):]
        if new:
            self.cache.add_active_response(rid, new)
        self.cache.stop_request(rid)
        self._ctx.pop(rid)


def _suffix_method(max_len: int) -> Method:
    try:
        return ArcticSuffixMethod(max_len)
    except ImportError:
        return SuffixMethod(max_len)


class HistoSpecMethod(Method):
    """HistoSpec's proposer replayed, drafts priced at ``costs``. Each replayed epoch is a
    rollout: the acceptance learnt in the earlier ones carries over as the trainer's does."""

    def __init__(self, cfg: HistoSpecConfig, name: str, costs: StepCosts = CPU_PRIOR,
                 drafting: Drafting = DRAFTING):
        self.name = name
        self.cfg = cfg
        self.store = HistoryStore(cfg)
        self.prop = DraftProposer(self.store, cfg, costs, drafting)
        self._epoch = -1

    _index_bytes = 0.0

    def observe(self, epoch, groups):
        self._epoch = epoch + 1
        # Indexes built while this epoch was drafted; adding the epoch drops them.
        self._index_bytes = self.store.build_cost()["index_bytes_per_token"] or self._index_bytes
        for pid, recs in groups.items():
            rewards = [r.reward for r in recs]
            self.store.add_group(prompt_key(_prompt_tokens(recs[0])), epoch, [r.token_ids for r in recs],
                                 None if any(x is None for x in rewards) else rewards)
        self.prop.carry_acceptance()

    def begin(self, rid, rec):
        self.prop.begin(rid, prompt_key(_prompt_tokens(rec)), group=f"{self._epoch}:{rec.prompt_id}",
                        prompt=rec.prompt_token_ids)

    def propose(self, rid, generated, max_len):
        return self.prop.propose(rid, generated, max_len).tokens

    def propose_step(self, items):
        return [d.tokens for d in self.prop.propose_step(items)]

    def observe_step(self, num_requests, num_scored_tokens, seconds, num_drafting_requests=None):
        self.prop.observe_step(num_requests, num_scored_tokens, seconds, num_drafting_requests)

    def feedback(self, rid, proposed, accepted):
        self.prop.feedback(rid, proposed, accepted)

    def end(self, rid, rec):
        self.prop.end(rid, rec.token_ids)

    def index_bytes_per_token(self):
        return self._index_bytes

    def extra(self) -> dict:
        st = self.prop.stats()
        out = {"index_build_us_per_token": self.store.build_cost()["index_build_us_per_token"],
               "steps_without_drafts_fraction": st["steps_without_drafts_fraction"]}
        for src in SOURCES:
            out[f"by_source/{src}/drafts"] = st[f"source/{src}/drafts"]
            out[f"by_source/{src}/accepted"] = st[f"source/{src}/accepted"]
            out[f"by_source/{src}/acceptance"] = st[f"source/{src}/accepted"] / max(1, st[f"source/{src}/proposed"])
        out.update(self.prop.calibration.counts())
        return out


class HindsightMethod(Method):
    """A ceiling, not a drafter: at each step, the longest continuation that agrees with the
    recorded response, of any occurrence of the request's last ``context`` tokens in
    everything a drafter in this engine could have seen (every earlier epoch's responses,
    this epoch's requests' tokens so far, finished ones whole, and the prompts), picked
    knowing the answer. A real drafter has to pick that continuation from the same text
    without the answer; the gap is what choosing costs, the ceiling what the text allows."""

    START = -1  # a response's virtual start marker, as the drafters' indexes have it

    def __init__(self, context: int):
        self.name = f"hindsight_context_{context}"
        self.m = context
        self._texts: list[list[int]] = []
        # (last ``m`` tokens) -> next token -> [(text, position of that next token)]
        self._index: dict[tuple, dict[int, list[tuple[int, int]]]] = {}
        self._req: dict[str, tuple[int, TraceRecord]] = {}

    def _append(self, tid: int, tokens) -> None:
        text, m, index = self._texts[tid], self.m, self._index
        for t in tokens:
            text.append(t)
            i = len(text) - 1
            if i >= m:
                index.setdefault(tuple(text[i - m:i]), {}).setdefault(t, []).append((tid, i))

    def _add_text(self, tokens) -> int:
        self._texts.append([])
        self._append(len(self._texts) - 1, tokens)
        return len(self._texts) - 1

    def observe(self, epoch, groups):
        if self._req:
            raise RuntimeError("an epoch ended with requests still running")
        if not self._texts:  # the first epoch; later ones were indexed as they were generated
            for recs in groups.values():
                for r in recs:
                    self._add_text([self.START, *r.token_ids])

    def begin(self, rid, rec):
        self._add_text(_prompt_tokens(rec))
        self._req[rid] = (self._add_text([self.START]), rec)

    def propose_step(self, items):
        # Every running request's new tokens are visible to all before anyone drafts.
        for rid, generated, _ in items:
            tid, _ = self._req[rid]
            self._append(tid, generated[len(self._texts[tid]) - 1:])
        out = []
        for rid, generated, max_len in items:
            tid, rec = self._req[rid]
            own, truth = self._texts[tid], rec.token_ids
            p = len(generated)
            best = 0
            if len(own) >= self.m and p < len(truth):
                for cand_tid, i in self._index.get(tuple(own[-self.m:]), {}).get(truth[p], ()):
                    text = self._texts[cand_tid]
                    k, stop = 0, min(max_len, len(text) - i, len(truth) - p)
                    while k < stop and text[i + k] == truth[p + k]:
                        k += 1
                    best = max(best, k)
            out.append(truth[p:p + best])
        return out

    def observe_step(self, num_requests, num_scored_tokens, seconds, num_drafting_requests=None):
        pass

    def end(self, rid, rec):
        tid, _ = self._req.pop(rid)
        self._append(tid, rec.token_ids[len(self._texts[tid]) - 1:])


# -- replay -------------------------------------------------------------------------------


@dataclasses.dataclass
class StepTime:
    """Modelled engine step time (seconds): the goodput rule's own step-cost model held at
    these costs (``goodput.StepCostModel.predict``), so the replay's clock and the plans
    priced against it are one formula. The defaults are the CPU prior, without its
    drafting-row term."""
    fixed: float = CPU_PRIOR.fixed_ms * 1e-3
    per_request: float = CPU_PRIOR.per_request_ms * 1e-3
    per_token: float = CPU_PRIOR.per_token_ms * 1e-3

    def __post_init__(self) -> None:
        self._model = StepCostModel(self.fixed, self.per_request, self.per_token)

    def __call__(self, num_requests: int, num_scored_tokens: int) -> float:
        return self._model.predict(num_requests, num_scored_tokens)


def simulate(method: Method, epochs: dict[int, dict[str, list[TraceRecord]]], max_len: int,
             cold: bool = False, step_time: Optional[StepTime] = None) -> dict:
    """Replay epochs >= 1 of a trace in engine order: each round drafts for every
    running request, verifies, feeds back, then retires finished requests.

    Drafting is timed per round with the thread's CPU clock (one clock pair per round,
    not per call), so the figure is the engine's per-step drafting cost and is not
    inflated by other processes sharing the CPU.
    """
    order = sorted(epochs)
    tokens = forwards = accepted = proposed = drafted = 0
    t_draft = 0.0
    step_time = step_time or StepTime()
    modelled_s = 0.0
    stepwise = hasattr(method, "propose_step")
    clock = time.thread_time
    if cold:
        order = order[:1]
    else:
        method.observe(order[0], epochs[order[0]])
    by_epoch_tf: dict[int, list[int]] = {}
    for ep in (order if cold else order[1:]):
        tok0, fwd0, s0 = tokens, forwards, modelled_s
        reqs = [(f"{ep}:{pid}:{r.sample_idx}", r) for pid, recs in sorted(epochs[ep].items()) for r in recs]
        for rid, rec in reqs:
            method.begin(rid, rec)
        pos = {rid: 0 for rid, _ in reqs}
        active = list(reqs)
        while active:
            gens = [rec.token_ids[:pos[rid]] for rid, rec in active]
            t0 = clock()
            if stepwise:
                drafts = method.propose_step([(rid, g, max_len) for (rid, _), g in zip(active, gens)])
            else:
                drafts = [method.propose(rid, g, max_len) for (rid, _), g in zip(active, gens)]
            t_draft += clock() - t0
            scored = len(active) + sum(len(d) for d in drafts)
            secs = step_time(len(active), scored)
            modelled_s += secs
            if stepwise:
                method.observe_step(len(active), scored, secs, sum(1 for d in drafts if d))
            acc = []
            for (rid, rec), draft in zip(active, drafts):
                rest = rec.token_ids[pos[rid]:]
                a = accepted_prefix(draft, rest)
                acc.append(a)
                forwards += 1
                proposed += len(draft)
                drafted += bool(draft)
                accepted += a
                pos[rid] += min(a + 1, len(rest))
            t0 = clock()
            for (rid, _), draft, a in zip(active, drafts, acc):
                method.feedback(rid, len(draft), a)
            t_draft += clock() - t0
            still = []
            for rid, rec in active:
                if pos[rid] >= len(rec.token_ids):
                    tokens += len(rec.token_ids)
                    method.end(rid, rec)
                else:
                    still.append((rid, rec))
            active = still
        by_epoch_tf[ep] = [tokens - tok0, forwards - fwd0, modelled_s - s0]
        method.observe(ep, epochs[ep])
    return {
        "tokens_per_forward_by_epoch": {str(e): round(t / max(1, f), 4) for e, (t, f, _) in by_epoch_tf.items()},
        "modelled_step_time_s_by_epoch": {str(e): s for e, (_, _, s) in by_epoch_tf.items()},
        "tokens_per_forward": tokens / max(1, forwards),
        "mean_accepted_len": accepted / max(1, forwards),
        "acceptance_rate": accepted / max(1, proposed),
        "draft_tokens_per_forward": proposed / max(1, forwards),
        "drafted_fraction": drafted / max(1, forwards),
        "draft_us_per_token": 1e6 * t_draft / max(1, tokens),
        "draft_us_per_call": 1e6 * t_draft / max(1, forwards),
        "index_kb_per_1k_tokens": method.index_bytes_per_token(),
        "generated_tokens": tokens,
        "forwards": forwards,
        "modelled_step_time_s": modelled_s,
        **method.extra(),
    }


def _finish(m: dict, verify_cost: float) -> dict:
    m["modelled_speedup"] = m["tokens_per_forward"] / (1.0 + verify_cost * m["draft_tokens_per_forward"])
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in m.items()}


def time_tiny_forward(batch: int, draft_tokens: int, context: int = 128) -> Optional[dict]:
    """Median time of one batched step of the tiny model (torch, KV cache, eager HF):
    a plain decode step (1 token per request) and a verification step (1 + draft_tokens)."""
    try:
        import torch
        import transformers
    except Exception:
        return None
    from rhymerl.models.tiny import TinyShape

    t = TinyShape()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=384, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                                   num_hidden_layers=t.num_hidden_layers, num_attention_heads=t.num_attention_heads,
                                   num_key_value_heads=t.num_key_value_heads, max_position_embeddings=t.max_position_embeddings)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 384, (batch, context))

    def median_step(width: int) -> float:
        times = []
        with torch.inference_mode():
            for _ in range(8):
                past = transformers.DynamicCache()
                model(ids, past_key_values=past, use_cache=True)
                step = torch.randint(0, 384, (batch, width))
                # CPU time of the process (all torch threads), like the drafting figures,
                # so other processes sharing the CPU do not skew the ratio.
                t0 = time.process_time()
                model(step, past_key_values=past, use_cache=True)
                times.append(time.process_time() - t0)
        times = sorted(times[1:])  # the first call warms up kernels and allocator
        return 1e6 * times[len(times) // 2]

    return {"batch": batch, "context": context, "decode_forward_us": median_step(1),
            "verify_forward_us": median_step(1 + draft_tokens), "torch_threads": torch.get_num_threads()}


BUILD_US_TARGET = 1.0
BYTES_TARGET = 40


def index_build_cost(epochs: dict[int, dict[str, list[TraceRecord]]]) -> dict:
    """Per-prompt history index build cost over every epoch's groups: CPU time and resident
    size per history token, for the store's index and (when installed) arctic-inference's
    compiled SuffixTree, plus what the store itself keeps per token (int32 ids)."""
    groups = [[r.token_ids for r in recs] for ep in sorted(epochs) for recs in epochs[ep].values()]
    ntok = sum(len(t) for g in groups for t in g)
    store = HistoryStore(dataclasses.replace(HistoSpecConfig(), token_budget=max(1, ntok)))
    for i, g in enumerate(groups):
        store.add_group(i, 0, g)
    store.prebuild(range(len(groups)), background=False)
    c = store.build_cost()
    out = {"history_tokens": ntok, "store_bytes_per_token": c["stored_bytes_per_token"],
           "suffix_automaton": {"build_us_per_token": round(c["index_build_us_per_token"], 3),
                                "bytes_per_token": round(c["index_bytes_per_token"], 1), "builder": c["index_builder"]}}
    try:
        from arctic_inference.suffix_decoding._C import SuffixTree
    except ImportError:
        return out
    t0 = time.thread_time()
    trees = []
    for g in groups:
        tree = SuffixTree(64)
        for j, t in enumerate(g):
            tree.extend(j, t)
        trees.append(tree)
    dt = time.thread_time() - t0
    out["arctic_suffix_tree_depth64"] = {"build_us_per_token": round(1e6 * dt / max(1, ntok), 3),
                                         "bytes_per_token": round(sum(t.estimate_memory() for t in trees) / max(1, ntok), 1)}
    return out


def _table(title: str, rows: dict[str, dict], cols: list[str]) -> str:
    w = max(len(k) for k in rows) + 2
    lines = [title, "".ljust(w) + "".join(c[:18].rjust(19) for c in cols)]
    for k, m in rows.items():
        lines.append(k.ljust(w) + "".join(f"{m[c]:19.3f}" if isinstance(m.get(c), float) else f"{m.get(c, '-'):>19}"
                                          for c in cols))
    return "\n".join(lines)


COLS = ["tokens_per_forward", "mean_accepted_len", "acceptance_rate", "draft_tokens_per_forward",
        "draft_us_per_token", "draft_us_per_call", "index_kb_per_1k_tokens", "modelled_wall_speedup"]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks histospec", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--trace", help="JSONL rollout trace (rhymerl/outputs/traces.py format) instead of the synthetic one")
    ap.add_argument("--similarity", type=float, default=0.85, help="synthetic: fraction of tokens copied from last epoch")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--n", type=int, default=8, help="synthetic: responses per prompt")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--mean-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-len", type=int, default=16, help="draft tokens per step the engine allows (num_speculative_tokens)")
    ap.add_argument("--verify-cost", type=float, default=0.05,
                    help="cost of one extra verified token relative to a decode step (modelled_speedup)")
    ap.add_argument("--costs", choices=PRESETS, default="cpu",
                    help="the modelled engine's step costs, which the goodput rule also plans with: the CPU prior, or "
                    "a shipped GPU config's engine on H100s as it derives them (benchmarks/roofline.py); --step-* "
                    "override single terms. A drafting row is charged nothing of its own in this replay")
    ap.add_argument("--step-fixed-ms", type=float, help="modelled engine step: fixed cost (ms)")
    ap.add_argument("--step-per-request-ms", type=float, help="modelled engine step: cost per request (ms)")
    ap.add_argument("--step-per-token-ms", type=float, help="modelled engine step: cost per scored token (ms)")
    ap.add_argument("--ablations", choices=["none", "quick", "full"], default="quick")
    ap.add_argument("--no-forward-timing", action="store_true", help="skip timing the tiny model's forward (no torch import)")
    ap.add_argument("--acceptance-carry", type=float, default=DRAFTING.acceptance_carry,
                    help="weight the acceptance HistoSpec learnt in earlier epochs keeps at each replayed epoch, as at "
                    "each of the trainer's rollouts (0 = the prior again, 1 = all kept)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    base_costs = preset(args.costs)
    costs = dataclasses.replace(
        base_costs, per_drafting_request_ms=0.0,
        fixed_ms=base_costs.fixed_ms if args.step_fixed_ms is None else args.step_fixed_ms,
        per_request_ms=base_costs.per_request_ms if args.step_per_request_ms is None else args.step_per_request_ms,
        per_token_ms=base_costs.per_token_ms if args.step_per_token_ms is None else args.step_per_token_ms)
    for flag, v in (("--step-fixed-ms", costs.fixed_ms), ("--step-per-request-ms", costs.per_request_ms)):
        if not v >= 0:
            print(f"benchmarks histospec: {flag} must be >= 0 (got {v})", file=sys.stderr)
            return 2
    if not costs.per_token_ms > 0:
        print(f"benchmarks histospec: --step-per-token-ms must be > 0 (got {costs.per_token_ms})", file=sys.stderr)
        return 2
    if not 0.0 <= args.acceptance_carry <= 1.0:
        print(f"benchmarks histospec: --acceptance-carry must be in [0, 1] (got {args.acceptance_carry})",
              file=sys.stderr)
        return 2

    if args.trace:
        records = read_trace(args.trace)
        source = {"trace": args.trace}
    else:
        records = synthetic_trace(num_prompts=args.prompts, n=args.n, epochs=args.epochs, similarity=args.similarity,
                                  mean_len=args.mean_len, seed=args.seed)
        source = {"synthetic": {"prompts": args.prompts, "n": args.n, "epochs": args.epochs,
                                "similarity": args.similarity, "mean_len": args.mean_len, "seed": args.seed}}
    epochs = by_epoch(records)
    if len(epochs) < 2:
        print(f"benchmarks histospec: the trace needs at least 2 epochs (got {sorted(epochs)})", file=sys.stderr)
        return 2

    cfg = HistoSpecConfig()
    drafting = dataclasses.replace(DRAFTING, acceptance_carry=args.acceptance_carry)
    step_time = StepTime(costs.fixed_ms * 1e-3, costs.per_request_ms * 1e-3, costs.per_token_ms * 1e-3)
    none_s: list[float] = []

    def run(method: Method, max_len: int = args.max_len) -> dict:
        m = simulate(method, epochs, max_len, step_time=step_time)
        if not none_s:
            none_s.append(m["modelled_step_time_s"])
        # Rollout wall time under the step-time model, none / method (> 1 = faster).
        m["modelled_wall_speedup"] = none_s[0] / max(1e-12, m["modelled_step_time_s"])
        return _finish(m, args.verify_cost)

    done: dict[tuple, dict] = {}

    def hs(c: HistoSpecConfig = cfg, d: Drafting = drafting, step_costs: StepCosts = costs) -> dict:
        # Ablation rows equal to an already measured configuration reuse its figures.
        key = (dataclasses.astuple(c), d, step_costs)
        if key not in done:
            done[key] = run(HistoSpecMethod(c, "histospec", step_costs, d))
        return dict(done[key])

    methods = {
        "none": run(Method()),
        "ngram": run(NgramMethod(2, 5)),
        "suffix": run(_suffix_method(args.max_len)),
        "histospec_chain": hs(),
    }
    methods["ngram"]["params"] = "prompt_lookup_min=2, prompt_lookup_max=5 (vLLM default 5/5 in ablations)"
    calib_counts = {k: v for k, v in methods["histospec_chain"].items() if k.startswith("calibration/")}
    for m in methods.values():
        for k in calib_counts:
            m.pop(k, None)

    # The trace's first epoch alone, with no history at all: what the group and cross-prompt
    # sources give before any epoch has finished.
    first: dict[str, dict] = {}
    first_none: list[float] = []
    for label, method in (("none", Method()), ("ngram", NgramMethod(2, 5)), ("suffix", _suffix_method(args.max_len)),
                          ("histospec_chain", HistoSpecMethod(cfg, "first", costs, drafting))):
        m = simulate(method, epochs, args.max_len, cold=True, step_time=step_time)
        if not first_none:
            first_none.append(m["modelled_step_time_s"])
        m["modelled_wall_speedup"] = first_none[0] / max(1e-12, m["modelled_step_time_s"])
        first[label] = {k: v for k, v in _finish(m, args.verify_cost).items() if not k.startswith("calibration/")}
    methods["suffix"]["params"] = ("vLLM suffix via arctic-inference: " if isinstance(_suffix_method(1), ArcticSuffixMethod)
                                   else "re-implementation (arctic-inference not installed): ") + \
        "max_tree_depth 24, max_spec_factor 1, min_token_prob 0.1"

    ablations: dict[str, dict[str, dict]] = {}
    if args.ablations != "none":
        def hd(**kw) -> dict:
            return hs(d=dataclasses.replace(drafting, **kw))

        # Which source contributes what: each alone, and all but one.
        srcs = {f"only_{s}": hd(sources=(s,)) for s in SOURCES}
        for s in SOURCES:
            srcs[f"without_{s}"] = hd(sources=tuple(x for x in SOURCES if x != s))
        srcs["all"] = hs()
        ablations["sources"] = srcs
        ablations["epochs_kept"] = {f"epochs_kept_{k}": hs(dataclasses.replace(cfg, epochs_kept=k)) for k in (1, 2, 3, 4)}
        # SuffixDecoding ties a draft's length to its match's (max_spec_factor 1); whether that
        # pays depends on a draft token's price.
        ablations["match_length_factor"] = {f"match_length_factor_{f:g}": hd(match_length_factor=f)
                                            for f in (0.0, 1.0, 2.0)}
        # A short match in a small index looks certain; scaling sources' chains by L / (L + K)
        # when they are compared lets a longer match elsewhere win.
        ablations["match_confidence_tokens"] = {
            f"match_confidence_tokens_{k:g}": hd(match_confidence_tokens=k) for k in (0.0, 1.0, 2.0, 4.0)}
        ablations["match_confidence_tokens"]["match_confidence_tokens_0_length_factor_0"] = hd(
            match_confidence_tokens=0.0, match_length_factor=0.0)
        ablations["ngram_params"] = {"ngram[5,5] (vLLM default)": run(NgramMethod(5, 5))}
        # What the text allows: the best continuation, picked knowing the answer, of the last
        # one or two tokens anywhere a drafter could have looked (chains of at most --max-len),
        # beside HistoSpec's chains drafted whole (drafts priced at almost nothing).
        free = StepCosts(fixed_ms=1e3, per_request_ms=0.0, per_token_ms=1e-6)
        ablations["hindsight_ceiling"] = {
            "histospec_chain (goodput)": dict(methods["histospec_chain"]),
            "histospec_chain, every chain whole": hs(step_costs=free),
            **{f"hindsight, last {c} token{'s' if c > 1 else ''}": run(HindsightMethod(c)) for c in (1, 2)}}
        # Does the rule plan at the right prices? Drafts planned at scaled draft-token prices, or
        # with another acceptance prior, against the same modelled clock: the defaults should be
        # within a few % of the best of them.
        scaled = {}
        for f in (0.5, 0.7, 1.0, 1.4, 2.0):
            plan_at = dataclasses.replace(costs, per_token_ms=costs.per_token_ms * f)
            scaled[f"draft_price_x{f:g}"] = hs(step_costs=plan_at)
        for prior in (0.5, 0.6, 0.8, 0.9):
            scaled[f"acceptance_prior_{prior:g}"] = hd(acceptance_prior=prior)
        ablations["rule_scaling"] = scaled
        if args.ablations == "full":
            ablations["match_window"] = {f"match_window_{w}": hd(match_window=w) for w in (3, 5, 7, 12)}
            ablations["min_prob"] = {f"min_prob_{p}": hd(min_prob=p) for p in (0.0, 0.1, 0.3)}

    # Drafting cost vs a target forward: one decode step drafts for every running request.
    batch = 32
    chain = methods["histospec_chain"]
    k = max(1, round(chain["draft_tokens_per_forward"]))
    fwd = None if args.no_forward_timing else time_tiny_forward(batch, k)
    per_call = chain["draft_us_per_call"]
    cost = {"batch": batch, "draft_us_per_step": round(per_call * batch, 2),
            "draft_us_per_call": per_call, "draft_us_per_token": chain["draft_us_per_token"]}
    if fwd is not None:
        cost.update(tiny_decode_forward_us=round(fwd["decode_forward_us"], 1),
                    tiny_verify_forward_us=round(fwd["verify_forward_us"], 1), verify_width=1 + k,
                    torch_threads=fwd["torch_threads"],
                    draft_fraction_of_decode_forward=round(per_call * batch / fwd["decode_forward_us"], 4),
                    draft_fraction_of_verify_forward=round(per_call * batch / fwd["verify_forward_us"], 4))
    else:
        why = "skipped (--no-forward-timing)" if args.no_forward_timing else "torch not importable"
        cost["note"] = f"tiny-model forward timing {why}: compare draft_us_per_step with the forward time in `bench rollout`"

    order_ok = (methods["histospec_chain"]["tokens_per_forward"] >= methods["suffix"]["tokens_per_forward"]
                >= methods["ngram"]["tokens_per_forward"] >= 1.0)
    history_index = index_build_cost(epochs)
    calib_rows = draft_calibration.table(calib_counts)
    result = {"methods": methods, "first_epoch": first, "ablations": ablations, "cost": cost, "source": source,
              "calibration": {"buckets": calib_rows, "min_tokens": draft_calibration.MIN_TOKENS,
                              "worst_gap": round(draft_calibration.worst_gap(calib_counts), 4),
                              "target_gap": draft_calibration.TARGET_GAP,
                              "over_target": draft_calibration.count_over(calib_counts),
                              "over_target_by_chance": round(draft_calibration.chance_over(calib_counts), 3)},
              "history_index": history_index,
              "ordering_chain>=suffix>=ngram>=1": order_ok,
              "step_costs": dataclasses.asdict(costs) | {"preset": args.costs},
              "histospec_settings": {**dataclasses.asdict(cfg), **dataclasses.asdict(drafting)},
              "wall_s": round(time.perf_counter() - t_start, 2)}

    if "rule_scaling" in ablations:
        rows = ablations["rule_scaling"]
        best = max(rows, key=lambda k: rows[k]["modelled_wall_speedup"])
        own = methods["histospec_chain"]["modelled_wall_speedup"]
        result["rule_scaling"] = {"defaults": own, "best": best, "best_speedup": rows[best]["modelled_wall_speedup"],
                                  "defaults_over_best": round(own / rows[best]["modelled_wall_speedup"], 4)}
    print(_table("HistoSpec offline replay (greedy-exact; identical for sampled one-hot drafts)", methods, COLS), file=sys.stderr)
    print("", file=sys.stderr)
    print(_table("first epoch alone, no history (modelled speedup against none's first epoch)", first, COLS),
          file=sys.stderr)
    print("", file=sys.stderr)
    cal = result["calibration"]
    print(_table(f"histospec_chain: predicted against realised acceptance of verified draft positions (worst gap "
                 f"{cal['worst_gap']:.3f} over buckets of >= {draft_calibration.MIN_TOKENS}; {cal['over_target']} "
                 f"more than {cal['target_gap']} off, where a calibrated rule would be by chance in "
                 f"{cal['over_target_by_chance']:.2f})",
                 {r["bucket"]: r for r in calib_rows}, ["tokens", "predicted", "realised", "gap", "standard_error"]),
          file=sys.stderr)
    for name, rows in ablations.items():
        print("", file=sys.stderr)
        print(_table(f"ablation: {name}", rows, COLS), file=sys.stderr)
    chain = methods["histospec_chain"]
    by_src = {src: {"drafts": chain[f"by_source/{src}/drafts"],
                    "accepted_per_forward": chain[f"by_source/{src}/accepted"] / max(1, chain["forwards"]),
                    "acceptance_rate": chain[f"by_source/{src}/acceptance"]} for src in SOURCES}
    result["histospec_chain_by_source"] = by_src
    print("", file=sys.stderr)
    print(_table("histospec_chain by draft source (tokens per forward = 1 + sum of accepted_per_forward)", by_src,
                 ["drafts", "accepted_per_forward", "acceptance_rate"]), file=sys.stderr)
    print(f"\nhistory index build (targets <= {BUILD_US_TARGET} us and <= {BYTES_TARGET} B per history token): "
          f"{json.dumps(history_index)}", file=sys.stderr)
    print(f"\ndrafting cost: {json.dumps(cost)}\nordering chain>=suffix>=ngram>=1: {order_ok}"
          f"\nwall {result['wall_s']} s", file=sys.stderr)
    if "rule_scaling" in result:
        print(f"rule scaling: the defaults reach {result['rule_scaling']['defaults_over_best']:.3f} of the best "
              f"alternative ({result['rule_scaling']['best']})", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
