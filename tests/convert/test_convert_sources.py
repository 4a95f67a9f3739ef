"""tarshards.convert from each kind of source: counts, keys and bytes of the shards checked
against the source; the manifest's info (class names); the plan's checks; the engines."""

from __future__ import annotations

import io
import json
import os
import wave

import numpy as np
import pytest
from PIL import Image

import tarshards
from tarshards.convert import detect_kind, format_of
from tarshards.format.manifest import Manifest
from tarshards.pipeline.dataset import iter_samples

# the Hugging Face tests never reach the Hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def image_bytes(seed: int, fmt: str = "JPEG", size=(12, 10)) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(
        buf, format=fmt
    )
    return buf.getvalue()


def wav_bytes(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(rng.integers(-3000, 3000, 400, dtype=np.int16).tobytes())
    return buf.getvalue()


def read_back(manifest: Manifest) -> tuple[list[str], dict[str, dict[str, bytes]]]:
    """Keys in order, and key -> {ext: bytes}, read from the shards (index checked too)."""
    keys, samples = [], {}
    for s in iter_samples(manifest.shard_urls()):
        keys.append(s["__key__"])
        samples[s["__key__"]] = {k: bytes(v) for k, v in s.items() if not k.startswith("__")}
    assert len(samples) == len(keys), "duplicate keys"
    assert manifest.num_samples == len(keys)
    for i, rec in enumerate(manifest.shards):  # each shard's index agrees with the shard
        assert manifest.load_index(i).num_samples == rec.samples
    return keys, samples


# ---- folders ------------------------------------------------------------------------------------


def make_imagefolder(root) -> dict[str, dict[str, bytes]]:
    """3 classes of JPEG/PNG images (one with a JSON sidecar, one with dots in its name), a
    file that is not an image (left out), hidden files; returns key -> members expected."""
    expected: dict[str, dict[str, bytes]] = {}
    counts = {"ant": 5, "bee": 7, "cat": 4}
    for c, (name, n) in enumerate(sorted(counts.items())):
        d = root / name
        (d / "sub").mkdir(parents=True)
        for i in range(n):
            data = image_bytes(c * 100 + i)
            where = d / "sub" if i == 0 else d
            (where / f"img{i:02d}.jpg").write_bytes(data)
            key = f"{name}/sub/img{i:02d}" if i == 0 else f"{name}/img{i:02d}"
            expected[key] = {"jpg": data, "cls": str(c).encode()}
        png = image_bytes(c, "PNG")
        (d / "x.y.PNG").write_bytes(png)
        expected[f"{name}/x_y"] = {"png": png, "cls": str(c).encode()}
        (d / "img01.json").write_bytes(b'{"note": 1}')
        expected[f"{name}/img01"]["json"] = b'{"note": 1}'
        (d / "notes.txt").write_bytes(b"not an image")
        (d / ".hidden.jpg").write_bytes(b"x")
    (root / ".git").mkdir()
    return expected


def test_imagefolder(tmp_path):
    expected = make_imagefolder(tmp_path / "train")
    assert detect_kind(tmp_path / "train") == "imagefolder"
    m = tarshards.convert(tmp_path / "train", tmp_path / "out", maxcount=4, workers=1)
    assert isinstance(m, Manifest)
    assert m.info["classes"] == ["ant", "bee", "cat"]
    assert Manifest.load(tmp_path / "out" / "manifest.json").info["classes"] == [
        "ant",
        "bee",
        "cat",
    ]
    keys, samples = read_back(m)
    assert keys == sorted(keys, key=lambda k: (k.split("/")[0], k)) and len(keys) == 19
    assert samples == expected
    assert [r.samples for r in m.shards] == [4, 4, 4, 4, 3]
    assert all(os.path.exists(u + ".tsidx") for u in m.shard_urls())


def test_files_grouped_by_name(tmp_path):
    src = tmp_path / "pairs"
    (src / "part2").mkdir(parents=True)
    expected = {
        "a": {"jpg": image_bytes(1), "json": b'{"w": 12}', "txt": "un chat é".encode()},
        "b": {"jpg": image_bytes(2), "txt": b"a dog"},
        "part2/c": {"jpg": image_bytes(3), "seg.png": image_bytes(4, "PNG")},
        "part2/d": {"bin": b"\x00\x01"},
    }
    for key, members in expected.items():
        for ext, data in members.items():
            name = f"{key}.{ext}" if ext != "bin" else key
            (src / name).write_bytes(data)
    assert detect_kind(src) == "files"
    m = tarshards.convert(src, str(tmp_path / "out" / "p-%04d.tar.gz"), maxcount=3, workers=1)
    assert m.url == str(tmp_path / "out" / "p.json")
    assert [os.path.basename(u) for u in m.shard_urls()] == ["p-0000.tar.gz", "p-0001.tar.gz"]
    keys, samples = read_back(m)
    assert keys == ["a", "b", "part2/c", "part2/d"]
    assert samples == expected
    with open(m.shard_urls()[0], "rb") as f:
        assert f.read(2) == b"\x1f\x8b"  # gzip, by the suffix


def test_maxsize_cuts_shards_by_file_sizes(tmp_path):
    src = tmp_path / "f"
    src.mkdir()
    for i in range(10):
        (src / f"s{i}.bin").write_bytes(bytes([i]) * 3000)
    m = tarshards.convert(src, tmp_path / "o", maxsize=10_000, workers=1)
    assert [r.samples for r in m.shards] == [2, 2, 2, 2, 2]
    assert read_back(m)[1]["s7"]["bin"] == bytes([7]) * 3000


# ---- Parquet -----------------------------------------------------------------------------------


def _parquet_table(start: int, n: int):
    pa = pytest.importorskip("pyarrow")
    rows = range(start, start + n)
    return pa.table(
        {
            "image": pa.array([image_bytes(i) for i in rows], pa.binary()),
            "mask": pa.array([image_bytes(i, "PNG") for i in rows], pa.large_binary()),
            "caption": [f"picture {i}" if i % 5 else None for i in rows],
            "label": pa.array([i % 3 for i in rows], pa.int32()),
            "info": [{"w": 12, "h": 10, "i": i} for i in rows],
            "tags": [[f"t{i}", "x"] for i in rows],
            "score": [i / 4 for i in rows],
        }
    )


def test_parquet_dataset_folder(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    src = tmp_path / "pq"
    (src / "b").mkdir(parents=True)
    pq.write_table(_parquet_table(0, 9), src / "a.parquet", row_group_size=4)
    pq.write_table(_parquet_table(9, 6), src / "b" / "part.parquet", row_group_size=4)
    (src / "_SUCCESS").write_bytes(b"")
    assert detect_kind(src) == "parquet"
    m = tarshards.convert(src, tmp_path / "out", maxcount=5, workers=1)
    keys, samples = read_back(m)
    assert keys == [f"{i:06d}" for i in range(15)]
    for i in range(15):
        s = samples[f"{i:06d}"]
        assert s["jpg"] == image_bytes(i) and s["png"] == image_bytes(i, "PNG")
        assert s["cls"] == str(i % 3).encode()
        assert json.loads(s["info.json"]) == {"w": 12, "h": 10, "i": i}
        assert json.loads(s["tags.json"]) == [f"t{i}", "x"]
        assert s["score.txt"] == str(i / 4).encode()
        if i % 5:
            assert s["caption.txt"] == f"picture {i}".encode()
        else:
            assert "caption.txt" not in s  # a null: no member
    assert [r.samples for r in m.shards] == [5, 5, 5]


def test_parquet_options_key_fields_extensions(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = _parquet_table(0, 6).append_column("id", pa.array([f"r{i}" for i in range(6)]))
    pq.write_table(table, tmp_path / "t.parquet")
    m = tarshards.convert(
        tmp_path / "t.parquet",
        tmp_path / "out",
        key="id",
        fields=["image", "caption"],
        extensions={"image": "image.jpeg", "caption": "txt"},
        workers=1,
    )
    keys, samples = read_back(m)
    assert keys == [f"r{i}" for i in range(6)]
    assert samples["r3"] == {"image.jpeg": image_bytes(3), "txt": b"picture 3"}
    with pytest.raises(ValueError, match="no key column"):
        tarshards.convert(tmp_path / "t.parquet", tmp_path / "o2", key="nope", workers=1)
    with pytest.raises(ValueError, match="extensions= names columns"):
        tarshards.convert(tmp_path / "t.parquet", tmp_path / "o3", extensions={"x": "y"})


def test_extension_inference():
    assert format_of(image_bytes(0)) == "jpg"
    assert format_of(image_bytes(0, "PNG")) == "png"
    assert format_of(image_bytes(0, "WEBP")) == "webp"
    assert format_of(wav_bytes(0)) == "wav"
    assert format_of(b"\x93NUMPY\x01\x00") == "npy"
    assert format_of(b"\x00\x00\x00\x18ftypmp42") == "mp4"
    assert format_of(b"whatever", "a/b.FLAC") == "flac"
    assert format_of(b"plain") is None


# ---- Hugging Face datasets ---------------------------------------------------------------------


def _hf_dataset():
    datasets = pytest.importorskip("datasets")
    n = 11
    features = datasets.Features(
        {
            "image": datasets.Image(),
            "audio": {"bytes": datasets.Value("binary"), "path": datasets.Value("string")},
            "label": datasets.ClassLabel(names=["zero", "one", "two"]),
            "text": datasets.Value("string"),
            "box": datasets.Sequence(datasets.Value("float32")),
        }
    )
    data = {
        "image": [
            {"bytes": image_bytes(i, "PNG" if i % 2 else "JPEG"), "path": None} for i in range(n)
        ],
        "audio": [{"bytes": wav_bytes(i), "path": None} for i in range(n)],
        "label": [i % 3 for i in range(n)],
        "text": [f"row {i}" for i in range(n)],
        "box": [[0.5, float(i)] for i in range(n)],
    }
    ds = datasets.Dataset.from_dict(data, features=features)
    # cast, not encoded (encoding Audio needs torchcodec): the storage is the same struct
    return ds.cast_column("audio", datasets.Audio(decode=False)), n


def _check_hf(m, n):
    keys, samples = read_back(m)
    assert keys == [f"{i:06d}" for i in range(n)]
    assert m.info["classes"] == ["zero", "one", "two"]
    for i in range(n):
        s = samples[f"{i:06d}"]
        # the encoded bytes as stored; the extension from the first image's format
        assert s["jpg"] == image_bytes(i, "PNG" if i % 2 else "JPEG")
        assert s["wav"] == wav_bytes(i)
        assert s["cls"] == str(i % 3).encode()
        assert s["text"] == f"row {i}".encode()
        assert json.loads(s["box.json"]) == [0.5, float(i)]


def test_hf_save_to_disk_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds, n = _hf_dataset()
    datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(tmp_path / "hf")
    assert detect_kind(tmp_path / "hf") == "hf"
    with pytest.raises(ValueError, match="choose one with split="):
        tarshards.convert(tmp_path / "hf", tmp_path / "o", workers=1)
    m = tarshards.convert(tmp_path / "hf", tmp_path / "out", split="train", maxcount=4, workers=2)
    assert os.path.basename(m.shard_urls()[0]) == "train-000000.tar"
    _check_hf(m, n)


def test_hf_dataset_object(tmp_path):
    ds, n = _hf_dataset()
    m = tarshards.convert(ds, tmp_path / "out", maxcount=4, workers=1)
    _check_hf(m, n)
    # a Dataset after select() reads through its indices mapping
    picked = ds.select([5, 1, 9])
    keys, samples = read_back(tarshards.convert(picked, tmp_path / "sel", workers=1))
    assert keys == ["000000", "000001", "000002"]
    assert samples["000001"]["wav"] == wav_bytes(1)


# ---- JSONL --------------------------------------------------------------------------------------


def test_jsonl_fields_name_files(tmp_path):
    (tmp_path / "media" / "img").mkdir(parents=True)
    rows = []
    for i in range(7):
        (tmp_path / "media" / "img" / f"{i}.jpg").write_bytes(image_bytes(i))
        (tmp_path / "media" / f"{i}.wav").write_bytes(wav_bytes(i))
        rows.append(
            {
                "__key__": f"clip{i}",
                "image": f"media/img/{i}.jpg",
                "sound": str(tmp_path / "media" / f"{i}.wav"),  # absolute paths too
                "caption": f"caption {i}",
                "label": i % 2,
                "extra": {"i": i},
            }
        )
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert detect_kind(path) == "jsonl"
    m = tarshards.convert(path, tmp_path / "out", maxcount=3, workers=1)
    keys, samples = read_back(m)
    assert keys == [f"clip{i}" for i in range(7)]
    for i in range(7):
        assert samples[f"clip{i}"] == {
            "jpg": image_bytes(i),
            "wav": wav_bytes(i),
            "caption.txt": f"caption {i}".encode(),
            "cls": str(i % 2).encode(),
            "extra.json": json.dumps({"i": i}).encode(),
        }


# ---- plans, reruns, engines ---------------------------------------------------------------------


def test_rerun_checks_the_plan(tmp_path):
    src = tmp_path / "f"
    src.mkdir()
    for i in range(6):
        (src / f"s{i}.txt").write_bytes(f"{i}".encode())
    m = tarshards.convert(src, tmp_path / "out", maxcount=2, workers=1)
    stats = [os.stat(u) for u in m.shard_urls()]
    again = tarshards.convert(src, tmp_path / "out", maxcount=2, workers=1)  # nothing to do
    assert again == m
    assert [(s.st_ino, s.st_mtime_ns) for s in stats] == [
        (os.stat(u).st_ino, os.stat(u).st_mtime_ns) for u in m.shard_urls()
    ]
    with pytest.raises(ValueError, match="other data or with other options"):
        tarshards.convert(src, tmp_path / "out", maxcount=3, workers=1)
    (src / "s9.txt").write_bytes(b"9")
    with pytest.raises(ValueError, match="other data or with other options"):
        tarshards.convert(src, tmp_path / "out", maxcount=2, workers=1)
    m2 = tarshards.convert(src, tmp_path / "out", maxcount=2, workers=1, overwrite=True)
    assert m2.num_samples == 7
    # shards that no plan describes are not taken over
    os.remove(str(tmp_path / "out" / "manifest.json.convert"))
    with pytest.raises(ValueError, match="no conversion plan"):
        tarshards.convert(src, tmp_path / "out", maxcount=2, workers=1)


def test_info_and_errors(tmp_path):
    src = tmp_path / "f"
    src.mkdir()
    (src / "a.txt").write_bytes(b"a")
    m = tarshards.convert(src, tmp_path / "out", info={"license": "CC0"}, workers=1)
    assert Manifest.load(m.url).info == {"license": "CC0"}
    with pytest.raises(FileNotFoundError):
        tarshards.convert(tmp_path / "missing", tmp_path / "o")
    with pytest.raises(ValueError, match="kind must be one of"):
        tarshards.convert(src, tmp_path / "o", kind="csv")
    with pytest.raises(ValueError, match="Parquet output is made from shards"):
        tarshards.convert(src, tmp_path / "o.parquet")
    with pytest.raises(ValueError, match="aligned"):
        tarshards.convert(src, tmp_path / "o", aligned=True)


def test_processes_engine_two_workers(tmp_path):
    expected = make_imagefolder(tmp_path / "train")
    m = tarshards.convert(tmp_path / "train", tmp_path / "out", maxcount=3, workers=2)
    assert read_back(m)[1] == expected
    assert len(m.shards) == 7


def test_dask_engine(tmp_path):
    pytest.importorskip("distributed")
    expected = make_imagefolder(tmp_path / "train")
    m = tarshards.convert(
        tmp_path / "train",
        str(tmp_path / "out" / "d-%03d.tar.zst"),
        maxcount=5,
        aligned=True,
        engine="dask",
        workers=2,
        meta={"jpg_bytes": lambda s: len(s["jpg"]) if "jpg" in s else None},  # on the workers
    )
    keys, got = read_back(m)
    assert got == expected
    assert m.load_index(0).compression == "zstd"
    want = [len(expected[k]["jpg"]) if "jpg" in expected[k] else np.nan for k in keys]
    np.testing.assert_array_equal(m.meta("jpg_bytes"), want)


def test_tarshards_convert_is_callable_however_it_was_imported(tmp_path):
    import subprocess
    import sys

    code = (
        "import tarshards.convert.sources, tarshards\n"  # the package imported first
        "from tarshards import convert\n"
        "assert callable(tarshards.convert) and callable(convert)\n"
        "assert tarshards.convert.write_parquet is tarshards.convert.parquet.write_parquet\n"
        "import sys; m = tarshards.convert(sys.argv[1], sys.argv[2], workers=1)\n"
        "print(m.num_samples)\n"
    )
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "a.txt").write_text("a")
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "f"), str(tmp_path / "o")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert out.returncode == 0 and out.stdout.strip() == "1", out.stderr


def test_jsonl_maxsize_counts_the_files_named(tmp_path):
    for i in range(6):
        (tmp_path / f"{i}.bin").write_bytes(bytes(5000))
    (tmp_path / "d.jsonl").write_text(
        "".join(json.dumps({"blob": f"{i}.bin"}) + "\n" for i in range(6))
    )
    m = tarshards.convert(tmp_path / "d.jsonl", tmp_path / "o", maxsize=13_000, workers=1)
    assert [r.samples for r in m.shards] == [2, 2, 2]
    assert read_back(m)[1]["000004"] == {"bin": bytes(5000)}


def test_parquet_of_the_hub_image_structs(tmp_path):
    """Hugging Face's Parquet files hold images as struct<bytes, path>: the bytes are written,
    the extension taken from the path (or the content where the path has none)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    images = [image_bytes(i, "PNG") for i in range(4)]
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table(
        {
            "image": pa.array(
                [{"bytes": b, "path": f"img{i}.png"} for i, b in enumerate(images)], struct
            ),
            "thumb": pa.array([{"bytes": image_bytes(i), "path": None} for i in range(4)], struct),
        }
    )
    pq.write_table(table, tmp_path / "hub.parquet")
    keys, samples = read_back(
        tarshards.convert(tmp_path / "hub.parquet", tmp_path / "o", workers=1)
    )
    assert keys == [f"{i:06d}" for i in range(4)]
    assert samples["000002"] == {"png": images[2], "jpg": image_bytes(2)}
