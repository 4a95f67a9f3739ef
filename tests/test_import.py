"""``import tarshards`` stays light: no torch, and the public names are all there."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run_python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, check=True,
                          text=True).stdout


def test_import_does_not_import_torch():
    code = ("import sys, json, tarshards\n"
            "from tarshards import TarWriter, ShardWriter, iter_tar, shard_samples\n"
            "import tarshards.codecs, tarshards.tario, tarshards.format, tarshards.writer\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'click', 'dask', 'msgpack', 's3fs', 'gcsfs'))))\n")
    assert json.loads(run_python(code)) == []


def test_reading_and_writing_without_torch(tmp_path):
    """Write a shard, read and decode it (numpy images): still no torch in sys.modules."""
    code = f"""
import sys
from tarshards import TarWriter, shard_samples, decode_value
import numpy as np
with TarWriter({str(tmp_path / 'a.tgz')!r}) as w:
    w.write({{"__key__": "k", "png": np.zeros((4, 5, 3), np.uint8), "cls": 1}})
(s,) = shard_samples({str(tmp_path / 'a.tgz')!r})
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
    code = ("import sys\nfrom tarshards.codecs import field_decoder\n"
            "field_decoder('png', image_mode='rgb8')\nprint('torch' in sys.modules)\n"
            "field_decoder('png', image_mode='torchrgb')\nprint('torch' in sys.modules)\n")
    assert run_python(code).split() == ["False", "True"]
