"""Random access over HTTP (Range requests) and S3 (moto) equals local; the manifest and indexes
are read from the remote place too; the shard cache refuses a download that does not match the
manifest."""

from __future__ import annotations

import importlib.util
import os
import uuid

import pytest

from tarshards import IntegrityError, ShardWriter, WebDataset
from tarshards.format.manifest import Manifest
from tarshards.pipeline.dataset import iter_samples
from tarshards.read.indexed import IndexedDataset
from tarshards.storage import ShardCache

pytestmark = pytest.mark.timeout(180)


def _load_servers():
    spec = importlib.util.spec_from_file_location(
        "tarshards_test_servers_ra", os.path.join(os.path.dirname(__file__), "servers.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


servers = _load_servers()


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    pytest.importorskip("aiohttp", reason="http:// needs aiohttp (tarshards[http])")
    root = tmp_path_factory.mktemp("ra-http")
    srv = servers.HTTPFileServer(root).start()
    try:
        yield root, srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("s3fs", reason="s3fs is needed for s3:// (pip install tarshards[s3])")
    pytest.importorskip("boto3", reason="boto3 is needed to create the test bucket")
    started = servers.start_moto()
    if started is None:
        pytest.skip("moto[server] is not installed")
    server, endpoint = started
    try:
        servers.make_s3_bucket(endpoint, "random-access")
        yield servers.s3_options(endpoint)
    finally:
        server.stop()


def _samples(n):
    return [
        {"__key__": f"r{i:05d}", "bin": os.urandom(500 + 37 * i), "cls": i % 7} for i in range(n)
    ]


def _write(base: str, suffix=".tar", storage_options=None, n=45, **kw):
    with ShardWriter(
        f"{base}/part-%04d{suffix}",
        maxcount=10,
        manifest=f"{base}/manifest.json",
        storage_options=storage_options,
        **kw,
    ) as w:
        for s in _samples(n):
            w.write(s)
    return w.manifest


@pytest.mark.parametrize("suffix,aligned", [(".tar", False), (".tar.zst", True), (".tgz", True)])
def test_http_random_access_equals_local(http, suffix, aligned):
    root, srv = http
    sub = uuid.uuid4().hex[:8]
    local = _write(str(root / sub), suffix, aligned=aligned)
    url = f"{srv.url}/{sub}/manifest.json"
    remote = Manifest.load(url)
    assert remote == local
    assert remote.shard_urls()[0] == f"{srv.url}/{sub}/part-0000{suffix}"
    want = list(iter_samples(local.shard_urls()))
    ds = IndexedDataset(url)
    srv.reset()
    order = list(range(len(ds)))[::-1]
    got = {i: ds[i] for i in order}
    for i in order:
        w = dict(want[i], __url__=remote.shard_urls()[ds.locate(i)[0]])
        assert got[i] == w
    # one ranged GET per sample (plus the indexes, loaded once), never a whole shard
    shard_gets = [r for m, p, r in srv.requests if m == "GET" and p.endswith(suffix)]
    assert len(shard_gets) == len(ds) and all(r and r.startswith("bytes=") for r in shard_gets)
    assert sum(1 for m, p, _ in srv.requests if p.endswith(".tsidx")) == len(remote)


def test_http_through_the_cache(http, tmp_path):
    root, srv = http
    sub = uuid.uuid4().hex[:8]
    local = _write(str(root / sub))
    url = f"{srv.url}/{sub}/manifest.json"
    ds = IndexedDataset(url, cache_dir=str(tmp_path / "cache"), verify=True)
    want = list(iter_samples(local.shard_urls()))
    for i in (44, 3, 17, 0, 43):
        assert {k: v for k, v in ds[i].items() if k != "__url__"} == {
            k: v for k, v in want[i].items() if k != "__url__"
        }
    assert len(os.listdir(tmp_path / "cache")) == 1 + 3  # .locks and the 3 shards touched


def test_cache_refuses_a_bad_download(http, tmp_path):
    root, srv = http
    sub = uuid.uuid4().hex[:8]
    m = _write(str(root / sub))
    bad = m.shard_urls()[2]
    with open(bad, "r+b") as f:  # the server now serves a shard with one flipped byte
        f.seek(1000)
        b = f.read(1)[0]
        f.seek(1000)
        f.write(bytes([b ^ 4]))
    url = f"{srv.url}/{sub}/manifest.json"
    remote = Manifest.load(url)
    cache = ShardCache(str(tmp_path / "cache"), manifest=remote)
    assert cache.fetch(remote.shard_urls()[0]).endswith("part-0000.tar")
    with pytest.raises(IntegrityError, match="does not match the manifest") as e:
        cache.fetch(remote.shard_urls()[2])
    assert e.value.url == remote.shard_urls()[2]
    assert not os.path.exists(cache.path_for(remote.shard_urls()[2]))
    assert not [p for p in os.listdir(tmp_path / "cache") if p.endswith(".part")]
    ds = WebDataset(url, cache_dir=str(tmp_path / "cache2"), shardshuffle=False)
    with pytest.raises(IntegrityError) as e:
        list(ds)
    assert e.value.url == remote.shard_urls()[2]
    # streaming verification over HTTP names the same shard
    with pytest.raises(IntegrityError) as e:
        list(WebDataset(url, verify=True, shardshuffle=False))
    assert e.value.url == remote.shard_urls()[2]


def test_s3_random_access_equals_local(s3, tmp_path):
    base = f"s3://random-access/{uuid.uuid4().hex[:8]}"
    m = _write(base, storage_options=s3)
    remote = Manifest.load(f"{base}/manifest.json", storage_options=s3)
    assert remote == m
    assert remote.shard_urls()[1] == f"{base}/part-0001.tar"
    want = list(iter_samples(remote.shard_urls(), storage_options=s3))
    ds = IndexedDataset(f"{base}/manifest.json", storage_options=s3, verify=True)
    assert len(ds) == len(want) == 45
    for i in (44, 0, 21, 10, 9, 33):
        assert ds[i] == want[i]
    assert len(WebDataset(f"{base}/manifest.json", storage_options=s3)) == 45
    assert len(list(WebDataset(f"{base}/manifest.json", storage_options=s3, verify=True))) == 45
