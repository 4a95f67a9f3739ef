"""webdataset's ``DataPipeline(*stages)`` on tarshards' pipeline.

A stage is a source (an iterable, a shard list, a ``DataLoader``, a function of no arguments, a
``PipelineStage``), a function of an iterator, a ``PipelineStage`` (``stage.run(src)``) or a
curried filter (``wds.shuffle(100)``). Curried filters become stages of the tarshards pipeline,
so each gets a random generator seeded from (seed, epoch, rank, worker) and the pipeline's
``handler``, exactly as the fluent API's methods do. Rank and worker are the ones
:mod:`tarshards.torch` discovers (``torch.distributed`` and the DataLoader worker).
"""

from __future__ import annotations

import copy
import itertools
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from ..pipeline.stages import reraise_exception
from . import filters
from ._base import TSDataPipeline
from .filters import Curried
from .utils import PipelineStage

__all__ = ["DataPipeline", "FluidInterface"]


def _apply(data, stage):
    """Run a non-curried stage on its upstream (webdataset's ``invoke``)."""
    if isinstance(stage, PipelineStage):
        return stage.run(data)
    if not callable(stage):
        raise ValueError(
            f"{stage!r}: not a valid pipeline stage (a function of an iterator, "
            "a PipelineStage or a curried filter)"
        )
    return stage(data)


_apply.__name__ = "stage"


def _flatten(stages) -> list:
    out: list = []
    for s in stages:
        if s is None:
            continue
        if isinstance(s, list):
            out.extend(x for x in s if x is not None)
        else:
            out.append(s)
    return out


class _CompatMixin:
    """webdataset's pipeline methods over a tarshards pipeline (placed first in the MRO)."""

    pipeline: list
    _repetitions: tuple[int | None, int | None] | None
    if TYPE_CHECKING:  # the tarshards pipeline's, which the classes built on this mixin have
        _stages: list

        def _append(self, fn, *args, **kwargs) -> Any: ...

    def _init_compat(self) -> None:
        self.pipeline = []  # the stages as given (webdataset's .pipeline / .stage(i))
        self._repetitions = None

    # ---- composition -------------------------------------------------------------------------
    def append(self, stage) -> None:
        """Append a stage (changes this pipeline)."""
        if isinstance(stage, Curried):
            self._append(stage.fn, *stage.args, **stage.kwargs)
        else:
            self._append(_apply, stage)
        self.pipeline.append(stage)

    def compose(self, *stages):
        """A copy of this pipeline with ``stages`` appended."""
        new = copy.copy(self)
        new._stages = list(self._stages)
        new.pipeline = list(self.pipeline)
        for stage in _flatten(stages):
            new.append(stage)
        return new

    def stage(self, i: int):
        """The ``i``-th stage as it was given."""
        return self.pipeline[i]

    # ---- epochs ------------------------------------------------------------------------------
    def with_epoch(self, nsamples: int = -1, nbatches: int = -1):
        """Exactly ``max(nsamples, nbatches)`` items per reader and iteration, repeating the
        reader's data when it is shorter (changes this pipeline and returns it)."""
        n = max(nsamples, nbatches)
        if n < 0:
            raise ValueError("with_epoch needs nsamples or nbatches")
        TSDataPipeline.with_epoch(self, n)
        return self

    def repeat(self, nepochs: int = -1, nbatches: int = -1):
        """Iterate ``nepochs`` times (forever when < 1, ending early on an empty pass), at most
        ``nbatches`` items in all when given (changes this pipeline and returns it)."""
        self._repetitions = (nepochs if nepochs > 0 else None, nbatches if nbatches > 0 else None)
        return self

    def with_length(self, n: int, silent: bool = False):
        """Give the pipeline a ``len()``; iteration is not affected."""
        TSDataPipeline.with_length(self, n)
        return self

    def __iter__(self) -> Iterator:
        if self._repetitions is None:
            return TSDataPipeline.__iter__(self)
        nepochs, nitems = self._repetitions
        passes = self._passes(nepochs)
        return passes if nitems is None else itertools.islice(passes, nitems)

    def _passes(self, nepochs):
        for _ in range(nepochs) if nepochs is not None else itertools.count():
            empty = True
            for item in TSDataPipeline.__iter__(self):
                empty = False
                yield item
            if empty:
                return

    # ---- resources ---------------------------------------------------------------------------
    def close(self) -> None:
        for stage in self.pipeline:
            if stage is not self and hasattr(stage, "close"):
                stage.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class FluidInterface:
    """webdataset's fluent methods: each appends the curried filter of the same name."""

    if TYPE_CHECKING:  # _CompatMixin's, which the classes built on this one have

        def compose(self, *stages) -> Any: ...

    def batched(self, batchsize, collation_fn=filters.default_collation_fn, partial=True):
        return self.compose(filters.batched(batchsize, collation_fn=collation_fn, partial=partial))

    def unbatched(self):
        return self.compose(filters.unbatched())

    def listed(self, batchsize, partial=True):
        return self.compose(filters.listed(batchsize, partial=partial))

    def unlisted(self):
        return self.compose(filters.unlisted())

    def log_keys(self, logfile=None):
        return self.compose(filters.log_keys(logfile))

    def shuffle(self, size, **kw):
        if size < 1:
            return self
        return self.compose(filters.shuffle(size, **kw))

    def map(self, f, handler=None):
        kw = {} if handler is None else {"handler": handler}
        return self.compose(filters.map(f, **kw))

    def decode(
        self,
        *args,
        pre=None,
        post=None,
        only=None,
        partial=False,
        handler=None,
        allow_unsafe=False,
        size=None,
    ):
        kw = {} if handler is None else {"handler": handler}
        return self.compose(
            filters.decode(
                *args,
                pre=pre,
                post=post,
                only=only,
                partial=partial,
                allow_unsafe=allow_unsafe,
                size=size,
                **kw,
            )
        )

    def map_dict(self, handler=None, **kw):
        if handler is not None:
            kw["handler"] = handler
        return self.compose(filters.map_dict(**kw))

    def select(self, predicate, **kw):
        return self.compose(filters.select(predicate, **kw))

    def to_tuple(self, *args, **kw):
        return self.compose(filters.to_tuple(*args, **kw))

    def map_tuple(self, *args, handler=None):
        kw = {} if handler is None else {"handler": handler}
        return self.compose(filters.map_tuple(*args, **kw))

    def slice(self, *args):
        return self.compose(filters.slice(*args))

    def rename(self, **kw):
        return self.compose(filters.rename(**kw))

    def rsample(self, p=0.5):
        return self.compose(filters.rsample(p))

    def rename_keys(self, *args, **kw):
        return self.compose(filters.rename_keys(*args, **kw))

    def extract_keys(self, *args, **kw):
        return self.compose(filters.extract_keys(*args, **kw))

    def xdecode(self, *args, **kw):
        return self.compose(filters.xdecode(*args, **kw))

    def mcached(self):
        return self.compose(filters.Cached())


class _Source:
    """Opens a pipeline's first stage (kept apart from the pipeline: no reference cycle, so a
    pipeline over a DataLoader with persistent workers shuts them down promptly)."""

    def __init__(self):
        self.stage = None

    def __call__(self, ctx: dict) -> Iterator:
        src = self.stage
        if src is None:
            raise ValueError("this DataPipeline has no stages")
        if hasattr(src, "pipeline_source"):
            return src.pipeline_source(ctx)
        if isinstance(src, PipelineStage):
            return iter(src.run())
        if isinstance(src, Iterable) or hasattr(src, "__iter__"):
            return iter(src)
        if callable(src):
            return iter(src())
        raise ValueError(f"{src!r}: not a valid pipeline source")

    def __repr__(self):
        return repr(self.stage)


class DataPipeline(_CompatMixin, FluidInterface, TSDataPipeline):
    """``DataPipeline(source, stage, stage, ...)``: webdataset's composable pipeline.

    ``seed`` (keyword) seeds every shuffle in the pipeline together with the epoch, rank and
    worker; ``handler`` (keyword) is the error policy handed to stages that take one.
    """

    def __init__(self, *args, seed: int = 0, handler=reraise_exception):
        TSDataPipeline.__init__(self, _Source(), seed=seed, handler=handler)
        self._init_compat()
        for stage in _flatten(args):
            self.append(stage)

    def append(self, stage) -> None:
        if not self.pipeline:
            if isinstance(stage, Curried):
                raise ValueError(
                    f"{stage!r} is a filter, not a source: put a shard list or an iterable first"
                )
            self._source.stage = stage
            self.pipeline.append(stage)
            return
        _CompatMixin.append(self, stage)

    def _source_repr(self) -> str:
        return f"DataPipeline({self._source.stage!r})"
