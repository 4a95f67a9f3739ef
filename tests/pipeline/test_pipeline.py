"""WebDataset and DataPipeline without a DataLoader."""

from __future__ import annotations

import gzip
import http.server
import os
import shutil
import threading
import warnings
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from tarshards import WebDataset, warn_and_continue
from tarshards.errors import PipeNotAllowedError, ShardFormatError, StorageError, TarshardsWarning
from tarshards.pipeline.dataset import DataPipeline


def keys(ds):
    return [s["__key__"] if isinstance(s, dict) else s[0] for s in ds]


def test_reads_all_samples_in_order(shards):
    paths, samples = shards
    got = list(WebDataset(paths))
    assert keys(got) == [s["__key__"] for s in samples]
    assert got[0]["__url__"] == paths[0]
    assert {k for k in got[0]} == {"__key__", "__url__", "__offset__", "jpg", "cls", "json"}
    assert got[0]["__offset__"] == 0 and got[1]["__offset__"] > 0


def test_brace_spec_and_double_colon(shards, tmp_path):
    paths, samples = shards
    spec = (
        str(tmp_path / "shard-{0000..0001}.tar") + "::" + str(tmp_path / "shard-{0002..0003}.tar")
    )
    assert keys(WebDataset(spec)) == [s["__key__"] for s in samples]
    listfile = tmp_path / "list.txt"
    listfile.write_text("\n".join(paths) + "\n")
    assert keys(WebDataset(str(listfile))) == [s["__key__"] for s in samples]
    assert keys(WebDataset(str(tmp_path / "shard-*.tar"))) == [s["__key__"] for s in samples]


def test_seed_constructor_tuples(shards):
    paths, samples = shards
    ds = WebDataset(paths, extensions="jpg cls")
    img, cls = next(iter(ds))
    assert isinstance(img, np.ndarray) and img.dtype == np.float32 and img.shape == (24, 32, 3)
    assert 0.0 <= img.min() and img.max() <= 1.0
    assert cls == 0
    raw = next(iter(WebDataset(paths, extensions="jpg cls", decoder=None)))
    assert raw == (samples[0]["jpg"], samples[0]["cls"])
    pil = next(
        iter(
            WebDataset(
                paths,
                extensions="jpg;png cls",
                decoder="pil",
                transforms=[lambda im: im.size, lambda c: c - 1],
            )
        )
    )
    assert pil == ((32, 24), -1)


def test_seed_shuffle_changes_order_but_keeps_samples(shards):
    paths, samples = shards
    ds = WebDataset(paths, extensions="cls json", shuffle=20)
    got = [j["i"] for _, j in ds]
    assert sorted(got) == list(range(len(samples)))
    assert got != list(range(len(samples)))


def test_fluent_pipeline_and_repr(shards):
    paths, _ = shards
    ds = (
        WebDataset(paths, shardshuffle=False)
        .shuffle(10)
        .decode("rgb8")
        .to_tuple("jpg", "cls")
        .map_tuple(lambda x: x.shape, None)
        .batched(8)
    )
    batches = list(ds)
    assert len(batches) == 13
    assert batches[0][0][0] == (24, 32, 3)
    r = repr(ds)
    assert "shuffle(10)" in r and "decode('rgb8')" in r and "batched(8)" in r
    assert "4 shards" in r


def test_epochs_deterministic_and_different(shards):
    paths, _ = shards

    def order(epoch):
        ds = WebDataset(paths, shardshuffle=True, seed=7).shuffle(30)
        ds.set_epoch(epoch)
        return keys(ds)

    assert order(0) == order(0)
    assert order(0) != order(1)
    ds = WebDataset(paths, shardshuffle=True, seed=7).shuffle(30)
    first, second = keys(ds), keys(ds)  # counted automatically
    assert first == order(0) and second == order(1)


def test_with_epoch_and_length(shards):
    paths, _ = shards
    ds = WebDataset(paths, resampled=True).with_epoch(250)
    got = keys(ds)
    assert len(got) == 250  # resampled is endless: with_epoch bounds it
    ds = WebDataset(paths).with_length(100)
    assert len(ds) == 100
    with pytest.raises(TypeError, match="no length"):
        len(WebDataset(paths))


def test_indexing_explains_streaming(shards):
    with pytest.raises(TypeError, match="streaming"):
        WebDataset(shards[0])[0]


# (the ranks' unequal shares are incidental here: the warning has tests of its own)
@pytest.mark.filterwarnings("ignore:\\d+ ranks (may )?read:tarshards.errors.TarshardsWarning")
def test_explicit_ranks_split_disjoint(shards):
    paths, samples = shards
    parts = [
        keys(WebDataset(paths, rank=r, world_size=2, shardshuffle=True, seed=1)) for r in range(2)
    ]
    assert not set(parts[0]) & set(parts[1])
    assert sorted(parts[0] + parts[1]) == sorted(s["__key__"] for s in samples)


def test_custom_splitters(shards):
    paths, _ = shards
    ds = WebDataset(paths, nodesplitter=lambda urls: urls[:1], workersplitter=lambda u: u)
    assert len(keys(ds)) == 25


def test_gzip_and_zstd_shards(shards, tmp_path):
    paths, samples = shards
    gz = tmp_path / "a.tgz"
    gz.write_bytes(gzip.compress(Path(paths[0]).read_bytes()))
    zstd = pytest.importorskip("zstandard")
    zs = tmp_path / "b.tar.zst"
    zs.write_bytes(zstd.ZstdCompressor().compress(Path(paths[1]).read_bytes()))
    assert keys(WebDataset([str(gz), str(zs)])) == [s["__key__"] for s in samples[:50]]


def test_corrupt_shard_warn_and_continue(shards, tmp_path):
    paths, samples = shards
    bad = tmp_path / "bad.tar"
    data = Path(paths[1]).read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    urls = [paths[0], str(bad), str(tmp_path / "missing.tar"), paths[2]]
    with pytest.raises(StorageError, match=r"1 of the 4 shards do not exist: .*missing.tar"):
        list(WebDataset(urls))  # a missing local shard: named before any sample is read
    with pytest.raises(ShardFormatError) as info:
        list(WebDataset([u for u in urls if "missing" not in u]))
    assert "bad.tar" in str(info.value) and info.value.offset is not None
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = keys(WebDataset(urls, handler=warn_and_continue))
    msgs = [str(x.message) for x in w if issubclass(x.category, TarshardsWarning)]
    assert len(msgs) == 2
    assert "bad.tar" in msgs[0] and "offset" in msgs[0]
    assert "missing.tar" in msgs[1]
    want = [s["__key__"] for s in samples[:25] + samples[50:75]]
    assert [k for k in got if k in want] == want
    assert len(got) < 100


def test_missing_shard_raises_storage_error(tmp_path):
    with pytest.raises(StorageError, match=r"missing.tar"):
        list(WebDataset(str(tmp_path / "missing.tar")))


def test_pipe_urls_need_permission(shards):
    paths, samples = shards
    with pytest.raises(PipeNotAllowedError, match="allow_pipe"):
        list(WebDataset(f"pipe:cat {paths[0]}"))
    got = keys(WebDataset(f"pipe:cat {paths[0]}", allow_pipe=True))
    assert got == [s["__key__"] for s in samples[:25]]


def test_empty_check(tmp_path):
    empty = tmp_path / "empty.tar"
    empty.write_bytes(bytes(1024))
    with pytest.raises(ValueError, match="no samples found"):
        list(WebDataset(str(empty)))
    assert list(WebDataset(str(empty), empty_check=False)) == []


def test_data_pipeline_generic_source():
    ds = DataPipeline(lambda ctx: iter(range(10))).map(lambda x: x * 2).batched(4)
    assert [list(b) for b in ds] == [[0, 2, 4, 6], [8, 10, 12, 14], [16, 18]]


def test_decode_size_reduced(shards):
    paths, _ = shards
    img, _ = next(iter(WebDataset(paths).decode("rgb8", size=(16, 12)).to_tuple("jpg", "cls")))
    assert img.shape == (12, 16, 3)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_reads_over_http(shards, tmp_path):
    pytest.importorskip("aiohttp")
    paths, samples = shards
    root = tmp_path / "www"
    root.mkdir()
    for p in paths:
        shutil.copy(p, root / os.path.basename(p))
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), partial(_QuietHandler, directory=str(root))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/shard-{{0000..0003}}.tar"
        got = list(WebDataset(url).decode().to_tuple("__key__", "cls"))
        assert [k for k, _ in got] == [s["__key__"] for s in samples]
        assert [c for _, c in got] == [int(s["cls"]) for s in samples]
    finally:
        server.shutdown()
        server.server_close()


def test_decode_before_to_tuple_skips_unused_fields(shards, tmp_path):
    _paths, samples = shards
    from tarshards import TarWriter

    bad = tmp_path / "bad-json.tar"
    with TarWriter(str(bad)) as w:
        for s in samples[:3]:
            w.write(dict(s, json=b"{not json"))
    # the broken json is never decoded because to_tuple does not ask for it
    got = list(WebDataset(str(bad)).decode("rgb8").to_tuple("jpg", "cls"))
    assert [c for _, c in got] == [0, 1, 2]
    with pytest.raises(Exception, match="json"):
        list(WebDataset(str(bad)).decode("rgb8"))


def test_fluent_methods_return_new_pipelines(shards):
    paths, samples = shards
    base = WebDataset(paths)
    tuples = base.to_tuple("__key__", "cls")
    assert tuples is not base
    assert isinstance(next(iter(base)), dict)  # base is unchanged
    assert next(iter(tuples))[0] == samples[0]["__key__"]
    assert "to_tuple" not in repr(base) and "to_tuple" in repr(tuples)


def test_pipe_urls_expand_braces(shards, tmp_path):
    _paths, samples = shards
    spec = f"pipe:cat {tmp_path}/shard-{{0000..0001}}.tar"
    assert keys(WebDataset(spec, allow_pipe=True)) == [s["__key__"] for s in samples[:50]]


def _uneven_shards(directory, counts):
    from tarshards import TarWriter

    urls = []
    for i, n in enumerate(counts):
        url = str(directory / f"u-{i:03d}.tar")
        with TarWriter(url) as t:
            for j in range(n):
                t.write({"__key__": f"s{i:03d}_{j:03d}", "cls": j})
        urls.append(url)
    return urls


def test_unequal_ranks_are_warned_about(tmp_path):
    """The plain shard split can give ranks different sample counts (a DDP step then waits on
    the rank that ran dry): rank 0 says so, with the counts when a manifest knows them."""
    from tarshards.format.manifest import build_manifest

    urls = _uneven_shards(tmp_path, [7, 13, 5, 11])
    manifest = build_manifest(urls, str(tmp_path / "m.json"), workers=1)

    def caught(ds):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            n = sum(1 for _ in ds)
        return n, [str(w.message) for w in got if issubclass(w.category, TarshardsWarning)]

    n, msgs = caught(WebDataset(manifest, rank=0, world_size=2))
    assert n == 12 and len(msgs) == 1 and "2 ranks read 12 to 24 samples an epoch" in msgs[0]
    assert "readers=V" in msgs[0]
    n, msgs = caught(WebDataset(urls, rank=0, world_size=2))
    assert n == 12 and len(msgs) == 1 and "may read different numbers" in msgs[0]
    assert caught(WebDataset(urls, rank=1, world_size=2))[1] == []  # rank 0 speaks for all
    assert caught(WebDataset(urls, rank=0, world_size=2, equal=False))[1] == []
    assert caught(WebDataset(urls, rank=0, world_size=2).with_epoch(5))[1] == []
    assert caught(WebDataset(urls))[1] == []  # one rank: nothing to wait for
    (tmp_path / "even").mkdir()
    even = _uneven_shards(tmp_path / "even", [7, 13, 13, 7])  # ranks: 7 + 13 and 13 + 7
    even_manifest = build_manifest(even, str(tmp_path / "even.json"), workers=1)
    assert caught(WebDataset(even_manifest, rank=0, world_size=2))[1] == []
