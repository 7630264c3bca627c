/* umbp.transfer C extensions: the radix sort both use (_rounds.c, _checks.c). A header of one static
 * function, compiled into each module: the extensions load independently, so they share no symbols. */
#ifndef UMBP_RADIX_H
#define UMBP_RADIX_H

#include <Python.h>

#include <stdint.h>
#include <string.h>

/* Sort 64-bit keys ascending (the callers pack a value above an index) by LSD radix, 11 bits a pass,
 * passes whose digit is the same for every key skipped: a round's offsets, or one group's block ids,
 * share their high bits. Insertion sort below 48. */
static void sort_keys(uint64_t *k, uint64_t *tmp, Py_ssize_t n) {
    if (n < 48) {
        for (Py_ssize_t i = 1; i < n; i++) {
            uint64_t v = k[i];
            Py_ssize_t j = i;
            for (; j > 0 && k[j - 1] > v; j--)
                k[j] = k[j - 1];
            k[j] = v;
        }
        return;
    }
    uint64_t all_or = 0, all_and = ~(uint64_t)0;
    for (Py_ssize_t i = 0; i < n; i++) {
        all_or |= k[i];
        all_and &= k[i];
    }
    uint64_t differ = all_or ^ all_and;
    Py_ssize_t count[2048];
    for (int shift = 0; shift < 64; shift += 11) {
        if (((differ >> shift) & 2047) == 0)
            continue;
        memset(count, 0, sizeof count);
        for (Py_ssize_t i = 0; i < n; i++)
            count[(k[i] >> shift) & 2047]++;
        Py_ssize_t at = 0;
        for (int d = 0; d < 2048; d++) {
            Py_ssize_t c = count[d];
            count[d] = at;
            at += c;
        }
        for (Py_ssize_t i = 0; i < n; i++)
            tmp[count[(k[i] >> shift) & 2047]++] = k[i];
        memcpy(k, tmp, (size_t)n * sizeof *k);
    }
}

#endif
