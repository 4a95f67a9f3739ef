"""webdataset's ``WebDataset``, ``WebLoader`` and ``FluidWrapper`` on tarshards.

``WebDataset`` takes webdataset 1.0's arguments and is tarshards' own ``WebDataset`` underneath
(shard order from (seed, epoch), split by rank and worker, the C reader, the shard cache), with
webdataset's fluent methods and ``.repeat()``. ``WebLoader`` is a pipeline over tarshards'
``WebLoader`` (a ``DataLoader`` that advances the dataset's epoch), so ``.unbatched()
.shuffle(n).batched(m)`` work on the loader.
"""

from __future__ import annotations

import warnings

from ..pipeline.stages import reraise_exception
from ._base import TSWebDataset, TSWebLoader
from .pipeline import DataPipeline, FluidInterface, _CompatMixin
from .shardlists import envsubst
from .tariterators import _policy, tarfile_samples

__all__ = ["FluidInterface", "FluidWrapper", "WebDataset", "WebLoader"]


def _dict_splitter(splitter):
    """A webdataset splitter works on ``{"url": ...}`` dicts; tarshards hands it URLs."""
    if splitter is None:
        return None

    def split(urls):
        return splitter({"url": u} for u in urls)

    split.__name__ = getattr(splitter, "__name__", "splitter")
    return split


class WebDataset(_CompatMixin, FluidInterface, TSWebDataset):
    """webdataset 1.0's ``WebDataset(urls, handler=..., shardshuffle=..., resampled=...)``.

    Differences (see docs/migration.md): ``seed=None`` means 0 (every run the same order);
    ``shardshuffle=N`` shuffles the whole shard list each epoch; without ``nodesplitter`` shards
    are split by rank as well as by worker; ``pipe:`` URLs need ``allow_pipe=True``; ``${VAR}``
    needs ``expand_env=True``; ``empty_check`` raises only when a reader's shards hold no sample.
    """

    def __init__(
        self,
        urls,
        handler=reraise_exception,
        mode=None,
        resampled=False,
        repeat=False,
        shardshuffle=None,
        cache_size=-1,
        cache_dir=None,
        url_to_name=None,
        detshuffle=False,
        nodesplitter=None,
        workersplitter=None,
        select_files=None,
        rename_files=None,
        empty_check=True,
        verbose=False,
        seed=None,
        *,
        allow_pipe: bool = False,
        expand_env: bool = False,
        storage_options=None,
        rank=None,
        world_size=None,
        retries: int = 5,
    ):
        if isinstance(urls, dict) or (isinstance(urls, str) and urls.endswith((".yaml", ".yml"))):
            raise ValueError(
                "yaml/dict dataset specs are not supported by tarshards.compat; pass the shard spec"
            )
        if mode == "resampled":
            resampled = True
        if resampled and shardshuffle not in (None, False, 0):
            warnings.warn(
                "WebDataset(shardshuffle=...) is ignored for resampled datasets", stacklevel=2
            )
        if isinstance(urls, str) and expand_env:
            urls = envsubst(urls)
        if cache_dir is not None and cache_size == 0:
            cache_dir = None
        TSWebDataset.__init__(
            self,
            urls,
            shardshuffle=bool(shardshuffle) and not resampled,
            resampled=resampled,
            seed=0 if seed is None else int(seed),
            handler=_policy(handler),
            nodesplitter=_dict_splitter(nodesplitter),
            workersplitter=_dict_splitter(workersplitter),
            empty_check=empty_check,
            rank=rank,
            world_size=world_size,
            storage_options=storage_options,
            allow_pipe=allow_pipe,
            cache_dir=cache_dir,
            cache_size=None if cache_size is None or cache_size < 0 else cache_size,
            retries=retries,
        )
        self._init_compat()
        self.select_files = select_files
        self.rename_files = rename_files
        if repeat:
            self.repeat()

    def read_samples(self, ctx: dict):
        if self.select_files is None and self.rename_files is None:
            samples = TSWebDataset.read_samples(self, ctx)
        else:
            urls = ({"url": u} for u in self.shard_list(ctx))
            samples = tarfile_samples(
                urls,
                handler=self.handler,
                select_files=self.select_files,
                rename_files=self.rename_files,
                allow_pipe=self.allow_pipe,
                storage_options=self.storage_options,
            )
        cache = getattr(self._opener, "__self__", None)  # the ShardCache of cache_dir=
        if cache is None:
            return samples
        return _with_local_path(samples, cache)


def _with_local_path(samples, cache):
    """webdataset's ``__local_path__`` with ``cache_dir=``: the file the sample was read from."""
    paths: dict = {}
    for sample in samples:
        url = sample.get("__url__")
        if url is not None:
            path = paths.get(url)
            if path is None:
                path = paths[url] = cache.local_path(url)
            sample["__local_path__"] = path
        yield sample


class FluidWrapper(DataPipeline):
    """A pipeline over any iterable, with webdataset's fluent methods."""

    def __init__(self, initial, **kwargs):
        DataPipeline.__init__(self, initial, **kwargs)


class WebLoader(DataPipeline):
    """``WebLoader(dataset, batch_size=..., num_workers=...)``: a ``DataLoader`` (tarshards'
    ``WebLoader``, which sets the dataset's epoch each pass) with webdataset's fluent methods."""

    def __init__(self, *args, **kwargs):
        if TSWebLoader is None:
            raise ImportError("WebLoader needs torch: pip install torch")
        self.loader = TSWebLoader(*args, **kwargs)
        DataPipeline.__init__(self, self.loader)

    def __len__(self):
        if self._length is not None:
            return self._length
        return len(self.loader)
