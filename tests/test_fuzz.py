"""A seeded, bounded mutational fuzzer: tarshards' tar reader against Python's ``tarfile``.

Seeds are small archives written by tarfile (ustar, gnu, pax), by GNU tar (gnu, posix, sparse
members) and gzip/zstd compressed ones. Each mutant (bit flips, byte sets, truncations,
insertions, deletions, header fields rewritten with huge sizes, odd type flags and bad checksums,
pax records rewritten) is read seven ways by tarshards (C and Python paths, several read sizes,
reused buffers, short reads) and once by tarfile. For every mutant:

* tarshards raises nothing outside its own error tree;
* all seven readings agree exactly (members and error);
* no silent loss: when tarfile reads more members than we yield, we raised;
* no wrong bytes: every member we yield equals tarfile's member at the same place, unless the
  difference is one of the documented deviations below (where tarfile is lax or not POSIX).

``TARSHARDS_FUZZ_N`` sets the number of mutants (default 2500, about half a minute on a loaded
2-core machine), ``TARSHARDS_FUZZ_SEED`` the random seed, and ``TARSHARDS_FUZZ_REPORT`` a file
to which the count of mutants in each outcome class is written as JSON.
"""

from __future__ import annotations

import collections
import gzip
import io
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import traceback
import warnings

import pytest

zstandard = pytest.importorskip("zstandard")

from test_tario import Trickle  # noqa: E402

from tarshards.compression import by_magic  # noqa: E402
from tarshards.errors import TarshardsError, TarshardsWarning  # noqa: E402
from tarshards.format import group_samples, split_name  # noqa: E402
from tarshards.tario import (  # noqa: E402
    decompressed_chunks,
    iter_tar_batches,
    read_chunks,
    tar_byte_source,
)

N = int(os.environ.get("TARSHARDS_FUZZ_N", "2500"))
SEED = int(os.environ.get("TARSHARDS_FUZZ_SEED", "20261201"))
TARFILE_CAP = 8 << 20  # tarfile's members are read up to this size (a huge declared size)


# ---------------------------------------------------------------------------------------------
# seeds
# ---------------------------------------------------------------------------------------------


def _tarfile_archive(fmt, rng, pax_headers=None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt, pax_headers=pax_headers) as tf:

        def add(name, data=b"", kind=tarfile.REGTYPE, link=""):
            ti = tarfile.TarInfo(name)
            ti.mtime = 1_700_000_000
            ti.type = kind
            ti.linkname = link
            ti.size = len(data) if kind == tarfile.REGTYPE else 0
            tf.addfile(ti, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

        add("s0.txt", b"hello")
        add("s0.bin", rng.randbytes(700))
        add("dir", kind=tarfile.DIRTYPE)
        add("dir/s1.json", b'{"a": 1}' * 40)
        add("s1.empty")
        add("s1.lnk", kind=tarfile.SYMTYPE, link="s0.txt")
        if fmt != tarfile.USTAR_FORMAT:
            add("long/" + "n" * 130 + ".txt", b"long name")
            add("l2.lnk", kind=tarfile.SYMTYPE, link="t" * 120)
            add("ünï/cödé.txt", "ü".encode() * 9)
        add("s2.bin", rng.randbytes(1500))
    return buf.getvalue()


def _gnu_tar(tmp, fmt, sparse=False) -> bytes:
    root = tmp / f"tree-{fmt}-{sparse}"
    root.mkdir()
    if sparse:
        with open(root / "sp.bin", "wb") as f:
            f.truncate(20_000)
            for i in range(6):
                f.seek(i * 3072)
                f.write(bytes([65 + i]) * 512)
    else:
        (root / "a.txt").write_bytes(b"alpha")
        (root / "sub").mkdir()
        (root / "sub" / "b.json").write_bytes(b'{"b": 2}')
        (root / ("g" * 110 + ".txt")).write_bytes(b"long")
        (root / "e.bin").write_bytes(b"")
        (root / "ln").symlink_to("a.txt")
    out = tmp / f"{fmt}-{sparse}.tar"
    cmd = [
        "tar",
        f"--format={fmt}",
        "--sort=name",
        "--mtime=@0",
        "--owner=0",
        "--group=0",
        "--numeric-owner",
        "-cf",
        str(out),
        "-C",
        str(root),
        ".",
    ]
    if sparse:
        cmd[2:2] = ["--sparse", "--hole-detection=raw"]
    if fmt == "posix":
        cmd[2:2] = ["--pax-option=delete=atime,delete=ctime"]
    subprocess.run(cmd, check=True, env={**os.environ, "LC_ALL": "C.UTF-8"})
    return out.read_bytes()


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    return build_seeds(tmp_path_factory.mktemp("gnutar"))


def build_seeds(tmp):
    """``({name: (bytes, None or (plain seed, "gz"|"zst"))}, {name: plain tar bytes})``."""
    rng = random.Random(SEED)
    plain = {
        "ustar": _tarfile_archive(tarfile.USTAR_FORMAT, rng),
        "gnu": _tarfile_archive(tarfile.GNU_FORMAT, rng),
        "pax": _tarfile_archive(tarfile.PAX_FORMAT, rng, {"comment": "fuzz seed"}),
    }
    if shutil.which("tar"):
        plain["gnutar-gnu"] = _gnu_tar(tmp, "gnu")
        plain["gnutar-posix"] = _gnu_tar(tmp, "posix")
        plain["gnutar-sparse-gnu"] = _gnu_tar(tmp, "gnu", sparse=True)
        plain["gnutar-sparse-posix"] = _gnu_tar(tmp, "posix", sparse=True)
    out = {name: (data, None) for name, data in plain.items()}
    for name in ("ustar", "pax"):
        out[f"{name}.gz"] = (gzip.compress(plain[name], mtime=0), (name, "gz"))
        out[f"{name}.zst"] = (
            zstandard.ZstdCompressor(write_checksum=True).compress(plain[name]),
            (name, "zst"),
        )
    half = len(plain["gnu"]) // 2
    out["gnu.2gz"] = (
        gzip.compress(plain["gnu"][:half], mtime=0) + gzip.compress(plain["gnu"][half:], mtime=0),
        ("gnu", "gz"),
    )
    return out, plain


# ---------------------------------------------------------------------------------------------
# mutations
# ---------------------------------------------------------------------------------------------


def _headers(data: bytes) -> list[int]:
    """Offsets of the blocks that look like tar headers (valid checksum)."""
    out = []
    for off in range(0, len(data) - 511, 512):
        blk = data[off : off + 512]
        if not blk.strip(b"\0"):
            continue
        try:
            stored = int(blk[148:156].split(b"\0")[0].strip() or b"x", 8)
        except ValueError:
            continue
        if stored == sum(blk[:148]) + 256 + sum(blk[156:]):
            out.append(off)
    return out


def _fix(block: bytearray) -> bytearray:
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return block


_TYPES = b"0\x001257LKxgSVDM"
_HUGE_SIZES = [
    b"77777777777\0",
    b"\x80" + (1 << 40).to_bytes(11, "big"),
    b"\xff" * 12,
    b"\x80" + b"\xff" * 11,
    b"00000001000\0",
    b"-0000000001\0",
    b"0000000000 \0",
    b"1_000\0\0\0\0\0\0\0",
]


def _rewrite_field(data: bytes, rng: random.Random, ops: list) -> bytes:
    heads = _headers(data)
    if not heads:
        return _flip(data, rng, ops)
    off = rng.choice(heads)
    blk = bytearray(data[off : off + 512])
    what = rng.choice(["size", "size", "type", "checksum", "name", "magic", "prefix", "sparse"])
    fix = True
    if what == "size":
        blk[124:136] = rng.choice(_HUGE_SIZES + [b"%011o\0" % rng.randrange(0, 5000)])
    elif what == "type":
        blk[156] = rng.choice(_TYPES)
    elif what == "checksum":
        good = int(_fix(bytearray(blk))[148:154], 8)
        blk[148:156] = b"%06o\0 " % max(0, good + rng.choice([65521, -65521, 1, -1, 131042]))
        fix = False
    elif what == "name":
        n = rng.randrange(0, 101)
        blk[0:100] = bytes(rng.choice(b"ab/.\0\xff_") for _ in range(n)) + bytes(100 - n)
    elif what == "magic":
        blk[257:265] = rng.choice([b"ustar\x0000", b"ustar  \0", bytes(8)])
    elif what == "prefix":
        blk[345:360] = rng.randbytes(15)
    else:  # old GNU sparse fields
        blk[156] = ord("S")
        blk[386:482] = b"".join(b"%011o\0" % rng.randrange(0, 4096) for _ in range(8))
        blk[482] = rng.choice([0, 0, 1])
        blk[483:495] = b"%011o\0" % rng.randrange(0, 1 << 16)
    if fix:
        _fix(blk)
    ops.append(f"field {what}@{off}")
    return data[:off] + bytes(blk) + data[off + 512 :]


def _pax_block(records: dict, kind=tarfile.XHDTYPE) -> bytes:
    return tarfile.TarInfo._create_pax_generic_header(records, kind, "utf-8")


def _rewrite_pax(data: bytes, rng: random.Random, ops: list) -> bytes:
    heads = _headers(data)
    if not heads:
        return _flip(data, rng, ops)
    off = rng.choice(heads)
    records = rng.choice(
        [
            {"size": str(rng.choice([1 << 40, 10**30, 0, 3, 1000]))},
            {"path": ""},
            {"size": ""},
            {"path": "p" * rng.randrange(1, 300)},
            {"size": "-1"},
            {"size": "12abc"},
            {
                "GNU.sparse.major": "1",
                "GNU.sparse.minor": "0",
                "GNU.sparse.name": "sp",
                "GNU.sparse.realsize": str(rng.randrange(0, 1 << 20)),
            },
            {"GNU.sparse.map": "0,3,10,2", "GNU.sparse.size": str(rng.randrange(0, 40))},
        ]
    )
    kind = rng.choice([tarfile.XHDTYPE, tarfile.XHDTYPE, tarfile.XGLTYPE])
    ops.append(f"pax {kind!r} {records!r}@{off}")
    return data[:off] + _pax_block(records, kind) + data[off:]


def _insert_ext(data: bytes, rng: random.Random, ops: list) -> bytes:
    """Insert an extended header, a zero block or a copy of a header at a header boundary."""
    heads = _headers(data) + [len(data) - len(data) % 512]
    off = rng.choice(heads) if heads else 0
    kind = rng.choice(["L", "K", "zero", "dup"])
    if kind == "zero":
        blob = bytes(512)
    elif kind == "dup" and heads:
        src = rng.choice(heads)
        blob = data[src : src + 512]
    else:
        blob = tarfile.TarInfo._create_gnu_long_header(
            "x" * rng.randrange(1, 700),
            kind.encode()[:1] if kind != "dup" else b"L",
            "utf-8",
            "strict",
        )
    ops.append(f"insert {kind}@{off}")
    return data[:off] + blob + data[off:]


def _flip(data: bytes, rng: random.Random, ops: list) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.choice([1, 1, 1, 2, 4])):
        i = rng.randrange(len(buf))
        buf[i] ^= 1 << rng.randrange(8)
        ops.append(f"flip@{i}")
    return bytes(buf)


def _set_byte(data: bytes, rng: random.Random, ops: list) -> bytes:
    buf = bytearray(data)
    i = rng.randrange(len(buf))
    buf[i] = rng.choice([0, 0xFF, 0x30, 0x20, rng.randrange(256)])
    ops.append(f"set@{i}={buf[i]}")
    return bytes(buf)


def _truncate(data: bytes, rng: random.Random, ops: list) -> bytes:
    if rng.random() < 0.5:
        cut = rng.randrange(len(data) + 1)
    else:  # near a block boundary
        cut = max(
            0,
            min(
                len(data),
                rng.randrange(0, len(data) // 512 + 1) * 512 + rng.choice([-1, 0, 0, 1, 100, 511]),
            ),
        )
    ops.append(f"cut@{cut}")
    return data[:cut]


def _insert_delete(data: bytes, rng: random.Random, ops: list) -> bytes:
    i = rng.randrange(len(data) + 1)
    if rng.random() < 0.5:
        blob = rng.choice([bytes(rng.randrange(1, 600)), rng.randbytes(rng.randrange(1, 600))])
        ops.append(f"insert {len(blob)}@{i}")
        return data[:i] + blob + data[i:]
    n = rng.randrange(1, 700)
    ops.append(f"delete {n}@{i}")
    return data[:i] + data[i + n :]


_BYTE_MUTATIONS = [_flip, _flip, _set_byte, _truncate, _insert_delete]
_TAR_MUTATIONS = _BYTE_MUTATIONS + [_rewrite_field, _rewrite_field, _rewrite_pax, _insert_ext]


def mutate(seeds, plain, rng: random.Random):
    name = rng.choice(sorted(seeds))
    data, compressed = seeds[name]
    ops = [name]
    if compressed is not None and rng.random() < 0.5:  # mutate the tar inside, recompress
        inner = plain[compressed[0]]
        for _ in range(rng.choice([1, 1, 2])):
            inner = rng.choice(_TAR_MUTATIONS)(inner, rng, ops) if inner else inner
        data = (
            gzip.compress(inner, mtime=0)
            if compressed[1] == "gz"
            else zstandard.ZstdCompressor(write_checksum=True).compress(inner)
        )
        ops.append(f"recompressed {compressed[1]}")
    else:
        muts = _BYTE_MUTATIONS if compressed is not None else _TAR_MUTATIONS
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            if data:
                data = rng.choice(muts)(data, rng, ops)
    return data, ops


# ---------------------------------------------------------------------------------------------
# the readers
# ---------------------------------------------------------------------------------------------


def _ways(data: bytes):
    """Seven readings: (label, chunks, accelerate)."""
    yield "file/C", tar_byte_source(io.BytesIO(data), "fuzz"), True
    yield "file/Py", tar_byte_source(io.BytesIO(data), "fuzz"), False
    yield "4096/C", decompressed_chunks(read_chunks(io.BytesIO(data), 4096), "fuzz"), True
    yield (
        "4096-reuse/Py",
        decompressed_chunks(read_chunks(io.BytesIO(data), 4096, reuse=True), "fuzz"),
        False,
    )
    yield "513/C", decompressed_chunks(read_chunks(io.BytesIO(data), 513), "fuzz"), True
    yield (
        "64-reuse/C",
        decompressed_chunks(read_chunks(io.BytesIO(data), 64, reuse=True), "fuzz"),
        True,
    )
    yield "trickle100/Py", tar_byte_source(Trickle(data, 100), "fuzz", 100), False


def ours(data: bytes):
    """``(members, error, warned)``; raises AssertionError when the readings disagree, and lets
    any exception outside the tarshards tree escape."""
    first = None
    for label, chunks, accelerate in _ways(data):
        got = []
        err = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", TarshardsWarning)
            try:
                for batch in iter_tar_batches(chunks, "fuzz", accelerate=accelerate):
                    got.extend(batch)
            except TarshardsError as exc:
                err = (type(exc).__name__, str(exc))
        out = (got, err, len(caught))
        if first is None:
            first = out
        elif out != first:
            raise AssertionError(
                f"reading {label} differs from file/C: {_brief(out)} != {_brief(first)}"
            )
    return first


def _brief(out):
    got, err, warned = out
    return ([(n, len(d), o) for n, d, o in got], err, warned)


def reference(data: bytes):
    """``(members, error, raw)`` as tarfile reads them; ``raw`` is the tar stream (zstd is
    decompressed first: tarfile cannot read it)."""
    comp = by_magic(data)
    raw = _decompress(data, comp)
    err = None
    if comp is not None and comp.name == "zstd":
        data, err = raw
    members = []
    try:
        with tarfile.open(
            fileobj=io.BytesIO(data),
            mode="r:gz" if comp is not None and comp.name == "gzip" else "r:",
        ) as tf:
            for m in tf:
                if not m.isreg():
                    continue
                if m.size > TARFILE_CAP:
                    return members, "member too large to read", raw[0]
                f = tf.extractfile(m)
                members.append((m.name, f.read(), m.offset))
    except Exception as exc:  # noqa: BLE001 - the reference's errors are all just errors
        return members, err or f"{type(exc).__name__}: {exc}", raw[0]
    return members, err, raw[0]


def _decompress(data: bytes, comp):
    """The tar bytes inside ``data`` (as much as decompresses) and the error, if any."""
    if comp is None:
        return data, None
    out = io.BytesIO()
    try:
        if comp.name == "zstd":
            with zstandard.ZstdDecompressor().stream_reader(
                io.BytesIO(data), read_across_frames=True
            ) as r:
                while chunk := r.read(1 << 16):
                    out.write(chunk)
        else:
            with gzip.GzipFile(fileobj=io.BytesIO(data)) as r:
                while chunk := r.read(1 << 16):
                    out.write(chunk)
    except Exception as exc:  # noqa: BLE001
        return out.getvalue(), f"{comp.name}: {exc}"
    return out.getvalue(), None


# ---------------------------------------------------------------------------------------------
# the verdict
# ---------------------------------------------------------------------------------------------

_EMPTY_PAX = re.compile(rb"\d+ (path|size|GNU\.sparse\.name)=/*\n")
_EMPTY_SIZE = re.compile(rb"\d+ size=\n")


def _deviation(mine, theirs, raw: bytes) -> str | None:
    """Why member ``mine`` may differ from tarfile's ``theirs``: one of the documented cases
    where tarfile departs from POSIX or GNU tar, checked on the archive's bytes."""
    (n1, d1, o1), (n2, d2, o2) = mine, theirs
    if b" size=" in _global_records(raw):
        return (
            "tarfile applies a global size= to a member's data but not to where the next "
            "header starts (GNU tar applies it to both, as we do)"
        )
    if o1 != o2:
        return None
    if n1 != n2 and n2 == "" and d1 != d2 and _EMPTY_SIZE.search(raw) and _EMPTY_PAX.search(raw):
        return (
            "tarfile names a member '' and reads its empty pax size= as 0 (POSIX: an empty "
            "value deletes the keyword)"
        )
    if n1 != n2 and d1 != d2 and n2.endswith("/" + n1) and _EMPTY_SIZE.search(raw):
        return (
            "tarfile applies the ustar prefix field to non-POSIX headers and reads an empty pax "
            "size= as 0 (GNU tar does neither)"
        )
    if n1 != n2 and d1 == d2:
        if b" path=" in _global_records(raw):
            return "tarfile does not apply a global path= to every member type (GNU tar does)"
        if n2 == "" and _EMPTY_PAX.search(raw):
            return "tarfile names a member '' (POSIX: an empty path= deletes the keyword)"
        if n2.endswith("/" + n1):
            return "tarfile applies the ustar prefix field to non-POSIX headers (GNU tar does not)"
        if n1.endswith("/" + n2) and _prefixed_gnu_type(raw, o1):
            return (
                "tarfile ignores the ustar prefix field of a GNU-type member (sparse) whose "
                "magic is POSIX's (GNU tar applies it, as we do)"
            )
    if n1 == n2 and d1 != d2:
        if _EMPTY_PAX.search(raw):
            return "tarfile reads an empty pax size= as 0 (POSIX: it deletes the keyword)"
        if _sparse_after_pax_size(raw, o1):
            return (
                "tarfile applies a pax size= to an old-GNU sparse member ('S'), whose own header "
                "gives its sizes (GNU tar lists those, as we read them)"
            )
    return None


def _size_field(h: bytes) -> int | None:
    """A header block's size field as plain octal digits, or None."""
    digits = h[124:136].split(b"\0", 1)[0].strip(b" ")
    return int(digits, 8) if digits and set(digits) <= set(b"01234567") else None


def _sparse_after_pax_size(raw: bytes, offset: int) -> bool:
    """Whether the member whose first header is at ``offset`` is an old-GNU sparse one ('S')
    behind a pax header with a size= record (seed 19019: GNU tar's tar -tvf lists the sparse
    header's own size, as we read it; tarfile the pax size)."""
    pos, sized = offset, False
    while pos + 512 <= len(raw):
        h = raw[pos : pos + 512]
        if h[156:157] != b"x":
            return sized and h[156:157] == b"S"
        size = _size_field(h)
        if size is None:
            return False
        sized = sized or b" size=" in raw[pos + 512 : pos + 512 + size]
        pos += 512 + (size + 511) // 512 * 512
    return False


def _prefixed_gnu_type(raw: bytes, offset: int) -> bool:
    """Whether the header at ``offset`` is a GNU sparse member ('S') with the POSIX magic
    ("ustar\\0" "00") and a prefix field: GNU tar reads the prefix into the name (it does so for
    every type under that magic), tarfile never for GNU types."""
    h = raw[offset : offset + 512]
    return len(h) == 512 and h[156:157] == b"S" and h[257:265] == b"ustar\x0000" and h[345] != 0


def _renamed_old_directory(member, raw: bytes) -> bool:
    """Whether ``member`` (name, data, offset of its first header) is an empty one whose own
    header, after a GNU long name or a pax header (or under a pax global path=), has type '\\0'
    and a name field ending in '/' while the member is named otherwise."""
    name, data, offset = member
    if data or name.endswith("/"):
        return False
    pos, renamed = offset, False
    while pos + 512 <= len(raw):
        h = raw[pos : pos + 512]
        if h[156:157] not in (b"L", b"x"):
            field = h[:100].split(b"\0", 1)[0]
            renamed = renamed or b" path=" in _global_records(raw)  # (seeds 40404, 50505)
            return renamed and h[156] == 0 and field.endswith(b"/")
        size = _size_field(h)
        if size is None:
            return False
        renamed = True
        pos += 512 + (size + 511) // 512 * 512
    return False


def _global_records(raw: bytes) -> bytes:
    """The payloads of the pax global headers in ``raw``."""
    out = []
    for h in _headers(raw):
        if raw[h + 156] == ord("g"):
            try:
                size = int(raw[h + 124 : h + 135], 8)
            except ValueError:
                continue
            out.append(raw[h + 512 : h + 512 + min(size, 1 << 20)])
    return b"".join(out)


def _same_but_global_names(mine: list, theirs: list, raw: bytes) -> bool:
    """Whether two readings agree, names aside where a pax global path= names the members
    (tarfile does not apply it to every member type; GNU tar does, as we do)."""
    if b" path=" not in _global_records(raw):
        return mine == theirs
    return [(d, o) for _, d, o in mine] == [(d, o) for _, d, o in theirs]


def _skipped_by_sized_old_directory(raw: bytes, offsets: list) -> bool:
    """Whether every offset lies in the declared data of a '\\0'-type header whose name field
    ends in '/' (a pre-POSIX directory with a size): tarfile reads on at the next block, GNU tar
    (tar -tvf on seed 12012's mutant) skips the size, as we do."""
    spans = []
    for h in _headers(raw):
        blk = raw[h : h + 512]
        if blk[156] != 0 or not blk[:100].split(b"\0", 1)[0].endswith(b"/"):
            continue
        size = _size_field(blk)
        if size:
            spans.append((h + 512, h + 512 + (size + 511) // 512 * 512))
    return bool(offsets) and all(any(a <= o < b for a, b in spans) for o in offsets)


def classify(data: bytes):
    """The outcome class of one mutant, or raises AssertionError for a broken promise."""
    mine, my_err, warned = ours(data)
    theirs, their_err, raw = reference(data)
    common = min(len(mine), len(theirs))
    deviations = []
    for i in range(common):
        if mine[i] != theirs[i]:
            why = _deviation(mine[i], theirs[i], raw)
            if (
                why is None
                and _renamed_old_directory(mine[i], raw)
                and _same_but_global_names(mine[i + 1 :], theirs[i:], raw)
            ):
                why = (
                    "tarfile takes a '\\0'-type member for a directory by its header's own name "
                    "('./') although a GNU long name or pax path renames it (GNU tar lists a "
                    "regular file under the new name, as we do)"
                )
            if why is None:
                raise AssertionError(
                    f"wrong bytes at member {i}: ours {_brief((mine, my_err, 0))}"
                    f" tarfile {[(n, len(d), o) for n, d, o in theirs]}"
                )
            deviations.append(why)
            break  # the readings part ways here: what follows is not comparable
    if deviations:
        return "deviation: " + deviations[0]
    if (
        len(theirs) > len(mine)
        and my_err is None
        and mine == theirs[: len(mine)]
        and _skipped_by_sized_old_directory(raw, [o for _, _, o in theirs[len(mine) :]])
    ):
        return (
            "deviation: tarfile reads no data for a pre-POSIX directory ('\\0' type, a name "
            "ending in '/') whose size is not 0 (GNU tar skips that size, as we do)"
        )
    if len(theirs) > len(mine) and my_err is None and b" size=" in _global_records(raw):
        # (seed 28028: a 'V' header under a global size=; tar -tvf lists what we yield)
        return (
            "deviation: tarfile applies a global size= to a member's data but not to where "
            "the next header starts (GNU tar applies it to both, as we do)"
        )
    if len(theirs) > len(mine) and my_err is None:
        raise AssertionError(
            f"silent loss: tarfile reads {len(theirs)} members, we yield "
            f"{len(mine)} and raise nothing"
        )
    if my_err is None and their_err is None:
        if len(mine) == len(theirs):
            return "both read, same members"
        return (
            "we read more (a lone zero block: tarfile stops there)"
            if warned
            else "we read more (tarfile stops early without an error)"
        )
    if my_err is not None and their_err is not None:
        return "both raise"
    if my_err is not None:
        if len(theirs) > len(mine):
            return "we raise, tarfile reads more (tarfile is lax)"
        return "we raise, tarfile stops without an error (silent loss in tarfile)"
    if len(mine) > len(theirs):
        return "tarfile raises, we read more (a lone zero block or tarfile's limits)"
    return "tarfile raises, we read the same members without error"


def run_fuzz(seeds, plain, n: int, seed: int):
    rng = random.Random(seed)
    counts = collections.Counter()
    failures = []
    for i in range(n):
        data, ops = mutate(seeds, plain, rng)
        try:
            counts[classify(data)] += 1
        except AssertionError as exc:
            counts["FAILED"] += 1
            failures.append((i, ops, str(exc)[:400], data))
        except Exception:  # noqa: BLE001 - an exception outside the tarshards tree
            counts["FAILED"] += 1
            failures.append((i, ops, traceback.format_exc(limit=4)[-600:], data))
    return counts, failures


def test_fuzz_reader_against_tarfile(seeds, tmp_path):
    seeds_, plain = seeds
    counts, failures = run_fuzz(seeds_, plain, N, SEED)
    report = os.environ.get("TARSHARDS_FUZZ_REPORT")
    if report:
        with open(report, "w") as f:
            json.dump(
                {
                    "mutants": N,
                    "seed": SEED,
                    "classes": dict(counts.most_common()),
                    "failures": [(i, ops, msg) for i, ops, msg, _ in failures[:50]],
                },
                f,
                indent=1,
            )
    print(f"\n{N} mutants (seed {SEED}):")
    for cls, k in counts.most_common():
        print(f"  {k:6d}  {cls}")
    for i, ops, msg, data in failures[:5]:
        (tmp_path / f"mutant-{i}.bin").write_bytes(data)
    assert not failures, "\n".join(
        f"mutant {i} ({' '.join(ops)}; saved as {tmp_path}/mutant-{i}.bin): {msg}"
        for i, ops, msg, _ in failures[:5]
    )
    # the mutations reach every kind of outcome that matters
    assert counts["both read, same members"] > N // 20
    assert counts["both raise"] > N // 20
    assert sum(k for c, k in counts.items() if c.startswith("we raise")) > 0


def test_fuzz_oracle_catches_a_reader_that_drops_members(seeds, monkeypatch):
    """The verdict is not vacuous: a reader that silently drops its last member is caught."""
    import tarshards.tario as tario

    real = tario.iter_tar_batches

    def lossy(chunks, source=None, **kw):
        members = [m for batch in real(chunks, source, **kw) for m in batch]
        yield members[:-1]

    monkeypatch.setattr(sys.modules[__name__], "iter_tar_batches", lossy)
    _, plain = seeds
    with pytest.raises(AssertionError, match="silent loss"):
        classify(plain["ustar"])


# ---------------------------------------------------------------------------------------------
# samples: grouping a damaged stream
# ---------------------------------------------------------------------------------------------

SAMPLE_N = int(os.environ.get("TARSHARDS_FUZZ_SAMPLES_N", "600"))
_META_KEYS = ("__key__", "__url__", "__offset__")


def _grouped(data: bytes, accelerate: bool, chunk: int):
    """``(samples as (key, {ext: bytes}) pairs, error)`` of a mutant, grouped in C or Python."""
    got, err = [], None
    chunks = decompressed_chunks(read_chunks(io.BytesIO(data), chunk), "fuzz")
    batches = iter_tar_batches(chunks, "fuzz", accelerate=accelerate)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TarshardsWarning)
        try:
            for s in group_samples(batches, "fuzz", batched=True, accelerate=accelerate):
                got.append(
                    (s["__key__"], {k: bytes(v) for k, v in s.items() if k not in _META_KEYS})
                )
        except TarshardsError as exc:
            err = (type(exc).__name__, str(exc), exc.member)
    return got, err


def _groups(members):
    """The members' samples as :func:`group_samples` forms them, stopping at a repeated field."""
    out: list = []
    for name, data, _ in members:
        parts = split_name(name)
        if parts is None:
            continue
        key, ext = parts
        if out and out[-1][0] == key:
            if ext in out[-1][1]:
                break
            out[-1][1][ext] = bytes(data)
        else:
            out.append((key, {ext: bytes(data)}))
    return out


def test_fuzz_samples_of_damaged_shards(seeds):
    """Samples read from mutants: C and Python grouping agree at every read size; every sample
    yielded is made of the members the member reader yields, in order, with their bytes; only
    the last sample can be held back, and only when the stream raised."""
    seeds_, plain = seeds
    rng = random.Random(SEED + 1)
    held_back = flushed = 0
    for i in range(SAMPLE_N):
        data, ops = mutate(seeds_, plain, rng)
        members, member_err, _ = ours(data)
        first = _grouped(data, True, 1 << 20)
        for accelerate, chunk in ((False, 1 << 20), (True, 513), (False, 64)):
            assert _grouped(data, accelerate, chunk) == first, (i, ops, accelerate, chunk)
        samples, err = first
        groups = _groups(members)
        assert samples == groups[: len(samples)], (i, ops)
        if err is None:
            assert samples == groups, (i, ops)
        else:
            assert len(groups) - len(samples) <= 1, (i, ops, err)
            cut = err[0] in ("TruncatedShardError", "CompressionError") and err[2] is not None
            named = split_name(err[2]) if cut else None
            if groups and named is not None and named[0] != groups[-1][0]:
                # the stream was cut in another sample's member: the last one is complete
                assert samples == groups, (i, ops, err)
            if groups and member_err is not None:
                if len(samples) == len(groups):
                    flushed += 1
                else:
                    held_back += 1
    # the mutations reach both outcomes at a cut: the last sample kept, and held back
    assert flushed > 0 and held_back > 0, (flushed, held_back)


INDEX_N = int(os.environ.get("TARSHARDS_FUZZ_INDEX_N", "800"))


def _index_members(data: bytes):
    """``(members as (key, ext, size, checksum), error name)`` of the index of a mutant."""
    from tarshards.index import index_stream

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TarshardsWarning)
        try:
            idx = index_stream(io.BytesIO(data), "fuzz")
        except TarshardsError as exc:
            return None, type(exc).__name__
    starts = idx.member_starts.tolist()
    out = []
    for s in range(idx.num_samples):
        for m in range(starts[s], starts[s + 1]):
            # the index keeps an extension as written; samples are keyed by it lower-cased, by
            # the reader and by IndexedDataset alike (seed 505 mutated a name to "....GNU...")
            ext = idx.extensions[int(idx.member_ext[m])].lower()
            out.append((idx.keys[s], ext, int(idx.member_sizes[m]), int(idx.member_checksums[m])))
    return out, None


def test_fuzz_index_agrees_with_the_reader(seeds):
    """The index of a mutant lists exactly the members a sequential read yields (names, sizes,
    checksums), or indexing raises where reading does: the index is made by the reader's own
    parser. (It used to have a walk of its own, which disagreed on ~7% of these mutants: a lone
    zero block ended the index, an empty pax path, a global pax size...)"""
    from tarshards.hashing import MEMBER_HASH, member_checksum_fn

    checksum = member_checksum_fn(MEMBER_HASH)
    seeds_, plain = seeds
    rng = random.Random(SEED + 2)
    outcomes = collections.Counter()
    for i in range(INDEX_N):
        data, ops = mutate(seeds_, plain, rng)
        got, err = [], None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TarshardsWarning)
            try:
                for batch in iter_tar_batches(tar_byte_source(io.BytesIO(data), "fuzz"), "fuzz"):
                    got.extend(batch)
            except TarshardsError as exc:
                err = type(exc).__name__
        want = [
            (*parts, len(d), checksum(bytes(d)))
            for name, d, _ in got
            if (parts := split_name(name)) is not None
        ]
        have, index_err = _index_members(data)
        if err is None:
            assert index_err is None, (i, ops, index_err)
            assert have == want, (i, ops)
            outcomes["same"] += 1
        else:
            assert index_err is not None, (i, ops, err, "the index lists", len(have))
            outcomes["both raise"] += 1
    assert outcomes["same"] > INDEX_N // 10 and outcomes["both raise"] > INDEX_N // 10
