"""Joins (placeholder, filled in below)."""

from __future__ import annotations

__all__ = ["join"]


def join(*args, **kwargs):
    raise NotImplementedError
