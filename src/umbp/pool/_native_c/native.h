/* umbp.pool._native's internal header: what the extension's files share (the module is one extension,
 * umbp.pool._native, built from every .c file of this folder; see module.c for what it is and why).
 *
 * Only what more than one file uses is declared here; everything else stays static in its file. The shared
 * functions and variables are hidden (NATIVE_INTERNAL): the built module exports PyInit__native alone, as a
 * single file of static functions did.
 */
#ifndef UMBP_POOL_NATIVE_H
#define UMBP_POOL_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <stdint.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "umbp._native assumes a little-endian host (psum64 reads little-endian words)"
#endif

#if defined(__GNUC__) || defined(__clang__)
#define NATIVE_INTERNAL __attribute__((visibility("hidden")))
#else
#define NATIVE_INTERNAL
#endif

/* ---- psum64 (psum.c) ------------------------------------------------------------------------------ */

#define ROW_BYTES 4096
#define GOLDEN 0x9E3779B97F4A7C15ULL

/* The row-value implementation in use: set by psum_init, switched by psum_impl. */
NATIVE_INTERNAL extern uint64_t (*psum_row_value_fn)(const unsigned char *, size_t);

/* A row's value: what the pool's readers (read_frames) and the copies (psum_copy_weighted) take per 4 KiB row. */
static inline uint64_t psum_row_sum(const unsigned char *p, size_t n) { return psum_row_value_fn(p, n); }

NATIVE_INTERNAL void psum_init(void);
NATIVE_INTERNAL uint64_t psum_copy_weighted(unsigned char *dst, const unsigned char *src, size_t n, uint64_t row0);
NATIVE_INTERNAL PyObject *psum_rows(PyObject *self, PyObject *args);
NATIVE_INTERNAL PyObject *psum_impl(PyObject *self, PyObject *args);
NATIVE_INTERNAL extern const char psum_rows_doc[], psum_impl_doc[];

/* ---- buffer lists and psum_copy (copy.c) ------------------------------------------------------------ */

typedef struct {
    Py_buffer *views;
    Py_ssize_t count; /* views acquired so far (released on error too) */
} Views;

NATIVE_INTERNAL void views_release(Views *v);
NATIVE_INTERNAL int views_acquire(PyObject *seq, Py_ssize_t lo, Py_ssize_t hi, int writable, Views *v);
NATIVE_INTERNAL PyObject *psum_copy(PyObject *self, PyObject *args, PyObject *kwargs);
NATIVE_INTERNAL extern const char psum_copy_doc[];

/* ---- read_frames (frames.c), pack_headers (headers.c) ----------------------------------------------- */

NATIVE_INTERNAL PyObject *read_frames(PyObject *self, PyObject *args);
NATIVE_INTERNAL extern const char read_frames_doc[];
NATIVE_INTERNAL void crc_init(void);
NATIVE_INTERNAL PyObject *pack_headers(PyObject *self, PyObject *args);
NATIVE_INTERNAL extern const char pack_headers_doc[];

/* ---- IndexTable (index_table.c: rows, key table, LRU; index_ops.c: its methods and type) ------------- */

#define IT_NIL 0xFFFFFFFFu
#define IT_MAX_ROWS (1u << 31) /* so the key table (<= 2 cells per row) has <= 2^32 cells: see it_home */
#define IT_MAX_PAGES 0xffffffffull /* a row's page count is 32 bits */
enum { IT_FREE = 0, IT_PENDING = 1, IT_COMMITTED = 2, IT_PENDING_DOOMED = 3, IT_DOOMED = 4 };
#define IT_HAS_CK 0x80
#define IT_STATE(t, h) ((t)->state[h] & 0x7f)

#define IT_SEEN 64 /* digests remembered (a save's keys are reserved together, then committed one by one) */

typedef struct {
    PyObject_HEAD
    uint64_t k0, k1;     /* SipHash key */
    int64_t alignment;
    PyObject *slot_type; /* umbp.pool.dram.index.Slot (a tuple subclass) */
    int keep_keys;
    uint32_t cap, used, free_head;       /* rows allocated, rows in use, free-row list (via next_) */
    uint32_t fresh;                     /* rows >= fresh were never used: untouched memory, not on the list */
    uint64_t *dig;                      /* 2 per row */
    int64_t *start, *nbytes;
    uint64_t *cksum;
    uint32_t *npages, *pins, *prev_, *next_;
    uint8_t *state;
    PyObject **keys;                    /* keep_keys only */
    PyObject *seen[IT_SEEN];            /* the str objects hashed lately and their digests, by address: a */
    uint64_t seen_d[IT_SEEN][2];        /* lookup, reserve and commit of one key object hash it once */
    uint64_t *table;                    /* (digest's low 32 bits) << 32 | (handle + 1); 0 = empty */
    uint64_t tmask;                     /* table size - 1 */
    uint32_t lru_head, lru_tail;
    int64_t lru_pages, live_bytes;
    Py_ssize_t live, reserved, pinned, deferred;
} IndexTable;

NATIVE_INTERNAL int it_digest(IndexTable *t, PyObject *key, uint64_t d[2]);
NATIVE_INTERNAL uint64_t it_probe(IndexTable *t, const uint64_t d[2]);
NATIVE_INTERNAL uint32_t it_find(IndexTable *t, const uint64_t d[2]);
NATIVE_INTERNAL int it_rehash(IndexTable *t, uint64_t size);
NATIVE_INTERNAL int it_grow_rows(IndexTable *t, uint64_t want);
NATIVE_INTERNAL void it_lru_unlink(IndexTable *t, uint32_t h);
NATIVE_INTERNAL void it_lru_push(IndexTable *t, uint32_t h);
NATIVE_INTERNAL void it_delete(IndexTable *t, uint32_t h);
NATIVE_INTERNAL PyObject *it_new_slot(IndexTable *t, long long start, long long nbytes, int has_ck, uint64_t cksum);
NATIVE_INTERNAL int it_slot_at(IndexTable *t, PyObject *slot, long long start);
NATIVE_INTERNAL PyObject *it_key(IndexTable *t, uint32_t h);
NATIVE_INTERNAL int it_make_room(IndexTable *t, const uint64_t d[2], uint64_t *cell);
NATIVE_INTERNAL int it_room_for(IndexTable *t, uint64_t rows);
NATIVE_INTERNAL void it_put_row(IndexTable *t, PyObject *key, const uint64_t d[2], uint64_t cell, long long start,
                                uint32_t npages, long long nbytes);
NATIVE_INTERNAL int it_cmp_u64(const void *a, const void *b);

NATIVE_INTERNAL extern PyTypeObject IndexTableType;
NATIVE_INTERNAL PyObject *IndexTable_abort(IndexTable *t, PyObject *key);
NATIVE_INTERNAL PyObject *IndexTable_remove(IndexTable *t, PyObject *keys);
NATIVE_INTERNAL PyObject *IndexTable_clear(IndexTable *t, PyObject *unused);
NATIVE_INTERNAL PyObject *IndexTable_unpin(IndexTable *t, PyObject *keys);
NATIVE_INTERNAL PyObject *IndexTable_evict(IndexTable *t, PyObject *unused);

/* ---- PageRuns (page_runs.c: the allocator and its type; page_runs_index.c: its calls on an IndexTable) -- */

typedef struct {
    PyObject_HEAD
    long long npages, free_pages;
    uint32_t ncap, nfresh, nfree;   /* run nodes: allocated, never used from here, free list (via next) */
    uint64_t *rstart, *rlen;
    uint32_t *prev, *next;          /* FIFO list of the runs of one length */
    uint32_t *by_start, *by_end;    /* node + 1; 0 = empty */
    uint64_t mask;                  /* size of both maps - 1 */
    uint64_t nruns;
    uint64_t *lens;                 /* distinct lengths, sorted */
    uint32_t *head, *tail;
    size_t nlens, lcap;
} PageRuns;

NATIVE_INTERNAL int pr_room_for(PageRuns *r, uint64_t m);
NATIVE_INTERNAL size_t pr_fit(const PageRuns *r, uint64_t n, uint64_t *start);
NATIVE_INTERNAL int pr_take_at(PageRuns *r, size_t i, uint64_t n);
NATIVE_INTERNAL int pr_free(PageRuns *r, uint64_t start, uint64_t length);

NATIVE_INTERNAL extern PyTypeObject PageRunsType;
NATIVE_INTERNAL PyObject *PageRuns_hand_back(PageRuns *r, PyObject *args);
NATIVE_INTERNAL PyObject *PageRuns_reserve_row(PageRuns *r, PyObject *const *args, Py_ssize_t nargs);
NATIVE_INTERNAL PyObject *PageRuns_reserve_rows(PageRuns *r, PyObject *const *args, Py_ssize_t nargs);
NATIVE_INTERNAL PyObject *PageRuns_evict_lru(PageRuns *r, PyObject *args);

#endif /* UMBP_POOL_NATIVE_H */
