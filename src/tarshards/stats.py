"""Live loader statistics and the hang watchdog's bookkeeping.

A :class:`Counters` object is one reader's running totals (a DataLoader worker's, or the main
process's with ``num_workers=0``): samples and bytes read, the time spent waiting on storage, in
the tar reader, decoding and in the other stages, shard open latencies, cache hits and misses,
retries, stalls, and per shard the time waited on it. The reading path receives it as a value
(the pipeline's iteration context, ``ctx["stats"]``) and adds to it; nothing here is global.
Clocks are read per shard, per read call (about a megabyte) and per batch; the time per sample
in the source and in decoding is measured on one sample in sixteen and scaled up (an estimate),
so that counting costs under 1% of an image pipeline's samples/s (``bench/bench_stats.py``).

A worker sends what its counters gathered since the last time (:meth:`Counters.take`) along
with each batch; the main process adds those deltas up (:meth:`Counters.add`) and
:meth:`Counters.snapshot` turns them into a :class:`LoaderStats`, a frozen value with a one-line
:meth:`~LoaderStats.summary`, :meth:`~LoaderStats.as_dict` and a Prometheus text export
(:meth:`~LoaderStats.prometheus`). :func:`gathered` combines the ranks' statistics (what
``WebLoader.stats(gather=True)`` collects through the process group) and names the slowest
ranks and shards.

The watchdog (``WebLoader(..., watchdog=SECONDS)``) uses the same object: the reading path marks
progress on it, a remote read that gets no byte for ``SECONDS`` times out and is retried from
its offset (:meth:`Counters.retried` reports it as a stall), and :func:`start_watchdog` runs a
thread that reports a worker making no progress elsewhere (a hung stage).
"""

from __future__ import annotations

import math
import threading
import time
import warnings
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator

from .errors import StallError, StallWarning

__all__ = ["Counters", "LoaderStats", "ShardTiming", "gathered", "start_watchdog"]

_now = clock = time.perf_counter_ns  # the one clock of the statistics

# the summed counters, in the order of Counters.take()'s tuple
_SUMS = (
    "samples",
    "bytes",
    "items",
    "storage_ns",
    "read_ns",
    "decode_ns",
    "produce_ns",
    "shards",
    "open_ns",
    "cache_hits",
    "cache_misses",
    "retries",
    "stalls",
    "wait_ns",
    "steps",
)
_MAXES = ("open_max_ns", "wait_max_ns")
# the training loop's waits per batch, counted by powers of two of nanoseconds: bucket k holds
# the waits of k bits (up to 2**k ns); the histogram and percentiles come from them
_WAIT_BUCKETS = 40  # (the last one: 2**39 ns, about 9 minutes, and above)
_PROM_BUCKETS = range(10, 37, 2)  # Prometheus' "le" bounds: 2**k ns, from 1 us to 69 s
_KEEP_SHARDS = 1000  # per-shard records kept in the totals (the slowest ones)
_SHOW_SHARDS = 5  # ... and named in a LoaderStats

OnStall = str | Callable[[StallError], object]


def _check_on_stall(on_stall: OnStall) -> OnStall:
    if callable(on_stall) or on_stall in ("warn", "raise", "skip"):
        return on_stall
    raise ValueError(f"on_stall is 'warn', 'raise', 'skip' or a function, not {on_stall!r}")


class Counters:
    """Running totals of one reader (see the module's notes); ``rank``/``worker`` say whose.

    ``watchdog``: seconds without progress that make a stall (``None``: no watchdog);
    ``on_stall``: what a stall does: ``"warn"`` (a :class:`~tarshards.errors.StallWarning`),
    ``"raise"`` (:class:`~tarshards.errors.StallError`, where the reading path can raise it),
    ``"skip"`` (counted only) or a function given the :class:`StallError`.
    """

    __slots__ = (
        *_SUMS,
        *_MAXES,
        "rank",
        "world_size",
        "worker",
        "watchdog",
        "on_stall",
        "url",
        "offset",
        "reading",
        "busy",
        "started_ns",
        "shard_times",
        "stall_log",
        "wait_hist",
        "closed",
        "__weakref__",
    )

    samples: int
    bytes: int
    items: int
    storage_ns: int
    read_ns: int
    decode_ns: int
    produce_ns: int
    shards: int
    open_ns: int
    cache_hits: int
    cache_misses: int
    retries: int
    stalls: int
    wait_ns: int
    steps: int
    open_max_ns: int
    wait_max_ns: int

    def __init__(
        self,
        rank: int = 0,
        world_size: int = 1,
        worker: int | None = None,
        *,
        watchdog: float | None = None,
        on_stall: OnStall = "warn",
    ):
        for name in _SUMS + _MAXES:
            setattr(self, name, 0)
        self.rank, self.world_size, self.worker = rank, world_size, worker
        if watchdog is not None and not watchdog > 0:
            raise ValueError(f"watchdog is a number of seconds > 0, not {watchdog!r}")
        self.watchdog = None if watchdog is None else float(watchdog)
        self.on_stall = _check_on_stall(on_stall)
        self.url: str | None = None  # the shard being read, and the offset reached in it
        self.offset = 0
        self.reading = False  # inside a storage read (that has its own timeout)
        self.busy = False  # making an item (else idle: waiting to be asked for one)
        self.started_ns = _now()
        # url -> [open ns, wait ns, bytes, samples]
        self.shard_times: dict[str, list[int]] = {}
        self.stall_log: list[tuple] = []  # (rank, worker, url, offset, seconds, where)
        self.wait_hist = [0] * _WAIT_BUCKETS
        self.closed = False

    # ---- the reading path ------------------------------------------------------------------
    def opened(self, url: str, offset: int, ns: int | None) -> None:
        """A shard was opened (at byte ``offset``) in ``ns`` nanoseconds (``None``: opened
        ahead elsewhere, :meth:`open_latency` tells later)."""
        self.shards += 1
        self.url, self.offset = url, offset
        if ns is not None:
            self.open_latency(url, ns)

    def open_latency(self, url: str, ns: int, waited: bool = True) -> None:
        """A shard's open took ``ns``; ``waited=False``: in a prefetching thread (the reader's
        wait for it shows in its reads)."""
        self.open_ns += ns
        if waited:
            self.storage_ns += ns
        if ns > self.open_max_ns:
            self.open_max_ns = ns
        rec = self.shard_times.get(url)
        if rec is None:
            self.shard_times[url] = [ns, ns, 0, 0]
        else:
            rec[0] += ns
            rec[1] += ns

    def shard_done(
        self, url: str, nbytes: int, wait_ns: int, samples: int, counted: bool = False
    ) -> None:
        """A shard's reading ended (or a run of it): ``nbytes`` read, ``wait_ns`` blocked in
        its reads (``counted``: already in the totals, as a :class:`CountedStream` adds them)."""
        if not counted:
            self.bytes += nbytes
            self.storage_ns += wait_ns
        rec = self.shard_times.get(url)
        if rec is None:
            rec = self.shard_times[url] = [0, 0, 0, 0]
        rec[1] += wait_ns
        rec[2] += nbytes
        rec[3] += samples

    def retried(self, url: str, offset: int, exc: BaseException) -> None:
        """A storage read failed and is retried from ``offset``: a timeout under a watchdog is
        a stall (reported by the ``on_stall`` policy)."""
        self.retries += 1
        if self.watchdog is not None and isinstance(exc, TimeoutError):
            self.stalled(url, offset, self.watchdog, "a storage read got no data")

    def cache(self, hit: bool) -> None:
        if hit:
            self.cache_hits += 1
        else:
            self.cache_misses += 1

    def stalled(
        self, url: str | None, offset: int | None, seconds: float, where: str, relay: bool = True
    ) -> None:
        """Record a stall and apply the ``on_stall`` policy. In a DataLoader worker
        (``worker`` set) a ``"warn"`` is left to the main process, which warns when the stall's
        record arrives with the worker's next batch, unless ``relay=False``."""
        self.stalls += 1
        record = (self.rank, self.worker, url, offset, seconds, where)
        self.stall_log.append(record)
        error = stall_error(record)
        policy = self.on_stall
        if policy == "warn":
            if self.worker is None or not relay:
                warnings.warn(str(error), StallWarning, stacklevel=3)
        elif policy == "raise":
            raise error
        elif callable(policy):
            policy(error)

    # ---- the main process ------------------------------------------------------------------
    def waited(self, ns: int) -> None:
        """The training loop waited ``ns`` for a batch."""
        self.wait_ns += ns
        self.steps += 1
        self.wait_hist[min(max(ns, 0).bit_length(), _WAIT_BUCKETS - 1)] += 1
        if ns > self.wait_max_ns:
            self.wait_max_ns = ns

    def take(self) -> tuple:
        """What was gathered since the last ``take()`` (and zero it): a small picklable value
        for :meth:`add` in another process."""
        sums = tuple(getattr(self, name) for name in _SUMS)
        maxes = tuple(getattr(self, name) for name in _MAXES)
        for name in _SUMS + _MAXES:
            setattr(self, name, 0)
        shards, self.shard_times = self.shard_times, {}
        stalls, self.stall_log = self.stall_log, []
        return sums, maxes, shards, stalls

    def add(self, delta: tuple) -> None:
        """Add a :meth:`take` of another reader."""
        sums, maxes, shards, stalls = delta
        for name, value in zip(_SUMS, sums):
            setattr(self, name, getattr(self, name) + value)
        for name, value in zip(_MAXES, maxes):
            if value > getattr(self, name):
                setattr(self, name, value)
        mine = self.shard_times
        for url, rec in shards.items():
            have = mine.get(url)
            if have is None:
                mine[url] = list(rec)
            else:
                for i, v in enumerate(rec):
                    have[i] += v
        if len(mine) > 2 * _KEEP_SHARDS:
            kept = sorted(mine.items(), key=lambda kv: kv[1][1], reverse=True)[:_KEEP_SHARDS]
            self.shard_times = dict(kept)
        self.stall_log.extend(stalls)
        if self.on_stall == "warn":
            for record in stalls:  # a worker's stall, reported where the trainer sees it
                warnings.warn(str(stall_error(record)), StallWarning, stacklevel=2)

    def snapshot(self) -> LoaderStats:
        """The totals so far as a :class:`LoaderStats`."""
        g = self.__getattribute__
        produce, read, decode = g("produce_ns"), g("read_ns"), g("decode_ns")
        if decode:  # measured around decoding, with the source's time in it
            decode = max(0, decode - read)
        slowest = sorted(self.shard_times.items(), key=lambda kv: kv[1][1], reverse=True)
        return LoaderStats(
            rank=self.rank,
            world_size=self.world_size,
            elapsed_s=(_now() - self.started_ns) / 1e9,
            samples=g("samples"),
            bytes=g("bytes"),
            batches=g("steps"),
            shards=g("shards"),
            wait_s=g("wait_ns") / 1e9,
            wait_max_s=g("wait_max_ns") / 1e9,
            produce_s=produce / 1e9,
            storage_s=g("storage_ns") / 1e9,
            read_s=read / 1e9,
            decode_s=decode / 1e9,
            stages_s=max(0, produce - read - decode) / 1e9,
            open_s=g("open_ns") / 1e9,
            open_max_s=g("open_max_ns") / 1e9,
            cache_hits=g("cache_hits"),
            cache_misses=g("cache_misses"),
            retries=g("retries"),
            stalls=g("stalls"),
            slowest_shards=tuple(
                ShardTiming(url, r[1] / 1e9, r[0] / 1e9, r[2], r[3], self.rank)
                for url, r in slowest[:_SHOW_SHARDS]
            ),
            stall_log=tuple(self.stall_log),
            wait_hist=tuple(self.wait_hist),
        )


def stall_error(record: tuple) -> StallError:
    """The :class:`StallError` of a stall record ``(rank, worker, url, offset, seconds, where)``."""
    rank, worker, url, offset, seconds, where = record
    who = "main process" if worker is None else f"worker {worker}"
    return StallError(
        f"no progress for {seconds:.1f}s: {where} (rank {rank}, {who})",
        rank=rank,
        worker=worker,
        seconds=seconds,
        url=url,
        offset=offset,
    )


# ---- timing the pipeline's layers (clocks read on one sample in _EVERY) -----------------------
_EVERY = 16  # per-sample times are measured on one sample in this many (and scaled up)


def timed_source(it: Iterable, c: Counters) -> Iterator:
    """The source's samples, counted, with an estimate of the time spent making them (storage
    and tar reading: the pull of one sample in ``_EVERY`` is timed, and scaled up)."""
    now = _now
    every = k = _EVERY
    t0 = now()
    for item in it:
        if t0:
            c.read_ns += (now() - t0) * every
            t0 = 0
        c.samples += 1
        yield item
        k -= 1
        if not k:
            k = every
            t0 = now()


def timed_stage(it: Iterable, c: Counters) -> Iterator:
    """The output of the decode stage, with an estimate of the time spent making it (one item
    in ``_EVERY`` timed and scaled up): the source's time is in it, and taken out of it in
    :meth:`Counters.snapshot` (so is the time of any stage between the source and decoding)."""
    now = _now
    every = k = _EVERY
    t0 = now()
    for item in it:
        if t0:
            c.decode_ns += (now() - t0) * every
            t0 = 0
        yield item
        k -= 1
        if not k:
            k = every
            t0 = now()


def timed_items(it: Iterable, c: Counters, last: Any = None) -> Iterator:
    """A reader's items (what it hands to the loader), counted, with the time spent making them
    (every item's while they take over 50 us each, as batches do; else one in ``_EVERY``). The
    reader counts as busy (watched) while it makes one. ``last``: an item to yield after the
    others (``None``: none)."""
    now = _now
    it = iter(it)
    i = 0
    slow = False
    while True:
        c.busy = True
        if slow or i % _EVERY == 0:
            t0 = now()
            try:
                item = next(it)
            except StopIteration:
                break
            finally:
                c.busy = False
            ns = now() - t0
            slow = ns > 50_000
            c.produce_ns += ns if slow else ns * _EVERY
        else:
            try:
                item = next(it)
            except StopIteration:
                break
            finally:
                c.busy = False
        i += 1
        c.items += 1
        yield item
    if last is not None:
        yield last


class CountedStream:
    """A stream read through: the bytes and the time blocked in its reads go to the shard's
    record when :meth:`done` is called; each read is a sign of progress (for the watchdog)."""

    def __init__(self, stream, c: Counters, url: str, offset: int = 0):
        self.stream = stream
        self._stream = stream
        self._c = c
        self.url = url
        self.nbytes = 0
        self.wait_ns = 0
        c.url, c.offset = url, offset
        self._offset = offset
        if getattr(stream, "readinto", None) is None:
            self.readinto = None  # type: ignore[assignment]

    def _timed(self, fn, arg):
        c = self._c
        c.reading = True
        t0 = _now()
        try:
            out = fn(arg)
        finally:
            c.reading = False
            ns = _now() - t0
            self.wait_ns += ns
            c.storage_ns += ns
        n = out if isinstance(out, int) else len(out)
        self.nbytes += n
        c.bytes += n
        c.offset = self._offset + self.nbytes
        return out

    def read(self, n: int = -1) -> bytes:
        return self._timed(self._stream.read, n)

    def read1(self, n: int = -1) -> bytes:
        fn = getattr(self._stream, "read1", None) or self._stream.read
        return self._timed(fn, n)

    def readinto(self, view) -> int:
        return self._timed(self._stream.readinto, view)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def done(self, samples: int) -> None:
        self._c.shard_done(self.url, self.nbytes, self.wait_ns, samples, counted=True)


# ---- the watchdog thread -------------------------------------------------------------------
def start_watchdog(c: Counters, interval: float | None = None) -> threading.Thread | None:
    """A daemon thread that reports (``on_stall``; a ``"raise"`` policy warns from there) when
    the reader has been busy making an item for ``c.watchdog`` seconds with no sign of progress
    (no sample, no read, no shard opened). A storage read is left to its own timeout (retried
    and reported where it happens) unless it blocks three times that long. It stops when ``c``
    is closed or collected. The reading path reads no clock for it: the thread compares the
    counters from one look to the next."""
    if c.watchdog is None:
        return None
    seconds = c.watchdog
    ref = weakref.ref(c)
    pause = interval if interval is not None else min(1.0, seconds / 8)

    def watch():
        seen: tuple = ()
        since = time.monotonic()
        reported = False
        while True:
            time.sleep(pause)
            c = ref()
            if c is None or c.closed:
                return
            signs = (c.busy, c.items, c.samples, c.offset, c.shards, c.retries, c.url)
            t = time.monotonic()
            if signs != seen:
                seen, since, reported = signs, t, False
            elif c.busy and not reported:
                idle = t - since
                if idle >= (3 * seconds if c.reading else seconds):
                    reported = True
                    where = (
                        "a storage read is blocked" if c.reading else "no sample or read completed"
                    )
                    try:
                        c.stalled(c.url, c.offset if c.url else None, idle, where, relay=False)
                    except StallError as exn:  # cannot raise in the reader's thread: warn
                        warnings.warn(str(exn), StallWarning, stacklevel=1)
            del c

    thread = threading.Thread(target=watch, name="tarshards-watchdog", daemon=True)
    thread.start()
    return thread


# ---- the values handed out -----------------------------------------------------------------
@dataclass(frozen=True)
class ShardTiming:
    """One shard's time: ``wait_s`` blocked on storage for it (open included), ``open_s`` its
    opens, ``bytes`` and ``samples`` read from it, on ``rank``."""

    url: str
    wait_s: float
    open_s: float
    bytes: int
    samples: int
    rank: int | None = None


@dataclass(frozen=True)
class LoaderStats:
    """A loader's statistics: this rank's (``WebLoader.stats()``) or all ranks' totals
    (``stats(gather=True)``: ``ranks`` holds each rank's, ``slowest_ranks`` the ranks whose
    training loop waited longest for data, first).

    Times are seconds. ``wait_s``: the training loop's wait for batches (``batches`` of them,
    the longest ``wait_max_s``). In the readers (summed over DataLoader workers, which run in
    parallel): ``produce_s`` making items, of which ``read_s`` in the source (``storage_s``
    blocked on storage: opens and reads; the rest is tar reading), ``decode_s`` decoding and
    ``stages_s`` the other stages (shuffle, the user's maps, batching). ``open_s`` is the shards'
    open latencies summed (``open_max_s`` the longest); ``slowest_shards`` the shards waited on
    longest.
    """

    rank: int | None = 0
    world_size: int = 1
    elapsed_s: float = 0.0
    samples: int = 0
    bytes: int = 0
    batches: int = 0
    shards: int = 0
    wait_s: float = 0.0
    wait_max_s: float = 0.0
    produce_s: float = 0.0
    storage_s: float = 0.0
    read_s: float = 0.0
    decode_s: float = 0.0
    stages_s: float = 0.0
    open_s: float = 0.0
    open_max_s: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0
    retries: int = 0
    stalls: int = 0
    slowest_shards: tuple[ShardTiming, ...] = ()
    stall_log: tuple[tuple, ...] = ()
    wait_hist: tuple[int, ...] = ()
    ranks: tuple[LoaderStats, ...] = ()
    slowest_ranks: tuple[int, ...] = field(default=())

    # ---- derived values ----------------------------------------------------------------------
    @property
    def samples_per_s(self) -> float:
        return self.samples / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def wait_fraction(self) -> float:
        """The share of the run the training loop spent waiting for data (0..1)."""
        if self.elapsed_s <= 0:
            return 0.0
        per_rank = self.elapsed_s * max(1, len(self.ranks) or 1)
        return min(1.0, self.wait_s / per_rank)

    @property
    def cache_hit_rate(self) -> float | None:
        total = self.cache_hits + self.cache_misses
        return self.cache_hits / total if total else None

    @property
    def open_mean_s(self) -> float:
        return self.open_s / self.shards if self.shards else 0.0

    def wait_quantile(self, q: float) -> float:
        """The ``q`` quantile (0..1) of the loop's wait per batch, in seconds: an upper bound
        within a factor of two (the waits are counted by powers of two)."""
        if not 0 <= q <= 1:
            raise ValueError(f"q is between 0 and 1, not {q!r}")
        total = sum(self.wait_hist)
        if not total:
            return 0.0
        need, seen = q * total, 0
        for k, n in enumerate(self.wait_hist):
            seen += n
            if n and seen >= need:
                return min(2**k / 1e9, self.wait_max_s) if k else 0.0
        return self.wait_max_s

    @property
    def wait_p50_s(self) -> float:
        return self.wait_quantile(0.5)

    @property
    def wait_p99_s(self) -> float:
        return self.wait_quantile(0.99)

    def as_dict(self) -> dict[str, Any]:
        """Plain values (JSON-ready): the fields and the derived rates."""
        out = asdict(self)
        out["slowest_shards"] = [asdict(s) for s in self.slowest_shards]
        out["stall_log"] = [list(s) for s in self.stall_log]
        out["ranks"] = [r.as_dict() for r in self.ranks]
        out["slowest_ranks"] = list(self.slowest_ranks)
        out["wait_hist"] = list(self.wait_hist)
        out.update(
            wait_p50_s=self.wait_p50_s,
            wait_p99_s=self.wait_p99_s,
            samples_per_s=self.samples_per_s,
            bytes_per_s=self.bytes_per_s,
            wait_fraction=self.wait_fraction,
            cache_hit_rate=self.cache_hit_rate,
            open_mean_s=self.open_mean_s,
        )
        return out

    @classmethod
    def from_dict(cls, d: dict) -> LoaderStats:
        """The inverse of :meth:`as_dict` (the derived values are dropped)."""
        names = {f for f in cls.__dataclass_fields__}
        values = {k: v for k, v in d.items() if k in names}
        values["slowest_shards"] = tuple(ShardTiming(**s) for s in d.get("slowest_shards", ()))
        values["stall_log"] = tuple(tuple(s) for s in d.get("stall_log", ()))
        values["ranks"] = tuple(cls.from_dict(r) for r in d.get("ranks", ()))
        values["slowest_ranks"] = tuple(d.get("slowest_ranks", ()))
        values["wait_hist"] = tuple(d.get("wait_hist", ()))
        return cls(**values)

    # ---- text ----------------------------------------------------------------------------
    def summary(self) -> str:
        """One line for a log or a tqdm postfix."""
        who = "all ranks" if self.rank is None else f"rank {self.rank}"
        parts = [
            f"{who}: {self.samples} samples ({_si(self.samples_per_s)}/s)",
            f"{_si(self.bytes_per_s)}B/s",
            f"wait {100 * self.wait_fraction:.1f}% (p99 {_dur(self.wait_p99_s)}, "
            f"max {_dur(self.wait_max_s)})",
        ]
        if self.produce_s > 0:
            p = self.produce_s
            parts.append(
                f"storage {100 * self.storage_s / p:.0f}% "
                f"read {100 * max(0.0, self.read_s - self.storage_s) / p:.0f}% "
                f"decode {100 * self.decode_s / p:.0f}% stages {100 * self.stages_s / p:.0f}%"
            )
        if self.shards:
            parts.append(f"open {_dur(self.open_mean_s)} (max {_dur(self.open_max_s)})")
        rate = self.cache_hit_rate
        if rate is not None:
            parts.append(f"cache {100 * rate:.0f}% hits")
        if self.retries or self.stalls:
            parts.append(f"{self.retries} retries, {self.stalls} stalls")
        if self.slowest_ranks:
            parts.append(f"slowest rank {self.slowest_ranks[0]}")
        return " | ".join(parts)

    __str__ = summary

    def prometheus(self, prefix: str = "tarshards_loader") -> str:
        """The statistics in Prometheus' text exposition format (one sample per rank; the
        slowest shards as a gauge labelled with their URL)."""
        rows = self.ranks or (self,)
        lines: list[str] = []
        for name, kind, doc, get in _METRICS:
            metric = f"{prefix}_{name}"
            lines.append(f"# HELP {metric} {doc}")
            lines.append(f"# TYPE {metric} {kind}")
            for r in rows:
                lines.append(f'{metric}{{rank="{r.rank}"}} {_num(get(r))}')
        metric = f"{prefix}_batch_wait_seconds"
        lines.append(f"# HELP {metric} The training loop's wait for each batch.")
        lines.append(f"# TYPE {metric} histogram")
        for r in rows:
            hist = list(r.wait_hist) + [0] * (_WAIT_BUCKETS - len(r.wait_hist))
            for k in _PROM_BUCKETS:
                le = _num(2**k / 1e9)
                lines.append(f'{metric}_bucket{{rank="{r.rank}",le="{le}"}} {sum(hist[: k + 1])}')
            lines.append(f'{metric}_bucket{{rank="{r.rank}",le="+Inf"}} {sum(hist)}')
            lines.append(f'{metric}_sum{{rank="{r.rank}"}} {_num(r.wait_s)}')
            lines.append(f'{metric}_count{{rank="{r.rank}"}} {sum(hist)}')
        metric = f"{prefix}_shard_wait_seconds"
        lines.append(f"# HELP {metric} Time blocked on storage for the slowest shards.")
        lines.append(f"# TYPE {metric} gauge")
        for r in rows:
            for s in r.slowest_shards:
                lines.append(f'{metric}{{rank="{r.rank}",url="{_label(s.url)}"}} {_num(s.wait_s)}')
        return "\n".join(lines) + "\n"


_METRICS: tuple[tuple[str, str, str, Callable[[LoaderStats], float]], ...] = (
    ("samples_total", "counter", "Samples read.", lambda r: r.samples),
    ("bytes_total", "counter", "Shard bytes read.", lambda r: r.bytes),
    ("batches_total", "counter", "Batches handed to the training loop.", lambda r: r.batches),
    ("shards_total", "counter", "Shards opened.", lambda r: r.shards),
    ("wait_seconds_total", "counter", "Training loop's wait for batches.", lambda r: r.wait_s),
    ("wait_max_seconds", "gauge", "Longest wait for one batch.", lambda r: r.wait_max_s),
    ("produce_seconds_total", "counter", "Readers' time making items.", lambda r: r.produce_s),
    (
        "storage_seconds_total",
        "counter",
        "Readers' time blocked on storage.",
        lambda r: r.storage_s,
    ),
    ("read_seconds_total", "counter", "Readers' time in the source.", lambda r: r.read_s),
    ("decode_seconds_total", "counter", "Readers' time decoding.", lambda r: r.decode_s),
    ("stages_seconds_total", "counter", "Readers' time in other stages.", lambda r: r.stages_s),
    ("open_seconds_total", "counter", "Shard open latencies summed.", lambda r: r.open_s),
    ("open_max_seconds", "gauge", "Longest shard open.", lambda r: r.open_max_s),
    ("cache_hits_total", "counter", "Shards found in the cache.", lambda r: r.cache_hits),
    ("cache_misses_total", "counter", "Shards downloaded to the cache.", lambda r: r.cache_misses),
    ("retries_total", "counter", "Storage reads retried.", lambda r: r.retries),
    ("stalls_total", "counter", "Stalls the watchdog reported.", lambda r: r.stalls),
    ("elapsed_seconds", "gauge", "Seconds since the loader started.", lambda r: r.elapsed_s),
)


def gathered(per_rank: Iterable[LoaderStats]) -> LoaderStats:
    """All ranks' statistics in one: the sums (``rank=None``), each rank's in ``ranks``, the
    ranks ordered by their loop's wait (``slowest_ranks``), the slowest shards of all."""
    ranks = tuple(sorted(per_rank, key=lambda r: -1 if r.rank is None else r.rank))
    if not ranks:
        raise ValueError("no statistics to gather")
    sums: dict[str, Any] = {}
    for name in (
        "samples",
        "bytes",
        "batches",
        "shards",
        "wait_s",
        "produce_s",
        "storage_s",
        "read_s",
        "decode_s",
        "stages_s",
        "open_s",
        "cache_hits",
        "cache_misses",
        "retries",
        "stalls",
    ):
        sums[name] = sum(getattr(r, name) for r in ranks)
    shards = sorted(
        (s for r in ranks for s in r.slowest_shards), key=lambda s: s.wait_s, reverse=True
    )
    return LoaderStats(
        rank=None,
        world_size=len(ranks),
        elapsed_s=max(r.elapsed_s for r in ranks),
        wait_max_s=max(r.wait_max_s for r in ranks),
        open_max_s=max(r.open_max_s for r in ranks),
        slowest_shards=tuple(shards[:_SHOW_SHARDS]),
        stall_log=tuple(s for r in ranks for s in r.stall_log),
        wait_hist=tuple(
            sum(r.wait_hist[k] if k < len(r.wait_hist) else 0 for r in ranks)
            for k in range(max(len(r.wait_hist) for r in ranks))
        ),
        ranks=ranks,
        slowest_ranks=tuple(
            r.rank
            for r in sorted(ranks, key=lambda r: r.wait_s, reverse=True)
            if r.rank is not None
        ),
        **sums,
    )


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def _dur(s: float) -> str:
    return f"{s * 1e3:.0f}ms" if s < 10 else f"{s:.0f}s"


def _num(x: float) -> str:
    if isinstance(x, int):
        return str(x)
    if math.isnan(x):
        return "NaN"
    return repr(float(x))


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
