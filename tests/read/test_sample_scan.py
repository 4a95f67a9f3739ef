"""The C sample scan of local plain files (``_speedups.SampleScan``, under ``shard_samples``) reads
what the reference reader and grouping read: the same samples, offsets, errors and warnings,
whatever the archive holds; it declines what it does not take, and the reference goes on from
that sample."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tarshards.errors import TarshardsError, TarshardsWarning
from tarshards.format.compression import decompressed_chunks
from tarshards.format.names import group_samples
from tarshards.read import reading
from tarshards.read.reading import shard_samples
from tarshards.tario import iter_tar_batches, read_chunks

SampleScan = pytest.importorskip("tarshards._speedups").__dict__.get("SampleScan")
pytestmark = pytest.mark.skipif(SampleScan is None, reason="no pread here")


def _run(samples_of) -> tuple:
    """``(samples, error, warnings)`` of an iteration: samples as dicts of bytes, the error as
    (type, message, member, offset)."""
    got, err = [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TarshardsWarning)
        try:
            for s in samples_of():
                got.append({k: bytes(v) if isinstance(v, bytes) else v for k, v in s.items()})
        except TarshardsError as exc:
            err = (type(exc).__name__, str(exc), exc.member, exc.offset)
    return got, err, [str(w.message) for w in caught]


def reference(raw: bytes, url: str, last_dot: bool = False) -> tuple:
    """The pure Python reader and grouping over the bytes as a stream of 4 KB chunks."""

    def samples():
        chunks = decompressed_chunks(read_chunks(io.BytesIO(raw), 4096), url)
        batches = iter_tar_batches(chunks, url, accelerate=False)
        return group_samples(batches, url, last_dot=last_dot, batched=True, accelerate=False)

    return _run(samples)


def scanned(path, last_dot: bool = False) -> tuple:
    return _run(lambda: shard_samples(str(path), last_dot=last_dot))


def scan_alone(path, start: int = 0, delta: int = 0) -> tuple[list, bool, int]:
    """What the C scan takes by itself: (samples, done, resume)."""
    with open(path, "rb") as f:
        scan = SampleScan(f.fileno(), start, os.fstat(f.fileno()).st_size, str(path), False, delta)
        out = list(scan)
    return out, scan.done, scan.resume


def _tar(members, fmt=tarfile.USTAR_FORMAT, end: bool = True, **info) -> bytes:
    out = io.BytesIO()
    with tarfile.open(
        fileobj=out, mode="w", format=fmt, encoding="utf-8", errors="surrogateescape"
    ) as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            for k, v in info.items():
                setattr(ti, k, v)
            if data is None:  # a directory
                ti.type = tarfile.DIRTYPE
                tf.addfile(ti)
                continue
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    raw = out.getvalue()
    if not end:  # tarfile pads to 10 KB records: keep the members only
        raw = raw.rstrip(b"\0")
        raw += bytes(-len(raw) % 512)
    return raw


SIZES = [0, 1, 511, 512, 513, 16_383, 16_384, 16_385, 70_000, 100_000, 300_000, 1_200_000]


def _samples(n: int = 30, exts=("jpg", "cls", "json")) -> list[tuple[str, bytes]]:
    members = []
    for i in range(n):
        for j, ext in enumerate(exts):
            size = SIZES[(i * 7 + j * 3) % len(SIZES)]
            members.append((f"s{i:04d}.{ext}", bytes([(i + j) % 251]) * size))
    return members


def _check(tmp_path, raw: bytes, last_dot: bool = False, name: str = "t.tar") -> tuple:
    path = tmp_path / name
    path.write_bytes(raw)
    ref = reference(raw, str(path), last_dot)
    got = scanned(path, last_dot)
    assert got == ref
    return got


def test_plain_shards_are_read_by_the_scan_alone_with_the_reference_samples(tmp_path):
    for fmt in (tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT):
        raw = _tar(_samples(), fmt)
        samples, err, warned = _check(tmp_path, raw)
        assert err is None and not warned and len(samples) == 30
        got, done, _ = scan_alone(tmp_path / "t.tar")
        assert done and got == samples  # every sample, without the reference reader


def test_pax_and_long_name_members_are_taken_too(tmp_path):
    """tarfile's and webdataset's pax headers (a float mtime on every member), a pax path, and
    GNU long names: the scan takes them (the names they give); keys longer than its 4 KB are
    declined and read by the reference."""
    members = _samples(12)
    pax = _tar(members, tarfile.PAX_FORMAT, mtime=1.5)
    long = [(f"{'d' * 150}/{n}", d) for n, d in members]
    for raw in (pax, _tar(long, tarfile.GNU_FORMAT), _tar(long, tarfile.PAX_FORMAT)):
        samples, err, _ = _check(tmp_path, raw)
        assert err is None and len(samples) == 12
        got, done, _ = scan_alone(tmp_path / "t.tar")
        assert done and got == samples
    huge = [(f"{'k' * 5000}.{e}", b"x" * 20_000) for e in ("a", "b")] + members[:6]
    samples, err, _ = _check(tmp_path, _tar(huge, tarfile.PAX_FORMAT))
    assert err is None and samples[0]["__key__"] == "k" * 5000
    got, done, resume = scan_alone(tmp_path / "t.tar")
    assert got == [] and not done and resume == 0


def test_names_grouping_skips_and_rewrites(tmp_path):
    """Members grouping skips (``__`` names, no dot, a trailing dot), ``./`` prefixes,
    directories, upper-case and non-ASCII extensions, names that are not UTF-8, and the last
    dot rule."""
    members = [
        ("./a/0001.JPG", b"1" * 30_000),
        ("./a/0001.Cls", b"2"),
        ("__meta__.json", b"{}"),
        ("./a/0001.ÑX", b"3" * 17_000),
        ("README", b"no dot"),
        ("./a/0002.tar.gz", b"4" * 20_000),
        ("a/0002.x.", b"trailing dot"),
        ("./a/0002.txt", b"5"),
        ("b/.hidden", b"6"),
        ("b/\udcff\udcfe.bin", b"7" * 40_000),
        ("b/\udcff\udcfe.cls", b"8"),
        ("__end__", b""),
    ]
    raw = _tar(members, tarfile.GNU_FORMAT)
    for last_dot in (False, True):
        samples, err, _ = _check(tmp_path, raw, last_dot)
        assert err is None
        keys = [s["__key__"] for s in samples]
        assert keys[:2] == ["a/0001", "a/0002"] if not last_dot else ["a/0001", "a/0002.tar"]
        assert "ñx" in samples[0] and "jpg" in samples[0] and "cls" in samples[0]


def test_directories_are_skipped_as_the_reader_skips_them(tmp_path):
    """Directory members (GNU tar's ``./`` first, a folder between samples, behind a pax or long
    name header) are skipped by the scan as by the reader; one that declares a size (whose
    blocks the reader takes for headers) is declined."""
    members = _samples(6)
    dirs = [("./", None), *members[:6], ("./d/", None), *members[6:12], ("d" * 120, None)]
    dirs += members[12:]
    for fmt in (tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        samples, err, _ = _check(tmp_path, _tar(dirs, fmt))
        assert err is None and len(samples) == 6
        got, done, _ = scan_alone(tmp_path / "t.tar")
        assert done and got == samples
    raw = bytearray(_tar(dirs))
    at = len(_tar(dirs[:7], end=False))  # the header of "./d/"
    raw[at + 124 : at + 135] = b"%011o" % 512  # a size, and its checksum made right
    raw[at + 148 : at + 156] = b" " * 8
    raw[at + 148 : at + 155] = b"%06o\0" % sum(raw[at : at + 512])
    samples, err, _ = _check(tmp_path, bytes(raw))
    got, done, resume = scan_alone(tmp_path / "t.tar")
    assert err is None and len(samples) == 6
    # the sample before the directory is the reference's too
    assert not done and len(got) == 1 and resume == samples[1]["__offset__"]


@pytest.mark.skipif(shutil.which("tar") is None, reason="no GNU tar here")
def test_gnu_tar_archives_of_a_folder(tmp_path):
    """``tar -cf shard.tar -C folder .`` in each of GNU tar's formats: its directories, its
    ``./`` names, a file with a hole (stored whole) and a symbolic link (the reader warns; the
    scan leaves that sample and the rest to the reader)."""
    folder = tmp_path / "src"
    for i in range(12):
        sub = folder / f"part{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        for ext, size in (("jpg", 20_000 + 3_000 * i), ("cls", i)):
            (sub / f"s{i:03d}.{ext}").write_bytes(bytes([i]) * size)
    (folder / "zz.lnk").symlink_to("part0/s000.jpg")
    with open(folder / "zz.bin", "wb") as f:
        f.seek(1 << 20)
        f.write(b"end")
    for fmt in ("gnu", "oldgnu", "posix", "ustar"):
        out = tmp_path / f"{fmt}.tar"
        subprocess.run(
            ["tar", "--format", fmt, "--sort=name", "-cf", str(out), "-C", str(folder), "."],
            check=True,
            capture_output=True,
        )
        samples, err, warned = _check(tmp_path, out.read_bytes(), name=f"{fmt}-copy.tar")
        assert err is None and len(samples) == 13 and len(warned) == 1
        got, done, _ = scan_alone(out)
        assert len(got) == 12 and not done  # the "zz" sample (a link in it) is the reader's


def test_what_the_scan_declines_the_reference_reads_from_that_sample(tmp_path):
    """A repeated extension (the error), a lone zero block (a warning, read on), a member of
    type NUL, a bad checksum, the end of the file without the marker, a cut inside a large
    member, a member longer than the file, bytes after the marker: the same samples, errors
    and warnings as the reference; the samples before the trouble come from the scan."""
    members = _samples(10)
    whole = _tar(members)
    body = _tar(members, end=False)
    first = _tar(members[:15], end=False)  # the first five samples
    rest = _tar(members[15:], end=False)
    dup = _tar([*members[:15], ("s0004.jpg", b"again"), *members[15:]])

    def retype(raw: bytes, at: int, flag: bytes) -> bytes:
        h = bytearray(raw[at : at + 512])
        h[156:157] = flag
        h[148:156] = b" " * 8
        h[148:155] = b"%06o\0" % sum(h)
        return raw[:at] + bytes(h) + raw[at + 512 :]

    bad = bytearray(whole)
    bad[len(first) + 5] ^= 0x55  # a header's name: its checksum fails
    cases = {
        "repeated extension": dup,
        "lone zero block": first + bytes(512) + rest + bytes(1024),
        "type NUL": retype(whole, len(first), b"\0"),
        "bad checksum": bytes(bad),
        "no end marker": body,
        "one zero block at the end": body + bytes(512),
        "a zero block and half": body + bytes(768),
        "cut in a large member": whole[: len(first) + 200_000],
        "cut in a header": whole[: len(first) + 300],
        "after the marker": whole + b"garbage" * 100,
        "empty archive": bytes(1024),
    }
    outcomes = {}
    for label, raw in cases.items():
        samples, err, warned = _check(tmp_path, raw)
        outcomes[label] = (len(samples), err and err[0], len(warned))
    assert outcomes["repeated extension"][1] == "DuplicateFieldError"
    assert outcomes["lone zero block"] == (10, None, 1)
    assert outcomes["cut in a large member"][1] == "TruncatedShardError"
    assert outcomes["after the marker"] == (10, None, 0)
    assert outcomes["empty archive"] == (0, None, 0)
    # the scan handed out the samples before the trouble itself
    (tmp_path / "d.tar").write_bytes(dup)
    got, done, resume = scan_alone(tmp_path / "d.tar")
    assert (
        not done
        and len(got) == 4
        and resume
        == got[-1]["__offset__"] + 3 * 512 + sum(-(-len(d) // 512) * 512 for _, d in members[9:12])
    )


def test_a_scan_from_an_offset_counts_offsets_from_the_stream(tmp_path):
    """``start`` (a header) and ``delta`` (the stream offset of file offset 0): offsets are the
    stream's; ``shard_samples`` goes on from the resume point with the same offsets."""
    members = _samples(6)
    raw = _tar(members)
    path = tmp_path / "t.tar"
    path.write_bytes(raw)
    everything, done, _ = scan_alone(path)
    assert done
    second = everything[1]["__offset__"]
    tail, done, _ = scan_alone(path, start=second, delta=-second)
    assert done
    assert [s["__offset__"] + second for s in tail] == [s["__offset__"] for s in everything[1:]]
    assert [s["__key__"] for s in tail] == [s["__key__"] for s in everything[1:]]


def test_shard_samples_uses_the_scan_for_copies_only(tmp_path, monkeypatch):
    raw = _tar(_samples(4))
    path = tmp_path / "t.tar"
    path.write_bytes(raw)
    made = []
    real = reading.local_samples
    monkeypatch.setattr(reading, "local_samples", lambda *a: made.append(1) or real(*a))
    assert len(list(shard_samples(str(path)))) == 4 and made == [1]
    views = list(shard_samples(str(path), copy=False))
    assert len(views) == 4 and made == [1]
    assert all(isinstance(s["jpg"], memoryview) for s in views)


@st.composite
def archives(draw):
    """Samples of varied sizes (around the scan's thresholds), written in one format, then
    perhaps damaged: cut, or one byte changed."""
    n = draw(st.integers(0, 12))
    sizes = st.sampled_from(SIZES[:-1]) | st.integers(0, 40_000)
    members = []
    for i in range(n):
        exts = draw(
            st.lists(st.sampled_from(["jpg", "cls", "txt", "JSON"]), min_size=1, max_size=3)
        )
        if draw(st.booleans()) and exts:  # sometimes a repeated extension
            exts = exts + exts[:1] if draw(st.integers(0, 9)) == 0 else exts
        for ext in exts:
            members.append((f"k{i:03d}.{ext}", bytes([i % 251]) * draw(sizes)))
        if draw(st.integers(0, 7)) == 0:
            members.append(("__skip__", b"s" * draw(sizes)))
        if draw(st.integers(0, 7)) == 0:
            members.append((f"dir{i}/", None))
    fmt = draw(st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]))
    raw = _tar(members, fmt, mtime=1.25) if fmt == tarfile.PAX_FORMAT else _tar(members, fmt)
    damage = draw(st.sampled_from(["none", "none", "cut", "flip"]))
    if damage == "cut" and raw:
        raw = raw[: draw(st.integers(0, len(raw)))]
    elif damage == "flip" and raw:
        at = draw(st.integers(0, len(raw) - 1))
        raw = raw[:at] + bytes([raw[at] ^ draw(st.integers(1, 255))]) + raw[at + 1 :]
    return raw


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=archives(), last_dot=st.booleans())
def test_the_scan_reads_what_the_reference_reads(tmp_path_factory, raw, last_dot):
    tmp = tmp_path_factory.mktemp("scan")
    if not raw:
        return  # an empty file is no DirectFile (the reference path reads it)
    _check(tmp, raw, last_dot)


def _offsets(path, last_dot: bool, scan: bool) -> tuple:
    """``scan_shards``' sample offsets of one shard (or its error), with or without the scan."""
    from tarshards.plan import epoch

    real = reading._SampleScan
    if not scan:
        reading._SampleScan = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TarshardsWarning)
            table = epoch.scan_shards([str(path)], opener=open_file, last_dot=last_dot)
        return table.offsets[0].tolist(), None
    except TarshardsError as exc:
        return None, (type(exc).__name__, str(exc), exc.member, exc.offset)
    finally:
        reading._SampleScan = real


def open_file(url):
    return open(url, "rb")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=archives(), last_dot=st.booleans())
def test_offsets_from_headers_alone_equal_the_reference(tmp_path_factory, raw, last_dot):
    """A planned pipeline without a manifest scans its shards for their sample offsets: the
    scan reads a local plain shard's headers alone (its data skipped), the reference reader the
    rest from the first sample it declines: the same offsets, and the same errors."""
    if not raw:
        return
    path = tmp_path_factory.mktemp("offsets") / "t.tar"
    path.write_bytes(raw)
    assert _offsets(path, last_dot, True) == _offsets(path, last_dot, False)


def test_a_scan_without_data_reads_only_headers(tmp_path):
    """``data=False``: the fields are None and the large members' data is never read (the
    bytes read are a small part of the shard)."""
    members = [
        (f"s{i:03d}.{e}", bytes([i]) * n)
        for i in range(40)
        for e, n in (("jpg", 200_000), ("cls", 3))
    ]
    path = tmp_path / "t.tar"
    path.write_bytes(_tar(members))
    size = path.stat().st_size
    before = _bytes_read()
    with open(path, "rb") as f:
        scan = SampleScan(f.fileno(), 0, size, str(path), False, 0, 1 << 18, False)
        got = list(scan)
    after = _bytes_read()
    assert scan.done and len(got) == 40
    if before is not None and after is not None:
        assert after - before < size // 10  # headers (8 KiB reads), not 8 MB of data
    assert all(s["jpg"] is None and s["cls"] is None for s in got)
    full, _, _ = scan_alone(path)
    assert [s["__offset__"] for s in got] == [s["__offset__"] for s in full]


def _bytes_read() -> int | None:
    """This process's bytes read by read() and pread() so far (Linux), else None."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(": ") for line in f.read().splitlines())
        return int(fields["rchar"])
    except (OSError, KeyError, ValueError):
        return None
