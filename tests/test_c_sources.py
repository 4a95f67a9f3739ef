"""The C sources' house rules (src/tarshards/_c/): one tar header parser per direction.

Every C path that reads a tar header goes through ``_c/tar.h``'s parser (its number, checksum,
name and pax record functions), every one that writes a header through its builder; no other C
file defines a parser or builder of its own, nor reads a header field at a raw offset. And the C
files all reach the build: each is a source of an extension in setup.py, and the sdist carries
them (MANIFEST.in).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
C_DIR = ROOT / "src" / "tarshards" / "_c"
TAR_H = C_DIR / "tar.h"

# what tar.h defines: the reading side's parser and the writing side's builder
PARSER = ("tar_number", "tar_header_sum", "tar_checksum_ok", "tar_full_name", "tar_pax_record")
BUILDER = ("tar_put_octal", "tar_template", "tar_header")
# a C function whose name says it parses or builds a header field, a checksum or a pax record
HEADER_WORK = re.compile(
    r"octal|header_sum|checksum_ok|canonical|plain_header|block_ok|pax_record|harmless_pax|"
    r"pax_member|_number|full_name|name_len|tar_header|template|ustar_header",
    re.I,
)
# the header's fields (size, mtime, checksum, type, magic, version, devices, prefix) at raw offsets
RAW_OFFSET = re.compile(r"\b(124|135|136|148|154|155|156|257|263|329|337|345)\b")
# a test against the last octal digit (c <= '7'): the heart of a header number parser
OCTAL_DIGIT = re.compile(r"[<>]=?\s*'7'")


def _sources() -> list[Path]:
    files = sorted(C_DIR.glob("*.c")) + sorted(p for p in C_DIR.glob("*.h") if p != TAR_H)
    assert files, f"no C sources in {C_DIR}"
    return files


def _definitions(text: str) -> list[str]:
    """Names of the functions a C file defines (house style: the name starts its line)."""
    return re.findall(r"^([A-Za-z_]\w*)\([^;]*?\)\s*\{", text, re.M | re.S)


def test_tar_h_holds_the_one_parser_and_the_one_builder():
    defined = set(_definitions(TAR_H.read_text()))
    missing = [name for name in PARSER + BUILDER if name not in defined]
    assert not missing, f"tar.h lacks {missing}"


@pytest.mark.parametrize("path", _sources(), ids=lambda p: p.name)
def test_no_c_file_but_tar_h_parses_or_builds_a_header(path: Path):
    text = path.read_text()
    own = [name for name in _definitions(text) if HEADER_WORK.search(name)]
    assert not own, f"{path.name} defines {own}: header parsing and building belong in tar.h"
    raw = [
        (n, line.strip())
        for n, line in enumerate(text.splitlines(), 1)
        if RAW_OFFSET.search(line.split("/*")[0].split("//")[0])
    ]
    assert not raw, f"{path.name} reads header fields at raw offsets (use tar.h): {raw[:3]}"
    assert not OCTAL_DIGIT.search(text), f"{path.name} parses octal digits (use tar_number)"


def test_the_old_single_files_are_gone():
    package = ROOT / "src" / "tarshards"
    for old in ("_speedups.c", "_xxh3.c", "_names.h", "_jpeg.c", "_deficits.c"):
        assert not (package / old).exists(), f"{old} is back beside _c/"


def test_every_c_file_is_built_and_shipped():
    setup = (ROOT / "setup.py").read_text()
    for path in sorted(C_DIR.glob("*.c")):
        assert f'"{path.name}"' in setup, f"{path.name} is no source of an extension in setup.py"
    manifest = (ROOT / "MANIFEST.in").read_text()
    assert "recursive-include src/tarshards/_c *.c *.h" in manifest


@pytest.mark.parametrize(
    ("module", "names"),
    [
        (
            "tarshards._speedups",
            {
                "scan_members", "ustar_parts", "group_members", "header_ok", "index_columns",
                "sample_members", "members_size", "tar_sample", "read_sample", "index_members",
                "ShuffleRun", "Recorder", "WriteBehind", "Counted", "SampleScan",
            },
        ),
        ("tarshards._xxh3", {"xxh3_64_intdigest", "hash_rows", "checksum64", "Xxh3", "Background"}),
    ],
)  # fmt: skip
def test_the_modules_export_what_they_did(module: str, names: set[str]):
    mod = pytest.importorskip(module, reason=f"{module} is not built here (optional)")
    mod = importlib.import_module(module)
    public = {n for n in dir(mod) if not n.startswith("_")} - {"SCAN_DIRECT"}
    assert public == names
