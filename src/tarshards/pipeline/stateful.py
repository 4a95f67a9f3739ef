"""Stages that hold a position: small classes with explicit, saveable state.

A stateful stage is called on its upstream (``stage(upstream)``) and returns an iterator.
``state_dict()`` saves its own position together with its upstream's state (when the upstream is
stateful); ``load_state_dict()`` takes effect at the next call, which restores the upstream
first, eagerly, before anything is read. ``Shuffle`` needs a *positional* upstream (one that can
``seek(position)`` and ``read_at(positions)``: a list, or a virtual reader's shard segment): its
buffer is rebuilt from sample positions, never saved as samples. The stateless stages they wrap
are :mod:`tarshards.pipeline.stages`' functions.
"""

from __future__ import annotations

from typing import Callable, Iterator

from ..errors import ResumeError
from ..plan.cursor import ShuffleCore
from ..types import WorkerInfo
from .iteration import ChainState, PipelineIterator
from .stages import batched, unbatched

__all__ = ["Batch", "Chain", "ChainIterator", "Limit", "ListSource", "Shuffle", "Unbatch"]

_END = object()


class ListSource:
    """A list as a positional, stateful source (the reference upstream for stateful stages)."""

    def __init__(self, items):
        self.items = list(items)
        self.position = 0

    def seek(self, position: int) -> None:
        self.position = int(position)

    def read_at(self, positions) -> dict:
        return {p: self.items[p] for p in positions}

    def __len__(self):
        return len(self.items)

    def __iter__(self):
        items = self.items
        while self.position < len(items):
            self.position += 1
            yield items[self.position - 1]

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


class _StageIter:
    """The iterator a stateful stage returns: its state is the stage's."""

    __slots__ = ("it", "stage")

    def __init__(self, stage, it):
        self.stage, self.it = stage, it

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.it)

    def state_dict(self) -> dict:
        return self.stage.state_dict()


def _state_of(upstream):
    return upstream.state_dict() if hasattr(upstream, "state_dict") else None


class Chain:
    """A positional source followed by stateful stages, as one stateful iterable: each
    ``iter()`` is one pass (epoch), a :class:`ChainIterator` (the one iterator protocol of
    :mod:`tarshards.pipeline.iteration`); ``state_dict()``/``load_state_dict()`` save and
    restore the whole chain (each stage's state holds its upstream's, which the chain hands
    down)."""

    def __init__(self, source, *stages):
        self.source = source
        self.stages = list(stages)
        self._live: ChainIterator | None = None
        self._pending: ChainState | None = None

    def __iter__(self) -> "ChainIterator":
        pending, self._pending = self._pending, None
        if pending is None or pending.fresh:
            self.source.seek(0)
        else:
            state: dict | None = pending.to_dict()
            for st in reversed(self.stages):
                if state is None:
                    raise ResumeError("the saved chain state is incomplete")
                st.load_state_dict(state)
                if "upstream" not in state:  # the stage restores its upstream itself
                    state = None
                    break
                state = state["upstream"]
            if state is not None:
                self.source.load_state_dict(state)
        it = self.source
        for st in self.stages:
            it = st(it)
        self._live = ChainIterator(it)
        return self._live

    def state_dict(self) -> dict:
        if self._live is None:
            return (self._pending or ChainState()).to_dict()
        return self._live.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._live = None
        self._pending = ChainState.from_dict(state)


class ChainIterator(PipelineIterator):
    """One pass of a :class:`Chain`: its items, and its position as a :class:`ChainState` (the
    last stage's state, which holds its upstream's)."""

    __slots__ = ("_it", "_top", "epoch", "finished", "info")

    def __init__(self, top):
        self._top = top  # the last stage's iterator (its state_dict: the chain's position)
        self._it = iter(top)
        self.epoch = 0  # a chain counts no epochs: each iter() is a pass of its source
        self.info = WorkerInfo()
        self.finished = False

    def __next__(self):
        try:
            return next(self._it)
        except StopIteration:
            self.finished = True  # after the pass: the next one starts afresh
            raise

    def state(self) -> ChainState:
        if self.finished:
            return ChainState()
        return ChainState.from_dict(_state_of(self._top) or {})


class Shuffle:
    """A shuffle buffer of ``bufsize`` over a positional upstream, resumable from its output
    count alone: the buffer is rebuilt by replaying its index arithmetic on positions and
    reading the held samples by position (``upstream.read_at``)."""

    def __init__(self, bufsize: int = 1000, initial: int | None = None, seed: int = 0):
        if bufsize < 0:
            raise ValueError(f"shuffle bufsize must be >= 0, got {bufsize}")
        self.bufsize, self.initial, self.seed = bufsize, initial, seed
        self._core: ShuffleCore | None = None
        self._pending: dict | None = None

    def _rng(self):
        from ..plan.cursor import reader_rng

        return reader_rng(self.seed, 0, 0)

    def __call__(self, upstream) -> Iterator:
        core = ShuffleCore(max(self.bufsize, 1), self.initial, self._rng())
        pending, self._pending = self._pending, None
        total = len(upstream)
        if pending is not None and pending.get("emitted"):
            core.replay(total, int(pending["emitted"]))
            held = core.positions()
            got = upstream.read_at(held)
            start = core.tail if core.tail >= 0 else 0
            core.buf[start:] = [got[p] for p in held]
        upstream.seek(core.consumed)
        self._core = core
        return _StageIter(self, core.run(iter(upstream), prefetch=True))

    def state_dict(self) -> dict:
        return {"emitted": self._core.emitted if self._core is not None else 0}

    def load_state_dict(self, state: dict) -> None:
        self._pending = dict(state)


class Limit:
    """At most ``n`` items (``take``/``with_epoch``), resumable."""

    def __init__(self, n: int):
        if n < 0:
            raise ValueError("Limit needs a non-negative count")
        self.n = int(n)
        self.count = 0
        self._upstream = None
        self._pending: dict | None = None

    def __call__(self, upstream) -> Iterator:
        pending, self._pending = self._pending, None
        self.count = 0 if pending is None else int(pending["count"])
        self._upstream = upstream
        return _StageIter(self, self._run(iter(upstream)))

    def _run(self, it):
        while self.count < self.n:
            item = next(it, _END)
            if item is _END:
                return
            self.count += 1
            yield item

    def state_dict(self) -> dict:
        return {"count": self.count, "upstream": _state_of(self._upstream)}

    def load_state_dict(self, state: dict) -> None:
        self._pending = dict(state)


class Unbatch:
    """The samples of each batch (as :func:`unbatched`), resumable inside a batch: the
    upstream's state is kept from before the batch being unpacked, which is produced again."""

    def __init__(self):
        self._upstream = None
        self._before = None
        self._index = 0
        self._pending: dict | None = None

    def __call__(self, upstream) -> Iterator:
        pending, self._pending = self._pending, None
        skip = 0 if pending is None else int(pending["index"])
        self._upstream = upstream
        self._before = None
        return _StageIter(self, self._run(iter(upstream), skip))

    def _snapshot(self):
        return _state_of(self._upstream)

    def _run(self, it, skip):
        while True:
            self._before = self._snapshot()
            self._index = 0
            batch = next(it, _END)
            if batch is _END:
                return
            for i, sample in enumerate(unbatched([batch])):
                if i < skip:
                    continue
                self._index = i + 1
                yield sample
            skip = 0

    def state_dict(self) -> dict:
        if self._upstream is None:
            return {"upstream": None, "index": 0}
        if self._before is None:  # not started: the upstream is where it is
            return {"upstream": self._snapshot(), "index": 0}
        return {"upstream": self._before, "index": self._index}

    def load_state_dict(self, state: dict) -> None:
        self._pending = dict(state)


class Batch:
    """Batches of ``batchsize`` (as :func:`batched`), resumable at batch boundaries: its state
    is its upstream's (a batch is handed out whole)."""

    def __init__(self, batchsize: int, collation_fn: Callable | None = None, partial: bool = True):
        self.batchsize, self.partial = batchsize, partial
        self.collation_fn = collation_fn
        self._upstream = None
        self._pending: dict | None = None

    def __call__(self, upstream) -> Iterator:
        self._pending = None
        self._upstream = upstream
        return _StageIter(
            self, batched(iter(upstream), self.batchsize, self.collation_fn, self.partial)
        )

    def state_dict(self) -> dict:
        return {"upstream": _state_of(self._upstream)}

    def load_state_dict(self, state: dict) -> None:
        self._pending = dict(state)
