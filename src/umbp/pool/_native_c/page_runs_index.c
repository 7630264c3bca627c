/* umbp.pool._native, PageRuns (2 of 2): the allocator's methods that take an IndexTable and change the table
 * and the free runs in one C call (hand_back, reserve_row, reserve_rows, evict_lru; each one's why at its
 * comment). The allocator itself is in page_runs.c, the table in index_table.c and index_ops.c.
 */
#include "native.h"

/* The run (start, npages) at items `at`, `at + 1` of one of the table's answers back to the free space. The
 * table's own ints, and hand_back made room first: nothing here fails. */
static void pr_free_run(PageRuns *r, PyObject *answer, Py_ssize_t at) {
    pr_free(r, PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(answer, at)),
            PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(answer, at + 1)));
}

/* hand_back(table, op, arg) -> the table's answer, with the pages it took off a row back in this allocator,
 * in one C call: op 0 unpin(arg: keys), 1 remove(arg: keys), 2 clear(), 3 abort(arg: key; also how a commit
 * of a reservation removed meanwhile ends), 4 evict() (answer None or (key, Slot, start, npages)). Room for
 * the runs is made first (one per key at most; per committed row for clear), so once the table has taken
 * pages off its rows nothing can fail before they are free again: with two calls from Python, the
 * interpreter's own allocations in between, or the free's growth, could run out of memory and lose them. */
PyObject *PageRuns_hand_back(PageRuns *r, PyObject *args) {
    IndexTable *t;
    int op;
    PyObject *arg = Py_None, *seq = NULL, *res = NULL;
    if (!PyArg_ParseTuple(args, "O!i|O", &IndexTableType, &t, &op, &arg) || op < 0 || op > 4) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "umbp: PageRuns.hand_back(table, op 0-4, arg)");
        return NULL;
    }
    if (op < 2 && (seq = PySequence_Fast(arg, "umbp: hand_back takes a sequence of keys")) == NULL)
        return NULL;
    Py_ssize_t room = op < 2 ? PySequence_Fast_GET_SIZE(seq) : op == 2 ? t->live : 1;
    if (pr_room_for(r, (uint64_t)room) == 0) {
        switch (op) {
        case 0: res = IndexTable_unpin(t, seq); break;
        case 1: res = IndexTable_remove(t, seq); break;
        case 2: res = IndexTable_clear(t, NULL); break;
        case 3: res = IndexTable_abort(t, arg); break;
        default: res = IndexTable_evict(t, NULL); break;
        }
    }
    if (res != NULL && res != Py_None) { /* (see pr_free_run) */
        if (op < 3) {
            PyObject *runs = PyTuple_GET_ITEM(res, op == 0 ? 0 : 1);
            for (Py_ssize_t i = 0; i < PyList_GET_SIZE(runs); i++)
                pr_free_run(r, PyList_GET_ITEM(runs, i), 0);
        } else {
            pr_free_run(r, res, op == 3 ? 0 : 2);
        }
    }
    Py_XDECREF(seq);
    return res;
}

/* The arguments of reserve_row / reserve_rows: (table, key or keys, nbytes, max_used). 1 with *npages
 * (>= 1 per object) when nbytes is an int in [0, capacity], 0 when it is not (the full path's case), -1 on
 * an error. */
static int rr_args(PageRuns *r, PyObject *const *args, Py_ssize_t nargs, const char *name, IndexTable **t,
                   long long *nbytes, long long *npages, long long *max_used) {
    if (nargs != 4 || !PyObject_TypeCheck(args[0], &IndexTableType)) {
        PyErr_Format(PyExc_TypeError, "umbp: PageRuns.%s(table, keys, nbytes, max_used)", name);
        return -1;
    }
    *t = (IndexTable *)args[0];
    int overflow;
    long long align = (*t)->alignment;
    long long n = PyLong_CheckExact(args[2]) ? PyLong_AsLongLongAndOverflow(args[2], &overflow) : -1;
    *max_used = PyLong_AsLongLong(args[3]);
    if (*max_used == -1 && PyErr_Occurred())
        return -1;
    /* the division first: no overflow in the product (the arena's capacity) */
    if (n < 0 || n / align > r->npages || n > r->npages * align)
        return 0;
    *nbytes = n;
    *npages = n ? (n + align - 1) / align : 1;
    return (unsigned long long)*npages <= IT_MAX_PAGES; /* (a longer object: the full path refuses it) */
}

/* Whether `pages` more pages in use would lift the pages in use above max_used (the high watermark). */
static int rr_over(const PageRuns *r, long long pages, long long max_used) {
    return r->npages - r->free_pages + pages > max_used;
}

/* reserve_row(table, key, nbytes, max_used) -> Slot, or None: DramIndex.reserve's common case in one call
 * and one hash of the key. It answers only an absent exact str key with an int size that fits the arena and
 * whose pages fit in a free run without lifting the pages in use above max_used (the high watermark), i.e. when
 * the Python path would evict nothing. Anything else (a bad argument, a present or busy key, a reservation
 * that must evict or cannot fit) is None with nothing changed, and the caller takes the full path, which
 * gives that case its answer or error. Same slot as the full path (same best-fit run). */
PyObject *PageRuns_reserve_row(PageRuns *r, PyObject *const *args, Py_ssize_t nargs) {
    IndexTable *t;
    long long nbytes = 0, npages = 0, max_used = 0;
    int ok = rr_args(r, args, nargs, "reserve_row", &t, &nbytes, &npages, &max_used);
    if (ok < 0)
        return NULL;
    PyObject *key = args[1];
    if (!ok || !PyUnicode_CheckExact(key) || rr_over(r, npages, max_used))
        Py_RETURN_NONE; /* (the watermark again below, after the Slot: this one only spares making it) */
    PyObject *slot = it_new_slot(t, 0, nbytes, 0, 0); /* before looking at anything: see it_slot_at */
    if (slot == NULL)
        return NULL;
    uint64_t d[2], start;
    if (rr_over(r, npages, max_used))
        goto none;
    if (it_digest(t, key, d) < 0)
        goto fail;
    uint64_t cell = it_probe(t, d);
    if (t->table[cell] != 0)
        goto none;
    if (it_make_room(t, d, &cell) < 0)
        goto fail;
    size_t fit = pr_fit(r, (uint64_t)npages, &start);
    if (fit == r->nlens)
        goto none;
    if (it_slot_at(t, slot, (long long)start) < 0 || pr_take_at(r, fit, (uint64_t)npages) < 0)
        goto fail;
    it_put_row(t, key, d, cell, (long long)start, (uint32_t)npages, nbytes);
    return slot;
none:
    Py_DECREF(slot);
    Py_RETURN_NONE;
fail:
    Py_DECREF(slot);
    return NULL;
}

/* reserve_rows(table, keys, nbytes, max_used) -> [Slot], or None: DramIndex.reserve_many's common case in
 * one call: a list of >= 2 distinct absent exact str keys, one int size that fits the arena, all of whose pages fit
 * in one free run (adjacent slots, in key order) without lifting the pages in use above max_used. Anything
 * else is None with nothing changed, and the caller takes the full path (same slots: the same best-fit run). */
PyObject *PageRuns_reserve_rows(PageRuns *r, PyObject *const *args, Py_ssize_t nargs) {
    IndexTable *t;
    long long nbytes = 0, npages = 0, max_used = 0;
    int ok = rr_args(r, args, nargs, "reserve_rows", &t, &nbytes, &npages, &max_used);
    if (ok < 0)
        return NULL;
    PyObject *keys = args[1];
    Py_ssize_t n = PyList_CheckExact(keys) ? PyList_GET_SIZE(keys) : 0;
    if (!ok || n < 2 || nbytes == 0 || npages > r->npages / n || rr_over(r, npages * n, max_used))
        Py_RETURN_NONE; /* (the watermark again below, after the Slots: this one only spares making them) */
    PyObject *slots = PyList_New(n), *out = NULL; /* the Slots before looking at anything: see it_slot_at */
    if (slots == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *slot = it_new_slot(t, 0, nbytes, 0, 0);
        if (slot == NULL) {
            Py_DECREF(slots);
            return NULL;
        }
        PyList_SET_ITEM(slots, i, slot);
    }
    uint64_t *d = NULL, start;
    if ((uint64_t)n > (uint64_t)(IT_MAX_ROWS - t->used) || rr_over(r, npages * n, max_used))
        goto none;
    if ((d = PyMem_RawMalloc((size_t)n * 3 * sizeof(uint64_t))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t *first = d + 2 * n; /* the digests' first words, sorted: a repeated key shows as a repeat */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        if (!PyUnicode_CheckExact(key)) /* (the full path keeps an exact copy: see IndexTable_add) */
            goto none;
        if (it_digest(t, key, d + 2 * i) < 0)
            goto done;
        if (t->table[it_probe(t, d + 2 * i)] != 0)
            goto none;
        first[i] = d[2 * i];
    }
    qsort(first, (size_t)n, sizeof(uint64_t), it_cmp_u64);
    for (Py_ssize_t i = 1; i < n; i++) {
        if (first[i] == first[i - 1]) /* a repeated key (or, once in ~2^64, two keys sharing a first word) */
            goto none;
    }
    /* room for every row and cell (growing them changes no answer), the Slots' offsets, then the pages:
     * what can fail comes before anything changes */
    if (it_room_for(t, (uint64_t)t->used + (uint64_t)n) < 0)
        goto done;
    size_t fit = pr_fit(r, (uint64_t)(npages * n), &start);
    if (fit == r->nlens)
        goto none;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (it_slot_at(t, PyList_GET_ITEM(slots, i), (long long)(start + (uint64_t)(i * npages))) < 0)
            goto done;
    }
    if (pr_take_at(r, fit, (uint64_t)(npages * n)) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) { /* rows and cells have room (it_room_for): nothing fails here */
        uint64_t cell = it_probe(t, d + 2 * i), page = start + (uint64_t)(i * npages);
        it_put_row(t, PyList_GET_ITEM(keys, i), d + 2 * i, cell, (long long)page, (uint32_t)npages, nbytes);
    }
    out = slots;
    slots = NULL;
    goto done;
none:
    out = Py_NewRef(Py_None);
done:
    Py_XDECREF(slots);
    PyMem_RawFree(d);
    return out;
}

/* evict_lru(table, target_used, budget, max_victims, want_keys) -> (victims, bytes, [keys] or None):
 * DramIndex._make_room's loop for an owner without an eviction callback, in one call. While more than
 * target_used pages are in use, fewer than budget pages were freed and max_victims (< 0: no limit) is not
 * reached, the table's least recently used unpinned committed object is removed and its pages freed
 * here. Same victims, in the same order, as the Python loop (IndexTable.evict + free). */
PyObject *PageRuns_evict_lru(PageRuns *r, PyObject *args) {
    IndexTable *t;
    long long target, budget, victims;
    int want_keys;
    if (!PyArg_ParseTuple(args, "O!LLLp", &IndexTableType, &t, &target, &budget, &victims, &want_keys))
        return NULL;
    PyObject *keys = want_keys ? PyList_New(0) : Py_NewRef(Py_None);
    if (keys == NULL)
        return NULL;
    long long count = 0, nbytes = 0, freed = 0;
    while (r->npages - r->free_pages > target && freed < budget && victims != 0) {
        uint32_t h = t->lru_head;
        if (h == IT_NIL)
            break;
        /* out of memory stops the loop with this victim kept; the victims before it are the answer (they are
         * gone: the caller must count and report them), or the error if there are none */
        if (want_keys) {
            PyObject *key = it_key(t, h);
            if (key == NULL || PyList_Append(keys, key) < 0) {
                Py_XDECREF(key);
                break;
            }
            Py_DECREF(key);
        }
        uint64_t start = (uint64_t)t->start[h], npages = t->npages[h];
        if (npages > 0 && pr_free(r, start, npages) < 0) { /* first: on failure the row keeps its pages */
            if (want_keys) {                                 /* and its key goes back off the list */
                PyObject *last = PyList_GET_ITEM(keys, PyList_GET_SIZE(keys) - 1);
                Py_SET_SIZE(keys, PyList_GET_SIZE(keys) - 1);
                Py_DECREF(last);
            }
            break;
        }
        it_lru_unlink(t, h);
        t->live--;
        t->live_bytes -= t->nbytes[h];
        nbytes += t->nbytes[h];
        it_delete(t, h);
        count++;
        victims--;
        freed += (long long)npages;
    }
    if (PyErr_Occurred()) {
        if (count == 0) {
            Py_DECREF(keys);
            return NULL;
        }
        PyErr_Clear();
    }
    return Py_BuildValue("(LLN)", count, nbytes, keys);
}
