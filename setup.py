"""Builds umbp's optional C extensions (umbp.pool._native, umbp.transfer._rounds, _checks and _copies);
everything else is in pyproject.toml.

The extensions are optional: without a C compiler the install still succeeds and umbp runs its pure-Python
paths (slower on hosts with many cores; see docs/pool.md). CI sets UMBP_REQUIRE_NATIVE=1 so a build that
silently failed there is an error, not a slower pass."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "umbp.pool._native",
            ["src/umbp/pool/_native.c"],
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
