"""``import tarshards`` stays light: no torch, and the public names are all there."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run_python(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, check=True, text=True
    ).stdout


def test_import_does_not_import_torch():
    code = (
        "import sys, json, tarshards\n"
        "from tarshards import TarWriter, ShardWriter, iter_tar, shard_samples\n"
        "import tarshards.codecs.registry, tarshards.tario, tarshards.format.names\n"
        "import tarshards.write.writer\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'click', 'dask', 'msgpack', 's3fs', 'gcsfs'))))\n"
    )
    assert json.loads(run_python(code)) == []


def test_reading_and_writing_without_torch(tmp_path):
    """Write a shard, read and decode it (numpy images): still no torch in sys.modules."""
    code = f"""
import sys
from tarshards import TarWriter, shard_samples, decode_value
import numpy as np
with TarWriter({str(tmp_path / "a.tgz")!r}) as w:
    w.write({{"__key__": "k", "png": np.zeros((4, 5, 3), np.uint8), "cls": 1}})
(s,) = shard_samples({str(tmp_path / "a.tgz")!r})
assert decode_value(s["png"], "png", image_mode="rgb8").shape == (4, 5, 3)
assert decode_value(s["cls"], "cls") == 1
print("torch" in sys.modules)
"""
    assert run_python(code).strip() == "False"


def test_public_names():
    import tarshards

    assert tarshards.__all__ == sorted(tarshards.__all__)
    for name in tarshards.__all__:
        assert getattr(tarshards, name) is not None, name


def test_torch_modes_need_torch_only_when_used():
    pytest.importorskip("torch")
    code = (
        "import sys\nfrom tarshards.codecs.registry import field_decoder\n"
        "field_decoder('png', image_mode='rgb8')\nprint('torch' in sys.modules)\n"
        "field_decoder('png', image_mode='torchrgb')\nprint('torch' in sys.modules)\n"
    )
    assert run_python(code).split() == ["False", "True"]


# ---- without torch (torch blocked in a subprocess, so these run whether it is installed or not)

NO_TORCH = "import sys\nsys.modules['torch'] = None  # `import torch` now fails as if missing\n"


def test_star_import_without_torch():
    code = NO_TORCH + (
        "from tarshards import *\n"
        "print(WebDataset.__module__, WebDataset.__mro__[1].__module__, WebLoader.__name__)\n"
    )
    assert run_python(code).split() == [
        "tarshards.pipeline.dataset",
        "tarshards.pipeline.composition",
        "WebLoader",
    ]


def test_optional_torch_entries_say_what_to_install():
    code = (
        NO_TORCH
        + """
import pickle
from tarshards import MissingDependencyError, UnsafeCodecError, WebLoader, decode, encode_value
from tarshards.codecs.registry import field_decoder
from tarshards.pipeline.stages import default_collation_fn
def fails(f, *args, **kw):
    try:
        f(*args, **kw)
    except Exception as exn:
        return f"{type(exn).__name__}: {exn}"
print(fails(field_decoder, "png", image_mode="torchrgb"))
print(fails(lambda: next(decode([{"__key__": "a", "png": b""}], "torch"))))
print(fails(field_decoder("pth"), b""))
print(fails(field_decoder, "pth", allow_unsafe=True))
print(fails(encode_value, object(), "pth"))
print(fails(WebLoader, []))
print(default_collation_fn([(1, "a"), (2, "b")])[1])
"""
    )
    lines = run_python(code).splitlines()
    hint = "pip install 'tarshards[torch]'"
    assert lines[0].startswith("MissingDependencyError: the image mode 'torchrgb'")
    assert hint in lines[0]
    assert lines[1].startswith("MissingDependencyError: the image mode 'torch'")
    assert lines[2].startswith("UnsafeCodecError: refusing")  # refused before torch is needed
    assert lines[3].startswith("MissingDependencyError: the codec 'pth' needs the torch")
    assert hint in lines[3] and hint in lines[4]
    assert lines[5] == f"MissingDependencyError: WebLoader is a torch DataLoader: {hint}"
    assert lines[6] == "['a', 'b']"


def test_torch_entries_registered_on_first_use():
    pytest.importorskip("torch")
    code = """
import sys
import torch
from tarshards.codecs.registry import decode_value, encode_value
from tarshards.pipeline.stages import default_collation_fn
print("tarshards.torch" in sys.modules)
data = encode_value({"w": torch.arange(3)}, "pth")
print("tarshards.torch" in sys.modules)
print(decode_value(data, "pth", allow_unsafe=True)["w"].tolist())
batch = default_collation_fn([(torch.zeros(2), 1), (torch.ones(2), 2)])
print(type(batch[0]).__name__, tuple(batch[0].shape), batch[1].tolist())
"""
    assert run_python(code).splitlines() == ["False", "True", "[0, 1, 2]", "Tensor (2, 2) [1, 2]"]


# ---- the lazy package (PEP 562): `import tarshards` loads only what is used -----------------


def test_import_is_light():
    code = (
        "import sys, json, tarshards\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('tarshards', 'numpy', 'fsspec', 'PIL', 'xxhash'))))\n"
    )
    assert json.loads(run_python(code)) == ["tarshards", "tarshards._lazy", "tarshards.errors"]


def test_lazy_table_covers_the_public_names():
    import importlib
    from pathlib import Path

    import tarshards

    callable_modules = tarshards._CALLABLE_SUBMODULES
    assert set(tarshards._LAZY_MODULES) | tarshards._LAZY | callable_modules == set(
        tarshards.__all__
    )
    assert all(callable(getattr(tarshards, name)) for name in callable_modules)
    assert dir(tarshards) == tarshards.__all__
    for name, module in tarshards._LAZY_MODULES.items():
        assert getattr(importlib.import_module(f"tarshards.{module}"), name) is getattr(
            tarshards, name
        )
    here = Path(tarshards.__file__).parent
    found = {p.stem for p in here.glob("*.py") if not p.stem.startswith("_")}
    found |= {p.name for p in here.iterdir() if (p / "__init__.py").exists()}
    # every module and package but the two that import optional parts (torch, click) when
    # imported; the modules that moved into packages keep their old names as attributes
    assert {v.split(".")[0] for v in tarshards._SUBMODULES.values()} == found - {"torch", "cli"}
    for old, new in tarshards._SUBMODULES.items():
        assert getattr(tarshards, old) is importlib.import_module(f"tarshards.{new}")
    code = "import tarshards as t\nprint(t.stages.shuffle.__module__, t.hashing.MEMBER_HASH)\n"
    assert run_python(code).split() == ["tarshards.pipeline.stages", "xxh3_64"]
    with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
        tarshards.nonesuch  # noqa: B018


@pytest.mark.parametrize(
    "module, registry, name",
    [
        ("codecs.registry", "OPTIONAL_CODECS", "pth"),
        ("codecs.registry", "OPTIONAL_ARRAY_KINDS", "torch-uint8"),
        ("codecs.images", "OPTIONAL_ARRAY_KINDS", "torch-float"),
        ("pipeline.stages", "OPTIONAL_COLLATION", "torch.Tensor"),
        ("codecs.crop", "OPTIONAL_CROP_CONVERTERS", "tensor"),
    ],
)
def test_optional_entries_declared_whichever_module_comes_first(module, registry, name):
    # the package declares them before the registry's module exists; imported first, it has them
    code = (
        NO_TORCH
        + f"import tarshards.{module} as m\nprint({name!r} in m.{registry}, len(m.{registry}))\n"
    )
    found, count = run_python(code).split()
    assert found == "True" and int(count) >= 1
