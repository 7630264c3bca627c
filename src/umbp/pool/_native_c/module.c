/* umbp.pool._native: the per-byte and per-value loops of the pool's hot paths, out of the interpreter.
 *
 * Why: the pure-Python paths (umbp.pool.checksum, umbp.pool.remote.resp) are already one numpy call or one buffer
 * check per object, but on a 16-core host the interpreter steps around them (and the GIL they retake)
 * cap a 64 KiB object stream at 2-4 GB/s, below the disk and the server (docs/ssd.md, docs/remote.md).
 * Here a whole batch runs with the GIL released: copy + checksum of many objects in one call, and the
 * receive + frame check + checksum of a run of same-size GET replies in one call.
 *
 * Everything here has a pure-Python twin that gives identical results (tests compare them); the
 * extension is optional and umbp.pool.native falls back when it is missing or UMBP_NATIVE=0.
 *
 * One extension built from this folder's files, one concept each (what they share: native.h):
 *   module.c            this file: the module's function table and its init
 *   psum.c              psum64's maths (GF(2^64), a row's value, its implementations), psum_rows, psum_impl
 *   copy.c              buffer lists, psum_copy (copy + checksum of a batch)
 *   frames.c            read_frames (the shared tier's GET loop)
 *   headers.c           pack_headers (the SSD writer's record headers, crc32)
 *   index_table.c       IndexTable's rows, key table and LRU (the DRAM index's compact core)
 *   index_ops.c         IndexTable's methods and type
 *   page_runs.c         PageRuns, the DRAM index's page allocator, and its type
 *   page_runs_index.c   PageRuns' one-call paths on an IndexTable (hand_back, reserve_row(s), evict_lru)
 */
#include "native.h"

static PyMethodDef methods[] = {
    {"psum_copy", (PyCFunction)(void (*)(void))psum_copy, METH_VARARGS | METH_KEYWORDS, psum_copy_doc},
    {"psum_impl", psum_impl, METH_VARARGS, psum_impl_doc},
    {"psum_rows", psum_rows, METH_VARARGS, psum_rows_doc},
    {"read_frames", read_frames, METH_VARARGS, read_frames_doc},
    {"pack_headers", pack_headers, METH_VARARGS, pack_headers_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_native", .m_doc = NULL, .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    crc_init();
    psum_init();
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyType_Ready(&IndexTableType) < 0 ||
                      PyModule_AddObjectRef(m, "IndexTable", (PyObject *)&IndexTableType) < 0 ||
                      PyType_Ready(&PageRunsType) < 0 ||
                      PyModule_AddObjectRef(m, "PageRuns", (PyObject *)&PageRunsType) < 0))
        Py_CLEAR(m);
    return m;
}
