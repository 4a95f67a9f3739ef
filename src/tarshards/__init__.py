"""tarshards: fast, correct streaming of deep-learning datasets stored as sharded tar files.

``import tarshards`` never imports torch. ``WebDataset``, ``DataPipeline`` and ``WebLoader`` are
resolved on first access: with torch installed they are ``torch.utils.data.IterableDataset``
subclasses (from :mod:`tarshards.torch`), otherwise plain iterables (and ``WebLoader`` a stand-in
that raises :class:`MissingDependencyError` saying what to install).
"""

from __future__ import annotations

import importlib

from . import codecs as _codecs
from . import crop as _crop
from . import stages as _stages
from .codecs import Codec, decode_value, encode_value, register_codec
from .errors import (
    CommandError,
    DecodeError,
    DuplicateFieldError,
    MissingDependencyError,
    PipeNotAllowedError,
    ShardFormatError,
    ShardWriteError,
    StorageError,
    TarshardsError,
    TarshardsWarning,
    UnsafeCodecError,
)
from .format import group_samples, parse_size, split_name
from .pipeline import iter_samples, shard_samples
from .shards import split_by_node, split_by_worker
from .specs import expand_urls
from .stages import (
    batched,
    decode,
    default_collation_fn,
    handle_extension,
    ignore_and_continue,
    ignore_and_stop,
    map_dict,
    map_tuple,
    rename,
    reraise_exception,
    select,
    shuffle,
    to_tuple,
    unbatched,
    warn_and_continue,
    warn_and_stop,
)
from .storage import open_url
from .tario import iter_tar
from .writer import ShardWriter, TarWriter

__version__ = "0.1.0"

# The optional entries of the registries, by name: tarshards.torch implements them and registers
# them when it is imported, which happens the first time one of them is used. The package (the
# top of the import order) declares them, so that codecs and stages never name a higher module.
_TORCH = {"module": "tarshards.torch", "extra": "torch"}
_codecs.OPTIONAL_ARRAY_KINDS.declare(["torch-uint8", "torch-float"], **_TORCH)
_codecs.OPTIONAL_CODECS.declare(["pth"], **_TORCH, safe=False)
_stages.OPTIONAL_COLLATION.declare(["torch.Tensor"], **_TORCH)
_crop.OPTIONAL_CROP_CONVERTERS.declare(["tensor"], **_TORCH)

__all__ = sorted(
    [
        "Codec",
        "CommandError",
        "DataPipeline",
        "DecodeError",
        "DuplicateFieldError",
        "IndexedDataset",
        "MixedDataset",
        "IntegrityError",
        "Manifest",
        "MissingDependencyError",
        "PipeNotAllowedError",
        "RandomResizedCrop",
        "ShardCache",
        "ShardFormatError",
        "ShardIndex",
        "ShardRecord",
        "ShardWriteError",
        "ShardWriter",
        "StorageError",
        "TarWriter",
        "TarshardsError",
        "TarshardsWarning",
        "UnsafeCodecError",
        "WebDataset",
        "WebLoader",
        "batched",
        "decode",
        "decode_value",
        "default_collation_fn",
        "encode_value",
        "expand_urls",
        "group_samples",
        "handle_extension",
        "ignore_and_continue",
        "ignore_and_stop",
        "iter_samples",
        "iter_tar",
        "map_dict",
        "map_samples",
        "map_shard_files",
        "map_shards",
        "map_tuple",
        "mix",
        "open_url",
        "parse_size",
        "random_resized_crop",
        "register_codec",
        "rename",
        "reraise_exception",
        "select",
        "shard_samples",
        "shuffle",
        "split_by_node",
        "split_by_worker",
        "split_name",
        "to_tuple",
        "unbatched",
        "warn_and_continue",
        "warn_and_stop",
    ]
)

_LAZY = {"WebDataset", "DataPipeline", "WebLoader", "IndexedDataset", "MixedDataset", "mix"}
# without torch: where the plain versions of the _LAZY names are
_PLAIN = {"IndexedDataset": "indexed", "MixedDataset": "mixing", "mix": "mixing"}
# modules imported on first use, to keep `import tarshards` (and CLI start-up) light
_LAZY_MODULES = {
    "ShardCache": "storage",
    "map_samples": "parallel",
    "map_shard_files": "parallel",
    "map_shards": "parallel",
    "Manifest": "manifest",
    "ShardRecord": "manifest",
    "ShardIndex": "index",
    "IntegrityError": "errors",
}
_LAZY_MODULES.update(RandomResizedCrop="crop", random_resized_crop="crop")


def __getattr__(name: str):
    if name in _LAZY_MODULES:
        value = getattr(importlib.import_module(f"tarshards.{_LAZY_MODULES[name]}"), name)
        globals()[name] = value
        return value
    if name in _LAZY:
        try:
            mod = importlib.import_module("tarshards.torch")
        except ImportError as exc:
            if getattr(exc, "name", "") not in ("torch", None):
                raise
            value = (
                _no_torch_loader
                if name == "WebLoader"
                else getattr(
                    importlib.import_module(f"tarshards.{_PLAIN.get(name, 'pipeline')}"), name
                )
            )
        else:
            value = getattr(mod, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tarshards' has no attribute {name!r}")


class _no_torch_loader:
    """``WebLoader`` where torch is not installed: using it says what to install (so that
    ``from tarshards import *`` works without torch)."""

    def __init__(self, *args, **kwargs):
        raise MissingDependencyError(
            "WebLoader is a torch DataLoader: pip install 'tarshards[torch]'"
        )


_no_torch_loader.__name__ = _no_torch_loader.__qualname__ = "WebLoader"


def __dir__():
    return __all__
