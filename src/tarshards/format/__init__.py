"""The format: what a shard holds and the records that describe a data set.

``names``        key/extension rules, grouping members into samples, sizes
``compression``  the one table of compressions (by suffix and by magic bytes)
``hashing``      content hashes (xxh3-128, sha256) and the data fingerprint
``tenbin``       the tensor binary format (``.ten`` members)
``index``        per-shard indexes (byte offsets of every sample) and their files
``manifest``     the one record of a data set: shards, counts, sizes, hashes, metadata columns
``selection``    views: a manifest and the rows kept in each shard

The tar layer itself (headers, the streaming reader, the member writer) is :mod:`tarshards.tario`.
"""

# The names of the module that ``tarshards.format`` was before the packages (``format.py``, now
# ``format/names.py``) stay attributes of the package, imported on first use:
# ``from tarshards.format import X`` still works for them. Submodules are imported as such.

from __future__ import annotations

from .._lazy import names_of

__getattr__ = names_of(
    "tarshards.format",
    "tarshards.format.names",
    ["compression", "hashing", "index", "manifest", "names", "selection", "tenbin"],
)
