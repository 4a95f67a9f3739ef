"""Writing a source's rows as shards: a fixed plan, one atomic job per shard, then the manifest.

The plan: rows are taken in the source's order and cut into shards of at most ``maxcount`` rows
and, with ``maxsize``, about that many bytes (the sizes the source lists: exact for files,
estimates for tables), so shard ``k`` holds a fixed range of rows. The plan's fingerprint (the
source's listing, the member plan, the ranges, the output's names and compression) is saved
beside the manifest (``MANIFEST.convert``) before anything is written.

Each shard is one job, run on the processes, Dask or Ray engine of :mod:`tarshards.parallel`
(or in this process, with one worker): it writes its rows with a
:class:`~tarshards.write.writer.TarWriter` to a temporary name, commits it under its final name when
complete, and saves its index beside it (with ``meta=``, the per-sample metadata columns
computed from the rows it wrote). A rerun after a kill finds the plan, checks that it is the
same, skips the shards that exist and writes the others; temporaries of dead writers are
removed. Then the manifest is assembled from the shards' indexes, each checked to hold its
planned number of samples.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from dataclasses import dataclass

from ..errors import IntegrityError, ShardWriteError
from ..format.manifest import Manifest, ManifestRecorder, index_path_for, relative_url, resolve_url
from ..format.names import parse_size
from ..parallel import FAILED, map_shard_files
from ..storage import AtomicOutput, filesystem, is_local, local_path, open_url
from ..write.writer import TarWriter, meta_functions, meta_row, meta_table, shard_name
from .sources import Source

__all__ = ["WriteOptions", "assign_rows", "output_layout", "write_shards"]

PLAN_FORMAT = "tarshards.convert-plan"
PLAN_SUFFIX = ".convert"


@dataclass(frozen=True)
class WriteOptions:
    """How shards are written: ``maxcount`` samples at most, and about ``maxsize`` bytes each
    (None: no limit by size), ``compress`` (``gz``, ``zst``...; None: by the name's suffix),
    ``aligned`` (each sample its own compressed frame, for random access), ``level``
    (compression level)."""

    maxcount: int = 10_000
    maxsize: int | float | str | None = None  # bytes once made (a size string is parsed)
    compress: str | None = None
    aligned: bool = False
    level: int | None = None

    def __post_init__(self):
        if not isinstance(self.maxcount, int) or self.maxcount < 1:
            raise ValueError(f"maxcount must be an int >= 1, got {self.maxcount!r}")
        if self.maxsize is not None:
            object.__setattr__(self, "maxsize", parse_size(self.maxsize, positive=True))


def assign_rows(sizes: list[int] | int, maxcount: int, maxsize: int | None) -> list[int]:
    """Shard boundaries ``[0, b1, ..., n]``: shard ``k`` gets rows ``[b[k], b[k+1])``.

    By count, shards are full (``maxcount`` rows) but the last. By size, the rows are cut into
    as few shards as ``maxsize`` allows, of about equal bytes (so that workers get equal work:
    80 MB with ``maxsize`` 64 MB is two shards of 40 MB, not 64 and 16), each still at most
    ``maxcount`` rows; a row larger than ``maxsize`` gets a shard of its own. Each row counts
    1 kB more than its size (the headers and padding of its members, about). ``sizes`` may be
    just the number of rows (sizes not measured), with ``maxsize=None``."""
    if isinstance(sizes, int) or maxsize is None:
        n = sizes if isinstance(sizes, int) else len(sizes)
        return list(range(0, n, maxcount)) + [n] if n else [0]
    n = len(sizes)
    if n == 0:
        return [0]
    weights = [s + 1024 for s in sizes]
    greedy = [0]
    count = total = 0
    for i, w in enumerate(weights):
        if count and (count + 1 > maxcount or total + w > maxsize):
            greedy.append(i)
            count = total = 0
        count += 1
        total += w
    greedy.append(n)
    k = len(greedy) - 1
    if k == 1 or -(-n // maxcount) >= k:  # bound by count (or one shard): full shards
        return greedy
    # bound by size: k shards of about total/k bytes each
    whole = sum(weights)
    bounds = [0]
    acc = 0
    for i, w in enumerate(weights):
        if len(bounds) < k and acc + w / 2 > whole * len(bounds) / k and i > bounds[-1]:
            bounds.append(i)
        acc += w
    bounds.append(n)
    shards = list(itertools.pairwise(bounds))
    ok = len(bounds) == k + 1 and all(
        b - a <= maxcount and (b - a == 1 or sum(weights[a:b]) <= maxsize) for a, b in shards
    )
    return bounds if ok else greedy


def output_layout(
    output, manifest=None, *, compress: str | None = None, prefix: str = "shard"
) -> tuple[str, str]:
    """``(shard pattern, manifest path)`` for an output: a pattern (``out/train-%06d.tar``, the
    manifest then ``out/train.json`` unless given), or a folder (``OUT/shard-000000.tar``...,
    the manifest ``OUT/manifest.json``)."""
    output = os.fspath(output)
    if "%" in output or "{" in output:
        pattern = output
        if manifest is None:
            head, tail = output.rsplit("/", 1) if "/" in output else ("", output)
            stem = tail.split("%", 1)[0].split("{", 1)[0].rstrip("-_.") or "manifest"
            manifest = f"{head}/{stem}.json" if head else f"{stem}.json"
    else:
        from ..format.compression import by_name

        comp = by_name(compress) if compress else None
        suffix = comp.suffix if comp is not None else ".tar"
        pattern = output.rstrip("/") + f"/{prefix}-%06d{suffix}"
        if manifest is None:
            manifest = output.rstrip("/") + "/manifest.json"
    shard_name(pattern, 0)  # a pattern with no place for the number fails here
    return pattern, os.fspath(manifest)


def _exists(url: str, storage_options) -> bool:
    if is_local(url):
        return os.path.exists(local_path(url))
    fs, path = filesystem(url, storage_options)
    return fs.exists(path)


class ConvertJob:
    """Write shard ``k`` of a plan: ``job(str(k), url) -> samples written`` (pickled to the
    worker processes; :func:`tarshards.parallel.map_shard_files` runs it)."""

    def __init__(
        self,
        source: Source,
        bounds,
        index_urls,
        options: WriteOptions,
        storage_options,
        meta=(),
    ):
        self.source = source
        self.bounds = list(bounds)
        self.index_urls = list(index_urls)
        self.options = options
        self.storage_options = storage_options
        self.meta = list(meta)  # [(name or None, fn)], as ShardWriter(meta=) takes them

    def __call__(self, inp: str, out: str) -> int:
        k = int(inp)
        start, stop = self.bounds[k], self.bounds[k + 1]
        opts = self.options
        meta, rows = self.meta, []
        with TarWriter(
            out,
            encoder=False,
            compress=opts.compress,
            level=opts.level,
            aligned=opts.aligned,
            # with meta, the index is saved below, once its columns are added
            index=True if meta else self.index_urls[k],
            storage_options=self.storage_options,
        ) as sink:
            write = sink.write_members
            for key, members in self.source.samples(start, stop):
                write([(f"{key}.{ext}", data) for ext, data in members], key)
                if meta:
                    rows.append(meta_row(meta, {"__key__": key, **dict(members)}))
        if sink.count != stop - start:
            raise IntegrityError(
                f"the source gave {sink.count} rows for shard {k}, not {stop - start}", url=out
            )
        if meta and sink.index is not None:
            idx = sink.index.with_meta(meta_table(rows))
            idx.save(self.index_urls[k], storage_options=self.storage_options)
        return sink.count


class InlineEngine:
    """Runs the shard jobs one after another in this process (``workers=1``): no process to
    start, no pickling of the source."""

    name = "inline"

    def run(self, job, pairs, todo, finished) -> None:
        for i in todo:
            finished(i, job(*pairs[i]))


def _meta_names(meta) -> list[str]:
    """What the plan records of ``meta=``: each column's name, or for a function returning
    several, its qualified name (``tarshards.media.probe.MediaMeta``)."""
    out = []
    for name, fn in meta:
        if name is None:
            named = fn if hasattr(fn, "__qualname__") else type(fn)
            name = f"{getattr(named, '__module__', '')}.{named.__qualname__}"
        out.append(name)
    return out


def _plan_record(
    source: Source, bounds, urls, pattern, options: WriteOptions, info, meta=()
) -> dict:
    what = {
        "source": source.identity(),
        "bounds": bounds,
        "pattern": pattern,
        "compress": options.compress,
        "maxcount": options.maxcount,
        "maxsize": options.maxsize,
        "aligned": options.aligned,
    }
    if meta:  # (only then: the plans of conversions without meta= keep their fingerprint)
        what["meta"] = _meta_names(meta)
    digest = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()
    return {
        "format": PLAN_FORMAT,
        "version": 1,
        "fingerprint": f"sha256:{digest}",
        "kind": source.kind,
        "rows": bounds[-1],
        "shards": len(urls),
        "info": info,
    }


def _check_plan(plan: dict, plan_url: str, urls, overwrite: bool, storage_options) -> None:
    """A rerun continues only the same conversion; a fresh one does not take over shards that
    something else wrote."""
    if overwrite:
        return
    if _exists(plan_url, storage_options):
        with open_url(plan_url, storage_options=storage_options) as f:
            try:
                old = json.loads(f.read())
            except ValueError:
                old = {}
        if old.get("fingerprint") != plan["fingerprint"]:
            raise ValueError(
                f"the output holds a conversion of other data or with other options "
                f"({plan_url}); convert into another output, or pass overwrite=True "
                "(--overwrite) to write every shard again"
            )
        return
    taken = [u for u in urls if _exists(u, storage_options)]
    if taken:
        raise ValueError(
            f"{len(taken)} of the output's shards exist but no conversion plan describes them "
            f"(first: {taken[0]}); convert into another output, or pass overwrite=True "
            "(--overwrite)"
        )


def write_shards(
    source: Source,
    output,
    *,
    manifest=None,
    options: WriteOptions = WriteOptions(),
    info: dict | None = None,
    prefix: str = "shard",
    engine="processes",
    workers: int | None = None,
    address: str | None = None,
    client=None,
    retries: int = 2,
    overwrite: bool = False,
    progress: bool | None = None,
    storage_options: dict | None = None,
    meta=None,
) -> Manifest:
    """Write ``source`` as shards with indexes and a manifest; resumable (module docstring).

    ``meta``: per-sample metadata columns for the shards' indexes, as ``ShardWriter(meta=)``
    takes them (``{"tokens": fn}``, or ``tarshards.media_meta()``), each function applied to
    the sample as a reader gives it before decoding (``{"__key__": key, ext: bytes}``)."""
    meta_fns = meta_functions(meta)
    pattern, manifest_url = output_layout(
        output, manifest, compress=options.compress, prefix=prefix
    )
    if options.compress is None and options.aligned:
        from ..format.compression import is_compressed_name

        if not is_compressed_name(pattern):
            raise ValueError("aligned=True is for compressed shards: give compress= or a suffix")
    n = source.count()
    if n == 0:
        raise ValueError("the source has no rows")
    sizes = source.sizes() if options.maxsize is not None else None
    if options.maxsize is not None and sizes is None:
        raise ValueError("this source was listed without sizes; maxsize= needs them")
    maxsize = None if options.maxsize is None else int(options.maxsize)
    bounds = assign_rows(n if sizes is None else sizes, options.maxcount, maxsize)
    urls = [shard_name(pattern, k) for k in range(len(bounds) - 1)]
    if is_local(manifest_url):
        os.makedirs(os.path.dirname(os.path.abspath(local_path(manifest_url))), exist_ok=True)
    base = Manifest((), url=manifest_url).base
    for folder in {os.path.dirname(os.path.abspath(local_path(u))) for u in urls if is_local(u)}:
        os.makedirs(folder, exist_ok=True)
    index_urls = [resolve_url(index_path_for(relative_url(u, base)), base) for u in urls]
    full_info = {**source.info(), **(info or {})}
    plan = _plan_record(source, bounds, urls, pattern, options, full_info, meta_fns)
    plan_url = manifest_url + PLAN_SUFFIX
    _check_plan(plan, plan_url, urls, overwrite, storage_options)
    with AtomicOutput(plan_url, storage_options=storage_options) as out:
        out.stream.write((json.dumps(plan, indent=1) + "\n").encode())

    job = ConvertJob(source, bounds, index_urls, options, storage_options, meta_fns)
    if engine == "processes" and workers == 1 and address is None and client is None:
        engine = InlineEngine()
    reports = map_shard_files(
        job,
        [(str(k), u) for k, u in enumerate(urls)],
        engine=engine,
        workers=workers,
        address=address,
        client=client,
        retries=retries,
        overwrite=overwrite,
        storage_options=storage_options,
        progress=progress,
        warn_kept=False,  # the plan check above refused a rerun with other sources or options
        warn_failed=False,  # raised below, naming the shards
    )
    failed = [r for r in reports if r.status == FAILED]
    if failed:
        raise ShardWriteError(
            f"{len(failed)} of {len(urls)} shards failed (rerun to write only those); "
            f"first: {failed[0].error}",
            url=failed[0].output,
        )
    return _assemble(job, urls, manifest_url, full_info)


def _assemble(job: ConvertJob, urls, manifest_url, info) -> Manifest:
    """The manifest from the shards' indexes (an index missing, as after a kill between a
    shard's commit and its index's, is made by reading the shard, its metadata columns from the
    source's rows)."""
    from ..format.index import ShardIndex, index_url

    storage_options, bounds = job.storage_options, job.bounds
    with ManifestRecorder(manifest_url, storage_options=storage_options, info=info) as rec:
        for k, (url, iurl) in enumerate(zip(urls, job.index_urls)):
            want = bounds[k + 1] - bounds[k]
            if _exists(iurl, storage_options):
                idx = ShardIndex.load(iurl, storage_options=storage_options)
            else:
                idx = index_url(url, storage_options=storage_options)
                if job.meta and idx.num_samples == want:
                    rows = [
                        meta_row(job.meta, {"__key__": key, **dict(members)})
                        for key, members in job.source.samples(bounds[k], bounds[k + 1])
                    ]
                    idx = idx.with_meta(meta_table(rows))
                idx.save(iurl, storage_options=storage_options)
            if idx.num_samples != want:
                raise IntegrityError(
                    f"the shard holds {idx.num_samples} samples; the conversion planned {want} "
                    "(written by something else? rerun with overwrite=True)",
                    url=url,
                )
            rec.add(url, idx, save_index=False)
        return rec.save()
