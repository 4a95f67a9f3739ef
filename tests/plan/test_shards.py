"""Shard order and splitting: deterministic, disjoint, covering."""

from __future__ import annotations

import itertools
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tarshards.errors import TarshardsWarning
from tarshards.plan.shards import make_rng, resampled_shards, shard_order, split_shards


@given(
    st.integers(0, 60),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(0, 10**6),
    st.integers(0, 5),
)
@settings(max_examples=80, deadline=None)
def test_splits_are_disjoint_and_cover(n, world, workers, seed, epoch):
    urls = [f"s{i}" for i in range(n)]
    order = shard_order(urls, seed=seed, epoch=epoch)
    parts = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for r, w in itertools.product(range(world), range(workers)):
            parts.append(
                split_shards(order, rank=r, world_size=world, worker=w, num_workers=workers)
            )
    flat = [u for p in parts for u in p]
    assert sorted(flat) == sorted(urls)
    assert len(set(flat)) == len(flat)


def test_order_depends_on_seed_and_epoch_only():
    urls = [f"s{i}" for i in range(50)]
    a = shard_order(urls, seed=3, epoch=0)
    assert a == shard_order(urls, seed=3, epoch=0)
    assert a != shard_order(urls, seed=3, epoch=1)
    assert a != shard_order(urls, seed=4, epoch=0)
    assert shard_order(urls, seed=3, epoch=0, shuffle=False) == urls


def test_fewer_shards_than_readers_warns():
    with pytest.warns(TarshardsWarning, match="readers get no data"):
        split_shards(["a", "b"], worker=0, num_workers=4)
    assert split_shards(["a", "b"], worker=3, num_workers=4, warn=False) == []


def test_bad_ranks_rejected():
    with pytest.raises(ValueError):
        split_shards(["a"], rank=2, world_size=2)


def test_resampled_draws_with_replacement_deterministically():
    urls = ["a", "b", "c"]
    a = list(itertools.islice(resampled_shards(urls, seed=1, epoch=0, rank=0), 30))
    b = list(itertools.islice(resampled_shards(urls, seed=1, epoch=0, rank=0), 30))
    c = list(itertools.islice(resampled_shards(urls, seed=1, epoch=0, rank=1), 30))
    assert a == b and a != c and set(a) == set(urls)


def test_make_rng_is_stable():
    assert make_rng(1, 2, 3).random() == make_rng(1, 2, 3).random()
    assert make_rng(1, 2, 3).random() != make_rng(1, 2, 4).random()


def test_splitters_default_to_the_single_process():
    from tarshards.plan.shards import split_by_node, split_by_worker

    urls = [f"s{i}" for i in range(5)]
    assert split_by_node(urls) == urls and split_by_worker(urls) == urls
    assert split_by_node(urls, 1, 2) == ["s1", "s3"]


def test_split_stages_are_given_the_pipelines_place():
    """split_by_node/split_by_worker as pipeline stages get the rank and worker the pipeline
    was given (here by a subclass; in training by the torch adapter), not a guess of their own."""
    from tarshards.pipeline.dataset import DataPipeline
    from tarshards.plan.shards import split_by_node, split_by_worker
    from tarshards.types import WorkerInfo

    class Placed(DataPipeline):
        def worker_info(self):
            return WorkerInfo(rank=1, world_size=2, worker=1, num_workers=2)

    items = list(range(16))
    pipe = Placed(lambda ctx: iter(items)).compose(split_by_node).compose(split_by_worker)
    assert list(pipe) == items[1::2][1::2]
    # values given explicitly are kept
    pipe = Placed(lambda ctx: iter(items)).compose(split_by_node, rank=0, world_size=4)
    assert list(pipe) == items[0::4]
