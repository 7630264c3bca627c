/* umbp.pool._native, read_frames: the shared tier's batched GET loop (resp.Wire.framed_payload for a run of
 * same-size replies): receive, reply framing and header checks, the payload straight into the caller's
 * buffer, and its psum64 row values, with the GIL released.
 */
#include "native.h"

#include <errno.h>
#include <poll.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

enum { RF_OK = 0, RF_CLOSED = 1, RF_TIMEOUT = 2, RF_OSERROR = 3, RF_PROTOCOL = 4, RF_INTERRUPTED = 5 };

/* Bytes buffered per read: a reply's head and the next one's, and a little of a payload. Payloads are
 * read straight into their destination (readv: the rest of the payload, then up to this much of what
 * follows into the buffer), so most of a value crosses memory once instead of twice (kernel -> buffer
 * -> dst). 16 KiB used the least client CPU per 64 KiB value on the dev VM (4 and 64 KiB: more system
 * time or more copying; bench/results/archive/28). */
#ifndef FILL_MAX
#define FILL_MAX (16 * 1024)
#endif

typedef struct {
    int fd;
    int timeout_ms;           /* the whole loop's budget: waits end at `deadline`, not timeout_ms each */
    struct timespec deadline; /* CLOCK_MONOTONIC; a server that drips bytes cannot stretch the call */
    unsigned char *buf;
    size_t cap, start, end;
    int err, errnum;
    PyThreadState *save; /* the GIL is released while the stream waits; taken back to run signal handlers */
} Stream;

/* A signal interrupted the wait: run Python's handlers (with the GIL) as a blocking recv would, so Ctrl-C
 * stops a read at once instead of at the socket timeout. 1 when a handler raised (the exception is set). */
static int stream_interrupted(Stream *s) {
    PyEval_RestoreThread(s->save);
    int raised = PyErr_CheckSignals() < 0;
    s->save = PyEval_SaveThread();
    return raised;
}

/* Milliseconds left before s->deadline (rounded up), 0 once it has passed; -1 without a deadline. */
static int stream_left_ms(const Stream *s) {
    if (s->timeout_ms < 0)
        return -1;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    long long ms = (long long)(s->deadline.tv_sec - now.tv_sec) * 1000 +
                   (s->deadline.tv_nsec - now.tv_nsec + 999999) / 1000000;
    return ms <= 0 ? 0 : ms > 0x7fffffff ? 0x7fffffff : (int)ms;
}

/* readv once, waiting for the first byte at most until the deadline: > 0 bytes, or 0 with s->err set.
 * The descriptor is non-blocking (Python keeps a socket with a timeout so). */
static ssize_t stream_readv(Stream *s, struct iovec *iov, int n) {
    for (;;) {
        ssize_t k = readv(s->fd, iov, n);
        if (k > 0)
            return k;
        if (k == 0) {
            s->err = RF_CLOSED;
            return 0;
        }
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            s->err = RF_OSERROR;
            s->errnum = errno;
            return 0;
        }
        int left = stream_left_ms(s);
        if (left == 0) {
            s->err = RF_TIMEOUT;
            return 0;
        }
        struct pollfd pfd = {.fd = s->fd, .events = POLLIN};
        int ready = poll(&pfd, 1, left);
        if (ready == 0) {
            s->err = RF_TIMEOUT;
            return 0;
        }
        if (ready < 0 && errno != EINTR) {
            s->err = RF_OSERROR;
            s->errnum = errno;
            return 0;
        }
        if (ready < 0 && stream_interrupted(s)) {
            s->err = RF_INTERRUPTED;
            return 0;
        }
    }
}

/* Buffer up to FILL_MAX more bytes (moving what is left to the front when short of room): 0, or -1
 * with s->err set. */
static int stream_fill(Stream *s) {
    if (s->start == s->end) {
        s->start = s->end = 0;
    } else if (s->cap - s->end < FILL_MAX) {
        memmove(s->buf, s->buf + s->start, s->end - s->start);
        s->end -= s->start;
        s->start = 0;
    }
    size_t room = s->cap - s->end < FILL_MAX ? s->cap - s->end : FILL_MAX;
    struct iovec iov = {.iov_base = s->buf + s->end, .iov_len = room};
    ssize_t k = stream_readv(s, &iov, 1);
    if (k <= 0)
        return -1;
    s->end += (size_t)k;
    return 0;
}

/* Fill dst[0:n]: what is buffered first; the rest straight from the socket, with what follows it (up
 * to FILL_MAX bytes) into the emptied buffer. */
static int stream_into(Stream *s, unsigned char *dst, size_t n) {
    size_t have = s->end - s->start;
    if (have > n)
        have = n;
    memcpy(dst, s->buf + s->start, have);
    s->start += have;
    size_t got = have;
    while (got < n) { /* the buffer is empty here: all of it went into dst */
        s->start = s->end = 0;
        struct iovec iov[2] = {{.iov_base = dst + got, .iov_len = n - got}, {.iov_base = s->buf, .iov_len = FILL_MAX}};
        ssize_t k = stream_readv(s, iov, 2);
        if (k <= 0)
            return -1;
        if ((size_t)k <= n - got) {
            got += (size_t)k;
        } else {
            s->end = (size_t)k - (n - got);
            got = n;
        }
    }
    return 0;
}

/* 1 when the stream continues with lead, buffering at least need >= lead_len bytes; 0 when it does not
 * (nothing consumed, and nothing waited for once the buffered bytes differ); -1 on an error. */
static int stream_match(Stream *s, const unsigned char *lead, size_t lead_len, size_t need) {
    if (need > s->cap)
        return 0; /* cannot happen with the Wire's 256 KiB buffer; Python's path would grow it */
    while (s->end - s->start < need) {
        size_t have = s->end - s->start;
        size_t cmp = have < lead_len ? have : lead_len;
        if (memcmp(s->buf + s->start, lead, cmp) != 0)
            return 0;
        if (stream_fill(s) < 0)
            return -1;
    }
    return memcmp(s->buf + s->start, lead, lead_len) == 0;
}

const char read_frames_doc[] = PyDoc_STR(
"read_frames(fd, timeout_ms, buf, start, end, lead, field, tails, dsts, rows, fields, r0, r1)\n"
"    -> (r, start, end, err, errno)\n\n"
"resp.Wire.framed_payload + row sums for replies r0..r1-1 of a same-size GET batch, GIL released:\n"
"reply r must be lead, `field` bytes (copied to fields[r*field:]), tails[r], then the rest of the bulk\n"
"(into dsts[r]) and CRLF; the 4 KiB row sums of dsts[r] go to row r of `rows` (a C-contiguous uint64\n"
"matrix). Stops at r1 or at the first reply that is not so framed (consuming nothing of it, and never\n"
"waiting for bytes once the buffered ones differ from lead). timeout_ms bounds the whole call, not\n"
"each wait (-1: none). err: 0 ok, 1 closed, 2 timeout (deadline passed),\n"
"3 OS error (errno), 4 a bulk not ending in CRLF. buf[start:end] is the Wire's buffered data; the\n"
"returned start/end replace the Wire's. A signal handler that raises while the loop waits (Ctrl-C)\n"
"stops it with that exception; the stream position is then unknown.");

PyObject *read_frames(PyObject *self, PyObject *args) {
    int fd, timeout_ms;
    PyObject *buf_obj, *tails_in, *dsts_in, *rows_obj, *fields_obj;
    Py_ssize_t start, end, field, r0, r1;
    Py_buffer lead = {0}, buf = {0}, rows = {0}, fields = {0};
    if (!PyArg_ParseTuple(args, "iiOnny*nOOOOnn:read_frames", &fd, &timeout_ms, &buf_obj, &start, &end, &lead,
                          &field, &tails_in, &dsts_in, &rows_obj, &fields_obj, &r0, &r1))
        return NULL;
    PyObject *tails = NULL, *dsts = NULL, *out = NULL;
    Views dv = {0};
    const char **tail_ptr = NULL;
    size_t tail_len = 0;

    if (PyObject_GetBuffer(buf_obj, &buf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (PyObject_GetBuffer(rows_obj, &rows, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (PyObject_GetBuffer(fields_obj, &fields, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    tails = PySequence_Fast(tails_in, "read_frames: tails must be a sequence of bytes");
    dsts = PySequence_Fast(dsts_in, "read_frames: dsts must be a sequence of buffers");
    if (tails == NULL || dsts == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(dsts);
    if (r0 < 0 || r1 < r0 || r1 > n || PySequence_Fast_GET_SIZE(tails) != n || start < 0 || end < start ||
        end > buf.len || field < 0 || buf.len < 2 * FILL_MAX) {
        PyErr_SetString(PyExc_ValueError, "read_frames: inconsistent arguments");
        goto done;
    }
    if (views_acquire(dsts, r0, r1, 1, &dv) < 0)
        goto done;
    Py_ssize_t size = r1 > r0 ? dv.views[0].len : 0;
    size_t nrows = ((size_t)size + ROW_BYTES - 1) / ROW_BYTES;
    if (rows.len < (Py_ssize_t)(n * nrows * sizeof(uint64_t)) || fields.len < n * field) {
        PyErr_SetString(PyExc_ValueError, "read_frames: rows or fields too small for the batch");
        goto done;
    }
    tail_ptr = PyMem_Calloc(r1 > r0 ? (size_t)(r1 - r0) : 1, sizeof(char *));
    if (tail_ptr == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t r = r0; r < r1; r++) {
        PyObject *t = PySequence_Fast_GET_ITEM(tails, r);
        if (!PyBytes_Check(t) || (r > r0 && (size_t)PyBytes_GET_SIZE(t) != tail_len) ||
            dv.views[r - r0].len != size) {
            PyErr_SetString(PyExc_ValueError, "read_frames: tails must be bytes of one length, dsts of one size");
            goto done;
        }
        tail_len = (size_t)PyBytes_GET_SIZE(t);
        tail_ptr[r - r0] = PyBytes_AS_STRING(t);
    }

    Stream s = {.fd = fd, .timeout_ms = timeout_ms, .buf = buf.buf, .cap = (size_t)buf.len,
                .start = (size_t)start, .end = (size_t)end};
    clock_gettime(CLOCK_MONOTONIC, &s.deadline);
    if (timeout_ms > 0) {
        s.deadline.tv_sec += timeout_ms / 1000;
        s.deadline.tv_nsec += (long)(timeout_ms % 1000) * 1000000;
        if (s.deadline.tv_nsec >= 1000000000) {
            s.deadline.tv_sec += 1;
            s.deadline.tv_nsec -= 1000000000;
        }
    }
    uint64_t *row_out = rows.buf;
    unsigned char *field_out = fields.buf;
    const unsigned char *lead_p = lead.buf;
    size_t lead_len = (size_t)lead.len, need = lead_len + (size_t)field + tail_len;
    Py_ssize_t r = r0;
    s.save = PyEval_SaveThread();
    for (; r < r1; r++) {
        int m = stream_match(&s, lead_p, lead_len, need);
        if (m <= 0)
            break;
        unsigned char *at = s.buf + s.start + lead_len;
        if (memcmp(at + field, tail_ptr[r - r0], tail_len) != 0)
            break;
        memcpy(field_out + r * field, at, (size_t)field);
        s.start += need;
        unsigned char *dst = dv.views[r - r0].buf;
        if (stream_into(&s, dst, (size_t)size) < 0)
            break;
        while (s.end - s.start < 2)
            if (stream_fill(&s) < 0)
                break;
        if (s.err)
            break;
        if (s.buf[s.start] != '\r' || s.buf[s.start + 1] != '\n') {
            s.err = RF_PROTOCOL;
            break;
        }
        s.start += 2;
        uint64_t *rr = row_out + (size_t)r * nrows;
        for (size_t k = 0; k < nrows; k++) {
            size_t off = k * ROW_BYTES, len = (size_t)size - off < ROW_BYTES ? (size_t)size - off : ROW_BYTES;
            rr[k] = psum_row_sum(dst + off, len);
        }
    }
    PyEval_RestoreThread(s.save);
    if (s.err != RF_INTERRUPTED) /* else the handler's exception propagates; the caller drops the connection */
        out = Py_BuildValue("nnnii", r, (Py_ssize_t)s.start, (Py_ssize_t)s.end, s.err, s.errnum);
done:
    views_release(&dv);
    PyMem_Free(tail_ptr);
    Py_XDECREF(tails);
    Py_XDECREF(dsts);
    if (lead.obj != NULL)
        PyBuffer_Release(&lead);
    if (buf.obj != NULL)
        PyBuffer_Release(&buf);
    if (rows.obj != NULL)
        PyBuffer_Release(&rows);
    if (fields.obj != NULL)
        PyBuffer_Release(&fields);
    return out;
}
