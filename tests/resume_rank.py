"""One rank of a training job over a planned WebDataset, for tests/test_resume_dist.py.

python resume_rank.py CONFIG.json RANK: joins a gloo group on 127.0.0.1, optionally loads the
loader state saved by a previous world, runs ``stop`` steps (or to the epoch's end), each one an
all_reduce, saves the state (rank 0) and writes what it delivered.
"""

import json
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
    timeout=timedelta(seconds=cfg["timeout"]),
)
ds = (
    WebDataset(cfg["urls"], shardshuffle=True, seed=5, readers=cfg["readers"])
    .shuffle(4)
    .to_tuple("__key__", "__pad__")
    .batched(cfg["batch"])
)
loader = WebLoader(ds, batch_size=None, num_workers=cfg["num_workers"])
if cfg.get("load"):
    loader.load_state_dict(torch.load(cfg["load"], weights_only=True))
steps, keys, pads = 0, [], []
for batch_keys, batch_pads in loader:
    total = torch.tensor([1])
    dist.all_reduce(total)  # a rank that ran dry would leave the others waiting here
    assert total.item() == cfg["world"]
    keys.extend(batch_keys)
    pads.extend(bool(p) for p in batch_pads)
    steps += 1
    if steps == cfg.get("stop"):
        break
state = loader.state_dict()
if rank == 0 and cfg.get("save"):
    torch.save(state, cfg["save"])
dist.barrier()
json.dump(
    {"steps": steps, "keys": keys, "pads": pads, "len": len(loader)},
    open(cfg["out"].format(rank=rank), "w"),
)
dist.destroy_process_group()
