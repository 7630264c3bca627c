/* umbp.pool._native, pack_headers: the SSD writer's record headers (fields, crc32, key, zero pad) for a whole
 * write group in one call (umbp.pool.ssd.format.pack_header_at for many records).
 */
#include "native.h"

/* CRC-32 as zlib.crc32 computes it (reflected polynomial 0xEDB88320): the SSD record header's crc.
 * Bytewise with a table; a header is ~100 bytes, so nothing faster is needed. */
static uint32_t crc_table[256];

void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[i] = c;
    }
}

static uint32_t crc32_update(uint32_t crc, const unsigned char *p, size_t n) {
    crc = ~crc;
    while (n--)
        crc = crc_table[(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

#define HEADER_BYTES 48
#define HEADER_CRC_AT 40

static int item_u64(PyObject *seq, Py_ssize_t i, uint64_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(seq, i));
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = (uint64_t)v;
    return 0;
}

const char pack_headers_doc[] = PyDoc_STR(
"pack_headers(buf, ats, keys, flags, seqs, lengths, checksums, magic, version, span=4096) -> None\n\n"
"ssd_format.pack_header_at for many records: at byte ats[i] of the writable buffer buf, the header of\n"
"a record (magic, version, flags[i], len(keys[i]), seqs[i], lengths[i], checksums[i], the crc32,\n"
"keys[i]: bytes), zero-padded to `span` bytes (a whole block in format 1; 0 = the header's own size\n"
"rounded up to 8 bytes, the packed entries of a format-2 group). One call per write group instead of\n"
"~2 us of Python a record.");

PyObject *pack_headers(PyObject *self, PyObject *args) {
    PyObject *buf_obj, *lists_in[6], *lists[6] = {NULL};
    Py_buffer buf = {0}, magic = {0};
    unsigned int version;
    Py_ssize_t span_arg = ROW_BYTES;
    PyObject *out = NULL;
    if (!PyArg_ParseTuple(args, "OOOOOOOy*I|n:pack_headers", &buf_obj, &lists_in[0], &lists_in[1], &lists_in[2],
                          &lists_in[3], &lists_in[4], &lists_in[5], &magic, &version, &span_arg))
        return NULL;
    if (PyObject_GetBuffer(buf_obj, &buf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    for (int k = 0; k < 6; k++)
        if ((lists[k] = PySequence_Fast(lists_in[k], "pack_headers: arguments must be sequences")) == NULL)
            goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(lists[0]);
    for (int k = 1; k < 6; k++)
        if (PySequence_Fast_GET_SIZE(lists[k]) != n) {
            PyErr_SetString(PyExc_ValueError, "pack_headers: the sequences differ in length");
            goto done;
        }
    if (magic.len != 8 || version > 0xFFFF || span_arg < 0 || span_arg > ROW_BYTES) {
        PyErr_SetString(PyExc_ValueError, "pack_headers: magic must be 8 bytes, version a u16, span 0..4096");
        goto done;
    }
    unsigned char *base = buf.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t at, flags, seq, length, checksum;
        if (item_u64(lists[0], i, &at) < 0 || item_u64(lists[2], i, &flags) < 0 || item_u64(lists[3], i, &seq) < 0 ||
            item_u64(lists[4], i, &length) < 0 || item_u64(lists[5], i, &checksum) < 0)
            goto done;
        PyObject *key = PySequence_Fast_GET_ITEM(lists[1], i);
        if (!PyBytes_Check(key)) {
            PyErr_SetString(PyExc_TypeError, "pack_headers: keys must be bytes");
            goto done;
        }
        size_t key_len = (size_t)PyBytes_GET_SIZE(key);
        size_t span = span_arg ? (size_t)span_arg : (HEADER_BYTES + key_len + 7) / 8 * 8;
        if (flags > 0xFFFF || HEADER_BYTES + key_len > span || span > ROW_BYTES || at > (uint64_t)buf.len ||
            (uint64_t)buf.len - at < span) {
            PyErr_Format(PyExc_ValueError, "pack_headers: record %zd does not fit (at %llu, key %zu bytes)", i,
                         (unsigned long long)at, key_len);
            goto done;
        }
        unsigned char *h = base + at;
        uint16_t u16[4] = {(uint16_t)version, (uint16_t)flags, (uint16_t)key_len, 0};
        uint64_t u64[3] = {seq, length, checksum};
        memcpy(h, magic.buf, 8);
        memcpy(h + 8, u16, 8);
        memcpy(h + 16, u64, 24);
        memset(h + HEADER_CRC_AT, 0, span - HEADER_CRC_AT);
        memcpy(h + HEADER_BYTES, PyBytes_AS_STRING(key), key_len);
        uint32_t crc = crc32_update(0, h, HEADER_CRC_AT);
        crc = crc32_update(crc, h + HEADER_CRC_AT + 4, HEADER_BYTES - HEADER_CRC_AT - 4 + key_len);
        memcpy(h + HEADER_CRC_AT, &crc, 4);
    }
    out = Py_NewRef(Py_None);
done:
    for (int k = 0; k < 6; k++)
        Py_XDECREF(lists[k]);
    if (buf.obj != NULL)
        PyBuffer_Release(&buf);
    if (magic.obj != NULL)
        PyBuffer_Release(&magic);
    return out;
}
