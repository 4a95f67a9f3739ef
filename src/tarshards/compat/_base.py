"""The base classes compat builds on: torch's when torch is installed, plain ones otherwise.

Importing :mod:`tarshards.compat` imports torch (through :mod:`tarshards.torch`, the one module
that does) when it is installed, as ``import webdataset`` does: its datasets must be
``torch.utils.data.IterableDataset`` instances for ``DataLoader`` to treat them as streams.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ..pipeline import dataset as _pipeline

_adapter: ModuleType | None
try:
    _adapter = importlib.import_module("tarshards.torch.adapter")
except ImportError as exc:  # no torch: plain iterables
    if getattr(exc, "name", None) not in ("torch", None):
        raise
    _adapter = None

if _adapter is not None:
    IterableDataset = _adapter.IterableDataset
    TSDataPipeline = _adapter.DataPipeline
    TSWebDataset = _adapter.WebDataset
    TSWebLoader = _adapter.WebLoader
    DataLoader = _adapter.DataLoader
else:

    class IterableDataset:  # type: ignore[no-redef]
        """Stand-in for torch's IterableDataset when torch is not installed."""

    TSDataPipeline = _pipeline.DataPipeline
    TSWebDataset = _pipeline.WebDataset
    TSWebLoader = None
    DataLoader = None

HAVE_TORCH = _adapter is not None
