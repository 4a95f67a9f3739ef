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
import importlib.util
import io
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import traceback
import warnings

import pytest

zstandard = pytest.importorskip("zstandard")

from test_tario import Trickle  # noqa: E402

from tarshards.errors import TarshardsError, TarshardsWarning  # noqa: E402
from tarshards.format.compression import by_magic  # noqa: E402
from tarshards.format.names import group_samples, split_name  # noqa: E402
from tarshards.read.reading import shard_samples  # noqa: E402
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


def _grouped_file(data: bytes, path):
    """:func:`_grouped` of the mutant written to ``path`` and read by ``shard_samples``: a local
    plain file's samples come from the C sample scan (the reference reader going on from the
    first sample it declines)."""
    path.write_bytes(data)
    got, err = [], None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TarshardsWarning)
        try:
            for s in shard_samples(str(path)):
                got.append(
                    (s["__key__"], {k: bytes(v) for k, v in s.items() if k not in _META_KEYS})
                )
        except TarshardsError as exc:
            err = (type(exc).__name__, str(exc).replace(str(path), "fuzz"), exc.member)
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


def test_fuzz_samples_of_damaged_shards(seeds, tmp_path):
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
        if data:  # (an empty file is read as a stream)
            assert _grouped_file(data, tmp_path / "mutant.tar") == first, (i, ops, "file")
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
    from tarshards.format.index import index_stream

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


def _repeats_a_field(members) -> bool:
    """Whether a sample of ``members`` ((key, ext, size, checksum), in order) repeats a field."""
    key, seen = None, set()
    for k, ext, _, _ in members:
        if k != key:
            key, seen = k, set()
        if ext.lower() in seen:
            return True
        seen.add(ext.lower())
    return False


def test_fuzz_index_agrees_with_the_reader(seeds):
    """The index of a mutant lists exactly the members a sequential read yields (names, sizes,
    checksums), or indexing raises where reading does: the index is made by the reader's own
    parser. (It used to have a walk of its own, which disagreed on ~7% of these mutants: a lone
    zero block ended the index, an empty pax path, a global pax size...)"""
    from tarshards.format.hashing import MEMBER_HASH, member_checksum_fn

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
        if err is None and index_err == "DuplicateFieldError":
            # a sample repeats a field: the sequential read of samples raises there (the member
            # reader above does not group), and so does indexing
            assert _repeats_a_field(want), (i, ops)
            outcomes["both raise"] += 1
            continue
        if err is None:
            assert index_err is None, (i, ops, index_err)
            assert have == want, (i, ops)
            outcomes["same"] += 1
        else:
            assert index_err is not None, (i, ops, err, "the index lists", len(have))
            outcomes["both raise"] += 1
    assert outcomes["same"] > INDEX_N // 10 and outcomes["both raise"] > INDEX_N // 10


# ---------------------------------------------------------------------------------------------
# random access: index building and ds[i] of damaged shards (hypothesis)
# ---------------------------------------------------------------------------------------------
#
# Each example writes a small shard (tarfile ustar/gnu/pax with long names, or ShardWriter plain,
# gzip, zstd, and sample-aligned gzip/zstd), damages it (a cut, a flipped bit in a header or in
# data, a bad checksum, a rewritten size or type, an inserted GNU long name, pax header or zero
# block; inside the tar and recompressed, or in the compressed bytes), and indexes it the way
# `tarshards index` does (build_manifest). The promise: indexing raises a tarshards error naming
# the shard, or ``IndexedDataset(manifest)[i]`` equals sample i of the sequential read for every
# i (and the sequential read raises nothing). A second test damages the shard after indexing
# (a stale index): ``ds[i]`` raises a tarshards error or equals the sequential read's sample.

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

RANDOM_ACCESS_N = int(os.environ.get("TARSHARDS_FUZZ_RANDOM_ACCESS_N", "120"))
# the same examples at every run (as the seeded fuzzers above); TARSHARDS_FUZZ_RANDOMIZE=1 draws
# new ones (how the bugs below were found)
_RA_DERANDOMIZE = not os.environ.get("TARSHARDS_FUZZ_RANDOMIZE")
_RA_EXTS = ["txt", "cls", "json", "seg.png"]


@st.composite
def _ra_samples(draw):
    out = []
    for i in range(draw(st.integers(1, 5))):
        where = draw(st.sampled_from(["", "d/", "l" * 110 + "/"]))
        exts = draw(st.lists(st.sampled_from(_RA_EXTS), min_size=1, max_size=3, unique=True))
        out.append((f"{where}k{i:02d}", {e: draw(st.binary(max_size=1200)) for e in exts}))
    return out


_RA_WRITERS = ["tarfile-ustar", "tarfile-gnu", "tarfile-pax", "sw", "sw.gz", "sw.zst"]
_RA_WRITERS += ["sw-aligned.gz", "sw-aligned.zst", "tarfile-pax.gz", "tarfile-gnu.zst"]


def _ra_write(d: str, samples, writer: str) -> tuple[str, bytes | None]:
    """The shard's path, and its tar bytes where it was compressed whole afterwards."""
    from tarshards import ShardWriter

    base, _, comp = writer.partition(".")
    if base.startswith("sw"):
        suffix = ".tar" + (f".{comp}" if comp else "")
        with ShardWriter(
            os.path.join(d, "w-%04d" + suffix), encoder=False, aligned=base == "sw-aligned"
        ) as w:
            for key, fields in samples:
                w.write({"__key__": key, **fields})
        return os.path.join(d, "w-0000" + suffix), None
    fmt = {"ustar": tarfile.USTAR_FORMAT, "gnu": tarfile.GNU_FORMAT, "pax": tarfile.PAX_FORMAT}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt[base.split("-")[1]]) as tf:
        for key, fields in samples:
            if fmt[base.split("-")[1]] == tarfile.USTAR_FORMAT and len(key) > 99:
                key = key[-40:]
            for ext, data in fields.items():
                ti = tarfile.TarInfo(f"{key}.{ext}")
                ti.size, ti.mtime = len(data), 1_700_000_000
                tf.addfile(ti, io.BytesIO(data))
    path = os.path.join(d, "t.tar" + (f".{comp}" if comp else ""))
    raw = buf.getvalue()
    with open(path, "wb") as f:
        f.write(_ra_compress(raw, comp))
    return path, raw if comp else None


def _ra_compress(raw: bytes, comp: str) -> bytes:
    if comp == "gz":
        return gzip.compress(raw, mtime=0)
    if comp == "zst":
        return zstandard.ZstdCompressor(write_checksum=True).compress(raw)
    return raw


def _ra_tar_bytes(path: str) -> tuple[bytes, str]:
    """The tar inside a (compressed) shard, and its compression's suffix."""
    with open(path, "rb") as f:
        data = f.read()
    if path.endswith(".gz"):
        return gzip.decompress(data), "gz"
    if path.endswith(".zst"):
        return zstandard.ZstdDecompressor().decompressobj().decompress(data), "zst"
    return data, ""


def _ra_mutate(data: bytes, draw, tar: bool) -> tuple[bytes, str, tuple[int, float]]:
    """One damage to ``data`` (a tar stream when ``tar``, else compressed bytes): the damaged
    bytes, what was done, and the range of offsets it touched (to the end where it shifts)."""
    kinds = ["cut", "flip-data", "set-byte"]
    if tar:
        kinds += ["flip-header", "checksum", "size", "type", "long-name", "pax", "zero", "dup"]
    kind = draw(st.sampled_from(kinds))
    heads = _headers(data) if tar else []
    if kind in ("flip-header", "checksum", "size", "type", "long-name", "pax", "zero", "dup"):
        if not heads:
            kind = "flip-data"
    n = len(data)
    if n == 0:
        return data, "empty", (0, 0)
    if kind == "cut":
        cut = draw(st.integers(0, n))
        if tar and draw(st.booleans()):  # near a block boundary
            cut = min(n, cut // 512 * 512 + draw(st.sampled_from([0, 1, 100, 511])))
        return data[:cut], f"cut@{cut}", (cut, math.inf)
    if kind in ("flip-data", "set-byte"):
        i = draw(st.integers(0, n - 1))
        buf = bytearray(data)
        if kind == "flip-data":
            buf[i] ^= 1 << draw(st.integers(0, 7))
        else:
            buf[i] = draw(st.sampled_from([0, 0xFF, 0x30, 0x20]))
        return bytes(buf), f"{kind}@{i}", (i, i + 1)
    off = draw(st.sampled_from(heads))
    blk = bytearray(data[off : off + 512])
    if kind == "flip-header":
        i = draw(st.integers(0, 511))
        blk[i] ^= 1 << draw(st.integers(0, 7))
        return (
            data[:off] + bytes(blk) + data[off + 512 :],
            f"flip-header@{off + i}",
            (off, off + 512),
        )
    if kind == "checksum":
        good = int(_fix(bytearray(blk))[148:154], 8)
        blk[148:156] = b"%06o\0 " % max(0, good + draw(st.sampled_from([1, -1, 65521])))
        return data[:off] + bytes(blk) + data[off + 512 :], f"checksum@{off}", (off, off + 512)
    if kind == "size":
        blk[124:136] = draw(
            st.sampled_from(_HUGE_SIZES) | st.integers(0, 5000).map(lambda s: b"%011o\0" % s)
        )
        return data[:off] + bytes(_fix(blk)) + data[off + 512 :], f"size@{off}", (off, off + 512)
    if kind == "type":
        blk[156] = draw(st.sampled_from(list(_TYPES)))
        return (
            data[:off] + bytes(_fix(blk)) + data[off + 512 :],
            f"type {chr(blk[156])}@{off}",
            (off, off + 512),
        )
    if kind == "long-name":
        name = draw(st.sampled_from(["x" * 150 + ".txt", "a/b.cls", "", "y" * 600]))
        blob = tarfile.TarInfo._create_gnu_long_header(name, b"L", "utf-8", "strict")
    elif kind == "pax":
        records = draw(
            st.sampled_from(
                [
                    {"path": "p" * 130 + ".txt"},
                    {"path": ""},
                    {"size": "3"},
                    {"size": str(1 << 40)},
                    {"size": "12abc"},
                ]
            )
        )
        blob = _pax_block(records, draw(st.sampled_from([tarfile.XHDTYPE, tarfile.XGLTYPE])))
    elif kind == "zero":
        blob = bytes(512)
    else:
        src = draw(st.sampled_from(heads))
        blob = data[src : src + 512]
    return data[:off] + blob + data[off:], f"insert {kind}@{off}", (off, math.inf)


def _ra_sequential(path: str):
    from tarshards.read.reading import iter_samples

    samples, err = [], None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TarshardsWarning)
        try:
            for s in iter_samples([path]):
                samples.append(s)
        except TarshardsError as exc:
            err = exc
    return samples, err


def _ra_assert_names_shard(exc: TarshardsError, path: str, what) -> None:
    assert exc.url is not None and os.path.basename(path) in str(exc.url), (what, repr(exc))
    assert os.path.basename(path) in str(exc), (what, str(exc))


def _ra_build(d: str, path: str):
    from tarshards.format.manifest import build_manifest

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TarshardsWarning)
        return build_manifest([path], os.path.join(d, "m.json"), workers=1)


def _ra_damaged_shard(d: str, data, samples, writer: str):
    path, _ = _ra_write(d, samples, writer)
    raw, comp = _ra_tar_bytes(path)
    if comp and data.draw(st.booleans(), label="mutate the compressed bytes"):
        with open(path, "rb") as f:
            damaged, what, _ = _ra_mutate(f.read(), data.draw, tar=False)
    else:
        inner, what, _ = _ra_mutate(raw, data.draw, tar=True)
        damaged = _ra_compress(inner, comp)
    with open(path, "wb") as f:
        f.write(damaged)
    return path, what


def _ra_check_equal(ds, samples: list, what) -> None:
    assert len(ds) == len(samples), (what, len(ds), len(samples))
    for i, want in enumerate(samples):
        got = ds[i]
        assert {k: bytes(v) if isinstance(v, memoryview) else v for k, v in got.items()} == {
            k: bytes(v) if isinstance(v, memoryview) else v for k, v in want.items()
        }, (what, i)


@settings(
    max_examples=RANDOM_ACCESS_N,
    deadline=None,
    derandomize=_RA_DERANDOMIZE,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(samples=_ra_samples(), writer=st.sampled_from(_RA_WRITERS), data=st.data())
def test_fuzz_index_and_random_access_of_damaged_shards(samples, writer, data):
    """A damaged shard gives a tarshards error naming it when indexed, or an index whose
    ``ds[i]`` equals sample i of the sequential read, for every i (and the read raises nothing)."""
    from tarshards.read.indexed import IndexedDataset

    with tempfile.TemporaryDirectory() as d:
        path, what = _ra_damaged_shard(d, data, samples, writer)
        try:
            manifest = _ra_build(d, path)
        except TarshardsError as exc:
            _ra_assert_names_shard(exc, path, what)
            return
        seq, err = _ra_sequential(path)
        assert err is None, (what, "indexed, but the sequential read raises", repr(err))
        with warnings.catch_warnings(), IndexedDataset(manifest) as ds:
            # a shard compressed as one stream without indexed_gzip is read from a copy (warns)
            warnings.simplefilter("ignore", TarshardsWarning)
            _ra_check_equal(ds, seq, what)


@settings(
    max_examples=RANDOM_ACCESS_N // 2,
    deadline=None,
    derandomize=_RA_DERANDOMIZE,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    samples=_ra_samples(),
    writer=st.sampled_from(_RA_WRITERS),
    verify=st.booleans(),
    data=st.data(),
)
def test_fuzz_random_access_with_a_stale_index(samples, writer, verify, data):
    """A shard damaged after it was indexed: each ``ds[i]`` raises a tarshards error naming the
    shard, or gives sample i as indexed (its key and fields); a plain shard's sample whose bytes
    the damage did not touch is read exactly as before; with ``verify=True`` a sample whose bytes
    changed is never returned."""
    from tarshards.read.indexed import IndexedDataset

    with tempfile.TemporaryDirectory() as d:
        path, _ = _ra_write(d, samples, writer)
        manifest = _ra_build(d, path)
        original, err = _ra_sequential(path)
        assert err is None and len(original) == len(samples)
        index = manifest.load_index(0)
        what, (lo, hi), plain = _ra_mutate_in_place(path, data)
        with warnings.catch_warnings(), IndexedDataset(manifest, verify=verify) as ds:
            warnings.simplefilter("ignore", TarshardsWarning)
            for i in range(len(ds)):
                start, end = int(index.tar_offsets[i]), int(index.sample_ends[i])
                untouched = plain and (end <= lo or start >= hi)
                try:
                    got = ds[i]
                except TarshardsError as exc:
                    assert not untouched, (what, i, repr(exc))
                    _ra_assert_names_shard(exc, path, what)
                    continue
                got = {k: bytes(v) if isinstance(v, memoryview) else v for k, v in got.items()}
                if verify or untouched:
                    assert got == original[i], (what, i)
                else:
                    assert sorted(got) == sorted(original[i]), (what, i)
                    assert got["__key__"] == original[i]["__key__"], (what, i)


def _ra_mutate_in_place(path: str, data):
    raw, comp = _ra_tar_bytes(path)
    if comp:
        with open(path, "rb") as f:
            damaged, what, _ = _ra_mutate(f.read(), data.draw, tar=False)
    else:
        damaged, what, touched = _ra_mutate(raw, data.draw, tar=True)
    with open(path, "wb") as f:
        f.write(damaged)
    return what, (touched if not comp else (0, math.inf)), not comp


# ---- what the random-access fuzzer found (regressions) -------------------------------------------


def _ra_tar(members, fmt=tarfile.USTAR_FORMAT, pax_headers=None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt, pax_headers=pax_headers) as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mtime = len(data), 1_700_000_000
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def _ra_random_access_equals_sequential(tmp_path, raw: bytes, name="t.tar"):
    from tarshards.read.indexed import IndexedDataset

    path = str(tmp_path / name)
    with open(path, "wb") as f:
        f.write(raw)
    manifest = _ra_build(str(tmp_path), path)
    seq, err = _ra_sequential(path)
    assert err is None
    with IndexedDataset(manifest) as ds:
        _ra_check_equal(ds, seq, name)
    return seq


def test_random_access_reads_a_size_field_with_a_trailing_space(tmp_path):
    """A size field of octal digits, a space and a NUL ("0000000003 \\0"): the reader takes it
    (tarfile and GNU tar too); ds[i] said "the member's size is not the index's"."""
    raw = bytearray(_ra_tar([("a.txt", b"abc"), ("b.txt", b"de")]))
    raw[124:136] = b"0000000003 \0"
    seq = _ra_random_access_equals_sequential(tmp_path, bytes(_fix_block(raw, 0)))
    assert [s["txt"] for s in seq] == [b"abc", b"de"]


def _fix_block(raw: bytearray, off: int) -> bytearray:
    raw[off : off + 512] = _fix(bytearray(raw[off : off + 512]))
    return raw


def test_random_access_under_a_pax_global_size(tmp_path):
    """A pax global header with size= sets every later member's size (GNU tar and the reader
    apply it; no header of the member says so): the index marks those samples, and ds[i] no
    longer refuses them as "the member's size is not the index's"."""
    raw = _ra_tar([("a.txt", b""), ("b.txt", b"")])
    raw = _pax_block({"size": "3"}, tarfile.XGLTYPE) + raw
    seq = _ra_random_access_equals_sequential(tmp_path, raw)
    assert [s["__key__"] for s in seq] == ["a"]  # 3 bytes of a.txt's data: b's header
    from tarshards.format.index import FLAG_GLOBAL_SIZE, index_stream

    assert int(index_stream(io.BytesIO(raw)).sample_flags[0]) & FLAG_GLOBAL_SIZE


def test_index_refuses_a_repeated_field_as_the_reader_does(tmp_path):
    """Two members "k.txt" in a row (or "k.txt", "k.TXT"): the sequential read raises
    DuplicateFieldError there; indexing used to list the sample, and ds[i] handed out one of
    the two. Now indexing raises the reader's error, naming shard, member and offset."""
    from tarshards.errors import DuplicateFieldError

    for second in ("k.txt", "k.TXT"):
        path = tmp_path / f"dup-{second}.tar"
        path.write_bytes(_ra_tar([("j.txt", b"0"), ("k.txt", b"1"), (second, b"2")]))
        _, err = _ra_sequential(str(path))
        assert isinstance(err, DuplicateFieldError)
        with pytest.raises(DuplicateFieldError, match="repeated extension 'txt'") as got:
            _ra_build(str(tmp_path), str(path))
        assert got.value.url == str(path)
        assert got.value.member == second and got.value.offset == err.offset == 2048


@pytest.mark.skipif(
    importlib.util.find_spec("indexed_gzip") is None, reason="needs indexed_gzip (the seek extra)"
)
def test_random_access_of_a_damaged_tgz_raises_a_tarshards_error(tmp_path):
    """A .tgz (one gzip stream) damaged after indexing: indexed_gzip's ZranError / OSError came
    out of ds[i] as is; now a CompressionError naming the shard."""
    from tarshards.errors import CompressionError
    from tarshards.read.indexed import IndexedDataset

    path = tmp_path / "t.tar.gz"
    path.write_bytes(gzip.compress(_ra_tar([("a.txt", b"x" * 3000), ("b.txt", b"y")]), mtime=0))
    manifest = _ra_build(str(tmp_path), str(path))
    path.write_bytes(path.read_bytes()[:12])
    with IndexedDataset(manifest) as ds, pytest.raises(CompressionError) as got:
        ds[1]
    assert got.value.url == str(path)
