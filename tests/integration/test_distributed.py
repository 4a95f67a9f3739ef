"""Ranks under a real ``torch.distributed`` process group (gloo, 2 processes started here).

The ranks are started as ``torchrun`` starts them (a fresh interpreter each, a TCP rendezvous on
a free local port), but without ``RANK``/``WORLD_SIZE`` in their environment: nothing is passed to
the datasets, whose rank must come from the process group, be discovered in the rank's main
process and be carried to the DataLoader workers (default, spawn and fork start methods). The
group runs every configuration once for the module (its start-up is the slow part); the tests then
check what each rank read.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import _dist_ranks  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tarshards import TarWriter  # noqa: E402

pytestmark = [
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(),
        reason="torch.distributed with gloo is not available",
    ),
    pytest.mark.timeout(1200),  # the group's first test waits for all of it (see STALL_TIMEOUT)
]

WORLD_SIZE = 2
NSHARDS, PER_SHARD = 12, 5  # enough shards for 2 ranks x 3 workers
# a hang fails the test: no configuration finished for this long (one takes seconds on an idle
# machine; spawned workers import torch, which is slow on a loaded one)
STALL_TIMEOUT = 240
RANK_SCRIPT = Path(_dist_ranks.__file__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world_size: int, out: Path, urls: list[str]):
    """Start ``world_size`` rank processes and wait for them. Fail, killing them, when one fails
    or when none has finished a configuration for ``STALL_TIMEOUT`` seconds (a hang)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    port = free_port()
    procs, errs = [], []
    try:
        for r in range(world_size):
            errs.append(open(out / f"rank{r}.err", "w"))
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(RANK_SCRIPT),
                        str(r),
                        str(world_size),
                        str(port),
                        str(out),
                        *urls,
                    ],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=errs[-1],
                )
            )
        last, progress = time.monotonic(), ""
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break  # one failed: the others may wait for it forever
            now = "".join(f.read_text() for f in sorted(out.glob("rank*.log")))
            if now != progress:
                last, progress = time.monotonic(), now
            elif time.monotonic() - last > STALL_TIMEOUT:
                pytest.fail(
                    f"the {world_size}-rank group made no progress for {STALL_TIMEOUT} s "
                    f"(a hang?); configurations done:\n{progress}"
                )
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in errs:
            f.close()
    for r, p in enumerate(procs):
        err = (out / f"rank{r}.err").read_text()
        assert p.returncode == 0, f"rank {r} failed ({p.returncode}):\n{err[-4000:]}"


@pytest.fixture(scope="module")
def group_run(tmp_path_factory):
    """Write the shards and run every configuration on 2 ranks: (all keys, per-rank results)."""
    root = tmp_path_factory.mktemp("dist")
    urls, all_keys = [], []
    for s in range(NSHARDS):
        path = root / f"part-{s:04d}.tar"
        with TarWriter(str(path)) as w:
            for i in range(PER_SHARD):
                key = f"s{s:02d}-{i}"
                w.write({"__key__": key, "txt": key})
                all_keys.append(key)
        urls.append(str(path))
    out = root / "out"
    out.mkdir()
    launch(WORLD_SIZE, out, urls)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    return sorted(all_keys), results


def assert_split(per_rank: list[list[str]], all_keys: list[str]):
    """Disjoint between ranks, together complete, each sample once."""
    first, second = per_rank
    assert first and second, "a rank read nothing"
    assert not set(first) & set(second), "ranks overlap"
    assert sorted(first + second) == all_keys


@pytest.mark.parametrize(
    "config", list(_dist_ranks.configurations()), ids=lambda c: _dist_ranks.name(*c)
)
def test_ranks_disjoint_and_complete(group_run, config):
    all_keys, results = group_run
    label = _dist_ranks.name(*config)
    assert_split([r[label] for r in results], all_keys)


@pytest.mark.parametrize("label", [c[0] for c in _dist_ranks.COMPAT])
def test_compat_pipeline_ranks_disjoint_and_complete(group_run, label):
    """``wds.DataPipeline(SimpleShardList, split_by_node, split_by_worker, ...)``: the splitter
    stages, which ask tarshards.torch for the rank inside the worker, get the main process's."""
    all_keys, results = group_run
    assert_split([r[label] for r in results], all_keys)


def test_rank_streams_do_not_depend_on_start_method_or_style(group_run):
    """Each rank's stream is a function of the seed, the epoch and the reader only."""
    _, results = group_run
    for r in results:
        for num_workers in _dist_ranks.WORKERS:
            streams = {
                tuple(r[_dist_ranks.name(style, n, ctx)])
                for style, n, ctx in _dist_ranks.configurations()
                if n == num_workers
            }
            assert len(streams) == 1, f"num_workers={num_workers}: the streams differ"


def test_rank_processes_were_distinct(group_run):
    _, results = group_run
    assert results[0]["pid"] != results[1]["pid"]


@pytest.mark.parametrize("label", ["persistent-spawn", "persistent-fork", "fresh-fork"])
def test_webloader_epochs_under_the_group(group_run, label):
    """WebLoader, persistent workers or not: every epoch a new order, split across ranks."""
    all_keys, results = group_run
    for epoch in range(_dist_ranks.EPOCHS):
        assert_split([r[label][epoch] for r in results], all_keys)
    for r in results:
        orders = [tuple(e) for e in r[label]]
        assert len(set(orders)) == len(orders), "an epoch repeated the previous order"


def test_webloader_same_seed_same_orders(group_run):
    """Three loaders built with the same seed (persistent spawn/fork workers, fresh workers)
    give the same orders epoch by epoch on each rank."""
    _, results = group_run
    for r in results:
        assert r["persistent-spawn"] == r["persistent-fork"] == r["fresh-fork"]
