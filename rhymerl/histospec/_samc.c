/* Compiled bulk builder of the history index (rhymerl.histospec.index).
 *
 * Builds the same generalised suffix automaton as SuffixAutomaton(online=False).add()
 * followed by freeze(): the same states in the same order (ids are creation order),
 * the same clones, the same counts, and emits the frozen form's flat columns:
 *
 *   ln, link        int32 per state
 *   cnt             int64 per state (occurrences of the state's strings)
 *   off             int32 per state + 1 (CSR offsets into the edge columns)
 *   etok, edst      int32 per edge: each state's edges, the preferred child first
 *                   (most frequent, smaller token on ties), the rest by token
 *
 * Pure Python spends ~5 us per history token on dict and list objects; this spends a
 * fraction of a microsecond, which is what keeps index building off the critical path
 * at cluster scale. Input: one int32 buffer of all sequences (each already led by the
 * START marker) and int64 offsets (sequences + 1).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int32_t *ln, *link, *head;   /* per state; head = first edge in the state's list */
    int64_t *cnt;
    int32_t *etok, *edst, *enext; /* per edge */
    uint64_t *hkey;              /* open addressing: (state << 32 | tok) + 1, 0 = empty */
    int32_t *hval;               /* edge id */
    size_t nstates, cap_states, nedges, cap_edges, hmask;
    int online;                  /* counts kept exact per token (a growing group index) */
} Sam;

static inline uint64_t key_of(int32_t s, int32_t c) {
    return (((uint64_t)(uint32_t)s << 32) | (uint32_t)c) + 1u;
}

static inline size_t hash_of(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return (size_t)k;
}

/* Edge id of (s, c), or -1. */
static inline int32_t find(const Sam *m, int32_t s, int32_t c) {
    uint64_t k = key_of(s, c);
    size_t i = hash_of(k) & m->hmask;
    while (m->hkey[i]) {
        if (m->hkey[i] == k) return m->hval[i];
        i = (i + 1) & m->hmask;
    }
    return -1;
}

static inline void add_edge(Sam *m, int32_t s, int32_t c, int32_t dst) {
    int32_t e = (int32_t)m->nedges++;
    m->etok[e] = c;
    m->edst[e] = dst;
    m->enext[e] = m->head[s];
    m->head[s] = e;
    uint64_t k = key_of(s, c);
    size_t i = hash_of(k) & m->hmask;
    while (m->hkey[i]) i = (i + 1) & m->hmask;
    m->hkey[i] = k;
    m->hval[i] = e;
}

static inline int32_t new_state(Sam *m, int32_t ln, int32_t link) {
    int32_t v = (int32_t)m->nstates++;
    m->ln[v] = ln;
    m->link[v] = link;
    m->head[v] = -1;
    m->cnt[v] = 0;
    return v;
}

static int32_t clone_of(Sam *m, int32_t p, int32_t q, int32_t c) {
    int32_t cl = new_state(m, m->ln[p] + 1, m->link[q]);
    if (m->online) {
        /* Online: the clone's end positions are q's (the caller's walk adds the new one).
         * Bulk: a clone owns no end position itself. */
        m->cnt[cl] = m->cnt[q];
    }
    for (int32_t e = m->head[q]; e >= 0; e = m->enext[e]) add_edge(m, cl, m->etok[e], m->edst[e]);
    while (p != -1) {
        int32_t e = find(m, p, c);
        if (e < 0 || m->edst[e] != q) break;
        m->edst[e] = cl;
        p = m->link[p];
    }
    m->link[q] = cl;
    return cl;
}

static int32_t extend(Sam *m, int32_t last, int32_t c) {
    int32_t cur;
    int32_t e = find(m, last, c);
    if (e >= 0) {
        int32_t q = m->edst[e];
        cur = (m->ln[last] + 1 == m->ln[q]) ? q : clone_of(m, last, q, c);
    } else {
        cur = new_state(m, m->ln[last] + 1, 0);
        int32_t p = last;
        while (p != -1 && (e = find(m, p, c)) < 0) {
            add_edge(m, p, c, cur);
            p = m->link[p];
        }
        if (p != -1) {
            int32_t q = m->edst[e];
            m->link[cur] = (m->ln[p] + 1 == m->ln[q]) ? q : clone_of(m, p, q, c);
        }
    }
    if (!m->online) {
        m->cnt[cur] += 1;
        return cur;
    }
    /* The new end position belongs to cur and every state on its suffix-link path. */
    for (int32_t v = cur; v > 0; v = m->link[v]) m->cnt[v] += 1;
    m->cnt[0] += 1;
    return cur;
}

static void sam_free(Sam *m) {
    free(m->ln); free(m->link); free(m->head); free(m->cnt);
    free(m->etok); free(m->edst); free(m->enext); free(m->hkey); free(m->hval);
}

static int sam_alloc(Sam *m, size_t ntok) {
    memset(m, 0, sizeof(*m));
    /* A generalised automaton over n symbols has at most 2n states and 3n transitions. */
    m->cap_states = 2 * ntok + 2;
    m->cap_edges = 3 * ntok + 2;
    size_t h = 16;
    while (h < 2 * m->cap_edges) h <<= 1;
    m->hmask = h - 1;
    m->ln = malloc(m->cap_states * sizeof(int32_t));
    m->link = malloc(m->cap_states * sizeof(int32_t));
    m->head = malloc(m->cap_states * sizeof(int32_t));
    m->cnt = malloc(m->cap_states * sizeof(int64_t));
    m->etok = malloc(m->cap_edges * sizeof(int32_t));
    m->edst = malloc(m->cap_edges * sizeof(int32_t));
    m->enext = malloc(m->cap_edges * sizeof(int32_t));
    m->hkey = calloc(h, sizeof(uint64_t));
    m->hval = malloc(h * sizeof(int32_t));
    if (!m->ln || !m->link || !m->head || !m->cnt || !m->etok || !m->edst || !m->enext || !m->hkey
        || !m->hval) {
        sam_free(m);
        return -1;
    }
    new_state(m, 0, -1);
    return 0;
}

/* Counts of every state's strings: each occurrence marked its own state; children in
 * the suffix-link tree are strictly longer, so sum by decreasing length. */
static int total_counts(Sam *m) {
    size_t n = m->nstates;
    int32_t maxln = 0;
    for (size_t v = 0; v < n; v++) if (m->ln[v] > maxln) maxln = m->ln[v];
    int64_t *start = calloc((size_t)maxln + 2, sizeof(int64_t));
    int32_t *order = malloc(n * sizeof(int32_t));
    if (!start || !order) { free(start); free(order); return -1; }
    for (size_t v = 0; v < n; v++) start[m->ln[v] + 1]++;
    for (int32_t l = 0; l <= maxln; l++) start[l + 1] += start[l];
    for (size_t v = 0; v < n; v++) order[start[m->ln[v]]++] = (int32_t)v;
    /* start[l] is now the end of bucket l, i.e. the start of bucket l + 1. */
    for (int32_t l = maxln; l >= 1; l--) {
        int64_t lo = start[l - 1], hi = start[l];
        for (int64_t i = lo; i < hi; i++) {
            int32_t v = order[i];
            m->cnt[m->link[v]] += m->cnt[v];
        }
    }
    free(start);
    free(order);
    return 0;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static PyObject *bytes_of(const void *p, size_t n) {
    return PyBytes_FromStringAndSize((const char *)p, (Py_ssize_t)n);
}

static PyObject *build(PyObject *self, PyObject *args) {
    Py_buffer tb, ob;
    if (!PyArg_ParseTuple(args, "y*y*", &tb, &ob)) return NULL;
    PyObject *res = NULL;
    size_t ntok = (size_t)tb.len / sizeof(int32_t);
    size_t nseq_off = (size_t)ob.len / sizeof(int64_t);
    const int32_t *tok = tb.buf;
    const int64_t *off = ob.buf;
    Sam m;
    int32_t *coff = NULL, *ctok = NULL, *cdst = NULL;
    uint64_t *tmp = NULL;
    if (nseq_off < 1 || off[nseq_off - 1] != (int64_t)ntok) {
        PyErr_SetString(PyExc_ValueError, "build: offsets do not match the token buffer");
        goto done;
    }
    if (ntok > (size_t)INT32_MAX / 3) {
        PyErr_SetString(PyExc_ValueError, "build: too many tokens for one index");
        goto done;
    }
    if (sam_alloc(&m, ntok) < 0) { PyErr_NoMemory(); goto done; }
    Py_BEGIN_ALLOW_THREADS
    for (size_t s = 0; s + 1 < nseq_off; s++) {
        int32_t last = 0;
        for (int64_t i = off[s]; i < off[s + 1]; i++) last = extend(&m, last, tok[i]);
    }
    Py_END_ALLOW_THREADS
    if (total_counts(&m) < 0) { PyErr_NoMemory(); sam_free(&m); goto done; }
    size_t n = m.nstates, ne = m.nedges;
    coff = malloc((n + 1) * sizeof(int32_t));
    ctok = malloc((ne ? ne : 1) * sizeof(int32_t));
    cdst = malloc((ne ? ne : 1) * sizeof(int32_t));
    tmp = malloc((ne ? ne : 1) * sizeof(uint64_t));
    if (!coff || !ctok || !cdst || !tmp) { PyErr_NoMemory(); sam_free(&m); goto done; }
    size_t k = 0;
    for (size_t v = 0; v < n; v++) {
        coff[v] = (int32_t)k;
        size_t d = 0;
        int32_t best = -1;
        for (int32_t e = m.head[v]; e >= 0; e = m.enext[e]) {
            /* Preferred child: highest count, then the smaller token. */
            if (best < 0 || m.cnt[m.edst[e]] > m.cnt[m.edst[best]]
                || (m.cnt[m.edst[e]] == m.cnt[m.edst[best]] && m.etok[e] < m.etok[best]))
                best = e;
            tmp[d++] = (uint64_t)e;
        }
        if (best < 0) continue;
        ctok[k] = m.etok[best];
        cdst[k] = m.edst[best];
        k++;
        if (d > 1) {
            size_t r = 0;
            for (size_t i = 0; i < d; i++) {
                int32_t e = (int32_t)tmp[i];
                if (e == best) continue;
                /* Sort key: the token (signed order, as unsigned) above, the edge id below. */
                tmp[r++] = ((uint64_t)((uint32_t)m.etok[e] ^ 0x80000000u) << 32) | (uint32_t)e;
            }
            qsort(tmp, r, sizeof(uint64_t), cmp_u64);
            for (size_t i = 0; i < r; i++) {
                int32_t e = (int32_t)(tmp[i] & 0xffffffff);
                ctok[k] = m.etok[e];
                cdst[k] = m.edst[e];
                k++;
            }
        }
    }
    coff[n] = (int32_t)k;
    res = Py_BuildValue("(NNNNNN)", bytes_of(m.ln, n * sizeof(int32_t)), bytes_of(m.link, n * sizeof(int32_t)),
                        bytes_of(m.cnt, n * sizeof(int64_t)), bytes_of(coff, (n + 1) * sizeof(int32_t)), bytes_of(ctok, k * sizeof(int32_t)),
                        bytes_of(cdst, k * sizeof(int32_t)));
    sam_free(&m);
done:
    free(coff); free(ctok); free(cdst); free(tmp);
    PyBuffer_Release(&tb);
    PyBuffer_Release(&ob);
    return res;
}

/* ---------------------------------------------------------------- drafting reads
 *
 * The proposer's per-step reads of a frozen index, the same walks as the pure-Python
 * _Match.advance and _chain_from/_walk (rhymerl.histospec.proposer), token for token:
 * matching a request's new tokens and reading the greedy chain after the match. They run
 * once per drafting request per engine step, so in Python they were most of the
 * proposer's time. The columns are the frozen automaton's arrays, each of the narrowest
 * integer type that holds it; a view holds their buffers (and so the arrays) alive.
 */
typedef struct {
    const char *p;
    char code;
    Py_ssize_t size;
} Col;

typedef struct {
    Py_buffer buf[6];
    int nbuf;
    Col ln, link, cnt, off, etok, edst;
    Py_ssize_t nstates;
} View;

/* The integer at p, of the struct-module type ``code`` (one that ``int_code`` accepted). */
static inline int64_t read_int(const char *p, char code) {
    switch (code) {
    case 'h': return *(const int16_t *)p;
    case 'H': return *(const uint16_t *)p;
    case 'i': return *(const int32_t *)p;
    case 'I': return *(const uint32_t *)p;
    case 'l': return *(const long *)p;
    case 'L': return (int64_t)*(const unsigned long *)p;
    default: return *(const int64_t *)p; /* 'q' */
    }
}

/* The type code of a buffer of native integers, or 0 (any other format or item size). */
static char int_code(const Py_buffer *b) {
    const char *f = b->format ? b->format : "B";
    if (f[0] == '@' || f[0] == '=') f++;
    char code = f[0];
    size_t want = code == 'h' || code == 'H' ? 2 : code == 'i' || code == 'I' ? 4
                : code == 'l' || code == 'L' ? sizeof(long) : code == 'q' ? 8 : 0;
    return want && !f[1] && (size_t)b->itemsize == want ? code : 0;
}

static inline int64_t col(const Col *c, Py_ssize_t i) {
    return read_int(c->p + i * c->size, c->code);
}

static void view_free(PyObject *cap) {
    View *v = PyCapsule_GetPointer(cap, "rhymerl.samc.view");
    if (!v) return;
    for (int i = 0; i < v->nbuf; i++) PyBuffer_Release(&v->buf[i]);
    free(v);
}

static PyObject *view(PyObject *self, PyObject *args) {
    PyObject *cols[6];
    if (!PyArg_ParseTuple(args, "OOOOOO", &cols[0], &cols[1], &cols[2], &cols[3], &cols[4], &cols[5])) return NULL;
    View *v = calloc(1, sizeof(View));
    if (!v) return PyErr_NoMemory();
    Col *dst[6] = {&v->ln, &v->link, &v->cnt, &v->off, &v->etok, &v->edst};
    for (int i = 0; i < 6; i++) {
        Py_buffer *b = &v->buf[i];
        if (PyObject_GetBuffer(cols[i], b, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) goto fail;
        v->nbuf++;
        char code = int_code(b);
        if (!code) {
            PyErr_Format(PyExc_TypeError, "view: column %d has format %s, not a signed or unsigned integer", i,
                         b->format ? b->format : "?");
            goto fail;
        }
        dst[i]->p = b->buf;
        dst[i]->code = code;
        dst[i]->size = b->itemsize;
    }
    v->nstates = v->buf[0].len / v->buf[0].itemsize;
    if (v->buf[1].len / v->buf[1].itemsize != v->nstates || v->buf[2].len / v->buf[2].itemsize != v->nstates
        || v->buf[3].len / v->buf[3].itemsize != v->nstates + 1
        || v->buf[4].len / v->buf[4].itemsize != v->buf[5].len / v->buf[5].itemsize) {
        PyErr_SetString(PyExc_ValueError, "view: column lengths do not form one automaton");
        goto fail;
    }
    PyObject *cap = PyCapsule_New(v, "rhymerl.samc.view", view_free);
    if (cap) return cap;
fail:
    for (int i = 0; i < v->nbuf; i++) PyBuffer_Release(&v->buf[i]);
    free(v);
    return NULL;
}

/* Child of state s on token c, or -1: the first edge (the preferred child), else a
 * bisection of the others, which are in token order. */
static inline int64_t trans_of(const View *v, int64_t s, int64_t c) {
    Py_ssize_t lo = (Py_ssize_t)col(&v->off, s), hi = (Py_ssize_t)col(&v->off, s + 1);
    if (lo == hi) return -1;
    if (col(&v->etok, lo) == c) return col(&v->edst, lo);
    lo++;
    Py_ssize_t a = lo, b = hi;
    while (a < b) {
        Py_ssize_t m = a + (b - a) / 2;
        if (col(&v->etok, m) < c) a = m + 1; else b = m;
    }
    return a < hi && col(&v->etok, a) == c ? col(&v->edst, a) : -1;
}

static View *view_of(PyObject *cap) {
    return PyCapsule_GetPointer(cap, "rhymerl.samc.view");
}

/* A request's tokens so far: a list or tuple of ints, or a 1-D integer buffer (the engine
 * passes a view of its token table, since copying a 16K-token response out of it every step
 * would cost more than the draft it serves). */
typedef struct {
    PyObject *fast, **items;
    Py_buffer gb;
    char code;
    Py_ssize_t len;
} Tokens;

static int tokens_open(Tokens *t, PyObject *gen) {
    memset(t, 0, sizeof(*t));
    if (!PyList_Check(gen) && !PyTuple_Check(gen) && PyObject_CheckBuffer(gen)) {
        if (PyObject_GetBuffer(gen, &t->gb, PyBUF_FORMAT | PyBUF_STRIDES) < 0) return -1;
        t->code = int_code(&t->gb);
        if (t->gb.ndim != 1 || !t->code) {
            PyBuffer_Release(&t->gb);
            PyErr_SetString(PyExc_TypeError, "generated must be a list of ints or a 1-D integer buffer");
            return -1;
        }
        t->len = t->gb.shape ? t->gb.shape[0] : t->gb.len / t->gb.itemsize;
        return 0;
    }
    t->fast = PySequence_Fast(gen, "generated must be a sequence");
    if (!t->fast) return -1;
    t->len = PySequence_Fast_GET_SIZE(t->fast);
    t->items = PySequence_Fast_ITEMS(t->fast);
    return 0;
}

/* Token i; -1 with an exception set on a bad item (-1 is also START: check PyErr_Occurred). */
static inline int64_t tokens_get(const Tokens *t, Py_ssize_t i) {
    if (t->fast) return PyLong_AsLongLong(t->items[i]);
    return read_int((const char *)t->gb.buf + i * (t->gb.strides ? t->gb.strides[0] : t->gb.itemsize), t->code);
}

static void tokens_close(Tokens *t) {
    if (t->fast) Py_DECREF(t->fast); else PyBuffer_Release(&t->gb);
}

/* Child of state s on token c (-1 if none), in a frozen view or a growing automaton. */
typedef int64_t (*trans_fn)(const void *index, int64_t s, int64_t c);
/* The greedy continuation of state v: 0 if none, else 1 with (token, child, probability). */
typedef int (*next_fn)(const void *index, int64_t v, int64_t *c, int64_t *u, double *q);

typedef struct {
    trans_fn trans;
    next_fn next;
    int64_t (*link)(const void *index, int64_t s);
    int64_t (*len)(const void *index, int64_t s);
    Py_ssize_t (*nstates)(const void *index);
} Reads;

/* _Match.advance: extend the match (st, ln) by positions [start, n) of the response behind a
 * virtual START marker, keeping at most the last ``window`` tokens matched. */
static PyObject *advance_with(const Reads *r, const void *ix, PyObject *gen, long long st,
                              long long ln, long long start, long long n, long long window, long long start_tok) {
    Tokens t;
    if (tokens_open(&t, gen) < 0) return NULL;
    PyObject *res = NULL;
    if (start < 0 || n > t.len + 1 || st < 0 || st >= r->nstates(ix)) {
        PyErr_SetString(PyExc_IndexError, "advance: positions out of range");
        goto done;
    }
    for (long long i = start; i < n; i++) {
        long long c = start_tok;
        if (i) {
            c = tokens_get(&t, (Py_ssize_t)(i - 1));
            if (c == -1 && PyErr_Occurred()) goto done;
        }
        for (;;) {
            int64_t q = r->trans(ix, st, c);
            if (q >= 0) { st = q; ln++; break; }
            if (st == 0) { ln = 0; break; }
            st = r->link(ix, st);
            ln = r->len(ix, st);
        }
        if (ln > window) {
            ln = window;
            while (r->len(ix, r->link(ix, st)) >= window) st = r->link(ix, st);
        }
    }
    res = Py_BuildValue("(LL)", st, ln);
done:
    tokens_close(&t);
    return res;
}

/* _chain_from over _greedy: the greedy chain after the match, backing off to shorter
 * matches while the match is at least ``min_match`` long and the chain is empty. */
static PyObject *chain_with(const Reads *r, const void *ix, long long st, long long ln, long long min_match,
                            long long limit, double min_prob) {
    if (st < 0 || st >= r->nstates(ix)) {
        PyErr_SetString(PyExc_IndexError, "chain: state out of range");
        return NULL;
    }
    while (ln >= min_match) {
        PyObject *toks = PyList_New(0), *probs = PyList_New(0);
        if (!toks || !probs) { Py_XDECREF(toks); Py_XDECREF(probs); return NULL; }
        double p = 1.0, score = 0.0;
        int64_t v = st;
        for (long long k = 0; k < limit; k++) {
            int64_t c, u;
            double q;
            if (!r->next(ix, v, &c, &u, &q)) break;
            p *= q;
            if (p < min_prob) break;
            PyObject *ct = PyLong_FromLongLong(c), *qt = PyFloat_FromDouble(q);
            if (!ct || !qt || PyList_Append(toks, ct) < 0 || PyList_Append(probs, qt) < 0) {
                Py_XDECREF(ct); Py_XDECREF(qt); Py_DECREF(toks); Py_DECREF(probs);
                return NULL;
            }
            Py_DECREF(ct);
            Py_DECREF(qt);
            score += p;
            v = u;
        }
        if (PyList_GET_SIZE(toks)) return Py_BuildValue("(NNdLL)", toks, probs, score, st, ln);
        Py_DECREF(toks);
        Py_DECREF(probs);
        if (st == 0) break; /* the root matches nothing shorter */
        st = r->link(ix, st);
        ln = r->len(ix, st);
    }
    Py_RETURN_NONE;
}

/* -- frozen view: each state's first edge is its preferred child; p = cnt[child] / cnt[state] */
static int64_t fz_trans(const void *ix, int64_t s, int64_t c) { return trans_of((const View *)ix, s, c); }
static int fz_next(const void *ix, int64_t v, int64_t *c, int64_t *u, double *q) {
    const View *w = ix;
    Py_ssize_t o = (Py_ssize_t)col(&w->off, v);
    if (o == (Py_ssize_t)col(&w->off, v + 1)) return 0;
    *c = col(&w->etok, o);
    *u = col(&w->edst, o);
    *q = (double)col(&w->cnt, *u) / (double)col(&w->cnt, v);
    return 1;
}
static int64_t fz_link(const void *ix, int64_t s) { return col(&((const View *)ix)->link, s); }
static int64_t fz_len(const void *ix, int64_t s) { return col(&((const View *)ix)->ln, s); }
static Py_ssize_t fz_nstates(const void *ix) { return ((const View *)ix)->nstates; }
static const Reads FROZEN = {fz_trans, fz_next, fz_link, fz_len, fz_nstates};

/* ---------------------------------------------------------------- growing group index
 *
 * A GRPO group's index (the prompt, then every sibling's tokens as they are emitted, several
 * sequences growing interleaved): SuffixAutomaton(online=True).push_at, with counts kept
 * exact per token, and its reads (_Match.advance, _walk_group). The greedy continuation of a
 * state is its most frequent child (the smaller token on ties), with probability normalised
 * over the children that exist: the ends of siblings in flight are "not generated yet", not
 * "the response stopped here".
 */
/* Resize the array ``ptr`` to n items: 0, or -1 with ``ptr`` kept (``tmp`` is a void *). */
#define GROW(ptr, n) ((tmp = realloc((ptr), (n) * sizeof(*(ptr)))) ? ((ptr) = tmp, 0) : -1)

/* Room for an automaton of ntok symbols: the bounds ``sam_alloc`` allocates for at once,
 * grown by doubling, and the edge hash rehashed to stay at most half full. */
static int sam_reserve(Sam *m, size_t ntok) {
    size_t need_s = 2 * ntok + 2, need_e = 3 * ntok + 2;
    void *tmp;
    if (need_s > m->cap_states) {
        size_t cap = m->cap_states * 2 > need_s ? m->cap_states * 2 : need_s;
        if (GROW(m->ln, cap) || GROW(m->link, cap) || GROW(m->head, cap) || GROW(m->cnt, cap))
            return -1;
        m->cap_states = cap;
    }
    if (need_e > m->cap_edges) {
        size_t cap = m->cap_edges * 2 > need_e ? m->cap_edges * 2 : need_e;
        if (GROW(m->etok, cap) || GROW(m->edst, cap) || GROW(m->enext, cap)) return -1;
        m->cap_edges = cap;
        size_t h = m->hmask + 1;
        if (h < 2 * cap) {
            while (h < 2 * cap) h <<= 1;
            uint64_t *hkey = calloc(h, sizeof(uint64_t));
            int32_t *hval = malloc(h * sizeof(int32_t));
            if (!hkey || !hval) { free(hkey); free(hval); return -1; }
            for (size_t i = 0; i <= m->hmask; i++) {
                if (!m->hkey[i]) continue;
                size_t j = hash_of(m->hkey[i]) & (h - 1);
                while (hkey[j]) j = (j + 1) & (h - 1);
                hkey[j] = m->hkey[i];
                hval[j] = m->hval[i];
            }
            free(m->hkey);
            free(m->hval);
            m->hkey = hkey;
            m->hval = hval;
            m->hmask = h - 1;
        }
    }
    return 0;
}

typedef struct {
    Sam m;
    size_t ntok;
} Group;

static void group_free(PyObject *cap) {
    Group *g = PyCapsule_GetPointer(cap, "rhymerl.samc.group");
    if (!g) return;
    sam_free(&g->m);
    free(g);
}

static Group *group_of(PyObject *cap) {
    return PyCapsule_GetPointer(cap, "rhymerl.samc.group");
}

static PyObject *group_new(PyObject *self, PyObject *args) {
    Group *g = calloc(1, sizeof(Group));
    if (!g) return PyErr_NoMemory();
    if (sam_alloc(&g->m, 32) < 0) { free(g); return PyErr_NoMemory(); }
    g->m.online = 1;
    PyObject *cap = PyCapsule_New(g, "rhymerl.samc.group", group_free);
    if (!cap) { sam_free(&g->m); free(g); }
    return cap;
}

static PyObject *group_push(PyObject *self, PyObject *args) {
    PyObject *cap, *seq;
    long long cursor;
    if (!PyArg_ParseTuple(args, "OLO", &cap, &cursor, &seq)) return NULL;
    Group *g = group_of(cap);
    if (!g) return NULL;
    Tokens t;
    if (tokens_open(&t, seq) < 0) return NULL;
    PyObject *res = NULL;
    if (cursor < 0 || (size_t)cursor >= g->m.nstates) {
        PyErr_SetString(PyExc_IndexError, "push: cursor is not a state of this index");
        goto done;
    }
    if ((size_t)t.len > (size_t)INT32_MAX / 3 - g->ntok) {
        PyErr_SetString(PyExc_ValueError, "push: too many tokens for one index");
        goto done;
    }
    if (sam_reserve(&g->m, g->ntok + (size_t)t.len) < 0) { PyErr_NoMemory(); goto done; }
    int32_t cur = (int32_t)cursor;
    for (Py_ssize_t i = 0; i < t.len; i++) {
        int64_t c = tokens_get(&t, i);
        if (c == -1 && PyErr_Occurred()) goto done;
        if (c < INT32_MIN || c > INT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "push: token id out of int32 range");
            goto done;
        }
        cur = extend(&g->m, cur, (int32_t)c);
        g->ntok++;
    }
    res = PyLong_FromLong(cur);
done:
    tokens_close(&t);
    return res;
}

static int64_t gr_trans(const void *ix, int64_t s, int64_t c) {
    if (c < INT32_MIN || c > INT32_MAX) return -1;
    int32_t e = find(&((const Group *)ix)->m, (int32_t)s, (int32_t)c);
    return e < 0 ? -1 : ((const Group *)ix)->m.edst[e];
}
static int gr_next(const void *ix, int64_t v, int64_t *c, int64_t *u, double *q) {
    const Sam *m = &((const Group *)ix)->m;
    int32_t best = -1;
    int64_t total = 0;
    for (int32_t e = m->head[v]; e >= 0; e = m->enext[e]) {
        int64_t k = m->cnt[m->edst[e]];
        total += k;
        if (best < 0 || k > m->cnt[m->edst[best]] || (k == m->cnt[m->edst[best]] && m->etok[e] < m->etok[best]))
            best = e;
    }
    if (best < 0) return 0;
    *c = m->etok[best];
    *u = m->edst[best];
    *q = m->enext[m->head[v]] < 0 ? 1.0 : (double)m->cnt[*u] / (double)total;
    return 1;
}
static int64_t gr_link(const void *ix, int64_t s) { return ((const Group *)ix)->m.link[s]; }
static int64_t gr_len(const void *ix, int64_t s) { return ((const Group *)ix)->m.ln[s]; }
static Py_ssize_t gr_nstates(const void *ix) { return (Py_ssize_t)((const Group *)ix)->m.nstates; }
static const Reads GROWING = {gr_trans, gr_next, gr_link, gr_len, gr_nstates};

/* The index behind a handle: a frozen view or a growing group index. */
static const void *index_of(PyObject *cap, const Reads **reads) {
    if (PyCapsule_IsValid(cap, "rhymerl.samc.group")) {
        *reads = &GROWING;
        return group_of(cap);
    }
    *reads = &FROZEN;
    return view_of(cap);
}

static PyObject *advance(PyObject *self, PyObject *args) {
    PyObject *cap, *gen;
    long long st, ln, start, n, window, start_tok;
    if (!PyArg_ParseTuple(args, "OLLOLLLL", &cap, &st, &ln, &gen, &start, &n, &window, &start_tok)) return NULL;
    const Reads *r;
    const void *ix = index_of(cap, &r);
    if (!ix) return NULL;
    return advance_with(r, ix, gen, st, ln, start, n, window, start_tok);
}

static PyObject *chain(PyObject *self, PyObject *args) {
    PyObject *cap;
    long long st, ln, min_match, limit;
    double min_prob;
    if (!PyArg_ParseTuple(args, "OLLLLd", &cap, &st, &ln, &min_match, &limit, &min_prob)) return NULL;
    const Reads *r;
    const void *ix = index_of(cap, &r);
    if (!ix) return NULL;
    return chain_with(r, ix, st, ln, min_match, limit, min_prob);
}

/* (ln, link, cnt) per state and (state, token, child) per edge: for tests against the
 * Python automaton. */
static PyObject *group_columns(PyObject *self, PyObject *args) {
    PyObject *cap;
    if (!PyArg_ParseTuple(args, "O", &cap)) return NULL;
    Group *g = group_of(cap);
    if (!g) return NULL;
    const Sam *m = &g->m;
    PyObject *states = PyList_New((Py_ssize_t)m->nstates), *edges = PyList_New(0);
    if (!states || !edges) { Py_XDECREF(states); Py_XDECREF(edges); return NULL; }
    for (size_t v = 0; v < m->nstates; v++) {
        PyList_SET_ITEM(states, (Py_ssize_t)v, Py_BuildValue("(iiL)", m->ln[v], m->link[v], (long long)m->cnt[v]));
        for (int32_t e = m->head[v]; e >= 0; e = m->enext[e]) {
            PyObject *x = Py_BuildValue("(iii)", (int)v, m->etok[e], m->edst[e]);
            if (!x || PyList_Append(edges, x) < 0) { Py_XDECREF(x); Py_DECREF(states); Py_DECREF(edges); return NULL; }
            Py_DECREF(x);
        }
    }
    return Py_BuildValue("(NN)", states, edges);
}

static PyMethodDef methods[] = {
    {"build", build, METH_VARARGS,
     "build(tokens_i32, offsets_i64) -> (ln, link, cnt, off, etok, edst) as bytes"},
    {"view", view, METH_VARARGS, "view(ln, link, cnt, off, etok, edst) -> a handle on a frozen index's columns"},
    {"advance", advance, METH_VARARGS,
     "advance(view or group, state, length, generated (list, tuple or 1-D int buffer), start, n, window, start_token)"
     " -> (state, length)"},
    {"chain", chain, METH_VARARGS,
     "chain(view or group, state, length, min_match, limit, min_prob)"
     " -> (tokens, probs, score, state, match length) | None"},
    {"group_new", group_new, METH_NOARGS, "group_new() -> a growing group index (one node: the root)"},
    {"group_push", group_push, METH_VARARGS, "group_push(group, cursor, tokens) -> the new end state"},
    {"group_columns", group_columns, METH_VARARGS, "group_columns(group) -> ([(ln, link, cnt)], [(state, token, child)])"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_samc", "Compiled history-index builder and drafting reads.", -1, methods};

PyMODINIT_FUNC PyInit__samc(void) { return PyModule_Create(&module); }
