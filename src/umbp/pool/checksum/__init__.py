"""The per-object checksum ("psum64", format 2) and the fused copy + checksum used by every tier.

    from umbp.pool.checksum import checksum
    digest = checksum(buffer)   # a 64-bit int

Definition. An object of n bytes is zero-padded to whole 4 KiB rows of 512 little-endian uint64 words;
word i = 64*m + l of row r (lane l < 64, step m < 8) is read as a polynomial over GF(2) of degree < 64
and given the exponent e = 512*r + 8*l + (7 - m). The digest is

    D = ( XOR over all words of  w * x**(64*e)  mod P ) xor (n * GOLDEN mod 2**64)

with carry-less products and P = x**64 + x**4 + x**3 + x + 1 (primitive: x has order 2**64 - 1). Every
bit of the object gets its own power of x, 64*e + bit, so this is a CRC-64 of the object's bits in a
fixed order (lanes transposed inside each row).

Why this function (docs/pool.md has the full argument): the former psum64 added words mod 2**64 and so
could not see two words swapped inside a row. No digest that adds per-word terms mod 2**64 can: a swap
changes it by f_i(b) - f_i(a) + f_j(a) - f_j(b), and for that never to vanish every f_i - f_j must be a
bijection of Z/2**64, which a cyclic group of even order does not allow for three positions (Hall-Paige).
XOR-accumulated products in the field GF(2**64) = GF(2)[x]/P have no such limit, and with the powers of
x above they detect with certainty: any change inside one word (every single-bit flip), any two flipped
bits anywhere, any swap of two different words anywhere in the object, and a swap of two rows whose
row values (below) differ. A zeroed block, a reordering of more rows, or other damage escapes only when
the error polynomial is a multiple of P (about 2**-64 for damage unrelated to P).

How it is computed cheaply everywhere (the GPU kernel and the C extension's portable path): inside a row,
each lane is a Horner chain over its 8 steps,
acc = acc * x**64 + w, and multiplying by x**64 is a few shifts and xors because P is sparse (mulx64).
Each lane's result is then multiplied once by K[64*r + l] = x**(512*(64*r + l)) (a full field product,
once per 8 words); the row's *value* rho_r is the XOR of its lanes times K[l], and D is the XOR of
rho_r * K[64*r] (the row weight) over rows, plus the length term. Rows, and pieces of an object cut at
row boundaries, combine by XOR, so threads, pieces and GPU programs add their parts with xor. With a
carry-less multiply instruction (x86-64 PCLMULQDQ) the C extension instead multiplies every word by its
power of x directly; the numpy path runs the lanes' Horner chains on arrays of rows and looks each
result's bytes up in a table (1 MiB), or for a few rows looks every byte's term up (8 MiB), built on
first use.

Modules: `gf64` (the field arithmetic and weight tables), `digest` (psum64 of objects and rows),
`fused_copy` (copy + checksum in one pass, split across threads). The C extension (umbp.pool._native)
and the GPU copy kernel (umbp.transfer.triton_kernels) compute the same value; this package is the
reference and the fallback.
"""

from umbp.pool.checksum.digest import (
    FORMAT,
    as_rows,
    checksum,
    checksum_u8,
    combine,
    combine_padded_rows,
    combine_rows,
    finish,
    row_sums_into,
    row_values,
)
from umbp.pool.checksum.fused_copy import (
    CHUNK_BYTES,
    PARALLEL_MIN_BYTES,
    PARALLEL_MIN_MEAN_OBJECT,
    copy_many,
    copy_with_checksum,
    run_split,
)
from umbp.pool.checksum.gf64 import (
    GOLDEN,
    LANES,
    POLY_LOW,
    ROW_BYTES,
    ROW_WORDS,
    STEPS,
    gf_mul,
    gf_mul_int,
    lane_table,
    mulx64,
)

__all__ = [
    "CHUNK_BYTES",
    "FORMAT",
    "GOLDEN",
    "LANES",
    "PARALLEL_MIN_BYTES",
    "PARALLEL_MIN_MEAN_OBJECT",
    "POLY_LOW",
    "ROW_BYTES",
    "ROW_WORDS",
    "STEPS",
    "as_rows",
    "checksum",
    "checksum_u8",
    "combine",
    "combine_padded_rows",
    "combine_rows",
    "copy_many",
    "copy_with_checksum",
    "finish",
    "gf_mul",
    "gf_mul_int",
    "lane_table",
    "mulx64",
    "row_sums_into",
    "row_values",
    "run_split",
]
