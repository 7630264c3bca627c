/* umbp.pool._native, PageRuns (1 of 2): the DRAM index's page allocator (umbp.pool.dram.allocator.PageAllocator's
 * C twin): its free runs, alloc and free, and its type, umbp.pool._native.PageRuns. The calls that work on an
 * IndexTable too (hand_back, reserve_row(s), evict_lru) are in page_runs_index.c; the struct is in native.h.
 *
 * Why: with the key table in C, the Python allocator was most of a reserve+commit (alloc, free and their
 * dict and bisect work: ~55% of a steady-state put, profiled). Same rules and same answers as the Python
 * class (tests compare them): free space as maximal runs of pages, one FIFO list per run length, best fit
 * (the shortest length >= n, the oldest run of that length), frees coalesce with both neighbours.
 * Runs are nodes in plain arrays; start -> run and end -> run are open-addressing tables (linear probing,
 * backward-shift deletion); the distinct lengths are a sorted array (a handful of KV page sizes in practice).
 */
#include "native.h"

static inline uint64_t pr_hash(uint64_t k, uint64_t mask) {
    k *= 0x9E3779B97F4A7C15ULL;
    return (k ^ (k >> 31)) & mask;
}

static inline uint64_t pr_key(const PageRuns *r, int end, uint32_t node) {
    return end ? r->rstart[node] + r->rlen[node] : r->rstart[node];
}

static uint32_t pr_find(const PageRuns *r, int end, uint64_t key) {
    const uint32_t *m = end ? r->by_end : r->by_start;
    for (uint64_t i = pr_hash(key, r->mask);; i = (i + 1) & r->mask) {
        uint32_t c = m[i];
        if (c == 0)
            return IT_NIL;
        if (pr_key(r, end, c - 1) == key)
            return c - 1;
    }
}

static void pr_put(PageRuns *r, int end, uint32_t node) {
    uint32_t *m = end ? r->by_end : r->by_start;
    uint64_t i = pr_hash(pr_key(r, end, node), r->mask);
    while (m[i])
        i = (i + 1) & r->mask;
    m[i] = node + 1;
}

/* Backward-shift deletion; node's start and length must still be its key's. */
static void pr_del(PageRuns *r, int end, uint32_t node) {
    uint32_t *m = end ? r->by_end : r->by_start;
    uint64_t i = pr_hash(pr_key(r, end, node), r->mask), j;
    while (m[i] != node + 1)
        i = (i + 1) & r->mask;
    for (j = i;;) {
        j = (j + 1) & r->mask;
        uint32_t c = m[j];
        if (c == 0)
            break;
        uint64_t home = pr_hash(pr_key(r, end, c - 1), r->mask);
        int stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            m[i] = c;
            i = j;
        }
    }
    m[i] = 0;
}

static int pr_rehash(PageRuns *r, uint64_t size) {
    uint32_t *ns = PyMem_RawCalloc(size, sizeof(uint32_t)), *ne = PyMem_RawCalloc(size, sizeof(uint32_t));
    if (ns == NULL || ne == NULL) {
        PyMem_RawFree(ns);
        PyMem_RawFree(ne);
        PyErr_NoMemory();
        return -1;
    }
    uint32_t *os = r->by_start;
    uint64_t oldsize = os ? r->mask + 1 : 0;
    PyMem_RawFree(r->by_end);
    r->by_start = ns;
    r->by_end = ne;
    r->mask = size - 1;
    for (uint64_t i = 0; i < oldsize; i++) {
        if (os[i]) {
            pr_put(r, 0, os[i] - 1);
            pr_put(r, 1, os[i] - 1);
        }
    }
    PyMem_RawFree(os);
    return 0;
}

static size_t pr_lower(const PageRuns *r, uint64_t n) { /* first index with lens[i] >= n */
    size_t lo = 0, hi = r->nlens;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (r->lens[mid] < n)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

#define PR_GROW(field, type, n)                                                                          \
    do {                                                                                                \
        void *p = PyMem_RawRealloc(r->field, (size_t)(n) * sizeof(type));                               \
        if (p == NULL)                                                                                  \
            goto nomem;                                                                                 \
        r->field = p;                                                                                   \
    } while (0)

/* The most distinct lengths free runs can have: k, with k (k + 1) / 2 <= npages (they sum to at most every page). */
static uint64_t pr_most_lengths(const PageRuns *r) {
    uint64_t k = 0;
    for (uint64_t hi = 1ull << 31; k < hi;) {
        uint64_t mid = (k + hi + 1) / 2;
        if (mid * (mid + 1) / 2 <= (uint64_t)r->npages)
            k = mid;
        else
            hi = mid - 1;
    }
    return k;
}

/* Room for m more runs than there are, and one: their nodes, length classes and hash cells, so that m frees
 * in a row allocate nothing (PageRuns.hand_back), and, with m = 0 (pr_room), so that the pr_add after a
 * free or a take drops runs cannot fail: one that runs out of memory changes nothing. Bounded by what free
 * runs can become: they lie apart (each merged with its free neighbours), so never more than half the
 * pages are runs, and their lengths are few (pr_most_lengths); a clear() of millions of objects then does
 * not grow the arrays for a run per object. */
int pr_room_for(PageRuns *r, uint64_t m) {
    uint64_t most = ((uint64_t)r->npages + 1) / 2, runs = r->nruns + m, classes = r->nlens + m + 1;
    runs = (runs < most ? runs : most) + 1;
    if (classes > r->lcap && m > 0) {
        uint64_t k = pr_most_lengths(r) + 1;
        classes = classes < k ? classes : k;
    }
    uint64_t size = r->mask + 1;
    while (runs * 2 > size)
        size *= 2;
    if (size > r->mask + 1 && pr_rehash(r, size) < 0)
        return -1;
    if (r->ncap < runs) { /* the nodes not holding a run: the free list and the fresh ones */
        uint64_t n = (uint64_t)r->ncap;
        while (n < runs)
            n *= 2;
        if (n >= IT_NIL) {
            PyErr_SetString(PyExc_MemoryError, "umbp: too many free page runs");
            return -1;
        }
        PR_GROW(rstart, uint64_t, n);
        PR_GROW(rlen, uint64_t, n);
        PR_GROW(prev, uint32_t, n);
        PR_GROW(next, uint32_t, n);
        r->ncap = (uint32_t)n;
    }
    if (r->lcap < classes) {
        size_t n = r->lcap;
        while (n < classes)
            n *= 2;
        PR_GROW(lens, uint64_t, n);
        PR_GROW(head, uint32_t, n);
        PR_GROW(tail, uint32_t, n);
        r->lcap = n;
    }
    return 0;
nomem:
    PyErr_NoMemory();
    return -1;
}

static int pr_room(PageRuns *r) {
    if ((r->nruns + 1) * 2 <= r->mask + 1 && r->ncap > r->nruns && r->nlens < r->lcap)
        return 0; /* room already: the common case, on every take and free */
    return pr_room_for(r, 0);
}

static int pr_add(PageRuns *r, uint64_t start, uint64_t length) {
    if (pr_room(r) < 0)
        return -1;
    uint32_t node = r->nfree;
    if (node != IT_NIL)
        r->nfree = r->next[node];
    else
        node = r->nfresh++;
    r->rstart[node] = start;
    r->rlen[node] = length;
    pr_put(r, 0, node);
    pr_put(r, 1, node);
    size_t i = pr_lower(r, length);
    if (i == r->nlens || r->lens[i] != length) {
        size_t k = r->nlens - i;
        memmove(r->lens + i + 1, r->lens + i, k * sizeof(uint64_t));
        memmove(r->head + i + 1, r->head + i, k * sizeof(uint32_t));
        memmove(r->tail + i + 1, r->tail + i, k * sizeof(uint32_t));
        r->lens[i] = length;
        r->head[i] = r->tail[i] = IT_NIL;
        r->nlens++;
    }
    r->prev[node] = r->tail[i];
    r->next[node] = IT_NIL;
    if (r->tail[i] != IT_NIL)
        r->next[r->tail[i]] = node;
    else
        r->head[i] = node;
    r->tail[i] = node;
    r->free_pages += (long long)length;
    r->nruns++;
    return 0;
}

static void pr_drop(PageRuns *r, uint32_t node) {
    uint64_t length = r->rlen[node];
    size_t i = pr_lower(r, length);
    uint32_t p = r->prev[node], n = r->next[node];
    if (p != IT_NIL) r->next[p] = n; else r->head[i] = n;
    if (n != IT_NIL) r->prev[n] = p; else r->tail[i] = p;
    if (r->head[i] == IT_NIL) {
        size_t k = r->nlens - i - 1;
        memmove(r->lens + i, r->lens + i + 1, k * sizeof(uint64_t));
        memmove(r->head + i, r->head + i + 1, k * sizeof(uint32_t));
        memmove(r->tail + i, r->tail + i + 1, k * sizeof(uint32_t));
        r->nlens--;
    }
    pr_del(r, 0, node);
    pr_del(r, 1, node);
    r->next[node] = r->nfree;
    r->nfree = node;
    r->free_pages -= (long long)length;
    r->nruns--;
}

/* The best-fit free run for n > 0 pages, changing nothing: its length class (r->nlens when no free run is
 * long enough), and where it starts in *start. pr_take_at takes the pages; callers make what can fail (a
 * Slot's offset, an int) in between, so that running out of memory changes nothing. */
size_t pr_fit(const PageRuns *r, uint64_t n, uint64_t *start) {
    size_t i = pr_lower(r, n);
    *start = i < r->nlens ? r->rstart[r->head[i]] : 0;
    return i;
}

/* Take n pages from the front of the first run of length class i (pr_fit's answer): 0, or -1 (no memory,
 * nothing changed). */
int pr_take_at(PageRuns *r, size_t i, uint64_t n) {
    if (pr_room(r) < 0) /* before the drop: see pr_room (growing the length arrays keeps class i) */
        return -1;
    uint32_t node = r->head[i];
    uint64_t start = r->rstart[node], length = r->rlen[node];
    pr_drop(r, node);
    return length > n ? pr_add(r, start + n, length - n) : 0; /* cannot fail: pr_room made room */
}

/* alloc(n) -> start page of a fresh run of n pages (best fit), or None if no free run is long enough. */
static PyObject *PageRuns_alloc(PageRuns *r, PyObject *arg) {
    long long n = PyLong_AsLongLong(arg);
    uint64_t start;
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n <= 0)
        return PyLong_FromLong(0);
    size_t fit = pr_fit(r, (uint64_t)n, &start);
    if (fit == r->nlens)
        Py_RETURN_NONE;
    PyObject *out = PyLong_FromUnsignedLongLong(start); /* before the take: out of memory changes nothing */
    if (out != NULL && pr_take_at(r, fit, (uint64_t)n) < 0)
        Py_CLEAR(out);
    return out;
}

/* The run [start, start + length) back to the free space, merged with free neighbours: 0, or -1 (no memory). */
int pr_free(PageRuns *r, uint64_t start, uint64_t length) {
    if (pr_room(r) < 0) /* before the drops: see pr_room */
        return -1;
    uint32_t left = pr_find(r, 1, start);
    if (left != IT_NIL) {
        start = r->rstart[left];
        length += r->rlen[left];
        pr_drop(r, left);
    }
    uint32_t right = pr_find(r, 0, start + length);
    if (right != IT_NIL) {
        length += r->rlen[right];
        pr_drop(r, right);
    }
    return pr_add(r, start, length);
}

/* free(start, n): the run back to the free space, merged with free neighbours. */
static PyObject *PageRuns_free(PageRuns *r, PyObject *args) {
    long long s, n;
    if (!PyArg_ParseTuple(args, "LL", &s, &n))
        return NULL;
    if (n <= 0)
        Py_RETURN_NONE;
    if (s < 0) {
        PyErr_SetString(PyExc_ValueError, "umbp: PageRuns.free of a negative start");
        return NULL;
    }
    if (pr_free(r, (uint64_t)s, (uint64_t)n) < 0)
        return NULL;
    Py_RETURN_NONE;
}


static PyObject *PageRuns_largest_free(PageRuns *r, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(r->nlens ? r->lens[r->nlens - 1] : 0);
}

/* free_runs() -> sorted [(start, length)] of every free run; for tests and debugging. */
static PyObject *PageRuns_free_runs(PageRuns *r, PyObject *unused) {
    PyObject *out = PyList_New(0);
    for (size_t i = 0; out != NULL && i < r->nlens; i++) {
        for (uint32_t node = r->head[i]; node != IT_NIL; node = r->next[node]) {
            PyObject *run = Py_BuildValue("(KK)", (unsigned long long)r->rstart[node],
                                          (unsigned long long)r->rlen[node]);
            if (run == NULL || PyList_Append(out, run) < 0) {
                Py_XDECREF(run);
                Py_CLEAR(out);
                break;
            }
            Py_DECREF(run);
        }
    }
    if (out != NULL && PyList_Sort(out) < 0)
        Py_CLEAR(out);
    return out;
}

static int PageRuns_init(PageRuns *r, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"npages", NULL};
    long long npages;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "L", kwlist, &npages))
        return -1;
    r->npages = npages;
    r->ncap = 64;
    r->lcap = 16;
    r->nfree = IT_NIL;
    r->rstart = PyMem_RawMalloc(64 * sizeof(uint64_t));
    r->rlen = PyMem_RawMalloc(64 * sizeof(uint64_t));
    r->prev = PyMem_RawMalloc(64 * sizeof(uint32_t));
    r->next = PyMem_RawMalloc(64 * sizeof(uint32_t));
    r->lens = PyMem_RawMalloc(16 * sizeof(uint64_t));
    r->head = PyMem_RawMalloc(16 * sizeof(uint32_t));
    r->tail = PyMem_RawMalloc(16 * sizeof(uint32_t));
    if (!r->rstart || !r->rlen || !r->prev || !r->next || !r->lens || !r->head || !r->tail) {
        PyErr_NoMemory();
        return -1;
    }
    if (pr_rehash(r, 64) < 0)
        return -1;
    if (npages > 0 && pr_add(r, 0, (uint64_t)npages) < 0)
        return -1;
    return 0;
}

/* Made and set up in one step: an object made by __new__ alone would have no arrays, and its methods would
 * read through NULL. */
static PyObject *PageRuns_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    PageRuns *r = (PageRuns *)type->tp_alloc(type, 0);
    if (r != NULL && PageRuns_init(r, args, kw) < 0)
        Py_CLEAR(r);
    return (PyObject *)r;
}

static void PageRuns_dealloc(PageRuns *r) {
    PyMem_RawFree(r->rstart);
    PyMem_RawFree(r->rlen);
    PyMem_RawFree(r->prev);
    PyMem_RawFree(r->next);
    PyMem_RawFree(r->by_start);
    PyMem_RawFree(r->by_end);
    PyMem_RawFree(r->lens);
    PyMem_RawFree(r->head);
    PyMem_RawFree(r->tail);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyMethodDef PageRuns_methods[] = {
    {"alloc", (PyCFunction)PageRuns_alloc, METH_O, NULL},
    {"free", (PyCFunction)PageRuns_free, METH_VARARGS, NULL},
    {"hand_back", (PyCFunction)PageRuns_hand_back, METH_VARARGS, NULL},
    {"largest_free", (PyCFunction)PageRuns_largest_free, METH_NOARGS, NULL},
    {"free_runs", (PyCFunction)PageRuns_free_runs, METH_NOARGS, NULL},
    {"evict_lru", (PyCFunction)PageRuns_evict_lru, METH_VARARGS, NULL},
    {"reserve_row", (PyCFunction)(void (*)(void))PageRuns_reserve_row, METH_FASTCALL, NULL},
    {"reserve_rows", (PyCFunction)(void (*)(void))PageRuns_reserve_rows, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef PageRuns_members[] = {
    {"npages", T_LONGLONG, offsetof(PageRuns, npages), READONLY, "pages managed"},
    {"free_pages", T_LONGLONG, offsetof(PageRuns, free_pages), READONLY, "pages in free runs"},
    {NULL, 0, 0, 0, NULL},
};

PyTypeObject PageRunsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "umbp.pool._native.PageRuns",
    .tp_basicsize = sizeof(PageRuns),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PageRuns_new,
    .tp_dealloc = (destructor)PageRuns_dealloc,
    .tp_methods = PageRuns_methods,
    .tp_members = PageRuns_members,
};
