/* umbp.pool._native, copies: buffer lists (a sequence of Python buffers held for a call, also read_frames's
 * destinations) and psum_copy, the pool's copy + checksum of a batch of objects with the GIL released.
 */
#include "native.h"

/* ---- buffer lists -------------------------------------------------------------------------------- */

void views_release(Views *v) {
    for (Py_ssize_t i = 0; i < v->count; i++)
        PyBuffer_Release(&v->views[i]);
    PyMem_Free(v->views);
    v->views = NULL;
    v->count = 0;
}

/* Buffers of seq[lo:hi] (contiguous; writable when asked), or -1 with an exception set. */
int views_acquire(PyObject *seq, Py_ssize_t lo, Py_ssize_t hi, int writable, Views *v) {
    v->count = 0;
    v->views = PyMem_Calloc(hi > lo ? (size_t)(hi - lo) : 1, sizeof(Py_buffer));
    if (v->views == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = lo; i < hi; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(item, &v->views[i - lo], flags) < 0) {
            views_release(v);
            return -1;
        }
        v->count++;
    }
    return 0;
}

/* ---- psum_copy ----------------------------------------------------------------------------------- */

const char psum_copy_doc[] = PyDoc_STR(
"psum_copy(dsts, srcs=None, row0s=None) -> list[int]\n\n"
"For each i: copy srcs[i] into dsts[i] (same length, not overlapping; skipped when srcs is None)\n"
"and return the psum64 of the bytes, all with the GIL released. With row0s, return instead the\n"
"xor of the weighted row values of each buffer as a piece of a larger object starting at row\n"
"row0s[i] (row0s[i] * 4096 bytes in), without the length mix: the pieces of one object xor up\n"
"(see psum.finish).");

PyObject *psum_copy(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"dsts", "srcs", "row0s", NULL};
    PyObject *dsts_in, *srcs_in = Py_None, *row0s_in = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|OO:psum_copy", kwlist, &dsts_in, &srcs_in, &row0s_in))
        return NULL;
    PyObject *dsts = PySequence_Fast(dsts_in, "psum_copy: dsts must be a sequence of buffers");
    if (dsts == NULL)
        return NULL;
    PyObject *srcs = NULL, *out = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(dsts);
    uint64_t *row0 = NULL, *res = NULL;
    Views dv = {0}, sv = {0};
    int copy = srcs_in != Py_None;

    if (copy) {
        srcs = PySequence_Fast(srcs_in, "psum_copy: srcs must be a sequence of buffers");
        if (srcs == NULL)
            goto done;
        if (PySequence_Fast_GET_SIZE(srcs) != n) {
            PyErr_SetString(PyExc_ValueError, "psum_copy: dsts and srcs differ in length");
            goto done;
        }
    }
    row0 = PyMem_Calloc(n ? (size_t)n : 1, sizeof(uint64_t));
    res = PyMem_Calloc(n ? (size_t)n : 1, sizeof(uint64_t));
    if (row0 == NULL || res == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (row0s_in != Py_None) {
        PyObject *r = PySequence_Fast(row0s_in, "psum_copy: row0s must be a sequence of ints");
        if (r == NULL)
            goto done;
        if (PySequence_Fast_GET_SIZE(r) != n) {
            Py_DECREF(r);
            PyErr_SetString(PyExc_ValueError, "psum_copy: dsts and row0s differ in length");
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            row0[i] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(r, i));
            if (PyErr_Occurred()) {
                Py_DECREF(r);
                goto done;
            }
        }
        Py_DECREF(r);
    }
    if (views_acquire(dsts, 0, n, copy, &dv) < 0)
        goto done;
    if (copy) {
        if (views_acquire(srcs, 0, n, 0, &sv) < 0)
            goto done;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (sv.views[i].len != dv.views[i].len) {
                PyErr_Format(PyExc_ValueError, "psum_copy: object %zd: source has %zd bytes, destination %zd",
                             i, sv.views[i].len, dv.views[i].len);
                goto done;
            }
        }
    }
    int whole = row0s_in == Py_None;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        size_t len = (size_t)dv.views[i].len;
        uint64_t h = psum_copy_weighted(dv.views[i].buf, copy ? sv.views[i].buf : NULL, len, row0[i]);
        res[i] = whole ? h ^ ((uint64_t)len * GOLDEN) : h;
    }
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(res[i]);
        if (v == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, v);
    }
done:
    views_release(&dv);
    views_release(&sv);
    PyMem_Free(row0);
    PyMem_Free(res);
    Py_XDECREF(srcs);
    Py_DECREF(dsts);
    return out;
}
