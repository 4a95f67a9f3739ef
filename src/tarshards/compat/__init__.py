"""webdataset's public API on tarshards: ``import tarshards.compat as wds``.

Changing ``import webdataset as wds`` to ``import tarshards.compat as wds`` is the whole
migration for code that uses webdataset's public names: ``DataPipeline`` with shard lists,
splitters and curried filters, ``WebDataset``/``WebLoader`` with their fluent methods,
``TarWriter``/``ShardWriter``, ``tenbin``, the decoders and handlers. Every stage is tarshards'
one implementation (:mod:`tarshards.pipeline.stages`, the tar reader, the codec registry); what
behaves
differently on purpose (deterministic seeds, no pickle or ``pipe:`` unless allowed, handlers
that never sleep) is listed in ``docs/migration.md``.

Importing this module imports torch when it is installed (webdataset's datasets are torch
``IterableDataset`` instances); ``import tarshards`` alone never does.
"""

from __future__ import annotations

from . import autodecode, filters, handlers, shardlists, tariterators, tenbin, utils  # noqa: F401
from .autodecode import (
    Continue,
    Decoder,
    DecodingError,
    ImageHandler,
    gzfilter,
    handle_extension,
    imagehandler,
    torch_loads,
)
from .compat import FluidInterface, FluidWrapper, WebDataset, WebLoader
from .extradatasets import MockDataset, with_epoch, with_length
from .filters import (
    Cached,
    associate,
    batched,
    decode,
    default_collation_fn,
    detshuffle,
    extract_keys,
    getfirst,
    info,
    listed,
    log_keys,
    map,
    map_dict,
    map_tuple,
    pipelinefilter,
    rename,
    rename_keys,
    rsample,
    select,
    shuffle,
    slice,
    to_tuple,
    transform_with,
    unbatched,
    unlisted,
    xdecode,
)
from .gopen import gopen, gopen_schemes
from .handlers import (
    ignore_and_continue,
    ignore_and_stop,
    reraise_exception,
    warn_and_continue,
    warn_and_stop,
)
from .mix import RandomMix, RoundRobin
from .pipeline import DataPipeline
from .shardlists import (
    ResampledShards,
    SimpleShardList,
    envsubst,
    expand_urls,
    non_empty,
    resampled,
    shardspec,
    single_node_only,
    split_by_node,
    split_by_worker,
)
from .tariterators import (
    base_plus_ext,
    group_by_keys,
    tar_file_expander,
    tar_file_iterator,
    tarfile_samples,
    tarfile_to_samples,
    url_opener,
    valid_sample,
)
from .utils import PipelineStage, make_seed, pytorch_worker_info, pytorch_worker_seed, repeatedly
from .writer import ShardWriter, TarWriter

__version__ = "1.0.2"  # the webdataset API this module follows

pytorch_weights_only = False  # accepted for compatibility; .pth needs allow_unsafe=True anyway

__all__ = sorted(
    [
        "Cached",
        "Continue",
        "DataPipeline",
        "Decoder",
        "DecodingError",
        "FluidInterface",
        "FluidWrapper",
        "ImageHandler",
        "MockDataset",
        "PipelineStage",
        "RandomMix",
        "ResampledShards",
        "RoundRobin",
        "ShardWriter",
        "SimpleShardList",
        "TarWriter",
        "WebDataset",
        "WebLoader",
        "associate",
        "autodecode",
        "base_plus_ext",
        "batched",
        "decode",
        "default_collation_fn",
        "detshuffle",
        "envsubst",
        "expand_urls",
        "extract_keys",
        "filters",
        "getfirst",
        "gopen",
        "gopen_schemes",
        "group_by_keys",
        "gzfilter",
        "handle_extension",
        "handlers",
        "ignore_and_continue",
        "ignore_and_stop",
        "imagehandler",
        "info",
        "listed",
        "log_keys",
        "make_seed",
        "map",
        "map_dict",
        "map_tuple",
        "non_empty",
        "pipelinefilter",
        "pytorch_worker_info",
        "pytorch_worker_seed",
        "rename",
        "rename_keys",
        "repeatedly",
        "reraise_exception",
        "resampled",
        "rsample",
        "select",
        "shardlists",
        "shardspec",
        "shuffle",
        "single_node_only",
        "slice",
        "split_by_node",
        "split_by_worker",
        "tar_file_expander",
        "tar_file_iterator",
        "tarfile_samples",
        "tarfile_to_samples",
        "tariterators",
        "tenbin",
        "to_tuple",
        "torch_loads",
        "transform_with",
        "unbatched",
        "unlisted",
        "url_opener",
        "utils",
        "valid_sample",
        "warn_and_continue",
        "warn_and_stop",
        "with_epoch",
        "with_length",
        "xdecode",
    ]
)
