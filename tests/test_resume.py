"""Exact and elastic resume of planned pipelines (virtual readers), through real loaders."""

from __future__ import annotations

import collections
import io
import warnings

import pytest

from tarshards import TarWriter
from tarshards.errors import ResumeError
from tarshards.plan.cursor import EpochPlan, PlanConfig, Schedule, ShuffleCore, reader_rng
from tarshards.testing import batch_digest, check_resume, run_epochs

COUNTS = [7, 13, 5, 11, 9, 3, 17, 8]  # uneven shards, 73 samples


def write_uneven(directory, counts=COUNTS, prefix="k"):
    urls, n = [], 0
    for s, cnt in enumerate(counts):
        path = directory / f"part-{s:02d}.tar"
        with TarWriter(str(path)) as w:
            for _ in range(cnt):
                w.write(
                    {
                        "__key__": f"{prefix}{n:04d}",
                        "cls": str(n % 7).encode(),
                        "txt": f"value {n}".encode(),
                    }
                )
                n += 1
        urls.append(str(path))
    return urls


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    return write_uneven(tmp_path_factory.mktemp("uneven"))


# ---- the plan: a pure function ------------------------------------------------------------


@pytest.mark.parametrize("remainder", ["drop", "pad", "carry"])
def test_plan_segments_are_disjoint_equal_and_cover(remainder):
    cfg = PlanConfig(seed=3, readers=6, batch_size=4, remainder=remainder)
    seen = collections.Counter()
    for epoch in range(3):
        plan = EpochPlan(COUNTS, cfg, epoch)
        assert plan.segment_length == plan.q * 4
        items = []
        for v in range(6):
            runs = list(plan.segment_runs(v))
            assert sum(b - a for _, a, b, _ in runs) == plan.segment_length
            items += [(s, i, pad) for s, a, b, pad in runs for i in range(a, b)]
        real = [(s, i) for s, i, pad in items if not pad]
        if remainder != "carry":  # (carried samples come again in the epoch's own order)
            assert len(set(real)) == len(real)  # nothing twice within an epoch
        seen.update(real)
        if remainder == "drop":
            assert len(real) == 72 and plan.q == 3
        if remainder == "pad":
            assert plan.q == 4 and len(real) == 73 and len(items) == 96
    if remainder == "carry":  # 219 samples over 3 epochs: 216 delivered, 3 carried on
        assert sum(seen.values()) == 216 and max(seen.values()) == 3
        assert sum(1 for c in seen.values() if c == 3) == 73 - 3


def test_plan_is_deterministic_and_changes_with_epoch():
    cfg = PlanConfig(seed=1, readers=6, batch_size=4)
    a, b = EpochPlan(COUNTS, cfg, 0), EpochPlan(COUNTS, cfg, 0)
    assert a.runs == b.runs
    assert EpochPlan(COUNTS, cfg, 1).runs != a.runs


def test_schedule_needs_world_dividing_readers():
    with pytest.raises(ValueError, match="virtual readers"):
        Schedule(60, 12, 5, 0)
    s = Schedule(18, 6, 3, 1, origin=0)
    assert s.steps == 6 and [s.global_batch(k) for k in range(3)] == [1, 4, 7]


def test_shuffle_replay_equals_the_run():
    for bufsize, initial in [(5, None), (8, 2), (50, None)]:
        full = list(ShuffleCore(bufsize, initial, reader_rng(0, 0, 1)).run(iter(range(37))))
        assert sorted(full) == list(range(37))
        for p in [0, 1, 3, 20, 36, 37]:
            core = ShuffleCore(bufsize, initial, reader_rng(0, 0, 1))
            core.replay(37, p)
            held = core.positions()
            core.buf[core.tail if core.tail >= 0 else 0 :] = held  # "read" them back
            rest = list(core.run(iter(range(core.consumed, 37))))
            assert full[p:] == rest, (bufsize, initial, p)


# ---- exact resume ---------------------------------------------------------------------------


def make_ds(urls, *, shuffle=5, readers=6, batch=4, seed=1, remainder="drop", torch_ds=False, **kw):
    if torch_ds:
        from tarshards.torch.adapter import WebDataset
    else:
        from tarshards.pipeline.dataset import WebDataset
    ds = WebDataset(urls, shardshuffle=True, seed=seed, readers=readers, remainder=remainder, **kw)
    if shuffle:
        ds = ds.shuffle(shuffle)
    return ds.decode().to_tuple("__key__", "cls", "__pad__").batched(batch)


def keys_of(batch):
    return list(batch[0])


@pytest.mark.parametrize("shuffle", [0, 5])
@pytest.mark.parametrize("remainder", ["drop", "pad", "carry"])
def test_dataset_resumes_exactly(urls, shuffle, remainder):
    check_resume(
        lambda: make_ds(urls, shuffle=shuffle, remainder=remainder),
        epochs=2,
        resumes_in_one_epoch=3,
    )


def make_plain(urls, *, shuffle=5, batch=4, seed=1, ctor=False, torch_ds=False, **kw):
    """A pipeline without an epoch plan (no readers=): the plain shard split."""
    if torch_ds:
        from tarshards.torch.adapter import WebDataset
    else:
        from tarshards.pipeline.dataset import WebDataset
    if ctor:  # the seed's API: shuffle= in the constructor
        ds = WebDataset(urls, shuffle=shuffle, seed=seed, **kw)
    else:
        ds = WebDataset(urls, shardshuffle=True, seed=seed, **kw)
        if shuffle:
            ds = ds.shuffle(shuffle)
    return ds.decode().to_tuple("__key__", "cls").batched(batch)


@pytest.mark.parametrize(
    "variant", ["shuffle", "no-shuffle", "ctor-shuffle", "with-epoch", "samples"]
)
def test_plain_pipeline_resumes_exactly(urls, variant):
    """Without an epoch plan the state names the epoch and the items yielded in it, and a
    resumed pipeline replays the epoch to there: exact (its state used to name only the
    next epoch, so a mid-epoch state silently dropped the rest of the epoch)."""
    from tarshards.pipeline.dataset import WebDataset

    def make():
        if variant == "samples":  # no batching: the position counts samples
            return WebDataset(urls, shuffle=7, seed=3)
        ds = make_plain(
            urls, shuffle=0 if variant == "no-shuffle" else 5, ctor=variant == "ctor-shuffle"
        )
        return ds.with_epoch(23) if variant == "with-epoch" else ds

    ref = check_resume(make, epochs=2, resumes_in_one_epoch=3)
    assert ref[0] != ref[1]
    ds = make()
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    assert state["kind"] == "stream" and state["epoch"] == 0 and state["position"] == 1


# (the ranks' unequal shares are incidental here: the warning has tests of its own)
@pytest.mark.filterwarnings("ignore:\\d+ ranks (may )?read:tarshards.errors.TarshardsWarning")
def test_plain_pipeline_state_refuses_another_place(urls):
    ds = make_plain(urls, rank=0, world_size=2)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    other = make_plain(urls, rank=1, world_size=2)
    other.load_state_dict(state)  # the place is checked when the iteration starts
    with pytest.raises(ResumeError, match=r"same place.*rank: saved 0, here 1"):
        iter(other)
    short = make_plain(urls)
    short.load_state_dict(dict(short.state_dict(), position=10_000))
    with pytest.raises(ResumeError, match="at item 10000 of epoch 0"):
        iter(short)


def test_every_sample_once_and_equal_batches(urls):
    ds = make_ds(urls)
    batches = list(ds)
    assert len(batches) == 18 and all(len(keys_of(b)) == 4 for b in batches)
    keys = [k for b in batches for k in keys_of(b)]
    assert len(set(keys)) == 72
    pad = list(make_ds(urls, remainder="pad"))
    flags = [f for b in pad for f in b[2]]
    assert len(pad) == 24 and sum(flags) == 96 - 73
    assert len({k for (b,) in zip(pad) for k, f in zip(b[0], b[2]) if not f}) == 73


def test_mismatched_state_raises(urls, tmp_path):
    ds = make_ds(urls)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    for other in [
        make_ds(urls, seed=2),
        make_ds(urls, readers=12, batch=2),
        make_ds(urls, batch=3),
        make_ds(urls, shuffle=7),
        make_ds(write_uneven(tmp_path, COUNTS[:-1] + [9])),
    ]:
        with pytest.raises(ResumeError, match="does not fit"):
            other.load_state_dict(state)
    with pytest.raises(ResumeError, match="not a tarshards resume state"):
        ds.load_state_dict({"epoch": 0})


# ---- through real loaders ---------------------------------------------------------------------

torch = pytest.importorskip("torch")


def _quiet():
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")


# (num_workers, persistent workers, shuffle buffer): 0-3 workers, persistent on and off, the
# shuffle buffer on (5) and off (0)
LOADER_CASES = [
    (0, False, 5),
    (1, False, 5),
    (2, False, 5),
    (3, False, 5),
    (2, True, 5),
    (3, True, 5),
    (0, False, 0),
    (1, True, 0),
    (3, False, 0),
]


@pytest.mark.parametrize("num_workers,persistent,shuffle", LOADER_CASES)
def test_webloader_resumes_exactly(urls, num_workers, persistent, shuffle):
    from tarshards.torch.adapter import WebLoader

    _quiet()

    def make():
        return WebLoader(
            make_ds(urls, torch_ds=True, shuffle=shuffle),
            batch_size=None,
            num_workers=num_workers,
            persistent_workers=persistent,
        )

    cuts = None if num_workers in (0, 2) else [(0, 5), (1, 7)]
    ref = check_resume(
        make,
        epochs=2,
        cuts=cuts,
        state_roundtrip=_torch_roundtrip,
        resumes_in_one_epoch=2 if num_workers == 2 else 0,
    )
    assert len(make()) == 18 and [len(e) for e in ref] == [18, 18] and ref[0] != ref[1]


@pytest.mark.parametrize("num_workers,persistent", [(0, False), (2, False), (2, True), (3, True)])
def test_webloader_resumes_a_plain_pipeline_exactly(urls, num_workers, persistent):
    """Without a plan WebLoader's state names the epoch and the batches handed out, and a
    resumed loader replays the epoch to there."""
    from tarshards.torch.adapter import WebLoader

    _quiet()

    def make():
        return WebLoader(
            make_plain(urls, torch_ds=True),
            batch_size=None,
            num_workers=num_workers,
            persistent_workers=persistent,
        )

    ref = check_resume(make, epochs=2, state_roundtrip=_torch_roundtrip)
    assert ref[0] != ref[1]


def _torch_roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_stream_does_not_depend_on_num_workers(urls):
    from tarshards.torch.adapter import WebLoader

    _quiet()
    streams = []
    for w in [1, 2, 3, 6]:
        ds = make_ds(urls, torch_ds=True, readers=12, batch=2, rank=1, world_size=2)
        streams.append([batch_digest(b) for b in WebLoader(ds, batch_size=None, num_workers=w)])
    assert len(streams[0]) == 18 and all(s == streams[0] for s in streams)


class _SDLRun:
    """A StatefulDataLoader as a trainer drives it (set_epoch each epoch when workers are not
    persistent: torchdata does not pass the epoch on)."""

    def __init__(self, urls, num_workers, persistent, planned=True, shuffle=5):
        from torchdata.stateful_dataloader import StatefulDataLoader

        make = make_ds if planned else make_plain
        self.ds = make(urls, torch_ds=True, shuffle=shuffle)
        self.persistent = persistent
        self.loader = StatefulDataLoader(
            self.ds, batch_size=None, num_workers=num_workers, persistent_workers=persistent
        )
        self.epoch = 0

    def __iter__(self):
        if not self.persistent:
            self.ds.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)

    def state_dict(self):
        return {"loader": self.loader.state_dict(), "epoch": self.epoch}

    def load_state_dict(self, state):
        self.loader.load_state_dict(state["loader"])
        self.epoch = state["epoch"] - 1


@pytest.mark.parametrize("num_workers,persistent,shuffle", LOADER_CASES)
def test_stateful_dataloader_resumes_exactly(urls, num_workers, persistent, shuffle):
    pytest.importorskip("torchdata.stateful_dataloader")
    _quiet()
    cuts = [(0, 0), (0, 7), (0, 18), (1, 5)]
    check_resume(
        lambda: _SDLRun(urls, num_workers, persistent, shuffle=shuffle), epochs=2, cuts=cuts
    )


@pytest.mark.parametrize("num_workers,persistent", [(0, False), (2, False), (2, True), (3, True)])
def test_stateful_dataloader_resumes_a_plain_pipeline_exactly(urls, num_workers, persistent):
    """StatefulDataLoader keeps each worker's dataset state: without a plan, each worker's
    pipeline replays its own stream to its own position."""
    pytest.importorskip("torchdata.stateful_dataloader")
    _quiet()
    cuts = [(0, 0), (0, 3), (0, 15), (1, 4)]  # not "end": torchdata's own (see the planned test)
    check_resume(lambda: _SDLRun(urls, num_workers, persistent, planned=False), epochs=2, cuts=cuts)


# (planned batches drop the remainder by default; the warning has tests of its own)
@pytest.mark.filterwarnings("ignore:epoch \\d+ drops:tarshards.errors.TarshardsWarning")
def test_manifest_gives_the_plan_without_a_scan(urls, tmp_path):
    from tarshards.format.manifest import build_manifest
    from tarshards.pipeline.dataset import WebDataset

    manifest = build_manifest(urls, str(tmp_path / "m.json"), workers=1)

    def make():
        return (
            WebDataset(str(tmp_path / "m.json"), shardshuffle=True, seed=1, readers=6)
            .shuffle(5)
            .decode()
            .to_tuple("__key__", "cls", "__pad__")
            .batched(4)
        )

    ds = make()
    assert ds.table.counts == tuple(COUNTS) and ds.table.fingerprint == manifest.fingerprint
    assert len(ds) == 18
    ref = check_resume(make, epochs=1, cuts=[(0, 7)])
    # the same batches as the scanned dataset (same counts, same plan)
    assert ref[0] == run_epochs(make_ds(urls), 1)[0]
    assert ds.table.sample_offsets(0) is not None  # seeks through the index


# ---- weighted mixing ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_sets(tmp_path_factory):
    d = tmp_path_factory.mktemp("mix")
    (d / "a").mkdir()
    (d / "b").mkdir()
    return (
        write_uneven(d / "a", [20, 15, 25], prefix="a"),
        write_uneven(d / "b", [9, 11], prefix="b"),
    )


def make_mix(two_sets, stop="first", torch_ds=False, **kw):
    if torch_ds:
        from tarshards.torch.adapter import WebDataset, mix
    else:
        from tarshards.pipeline.dataset import WebDataset
        from tarshards.plan.mixing import mix
    a_urls, b_urls = two_sets
    a = WebDataset(a_urls, shardshuffle=True, seed=0).shuffle(4).decode()
    b = WebDataset(b_urls, shardshuffle=True, seed=0).decode()
    return (
        mix({"a": a, "b": b}, weights={"a": 0.7, "b": 0.3}, readers=4, stop=stop, seed=3, **kw)
        .to_tuple("__key__", "__source__", "__pad__")
        .batched(10)
    )


def test_batch_quotas_are_exact():
    from tarshards.plan.mixing import batch_quotas

    q = batch_quotas((0.7, 0.3), 4, (1000, 1000), "first")
    assert all(sum(x) == 4 and x[0] in (2, 3) and x[1] in (1, 2) for x in q)
    for n in range(1, len(q)):  # every prefix within one sample of the weights
        got = sum(x[0] for x in q[:n])
        assert abs(got - 0.7 * 4 * n) <= 1
    assert batch_quotas((1, 1, 2), 4, (10, 10, 10), "first")[0] == (1, 1, 2)


@pytest.mark.parametrize("stop", ["first", "all", "cycle"])
def test_mix_quotas_stops_and_resume(two_sets, stop):
    batches = list(make_mix(two_sets, stop))
    for keys, sources, pads in batches:
        assert len(keys) == 10 and list(sources).count("a") == 7  # 10 x 0.7 exactly
    keys = [k for b in batches for k in b[0]]
    a_keys = [k for k in keys if k.startswith("a")]
    b_keys = [k for k in keys if k.startswith("b")]
    if stop == "first":  # b (20 samples, 5 per reader) runs out first: nothing twice
        assert len(set(keys)) == len(keys) and len(set(b_keys)) <= 20
    if stop == "all":  # every sample of both sets at least once
        assert len(set(a_keys)) == 60 and len(set(b_keys)) == 20
    if stop == "cycle":
        assert len(keys) == 80
    check_resume(lambda: make_mix(two_sets, stop), epochs=2, cuts=[(0, 1), (0, "end"), (1, 1)])


def test_mix_through_loader_and_elastic(two_sets):
    from tarshards.torch.adapter import WebLoader

    _quiet()
    check_resume(
        lambda: WebLoader(make_mix(two_sets, "all", torch_ds=True), batch_size=None, num_workers=2),
        epochs=1,
        cuts=[(0, 3)],
    )
    # 2 ranks -> 4 ranks: every remaining batch once
    full = [[] for _ in range(2)]
    saved = None
    for r in range(2):
        ds = make_mix(two_sets, "all", rank=r, world_size=2)
        it = iter(ds)
        for _ in range(2):
            full[r].append(next(it))
        if r == 0:
            saved = ds.state_dict()
    after = []
    for r in range(4):
        ds = make_mix(two_sets, "all", rank=r, world_size=4)
        ds.load_state_dict(saved)
        after.append(list(ds))
    assert len({len(x) for x in after}) == 1  # equal steps
    got = [
        k
        for b in full[0] + full[1] + [b for x in after for b in x]
        for k, p in zip(b[0], b[2])
        if not p
    ]
    whole = [k for b in make_mix(two_sets, "all") for k in b[0]]
    assert sorted(got) == sorted(whole)


def test_state_from_a_step_count(urls):
    from tarshards.torch.adapter import WebLoader

    def make():
        return WebLoader(make_ds(urls, torch_ds=True), batch_size=None)

    whole = run_epochs(make(), 2)
    flat = [d for e in whole for d in e]
    for step in (0, 5, 18, 25):
        loader = make()
        loader.load_state_dict(loader.state_from_step(step))
        got = [batch_digest(b) for _ in range(loader.epoch, 2) for b in loader]
        assert got == flat[step:], step


def test_plain_stream_webloader_resumes_by_replay(urls):
    from tarshards.torch.adapter import WebDataset, WebLoader

    def make():
        ds = WebDataset(urls, shardshuffle=True, seed=2).shuffle(5).to_tuple("__key__").batched(4)
        return WebLoader(ds, batch_size=None)

    check_resume(make, epochs=2, cuts=[(0, 3), (0, "end"), (1, 2)])
    planned_state = WebLoader(make_ds(urls, torch_ds=True), batch_size=None).state_dict()
    with pytest.raises(ResumeError, match="no plan"):
        make().load_state_dict(planned_state)
