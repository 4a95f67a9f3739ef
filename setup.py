"""Build the optional C accelerator; tarshards works without it (pure Python fallback)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tarshards._speedups",
            ["src/tarshards/_speedups.c"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
    ],
)
