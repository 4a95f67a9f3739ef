"""The training script of docs/distributed.md, killed with SIGKILL mid-epoch and restarted from
its last checkpoint, logs the same batches as an uninterrupted run."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent


def training_script() -> str:
    text = (ROOT / "docs" / "distributed.md").read_text()
    m = re.search(r"```python\n(# train\.py\n.*?)```", text, re.S)
    assert m, "docs/distributed.md has no train.py block"
    return m.group(1)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(script, data, ckpt, delay=0.0):
    env = dict(
        os.environ,
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_port()),
        TRAIN_STEP_SECONDS=str(delay),
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    )
    return subprocess.Popen(
        [sys.executable, str(script), data, str(ckpt)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def finish(p, timeout=300):
    out = p.communicate(timeout=timeout)[0].decode()
    assert p.returncode == 0, out[-3000:]


@pytest.mark.timeout(600)
def test_sigkill_mid_epoch_then_restart_equals_uninterrupted(tmp_path):
    from tarshards import ShardWriter

    with ShardWriter(str(tmp_path / "data-%04d.tar"), maxcount=10) as sink:
        for i in range(80):
            sink.write({"__key__": f"s{i:03d}", "cls": i % 10, "txt": f"sample {i}"})
    data = str(tmp_path / "data-{0000..0007}.tar")
    script = tmp_path / "train.py"
    script.write_text(training_script())

    finish(start(script, data, tmp_path / "whole"))
    whole = (tmp_path / "whole" / "log-0.txt").read_text().splitlines()
    assert len(whole) == 40 and len(set(whole)) == 40  # 2 epochs x 20 steps

    ckpt = tmp_path / "crash"
    p = start(script, data, ckpt, delay=0.2)
    log = ckpt / "log-0.txt"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and p.poll() is None:
        if log.exists() and len(log.read_text().splitlines()) >= 10:
            break
        time.sleep(0.05)
    assert p.poll() is None, "the trainer ended before it could be killed"
    os.killpg(p.pid, signal.SIGKILL)  # the trainer and its DataLoader workers
    p.communicate(timeout=60)
    logged = len(log.read_text().splitlines())
    assert 10 <= logged < 20  # killed inside epoch 0
    import torch

    saved = torch.load(ckpt / "last.pt", weights_only=True)
    assert 0 < saved["step"] <= logged and saved["loader"]["step"] == saved["step"]

    finish(start(script, data, ckpt))
    assert log.read_text().splitlines() == whole
