/* umbp.pool._native, psum64: the checksum's maths (GF(2^64) arithmetic, a 4 KiB row's value in three
 * implementations picked at load time), the weighted copy under psum_copy (copy.c), and the module
 * functions psum_rows and psum_impl.
 *
 * psum64 format 2 (see umbp/pool/checksum/): a CRC-64 (P = x^64 + x^4 + x^3 + x + 1) of the object's bits in a
 * fixed order: each 4 KiB row (the last zero-padded) is 64 Horner chains of 8 words, lane l times
 * x^(512 l), row r times x^(32768 r), all xored, the length mixed in with xor (nbytes * GOLDEN).
 */
#include "native.h"

/* AVX2 and baseline versions of the portable row loop, picked at load time (GCC/Clang on x86-64 with
 * ifunc); elsewhere (aarch64, e.g. GH200 hosts) one version, which the compiler vectorises itself. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && defined(__linux__)
#define HOT_LOOP __attribute__((target_clones("avx2", "default")))
#else
#define HOT_LOOP
#endif

#define ROW_WORDS (ROW_BYTES / 8)
#define LANES 64
#define STEPS (ROW_WORDS / LANES)

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
/* x^(64 e(i)) for word i of a row: what the carry-less path multiplies by. Cache-line aligned: row_value_vclmul
 * reads it 64 bytes at a time, and with every load split over two lines psum_copy ran ~4% slower. */
static _Alignas(64) uint64_t gamma_k[ROW_WORDS];
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
uint64_t (*psum_row_value_fn)(const unsigned char *, size_t) = row_value_portable;
static uint64_t (*gf_mul_fn)(uint64_t, uint64_t) = gf_mul_portable;

/* GCC 12 calls a target_clones function a local variable when its address goes into a pointer other files read
 * (psum_row_value_fn): -Wdangling-pointer, a false positive (it is a function, and lives as long as the module). */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdangling-pointer"
#endif
static void set_impl(int impl) {
    impl_now = impl;
    psum_row_value_fn = row_value_portable;
    gf_mul_fn = gf_mul_portable;
#ifdef HAVE_CLMUL_PATH
    if (impl >= IMPL_CLMUL) {
        gf_mul_fn = gf_mul_clmul;
        psum_row_value_fn = impl == IMPL_VCLMUL ? row_value_vclmul : row_value_clmul;
    }
#endif
}
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#pragma GCC diagnostic pop
#endif

void psum_init(void) {
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

uint64_t psum_copy_weighted(unsigned char *dst, const unsigned char *src, size_t n, uint64_t row0) {
    uint64_t h = 0, w = row_weight(row0);
    for (size_t c = 0; c < n; c += COPY_CHUNK) {
        size_t clen = n - c < COPY_CHUNK ? n - c : COPY_CHUNK;
        if (src != NULL)
            memcpy(dst + c, src + c, clen);
        for (size_t off = 0; off < clen; off += ROW_BYTES) {
            size_t len = clen - off < ROW_BYTES ? clen - off : ROW_BYTES;
            h ^= gf_mul_fn(psum_row_sum(dst + c + off, len), w);
            w = gf_mul_fn(w, row_step);
        }
    }
    return h;
}

const char psum_rows_doc[] = PyDoc_STR(
"psum_rows(src, out)\n\n"
"psum64's row value of each 4096-byte row of src (a whole number of rows) into out (a writable\n"
"buffer of one uint64 per row), with the GIL released: what the SSD tier combines per record.");

PyObject *psum_rows(PyObject *self, PyObject *args) {
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
        uint64_t v = psum_row_sum(p + r * ROW_BYTES, ROW_BYTES);
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

const char psum_impl_doc[] = PyDoc_STR(
"psum_impl(name=None) -> str\n\n"
"The row-value implementation in use ('portable', 'clmul' or 'vclmul'); with a name, switch to it\n"
"(for tests: every implementation gives the same values). Naming one this CPU lacks is a ValueError.");

PyObject *psum_impl(PyObject *self, PyObject *args) {
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
