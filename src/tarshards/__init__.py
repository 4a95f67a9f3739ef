"""tarshards: fast, correct streaming of deep-learning datasets stored as sharded tar files.

``import tarshards`` never imports torch. ``WebDataset``, ``DataPipeline`` and ``WebLoader`` are
resolved on first access: with torch installed they are ``torch.utils.data.IterableDataset``
subclasses (from :mod:`tarshards.torch`), otherwise plain iterables (and ``WebLoader`` a stand-in
that raises :class:`MissingDependencyError` saying what to install).
"""

from __future__ import annotations

import importlib

from ._lazy import declare_optional as _declare_optional
from .errors import MissingDependencyError

__version__ = "0.1.0"

# The optional entries of the registries, by name: tarshards.torch implements them and registers
# them when it is imported, which happens the first time one of them is used. The package (the
# top of the import order) declares them, so that codecs and stages never name a higher module;
# the registries pick them up when their modules are imported (tarshards._lazy.declare_optional).
_TORCH = {"module": "tarshards.torch.adapter", "extra": "torch"}
_declare_optional("images.OPTIONAL_ARRAY_KINDS", ["torch-uint8", "torch-float"], **_TORCH)
_declare_optional("codecs.OPTIONAL_CODECS", ["pth"], **_TORCH, safe=False)
_declare_optional("stages.OPTIONAL_COLLATION", ["torch.Tensor"], **_TORCH)
_declare_optional("collation.OPTIONAL_ARRAY_TYPES", ["torch", "torch.Tensor"], **_TORCH)
_declare_optional("crop.OPTIONAL_CROP_CONVERTERS", ["tensor"], **_TORCH)
_declare_optional("media.output.OPTIONAL_MEDIA_CONVERTERS", ["tensor"], **_TORCH)
# batches of clips (tarshards.video / tarshards.audio values): collated by tarshards.media.collate
_declare_optional(
    "stages.OPTIONAL_COLLATION",
    ["tarshards.media.video.VideoClip", "tarshards.media.audio.AudioClip"],
    module="tarshards.media.collate",
    extra="av",
)
# dataset spec files (WebDataset("train.yaml")): read by tarshards.curate.spec, with PyYAML
_declare_optional(
    "specs.OPTIONAL_DATASET_SPECS", [".yaml", ".yml"], module="tarshards.curate.spec", extra="yaml"
)

__all__ = sorted(
    [
        "AudioClip",
        "Codec",
        "CommandError",
        "DataPipeline",
        "DatasetSpec",
        "DecodeError",
        "DuplicateFieldError",
        "DuplicateKeyError",
        "IndexedDataset",
        "KeyIndex",
        "LoaderStats",
        "MixedDataset",
        "IntegrityError",
        "Manifest",
        "MissingDependencyError",
        "PipeNotAllowedError",
        "PlanOptions",
        "RandomResizedCrop",
        "ReadOptions",
        "SafetyOptions",
        "ShardCache",
        "ShardFormatError",
        "ShardIndex",
        "ShardRecord",
        "ShardSpecError",
        "ShardWriteError",
        "ShardWriter",
        "StallError",
        "StallWarning",
        "StorageError",
        "TarWriter",
        "TarshardsError",
        "TarshardsWarning",
        "UnsafeCodecError",
        "VideoClip",
        "View",
        "WebDataset",
        "WebLoader",
        "add_columns",
        "add_meta",
        "audio",
        "audit",
        "batched",
        "build_manifest",
        "collate_packed",
        "collate_padded",
        "convert",
        "decode",
        "decode_value",
        "dedup",
        "default_collation_fn",
        "encode_value",
        "expand_urls",
        "group_samples",
        "handle_extension",
        "ignore_and_continue",
        "ignore_and_stop",
        "iter_samples",
        "iter_tar",
        "join",
        "map_dict",
        "map_samples",
        "map_shard_files",
        "map_shards",
        "map_tuple",
        "media_meta",
        "mix",
        "open_url",
        "parse_size",
        "random_resized_crop",
        "read_media",
        "read_spec",
        "register_codec",
        "rename",
        "reraise_exception",
        "select",
        "shard_samples",
        "shuffle",
        "split",
        "split_by_node",
        "split_by_worker",
        "split_name",
        "to_tuple",
        "unbatched",
        "video",
        "view",
        "warn_and_continue",
        "warn_and_stop",
    ]
)

_LAZY = {"WebDataset", "DataPipeline", "WebLoader", "IndexedDataset", "MixedDataset", "mix"}
# without torch: where the plain versions of the _LAZY names are
_PLAIN = {"IndexedDataset": "read.indexed", "MixedDataset": "plan.mixing", "mix": "plan.mixing"}
# every other public name -> the module that defines it, imported on first access (PEP 562), so
# that `import tarshards` (and each command's start-up) loads only what is used
_MODULE_OF = {
    "codecs.registry": ["Codec", "decode_value", "encode_value", "register_codec"],
    "pipeline.collation": ["collate_packed", "collate_padded"],
    "codecs.crop": ["RandomResizedCrop", "random_resized_crop"],
    "curate": ["KeyIndex", "add_meta", "add_columns", "join"],
    "curate.views": ["View", "dedup", "split", "view"],
    "errors": [
        "CommandError",
        "DecodeError",
        "DuplicateFieldError",
        "DuplicateKeyError",
        "IntegrityError",
        "MissingDependencyError",
        "PipeNotAllowedError",
        "ShardFormatError",
        "ShardSpecError",
        "ShardWriteError",
        "StallError",
        "StallWarning",
        "StorageError",
        "TarshardsError",
        "TarshardsWarning",
        "UnsafeCodecError",
    ],
    "format.names": ["group_samples", "parse_size", "split_name"],
    "format.index": ["ShardIndex"],
    "plan.ledger": ["audit"],
    "format.manifest": ["Manifest", "ShardRecord", "build_manifest"],
    "media.audio": ["AudioClip", "audio"],
    "media.probe": ["media_meta"],
    "media.access": ["read_media"],
    "media.video": ["VideoClip", "video"],
    "parallel": ["map_samples", "map_shard_files", "map_shards"],
    "pipeline.dataset": ["iter_samples", "shard_samples"],
    "plan.shards": ["split_by_node", "split_by_worker"],
    "read.specs": ["expand_urls"],
    "stats": ["LoaderStats"],
    "pipeline.stages": [
        "batched",
        "decode",
        "default_collation_fn",
        "handle_extension",
        "ignore_and_continue",
        "ignore_and_stop",
        "map_dict",
        "map_tuple",
        "rename",
        "reraise_exception",
        "select",
        "shuffle",
        "to_tuple",
        "unbatched",
        "warn_and_continue",
        "warn_and_stop",
    ],
    "storage": ["ShardCache", "open_url"],
    "tario": ["iter_tar"],
    "types": ["PlanOptions", "ReadOptions", "SafetyOptions"],
    "curate.spec": ["DatasetSpec", "read_spec"],  # dataset spec files (YAML blends)
    "write.writer": ["ShardWriter", "TarWriter"],
}
_LAZY_MODULES = {name: module for module, names in _MODULE_OF.items() for name in names}
# the packages and modules, reachable as attributes after `import tarshards` (imported on first
# access); a module's name from before the packages (tarshards.stages...) names its new place
_SUBMODULES = {
    "benchmark": "benchmark",
    "codecs": "codecs",
    "collation": "pipeline.collation",
    "compat": "compat",
    "composition": "pipeline.composition",
    "compression": "format.compression",
    "convert": "convert",
    "crop": "codecs.crop",
    "curate": "curate",
    "decoding": "codecs.decoding",
    "errors": "errors",
    "format": "format",
    "fusion": "pipeline.fusion",
    "hashing": "format.hashing",
    "images": "codecs.images",
    "index": "format.index",
    "indexed": "read.indexed",
    "ledger": "plan.ledger",
    "manifest": "format.manifest",
    "media": "media",
    "mixing": "plan.mixing",
    "on_error": "on_error",
    "packing": "plan.packing",
    "parallel": "parallel",
    "pipeline": "pipeline",
    "plan": "plan",
    "planned": "plan.planned",
    "read": "read",
    "reading": "read.reading",
    "selection": "format.selection",
    "shards": "plan.shards",
    "sidecar": "read.sidecar",
    "source": "plan.cursor",
    "specs": "read.specs",
    "stages": "pipeline.stages",
    "stateful": "pipeline.stateful",
    "stats": "stats",
    "storage": "storage",
    "tario": "tario",
    "tenbin": "format.tenbin",
    "testing": "testing",
    "types": "types",
    "web": "web",
    "write": "write",
    "writer": "write.writer",
}


# subpackages that are also called as functions: ``tarshards.convert(src, output)`` (importing
# the package binds its module here, so the module itself is callable; see tarshards.convert)
_CALLABLE_SUBMODULES = frozenset(["convert"])


def __getattr__(name: str):
    if name in _LAZY_MODULES:
        value = getattr(importlib.import_module(f"tarshards.{_LAZY_MODULES[name]}"), name)
        globals()[name] = value
        return value
    if name in _LAZY:
        try:
            mod = importlib.import_module("tarshards.torch.adapter")
        except ImportError as exc:
            if getattr(exc, "name", "") not in ("torch", None):
                raise
            value = (
                _no_torch_loader
                if name == "WebLoader"
                else getattr(
                    importlib.import_module(f"tarshards.{_PLAIN.get(name, 'pipeline.dataset')}"),
                    name,
                )
            )
        else:
            value = getattr(mod, name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        module = importlib.import_module(f"tarshards.{_SUBMODULES[name]}")
        globals()[name] = module
        return module
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
