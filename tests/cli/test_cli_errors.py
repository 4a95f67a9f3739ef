"""Bad inputs give one line on stderr and exit status 1 in every tool, never a traceback.

Real subprocesses for every reading tool on a member that declares a huge size and on a 0-byte
file (issue 10, defect 6). The subprocesses that meet a huge declared size run with their address
space capped (RLIMIT_AS, 2 GB): a reader that tries to allocate the declared size then fails fast
with MemoryError (which the tools must still report in one line) instead of taking the machine's
memory.
"""

from __future__ import annotations

import io
import os
import resource
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from tarshards import TarWriter, WebDataset
from tarshards.cli import main as cli
from tarshards.pipeline.stages import ignore_and_continue

BIN = Path(sys.executable).parent
TOOLS = {  # script -> extra arguments
    "tarscat": [],
    "tar2tsv": [],
    "tarsplit": ["-o", "out/part"],
    "tarshow": [],
    "tarproc": ["-c", "true"],
    "tarpcat": [],
    "tarsort": [],
}


def tar_with_size_field(size_field: bytes | None = None, pax_size: str | None = None) -> bytes:
    """A 10 kB tar of three members whose second declares a size it does not have."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for i in range(3):
            info = tarfile.TarInfo(f"s{i}.txt")
            info.size = 100
            tf.addfile(info, io.BytesIO(b"x" * 100))
    raw = bytearray(buf.getvalue()[:10240])
    off = 1024
    if size_field is not None:
        raw[off + 124 : off + 136] = size_field
        raw[off + 148 : off + 156] = b" " * 8
        raw[off + 148 : off + 156] = b"%06o\0 " % sum(raw[off : off + 512])
    if pax_size is not None:  # a pax header before the member
        record = f" size={pax_size}\n"
        record = f"{len(record) + len(str(len(record) + 3))}{record}".encode()
        pax = tarfile.TarInfo("././@PaxHeader")
        pax.type = tarfile.XHDTYPE
        pax.size = len(record)
        block = pax.tobuf(tarfile.USTAR_FORMAT) + record + bytes(-len(record) % 512)
        raw[off:off] = block
    return bytes(raw)


HUGE = {
    "octal": tar_with_size_field(b"77777777777\0"),
    "base256_1TB": tar_with_size_field(b"\x80" + (1 << 40).to_bytes(11, "big")),
    "base256_beyond": tar_with_size_field(b"\x80" + (1 << 80).to_bytes(11, "big")),
    "pax": tar_with_size_field(pax_size=str(1 << 60)),
}


MEMORY_CAP = 2 << 30


def _cap_memory():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def run_tool(tool: str, args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / tool), *[str(a) for a in args]],
        cwd=cwd,
        capture_output=True,
        timeout=120,
        preexec_fn=_cap_memory,
    )


def needs(tool: str) -> None:
    if not (BIN / tool).exists():
        pytest.skip(f"{tool} is not installed next to {sys.executable}")


def assert_one_line(stderr: str, returncode: int, prog: str, *needles: str) -> None:
    assert returncode == 1, stderr
    assert "Traceback" not in stderr, stderr
    # progress lines ("# writing out/part-000000.tar") may come first: the samples before the
    # damage are complete and are written; the error itself is one line
    lines = [ln for ln in stderr.strip().splitlines() if not ln.startswith("# ")]
    assert len(lines) == 1, stderr
    assert lines[0].startswith(f"{prog}: error: "), stderr
    for needle in needles:
        assert needle in lines[0], stderr


@pytest.fixture
def bad_inputs(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "huge.tar").write_bytes(HUGE["octal"])
    (tmp_path / "empty.tar").write_bytes(b"")
    return tmp_path


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_every_tool_huge_member_and_empty_file_one_line(tool, bad_inputs):
    needs(tool)
    for name in ("huge.tar", "empty.tar"):
        p = run_tool(tool, [*TOOLS[tool], bad_inputs / name], bad_inputs)
        assert_one_line(p.stderr.decode(), p.returncode, tool, name)
    assert os.listdir(bad_inputs / "out") == []  # tarsplit: no shard, no temporary


@pytest.mark.parametrize("variant", sorted(HUGE))
def test_huge_size_variants(variant, tmp_path):
    needs("tarscat")
    path = tmp_path / f"{variant}.tar"
    path.write_bytes(HUGE[variant])
    p = run_tool("tarscat", [path, "-o", tmp_path / "o.tar"], tmp_path)
    assert_one_line(p.stderr.decode(), p.returncode, "tarscat", path.name)
    assert os.listdir(tmp_path) == [path.name]


def test_tarcheck_on_huge_member_and_empty_file(bad_inputs):
    needs("tarcheck")
    for name in ("huge.tar", "empty.tar"):
        p = run_tool("tarcheck", [bad_inputs / name], bad_inputs)
        err = p.stderr.decode()
        assert p.returncode == 1 and "Traceback" not in err, err
        problems = [ln for ln in err.splitlines() if ln.startswith("tarcheck: problem: ")]
        assert len(problems) == 1 and name in problems[0], err


def invoke(name: str, args, input=None):
    prog = cli.COMMANDS[name][0] or f"tarshards {name}"
    return CliRunner().invoke(
        cli.load_command(name), [str(a) for a in args], input=input, prog_name=prog
    )


def test_empty_stdin_is_an_error(tmp_path):
    r = invoke("cat", [], input=b"")
    assert_one_line(r.stderr, r.exit_code, "tarscat", "0 bytes")


def test_tarsort_empty_field_is_a_usage_error(tmp_path):
    with TarWriter(str(tmp_path / "a.tar")) as w:
        w.write({"__key__": "a", "cls": b"1"})
    for field in ("", " ", "__key__"):
        r = invoke("sort", ["-k", field, tmp_path / "a.tar", "-o", tmp_path / "o.tar"])
        assert r.exit_code == 2, r.output
        assert "is not a field name" in r.stderr
    assert not (tmp_path / "o.tar").exists()


def test_map_with_a_missing_input_says_so_in_one_line(tmp_path):
    with TarWriter(str(tmp_path / "a.tar")) as w:
        w.write({"__key__": "a", "cls": b"1"})
    r = invoke(
        "map",
        [
            "-c",
            "true",
            tmp_path / "a.tar",
            tmp_path / "nosuch.tar",
            "-o",
            str(tmp_path / "out-{0..1}.tar"),
            "-q",
        ],
    )
    assert_one_line(r.stderr, r.exit_code, "tarshards map", "no such input shard", "nosuch.tar")
    assert "Errno" not in r.stderr
    assert not list(tmp_path.glob("out-*"))


def test_on_error_is_one_option_with_the_old_spellings(tmp_path):
    good = tmp_path / "good.tar"
    with TarWriter(str(good)) as w:
        for i in range(3):
            w.write({"__key__": f"k{i}", "cls": str(i)})
    (tmp_path / "bad.tar").write_bytes(good.read_bytes()[:1500])  # cut inside a member
    for name in ("cat", "tsv", "split", "show", "proc", "pcat", "sort"):
        r = invoke(name, ["--help"])
        assert "-e, --on-error [raise|skip]" in r.output, (name, r.output)
    for spelling, code in (
        ("raise", 1),
        ("abort", 1),
        ("fail", 1),
        ("skip", 0),
        ("warn", 0),
        ("SKIP", 0),
    ):
        r = invoke("cat", [tmp_path / "bad.tar", good, "-e", spelling, "-o", tmp_path / "o.tar"])
        assert r.exit_code == code, (spelling, r.output)
        if code == 0:
            assert "tarscat: warning: skipped the rest of a shard" in r.stderr
            assert "bad.tar" in r.stderr
    r = invoke("cat", [good, "-e", "ignore"])
    assert r.exit_code == 2 and "'ignore' is not one of 'raise', 'skip'" in r.stderr
    r = invoke("proc", ["-c", "exit 3", good, "-e", "abort", "-o", tmp_path / "p.tar"])
    assert r.exit_code == 1 and "status 3" in r.stderr


def truncated_tgz(tmp_path) -> Path:
    path = tmp_path / "one.tgz"
    with TarWriter(str(path)) as w:
        w.write({"__key__": "a", "bin": os.urandom(100_000)})
    data = path.read_bytes()
    cut = tmp_path / "cut.tgz"
    cut.write_bytes(data[: len(data) // 2])
    return cut


def test_truncated_tgz_under_a_continuing_handler_names_the_cause(tmp_path):
    cut = truncated_tgz(tmp_path)
    with pytest.raises(ValueError, match="truncated") as info:
        list(WebDataset(str(cut), handler=ignore_and_continue, shardshuffle=False))
    assert "KEY.EXT" not in str(info.value) and "cut.tgz" in str(info.value)
    r = invoke("cat", [cut, "-e", "skip", "-o", tmp_path / "o.tar"])
    assert r.exit_code == 0
    assert "tarscat: warning: skipped the rest of a shard: gzip" in r.stderr
    assert "cut.tgz" in r.stderr
