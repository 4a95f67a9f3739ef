"""The PyTorch adapter: the only module of tarshards that imports torch.

``WebDataset`` and ``DataPipeline`` here are the pipeline classes made into
``torch.utils.data.IterableDataset`` subclasses. This is the top of the stack, where the reader's
place is discovered and handed down as a :class:`~tarshards.types.WorkerInfo`:

- **rank and world size** are discovered in the process that owns the process group (the main
  process: where the dataset is iterated, or handed to a DataLoader), each time an iteration or a
  DataLoader's workers start, so a dataset built before ``init_process_group`` and used after it
  sees the right rank. ``torch.distributed`` when it is initialized; else a launcher's ``RANK``
  and ``WORLD_SIZE`` environment variables; else rank 0 of 1. DataLoader workers do not discover
  it again (``torch.distributed`` is not initialized in a spawned worker): the rank is captured in
  the main process when the dataset is sent to spawn/forkserver workers, and a forked worker has
  the main process's own state.
- **the epoch** set by :meth:`set_epoch` in the main process reaches DataLoader workers through a
  one-value tensor in shared memory, created in the main process before the workers start, so
  persistent workers (``persistent_workers=True``) see each new epoch.

``WebLoader`` is a ``DataLoader`` that sets the dataset's epoch each time it is iterated.
"""

from __future__ import annotations

import abc
import collections
import functools
import inspect
import io
import itertools
import multiprocessing.context
import os
import warnings
import weakref
from multiprocessing import resource_tracker
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    default_collate,
    default_convert,
    get_worker_info,
)

from ..codecs.crop import register_crop_converter
from ..codecs.registry import Codec, register_array_kind, register_codec
from ..errors import (
    ResumeError,
    TarshardsWarning,  # (of a plain DataLoader repeating its order)
)
from ..media.output import register_media_converter
from ..media.probe import register_worker_count
from ..pipeline import dataset as _pipeline
from ..pipeline.collation import register_array_type
from ..pipeline.stages import collate_error, register_collation
from ..plan import mixing as _mix
from ..plan.epoch import STATE_FORMAT
from ..plan.ledger import LedgerWriter
from ..read import indexed as _indexed
from ..stats import Counters, LoaderStats, OnStall, clock, gathered, start_watchdog, timed_items
from ..storage import is_local
from ..types import Stateful, WorkerInfo
from .transport import Group, Packer, Unpacker, new_token, remove_orphans

__all__ = [
    "DataPipeline",
    "IndexedDataset",
    "MixedDataset",
    "WebDataset",
    "WebLoader",
    "discover_rank",
    "image_to_tensor",
    "mix",
    "torch_environment",
]


# In a process started by spawn/forkserver (a DataLoader worker) that was sent a tarshards dataset:
# the (rank, world_size) its rank's main process discovered, so that code in the worker that asks
# (webdataset-style stages through tarshards.compat) gets the same answer as the dataset.
_received_rank: tuple[int, int] | None = None


def discover_rank() -> tuple[int, int]:
    """``(rank, world_size)`` of this process: from ``torch.distributed`` when it is initialized,
    else, in a DataLoader worker started by ``spawn``/``forkserver`` (where ``torch.distributed``
    is not initialized), the rank the main process discovered and sent with the dataset, else from
    a launcher's ``RANK`` and ``WORLD_SIZE`` environment variables (torchrun, SLURM scripts that
    export them...), else ``(0, 1)``.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if _received_rank is not None:
        return _received_rank
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or world is None:
        return 0, 1
    try:
        place = WorkerInfo(rank=int(rank), world_size=int(world))
    except ValueError:
        raise ValueError(f"bad RANK/WORLD_SIZE in the environment: {rank!r}/{world!r}") from None
    return place.rank, place.world_size


def torch_environment() -> dict:
    """Rank/world size (:func:`discover_rank`) and the DataLoader worker of this process, as a
    dict. Inside a spawned worker the rank is not known here: datasets carry it from the main
    process instead (see the module's notes)."""
    rank, world = discover_rank()
    info = get_worker_info()
    worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
    return {"rank": rank, "world_size": world, "worker": worker, "num_workers": num_workers}


# ---- a plain DataLoader's workers repeating an epoch's order ----------------------------------
# A DataLoader (without persistent workers) starts every epoch with fresh workers, each with a
# fresh copy of the dataset, so a dataset that counts its epochs itself starts at the same one
# every time: the same shard and sample order each epoch. The workers record the epoch they
# start in a table shared by the main process and all its workers (made in the main process
# when a dataset is made, so forked workers inherit it; sent along to spawned ones), keyed by the
# dataset's token (a new one for each composed pipeline and each loaded state) and the worker.
_ORDER_SLOTS = 4096
_order_table: torch.Tensor | None = None
_order_tokens = itertools.count(1)


def _new_order_token() -> int:
    """A token for a new pipeline, and the table its workers write (made here, once)."""
    global _order_table
    if _order_table is None and get_worker_info() is None:
        _order_table = torch.zeros(_ORDER_SLOTS, dtype=torch.int64).share_memory_()
    return next(_order_tokens)


def _check_order_moved(ds) -> None:
    """In a DataLoader worker: warn once (from worker 0) when this worker starts the epoch it
    started before (a plain DataLoader's fresh workers, no ``set_epoch``) in a pipeline whose
    order is random."""
    info = get_worker_info()
    table = _order_table
    token = ds.__dict__.get("_order_token")
    if info is None or table is None or not token or ds.loader_link.managed:
        return
    if ds.current_epoch() is not None or ds.pending_state is not None:
        return  # set_epoch() or a loaded state: the epoch is the caller's choice
    if not _order_varies(ds):
        return
    cells = table.numpy()
    key = ((token & 0xFFFFF) << 12) | (info.id & 0xFFF)
    value = (key << 24) | ((ds.next_epoch() + 1) & 0xFFFFFF)
    slot = (token * 131 + info.id) % _ORDER_SLOTS
    again = int(cells[slot]) == value
    cells[slot] = value
    if not again or info.id != 0:
        return
    warned = (((token & 0xFFFFF) << 12 | 0xFFF) << 24) | 1
    wslot = (token * 131 + 0xFFF) % _ORDER_SLOTS
    if int(cells[wslot]) == warned:
        return
    cells[wslot] = warned
    warnings.warn(
        f"DataLoader worker {info.id} starts epoch {ds.next_epoch()} of this dataset again: a "
        "DataLoader's fresh workers begin from the dataset's own epoch each time, so every "
        "epoch repeats the same shard and sample order. Use tarshards.WebLoader (it advances "
        "the epoch each time it is iterated), or call dataset.set_epoch(epoch) before each "
        "epoch",
        TarshardsWarning,
        stacklevel=3,
    )


def _order_varies(ds) -> bool:
    """Does the pipeline's order depend on the epoch (shard shuffling, resampling, a stage
    drawing random numbers)?"""
    if getattr(ds, "shardshuffle", False) or getattr(ds, "resampled", False):
        return True
    if any(getattr(src, "shardshuffle", False) for src in getattr(ds, "sources", ()) or ()):
        return True
    return any(st.wants_rng for st in ds.stage_list)


if TYPE_CHECKING:  # the mixin only goes on core pipelines (_adapter's classes below)
    _MixinBase = _pipeline.DataPipeline
else:
    _MixinBase = object


class _TorchMixin(_MixinBase):
    """Shared overrides: rank and epoch carried from the main process into DataLoader workers,
    and the pipeline's own item/len/iter behaviour."""

    # (rank, world_size) captured in the main process when the dataset was sent to a worker
    _parent_rank: tuple[int, int] | None = None
    # the epoch as a shared-memory int64 tensor ([-1]: count epochs), made in the main process
    _shared_epoch: torch.Tensor | None = None

    def worker_info(self) -> WorkerInfo:
        info = get_worker_info()
        if info is None:  # the main process: it owns the process group
            rank, world = discover_rank()
            worker, num_workers = 0, 1
        else:
            # spawn/forkserver: captured in the main process; fork: the main process's state
            rank, world = self._parent_rank or discover_rank()
            worker, num_workers = info.id, info.num_workers
        place = WorkerInfo(rank, world, worker, num_workers)
        return _pipeline.explicit_rank(
            place, getattr(self, "rank", None), getattr(self, "world_size", None)
        )

    def set_epoch(self, epoch: int) -> None:
        """Fix the epoch used to seed shard and sample shuffling (instead of counting).

        Called in the main process, it also reaches DataLoader workers that are already running
        (``persistent_workers=True``): they read it when their next epoch starts.
        """
        _pipeline.DataPipeline.set_epoch(self, epoch)
        if get_worker_info() is None:
            self._epoch_cell().fill_(int(epoch))

    def unpin_epoch(self) -> None:
        cell = self._shared_epoch
        if cell is not None:
            cell.fill_(-1)  # an earlier set_epoch() must not pin the workers' epoch

    def _epoch_cell(self) -> torch.Tensor:
        cell = self._shared_epoch
        if cell is None or not cell.is_shared():
            value = -1 if self.epoch is None else self.epoch
            cell = torch.full((1,), value, dtype=torch.int64).share_memory_()
            self._shared_epoch = cell
        return cell

    def current_epoch(self) -> int | None:
        cell = self._shared_epoch
        if cell is not None and get_worker_info() is not None:
            value = int(cell[0])
            if value >= 0:
                return value
        return self.epoch

    def compose(self, stage, *args, **kwargs):
        new = _pipeline.DataPipeline.compose(self, stage, *args, **kwargs)
        new._shared_epoch = None  # its own epoch from here on (set_epoch makes a new cell)
        new._order_token = _new_order_token()
        return new

    def load_state_dict(self, state: dict) -> None:
        _pipeline.DataPipeline.load_state_dict(self, state)
        self._order_token = _new_order_token()  # a resumed epoch is run again on purpose

    def __getstate__(self):
        state = self.__dict__.copy()
        if "loader_link" in state:  # a worker's own transport, grouping and counters stay here
            state["loader_link"] = self.loader_link.for_worker()
        if multiprocessing.context.get_spawning_popen() is not None and get_worker_info() is None:
            # sent to a new process (a spawn/forkserver DataLoader worker): carry the rank
            # discovered here, and share the epoch cell with it
            state["_parent_rank"] = discover_rank()
            state["_shared_epoch"] = self._epoch_cell()
            state["_order_table"] = _order_table
        return state

    def __setstate__(self, state):
        global _received_rank, _order_table
        table = state.pop("_order_table", None)
        if table is not None and _order_table is None:
            _order_table = table
        self.__dict__.update(state)
        if state.get("_parent_rank") is not None:  # sent by a rank's main process
            _received_rank = tuple(state["_parent_rank"])

    def __iter__(self):
        _check_order_moved(self)
        it = _pipeline.DataPipeline.__iter__(self)
        monitor = self.loader_link.monitor  # WebLoader(stats=True) or watchdog=
        if monitor is not None:  # in a worker, the last news goes after the last item
            it = timed_items(it, monitor, _LAST_NEWS if get_worker_info() is not None else None)
        grouping = self.loader_link.group  # in a WebLoader worker: batches are
        return it if grouping is None else _grouped(it, *grouping)  # sent a few at a time

    def __getitem__(self, index):
        return _pipeline.DataPipeline.__getitem__(self, index)

    def __len__(self):
        return _pipeline.DataPipeline.__len__(self)

    def __repr__(self):
        return _pipeline.DataPipeline.__repr__(self)


_FROM_MIXIN = (
    "worker_info",
    "set_epoch",
    "current_epoch",
    "compose",
    "load_state_dict",
    "__getstate__",
    "__setstate__",
    "__iter__",
    "__getitem__",
    "__len__",
    "__repr__",
)


def _adapter(cls):
    """Give ``cls`` the mixin's methods ahead of IterableDataset's and the core pipeline's in
    the MRO (those the class defines itself stay)."""
    for name in _FROM_MIXIN:
        if name not in cls.__dict__:
            setattr(cls, name, getattr(_TorchMixin, name))
    return abc.update_abstractmethods(cls)  # IterableDataset's abstract __iter__ is now defined


@_adapter
class WebDataset(IterableDataset, _TorchMixin, _pipeline.WebDataset):
    __doc__ = _pipeline.WebDataset.__doc__

    # the signature inspect and help() show (mypy: "unsupported decorated constructor")
    @functools.wraps(_pipeline.WebDataset.__init__)  # type: ignore[misc]
    def __init__(self, *args, **kwargs):
        _pipeline.WebDataset.__init__(self, *args, **kwargs)
        self._order_token = _new_order_token()

    __len__ = _pipeline.WebDataset.__len__  # exact with a manifest


@_adapter
class DataPipeline(IterableDataset, _TorchMixin, _pipeline.DataPipeline):
    __doc__ = _pipeline.DataPipeline.__doc__

    # the signature inspect and help() show (mypy: "unsupported decorated constructor")
    @functools.wraps(_pipeline.DataPipeline.__init__)  # type: ignore[misc]
    def __init__(self, *args, **kwargs):
        _pipeline.DataPipeline.__init__(self, *args, **kwargs)
        self._order_token = _new_order_token()


class IndexedDataset(Dataset, _indexed.IndexedDataset):
    """:class:`tarshards.read.indexed.IndexedDataset` as a ``torch.utils.data.Dataset`` (map-style:
    works with ``DataLoader(shuffle=True, num_workers=N)`` and ``DistributedSampler``)."""

    # the signature inspect and help() show (mypy: "unsupported decorated constructor")
    @functools.wraps(_indexed.IndexedDataset.__init__)  # type: ignore[misc]
    def __init__(self, *args, **kwargs):
        _indexed.IndexedDataset.__init__(self, *args, **kwargs)

    __getitem__ = _indexed.IndexedDataset.__getitem__
    __len__ = _indexed.IndexedDataset.__len__
    __iter__ = _indexed.IndexedDataset.__iter__
    __repr__ = _indexed.IndexedDataset.__repr__


@_adapter
class MixedDataset(IterableDataset, _TorchMixin, _mix.MixedDataset):
    __doc__ = _mix.MixedDataset.__doc__

    # the signature inspect and help() show (mypy: "unsupported decorated constructor")
    @functools.wraps(_mix.MixedDataset.__init__)  # type: ignore[misc]
    def __init__(self, *args, **kwargs):
        _mix.MixedDataset.__init__(self, *args, **kwargs)
        self._order_token = _new_order_token()

    __len__ = _mix.MixedDataset.__len__  # the batches a rank yields an epoch


def mix(sources, weights=None, **kwargs) -> MixedDataset:
    """:func:`tarshards.plan.mixing.mix` as a torch ``IterableDataset``."""
    return MixedDataset(sources, weights, **kwargs)


# the fields of a planned state that say where it is (the rest: what the plan depends on)
_POSITION_KEYS = frozenset(
    ("format", "kind", "epoch", "position", "origin", "world_size", "finished")
    + ("worker", "num_workers", "next_step")
)


class WebLoader(DataLoader):
    """A ``DataLoader`` that runs the dataset's epochs in turn (e = start_epoch, e + 1, ...) and
    can save and restore its place.

    Each ``iter(loader)`` runs the next epoch: the dataset counts it (so persistent workers
    follow too). ``state_dict()`` names the epoch and the number of batches handed out so far
    (the global step within the epoch: batches prefetched but not handed out are produced
    again after a resume); ``load_state_dict()`` makes the next ``iter()`` continue from there.
    With a planned dataset (``WebDataset(..., readers=V)``) resuming seeks to the position,
    works with any ``num_workers`` and another world size, and ``len(loader)`` is exact.

    With ``persistent_workers=True`` too, each epoch gets a new order: the epoch reaches the
    running workers through shared memory (see :meth:`WebDataset.set_epoch`).

    With workers, batches of arrays and tensors travel through shared memory that each worker
    allocates once (:mod:`tarshards.torch.transport`) instead of a new shared-memory segment per
    tensor: ``transport="shm"`` (the default, ``"auto"``) or ``None`` for DataLoader's own path.
    The tensors handed out are views of a worker's slot (no copy in the main process; with
    ``pin_memory`` they are copied into pinned memory instead): the slot is written again only
    once they are all garbage collected, and a worker whose slots are all still held sends its
    batches the usual way. Anything else in a batch (keys, strings) travels as usual; batches
    without array data, or with very little, pass through unchanged. When the dataset is a
    tarshards pipeline whose last stage is ``.batched()`` with its default collation (and the
    loader's ``batch_size=None``, default ``collate_fn``), each worker stacks its batches
    straight into its slots (the pixels are written once, no copy into shared memory) and sends
    a few consecutive batches at a time (up to 8, or 8 MiB of arrays: a worker's ring is then
    ``prefetch_factor + 3`` slots of up to about 10 MiB, or of one batch where that is more);
    they are handed out in DataLoader's own order (the workers in turn), so steps and resumed
    positions are those of ``transport=None``. With
    ``persistent_workers=True``, an epoch broken off restarts the workers (the batches they
    had made ahead would keep their slots).

    ``stats=True`` keeps counters in every worker (samples, bytes, time on storage, decoding and
    the other stages, shard opens, cache hits, retries, the loop's wait per batch), sent to the
    main process with the batches: :meth:`stats` returns them (``gather=True``: every rank's).
    ``watchdog=SECONDS`` reports a worker that makes no progress for that long (rank, worker,
    shard URL, byte offset) and abandons a remote read silent that long, resuming it from its
    offset; ``on_stall`` is ``"warn"`` (a :class:`~tarshards.errors.StallWarning`), ``"raise"``
    (:class:`~tarshards.errors.StallError`), ``"skip"`` or a function given the error. See
    docs/monitoring.md.

    ``ledger=PATH`` (a planned dataset) appends a record per step handed out (the plan, epoch,
    global batch, rank, world size, time) to ``PATH/rank-N.jsonl`` (or ``PATH`` with ``{rank}``
    replaced), and a start record at each epoch and resume: ``tarshards audit PATH [SPEC]``
    checks that every sample came exactly once (see :mod:`tarshards.plan.ledger`).
    """

    # a tarshards pipeline (its methods used) or any dataset (its attributes probed)
    dataset: Any

    def __init__(
        self,
        dataset,
        *args,
        start_epoch: int = 0,
        transport: str | None = "auto",
        stats: bool = False,
        watchdog: float | None = None,
        on_stall: OnStall = "warn",
        ledger: str | os.PathLike | None = None,
        **kwargs,
    ):
        if transport not in ("auto", "shm", None):
            raise ValueError(f"transport is 'auto', 'shm' or None, not {transport!r}")
        monitor = None
        if stats or watchdog is not None:
            Counters(watchdog=watchdog, on_stall=on_stall)  # checks them
            monitor = (bool(stats), watchdog, on_stall)
        bound = inspect.signature(DataLoader.__init__).bind(self, dataset, *args, **kwargs)
        options = bound.arguments
        options.update(options.pop("kwargs", {}) or {})
        if options.get("collate_fn") is None and options.get("batch_size", 1) is not None:
            options["collate_fn"] = _Hinted(default_collate)  # mixed image sizes: what to do
        packing = transport is not None and (options.get("num_workers") or 0) > 0
        grouping = None
        owning = getattr(dataset, "copy", True) is False  # zero-copy fields: bytes before collate
        if packing or owning:
            inner = options.get("collate_fn")
            if inner is None:
                inner = default_convert if options.get("batch_size", 1) is None else default_collate
            if owning:
                inner = _Owning(inner)
            if packing:
                prefetch = options.get("prefetch_factor") or 2
                # the batches in flight, the one the user holds while asking for the next, a spare
                token = new_token()
                packer = Packer(slots=prefetch + 3, to_array=_tensor_to_array, token=token)
                plain = inner.inner if isinstance(inner, _Owning) else inner
                in_order = options.get("in_order", True)  # the order that _InTurn keeps
                if (
                    isinstance(dataset, _pipeline.DataPipeline)
                    and plain is default_convert
                    and in_order
                ):
                    # the dataset's batches go straight to the packer: the pipeline's last
                    # batched() stacks them in the worker's slot (no copy on the way), and
                    # they travel a few at a time (a group size the main process sets in
                    # `cell` once it has seen a batch; 0: one at a time)
                    cell = torch.zeros(1, dtype=torch.int64).share_memory_()
                    grouping = (packer, cell)
                    options["worker_init_fn"] = _GivingSlots(
                        options.get("worker_init_fn"), packer, cell
                    )
                inner = _PackingCollate(inner, packer)
            options["collate_fn"] = inner
        if monitor is not None and (options.get("num_workers") or 0) > 0:
            # each worker counts in its own Counters and sends what it gathered with each batch
            inner = options.get("collate_fn")
            if inner is None:
                inner = default_convert if options.get("batch_size", 1) is None else default_collate
            options["collate_fn"] = _CarryingStats(
                inner, options.get("batch_size", 1), bool(options.get("drop_last"))
            )
            options["worker_init_fn"] = _Monitoring(
                options.get("worker_init_fn"), watchdog, on_stall
            )
        options.pop("self")
        super().__init__(**options)
        self._packing = packing
        self._grouping = grouping
        if packing:
            # segments of exited workers whose tickets were dropped (an epoch broken off)
            self._token = token
            # the loader gone (or the program ending, after an error too): every segment of
            # its workers, whose tickets no one will map
            weakref.finalize(self, remove_orphans, token, True)
        self._unpacker: Unpacker | None = None
        if self._planned():
            dataset.plan_identity()  # count the shards once here, not in every worker
            dataset.attach_loader(warns=True)  # of dropped samples: here, not in every worker
        self.epoch = start_epoch  # the epoch the next iter() runs
        self._current: int | None = None  # the epoch being run, its steps handed out, finished?
        self._step = 0
        self._finished = False
        self._pending: dict | None = None
        self._workers_next: int | None = None  # with persistent workers: the epoch they run next
        self._origin = 0
        self._monitor = monitor  # (stats, watchdog, on_stall) or None
        self._totals: Counters | None = None  # this rank's statistics (made at the first iter)
        self._ledger_path = None if ledger is None else os.fspath(ledger)
        self._ledger: LedgerWriter | None = None  # opened at the first iter()
        if ledger is not None and not self._planned():
            raise ValueError(
                "ledger= records each step's place in the epoch plan: it needs a planned "
                "dataset (WebDataset(..., readers=V)); the plain path's order depends on the "
                "workers and ranks that ran it and cannot be replayed"
            )

    def stats(self, gather: bool = False) -> LoaderStats:
        """This rank's statistics so far (``WebLoader(..., stats=True)``): a
        :class:`~tarshards.stats.LoaderStats` (``str()`` is a one-line summary, ``.as_dict()``,
        ``.prometheus()``). ``gather=True``: every rank's, collected through the process group
        (``torch.distributed.all_gather_object``; every rank must call it), summed, with the
        ranks whose loop waited longest and the slowest shards named. A worker's counters reach
        this process with its batches."""
        if self._monitor is None:
            raise ValueError("this loader keeps no statistics: pass WebLoader(..., stats=True)")
        local = self._counters().snapshot()
        if not gather:
            return local
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, local.as_dict())
            return gathered(LoaderStats.from_dict(d) for d in everyone)
        return gathered([local])

    def _counters(self) -> Counters:
        totals = self._totals
        if totals is None:
            _stats, watchdog, on_stall = self._monitor or (False, None, "warn")
            ds = self.dataset  # its place: the rank discovered here, or the one it was given
            env = ds.environment() if isinstance(ds, _pipeline.DataPipeline) else None
            env = env or torch_environment()
            totals = Counters(
                env["rank"], env["world_size"], None, watchdog=watchdog, on_stall=on_stall
            )
            self._totals = totals
            if self.num_workers == 0:  # the dataset runs here, and counts here
                start_watchdog(totals)
                weakref.finalize(self, _close, totals)
        return totals

    def _planned(self) -> bool:
        return getattr(self.dataset, "_plan_config", None) is not None

    def __iter__(self):
        ds = self.dataset
        pending, self._pending = self._pending, None
        loaded = pending is not None  # a state: the ledger records a resume
        fresh_workers = False
        origin = 0
        if pending is not None:
            epoch, step = pending["epoch"], pending["step"]
            if self._planned():
                inner = pending["dataset"]
                world = ds.environment()["world_size"]
                if inner["world_size"] == world:
                    origin = inner["origin"]
                    step = (inner["position"] - origin) // world
                else:
                    origin, step = inner["position"], 0
            if pending["finished"]:
                epoch, step, origin = epoch + 1, 0, 0
                pending = None
            fresh_workers = True
        else:
            epoch, step = self.epoch, 0
        if isinstance(ds, _pipeline.DataPipeline):
            # the loader moves the epoch (no warning of repeats): counted by the dataset (and
            # by persistent workers' copies) from here, an earlier set_epoch() unpinned
            resume = pending["dataset"] if pending is not None and self._planned() else None
            ds.loader_epoch(epoch, resume)
            if resume is not None:
                fresh_workers = True
        elif hasattr(ds, "set_epoch"):
            ds.set_epoch(epoch)
        # With the transport, an epoch broken off leaves the batches the workers had made
        # ahead (dropped by DataLoader's reset) holding their slots: new workers, new rings.
        broken_off = self._packing and self._current is not None and not self._finished
        if (
            self.persistent_workers
            and self._iterator is not None
            and (fresh_workers or broken_off or self._workers_next != epoch)
        ):
            # they hold another epoch or position (persistent workers: a multiprocessing iterator)
            self._iterator._shutdown_workers()  # type: ignore[attr-defined]
            self._iterator = None
            if self._unpacker is not None:
                self._unpacker.close()
                self._unpacker = None
        self._workers_next = epoch + 1
        self.epoch = epoch + 1
        if self._ledger_path is not None:
            self._ledger_start(epoch, origin, step, loaded)
        self._current, self._step, self._finished = epoch, step, False
        self._origin = origin
        warn_dropped = getattr(ds, "warn_dropped", None) if self._planned() else None
        if warn_dropped is not None:
            warn_dropped(epoch)  # remainder="drop" left at its default leaves samples out
        if self._packing:
            # one resource tracker for this process and its workers (forked ones would each
            # start their own): the names of their segments are withdrawn where registered
            resource_tracker.ensure_running()
        totals = None
        if self._monitor is not None:
            totals = self._counters()
            if self.num_workers == 0 and isinstance(ds, _pipeline.DataPipeline):
                ds.attach_loader(monitor=totals)
        it: Iterator = super().__iter__()
        if self._packing:
            remove_orphans(self._token)  # of the workers of earlier epochs
            if self._unpacker is None or not self.persistent_workers:
                if self._unpacker is not None:
                    self._unpacker.close()  # the previous epoch's workers (and rings) are gone
                pinned = self.pin_memory and torch.cuda.is_available()
                self._unpacker = Unpacker(
                    from_array=_array_to_tensor,
                    alloc=_pinned_alloc if pinned else None,
                    copy=pinned,  # else the batch's tensors are views of the slot (no copy)
                )
            in_turn = None
            if self._grouping is not None:
                packer, cell = self._grouping
                in_turn = _InTurn(self.num_workers, packer, cell)
            absorb = totals.add if totals is not None and self.num_workers else None
            it = _UnpackingIterator(it, self._unpacker, in_turn, absorb)
        elif totals is not None and self.num_workers:
            it = _absorbing(it, totals)
        if pending is not None and not self._planned() and step:
            for _ in range(step):  # a plain stream: replay to the position
                next(it)
        return self._count(it) if totals is None else self._count_timed(it, totals)

    def _count(self, it):
        try:
            for batch in it:
                if self._ledger is not None:
                    self._ledger_step()
                self._step += 1
                yield batch
        except Exception:
            self._abandon(it)  # an error (in a worker, say) ends the epoch: its workers too
            raise
        self._finished = True

    def _abandon(self, it) -> None:
        """Stop the workers of an epoch that an error ended, and remove the shared-memory
        segments whose batches will never be taken (else Python's resource tracker finds
        them at exit and warns of "leaked shared_memory objects")."""
        inner = getattr(it, "_it", it)  # DataLoader's iterator
        shutdown = getattr(inner, "_shutdown_workers", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:  # already down, or half made: the segments below still go
                pass
            if self.persistent_workers and self._iterator is inner:
                self._iterator = None
        if self._packing:
            remove_orphans(self._token, True)
            if self._unpacker is not None:
                self._unpacker.close()
                self._unpacker = None

    def _count_timed(self, it, totals: Counters):
        """:meth:`_count`, with the time the training loop waits for each batch."""
        try:
            t0 = clock()
            for batch in it:
                totals.waited(clock() - t0)
                if self._ledger is not None:
                    self._ledger_step()
                self._step += 1
                yield batch
                t0 = clock()
            self._finished = True
        except Exception:
            self._abandon(it)  # as in _count
            raise
        finally:
            ds = self.dataset
            if self.num_workers == 0 and isinstance(ds, _pipeline.DataPipeline):
                if ds.loader_link.monitor is totals:
                    ds.attach_loader(monitor=None)

    def _ledger_start(self, epoch: int, origin: int, step: int, loaded: bool) -> None:
        """A start record in this rank's ledger (opened at the first epoch)."""
        ds, path = self.dataset, self._ledger_path
        if path is None:
            return
        env = ds.environment()
        writer = self._ledger
        if writer is None or writer.world_size != env["world_size"]:
            if writer is not None:
                writer.close()
            writer = LedgerWriter(path, env["rank"], env["world_size"])
            weakref.finalize(self, writer.close)
            self._ledger = writer
        manifest = getattr(ds, "manifest", None)
        url = getattr(manifest, "url", None)
        view = getattr(ds, "view", None)  # a view's plan replays over the view (its rows)
        if view is not None:
            url = getattr(view, "url", None)
        position = origin + step * env["world_size"]
        state = ds.plan_state(epoch, position, origin=origin, world_size=env["world_size"])
        writer.start(
            {k: v for k, v in state.items() if k not in _POSITION_KEYS},  # the plan's identity
            epoch=epoch,
            position=position,
            origin=origin,
            num_batches=ds.steps_per_epoch(epoch, 1),  # the epoch's global batches
            resumed=loaded,
            data=os.path.abspath(url) if url is not None and is_local(url) else url,
        )

    def _ledger_step(self) -> None:
        """A step record: the batch about to be handed out (global batch origin + k R + r)."""
        writer, epoch = self._ledger, self._current
        if writer is None or epoch is None:
            return
        world = writer.world_size
        writer.step(epoch, self._step, self._origin + self._step * world + writer.rank)

    def __len__(self):
        if self._planned():
            epoch = self._current if self._current is not None else self.epoch
            return self.dataset.steps_per_epoch(epoch)
        return super().__len__()

    def state_dict(self) -> dict:
        """The loader's place: epoch, steps handed out, and the dataset's state there."""
        if self._pending is not None:
            return dict(self._pending)
        if self._current is None:
            epoch, step, finished = self.epoch, 0, False
        else:
            epoch, step, finished = self._current, self._step, self._finished
        state = {
            "format": STATE_FORMAT,
            "kind": "loader",
            "epoch": epoch,
            "step": step,
            "finished": finished,
        }
        ds = self.dataset
        if self._planned():
            world = ds.environment()["world_size"]
            origin = self._origin if self._current is not None else 0
            state["dataset"] = ds.plan_state(
                epoch, origin + step * world, origin=origin, world_size=world, finished=finished
            )
        elif isinstance(ds, Stateful):  # a resumable dataset: its epoch, from the start
            state["dataset"] = {
                "format": STATE_FORMAT,
                "kind": "stream",
                "seed": getattr(ds, "seed", None),
                "epoch": epoch,
            }
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` at the next ``iter()``; a state that does not fit this
        dataset raises :class:`~tarshards.errors.ResumeError`."""
        if not isinstance(state, dict) or state.get("kind") != "loader":
            raise ResumeError(
                "not a WebLoader state (use dataset.load_state_dict for a dataset's state)"
            )
        ds = self.dataset
        if self._planned():
            state = dict(state, dataset=ds.check_plan_state(state.get("dataset")))
        elif state.get("dataset", {}).get("kind") == "plan":
            raise ResumeError(
                "a planned pipeline's state loaded into a loader whose dataset "
                "has no plan (readers=)"
            )
        self._pending = dict(state)
        self.epoch = state["epoch"] + (1 if state.get("finished") else 0)

    def state_from_step(self, step: int, start_epoch: int = 0) -> dict:
        """The loader state after ``step`` steps from the start of ``start_epoch`` (for
        trainers that keep a step count), on this world size."""
        inner = self.dataset.state_from_step(step, start_epoch=start_epoch)
        world = inner["world_size"]
        return {
            "format": STATE_FORMAT,
            "kind": "loader",
            "epoch": inner["epoch"],
            "step": inner["position"] // world,
            "finished": False,
            "dataset": inner,
        }


class _Hinted:
    """A collate function whose failure on values of different shapes (images of mixed sizes)
    says what to do (:func:`tarshards.pipeline.stages.collate_error`)."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, batch):
        try:
            return self.inner(batch)
        except (RuntimeError, ValueError, TypeError) as exn:
            err = collate_error(batch, exn) if isinstance(batch, list) else None
            if err is None:
                raise
            raise err from exn


class _Owning:
    """A collate function that first turns memoryviews (the fields of a ``copy=False`` dataset)
    into bytes: torch's collation takes a view for a sequence of ints, and views do not pickle."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, batch):
        return self.inner(_owned(batch))


def _owned(x):
    if type(x) is memoryview:
        return x.tobytes()
    if type(x) is dict:
        return {k: _owned(v) for k, v in x.items()}
    if type(x) in (list, tuple):
        return type(x)(_owned(v) for v in x)
    return x


class _PackingCollate:
    """Runs in each worker: the usual collation, then the batch into a shared-memory slot."""

    def __init__(self, inner, packer):
        self.inner = inner
        self.packer = packer

    def __call__(self, batch):
        if type(batch) is Group:  # batches that the worker sends together
            return self.packer(batch.like([self.inner(b) for b in batch]))
        return self.packer(self.inner(batch))


class _GivingSlots:
    """A worker's init function: the worker's copy of the dataset stacks its batches in the
    slots of the worker's packer (its ``loader_link.allocate``, read by the pipeline's context) and
    yields them in groups of the size in ``cell`` (``loader_link.group``); then the user's
    ``worker_init_fn``."""

    def __init__(self, inner, packer, cell):
        self.inner = inner
        self.packer = packer
        self.cell = cell

    def __call__(self, worker_id):
        info = get_worker_info()
        if info is not None and isinstance(info.dataset, _pipeline.DataPipeline):
            # read by the pipeline's context (getattr), in this worker's copy only
            info.dataset.attach_loader(allocate=self.packer.allocate, group=(self.cell, info.id))
        if self.inner is not None:
            self.inner(worker_id)


def _grouped(it, cell: torch.Tensor, worker: int):
    """The batches of ``it`` in groups (:class:`~tarshards.torch.transport.Group`, marked with the
    worker's id) of the size the main process set in ``cell`` (one at a time until it has):
    what a WebLoader worker sends at a time."""
    it = iter(it)
    size = cell.numpy()
    for first in it:
        group = Group([first], worker)
        del first
        k = int(size[0])
        if k > 1:
            group.extend(itertools.islice(it, k - 1))
        yield group
        del group


class _InTurn:
    """Main side of the groups: their batches handed out in the order of DataLoader's own path
    (the workers in turn, one batch each, skipping those that have run out), which a planned
    pipeline's steps and a resumed position rely on.

    DataLoader itself hands out the groups with the workers in turn: a worker that another one
    has delivered twice since its own last group has run out. The first batch sets the group
    size (``cell``): the packer's for that many bytes; the workers take it up from their next
    group on.
    """

    def __init__(self, num_workers: int, packer: Packer, cell: torch.Tensor):
        self.queues: list[collections.deque] = [collections.deque() for _ in range(num_workers)]
        self.done = [False] * num_workers
        self.since = [[0] * num_workers for _ in range(num_workers)]  # [w][u]: groups of u
        self.turn = 0
        self.ended = False  # DataLoader's iterator is exhausted
        self.packer: Packer | None = packer  # until the first batch sets the group size
        self.cell = cell

    def next(self, pull):
        queues, done = self.queues, self.done
        while True:
            w = self.turn
            queue = queues[w]
            while not queue and not done[w]:
                self._pull(pull)
            self.turn = (w + 1) % len(queues)
            if queue:
                return queue.popleft()
            if all(done) and not any(queues):
                if self.ended:
                    raise StopIteration
                self._pull(pull)  # (never short of the loader's own end)

    def _pull(self, pull) -> None:
        try:
            group = pull()
        except StopIteration:
            self.done[:] = [True] * len(self.queues)
            self.ended = True
            return
        if type(group) is not Group:
            raise TypeError(f"a WebLoader worker sent {type(group).__name__}, not a batch group")
        u = group.worker
        assert u is not None  # a worker's groups name it (_grouped)
        if self.packer is not None and group:
            if int(self.cell[0]) < 1:
                self.cell.fill_(self.packer.group_size(_array_bytes(group[0])))
            self.packer = None
        self.queues[u].extend(group)
        for w, row in enumerate(self.since):
            if w != u:
                row[u] += 1
                if row[u] >= 2:
                    self.done[w] = True
        self.since[u][:] = [0] * len(self.queues)


def _array_bytes(batch) -> int:
    if isinstance(batch, np.ndarray):
        return batch.nbytes
    if isinstance(batch, torch.Tensor):
        return batch.numel() * batch.element_size()
    if isinstance(batch, (tuple, list)):
        return sum(_array_bytes(x) for x in batch)
    if isinstance(batch, dict):
        return sum(_array_bytes(x) for x in batch.values())
    return 0


class _UnpackingIterator:
    """The DataLoader's iterator, with each batch taken out of its slot.

    Unless the autograd profiler is on, each step calls the iterator's ``_next_data()`` directly
    (what its ``__next__`` does, without the ``record_function`` scope around it, which costs
    the main process about as much as taking the batch out of its slot; and without the warning
    about an IterableDataset yielding more than ``len()``).
    """

    def __init__(self, it, unpacker, in_turn: _InTurn | None = None, absorb=None):
        self._it = it
        self._absorb = absorb  # takes the workers' statistics that come with the batches
        self._unpack = unpacker
        self._direct = all(hasattr(it, a) for a in ("_next_data", "_sampler_iter", "_num_yielded"))
        self._in_turn = in_turn  # the workers send groups of batches

    def __iter__(self):
        return self

    def __next__(self):
        if self._in_turn is not None:
            return self._in_turn.next(self._pull)
        while True:
            data = self._pull()
            if data is not _NOTHING:
                return data

    def _pull(self):
        it = self._it
        if not self._direct or torch.autograd._profiler_enabled():
            data = next(it)
        else:
            if it._sampler_iter is None:
                it._reset()
            data = it._next_data()
            it._num_yielded += 1
        if type(data) is _Carried:
            if self._absorb is not None:
                self._absorb(data.delta)
            data = data.payload
        return self._unpack(data)

    def __len__(self):
        return len(self._it)

    def __getattr__(self, name):
        return getattr(self._it, name)


class _Carried:
    """A worker's batch (or group of batches) with the statistics gathered since its last one
    (:meth:`tarshards.stats.Counters.take`)."""

    __slots__ = ("delta", "payload")

    def __init__(self, payload, delta):
        self.payload = payload
        self.delta = delta

    def __reduce__(self):
        return _Carried, (self.payload, self.delta)


# the item a monitored worker's dataset yields after its last one, so that the counters' last
# news (the end of the last shard) reach the main process; taken out before collation
_LAST_NEWS: Any = type("_LastNews", (), {"__reduce__": lambda self: "_LAST_NEWS"})()
_NOTHING: Any = type("_Nothing", (), {"__reduce__": lambda self: "_NOTHING"})()


class _CarryingStats:
    """A worker's collate function: the inner one, then the worker's counters' news attached.
    The end-of-stream item (``_LAST_NEWS``, last in its batch or group) is taken out; a batch
    left empty (or short of ``batch_size`` under ``drop_last``) becomes ``_NOTHING``, which
    the main process does not hand out."""

    def __init__(self, inner, batch_size=None, drop_last: bool = False):
        self.inner = inner
        self.batch_size = batch_size
        self.drop_last = drop_last

    def __call__(self, batch):
        if batch is _LAST_NEWS:
            out = _NOTHING
        elif type(batch) is list and batch and batch[-1] is _LAST_NEWS:
            batch = batch[:-1]
            full = self.batch_size is None or len(batch) == self.batch_size
            out = self.inner(batch) if batch and (full or not self.drop_last) else _NOTHING
        elif type(batch) is Group and batch and batch[-1] is _LAST_NEWS:
            out = self.inner(batch.like(batch[:-1]))  # (an empty group still counts as a turn)
        else:
            out = self.inner(batch)
        info = get_worker_info()
        ds = None if info is None else info.dataset
        monitor = ds.loader_link.monitor if isinstance(ds, _pipeline.DataPipeline) else None
        if monitor is None:
            return out
        return _Carried(out, monitor.take())


class _Monitoring:
    """A worker's init function: the worker's copy of the dataset counts in a
    :class:`~tarshards.stats.Counters` of its own (its ``loader_link.monitor``), watched by a thread
    when the loader has a watchdog; then the inner init function."""

    def __init__(self, inner, watchdog, on_stall):
        self.inner = inner
        self.watchdog = watchdog
        self.on_stall = on_stall

    def __call__(self, worker_id):
        info = get_worker_info()
        ds = None if info is None else info.dataset
        if isinstance(ds, _pipeline.DataPipeline):
            place = ds.worker_info()
            monitor = Counters(
                place.rank,
                place.world_size,
                worker_id,
                watchdog=self.watchdog,
                on_stall=self.on_stall,
            )
            ds.attach_loader(monitor=monitor)
            start_watchdog(monitor)
        if self.inner is not None:
            self.inner(worker_id)


def _absorbing(it, totals: Counters):
    """The batches of ``it``, the workers' statistics that come with them added to ``totals``."""
    for data in it:
        if type(data) is _Carried:
            totals.add(data.delta)
            data = data.payload
            if data is _NOTHING:
                continue
        yield data


def _close(totals: Counters) -> None:
    totals.closed = True


def _tensor_to_array(x):
    if not isinstance(x, torch.Tensor):
        return None
    try:  # refuses what a slot cannot carry: grad, conj/neg bits, other devices and layouts
        arr = x.numpy()
    except (TypeError, RuntimeError):  # ... and dtypes numpy lacks (bfloat16...)
        return None
    return arr, "tensor"


def _array_to_tensor(arr, kind):
    return torch.from_numpy(arr)


def _pinned_alloc(shape, dtype, kind):
    t = torch.empty(shape, dtype=torch.from_numpy(np.empty(0, dtype=dtype)).dtype, pin_memory=True)
    return (t if kind == "tensor" else t.numpy()), t.numpy()


def image_to_tensor(arr: np.ndarray, as_float: bool, size=None) -> torch.Tensor:
    """HxWxC (or HxW) uint8 array -> CxHxW (or HxW) tensor, float in [0, 1] when ``as_float``.

    Without a resize the tensor is a CxHxW *view* of the HxWxC pixels (strides ``(1, W*C, C)``,
    no copy), as torchvision's ``pil_to_tensor`` returns; ``.contiguous()`` packs it, and
    collation (:func:`stack`, ``torch.stack``) packs a batch of them in its one copy.
    ``size=(w, h)`` resizes when needed (bilinear, antialiased, on uint8: torch's fast path).
    """
    if size is not None and (arr.shape[1], arr.shape[0]) != (size[0], size[1]):
        t = torch.from_numpy(arr)
        x = t.permute(2, 0, 1)[None] if t.ndim == 3 else t[None, None]
        x = torch.nn.functional.interpolate(
            x, size=(size[1], size[0]), mode="bilinear", align_corners=False, antialias=True
        )
        t = x[0] if t.ndim == 3 else x[0, 0]
    else:  # numpy's transpose is a cheaper view than torch's permute
        t = torch.from_numpy(arr.transpose(2, 0, 1) if arr.ndim == 3 else arr)
    if as_float:
        return t.to(torch.float32).div_(255.0)
    return t


def resized_crop(arr: np.ndarray, box, size, flip: bool, as_float: bool) -> torch.Tensor:
    """The crop ``box=(left, upper, right, lower)`` of an HxWxC uint8 array, resized to
    ``size=(h, w)`` (bilinear, antialiased: torch's uint8 fast path), flipped left-right when
    ``flip``: a contiguous CxHxW tensor, float in [0, 1] when ``as_float``.

    A fractional box (a crop of a JPEG decoded at a reduced scale) is rounded to whole pixels
    of that scale.
    """
    left, top, right, bottom = (int(round(v)) for v in box)
    right, bottom = max(right, left + 1), max(bottom, top + 1)
    x = torch.from_numpy(arr[top:bottom, left:right, :3]).permute(2, 0, 1)[None]
    if (bottom - top, right - left) != (size[0], size[1]):
        x = torch.nn.functional.interpolate(
            x.contiguous(memory_format=torch.channels_last),
            size=(size[0], size[1]),
            mode="bilinear",
            align_corners=False,
            antialias=True,
        )
    x = x[0]
    if flip:
        x = x.flip(-1)  # a copy, but of the output (and torch's flip is fast)
    if as_float:  # numpy converts uint8 to float about 1.5x faster than torch here
        return torch.from_numpy(np.divide(x.numpy(), np.float32(255), dtype=np.float32, order="C"))
    return x.contiguous()


def stack(tensors: list) -> torch.Tensor:
    """Collate a column of tensors (contiguous, batch dimension first).

    Stacking the CxHxW image views of :func:`image_to_tensor` is where their pixels are
    transposed (one copy per image, as a per-image ``.contiguous()`` would have cost).
    """
    return torch.stack(tensors)


def stack_into(tensors: list, allocate):
    """:func:`stack` into the array that ``allocate(shape, dtype)`` gives (a loader's
    shared-memory slot), as a tensor over it; ``None`` where it cannot."""
    x = tensors[0]
    if x.device.type != "cpu" or x.requires_grad or x.layout != torch.strided:
        return None
    dtype = _numpy_dtype(x.dtype)
    if dtype is None:
        return None
    out = allocate((len(tensors), *x.shape), dtype)
    if out is None:
        return None
    try:
        return torch.stack(tensors, out=torch.from_numpy(out))
    except (RuntimeError, TypeError):  # shapes or dtypes that differ: as torch.stack has it
        return None


@functools.cache
def _numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:  # no numpy twin (bfloat16...)
        return None


def save_pth(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def load_pth(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


# ---------------------------------------------------------------------------------------------
# the registry entries that need torch (declared by name in tarshards/__init__.py)
# ---------------------------------------------------------------------------------------------

# a DLPack capsule's tensor: torch.from_dlpack less its checks for objects with __dlpack__
_from_capsule = getattr(torch._C, "_from_dlpack", None) or torch.from_dlpack
register_array_kind(
    "torch-uint8",
    lambda arr, size: image_to_tensor(arr, False, size=size),
    resizes=True,
    wrap=torch.from_numpy,  # image_to_tensor(arr, False) of the CxHxW view
    from_dlpack=_from_capsule,
)
register_array_kind(
    "torch-float",
    lambda arr, size: image_to_tensor(arr, True, size=size),
    resizes=True,
    wrap=lambda chw: torch.from_numpy(chw).to(torch.float32).div_(255.0),
    from_dlpack=lambda capsule: _from_capsule(capsule).to(torch.float32).div_(255.0),
)
register_codec(
    Codec(
        ("pth",), lambda value, ext: save_pth(value), lambda data, ext: load_pth(data), safe=False
    )
)
register_collation(torch.Tensor, stack, into=stack_into)
register_crop_converter("tensor", resized_crop)
register_media_converter("tensor", torch.from_numpy)


def _dataloader_workers() -> int:
    info = get_worker_info()
    return 0 if info is None else int(info.num_workers)


register_worker_count(_dataloader_workers)  # video decoders choose their threads by it
register_array_type("torch", torch.Tensor, lambda t: t.detach().cpu().numpy(), torch.from_numpy)
