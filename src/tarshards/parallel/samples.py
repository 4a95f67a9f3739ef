"""``map_samples``: a function over the samples of a stream, in worker processes."""

from __future__ import annotations

import collections
import traceback
from typing import Callable, Iterable, Iterator

from ..errors import TarshardsError
from ..on_error import OnError, error_policy, sample_context
from ..pipeline import stages as _stages
from .pool import ProcessPool, default_workers, dumps, portable_exception, remote_cause

__all__ = ["apply_one", "map_samples"]


class _SampleOutcome:
    __slots__ = ("ok", "tb", "value")

    def __init__(self, ok, value, tb=None):
        self.ok = ok
        self.value = value
        self.tb = tb


def apply_one(fn, sample):
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
                out.append(_SampleOutcome(True, apply_one(self.fn, sample)))
            except Exception as exn:
                err = sample_context(exn, sample)
                out.append(_SampleOutcome(False, portable_exception(err), traceback.format_exc()))
        return out


def _sample_key(sample) -> str | None:
    return sample.get("__key__") if isinstance(sample, dict) else None


def map_samples(
    fn: Callable,
    source: Iterable,
    processes: int | None = None,
    *,
    ordered: bool = True,
    chunksize: int = 4,
    prefetch: int = 2,
    on_error: OnError = "raise",
    handler: Callable | None = None,
    mp_context=None,
) -> Iterator:
    """Apply ``fn`` to each sample of ``source`` in ``processes`` worker processes.

    Yields ``fn(sample)`` for each sample, in the order of ``source`` (``ordered=True``) or as
    results arrive. ``None`` results are dropped and dict results keep the sample's ``__key__``,
    as in :func:`tarshards.pipeline.stages.map`. ``processes=0`` runs in this process (no pickling);
    ``None`` uses one process per CPU. Samples go to the workers ``chunksize`` at a time, at most
    ``prefetch`` chunks per worker ahead, so memory stays bounded however long ``source`` is.

    An exception in ``fn`` becomes a :class:`~tarshards.errors.TarshardsError` naming the sample
    key and shard (the worker's traceback is its ``__cause__``) and goes to ``on_error``
    (:mod:`tarshards.on_error`): the default raises it, a function returning True skips the sample
    (``warn_and_continue``), one returning False ends the stream (with a warning); ``"skip"`` and
    ``"warn"`` skip data errors only. ``handler=`` is the older name of ``on_error=``. A worker
    process that dies (a crash in native code) loses its chunk: those samples are tried again one
    by one and the one whose worker dies again is reported as an error.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, not {fn!r}")
    policy = error_policy(on_error, handler)
    processes = default_workers(processes)
    if chunksize < 1 or prefetch < 1:
        raise ValueError(f"chunksize and prefetch must be >= 1, got {chunksize}, {prefetch}")
    if processes == 0:
        return _stages.map(source, fn, on_error=policy)
    return _map_samples_pool(
        fn, source, processes, ordered, chunksize, prefetch, policy, mp_context
    )


def _map_samples_pool(fn, source, processes, ordered, chunksize, prefetch, policy, mp_context):
    payload = dumps(_ChunkRunner(fn))
    it = iter(source)
    # chunk id -> [samples, outcomes (list of _SampleOutcome | None), missing count]
    chunks: dict[int, list] = {}
    next_chunk = 0
    next_emit = 0
    exhausted = False
    window = processes * prefetch
    with ProcessPool(processes, payload, mp_context) as pool:
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
                    outcomes: list = value
                else:  # the runner itself failed (e.g. a result that does not pickle)
                    outcomes = [_SampleOutcome(False, remote_cause(value, tb))] * n
                for j, o in enumerate(outcomes):
                    if entry[1][start + j] is None:
                        entry[1][start + j] = o
                        entry[2] -= 1
            # emit finished chunks
            while True:
                if ordered:
                    ready = chunks.get(next_emit)
                    if ready is None or ready[2] > 0:
                        break
                    del chunks[next_emit]
                    next_emit += 1
                else:
                    done = [c for c, e in chunks.items() if e[2] == 0]
                    if not done:
                        break
                    ready = chunks.pop(done[0])
                for o in ready[1]:
                    if o.ok:
                        if o.value is not None:
                            yield o.value
                        continue
                    err = remote_cause(o.value, o.tb)
                    if policy(err):
                        continue
                    return


def _handle_death(tasks, exitcode, chunks, resubmit) -> None:
    """A worker died holding ``tasks`` (the first was running, the rest were queued)."""
    for pos, (cid, start, n) in enumerate(tasks):
        entry = chunks[cid]
        piece = entry[0][start : start + n]
        if pos > 0:  # queued behind the task that was running: not tried yet
            resubmit.append(((cid, start, n), piece))
        elif n > 1:  # find the sample that kills its worker: try them one by one
            for j in range(n):
                resubmit.append(((cid, start + j, 1), [piece[j]]))
        else:
            sample = piece[0]
            err = TarshardsError(
                f"the worker process died (exit code {exitcode}) while "
                "running the function on this sample",
                url=sample.get("__url__") if isinstance(sample, dict) else None,
                member=_sample_key(sample),
            )
            entry[1][start] = _SampleOutcome(False, err)
            entry[2] -= 1
