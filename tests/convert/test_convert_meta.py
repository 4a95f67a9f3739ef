"""tarshards.convert(meta=...) and ``tarshards convert --media``: the converted shards' indexes
carry per-sample metadata columns, equal to the functions computed over the source's samples
(independently, from the files on disk), in manifest order."""

from __future__ import annotations

import io
import os
import warnings

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

import tarshards
from tarshards.format.index import ShardIndex
from tarshards.format.manifest import Manifest
from tarshards.pipeline.dataset import iter_samples


def make_pairs(root, n: int = 11) -> dict[str, dict[str, bytes]]:
    """A folder of ``kNN.jpg`` (sizes vary) + ``kNN.txt`` (a caption of NN % 5 + 1 words), and
    two images without a caption; returns key -> {ext: bytes} as written."""
    rng = np.random.default_rng(3)
    os.makedirs(root)
    out: dict[str, dict[str, bytes]] = {}
    for i in range(n):
        key = f"k{i:02d}"
        buf = io.BytesIO()
        pixels = rng.integers(0, 256, (8 + i, 10 + 2 * i, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(buf, format="JPEG")
        sample = {"jpg": buf.getvalue()}
        if i not in (4, 9):
            sample["txt"] = " ".join(["word"] * (i % 5 + 1)).encode()
        for ext, data in sample.items():
            with open(os.path.join(root, f"{key}.{ext}"), "wb") as f:
                f.write(data)
        out[key] = sample
    return out


def tokens(sample):
    """Words in the caption; None (no value) for a sample without one."""
    txt = sample.get("txt")
    return None if txt is None else len(bytes(txt).split())


def jpg_bytes(sample):
    return len(sample["jpg"])


def manifest_keys(m: Manifest) -> list[str]:
    return [s["__key__"] for s in iter_samples(m.shard_urls())]


def expected_column(source, keys, fn) -> np.ndarray:
    return np.array(
        [np.nan if (v := fn({"__key__": k, **source[k]})) is None else v for k in keys], float
    )


@pytest.mark.parametrize("workers", [1, 2])
def test_meta_columns_equal_the_functions_over_the_source(tmp_path, workers):
    source = make_pairs(tmp_path / "pairs")
    m = tarshards.convert(
        tmp_path / "pairs",
        tmp_path / "out",
        maxcount=3,
        workers=workers,
        meta=[{"tokens": tokens, "jpg_bytes": jpg_bytes}, tarshards.media_meta()],
    )
    assert len(m.shards) == 4
    m = Manifest.load(m.url)  # as read back from the files
    keys = manifest_keys(m)
    assert sorted(keys) == sorted(source)
    assert m.meta_columns() == ["jpg.height", "jpg.width", "jpg_bytes", "tokens"]
    got = m.meta("tokens")
    want = expected_column(source, keys, tokens)
    assert np.isnan(want).sum() == 2
    np.testing.assert_array_equal(got, want)  # NaN where the source has no caption
    np.testing.assert_array_equal(m.meta("jpg_bytes"), expected_column(source, keys, jpg_bytes))
    sizes = [Image.open(io.BytesIO(source[k]["jpg"])).size for k in keys]
    np.testing.assert_array_equal(m.meta("jpg.width"), [w for w, _ in sizes])
    np.testing.assert_array_equal(m.meta("jpg.height"), [h for _, h in sizes])
    for i in range(len(m.shards)):  # each shard's own index file holds its rows' values
        idx = ShardIndex.load(m.index_url(i))
        assert len(idx.meta["tokens"]) == idx.num_samples == m.shards[i].samples


def test_a_lost_index_is_made_again_with_its_columns(tmp_path):
    source = make_pairs(tmp_path / "pairs", n=6)
    meta = {"tokens": tokens}
    m = tarshards.convert(tmp_path / "pairs", tmp_path / "out", maxcount=4, workers=1, meta=meta)
    before = m.meta("tokens")
    # a kill between a shard's commit and its index's: the rerun indexes the shard again
    os.remove(m.index_url(1))
    os.remove(m.url)
    with warnings.catch_warnings():  # the kept shards are the plan's: no "outputs exist" warning
        warnings.simplefilter("error", tarshards.TarshardsWarning)
        again = tarshards.convert(
            tmp_path / "pairs", tmp_path / "out", maxcount=4, workers=1, meta=meta
        )
    np.testing.assert_array_equal(again.meta("tokens"), before)
    keys = manifest_keys(again)
    np.testing.assert_array_equal(before, expected_column(source, keys, tokens))
    # the plan records which columns: a rerun with others (or none) is another conversion
    with pytest.raises(ValueError, match="other data or with other options"):
        tarshards.convert(tmp_path / "pairs", tmp_path / "out", maxcount=4, workers=1)
    with pytest.raises(ValueError, match="Parquet output"):
        tarshards.convert(m, tmp_path / "x.parquet", meta=meta)


def test_cli_media_records_image_sizes(tmp_path):
    from tarshards.cli.main import group as cli

    source = make_pairs(tmp_path / "pairs", n=5)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        cli, ["convert", str(tmp_path / "pairs"), "-o", str(out), "-c", "2", "-p", "1", "--media"]
    )
    assert result.exit_code == 0, result.output
    m = Manifest.load(str(out / "manifest.json"))
    keys = manifest_keys(m)
    widths = [Image.open(io.BytesIO(source[k]["jpg"])).size[0] for k in keys]
    np.testing.assert_array_equal(m.meta("jpg.width"), widths)
    result = CliRunner().invoke(
        cli, ["convert", str(out / "manifest.json"), "-o", str(tmp_path / "o.parquet"), "--media"]
    )
    assert result.exit_code != 0 and "--media" in result.output
