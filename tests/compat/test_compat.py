"""``import tarshards.compat as wds``: webdataset's documented usage, run on tarshards.

These are our own ports of the usage webdataset documents (composable ``DataPipeline``, the
fluent ``WebDataset``, ``WebLoader`` with fluent methods, writers, tenbin), including a pipeline
of the shape OpenCLIP trains with, through a 2-worker ``WebLoader`` on 2 simulated ranks and on
2 real gloo ranks.
"""

from __future__ import annotations

import functools
import io
import os
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from conftest import write_shards

import tarshards
import tarshards.compat as wds
from tarshards.errors import MissingFieldError, PipeNotAllowedError, UnsafeCodecError

try:
    import torch
except ImportError:  # the lean install: compat works without torch, loaders are skipped
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="needs torch (DataLoader, tensors)")


SRC = os.path.dirname(os.path.dirname(os.path.dirname(wds.__file__)))  # .../src


@pytest.fixture
def eight(tmp_path):
    """8 shards x 10 samples (jpg, cls, json)."""
    return write_shards(tmp_path, 8, 10)


def keys_of(items):
    return sorted(k for (k,) in items)


# ---- DataPipeline: sources, functions of an iterator, curried filters ------------------------


def test_trivial_pipelines():
    assert list(wds.DataPipeline(lambda: iter([1, 2, 3, 4]))) == [1, 2, 3, 4]
    assert list(wds.DataPipeline(lambda: iter([1, 2, 3]), wds.map(lambda x: x + 1))) == [2, 3, 4]

    def add4(src):
        for x in src:
            yield x + 4

    assert list(wds.DataPipeline(range(1, 3), add4)) == [5, 6]
    # a list argument is a list of stages, as in webdataset
    assert list(wds.DataPipeline([lambda: iter([1, 2]), add4])) == [5, 6]
    assert len(list(wds.DataPipeline(wds.SimpleShardList("t-{000..099}.tar")))) == 100


def test_reading_shards_composably(eight):
    paths, samples = eight
    ds = wds.DataPipeline(
        wds.SimpleShardList(paths),
        wds.split_by_node,
        wds.split_by_worker,
        wds.tarfile_to_samples(),
        wds.shuffle(20),
        wds.decode("rgb8"),
        wds.to_tuple("jpg;png", "cls", "__key__"),
    )
    got = list(ds)
    assert sorted(k for _, _, k in got) == sorted(s["__key__"] for s in samples)
    image, cls, _ = got[0]
    assert image.dtype == np.uint8 and image.shape == (24, 32, 3) and isinstance(cls, int)
    # the curried shuffle is seeded by the pipeline: same seed and epoch, same order
    again = wds.DataPipeline(*ds.pipeline)
    assert [k for *_, k in again] == [k for *_, k in got]
    assert [k for *_, k in again] != [k for *_, k in got]  # epoch 1 differs from epoch 0


def test_curried_filter_outside_a_pipeline():
    out = list(wds.batched(3)(iter(range(7))))
    assert [list(b) for b in out] == [[0, 1, 2], [3, 4, 5], [6]]
    assert list(wds.select(lambda x: x % 2)(range(5))) == [1, 3]


def test_with_epoch_exact_and_repeat(eight):
    paths, _ = eight
    ds = wds.DataPipeline(wds.SimpleShardList(paths[:2]), wds.tarfile_to_samples())
    assert len(list(ds)) == 20
    assert len(list(ds.with_epoch(53))) == 53  # shorter data is repeated
    assert len(list(ds.with_epoch(7))) == 7
    ds2 = wds.DataPipeline(wds.SimpleShardList(paths[:2]), wds.tarfile_to_samples())
    assert len(list(ds2.repeat(nepochs=3))) == 60
    empty = wds.DataPipeline(lambda: iter([])).with_epoch(10)
    assert list(empty) == []  # no data: ends instead of spinning


def test_fluent_with_epoch_has_webdataset_meaning(eight):
    import tarshards as ts

    paths, _ = eight
    got = [k for (k,) in ts.WebDataset(paths[:1]).to_tuple("__key__").with_epoch(25)]
    assert len(got) == 25 and len(set(got)) == 10  # 10 samples, gone through again


def test_with_length_and_len():
    ds = wds.DataPipeline(lambda: iter(range(5)))
    with pytest.raises(TypeError):
        len(ds)
    assert len(ds.with_length(17)) == 17


class Tag(wds.PipelineStage):
    """A custom stage, as OpenCLIP writes them."""

    def __init__(self, label):
        self.label = label

    def run(self, src):
        for sample in src:
            sample = dict(sample)
            sample["tag"] = self.label
            yield sample


def test_custom_pipeline_stage(eight):
    paths, _ = eight
    ds = wds.DataPipeline(
        wds.SimpleShardList(paths[:1]),
        wds.tarfile_to_samples(),
        Tag("x"),
        wds.to_tuple("tag", "cls"),
    )
    got = list(ds)
    assert len(got) == 10 and all(t == "x" for t, _ in got)
    assert isinstance(ds.stage(2), Tag)


def test_own_tarfile_to_samples_from_the_building_blocks(eight):
    """OpenCLIP writes its tarfile_to_samples from url_opener, tar_file_expander, group_by_keys."""
    paths, samples = eight

    def group_by_keys_nothrow(data, keys=wds.base_plus_ext, lcase=True, suffixes=None):
        current = None
        for filesample in data:
            prefix, suffix = keys(filesample["fname"])
            if prefix is None:
                continue
            if lcase:
                suffix = suffix.lower()
            if current is None or prefix != current["__key__"]:
                if wds.valid_sample(current):
                    yield current
                current = {"__key__": prefix, "__url__": filesample["__url__"]}
            if suffixes is None or suffix in suffixes:
                current[suffix] = filesample["data"]
        if wds.valid_sample(current):
            yield current

    def tarfile_to_samples_nothrow(src, handler=wds.warn_and_continue):
        streams = wds.url_opener(src, handler=handler)
        files = wds.tar_file_expander(streams, handler=handler)
        return group_by_keys_nothrow(files)

    ds = wds.DataPipeline(
        wds.SimpleShardList(paths), tarfile_to_samples_nothrow, wds.to_tuple("__key__")
    )
    assert keys_of(ds) == sorted(s["__key__"] for s in samples)
    assert wds.base_plus_ext("a/b.seg.png") == ("a/b", "seg.png")
    grouped = list(wds.group_by_keys(wds.tar_file_expander(wds.url_opener([{"url": paths[0]}]))))
    assert [s["__key__"] for s in grouped] == [s["__key__"] for s in samples[:10]]
    # samples carry the offset of their first member, whichever grouping made them (a custom
    # keys function takes webdataset's loop), as tarshards' own samples do
    custom = list(
        wds.group_by_keys(
            wds.tar_file_expander(wds.url_opener([{"url": paths[0]}])),
            keys=lambda name: wds.base_plus_ext(name),
        )
    )
    offsets = [s["__offset__"] for s in grouped]
    assert [s["__offset__"] for s in custom] == offsets
    assert offsets == [s["__offset__"] for s in tarshards.WebDataset(paths[0])]
    assert offsets[0] == 0 and offsets == sorted(set(offsets))


# ---- OpenCLIP's shape: simulated ranks, real gloo ranks --------------------------------------


def openclip_pipeline(urls, *, rank=None, world_size=None, epoch_batches=5, resampled=False):
    """The pipeline OpenCLIP's get_wds_dataset builds, at a small scale."""
    if resampled:
        stages = [wds.ResampledShards(urls, deterministic=True, seed=3)]
    else:
        splitter = (
            wds.split_by_node
            if rank is None
            else functools.partial(wds.split_by_node, rank=rank, world_size=world_size)
        )
        stages = [
            wds.SimpleShardList(urls),
            wds.detshuffle(bufsize=100, initial=10, seed=3),
            splitter,
            wds.split_by_worker,
        ]
    stages += [
        wds.tarfile_to_samples(handler=wds.warn_and_continue),
        wds.shuffle(20, initial=5),
        wds.select(lambda s: "jpg" in s and "json" in s),
        wds.decode("pilrgb", handler=wds.warn_and_continue),
        wds.rename(image="jpg;png;jpeg;webp", text="txt;json", key="__key__"),
        wds.map_dict(
            image=lambda im: torch.from_numpy(np.array(im)).permute(2, 0, 1), text=lambda t: t["i"]
        ),
        wds.to_tuple("image", "text", "key"),
        wds.batched(4, partial=False),
    ]
    return wds.DataPipeline(*stages).with_epoch(epoch_batches)


def run_loader(pipeline, epochs=1):
    loader = wds.WebLoader(
        pipeline, batch_size=None, shuffle=False, num_workers=2, persistent_workers=True
    )
    out = []
    for _ in range(epochs):
        out.append([batch for batch in loader])
    return out


@needs_torch
def test_openclip_pipeline_two_simulated_ranks(eight):
    paths, samples = eight
    seen = []
    for rank in range(2):
        (batches,) = run_loader(openclip_pipeline(paths, rank=rank, world_size=2))
        assert len(batches) == 10  # 5 batches x 2 workers
        for images, texts, keys in batches:
            assert images.shape == (4, 3, 24, 32) and images.dtype == torch.uint8
            assert texts.shape == (4,)
            seen.extend(keys)
    # 8 shards over 2 ranks x 2 workers: every sample once
    assert sorted(seen) == sorted(s["__key__"] for s in samples)


@needs_torch
def test_openclip_pipeline_longer_epoch_repeats_per_worker(eight):
    paths, _ = eight
    (batches,) = run_loader(openclip_pipeline(paths, rank=0, world_size=2, epoch_batches=8))
    assert len(batches) == 16  # exactly 8 per worker, though each has only 5 batches of data


@needs_torch
def test_openclip_resampled_is_deterministic(eight):
    paths, _ = eight
    first = run_loader(openclip_pipeline(paths, resampled=True, epoch_batches=3), epochs=1)
    second = run_loader(openclip_pipeline(paths, resampled=True, epoch_batches=3), epochs=1)
    assert [list(b[2]) for b in first[0]] == [list(b[2]) for b in second[0]]
    assert len(first[0]) == 6


GLOO_SCRIPT = """
import json, sys
import torch.distributed as dist
sys.path[:0] = [{tests!r}, {here!r}]
from test_compat import openclip_pipeline, run_loader
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=rank, world_size=2)
(batches,) = run_loader(openclip_pipeline({paths!r}))
keys = [k for _, _, ks in batches for k in ks]
dist.barrier()
dist.destroy_process_group()
print(json.dumps({{"rank": rank, "batches": len(batches), "keys": keys}}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_torch
def test_openclip_pipeline_two_gloo_ranks(eight, tmp_path):
    import json

    paths, samples = eight
    script = tmp_path / "rank.py"
    script.write_text(
        GLOO_SCRIPT.format(
            tests=os.path.dirname(os.path.dirname(__file__)),
            here=os.path.dirname(__file__),
            port=free_port(),
            paths=paths,
        )
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC] + sys.path))
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        for r in range(2)
    ]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=180)
            assert p.returncode == 0, err[-2000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [r["batches"] for r in results] == [10, 10]
    seen = [k for r in results for k in r["keys"]]
    assert sorted(seen) == sorted(s["__key__"] for s in samples)  # disjoint and complete


# ---- WebDataset and WebLoader, fluent --------------------------------------------------------


def test_webdataset_fluent_and_context_manager(eight):
    paths, samples = eight
    with (
        wds.WebDataset(paths, shardshuffle=100)
        .shuffle(5)
        .decode("rgb")
        .to_tuple("png;jpg", "cls", "__key__") as ds
    ):
        got = list(ds)
    assert sorted(k for *_, k in got) == sorted(s["__key__"] for s in samples)
    assert got[0][0].dtype == np.float32
    assert len(list(wds.WebDataset(paths, shardshuffle=False).rsample(1.0))) == 80
    assert len(list(wds.WebDataset(paths, shardshuffle=False).repeat(nepochs=2))) == 160
    assert len(list(wds.WebDataset(paths[:1], shardshuffle=False).with_epoch(33))) == 33
    tup = next(iter(wds.WebDataset(paths, shardshuffle=False).extract_keys("*.jpg", "*.cls")))
    assert isinstance(tup[0], bytes) and tup[1] == b"0"


@needs_torch
def test_webloader_fluent_methods(eight):
    paths, samples = eight
    ds = wds.WebDataset(paths, shardshuffle=True).decode().to_tuple("cls", "__key__").batched(3)
    loader = wds.WebLoader(ds, batch_size=None, num_workers=2).unbatched().shuffle(10).batched(8)
    batches = list(loader)
    keys = [k for _, ks in batches for k in ks]
    assert sorted(keys) == sorted(s["__key__"] for s in samples)
    assert all(len(ks) == 8 for _, ks in batches)


@needs_torch
def test_dataloader_over_a_pipeline(eight):
    paths, _ = eight
    ds = wds.DataPipeline(
        wds.SimpleShardList(paths),
        wds.split_by_worker,
        wds.tarfile_to_samples(),
        wds.decode(),
        wds.to_tuple("cls"),
    )
    loader = torch.utils.data.DataLoader(ds, num_workers=2, batch_size=3)
    unbatched = wds.DataPipeline(loader, wds.unbatched())
    assert len(list(unbatched)) == 80


# ---- shard lists ------------------------------------------------------------------------------


def test_resampled_shards_deterministic_from_the_seed():
    urls = [f"s{i}" for i in range(100)]
    a = wds.ResampledShards(urls, deterministic=True, seed=1)
    b = wds.ResampledShards(urls, deterministic=True, seed=1)
    first = [x["url"] for x, _ in zip(a, range(20))]
    assert first == [x["url"] for x, _ in zip(b, range(20))]
    assert [x["url"] for x, _ in zip(a, range(20))] != first  # the next epoch differs
    c = wds.ResampledShards(urls, deterministic=True, seed=2)
    assert [x["url"] for x, _ in zip(c, range(20))] != first


def test_split_by_node_and_worker_over_url_dicts():
    src = [{"url": str(i)} for i in range(10)]
    mine = list(wds.split_by_node(iter(src), rank=1, world_size=3))
    assert [x["url"] for x in mine] == ["1", "4", "7"]
    assert len(list(wds.split_by_worker(iter(src)))) == 10  # main process: worker 0 of 1
    with pytest.raises(ValueError):
        list(wds.non_empty(iter([])))


def test_env_vars_in_specs_only_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("WDS_ROOT", str(tmp_path))
    assert wds.SimpleShardList("${ROOT}/a.tar").urls == ["${ROOT}/a.tar"]
    assert wds.SimpleShardList("${ROOT}/a-{0..1}.tar", expand_env=True).urls == [
        f"{tmp_path}/a-0.tar",
        f"{tmp_path}/a-1.tar",
    ]
    with pytest.raises(ValueError, match="WDS_NOPE"):
        wds.SimpleShardList("${NOPE}/a.tar", expand_env=True)


def test_mixing(eight):
    paths, _ = eight
    a = wds.DataPipeline(wds.SimpleShardList(paths[:1]), wds.tarfile_samples)
    b = wds.DataPipeline(wds.SimpleShardList(paths[1:2]), wds.tarfile_samples)
    assert len(list(wds.RoundRobin([a, b]))) == 20
    mix1 = [s["__key__"] for s in wds.RandomMix([a, b], longest=True)]
    mix2 = [s["__key__"] for s in wds.RandomMix([a, b], longest=True)]
    assert len(mix1) == 20 and mix1 == mix2  # seeded
    assert list(wds.RoundRobin([[1, 1], [2], [3, 3, 3]], longest=True)) == [1, 2, 3, 1, 3, 3]


# ---- errors webdataset code catches; safety defaults ------------------------------------------


def test_corrupt_shard_is_a_tarfile_read_error(tmp_path, eight):
    paths, _ = eight
    bad = tmp_path / "bad.tar"
    bad.write_bytes(Path(paths[0]).read_bytes()[:2500])  # inside a member's data
    with pytest.raises(tarfile.ReadError):
        list(wds.DataPipeline(wds.SimpleShardList([str(bad)]), wds.tarfile_to_samples()))
    got = list(
        wds.DataPipeline(
            wds.SimpleShardList([str(bad), paths[1]]),
            wds.tarfile_to_samples(handler=wds.ignore_and_continue),
        )
    )
    assert len(got) >= 10


def test_missing_field_is_value_error_and_key_error(eight):
    paths, _ = eight
    for stage in (wds.to_tuple("foo"), wds.rename(x="foo"), wds.map_dict(foo=len)):
        ds = wds.DataPipeline(wds.SimpleShardList(paths[:1]), wds.tarfile_to_samples(), stage)
        with pytest.raises(ValueError) as info:
            list(ds)
        assert isinstance(info.value, KeyError) and isinstance(info.value, MissingFieldError)


def test_pipe_refused_unless_allowed(tmp_path, eight):
    paths, _ = eight
    with pytest.raises(PipeNotAllowedError, match="allow_pipe=True"):
        list(wds.WebDataset(f"pipe:cat {paths[0]}", shardshuffle=False))
    # a handler that continues does not swallow the refusal: it is not a data error
    with pytest.raises(PipeNotAllowedError):
        list(
            wds.DataPipeline(
                wds.SimpleShardList(f"pipe:cat {paths[0]}"),
                wds.tarfile_to_samples(handler=wds.ignore_and_stop),
            )
        )
    assert (
        len(list(wds.WebDataset(f"pipe:cat {paths[0]}", shardshuffle=False, allow_pipe=True))) == 10
    )
    assert (
        len(
            list(
                wds.DataPipeline(
                    wds.SimpleShardList(f"pipe:cat {paths[0]}"),
                    wds.tarfile_to_samples(allow_pipe=True),
                )
            )
        )
        == 10
    )
    with pytest.raises(PipeNotAllowedError, match="allow_pipe=True"):
        wds.TarWriter(f"pipe:cat > {tmp_path}/p.tar")
    with wds.TarWriter(f"pipe:cat > {tmp_path}/p.tar", allow_pipe=True) as sink:
        sink.write({"__key__": "a", "txt": "hello", "cls": 3})
    (sample,) = wds.DataPipeline(
        wds.SimpleShardList(f"{tmp_path}/p.tar"), wds.tarfile_samples, wds.decode()
    )
    assert sample["txt"] == "hello" and sample["cls"] == 3


def test_pickle_refused_unless_allowed(tmp_path):
    with wds.TarWriter(f"{tmp_path}/p.tar") as sink:
        sink.write({"__key__": "a", "pyd": {"x": 0}})
    ds = wds.WebDataset(f"{tmp_path}/p.tar", shardshuffle=False)
    with pytest.raises(UnsafeCodecError, match="allow_unsafe=True"):
        list(ds.decode())
    assert next(iter(ds.decode(allow_unsafe=True)))["pyd"] == {"x": 0}


def test_handlers_are_tarshards_own():
    import tarshards

    assert wds.warn_and_continue is tarshards.warn_and_continue  # never sleeps
    assert wds.reraise_exception is tarshards.reraise_exception


def test_pipeline_handler_reaches_curried_filters():
    """A curried filter that takes only handler= (webdataset's) gets the pipeline's policy."""

    def f(x):
        if x == 2:
            raise ValueError("bad")
        return x * 10

    pipeline = wds.DataPipeline(lambda: iter(range(5)), wds.map(f), handler=wds.ignore_and_continue)
    assert list(pipeline) == [0, 10, 30, 40]
    with pytest.raises(ValueError, match="bad"):
        list(wds.DataPipeline(lambda: iter(range(5)), wds.map(f)))


# ---- decoding, writing, tenbin ---------------------------------------------------------------


@needs_torch
def test_image_handler_and_decode_handlers(eight):
    paths, _ = eight
    ds = wds.DataPipeline(
        wds.SimpleShardList(paths[:1]),
        wds.tarfile_samples,
        wds.decode(wds.autodecode.ImageHandler("torchrgb")),
        wds.to_tuple("jpg", "cls"),
    )
    image, cls = next(iter(ds))
    assert image.shape == (3, 24, 32) and image.dtype == torch.float32 and isinstance(cls, int)
    ds = (
        wds.WebDataset(paths[:1], shardshuffle=False)
        .decode(wds.handle_extension("jpg", len), wds.imagehandler("l8"))
        .to_tuple("jpg")
    )
    assert isinstance(next(iter(ds))[0], int)


def test_writers_and_tenbin(tmp_path):
    from tarshards.compat import tenbin

    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4, np.uint8)]
    (back,) = [tenbin.decode_buffer(tenbin.encode_buffer(arrays))]
    assert all((a == b).all() and a.dtype == b.dtype for a, b in zip(arrays, back))
    with wds.ShardWriter(f"{tmp_path}/s-%04d.tar", maxcount=3, verbose=0) as sink:
        for i in range(7):
            sink.write({"__key__": f"k{i}", "ten": arrays, "tb": np.full(2, i), "cls": i})
    ds = wds.WebDataset(f"{tmp_path}/s-{{0000..0002}}.tar", shardshuffle=False).decode()
    got = list(ds)
    assert [s["cls"] for s in got] == list(range(7))
    assert (got[0]["ten"][0] == arrays[0]).all() and (got[4]["tb"][0] == 4).all()


def test_tenbin_matches_webdataset(tmp_path):
    theirs = pytest.importorskip("webdataset.tenbin")
    from tarshards.format import tenbin

    arrays = [np.random.default_rng(0).random((3, 5)), np.arange(7, dtype=np.int16)]
    for a, b in zip(theirs.decode_buffer(tenbin.encode_buffer(arrays)), arrays):
        assert (a == b).all()
    for a, b in zip(tenbin.decode_buffer(bytes(theirs.encode_buffer(arrays))), arrays):
        assert (a == b).all()
    buf = io.BytesIO()
    tenbin.write(buf, arrays)
    buf.seek(0)
    assert all((a == b).all() for a, b in zip(tenbin.read(buf), arrays))


@pytest.mark.filterwarnings("ignore:unclosed file:ResourceWarning")  # webdataset's own open file
def test_shards_written_by_compat_read_by_webdataset(tmp_path):
    real = pytest.importorskip("webdataset")
    with wds.TarWriter(str(tmp_path / "x.tar")) as sink:
        for i in range(5):
            sink.write({"__key__": f"k{i}", "cls": i, "txt": f"t{i}"})
    theirs = list(
        real.WebDataset(str(tmp_path / "x.tar"), shardshuffle=False)
        .decode()
        .to_tuple("__key__", "cls", "txt")
    )
    ours = list(
        wds.WebDataset(str(tmp_path / "x.tar"), shardshuffle=False)
        .decode()
        .to_tuple("__key__", "cls", "txt")
    )
    assert ours == theirs == [(f"k{i}", i, f"t{i}") for i in range(5)]


def test_compat_without_torch(tmp_path, eight):
    """The lean install: no torch, yet compat pipelines run (as plain iterables)."""
    paths, _ = eight
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # torch cannot be imported\n"
        "import tarshards.compat as wds\n"
        f"ds = wds.DataPipeline(wds.SimpleShardList({paths!r}), wds.split_by_node,\n"
        "    wds.split_by_worker, wds.tarfile_to_samples(), wds.shuffle(10), wds.decode('rgb8'),\n"
        "    wds.to_tuple('jpg', 'cls'), wds.batched(5))\n"
        "print(sum(len(c) for _, c in ds), wds.pytorch_worker_info())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([SRC] + sys.path)),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[0] == "80 (0, 1, 0, 1)"


def test_import_tarshards_alone_stays_light():
    code = "import sys, tarshards; print('tarshards.compat' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([SRC] + sys.path)),
    )
    assert out.stdout.strip() == "False"


def test_cache_dir_samples_carry_their_local_path(tmp_path):
    """With ``cache_dir=`` every sample has webdataset's ``__local_path__``: the cached copy of
    a remote shard (served by a real HTTP server on 127.0.0.1), the file itself for a local
    shard (read in place); without ``cache_dir=`` there is none."""
    from conftest import load_servers

    pytest.importorskip("aiohttp", reason="http:// needs aiohttp (pip install 'tarshards[http]')")
    servers = load_servers()
    root = tmp_path / "www"
    root.mkdir()
    paths, _ = write_shards(root, 2, 3)
    cache = tmp_path / "cache"
    with servers.HTTPFileServer(root) as srv:
        remote = [f"{srv.url}/{os.path.basename(p)}" for p in paths]
        got = list(wds.WebDataset(remote, cache_dir=str(cache), shardshuffle=False))
        assert len(got) == 6
        for sample in got:
            local = sample["__local_path__"]
            assert local.startswith(str(cache)) and os.path.isfile(local)
            with open(local, "rb") as f, open(paths[remote.index(sample["__url__"])], "rb") as g:
                assert f.read() == g.read()
    here = list(wds.WebDataset(paths, cache_dir=str(cache), shardshuffle=False))
    assert [s["__local_path__"] for s in here] == [s["__url__"] for s in here]
    assert all("__local_path__" not in s for s in wds.WebDataset(paths, shardshuffle=False))
