"""The data-order ledger: what each training step saw, written as it runs and audited later.

``WebLoader(dataset, ledger=PATH)`` (a planned dataset: ``WebDataset(..., readers=V)``) appends
one line of JSON per step to one file per rank: ``PATH`` with ``{rank}`` replaced, or, when
``PATH`` has no ``{rank}``, ``PATH/rank-N.jsonl`` (``PATH`` a directory). Two kinds of record:

- a **start** record at every ``iter(loader)`` (each epoch, each resume)::

    {"ledger": "tarshards.ledger/1", "plan": "3f9c0a1d2b4e", "identity": {...the plan's
     identity: fingerprint, seed, readers, batch_size, remainder, shardshuffle, bufsize,
     initial}, "epoch": 0, "position": 10, "origin": 10, "resumed": true, "rank": 1,
     "world_size": 3, "num_batches": 36, "data": "/data/manifest.json", "time": 1765000000.5}

- a **step** record per batch handed to the trainer::

    {"plan": "3f9c0a1d2b4e", "epoch": 0, "step": 2, "batch": 17, "rank": 1, "world_size": 3,
     "time": 1765000001.25}

``batch`` is the step's *global batch* ``g`` of the epoch's plan (:mod:`tarshards.plan`: batch
``g // V`` of virtual reader ``g % V``; ``g >= num_batches`` is a batch of declared padding), which
with the plan names the step's samples exactly; ``step`` is the loader's step within the epoch
(its ``state_dict()["step"]``); ``plan`` is a short hash of the identity (the same for every rank
and restart of one training). Each record is one ``write`` of an unbuffered append-only file:
a killed process loses at most the record it was writing (a torn last line is ignored).

:func:`audit` (``tarshards audit LEDGER... [SPEC]``) reads the ledgers (one per rank, or one for
all: records carry their rank), replays the plans and reports, per epoch, the samples delivered
twice or never. A *resume* (a start record with ``resumed``, made by ``load_state_dict``) from
position ``G`` of epoch ``e`` discards what earlier runs delivered at or after ``(e, G)`` (the
model went back to that checkpoint with the loader: those steps are *replayed*, not repeated); a
loader that restarts without its state (the bug: model resumed, data from the start) shows as
samples delivered twice. Keys come from the data's manifest and shard indexes (``SPEC``, or the
manifest named in the start records): no sample data is read.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from .._lazy import LazyModule
from ..errors import TarshardsError
from ..format.manifest import Manifest, ShardRecord, as_manifest
from ..format.selection import as_record, is_view_spec
from ..read.specs import expand_urls, is_manifest_spec
from ..storage import is_local, local_path
from .cursor import ShuffleCore, reader_rng
from .epoch import EpochPlan, PlanConfig, ShardTable, plan_for
from .packing import replay_units, spec_from_identity

np = LazyModule("numpy", globals(), "np")

__all__ = [
    "LEDGER_FORMAT",
    "AuditReport",
    "EpochAudit",
    "Ledger",
    "LedgerWriter",
    "audit",
    "ledger_path",
    "plan_id",
    "read_ledger",
]

LEDGER_FORMAT = "tarshards.ledger/1"
_INDEX_SUFFIX = ".tsidx"


def plan_id(identity: dict) -> str:
    """The short name of a plan's identity (12 hex digits of its sha256): what step records
    carry to say which plan their ``batch`` is of."""
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def ledger_path(path: str | os.PathLike, rank: int) -> str:
    """The file rank ``rank`` writes: ``path`` with ``{rank}`` replaced, or ``path/rank-N.jsonl``
    (``path`` a directory) when it has no ``{rank}``."""
    path = os.fspath(path)
    if "{rank}" in path:
        return path.replace("{rank}", str(int(rank)))
    return os.path.join(path, f"rank-{int(rank)}.jsonl")


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------


class LedgerWriter:
    """Appends one rank's records to its ledger file (one ``os.write`` per record, no buffer:
    what a killed process wrote is in the file). A context manager; :meth:`close` closes it."""

    def __init__(self, path: str | os.PathLike, rank: int, world_size: int):
        self.path = ledger_path(path, rank)
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self.rank, self.world_size = int(rank), int(world_size)
        self.plan: str | None = None
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def start(
        self,
        identity: dict,
        *,
        epoch: int,
        position: int,
        origin: int,
        num_batches: int,
        resumed: bool,
        data: str | None = None,
    ) -> None:
        """A start record: the loader begins (or resumes) ``epoch`` at global batch
        ``position`` (``origin``: where its world's step 0 is)."""
        self.plan = plan_id(identity)
        record = {
            "ledger": LEDGER_FORMAT,
            "plan": self.plan,
            "identity": identity,
            "epoch": int(epoch),
            "position": int(position),
            "origin": int(origin),
            "resumed": bool(resumed),
            "rank": self.rank,
            "world_size": self.world_size,
            "num_batches": int(num_batches),
            "data": data,
            "time": time.time(),
        }
        self._write(json.dumps(record, separators=(",", ":")) + "\n")

    def step(self, epoch: int, step: int, batch: int) -> None:
        """A step record: global batch ``batch`` of ``epoch`` handed out as step ``step``."""
        self._write(
            f'{{"plan":"{self.plan}","epoch":{epoch},"step":{step},"batch":{batch},'
            f'"rank":{self.rank},"world_size":{self.world_size},"time":{time.time():.6f}}}\n'
        )

    def _write(self, line: str) -> None:
        if self._fd is None:
            raise ValueError(f"the ledger {self.path} is closed")
        os.write(self._fd, line.encode())

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "LedgerWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------


def _ledger_files(paths: Iterable[str | os.PathLike]) -> list[str]:
    files: list[str] = []
    for p in paths:
        p = os.fspath(p)
        if os.path.isdir(p):
            found = sorted(glob.glob(os.path.join(p, "*.jsonl")))
            if not found:
                raise ValueError(f"no ledger files (*.jsonl) in the directory {p}")
            files += found
        elif any(c in p for c in "*?["):
            files += sorted(glob.glob(p))
        elif os.path.exists(p):
            files.append(p)
        else:
            raise FileNotFoundError(f"no ledger at {p}")
    if not files:
        raise ValueError("no ledger files given")
    return files


_STEP_FIELDS = ("epoch", "step", "batch", "rank", "world_size")
_STEP_HEAD = b'{"plan":"'
_NUMBERS_ONLY = bytes(c if chr(c) in "0123456789.-" else 32 for c in range(256))


def _start_lines(data: bytes) -> tuple[list[bytes], bytes]:
    """The start records' lines of a ledger file's ``data`` (a few), and the rest."""
    heads, pieces, pos = [], [], 0
    while True:
        i = data.find(b'{"ledger"', pos)
        if i < 0:
            break
        j = data.find(b"\n", i) + 1 or len(data)
        heads.append(data[i:j])
        pieces.append(data[pos:i])
        pos = j
    if not heads:
        return heads, data
    pieces.append(data[pos:])
    return heads, b"".join(pieces)


class Ledger:
    """The records of one or more ledger files: :attr:`starts` (a list of dicts, in the files'
    order) and the step records as numpy arrays (:attr:`steps`: ``plan`` (index into
    :attr:`plans`), ``epoch``, ``step``, ``batch``, ``rank``, ``world_size``, ``time``).
    :attr:`torn` counts ignored lines (a torn last line of a killed writer)."""

    def __init__(self, files: Sequence[str]):
        self.files = list(files)
        self.starts: list[dict] = []
        self.plans: list[str] = []
        self.torn = 0
        self._plan_of: dict[str, int] = {}
        parts: list[dict[str, Any]] = []
        for path in self.files:
            with open(path, "rb") as f:
                data = f.read()
            end = data.rfind(b"\n") + 1
            tail, data = data[end:], data[:end]  # tail: a line cut short (or left unended)
            lines, body = _start_lines(data)
            fast = self._fast_columns(body)
            if fast is None:  # not the writer's own format throughout: line by line
                lines += [ln for ln in body.split(b"\n") if ln.strip()]
            else:
                parts.append(fast)
            records = []
            for line in lines:
                try:
                    records.append(json.loads(line))
                except ValueError:
                    raise ValueError(f"{path}: {line[:80]!r} is not a ledger record") from None
            if tail.strip():
                try:
                    records.append(json.loads(tail))
                except ValueError:
                    self.torn += 1
            steps = []
            for rec in records:
                if "ledger" in rec:
                    if rec["ledger"] != LEDGER_FORMAT:
                        raise ValueError(
                            f"{path}: ledger format {rec['ledger']!r}, expected {LEDGER_FORMAT!r}"
                        )
                    rec["file"] = path
                    self.starts.append(rec)
                    self._plan(rec["plan"])
                else:
                    steps.append(rec)
            parts.append(self._json_columns(steps))
        self.steps: dict[str, Any] = {
            k: np.concatenate([p[k] for p in parts]) for k in ("plan", *_STEP_FIELDS, "time")
        }

    def _plan(self, name: str) -> int:
        got = self._plan_of.get(name)
        if got is None:
            got = self._plan_of[name] = len(self.plans)
            self.plans.append(name)
        return got

    def _fast_columns(self, body: bytes) -> dict[str, Any] | None:
        """The step records of ``body`` as columns when every line is one in the writer's own
        format, of one plan: the field names cut out and the numbers parsed by numpy in one
        call (1M records in about a second); else ``None``."""
        n = body.count(b"\n")
        if not n:
            return self._json_columns([])
        plan = body[len(_STEP_HEAD) : len(_STEP_HEAD) + 12]
        if not body.startswith(_STEP_HEAD) or body.count(_STEP_HEAD + plan + b'"') != n:
            return None
        # the plan, the field names, braces and commas to blanks: the numbers are left
        nums = body.replace(_STEP_HEAD + plan + b'"', b"").translate(_NUMBERS_ONLY)
        try:
            values = np.fromstring(nums, dtype=np.float64, sep=" ")
        except ValueError:
            return None
        if values.size != 6 * n:
            return None
        table = values.reshape(n, 6)
        out = {k: table[:, i].astype(np.int64) for i, k in enumerate(_STEP_FIELDS)}
        out["time"] = table[:, 5].copy()
        out["plan"] = np.full(n, self._plan(plan.decode()), dtype=np.int64)
        return out

    def _json_columns(self, records: list[dict]) -> dict[str, Any]:
        n = len(records)
        out = {
            k: np.fromiter((r[k] for r in records), dtype=np.int64, count=n) for k in _STEP_FIELDS
        }
        out["time"] = np.fromiter((r["time"] for r in records), dtype=np.float64, count=n)
        out["plan"] = np.fromiter((self._plan(r["plan"]) for r in records), dtype=np.int64, count=n)
        return out

    def __len__(self) -> int:
        return len(self.steps["time"])

    def identity(self, plan: int) -> dict | None:
        """The identity of plan number ``plan`` (from its start records), or ``None``."""
        name = self.plans[plan]
        for s in self.starts:
            if s["plan"] == name:
                return s["identity"]
        return None

    def num_batches(self, plan: int, epoch: int) -> int | None:
        name = self.plans[plan]
        for s in self.starts:
            if s["plan"] == name and s["epoch"] == epoch:
                return int(s["num_batches"])
        return None

    def data(self) -> str | None:
        """The data the start records name (a manifest's URL), if any."""
        for s in self.starts:
            if s.get("data"):
                return s["data"]
        return None


def read_ledger(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> Ledger:
    """The records of the ledgers ``paths`` (files, directories of ``*.jsonl``, globs)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    return Ledger(_ledger_files(paths))


# ---------------------------------------------------------------------------------------------
# the data: counts and keys from the manifest and the shard indexes
# ---------------------------------------------------------------------------------------------


def _manifest_of(spec, storage_options: dict | None = None) -> Manifest:
    """The manifest of ``spec`` (a manifest, or shards whose sidecar indexes give counts and
    keys): no shard is read."""
    if isinstance(spec, Manifest) or is_manifest_spec(spec):
        return as_manifest(spec, storage_options).with_sidecar_indexes()
    from ..format.index import ShardIndex

    records = []
    for url in expand_urls(spec, storage_options=storage_options):
        if is_local(url):
            url = os.path.abspath(local_path(url))
        try:
            idx = ShardIndex.load(url + _INDEX_SUFFIX, storage_options=storage_options)
        except (OSError, TarshardsError) as exn:
            raise ValueError(
                f"no index for {url} ({exn}): the audit reads keys from indexes, never from the "
                "shards; give the data's manifest, or make indexes: tarshards index --sidecar"
            ) from None
        records.append(ShardRecord(url=url, samples=idx.num_samples, index=url + _INDEX_SUFFIX))
    return Manifest(tuple(records), storage_options=storage_options)


class _Data:
    """A manifest (or a view of one) as the plans see it (a :class:`ShardTable`) and its keys,
    loaded per shard."""

    def __init__(self, manifest: Manifest, view=None):
        self.manifest = manifest
        self.table = (
            ShardTable.from_manifest(manifest)
            if view is None
            else ShardTable.from_view(view, manifest.shard_urls())
        )
        self.urls = self.table.urls
        self._keys: dict[int, list[str]] = {}

    def fits(self, fingerprint: str) -> bool:
        return fingerprint in (self.table.fingerprint, self.manifest.checksum)

    def row(self, shard: int, i: int) -> int:
        """The row in its shard of the plan's sample ``i`` of ``shard`` (a view keeps some)."""
        kept = self.table.selected_rows(shard)
        return int(i) if kept is None else int(kept[i])

    def key(self, shard: int, row: int) -> str | None:
        keys = self._keys.get(shard)
        if keys is None:
            if self.manifest.shards[shard].index is None:
                return None
            keys = self._keys[shard] = self.manifest.load_index(shard).keys
        return keys[row]


# ---------------------------------------------------------------------------------------------
# the audit
# ---------------------------------------------------------------------------------------------


@dataclass
class EpochAudit:
    """One epoch of one plan: its global batches (``num_batches``; ``None`` when no start record
    says and no data was given), those delivered (``delivered``), whether the epoch ran to its
    end (``complete``: else only what lies before the furthest step is checked), the batches
    delivered twice or more (``twice``: batch -> times) and never (``never``), padding batches
    (``padding``), steps replayed after a resume (``replayed``), and the samples behind the
    faults (``duplicate_samples``, ``missing_samples``: dicts with shard, row, key, batch)."""

    plan: str
    epoch: int
    num_batches: int | None
    world_sizes: list[int]
    delivered: int
    complete: bool
    reached: int
    twice: dict[int, int] = field(default_factory=dict)
    never: list[int] = field(default_factory=list)
    padding: int = 0
    replayed: int = 0
    batch_size: int | None = None
    duplicate_samples: list[dict] = field(default_factory=list)
    missing_samples: list[dict] = field(default_factory=list)
    named: str | None = None  # why the samples are not named (None: they are)
    dropped: int | None = None  # samples remainder="drop" leaves out of the epoch (declared)

    @property
    def ok(self) -> bool:
        return not self.twice and not self.never

    def as_dict(self) -> dict:
        return {
            "plan": self.plan,
            "epoch": self.epoch,
            "num_batches": self.num_batches,
            "world_sizes": self.world_sizes,
            "delivered_batches": self.delivered,
            "complete": self.complete,
            "reached": self.reached,
            "batch_size": self.batch_size,
            "padding_batches": self.padding,
            "dropped_samples": self.dropped,
            "replayed_steps": self.replayed,
            "ok": self.ok,
            "twice": [{"batch": b, "times": n} for b, n in sorted(self.twice.items())],
            "never": self.never,
            "duplicate_samples": self.duplicate_samples,
            "missing_samples": self.missing_samples,
        }


@dataclass
class AuditReport:
    """What :func:`audit` found: one :class:`EpochAudit` per (plan, epoch); :attr:`ok` when no
    sample was delivered twice or never."""

    epochs: list[EpochAudit]
    steps: int
    files: list[str]
    torn: int = 0
    named: bool = False  # the samples are named (the data was at hand)

    @property
    def ok(self) -> bool:
        return all(e.ok for e in self.epochs)

    def as_dict(self) -> dict:
        return {
            "ok": self.ok,
            "steps": self.steps,
            "files": self.files,
            "torn_lines": self.torn,
            "epochs": [e.as_dict() for e in self.epochs],
        }

    def __str__(self) -> str:
        lines = [
            f"{self.steps} step records in {len(self.files)} ledger file(s)"
            + (f", {self.torn} torn line(s) ignored" if self.torn else "")
        ]
        for e in self.epochs:
            worlds = "->".join(str(w) for w in e.world_sizes)
            span = (
                f"{e.num_batches} batches"
                if e.complete
                else f"in progress: {e.reached} of {e.num_batches} batches"
            )
            head = (
                f"epoch {e.epoch} (plan {e.plan}, world size {worlds}): {span}, "
                f"{e.delivered} delivered"
            )
            if e.padding:
                head += f", {e.padding} of padding"
            if e.replayed:
                head += f", {e.replayed} replayed after a resume"
            if e.dropped:
                head += f", {e.dropped} sample(s) left out by remainder='drop'"
            if e.ok:
                lines.append(head + ": every sample exactly once")
                continue
            if e.named is None:  # the samples named (padding apart)
                twice, never = len(e.duplicate_samples), len(e.missing_samples)
                what = "sample(s)"
            else:
                twice, never, what = sum(n - 1 for n in e.twice.values()), len(e.never), "batch(es)"
            lines.append(f"{head}: {twice} {what} delivered twice, {never} never")
            for b, n in sorted(e.twice.items()):
                lines.append(f"  batch {b} delivered {n} times")
            for b in e.never:
                lines.append(f"  batch {b} never delivered")
            for kind, samples in (("twice", e.duplicate_samples), ("never", e.missing_samples)):
                for s in samples:
                    lines.append(
                        f"  {kind}: {s['key']}  (shard {s['shard']}, row {s['row']}, "
                        f"batch {s['batch']})"
                    )
            if e.named is not None:
                lines.append(f"  ({e.named})")
        return "\n".join(lines)


def _resumes(ledger: Ledger, name: str) -> list[tuple[float, int, int]]:
    """(time, epoch, position) of each resume of plan ``name``: the start records with
    ``resumed`` that load one state into one world (every rank writes one) make one resume,
    timed by its first; a rank that starts twice from the same state is two resumes."""
    groups: dict[tuple, list[tuple[float, set]]] = {}
    for s in sorted(
        (s for s in ledger.starts if s["plan"] == name and s.get("resumed")),
        key=lambda s: s["time"],
    ):
        runs = groups.setdefault((s["epoch"], s["position"], s["world_size"]), [])
        who = (s["file"], s["rank"])
        if not runs or who in runs[-1][1]:
            runs.append((s["time"], set()))
        runs[-1][1].add(who)
    return sorted((t, key[0], key[1]) for key, runs in groups.items() for t, _ in runs)


def _superseded(ledger: Ledger, plan: int) -> Any:
    """A boolean array over the step records: those of plan ``plan`` that a later resume went
    back over (a start record with ``resumed`` at a position at or before theirs)."""
    st = ledger.steps
    resumes = _resumes(ledger, ledger.plans[plan])
    out = np.zeros(len(st["time"]), dtype=bool)
    if not resumes:
        return out
    big = np.int64(1) << 40
    times = np.array([r[0] for r in resumes])
    keys = np.array([r[1] * big + r[2] for r in resumes], dtype=np.int64)
    # the least (epoch, position) resumed to after each time: a suffix minimum
    suffix = np.minimum.accumulate(keys[::-1])[::-1]
    suffix = np.append(suffix, np.iinfo(np.int64).max)
    at = np.searchsorted(times, st["time"], side="right")
    pos = st["batch"] - st["rank"]  # the step's first global batch
    key = st["epoch"] * big + pos
    return (key >= suffix[at]) & (st["plan"] == plan)


def _plan_config(identity: dict) -> PlanConfig:
    return PlanConfig(
        seed=identity["seed"],
        readers=identity["readers"],
        batch_size=identity["batch_size"],
        remainder=identity["remainder"],
        shardshuffle=identity["shardshuffle"],
        bufsize=identity["bufsize"],
        initial=identity["initial"],
    )


class _Replay:
    """The samples of a plan's global batches, from the plan alone (no data read)."""

    def __init__(self, data: _Data, config: PlanConfig):
        self.data, self.config = data, config
        self._orders: dict[tuple[int, int], Any] = {}

    def plan(self, epoch: int) -> EpochPlan:
        return plan_for(self.data.table, self.config, epoch)

    def _order(self, plan: EpochPlan, reader: int):
        """Reader ``reader``'s segment positions in the order its shuffle buffer gives them."""
        got = self._orders.get((plan.epoch, reader))
        if got is None:
            cfg = self.config
            n = plan.segment_length
            if cfg.bufsize <= 1:
                got = np.arange(n)
            else:
                core = ShuffleCore(
                    cfg.bufsize, cfg.initial, reader_rng(cfg.seed, plan.epoch, reader)
                )
                got = np.fromiter(core.run(iter(range(n))), dtype=np.int64, count=n)
            self._orders[(plan.epoch, reader)] = got
        return got

    @property
    def batch_size(self) -> int:
        return self.config.batch_size

    def num_batches(self, epoch: int) -> int:
        return self.plan(epoch).num_batches

    def dropped(self, epoch: int) -> int | None:
        """Samples ``remainder="drop"`` leaves out of the epoch (``None``: another remainder)."""
        if self.config.remainder != "drop":
            return None
        plan = self.plan(epoch)
        return plan.length - plan.num_batches * self.config.batch_size

    def samples(self, epoch: int, batch: int) -> list[dict]:
        """The samples of global batch ``batch`` of ``epoch``: shard (URL), row, key, pad."""
        plan = self.plan(epoch)
        B, V = self.config.batch_size, self.config.readers
        if batch >= plan.num_batches:  # a padding batch: the epoch's first samples, unshuffled
            positions = list(range(min(B, plan.segment_length)))
            reader, pad_batch = 0, True
        else:
            reader, j = batch % V, batch // V
            positions = self._order(plan, reader)[j * B : (j + 1) * B].tolist()
            pad_batch = False
        out = []
        for p in positions:
            shard, i, pad = plan.locate(plan.reader_position(reader, int(p)))
            row = self.data.row(shard, i)
            out.append(
                {
                    "shard": self.data.urls[shard],
                    "row": int(row),
                    "key": self.data.key(shard, row),
                    "batch": int(batch),
                    "pad": bool(pad or pad_batch),
                }
            )
        return out


class _UnitReplay:
    """The samples of a packed or bucketed plan's global units (packs, a bucket's batches),
    from the plan and the metadata column alone (:func:`tarshards.plan.packing.replay_units`)."""

    batch_size = None

    def __init__(self, data: _Data, identity: dict):
        self.data, self.identity = data, identity
        self._layouts: dict[int, Any] = {}

    def layout(self, epoch: int):
        got = self._layouts.get(epoch)
        if got is None:
            got = self._layouts[epoch] = replay_units(self.data.table, self.identity, epoch)
        return got

    def num_batches(self, epoch: int) -> int:
        return self.layout(epoch).num_batches

    def dropped(self, epoch: int) -> int | None:
        lay = self.layout(epoch)
        return lay.dropped if (self.identity["remainder"] == "drop" or lay.dropped) else None

    def samples(self, epoch: int, batch: int) -> list[dict]:
        lay = self.layout(epoch)
        if batch >= lay.num_batches:  # a padding unit: the epoch's first unit again
            got = [(s, i, True) for s, i, _ in lay.unit_samples(0)]
        else:
            got = lay.unit_samples(batch)
        out = []
        for shard, i, pad in got:
            row = self.data.row(shard, i)
            out.append(
                {
                    "shard": self.data.urls[shard],
                    "row": row,
                    "key": self.data.key(shard, row),
                    "batch": int(batch),
                    "pad": bool(pad),
                }
            )
        return out


def _replay_of(data: _Data | None, identity: dict | None) -> "_Replay | _UnitReplay | None":
    """How the samples of the plan ``identity`` are replayed over ``data`` (``None``: a mixture,
    or no data)."""
    if data is None or identity is None or "sources" in identity:
        return None
    if not data.fits(identity["fingerprint"]):
        raise ValueError(
            f"the data ({data.table}) is not the data the ledger's plan ran over (fingerprint "
            f"{identity['fingerprint'][:12]}): give the manifest (or view) it was trained on"
        )
    if spec_from_identity(identity) is not None:
        return _UnitReplay(data, identity)
    return _Replay(data, _plan_config(identity))


def _load_data(ledger: Ledger, spec, storage_options: dict | None) -> _Data | None:
    if spec is None:
        spec = ledger.data()
        if spec is None:
            return None
    if is_view_spec(spec):  # a view: the rows it keeps of its manifest's shards
        view = as_record(spec, storage_options)
        if isinstance(view, Manifest):  # (a manifest under a view's name)
            return _Data(_manifest_of(view, storage_options))
        manifest = view.manifest.with_sidecar_indexes()
        return _Data(manifest, view)
    return _Data(_manifest_of(spec, storage_options))


def audit(
    ledgers: str | os.PathLike | Iterable[str | os.PathLike] | Ledger,
    spec=None,
    *,
    storage_options: dict | None = None,
    name_limit: int = 1000,
) -> AuditReport:
    """Replay the plans of the ledgers ``ledgers`` and report, per epoch, the samples delivered
    twice or never (see the module docstring). ``spec``: the data (a manifest, or shards with
    sidecar indexes; default: the manifest the ledgers name), used to count batches where no
    start record does and to name the samples (shard, row, key: from the indexes, no sample
    data read); ``name_limit`` bounds the samples named per epoch and kind."""
    ledger = ledgers if isinstance(ledgers, Ledger) else read_ledger(ledgers)
    data = _load_data(ledger, spec, storage_options)
    st = ledger.steps
    epochs: list[EpochAudit] = []
    for p, name in enumerate(ledger.plans):
        identity = ledger.identity(p)
        single = identity is not None and "sources" not in identity  # not a mixture
        replay = _replay_of(data, identity)
        gone = _superseded(ledger, p)
        mine = st["plan"] == p
        for e in sorted(set(st["epoch"][mine].tolist())):
            in_epoch = mine & (st["epoch"] == e)
            live = in_epoch & ~gone
            nb = ledger.num_batches(p, e)
            if nb is None and replay is not None:
                nb = replay.num_batches(e)
            batches = st["batch"][live]
            worlds = list(dict.fromkeys(st["world_size"][live].tolist()))
            later = bool(np.any(mine & ~gone & (st["epoch"] > e)))
            ends = (batches - st["rank"][live]) + st["world_size"][live]
            reached = int(ends.max()) if len(ends) else 0
            if nb is None:
                nb = reached  # unknown: what was reached
            complete = later or reached >= nb
            limit = nb if complete else min(reached, nb)
            real = batches[batches < nb]
            counts = np.bincount(real, minlength=nb) if nb else np.zeros(0, dtype=np.int64)
            twice = {int(b): int(counts[b]) for b in np.flatnonzero(counts > 1)}
            never = [int(b) for b in np.flatnonzero(counts[:limit] == 0)]
            ea = EpochAudit(
                plan=name,
                epoch=int(e),
                num_batches=nb,
                world_sizes=worlds,
                delivered=int(len(real)),
                complete=complete,
                reached=min(reached, nb),
                twice=twice,
                never=never,
                padding=int((batches >= nb).sum()),
                replayed=int((in_epoch & gone).sum()),
                batch_size=identity.get("batch_size") if identity else None,
            )
            if replay is not None:
                ea.dropped = replay.dropped(ea.epoch)
            if replay is None:
                ea.named = (
                    "the samples of a mixture are not named: its batches are checked"
                    if not single
                    else "give the data's manifest to name the samples"
                )
            if replay is not None:
                ea.duplicate_samples = [
                    s
                    for b in list(twice)[:name_limit]
                    for s in replay.samples(ea.epoch, b)
                    if not s["pad"]
                ][:name_limit]
                ea.missing_samples = [
                    s
                    for b in never[:name_limit]
                    for s in replay.samples(ea.epoch, b)
                    if not s["pad"]
                ][:name_limit]
            epochs.append(ea)
    return AuditReport(
        epochs=epochs, steps=len(ledger), files=ledger.files, torn=ledger.torn, named=bool(data)
    )


def step_samples(
    ledgers: str | os.PathLike | Iterable[str | os.PathLike] | Ledger,
    step: int,
    spec=None,
    *,
    storage_options: dict | None = None,
) -> dict:
    """What training step ``step`` held: the steps are counted from 0 in the order training took
    them (epoch, then position; a resume's replayed steps left out), one per world step (every
    rank's batch). Returns ``{"step", "epoch", "position", "world_size", "ranks": [{"rank",
    "batch", "samples": [{shard, row, key, pad}]}]}``; the samples need the data (``spec``, or
    the manifest the ledgers name)."""
    ledger = ledgers if isinstance(ledgers, Ledger) else read_ledger(ledgers)
    if len(ledger.plans) != 1:
        raise ValueError(
            f"the ledgers hold {len(ledger.plans)} plans: --keys needs the ledger of one training"
        )
    st = ledger.steps
    live = ~_superseded(ledger, 0)
    pos = st["batch"] - st["rank"]
    big = np.int64(1) << 40
    key = st["epoch"] * big + pos
    order = np.unique(key[live])
    if not 0 <= step < len(order):
        raise ValueError(f"step {step} is not in the ledger (it holds steps 0-{len(order) - 1})")
    k = order[step]
    rows = np.flatnonzero(live & (key == k))
    epoch, position = int(k // big), int(k % big)
    data = _load_data(ledger, spec, storage_options)
    replay = _replay_of(data, ledger.identity(0))
    ranks = []
    for i in rows[np.argsort(st["rank"][rows], kind="stable")]:
        b = int(st["batch"][i])
        ranks.append(
            {
                "rank": int(st["rank"][i]),
                "batch": b,
                "samples": replay.samples(epoch, b) if replay is not None else None,
            }
        )
    return {
        "step": int(step),
        "epoch": epoch,
        "position": position,
        "world_size": int(st["world_size"][rows[0]]),
        "ranks": ranks,
    }
