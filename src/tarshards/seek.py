"""The old import path of :mod:`tarshards.storage.seek` (kept for code written against it;
nothing in tarshards imports this module)."""

from __future__ import annotations

from .storage.seek import read_exact, read_sample_at, sample_from_bytes, samples_from

__all__ = ["read_exact", "read_sample_at", "sample_from_bytes", "samples_from"]
