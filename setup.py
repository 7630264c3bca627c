"""Builds umbp's optional C extensions (umbp.pool._native, umbp.transfer._rounds, _checks and _copies);
everything else is in pyproject.toml.

The extensions are optional: without a C compiler the install still succeeds and umbp runs its pure-Python
paths (slower on hosts with many cores; see docs/pool.md). CI sets UMBP_REQUIRE_NATIVE=1 so a build that
silently failed there is an error, not a slower pass."""

from setuptools import Extension, setup

# umbp.pool._native: one extension from several files, one concept each (module.c says which holds what),
# compiled as one unit (unity.c includes them all, so that calls between them inline as within one file).
# Their folder is not named _native: where the extension was not built, `import umbp.pool._native` would
# then find the folder (an empty namespace package) instead of failing over to the pure-Python paths.
NATIVE = "src/umbp/pool/_native_c"
NATIVE_FILES = (
    "module",
    "psum",
    "copy",
    "frames",
    "headers",
    "index_table",
    "index_ops",
    "page_runs",
    "page_runs_index",
)

setup(
    ext_modules=[
        Extension(
            "umbp.pool._native",
            [f"{NATIVE}/unity.c"],
            depends=[f"{NATIVE}/native.h", *(f"{NATIVE}/{name}.c" for name in NATIVE_FILES)],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        ),
        *(
            Extension(
                f"umbp.transfer.{name}",
                [f"src/umbp/transfer/{name}.c"],
                depends=["src/umbp/transfer/_radix.h"],
                extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
                optional=True,
            )
            for name in ("_rounds", "_checks", "_copies")
        ),
    ]
)
