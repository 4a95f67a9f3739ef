"""The PyTorch adapter: the only module of tarshards that imports torch.

``WebDataset`` and ``DataPipeline`` here are the pipeline classes made into
``torch.utils.data.IterableDataset`` subclasses that find their rank (torch.distributed) and
DataLoader worker by themselves. ``WebLoader`` is a ``DataLoader`` that advances the dataset's
epoch each time it is iterated, so shuffles change every epoch even with fresh worker processes.
"""

from __future__ import annotations

import inspect
import io

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, default_collate, default_convert
from torch.utils.data import get_worker_info

from . import pipeline as _pipeline
from .codecs import Codec, register_array_kind, register_codec
from .stages import register_collation
from .transport import Packer, Unpacker

__all__ = ["DataPipeline", "WebDataset", "WebLoader", "image_to_tensor", "torch_environment"]


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
    __len__ = _TorchMixin.__len__
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


class WebLoader(DataLoader):
    """A ``DataLoader`` that calls ``dataset.set_epoch(e)`` before each epoch (e = 0, 1, ...).

    With workers, batches of arrays and tensors travel through shared memory that each worker
    allocates once (:mod:`tarshards.transport`) instead of a new shared-memory segment per
    tensor: ``transport="shm"`` (the default, ``"auto"``) or ``None`` for DataLoader's own path.
    Anything else in a batch (keys, strings) travels as usual; batches without array data, or
    with very little, pass through unchanged.
    """

    def __init__(self, dataset, *args, start_epoch: int = 0, transport: str | None = "auto",
                 **kwargs):
        if transport not in ("auto", "shm", None):
            raise ValueError(f"transport is 'auto', 'shm' or None, not {transport!r}")
        bound = inspect.signature(DataLoader.__init__).bind(self, dataset, *args, **kwargs)
        options = bound.arguments
        options.update(options.pop("kwargs", {}) or {})
        packing = transport is not None and (options.get("num_workers") or 0) > 0
        if packing:
            inner = options.get("collate_fn")
            if inner is None:
                inner = default_convert if options.get("batch_size", 1) is None \
                    else default_collate
            prefetch = options.get("prefetch_factor") or 2
            packer = Packer(slots=prefetch + 2, to_array=_tensor_to_array)
            options["collate_fn"] = _PackingCollate(inner, packer)
        options.pop("self")
        super().__init__(**options)
        self.epoch = start_epoch
        self._packing = packing
        self._unpacker = None

    def __iter__(self):
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.epoch)
        self.epoch += 1
        it = super().__iter__()
        if not self._packing:
            return it
        if self._unpacker is None or not self.persistent_workers:
            if self._unpacker is not None:
                self._unpacker.close()  # the previous epoch's workers (and rings) are gone
            pinned = self.pin_memory and torch.cuda.is_available()
            self._unpacker = Unpacker(from_array=_array_to_tensor,
                                      alloc=_pinned_alloc if pinned else None)
        return _UnpackingIterator(it, self._unpacker)


class _PackingCollate:
    """Runs in each worker: the usual collation, then the batch into a shared-memory slot."""

    def __init__(self, inner, packer):
        self.inner = inner
        self.packer = packer

    def __call__(self, batch):
        return self.packer(self.inner(batch))


class _UnpackingIterator:
    """The DataLoader's iterator, with each batch copied out of its slot."""

    def __init__(self, it, unpacker):
        self._it = it
        self._unpack = unpacker

    def __iter__(self):
        return self

    def __next__(self):
        return self._unpack(next(self._it))

    def __len__(self):
        return len(self._it)

    def __getattr__(self, name):
        return getattr(self._it, name)


def _tensor_to_array(x):
    if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.requires_grad \
            or x.layout != torch.strided or x.is_quantized or x.is_conj() or x.is_neg():
        return None
    try:
        arr = x.numpy()
    except (TypeError, RuntimeError):  # dtypes numpy lacks (bfloat16...)
        return None
    return arr, "tensor"


def _array_to_tensor(arr, kind):
    return torch.from_numpy(arr)


def _pinned_alloc(shape, dtype, kind):
    t = torch.empty(shape, dtype=torch.from_numpy(np.empty(0, dtype=dtype)).dtype,
                    pin_memory=True)
    return (t if kind == "tensor" else t.numpy()), t.numpy()


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


# ---------------------------------------------------------------------------------------------
# the registry entries that need torch (declared by name in tarshards/__init__.py)
# ---------------------------------------------------------------------------------------------

register_array_kind("torch-uint8", lambda arr, size: image_to_tensor(arr, False, size=size),
                    resizes=True)
register_array_kind("torch-float", lambda arr, size: image_to_tensor(arr, True, size=size),
                    resizes=True)
register_codec(Codec(("pth",), lambda value, ext: save_pth(value),
                     lambda data, ext: load_pth(data), safe=False))
register_collation(torch.Tensor, stack)
