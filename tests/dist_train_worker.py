"""Run by tests/test_dist_faults.py under `torchrun --nproc_per_node N`: each gloo rank pre-trains
with the settings given (mpp.train.train, as tools/pretrain.py would) and writes to
OUTPUT_DIR/rank{r}.json the pixel hashes of the samples its loader gave, the steps it took, a
digest of its final weights (encoder and head) and its own skipped samples by kind (the counters
it hands to the run's final gather of them). With MPP_TEST_SLOW_BEGIN=S the main rank's
start-up work (Task.begin, which the other ranks wait for) takes S seconds longer; with
MPP_TEST_STALE_LISTING=1 the other ranks' listing of checkpoints misses the newest (as another
node's view of a network file system can for a while); with MPP_TEST_FULL_DISK=1 the main rank's
writes of the model's weights fail as on a full disk; with MPP_TEST_DATA_ERROR_AT=K rank 1's
loader raises a DataError in place of its K-th batch."""
import errno
import hashlib
import json
import os
import sys
import time

import torch

import mpp.checkpoint
import mpp.rundir
import mpp.train
from mpp.config import load_config
from mpp.data import DataError
from mpp.data.loader import ShardLoader
from mpp.runtime import leave_process_group


def main(*overrides: str) -> None:
    cfg = load_config(None, list(overrides))
    hashes, tasks = [], []
    epoch, build = ShardLoader.epoch, mpp.train.build_task

    def recorded(self, *args, **kwargs):
        for batch in epoch(self, *args, **kwargs):
            hashes.append([hashlib.sha1(img.permute(1, 2, 0).numpy().tobytes()).hexdigest() for img in batch["image"]])
            yield batch

    ShardLoader.epoch = recorded
    fail_at = int(os.environ.get("MPP_TEST_DATA_ERROR_AT", 0))
    if fail_at and os.environ.get("RANK") == "1":
        def failing(self, *args, **kwargs):
            for batch in recorded(self, *args, **kwargs):
                if len(hashes) == fail_at:
                    raise DataError("shard 000001.tar changed since it was listed")
                yield batch
        ShardLoader.epoch = failing
    mpp.train.build_task = lambda *a: tasks.append(build(*a)) or tasks[-1]
    skipped, gather_skips = [], mpp.train._skipped
    mpp.train._skipped = lambda run: skipped.append(dict(run.batches.counted)) or gather_skips(run)
    slow = float(os.environ.get("MPP_TEST_SLOW_BEGIN", 0))
    if slow:
        begin = mpp.train.Task.begin
        mpp.train.Task.begin = lambda self, *a: time.sleep(slow) or begin(self, *a)
    if os.environ.get("MPP_TEST_FULL_DISK") and os.environ.get("RANK") == "0":
        def full(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device", "model.safetensors")
        mpp.checkpoint.save_model = full
    if os.environ.get("MPP_TEST_STALE_LISTING") and os.environ.get("RANK") != "0":
        candidates = mpp.rundir.candidates
        mpp.rundir.candidates = lambda root: (lambda found, bad: (found[1:], bad))(*candidates(root))
    metrics = mpp.train.train(cfg)
    weights = hashlib.sha1(b"".join(p.detach().numpy().tobytes() for p in tasks[0].state_dict().values()))
    rank = torch.distributed.get_rank()
    with open(f"{cfg.output_dir}/rank{rank}.json", "w") as f:
        json.dump({"steps": metrics["steps"], "batches": hashes[:metrics["steps"]], "weights": weights.hexdigest(),
                   "skipped": skipped[-1]}, f)
    leave_process_group()  # as the tools do: a group alive at exit can abort a rank after its work


if __name__ == "__main__":
    main(*sys.argv[1:])
