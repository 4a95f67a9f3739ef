"""``tarcheck``: verify shards and count what is in them.

For every shard: it must be readable to its end (no bad header, no truncated member, an
end-of-archive marker), no key may be split across non-adjacent members, no sample may repeat an
extension. Counts of samples, members, bytes and extensions are printed as a table, problems as one
line each (shard, member, offset); the exit status is 1 when any problem was found.

Warnings do not change the exit status: a gzip, bzip2 or xz shard made of several members or
streams back to back (sample-aligned gzip as tarshards wrote it before the one-member layout,
``cat a.gz b.gz``, pbzip2) is read whole by tarshards, GNU tar and gzip, but Python's streaming
``tarfile`` (``r|*``: webdataset, Hugging Face ``datasets``, Ray) stops after the first one
without an error; the warning says how many samples those readers see and the command that
rewrites the shard as one stream.
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import click

from ..errors import TarshardsError
from ..format.compression import by_magic
from ..format.hashing import HashingReader, split_hash
from ..format.hashing import check_shard as verify_record
from ..format.names import split_name
from ..storage import open_url
from ..tario import decompressed_chunks, iter_tar, read_chunks
from ._common import (
    CONTEXT_SETTINGS,
    Progress,
    as_data_error,
    collect_inputs,
    examples,
    files_from_option,
    handle_errors,
    inputs_argument,
    print_err,
    quiet_option,
)

if TYPE_CHECKING:
    from ..format.manifest import ShardRecord

__all__ = ["ShardReport", "check_cmd", "check_shard"]


@dataclass
class ShardReport:
    url: str
    samples: int = 0
    members: int = 0
    skipped: int = 0  # members that are not sample fields (no extension, __meta__)
    data_bytes: int = 0
    stream_bytes: int = 0
    extensions: collections.Counter = field(default_factory=collections.Counter)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _counted(chunks, counter: list):
    for chunk in chunks:
        counter[0] += len(chunk)
        yield chunk


def _sniffed(chunks, head: list):
    for chunk in chunks:
        if not head:
            head.append(bytes(chunk[:8]))
        yield chunk


def _rewrite_hint(url: str, compression: str) -> str:
    name = url.rsplit("/", 1)[-1]
    stem = name.split(".", 1)[0]
    if compression == "gzip":
        return (
            f"tarsplit --aligned -z -n 1000000000 -s 1P -o '{stem}-new-%06d.tgz' {url} "
            "(sample-aligned, one gzip member; add --manifest PATH for its index), or "
            f"tarscat {url} -o {stem}-new.tgz (one plain gzip stream)"
        )
    suffix = {"bzip2": ".tar.bz2", "xz": ".tar.xz"}.get(compression, ".tar")
    return f"tarscat {url} -o {stem}-new{suffix}"


def _multi_member_warning(url: str, compression: str, frames: list, starts: list) -> str:
    """What Python's streaming tarfile sees of a shard of several members/streams."""
    first_end = frames[1][1]
    seen = sum(1 for offset in starts if offset < first_end)
    what = "gzip members" if compression == "gzip" else f"{compression} streams"
    return (
        f"{len(frames)} {what} back to back (shard {url}): tarshards, GNU tar and "
        f"{compression} read them all, but Python's streaming tarfile (webdataset, Hugging "
        f"Face datasets, Ray) stops after the first without an error and sees {seen} of "
        f"{len(starts)} samples; rewrite it as one stream: {_rewrite_hint(url, compression)}"
    )


def check_shard(
    url: str, *, max_problems: int = 20, expect: ShardRecord | None = None
) -> ShardReport:
    """Read one shard to its end and report what is in it and what is wrong with it.

    ``expect``: the shard's manifest record; its size, hash and sample count are checked too."""
    rep = ShardReport(url)
    seen: dict[str, int] = {}  # key -> offset of its first member, for finished samples
    key = None
    exts: set[str] = set()
    first_offset = 0
    last_end = 0
    total = [0]
    frames: list = []  # (compressed, decompressed offset) where each member/frame/stream starts
    head: list = []
    starts: list = []  # tar offset of each sample

    def problem(msg: str) -> None:
        if len(rep.problems) < max_problems:
            rep.problems.append(msg)

    try:
        with open_url(url) as stream:
            if expect is not None:
                stream = hashed = _hashing_reader(stream, expect)
            chunks = _counted(
                decompressed_chunks(
                    _sniffed(read_chunks(stream), head),
                    url,
                    on_frame=lambda c, d: frames.append((c, d)),
                ),
                total,
            )
            for name, data, offset in iter_tar(chunks, url):
                rep.members += 1
                rep.data_bytes += len(data)
                last_end = offset + 512 + ((len(data) + 511) & ~511)
                parts = split_name(name)
                if parts is None:
                    rep.skipped += 1
                    continue
                k, ext = parts
                if k != key:
                    if key is not None:
                        seen[key] = first_offset
                    if k in seen:
                        problem(
                            f"key {k!r} split across non-adjacent members: first sample at "
                            f"offset {seen[k]}, again at (shard {url}, member {name!r}, "
                            f"offset {offset})"
                        )
                    key, exts, first_offset = k, set(), offset
                    rep.samples += 1
                    starts.append(offset)
                if ext in exts:
                    problem(
                        f"repeated extension {ext!r} in sample {k!r} (shard {url}, "
                        f"member {name!r}, offset {offset})"
                    )
                exts.add(ext)
                rep.extensions[ext] += 1
            if expect is not None:
                hashed.finish()
        rep.stream_bytes = total[0]
        comp = by_magic(head[0]) if head else None
        if comp is not None and comp.name in ("gzip", "bzip2", "xz"):
            real = [f for f in frames if f[1] < total[0]]  # members that hold tar bytes
            if len(real) > 1 and starts:
                rep.warnings.append(_multi_member_warning(url, comp.name, real, starts))
        if rep.members and total[0] < last_end + 1024:
            problem(
                f"no end-of-archive marker: the shard may be truncated at a member "
                f"boundary (shard {url}, offset {total[0]})"
            )
        if expect is not None:
            try:
                verify_record(
                    url,
                    expected_hash=expect.hash,
                    expected_nbytes=expect.nbytes,
                    got_hash=hashed.digest,
                    got_nbytes=hashed.nbytes,
                    expected_samples=expect.samples,
                    got_samples=rep.samples,
                )
            except TarshardsError as exn:
                problem(str(exn))
        if rep.members == 0:
            problem(f"no members: empty shard (shard {url})")
        elif rep.samples == 0:
            problem(f"no samples: no member is named KEY.EXT (shard {url})")
    except TarshardsError as exn:
        rep.stream_bytes = total[0]
        problem(str(exn.with_context(url=url)))
    except OSError as exn:
        problem(f"read failed: {exn} (shard {url})")
    except (MemoryError, OverflowError) as exn:  # defensive: the reader should not let these out
        problem(str(as_data_error(exn, url)))
    return rep


def _manifest_index(manifest, i: int):
    return manifest.load_index(i) if manifest.shards[i].index else None


def _differing_members(url: str, index, most: int = 5) -> list[str]:
    """Where a shard differs from its index: the members whose data checksum (or name, or
    size) is not the index's, read again from the shard; at most ``most`` lines."""
    try:
        idx = index()
    except (TarshardsError, OSError):
        return []
    if idx is None:
        return []
    checksum = idx.checksum_fn()
    sums = idx.member_checksums.tolist()
    sizes = idx.member_sizes.tolist()
    names = [name for i in range(idx.num_samples) for name in idx.member_names(i)]
    out: list[str] = []
    n = 0
    try:
        with open_url(url) as stream:
            for n, (name, data, offset) in enumerate(
                iter_tar(decompressed_chunks(read_chunks(stream), url), url), 1
            ):
                i = n - 1
                if i >= len(sums):
                    out.append(f"member {name!r} (offset {offset}) is not in the index")
                elif name.lstrip("./") != names[i].lstrip("./") or len(data) != sizes[i]:
                    out.append(
                        f"member {name!r} (offset {offset}) is not the index's {names[i]!r} "
                        f"of {sizes[i]} bytes"
                    )
                elif checksum(data) != sums[i]:
                    out.append(
                        f"member {name!r} (offset {offset}): its data's checksum differs from "
                        f"the index's (shard {url})"
                    )
                if len(out) >= most:
                    break
    except (TarshardsError, OSError):
        pass
    if not out and n < len(sums):
        out.append(f"the shard ends after {n} of the index's {len(sums)} members (shard {url})")
    if not out:
        out.append(
            f"every member's data matches the index: the difference is in headers or padding "
            f"(shard {url})"
        )
    return out


def _hashing_reader(stream, expect):
    algorithm = split_hash(expect.hash)[0] if expect.hash else "crc32"
    return HashingReader(stream, algorithm)


def _human(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)  # pragma: no cover


def format_table(reports: list[ShardReport]) -> str:
    # payload: the members' data, without tar headers and padding (the file is larger)
    rows = [("shard", "samples", "members", "payload", "extensions", "status")]
    for r in reports:
        exts = " ".join(f"{e}:{n}" for e, n in sorted(r.extensions.items()))
        rows.append(
            (
                r.url,
                str(r.samples),
                str(r.members),
                _human(r.data_bytes),
                exts or "-",
                "ok" if r.ok else f"{len(r.problems)} problem(s)",
            )
        )
    if len(reports) > 1:
        tot: collections.Counter[str] = collections.Counter()
        for r in reports:
            tot.update(r.extensions)
        bad = sum(1 for r in reports if not r.ok)
        rows.append(
            (
                f"total ({len(reports)} shards)",
                str(sum(r.samples for r in reports)),
                str(sum(r.members for r in reports)),
                _human(sum(r.data_bytes for r in reports)),
                " ".join(f"{e}:{n}" for e, n in sorted(tot.items())) or "-",
                "ok" if not bad else f"{bad} bad shard(s)",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for j, row in enumerate(rows):
        cells = [
            c.ljust(w) if i in (0, 4, 5) else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


@click.command(
    "check",
    context_settings=CONTEXT_SETTINGS,
    epilog=examples(
        "tarcheck 'train-{0000..0147}.tar'", "tarcheck -q shards/*.tar && echo all good"
    ),
)
@inputs_argument
@files_from_option
@click.option(
    "--max-problems",
    type=click.IntRange(min=1),
    default=20,
    show_default=True,
    help="Problems listed per shard.",
)
@quiet_option("Only problems and the exit status; no table.")
@click.option(
    "--manifest",
    "manifest_url",
    default=None,
    metavar="MANIFEST",
    help="Check sizes, hashes, counts against MANIFEST.",
)
@handle_errors
def check_cmd(
    inputs: tuple[str, ...],
    listfile: str | None,
    max_problems: int,
    quiet: bool,
    manifest_url: str | None = None,
) -> None:
    """Verify shards: readable to the end, no truncated member, no split key, no repeated field.

    With --manifest, each shard's size, hash and sample count must be the manifest's too (its
    shards are checked when no INPUTS are given)."""
    expected = manifest = None
    positions: dict[str, int] = {}
    if manifest_url is None and len(inputs) == 1 and listfile is None:
        from ..format.manifest import is_manifest_spec

        if is_manifest_spec(inputs[0]):  # tarcheck M: its shards, checked against it
            manifest_url, inputs = inputs[0], ()
    if manifest_url is not None:
        from ..format.manifest import as_manifest

        # a view: its manifest's shards; column groups' shards too
        manifest = as_manifest(manifest_url).every_shard()
        expected = manifest.records_by_url()
        positions = {u: i for i, u in enumerate(manifest.shard_urls())}
        urls = (
            collect_inputs(inputs, listfile, exist=False)
            if (inputs or listfile)
            else manifest.shard_urls()
        )
    else:
        urls = collect_inputs(inputs, listfile, exist=False)  # a missing shard: a problem line
    reports = []
    with Progress(quiet, "tarcheck", unit="shards", total=len(urls)) as bar:
        for url in urls:
            expect = None
            if expected is not None:
                expect = expected.get(url)
                if expect is None:
                    rep = ShardReport(url, problems=[f"not in the manifest (shard {url})"])
                    reports.append(rep)
                    bar.update()
                    continue
            index = None
            if manifest is not None and url in positions:
                i = positions[url]
                index = functools.partial(_manifest_index, manifest, i)
            rep = check_shard(url, max_problems=max_problems, expect=expect)
            if index is not None and any("hash" in p for p in rep.problems):
                # where: the members whose checksum differs from the index's (read again)
                rep.problems.extend(_differing_members(url, index))
            reports.append(rep)
            bar.update()
    if not quiet:
        click.echo(format_table(reports))
    problems = [p for r in reports for p in r.problems]
    prog = click.get_current_context().command_path
    for r in reports:
        for w in r.warnings:
            print_err(f"{prog}: warning: {w}")
    for p in problems:
        print_err(f"{prog}: problem: {p}")
    if problems:
        bad = sum(1 for r in reports if not r.ok)
        print_err(f"{prog}: error: {bad} of {len(reports)} shard(s) have problems")
        click.get_current_context().exit(1)
