"""Composing a source of samples with stages (:class:`DataPipeline`), and its fluent methods.

``WebDataset`` keeps a list of ``(stage function, args, kwargs)``; its fluent methods are generated
from the stage functions in :mod:`tarshards.pipeline.stages`, so there is one implementation of
each stage. At iteration time the pipeline asks :meth:`DataPipeline.worker_info` where it runs (a
:class:`~tarshards.types.WorkerInfo`: rank and DataLoader worker), picks the epoch's shards, and
runs the stages, passing each stage that takes them a seeded ``rng``, the dataset's error policy
(``on_error``) and its place (``rank``, ``world_size``, ``worker``, ``num_workers``,
``worker_info``). This module discovers nothing: the core runs as rank 0 of 1, worker 0 of 1
unless told otherwise, and the torch adapter (:mod:`tarshards.torch`) overrides ``worker_info``
with what it discovered at the top.
"""

from __future__ import annotations

import copy
import inspect
import itertools
from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator, TypeVar

from ..on_error import OnError, error_policy
from ..plan import packing as _packing
from ..plan.epoch import PlanState, Schedule, StreamState, check_state
from ..plan.planned import PlannedIterator
from ..plan.shards import make_rng
from ..types import LoaderLink, WorkerInfo
from . import stages as _stages
from .fusion import DEFAULT, PLACE, Stage, params, rewrite, short_repr, wanted
from .iteration import PipelineIterator, StreamIterator

__all__ = ["DataPipeline"]

# the stage record and its helpers live in .fusion; these names are what pipeline.py and
# mixing.py import from here
_DEFAULT = DEFAULT
_PLACE = PLACE
_Stage = Stage
_wanted = wanted


def _place(info: WorkerInfo) -> dict:
    return {
        "rank": info.rank,
        "world_size": info.world_size,
        "worker": info.worker,
        "num_workers": info.num_workers,
        "worker_info": info,
    }


_DP = TypeVar("_DP", bound="DataPipeline")


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
    _live: PipelineIterator | None = None
    # what a loader running this pipeline told it (WebLoader; its DataLoader workers)
    loader_link: LoaderLink = LoaderLink()

    def __init__(
        self,
        source: Callable[[dict], Iterator] | Iterable,
        *,
        seed: int = 0,
        on_error: OnError = "raise",
        handler: Callable | None = None,
    ):
        self._source = source
        self._stages: list[Stage] = []
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
    def compose(self: _DP, stage: Callable, *args, **kwargs) -> _DP:
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
        self._stages.append(Stage(stage, args, kwargs))

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
        manifest = getattr(self, "manifest", None)
        source = "the manifest" if manifest is None else repr(getattr(manifest, "url", None))
        raise TypeError(
            f"{type(self).__name__} is a streaming dataset: it can be iterated "
            "over (for sample in ds, or DataLoader(ds)), not indexed. For ds[i] use "
            f"tarshards.IndexedDataset({source}) (random access by byte range; "
            "the manifest and shard indexes come from writing with manifest= or from: "
            "tarshards index SPEC -o manifest.json)"
        )

    def set_epoch(self, epoch: int) -> None:
        """Fix the epoch used to seed shard and sample shuffling (instead of counting)."""
        self.epoch = int(epoch)

    # ---- what the plan and a loader ask of the pipeline --------------------------------------
    @property
    def stage_list(self) -> tuple[Stage, ...]:
        """The stages as written (:class:`tarshards.pipeline.fusion.Stage`), in order."""
        return tuple(self._stages)

    def prefix(self, k: int, *, unbounded: bool = False) -> "DataPipeline":
        """A copy of this pipeline with its first ``k`` stages only (what ``tarshards bench``
        times stage by stage); ``unbounded``: without a ``with_epoch`` length."""
        new = copy.copy(self)
        new._stages = list(self._stages[:k])
        if unbounded:
            new._nsamples = None
        return new

    @property
    def plan_config(self) -> dict | None:
        """A planned pipeline's plan settings (``readers``, ``remainder``...; ``None``: no
        plan), as ``WebDataset(readers=V)`` or a mixture set them."""
        return self._plan_config

    @property
    def epoch_items(self) -> int | None:
        """The items each reader yields per epoch as :meth:`with_epoch` fixed it (``None``:
        what the data gives)."""
        return self._nsamples

    @property
    def pending_state(self) -> dict | None:
        """The state the next ``iter()`` resumes from (:meth:`load_state_dict`), or ``None``."""
        return self._pending_state

    def advance_epoch(self, epoch: int | None = None) -> int:
        """The epoch of an iteration starting now: ``epoch`` (a resumed state's) or the
        pipeline's own (:meth:`set_epoch`'s, else the count); unless :meth:`set_epoch` fixed
        it, the count moves past it."""
        if epoch is None:
            epoch = self.epoch if self.epoch is not None else self._auto_epoch
        if self.epoch is None:
            self._auto_epoch = int(epoch) + 1
        return int(epoch)

    def attach_loader(self, **changes) -> None:
        """Tell the pipeline what the loader running it gives (:class:`LoaderLink`'s fields;
        ``monitor=None`` etc. take one back)."""
        self.loader_link = replace(self.loader_link, **changes)

    def loader_epoch(self, epoch: int, state: dict | None = None) -> None:
        """A loader runs ``epoch`` next (from ``state``, a checked planned state, when given)
        and moves the epoch from here on: the pipeline counts on from it (its workers' copies
        too) and an earlier :meth:`set_epoch` no longer pins it."""
        self.attach_loader(managed=True)
        self.epoch = None
        self._auto_epoch = int(epoch)
        self._pending_state = None if state is None else dict(state)
        self.unpin_epoch()

    def unpin_epoch(self) -> None:
        """Undo what :meth:`set_epoch` shared with other processes (the torch adapter's
        workers read the epoch from shared memory); nothing here."""

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

    def current_epoch(self) -> int | None:
        """The epoch set by :meth:`set_epoch` (``None``: count); the torch adapter reads it from
        memory shared with the main process inside DataLoader workers."""
        return self.epoch

    def _context(self) -> dict:
        ctx = _place(self.worker_info())
        epoch = self.current_epoch()
        if epoch is None:
            epoch = self._auto_epoch
            self._auto_epoch += 1
        ctx["epoch"] = epoch
        ctx["seed"] = self.seed
        allocate = self.loader_link.allocate
        if allocate is not None:  # a loader worker's transport: where batches are made
            ctx["allocate"] = allocate
        stats = self.loader_link.monitor
        if stats is not None:  # a loader's counters (WebLoader(stats=True), watchdog=)
            ctx["stats"] = stats
        return ctx

    # ---- iteration ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator:
        pending, self._pending_state = getattr(self, "_pending_state", None), None
        if getattr(self, "_plan_config", None) is not None:
            planned = PlannedIterator(self, pending)
            self._live = planned
            return planned
        saved = None if pending is None else StreamState.from_dict(pending)
        if saved is not None:  # a stream state: the epoch, and the items yielded in it
            self._auto_epoch = saved.epoch
            if self.epoch is not None:
                self.epoch = saved.epoch
        ctx = self._context()
        if self._nsamples is None:
            data = self._run(ctx)
        else:
            data = itertools.islice(self._repeated(ctx), self._nsamples)
        info = WorkerInfo(ctx["rank"], ctx["world_size"], ctx["worker"], ctx["num_workers"])
        live = StreamIterator(self.seed, ctx["epoch"], info, data)
        self._live = live
        if saved is not None and saved.position:
            live.replay(saved)
        return live

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
        if ctx.get("stats") is not None:  # a loader's counters
            from ..stats import timed_source

            data = timed_source(data, ctx["stats"])
        # the batches are this pipeline's items (nothing after its last stage keeps them): a
        # loader's transport (ctx["allocate"]) gives the memory they are stacked into
        calls = rewrite(self._stages, allocate=ctx.get("allocate"))
        return iter(self.run_calls(data, calls, ctx, ("stage",)))

    def run_stages(self, data, stage_list, ctx: dict, rng_tag: tuple, first: int = 0):
        """Apply ``stage_list`` (numbered from ``first``, rewritten by
        :func:`tarshards.pipeline.fusion.rewrite`) to ``data`` in the iteration ``ctx``: stages
        that take
        an ``rng`` get one seeded from ``rng_tag``, the stage's number, seed, epoch, rank and
        worker; those that take the error policy or the place get this pipeline's."""
        return self.run_calls(data, rewrite(stage_list, first=first), ctx, rng_tag)

    def run_calls(self, data, calls, ctx: dict, rng_tag: tuple):
        """Apply rewritten stages (:class:`tarshards.pipeline.fusion.Call`) to ``data`` (see
        :meth:`run_stages`)."""
        for call in calls:
            st, kwargs = call.stage, call.kwargs
            if st.wants_rng or st.wants_policy or st.wants_handler or st.wants_place:
                kwargs = dict(kwargs)
                for name in st.wants_place:
                    kwargs[name] = ctx[name]
                if st.wants_rng:
                    again = (ctx["again"],) if ctx.get("again") else ()
                    kwargs["rng"] = make_rng(
                        *rng_tag,
                        call.number,
                        ctx["seed"],
                        ctx["epoch"],
                        ctx["rank"],
                        ctx["worker"],
                        *again,
                    )
                    if "sample_seed" in params(call.fn) and "sample_seed" not in kwargs:
                        # what a sample's own draws come from: not the place that reads it
                        kwargs["sample_seed"] = ("sample", ctx["seed"], ctx["epoch"], *again)
                if st.wants_policy:
                    kwargs["on_error"] = self.on_error
                if st.wants_handler:
                    kwargs["handler"] = self.on_error
            data = call.fn(data, *call.args, **kwargs)
            if call.decodes and ctx.get("stats") is not None:
                from ..stats import timed_stage

                data = timed_stage(data, ctx["stats"])  # the time in decoding
        return data

    # ---- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where this pipeline is: a small dict to save with a checkpoint.

        In a planned pipeline (``WebDataset(..., readers=V)``) it names the epoch and the global
        batch position reached by the iteration in progress (or, in a DataLoader worker, this
        worker's next step), plus what the plan depends on, so that :meth:`load_state_dict`
        can check it. Otherwise it names the epoch of the iteration in progress and the items
        it has yielded, and the place (rank, DataLoader worker) it runs in: a pipeline that
        loads it replays that epoch to there (exact, at the cost of making those items again;
        only in the same place); between iterations, the epoch the next one runs.
        """
        live: PipelineIterator | None = getattr(self, "_live", None)
        if live is not None:  # the pass in progress (either kind) says where it is
            return live.state_dict()
        pending = getattr(self, "_pending_state", None)
        if pending is not None:
            return dict(pending)
        if getattr(self, "_plan_config", None) is not None:
            return self.plan_state(self.next_epoch(), 0)
        return StreamState(self.seed, self.next_epoch()).to_dict()

    def load_state_dict(self, state: dict) -> None:
        """Resume from a :meth:`state_dict` (or a loader's) at the next ``iter()``.

        A state that does not fit (other data, seed or plan) raises
        :class:`~tarshards.errors.ResumeError` here, at once.
        """
        if isinstance(state, dict) and state.get("kind") == "loader":
            state = state["dataset"]
        if getattr(self, "_plan_config", None) is not None:
            state = self.check_plan_state(state)
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
        """The state at global batch ``position`` of ``epoch`` (see
        :mod:`tarshards.plan.cursor`)."""
        if world_size is None:
            world_size = self.environment()["world_size"]
        return PlanState(
            self.plan_identity(), epoch, position, origin, world_size, finished
        ).to_dict()

    def steps_per_epoch(self, epoch: int | None = None, world_size: int | None = None) -> int:
        """Batches each rank yields in ``epoch`` (the same on every rank)."""
        if world_size is None:
            world_size = self.environment()["world_size"]
        epoch = self.next_epoch() if epoch is None else epoch
        prog = self.epoch_program(epoch)
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

    def plan_identity(self) -> dict:
        """What a planned pipeline's state depends on (its data, seed and plan)."""
        raise TypeError(f"{type(self).__name__} has no epoch plan (WebDataset(readers=V) has)")

    def fingerprint_aliases(self) -> dict:
        """Other fingerprints a saved state may carry for this pipeline's data, each mapped to
        the one :meth:`plan_identity` has (:attr:`tarshards.plan.epoch.ShardTable.aliases`)."""
        return {}

    def check_plan_state(self, state: dict) -> dict:
        """``state`` checked against this planned pipeline (:class:`ResumeError` where it does
        not fit), with the data's fingerprint in place of an alias."""
        return check_state(
            state, dict(self.plan_identity(), kind="plan"), aliases=self.fingerprint_aliases()
        )

    def epoch_program(self, epoch: int) -> Any:
        """The epoch's program of batches (planned pipelines)."""
        raise TypeError(f"{type(self).__name__} has no epoch plan (WebDataset(readers=V) has)")

    def __getstate__(self):  # the live iteration stays in its process
        state = self.__dict__.copy()
        state["_live"] = None
        return state

    def next_epoch(self) -> int:
        return self.epoch if self.epoch is not None else self._auto_epoch

    def __repr__(self):
        return " | ".join([self._source_repr()] + [repr(s) for s in self._stages])

    def _source_repr(self) -> str:
        return f"{type(self).__name__}({short_repr(self._source)})"


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
        check = getattr(stage, "check_arguments", None)  # a stage's own checks, at once
        if check is not None:
            check(*args, **shown)
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
# packs and buckets (tarshards.plan.packing): stages of their own, which a planned pipeline plans
for _name in ("pack", "bucket"):
    setattr(DataPipeline, _name, _fluent(getattr(_packing, _name)))
