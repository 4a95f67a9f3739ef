"""A clip of a remote member reads a small part of it (bytes counted at the HTTP server)."""

from __future__ import annotations

import io

import numpy as np
import pytest

from .conftest import full_decode, make_video

av = pytest.importorskip("av")
pytest.importorskip("aiohttp", reason="HTTP reading needs aiohttp (tarshards[http])")

from conftest import load_servers  # noqa: E402  (tests/conftest.py)

import tarshards  # noqa: E402
from tarshards import IndexedDataset, ShardWriter  # noqa: E402

HTTPFileServer = load_servers().HTTPFileServer


def test_a_2s_clip_of_a_60s_remote_member_reads_under_a_quarter_of_it(tmp_path):
    data = make_video(600, fps=10, width=128, height=96, texture=True)  # 60 s
    with ShardWriter(str(tmp_path / "r-%02d.tar"), manifest=str(tmp_path / "r.json")) as w:
        w.write({"__key__": "a", "txt": "first", "mp4": make_video(10)})
        w.write({"__key__": "long", "txt": "the long one", "mp4": data})
    frames, times = full_decode(data)
    with HTTPFileServer(tmp_path) as srv:
        ds = IndexedDataset(
            f"{srv.url}/r.json", decode=tarshards.video(frames=20, clip="random", output="numpy")
        )
        for _ in range(3):
            srv.reset()
            s = ds[1]
            sent = srv.bytes_sent("/r-00.tar")
            assert s["txt"] == "the long one"
            clip = s["mp4"]
            idx = [times.index(float(t)) for t in clip.timestamps]
            assert np.diff(idx).tolist() == [1] * 19  # 2 s at 10 fps
            assert all(np.array_equal(f, frames[i]) for i, f in zip(idx, clip.frames))
            assert 0 < sent <= 0.25 * len(data), (sent, len(data))


def test_a_keyframe_table_fetches_the_clip_at_once(tmp_path):
    from tarshards.media.metadata import add_media_meta, member_keyframes

    data = make_video(600, fps=10, width=128, height=96, texture=True)
    with ShardWriter(str(tmp_path / "k-%02d.tar"), manifest=str(tmp_path / "k.json")) as w:
        w.write({"__key__": "long", "mp4": data})
    m = add_media_meta(str(tmp_path / "k.json"), keyframes=True)
    times, positions = m.load_index(0).member_keyframes(0)
    with av.open(io.BytesIO(data)) as c:  # PyAV's keyframes: every 12th frame
        s = c.streams.video[0]
        ref = [float(p.pts * s.time_base) for p in c.demux(s) if p.is_keyframe]
    assert times.tolist() == ref and len(ref) >= 50  # a keyframe every 12 frames (or sooner)
    assert member_keyframes(data) == (times.tolist(), positions.tolist())
    frames, ftimes = full_decode(data)
    with HTTPFileServer(tmp_path) as srv:
        ds = IndexedDataset(
            f"{srv.url}/k.json", decode=tarshards.video(frames=60, clip="center", output="numpy")
        )
        ds[0]
        srv.reset()
        clip = ds[0]["mp4"]
        planned = (srv.bytes_sent("/k-00.tar"), srv.gets("/k-00.tar"))
    plain = tarshards.Manifest.load(str(tmp_path / "k.json"))
    assert plain.load_index(0).keyframe_table is not None
    idx = [ftimes.index(float(t)) for t in clip.timestamps]
    assert idx == list(range(270, 330))
    assert all(np.array_equal(f, frames[i]) for i, f in zip(idx, clip.frames))
    # without the table: the same clip, more requests
    stats: dict = {}
    index = m.load_index(0)
    off, size = int(index.member_data_offsets[0]), int(index.member_sizes[0])
    with HTTPFileServer(tmp_path) as srv:
        url = f"{srv.url}/k-00.tar"
        dec = tarshards.video(frames=60, clip="center", output="numpy")
        again = tarshards.read_media(url, off, size, dec, stats=stats)
        unplanned = (srv.bytes_sent("/k-00.tar"), srv.gets("/k-00.tar"))
    assert np.array_equal(again.frames, clip.frames)
    assert planned[1] < unplanned[1], (planned, unplanned)  # the clip's packets at once
    assert planned[0] <= 0.5 * len(data)
