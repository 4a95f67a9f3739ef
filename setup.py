"""Build the optional C accelerator; tarshards works without it (pure Python fallback)."""

import sys

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tarshards._speedups",
            ["src/tarshards/_speedups.c"],
            depends=["src/tarshards/_names.h"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
        # xxh3_64 through the system's libxxhash (Debian: libxxhash-dev), vectorised at run time
        # (AVX2 where there is one) and hashing without the GIL; skipped where its headers are
        # missing (the xxhash package then hashes, with the same values)
        Extension(
            "tarshards._xxh3",
            ["src/tarshards/_xxh3.c"],
            depends=["src/tarshards/_names.h"],
            optional=True,
            libraries=["xxhash"],
            extra_compile_args=["-O2"],
        ),
        # the largest deficit rule of mixing by tokens (tarshards.mixing; numpy without it),
        # in the same float64 operations as numpy's: no fused multiply-adds
        Extension(
            "tarshards._deficits",
            ["src/tarshards/_deficits.c"],
            optional=True,
            extra_compile_args=["-O2", "-ffp-contract=off"],
        ),
        # JPEG decoding and cropped decoding over the system's libjpeg-turbo (Debian:
        # libjpeg-dev); skipped where its headers are missing (simplejpeg and Pillow then decode)
        Extension(
            "tarshards._jpeg",
            ["src/tarshards/_jpeg.c"],
            optional=True,
            # dladdr (library()): in libc since glibc 2.34, in libdl before
            libraries=["jpeg"] + (["dl"] if sys.platform.startswith("linux") else []),
            extra_compile_args=["-O2"],
        ),
    ],
)
