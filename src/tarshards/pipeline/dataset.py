"""The fluent ``WebDataset`` API: a :class:`~tarshards.pipeline.composition.DataPipeline` over tar
shards, with the plain shard split or an epoch plan over virtual readers (``readers=V``).

The composition itself lives in :mod:`tarshards.pipeline.composition`, the plain reading of shards
in :mod:`tarshards.read.reading` and the planned iteration in :mod:`tarshards.plan.planned`; their
public names are importable from here as before.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Iterable, Iterator, Mapping

from ..on_error import OnError
from ..plan import packing as _packing
from ..plan.epoch import PlanConfig, ShardTable, plan_for, scan_shards
from ..plan.planned import PlannedProgram, SingleProgram, feed_batches
from ..plan.shards import resampled_shards, shard_order, split_shards
from ..read.reading import iter_samples, shard_samples
from ..read.specs import check_local_shards, expand_urls
from ..read.specs import is_dataset_spec as _is_dataset_spec
from ..read.specs import is_manifest_spec as _is_manifest_spec
from ..read.specs import open_dataset_spec as _open_dataset_spec
from ..storage import is_local, open_url
from ..types import EpochContext, PlanOptions, ReadOptions, SafetyOptions, WorkerInfo
from . import stages as _stages
from .composition import _DEFAULT, _PLACE, DataPipeline, _Stage, _wanted

__all__ = [
    "DataPipeline",
    "PlanOptions",
    "PlannedProgram",
    "ReadOptions",
    "SafetyOptions",
    "WebDataset",
    "feed_batches",
    "iter_samples",
    "shard_samples",
]


class _Auto:
    """``decoder=``'s default: ``"rgb"`` with ``extensions=``, else no decoding."""

    def __repr__(self) -> str:
        return "<auto>"


_AUTO: Any = _Auto()

#: the option values' classes, by the name of the ``WebDataset`` parameter that takes one
_GROUPS: dict[str, type] = {"read": ReadOptions, "plan": PlanOptions, "safety": SafetyOptions}
#: each flat keyword of before -> the group whose value holds it
_FLAT = {
    name: group
    for group, cls in _GROUPS.items()
    for name in (f.name for f in dataclasses.fields(cls))
}


def _grouped(flat: dict, **given: Any) -> tuple:
    """The (read, plan, safety) values from those ``given`` (``None``: left out) and the flat
    keywords ``flat`` (webdataset's and tarshards' keywords of before: ``cache_dir=``,
    ``readers=``, ``allow_unsafe=``...), which go into the value of their group."""
    for name in flat:
        if name not in _FLAT:
            raise TypeError(f"WebDataset.__init__() got an unexpected keyword argument {name!r}")
    values = []
    for group, cls in _GROUPS.items():
        value = given[group]
        mine = {k: v for k, v in flat.items() if _FLAT[k] == group}
        if value is None:
            value = cls(**mine)
        elif not isinstance(value, cls):
            raise TypeError(f"{group}_options must be a {cls.__name__}, not {type(value).__name__}")
        elif mine:
            raise TypeError(
                f"pass {', '.join(k + '=' for k in mine)} either in {group}_options="
                f"{cls.__name__}(...) or as keywords, not both"
            )
        values.append(value)
    return tuple(values)


def _field(group: str, name: str) -> property:
    """The attribute ``name`` of a dataset: a field of its ``group`` value; setting it replaces
    the value (the values stay frozen)."""

    def get(self):
        return getattr(getattr(self, group), name)

    def put(self, value):
        setattr(self, group, dataclasses.replace(getattr(self, group), **{name: value}))

    return property(get, put, doc=f"``{group}.{name}``")


class WebDataset(DataPipeline):
    """A streaming dataset of samples from tar shards.

    Seed-notebook style: ``WebDataset(urls, extensions="jpg cls", decoder="pil",
    transforms=[augment, None], shuffle=100)`` yields tuples. Fluent style: ``WebDataset(urls,
    shardshuffle=True, seed=0).shuffle(1000).decode("pil").to_tuple("jpg", "cls").batched(64)``.

    ``urls``: a shard spec (braces, ``::``-joined specs, globs, lists, a URL list file, a
    directory of shards). ``split``: with a directory that Megatron-Energon prepared
    (``.nv-meta/split.yaml``), the part to read (``"train"``, ``"val"``, ``"test"``).
    A dataset spec file (``WebDataset("train.yaml", readers=V)``: sources, weights, subsets,
    repeats, splits, ``split=`` one of them; see :mod:`tarshards.curate.spec`) gives the planned
    mixture of its sources instead (a :class:`~tarshards.plan.mixing.MixedDataset`, ``__source__``
    on every sample).
    ``shardshuffle``: shuffle the shard order each epoch (default: on when ``shuffle`` > 0).
    ``resampled``: draw shards with replacement forever (bound it with ``.with_epoch(n)``).
    ``on_error``: what a data error does: ``"raise"``, ``"skip"``, ``"warn"``, or a function
    ``exn -> bool`` (see :mod:`tarshards.on_error`); ``handler=`` is its older name and takes
    webdataset's handler functions (``warn_and_continue``...).
    ``manifest``: the shards' manifest (exact ``len()``, ``verify``, known offsets).
    ``decode_size=(w, h)``: with ``decoder=``, decode images at that size (fast for JPEG).
    ``fields=[...]``: with a manifest, only these fields (and ``__key__``...): only the column
    groups holding them are read, and the base shards only when a field is not in a group
    (see :func:`tarshards.add_columns`); a manifest with column groups or a join
    (:func:`tarshards.join`) is read merged row by row; a view of one reads its rows of
    every part.

    The other options come in three frozen values (:mod:`tarshards.types`), each field also
    accepted as a keyword of its own (``WebDataset(urls, cache_dir=..., readers=60)`` is
    ``WebDataset(urls, read_options=ReadOptions(cache_dir=...),
    plan_options=PlanOptions(readers=60))``):

    ``read_options``, a :class:`ReadOptions`: how shards are opened and parsed.
    ``storage_options`` (fsspec's), ``allow_pipe`` (``pipe:`` URLs), ``retries``: reconnections
    per shard after a dropped connection (resumes at the offset), ``last_dot``,
    ``cache_dir``/``cache_size``: keep remote shards in a local cache (size like ``"20GB"``).
    ``prefetch``: shards opened ahead of the current one (default: 2 for remote shard lists, 0
    for local files); ``prefetch_bytes`` bounds the memory they buffer.
    ``copy=False``: zero-copy reads: the fields of local plain shards are read-only
    ``memoryview`` slices of the memory-mapped file instead of ``bytes`` copies (decoders take
    either; ``bytes(v)`` copies one out); other shards still give ``bytes``. See
    docs/performance.md.

    ``plan_options``, a :class:`PlanOptions`: which shards each reader reads.
    ``readers=V``: follow an epoch plan over ``V`` virtual readers (see
    :mod:`tarshards.plan.cursor`): exact and elastic mid-epoch resume (``state_dict()``), equal
    batches on every rank, ``len()`` exact; ``remainder="drop"|"carry"|"pad"`` says what
    happens to the samples that do not fill ``V x B`` (left out: ``"drop"``, with a warning
    naming the count for each epoch that drops any); ``equal=True`` asks for it explicitly.
    ``rank``/``world_size``: the node's place (default: from torch.distributed when initialized).
    ``nodesplitter``/``workersplitter``: functions ``urls -> urls`` replacing the default split.

    ``safety_options``, a :class:`SafetyOptions`: what is trusted and checked.
    ``allow_unsafe``: let ``decoder=`` unpickle. ``verify``: check shards against the manifest
    (over a view, which reads only its rows: each sample read against its index's member
    checksums).
    ``empty_check``: raise when this reader was given shards but found no sample in them.
    """

    def __new__(cls, urls=None, *args: Any, **options: Any):
        # a dataset spec file (train.yaml): the planned mixture of its sources it describes
        # (tarshards.curate.spec), which is not a WebDataset (so __init__ is not called)
        if _is_dataset_spec(urls):
            return _open_dataset_spec(cls, urls, *args, **options)
        return super().__new__(cls)

    def __init__(
        self,
        urls,
        extensions: str | None = None,
        decoder: Any = _AUTO,
        transforms: Any = None,
        shuffle: int = 0,
        *,
        shardshuffle: bool | None = None,
        resampled: bool = False,
        seed: int = 0,
        on_error: OnError = "raise",
        manifest=None,
        split: str | None = None,
        decode_size=None,
        read_options: ReadOptions | None = None,
        plan_options: PlanOptions | None = None,
        safety_options: SafetyOptions | None = None,
        **options: Any,
    ):
        handler = options.pop("handler", None)
        read, plan, safety = _grouped(
            options, read=read_options, plan=plan_options, safety=safety_options
        )
        fields = read.fields  # only these fields: only the column groups holding them are read
        super().__init__(self.read_samples, seed=seed, on_error=on_error, handler=handler)
        self._plan_config = None
        if plan.readers is not None:
            # remainder left out: "drop", with a warning for each epoch that drops samples
            PlanConfig(readers=plan.readers, remainder=plan.remainder or "drop")  # checks them
            self._plan_config = {
                "readers": plan.readers,
                "remainder": plan.remainder or "drop",
                "chosen": plan.remainder is not None,
            }
        storage_options = read.storage_options
        self._table: ShardTable | None = None
        self.manifest = None
        if manifest is None and _is_manifest_spec(urls):
            manifest, urls = urls, None
        #: a view (tarshards.format.selection.View) given as the manifest: its rows are what is read
        self.view = None
        if manifest is not None:
            from ..format.selection import View, as_record

            record = as_record(manifest, storage_options)
            if isinstance(record, View):
                self.view, record = record, record.manifest
            self.manifest = record
        #: how a manifest with sidecar columns or a join (or one read with fields=) is read
        self.layout = None
        if fields is not None or (self.manifest is not None and _has_layout(self.manifest)):
            # (a view's rows then select the layout's logical rows: every part read at them)
            self.layout = _layout(self.manifest, fields, storage_options)
            self.manifest, urls = self.layout.manifest, None
        if urls is None and self.manifest is not None:
            self.urls = self.manifest.shard_urls()
        else:
            self.urls = expand_urls(urls, storage_options=storage_options, split=split)
        if not self.urls:
            raise ValueError(f"the shard spec {urls!r} names no shards")
        if safety.verify and self.manifest is None:
            raise ValueError(
                "verify=True checks shards against a manifest: pass manifest=M "
                "(or the manifest as the URL spec)"
            )
        self.spec = (
            urls if urls is not None else (getattr(self.manifest, "url", None) or "<manifest>")
        )
        self.resampled = resampled
        self.shardshuffle = bool(shuffle) if shardshuffle is None else bool(shardshuffle)
        if read.prefetch is None:
            read = dataclasses.replace(
                read, prefetch=2 if any(_is_remote(u) for u in self.urls) else 0
            )
        #: how shards are opened and parsed; which shards each reader reads; what is trusted
        #: and checked (frozen values; the flat attributes below read and replace their fields)
        self.read_options: ReadOptions = read
        self.plan_options: PlanOptions = plan
        self.safety_options: SafetyOptions = safety
        self._opener = None
        self._cache = None
        if read.cache_dir is not None:
            from ..storage import ShardCache

            cache = ShardCache(
                read.cache_dir,
                max_bytes=read.cache_size,
                storage_options=storage_options,
                retries=read.retries,
                allow_pipe=read.allow_pipe,
                manifest=self.manifest,
            )
            self._opener = cache.open
            self._cache = cache
        # the seed notebook's constructor: shuffle, decode, tuple, per-element transforms
        if shuffle:
            self._append(_stages.shuffle, shuffle)
        if decoder is _AUTO:
            decoder = "rgb" if extensions is not None else None
        if decoder is not None:
            modes = decoder if isinstance(decoder, (list, tuple)) else [decoder]
            kw = {"allow_unsafe": safety.allow_unsafe}
            if decode_size is not None:
                kw["size"] = decode_size
            self._append(_stages.decode, *modes, **kw)
        if extensions is not None:
            fields = extensions.split() if isinstance(extensions, str) else list(extensions)
            self._append(_stages.to_tuple, *fields)
            if transforms is not None:
                if callable(transforms):
                    self._append(_stages.map, transforms)
                else:
                    self._append(_stages.map_tuple, *transforms)
        elif transforms is not None:
            raise ValueError(
                "transforms= applies to the elements of extensions=; with dict "
                "samples use .map() or .map_dict()"
            )

    # the flat attributes of before: fields of the option values (setting one replaces the value)
    storage_options = _field("read_options", "storage_options")
    allow_pipe = _field("read_options", "allow_pipe")
    retries = _field("read_options", "retries")
    last_dot = _field("read_options", "last_dot")
    prefetch = _field("read_options", "prefetch")
    prefetch_bytes = _field("read_options", "prefetch_bytes")
    copy = _field("read_options", "copy")
    rank = _field("plan_options", "rank")
    world_size = _field("plan_options", "world_size")
    nodesplitter = _field("plan_options", "nodesplitter")
    workersplitter = _field("plan_options", "workersplitter")
    verify = _field("safety_options", "verify")
    empty_check = _field("safety_options", "empty_check")

    def worker_info(self) -> WorkerInfo:
        return explicit_rank(super().worker_info(), self.rank, self.world_size)

    # ---- the epoch plan (readers=) ------------------------------------------------------------
    @property
    def table(self):
        """The shards' sample counts and offsets (scanned once, when first needed)."""
        if self._table is None:
            self._check_shards_exist()
            if self.layout is not None:  # the logical rows (sidecar columns, a join)
                self._table = self.layout.table(self.view)
            elif self.view is not None:
                self._table = ShardTable.from_view(self.view, self.urls)
            elif self.manifest is not None:
                self._table = ShardTable.from_manifest(self.manifest, self.urls)
            else:
                self._table = scan_shards(self.urls, opener=self.open_shard, last_dot=self.last_dot)
        return self._table

    def set_table(self, table) -> None:
        """Use known per-shard counts/offsets (a :class:`tarshards.plan.cursor.ShardTable`)."""
        if list(table.urls) != list(self.urls):
            raise ValueError("the table describes other shards than this dataset's")
        self._table = table

    def open_shard(self, url, stats=None):
        """Open a shard; ``stats``: a loader's counters (retries, cache hits; its watchdog's
        time is the read timeout)."""
        if self._opener is not None:
            if stats is not None and self._opener == getattr(self._cache, "open", None):
                return self._opener(url, stats=stats)
            return self._opener(url)
        return open_url(url, options=self.read_options, **_watched(stats))

    def _open_range(self, url, offset: int, length: int | None, stats=None):
        """A stream of ``length`` bytes (``None``: to the end) from byte ``offset`` of a shard."""
        return open_url(
            url, offset=offset, length=length, options=self.read_options, **_watched(stats)
        )

    def range_opener(self):
        """``_open_range``, or ``None`` with a user's opener (it cannot be asked for a range)."""
        return self._open_range if self._opener is None else None

    def plan_parts(self):
        """(PlanConfig, stages before the batch, the batch stage, stages after it)."""
        stages = self._stages
        bufsize, initial, first = 0, None, 0
        if stages and stages[0].fn is _stages.shuffle:
            args = bound_args(stages[0])
            if args.get("rng") is not None or args.get("seed") is not None:
                raise ValueError(
                    "in a planned pipeline the shuffle is seeded from the plan; "
                    "leave out rng=/seed= (set WebDataset(seed=))"
                )
            bufsize, initial, first = int(args["bufsize"]), args["initial"], 1
        if any(st.fn is _stages.shuffle for st in stages[first:]):
            raise ValueError(
                "a planned pipeline (readers=) shuffles samples first: put "
                ".shuffle(n) before every other stage"
            )
        batch_at = [i for i, st in enumerate(stages) if st.fn is _stages.batched]
        if not batch_at:
            raise ValueError(
                "a planned pipeline (readers=) batches inside the dataset: add "
                ".batched(B) (and give the loader batch_size=None)"
            )
        bi = batch_at[0]
        bargs = bound_args(stages[bi])
        if self._nsamples is not None:
            raise ValueError(
                "with_epoch() does not apply to a planned pipeline: the plan "
                "fixes the epoch (len(loader) is exact)"
            )
        plan = self._plan_config
        if plan is None:
            raise TypeError(f"{type(self).__name__} has no epoch plan (WebDataset(readers=V) has)")
        cfg = PlanConfig(
            seed=self.seed,
            readers=plan["readers"],
            batch_size=int(bargs["batchsize"]),
            remainder=plan["remainder"],
            shardshuffle=self.shardshuffle,
            bufsize=bufsize,
            initial=None if initial is None else int(initial),
        )
        return cfg, stages[first:bi], stages[bi], stages[bi + 1 :]

    def plan_identity(self) -> dict:
        if _packing.unit_stage(self._stages) is not None:  # .pack() / .bucket(): units
            return _packing.plan_identity(self)
        return self.plan_parts()[0].identity(self.table.fingerprint)

    def fingerprint_aliases(self) -> dict:
        return dict(self.table.aliases)

    def epoch_program(self, epoch: int) -> "PlannedProgram":
        if _packing.unit_stage(self._stages) is not None:  # .pack() / .bucket(): units
            return _packing.UnitProgram(self, epoch)
        return SingleProgram(self, epoch)

    def dropped_samples(self, epoch: int | None = None) -> int:
        """The samples a planned pipeline (``readers=V``) leaves out of ``epoch`` (default: the
        next): those that do not fill ``V x B`` under ``remainder="drop"``; 0 otherwise."""
        if self._plan_config is None:
            return 0
        if _packing.unit_stage(self._stages) is not None:  # .pack() / .bucket(): units
            prog = _packing.UnitProgram(self, self.next_epoch() if epoch is None else int(epoch))
            return prog.dropped
        cfg = self.plan_parts()[0]
        if cfg.remainder != "drop":
            return 0
        plan = plan_for(self.table, cfg, self.next_epoch() if epoch is None else int(epoch))
        return plan.length - plan.num_batches * cfg.batch_size

    def warn_dropped(self, epoch: int) -> None:
        """Warn (once per epoch and process) that the default ``remainder="drop"`` leaves
        samples out of ``epoch``, with their count and the options that keep them."""
        plan = self._plan_config
        if plan is not None and _packing.unit_stage(self._stages) is not None:
            _packing.warn_dropped(self, epoch)  # .pack() / .bucket(): units, their own words
            return
        if plan is None or plan.get("chosen"):
            return
        warned = self.__dict__.setdefault("_dropped_warned", set())
        if epoch in warned:
            return
        warned.add(epoch)
        dropped = self.dropped_samples(epoch)
        if not dropped:
            return
        import warnings

        from ..errors import TarshardsWarning

        cfg = self.plan_parts()[0]
        total = self.table.num_samples
        V, B = cfg.readers, cfg.batch_size
        warnings.warn(
            f"epoch {epoch} drops {dropped} of {total} samples: readers={V} x .batched({B}) "
            f"plans {V} x {(total - dropped) // (V * B)} batches of {B} ({total - dropped} "
            f"samples) and remainder='drop' is the default. remainder='carry' keeps them (they "
            "open the next epoch; batches stay exact and equal), remainder='pad' pads the last "
            "batches with repeated samples flagged __pad__; pass remainder='drop' to drop them "
            "without this warning",
            TarshardsWarning,
            stacklevel=4,
        )

    def _warn_unequal(self, context: EpochContext) -> None:
        """Say (once, from rank 0's first worker) that the plain shard split may give the ranks
        different numbers of samples, which stalls a synchronous (DDP) step at the epoch's end:
        with a manifest, only when it does, with the counts."""
        import warnings

        from ..errors import TarshardsWarning

        world, nworkers = context.worker.world_size, context.worker.num_workers
        if self.manifest is not None:
            if self.nodesplitter or self.workersplitter:  # their split is not ours to count
                return
            counts = self._counts()
            order = shard_order(
                self.urls, seed=context.seed, epoch=context.epoch, shuffle=self.shardshuffle
            )
            per_rank = [
                sum(
                    counts.get(u, 0)
                    for w in range(nworkers)
                    for u in split_shards(
                        order,
                        rank=r,
                        world_size=world,
                        worker=w,
                        num_workers=nworkers,
                        warn=False,
                    )
                )
                for r in range(world)
            ]
            if len(set(per_rank)) == 1:
                return
            what = f"read {min(per_rank)} to {max(per_rank)} samples an epoch"
        else:
            what = "may read different numbers of samples (the shards' counts are unknown)"
        warnings.warn(
            f"{world} ranks {what}: a synchronous (DDP) step waits forever on a rank that ran "
            "dry. Pass readers=V (a multiple of the world size) for equal batches on every "
            "rank, with exact and elastic resume; or end the epoch with .with_epoch(n); "
            "equal=False silences this",
            TarshardsWarning,
            stacklevel=3,
        )

    def shard_list(self, ctx: EpochContext | Mapping[str, Any]) -> Iterable[str]:
        """The shards this reader reads in the epoch described by ``ctx``: an
        :class:`~tarshards.types.EpochContext` (or the pipeline's context dict: ``seed``,
        ``epoch``, ``rank``, ``world_size``, ``worker``, ``num_workers``).

        A ``nodesplitter``/``workersplitter`` that takes parameters named ``rank``,
        ``world_size``, ``worker``, ``num_workers`` or ``worker_info`` (as :func:`split_by_node`
        and :func:`split_by_worker` do) is given this reader's values.
        """
        context = _epoch_context(ctx)
        place = context.worker
        if self.resampled:
            return resampled_shards(
                self.urls, seed=context.seed, epoch=context.epoch, rank=place.reader, worker=0
            )
        urls = shard_order(
            self.urls, seed=context.seed, epoch=context.epoch, shuffle=self.shardshuffle
        )
        if self.nodesplitter is not None:
            urls = _as_urls(_call_splitter(self.nodesplitter, urls, place))
        if self.workersplitter is not None:
            urls = _as_urls(_call_splitter(self.workersplitter, urls, place))
        if self.nodesplitter is None or self.workersplitter is None:
            rank, world = (
                (0, 1) if self.nodesplitter is not None else (place.rank, place.world_size)
            )
            worker, nworkers = (
                (0, 1) if self.workersplitter is not None else (place.worker, place.num_workers)
            )
            urls = split_shards(
                urls, rank=rank, world_size=world, worker=worker, num_workers=nworkers
            )
        return urls

    def _check_shards_exist(self) -> None:
        """Under ``on_error="raise"``: every local shard exists (one ``stat`` each, once), or
        an error lists those that do not, before the first sample is read."""
        if self.__dict__.get("_shards_exist") or self.on_error.mode != "raise":
            return
        check_local_shards(self.urls, self.spec)
        self._shards_exist = True

    def read_samples(self, ctx: dict) -> Iterator[dict]:
        """The samples of the epoch and place ``ctx`` names, before any stage: the pipeline's
        source (its shards split or planned, read and grouped into samples)."""
        self._check_shards_exist()
        context = _epoch_context(ctx)
        shards: Any = self.shard_list(context)
        if not self.resampled:
            shards = list(shards)
            place = context.worker
            if (
                place.world_size > 1
                and place.rank == 0
                and place.worker == 0
                and self.plan_options.equal is None
                and self._nsamples is None
            ):
                self._warn_unequal(context)
        if self.view is not None and self.layout is None:  # (resampled: endless shards)
            yield from self._view_samples(shards, ctx.get("stats"))
            return
        read = self.read_options
        options: dict[str, Any] = {
            "storage_options": read.storage_options,
            "allow_pipe": read.allow_pipe,
            "last_dot": read.last_dot,
            "retries": read.retries,
            "prefetch": read.prefetch,
            "prefetch_bytes": read.prefetch_bytes,
        }
        if not read.copy:
            options["copy"] = False
        stats = ctx.get("stats")
        if stats is not None:  # a loader's counters (stats=True, watchdog=)
            options["stats"] = stats
        if self._opener is not None:
            options["opener"] = self._opener
            if stats is not None and self._opener == getattr(self._cache, "open", None):
                options["opener"] = functools.partial(self._opener, stats=stats)
        if (
            self.safety_options.verify and self.manifest is not None
        ):  # verify= needs a manifest (__init__)
            options["expect"] = self.manifest.records_by_url()
        if self.manifest is not None and self.on_error.mode != "raise":
            options["index_of"] = _IndexOf(self.manifest)  # to name the samples a skip loses
        if self.layout is not None:  # sidecar columns, a join, fields=: parts merged per row
            yield from self.layout.iter_samples(
                shards,
                on_error=self.on_error,
                verify=self.safety_options.verify,
                rows=None if self.view is None else self.view.rows,
                **{
                    k: options[k]
                    for k in ("storage_options", "last_dot", "retries", "opener")
                    if k in options
                },
            )
            return
        if not self.safety_options.empty_check or self.resampled:
            yield from iter_samples(shards, on_error=self.on_error, **options)
            return
        skipped: list = []  # errors the policy let pass, to name the real cause below
        samples = iter_samples(shards, on_error=self.on_error.observed(skipped.append), **options)
        first = next(samples, _DEFAULT)  # peek: no per-sample cost for the check
        if first is _DEFAULT:
            if shards and skipped:
                raise ValueError(
                    f"no samples found in {len(shards)} shard(s) ({shards[0]}...): the handler "
                    f"skipped {len(skipped)} shard error(s), the first: {skipped[0]}"
                ) from skipped[0]
            if shards:
                raise ValueError(
                    f"no samples found in {len(shards)} shard(s) ({shards[0]}...): are the "
                    "member names KEY.EXT? (pass empty_check=False to allow empty shards)"
                )
            return
        del skipped[:]
        yield first
        yield from samples

    def _view_samples(self, shards: list, stats=None) -> Iterator[dict]:
        """The samples a view keeps of ``shards`` (in their order; only their bytes read).
        ``verify=True``: each sample's members against the member checksums of its shard's
        index (the bytes of the rows the view leaves out are not read, so not checked)."""
        from ..errors import TarshardsError
        from ..plan.cursor import read_rows

        table = self.table
        base = table.manifest  # the view's base (its shards in the table's order)
        row = {u: i for i, u in enumerate(table.urls)}
        ranged = self.range_opener()
        verify = self.safety_options.verify
        if verify:
            from ..read.sidecar import check_members
        for url in shards:
            i = row[url]
            if not table.counts[i]:
                continue
            seen = 0
            try:
                for got in read_rows(
                    table,
                    i,
                    range(table.counts[i]),
                    opener=self.open_shard
                    if stats is None
                    else functools.partial(self.open_shard, stats=stats),
                    range_opener=ranged,
                    last_dot=self.last_dot,
                    stats=stats,
                ):
                    if verify:  # each sample's members against its index's checksums
                        rows = table.selected_rows(i)
                        for sample in got:
                            j = seen if rows is None else int(rows[seen])
                            check_members(sample, base.load_index(i), j, url)
                            seen += 1
                    yield from got
            except TarshardsError as exn:
                if not self.on_error(exn):
                    return

    # ---- exact lengths from the manifest --------------------------------------------------------
    def num_samples(
        self,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        worker: int = 0,
        num_workers: int = 1,
        epoch: int | None = None,
    ) -> int:
        """The exact number of samples one reader gets in an epoch (from the manifest).

        Left out, ``rank``/``world_size`` are this process's; ``worker``/``num_workers`` default
        to the whole rank (all its DataLoader workers together). With shard shuffling the
        shards a rank gets, and so its count, can change with the epoch (default: the next).
        """
        if self.manifest is None:
            raise TypeError(
                "this WebDataset has no manifest, so its length is unknown: pass "
                "manifest=M (make one with: tarshards index SPEC -o M), or set a "
                "length with .with_length(n)"
            )
        if self.resampled:
            raise TypeError("a resampled WebDataset is endless; bound it with .with_epoch(n)")
        info = self.worker_info()
        if epoch is None:
            epoch = self.current_epoch()
        context = EpochContext(
            seed=self.seed,
            epoch=self._auto_epoch if epoch is None else epoch,
            worker=WorkerInfo(
                info.rank if rank is None else rank,
                info.world_size if world_size is None else world_size,
                worker,
                num_workers,
            ),
        )
        counts = self._counts()
        total = 0
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            shards = list(self.shard_list(context))
        for url in shards:
            n = counts.get(url)
            if n is None:
                raise TypeError(f"shard {url} is not in the manifest; its length is unknown")
            total += n
        return total

    def _counts(self) -> dict:
        """Shard URL -> the samples read of it (a view's: the rows it keeps)."""
        if self.view is None:
            return {} if self.manifest is None else self.manifest.counts()
        if self.layout is None:
            return self.view.counts()
        return dict(zip(self.layout.urls, self.view.selected_counts))

    def __len__(self):
        """``with_length(n)`` when set; else, with a manifest, the exact sample count of this
        rank (the whole set on one process); see :meth:`num_samples`."""
        if self._length is not None:
            return self._length
        if self._plan_config is not None:  # planned: the batches this rank yields
            return self.steps_per_epoch()
        if self.manifest is None:
            raise TypeError(
                f"{type(self).__name__} is a stream and has no length without a "
                "manifest: pass manifest=M (make one with: tarshards index SPEC -o "
                "M) for its exact length, or set one with .with_length(n)"
            )
        return self.num_samples()

    def _source_repr(self) -> str:
        spec = repr(self.spec) if isinstance(self.spec, str) else f"[{self.urls[0]!r}, ...]"
        return f"{type(self).__name__}({spec}, {len(self.urls)} shards)"


# inspect.signature(WebDataset) shows __init__'s parameters (__new__ only routes a spec file)
WebDataset.__new__.__signature__ = inspect.signature(WebDataset.__init__)  # type: ignore[attr-defined]


def _has_layout(manifest) -> bool:
    return bool(manifest.columns or manifest.join)


def _layout(manifest, fields, storage_options):
    """The :class:`~tarshards.read.sidecar.Layout` a manifest is read through (``fields=``: only the
    parts holding those fields)."""
    if manifest is None:
        raise ValueError(
            "fields= reads the column groups of a manifest: pass the manifest (or its path) "
            "as the data set"
        )
    from ..read.sidecar import layout_for

    layout = layout_for(manifest, fields, storage_options=storage_options)
    if layout is None:  # (not asked of a plain manifest read whole)
        raise ValueError("this manifest has no column groups or join to read")
    return layout


class _IndexOf:
    """``url -> ShardIndex | None``: a manifest's index of a shard, where it has one."""

    def __init__(self, manifest):
        self.manifest = manifest

    def __call__(self, url: str):
        urls = self.manifest.shard_urls()
        if url not in urls:
            return None
        i = urls.index(url)
        return self.manifest.load_index(i) if self.manifest.shards[i].index else None


def _watched(stats) -> dict:
    """``open_url``'s options for a loader's counters: told of retries; with a watchdog, a read
    silent that long is abandoned and resumed."""
    if stats is None:
        return {}
    if stats.watchdog is None:
        return {"stats": stats}
    return {"stats": stats, "timeout": stats.watchdog}


def _is_remote(url: str) -> bool:
    """A shard read over a network (prefetching pays off), not a file, stdin or a pipe."""
    return not (is_local(url) or url == "-" or url.startswith("pipe:"))


def explicit_rank(info: WorkerInfo, rank: int | None, world_size: int | None) -> WorkerInfo:
    """``info`` with the rank and world size given to the dataset, where given."""
    if rank is None and world_size is None:
        return info
    return info.replace(
        rank=info.rank if rank is None else rank,
        world_size=info.world_size if world_size is None else world_size,
    )


def _epoch_context(ctx: EpochContext | Mapping[str, Any]) -> EpochContext:
    """``ctx`` as an :class:`EpochContext`: the pipeline's context dict (or one made by hand:
    ``seed``, ``epoch``, ``rank``, ``world_size``, ``worker``, ``num_workers``) converted."""
    if isinstance(ctx, EpochContext):
        return ctx
    info = ctx.get("worker_info")
    if info is None:
        info = WorkerInfo(ctx["rank"], ctx["world_size"], ctx["worker"], ctx["num_workers"])
    return EpochContext(seed=ctx["seed"], epoch=ctx["epoch"], worker=info)


def _call_splitter(fn: Callable, urls: list[str], place: WorkerInfo):
    values = {
        "rank": place.rank,
        "world_size": place.world_size,
        "worker": place.worker,
        "num_workers": place.num_workers,
        "worker_info": place,
    }
    return fn(urls, **{name: values[name] for name in _wanted(fn, _PLACE)})


def _as_urls(items) -> list[str]:
    out = []
    for x in items:
        out.append(x["url"] if isinstance(x, dict) else x)
    return out


def bound_args(stage: _Stage) -> dict:
    """A stage's arguments by name, defaults filled in."""
    bound = inspect.signature(stage.fn).bind(None, *stage.args, **stage.kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)
