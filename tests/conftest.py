"""Shared fixtures: small shards made on the fly."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tarshards import ShardWriter, TarWriter


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


class TokenPools:
    """Costs for a mixture's plan, ``stream(i, npass)`` as the plans ask for them: each source a
    fixed pool of long-tailed costs (``pareto(tail) * 40 + low``, at most 1500), every pass
    another order of the pool split into the readers' rows (as a plan's passes are: the same
    samples, another shuffle). ``low=0`` lets samples cost 0 (the first of each pool costs
    1-40: a source of 0 tokens only is refused, and ``"drop"`` of none under a budget too)."""

    def __init__(self, seed, V, lengths, tail=1.3, low=1):
        rng = np.random.default_rng(seed)
        self.V, self.lengths = V, lengths
        self.pools = [
            np.minimum(rng.pareto(tail, V * n) * 40 + low, 1500).astype(int).astype(np.float64)
            for n in lengths
        ]
        for pool in self.pools:
            pool[0] = min(max(pool[0], 1.0), 40.0)
        self.passes: dict = {}

    def __call__(self, i, npass):
        if (i, npass) not in self.passes:
            perm = np.random.default_rng([i, npass]).permutation(len(self.pools[i]))
            self.passes[(i, npass)] = self.pools[i][perm].reshape(self.V, self.lengths[i])
        return self.passes[(i, npass)]

    def cost(self, v, s, p):
        """The cost of position ``p`` (passes counted on) of source ``s`` for reader ``v``."""
        return float(self(s, p // self.lengths[s])[v, p % self.lengths[s]])

    def largest(self):
        return [float(p.max()) for p in self.pools]


def write_token_set(directory, prefix: str, n: int, draw, seed: int, per_shard: int = 60) -> str:
    """``n`` samples whose ``tok`` field is a token count drawn by ``draw(rng)``, in shards of
    ``per_shard`` with a manifest whose ``tokens`` column records it; returns the manifest."""
    rng = np.random.default_rng(seed)
    with ShardWriter(
        str(directory / f"{prefix}-%03d.tar"),
        maxcount=per_shard,
        manifest=str(directory / f"{prefix}.json"),
        meta={"tokens": lambda s: int(s["tok"])},
    ) as w:
        for i in range(n):
            w.write({"__key__": f"{prefix}{i:05d}", "tok": str(draw(rng)).encode()})
    return str(directory / f"{prefix}.json")


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


class ShardOpener:
    """``opener=`` for ``build_manifest``: opens a local shard, leaving a file in ``log_dir`` per
    open (which shards were read, by any process: threads, workers, cluster workers); with
    ``die=NAME``, the first read of shard NAME kills its process part way (after its bytes were
    read, before its index is saved), once (a marker file in ``log_dir`` says it happened)."""

    def __init__(self, log_dir, die=None):
        self.log_dir = str(log_dir)
        self.die = die
        os.makedirs(self.log_dir, exist_ok=True)

    @property
    def marker(self) -> str:
        return os.path.join(self.log_dir, "died")

    def __call__(self, url):
        import tempfile

        name = os.path.basename(url)
        os.close(tempfile.mkstemp(prefix=f"open.{name}.", dir=self.log_dir)[0])
        f = open(url, "rb")
        if name == self.die and not os.path.exists(self.marker):
            return _DiesOnSecondRead(f, self.marker)
        return f

    def opened(self) -> list:
        """The shard names opened so far, sorted (a name once per open)."""
        return sorted(
            n.split(".", 1)[1].rsplit(".", 1)[0]
            for n in os.listdir(self.log_dir)
            if n.startswith("open.")
        )

    def clear(self) -> None:
        for n in os.listdir(self.log_dir):
            if n.startswith("open."):
                os.remove(os.path.join(self.log_dir, n))


class _DiesOnSecondRead:
    def __init__(self, f, marker):
        self.f, self.marker, self.reads = f, marker, 0

    def _count(self):
        self.reads += 1
        if self.reads == 2:
            open(self.marker, "w").close()
            os._exit(9)

    def readinto(self, b):
        self._count()
        return self.f.readinto(b)

    def read(self, n=-1):
        self._count()
        return self.f.read(n)

    def close(self):
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: Path, cfg: dict, world: int, tmp: Path, tag: str) -> list:
    """Run ``python SCRIPT CFG RANK`` as ``world`` real processes (ranks of one gloo process
    group at ``cfg["port"]``, ``world`` given as ``cfg["world"]``), ``cfg`` written to
    ``tmp/TAG.json``; each rank writes its result to ``tmp/TAG-RANK.json`` (``cfg["out"]``).
    A rank that fails fails the test with its output."""
    cfg = dict(cfg, world=world, out=str(tmp / f"{tag}-{{rank}}.json"))
    path = tmp / f"{tag}.json"
    path.write_text(json.dumps(cfg))
    src = str(Path(__file__).resolve().parent.parent / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(path), str(r)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} of {world} failed:\n{out.decode()[-3000:]}"
    return [json.loads((tmp / f"{tag}-{r}.json").read_text()) for r in range(world)]
