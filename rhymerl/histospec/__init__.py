"""HistoSpec: speculative decoding with drafts from earlier epochs' responses (engine-independent core)."""

from rhymerl.histospec.hashing import HASH_BACKEND, prompt_key
from rhymerl.histospec.index import FrozenSuffixAutomaton, SuffixAutomaton
from rhymerl.histospec.proposer import Draft, DraftProposer
from rhymerl.histospec.store import HistoryError, HistoryStore

__all__ = ["HASH_BACKEND", "Draft", "DraftProposer", "FrozenSuffixAutomaton", "HistoryError", "HistoryStore",
           "SuffixAutomaton", "prompt_key"]
