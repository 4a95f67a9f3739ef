"""A clip of a remote member reads a small part of it (bytes counted at the HTTP server)."""

from __future__ import annotations

import numpy as np
import pytest

from .conftest import full_decode, make_video

pytest.importorskip("av")
pytest.importorskip("aiohttp", reason="HTTP reading needs aiohttp (tarshards[http])")

import tarshards  # noqa: E402
from tarshards import IndexedDataset, ShardWriter  # noqa: E402

from conftest import load_servers  # noqa: E402  (tests/conftest.py)

HTTPFileServer = load_servers().HTTPFileServer


def test_a_2s_clip_of_a_60s_remote_member_reads_under_a_quarter_of_it(tmp_path):
    data = make_video(600, fps=10, texture=True)  # 60 s
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
