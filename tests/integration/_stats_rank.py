"""One rank of a real gloo group for ``test_stats_dist.py``: reads its share of the shards
through ``WebLoader(stats=True)`` and writes ``loader.stats(gather=True)`` (every rank calls it)
as JSON. Run as ``python _stats_rank.py RANK WORLD_SIZE PORT OUT_DIR URL...``."""

from __future__ import annotations

import datetime
import json
import sys
import time


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    urls = sys.argv[5:]
    import torch.distributed as dist

    from tarshards.torch.adapter import WebDataset, WebLoader

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        ds = WebDataset(urls, equal=False).map(_slow if rank == 1 else _fast).to_tuple("__key__")
        loader = WebLoader(ds, batch_size=4, num_workers=1, stats=True)
        keys = [k for batch in loader for k in batch[0]]
        gathered = loader.stats(gather=True)
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump({"keys": keys, "stats": gathered.as_dict(), "text": gathered.prometheus()}, f)
    finally:
        dist.destroy_process_group()


def _fast(sample):
    return sample


def _slow(sample):  # rank 1's loop waits longer for its data
    time.sleep(0.01)
    return sample


if __name__ == "__main__":
    main()
