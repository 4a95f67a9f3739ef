"""The installed command-line tools as real processes in shell pipelines, as in the seed."""

from __future__ import annotations

import io
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import write_shards
from PIL import Image

BIN = Path(sys.executable).parent
TOOLS = [
    "tarscat",
    "tarcats",
    "tar2tsv",
    "tarsplit",
    "tarshow",
    "tarproc",
    "tarpcat",
    "tarsort",
    "tarcheck",
    "tarshards",
]

pytestmark = pytest.mark.skipif(
    not all((BIN / t).exists() for t in TOOLS),
    reason=f"console scripts not installed next to {sys.executable} (pip install -e .)",
)


def sh(cmd: str, cwd, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run a bash pipeline with the venv's scripts first on PATH."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    return subprocess.run(
        ["bash", "-o", "pipefail", "-c", cmd],
        cwd=cwd,
        env=env,
        capture_output=True,
        timeout=timeout,
    )


def tar_members(path) -> list[tarfile.TarInfo]:
    with tarfile.open(path) as tf:
        return [m for m in tf.getmembers() if m.isfile()]


@pytest.fixture
def in_tar(tmp_path):
    paths, samples = write_shards(tmp_path, 1, 30)
    os.rename(paths[0], tmp_path / "in.tar")
    return tmp_path / "in.tar", samples


def assert_one_line_error(proc, prog: str, *needles: str):
    err = proc.stderr.decode()
    assert proc.returncode == 1, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{prog}: error: "), err
    for needle in needles:
        assert needle in lines[0], err


# ---------------------------------------------------------------------------------------------
# "What it must show"
# ---------------------------------------------------------------------------------------------


def test_tarscat_count_then_tar2tsv(in_tar, tmp_path):
    _path, samples = in_tar
    p = sh("tarscat -c 10 in.tar > small.tar", tmp_path)
    assert p.returncode == 0, p.stderr
    p = sh("tar tvf small.tar | fgrep .jpg | wc -l", tmp_path)
    assert p.stdout.decode().strip() == "10"
    # the member bytes pass through unchanged
    with tarfile.open(tmp_path / "small.tar") as tf:
        for s in samples[:10]:
            assert tf.extractfile(f"{s['__key__']}.jpg").read() == s["jpg"]

    p = sh("tar2tsv -f cls small.tar", tmp_path)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.decode().splitlines()
    assert lines[0] == "__key__\tcls"
    assert lines[1:] == [f"{s['__key__']}\t{s['cls'].decode()}" for s in samples[:10]]


def _gnu_tar() -> bool:
    try:
        out = subprocess.run(["tar", "--version"], capture_output=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return b"GNU tar" in out


@pytest.mark.skipif(not _gnu_tar(), reason="needs GNU tar (--sort=name)")
def test_tar_of_a_directory_into_tarsplit_maxshards(tmp_path):
    src = tmp_path / "src" / "train"
    src.mkdir(parents=True)
    payloads = {}
    for i in range(60):  # 60 samples of ~50 kB: about 3 MB in all
        key = f"n{i % 3:04d}_{i:05d}"
        data = os.urandom(50_000)
        (src / f"{key}.bin").write_bytes(data)
        (src / f"{key}.cls").write_text(str(i % 3))
        payloads[f"train/{key}"] = data
    (src / "README").write_text("no extension: not part of any sample")
    out = tmp_path / "out"
    out.mkdir()
    p = sh(
        f"tar -cf - --sort=name -C {shlex.quote(str(tmp_path / 'src'))} . "
        "| tarsplit -s 1e6 -o out/out --maxshards 2",
        tmp_path,
    )
    err = p.stderr.decode()
    assert "Traceback" not in err
    assert "# writing out/out-000000.tar" in err and "# writing out/out-000001.tar" in err
    assert "stopped after --maxshards 2" in err and "rest of the input was not read" in err
    assert sorted(os.listdir(out)) == ["out-000000.tar", "out-000001.tar"]  # no temp files left
    keys = []
    for name in ("out-000000.tar", "out-000001.tar"):
        shard = out / name
        assert shard.stat().st_size <= 1e6
        with tarfile.open(shard) as tf:  # a complete, valid archive for the standard library
            for m in tf.getmembers():
                key, ext = m.name.split(".", 1)
                assert not key.startswith("./")
                if ext == "bin":
                    keys.append(key)
                    assert tf.extractfile(m).read() == payloads[key]
    assert len(keys) >= 2 * 17 and len(keys) < 60
    assert keys == sorted(keys)
    p = sh("tarcheck out/out-000000.tar out/out-000001.tar", tmp_path)
    assert p.returncode == 0, p.stderr


def test_tarshow_two_samples(in_tar, tmp_path):
    _path, samples = in_tar
    p = sh("tarshow -c 2 in.tar", tmp_path)
    assert p.returncode == 0, p.stderr
    blocks = p.stdout.decode().strip().split("\n\n")
    assert len(blocks) == 2
    for block, s in zip(blocks, samples):
        fields = dict(line.split(None, 1) for line in block.splitlines())
        assert fields["__key__"] == s["__key__"]
        assert fields["cls"] == s["cls"].decode()
        assert fields["json"] == s["json"].decode()
        assert fields["jpg"].startswith(f"[{len(s['jpg'])} bytes] ff d8 ff")


def test_tarproc_parallel_resize_keeps_order(in_tar, tmp_path):
    script = (
        "from PIL import Image; import glob; "
        "[Image.open(f).resize((20, 10)).save(f) for f in glob.glob('*.jpg')]"
    )
    cmd = f"{shlex.quote(sys.executable)} -c {shlex.quote(script)}"
    p = sh(
        f"tarscat -c 12 in.tar | tarproc -p 5 -c {shlex.quote(cmd)} > out.tar",
        tmp_path,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    _, samples = in_tar
    members = tar_members(tmp_path / "out.tar")
    names = [m.name for m in members]
    expect = [f"{s['__key__']}.{ext}" for s in samples[:12] for ext in ("cls", "jpg", "json")]
    assert names == expect  # input order, all fields
    with tarfile.open(tmp_path / "out.tar") as tf:
        for s in samples[:12]:
            img = Image.open(io.BytesIO(tf.extractfile(f"{s['__key__']}.jpg").read()))
            assert img.size == (20, 10)
            assert tf.extractfile(f"{s['__key__']}.cls").read() == s["cls"]


@pytest.mark.parametrize("tool", TOOLS)
def test_help_has_one_line_per_option_and_an_example(tool, tmp_path):
    p = sh(f"{tool} --help", tmp_path)
    assert p.returncode == 0, p.stderr
    text = p.stdout.decode()
    assert "Examples:" in text
    options = text.split("Options:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert options and all(line.startswith("  -") for line in options), text
    assert any("--help" in line for line in options)


# ---------------------------------------------------------------------------------------------
# bad inputs: one line, exit status, no traceback
# ---------------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    p = sh("tarscat nosuch.tar > out.tar", tmp_path)
    assert_one_line_error(p, "tarscat", "nosuch.tar")


def test_truncated_tar(in_tar, tmp_path):
    data = in_tar[0].read_bytes()
    victim = [m for m in tar_members(in_tar[0]) if m.name.endswith(".jpg")][12]
    (tmp_path / "cut.tar").write_bytes(data[: victim.offset_data + 100])  # cut inside a member
    p = sh("tarscat cut.tar > out.tar", tmp_path)
    assert_one_line_error(
        p, "tarscat", "truncated", "cut.tar", repr(victim.name), f"offset {victim.offset}"
    )
    p = sh("tar2tsv cut.tar > out.tsv", tmp_path)
    assert_one_line_error(p, "tar2tsv", "cut.tar", "offset")


def test_non_tar_file(tmp_path):
    (tmp_path / "notes.tar").write_bytes(b"just some text, not an archive\n" * 40)
    p = sh("tarscat notes.tar > out.tar", tmp_path)
    assert_one_line_error(p, "tarscat", "notes.tar", "offset 0")
    p = sh("cat notes.tar | tarsplit -o x", tmp_path)
    assert_one_line_error(p, "tarsplit", "offset 0")
    assert not list(tmp_path.glob("x-*"))


def test_bad_size_string_is_a_usage_error(tmp_path):
    p = sh("tarsplit -s 12Q -o out in.tar", tmp_path)
    err = p.stderr.decode()
    assert p.returncode == 2
    assert "Traceback" not in err
    assert "Error: Invalid value for '-s' / '--maxsize': '12Q' is not a size" in err


def test_closed_stdout_exits_quietly(tmp_path):
    _paths, _ = write_shards(tmp_path, 3, 40)
    p = sh(
        "tarscat 'shard-{0000..0002}.tar' 'shard-{0000..0002}.tar' | head -c 100 | wc -c", tmp_path
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.decode().strip() == "100"
    assert p.stderr == b""


def test_subcommand_equals_script(in_tar, tmp_path):
    a = sh("tarscat -c 5 -s 3 in.tar | md5sum", tmp_path)
    b = sh("tarshards cat -c 5 -s 3 in.tar | md5sum", tmp_path)
    c = sh("tarcats -c 5 -s 3 in.tar | md5sum", tmp_path)
    assert a.returncode == b.returncode == c.returncode == 0
    assert a.stdout == b.stdout == c.stdout


def test_stdin_pipeline_through_several_tools(in_tar, tmp_path):
    if shutil.which("gzip") is None:
        pytest.skip("gzip not installed")
    p = sh(
        "gzip -c in.tar | tarscat -s 5 | tarsort -k cls -n -r | tarsplit -n 10 -z -o part "
        "&& tarcheck part-*.tgz",
        tmp_path,
    )
    assert p.returncode == 0, p.stderr
    assert sorted(x.name for x in tmp_path.glob("part-*")) == [
        "part-000000.tgz",
        "part-000001.tgz",
        "part-000002.tgz",
    ]
    assert "total (3 shards)       25" in p.stdout.decode()
