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
array data to be worth it) pass through unchanged too. The segments are made by the worker; the
main process removes a segment's name as soon as it has mapped it (both mappings stay valid
until closed and the last view is gone); a worker that exits removes the names that no ticket
in flight still needs, and :func:`remove_orphans` those whose tickets were dropped (an epoch
broken off); Python's resource tracker removes them if a worker is killed.

Batches travel a few at a time (:class:`Group`: consecutive batches of one worker in one slot,
one ticket, one trip through DataLoader's queues, up to ``group_max`` batches or
``group_bytes`` of arrays): at tens of thousands of samples a second, DataLoader's per-item
machinery (an index sent, a result received, a feeder thread woken on each side) costs a few
percent of the decoding; groups divide it. :class:`~tarshards.torch.WebLoader` hands their
batches out in DataLoader's own order (the workers in turn).

The copy on the worker's side can go too: :meth:`Packer.allocate` hands out an empty array in
the slot the next batch will use, and a stage that makes the batch (the default collation of a
pipeline's last ``batched()``, when :class:`~tarshards.torch.WebLoader` runs it) stacks the
samples' arrays straight into it; the packer finds them already in place and copies only the
rest (labels, say). A decoded sample's pixels are then written once, from the decoder's output
to the memory the trainer reads.

This module needs only numpy; :mod:`tarshards.torch` plugs tensors in through the ``to_array``
and ``from_array`` functions of :class:`Packer` and :class:`Unpacker`.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import secrets
import weakref
from dataclasses import dataclass
from multiprocessing import shared_memory, util
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = ["Group", "Packer", "Ticket", "Unpacker", "new_token", "remove_orphans"]

_ALIGN = 64
_MIN_BYTES = 32 << 10  # batches with less array data than this are not worth a slot
# a worker sends up to _GROUP_MAX consecutive batches as one Group (one slot, one ticket, one
# trip through DataLoader's queues) while together they hold at most _GROUP_BYTES of arrays
_GROUP_BYTES = 8 << 20
_GROUP_MAX = 8


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
    copied: int = 0  # bytes the worker copied into the slot (the rest was made there)


@dataclass(frozen=True)
class _Leaf:
    offset: int
    shape: tuple[int, ...]
    dtype: str
    kind: str  # "array" or the name the to_array function gave (e.g. "tensor")


def _round(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _Ring:
    """One worker's segment: a header of busy flags, then ``slots`` slots of ``slot_bytes``."""

    def __init__(self, slots: int, slot_bytes: int, token: str = "p"):
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.header = _round(slots)
        name = f"tarshards-{token}-{os.getpid()}-{secrets.token_hex(6)}"
        size = self.header + slots * slot_bytes
        self.shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        buf = self.shm.buf
        assert buf is not None  # None only once closed
        self.busy: memoryview | None = buf[:slots]  # 0: free, 1: a batch is there
        self.address = _address(np.frombuffer(buf, np.uint8, 1))  # of the mapping
        self.busy[:] = bytes(slots)
        # the name goes when the main process maps the segment, or when this process exits
        # with no ticket out (see _unlink); the main process keeps its own mapping
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


def _address(arr: np.ndarray) -> int:
    return arr.__array_interface__["data"][0]


def _free(ring: _Ring | None, slot: int) -> None:
    if ring is not None and ring.busy is not None:
        ring.busy[slot] = 0


def _unlink(ring: _Ring) -> None:
    """At exit: remove the segment's name unless a ticket naming it may still be on its way
    (a slot is busy: the main process has not mapped it yet, else it would have removed the
    name already). DataLoader stops a worker as soon as it learns that the worker has run out,
    even while batches of that worker that came early still wait for their turn; the main
    process maps their segment then, or removes it with :func:`remove_orphans` when they never
    come (an epoch broken off)."""
    shm = ring.shm
    in_flight = False
    if ring.busy is not None:
        in_flight = any(ring.busy)
        ring.busy.release()  # the view would keep the mapping from closing
        ring.busy = None
    if not in_flight:
        try:
            shm.unlink()
        except FileNotFoundError:  # the main process mapped it and removed the name
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
        to_array: Callable[[Any], tuple[np.ndarray, str] | None] | None = None,
        min_bytes: int = _MIN_BYTES,
        group_bytes: int = _GROUP_BYTES,
        group_max: int = _GROUP_MAX,
        token: str = "p",
    ):
        if slots < 2:
            raise ValueError(f"a ring needs at least 2 slots, got {slots}")
        self.slots = int(slots)
        self.to_array = to_array
        self.min_bytes = int(min_bytes)
        self.group_bytes = int(group_bytes)
        self.group_max = max(1, int(group_max))
        self.token = token  # in the segments' names
        self._ring: _Ring | None = None
        self._outgrown: list[_Ring] = []  # kept until exit: tickets may still name them
        self._open: int | None = None  # the slot that allocate() fills for the next batch
        self._bump = 0  # its bytes handed out so far
        self._allocated: dict[int, tuple] = {}  # data address -> (offset, shape, dtype)

    def __getstate__(self) -> dict[str, Any]:  # a new process starts without a ring of its own
        state = dict(self.__dict__)
        state["_ring"] = None
        state["_outgrown"] = []
        state["_open"], state["_bump"], state["_allocated"] = None, 0, {}
        return state

    def group_size(self, batch_bytes: int) -> int:
        """How many batches of ``batch_bytes`` of array data travel as one :class:`Group`."""
        return max(1, min(self.group_max, self.group_bytes // max(int(batch_bytes), 1)))

    def allocate(self, shape: tuple[int, ...], dtype: npt.DTypeLike) -> np.ndarray | None:
        """An empty array in the slot that the next batch goes to, for the stage that makes
        the batch's arrays (the stacks of its columns) to write them in place: that batch then
        takes no copy on its way (``None``: no room, or no free slot; the stage makes its array
        as usual). The first allocation makes the ring, sized by it.

        Only for a batch that is handed to this packer before the next one is made, and that
        nothing else keeps: once the main process lets it go, the slot is written again. An
        allocation that the next batch does not hold (whole, in shape and dtype) is copied like
        any other array, and the slot is given back.
        """
        dtype = np.dtype(dtype)
        if dtype.hasobject:
            return None
        nbytes = math.prod(shape) * dtype.itemsize
        ring = self._ring
        if ring is None:
            if nbytes < self.min_bytes:
                return None
            # sized by this first array, with room for the batch's smaller ones (labels), for
            # a group of such batches; a batch with more finds no room, goes to a larger ring
            # once, and sizes that one
            per_batch = nbytes + nbytes // 4 + 4096
            size = _round(per_batch * self.group_size(nbytes))
            ring = self._ring = _Ring(self.slots, size, self.token)
        if self._open is None:
            slot = ring.take()
            if slot is None:
                return None
            self._open, self._bump, self._allocated = slot, 0, {}
        offset = self._bump
        if offset + nbytes > ring.slot_bytes:
            return None
        view = np.ndarray(
            shape,
            dtype=dtype,
            buffer=ring.shm.buf,
            offset=ring.header + self._open * ring.slot_bytes + offset,
        )
        self._bump = offset + _round(nbytes)
        self._allocated[_address(view)] = (offset, tuple(view.shape), dtype)
        return view

    def _in_slot(self, arr: np.ndarray) -> int | None:
        """The offset of ``arr`` in the open slot when it is an array :meth:`allocate` gave
        (whole, unchanged in shape and type), else ``None``."""
        if not self._allocated:
            return None
        found = self._allocated.get(_address(arr))
        if found is None:
            return None
        offset, shape, dtype = found
        if arr.shape != shape or arr.dtype != dtype or not arr.flags.c_contiguous:
            return None
        return offset

    def _leaves(self, batch: Any, out: list[tuple[np.ndarray, str]]) -> Any:
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
            items = [self._leaves(x, out) for x in batch]
            return batch.like(items) if type(batch) is Group else items
        if isinstance(batch, dict):
            return {k: self._leaves(v, out) for k, v in batch.items()}
        if self.to_array is not None:
            converted = self.to_array(batch)
            if converted is not None:
                out.append(converted)
                return _Placeholder(len(out) - 1)
        return batch

    def __call__(self, batch: Any) -> Any:  # a Ticket, or the batch unchanged
        arrays: list[tuple[np.ndarray, str]] = []
        tree = self._leaves(batch, arrays)
        ring, open_slot, bump = self._ring, self._open, self._bump
        placed = [self._in_slot(arr) for arr, _kind in arrays]  # written there by allocate()
        self._open, self._bump, self._allocated = None, 0, {}
        if open_slot is not None:
            assert ring is not None
            if any(p is not None for p in placed):
                offsets: list[int] = []
                total = bump  # the other arrays go after those already there
                for (arr, _kind), p in zip(arrays, placed):
                    if p is None:
                        offsets.append(total)
                        total += _round(arr.nbytes)
                    else:
                        offsets.append(p)
                if total <= ring.slot_bytes:
                    return self._ticket(ring, open_slot, tree, arrays, offsets, placed)
            start = ring.address + ring.header + open_slot * ring.slot_bytes
            if any(start <= _address(arr) < start + ring.slot_bytes for arr, _kind in arrays):
                # allocations (or views of them) without room for the rest: all of it into
                # another slot (of a larger ring where needed) before this one is written again
                ticket = self._copied(tree, arrays, grow=True)
                _free(ring, open_slot)
                return ticket
            _free(ring, open_slot)  # nothing of this batch is there
        if not arrays:
            return batch
        return self._copied(tree, arrays, grow=False) or batch

    def _copied(self, tree: Any, arrays: list[tuple[np.ndarray, str]], grow: bool) -> Ticket | None:
        """The arrays copied into a free slot (``None``: too little data, or no free slot)."""
        offsets: list[int] = []
        total = 0
        for arr, _kind in arrays:
            offsets.append(total)
            total += _round(arr.nbytes)
        if total < self.min_bytes and not grow:
            return None
        ring = self._ring
        if ring is None or ring.slot_bytes < total:
            if ring is not None:
                self._outgrown.append(ring)
            # room for some growth, so that slightly larger batches do not make a new ring
            ring = self._ring = _Ring(self.slots, _round(total + total // 4), self.token)
        slot = ring.take()
        if slot is None and grow:  # the batch is in a slot already: it must go through one
            self._outgrown.append(ring)
            ring = self._ring = _Ring(self.slots, ring.slot_bytes, self.token)
            slot = ring.take()
        if slot is None:  # every slot still holds a batch that someone can see
            return None
        return self._ticket(ring, slot, tree, arrays, offsets, [None] * len(arrays))

    def _ticket(
        self,
        ring: _Ring,
        slot: int,
        tree: Any,
        arrays: list[tuple[np.ndarray, str]],
        offsets: list[int],
        placed: list[int | None],
    ) -> Ticket:
        base = ring.header + slot * ring.slot_bytes
        buf = ring.shm.buf
        leaves: list[_Leaf] = []
        copied = 0
        for (arr, kind), offset, p in zip(arrays, offsets, placed):
            if p is None:
                view = np.ndarray(arr.shape, dtype=arr.dtype, buffer=buf, offset=base + offset)
                np.copyto(view, arr, casting="no")
                del view
                copied += arr.nbytes
            leaves.append(_Leaf(offset, tuple(arr.shape), arr.dtype.str, kind))
        tree = _fill(tree, leaves)
        return Ticket(
            ring.shm.name, ring.shm.size, slot, ring.slot_bytes, tree, ring.header, copied
        )


class Group(list):
    """Consecutive batches of one worker (``worker``: its id) that travel together (one slot,
    one ticket)."""

    def __init__(self, items: Iterable[Any] = (), worker: int | None = None):
        super().__init__(items)
        self.worker = worker

    def __reduce__(self) -> tuple[type[Group], tuple[list[Any], int | None]]:
        return Group, (list(self), self.worker)

    def like(self, items: Iterable[Any]) -> Group:
        return Group(items, self.worker)


@dataclass(frozen=True)
class _Placeholder:
    index: int


def _fill(tree: Any, leaves: list[_Leaf]) -> Any:
    if isinstance(tree, _Placeholder):
        return leaves[tree.index]
    if isinstance(tree, tuple):
        items = [_fill(x, leaves) for x in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else tuple(items)
    if isinstance(tree, list):
        items = [_fill(x, leaves) for x in tree]
        return tree.like(items) if type(tree) is Group else items
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
        alloc: Callable[[tuple[int, ...], np.dtype, str], tuple[Any, np.ndarray]] | None = None,
        copy: bool = True,
    ):
        self.from_array = from_array
        self.alloc = alloc
        self.copy = bool(copy) or alloc is not None
        self._segments: dict[str, mmap.mmap] = {}
        self._flags: dict[str, np.ndarray] = {}
        self.tickets = 0  # batches that came through a slot (the others came the usual way)
        self.copied_bytes = 0  # of their array data, what the workers copied into the slots
        self.slot_bytes = 0  # ... and all of it (the rest was stacked in the slot itself)

    def _segment(self, ticket: Ticket) -> mmap.mmap:
        buf = self._segments.get(ticket.segment)
        if buf is None:
            buf = self._segments[ticket.segment] = _attach(ticket.segment, ticket.segment_size)
        return buf

    def _busy_flags(self, ticket: Ticket, buf: mmap.mmap) -> np.ndarray | None:
        if not ticket.header:  # a ring without flags: nothing to release
            return None
        flags = self._flags.get(ticket.segment)
        if flags is None:
            flags = self._flags[ticket.segment] = np.frombuffer(buf, np.uint8, ticket.header)
        return flags

    def __call__(self, item: Any) -> Any:  # the batch of a Ticket, else item itself
        if not isinstance(item, Ticket):
            return item
        self.tickets += 1
        self.copied_bytes += item.copied
        self.slot_bytes += _nbytes(item.tree)
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

    def _unpack(self, tree: Any, buf: mmap.mmap | ctypes.Array[ctypes.c_char], base: int) -> Any:
        if isinstance(tree, _Leaf):
            dtype = np.dtype(tree.dtype)
            # ignore: a ctypes array is a buffer (numpy's stubs name no Buffer type before 3.12)
            src = np.ndarray(
                tree.shape,
                dtype=dtype,
                buffer=buf,  # type: ignore[arg-type]
                offset=base + tree.offset,
            )
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
            items = [self._unpack(x, buf, base) for x in tree]
            return tree.like(items) if type(tree) is Group else items
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


def _nbytes(tree: Any) -> int:
    if isinstance(tree, _Leaf):
        return math.prod(tree.shape) * np.dtype(tree.dtype).itemsize
    if isinstance(tree, (tuple, list)):
        return sum(_nbytes(x) for x in tree)
    if isinstance(tree, dict):
        return sum(_nbytes(x) for x in tree.values())
    return 0


def _release(flags: np.ndarray, slot: int) -> None:
    flags[slot] = 0  # the worker may write this slot again


def _attach(name: str, size: int) -> mmap.mmap:
    """Map a worker's segment, then remove its name (the mappings of both processes stay):
    nothing else needs it, and a worker that exits with a ticket out leaves the name for this.

    ``SharedMemory(name)`` would register the name with this process's resource tracker, which
    then warns about a "leak"; the worker's registration (the tracker is shared by the
    processes of one program) is withdrawn with the name.
    """
    try:
        import _posixshmem
    except ImportError:  # not POSIX: let SharedMemory do it, and keep the object alive
        shm = shared_memory.SharedMemory(name=name)
        _KEEP.append(shm)
        return shm._mmap  # type: ignore[attr-defined]  # no public handle on the mapping
    path = "/" + name.lstrip("/")
    fd = _posixshmem.shm_open(path, os.O_RDWR, mode=0o600)
    try:
        mapping = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    _remove_name(path)
    return mapping


def _remove_name(path: str) -> None:
    import _posixshmem
    from multiprocessing import resource_tracker

    try:
        _posixshmem.shm_unlink(path)
    except FileNotFoundError:
        return
    resource_tracker.unregister(path, "shared_memory")


def new_token() -> str:
    """A name for one loader's segments (``Packer(token=...)``, :func:`remove_orphans`)."""
    return secrets.token_hex(4)


def remove_orphans(token: str, everything: bool = False) -> int:
    """Remove the segments of ``token`` whose worker has exited and that the main process never
    mapped (tickets dropped with an epoch broken off); the number removed. ``everything``: those
    of running workers too (the loader is gone: no ticket of theirs will be mapped), so that no
    name is left for the resource tracker to call leaked (after an error, say, when the
    workers are stopped at exit without running their own clean-up)."""
    if not token or not os.path.isdir("/dev/shm"):
        return 0
    removed = 0
    prefix = f"tarshards-{token}-"
    for entry in os.listdir("/dev/shm"):
        if not entry.startswith(prefix):
            continue
        try:
            pid = int(entry[len(prefix) :].split("-", 1)[0])
            if everything:
                raise ProcessLookupError
            os.kill(pid, 0)
            continue  # its worker still runs: its tickets may yet come
        except ValueError:
            continue
        except ProcessLookupError:
            pass
        except PermissionError:  # another user's process of that pid: not ours
            continue
        _remove_name("/" + entry)
        removed += 1
    return removed


_KEEP: list[shared_memory.SharedMemory] = []
