"""webdataset's shard lists and splitters: streams of ``{"url": ...}`` dicts.

``SimpleShardList`` expands a shard spec with tarshards' rules (braces, ``::``, globs, list
files); ``${VAR}`` is substituted from ``WDS_VAR`` only when asked (``expand_env=True`` or
:func:`envsubst`), since a shard spec should not change with the environment behind the caller's
back. ``ResampledShards(urls, deterministic=True)`` draws shards from a generator seeded by
(seed, epoch, rank, worker) alone. Rank and worker come from :mod:`tarshards.torch`.
"""

from __future__ import annotations

import glob
import itertools
import os
import random
import re
import sys
import time
from typing import Iterable, Iterator

from ..plan.shards import make_rng
from ..read.specs import expand_urls as _ts_expand_urls
from ._base import IterableDataset
from .filters import pipelinefilter
from .utils import pytorch_worker_info, pytorch_worker_seed

__all__ = [
    "DirectoryShardList",
    "ResampledShardList",
    "ResampledShards",
    "SimpleShardList",
    "envsubst",
    "expand_source",
    "expand_urls",
    "non_empty",
    "resampled",
    "shardspec",
    "single_node_only",
    "split_by_node",
    "split_by_worker",
]

_VAR = re.compile(r"\$\{(\w+)\}")


def envsubst(spec: str) -> str:
    """Replace ``${NAME}`` by the environment variable ``WDS_NAME`` (webdataset's rule); a
    missing variable is an error."""

    def lookup(m):
        name = "WDS_" + m.group(1)
        if name not in os.environ:
            raise ValueError(f"shard spec {spec!r} uses ${{{m.group(1)}}} but {name} is not set")
        return os.environ[name]

    for _ in range(10):
        new = _VAR.sub(lookup, spec)
        if new == spec:
            break
        spec = new
    return spec


def expand_urls(urls, expand_env: bool = False) -> list[str]:
    """A shard spec (or list) as a list of URLs (``expand_env``: substitute ``${VAR}`` first)."""
    if isinstance(urls, str):
        if expand_env:
            urls = envsubst(urls)
        return _ts_expand_urls(urls)
    return [os.fspath(u) for u in urls]


def expand_source(source, max_urls: int = int(1e9), expand_env: bool = False) -> list[str]:
    if isinstance(source, str):
        return expand_urls(source, expand_env)
    if isinstance(source, Iterable):
        return [
            u if isinstance(u, str) else os.fspath(u) for u in itertools.islice(source, max_urls)
        ]
    raise ValueError(f"cannot make a shard list from {type(source).__name__}")


class SimpleShardList(IterableDataset):
    """The shards of a spec as ``{"url": ...}`` dicts; ``seed``: shuffled with that seed."""

    def __init__(self, urls, seed=None, *, expand_env: bool = False):
        super().__init__()
        self.urls = expand_urls(urls, expand_env)
        if not self.urls:
            raise ValueError(f"the shard spec {urls!r} names no shards")
        self.seed = 0 if seed is True else seed

    def __len__(self):
        return len(self.urls)

    def __iter__(self) -> Iterator[dict]:
        urls = list(self.urls)
        if self.seed is not None:
            random.Random(self.seed).shuffle(urls)
        for url in urls:
            yield {"url": url}


class ResampledShards(IterableDataset):
    """Shards drawn with replacement, ``nshards`` of them per pass (forever by default).

    ``deterministic=True``: each pass draws from a generator seeded by ``(seed, epoch,
    worker_seed())`` only (``worker_seed`` defaults to ``rank * 1000 + worker``); inside a
    :class:`~tarshards.compat.DataPipeline` the epoch is the pipeline's (``set_epoch`` /
    ``WebLoader``), otherwise it is counted per pass. ``deterministic=False`` (webdataset's
    default) also mixes in fresh entropy, so runs differ.
    """

    def __init__(
        self,
        urls,
        nshards: int = sys.maxsize,
        seed: int = 0,
        worker_seed=None,
        deterministic: bool = False,
        max_urls: int = int(1e6),
        empty_check: bool = True,
        *,
        expand_env: bool = False,
    ):
        super().__init__()
        self.urls = expand_source(urls, max_urls, expand_env)
        if empty_check and not self.urls:
            raise ValueError("empty_check=True, but no shards found in ResampledShards")
        self.nshards = nshards
        self.worker_seed = pytorch_worker_seed if worker_seed is None else worker_seed
        self.deterministic = deterministic
        self.seed = seed
        self.epoch = -1

    def __iter__(self) -> Iterator[dict]:
        self.epoch += 1
        return self._draw(self.epoch, self.worker_seed())

    def pipeline_source(self, ctx: dict) -> Iterator[dict]:
        """Called by DataPipeline: the epoch is the pipeline's, the reader the one it runs in."""
        self.epoch = ctx["epoch"]
        if self.worker_seed is pytorch_worker_seed:
            reader = ctx["rank"] * 1000 + ctx["worker"]
        else:
            reader = self.worker_seed()
        return self._draw(ctx["epoch"], reader)

    def _draw(self, epoch: int, reader) -> Iterator[dict]:
        parts = ["resample", self.seed, epoch, reader]
        if not self.deterministic:
            parts += [os.getpid(), os.urandom(8).hex()]
        rng = make_rng(*parts)
        urls, n = self.urls, len(self.urls)
        for _ in range(self.nshards):
            yield {"url": urls[rng.randrange(n)]}


ResampledShardList = ResampledShards


def _split(src, index: int, count: int):
    if count > 1:
        return itertools.islice(src, index, None, count)
    return iter(src)


def split_by_node(src, group=None, *, rank: int | None = None, world_size: int | None = None):
    """Every ``world_size``-th item starting at this node's rank (rank/world size discovered
    through torch.distributed unless given)."""
    if rank is None or world_size is None:
        r, w, _, _ = pytorch_worker_info(group=group)
        rank = r if rank is None else rank
        world_size = w if world_size is None else world_size
    yield from _split(src, rank, world_size)


def single_node_only(src, group=None):
    """Pass everything through; an error on more than one node (split explicitly there)."""
    _, world, _, _ = pytorch_worker_info(group=group)
    if world > 1:
        raise ValueError(
            "you need to add an explicit nodesplitter to your input pipeline for "
            "multi-node training"
        )
    yield from src


def split_by_worker(src, *, worker: int | None = None, num_workers: int | None = None):
    """Every ``num_workers``-th item starting at this DataLoader worker's id."""
    if worker is None or num_workers is None:
        _, _, w, n = pytorch_worker_info()
        worker = w if worker is None else worker
        num_workers = n if num_workers is None else num_workers
    yield from _split(src, worker, num_workers)


def non_empty(src):
    """Pass everything through; a ``ValueError`` if there was nothing."""
    empty = True
    for item in src:
        empty = False
        yield item
    if empty:
        raise ValueError("pipeline stage received no data at all and this was declared as an error")


def _resampled(src, n: int = sys.maxsize, rng=None):
    """Draw ``n`` items with replacement from everything ``src`` yields (seeded by the
    pipeline)."""
    items = list(src)
    if not items:
        return
    rng = random.Random() if rng is None else rng
    for _ in range(n):
        yield items[rng.randrange(len(items))]


resampled = pipelinefilter(_resampled)


def shardspec(spec: str, *, expand_env: bool = False):
    """A shard list for a spec (webdataset also reads ``.yaml`` specs; tarshards does not)."""
    if spec.endswith((".yaml", ".yml")):
        raise ValueError(
            "yaml dataset specs are not supported by tarshards.compat; list the shards instead"
        )
    return SimpleShardList(spec, expand_env=expand_env)


def _alternatives(pattern: str) -> list[str]:
    """``"*.{tar,tgz}"`` -> ``["*.tar", "*.tgz"]`` (comma alternatives in braces)."""
    m = re.search(r"\{([^{}]*,[^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    return [
        alt
        for choice in m.group(1).split(",")
        for alt in _alternatives(pattern[: m.start()] + choice + pattern[m.end() :])
    ]


def _pid_of(fname: str) -> int | None:
    m = re.match(r"^.*\._(\d+)_$", fname)
    return int(m.group(1)) if m else None


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


class DirectoryShardList(IterableDataset):
    """Shards taken from a directory as they appear (a work queue shared by processes).

    Each shard is claimed by renaming it to ``NAME._PID_`` (so no two processes take it), handed
    out as ``{"url": ...}``, and after use deleted (``mode="unlink"``), renamed ``NAME._done_``
    (``"keep"``) or put back (``"resample"``). ``select``: ``"random"`` or ``"oldest"``. With
    ``poll=None`` the iteration ends when the directory has no shard left; otherwise it waits
    ``poll`` seconds between looks, for at most ``timeout`` seconds.
    """

    def __init__(
        self,
        path: str,
        pattern: str = "*.{tar,tgz,tar.tgz}",
        poll=1,
        timeout: float = 1e12,
        mode: str = "resample",
        select: str = "random",
        fate=None,
    ):
        if not path.endswith("/") or not os.path.isdir(path):
            raise ValueError(
                f"DirectoryShardList needs an existing directory ending in '/': {path!r}"
            )
        if mode not in ("unlink", "keep", "resample"):
            raise ValueError(f"mode must be unlink, keep or resample, not {mode!r}")
        if select not in ("random", "oldest"):
            raise ValueError(f"select must be random or oldest, not {select!r}")
        self.path, self.pattern, self.poll, self.timeout = path, pattern, poll, timeout
        self.mode, self.select, self.fate = mode, select, fate

    def _candidates(self) -> list[str]:
        names = set()
        for pat in _alternatives(self.pattern):
            names.update(glob.glob(os.path.join(self.path, pat)))
        return sorted(names)

    def recycle(self, activename: str) -> None:
        """Dispose of a claimed shard according to ``mode``."""
        base = re.sub(r"\._\d+_$", "", activename)
        if self.mode == "unlink":
            os.unlink(activename)
        elif self.mode == "keep":
            os.rename(activename, base + "._done_")
        else:
            os.rename(activename, base)

    def cleanup_files_without_processes(self) -> None:
        """Recycle shards claimed by processes that no longer run."""
        for fname in glob.glob(os.path.join(self.path, "*._*_")):
            pid = _pid_of(fname)
            if pid is not None and not _running(pid):
                self.recycle(fname)

    def __iter__(self) -> Iterator[dict]:
        start = time.monotonic()
        rng = random.Random()
        while time.monotonic() - start < self.timeout:
            candidates = self._candidates()
            if not candidates:
                if self.poll is None:
                    return
                time.sleep(self.poll)
                continue
            if self.select == "oldest":
                candidate = min(candidates, key=lambda f: os.stat(f).st_mtime)
            else:
                candidate = rng.choice(candidates)
            active = f"{candidate}._{os.getpid()}_"
            try:
                os.rename(candidate, active)
            except FileNotFoundError:  # another process claimed it first
                continue
            yield {"url": active}
            self.recycle(active)
            self.cleanup_files_without_processes()
