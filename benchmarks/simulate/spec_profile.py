"""HistoSpec's speed by response position, measured by replaying a rollout trace through
the real draft proposer, for the cluster simulator.

Each epoch >= 1 of the trace is replayed in engine order against a history store holding
the earlier epochs: the epoch's requests are all in flight and each step the proposer
drafts for all of them in one call; each draft is checked against the recorded tokens
(exact-match acceptance, what a greedy or lossless verifier emits for the recorded sample)
and the forward emits accepted + 1 tokens. The proposer's CPU time per request per step is
measured on the way. Forwards are
bucketed by the position they start at, so a long response's speed follows how far its
history match carries, not one global mean.
"""

from __future__ import annotations

import json
import math
import time
from bisect import bisect_right
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from rhymerl.histospec.step_costs import CPU_PRIOR, StepCosts, roofline_costs

# Bucket edges in tokens (the last bucket is open-ended).
EDGES = (0, 64, 256, 1024, 4096)


@dataclass
class SpecProfile:
    edges: list[int]
    tokens_per_forward: list[float]  # per bucket
    draft_tokens_per_forward: list[float]  # per bucket: verified draft tokens per forward
    source: str
    # CPU seconds the proposer spends per request per engine step (drafting and feedback),
    # measured on the host that replayed the trace. vLLM drafts between two forwards, so a
    # step of B speculating requests waits B times this; 0 = not measured.
    proposer_s_per_request: float = 0.0

    def per_request(self, lengths) -> tuple[np.ndarray, np.ndarray]:
        """Per response: mean tokens per forward over its positions, and mean draft tokens
        verified per forward (forward-weighted)."""
        L = np.asarray(lengths, dtype=float)
        fwd = np.zeros_like(L)
        drafted = np.zeros_like(L)
        bounds = list(self.edges[1:]) + [math.inf]
        for lo, hi, tpf, dpf in zip(self.edges, bounds, self.tokens_per_forward, self.draft_tokens_per_forward):
            toks = np.clip(L - lo, 0, hi - lo)
            f = toks / max(1.0, tpf)
            fwd += f
            drafted += f * dpf
        fwd = np.maximum(fwd, 1.0)
        return L / fwd, drafted / fwd

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SpecProfile":
        try:
            p = cls([int(x) for x in d["edges"]], [float(x) for x in d["tokens_per_forward"]],
                    [float(x) for x in d["draft_tokens_per_forward"]], str(d["source"]),
                    float(d.get("proposer_s_per_request", 0.0)))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"speculation profile: missing or ill-typed field ({e})") from None
        if not (len(p.edges) == len(p.tokens_per_forward) == len(p.draft_tokens_per_forward)) or p.edges[0] != 0:
            raise ValueError("speculation profile: edges, tokens_per_forward and draft_tokens_per_forward must align, edges[0] = 0")
        if any(t < 1.0 for t in p.tokens_per_forward):
            raise ValueError("speculation profile: tokens_per_forward must be >= 1")
        if not p.proposer_s_per_request >= 0.0:
            raise ValueError("speculation profile: proposer_s_per_request must be >= 0")
        return p


def measure(trace: str | Path, costs: StepCosts = CPU_PRIOR, max_len: int = 16, edges=EDGES, repeats: int = 1,
            host: str = "the replaying host", pricing: str = "") -> SpecProfile:
    """Replay ``trace`` through the HistoSpec proposer, drafts priced at ``costs``.

    The drafts are the same in every replay; the proposer's CPU time is the median of
    ``repeats`` replays on ``host``. ``pricing`` says what the drafts were priced at."""
    from rhymerl.config import HistoSpecConfig
    from rhymerl.histospec import DraftProposer, HistoryStore, prompt_key
    from rhymerl.histospec.acceptance import accepted_prefix
    from rhymerl.outputs.traces import TraceError, by_epoch, read_trace

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    cfg = HistoSpecConfig()
    ep = by_epoch(read_trace(trace))
    order = sorted(ep)
    if len(order) < 2:
        raise TraceError(f"{trace}: a speculation profile needs at least two epochs (history, then replay)")
    nb = len(edges)

    def key_of(rec):
        return prompt_key(rec.prompt_token_ids if rec.prompt_token_ids is not None else [hash(rec.prompt_id) & 0x7FFFFFFF])

    def replay():
        store = HistoryStore(cfg)
        prop = DraftProposer(store, cfg, costs)
        toks = np.zeros(nb)
        fwds = np.zeros(nb)
        drafted = np.zeros(nb)

        def add(e):
            for pid, recs in ep[e].items():
                store.add_group(key_of(recs[0]), e, [r.token_ids for r in recs])

        add(order[0])
        proposer_s = 0.0
        for e in order[1:]:
            # The engine's order: the epoch's requests all in flight, one proposer call per step.
            active = []
            for pid, recs in sorted(ep[e].items()):
                for r in recs:
                    rid = f"{e}:{pid}:{r.sample_idx}"
                    prop.begin(rid, key_of(r), group=f"{e}:{pid}")
                    active.append([rid, r.token_ids, 0])
            while active:
                t0 = time.perf_counter()
                drafts = prop.propose_step([(rid, seq[:pos], max_len) for rid, seq, pos in active])
                proposer_s += time.perf_counter() - t0
                still = []
                for item, d in zip(active, drafts):
                    rid, seq, pos = item
                    a = accepted_prefix(d.tokens, seq[pos:])
                    t0 = time.perf_counter()
                    prop.feedback(rid, len(d.tokens), a)
                    proposer_s += time.perf_counter() - t0
                    k = bisect_right(edges, pos) - 1  # the bucket holding position pos
                    step = min(a + 1, len(seq) - pos)
                    toks[k] += step
                    fwds[k] += 1
                    drafted[k] += len(d.tokens)
                    item[2] = pos + step
                    if item[2] < len(seq):
                        still.append(item)
                    else:
                        prop.end(rid, seq)
                active = still
            add(e)
        return toks, fwds, drafted, proposer_s / max(1.0, float(fwds.sum()))

    runs = [replay() for _ in range(repeats)]
    toks, fwds, drafted, _ = runs[0]
    per_request = sorted(r[3] for r in runs)[repeats // 2]
    # Buckets the trace never reached take the last measured bucket's figures.
    tpf, dpf = [], []
    for k in range(nb):
        if fwds[k]:
            tpf.append(float(toks[k] / fwds[k]))
            dpf.append(float(drafted[k] / fwds[k]))
        else:
            tpf.append(tpf[-1] if tpf else 1.0)
            dpf.append(dpf[-1] if dpf else 0.0)
    measured = int((fwds > 0).sum())
    note = "" if measured == nb else (f"; positions >= {edges[measured]} not in the trace, extrapolated from "
                                      f"positions {edges[measured - 1]}..{edges[measured] - 1}")
    how = f", median of {repeats} replays" if repeats > 1 else ""
    return SpecProfile(list(edges), tpf, dpf, f"HistoSpec replay of {Path(trace).name} ({int(toks.sum())} tokens, "
                       f"{len(order) - 1} replayed epochs, max draft {max_len}{note}; proposer "
                       f"{1e6 * per_request:.0f} us per request per step{how} on {host}){pricing}", per_request)


def measure_for_engine(trace: str | Path, cost, context_tokens: float, repeats: int = 1,
                       host: str = "the replaying host") -> SpecProfile:
    """``measure`` with drafts priced at the simulated engine's step costs (``cost``: the
    calibration's ``DecodeCostModel``), as an engine on that device prices them
    (``rhymerl.histospec.device_costs``)."""
    prior = roofline_costs(cost, context_tokens)
    pricing = (f"; drafts priced at this engine's roofline at a {int(context_tokens)}-token context "
               f"({prior.fixed_ms} ms + {prior.per_request_ms} ms per request + "
               f"{prior.per_token_ms} ms per scored token)")
    return measure(trace, prior, repeats=repeats, host=host, pricing=pricing)


def load(path: Optional[str | Path]) -> Optional[SpecProfile]:
    if path is None:
        return None
    d = json.loads(Path(path).read_text())
    return SpecProfile.from_dict(d.get("speculation", d))


def main(argv: Optional[list[str]] = None) -> int:
    import argparse
    import os
    import platform
    import sys

    from rhymerl.histopipe import calibration
    from rhymerl.outputs.traces import TraceError
    from benchmarks.simulate.workload import DEFAULT_MAX_TOKENS, DEFAULT_PROMPT_LEN

    ap = argparse.ArgumentParser(prog="python -m benchmarks.simulate.spec_profile",
                                 description="Measure HistoSpec's speed by response position on a rollout trace, "
                                 "for the cluster simulator's projection.")
    ap.add_argument("trace", help="rollout trace JSONL with at least two epochs")
    ap.add_argument("--calibration", default=None, help="cost-model calibration JSON (default: the shipped roofline file)")
    ap.add_argument("--context", type=float, default=DEFAULT_PROMPT_LEN + DEFAULT_MAX_TOKENS / 2,
                    help="a typical row's context in tokens, for the drafts' prices (default: the simulator's "
                    "default prompt plus half its default max tokens)")
    ap.add_argument("--repeats", type=int, default=5, help="replays; the proposer time is their median")
    ap.add_argument("--write", action="store_true", help="store the profile as the calibration file's speculation section")
    args = ap.parse_args(argv)
    try:
        cost, source, whole = calibration.load(args.calibration)
        prof = measure_for_engine(args.trace, cost, args.context, args.repeats,
                                  host=f"a {os.cpu_count()}-core {platform.machine()} host")
    except (ValueError, TraceError, OSError) as e:
        print(f"spec_profile: {e}", file=sys.stderr)
        return 2
    print(json.dumps(prof.to_dict(), indent=1))
    if args.write:
        extra = {k: v for k, v in whole.items() if k not in ("source", "cost")}
        extra["speculation"] = prof.to_dict()
        calibration.save(args.calibration or calibration.DEFAULT, cost, source, extra)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
