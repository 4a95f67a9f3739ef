"""map_shards on a real dask.distributed LocalCluster with 2 worker processes."""

from __future__ import annotations

import functools
import os
import threading

import pytest

distributed = pytest.importorskip("distributed")

from conftest import write_shards  # noqa: E402

from tarshards import shard_samples  # noqa: E402
from tarshards.errors import TarshardsWarning  # noqa: E402
from tarshards.parallel import map_shards  # noqa: E402

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


def test_dask_local_cluster_8_shards(tmp_path):
    paths, samples = write_shards(tmp_path, 8, PER_SHARD)
    outs = str(tmp_path / "out-{0..7}.tar")
    reports = map_shards(
        plus_100, str(tmp_path / "shard-{0000..0007}.tar"), outs, engine="dask", workers=2
    )
    assert [r.status for r in reports] == ["done"] * 8
    assert [(r.samples_in, r.samples_out) for r in reports] == [(PER_SHARD, PER_SHARD)] * 8
    got = read_all([str(tmp_path / f"out-{i}.tar") for i in range(8)])
    assert got == expected(samples)  # every sample once, fn applied, none missing


def test_dask_worker_killed_mid_shard(tmp_path, cluster):
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
        reports = map_shards(fn, paths, outs, engine="dask", address=cluster.scheduler_address)
    finally:
        stop.set()
        watcher.join()
    assert os.path.exists(tmp_path / "marker")  # a worker did die
    assert [r.status for r in reports] == ["done"] * 8
    assert seen_partial == []
    assert read_all(outs) == expected(samples)
    assert [n for n in os.listdir(tmp_path) if n.endswith(".tmp")] == []


def test_dask_rerun_after_failure_does_only_the_rest(tmp_path, cluster):
    paths, samples = write_shards(tmp_path, 8, PER_SHARD)
    outs = str(tmp_path / "out-{0..7}.tar")
    client = distributed.Client(cluster)
    try:
        with pytest.warns(TarshardsWarning, match="1 of 8 shards failed"):
            reports = map_shards(fail_in_shard_3, paths, outs, engine="dask", client=client)
        assert [r.status for r in reports].count("done") == 7
        assert reports[3].status == "failed" and "sample000035" in reports[3].error
        assert not os.path.exists(tmp_path / "out-3.tar")
        reports = map_shards(plus_100, paths, outs, engine="dask", client=client)
    finally:
        client.close()
    assert [r.status for r in reports] == ["skipped"] * 3 + ["done"] + ["skipped"] * 4
    assert read_all([str(tmp_path / f"out-{i}.tar") for i in range(8)]) == expected(samples)


@pytest.mark.timeout(120)
def test_function_workers_cannot_import_fails_instead_of_hanging(tmp_path, monkeypatch):
    """A function from a module only the client can import: each shard fails with a clear
    error (before, the worker's connection broke and the job waited forever)."""
    import importlib
    import sys
    import warnings

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
        reports = map_shards(mod.fn, paths, outs, engine="dask", workers=1, retries=0)
    assert [r.status for r in reports] == ["failed", "failed"]
    assert all(
        "could not be loaded on the Dask worker" in r.error and "client_only_mod" in r.error
        for r in reports
    )
    assert not any(os.path.exists(o) for o in outs)


def test_same_job_twice_on_one_client(tmp_path, cluster):
    """Back-to-back jobs with the same function on one client (as a notebook does)."""
    paths, samples = write_shards(tmp_path, 4, PER_SHARD)
    with distributed.Client(cluster) as client:
        for run in range(3):
            outs = [str(tmp_path / f"run{run}-{i}.tar") for i in range(4)]
            reports = map_shards(plus_100, paths, outs, engine="dask", client=client)
            assert [r.status for r in reports] == ["done"] * 4, [r.error for r in reports]
            assert read_all(outs) == expected(samples)
