"""The one iterator a pipeline hands out: what ``iter(pipeline)`` returns, planned or not.

A :class:`PipelineIterator` is one pass (epoch) of a pipeline in one place: it owns the epoch,
the place (:class:`~tarshards.types.WorkerInfo`: rank and DataLoader worker), the running
stages, and its position, which :meth:`~PipelineIterator.state` gives as a typed, frozen value
(:class:`~tarshards.plan.epoch.PlanState` or :class:`~tarshards.plan.epoch.StreamState`) and
:meth:`~PipelineIterator.state_dict` as its saved form. Loaders (``WebLoader``,
``StatefulDataLoader`` through the dataset's ``state_dict``) ask it through these public methods
only.

Two kinds, one protocol:

* :class:`StreamIterator`: the plain shard split (no epoch plan). Its position is the items it
  has yielded; a resumed one replays its epoch to there (the stream is a pure function of seed,
  epoch and place, so the replayed rest equals the uninterrupted rest), in the same place only.
* ``PlannedIterator`` (:mod:`tarshards.plan.planned`): an epoch plan over virtual readers. Its
  position is a global step of the plan, found again by arithmetic (no replay), on any world
  size.

A chain of stateful stages over a positional source (:class:`tarshards.pipeline.stateful.Chain`)
hands out the same kind of iterator (``ChainIterator``), whose :class:`ChainState` holds each
stage's position with its upstream's.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterator, Mapping

from ..errors import ResumeError
from ..plan.epoch import PlanState, StreamState
from ..types import WorkerInfo

__all__ = ["ChainState", "PipelineIterator", "StreamIterator"]


class PipelineIterator:
    """One pass of a pipeline in one place (see the module). Subclasses give ``__next__`` and
    :meth:`state`."""

    epoch: int
    info: WorkerInfo
    finished: bool

    def __iter__(self) -> "PipelineIterator":
        return self

    def __next__(self) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def state(self) -> PlanState | StreamState | ChainState:  # pragma: no cover - abstract
        """Where this pass is, as a typed, frozen value."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """:meth:`state` in its saved form (what ``load_state_dict`` takes)."""
        return self.state().to_dict()


class _Counted:
    """Iterates ``iterable``, counting the items yielded (``position``); ``finished`` once it
    ends. The reference of the C base ``tarshards._speedups.Counted`` (used where it is built:
    one C call an item instead of a Python frame)."""

    def __init__(self, iterable):
        self._data = iter(iterable)
        self.position = 0
        self.finished = False

    def __iter__(self):
        return self

    def __next__(self) -> Any:
        try:
            item = next(self._data)
        except StopIteration:
            self.finished = True
            raise
        self.position += 1
        return item


try:  # optional C accelerator (_speedups, see _c/counted.c); _Counted is the reference
    from .._speedups import Counted as _CountedBase
except ImportError:  # pragma: no cover - built by default
    _CountedBase = _Counted


class StreamIterator(_CountedBase, PipelineIterator):
    """A pass of a pipeline without an epoch plan: ``data`` (the pipeline's items of this epoch,
    in this place) counted as they are yielded (``position``; ``finished`` once it ended), see
    the module."""

    def __init__(self, seed: int, epoch: int, info: WorkerInfo, data: Iterator):
        super().__init__(data)
        self.seed = seed
        self.epoch = int(epoch)
        self.info = info

    @property
    def place(self) -> dict[str, int]:
        info = self.info
        return {
            "rank": info.rank,
            "world_size": info.world_size,
            "worker": info.worker,
            "num_workers": info.num_workers,
        }

    def state(self) -> StreamState:
        if self.finished:  # the epoch ended: the next one from its start
            return StreamState(self.seed, self.epoch + 1, 0, self.place)
        return StreamState(self.seed, self.epoch, self.position, self.place)

    def replay(self, saved: StreamState) -> None:
        """Make and drop the items the saved pass had yielded (``saved.position``), in the same
        place (else :class:`~tarshards.errors.ResumeError`)."""
        n = saved.position
        moved = [
            f"{k}: saved {saved.place.get(k)!r}, here {v!r}"
            for k, v in self.place.items()
            if saved.place.get(k, v) != v
        ]
        if moved:
            raise ResumeError(
                "a pipeline without an epoch plan resumes mid-epoch only in the same place "
                "(its stream depends on the rank and the DataLoader worker); pass readers=V "
                "for a plan that moves between world sizes: " + "; ".join(moved)
            )
        got = sum(1 for _ in itertools.islice(self, n))
        if got < n:
            raise ResumeError(
                f"the saved state is at item {n} of epoch {self.epoch}, but this epoch has "
                f"{got} items here (other data?)"
            )


@dataclass(frozen=True)
class ChainState:
    """Where a chain of stateful stages is: ``fresh`` (before its first item, or after its
    last: the next pass starts afresh), else ``stages``: the last stage's position holding its
    upstream's (``"upstream"``), down to the source's, as each stage saves it (read-only).
    :meth:`to_dict` is the saved form."""

    fresh: bool = True
    stages: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def to_dict(self) -> dict:
        return {"fresh": True} if self.fresh else _thaw(self.stages)

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> "ChainState":
        if not isinstance(state, Mapping):
            raise ResumeError(f"not a chain state: {state!r:.200}")
        if state.get("fresh"):
            return cls()
        return cls(False, _freeze(state))


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value
