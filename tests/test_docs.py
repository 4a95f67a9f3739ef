"""Run the code blocks of README.md and docs/*.md, so the documentation never drifts from the code.

Each document is one test. Its fenced blocks run in order, in a fresh temporary directory:
``python`` blocks are executed in one shared namespace (a block may use what an earlier one
defined), ``bash``/``sh`` blocks run with ``bash -euo pipefail`` with the virtual environment's
``bin`` first on ``PATH`` (so ``tarscat``, ``tar2tsv``... are the installed tools). Other fences
(``text``, ``console``, ``yaml``...) are shown output or configuration and are not run.

A block that cannot run here (it needs a remote server, a cluster, or would recurse into
``make test``) is preceded by the marker line::

    <!-- doctest: skip (the reason) -->

which renders as nothing. Keep those few.

A block preceded by ``<!-- doctest: write NAME -->`` is not run but written to the file ``NAME``
in that directory (a script that a later ``bash`` block runs, under ``torchrun`` say).

Where an optional package is not installed (the lean CI job: ``pip install .`` without extras), a
document stops at the first block that needs one and is skipped, naming the package; in the full
install every block runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
RUN_PY = {"python", "py", "python3"}
RUN_SH = {"bash", "sh", "shell"}
SKIP_MARK = re.compile(r"^<!--\s*doctest:\s*skip\b.*-->\s*$")
WRITE_MARK = re.compile(r"^<!--\s*doctest:\s*write\s+(\S+)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")


def extract_blocks(text: str) -> list[dict]:
    """The fenced code blocks of a markdown text: language, code, first line, skip marker."""
    blocks = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        j = i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        skip = j >= 0 and bool(SKIP_MARK.match(lines[j].strip()))
        write = WRITE_MARK.match(lines[j].strip()) if j >= 0 else None
        body = []
        k = i + 1
        while k < len(lines) and not lines[k].strip().startswith(fence):
            line = lines[k]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            k += 1
        if k == len(lines):
            raise ValueError(f"unclosed code fence at line {i + 1}")
        blocks.append({"lang": lang, "code": "\n".join(body) + "\n", "line": i + 2, "skip": skip})
        if write:
            blocks[-1]["write"] = write.group(1)
        i = k + 1
    return blocks


def test_extract_blocks():
    text = (
        "# t\n\n```python\nx = 1\n```\n\ntext\n<!-- doctest: skip (needs s3) -->\n"
        "```bash\naws s3 ls\n```\n\n```text\noutput\n```\n"
    )
    blocks = extract_blocks(text)
    assert [(b["lang"], b["skip"], b["line"]) for b in blocks] == [
        ("python", False, 4),
        ("bash", True, 10),
        ("text", False, 14),
    ]
    assert blocks[0]["code"] == "x = 1\n"
    with pytest.raises(ValueError, match="unclosed"):
        extract_blocks("```python\nx = 1\n")


def test_every_doc_has_runnable_blocks():
    """Each page shows code, and most of it runs: skipped blocks stay the exception."""
    assert (ROOT / "docs").is_dir()
    names = {p.name for p in DOCS}
    for required in (
        "format.md",
        "dataset.md",
        "distributed.md",
        "storage.md",
        "cli.md",
        "processing.md",
        "migration.md",
    ):
        assert required in names, f"docs/{required} is missing"
    total = skipped = 0
    for path in DOCS:
        blocks = [b for b in extract_blocks(path.read_text()) if b["lang"] in RUN_PY | RUN_SH]
        runnable = [b for b in blocks if not b["skip"]]
        assert runnable, f"{path.name} has no block that runs"
        total += len(blocks)
        skipped += len(blocks) - len(runnable)
    assert skipped <= max(3, total // 5), f"{skipped} of {total} blocks are skipped"


# optional packages the docs and examples use (extras of pyproject.toml, and the dev tools)
OPTIONAL = (
    "torch",
    "dask",
    "distributed",
    "ray",
    "aiohttp",
    "requests",
    "s3fs",
    "gcsfs",
    "msgpack",
    "simplejpeg",
    "webdataset",
    "cloudpickle",
    "sklearn",
    "moto",
    "boto3",
    "av",
    "soundfile",
    "pyarrow",
    "datasets",
    "yaml",
)
MISSING = [name for name in OPTIONAL if importlib.util.find_spec(name) is None]
_NEEDS = re.compile(
    r"No module named '([\w.]+)'|MissingDependencyError|pip install 'tarshards\[|"
    r"install cloudpickle|torchrun: command not found"
)


def _skip_if_needs_missing(where: str, text: str) -> None:
    """Skip (naming the missing packages) when a block failed for want of an optional one."""
    m = _NEEDS.search(text)
    if m and MISSING and (m.group(1) is None or m.group(1).split(".")[0] in MISSING):
        line = text.strip().splitlines()[0]
        pytest.skip(f"{where} needs an optional package: {line[:160]}")


def _requires(*names: str) -> None:
    for name in names:
        pytest.importorskip(name, reason=f"needs {name} (an optional package)")


def _run_python(code: str, path: Path, line: int, module: types.ModuleType) -> None:
    # pad so that tracebacks point at the right line of the markdown file
    exec(compile("\n" * (line - 1) + code, str(path), "exec"), module.__dict__)


def _run_shell(code: str, where: str, cwd: Path) -> None:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{where}: shell block exited with {proc.returncode}\n"
            f"--- code\n{code}--- stdout\n{proc.stdout[-3000:]}"
            f"--- stderr\n{proc.stderr[-3000:]}"
        )


# docs/migration.md runs webdataset 1.0.2's tariterators.url_opener, which leaves its shard files
# open (the warning comes from wherever the garbage collector runs, so not by module)
@pytest.mark.filterwarnings("ignore:unclosed file <_io.BufferedReader name='ds-000:ResourceWarning")
# docs/distributed.md splits shards of unknown counts by rank: the warning users see there too
@pytest.mark.filterwarnings(
    "ignore:\\d+ ranks may read different numbers:tarshards.errors.TarshardsWarning"
)
@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_doc_blocks_run(path: Path, tmp_path, monkeypatch):
    blocks = extract_blocks(path.read_text())
    monkeypatch.chdir(tmp_path)
    # a module object that is *not* in sys.modules: plain pickle cannot find the doc's functions
    # by reference, so worker processes (local or Dask) receive them by value through cloudpickle
    module = types.ModuleType("tarshards_doc_" + re.sub(r"\W", "_", path.stem))
    module.__file__ = str(path)
    for block in blocks:
        if block["skip"] or block["lang"] not in RUN_PY | RUN_SH:
            continue
        where = f"{path.relative_to(ROOT)}:{block['line']}"
        if block.get("write"):  # a script for a later block to run
            (tmp_path / block["write"]).write_text(block["code"])
            continue
        try:
            if block["lang"] in RUN_PY:
                _run_python(block["code"], path, block["line"], module)
            else:
                _run_shell(block["code"], where, tmp_path)
        except Exception as exn:
            _skip_if_needs_missing(where, f"{type(exn).__name__}: {exn}")
            raise


# ---------------------------------------------------------------------------------------------
# the example scripts
# ---------------------------------------------------------------------------------------------


def _run_example(args: list[str], cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable] + args, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{args[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_imagefolder_to_shards(tmp_path):
    from PIL import Image

    from tarshards import WebDataset

    root = tmp_path / "folder"
    names = {"cat": 5, "dog": 4, "emu": 3}
    for name, n in names.items():
        (root / name).mkdir(parents=True)
        for i in range(n):
            Image.new("RGB", (40 + i, 30), (i * 20, 100, 50)).save(root / name / f"{i}.v1.jpg")
    Image.new("L", (20, 20), 7).save(root / "dog" / "0.v1.png")  # same stem, other suffix
    out = tmp_path / "shards" / "pets-%04d.tar"
    _run_example(
        [
            str(ROOT / "examples" / "imagefolder_to_shards.py"),
            str(root),
            "-o",
            str(out),
            "-n",
            "5",
            "--resize",
            "16",
        ],
        tmp_path,
    )
    shards = sorted((tmp_path / "shards").glob("pets-*.tar"))
    assert len(shards) == 3  # 13 images, 5 per shard
    samples = list(WebDataset([str(p) for p in shards]).decode("pil"))
    assert len(samples) == 13
    assert len({s["__key__"] for s in samples}) == 13
    listing = json.loads((tmp_path / "shards" / "classes.json").read_text())
    assert listing["classes"] == ["cat", "dog", "emu"]
    for s in samples:
        image = s.get("jpg") or s.get("png")
        assert min(image.size) == 16
        assert listing["classes"][s["cls"]] == s["json"]["class"] == s["__key__"].split("/")[0]
    counts = {c: sum(1 for s in samples if s["json"]["class"] == c) for c in names}
    assert counts == {"cat": 5, "dog": 5, "emu": 3}


def test_seed_notebook_example(tmp_path):
    _requires("torch")
    proc = _run_example(
        [
            str(ROOT / "examples" / "seed_notebook.py"),
            "--out",
            str(tmp_path / "seed"),
            "--workers",
            "2",
            "--per-shard",
            "16",
        ],
        tmp_path,
    )
    assert "torch.Size([16, 3, 224, 224]) torch.Size([16])" in proc.stdout
    assert "rescaled image sizes: {(256, 256)}" in proc.stdout


def test_demo_runs_every_step(tmp_path):
    """``make demo`` in miniature: every step works (accuracy needs the full run's epochs).

    The Dask steps are left out here (docs/processing.md runs the Dask engine); ``make demo``
    runs them.
    """
    _requires("torch", "sklearn")
    out = tmp_path / "demo"
    proc = _run_example(
        [
            str(ROOT / "examples" / "demo.py"),
            "--out",
            str(out),
            "--epochs",
            "1",
            "--min-accuracy",
            "0",
            "--skip-dask",
        ],
        tmp_path,
        timeout=300,
    )
    assert "DEMO OK" in proc.stdout
    assert (out / "contact_sheet.png").is_file()
    assert len(list((out / "processed-processes").glob("*.tar"))) == 5
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["history"]) == 1 and 0 <= summary["accuracy"] <= 1
