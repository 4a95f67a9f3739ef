"""Small frozen values passed between the layers of tarshards.

These sit at the bottom of the import order (beside :mod:`tarshards.errors`): every other module
may use them, and they import nothing of tarshards. Rank and worker are discovered once, at the
top (:mod:`tarshards.torch`), and travel down as a :class:`WorkerInfo` value; nothing deeper reads
``torch.distributed`` or environment variables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, runtime_checkable

__all__ = ["EpochContext", "ReadOptions", "ShardSlice", "Stateful", "WorkerInfo"]


@dataclass(frozen=True)
class WorkerInfo:
    """Where one reader runs: rank ``rank`` of ``world_size``, DataLoader worker ``worker`` of
    ``num_workers`` (worker 0 of 1 in the main process)."""

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1

    def __post_init__(self):
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"bad rank/world_size: {self.rank}/{self.world_size}")
        if self.num_workers < 1 or not 0 <= self.worker < self.num_workers:
            raise ValueError(f"bad worker/num_workers: {self.worker}/{self.num_workers}")

    @property
    def reader(self) -> int:
        """This reader's number among all ``world_size * num_workers`` readers."""
        return self.rank * self.num_workers + self.worker

    @property
    def num_readers(self) -> int:
        return self.world_size * self.num_workers

    def replace(self, **changes) -> "WorkerInfo":
        values = {
            "rank": self.rank,
            "world_size": self.world_size,
            "worker": self.worker,
            "num_workers": self.num_workers,
        }
        values.update(changes)
        return WorkerInfo(**values)


@dataclass(frozen=True)
class EpochContext:
    """What one iteration of a pipeline runs under: the seed, the epoch and the reader."""

    seed: int = 0
    epoch: int = 0
    worker: WorkerInfo = field(default_factory=WorkerInfo)


@dataclass(frozen=True)
class ShardSlice:
    """A shard, or the samples ``start <= i < stop`` of it (``stop=None``: to its end)."""

    url: str
    start: int = 0
    stop: int | None = None

    def __post_init__(self):
        if self.start < 0 or (self.stop is not None and self.stop < self.start):
            raise ValueError(f"bad slice {self.start}:{self.stop} of {self.url}")


@dataclass(frozen=True)
class ReadOptions:
    """How shards are opened and parsed (one value instead of loose keyword arguments)."""

    storage_options: Mapping[str, Any] | None = None
    allow_pipe: bool = False
    last_dot: bool = False
    retries: int = 5
    chunk_size: int = 1 << 20


@runtime_checkable
class Stateful(Protocol):
    """Anything whose position can be saved and restored (torchdata's protocol)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...
