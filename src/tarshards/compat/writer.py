"""webdataset's ``TarWriter`` and ``ShardWriter`` signatures on tarshards' writers.

Shards are committed atomically and their headers are deterministic (``mtime=None`` means 0,
owner 0, mode 0444), so equal samples give equal bytes; webdataset stamps the current time and
the user ``bigdata``. ``pipe:`` destinations need ``allow_pipe=True``.
"""

from __future__ import annotations

import contextlib
from typing import Callable

from ..errors import PipeNotAllowedError
from ..storage import open_url
from ..write import writer as _w

__all__ = ["ShardWriter", "TarWriter"]


def _encoder_fn(encoder):
    if encoder is None or encoder is False:
        return False, None
    if encoder is True:
        return True, None
    if callable(encoder):
        return False, encoder
    raise ValueError(f"encoder must be True, False or a function, not {encoder!r}")


class TarWriter(_w.TarWriter):
    """``TarWriter(fileobj, compress=None, encoder=True, mtime=None, ...)`` (webdataset's)."""

    def __init__(
        self,
        fileobj,
        user: str = "bigdata",
        group: str = "bigdata",
        mode: int = 0o444,
        compress=None,
        encoder=True,
        keep_meta: bool = False,
        mtime=None,
        format=None,
        *,
        allow_pipe: bool = False,
        storage_options=None,
    ):
        self._pipe = contextlib.ExitStack()
        dest = fileobj
        if isinstance(fileobj, str) and fileobj.startswith("pipe:"):
            if not allow_pipe:
                raise PipeNotAllowedError(
                    "pipe: destinations run shell commands and are off by default; pass "
                    "allow_pipe=True (TarWriter(..., allow_pipe=True)) if you mean it",
                    url=fileobj,
                )
            dest = self._pipe.enter_context(open_url(fileobj, "wb", allow_pipe=True))
            if compress is None and fileobj.rstrip().endswith((".tgz", ".tar.gz")):
                compress = "gz"
        use_registry, self._encode_fn = _encoder_fn(encoder)
        try:
            super().__init__(
                dest,
                encoder=use_registry,
                compress=compress,
                mtime=0 if mtime is None else int(mtime),
                storage_options=storage_options,
            )
        except BaseException:
            self._pipe.close()
            raise
        self.keep_meta = keep_meta

    def encode(self, sample: dict):
        if self._encode_fn is not None:
            sample = self._encode_fn(sample)
        return super().encode(sample)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._pipe.close()

    def abort(self) -> None:
        try:
            super().abort()
        finally:
            self._pipe.close()


class ShardWriter(_w.ShardWriter):
    """``ShardWriter(pattern, maxcount=100000, maxsize=3e9, post=None, start_shard=0,
    verbose=1, opener=None, **tarwriter_kw)`` (webdataset's)."""

    def __init__(
        self,
        pattern: str,
        maxcount: int = 100000,
        maxsize: float = 3e9,
        post: Callable | None = None,
        start_shard: int = 0,
        verbose: int = 1,
        opener: Callable | None = None,
        **kw,
    ):
        encoder = kw.pop("encoder", True)
        use_registry, self._encode_fn = _encoder_fn(encoder)
        super().__init__(
            pattern,
            maxcount,
            maxsize,
            start_shard=start_shard,
            verbose=verbose,
            post=post,
            encoder=use_registry,
            **kw,
        )
        self.opener = opener

    def _open_next(self) -> None:
        if self.opener is None:
            return super()._open_next()
        name = _w.shard_name(self.pattern, self.shard)
        self.shard += 1
        self._writer = _w.TarWriter(self.opener(name), **self.tarwriter_options)
        self._started = 0.0

    def write(self, sample: dict) -> int:
        if self._encode_fn is not None:
            sample = self._encode_fn(sample)
        return super().write(sample)

    def finish(self) -> None:
        """Commit the current shard (the next write starts a new one)."""
        self._finish_current()
