"""Elastic resume with real gloo process groups: a state saved on R ranks loads on R' ranks.

Every sample of the epoch is delivered exactly once over both worlds, and every rank of a world
runs the same number of steps (each step is an all_reduce under a timeout: a rank that ran dry
would fail the test instead of hanging it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from conftest import free_port, run_ranks  # noqa: E402
from test_resume import write_uneven  # noqa: E402

HERE = Path(__file__).resolve().parent
READERS, BATCH = 12, 2  # 73 samples: 3 batches per reader, 36 global batches per epoch


def run_world(tmp, urls, world, *, stop=None, load=None, save=None, tag="a", num_workers=0):
    cfg = {
        "urls": urls,
        "port": free_port(),
        "readers": READERS,
        "batch": BATCH,
        "stop": stop,
        "load": load,
        "save": save,
        "timeout": 60,
        "num_workers": num_workers,
    }
    return run_ranks(HERE / "resume_rank.py", cfg, world, tmp, tag)


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
