"""Moving batches from loader workers to the trainer through shared memory allocated once.

A ``torch.utils.data.DataLoader`` worker hands each batch to the main process by pickling it;
every tensor's storage is first moved into a new shared-memory segment (a file descriptor sent
over a socket, a fresh mapping and fresh page faults on the other side, for every tensor of
every batch). At tens of thousands of small images per second that overhead costs as much as
the decoding. Here a worker instead copies a batch's arrays into a slot of a ring of
shared-memory slots that it allocated once (``np.copyto`` into a view: no pickling of array
data, no new segment per batch) and sends a small :class:`Ticket` (segment name, slot, shapes,
dtypes, and the batch's non-array parts). The main process maps each worker's segment once and
copies the arrays out of the slot into fresh arrays (one copy), so the slot is free again before
the batch is handed to the user.

Each slot has a flag in a small header at the start of its segment: the worker marks a slot
busy when it writes a batch there, and the main process marks it free again once it is done with
the batch. With ``Unpacker(copy=True)`` that is right after copying the arrays out; with
``copy=False`` (what :class:`~tarshards.torch.WebLoader` uses) the main process hands out the
arrays as views of the slot itself (no copy at all on its side) and frees the slot when the last
of them is garbage collected. A worker that finds no free slot (the user keeps more batches than
the ring holds) sends that batch the ordinary way (the batch unchanged), so a slot is never
overwritten while anything can still see it. Batches that are not arrays (or hold too little
array data to be worth it) pass through unchanged too. The segments belong to the worker that
made them: it removes their names when it exits (the mappings stay valid for the main process
until it closes them and the last view is gone), and Python's resource tracker removes them if
a worker is killed.

This module needs only numpy; :mod:`tarshards.torch` plugs tensors in through the ``to_array``
and ``from_array`` functions of :class:`Packer` and :class:`Unpacker`.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import weakref
from dataclasses import dataclass
from multiprocessing import shared_memory, util
from typing import Any, Callable

import numpy as np

__all__ = ["Packer", "Ticket", "Unpacker"]

_ALIGN = 64
_MIN_BYTES = 32 << 10  # batches with less array data than this are not worth a slot


@dataclass(frozen=True)
class Ticket:
    """A batch that waits in a slot: ``tree`` is the batch with each array replaced by
    ``_Leaf(offset, shape, dtype, kind)`` (offsets from the slot's start)."""

    segment: str
    segment_size: int
    slot: int
    slot_bytes: int
    tree: Any
    header: int = 0  # bytes before the first slot (one busy flag per slot)


@dataclass(frozen=True)
class _Leaf:
    offset: int
    shape: tuple
    dtype: str
    kind: str  # "array" or the name the to_array function gave (e.g. "tensor")


def _round(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _Ring:
    """One worker's segment: a header of busy flags, then ``slots`` slots of ``slot_bytes``."""

    def __init__(self, slots: int, slot_bytes: int):
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.header = _round(slots)
        name = f"tarshards-{os.getpid()}-{secrets.token_hex(6)}"
        size = self.header + slots * slot_bytes
        self.shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        self.busy: memoryview | None = self.shm.buf[:slots]  # 0: free, 1: a batch is there
        self.busy[:] = bytes(slots)
        # the name goes when this process exits; the main process keeps its own mapping
        self._finalizer = util.Finalize(self, _unlink, args=(self,), exitpriority=10)

    def take(self) -> int | None:
        """A free slot, marked busy, or ``None``: the first free one, so that the few slots in
        use stay warm in the caches rather than all of them taking turns."""
        busy = self.busy
        if busy is None:  # closed (the process is exiting)
            return None
        for slot in range(self.slots):
            if not busy[slot]:
                busy[slot] = 1
                return slot
        return None


def _unlink(ring) -> None:
    shm = ring.shm
    if ring.busy is not None:
        ring.busy.release()  # the view would keep the mapping from closing
        ring.busy = None
    try:
        shm.unlink()
    except FileNotFoundError:
        pass
    try:
        shm.close()
    except BufferError:  # a view is still alive; the mapping goes with the process
        pass


class Packer:
    """Worker side: ``packer(batch)`` returns a :class:`Ticket` or the batch unchanged.

    ``to_array(x)`` returns ``(ndarray, kind)`` for leaves that should travel through the
    slot (numpy arrays always do), or ``None``. ``slots``: slots per worker ring.
    """

    def __init__(
        self,
        slots: int = 4,
        to_array: Callable[[Any], tuple | None] | None = None,
        min_bytes: int = _MIN_BYTES,
    ):
        if slots < 2:
            raise ValueError(f"a ring needs at least 2 slots, got {slots}")
        self.slots = int(slots)
        self.to_array = to_array
        self.min_bytes = int(min_bytes)
        self._ring: _Ring | None = None
        self._outgrown: list[_Ring] = []  # kept until exit: tickets may still name them

    def __getstate__(self):  # a new process starts without a ring of its own
        state = dict(self.__dict__)
        state["_ring"] = None
        state["_outgrown"] = []
        return state

    def _leaves(self, batch, out: list):
        """Replace arrays by placeholders (their index in ``out``); others stay."""
        if isinstance(batch, np.ndarray):
            if batch.dtype.hasobject:
                return batch
            out.append((batch, "array"))
            return _Placeholder(len(out) - 1)
        if isinstance(batch, tuple):
            items = [self._leaves(x, out) for x in batch]
            if hasattr(batch, "_fields"):  # a namedtuple
                return type(batch)(*items)
            return tuple(items)
        if isinstance(batch, list):
            return [self._leaves(x, out) for x in batch]
        if isinstance(batch, dict):
            return {k: self._leaves(v, out) for k, v in batch.items()}
        if self.to_array is not None:
            converted = self.to_array(batch)
            if converted is not None:
                out.append(converted)
                return _Placeholder(len(out) - 1)
        return batch

    def __call__(self, batch):
        arrays: list = []
        tree = self._leaves(batch, arrays)
        if not arrays:
            return batch
        offsets = []
        total = 0
        for arr, _kind in arrays:
            offsets.append(total)
            total += _round(arr.nbytes)
        if total < self.min_bytes:
            return batch
        ring = self._ring
        if ring is None or ring.slot_bytes < total:
            if ring is not None:
                self._outgrown.append(ring)
            # room for some growth, so that slightly larger batches do not make a new ring
            ring = self._ring = _Ring(self.slots, _round(total + total // 4))
        slot = ring.take()
        if slot is None:  # every slot still holds a batch that someone can see
            return batch
        base = ring.header + slot * ring.slot_bytes
        buf = ring.shm.buf
        leaves = []
        for (arr, kind), offset in zip(arrays, offsets):
            view = np.ndarray(arr.shape, dtype=arr.dtype, buffer=buf, offset=base + offset)
            np.copyto(view, arr, casting="no")
            leaves.append(_Leaf(offset, tuple(arr.shape), arr.dtype.str, kind))
            del view
        tree = _fill(tree, leaves)
        return Ticket(ring.shm.name, ring.shm.size, slot, ring.slot_bytes, tree, ring.header)


@dataclass(frozen=True)
class _Placeholder:
    index: int


def _fill(tree, leaves):
    if isinstance(tree, _Placeholder):
        return leaves[tree.index]
    if isinstance(tree, tuple):
        items = [_fill(x, leaves) for x in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else tuple(items)
    if isinstance(tree, list):
        return [_fill(x, leaves) for x in tree]
    if isinstance(tree, dict):
        return {k: _fill(v, leaves) for k, v in tree.items()}
    return tree


class Unpacker:
    """Main side: ``unpacker(item)`` turns a :class:`Ticket` back into the batch; anything else
    passes through.

    ``copy=True``: the arrays are copied out of the slot into fresh arrays and the slot is free
    at once. ``copy=False``: the arrays are views of the slot (read-write, no copy) and the slot
    is freed when the last of them (and of anything made from them without a copy, such as a
    ``torch.from_numpy`` tensor) is garbage collected. ``from_array(arr, kind)`` turns an
    array of a non-``"array"`` kind back into its type (a tensor). ``alloc(shape, dtype, kind)``
    may give the destination of the copy (e.g. a pinned tensor and its numpy view); it implies
    ``copy=True``.
    """

    def __init__(
        self,
        from_array: Callable[[np.ndarray, str], Any] | None = None,
        alloc: Callable | None = None,
        copy: bool = True,
    ):
        self.from_array = from_array
        self.alloc = alloc
        self.copy = bool(copy) or alloc is not None
        self._segments: dict[str, mmap.mmap] = {}
        self._flags: dict[str, np.ndarray] = {}
        self.tickets = 0  # batches that came through a slot (the others came the usual way)

    def _segment(self, ticket: Ticket):
        buf = self._segments.get(ticket.segment)
        if buf is None:
            buf = self._segments[ticket.segment] = _attach(ticket.segment, ticket.segment_size)
        return buf

    def _busy_flags(self, ticket: Ticket, buf) -> np.ndarray | None:
        if not ticket.header:  # a ring without flags: nothing to release
            return None
        flags = self._flags.get(ticket.segment)
        if flags is None:
            flags = self._flags[ticket.segment] = np.frombuffer(buf, np.uint8, ticket.header)
        return flags

    def __call__(self, item):
        if not isinstance(item, Ticket):
            return item
        self.tickets += 1
        buf = self._segment(item)
        flags = self._busy_flags(item, buf)
        base = item.header + item.slot * item.slot_bytes
        if self.copy:
            try:
                return self._unpack(item.tree, buf, base)
            finally:
                if flags is not None:
                    flags[item.slot] = 0
        # One holder per batch: a ctypes array over the slot's bytes. Every leaf is made with
        # buffer=holder (its .base), so the holder lives exactly as long as any leaf or view of
        # one; and it holds an export of the mapping, which cannot be unmapped under it.
        holder = (ctypes.c_char * item.slot_bytes).from_buffer(buf, base)
        if flags is not None:
            weakref.finalize(holder, _release, flags, item.slot)
        return self._unpack(item.tree, holder, 0)

    def _unpack(self, tree, buf, base):
        if isinstance(tree, _Leaf):
            dtype = np.dtype(tree.dtype)
            src = np.ndarray(tree.shape, dtype=dtype, buffer=buf, offset=base + tree.offset)
            if self.alloc is not None:
                value, dst = self.alloc(tree.shape, dtype, tree.kind)
                np.copyto(dst, src, casting="no")
                return value
            out = src.copy() if self.copy else src
            if tree.kind != "array" and self.from_array is not None:
                return self.from_array(out, tree.kind)
            return out
        if isinstance(tree, tuple):
            items = [self._unpack(x, buf, base) for x in tree]
            return type(tree)(*items) if hasattr(tree, "_fields") else tuple(items)
        if isinstance(tree, list):
            return [self._unpack(x, buf, base) for x in tree]
        if isinstance(tree, dict):
            return {k: self._unpack(v, buf, base) for k, v in tree.items()}
        return tree

    def close(self) -> None:
        """Drop the mappings; one that batches handed out still use stays until they go."""
        segments, self._segments = self._segments, {}
        self._flags = {}
        for mapping in segments.values():
            try:
                mapping.close()
            except BufferError:  # a view is still alive; the mapping goes when it does
                pass


def _release(flags: np.ndarray, slot: int) -> None:
    flags[slot] = 0  # the worker may write this slot again


def _attach(name: str, size: int) -> mmap.mmap:
    """Map a worker's segment without taking ownership of it.

    ``SharedMemory(name)`` would register the name with this process's resource tracker, which
    then warns about a "leak" and tries to remove a name that its owner already removed.
    """
    try:
        import _posixshmem
    except ImportError:  # not POSIX: let SharedMemory do it, and keep the object alive
        shm = shared_memory.SharedMemory(name=name)
        _KEEP.append(shm)
        return shm._mmap
    fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDWR, mode=0o600)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


_KEEP: list = []
