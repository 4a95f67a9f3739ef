"""Curating a data set without copying its media (DESIGN.md part 2: views, dedup, sidecar columns,
joins, the key table, splits, dataset spec files).

So far: :class:`KeyIndex`, the key table (key -> shard and row for a whole data set, a
memory-mapped sorted array of key hashes), the foundation of joins; and :func:`add_meta`,
per-sample metadata columns (tokens, sizes, durations) added to an existing data set's indexes;
:func:`add_columns`, sidecar column groups (new fields in shards of their own, aligned row by
row with the base); :func:`join`, two data sets of different shard layouts joined by key.
"""

from __future__ import annotations

from .columns import add_columns
from .join import join
from .keyindex import DUPLICATE_POLICIES, KeyIndex
from .meta import add_meta

__all__ = ["DUPLICATE_POLICIES", "KeyIndex", "add_columns", "add_meta", "join"]
