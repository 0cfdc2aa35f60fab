import dataclasses

import pytest

from rhymerl.config import HistoSpecConfig
from rhymerl.histospec import DraftProposer, HistoryError, HistoryStore
from rhymerl.histospec.step_costs import StepCosts

pytestmark = pytest.mark.cpu


def cfg(**kw):
    return dataclasses.replace(HistoSpecConfig(), **kw)


def test_add_has_lengths_and_epoch_replacement():
    s = HistoryStore(cfg(epochs_kept=1))
    assert not s.has(7) and s.lengths(7) == []
    s.add_group(7, 0, [[1, 2, 3], [4, 5]], [1.0, 0.0])
    assert s.has(7) and s.lengths(7) == [[3, 2]] and s.num_tokens == 5
    s.add_group(7, 1, [[9] * 4])
    # epochs_kept=1: the new visit replaces the old one (as in the release).
    assert s.lengths(7) == [[4]] and s.epochs(7) == [1] and s.num_tokens == 4
    assert s.vocab_size == 10


def test_epochs_kept_and_same_epoch_join():
    s = HistoryStore(cfg(epochs_kept=2))
    s.add_group(1, 0, [[1, 2]])
    s.add_group(1, 1, [[3, 4, 5]])
    s.add_group(1, 1, [[6]])
    assert s.lengths(1) == [[2], [3, 1]]
    s.add_group(1, 2, [[7]])
    assert s.epochs(1) == [1, 2] and s.num_tokens == 5
    sam = s.index(1)
    assert sam.match([4, 5])[1] == 2 and sam.match([1, 2])[1] < 2
    with pytest.raises(HistoryError, match="older"):
        s.add_group(1, 0, [[1]])


def test_token_budget_evicts_oldest_visits_first():
    s = HistoryStore(cfg(epochs_kept=3, token_budget=10))
    s.add_group(1, 0, [[1] * 4])
    s.add_group(2, 0, [[2] * 4])
    s.add_group(1, 1, [[3] * 4])  # 12 > 10: prompt 1's epoch 0 goes first
    assert s.epochs(1) == [1] and s.epochs(2) == [0] and s.num_tokens == 8
    s.add_group(3, 1, [[4] * 6])  # 14: prompt 2 (oldest) is forgotten
    assert not s.has(2) and s.has(3) and s.num_tokens <= 10


def test_bad_inputs_are_clear_errors():
    s = HistoryStore(cfg(), vocab_size=10)
    with pytest.raises(HistoryError, match="vocab_size"):
        s.add_group(1, 0, [[3, 10]])
    with pytest.raises(HistoryError, match="negative"):
        s.add_group(1, 0, [[-2]])
    with pytest.raises(HistoryError, match="rewards"):
        s.add_group(1, 0, [[1], [2]], [1.0])


def _store():
    s = HistoryStore(cfg(epochs_kept=2), vocab_size=100)
    s.add_group(11, 0, [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9, 9]], [1.0, 0.0])
    s.add_group(11, 1, [[1, 2, 3, 4, 5, 6, 7, 99]], None)
    s.add_group(2 ** 64 - 1, 1, [[5, 6, 7]], [0.5])
    return s


def test_save_load_roundtrip_gives_identical_drafts(tmp_path):
    s = _store()
    path = tmp_path / "hist.bin"
    s.save(path)
    t = HistoryStore.load(path, s.cfg, vocab_size=100)
    assert t.keys() == s.keys() and t.num_tokens == s.num_tokens and t.vocab_size == 100
    for k in s.keys():
        assert t.lengths(k) == s.lengths(k) and t.epochs(k) == s.epochs(k)
        assert t.responses(k) == s.responses(k)
    # Drafts priced as a GPU's (cheap beside a step), so the plan follows the stored path
    # wherever it leads, whatever the CPU prior's prices.
    gpu = StepCosts(fixed_ms=10.0, per_request_ms=0.1, per_token_ms=0.01)
    drafts = []
    for store in (s, t):
        p = DraftProposer(store, s.cfg, gpu)
        p.begin("r", 11)
        drafts.append(p.propose("r", [1, 2, 3], 8))
    assert drafts[0] == drafts[1] and drafts[0].tokens[:4] == [4, 5, 6, 7]
    assert HistoryStore.from_bytes(s.to_bytes(), s.cfg).to_bytes() == s.to_bytes()


def test_corrupt_and_mismatched_files_raise(tmp_path):
    b = _store().to_bytes()
    c = cfg(epochs_kept=2)
    bad = bytearray(b)
    bad[-3] ^= 0xFF
    with pytest.raises(HistoryError, match="checksum"):
        HistoryStore.from_bytes(bytes(bad), c)
    with pytest.raises(HistoryError, match="truncated"):
        HistoryStore.from_bytes(b[:-5], c)
    with pytest.raises(HistoryError, match="magic"):
        HistoryStore.from_bytes(b"XXXXXXXX" + b[8:], c)
    wrong_version = bytearray(b)
    wrong_version[8] = 99
    with pytest.raises(HistoryError, match="version 99"):
        HistoryStore.from_bytes(bytes(wrong_version), c)
    with pytest.raises(HistoryError, match="vocab_size 100, the model has 50"):
        HistoryStore.from_bytes(b, c, vocab_size=50)
    with pytest.raises(HistoryError, match="does not exist"):
        HistoryStore.load(tmp_path / "missing.bin", c)
    p = tmp_path / "short.bin"
    p.write_bytes(b[:10])
    with pytest.raises(HistoryError, match=str(p)):
        HistoryStore.load(p, c)


def test_load_with_smaller_epochs_kept_trims():
    t = HistoryStore.from_bytes(_store().to_bytes(), cfg(epochs_kept=1))
    assert t.epochs(11) == [1]
