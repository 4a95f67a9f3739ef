"""``tarsort``: sort or shuffle the samples of a dataset, out of core.

Samples go into a temporary SQLite database on disk (one row each: sort key, input position, the
members packed as bytes); an index on (sort key, position) then gives the output order. Memory use
is bounded by SQLite's page cache, whatever the size of the dataset; the disk needs room for one
copy of it. Ties keep input order, so the sort is stable.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import struct
import tempfile
from typing import Iterable, Iterator

import click

from ..errors import DecodeError
from ..plan.shards import make_rng
from ..write.writer import TarWriter
from ._common import (
    CONTEXT_SETTINGS,
    Progress,
    check_stdout_not_tty,
    collect_inputs,
    examples,
    handle_errors,
    inputs_argument,
    members_of,
    on_error_option,
    output_dest,
    output_option,
    quiet_option,
    read_samples,
)

__all__ = ["pack_members", "sort_cmd", "sorted_samples", "unpack_members"]

_LEN = struct.Struct("<IQ")


def pack_members(members: list[tuple[str, bytes]]) -> bytes:
    parts = []
    for name, data in members:
        raw = name.encode("utf-8", "surrogateescape")
        parts.append(_LEN.pack(len(raw), len(data)))
        parts.append(raw)
        parts.append(data)
    return b"".join(parts)


def unpack_members(blob: bytes) -> list[tuple[str, bytes]]:
    out = []
    pos = 0
    view = memoryview(blob)
    while pos < len(blob):
        nlen, dlen = _LEN.unpack_from(blob, pos)
        pos += _LEN.size
        name = bytes(view[pos : pos + nlen]).decode("utf-8", "surrogateescape")
        pos += nlen
        out.append((name, bytes(view[pos : pos + dlen])))
        pos += dlen
    return out


def _sort_value(sample: dict, field: str | None, numeric: bool):
    if field is None:
        value = sample["__key__"]
    else:
        data = sample.get(field)
        if data is None:
            raise DecodeError(
                f"sample has no field {field!r} to sort by",
                url=sample.get("__url__"),
                member=sample["__key__"],
            )
        try:
            value = data.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise DecodeError(
                f"field {field!r} is not text, cannot sort by it",
                url=sample.get("__url__"),
                member=f"{sample['__key__']}.{field}",
            ) from None
    if numeric:
        try:
            return float(value)
        except ValueError:
            raise DecodeError(
                f"{value[:40]!r} is not a number (-n/--numeric)",
                url=sample.get("__url__"),
                member=sample["__key__"] if field is None else f"{sample['__key__']}.{field}",
            ) from None
    return value


def sorted_samples(
    samples: Iterable[dict],
    *,
    field: str | None = None,
    numeric: bool = False,
    shuffle: bool = False,
    seed: int = 0,
    reverse: bool = False,
    tmpdir: str | None = None,
    cache_mb: int = 64,
    progress: Progress | None = None,
) -> Iterator[list[tuple[str, bytes]]]:
    """Yield the members of each sample (lists of ``(name, bytes)``) in sorted order."""
    rng = make_rng("tarsort", seed) if shuffle else None
    with tempfile.TemporaryDirectory(prefix="tarsort-", dir=tmpdir) as d:
        db = sqlite3.connect(os.path.join(d, "samples.db"))
        with contextlib.closing(db):
            db.execute("PRAGMA journal_mode=OFF")
            db.execute("PRAGMA synchronous=OFF")
            db.execute("PRAGMA temp_store=FILE")
            db.execute(f"PRAGMA cache_size=-{int(cache_mb) * 1024}")
            db.execute("CREATE TABLE s (seq INTEGER PRIMARY KEY, k, data BLOB)")
            batch = []
            for seq, sample in enumerate(samples):
                if rng is not None:
                    k = rng.random()
                else:
                    k = _sort_value(sample, field, numeric)
                batch.append((seq, k, pack_members(members_of(sample))))
                if progress is not None:
                    progress.update()
                if len(batch) >= 256:
                    db.executemany("INSERT INTO s VALUES (?, ?, ?)", batch)
                    batch.clear()
            if batch:
                db.executemany("INSERT INTO s VALUES (?, ?, ?)", batch)
            db.commit()
            # sort (key, position) pairs only (SQLite's sorter spills to disk), then fetch each
            # sample by its primary key; ties keep input order, also with reverse
            order = "DESC" if reverse else "ASC"
            keys = db.execute(f"SELECT seq FROM s ORDER BY k {order}, seq ASC")
            fetch = db.cursor()
            for (seq,) in keys:
                (blob,) = fetch.execute("SELECT data FROM s WHERE seq = ?", (seq,)).fetchone()
                yield unpack_members(blob)


@click.command(
    "sort",
    context_settings=CONTEXT_SETTINGS,
    epilog=examples(
        "tarsort in.tar > by-key.tar",
        "tarsort -k cls -n 'train-{0000..0009}.tar' -o by-class.tar",
        "tarsort --shuffle --seed 7 in.tar | tarsplit -n 1000 -o shuffled",
    ),
)
@inputs_argument
@click.option(
    "-k", "--field", default=None, metavar="EXT", help="Sort by this text field (default: the key)."
)
@click.option("-n", "--numeric", is_flag=True, help="Compare sort values as numbers.")
@click.option("-r", "--reverse", is_flag=True, help="Largest first.")
@click.option(
    "--shuffle", is_flag=True, help="Shuffle instead of sorting (all samples, uniformly)."
)
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed for --shuffle.")
@output_option()
@click.option("--tmpdir", default=None, metavar="DIR", help="Where the temporary database goes.")
@click.option(
    "--cache-mb",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="SQLite cache size (memory bound).",
)
@on_error_option()
@quiet_option()
@handle_errors
def sort_cmd(
    inputs: tuple[str, ...],
    field: str | None,
    numeric: bool,
    reverse: bool,
    shuffle: bool,
    seed: int,
    output: str,
    tmpdir: str | None,
    cache_mb: int,
    on_error: str,
    quiet: bool,
) -> None:
    """Sort the samples of INPUTS by key or by a field, or shuffle them, out of core."""
    if field is not None and (not field.strip() or field.startswith("__")):
        raise click.BadParameter(
            f"{field!r} is not a field name (an extension such as cls)",
            param_hint="'-k' / '--field'",
        )
    if shuffle and (field or numeric):
        raise click.UsageError("--shuffle does not take -k/--field or -n/--numeric")
    urls = collect_inputs(inputs)
    check_stdout_not_tty(output)
    samples = read_samples(urls, on_error)
    with Progress(quiet, "tarsort: reading") as bar:
        ordered = sorted_samples(
            samples,
            field=field,
            numeric=numeric,
            shuffle=shuffle,
            seed=seed,
            reverse=reverse,
            tmpdir=tmpdir,
            cache_mb=cache_mb,
            progress=bar,
        )
        with TarWriter(output_dest(output), encoder=False) as sink:
            for members in ordered:
                sink.write_members(members)
