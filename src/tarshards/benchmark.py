"""Where an input pipeline's time goes, measured on its own data (``tarshards bench``).

:func:`bench_pipeline` measures, on the first samples of a shard spec:

* **raw read**: the shards' bytes read through :func:`tarshards.storage.open_url`, against
  ``cat`` (local files) or a plain ``GET`` through fsspec (remote URLs) on the same shards;
* **per stage**: the pipeline cut after each of its stages (read and group, then shuffle,
  decode, to_tuple, map, batched...), each prefix timed over the same number of samples, so a
  stage's own cost is the difference between its prefix and the one before it;
* **loader**: the whole pipeline through a ``WebLoader`` with ``num_workers`` workers (torch);
* time to the first sample and to the first batch, peak memory (this process and the loader's
  workers);
* a one-line **diagnosis**: the stage that bounds the pipeline and what to try.

The result is a plain dict (``json.dumps``-able); :func:`format_report` prints it as a table,
:func:`plot_report` draws it as a PNG (with Pillow, always installed).
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import os
import random
import resource
import subprocess
import sys
import time
from typing import Any, Callable, Iterable

from .codecs.images import jpeg_decoder
from .pipeline.dataset import DataPipeline
from .pipeline.stages import decode as _decode_stage
from .read.specs import expand_urls
from .storage import open_url
from .tario import iter_tar_batches, tar_byte_source

__all__ = ["bench_pipeline", "diagnose", "format_report", "plot_report"]

_LOCAL_PREFIXES = ("file://",)


def _is_local(url: str) -> bool:
    return "://" not in url or url.startswith(_LOCAL_PREFIXES)


def _local_path(url: str) -> str:
    return url[len("file://") :] if url.startswith("file://") else url


def _peak_rss_mb(who=resource.RUSAGE_SELF) -> float:
    kib = resource.getrusage(who).ru_maxrss  # KiB on Linux, bytes on macOS
    return kib / 1024 / (1024 if sys.platform == "darwin" else 1)


class _Bar:
    """A tqdm bar on stderr (or nothing)."""

    def __init__(self, enabled: bool, desc: str, total: int | None, unit: str = "samples"):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(
                desc=f"{desc:<14}",
                total=total,
                unit=unit,
                file=sys.stderr,
                dynamic_ncols=True,
                leave=False,
                unit_scale=True,
            )

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------------------------------
# raw reading
# ---------------------------------------------------------------------------------------------


def _read_ours(urls, max_bytes, deadline, bar, storage_options) -> tuple[int, float]:
    n = 0
    t0 = time.perf_counter()
    for url in urls:
        with open_url(url, storage_options=storage_options) as f:
            while True:
                chunk = f.read(1 << 20)
                if not chunk:
                    break
                n += len(chunk)
                bar.update(len(chunk))
                if n >= max_bytes or time.perf_counter() > deadline:
                    return n, time.perf_counter() - t0
    return n, time.perf_counter() - t0


def _read_reference(urls, nbytes, storage_options) -> tuple[str, int, float]:
    """``cat`` on local files, a plain fsspec GET on remote ones: the same bytes (about)."""
    if all(_is_local(u) for u in urls):
        paths, total = [], 0
        for u in urls:
            if total >= nbytes:
                break
            paths.append(_local_path(u))
            total += os.path.getsize(paths[-1])
        t0 = time.perf_counter()
        subprocess.run(["cat", *paths], stdout=subprocess.DEVNULL, check=True)
        return "cat", total, time.perf_counter() - t0
    import fsspec

    n = 0
    t0 = time.perf_counter()
    for u in urls:
        with fsspec.open(u, "rb", **(storage_options or {})) as f:
            while n < nbytes:
                chunk = f.read(1 << 20)
                if not chunk:
                    break
                n += len(chunk)
        if n >= nbytes:
            break
    return "GET", n, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# stages
# ---------------------------------------------------------------------------------------------


def _batch_len(item) -> int:
    """Samples in a batch: a dict or tuple/list of columns (arrays, tensors, lists), or a list
    of samples."""
    if isinstance(item, dict):
        item = next(iter(item.values()), ())
    elif isinstance(item, (tuple, list)) and item:
        first = item[0]
        if hasattr(first, "shape") or isinstance(first, (list, tuple)):
            item = first
    try:
        return len(item)
    except TypeError:
        return 1


def _stage_name(stage) -> str:
    fn = getattr(stage, "fn", stage)
    name = getattr(fn, "__name__", type(fn).__name__)
    return {
        "map": "map (transforms)",
        "map_tuple": "map_tuple (transforms)",
        "map_dict": "map_dict (transforms)",
    }.get(name, name)


def _prefixes(ds) -> list[tuple[str, Any, bool]]:
    """``(name, pipeline cut after that stage, yields batches)`` for each stage of ``ds``."""
    if not isinstance(ds, DataPipeline):
        return [("pipeline", ds, False)]
    stages = ds.stage_list
    out = []
    batched = False
    for k in range(len(stages) + 1):
        # with_epoch's length dropped: max_samples bounds the measurement instead
        cut = ds.prefix(k, unbounded=True)
        if k:
            name = _stage_name(stages[k - 1])
            batched = batched or name == "batched"
            if name == "unbatched":
                batched = False
        else:
            name = "read + group"
        out.append((name, cut, batched))
    return out


def _time_iteration(ds, n: int, batched: bool, deadline: float, bar) -> dict:
    """Iterate ``ds`` for ``n`` samples (or until ``deadline``): samples, seconds, first."""
    if hasattr(ds, "set_epoch"):
        ds.set_epoch(0)
    t0 = time.perf_counter()
    first = None
    count = 0
    it = iter(ds)
    try:
        for item in it:
            if first is None:
                first = time.perf_counter() - t0
            k = _batch_len(item) if batched else 1
            count += k
            bar.update(k)
            if count >= n or time.perf_counter() > deadline:
                break
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
    return {"samples": count, "seconds": time.perf_counter() - t0, "first_s": first}


# ---------------------------------------------------------------------------------------------
# the measurement
# ---------------------------------------------------------------------------------------------


def bench_pipeline(
    spec,
    dataset: Any = None,
    *,
    max_samples: int = 2000,
    seconds_per_stage: float = 10.0,
    workers: int | None = None,
    batch_size: int = 64,
    max_read_bytes: int = 1 << 30,
    storage_options: dict | None = None,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Measure where the time of ``dataset`` (a pipeline over the shards of ``spec``) goes.

    ``dataset``: a :class:`~tarshards.pipeline.dataset.DataPipeline` / ``WebDataset`` (each of its
    stages is timed), any other iterable (timed as a whole), or ``None`` for the bare samples.
    ``max_samples`` and ``seconds_per_stage`` bound each measurement. ``workers``: also time
    a ``WebLoader`` with that many workers (``None``: 2 when torch is installed, else none;
    0: no loader). ``batch_size``: the loader's batch size when the pipeline does not batch.
    Returns a dict (see :func:`format_report`); ``log`` gets one line per finished step.
    ``spec`` may be a view (``*.view.json``): the pipeline reads its samples; the raw read and
    tar member measurements read its shards (what the storage and the parser give).
    """
    from .format.manifest import is_manifest_spec, spec_urls  # a manifest names its shards

    expand = spec_urls if is_manifest_spec(spec) else expand_urls
    urls = expand(spec, storage_options=storage_options)
    if not urls:
        raise ValueError(f"the shard spec {spec!r} names no shards")
    if dataset is None:  # a manifest or a view is read as such (a view: only its samples)
        dataset = _default_dataset(spec if is_manifest_spec(spec) else urls)
    say = log or (lambda line: None)
    report: dict[str, Any] = {
        "spec": spec if isinstance(spec, str) else list(spec),
        "shards": len(urls),
        "max_samples": max_samples,
        "pipeline": repr(dataset),
        "jpeg_decoder": jpeg_decoder(),
    }

    # 1. raw read (the reference first: it also warms the page cache for local files)
    ref_name, _, _ = _read_reference(urls, max_read_bytes, storage_options)
    with _Bar(progress, "raw read", None, unit="B") as bar:
        nbytes, secs = _read_ours(
            urls, max_read_bytes, time.perf_counter() + seconds_per_stage, bar, storage_options
        )
    ref_name, ref_bytes, ref_secs = _read_reference(urls, nbytes, storage_options)
    raw: dict[str, Any] = {
        "bytes": nbytes,
        "seconds": secs,
        "mb_per_s": nbytes / 1e6 / max(secs, 1e-9),
        "reference": ref_name,
        "reference_mb_per_s": ref_bytes / 1e6 / max(ref_secs, 1e-9),
    }
    raw["ratio"] = raw["mb_per_s"] / raw["reference_mb_per_s"]
    report["raw_read"] = raw
    say(f"raw read: {raw['mb_per_s']:.0f} MB/s ({ref_name}: {raw['reference_mb_per_s']:.0f})")

    # 2. tar members
    with _Bar(progress, "tar members", None, unit="members") as bar:
        t0 = time.perf_counter()
        deadline = t0 + seconds_per_stage
        members = mbytes = 0
        for url in urls:
            with open_url(url, storage_options=storage_options) as f:
                for batch in iter_tar_batches(
                    tar_byte_source(f, url, direct=True), url
                ):  # the reader's path
                    members += len(batch)
                    mbytes += sum(len(m[1]) for m in batch)
                    bar.update(len(batch))
                    if members >= max_samples * 4 or time.perf_counter() > deadline:
                        break
            if members >= max_samples * 4 or time.perf_counter() > deadline:
                break
        secs = time.perf_counter() - t0
    report["tar"] = {
        "members": members,
        "bytes": mbytes,
        "seconds": secs,
        "members_per_s": members / max(secs, 1e-9),
        "mb_per_s": mbytes / 1e6 / max(secs, 1e-9),
    }

    # 3. a cold start of the whole pipeline (imports, first shard): the time to the first
    # sample; it also warms up what the stage measurements below would otherwise pay once
    prefixes = _prefixes(dataset)
    with _Bar(progress, "first sample", None) as bar:
        cold = _time_iteration(
            dataset,
            min(max_samples, 256),
            prefixes[-1][2],
            time.perf_counter() + seconds_per_stage,
            bar,
        )
    report["time_to_first_sample_s"] = cold["first_s"]

    # 4. each stage, as the pipeline cut after it
    stages = []
    prev_per_sample = 0.0
    for name, cut, batched in prefixes:
        with _Bar(progress, name, max_samples) as bar:
            res = _time_iteration(
                cut, max_samples, batched, time.perf_counter() + seconds_per_stage, bar
            )
        per_sample = res["seconds"] / max(res["samples"], 1)
        own = max(per_sample - prev_per_sample, 0.0)
        stages.append(
            {
                "name": name,
                "samples": res["samples"],
                "seconds": res["seconds"],
                "samples_per_s": res["samples"] / max(res["seconds"], 1e-9),
                "stage_us_per_sample": own * 1e6,
                "stage_samples_per_s": (1 / own) if own > 0 else None,
                "time_to_first_s": res["first_s"],
            }
        )
        prev_per_sample = per_sample
        say(f"{name}: {stages[-1]['samples_per_s']:.0f} samples/s")
    report["stages"] = stages
    report["pipeline_samples_per_s"] = stages[-1]["samples_per_s"]
    # what each field costs the decode stage (video and audio fields dwarf the rest)
    report["field_decode_us"] = _field_decode_times(
        dataset, prefixes, min(max_samples, 16), time.perf_counter() + seconds_per_stage
    )

    # 5. the loader
    report["loader"] = None
    if workers is None:
        workers = 2 if importlib.util.find_spec("torch") is not None else 0
    if workers > 0:
        report["loader"] = _bench_loader(
            dataset, workers, batch_size, stages[-1], max_samples, seconds_per_stage, progress
        )
        say(f"loader: {report['loader']['samples_per_s']:.0f} samples/s")
    report["time_to_first_batch_s"] = (
        report["loader"]["time_to_first_batch_s"] if report["loader"] else None
    )
    report["peak_rss_mb"] = _peak_rss_mb()
    report["peak_rss_workers_mb"] = _peak_rss_mb(resource.RUSAGE_CHILDREN)
    report["bottleneck"], report["diagnosis"] = diagnose(report)
    return report


def _web_dataset_class():
    """``WebDataset`` as ``tarshards.WebDataset`` resolves it: the torch adapter's with torch
    installed, else the plain pipeline (this module sits beside the adapters, below the
    package)."""
    try:
        return importlib.import_module("tarshards.torch.adapter").WebDataset
    except ImportError as exc:
        if getattr(exc, "name", None) not in ("torch", None):
            raise
    from .pipeline.dataset import WebDataset

    return WebDataset


def _default_dataset(urls):
    from .pipeline import dataset as pipeline

    return pipeline.WebDataset(urls)


def _bench_loader(dataset, workers, batch_size, last_stage, max_samples, seconds, progress):
    adapter = importlib.import_module("tarshards.torch.adapter")
    from torch.utils.data import IterableDataset

    ds = dataset
    if not isinstance(ds, IterableDataset):
        ds = type("BenchDataset", (IterableDataset,), {"__iter__": lambda self: iter(dataset)})()
    batched = _prefixes(dataset)[-1][2]
    loader = adapter.WebLoader(
        ds,
        batch_size=None if batched else batch_size,
        num_workers=workers,
        collate_fn=None if batched else _collate(),
    )
    t0 = time.perf_counter()
    first = None
    count = n_first = 0
    t_first = deadline = end = t0
    it = iter(loader)
    with _Bar(progress, f"loader x{workers}", max_samples * 2) as bar:
        try:
            for batch in it:
                k = _batch_len(batch)
                if first is None:  # samples/s counted from the first batch (workers started)
                    t_first = time.perf_counter()
                    first = t_first - t0
                    deadline = t_first + seconds
                    n_first = k
                count += k
                bar.update(k)
                end = time.perf_counter()
                if count >= max_samples * 2 or end > deadline:
                    break
        finally:
            del it  # shuts the workers down
    steady = (count - n_first) / max(end - t_first, 1e-9) if count > n_first else 0.0
    return {
        "workers": workers,
        "batch_size": None if batched else batch_size,
        "samples": count,
        "seconds": end - t0,
        "samples_per_s": steady,
        "time_to_first_batch_s": first,
        "vs_one_process": steady / max(last_stage["samples_per_s"], 1e-9),
    }


def _collate():
    from .pipeline.stages import default_collation_fn

    return default_collation_fn


# ---------------------------------------------------------------------------------------------
def _field_decode_times(dataset, prefixes, n: int, deadline: float) -> dict:
    """Microseconds per sample that the pipeline's (first) decode stage spends on each field,
    by extension, over the first ``n`` samples: each field decoded alone with the stage's
    handlers. ``{}`` without a decode stage."""
    stages = getattr(dataset, "_stages", None) or []
    st = next((s for s in stages if getattr(s, "fn", None) is _decode_stage), None)
    if st is None:
        return {}
    kw = {k: v for k, v in st.kwargs.items() if k in ("only", "size", "allow_unsafe")}
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    it = iter(prefixes[0][1])
    try:
        for sample in itertools.islice(it, n):
            for k, v in sample.items():
                if k.startswith("__"):
                    continue
                one = {"__key__": sample.get("__key__"), "__url__": sample.get("__url__"), k: v}
                t0 = time.perf_counter()
                try:
                    list(_decode_stage([one], *st.args, rng=random.Random(0), **kw))
                except Exception:  # noqa: BLE001 - a field that does not decode is not timed
                    continue
                ext = k.rpartition(".")[2].lower()
                totals[ext] = totals.get(ext, 0.0) + time.perf_counter() - t0
                counts[ext] = counts.get(ext, 0) + 1
            if time.perf_counter() > deadline:
                break
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
    return {ext: totals[ext] / counts[ext] * 1e6 for ext in sorted(totals)}


_MEDIA_FIELDS = ("mp4", "webm", "mkv", "mov", "avi", "m4v", "wav", "flac", "mp3", "ogg", "opus")

# diagnosis and output
# ---------------------------------------------------------------------------------------------

_ADVICE = {
    "read": "reading bounds you: {why}; cache remote shards (cache_dir=), prefetch more shards, "
    "or use more readers (workers, ranks) on more shards",
    "read + group": "reading and grouping samples bounds you: build the C extension "
    "(setup.py build_ext), use fewer, larger samples, or add workers",
    "decode": "decoding bounds you: add workers, decode at a smaller size (decode(..., "
    "size=)), decode only the fields you use (to_tuple right after decode), or use "
    "random_resized_crop for training crops",
    "shuffle": "the shuffle buffer bounds you: a smaller buffer, or shard shuffling instead",
    "transforms": "your transforms bound you: add workers, move augmentation to the GPU, or "
    "decode straight to the size you need",
    "batched": "collation bounds you: batch arrays of one shape and dtype (they stack "
    "cheaply), or batch in the loader instead",
    "loader": "the DataLoader transport bounds you ({ratio:.2f}x one process with {workers} "
    "workers on {cores} cores): {fix}",
}


def diagnose(report: dict) -> tuple[str, str]:
    """``(bottleneck, one line of advice)`` from a :func:`bench_pipeline` report."""
    stages = report.get("stages") or []
    raw = report.get("raw_read") or {}
    loader = report.get("loader")
    if (
        loader
        and loader["vs_one_process"] < 0.8 * loader["workers"]
        and loader["workers"] > 1
        and loader["vs_one_process"] < 1.0
    ):
        cores = os.cpu_count() or 1
        if loader.get("batch_size") is not None:
            fix = "batch inside the dataset (.batched(64), then batch_size=None)"
        elif loader["workers"] >= cores:
            fix = "fewer workers (no more than the free cores), larger batches"
        else:
            fix = "larger batches, or more workers"
        return "loader", _ADVICE["loader"].format(
            ratio=loader["vs_one_process"], workers=loader["workers"], cores=cores, fix=fix
        )
    if not stages:
        return "unknown", "no stage was measured"
    worst = max(stages, key=lambda s: s["stage_us_per_sample"])
    name = worst["name"]
    total_us = sum(s["stage_us_per_sample"] for s in stages)
    share = worst["stage_us_per_sample"] / total_us if total_us else 0.0
    if name == "read + group" and raw.get("ratio", 1.0) < 0.5:
        why = (
            f"{raw['mb_per_s']:.0f} MB/s against {raw['reference']}'s "
            f"{raw['reference_mb_per_s']:.0f} MB/s"
        )
        return "read", _ADVICE["read"].format(why=why)
    if name == "read + group" and raw.get("reference") == "GET":
        why = f"the storage gives {raw['reference_mb_per_s']:.0f} MB/s"
        return "read", _ADVICE["read"].format(why=why)
    key = "transforms" if "transforms" in name else name
    advice = _ADVICE.get(key, f"the {name} stage bounds you: look at what it does per sample")
    fields = report.get("field_decode_us") or {}
    if key == "decode" and fields:
        ext = max(fields, key=lambda e: fields[e])
        advice += f"; the slowest field is .{ext} ({fields[ext] / 1000:.2f} ms a sample)"
        if ext in _MEDIA_FIELDS:
            advice += (
                ": decode fewer frames or a smaller size= (tarshards.video), shorter spans "
                "(tarshards.audio(seconds=)), or read clips by byte range (IndexedDataset)"
            )
    if key == "decode" and (report.get("jpeg_decoder") or {}).get("decoder", "") == "Pillow":
        advice += "; install simplejpeg (pip install tarshards[fast]) or build the C decoder"
    return key, f"{advice} ({share:.0%} of the time per sample)"


def format_report(report: dict) -> str:
    """The report as a table (plain text)."""
    lines = [f"tarshards bench: {report['spec']} ({report['shards']} shards)"]
    raw = report["raw_read"]
    lines.append(
        f"  raw read      {raw['mb_per_s']:10.1f} MB/s   ({raw['reference']}: "
        f"{raw['reference_mb_per_s']:.1f} MB/s, {raw['ratio']:.2f}x)"
    )
    tar = report["tar"]
    lines.append(
        f"  tar members   {tar['members_per_s']:10.0f} /s     ({tar['mb_per_s']:.1f} MB/s)"
    )
    lines.append(f"  {'stage':<24}{'samples/s':>12}{'stage us/sample':>17}{'stage alone/s':>15}")
    for s in report["stages"]:
        alone = f"{s['stage_samples_per_s']:.0f}" if s["stage_samples_per_s"] else "-"
        lines.append(
            f"  {s['name']:<24}{s['samples_per_s']:12.0f}"
            f"{s['stage_us_per_sample']:17.1f}{alone:>15}"
        )
    loader = report.get("loader")
    if loader:
        lines.append(
            f"  {'loader x' + str(loader['workers']):<24}{loader['samples_per_s']:12.0f}"
            f"{'':17}{loader['vs_one_process']:14.2f}x"
        )
    first = report.get("time_to_first_sample_s")
    batch = report.get("time_to_first_batch_s")
    lines.append(
        f"  first sample  {first if first is not None else float('nan'):.3f} s"
        + (f"   first batch {batch:.3f} s" if batch is not None else "")
    )
    lines.append(
        f"  peak memory   {report['peak_rss_mb']:.0f} MB"
        + (f" (workers {report['peak_rss_workers_mb']:.0f} MB)" if report.get("loader") else "")
    )
    jd = report.get("jpeg_decoder")
    if jd:
        lines.append(
            f"  JPEG decoder  {jd['decoder']}"
            + (f", libjpeg-turbo {jd['libjpeg_turbo']}" if jd.get("libjpeg_turbo") else "")
            + (f" ({jd['libjpeg']})" if jd.get("libjpeg") else "")
        )
    fields = report.get("field_decode_us")
    if fields:
        lines.append(
            "  field decode  "
            + ", ".join(f".{e} {us / 1000:.2f} ms" for e, us in sorted(fields.items()))
        )
    lines.append(f"  bottleneck    {report['diagnosis']}")
    return "\n".join(lines)


def plot_report(report: dict, path: str) -> None:
    """A bar chart of samples/s (cumulative, per stage) as a PNG, drawn with Pillow."""
    from PIL import Image, ImageDraw

    rows = [(s["name"], s["samples_per_s"]) for s in report["stages"]]
    if report.get("loader"):
        rows.append((f"loader x{report['loader']['workers']}", report["loader"]["samples_per_s"]))
    width, left, bar_h, gap, top = 900, 200, 26, 10, 60
    height = top + len(rows) * (bar_h + gap) + 60
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    draw.text((10, 10), f"tarshards bench: {report['spec']}", fill="black")
    draw.text((10, 28), "samples/s of the pipeline cut after each stage", fill="gray")
    peak = max((r for _, r in rows), default=1.0) or 1.0
    span = width - left - 120
    for i, (name, rate) in enumerate(rows):
        y = top + i * (bar_h + gap)
        draw.text((10, y + 7), name[:28], fill="black")
        w = int(span * rate / peak)
        colour = (220, 90, 60) if name.startswith(report.get("bottleneck", "?")) else (70, 120, 200)
        draw.rectangle([left, y, left + max(w, 1), y + bar_h], fill=colour)
        draw.text((left + w + 6, y + 7), f"{rate:,.0f}/s", fill="black")
    draw.text((10, height - 40), report["diagnosis"][:140], fill="black")
    img.save(path, format="PNG")


def dataset_from_options(
    urls,
    *,
    shuffle: int = 0,
    decode: Iterable[str] = (),
    crop: int | None = None,
    media: bool = False,
    frames: int = 16,
    fields: str | None = None,
    batch_size: int | None = None,
    seed: int = 0,
):
    """The pipeline ``tarshards bench`` builds from its options (a WebDataset)."""
    ds = _web_dataset_class()(urls, shardshuffle=bool(shuffle), seed=seed)
    if shuffle:
        ds = ds.shuffle(shuffle)
    handlers: list[Any] = list(decode)
    if crop:
        from .codecs.crop import random_resized_crop

        torch_ok = importlib.util.find_spec("torch") is not None
        handlers.insert(0, random_resized_crop(crop, output="torchrgb" if torch_ok else "rgb8"))
    if media:  # video clips and audio (tarshards.video / tarshards.audio)
        from .media.audio import audio
        from .media.video import video

        handlers[:0] = [video(frames=frames), audio()]
    if handlers:
        ds = ds.decode(*handlers)
    if fields:
        ds = ds.to_tuple(*fields.split())
    if batch_size:
        ds = ds.batched(batch_size)
    return ds
