"""``tarshards browse`` as users run it: a subprocess that prints its URL, serves, and stops on
Ctrl-C (SIGINT) with status 0; a non-loopback address is warned about; a bad spec is one line."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import pytest

import tarshards

pytestmark = pytest.mark.timeout(120)


def _env() -> dict:
    env = dict(os.environ)
    # the subprocess imports the tarshards this test imports (the source tree, or the install)
    where = os.path.dirname(os.path.dirname(os.path.abspath(tarshards.__file__)))
    env["PYTHONPATH"] = where + os.pathsep + env.get("PYTHONPATH", "")
    env["BROWSER"] = "true"  # never a real browser, even without --no-open
    return env


def _start(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tarshards.cli.main", "browse", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    line = proc.stdout.readline()
    m = re.search(r"(http://\S+/)", line)
    if m is None:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"no URL in {line!r}; stderr: {proc.stderr.read()}")
    return proc, m.group(1)


def _stop(proc: subprocess.Popen) -> tuple[int, str]:
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return proc.returncode, err


def test_browse_serves_a_shard_spec_and_stops_on_ctrl_c(dataset, tmp_path):
    proc, url = _start(dataset[1], "--port", "0", "--no-open", "-q", "--index-dir", str(tmp_path))
    try:
        assert url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(url + "api/info", timeout=30) as r:
            info = json.loads(r.read())
        assert info["samples"] == 120 and info["shards"] == 3
        with urllib.request.urlopen(url + "api/sample/119", timeout=30) as r:
            assert json.loads(r.read())["key"] == "img0119"
    finally:
        code, err = _stop(proc)
    assert code == 0, err
    assert "warning" not in err


def test_browse_warns_when_not_on_loopback(dataset):
    proc, url = _start(dataset[0], "--host", "0.0.0.0", "--port", "0", "--no-open")
    try:
        with urllib.request.urlopen(url + "api/info", timeout=30) as r:
            assert json.loads(r.read())["samples"] == 120
    finally:
        code, err = _stop(proc)
    assert code == 0
    assert "warning: binding 0.0.0.0, not a loopback address" in err


def test_browse_bad_spec_is_a_one_line_error(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "tarshards.cli.main", "browse", str(tmp_path / "none.json")],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    assert out.returncode == 1
    assert out.stderr.startswith("tarshards browse: error:") and out.stderr.count("\n") == 1
