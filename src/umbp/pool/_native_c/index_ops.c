/* umbp.pool._native, IndexTable (2 of 2): the table's Python methods (state, add, commit, abort, lookup, pin,
 * unpin, remove, clear, evict, ...) and its type, umbp.pool._native.IndexTable. The rows, key table and LRU
 * they work on, and why the table is laid out so, are in index_table.c.
 */
#include "native.h"

static int it_find_key(IndexTable *t, PyObject *key, uint32_t *h) {
    uint64_t d[2];
    if (it_digest(t, key, d) < 0)
        return -1;
    *h = it_find(t, d);
    return 0;
}

/* While a method changes several rows and makes Python objects as it goes (Slots, runs, keys), garbage
 * collection is held off: a collection runs finalizers, any Python code, which could read or change this
 * table half-way through, e.g. pin a row between its leaving the LRU and its deletion, and be handed pages
 * about to be freed. What the method makes meanwhile is collected later. */
static int it_gc_hold(void) {
    return PyGC_Disable();
}

static void it_gc_release(int was_enabled) {
    if (was_enabled)
        PyGC_Enable();
}

/* The digests of a sequence's keys, computed before a method changes anything: a bad key (not a str, or a
 * str UTF-8 cannot encode) then raises with the table as it was; found half-way, it left the keys before
 * it pinned, or their pages in no row and never handed back. `extra` more words are allocated after the
 * 2 * n digest words for the caller. NULL with an error set, or a PyMem_RawMalloc block. */
static uint64_t *it_digests(IndexTable *t, PyObject *seq, size_t extra) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    uint64_t *d = PyMem_RawMalloc(((size_t)n * 2 + extra + 1) * sizeof(uint64_t));
    if (d == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (it_digest(t, PySequence_Fast_GET_ITEM(seq, i), d + 2 * i) < 0) {
            PyMem_RawFree(d);
            return NULL;
        }
    }
    return d;
}

static PyObject *it_slot(IndexTable *t, uint32_t h) {
    return it_new_slot(t, t->start[h], t->nbytes[h], (t->state[h] & IT_HAS_CK) != 0, t->cksum[h]);
}

static PyObject *it_run(IndexTable *t, uint32_t h) {
    return Py_BuildValue("(LI)", (long long)t->start[h], (unsigned int)t->npages[h]);
}

static int IndexTable_init(IndexTable *t, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"seed", "alignment", "slot_type", "keep_keys", NULL};
    Py_buffer seed;
    long long alignment;
    PyObject *slot_type;
    int keep_keys;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*LOp", kwlist, &seed, &alignment, &slot_type, &keep_keys))
        return -1;
    if (seed.len != 16 || !PyType_Check(slot_type) ||
        !PyType_IsSubtype((PyTypeObject *)slot_type, &PyTuple_Type) || alignment <= 0) {
        PyBuffer_Release(&seed);
        PyErr_SetString(PyExc_ValueError, "umbp: IndexTable(seed: 16 bytes, alignment > 0, slot_type: tuple type)");
        return -1;
    }
    memcpy(&t->k0, seed.buf, 8);
    memcpy(&t->k1, (char *)seed.buf + 8, 8);
    PyBuffer_Release(&seed);
    t->alignment = alignment;
    t->slot_type = Py_NewRef(slot_type);
    t->keep_keys = keep_keys;
    t->free_head = IT_NIL;
    t->lru_head = t->lru_tail = IT_NIL;
    if (it_grow_rows(t, 0) < 0 || it_rehash(t, 4096) < 0)
        return -1;
    return 0;
}

/* Made and set up in one step (as PageRuns_new). */
static PyObject *IndexTable_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    IndexTable *t = (IndexTable *)type->tp_alloc(type, 0);
    if (t != NULL && IndexTable_init(t, args, kw) < 0)
        Py_CLEAR(t);
    return (PyObject *)t;
}

static void IndexTable_dealloc(IndexTable *t) {
    if (t->keys != NULL) {
        for (uint32_t h = 0; h < t->fresh; h++)
            Py_XDECREF(t->keys[h]);
    }
    PyMem_RawFree(t->keys);
    PyMem_RawFree(t->dig);
    PyMem_RawFree(t->start);
    PyMem_RawFree(t->nbytes);
    PyMem_RawFree(t->cksum);
    PyMem_RawFree(t->npages);
    PyMem_RawFree(t->pins);
    PyMem_RawFree(t->prev_);
    PyMem_RawFree(t->next_);
    PyMem_RawFree(t->state);
    PyMem_RawFree(t->table);
    for (size_t i = 0; i < IT_SEEN; i++)
        Py_XDECREF(t->seen[i]);
    Py_XDECREF(t->slot_type);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

/* state(key) -> 0 absent, 1 pending, 2 committed, 3 busy (removed while pinned or being written) */
static PyObject *IndexTable_state(IndexTable *t, PyObject *key) {
    uint32_t h;
    if (it_find_key(t, key, &h) < 0)
        return NULL;
    if (h == IT_NIL)
        return PyLong_FromLong(0);
    switch (IT_STATE(t, h)) {
    case IT_PENDING: return PyLong_FromLong(1);
    case IT_COMMITTED: return PyLong_FromLong(2);
    default: return PyLong_FromLong(3);
    }
}

/* add(key, start, npages, nbytes) -> Slot: a new pending row; the caller checked the key is absent. */
static PyObject *IndexTable_add(IndexTable *t, PyObject *args) {
    PyObject *key;
    long long start, nbytes;
    unsigned long long npages;
    uint64_t d[2];
    if (!PyArg_ParseTuple(args, "ULKL", &key, &start, &npages, &nbytes))
        return NULL;
    if (npages > IT_MAX_PAGES) {
        PyErr_SetString(PyExc_OverflowError, "umbp: an object of more than 2**32 - 1 pages");
        return NULL;
    }
    /* the table keeps exact str keys: dropping one then runs no Python code (a subclass's __del__ could) */
    PyObject *exact = PyUnicode_CheckExact(key) ? Py_NewRef(key) : PyUnicode_FromObject(key), *slot = NULL;
    if (exact == NULL)
        return NULL;
    key = exact;
    slot = it_new_slot(t, start, nbytes, 0, 0); /* first: see it_slot_at */
    if (slot == NULL || it_digest(t, key, d) < 0)
        goto fail;
    uint64_t cell = it_probe(t, d);
    if (t->table[cell] != 0) {
        PyErr_SetString(PyExc_KeyError, "umbp: IndexTable.add of a key already present");
        goto fail;
    }
    if (it_make_room(t, d, &cell) < 0)
        goto fail;
    it_put_row(t, key, d, cell, start, (uint32_t)npages, nbytes);
    Py_DECREF(exact);
    return slot;
fail:
    Py_DECREF(exact);
    Py_XDECREF(slot);
    return NULL;
}

/* commit(key, checksum) -> 1 committed, -1 no reservation, 0 removed meanwhile (nothing changed: abort it). */
static PyObject *IndexTable_commit(IndexTable *t, PyObject *const *args, Py_ssize_t nargs) {
    uint32_t h;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "umbp: IndexTable.commit(key, checksum)");
        return NULL;
    }
    PyObject *key = args[0], *ck = args[1];
    if (it_find_key(t, key, &h) < 0)
        return NULL;
    if (h == IT_NIL || (IT_STATE(t, h) != IT_PENDING && IT_STATE(t, h) != IT_PENDING_DOOMED))
        return PyLong_FromLong(-1);
    if (ck != Py_None) {
        unsigned long long v = PyLong_AsUnsignedLongLong(ck);
        if (v == (unsigned long long)-1 && PyErr_Occurred())
            return NULL;
        t->cksum[h] = v;
    }
    if (IT_STATE(t, h) == IT_PENDING_DOOMED) /* removed meanwhile: the caller aborts it (PageRuns.hand_back) */
        return PyLong_FromLong(0);
    t->reserved--;
    t->state[h] = IT_COMMITTED | (ck != Py_None ? IT_HAS_CK : 0);
    it_lru_push(t, h);
    t->live++;
    t->live_bytes += t->nbytes[h];
    return PyLong_FromLong(1);
}

/* abort(key) -> (start, npages) to free, or None without a reservation. */
PyObject *IndexTable_abort(IndexTable *t, PyObject *key) {
    uint32_t h;
    if (it_find_key(t, key, &h) < 0)
        return NULL;
    if (h == IT_NIL || (IT_STATE(t, h) != IT_PENDING && IT_STATE(t, h) != IT_PENDING_DOOMED))
        Py_RETURN_NONE;
    int gc = it_gc_hold();
    PyObject *run = it_run(t, h); /* first: on failure nothing changed */
    if (run != NULL) {
        t->reserved--;
        if (IT_STATE(t, h) == IT_PENDING_DOOMED)
            t->deferred--;
        it_delete(t, h);
    }
    it_gc_release(gc);
    return run;
}

/* lookup(keys, touch) -> [bool]: committed keys; touch moves hits to the LRU's recent end. */
static PyObject *IndexTable_lookup(IndexTable *t, PyObject *args) {
    PyObject *keys;
    int touch;
    if (!PyArg_ParseTuple(args, "Op", &keys, &touch))
        return NULL;
    PyObject *seq = PySequence_Fast(keys, "umbp: lookup() takes a sequence of keys");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        uint32_t h;
        if (it_find_key(t, PySequence_Fast_GET_ITEM(seq, i), &h) < 0) {
            Py_CLEAR(out);
            break;
        }
        int hit = h != IT_NIL && IT_STATE(t, h) == IT_COMMITTED;
        if (hit && touch && t->pins[h] == 0) {
            it_lru_unlink(t, h);
            it_lru_push(t, h);
        }
        PyList_SET_ITEM(out, i, PyBool_FromLong(hit));
    }
    Py_DECREF(seq);
    return out;
}

static PyObject *IndexTable_contains(IndexTable *t, PyObject *key) {
    uint32_t h;
    if (!PyUnicode_Check(key))
        Py_RETURN_FALSE;
    if (it_find_key(t, key, &h) < 0)
        return NULL;
    return PyBool_FromLong(h != IT_NIL && IT_STATE(t, h) == IT_COMMITTED);
}

static PyObject *IndexTable_slot_of(IndexTable *t, PyObject *key) {
    uint32_t h;
    if (it_find_key(t, key, &h) < 0)
        return NULL;
    if (h == IT_NIL || IT_STATE(t, h) != IT_COMMITTED)
        Py_RETURN_NONE;
    return it_slot(t, h);
}

/* pin(keys) -> [Slot | None]. All or nothing: every key is hashed and every Slot made before the first pin,
 * so a bad key or a failed allocation leaves no key pinned (a pin the caller never got could never be
 * undone: its pages would stay out of reach of eviction for good). */
static PyObject *IndexTable_pin(IndexTable *t, PyObject *keys) {
    PyObject *seq = PySequence_Fast(keys, "umbp: pin() takes a sequence of keys");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    uint64_t *d = it_digests(t, seq, 0);
    PyObject *out = d != NULL ? PyList_New(n) : NULL;
    int gc = it_gc_hold(); /* from the Slots to the pins nothing else may change the rows */
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        uint32_t h = it_find(t, d + 2 * i);
        PyObject *item = h != IT_NIL && IT_STATE(t, h) == IT_COMMITTED ? it_slot(t, h) : Py_NewRef(Py_None);
        if (item == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, item);
    }
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) { /* allocates nothing: cannot fail */
        if (PyList_GET_ITEM(out, i) == Py_None)
            continue;
        uint32_t h = it_find(t, d + 2 * i);
        if (t->pins[h] == 0) {
            it_lru_unlink(t, h);
            t->pinned++;
        }
        t->pins[h]++;
    }
    it_gc_release(gc);
    PyMem_RawFree(d);
    Py_DECREF(seq);
    return out;
}

/* Remove row h: a committed row is removed (1), its pages handed back now if unpinned (see it_frees_now),
 * else by its last unpin; a pending row is doomed (0), its pages handed back by its commit or abort.
 * Allocates nothing and cannot fail: the caller made the run it hands back first (it_runs_ahead). */
static int it_remove_row(IndexTable *t, uint32_t h) {
    int st = IT_STATE(t, h);
    if (st == IT_PENDING) {
        t->state[h] = IT_PENDING_DOOMED;
        t->deferred++;
        return 0;
    }
    if (st != IT_COMMITTED)
        return 0;
    t->live--;
    t->live_bytes -= t->nbytes[h];
    if (t->pins[h]) {
        t->state[h] = IT_DOOMED;
        t->deferred++;
        return 1;
    }
    it_lru_unlink(t, h);
    it_delete(t, h);
    return 1;
}

/* Whether removing row h hands its pages back now. */
static int it_frees_now(IndexTable *t, uint32_t h) {
    return IT_STATE(t, h) == IT_COMMITTED && t->pins[h] == 0;
}

/* Whether an unpin of row h may hand its pages back (a removed row's pin; the last one does). */
static int it_doomed(IndexTable *t, uint32_t h) {
    return IT_STATE(t, h) == IT_DOOMED && t->pins[h] > 0;
}

/* Pages handed back must reach the caller, and making a run's tuple can fail; so remove and unpin make
 * them before they change anything: runs[i] for each key i whose row `frees` (NULL for the others), the
 * list to hand them back in, with room for all of them (filled with PyList_SET_ITEM, its length set at the
 * end: appending can fail too), and the method's 2-tuple answer. 0, or -1 with an error set and nothing
 * made. */
static int it_runs_ahead(IndexTable *t, const uint64_t *d, Py_ssize_t n, int (*frees)(IndexTable *, uint32_t),
                         PyObject ***runs, PyObject **freed, PyObject **res) {
    Py_ssize_t count = 0;
    *freed = NULL;
    if ((*res = PyTuple_New(2)) == NULL)
        return -1;
    *runs = PyMem_RawCalloc((size_t)n + 1, sizeof(PyObject *));
    if (*runs == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t h = it_find(t, d + 2 * i);
        if (h == IT_NIL || !frees(t, h))
            continue;
        if (((*runs)[i] = it_run(t, h)) == NULL)
            goto fail;
        count++;
    }
    if ((*freed = PyList_New(count)) != NULL)
        return 0;
fail:
    for (Py_ssize_t i = 0; *runs != NULL && i < n; i++)
        Py_XDECREF((*runs)[i]);
    PyMem_RawFree(*runs);
    *runs = NULL;
    Py_CLEAR(*res);
    return -1;
}

/* it_runs_ahead's list with the runs actually handed back (`used` of them), and the unused runs dropped. */
static PyObject *it_runs_done(PyObject **runs, Py_ssize_t n, PyObject *freed, Py_ssize_t used) {
    for (Py_ssize_t i = 0; i < n; i++)
        Py_XDECREF(runs[i]);
    PyMem_RawFree(runs);
    Py_SET_SIZE(freed, used); /* (the items past it were never set) */
    return freed;
}

/* remove(keys) -> (removed, [(start, npages) to free]). All or nothing: every key hashed, every run and the
 * answer made first (it_digests, it_runs_ahead; `removed` counted as the distinct committed rows). */
PyObject *IndexTable_remove(IndexTable *t, PyObject *keys) {
    PyObject *seq = PySequence_Fast(keys, "umbp: remove() takes an iterable of keys"), *freed, **runs, *res = NULL;
    Py_ssize_t n = seq != NULL ? PySequence_Fast_GET_SIZE(seq) : 0, committed = 0, used = 0;
    uint64_t *d = seq != NULL ? it_digests(t, seq, (size_t)n) : NULL;
    if (d == NULL) {
        Py_XDECREF(seq);
        return NULL;
    }
    uint64_t *rows = d + 2 * n;
    int gc = it_gc_hold(); /* the rows as it_runs_ahead saw them until the last one is removed */
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t h = it_find(t, d + 2 * i);
        if (h != IT_NIL && IT_STATE(t, h) == IT_COMMITTED)
            rows[committed++] = h;
    }
    qsort(rows, (size_t)committed, sizeof(uint64_t), it_cmp_u64); /* a key given twice is removed once */
    Py_ssize_t removed = 0;
    for (Py_ssize_t i = 0; i < committed; i++)
        removed += i == 0 || rows[i] != rows[i - 1];
    PyObject *count = PyLong_FromSsize_t(removed);
    if (count != NULL && it_runs_ahead(t, d, n, it_frees_now, &runs, &freed, &res) == 0) {
        for (Py_ssize_t i = 0; i < n; i++) {
            uint32_t h = it_find(t, d + 2 * i);
            if (h == IT_NIL)
                continue;
            int now = it_frees_now(t, h);
            it_remove_row(t, h);
            if (now) {
                PyList_SET_ITEM(freed, used++, runs[i]);
                runs[i] = NULL;
            }
        }
        PyTuple_SET_ITEM(res, 0, Py_NewRef(count));
        PyTuple_SET_ITEM(res, 1, it_runs_done(runs, n, freed, used));
    }
    Py_XDECREF(count);
    it_gc_release(gc);
    PyMem_RawFree(d);
    Py_XDECREF(seq);
    return res;
}

/* clear() -> (removed, [(start, npages) to free] in page order): every committed row removed, every pending
 * one doomed. The answer made first: on failure nothing changed. */
PyObject *IndexTable_clear(IndexTable *t, PyObject *unused) {
    int gc = it_gc_hold(); /* from the count of the runs to the last row removed */
    Py_ssize_t m = 0;
    for (uint32_t h = 0; h < t->fresh; h++)
        m += it_frees_now(t, h);
    uint64_t *v = PyMem_RawMalloc(((size_t)m * 2 + 1) * sizeof(uint64_t));
    PyObject *res = v != NULL ? Py_BuildValue("(nN)", t->live, PyList_New(m)) : PyErr_NoMemory();
    if (res == NULL) {
        it_gc_release(gc);
        PyMem_RawFree(v);
        return NULL;
    }
    Py_ssize_t k = 0;
    for (uint32_t h = 0; h < t->fresh; h++) {
        if (it_frees_now(t, h)) {
            v[2 * k] = (uint64_t)t->start[h];
            v[2 * k++ + 1] = t->npages[h];
        }
    }
    qsort(v, (size_t)m, 2 * sizeof(uint64_t), it_cmp_u64); /* page order: see DramIndex.clear */
    PyObject *freed = PyTuple_GET_ITEM(res, 1);
    for (Py_ssize_t i = 0; res != NULL && i < m; i++) {
        PyObject *run = Py_BuildValue("(KK)", (unsigned long long)v[2 * i], (unsigned long long)v[2 * i + 1]);
        if (run == NULL)
            Py_CLEAR(res);
        else
            PyList_SET_ITEM(freed, i, run);
    }
    for (uint32_t h = 0; res != NULL && h < t->fresh; h++) {
        if (IT_STATE(t, h) != IT_FREE)
            it_remove_row(t, h);
    }
    it_gc_release(gc);
    PyMem_RawFree(v);
    return res;
}

/* unpin(keys) -> ([(start, npages) to free], first key without a pin or None). Stops at that key. Every key
 * hashed, every run and the answer made first (it_digests, it_runs_ahead). */
PyObject *IndexTable_unpin(IndexTable *t, PyObject *keys) {
    PyObject *seq = PySequence_Fast(keys, "umbp: unpin() takes an iterable of keys"), *freed, **runs, *res = NULL;
    uint64_t *d = seq != NULL ? it_digests(t, seq, 0) : NULL;
    Py_ssize_t n = d != NULL ? PySequence_Fast_GET_SIZE(seq) : 0, used = 0;
    PyObject *bad = Py_None;
    if (d != NULL) {
        int gc = it_gc_hold();
        if (it_runs_ahead(t, d, n, it_doomed, &runs, &freed, &res) == 0) {
            for (Py_ssize_t i = 0; i < n; i++) {
                uint32_t h = it_find(t, d + 2 * i);
                int st = h == IT_NIL ? IT_FREE : IT_STATE(t, h);
                if ((st != IT_COMMITTED && st != IT_DOOMED) || t->pins[h] == 0) {
                    bad = PySequence_Fast_GET_ITEM(seq, i);
                    break;
                }
                if (--t->pins[h])
                    continue;
                t->pinned--;
                if (st == IT_COMMITTED) {
                    it_lru_push(t, h); /* a read is a use: most recently used */
                    continue;
                }
                PyList_SET_ITEM(freed, used++, runs[i]); /* the removed row's last pin: its pages go back */
                runs[i] = NULL;
                t->deferred--;
                it_delete(t, h);
            }
            PyTuple_SET_ITEM(res, 0, it_runs_done(runs, n, freed, used));
            PyTuple_SET_ITEM(res, 1, Py_NewRef(bad));
        }
        it_gc_release(gc);
    }
    PyMem_RawFree(d);
    Py_XDECREF(seq);
    return res;
}

/* evict() -> (key, Slot, start, npages) of the least recently used unpinned committed row, removed; or None. */
PyObject *IndexTable_evict(IndexTable *t, PyObject *unused) {
    uint32_t h = t->lru_head;
    if (h == IT_NIL)
        Py_RETURN_NONE;
    int gc = it_gc_hold(); /* h stays the LRU's head while its answer is made */
    PyObject *res = Py_BuildValue("(NNLI)", it_key(t, h), it_slot(t, h), (long long)t->start[h],
                                  (unsigned int)t->npages[h]);
    it_gc_release(gc);
    if (res == NULL)
        return NULL;
    it_lru_unlink(t, h);
    t->live--;
    t->live_bytes -= t->nbytes[h];
    it_delete(t, h);
    return res;
}

/* rows() -> [(key, start, npages, state)] of every row holding pages; for tests and debugging. */
static PyObject *IndexTable_rows(IndexTable *t, PyObject *unused) {
    static const char *names[] = {"free", "reserved", "committed", "reserved", "doomed"};
    PyObject *out = PyList_New(0);
    for (uint32_t h = 0; out != NULL && h < t->fresh; h++) {
        int st = IT_STATE(t, h);
        if (st == IT_FREE)
            continue;
        PyObject *row = Py_BuildValue("(NLIs)", it_key(t, h), (long long)t->start[h], (unsigned int)t->npages[h],
                                      names[st]);
        if (row == NULL || PyList_Append(out, row) < 0)
            Py_CLEAR(out);
        Py_XDECREF(row);
    }
    return out;
}

/* presize(rows): room for `rows` objects without growing: the rows (address space, see it_grow_rows) and
 * a key table of at least 2 * rows cells (load <= 1/2). Growing is what pauses: doubling the key table
 * re-inserts every key (~1 s at 16 M), so an owner that knows its most objects (capacity / smallest object)
 * sizes the table once, before serving. */
static PyObject *IndexTable_presize(IndexTable *t, PyObject *arg) {
    unsigned long long rows = PyLong_AsUnsignedLongLong(arg);
    if (rows == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (it_room_for(t, rows > IT_MAX_ROWS ? IT_MAX_ROWS : rows) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* counters() -> (live, reserved, pinned, deferred, lru_pages, live_bytes, table bytes: the key table and the
 * rows ever used, i.e. the memory the table has touched; presized rows never used cost address space only) */
static PyObject *IndexTable_counters(IndexTable *t, PyObject *unused) {
    size_t per_row = 2 * sizeof(uint64_t) + 2 * sizeof(int64_t) + sizeof(uint64_t) + 4 * sizeof(uint32_t) + 1 +
                     (t->keep_keys ? sizeof(PyObject *) : 0);
    size_t mem = (size_t)t->fresh * per_row + (size_t)(t->tmask + 1) * sizeof(uint64_t); /* rows in use once */
    return Py_BuildValue("(nnnnLLn)", t->live, t->reserved, t->pinned, t->deferred, (long long)t->lru_pages,
                         (long long)t->live_bytes, (Py_ssize_t)mem);
}

static Py_ssize_t IndexTable_len(IndexTable *t) { return t->live; }

static PyMethodDef IndexTable_methods[] = {
    {"state", (PyCFunction)IndexTable_state, METH_O, NULL},
    {"add", (PyCFunction)IndexTable_add, METH_VARARGS, NULL},
    {"commit", (PyCFunction)(void (*)(void))IndexTable_commit, METH_FASTCALL, NULL},
    {"abort", (PyCFunction)IndexTable_abort, METH_O, NULL},
    {"lookup", (PyCFunction)IndexTable_lookup, METH_VARARGS, NULL},
    {"contains", (PyCFunction)IndexTable_contains, METH_O, NULL},
    {"slot_of", (PyCFunction)IndexTable_slot_of, METH_O, NULL},
    {"pin", (PyCFunction)IndexTable_pin, METH_O, NULL},
    {"unpin", (PyCFunction)IndexTable_unpin, METH_O, NULL},
    {"remove", (PyCFunction)IndexTable_remove, METH_O, NULL},
    {"clear", (PyCFunction)IndexTable_clear, METH_NOARGS, NULL},
    {"evict", (PyCFunction)IndexTable_evict, METH_NOARGS, NULL},
    {"rows", (PyCFunction)IndexTable_rows, METH_NOARGS, NULL},
    {"counters", (PyCFunction)IndexTable_counters, METH_NOARGS, NULL},
    {"presize", (PyCFunction)IndexTable_presize, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef IndexTable_members[] = {
    {"lru_pages", T_LONGLONG, offsetof(IndexTable, lru_pages), READONLY, "pages of evictable objects"},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods IndexTable_as_seq = {.sq_length = (lenfunc)IndexTable_len};

PyTypeObject IndexTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "umbp.pool._native.IndexTable",
    .tp_basicsize = sizeof(IndexTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Compact key -> slot table of the DRAM index (see umbp.pool.dram.index).",
    .tp_new = IndexTable_new,
    .tp_dealloc = (destructor)IndexTable_dealloc,
    .tp_methods = IndexTable_methods,
    .tp_members = IndexTable_members,
    .tp_as_sequence = &IndexTable_as_seq,
};
