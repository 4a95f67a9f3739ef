"""Build the optional C accelerator; tarshards works without it (pure Python fallback)."""

import sys

from setuptools import Extension, setup


def _c(*names: str) -> list[str]:
    """Paths of files in src/tarshards/_c/."""
    return [f"src/tarshards/_c/{name}" for name in names]


setup(
    ext_modules=[
        # the C sources by concern (src/tarshards/_c/: one file each, tar.h the one tar header
        # parser and builder that every C path shares)
        Extension(
            "tarshards._speedups",
            _c(
                "speedups_module.c",
                "members.c",
                "samples.c",
                "group.c",
                "write.c",
                "recorder.c",
                "index_scan.c",
                "random_access.c",
                "shuffle.c",
                "writebehind.c",
                "counted.c",
            ),
            depends=_c("speedups.h", "tar.h", "names.h"),
            optional=True,
            extra_compile_args=["-O2"],
        ),
        # xxh3_64 through the system's libxxhash (Debian: libxxhash-dev), vectorised at run time
        # (AVX2 where there is one) and hashing without the GIL; skipped where its headers are
        # missing (the xxhash package then hashes, with the same values)
        Extension(
            "tarshards._xxh3",
            _c("xxh3_module.c", "readback.c"),
            depends=_c("xxh3.h", "tar.h", "names.h"),
            optional=True,
            libraries=["xxhash"],
            extra_compile_args=["-O2"],
        ),
        # the largest deficit rule of mixing by tokens (tarshards.plan.mixing; numpy without it),
        # in the same float64 operations as numpy's: no fused multiply-adds
        Extension(
            "tarshards._deficits",
            _c("deficits.c"),
            optional=True,
            extra_compile_args=["-O2", "-ffp-contract=off"],
        ),
        # JPEG decoding and cropped decoding over the system's libjpeg-turbo (Debian:
        # libjpeg-dev); skipped where its headers are missing (simplejpeg and Pillow then decode)
        Extension(
            "tarshards._jpeg",
            _c("jpeg.c"),
            optional=True,
            # dladdr (library()): in libc since glibc 2.34, in libdl before
            libraries=["jpeg"] + (["dl"] if sys.platform.startswith("linux") else []),
            extra_compile_args=["-O2"],
        ),
    ],
)
