"""Curating a data set without copying its media (DESIGN.md part 2: views, dedup, sidecar columns,
joins, the key table, splits, dataset spec files).

* :class:`KeyIndex`, the key table (key -> shard and row for a whole data set, a memory-mapped
  sorted array of key hashes), the foundation of joins;
* :func:`add_meta`, per-sample metadata columns (tokens, sizes, durations) added to an existing
  data set's indexes;
* views (:class:`View`, :func:`view`, :func:`dedup`, :func:`split`): selections of a data set's
  samples, stored beside its manifest, read wherever a manifest is;
* :func:`add_columns`, sidecar column groups (new fields in shards of their own, aligned row by
  row with the base); :func:`join`, two data sets of different shard layouts joined by key.
"""

from __future__ import annotations

from .columns import add_columns
from .join import join
from .keyindex import DUPLICATE_POLICIES, KeyIndex
from .meta import add_meta
from .views import View, dedup, split, view

__all__ = [
    "DUPLICATE_POLICIES",
    "KeyIndex",
    "View",
    "add_columns",
    "add_meta",
    "dedup",
    "join",
    "split",
    "view",
]
