"""Loader statistics (``WebLoader(..., stats=True)``): the counters against what a traced run
measures, the one-line summary, the gathered view and the Prometheus text export."""

from __future__ import annotations

import os
import re
import tarfile

import pytest
from conftest import write_shards

from tarshards.stats import Counters, LoaderStats, ShardTiming, gathered

# ---- a strict parser of Prometheus' text exposition format (0.0.4) -------------------------
_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
_SAMPLE = re.compile(
    rf"^({_NAME})(?:\{{({_LABEL}(?:,{_LABEL})*)?\}})? "
    r"([-+]?(?:[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?|\.[0-9]+(?:[eE][-+]?[0-9]+)?|"
    r"NaN|[-+]?Inf))$"
)
_LABEL_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')


def parse_prometheus(text: str) -> dict:
    """``{metric: {"type": t, "help": h, "samples": [(labels, value)]}}``; raises on any line
    that the exposition format does not allow (types declared once, before their samples)."""
    assert text.endswith("\n"), "the exposition ends with a line feed"
    metrics: dict = {}
    for line in text[:-1].split("\n"):
        if line.startswith("# HELP "):
            name, _, doc = line[7:].partition(" ")
            assert re.fullmatch(_NAME, name), line
            metrics.setdefault(name, {"samples": []})["help"] = doc
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped"), line
            entry = metrics.setdefault(name, {"samples": []})
            assert "type" not in entry and not entry["samples"], f"late TYPE: {line}"
            entry["type"] = kind
        else:
            m = _SAMPLE.match(line)
            assert m, f"not a sample line: {line!r}"
            name, labels, value = m.groups()
            base = name
            for suffix in ("_bucket", "_sum", "_count"):  # a histogram's series
                stem = name[: -len(suffix)]
                if name.endswith(suffix) and metrics.get(stem, {}).get("type") == "histogram":
                    base = stem
            assert base in metrics and "type" in metrics[base], f"no TYPE before {name}"
            pairs = dict(_LABEL_PAIR.findall(labels or ""))
            if metrics[base]["type"] == "histogram":
                assert base != name, f"a histogram's sample must be _bucket/_sum/_count: {line}"
                assert (name.endswith("_bucket")) == ("le" in pairs), line
            metrics[base]["samples"].append((name, pairs, float(value)))
    return metrics


def traced(paths) -> tuple[int, int]:
    """What reading the shards means, measured without tarshards: (samples, bytes)."""
    keys, nbytes = set(), 0
    for p in paths:
        nbytes += os.path.getsize(p)
        with tarfile.open(p) as tf:
            keys |= {m.name.split(".", 1)[0] for m in tf.getmembers() if m.isfile()}
    return len(keys), nbytes


# ---- the values, without torch ---------------------------------------------------------------
def _stats(rank, wait, samples=10, url="http://h/a.tar"):
    return LoaderStats(
        rank=rank,
        elapsed_s=2.0,
        samples=samples,
        bytes=1000 * samples,
        batches=samples // 2,
        wait_s=wait,
        produce_s=1.0,
        storage_s=0.25,
        read_s=0.5,
        decode_s=0.25,
        stages_s=0.25,
        shards=2,
        open_s=0.1,
        cache_hits=3,
        cache_misses=1,
        slowest_shards=(ShardTiming(url, wait, 0.05, 1000, 5, rank),),
        wait_hist=tuple(3 if k == 20 else 2 if k == 27 else 0 for k in range(40)),
    )


def check_histogram(metric: dict, counts: dict) -> None:
    """A parsed Prometheus histogram: per rank, cumulative buckets by ``le`` ending in +Inf,
    equal to ``_count``; ``counts``: the count expected per rank."""
    assert metric["type"] == "histogram"
    for rank, want in counts.items():
        rows = [(n, lab, v) for n, lab, v in metric["samples"] if lab["rank"] == rank]
        buckets = [(float(lab["le"]), v) for n, lab, v in rows if n.endswith("_bucket")]
        assert buckets == sorted(buckets) and buckets[-1][0] == float("inf")
        values = [v for _, v in buckets]
        assert values == sorted(values)  # cumulative
        (count,) = [v for n, _, v in rows if n.endswith("_count")]
        assert values[-1] == count == want


def test_counters_travel_as_deltas():
    worker = Counters(0, 1, worker=0)
    main = Counters(0, 1)
    worker.samples += 5
    worker.opened("a", 0, 1_000_000)
    worker.shard_done("a", 300, 2_000_000, 5)
    main.add(worker.take())
    worker.samples += 2
    worker.shard_done("a", 100, 1_000_000, 2)
    main.add(worker.take())
    assert worker.take()[0] == (0,) * len(worker.take()[0])  # take() zeroes
    snap = main.snapshot()
    assert (snap.samples, snap.bytes, snap.shards) == (7, 400, 1)
    assert snap.storage_s == pytest.approx(0.004)
    assert snap.open_max_s == pytest.approx(0.001)
    (shard,) = snap.slowest_shards
    assert (shard.url, shard.bytes, shard.samples) == ("a", 400, 7)
    assert shard.wait_s == pytest.approx(0.004)


def test_gathered_names_the_slowest_rank_and_shard():
    ranks = [_stats(0, 0.1, url="s0"), _stats(1, 0.9, url="s1"), _stats(2, 0.3, url="s2")]
    g = gathered(ranks)
    assert g.rank is None and g.world_size == 3
    assert g.samples == 30 and g.bytes == 30_000 and g.cache_hits == 9
    assert g.slowest_ranks == (1, 2, 0)
    assert [s.url for s in g.slowest_shards] == ["s1", "s2", "s0"]
    assert "slowest rank 1" in g.summary()
    again = LoaderStats.from_dict(g.as_dict())
    assert again == g


def test_wait_percentiles():
    c = Counters()
    for _ in range(98):
        c.waited(1_000_000)  # 1 ms
    c.waited(100_000_000)  # 100 ms, twice
    c.waited(100_000_000)
    st = c.snapshot()
    assert st.batches == 100 and st.wait_max_s == pytest.approx(0.1)
    assert 0.001 <= st.wait_p50_s <= 0.002  # an upper bound within a factor of two
    assert st.wait_p99_s == pytest.approx(0.1)
    assert st.wait_quantile(0) == st.wait_quantile(0.0) <= st.wait_p50_s
    with pytest.raises(ValueError):
        st.wait_quantile(1.5)


def test_summary_is_one_line():
    line = str(_stats(0, 0.5))
    assert "\n" not in line and line == _stats(0, 0.5).summary()
    assert "rank 0" in line and "10 samples" in line and "cache 75% hits" in line
    assert "wait 25.0%" in line  # 0.5 s of 2 s


def test_prometheus_export_parses():
    url = 'http://h/we"ird\\name\n.tar'  # label values that need escaping
    text = gathered([_stats(0, 0.1, url=url), _stats(1, 0.2)]).prometheus()
    metrics = parse_prometheus(text)
    samples = metrics["tarshards_loader_samples_total"]
    assert samples["type"] == "counter"
    assert sorted((s[1]["rank"], s[2]) for s in samples["samples"]) == [("0", 10.0), ("1", 10.0)]
    shard = metrics["tarshards_loader_shard_wait_seconds"]["samples"]
    assert any(
        labels["url"] == url.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        for _, labels, _ in shard
    )
    check_histogram(metrics["tarshards_loader_batch_wait_seconds"], {"0": 5, "1": 5})
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        return
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["tarshards_loader_samples"].samples[0].value == 10
    found = [s.labels["url"] for s in families["tarshards_loader_shard_wait_seconds"].samples]
    assert url in found
    hist = families["tarshards_loader_batch_wait_seconds"]
    assert hist.type == "histogram"
    counts = {s.labels["rank"]: s.value for s in hist.samples if s.name.endswith("_count")}
    assert counts == {"0": 5, "1": 5}


def test_bad_options():
    with pytest.raises(ValueError, match="watchdog"):
        Counters(watchdog=0)
    with pytest.raises(ValueError, match="on_stall"):
        Counters(on_stall="explode")


# ---- through the loader ----------------------------------------------------------------------
torch = pytest.importorskip("torch")


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("planned", [False, True], ids=["plain", "planned"])
def test_loader_counters_equal_a_traced_run(tmp_path, num_workers, planned):
    from tarshards.torch.adapter import WebDataset, WebLoader

    paths, _ = write_shards(tmp_path, 4, 12)
    want_samples, want_bytes = traced(paths)
    ds = WebDataset(paths, readers=4 if planned else None)
    ds = ds.decode("rgb").to_tuple("jpg", "cls").batched(6)
    loader = WebLoader(ds, batch_size=None, num_workers=num_workers, stats=True)
    got = sum(len(b[1]) for b in loader)
    st = loader.stats()
    assert got == want_samples == st.samples
    assert st.batches == len(list(range(0, got, 6)))
    assert st.bytes == want_bytes  # (a plan's runs cover each shard's bytes once here)
    assert st.shards == len(paths)
    assert sum(s.bytes for s in st.slowest_shards) <= want_bytes
    assert st.decode_s > 0 and st.produce_s > 0  # (per-sample times: estimates)
    assert st.wait_s > 0 and st.wait_max_s <= st.wait_s
    assert st.rank == 0 and st.stalls == 0
    # a second epoch adds up
    sum(len(b[1]) for b in loader)
    assert loader.stats().samples == 2 * want_samples
    assert loader.stats(gather=True).samples == 2 * want_samples  # one process: itself


def test_loader_counts_cache_hits_and_misses(tmp_path):
    from conftest import load_servers

    from tarshards.torch.adapter import WebDataset, WebLoader

    servers = load_servers()
    paths, _ = write_shards(tmp_path, 3, 5)
    with servers.HTTPFileServer(tmp_path) as srv:
        urls = [f"{srv.url}/{os.path.basename(p)}" for p in paths]
        ds = WebDataset(urls, cache_dir=str(tmp_path / "cache")).to_tuple("__key__")
        loader = WebLoader(ds, batch_size=5, stats=True)
        for _ in range(2):
            assert sum(len(b[0]) for b in loader) == 15
    st = loader.stats()
    assert (st.cache_misses, st.cache_hits) == (3, 3)
    assert st.bytes == 2 * sum(os.path.getsize(p) for p in paths)


def test_stats_off_says_how(tmp_path):
    from tarshards.torch.adapter import WebDataset, WebLoader

    paths, _ = write_shards(tmp_path, 1, 2)
    with pytest.raises(ValueError, match="stats=True"):
        WebLoader(WebDataset(paths)).stats()


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("transport", ["auto", None])
def test_stats_leave_the_batches_alone(tmp_path, drop_last, transport):
    """Loader-side batching with workers: the same batches with and without statistics (the
    end-of-stream news never shows), and the last shard's bytes still arrive."""
    from tarshards.torch.adapter import WebDataset, WebLoader

    paths, _ = write_shards(tmp_path, 4, 7)
    _, want_bytes = traced(paths)

    def run(stats):
        ds = WebDataset(paths).to_tuple("__key__", "cls")
        loader = WebLoader(
            ds,
            batch_size=5,
            num_workers=2,
            drop_last=drop_last,
            transport=transport,
            stats=stats,
        )
        return [list(b[0]) for b in loader], loader

    plain, _ = run(False)
    counted, loader = run(True)
    assert counted == plain
    st = loader.stats()
    assert st.bytes == want_bytes and st.samples == 28
    assert st.batches == len(plain)


def test_persistent_workers_keep_counting(tmp_path):
    from tarshards.torch.adapter import WebDataset, WebLoader

    paths, _ = write_shards(tmp_path, 4, 7)
    want_samples, want_bytes = traced(paths)
    ds = WebDataset(paths).to_tuple("__key__", "cls").batched(5)
    loader = WebLoader(ds, batch_size=None, num_workers=2, persistent_workers=True, stats=True)
    for epoch in (1, 2):
        assert sum(len(b[0]) for b in loader) == want_samples
        st = loader.stats()
        assert (st.samples, st.bytes, st.shards) == (
            epoch * want_samples,
            epoch * want_bytes,
            epoch * len(paths),
        )
