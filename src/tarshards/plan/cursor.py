"""The cursor that reads one virtual reader's part of an epoch (the plan: :mod:`tarshards.plan`).

Within a reader the samples pass a shuffle buffer whose generator is seeded from (seed, epoch,
reader). Its state at any output position follows from the position alone: :class:`ReaderStream`
replays the buffer's index arithmetic on sample positions (integers, no data) and then reads only
the samples the buffer holds, seeking to their byte offsets in plain tar shards.
"""

from __future__ import annotations

import bisect
import collections
import hashlib
import itertools
import os
import random
from typing import (
    TYPE_CHECKING,
    Any,
    BinaryIO,
    Callable,
    ContextManager,
    Generator,
    Iterator,
    Protocol,
    Sequence,
    cast,
)

from .._lazy import LazyModule
from ..errors import ResumeError, TarshardsError
from ..format.compression import inflated_from
from ..format.names import group_run, group_samples
from ..storage.paths import is_local
from ..storage.seek import read_exact, sample_from_bytes
from ..tario import decompressed_chunks, iter_tar_batches, read_chunks, tar_byte_source
from ..tario.buffer import DirectFile, direct_local, map_local
from ..tario.reader import plain_run
from .epoch import (
    REMAINDERS,
    STATE_FORMAT,
    EpochPlan,
    PlanConfig,
    Schedule,
    ShardTable,
    check_state,
    plan_for,
    scan_shards,
)

if TYPE_CHECKING:  # (imported where a loader counts)
    from ..stats import Counters

try:  # optional C accelerator (_speedups, see _c/); ShuffleCore._run is the reference
    from .._speedups import ShuffleRun as _ShuffleRun
except ImportError:  # pragma: no cover - without the extension
    _ShuffleRun = None

try:  # the samples of a local plain file read and grouped in C (see read.reading)
    from .._speedups import SampleScan as _SampleScan
except ImportError:  # pragma: no cover - without the extension, or without pread
    _SampleScan = None

np = LazyModule("numpy", globals(), "np")

__all__ = [
    "EpochPlan",
    "PlanConfig",
    "REMAINDERS",
    "ReaderStream",
    "STATE_FORMAT",
    "Schedule",
    "ShardTable",
    "ShuffleCore",
    "check_state",
    "plan_for",
    "read_rows",
    "reader_rng",
    "scan_shards",
]

# ---------------------------------------------------------------------------------------------
# the shuffle buffer, written once for sample positions and for samples
# ---------------------------------------------------------------------------------------------


class ClosingIterator(Protocol):
    """An iterator with ``close()``: a generator, or the C loop of ``_speedups.ShuffleRun``."""

    def __iter__(self) -> Iterator[Any]: ...

    def __next__(self) -> Any: ...

    def close(self) -> None: ...


_END = object()
CHUNK_BYTES = 1 << 17  # a reader's read size: a dozen readers' buffers stay in the CPU caches
_LIST_SAMPLES = 64  # samples handed on in one list (when no batch size aligns the lists)
_MIN_LIST = 16  # the fewest samples in one list: a small batch size's lists hold several batches
# a resume reads the samples a shuffle buffer held in runs, reading through gaps of up to this
# many samples between wanted ones (a mapped file: a run costs less, so the gaps are shorter)
_READ_THROUGH = 16
_READ_THROUGH_MAPPED = 4


class ShuffleCore:
    """A shuffle buffer whose whole state is (buffer, generator, input consumed, phase).

    :meth:`run` is the one implementation: it is run over integers (positions) to find the
    state at any output position, and over samples to produce the stream. ``run`` resumes from
    the state the object holds, so a core prepared by a replay continues exactly. Over samples
    (``prefetch=True``) the C loop of ``_speedups.ShuffleRun`` runs where it is built: the same
    outputs from the same draws, each pick handed on a few outputs after it was drawn while its
    objects are fetched into the CPU cache (a buffer of many samples has long let them go cold).
    """

    __slots__ = ("_c", "_emitted", "_tail", "buf", "bufsize", "initial", "rng")

    def __init__(self, bufsize: int, initial: int | None, rng: random.Random):
        self.bufsize = bufsize
        self.initial = bufsize if initial is None else max(1, min(initial, bufsize))
        self.rng = rng
        self.buf: list = []
        self._emitted = 0
        self._tail = -1  # >= 0: the input ended, buf is shuffled, next output is buf[tail]
        self._c: Any = None  # the C loop running over the samples, which keeps the counts

    @property
    def emitted(self) -> int:
        return self._emitted if self._c is None else self._c.emitted

    @property
    def tail(self) -> int:
        return self._tail if self._c is None else self._c.tail

    @property
    def consumed(self) -> int:
        held = len(self.buf) + (0 if self._c is None else self._c.held)
        if self.tail >= 0:
            return self.emitted + held - self.tail
        return self.emitted + held

    def run(self, it: Iterator, prefetch: bool = False) -> ClosingIterator:
        if prefetch and _ShuffleRun is not None and type(self.rng) is random.Random:
            if self._c is not None:
                raise RuntimeError("ShuffleCore.run: the core already runs")
            self._c = _ShuffleRun(
                self.buf,
                it,
                self.rng.getrandbits,
                self.rng.shuffle,
                self.bufsize,
                self.initial,
                self._emitted,
                self._tail,
            )
            return self._c
        return self._run(it)

    def _run(self, it: Iterator) -> Generator[Any, None, None]:
        buf = self.buf
        if self._tail < 0:
            bufsize, initial = self.bufsize, self.initial
            randrange = self.rng.randrange
            for sample in it:
                buf.append(sample)
                if len(buf) < bufsize:
                    nxt = next(it, _END)  # grow two at a time while filling
                    if nxt is not _END:
                        buf.append(nxt)
                if len(buf) >= initial:
                    i = randrange(len(buf))
                    buf[i], buf[-1] = buf[-1], buf[i]
                    self._emitted += 1
                    yield buf.pop()
            self.rng.shuffle(buf)
            self._tail = 0
        while self._tail < len(buf):
            x = buf[self._tail]
            buf[self._tail] = None
            self._tail += 1
            self._emitted += 1
            yield x

    def replay(self, total: int, outputs: int) -> None:
        """Advance over positions ``0..total-1`` until ``outputs`` have come out (no data)."""
        gen = self._run(iter(range(total)))
        before = self.emitted
        collections.deque(itertools.islice(gen, outputs), maxlen=0)  # consumed at C speed
        gen.close()
        if self.emitted - before < outputs:
            raise ResumeError(f"shuffle replay: {outputs} outputs asked of {total} inputs")

    def positions(self) -> list[int]:
        """The positions the buffer holds (after :meth:`replay`), in buffer order."""
        return list(self.buf if self.tail < 0 else self.buf[self.tail :])


def reader_rng(seed: int, epoch: int, reader: int) -> random.Random:
    text = f"reader-shuffle/{seed}/{epoch}/{reader}".encode()
    return random.Random(int.from_bytes(hashlib.sha256(text).digest()[:8], "big"))


# ---------------------------------------------------------------------------------------------
# reading a reader's segment
# ---------------------------------------------------------------------------------------------


class ReaderStream:
    """The raw samples (dicts of bytes) one virtual reader yields in one epoch, in shuffled
    order, from any output position: the cursor over the plan.

    ``seek(p)`` positions it at output ``p`` (0 <= p <= q B): without a shuffle buffer it opens
    the segment at ``p``; with one it replays the buffer on positions, reads the buffered
    samples by their offsets, and continues reading at the input position reached.

    Samples are read in *lists*, cut at the segment positions that are multiples of ``unit``
    (the batch size: a list is one batch, or a few batches of a small one). From a local plain
    tar whose sample offsets are known the shard's run is mapped once, and each list is parsed
    afresh from its own byte range, to its end: when a list is handed on, nothing of it stays
    behind (no member tuples, no sample waiting for its next member). A list of plain members
    is read and grouped in two C calls (:func:`~tarshards.tario.reader.plain_run`,
    :func:`~tarshards.format.names.group_run`; a generator per list and a frame per sample cost the
    planned path 6-7 % of the raw rate against the plain pipeline). Otherwise the shard is
    streamed (read ``chunk_bytes`` at a time) and cut into lists. Without a shuffle buffer
    :meth:`take` hands a whole list on as it is and keeps no reference to what it handed on.

    This is what makes many readers interleaved cost what one reader costs: a reader that
    kept the last turn's samples alive until its next turn (a dozen turns later) made every
    batch allocate memory that had gone cold in the CPU caches, and free cold objects.
    Nothing here costs a Python frame per sample: lists are made and sliced at C speed.
    """

    def __init__(
        self,
        table: ShardTable,
        plan: EpochPlan,
        reader: int,
        *,
        opener: Callable[[str], ContextManager[BinaryIO]],
        # (url, offset, length or None) -> that byte range of the shard
        range_opener: Callable[[str, int, int | None], ContextManager[BinaryIO]] | None = None,
        last_dot: bool = False,
        chunk_bytes: int = CHUNK_BYTES,
        unit: int = _LIST_SAMPLES,
        stats: Counters | None = None,
        verify: bool = False,
    ):
        self.table = table
        # a view's rows: each sample read checked against its index's member checksums
        self.verify = verify
        self.stats = stats  # a loader's counters: the runs' opens and bytes go there
        self.plan = plan
        self.reader = reader
        self.opener = opener
        # (url, offset, length or None) -> a stream of that byte range: remote shards are then
        # read from a sample's offset (an HTTP/object-store range) instead of from their start
        self.range_opener = range_opener
        self.last_dot = last_dot
        self.chunk_bytes = chunk_bytes
        unit = max(1, int(unit))
        self.unit = unit * -(-_MIN_LIST // unit)  # the samples in a list (between two cuts)
        self.position = 0
        self._it: Iterator | None = None  # with a shuffle buffer: what comes out of it
        self._lists: Iterator[list[dict]] | None = None  # without one: the segment's lists
        self._cur: list[dict] = []  # the list being taken from
        self._open: list[ClosingIterator] = []  # what close() closes

    def seek(self, position: int) -> None:
        plan, cfg = self.plan, self.plan.config
        if not 0 <= position <= plan.segment_length:
            raise ValueError(f"position {position} outside reader segment of {plan.segment_length}")
        self.close()
        self.position = position
        if cfg.bufsize <= 1:
            lists = self.chunks(position)
            self._open.append(lists)
            self._lists = lists
            return
        core = ShuffleCore(cfg.bufsize, cfg.initial, reader_rng(cfg.seed, plan.epoch, self.reader))
        if position:
            core.replay(plan.segment_length, position)
            held = core.positions()
            samples = self.read_positions(held)
            if core.tail >= 0:
                core.buf[core.tail :] = [samples[p] for p in held]
            else:
                core.buf[:] = [samples[p] for p in held]
        run = core.run(self.read_from(core.consumed), prefetch=True)
        self._open.append(run)
        self._it = run

    def take(self, n: int) -> list[dict]:
        """The next ``n`` samples (a list: one batch's worth is taken at C speed)."""
        if self._it is None and self._lists is None:
            self.seek(self.position)
        if self._it is not None:
            got = list(itertools.islice(self._it, n))
        else:
            got = self._take_lists(n)
        self.position += len(got)
        if len(got) < n:
            raise TarshardsError(
                f"reader {self.reader} of epoch {self.plan.epoch} ran out at position "
                f"{self.position} of {self.plan.segment_length}: the shards changed since "
                "they were counted",
                url=None,
            )
        return got

    def _take_lists(self, n: int) -> list[dict]:
        """The next ``n`` samples from the segment's lists (fewer at its end). A list taken
        whole is handed on itself; what is taken of a list leaves it (nothing handed on is
        kept here)."""
        got: list[dict] = []
        lists = self._lists
        while len(got) < n:
            cur = self._cur
            if not cur:
                cur = self._cur = next(lists, None) or []  # type: ignore[arg-type]
                if not cur:
                    break
            want = n - len(got)
            if not got and len(cur) == want:
                self._cur = []
                return cur
            got += cur[:want]
            del cur[:want]
        return got

    def skip(self, n: int) -> None:
        self.take(n)

    def close(self) -> None:
        for gen in reversed(self._open):
            gen.close()
        self._open.clear()
        self._it = self._lists = None
        self._cur = []

    # ---- reading ---------------------------------------------------------------------------
    def read_from(self, position: int) -> Iterator[dict]:
        """The segment's samples in list order from ``position`` on (closed by :meth:`close`)."""
        chunks = self.chunks(position)
        self._open.append(chunks)
        return itertools.chain.from_iterable(chunks)

    def chunks(self, position: int = 0) -> Generator[list[dict], None, None]:
        """The segment's samples in list order from ``position`` on, in lists cut at the
        segment positions that are multiples of :attr:`unit` (and where a shard's run ends)."""
        at = position
        for shard, a, b, pad in self.plan.segment_runs(self.reader, position):
            yield from self._shard_chunks(shard, a, b, pad, at)
            at += b - a

    def _shard_chunks(
        self, shard: int, a: int, b: int, pad: bool, at: int = 0
    ) -> Iterator[list[dict]]:
        """Samples ``a:b`` of one shard (sample ``a`` at segment position ``at``) in lists. In a
        plain tar whose sample offsets are known the read starts at sample ``a`` (a seek, or
        bytes dropped unparsed) and stops at the end of sample ``b - 1``; otherwise the first
        ``a`` samples are parsed and dropped."""
        if self.table.rows[shard] is not None:  # a view: only the rows it keeps are read
            yield from self._view_chunks(shard, a, b, pad, at)
            return
        table = self.table
        url = table.urls[shard]
        offsets = table.sample_offsets(shard) if table.plain[shard] else None
        # a sample-aligned compressed shard: decompression starts at sample a's frame or
        # flush point (instead of decompressing and dropping the first a samples)
        points = table.seek_points(shard) if offsets is None and a > 0 else None
        want = b - a
        size, skip, begin = -1, a, 0
        if offsets is not None:
            begin = int(offsets[a]) if 0 < a < len(offsets) else 0
            skip = 0
            if b < len(offsets):  # stop reading where the run ends
                size = int(offsets[b]) - begin
        elif points is not None and a < len(points[0]):
            begin = int(points[0][a])
            skip = 0
        else:
            points = None
        known = offsets is not None or points is not None
        ranged = self._ranged(url) and known and (begin > 0 or size >= 0)
        stats, counted = self.stats, None
        if stats is not None:
            from ..stats import CountedStream, clock

            t0 = clock()
        try:
            with (
                self.range_opener(url, begin, size if size >= 0 else None)  # type: ignore[misc]
                if ranged
                else self.opener(url)
            ) as stream:
                if stats is not None:
                    stats.opened(url, begin, clock() - t0)
                origin = 0  # where the read starts in the tar stream (samples' __offset__)
                if offsets is not None and begin:
                    if not ranged and not _seek(stream, begin):
                        _discard(stream, begin, url)
                    origin = begin
                # a local file is read with pread, its samples by the C scan (as the plain path
                # reads copies), the reference from the first sample it declines
                direct = (
                    direct_local(stream, size)
                    if offsets is not None and _SampleScan is not None
                    else None
                )
                if direct is not None:
                    if stats is not None:  # the run's bytes
                        stats.shard_done(url, direct.stop - direct.pos, 0, b - a)
                    yield from self._scanned_lists(direct, url, offsets, a, b, pad, at)
                    return
                # else mapped from the run's first byte to its last (parsed in place, as the
                # plain path does); other streams are read through a window
                src: Any = map_local(stream, size) if offsets is not None else None
                if src is not None:
                    if stats is not None:  # the run's bytes, read in place
                        stats.shard_done(url, src.stop - src.start, 0, b - a)
                    try:
                        yield from self._mapped_lists(src, url, offsets, a, b, pad, at)
                    finally:
                        src.close()
                    return
                if stats is not None:
                    stream = counted = CountedStream(stream, stats, url, begin)
                # cast: a stream as far as the readers of chunks go (readinto, read)
                window = cast(BinaryIO, _Window(stream, size, self.chunk_bytes))
                if points is not None:
                    if not ranged and not _seek(stream, begin):
                        _discard(stream, begin, url)
                    origin = int(points[1][a])
                    src = resumed_chunks(window, points[2], url, begin, self.chunk_bytes)
                else:
                    src = tar_byte_source(window, url, self.chunk_bytes, mapped=False)
                batches = iter_tar_batches(src, url, offset=origin, chunk_size=self.chunk_bytes)
                groups = group_samples(batches, url, last_dot=self.last_dot, batched=True)
                if skip:
                    next(itertools.islice(groups, skip - 1, skip), None)
                n, unit = 0, self.unit
                while n < want:
                    k = min(want - n, unit - (at + n) % unit)
                    chunk = list(itertools.islice(groups, k))
                    if not chunk:
                        break
                    _flag(chunk, pad)
                    n += len(chunk)
                    yield chunk
                if n == want:
                    return
        except TarshardsError as exn:
            raise exn.with_context(url=url) from None
        finally:
            if counted is not None:
                counted.done(b - a)
        raise TarshardsError(
            f"shard has fewer samples than the {table.counts[shard]} counted (wanted {a}:{b})",
            url=url,
        )

    def _check(self, shard: int, positions, samples: list) -> None:
        """``samples`` (at ``positions`` among a view's rows of ``shard``) against the member
        checksums of the shard's index."""
        idx = self.table.manifest.load_index(shard)
        sel = self.table.rows[shard]
        url = self.table.urls[shard]
        for p, sample in zip(positions, samples):
            idx.check_sample(sample, int(p) if sel is None else int(sel[p]), url)

    def _view_chunks(self, shard: int, a: int, b: int, pad: bool, at: int):
        """Samples ``a:b`` of a view's shard (the rows it keeps, read by byte ranges) in lists
        cut at the segment positions that are multiples of :attr:`unit`."""
        samples = itertools.chain.from_iterable(
            read_rows(
                self.table,
                shard,
                np.arange(a, b),
                opener=self.opener,
                range_opener=self.range_opener,
                last_dot=self.last_dot,
                stats=self.stats,
            )
        )
        n, unit, want = 0, self.unit, b - a
        while n < want:
            k = min(want - n, unit - (at + n) % unit)
            chunk = list(itertools.islice(samples, k))
            if not chunk:
                break
            if self.verify:
                self._check(shard, range(a + n, a + n + len(chunk)), chunk)
            _flag(chunk, pad)
            n += len(chunk)
            yield chunk

    def _scanned_lists(
        self, src: DirectFile, url: str, offsets, a: int, b: int, pad: bool, at: int
    ):
        """Samples ``a:b`` of a local plain shard (``src``: the run's bytes, read with pread) in
        lists as :meth:`_mapped_lists` cuts them, read and grouped by the C sample scan one
        sample at a time while each list starts where the index says; from the first list it
        does not take whole, :meth:`_mapped_lists` (which reads the rest and reports damage or a
        changed shard)."""
        unit = self.unit
        start = src.pos
        # its buffer at most a quarter of the reader's read size: many readers take turns
        scan = _SampleScan(src.fd, start, src.stop, url, self.last_dot, 0, self.chunk_bytes // 4)
        i = a
        while i < b:
            j = min(b, i + unit - (at + i - a) % unit)
            got = list(itertools.islice(scan, j - i))
            lo = start if i == a else int(offsets[i])
            if len(got) != j - i or (i > a and got[0]["__offset__"] != lo):
                del got
                src.stream.seek(lo)
                whole = map_local(src.stream, src.stop - lo)
                if whole is None:  # (it was a local plain file a moment ago)
                    raise TarshardsError("the shard changed while it was read", url=url)
                try:
                    yield from self._mapped_lists(whole, url, offsets, i, b, pad, at + i - a)
                finally:
                    whole.close()
                return
            _flag(got, pad)
            i = j
            yield got

    def _mapped_lists(self, src, url: str, offsets, a: int, b: int, pad: bool, at: int):
        """Samples ``a:b`` of a mapped plain shard (``src``: the run's bytes) in lists, each
        parsed from its own byte range to its end (see the class notes)."""
        unit, n, last_dot = self.unit, len(offsets), self.last_dot
        i = a
        while i < b:
            j = min(b, i + unit - (at + i - a) % unit)
            lo = src.start if i == a else int(offsets[i])
            hi = int(offsets[j]) if j < n else src.stop
            # plain members up to the next sample's offset: one C call to read them, one to
            # group them (no generator per list, no frame per sample); the general path for the
            # rest (the shard's last list, which ends at the end-of-archive blocks; pax
            # headers; damage, which it reports)
            members = plain_run(src.map, lo, hi) if j < n else None
            got = None if members is None else group_run(members, url, last_dot)
            del members
            if got is None:
                batches = iter_tar_batches(src.part(lo, hi), url, offset=lo, chunk_size=hi - lo)
                got = list(group_samples(batches, url, last_dot=last_dot, batched=True))
            if len(got) != j - i:
                how = "fewer" if len(got) < j - i else "more"
                raise TarshardsError(
                    f"shard has {how} samples than counted: {len(got)} between the offsets of "
                    f"samples {i} and {j} (the shard changed since it was indexed)",
                    url=url,
                    offset=lo,
                )
            _flag(got, pad)
            src.release(hi)
            i = j
            yield got

    def read_positions(self, positions: Sequence[int]) -> dict[int, dict]:
        """The samples at some positions of this reader's segment, by position (a sample at
        two positions, as padding repeats it, is read once and copied)."""
        ps = sorted(positions)
        per_shard: dict[int, list[tuple[int, int, bool]]] = {}  # (index, position, pad)
        i, start = 0, 0  # the next position to place; the segment position of the run's start
        for shard, a, b, pad in self.plan.segment_runs(self.reader):
            end = start + b - a
            j = bisect.bisect_left(ps, end, i)
            if j > i:
                shift = a - start
                per_shard.setdefault(shard, []).extend([(shift + p, p, pad) for p in ps[i:j]])
                i = j
                if i == len(ps):
                    break
            start = end
        if i < len(ps):
            raise ValueError(f"position {ps[i]} outside reader segment of {start}")
        out: dict[int, dict] = {}
        for shard, wanted in per_shard.items():
            wanted.sort()
            idxs = list(dict.fromkeys(w[0] for w in wanted))
            got = dict(itertools.chain.from_iterable(self._read_samples(shard, idxs)))
            prev = -1
            for idx, p, pad in wanted:
                sample = got[idx] if idx != prev else dict(got[idx])  # held twice: a copy
                sample["__pad__"] = pad
                out[p] = sample
                prev = idx
        return out

    def _read_samples(self, shard: int, idxs: list[int]) -> Iterator[list[tuple[int, dict]]]:
        """The samples ``idxs`` (sorted) of one shard, as lists of ``(index, sample)``."""
        if self.table.rows[shard] is not None:  # a view: its rows, by byte ranges
            got = itertools.chain.from_iterable(
                read_rows(
                    self.table,
                    shard,
                    idxs,
                    opener=self.opener,
                    range_opener=self.range_opener,
                    last_dot=self.last_dot,
                )
            )
            pairs = list(zip(idxs, got))
            if self.verify:
                self._check(shard, [i for i, _ in pairs], [s for _, s in pairs])
            yield pairs
            return
        table = self.table
        url = table.urls[shard]
        offsets = table.sample_offsets(shard)
        if offsets is not None and table.plain[shard] and self._ranged(url):
            yield from self._read_span(url, offsets, idxs)
            return
        points = table.seek_points(shard) if offsets is None else None
        try:
            with self.opener(url) as stream:
                if points is not None and _seekable(stream):
                    # a sample-aligned compressed shard: each sample decompressed alone
                    yield from self._read_entered(stream, url, points, idxs)
                    return
                if offsets is not None and table.plain[shard] and _seekable(stream):
                    # one read per run of nearby samples (gaps of a few samples read through); a
                    # local file is mapped once and each run parsed in place
                    stream.seek(0)
                    whole = map_local(stream)
                    try:
                        yield from self._read_runs(stream, whole, url, offsets, idxs)
                    finally:
                        if whole is not None:
                            whole.close()
                    return
                want = set(idxs)
                last = idxs[-1]
                batches = iter_tar_batches(tar_byte_source(stream, url, direct=True), url)
                for i, sample in enumerate(
                    group_samples(batches, url, last_dot=self.last_dot, batched=True)
                ):
                    if i in want:
                        yield [(i, sample)]
                    if i >= last:
                        return
        except TarshardsError as exn:
            raise exn.with_context(url=url) from None
        raise TarshardsError("shard has fewer samples than counted", url=url)

    def _read_entered(self, stream, url: str, points, idxs: list[int]):
        """Samples ``idxs`` of a sample-aligned compressed shard, each read from its frame or
        flush point to its end and decompressed alone."""
        starts, tar_offsets, entry, ends = points
        compression = "gzip" if entry == "deflate" else "any"
        for i in idxs:
            begin, end = int(starts[i]), int(ends[i])
            stream.seek(begin)
            data = read_exact(stream, end - begin, url, begin)
            sample = sample_from_bytes(
                data,
                int(tar_offsets[i]),
                compression=compression,
                url=url,
                last_dot=self.last_dot,
                offset=begin,
                entry=entry,
            )
            yield [(i, sample)]

    def _ranged(self, url: str) -> bool:
        return self.range_opener is not None and not is_local(url)

    def _read_span(self, url: str, offsets, idxs: list[int]) -> Iterator[list[tuple[int, dict]]]:
        """The samples ``idxs`` (sorted) of a remote plain shard: one ranged read from the first
        one's offset to the end of the last one, parsed in order."""
        lo, hi = idxs[0], idxs[-1]
        begin = int(offsets[lo])
        length = int(offsets[hi + 1]) - begin if hi + 1 < len(offsets) else None
        want = set(idxs)
        try:
            with self.range_opener(url, begin, length) as stream:  # type: ignore[misc]
                batches = iter_tar_batches(
                    tar_byte_source(stream, url, self.chunk_bytes, mapped=False),
                    url,
                    offset=begin,
                    chunk_size=self.chunk_bytes,
                )
                groups = group_samples(batches, url, last_dot=self.last_dot, batched=True)
                for i, sample in enumerate(groups, lo):
                    if i in want:
                        yield [(i, sample)]
                    if i >= hi:
                        return
        except TarshardsError as exn:
            raise exn.with_context(url=url) from None
        raise TarshardsError(
            f"samples {lo}..{hi} not found at offset {begin}", url=url, offset=begin
        )

    def _read_runs(self, stream, whole, url, offsets, idxs: list[int]):
        gap = _READ_THROUGH if whole is None else _READ_THROUGH_MAPPED
        runs, start = [], 0
        for k in range(1, len(idxs) + 1):
            if k == len(idxs) or idxs[k] - idxs[k - 1] > gap:
                runs.append(idxs[start:k])
                start = k
        n = len(offsets)
        for run in runs:
            lo, hi = run[0], run[-1]
            begin = int(offsets[lo])
            stop = int(offsets[hi + 1]) if hi + 1 < n else None
            src: Any
            if whole is not None:
                src = whole.part(begin, stop)
            else:
                stream.seek(begin)
                src = [stream.read(stop - begin) if stop else stream.read()]
            batches = iter_tar_batches(src, url, offset=begin, chunk_size=self.chunk_bytes)
            groups = group_samples(batches, url, last_dot=self.last_dot, batched=True)
            got = list(itertools.islice(groups, hi + 1 - lo))
            groups.close()
            if len(got) != hi + 1 - lo:
                raise TarshardsError(
                    f"samples {lo}..{hi} not found at offset {begin}", url=url, offset=begin
                )
            yield [(i, got[i - lo]) for i in run]


# ---------------------------------------------------------------------------------------------
# reading the rows a view keeps
# ---------------------------------------------------------------------------------------------

_RUN_SAMPLES = 64  # the most samples read in one piece (a run of adjacent rows is cut there)


def read_rows(
    table: ShardTable,
    shard: int,
    positions,
    *,
    opener: Callable[[str], ContextManager[BinaryIO]],
    range_opener: Callable[[str, int, int | None], ContextManager[BinaryIO]] | None = None,
    last_dot: bool = False,
    stats: Counters | None = None,
) -> Iterator[list[dict]]:
    """The samples at ``positions`` (sorted; positions among the rows the table's view keeps of
    shard ``shard``, or among all its rows) of one shard, in lists, reading only their bytes.

    In a plain shard whose sample offsets are known (its index), adjacent rows are read
    together, each run of them as one byte range (a seek and a read in a local file, one ranged
    request through ``range_opener`` for a remote one), from the first sample's offset to the
    next sample's; a sample-aligned compressed shard reads and decompresses each sample from its
    frame or flush point; any other shard is read from its start and the rows picked out.
    """
    url = table.urls[shard]
    pos = np.asarray(positions, dtype=np.int64)
    if not len(pos):
        return
    sel = table.rows[shard]
    want = pos if sel is None else np.asarray(sel)[pos]
    offsets = table.sample_offsets(shard) if table.plain[shard] else None
    try:
        if offsets is not None:
            yield from _read_plain_rows(url, offsets, want, opener, range_opener, last_dot, stats)
            return
        points = table.seek_points(shard)
        with opener(url) as stream:
            if points is not None and _seekable(stream):
                yield from _read_entered_rows(stream, url, points, want, last_dot)
                return
            # read through: the shard from its start, the rows picked out
            keep = set(want.tolist())
            last = int(want[-1])
            got: list[dict] = []
            batches = iter_tar_batches(tar_byte_source(stream, url, direct=True), url)
            for i, sample in enumerate(
                group_samples(batches, url, last_dot=last_dot, batched=True)
            ):
                if i in keep:
                    got.append(sample)
                    if len(got) >= _RUN_SAMPLES:
                        yield got
                        got = []
                if i >= last:
                    if got:
                        yield got
                    return
    except TarshardsError as exn:
        raise exn.with_context(url=url) from None
    raise TarshardsError(
        f"shard has fewer samples than the view's rows (row {int(want[-1])} wanted)", url=url
    )


def _row_runs(want, n_max: int = _RUN_SAMPLES) -> list[tuple[int, int]]:
    """``[(first row, last row + 1)]``: the runs of adjacent rows of ``want`` (sorted), each of
    at most ``n_max`` rows."""
    brk = np.flatnonzero(np.diff(want) != 1) + 1
    firsts = want[np.concatenate([[0], brk])].tolist()
    lasts = (want[np.concatenate([brk - 1, [len(want) - 1]])] + 1).tolist()
    out = []
    for lo, hi in zip(firsts, lasts):
        while hi - lo > n_max:
            out.append((lo, lo + n_max))
            lo += n_max
        out.append((lo, hi))
    return out


_RANGE_GAP = 1 << 12  # remote runs this close (bytes) are fetched in one request
_RANGE_MAX = 1 << 23  # the most bytes one request of merged runs asks for


def _fetches(runs: list[tuple[int, int]], offsets) -> list[list[tuple[int, int]]]:
    """``runs`` grouped into ranged requests: a run joins the previous request where the bytes
    between them are at most ``_RANGE_GAP`` and the request stays under ``_RANGE_MAX`` (a
    request per sample costs a round trip each; a few KB read through cost less)."""
    n = len(offsets)
    out: list[list[tuple[int, int]]] = []
    for lo, hi in runs:
        if out:
            prev = out[-1]
            first, end = int(offsets[prev[0][0]]), prev[-1][1]
            if (
                end < n
                and hi < n
                and int(offsets[lo]) - int(offsets[end]) <= _RANGE_GAP
                and int(offsets[hi]) - first <= _RANGE_MAX
            ):
                prev.append((lo, hi))
                continue
        out.append([(lo, hi)])
    return out


def _parse_rows(data, url: str, begin: int, lo: int, hi: int, last_dot: bool) -> list[dict]:
    """Samples ``lo..hi-1`` parsed from ``data``, the shard's bytes from sample ``lo``'s offset
    ``begin`` (to the next sample's, or to the end of the shard)."""
    # plain members that end where the next sample starts: read and grouped in two C calls
    members = plain_run(data, 0, len(data))
    fast = None if members is None else group_run(members, url, last_dot)
    if fast is not None and len(fast) == hi - lo:
        if begin:
            for sample in fast:
                sample["__offset__"] += begin
        return fast
    batches = iter_tar_batches([data], url, offset=begin, chunk_size=max(1, len(data)))
    groups = group_samples(batches, url, last_dot=last_dot, batched=True)
    got = list(itertools.islice(groups, hi - lo))
    groups.close()
    if len(got) != hi - lo:
        raise TarshardsError(
            f"samples {lo}..{hi - 1} not found at offset {begin} (the shard changed since it "
            "was indexed)",
            url=url,
            offset=begin,
        )
    return got


def _read_plain_rows(url, offsets, want, opener, range_opener, last_dot, stats):
    n = len(offsets)
    runs = _row_runs(want)
    ranged = range_opener is not None and not is_local(url)
    nbytes, t0 = 0, 0
    if stats is not None:
        from ..stats import clock

        t0 = clock()
    if ranged:
        for k, fetch in enumerate(_fetches(runs, offsets)):
            begin = int(offsets[fetch[0][0]])
            last = fetch[-1][1]
            length = int(offsets[last]) - begin if last < n else None
            with range_opener(url, begin, length) as stream:
                if stats is not None and k == 0:
                    stats.opened(url, begin, clock() - t0)
                data = stream.read()
            nbytes += len(data)
            for lo, hi in fetch:  # each run's bytes of the request
                a = int(offsets[lo]) - begin
                b = int(offsets[hi]) - begin if hi < n else len(data)
                part = data if len(fetch) == 1 else data[a:b]
                yield _parse_rows(part, url, begin + a, lo, hi, last_dot)
    else:
        with opener(url) as stream:
            if stats is not None:
                stats.opened(url, int(offsets[runs[0][0]]), clock() - t0)
            seekable = _seekable(stream)
            ahead = _Readahead(stream, offsets, runs) if seekable else None
            at = 0
            for k, (lo, hi) in enumerate(runs):
                if ahead is not None:
                    ahead.advise(k)
                begin = int(offsets[lo])
                length = int(offsets[hi]) - begin if hi < n else -1
                if seekable:
                    stream.seek(begin)
                else:
                    _discard(stream, begin - at, url)
                data = read_exact(stream, length, url, begin) if length >= 0 else stream.read()
                at = begin + len(data)
                nbytes += len(data)
                yield _parse_rows(data, url, begin, lo, hi, last_dot)
    if stats is not None:
        stats.shard_done(url, nbytes, 0, len(want))


_AHEAD_BYTES = 1 << 25  # a local view's runs announced to the kernel this far ahead


class _Readahead:
    """Tell the kernel which byte ranges of a local file the next runs will read
    (``POSIX_FADV_WILLNEED``): it fetches them in parallel, where reading one run after the
    other from a disk would wait for each (the page cache's own readahead serves sequential
    reads only). Does nothing where the stream has no file descriptor."""

    def __init__(self, stream, offsets, runs):
        self.fd = None
        if hasattr(os, "posix_fadvise"):
            try:
                self.fd = stream.fileno()
            except (AttributeError, OSError, ValueError):
                self.fd = None
        self.offsets, self.runs, self.next = offsets, runs, 0

    def advise(self, k: int) -> None:
        if self.fd is None or self.next > k + 8:
            return
        offsets, runs, n = self.offsets, self.runs, len(self.offsets)
        budget = _AHEAD_BYTES
        while self.next < len(runs) and budget > 0:
            lo, hi = runs[self.next]
            begin = int(offsets[lo])
            length = int(offsets[hi]) - begin if hi < n else 0
            try:
                os.posix_fadvise(self.fd, begin, length, os.POSIX_FADV_WILLNEED)
            except OSError:
                self.fd = None
                return
            budget -= length or _AHEAD_BYTES
            self.next += 1


def _read_entered_rows(stream, url: str, points, want, last_dot: bool):
    """Rows ``want`` of a sample-aligned compressed shard, each decompressed alone."""
    starts, tar_offsets, entry, ends = points
    compression = "gzip" if entry == "deflate" else "any"
    got: list[dict] = []
    for i in want.tolist():
        begin, end = int(starts[i]), int(ends[i])
        stream.seek(begin)
        data = read_exact(stream, end - begin, url, begin)
        got.append(
            sample_from_bytes(
                data,
                int(tar_offsets[i]),
                compression=compression,
                url=url,
                last_dot=last_dot,
                offset=begin,
                entry=entry,
            )
        )
        if len(got) >= _RUN_SAMPLES:
            yield got
            got = []
    if got:
        yield got


def _flag(samples: list[dict], pad: bool) -> None:
    """Set ``__pad__`` on each sample (here, so that no loop variable keeps the last one)."""
    for sample in samples:
        sample["__pad__"] = pad


class _Window:
    """A stream read ``step`` bytes at a time at most (a reader's buffer stays that small), and
    only its next ``size`` bytes (reads stop where a run ends; ``size < 0``: to the end)."""

    def __init__(self, stream, size: int, step: int):
        self._stream = stream
        self._left = size if size >= 0 else 1 << 62
        self._step = step

    def readinto(self, view: memoryview) -> int:
        n = min(len(view), self._left, self._step)
        if n <= 0:
            return 0
        readinto = getattr(self._stream, "readinto", None)
        if readinto is None:  # a stream with read() only
            data = self._stream.read(n)
            got = len(data)
            view[:got] = data
        elif n < len(view):
            part = view[:n]
            try:
                got = readinto(part) or 0
            finally:
                part.release()  # (see tario.buffer._Buffer._more)
        else:
            got = readinto(view) or 0
        self._left -= got
        return got

    def read(self, n: int | None = -1) -> bytes:
        n = self._step if n is None or n < 0 else n
        n = min(n, self._left, self._step)
        if n <= 0:
            return b""
        data = self._stream.read(n)
        self._left -= len(data)
        return data

    read1 = read


def _discard(stream, n: int, url) -> None:
    """Read and drop the next ``n`` bytes of a stream that cannot seek."""
    while n > 0:
        piece = stream.read(min(n, 1 << 20))
        if not piece:
            raise TarshardsError("the shard ended before a sample's recorded offset", url=url)
        n -= len(piece)


def resumed_chunks(
    stream: BinaryIO, entry: str, url: str | None, offset: int, chunk_size: int
) -> Iterator[bytes]:
    """The tar stream of a sample-aligned compressed shard read from ``offset`` (where
    ``stream`` stands): a frame of its own (``entry="member"``), or a flush point of a
    one-member gzip shard (``"deflate"``: a raw inflater)."""
    chunks = read_chunks(stream, chunk_size)
    if entry == "deflate":
        return inflated_from(chunks, url, offset)
    return decompressed_chunks(chunks, url)


def _seekable(stream) -> bool:
    try:
        return bool(stream.seekable())
    except (AttributeError, OSError, ValueError):
        return False


def _seek(stream, offset: int) -> bool:
    if not _seekable(stream):
        return False
    stream.seek(offset)
    return True
