"""History store: each prompt's responses from its last K visits, indexed lazily, saved checksummed."""

from __future__ import annotations

import hashlib
import io
import math
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from rhymerl.outputs.atomic import atomic_write_bytes
from rhymerl.config import HistoSpecConfig
from rhymerl.histospec.budget import STORED_BYTES_PER_TOKEN, VisitBudget, available_memory_bytes
from rhymerl.histospec.index import BUILDER, FrozenSuffixAutomaton, build_frozen

MAGIC = b"RHYMEHST"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sII32sQ")  # magic, version, reserved, sha256(payload), payload length


class HistoryError(ValueError):
    """A corrupt or mismatched history file, or a bad argument to the store."""


@dataclass
class _Visit:
    epoch: int
    responses: list[np.ndarray]  # int32 token ids, one array per response
    rewards: Optional[list[float]]

    @property
    def num_tokens(self) -> int:
        return sum(len(r) for r in self.responses)


@dataclass
class _Entry:
    visits: list[_Visit] = field(default_factory=list)  # oldest first
    index: Optional[FrozenSuffixAutomaton] = None


class HistoryStore:
    def __init__(self, cfg: HistoSpecConfig, vocab_size: int | None = None, token_budget: int | None = None):
        """``token_budget`` overrides ``cfg.token_budget``; with neither, ``cfg.memory_fraction`` of memory."""
        if cfg.epochs_kept < 1:
            raise HistoryError(f"histospec.epochs_kept must be >= 1 (got {cfg.epochs_kept})")
        self.cfg = cfg
        self._vocab_size = vocab_size
        self._max_token = -1
        self._entries: dict[int, _Entry] = {}
        if token_budget is None:
            token_budget = cfg.token_budget or max(1, int(cfg.memory_fraction * available_memory_bytes()
                                                          / STORED_BYTES_PER_TOKEN))
        self._budget = VisitBudget(token_budget)
        self._lock = threading.RLock()
        self.build_s = 0.0
        self.built_tokens = 0
        # Shared index over every prompt's responses (built on first use after a change).
        self._global: Optional[FrozenSuffixAutomaton] = None
        self._global_stale = True

    @property
    def vocab_size(self) -> int | None:
        """The vocabulary size given at construction, else (largest token id seen) + 1."""
        if self._vocab_size is not None:
            return self._vocab_size
        return self._max_token + 1 if self._max_token >= 0 else None

    @property
    def num_tokens(self) -> int:
        return self._budget.num_tokens

    @property
    def token_budget(self) -> int:
        return self._budget.token_budget

    def has(self, key: int) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[int]:
        return list(self._entries)

    def lengths(self, key: int) -> list[list[int]]:
        e = self._entries.get(key)
        return [] if e is None else [[len(r) for r in v.responses] for v in e.visits]

    def epochs(self, key: int) -> list[int]:
        e = self._entries.get(key)
        return [] if e is None else [v.epoch for v in e.visits]

    def responses(self, key: int) -> list[list[list[int]]]:
        e = self._entries.get(key)
        return [] if e is None else [[r.tolist() for r in v.responses] for v in e.visits]

    def index(self, key: int) -> Optional[FrozenSuffixAutomaton]:
        """The prompt's suffix automaton (built on first use), or None if unknown."""
        e = self._entries.get(key)
        if e is None:
            return None
        idx = e.index
        if idx is None:
            with self._lock:
                e = self._entries.get(key)
                if e is None:
                    return None
                if e.index is None:
                    e.index = self._build(e)
                idx = e.index
        return idx

    def prebuild(self, keys, background: bool = True) -> Optional[threading.Thread]:
        """Build the indexes of ``keys`` ahead of use, by default in a daemon thread."""
        keys = [int(k) for k in keys if int(k) in self._entries]

        def work() -> None:
            for k in keys:
                self.index(k)
            self.global_index()

        if not background:
            work()
            return None
        t = threading.Thread(target=work, name="histospec-prebuild", daemon=True)
        t.start()
        return t

    def build_cost(self) -> dict:
        """Index build time and index memory per history token, over the indexes built so far."""
        with self._lock:
            idx = [e.index for e in self._entries.values() if e.index is not None]
            tokens = sum(i.num_tokens for i in idx)
            mem = sum(i.memory_bytes() for i in idx)
        return {"index_build_us_per_token": 1e6 * self.build_s / max(1, self.built_tokens),
                "index_bytes_per_token": mem / max(1, tokens),
                "stored_bytes_per_token": STORED_BYTES_PER_TOKEN, "index_builder": BUILDER}

    def global_index(self) -> Optional[FrozenSuffixAutomaton]:
        """One index over the newest kept visits up to ``global_token_budget`` tokens; None if empty or 0."""
        if self.cfg.global_token_budget <= 0:
            return None
        if self._global_stale:
            with self._lock:
                if self._global_stale:
                    self._global_stale = False
                    self._global = self._build_global()
        return self._global

    def _build_global(self) -> Optional[FrozenSuffixAutomaton]:
        budget = self.cfg.global_token_budget
        # Index outside the lock: the arrays are never modified in place.
        chosen: list[list[np.ndarray]] = []
        total = 0
        with self._lock:
            for key, epoch in reversed(list(self._budget)):
                v = next(x for x in self._entries[key].visits if x.epoch == epoch)
                if total + v.num_tokens > budget:
                    break
                total += v.num_tokens
                chosen.append(list(v.responses))
        return build_frozen([r for responses in chosen for r in responses])

    def index_memory_bytes(self) -> int:
        return sum(e.index.memory_bytes() for e in self._entries.values() if e.index is not None)

    def add_group(self, key: int, epoch: int, responses: list[list[int]], rewards: list[float] | None = None) -> None:
        """Record a prompt's responses from one rollout visit (and index them now)."""
        if rewards is not None and len(rewards) != len(responses):
            raise HistoryError(f"add_group: {len(rewards)} rewards for {len(responses)} responses")
        resp = [self._check_tokens(r) for r in responses]
        rew = None if rewards is None else [float(x) for x in rewards]
        key, epoch = int(key), int(epoch)
        with self._lock:
            e = self._entries.setdefault(key, _Entry())
            if e.visits and epoch < e.visits[-1].epoch:
                raise HistoryError(f"add_group: epoch {epoch} is older than the newest kept epoch {e.visits[-1].epoch} of this prompt")
            if e.visits and e.visits[-1].epoch == epoch:  # a second group of the epoch joins its visit
                v = e.visits[-1]
                v.responses.extend(resp)
                v.rewards = None if (v.rewards is None or rew is None) else v.rewards + rew
            else:
                e.visits.append(_Visit(epoch, resp, rew))
                while len(e.visits) > self.cfg.epochs_kept:
                    self._drop_oldest_visit(key, e)
            e.index = None
            self._global_stale = True
            for k, ep in self._budget.add(key, epoch, sum(len(r) for r in resp)):
                self._drop_visit(k, ep)

    def _check_tokens(self, r: Sequence[int]) -> np.ndarray:
        out = np.asarray(r, dtype=np.int64).reshape(-1)
        if out.size:
            lo, hi = int(out.min()), int(out.max())
            if lo < 0:
                raise HistoryError(f"add_group: negative token id {lo}")
            if self._vocab_size is not None and hi >= self._vocab_size:
                raise HistoryError(f"add_group: token id {hi} >= vocab_size {self._vocab_size}")
            if hi >= 2 ** 31:
                raise HistoryError(f"add_group: token id {hi} does not fit in int32")
            self._max_token = max(self._max_token, hi)
        return out.astype(np.int32)

    def _drop_oldest_visit(self, key: int, e: _Entry) -> None:
        v = e.visits.pop(0)
        self._budget.remove(key, v.epoch)
        self._global_stale = True
        e.index = None
        if not e.visits:
            del self._entries[key]

    def _drop_visit(self, key: int, epoch: int) -> None:
        """The budget evicted this visit (always its prompt's oldest: epochs only grow)."""
        e = self._entries[key]
        assert e.visits[0].epoch == epoch
        e.visits.pop(0)
        self._global_stale = True
        e.index = None
        if not e.visits:
            del self._entries[key]

    def _build(self, e: _Entry) -> Optional[FrozenSuffixAutomaton]:
        t0 = time.thread_time()
        idx = build_frozen([r for v in e.visits for r in v.responses])
        self.build_s += time.thread_time() - t0
        self.built_tokens += idx.num_tokens if idx is not None else 0
        return idx

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        vs = -1 if self._vocab_size is None else self._vocab_size
        buf.write(struct.pack("<qqI", vs, self._max_token, len(self._budget)))
        for key, epoch in self._budget:
            v = next(x for x in self._entries[key].visits if x.epoch == epoch)
            lens = np.asarray([len(r) for r in v.responses], dtype="<i4")
            toks = (np.concatenate(v.responses) if v.responses else np.zeros(0)).astype("<i4")
            rew = np.asarray(v.rewards if v.rewards is not None else [math.nan] * len(v.responses), dtype="<f8")
            buf.write(struct.pack("<QqIB", key, epoch, len(lens), v.rewards is not None))
            buf.write(lens.tobytes())
            buf.write(rew.tobytes())
            buf.write(toks.tobytes())
        payload = buf.getvalue()
        return _HEADER.pack(MAGIC, FORMAT_VERSION, 0, hashlib.sha256(payload).digest(), len(payload)) + payload

    @classmethod
    def from_bytes(cls, b: bytes, cfg: HistoSpecConfig, vocab_size: int | None = None, source: str = "<bytes>",
                   token_budget: int | None = None) -> "HistoryStore":
        if len(b) < _HEADER.size:
            raise HistoryError(f"{source}: not a HistoSpec history file (only {len(b)} bytes)")
        magic, version, _, digest, n = _HEADER.unpack_from(b)
        if magic != MAGIC:
            raise HistoryError(f"{source}: not a HistoSpec history file (bad magic {magic!r})")
        if version != FORMAT_VERSION:
            raise HistoryError(f"{source}: history format version {version}, this code reads version {FORMAT_VERSION}")
        payload = b[_HEADER.size:]
        if len(payload) != n:
            raise HistoryError(f"{source}: truncated history file ({len(payload)} of {n} payload bytes)")
        if hashlib.sha256(payload).digest() != digest:
            raise HistoryError(f"{source}: history file checksum mismatch (corrupt file)")
        vs, max_tok, nvisits = struct.unpack_from("<qqI", payload)
        file_vocab = None if vs < 0 else vs
        if vocab_size is not None and file_vocab is not None and file_vocab != vocab_size:
            raise HistoryError(f"{source}: history was recorded with vocab_size {file_vocab}, the model has {vocab_size}")
        if vocab_size is not None and max_tok >= vocab_size:
            raise HistoryError(f"{source}: history holds token id {max_tok}, outside the model's vocab_size {vocab_size}")
        store = cls(cfg, vocab_size if vocab_size is not None else file_vocab, token_budget)
        off = struct.calcsize("<qqI")
        rec = struct.Struct("<QqIB")
        try:
            for _ in range(nvisits):
                key, epoch, nresp, has_rew = rec.unpack_from(payload, off)
                off += rec.size
                lens = np.frombuffer(payload, "<i4", nresp, off); off += 4 * nresp
                rew = np.frombuffer(payload, "<f8", nresp, off); off += 8 * nresp
                ntok = int(lens.sum())
                toks = np.frombuffer(payload, "<i4", ntok, off).astype(np.int32); off += 4 * ntok
                bounds = np.concatenate([[0], np.cumsum(lens)]).tolist()
                responses = [toks[bounds[i]:bounds[i + 1]] for i in range(nresp)]
                store._load_visit(key, epoch, responses, rew.tolist() if has_rew else None)
        except (struct.error, ValueError) as e:
            raise HistoryError(f"{source}: malformed history payload ({e})") from None
        if off != len(payload):
            raise HistoryError(f"{source}: {len(payload) - off} unexpected trailing bytes")
        store._max_token = max(store._max_token, max_tok)
        for k, ep in store._budget.evict_over_budget():
            store._drop_visit(k, ep)
        return store

    def _load_visit(self, key: int, epoch: int, responses: list[list[int]], rewards) -> None:
        # No index build here; the budget is enforced once the whole file is read.
        e = self._entries.setdefault(key, _Entry())
        e.visits.append(_Visit(epoch, responses, rewards))
        self._budget.load(key, epoch, sum(len(r) for r in responses))
        self._global_stale = True
        while len(e.visits) > self.cfg.epochs_kept:
            self._drop_oldest_visit(key, e)

    def save(self, path: str | Path) -> None:
        atomic_write_bytes(Path(path), self.to_bytes())

    @classmethod
    def load(cls, path: str | Path, cfg: HistoSpecConfig, vocab_size: int | None = None,
             token_budget: int | None = None) -> "HistoryStore":
        path = Path(path)
        if not path.is_file():
            raise HistoryError(f"history file {path} does not exist")
        return cls.from_bytes(path.read_bytes(), cfg, vocab_size, source=str(path), token_budget=token_budget)
