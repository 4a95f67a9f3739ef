"""A pipeline's stage list, and the one rewrite it goes through before it runs.

A pipeline keeps its stages as they were written: a :class:`Stage` each (the stage function,
its arguments, and what it asks the pipeline for: a seeded ``rng``, the error policy, its
place). :func:`rewrite` turns a run of stages into the calls to make (:class:`Call`). It is
the only place where stages are fused or changed, and each rewrite gives the same values as
the stages as written, only faster:

* ``decode(...)`` followed by ``to_tuple(...)`` (both taking the pipeline's error policy, the
  tuple with no option but ``missing_is_error``) runs as one pass,
  :func:`tarshards.codecs.decoding.decode_tuple`: no decoded copy of the sample, only the tuple's
  fields decoded;
* ``decode(...)`` followed by a ``to_tuple(...)`` with other options decodes only the fields the
  tuple can pick (``only=``);
* the pipeline's last stage, a ``batched(B)`` with the default collation, stacks its columns
  into memory given by a loader's transport (``allocate``); with ``decode``, ``to_tuple``
  right before it, JPEG images are decoded straight into the batch's rows
  (:class:`tarshards.codecs.decoding.BatchRows`).

What a call needs from the iteration in progress (its ``rng``, seeded from the stage's number,
the seed, the epoch and the place; the error policy; the place) is bound by
:meth:`tarshards.pipeline.composition.DataPipeline.run_stages`, not here.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..codecs import decoding
from . import stages

__all__ = [
    "DEFAULT",
    "PLACE",
    "Call",
    "Stage",
    "params",
    "rewrite",
    "short_repr",
    "tuple_fields",
    "wanted",
]

DEFAULT: Any = object()  # "not given" (a stage argument left to its default)
# what a stage or a splitter may ask for by naming a parameter so: the reader's place
PLACE = ("rank", "world_size", "worker", "num_workers", "worker_info")


@functools.cache
def params(fn) -> frozenset:
    """The names of ``fn``'s parameters (empty where it has no signature)."""
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


def wanted(fn, names, given=()) -> tuple:
    """Those of ``names`` that ``fn`` takes as parameters and that are not given already (as
    keywords, or bound by a ``functools.partial``)."""
    try:
        names_of = params(fn)
    except TypeError:  # an unhashable callable: not cached
        names_of = params.__wrapped__(fn)
    bound = fn.keywords if isinstance(fn, functools.partial) else {}
    return tuple(n for n in names if n in names_of and n not in given and n not in bound)


def short_repr(v) -> str:
    """A value as a pipeline's repr shows it: a function by name, anything else cut to 40."""
    if callable(v) and hasattr(v, "__name__"):
        return v.__name__
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def tuple_fields(args) -> list[str]:
    """Every field a ``to_tuple(*args)`` stage may pick (alternatives included)."""
    if len(args) == 1 and isinstance(args[0], str) and " " in args[0]:
        args = args[0].split()
    return [f for spec in args for f in spec.split(";")]


class Stage:
    """One stage as written: ``fn(samples, *args, **kwargs)``, and what it asks the pipeline
    for (by naming a parameter): ``wants_rng`` (a seeded ``rng``, unless given one or a
    ``seed``), ``wants_policy`` (the pipeline's ``on_error``), ``wants_handler`` (the policy as
    webdataset's ``handler=``, for stages that take only that), ``wants_place`` (the names of
    :data:`PLACE` it takes)."""

    __slots__ = (
        "args",
        "fn",
        "kwargs",
        "label",
        "wants_handler",
        "wants_place",
        "wants_policy",
        "wants_rng",
    )

    def __init__(self, fn, args, kwargs, label=None):
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        names = params(fn)
        self.wants_rng = "rng" in names and "rng" not in kwargs and "seed" not in kwargs
        given = "on_error" in kwargs or "handler" in kwargs
        self.wants_policy = "on_error" in names and not given
        self.wants_handler = "handler" in names and "on_error" not in names and not given
        self.wants_place = wanted(fn, PLACE, kwargs)
        self.label = label or getattr(fn, "__name__", repr(fn))

    def __repr__(self):
        parts = [short_repr(a) for a in self.args]
        parts += [f"{k}={short_repr(v)}" for k, v in self.kwargs.items()]
        return f"{self.label}({', '.join(parts)})"

    @property
    def collates_by_default(self) -> bool:
        """A ``batched()`` with the default collation (which a transport can stack into)."""
        if self.fn is not stages.batched:
            return False
        fn = self.kwargs.get("collation_fn", self.args[1] if len(self.args) > 1 else DEFAULT)
        return fn is DEFAULT or fn is stages.default_collation_fn

    @property
    def batch_size(self) -> int | None:
        """A ``batched()``'s batch size, where it is a positive int."""
        size = self.args[0] if self.args else self.kwargs.get("batchsize")
        return size if isinstance(size, int) and size > 0 else None


@dataclass(frozen=True)
class Call:
    """One call of a rewritten stage list: ``fn(data, *args, **kwargs)``, for the stage
    ``stage`` (whose ``wants_*`` say what to bind), numbered ``number`` in its pipeline (what
    its ``rng`` is seeded from). ``decodes`` marks the call that decodes (a loader's statistics
    time it)."""

    stage: Stage
    number: int
    fn: Callable
    args: tuple
    kwargs: dict = field(default_factory=dict)
    decodes: bool = False


def _fusable(dec: Stage, tup: Stage) -> bool:
    return dec.wants_policy and tup.wants_policy and set(tup.kwargs) <= {"missing_is_error"}


def rewrite(stage_list: Sequence[Stage], *, first: int = 0, allocate=None) -> list[Call]:
    """The calls that run ``stage_list`` (numbered from ``first``), fused as the module
    docstring says. ``allocate`` (a loader's transport) is given only where the list ends
    the pipeline (nothing after its last stage keeps the batches)."""
    rows = None
    last = len(stage_list) - 1
    batch_into = None  # the last stage, stacking into the transport's memory
    if allocate is not None and stage_list and stage_list[-1].collates_by_default:
        size = stage_list[-1].batch_size
        if (
            len(stage_list) >= 3
            and stage_list[-3].fn is stages.decode
            and stage_list[-2].fn is stages.to_tuple
            and size is not None
        ):
            rows = decoding.BatchRows(allocate, size)
        st = stage_list[-1]
        kwargs = dict(st.kwargs)
        kwargs["collation_fn"] = functools.partial(
            stages.default_collation_fn, allocate=allocate, rows=rows
        )
        batch_into = Stage(st.fn, st.args[:1], kwargs, label=st.label)
    calls: list[Call] = []
    n = 0
    while n < len(stage_list):
        st = stage_list[n] if not (n == last and batch_into is not None) else batch_into
        number = first + n
        nxt = stage_list[n + 1] if n + 1 < len(stage_list) else None
        if st.fn is stages.decode and nxt is not None and nxt.fn is stages.to_tuple:
            if _fusable(st, nxt):
                kwargs = dict(st.kwargs, **nxt.kwargs)
                if rows is not None and n + 1 == last - 1:  # images into the batch's rows
                    kwargs["rows"] = rows
                calls.append(
                    Call(st, number, decoding.decode_tuple, (nxt.args, *st.args), kwargs, True)
                )
                n += 2  # the to_tuple is in the fused call
                continue
            if "only" not in st.kwargs:
                # to_tuple keeps only the fields it names: decoding the others is wasted work
                kwargs = dict(st.kwargs, only=tuple_fields(nxt.args))
                calls.append(Call(st, number, st.fn, st.args, kwargs, True))
                n += 1
                continue
        calls.append(Call(st, number, st.fn, st.args, st.kwargs, st.fn is stages.decode))
        n += 1
    return calls
