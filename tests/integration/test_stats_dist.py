"""``WebLoader.stats(gather=True)`` over a real 2-rank gloo process group (fresh interpreters,
the way torchrun starts ranks): every rank gets all ranks' statistics, summed, with the slowest
rank and shards named, and the export parses as Prometheus text."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from conftest import write_shards  # noqa: E402
from test_stats import check_histogram, parse_prometheus, traced  # noqa: E402

RANK_SCRIPT = Path(__file__).with_name("_stats_rank.py")
WORLD = 2


def test_gathered_statistics_over_gloo(tmp_path):
    paths, _ = write_shards(tmp_path, 4, 6)
    want_samples, want_bytes = traced(paths)
    out = tmp_path / "out"
    out.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    procs = [
        subprocess.Popen(
            [sys.executable, str(RANK_SCRIPT), str(r), str(WORLD), str(port), str(out), *paths],
            env=env,
            stderr=subprocess.PIPE,
        )
        for r in range(WORLD)
    ]
    try:
        errs = [p.communicate(timeout=240)[1].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{errs[r][-3000:]}"
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert results[0]["stats"] == results[1]["stats"] or all(
        res["stats"]["samples"] == want_samples for res in results
    )
    for res in results:
        st = res["stats"]
        assert st["rank"] is None and st["world_size"] == WORLD
        assert st["samples"] == want_samples and st["bytes"] == want_bytes
        per_rank = {r["rank"]: r for r in st["ranks"]}
        assert sorted(per_rank) == [0, 1]
        for r in (0, 1):  # each rank's own counts: what it read
            assert per_rank[r]["samples"] == len(results[r]["keys"]) > 0
        assert st["slowest_ranks"][0] == 1  # its stage sleeps: its loop waits longest
        assert {s["url"] for s in st["slowest_shards"]} <= set(paths)
        metrics = parse_prometheus(res["text"])
        ranks = {lab["rank"] for _, lab, _ in metrics["tarshards_loader_samples_total"]["samples"]}
        assert ranks == {"0", "1"}
        check_histogram(
            metrics["tarshards_loader_batch_wait_seconds"],
            {str(r): per_rank[r]["batches"] for r in (0, 1)},
        )
