"""map_shards and index building on the cluster engines: a real dask.distributed LocalCluster
with 2 worker processes, and a local Ray of 2 CPUs (each test runs on both; one Ray for the
module, as it is slow to start, and one more started on demand by the first test)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import threading

import pytest
from click.testing import CliRunner
from conftest import ShardOpener, make_samples, write_shards

from tarshards import shard_samples
from tarshards.errors import TarshardsWarning
from tarshards.format.manifest import Manifest, build_manifest
from tarshards.parallel import map_shards

PER_SHARD = 10


def plus_100(sample):
    return {
        "__key__": sample["__key__"],
        "cls": str(int(sample["cls"]) + 100).encode(),
        "json": sample["json"],
    }


def fail_in_shard_3(sample):
    if sample["__key__"] == "sample000035":
        raise ValueError("bad sample")
    return plus_100(sample)


def die_once(sample, marker):
    """Kill this worker process mid-shard, once: the marker file is made first."""
    if sample["__key__"].endswith("5") and not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(9)
    return plus_100(sample)


def expected(samples):
    return {s["__key__"]: str(int(s["cls"]) + 100).encode() for s in samples}


def read_all(paths):
    out = {}
    for p in paths:
        for s in shard_samples(p):
            assert s["__key__"] not in out, f"duplicate sample {s['__key__']}"
            out[s["__key__"]] = s["cls"]
    return out


@pytest.fixture(scope="module")
def cluster():
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        dashboard_address=None,
        silence_logs=50,
        scheduler_kwargs={"dashboard_address": "127.0.0.1:0"},
    ) as c:
        yield c


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    from tarshards.parallel.engines import local_ray_env

    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        logging_level=logging.ERROR,
        runtime_env=local_ray_env(),  # the workers import the tests' modules (as ours do)
    )
    yield ray
    ray.shutdown()


ENGINES = ["dask", "ray"]


def needs(engine):
    pytest.importorskip("distributed" if engine == "dask" else "ray")


@pytest.fixture(params=ENGINES)
def on_cluster(request):
    """The keywords that run a job on the module's cluster of that engine."""
    if request.param == "dask":
        return {"engine": "dask", "address": request.getfixturevalue("cluster").scheduler_address}
    request.getfixturevalue("ray_local")  # connected: the engine uses it
    return {"engine": "ray"}


@pytest.mark.parametrize("engine", ENGINES)
def test_local_cluster_started_for_8_shards(tmp_path, engine):
    needs(engine)
    if engine == "ray":
        import ray

        if ray.is_initialized():  # another module's tests left one: this one is for the test
            pytest.skip("a Ray connection is already open")
    _paths, samples = write_shards(tmp_path, 8, PER_SHARD)
    outs = str(tmp_path / "out-{0..7}.tar")
    reports = map_shards(
        plus_100, str(tmp_path / "shard-{0000..0007}.tar"), outs, engine=engine, workers=2
    )
    assert [r.status for r in reports] == ["done"] * 8
    assert [(r.samples_in, r.samples_out) for r in reports] == [(PER_SHARD, PER_SHARD)] * 8
    got = read_all([str(tmp_path / f"out-{i}.tar") for i in range(8)])
    assert got == expected(samples)  # every sample once, fn applied, none missing
    if engine == "ray":
        import ray

        assert not ray.is_initialized()  # the Ray it started is stopped again


def test_worker_killed_mid_shard(tmp_path, on_cluster):
    paths, samples = write_shards(tmp_path, 8, PER_SHARD)
    outs = [str(tmp_path / f"out-{i}.tar") for i in range(8)]
    fn = functools.partial(die_once, marker=str(tmp_path / "marker"))
    seen_partial = []
    stop = threading.Event()

    def watch():  # a final name must only ever hold a complete shard
        while not stop.is_set():
            for o in outs:
                if os.path.exists(o):
                    n = sum(1 for _ in shard_samples(o))
                    if n != PER_SHARD:
                        seen_partial.append((o, n))
            stop.wait(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        reports = map_shards(fn, paths, outs, **on_cluster)
    finally:
        stop.set()
        watcher.join()
    assert os.path.exists(tmp_path / "marker")  # a worker did die
    assert [r.status for r in reports] == ["done"] * 8
    assert seen_partial == []
    assert read_all(outs) == expected(samples)
    assert [n for n in os.listdir(tmp_path) if n.endswith(".tmp")] == []


def test_rerun_after_failure_does_only_the_rest(tmp_path, on_cluster):
    paths, samples = write_shards(tmp_path, 8, PER_SHARD)
    outs = str(tmp_path / "out-{0..7}.tar")
    with pytest.warns(TarshardsWarning, match="1 of 8 shards failed"):
        reports = map_shards(fail_in_shard_3, paths, outs, **on_cluster)
    assert [r.status for r in reports].count("done") == 7
    assert reports[3].status == "failed" and "sample000035" in reports[3].error
    assert not os.path.exists(tmp_path / "out-3.tar")
    with pytest.warns(TarshardsWarning, match="7 of 8 outputs exist already and were kept"):
        reports = map_shards(plus_100, paths, outs, **on_cluster)
    assert [r.status for r in reports] == ["skipped"] * 3 + ["done"] + ["skipped"] * 4
    assert read_all([str(tmp_path / f"out-{i}.tar") for i in range(8)]) == expected(samples)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ENGINES)
def test_function_workers_cannot_import_fails_instead_of_hanging(
    tmp_path, monkeypatch, engine, request
):
    """A function from a module only the client can import: each shard fails with a clear
    error (before, the worker's connection broke and the job waited forever)."""
    import importlib
    import sys
    import warnings

    needs(engine)
    if engine == "ray":
        request.getfixturevalue("ray_local")
    moddir = tmp_path / "clientonly"
    moddir.mkdir()
    (moddir / "client_only_mod.py").write_text("def fn(sample):\n    return sample\n")
    sys.path.insert(0, str(moddir))
    try:
        mod = importlib.import_module("client_only_mod")
    finally:
        sys.path.remove(str(moddir))
    monkeypatch.setitem(sys.modules, "client_only_mod", mod)
    paths, _ = write_shards(tmp_path, 2, 3)
    outs = [str(tmp_path / f"out-{i}.tar") for i in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TarshardsWarning)
        reports = map_shards(mod.fn, paths, outs, engine=engine, workers=1, retries=0)
    assert [r.status for r in reports] == ["failed", "failed"]
    where = "Dask" if engine == "dask" else "Ray"
    assert all(
        f"could not be loaded on the {where} worker" in r.error and "client_only_mod" in r.error
        for r in reports
    ), [r.error for r in reports]
    assert not any(os.path.exists(o) for o in outs)


def test_same_job_twice_on_one_client(tmp_path, on_cluster):
    """Back-to-back jobs with the same function on one client (as a notebook does)."""
    paths, samples = write_shards(tmp_path, 4, PER_SHARD)
    where = dict(on_cluster)
    with contextlib.ExitStack() as stack:
        if where["engine"] == "dask":
            import distributed

            where["client"] = stack.enter_context(distributed.Client(where.pop("address")))
        for run in range(3):
            outs = [str(tmp_path / f"run{run}-{i}.tar") for i in range(4)]
            reports = map_shards(plus_100, paths, outs, **where)
            assert [r.status for r in reports] == ["done"] * 4, [r.error for r in reports]
            assert read_all(outs) == expected(samples)


# ---------------------------------------------------------------------------------------------
# index building on the cluster: the local index byte for byte, a dead worker, reruns
# ---------------------------------------------------------------------------------------------


def _index_files(d) -> dict:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.suffix in (".json", ".tsidx")}


@pytest.fixture(scope="module")
def indexed_locally(tmp_path_factory):
    """6 shards and their manifest and indexes made on this machine."""
    d = tmp_path_factory.mktemp("local")
    paths, _ = write_shards(d, 6, PER_SHARD)
    build_manifest(paths, d / "m.json", workers=1)
    return d, _index_files(d)


def _copy_shards(src, dst):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.json", "*.tsidx"))
    return sorted(str(p) for p in dst.glob("shard-*.tar"))


def test_cluster_index_equals_local_index(tmp_path, on_cluster, indexed_locally):
    src, want = indexed_locally
    d = tmp_path / "c"
    paths = _copy_shards(src, d)
    args = ["index", "-q", *paths, "-o", str(d / "m.json"), "--engine", on_cluster["engine"]]
    if "address" in on_cluster:
        args += ["--address", on_cluster["address"]]
    from tarshards.cli.main import group

    res = CliRunner().invoke(group, args)
    assert res.exit_code == 0, res.output
    assert _index_files(d) == want  # manifest and every index, byte for byte


def test_cluster_index_worker_killed_is_retried_and_rerun_reads_only_the_rest(
    tmp_path, on_cluster, indexed_locally
):
    src, want = indexed_locally
    d = tmp_path / "c"
    paths = _copy_shards(src, d)
    opener = ShardOpener(tmp_path / "log", die="shard-0003.tar")
    m = build_manifest(paths, d / "m.json", opener=opener, **on_cluster)
    assert os.path.exists(opener.marker)  # the worker reading shard 3 died part way
    assert opener.opened().count("shard-0003.tar") == 2
    assert _index_files(d) == want and m == Manifest.load(src / "m.json")
    assert not [n for n in os.listdir(d) if ".tmp" in n]
    # a rerun after two indexes were lost reads those two shards only
    os.remove(d / "shard-0001.tar.tsidx")
    os.remove(d / "shard-0004.tar.tsidx")
    opener.clear()
    build_manifest(paths, d / "m.json", opener=opener, **on_cluster)
    assert opener.opened() == ["shard-0001.tar", "shard-0004.tar"]
    assert _index_files(d) == want


# ---------------------------------------------------------------------------------------------
# conversion and the key table on Ray (the module's Ray): the processes engine's output, byte
# for byte
# ---------------------------------------------------------------------------------------------


def _tree(d) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def caption_words(sample):
    return len(bytes(sample["txt"]).split())


def test_convert_on_ray_equals_processes(tmp_path, ray_local):
    import tarshards
    from tarshards.cli.main import group

    src = tmp_path / "src"
    src.mkdir()
    for s in make_samples(23):
        (src / f"{s['__key__']}.jpg").write_bytes(s["jpg"])
        (src / f"{s['__key__']}.txt").write_bytes(b"w " * (int(s["cls"]) + 1))
    out = tmp_path / "out"  # each run writes here (the plan names its output), then moves
    kw = dict(maxcount=5, compress="zst", aligned=True)
    meta = [{"words": caption_words}, tarshards.media_meta()]
    want = tarshards.convert(src, out, engine="processes", workers=2, meta=meta, **kw)
    out.rename(tmp_path / "p")
    got = tarshards.convert(src, out, engine="ray", workers=2, meta=meta, **kw)
    assert len(want.shards) == 5 and want.meta("words")[:3].tolist() == [1.0, 2.0, 3.0]
    assert got.meta("jpg.width").tolist() == [32.0] * 23
    assert _tree(out) == _tree(tmp_path / "p")  # shards, indexes, manifest and plan
    kept = os.stat(out / "shard-000000.tar.zst").st_ino
    for name in ("shard-000002.tar.zst", "shard-000004.tar.zst.tsidx", "manifest.json"):
        os.remove(out / name)  # as if killed: a rerun on Ray writes only what is missing
    tarshards.convert(src, out, engine="ray", workers=2, meta=meta, **kw)
    assert _tree(out) == _tree(tmp_path / "p")
    assert os.stat(out / "shard-000000.tar.zst").st_ino == kept
    shutil.rmtree(out)
    args = ["convert", "-q", str(src), "-o", str(out), "-c", "5", "-z", "zst", "--aligned"]
    res = CliRunner().invoke(group, [*args, "--media", "--engine", "ray", "-p", "2"])
    assert res.exit_code == 0, res.output
    out.rename(tmp_path / "c")
    tarshards.convert(src, out, workers=2, meta=tarshards.media_meta(), **kw)
    assert _tree(out) == _tree(tmp_path / "c")
    assert Manifest.load(str(out / "manifest.json")).meta_columns() == ["jpg.height", "jpg.width"]


def test_keyindex_on_ray_equals_processes(tmp_path, ray_local, indexed_locally):
    from tarshards import KeyIndex

    src, _ = indexed_locally
    kw = dict(workers=2, group_keys=PER_SHARD * 2)  # 3 groups of 2 shards: 3 tasks
    want = KeyIndex.build(src / "m.json", tmp_path / "p.keys", engine="processes", **kw)
    got = KeyIndex.build(src / "m.json", tmp_path / "r.keys", engine="ray", **kw)
    assert len(got) == len(want) == 6 * PER_SHARD
    assert _tree(tmp_path / "r.keys") == _tree(tmp_path / "p.keys")
    assert got.locate("sample000037") == (3, 7)


def caption_of(sample):
    """add_columns' function (module level: the cluster's workers import it)."""
    return {"txt": f"caption of {sample['__key__']}"}


def test_add_columns_on_a_cluster_equals_processes(tmp_path, on_cluster, indexed_locally):
    """Sidecar columns (issue 37) made one task a shard on the cluster: the same shards."""
    import tarshards

    src, _ = indexed_locally
    want = tarshards.add_columns(
        src / "m.json", caption_of, output=str(tmp_path / "p" / "m.json"), workers=2
    )
    got = tarshards.add_columns(
        src / "m.json", caption_of, output=str(tmp_path / "c" / "m.json"), **on_cluster
    )
    assert [r.hash for r in got.columns[0].shards] == [r.hash for r in want.columns[0].shards]
    assert got.fingerprint == want.fingerprint and got.num_samples == 6 * PER_SHARD
