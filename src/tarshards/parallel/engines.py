"""Where the shard jobs of :func:`~tarshards.parallel.map_shards` run: an :class:`Engine`.

An engine runs ``job(input_url, output_url) -> ShardReport`` for the pairs it is given and calls
``finished(i, report)`` once per pair. A job raises ``OSError`` for a failure worth another
attempt (see :func:`tarshards.parallel.jobs.attempt`); the engine tries such a shard, or one whose
worker process died, again up to ``retries`` times, then reports it failed.

* :class:`ProcessEngine` (``engine="processes"``): local worker processes.
* :class:`DaskEngine` (``engine="dask"``): a ``dask.distributed`` cluster; Dask is imported only
  when this engine runs.
* :class:`RayEngine` (``engine="ray"``): a Ray cluster (the one this process is connected to, the
  one at ``address``, or a local one started for the job); Ray is imported only when it runs.

Besides :func:`~tarshards.parallel.map_shards`, :func:`tarshards.format.manifest.build_manifest`
runs its per-shard indexing on these engines (this module and ``pool``/``reports`` sit below the
manifest in the import order for that).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import pickle
import uuid
from typing import Callable, Protocol, runtime_checkable

from ..errors import MissingDependencyError
from ..on_error import describe
from .pool import ProcessPool, default_workers, payload_for
from .reports import FAILED, ShardReport

__all__ = ["ENGINES", "DaskEngine", "Engine", "ProcessEngine", "RayEngine", "make_engine"]

ENGINES = ("processes", "dask", "ray")

Job = Callable[[str, str], ShardReport]
Finished = Callable[[int, ShardReport], None]


@runtime_checkable
class Engine(Protocol):
    """Runs shard jobs: ``run(job, pairs, todo, finished)`` runs ``job(*pairs[i])`` for each ``i``
    in ``todo`` and calls ``finished(i, report)`` for each (failed ones included)."""

    name: str

    def run(
        self, job: Job, pairs: list[tuple[str, str]], todo: list[int], finished: Finished
    ) -> None: ...


def check_retries(retries) -> int:
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
        raise ValueError(f"retries must be an int >= 0, got {retries!r}")
    return retries


def make_engine(
    engine: str | Engine,
    *,
    workers: int | None = None,
    address: str | None = None,
    client=None,
    retries: int = 2,
    mp_context=None,
) -> Engine:
    """The engine for ``map_shards(engine=...)``: a name from :data:`ENGINES`, or an engine."""
    if isinstance(engine, Engine):
        return engine
    if engine == "processes":
        if address is not None or client is not None:
            raise ValueError("address= and client= are for engine='dask'")
        return ProcessEngine(workers, retries=retries, mp_context=mp_context)
    if engine == "dask":
        return DaskEngine(workers, address=address, client=client, retries=retries)
    if engine == "ray":
        if client is not None:
            raise ValueError("client= is for engine='dask' (engine='ray' takes address=)")
        return RayEngine(workers, address=address, retries=retries)
    raise ValueError(f"engine must be one of {', '.join(ENGINES)}, not {engine!r}")


# ---------------------------------------------------------------------------------------------
# local processes
# ---------------------------------------------------------------------------------------------


class _Attempt:
    """Worker side of the processes engine: ``job(input, output)`` with the attempt number."""

    def __init__(self, job):
        self.job = job

    def __call__(self, inp, out, attempt):
        report = self.job(inp, out)
        report.attempts = attempt
        return report


class ProcessEngine:
    """Shard jobs in ``workers`` local processes (default: one per CPU), one shard at a time
    each; a worker that dies is replaced and only its shard is tried again. A job with a
    ``prepare()`` method has it called here first (before the workers fork: what it imports
    there, they inherit)."""

    name = "processes"

    def __init__(self, workers: int | None = None, *, retries: int = 2, mp_context=None):
        self.workers = max(1, default_workers(workers))
        self.retries = check_retries(retries)
        self.mp_context = mp_context

    def run(
        self, job: Job, pairs: list[tuple[str, str]], todo: list[int], finished: Finished
    ) -> None:
        prepare = getattr(job, "prepare", None)
        if callable(prepare):
            prepare()
        payload = payload_for(_Attempt(job), self.mp_context)  # forked workers: not pickled
        pending = collections.deque(todo)
        attempts: collections.Counter = collections.Counter()

        def retry_or_fail(i, why):
            if attempts[i] > self.retries:
                inp, out = pairs[i]
                finished(i, ShardReport(inp, out, status=FAILED, error=why, attempts=attempts[i]))
            else:
                pending.appendleft(i)

        with ProcessPool(min(self.workers, len(todo)), payload, self.mp_context) as pool:
            while pending or pool.load:
                while pending:
                    i = pending[0]
                    inp, out = pairs[i]
                    if not pool.submit(i, (inp, out, attempts[i] + 1), 1):
                        break
                    attempts[i] += 1
                    pending.popleft()
                for kind, task, value, _ in pool.events():
                    if kind == "ok":
                        finished(task, value)
                    elif kind == "died":
                        for i in task:
                            retry_or_fail(
                                i,
                                f"the worker process died (exit code {value}) "
                                f"{attempts[i]} time(s)",
                            )
                    else:
                        retry_or_fail(task, describe(value))


# ---------------------------------------------------------------------------------------------
# Dask
# ---------------------------------------------------------------------------------------------


def _import_distributed():
    try:
        import distributed
    except ImportError:
        raise MissingDependencyError(
            "engine='dask' needs dask.distributed: pip install 'tarshards[dask]'"
        ) from None
    return distributed


def _run_pickled_job(job_bytes: bytes, inp: str, out: str, where: str = "Dask"):
    """A Dask (or Ray) task: load the job here, so a function the worker cannot import fails
    this task with a clear error (a function inside the task message would break the worker's
    connection and leave the task hanging)."""
    try:
        job = pickle.loads(job_bytes)
    except Exception as exn:
        raise RuntimeError(
            f"the function could not be loaded on the {where} worker ({type(exn).__name__}: "
            f"{exn}); "
            "its module must be importable there (install it on the workers, or define the "
            "function in the script that calls map_shards)"
        ) from exn
    return job(inp, out)


class DaskEngine:
    """One Dask task per shard: on ``client``, on the cluster at ``address``, or on a
    ``LocalCluster`` of ``workers`` single-threaded processes started for the job. Dask retries a
    task ``retries`` times (an ``OSError`` in the job, or its worker dying)."""

    name = "dask"

    def __init__(
        self,
        workers: int | None = None,
        *,
        address: str | None = None,
        client=None,
        retries: int = 2,
    ):
        self.workers = default_workers(workers)
        self.address = address
        self.client = client
        self.retries = check_retries(retries)

    def run(self, job, pairs, todo, finished) -> None:
        _run_dask(job, pairs, todo, self.workers, self.address, self.retries, self.client, finished)


def _run_dask(job, pairs, todo, workers, address, retries, client, finished) -> None:
    distributed = _import_distributed()
    import dask

    with contextlib.ExitStack() as stack:
        if client is None:
            if address is None:
                # the scheduler reschedules a dead worker's task up to allowed-failures times
                stack.enter_context(
                    dask.config.set({"distributed.scheduler.allowed-failures": retries})
                )
                cluster = stack.enter_context(
                    distributed.LocalCluster(
                        n_workers=max(1, workers),
                        threads_per_worker=1,
                        processes=True,
                        host="127.0.0.1",
                        dashboard_address=None,
                        silence_logs=40,
                        # no dashboard; the scheduler's small HTTP server on a free local port
                        scheduler_kwargs={"dashboard_address": "127.0.0.1:0"},
                    )
                )
                client = stack.enter_context(distributed.Client(cluster))
            else:
                client = stack.enter_context(distributed.Client(address))
        token = uuid.uuid4().hex[:12]
        futures = {}
        import cloudpickle  # a dependency of distributed; pickles __main__ functions by value

        # hash=False: a key of its own, so a job with the same function on the same client
        # never shares (and loses) data with one that is finishing
        job_bytes = client.scatter(
            cloudpickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL), broadcast=True, hash=False
        )
        for i in todo:
            inp, out = pairs[i]
            fut = client.submit(
                _run_pickled_job,
                job_bytes,
                inp,
                out,
                key=f"tarshards-shard-{token}-{i}",
                pure=False,
                retries=retries,
            )
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
                        why = describe(exn)
                    report = ShardReport(inp, out, status=FAILED, error=why)
                finished(i, report)
        finally:
            pending = [f for f in futures if not f.done()]
            if pending:
                with contextlib.suppress(Exception):
                    client.cancel(pending)


# ---------------------------------------------------------------------------------------------
# Ray
# ---------------------------------------------------------------------------------------------


def _import_ray():
    try:
        import ray
    except ImportError:
        raise MissingDependencyError(
            "engine='ray' needs ray: pip install 'tarshards[ray]'"
        ) from None
    return ray


def local_ray_env() -> dict:
    """The ``runtime_env`` of a local Ray started for a job: its workers import what this
    process imports (its ``sys.path`` as their ``PYTHONPATH``, as worker processes started by
    ``multiprocessing`` or a Dask ``LocalCluster`` do), so that functions from the caller's own
    modules load there."""
    import sys

    path = [p for p in sys.path if p and os.path.isdir(p)]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(dict.fromkeys(path))}}


class _NotRetried(Exception):
    """Never raised: Ray's ``retry_exceptions`` list must not be empty."""


class RayEngine:
    """One Ray task per shard, on the Ray cluster this process is connected to, on the one at
    ``address`` (``"auto"``, ``"ray://head:10001"``, ``"HOST:6379"``), or on a local one of
    ``workers`` CPUs started for the job (and stopped after it). Ray runs a task again, up to
    ``retries`` times, when its worker process dies or the job raises ``OSError``; each task
    takes one CPU."""

    name = "ray"

    def __init__(self, workers: int | None = None, *, address: str | None = None, retries: int = 2):
        self.workers = max(1, default_workers(workers))
        self.address = address
        self.retries = check_retries(retries)

    def run(self, job, pairs, todo, finished) -> None:
        ray = _import_ray()
        started = False
        if not ray.is_initialized():
            if self.address is None:  # a local cluster of our own, not one found on the machine
                ray.init(
                    address="local",
                    num_cpus=self.workers,
                    include_dashboard=False,
                    logging_level=logging.ERROR,
                    runtime_env=local_ray_env(),
                )
            else:
                ray.init(address=self.address, logging_level=logging.ERROR)
            started = True
        try:
            _run_ray(ray, job, pairs, todo, self.retries, finished)
        finally:
            if started:
                ray.shutdown()


def _run_ray(ray, job, pairs, todo, retries, finished) -> None:
    import cloudpickle  # a dependency of ray; pickles __main__ functions by value

    job_ref = ray.put(cloudpickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL))
    task = ray.remote(_run_pickled_job).options(
        num_cpus=1,
        max_retries=retries,  # the worker process died
        retry_exceptions=[OSError] if retries else [_NotRetried],  # I/O: try the shard again
        name="tarshards-shard",
    )
    refs = {task.remote(job_ref, *pairs[i], "Ray"): i for i in todo}
    pending = list(refs)
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                i = refs[ref]
                inp, out = pairs[i]
                try:
                    report = ray.get(ref)
                except Exception as exn:
                    report = ShardReport(inp, out, status=FAILED, error=_ray_error(ray, exn))
                finished(i, report)
    finally:
        for ref in pending:
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)


def _ray_error(ray, exn: BaseException) -> str:
    """Why a Ray task failed, in one line: the job's own exception where it raised one."""
    if isinstance(exn, (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError)):
        return f"worker processes died while running this shard: {type(exn).__name__}"
    if isinstance(exn, ray.exceptions.RayTaskError):
        cause = getattr(exn, "cause", None)
        if cause is not None:
            return describe(cause)
    return describe(exn)
