"""The old import path of :class:`tarshards.storage.cache.ShardCache` (kept for code written
against it; nothing in tarshards imports this module)."""

from __future__ import annotations

from .storage.cache import ShardCache, cache_name, looks_like_shard

__all__ = ["ShardCache", "cache_name", "looks_like_shard"]
