"""Shards -> Parquet -> shards: every field of every sample byte for byte the same (the shard files
too, written with the same sizes), the manifest's info carried through; chosen fields; the CLI."""

from __future__ import annotations

import dataclasses
import filecmp
import io
import json

import numpy as np
import pytest
from click.testing import CliRunner

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

import tarshards
from tarshards import ShardWriter
from tarshards.cli.main import group
from tarshards.format.manifest import Manifest
from tarshards.pipeline.dataset import iter_samples


def _samples(n=23):
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        npy = io.BytesIO()
        np.save(npy, rng.random((2, 3)).astype("float32"))
        s = {
            "__key__": f"dir{i % 2}/k{i:04d}",
            "jpg": rng.integers(0, 256, 300 + i, dtype=np.uint8).tobytes(),  # any bytes
            "cls": str(i % 4).encode(),
            "json": json.dumps({"i": i, "text": "naïve ✓"}).encode(),
            "npy": npy.getvalue(),
            "seg.png": b"\x89PNG\r\n\x1a\n" + bytes([i]) * 9,
            "caption": f"a caption, {i} ☃".encode(),  # text under a name of its own
        }
        if i % 3 == 0:
            del s["caption"]  # a field some samples lack
        if i == 5:
            s["jpg"] = b""  # an empty member
        out.append(s)
    return out


def _write(tmp_path, samples, maxcount=5):
    (tmp_path / "orig").mkdir()
    with ShardWriter(
        str(tmp_path / "orig" / "shard-%06d.tar"),
        maxcount=maxcount,
        encoder=False,
        manifest=tmp_path / "orig" / "manifest.json",
    ) as w:
        for s in samples:
            w.write(s)
    info = {"classes": ["a", "b", "c", "d"], "note": "test"}  # what describes the data set
    return dataclasses.replace(w.manifest, info=info).save(w.manifest.url)


def _fields(manifest) -> list[tuple[str, dict]]:
    return [
        (s["__key__"], {k: bytes(v) for k, v in s.items() if not k.startswith("__")})
        for s in iter_samples(manifest.shard_urls())
    ]


def test_round_trip_is_byte_identical(tmp_path):
    samples = _samples()
    orig = _write(tmp_path, samples)
    out = tarshards.convert(orig.url, tmp_path / "all.parquet")
    assert out.num_rows == len(samples)
    table = pq.read_table(tmp_path / "all.parquet")
    assert table.column_names == ["__key__", "cls", "jpg", "json", "npy", "seg.png", "caption"]
    assert table.schema.field("jpg").type == pa.binary()  # media as binary
    assert table.schema.field("json").type == pa.string()  # text as text
    assert table.column("__key__").to_pylist() == [s["__key__"] for s in samples]

    back = tarshards.convert(tmp_path / "all.parquet", tmp_path / "back", maxcount=5, workers=1)
    expected = [(s["__key__"], {k: v for k, v in s.items() if k != "__key__"}) for s in samples]
    assert _fields(back) == _fields(orig) == expected
    assert back.info == {"classes": ["a", "b", "c", "d"], "note": "test"}
    # the same samples in the same shards: the same files, byte for byte
    assert len(back.shards) == len(orig.shards)
    for a, b in zip(orig.shard_urls(), back.shard_urls()):
        assert filecmp.cmp(a, b, shallow=False)
    assert [r.hash for r in back.shards] == [r.hash for r in orig.shards]


def test_binary_columns_and_chosen_fields(tmp_path):
    samples = _samples(8)
    samples[2]["txt"] = b"\xff\xfe not utf-8"
    orig = _write(tmp_path, samples)
    with pytest.raises(ValueError, match="not UTF-8"):
        tarshards.convert(orig.url, tmp_path / "t.parquet")
    tarshards.convert(orig.url, tmp_path / "b.parquet", text=False)
    table = pq.read_table(tmp_path / "b.parquet")
    assert all(table.schema.field(c).type == pa.binary() for c in table.column_names[1:])
    back = tarshards.convert(tmp_path / "b.parquet", tmp_path / "back", maxcount=5, workers=1)
    assert _fields(back) == _fields(orig)

    # chosen fields, from a shard spec instead of a manifest
    spec = str(tmp_path / "orig" / "shard-{000000..000001}.tar")
    out = tarshards.convert(spec, tmp_path / "some.parquet", fields=["cls", "npy"])
    assert out.columns == ("__key__", "cls", "npy")
    table = pq.read_table(tmp_path / "some.parquet")
    assert table.num_rows == 8
    assert table.column("npy").to_pylist()[3] == samples[3]["npy"]


def test_cli_both_ways(tmp_path):
    orig = _write(tmp_path, _samples(12))
    runner = CliRunner()
    res = runner.invoke(
        group, ["convert", orig.url, "-o", str(tmp_path / "x.parquet"), "-f", "jpg,cls", "-q"]
    )
    assert res.exit_code == 0, res.output
    assert pq.read_table(tmp_path / "x.parquet").column_names == ["__key__", "jpg", "cls"]
    res = runner.invoke(
        group,
        ["convert", str(tmp_path / "x.parquet"), "-o", str(tmp_path / "y-%03d.tar"), "-c", "4"],
    )
    assert res.exit_code == 0, res.output
    m = Manifest.load(tmp_path / "y.json")
    assert m.num_samples == 12 and len(m.shards) == 3
    assert {tuple(f) for _, f in _fields(m)} == {("cls", "jpg")}
    res = runner.invoke(
        group, ["convert", str(tmp_path / "x.parquet"), "-o", str(tmp_path / "z"), "--ext", "bad"]
    )
    assert res.exit_code == 2 and "COLUMN=EXT" in res.output
