/* umbp.transfer._copies: a round's copy-engine copies (one per run of adjacent arena slots) issued in one
 * call.
 *
 * Why: through ctypes, each cudaMemcpyAsync cost ~5 us of a slow host's time and each
 * cudaMemcpyBatchAsync ~20 us (converting three arrays of addresses, building the call's arguments),
 * two or three of them per round of a restore whose copies take ~0.3 ms: host time the copy engine may
 * wait for. Here the runtime's functions are called through their addresses (found by batchcopy.py via
 * ctypes in the CUDA runtime torch loaded, so nothing here links against CUDA and the module builds
 * without it). batchcopy.issue is the Python twin; tests hold both to the same calls.
 *
 * issue(one, batch, fail_index, dst_base, dst_offs, src_base, src_offs, sizes, stream, lead_bytes,
 *       lead_runs) -> None
 *   one: address of cudaMemcpyAsync; batch: address of cudaMemcpyBatchAsync, or 0 (then every run is
 *   copied by `one`); fail_index: 1 for the CUDA 12.8/12.9 batch call, which takes a failIdx
 *   out-parameter before the stream. Run i copies sizes[i] bytes from src_base + src_offs[i] to
 *   dst_base + dst_offs[i] (int64 buffers, one value per run) on `stream` (a cudaStream_t as an int).
 *   With a batch call, the first runs up to lead_bytes (at most lead_runs of them, never all; none when
 *   lead_bytes is 0) go one by one ahead of it, so bytes move while the batch call's fixed cost is spent.
 *   A failing call raises RuntimeError naming the CUDA error.
 *
 * head(one, batch, fail_index, dst_base, offs, ids, run_src, run_stride, run_obj, run_nbytes, count, stream,
 *      lead_bytes, lead_runs) -> None
 *   A cold save's head (head.py): each object's runs of KV memory to its arena slot, split as issue()
 *   splits runs; see head() below. batchcopy.python_head is the Python twin.
 *
 * early(one, stream, dst_base, dst_step, src_base, offsets, nbytes, capacity, count) -> bool
 *   A restore's early copies (early.py), checks first: see early() below. batchcopy.python_early is the
 *   Python twin.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int (*one_fn)(void *dst, const void *src, size_t count, int kind, void *stream);
typedef int (*batch_fn)(void **dsts, void **srcs, size_t *sizes, size_t count, void *attrs, size_t *attrs_idxs,
                        size_t num_attrs, void *stream);
typedef int (*batch_fail_fn)(void **dsts, void **srcs, size_t *sizes, size_t count, void *attrs,
                             size_t *attrs_idxs, size_t num_attrs, size_t *fail_idx, void *stream);

enum { MEMCPY_DEFAULT = 4, SRC_ORDER_STREAM = 1 }; /* cudaMemcpyDefault, cudaMemcpySrcAccessOrderStream */

/* cudaMemcpyAttributes: sources read in stream order (after the kernels queued before); location hints
 * left invalid (they matter only for managed memory) */
struct location {
    int type, id;
};
struct attributes {
    int src_access_order;
    struct location src_hint, dst_hint;
    unsigned int flags;
};

static int int64s(PyObject *obj, Py_buffer *view, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    if (view->itemsize != 8 || (strcmp(f, "l") && strcmp(f, "q") && strcmp(f, "<q") && strcmp(f, "=q") &&
                                strcmp(f, "<l") && strcmp(f, "=l"))) {
        PyErr_Format(PyExc_TypeError, "issue: %s must be an int64 buffer", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Enqueue run i (dsts[i] <- srcs[i], sizes[i] bytes) for i < n on `stream`: with a batch call, the first
 * runs up to lead_bytes (at most lead_runs, never all) one by one, then the rest in one batch call; else
 * every run one by one. Called with the GIL released; 0, or a CUDA error whose call `*in_batch` names and
 * (one by one) the run `*failed_at`. */
static int issue_ptrs(uint64_t one_addr, uint64_t batch_addr, int fail_index, void **dsts, void **srcs,
                      size_t *sizes, Py_ssize_t n, uint64_t stream, long long lead_bytes, Py_ssize_t lead_runs,
                      int *in_batch, Py_ssize_t *failed_at) {
    Py_ssize_t first = n; /* runs copied one by one */
    if (batch_addr) {
        first = 0;
        Py_ssize_t most = lead_runs < n - 1 ? lead_runs : n - 1;
        for (long long queued = 0; lead_bytes > 0 && first < most;) {
            queued += (long long)sizes[first++];
            if (queued >= lead_bytes)
                break;
        }
    }
    int err = 0;
    one_fn one = (one_fn)(uintptr_t)one_addr;
    void *s = (void *)(uintptr_t)stream;
    *in_batch = 0;
    for (Py_ssize_t i = 0; i < first && !err; i++) {
        err = one(dsts[i], srcs[i], sizes[i], MEMCPY_DEFAULT, s);
        *failed_at = i;
    }
    Py_ssize_t count = n - first;
    if (!err && count > 0) {
        struct attributes attrs = {SRC_ORDER_STREAM, {0, 0}, {0, 0}, 0};
        size_t attrs_idx = 0, fail_idx = 0;
        if (fail_index)
            err = ((batch_fail_fn)(uintptr_t)batch_addr)(dsts + first, srcs + first, sizes + first, (size_t)count,
                                                         &attrs, &attrs_idx, 1, &fail_idx, s);
        else
            err = ((batch_fn)(uintptr_t)batch_addr)(dsts + first, srcs + first, sizes + first, (size_t)count,
                                                    &attrs, &attrs_idx, 1, s);
        *in_batch = err != 0;
        *failed_at = first;
    }
    return err;
}

/* The error of a failed issue_ptrs, as one RuntimeError naming the CUDA error; NULL. */
static PyObject *copy_failed(int err, int in_batch, Py_ssize_t n, Py_ssize_t failed_at, const size_t *sizes) {
    if (in_batch)
        return PyErr_Format(PyExc_RuntimeError, "umbp: cudaMemcpyBatchAsync failed with CUDA error %d (%zd copies)",
                            err, n - failed_at);
    return PyErr_Format(PyExc_RuntimeError, "umbp: cudaMemcpyAsync failed with CUDA error %d (%lld bytes)", err,
                        (long long)sizes[failed_at]);
}

/* issue_ptrs over run_arrays' `ptrs` with the GIL released: None, or the RuntimeError of copy_failed. */
static PyObject *issue_all(uint64_t one_addr, uint64_t batch_addr, int fail_index, void **ptrs, Py_ssize_t n,
                           uint64_t stream, long long lead_bytes, Py_ssize_t lead_runs) {
    size_t *sizes = (size_t *)(ptrs + 2 * n);
    int err, in_batch;
    Py_ssize_t failed_at = 0;
    Py_BEGIN_ALLOW_THREADS;
    err = issue_ptrs(one_addr, batch_addr, fail_index, ptrs, ptrs + n, sizes, n, stream, lead_bytes, lead_runs,
                     &in_batch, &failed_at);
    Py_END_ALLOW_THREADS;
    return err ? copy_failed(err, in_batch, n, failed_at, sizes) : Py_NewRef(Py_None);
}

/* Pointer arrays for n runs: dsts, srcs (n each) then sizes (n), in one allocation the caller frees. */
static void **run_arrays(Py_ssize_t n) {
    void **ptrs = malloc((size_t)(n > 0 ? n : 1) * 3 * sizeof(void *));
    if (!ptrs)
        PyErr_NoMemory();
    return ptrs;
}

PyDoc_STRVAR(issue_doc, "issue(one, batch, fail_index, dst_base, dst_offs, src_base, src_offs, sizes, stream, "
                        "lead_bytes, lead_runs) -> None\n\n"
                        "Enqueue one copy per run on a CUDA stream (see the module comment).");

static PyObject *issue(PyObject *self, PyObject *args) {
    unsigned long long one_addr, batch_addr, stream, dst_base, src_base;
    int fail_index;
    long long lead_bytes;
    Py_ssize_t lead_runs;
    PyObject *o_dst, *o_src, *o_sizes;
    if (!PyArg_ParseTuple(args, "KKpKOKOOKLn:issue", &one_addr, &batch_addr, &fail_index, &dst_base, &o_dst,
                          &src_base, &o_src, &o_sizes, &stream, &lead_bytes, &lead_runs))
        return NULL;
    if (!one_addr)
        return PyErr_Format(PyExc_ValueError, "issue: no cudaMemcpyAsync address");
    Py_buffer vd, vs, vn;
    if (int64s(o_dst, &vd, "dst_offs") < 0)
        return NULL;
    if (int64s(o_src, &vs, "src_offs") < 0) {
        PyBuffer_Release(&vd);
        return NULL;
    }
    if (int64s(o_sizes, &vn, "sizes") < 0) {
        PyBuffer_Release(&vd);
        PyBuffer_Release(&vs);
        return NULL;
    }
    Py_ssize_t n = vn.len / 8;
    PyObject *result = NULL;
    void **ptrs = NULL;
    if (vd.len / 8 != n || vs.len / 8 != n) {
        PyErr_Format(PyExc_ValueError, "issue: %zd sizes but %zd destinations and %zd sources", n, vd.len / 8,
                     vs.len / 8);
        goto done;
    }
    const int64_t *doff = vd.buf, *soff = vs.buf, *size = vn.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (size[i] < 0) {
            PyErr_Format(PyExc_ValueError, "issue: run %zd has a negative size", i);
            goto done;
        }
    if (!(ptrs = run_arrays(n)))
        goto done;
    void **dsts = ptrs, **srcs = ptrs + n;
    size_t *sizes = (size_t *)(ptrs + 2 * n);
    for (Py_ssize_t i = 0; i < n; i++) {
        dsts[i] = (void *)(uintptr_t)(dst_base + (uint64_t)doff[i]);
        srcs[i] = (void *)(uintptr_t)(src_base + (uint64_t)soff[i]);
        sizes[i] = (size_t)size[i];
    }
    result = issue_all(one_addr, batch_addr, fail_index, ptrs, n, stream, lead_bytes, lead_runs);
done:
    free(ptrs);
    PyBuffer_Release(&vd);
    PyBuffer_Release(&vs);
    PyBuffer_Release(&vn);
    return result;
}

PyDoc_STRVAR(head_doc, "head(one, batch, fail_index, dst_base, offs, ids, run_src, run_stride, run_obj, run_nbytes, "
                       "count, stream, lead_bytes, lead_runs) -> None\n\n"
                       "Enqueue a save head's copies from KV pages to arena slots (see the module comment).");

/* A cold save's head (head.py): for objects k < count and each run j of the group's objects (run_*: int64
 * arrays, one value per run), copy run_nbytes[j] bytes from run_src[j] + ids[k] * run_stride[j] to
 * dst_base + offs[k] + run_obj[j], object by object, split as issue() splits runs. Why in C: working those
 * addresses out in numpy (a broadcast product, two sums) was ~5 us of a fast host's time and ~20 of a slow
 * one's in front of the save's first copy. */
static PyObject *head(PyObject *self, PyObject *args) {
    unsigned long long one_addr, batch_addr, stream, dst_base;
    int fail_index;
    long long lead_bytes;
    Py_ssize_t count, lead_runs;
    PyObject *o_offs, *o_ids, *o_rsrc, *o_rstride, *o_robj, *o_rn;
    if (!PyArg_ParseTuple(args, "KKpKOOOOOOnKLn:head", &one_addr, &batch_addr, &fail_index, &dst_base, &o_offs,
                          &o_ids, &o_rsrc, &o_rstride, &o_robj, &o_rn, &count, &stream, &lead_bytes, &lead_runs))
        return NULL;
    if (!one_addr)
        return PyErr_Format(PyExc_ValueError, "head: no cudaMemcpyAsync address");
    PyObject *objs[6] = {o_offs, o_ids, o_rsrc, o_rstride, o_robj, o_rn};
    static const char *names[6] = {"offs", "ids", "run_src", "run_stride", "run_obj", "run_nbytes"};
    Py_buffer v[6];
    int got = 0;
    PyObject *result = NULL;
    void **ptrs = NULL;
    for (; got < 6; got++)
        if (int64s(objs[got], &v[got], names[got]) < 0)
            goto done;
    Py_ssize_t runs = v[2].len / 8;
    if (count < 0 || v[0].len / 8 < count || v[1].len / 8 < count || v[3].len / 8 != runs || v[4].len / 8 != runs ||
        v[5].len / 8 != runs) {
        PyErr_Format(PyExc_ValueError, "head: %zd objects of %zd runs do not match the arrays given", count, runs);
        goto done;
    }
    const int64_t *offs = v[0].buf, *ids = v[1].buf, *rsrc = v[2].buf, *rstride = v[3].buf, *robj = v[4].buf,
                  *rn = v[5].buf;
    for (Py_ssize_t j = 0; j < runs; j++)
        if (rn[j] < 0) {
            PyErr_Format(PyExc_ValueError, "head: run %zd has a negative size", j);
            goto done;
        }
    Py_ssize_t n = count * runs;
    if (!(ptrs = run_arrays(n)))
        goto done;
    void **dsts = ptrs, **srcs = ptrs + n;
    size_t *sizes = (size_t *)(ptrs + 2 * n);
    for (Py_ssize_t k = 0, i = 0; k < count; k++)
        for (Py_ssize_t j = 0; j < runs; j++, i++) {
            srcs[i] = (void *)(uintptr_t)((uint64_t)rsrc[j] + (uint64_t)ids[k] * (uint64_t)rstride[j]);
            dsts[i] = (void *)(uintptr_t)(dst_base + (uint64_t)offs[k] + (uint64_t)robj[j]);
            sizes[i] = (size_t)rn[j];
        }
    result = issue_all(one_addr, batch_addr, fail_index, ptrs, n, stream, lead_bytes, lead_runs);
done:
    free(ptrs);
    while (got-- > 0)
        PyBuffer_Release(&v[got]);
    return result;
}

PyDoc_STRVAR(early_doc, "early(one, stream, dst_base, dst_step, src_base, offsets, nbytes, capacity, count) -> bool\n\n"
                        "Copy a restore's first objects into staging, if every offset passes (see the module comment).");

/* A restore's early copies (early.py): object k (k < count) copies nbytes from src_base + offsets[k] to
 * dst_base + k * dst_step with `one` on `stream`. First every one of those offsets is checked as far as its
 * copy needs: an integer (operator.index), 8-byte aligned, its object inside the arena (offset + nbytes <=
 * capacity); if any is not, nothing is copied and the answer is False (the restore then goes the usual
 * way, whose validation names the error). Why in C: in Python the checks, the staging rows and a ctypes
 * call per copy were most of the ~50 us of a slow host's time in front of an 8K restore's first copy. */
static PyObject *early(PyObject *self, PyObject *args) {
    unsigned long long one_addr, stream, dst_base, dst_step, src_base;
    long long nbytes, capacity;
    Py_ssize_t count;
    PyObject *offsets;
    if (!PyArg_ParseTuple(args, "KKKKKOLLn:early", &one_addr, &stream, &dst_base, &dst_step, &src_base, &offsets,
                          &nbytes, &capacity, &count))
        return NULL;
    if (!one_addr)
        return PyErr_Format(PyExc_ValueError, "early: no cudaMemcpyAsync address");
    enum { MOST = 64 };
    if (count <= 0 || count > MOST || nbytes <= 0 || capacity < nbytes)
        Py_RETURN_FALSE;
    long long offs[MOST];
    for (Py_ssize_t k = 0; k < count; k++) {
        PyObject *item = PySequence_GetItem(offsets, k);
        PyObject *index = item ? PyNumber_Index(item) : NULL;
        Py_XDECREF(item);
        int overflow = 0;
        long long off = index ? PyLong_AsLongLongAndOverflow(index, &overflow) : -1;
        Py_XDECREF(index);
        if (PyErr_Occurred() || overflow || off < 0 || (off & 7) || off > capacity - nbytes) {
            PyErr_Clear(); /* a bad offset: no early copies, as the Python twin answers */
            Py_RETURN_FALSE;
        }
        offs[k] = off;
    }
    one_fn one = (one_fn)(uintptr_t)one_addr;
    void *s = (void *)(uintptr_t)stream;
    int err = 0;
    Py_ssize_t k = 0;
    Py_BEGIN_ALLOW_THREADS;
    for (; k < count && !err; k++)
        err = one((void *)(uintptr_t)(dst_base + (uint64_t)k * dst_step),
                  (const void *)(uintptr_t)(src_base + (uint64_t)offs[k]), (size_t)nbytes, MEMCPY_DEFAULT, s);
    Py_END_ALLOW_THREADS;
    if (err)
        return PyErr_Format(PyExc_RuntimeError, "umbp: cudaMemcpyAsync failed with CUDA error %d (%lld bytes)", err,
                            nbytes);
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"issue", issue, METH_VARARGS, issue_doc},
    {"early", early, METH_VARARGS, early_doc},
    {"head", head, METH_VARARGS, head_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_copies", .m_doc = NULL, .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__copies(void) { return PyModule_Create(&module); }
