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
 * psum64 format 2 (see umbp/pool/checksum/): a CRC-64 (P = x^64 + x^4 + x^3 + x + 1) of the object's bits in a
 * fixed order: each 4 KiB row (the last zero-padded) is 64 Horner chains of 8 words, lane l times
 * x^(512 l), row r times x^(32768 r), all xored, the length mixed in with xor (nbytes * GOLDEN).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "umbp._native assumes a little-endian host (psum64 reads little-endian words)"
#endif

/* AVX2 and baseline versions of the portable row loop, picked at load time (GCC/Clang on x86-64 with
 * ifunc); elsewhere (aarch64, e.g. GH200 hosts) one version, which the compiler vectorises itself. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && defined(__linux__)
#define HOT_LOOP __attribute__((target_clones("avx2", "default")))
#else
#define HOT_LOOP
#endif

#define ROW_BYTES 4096
#define ROW_WORDS (ROW_BYTES / 8)
#define LANES 64
#define STEPS (ROW_WORDS / LANES)
#define GOLDEN 0x9E3779B97F4A7C15ULL

/* ---- GF(2^64) = GF(2)[x] / (x^64 + x^4 + x^3 + x + 1) ------------------------------------------------ */

/* a * x^64 mod P: P is sparse, so a * (x^4 + x^3 + x + 1) plus its <= 3 overflow bits folded once more. */
static inline uint64_t mulx64(uint64_t a) {
    uint64_t o = (a >> 60) ^ (a >> 61) ^ (a >> 63);
    return a ^ (a << 1) ^ (a << 3) ^ (a << 4) ^ o ^ (o << 1) ^ (o << 3) ^ (o << 4);
}

/* a * b mod P, bit by bit (the portable path; a few hundred operations, used once per 32 words). */
static uint64_t gf_mul_portable(uint64_t a, uint64_t b) {
    uint64_t lo = 0, hi = 0;
    for (int j = 0; j < 64; j++) {
        uint64_t m = 0 - ((b >> j) & 1);
        lo ^= (a << j) & m;
        if (j)
            hi ^= (a >> (64 - j)) & m;
    }
    return lo ^ mulx64(hi);
}

static uint64_t lane_k[LANES];      /* x^(64 STEPS l): lane l's multiplier inside a row */
static uint64_t lane_lo[LANES][16], lane_hi[LANES][16]; /* lane_k[l] * v for v < 16, unreduced (128 bits) */
static uint64_t gamma_k[ROW_WORDS]; /* x^(64 e(i)) for word i of a row: what the carry-less path multiplies by */
static uint64_t row_step;           /* x^(64 * 512): from one row's weight to the next */

/* A row's value (checksum/digest.py): 64 Horner chains over the row's 8 steps, each times lane_k, xored. Partial
 * rows (n < ROW_BYTES) are zero-padded. The loop over lanes is what the compiler vectorises. */
HOT_LOOP
static uint64_t row_value_portable(const unsigned char *p, size_t n) {
    uint64_t acc[LANES] = {0}, w, h = 0;
    unsigned char pad[ROW_BYTES];
    if (n < ROW_BYTES) {
        memset(pad, 0, sizeof pad);
        memcpy(pad, p, n);
        p = pad;
    }
    for (int m = 0; m < STEPS; m++)
        for (int l = 0; l < LANES; l++) {
            memcpy(&w, p + 8 * (LANES * m + l), 8);
            acc[l] = mulx64(acc[l]) ^ w;
        }
    for (int l = 0; l < LANES; l++) { /* acc * lane_k[l], four bits of acc at a time from the lane's table */
        uint64_t lo = 0, hi = 0, a = acc[l];
        for (int j = 0; j < 16; j++) {
            unsigned v = (unsigned)(a >> (4 * j)) & 15;
            lo ^= lane_lo[l][v] << (4 * j);
            hi ^= lane_hi[l][v] << (4 * j);
            if (j)
                hi ^= lane_lo[l][v] >> (64 - 4 * j);
        }
        h ^= lo ^ mulx64(hi);
    }
    return h;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_CLMUL_PATH 1

/* The same value with one carry-less multiply per word (PCLMULQDQ, every x86-64 CPU since 2010): xor of
 * w_i * gamma_k[i] as 128-bit products, folded once per row. */
__attribute__((target("pclmul,sse4.1")))
static inline uint64_t fold128(__m128i x) {
    uint64_t lo = (uint64_t)_mm_cvtsi128_si64(x), hi = (uint64_t)_mm_extract_epi64(x, 1);
    return lo ^ mulx64(hi);
}

__attribute__((target("pclmul,sse4.1")))
static uint64_t gf_mul_clmul(uint64_t a, uint64_t b) {
    return fold128(_mm_clmulepi64_si128(_mm_cvtsi64_si128((long long)a), _mm_cvtsi64_si128((long long)b), 0));
}

__attribute__((target("pclmul,sse4.1")))
static uint64_t row_value_clmul(const unsigned char *p, size_t n) {
    unsigned char pad[ROW_BYTES];
    if (n < ROW_BYTES) {
        memset(pad, 0, sizeof pad);
        memcpy(pad, p, n);
        p = pad;
    }
    __m128i a0 = _mm_setzero_si128(), a1 = a0, a2 = a0, a3 = a0;
    for (int i = 0; i < ROW_WORDS; i += 4) {
        __m128i v0 = _mm_loadu_si128((const __m128i *)(p + 8 * i));
        __m128i v1 = _mm_loadu_si128((const __m128i *)(p + 8 * i + 16));
        __m128i g0 = _mm_loadu_si128((const __m128i *)(gamma_k + i));
        __m128i g1 = _mm_loadu_si128((const __m128i *)(gamma_k + i + 2));
        a0 = _mm_xor_si128(a0, _mm_clmulepi64_si128(v0, g0, 0x00));
        a1 = _mm_xor_si128(a1, _mm_clmulepi64_si128(v0, g0, 0x11));
        a2 = _mm_xor_si128(a2, _mm_clmulepi64_si128(v1, g1, 0x00));
        a3 = _mm_xor_si128(a3, _mm_clmulepi64_si128(v1, g1, 0x11));
    }
    return fold128(_mm_xor_si128(_mm_xor_si128(a0, a1), _mm_xor_si128(a2, a3)));
}

/* Four carry-less multiplies per instruction (VPCLMULQDQ on 512-bit registers: Ice Lake, Zen 4 and later). */
__attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.1")))
static uint64_t row_value_vclmul(const unsigned char *p, size_t n) {
    unsigned char pad[ROW_BYTES];
    if (n < ROW_BYTES) {
        memset(pad, 0, sizeof pad);
        memcpy(pad, p, n);
        p = pad;
    }
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (int i = 0; i < ROW_WORDS; i += 16) {
        __m512i v0 = _mm512_loadu_si512((const void *)(p + 8 * i));
        __m512i v1 = _mm512_loadu_si512((const void *)(p + 8 * i + 64));
        __m512i g0 = _mm512_loadu_si512((const void *)(gamma_k + i));
        __m512i g1 = _mm512_loadu_si512((const void *)(gamma_k + i + 8));
        a0 = _mm512_xor_si512(a0, _mm512_clmulepi64_epi128(v0, g0, 0x00));
        a1 = _mm512_xor_si512(a1, _mm512_clmulepi64_epi128(v0, g0, 0x11));
        a2 = _mm512_xor_si512(a2, _mm512_clmulepi64_epi128(v1, g1, 0x00));
        a3 = _mm512_xor_si512(a3, _mm512_clmulepi64_epi128(v1, g1, 0x11));
    }
    __m512i a = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
    __m128i x = _mm_xor_si128(_mm_xor_si128(_mm512_extracti32x4_epi32(a, 0), _mm512_extracti32x4_epi32(a, 1)),
                              _mm_xor_si128(_mm512_extracti32x4_epi32(a, 2), _mm512_extracti32x4_epi32(a, 3)));
    return fold128(x);
}
#endif

/* The implementation in use (chosen at import, switchable for tests through psum_impl). */
enum { IMPL_PORTABLE = 0, IMPL_CLMUL = 1, IMPL_VCLMUL = 2 };
static const char *impl_names[] = {"portable", "clmul", "vclmul"};
static int impl_best = IMPL_PORTABLE, impl_now = IMPL_PORTABLE;
static uint64_t (*row_value_fn)(const unsigned char *, size_t) = row_value_portable;
static uint64_t (*gf_mul_fn)(uint64_t, uint64_t) = gf_mul_portable;

static void set_impl(int impl) {
    impl_now = impl;
    row_value_fn = row_value_portable;
    gf_mul_fn = gf_mul_portable;
#ifdef HAVE_CLMUL_PATH
    if (impl >= IMPL_CLMUL) {
        gf_mul_fn = gf_mul_clmul;
        row_value_fn = impl == IMPL_VCLMUL ? row_value_vclmul : row_value_clmul;
    }
#endif
}

static void psum_init(void) {
    uint64_t xstep = 2; /* x^(64 STEPS): 64 STEPS is a power of two */
    for (int t = 1; t < 64 * STEPS; t *= 2)
        xstep = gf_mul_portable(xstep, xstep);
    lane_k[0] = 1;
    for (int l = 1; l < LANES; l++)
        lane_k[l] = gf_mul_portable(lane_k[l - 1], xstep);
    row_step = gf_mul_portable(lane_k[LANES - 1], xstep);
    for (int l = 0; l < LANES; l++)
        for (unsigned v = 0; v < 16; v++)
            for (int t = 0; t < 4; t++)
                if (v >> t & 1) {
                    lane_lo[l][v] ^= lane_k[l] << t;
                    lane_hi[l][v] ^= t ? lane_k[l] >> (64 - t) : 0;
                }
    for (int l = 0; l < LANES; l++) { /* word 64 m + l: x^(64 (8 l + 7 - m)) = lane_k[l] * x^(64 (7 - m)) */
        uint64_t g = lane_k[l];
        for (int m = STEPS - 1; m >= 0; m--) {
            gamma_k[LANES * m + l] = g;
            g = mulx64(g);
        }
    }
#ifdef HAVE_CLMUL_PATH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1")) {
        impl_best = IMPL_CLMUL;
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq"))
            impl_best = IMPL_VCLMUL;
    }
#endif
    set_impl(impl_best);
}

/* A row's value: what the pool's readers (read_frames) and the copies below take per 4 KiB row. */
static inline uint64_t row_sum(const unsigned char *p, size_t n) { return row_value_fn(p, n); }

/* x^(64 * 512 * r): row r's weight. */
static uint64_t row_weight(uint64_t r) {
    uint64_t w = 1, b = row_step;
    for (; r; r >>= 1) {
        if (r & 1)
            w = gf_mul_fn(w, b);
        b = gf_mul_fn(b, b);
    }
    return w;
}

/* Copy src into dst (when src is not NULL) and return the xor of the weighted row values of the copied
 * bytes, rows numbered from row0. The copy goes 64 KiB at a time and each piece is checksummed right
 * after, from L2 (copying and checksumming 4 KiB row by row ran at about half the speed: archive/28). */
#define COPY_CHUNK (64 * 1024)

static uint64_t copy_weighted(unsigned char *dst, const unsigned char *src, size_t n, uint64_t row0) {
    uint64_t h = 0, w = row_weight(row0);
    for (size_t c = 0; c < n; c += COPY_CHUNK) {
        size_t clen = n - c < COPY_CHUNK ? n - c : COPY_CHUNK;
        if (src != NULL)
            memcpy(dst + c, src + c, clen);
        for (size_t off = 0; off < clen; off += ROW_BYTES) {
            size_t len = clen - off < ROW_BYTES ? clen - off : ROW_BYTES;
            h ^= gf_mul_fn(row_sum(dst + c + off, len), w);
            w = gf_mul_fn(w, row_step);
        }
    }
    return h;
}

PyDoc_STRVAR(psum_rows_doc,
"psum_rows(src, out)\n\n"
"psum64's row value of each 4096-byte row of src (a whole number of rows) into out (a writable\n"
"buffer of one uint64 per row), with the GIL released: what the SSD tier combines per record.");

static PyObject *psum_rows(PyObject *self, PyObject *args) {
    Py_buffer src, out;
    if (!PyArg_ParseTuple(args, "y*w*:psum_rows", &src, &out))
        return NULL;
    PyObject *res = NULL;
    size_t rows = (size_t)src.len / ROW_BYTES;
    if ((size_t)src.len % ROW_BYTES || (size_t)out.len != rows * 8) {
        PyErr_Format(PyExc_ValueError, "psum_rows: %zd bytes of rows need %zu bytes of output, got %zd", src.len,
                     rows * 8, out.len);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *p = src.buf;
    unsigned char *o = out.buf;
    for (size_t r = 0; r < rows; r++) {
        uint64_t v = row_sum(p + r * ROW_BYTES, ROW_BYTES);
        memcpy(o + 8 * r, &v, 8);
    }
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    return res;
}

PyDoc_STRVAR(psum_impl_doc,
"psum_impl(name=None) -> str\n\n"
"The row-value implementation in use ('portable', 'clmul' or 'vclmul'); with a name, switch to it\n"
"(for tests: every implementation gives the same values). Naming one this CPU lacks is a ValueError.");

static PyObject *psum_impl(PyObject *self, PyObject *args) {
    const char *name = NULL;
    if (!PyArg_ParseTuple(args, "|s:psum_impl", &name))
        return NULL;
    if (name != NULL) {
        int found = -1;
        for (int i = 0; i <= impl_best; i++)
            if (strcmp(name, impl_names[i]) == 0)
                found = i;
        if (found < 0)
            return PyErr_Format(PyExc_ValueError, "psum_impl: %s is not available here (best: %s)", name,
                                impl_names[impl_best]);
        set_impl(found);
    }
    return PyUnicode_FromString(impl_names[impl_now]);
}

/* ---- buffer lists -------------------------------------------------------------------------------- */

typedef struct {
    Py_buffer *views;
    Py_ssize_t count; /* views acquired so far (released on error too) */
} Views;

static void release_views(Views *v) {
    for (Py_ssize_t i = 0; i < v->count; i++)
        PyBuffer_Release(&v->views[i]);
    PyMem_Free(v->views);
    v->views = NULL;
    v->count = 0;
}

/* Buffers of seq[lo:hi] (contiguous; writable when asked), or -1 with an exception set. */
static int acquire_views(PyObject *seq, Py_ssize_t lo, Py_ssize_t hi, int writable, Views *v) {
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
            release_views(v);
            return -1;
        }
        v->count++;
    }
    return 0;
}

/* ---- psum_copy ----------------------------------------------------------------------------------- */

PyDoc_STRVAR(psum_copy_doc,
"psum_copy(dsts, srcs=None, row0s=None) -> list[int]\n\n"
"For each i: copy srcs[i] into dsts[i] (same length, not overlapping; skipped when srcs is None)\n"
"and return the psum64 of the bytes, all with the GIL released. With row0s, return instead the\n"
"xor of the weighted row values of each buffer as a piece of a larger object starting at row\n"
"row0s[i] (row0s[i] * 4096 bytes in), without the length mix: the pieces of one object xor up\n"
"(see psum.finish).");

static PyObject *psum_copy(PyObject *self, PyObject *args, PyObject *kwargs) {
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
    if (acquire_views(dsts, 0, n, copy, &dv) < 0)
        goto done;
    if (copy) {
        if (acquire_views(srcs, 0, n, 0, &sv) < 0)
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
        uint64_t h = copy_weighted(dv.views[i].buf, copy ? sv.views[i].buf : NULL, len, row0[i]);
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
    release_views(&dv);
    release_views(&sv);
    PyMem_Free(row0);
    PyMem_Free(res);
    Py_XDECREF(srcs);
    Py_DECREF(dsts);
    return out;
}

/* ---- read_frames ---------------------------------------------------------------------------------- */

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

PyDoc_STRVAR(read_frames_doc,
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

static PyObject *read_frames(PyObject *self, PyObject *args) {
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
    if (acquire_views(dsts, r0, r1, 1, &dv) < 0)
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
            rr[k] = row_sum(dst + off, len);
        }
    }
    PyEval_RestoreThread(s.save);
    if (s.err != RF_INTERRUPTED) /* else the handler's exception propagates; the caller drops the connection */
        out = Py_BuildValue("nnnii", r, (Py_ssize_t)s.start, (Py_ssize_t)s.end, s.err, s.errnum);
done:
    release_views(&dv);
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

/* ---- pack_headers -------------------------------------------------------------------------------- */

/* CRC-32 as zlib.crc32 computes it (reflected polynomial 0xEDB88320): the SSD record header's crc.
 * Bytewise with a table; a header is ~100 bytes, so nothing faster is needed. */
static uint32_t crc_table[256];

static void crc_init(void) {
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

PyDoc_STRVAR(pack_headers_doc,
"pack_headers(buf, ats, keys, flags, seqs, lengths, checksums, magic, version, span=4096) -> None\n\n"
"ssd_format.pack_header_at for many records: at byte ats[i] of the writable buffer buf, the header of\n"
"a record (magic, version, flags[i], len(keys[i]), seqs[i], lengths[i], checksums[i], the crc32,\n"
"keys[i]: bytes), zero-padded to `span` bytes (a whole block in format 1; 0 = the header's own size\n"
"rounded up to 8 bytes, the packed entries of a format-2 group). One call per write group instead of\n"
"~2 us of Python a record.");

static PyObject *pack_headers(PyObject *self, PyObject *args) {
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

/* ==== IndexTable: the compact core of the scheduler's DRAM index (umbp.pool.index) ============
 *
 * Why: a dict of per-object Python objects costs ~470 B and a gen-2 GC traversal per object; at the 10-30 M
 * objects of a 1.8 TB DRAM tier that is GBs of heap and collections of a second or more in vLLM's step
 * loop. Here an object is a row of plain arrays indexed by a uint32 handle (no Python object per row):
 * a 128-bit keyed SipHash digest of the key, its first page, pages, bytes, checksum, pins, state and its
 * LRU links (an array-based doubly linked list: O(1) touch, pin, evict). A key -> handle table uses open
 * addressing with linear probing (backward-shift deletion, no tombstones) over 64-bit cells: the handle + 1
 * and the low 32 bits of the digest's first word. Those bits are the cell's home (the table has at most 2^32
 * cells) and a filter: a probe or a deletion passes other keys' cells without reading their rows' digests,
 * which at millions of objects are cache misses (rows lie apart from their cells in memory). Pages come from
 * PageRuns below. Optionally the key str itself is kept (keep_keys) for callers that must hand victims' keys
 * on (tier demotion).
 *
 * Digest collisions: the table compares the full 128-bit digest of a secret-keyed PRF (SipHash-2-4-128,
 * key from os.urandom per index), so two distinct keys alias with probability ~n^2/2^129 (~1e-24 at 30 M),
 * and nobody without the key can search for a collision.
 */

#define IT_NIL 0xFFFFFFFFu
#define IT_MAX_ROWS (1u << 31) /* so the key table (<= 2 cells per row) has <= 2^32 cells: see it_home */
#define IT_MAX_PAGES 0xffffffffull /* a row's page count is 32 bits */
enum { IT_FREE = 0, IT_PENDING = 1, IT_COMMITTED = 2, IT_PENDING_DOOMED = 3, IT_DOOMED = 4 };
#define IT_HAS_CK 0x80

#define ROTL64(x, b) (((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND                                                                                        \
    do {                                                                                                \
        v0 += v1; v1 = ROTL64(v1, 13); v1 ^= v0; v0 = ROTL64(v0, 32);                                    \
        v2 += v3; v3 = ROTL64(v3, 16); v3 ^= v2;                                                         \
        v0 += v3; v3 = ROTL64(v3, 21); v3 ^= v0;                                                         \
        v2 += v1; v1 = ROTL64(v1, 17); v1 ^= v2; v2 = ROTL64(v2, 32);                                    \
    } while (0)

/* SipHash-2-4 with 128-bit output (the reference algorithm's 16-byte variant). */
static void siphash128(const unsigned char *in, size_t len, uint64_t k0, uint64_t k1, uint64_t out[2]) {
    uint64_t v0 = k0 ^ 0x736f6d6570736575ULL, v1 = k1 ^ 0x646f72616e646f6dULL;
    uint64_t v2 = k0 ^ 0x6c7967656e657261ULL, v3 = k1 ^ 0x7465646279746573ULL;
    v1 ^= 0xee;
    const unsigned char *end = in + (len - (len % 8));
    for (; in != end; in += 8) {
        uint64_t m;
        memcpy(&m, in, 8);
        v3 ^= m;
        SIPROUND; SIPROUND;
        v0 ^= m;
    }
    uint64_t b = ((uint64_t)len) << 56;
    switch (len & 7) {
    case 7: b |= ((uint64_t)in[6]) << 48; /* fall through */
    case 6: b |= ((uint64_t)in[5]) << 40; /* fall through */
    case 5: b |= ((uint64_t)in[4]) << 32; /* fall through */
    case 4: b |= ((uint64_t)in[3]) << 24; /* fall through */
    case 3: b |= ((uint64_t)in[2]) << 16; /* fall through */
    case 2: b |= ((uint64_t)in[1]) << 8;  /* fall through */
    case 1: b |= ((uint64_t)in[0]); break;
    case 0: break;
    }
    v3 ^= b;
    SIPROUND; SIPROUND;
    v0 ^= b;
    v2 ^= 0xee;
    SIPROUND; SIPROUND; SIPROUND; SIPROUND;
    out[0] = v0 ^ v1 ^ v2 ^ v3;
    v1 ^= 0xdd;
    SIPROUND; SIPROUND; SIPROUND; SIPROUND;
    out[1] = v0 ^ v1 ^ v2 ^ v3;
}

#define IT_SEEN 64 /* digests remembered (a save's keys are reserved together, then committed one by one) */

typedef struct {
    PyObject_HEAD
    uint64_t k0, k1;     /* SipHash key */
    int64_t alignment;
    PyObject *slot_type; /* umbp.pool.index.Slot (a tuple subclass) */
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

static int it_digest(IndexTable *t, PyObject *key, uint64_t d[2]) {
    Py_ssize_t n;
    const char *s;
    if (!PyUnicode_Check(key)) {
        PyErr_Format(PyExc_TypeError, "umbp: index keys are str, got %.80s", Py_TYPE(key)->tp_name);
        return -1;
    }
    /* A str never changes, and the entry's reference keeps the object (and so its address) alive. Exact str
     * only: dropping an entry then runs no Python code (a subclass's __del__ could re-enter the table). */
    int exact = PyUnicode_CheckExact(key);
    size_t slot = ((uintptr_t)key >> 4) % IT_SEEN;
    if (exact && t->seen[slot] == key) {
        d[0] = t->seen_d[slot][0];
        d[1] = t->seen_d[slot][1];
        return 0;
    }
    s = PyUnicode_AsUTF8AndSize(key, &n);
    if (s == NULL)
        return -1;
    siphash128((const unsigned char *)s, (size_t)n, t->k0, t->k1, d);
    if (exact) {
        Py_XSETREF(t->seen[slot], Py_NewRef(key));
        t->seen_d[slot][0] = d[0];
        t->seen_d[slot][1] = d[1];
    }
    return 0;
}

#define IT_CELL(d0, h) (((d0) << 32) | ((uint64_t)(h) + 1)) /* the shift keeps d0's low 32 bits */
#define IT_HANDLE(c) ((uint32_t)(c) - 1)

/* A cell's home, from its own bits (the table has at most 2^32 cells). */
static inline uint64_t it_home(const IndexTable *t, uint64_t c) { return (c >> 32) & t->tmask; }

/* The cell holding the row of digest d, or the empty cell where it would go. */
static uint64_t it_probe(IndexTable *t, const uint64_t d[2]) {
    uint64_t i = d[0] & t->tmask, tag = d[0] & 0xFFFFFFFFu;
    for (;;) {
        uint64_t c = t->table[i];
        if (c == 0)
            return i;
        uint32_t h = IT_HANDLE(c);
        if ((c >> 32) == tag && t->dig[2 * h] == d[0] && t->dig[2 * h + 1] == d[1])
            return i;
        i = (i + 1) & t->tmask;
    }
}

static uint32_t it_find(IndexTable *t, const uint64_t d[2]) {
    uint64_t c = t->table[it_probe(t, d)];
    return c ? IT_HANDLE(c) : IT_NIL;
}

static int it_find_key(IndexTable *t, PyObject *key, uint32_t *h) {
    uint64_t d[2];
    if (it_digest(t, key, d) < 0)
        return -1;
    *h = it_find(t, d);
    return 0;
}

static int it_rehash(IndexTable *t, uint64_t size) {
    uint64_t *nt = PyMem_RawCalloc(size, sizeof(uint64_t));
    if (nt == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    uint64_t *old = t->table;
    uint64_t oldsize = old ? t->tmask + 1 : 0;
    t->table = nt;
    t->tmask = size - 1;
    for (uint64_t i = 0; i < oldsize; i++) {
        if (old[i]) { /* keys are distinct: the first empty cell from the home */
            uint64_t j = it_home(t, old[i]);
            while (t->table[j])
                j = (j + 1) & t->tmask;
            t->table[j] = old[i];
        }
    }
    PyMem_RawFree(old);
    return 0;
}

#define IT_GROW(field, type)                                                                             \
    do {                                                                                                \
        void *p = PyMem_RawRealloc(t->field, (size_t)ncap * sizeof(type));                              \
        if (p == NULL)                                                                                  \
            goto nomem;                                                                                 \
        t->field = p;                                                                                   \
    } while (0)

/* Make room for at least `want` rows (0: the next doubling). The new rows are not initialised or listed:
 * rows are taken from `fresh` upwards once the free list is empty, so a large presize costs address
 * space only, until the rows are used (realloc of a large block moves pages, it does not copy them). */
static int it_grow_rows(IndexTable *t, uint64_t want) {
    uint64_t ncap = t->cap ? (uint64_t)t->cap * 2 : 1024;
    if (want > ncap)
        ncap = want;
    if (ncap > IT_MAX_ROWS)
        ncap = IT_MAX_ROWS;
    if (ncap <= t->cap) {
        PyErr_SetString(PyExc_MemoryError, "umbp: the DRAM index holds at most 2**31 objects");
        return -1;
    }
    {
        void *p = PyMem_RawRealloc(t->dig, (size_t)ncap * 2 * sizeof(uint64_t));
        if (p == NULL)
            goto nomem;
        t->dig = p;
    }
    IT_GROW(start, int64_t);
    IT_GROW(nbytes, int64_t);
    IT_GROW(cksum, uint64_t);
    IT_GROW(npages, uint32_t);
    IT_GROW(pins, uint32_t);
    IT_GROW(prev_, uint32_t);
    IT_GROW(next_, uint32_t);
    IT_GROW(state, uint8_t);
    if (t->keep_keys) {
        IT_GROW(keys, PyObject *);
        memset(t->keys + t->cap, 0, (size_t)(ncap - t->cap) * sizeof(PyObject *));
    }
    t->cap = (uint32_t)ncap;
    return 0;
nomem:
    PyErr_NoMemory();
    return -1;
}

static void it_lru_unlink(IndexTable *t, uint32_t h) {
    uint32_t p = t->prev_[h], n = t->next_[h];
    if (p != IT_NIL) t->next_[p] = n; else t->lru_head = n;
    if (n != IT_NIL) t->prev_[n] = p; else t->lru_tail = p;
    t->lru_pages -= t->npages[h];
}

static void it_lru_push(IndexTable *t, uint32_t h) {
    t->prev_[h] = t->lru_tail;
    t->next_[h] = IT_NIL;
    if (t->lru_tail != IT_NIL) t->next_[t->lru_tail] = h; else t->lru_head = h;
    t->lru_tail = h;
    t->lru_pages += t->npages[h];
}

/* Drop row h from the key table (backward-shift deletion) and put it on the free-row list. */
static void it_delete(IndexTable *t, uint32_t h) {
    uint64_t i = t->dig[2 * h] & t->tmask, j;
    while (IT_HANDLE(t->table[i]) != h)
        i = (i + 1) & t->tmask;
    for (j = i;;) {
        j = (j + 1) & t->tmask;
        uint64_t c = t->table[j];
        if (c == 0)
            break;
        uint64_t home = it_home(t, c);
        /* move c back to i unless its home lies cyclically in (i, j] */
        int stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            t->table[i] = c;
            i = j;
        }
    }
    t->table[i] = 0;
    PyObject *key = NULL;
    if (t->keep_keys) {
        key = t->keys[h];
        t->keys[h] = NULL;
    }
    t->state[h] = IT_FREE;
    t->next_[h] = t->free_head;
    t->free_head = h;
    t->used--;
    Py_XDECREF(key); /* last, the row gone: a str subclass's __del__ may use the table */
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

/* A Slot (offset, nbytes, checksum or None) for a row starting at page `start`. */
static PyObject *it_new_slot(IndexTable *t, long long start, long long nbytes, int has_ck, uint64_t cksum) {
    PyTypeObject *tp = (PyTypeObject *)t->slot_type;
    PyObject *s = tp->tp_alloc(tp, 3);
    if (s == NULL)
        return NULL;
    PyObject *off = PyLong_FromLongLong(start * t->alignment);
    PyObject *nb = PyLong_FromLongLong(nbytes);
    PyObject *ck = has_ck ? PyLong_FromUnsignedLongLong(cksum) : Py_NewRef(Py_None);
    if (off == NULL || nb == NULL || ck == NULL) {
        Py_XDECREF(off); Py_XDECREF(nb); Py_XDECREF(ck); Py_DECREF(s);
        return NULL;
    }
    PyTuple_SET_ITEM(s, 0, off);
    PyTuple_SET_ITEM(s, 1, nb);
    PyTuple_SET_ITEM(s, 2, ck);
    return s;
}

static PyObject *it_slot(IndexTable *t, uint32_t h) {
    return it_new_slot(t, t->start[h], t->nbytes[h], (t->state[h] & IT_HAS_CK) != 0, t->cksum[h]);
}

/* A reservation's Slots are made before it looks at the table or the free runs: a Slot is a GC-tracked
 * object, making one can start a garbage collection, and a collection runs finalizers, any Python code,
 * which may reserve or free in this very index. A Slot made for pages not yet chosen holds offset 0 until
 * it_slot_at sets it: an int, whose making starts no collection. */
static int it_slot_at(IndexTable *t, PyObject *slot, long long start) {
    PyObject *off = PyLong_FromLongLong(start * t->alignment);
    if (off == NULL)
        return -1;
    PyObject *old = PyTuple_GET_ITEM(slot, 0);
    PyTuple_SET_ITEM(slot, 0, off);
    Py_DECREF(old);
    return 0;
}

#define IT_STATE(t, h) ((t)->state[h] & 0x7f)

static PyObject *it_run(IndexTable *t, uint32_t h) {
    return Py_BuildValue("(LI)", (long long)t->start[h], (unsigned int)t->npages[h]);
}

/* The key of row h: the str when keep_keys, else its 16-byte digest. */
static PyObject *it_key(IndexTable *t, uint32_t h) {
    if (t->keep_keys && t->keys[h] != NULL)
        return Py_NewRef(t->keys[h]);
    return PyBytes_FromStringAndSize((const char *)&t->dig[2 * h], 16);
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

/* Room for one more row (growing the rows or the key table when due); cell is where digest d goes and moves
 * when the key table grows. 0, or -1 with MemoryError set. */
static int it_make_room(IndexTable *t, const uint64_t d[2], uint64_t *cell) {
    if (t->free_head == IT_NIL && t->fresh == t->cap && it_grow_rows(t, 0) < 0)
        return -1;
    if ((uint64_t)(t->used + 1) * 2 > t->tmask + 1) { /* keep the load <= 1/2: short probes */
        if (it_rehash(t, (t->tmask + 1) * 2) < 0)
            return -1;
        *cell = it_probe(t, d);
    }
    return 0;
}

/* Rows and key-table cells (load <= 1/2) for `rows` rows in all (<= IT_MAX_ROWS), made now: adding rows up
 * to that count then never grows anything. 0, or -1 with MemoryError set. */
static int it_room_for(IndexTable *t, uint64_t rows) {
    if (rows > t->cap && it_grow_rows(t, rows) < 0) /* the rows not in use (free list, never used): cap - used */
        return -1;
    uint64_t size = t->tmask + 1;
    while (size < 2 * rows)
        size *= 2;
    return size > t->tmask + 1 ? it_rehash(t, size) : 0;
}

/* A new pending row for digest d at the empty cell (after it_make_room). Allocates nothing, so it cannot
 * fail, and runs no Python code: callers make the row's Slot first (see it_slot_at), and a reservation
 * that runs out of memory changes nothing. */
static void it_put_row(IndexTable *t, PyObject *key, const uint64_t d[2], uint64_t cell, long long start,
                       uint32_t npages, long long nbytes) {
    uint32_t h = t->free_head;
    if (h != IT_NIL)
        t->free_head = t->next_[h];
    else
        h = t->fresh++;
    t->dig[2 * h] = d[0];
    t->dig[2 * h + 1] = d[1];
    t->start[h] = start;
    t->npages[h] = npages;
    t->nbytes[h] = nbytes;
    t->pins[h] = 0;
    t->state[h] = IT_PENDING;
    t->prev_[h] = t->next_[h] = IT_NIL;
    if (t->keep_keys)
        t->keys[h] = Py_NewRef(key);
    t->table[cell] = IT_CELL(d[0], h);
    t->used++;
    t->reserved++;
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
static PyObject *IndexTable_abort(IndexTable *t, PyObject *key) {
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

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
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
static PyObject *IndexTable_remove(IndexTable *t, PyObject *keys) {
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
    qsort(rows, (size_t)committed, sizeof(uint64_t), cmp_u64); /* a key given twice is removed once */
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
static PyObject *IndexTable_clear(IndexTable *t, PyObject *unused) {
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
    qsort(v, (size_t)m, 2 * sizeof(uint64_t), cmp_u64); /* page order: see DramIndex.clear */
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
static PyObject *IndexTable_unpin(IndexTable *t, PyObject *keys) {
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
static PyObject *IndexTable_evict(IndexTable *t, PyObject *unused) {
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

static PyTypeObject IndexTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "umbp.pool._native.IndexTable",
    .tp_basicsize = sizeof(IndexTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Compact key -> slot table of the DRAM index (see umbp.pool.index).",
    .tp_new = IndexTable_new,
    .tp_dealloc = (destructor)IndexTable_dealloc,
    .tp_methods = IndexTable_methods,
    .tp_members = IndexTable_members,
    .tp_as_sequence = &IndexTable_as_seq,
};

/* ==== end of IndexTable ============================================================================= */

/* ==== PageRuns: the DRAM index's page allocator (umbp.pool.dram.allocator.PageAllocator's C twin) ====
 *
 * Why: with the key table in C, the Python allocator was most of a reserve+commit (alloc, free and their
 * dict and bisect work: ~55% of a steady-state put, profiled). Same rules and same answers as the Python
 * class (tests compare them): free space as maximal runs of pages, one FIFO list per run length, best fit
 * (the shortest length >= n, the oldest run of that length), frees coalesce with both neighbours.
 * Runs are nodes in plain arrays; start -> run and end -> run are open-addressing tables (linear probing,
 * backward-shift deletion); the distinct lengths are a sorted array (a handful of KV page sizes in practice).
 */

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

static inline uint64_t pr_hash(uint64_t k, uint64_t mask) {
    k *= 0x9E3779B97F4A7C15ULL;
    return (k ^ (k >> 31)) & mask;
}

static inline uint64_t pr_key(const PageRuns *r, int end, uint32_t node) {
    return end ? r->rstart[node] + r->rlen[node] : r->rstart[node];
}

static uint32_t pr_find(const PageRuns *r, int end, uint64_t key) {
    const uint32_t *m = end ? r->by_end : r->by_start;
    for (uint64_t i = pr_hash(key, r->mask);; i = (i + 1) & r->mask) {
        uint32_t c = m[i];
        if (c == 0)
            return IT_NIL;
        if (pr_key(r, end, c - 1) == key)
            return c - 1;
    }
}

static void pr_put(PageRuns *r, int end, uint32_t node) {
    uint32_t *m = end ? r->by_end : r->by_start;
    uint64_t i = pr_hash(pr_key(r, end, node), r->mask);
    while (m[i])
        i = (i + 1) & r->mask;
    m[i] = node + 1;
}

/* Backward-shift deletion; node's start and length must still be its key's. */
static void pr_del(PageRuns *r, int end, uint32_t node) {
    uint32_t *m = end ? r->by_end : r->by_start;
    uint64_t i = pr_hash(pr_key(r, end, node), r->mask), j;
    while (m[i] != node + 1)
        i = (i + 1) & r->mask;
    for (j = i;;) {
        j = (j + 1) & r->mask;
        uint32_t c = m[j];
        if (c == 0)
            break;
        uint64_t home = pr_hash(pr_key(r, end, c - 1), r->mask);
        int stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            m[i] = c;
            i = j;
        }
    }
    m[i] = 0;
}

static int pr_rehash(PageRuns *r, uint64_t size) {
    uint32_t *ns = PyMem_RawCalloc(size, sizeof(uint32_t)), *ne = PyMem_RawCalloc(size, sizeof(uint32_t));
    if (ns == NULL || ne == NULL) {
        PyMem_RawFree(ns);
        PyMem_RawFree(ne);
        PyErr_NoMemory();
        return -1;
    }
    uint32_t *os = r->by_start;
    uint64_t oldsize = os ? r->mask + 1 : 0;
    PyMem_RawFree(r->by_end);
    r->by_start = ns;
    r->by_end = ne;
    r->mask = size - 1;
    for (uint64_t i = 0; i < oldsize; i++) {
        if (os[i]) {
            pr_put(r, 0, os[i] - 1);
            pr_put(r, 1, os[i] - 1);
        }
    }
    PyMem_RawFree(os);
    return 0;
}

static size_t pr_lower(const PageRuns *r, uint64_t n) { /* first index with lens[i] >= n */
    size_t lo = 0, hi = r->nlens;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (r->lens[mid] < n)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

#define PR_GROW(field, type, n)                                                                          \
    do {                                                                                                \
        void *p = PyMem_RawRealloc(r->field, (size_t)(n) * sizeof(type));                               \
        if (p == NULL)                                                                                  \
            goto nomem;                                                                                 \
        r->field = p;                                                                                   \
    } while (0)

/* The most distinct lengths free runs can have: k, with k (k + 1) / 2 <= npages (they sum to at most every page). */
static uint64_t pr_most_lengths(const PageRuns *r) {
    uint64_t k = 0;
    for (uint64_t hi = 1ull << 31; k < hi;) {
        uint64_t mid = (k + hi + 1) / 2;
        if (mid * (mid + 1) / 2 <= (uint64_t)r->npages)
            k = mid;
        else
            hi = mid - 1;
    }
    return k;
}

/* Room for m more runs than there are, and one: their nodes, length classes and hash cells, so that m frees
 * in a row allocate nothing (PageRuns.hand_back), and, with m = 0 (pr_room), so that the pr_add after a
 * free or a take drops runs cannot fail: one that runs out of memory changes nothing. Bounded by what free
 * runs can become: they lie apart (each merged with its free neighbours), so never more than half the
 * pages are runs, and their lengths are few (pr_most_lengths); a clear() of millions of objects then does
 * not grow the arrays for a run per object. */
static int pr_room_for(PageRuns *r, uint64_t m) {
    uint64_t most = ((uint64_t)r->npages + 1) / 2, runs = r->nruns + m, classes = r->nlens + m + 1;
    runs = (runs < most ? runs : most) + 1;
    if (classes > r->lcap && m > 0) {
        uint64_t k = pr_most_lengths(r) + 1;
        classes = classes < k ? classes : k;
    }
    uint64_t size = r->mask + 1;
    while (runs * 2 > size)
        size *= 2;
    if (size > r->mask + 1 && pr_rehash(r, size) < 0)
        return -1;
    if (r->ncap < runs) { /* the nodes not holding a run: the free list and the fresh ones */
        uint64_t n = (uint64_t)r->ncap;
        while (n < runs)
            n *= 2;
        if (n >= IT_NIL) {
            PyErr_SetString(PyExc_MemoryError, "umbp: too many free page runs");
            return -1;
        }
        PR_GROW(rstart, uint64_t, n);
        PR_GROW(rlen, uint64_t, n);
        PR_GROW(prev, uint32_t, n);
        PR_GROW(next, uint32_t, n);
        r->ncap = (uint32_t)n;
    }
    if (r->lcap < classes) {
        size_t n = r->lcap;
        while (n < classes)
            n *= 2;
        PR_GROW(lens, uint64_t, n);
        PR_GROW(head, uint32_t, n);
        PR_GROW(tail, uint32_t, n);
        r->lcap = n;
    }
    return 0;
nomem:
    PyErr_NoMemory();
    return -1;
}

static int pr_room(PageRuns *r) {
    if ((r->nruns + 1) * 2 <= r->mask + 1 && r->ncap > r->nruns && r->nlens < r->lcap)
        return 0; /* room already: the common case, on every take and free */
    return pr_room_for(r, 0);
}

static int pr_add(PageRuns *r, uint64_t start, uint64_t length) {
    if (pr_room(r) < 0)
        return -1;
    uint32_t node = r->nfree;
    if (node != IT_NIL)
        r->nfree = r->next[node];
    else
        node = r->nfresh++;
    r->rstart[node] = start;
    r->rlen[node] = length;
    pr_put(r, 0, node);
    pr_put(r, 1, node);
    size_t i = pr_lower(r, length);
    if (i == r->nlens || r->lens[i] != length) {
        size_t k = r->nlens - i;
        memmove(r->lens + i + 1, r->lens + i, k * sizeof(uint64_t));
        memmove(r->head + i + 1, r->head + i, k * sizeof(uint32_t));
        memmove(r->tail + i + 1, r->tail + i, k * sizeof(uint32_t));
        r->lens[i] = length;
        r->head[i] = r->tail[i] = IT_NIL;
        r->nlens++;
    }
    r->prev[node] = r->tail[i];
    r->next[node] = IT_NIL;
    if (r->tail[i] != IT_NIL)
        r->next[r->tail[i]] = node;
    else
        r->head[i] = node;
    r->tail[i] = node;
    r->free_pages += (long long)length;
    r->nruns++;
    return 0;
}

static void pr_drop(PageRuns *r, uint32_t node) {
    uint64_t length = r->rlen[node];
    size_t i = pr_lower(r, length);
    uint32_t p = r->prev[node], n = r->next[node];
    if (p != IT_NIL) r->next[p] = n; else r->head[i] = n;
    if (n != IT_NIL) r->prev[n] = p; else r->tail[i] = p;
    if (r->head[i] == IT_NIL) {
        size_t k = r->nlens - i - 1;
        memmove(r->lens + i, r->lens + i + 1, k * sizeof(uint64_t));
        memmove(r->head + i, r->head + i + 1, k * sizeof(uint32_t));
        memmove(r->tail + i, r->tail + i + 1, k * sizeof(uint32_t));
        r->nlens--;
    }
    pr_del(r, 0, node);
    pr_del(r, 1, node);
    r->next[node] = r->nfree;
    r->nfree = node;
    r->free_pages -= (long long)length;
    r->nruns--;
}

/* The best-fit free run for n > 0 pages, changing nothing: its length class (r->nlens when no free run is
 * long enough), and where it starts in *start. pr_take_at takes the pages; callers make what can fail (a
 * Slot's offset, an int) in between, so that running out of memory changes nothing. */
static size_t pr_fit(const PageRuns *r, uint64_t n, uint64_t *start) {
    size_t i = pr_lower(r, n);
    *start = i < r->nlens ? r->rstart[r->head[i]] : 0;
    return i;
}

/* Take n pages from the front of the first run of length class i (pr_fit's answer): 0, or -1 (no memory,
 * nothing changed). */
static int pr_take_at(PageRuns *r, size_t i, uint64_t n) {
    if (pr_room(r) < 0) /* before the drop: see pr_room (growing the length arrays keeps class i) */
        return -1;
    uint32_t node = r->head[i];
    uint64_t start = r->rstart[node], length = r->rlen[node];
    pr_drop(r, node);
    return length > n ? pr_add(r, start + n, length - n) : 0; /* cannot fail: pr_room made room */
}

/* alloc(n) -> start page of a fresh run of n pages (best fit), or None if no free run is long enough. */
static PyObject *PageRuns_alloc(PageRuns *r, PyObject *arg) {
    long long n = PyLong_AsLongLong(arg);
    uint64_t start;
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n <= 0)
        return PyLong_FromLong(0);
    size_t fit = pr_fit(r, (uint64_t)n, &start);
    if (fit == r->nlens)
        Py_RETURN_NONE;
    PyObject *out = PyLong_FromUnsignedLongLong(start); /* before the take: out of memory changes nothing */
    if (out != NULL && pr_take_at(r, fit, (uint64_t)n) < 0)
        Py_CLEAR(out);
    return out;
}

/* The run [start, start + length) back to the free space, merged with free neighbours: 0, or -1 (no memory). */
static int pr_free(PageRuns *r, uint64_t start, uint64_t length) {
    if (pr_room(r) < 0) /* before the drops: see pr_room */
        return -1;
    uint32_t left = pr_find(r, 1, start);
    if (left != IT_NIL) {
        start = r->rstart[left];
        length += r->rlen[left];
        pr_drop(r, left);
    }
    uint32_t right = pr_find(r, 0, start + length);
    if (right != IT_NIL) {
        length += r->rlen[right];
        pr_drop(r, right);
    }
    return pr_add(r, start, length);
}

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
static PyObject *PageRuns_hand_back(PageRuns *r, PyObject *args) {
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

/* free(start, n): the run back to the free space, merged with free neighbours. */
static PyObject *PageRuns_free(PageRuns *r, PyObject *args) {
    long long s, n;
    if (!PyArg_ParseTuple(args, "LL", &s, &n))
        return NULL;
    if (n <= 0)
        Py_RETURN_NONE;
    if (s < 0) {
        PyErr_SetString(PyExc_ValueError, "umbp: PageRuns.free of a negative start");
        return NULL;
    }
    if (pr_free(r, (uint64_t)s, (uint64_t)n) < 0)
        return NULL;
    Py_RETURN_NONE;
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
static PyObject *PageRuns_reserve_row(PageRuns *r, PyObject *const *args, Py_ssize_t nargs) {
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
static PyObject *PageRuns_reserve_rows(PageRuns *r, PyObject *const *args, Py_ssize_t nargs) {
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
    qsort(first, (size_t)n, sizeof(uint64_t), cmp_u64);
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
static PyObject *PageRuns_evict_lru(PageRuns *r, PyObject *args) {
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

static PyObject *PageRuns_largest_free(PageRuns *r, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(r->nlens ? r->lens[r->nlens - 1] : 0);
}

/* free_runs() -> sorted [(start, length)] of every free run; for tests and debugging. */
static PyObject *PageRuns_free_runs(PageRuns *r, PyObject *unused) {
    PyObject *out = PyList_New(0);
    for (size_t i = 0; out != NULL && i < r->nlens; i++) {
        for (uint32_t node = r->head[i]; node != IT_NIL; node = r->next[node]) {
            PyObject *run = Py_BuildValue("(KK)", (unsigned long long)r->rstart[node],
                                          (unsigned long long)r->rlen[node]);
            if (run == NULL || PyList_Append(out, run) < 0) {
                Py_XDECREF(run);
                Py_CLEAR(out);
                break;
            }
            Py_DECREF(run);
        }
    }
    if (out != NULL && PyList_Sort(out) < 0)
        Py_CLEAR(out);
    return out;
}

static int PageRuns_init(PageRuns *r, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"npages", NULL};
    long long npages;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "L", kwlist, &npages))
        return -1;
    r->npages = npages;
    r->ncap = 64;
    r->lcap = 16;
    r->nfree = IT_NIL;
    r->rstart = PyMem_RawMalloc(64 * sizeof(uint64_t));
    r->rlen = PyMem_RawMalloc(64 * sizeof(uint64_t));
    r->prev = PyMem_RawMalloc(64 * sizeof(uint32_t));
    r->next = PyMem_RawMalloc(64 * sizeof(uint32_t));
    r->lens = PyMem_RawMalloc(16 * sizeof(uint64_t));
    r->head = PyMem_RawMalloc(16 * sizeof(uint32_t));
    r->tail = PyMem_RawMalloc(16 * sizeof(uint32_t));
    if (!r->rstart || !r->rlen || !r->prev || !r->next || !r->lens || !r->head || !r->tail) {
        PyErr_NoMemory();
        return -1;
    }
    if (pr_rehash(r, 64) < 0)
        return -1;
    if (npages > 0 && pr_add(r, 0, (uint64_t)npages) < 0)
        return -1;
    return 0;
}

/* Made and set up in one step: an object made by __new__ alone would have no arrays, and its methods would
 * read through NULL. */
static PyObject *PageRuns_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    PageRuns *r = (PageRuns *)type->tp_alloc(type, 0);
    if (r != NULL && PageRuns_init(r, args, kw) < 0)
        Py_CLEAR(r);
    return (PyObject *)r;
}

static void PageRuns_dealloc(PageRuns *r) {
    PyMem_RawFree(r->rstart);
    PyMem_RawFree(r->rlen);
    PyMem_RawFree(r->prev);
    PyMem_RawFree(r->next);
    PyMem_RawFree(r->by_start);
    PyMem_RawFree(r->by_end);
    PyMem_RawFree(r->lens);
    PyMem_RawFree(r->head);
    PyMem_RawFree(r->tail);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyMethodDef PageRuns_methods[] = {
    {"alloc", (PyCFunction)PageRuns_alloc, METH_O, NULL},
    {"free", (PyCFunction)PageRuns_free, METH_VARARGS, NULL},
    {"hand_back", (PyCFunction)PageRuns_hand_back, METH_VARARGS, NULL},
    {"largest_free", (PyCFunction)PageRuns_largest_free, METH_NOARGS, NULL},
    {"free_runs", (PyCFunction)PageRuns_free_runs, METH_NOARGS, NULL},
    {"evict_lru", (PyCFunction)PageRuns_evict_lru, METH_VARARGS, NULL},
    {"reserve_row", (PyCFunction)(void (*)(void))PageRuns_reserve_row, METH_FASTCALL, NULL},
    {"reserve_rows", (PyCFunction)(void (*)(void))PageRuns_reserve_rows, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef PageRuns_members[] = {
    {"npages", T_LONGLONG, offsetof(PageRuns, npages), READONLY, "pages managed"},
    {"free_pages", T_LONGLONG, offsetof(PageRuns, free_pages), READONLY, "pages in free runs"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject PageRunsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "umbp.pool._native.PageRuns",
    .tp_basicsize = sizeof(PageRuns),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PageRuns_new,
    .tp_dealloc = (destructor)PageRuns_dealloc,
    .tp_methods = PageRuns_methods,
    .tp_members = PageRuns_members,
};

/* ==== end of PageRuns ================================================================================ */

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
