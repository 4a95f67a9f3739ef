"""Mapping functions over samples and shards: local worker processes, a Dask or a Ray cluster.

* :func:`map_samples` applies ``fn`` to each sample of a dataset or iterable in worker processes and
  yields the results (in order, or as they finish). An exception in ``fn`` reaches the caller
  naming the sample key, or goes to ``on_error``.
* :func:`map_shards` applies ``fn(sample) -> sample | None | list`` to every sample of each input
  shard and writes the matching output shard. Tasks are shards. Each output is written to a
  temporary name and committed when complete (:class:`~tarshards.write.writer.TarWriter`), outputs
  that
  exist are skipped (so a job that died can be rerun and does only the rest), and a shard whose
  worker process died, or that hit an I/O error, is tried again up to ``retries`` times.
* :func:`map_shard_files` runs ``fn(input_url, output_url)`` for functions that write themselves.

``engine="processes"`` runs on this machine; ``engine="dask"`` runs on a ``dask.distributed``
cluster: a ``LocalCluster`` started for the job, or the cluster at ``address``; ``engine="ray"``
on a Ray cluster: the one this process is connected to, the one at ``address``, or a local one
started for the job. Dask and Ray are imported only when their engine is chosen. Any object with
the :class:`Engine` protocol may be given too.

The package's rooms: ``pool`` (worker processes), ``samples`` (map_samples), ``jobs`` (one shard's
work and the retry rule), ``engines`` (where jobs run), ``shardmap`` (map_shards), ``reports``
(ShardReport, summaries), ``shell`` (shell commands per sample).
"""

from __future__ import annotations

from .engines import ENGINES, DaskEngine, Engine, ProcessEngine, RayEngine
from .reports import DONE, FAILED, SKIPPED, ShardReport, format_summary, summarize
from .samples import map_samples
from .shardmap import map_shard_files, map_shards
from .shell import ShellSampleFn, shell_sample_fn

__all__ = [
    "DONE",
    "ENGINES",
    "FAILED",
    "SKIPPED",
    "DaskEngine",
    "Engine",
    "ProcessEngine",
    "RayEngine",
    "ShardReport",
    "ShellSampleFn",
    "format_summary",
    "map_samples",
    "map_shard_files",
    "map_shards",
    "shell_sample_fn",
    "summarize",
]
