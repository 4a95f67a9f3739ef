"""Views (issue 37, item 1): a selection of a data set's samples, stored beside its manifest and
read wherever a manifest is (``WebDataset``, ``IndexedDataset``, planned iteration and its
resume, elastic resume, ``mix``), reading only the selected samples' bytes."""

from __future__ import annotations

import contextlib
import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tarshards
from tarshards import IndexedDataset, Manifest, TarWriter, View, WebDataset, build_manifest
from tarshards.errors import IntegrityError, ResumeError
from tarshards.plan.cursor import ReaderStream, read_rows
from tarshards.plan.epoch import PlanConfig, ShardTable, plan_for
from tarshards.testing import check_resume

COUNTS = [23, 9, 31, 17, 12]  # 92 samples


def write_shards(d, counts, start=0, prefix="part"):
    """Shards of ``counts`` samples (keys k0000...; ~1 KB each, mostly the ``bin`` field),
    written with their indexes; returns their paths."""
    n = start
    paths = []
    for s, cnt in enumerate(counts):
        path = str(d / f"{prefix}-{s:02d}.tar")
        with TarWriter(path, index=True) as w:
            for _ in range(cnt):
                w.write(
                    {
                        "__key__": f"k{n:04d}",
                        "txt": f"value {n} " + "x" * (n % 17),
                        "cls": str(n % 7),
                        "bin": bytes([n % 251]) * 700,
                    }
                )
                n += 1
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("views")
    paths = write_shards(d, COUNTS)
    m = build_manifest(paths, str(d / "m.json"))
    assert [r.samples for r in m.shards] == COUNTS
    return d, m


def all_keys(m):
    return [f"k{i:04d}" for i in range(m.num_samples)]


selections = st.lists(st.integers(0, sum(COUNTS) - 1), min_size=1, max_size=60)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(picked=selections)
def test_view_yields_exactly_the_selected_samples_in_manifest_order(data, picked):
    _d, m = data
    view = View.from_positions(m, picked)
    want = [all_keys(m)[i] for i in sorted(set(picked))]
    assert len(view) == len(want)
    # sequential (plain shard split), random access, and the same after a save/load
    assert [s["__key__"] for s in WebDataset(view)] == want
    ds = IndexedDataset(view)
    assert len(ds) == len(want)
    assert [ds[i]["__key__"] for i in range(len(ds))] == want
    assert ds[-1]["__key__"] == want[-1]
    for i in range(0, len(want), 7):  # the bytes of the sample, not only its key
        got = ds[i]
        k = int(got["__key__"][1:])
        assert got["bin"] == bytes([k % 251]) * 700
    # planned: every sample once (pad repeats samples, flagged)
    planned = WebDataset(view, readers=1, remainder="pad", shardshuffle=False).batched(1)
    assert [b["__key__"][0] for b in planned] == want


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(picked=selections, seed=st.integers(0, 3))
def test_view_file_roundtrip(data, tmp_path_factory, picked, seed):
    _d, m = data
    view = View.from_positions(m, picked)
    path = tmp_path_factory.mktemp("vf") / "sel.view.json"
    saved = view.save(path)
    back = View.load(path)
    assert back == view and back.fingerprint == view.fingerprint == saved.fingerprint
    assert all(
        (a is None and b is None) or np.array_equal(a, b) for a, b in zip(back.rows, view.rows)
    )
    assert back.manifest == m
    assert json.loads(path.read_text())["manifest"] == m.url  # not beside it: absolute


def test_fingerprints(data):
    _d, m = data
    assert View(m).fingerprint == m.fingerprint  # everything: the base's data
    a = View.from_positions(m, [1, 2, 3])
    b = View.from_positions(m, [1, 2, 4])
    assert len({a.fingerprint, b.fingerprint, m.fingerprint}) == 3


def test_big_view_file_is_small_and_fast(tmp_path):
    counts = [1_000_000] * 10
    m = Manifest.from_counts([f"s{i}.tar" for i in range(10)], counts).save(tmp_path / "m.json")
    rng = np.random.default_rng(0)
    rows = [np.flatnonzero(rng.random(c) < 0.1) for c in counts]
    view = View.of(m, rows).save(tmp_path / "ten.view.json")
    size = os.path.getsize(tmp_path / "ten.view.json")
    assert size < 3_000_000  # about a bit per base row (10M rows)
    back = View.load(tmp_path / "ten.view.json")
    assert len(back) == len(view) and np.array_equal(back.rows[3], rows[3])
    contiguous = View.of(m, [np.arange(10, 900_000)] + [None] * 9).save(tmp_path / "c.view.json")
    assert os.path.getsize(tmp_path / "c.view.json") < 2000  # runs: a few bytes
    assert len(View.load(tmp_path / "c.view.json")) == len(contiguous)


def test_edited_view_or_changed_base_is_refused(data, tmp_path):
    _d, m = data
    path = tmp_path / "a.view.json"
    View.from_positions(m, [3, 5, 40]).save(path)
    obj = json.loads(path.read_text())
    obj["fingerprint"] = "0" * 64
    path.write_text(json.dumps(obj))
    with pytest.raises(IntegrityError, match="fingerprint"):
        View.load(path)
    obj = json.loads(path.read_text())
    obj["base_fingerprint"] = "1" * 64
    path.write_text(json.dumps(obj))
    with pytest.raises(IntegrityError, match="other data"):
        View.load(path)


def test_view_of_a_view_composes(data, tmp_path):
    _d, m = data
    first = View.from_positions(m, range(0, m.num_samples, 2)).save(tmp_path / "even.view.json")
    second = first.take([0, 1, 5, 30, 45]).save(tmp_path / "some.view.json")
    assert second.manifest == m and second.parent == str(tmp_path / "even.view.json")
    want = [all_keys(m)[i] for i in (0, 2, 10, 60, 90)]
    assert [s["__key__"] for s in WebDataset(str(tmp_path / "some.view.json"))] == want
    again = View.load(tmp_path / "some.view.json")
    assert again.parent == str(tmp_path / "even.view.json")
    assert [IndexedDataset(again)[i]["__key__"] for i in range(5)] == want
    frac = first.fraction(0.0, 0.5)
    assert len(frac) == round(len(first) * 0.5)


def test_a_view_path_is_accepted_as_a_manifest(data, tmp_path):
    d, m = data
    path = tmp_path / "v.view.json"
    View.from_positions(m, [0, 50, 91]).save(path)
    assert tarshards.format.manifest.as_manifest(str(path)) == m
    ds = WebDataset(str(path))
    assert ds.view is not None and len(ds) == 3
    beside = View.from_positions(m, [1]).save(d / "beside.view.json")
    assert json.loads((d / "beside.view.json").read_text())["manifest"] == "m.json"
    assert View.load(d / "beside.view.json") == beside
    assert [s["__key__"] for s in WebDataset(m.shard_urls(), manifest=str(path))] == [
        "k0000",
        "k0050",
        "k0091",
    ]


def make_planned(view, shuffle=3, torch_ds=False, **kw):
    if torch_ds:
        from tarshards.torch.adapter import WebDataset as TorchWebDataset

        cls = TorchWebDataset
    else:
        cls = WebDataset
    ds = cls(view, readers=4, seed=1, remainder=kw.pop("remainder", "carry"), **kw)
    if shuffle:
        ds = ds.shuffle(shuffle)
    return ds.to_tuple("__key__", "__pad__").batched(3)


def test_planned_view_every_sample_once_and_resume(data):
    _d, m = data
    view = View.from_positions(m, np.flatnonzero(np.arange(m.num_samples) % 3 != 1))
    keys = [k for b in make_planned(view, remainder="pad") for k, p in zip(*b) if not p]
    assert sorted(keys) == [all_keys(m)[i] for i in view.global_rows()]
    ds = make_planned(view)
    assert ds.table.fingerprint == view.fingerprint
    check_resume(lambda: make_planned(view), epochs=2, cuts=[(0, 1), (0, 4), (0, "end"), (1, 2)])
    # a state saved over the view does not load over the base (other data)
    run = make_planned(view)
    it = iter(run)
    next(it)
    state = run.state_dict()
    base = make_planned(m)
    with pytest.raises(ResumeError, match="fingerprint"):
        base.load_state_dict(state)


def test_webloader_with_workers_resumes_over_a_view(data):
    pytest.importorskip("torch")
    from tarshards.torch.adapter import WebLoader

    _d, m = data
    view = View.from_positions(m, np.flatnonzero(np.arange(m.num_samples) % 4 != 0))

    def make():
        return WebLoader(make_planned(view, torch_ds=True), batch_size=None, num_workers=2)

    check_resume(make, epochs=2, cuts=[(0, 3), (1, 2)], resumes_in_one_epoch=1)


def test_elastic_resume_over_a_view(data):
    _d, m = data
    view = View.from_positions(m, np.flatnonzero(np.arange(m.num_samples) % 5 != 2))

    def make(rank, world):
        return make_planned(view, remainder="pad", rank=rank, world_size=world)

    got, saved = [], None
    for r in range(2):
        it = iter(make(r, 2))
        got += [next(it) for _ in range(2)]
        if r == 0:
            run = make(0, 2)
            it0 = iter(run)
            [next(it0) for _ in range(2)]
            saved = run.state_dict()
    for r in range(4):
        ds = make(r, 4)
        ds.load_state_dict(saved)
        got += list(ds)
    keys = [k for b in got for k, p in zip(*b) if not p]
    assert sorted(keys) == [all_keys(m)[i] for i in view.global_rows()]


def test_mix_over_views(data):
    _d, m = data
    a = View.from_positions(m, range(0, 40))
    b = View.from_positions(m, range(60, 92))
    mixed = (
        tarshards.mix(
            {"a": WebDataset(a), "b": WebDataset(b)},
            weights={"a": 0.5, "b": 0.5},
            readers=2,
            stop="first",
        )
        .to_tuple("__key__", "__source__")
        .batched(4)
    )
    batches = list(mixed)
    assert batches
    for keys, sources in batches:
        for k, s in zip(keys, sources):
            assert (int(k[1:]) < 40) == (s == "a") and (s == "b") == (int(k[1:]) >= 60)
    check_resume(lambda: mixed, epochs=1, cuts=[(0, 2)])
    # views (or their files) as the sources themselves
    direct = tarshards.mix({"a": a, "b": b}, readers=2).to_tuple("__key__", "__source__").batched(4)
    assert [list(k) for k, _ in direct] == [list(k) for k, _ in batches]


class _Counting:
    """An opener that counts the bytes read from every file it opens."""

    def __init__(self):
        self.bytes = 0

    @contextlib.contextmanager
    def __call__(self, url):
        with open(url, "rb") as f:
            outer = self

            class F:
                def read(self, n=-1):
                    got = f.read(n)
                    outer.bytes += len(got)
                    return got

                def readinto(self, b):
                    got = f.readinto(b)
                    outer.bytes += got or 0
                    return got

                def seek(self, *a):
                    return f.seek(*a)

                def seekable(self):
                    return True

                def tell(self):
                    return f.tell()

            yield F()


def test_a_ten_percent_view_reads_about_ten_percent_of_the_bytes(data):
    _d, m = data
    rng = np.random.default_rng(7)
    picked = np.flatnonzero(rng.random(m.num_samples) < 0.1)
    view = View.from_positions(m, picked)
    table = ShardTable.from_view(view)
    total = sum(os.path.getsize(u) for u in m.shard_urls())
    count = _Counting()
    keys = []
    for i in range(len(table)):
        for got in read_rows(table, i, range(table.counts[i]), opener=count):
            keys += [s["__key__"] for s in got]
    assert keys == [all_keys(m)[i] for i in picked]
    share = count.bytes / total
    assert share < 0.16, share  # each sample ~1 KB of a ~93 KB data set; only theirs read
    # the same through the plan's cursor (one reader, no shuffle)
    cfg = PlanConfig(readers=1, batch_size=1, remainder="pad", shardshuffle=False)
    plan = plan_for(table, cfg, 0)
    count2 = _Counting()
    stream = ReaderStream(table, plan, 0, opener=count2)
    stream.seek(0)
    got = stream.take(len(view))
    stream.close()
    assert [s["__key__"] for s in got] == keys
    assert count2.bytes == count.bytes


def test_view_over_http_reads_only_its_ranges(data, tmp_path):
    pytest.importorskip(
        "aiohttp", reason="http:// needs the http extra (pip install tarshards[http])"
    )
    from conftest import load_servers

    servers = load_servers()
    d, m = data
    total = sum(os.path.getsize(u) for u in m.shard_urls())
    with servers.HTTPFileServer(d) as srv:
        remote = Manifest.load(f"{srv.url}/m.json")
        assert remote.shard_urls()[0].startswith("http://")
        rng = np.random.default_rng(3)
        picked = np.flatnonzero(rng.random(m.num_samples) < 0.1)
        view = View.from_positions(remote, picked).save(tmp_path / "r.view.json")
        srv.reset()
        keys = [s["__key__"] for s in WebDataset(str(tmp_path / "r.view.json"))]
        assert keys == [all_keys(m)[i] for i in picked]
        sent = sum(srv.bytes_sent(f"/{os.path.basename(u)}") for u in m.shard_urls())
        assert sent < 0.2 * total, (sent, total)
        assert all(r is not None for meth, p, r in srv.requests if p.endswith(".tar"))
        srv.reset()
        planned = WebDataset(view, readers=2, remainder="pad", shardshuffle=False).batched(2)
        got = [k for b in planned for k, p in zip(b["__key__"], b["__pad__"]) if not p]
        assert sorted(got) == keys
        sent = sum(srv.bytes_sent(f"/{os.path.basename(u)}") for u in m.shard_urls())
        assert sent < 0.3 * total, (sent, total)
        # every other sample: the small holes (one ~3.5 KB sample) are read through, a few
        # requests a shard instead of one a sample
        srv.reset()
        even = View.from_positions(remote, range(0, m.num_samples, 2))
        keys = [s["__key__"] for s in WebDataset(even)]
        assert keys == all_keys(m)[::2]
        tar_gets = [p for meth, p, r in srv.requests if meth == "GET" and p.endswith(".tar")]
        assert len(tar_gets) <= 2 * len(COUNTS), tar_gets


@pytest.mark.parametrize("aligned", [True, False])
def test_views_of_compressed_shards(tmp_path, aligned):
    """Sample-aligned gzip shards: each kept sample read and decompressed alone; one-stream
    gzip shards: read from the start, the kept rows picked out."""
    from tarshards import ShardWriter

    with ShardWriter(
        str(tmp_path / "z-%04d.tgz"),
        maxcount=15,
        manifest=str(tmp_path / "z.json"),
        aligned=aligned,
    ) as w:
        for i in range(40):
            w.write({"__key__": f"k{i:04d}", "txt": f"t{i}", "bin": bytes([i]) * 300})
    m = Manifest.load(tmp_path / "z.json")
    view = View.from_positions(m, [0, 3, 14, 15, 29, 39])
    assert (ShardTable.from_view(view).seek_points(0) is not None) == aligned
    want = [f"k{i:04d}" for i in (0, 3, 14, 15, 29, 39)]
    assert [s["__key__"] for s in WebDataset(view)] == want
    got = [s for s in WebDataset(view)]
    assert got[2]["bin"] == bytes([14]) * 300
    planned = WebDataset(view, readers=2, remainder="pad", shardshuffle=False).shuffle(2).batched(2)
    keys = [k for b in planned for k, p in zip(b["__key__"], b["__pad__"]) if not p]
    assert sorted(keys) == want
    check_resume(
        lambda: WebDataset(view, readers=2, remainder="pad", seed=2).shuffle(2).batched(1),
        epochs=1,
        cuts=[(0, 1), (0, 3)],
    )


def test_resampled_view_draws_only_its_samples(data):
    _d, m = data
    view = View.from_positions(m, [5, 6, 70])
    ds = WebDataset(view, resampled=True)
    it = iter(ds)
    keys = {next(it)["__key__"] for _ in range(30)}
    assert keys <= {"k0005", "k0006", "k0070"} and len(keys) >= 2


def test_a_views_metadata_columns_are_its_rows(tmp_path):
    from tarshards import ShardWriter

    with ShardWriter(
        str(tmp_path / "t-%04d.tar"),
        maxcount=7,
        manifest=str(tmp_path / "t.json"),
        meta={"tokens": lambda s: len(s["txt"])},
    ) as w:
        for i in range(20):
            w.write({"__key__": f"k{i:04d}", "txt": "w" * i})
    m = Manifest.load(tmp_path / "t.json")
    view = View.from_positions(m, [2, 9, 10, 19])
    assert view.meta_columns() == ["tokens"]
    assert view.meta("tokens").tolist() == [2.0, 9.0, 10.0, 19.0]
    assert View(m).meta("tokens").tolist() == [float(i) for i in range(20)]
