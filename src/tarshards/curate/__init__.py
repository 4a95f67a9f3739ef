"""Curating a data set without copying its media (DESIGN.md part 2: views, dedup, sidecar columns,
joins, the key table, splits, dataset spec files).

So far: :class:`KeyIndex`, the key table (key -> shard and row for a whole data set, a
memory-mapped sorted array of key hashes), the foundation of joins.
"""

from __future__ import annotations

from .keyindex import DUPLICATE_POLICIES, KeyIndex

__all__ = ["DUPLICATE_POLICIES", "KeyIndex"]
