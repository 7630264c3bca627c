/* umbp.pool._native, IndexTable (1 of 2): the compact core of the scheduler's DRAM index (umbp.pool.dram.index):
 * its rows, key table and LRU list, and the row-level steps its methods (index_ops.c) and PageRuns' one-call
 * paths (page_runs_index.c) share. The struct is in native.h.
 *
 * Why: a dict of per-object Python objects costs ~470 B and a gen-2 GC traversal per object; at the 10-30 M
 * objects of a 1.8 TB DRAM tier that is GBs of heap and collections of a second or more in vLLM's step
 * loop. Here an object is a row of plain arrays indexed by a uint32 handle (no Python object per row):
 * a 128-bit keyed SipHash digest of the key, its first page, pages, bytes, checksum, pins, state and its
 * LRU links (an array-based doubly linked list: O(1) touch, pin, evict). A key -> handle table uses open
 * addressing with linear probing (backward-shift deletion, no tombstones) over 64-bit cells: the handle + 1
 * and the low 32 bits of the digest's first word. Those bits are the cell's home (the table has at most 2^32
 * cells) and a filter: a probe or a deletion passes other keys' cells without reading their rows' digests,
 * which at millions of objects are cache misses (rows lie apart from their cells in memory). Pages come from
 * PageRuns (page_runs.c). Optionally the key str itself is kept (keep_keys) for callers that must hand victims'
 * keys on (tier demotion).
 *
 * Digest collisions: the table compares the full 128-bit digest of a secret-keyed PRF (SipHash-2-4-128,
 * key from os.urandom per index), so two distinct keys alias with probability ~n^2/2^129 (~1e-24 at 30 M),
 * and nobody without the key can search for a collision.
 */
#include "native.h"

#define ROTL64(x, b) (((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND                                                                                        \
    do {                                                                                                \
        v0 += v1; v1 = ROTL64(v1, 13); v1 ^= v0; v0 = ROTL64(v0, 32);                                    \
        v2 += v3; v3 = ROTL64(v3, 16); v3 ^= v2;                                                         \
        v0 += v3; v3 = ROTL64(v3, 21); v3 ^= v0;                                                         \
        v2 += v1; v1 = ROTL64(v1, 17); v1 ^= v2; v2 = ROTL64(v2, 32);                                    \
    } while (0)

/* SipHash-2-4 with 128-bit output (the reference algorithm's 16-byte variant). */
static void siphash128(const unsigned char *in, size_t len, uint64_t k0, uint64_t k1, uint64_t out[2]) {
    uint64_t v0 = k0 ^ 0x736f6d6570736575ULL, v1 = k1 ^ 0x646f72616e646f6dULL;
    uint64_t v2 = k0 ^ 0x6c7967656e657261ULL, v3 = k1 ^ 0x7465646279746573ULL;
    v1 ^= 0xee;
    const unsigned char *end = in + (len - (len % 8));
    for (; in != end; in += 8) {
        uint64_t m;
        memcpy(&m, in, 8);
        v3 ^= m;
        SIPROUND; SIPROUND;
        v0 ^= m;
    }
    uint64_t b = ((uint64_t)len) << 56;
    switch (len & 7) {
    case 7: b |= ((uint64_t)in[6]) << 48; /* fall through */
    case 6: b |= ((uint64_t)in[5]) << 40; /* fall through */
    case 5: b |= ((uint64_t)in[4]) << 32; /* fall through */
    case 4: b |= ((uint64_t)in[3]) << 24; /* fall through */
    case 3: b |= ((uint64_t)in[2]) << 16; /* fall through */
    case 2: b |= ((uint64_t)in[1]) << 8;  /* fall through */
    case 1: b |= ((uint64_t)in[0]); break;
    case 0: break;
    }
    v3 ^= b;
    SIPROUND; SIPROUND;
    v0 ^= b;
    v2 ^= 0xee;
    SIPROUND; SIPROUND; SIPROUND; SIPROUND;
    out[0] = v0 ^ v1 ^ v2 ^ v3;
    v1 ^= 0xdd;
    SIPROUND; SIPROUND; SIPROUND; SIPROUND;
    out[1] = v0 ^ v1 ^ v2 ^ v3;
}

int it_digest(IndexTable *t, PyObject *key, uint64_t d[2]) {
    Py_ssize_t n;
    const char *s;
    if (!PyUnicode_Check(key)) {
        PyErr_Format(PyExc_TypeError, "umbp: index keys are str, got %.80s", Py_TYPE(key)->tp_name);
        return -1;
    }
    /* A str never changes, and the entry's reference keeps the object (and so its address) alive. Exact str
     * only: dropping an entry then runs no Python code (a subclass's __del__ could re-enter the table). */
    int exact = PyUnicode_CheckExact(key);
    size_t slot = ((uintptr_t)key >> 4) % IT_SEEN;
    if (exact && t->seen[slot] == key) {
        d[0] = t->seen_d[slot][0];
        d[1] = t->seen_d[slot][1];
        return 0;
    }
    s = PyUnicode_AsUTF8AndSize(key, &n);
    if (s == NULL)
        return -1;
    siphash128((const unsigned char *)s, (size_t)n, t->k0, t->k1, d);
    if (exact) {
        Py_XSETREF(t->seen[slot], Py_NewRef(key));
        t->seen_d[slot][0] = d[0];
        t->seen_d[slot][1] = d[1];
    }
    return 0;
}

#define IT_CELL(d0, h) (((d0) << 32) | ((uint64_t)(h) + 1)) /* the shift keeps d0's low 32 bits */
#define IT_HANDLE(c) ((uint32_t)(c) - 1)

/* A cell's home, from its own bits (the table has at most 2^32 cells). */
static inline uint64_t it_home(const IndexTable *t, uint64_t c) { return (c >> 32) & t->tmask; }

/* The cell holding the row of digest d, or the empty cell where it would go. */
uint64_t it_probe(IndexTable *t, const uint64_t d[2]) {
    uint64_t i = d[0] & t->tmask, tag = d[0] & 0xFFFFFFFFu;
    for (;;) {
        uint64_t c = t->table[i];
        if (c == 0)
            return i;
        uint32_t h = IT_HANDLE(c);
        if ((c >> 32) == tag && t->dig[2 * h] == d[0] && t->dig[2 * h + 1] == d[1])
            return i;
        i = (i + 1) & t->tmask;
    }
}

uint32_t it_find(IndexTable *t, const uint64_t d[2]) {
    uint64_t c = t->table[it_probe(t, d)];
    return c ? IT_HANDLE(c) : IT_NIL;
}

int it_rehash(IndexTable *t, uint64_t size) {
    uint64_t *nt = PyMem_RawCalloc(size, sizeof(uint64_t));
    if (nt == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    uint64_t *old = t->table;
    uint64_t oldsize = old ? t->tmask + 1 : 0;
    t->table = nt;
    t->tmask = size - 1;
    for (uint64_t i = 0; i < oldsize; i++) {
        if (old[i]) { /* keys are distinct: the first empty cell from the home */
            uint64_t j = it_home(t, old[i]);
            while (t->table[j])
                j = (j + 1) & t->tmask;
            t->table[j] = old[i];
        }
    }
    PyMem_RawFree(old);
    return 0;
}

#define IT_GROW(field, type)                                                                             \
    do {                                                                                                \
        void *p = PyMem_RawRealloc(t->field, (size_t)ncap * sizeof(type));                              \
        if (p == NULL)                                                                                  \
            goto nomem;                                                                                 \
        t->field = p;                                                                                   \
    } while (0)

/* Make room for at least `want` rows (0: the next doubling). The new rows are not initialised or listed:
 * rows are taken from `fresh` upwards once the free list is empty, so a large presize costs address
 * space only, until the rows are used (realloc of a large block moves pages, it does not copy them). */
int it_grow_rows(IndexTable *t, uint64_t want) {
    uint64_t ncap = t->cap ? (uint64_t)t->cap * 2 : 1024;
    if (want > ncap)
        ncap = want;
    if (ncap > IT_MAX_ROWS)
        ncap = IT_MAX_ROWS;
    if (ncap <= t->cap) {
        PyErr_SetString(PyExc_MemoryError, "umbp: the DRAM index holds at most 2**31 objects");
        return -1;
    }
    {
        void *p = PyMem_RawRealloc(t->dig, (size_t)ncap * 2 * sizeof(uint64_t));
        if (p == NULL)
            goto nomem;
        t->dig = p;
    }
    IT_GROW(start, int64_t);
    IT_GROW(nbytes, int64_t);
    IT_GROW(cksum, uint64_t);
    IT_GROW(npages, uint32_t);
    IT_GROW(pins, uint32_t);
    IT_GROW(prev_, uint32_t);
    IT_GROW(next_, uint32_t);
    IT_GROW(state, uint8_t);
    if (t->keep_keys) {
        IT_GROW(keys, PyObject *);
        memset(t->keys + t->cap, 0, (size_t)(ncap - t->cap) * sizeof(PyObject *));
    }
    t->cap = (uint32_t)ncap;
    return 0;
nomem:
    PyErr_NoMemory();
    return -1;
}

void it_lru_unlink(IndexTable *t, uint32_t h) {
    uint32_t p = t->prev_[h], n = t->next_[h];
    if (p != IT_NIL) t->next_[p] = n; else t->lru_head = n;
    if (n != IT_NIL) t->prev_[n] = p; else t->lru_tail = p;
    t->lru_pages -= t->npages[h];
}

void it_lru_push(IndexTable *t, uint32_t h) {
    t->prev_[h] = t->lru_tail;
    t->next_[h] = IT_NIL;
    if (t->lru_tail != IT_NIL) t->next_[t->lru_tail] = h; else t->lru_head = h;
    t->lru_tail = h;
    t->lru_pages += t->npages[h];
}

/* Drop row h from the key table (backward-shift deletion) and put it on the free-row list. */
void it_delete(IndexTable *t, uint32_t h) {
    uint64_t i = t->dig[2 * h] & t->tmask, j;
    while (IT_HANDLE(t->table[i]) != h)
        i = (i + 1) & t->tmask;
    for (j = i;;) {
        j = (j + 1) & t->tmask;
        uint64_t c = t->table[j];
        if (c == 0)
            break;
        uint64_t home = it_home(t, c);
        /* move c back to i unless its home lies cyclically in (i, j] */
        int stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            t->table[i] = c;
            i = j;
        }
    }
    t->table[i] = 0;
    PyObject *key = NULL;
    if (t->keep_keys) {
        key = t->keys[h];
        t->keys[h] = NULL;
    }
    t->state[h] = IT_FREE;
    t->next_[h] = t->free_head;
    t->free_head = h;
    t->used--;
    Py_XDECREF(key); /* last, the row gone: a str subclass's __del__ may use the table */
}

/* A Slot (offset, nbytes, checksum or None) for a row starting at page `start`. */
PyObject *it_new_slot(IndexTable *t, long long start, long long nbytes, int has_ck, uint64_t cksum) {
    PyTypeObject *tp = (PyTypeObject *)t->slot_type;
    PyObject *s = tp->tp_alloc(tp, 3);
    if (s == NULL)
        return NULL;
    PyObject *off = PyLong_FromLongLong(start * t->alignment);
    PyObject *nb = PyLong_FromLongLong(nbytes);
    PyObject *ck = has_ck ? PyLong_FromUnsignedLongLong(cksum) : Py_NewRef(Py_None);
    if (off == NULL || nb == NULL || ck == NULL) {
        Py_XDECREF(off); Py_XDECREF(nb); Py_XDECREF(ck); Py_DECREF(s);
        return NULL;
    }
    PyTuple_SET_ITEM(s, 0, off);
    PyTuple_SET_ITEM(s, 1, nb);
    PyTuple_SET_ITEM(s, 2, ck);
    return s;
}

/* A reservation's Slots are made before it looks at the table or the free runs: a Slot is a GC-tracked
 * object, making one can start a garbage collection, and a collection runs finalizers, any Python code,
 * which may reserve or free in this very index. A Slot made for pages not yet chosen holds offset 0 until
 * it_slot_at sets it: an int, whose making starts no collection. */
int it_slot_at(IndexTable *t, PyObject *slot, long long start) {
    PyObject *off = PyLong_FromLongLong(start * t->alignment);
    if (off == NULL)
        return -1;
    PyObject *old = PyTuple_GET_ITEM(slot, 0);
    PyTuple_SET_ITEM(slot, 0, off);
    Py_DECREF(old);
    return 0;
}

/* The key of row h: the str when keep_keys, else its 16-byte digest. */
PyObject *it_key(IndexTable *t, uint32_t h) {
    if (t->keep_keys && t->keys[h] != NULL)
        return Py_NewRef(t->keys[h]);
    return PyBytes_FromStringAndSize((const char *)&t->dig[2 * h], 16);
}

/* Room for one more row (growing the rows or the key table when due); cell is where digest d goes and moves
 * when the key table grows. 0, or -1 with MemoryError set. */
int it_make_room(IndexTable *t, const uint64_t d[2], uint64_t *cell) {
    if (t->free_head == IT_NIL && t->fresh == t->cap && it_grow_rows(t, 0) < 0)
        return -1;
    if ((uint64_t)(t->used + 1) * 2 > t->tmask + 1) { /* keep the load <= 1/2: short probes */
        if (it_rehash(t, (t->tmask + 1) * 2) < 0)
            return -1;
        *cell = it_probe(t, d);
    }
    return 0;
}

/* Rows and key-table cells (load <= 1/2) for `rows` rows in all (<= IT_MAX_ROWS), made now: adding rows up
 * to that count then never grows anything. 0, or -1 with MemoryError set. */
int it_room_for(IndexTable *t, uint64_t rows) {
    if (rows > t->cap && it_grow_rows(t, rows) < 0) /* the rows not in use (free list, never used): cap - used */
        return -1;
    uint64_t size = t->tmask + 1;
    while (size < 2 * rows)
        size *= 2;
    return size > t->tmask + 1 ? it_rehash(t, size) : 0;
}

/* A new pending row for digest d at the empty cell (after it_make_room). Allocates nothing, so it cannot
 * fail, and runs no Python code: callers make the row's Slot first (see it_slot_at), and a reservation
 * that runs out of memory changes nothing. */
void it_put_row(IndexTable *t, PyObject *key, const uint64_t d[2], uint64_t cell, long long start,
                uint32_t npages, long long nbytes) {
    uint32_t h = t->free_head;
    if (h != IT_NIL)
        t->free_head = t->next_[h];
    else
        h = t->fresh++;
    t->dig[2 * h] = d[0];
    t->dig[2 * h + 1] = d[1];
    t->start[h] = start;
    t->npages[h] = npages;
    t->nbytes[h] = nbytes;
    t->pins[h] = 0;
    t->state[h] = IT_PENDING;
    t->prev_[h] = t->next_[h] = IT_NIL;
    if (t->keep_keys)
        t->keys[h] = Py_NewRef(key);
    t->table[cell] = IT_CELL(d[0], h);
    t->used++;
    t->reserved++;
}

/* qsort's order of uint64 values (IndexTable.remove and clear, PageRuns.reserve_rows). */
int it_cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}
