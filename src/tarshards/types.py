"""Small frozen values passed between the layers of tarshards.

These sit at the bottom of the import order (beside :mod:`tarshards.errors`): every other module
may use them, and they import nothing of tarshards. Rank and worker are discovered once, at the
top (:mod:`tarshards.torch`), and travel down as a :class:`WorkerInfo` value; nothing deeper reads
``torch.distributed`` or environment variables.
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

__all__ = [
    "EpochContext",
    "LoaderLink",
    "PlanOptions",
    "ReadOptions",
    "SafetyOptions",
    "Stateful",
    "WorkerInfo",
]


@dataclass(frozen=True)
class LoaderLink:
    """What a loader (``tarshards.WebLoader``, its DataLoader workers) tells the pipeline it
    runs: given with :meth:`tarshards.pipeline.composition.DataPipeline.attach_loader`, read by the
    pipeline's iteration. A pipeline no loader runs has the empty link.

    ``allocate``: the worker's transport, the memory its batches are stacked into; ``group``:
    ``(shared cell, worker id)``, how many batches the worker hands on together; ``monitor``:
    the loader's counters (:class:`tarshards.stats.Counters`); ``managed``: the loader moves
    the epoch (no warning of a repeated order); ``warns``: the loader warns of the samples a
    plan leaves out (the workers do not). Only ``managed`` and ``warns`` travel to the
    workers; the rest belongs to one process."""

    allocate: Callable | None = None
    group: tuple | None = None
    monitor: Any = None
    managed: bool = False
    warns: bool = False

    def for_worker(self) -> "LoaderLink":
        """What a copy of the pipeline in another process keeps of this link."""
        return LoaderLink(managed=self.managed, warns=self.warns)


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
    """What one iteration of a pipeline runs under: the seed, the epoch and the reader (which
    shards a reader reads in an epoch is a function of this value alone)."""

    seed: int = 0
    epoch: int = 0
    worker: WorkerInfo = field(default_factory=WorkerInfo)


def _check_int(obj: Any, name: str, least: int, none: bool = False) -> None:
    """``obj.name`` as an ``int`` (numpy integers too) of at least ``least``, or ``None``."""
    owner, value = type(obj).__name__, getattr(obj, name)
    if value is None and none:
        return
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{owner}.{name} must be an int, not {type(value).__name__}") from None
    if number < least:
        raise ValueError(f"{owner}.{name} must be >= {least}, not {value!r}")
    object.__setattr__(obj, name, number)


def _check_flag(obj: Any, name: str, none: bool = False) -> None:
    """``obj.name`` as a ``bool`` (``0``/``1`` and numpy booleans too), or ``None``."""
    value = getattr(obj, name)
    if isinstance(value, bool) or (value is None and none):
        return
    numpy_bool = getattr(getattr(value, "dtype", None), "kind", "") == "b" and not value.shape
    if numpy_bool or (isinstance(value, int) and value in (0, 1)):
        object.__setattr__(obj, name, bool(value))
        return
    raise TypeError(f"{type(obj).__name__}.{name} must be True or False, not {value!r}")


def _check_callable(owner: str, name: str, value: Any) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"{owner}.{name} must be a function or None, not {type(value).__name__}")


@dataclass(frozen=True)
class ReadOptions:
    """How shards are opened and parsed (one value instead of loose keyword arguments).

    ``storage_options``: fsspec's options for remote URLs. ``allow_pipe``: allow ``pipe:CMD``
    URLs (they run a shell command). ``retries``: reconnections per shard after a dropped
    connection (reading resumes at the offset). ``last_dot``: split member names into key and
    extension at the last dot instead of the first. ``cache_dir``/``cache_size``: keep remote
    shards in a local cache (size like ``"20GB"``). ``prefetch``: shards opened ahead of the
    current one (``None``: 2 for remote shard lists, 0 for local files); ``prefetch_bytes``
    bounds the memory they buffer. ``copy=False``: zero-copy reads of local plain shards
    (read-only ``memoryview`` fields). ``fields``: with a manifest, read only these fields (and
    ``__key__``...): only the column groups that hold them are opened (sidecar columns).
    """

    storage_options: Mapping[str, Any] | None = None
    allow_pipe: bool = False
    retries: int = 5
    last_dot: bool = False
    cache_dir: str | None = None
    cache_size: float | str | None = None
    prefetch: int | None = None
    prefetch_bytes: int = 256 << 20
    copy: bool = True
    fields: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.fields is not None:
            names = (self.fields,) if isinstance(self.fields, str) else tuple(self.fields)
            if not all(isinstance(f, str) for f in names):
                raise TypeError(f"ReadOptions.fields names fields (str), got {self.fields!r}")
            object.__setattr__(self, "fields", names)
        if self.storage_options is not None:
            if not isinstance(self.storage_options, Mapping):
                raise TypeError(
                    "ReadOptions.storage_options must be a dict, not "
                    f"{type(self.storage_options).__name__}"
                )
            object.__setattr__(self, "storage_options", dict(self.storage_options))
        _check_int(self, "retries", 0)
        for name in ("allow_pipe", "last_dot", "copy"):
            _check_flag(self, name)
        try:
            if self.prefetch is not None:
                _check_int(self, "prefetch", 0)
            _check_int(self, "prefetch_bytes", 1)
        except (TypeError, ValueError):
            raise ValueError(
                f"bad prefetch={self.prefetch!r} / prefetch_bytes={self.prefetch_bytes!r}"
            ) from None
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise TypeError(
                f"ReadOptions.cache_dir must be a path, not {type(self.cache_dir).__name__}"
            )


REMAINDERS = ("drop", "carry", "pad")


@dataclass(frozen=True)
class PlanOptions:
    """Which shards (and samples) each reader reads.

    The epoch plan: ``readers=V`` virtual readers (exact and elastic mid-epoch resume, equal
    batches on every rank, exact ``len()``); ``remainder`` (``"drop"``, ``"carry"``, ``"pad"``;
    ``None``: ``"drop"`` with a warning naming the count) says what happens to the samples that
    do not fill ``V x B``; ``equal=True`` asks for equal batches explicitly, ``equal=False``
    silences the warning of the plain split that ranks may read different numbers of samples.
    The plain shard split: ``rank``/``world_size`` (default: from torch.distributed when
    initialized), ``nodesplitter``/``workersplitter`` (functions ``urls -> urls`` replacing the
    split by rank and by DataLoader worker).
    """

    readers: int | None = None
    remainder: str | None = None
    equal: bool | None = None
    rank: int | None = None
    world_size: int | None = None
    nodesplitter: Callable | None = None
    workersplitter: Callable | None = None

    def __post_init__(self):
        _check_int(self, "readers", 1, none=True)
        if self.remainder is not None and self.remainder not in REMAINDERS:
            raise ValueError(
                f"PlanOptions.remainder must be one of {', '.join(REMAINDERS)}, "
                f"not {self.remainder!r}"
            )
        _check_flag(self, "equal", none=True)
        if self.readers is None and self.equal:
            raise ValueError(
                "equal batches per rank need the epoch plan: pass readers=V "
                "(virtual readers, e.g. 60)"
            )
        if self.readers is not None and self.equal is False:
            raise ValueError(
                "a planned pipeline (readers=) always yields equal batches per "
                "rank; leave readers= out for the plain shard split"
            )
        _check_int(self, "rank", 0, none=True)
        _check_int(self, "world_size", 1, none=True)
        if self.rank is not None and self.world_size is not None and self.rank >= self.world_size:
            raise ValueError(
                f"PlanOptions.rank {self.rank} is not below world_size {self.world_size}"
            )
        _check_callable("PlanOptions", "nodesplitter", self.nodesplitter)
        _check_callable("PlanOptions", "workersplitter", self.workersplitter)


@dataclass(frozen=True)
class SafetyOptions:
    """What a pipeline trusts and what it checks.

    ``allow_unsafe``: let ``decode`` unpickle (``.pyd``, ``.pth``...), which can run code.
    ``verify``: check each shard against the manifest's size and hash while reading (needs a
    manifest). ``empty_check``: raise when this reader was given shards but found no sample in
    them. (``pipe:`` URLs, which run shell commands, are allowed by
    :attr:`ReadOptions.allow_pipe`, beside the other opening options.)
    """

    allow_unsafe: bool = False
    verify: bool = False
    empty_check: bool = True

    def __post_init__(self):
        for name in ("allow_unsafe", "verify", "empty_check"):
            _check_flag(self, name)


@runtime_checkable
class Stateful(Protocol):
    """Anything whose position can be saved and restored (torchdata's protocol)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...
