"""The browser's server over HTTP on 127.0.0.1 (urllib): the JSON API against the data written,
pages, bad input, methods, paths that try to reach the file system, escaping, headers."""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
import warnings

import pytest

from tarshards import IndexedDataset, Manifest
from tarshards.format.hashing import member_checksum_fn
from tarshards.web import CSP, BrowseData, serve

N = 120  # samples in the data set of conftest.py

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(dataset):
    with serve(dataset[0], page_size=12) as srv:
        yield srv


def get(srv, path: str, method: str = "GET", headers: dict | None = None):
    """``(status, headers, body)`` of a raw request (the path sent exactly as given)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        conn.putheader("Host", (headers or {}).get("Host", f"127.0.0.1:{srv.port}"))
        conn.endheaders()
        r = conn.getresponse()
        return r.status, r.headers, r.read()
    finally:
        conn.close()


def get_json(srv, path: str):
    with urllib.request.urlopen(srv.url.rstrip("/") + path, timeout=30) as r:
        assert r.headers["Content-Type"] == "application/json"
        return json.loads(r.read())


def test_api_sample_matches_the_data_and_the_index(server, dataset):
    manifest = Manifest.load(dataset[0])
    ds = IndexedDataset(manifest)
    made = dataset[2]
    for i in (0, 7, 49, 50, 119):
        got = get_json(server, f"/api/sample/{i}")
        want = made[i]
        shard, j = ds.locate(i)
        idx = manifest.load_index(shard)
        assert got["index"] == i and got["key"] == want["__key__"]
        assert got["shard"] == shard and got["position"] == j
        assert got["shard_url"] == ds.urls[shard]
        assert got["offset"] == int(idx.tar_offsets[j]) == ds[i]["__offset__"]
        fields = {f["name"]: f for f in got["fields"]}
        assert set(fields) == {k for k in want if not k.startswith("__")}
        csum = member_checksum_fn(idx.member_hash)
        for name, f in fields.items():
            assert f["size"] == len(want[name])
            algo, _, hexdigest = f["checksum"].partition(":")
            assert algo == idx.member_hash and int(hexdigest, 16) == csum(want[name])
            assert f["member"] == f"{want['__key__']}.{name}"
            # the offsets are where the bytes are in the shard (plain tar)
            with open(ds.urls[shard], "rb") as fh:
                fh.seek(f["data_offset"])
                assert fh.read(f["size"]) == want[name]
        assert got["size"] == sum(len(v) for k, v in want.items() if not k.startswith("__"))


def test_api_field_bytes_page_info_search(server, dataset):
    made = dataset[2]
    with urllib.request.urlopen(server.url + "api/sample/9/bin", timeout=30) as r:
        assert r.read() == made[9]["bin"]
        assert r.headers["Content-Type"] == "application/octet-stream"
        assert r.headers["Content-Disposition"].startswith("attachment")
    info = get_json(server, "/api/info")
    assert info["samples"] == N and info["shards"] == 3
    assert info["fingerprint"] == Manifest.load(dataset[0]).fingerprint
    page = get_json(server, "/api/page?page=4&size=12")
    assert page["pages"] == 10 and [s["index"] for s in page["samples"]] == list(range(48, 60))
    assert [s["key"] for s in page["samples"]] == [m["__key__"] for m in made[48:60]]
    # search: keys img0010..img0019 (a shard of unsorted keys and sorted ones alike)
    found = get_json(server, "/api/search?q=img001&limit=100")
    assert found["total"] == 10 and found["indices"] == list(range(10, 20))
    assert found["keys"] == [f"img{i:04d}" for i in range(10, 20)]
    found = get_json(server, "/api/search?q=img00&start=3&limit=4")
    want = [i for i, m in enumerate(made) if m["__key__"].startswith("img00")]
    assert found["total"] == len(want) and found["indices"] == want[3:7]
    assert get_json(server, "/api/search?q=evil")["indices"] == [7]
    assert get_json(server, "/api/search?q=nothing")["total"] == 0


@pytest.mark.parametrize(
    "path, status, words",
    [
        ("/api/sample/120", 404, "out of range"),
        ("/api/sample/-1", 404, "out of range"),
        ("/api/sample/abc", 400, "bad sample index"),
        ("/api/sample/1e3", 400, "bad sample index"),
        ("/api/sample/3/nope", 404, "no field 'nope'"),
        ("/api/page?page=99", 404, "page 99 out of range"),
        ("/api/page?size=0", 400, "size 0 out of range"),
        ("/api/page?page=x", 400, "bad page number"),
        ("/api/nothing", 404, "no such API endpoint"),
        ("/thumb/3/txt", 400, "not an image"),
        ("/thumb/3/jpg?size=5000", 400, "size 5000 out of range"),
        ("/thumb/11/seg.png", 422, "not an image Pillow reads"),
        ("/sample/999", 404, "out of range"),
        ("/goto?i=oops", 400, "bad sample index"),
        ("/static/missing.js", 404, "no such asset"),
        ("/nowhere", 404, "no such page"),
    ],
)
def test_bad_input_is_a_4xx_with_a_one_line_reason(server, path, status, words):
    code, headers, body = get(server, path)
    assert code == status
    text = body.decode()
    assert text.endswith("\n") and text.count("\n") == 1, text
    if path.startswith("/api/"):
        assert headers["Content-Type"] == "application/json"
        text = json.loads(text)["error"]
    assert words in text


@pytest.mark.parametrize(
    "path",
    [
        "/static/../../../../etc/passwd",
        "/static/..%2f..%2f..%2fetc%2fpasswd",
        "/static/%2e%2e/%2e%2e/etc/passwd",
        "/static/%252e%252e%252f%252e%252e%252fetc%252fpasswd",
        "/static/%25252e%25252e/x",
        "/static/..\\..\\etc\\passwd",
        "/static/%5c..%5cpasswd",
        "/static/style.css%00.txt",
        "/../api/info",
        "/api/sample/0/..",
        "/static/./style.css",
    ],
)
def test_no_path_reaches_the_file_system(server, path):
    code, _, body = get(server, path)
    assert 400 <= code < 500, (path, code)
    assert b"root:" not in body and len(body) < 300


def test_static_assets_are_served_by_name_only(server):
    code, headers, body = get(server, "/static/style.css")
    assert code == 200 and headers["Content-Type"].startswith("text/css") and b".grid" in body
    assert get(server, "/static/__init__.py")[0] == 404
    assert get(server, "/static/../server.py")[0] == 400


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "FOO"])
def test_no_write_endpoints(server, method):
    code, headers, _ = get(server, "/api/sample/0", method=method)
    assert code == 405 and headers["Allow"] == "GET, HEAD"


def test_head_and_security_headers(server):
    code, headers, body = get(server, "/", method="HEAD")
    assert code == 200 and body == b"" and int(headers["Content-Length"]) > 0
    for path in ("/", "/api/sample/0", "/thumb/0/jpg", "/static/style.css", "/nowhere"):
        _, headers, _ = get(server, path)
        assert headers["Content-Security-Policy"] == CSP
        assert "default-src 'none'" in CSP and "script-src" not in CSP  # no scripts at all
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert headers["X-Frame-Options"] == "DENY"
        assert headers["Server-Timing"].startswith("app;dur=")


def test_foreign_host_header_refused_on_loopback(server):
    code, _, body = get(server, "/api/info", headers={"Host": "attacker.example:80"})
    assert code == 400 and b"Host" in body
    assert get(server, "/api/info", headers={"Host": f"localhost:{server.port}"})[0] == 200


def test_keys_and_captions_are_escaped(server, evil):
    evil_key, evil_caption = evil
    # the sample with the HTML key and caption, on its page, in the grid and in search results
    for path in ("/sample/7", "/?page=0&size=12", "/search?q=evil", "/stats"):
        code, _, body = get(server, path)
        assert code == 200, path
        html = body.decode()
        assert "<script" not in html.lower(), path
        assert "onerror=" not in html.replace("onerror=&quot;", "")  # only escaped
        if path != "/stats":
            assert "&lt;script&gt;window.__xss=2&lt;/script&gt;" in html, path
    html = get(server, "/sample/7")[2].decode()
    assert "&lt;script&gt;window.__xss=3&lt;/script&gt;&lt;b&gt;bold?&lt;/b&gt; &amp; done" in html
    assert get_json(server, "/api/sample/7")["key"] == evil_key
    assert evil_caption.encode() == get(server, "/api/sample/7/txt")[2]


def test_pages_render(server):
    html = get(server, "/?page=9&size=12")[2].decode()
    assert 'data-index="108"' in html and 'data-index="119"' in html
    assert 'data-index="107"' not in html
    html = get(server, "/sample/3")[2].decode()
    for name in ("png", "cls", "txt", "json", "bin"):
        assert f'id="field-{name}"' in html
    html = get(server, "/sample/11")[2].decode()  # an unreadable image: the page still renders
    assert 'id="field-seg.png"' in html and "/thumb/11/seg.png" in html
    code, headers, _ = get(server, "/goto?i=42")
    assert code == 303 and headers["Location"] == "/sample/42"
    code, headers, body = get(server, "/thumb/4/jpg?size=32")
    assert code == 200 and headers["Content-Type"] == "image/jpeg" and body[:2] == b"\xff\xd8"
    stats = get(server, "/stats")[2].decode()
    assert stats.count("<svg") >= 6 and "samples per shard" in stats


def test_stats_from_the_index_and_from_data(server, dataset):
    made = dataset[2]
    st = get_json(server, "/api/stats")
    assert st["index"]["samples_per_shard"] == [50, 50, 20]
    fields = st["index"]["fields"]
    assert fields["bin"]["bytes"] == sum(len(s["bin"]) for s in made)
    assert fields["jpg"]["count"] == N // 2 and fields["png"]["count"] == N // 2
    assert sum(fields["txt"]["histogram"]["counts"]) == N
    assert st["index"]["members_per_sample"] == {"5": N - 1, "6": 1}
    data = st["data"]
    assert data["samples_read"] == N  # fewer than stats_samples: every sample
    assert data["classes"]["cls"] == {str(c): N // 4 for c in range(4)}
    sizes = sorted(tuple(s) for s in data["images"]["jpg"]["sizes"])
    want = sorted((48 + (i % 4) * 8, 40 + (i % 3) * 8) for i in range(0, N, 2))
    assert sizes == want
    hist = data["json_columns"]["json"]["i"]  # the JSON field's number "i": 0..119
    assert hist["counts"] and sum(hist["counts"]) == N and hist["edges"][0] == 0
    assert "tag" not in data["json_columns"]["json"]  # a string, not a number


def test_shard_spec_is_indexed_in_a_directory_kept(dataset, evil, tmp_path):
    spec = dataset[1]
    with BrowseData(spec, index_dir=tmp_path) as data:
        assert len(data) == N and data.info(7).key == evil[0]
        made = list(tmp_path.glob("browse-*.json"))
        assert len(made) == 1
        mtime = made[0].stat().st_mtime_ns
    with BrowseData(spec, index_dir=tmp_path) as data:  # reused, not rebuilt
        assert data.read(119)["txt"] == b"caption of sample 119"
    assert made[0].stat().st_mtime_ns == mtime
    with BrowseData(spec) as data:  # a temporary directory, removed at close
        folder = data.manifest.base
        assert data.info(50).shard == 1
    import os

    assert not os.path.exists(folder)


def test_remote_shards_over_http(dataset, tmp_path):
    pytest.importorskip("aiohttp", reason="http:// needs aiohttp (tarshards[http])")
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "integration", "servers.py")
    spec = importlib.util.spec_from_file_location("tarshards_test_servers_web", path)
    servers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(servers)
    root = os.path.dirname(dataset[0])
    http_srv = servers.HTTPFileServer(root).start()
    try:
        with serve(http_srv.url + "/train-{0000..0002}.tar") as srv:
            got = get_json(srv, "/api/sample/51")
            assert got["key"] == "img0051" and got["shard_url"].startswith("http://127.0.0.1")
            with urllib.request.urlopen(srv.url + "api/sample/51/txt", timeout=30) as r:
                assert r.read() == b"caption of sample 51"
            code, _, body = get(srv, "/thumb/51/png")
            assert code == 200 and body[:2] == b"\xff\xd8"
    finally:
        http_srv.stop()


def test_binding_elsewhere_warns_and_loopback_does_not(dataset):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        serve(dataset[0]).close()
    with pytest.warns(Warning, match="not a loopback address"):
        srv = serve(dataset[0], host="0.0.0.0")
    with srv:
        # reachable through a non-loopback address of this machine where it has one
        assert get_json(srv, "/api/info")["samples"] == N


def test_close_frees_the_port(dataset):
    srv = serve(dataset[0])
    port = srv.port
    srv.close()
    srv.close()  # idempotent
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0
