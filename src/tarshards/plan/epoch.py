"""Epoch plans over virtual readers: a pure function of the data, the seed and the epoch.

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

The cursor that reads one reader's part of an epoch is :class:`tarshards.plan.cursor.ReaderStream`.
"""

from __future__ import annotations

import bisect
import functools
import json
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Mapping, Sequence

from .._lazy import LazyModule
from ..errors import ResumeError, TarshardsError
from ..format.manifest import Manifest, data_fingerprint
from ..format.names import group_samples
from ..read.reading import local_samples
from ..tario import iter_tar_batches, tar_byte_source
from ..tario.buffer import DirectFile
from .shards import shard_order

np = LazyModule("numpy", globals(), "np")

__all__ = [
    "EpochPlan",
    "PlanConfig",
    "PlanState",
    "REMAINDERS",
    "STATE_FORMAT",
    "Schedule",
    "ShardTable",
    "StreamState",
    "check_state",
    "plan_for",
    "scan_shards",
]


STATE_FORMAT = "tarshards.resume/1"
REMAINDERS = ("drop", "carry", "pad")


# ---------------------------------------------------------------------------------------------
# the data: per-shard sample counts (and byte offsets)
# ---------------------------------------------------------------------------------------------


class ShardTable:
    """The per-shard view of a data set that an epoch plan reads: a
    :class:`~tarshards.format.manifest.Manifest`'s shards with their sample counts and the data's
    one fingerprint, and (optionally) the byte offset of every sample in each shard (for seeking).

    A table comes from a manifest (:meth:`from_manifest`: offsets from its per-shard indexes,
    loaded when a shard is first sought) or from a scan (:func:`scan_shards`: a manifest without
    hashes, offsets recorded as the shards are read); both give the same :attr:`fingerprint`
    (:func:`~tarshards.format.manifest.data_fingerprint` of the shards' names and counts), so a
    resume state saved with one loads with the other. :attr:`manifest` is that record.

    ``offsets[i]`` is a sequence of the byte offsets of shard i's samples, or ``None`` when not
    known (the shard is then read from its start and samples are skipped). ``plain[i]`` says the
    shard is an uncompressed tar (offsets can be sought). :attr:`aliases` maps the other values
    a saved state may carry for this data to :attr:`fingerprint`: the manifest's
    :attr:`~tarshards.format.manifest.Manifest.checksum`, which states saved with a manifest carried
    before the data had one fingerprint.
    """

    def __init__(
        self,
        urls: Sequence[str],
        counts: Sequence[int],
        *,
        fingerprint: str | None = None,
        offsets: Sequence | None = None,
        plain: Sequence[bool] | None = None,
        manifest: Manifest | None = None,
        rows: Sequence | None = None,
    ):
        self.urls = tuple(os.fspath(u) for u in urls)
        self.counts = tuple(int(c) for c in counts)
        if len(self.urls) != len(self.counts):
            raise ValueError("one count per shard")
        if any(c < 0 for c in self.counts):
            raise ValueError("sample counts are non-negative")
        if manifest is not None and [r.samples for r in manifest.shards] != list(self.counts):
            raise ValueError("the manifest's records are not these shards' counts")
        # a view (tarshards.format.selection.View): the rows of each shard it keeps (None: all). The
        # plan then counts the rows kept; its sample i of a shard is the shard's row rows[i]
        self.base_counts = self.counts
        self.rows: list = [None] * len(self.urls)
        if rows is not None:
            self.rows = list(rows)
            if len(self.rows) != len(self.urls):
                raise ValueError("one row selection per shard")
            self.counts = tuple(
                c if r is None else len(r) for c, r in zip(self.base_counts, self.rows)
            )
            if fingerprint is None and any(r is not None for r in self.rows):
                fingerprint = _rows_fingerprint(self.urls, self.base_counts, self.rows)
        self.offsets = list(offsets) if offsets is not None else [None] * len(self.urls)
        self.plain = list(plain) if plain is not None else [not _compressed(u) for u in self.urls]
        self._manifest = manifest  # a scan's (or a bare table's) is made when first asked for
        self.fingerprint = fingerprint or data_fingerprint(self.urls, self.counts)
        self.aliases: dict[str, str] = {}
        self._points: dict = {}  # shard -> seek_points (False: none)

    @classmethod
    def from_manifest(
        cls,
        manifest: Manifest,
        urls: Sequence[str] | None = None,
        *,
        rows: Sequence | None = None,
        fingerprint: str | None = None,
    ) -> "ShardTable":
        """The table of ``manifest``'s shards (of those named ``urls``, found by URL, in that
        order; by position where a URL is not among the manifest's): counts from its records,
        sample offsets from its per-shard indexes, loaded when a shard is first sought. A state
        saved with this manifest's :attr:`~tarshards.format.manifest.Manifest.checksum` as its
        fingerprint (tarshards before the two were told apart) is accepted
        (:attr:`aliases`)."""
        full = manifest
        if urls is not None:
            urls = [os.fspath(u) for u in urls]
            row = {u: i for i, u in enumerate(manifest.shard_urls())}
            found = [row[u] for u in urls if u in row]
            if len(found) == len(urls) and found != list(range(len(manifest.shards))):
                manifest = replace(
                    manifest, shards=tuple(manifest.shards[i] for i in found), _indexes={}
                )
        else:
            urls = manifest.shard_urls()
        table = cls(
            urls,
            [r.samples for r in manifest.shards],
            manifest=manifest,
            rows=rows,
            fingerprint=fingerprint,
        )
        if rows is None:
            table.aliases[full.checksum] = table.fingerprint
        return table

    @classmethod
    def from_view(cls, view, urls: Sequence[str] | None = None) -> "ShardTable":
        """The table an epoch plan reads over a :class:`~tarshards.format.selection.View` (of the
        shards ``urls``, a reordering or part of its manifest's, default all): the counts are
        the rows it keeps, the fingerprint the view's."""
        base_urls = view.manifest.shard_urls()
        urls = base_urls if urls is None else [os.fspath(u) for u in urls]
        row = {u: i for i, u in enumerate(base_urls)}
        missing = [u for u in urls if u not in row]
        if missing:
            raise ValueError(f"shard {missing[0]} is not one of the view's base's shards")
        fp = view.fingerprint
        if urls != base_urls:  # another data set: these shards' rows
            import hashlib

            fp = hashlib.sha256((fp + json.dumps([row[u] for u in urls])).encode()).hexdigest()
        rows = [view.rows[row[u]] for u in urls]
        return cls.from_manifest(view.manifest, urls, rows=rows, fingerprint=fp)

    def selected_rows(self, shard: int):
        """The rows of shard ``shard`` a view keeps (a sorted int array), or ``None`` where
        every row is read (plan position i of the shard is then its row i)."""
        return self.rows[shard]

    def meta(self, name: str):
        """Per-sample metadata column ``name`` (:meth:`~tarshards.format.manifest.Manifest.meta`)
        for the table's samples in table order: a view's kept rows only (``KeyError`` where the
        manifest has no such column)."""
        column = np.asarray(self.manifest.meta(name))
        if all(r is None for r in self.rows):
            return column
        starts = np.concatenate(([0], np.cumsum(self.base_counts)[:-1])).astype(np.int64)
        parts = [
            starts[s] + (np.arange(c) if r is None else np.asarray(r, dtype=np.int64))
            for s, (c, r) in enumerate(zip(self.base_counts, self.rows))
        ]
        return column[np.concatenate(parts)] if parts else column[:0]

    @property
    def manifest(self) -> Manifest:
        """The record the table views: the manifest it came from, or a scan's manifest (shard
        URLs and counts, no sizes or hashes), with the same :attr:`fingerprint`."""
        if self._manifest is None:
            self._manifest = Manifest.from_counts(self.urls, self.base_counts)
        return self._manifest

    def sample_offsets(self, shard: int):
        """Byte offsets of shard ``shard``'s samples in its plain tar file, or ``None``."""
        offs = self.offsets[shard]
        manifest = self._manifest
        if offs is None and self.plain[shard]:
            offs = False
            if manifest is not None and manifest.shards[shard].index is not None:
                idx = manifest.load_index(shard)
                if getattr(idx, "compression", "none") == "none" and idx.seekable:
                    offs = idx.sample_offsets
            self.offsets[shard] = offs
        return offs if offs is not False else None

    def seek_points(self, shard: int):
        """``(file offsets, tar offsets, entry, file ends)`` of the samples of a sample-aligned
        compressed shard (from the manifest's index: where a resumed read starts decompressing,
        and how, see :attr:`tarshards.format.index.ShardIndex.entry`), or ``None``."""
        got = self._points.get(shard)
        if got is None:
            got = False
            manifest = self._manifest
            if (
                manifest is not None
                and not self.plain[shard]
                and manifest.shards[shard].index is not None
            ):
                idx = manifest.load_index(shard)
                if idx.compression != "none" and idx.seekable:
                    got = (idx.sample_offsets, idx.tar_offsets, idx.entry, idx.sample_ends)
            self._points[shard] = got
        return got or None

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


def _rows_fingerprint(urls, counts, rows) -> str:
    """The fingerprint of a selection of rows of the shards ``urls`` (their ``counts``)."""
    import hashlib

    h = hashlib.sha256(data_fingerprint(urls, counts).encode())
    for i, r in enumerate(rows):
        if r is None:
            h.update(b"%d:*;" % i)
        else:
            h.update(b"%d:%d:" % (i, len(r)))
            h.update(np.ascontiguousarray(r, dtype="<i8").tobytes())
    return h.hexdigest()


def _compressed(url: str) -> bool:
    return str(url).lower().endswith((".gz", ".tgz", ".zst", ".tzst"))


def scan_shards(urls: Sequence[str], *, opener: Callable, last_dot: bool = False) -> ShardTable:
    """Read every shard once and record its sample count and sample byte offsets.

    This is what a manifest/index stores; without one, a resumable pipeline scans the shards when
    it first needs the plan (once per process that builds it). The table's :attr:`~ShardTable.
    manifest` is the scan's record: a manifest without sizes and hashes, with the same
    fingerprint as the shards' manifest (``tarshards index``) has.
    """
    counts, offsets, plain = [], [], []
    for url in urls:
        try:
            with opener(url) as stream:
                src = tar_byte_source(stream, url, direct=True)
                is_plain = hasattr(src, "readinto")
                if isinstance(src, DirectFile):  # its headers alone, the data skipped
                    samples = local_samples(src, url, last_dot, data=False)
                    offs = [sample["__offset__"] for sample in samples]
                else:
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
# resume states: typed, frozen; saved as plain dicts (a checkpoint's JSON or torch.save)
# ---------------------------------------------------------------------------------------------

_PLAN_POSITION = ("epoch", "position", "origin", "world_size", "finished")
_WORKER_POSITION = ("worker", "num_workers", "next_step")


@dataclass(frozen=True)
class PlanState:
    """Where a planned pipeline (``readers=V``) is: ``epoch``, the global batch ``position``
    reached (``None`` in one DataLoader worker's own state, which says ``next_step`` instead),
    the ``origin`` its world of ``world_size`` ranks started counting steps from, whether the
    epoch is ``finished``; and what the plan depends on (``identity``: the data's fingerprint,
    the seed and the plan's parameters, :meth:`PlanConfig.identity`), which a load checks.

    :meth:`to_dict` is the saved form (``kind="plan"``, the identity's fields beside the
    position's), :meth:`from_dict` reads it back."""

    identity: Mapping[str, Any]
    epoch: int
    position: int | None
    origin: int = 0
    world_size: int = 1
    finished: bool = False
    worker: int | None = None  # one DataLoader worker's own state (StatefulDataLoader)
    num_workers: int | None = None
    next_step: int | None = None

    def to_dict(self) -> dict:
        state: dict[str, Any] = {"format": STATE_FORMAT, "kind": "plan"}
        state.update(self.identity)
        state.update(
            epoch=int(self.epoch),
            position=None if self.position is None else int(self.position),
            origin=int(self.origin),
            world_size=int(self.world_size),
            finished=bool(self.finished),
        )
        if self.worker is not None:
            state.update(worker=self.worker, num_workers=self.num_workers, next_step=self.next_step)
        return state

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> "PlanState":
        if state.get("format") != STATE_FORMAT or state.get("kind") != "plan":
            raise ResumeError(f"not a planned resume state: {dict(state)!r:.200}")
        skip = {"format", "kind", *_PLAN_POSITION, *_WORKER_POSITION}
        worker = state.get("num_workers") is not None
        position = state.get("position")
        return cls(
            identity={k: v for k, v in state.items() if k not in skip},
            epoch=int(state["epoch"]),
            position=None if position is None else int(position),
            origin=int(state.get("origin") or 0),
            world_size=int(state["world_size"]),
            finished=bool(state.get("finished")),
            worker=int(state["worker"]) if worker else None,
            num_workers=int(state["num_workers"]) if worker else None,
            next_step=int(state["next_step"]) if worker else None,
        )


@dataclass(frozen=True)
class StreamState:
    """Where a pipeline without an epoch plan is: ``epoch`` and the items it has yielded in it
    (``position``), and the place it ran in (``place``: rank, world size, DataLoader worker and
    workers; empty between iterations), which a resume mid-epoch must match (the stream
    depends on it). :meth:`to_dict` is the saved form (``kind="stream"``)."""

    seed: int
    epoch: int
    position: int = 0
    place: Mapping[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dict(
            self.place,
            format=STATE_FORMAT,
            kind="stream",
            seed=self.seed,
            epoch=int(self.epoch),
            position=int(self.position),
        )

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> "StreamState":
        if state.get("format") != STATE_FORMAT or state.get("kind") != "stream":
            raise ResumeError(f"not a stream resume state: {dict(state)!r:.200}")
        place = {
            k: int(state[k])
            for k in ("rank", "world_size", "worker", "num_workers")
            if state.get(k) is not None
        }
        return cls(
            seed=state["seed"],
            epoch=int(state["epoch"]),
            position=int(state.get("position") or 0),
            place=place,
        )


def check_state(state: dict, expected: dict, *, aliases: Mapping[str, str] | None = None) -> dict:
    """Raise :class:`ResumeError` naming every field where ``state`` differs from ``expected``;
    return the state as checked.

    ``aliases`` maps other values a saved fingerprint may have for the same data to the one
    expected (:attr:`ShardTable.aliases`: a manifest's checksum, which states saved with a
    manifest carried before the data had one fingerprint); a state that carries one is checked,
    and returned, with the fingerprint in its place (at the top, and in a mixture's sources).
    """
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ResumeError(
            f"not a tarshards resume state (format {got!r}, expected {STATE_FORMAT!r})"
        )
    if aliases:
        state = _renamed(state, aliases)
    diffs = [
        f"{k}: saved {state.get(k)!r}, here {v!r}" for k, v in expected.items() if state.get(k) != v
    ]
    if diffs:
        hint = ""
        if str(state.get("fingerprint", "")).startswith("sha256:") and expected.get(
            "fingerprint"
        ) != state.get("fingerprint"):
            hint = (
                " (the state was saved with a manifest by an earlier tarshards, whose "
                "fingerprint was the manifest's checksum: load it into a pipeline given the "
                "same manifest)"
            )
        if "packs" in expected and state.get("packs") != expected["packs"]:
            hint += (
                " (its packs were made by another packing rule, an earlier tarshards' if none is "
                "named: this plan's packs are other samples, so the state cannot resume it)"
            )
        raise ResumeError("the saved state does not fit this pipeline: " + "; ".join(diffs) + hint)
    return state


def _renamed(value, aliases: Mapping[str, str]):
    """``value`` (a state: dicts, lists) with every string that is a key of ``aliases``
    replaced by its value (checksums are ``sha256:`` and 64 hex digits: nothing else matches)."""
    if isinstance(value, str):
        return aliases.get(value, value)
    if isinstance(value, dict):
        return {k: _renamed(v, aliases) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_renamed(v, aliases) for v in value)
    return value
