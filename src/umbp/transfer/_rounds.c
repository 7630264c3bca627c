/* umbp.transfer._rounds: a transfer batch cut into rounds and laid out in device staging, in one call.
 *
 * Why: a restore's first copy can be issued only once its round's arena slots are sorted into runs of
 * adjacent slots and placed in staging. In numpy that is ~30 small calls (plans.round_bounds and
 * plans.plan_rounds), each a few microseconds of interpreter on a slow host: 0.1-0.2 ms in front of
 * the first copy of an 8K-token restore on the H200's host, whose copy takes 0.85 ms. Here it is one
 * pass over the objects. plans.py keeps the numpy twin, which gives identical results (tests compare
 * them); the extension is optional.
 *
 * lay_out(offs, size, reach, budgets, cap, run_pad, out) -> (rounds, runs)
 *   offs, size, reach: int64 per object in batch order (arena offset, object bytes, slot reach), checked
 *   by the engine already (offsets >= 0). budgets: staging bytes per round (a tuple of ints; empty: one
 *   round of everything). Round k takes the longest run of objects whose costs (reach + run_pad) add up
 *   to at most budgets[k] (the last budget and any round past it: max(cap, last budget)), at least one.
 *   out: writable int64 buffer of at least 8 n + 4 words, filled as
 *     bounds[rounds + 1], pos[n], first_run[rounds + 1], totals[rounds], start[runs], base[runs],
 *     length[runs]
 *   pos: each object's staging offset within its round's buffer (batch order); runs: per round, slots
 *   sorted by offset (ties by batch order) and cut where one slot does not begin exactly where the one
 *   before reaches; each run's staging run_pad-aligned, after the round's runs before it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_radix.h"

static int get_int64s(PyObject *obj, Py_buffer *view, const char *name, Py_ssize_t n, int writable) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    if (view->itemsize != 8 || (strcmp(f, "l") && strcmp(f, "q") && strcmp(f, "<q") && strcmp(f, "=q") &&
                                strcmp(f, "<l") && strcmp(f, "=l"))) {
        PyErr_Format(PyExc_TypeError, "lay_out: %s must be an int64 buffer", name);
        PyBuffer_Release(view);
        return -1;
    }
    if (n >= 0 && view->len / 8 < n) {
        PyErr_Format(PyExc_ValueError, "lay_out: %s holds %zd values, needs %zd", name, view->len / 8, n);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(lay_out_doc, "lay_out(offs, size, reach, budgets, cap, run_pad, out) -> (rounds, runs)\n\n"
                          "Cut a batch into rounds and lay each out in staging (see the module comment).");

static PyObject *lay_out(PyObject *self, PyObject *args) {
    PyObject *o_offs, *o_size, *o_reach, *budgets, *o_out;
    long long cap, run_pad;
    if (!PyArg_ParseTuple(args, "OOOO!LLO:lay_out", &o_offs, &o_size, &o_reach, &PyTuple_Type, &budgets, &cap,
                          &run_pad, &o_out))
        return NULL;
    if (run_pad <= 0 || (run_pad & (run_pad - 1)))
        return PyErr_Format(PyExc_ValueError, "lay_out: run_pad must be a power of two, got %lld", run_pad);
    Py_buffer vo, vs, vr, vout;
    if (get_int64s(o_offs, &vo, "offs", -1, 0) < 0)
        return NULL;
    Py_ssize_t n = vo.len / 8;
    PyObject *res = NULL;
    uint64_t *keys = NULL;
    int got = 0;
    if (get_int64s(o_size, &vs, "size", n, 0) < 0)
        goto release;
    got = 1;
    if (get_int64s(o_reach, &vr, "reach", n, 0) < 0)
        goto release;
    got = 2;
    if (get_int64s(o_out, &vout, "out", 8 * n + 4, 1) < 0)
        goto release;
    got = 3;
    Py_ssize_t nb = PyTuple_GET_SIZE(budgets);
    long long *budget = PyMem_Malloc(((size_t)nb + 1) * sizeof *budget);
    if (budget == NULL) {
        PyErr_NoMemory();
        goto release;
    }
    for (Py_ssize_t i = 0; i < nb; i++) {
        budget[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(budgets, i));
        if (budget[i] == -1 && PyErr_Occurred()) {
            PyMem_Free(budget);
            goto release;
        }
    }
    const int64_t *offs = vo.buf, *size = vs.buf, *reach = vr.buf;
    int64_t *out = vout.buf;
    int idx_bits = 1;
    while (((Py_ssize_t)1 << idx_bits) < n)
        idx_bits++;
    keys = PyMem_Malloc(2 * ((size_t)n + 1) * sizeof *keys);
    if (keys == NULL) {
        PyMem_Free(budget);
        PyErr_NoMemory();
        goto release;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (offs[i] < 0 || (offs[i] & 7) || ((uint64_t)offs[i] >> 3) >> (64 - idx_bits)) {
            PyMem_Free(budget);
            PyErr_SetString(PyExc_ValueError, "lay_out: an offset is negative, unaligned or too large to sort");
            goto release;
        }
    }
    /* rounds: greedy on the running sum of costs */
    int64_t *bounds = out;
    Py_ssize_t rounds = 0;
    bounds[0] = 0;
    if (nb == 0) {
        if (n > 0)
            bounds[++rounds] = n;
    } else {
        Py_ssize_t i = 0;
        while (i < n) {
            long long room = rounds < nb - 1 ? budget[rounds] : (cap > budget[nb - 1] ? cap : budget[nb - 1]);
            long long used = reach[i] + run_pad;
            Py_ssize_t j = i + 1;
            while (j < n && used + reach[j] + run_pad <= room)
                used += reach[j++] + run_pad;
            bounds[++rounds] = j;
            i = j;
        }
    }
    PyMem_Free(budget);
    int64_t *pos = bounds + rounds + 1;
    int64_t *first_run = pos + n;
    int64_t *totals = first_run + rounds + 1;
    /* runs are written after the totals, at most n of each column: start, base, length side by side
     * in n-long columns first, then packed together once the run count is known */
    int64_t *col = totals + rounds;
    int64_t *start = col, *base = col + n, *length = col + 2 * n;
    uint64_t *tmp = keys + n;
    Py_ssize_t runs = 0;
    for (Py_ssize_t r = 0; r < rounds; r++) {
        Py_ssize_t a = bounds[r], b = bounds[r + 1], m = b - a;
        for (Py_ssize_t i = 0; i < m; i++)
            keys[i] = (((uint64_t)offs[a + i] >> 3) << idx_bits) | (uint64_t)(a + i);
        sort_keys(keys, tmp, m);
        uint64_t mask = ((uint64_t)1 << idx_bits) - 1;
        first_run[r] = runs;
        int64_t staged = 0, run_start = 0, run_base = 0, reach_end = 0;
        Py_ssize_t run_first = 0;
        for (Py_ssize_t i = 0; i <= m; i++) {
            Py_ssize_t obj = i < m ? (Py_ssize_t)(keys[i] & mask) : 0;
            int64_t off = i < m ? offs[obj] : 0;
            if (i == m || i == 0 || off != reach_end) {
                if (i > 0) { /* close the run of keys[run_first:i] */
                    Py_ssize_t last = (Py_ssize_t)(keys[i - 1] & mask);
                    int64_t len = offs[last] + size[last] - run_start;
                    int64_t padded = (len + run_pad - 1) & -run_pad;
                    start[runs] = run_start;
                    base[runs] = run_base;
                    length[runs] = len;
                    runs++;
                    for (Py_ssize_t k = run_first; k < i; k++) {
                        Py_ssize_t o = (Py_ssize_t)(keys[k] & mask);
                        pos[o] = offs[o] - run_start + run_base;
                    }
                    staged = run_base + padded;
                }
                if (i == m)
                    break;
                run_first = i;
                run_start = off;
                run_base = staged;
            }
            reach_end = off + reach[obj];
        }
        totals[r] = staged;
    }
    first_run[rounds] = runs;
    /* pack the three run columns after one another */
    memmove(col + runs, base, (size_t)runs * sizeof *col);
    memmove(col + 2 * runs, length, (size_t)runs * sizeof *col);
    res = Py_BuildValue("nn", rounds, runs);
release:
    PyMem_Free(keys);
    if (got >= 3)
        PyBuffer_Release(&vout);
    if (got >= 2)
        PyBuffer_Release(&vr);
    if (got >= 1)
        PyBuffer_Release(&vs);
    PyBuffer_Release(&vo);
    return res;
}

static PyMethodDef methods[] = {
    {"lay_out", lay_out, METH_VARARGS, lay_out_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_rounds", .m_doc = NULL, .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__rounds(void) { return PyModule_Create(&module); }
