/* umbp.transfer._checks: a transfer batch validated and flattened in one call.
 *
 * Why: every save and load first checks its whole batch (no kernel may see a bad block id or arena
 * offset) and joins the Moves' lists into one id and one offset array. In Python that is a dozen
 * interpreter steps and numpy calls per Moves plus a few per batch: ~60 us on the H200's host for an
 * 8K-token restore (8 Moves, 28 objects), all of it before the first copy, which itself takes ~0.85 ms.
 * Here it is one pass. TransferEngine._checked keeps the Python twin, which gives the same results and
 * raises the same errors (tests compare them); the extension is optional.
 *
 * flatten(batch, groups, capacity, load) -> (key, buf, digests) or None
 *   batch: a sequence of Moves (attributes group, block_ids, offsets, digests, slot_bytes).
 *   groups: dict group -> (object_bytes, num_blocks, alias class, note): the class a dense index from 0,
 *   shared by groups whose layers share memory (block b of each is one page: vLLM's hybrid layout),
 *   the note a str the duplicate-write error ends with ("" for a group of its own).
 *   key: per Moves (group, objects, slot reach); buf: a bytearray of the block ids, then the offsets,
 *   as int64 in batch order. digests (loads): None when every Moves' digests are None or a list or
 *   tuple of ints in [0, 2**64), used as they are; else per Moves None or a list of its digests
 *   converted to ints (numpy integers, bools), which the caller gives the backends instead.
 *   None: a Moves' block_ids or offsets is not a list or tuple, or the values are too wide for one sort
 *   key; the caller then runs the Python twin.
 *   Raises as the twin does, first found first, in the twin's order: per Moves the group (KeyError),
 *   the lengths and slot_bytes (ValueError; TypeError, OverflowError for a value that is no int64); then
 *   the values, every Moves' ids, then every Moves' offsets (TypeError, OverflowError); then every
 *   block id below its group's block count, every offset 8-byte aligned with its slot inside the arena
 *   (compared as offset > capacity - reach: offset + reach wraps for offsets near 2**63); then (loads)
 *   every digest an integer in [0, 2**64) (ValueError); then a load writes no block of an alias class
 *   twice, a save no arena byte twice (ValueError). All of it before the caller writes a byte.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "_radix.h"

typedef struct {
    PyObject *group, *ids, *offs, *dig, *note; /* references held until the call returns: a Moves-like
                                                * object may hand out new objects per attribute read */
    Py_ssize_t n, at;
    long long reach, blocks, index;
} Part;

static int bits_for(unsigned long long v) { /* bits to hold 0..v */
    int b = 1;
    while (b < 64 && (v >> b))
        b++;
    return b;
}

static const char lengths_msg[] = "umbp: block_ids, offsets (and digests) of a Moves must have one entry per object";

static PyObject *attr_group, *attr_ids, *attr_offs, *attr_digests, *attr_slot_bytes; /* interned at import */

/* Read one Moves; 0: ok, 1: not a list or tuple (the caller returns None), -1: error set. */
static int read_part(PyObject *mv, PyObject *groups, Part *p, PyObject **key_item) {
    PyObject *g = NULL, *ids = NULL, *offs = NULL, *dig = NULL, *sb = NULL;
    int rc = -1;
    if (!(g = PyObject_GetAttr(mv, attr_group)) || !(ids = PyObject_GetAttr(mv, attr_ids)) ||
        !(offs = PyObject_GetAttr(mv, attr_offs)) || !(dig = PyObject_GetAttr(mv, attr_digests)) ||
        !(sb = PyObject_GetAttr(mv, attr_slot_bytes)))
        goto done;
    PyObject *entry = PyDict_GetItemWithError(groups, g);
    if (entry == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_KeyError, "umbp: group %S is not registered with the transfer engine", g);
        goto done;
    }
    long long object_bytes;
    PyObject *note;
    if (!PyArg_ParseTuple(entry, "LLLU", &object_bytes, &p->blocks, &p->index, &note))
        goto done;
    if (!(PyList_Check(ids) || PyTuple_Check(ids)) || !(PyList_Check(offs) || PyTuple_Check(offs))) {
        rc = 1;
        goto done;
    }
    p->n = PySequence_Fast_GET_SIZE(ids);
    Py_ssize_t nd = dig == Py_None ? p->n : PyObject_Length(dig);
    if (nd < 0)
        goto done;
    if (PySequence_Fast_GET_SIZE(offs) != p->n || nd != p->n) {
        PyErr_SetString(PyExc_ValueError, lengths_msg);
        goto done;
    }
    p->reach = object_bytes;
    if (sb != Py_None) {
        long long v = PyLong_AsLongLong(sb);
        if (v == -1 && PyErr_Occurred())
            goto done;
        if (v < object_bytes) {
            PyErr_Format(PyExc_ValueError, "umbp: slot_bytes %S is smaller than group %S's objects (%lld bytes)",
                         sb, g, object_bytes);
            goto done;
        }
        p->reach = v;
    }
    *key_item = Py_BuildValue("(OnL)", g, p->n, p->reach);
    if (*key_item == NULL)
        goto done;
    p->group = g;
    p->ids = ids;
    p->offs = offs;
    p->dig = dig;
    p->note = Py_NewRef(note);
    g = ids = offs = dig = NULL;
    rc = 0;
done:
    Py_XDECREF(g);
    Py_XDECREF(ids);
    Py_XDECREF(offs);
    Py_XDECREF(dig);
    Py_XDECREF(sb);
    return rc;
}

/* A list's or tuple's ints into out[0:n]; -1 with an error set. A list that changes size while read
 * (an item's __index__ may run code) is an error, not a read past its end. */
static int fill(PyObject *seq, Py_ssize_t n, int64_t *out) {
    for (Py_ssize_t j = 0; j < n; j++) {
        if (PySequence_Fast_GET_SIZE(seq) != n) {
            PyErr_SetString(PyExc_ValueError, "umbp: a Moves list changed while it was read");
            return -1;
        }
        PyObject *item = PySequence_Fast_GET_ITEM(seq, j);
        Py_INCREF(item);
        long long v = PyLong_AsLongLong(item);
        Py_DECREF(item);
        if (v == -1 && PyErr_Occurred())
            return -1;
        out[j] = v;
    }
    return 0;
}

/* Load: every digest an integer in [0, 2**64), before anything is written (a bad one used to raise after
 * earlier objects were written, or read as a quiet miss). *conv stays NULL while every Moves' digests
 * are None or a list or tuple of ints; else a tuple, per Moves None or the converted list. An item's
 * __index__ may run code: a list that changes size is refused, and the values given back are the ones
 * checked. -1 with an error set. */
static int check_digests(Part *parts, Py_ssize_t m, PyObject **conv) {
    for (Py_ssize_t i = 0; i < m; i++) {
        if (parts[i].dig == Py_None)
            continue;
        int exact = PyList_CheckExact(parts[i].dig) || PyTuple_CheckExact(parts[i].dig);
        PyObject *seq = PySequence_Fast(parts[i].dig, "umbp: digests must be a sequence");
        if (seq == NULL)
            return -1;
        Py_ssize_t n = parts[i].n;
        PyObject *out = exact ? NULL : PyList_New(n); /* made when a value needs converting */
        if (!exact && out == NULL)
            goto fail;
        for (Py_ssize_t j = 0; j < n; j++) {
            if (PySequence_Fast_GET_SIZE(seq) != n) {
                PyErr_SetString(PyExc_ValueError, lengths_msg);
                goto fail;
            }
            PyObject *item = PySequence_Fast_GET_ITEM(seq, j), *v;
            Py_INCREF(item);
            if (PyLong_CheckExact(item))
                v = Py_NewRef(item);
            else {
                if (out == NULL) { /* the items before j are checked ints, and no code ran since */
                    if ((out = PyList_New(n)) == NULL) {
                        Py_DECREF(item);
                        goto fail;
                    }
                    for (Py_ssize_t k = 0; k < j; k++)
                        PyList_SET_ITEM(out, k, Py_NewRef(PySequence_Fast_GET_ITEM(seq, k)));
                }
                v = PyNumber_Index(item);
            }
            int bad = v == NULL;
            if (!bad) {
                unsigned long long u = PyLong_AsUnsignedLongLong(v);
                bad = u == (unsigned long long)-1 && PyErr_Occurred();
            }
            if (bad) {
                Py_XDECREF(v);
                if (PyErr_ExceptionMatches(PyExc_TypeError) || PyErr_ExceptionMatches(PyExc_OverflowError)) {
                    PyErr_Clear();
                    PyErr_Format(PyExc_ValueError,
                                 "umbp: a digest must be an integer in [0, 2**64) (a psum64 from save), "
                                 "got %R for group %S",
                                 item, parts[i].group);
                }
                Py_DECREF(item);
                goto fail;
            }
            Py_DECREF(item);
            if (out != NULL)
                PyList_SET_ITEM(out, j, v);
            else
                Py_DECREF(v);
        }
        Py_DECREF(seq);
        if (out != NULL) {
            if (*conv == NULL) {
                if ((*conv = PyTuple_New(m)) == NULL) {
                    Py_DECREF(out);
                    return -1;
                }
                for (Py_ssize_t k = 0; k < m; k++)
                    PyTuple_SET_ITEM(*conv, k, Py_NewRef(Py_None));
            }
            Py_DECREF(PyTuple_GET_ITEM(*conv, i)); /* a tuple of our own, not yet shared */
            PyTuple_SET_ITEM(*conv, i, out);
        }
        continue;
    fail:
        Py_XDECREF(out);
        Py_DECREF(seq);
        return -1;
    }
    return 0;
}

/* Load: is any (alias class, block) written twice? The first Moves in batch order whose class repeats a
 * block is named. Returns 1 if the keys do not fit one sort key (the caller returns None), -1 with an
 * error. */
static int check_writes(Part *parts, Py_ssize_t m, const int64_t *ids, Py_ssize_t total, uint64_t *keys,
                        long long ngroups) {
    long long most = 0;
    for (Py_ssize_t i = 0; i < m; i++)
        most = parts[i].blocks > most ? parts[i].blocks : most;
    int id_bits = bits_for((unsigned long long)most);
    if (id_bits + bits_for((unsigned long long)ngroups) > 64)
        return 1;
    for (Py_ssize_t i = 0; i < m; i++)
        for (Py_ssize_t j = 0; j < parts[i].n; j++)
            keys[parts[i].at + j] = ((uint64_t)parts[i].index << id_bits) | (uint64_t)ids[parts[i].at + j];
    sort_keys(keys, keys + total, total);
    long long bad = -1; /* the lowest repeated group index is not the first in batch order: mark, then pick */
    unsigned char *repeated = NULL;
    for (Py_ssize_t k = 1; k < total; k++) {
        if (keys[k] != keys[k - 1])
            continue;
        if (repeated == NULL && !(repeated = PyMem_Calloc((size_t)ngroups, 1))) {
            PyErr_NoMemory();
            return -1;
        }
        repeated[keys[k] >> id_bits] = 1;
    }
    if (repeated == NULL)
        return 0;
    for (Py_ssize_t i = 0; i < m && bad < 0; i++)
        if (repeated[parts[i].index])
            bad = i;
    PyMem_Free(repeated);
    PyErr_Format(PyExc_ValueError, "umbp: a load writes block ids of group %S twice%U", parts[bad].group,
                 parts[bad].note);
    return -1;
}

/* Save: do two slots overlap? Sorted by offset, each slot must end where the next begins or before (a
 * slot overlapping a later one overlaps its successor in that order). keys: room for 3 total words.
 * 1: too wide for a sort key. */
static int check_disjoint(Part *parts, Py_ssize_t m, const int64_t *offs, Py_ssize_t total, uint64_t *keys,
                          long long capacity) {
    int idx_bits = bits_for((unsigned long long)total);
    if (idx_bits + bits_for((unsigned long long)capacity >> 3) > 64)
        return 1;
    int64_t *reach = (int64_t *)(keys + 2 * total);
    for (Py_ssize_t i = 0; i < m; i++)
        for (Py_ssize_t j = 0; j < parts[i].n; j++)
            reach[parts[i].at + j] = parts[i].reach;
    for (Py_ssize_t i = 0; i < total; i++)
        keys[i] = (((uint64_t)offs[i] >> 3) << idx_bits) | (uint64_t)i;
    sort_keys(keys, keys + total, total);
    uint64_t mask = ((uint64_t)1 << idx_bits) - 1;
    for (Py_ssize_t k = 1; k < total; k++) {
        Py_ssize_t prev = (Py_ssize_t)(keys[k - 1] & mask), next = (Py_ssize_t)(keys[k] & mask);
        if (offs[next] < offs[prev] + reach[prev]) {
            PyErr_SetString(PyExc_ValueError, "umbp: a save batch writes overlapping arena slots");
            return -1;
        }
    }
    return 0;
}

PyDoc_STRVAR(flatten_doc, "flatten(batch, groups, capacity, load) -> (key, buf) or None\n\n"
                          "Validate a transfer batch and join its ids and offsets (see the module comment).");

static PyObject *flatten(PyObject *self, PyObject *args) {
    PyObject *batch, *groups;
    long long capacity;
    int load;
    if (!PyArg_ParseTuple(args, "OO!Lp:flatten", &batch, &PyDict_Type, &groups, &capacity, &load))
        return NULL;
    PyObject *seq = PySequence_Fast(batch, "flatten: batch must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    PyObject *key = PyTuple_New(m), *buf = NULL, *res = NULL, *conv = NULL;
    Part *parts = PyMem_Calloc((size_t)m + 1, sizeof *parts);
    uint64_t *keys = NULL;
    if (key == NULL || parts == NULL) {
        if (parts == NULL)
            PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *item = NULL;
        int rc = read_part(PySequence_Fast_GET_ITEM(seq, i), groups, &parts[i], &item);
        if (rc != 0) {
            if (rc > 0)
                res = Py_NewRef(Py_None);
            goto done;
        }
        PyTuple_SET_ITEM(key, i, item);
        parts[i].at = total;
        total += parts[i].n;
    }
    buf = PyByteArray_FromStringAndSize(NULL, 16 * total);
    if (buf == NULL)
        goto done;
    int64_t *ids = (int64_t *)PyByteArray_AS_STRING(buf), *offs = ids + total;
    for (Py_ssize_t i = 0; i < m; i++) /* every Moves' ids, then every Moves' offsets, as the twin */
        if (fill(parts[i].ids, parts[i].n, ids + parts[i].at) < 0)
            goto done;
    for (Py_ssize_t i = 0; i < m; i++)
        if (fill(parts[i].offs, parts[i].n, offs + parts[i].at) < 0)
            goto done;
    for (Py_ssize_t i = 0; i < m; i++)
        for (Py_ssize_t j = parts[i].at; j < parts[i].at + parts[i].n; j++)
            if ((uint64_t)ids[j] >= (uint64_t)parts[i].blocks) {
                PyErr_Format(PyExc_ValueError, "umbp: block id outside [0, %lld) in a transfer batch",
                             parts[i].blocks);
                goto done;
            }
    for (Py_ssize_t i = 0; i < m; i++)
        for (Py_ssize_t j = parts[i].at; j < parts[i].at + parts[i].n; j++)
            if (offs[j] < 0 || (offs[j] & 7) || offs[j] > capacity - parts[i].reach) {
                PyErr_SetString(PyExc_ValueError,
                                "umbp: arena offset outside the arena or not 8-byte aligned in a transfer batch");
                goto done;
            }
    if (load && total > 0 && check_digests(parts, m, &conv) < 0)
        goto done;
    if (total > 1) {
        keys = PyMem_Malloc(3 * (size_t)total * sizeof *keys);
        if (keys == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        int rc = load ? check_writes(parts, m, ids, total, keys, (long long)PyDict_GET_SIZE(groups))
                      : check_disjoint(parts, m, offs, total, keys, capacity);
        if (rc != 0) {
            if (rc > 0)
                res = Py_NewRef(Py_None);
            goto done;
        }
    }
    res = PyTuple_Pack(3, key, buf, conv == NULL ? Py_None : conv);
done:
    Py_XDECREF(conv);
    PyMem_Free(keys);
    for (Py_ssize_t i = 0; parts != NULL && i < m; i++) {
        Py_XDECREF(parts[i].group);
        Py_XDECREF(parts[i].ids);
        Py_XDECREF(parts[i].offs);
        Py_XDECREF(parts[i].dig);
        Py_XDECREF(parts[i].note);
    }
    PyMem_Free(parts);
    Py_XDECREF(buf);
    Py_XDECREF(key);
    Py_DECREF(seq);
    return res;
}

static PyMethodDef methods[] = {
    {"flatten", flatten, METH_VARARGS, flatten_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_checks", .m_doc = NULL, .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__checks(void) {
    if (!(attr_group = PyUnicode_InternFromString("group")) || !(attr_ids = PyUnicode_InternFromString("block_ids")) ||
        !(attr_offs = PyUnicode_InternFromString("offsets")) ||
        !(attr_digests = PyUnicode_InternFromString("digests")) ||
        !(attr_slot_bytes = PyUnicode_InternFromString("slot_bytes")))
        return NULL;
    return PyModule_Create(&module);
}
