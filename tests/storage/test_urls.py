"""Shard specs, opening URLs, atomic outputs, and the resuming reader (in-memory streams)."""

from __future__ import annotations

import io
import logging
import os

import pytest

from tarshards.errors import PipeNotAllowedError, StorageError
from tarshards.read.specs import expand_urls
from tarshards.storage import AtomicOutput, ResumingReader, open_url, url_protocol

DATA = bytes(range(256)) * 400  # 102400 bytes


class _Flaky:
    """Serves DATA from an offset; the first streams fail after a few bytes."""

    def __init__(self, fail_after=(), exc=ConnectionResetError, short=False, size=None):
        self.fail_after = list(fail_after)
        self.exc = exc
        self.short = short  # end quietly (a short read) instead of raising
        self.size = len(DATA) if size is None else size
        self.opens = []

    def __call__(self, offset):
        self.opens.append(offset)
        limit = self.fail_after.pop(0) if self.fail_after else None
        return _Stream(DATA, offset, limit, self.exc, self.short), self.size


class _Stream:
    def __init__(self, data, offset, limit, exc, short):
        self.data, self.pos, self.exc, self.short = data, offset, exc, short
        self.end = len(data) if limit is None else min(len(data), offset + limit)
        self.closed = False

    def read(self, n):
        if self.pos >= self.end and self.end < len(self.data):
            if self.short:
                return b""
            raise self.exc("connection dropped")
        out = self.data[self.pos : min(self.end, self.pos + n)]
        self.pos += len(out)
        return out

    def close(self):
        self.closed = True


def _read_all(r, n=7000):
    parts = []
    while True:
        b = r.read(n)
        if not b:
            return b"".join(parts)
        parts.append(b)


def test_resumes_at_offset_and_logs(caplog):
    src = _Flaky(fail_after=[10_000, 25_000, 1])
    with caplog.at_level(logging.WARNING, logger="tarshards.storage.retry"):
        with ResumingReader("http://x/a.tar", src, retries=3, backoff=0) as r:
            assert _read_all(r) == DATA
            assert r.resumes == 3
    assert src.opens == [0, 10_000, 35_000, 35_001]  # each reconnection at the offset reached
    msgs = [rec.getMessage() for rec in caplog.records if rec.name == "tarshards.storage.retry"]
    assert len(msgs) == 3 and all("http://x/a.tar" in m and "resuming" in m for m in msgs)
    assert "offset 10000" in msgs[0] and "offset 35001" in msgs[2]


def test_short_read_before_known_size_resumes():
    src = _Flaky(fail_after=[5000, 5000], short=True)
    with ResumingReader("s3://b/a.tar", src, retries=2, backoff=0) as r:
        assert _read_all(r, 4096) == DATA
    assert len(src.opens) == 3


def test_retries_exhausted_raise_storage_error_with_offset():
    src = _Flaky(fail_after=[3000, 0, 0, 0, 0])
    r = ResumingReader("gs://b/a.tar", src, retries=2, backoff=0)
    with pytest.raises(StorageError) as info:
        _read_all(r, 1000)
    assert info.value.url == "gs://b/a.tar"
    assert info.value.offset == 3000
    assert "offset 3000" in str(info.value) and "gs://b/a.tar" in str(info.value)
    assert isinstance(info.value, OSError)


def test_progress_resets_the_retry_count():
    src = _Flaky(fail_after=[20_000] * 5)  # five drops, each after progress
    with ResumingReader("u", src, retries=1, backoff=0) as r:
        assert _read_all(r) == DATA


def test_fatal_errors_are_not_retried():
    def open_at(offset):
        raise FileNotFoundError("gone")

    with pytest.raises(StorageError, match="gone"):
        ResumingReader("s3://b/x.tar", open_at, retries=5, backoff=10)


def test_object_changing_size_is_an_error():
    sizes = [len(DATA), len(DATA) + 1]

    def open_at(offset):
        return _Stream(
            DATA, offset, 100 if offset == 0 else None, ConnectionError, False
        ), sizes.pop(0)

    r = ResumingReader("u", open_at, retries=3, backoff=0)
    with pytest.raises(StorageError, match="changed size"):
        _read_all(r)


def test_negative_retries_rejected():
    with pytest.raises(ValueError):
        ResumingReader("u", _Flaky(), retries=-1)


def test_backoff_is_bounded(monkeypatch):
    import tarshards.storage.retry as retry

    slept = []
    monkeypatch.setattr(retry.time, "sleep", slept.append)
    src = _Flaky(fail_after=[0] * 6)
    with ResumingReader("u", src, retries=6, backoff=0.5, max_backoff=2.0) as r:
        assert _read_all(r) == DATA
    assert slept == [0.5, 1.0, 2.0, 2.0, 2.0, 2.0]


# ---- open_url / local files ----------------------------------------------------------------


def test_open_local_and_file_urls(tmp_path):
    p = tmp_path / "a.bin"
    p.write_bytes(b"hello")
    for url in (str(p), f"file://{p}", f"file:{p}"):
        with open_url(url) as f:
            assert f.read() == b"hello"
    with pytest.raises(StorageError, match="no such shard"):
        with open_url(str(tmp_path / "missing.tar")):
            pass


def test_a_missing_shard_is_a_file_not_found_error(tmp_path):
    from tarshards.errors import ShardNotFoundError

    for url in (str(tmp_path / "missing.tar"), f"file://{tmp_path}/missing.tar"):
        with pytest.raises(ShardNotFoundError) as info:
            with open_url(url):
                pass
        assert isinstance(info.value, FileNotFoundError) and info.value.url == url

    def gone(offset):
        raise FileNotFoundError("gone")

    with pytest.raises(ShardNotFoundError, match="gone"):  # at open, and not retried
        ResumingReader("s3://b/x.tar", gone, retries=5, backoff=10)
    with ResumingReader("u", _Flaky(exc=FileNotFoundError, fail_after=[0]), backoff=10) as r:
        with pytest.raises(ShardNotFoundError, match="dropped"):  # or while reading
            r.read(10)


def test_pipe_needs_permission():
    with pytest.raises(PipeNotAllowedError):
        with open_url("pipe:echo hi"):
            pass
    with open_url("pipe:printf hi", allow_pipe=True) as f:
        assert f.read() == b"hi"


def test_unknown_protocol_is_a_storage_error():
    with pytest.raises(StorageError):
        with open_url("nosuchproto://x/y.tar"):
            pass


def test_url_protocol():
    assert url_protocol("s3://b/k") == "s3"
    assert url_protocol("HTTP://h/x") == "http"
    assert url_protocol("/a/b.tar") is None
    assert url_protocol("file:///a") is None
    assert url_protocol("pipe:cat x") == "pipe"
    assert url_protocol("-") == "-"


def test_expand_urls_braces_lists_and_files(tmp_path):
    assert expand_urls("s3://b/a-{0..2}.tar") == [f"s3://b/a-{i}.tar" for i in range(3)]
    assert expand_urls("a-{00..01}.tar::b.tar") == ["a-00.tar", "a-01.tar", "b.tar"]
    assert expand_urls(["x.tar", "y-{1..2}.tar"]) == ["x.tar", "y-1.tar", "y-2.tar"]
    listing = tmp_path / "list.txt"
    listing.write_text("# shards\nhttp://h/a.tar\n\nhttp://h/b-{0..1}.tar\n")
    want = ["http://h/a.tar", "http://h/b-0.tar", "http://h/b-1.tar"]
    assert expand_urls(str(listing)) == want
    assert expand_urls("@" + str(listing)) == want
    (tmp_path / "s-1.tar").write_bytes(b"")
    (tmp_path / "s-0.tar").write_bytes(b"")
    assert expand_urls(str(tmp_path / "s-*.tar")) == [
        str(tmp_path / f"s-{i}.tar") for i in range(2)
    ]
    with pytest.raises(FileNotFoundError):
        expand_urls(str(tmp_path / "none-*.tar"))
    with pytest.raises(TypeError):
        expand_urls(3)
    with pytest.raises(ValueError):
        expand_urls(None)


# ---- AtomicOutput ----------------------------------------------------------------------------


def test_atomic_output_local_commit_and_abort(tmp_path):
    dest = tmp_path / "sub" / "out.tar"
    with AtomicOutput(str(dest)) as out:
        out.stream.write(b"data")
        assert not dest.exists()
    assert dest.read_bytes() == b"data"
    with pytest.raises(RuntimeError):
        with AtomicOutput(str(tmp_path / "bad.tar")) as out:
            out.stream.write(b"partial")
            raise RuntimeError("boom")
    assert sorted(os.listdir(tmp_path)) == ["sub"]
    assert os.listdir(tmp_path / "sub") == ["out.tar"]


def test_atomic_output_remote_via_fsspec_memory():
    import fsspec

    fs = fsspec.filesystem("memory")
    with AtomicOutput("memory://bucket/x.tar") as out:
        out.stream.write(b"abc")
        assert not fs.exists("/bucket/x.tar")
    assert fs.cat("/bucket/x.tar") == b"abc"
    with pytest.raises(RuntimeError):
        with AtomicOutput("memory://bucket/y.tar") as out:
            out.stream.write(b"abc")
            raise RuntimeError("boom")
    assert not fs.exists("/bucket/y.tar")


def test_atomic_output_file_object():
    buf = io.BytesIO()
    with AtomicOutput(buf) as out:
        out.stream.write(b"xyz")
    assert buf.getvalue() == b"xyz"


def test_memory_fs_read_goes_through_resuming_reader():
    import fsspec

    fsspec.filesystem("memory").pipe("/bucket/r.bin", DATA)
    with open_url("memory://bucket/r.bin", block_size=4096) as f:
        assert isinstance(f, ResumingReader)
        assert f.size == len(DATA)
        assert _read_all(f, 10_000) == DATA


# ---- reading at an offset, for a length ------------------------------------------------------

RANGES = [(0, None), (1000, None), (12_345, 100), (0, 10), (len(DATA) - 7, 7), (len(DATA) - 7, 99)]


@pytest.mark.parametrize("offset, length", RANGES)
def test_open_local_file_at_offset(tmp_path, offset, length):
    p = tmp_path / "a.bin"
    p.write_bytes(DATA)
    want = DATA[offset:] if length is None else DATA[offset : offset + length]
    for url in (str(p), f"file://{p}"):
        with open_url(url, offset=offset, length=length) as f:
            assert _read_all(f, 333) == want
        with open_url(url, offset=offset, length=length) as f:
            assert f.read() == want


@pytest.mark.parametrize("offset, length", RANGES)
def test_open_memory_fs_at_offset(offset, length):
    import fsspec

    fsspec.filesystem("memory").pipe("/bucket/ranges.bin", DATA)
    want = DATA[offset:] if length is None else DATA[offset : offset + length]
    with open_url("memory://bucket/ranges.bin", offset=offset, length=length) as f:
        assert isinstance(f, ResumingReader) and f.tell() == offset
        assert _read_all(f, 4096) == want
        assert f.tell() == offset + len(want)


def test_pipe_and_stdin_skip_to_the_offset():
    with open_url("pipe:printf 0123456789", allow_pipe=True, offset=3, length=4) as f:
        assert f.read() == b"3456"
    with pytest.raises(StorageError, match="ended"):
        with open_url("pipe:printf 0123", allow_pipe=True, offset=10) as f:
            pass


def test_zero_length_reads_nothing_and_bad_ranges_are_refused(tmp_path):
    import fsspec

    fsspec.filesystem("memory").pipe("/bucket/z.bin", DATA)
    with open_url("memory://bucket/z.bin", offset=5, length=0) as f:
        assert f.read() == b""
    for bad in ({"offset": -1}, {"length": -1}):
        with pytest.raises(ValueError):
            with open_url("memory://bucket/z.bin", **bad):
                pass
    with pytest.raises(ValueError, match="reading"):
        with open_url(str(tmp_path / "out.bin"), "wb", offset=3):
            pass


def test_read_options_give_the_reading_keywords(tmp_path):
    from tarshards.types import ReadOptions

    with open_url("pipe:printf ok", options=ReadOptions(allow_pipe=True)) as f:
        assert f.read() == b"ok"
    with pytest.raises(PipeNotAllowedError):
        with open_url("pipe:printf ok", options=ReadOptions()):
            pass
    with pytest.raises(TypeError, match="either"):
        with open_url("pipe:printf ok", options=ReadOptions(), allow_pipe=True):
            pass


def test_resuming_reader_inside_a_range():
    """A range [start, stop) resumes inside itself and ends at stop, not at the object's end."""
    src = _Flaky(fail_after=[1000, 1])
    with ResumingReader("u", src, retries=3, backoff=0, start=5000, stop=9000) as r:
        assert _read_all(r, 700) == DATA[5000:9000]
        assert r.read(10) == b""
    assert src.opens == [5000, 6000, 6001]
    short = _Flaky(fail_after=[100, 100], short=True)  # the stream ends early: resumed too
    with ResumingReader("u", short, retries=3, backoff=0, start=10, stop=500) as r:
        assert _read_all(r) == DATA[10:500]
    with pytest.raises(ValueError):
        ResumingReader("u", _Flaky(), start=10, stop=5)
