"""Small, version-guarded, idempotent fixes to vLLM, applied by the rollout engine; each states its reason."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

# vLLM versions whose CPU expand kernel drops its output (upstream issue #55005; 0.33.0 has the same code).
_EXPAND_FIX_VERSIONS = ("0.32.", "0.33.")

_applied: set[str] = set()


def _vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "")


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def expand_batch_to_tokens_torch(x, cu_num_tokens, num_tokens: int, replace_from: int = 0, replace_to: int = 0):
    """Torch version of rejection_sampler.expand_batch_to_tokens (same contract)."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    src = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype, device=x.device), x)
    out = torch.repeat_interleave(src, counts, output_size=num_tokens)
    return out


def patch_cpu_rejection_expand() -> bool:
    """Reason: on CPU the expand kernel's int64 temporary is never copied back: sampling reads garbage temperatures."""
    name = "cpu_rejection_expand"
    if name in _applied:
        return True
    if not _vllm_version().startswith(_EXPAND_FIX_VERSIONS) or not _on_cpu():
        return False
    from vllm.v1.sample import rejection_sampler as rs

    rs._rhymerl_original_expand_batch_to_tokens = rs.expand_batch_to_tokens
    rs.expand_batch_to_tokens = expand_batch_to_tokens_torch
    _applied.add(name)
    logger.info("rhymerl: applied vLLM patch %s (vLLM %s)", name, _vllm_version())
    return True


def unpatch_cpu_rejection_expand() -> None:
    """Undo patch_cpu_rejection_expand (tests use it to show the unfixed path)."""
    from vllm.v1.sample import rejection_sampler as rs

    orig = getattr(rs, "_rhymerl_original_expand_batch_to_tokens", None)
    if orig is not None:
        rs.expand_batch_to_tokens = orig
    _applied.discard("cpu_rejection_expand")


def patch_idempotent_kernel_registration() -> bool:
    """Reason: re-registering CPU kernels per engine start crashes (_rebind_kernels) once numba's llvmlite is loaded."""
    name = "idempotent_kernel_registration"
    if name in _applied:
        return True
    if not _vllm_version().startswith(_EXPAND_FIX_VERSIONS):
        return False
    from vllm.triton_utils import dispatcher

    original = dispatcher.register_kernels

    def register_kernels(overrides):
        fresh = {k: v for k, v in overrides.items() if dispatcher._registry.get(k, (None, None))[1] is not v}
        if fresh:
            original(fresh)

    dispatcher._rhymerl_original_register_kernels = original
    dispatcher.register_kernels = register_kernels
    _applied.add(name)
    return True


# vLLM's marker for a rejected slot; the versions the patches below were written for.
PLACEHOLDER_TOKEN_ID = -1
_SPEC_STEP_VERSIONS = ("0.32.", "0.33.")
# Proposers that draft from token ids alone (no spec-decode metadata or hidden states).
_TOKEN_ONLY_DRAFTERS = ("ngram", "suffix", "custom_class")


def zero_draft_step_takes_plain_sampler(runner, spec_decode_metadata) -> bool:
    """Whether a step can sample without speculation (no drafts, token-only drafter, no recurrent state)."""
    if spec_decode_metadata is None or spec_decode_metadata.max_spec_len != 0:
        return False
    spec = runner.speculative_config
    if spec is None or spec.method not in _TOKEN_ONLY_DRAFTERS:
        return False
    return not runner.model_config.is_hybrid


def patch_zero_draft_plain_sampler() -> bool:
    """Reason: a step without drafts runs the costly rejection sampler (vLLM #49548); the plain one gives the same."""
    name = "zero_draft_plain_sampler"
    if name in _applied:
        return True
    if not _vllm_version().startswith(_SPEC_STEP_VERSIONS):
        return False
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._sample

    def _sample(self, logits, spec_decode_metadata):
        if zero_draft_step_takes_plain_sampler(self, spec_decode_metadata):
            spec_decode_metadata = None
        return original(self, logits, spec_decode_metadata)

    GPUModelRunner._rhymerl_original_sample = original
    GPUModelRunner._sample = _sample
    _applied.add(name)
    logger.info("rhymerl: applied vLLM patch %s (vLLM %s)", name, _vllm_version())
    return True


def unpatch_zero_draft_plain_sampler() -> None:
    """Undo patch_zero_draft_plain_sampler (for the step benchmark)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    orig = getattr(GPUModelRunner, "_rhymerl_original_sample", None)
    if orig is not None:
        GPUModelRunner._sample = orig
        del GPUModelRunner._rhymerl_original_sample
    _applied.discard("zero_draft_plain_sampler")


def sample_recovered_tokens_inverse_cdf(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids,
                                        draft_probs, target_probs, sampling_metadata, device,
                                        use_fp64_gumbel: bool = False):
    """rejection_sampler.sample_recovered_tokens for one-hot drafts by inverse CDF: one float64 uniform per
    drafting request (shared by its positions, as vLLM's noise row); drafts with probabilities take vLLM's."""
    from vllm.v1.sample import rejection_sampler as rs

    if draft_probs is not None or use_fp64_gumbel:
        return rs._rhymerl_original_sample_recovered_tokens(max_spec_len, num_draft_tokens, cu_num_draft_tokens,
                                                            draft_token_ids, draft_probs, target_probs,
                                                            sampling_metadata, device, use_fp64_gumbel)
    num_tokens, vocab_size = target_probs.shape
    if num_tokens == 0:
        return torch.empty_like(draft_token_ids)
    generators = sampling_metadata.generators
    drafting = [i for i, n in enumerate(num_draft_tokens) if n > 0]
    u = torch.zeros(len(num_draft_tokens), dtype=torch.float64, device=device)
    unseeded = [i for i in drafting if i not in generators]
    if unseeded:
        u[torch.as_tensor(unseeded, device=device)] = torch.rand(len(unseeded), dtype=torch.float64, device=device)
    for i in drafting:
        if i in generators:
            u[i] = torch.rand(1, dtype=torch.float64, device=device, generator=generators[i])[0]
    u = u.repeat_interleave(torch.as_tensor(num_draft_tokens, device=device))
    cdf = target_probs.to(torch.float64)
    ids = draft_token_ids.to(torch.int64)
    real = ids >= 0  # vLLM pads with -1: such a position removes no token
    cdf[real.nonzero().squeeze(1), ids[real]] = 0.0
    torch.cumsum(cdf, dim=1, out=cdf)
    # The first token whose cumulative mass exceeds u x total: never one of zero mass.
    picked = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    return picked.clamp_(max=vocab_size - 1).to(draft_token_ids.dtype)


def patch_recovered_tokens_inverse_cdf() -> bool:
    """Reason: rejection draws full-vocab noise per request; one uniform + cumsum samples the same, cheaper on CPU."""
    name = "recovered_tokens_inverse_cdf"
    if name in _applied:
        return True
    # CPU only: on a GPU the noise is one cheap kernel, and the row lists would cost host-device copies.
    if not _vllm_version().startswith(_SPEC_STEP_VERSIONS) or not _on_cpu():
        return False
    from vllm.v1.sample import rejection_sampler as rs

    rs._rhymerl_original_sample_recovered_tokens = rs.sample_recovered_tokens
    rs.sample_recovered_tokens = sample_recovered_tokens_inverse_cdf
    _applied.add(name)
    logger.info("rhymerl: applied vLLM patch %s (vLLM %s)", name, _vllm_version())
    return True


def unpatch_recovered_tokens_inverse_cdf() -> None:
    from vllm.v1.sample import rejection_sampler as rs

    orig = getattr(rs, "_rhymerl_original_sample_recovered_tokens", None)
    if orig is not None:
        rs.sample_recovered_tokens = orig
    _applied.discard("recovered_tokens_inverse_cdf")


def sampled_logprobs_tensors(self, max_num_logprobs, metadata, logits, target_logits, bonus_logits, sampled_token_ids):
    """RejectionSampler._get_logprobs_tensors for ``max_num_logprobs == 0`` without full-vocabulary copies."""
    from vllm.v1.outputs import LogprobsTensors

    device = logits.device
    num_rows = logits.shape[0]
    batch, width = sampled_token_ids.shape
    target_idx = metadata.target_logits_indices.to(torch.int64)
    bonus_idx = metadata.bonus_logits_indices.to(torch.int64)
    starts = torch.zeros_like(metadata.cu_num_sampled_tokens, dtype=torch.int64)
    starts[1:] = metadata.cu_num_sampled_tokens[:-1].to(torch.int64)
    offsets = torch.arange(width, device=device, dtype=torch.int64)
    slot_rows = (starts.unsqueeze(1) + offsets.unsqueeze(0)).flatten().clamp_(max=num_rows - 1)
    tokens = sampled_token_ids.flatten().to(torch.int64)
    tokens = torch.where(tokens == PLACEHOLDER_TOKEN_ID, torch.zeros_like(tokens), tokens)
    scored = torch.as_tensor([n + 1 for n in metadata.num_draft_tokens], device=device, dtype=torch.int64)
    real = (offsets.unsqueeze(0) < scored.unsqueeze(1)).flatten()
    row_token = torch.zeros(num_rows, dtype=torch.int64, device=device)
    row_token[slot_rows[real]] = tokens[real]
    row_logprob = torch.zeros(num_rows, dtype=torch.float32, device=device)
    row_rank = torch.zeros(num_rows, dtype=torch.int64, device=device)
    for idx, rows in ((target_idx, target_logits), (bonus_idx, bonus_logits)):
        if idx.numel() == 0:
            continue
        # vLLM's own formulas on the scored rows only; an int32 count is faster than int64's on CPU.
        logprobs = rows.log_softmax(dim=-1, dtype=torch.float32)
        tok_logprob = logprobs.gather(1, row_token[idx].unsqueeze(1))
        row_logprob[idx] = tok_logprob.squeeze(1)
        row_rank[idx] = (logprobs >= tok_logprob).sum(-1, dtype=torch.int32).to(torch.int64)
    return LogprobsTensors(tokens.to(torch.int32).unsqueeze(1), row_logprob[slot_rows].unsqueeze(1), row_rank[slot_rows])


def patch_sampled_logprobs_without_vocab_copies() -> bool:
    """Reason: with drafts the rejection sampler log-softmaxes a full-vocab row per (request, slot), padding too."""
    name = "sampled_logprobs_without_vocab_copies"
    if name in _applied:
        return True
    # CPU only: its masked scatter would synchronise a GPU with the host, which vLLM's path avoids.
    if not _vllm_version().startswith(_SPEC_STEP_VERSIONS) or not _on_cpu():
        return False
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    original = RejectionSampler._get_logprobs_tensors

    def _get_logprobs_tensors(self, max_num_logprobs, metadata, logits, target_logits, bonus_logits, sampled_token_ids):
        if max_num_logprobs != 0 or self.is_logits_logprobs_mode:
            return original(self, max_num_logprobs, metadata, logits, target_logits, bonus_logits, sampled_token_ids)
        return sampled_logprobs_tensors(self, max_num_logprobs, metadata, logits, target_logits, bonus_logits,
                                        sampled_token_ids)

    RejectionSampler._rhymerl_original_get_logprobs_tensors = original
    RejectionSampler._get_logprobs_tensors = _get_logprobs_tensors
    _applied.add(name)
    logger.info("rhymerl: applied vLLM patch %s (vLLM %s)", name, _vllm_version())
    return True


def unpatch_rejection_sampler_cuts() -> None:
    """Undo patch_recovered_tokens_inverse_cdf and patch_sampled_logprobs_without_vocab_copies."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    unpatch_recovered_tokens_inverse_cdf()
    orig = getattr(RejectionSampler, "_rhymerl_original_get_logprobs_tensors", None)
    if orig is not None:
        RejectionSampler._get_logprobs_tensors = orig
        del RejectionSampler._rhymerl_original_get_logprobs_tensors
    _applied.discard("sampled_logprobs_without_vocab_copies")


def apply_all() -> list[str]:
    applied = []
    if patch_cpu_rejection_expand():
        applied.append("cpu_rejection_expand")
    if patch_idempotent_kernel_registration():
        applied.append("idempotent_kernel_registration")
    if patch_zero_draft_plain_sampler():
        applied.append("zero_draft_plain_sampler")
    if patch_recovered_tokens_inverse_cdf():
        applied.append("recovered_tokens_inverse_cdf")
    if patch_sampled_logprobs_without_vocab_copies():
        applied.append("sampled_logprobs_without_vocab_copies")
    return applied


def applied() -> set[str]:
    return set(_applied)
