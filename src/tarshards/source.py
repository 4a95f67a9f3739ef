"""Epoch plans over virtual readers, and the cursor that reads one reader's part of an epoch.

The plan is what makes resuming exact and elastic. It is a pure function of the data (the shard
table's sample counts and fingerprint), the seed, the epoch and the plan's parameters: the number
``readers`` of *virtual readers* V and the batch size B. It never depends on the process that
runs it (rank, DataLoader worker).

- The epoch's list of samples is the shards in the epoch's order (shuffled from (seed, epoch)),
  each in its file order. With ``remainder="carry"`` the list starts with the samples the
  previous epoch left over.
- The list is cut into V equal *segments* of ``q * B`` samples (cut mid-shard where needed); the
  rest is dropped (``"drop"``), carried into the next epoch (``"carry"``), or the list is padded
  with repeated samples flagged ``__pad__`` (``"pad"``). Every reader thus yields exactly ``q``
  batches of exactly ``B`` samples.
- *Global batch* ``g`` of the epoch is batch ``g // V`` of reader ``g % V``. Step ``k`` of a world
  of R ranks delivers global batches ``O + k R + r`` (rank r, origin O); R must divide V, so a
  rank hosts the fixed set of readers ``v = (O + r) mod R (mod R)``: its stream depends on R and
  r, never on the number of DataLoader workers.
- A position in an epoch is the number G of global batches delivered, the same on every rank
  (ranks move in step). Resuming on another world size R' continues the same global order from
  G (origin O = G): every sample not yet delivered comes exactly once, and the last step is
  filled with batches flagged ``__pad__`` where ``V q - G`` does not divide by R'.

Within a reader the samples pass a shuffle buffer whose generator is seeded from (seed, epoch,
reader). Its state at any output position follows from the position alone: :class:`ReaderStream`
replays the buffer's index arithmetic on sample positions (integers, no data) and then reads only
the samples the buffer holds, seeking to their byte offsets in plain tar shards.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import json
import os
import random
from dataclasses import dataclass
from typing import Callable, Generator, Iterator, Sequence

from ._lazy import LazyModule
from .errors import ResumeError, TarshardsError
from .format import group_samples
from .shards import shard_order
from .tario import iter_tar_batches, tar_byte_source

np = LazyModule("numpy", globals(), "np")

__all__ = [
    "EpochPlan",
    "PlanConfig",
    "ReaderStream",
    "Schedule",
    "ShardTable",
    "ShuffleCore",
    "STATE_FORMAT",
    "scan_shards",
]

STATE_FORMAT = "tarshards.resume/1"
REMAINDERS = ("drop", "carry", "pad")


# ---------------------------------------------------------------------------------------------
# the data: per-shard sample counts (and byte offsets)
# ---------------------------------------------------------------------------------------------


class ShardTable:
    """The shards of a data set with their sample counts, a fingerprint and (optionally) the byte
    offset of every sample in each shard (for seeking).

    ``offsets[i]`` is a sequence of the byte offsets of shard i's samples, or ``None`` when not
    known (the shard is then read from its start and samples are skipped). ``plain[i]`` says the
    shard is an uncompressed tar (offsets can be sought).
    """

    def __init__(
        self,
        urls: Sequence[str],
        counts: Sequence[int],
        *,
        fingerprint: str | None = None,
        offsets: Sequence | None = None,
        plain: Sequence[bool] | None = None,
    ):
        self.urls = tuple(os.fspath(u) for u in urls)
        self.counts = tuple(int(c) for c in counts)
        if len(self.urls) != len(self.counts):
            raise ValueError("one count per shard")
        if any(c < 0 for c in self.counts):
            raise ValueError("sample counts are non-negative")
        self.offsets = list(offsets) if offsets is not None else [None] * len(self.urls)
        self.plain = list(plain) if plain is not None else [not _compressed(u) for u in self.urls]
        self.fingerprint = fingerprint or _fingerprint(self.urls, self.counts)
        self._manifest = None

    @classmethod
    def from_manifest(cls, manifest, urls: Sequence[str] | None = None) -> "ShardTable":
        """Counts and fingerprint from a :class:`tarshards.manifest.Manifest`; sample offsets
        from its per-shard indexes, loaded when a shard is first sought."""
        urls = list(urls) if urls is not None else manifest.shard_urls()
        table = cls(urls, [r.samples for r in manifest.shards], fingerprint=manifest.fingerprint)
        table._manifest = manifest
        return table

    def sample_offsets(self, shard: int):
        """Byte offsets of shard ``shard``'s samples in its plain tar file, or ``None``."""
        offs = self.offsets[shard]
        if offs is None and self._manifest is not None and self.plain[shard]:
            offs = False
            if self._manifest.shards[shard].index is not None:
                idx = self._manifest.load_index(shard)
                if getattr(idx, "compression", "none") == "none" and idx.seekable:
                    offs = idx.sample_offsets
            self.offsets[shard] = offs
        return offs if offs is not False else None

    @property
    def num_samples(self) -> int:
        return sum(self.counts)

    def __len__(self):
        return len(self.urls)

    def __repr__(self):
        return (
            f"ShardTable({len(self.urls)} shards, {self.num_samples} samples, "
            f"fingerprint {self.fingerprint[:12]})"
        )


def _compressed(url: str) -> bool:
    return str(url).lower().endswith((".gz", ".tgz", ".zst", ".tzst"))


def _fingerprint(urls, counts) -> str:
    names = [u.rstrip("/").rsplit("/", 1)[-1] for u in urls]
    text = json.dumps([names, list(counts)], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def scan_shards(urls: Sequence[str], *, opener: Callable, last_dot: bool = False) -> ShardTable:
    """Read every shard once and record its sample count and sample byte offsets.

    This is what a manifest/index stores; without one, a resumable pipeline scans the shards when
    it first needs the plan (once per process that builds it).
    """
    counts, offsets, plain = [], [], []
    for url in urls:
        try:
            with opener(url) as stream:
                src = tar_byte_source(stream, url)
                is_plain = hasattr(src, "readinto")
                batches = iter_tar_batches(src, url)
                groups = group_samples(batches, url, last_dot=last_dot, batched=True)
                offs = [sample["__offset__"] for sample in groups]
        except TarshardsError as exn:
            raise exn.with_context(url=url) from None
        counts.append(len(offs))
        offsets.append(np.asarray(offs, dtype=np.int64))
        plain.append(is_plain)
    return ShardTable(urls, counts, offsets=offsets, plain=plain)


# ---------------------------------------------------------------------------------------------
# the plan
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanConfig:
    """The parameters of a plan (with the data's fingerprint, what a saved state must match)."""

    seed: int = 0
    readers: int = 60
    batch_size: int = 1
    remainder: str = "drop"
    shardshuffle: bool = True
    bufsize: int = 0
    initial: int | None = None

    def __post_init__(self):
        if self.readers < 1:
            raise ValueError(f"readers must be >= 1, got {self.readers}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.remainder not in REMAINDERS:
            raise ValueError(
                f"remainder must be one of {', '.join(REMAINDERS)}, got {self.remainder!r}"
            )

    def identity(self, fingerprint: str) -> dict:
        """What a state records to be checked on load."""
        return {
            "fingerprint": fingerprint,
            "seed": self.seed,
            "readers": self.readers,
            "batch_size": self.batch_size,
            "remainder": self.remainder,
            "shardshuffle": self.shardshuffle,
            "bufsize": self.bufsize,
            "initial": self.initial,
        }


class EpochPlan:
    """The epoch's sample list cut into ``readers`` segments of ``q * batch_size`` samples.

    The list is a sequence of *runs* ``(shard, start, stop, pad)``. ``q`` is the number of
    batches each reader yields; ``num_batches = readers * q`` the epoch's global batches.
    """

    def __init__(self, counts: Sequence[int], config: PlanConfig, epoch: int):
        self.config = config
        self.epoch = int(epoch)
        counts = list(counts)
        V, B = config.readers, config.batch_size
        VB = V * B
        N = sum(counts)
        if N == 0:
            raise ValueError("the data set has no samples")
        if config.remainder != "pad" and N < VB:
            raise ValueError(
                f"{N} samples are fewer than readers x batch_size = {V} x {B} = {VB}: every "
                "reader needs at least one full batch (use fewer readers, a smaller batch, or "
                "remainder='pad')"
            )
        order = shard_order(
            range(len(counts)), seed=config.seed, epoch=self.epoch, shuffle=config.shardshuffle
        )
        runs: list[tuple[int, int, int, bool]] = []
        if config.remainder == "carry" and self.epoch > 0:
            carried = (self.epoch * N) % VB  # what epoch - 1 left over: the end of its order
            prev = shard_order(
                range(len(counts)),
                seed=config.seed,
                epoch=self.epoch - 1,
                shuffle=config.shardshuffle,
            )
            tail = []
            for s in reversed(prev):
                if carried <= 0:
                    break
                take = min(carried, counts[s])
                if take:
                    tail.append((s, counts[s] - take, counts[s], False))
                carried -= take
            runs.extend(reversed(tail))
        runs.extend((s, 0, counts[s], False) for s in order if counts[s])
        length = sum(r[2] - r[1] for r in runs)
        if config.remainder == "pad":
            q = -(-length // VB)
            missing = q * VB - length
            base = list(runs)
            while missing > 0:  # repeat the list from its start, flagged as padding
                for s, a, b, _ in base:
                    take = min(missing, b - a)
                    runs.append((s, a, a + take, True))
                    missing -= take
                    if missing <= 0:
                        break
        else:
            q = length // VB
        self.q = q
        self.num_batches = V * q
        self.segment_length = q * B
        self.runs = runs
        starts, pos = [], 0
        for _, a, b, _ in runs:
            starts.append(pos)
            pos += b - a
        self._starts = starts
        self.length = pos  # padded length; the planned part is [0, V q B)

    def locate(self, position: int) -> tuple[int, int, bool]:
        """(shard, sample index in the shard, pad) of a position in the epoch's list."""
        i = bisect.bisect_right(self._starts, position) - 1
        s, a, _, pad = self.runs[i]
        return s, a + position - self._starts[i], pad

    def segment_runs(self, reader: int, start: int = 0) -> Iterator[tuple[int, int, int, bool]]:
        """The runs of reader ``reader``'s segment from its position ``start`` on."""
        lo = reader * self.segment_length + start
        hi = (reader + 1) * self.segment_length
        if lo >= hi:
            return
        i = bisect.bisect_right(self._starts, lo) - 1
        while i < len(self.runs) and self._starts[i] < hi:
            s, a, b, pad = self.runs[i]
            base = self._starts[i]
            x0 = max(lo, base) - base + a
            x1 = min(hi, base + b - a) - base + a
            if x1 > x0:
                yield s, x0, x1, pad
            i += 1

    def reader_position(self, reader: int, position: int) -> int:
        return reader * self.segment_length + position


@functools.lru_cache(maxsize=64)
def _cached_plan(counts: tuple, config: PlanConfig, epoch: int) -> EpochPlan:
    return EpochPlan(counts, config, epoch)


def plan_for(table: ShardTable, config: PlanConfig, epoch: int) -> EpochPlan:
    return _cached_plan(table.counts, config, int(epoch))


# ---------------------------------------------------------------------------------------------
# which global batches a rank delivers
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Schedule:
    """Rank ``rank`` of ``world_size`` from origin ``origin``: its step ``k`` is global batch
    ``origin + k * world_size + rank``; a global batch at or past ``num_batches`` is padding."""

    num_batches: int
    readers: int
    world_size: int
    rank: int
    origin: int = 0

    def __post_init__(self):
        if self.readers % self.world_size:
            raise ValueError(
                f"{self.world_size} ranks cannot share {self.readers} virtual readers evenly: "
                f"choose readers= divisible by the world size (60 fits 1-6, 10, 12, 15, 20, "
                f"30 ranks; 120, 240, 360 fit more)"
            )

    @property
    def steps(self) -> int:
        """Steps from the origin to the end of the epoch (the same on every rank)."""
        left = self.num_batches - self.origin
        return max(0, -(-left // self.world_size))

    def global_batch(self, step: int) -> int:
        return self.origin + step * self.world_size + self.rank


# ---------------------------------------------------------------------------------------------
# the shuffle buffer, written once for sample positions and for samples
# ---------------------------------------------------------------------------------------------


_END = object()
CHUNK_BYTES = 1 << 17  # a reader's read size: a dozen readers' buffers stay in the CPU caches
_LIST_SAMPLES = 64  # samples handed on in one list


class ShuffleCore:
    """A shuffle buffer whose whole state is (buffer, generator, input consumed, phase).

    :meth:`run` is the one implementation: it is run over integers (positions) to find the
    state at any output position, and over samples to produce the stream. ``run`` resumes from
    the state the object holds, so a core prepared by a replay continues exactly.
    """

    __slots__ = ("bufsize", "initial", "rng", "buf", "emitted", "tail")

    def __init__(self, bufsize: int, initial: int | None, rng: random.Random):
        self.bufsize = bufsize
        self.initial = bufsize if initial is None else max(1, min(initial, bufsize))
        self.rng = rng
        self.buf: list = []
        self.emitted = 0
        self.tail = -1  # >= 0: the input ended, buf is shuffled, next output is buf[tail]

    @property
    def consumed(self) -> int:
        if self.tail >= 0:
            return self.emitted + len(self.buf) - self.tail
        return self.emitted + len(self.buf)

    def run(self, it: Iterator) -> Iterator:
        buf = self.buf
        if self.tail < 0:
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
                    self.emitted += 1
                    yield buf.pop()
            self.rng.shuffle(buf)
            self.tail = 0
        while self.tail < len(buf):
            x = buf[self.tail]
            buf[self.tail] = None
            self.tail += 1
            self.emitted += 1
            yield x

    def replay(self, total: int, outputs: int) -> None:
        """Advance over positions ``0..total-1`` until ``outputs`` have come out (no data)."""
        gen = self.run(iter(range(total)))
        for _ in range(outputs):
            if next(gen, _END) is _END:
                raise ResumeError(f"shuffle replay: {outputs} outputs asked of {total} inputs")
        gen.close()

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

    Samples are read in *chunks* (lists): from a plain tar whose sample offsets are known, each
    chunk is one read of the byte range of about ``chunk_bytes`` worth of samples (so a reader
    holds no buffer between batches, and many readers interleaved stay in the CPU caches);
    otherwise the shard is streamed and cut into lists. Nothing here costs a Python frame per
    sample: the flat stream is ``itertools.chain`` over the chunks, and :meth:`take` slices it
    at C speed.
    """

    def __init__(
        self,
        table: ShardTable,
        plan: EpochPlan,
        reader: int,
        *,
        opener: Callable,
        last_dot: bool = False,
        chunk_bytes: int = CHUNK_BYTES,
    ):
        self.table = table
        self.plan = plan
        self.reader = reader
        self.opener = opener
        self.last_dot = last_dot
        self.chunk_bytes = chunk_bytes
        self.position = 0
        self._it: Iterator | None = None
        self._open: list[Generator] = []  # what close() closes

    def seek(self, position: int) -> None:
        plan, cfg = self.plan, self.plan.config
        if not 0 <= position <= plan.segment_length:
            raise ValueError(f"position {position} outside reader segment of {plan.segment_length}")
        self.close()
        self.position = position
        if cfg.bufsize <= 1:
            self._it = self._read_from(position)
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
        run = core.run(self._read_from(core.consumed))
        self._open.append(run)
        self._it = run

    def take(self, n: int) -> list[dict]:
        """The next ``n`` samples (a list: one batch's worth is taken at C speed)."""
        if self._it is None:
            self.seek(self.position)
        got = list(itertools.islice(self._it, n))  # type: ignore[arg-type]
        self.position += len(got)
        if len(got) < n:
            raise TarshardsError(
                f"reader {self.reader} of epoch {self.plan.epoch} ran out at position "
                f"{self.position} of {self.plan.segment_length}: the shards changed since "
                "they were counted",
                url=None,
            )
        return got

    def skip(self, n: int) -> None:
        self.take(n)

    def close(self) -> None:
        for gen in reversed(self._open):
            gen.close()
        self._open.clear()
        self._it = None

    # ---- reading ---------------------------------------------------------------------------
    def _read_from(self, position: int) -> Iterator[dict]:
        """The segment's samples in list order from ``position`` on (closed by :meth:`close`)."""
        chunks = self.chunks(position)
        self._open.append(chunks)
        return itertools.chain.from_iterable(chunks)

    def chunks(self, position: int = 0) -> Generator[list[dict], None, None]:
        """The segment's samples in list order from ``position`` on, in lists."""
        for shard, a, b, pad in self.plan.segment_runs(self.reader, position):
            yield from self._shard_chunks(shard, a, b, pad)

    def _shard_chunks(self, shard: int, a: int, b: int, pad: bool) -> Iterator[list[dict]]:
        """Samples ``a:b`` of one shard in lists. In a plain tar whose sample offsets are known
        the read starts at sample ``a`` (a seek, or bytes dropped unparsed) and stops at the
        end of sample ``b - 1``; otherwise the first ``a`` samples are parsed and dropped."""
        table = self.table
        url = table.urls[shard]
        offsets = table.sample_offsets(shard) if table.plain[shard] else None
        want = b - a
        try:
            with self.opener(url) as stream:
                size, skip = -1, a
                origin = 0  # where the read starts in the tar stream (samples' __offset__)
                if offsets is not None:
                    begin = int(offsets[a]) if a < len(offsets) else 0
                    if a and not _seek(stream, begin):
                        _discard(stream, begin, url)
                    if a:
                        origin = begin
                    skip = 0
                    if b < len(offsets):  # stop reading where the run ends
                        size = int(offsets[b]) - begin
                src = _Window(stream, size, self.chunk_bytes)
                batches = iter_tar_batches(
                    tar_byte_source(src, url, self.chunk_bytes), url, offset=origin
                )
                groups = group_samples(batches, url, last_dot=self.last_dot, batched=True)
                if skip:
                    next(itertools.islice(groups, skip - 1, skip), None)
                n = 0
                while n < want:
                    chunk = list(itertools.islice(groups, min(want - n, _LIST_SAMPLES)))
                    if not chunk:
                        break
                    for sample in chunk:
                        sample["__pad__"] = pad
                    n += len(chunk)
                    yield chunk
                if n == want:
                    return
        except TarshardsError as exn:
            raise exn.with_context(url=url) from None
        raise TarshardsError(
            f"shard has fewer samples than the {table.counts[shard]} counted (wanted {a}:{b})",
            url=url,
        )

    def read_positions(self, positions: Sequence[int]) -> dict[int, dict]:
        """The samples at some positions of this reader's segment, by position."""
        plan = self.plan
        wanted: dict[tuple[int, int], list[tuple[int, bool]]] = {}
        for p in positions:
            shard, idx, pad = plan.locate(plan.reader_position(self.reader, p))
            wanted.setdefault((shard, idx), []).append((p, pad))
        by_shard: dict[int, list[int]] = {}
        for shard, idx in wanted:
            by_shard.setdefault(shard, []).append(idx)
        out: dict[int, dict] = {}
        for shard, idxs in by_shard.items():
            for idx, sample in self._read_samples(shard, sorted(idxs)):
                for p, pad in wanted[(shard, idx)]:
                    s = dict(sample)
                    s["__pad__"] = pad
                    out[p] = s
        return out

    def _read_samples(self, shard: int, idxs: list[int]) -> Iterator[tuple[int, dict]]:
        table = self.table
        url = table.urls[shard]
        offsets = table.sample_offsets(shard)
        try:
            with self.opener(url) as stream:
                if offsets is not None and table.plain[shard] and _seekable(stream):
                    # one read per run of nearby samples (gaps of a few samples read through)
                    n = len(offsets)
                    runs, start = [], 0
                    for k in range(1, len(idxs) + 1):
                        if k == len(idxs) or idxs[k] - idxs[k - 1] > 4:
                            runs.append(idxs[start:k])
                            start = k
                    for run in runs:
                        lo, hi = run[0], run[-1]
                        begin = int(offsets[lo])
                        stream.seek(begin)
                        if hi + 1 < n:
                            data = stream.read(int(offsets[hi + 1]) - begin)
                        else:
                            data = stream.read()
                        want = set(run)
                        batches = iter_tar_batches([data], url, offset=begin)
                        got = 0
                        for i, sample in enumerate(
                            group_samples(batches, url, last_dot=self.last_dot, batched=True), lo
                        ):
                            if i in want:
                                got += 1
                                yield i, sample
                            if i >= hi:
                                break
                        if got != len(run):
                            raise TarshardsError(
                                f"samples {lo}..{hi} not found at offset {begin}",
                                url=url,
                                offset=begin,
                            )
                    return
                want = set(idxs)
                last = idxs[-1]
                batches = iter_tar_batches(tar_byte_source(stream, url), url)
                for i, sample in enumerate(
                    group_samples(batches, url, last_dot=self.last_dot, batched=True)
                ):
                    if i in want:
                        yield i, sample
                    if i >= last:
                        return
        except TarshardsError as exn:
            raise exn.with_context(url=url) from None
        raise TarshardsError("shard has fewer samples than counted", url=url)


class _Window:
    """A stream read ``step`` bytes at a time at most (a reader's buffer stays that small), and
    only its next ``size`` bytes (reads stop where a run ends; ``size < 0``: to the end)."""

    def __init__(self, stream, size: int, step: int):
        self._stream = stream
        self._left = size if size >= 0 else 1 << 62
        self._step = step

    def readinto(self, view) -> int:
        n = min(len(view), self._left, self._step)
        if n <= 0:
            return 0
        got = self._stream.readinto(view[:n] if n < len(view) else view) or 0
        self._left -= got
        return got

    def read(self, n: int = -1) -> bytes:
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


def check_state(state: dict, expected: dict) -> None:
    """Raise :class:`ResumeError` naming every field where ``state`` differs from ``expected``."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ResumeError(
            f"not a tarshards resume state (format {got!r}, expected {STATE_FORMAT!r})"
        )
    diffs = [
        f"{k}: saved {state.get(k)!r}, here {v!r}" for k, v in expected.items() if state.get(k) != v
    ]
    if diffs:
        raise ResumeError("the saved state does not fit this pipeline: " + "; ".join(diffs))
