"""Mapping functions over samples and shards: local worker processes, or a Dask cluster.

* :func:`map_samples` applies ``fn`` to each sample of a dataset or iterable in worker processes and
  yields the results (in order, or as they finish). An exception in ``fn`` reaches the caller as a
  :class:`~tarshards.errors.TarshardsError` naming the sample key, or goes to ``handler``.
* :func:`map_shards` applies ``fn(sample) -> sample | None | list`` to every sample of each input
  shard and writes the matching output shard. Tasks are shards. Each output is written to a
  temporary name and committed when complete (:class:`~tarshards.writer.TarWriter`), outputs that
  exist are skipped (so a job that died can be rerun and does only the rest), and a shard whose
  worker process died, or that hit an I/O error, is tried again up to ``retries`` times.
* :func:`map_shard_files` runs ``fn(input_url, output_url)`` for functions that write themselves.

``engine="processes"`` runs on this machine; ``engine="dask"`` runs on a ``dask.distributed``
cluster: a ``LocalCluster`` started for the job, or the cluster at ``address``. Dask is imported
only when that engine is chosen.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator

from . import stages as _stages
from .errors import (
    CommandError,
    DuplicateFieldError,
    MissingDependencyError,
    TarshardsError,
    TarshardsWarning,
)
from .pipeline import shard_samples
from .stages import reraise_exception
from .urls import _fsspec_resolve, expand_urls, is_local, local_path
from .writer import TarWriter

__all__ = [
    "ShardReport",
    "ShellSampleFn",
    "format_summary",
    "map_samples",
    "map_shard_files",
    "map_shards",
    "shell_sample_fn",
    "summarize",
]

ENGINES = ("processes", "dask")
DONE, SKIPPED, FAILED = "done", "skipped", "failed"
_MAX_MESSAGES = 20

# ---------------------------------------------------------------------------------------------
# pickling functions for worker processes
# ---------------------------------------------------------------------------------------------


def _dumps(obj) -> bytes:
    """Pickle ``obj`` (a function and its options); lambdas and closures need cloudpickle."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        try:
            import cloudpickle
        except ImportError:
            raise TypeError(
                f"the function must be picklable to run in worker processes ({exc}); define it "
                "at module level, or install cloudpickle to send lambdas and closures") from None
        return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _portable_exception(exn: BaseException) -> BaseException:
    """``exn`` if it survives pickling, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(exn))
        return exn
    except Exception:
        return RuntimeError(f"{type(exn).__name__}: {exn}")


def _describe(exn: BaseException) -> str:
    """One line for a report: our errors as they are, others with their type; plus notes."""
    text = str(exn) if isinstance(exn, TarshardsError) else f"{type(exn).__name__}: {exn}"
    notes = getattr(exn, "__notes__", None)
    if notes:
        text += " (" + "; ".join(str(n) for n in notes) + ")"
    return text


def _remote_cause(exn: BaseException, tb: str | None) -> BaseException:
    if tb:
        from multiprocessing.pool import RemoteTraceback

        exn.__cause__ = RemoteTraceback(tb)
    return exn


# ---------------------------------------------------------------------------------------------
# a small process pool that knows which task a dead worker was running
# ---------------------------------------------------------------------------------------------


def _worker_main(conn, payload: bytes) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    fn = pickle.loads(payload)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        task_id, args = msg
        try:
            reply = (task_id, True, fn(*args), None)
        except Exception as exn:
            reply = (task_id, False, _portable_exception(exn), traceback.format_exc())
        try:
            conn.send(reply)
        except Exception as exn:  # a result that does not pickle
            conn.send((task_id, False, TypeError(f"result could not be sent back: {exn}"),
                       traceback.format_exc()))


class _Worker:
    __slots__ = ("process", "conn", "tasks")

    def __init__(self, process, conn):
        self.process = process
        self.conn = conn
        self.tasks: collections.deque = collections.deque()


class _ProcessPool:
    """``workers`` processes each running ``pickle.loads(payload)(*args)`` on the tasks sent.

    Unlike ``concurrent.futures``, a worker that dies loses only its own tasks: :meth:`events`
    reports them (``("died", task_ids, exitcode)``) and a fresh worker takes its place.
    """

    def __init__(self, workers: int, payload: bytes, mp_context=None):
        if isinstance(mp_context, str) or mp_context is None:
            mp_context = multiprocessing.get_context(mp_context)
        self._ctx = mp_context
        self._payload = payload
        self._workers: list[_Worker] = []
        self._closed = False
        for _ in range(workers):
            self._workers.append(self._start())

    def _start(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        p = self._ctx.Process(target=_worker_main, args=(child, self._payload),
                              name="tarshards-worker", daemon=False)
        p.start()
        child.close()
        return _Worker(p, parent)

    @property
    def load(self) -> int:
        return sum(len(w.tasks) for w in self._workers)

    def submit(self, task_id, args: tuple, per_worker: int = 1) -> bool:
        """Send a task to the least busy worker with fewer than ``per_worker`` tasks."""
        w = min(self._workers, key=lambda w: len(w.tasks))
        if len(w.tasks) >= per_worker:
            return False
        w.tasks.append(task_id)
        with contextlib.suppress(OSError):  # a dead worker: events() reports the task as lost
            w.conn.send((task_id, args))
        return True

    def events(self) -> list[tuple]:
        """Wait for results: ``("ok", id, value, None)``, ``("error", id, exn, tb)``, ``("died",
        ids, exitcode, None)``."""
        busy = [w for w in self._workers if w.tasks]
        if not busy:
            return []
        ready = multiprocessing.connection.wait(
            [w.conn for w in busy] + [w.process.sentinel for w in busy])
        out = []
        for i, w in enumerate(self._workers):
            if not w.tasks:
                continue
            if w.conn in ready or w.process.sentinel in ready:
                try:
                    while w.tasks and w.conn.poll():
                        task_id, ok, value, tb = w.conn.recv()
                        w.tasks.popleft()
                        out.append(("ok" if ok else "error", task_id, value, tb))
                except (EOFError, OSError):
                    pass
                if w.process.sentinel in ready or not w.process.is_alive():
                    w.process.join()
                    if w.tasks:
                        out.append(("died", list(w.tasks), w.process.exitcode, None))
                    with contextlib.suppress(OSError):
                        w.conn.close()
                    self._workers[i] = self._start()
        return out

    def close(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            with contextlib.suppress(OSError, ValueError):
                if w.tasks:
                    w.process.terminate()
                else:
                    w.conn.send(None)
        deadline = time.monotonic() + timeout
        for w in self._workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                w.process.terminate()
                w.process.join(1.0)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            with contextlib.suppress(OSError):
                w.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _default_workers(n) -> int:
    if n is None:
        return os.cpu_count() or 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"the number of worker processes must be an int >= 0, got {n!r}")
    return n


# ---------------------------------------------------------------------------------------------
# map_samples
# ---------------------------------------------------------------------------------------------


class _SampleOutcome:
    __slots__ = ("ok", "value", "tb")

    def __init__(self, ok, value, tb=None):
        self.ok = ok
        self.value = value
        self.tb = tb


def _apply_one(fn, sample):
    result = fn(sample)
    if isinstance(result, dict) and isinstance(sample, dict) and "__key__" in sample:
        result.setdefault("__key__", sample["__key__"])
    return result


class _ChunkRunner:
    """Worker side of :func:`map_samples`: apply ``fn`` to each sample of a chunk."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, samples: list) -> list[_SampleOutcome]:
        out = []
        for sample in samples:
            try:
                out.append(_SampleOutcome(True, _apply_one(self.fn, sample)))
            except Exception as exn:
                err = _stages._context(exn, sample)
                out.append(_SampleOutcome(False, _portable_exception(err),
                                          traceback.format_exc()))
        return out


def _sample_key(sample) -> str | None:
    return sample.get("__key__") if isinstance(sample, dict) else None


def map_samples(fn: Callable, source: Iterable, processes: int | None = None, *,
                ordered: bool = True, chunksize: int = 4, prefetch: int = 2,
                handler: Callable = reraise_exception, mp_context=None) -> Iterator:
    """Apply ``fn`` to each sample of ``source`` in ``processes`` worker processes.

    Yields ``fn(sample)`` for each sample, in the order of ``source`` (``ordered=True``) or as
    results arrive. ``None`` results are dropped and dict results keep the sample's ``__key__``,
    as in :func:`tarshards.stages.map`. ``processes=0`` runs in this process (no pickling);
    ``None`` uses one process per CPU. Samples go to the workers ``chunksize`` at a time, at most
    ``prefetch`` chunks per worker ahead, so memory stays bounded however long ``source`` is.

    An exception in ``fn`` becomes a :class:`~tarshards.errors.TarshardsError` naming the sample
    key and shard (the worker's traceback is its ``__cause__``) and goes to ``handler``: the
    default raises it, ``warn_and_continue`` skips the sample, a handler returning False ends the
    stream. A worker process that dies (a crash in native code) loses its chunk: those samples are
    tried again one by one and the one whose worker dies again is reported as an error.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, not {fn!r}")
    processes = _default_workers(processes)
    if chunksize < 1 or prefetch < 1:
        raise ValueError(f"chunksize and prefetch must be >= 1, got {chunksize}, {prefetch}")
    if processes == 0:
        return _stages.map(source, fn, handler=handler)
    return _map_samples_pool(fn, source, processes, ordered, chunksize, prefetch, handler,
                             mp_context)


def _map_samples_pool(fn, source, processes, ordered, chunksize, prefetch, handler,
                      mp_context):
    payload = _dumps(_ChunkRunner(fn))
    it = iter(source)
    # chunk id -> [samples, outcomes (list of _SampleOutcome | None), missing count]
    chunks: dict[int, list] = {}
    next_chunk = 0
    next_emit = 0
    exhausted = False
    window = processes * prefetch
    with _ProcessPool(processes, payload, mp_context) as pool:
        resubmit: collections.deque = collections.deque()
        while True:
            # keep every worker fed
            while True:
                if resubmit:
                    if not pool.submit(resubmit[0][0], (resubmit[0][1],), prefetch):
                        break
                    resubmit.popleft()
                    continue
                if exhausted or len(chunks) >= window:
                    break
                batch = []
                for sample in it:
                    batch.append(sample)
                    if len(batch) >= chunksize:
                        break
                if not batch:
                    exhausted = True
                    break
                cid = next_chunk
                next_chunk += 1
                chunks[cid] = [batch, [None] * len(batch), len(batch)]
                if not pool.submit((cid, 0, len(batch)), (batch,), prefetch):
                    resubmit.append(((cid, 0, len(batch)), batch))
                    break
            if not chunks:
                return
            for kind, task, value, tb in pool.events():
                if kind == "died":
                    _handle_death(task, value, chunks, resubmit)
                    continue
                cid, start, n = task
                entry = chunks[cid]
                if kind == "ok":
                    outcomes = value
                else:  # the runner itself failed (e.g. a result that does not pickle)
                    outcomes = [_SampleOutcome(False, _remote_cause(value, tb))] * n
                for j, o in enumerate(outcomes):
                    if entry[1][start + j] is None:
                        entry[1][start + j] = o
                        entry[2] -= 1
            # emit finished chunks
            while True:
                if ordered:
                    entry = chunks.get(next_emit)
                    if entry is None or entry[2] > 0:
                        break
                    del chunks[next_emit]
                    next_emit += 1
                else:
                    done = [c for c, e in chunks.items() if e[2] == 0]
                    if not done:
                        break
                    entry = chunks.pop(done[0])
                for o in entry[1]:
                    if o.ok:
                        if o.value is not None:
                            yield o.value
                        continue
                    err = _remote_cause(o.value, o.tb)
                    if handler(err):
                        continue
                    return


def _handle_death(tasks, exitcode, chunks, resubmit) -> None:
    """A worker died holding ``tasks`` (the first was running, the rest were queued)."""
    for pos, (cid, start, n) in enumerate(tasks):
        entry = chunks[cid]
        piece = entry[0][start:start + n]
        if pos > 0:  # queued behind the task that was running: not tried yet
            resubmit.append(((cid, start, n), piece))
        elif n > 1:  # find the sample that kills its worker: try them one by one
            for j in range(n):
                resubmit.append(((cid, start + j, 1), [piece[j]]))
        else:
            sample = piece[0]
            err = TarshardsError(f"the worker process died (exit code {exitcode}) while "
                                 "running the function on this sample",
                                 url=sample.get("__url__") if isinstance(sample, dict) else None,
                                 member=_sample_key(sample))
            entry[1][start] = _SampleOutcome(False, err)
            entry[2] -= 1


# ---------------------------------------------------------------------------------------------
# per-shard jobs
# ---------------------------------------------------------------------------------------------


@dataclass
class ShardReport:
    """What happened to one shard: ``status`` is ``"done"``, ``"skipped"`` (the output existed)
    or ``"failed"`` (``error`` says why). ``messages`` holds the first errors a handler skipped."""

    input: str
    output: str
    status: str = DONE
    samples_in: int = 0
    samples_out: int = 0
    samples_skipped: int = 0
    seconds: float = 0.0
    error: str | None = None
    attempts: int = 0
    messages: list = field(default_factory=list)
    index: bytes | None = field(default=None, repr=False)  # the output's index (manifest=)

    def as_dict(self) -> dict:
        out = asdict(self)
        out.pop("index", None)
        return out


class _HandlerStop(Exception):
    """A handler asked to stop: the shard fails (a partial output is never committed)."""


class _SampleShardJob:
    """Read one input shard, apply ``fn`` to each sample, write the output shard atomically."""

    def __init__(self, fn, *, decode=None, handler=reraise_exception, encoder=True,
                 storage_options=None, compress=None, allow_pipe=False, record=False,
                 aligned=False):
        self.record = record or aligned
        self.aligned = aligned
        self.fn = fn
        if decode is None or decode is False:
            self.decode = None
        elif isinstance(decode, (list, tuple)):
            self.decode = tuple(decode)
        else:
            self.decode = (decode,)
        self.handler = handler
        self.encoder = encoder
        self.storage_options = storage_options
        self.compress = compress
        self.allow_pipe = allow_pipe

    def __call__(self, inp: str, out: str) -> ShardReport:
        report = ShardReport(inp, out)
        t0 = time.monotonic()
        handler = self.handler

        def handle(exn):
            if handler(exn):
                report.samples_skipped += 1
                if len(report.messages) < _MAX_MESSAGES:
                    report.messages.append(_describe(exn))
                return True
            raise _HandlerStop(_describe(exn))

        def counted(samples):
            for s in samples:
                report.samples_in += 1
                yield s

        samples = counted(shard_samples(inp, storage_options=self.storage_options,
                                        allow_pipe=self.allow_pipe))
        if self.decode is not None:
            samples = _stages.decode(samples, *self.decode, handler=handle)
        fn = self.fn
        try:
            with TarWriter(out, encoder=self.encoder, compress=self.compress,
                           storage_options=self.storage_options,
                           index=getattr(self, "record", False),
                           aligned=getattr(self, "aligned", False)) as sink:
                try:
                    for sample in samples:
                        try:
                            result = _apply_one(fn, sample)
                            if result is None:
                                continue
                            results = result if isinstance(result, (list, tuple)) else (result,)
                            members = [sink.encode(r) for r in results]
                        except Exception as exn:
                            handle(_stages._context(exn, sample))
                            continue
                        for m in members:
                            sink.write_members(m)
                            report.samples_out += 1
                except TarshardsError as exn:
                    if isinstance(exn, OSError):
                        raise  # I/O: the attempt fails and the engine tries again
                    handle(exn)  # a broken input: keep what came before it if the handler says so
        except _HandlerStop as stop:
            report.status = FAILED
            report.error = f"stopped by the error handler: {stop}"
        except OSError:
            raise
        except Exception as exn:
            report.status = FAILED
            report.error = _describe(exn)
        else:
            if sink.index is not None:
                report.index = sink.index.to_bytes()
        report.seconds = time.monotonic() - t0
        return report


class _FileShardJob:
    """Run ``fn(input_url, output_url)``; an int result is the number of samples written."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, inp: str, out: str) -> ShardReport:
        report = ShardReport(inp, out)
        t0 = time.monotonic()
        try:
            result = self.fn(inp, out)
        except OSError:
            raise
        except Exception as exn:
            report.status = FAILED
            report.error = _describe(exn)
        else:
            if isinstance(result, int) and not isinstance(result, bool):
                report.samples_out = result
            elif isinstance(result, dict):
                report.samples_in = int(result.get("samples_in", 0))
                report.samples_out = int(result.get("samples_out", 0))
        report.seconds = time.monotonic() - t0
        return report


# ---------------------------------------------------------------------------------------------
# map_shards / map_shard_files
# ---------------------------------------------------------------------------------------------


def _exists(url: str, storage_options) -> bool:
    if is_local(url):
        return os.path.exists(local_path(url))
    fs, path, _ = _fsspec_resolve(url, storage_options)
    return fs.exists(path)


def _pairs(inputs, outputs, storage_options) -> list[tuple[str, str]]:
    ins = expand_urls(inputs, storage_options=storage_options)
    outs = expand_urls(outputs, storage_options=storage_options)
    if not ins:
        raise ValueError(f"the input spec {inputs!r} names no shards")
    if len(ins) != len(outs):
        raise ValueError(f"{len(ins)} input shards but {len(outs)} output shards; the specs must "
                         "name the same number")
    if len(set(outs)) != len(outs):
        raise ValueError("the output spec names the same shard more than once")
    return list(zip(ins, outs))


def map_shards(fn: Callable, inputs, outputs, *, engine: str = "processes",
               workers: int | None = None, address: str | None = None, retries: int = 2,
               overwrite: bool = False, decode=None, handler: Callable = reraise_exception,
               encoder: bool = True, compress=None, storage_options: dict | None = None,
               allow_pipe: bool = False, progress: bool | None = None, client=None,
               mp_context=None, manifest=None, aligned: bool = False) -> list[ShardReport]:
    """Apply ``fn(sample) -> sample | None | list of samples`` to every sample of each input shard
    and write the results to the matching output shard.

    ``manifest=PATH``: record each output's index while writing it and write the manifest of
    the outputs (outputs skipped because they existed are indexed by reading them).
    ``aligned=True``: compressed outputs get sample-aligned compression (random access).

    ``inputs`` and ``outputs`` are shard specs (``"in-{0000..0999}.tar"``) or lists naming the same
    number of shards; outputs are any URL the library writes (local, ``s3://``...). Samples are
    read as raw bytes (``__key__``, ``__url__``, one bytes field per extension) or decoded with
    ``decode`` (``"pil"``, or a list of decode handlers, see :func:`tarshards.stages.decode`);
    results are encoded by extension unless ``encoder=False``.

    Each output appears under its final name only when complete. Outputs that already exist are
    skipped unless ``overwrite=True``. Errors in ``fn`` or in the data go to ``handler`` (the
    default fails the shard; ``warn_and_continue`` skips the sample). A shard whose worker died or
    that hit an I/O error is tried again up to ``retries`` times. A failed shard does not stop the
    others; a warning names the failures. Returns one :class:`ShardReport` per shard, in order.

    ``engine="processes"`` uses ``workers`` local processes (default: one per CPU).
    ``engine="dask"`` submits one task per shard to ``client``, to the cluster at ``address``, or
    to a ``LocalCluster`` of ``workers`` single-threaded processes started for the job.
    ``progress`` shows a bar over shards (default: when stderr is a terminal).
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, not {fn!r}")
    job = _SampleShardJob(fn, decode=decode, handler=handler, encoder=encoder,
                          storage_options=storage_options, compress=compress,
                          allow_pipe=allow_pipe, record=manifest is not None, aligned=aligned)
    pairs = _pairs(inputs, outputs, storage_options)
    reports = _run_shard_jobs(job, pairs, engine=engine, workers=workers, address=address,
                              retries=retries, overwrite=overwrite,
                              storage_options=storage_options, progress=progress, client=client,
                              mp_context=mp_context)
    if manifest is not None:
        _write_manifest(reports, manifest, storage_options)
    return reports


def _write_manifest(reports, path, storage_options) -> None:
    """The manifest of the outputs that exist (done, or skipped because they existed)."""
    from .index import ShardIndex, index_url
    from .manifest import ManifestRecorder

    recorder = ManifestRecorder(path, storage_options=storage_options)
    for r in reports:
        if r.status == DONE and r.index is not None:
            recorder.add(r.output, ShardIndex.from_bytes(r.index, url=r.output))
        elif r.status == SKIPPED:
            recorder.add(r.output, index_url(r.output, storage_options=storage_options))
    recorder.save()


def map_shard_files(fn: Callable, pairs, *, engine: str = "processes",
                    workers: int | None = None, address: str | None = None, retries: int = 2,
                    overwrite: bool = False, storage_options: dict | None = None,
                    progress: bool | None = None, client=None,
                    mp_context=None) -> list[ShardReport]:
    """Run ``fn(input_url, output_url)`` for each pair, on the same engines as :func:`map_shards`.

    ``fn`` writes the output itself (use :class:`~tarshards.writer.TarWriter` so that it appears
    only when complete); it may return the number of samples written, or a dict with
    ``samples_in`` and ``samples_out``. Existing outputs are skipped unless ``overwrite=True``.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, not {fn!r}")
    pairs = [(os.fspath(i), os.fspath(o)) for i, o in pairs]
    return _run_shard_jobs(_FileShardJob(fn), pairs, engine=engine, workers=workers,
                           address=address, retries=retries, overwrite=overwrite,
                           storage_options=storage_options, progress=progress, client=client,
                           mp_context=mp_context, cleanup=False)


def _run_shard_jobs(job, pairs, *, engine, workers, address, retries, overwrite,
                    storage_options, progress, client, mp_context, cleanup=True):
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    if not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be an int >= 0, got {retries!r}")
    if engine == "processes" and (address is not None or client is not None):
        raise ValueError("address= and client= are for engine='dask'")
    workers = _default_workers(workers)
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
            if engine == "processes":
                _run_processes(job, pairs, todo, max(1, workers), retries, mp_context, finished)
            else:
                _run_dask(job, pairs, todo, workers, address, retries, client, finished)
    finally:
        if bar is not None:
            bar.close()
        if cleanup:
            _remove_stale_temps([pairs[i][1] for i in todo])
    failed = [r for r in reports if r.status == FAILED]
    if failed:
        warnings.warn(f"{len(failed)} of {len(pairs)} shards failed; first: {failed[0].input}: "
                      f"{failed[0].error}", TarshardsWarning, stacklevel=3)
    return reports


def _progress_bar(total, initial, progress):
    if progress is None:
        progress = hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="shard", file=sys.stderr, dynamic_ncols=True)


class _Attempt:
    """Worker side of the processes engine: ``job(input, output)`` with the attempt number."""

    def __init__(self, job):
        self.job = job

    def __call__(self, inp, out, attempt):
        report = self.job(inp, out)
        report.attempts = attempt
        return report


def _run_processes(job, pairs, todo, workers, retries, mp_context, finished) -> None:
    payload = _dumps(_Attempt(job))
    pending = collections.deque(todo)
    attempts = collections.Counter()
    last_error: dict[int, str] = {}

    def retry_or_fail(i, why):
        if attempts[i] > retries:
            inp, out = pairs[i]
            finished(i, ShardReport(inp, out, status=FAILED, error=why, attempts=attempts[i]))
        else:
            last_error[i] = why
            pending.appendleft(i)

    with _ProcessPool(min(workers, len(todo)), payload, mp_context) as pool:
        while pending or pool.load:
            while pending:
                i = pending[0]
                inp, out = pairs[i]
                if not pool.submit(i, (inp, out, attempts[i] + 1), 1):
                    break
                attempts[i] += 1
                pending.popleft()
            for kind, task, value, tb in pool.events():
                if kind == "ok":
                    finished(task, value)
                elif kind == "died":
                    for i in task:
                        retry_or_fail(i, f"the worker process died (exit code {value}) "
                                         f"{attempts[i]} time(s)")
                else:
                    retry_or_fail(task, _describe(value))


def _import_distributed():
    try:
        import distributed
    except ImportError:
        raise MissingDependencyError(
            "engine='dask' needs dask.distributed: pip install 'tarshards[dask]'") from None
    return distributed


def _run_pickled_job(job_bytes: bytes, inp: str, out: str):
    """A Dask task: load the job here, so a function the worker cannot import fails this task
    with a clear error (a function inside the task message would break the worker's connection
    and leave the task hanging)."""
    try:
        job = pickle.loads(job_bytes)
    except Exception as exn:
        raise RuntimeError(
            f"the function could not be loaded on the Dask worker ({type(exn).__name__}: {exn}); "
            "its module must be importable there (install it on the workers, or define the "
            "function in the script that calls map_shards)") from exn
    return job(inp, out)


def _run_dask(job, pairs, todo, workers, address, retries, client, finished) -> None:
    distributed = _import_distributed()
    import dask

    with contextlib.ExitStack() as stack:
        if client is None:
            if address is None:
                # the scheduler reschedules a dead worker's task up to allowed-failures times
                stack.enter_context(dask.config.set(
                    {"distributed.scheduler.allowed-failures": retries}))
                cluster = stack.enter_context(distributed.LocalCluster(
                    n_workers=max(1, workers), threads_per_worker=1, processes=True,
                    host="127.0.0.1", dashboard_address=None, silence_logs=40,
                    # no dashboard; the scheduler's small HTTP server on a free local port
                    scheduler_kwargs={"dashboard_address": "127.0.0.1:0"}))
                client = stack.enter_context(distributed.Client(cluster))
            else:
                client = stack.enter_context(distributed.Client(address))
        token = uuid.uuid4().hex[:12]
        futures = {}
        import cloudpickle  # a dependency of distributed; pickles __main__ functions by value

        # hash=False: a key of its own, so a job with the same function on the same client
        # never shares (and loses) data with one that is finishing
        job_bytes = client.scatter(cloudpickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL),
                                   broadcast=True, hash=False)
        for i in todo:
            inp, out = pairs[i]
            fut = client.submit(_run_pickled_job, job_bytes, inp, out,
                                key=f"tarshards-shard-{token}-{i}", pure=False, retries=retries)
            futures[fut] = i
        try:
            for fut in distributed.as_completed(futures):
                i = futures[fut]
                inp, out = pairs[i]
                try:
                    report = fut.result()
                except Exception as exn:
                    if type(exn).__name__ == "KilledWorker":
                        why = f"worker processes died while running this shard: {exn}"
                    else:
                        why = _describe(exn)
                    report = ShardReport(inp, out, status=FAILED, error=why)
                finished(i, report)
        finally:
            pending = [f for f in futures if not f.done()]
            if pending:
                with contextlib.suppress(Exception):
                    client.cancel(pending)


_TEMP_RE = r"\.[0-9a-f]{8}\.tmp"  # tarshards.urls.AtomicOutput: ".NAME.<8 hex>.tmp" beside NAME


def _remove_stale_temps(outputs) -> int:
    """Remove temporary files left beside local ``outputs`` by attempts whose worker died."""
    by_dir: dict[str, set] = collections.defaultdict(set)
    for out in outputs:
        if is_local(out) and out != "-":
            path = os.path.abspath(local_path(out))
            by_dir[os.path.dirname(path)].add(os.path.basename(path))
    removed = 0
    for d, names in by_dir.items():
        try:
            entries = os.listdir(d)
        except OSError:
            continue
        for entry in entries:
            if not entry.startswith(".") or not entry.endswith(".tmp"):
                continue
            m = re.fullmatch(r"\.(.+)" + _TEMP_RE, entry)
            if m and m.group(1) in names:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(d, entry))
                    removed += 1
    return removed


# ---------------------------------------------------------------------------------------------
# summaries
# ---------------------------------------------------------------------------------------------


def summarize(reports: list[ShardReport]) -> dict:
    """Counts over reports: shards done/skipped/failed, samples in/out/skipped, seconds."""
    out = {"shards": len(reports), DONE: 0, SKIPPED: 0, FAILED: 0, "samples_in": 0,
           "samples_out": 0, "samples_skipped": 0, "seconds": 0.0}
    for r in reports:
        out[r.status] += 1
        out["samples_in"] += r.samples_in
        out["samples_out"] += r.samples_out
        out["samples_skipped"] += r.samples_skipped
        out["seconds"] += r.seconds
    return out


def format_summary(reports: list[ShardReport], wall_seconds: float | None = None) -> str:
    """A small table: shards and samples per status, and the time taken."""
    rows = [("", "shards", "samples in", "samples out", "errors", "seconds")]
    for status in (DONE, SKIPPED, FAILED):
        rs = [r for r in reports if r.status == status]
        s = summarize(rs)
        rows.append((status, str(len(rs)), str(s["samples_in"]), str(s["samples_out"]),
                     str(s["samples_skipped"]), f"{s['seconds']:.1f}"))
    s = summarize(reports)
    total_secs = f"{wall_seconds:.1f}" if wall_seconds is not None else f"{s['seconds']:.1f}"
    rows.append(("total", str(len(reports)), str(s["samples_in"]), str(s["samples_out"]),
                 str(s["samples_skipped"]), total_secs))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [r[c].rjust(widths[c]) for c in range(1, len(r))]
        lines.append("  ".join(cells).rstrip())
    if wall_seconds is not None:
        lines.append("(errors: samples skipped by the error handler; seconds: per-shard sums, "
                     "total: wall clock)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# per-sample shell commands (tarproc -c)
# ---------------------------------------------------------------------------------------------


class ShellSampleFn:
    """Run a shell command on one sample, with the semantics of ``tarproc -c``.

    The sample's fields are written to a fresh temporary directory as ``BASE.EXT`` files (``BASE``
    is the last path component of ``__key__``); the command runs there with ``$KEY`` set to the
    full key. The files present afterwards form the output sample under the same key: ``BASE.EXT``
    becomes field ``EXT``, any other file ``NAME`` becomes field ``NAME``; hidden files, ``__*``
    files and subdirectories are not collected. No file left: ``None`` (the sample is dropped).
    A non-zero exit status raises :class:`~tarshards.errors.CommandError` (a ``RuntimeError``)
    naming the key, the shard and the command's stderr.
    Instances pickle, so they run in worker processes and on Dask workers.
    """

    def __init__(self, cmd: str, *, timeout: float | None = None, env: dict | None = None,
                 verbose: bool = False, tmpdir: str | None = None):
        if not isinstance(cmd, str) or not cmd.strip():
            raise ValueError("the shell command is an empty string")
        self.cmd = cmd
        self.timeout = timeout
        self.env = dict(env) if env else None
        self.verbose = verbose
        self.tmpdir = tmpdir

    def __repr__(self):
        return f"ShellSampleFn({self.cmd!r})"

    def __call__(self, sample: dict) -> dict | None:
        key = sample.get("__key__")
        if not isinstance(key, str) or not key:
            raise ValueError(f"a sample needs a string '__key__', got {key!r}")
        base = key.rpartition("/")[2]
        with tempfile.TemporaryDirectory(prefix="tarshards-sample-", dir=self.tmpdir) as tmp:
            for ext, value in sample.items():
                if ext.startswith("__"):
                    continue
                if isinstance(value, str):
                    value = value.encode("utf-8")
                if not isinstance(value, (bytes, bytearray, memoryview)):
                    raise TypeError(f"field {ext!r} is a {type(value).__name__}; a shell command "
                                    "gets raw bytes (do not decode the samples)")
                with open(os.path.join(tmp, f"{base}.{ext}"), "wb") as f:
                    f.write(value)
            env = dict(os.environ)
            if self.env:
                env.update(self.env)
            env["KEY"] = key
            proc = subprocess.run(self.cmd, shell=True, cwd=tmp, env=env,
                                  stdin=subprocess.DEVNULL, capture_output=True,
                                  timeout=self.timeout)
            if proc.returncode != 0:
                tail = proc.stderr.decode("utf-8", "replace").strip()[-500:]
                raise CommandError(
                    f"command exited with status {proc.returncode} on sample {key!r}: "
                    f"{self.cmd}" + (f": {tail}" if tail else ""), status=proc.returncode,
                    stderr=proc.stderr, url=sample.get("__url__"))
            if self.verbose and (proc.stdout or proc.stderr):
                with contextlib.suppress(Exception):
                    sys.stderr.write((proc.stdout + proc.stderr).decode("utf-8", "replace"))
            out = {"__key__": key}
            if "__url__" in sample:
                out["__url__"] = sample["__url__"]
            prefix = base + "."
            for name in sorted(os.listdir(tmp)):
                path = os.path.join(tmp, name)
                if name.startswith((".", "__")) or not os.path.isfile(path):
                    continue
                ext = name[len(prefix):] if name.startswith(prefix) else name
                if not ext:
                    continue
                if ext in out:
                    raise DuplicateFieldError(
                        f"the command left two files for field {ext!r} in sample {key!r}",
                        url=sample.get("__url__"), member=name)
                with open(path, "rb") as f:
                    out[ext] = f.read()
        if len(out) == (2 if "__url__" in out else 1):
            return None
        return out


def shell_sample_fn(cmd: str, **options: Any) -> ShellSampleFn:
    """A picklable ``fn(sample) -> sample`` running ``cmd`` on each sample (see ShellSampleFn)."""
    return ShellSampleFn(cmd, **options)
