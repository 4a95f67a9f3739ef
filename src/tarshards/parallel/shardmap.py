"""``map_shards`` and ``map_shard_files``: a job per shard, run on an engine.

The steps, in order: pair the input and output specs (:func:`_pairs`); skip the outputs that exist
(reruns do only the rest); run the jobs on the engine (:mod:`tarshards.parallel.engines`), each
writing its output atomically (:mod:`tarshards.parallel.jobs`); remove temporary files that dead
attempts left; warn about failed shards; return one :class:`ShardReport` per shard, in order.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Callable

from ..errors import TarshardsWarning
from ..format.manifest import spec_urls
from ..on_error import OnError, error_policy
from ..read.specs import expand_urls
from ..storage import filesystem, is_local, local_path, remove_stale_temporaries
from .engines import Engine, make_engine
from .jobs import FileShardJob, SampleShardJob
from .reports import DONE, FAILED, SKIPPED, ShardReport

__all__ = ["map_shard_files", "map_shards"]


def _exists(url: str, storage_options) -> bool:
    if is_local(url):
        return os.path.exists(local_path(url))
    fs, path = filesystem(url, storage_options)
    return fs.exists(path)


def _pairs(inputs, outputs, storage_options) -> list[tuple[str, str]]:
    ins = spec_urls(inputs, storage_options=storage_options)  # a manifest names its shards
    outs = expand_urls(outputs, storage_options=storage_options)
    if not ins:
        raise ValueError(f"the input spec {inputs!r} names no shards")
    if len(ins) != len(outs):
        raise ValueError(
            f"{len(ins)} input shards but {len(outs)} output shards; the specs must "
            "name the same number"
        )
    if len(set(outs)) != len(outs):
        raise ValueError("the output spec names the same shard more than once")
    return list(zip(ins, outs))


def map_shards(
    fn: Callable,
    inputs,
    outputs,
    *,
    engine: str | Engine = "processes",
    workers: int | None = None,
    address: str | None = None,
    retries: int = 2,
    overwrite: bool = False,
    decode=None,
    on_error: OnError = "raise",
    handler: Callable | None = None,
    encoder: bool = True,
    compress=None,
    storage_options: dict | None = None,
    allow_pipe: bool = False,
    progress: bool | None = None,
    client=None,
    mp_context=None,
    manifest=None,
    aligned: bool = False,
) -> list[ShardReport]:
    """Apply ``fn(sample) -> sample | None | list of samples`` to every sample of each input shard
    and write the results to the matching output shard.

    ``manifest=PATH``: record each output's index while writing it and write the manifest of
    the outputs (outputs skipped because they existed are indexed by reading them).
    ``aligned=True``: compressed outputs get sample-aligned compression (random access).

    ``inputs`` and ``outputs`` are shard specs (``"in-{0000..0999}.tar"``) or lists naming the same
    number of shards; outputs are any URL the library writes (local, ``s3://``...). Samples are
    read as raw bytes (``__key__``, ``__url__``, one bytes field per extension) or decoded with
    ``decode`` (``"pil"``, or a list of decode handlers, see
    :func:`tarshards.pipeline.stages.decode`);
    results are encoded by extension unless ``encoder=False``.

    Each output appears under its final name only when complete. Outputs that already exist are
    skipped unless ``overwrite=True``. Errors in ``fn`` or in the data go to ``on_error`` (the
    default fails the shard; ``"warn"`` skips samples with data errors, ``warn_and_continue`` any
    failing sample; ``handler=`` is the older name). A shard whose worker died or
    that hit an I/O error is tried again up to ``retries`` times. A failed shard does not stop the
    others; a warning names the failures. Returns one :class:`ShardReport` per shard, in order.

    ``engine="processes"`` uses ``workers`` local processes (default: one per CPU).
    ``engine="dask"`` submits one task per shard to ``client``, to the cluster at ``address``, or
    to a ``LocalCluster`` of ``workers`` single-threaded processes started for the job.
    ``engine="ray"`` submits one task per shard to the Ray cluster this process is connected to,
    to the one at ``address``, or to a local one of ``workers`` CPUs started for the job. An
    :class:`~tarshards.parallel.engines.Engine` object may be given instead of a name.
    ``progress`` shows a bar over shards (default: when stderr is a terminal).
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, not {fn!r}")
    runner = make_engine(
        engine,
        workers=workers,
        address=address,
        client=client,
        retries=retries,
        mp_context=mp_context,
    )
    job = SampleShardJob(
        fn,
        decode=decode,
        on_error=error_policy(on_error, handler),
        encoder=encoder,
        storage_options=storage_options,
        compress=compress,
        allow_pipe=allow_pipe,
        record=manifest is not None,
        aligned=aligned,
    )
    pairs = _pairs(inputs, outputs, storage_options)
    reports = _run_shard_jobs(
        job, pairs, runner, overwrite=overwrite, storage_options=storage_options, progress=progress
    )
    if manifest is not None:
        _write_manifest(reports, manifest, storage_options)
    return reports


def _write_manifest(reports, path, storage_options) -> None:
    """The manifest of the outputs that exist (done, or skipped because they existed)."""
    from ..format.index import ShardIndex, index_url
    from ..format.manifest import ManifestRecorder

    with ManifestRecorder(path, storage_options=storage_options) as recorder:
        for r in reports:
            if r.status == DONE and r.index is not None:
                recorder.add(r.output, ShardIndex.from_bytes(r.index, url=r.output))
            elif r.status == SKIPPED:
                recorder.add(r.output, index_url(r.output, storage_options=storage_options))
        recorder.save()


def map_shard_files(
    fn: Callable,
    pairs,
    *,
    engine: str | Engine = "processes",
    workers: int | None = None,
    address: str | None = None,
    retries: int = 2,
    overwrite: bool = False,
    storage_options: dict | None = None,
    progress: bool | None = None,
    client=None,
    mp_context=None,
    warn_kept: bool = True,
    warn_failed: bool = True,
) -> list[ShardReport]:
    """Run ``fn(input_url, output_url)`` for each pair, on the same engines as :func:`map_shards`.

    ``fn`` writes the output itself (use :class:`~tarshards.write.writer.TarWriter` so that it
    appears only when complete); it may return the number of samples written, or a dict with
    ``samples_in`` and ``samples_out``. Existing outputs are skipped unless ``overwrite=True``,
    with a warning that says so (``warn_kept=False``: a caller that checks itself that the kept
    outputs are what its run would make, as :func:`tarshards.convert` does by its plan).
    Failed shards are reported (``ShardReport.status == FAILED``) with a warning
    (``warn_failed=False``: a caller that raises on them itself).
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, not {fn!r}")
    runner = make_engine(
        engine,
        workers=workers,
        address=address,
        client=client,
        retries=retries,
        mp_context=mp_context,
    )
    pairs = [(os.fspath(i), os.fspath(o)) for i, o in pairs]
    return _run_shard_jobs(
        FileShardJob(fn),
        pairs,
        runner,
        overwrite=overwrite,
        storage_options=storage_options,
        progress=progress,
        cleanup=False,
        warn_kept=warn_kept,
        warn_failed=warn_failed,
    )


def _run_shard_jobs(
    job,
    pairs,
    engine: Engine,
    *,
    overwrite,
    storage_options,
    progress,
    cleanup=True,
    warn_kept=True,
    warn_failed=True,
) -> list[ShardReport]:
    """Skip the outputs that exist, run the rest on ``engine``, report every pair in order."""
    reports: list[ShardReport | None] = [None] * len(pairs)
    todo = []
    for i, (inp, out) in enumerate(pairs):
        if not overwrite and _exists(out, storage_options):
            reports[i] = ShardReport(inp, out, status=SKIPPED)
        else:
            todo.append(i)
    bar = _progress_bar(len(pairs), len(pairs) - len(todo), progress)
    try:

        def finished(i, report):
            reports[i] = report
            if bar is not None:
                bar.update(1)
                if report.status == FAILED:
                    bar.write(f"failed: {report.input}: {report.error}", file=sys.stderr)

        if todo:
            engine.run(job, pairs, todo, finished)
    finally:
        if bar is not None:
            bar.close()
        if cleanup:
            _remove_stale_temps([pairs[i][1] for i in todo])
    done = [r for r in reports if r is not None]
    if len(done) != len(pairs):
        raise RuntimeError(
            f"internal error: the {engine.name} engine reported {len(done)} of {len(pairs)} shards"
        )
    kept = [r for r in done if r.status == SKIPPED]
    if kept and warn_kept:
        names = ", ".join(r.output for r in kept[:3]) + (" ..." if len(kept) > 3 else "")
        warnings.warn(
            f"{len(kept)} of {len(pairs)} outputs exist already and were kept, not made again "
            f"({names}): a rerun makes only the missing ones, so a changed function or "
            "options do not reach them. To redo them, pass overwrite=True (tarshards map "
            "--overwrite) or remove them first",
            TarshardsWarning,
            stacklevel=3,
        )
    failed = [r for r in done if r.status == FAILED]
    if failed and warn_failed:
        warnings.warn(
            f"{len(failed)} of {len(pairs)} shards failed; first: {failed[0].input}: "
            f"{failed[0].error}",
            TarshardsWarning,
            stacklevel=3,
        )
    return done


def _progress_bar(total, initial, progress):
    if progress is None:
        progress = hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="shard", file=sys.stderr, dynamic_ncols=True)


def _remove_stale_temps(outputs) -> int:
    """Remove temporary files left beside local ``outputs`` by attempts whose worker died."""
    dirs = {
        os.path.dirname(os.path.abspath(local_path(out)))
        for out in outputs
        if is_local(out) and out != "-"
    }
    return sum(len(remove_stale_temporaries(d)) for d in sorted(dirs))
