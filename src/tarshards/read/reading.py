"""Reading the samples of shards in turn: the plain path under every pipeline (one shard's
samples, several shards' with an error policy and prefetching, verified against a manifest)."""

from __future__ import annotations

import bisect
import functools
import itertools
import os
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Iterable, Iterator, cast

from ..errors import IntegrityError, StorageError, TarshardsError
from ..format.names import group_samples
from ..on_error import OnError, error_policy
from ..storage import is_local, local_path, open_url
from ..storage.prefetch import ShardPrefetcher, given_stream
from ..tario import iter_tar_batches, tar_byte_source
from ..tario.buffer import DirectFile, MappedFile, direct_local, map_local

try:  # the samples of a local plain file read and grouped in C, one a call (see local_samples)
    from .._speedups import SampleScan as _SampleScan
except ImportError:  # pragma: no cover - the extension is not built, or no pread here
    _SampleScan = None

if TYPE_CHECKING:  # (imported where a loader counts)
    from ..stats import Counters

__all__ = ["iter_samples", "local_samples", "shard_samples", "skipped_rest"]


def shard_samples(
    url: str,
    *,
    storage_options: dict | None = None,
    allow_pipe: bool = False,
    last_dot: bool = False,
    opener: Callable | None = None,
    chunk_size: int = 1 << 20,
    retries: int = 5,
    expect=None,
    copy: bool = True,
    stats: Counters | None = None,
) -> Iterator[dict]:
    """The samples of one shard (any URL :func:`tarshards.storage.open_url` opens).

    ``retries``: reconnections after a dropped connection, resuming at the byte offset reached.
    ``expect``: the shard's manifest record (``samples``, ``nbytes``, ``hash``): the shard is
    hashed as it streams, and after its last sample an :class:`IntegrityError` naming it is
    raised when its size, hash or sample count differ.
    ``copy=False`` (zero-copy): the fields of a local plain shard (memory-mapped) are read-only
    ``memoryview`` slices of the map, not ``bytes`` copies; other shards (compressed, remote,
    piped, or verified with ``expect``) give ``bytes`` (see :func:`tarshards.tario.iter_tar`).

    ``stats``: the reader's :class:`~tarshards.stats.Counters` (a loader's ``stats=True`` or
    ``watchdog=``): the open's latency, the bytes read and the time blocked reading go there,
    and remote reads time out after its ``watchdog`` seconds without data (then resume).

    Errors are :class:`~tarshards.errors.TarshardsError` subclasses naming the shard, the member
    and the offset; OS errors while reading become :class:`StorageError`.
    """
    url = os.fspath(url)
    if opener is None:
        opener = cast(
            Callable,
            functools.partial(
                open_url, **_open_options(storage_options, allow_pipe, retries, stats)
            ),
        )
    if stats is not None:
        yield from _counted_samples(url, opener, stats, chunk_size, last_dot, expect, copy)
        return
    try:
        with opener(url) as stream:
            if expect is not None:
                yield from _verified_samples(stream, url, expect, chunk_size, last_dot)
                return
            # copies: read with pread (large members straight into their bytes); views: mapped
            src = tar_byte_source(stream, url, chunk_size, direct=copy)
            if type(src) is DirectFile:
                yield from local_samples(src, url, last_dot)
                return
            batches = iter_tar_batches(src, url, copy=copy)
            yield from group_samples(batches, url, last_dot=last_dot, batched=True)
    except TarshardsError as exn:
        raise exn.with_context(url=url) from None
    except OSError as exn:
        raise StorageError(f"read failed: {exn}", url=url) from exn


def local_samples(
    src: DirectFile, url: str, last_dot: bool, *, data: bool = True
) -> Iterator[dict]:
    """The samples of a local plain tar file (``src``, read with ``pread``): read and grouped in
    C one sample a call (``_speedups.SampleScan``) up to the end-of-archive marker while the
    members are ones it takes; from the first sample it declines (anything unusual: a header
    that is neither a plain member nor a directory, a repeated extension, a lone zero block, a
    cut), the reference reader and grouping go on from that sample's first header to the end,
    and decide (and raise). Without the extension, the reference reads the whole file.

    One sample a call keeps a large member's copy in memory still in the CPU's cache (the
    consumer freed the last sample's): measured in ``bench/bench_reads.py``, ~10% of a raw read
    of 100 KB samples against the reader's batches of members. The scan and the rest are
    chained in C (no Python frame a sample).

    ``data=False`` (for where the samples are, as a scan of offsets wants): the scan skips the
    members' data and reads headers alone; its samples' fields are ``None`` (those the
    reference reads after a decline hold their bytes)."""
    start = src.pos
    if _SampleScan is None:
        return _declined(None, src, url, last_dot, start)
    scan = _SampleScan(src.fd, start, src.stop, url, last_dot, -start, 1 << 18, data)
    return itertools.chain(scan, _declined(scan, src, url, last_dot, start))


def _declined(scan, src: DirectFile, url: str, last_dot: bool, start: int) -> Iterator[dict]:
    """What follows the samples ``scan`` took: nothing after the end-of-archive marker, else
    the reference reader and grouping from the sample it declined (``scan.resume``; the start
    without a scan)."""
    if scan is not None and scan.done:
        return
    at = start if scan is None else scan.resume
    rest = DirectFile(src.stream, at, src.stop)
    batches = iter_tar_batches(cast(Any, rest), url, offset=at - start)
    yield from group_samples(batches, url, last_dot=last_dot, batched=True)


def _open_options(
    storage_options, allow_pipe: bool, retries: int, stats: Counters | None
) -> dict[str, Any]:
    options: dict[str, Any] = {"storage_options": storage_options, "allow_pipe": allow_pipe}
    options["retries"] = retries
    if stats is not None:
        options["stats"] = stats
        if stats.watchdog is not None:  # a read silent that long is abandoned and resumed
            options["timeout"] = stats.watchdog
    return options


def _counted_samples(url, opener, stats: Counters, chunk_size, last_dot, expect, copy):
    """:func:`shard_samples` with its open, bytes and read time counted in ``stats``."""
    from ..stats import CountedStream, clock

    counted = None
    first = stats.samples  # the samples counted downstream while this shard is read
    t0 = clock()
    try:
        with opener(url) as stream:
            ahead = hasattr(stream, "open_ns")  # opened ahead by a prefetching thread
            stats.opened(url, 0, None if ahead else clock() - t0)
            # a local plain tar (copies read with pread, views mapped): its size is read
            local: DirectFile | MappedFile | None = None
            if expect is None:
                local = direct_local(stream) if copy and _SampleScan is not None else None
                local = local or map_local(stream)
            if local is not None:
                size = local.stop - (local.pos if isinstance(local, DirectFile) else local.start)
                try:
                    if isinstance(local, DirectFile):
                        yield from local_samples(local, url, last_dot)
                    else:
                        batches = iter_tar_batches(cast(Any, local), url, copy=copy)
                        yield from group_samples(batches, url, last_dot=last_dot, batched=True)
                finally:
                    stats.shard_done(url, size, 0, stats.samples - first)
                return
            counted = CountedStream(stream, stats, url)
            if expect is not None:
                yield from _verified_samples(counted, url, expect, chunk_size, last_dot)
                return
            batches = iter_tar_batches(
                tar_byte_source(cast(BinaryIO, counted), url, chunk_size, mapped=False),
                url,
                copy=copy,
            )
            yield from group_samples(batches, url, last_dot=last_dot, batched=True)
    except TarshardsError as exn:
        raise exn.with_context(url=url) from None
    except OSError as exn:
        raise StorageError(f"read failed: {exn}", url=url) from exn
    finally:
        if counted is not None:
            counted.done(stats.samples - first)
            ns = getattr(counted.stream, "open_ns", None)
            if ns is not None:
                stats.open_latency(url, ns, waited=False)


def _verified_samples(stream, url: str, expect, chunk_size: int, last_dot: bool):
    from ..format.hashing import HashingReader, check_shard, split_hash

    if not getattr(expect, "hash", None) and getattr(expect, "nbytes", None) is None:
        raise IntegrityError(
            "verify=True needs the shard's hash or size in the manifest "
            "(rebuild it with: tarshards index SPEC -o MANIFEST)",
            url=url,
        )
    algorithm = split_hash(expect.hash)[0] if expect.hash else "crc32"
    reader = HashingReader(stream, algorithm)
    batches = iter_tar_batches(tar_byte_source(cast(BinaryIO, reader), url, chunk_size), url)
    count = 0
    for sample in group_samples(batches, url, last_dot=last_dot, batched=True):
        count += 1
        yield sample
    reader.finish()
    check_shard(
        url,
        expected_hash=expect.hash,
        expected_nbytes=expect.nbytes,
        got_hash=reader.digest,
        got_nbytes=reader.nbytes,
        expected_samples=expect.samples,
        got_samples=count,
    )


def skipped_rest(exn: TarshardsError, index=None) -> str | None:
    """What skipping the rest of a shard after ``exn`` loses, in words: its samples from the one
    the error is in, where ``index`` (the shard's :class:`~tarshards.format.index.ShardIndex`, or a
    function returning it or ``None``) knows them; else the bytes from the error's offset (of a
    local file's size). ``None`` when the error names no offset."""
    offset = exn.offset
    if offset is None:
        return None
    if callable(index):
        try:
            index = index()
        except (TarshardsError, OSError):
            index = None
    if index is not None:
        starts = index.tar_offsets.tolist()
        total = len(starts)
        # the sample of the last member before the offset is lost too (still being grouped)
        first = max(0, bisect.bisect_left(starts, offset) - 1)
        if total and first < total:
            keys = index.keys
            lost = total - first
            which = repr(keys[first]) if lost == 1 else f"{keys[first]!r} to {keys[-1]!r}"
            return (
                f"the rest of the shard is skipped from offset {offset}: {lost} of its "
                f"{total} samples ({which}, by its index)"
            )
    url = exn.url
    size = None
    if url is not None and is_local(url) and not str(url).lower().endswith(_PACKED):
        try:
            size = os.path.getsize(local_path(url))
        except OSError:
            size = None
    if size is not None and size > offset:
        return (
            f"the rest of the shard is skipped: {size - offset:,} bytes from offset {offset} "
            f"(of its {size:,}; an index, from tarshards index, would count the samples)"
        )
    return f"the rest of the shard is skipped, from offset {offset} to its end"


_PACKED = (".gz", ".tgz", ".zst", ".tzst", ".bz2", ".xz", ".lz4")


def _noted(exn: TarshardsError, policy, index_of) -> TarshardsError:
    """``exn`` with a note of what skipping the rest of its shard loses (not under "raise")."""
    if policy.mode == "raise" or not hasattr(exn, "add_note"):
        return exn
    index = None
    if index_of is not None and exn.url is not None:
        index = functools.partial(index_of, exn.url)
    note = skipped_rest(exn, index)
    if note is not None and note not in getattr(exn, "__notes__", ()):
        exn.add_note(note)
    return exn


def iter_samples(
    urls: Iterable[str],
    *,
    on_error: OnError = "raise",
    handler: Callable | None = None,
    prefetch: int = 0,
    prefetch_bytes: int = 256 << 20,
    expect: dict | None = None,
    index_of: Callable | None = None,
    stats: Counters | None = None,
    **options,
) -> Iterator[dict]:
    """The samples of several shards in turn; shard errors go to ``on_error``.

    With ``on_error="warn"`` (or ``handler=warn_and_continue``) a bad shard yields the samples
    before the error, one warning naming shard and offset and what the rest of the shard held
    (its samples, by ``index_of(url)``, a function returning the shard's index or ``None``;
    else its bytes from the offset), and the stream goes on with the next shard. Only tarshards
    errors reach the policy here (errors of the shard, not of user code).

    ``prefetch=k`` opens the next ``k`` shards while the current one is read, each filled from a
    thread into a buffer (``prefetch_bytes`` over all of them; at most ``k + 1`` connections):
    see :mod:`tarshards.storage.prefetch`. Order, samples and errors are the same as without it.
    ``stats``: the reader's :class:`~tarshards.stats.Counters` (see :func:`shard_samples`).
    """
    policy = error_policy(on_error, handler)
    if stats is not None:
        options["stats"] = stats

    def one(url, **extra):
        if expect is None:
            return shard_samples(url, **options, **extra)
        record = expect.get(url)
        if record is None:
            raise IntegrityError("verify=True: this shard is not in the manifest", url=url)
        return shard_samples(url, expect=record, **options, **extra)

    if not prefetch:
        for url in urls:
            try:
                yield from one(url)
            except TarshardsError as exn:
                if policy(_noted(exn, policy, index_of)):
                    continue
                return
        return
    opener = options.pop("opener", None)
    if opener is None:
        opener = functools.partial(
            open_url,
            **_open_options(
                options.get("storage_options"),
                options.get("allow_pipe", False),
                options.get("retries", 5),
                stats,
            ),
        )
    with ShardPrefetcher(opener, ahead=prefetch, max_bytes=prefetch_bytes) as prefetcher:
        for url, stream in prefetcher.streams(urls):
            try:
                yield from one(url, opener=lambda _url, s=stream: given_stream(s))
            except TarshardsError as exn:
                if policy(_noted(exn, policy, index_of)):
                    continue
                return
