"""The torch adapter: the only part of tarshards that imports torch.

``adapter``    ``WebDataset``/``DataPipeline``/``IndexedDataset``/``MixedDataset`` as torch
               datasets, ``WebLoader``, rank discovery, the torch registry entries
``transport``  batches handed from DataLoader workers through shared memory (numpy only)

The adapter's names are this package's too (``from tarshards.torch import WebLoader``), imported
on first use: importing ``tarshards.torch.transport`` alone does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "DataPipeline",
    "IndexedDataset",
    "MixedDataset",
    "WebDataset",
    "WebLoader",
    "discover_rank",
    "image_to_tensor",
    "load_pth",
    "mix",
    "torch_environment",
]


def __getattr__(name: str) -> Any:
    if name.startswith("__") or name in ("adapter", "transport"):  # submodules: imported as such
        raise AttributeError(name)
    adapter = importlib.import_module("tarshards.torch.adapter")
    try:
        value = getattr(adapter, name)
    except AttributeError:
        raise AttributeError(f"module 'tarshards.torch' has no attribute {name!r}") from None
    globals()[name] = value
    return value
