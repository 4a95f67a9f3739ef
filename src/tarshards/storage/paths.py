"""What a URL names: its protocol, whether it is a local path, and the fsspec file system that
serves it (with an install hint when that file system's package is missing)."""

from __future__ import annotations

from typing import Any

from ..errors import MissingDependencyError, StorageError

__all__ = ["filesystem", "is_local", "local_path", "url_protocol"]

# protocol -> the tarshards extra that installs its fsspec back-end
_INSTALL_HINTS = {
    "s3": "s3",
    "s3a": "s3",
    "gs": "gcs",
    "gcs": "gcs",
    "http": "http",
    "https": "http",
}


def url_protocol(url: str) -> str | None:
    """The protocol of a URL (``"s3"``), ``None`` for local paths, ``"pipe"``, or ``"-"``."""
    if url == "-":
        return "-"
    if url.startswith("pipe:"):
        return "pipe"
    head, sep, _ = url.partition("://")
    if sep and head.isidentifier():
        return head.lower() if head.lower() != "file" else None
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


def filesystem(url: str, storage_options: dict | None = None) -> tuple[Any, str]:
    """``(fsspec file system, path in it)`` for ``url``.

    A protocol whose package is missing raises :class:`MissingDependencyError` naming the
    tarshards extra to install; an unknown protocol raises :class:`StorageError`."""
    try:
        import fsspec
    except ImportError:  # pragma: no cover - core dependency
        raise MissingDependencyError("fsspec is required: pip install fsspec") from None
    try:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as exc:
        proto = url_protocol(url) or "file"
        extra = _INSTALL_HINTS.get(proto)
        hint = f"pip install 'tarshards[{extra}]'" if extra else str(exc)
        raise MissingDependencyError(
            f"reading {proto}:// URLs needs an extra package: {hint}", url=url
        ) from None
    except ValueError as exc:  # unknown protocol
        raise StorageError(f"cannot open {url!r}: {exc}", url=url) from None
    return fs, path
