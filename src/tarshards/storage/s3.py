"""One streaming ``GetObject`` of an S3 object from a byte offset on (the stream under a
:class:`~tarshards.storage.retry.ResumingReader` for ``s3://`` URLs read through s3fs)."""

from __future__ import annotations

import contextlib
from typing import Any

from .retry import read_to_end

__all__ = ["S3Stream"]


class S3Stream:
    """One streaming ``GetObject`` of an S3 object from byte ``offset`` on (s3fs's client).

    s3fs's own file object reads an object as ranges of ``block_size`` bytes, each a request of
    its own; for a sequential read of a whole shard one request is enough, and each request
    saved is one first-byte latency saved. ``stop`` asks for the bytes before it only. ``size``
    is the object's size. ``timeout``: seconds a request or a read may go without an answer
    before it fails (a ``TimeoutError``, which the resuming reader retries; ``None``: wait).
    """

    def __init__(self, fs, path: str, offset: int = 0, *, stop: int | None = None, timeout=None):
        from fsspec.asyn import sync

        self._sync = sync
        self._timeout = timeout
        self._loop = fs.loop
        bucket, key, version = fs.split_path(path)
        kwargs = {"Bucket": bucket, "Key": key}
        if version:
            kwargs["VersionId"] = version
        if offset or stop is not None:
            kwargs["Range"] = f"bytes={offset}-{'' if stop is None else max(stop - 1, offset)}"
        resp = sync(fs.loop, fs._call_s3, "get_object", timeout=timeout, **kwargs)
        self._body: Any = resp["Body"]
        total = str(resp.get("ContentRange") or "").rpartition("/")[2]
        if total.isdigit():
            self.size: int | None = int(total)
        elif resp.get("ContentLength") is not None and stop is None:
            self.size = offset + int(resp["ContentLength"])
        else:
            self.size = None

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            return read_to_end(self.read)
        if self._body is None:
            return b""
        return self._sync(self._loop, self._body.read, n, timeout=self._timeout)

    def close(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            with contextlib.suppress(Exception):
                body.close()
