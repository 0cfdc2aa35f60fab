"""vLLM adapter: HistoSpec as a ``custom_class`` speculative proposer. ``propose`` carries no request ids, so
the engine ``attach``-es the model runner; requests identify themselves in ``SamplingParams.extra_args``."""

from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np

from rhymerl.histospec.hashing import prompt_key


class HistoSpecProposer:
    """One instance per vLLM model runner; drafts come from the attached DraftProposer."""

    def __init__(self, vllm_config: Any):
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.runner: Any = None
        self.core: Any = None  # rhymerl.histospec.DraftProposer, or None = no drafts
        self._live: dict[str, list] = {}  # core request id -> [vllm req id, tokens proposed last step]
        self._by_vllm_id: dict[str, str] = {}
        self.counts = {"calls": 0, "proposed": 0, "drafts": 0, "accepted": 0, "draft_time_s": 0.0,
                       "steps_without_drafts": 0}
        # End of the previous call: the next call's start minus this is one engine step.
        self._last_end: Optional[float] = None

    def load_model(self, *args, **kwargs) -> None:
        """No draft model: drafts come from history."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None, **_: Any) -> list[list[int]]:
        t0 = time.perf_counter()
        n = len(sampled_token_ids)
        out: list[list[int]] = [[] for _ in range(n)]
        runner, core = self.runner, self.core
        self.counts["calls"] += 1
        if runner is None or core is None:
            return out
        batch = runner.input_batch
        req_ids = batch.req_ids
        requests = runner.requests
        self._drop_finished(requests)
        rows: list[int] = []
        items: list[tuple[str, np.ndarray, int]] = []
        # The step that just ran: rows and scored tokens; a step that prefilled is not timed.
        step_rows = step_scored = step_drafting = 0
        decode_only = True
        for i in range(n):
            sampled = sampled_token_ids[i]
            if not sampled:
                decode_only = False  # a (chunked) prefill ran in this step: do not time it
                continue  # still in (chunked) prefill, or discarded this step
            vid = req_ids[i]
            if vid is None:
                continue
            rid = self._by_vllm_id.get(vid)
            state = requests.get(vid)
            if state is None:
                continue
            if rid is None:
                rid = self._begin(vid, state)
                decode_only = False
            live = self._live[rid]
            step_rows += 1
            step_scored += 1 + live[1]
            if live[1] > 0:
                step_drafting += 1
                acc = len(sampled) - 1
                self.counts["accepted"] += acc
                core.feedback(rid, live[1], acc)
                live[1] = 0
            num_tokens = int(num_tokens_no_spec[i])
            p_len = state.num_prompt_tokens
            params = state.sampling_params
            room = self.max_model_len - num_tokens - 1
            if params is not None and params.max_tokens is not None:
                room = min(room, params.max_tokens - (num_tokens - p_len) - 1)
            max_len = min(self.k, room)
            # A view, not a copy: the proposer reads only the tokens it has not seen.
            generated = token_ids_cpu[i, p_len:num_tokens]
            rows.append(i)
            items.append((rid, generated, max_len))
        if decode_only and step_rows and self._last_end is not None:
            core.observe_step(step_rows, step_scored, t0 - self._last_end, step_drafting)
        drafts = core.propose_step(items) if items else []
        for i, (rid, _, max_len), d in zip(rows, items, drafts):
            toks = d.tokens[:max_len]
            if toks:
                out[i] = toks
                self._live[rid][1] = len(toks)
                self.counts["proposed"] += len(toks)
                self.counts["drafts"] += 1
        if items and not any(out):
            self.counts["steps_without_drafts"] += 1
        self._last_end = time.perf_counter()
        self.counts["draft_time_s"] += self._last_end - t0
        return out

    def attach(self, runner: Any, core: Any) -> None:
        self.runner = runner
        self.set_core(core)

    def set_core(self, core: Any) -> None:
        """Swap the core proposer (a new history store); live requests restart their match."""
        old = self.core
        if old is not None:
            for rid in list(self._live):
                old.end(rid)
        self._live.clear()
        self._by_vllm_id.clear()
        self.core = core

    def end_request(self, rid: str, response: Optional[list[int]] = None) -> None:
        """The engine saw ``rid`` finish: its tokens become a sibling draft source."""
        live = self._live.pop(rid, None)
        if live is None:
            return
        self._by_vllm_id.pop(live[0], None)
        if self.core is not None:
            self.core.end(rid, response)

    def end_all(self) -> None:
        for rid in list(self._live):
            self.end_request(rid)

    def reset_counts(self) -> None:
        for key in self.counts:
            self.counts[key] = 0.0 if key == "draft_time_s" else 0

    def _begin(self, vid: str, state: Any) -> str:
        extra = (state.sampling_params.extra_args or {}) if state.sampling_params is not None else {}
        rid = str(extra.get("rhymerl_rid", vid))
        key = extra.get("rhymerl_key")
        if key is None:
            key = prompt_key(state.prompt_token_ids or [])
        pred = extra.get("rhymerl_pred_len")
        self.core.begin(rid, int(key), extra.get("rhymerl_group"), None if pred is None else float(pred),
                        prompt=state.prompt_token_ids)
        self._live[rid] = [vid, 0]
        self._by_vllm_id[vid] = rid
        return rid

    def _drop_finished(self, requests: dict) -> None:
        if len(self._by_vllm_id) <= len(requests) and all(v in requests for v in self._by_vllm_id):
            return
        for vid, rid in list(self._by_vllm_id.items()):
            if vid not in requests:
                self.end_request(rid)
