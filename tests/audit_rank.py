"""One rank of a training job that keeps a data-order ledger, for tests/plan/test_ledger.py.

python audit_rank.py CONFIG.json RANK: joins a gloo group on 127.0.0.1, optionally loads the
loader state a previous world saved, runs its steps (each an all_reduce, as a gradient's would
be), saves the loader's state at step ``save_at`` (rank 0, as a trainer's checkpoint), and at
step ``stop`` dies without cleaning up (``os._exit``: the steps after the checkpoint are lost with
the process, as in a crash); it writes the keys each of its steps delivered.
"""

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from tarshards.torch.adapter import WebDataset, WebLoader

cfg = json.load(open(sys.argv[1]))
rank = int(sys.argv[2])
dist.init_process_group(
    "gloo",
    init_method=f"tcp://127.0.0.1:{cfg['port']}",
    rank=rank,
    world_size=cfg["world"],
    timeout=timedelta(seconds=60),
)
if cfg.get("pack"):  # packs of at most cfg["pack"] tokens (a "tokens" metadata column)
    ds = WebDataset(cfg["data"], shardshuffle=True, seed=5, readers=6, remainder="pad").pack(
        cfg["pack"], "tokens", window=4
    )
else:
    ds = (
        WebDataset(cfg["data"], shardshuffle=True, seed=5, readers=12, remainder="pad")
        .shuffle(4)
        .to_tuple("__key__", "__pad__")
        .batched(2)
    )
loader = WebLoader(ds, batch_size=None, num_workers=cfg["num_workers"], ledger=cfg["ledger"])
if cfg.get("load"):
    loader.load_state_dict(torch.load(cfg["load"], weights_only=True))
steps = []
out = cfg["out"].format(rank=rank)
for item in loader:
    if cfg.get("pack"):
        keys, pads = [s["__key__"] for s in item], [s["__pad__"] for s in item]
    else:
        keys, pads = item
    total = torch.tensor([1])
    dist.all_reduce(total)
    steps.append([list(keys), [bool(p) for p in pads]])
    with open(out, "w") as f:
        json.dump(steps, f)
    if len(steps) == cfg.get("save_at"):
        if rank == 0:
            torch.save(loader.state_dict(), cfg["save"])
        dist.barrier()
    if len(steps) == cfg.get("stop"):
        os._exit(0)  # killed: no state saved, nothing closed
dist.barrier()
dist.destroy_process_group()
