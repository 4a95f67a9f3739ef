"""One rank of a real gloo process group, for ``test_distributed.py``.

Run as ``python _dist_ranks.py RANK WORLD_SIZE PORT OUT_DIR URL...``, the way ``torchrun`` starts
ranks: a fresh interpreter per rank, ``init_process_group("gloo", init_method="tcp://...")``. The
rank is given to ``init_process_group`` only: ``RANK``/``WORLD_SIZE`` are *not* in the
environment, so the datasets must learn it from ``torch.distributed`` in this process. Each
rank writes what it read to ``OUT_DIR/rank{R}.json`` and one line per configuration done to
``OUT_DIR/rank{R}.log``; the test compares the ranks' results.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import warnings

WORKERS = (0, 1, 2, 3)
# None: the start method this process has by default (fork under Python < 3.14, as under torchrun)
CONTEXTS = (None, "spawn", "fork")
EPOCHS = 3


def configurations():
    """(style, num_workers, context) for every case the test checks."""
    for style in ("default", "nodesplitter"):
        for num_workers in WORKERS:
            for context in CONTEXTS if num_workers else (None,):
                yield style, num_workers, context


def name(style, num_workers, context) -> str:
    return f"{style}-w{num_workers}-{context or 'default'}"


def make_dataset(urls, style, seed=7):
    from tarshards import split_by_node
    from tarshards.torch.adapter import WebDataset

    if style == "nodesplitter":  # webdataset's style: the splitter is given the rank
        ds = WebDataset(urls, shardshuffle=True, seed=seed, nodesplitter=split_by_node)
    else:
        ds = WebDataset(urls, shardshuffle=True, seed=seed)
    return ds.shuffle(8).to_tuple("__key__")


def make_compat_pipeline(urls):
    """webdataset's composed style through tarshards.compat: the splitters are stages."""
    import tarshards.compat as wds

    return wds.DataPipeline(
        wds.SimpleShardList(urls),
        wds.split_by_node,
        wds.split_by_worker,
        wds.tarfile_to_samples(),
        wds.shuffle(8),
        wds.to_tuple("__key__"),
    )


COMPAT = [("compat-w2-spawn", 2, "spawn"), ("compat-w2-fork", 2, "fork")]


def keys(loader) -> list[str]:
    return [k for (k,) in loader]


def log(out_dir, rank, label):
    with open(os.path.join(out_dir, f"rank{rank}.log"), "a") as f:
        f.write(f"{time.monotonic():.1f} {label}\n")


def run_rank(rank, world_size, port, out_dir, urls):
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from tarshards.torch.adapter import WebLoader

    # datasets of the default style are built before the process group exists, as a script
    # that builds its data first would: the rank must be found when they are iterated
    early = {name(*c): make_dataset(urls, c[0]) for c in configurations() if c[0] == "default"}
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    results: dict = {"pid": os.getpid()}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch: more workers than cores
            for style, num_workers, context in configurations():
                label = name(style, num_workers, context)
                ds = early[label] if label in early else make_dataset(urls, style)
                kw = {"multiprocessing_context": context, "timeout": 120} if num_workers else {}
                loader = DataLoader(ds, batch_size=None, num_workers=num_workers, **kw)
                results[label] = keys(loader)
                log(out_dir, rank, label)
            for label, num_workers, context in COMPAT:
                loader = DataLoader(
                    make_compat_pipeline(urls),
                    batch_size=None,
                    num_workers=num_workers,
                    multiprocessing_context=context,
                    timeout=120,
                )
                results[label] = keys(loader)
                log(out_dir, rank, label)
            # WebLoader, three epochs per loader; the orders depend on seed, epoch, reader only
            for label, kw in [
                (
                    "persistent-spawn",
                    {"persistent_workers": True, "multiprocessing_context": "spawn"},
                ),
                (
                    "persistent-fork",
                    {"persistent_workers": True, "multiprocessing_context": "fork"},
                ),
                ("fresh-fork", {"multiprocessing_context": "fork"}),
            ]:
                loader = WebLoader(
                    make_dataset(urls, "default", seed=11),
                    batch_size=None,
                    num_workers=2,
                    timeout=120,
                    **kw,
                )
                results[label] = [keys(loader) for _ in range(EPOCHS)]
                log(out_dir, rank, label)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    run_rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:])
