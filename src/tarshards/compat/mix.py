"""Mixing datasets: ``RoundRobin`` and ``RandomMix`` (webdataset's names).

``RandomMix`` draws from a generator seeded by (seed, pass, rank, worker); webdataset's draws from
the global random state.
"""

from __future__ import annotations

from ..plan.shards import make_rng
from ._base import IterableDataset
from .utils import pytorch_worker_info

__all__ = [
    "RandomMix",
    "RoundRobin",
    "random_samples",
    "round_robin_longest",
    "round_robin_shortest",
]


def round_robin_shortest(*sources):
    """One item from each source in turn, until one of them ends."""
    its = [iter(s) for s in sources]
    while True:
        for it in its:
            try:
                yield next(it)
            except StopIteration:
                return


def round_robin_longest(*sources):
    """One item from each source in turn, dropping sources as they end."""
    its = [iter(s) for s in sources]
    while its:
        alive = []
        for it in its:
            try:
                item = next(it)
            except StopIteration:
                continue
            alive.append(it)
            yield item
        its = alive


class RoundRobin(IterableDataset):
    """Interleave datasets one item at a time (``longest``: until all have ended)."""

    def __init__(self, datasets, longest: bool = False):
        self.datasets = datasets
        self.longest = longest

    def __iter__(self):
        fn = round_robin_longest if self.longest else round_robin_shortest
        return fn(*self.datasets)


def random_samples(sources, probs=None, longest: bool = False, rng=None):
    """Items from sources picked at random with probabilities ``probs`` (default: equal).

    Ends when a source ends, or (``longest``) when all have.
    """
    import random

    rng = random.Random() if rng is None else rng
    its = [iter(s) for s in sources]
    weights = [1.0] * len(its) if probs is None else [float(p) for p in probs]
    if len(weights) != len(its):
        raise ValueError(f"{len(weights)} probabilities for {len(its)} sources")
    while its:
        (i,) = rng.choices(range(len(its)), weights=weights)
        try:
            yield next(its[i])
        except StopIteration:
            if not longest:
                return
            del its[i], weights[i]


class RandomMix(IterableDataset):
    """Mix datasets at random with weights ``probs`` (seeded; see the module docstring)."""

    def __init__(self, datasets, probs=None, longest: bool = False, seed: int = 0):
        self.datasets = datasets
        self.probs = probs
        self.longest = longest
        self.seed = seed
        self.epoch = -1

    def __iter__(self):
        self.epoch += 1
        rank, _, worker, _ = pytorch_worker_info()
        rng = make_rng("mix", self.seed, self.epoch, rank, worker)
        return random_samples(self.datasets, self.probs, self.longest, rng=rng)
