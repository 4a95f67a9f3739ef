"""The optional C accelerator agrees with the pure Python reference, on good and bad input."""

from __future__ import annotations

import io
import random
import tarfile

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_tario import FORMATS, archive_entries, build_tarfile

from tarshards import tario
from tarshards.errors import DuplicateFieldError, ShardFormatError
from tarshards.format import names as fmt_mod
from tarshards.format.names import group_samples
from tarshards.plan import cursor as source_mod
from tarshards.plan.cursor import ShuffleCore
from tarshards.tario import decompressed_chunks, iter_tar_batches, read_chunks

pytestmark = pytest.mark.skipif(
    tario._scan_members is None or fmt_mod._group_members is None,
    reason="the C accelerator is not built",
)


def read(data: bytes, chunk_size: int, accelerate: bool, last_dot: bool = False):
    """Samples (and the error, if any) read with or without the accelerator."""
    out = []
    batches = iter_tar_batches(
        decompressed_chunks(read_chunks(io.BytesIO(data), chunk_size)), "mem", accelerate=accelerate
    )
    try:
        for s in group_samples(
            batches, "mem", batched=True, accelerate=accelerate, last_dot=last_dot
        ):
            out.append(s)
    except (ShardFormatError, DuplicateFieldError) as exc:
        return out, (type(exc), str(exc), exc.offset, exc.member)
    return out, None


def members(data: bytes, chunk_size: int, accelerate: bool):
    out = []
    try:
        for batch in iter_tar_batches(
            read_chunks(io.BytesIO(data), chunk_size), "mem", accelerate=accelerate
        ):
            out.extend(batch)
    except ShardFormatError as exc:
        return out, (str(exc), exc.offset)
    return out, None


# (the archives hold links, which the reader skips with a warning tested on its own)
@pytest.mark.filterwarnings("ignore:.* links to .* is skipped:tarshards.errors.TarshardsWarning")
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    entries=archive_entries(),
    fmt=st.sampled_from(sorted(FORMATS)),
    chunk_size=st.sampled_from([1, 100, 512, 4096, 1 << 20]),
    last_dot=st.booleans(),
)
def test_same_samples_as_python(entries, fmt, chunk_size, last_dot):
    try:
        data = build_tarfile(entries, FORMATS[fmt])
    except ValueError:
        assume(False)
    assert read(data, chunk_size, True, last_dot) == read(data, chunk_size, False, last_dot)
    assert members(data, chunk_size, True) == members(data, chunk_size, False)


def _tar(names_and_data):
    return _tarfile_bytes(names_and_data, tarfile.USTAR_FORMAT)


_names = st.lists(
    st.tuples(
        st.sampled_from(["a", "./a", "d/a", "b", "__meta__", "d/__x", "noext", "A", "é"]),
        st.sampled_from(["", ".jpg", ".JPG", ".seg.png", ".cls", ".", ".Ä"]),
    ),
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(_names, st.booleans())
def test_key_rules_and_duplicates_match(names, last_dot):
    data = _tar([(k + e, f"{k}{e}".encode()) for k, e in names])
    assert read(data, 1 << 20, True, last_dot) == read(data, 1 << 20, False, last_dot)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.integers(0, 13), st.booleans()), min_size=1, max_size=60
    ),
    st.booleans(),
)
def test_grouping_with_more_extensions_than_it_keeps(picks, last_dot):
    """The C grouping keeps the last eight lower-case extensions it saw (their str made once):
    fourteen in turn, some in capitals, some non-ASCII, group as the Python loop does."""
    exts = ["jpg", "png", "cls", "json", "txt", "seg.png", "a", "b", "c", "d", "e", "f", "gé", "h"]
    names = []
    for key, ext, upper in picks:
        e = exts[ext].upper() if upper else exts[ext]
        names.append((f"d/k{key}.{e}", f"{key}{e}".encode()))
    data = _tar(names)
    assert read(data, 1 << 20, True, last_dot) == read(data, 1 << 20, False, last_dot)


@settings(max_examples=60, deadline=None)
@given(pos=st.integers(0, 511), flip=st.integers(1, 255), which=st.integers(0, 2))
def test_corrupted_headers_give_the_same_error(pos, flip, which):
    data = bytearray(_tar([("x.cls", b"1"), ("x.jpg", b"2" * 600), ("y.cls", b"3")]))
    offsets = [0, 1024, 1024 + 512 + 1024]
    data[offsets[which] + pos] ^= flip
    assert read(bytes(data), 1 << 20, True) == read(bytes(data), 1 << 20, False)


_member = st.tuples(
    st.one_of(
        st.from_regex(r"[a-z0-9_/]{1,120}\.[a-z]{1,4}", fullmatch=True),
        st.text(min_size=1, max_size=30)
        .filter(lambda t: "\0" not in t)  # EncodeError
        .map(lambda t: t + ".txt"),
    ),
    st.one_of(st.binary(max_size=1500), st.binary(max_size=20).map(bytearray)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_member, max_size=8), st.integers(0, 2**33 - 1), st.sampled_from([0o444, 0o644]))
def test_writer_bytes_identical_to_python(members, mtime, mode):
    out = []
    for accelerate in (True, False):
        buf = io.BytesIO()
        w = tario.TarMemberWriter(buf, mtime=mtime, mode=mode)
        n = w.add_all(members, accelerate=accelerate)
        assert n == len(buf.getvalue())
        out.append(buf.getvalue())
    assert out[0] == out[1]


class _Sized:
    """A value of a given length (members of 8 GiB and more, without the bytes)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.one_of(
                _member.map(lambda m: m[0]),
                st.text(min_size=1, max_size=120).filter(lambda t: "\0" not in t),
            ),
            st.one_of(
                st.binary(max_size=1500),
                st.sampled_from([8**11 - 1, 8**11, 8**11 + 511]).map(_Sized),
            ),
        ),
        max_size=8,
    )
)
def test_members_size_equals_python_and_the_bytes_written(members):
    from tarshards import _speedups
    from tarshards.write import writer as writer_mod

    want = writer_mod._members_size_py(members)
    assert _speedups.members_size(members, tario.header_size) == want
    if all(isinstance(d, bytes) for _, d in members):
        buf = io.BytesIO()
        assert tario.TarMemberWriter(buf).add_all(members) == want == len(buf.getvalue())


def test_members_size_refuses_what_is_not_a_member():
    from tarshards import _speedups
    from tarshards.errors import EncodeError

    with pytest.raises(EncodeError, match="NUL"):  # header_size's error, as the writer's
        _speedups.members_size([("a\0b.txt", b"x")], tario.header_size)

    with pytest.raises(TypeError):
        _speedups.members_size([("a.txt", b"x", 1)], tario.header_size)
    with pytest.raises(TypeError):
        _speedups.members_size([(b"a.txt", b"x")], tario.header_size)
    with pytest.raises(TypeError):
        _speedups.members_size([("a.txt", 3)], tario.header_size)


def _header(name: str, size_field: bytes, delta: int = 0, high: bool = False) -> bytes:
    hdr = bytearray(tarfile.TarInfo(name).tobuf(tarfile.USTAR_FORMAT))
    hdr[124:136] = size_field
    if high:  # fields the C loop does not read, set to 0xFF: a byte sum above 65521
        hdr[100:124] = b"\xff" * 24
        hdr[136:148] = b"\xff" * 12
        hdr[157:257] = b"\xff" * 100
        hdr[265:345] = b"\xff" * 80
        hdr[len(name) : 100] = b"\xff" * (100 - len(name))
    hdr[148:156] = b" " * 8
    hdr[148:156] = b"%06o\0 " % (sum(hdr) + delta)
    return bytes(hdr)


@pytest.mark.parametrize("delta", [65521, -65521, 131042, 1])
def test_c_scan_stops_at_a_checksum_off_by_65521(delta):
    """The C loop hands a wrong checksum to Python (which raises), whatever the difference."""
    good = _header("a.txt", b"%011o\0" % 1) + b"1" + bytes(511)
    bad = _header("b.txt", b"%011o\0" % 1, delta, high=delta < 0) + b"2" + bytes(511)
    assert 0 <= int(bad[148:154], 8) < 8**6
    buf = good + bad + bytes(1024)
    members, pos = tario._scan_members(buf, 0, 0, len(buf))
    assert [m[0] for m in members] == ["a.txt"] and pos == 1024
    for accelerate in (True, False):
        got, err = members_of(buf, accelerate)
        assert [m[0] for m in got] == ["a.txt"] and err is not None and "checksum" in err[0]


@pytest.mark.parametrize("size_field", [b"77777777777\0", b"\x80" + (1 << 40).to_bytes(11, "big")])
def test_c_scan_stops_at_a_size_beyond_the_buffer(size_field):
    buf = _header("huge.bin", size_field) + bytes(4096)
    members, pos = tario._scan_members(buf, 0, 0, len(buf))
    assert members == [] and pos == 0
    for accelerate in (True, False):
        got, err = members_of(buf, accelerate)
        assert got == [] and "huge.bin" in err[0] and "truncated" in err[0]


def members_of(data: bytes, accelerate: bool):
    return members(data, 1 << 20, accelerate)


def test_c_scan_reads_a_header_whose_byte_sum_is_above_65521():
    hdr = _header("c.txt", b"%011o\0" % 2, 0, high=True)
    assert int(hdr[148:154], 8) > 65521
    buf = hdr + b"cc" + bytes(510) + bytes(1024)
    members, pos = tario._scan_members(buf, 0, 0, len(buf))
    assert len(members) == 1 and members[0][1:] == (b"cc", 0) and pos == 1024
    assert members_of(buf, True) == members_of(buf, False) == (members, None)


# ---- members behind pax headers (Python's tarfile and webdataset put one before every member) --


def _tarfile_bytes(members, fmt, mtime=0, **records) -> bytes:
    """An archive of ``members`` (name, data) as tarfile writes it in format ``fmt``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            ti.mtime = mtime
            ti.pax_headers = dict(records)
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def _pax_tar(members, **records) -> bytes:
    """A PAX archive as tarfile writes files added from disk: a float mtime on every member (so a
    pax header before each), extra records given as keyword arguments."""
    return _tarfile_bytes(members, tarfile.PAX_FORMAT, 1699848965.4376638, **records)


_PAX_MEMBERS = [
    ("s0.jpg", b"j" * 700),
    ("s0.cls", b"3"),
    ("d/" + "long" * 40 + ".txt", b"a long name: a path record"),
    ("é/ü.json", b"{}"),
    ("s1.cls", b""),
]


@pytest.mark.parametrize("records", [{}, {"comment": "x", "SCHILY.xattr.user.k": "v"}])
def test_c_scan_reads_members_behind_harmless_pax_headers(records):
    data = _pax_tar(_PAX_MEMBERS, **records)
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        want = [(ti.name, tf.extractfile(ti).read(), ti.offset) for ti in tf]
        where = [(ti.offset, ti.offset_data, ti.size, False) for ti in tf]
    assert all(data[o + 156] == ord("x") for _, _, o in want)  # each member behind a pax header
    layout: list = []
    got, pos = tario._scan_members(data, 0, 0, len(data), len(data), None, True, layout)
    assert got == want and data[pos : pos + 1024] == bytes(1024)
    assert layout == where  # where each member's data lies, for the indexer
    assert tario._scan_members(data, 0, 0, len(data), len(data), None, False) == ([], 0)
    assert members_of(data, True) == members_of(data, False) == (want, None)
    assert read(data, 1 << 20, True) == read(data, 1 << 20, False)


def test_c_scan_reads_members_behind_gnu_long_names():
    data = _tarfile_bytes(_PAX_MEMBERS, tarfile.GNU_FORMAT)
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        want = [(ti.name, tf.extractfile(ti).read(), ti.offset) for ti in tf]
        where = [(ti.offset, ti.offset_data, ti.size, False) for ti in tf if len(ti.name) > 99]
    assert where  # one member behind a long-name header
    layout: list = []
    got, _ = tario._scan_members(data, 0, 0, len(data), len(data), None, True, layout)
    assert got == want and layout == where
    assert members_of(data, True) == members_of(data, False) == (want, None)


def _pax_header(payload: bytes) -> bytes:
    ti = tarfile.TarInfo("././@PaxHeader")
    ti.type = tarfile.XHDTYPE
    ti.size = len(payload)
    return ti.tobuf(tarfile.USTAR_FORMAT) + payload + bytes(-len(payload) % 512)


@pytest.mark.parametrize(
    "payload",
    [
        b"12 size=700\n",  # changes the data's size
        b"22 GNU.sparse.major=1\n",  # a sparse member
        b"9 path=\n",  # an empty path: the header's name wins
        b"11 path=d/\n",  # a path ending in '/'
        b"15 path=x.jpg\n",  # a length beyond the record
        b"10 pathx.jpg\n",  # no '='
        b"x9 path=a\n",  # not a length
        b"13 path=x.jpg",  # no newline
    ],
)
def test_c_scan_hands_other_pax_headers_to_python(payload):
    """What the C loop does not read exactly as the Python path does, it leaves to it: the
    Python path reads the member (or raises) and both paths agree."""
    member = tarfile.TarInfo("s0.jpg")
    member.size = 700
    data = _pax_header(payload) + member.tobuf(tarfile.USTAR_FORMAT) + b"j" * 700 + bytes(324)
    data += bytes(1024)
    assert tario._scan_members(data, 0, 0, len(data), len(data), None, True) == ([], 0)
    assert members_of(data, True) == members_of(data, False)
    assert read(data, 1 << 20, True) == read(data, 1 << 20, False)


# (a mutation can leave a lone zero block before more headers: the reader warns and reads on,
# a warning tested on its own)
@pytest.mark.filterwarnings("ignore:a lone zero block:tarshards.errors.TarshardsWarning")
@settings(max_examples=200, deadline=None)
@given(
    edits=st.lists(
        st.tuples(st.integers(0, 10**6), st.sampled_from(list(b" =\n0123456789/\0xa\xff"))),
        min_size=1,
        max_size=3,
    ),
    in_pax=st.booleans(),
    chunk_size=st.sampled_from([512, 700, 1 << 20]),
    gnu=st.booleans(),
)
def test_mutated_pax_headers_read_alike(edits, in_pax, chunk_size, gnu):
    """Bytes of the pax or GNU long-name headers (their blocks and payloads) or anywhere
    changed: the C scan and the Python path give the same members, or the same error."""
    if gnu:
        long = [(name + "_" * 100, value) for name, value in _PAX_MEMBERS]
        data = bytearray(_tarfile_bytes(long, tarfile.GNU_FORMAT))
    else:
        data = bytearray(_pax_tar(_PAX_MEMBERS, comment="hello world"))
    pax_blocks = [o for o in range(0, len(data) - 512, 512) if data[o + 156] in b"xL"]
    for where, value in edits:
        if in_pax:
            o = pax_blocks[where % len(pax_blocks)]
            pos = o + (where // 7) % 612  # the header block or the first 100 bytes of records
        else:
            pos = where % len(data)
        data[pos] = value
    mutated = bytes(data)
    assert members(mutated, chunk_size, True) == members(mutated, chunk_size, False)
    assert read(mutated, chunk_size, True) == read(mutated, chunk_size, False)


# ---- the shuffle buffer's C loop (source.ShuffleCore.run, prefetch=True) ---------------------

_c_shuffle = pytest.mark.skipif(source_mod._ShuffleRun is None, reason="no C shuffle loop")


def _shuffled(bufsize, initial, n, seed, prefetch, start=0):
    """The outputs of a core over ``range(n)`` from output ``start`` on (replayed to there)."""
    core = ShuffleCore(bufsize, initial, random.Random(seed))
    if start:
        core.replay(n, start)
    out = list(core.run(iter(range(core.consumed, n)), prefetch=prefetch))
    return out, core


@_c_shuffle
@settings(max_examples=300, deadline=None)
@given(
    bufsize=st.integers(1, 300),
    initial=st.one_of(st.none(), st.integers(1, 400)),
    n=st.integers(0, 700),
    seed=st.integers(0, 2**40),
    at=st.floats(0, 1),
)
def test_c_shuffle_loop_equals_python(bufsize, initial, n, seed, at):
    """The same outputs from the same draws, from the start and from a replayed position; the
    generator ends in the same state (the last shuffle drew after every pick, as in Python)."""
    start = int(at * n)
    ref, ref_core = _shuffled(bufsize, initial, n, seed, False, start)
    got, core = _shuffled(bufsize, initial, n, seed, True, start)
    assert got == ref
    assert core.emitted == ref_core.emitted == n
    assert core.rng.getstate() == ref_core.rng.getstate()


@_c_shuffle
def test_c_shuffle_loop_counts_outputs_as_handed_on():
    core = ShuffleCore(100, None, random.Random(3))
    run = core.run(iter(range(1000)), prefetch=True)
    ref = ShuffleCore(100, None, random.Random(3))._run(iter(range(1000)))
    for k in range(1, 250):
        assert next(run) == next(ref)
        assert core.emitted == k  # what a stateful stage saves: outputs handed on
    run.close()
    assert next(run, None) is None and core.emitted == 249
    with pytest.raises(RuntimeError, match="already runs"):
        core.run(iter(()), prefetch=True)


@_c_shuffle
def test_c_shuffle_loop_passes_input_errors_on():
    def failing():
        yield from range(50)
        raise ValueError("shard broke")

    run = ShuffleCore(10, None, random.Random(0)).run(failing(), prefetch=True)
    got = []
    with pytest.raises(ValueError, match="shard broke"):
        for x in run:
            got.append(x)
    assert len(set(got)) == len(got) and set(got) <= set(range(50))
    assert next(run, None) is None  # finished, like a generator that raised


@_c_shuffle
def test_c_shuffle_loop_holds_samples_of_any_type():
    samples = [{"__key__": str(i), "x": bytes(600 * (i % 3)), "y": [i]} for i in range(300)]
    samples += [(i, "t") for i in range(50)] + [[i] for i in range(50)] + list(range(50))
    ref = list(ShuffleCore(64, 8, random.Random(1))._run(iter(samples)))
    got = list(ShuffleCore(64, 8, random.Random(1)).run(iter(samples), prefetch=True))
    assert [id(x) for x in got] == [id(x) for x in ref]


def test_shuffle_of_another_generator_runs_in_python():
    class Mine(random.Random):
        def random(self):
            return 0.5

    core = ShuffleCore(10, None, Mine(0))
    assert not isinstance(core.run(iter(range(5)), prefetch=True), source_mod._ShuffleRun or ())
