"""Which shards a reader reads, in which order.

All randomness derives from ``(seed, epoch, rank, worker)`` through :func:`make_rng`, so the same
seed always gives the same order and every epoch gets a new one. The shard list is shuffled with
(seed, epoch) only, identically on every rank and worker, and *then* split: first by node (rank),
then by DataLoader worker. The pieces are disjoint and together cover the list, so every shard is
read exactly once per epoch.
"""

from __future__ import annotations

import hashlib
import random
import warnings
from typing import Iterator, Sequence, TypeVar

from ..errors import TarshardsWarning

__all__ = [
    "make_rng",
    "resampled_shards",
    "shard_order",
    "split_by_node",
    "split_by_worker",
    "split_shards",
]


def make_rng(*parts) -> random.Random:
    """A ``random.Random`` seeded from any tuple of ints/strings (stable across runs)."""
    text = "/".join(str(p) for p in parts).encode()
    return random.Random(int.from_bytes(hashlib.sha256(text).digest()[:8], "big"))


_T = TypeVar("_T")


def shard_order(
    urls: Sequence[_T], *, seed: int = 0, epoch: int = 0, shuffle: bool = True
) -> list[_T]:
    """The epoch's shard order: a permutation from (seed, epoch), or the list as it is."""
    urls = list(urls)
    if shuffle:
        make_rng("shards", seed, epoch).shuffle(urls)
    return urls


def split_by_node(
    urls: Sequence[str], rank: int | None = None, world_size: int | None = None
) -> list[str]:
    """The shards of one node: every ``world_size``-th shard starting at ``rank``.

    This module knows nothing of torch: left out, rank and world size are those of a single
    process (rank 0 of 1). Given as ``WebDataset(..., nodesplitter=split_by_node)`` (webdataset's
    style) or used as a pipeline stage, it receives the rank and world size the pipeline was
    given by the torch adapter, which discovered them in the process that owns the process group.
    """
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"bad rank/world_size: {rank}/{world_size}")
    return list(urls)[rank::world_size]


def split_by_worker(
    urls: Sequence[str], worker: int | None = None, num_workers: int | None = None
) -> list[str]:
    """The shards of one DataLoader worker (same rule as :func:`split_by_node`). Left out, the
    worker is 0 of 1; as ``workersplitter=`` or a pipeline stage, the pipeline passes its own."""
    worker = 0 if worker is None else worker
    num_workers = 1 if num_workers is None else num_workers
    if num_workers < 1 or not 0 <= worker < num_workers:
        raise ValueError(f"bad worker/num_workers: {worker}/{num_workers}")
    return list(urls)[worker::num_workers]


def split_shards(
    urls: Sequence[str],
    *,
    rank: int = 0,
    world_size: int = 1,
    worker: int = 0,
    num_workers: int = 1,
    warn: bool = True,
) -> list[str]:
    """Split by node, then by worker; warns when some readers get no shard at all."""
    mine = split_by_worker(split_by_node(urls, rank, world_size), worker, num_workers)
    readers = world_size * num_workers
    if warn and len(urls) < readers and worker == 0 and rank == 0:
        warnings.warn(
            f"{len(urls)} shards for {readers} readers ({world_size} ranks x {num_workers} "
            f"workers): {readers - len(urls)} readers get no data. Use more shards, fewer "
            "workers, or resampled=True",
            TarshardsWarning,
            stacklevel=2,
        )
    return mine


def resampled_shards(
    urls: Sequence[str], *, seed: int = 0, epoch: int = 0, rank: int = 0, worker: int = 0
) -> Iterator[str]:
    """Draw shards with replacement, forever, from a stream seeded by all four parts."""
    if not urls:
        return
    rng = make_rng("resample", seed, epoch, rank, worker)
    urls = list(urls)
    while True:
        yield urls[rng.randrange(len(urls))]
