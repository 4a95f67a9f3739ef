"""Zero-copy reads (``copy=False``): members of mapped local plain shards are read-only views of
the map, equal to the copying reader's bytes; the map lives as long as a view; every other
input gives bytes; decoders, stages and writers take views."""

from __future__ import annotations

import gc
import gzip
import importlib.util
import io
import json
import os
import pathlib
import tarfile
import weakref

import numpy as np
import pytest
from conftest import write_shards
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_tario import (
    FORMATS,
    _member,
    archive_entries,
    build_tarfile,
    local_file,
    tarfile_regular,
)

from tarshards import ShardWriter, TarWriter, WebDataset
from tarshards.codecs.images import IMAGE_MODES
from tarshards.codecs.registry import field_decoder
from tarshards.pipeline.dataset import shard_samples
from tarshards.tario import iter_tar, iter_tar_batches, tar_byte_source
from tarshards.tario.buffer import MappedFile, reader_buffer

WDS_TESTDATA = pathlib.Path(__file__).resolve().parents[2] / ".." / "shared" / "testdata"
WDS_TESTDATA = WDS_TESTDATA / "webdataset"


def _views(path, **kw):
    with open(path, "rb") as f:
        return list(iter_tar(tar_byte_source(f, str(path)), str(path), copy=False, **kw))


def _as_bytes(members):
    return [(n, bytes(d), o) for n, d, o in members]


# ---------------------------------------------------------------------------------------------
# the zero-copy stream equals the copying stream
# ---------------------------------------------------------------------------------------------


# (the archives hold links, which the reader skips with a warning tested on its own)
@pytest.mark.filterwarnings("ignore:.* links to .* is skipped:tarshards.errors.TarshardsWarning")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entries=archive_entries(), fmt=st.sampled_from(sorted(FORMATS)))
def test_views_equal_copies_for_tarfile_archives(entries, fmt):
    try:
        raw = build_tarfile(entries, FORMATS[fmt])
    except ValueError:  # ustar cannot hold this name
        return
    expected = tarfile_regular(raw)
    with local_file(raw) as f:
        src = tar_byte_source(f, "t")
        assert isinstance(src, MappedFile)
        got = list(iter_tar(src, "t", copy=False))
    assert all(type(d) is memoryview and d.readonly for _, d, _ in got)
    assert _as_bytes(got) == expected


@pytest.mark.parametrize("accelerate", [True, False])
def test_c_and_python_fast_paths_give_the_same_views(tmp_path, accelerate):
    entries = [
        ("file", f"k{i:03d}.{ext}", os.urandom(i * 37), "") for i in range(60) for ext in "ab"
    ]
    entries.insert(30, ("file", "L" * 150 + ".x", b"long", ""))  # a GNU long name: general path
    raw = build_tarfile(entries, tarfile.GNU_FORMAT)
    path = tmp_path / "t.tar"
    path.write_bytes(raw)
    with open(path, "rb") as f:
        batches = list(
            iter_tar_batches(tar_byte_source(f, "t"), "t", accelerate=accelerate, copy=False)
        )
    members = [m for batch in batches for m in batch]
    assert all(type(d) is memoryview for _, d, _ in members)
    assert _as_bytes(members) == tarfile_regular(raw)


def test_mid_shard_offsets(tmp_path):
    raw = b"".join(_member(f"s{i}.bin", bytes([i]) * (i * 100)) for i in range(10)) + bytes(1024)
    path = tmp_path / "t.tar"
    path.write_bytes(raw)
    expected = tarfile_regular(raw)
    start = expected[4][2]
    with open(path, "rb") as f:
        f.seek(start)
        got = list(iter_tar(tar_byte_source(f, "t"), "t", offset=start, copy=False))
    assert all(type(d) is memoryview for _, d, _ in got)
    assert _as_bytes(got) == expected[4:]


@pytest.mark.skipif(not WDS_TESTDATA.is_dir(), reason="shared/testdata/webdataset is absent")
@pytest.mark.parametrize("name", ["compressed.tar", "mpdata.tar", "tendata.tar", "testgz.tar"])
def test_webdataset_shards(name):
    if name == "mpdata.tar":
        pytest.importorskip("msgpack", reason="its samples are msgpack (an optional codec)")
    path = WDS_TESTDATA / name
    with open(path, "rb") as f:
        expected = list(iter_tar(tar_byte_source(f, name), name))
    got = _views(path)
    assert expected and _as_bytes(got) == expected
    assert all(type(d) is memoryview for _, d, _ in got)
    # and decoded through a pipeline: the same values
    copied = list(WebDataset(str(path)).decode())
    viewed = list(WebDataset(str(path), copy=False).decode())
    assert len(copied) == len(viewed) > 0
    for a, b in zip(copied, viewed):
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], np.ndarray) or isinstance(a[k], list):
                assert repr(a[k]) == repr(b[k])
            else:
                assert a[k] == b[k], k


# ---------------------------------------------------------------------------------------------
# what is not a mapped plain local file gives bytes
# ---------------------------------------------------------------------------------------------


def test_other_inputs_give_bytes(tmp_path):
    raw = b"".join(_member(f"s{i}.txt", b"v%d" % i) for i in range(5)) + bytes(1024)
    expected = tarfile_regular(raw)
    gz = tmp_path / "t.tar.gz"
    gz.write_bytes(gzip.compress(raw))
    inputs = {
        "gzip file": lambda: open(gz, "rb"),
        "in-memory stream": lambda: io.BytesIO(raw),
    }
    for what, make in inputs.items():
        with make() as f:
            got = list(iter_tar(tar_byte_source(f, what), what, copy=False))
        assert got == expected, what
        assert all(type(d) is bytes for _, d, _ in got), what
    plain = tmp_path / "t.tar"
    plain.write_bytes(raw)
    with open(plain, "rb") as f:  # mapped=False: streamed, bytes
        got = list(iter_tar(tar_byte_source(f, "t", mapped=False), "t", copy=False))
    assert got == expected and all(type(d) is bytes for _, d, _ in got)
    r, w = os.pipe()  # a pipe
    with os.fdopen(w, "wb") as wf:
        wf.write(raw)
    with os.fdopen(r, "rb") as rf:
        got = list(iter_tar(tar_byte_source(rf, "p"), "p", copy=False))
    assert got == expected and all(type(d) is bytes for _, d, _ in got)


# ---------------------------------------------------------------------------------------------
# lifetime: a view keeps the map alive; closing never raises; released pages read right
# ---------------------------------------------------------------------------------------------


def test_views_outlive_the_reader_and_the_last_one_unmaps(tmp_path):
    payloads = [os.urandom(1000 + i) for i in range(20)]
    raw = b"".join(_member(f"s{i:02d}.bin", p) for i, p in enumerate(payloads)) + bytes(1024)
    path = tmp_path / "t.tar"
    path.write_bytes(raw)
    with open(path, "rb") as f:
        src = tar_byte_source(f, "t")
        assert isinstance(src, MappedFile)
        mapping = weakref.ref(src.map)
        views = [d for _, d, _ in iter_tar(src, "t", copy=False)]  # the reader ran to its end
        assert not src.map.closed  # views are alive: closing only let go of it
        src.close()  # closing again, with views alive, does not raise either
    del src
    gc.collect()
    assert mapping() is not None
    keep = views[7]
    del views
    gc.collect()
    assert mapping() is not None and bytes(keep) == payloads[7]
    del keep
    gc.collect()
    assert mapping() is None  # the last view unmapped it


def test_reader_closed_early_with_views_alive(tmp_path):
    raw = b"".join(_member(f"s{i}.bin", bytes([i]) * 700) for i in range(10)) + bytes(1024)
    path = tmp_path / "t.tar"
    path.write_bytes(raw)
    with open(path, "rb") as f:
        it = iter_tar(tar_byte_source(f, "t"), "t", copy=False)
        first = next(it)[1]
        it.close()  # the reader's finally closes the map: must not raise with a view alive
    assert bytes(first) == bytes([0]) * 700
    # and with samples held in a pipeline stage, the shard closed under them
    samples = list(shard_samples(str(path), copy=False))
    assert [bytes(s["bin"])[:1] for s in samples] == [bytes([i]) for i in range(10)]


def test_released_pages_read_right_through_a_live_view(tmp_path):
    """Pages behind the reader are given back (MADV_DONTNEED every 8 MiB); a view taken early
    re-faults them from the page cache after the reader moved 100 MB on."""
    mib = 1 << 20
    path = tmp_path / "big.tar"
    with open(path, "wb") as f:
        for i in range(110):
            f.write(_member(f"m{i:03d}.bin", bytes([i]) * mib))
        f.write(bytes(1024))
    with open(path, "rb") as f:
        src = tar_byte_source(f, "big")
        it = iter_tar(src, "big", copy=False)
        first = next(it)[1]
        rest = 0
        for name, data, offset in it:
            rest += 1
            del data
        assert rest == 109
    assert len(first) == mib and bytes(first) == bytes([0]) * mib
    # and at the buffer's level: pages released under a live view
    with open(path, "rb") as f:
        b = reader_buffer(tar_byte_source(f, "big"))
        view = memoryview(b.buf)[512 : 512 + mib]
        b.release(100 * mib)
        assert b.released >= 96 * mib or not hasattr(__import__("mmap"), "MADV_DONTNEED")
        assert view == bytes([0]) * mib
        b.close()  # a view is alive: no BufferError
        del view


# ---------------------------------------------------------------------------------------------
# decoders, stages and writers take views
# ---------------------------------------------------------------------------------------------


def _values():
    img = np.zeros((24, 32, 3), np.uint8)
    img[4:12, 8:20] = (200, 40, 90)
    values = {
        "txt": "héllo",
        "cls": 7,
        "json": {"a": [1, 2], "b": "ü"},
        "npy": np.arange(6, dtype=np.int16).reshape(2, 3),
        "npz": {"a": np.arange(3)},
        "msgpack": {"a": 1},
        "pyd": {"x": 1},
        "ten": np.arange(4, dtype=np.float32),
        "txt.gz": "zipped",
        "json.gz": {"z": 2},
        "jpg": img,
        "png": img,
    }
    if importlib.util.find_spec("msgpack") is None:  # an optional codec (the lean job has none)
        del values["msgpack"]
    return values


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if hasattr(a, "tobytes") and hasattr(a, "mode"):  # a PIL image
        return a.mode == b.mode and a.size == b.size and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if type(a).__module__ == "torch":
        import torch

        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.fixture
def codec_shard(tmp_path):
    values = _values()
    path = tmp_path / "codecs.tar"
    with TarWriter(str(path)) as w:
        for i in range(3):
            w.write({"__key__": f"k{i}", **values})
    return str(path)


@pytest.mark.parametrize("mode", sorted(IMAGE_MODES))
def test_every_codec_decodes_views(codec_shard, mode):
    if mode.startswith("torch"):
        pytest.importorskip("torch")
    (sample,) = [s for s in shard_samples(codec_shard, copy=False)][:1]
    copied = next(iter(shard_samples(codec_shard)))
    assert all(type(sample[k]) is memoryview for k in _values())
    for ext in _values():
        dec = field_decoder(ext, image_mode=mode, allow_unsafe=True)
        assert dec is not None
        assert _same(dec(copied[ext]), dec(sample[ext])), (ext, mode)
    for ext in ("jpg", "png"):  # and at a reduced size
        dec = field_decoder(ext, image_mode=mode, size=(16, 12))
        assert _same(dec(copied[ext]), dec(sample[ext])), (ext, mode)


def test_pipelines_over_views(codec_shard):
    def run(copy):
        ds = WebDataset(codec_shard, copy=copy, shardshuffle=False)
        return (
            list(ds.decode("rgb8", allow_unsafe=True).to_tuple("jpg", "cls", "json")),
            list(ds.decode("pil", allow_unsafe=True)),
            list(ds.to_tuple("txt", "npy").batched(2)),
        )

    copied, viewed = run(True), run(False)
    for a, b in zip(copied[0] + copied[1], viewed[0] + viewed[1]):
        if isinstance(a, dict):
            assert a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a if k[:2] != "__")
        else:
            assert all(_same(x, y) for x, y in zip(a, b))
    raw = viewed[2]
    assert [type(v) for v in raw[0][0]] == [memoryview, memoryview]  # undecoded: still views
    assert [[bytes(v) for v in f] for b in raw for f in b] == [
        [bytes(v) for v in f] for b in copied[2] for f in b
    ]


def test_random_resized_crop_takes_views(codec_shard):
    torch = pytest.importorskip("torch")
    from tarshards import random_resized_crop

    def run(copy):
        ds = WebDataset(codec_shard, copy=copy, shardshuffle=False, seed=3)
        return list(ds.decode(random_resized_crop(16), only=["jpg"]).to_tuple("jpg"))

    for (a,), (b,) in zip(run(True), run(False)):
        assert torch.equal(a, b)


def test_read_views_then_write(tmp_path, codec_shard):
    """A pipeline that reads zero-copy and writes: TarWriter and ShardWriter take views."""
    out = tmp_path / "out.tar"
    with TarWriter(str(out)) as w:
        for sample in shard_samples(codec_shard, copy=False):
            w.write(sample)
    raw_in = [(n, d) for n, d, _ in tarfile_regular(pathlib.Path(codec_shard).read_bytes())]
    raw_out = [(n, d) for n, d, _ in tarfile_regular(out.read_bytes())]
    assert raw_out == raw_in
    with TarWriter(str(tmp_path / "raw.tar"), encoder=False) as w:  # no encoder: bytes-like kept
        for sample in shard_samples(codec_shard, copy=False):
            w.write(sample)
    again = [(n, d) for n, d, _ in tarfile_regular((tmp_path / "raw.tar").read_bytes())]
    assert again == raw_in
    pattern = str(tmp_path / "part-%02d.tar")
    with ShardWriter(pattern, maxcount=2) as sw:
        for sample in shard_samples(codec_shard, copy=False):
            sw.write(sample)
    parts = sorted(tmp_path.glob("part-*.tar"))
    assert len(parts) == 2
    written = [(n, d) for p in parts for n, d, _ in tarfile_regular(p.read_bytes())]
    assert written == raw_in


def test_webdataset_copy_false_end_to_end(tmp_path):
    paths, samples = write_shards(tmp_path, 3, 10)
    ds = WebDataset(paths, copy=False, shardshuffle=False).shuffle(8, seed=1)
    got = list(ds)
    assert all(type(s["jpg"]) is memoryview for s in got)
    by_key = {s["__key__"]: s for s in samples}
    assert sorted(s["__key__"] for s in got) == sorted(by_key)
    for s in got:
        ref = by_key[s["__key__"]]
        assert bytes(s["jpg"]) == ref["jpg"] and s["cls"] == ref["cls"]
        assert json.loads(bytes(s["json"])) == json.loads(ref["json"])
    tuples = list(WebDataset(paths, copy=False).decode("rgb8").to_tuple("jpg", "cls"))
    assert len(tuples) == 30 and all(isinstance(t[0], np.ndarray) for t in tuples)


def test_decoded_views_through_dataloader_workers(tmp_path):
    torch = pytest.importorskip("torch")
    from tarshards.torch.adapter import WebDataset as TorchWebDataset

    paths, samples = write_shards(tmp_path, 2, 6)
    ds = TorchWebDataset(paths, copy=False).decode("rgb8").to_tuple("jpg", "cls")
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    got = sorted(int(c) for _, c in loader)
    assert got == sorted(int(s["cls"]) for s in samples)


def test_c_scan_slices_the_view_it_is_given():
    from tarshards import tario

    if tario._scan_members is None:
        pytest.skip("the C accelerator is not built")
    buf = bytearray(_member("a.bin", b"12345") + _member("b.bin", b"xy") + bytes(1024))
    members, _pos = tario._scan_members(buf, 0, 0, len(buf), len(buf), memoryview(buf))
    assert [(n, type(d), bytes(d), o) for n, d, o in members] == [
        ("a.bin", memoryview, b"12345", 0),
        ("b.bin", memoryview, b"xy", 1024),
    ]
    buf[512] = ord("9")  # a view, not a copy: it sees the buffer change
    assert bytes(members[0][1]) == b"92345"
    copied, _ = tario._scan_members(buf, 0, 0, len(buf), len(buf), None)
    assert [type(d) for _, d, _ in copied] == [bytes, bytes]
    with pytest.raises(TypeError):
        tario._scan_members(buf, 0, 0, len(buf), len(buf), bytes(buf))
