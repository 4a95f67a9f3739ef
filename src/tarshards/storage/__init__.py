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

from .atomic import AtomicOutput, remove_stale_temporaries, temporary_directory
from .cache import ShardCache
from .open import open_url
from .paths import filesystem, is_local, local_path, url_protocol
from .prefetch import ShardPrefetcher
from .retry import ResumingReader
from .seek import read_sample_at, samples_from

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
