"""Every command that takes a shard spec takes a manifest the same way (issue 42, item 3): its
shards, in its order, as ``WebDataset(manifest)`` reads them; and brace typos and missing local
shards are named before anything is read (item 4)."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from tarshards import ShardWriter
from tarshards.cli import main as cli

SPEC = "m-{0000..0002}.tar"


def run(name, args, cwd):
    cmd, prog = cli.load_command(name), cli.COMMANDS[name][0] or f"tarshards {name}"
    old = os.getcwd()
    os.chdir(cwd)
    try:
        return CliRunner().invoke(cmd, [str(a) for a in args], prog_name=prog)
    finally:
        os.chdir(old)


@pytest.fixture
def data(tmp_path):
    os.chdir(tmp_path)
    try:
        with ShardWriter("m-%04d.tar", maxcount=10, manifest="manifest.json") as sink:
            for i in range(30):
                sink.write({"__key__": f"k{i:04d}", "cls": i % 3, "txt": f"text {i}"})
    finally:
        os.chdir(os.path.dirname(tmp_path))
    return tmp_path


# each command that takes a spec: its arguments after the spec ({out}: a fresh output name)
ARGS = {
    "cat": ["-q"],
    "tsv": ["-f", "cls txt"],
    "split": ["-n", "7", "-q", "-o", "{out}/part-%04d.tar"],
    "show": ["-c", "2"],
    "proc": ["-q", "-c", "cat *.txt > /dev/null"],
    "pcat": ["-q", "-p", "1"],
    "sort": ["-q", "-k", "txt"],
    "check": ["-q"],
    "map": ["-q", "-c", "true", "-p", "1", "-o", "{out}-{{0000..0002}}.tar"],
    "bench": ["-q", "-n", "20", "--seconds", "0.2", "--workers", "0", "--json"],
    "index": ["-q", "-o", "{out}.json"],
    "convert": ["-q", "-o", "{out}.parquet"],
    "info": ["--json"],
}


# commands that serve rather than run to an end: checked through what they serve
SERVERS = {"browse"}
# commands that take a manifest or a view only, not shard specs (they read the indexes):
# tests/cli/test_cli_views.py, tests/cli/test_cli_columns.py
MANIFEST_ONLY = {"view", "dedup", "columns", "join"}
# commands whose spec follows other inputs, checked in tests of their own (audit: LEDGER...
# [SPEC], tests/plan/test_ledger.py gives it a manifest and a brace spec)
OWN_TESTS = {"audit"}


def test_every_command_is_covered():
    assert set(ARGS) | SERVERS | MANIFEST_ONLY | OWN_TESTS == set(cli.COMMANDS)


def test_browse_serves_a_manifest_as_it_serves_the_spec(data):
    import re
    import signal
    import subprocess
    import sys
    import urllib.request

    import tarshards

    env = dict(os.environ, BROWSER="true")  # never a real browser
    where = os.path.dirname(os.path.dirname(os.path.abspath(tarshards.__file__)))
    env["PYTHONPATH"] = where + os.pathsep + env.get("PYTHONPATH", "")
    seen = {}
    for label, spec in (("braces", SPEC), ("manifest", "manifest.json")):
        proc = subprocess.Popen(
            [sys.executable, "-m", "tarshards.cli.main", "browse", spec, "--port", "0"]
            + ["--no-open", "-q", "--index-dir", str(data / f"idx_{label}")],
            cwd=data,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            m = re.search(r"(http://\S+/)", proc.stdout.readline())
            assert m is not None, proc.stderr.read()
            pages = []
            for path in ("api/info", "api/sample/0", "api/sample/29"):
                with urllib.request.urlopen(m.group(1) + path, timeout=30) as r:
                    got = json.loads(r.read())
                pages.append({k: got[k] for k in ("samples", "shards", "key") if k in got})
            seen[label] = pages
        finally:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=30)
        assert proc.returncode == 0
    assert seen["braces"] == seen["manifest"]
    assert seen["manifest"][0] == {"samples": 30, "shards": 3}
    assert seen["manifest"][2]["key"] == "k0029"


def _outputs(directory, out):
    found = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith(out):
            path = os.path.join(directory, name)
            if os.path.isdir(path):
                for sub in sorted(os.listdir(path)):
                    with open(os.path.join(path, sub), "rb") as f:
                        found[f"{name}/{sub}"[len(out) :]] = f.read()
            else:
                with open(path, "rb") as f:
                    found[name[len(out) :]] = f.read()
    return found


@pytest.mark.parametrize("name", sorted(ARGS))
def test_a_manifest_is_a_spec_for_every_command(data, name):
    if name == "bench":
        pytest.importorskip("torch")
    if name == "convert":  # shards into Parquet
        pytest.importorskip("pyarrow")
    results = {}
    for label, spec in (("braces", SPEC), ("manifest", "manifest.json")):
        out = f"out_{label}"
        if name == "split":
            os.makedirs(data / out)
        args = [spec] + [a.format(out=out) for a in ARGS[name]]
        r = run(name, args, data)
        assert r.exit_code == 0, (label, r.output)
        assert "not a tar archive" not in r.output
        # (a manifest's shard URLs are resolved against its directory: absolute here)
        stdout = r.stdout_bytes.replace(str(data).encode() + b"/", b"")
        results[label] = (stdout, _outputs(data, out))
    if name == "bench":  # measurements differ; the shards read are the same
        got = [json.loads(results[k][0]) for k in ("braces", "manifest")]
        assert got[0]["shards"] == got[1]["shards"] == 3
        return
    if name == "index":  # the manifests written name the same shards with the same counts
        a, b = (json.loads(results[k][1][".json"]) for k in ("braces", "manifest"))
        assert [(s["url"], s["samples"]) for s in a["shards"]] == [
            (s["url"], s["samples"]) for s in b["shards"]
        ]
        return
    if name == "info":  # the same shards, samples and bytes (named as given)
        a, b = (json.loads(results[k][0])["sources"][0] for k in ("braces", "manifest"))
        assert a["shards"] == b["shards"] == 3 and a["samples"] == b["samples"] == 30
        assert a["bytes"] == b["bytes"] > 0
        return
    if name == "map":  # its summary has timings; the shards written are the same
        assert len(results["manifest"][1]) == 3
        assert results["braces"][1] == results["manifest"][1]
        return
    assert results["braces"] == results["manifest"]
    assert results["manifest"][0] or results["manifest"][1] or name == "check"


def test_tarcheck_of_a_manifest_checks_against_it_and_names_the_member(data):
    import tarfile

    with tarfile.open(data / "m-0001.tar") as tf:
        member = next(m for m in tf.getmembers() if m.name == "k0013.txt")
    with open(data / "m-0001.tar", "r+b") as f:  # same size, other bytes: the hash differs
        f.seek(member.offset_data + 2)
        f.write(b"X")
    r = run("check", ["-q", "manifest.json"], data)
    assert r.exit_code == 1
    lines = [line for line in r.output.splitlines() if ": problem: " in line]
    assert len(lines) == 2, r.output
    assert "m-0001.tar" in lines[0] and "hash" in lines[0]
    assert f"member 'k0013.txt' (offset {member.offset}): its data's checksum differs" in lines[1]
    # the same through --manifest
    r2 = run("check", ["-q", "--manifest", "manifest.json"], data)
    assert r2.exit_code == 1 and r2.output == r.output


def test_a_manifest_in_python_and_on_the_command_line_names_the_same_shards(data):
    from tarshards.format.manifest import spec_urls

    urls = spec_urls(str(data / "manifest.json"))
    assert [os.path.basename(u) for u in urls] == ["m-0000.tar", "m-0001.tar", "m-0002.tar"]
    assert spec_urls([str(data / "manifest.json"), str(data / "m-0000.tar")])[-1].endswith(
        "m-0000.tar"
    )


# ---- item 4: brace typos and missing shards --------------------------------------------------


@pytest.mark.parametrize(
    "spec, said",
    [
        ("m-{0000...0002}.tar", "did not expand: a range has two dots"),
        ("m-{0000..0002.tar", "unbalanced braces"),
    ],
)
def test_brace_typos_say_what_is_wrong(data, spec, said):
    r = run("cat", ["-q", spec], data)
    assert r.exit_code != 0
    assert said in r.output and "no such shard" not in r.output


def test_missing_local_shards_are_listed_before_reading(data):
    r = run("cat", ["-q", "m-{0000..0004}.tar"], data)
    assert r.exit_code != 0
    assert "2 of the 5 shards" in r.output
    assert "m-0003.tar" in r.output and "m-0004.tar" in r.output
    assert r.stdout_bytes == b""  # nothing was written before the error
