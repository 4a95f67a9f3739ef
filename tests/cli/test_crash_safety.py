"""kill -9 at random moments: no partial shard under a final name, no temporary left behind.

The writers run as real processes (``ShardWriter`` in a Python script, ``tarsplit``, ``tarscat
-o``) writing shards of a few hundred kB to a MB, and are killed with SIGKILL at random moments
(seeded) while their temporary file exists. After each kill every file under a final name must be
a complete, valid shard with the right samples; a run to completion into the same place must then
leave no temporary file behind.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tarshards import TarWriter
from tarshards.pipeline.dataset import shard_samples

BIN = Path(sys.executable).parent
KILLS = 3  # per writer
pytestmark = pytest.mark.skipif(os.name != "posix", reason="needs SIGKILL and flock")


def payload(i: int) -> bytes:
    # ~150 kB that do not compress, derived from the index (no big expected values to keep)
    seed = hashlib.sha256(str(i).encode()).digest()
    return seed * (150_000 // len(seed))


def expected_key(i: int) -> str:
    return f"s{i:04d}"


N = 40

_SHARDWRITER = f"""
import hashlib, sys
from tarshards import ShardWriter
def payload(i):
    seed = hashlib.sha256(str(i).encode()).digest()
    return seed * (150_000 // len(seed))
with ShardWriter(sys.argv[1], maxsize=1_000_000) as sink:
    for i in range({N}):
        sink.write({{"__key__": f"s{{i:04d}}", "bin": payload(i), "cls": str(i % 7)}})
"""


@pytest.fixture(scope="module")
def big_tar(tmp_path_factory):
    path = tmp_path_factory.mktemp("in") / "big.tar"
    with TarWriter(str(path)) as w:
        for i in range(N):
            w.write({"__key__": expected_key(i), "bin": payload(i), "cls": str(i % 7)})
    return path


def check_complete(path: Path, must_start_at_zero: bool = False) -> list[int]:
    """``path`` is a whole shard: end marker, readable to the end, every sample as written."""
    raw = path.read_bytes()
    assert raw[-1024:] == bytes(1024), f"{path.name}: no end-of-archive marker"
    indices = []
    for s in shard_samples(str(path)):
        i = int(s["__key__"][1:])
        assert s["bin"] == payload(i) and s["cls"] == str(i % 7).encode(), path.name
        indices.append(i)
    assert indices and indices == list(range(indices[0], indices[0] + len(indices))), path.name
    if must_start_at_zero:
        assert indices[0] == 0
    return indices


def final_files(out: Path) -> list[Path]:
    return sorted(p for p in out.iterdir() if not p.name.startswith("."))


def temporaries(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.endswith(".tmp"))


def run_and_kill(cmd: list[str], out: Path, delay) -> tuple[bool, float]:
    """Start ``cmd``; once its own temporary file exists, wait ``delay()`` seconds and SIGKILL
    it. Returns whether the kill left its temporary behind (it was caught in the middle of a
    shard) and how long it ran after its temporary appeared."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    mine = f".{proc.pid}-"  # its own temporary, not one a killed run left
    try:
        deadline = time.monotonic() + 60
        while (
            not any(mine in n for n in temporaries(out))
            and proc.poll() is None
            and time.monotonic() < deadline
        ):
            time.sleep(0.002)
        t0 = time.monotonic()
        wait = delay()
        if wait is None:
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err.decode()
            return False, time.monotonic() - t0
        time.sleep(wait)
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        return any(mine in n for n in temporaries(out)), time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


WRITERS = {
    "ShardWriter": lambda out, big: [sys.executable, "-c", _SHARDWRITER, str(out / "sw-%04d.tar")],
    "tarsplit": lambda out, big: [
        str(BIN / "tarsplit"),
        "-s",
        "1M",
        "-q",
        "-o",
        str(out / "ts"),
        str(big),
    ],
    "tarscat": lambda out, big: [str(BIN / "tarscat"), str(big), "-o", str(out / "all.tar")],
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_kill_9_never_publishes_a_partial_shard(writer, big_tar, tmp_path):
    if writer != "ShardWriter" and not (BIN / writer).exists():
        pytest.skip(f"{writer} is not installed next to {sys.executable}")
    out = tmp_path / "out"
    out.mkdir()
    cmd = WRITERS[writer](out, big_tar)
    rng = random.Random(f"kill-9 {writer}")
    _, duration = run_and_kill(cmd, out, lambda: None)  # how long one whole run writes
    caught = attempts = 0
    longest = 0.9 * duration
    # KILLS kills at random moments; on a loaded machine a run's speed varies, so while none has
    # landed in the middle of a shard yet, try a few more with shorter delays
    while attempts < KILLS or (not caught and attempts < KILLS + 8):
        left, _ = run_and_kill(cmd, out, lambda top=longest: rng.uniform(0, top))
        attempts += 1
        caught += left
        if not left:
            longest /= 2
        for path in final_files(out):  # whatever is visible under a final name is whole
            check_complete(path)
    assert caught >= 1  # some kills did land in the middle of a shard
    # a run to completion into the same place removes what the killed runs left
    proc = subprocess.run(cmd, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()
    assert temporaries(out) == []
    seen = []
    for path in final_files(out):
        seen += check_complete(path)
    assert seen == list(range(N))
