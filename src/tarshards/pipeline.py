"""Composing a source of samples with stages, and the fluent ``WebDataset`` API.

``WebDataset`` keeps a list of ``(stage function, args, kwargs)``; its fluent methods are generated
from the stage functions in :mod:`tarshards.stages`, so there is one implementation of each stage.
At iteration time the pipeline asks :meth:`DataPipeline.worker_info` where it runs (a
:class:`~tarshards.types.WorkerInfo`: rank and DataLoader worker), picks the epoch's shards, and
runs the stages, passing each stage that takes them a seeded ``rng``, the dataset's error policy
(``on_error``) and its place (``rank``, ``world_size``, ``worker``, ``num_workers``,
``worker_info``). This module discovers nothing: the core runs as rank 0 of 1, worker 0 of 1
unless told otherwise, and the torch adapter (:mod:`tarshards.torch`) overrides ``worker_info``
with what it discovered at the top.
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
import os
from typing import Any, BinaryIO, Callable, Iterable, Iterator, cast

from . import stages as _stages
from .errors import IntegrityError, ResumeError, StorageError, TarshardsError
from .format import group_samples
from .storage.prefetch import ShardPrefetcher, given_stream
from .shards import make_rng, resampled_shards, shard_order, split_shards
from .on_error import OnError, error_policy
from .source import (
    STATE_FORMAT,
    PlanConfig,
    ReaderStream,
    Schedule,
    ShardTable,
    check_state,
    plan_for,
    scan_shards,
)
from .tario import iter_tar_batches, tar_byte_source
from .types import WorkerInfo
from .specs import expand_urls
from .specs import is_manifest_spec as _is_manifest_spec
from .storage import is_local, open_url

__all__ = ["DataPipeline", "WebDataset", "iter_samples", "shard_samples"]

_DEFAULT: Any = object()
# what a stage or a splitter may ask for by naming a parameter so: the reader's place
_PLACE = ("rank", "world_size", "worker", "num_workers", "worker_info")


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
) -> Iterator[dict]:
    """The samples of one shard (any URL :func:`tarshards.storage.open_url` opens).

    ``retries``: reconnections after a dropped connection, resuming at the byte offset reached.
    ``expect``: the shard's manifest record (``samples``, ``nbytes``, ``hash``): the shard is
    hashed as it streams, and after its last sample an :class:`IntegrityError` naming it is
    raised when its size, hash or sample count differ.

    Errors are :class:`~tarshards.errors.TarshardsError` subclasses naming the shard, the member
    and the offset; OS errors while reading become :class:`StorageError`.
    """
    url = os.fspath(url)
    if opener is None:
        opener = functools.partial(
            open_url, storage_options=storage_options, allow_pipe=allow_pipe, retries=retries
        )
    try:
        with opener(url) as stream:
            if expect is not None:
                yield from _verified_samples(stream, url, expect, chunk_size, last_dot)
                return
            batches = iter_tar_batches(tar_byte_source(stream, url, chunk_size), url)
            yield from group_samples(batches, url, last_dot=last_dot, batched=True)
    except TarshardsError as exn:
        raise exn.with_context(url=url) from None
    except OSError as exn:
        raise StorageError(f"read failed: {exn}", url=url) from exn


def _verified_samples(stream, url: str, expect, chunk_size: int, last_dot: bool):
    from .hashing import HashingReader, check_shard, split_hash

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


def iter_samples(
    urls: Iterable[str],
    *,
    on_error: OnError = "raise",
    handler: Callable | None = None,
    prefetch: int = 0,
    prefetch_bytes: int = 256 << 20,
    expect: dict | None = None,
    **options,
) -> Iterator[dict]:
    """The samples of several shards in turn; shard errors go to ``on_error``.

    With ``on_error="warn"`` (or ``handler=warn_and_continue``) a bad shard yields the samples
    before the error, one warning naming shard and offset, and the stream goes on with the next
    shard. Only tarshards errors reach the policy here (errors of the shard, not of user code).

    ``prefetch=k`` opens the next ``k`` shards while the current one is read, each filled from a
    thread into a buffer (``prefetch_bytes`` over all of them; at most ``k + 1`` connections):
    see :mod:`tarshards.storage.prefetch`. Order, samples and errors are the same as without it.
    """
    policy = error_policy(on_error, handler)

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
                if policy(exn):
                    continue
                return
        return
    opener = options.pop("opener", None)
    if opener is None:
        opener = functools.partial(
            open_url,
            storage_options=options.get("storage_options"),
            allow_pipe=options.get("allow_pipe", False),
            retries=options.get("retries", 5),
        )
    with ShardPrefetcher(opener, ahead=prefetch, max_bytes=prefetch_bytes) as prefetcher:
        for url, stream in prefetcher.streams(urls):
            try:
                yield from one(url, opener=lambda _url, s=stream: given_stream(s))
            except TarshardsError as exn:
                if policy(exn):
                    continue
                return


class _Stage:
    __slots__ = (
        "fn",
        "args",
        "kwargs",
        "wants_rng",
        "wants_policy",
        "wants_handler",
        "wants_place",
        "label",
    )

    def __init__(self, fn, args, kwargs, label=None):
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        params = _params(fn)
        self.wants_rng = "rng" in params and "rng" not in kwargs and "seed" not in kwargs
        given = "on_error" in kwargs or "handler" in kwargs
        # the pipeline's error policy: as on_error= to stages that take it, as handler= to those
        # that take only webdataset's handler= (tarshards.compat's filters, user stages)
        self.wants_policy = "on_error" in params and not given
        self.wants_handler = "handler" in params and "on_error" not in params and not given
        self.wants_place = _wanted(fn, _PLACE, kwargs)
        self.label = label or getattr(fn, "__name__", repr(fn))

    def __repr__(self):
        parts = [_short(a) for a in self.args]
        parts += [f"{k}={_short(v)}" for k, v in self.kwargs.items()]
        return f"{self.label}({', '.join(parts)})"


@functools.cache
def _params(fn) -> frozenset:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


def _wanted(fn, names, given=()) -> tuple:
    """Those of ``names`` that ``fn`` takes as parameters and that are not given already (as
    keywords, or bound by a ``functools.partial``)."""
    try:
        params = _params(fn)
    except TypeError:  # an unhashable callable: not cached
        params = _params.__wrapped__(fn)
    bound = fn.keywords if isinstance(fn, functools.partial) else {}
    return tuple(n for n in names if n in params and n not in given and n not in bound)


def _place(info: WorkerInfo) -> dict:
    return {
        "rank": info.rank,
        "world_size": info.world_size,
        "worker": info.worker,
        "num_workers": info.num_workers,
        "worker_info": info,
    }


def _short(v) -> str:
    if callable(v) and hasattr(v, "__name__"):
        return v.__name__
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


class DataPipeline:
    """A source of samples followed by stages (plain iterable, no torch needed).

    ``source`` is a function ``(context) -> iterator`` where ``context`` holds ``epoch``,
    ``rank``, ``world_size``, ``worker``, ``num_workers``, ``seed`` and ``worker_info`` (the same
    place as a :class:`~tarshards.types.WorkerInfo`).
    """

    # set by planned pipelines (WebDataset(readers=), MixedDataset): the plan's parameters, a
    # state to resume from at the next iter(), the iteration in progress
    _plan_config: dict[str, Any] | None = None
    _pending_state: dict | None = None
    _live: Any = None

    def __init__(
        self,
        source: Callable[[dict], Iterator] | Iterable,
        *,
        seed: int = 0,
        on_error: OnError = "raise",
        handler: Callable | None = None,
    ):
        self._source = source
        self._stages: list[_Stage] = []
        self.seed = seed
        self.on_error = error_policy(on_error, handler)
        self.epoch: int | None = None  # None: counted automatically
        self._auto_epoch = 0
        self._nsamples: int | None = None  # with_epoch
        self._length: int | None = None  # with_length

    @property
    def handler(self):
        """The error policy (older name of :attr:`on_error`)."""
        return self.on_error

    # ---- composition -------------------------------------------------------------------------
    def compose(self, stage: Callable, *args, **kwargs) -> "DataPipeline":
        """A copy of this pipeline with the stage ``stage(samples, *args, **kwargs)`` appended.

        Like webdataset, fluent methods return a new pipeline and leave this one as it was
        (``with_epoch``/``with_length``/``set_epoch`` change the pipeline itself).
        """
        new = copy.copy(self)
        new._stages = list(self._stages)
        new._append(stage, *args, **kwargs)
        return new

    def _append(self, stage: Callable, *args, **kwargs) -> None:
        if not callable(stage):
            raise TypeError(f"a stage is a generator function, not {stage!r}")
        self._stages.append(_Stage(stage, args, kwargs))

    def with_epoch(
        self, nsamples: int | None = None, nbatches: int | None = None
    ) -> "DataPipeline":
        """Make each iteration yield exactly ``nsamples`` items per reader (rank x worker).

        webdataset's meaning: a reader whose data is shorter goes through it again (with fresh
        shuffles) until it has yielded ``nsamples`` items; a reader with no data at all yields
        nothing. ``nbatches`` is another name for the same count (items after ``.batched()``).
        """
        counts = [n for n in (nsamples, nbatches) if n is not None]
        if len(counts) != 1 or int(counts[0]) < 0:
            raise ValueError("with_epoch needs one non-negative count (nsamples or nbatches)")
        self._nsamples = int(counts[0])
        return self

    def with_length(self, n: int) -> "DataPipeline":
        """Give the dataset a ``len()`` (for code that asks; iteration is not affected)."""
        self._length = int(n)
        return self

    def __len__(self):
        if self._length is None:
            raise TypeError(
                f"{type(self).__name__} is a stream and has no length; set one with .with_length(n)"
            )
        return self._length

    def __getitem__(self, index):
        raise TypeError(
            f"{type(self).__name__} is a streaming dataset: it can be iterated "
            "over (for sample in ds, or DataLoader(ds)), not indexed"
        )

    def set_epoch(self, epoch: int) -> None:
        """Fix the epoch used to seed shard and sample shuffling (instead of counting)."""
        self.epoch = int(epoch)

    # ---- environment -------------------------------------------------------------------------
    def worker_info(self) -> WorkerInfo:
        """Where the reader running this iteration is: rank 0 of 1, worker 0 of 1 here; the torch
        adapter overrides it with the rank it discovered in the main process and the worker."""
        return WorkerInfo()

    def environment(self) -> dict:
        """:meth:`worker_info` as a dict: ``rank``, ``world_size``, ``worker``, ``num_workers``."""
        info = self.worker_info()
        return {
            "rank": info.rank,
            "world_size": info.world_size,
            "worker": info.worker,
            "num_workers": info.num_workers,
        }

    def _current_epoch(self) -> int | None:
        """The epoch set by :meth:`set_epoch` (``None``: count); the torch adapter reads it from
        memory shared with the main process inside DataLoader workers."""
        return self.epoch

    def _context(self) -> dict:
        ctx = _place(self.worker_info())
        epoch = self._current_epoch()
        if epoch is None:
            epoch = self._auto_epoch
            self._auto_epoch += 1
        ctx["epoch"] = epoch
        ctx["seed"] = self.seed
        return ctx

    # ---- iteration ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator:
        pending, self._pending_state = getattr(self, "_pending_state", None), None
        if getattr(self, "_plan_config", None) is not None:
            it = _PlannedIterator(self, pending)
            self._live = it
            return it
        if pending is not None:  # a stream state: it only names the epoch to run
            self._auto_epoch = pending["epoch"]
            if self.epoch is not None:
                self.epoch = pending["epoch"]
        ctx = self._context()
        if self._nsamples is None:
            return self._run(ctx)
        return itertools.islice(self._repeated(ctx), self._nsamples)

    def _repeated(self, ctx: dict) -> Iterator:
        """The epoch's data, run again (pass 1, 2... with their own shuffles) while it lasts."""
        for again in itertools.count():
            if again:
                ctx = dict(ctx, again=again)
            empty = True
            for item in self._run(ctx):
                empty = False
                yield item
            if empty:
                return

    def _run(self, ctx: dict) -> Iterator:
        src = self._source
        data = src(ctx) if callable(src) else iter(src)
        data = self._run_stages(data, self._stages, ctx, ("stage",))
        return iter(data)

    def _run_stages(self, data, stages, ctx: dict, rng_tag: tuple, first: int = 0):
        """Apply ``stages`` (numbered from ``first``) to ``data``; stages that take an ``rng``
        get one seeded from ``rng_tag``, the stage's number, seed, epoch, rank and worker."""
        for n, st in enumerate(stages):
            i = first + n
            kwargs = st.kwargs
            if (
                st.fn is _stages.decode
                and "only" not in kwargs
                and n + 1 < len(stages)
                and stages[n + 1].fn is _stages.to_tuple
            ):
                # to_tuple keeps only the fields it names: decoding the others is wasted work
                kwargs = dict(kwargs, only=_tuple_fields(stages[n + 1].args))
            if st.wants_rng or st.wants_policy or st.wants_handler or st.wants_place:
                kwargs = dict(kwargs)
                for name in st.wants_place:
                    kwargs[name] = ctx[name]
                if st.wants_rng:
                    again = (ctx["again"],) if ctx.get("again") else ()
                    kwargs["rng"] = make_rng(
                        *rng_tag, i, ctx["seed"], ctx["epoch"], ctx["rank"], ctx["worker"], *again
                    )
                if st.wants_policy:
                    kwargs["on_error"] = self.on_error
                if st.wants_handler:
                    kwargs["handler"] = self.on_error
            data = st.fn(data, *st.args, **kwargs)
        return data

    # ---- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where this pipeline is: a small dict to save with a checkpoint.

        In a planned pipeline (``WebDataset(..., readers=V)``) it names the epoch and the global
        batch position reached by the iteration in progress (or, in a DataLoader worker, this
        worker's next step), plus what the plan depends on, so that :meth:`load_state_dict`
        can check it. Otherwise it names the epoch the next iteration runs.
        """
        if getattr(self, "_plan_config", None) is not None:
            live = getattr(self, "_live", None)
            if live is not None:
                return live.state_dict()
            if self._pending_state is not None:
                return dict(self._pending_state)
            return self.plan_state(self._next_epoch(), 0)
        return {
            "format": STATE_FORMAT,
            "kind": "stream",
            "seed": self.seed,
            "epoch": self._next_epoch(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from a :meth:`state_dict` (or a loader's) at the next ``iter()``.

        A state that does not fit (other data, seed or plan) raises
        :class:`~tarshards.errors.ResumeError` here, at once.
        """
        if isinstance(state, dict) and state.get("kind") == "loader":
            state = state["dataset"]
        if getattr(self, "_plan_config", None) is not None:
            check_state(state, dict(self._plan_identity(), kind="plan"))
        else:
            check_state(state, {"kind": "stream", "seed": self.seed})
        self._live = None
        self._pending_state = dict(state)
        self._auto_epoch = int(state["epoch"])
        if self.epoch is not None:
            self.epoch = int(state["epoch"])

    def plan_state(
        self,
        epoch: int,
        position: int,
        *,
        origin: int = 0,
        world_size: int | None = None,
        finished: bool = False,
    ) -> dict:
        """The state at global batch ``position`` of ``epoch`` (see :mod:`tarshards.source`)."""
        if world_size is None:
            world_size = self.environment()["world_size"]
        state: dict[str, Any] = {"format": STATE_FORMAT, "kind": "plan"}
        state.update(self._plan_identity())
        state.update(
            {
                "epoch": int(epoch),
                "position": int(position),
                "origin": int(origin),
                "world_size": int(world_size),
                "finished": bool(finished),
            }
        )
        return state

    def steps_per_epoch(self, epoch: int | None = None, world_size: int | None = None) -> int:
        """Batches each rank yields in ``epoch`` (the same on every rank)."""
        if world_size is None:
            world_size = self.environment()["world_size"]
        epoch = self._next_epoch() if epoch is None else epoch
        prog = self._epoch_program(epoch)
        Schedule(prog.num_batches, prog.readers, world_size, 0)  # checks world_size
        return prog.num_batches // world_size

    def state_from_step(
        self, step: int, world_size: int | None = None, start_epoch: int = 0
    ) -> dict:
        """The state after ``step`` global steps counted from the start of ``start_epoch``, for
        trainers that keep only a step count (every epoch run in full on ``world_size`` ranks)."""
        if world_size is None:
            world_size = self.environment()["world_size"]
        epoch, left = int(start_epoch), int(step)
        while True:
            n = self.steps_per_epoch(epoch, world_size)
            if left < n:
                return self.plan_state(epoch, left * world_size, world_size=world_size)
            left -= n
            epoch += 1

    def _plan_identity(self) -> dict:
        """What a planned pipeline's state depends on (its data, seed and plan)."""
        raise TypeError(f"{type(self).__name__} has no epoch plan (WebDataset(readers=V) has)")

    def _epoch_program(self, epoch: int) -> Any:
        """The epoch's program of batches (planned pipelines)."""
        raise TypeError(f"{type(self).__name__} has no epoch plan (WebDataset(readers=V) has)")

    def __getstate__(self):  # the live iteration stays in its process
        state = self.__dict__.copy()
        state["_live"] = None
        return state

    def _next_epoch(self) -> int:
        return self.epoch if self.epoch is not None else self._auto_epoch

    def __repr__(self):
        return " | ".join([self._source_repr()] + [repr(s) for s in self._stages])

    def _source_repr(self) -> str:
        return f"{type(self).__name__}({_short(self._source)})"


def _tuple_fields(args) -> list[str]:
    """Every field a ``to_tuple(*args)`` stage may pick (alternatives included)."""
    if len(args) == 1 and isinstance(args[0], str) and " " in args[0]:
        args = args[0].split()
    return [f for spec in args for f in spec.split(";")]


# parameters the pipeline fills in (a seeded rng; its error policy): not shown on fluent methods
_INJECTED = frozenset({"rng", "handler"})


def _fluent_signature(stage: Callable) -> inspect.Signature:
    """``stage``'s signature as a method: ``self`` instead of the samples, without the injected
    parameters (those after one become keyword-only, so positions stay true), and
    ``on_error=None`` meaning "the pipeline's policy"."""
    sig = inspect.signature(stage)
    shown = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    keyword_only = False
    for p in list(sig.parameters.values())[1:]:
        if p.name in _INJECTED:
            keyword_only = keyword_only or p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
            continue
        if keyword_only and p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            p = p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
        if p.name == "on_error":
            p = p.replace(default=None)
        shown.append(p)
    if keyword_only:  # keep the order Python requires: keyword-only ones after *args
        shown.sort(key=lambda p: p.kind)
    return sig.replace(parameters=shown, return_annotation="DataPipeline")


def _fluent(stage: Callable) -> Callable:
    """A fluent method that appends ``stage``: one implementation, with the stage's signature
    (less the samples and what the pipeline injects) and docstring. Arguments are checked
    against the signature when the method is called, not at iteration."""
    sig = _fluent_signature(stage)

    def method(self, *args, **kwargs):
        shown = {k: v for k, v in kwargs.items() if k not in _INJECTED}
        try:
            sig.bind(self, *args, **shown)
        except TypeError as exn:
            raise TypeError(f".{stage.__name__}(): {exn}") from None
        if "on_error" in kwargs and kwargs["on_error"] is None:
            del kwargs["on_error"]  # the pipeline's policy
        return self.compose(stage, *args, **kwargs)

    method.__name__ = stage.__name__
    method.__qualname__ = f"DataPipeline.{stage.__name__}"
    method.__doc__ = stage.__doc__
    method.__module__ = __name__
    method.__signature__ = sig  # type: ignore[attr-defined]
    return method


for _name in (
    "shuffle",
    "decode",
    "select",
    "map",
    "map_dict",
    "map_tuple",
    "to_tuple",
    "rename",
    "batched",
    "unbatched",
    "take",
    "slice",
):
    setattr(DataPipeline, _name, _fluent(getattr(_stages, _name)))


class WebDataset(DataPipeline):
    """A streaming dataset of samples from tar shards.

    Seed-notebook style: ``WebDataset(urls, extensions="jpg cls", decoder="pil",
    transforms=[augment, None], shuffle=100)`` yields tuples. Fluent style: ``WebDataset(urls,
    shardshuffle=True, seed=0).shuffle(1000).decode("pil").to_tuple("jpg", "cls").batched(64)``.

    ``urls``: a shard spec (braces, ``::``-joined specs, globs, lists, a URL list file).
    ``shardshuffle``: shuffle the shard order each epoch (default: on when ``shuffle`` > 0).
    ``resampled``: draw shards with replacement forever (bound it with ``.with_epoch(n)``).
    ``on_error``: what a data error does: ``"raise"``, ``"skip"``, ``"warn"``, or a function
    ``exn -> bool`` (see :mod:`tarshards.on_error`); ``handler=`` is its older name and takes
    webdataset's handler functions (``warn_and_continue``...).
    ``rank``/``world_size``: the node's place (default: from torch.distributed when initialized).
    ``nodesplitter``/``workersplitter``: functions ``urls -> urls`` replacing the default split.
    ``empty_check``: raise when this reader was given shards but found no sample in them.
    ``cache_dir``/``cache_size``: keep remote shards in a local cache (size like ``"20GB"``).
    ``retries``: reconnections per shard after a dropped connection (resumes at the offset).
    ``decode_size=(w, h)``: with ``decoder=``, decode images at that size (fast for JPEG).
    ``readers=V``: follow an epoch plan over ``V`` virtual readers (see
    :mod:`tarshards.source`): exact and elastic mid-epoch resume (``state_dict()``), equal
    batches on every rank, ``len()`` exact; ``remainder="drop"|"carry"|"pad"`` says what
    happens to the samples that do not fill ``V x B``; ``equal=True`` asks for it explicitly.
    ``prefetch``: shards opened ahead of the current one (default: 2 for remote shard lists, 0
    for local files); ``prefetch_bytes`` bounds the memory they buffer.
    """

    def __init__(
        self,
        urls,
        extensions: str | None = None,
        decoder: Any = _DEFAULT,
        transforms: Any = None,
        shuffle: int = 0,
        *,
        shardshuffle: bool | None = None,
        resampled: bool = False,
        seed: int = 0,
        on_error: OnError = "raise",
        handler: Callable | None = None,
        nodesplitter: Callable | None = None,
        workersplitter: Callable | None = None,
        empty_check: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        storage_options: dict | None = None,
        allow_pipe: bool = False,
        cache_dir: str | None = None,
        cache_size: float | str | None = None,
        retries: int = 5,
        last_dot: bool = False,
        decode_size=None,
        allow_unsafe: bool = False,
        manifest=None,
        verify: bool = False,
        prefetch: int | None = None,
        prefetch_bytes: int = 256 << 20,
        readers: int | None = None,
        remainder: str = "drop",
        equal: bool | None = None,
    ):
        super().__init__(self._samples, seed=seed, on_error=on_error, handler=handler)
        if readers is None and equal:
            raise ValueError(
                "equal batches per rank need the epoch plan: pass readers=V "
                "(virtual readers, e.g. 60)"
            )
        if readers is not None and equal is False:
            raise ValueError(
                "a planned pipeline (readers=) always yields equal batches per "
                "rank; leave readers= out for the plain shard split"
            )
        self._plan_config = None
        if readers is not None:
            PlanConfig(readers=readers, remainder=remainder)  # checks the arguments
            self._plan_config = {"readers": int(readers), "remainder": remainder}
        self._table: ShardTable | None = None
        self.manifest = None
        if manifest is None and _is_manifest_spec(urls):
            manifest, urls = urls, None
        if manifest is not None:
            from .manifest import as_manifest

            self.manifest = as_manifest(manifest, storage_options)
        if urls is None and self.manifest is not None:
            self.urls = self.manifest.shard_urls()
        else:
            self.urls = expand_urls(urls, storage_options=storage_options)
        if not self.urls:
            raise ValueError(f"the shard spec {urls!r} names no shards")
        if verify and self.manifest is None:
            raise ValueError(
                "verify=True checks shards against a manifest: pass manifest=M "
                "(or the manifest as the URL spec)"
            )
        self.verify = verify
        self.spec = (
            urls if urls is not None else (getattr(self.manifest, "url", None) or "<manifest>")
        )
        self.resampled = resampled
        self.shardshuffle = bool(shuffle) if shardshuffle is None else bool(shardshuffle)
        self.nodesplitter = nodesplitter
        self.workersplitter = workersplitter
        self.empty_check = empty_check
        self.rank = rank
        self.world_size = world_size
        self.last_dot = last_dot
        self.storage_options = storage_options
        self.allow_pipe = allow_pipe
        self.retries = retries
        if prefetch is None:
            prefetch = 2 if any(_is_remote(u) for u in self.urls) else 0
        if prefetch < 0 or prefetch_bytes < 1:
            raise ValueError(f"bad prefetch={prefetch!r} / prefetch_bytes={prefetch_bytes!r}")
        self.prefetch = int(prefetch)
        self.prefetch_bytes = int(prefetch_bytes)
        self._opener = None
        if cache_dir is not None:
            from .storage import ShardCache

            cache = ShardCache(
                cache_dir,
                max_bytes=cache_size,
                storage_options=storage_options,
                retries=retries,
                allow_pipe=allow_pipe,
                manifest=self.manifest,
            )
            self._opener = cache.open
        # the seed notebook's constructor: shuffle, decode, tuple, per-element transforms
        if shuffle:
            self._append(_stages.shuffle, shuffle)
        if decoder is _DEFAULT:
            decoder = "rgb" if extensions is not None else None
        if decoder is not None:
            modes = decoder if isinstance(decoder, (list, tuple)) else [decoder]
            kw = {"allow_unsafe": allow_unsafe}
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

    def worker_info(self) -> WorkerInfo:
        return _explicit_rank(super().worker_info(), self.rank, self.world_size)

    # ---- the epoch plan (readers=) ------------------------------------------------------------
    @property
    def table(self):
        """The shards' sample counts and offsets (scanned once, when first needed)."""
        if self._table is None:
            if self.manifest is not None:
                self._table = ShardTable.from_manifest(self.manifest, self.urls)
            else:
                self._table = scan_shards(self.urls, opener=self._open, last_dot=self.last_dot)
        return self._table

    def set_table(self, table) -> None:
        """Use known per-shard counts/offsets (a :class:`tarshards.source.ShardTable`)."""
        if list(table.urls) != list(self.urls):
            raise ValueError("the table describes other shards than this dataset's")
        self._table = table

    def _open(self, url):
        if self._opener is not None:
            return self._opener(url)
        return open_url(
            url,
            storage_options=self.storage_options,
            allow_pipe=self.allow_pipe,
            retries=self.retries,
        )

    def _plan_parts(self):
        """(PlanConfig, stages before the batch, the batch stage, stages after it)."""
        stages = self._stages
        bufsize, initial, first = 0, None, 0
        if stages and stages[0].fn is _stages.shuffle:
            args = _bind(stages[0])
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
        bargs = _bind(stages[bi])
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

    def _plan_identity(self) -> dict:
        return self._plan_parts()[0].identity(self.table.fingerprint)

    def _epoch_program(self, epoch: int) -> "PlannedProgram":
        return _SingleProgram(self, epoch)

    def shard_list(self, ctx: dict) -> Iterable[str]:
        """The shards this reader reads in the epoch described by ``ctx``.

        A ``nodesplitter``/``workersplitter`` that takes parameters named ``rank``,
        ``world_size``, ``worker``, ``num_workers`` or ``worker_info`` (as :func:`split_by_node`
        and :func:`split_by_worker` do) is given this reader's values.
        """
        if self.resampled:
            return resampled_shards(
                self.urls,
                seed=ctx["seed"],
                epoch=ctx["epoch"],
                rank=ctx["rank"] * ctx["num_workers"] + ctx["worker"],
                worker=0,
            )
        urls = shard_order(
            self.urls, seed=ctx["seed"], epoch=ctx["epoch"], shuffle=self.shardshuffle
        )
        if self.nodesplitter is not None:
            urls = _as_urls(_call_splitter(self.nodesplitter, urls, ctx))
        if self.workersplitter is not None:
            urls = _as_urls(_call_splitter(self.workersplitter, urls, ctx))
        if self.nodesplitter is None or self.workersplitter is None:
            rank, world = (
                (0, 1) if self.nodesplitter is not None else (ctx["rank"], ctx["world_size"])
            )
            worker, nworkers = (
                (0, 1) if self.workersplitter is not None else (ctx["worker"], ctx["num_workers"])
            )
            urls = split_shards(
                urls, rank=rank, world_size=world, worker=worker, num_workers=nworkers
            )
        return urls

    def _samples(self, ctx: dict) -> Iterator[dict]:
        shards: Any = self.shard_list(ctx)
        if not self.resampled:
            shards = list(shards)
        options: dict[str, Any] = {
            "storage_options": self.storage_options,
            "allow_pipe": self.allow_pipe,
            "last_dot": self.last_dot,
            "retries": self.retries,
            "prefetch": self.prefetch,
            "prefetch_bytes": self.prefetch_bytes,
        }
        if self._opener is not None:
            options["opener"] = self._opener
        if self.verify and self.manifest is not None:  # verify= needs a manifest (__init__)
            options["expect"] = self.manifest.records_by_url()
        if not self.empty_check or self.resampled:
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
        env = self.environment()
        ctx = {
            "rank": env["rank"] if rank is None else rank,
            "world_size": env["world_size"] if world_size is None else world_size,
            "worker": worker,
            "num_workers": num_workers,
            "seed": self.seed,
            "epoch": (
                epoch
                if epoch is not None
                else self._current_epoch()
                if self._current_epoch() is not None
                else self._auto_epoch
            ),
        }
        counts = self.manifest.counts()
        total = 0
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            shards = list(self.shard_list(ctx))
        for url in shards:
            n = counts.get(url)
            if n is None:
                raise TypeError(f"shard {url} is not in the manifest; its length is unknown")
            total += n
        return total

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


def _is_remote(url: str) -> bool:
    """A shard read over a network (prefetching pays off), not a file, stdin or a pipe."""
    return not (is_local(url) or url == "-" or url.startswith("pipe:"))


def _explicit_rank(info: WorkerInfo, rank: int | None, world_size: int | None) -> WorkerInfo:
    """``info`` with the rank and world size given to the dataset, where given."""
    if rank is None and world_size is None:
        return info
    return info.replace(
        rank=info.rank if rank is None else rank,
        world_size=info.world_size if world_size is None else world_size,
    )


def _call_splitter(fn: Callable, urls: list[str], ctx: dict):
    if "worker_info" not in ctx:  # a context made by hand (rank, world_size... only)
        ctx = dict(
            ctx,
            worker_info=WorkerInfo(
                ctx["rank"], ctx["world_size"], ctx["worker"], ctx["num_workers"]
            ),
        )
    return fn(urls, **{name: ctx[name] for name in _wanted(fn, _PLACE)})


def _as_urls(items) -> list[str]:
    out = []
    for x in items:
        out.append(x["url"] if isinstance(x, dict) else x)
    return out


def _bind(stage: _Stage) -> dict:
    """A stage's arguments by name, defaults filled in."""
    bound = inspect.signature(stage.fn).bind(None, *stage.args, **stage.kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


class PlannedProgram:
    """What one epoch of a planned pipeline is, for :class:`_PlannedIterator`: the number of
    global batches, the readers, and the chain of batches of each reader (subclassed by the
    single-source plan below and by :class:`tarshards.mixing.MixedDataset`)."""

    num_batches: int
    readers: int
    post: list

    def chain(self, it: "_PlannedIterator", reader: int, batches: list[int]):
        raise NotImplementedError

    def pad_chain(self, it: "_PlannedIterator"):
        raise NotImplementedError


def feed_batches(stream: ReaderStream, batches: list[int], size: int, bufsize: int) -> Iterator:
    """The raw samples of batches ``batches`` (``size`` samples each) of one reader stream,
    seeking over gaps (or reading through small ones): one list per batch, flattened in C."""
    return itertools.chain.from_iterable(_batch_lists(stream, batches, size, bufsize))


def _batch_lists(stream: ReaderStream, batches: list[int], size: int, bufsize: int):
    try:
        for j in batches:
            p = j * size
            if p != stream.position:
                gap = p - stream.position
                if stream.position == 0 or gap > 2 * bufsize or gap < 0:
                    stream.seek(p)
                else:
                    stream.skip(gap)
            yield stream.take(size)
    finally:
        stream.close()


class _SingleProgram(PlannedProgram):
    def __init__(self, ds: "WebDataset", epoch: int):
        cfg, pre, bstage, post = ds._plan_parts()
        self.ds, self.cfg = ds, cfg
        self.plan = plan_for(ds.table, cfg, epoch)
        self.num_batches = self.plan.num_batches
        self.readers = cfg.readers
        self.pre, self.bstage, self.post = pre, bstage, post

    def _stream(self, reader: int) -> ReaderStream:
        ds = self.ds
        return ReaderStream(ds.table, self.plan, reader, opener=ds._open, last_dot=ds.last_dot)

    def chain(self, it, reader, batches):
        cfg, ds = self.cfg, self.ds
        raw = feed_batches(self._stream(reader), batches, cfg.batch_size, cfg.bufsize)
        ctx = dict(it.ctx, reader=reader)
        data = ds._run_stages(raw, self.pre, ctx, ("reader", reader), first=1 if cfg.bufsize else 0)
        return iter(ds._run_stages(data, [self.bstage], ctx, ("reader", reader)))

    def pad_chain(self, it):
        """One batch of padding: the epoch's first samples again, flagged ``__pad__``."""
        ds, B = self.ds, self.cfg.batch_size
        stream = self._stream(0)

        def raw():
            try:
                for sample in itertools.islice(stream._read_from(0), B):
                    sample["__pad__"] = True
                    yield sample
            finally:
                stream.close()

        data = ds._run_stages(raw(), self.pre, it.ctx, ("pad",))
        return iter(ds._run_stages(data, [self.bstage], it.ctx, ("pad",)))


class _PlannedIterator:
    """One pass of a planned pipeline on one rank and DataLoader worker.

    Worker ``w`` of ``W`` yields this rank's steps ``k0 + w, k0 + w + W, ...`` (the DataLoader
    takes the workers in turn, so the rank's stream is the steps in order, whatever ``W``). Step
    ``k`` is global batch ``g``: batch ``g // V`` of reader ``g % V``, run through the
    pipeline's stages in a chain of its own per reader (shuffle, per-sample stages, batch).
    A loaded state is consumed here, at once (never lazily inside a generator body).
    """

    def __init__(self, ds, pending: dict | None):
        env = ds.environment()
        info = WorkerInfo(env["rank"], env["world_size"], env["worker"], env["num_workers"])
        self.ds = ds
        self.info = info
        origin, first = 0, None
        if pending is not None:
            epoch = int(pending["epoch"])
            position = int(pending["position"] or 0)
            worker_state = pending.get("num_workers") is not None
            finished = pending.get("finished") and not worker_state
            if finished:
                epoch, position = epoch + 1, 0  # after StopIteration: the next epoch
            prog = ds._epoch_program(epoch)
            if finished:
                pass
            elif worker_state:  # one DataLoader worker's own state (StatefulDataLoader)
                if (pending["num_workers"], pending["world_size"], pending["worker"]) != (
                    info.num_workers,
                    info.world_size,
                    info.worker,
                ):
                    raise ResumeError(
                        f"a worker state of worker {pending['worker']}/{pending['num_workers']} "
                        f"on {pending['world_size']} ranks loaded into worker "
                        f"{info.worker}/{info.num_workers} on {info.world_size} ranks"
                    )
                origin, first = int(pending["origin"]), int(pending["next_step"])
            elif position >= prog.num_batches:
                origin, first = position, info.worker  # the epoch's (empty) rest
            elif int(pending["world_size"]) == info.world_size:
                origin = int(pending["origin"])
                if (position - origin) % info.world_size:
                    raise ResumeError(
                        f"position {position} is not a step boundary of "
                        f"{info.world_size} ranks from origin {origin}"
                    )
            else:  # elastic: the new world continues the global order from here
                origin = position
            if first is None:
                first = (position - origin) // info.world_size + info.worker
        else:
            epoch = ds.epoch if ds.epoch is not None else ds._auto_epoch
            prog = ds._epoch_program(epoch)
            first = info.worker
        if ds.epoch is None:
            ds._auto_epoch = epoch + 1
        self.epoch = epoch
        self.prog = prog
        self.sched = Schedule(prog.num_batches, prog.readers, info.world_size, info.rank, origin)
        self.first = first
        self.next_step = first
        self.finished = False
        self.ctx = {
            "seed": ds.seed,
            "epoch": epoch,
            "rank": info.rank,
            "world_size": info.world_size,
            "worker": info.worker,
            "num_workers": info.num_workers,
        }
        self._gen = self._run()

    # ---- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This worker's position (its next step), in the plan's terms."""
        state = self.ds.plan_state(
            self.epoch,
            0,
            origin=self.sched.origin,
            world_size=self.info.world_size,
            finished=self.finished,
        )
        W = self.info.num_workers
        if W > 1 or self.info.worker:
            state.update(
                {
                    "worker": self.info.worker,
                    "num_workers": W,
                    "next_step": self.next_step,
                    "position": None,
                }
            )
        else:
            step = min(self.next_step, self.sched.steps)
            state["position"] = self.sched.origin + step * self.info.world_size
        return state

    # ---- iteration -------------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._gen)
        except StopIteration:
            self.finished = True
            raise

    def _run(self):
        prog, sched = self.prog, self.sched
        V = prog.readers
        steps = range(self.first, sched.steps, self.info.num_workers)
        needed: dict[int, list[int]] = {}
        for k in steps:
            g = sched.global_batch(k)
            if g < prog.num_batches:
                needed.setdefault(g % V, []).append(g // V)
        chains = {v: prog.chain(self, v, js) for v, js in needed.items()}
        units = self._units(steps, chains)
        if prog.post:
            units = self.ds._run_stages(
                units, prog.post, self.ctx, ("post",), first=len(self.ds._stages) - len(prog.post)
            )
        yield from units

    def _units(self, steps, chains):
        prog, sched, V = self.prog, self.sched, self.prog.readers
        for k in steps:
            g = sched.global_batch(k)
            chain = chains[g % V] if g < prog.num_batches else prog.pad_chain(self)
            batch = next(chain, _DEFAULT)
            if batch is _DEFAULT:
                raise TarshardsError(
                    f"reader {g % V} of epoch {self.epoch} yielded fewer batches than planned: a "
                    "stage dropped samples (select, a skipping handler, a map returning None). "
                    "A planned pipeline needs every sample to reach the batch; flag bad samples "
                    "instead of dropping them"
                )
            self.next_step = k + self.info.num_workers
            yield batch
