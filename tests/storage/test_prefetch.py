"""Reading shards ahead: same bytes, same samples, same errors, bounded memory, no leftover
threads."""

from __future__ import annotations

import os
import threading
import time
import warnings
from pathlib import Path

import pytest
from conftest import load_servers, write_shards

from tarshards import StorageError, TarshardsWarning, TarWriter, WebDataset
from tarshards.pipeline.dataset import iter_samples
from tarshards.pipeline.stages import warn_and_continue
from tarshards.storage import ShardPrefetcher, open_url

pytestmark = pytest.mark.timeout(120)


def _prefetch_threads():
    return [t for t in threading.enumerate() if t.name.startswith("tarshards-prefetch")]


def _wait_no_threads(timeout=10.0):
    deadline = time.monotonic() + timeout
    while _prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    return _prefetch_threads()


@pytest.mark.parametrize("ahead", [0, 1, 3])
@pytest.mark.parametrize("read_size", [1, 511, 4096, 1 << 20])
def test_streams_give_the_bytes_of_each_shard_in_order(tmp_path, ahead, read_size):
    files = []
    for i in range(4):
        path = tmp_path / f"f{i}.bin"
        path.write_bytes(os.urandom(50_000 + 7919 * i))
        files.append(str(path))
    # a tiny buffer limit and chunk make the filler wait for the reader again and again
    prefetcher = ShardPrefetcher(open_url, ahead=ahead, max_bytes=8192, chunk=1000)
    got = []
    with prefetcher:
        for url, stream in prefetcher.streams(files):
            parts = []
            while True:
                data = stream.read(read_size)
                if not data:
                    break
                parts.append(data)
            got.append((url, b"".join(parts)))
    assert got == [(f, Path(f).read_bytes()) for f in files]
    assert not _wait_no_threads()


def test_samples_equal_without_prefetch(tmp_path):
    paths, samples = write_shards(tmp_path, 5, 7)
    plain = list(iter_samples(paths))
    ahead = list(iter_samples(paths, prefetch=2, prefetch_bytes=64 << 10))
    assert [s["__key__"] for s in ahead] == [s["__key__"] for s in samples]
    assert [{k: v for k, v in s.items()} for s in ahead] == plain


def test_an_error_is_raised_where_the_shard_fails(tmp_path):
    paths, _ = write_shards(tmp_path, 3, 4)
    missing = str(tmp_path / "missing.tar")
    urls = [paths[0], missing, paths[1], paths[2]]
    with pytest.raises(StorageError) as direct:
        list(iter_samples(urls))
    seen = []
    with pytest.raises(StorageError) as ahead:
        for s in iter_samples(urls, prefetch=2):
            seen.append(s["__key__"])
    assert len(seen) == 4  # the first shard, then the error
    assert type(ahead.value) is type(direct.value)
    assert ahead.value.url == missing == direct.value.url
    assert not _wait_no_threads()


def test_a_continuing_handler_skips_the_bad_shard_only(tmp_path):
    paths, _ = write_shards(tmp_path, 3, 4)
    truncated = tmp_path / "cut.tar"
    # cut inside the second sample's data (a cut inside the first sample's padding also raises
    # now, and the first sample would be lost with the shard)
    truncated.write_bytes(Path(paths[0]).read_bytes()[:5000])
    urls = [paths[0], str(truncated), paths[1], paths[2]]
    with warnings.catch_warnings(record=True) as w1:
        warnings.simplefilter("always")
        plain = [s["__key__"] for s in iter_samples(urls, handler=warn_and_continue)]
    with warnings.catch_warnings(record=True) as w2:
        warnings.simplefilter("always")
        ahead = [s["__key__"] for s in iter_samples(urls, handler=warn_and_continue, prefetch=3)]
    assert ahead == plain and len(plain) > 12
    assert [str(w.message) for w in w1 if w.category is TarshardsWarning] == [
        str(w.message) for w in w2 if w.category is TarshardsWarning
    ]


def test_stopping_early_stops_the_threads(tmp_path):
    paths = []
    for i in range(6):  # shards larger than a buffer's share: their fillers must wait
        paths.append(str(tmp_path / f"big-{i}.tar"))
        with TarWriter(paths[-1]) as w:
            for j in range(3):
                w.write({"__key__": f"k{i}_{j}", "bin": os.urandom(1 << 20)})
    it = iter_samples(paths, prefetch=3, prefetch_bytes=4 << 20)
    next(it)
    assert _prefetch_threads()  # shards ahead are being read
    it.close()
    assert not _wait_no_threads()


def test_buffers_stay_within_their_bound(tmp_path):
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(8 << 20))
    prefetcher = ShardPrefetcher(open_url, ahead=1, max_bytes=2 << 20, chunk=64 << 10)
    with prefetcher:
        streams = prefetcher.streams([str(big), str(big)])
        _url, first = next(streams)
        first.read(10)
        time.sleep(0.3)  # give both fillers time to run ahead as far as they may
        window = list(prefetcher._window)
        assert len(window) == 2
        for stream in window:
            # each buffer holds at most its share of max_bytes (plus one chunk in flight)
            assert stream._buffered <= (2 << 20) // 2 + (64 << 10)
        streams.close()
    assert not _wait_no_threads()


def test_webdataset_prefetches_remote_shards_only(tmp_path):
    pytest.importorskip("aiohttp", reason="http:// needs aiohttp (tarshards[http])")
    paths, samples = write_shards(tmp_path, 4, 5)
    assert WebDataset(paths).prefetch == 0
    servers = load_servers()
    with servers.HTTPFileServer(tmp_path) as srv:
        urls = [f"{srv.url}/{os.path.basename(p)}" for p in paths]
        ds = WebDataset(urls)
        assert ds.prefetch == 2
        keys = [s["__key__"] for s in ds]
        assert keys == [s["__key__"] for s in samples]
        assert srv.gets() == 4  # one GET per shard, none wasted
        off = WebDataset(urls, prefetch=0)
        assert [s["__key__"] for s in off] == keys
    assert not _wait_no_threads()


def test_shards_ahead_are_requested_while_the_first_is_read(tmp_path):
    """While the consumer holds the first sample, the next ``ahead`` shards are already being
    fetched (the server has their GETs), and never more than that."""
    pytest.importorskip("aiohttp", reason="http:// needs aiohttp (tarshards[http])")
    paths, _ = write_shards(tmp_path, 6, 3)
    servers = load_servers()
    with servers.HTTPFileServer(tmp_path) as srv:
        urls = [f"{srv.url}/{os.path.basename(p)}" for p in paths]
        it = iter_samples(urls, prefetch=2)
        next(it)
        deadline = time.monotonic() + 10
        while srv.gets() < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert srv.gets() == 3  # the current shard and two ahead: bounded connections
        rest = list(it)
        assert len(rest) == 17 and srv.gets() == 6
    assert not _wait_no_threads()
