"""The torch adapter with a real DataLoader: workers, ranks, epochs."""

from __future__ import annotations

import collections
import warnings

import pytest

torch = pytest.importorskip("torch")
from conftest import write_shards  # noqa: E402
from torch.utils.data import DataLoader, IterableDataset  # noqa: E402

from tarshards import WebDataset, WebLoader  # noqa: E402
from tarshards.errors import TarshardsWarning  # noqa: E402


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
    ds = (
        WebDataset(paths, shardshuffle=True, seed=3)
        .shuffle(20)
        .decode("torchrgb")
        .to_tuple("__key__", "jpg", "cls")
    )
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


# (the ranks' unequal shares are incidental here: the warning has tests of its own; set before
# the DataLoader's workers fork, so that theirs is ignored too)
@pytest.mark.filterwarnings("ignore:\\d+ ranks (may )?read:tarshards.errors.TarshardsWarning")
def test_ranks_times_workers_disjoint_and_complete(six_shards):
    paths, samples = six_shards
    per_rank = []
    for rank in range(2):
        ds = WebDataset(paths, rank=rank, world_size=2, shardshuffle=True, seed=5).to_tuple(
            "__key__", "cls"
        )
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
        ds.shard_list(
            {"seed": 0, "epoch": 0, "rank": 0, "world_size": 1, "worker": 0, "num_workers": 2}
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = loader_keys(ds, batch_size=4, num_workers=2, timeout=60)
    assert sorted(got) == sorted(s["__key__"] for s in samples[:12])


def test_webdataset_style_splitters_discover_workers(six_shards):
    from tarshards import split_by_node, split_by_worker

    paths, samples = six_shards
    ds = WebDataset(paths, nodesplitter=split_by_node, workersplitter=split_by_worker).to_tuple(
        "__key__"
    )
    got = loader_keys(ds, batch_size=8, num_workers=2)
    assert sorted(got) == sorted(s["__key__"] for s in samples)  # each shard once, not twice


def epoch_keys(loader, epochs):
    return [[k for (ks,) in loader for k in ks] for _ in range(epochs)]


def make_epoch_ds(paths, seed=11):
    return WebDataset(paths, shardshuffle=True, seed=seed).shuffle(30).to_tuple("__key__")


def test_persistent_workers_new_order_each_epoch_same_again(six_shards):
    """WebLoader with persistent workers: set_epoch reaches the running workers."""
    paths, samples = six_shards
    everything = sorted(s["__key__"] for s in samples)

    def orders():
        loader = WebLoader(
            make_epoch_ds(paths), batch_size=8, num_workers=2, persistent_workers=True, timeout=60
        )
        return epoch_keys(loader, 3)

    first = orders()
    assert all(sorted(e) == everything for e in first)
    assert len({tuple(e) for e in first}) == 3, "an epoch repeated an order"
    assert orders() == first
    # the same orders as fresh workers each epoch: the order is a function of seed and epoch
    fresh = WebLoader(make_epoch_ds(paths), batch_size=8, num_workers=2, timeout=60)
    assert epoch_keys(fresh, 3) == first


def test_plain_dataloader_persistent_workers_with_set_epoch(six_shards):
    paths, _ = six_shards
    ds = make_epoch_ds(paths)
    loader = DataLoader(ds, batch_size=8, num_workers=2, persistent_workers=True, timeout=60)
    got = []
    for epoch in (0, 1, 2):
        ds.set_epoch(epoch)
        got.append([k for (ks,) in loader for k in ks])
    webloader = WebLoader(make_epoch_ds(paths), batch_size=8, num_workers=2, timeout=60)
    assert got == epoch_keys(webloader, 3)
    ds.set_epoch(1)  # back to an earlier epoch: its order again
    assert [k for (ks,) in loader for k in ks] == got[1]


def test_persistent_workers_without_set_epoch_count_epochs(six_shards):
    paths, _ = six_shards
    loader = DataLoader(
        make_epoch_ds(paths), batch_size=8, num_workers=2, persistent_workers=True, timeout=60
    )
    got = epoch_keys(loader, 2)
    webloader = WebLoader(make_epoch_ds(paths), batch_size=8, num_workers=2, timeout=60)
    assert got == epoch_keys(webloader, 2)


def test_no_workers_count_epochs(six_shards):
    paths, _ = six_shards
    ds = make_epoch_ds(paths)
    counted = [[k for (k,) in ds] for _ in range(2)]
    assert counted[0] != counted[1]
    loader = WebLoader(make_epoch_ds(paths), batch_size=8, num_workers=0)
    assert epoch_keys(loader, 2) == counted
    plain = DataLoader(make_epoch_ds(paths), batch_size=8, num_workers=0)
    assert epoch_keys(plain, 2) == counted


def test_compose_after_set_epoch_keeps_epochs_apart(six_shards):
    paths, _ = six_shards
    base = make_epoch_ds(paths)
    base.set_epoch(3)
    derived = base.map(lambda t: t)
    derived.set_epoch(4)
    loader = DataLoader(base, batch_size=8, num_workers=1, timeout=60)
    expected = make_epoch_ds(paths)
    expected.set_epoch(3)
    assert [k for (ks,) in loader for k in ks] == [k for (k,) in expected]


def keys_of(ds):
    return [k for (k,) in ds]


# (the ranks' unequal shares are incidental here: the warning has tests of its own)
@pytest.mark.filterwarnings("ignore:\\d+ ranks (may )?read:tarshards.errors.TarshardsWarning")
def test_launcher_environment_is_honoured_at_the_top(six_shards, monkeypatch):
    paths, _ = six_shards
    built_before = WebDataset(paths, shardshuffle=True, seed=2).to_tuple("__key__")
    built_before.set_epoch(0)  # iterated twice below: the same epoch both times
    rank1 = keys_of(
        WebDataset(paths, rank=1, world_size=2, shardshuffle=True, seed=2).to_tuple("__key__")
    )
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert keys_of(built_before) == rank1  # the rank is found when iterating, not building
    got = [
        k for (ks,) in DataLoader(built_before, batch_size=4, num_workers=2, timeout=60) for k in ks
    ]
    assert sorted(got) == sorted(rank1)
    # an explicit rank wins over the environment
    assert (
        keys_of(
            WebDataset(paths, rank=0, world_size=2, shardshuffle=True, seed=2).to_tuple("__key__")
        )
        != rank1
    )


def test_bad_launcher_environment_fails_loudly(six_shards, monkeypatch):
    from tarshards.torch.adapter import discover_rank

    paths, _ = six_shards
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK/WORLD_SIZE"):
        discover_rank()
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(ValueError, match="RANK/WORLD_SIZE"):
        list(WebDataset(paths))
    monkeypatch.delenv("RANK")
    assert discover_rank() == (0, 1)  # one of the two alone: not a launcher's


def test_nodesplitter_is_given_the_rank(six_shards):
    from tarshards import split_by_node, split_by_worker

    paths, _ = six_shards
    plain = keys_of(
        WebDataset(paths, rank=1, world_size=2, shardshuffle=True, seed=4).to_tuple("__key__")
    )
    styled = WebDataset(
        paths,
        rank=1,
        world_size=2,
        shardshuffle=True,
        seed=4,
        nodesplitter=split_by_node,
        workersplitter=split_by_worker,
    )
    assert keys_of(styled.to_tuple("__key__")) == plain
    got = [
        k
        for (ks,) in DataLoader(styled.to_tuple("__key__"), batch_size=4, num_workers=2, timeout=60)
        for k in ks
    ]
    assert sorted(got) == sorted(plain)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_webloader_hands_out_bytes_for_zero_copy_fields(tmp_path, num_workers):
    # memoryviews would collate to lists of ints and do not pickle: WebLoader makes them bytes
    import io
    import tarfile

    path = tmp_path / "z.tar"
    with tarfile.open(path, "w") as tf:
        for i in range(12):
            for ext, data in (("bin", bytes([i]) * 300), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"s{i:02d}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    ds = WebDataset(str(path), copy=False).to_tuple("bin", "cls")
    assert type(next(iter(ds))[0]) is memoryview
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TarshardsWarning)  # one shard for two workers
        got = sorted(tuple(x) for x in WebLoader(ds, batch_size=None, num_workers=num_workers))
    assert got == [(bytes([i]) * 300, str(i).encode()) for i in range(12)]
    batches = list(WebLoader(ds.batched(4), batch_size=None, num_workers=0))
    assert batches[0][0] == [bytes([i]) * 300 for i in range(4)]
