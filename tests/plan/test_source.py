"""ReaderStream reads a reader's segment in chunks the same way whatever it knows of the shards:
offsets and a seekable file, offsets and a stream that cannot seek, or no offsets at all."""

from __future__ import annotations

import contextlib
import io
import itertools

import pytest
from test_resume import COUNTS, write_uneven

from tarshards.plan.cursor import EpochPlan, PlanConfig, ReaderStream, ShardTable, scan_shards
from tarshards.tario.buffer import map_local


class _Forward:
    """A file that can only be read forwards (as an HTTP stream)."""

    def __init__(self, f):
        self._f = f

    def read(self, n=-1):
        return self._f.read(n)

    def readinto(self, view):
        return self._f.readinto(view)

    def seekable(self):
        return False


def _open(url):
    return open(url, "rb")


@contextlib.contextmanager
def _open_forward(url):
    with open(url, "rb") as f:
        yield _Forward(f)


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    return write_uneven(tmp_path_factory.mktemp("source"))


def _expected_keys(plan, reader, position=0):
    first = list(itertools.accumulate([0] + COUNTS))
    return [
        (f"k{first[s] + i:04d}", pad)
        for s, a, b, pad in plan.segment_runs(reader, position)
        for i in range(a, b)
    ]


@pytest.mark.parametrize("mode", ["seek", "forward", "no-offsets"])
@pytest.mark.parametrize("chunk_bytes", [1, 700, 1 << 17])
@pytest.mark.parametrize("remainder", ["drop", "pad"])
def test_reader_stream_reads_its_segment_from_any_position(urls, mode, chunk_bytes, remainder):
    scanned = scan_shards(urls, opener=_open)
    table = scanned if mode != "no-offsets" else ShardTable(urls, scanned.counts)
    opener = _open_forward if mode == "forward" else _open
    plan = EpochPlan(
        table.counts, PlanConfig(seed=2, readers=5, batch_size=3, remainder=remainder), 1
    )
    for reader in range(5):
        want = _expected_keys(plan, reader)
        for position in sorted({0, 1, plan.segment_length // 2, plan.segment_length - 1}):
            stream = ReaderStream(table, plan, reader, opener=opener, chunk_bytes=chunk_bytes)
            stream.seek(position)
            try:
                got = stream.take(plan.segment_length - position)
            finally:
                stream.close()
            assert [(s["__key__"], s["__pad__"]) for s in got] == want[position:]
            assert all(s["txt"] == f"value {int(s['__key__'][1:])}".encode() for s in got)


def test_reader_stream_with_shuffle_equals_a_fresh_run_from_every_position(urls):
    table = scan_shards(urls, opener=_open)
    plan = EpochPlan(table.counts, PlanConfig(seed=4, readers=3, batch_size=4, bufsize=6), 0)
    for reader in range(3):
        full = ReaderStream(table, plan, reader, opener=_open, chunk_bytes=700)
        whole = [s["__key__"] for s in full.take(plan.segment_length)]
        full.close()
        assert sorted(whole) == sorted(k for k, _ in _expected_keys(plan, reader))
        for position in range(0, plan.segment_length, 5):
            stream = ReaderStream(table, plan, reader, opener=_open_forward, chunk_bytes=1 << 17)
            stream.seek(position)
            rest = [s["__key__"] for s in stream.take(plan.segment_length - position)]
            stream.close()
            assert rest == whole[position:]


def test_reader_stream_names_a_shard_that_changed(urls, tmp_path):
    table = scan_shards(urls, opener=_open)
    short = ShardTable(urls, [c + 2 for c in table.counts])  # counted more than there are
    plan = EpochPlan(short.counts, PlanConfig(readers=1, batch_size=1, shardshuffle=False), 0)
    stream = ReaderStream(short, plan, 0, opener=_open)
    with pytest.raises(Exception, match="fewer samples") as info:
        stream.take(plan.segment_length)
    assert urls[0] in str(info.value)
    stream.close()


def _open_bytes(url):
    """A seekable stream that is no file: read through the reader's buffer, never mapped."""
    with open(url, "rb") as f:
        return io.BytesIO(f.read())


@pytest.mark.parametrize("remainder", ["drop", "pad"])
def test_mapped_and_buffered_reads_give_the_same_samples_from_every_position(urls, remainder):
    """A local file is mapped (the segment's runs and a resumed shuffle buffer's samples parsed
    in place); any other stream is read through a buffer of the reader's size. Both give the
    same samples, offsets and padding flags, fresh and resumed (padding puts one sample in the
    buffer twice: it is read once and copied)."""
    table = scan_shards(urls, opener=_open)
    # padding: one reader whose buffer outgrows its segment holds repeated samples twice
    readers, bufsize = (2, 9) if remainder == "drop" else (1, 100)
    cfg = PlanConfig(seed=5, readers=readers, batch_size=4, bufsize=bufsize, remainder=remainder)
    plan = EpochPlan(table.counts, cfg, 0)
    padded = False
    for reader in range(readers):
        fresh = ReaderStream(table, plan, reader, opener=_open_bytes)
        whole = fresh.take(plan.segment_length)
        fresh.close()
        for position in range(0, plan.segment_length, 3):
            got = {}
            for name, opener in (("mapped", _open), ("buffered", _open_bytes)):
                stream = ReaderStream(table, plan, reader, opener=opener, chunk_bytes=700)
                stream.seek(position)
                got[name] = stream.take(plan.segment_length - position)
                stream.close()
            assert got["mapped"] == got["buffered"] == whole[position:]
            assert all(s["__offset__"] >= 0 and s["__url__"] in urls for s in got["mapped"])
            padded = padded or any(s["__pad__"] for s in got["mapped"])
    assert padded == (remainder == "pad")


def test_a_planned_reader_maps_a_local_file(urls, monkeypatch):
    import tarshards.plan.cursor as source

    mapped = []

    def spy(stream, length=-1):
        file = map_local(stream, length)
        mapped.append(file is not None)
        return file

    monkeypatch.setattr(source, "map_local", spy)
    table = scan_shards(urls, opener=_open)
    plan = EpochPlan(table.counts, PlanConfig(seed=1, readers=2, batch_size=2, bufsize=4), 0)
    stream = ReaderStream(table, plan, 1, opener=_open)
    stream.seek(3)  # the buffer's samples by offset, then the rest of the segment
    stream.take(plan.segment_length - 3)
    stream.close()
    assert mapped and all(mapped)
    mapped.clear()
    stream = ReaderStream(table, plan, 1, opener=_open_bytes)
    stream.seek(3)
    stream.take(plan.segment_length - 3)
    stream.close()
    assert mapped and not any(mapped)


# ---- lists cut at batch boundaries, nothing kept after a turn ------------------------------


@pytest.mark.parametrize("mode", ["seek", "forward", "no-offsets"])
@pytest.mark.parametrize("unit", [1, 3, 4, 7, 64])
def test_takes_of_any_size_across_the_lists_give_the_segment(urls, mode, unit):
    """Lists are cut at the segment positions that are multiples of the unit (and where a
    shard's run ends); takes that end inside a list, span several, or match one exactly give
    the segment's samples in order, from any position."""
    scanned = scan_shards(urls, opener=_open)
    table = scanned if mode != "no-offsets" else ShardTable(urls, scanned.counts)
    opener = _open_forward if mode == "forward" else _open
    plan = EpochPlan(table.counts, PlanConfig(seed=3, readers=3, batch_size=4), 0)
    sizes = itertools.cycle([1, 4, 2, 7, 16, 3, 4])
    for reader in range(3):
        want = [k for k, _ in _expected_keys(plan, reader)]
        for position in (0, 5):
            stream = ReaderStream(table, plan, reader, opener=opener, unit=unit)
            stream.seek(position)
            got: list = []
            while len(got) < len(want) - position:
                got += stream.take(min(next(sizes), len(want) - position - len(got)))
            stream.close()
            assert [s["__key__"] for s in got] == want[position:]


def test_a_reader_keeps_no_reference_to_the_samples_it_handed_on(urls):
    """Interleaved readers each take a batch per turn: what a reader handed on must not stay
    alive until its next turn (a dozen readers later, that made every batch allocate and free
    memory gone cold in the CPU caches). (A streamed shard, not mapped, holds the samples of
    its current read window, ``chunk_bytes``.)"""
    import sys

    opener = _open

    table = scan_shards(urls, opener=_open)
    plan = EpochPlan(table.counts, PlanConfig(seed=1, readers=2, batch_size=4), 0)
    alone = [sys.getrefcount(s) for s in [{} for _ in range(4)]]  # held by one list only
    for unit in (4, 1):  # a list per batch; lists of several batches
        stream = ReaderStream(table, plan, 1, opener=opener, unit=unit)
        stream.seek(0)
        for _ in range(plan.segment_length // 4):
            batch = stream.take(4)
            assert [sys.getrefcount(s) for s in batch] == alone  # no list, window or variable
        stream.close()


def test_a_long_mapped_run_gives_its_pages_back_as_it_goes(tmp_path, monkeypatch):
    """Lists parsed one by one from a mapped run release the pages behind them every 8 MiB
    (the resident memory stays that of a window, not of the shard)."""
    import mmap

    import tarshards.plan.cursor as source
    from tarshards import TarWriter

    path = tmp_path / "big.tar"
    with TarWriter(str(path)) as w:
        for i in range(40):
            w.write({"__key__": f"s{i:03d}", "bin": bytes([i]) * (1 << 19)})
    mapped = []

    def spy(stream, length=-1):
        file = map_local(stream, length)
        mapped.append(file)
        return file

    monkeypatch.setattr(source, "map_local", spy)
    monkeypatch.setattr(source, "_SampleScan", None)  # (else read with pread, not mapped)
    table = scan_shards([str(path)], opener=_open)
    plan = EpochPlan(table.counts, PlanConfig(readers=1, batch_size=4, shardshuffle=False), 0)
    stream = ReaderStream(table, plan, 0, opener=_open, unit=4)
    stream.seek(0)
    got = [s["bin"][:1] for s in stream.take(40)]
    stream.close()
    assert got == [bytes([i]) for i in range(40)]
    assert len(mapped) == 1
    if hasattr(mmap, "MADV_DONTNEED"):
        assert mapped[0]._released >= 16 << 20


def _lookahead(samples):
    """A stage that reads one sample ahead before handing one on."""
    it = iter(samples)
    prev = next(it, None)
    for sample in it:
        yield prev
        prev = sample
    if prev is not None:
        yield prev


# (planned batches drop the remainder by default; the warning has tests of its own)
@pytest.mark.filterwarnings("ignore:epoch \\d+ drops:tarshards.errors.TarshardsWarning")
def test_a_stage_that_reads_ahead_into_the_next_batch_gets_every_sample(urls):
    """After each turn the consumed lists of the reader's feed are emptied; a stage that has
    already read into the next batch's list keeps it whole."""
    from tarshards.pipeline.dataset import WebDataset

    def keys(ds):
        return [[s["__key__"] for s in batch] for batch in ds]

    def make():
        return WebDataset(urls, readers=3, seed=4)

    plain = keys(make().batched(4, collation_fn=list))
    ahead = keys(make().compose(_lookahead).batched(4, collation_fn=list))
    assert ahead == plain and len(plain) == 3 * (sum(COUNTS) // 12)


def test_interleaved_readers_hold_about_one_batch(tmp_path):
    """With six readers taking turns, the pipeline holds what one turn needs, not a batch per
    reader (measured with tracemalloc: the samples are 16 KiB each, 16 to a batch)."""
    import tracemalloc

    from tarshards import TarWriter
    from tarshards.pipeline.dataset import WebDataset

    urls = []
    for s in range(3):
        path = tmp_path / f"p{s}.tar"
        with TarWriter(str(path)) as w:
            for i in range(64):
                w.write({"__key__": f"s{s}-{i:03d}", "bin": bytes(16 << 10), "cls": b"1"})
        urls.append(str(path))
    B = 16
    ds = WebDataset(urls, readers=6, seed=0).to_tuple("bin", "cls").batched(B, collation_fn=list)
    ds.set_table(scan_shards(urls, opener=_open))
    it = iter(ds)
    batch = next(it)
    tracemalloc.start()
    try:
        held = 0
        for _ in range(6):
            batch = next(it)
            del batch
            held = max(held, tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    per_batch = B * (16 << 10)
    assert held < 2.5 * per_batch  # six readers keeping their last batch: >= 6 batches


# ---- a mapped list in one C call, the general path for the rest ------------------------------


def _foreign_shard(path, n=64):
    """A tarfile-written shard (GNU format) with, between its first samples, members the C scan
    does not read (a directory, a symlink, a hard link), and members it reads behind extra
    headers (a GNU long name) throughout."""
    import tarfile

    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for i in range(n):
            key = f"d{i:03d}" if i % 5 != 3 else f"{'long' * 30}{i:03d}"
            if i in (2, 9):
                d = tarfile.TarInfo(f"dir{i}")
                d.type = tarfile.DIRTYPE
                tar.addfile(d)
            if i in (4, 11):
                link = tarfile.TarInfo(f"link{i}")
                link.type = tarfile.SYMTYPE if i % 2 else tarfile.LNKTYPE
                link.linkname = f"d{i - 1:03d}.cls"
                tar.addfile(link)
            for ext, data in (("cls", str(i).encode()), ("txt", b"t" * (i * 37 % 1500))):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


def test_mapped_lists_equal_the_general_path_over_foreign_members(tmp_path, monkeypatch):
    """A list of a mapped shard is read in one C call when its bytes are plain members up to the
    next sample's offset; lists holding members the C scan leaves to the general path (links,
    directories) go through it. Both give what a buffered (never mapped) read gives, and the C
    call does take the plain lists."""
    import tarshards.plan.cursor as source

    urls = [_foreign_shard(tmp_path / f"f{s}.tar", n=64 + 3 * s) for s in range(2)]
    real = source.plain_run
    taken = []

    def spy(buf, lo, hi):
        got = real(buf, lo, hi)
        taken.append(got is not None)
        return got

    monkeypatch.setattr(source, "plain_run", spy)
    table = scan_shards(urls, opener=_open)
    for unit in (1, 3, 4):
        plan = EpochPlan(table.counts, PlanConfig(seed=2, readers=2, batch_size=unit), 0)
        for reader in range(2):
            got = {}
            for name, opener in (("mapped", _open), ("buffered", _open_bytes)):
                stream = ReaderStream(table, plan, reader, opener=opener, unit=unit)
                stream.seek(0)
                got[name] = stream.take(plan.segment_length)
                stream.close()
            assert got["mapped"] == got["buffered"]
            assert [s["__key__"][-3:] for s in got["mapped"]] == [
                k[-3:] for k, _ in _expected_foreign(plan, reader, table)
            ]
    assert any(taken) and not all(taken)  # plain lists in one call, the others by the general path


def _expected_foreign(plan, reader, table):
    import tarfile

    keys = []
    for s, a, b, pad in plan.segment_runs(reader, 0):
        with tarfile.open(table.urls[s]) as tar:
            names = [m.name.rsplit(".", 1)[0] for m in tar.getmembers() if m.name.endswith(".cls")]
        keys += [(k, pad) for k in names[a:b]]
    return keys


def test_a_damaged_header_inside_a_mapped_list_is_reported_as_by_the_plain_reader(tmp_path):
    """The one-call read of a list stops at a header whose checksum is wrong, and the general
    path reports it: the same error as a plain sequential read, naming the shard, the member
    and its offset."""
    from tarshards.errors import TarshardsError
    from tarshards.pipeline.dataset import iter_samples

    bad = _foreign_shard(tmp_path / "s.tar")
    table = scan_shards([bad], opener=_open)  # counted and indexed while intact
    with open(bad, "r+b") as f:
        f.seek(int(table.sample_offsets(0)[37]) + 148)  # sample 37's first header's checksum
        f.write(b"0000000\0")
    with pytest.raises(TarshardsError) as plain:
        list(iter_samples([bad]))
    plan = EpochPlan(table.counts, PlanConfig(readers=1, batch_size=4, shardshuffle=False), 0)
    stream = ReaderStream(table, plan, 0, opener=_open, unit=4)
    stream.seek(0)
    with pytest.raises(TarshardsError) as planned:
        stream.take(plan.segment_length)
    stream.close()
    assert type(planned.value) is type(plain.value)
    assert planned.value.url == bad and planned.value.offset == plain.value.offset
    assert planned.value.member == plain.value.member and plain.value.offset is not None


def _odd_shard(path) -> None:
    """Samples of varied sizes with what the C sample scan declines among them: a symbolic link
    (its sample on is read by the mapped path) and a pax header with a size record."""
    import tarfile

    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for i in range(60):
            for ext, size in (("jpg", (i * 7919) % 90_000), ("cls", i % 5)):
                ti = tarfile.TarInfo(f"s{i:03d}.{ext}")
                ti.size = size
                if i == 41 and ext == "cls":
                    ti.pax_headers = {"size": str(size)}
                tf.addfile(ti, io.BytesIO(bytes([i % 251]) * size))
            if i == 17:
                link = tarfile.TarInfo(f"s{i:03d}.lnk")
                link.type = tarfile.SYMTYPE
                link.linkname = "elsewhere"
                tf.addfile(link)


@pytest.mark.parametrize("unit", [1, 4, 16])
def test_pread_and_mapped_runs_read_the_same_samples(tmp_path, monkeypatch, unit):
    """A local plain shard's runs are read with pread by the C sample scan (the mapped path
    from the first list it does not take whole): the same samples, offsets and lists as the
    mapped path, from every position, in shards the scan takes whole and in one it declines
    twice."""
    import warnings

    import tarshards.plan.cursor as source
    from tarshards import TarWriter

    plain = tmp_path / "plain.tar"
    with TarWriter(str(plain)) as w:
        for i in range(50):
            w.write(
                {"__key__": f"p{i:03d}", "bin": bytes([i]) * ((i * 3571) % 70_000), "n": str(i)}
            )
    odd = tmp_path / "odd.tar"
    _odd_shard(odd)
    urls = [str(plain), str(odd)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = scan_shards(urls, opener=_open)
        plan = EpochPlan(table.counts, PlanConfig(seed=1, readers=3, batch_size=unit), 0)

        mapped: list = []  # the runs the scanning reader left to the mapped path
        real = source.ReaderStream._mapped_lists

        def spy(self, src, url, *args):
            mapped.append(url)
            return real(self, src, url, *args)

        def read(position: int, reader: int, scan: bool) -> list:
            if not scan:
                monkeypatch.setattr(source, "_SampleScan", None)
            else:
                monkeypatch.setattr(source.ReaderStream, "_mapped_lists", spy)
            stream = ReaderStream(table, plan, reader, opener=_open, unit=unit)
            stream.seek(position)
            try:
                return stream.take(plan.segment_length - position)
            finally:
                stream.close()
                monkeypatch.undo()

        for reader in range(3):
            for position in (0, 1, 7, plan.segment_length // 2, plan.segment_length - 1):
                assert read(position, reader, True) == read(position, reader, False)
    assert str(odd) in mapped and str(plain) not in mapped
