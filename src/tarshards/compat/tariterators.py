"""webdataset's tar reading stages over tarshards' reader.

The building blocks (``url_opener`` -> ``tar_file_expander`` -> ``group_by_keys``) pass webdataset's
dicts (``{"url", "stream"}``, then ``{"fname", "data", "__url__"}``) so that code assembling its
own ``tarfile_to_samples`` from them runs unchanged. ``tarfile_samples`` itself reads each shard
with :func:`tarshards.pipeline.dataset.iter_samples` (the C fast path) unless files are selected or
renamed. Members are parsed by :mod:`tarshards.tario`; errors are tarshards errors naming shard,
member and offset (a corrupt shard's is also a ``tarfile.ReadError``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, TypeGuard

from ..errors import PipeNotAllowedError, TarshardsError
from ..format.names import group_samples, split_name
from ..pipeline.dataset import iter_samples
from ..pipeline.stages import reraise_exception
from ..tario import iter_tar, tar_byte_source
from .filters import pipelinefilter
from .gopen import _Opened

__all__ = [
    "base_plus_ext",
    "group_by_keys",
    "tar_file_expander",
    "tar_file_iterator",
    "tarfile_samples",
    "tarfile_to_samples",
    "url_opener",
    "valid_sample",
]

meta_prefix = "__"
meta_suffix = "__"


def base_plus_ext(path: str):
    """``"dir/key.seg.png"`` -> ``("dir/key", "seg.png")``; ``(None, None)`` for a member that is
    not part of a sample (tarshards' key rule: the key ends at the first dot of the file name)."""
    parts = split_name(path)
    if parts is None:
        return None, None
    name = path[2:] if path.startswith("./") else path
    return parts[0], name[len(parts[0]) + 1 :]


def valid_sample(sample: Any) -> TypeGuard[dict[str, Any]]:
    """True for a non-empty sample dict not marked ``__bad__``."""
    return (
        sample is not None
        and isinstance(sample, dict)
        and len(sample) > 0
        and not sample.get("__bad__", False)
    )


def _policy(handler: Callable) -> Callable:
    """The handler for data errors; refusing ``pipe:`` is a configuration error and raises."""
    if handler is reraise_exception or getattr(handler, "_tarshards_policy", False):
        return handler

    def decide(exn):
        if isinstance(exn, PipeNotAllowedError):
            raise exn
        return handler(exn)

    decide._tarshards_policy = True  # type: ignore[attr-defined]  # a marker on the function
    decide.__name__ = getattr(handler, "__name__", "handler")
    return decide


def url_opener(data: Iterable[dict], handler: Callable = reraise_exception, **kw) -> Iterator[dict]:
    """Add ``stream`` (an open binary file) to each ``{"url": ...}`` dict.

    ``kw`` goes to :func:`tarshards.open_url` (``allow_pipe=True``, ``storage_options=``...).
    The consumer closes the stream (``tar_file_expander`` does).
    """
    decide = _policy(handler)
    for sample in data:
        if not isinstance(sample, dict) or "url" not in sample:
            raise TypeError(f"url_opener expects dicts with a 'url', got {sample!r}")
        url = sample["url"]
        try:
            stream = _Opened(url, "rb", **kw)
        except Exception as exn:
            if isinstance(exn, TarshardsError):
                exn.with_context(url=url)
            if decide(exn):
                continue
            return
        sample = dict(sample)
        sample["stream"] = stream
        yield sample


def tar_file_iterator(
    fileobj,
    skip_meta=None,
    handler: Callable = reraise_exception,
    select_files: Callable | None = None,
    rename_files: Callable | None = None,
    url=None,
) -> Iterator[dict]:
    """``{"fname", "data"}`` for each regular member of a tar stream (gzip/zstd detected)."""
    for name, data, offset in iter_tar(tar_byte_source(fileobj, url, direct=True), url):
        if select_files is not None and not select_files(name):
            continue
        if rename_files is not None:
            name = rename_files(name)
            if name is None:
                continue
        yield {"fname": name, "data": data, "__offset__": offset}


def tar_file_expander(
    data: Iterable[dict],
    handler: Callable = reraise_exception,
    select_files: Callable | None = None,
    rename_files: Callable | None = None,
    eof_value=None,
) -> Iterator[dict]:
    """The members of each opened shard, as ``{"fname", "data", "__url__"}`` dicts."""
    decide = _policy(handler)
    for source in data:
        url = source["url"]
        stream = source["stream"]
        try:
            with stream:
                for member in tar_file_iterator(
                    stream,
                    handler=handler,
                    url=url,
                    select_files=select_files,
                    rename_files=rename_files,
                ):
                    member["__url__"] = url
                    yield member
        except Exception as exn:
            if isinstance(exn, TarshardsError):
                exn.with_context(url=url)
            elif isinstance(exn, OSError):
                from ..errors import StorageError

                exn = StorageError(f"read failed: {exn}", url=url)
            if decide(exn):
                continue
            return
        if eof_value is not None:
            yield eof_value


def group_by_keys(
    data: Iterable[dict],
    keys: Callable = base_plus_ext,
    lcase: bool = True,
    suffixes=None,
    handler: Callable | None = None,
) -> Iterator[dict]:
    """Group consecutive members with the same key (and shard) into samples.

    With the default ``keys`` this is tarshards' grouping
    (:func:`tarshards.format.names.group_samples`,
    one shard at a time); a custom ``keys(fname) -> (key, suffix)`` gets the same rules.
    ``suffixes``: keep only these extensions. A repeated extension in one sample is an error
    (a ``ValueError``) unless ``handler`` skips it.
    """
    handler = reraise_exception if handler is None else handler
    if keys is base_plus_ext and lcase:
        yield from _group_default(data, suffixes, handler)
        return
    current = None
    for member in data:
        if not member:
            continue
        fname, value, url = member["fname"], member["data"], member.get("__url__")
        prefix, suffix = keys(fname)
        if prefix is None:
            continue
        if lcase:
            suffix = suffix.lower()
        if current is None or prefix != current["__key__"] or current["__url__"] != url:
            if valid_sample(current):
                yield current
            # as the default grouping: the offset of the sample's first member (None when
            # the member dicts were made without one)
            current = {"__key__": prefix, "__url__": url, "__offset__": member.get("__offset__")}
        if suffixes is None or suffix in suffixes:
            if suffix in current:
                exn = ValueError(f"{fname}: duplicate file name in tar file {suffix} (shard {url})")
                if handler(exn):
                    continue
                return
            current[suffix] = value
    if valid_sample(current):
        yield current


def _group_default(data, suffixes, handler):
    def runs():
        url = None
        run: list[tuple[str, Any, int | None]] = []
        for member in data:
            if not member:
                continue
            if member.get("__url__") != url and run:
                yield url, run
                run = []
            url = member.get("__url__")
            run.append((member["fname"], member["data"], member.get("__offset__")))
        if run:
            yield url, run

    for url, run in runs():
        try:
            for sample in group_samples([run], url, batched=True):
                if suffixes is not None:
                    sample = {
                        k: v for k, v in sample.items() if k.startswith("__") or k in suffixes
                    }
                if valid_sample(sample):
                    yield sample
        except TarshardsError as exn:
            if handler(exn):
                continue
            return


def tarfile_samples(
    src: Iterable[dict],
    handler: Callable = reraise_exception,
    select_files: Callable | None = None,
    rename_files: Callable | None = None,
    **open_options,
) -> Iterator[dict]:
    """The samples of each ``{"url": ...}`` shard in turn.

    ``open_options`` go to :func:`tarshards.open_url` (``allow_pipe=True``, ``storage_options``).
    """
    if select_files is None and rename_files is None:
        urls = (s["url"] if isinstance(s, dict) else s for s in src)
        return iter_samples(urls, handler=_policy(handler), **open_options)
    streams = url_opener(src, handler=handler, **open_options)
    files = tar_file_expander(
        streams, handler=handler, select_files=select_files, rename_files=rename_files
    )
    return group_by_keys(files, handler=handler)


tarfile_to_samples = pipelinefilter(tarfile_samples)
