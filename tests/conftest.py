"""Shared fixtures: small shards made on the fly."""

from __future__ import annotations

import io
import os
import json

import numpy as np
import pytest
from PIL import Image

from tarshards import TarWriter


def make_jpeg(seed: int, size=(32, 24)) -> bytes:
    rng = np.random.default_rng(seed)
    arr = (rng.random((size[1], size[0], 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def make_samples(n: int, start: int = 0, prefix: str = "sample"):
    """``n`` samples with jpg, cls and json fields (bytes), keys ``{prefix}{i:06d}``."""
    out = []
    for i in range(start, start + n):
        out.append(
            {
                "__key__": f"{prefix}{i:06d}",
                "jpg": make_jpeg(i),
                "cls": str(i % 10).encode(),
                "json": json.dumps({"i": i, "label": i % 10}).encode(),
            }
        )
    return out


def write_shards(
    directory,
    nshards: int,
    per_shard: int,
    pattern: str = "shard-{:04d}.tar",
    prefix: str = "sample",
):
    """Write ``nshards`` shards of ``per_shard`` samples; returns (paths, samples)."""
    paths, samples = [], []
    for s in range(nshards):
        path = directory / pattern.format(s)
        chunk = make_samples(per_shard, start=s * per_shard, prefix=prefix)
        with TarWriter(str(path)) as w:
            for sample in chunk:
                w.write(sample)
        paths.append(str(path))
        samples.extend(chunk)
    return paths, samples


@pytest.fixture
def shards(tmp_path):
    """4 shards x 25 samples (jpg, cls, json): returns (paths, samples)."""
    return write_shards(tmp_path, 4, 25)


def load_servers():
    """tests/integration/servers.py as a module (the real local servers: HTTP, proxies, moto)."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "integration", "servers.py")
    spec = importlib.util.spec_from_file_location("tarshards_test_servers", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def refused_in_forked_child(call) -> bool:
    """Whether ``call()``, made in a forked child (where a C object's thread does not exist),
    raises RuntimeError saying so rather than hanging or doing the parent's work."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        try:
            call()
            code = 1
        except RuntimeError as exc:
            code = 0 if "forked child" in str(exc) else 2
        except BaseException:
            code = 3
        os.write(w, bytes([code]))
        os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    return got == b"\x00"
