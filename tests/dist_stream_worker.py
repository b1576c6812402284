"""Run by tests/test_stream_dist.py under `torchrun --nproc_per_node 2`: each gloo rank streams
epochs 1 to 3 (rank/world size taken from torch.distributed) for training, all-reducing once per
batch (as DDP would, so unequal batch counts would hang), and one evaluation pass (each rank its
own share, no collective per batch), and writes to OUT/rank{r}.json per pass the pixel hashes it
saw, its batch count and the count its loader said."""
import hashlib
import json
import sys
from datetime import timedelta

import torch.distributed as dist

from mpp.config import DataConfig
from mpp.data import make_loader
import torch

EPOCHS = (1, 2, 3)  # the shard shuffle of each: any one of them may happen to agree across ranks


def main(manifest: str, out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    cfg = DataConfig(num_workers=2, crop_scale=(1.0, 1.0), hflip=0.0, eval_crop_pct=1.0, shuffle_buffer=5)
    result = {}
    for train in (True, False):
        loader = make_loader(manifest, batch_size=4, img_size=16, train=train, labeled=True, data_cfg=cfg, seed=1)
        for epoch in EPOCHS if train else (3,):
            hashes, n = [], 0
            for batch in loader.epoch(epoch):
                hashes += [hashlib.sha1(img.permute(1, 2, 0).numpy().tobytes()).hexdigest() for img in batch["image"]]
                if train:
                    dist.all_reduce(torch.ones(1))
                n += 1
            result[f"train{epoch}" if train else "eval"] = {"batches": n, "expected": loader.batches_per_epoch,
                                                            "hashes": hashes}
    with open(f"{out}/rank{dist.get_rank()}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
