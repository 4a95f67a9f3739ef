"""Packing and bucketing: samples grouped into *units* (packs under a token budget, batches of one
bucket), planned from the index's per-sample metadata where it exists.

A unit is a set of positions of the epoch's sample list (the shards in the epoch's order, each in
its file order: :class:`tarshards.plan.epoch.EpochPlan` over one reader). Both kinds of unit are
made the
same way on a stream of samples and on the metadata, so a planned pipeline and a plain one group
the same samples:

- **packs** (:func:`pack`): the stream is packed as it comes with at most ``window`` packs
  open (:class:`_OpenPacks`): a sample goes into the previous sample's pack where it fits,
  else into the open pack with the least room that fits it (the lowest slot on a tie); where
  none does, a new pack opens, the fullest open one going out first when ``window`` are open;
  at the end the open packs go out in the order of their last sample. A sample over the
  budget is a pack of its own, out at once (``oversize="truncate"``: the collation cuts it),
  left out (``"drop"``, counted and warned) or an error (``"raise"``). Packs come out in the
  order they close. (The plan's identity names this rule, :data:`PACK_RULE`: states and
  ledgers of packs made by another rule are refused.)
- **buckets** (:func:`bucket`): each sample goes to the bucket of its key
  (``bisect_right(boundaries, key)``); a bucket's batch is out when it holds its batch size;
  at the end the partial batches (``partial=True``) come out in the order of their last sample.

In a planned pipeline (``WebDataset(..., readers=V)``) whose cost (or key) is a metadata column
of the manifest (``Manifest.meta``), the epoch's units are computed from the column alone, no
data read: :func:`pack_units` (one C loop), :func:`bucket_units` (numpy). The unit list
is then cut like the sample list of a plain plan: reader ``v`` yields units ``v q .. v q + q - 1``
(``q = P // V``; ``remainder="pad"``: ``ceil(P / V)``, the missing units repeat the first ones,
flagged ``__pad__``), global batch ``g`` is unit ``(g % V) q + g // V``. A position is then, as
for batches, a count of global units: resume, elastic resume and DataLoader workers work as
they do for ``.batched(B)``. A reader reads each unit on the turn that hands it on, from its
shards' maps, a run of adjacent samples at a time (:class:`_UnitReads`: a pack is about two
runs), and holds nothing between its turns; where the shards are not local plain tars with
known offsets, it streams its members in file order and holds the samples of the units not
yet complete (the open packs').
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import operator
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterable, Iterator, Sequence

from .._lazy import LazyModule
from ..errors import TarshardsError, TarshardsWarning
from ..format.names import group_run, group_samples
from ..storage.paths import is_local
from ..tario import iter_tar_batches
from ..tario.buffer import map_local
from ..tario.reader import plain_run
from .cursor import ReaderStream
from .epoch import PlanConfig, ShardTable, plan_for
from .planned import PlannedProgram

np = LazyModule("numpy", globals(), "np")

try:  # optional C loop of the packing rule (see _c/deficits.c); _plan_packs_py is the reference
    from .._deficits import plan_packs as _c_plan
except ImportError:  # pragma: no cover - without the extension
    _c_plan = None

__all__ = [
    "BucketSpec",
    "OVERSIZE",
    "PackSpec",
    "UnitLayout",
    "UnitPlan",
    "UnitProgram",
    "bucket",
    "bucket_units",
    "pack",
    "pack_units",
    "replay_units",
    "spec_from_identity",
    "unit_stage",
]

OVERSIZE = ("truncate", "drop", "raise")
DEFAULT_WINDOW = 8  # packs open at once (long-tailed lengths: ~99.6 % fill; see pack())
# the rule that makes a plan's packs, in its identity (states, ledgers): a state or a ledger of
# packs made by another rule (an earlier tarshards: best-fit decreasing in windows of cost) is
# refused, not resumed or replayed over other packs
PACK_RULE = "the previous sample's pack, else best fit; packs open/1"
_READ_THROUGH = 32  # a gap of up to this many samples between wanted ones is read, not sought
# a planned reader gives the pages of a shard's map back behind it every this many bytes (more
# often cost the packed pipeline 2-3 % of its rate; a map is closed after its last pack anyway)
_GIVE_BACK = 32 << 20
_RUN = 64  # the most samples taken from the stream at once


# ---------------------------------------------------------------------------------------------
# what a sample costs (or which bucket it is in)
# ---------------------------------------------------------------------------------------------


def _measure(value: Any) -> float:
    """A field's value as a number: its length when it has one (tokens, text), else itself."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    try:
        return float(len(value))
    except TypeError:
        return float(value)


def _getter(what: str | Callable, role: str) -> Callable[[Any], float]:
    if callable(what):
        return lambda sample: float(what(sample))
    if not isinstance(what, str):
        raise TypeError(f"{role}= is a field name, a metadata column or a function, not {what!r}")

    def get(sample):
        try:
            value = sample[what]
        except (KeyError, TypeError, IndexError):
            key = sample.get("__key__") if isinstance(sample, dict) else None
            raise TarshardsError(
                f"sample {key!r} has no field {what!r} for {role}=: a metadata column (from "
                "the manifest's index, tarshards.add_meta) is used in a planned pipeline "
                "(WebDataset(manifest, readers=V)); in a plain one name a field or pass a "
                "function of the sample"
            ) from None
        return _measure(value)

    return get


def _check_budget(max_tokens: float, window: int | None, oversize: str) -> None:
    if not max_tokens > 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens!r}")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive number of packs, got {window!r}")
    if oversize not in OVERSIZE:
        raise ValueError(f"oversize must be one of {', '.join(OVERSIZE)}, got {oversize!r}")


def _bucket_sizes(boundaries: Sequence[float], batch_size) -> tuple[tuple[float, ...], tuple]:
    bounds = tuple(float(b) for b in boundaries)
    if any(b >= c for b, c in itertools.pairwise(bounds)):
        raise ValueError(f"boundaries must increase, got {list(boundaries)}")
    n = len(bounds) + 1
    if isinstance(batch_size, dict):
        missing = [i for i in range(n) if i not in batch_size]
        if missing:
            raise ValueError(
                f"batch_size= as a dict needs a size for every bucket 0..{n - 1} "
                f"({len(bounds)} boundaries); missing {missing}"
            )
        sizes = tuple(int(batch_size[i]) for i in range(n))
    elif isinstance(batch_size, (list, tuple)):
        if len(batch_size) != n:
            raise ValueError(
                f"batch_size= as a list needs one size per bucket: {n} for {len(bounds)} "
                f"boundaries, got {len(batch_size)}"
            )
        sizes = tuple(int(b) for b in batch_size)
    else:
        sizes = (int(batch_size),) * n
    if any(s < 1 for s in sizes):
        raise ValueError(f"batch sizes must be >= 1, got {list(sizes)}")
    return bounds, sizes


# ---------------------------------------------------------------------------------------------
# the streaming stages (a plain pipeline; a planned one computes the same units from metadata)
# ---------------------------------------------------------------------------------------------


class _OpenPacks:
    """The packing rule, one sample at a time: at most ``k`` packs open, each a slot.

    A sample (cost ``c`` <= budget) goes into the pack of the sample placed before it where it
    fits (a pack's samples then lie in a few runs of adjacent samples, which a reader parses in
    one piece each), else into the open pack with the least room that still fits it (ties: the
    lowest slot). Where none fits, a new pack opens in the lowest free slot; with every slot
    taken, the fullest open pack (the least room; ties: the lowest slot) is closed first, and
    the new one takes its slot. At the end the open packs close in the order of their last
    sample. :func:`pack` and :func:`pack_units` (and its C loop) follow this in the same float
    operations: ``room = budget; room -= c``."""

    __slots__ = ("budget", "ids", "k", "next_id", "prev", "rooms")

    def __init__(self, budget: float, k: int):
        self.budget, self.k = float(budget), int(k)
        self.rooms: list[float] = []  # room left in each slot's open pack
        self.ids: list[int] = []  # each slot's pack (numbered as opened)
        self.next_id = 0
        self.prev = -1  # the slot of the last sample placed

    def place(self, c: float) -> tuple[int, int]:
        """(the slot the sample goes into, the pack closed to make room for it or -1)."""
        rooms = self.rooms
        best, least, closed = -1, 0.0, -1
        if self.prev >= 0 and rooms[self.prev] >= c:
            best = self.prev
        else:
            for slot, room in enumerate(rooms):
                if room >= c and (best < 0 or room < least):
                    best, least = slot, room
        if best < 0:
            if len(rooms) < self.k:
                best = len(rooms)
                rooms.append(0.0)
                self.ids.append(-1)
            else:
                best = rooms.index(min(rooms))  # the fullest; ties: the lowest slot
                closed = self.ids[best]
            room = self.budget
            rooms[best] = room
            self.ids[best] = self.next_id
            self.next_id += 1
        rooms[best] -= c
        self.prev = best
        return best, closed


def _plan_packs_py(costs: list, budget: float, k: int) -> tuple[list, list]:
    """:func:`_plan_packs` in Python (without the C loop): the same packs."""
    packer = _OpenPacks(budget, k)
    unit_of = [0] * len(costs)
    key: list[int] = []  # each pack's order key
    for i, c in enumerate(costs):
        if c > budget:  # a pack of its own, out at once
            unit_of[i] = packer.next_id
            packer.next_id += 1
            key.append(2 * i)
            continue
        slot, closed = packer.place(c)
        if closed >= 0:
            key[closed] = 2 * i
        u = packer.ids[slot]
        if u == len(key):
            key.append(2 * len(costs) + 1)  # (open: out at the end, unless closed before)
        unit_of[i] = u
    return unit_of, key


def _plan_packs(costs, budget: float, k: int):
    """Each sample's pack (numbered as opened) and each pack's order key (``2 i``: out when
    sample ``i`` arrives, closed to make room for it or a sample over the budget alone;
    ``2 n + 1``: open at the end), for samples costing ``costs`` (float64) in stream order."""
    if _c_plan is not None:
        unit_of, key = _c_plan(costs, float(budget), int(k))
        return np.frombuffer(unit_of, dtype=np.int64), np.frombuffer(key, dtype=np.int64)
    u, key = _plan_packs_py(costs.tolist(), float(budget), int(k))
    return np.asarray(u, dtype=np.int64), np.asarray(key, dtype=np.int64)


def pack(
    samples: Iterable,
    max_tokens: float,
    cost: str | Callable = "tokens",
    *,
    window: int | None = None,
    oversize: str = "truncate",
) -> Iterator[list]:
    """Group samples into packs (lists of samples) whose total cost is at most ``max_tokens``.

    ``cost``: a metadata column of the manifest (planned pipelines, ``readers=V``: the packs are
    planned from the index, no data read), a field of the sample (its length, or its value if
    a number), or a function of the sample. The stream is packed as it comes with ``window``
    packs open at once (default 8): each sample goes into the previous sample's pack where it
    fits, else into the open pack it fills best; where none has room, the fullest open pack
    goes out and a new one opens. About 99 % fill on long-tailed lengths (lognormal, mean ~400
    of 8,192: 99.3 %; 98.8 % with 4 open), and a pack's samples lie in about two runs of
    adjacent samples of the stream (a planned reader parses a pack on its own turn, a run at
    a time, and holds nothing). Only the open packs' samples are held here. A sample
    costing more than ``max_tokens``: a pack of its own (``oversize="truncate"``;
    ``collate_packed(max_tokens=...)`` cuts it), left out with a warning that counts them
    (``"drop"``), or a ``ValueError`` (``"raise"``). Deterministic: the same stream gives the
    same packs (see :mod:`tarshards.plan.packing`).
    """
    _check_budget(max_tokens, window, oversize)
    get = _getter(cost, "cost")
    budget = float(max_tokens)
    packer = _OpenPacks(budget, DEFAULT_WINDOW if window is None else window)
    held: list[list] = []  # each slot's samples
    last: list[int] = []  # each slot's last sample (its index in the stream)
    dropped = 0
    for i, sample in enumerate(samples):
        c = get(sample)
        if c != c or c < 0:
            raise ValueError(f"cost {c} of sample {_key(sample)!r} is not a non-negative number")
        if c > budget:
            if oversize == "raise":
                raise ValueError(
                    f"sample {_key(sample)!r} costs {c:g} > max_tokens={max_tokens:g} "
                    "(oversize='truncate' gives it a pack of its own, 'drop' leaves it out)"
                )
            if oversize == "drop":
                dropped += 1
                continue
            yield [sample]
            continue
        slot, closed = packer.place(c)
        if slot == len(held):
            held.append([])
            last.append(i)
        if closed >= 0:
            out, held[slot] = held[slot], []
            yield out
        held[slot].append(sample)
        last[slot] = i
    for slot in sorted(range(len(held)), key=last.__getitem__):
        yield held[slot]
    if dropped:
        warnings.warn(
            f".pack({max_tokens:g}) left out {dropped} sample(s) costing more than max_tokens "
            "(oversize='drop')",
            TarshardsWarning,
            stacklevel=2,
        )


def bucket(
    samples: Iterable,
    key: str | Callable,
    boundaries: Sequence[float],
    batch_size: int | Sequence[int] | dict = 32,
    *,
    partial: bool = True,
    collation_fn: Callable | None = None,
) -> Iterator:
    """Batches of samples that share a bucket: bucket ``i`` holds the keys ``k`` with
    ``boundaries[i - 1] <= k < boundaries[i]`` (``len(boundaries) + 1`` buckets).

    ``key``: a metadata column of the manifest (planned pipelines: batches planned from the
    index), a field (its length, or its value if a number) or a function of the sample
    (aspect ratio, length, resolution). ``batch_size``: one size, a list of one per bucket, or
    a dict ``{bucket: size}``. A bucket's batch comes out when it is full; at the end the
    partial ones, in the order of their last sample (``partial=False`` leaves them out).
    ``collation_fn`` (default: none, a batch is a list of samples): e.g.
    :func:`tarshards.collate_padded`.
    """
    bounds, sizes = _bucket_sizes(boundaries, batch_size)
    get = _getter(key, "key")
    open_: dict[int, list] = {}
    last: dict[int, int] = {}
    for i, sample in enumerate(samples):
        v = get(sample)
        if v != v:
            raise ValueError(f"key of sample {_key(sample)!r} is NaN")
        b = bisect.bisect_right(bounds, v)
        got = open_.setdefault(b, [])
        got.append(sample)
        last[b] = i
        if len(got) == sizes[b]:
            del open_[b]
            yield collation_fn(got) if collation_fn is not None else got
    if partial:
        for b in sorted(open_, key=last.__getitem__):
            got = open_[b]
            yield collation_fn(got) if collation_fn is not None else got


def _unit_name(spec) -> str:
    return "packs" if isinstance(spec, PackSpec) else "batches"


def _check_pack(max_tokens, cost="tokens", *, window=None, oversize="truncate") -> None:
    _check_budget(max_tokens, window, oversize)
    if not (isinstance(cost, str) or callable(cost)):
        raise TypeError(f"cost= is a field name, a metadata column or a function, not {cost!r}")


def _check_bucket(key, boundaries, batch_size=32, *, partial=True, collation_fn=None) -> None:
    _bucket_sizes(boundaries, batch_size)
    if not (isinstance(key, str) or callable(key)):
        raise TypeError(f"key= is a field name, a metadata column or a function, not {key!r}")


# the fluent methods check their arguments when called (DataPipeline.pack(...), .bucket(...))
pack.check_arguments = _check_pack  # type: ignore[attr-defined]
bucket.check_arguments = _check_bucket  # type: ignore[attr-defined]


def _key(sample) -> Any:
    return sample.get("__key__") if isinstance(sample, dict) else None


# ---------------------------------------------------------------------------------------------
# units planned from metadata
# ---------------------------------------------------------------------------------------------


class UnitPlan:
    """An epoch's units: ``members`` (epoch positions, unit by unit, each unit ascending) cut at
    ``offsets`` (``len(self) + 1`` of them); units are in the order of their last position.
    ``costs``: each unit's total cost (packs; counted at most ``max_tokens`` a sample);
    ``left_out``: samples in no unit (``oversize="drop"``, ``partial=False``)."""

    def __init__(self, members, offsets, costs=None, left_out: int = 0, budget: float = 0.0):
        self.members = members
        self.offsets = offsets
        self.costs = costs
        self.left_out = int(left_out)
        self.budget = float(budget)
        self._runs: Any = False  # the readers' run table (_unit_runs; False: not yet made)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def unit(self, u: int):
        return self.members[self.offsets[u] : self.offsets[u + 1]]

    def units(self) -> list[list[int]]:
        return [self.unit(u).tolist() for u in range(len(self))]

    def fill(self) -> float:
        """Mean fill of the packs: their cost over ``len(self) * max_tokens``."""
        if self.costs is None or not len(self) or not self.budget:
            return float("nan")
        return float(np.sum(self.costs) / (len(self) * self.budget))


def _ordered(unit_of, positions, costs=None, late=None) -> tuple:
    """Members and offsets of the units (``unit_of[i]``: the unit of ``positions[i]``), units in
    the order of their last position (with ``late``, a rank by unit id: by rank first),
    members ascending; with ``costs``, each unit's total."""
    order = np.lexsort((positions, unit_of))
    pos, uid = positions[order], unit_of[order]
    n = int(uid[-1]) + 1 if len(uid) else 0
    counts = np.bincount(uid, minlength=n)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    nonempty = counts > 0
    starts, lens = offsets[:-1][nonempty], counts[nonempty]
    lastpos = pos[offsets[1:][nonempty] - 1]
    if late is None:
        by_last = np.argsort(lastpos, kind="stable")
    else:
        by_last = np.lexsort((lastpos, np.asarray(late)[:n][nonempty]))
    starts, lens = starts[by_last], lens[by_last]
    new_off = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=new_off[1:])
    idx = np.repeat(starts - new_off[:-1], lens) + np.arange(new_off[-1])
    unit_costs = None
    if costs is not None:
        c = costs[order][idx]
        unit_costs = np.add.reduceat(c, new_off[:-1]) if len(c) else np.zeros(0)
    return pos[idx], new_off, unit_costs


def pack_units(
    costs, max_tokens: float, *, window: int | None = None, oversize: str = "truncate"
) -> UnitPlan:
    """The packs of a stream of samples costing ``costs`` (epoch order), as :func:`pack`
    makes them (the same packs, in the same order), computed from the costs alone."""
    _check_budget(max_tokens, window, oversize)
    costs = np.asarray(costs, dtype=np.float64)
    if np.isnan(costs).any() or (costs < 0).any():
        bad = int(np.flatnonzero(np.isnan(costs) | (costs < 0))[0])
        raise ValueError(
            f"cost of the sample at epoch position {bad} is {costs[bad]}: every sample needs a "
            "non-negative cost (a shard whose index lacks the column gives NaN)"
        )
    over = costs > max_tokens
    left_out = 0
    if over.any():
        if oversize == "raise":
            raise ValueError(
                f"{int(over.sum())} samples cost more than max_tokens={max_tokens:g} (the "
                f"largest {costs.max():g}; oversize='truncate' gives each a pack of its own, "
                "'drop' leaves them out)"
            )
        if oversize == "drop":
            left_out = int(over.sum())
    keep = np.flatnonzero(~over) if oversize == "drop" else np.arange(len(costs))
    kc = np.ascontiguousarray(costs[keep])
    k = DEFAULT_WINDOW if window is None else window
    unit_of, key = _plan_packs(kc, float(max_tokens), k)
    clipped = np.minimum(kc, max_tokens)
    members, offsets, ucost = _ordered(unit_of, keep.astype(np.int64), clipped, late=key)
    return UnitPlan(members, offsets, ucost, left_out=left_out, budget=float(max_tokens))


def bucket_units(values, boundaries, batch_size, *, partial: bool = True) -> UnitPlan:
    """The batches of a stream of samples with keys ``values`` (epoch order), as :func:`bucket`
    makes them (the same batches), computed from the keys alone."""
    bounds, sizes = _bucket_sizes(boundaries, batch_size)
    values = np.asarray(values, dtype=np.float64)
    if np.isnan(values).any():
        bad = int(np.flatnonzero(np.isnan(values))[0])
        raise ValueError(f"the key of the sample at epoch position {bad} is NaN")
    b = np.searchsorted(np.asarray(bounds), values, side="right")
    n = len(values)
    order = np.argsort(b, kind="stable")  # by bucket, each in stream order
    bs = b[order]
    counts = np.bincount(bs, minlength=len(sizes))
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    rank = np.arange(n) - starts[bs]
    size = np.asarray(sizes)[bs]
    batch = rank // size
    full = counts // np.asarray(sizes)  # full batches per bucket
    keep = np.ones(n, dtype=bool) if partial else batch < full[bs]
    nb = -(-counts // np.asarray(sizes))  # batches per bucket, partial ones too
    base = np.concatenate(([0], np.cumsum(nb)[:-1]))
    unit_of = base[bs] + batch
    # the partial batches come out at the end (a stream knows them only there)
    late = np.zeros(int(nb.sum()), dtype=bool)
    late[(base + full)[full < nb]] = True
    members, offsets, _ = _ordered(unit_of[keep], order[keep].astype(np.int64), late=late)
    return UnitPlan(members, offsets, None, left_out=int(n - keep.sum()))


# ---------------------------------------------------------------------------------------------
# the planned program: units in place of batches
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackSpec:
    max_tokens: float
    cost: str
    window: int | None
    oversize: str

    def identity(self) -> dict:
        return {
            "unit": "pack",
            "max_tokens": self.max_tokens,
            "cost": self.cost,
            "window": self.window,
            "oversize": self.oversize,
        }


@dataclass(frozen=True)
class BucketSpec:
    key: str
    boundaries: tuple
    batch_sizes: tuple
    partial: bool
    collation_fn: Any = None

    def identity(self) -> dict:
        return {
            "unit": "bucket",
            "key": self.key,
            "boundaries": list(self.boundaries),
            "batch_sizes": list(self.batch_sizes),
            "partial": self.partial,
        }


def unit_stage(stages: Sequence) -> int | None:
    """The index of the first ``pack``/``bucket`` stage of a pipeline's stages, or ``None``."""
    for i, st in enumerate(stages):
        if st.fn is pack or st.fn is bucket:
            return i
    return None


def _bound(st) -> dict:
    import inspect

    args = inspect.signature(st.fn).bind(None, *st.args, **st.kwargs)
    args.apply_defaults()
    return dict(args.arguments)


def unit_parts(ds) -> tuple[Any, list, list]:
    """(the unit's spec, the stages before it, the stages after it) of a planned pipeline."""
    from ..pipeline import stages as _stages

    stages = ds.stage_list
    i = unit_stage(stages)
    if i is None:
        raise TypeError("the pipeline has no .pack() or .bucket() stage")
    st = stages[i]
    args = _bound(st)
    pre, post = list(stages[:i]), list(stages[i + 1 :])
    for other in pre:
        if other.fn in (_stages.shuffle, _stages.batched, _stages.unbatched):
            name = other.fn.__name__
            raise ValueError(
                f"a planned pipeline with .{st.fn.__name__}() takes no .{name}() before it: "
                "the plan orders the shards (shardshuffle) and groups the samples itself; "
                "per-sample stages (decode, map, to_tuple...) may come before it"
            )
    if ds.epoch_items is not None:
        raise ValueError("with_epoch() does not apply to a planned pipeline")
    what = args["cost"] if st.fn is pack else args["key"]
    role = "cost" if st.fn is pack else "key"
    columns = _meta_columns(ds)
    if not isinstance(what, str) or what not in columns:
        named = what if isinstance(what, str) else getattr(what, "__name__", repr(what))
        raise ValueError(
            f".{st.fn.__name__}({role}={named!r}) in a planned pipeline (readers=V) is planned "
            f"from a per-sample metadata column of the manifest (it has: "
            f"{', '.join(columns) or 'none'}): record one while writing "
            f"(ShardWriter(..., meta={{{named!r}: fn}})) or add it with tarshards.add_meta(...); "
            "a field or a function works in a plain pipeline (no readers=)"
        )
    if st.fn is pack:
        _check_budget(args["max_tokens"], args["window"], args["oversize"])
        spec: Any = PackSpec(float(args["max_tokens"]), what, args["window"], args["oversize"])
    else:
        bounds, sizes = _bucket_sizes(args["boundaries"], args["batch_size"])
        spec = BucketSpec(what, bounds, sizes, bool(args["partial"]), args["collation_fn"])
    return spec, pre, post


def _meta_columns(ds) -> list[str]:
    if getattr(ds, "manifest", None) is None:
        return []
    return ds.table.manifest.meta_columns()


# per table (weakly): metadata columns in table order, and recent epochs' unit plans
_COLUMNS: "weakref.WeakKeyDictionary[ShardTable, dict]" = weakref.WeakKeyDictionary()
_PLANS: "weakref.WeakKeyDictionary[ShardTable, dict]" = weakref.WeakKeyDictionary()
# per table (weakly): where each shard's last sample ends (read once; _UnitReads)
_ENDS: "weakref.WeakKeyDictionary[ShardTable, dict]" = weakref.WeakKeyDictionary()


def _column(table: ShardTable, name: str) -> tuple[Any, str]:
    """Metadata column ``name`` of the table's shards (table order) and a digest of it."""
    got = _COLUMNS.setdefault(table, {})
    if name not in got:
        values = np.ascontiguousarray(table.meta(name), dtype=np.float64)
        if np.isnan(values).any():
            starts = np.concatenate(([0], np.cumsum(table.counts)))
            bad = int(np.flatnonzero(np.isnan(values))[0])
            shard = int(np.searchsorted(starts, bad, side="right") - 1)
            raise TarshardsError(
                f"metadata column {name!r} has no value for sample {bad - starts[shard]} of "
                "this shard (its index lacks the column: add it with tarshards.add_meta)",
                url=table.urls[shard],
            )
        digest = hashlib.blake2b(values.tobytes(), digest_size=8).hexdigest()
        got[name] = (values, digest)
    return got[name]


def _epoch_list(table: ShardTable, seed: int, shardshuffle: bool, epoch: int):
    """The plan of the epoch's sample list over one reader."""
    cfg = PlanConfig(
        seed=seed, readers=1, batch_size=1, remainder="drop", shardshuffle=shardshuffle
    )
    return plan_for(table, cfg, epoch)


def _epoch_order(table: ShardTable, seed: int, shardshuffle: bool, epoch: int):
    """(the plan of the epoch's sample list over one reader, the manifest row of each of its
    positions)."""
    full = _epoch_list(table, seed, shardshuffle, epoch)
    starts = np.concatenate(([0], np.cumsum(table.counts)[:-1]))
    rows = (
        np.concatenate([np.arange(starts[s] + a, starts[s] + b) for s, a, b, _ in full.runs])
        if full.runs
        else np.zeros(0, dtype=np.int64)
    )
    return full, rows


def plan_units(table: ShardTable, spec, seed: int, shardshuffle: bool, epoch: int) -> UnitPlan:
    """The units of ``epoch`` (cached per table for a few epochs)."""
    cache = _PLANS.setdefault(table, {})
    key = (spec, seed, shardshuffle, int(epoch))
    got = cache.get(key)
    if got is None:
        name = spec.cost if isinstance(spec, PackSpec) else spec.key
        values, _ = _column(table, name)
        _, rows = _epoch_order(table, seed, shardshuffle, epoch)
        if isinstance(spec, PackSpec):
            got = pack_units(
                values[rows], spec.max_tokens, window=spec.window, oversize=spec.oversize
            )
        else:
            got = bucket_units(
                values[rows], spec.boundaries, spec.batch_sizes, partial=spec.partial
            )
        while len(cache) >= 4:
            cache.pop(next(iter(cache)))
        cache[key] = got
    return got


def plan_identity(ds) -> dict:
    """What a state of a packed/bucketed planned pipeline records and checks."""
    spec, _, _ = unit_parts(ds)
    plan = ds.plan_config
    name = spec.cost if isinstance(spec, PackSpec) else spec.key
    _, digest = _column(ds.table, name)
    out = {
        "fingerprint": ds.table.fingerprint,
        "seed": ds.seed,
        "readers": plan["readers"],
        "remainder": plan["remainder"],
        "shardshuffle": ds.shardshuffle,
        "meta": digest,
    }
    out.update(spec.identity())
    if isinstance(spec, PackSpec):
        out["packs"] = PACK_RULE
    return out


def _positions(stream: ReaderStream, positions) -> Generator[list, None, None]:
    """The samples at ``positions`` (ascending) of ``stream``'s segment, in order, in lists:
    each run of nearby positions (gaps of up to ``_READ_THROUGH`` samples read through) read
    from its first position as the stream cuts it (a dense run's lists handed on as they are);
    the stream is opened again at the next run (a seek)."""
    ps = positions
    if not len(ps):
        return
    gaps = np.flatnonzero(np.diff(ps) > _READ_THROUGH) + 1
    bounds = np.concatenate(([0], gaps, [len(ps)])).tolist()
    for a, b in itertools.pairwise(bounds):
        lo, hi = int(ps[a]), int(ps[b - 1]) + 1
        dense = hi - lo == b - a
        wanted: list[int] = [] if dense else ps[a:b].tolist()
        chunks = stream.chunks(lo)
        try:
            at = lo
            k = 0  # wanted positions handed on
            for lst in chunks:
                end = at + len(lst)
                if end > hi:
                    lst = lst[: hi - at]
                    end = hi
                if not dense:  # the wanted samples (the list read is emptied: see above)
                    j = bisect.bisect_left(wanted, end, k)
                    got = [lst[p - at] for p in wanted[k:j]]
                    lst.clear()
                    lst, k = got, j
                at = end
                if at >= hi:
                    chunks.close()  # (lets go of the list the run's last one was cut from)
                yield lst
                if at >= hi:
                    break
        finally:
            chunks.close()
        if at < hi:
            raise TarshardsError(
                f"the epoch's samples ended at position {at}, before {hi}: the shards changed "
                "since they were counted"
            )


class UnitProgram(PlannedProgram):
    """The epoch program of a planned pipeline whose unit is a pack or a bucket's batch."""

    def __init__(self, ds: Any, epoch: int):
        spec, pre, post = unit_parts(ds)
        plan = ds.plan_config
        self.ds, self.spec, self.pre, self.post = ds, spec, pre, post
        self.epoch = int(epoch)
        self.layout = UnitLayout(
            ds.table, spec, ds.seed, ds.shardshuffle, plan["readers"], plan["remainder"], epoch
        )
        lay = self.layout
        self.units, self.full, self.readers, self.q = lay.units, lay.full, lay.readers, lay.q
        self.num_batches, self.dropped = lay.num_batches, lay.dropped
        self._handed: dict[int, list] = {}  # each reader's raw units handed on (_assembled)
        # the shards the pass's readers have mapped ([its source, its readers left]) and the
        # readers that read each shard (_UnitReads)
        self.maps: dict[int, list] = {}
        self.users: dict[int, int] = {}

    def close(self) -> None:
        maps, self.maps = self.maps, {}
        for entry in maps.values():
            _close_map(entry[0])

    def unit_samples(self, g: int) -> list[tuple[int, int, bool]]:
        """``(shard, sample index in the shard, pad)`` of each sample of global batch ``g`` (a
        pack or a bucket's batch), from the plan alone (what a ledger's audit replays)."""
        return self.layout.unit_samples(g)

    def _stream(self, stats=None) -> ReaderStream:
        import functools

        ds = self.ds
        ranged = ds.range_opener()
        opener = ds.open_shard
        return ReaderStream(
            ds.table,
            self.full,
            0,
            opener=opener if stats is None else functools.partial(opener, stats=stats),
            range_opener=(
                ranged
                if stats is None or ranged is None
                else functools.partial(ranged, stats=stats)
            ),
            last_dot=ds.last_dot,
            unit=16,
            stats=stats,
        )

    def chain(self, it, reader, batches):
        ctx = dict(it.ctx, reader=reader)
        P = len(self.units)
        ids = [reader * self.q + j for j in batches]
        real = [u for u in ids if u < P]
        pads = [u - P for u in ids if u >= P]
        # (here, not in the generator: every reader of the pass says which shards it maps
        # before any reads, so that a shard's map is closed after its last reader's last pack)
        reads = _UnitReads.of(self, ctx, real) if real else None
        return self._assembled(ctx, reader, real, pads, reads)

    def _assembled(self, ctx, reader, real, pads, reads=None):
        """The units (their samples through the stages before the unit stage, in unit order:
        what a stage does to a sample happens just before its unit goes out).

        Nothing of a unit stays referenced here once it is out: the raw lists the stages have
        consumed are emptied (as :class:`tarshards.planned._Feed` does for batches), and the
        unit itself is yielded without a name in this frame. With V readers interleaved, a
        reader that kept its last unit's samples alive until its next turn made every unit
        allocate memory gone cold in the CPU caches."""
        units = self.units
        P = len(units)
        ids = np.asarray([*real, *(u % P for u in pads)], dtype=np.int64)
        lens = units.offsets[ids + 1] - units.offsets[ids]
        # raw units handed on, with their iterators (emptied by turn_done once consumed)
        handed: list[tuple[list, Iterator]] = []
        self._handed[reader] = handed

        def iters():
            for got in self._raw_units(ctx, real, [u % P for u in pads], reads):
                it = iter(got)
                handed.append((got, it))
                yield it

        raw: Iterator = itertools.chain.from_iterable(iters())
        if ctx.get("stats") is not None:
            from ..stats import timed_source

            raw = timed_source(raw, ctx["stats"])
        data = iter(self.ds.run_stages(raw, self.pre, ctx, ("reader", reader)))
        for n in lens.tolist():
            yield self._out(self._take(data, n, reader))

    def turn_done(self, reader: int) -> None:
        """Empty the raw units of ``reader`` that the stages have wholly consumed (one that
        reads ahead has moved on to the next): at once, on the turn that handed the unit on,
        not on the reader's next turn, V turns later (see :meth:`_assembled`)."""
        handed = self._handed.get(reader)
        while handed and not operator.length_hint(handed[0][1]):
            handed.pop(0)[0].clear()

    def _take(self, data: Iterator, n: int, reader: int) -> list:
        got = list(itertools.islice(data, n))
        if len(got) < n:
            raise TarshardsError(
                f"a unit of epoch {self.epoch} (reader {reader}) lost samples: a stage "
                "before .pack()/.bucket() dropped samples (a planned pipeline needs each "
                "of them; flag bad samples instead)"
            )
        return got

    def _raw_units(self, ctx, real: list, pads: list, reads=None) -> Iterator[list]:
        """The raw samples of the units ``real``, then of the padding units ``pads`` (read by
        position, flagged): each unit read when it is due from its shards' maps where they are
        local plain tars with known offsets (``reads``, a :class:`_UnitReads`), else from the
        reader's stream (:meth:`_streamed_units`)."""
        units = self.units
        if real:
            if reads is not None:
                yield from reads.units()
            else:
                ids = np.asarray(real, dtype=np.int64)
                lo, hi = units.offsets[ids], units.offsets[ids + 1]
                lens = hi - lo
                cuts = np.concatenate(([0], np.cumsum(lens)))
                # every unit's members, taken from the plan at once
                flat = units.members[np.repeat(lo - cuts[:-1], lens) + np.arange(cuts[-1])]
                cut = cuts.tolist()
                members = flat.tolist()
                lists = [members[cut[i] : cut[i + 1]] for i in range(len(real))]
                yield from self._streamed_units(ctx, lists, flat)
        for u in pads:
            yield self._pad_raw(units.unit(u).tolist())

    def _streamed_units(self, ctx, real: list, flat) -> Iterator[list]:
        """The raw samples of the units whose members are ``real`` from the reader's stream.

        The reader reads its members in file order into one list (the lists read are appended
        and emptied: a list kept by the generators that made it would keep its samples alive
        after their unit is out) and takes each unit from it by index (a slice where the unit's
        samples are adjacent), at C speed; once a unit is out, the samples before the first one
        a later unit needs are let go. Where and what to take is arithmetic on the plan, done
        at once in numpy."""
        if real:  # (always)
            positions = np.sort(flat)  # the reader's members, in the order they are read
            lens = np.fromiter(map(len, real), dtype=np.int64, count=len(real))
            cuts = np.concatenate(([0], np.cumsum(lens)))
            at = np.searchsorted(positions, flat)  # each member's place in the read order
            firsts, lasts = at[cuts[:-1]], at[cuts[1:] - 1]  # (members ascending)
            # after unit j: the places before the first one a later unit needs are let go
            later = np.minimum.accumulate(firsts[::-1])[::-1]
            drop = np.append(later[1:], len(positions))
            base = np.concatenate(([0], drop[:-1]))  # places let go before unit j
            rel = (at - np.repeat(base, lens)).tolist()
            ends = (lasts + 1).tolist()
            adjacent = (lasts - firsts + 1 == lens).tolist()
            cut, span = cuts.tolist(), (drop - base).tolist()
            stream = self._stream(ctx.get("stats"))
            lists = _positions(stream, positions)
            try:
                buf: list = []
                done = 0
                for j in range(len(real)):
                    while done < ends[j]:  # read on to the unit's last sample
                        lst = next(lists)
                        done += len(lst)
                        buf += lst
                        lst.clear()
                    r = rel[cut[j] : cut[j + 1]]
                    if adjacent[j]:
                        got = buf[r[0] : r[-1] + 1]
                    elif len(r) == 1:
                        got = [buf[r[0]]]
                    else:
                        got = list(operator.itemgetter(*r)(buf))
                    del buf[: span[j]]
                    yield got
            finally:
                lists.close()
                stream.close()

    def _out(self, samples: list):
        fn = getattr(self.spec, "collation_fn", None)
        return fn(samples) if fn is not None else samples

    def _pad_raw(self, members: list) -> list:
        """The raw samples at positions ``members`` again (a unit), flagged ``__pad__``."""
        stream = self._stream()
        try:
            got = stream.read_positions(members)
        finally:
            stream.close()
        for p in members:
            got[p]["__pad__"] = True
        return [got[p] for p in members]

    def pad_chain(self, it):
        raw = iter(self._pad_raw(self.units.unit(0).tolist()))
        return iter([self._out(list(self.ds.run_stages(raw, self.pre, it.ctx, ("pad",))))])


def _unit_runs(table: ShardTable, units: UnitPlan, full) -> dict | None:
    """The runs of adjacent samples of one shard in every unit of ``units`` (the members of
    each, unit by unit): their byte ranges in the shards (``hi`` -1: to the end of the shard's
    last sample), shards and sample counts, each unit's first run (``of``: ``len(units) + 1``
    of them) and its samples (``size``), as lists; ``None`` where a shard is not a local plain
    tar with known sample offsets, or is read through a view's rows. Cached with the plan (an
    epoch's)."""
    if units._runs is not False:
        return units._runs
    got = None
    flat = units.members
    spans = np.asarray([r[:3] for r in full.runs], dtype=np.int64).reshape(-1, 3)
    starts = np.concatenate(([0], np.cumsum(spans[:, 2] - spans[:, 1])))
    which = np.searchsorted(starts, flat, side="right") - 1
    shard = spans[which, 0]
    idx = spans[which, 1] + (flat - starts[which])
    lo = np.empty(len(flat), dtype=np.int64)
    hi = np.empty(len(flat), dtype=np.int64)
    ok = True
    for s in np.unique(shard).tolist():
        url = table.urls[s]
        offsets = table.sample_offsets(s) if table.plain[s] else None
        if table.rows[s] is not None or offsets is None or not is_local(url):
            ok = False
            break
        offs = np.append(np.asarray(offsets, dtype=np.int64), -1)  # -1: to the shard's end
        mine = shard == s
        lo[mine] = offs[idx[mine]]
        hi[mine] = offs[idx[mine] + 1]
    if ok:
        new = np.ones(len(flat), dtype=bool)
        new[1:] = (shard[1:] != shard[:-1]) | (lo[1:] != hi[:-1]) | (hi[:-1] < 0)
        new[units.offsets[:-1][np.diff(units.offsets) > 0]] = True
        first = np.flatnonzero(new)
        end = np.append(first[1:], len(flat))
        got = {
            "lo": lo[first].tolist(),
            "hi": hi[end - 1].tolist(),
            "shard": shard[first].tolist(),
            "count": (end - first).tolist(),
            "of": np.searchsorted(first, units.offsets).tolist(),
            "size": np.diff(units.offsets).tolist(),
        }
    units._runs = got
    return got


def _close_map(src: tuple) -> None:
    """Close a shard a :class:`_UnitReads` opened: its map, then its stream."""
    ctx, mapped = src[:2]
    try:
        if mapped is not None:
            mapped.close()
    finally:
        ctx.__exit__(None, None, None)


def _unflagged(samples: list) -> list:
    """``samples`` with ``__pad__`` set false (here, so that no loop variable keeps one)."""
    for sample in samples:
        sample["__pad__"] = False
    return samples


class _UnitReads:
    """A reader's units read each when it is due, from its shards' maps: a unit's samples are
    parsed on the reader's turn that hands them on, none before.

    A reader that streams its shards and holds the samples of the packs still open (the other
    way, :meth:`UnitProgram._streamed_units`) parses each sample a turn or more before its
    pack goes out: with V readers interleaved, V - 1 other readers' turns come between, and
    the held samples have gone cold in the CPU caches by then. Here the members of a unit are
    runs of adjacent samples (a few: the packing rule keeps a pack's samples together), each
    one byte range of a mapped shard, parsed in one C call
    (:func:`~tarshards.tario.reader.plain_run`), and the unit grouped in one more
    (:func:`~tarshards.format.group_run`); where either declines (pax headers, damage), the
    general reader parses the unit's runs and raises the right error. The runs of every unit
    are arithmetic on the plan, done once per epoch (:func:`_unit_runs`, cached with the
    plan). For local plain tars whose sample offsets the index knows, without a view's rows,
    sidecar columns or a loader's counters (:meth:`of` says ``None`` otherwise)."""

    def __init__(self, prog, ids: list[int], runs: dict):
        self.prog, self.ds = prog, prog.ds
        self.ids = ids
        self.runs = runs
        self.urls = self.ds.table.urls
        # each shard's last use among these units; the pass counts this reader among its
        # readers (its map is closed when the last of them is done with it: _let_go)
        shard, ur = runs["shard"], runs["of"]
        self.last_use: dict[int, int] = {}
        for j, u in enumerate(ids):
            for r in range(ur[u], ur[u + 1]):
                self.last_use[shard[r]] = j
        users = prog.users
        for s in self.last_use:
            users[s] = users.get(s, 0) + 1

    @classmethod
    def of(cls, prog, ctx, ids: list[int]) -> "_UnitReads | None":
        ds = prog.ds
        if ctx.get("stats") is not None or getattr(ds, "layout", None) is not None:
            return None
        runs = _unit_runs(ds.table, prog.units, prog.full)
        if runs is None:
            return None
        return cls(prog, ids, runs)

    def units(self) -> Iterator[list]:
        runs = self.runs
        lo, hi, shard, ur = runs["lo"], runs["hi"], runs["shard"], runs["of"]
        ids = self.ids
        # this reader lets go of each shard after the last of its units that reads it
        closing: dict[int, list[int]] = {}
        for s, j in self.last_use.items():
            closing.setdefault(j, []).append(s)
        # after unit j: its first run's shard is read no more before this byte (its pages are
        # given back, MappedFile.release, every _GIVE_BACK bytes; -1: read no more)
        given: dict[int, int] = {}
        free: list[tuple[int, int]] = [(0, -1)] * len(ids)
        least: dict[int, int] = {}
        for j in range(len(ids) - 1, -1, -1):
            u = ids[j]
            free[j] = (shard[ur[u]], least.get(shard[ur[u]], -1))
            for r in range(ur[u], ur[u + 1]):
                if lo[r] < least.get(shard[r], 1 << 62):
                    least[shard[r]] = lo[r]
        # shard -> (its stream's context, its MappedFile or None, the stream, the map or None)
        maps: dict[int, tuple] = {}
        last_dot, size = self.ds.last_dot, runs["size"]
        try:
            for j, u in enumerate(ids):
                a, b = ur[u], ur[u + 1]
                members: list | None = []
                for r in range(a, b):
                    src = maps.get(shard[r]) or self._open(maps, shard[r])
                    end = hi[r] if hi[r] >= 0 else self._data_end(shard[r], src[1])
                    got = plain_run(src[3], lo[r], end) if src[3] is not None and end >= 0 else None
                    if got is None:
                        members = None
                        break
                    members += got  # type: ignore[operator]
                url = self.urls[shard[a]]
                samples = None if members is None else group_run(members, url, last_dot)
                del members
                if samples is None or len(samples) != size[u]:
                    samples = []
                    for r in range(a, b):
                        samples += self._general(maps, r)
                yield _unflagged(samples)
                s, at = free[j]
                if at - given.get(s, 0) >= _GIVE_BACK and s in maps and maps[s][1] is not None:
                    if self.prog.maps[s][1] == 1:  # (no other reader of the pass reads it)
                        maps[s][1].release(at)
                    given[s] = at
                for s in closing.get(j, ()):
                    self._let_go(maps, s)
        finally:
            for s in list(maps):
                self._let_go(maps, s)

    def _open(self, maps: dict, s: int) -> tuple:
        """Shard ``s`` opened and mapped, shared with the pass's other readers (adjacent
        readers read the same shard: one map, not one each)."""
        shared = self.prog.maps
        entry = shared.get(s)
        if entry is None:  # (its count: the readers that have not let go of it)
            ctx = self.ds.open_shard(self.urls[s])
            stream = ctx.__enter__()
            try:
                stream.seek(0)
                mapped = map_local(stream)
            except BaseException:
                ctx.__exit__(None, None, None)
                raise
            src = (ctx, mapped, stream, None if mapped is None else mapped.map)
            entry = shared[s] = [src, self.prog.users.get(s, 1)]
        maps[s] = entry[0]
        return entry[0]

    def _let_go(self, maps: dict, s: int) -> None:
        """This reader reads shard ``s`` no more (closed when no reader of the pass does)."""
        if maps.pop(s, None) is None:
            return
        users = self.prog.users
        users[s] = users.get(s, 1) - 1
        entry = self.prog.maps.get(s)
        if entry is not None:
            entry[1] = users[s]
            if users[s] <= 0:
                del self.prog.maps[s]
                _close_map(entry[0])

    def _data_end(self, s: int, mapped) -> int:
        """Where shard ``s``'s last sample ends (its last member's padded end, as a plain tar
        lays it out: a wrong guess only sends the run to the general reader), or -1."""
        if mapped is None:
            return -1
        ends = _ENDS.setdefault(self.ds.table, {})
        end = ends.get(s)
        if end is None:
            end = -1
            offsets = self.ds.table.sample_offsets(s)
            lo = int(offsets[-1])
            try:
                batches = iter_tar_batches(mapped.part(lo), "", offset=lo, chunk_size=1 << 16)
                last = None
                for batch in batches:
                    if batch:
                        last = batch[-1]
                if last is not None:
                    end = int(last[2]) + 512 + -(-len(last[1]) // 512) * 512
            except TarshardsError:  # (the general reader reports it)
                pass
            ends[s] = end
        return end

    def _general(self, maps: dict, r: int) -> list:
        """Run ``r``'s samples by the general reader (which raises the right error)."""
        runs = self.runs
        s, lo, hi, n = runs["shard"][r], runs["lo"][r], runs["hi"][r], runs["count"][r]
        url = self.urls[s]
        src = maps.get(s) or self._open(maps, s)
        try:
            if src[1] is not None:
                part = src[1].part(lo, None if hi < 0 else hi)
                chunks: Any = part
                size = part.stop - lo
            else:
                src[2].seek(lo)
                data = src[2].read(hi - lo) if hi >= 0 else src[2].read()
                chunks, size = [data], len(data)
            batches = iter_tar_batches(chunks, url, offset=lo, chunk_size=max(size, 1))
            groups = group_samples(batches, url, last_dot=self.ds.last_dot, batched=True)
            got = list(itertools.islice(groups, n))
            groups.close()
        except TarshardsError as exn:
            raise exn.with_context(url=url) from None
        if len(got) != n:
            raise TarshardsError(
                f"shard has fewer samples than counted: {len(got)} of {n} from offset {lo} "
                "(the shard changed since it was indexed)",
                url=url,
                offset=lo,
            )
        return got


class UnitLayout:
    """An epoch's units laid out over ``readers`` virtual readers, from the plan alone (no data
    read): what a :class:`UnitProgram` reads and what an audit replays (:func:`replay_units`).
    ``units`` (:class:`UnitPlan`), ``full`` (the epoch's sample list over one reader), ``q``
    (units per reader), ``num_batches`` (global units), ``dropped`` (samples left out)."""

    def __init__(
        self,
        table: ShardTable,
        spec,
        seed: int,
        shardshuffle: bool,
        readers: int,
        remainder: str,
        epoch: int,
    ):
        self.spec = spec
        self.epoch = int(epoch)
        if remainder == "carry":
            raise ValueError(
                "remainder='carry' is not supported with .pack()/.bucket(): use 'drop' (the "
                "units that do not fill the readers wait for no epoch) or 'pad'"
            )
        self.units = plan_units(table, spec, seed, shardshuffle, self.epoch)
        self.full = _epoch_list(table, seed, shardshuffle, self.epoch)
        V, P = int(readers), len(self.units)
        self.readers = V
        self.q = -(-P // V) if remainder == "pad" else P // V
        if self.q == 0:
            raise ValueError(
                f"epoch {epoch} has {P} units ({_unit_name(spec)}), fewer than readers={V}: "
                "use fewer readers or remainder='pad'"
            )
        self.num_batches = V * self.q
        # samples the units that do not fill the readers leave out (remainder="drop")
        unplanned = self.units.offsets[-1] - self.units.offsets[V * self.q] if P > V * self.q else 0
        self.dropped = int(unplanned) + self.units.left_out

    def unit_samples(self, g: int) -> list[tuple[int, int, bool]]:
        """``(shard, sample index in the shard, pad)`` of each sample of global batch ``g`` (a
        pack or a bucket's batch), from the plan alone (what a ledger's audit replays). The
        index counts the samples the table keeps (a view's rows: ``table.selected_rows``)."""
        if not 0 <= g < self.num_batches:
            raise ValueError(f"global batch {g} outside the epoch's {self.num_batches}")
        u = (g % self.readers) * self.q + g // self.readers
        P = len(self.units)
        out = []
        for p in self.units.unit(u % P).tolist():
            shard, i, _ = self.full.locate(p)
            out.append((shard, i, u >= P))
        return out


def spec_from_identity(identity: dict):
    """The unit spec (packs or a bucket's batches) a plan identity records (a ledger's start
    record, a saved state), or ``None`` when the plan groups no units."""
    unit = identity.get("unit")
    if unit == "pack":
        rule = identity.get("packs")
        if rule != PACK_RULE:
            made = (
                f"by the rule {rule!r}"
                if rule
                else "by an earlier tarshards (best-fit decreasing in windows of cost)"
            )
            raise ValueError(
                f"the plan's packs were made {made}; this tarshards makes them by "
                f"{PACK_RULE!r}: other packs, so it cannot replay or resume that plan"
            )
        return PackSpec(
            float(identity["max_tokens"]),
            identity["cost"],
            identity["window"],
            identity["oversize"],
        )
    if unit == "bucket":
        return BucketSpec(
            identity["key"],
            tuple(float(b) for b in identity["boundaries"]),
            tuple(int(b) for b in identity["batch_sizes"]),
            bool(identity["partial"]),
        )
    return None


def replay_units(table: ShardTable, identity: dict, epoch: int) -> UnitLayout:
    """The :class:`UnitLayout` of ``epoch`` of the packed or bucketed plan ``identity`` records
    (:func:`plan_identity`) over ``table``; a ``ValueError`` where the table's metadata column is
    not the one the plan was made from."""
    spec = spec_from_identity(identity)
    if spec is None:
        raise ValueError("the plan groups no packs or buckets")
    name = spec.cost if isinstance(spec, PackSpec) else spec.key
    _, digest = _column(table, name)
    if identity.get("meta") not in (None, digest):
        raise ValueError(
            f"the metadata column {name!r} of the data is not the one the plan was made from "
            "(its digest differs): give the data the run read"
        )
    return UnitLayout(
        table,
        spec,
        int(identity["seed"]),
        bool(identity["shardshuffle"]),
        int(identity["readers"]),
        identity["remainder"],
        epoch,
    )


def warn_dropped(ds, epoch: int) -> None:
    """Warn (once per epoch and process) of the samples a packed/bucketed plan leaves out:
    units past ``readers x q`` (``remainder="drop"`` left to its default) and samples in no unit
    (``oversize="drop"``, ``partial=False``: always)."""
    warned = ds.__dict__.setdefault("_dropped_warned", set())
    if epoch in warned:
        return
    warned.add(epoch)
    prog = ds.epoch_program(epoch)
    tail = prog.dropped - prog.units.left_out
    parts = []
    if tail and not ds.plan_config.get("chosen"):
        parts.append(
            f"{tail} in the {len(prog.units) - prog.num_batches} units that do not fill "
            f"readers={prog.readers} (remainder='drop' is the default; 'pad' repeats units "
            "flagged __pad__ instead)"
        )
    if prog.units.left_out:
        what = (
            "over max_tokens (oversize='drop')"
            if isinstance(prog.spec, PackSpec)
            else ("in partial batches (partial=False)")
        )
        parts.append(f"{prog.units.left_out} {what}")
    if parts:
        warnings.warn(
            f"epoch {epoch} leaves out samples: " + "; ".join(parts),
            TarshardsWarning,
            stacklevel=4,
        )
