"""``tarshards convert`` killed with SIGKILL mid-way and run again: only the missing shards are
written, the earlier ones are untouched (same inode, same mtime), and the data set holds exactly
the source's samples, none twice.

To stop the conversion at a known place, one source file is a named pipe: the shard job that
reads it blocks there (with the shards before it committed, and its own temporary file open)
until the test kills the process group. The pipe is then replaced by an empty file of the same
name and size (the source's listing, and so the conversion's plan, are unchanged)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tarshards.format.manifest import Manifest
from tarshards.pipeline.dataset import iter_samples

ROOT = Path(__file__).resolve().parents[2]
N, PER_SHARD, BLOCKED = 60, 5, 37  # 12 shards; the row that blocks is in shard 7


def _cli(src, out, workers):
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    )
    cmd = [sys.executable, "-m", "tarshards.cli.main", "convert", str(src), "-o", str(out)]
    cmd += ["-c", str(PER_SHARD), "-p", str(workers), "-q"]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )


def _shards(out) -> list[str]:
    return sorted(p for p in os.listdir(out) if p.endswith(".tar"))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
@pytest.mark.parametrize("workers", [1, 2])
def test_sigkill_then_rerun_writes_only_the_missing_shards(tmp_path, workers):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    payload = {}
    for i in range(N):
        name = f"s{i:03d}"
        if i == BLOCKED:
            os.mkfifo(src / f"{name}.bin")
            payload[name] = b""
        else:
            payload[name] = os.urandom(1000 + i)
            (src / f"{name}.bin").write_bytes(payload[name])
    # all shards but the blocked one can finish when there are 2 workers; shards 0..6 with one
    expect_done = 12 - 1 if workers == 2 else BLOCKED // PER_SHARD
    p = _cli(src, out, workers)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if out.exists() and len(_shards(out)) >= expect_done:
                break
            assert p.poll() is None, p.communicate()[0].decode()[-2000:]
            time.sleep(0.02)
        time.sleep(0.3)  # nothing more is written: the job of shard 7 waits on the pipe
        done = _shards(out)
        assert len(done) == expect_done, done
        assert f"shard-{BLOCKED // PER_SHARD:06d}.tar" not in done
        before = {name: os.stat(out / name) for name in done}
    finally:
        os.killpg(p.pid, signal.SIGKILL)  # the command and its worker processes
        p.communicate()
    assert not (out / "manifest.json").exists()
    assert any(".tmp" in n or n.startswith(".") for n in os.listdir(out)), os.listdir(out)

    os.remove(src / f"s{BLOCKED:03d}.bin")
    (src / f"s{BLOCKED:03d}.bin").write_bytes(b"")
    p = _cli(src, out, workers)
    output = p.communicate(timeout=300)[0].decode()
    assert p.returncode == 0, output[-3000:]

    for name, st in before.items():  # earlier shards untouched
        now = os.stat(out / name)
        assert (now.st_ino, now.st_mtime_ns, now.st_size) == (
            st.st_ino,
            st.st_mtime_ns,
            st.st_size,
        )
    m = Manifest.load(out / "manifest.json")
    assert len(m.shards) == 12 and m.num_samples == N
    keys = []
    for s in iter_samples(m.shard_urls()):
        keys.append(s["__key__"])
        assert bytes(s["bin"]) == payload[s["__key__"]]
    assert keys == sorted(payload)  # exactly the source's samples, in order, none twice
    # what the killed writer left was removed; only shards, indexes, manifest and plan remain
    left = sorted(os.listdir(out))
    assert left == sorted(
        [f"shard-{k:06d}.tar{x}" for k in range(12) for x in ("", ".tsidx")]
        + ["manifest.json", "manifest.json.convert"]
    )
