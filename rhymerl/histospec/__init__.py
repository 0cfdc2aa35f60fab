"""HistoSpec: speculative decoding with drafts from earlier epochs' responses.

Engine-independent core (pure Python/NumPy): prompt keys, the history store with a
suffix-automaton index per prompt, the draft proposer (chains and trees, adaptive
length, sibling drafting) and the lossless acceptance math. The vLLM adapter lives in
``vllm_proposer.py``.
"""

from rhymerl.histospec.hashing import HASH_BACKEND, prompt_key
from rhymerl.histospec.index import FrozenSuffixAutomaton, SuffixAutomaton
from rhymerl.histospec.proposer import Draft, DraftProposer
from rhymerl.histospec.store import HistoryError, HistoryStore

__all__ = ["HASH_BACKEND", "Draft", "DraftProposer", "FrozenSuffixAutomaton", "HistoryError", "HistoryStore",
           "SuffixAutomaton", "prompt_key"]
