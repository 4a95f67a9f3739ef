"""Where shards are read from and written to: opening URLs, resuming reads, atomic output, the
shard cache, prefetching, and reading samples at byte offsets.

=================  ===========================================================================
``paths``          what a URL names: protocol, local path, the fsspec file system serving it
``open``           :func:`open_url`, the one entry that opens a URL (at ``offset=``, for
                   ``length=`` bytes), and shell-command streams (``pipe:``)
``retry``          :class:`ResumingReader`: the one retry ladder (reconnect at the offset reached)
``http``, ``s3``   the streams under it: one streaming GET, one streaming ``GetObject``
``atomic``         :class:`AtomicOutput` and its temporary files
``cache``          :class:`ShardCache`: whole remote shards on local disk, shared by processes
``prefetch``       :class:`ShardPrefetcher`: the next shards read while one is parsed
``seek``           :func:`read_sample_at`, :func:`samples_from`: samples at a byte offset
=================  ===========================================================================
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names as the type checker sees them; at run time, __getattr__ below
    from .atomic import AtomicOutput, remove_stale_temporaries, temporary_directory
    from .cache import ShardCache
    from .open import open_url
    from .paths import filesystem, is_local, local_path, url_protocol
    from .prefetch import ShardPrefetcher
    from .retry import ResumingReader
    from .seek import read_sample_at, samples_from

# name -> the submodule that defines it: imported on first use (PEP 562), so that a tool which
# writes one file does not load the cache, the prefetcher, the HTTP and S3 streams and the tar
# reader at start-up
_NAMES = {
    "AtomicOutput": "atomic",
    "remove_stale_temporaries": "atomic",
    "temporary_directory": "atomic",
    "ShardCache": "cache",
    "open_url": "open",
    "filesystem": "paths",
    "is_local": "paths",
    "local_path": "paths",
    "url_protocol": "paths",
    "ShardPrefetcher": "prefetch",
    "ResumingReader": "retry",
    "read_sample_at": "seek",
    "samples_from": "seek",
}

__all__ = [
    "AtomicOutput",
    "ResumingReader",
    "ShardCache",
    "ShardPrefetcher",
    "filesystem",
    "is_local",
    "local_path",
    "open_url",
    "read_sample_at",
    "remove_stale_temporaries",
    "samples_from",
    "temporary_directory",
    "url_protocol",
]


def __getattr__(name: str):
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'tarshards.storage' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
