"""The goodput rule's step-cost prior, measured: ``bench step --calibrate``.

HistoSpec plans drafts with a step-time model, seconds = fixed + (per_request + per_token) x R
+ per_token x D + per_drafting_request x N, for a decode step of R requests of which N carry
D draft tokens in all (``goodput.StepCostModel``). With ``step_cost: measured`` the engine
refits it as it runs; ``step_cost: prior`` (the default: resumed sampled runs replay token
for token) plans with its device kind's prior (``rhymerl/histospec/step_costs.py``'s
``CPU_PRIOR`` on a CPU), which this measures.

One engine, greedy decoding, drafts from the history alone with a fixed length: the history
holds an untimed pass over the first N of the R prompts, so exactly those requests draft and
their drafts are the tokens the engine writes. Each decode step's (R, D, N, seconds) is taken
where the engine reports it to the proposer (prefill steps excluded, as in the live fit), over
a grid of requests, drafting shares and draft lengths, and fitted by the engine's own fit
(``StepCostModel``) without its prior. The draft token's price by batch size (each drafted
step's excess over the fit without drafts, per draft token) shows whether one price per
draft token holds at every batch size, as the model assumes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

from rhymerl.histospec.goodput import StepCostModel
from rhymerl.histospec.proposer import DRAFTING, Draft, DraftProposer
from rhymerl.histospec.step_costs import StepCosts

# Drafting shares of the requests and draft lengths each batch size is measured at (up to the
# shipped configs' 8 draft tokens: longer drafts are longer verification queries).
GRID = ((0.0, 0), (0.5, 1), (0.5, 4), (1.0, 2), (1.0, 8))
# Batch sizes whose draft prices are pooled in the price-by-rows table.
PRICE_BUCKETS = ((1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 1 << 30))


@dataclasses.dataclass
class StepRow:
    requests: int
    draft_tokens: int
    drafting_requests: int
    seconds: float


def _fitted(rows: Sequence[StepRow]) -> StepCostModel:
    """The engine's own step-cost fit (``goodput.StepCostModel``: the basis (1, R, D, N),
    relative errors, non-negative costs) over ``rows``, with no prior weight, decay or
    warm-up: the measured steps alone."""
    # The prior only seeds the ridge terms, weighted 1e-9 of a step; its draft/row ratio
    # (1/2) stands in for the draft columns of steps that never drafted.
    model = StepCostModel(1.0, 1.0, 1.0, prior_steps=1e-9, decay=1.0, warmup=0)
    for r in rows:
        model.observe_step(r.requests, r.requests + r.draft_tokens, r.seconds, r.drafting_requests)
    return model


def fit_step_costs(rows: Iterable[StepRow]) -> dict:
    """The step-cost model's coefficients (ms) from measured decode steps, as ``StepCosts``
    states them, with the fit's relative error and the draft price by batch size."""
    rows = [r for r in rows if r.requests > 0 and r.seconds > 0]
    drafted = [r for r in rows if r.draft_tokens > 0]
    if len({r.requests for r in rows}) < 2 or len(drafted) < 4 or len(rows) < 8:
        raise ValueError("calibration needs decode steps at two batch sizes or more, some of them with drafts "
                         f"(got {len(rows)} steps, {len(drafted)} with drafts)")
    model = _fitted(rows)
    fixed, per_request, per_token, per_drow = model.coef
    # Without drafts: the base every drafted step's excess is measured from.
    plain = [r for r in rows if r.draft_tokens == 0]
    base = None
    if len({r.requests for r in plain}) >= 2:
        c = _fitted(plain).coef
        base = (c[0], c[1] + c[2])
    price = []
    for lo, hi in PRICE_BUCKETS:
        sel = [r for r in drafted if lo <= r.requests <= hi]
        if base is None or not sel:
            continue
        excess = sum(r.seconds - (base[0] + base[1] * r.requests) for r in sel)
        price.append({"requests": f"{lo}-{hi}" if hi < 1 << 30 else f"{lo}+", "steps": len(sel),
                      "draft_tokens_per_step": sum(r.draft_tokens for r in sel) / len(sel),
                      "ms_per_draft_token": 1e3 * excess / sum(r.draft_tokens for r in sel)})
    notes = []
    if per_request == 0.0:
        notes.append("a draft token fitted dearer than a row: per_request clamped to 0")
    if per_drow == 0.0:
        notes.append("a drafting row fitted at no cost or less beyond its tokens: clamped to 0")
    keys = {"fixed_ms": 1e3 * fixed, "per_request_ms": 1e3 * per_request, "per_token_ms": 1e3 * per_token,
            "per_drafting_request_ms": 1e3 * per_drow}
    return {"keys": keys, "per_row_ms": 1e3 * (per_request + per_token), "relative_rms_error": model.relative_error,
            "steps": len(rows), "steps_with_drafts": len(drafted), "no_draft_fit_ms": None if base is None else
            {"fixed": 1e3 * base[0], "per_request": 1e3 * base[1]}, "draft_price_by_requests": price, "notes": notes}


def prior(keys: dict) -> str:
    """The fitted costs as the ``StepCosts`` a device's prior is written as."""
    return "StepCosts(" + ", ".join(f"{k}={v:.4g}" for k, v in keys.items()) + ")"


def table(out: dict) -> str:
    k = out["keys"]
    lines = [f"step-cost calibration: {out['model']}, greedy, {out['tokens']} tokens per request, threads={out['threads']}: "
             f"{out['steps']} decode steps ({out['steps_with_drafts']} with drafts), relative rms error "
             f"{out['relative_rms_error']:.3f}",
             f"  a step {k['fixed_ms']:.2f} ms + a row {out['per_row_ms']:.2f} ms + a draft token "
             f"{k['per_token_ms']:.2f} ms + a drafting row {k['per_drafting_request_ms']:.2f} ms "
             "beyond its tokens"]
    if out["draft_price_by_requests"]:
        lines.append("  a draft token's price by requests in the step (excess over the fit without drafts): " + "  ".join(
            f"{b['requests']}: {b['ms_per_draft_token']:.2f} ms ({b['draft_tokens_per_step']:.1f} a step)"
            for b in out["draft_price_by_requests"]))
    lines += [f"  note: {n}" for n in out["notes"]]
    lines.append(f"  prior: {prior(k)}")
    return "\n".join(lines)


def measure(args: Any) -> list[StepRow]:
    """Every timed decode step of the calibration grid on one engine (see the module doc)."""
    from rhymerl.config import HistoSpecConfig, ModelConfig, RolloutConfig
    from rhymerl.histospec import HistoryStore
    from rhymerl.models import resolve_model
    from benchmarks.rollout import _prompts
    from rhymerl.rollout import RolloutEngine, SamplingSpec

    model_dir = resolve_model(ModelConfig(path=args.model))
    top = max(args.sizes)
    # Distinct prompts: one prompt's history must not draft for another request.
    prompts = _prompts(model_dir, top, distinct=True)
    base = HistoSpecConfig()
    cfg = RolloutConfig(speculative="histospec", n=1, temperature=0.0, max_tokens=args.tokens, num_speculative_tokens=8,
                        max_num_seqs=max(64, top), max_model_len=1024)
    engine = RolloutEngine(cfg, base, model_dir, seed=args.seed)
    engine._DraftProposer = FixedLengthProposer
    rows: list[StepRow] = []
    sampling = SamplingSpec(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    try:
        engine.generate(prompts[:2], 1, SamplingSpec(temperature=0.0, max_tokens=4), record_history=False)  # warm-up
        for _ in range(args.repeats):
            for size in args.sizes:
                for share, length in GRID:
                    drafting = min(size, max(1, round(share * size))) if share > 0 else 0
                    FixedLengthProposer.length = max(1, length)
                    engine.set_history(HistoryStore(base, vocab_size=engine.vocab_size))
                    if drafting:  # untimed: the history the first ``drafting`` requests draft from
                        engine.generate(prompts[:drafting], 1, sampling, epoch=0)
                    # Where the engine reports each decode step to its proposer: the steps the live fit sees.
                    core = engine._core
                    observe = core.observe_step

                    def record(num_requests, num_scored_tokens, seconds, num_drafting_requests=None, _o=observe):
                        rows.append(StepRow(num_requests, num_scored_tokens - num_requests,
                                            num_drafting_requests or 0, seconds))
                        return _o(num_requests, num_scored_tokens, seconds, num_drafting_requests)

                    core.observe_step = record
                    engine.generate(prompts[:size], 1, sampling, epoch=1, record_history=False)
    finally:
        engine.shutdown()
    return rows


class FixedLengthProposer(DraftProposer):
    """Drafts of ``length`` tokens from the history alone (what the chain allows): the grid's
    controlled drafting, its drafts priced at nothing so that every chain is drafted."""

    length = 1
    FREE = StepCosts(fixed_ms=1e3, per_request_ms=0.0, per_token_ms=1e-6, search_us=0.0)

    def __init__(self, store, cfg, costs=None, drafting=None):
        super().__init__(store, cfg, self.FREE, dataclasses.replace(DRAFTING, sources=("history",)))

    def propose_step(self, items) -> list[Draft]:
        return super().propose_step([(rid, gen, min(max_len, self.length)) for rid, gen, max_len in items])
