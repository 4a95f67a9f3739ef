"""Worker processes for :mod:`tarshards.parallel`: pickling the function, and a small pool that
knows which task a dead worker was running (so that only its own tasks are lost or retried)."""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import time
import traceback

__all__ = [
    "Inherited",
    "ProcessPool",
    "default_workers",
    "dumps",
    "payload_for",
    "portable_exception",
    "remote_cause",
]


def dumps(obj) -> bytes:
    """Pickle ``obj`` (a function and its options); lambdas and closures need cloudpickle."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        try:
            import cloudpickle
        except ImportError:
            raise TypeError(
                f"the function must be picklable to run in worker processes ({exc}); define it "
                "at module level, or install cloudpickle to send lambdas and closures"
            ) from None
        return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


class Inherited:
    """A function :class:`ProcessPool` workers inherit instead of unpickling: where they are
    forked, they start with the parent's memory, so nothing needs pickling (a conversion's
    job holds its source's listing: 20,000 rows as tuples took 16 ms to pickle and 17-19 ms
    to load in each worker, on the way to the first file)."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn


def payload_for(fn, mp_context=None) -> bytes | Inherited:
    """What :class:`ProcessPool` takes for ``fn``: ``fn`` itself (:class:`Inherited`) where the
    workers fork, else its pickle (:func:`dumps`)."""
    if _context(mp_context).get_start_method() == "fork":
        return Inherited(fn)
    return dumps(fn)


def _context(mp_context):
    if isinstance(mp_context, str) or mp_context is None:
        return multiprocessing.get_context(mp_context)
    return mp_context


def portable_exception(exn: BaseException) -> BaseException:
    """``exn`` if it survives pickling, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(exn))
        return exn
    except Exception:
        return RuntimeError(f"{type(exn).__name__}: {exn}")


def remote_cause(exn: BaseException, tb: str | None) -> BaseException:
    if tb:
        from multiprocessing.pool import RemoteTraceback  # type: ignore[attr-defined]

        exn.__cause__ = RemoteTraceback(tb)
    return exn


def _worker_main(conn, payload: bytes | Inherited) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    fn = payload.fn if isinstance(payload, Inherited) else pickle.loads(payload)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        task_id, args = msg
        try:
            reply: tuple = (task_id, True, fn(*args), None)
        except Exception as exn:
            reply = (task_id, False, portable_exception(exn), traceback.format_exc())
        try:
            conn.send(reply)
        except Exception as exn:  # a result that does not pickle
            conn.send(
                (
                    task_id,
                    False,
                    TypeError(f"result could not be sent back: {exn}"),
                    traceback.format_exc(),
                )
            )


class _Worker:
    __slots__ = ("conn", "process", "tasks")

    def __init__(self, process, conn):
        self.process = process
        self.conn = conn
        self.tasks: collections.deque = collections.deque()


class ProcessPool:
    """``workers`` processes each running ``pickle.loads(payload)(*args)`` on the tasks sent
    (``payload``: a pickle, or an :class:`Inherited` function where the processes fork).

    Unlike ``concurrent.futures``, a worker that dies loses only its own tasks: :meth:`events`
    reports them (``("died", task_ids, exitcode)``) and a fresh worker takes its place.
    """

    def __init__(self, workers: int, payload: bytes | Inherited, mp_context=None):
        self._ctx = mp_context = _context(mp_context)
        if isinstance(payload, Inherited) and mp_context.get_start_method() != "fork":
            raise ValueError("an Inherited payload is for forked workers; pickle it (dumps)")
        self._payload = payload
        self._workers: list[_Worker] = []
        self._closed = False
        for _ in range(workers):
            self._workers.append(self._start())

    def _start(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        p = self._ctx.Process(
            target=_worker_main, args=(child, self._payload), name="tarshards-worker", daemon=False
        )
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
            [w.conn for w in busy] + [w.process.sentinel for w in busy]
        )
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


def default_workers(n) -> int:
    if n is None:
        return os.cpu_count() or 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"the number of worker processes must be an int >= 0, got {n!r}")
    return n
