"""Elastic resume with real gloo process groups: a state saved on R ranks loads on R' ranks.

Every sample of the epoch is delivered exactly once over both worlds, and every rank of a world
runs the same number of steps (each step is an all_reduce under a timeout: a rank that ran dry
would fail the test instead of hanging it).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from test_resume import write_uneven  # noqa: E402

HERE = Path(__file__).resolve().parent
READERS, BATCH = 12, 2  # 73 samples: 3 batches per reader, 36 global batches per epoch


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(tmp, urls, world, *, stop=None, load=None, save=None, tag="a", num_workers=0):
    cfg = {
        "urls": urls,
        "world": world,
        "port": _port(),
        "readers": READERS,
        "batch": BATCH,
        "stop": stop,
        "load": load,
        "save": save,
        "timeout": 60,
        "num_workers": num_workers,
        "out": str(tmp / f"{tag}-{{rank}}.json"),
    }
    path = tmp / f"{tag}.json"
    path.write_text(json.dumps(cfg))
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]),
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "resume_rank.py"), str(path), str(r)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} of {world} failed:\n{out.decode()[-3000:]}"
    return [json.loads((tmp / f"{tag}-{r}.json").read_text()) for r in range(world)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("before,after,stop", [(2, 3, 5), (3, 2, 5), (4, 6, 4)])
def test_elastic_resume_every_sample_once(tmp_path, before, after, stop):
    urls = write_uneven(tmp_path)
    state = str(tmp_path / "state.pt")
    first = run_world(tmp_path, urls, before, stop=stop, save=state, tag="first")
    assert [r["steps"] for r in first] == [stop] * before
    assert all(r["len"] == 36 // before for r in first)
    second = run_world(tmp_path, urls, after, load=state, tag="second")
    left = 36 - stop * before
    steps = -(-left // after)
    assert [r["steps"] for r in second] == [steps] * after  # equal steps on every rank
    delivered = [k for r in first + second for k, pad in zip(r["keys"], r["pads"]) if not pad]
    npad = sum(p for r in second for p in r["pads"])
    assert npad == (steps * after - left) * BATCH  # only the last step is filled up
    assert len(delivered) == 72 and len(set(delivered)) == 72  # every planned sample once
