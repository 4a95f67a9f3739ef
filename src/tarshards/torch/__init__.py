"""The torch adapter: the only part of tarshards that imports torch.

``adapter``    ``WebDataset``/``DataPipeline``/``IndexedDataset``/``MixedDataset`` as torch
               datasets, ``WebLoader``, rank discovery, the torch registry entries
``transport``  batches handed from DataLoader workers through shared memory (numpy only)

The adapter's names are this package's too (``from tarshards.torch import WebLoader``), imported
on first use: importing ``tarshards.torch.transport`` alone does not import torch.
"""

from __future__ import annotations

from .._lazy import names_of

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


__getattr__ = names_of("tarshards.torch", "tarshards.torch.adapter", ["adapter", "transport"])
