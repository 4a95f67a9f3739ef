"""webdataset's utilities: ``PipelineStage``, rank/worker discovery, ``repeatedly``, seeds.

Rank and worker come from :func:`tarshards.torch.discover_rank` (an initialized
``torch.distributed`` group, else a launcher's ``RANK``/``WORLD_SIZE``) and the DataLoader worker,
the one place tarshards discovers them; without torch every reader is rank 0 of 1, worker 0 of
1. Unlike webdataset, the ``WORKER``/``NUM_WORKERS`` environment variables are not read: pass
``rank=``/``world_size=`` where a stage takes them to override the discovered place.
"""

from __future__ import annotations

import hashlib
import importlib
import sys
from typing import Any, Callable, Iterable, Iterator

__all__ = [
    "PipelineStage",
    "identity",
    "make_seed",
    "pytorch_worker_info",
    "pytorch_worker_seed",
    "repeatedly",
    "repeatedly0",
]


class PipelineStage:
    """Base class of webdataset-style stages: subclasses define ``run(self, src)``.

    A ``PipelineStage`` placed in a :class:`~tarshards.compat.DataPipeline` is called as
    ``stage.run(upstream)`` (or ``stage.run()`` when it is the source).
    """

    def run(self, *args, **kwargs):
        return self.invoke(*args, **kwargs)

    def invoke(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} must define run(self, src)")


def identity(x: Any) -> Any:
    return x


def _torch_adapter():
    try:
        return importlib.import_module("tarshards.torch.adapter")
    except ImportError:
        return None


def _as_tuple(env) -> tuple[int, int, int, int]:
    if isinstance(env, dict):
        return env["rank"], env["world_size"], env["worker"], env["num_workers"]
    return env.rank, env.world_size, env.worker, env.num_workers


def pytorch_worker_info(group=None) -> tuple[int, int, int, int]:
    """``(rank, world_size, worker, num_workers)`` of the calling reader.

    ``group``: a torch.distributed process group whose rank and size to report instead of the
    default group's.
    """
    adapter = _torch_adapter()
    if adapter is None:
        return 0, 1, 0, 1
    rank, world, worker, nworkers = _as_tuple(adapter.torch_environment())
    if group is not None:
        dist = importlib.import_module("torch.distributed")
        rank, world = dist.get_rank(group=group), dist.get_world_size(group=group)
    return rank, world, worker, nworkers


def pytorch_worker_seed(group=None) -> int:
    """A number distinct for each (rank, worker): ``rank * 1000 + worker`` as in webdataset."""
    rank, _, worker, _ = pytorch_worker_info(group=group)
    return rank * 1000 + worker


def make_seed(*args) -> int:
    """A 31-bit seed from any values, stable across processes (webdataset's used ``hash``, which
    Python randomises per process for strings)."""
    text = "/".join(repr(a) for a in args).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:4], "big") & 0x7FFFFFFF


def _batch_size(batch) -> int:
    return len(batch[0])


def repeatedly(
    source: Iterable,
    nepochs: int | None = None,
    nbatches: int | None = None,
    nsamples: int | None = None,
    batchsize: Callable[[Any], int] = _batch_size,
) -> Iterator:
    """Iterate over ``source`` again and again: ``nepochs`` passes, or until ``nbatches`` items or
    ``nsamples`` samples (``batchsize(batch)`` each) have been yielded. An empty pass ends it."""
    epoch = count = total = 0
    while True:
        empty = True
        for item in source:
            empty = False
            yield item
            count += 1
            if nbatches is not None and count >= nbatches:
                return
            if nsamples is not None:
                total += batchsize(item)
                if total >= nsamples:
                    return
        epoch += 1
        if empty or (nepochs is not None and epoch >= nepochs):
            return


def repeatedly0(loader: Iterable, nepochs: int = sys.maxsize, nbatches: int = sys.maxsize):
    """``nepochs`` passes over ``loader``, at most ``nbatches`` items each."""
    import itertools

    for _ in range(nepochs):
        yield from itertools.islice(loader, nbatches)
