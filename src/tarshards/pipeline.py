"""Composing a source of samples with stages, and the fluent ``WebDataset`` API.

``WebDataset`` keeps a list of ``(stage function, args, kwargs)``; its fluent methods are generated
from the stage functions in :mod:`tarshards.stages`, so there is one implementation of each stage.
At iteration time the pipeline works out who it is (rank, worker), picks the epoch's shards, and
runs the stages, passing each stage that takes them a seeded ``rng`` and the dataset's error
policy (``on_error``).
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
import os
from typing import Any, Callable, Iterable, Iterator

from . import stages as _stages
from .errors import StorageError, TarshardsError
from .format import group_samples
from .prefetch import ShardPrefetcher, given_stream
from .shards import make_rng, resampled_shards, shard_order, split_shards
from .on_error import OnError, error_policy
from .tario import iter_tar_batches, tar_byte_source
from .urls import expand_urls, is_local, open_url

__all__ = ["DataPipeline", "WebDataset", "iter_samples", "shard_samples"]

_DEFAULT: Any = object()


def shard_samples(url: str, *, storage_options: dict | None = None, allow_pipe: bool = False,
                  last_dot: bool = False, opener: Callable | None = None,
                  chunk_size: int = 1 << 20, retries: int = 5) -> Iterator[dict]:
    """The samples of one shard (any URL :func:`tarshards.urls.open_url` opens).

    ``retries``: reconnections after a dropped connection, resuming at the byte offset reached.

    Errors are :class:`~tarshards.errors.TarshardsError` subclasses naming the shard, the member
    and the offset; OS errors while reading become :class:`StorageError`.
    """
    url = os.fspath(url)
    if opener is None:
        opener = functools.partial(open_url, storage_options=storage_options,
                                   allow_pipe=allow_pipe, retries=retries)
    try:
        with opener(url) as stream:
            batches = iter_tar_batches(tar_byte_source(stream, url, chunk_size), url)
            yield from group_samples(batches, url, last_dot=last_dot, batched=True)
    except TarshardsError as exn:
        raise exn.with_context(url=url) from None
    except OSError as exn:
        raise StorageError(f"read failed: {exn}", url=url) from exn


def iter_samples(urls: Iterable[str], *, on_error: OnError = "raise",
                 handler: Callable | None = None, prefetch: int = 0,
                 prefetch_bytes: int = 256 << 20, **options) -> Iterator[dict]:
    """The samples of several shards in turn; shard errors go to ``on_error``.

    With ``on_error="warn"`` (or ``handler=warn_and_continue``) a bad shard yields the samples
    before the error, one warning naming shard and offset, and the stream goes on with the next
    shard. Only tarshards errors reach the policy here (errors of the shard, not of user code).

    ``prefetch=k`` opens the next ``k`` shards while the current one is read, each filled from a
    thread into a buffer (``prefetch_bytes`` over all of them; at most ``k + 1`` connections):
    see :mod:`tarshards.prefetch`. Order, samples and errors are the same as without it.
    """
    policy = error_policy(on_error, handler)
    if not prefetch:
        for url in urls:
            try:
                yield from shard_samples(url, **options)
            except TarshardsError as exn:
                if policy(exn):
                    continue
                return
        return
    opener = options.pop("opener", None)
    if opener is None:
        opener = functools.partial(open_url, storage_options=options.get("storage_options"),
                                   allow_pipe=options.get("allow_pipe", False),
                                   retries=options.get("retries", 5))
    with ShardPrefetcher(opener, ahead=prefetch, max_bytes=prefetch_bytes) as prefetcher:
        for url, stream in prefetcher.streams(urls):
            try:
                yield from shard_samples(url, opener=lambda _url, s=stream: given_stream(s),
                                         **options)
            except TarshardsError as exn:
                if policy(exn):
                    continue
                return


class _Stage:
    __slots__ = ("fn", "args", "kwargs", "wants_rng", "wants_policy", "label")

    def __init__(self, fn, args, kwargs, label=None):
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        params = _params(fn)
        self.wants_rng = "rng" in params and "rng" not in kwargs and "seed" not in kwargs
        self.wants_policy = ("on_error" in params and "on_error" not in kwargs
                             and "handler" not in kwargs)
        self.label = label or getattr(fn, "__name__", repr(fn))

    def __repr__(self):
        parts = [_short(a) for a in self.args]
        parts += [f"{k}={_short(v)}" for k, v in self.kwargs.items()]
        return f"{self.label}({', '.join(parts)})"


@functools.cache
def _params(fn) -> frozenset:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


def _short(v) -> str:
    if callable(v) and hasattr(v, "__name__"):
        return v.__name__
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


class DataPipeline:
    """A source of samples followed by stages (plain iterable, no torch needed).

    ``source`` is a function ``(context) -> iterator`` where ``context`` holds ``epoch``,
    ``rank``, ``world_size``, ``worker``, ``num_workers`` and ``seed``.
    """

    def __init__(self, source: Callable[[dict], Iterator] | Iterable, *, seed: int = 0,
                 on_error: OnError = "raise", handler: Callable | None = None):
        self._source = source
        self._stages: list[_Stage] = []
        self.seed = seed
        self.on_error = error_policy(on_error, handler)
        self.epoch: int | None = None  # None: counted automatically
        self._auto_epoch = 0
        self._nsamples: int | None = None  # with_epoch
        self._length: int | None = None  # with_length

    @property
    def handler(self):
        """The error policy (older name of :attr:`on_error`)."""
        return self.on_error

    # ---- composition -------------------------------------------------------------------------
    def compose(self, stage: Callable, *args, **kwargs) -> "DataPipeline":
        """A copy of this pipeline with the stage ``stage(samples, *args, **kwargs)`` appended.

        Like webdataset, fluent methods return a new pipeline and leave this one as it was
        (``with_epoch``/``with_length``/``set_epoch`` change the pipeline itself).
        """
        new = copy.copy(self)
        new._stages = list(self._stages)
        new._append(stage, *args, **kwargs)
        return new

    def _append(self, stage: Callable, *args, **kwargs) -> None:
        if not callable(stage):
            raise TypeError(f"a stage is a generator function, not {stage!r}")
        self._stages.append(_Stage(stage, args, kwargs))

    def with_epoch(self, nsamples: int | None = None, nbatches: int | None = None
                   ) -> "DataPipeline":
        """Make each iteration yield exactly ``nsamples`` items per reader (rank x worker).

        webdataset's meaning: a reader whose data is shorter goes through it again (with fresh
        shuffles) until it has yielded ``nsamples`` items; a reader with no data at all yields
        nothing. ``nbatches`` is another name for the same count (items after ``.batched()``).
        """
        counts = [n for n in (nsamples, nbatches) if n is not None]
        if len(counts) != 1 or int(counts[0]) < 0:
            raise ValueError("with_epoch needs one non-negative count (nsamples or nbatches)")
        self._nsamples = int(counts[0])
        return self

    def with_length(self, n: int) -> "DataPipeline":
        """Give the dataset a ``len()`` (for code that asks; iteration is not affected)."""
        self._length = int(n)
        return self

    def __len__(self):
        if self._length is None:
            raise TypeError(f"{type(self).__name__} is a stream and has no length; "
                            "set one with .with_length(n)")
        return self._length

    def __getitem__(self, index):
        raise TypeError(f"{type(self).__name__} is a streaming dataset: it can be iterated "
                        "over (for sample in ds, or DataLoader(ds)), not indexed")

    def set_epoch(self, epoch: int) -> None:
        """Fix the epoch used to seed shard and sample shuffling (instead of counting)."""
        self.epoch = int(epoch)

    # ---- environment -------------------------------------------------------------------------
    def environment(self) -> dict:
        """Rank and worker of the reader running this iteration (the torch adapter overrides it)."""
        return {"rank": 0, "world_size": 1, "worker": 0, "num_workers": 1}

    def _context(self) -> dict:
        ctx = self.environment()
        if self.epoch is not None:
            epoch = self.epoch
        else:
            epoch = self._auto_epoch
            self._auto_epoch += 1
        ctx["epoch"] = epoch
        ctx["seed"] = self.seed
        return ctx

    # ---- iteration ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator:
        ctx = self._context()
        if self._nsamples is None:
            return self._run(ctx)
        return itertools.islice(self._repeated(ctx), self._nsamples)

    def _repeated(self, ctx: dict) -> Iterator:
        """The epoch's data, run again (pass 1, 2... with their own shuffles) while it lasts."""
        for again in itertools.count():
            if again:
                ctx = dict(ctx, again=again)
            empty = True
            for item in self._run(ctx):
                empty = False
                yield item
            if empty:
                return

    def _run(self, ctx: dict) -> Iterator:
        src = self._source
        data = src(ctx) if callable(src) else iter(src)
        stages = self._stages
        for i, st in enumerate(stages):
            kwargs = st.kwargs
            if (st.fn is _stages.decode and "only" not in kwargs and i + 1 < len(stages)
                    and stages[i + 1].fn is _stages.to_tuple):
                # to_tuple keeps only the fields it names: decoding the others is wasted work
                kwargs = dict(kwargs, only=_tuple_fields(stages[i + 1].args))
            if st.wants_rng or st.wants_policy:
                kwargs = dict(kwargs)
                if st.wants_rng:
                    again = (ctx["again"],) if ctx.get("again") else ()
                    kwargs["rng"] = make_rng("stage", i, ctx["seed"], ctx["epoch"], ctx["rank"],
                                             ctx["worker"], *again)
                if st.wants_policy:
                    kwargs["on_error"] = self.on_error
            data = st.fn(data, *st.args, **kwargs)
        return iter(data)

    def __repr__(self):
        return " | ".join([self._source_repr()] + [repr(s) for s in self._stages])

    def _source_repr(self) -> str:
        return f"{type(self).__name__}({_short(self._source)})"


def _tuple_fields(args) -> list[str]:
    """Every field a ``to_tuple(*args)`` stage may pick (alternatives included)."""
    if len(args) == 1 and isinstance(args[0], str) and " " in args[0]:
        args = args[0].split()
    return [f for spec in args for f in spec.split(";")]


# parameters the pipeline fills in (a seeded rng; its error policy): not shown on fluent methods
_INJECTED = frozenset({"rng", "handler"})


def _fluent_signature(stage: Callable) -> inspect.Signature:
    """``stage``'s signature as a method: ``self`` instead of the samples, without the injected
    parameters (those after one become keyword-only, so positions stay true), and
    ``on_error=None`` meaning "the pipeline's policy"."""
    sig = inspect.signature(stage)
    shown = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    keyword_only = False
    for p in list(sig.parameters.values())[1:]:
        if p.name in _INJECTED:
            keyword_only = keyword_only or p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
            continue
        if keyword_only and p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            p = p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
        if p.name == "on_error":
            p = p.replace(default=None)
        shown.append(p)
    if keyword_only:  # keep the order Python requires: keyword-only ones after *args
        shown.sort(key=lambda p: p.kind)
    return sig.replace(parameters=shown, return_annotation="DataPipeline")


def _fluent(stage: Callable) -> Callable:
    """A fluent method that appends ``stage``: one implementation, with the stage's signature
    (less the samples and what the pipeline injects) and docstring. Arguments are checked
    against the signature when the method is called, not at iteration."""
    sig = _fluent_signature(stage)

    def method(self, *args, **kwargs):
        shown = {k: v for k, v in kwargs.items() if k not in _INJECTED}
        try:
            sig.bind(self, *args, **shown)
        except TypeError as exn:
            raise TypeError(f".{stage.__name__}(): {exn}") from None
        if "on_error" in kwargs and kwargs["on_error"] is None:
            del kwargs["on_error"]  # the pipeline's policy
        return self.compose(stage, *args, **kwargs)

    method.__name__ = stage.__name__
    method.__qualname__ = f"DataPipeline.{stage.__name__}"
    method.__doc__ = stage.__doc__
    method.__module__ = __name__
    method.__signature__ = sig  # type: ignore[attr-defined]
    return method


for _name in ("shuffle", "decode", "select", "map", "map_dict", "map_tuple", "to_tuple",
              "rename", "batched", "unbatched", "take", "slice"):
    setattr(DataPipeline, _name, _fluent(getattr(_stages, _name)))


class WebDataset(DataPipeline):
    """A streaming dataset of samples from tar shards.

    Seed-notebook style: ``WebDataset(urls, extensions="jpg cls", decoder="pil",
    transforms=[augment, None], shuffle=100)`` yields tuples. Fluent style: ``WebDataset(urls,
    shardshuffle=True, seed=0).shuffle(1000).decode("pil").to_tuple("jpg", "cls").batched(64)``.

    ``urls``: a shard spec (braces, ``::``-joined specs, globs, lists, a URL list file).
    ``shardshuffle``: shuffle the shard order each epoch (default: on when ``shuffle`` > 0).
    ``resampled``: draw shards with replacement forever (bound it with ``.with_epoch(n)``).
    ``on_error``: what a data error does: ``"raise"``, ``"skip"``, ``"warn"``, or a function
    ``exn -> bool`` (see :mod:`tarshards.on_error`); ``handler=`` is its older name and takes
    webdataset's handler functions (``warn_and_continue``...).
    ``rank``/``world_size``: the node's place (default: from torch.distributed when initialized).
    ``nodesplitter``/``workersplitter``: functions ``urls -> urls`` replacing the default split.
    ``empty_check``: raise when this reader was given shards but found no sample in them.
    ``cache_dir``/``cache_size``: keep remote shards in a local cache (size like ``"20GB"``).
    ``retries``: reconnections per shard after a dropped connection (resumes at the offset).
    ``decode_size=(w, h)``: with ``decoder=``, decode images at that size (fast for JPEG).
    ``prefetch``: shards opened ahead of the current one (default: 2 for remote shard lists, 0
    for local files); ``prefetch_bytes`` bounds the memory they buffer.
    """

    def __init__(self, urls, extensions: str | None = None, decoder: Any = _DEFAULT,
                 transforms: Any = None, shuffle: int = 0, *, shardshuffle: bool | None = None,
                 resampled: bool = False, seed: int = 0, on_error: OnError = "raise",
                 handler: Callable | None = None, nodesplitter: Callable | None = None,
                 workersplitter: Callable | None = None, empty_check: bool = True,
                 rank: int | None = None, world_size: int | None = None,
                 storage_options: dict | None = None, allow_pipe: bool = False,
                 cache_dir: str | None = None, cache_size: float | str | None = None,
                 retries: int = 5, last_dot: bool = False, decode_size=None,
                 allow_unsafe: bool = False, prefetch: int | None = None,
                 prefetch_bytes: int = 256 << 20):
        super().__init__(self._samples, seed=seed, on_error=on_error, handler=handler)
        self.urls = expand_urls(urls, storage_options=storage_options)
        if not self.urls:
            raise ValueError(f"the shard spec {urls!r} names no shards")
        self.spec = urls
        self.resampled = resampled
        self.shardshuffle = bool(shuffle) if shardshuffle is None else bool(shardshuffle)
        self.nodesplitter = nodesplitter
        self.workersplitter = workersplitter
        self.empty_check = empty_check
        self.rank = rank
        self.world_size = world_size
        self.last_dot = last_dot
        self.storage_options = storage_options
        self.allow_pipe = allow_pipe
        self.retries = retries
        if prefetch is None:
            prefetch = 2 if any(_is_remote(u) for u in self.urls) else 0
        if prefetch < 0 or prefetch_bytes < 1:
            raise ValueError(f"bad prefetch={prefetch!r} / prefetch_bytes={prefetch_bytes!r}")
        self.prefetch = int(prefetch)
        self.prefetch_bytes = int(prefetch_bytes)
        self._opener = None
        if cache_dir is not None:
            from .cache import ShardCache

            cache = ShardCache(cache_dir, max_bytes=cache_size, storage_options=storage_options,
                               retries=retries, allow_pipe=allow_pipe)
            self._opener = cache.open
        # the seed notebook's constructor: shuffle, decode, tuple, per-element transforms
        if shuffle:
            self._append(_stages.shuffle, shuffle)
        if decoder is _DEFAULT:
            decoder = "rgb" if extensions is not None else None
        if decoder is not None:
            modes = decoder if isinstance(decoder, (list, tuple)) else [decoder]
            kw = {"allow_unsafe": allow_unsafe}
            if decode_size is not None:
                kw["size"] = decode_size
            self._append(_stages.decode, *modes, **kw)
        if extensions is not None:
            fields = extensions.split() if isinstance(extensions, str) else list(extensions)
            self._append(_stages.to_tuple, *fields)
            if transforms is not None:
                if callable(transforms):
                    self._append(_stages.map, transforms)
                else:
                    self._append(_stages.map_tuple, *transforms)
        elif transforms is not None:
            raise ValueError("transforms= applies to the elements of extensions=; with dict "
                             "samples use .map() or .map_dict()")

    def environment(self) -> dict:
        env = super().environment()
        if self.rank is not None:
            env["rank"] = self.rank
        if self.world_size is not None:
            env["world_size"] = self.world_size
        return env

    def shard_list(self, ctx: dict) -> Iterable[str]:
        """The shards this reader reads in the epoch described by ``ctx``."""
        if self.resampled:
            return resampled_shards(self.urls, seed=ctx["seed"], epoch=ctx["epoch"],
                                    rank=ctx["rank"] * ctx["num_workers"] + ctx["worker"],
                                    worker=0)
        urls = shard_order(self.urls, seed=ctx["seed"], epoch=ctx["epoch"],
                           shuffle=self.shardshuffle)
        if self.nodesplitter is not None:
            urls = _as_urls(self.nodesplitter(urls))
        if self.workersplitter is not None:
            urls = _as_urls(self.workersplitter(urls))
        if self.nodesplitter is None or self.workersplitter is None:
            rank, world = ((0, 1) if self.nodesplitter is not None
                           else (ctx["rank"], ctx["world_size"]))
            worker, nworkers = ((0, 1) if self.workersplitter is not None
                                else (ctx["worker"], ctx["num_workers"]))
            urls = split_shards(urls, rank=rank, world_size=world, worker=worker,
                                num_workers=nworkers)
        return urls

    def _samples(self, ctx: dict) -> Iterator[dict]:
        shards: Any = self.shard_list(ctx)
        if not self.resampled:
            shards = list(shards)
        options: dict[str, Any] = {
            "storage_options": self.storage_options, "allow_pipe": self.allow_pipe,
            "last_dot": self.last_dot, "retries": self.retries, "prefetch": self.prefetch,
            "prefetch_bytes": self.prefetch_bytes}
        if self._opener is not None:
            options["opener"] = self._opener
        if not self.empty_check or self.resampled:
            yield from iter_samples(shards, on_error=self.on_error, **options)
            return
        skipped: list = []  # errors the policy let pass, to name the real cause below
        samples = iter_samples(shards, on_error=self.on_error.observed(skipped.append), **options)
        first = next(samples, _DEFAULT)  # peek: no per-sample cost for the check
        if first is _DEFAULT:
            if shards and skipped:
                raise ValueError(
                    f"no samples found in {len(shards)} shard(s) ({shards[0]}...): the handler "
                    f"skipped {len(skipped)} shard error(s), the first: {skipped[0]}"
                ) from skipped[0]
            if shards:
                raise ValueError(
                    f"no samples found in {len(shards)} shard(s) ({shards[0]}...): are the "
                    "member names KEY.EXT? (pass empty_check=False to allow empty shards)")
            return
        del skipped[:]
        yield first
        yield from samples

    def _source_repr(self) -> str:
        spec = repr(self.spec) if isinstance(self.spec, str) else f"[{self.urls[0]!r}, ...]"
        return f"{type(self).__name__}({spec}, {len(self.urls)} shards)"


def _is_remote(url: str) -> bool:
    """A shard read over a network (prefetching pays off), not a file, stdin or a pipe."""
    return not (is_local(url) or url == "-" or url.startswith("pipe:"))


def _as_urls(items) -> list[str]:
    out = []
    for x in items:
        out.append(x["url"] if isinstance(x, dict) else x)
    return out

