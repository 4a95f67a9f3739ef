"""The fast paths of converting a folder: the same bytes whatever the number of workers, the
listing's pickled form, the kernel asked to write shards out early, forked workers that inherit
the job instead of unpickling it."""

from __future__ import annotations

import io
import multiprocessing
import os
import pickle
import sys

import pytest
from test_convert_sources import make_imagefolder, read_back

import tarshards
import tarshards.write.writer
from tarshards.convert.sources import FolderSource
from tarshards.parallel.pool import Inherited, ProcessPool, payload_for
from tarshards.storage import AtomicOutput


def _files(folder) -> dict[str, bytes]:
    return {n: (folder / n).read_bytes() for n in sorted(os.listdir(folder))}


def _tree(root) -> dict:
    """An ImageFolder of make_imagefolder's, plus samples of two files, a file without a suffix
    and names whose order differs from their keys' (``a-b.jpg`` sorts before ``a.jpg``)."""
    expected = make_imagefolder(root)
    (root / "bee" / "a-b.jpg").write_bytes(b"ab")
    (root / "bee" / "a.jpg").write_bytes(b"a")
    (root / "bee" / "a.txt").write_bytes(b"caption")
    (root / "bee" / "noext").write_bytes(b"left out: no image")
    expected["bee/a-b"] = {"jpg": b"ab", "cls": b"1"}
    expected["bee/a"] = {"jpg": b"a", "txt": b"caption", "cls": b"1"}
    return expected


def test_same_bytes_with_one_worker_and_two(tmp_path, monkeypatch):
    # writeback requested every 4 kB instead of every 8 MB: the path runs on a small shard
    monkeypatch.setattr(tarshards.write.writer, "WRITEBACK_EVERY", 4096)
    expected = _tree(tmp_path / "train")
    one = tarshards.convert(tmp_path / "train", tmp_path / "one", maxcount=5, workers=1)
    two = tarshards.convert(tmp_path / "train", tmp_path / "two", maxcount=5, workers=2)
    assert read_back(one)[1] == expected
    assert one.num_samples == two.num_samples == len(expected)
    # shards, indexes and manifest byte for byte (the plans differ: they name their outputs)
    a, b = _files(tmp_path / "one"), _files(tmp_path / "two")
    assert a.pop("manifest.json.convert") != b.pop("manifest.json.convert")
    assert len(a) == 2 * 5 + 1 and a == b


@pytest.mark.parametrize("kind", ["imagefolder", "files"])
@pytest.mark.parametrize("sizes", [False, True])
def test_folder_source_pickles_as_it_is(tmp_path, kind, sizes):
    _tree(tmp_path / "train")
    src = FolderSource(tmp_path / "train", kind, sizes=sizes)
    back = pickle.loads(pickle.dumps(src))
    assert back.count() == src.count() and back.identity() == src.identity()
    assert back.sizes() == src.sizes() and back.info() == src.info()
    assert list(back.samples(0, back.count())) == list(src.samples(0, src.count()))
    if kind == "imagefolder":  # a file a sample: paths packed as a string, unpacked the same
        single = FolderSource(tmp_path / "train", kind, sizes=sizes, fields=["jpg", "png"])
        again = pickle.loads(pickle.dumps(single))
        assert isinstance(single.__getstate__()["_paths"], str)
        assert list(again.samples(0, again.count())) == list(single.samples(0, single.count()))
        assert again.identity() == single.identity()


def test_samples_read_by_folder_descriptor_across_many_folders(tmp_path, monkeypatch):
    """More folders than the descriptors kept open (they are closed and opened again)."""
    import tarshards.convert.sources as sources

    monkeypatch.setattr(sources, "_OPEN_FOLDERS", 3)
    root = tmp_path / "files"
    want = {}
    for i in range(8):
        (root / f"d{i}").mkdir(parents=True)
        for j in range(2):
            want[f"d{i}/s{j}"] = f"{i}-{j}".encode()
            (root / f"d{i}" / f"s{j}.txt").write_bytes(want[f"d{i}/s{j}"])
    src = FolderSource(root, "files")
    got = {key: dict(members)["txt"] for key, members in src.samples(0, src.count())}
    assert got == want
    got = {key: dict(members)["txt"] for key, members in src.samples(5, 9)}
    assert list(got) == sorted(want)[5:9]


def test_start_writeback_keeps_the_bytes(tmp_path):
    path = tmp_path / "f.bin"
    chunks = [os.urandom(3000 + i) for i in range(10)]
    with AtomicOutput(path) as out:
        assert out.can_write_back == sys.platform.startswith("linux")
        for c in chunks:
            out.stream.write(c)
            out.start_writeback()
        out.start_writeback()  # nothing new: no call
        assert not path.exists()
    assert path.read_bytes() == b"".join(chunks)
    stream = io.BytesIO()
    with AtomicOutput(stream) as out:  # not a temporary file: nothing to do
        assert not out.can_write_back
        out.stream.write(b"x")
        out.start_writeback()
    assert stream.getvalue() == b"x"


def _double(x):
    return 2 * x


def test_forked_workers_inherit_the_function():
    if "fork" in multiprocessing.get_all_start_methods():
        payload = payload_for(_double, "fork")
        assert isinstance(payload, Inherited)
        with ProcessPool(1, payload, "fork") as pool:
            assert pool.submit(1, (21,))
            assert pool.events() == [("ok", 1, 42, None)]
        with pytest.raises(ValueError, match="forked"):
            ProcessPool(1, Inherited(_double), "spawn")
    assert isinstance(payload_for(_double, "spawn"), bytes)  # pickled for spawned workers
