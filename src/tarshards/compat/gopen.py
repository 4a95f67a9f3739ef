"""webdataset's ``gopen``: open a URL for reading or writing through :func:`tarshards.open_url`.

``pipe:`` URLs need ``allow_pipe=True`` (webdataset runs them by default).
"""

from __future__ import annotations

import contextlib

from ..storage import open_url

__all__ = ["gopen"]


class _Opened:
    """An open stream that also closes what opened it (a context manager too)."""

    def __init__(self, url, mode, **options):
        self._stack = contextlib.ExitStack()
        self.stream = self._stack.enter_context(open_url(url, mode, **options))
        self.url = url

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def read(self, *args):
        return self.stream.read(*args)

    def write(self, data):
        return self.stream.write(data)

    def close(self):
        self._stack.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def gopen(url, mode: str = "rb", bufsize: int = 8192, *, allow_pipe: bool = False, **options):
    """A binary stream for ``url`` (a path, ``file:``, ``http(s)://``, ``s3://``..., ``-``)."""
    if "b" not in mode:
        raise ValueError(f"gopen opens binary streams; mode {mode!r} has no 'b'")
    return _Opened(url, mode, allow_pipe=allow_pipe, **options)


gopen_schemes: dict[str, object] = {}  # fsspec decides which protocols are known
