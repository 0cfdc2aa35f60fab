from collections import Counter

import numpy as np
import pytest

from rhymerl.histospec import SuffixAutomaton, prompt_key
from rhymerl.histospec.hashing import xxh64_py

pytestmark = pytest.mark.cpu


def brute_counts(seqs, max_len):
    occ = Counter()
    for s in seqs:
        for i in range(len(s)):
            for L in range(1, max_len + 1):
                if i + L <= len(s):
                    occ[tuple(s[i:i + L])] += 1
    return occ


@pytest.mark.parametrize("alphabet", [2, 5, 50])
def test_counts_match_brute_force_batch_and_online(alphabet):
    rng = np.random.default_rng(alphabet)
    seqs = [rng.integers(0, alphabet, size=int(rng.integers(1, 60))).tolist() for _ in range(6)]
    sam = SuffixAutomaton()
    for s in seqs[:-1]:
        sam.add(s)
    sam.start_sequence()
    for t in seqs[-1]:
        sam.push(t)
    occ = brute_counts(seqs, 6)
    for sub, n in occ.items():
        st, length = sam.match(sub)
        assert length == len(sub)
        assert sam.cnt[st] == n
    assert sam.num_states <= 2 * sum(len(s) for s in seqs) + 1


def test_match_finds_longest_occurring_suffix():
    rng = np.random.default_rng(0)
    text = rng.integers(0, 4, size=80).tolist()
    sam = SuffixAutomaton()
    sam.add(text)
    subs = {tuple(text[i:j]) for i in range(len(text)) for j in range(i + 1, min(len(text), i + 12) + 1)}
    for _ in range(200):
        q = rng.integers(0, 4, size=int(rng.integers(1, 12))).tolist()
        want = max((L for L in range(len(q) + 1) if L == 0 or tuple(q[len(q) - L:]) in subs), default=0)
        assert sam.match(q)[1] == want


def test_children_probabilities_are_empirical_continuations():
    sam = SuffixAutomaton()
    for r in ([1, 2, 3], [1, 2, 3], [1, 2, 4], [1, 2]):
        sam.add(r)
    st, _ = sam.match([1, 2])
    kids = {c: p for c, _, p in sam.children(st)}
    # 4 occurrences of "1 2": followed by 3 twice, 4 once, end of response once.
    assert kids == {3: 0.5, 4: 0.25}
    tok, _, p = sam.best_child(st)
    assert (tok, p) == (3, 0.5)


def test_prompt_key_is_xxh64_of_int32_le_and_stable():
    ids = [151644, 8948, 198, 2610, 525]
    data = np.asarray(ids, dtype="<i4").tobytes()
    assert prompt_key(ids) == xxh64_py(data)
    # Known XXH64 test vectors (seed 0).
    assert xxh64_py(b"") == 0xEF46DB3751D8E999
    assert xxh64_py(b"a") == 0xD24EC4F1A98C6E5B
    assert xxh64_py(b"abc") == 0x44BC2CF5AD770999
    assert prompt_key([1, 2, 3]) == prompt_key(np.array([1, 2, 3], dtype=np.int64))
    assert prompt_key([1, 2, 3]) != prompt_key([1, 2, 4])
    try:
        import xxhash
    except ImportError:
        return
    rng = np.random.default_rng(0)
    for n in range(0, 70):
        b = rng.integers(0, 256, size=n, dtype=np.uint8).tobytes()
        assert xxh64_py(b) == xxhash.xxh64_intdigest(b)


def test_frozen_copy_answers_like_the_growing_index():
    rng = np.random.default_rng(7)
    sam = SuffixAutomaton()
    for _ in range(5):
        sam.add(rng.integers(0, 6, size=50).tolist())
    frozen = sam.freeze()
    assert frozen.num_states == sam.num_states and frozen.num_tokens == sam.num_tokens
    for _ in range(100):
        q = rng.integers(0, 6, size=int(rng.integers(1, 9))).tolist()
        st, length = sam.match(q)
        assert frozen.match(q) == (st, length)
        assert frozen.children(st) == sam.children(st)
        assert frozen.best_child(st) == sam.best_child(st)
    assert frozen.memory_bytes() < sam.memory_bytes() / 2


def test_bulk_build_counts_equal_online_counts():
    rng = np.random.default_rng(9)
    seqs = [rng.integers(0, 4, size=40).tolist() for _ in range(4)]
    online, bulk = SuffixAutomaton(), SuffixAutomaton(online=False)
    for s in seqs:
        online.add(s)
        bulk.add(s)
    a, b = online.freeze(), bulk.freeze()
    assert list(a.cnt) == list(b.cnt)


def _columns(idx):
    return {k: list(getattr(idx, k)) for k in ("ln", "link", "cnt", "off", "etok", "edst")}


@pytest.mark.parametrize("alphabet", [2, 3, 7, 40000])
def test_compiled_builder_builds_the_python_automaton(alphabet):
    from rhymerl.histospec import index

    # The suite runs on an installed package: a compiler failure must not pass unseen.
    assert index.BUILDER == "compiled"
    rng = np.random.default_rng(alphabet)
    for trial in range(20):
        seqs = [rng.integers(0, alphabet, size=int(rng.integers(0, 80))).tolist() for _ in range(int(rng.integers(1, 9)))]
        if trial % 3 == 0:  # GRPO-like: near-copies of one response
            base = rng.integers(0, alphabet, size=60)
            seqs = [np.where(rng.random(60) < 0.1, rng.integers(0, alphabet, size=60), base).tolist() for _ in range(6)]
        ref = SuffixAutomaton(online=False)
        for s in seqs:
            ref.add([index.START] + s)
        want = ref.freeze()
        got = index.build_frozen(seqs)
        assert _columns(got) == _columns(want)  # same states, ids, edge order
        assert (got.num_tokens, got.num_seqs) == (want.num_tokens, want.num_seqs)
        for _ in range(20):
            q = [index.START] + rng.integers(0, alphabet, size=int(rng.integers(0, 6))).tolist()
            st, _ = ref.match(q)
            assert got.match(q) == ref.match(q)
            assert got.children(st) == ref.children(st)
            assert got.best_child(st) == ref.best_child(st)


def test_index_stays_small():
    from rhymerl.histospec import index

    rng = np.random.default_rng(3)
    base = rng.integers(0, 49152, size=300)
    seqs = [np.where(rng.random(300) < 0.15, rng.integers(0, 49152, size=300), base) for _ in range(16)]
    idx = index.build_frozen(seqs)
    assert idx.memory_bytes() / idx.num_tokens <= 40
    assert index.build_frozen([]) is None


def test_incremental_match_on_a_frozen_index_equals_the_growing_one():
    from rhymerl.histospec.proposer import _Match

    rng = np.random.default_rng(11)
    seqs = [rng.integers(0, 4, size=50).tolist() for _ in range(5)]
    grow = SuffixAutomaton()
    for s in seqs:
        grow.add([-1] + s)
    frozen = grow.freeze()
    grow.best_arrays()  # the growing index's own fast path
    for _ in range(30):
        gen = rng.integers(0, 4, size=60).tolist()
        a, b = _Match(grow), _Match(frozen)
        for n in range(0, 61, int(rng.integers(1, 5))):
            a.advance(gen[:n], window=8)
            b.advance(gen[:n], window=8)
            assert (a.state, a.length) == (b.state, b.length)


@pytest.mark.parametrize("alphabet", [3, 300, 49152])
def test_compiled_drafting_reads_equal_the_python_ones(alphabet, monkeypatch):
    """The proposer's compiled match and chain over a frozen index (``_samc.advance`` /
    ``_samc.chain``) give its pure-Python walks' states, lengths, tokens and probabilities,
    on columns of every width the index uses (a 49k vocabulary needs wider ones)."""
    from rhymerl.histospec import index
    from rhymerl.histospec.proposer import _Match, _python_chain, _walk

    assert index.DRAFT_READS  # the suite runs on an installed package
    rng = np.random.default_rng(alphabet)
    base = rng.integers(0, alphabet, size=120)
    seqs = [np.where(rng.random(120) < 0.2, rng.integers(0, alphabet, size=120), base).tolist() for _ in range(8)]
    seqs += [rng.integers(0, alphabet, size=int(rng.integers(1, 60))).tolist() for _ in range(4)]
    frozen = index.build_frozen(seqs)
    assert {frozen.etok.typecode, frozen.edst.typecode} <= {"h", "H", "i", "I", "q"}

    def reads(compiled: bool, gen: list[int], window: int, limits: list[tuple]) -> list:
        monkeypatch.setattr(index, "DRAFT_READS", compiled)
        frozen._view = None
        m, out = _Match(frozen), []
        for n in range(0, len(gen) + 1, 3):
            m.advance(gen[:n], window)
            out.append((m.state, m.length))
            for min_match, limit, min_prob in limits:
                cand = _chain_from(m, min_match, limit, min_prob, compiled)
                out.append(cand)
        return out

    def _chain_from(m, min_match, limit, min_prob, compiled):
        if compiled:
            return index._samc.chain(frozen.compiled(), m.state, m.length, min_match, limit, min_prob)
        return _python_chain(frozen, _walk, m.state, m.length, limit, min_prob, min_match)

    limits = [(1, 8, 0.0), (2, 16, 0.05), (3, 32, 0.3), (1, 64, 1e-9)]
    for trial in range(12):
        src = seqs[int(rng.integers(0, len(seqs)))]
        cut = int(rng.integers(0, len(src)))
        gen = src[:cut] + rng.integers(0, alphabet, size=int(rng.integers(0, 10))).tolist() + src[cut:]
        window = int(rng.integers(1, 40))
        want = reads(False, gen, window, limits)
        assert reads(True, gen, window, limits) == want
        assert any(c is not None for c in want if not isinstance(c, tuple) or len(c) == 5)


def test_compiled_reads_refuse_what_is_not_an_index():
    from rhymerl.histospec import index

    frozen = index.build_frozen([[1, 2, 3]])
    view = frozen.compiled()
    with pytest.raises(IndexError):
        index._samc.advance(view, 0, 0, [1, 2], 0, 9, 8, index.START)
    with pytest.raises(IndexError):
        index._samc.chain(view, frozen.num_states, 1, 1, 8, 0.0)
    with pytest.raises(TypeError):
        index._samc.view(frozen.ln, frozen.link, frozen.cnt, frozen.off, frozen.etok, np.zeros(3))
    with pytest.raises(ValueError):
        index._samc.view(frozen.ln, frozen.link, frozen.cnt, frozen.ln, frozen.etok, frozen.edst)


@pytest.mark.parametrize("alphabet", [2, 6, 49152])
def test_compiled_group_index_grows_the_python_automaton(alphabet):
    """A group's compiled index, grown the way the proposer grows it (the prompt, then
    siblings' tokens pushed interleaved a few at a time), holds the online automaton's
    states, links, counts and edges, and its compiled match and greedy walk (by most
    frequent child, probabilities over the children that exist) equal the Python ones."""
    from rhymerl.histospec import index
    from rhymerl.histospec.proposer import _Match, _walk_group

    assert index.DRAFT_READS
    rng = np.random.default_rng(alphabet)
    for trial in range(6):
        py, c = SuffixAutomaton(), index.CompiledGroupIndex()
        prompt = rng.integers(0, alphabet, size=int(rng.integers(0, 20))).tolist()
        assert py.push_at(0, prompt) == c.push_at(0, prompt)
        base = rng.integers(0, alphabet, size=90)
        sibs = [np.where(rng.random(90) < 0.25, rng.integers(0, alphabet, size=90), base).tolist() for _ in range(4)]
        cur_py, cur_c, pos = [0] * 4, [0] * 4, [0] * 4
        for k in range(4):
            cur_py[k], cur_c[k] = py.push_at(0, [index.START]), c.push_at(0, [index.START])
        while any(p < 90 for p in pos):
            k = int(rng.integers(0, 4))
            step = sibs[k][pos[k]:pos[k] + int(rng.integers(1, 4))]
            cur_py[k], cur_c[k] = py.push_at(cur_py[k], step), c.push_at(cur_c[k], step)
            assert cur_py[k] == cur_c[k]
            pos[k] += len(step)
            if rng.random() < 0.2:  # reads while the index grows
                gen = sibs[k][:pos[k]]
                a, b = _Match(py), _Match(c)
                a.advance(gen, 7)
                b.advance(gen, 7)
                assert (a.state, a.length) == (b.state, b.length)
                for limit, min_prob in ((8, 0.0), (2, 0.2), (16, 0.2)):
                    want = _walk_group(py, a.state, limit, min_prob)
                    got = index._samc.chain(c.handle, b.state, max(1, b.length), 1, limit, min_prob)
                    if want[0]:
                        assert got is not None and got[:3] == want
        states, edges = c.columns()
        assert states == list(zip(py.ln, py.link, py.cnt))
        assert sorted(edges) == sorted((v, t, u) for v, d in enumerate(py.nxt) for t, u in d.items())
        assert (c.num_tokens, c.num_seqs) == (py.num_tokens, py.num_seqs) and c.version > 0


def test_compiled_group_index_refuses_bad_input():
    from rhymerl.histospec import index

    c = index.CompiledGroupIndex()
    with pytest.raises(IndexError):
        c.push_at(5, [1, 2])
    with pytest.raises(OverflowError):
        c.push_at(0, [1 << 40])
    with pytest.raises(IndexError):
        index._samc.advance(c.handle, 0, 0, [1], 0, 5, 7, index.START)
    assert index._samc.chain(c.handle, 0, 0, 1, 8, 0.0) is None
