"""The torch adapter: the only part of tarshards that imports torch.

``adapter``    ``WebDataset``/``DataPipeline``/``IndexedDataset``/``MixedDataset`` as torch
               datasets, ``WebLoader``, rank discovery, the torch registry entries
``transport``  batches handed from DataLoader workers through shared memory

Importing this package imports torch and registers the torch entries of the registries.
"""

from .adapter import *  # noqa: F403
from .adapter import __all__ as __all__
from .adapter import load_pth as load_pth
