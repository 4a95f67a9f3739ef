"""Shard specs and opening URLs.

A *spec* names a list of shards: a string with brace ranges (``train-{0000..0147}.tgz``), several
specs joined with ``::``, a glob over local or fsspec paths, a list of any of those, or a text file
listing one URL per line (``@shards.txt`` or a path ending in ``.txt``/``.shards``).

Opening goes through fsspec, so every protocol whose package is installed works (``file:``,
``http(s)://``, ``s3://``, ``gs://``...), ``-`` is stdin/stdout, and ``pipe:CMD`` runs a shell
command, but only when the caller allows it explicitly.
"""

from __future__ import annotations

import contextlib
import glob as _glob
import os
import subprocess
import sys
import tempfile
import uuid
from typing import BinaryIO, Iterable, Iterator

import braceexpand

from .errors import MissingDependencyError, PipeNotAllowedError, StorageError

__all__ = [
    "AtomicOutput",
    "expand_urls",
    "is_local",
    "local_path",
    "open_url",
    "url_protocol",
]

_INSTALL_HINTS = {
    "s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "http": "http", "https": "http",
}
_LIST_SUFFIXES = (".txt", ".shards", ".list")


def url_protocol(url: str) -> str | None:
    """The protocol of a URL (``"s3"``), ``None`` for local paths, ``"pipe"``, or ``"-"``."""
    if url == "-":
        return "-"
    if url.startswith("pipe:"):
        return "pipe"
    head, sep, _ = url.partition("://")
    if sep and head.isidentifier():
        return head.lower() if head.lower() != "file" else None
    if url.startswith("file:"):
        return None
    return None


def is_local(url: str) -> bool:
    return url_protocol(url) is None


def local_path(url: str) -> str:
    """Filesystem path of a local URL (``file:`` prefixes removed)."""
    if url.startswith("file://"):
        return url[7:]
    if url.startswith("file:"):
        return url[5:]
    return url


def _has_glob(s: str) -> bool:
    return any(c in s for c in "*?[")


def expand_urls(spec, *, storage_options: dict | None = None) -> list[str]:
    """Expand a shard spec into the list of URLs it names (order kept, no sorting of lists)."""
    if spec is None:
        raise ValueError("no shards given (urls=None)")
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if isinstance(spec, str):
        out = []
        for part in spec.split("::"):
            part = part.strip()
            if not part:
                continue
            out.extend(_expand_one(part, storage_options))
        return out
    if isinstance(spec, Iterable):
        out = []
        for item in spec:
            out.extend(expand_urls(item, storage_options=storage_options))
        return out
    raise TypeError(f"a shard spec is a string, a path or a list of them, not "
                    f"{type(spec).__name__}")


def _expand_one(part: str, storage_options) -> list[str]:
    if part == "-" or part.startswith("pipe:"):
        return [part]
    if part.startswith("@"):
        return _read_list(part[1:], storage_options)
    if part.lower().endswith(_LIST_SUFFIXES) and is_local(part) and os.path.isfile(
            local_path(part)):
        return _read_list(part, storage_options)
    urls = list(braceexpand.braceexpand(part))
    out = []
    for url in urls:
        if _has_glob(url):
            out.extend(_glob_url(url, storage_options))
        else:
            out.append(url)
    return out


def _read_list(path: str, storage_options) -> list[str]:
    with open_url(path, storage_options=storage_options) as f:
        text = f.read().decode("utf-8")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out.extend(_expand_one(line, storage_options))
    return out


def _glob_url(url: str, storage_options) -> list[str]:
    if is_local(url):
        found = sorted(_glob.glob(local_path(url)))
    else:
        fs, _, _ = _fsspec_resolve(url, storage_options)
        protocol = url_protocol(url)
        found = sorted(f"{protocol}://{p}" if "://" not in p else p for p in fs.glob(url))
    if not found:
        raise FileNotFoundError(f"no shard matches the pattern {url!r}")
    return found


def _fsspec_resolve(url: str, storage_options):
    try:
        import fsspec
    except ImportError:  # pragma: no cover - core dependency
        raise MissingDependencyError("fsspec is required: pip install fsspec") from None
    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {})) + (fsspec,)
    except ImportError as exc:
        proto = url_protocol(url) or "file"
        extra = _INSTALL_HINTS.get(proto)
        hint = f"pip install 'tarshards[{extra}]'" if extra else str(exc)
        raise MissingDependencyError(
            f"reading {proto}:// URLs needs an extra package: {hint}", url=url) from None
    except ValueError as exc:  # unknown protocol
        raise StorageError(f"cannot open {url!r}: {exc}", url=url) from None


class _PipeStream:
    """The stdout of a shell command; closing it checks the exit status."""

    def __init__(self, cmd: str, mode: str):
        self.cmd = cmd
        if "r" in mode:
            self.proc = subprocess.Popen(cmd, shell=True, stdout=subprocess.PIPE,
                                         bufsize=1 << 20)
            self.stream = self.proc.stdout
        else:
            self.proc = subprocess.Popen(cmd, shell=True, stdin=subprocess.PIPE, bufsize=1 << 20)
            self.stream = self.proc.stdin

    def read(self, n=-1):
        return self.stream.read(n)

    def write(self, data):
        return self.stream.write(data)

    def flush(self):
        self.stream.flush()

    def close(self):
        self.stream.close()
        rc = self.proc.wait()
        if rc not in (0, -13, 141):  # SIGPIPE when we stop reading early is fine
            raise StorageError(f"pipe command exited with status {rc}: {self.cmd}",
                               url=f"pipe:{self.cmd}")


@contextlib.contextmanager
def open_url(url: str, mode: str = "rb", *, storage_options: dict | None = None,
             allow_pipe: bool = False, block_size: int = 1 << 20) -> Iterator[BinaryIO]:
    """Open a URL as a binary stream (a context manager).

    ``-`` is stdin (or stdout for writing) and is not closed. ``pipe:CMD`` needs
    ``allow_pipe=True``. Other URLs go through fsspec with ``storage_options``.
    """
    if not isinstance(url, str):
        url = os.fspath(url)
    if url == "-":
        yield (sys.stdin.buffer if "r" in mode else sys.stdout.buffer)
        return
    if url.startswith("pipe:"):
        if not allow_pipe:
            raise PipeNotAllowedError(
                "pipe: URLs run shell commands and are off by default; pass allow_pipe=True "
                "(WebDataset(..., allow_pipe=True)) if you trust the shard list", url=url)
        p = _PipeStream(url[5:], mode)
        try:
            yield p
        finally:
            p.close()
        return
    if is_local(url):
        path = local_path(url)
        try:
            f = open(path, mode, buffering=0 if "r" in mode else -1)
        except FileNotFoundError:
            raise StorageError("no such shard file", url=url) from None
        except IsADirectoryError:
            raise StorageError("is a directory, not a shard", url=url) from None
        except PermissionError:
            raise StorageError("permission denied", url=url) from None
        with f:
            yield f
        return
    fs, path, _ = _fsspec_resolve(url, storage_options)
    try:
        f = fs.open(path, mode, block_size=block_size)
    except FileNotFoundError:
        raise StorageError("no such shard", url=url) from None
    except OSError as exc:
        raise StorageError(f"cannot open: {exc}", url=url) from exc
    with f:
        yield f


class AtomicOutput:
    """A destination that appears under its final name only when complete.

    Local paths are written to a temporary name in the same directory and renamed on
    :meth:`commit`; remote URLs are written to a local temporary file and uploaded through fsspec
    on commit; ``-`` writes to stdout; a file object is written to directly. :meth:`abort` (or an
    exception in the ``with`` block) removes the temporary file.
    """

    def __init__(self, dest, *, storage_options: dict | None = None):
        self.dest = dest
        self.storage_options = storage_options
        self._tmp = None
        self._owned = False
        self.done = False
        if hasattr(dest, "write"):
            self.stream = dest
            self.name = getattr(dest, "name", "<stream>")
            return
        dest = os.fspath(dest)
        self.name = dest
        if dest == "-":
            self.stream = sys.stdout.buffer
        elif is_local(dest):
            path = local_path(dest)
            d = os.path.dirname(os.path.abspath(path))
            os.makedirs(d, exist_ok=True)
            self._tmp = os.path.join(d, f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp")
            self.stream = open(self._tmp, "wb")
            self._owned = True
        else:
            fd, self._tmp = tempfile.mkstemp(prefix="tarshards-upload-", suffix=".tmp")
            self.stream = os.fdopen(fd, "wb")
            self._owned = True

    def commit(self) -> None:
        if self.done:
            return
        self.done = True
        if not self._owned:
            self.stream.flush()
            return
        self.stream.close()
        if is_local(self.name):
            os.replace(self._tmp, local_path(self.name))
            self._tmp = None
            return
        fs, path, _ = _fsspec_resolve(self.name, self.storage_options)
        try:
            fs.put_file(self._tmp, path)
        except Exception as exc:
            raise StorageError(f"upload failed: {exc}", url=self.name) from exc
        finally:
            with contextlib.suppress(OSError):
                os.unlink(self._tmp)
            self._tmp = None

    def abort(self) -> None:
        if self.done:
            return
        self.done = True
        if self._owned:
            with contextlib.suppress(OSError):
                self.stream.close()
            if self._tmp:
                with contextlib.suppress(OSError):
                    os.unlink(self._tmp)
                self._tmp = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.commit()
        else:
            self.abort()
        return False


def copy_stream(src: BinaryIO, dst: BinaryIO, bufsize: int = 1 << 20) -> int:
    """Copy a stream; returns bytes copied."""
    n = 0
    while True:
        b = src.read(bufsize)
        if not b:
            return n
        dst.write(b)
        n += len(b)

