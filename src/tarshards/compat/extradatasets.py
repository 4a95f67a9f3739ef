"""webdataset's small datasets: ``MockDataset``, ``repeatedly``, ``with_epoch``, ``with_length``."""

from __future__ import annotations

from typing import Iterator

from ._base import IterableDataset
from .utils import PipelineStage
from .utils import repeatedly as _repeatedly

__all__ = ["MockDataset", "repeatedly", "with_epoch", "with_length"]


class MockDataset(IterableDataset):
    """``length`` copies of ``sample`` (for testing pipelines without data)."""

    def __init__(self, sample, length: int):
        self.sample = sample
        self.length = length

    def __len__(self):
        return self.length

    def __iter__(self):
        for _ in range(self.length):
            yield self.sample


class repeatedly(IterableDataset, PipelineStage):
    """A stage repeating its upstream: ``nepochs`` passes or ``nbatches`` items in all."""

    def __init__(self, source=None, nepochs=None, nbatches=None, length=None):
        self.source = source
        self.nepochs = nepochs
        self.nbatches = nbatches
        self.length = length

    def run(self, source):
        return _repeatedly(source, nepochs=self.nepochs, nbatches=self.nbatches)

    invoke = run

    def __iter__(self):
        return self.run(self.source)

    def __len__(self):
        if self.length is None:
            raise TypeError("repeatedly has no length unless given one")
        return self.length


class with_epoch(IterableDataset):
    """Cut (or stretch) a dataset's epochs to ``length`` items: the underlying iterator carries
    on where the previous epoch stopped, and starts over when it ends."""

    def __init__(self, dataset, length: int):
        self.source = dataset
        self.length = length
        self._it: Iterator | None = None

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_it"] = None
        return state

    def __iter__(self):
        count = 0
        restarted = False
        while count < self.length:
            if self._it is None:
                self._it = iter(self.source)
            try:
                item = next(self._it)
            except StopIteration:
                self._it = None
                if restarted:
                    return  # empty source
                restarted = True
                continue
            restarted = False
            yield item
            count += 1

    invoke = __iter__


class with_length(IterableDataset, PipelineStage):
    """Give a dataset a ``len()`` (iteration unchanged)."""

    def __init__(self, dataset, length: int):
        self.dataset = dataset
        self.length = length

    def __iter__(self):
        return iter(self.dataset)

    def __len__(self):
        return self.length

    def run(self, dataset):
        return iter(dataset)
