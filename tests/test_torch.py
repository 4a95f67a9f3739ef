"""The torch adapter with a real DataLoader: workers, ranks, epochs."""

from __future__ import annotations

import collections
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, IterableDataset  # noqa: E402

from tarshards import WebDataset, WebLoader  # noqa: E402
from tarshards.errors import TarshardsWarning  # noqa: E402

from conftest import write_shards  # noqa: E402


@pytest.fixture(scope="module")
def six_shards(tmp_path_factory):
    return write_shards(tmp_path_factory.mktemp("six"), 6, 12)


def loader_keys(ds, **kw):
    out = []
    for batch in DataLoader(ds, **kw):
        out.extend(batch[0])
    return out


def test_is_an_iterable_dataset(six_shards):
    assert WebDataset.__base__ is IterableDataset
    assert isinstance(WebDataset(six_shards[0]), IterableDataset)


@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
def test_every_sample_once_per_epoch(six_shards, num_workers):
    paths, samples = six_shards
    ds = WebDataset(paths, shardshuffle=True, seed=3).shuffle(20).decode("torchrgb").to_tuple(
        "__key__", "jpg", "cls")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: 3 workers on 2 cores
        got = loader_keys(ds, batch_size=16, num_workers=num_workers)
    counts = collections.Counter(got)
    assert len(got) == len(samples)
    assert set(counts) == {s["__key__"] for s in samples}


def test_batches_have_tensor_shapes(six_shards):
    paths, _ = six_shards
    ds = WebDataset(paths).decode("torchrgb").to_tuple("jpg", "cls")
    images, classes = next(iter(DataLoader(ds, batch_size=16, num_workers=2)))
    assert images.shape == (16, 3, 24, 32) and images.dtype == torch.float32
    assert classes.shape == (16,) and classes.dtype == torch.int64


def test_ranks_times_workers_disjoint_and_complete(six_shards):
    paths, samples = six_shards
    per_rank = []
    for rank in range(2):
        ds = WebDataset(paths, rank=rank, world_size=2, shardshuffle=True, seed=5).to_tuple(
            "__key__", "cls")
        per_rank.append(loader_keys(ds, batch_size=8, num_workers=2))
    a, b = map(set, per_rank)
    assert not a & b
    assert a | b == {s["__key__"] for s in samples}
    assert len(per_rank[0]) + len(per_rank[1]) == len(samples)


def test_epochs_same_seed_same_order_and_differ(six_shards):
    paths, _ = six_shards

    def epoch_orders(seed):
        ds = WebDataset(paths, shardshuffle=True, seed=seed).shuffle(30).to_tuple("__key__")
        loader = WebLoader(ds, batch_size=8, num_workers=2)
        return [loader_keys_from(loader) for _ in range(2)]

    def loader_keys_from(loader):
        out = []
        for (k,) in loader:
            out.extend(k)
        return out

    first = epoch_orders(11)
    again = epoch_orders(11)
    assert first == again
    assert first[0] != first[1]
    assert sorted(first[0]) == sorted(first[1])


def test_fewer_shards_than_workers_warns_not_hangs(six_shards):
    paths, samples = six_shards
    ds = WebDataset(paths[:1]).to_tuple("__key__")
    with pytest.warns(TarshardsWarning, match="readers get no data"):
        ds.shard_list({"seed": 0, "epoch": 0, "rank": 0, "world_size": 1, "worker": 0,
                       "num_workers": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = loader_keys(ds, batch_size=4, num_workers=2, timeout=60)
    assert sorted(got) == sorted(s["__key__"] for s in samples[:12])


def test_webdataset_style_splitters_discover_workers(six_shards):
    from tarshards import split_by_node, split_by_worker

    paths, samples = six_shards
    ds = WebDataset(paths, nodesplitter=split_by_node, workersplitter=split_by_worker).to_tuple(
        "__key__")
    got = loader_keys(ds, batch_size=8, num_workers=2)
    assert sorted(got) == sorted(s["__key__"] for s in samples)  # each shard once, not twice
