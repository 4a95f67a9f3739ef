"""The PyTorch adapter: the only module of tarshards that imports torch.

``WebDataset`` and ``DataPipeline`` here are the pipeline classes made into
``torch.utils.data.IterableDataset`` subclasses that find their rank (torch.distributed) and
DataLoader worker by themselves. ``WebLoader`` is a ``DataLoader`` that advances the dataset's
epoch each time it is iterated, so shuffles change every epoch even with fresh worker processes.
"""

from __future__ import annotations

import io

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from . import indexed as _indexed
from . import pipeline as _pipeline

__all__ = ["DataPipeline", "IndexedDataset", "WebDataset", "WebLoader", "image_to_tensor",
           "torch_environment"]


def torch_environment() -> dict:
    """Rank/world size from torch.distributed (when initialized) and the DataLoader worker."""
    env = {"rank": 0, "world_size": 1, "worker": 0, "num_workers": 1}
    if dist.is_available() and dist.is_initialized():
        env["rank"] = dist.get_rank()
        env["world_size"] = dist.get_world_size()
    info = get_worker_info()
    if info is not None:
        env["worker"] = info.id
        env["num_workers"] = info.num_workers
    return env


class _TorchMixin:
    """Shared overrides: torch discovery, and the pipeline's own item/len/iter behaviour."""

    def environment(self) -> dict:
        env = torch_environment()
        rank = getattr(self, "rank", None)
        world = getattr(self, "world_size", None)
        if rank is not None:
            env["rank"] = rank
        if world is not None:
            env["world_size"] = world
        return env

    def __iter__(self):
        return _pipeline.DataPipeline.__iter__(self)

    def __getitem__(self, index):
        return _pipeline.DataPipeline.__getitem__(self, index)

    def __len__(self):
        return _pipeline.DataPipeline.__len__(self)

    def __repr__(self):
        return _pipeline.DataPipeline.__repr__(self)


class WebDataset(IterableDataset, _TorchMixin, _pipeline.WebDataset):
    __doc__ = _pipeline.WebDataset.__doc__

    def __init__(self, *args, **kwargs):
        _pipeline.WebDataset.__init__(self, *args, **kwargs)

    environment = _TorchMixin.environment
    __iter__ = _TorchMixin.__iter__
    __getitem__ = _TorchMixin.__getitem__
    __len__ = _pipeline.WebDataset.__len__  # exact with a manifest
    __repr__ = _TorchMixin.__repr__


class DataPipeline(IterableDataset, _TorchMixin, _pipeline.DataPipeline):
    __doc__ = _pipeline.DataPipeline.__doc__

    def __init__(self, *args, **kwargs):
        _pipeline.DataPipeline.__init__(self, *args, **kwargs)

    environment = _TorchMixin.environment
    __iter__ = _TorchMixin.__iter__
    __getitem__ = _TorchMixin.__getitem__
    __len__ = _TorchMixin.__len__
    __repr__ = _TorchMixin.__repr__


class IndexedDataset(Dataset, _indexed.IndexedDataset):
    """:class:`tarshards.indexed.IndexedDataset` as a ``torch.utils.data.Dataset`` (map-style:
    works with ``DataLoader(shuffle=True, num_workers=N)`` and ``DistributedSampler``)."""

    def __init__(self, *args, **kwargs):
        _indexed.IndexedDataset.__init__(self, *args, **kwargs)

    __getitem__ = _indexed.IndexedDataset.__getitem__
    __len__ = _indexed.IndexedDataset.__len__
    __iter__ = _indexed.IndexedDataset.__iter__
    __repr__ = _indexed.IndexedDataset.__repr__


class WebLoader(DataLoader):
    """A ``DataLoader`` that calls ``dataset.set_epoch(e)`` before each epoch (e = 0, 1, ...)."""

    def __init__(self, dataset, *args, start_epoch: int = 0, **kwargs):
        super().__init__(dataset, *args, **kwargs)
        self.epoch = start_epoch

    def __iter__(self):
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.epoch)
        self.epoch += 1
        return super().__iter__()


def image_to_tensor(arr: np.ndarray, as_float: bool, size=None) -> torch.Tensor:
    """HxWxC (or HxW) uint8 array -> CxHxW (or HxW) tensor, float in [0, 1] when ``as_float``.

    ``size=(w, h)`` resizes when needed (bilinear, antialiased, on uint8: torch's fast path).
    """
    t = torch.from_numpy(np.ascontiguousarray(arr))
    if size is not None and (t.shape[1], t.shape[0]) != (size[0], size[1]):
        x = t.permute(2, 0, 1)[None] if t.ndim == 3 else t[None, None]
        x = torch.nn.functional.interpolate(x, size=(size[1], size[0]), mode="bilinear",
                                            align_corners=False, antialias=True)
        t = x[0].permute(1, 2, 0) if t.ndim == 3 else x[0, 0]
    if t.ndim == 3:
        t = t.permute(2, 0, 1).contiguous()
    if as_float:
        return t.to(torch.float32).div_(255.0)
    return t


def stack(tensors: list) -> torch.Tensor:
    """Collate a column of tensors."""
    return torch.stack(tensors)


def save_pth(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def load_pth(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)
