"""The commands on media: tarshards index --media, tarshow, tarshards bench."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from .conftest import make_tone, make_video

av = pytest.importorskip("av")

import tarshards  # noqa: E402
from tarshards import ShardWriter, TarWriter  # noqa: E402

SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")


def _run(*args):
    env = dict(os.environ, PYTHONPATH=os.path.abspath(SRC))
    return subprocess.run(
        [sys.executable, "-m", "tarshards.cli.main", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_index_media_records_the_columns(tmp_path):
    for n in range(2):
        with TarWriter(str(tmp_path / f"c-{n}.tar")) as w:
            for i in range(2):
                w.write({"__key__": f"k{n}{i}", "mp4": make_video(3 + 2 * n + i), "cls": i})
    out = _run(
        "index",
        "--media",
        "--keyframes",
        "-q",
        str(tmp_path / "c-{0..1}.tar"),
        "-o",
        str(tmp_path / "c.json"),
    )
    assert out.returncode == 0, out.stderr
    m = tarshards.Manifest.load(str(tmp_path / "c.json"))
    assert m.meta("mp4.frames").tolist() == [3, 4, 5, 6]
    assert m.meta("mp4.fps").tolist() == [25.0] * 4
    assert m.meta("mp4.duration").tolist() == pytest.approx([0.12, 0.16, 0.2, 0.24])
    index = m.load_index(1)
    members, times, _ = index.keyframe_table
    exts = [index.extensions[e] for e in index.member_ext.tolist()]
    videos = [k for k, e in enumerate(exts) if e == "mp4"]
    assert sorted(set(members.tolist())) == videos
    for k, data in zip(videos, [make_video(5), make_video(6)]):
        with av.open(io.BytesIO(data)) as c:
            s = c.streams.video[0]
            ref = [float(p.pts * s.time_base) for p in c.demux(s) if p.is_keyframe]
        assert times[members == k].tolist() == ref
    assert _run("index", "--keyframes", str(tmp_path / "c-0.tar"), "-o", "x.json").returncode == 2


def test_tarshow_shows_duration_and_a_poster_frame(tmp_path):
    path = str(tmp_path / "s.tar")
    with TarWriter(path) as w:
        w.write({"__key__": "a", "mp4": make_video(50), "flac": (make_tone(1.5), 8000)})
    out = _run("show", path, "--images", str(tmp_path / "grid.png"))
    assert out.returncode == 0, out.stderr
    assert "video 64x48, 25 fps, 2.00 s, 50 frames" in out.stdout
    assert "audio 1 ch, 8000 Hz, 1.50 s, flac" in out.stdout
    from PIL import Image

    with Image.open(tmp_path / "grid.png") as img:
        assert img.width > 0


def test_bench_names_the_decode_time_of_media_fields(tmp_path):
    from tarshards.benchmark import bench_pipeline, dataset_from_options, format_report

    with ShardWriter(str(tmp_path / "b-%02d.tar"), maxcount=100) as w:
        for i in range(12):
            w.write({"__key__": f"k{i}", "mp4": make_video(60), "txt": "caption"})
    spec = str(tmp_path / "b-00.tar")
    ds = dataset_from_options(spec, media=True, frames=4)
    report = bench_pipeline(spec, ds, max_samples=12, seconds_per_stage=3, workers=0)
    fields = report["field_decode_us"]
    assert set(fields) == {"mp4", "txt"} and fields["mp4"] > fields["txt"]
    assert "field decode" in format_report(report) and ".mp4" in format_report(report)
    if report["bottleneck"] == "decode":
        assert "slowest field is .mp4" in report["diagnosis"]
