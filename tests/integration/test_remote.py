"""Remote shards against real local servers: HTTP, S3 (moto) and GCS (emulator).

Write with ``ShardWriter``, read back with ``WebDataset`` and a 2-worker DataLoader; drop
connections in the middle of shards with a TCP proxy and check that nothing is lost.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import uuid
from dataclasses import dataclass, field

import pytest
from conftest import make_samples

# a stuck connection must fail the test, not hold up the whole suite
pytestmark = pytest.mark.timeout(180)
from tarshards import ShardWriter, StorageError, TarWriter, WebDataset
from tarshards.pipeline.dataset import iter_samples
from tarshards.pipeline.stages import warn_and_continue
from tarshards.storage import open_url

torch = pytest.importorskip("torch", reason="the DataLoader tests need torch")
from tarshards.torch.adapter import WebDataset as TorchWebDataset  # noqa: E402


def _load_servers():
    spec = importlib.util.spec_from_file_location(
        "tarshards_test_servers", os.path.join(os.path.dirname(__file__), "servers.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


servers = _load_servers()


@dataclass
class Remote:
    """A place to write shards to and read them back from."""

    name: str
    read_base: str  # URL prefix readers use
    write_base: str  # where ShardWriter writes (a local dir for HTTP, the URL otherwise)
    storage_options: dict | None = None
    server: object = field(default=None, repr=False)

    def fresh(self) -> tuple[str, str]:
        """A new (write prefix, read prefix) pair, so tests never see each other's shards."""
        sub = uuid.uuid4().hex[:8]
        if self.name == "http":
            os.makedirs(os.path.join(self.write_base, sub), exist_ok=True)
            return os.path.join(self.write_base, sub), f"{self.read_base}/{sub}"
        return f"{self.write_base}/{sub}", f"{self.read_base}/{sub}"


@pytest.fixture(scope="session")
def http_remote(tmp_path_factory):
    root = tmp_path_factory.mktemp("http-root")
    srv = servers.HTTPFileServer(root).start()
    try:
        yield Remote("http", srv.url, str(root), None, srv)
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def s3_remote():
    pytest.importorskip("s3fs", reason="s3fs is needed for s3:// (pip install tarshards[s3])")
    pytest.importorskip("boto3", reason="boto3 is needed to create the test bucket")
    started = servers.start_moto()
    if started is None:
        pytest.skip("moto[server] is not installed")
    server, endpoint = started
    try:
        servers.make_s3_bucket(endpoint, "shards")
        yield Remote("s3", "s3://shards", "s3://shards", servers.s3_options(endpoint), server)
    finally:
        server.stop()


@pytest.fixture(scope="session")
def gcs_remote():
    old = os.environ.get("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")
    # without this (read when gcsfs is imported), gcsfs probes for hierarchical namespaces
    # against the emulator and each first access waits 60 s
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    pytest.importorskip("gcsfs", reason="gcsfs is needed for gs:// (pip install tarshards[gcs])")
    started = servers.start_gcs("shards")
    if started is None:
        pytest.skip("gcp-storage-emulator is not installed")
    server, endpoint = started
    try:
        yield Remote("gcs", "gs://shards", "gs://shards", servers.gcs_options(endpoint), server)
    finally:
        server.stop()
        if old is None:
            os.environ.pop("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", None)
        else:
            os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = old


@pytest.fixture(params=["http", "s3", "gcs"])
def remote(request):
    return request.getfixturevalue(f"{request.param}_remote")


def _write(remote, nshards: int, per_shard: int, pattern: str = "shard-%04d.tar", start=0):
    write_base, read_base = remote.fresh()
    samples = make_samples(nshards * per_shard, start=start)
    with ShardWriter(
        f"{write_base}/{pattern}", maxcount=per_shard, storage_options=remote.storage_options
    ) as w:
        for s in samples:
            w.write(s)
    ext = pattern.split("%04d", 1)[1]
    urls = [f"{read_base}/{pattern.split('%', 1)[0]}{i:04d}{ext}" for i in range(nshards)]
    return urls, samples


def _fields(sample):
    return {k: bytes(v) for k, v in sample.items() if not k.startswith("__")}


def test_write_then_read_with_dataloader(remote):
    urls, samples = _write(remote, 4, 10)
    ds = TorchWebDataset(urls, storage_options=remote.storage_options, shardshuffle=False)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    got = {}
    for sample in loader:
        key = sample["__key__"]
        assert key not in got, f"{key} read twice"
        got[key] = _fields(sample)
    assert sorted(got) == [s["__key__"] for s in samples]
    for s in samples:
        assert got[s["__key__"]] == _fields(s)


def test_glob_and_compressed_shards(remote):
    if remote.name == "http":
        pytest.skip("HTTP has no listing to glob")
    urls, samples = _write(remote, 2, 7, pattern="part-%04d.tar.gz")
    spec = urls[0].rsplit("/", 1)[0] + "/part-*.tar.gz"
    ds = WebDataset(spec, storage_options=remote.storage_options, shardshuffle=False)
    assert ds.urls == urls
    got = list(ds)
    assert [s["__key__"] for s in got] == [s["__key__"] for s in samples]
    assert all(_fields(a) == _fields(b) for a, b in zip(got, samples))


def test_remote_object_appears_only_when_complete(remote):
    if remote.name == "http":
        pytest.skip("the HTTP test server is read-only")
    import fsspec

    write_base, _ = remote.fresh()
    fs, _ = fsspec.core.url_to_fs(write_base, **remote.storage_options)
    url = f"{write_base}/one.tar"
    w = TarWriter(url, storage_options=remote.storage_options)
    for s in make_samples(3):
        w.write(s)
    assert not fs.exists(url), "the object exists before the writer was closed"
    w.close()
    assert fs.exists(url)
    with pytest.raises(RuntimeError):
        with TarWriter(f"{write_base}/broken.tar", storage_options=remote.storage_options) as w:
            w.write(make_samples(1)[0])
            raise RuntimeError("the producer failed")
    assert not fs.exists(f"{write_base}/broken.tar")


def test_missing_remote_shard_is_a_storage_error(remote):
    _, read_base = remote.fresh()
    url = f"{read_base}/nope.tar"
    with pytest.raises(StorageError) as info:
        list(WebDataset(url, storage_options=remote.storage_options))
    assert url in str(info.value) or "nope.tar" in str(info.value)
    with pytest.raises(FileNotFoundError):  # a ShardNotFoundError, at once (no retries)
        with open_url(url, storage_options=remote.storage_options, retry_backoff=10):
            pass


# ---- dropped connections ---------------------------------------------------------------------


@pytest.fixture
def shards_over_http(http_remote):
    urls, samples = _write(http_remote, 3, 40)  # ~200 kB per shard
    return urls, samples


@pytest.mark.parametrize("pattern", ["shard-%04d.tar", "shard-%04d.tgz"])
def test_cut_connections_lose_nothing(http_remote, caplog, pattern):
    urls, samples = _write(http_remote, 3, 40, pattern=pattern)
    srv = http_remote.server
    cut_after = 8_000 if pattern.endswith(".tgz") else 60_000  # .tgz: ~28 kB a shard
    with servers.CuttingProxy(("127.0.0.1", srv.port), cut_after=cut_after, cuts=4) as proxy:
        proxied = [u.replace(srv.url, proxy.url) for u in urls]
        with caplog.at_level(logging.WARNING, logger="tarshards.storage.retry"):
            got = list(WebDataset(proxied, shardshuffle=False))
    assert proxy.cut_count == 4
    assert [s["__key__"] for s in got] == [s["__key__"] for s in samples]
    assert all(_fields(a) == _fields(b) for a, b in zip(got, samples))
    resumes = [
        r for r in caplog.records if r.name == "tarshards.storage.retry" and "resuming" in r.message
    ]
    assert len(resumes) == 4
    assert any("offset 0 " not in r.getMessage() for r in resumes), "no resume past offset 0"
    assert all(r.levelno == logging.WARNING for r in resumes)


def test_cut_connections_with_dataloader_workers(http_remote):
    urls, samples = _write(http_remote, 4, 30)
    srv = http_remote.server
    with servers.CuttingProxy(("127.0.0.1", srv.port), cut_after=40_000, cuts=6) as proxy:
        proxied = [u.replace(srv.url, proxy.url) for u in urls]
        loader = torch.utils.data.DataLoader(
            TorchWebDataset(proxied, shardshuffle=False), batch_size=None, num_workers=2
        )
        got = sorted((s["__key__"], s["jpg"]) for s in loader)
    assert proxy.cut_count == 6
    assert got == sorted((s["__key__"], s["jpg"]) for s in samples)


def test_retries_exhausted_names_url_and_offset(http_remote):
    urls, samples = _write(http_remote, 2, 40)
    srv = http_remote.server
    # the first connection gets 50 kB through, every later one is cut before its first byte
    with servers.CuttingProxy(("127.0.0.1", srv.port), cut_after=[50_000, 0], cuts=100) as proxy:
        bad = urls[0].replace(srv.url, proxy.url)
        with pytest.raises(StorageError) as info:
            with open_url(bad, retries=2, retry_backoff=0.01, timeout=10) as f:
                while f.read(1 << 16):
                    pass
        err = info.value
        assert err.url == bad and bad in str(err)
        assert err.offset is not None and err.offset > 0 and f"offset {err.offset}" in str(err)
        assert "2 retries" in str(err)
        # the pipeline's handler decides: warn and go on with the next shard
        opener = functools.partial(open_url, retries=1, retry_backoff=0.01, timeout=10)
        with pytest.warns(Warning, match="offset"):
            got = list(iter_samples([bad, urls[1]], handler=warn_and_continue, opener=opener))
    keys = [s["__key__"] for s in got]
    assert keys[-40:] == [s["__key__"] for s in samples[40:]]
    assert len(keys) < 80


def test_http_not_found_fails_fast(http_remote):
    with pytest.raises(StorageError, match="404"):
        with open_url(f"{http_remote.read_base}/missing.tar", retries=3, retry_backoff=5):
            pass


def test_http_reads_one_request_per_shard(http_remote):
    urls, _samples = _write(http_remote, 2, 20)
    srv = http_remote.server
    before = srv.get_counts()
    assert len(list(WebDataset(urls, shardshuffle=False))) == 40
    after = srv.get_counts()
    for u in urls:
        path = u[len(srv.url) :]
        assert after[path] - before[path] == 1
    heads = [r for r in srv.requests if r[0] == "HEAD"]
    assert not heads, "reading should not need a HEAD request"


def test_silent_http_server_times_out_instead_of_hanging():
    pytest.importorskip("aiohttp")
    import socket
    import threading
    import time

    sock = socket.create_server(("127.0.0.1", 0))
    held = []

    def accept():
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            held.append(conn)  # read nothing, answer nothing

    threading.Thread(target=accept, daemon=True).start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/shard.tar"
    started = time.monotonic()
    try:
        with pytest.raises(StorageError) as info:
            with open_url(url, retries=1, retry_backoff=0.01, timeout=0.5):
                pass
        assert url in str(info.value)
        assert time.monotonic() - started < 30
    finally:
        sock.close()
        for c in held:
            c.close()


def test_s3_cut_connections_resume_at_the_offset(s3_remote, caplog):
    """S3 shards are read with one streaming GetObject each; a dropped connection resumes
    with a ranged GET at the byte reached, with and without prefetch."""
    urls, samples = _write(s3_remote, 3, 40)
    endpoint = s3_remote.storage_options["client_kwargs"]["endpoint_url"]
    port = int(endpoint.rsplit(":", 1)[1])
    for prefetch in (0, 2):
        with servers.CuttingProxy(
            ("127.0.0.1", port), cut_after=[10**9, 70_000], cuts=3, pause=0.5
        ) as proxy:
            options = servers.s3_options(proxy.url)
            options["skip_instance_cache"] = True
            with caplog.at_level(logging.WARNING, logger="tarshards.storage.retry"):
                caplog.clear()
                got = list(
                    WebDataset(urls, shardshuffle=False, storage_options=options, prefetch=prefetch)
                )
        assert proxy.cut_count == 3
        assert [s["__key__"] for s in got] == [s["__key__"] for s in samples]
        assert all(_fields(a) == _fields(b) for a, b in zip(got, samples))
        # a cut before the response headers is retried inside s3fs; cuts in a body are ours (the
        # proxy pauses before each reset so that the bytes before it reach the reader: aiohttp
        # drops a body's buffered bytes once the connection fails)
        resumes = [r for r in caplog.records if "resuming" in r.getMessage()]
        assert any("offset 0 " not in r.getMessage() for r in resumes)


# ---- reads at an offset, for a length (random access, resumed reads) -------------------------

_BLOB = bytes(range(251)) * 1200  # 301,200 bytes, no period that divides a tar block


def _put_blob(remote) -> str:
    """``_BLOB`` as one object on ``remote`` (written through open_url); its read URL."""
    write_base, read_base = remote.fresh()
    with open_url(f"{write_base}/blob.bin", "wb", storage_options=remote.storage_options) as f:
        f.write(_BLOB)
    return f"{read_base}/blob.bin"


@pytest.mark.parametrize(
    "offset, length",
    [(0, None), (70_001, None), (12_345, 100), (0, 1), (len(_BLOB) - 9, 9), (len(_BLOB) - 9, 50)],
)
def test_open_url_at_offset_for_length(remote, offset, length):
    url = _put_blob(remote)
    want = _BLOB[offset:] if length is None else _BLOB[offset : offset + length]
    with open_url(url, offset=offset, length=length, storage_options=remote.storage_options) as f:
        got = b"".join(iter(lambda: f.read(10_000), b""))
    assert got == want


def test_http_range_is_asked_for_exactly(http_remote):
    """A read with a length asks for that range (``bytes=a-b``), one request, streamed or not."""
    pytest.importorskip("aiohttp")
    import fsspec

    from tarshards.storage.http import HTTPStream

    url = _put_blob(http_remote)
    srv = http_remote.server
    path = url[len(srv.url) :]
    srv.reset()
    with open_url(url, offset=1000, length=5000) as f:
        assert f.read() == _BLOB[1000:6000]
    # the streaming path (a range larger than the read-ahead), on its own
    s = HTTPStream(fsspec.filesystem("http"), url, 2000, stop=250_000, prefetch=4096)
    try:
        assert b"".join(iter(lambda: s.read(7777), b"")) == _BLOB[2000:250_000]
        assert s.size == len(_BLOB)
    finally:
        s.close()
    ranges = [r[2] for r in srv.requests if r[1] == path]
    assert ranges == ["bytes=1000-5999", "bytes=2000-249999"]


def test_cut_connection_inside_a_range_is_retried(http_remote, caplog):
    """A range of at most the read-ahead is fetched in one piece: a cut fetches it again."""
    urls, _ = _write(http_remote, 1, 40)
    url = urls[0]
    srv = http_remote.server
    with open(os.path.join(http_remote.write_base, url[len(srv.url) + 1 :]), "rb") as f:
        data = f.read()
    with servers.CuttingProxy(("127.0.0.1", srv.port), cut_after=30_000, cuts=2) as proxy:
        proxied = url.replace(srv.url, proxy.url)
        with caplog.at_level(logging.WARNING, logger="tarshards.storage.retry"):
            with open_url(proxied, offset=10_000, length=100_000, retry_backoff=0.01) as f:
                got = b"".join(iter(lambda: f.read(1 << 16), b""))
    assert proxy.cut_count == 2
    assert got == data[10_000:110_000]
    assert len([r for r in caplog.records if "resuming" in r.getMessage()]) == 2


@pytest.mark.parametrize("shuffle", [0, 30])
def test_planned_resume_over_http_reads_from_the_sample_offset(http_remote, shuffle):
    """A resumed planned reader asks for the shard from the offset of the sample it resumes at
    (an HTTP range), instead of reading the shard from its start; the stream stays exact."""
    from tarshards.testing import check_resume

    write_base, read_base = http_remote.fresh()
    with ShardWriter(
        f"{write_base}/shard-%04d.tar", maxcount=40, manifest=f"{write_base}/manifest.json"
    ) as w:
        for s in make_samples(120):
            w.write(s)

    def make():
        ds = WebDataset(f"{read_base}/manifest.json", shardshuffle=True, seed=3, readers=2)
        if shuffle:
            ds = ds.shuffle(shuffle)
        return ds.to_tuple("__key__").batched(5)

    check_resume(make, epochs=1, cuts=[(0, 7), (0, 15)])
    ds = make()
    it = iter(ds)
    for _ in range(7):
        next(it)
    state = ds.state_dict()
    del it
    srv = http_remote.server
    srv.reset()
    fresh = make()
    fresh.load_state_dict(state)
    next(iter(fresh))
    shard_gets = [r for m, p, r in srv.requests if m == "GET" and p.endswith(".tar")]
    starts = [int(r.split("=")[1].split("-")[0]) for r in shard_gets if r]
    assert starts and max(starts) > 0, shard_gets


# (planned batches drop the remainder by default; the warning has tests of its own)
@pytest.mark.filterwarnings("ignore:epoch \\d+ drops:tarshards.errors.TarshardsWarning")
def test_planned_resume_is_exact_on_every_store(remote):
    """Resumed planned readers open remote shards at a sample's offset (a ranged read) on
    HTTP, S3 and GCS alike; what they yield equals the uninterrupted run."""
    from tarshards.testing import check_resume

    write_base, read_base = remote.fresh()
    with ShardWriter(
        f"{write_base}/shard-%04d.tar",
        maxcount=30,
        manifest=f"{write_base}/manifest.json",
        storage_options=remote.storage_options,
    ) as w:
        for s in make_samples(90):
            w.write(s)

    def make():
        ds = WebDataset(
            f"{read_base}/manifest.json",
            shardshuffle=True,
            seed=5,
            readers=3,
            storage_options=remote.storage_options,
        )
        return ds.shuffle(10).to_tuple("__key__").batched(4)

    check_resume(make, epochs=1, cuts=[(0, 4), (0, 13)])
