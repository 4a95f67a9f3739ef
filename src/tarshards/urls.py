"""The names ``tarshards.urls`` held before :mod:`tarshards.storage` and :mod:`tarshards.specs`
took them over, kept for code written against the old import path (nothing in tarshards imports
this module; new code imports from ``tarshards``, ``tarshards.storage`` or ``tarshards.specs``).
"""

from __future__ import annotations

from .specs import expand_urls
from .storage import (
    AtomicOutput,
    ResumingReader,
    filesystem,
    is_local,
    local_path,
    open_url,
    remove_stale_temporaries,
    temporary_directory,
    url_protocol,
)

__all__ = [
    "AtomicOutput",
    "ResumingReader",
    "expand_urls",
    "is_local",
    "local_path",
    "open_url",
    "remove_stale_temporaries",
    "temporary_directory",
    "url_protocol",
]


def _fsspec_resolve(url: str, storage_options=None):
    """The old ``(fs, path, fsspec)`` form of :func:`tarshards.storage.filesystem`."""
    import fsspec

    return (*filesystem(url, storage_options), fsspec)
