"""Audio and video from tar members, on media encoded here (see conftest.py)."""

from __future__ import annotations

import io
import pickle
import random

import numpy as np
import pytest

from .conftest import encode_audio, frame_level, full_decode, make_tone, make_video

av = pytest.importorskip("av")
sf = pytest.importorskip("soundfile")

import tarshards  # noqa: E402
from tarshards import DecodeError, IndexedDataset, ShardWriter, TarWriter  # noqa: E402
from tarshards.media.probe import probe  # noqa: E402
from tarshards.pipeline.dataset import WebDataset  # noqa: E402
from tarshards.testing import check_resume  # noqa: E402


def _index_of(timestamps, times):
    return [times.index(float(t)) for t in timestamps]


# ---------------------------------------------------------------------------------------------
# video clips
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stride", [1, 3])
def test_random_clips_are_the_consecutive_frames_of_a_full_decode(video_100, stride):
    frames, times = full_decode(video_100)
    dec = tarshards.video(frames=8, stride=stride, output="numpy")
    starts = set()
    for seed in range(6):
        clip = dec.decode(video_100, random.Random(seed))
        assert clip.frames.shape == (8, 48, 64, 3) and clip.frames.dtype == np.uint8
        idx = _index_of(clip.timestamps, times)
        assert np.diff(idx).tolist() == [stride] * 7  # consecutive (every stride-th) frames
        for i, f in zip(idx, clip.frames):
            assert np.array_equal(f, frames[i])
            assert abs(int(f.mean()) - frame_level(i)) <= 3  # the frame carries its index
        starts.add(idx[0])
    assert len(starts) > 1  # the clip's start is drawn


def test_start_center_all_and_fps(video_100):
    frames, times = full_decode(video_100)
    clip = tarshards.video(frames=4, clip="start", output="numpy").decode(video_100)
    assert _index_of(clip.timestamps, times) == [0, 1, 2, 3]
    clip = tarshards.video(frames=4, clip="center", output="numpy").decode(video_100)
    assert _index_of(clip.timestamps, times) == [48, 49, 50, 51]
    clip = tarshards.video(clip="all", stride=10, output="numpy").decode(video_100)
    assert _index_of(clip.timestamps, times) == list(range(0, 100, 10))
    assert all(np.array_equal(f, frames[i]) for i, f in zip(range(0, 100, 10), clip.frames))
    # 5 frames a second from a 25 fps video: every 5th frame
    clip = tarshards.video(frames=6, fps=5, clip="start", output="numpy").decode(video_100)
    assert _index_of(clip.timestamps, times) == [0, 5, 10, 15, 20, 25]
    clip = tarshards.video(frames=3, clip="start", size=(24, 32), output="numpy").decode(video_100)
    assert clip.frames.shape == (3, 24, 32, 3)
    clip = tarshards.video(frames=2, clip="start", size=24, output="numpy").decode(video_100)
    assert clip.frames.shape == (2, 24, 32, 3)  # the shorter side


def test_a_short_video_repeats_its_last_frame():
    data = make_video(5)
    clip = tarshards.video(frames=8, output="numpy").decode(data, random.Random(0))
    _frames, times = full_decode(data)
    assert _index_of(clip.timestamps, times) == [0, 1, 2, 3, 4, 4, 4, 4]


def test_clips_of_webm_and_h264():
    for fmt, codec in [("webm", "libvpx"), ("mp4", "libx264")]:
        if codec not in av.codecs_available:
            continue
        data = make_video(40, fmt=fmt, codec=codec)
        frames, times = full_decode(data)
        clip = tarshards.video(frames=5, stride=2, output="numpy").decode(data, random.Random(4))
        idx = _index_of(clip.timestamps, times)
        assert np.diff(idx).tolist() == [2] * 4
        assert all(np.array_equal(f, frames[i]) for i, f in zip(idx, clip.frames))


def test_arguments_are_checked():
    with pytest.raises(ValueError):
        tarshards.video(frames=0)
    with pytest.raises(ValueError):
        tarshards.video(clip="middle")
    with pytest.raises(ValueError):
        tarshards.video(stride=2, fps=4)
    with pytest.raises(ValueError):
        tarshards.audio(seconds=0)
    with pytest.raises(ValueError):
        tarshards.audio(clip="end")


def test_threads_option_decodes_the_same_frames(video_100):
    """One decoding thread (``threads=1``), FFmpeg's choice (0) and the chosen number (None),
    threads on slices, on frames or both, give the same clip."""
    a = tarshards.video(frames=6, output="numpy").decode(video_100, random.Random(3))
    for threads in (0, 1, 2):
        for kind in ("slice", "frame", "auto"):
            dec = tarshards.video(frames=6, output="numpy", threads=threads, thread_type=kind)
            b = dec.decode(video_100, random.Random(3))
            assert np.array_equal(a.frames, b.frames)
            assert np.array_equal(a.timestamps, b.timestamps)
    with pytest.raises(ValueError, match="threads"):
        tarshards.video(threads=-1)
    with pytest.raises(ValueError, match="thread_type"):
        tarshards.video(thread_type="frames")


def _chosen_threads(_=None):
    from tarshards.media.probe import decoder_threads

    return decoder_threads()


def test_threads_are_chosen_where_the_decoder_runs():
    """A lone process leaves the threads to FFmpeg (0); a DataLoader worker takes its share of
    the cores (cores // workers, at least 1); another worker process (a pool's) takes 1."""
    import multiprocessing
    import os

    from tarshards.media.probe import decoder_threads

    assert decoder_threads(3) == 3 and decoder_threads(0) == 0
    if multiprocessing.parent_process() is None:
        assert decoder_threads() == 0
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.map(_chosen_threads, [0]) == [1]
    pytest.importorskip("torch")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ds = tarshards.DataPipeline(lambda ctx: iter(range(2))).map(_chosen_threads)
    for workers in (1, 2):
        got = set(tarshards.WebLoader(ds, num_workers=workers, batch_size=None))
        assert got == {max(1, cores // workers)}


def test_frames_of_any_width_equal_a_full_decode():
    """Frames whose RGB rows are not a multiple of 64 bytes (FFmpeg pads its lines) come out
    whole, equal to PyAV's own conversion; the scaler kept between clips follows a change of
    size."""
    for width, height in ((50, 36), (64, 48), (50, 36)):
        data = make_video(30, width=width, height=height)
        frames, times = full_decode(data)
        dec = tarshards.video(frames=4, output="numpy")
        clip = dec.decode(data, random.Random(width))
        assert clip.frames.shape == (4, height, width, 3)
        idx = _index_of(clip.timestamps, times)
        assert all(np.array_equal(f, frames[i]) for i, f in zip(idx, clip.frames))
        # a decoder that has run pickles (for spawned workers) without its scaler
        again = pickle.loads(pickle.dumps(dec)).decode(data, random.Random(width))
        assert np.array_equal(again.frames, clip.frames)


def test_tensor_output_where_torch_is_installed(video_100):
    torch = pytest.importorskip("torch")
    clip = tarshards.video(frames=2, clip="start").decode(video_100)
    assert isinstance(clip.frames, torch.Tensor) and clip.frames.dtype == torch.uint8
    assert tuple(clip.frames.shape) == (2, 48, 64, 3)
    tone = encode_audio(make_tone(0.5), 8000)
    got = tarshards.audio().decode(tone)
    assert isinstance(got.samples, torch.Tensor) and got.samples.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# audio
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["WAV", "FLAC"])
def test_audio_spans_equal_soundfile(fmt):
    x = make_tone(3.0, rate=8000, channels=2)
    data = encode_audio(x, 8000, fmt)
    ref, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    whole = tarshards.audio(output="numpy").decode(data)
    assert whole.rate == rate == 8000 and np.array_equal(whole.samples, ref.T)
    dec = tarshards.audio(seconds=0.5, output="numpy")
    spans = set()
    for seed in range(5):
        got = dec.decode(data, random.Random(seed))
        s = got.samples
        assert s.shape == (2, 4000) and s.dtype == np.float32
        # where the span starts: the first place it matches
        hits = [
            k
            for k in np.flatnonzero(ref[:, 0] == s[0, 0]).tolist()
            if np.array_equal(ref[k : k + 4000].T, s)
        ]
        assert hits, "the span is not a span of the file"
        spans.add(hits[0])
    assert len(spans) > 1
    got = tarshards.audio(seconds=1, clip="center", output="numpy").decode(data)
    assert np.array_equal(got.samples, ref[8000:16000].T)
    got = tarshards.audio(seconds=5, clip="start", output="numpy").decode(data)
    assert np.array_equal(got.samples[:, :24000], ref.T) and not got.samples[:, 24000:].any()


def test_audio_resampled_and_mono():
    x = make_tone(1.0, rate=8000, channels=2, freq=100.0)
    data = encode_audio(x, 8000)
    got = tarshards.audio(rate=16000, mono=True, output="numpy").decode(data)
    assert got.rate == 16000 and got.samples.shape[0] == 1
    assert abs(got.samples.shape[1] - 16000) <= 64
    ref = x.mean(axis=1)
    # the resampled signal at even positions is the signal (within the filter's error)
    n = min(len(ref), got.samples.shape[1] // 2) - 200
    assert np.abs(got.samples[0, 0 : 2 * n : 2][100:] - ref[100:n]).max() < 0.05


def test_audio_writing_from_arrays(tmp_path):
    x = make_tone(0.5, rate=16000, channels=2)
    path = str(tmp_path / "a.tar")
    with TarWriter(path) as w:
        w.write({"__key__": "a", "flac": (x, 16000), "wav": x.T})  # (channels, samples) too
    torch = None
    try:
        import torch
    except ImportError:
        pass
    if torch is not None:
        with TarWriter(str(tmp_path / "t.tar")) as w:
            w.write({"__key__": "t", "wav": (torch.from_numpy(x.T.copy()), 8000)})
        (s,) = list(WebDataset(str(tmp_path / "t.tar")))
        back, rate = sf.read(io.BytesIO(s["wav"]), dtype="float32")
        assert rate == 8000 and back.shape == (8000, 2)
    (s,) = list(WebDataset(path))
    assert isinstance(s["flac"], bytes) and isinstance(s["wav"], bytes)  # audio stays bytes
    for ext in ("flac", "wav"):
        back, rate = sf.read(io.BytesIO(s[ext]), dtype="float32")
        assert rate == 16000 and back.shape == x.shape
        assert np.abs(back - x).max() < 1e-4  # 16-bit PCM
    got = next(iter(WebDataset(path).decode(tarshards.audio(output="numpy"))))["flac"]
    assert got.rate == 16000 and np.abs(got.samples - x.T).max() < 1e-4


# ---------------------------------------------------------------------------------------------
# metadata
# ---------------------------------------------------------------------------------------------


def test_probe_equals_pyav_and_pillow(video_100):
    from PIL import Image

    info = probe(video_100, "mp4")
    with av.open(io.BytesIO(video_100)) as c:
        s = c.streams.video[0]
        assert info["width"] == s.codec_context.width == 64
        assert info["height"] == s.codec_context.height == 48
        assert info["fps"] == float(s.average_rate) == 25.0
        assert info["frames"] == s.frames == 100
        assert info["duration"] == pytest.approx(float(s.duration * s.time_base)) == 4.0
        assert info["codec"] == s.codec_context.name
    tone = encode_audio(make_tone(1.5, rate=22050, channels=2), 22050, "FLAC")
    info = probe(tone, "flac")
    fi = sf.info(io.BytesIO(tone))
    assert (info["rate"], info["channels"]) == (fi.samplerate, fi.channels) == (22050, 2)
    assert info["duration"] == pytest.approx(fi.duration)
    buf = io.BytesIO()
    Image.new("RGB", (37, 21)).save(buf, format="JPEG")
    assert probe(buf.getvalue(), "jpg") == {"width": 37, "height": 21}
    assert probe(b"{}", "json") == {}


def test_media_meta_columns_through_the_writer_and_the_manifest(tmp_path, video_100):
    from PIL import Image

    rng = np.random.default_rng(0)
    samples = []
    for i in range(7):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (10 + i, 20 + 2 * i, 3), np.uint8)).save(
            buf, format="JPEG"
        )
        s = {"__key__": f"k{i}", "jpg": buf.getvalue(), "cls": i}
        if i % 2 == 0:
            s["mp4"] = make_video(5 + i)
            s["flac"] = (make_tone(0.25 * (i + 1), rate=8000), 8000)
        samples.append(s)
    with ShardWriter(
        str(tmp_path / "m-%02d.tar"),
        maxcount=3,
        manifest=str(tmp_path / "m.json"),
        meta=[tarshards.media_meta(), {"tokens": lambda s: 10 * s["cls"]}],
    ) as w:
        for s in samples:
            w.write(s)
    m = tarshards.Manifest.load(str(tmp_path / "m.json"))
    assert len(m.shards) == 3
    assert m.meta("jpg.width").tolist() == [20 + 2 * i for i in range(7)]
    assert m.meta("jpg.height").tolist() == [10 + i for i in range(7)]
    assert m.meta("tokens").tolist() == [10 * i for i in range(7)]
    frames = m.meta("mp4.frames")
    assert frames[0::2].tolist() == [5, 7, 9, 11] and np.isnan(frames[1::2]).all()
    assert m.meta("mp4.fps")[0] == 25.0
    assert m.meta("flac.duration")[0::2].tolist() == [0.25, 0.75, 1.25, 1.75]
    assert m.meta("flac.rate")[2] == 8000
    assert "mp4.duration" in m.meta_columns()
    with pytest.raises(KeyError):
        m.meta("nothing")


def test_index_media_adds_the_columns_to_existing_indexes(tmp_path, video_100):
    from tarshards.media.metadata import add_media_meta

    with ShardWriter(str(tmp_path / "x-%02d.tar"), maxcount=2, manifest=tmp_path / "x.json") as w:
        for i in range(3):
            w.write({"__key__": f"k{i}", "mp4": make_video(4 + i), "txt": "x"})
    m = tarshards.Manifest.load(str(tmp_path / "x.json"))
    with pytest.raises(KeyError):
        m.meta("mp4.frames")
    add_media_meta(m)
    m = tarshards.Manifest.load(str(tmp_path / "x.json"))
    assert m.meta("mp4.frames").tolist() == [4, 5, 6]
    assert m.meta("mp4.width").tolist() == [64, 64, 64]
    # the data and the rest of the index are unchanged: random access still reads it
    assert IndexedDataset(m)[2]["txt"] == b"x"


# ---------------------------------------------------------------------------------------------
# pipelines, random access, errors
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def video_shard(tmp_path_factory):
    d = tmp_path_factory.mktemp("videos")
    data = make_video(60)
    with ShardWriter(str(d / "v-%02d.tar"), maxcount=5, manifest=str(d / "v.json")) as w:
        for i in range(10):
            w.write({"__key__": f"v{i:03d}", "mp4": data, "cls": i})
    return d, data


def test_pipeline_clips_resume_exactly(video_shard):
    d, _ = video_shard
    urls = [str(d / "v-00.tar"), str(d / "v-01.tar")]

    def make():
        return (
            WebDataset(urls, seed=5, shardshuffle=True)
            .shuffle(4)
            .decode(tarshards.video(frames=3, stride=2, output="numpy"))
            .map(lambda s: (s["__key__"], s["mp4"].timestamps.tolist()))
            .batched(3)
        )

    ref = check_resume(make, epochs=2, resumes_in_one_epoch=2)
    assert ref[0] != ref[1]  # another epoch, other clips


def test_indexed_dataset_reads_clips_from_byte_ranges(video_shard):
    d, data = video_shard
    ds = IndexedDataset(str(d / "v.json"), decode=tarshards.video(frames=4, output="numpy"))
    frames, times = full_decode(data)
    s = ds[7]
    assert s["__key__"] == "v007" and s["cls"] == 7
    idx = _index_of(s["mp4"].timestamps, times)
    assert np.diff(idx).tolist() == [1, 1, 1]
    assert all(np.array_equal(f, frames[i]) for i, f in zip(idx, s["mp4"].frames))


def test_read_media_from_a_members_range(video_shard):
    d, data = video_shard
    m = tarshards.Manifest.load(str(d / "v.json"))
    idx = m.load_index(0)
    j = idx.keys.index("v003")
    ms = idx.member_starts
    exts = [idx.extensions[e] for e in idx.member_ext[ms[j] : ms[j + 1]]]
    k = ms[j] + exts.index("mp4")
    offset, size = int(idx.member_data_offsets[k]), int(idx.member_sizes[k])
    stats: dict = {}
    clip = tarshards.read_media(
        m.shard_urls()[0],
        offset,
        size,
        tarshards.video(frames=3, clip="center", output="numpy"),
        stats=stats,
    )
    ref = tarshards.video(frames=3, clip="center", output="numpy").decode(data)
    assert np.array_equal(clip.frames, ref.frames)
    assert stats["bytes_fetched"] <= size + (64 << 10)


def _bad_shard(path):
    good = make_video(20)
    tone = encode_audio(make_tone(0.5), 8000)
    with TarWriter(path) as w:
        w.write({"__key__": "ok0", "mp4": good})
        w.write({"__key__": "cut", "mp4": good[: len(good) // 3]})  # truncated
        w.write({"__key__": "wav", "mp4": tone})  # audio named .mp4: no video stream
        w.write({"__key__": "txt", "mp4": b"this is not a video at all" * 20})
        w.write({"__key__": "ok1", "mp4": good})


def test_bad_media_is_a_data_error_under_the_policy(tmp_path):
    path = str(tmp_path / "bad.tar")
    _bad_shard(path)
    dec = tarshards.video(frames=4, clip="center", output="numpy")
    for key in ("cut", "wav", "txt"):
        ds = WebDataset(path).select(lambda s, key=key: s["__key__"] == key).decode(dec)
        with pytest.raises(DecodeError) as err:
            list(ds)
        e = err.value
        assert e.url == path and e.member == f"{key}.mp4" and e.offset is not None, str(e)
        assert path in str(e) and f"{key}.mp4" in str(e)
    ok = [s["__key__"] for s in WebDataset(path, on_error="skip").decode(dec)]
    assert ok == ["ok0", "ok1"]


def test_bad_media_through_random_access(tmp_path):
    from tarshards.format.manifest import build_manifest

    path = str(tmp_path / "bad.tar")
    _bad_shard(path)
    build_manifest([path], str(tmp_path / "bad.json"))
    ds = IndexedDataset(str(tmp_path / "bad.json"), decode=tarshards.video(output="numpy"))
    assert ds[0]["mp4"].frames.shape[0] == 16
    for i, key in [(1, "cut"), (3, "txt")]:
        with pytest.raises(DecodeError) as err:
            ds[i]
        e = err.value
        assert e.url == path and e.member == f"{key}.mp4" and e.offset is not None, str(e)


def test_index_metadata_columns_keep_old_indexes_and_survive_bytes(tmp_path):
    import pickle

    from tarshards.format.index import ShardIndex

    with ShardWriter(str(tmp_path / "o-%02d.tar"), manifest=str(tmp_path / "o.json")) as w:
        for i in range(4):
            w.write({"__key__": f"k{i}", "txt": "x" * i})
    m = tarshards.Manifest.load(str(tmp_path / "o.json"))
    old = m.load_index(0)
    assert old.meta == {} and b'"meta"' not in old.to_bytes()  # the bytes it always had
    new = old.with_meta({"tokens": [1, 2, 3, 4]})
    assert new != old and new.with_meta({}) == new
    again = ShardIndex.from_bytes(new.to_bytes())
    assert again == new and again.meta["tokens"].tolist() == [1, 2, 3, 4]
    assert pickle.loads(pickle.dumps(new)).meta["tokens"].tolist() == [1, 2, 3, 4]
    # the arrays before the columns are the old index's: readers that stop there see it
    assert again.keys == old.keys and again.member_sizes.tolist() == old.member_sizes.tolist()
    with pytest.raises(ValueError):
        old.with_meta({"tokens": [1, 2]})
    with pytest.raises(ValueError):
        ShardWriter(str(tmp_path / "p-%02d.tar"), meta={"tokens": len})  # no manifest


def test_batches_of_clips(tmp_path):
    path = str(tmp_path / "b.tar")
    with TarWriter(path) as w:
        for i in range(4):
            w.write(
                {
                    "__key__": f"b{i}",
                    "mp4": make_video(20),
                    "wav": (make_tone(1.0), 8000),
                    "cls": i,
                }
            )
    ds = (
        WebDataset(path)
        .decode(tarshards.video(frames=3, output="numpy"), tarshards.audio(seconds=0.25))
        .to_tuple("mp4", "wav", "cls")
        .batched(2)
    )
    batches = list(ds)
    assert len(batches) == 2
    v, a, c = batches[0]
    assert isinstance(v, tarshards.VideoClip) and v.frames.shape == (2, 3, 48, 64, 3)
    assert v.timestamps.shape == (2, 3)
    assert isinstance(a, tarshards.AudioClip) and tuple(a.samples.shape) == (2, 1, 2000)
    assert a.rate == 8000 and c.tolist() == [0, 1]
    # recordings of different lengths stay a list
    whole = WebDataset(path).decode(tarshards.audio()).to_tuple("wav").batched(2)
    (a,), _ = list(whole)
    assert tuple(a.samples.shape) == (2, 1, 8000)


def test_a_samples_clip_does_not_depend_on_the_worker_that_reads_it(video_shard):
    pytest.importorskip("torch")
    d, _ = video_shard
    urls = [str(d / "v-00.tar"), str(d / "v-01.tar")]

    def clips(workers, epoch=0):
        ds = (
            tarshards.WebDataset(urls, seed=9)
            .decode(tarshards.video(frames=2, output="numpy"))
            .to_tuple("__key__", "mp4")
            .map_tuple(None, lambda c: float(c.timestamps[0]))
        )
        ds.set_epoch(epoch)
        if not workers:
            return dict(ds)
        return dict(tarshards.WebLoader(ds, num_workers=workers, batch_size=None))

    one = clips(0)
    assert clips(2) == one  # (seed, epoch, key) alone choose the clip
    assert clips(0, epoch=1) != one


def test_bad_media_in_loader_workers_is_skipped_under_the_policy(tmp_path):
    pytest.importorskip("torch")
    path = str(tmp_path / "bad.tar")
    _bad_shard(path)
    ds = (
        tarshards.WebDataset(path, on_error="skip")  # the torch IterableDataset
        .decode(tarshards.video(frames=2, output="numpy"))
        .to_tuple("__key__", "mp4")
        .map_tuple(None, lambda c: c.frames.shape)
    )
    got = list(tarshards.WebLoader(ds, num_workers=1, batch_size=None))
    assert [(k, tuple(s)) for k, s in got] == [("ok0", (2, 48, 64, 3)), ("ok1", (2, 48, 64, 3))]
