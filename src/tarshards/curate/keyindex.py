"""The key table of a data set: sample key -> (shard, row), memory-mapped, for 100M+ keys.

A :class:`KeyIndex` is a directory of flat little-endian arrays and a small JSON header
(``keyindex.json``), all of them sorted by the xxh3_64 of the key's UTF-8 bytes::

    keys.tski/
      keyindex.json     format, version, count, the manifest's fingerprint, checksum, shard URLs
      hashes.u64        xxh3_64 of each key, ascending (ties: by shard, then row)
      shards.u32        the shard's number in the manifest, per key
      rows.u32          the sample's row in its shard (its position in the shard index)
      key_offsets.u64   where each key's bytes start in keys.bin (count + 1 values)
      keys.bin          the keys' UTF-8 bytes, back to back, in hash order
      buckets.u64       where the hashes of each value of their top ``bucket_bits`` bits
                        start (2**bucket_bits + 1 values; about 256 keys a bucket)

A lookup is a binary search of one bucket of ``hashes.u64`` (a page or two, where a search of
the whole array probes ~27 places for 100M keys: a cold lookup reads about six pages in all),
then one comparison of the key's bytes, which makes it exact: a key that is not in the
table never comes back with the row of another whose hash it shares. Keys stored in the table
(rather than verified against the shard indexes) keep a lookup within the table: no shard index
is fetched (a remote one is a round trip, and 100M keys' indexes do not fit in memory as Python
strings). The cost, per key: 8 (hash) + 4 (shard) + 4 (row) + 8 (offset) + the key's bytes
(+ 1/32 for the buckets); for 100M keys of 20 bytes, 4.4 GB on disk, of which a lookup touches
about six pages (the page cache keeps what is hot; nothing is read at open).

Building (:meth:`KeyIndex.build`) hashes each shard index's key blob in one C call
(:func:`tarshards.format.hashing.hash_rows`) and sorts groups of consecutive shards into runs in
parallel (the ``processes``, ``dask`` or ``ray`` engine of :mod:`tarshards.parallel`); a merge
then reads the runs range by range of the hash space (the hashes are uniform, so each range
holds about ``chunk_keys`` keys) and appends each range, sorted, to the table: memory stays at a
few hundred MB whatever the number of keys. The table is the same, byte for byte, for any number of
workers.

Two samples with the same key: ``duplicates="error"`` (the default) raises
:class:`~tarshards.errors.DuplicateKeyError` naming both (after counting all of them);
``duplicates="first"`` keeps the first in manifest order (lowest shard, then row) and records
how many were dropped (:attr:`KeyIndex.duplicates`, the first 100 in the header).

The header holds the manifest's fingerprint (the data's identity) and checksum (over its records:
URLs, counts, sizes and hashes): :meth:`KeyIndex.open` with ``manifest=`` refuses a table built
from another version of the data set, even one with the same shard names and counts
(:class:`~tarshards.errors.IntegrityError`). Tables built before the header had ``checksum``
hold the checksum under ``fingerprint``, and are checked the same way.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import uuid
from typing import Iterable, Sequence

import numpy as np

from ..errors import DuplicateKeyError, IntegrityError, ShardFormatError
from ..format.hashing import hash_rows, member_checksum_fn
from ..format.index import INDEX_SUFFIX, ShardIndex
from ..format.manifest import Manifest, ShardRecord, is_manifest_spec, relative_url, resolve_url
from ..parallel.engines import make_engine
from ..parallel.jobs import ShardJob
from ..parallel.pool import portable_exception
from ..parallel.reports import FAILED, ShardReport
from ..storage import is_local, local_path, url_protocol

__all__ = ["DUPLICATE_POLICIES", "KEYINDEX_FORMAT", "KeyIndex"]

KEYINDEX_FORMAT = "tarshards.keyindex"
KEYINDEX_VERSION = 1
HEADER = "keyindex.json"
DUPLICATE_POLICIES = ("error", "first")
_FILES = {  # name -> dtype, entries ("count", "count+1", "key_bytes" or "buckets+1")
    "hashes": ("<u8", "count", "hashes.u64"),
    "shards": ("<u4", "count", "shards.u32"),
    "rows": ("<u4", "count", "rows.u32"),
    "key_offsets": ("<u8", "count+1", "key_offsets.u64"),
    "keys": ("u1", "key_bytes", "keys.bin"),
    "buckets": ("<u8", "buckets+1", "buckets.u64"),
}
_BUCKET_KEYS = 256  # keys per bucket of the hashes' top bits, on average
_ROW_BITS = 32
_ROW_MASK = np.uint64((1 << _ROW_BITS) - 1)
_EXAMPLES = 100  # duplicates kept in the header
_GATHER_ROWS = 1 << 16  # rows reordered at once (bounds the byte-index array)


# ---------------------------------------------------------------------------------------------
# keys as a blob and offsets
# ---------------------------------------------------------------------------------------------


def _encode_keys(keys) -> tuple[bytes, np.ndarray]:
    """Keys (str or bytes) as their UTF-8 bytes back to back, and the n + 1 offsets."""
    if isinstance(keys, (str, bytes)):
        raise TypeError("lookup takes a collection of keys; use ki[key] or ki.get(key) for one")
    keys = list(keys)
    try:
        joined = "".join(keys)
    except TypeError:  # not all str
        joined = None
    if joined is not None:
        if joined.isascii():
            blob = joined.encode("ascii")
            lengths = np.fromiter(map(len, keys), np.int64, len(keys))
        else:
            raw = [k.encode("utf-8", "surrogateescape") for k in keys]
            blob = b"".join(raw)
            lengths = np.fromiter(map(len, raw), np.int64, len(raw))
    else:
        raw = [_key_bytes(k) for k in keys]
        blob = b"".join(raw)
        lengths = np.fromiter(map(len, raw), np.int64, len(raw))
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return blob, offsets


def _key_bytes(key) -> bytes:
    if isinstance(key, str):
        return key.encode("utf-8", "surrogateescape")
    if isinstance(key, (bytes, bytearray, memoryview)):
        return bytes(key)
    if isinstance(key, np.str_):
        return str(key).encode("utf-8", "surrogateescape")
    raise TypeError(f"a key is a str or bytes, not {type(key).__name__}")


def _reorder_rows(blob: np.ndarray, lengths: np.ndarray, perm: np.ndarray):
    """The rows of ``blob`` (a uint8 array holding rows of ``lengths`` back to back, in order)
    in the order ``perm`` (a selection too), back to back, and their offsets."""
    lengths = np.asarray(lengths, np.int64)
    new_lengths = lengths[perm]
    offsets = np.zeros(len(perm) + 1, np.int64)
    np.cumsum(new_lengths, out=offsets[1:])
    n = len(lengths)
    width = int(lengths.max()) if n else 0
    if not len(perm) or not width:
        return np.zeros(0, np.uint8), offsets
    if n * width <= 4 * len(blob) + (1 << 20):  # rows padded to one width: row copies
        row = np.dtype((np.void, width))  # a row as one item: np.take copies rows whole
        if (lengths == width).all():
            return np.take(np.ascontiguousarray(blob).view(row), perm).view(np.uint8), offsets
        mask = np.arange(width, dtype=np.int64) < lengths[:, None]
        padded = np.zeros((n, width), np.uint8)
        padded[mask] = blob
        taken = np.take(padded.reshape(-1).view(row), perm).view(np.uint8).reshape(-1, width)
        return taken[np.arange(width, dtype=np.int64) < new_lengths[:, None]], offsets
    starts = np.zeros(n, np.int64)  # a few long rows: a byte index, in slices of rows
    np.cumsum(lengths[:-1], out=starts[1:])
    starts = starts[perm]
    out = np.empty(int(offsets[-1]), np.uint8)
    for a in range(0, len(perm), _GATHER_ROWS):
        b = min(a + _GATHER_ROWS, len(perm))
        lo, hi = int(offsets[a]), int(offsets[b])
        if hi == lo:
            continue
        shift = starts[a:b] - offsets[a:b]
        idx = np.repeat(shift, new_lengths[a:b]) + np.arange(lo, hi, dtype=np.int64)
        out[lo:hi] = blob[idx]
    return out, offsets


# ---------------------------------------------------------------------------------------------
# sources
# ---------------------------------------------------------------------------------------------


def _as_manifest(source, storage_options) -> Manifest:
    """A manifest (path, URL or :class:`Manifest`), or a shard spec whose shards have their
    index beside them (``SHARD.tsidx``): a manifest made in memory from those indexes."""
    if isinstance(source, Manifest):
        return source
    if is_manifest_spec(source):
        return Manifest.load(os.fspath(source), storage_options=storage_options)
    from ..read.specs import expand_urls

    urls = expand_urls(source, storage_options=storage_options)
    if not urls:
        raise ValueError(f"no shards in {source!r}")
    records = []
    for url in urls:
        if is_local(url):
            url = os.path.abspath(local_path(url))
        idx = ShardIndex.load(url + INDEX_SUFFIX, storage_options=storage_options)
        records.append(
            ShardRecord(
                url=url,
                samples=idx.num_samples,
                nbytes=idx.nbytes,
                hash=idx.hash,
                index=url + INDEX_SUFFIX,
            )
        )
    return Manifest(tuple(records), storage_options=storage_options)


def _manifest_base(url: str) -> str:
    if is_local(url):
        return os.path.dirname(os.path.abspath(local_path(url)))
    return url.rsplit("/", 1)[0] + "/"


# ---------------------------------------------------------------------------------------------
# building: sorted runs per group of shards (in parallel), then a merge by hash range
# ---------------------------------------------------------------------------------------------


class _RunJob(ShardJob):
    """One group of consecutive shards (``input``: ``"START:STOP"`` of the manifest) -> one
    sorted run at ``output`` (a path prefix): ``.hash`` (uint64), ``.loc`` (shard << 32 | row,
    uint64), ``.koff`` (int64, n + 1) and ``.keys`` (bytes), all in (hash, shard, row) order."""

    def __init__(self, index_urls, shard_urls, records, storage_options):
        self.index_urls = index_urls
        self.shard_urls = shard_urls
        self.records = records  # (samples, nbytes, hash) per shard
        self.storage_options = storage_options
        self.error: Exception | None = None

    def __call__(self, inp: str, out: str) -> ShardReport:
        report = super().__call__(inp, out)
        if report.status == FAILED and self.error is not None:
            report.messages = [portable_exception(self.error)]  # raised as it is by the caller
        return report

    def _run(self, report) -> None:
        self.error = None
        try:
            self._sort(report)
        except Exception as exc:
            self.error = exc
            raise

    def _sort(self, report) -> None:
        start, stop = map(int, report.input.split(":"))
        hashes, locs, blobs, lengths = [], [], [], []
        for s in range(start, stop):
            index_url = self.index_urls[s]
            if index_url is None:
                raise ShardFormatError(
                    "the manifest has no index for this shard (make one with: tarshards index "
                    "SPEC -o MANIFEST)",
                    url=self.shard_urls[s],
                )
            with _shard_keys(index_url, self.storage_options) as idx:
                samples, _nbytes, shard_hash = self.records[s]
                if idx.num_samples != samples or (
                    shard_hash is not None and idx.hash is not None and idx.hash != shard_hash
                ):
                    raise IntegrityError(
                        f"the shard's index ({idx.num_samples} samples, {idx.hash}) does not "
                        f"match the manifest ({samples} samples, {shard_hash}): rebuild the index",
                        url=self.shard_urls[s],
                    )
                if samples >= 1 << _ROW_BITS:
                    raise ValueError(f"{self.shard_urls[s]}: more than 2**32 samples in one shard")
                offsets = np.array(idx.key_offsets, np.int64)  # copies: the map is closed after
                blob = np.array(idx.key_blob[int(offsets[0]) : int(offsets[-1])], np.uint8)
                del idx
            offsets -= offsets[0]
            hashes.append(np.frombuffer(hash_rows(blob, offsets), np.uint64))
            locs.append(
                (np.uint64(s) << np.uint64(_ROW_BITS)) | np.arange(samples, dtype=np.uint64)
            )
            blobs.append(blob)
            lengths.append(np.diff(offsets))
        h = np.concatenate(hashes) if hashes else np.zeros(0, np.uint64)
        loc = np.concatenate(locs) if locs else np.zeros(0, np.uint64)
        blob = np.concatenate(blobs) if blobs else np.zeros(0, np.uint8)
        lens = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        order = _hash_order(h)
        keys, koff = _reorder_rows(blob, lens, order)
        out = report.output
        np.take(h, order).tofile(out + ".hash")
        np.take(loc, order).tofile(out + ".loc")
        koff.tofile(out + ".koff")
        keys.tofile(out + ".keys")
        report.samples_in = report.samples_out = len(h)


@contextlib.contextmanager
def _shard_keys(index_url: str, storage_options):
    """The shard index at ``index_url``; a local one memory-mapped, so that only its keys' pages
    are read (a third of the file or less), the map closed after."""
    if not is_local(index_url):
        yield ShardIndex.load(index_url, storage_options=storage_options)
        return
    path = local_path(index_url)
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            yield ShardIndex.from_bytes(b"", url=index_url)  # raises: truncated
            return
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        view = memoryview(mm)  # from_bytes takes any buffer (its arrays: views of it)
        yield ShardIndex.from_bytes(view, url=index_url)
        del view
    finally:
        try:
            mm.close()
        except BufferError:  # a view still held (an error's traceback): the GC closes it
            pass


def _hash_order(h: np.ndarray) -> np.ndarray:
    """The stable order of ``h`` (equal hashes keep their order: (shard, row)), by the fast
    unstable sort (5x numpy's stable one on random uint64) and a fix of the rare ties."""
    order = np.argsort(h)
    hs = np.take(h, order)
    tie = np.flatnonzero(hs[1:] == hs[:-1])
    if len(tie):  # every member of each run of equal hashes, sorted by (hash, position)
        at = np.union1d(tie, tie + 1)
        order[at] = order[at][np.lexsort((order[at], hs[at]))]
    return order


def _groups(manifest: Manifest, group_keys: int) -> list[tuple[int, int]]:
    """Consecutive shards, about ``group_keys`` samples a group (at least one shard)."""
    out = []
    start, total = 0, 0
    for i, r in enumerate(manifest.shards):
        if total and total + r.samples > group_keys:
            out.append((start, i))
            start, total = i, 0
        total += r.samples
    if start < len(manifest.shards):
        out.append((start, len(manifest.shards)))
    return out


class _Run:
    """A sorted run on disk, read by slices (files opened per read: no descriptors held)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.n = os.path.getsize(prefix + ".hash") // 8

    def read(self, suffix: str, dtype, start: int, stop: int) -> np.ndarray:
        size = np.dtype(dtype).itemsize
        return np.fromfile(self.prefix + suffix, dtype, stop - start, offset=start * size)


def _bucket_bits(n: int) -> int:
    """Bits of the hash that number the buckets: about ``_BUCKET_KEYS`` keys a bucket."""
    bits = 0
    while (n >> bits) > _BUCKET_KEYS and bits < 40:
        bits += 1
    return bits


def _bounds(n_ranges: int) -> np.ndarray:
    """The starts of ``n_ranges`` equal ranges of the uint64 hash space (the last range runs
    to the end of it)."""
    step = (1 << 64) // n_ranges
    return np.array([i * step for i in range(n_ranges)], np.uint64)


class _Merger:
    """Merges the runs range by range and appends to the table's files."""

    def __init__(self, folder: str, shard_urls: Sequence[str], duplicates: str):
        self.folder = folder
        self.shard_urls = shard_urls
        self.policy = duplicates
        self.files = {
            name: open(os.path.join(folder, fname), "wb") for name, (_, _, fname) in _FILES.items()
        }
        self.count = 0
        self.key_bytes = 0
        self.dropped = 0
        self.examples: list = []
        self.collisions = 0
        self.files["key_offsets"].write(np.zeros(1, "<u8").tobytes())
        self.bucket_bits = 0
        self.bucket_counts = np.zeros(1, np.int64)

    def close(self) -> None:
        buckets = np.zeros(len(self.bucket_counts) + 1, "<u8")
        np.cumsum(self.bucket_counts, out=buckets[1:])
        self.files["buckets"].write(buckets.tobytes())
        for f in self.files.values():
            f.close()

    def merge(self, runs: list[_Run], chunk_keys: int) -> None:
        total = sum(r.n for r in runs)
        self.bucket_bits = _bucket_bits(total)
        self.bucket_counts = np.zeros(1 << self.bucket_bits, np.int64)
        n_ranges = max(1, -(-total // max(1, chunk_keys)))
        bounds = _bounds(n_ranges)
        cuts = []  # per run: where each range starts in it, and its end
        for run in runs:
            h = run.read(".hash", "<u8", 0, run.n)
            cuts.append(np.append(np.searchsorted(h, bounds), run.n).tolist())
            del h
        for r in range(n_ranges):
            parts = [(run, c[r], c[r + 1]) for run, c in zip(runs, cuts) if c[r + 1] > c[r]]
            if parts:
                self._range(parts)

    def _range(self, parts) -> None:
        hashes, locs, blobs, lengths = [], [], [], []
        for run, a, b in parts:
            hashes.append(run.read(".hash", "<u8", a, b))
            locs.append(run.read(".loc", "<u8", a, b))
            koff = run.read(".koff", "<i8", a, b + 1)
            blobs.append(run.read(".keys", "u1", int(koff[0]), int(koff[-1])))
            lengths.append(np.diff(koff))
        h = np.concatenate(hashes)
        loc = np.concatenate(locs)
        blob = np.concatenate(blobs)
        lens = np.concatenate(lengths)
        # (hash, shard, row): one order whatever the runs. The parts come in run order, runs
        # in shard order and each in (hash, shard, row) order, so a stable sort by hash gives
        # it (timsort merges the sorted parts)
        order = np.argsort(h, kind="stable")
        h, loc = np.take(h, order), np.take(loc, order)
        keep = self._check_ties(h, loc, blob, lens, order)
        if keep is not None:
            h, loc, order = h[keep], loc[keep], order[keep]
        keys, koff = _reorder_rows(blob, lens, order)
        f = self.files
        f["hashes"].write(h.astype("<u8", copy=False).tobytes())
        f["shards"].write((loc >> np.uint64(_ROW_BITS)).astype("<u4").tobytes())
        f["rows"].write((loc & _ROW_MASK).astype("<u4").tobytes())
        f["key_offsets"].write((koff[1:] + self.key_bytes).astype("<u8").tobytes())
        f["keys"].write(keys.tobytes())
        if self.bucket_bits:
            self.bucket_counts += np.bincount(
                (h >> np.uint64(64 - self.bucket_bits)).astype(np.int64),
                minlength=len(self.bucket_counts),
            )
        else:
            self.bucket_counts[0] += len(h)
        self.count += len(h)
        self.key_bytes += int(koff[-1])

    def _check_ties(self, h, loc, blob, lens, order):
        """Equal hashes (``h``, ``loc``: sorted; ``order``: their rows in ``blob``/``lens``):
        the same key twice (a duplicate: dropped or counted for the error) or two keys sharing
        a hash (a collision: both kept, the lookup compares keys). Returns the rows to keep, or
        None for all."""
        tie = np.flatnonzero(h[1:] == h[:-1])
        if not len(tie):
            return None
        starts = np.zeros(len(lens), np.int64)
        np.cumsum(lens[:-1], out=starts[1:])
        starts, lens = starts[order], lens[order]
        drop = []
        i = 0
        ties = tie.tolist()
        while i < len(ties):  # runs of equal hashes
            first = ties[i]
            last = first + 1
            while i + 1 < len(ties) and ties[i + 1] == last:
                i += 1
                last += 1
            i += 1
            seen: dict = {}
            kept = 0
            for j in range(first, last + 1):
                key = bytes(blob[starts[j] : starts[j] + lens[j]])
                if key in seen:
                    self._duplicate(key, int(loc[seen[key]]), int(loc[j]))
                    drop.append(j)
                else:
                    seen[key] = j
                    kept += 1
            if kept > 1:
                self.collisions += kept
        if not drop:
            return None
        keep = np.ones(len(h), bool)
        keep[drop] = False
        return keep

    def _duplicate(self, key: bytes, first: int, later: int) -> None:
        self.dropped += 1
        if len(self.examples) < _EXAMPLES:
            self.examples.append(
                [
                    key.decode("utf-8", "surrogateescape"),
                    [first >> _ROW_BITS, first & int(_ROW_MASK)],
                    [later >> _ROW_BITS, later & int(_ROW_MASK)],
                ]
            )


def _duplicate_error(examples: list, count: int, shard_urls) -> DuplicateKeyError:
    key, (s1, r1), (s2, r2) = examples[0]
    return DuplicateKeyError(
        f"{count} key(s) name more than one sample; the first: {key!r} is row {r1} of "
        f"{shard_urls[s1]} and row {r2} of this shard (KeyIndex.build(..., "
        f"duplicates='first') keeps the first in manifest order)",
        url=shard_urls[s2],
        member=key,
    )


# ---------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------


class KeyIndex:
    """Key -> (shard URL, row) for a whole data set (see the module docstring).

    ``ki[key]`` -> ``(shard_url, row)`` (``KeyError`` when missing), ``ki.get(key, default)``,
    ``key in ki``, ``len(ki)``; :meth:`lookup` for many keys at once (numpy arrays of shard
    numbers and rows, -1 where missing); :meth:`locate` for one key's ``(shard, row)`` numbers.
    ``shard_urls[i]`` is shard ``i``'s URL (the manifest's order). Read-only; the arrays are
    memory-mapped, so opening costs nothing and worker processes share the pages.
    """

    def __init__(self, path: str, header: dict, arrays: dict, shard_urls: list[str]):
        self.path = path
        self.header = header
        self._arrays = arrays
        self.hashes: np.ndarray = arrays["hashes"]
        self.shards: np.ndarray = arrays["shards"]
        self.rows: np.ndarray = arrays["rows"]
        self.key_offsets: np.ndarray = arrays["key_offsets"]
        self.key_bytes: np.ndarray = arrays["keys"]
        self.buckets: np.ndarray = arrays["buckets"]  # where each top-bits bucket starts
        self.shard_urls = shard_urls
        # plain ndarray views of the same mappings: indexing skips np.memmap's subclass hooks
        self._h, self._s, self._r, self._o, self._k, self._b = (
            arrays[name].view(np.ndarray)
            for name in ("hashes", "shards", "rows", "key_offsets", "keys", "buckets")
        )
        self._shift = 64 - int(header["bucket_bits"])
        self._count = int(header["count"])
        self._collisions = int(header.get("collisions", 0))
        self._digest = member_checksum_fn("xxh3_64")

    # ---- building ----------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        source,
        output,
        *,
        engine="processes",
        workers: int | None = None,
        address: str | None = None,
        client=None,
        duplicates: str = "error",
        storage_options: dict | None = None,
        group_keys: int | None = None,
        chunk_keys: int = 1 << 21,
    ) -> "KeyIndex":
        """Build the key table of ``source`` at ``output`` (a local directory) and open it.

        ``source``: a manifest (path, URL or :class:`~tarshards.Manifest`) whose shards have
        index files, or a shard spec whose shards have ``SHARD.tsidx`` beside them. Groups of
        consecutive shards (about ``group_keys`` keys each) are hashed and sorted on
        ``engine`` (``"processes"``, ``"dask"``, ``"ray"`` or an engine object; ``workers`` of
        them, by default one per CPU; one worker runs in this process; by default groups are
        sized to give each worker four, up to 1M keys each), into a temporary folder beside
        ``output``; the merge holds about ``chunk_keys`` keys at once. ``address``: the Dask
        scheduler or Ray cluster (``client``: a Dask client); by default a local cluster of
        ``workers`` is started for the job, or with Ray, the one this process is connected to is
        used. The cluster's workers must see ``output``'s folder (a local cluster does; a remote
        one needs a shared file system there). ``duplicates``: ``"error"`` or
        ``"first"`` (see the module docstring). An existing table at ``output`` is replaced
        when the new one is complete.
        """
        if duplicates not in DUPLICATE_POLICIES:
            raise ValueError(
                f"duplicates must be one of {', '.join(DUPLICATE_POLICIES)}, not {duplicates!r}"
            )
        output = os.fspath(output)
        if url_protocol(output) is not None and not output.startswith("file:"):
            raise ValueError("a key index is written to a local directory (it is memory-mapped)")
        output = os.path.abspath(local_path(output))
        if os.path.exists(output) and not os.path.exists(os.path.join(output, HEADER)):
            raise ValueError(f"{output} exists and is not a key index; choose another path")
        manifest = _as_manifest(source, storage_options)
        storage_options = storage_options or manifest.storage_options
        shard_urls = manifest.shard_urls()
        index_urls = [manifest.index_url(i) for i in range(len(manifest.shards))]
        records = [(r.samples, r.nbytes, r.hash) for r in manifest.shards]
        tmp = f"{output}.tmp-{uuid.uuid4().hex[:12]}"
        os.makedirs(os.path.join(tmp, "runs"))
        try:
            if group_keys is None:  # enough groups to keep the workers busy, up to 1M keys each
                n_workers = workers or os.cpu_count() or 1
                group_keys = min(1 << 20, -(-manifest.num_samples // (4 * n_workers)))
            groups = _groups(manifest, max(1, group_keys))
            pairs = [
                (f"{a}:{b}", os.path.join(tmp, "runs", f"{g:06d}"))
                for g, (a, b) in enumerate(groups)
            ]
            job = _RunJob(index_urls, shard_urls, records, storage_options)
            _run_jobs(job, pairs, engine, workers, address, client)
            merger = _Merger(tmp, shard_urls, duplicates)
            try:
                merger.merge([_Run(out) for _, out in pairs], chunk_keys)
            finally:
                merger.close()
            shutil.rmtree(os.path.join(tmp, "runs"))
            if merger.dropped and duplicates == "error":
                raise _duplicate_error(merger.examples, merger.dropped, shard_urls)
            header = _header(manifest, output, merger, duplicates)
            with open(os.path.join(tmp, HEADER), "w", encoding="utf-8") as f:
                f.write(json.dumps(header, indent=1, sort_keys=True) + "\n")
            _commit(tmp, output)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return cls.open(output, manifest=manifest)

    # ---- opening -----------------------------------------------------------------------------
    @classmethod
    def open(cls, path, *, manifest=None, storage_options: dict | None = None) -> "KeyIndex":
        """Open the key table at ``path`` (memory-mapped: nothing is read but the header).

        With ``manifest`` (a manifest path, URL, :class:`~tarshards.Manifest` or the shard spec
        it was built from), the table must have been built from that data set (the same
        fingerprint), else :class:`~tarshards.errors.IntegrityError`; its shard URLs are then
        taken from it (a data set moved as a whole still opens). Without, the shard URLs are
        resolved against where the manifest was when the table was built.
        """
        path = os.path.abspath(local_path(os.fspath(path)))
        head = os.path.join(path, HEADER)
        if not os.path.exists(head):
            raise ShardFormatError(f"{path} is not a key index (no keyindex.json)")
        try:
            with open(head, encoding="utf-8") as f:
                header = json.load(f)
            fmt, version = header["format"], header["version"]
            count, key_bytes = int(header["count"]), int(header["key_bytes"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ShardFormatError(f"corrupt key index header {head}: {exc}") from None
        if fmt != KEYINDEX_FORMAT:
            raise ShardFormatError(f"{head} is not a key index (format {fmt!r})")
        if version != KEYINDEX_VERSION:
            raise ShardFormatError(
                f"key index {path}: version {version} is not supported (this tarshards reads "
                f"version {KEYINDEX_VERSION})"
            )
        bits = int(header.get("bucket_bits", -1))
        if not 0 <= bits <= 40:
            raise ShardFormatError(f"corrupt key index header {head}: bucket_bits {bits}")
        sizes = {
            "count": count,
            "count+1": count + 1,
            "key_bytes": key_bytes,
            "buckets+1": (1 << bits) + 1,
        }
        arrays = {}
        for name, (dtype, per, fname) in _FILES.items():
            n = sizes[per]
            file = os.path.join(path, fname)
            want = n * np.dtype(dtype).itemsize
            got = os.path.getsize(file) if os.path.exists(file) else -1
            if got != want:
                raise IntegrityError(
                    f"key index {path}: {fname} has {got} bytes, its header says {want}"
                )
            arrays[name] = np.memmap(file, dtype, "r", shape=(n,)) if n else np.zeros(0, dtype)
        stored = header["manifest"]
        if manifest is not None:
            m = _as_manifest(manifest, storage_options)
            # the records' checksum (keys are content: same names and counts do not suffice);
            # a table built before the header had "checksum" holds it under "fingerprint"
            saved = stored.get("checksum", stored["fingerprint"])
            if m.checksum != saved:
                raise IntegrityError(
                    f"the key index {path} was built from another version of the data set "
                    f"(its manifest's checksum {saved}, this one's {m.checksum}): rebuild it "
                    "with KeyIndex.build"
                )
            shard_urls = m.shard_urls()
        else:
            where = stored.get("url")
            base = None
            if where is not None:
                base = _manifest_base(resolve_url(where, os.path.dirname(path)))
            shard_urls = [resolve_url(u, base) for u in header["shards"]]
        return cls(path, header, arrays, shard_urls)

    def __reduce__(self):  # worker processes map the same files
        return (_reopen, (self.path, self.shard_urls))

    # ---- values ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._count

    @property
    def fingerprint(self) -> str:
        """The fingerprint of the data the table was built from
        (:attr:`tarshards.Manifest.fingerprint`; a table built before the header had
        ``checksum`` holds that manifest's checksum here)."""
        return self.header["manifest"]["fingerprint"]

    @property
    def duplicates(self) -> int:
        """How many samples were left out as later duplicates of a key (``duplicates="first"``)."""
        return int(self.header["duplicates"]["count"])

    @property
    def nbytes(self) -> int:
        """The table's size on disk (the arrays; the header aside)."""
        return sum(int(a.nbytes) for a in self._arrays.values())

    def __repr__(self) -> str:
        return f"KeyIndex({self._count} keys, {len(self.shard_urls)} shards, path={self.path!r})"

    # ---- one key -----------------------------------------------------------------------------
    def locate(self, key) -> tuple[int, int] | None:
        """``(shard number, row)`` of ``key``, or None."""
        kb = _key_bytes(key)
        h = self._digest(kb)
        hashes = self._h
        bucket = h >> self._shift
        lo, hi = self._b[bucket : bucket + 2].tolist()  # the keys whose hash has these top bits
        j = lo + int(hashes[lo:hi].searchsorted(np.uint64(h)))
        while j < hi and int(hashes[j]) == h:
            a, b = self._o[j : j + 2].tolist()
            if b - a == len(kb) and self._k[a:b].tobytes() == kb:
                return int(self._s[j]), int(self._r[j])
            j += 1
        return None

    def get(self, key, default=None):
        """``(shard_url, row)`` of ``key``, or ``default``."""
        found = self.locate(key)
        if found is None:
            return default
        return self.shard_urls[found[0]], found[1]

    def __getitem__(self, key) -> tuple[str, int]:
        found = self.locate(key)
        if found is None:
            raise KeyError(key)
        return self.shard_urls[found[0]], found[1]

    def __contains__(self, key) -> bool:
        return self.locate(key) is not None

    # ---- many keys ---------------------------------------------------------------------------
    def lookup(self, keys: Iterable) -> tuple[np.ndarray, np.ndarray]:
        """Shard numbers and rows (int64 arrays; -1 where a key is missing) of ``keys``: one
        hash pass, one ``searchsorted`` of the sorted hashes (the table read in order) and a
        vectorised comparison of the keys' bytes. ``ki.shard_urls[shard]`` names the shard."""
        blob, qoff = _encode_keys(keys)
        n_q = len(qoff) - 1
        shard = np.full(n_q, -1, np.int64)
        row = np.full(n_q, -1, np.int64)
        if not n_q or not self._count:
            return shard, row
        h = np.frombuffer(hash_rows(blob, qoff), np.uint64)
        order = np.argsort(h)  # the queries in hash order: the binary searches and the
        hs = h[order]  # gathers below walk the table forwards
        pos = self._lower_bound(hs)
        cand = np.flatnonzero(pos < self._count)
        cand = cand[self._h[pos[cand]] == hs[cand]]
        j = pos[cand]
        q = order[cand]
        ok = self._same_keys(np.frombuffer(blob, np.uint8), qoff, q, j)
        shard[q[ok]] = self._s[j[ok]]
        row[q[ok]] = self._r[j[ok]]
        if self._collisions:  # a key that shares its hash: the others of its run, one by one
            qbytes = memoryview(blob)
            for i in q[~ok].tolist():
                found = self.locate(bytes(qbytes[qoff[i] : qoff[i + 1]]))
                if found is not None:
                    shard[i], row[i] = found
        return shard, row

    def _lower_bound(self, hs: np.ndarray) -> np.ndarray:
        """``np.searchsorted(hashes, hs)``, each search within its bucket: a handful of pages
        of the hashes instead of ~27 probes across the file."""
        if self._shift >= 64:
            return np.searchsorted(self._h, hs)
        bucket = (hs >> np.uint64(self._shift)).astype(np.int64)
        lo = self._b[bucket].astype(np.int64)
        hi = self._b[bucket + 1].astype(np.int64)
        last = self._count - 1
        while True:
            active = lo < hi
            if not active.any():
                return lo
            mid = (lo + hi) >> 1
            below = (self._h[np.minimum(mid, last)] < hs) & active
            lo = np.where(below, mid + 1, lo)
            hi = np.where(active & ~below, mid, hi)

    def _same_keys(self, qblob, qoff, q, j) -> np.ndarray:
        """Whether query key ``q[i]`` is the table's key ``j[i]``, for each ``i``."""
        qa = qoff[q]
        qlen = qoff[q + 1] - qa
        ka = self._o[j].astype(np.int64)
        klen = self._o[j + 1].astype(np.int64) - ka
        same = qlen == klen
        idx = np.flatnonzero(same & (qlen > 0))
        if not len(idx):
            return same
        lens = qlen[idx]
        width = int(lens[0])
        if (lens == width).all():  # keys of one length (the usual case): a 2-D gather
            cols = np.arange(width, dtype=np.int64)
            qi = qa[idx, None] + cols
            ki = ka[idx, None] + cols
            bad = (qblob[qi] != self._k[ki]).any(axis=1)
        else:
            ends = np.cumsum(lens)
            firsts = ends - lens
            pos = np.arange(int(ends[-1]), dtype=np.int64)
            qi = np.repeat(qa[idx] - firsts, lens) + pos
            ki = np.repeat(ka[idx] - firsts, lens) + pos
            differ = qblob[qi] != self._k[ki]
            bad = np.add.reduceat(differ.astype(np.int64), firsts) > 0
        same[idx[bad]] = False
        return same


def _reopen(path, shard_urls):
    ki = KeyIndex.open(path)
    ki.shard_urls = list(shard_urls)
    return ki


def _run_jobs(job, pairs, engine, workers, address=None, client=None) -> None:
    if workers is not None and (not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    failed = []
    if engine == "processes" and (workers == 1 or len(pairs) == 1) and address is None:
        for inp, out in pairs:  # in this process: its errors raised as they are
            job._sort(ShardReport(inp, out))
    else:
        eng = make_engine(engine, workers=workers, address=address, client=client)
        done: list = []
        eng.run(job, pairs, list(range(len(pairs))), lambda i, r: done.append(r))
        failed = [r for r in done if r.status == FAILED]
    if failed:
        first = min(failed, key=lambda r: int(r.input.split(":")[0]))
        if first.messages and isinstance(first.messages[0], BaseException):
            raise first.messages[0]
        raise RuntimeError(
            f"the key index could not be built: {len(failed)} group(s) of shards failed; the "
            f"first (shards {first.input} of the manifest): {first.error}"
        )


def _header(manifest: Manifest, output: str, merger: _Merger, duplicates: str) -> dict:
    where = None
    if manifest.url is not None:
        where = relative_url(manifest.url, os.path.dirname(output))
        if is_local(where) and os.path.isabs(where):
            where = os.path.abspath(where)
    return {
        "format": KEYINDEX_FORMAT,
        "version": KEYINDEX_VERSION,
        "hash": "xxh3_64",
        "count": merger.count,
        "bucket_bits": merger.bucket_bits,
        "key_bytes": merger.key_bytes,
        "collisions": merger.collisions,
        "duplicates": {"policy": duplicates, "count": merger.dropped, "first": merger.examples},
        "manifest": {
            "fingerprint": manifest.fingerprint,
            "checksum": manifest.checksum,
            "url": where,
            "num_samples": manifest.num_samples,
        },
        "shards": [r.url for r in manifest.shards],
        "files": {name: [fname, dtype] for name, (dtype, _, fname) in _FILES.items()},
    }


def _commit(tmp: str, output: str) -> None:
    """``tmp`` under the name ``output`` (an older table there replaced)."""
    if os.path.exists(output):
        old = f"{output}.old-{uuid.uuid4().hex[:12]}"
        os.replace(output, old)
        os.replace(tmp, output)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, output)
