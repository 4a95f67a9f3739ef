"""The shard cache, against a real HTTP server on 127.0.0.1 (tests/integration/servers.py)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest
from conftest import load_servers, make_samples, write_shards

from tarshards import WebDataset
from tarshards.pipeline.dataset import shard_samples
from tarshards.storage.cache import ShardCache, cache_name, looks_like_shard

servers = load_servers()


def _needs_http():
    pytest.importorskip("aiohttp", reason="http:// needs aiohttp (pip install 'tarshards[http]')")


@pytest.fixture
def served(tmp_path):
    """3 shards x 30 samples served over HTTP: (server, urls, samples, sizes)."""
    _needs_http()
    root = tmp_path / "www"
    root.mkdir()
    paths, samples = write_shards(root, 3, 30)
    with servers.HTTPFileServer(root) as srv:
        urls = [f"{srv.url}/{os.path.basename(p)}" for p in paths]
        yield srv, urls, samples, [os.path.getsize(p) for p in paths]


def _path(url):
    return "/" + url.split("/", 3)[3]


def _keys(samples):
    return [s["__key__"] for s in samples]


def test_second_epoch_reads_from_the_cache(served, tmp_path):
    srv, urls, samples, sizes = served
    cache = tmp_path / "cache"
    for _ in range(2):
        got = list(WebDataset(urls, shardshuffle=False, cache_dir=str(cache)))
        assert _keys(got) == _keys(samples)
        assert all(a["jpg"] == b["jpg"] for a, b in zip(got, samples))
    assert all(srv.gets(_path(u)) == 1 for u in urls)
    c = ShardCache(cache)
    assert sorted(os.path.getsize(p) for p, _, _ in c.entries()) == sorted(sizes)
    assert not [n for n in os.listdir(cache) if n.endswith(".part")]


_READER = r"""
import json, os, sys, time
from tarshards import WebDataset
urls, cache, go = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
while not os.path.exists(go):
    time.sleep(0.005)
print(json.dumps([s["__key__"] for s in WebDataset(urls, shardshuffle=False, cache_dir=cache)]))
"""


def test_four_processes_download_each_shard_once(tmp_path):
    _needs_http()
    root = tmp_path / "www"
    root.mkdir()
    paths, samples = write_shards(root, 3, 30)
    cache, go = str(tmp_path / "cache"), str(tmp_path / "go")
    # a slow server, so that the four readers want the same shard at the same time
    with servers.HTTPFileServer(root, delay=0.02, chunk=16 << 10) as srv:
        urls = [f"{srv.url}/{os.path.basename(p)}" for p in paths]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _READER, json.dumps(urls), cache, go],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(4)
        ]
        time.sleep(0.5)  # let them import
        open(go, "w").close()
        outs = [p.communicate(timeout=120) for p in procs]
        counts = srv.get_counts()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert json.loads(out) == _keys(samples)
    assert {_path(u): counts[_path(u)] for u in urls} == {_path(u): 1 for u in urls}
    assert len(ShardCache(cache).entries()) == 3


def test_lru_eviction_beyond_the_limit(served, tmp_path):
    srv, urls, samples, sizes = served
    a, b, c = urls
    cache = ShardCache(tmp_path / "cache", max_bytes=max(sizes) * 2 + min(sizes) // 2)

    def read(url):
        return _keys(shard_samples(url, opener=cache.open))

    read(a)
    read(b)
    assert read(a) == _keys(samples[:30])  # a hit: a becomes the most recently used
    assert srv.gets(_path(a)) == 1
    read(c)  # three shards do not fit: b, the least recently used, goes
    assert sorted(os.path.basename(p) for p, _, _ in cache.entries()) == sorted(
        cache_name(u) for u in (a, c)
    )
    assert cache.size() <= cache.max_bytes
    assert read(b) == _keys(samples[30:60])
    assert srv.gets(_path(b)) == 2 and srv.gets(_path(c)) == 1
    assert sorted(os.path.basename(p) for p, _, _ in cache.entries()) == sorted(
        cache_name(u) for u in (c, b)
    )


def test_a_download_takes_its_last_use_from_the_clock_hits_use(served, tmp_path, monkeypatch):
    """A new entry's last use is set from ``time.time_ns()``, as a hit's is: the file system's
    own write time comes from a coarser clock (seen here up to 0.2 ms behind), which made a
    shard fetched just after another's hit look older than it, and evicted first."""
    import types

    from tarshards.storage import cache as cache_mod

    _, urls, _, _ = served
    cache = ShardCache(tmp_path / "cache")
    later = time.time_ns() + 3_600 * 10**9  # an hour ahead: no write time can be that
    clock = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if k[0] != "_"})
    clock.time_ns = lambda: later
    monkeypatch.setattr(cache_mod, "time", clock)
    _keys(shard_samples(urls[0], opener=cache.open))
    [(_, _, used)] = cache.entries()
    assert used == later


def test_samples_stream_while_the_shard_is_cached(served, tmp_path):
    srv, urls, samples, _ = served
    cache = ShardCache(tmp_path / "cache")
    final = cache.path_for(urls[0])
    it = shard_samples(urls[0], opener=cache.open, chunk_size=8192)
    first = next(it)
    assert first["__key__"] == samples[0]["__key__"]
    assert os.path.exists(final + ".part") and not os.path.exists(final)
    rest = list(it)
    assert len(rest) == 29
    assert os.path.exists(final) and not os.path.exists(final + ".part")
    with (
        open(final, "rb") as f,
        open(os.path.join(os.path.dirname(srv.root), "www", "shard-0000.tar"), "rb") as g,
    ):
        assert f.read() == g.read()


def test_stopping_early_leaves_nothing_behind(served, tmp_path):
    srv, urls, _, _ = served
    cache = ShardCache(tmp_path / "cache")
    it = shard_samples(urls[1], opener=cache.open, chunk_size=8192)
    next(it)
    it.close()
    assert cache.entries() == []
    assert not [n for n in os.listdir(cache.cache_dir) if n.endswith(".part")]
    assert len(list(shard_samples(urls[1], opener=cache.open))) == 30
    assert srv.gets(_path(urls[1])) == 2
    assert len(cache.entries()) == 1


def test_local_paths_bypass_the_cache(tmp_path):
    paths, samples = write_shards(tmp_path, 1, 5)
    cache = ShardCache(tmp_path / "cache")
    assert _keys(shard_samples(paths[0], opener=cache.open)) == _keys(samples)
    assert cache.entries() == []


def test_a_file_that_is_not_a_shard_is_not_cached(tmp_path, caplog):
    _needs_http()
    root = tmp_path / "www"
    root.mkdir()
    (root / "notes.tar").write_bytes(b"these are not the shards you are looking for\n" * 40)
    with servers.HTTPFileServer(root) as srv:
        cache = ShardCache(tmp_path / "cache")
        with caplog.at_level(logging.WARNING, logger="tarshards.storage.cache"):
            with cache.open(f"{srv.url}/notes.tar") as f:
                assert f.read(10) == b"these are "
                while f.read(1 << 16):
                    pass
    assert cache.entries() == []
    assert any("not a tar" in r.getMessage() for r in caplog.records)


def test_fetch_returns_the_local_copy(served, tmp_path):
    srv, urls, _, sizes = served
    cache = ShardCache(tmp_path / "cache")
    path = cache.fetch(urls[2])
    assert os.path.getsize(path) == sizes[2]
    assert cache.fetch(urls[2]) == path
    assert srv.gets(_path(urls[2])) == 1
    with pytest.raises(ValueError):
        cache.fetch(str(tmp_path / "local.tar"))


def test_cache_names_hash_the_whole_url():
    a = cache_name("https://one.example/data/train-0001.tar")
    b = cache_name("https://two.example/data/train-0001.tar")
    assert a != b and a.endswith("-train-0001.tar") and b.endswith("-train-0001.tar")
    assert cache_name("s3://b/x/y.tgz?versionId=3").endswith("-y.tgz")
    assert "/" not in cache_name("http://h/a b/c%20d.tar")


def test_looks_like_shard():
    import io

    from tarshards import TarWriter

    buf = io.BytesIO()
    with TarWriter(buf) as w:
        w.write(make_samples(1)[0])
    assert looks_like_shard(buf.getvalue()[:512])
    assert looks_like_shard(b"\x1f\x8b\x08\x00")
    assert looks_like_shard(b"\x28\xb5\x2f\xfd\x00")
    assert looks_like_shard(b"\0" * 512)
    assert not looks_like_shard(b"<html>" + b" " * 600)


def test_cache_sizes(tmp_path):
    """max_bytes= reads sizes with tarshards.format.names.parse_size: GB decimal, GiB binary."""
    sizes = {
        None: None,
        1000: 1000,
        1.5e3: 1500,
        "500M": 500 * 10**6,
        "20GB": 20 * 10**9,
        "1.5 GiB": int(1.5 * (1 << 30)),
        0: 0,
    }
    for given, expected in sizes.items():
        assert ShardCache(tmp_path / "cache", max_bytes=given).max_bytes == expected
    with pytest.raises(ValueError):
        ShardCache(tmp_path / "cache", max_bytes="lots")
    with pytest.raises(ValueError):
        ShardCache(tmp_path / "cache", max_bytes=-1)
    with pytest.raises(TypeError):
        ShardCache(tmp_path / "cache", max_bytes=True)
