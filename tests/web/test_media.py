"""Audio and video in the browser's server, over HTTP on 127.0.0.1 (urllib): the raw-field route
with media types and byte ranges (206, 416), video poster frames (and their placeholder without
PyAV), durations from the index or the member's header, metadata-column histograms."""

from __future__ import annotations

import http.client
import io
import json
import re
import sys
import urllib.request

import numpy as np
import pytest
from PIL import Image

from tarshards import Manifest
from tarshards.web import CSP, serve

from .conftest import BROKEN_VIDEO, MEDIA_N, TONE_SECONDS, VIDEO_FPS, VIDEO_FRAMES

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(media_dataset):
    with serve(media_dataset[0], page_size=6) as srv:
        yield srv


def request(srv, path: str, headers: dict | None = None, method: str = "GET"):
    """``(status, headers, body)``."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    try:
        conn.request(method, path, headers={"Host": f"127.0.0.1:{srv.port}", **(headers or {})})
        r = conn.getresponse()
        return r.status, r.headers, r.read()
    finally:
        conn.close()


def test_raw_media_fields_have_their_type_and_play_inline(server, media_dataset):
    made = media_dataset[2]
    for name, ctype in (("wav", "audio/wav"), ("flac", "audio/flac"), ("mp4", "video/mp4")):
        with urllib.request.urlopen(server.url + f"api/sample/1/{name}", timeout=30) as r:
            assert r.status == 200 and r.headers["Content-Type"] == ctype
            assert r.headers["Content-Disposition"].startswith("inline")
            assert r.headers["Accept-Ranges"] == "bytes"
            assert r.read() == made[1][name]
    # other fields are still a download
    status, headers, body = request(server, "/api/sample/1/txt")
    assert status == 200 and headers["Content-Type"] == "application/octet-stream"
    assert headers["Content-Disposition"].startswith("attachment") and body == b"clip 1"
    assert "media-src 'self'" in CSP and headers["Content-Security-Policy"] == CSP


def test_byte_ranges(server, media_dataset):
    wav = media_dataset[2][2]["wav"]
    n = len(wav)
    path = "/api/sample/2/wav"
    cases = {
        "bytes=10-19": (10, 20),
        "bytes=100-": (100, n),
        "bytes=-7": (n - 7, n),
        f"bytes={n - 3}-{n + 500}": (n - 3, n),  # the end clamped to the field
        "bytes=0-0": (0, 1),
        f"bytes=-{n + 10}": (0, n),
    }
    for spec, (a, b) in cases.items():
        status, headers, body = request(server, path, {"Range": spec})
        assert status == 206, spec
        assert headers["Content-Range"] == f"bytes {a}-{b - 1}/{n}", spec
        assert int(headers["Content-Length"]) == b - a and body == wav[a:b], spec
        assert headers["Content-Type"] == "audio/wav"
    # not satisfiable: 416 naming the size
    for spec in (f"bytes={n}-", f"bytes={n + 5}-{n + 9}", "bytes=-0"):
        status, headers, body = request(server, path, {"Range": spec})
        assert status == 416, spec
        assert headers["Content-Range"] == f"bytes */{n}"
        assert "not satisfiable" in json.loads(body)["error"]
    # ignored (the whole field, 200): several ranges, another unit, malformed, last < first
    for spec in ("bytes=0-1,5-9", "items=0-3", "bytes=abc", "bytes=9-2"):
        status, headers, body = request(server, path, {"Range": spec})
        assert status == 200 and body == wav, spec
    # If-Range: the range only while the field is the one the client has (its ETag)
    etag = request(server, path)[1]["ETag"]
    status, _, body = request(server, path, {"Range": "bytes=4-7", "If-Range": etag})
    assert status == 206 and body == wav[4:8]
    status, _, body = request(server, path, {"Range": "bytes=4-7", "If-Range": '"other"'})
    assert status == 200 and body == wav
    # HEAD: the headers of the range, no body
    status, headers, body = request(server, path, {"Range": "bytes=4-7"}, method="HEAD")
    assert status == 206 and headers["Content-Length"] == "4" and body == b""


def _pixels(jpeg: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"), dtype=np.float64)


def test_video_poster_is_the_middle_frame(server, media_dataset):
    import av

    with urllib.request.urlopen(server.url + "poster/0/mp4", timeout=30) as r:
        assert r.headers["Content-Type"] == "image/jpeg"
        poster = _pixels(r.read())
    assert poster.shape == (48, 64, 3)  # at most 192 pixels: kept as it is
    assert poster.var() > 100  # the noise pattern, not a blank frame
    with av.open(io.BytesIO(media_dataset[2][0]["mp4"])) as c:
        frames = [f.to_ndarray(format="rgb24").astype(np.float64) for f in c.decode(video=0)]
    errors = [np.abs(poster - f).mean() for f in frames]
    assert int(np.argmin(errors)) in (VIDEO_FRAMES // 2 - 1, VIDEO_FRAMES // 2)
    with urllib.request.urlopen(server.url + "poster/0/mp4?size=32", timeout=30) as r:
        assert max(Image.open(io.BytesIO(r.read())).size) == 32
    # not a video: 422 naming the field; an audio field: 400; a missing field: 404
    status, _, body = request(server, f"/poster/{BROKEN_VIDEO}/mp4")
    assert status == 422 and b"mp4" in body
    assert request(server, "/poster/0/wav")[0] == 400
    assert request(server, "/poster/0/webm")[0] == 404


def test_grid_and_sample_page_show_players_posters_and_durations(server):
    html = request(server, "/")[2].decode()
    assert len(re.findall(r'<img class="thumb poster" src="/poster/\d+/mp4"', html)) == 6
    # a page of players fetches nothing before one plays; a sample page loads their headers
    assert len(re.findall(r'<audio class="player" controls preload="none"', html)) == 12
    assert 'src="/api/sample/3/wav"' in html and 'src="/api/sample/3/flac"' in html
    want = f"{VIDEO_FRAMES / VIDEO_FPS:.2f} s"  # mp4.duration from the index
    assert html.count(want) == MEDIA_N - 1  # not the broken one
    assert f"{TONE_SECONDS:.2f} s" in html
    page = request(server, "/sample/1")[2].decode()
    assert '<img class="full poster" src="/poster/1/mp4?size=640"' in page
    assert '<video class="player" controls preload="none" src="/api/sample/1/mp4">' in page
    assert page.count('<audio class="player" controls preload="metadata"') == 2 and want in page


def test_durations_probed_without_metadata_columns(media_dataset):
    """Shards without metadata in their index: the duration comes from the member's header."""
    with serve(media_dataset[1]) as srv:
        assert srv.data.manifest.meta_columns() == []
        html = request(srv, "/")[2].decode()
        assert html.count(f"{VIDEO_FRAMES / VIDEO_FPS:.2f} s") == MEDIA_N - 1
        assert "8,000 Hz" in html
        stats = json.loads(request(srv, "/api/stats")[2])
        assert stats["index"]["meta"] == {}


def test_without_pyav_posters_are_placeholders(server, monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)  # import av fails
    html = request(server, "/?page=0&size=6")[2].decode()
    assert html.count('class="thumb placeholder"') == MEDIA_N
    assert "/poster/" not in html and html.count("<audio") == 12
    status, _, body = request(server, "/poster/1/mp4?size=33")  # not cached: needs PyAV
    assert status == 501 and b"PyAV" in body
    assert request(server, "/sample/2")[0] == 200


def test_metadata_columns_as_histograms(server, media_dataset):
    manifest = Manifest.load(media_dataset[0])
    stats = json.loads(request(server, "/api/stats")[2])["index"]["meta"]
    assert set(stats) == set(manifest.meta_columns())
    assert {"mp4.duration", "mp4.width", "wav.duration", "wav.rate", "flac.samples"} <= set(stats)
    d = stats["mp4.duration"]
    values = manifest.meta("mp4.duration")
    assert d["count"] == MEDIA_N - 1 and d["missing"] == 1  # the broken video has no value
    assert d["mean"] == pytest.approx(np.nanmean(values))
    assert sum(d["histogram"]["counts"]) == d["count"]
    assert stats["wav.rate"]["min"] == stats["wav.rate"]["max"] == 8000
    page = request(server, "/stats")[2].decode()
    for name in ("mp4.duration", "wav.rate", "flac.samples"):
        assert f"<title>metadata: {name}</title>" in page


def test_an_open_range_of_a_large_field_is_answered_in_parts(tmp_path):
    from tarshards import ShardWriter
    from tarshards.web.server import RANGE_CHUNK

    big = np.random.default_rng(0).integers(0, 256, RANGE_CHUNK + 12345, np.uint8).tobytes()
    with ShardWriter(str(tmp_path / "big-%04d.tar"), manifest=str(tmp_path / "big.json")) as w:
        w.write({"__key__": "a", "ogg": big})
    with serve(str(tmp_path / "big.json")) as srv:
        status, headers, body = request(srv, "/api/sample/0/ogg", {"Range": "bytes=100-"})
        assert status == 206 and headers["Content-Type"] == "audio/ogg"
        assert headers["Content-Range"] == f"bytes 100-{100 + RANGE_CHUNK - 1}/{len(big)}"
        assert body == big[100 : 100 + RANGE_CHUNK]
        # the player asks on from there: the rest (read alone from the shard)
        status, headers, body = request(
            srv, "/api/sample/0/ogg", {"Range": f"bytes={100 + RANGE_CHUNK}-"}
        )
        assert status == 206 and body == big[100 + RANGE_CHUNK :]
        # a closed range is answered as asked
        status, _, body = request(srv, "/api/sample/0/ogg", {"Range": f"bytes=5-{len(big) - 2}"})
        assert status == 206 and body == big[5:-1]
