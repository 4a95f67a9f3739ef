"""The per-shard jobs of :func:`~tarshards.parallel.map_shards` and ``map_shard_files``, and the
one rule of an attempt: an ``OSError`` is raised to the engine (which tries the shard again, up to
its ``retries``), any other exception fails the shard with a report saying why."""

from __future__ import annotations

import time
from typing import Callable

from ..errors import TarshardsError
from ..on_error import OnError, describe, error_policy, sample_context
from ..pipeline import stages as _stages
from ..pipeline.dataset import shard_samples
from ..write.writer import TarWriter
from .reports import FAILED, ShardReport
from .samples import apply_one

__all__ = ["FileShardJob", "SampleShardJob", "ShardJob", "attempt"]

_MAX_MESSAGES = 20  # errors kept in a report's messages


class _PolicyStop(Exception):
    """The error policy asked to stop: the shard fails (a partial output is never committed)."""


def attempt(report: ShardReport, work: Callable[[ShardReport], None]) -> ShardReport:
    """Run ``work(report)`` as one attempt at a shard and time it. ``OSError`` propagates (the
    engine retries); any other exception marks the shard failed."""
    t0 = time.monotonic()
    try:
        work(report)
    except OSError:
        raise
    except _PolicyStop as stop:
        report.status = FAILED
        report.error = f"stopped by the error handler: {stop}"
    except Exception as exn:
        report.status = FAILED
        report.error = describe(exn)
    report.seconds = time.monotonic() - t0
    return report


class ShardJob:
    """One shard's work: ``job(input_url, output_url) -> ShardReport``, run as one
    :func:`attempt` (subclasses write ``_run(report)``). Instances pickle (worker processes)."""

    def __call__(self, inp: str, out: str) -> ShardReport:
        return attempt(ShardReport(inp, out), self._run)

    def _run(self, report: ShardReport) -> None:
        raise NotImplementedError


class SampleShardJob(ShardJob):
    """Read one input shard, apply ``fn`` to each sample, write the output shard atomically."""

    def __init__(
        self,
        fn,
        *,
        decode=None,
        on_error: OnError = "raise",
        encoder=True,
        storage_options=None,
        compress=None,
        allow_pipe=False,
        record=False,
        aligned=False,
    ):
        self.record = record or aligned  # keep the output's index (for a manifest)
        self.aligned = aligned  # sample-aligned compression
        self.fn = fn
        if decode is None or decode is False:
            self.decode = None
        elif isinstance(decode, (list, tuple)):
            self.decode = tuple(decode)
        else:
            self.decode = (decode,)
        self.policy = error_policy(on_error)
        self.encoder = encoder
        self.storage_options = storage_options
        self.compress = compress
        self.allow_pipe = allow_pipe

    def _run(self, report: ShardReport) -> None:
        policy = self.policy

        def handle(exn):
            if policy(exn):
                report.samples_skipped += 1
                if len(report.messages) < _MAX_MESSAGES:
                    report.messages.append(describe(exn))
                return True
            raise _PolicyStop(describe(exn))

        def counted(samples):
            for s in samples:
                report.samples_in += 1
                yield s

        samples = counted(
            shard_samples(
                report.input, storage_options=self.storage_options, allow_pipe=self.allow_pipe
            )
        )
        if self.decode is not None:
            samples = _stages.decode(samples, *self.decode, on_error=handle)
        fn = self.fn
        with TarWriter(
            report.output,
            encoder=self.encoder,
            compress=self.compress,
            storage_options=self.storage_options,
            index=self.record,
            aligned=self.aligned,
        ) as sink:
            try:
                for sample in samples:
                    try:
                        result = apply_one(fn, sample)
                        if result is None:
                            continue
                        results = result if isinstance(result, (list, tuple)) else (result,)
                        members = [sink.encode(r) for r in results]
                    except Exception as exn:
                        handle(sample_context(exn, sample))
                        continue
                    for m in members:
                        sink.write_members(m)
                        report.samples_out += 1
            except TarshardsError as exn:
                if isinstance(exn, OSError):
                    raise  # I/O: the attempt fails and the engine tries again
                handle(exn)  # a broken input: keep what came before it if the policy says so
        if sink.index is not None:  # committed: the index it recorded
            report.index = sink.index.to_bytes()


class FileShardJob(ShardJob):
    """Run ``fn(input_url, output_url)``; an int result is the number of samples written."""

    def __init__(self, fn):
        self.fn = fn

    def _run(self, report: ShardReport) -> None:
        result = self.fn(report.input, report.output)
        if isinstance(result, int) and not isinstance(result, bool):
            report.samples_out = result
        elif isinstance(result, dict):
            report.samples_in = int(result.get("samples_in", 0))
            report.samples_out = int(result.get("samples_out", 0))
