"""vLLM's ``suffix`` drafter's response cache, replaced from outside the engine: benches give
it the same evidence as HistoSpec's history, and a fresh one at each repeat."""

from __future__ import annotations

from typing import Any, Sequence


def suffix_drafter_of(worker: Any) -> Any:
    """The model runner's vLLM suffix proposer (``collective_rpc``)."""
    runner = getattr(worker, "model_runner", worker)
    return getattr(runner, "drafter", None)


def refill_suffix_cache(engine: Any, pairs: Sequence[tuple[list[int], list[int]]] = ()) -> None:
    """A fresh suffix cache holding ``pairs``' (prompt, response), as earlier epochs would have left it
    (none: an empty cache, as at a run's start)."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache  # optional: vLLM's suffix method

    def refill(worker: Any, pairs=list(pairs)) -> int:
        drafter = suffix_drafter_of(worker)
        old = drafter.suffix_cache
        cache = SuffixDecodingCache(max_tree_depth=old.max_tree_depth, max_cached_requests=old.max_cached_requests)
        for i, (prompt, response) in enumerate(pairs):
            rid = f"warm-{i}"
            cache.start_request(rid, prompt)
            cache.add_active_response(rid, response)
            cache.stop_request(rid)
        drafter.suffix_cache = cache
        return len(pairs)

    engine.llm.collective_rpc(refill)
