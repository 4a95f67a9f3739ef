"""The hang watchdog (``WebLoader(..., watchdog=SECONDS)``) against a real HTTP server that
stalls one shard mid-way: the report names the shard and the byte offset, the read is retried
from there, and the epoch completes with every sample once."""

from __future__ import annotations

import gc
import os
import warnings

import pytest
from conftest import load_servers, write_shards

torch = pytest.importorskip("torch")
pytest.importorskip("aiohttp")

from tarshards.errors import StallError, StallWarning, TarshardsWarning  # noqa: E402
from tarshards.torch.adapter import WebDataset, WebLoader  # noqa: E402

servers = load_servers()
STALL_AT = 50_000  # bytes into shard 2 (of about 100 kB)


@pytest.fixture
def stalling(tmp_path):
    paths, samples = write_shards(tmp_path, 4, 25)
    stalled = "/" + os.path.basename(paths[2])
    with servers.HTTPFileServer(tmp_path, stall={stalled: STALL_AT}) as srv:
        urls = [f"{srv.url}/{os.path.basename(p)}" for p in paths]
        yield srv, urls, sorted(s["__key__"] for s in samples)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stalled_shard_is_reported_and_retried(stalling, num_workers):
    srv, urls, keys = stalling
    ds = WebDataset(urls).to_tuple("__key__").batched(10)
    loader = WebLoader(ds, batch_size=None, num_workers=num_workers, stats=True, watchdog=1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [k for batch in loader for k in batch[0]]
    assert sorted(got) == keys  # every sample once
    assert srv.stalled == [(urlpath(urls[2]), STALL_AT)]
    assert issubclass(StallWarning, TarshardsWarning)
    # (on a loaded machine another read may time out too: the stall made is among the reports)
    reports = [str(w.message) for w in caught if issubclass(w.category, StallWarning)]
    text = next(t for t in reports if urls[2] in t and f"offset {STALL_AT}" in t)
    assert "rank 0" in text and ("main process" if num_workers == 0 else "worker ") in text
    st = loader.stats()
    assert st.stalls >= 1 and st.retries >= 1
    (record,) = [r for r in st.stall_log if r[2] == urls[2] and r[3] == STALL_AT]
    rank, worker, _url, _offset, seconds, _where = record
    assert (rank, seconds) == (0, 1.0)
    assert worker is None if num_workers == 0 else worker in (0, 1)


def test_stalled_run_of_a_planned_pipeline(tmp_path):
    """readers=V: the plan's runs are read through the same watched reads."""
    paths, samples = write_shards(tmp_path, 4, 25)
    with servers.HTTPFileServer(tmp_path) as srv:
        urls = [f"{srv.url}/{os.path.basename(p)}" for p in paths]
        ds = WebDataset(urls, readers=4).to_tuple("__key__").batched(5)
        ds.table  # noqa: B018  (the shards are scanned before the stall is switched on)
        srv.stall["/" + os.path.basename(paths[1])] = STALL_AT
        loader = WebLoader(ds, batch_size=None, watchdog=1.0, stats=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = [k for batch in loader for k in batch[0]]
    assert sorted(got) == sorted(s["__key__"] for s in samples)
    assert srv.stalled == [(urlpath(urls[1]), STALL_AT)]
    reports = [str(w.message) for w in caught if issubclass(w.category, StallWarning)]
    assert any(urls[1] in t and f"offset {STALL_AT}" in t for t in reports)
    assert loader.stats().bytes == sum(os.path.getsize(p) for p in paths)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_on_stall_raise(stalling, num_workers):
    _srv, urls, _ = stalling
    ds = WebDataset(urls).to_tuple("__key__").batched(10)
    loader = WebLoader(ds, batch_size=None, num_workers=num_workers, watchdog=1.0, on_stall="raise")
    it = iter(loader)
    with pytest.raises(StallError) as info:
        for _ in it:
            pass
    err = info.value
    # the workers go now (a DataLoader iterator collected later, from whatever thread the
    # collector runs in, stops its workers there: in fsspec's event loop it stalls the next
    # test's reads for the workers' join timeout)
    it.close()
    del it, loader, info
    gc.collect()
    assert isinstance(err, TimeoutError)
    if num_workers == 0:
        assert (err.url, err.offset, err.rank, err.worker) == (urls[2], STALL_AT, 0, None)
    else:  # re-raised by DataLoader from the worker's message
        assert urls[2] in str(err) and f"offset {STALL_AT}" in str(err) and "worker 0" in str(err)


def test_on_stall_function(stalling):
    _srv, urls, keys = stalling
    seen = []
    ds = WebDataset(urls).to_tuple("__key__").batched(10)
    loader = WebLoader(ds, batch_size=None, watchdog=1.0, on_stall=seen.append)
    assert sorted(k for batch in loader for k in batch[0]) == keys
    assert (urls[2], STALL_AT) in [(e.url, e.offset) for e in seen]


def test_watchdog_thread_reports_a_hung_stage(tmp_path):
    """No storage read is stuck, a stage is: the watchdog's thread reports the shard reached."""
    import time

    paths, _ = write_shards(tmp_path, 1, 4)

    def slow(sample):
        if sample["__key__"].endswith("2"):
            time.sleep(1.5)
        return sample

    ds = WebDataset(paths).map(slow).to_tuple("__key__")
    loader = WebLoader(ds, batch_size=2, watchdog=0.5, stats=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert sum(len(b[0]) for b in loader) == 4
    reports = [str(w.message) for w in caught if issubclass(w.category, StallWarning)]
    assert reports and paths[0] in reports[0] and "no sample or read" in reports[0]
    assert loader.stats().stalls >= 1


def urlpath(url: str) -> str:
    return "/" + url.rsplit("/", 1)[1]
