"""The import graph holds the layer order of shared/DESIGN.md part 2: imports go one way, down.

Every module of ``src/tarshards`` is read (not imported) and its edges collected: ``import`` and
``from ... import`` statements anywhere in the file (function bodies included), and strings naming
a tarshards module passed to a call (``importlib.import_module("tarshards.torch")``,
``LazyModule("tarshards.x", ...)``), since an import at call time is an edge too. An edge from a
module to one in a higher layer fails, and so does a module the table below does not place.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "tarshards"

# Lowest first. A module may import modules of its own layer and of the layers below it.
# A name stands for the module and, with a package, everything in it ("cli" covers cli/*), unless
# a row names the package's module itself ("tario.reader": the layers inside a package).
LAYERS: list[tuple[str, ...]] = [
    (
        "errors",
        "types",
        "_lazy",
        "_speedups",
        "_jpeg",
        "_xxh3",
        "_deficits",
        "stats",
        "read",
        "write",
    ),  # the bottom: no tarshards imports but these (stats: a loader's counters, which the
    # reading path is handed; the packages read/ and write/, whose __init__ holds only its
    # docstring: each module of a package has its own row below, and a package whose name was
    # a module's before (format, codecs, plan, pipeline) sits with that module, whose names it
    # hands out on first use)
    (
        "format",
        "format.names",
        "on_error",
        "format.tenbin",
    ),  # naming rules, parse_size; the error policy
    ("format.compression", "format.hashing"),  # one table of compressions; content hashes
    ("codecs.images",),  # image codecs and modes, the JPEG fast paths
    ("codecs", "codecs.registry", "codecs.crop"),  # the codec registry; image crops
    ("media.probe", "media.output"),  # media properties and the PyAV backend; media outputs
    ("codecs.decoding",),  # the decode stage (and the fused decode + to_tuple)
    ("tario.headers",),  # tar header fields, checksums, pax records, names
    ("tario.buffer", "tario.writer"),  # byte sources and the reader's buffer; the member writer
    ("tario.sparse",),  # GNU sparse members
    ("tario.reader",),  # the streaming member reader
    ("tario",),  # the package: re-exports its modules' names
    ("storage",),  # opening URLs (at an offset), retries, atomic output, cache, prefetch, seeks
    ("read.specs",),  # shard specs (list files and globs read through storage)
    ("parallel.pool", "parallel.reports", "parallel.engines"),  # where shard jobs run
    (
        "write.writer",
        "format.manifest",
        "format.index",
        "format.selection",
    ),  # writing; the dataset's record and index;
    # views (a selection of a manifest's rows: a record of the data too)
    ("media.video", "media.audio", "media.access", "media.metadata"),  # clips, byte ranges
    ("media",),  # the package: its names, imported on first use
    (
        "plan.shards",
        "plan",
        "plan.epoch",
        "plan.cursor",
        "read.reading",
    ),  # shard lists, the epoch plan and its cursor; shard reading
    ("read.sidecar",),  # sidecar column groups and joins, read row by row beside their base
    ("pipeline.iteration",),  # the one iterator a pipeline hands out (both kinds, one protocol)
    (
        "pipeline.stages",
        "plan.planned",
        "pipeline.stateful",
    ),  # stages; the planned iteration; stages with a state
    ("pipeline.fusion",),  # the stage record and the one rewrite of a stage list (fusion)
    (
        "plan.packing",
        "pipeline.collation",
    ),  # packs and buckets (planned from metadata); their collations
    ("pipeline.composition",),  # DataPipeline: a source and stages, the fluent methods
    (
        "pipeline",
        "pipeline.dataset",
    ),  # WebDataset (and the names of the modules above, re-exported)
    (
        "plan.mixing",
        "read.indexed",
        "testing",
        "media.collate",
    ),  # mixtures, random access, the resume check
    ("plan.ledger",),  # the data-order ledger and its audit (replays plans)
    ("torch.transport",),  # batches from DataLoader workers through shared memory (numpy only)
    # adapters and engines (the torch package re-exports torch.adapter)
    ("torch", "torch.adapter", "parallel", "compat", "benchmark"),
    ("curate",),  # views, dedup, sidecar columns, joins, the key table, splits, dataset specs
    ("convert",),  # sources into shards (on the parallel engines), shards into Parquet
    ("web",),  # the data set browser (a web application over random access)
    ("cli",),  # the command line
    ("__init__",),  # the package itself, above everything
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}

# Upward edges that work under way removes, each with the reason it is still here. An entry whose
# edge is gone fails test_known_upward_edges_still_exist: delete it then.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}

_MODULE_STRING = re.compile(r"tarshards(\.[A-Za-z_][A-Za-z0-9_]*)+")


def _module_name(path: Path) -> str:
    """``tarshards.x.y`` for ``src/tarshards/x/y.py`` (a package's ``__init__`` is its name)."""
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _resolve(module: str, level: int, current: str, package: bool) -> str:
    if level == 0:
        return module
    base = current.split(".")
    if not package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([module] if module else []))


def _edges(path: Path) -> list[tuple[str, int, str]]:
    """``(target module, line, how)`` for each tarshards module ``path`` imports."""
    current = _module_name(path)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, "import") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", node.level, current, _is_package(path))
            for a in node.names:  # `from . import stages` names a module; keep the longest
                sub = f"{base}.{a.name}"
                target = sub if _exists(sub) else base
                out.append((target, node.lineno, "from-import"))
        elif isinstance(node, ast.Call):
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    text = arg.value
                    if text.startswith(".") and _call_name(node) == "import_module":
                        text = _resolve(
                            text.lstrip("."),
                            len(text) - len(text.lstrip(".")),
                            current,
                            _is_package(path),
                        )
                    if _MODULE_STRING.fullmatch(text):
                        out.append((text, node.lineno, f"string in {_call_name(node)}()"))
    edges = [(t, line, how) for t, line, how in out if t.split(".")[0] == "tarshards"]
    return list(dict.fromkeys(edges))  # `from x import a, b` is one edge


def _call_name(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "?")


def _exists(module: str) -> bool:
    rel = Path(*module.split(".")[1:])
    return (
        (SRC / rel).with_suffix(".py").exists()
        or (SRC / rel / "__init__.py").exists()
        or module in ("tarshards._speedups", "tarshards._jpeg", "tarshards._xxh3")
        or module == "tarshards._deficits"
    )


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts == ["tarshards"]:
        return LAYER_OF["__init__"]
    return LAYER_OF.get(".".join(parts[1:3]), LAYER_OF.get(parts[1]))


def _modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_every_module_has_a_layer():
    unplaced = [_module_name(p) for p in _modules() if _layer(_module_name(p)) is None]
    assert not unplaced, (
        f"modules without a layer: {', '.join(unplaced)}. Add each to LAYERS in "
        f"tests/test_imports.py, in the layer of shared/DESIGN.md part 2 it belongs to (a "
        f"module may import only its own layer and those below)"
    )


def test_imports_go_down_the_layers():
    upward = []
    for path in _modules():
        src = _module_name(path)
        src_layer = _layer(src)
        if src_layer is None:
            continue  # reported by test_every_module_has_a_layer
        for target, line, how in _edges(path):
            target_layer = _layer(target)
            if target_layer is None:
                upward.append(
                    f"{path.relative_to(SRC.parent)}:{line}: {src} -> {target} ({how}): "
                    f"{target} has no layer; add it to LAYERS in tests/test_imports.py"
                )
            elif target_layer > src_layer and (src, target) not in KNOWN_UPWARD:
                upward.append(
                    f"{path.relative_to(SRC.parent)}:{line}: {src} (layer "
                    f"{src_layer}) -> {target} (layer {target_layer}) ({how})"
                )
    assert not upward, "imports that go up the layers of DESIGN.md:\n" + "\n".join(upward)


def test_known_upward_edges_still_exist():
    edges = {(_module_name(p), t) for p in _modules() for t, _, _ in _edges(p)}
    gone = [f"{a} -> {b}" for a, b in KNOWN_UPWARD if (a, b) not in edges]
    assert not gone, f"remove from KNOWN_UPWARD in tests/test_imports.py: {', '.join(gone)}"


def test_the_old_import_paths_are_gone():
    """``tarshards.urls``, ``tarshards.cache`` and ``tarshards.seek`` (import paths of the
    unreleased 0.1.0) are gone: their names live in ``tarshards.storage`` and
    ``tarshards.read.specs``."""
    import importlib

    for old in ("tarshards.urls", "tarshards.cache", "tarshards.seek"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)


# the modules that stay at the top of the package: everything else lives in a package by concern
TOP_LEVEL = {"__init__", "_lazy", "errors", "types", "on_error", "stats", "testing", "benchmark"}
EXTENSIONS = {"_speedups", "_jpeg", "_xxh3", "_deficits"}  # the C extensions (sources in _c/)


def test_a_tree_by_concern():
    """At most 12 modules at the top of ``src/tarshards`` (the C extensions counted), the rest in
    packages; the modules that moved into packages are importable only from there (their old
    names stay attributes of the package: ``tarshards.stages`` is ``tarshards.pipeline.stages``)."""
    import importlib

    import tarshards

    python = {p.stem for p in SRC.glob("*.py")}
    assert python == TOP_LEVEL
    built = {p.name.split(".")[0] for p in SRC.glob("*.so")} | {
        p.name.split(".")[0] for p in SRC.glob("*.pyd")
    }
    assert built <= EXTENSIONS
    assert len(python | EXTENSIONS) <= 12
    for old, new in [("stages", "pipeline.stages"), ("writer", "write.writer"), ("plan", "plan")]:
        assert getattr(tarshards, old) is importlib.import_module(f"tarshards.{new}")
    for old in ("tarshards.stages", "tarshards.writer", "tarshards.manifest", "tarshards.source"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)


# ---- the checker itself: it sees the kinds of edges it claims to see --------------------------


def _check(tmp_path, name: str, code: str) -> list[tuple[str, int, str]]:
    global SRC
    pkg = tmp_path / "tarshards"
    (pkg / "cli").mkdir(parents=True, exist_ok=True)
    for f in ("__init__.py", "torch.py", "stages.py", "cli/__init__.py"):
        (pkg / f).touch()
    (pkg / name).write_text(code)
    old, SRC = SRC, pkg
    try:
        return [(t, how.split()[0]) for t, _, how in _edges(pkg / name)]
    finally:
        SRC = old


@pytest.mark.parametrize(
    "code, target",
    [
        ("import tarshards.torch", "tarshards.torch"),
        ("from .torch import stack", "tarshards.torch"),
        ("from . import torch as t", "tarshards.torch"),
        ("def f():\n    from .torch import stack\n", "tarshards.torch"),
        ("import importlib\nimportlib.import_module('tarshards.torch')", "tarshards.torch"),
        (
            "from importlib import import_module\nimport_module('.torch', 'tarshards')",
            "tarshards.torch",
        ),
        ("LazyModule('tarshards.torch', globals(), 't')", "tarshards.torch"),
    ],
)
def test_checker_sees_static_and_string_edges(tmp_path, code, target):
    edges = _check(tmp_path, "codecs.py", code)
    assert [t for t, _ in edges] == [target]
    assert _layer(target) > _layer("tarshards.codecs")


def test_checker_resolves_relative_imports_in_packages(tmp_path):
    assert _check(tmp_path, "cli/x.py", "from ..stages import map\nfrom . import y") == [
        ("tarshards.stages", "from-import"),
        ("tarshards.cli", "from-import"),
    ]


# Cycles between modules (allowed within a layer by the order above, but a cycle means two
# modules that cannot be understood apart). Known ones, each with the work that removes it
# (the CLI's main <-> proc/sort were removed by the one-module-per-command split):
KNOWN_CYCLES: dict[frozenset, str] = {}


def _graph() -> dict[str, set[str]]:
    """Module -> the modules it imports (the known upward edges left out: they are reported,
    with their reason, by KNOWN_UPWARD)."""
    graph: dict[str, set[str]] = {}
    for path in _modules():
        src = _module_name(path)
        graph.setdefault(src, set()).update(
            t for t, _, _ in _edges(path) if t != src and (src, t) not in KNOWN_UPWARD
        )
    return graph


def _cycles(graph: dict[str, set[str]]) -> set[frozenset]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset] = set()

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.add(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    cycles = _cycles(_graph())
    known = set(KNOWN_CYCLES)
    # a component of several modules is fine only when known pairs make up all of it
    unexpected = [c for c in cycles if c != frozenset().union(*(p for p in known if p <= c))]
    assert not unexpected, "import cycles: " + "; ".join(
        " <-> ".join(sorted(c)) for c in unexpected
    )
    stale = [" <-> ".join(sorted(p)) for p in known if not any(p <= c for c in cycles)]
    assert not stale, f"remove from KNOWN_CYCLES in tests/test_imports.py: {', '.join(stale)}"


def test_cycle_finder():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {frozenset("abc")}
    assert _cycles({"a": {"b"}, "b": set()}) == set()


# ---- private attributes across modules (back channels) ----------------------------------------
#
# No module touches another module's private (``_x``) names: an import edge says which modules
# talk, but ``ds._run_stages()`` or ``loader.dataset._auto_epoch = n`` on an object made elsewhere
# is a channel the layer table cannot see. Read from the AST (no types), a use is:
#   * ``from .m import _x`` / ``m._x`` with ``m`` another module (modules of one subpackage, such
#     as tario/*, share their private names: the package is the unit there), and
#   * ``obj._x`` (read, call or write) where ``obj`` is not ``self``, ``cls`` or ``super()`` and
#     ``_x`` is a name another tarshards module defines (a def, a class, a module-level or
#     class-level name, a ``self._x =``, a ``__slots__`` entry): an attribute of one of its
#     objects. Dunders are not private; names no tarshards module defines (``sys._getframe``,
#     ``namedtuple._replace``) are not ours to police here.
# Today's uses are listed below, each with its reason: the list may only shrink (a new use fails
# test_no_new_private_access; one that is gone fails test_private_access_list_is_current: delete
# its line then).

_SAME_CLASS = "an object of this module's own class (a copy being built): allowed"
_THIRD_PARTY = "a third-party object's private attribute (PIL, s3fs), not a tarshards name"

# (module less "tarshards.", private name): why it is still here
PRIVATE_ACCESS: dict[tuple[str, str], str] = {
    ("compat.pipeline", "_stages"): _SAME_CLASS,
    ("pipeline.composition", "_append"): _SAME_CLASS,
    ("pipeline.composition", "_stages"): _SAME_CLASS,
    ("codecs.images", "_mode"): _THIRD_PARTY,
    ("codecs.images", "_size"): _THIRD_PARTY,
    ("storage.s3", "_call_s3"): _THIRD_PARTY,
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


_NATIVE = {"_speedups", "_jpeg", "_xxh3", "_lazy"}  # modules, not private names


def _defined_private(tree: ast.AST) -> set[str]:
    """The private names a module defines (see above)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.isidentifier():  # __slots__ and getattr(self, "_x") strings
                names.add(node.value)
        elif isinstance(node, ast.alias) and node.asname:
            names.add(node.asname)
    return {n for n in names if _private(n)}


def _subpackage(module: str) -> str | None:
    """``tarshards.tario`` for ``tarshards.tario.reader``; None for a top-level module."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else None


def _private_uses(
    trees: dict[str, tuple[ast.AST, bool]],
) -> list[tuple[str, str, int, str]]:
    """``(module, private name, line, how)`` for each use across modules in ``trees`` (module
    name -> (its AST, whether it is a package's ``__init__``))."""
    defined = {m: _defined_private(t) for m, (t, _) in trees.items()}
    owners: dict[str, set[str]] = {}
    for m, names in defined.items():
        for n in names:
            owners.setdefault(n, set()).add(m)
    out = []
    for m, (tree, package) in trees.items():
        modules = {}  # local name -> tarshards module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _resolve(node.module or "", node.level, m, package)
                if base.split(".")[0] != "tarshards":
                    continue
                for a in node.names:
                    if f"{base}.{a.name}" in trees:
                        modules[a.asname or a.name] = f"{base}.{a.name}"
                    elif _private(a.name) and a.name not in _NATIVE:
                        same = _subpackage(base) is not None and _subpackage(base) in (
                            _subpackage(m),
                            m,
                        )
                        if base != m and not same:
                            out.append((m, a.name, node.lineno, f"from {base} import"))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in trees and a.asname:
                        modules[a.asname] = a.name
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            v = node.value
            if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                continue
            if isinstance(v, ast.Call) and getattr(v.func, "id", None) == "super":
                continue
            if isinstance(v, ast.Name) and v.id in modules:
                target = modules[v.id]
                same = _subpackage(target) is not None and _subpackage(target) == _subpackage(m)
                if target != m and not same and node.attr not in _NATIVE:
                    out.append((m, node.attr, node.lineno, f"{v.id}.{node.attr}"))
                continue
            if owners.get(node.attr, set()) - {m}:
                out.append((m, node.attr, node.lineno, ast.unparse(node)[:60]))
    return out


def _trees() -> dict[str, tuple[ast.AST, bool]]:
    return {
        _module_name(p): (ast.parse(p.read_text(encoding="utf-8")), _is_package(p))
        for p in _modules()
    }


def test_no_new_private_access():
    new = sorted(
        f"{m}:{line}: {how} ({name})"
        for m, name, line, how in _private_uses(_trees())
        if (m.removeprefix("tarshards."), name) not in PRIVATE_ACCESS
    )
    assert not new, (
        "modules touching another module's private names (add a public method, or pass a "
        "value; see the comment above PRIVATE_ACCESS in tests/test_imports.py):\n" + "\n".join(new)
    )


def test_private_access_list_is_current():
    uses = {(m.removeprefix("tarshards."), name) for m, name, _, _ in _private_uses(_trees())}
    gone = sorted(f"{m} {name}" for m, name in PRIVATE_ACCESS if (m, name) not in uses)
    assert not gone, "gone: delete from PRIVATE_ACCESS in tests/test_imports.py:\n" + "\n".join(
        gone
    )


def test_private_access_checker():
    code = {
        "tarshards.composition": (
            "class P:\n"
            "    def __init__(self):\n"
            "        self._auto_epoch = 0\n"
            "    def _run_stages(self):\n"
            "        return self._auto_epoch\n"
            "    def copy(self):\n"
            "        new = P()\n"
            "        new._auto_epoch = self._auto_epoch\n"
            "        return super()._x\n"
        ),
        "tarshards.tario.headers": "_octal = 1\n",
        "tarshards.tario.reader": "from .headers import _octal\n",
        "tarshards.planned": (
            "from . import composition as _c\n"
            "from .tario.headers import _octal\n"
            "import sys\n"
            "def f(ds):\n"
            "    ds._run_stages()\n"
            "    ds._auto_epoch = 2\n"
            "    sys._getframe()\n"
            "    return _c._helper\n"
        ),
    }
    trees = {m: (ast.parse(c), False) for m, c in code.items()}
    got = sorted((m, name, how) for m, name, _, how in _private_uses(trees))
    assert got == [
        ("tarshards.planned", "_auto_epoch", "ds._auto_epoch"),
        ("tarshards.planned", "_helper", "_c._helper"),
        ("tarshards.planned", "_octal", "from tarshards.tario.headers import"),
        ("tarshards.planned", "_run_stages", "ds._run_stages"),
    ]


def test_no_test_folder_is_named_after_an_importable_package():
    """A folder of tests/ (on sys.path in pytest's prepend mode) named like a package a test may
    import (torch) would be imported as an empty namespace package where the real one is not
    installed: the lean install's tests would then see a "torch" without torch.distributed."""
    tests = Path(__file__).resolve().parent
    optional = {"torch", "dask", "ray", "av", "pyarrow", "datasets", "soundfile", "yaml", "PIL"}
    named = {p.name for p in tests.iterdir() if p.is_dir()} & optional
    assert not named, f"rename tests/{', tests/'.join(sorted(named))}"


def test_a_package_named_like_a_module_before_hands_out_its_names():
    """format, codecs, plan and pipeline were modules before the packages: their names stay
    attributes of the package (from tarshards.plan import EpochPlan), imported on first use,
    and importing one of their submodules imports nothing more."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import tarshards.codecs.images\n"
        "seen = ['tarshards.codecs.registry' in sys.modules]\n"
        "import tarshards.pipeline.stages\n"
        "print(seen + ['tarshards.pipeline.dataset' in sys.modules])\n"
        "from tarshards.pipeline import WebDataset\n"
        "from tarshards.plan import EpochPlan\n"
        "from tarshards.codecs import register_codec\n"
        "from tarshards.format import parse_size\n"
        "print(WebDataset.__module__, EpochPlan.__module__, register_codec.__module__, "
        "parse_size.__module__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert out[0] == "[False, False]"
    assert out[1].split() == [
        "tarshards.pipeline.dataset",
        "tarshards.plan.epoch",
        "tarshards.codecs.registry",
        "tarshards.format.names",
    ]
    import tarshards.plan

    with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
        tarshards.plan.nonesuch  # noqa: B018
