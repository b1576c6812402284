"""mpp.data.slots: batch buffers reused between workers and the main process, never while a batch
over them is alive."""
from __future__ import annotations

import gc
import multiprocessing
import pickle
import sys
import time

import pytest
import torch

from mpp.config import DataConfig
from mpp.data import make_loader
from mpp.data.slots import FILLING, FREE, HELD, BatchSlots
from mpp.data.loader import SLOTS_PER_WORKER
from mpp.prefetch import DevicePrefetcher
from shardutil import write_shards


def states(slots: BatchSlots) -> list[int]:
    return list(slots.state[:])


def test_slot_is_free_only_when_every_view_is_garbage():
    slots = BatchSlots(2, 2, (4, 3, 3, 3))
    a, b = slots.acquire(1), slots.acquire(1)
    assert (a[0], b[0]) == (2, 3) and slots.acquire(1) is None and states(slots) == [FREE, FREE, FILLING, FILLING]
    a[1][:2].fill_(7)
    batch = slots.receive(a[0], 2)
    assert batch.shape == (2, 3, 3, 3) and bool((batch == 7).all()) and states(slots)[2] == HELD
    view = batch.permute(0, 3, 1, 2)[1:]
    del batch, a
    gc.collect()
    assert states(slots)[2] == HELD  # a view keeps the slot
    del view
    assert states(slots)[2] == FREE
    slots.reclaim(1)  # a slot filled but never received (an abandoned epoch) is freed
    assert states(slots) == [FREE] * 4
    assert pickle.loads(pickle.dumps(slots)).acquire(0) is None  # a spawned worker: no slots


def test_held_batches_are_never_overwritten_and_slots_come_back(tmp_path):
    n = 2 * SLOTS_PER_WORKER  # 2 workers
    manifest, _ = write_shards(tmp_path, [2 * n] * 4)
    cfg = DataConfig(num_workers=2, eval_crop_pct=1.0)
    loader = make_loader(manifest, batch_size=4, img_size=16, train=True, labeled=True, data_cfg=cfg)
    slots = loader.stream.slots
    assert slots is not None and len(slots.state) == n < loader.batches_per_epoch
    held = list(loader.epoch(0))  # more batches held than there are slots: the rest travel as usual
    assert states(slots).count(HELD) == n
    loader.stream.slots = None  # the same epoch without slots: the same batches
    plain = list(loader.epoch(0))
    assert all(torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"])
               for a, b in zip(held, plain, strict=True))
    loader.stream.slots = slots
    del held
    gc.collect()
    assert HELD not in states(slots)  # free again (or already refilled by the workers' read-ahead)
    it = loader.epoch(1)
    for _ in range(4):  # past what the workers read ahead while every slot was held
        next(it)
    it.close()  # abandoned: the batches its workers fill now are never received
    deadline = time.monotonic() + 30
    while FILLING not in states(slots) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert FILLING in states(slots)
    again = list(loader.epoch(2))  # reclaimed as the workers start this epoch: all in use again
    assert states(slots).count(HELD) == n and len(again) == loader.batches_per_epoch


def test_the_trainers_look_ahead_fits_in_one_workers_slots(tmp_path):
    """Off CUDA the trainer's prefetcher hands the slot batches on as they are and holds several
    (the step's, the queued ones, the one being staged): with one worker every batch must still
    come in a slot, not through a fresh shared-memory segment."""
    manifest, _ = write_shards(tmp_path, [48] * 2)
    loader = make_loader(manifest, batch_size=4, img_size=16, train=True, labeled=True,
                         data_cfg=DataConfig(num_workers=1, eval_crop_pct=1.0))
    mem = loader.stream.slots.mem
    base = torch.frombuffer(mem, dtype=torch.uint8).data_ptr()
    batches = DevicePrefetcher((b for e in range(2) for b in loader.epoch(e)), "cpu")
    outside = 0
    for i, batch in enumerate(batches):
        time.sleep(0.02)  # a step: the thread and the workers read ahead as far as they may
        outside += not base <= batch["image"].data_ptr() < base + len(mem)
    batches.close()
    loader.close()
    assert i + 1 == 2 * loader.batches_per_epoch and outside == 0


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")
def test_workers_are_forked_whatever_the_default_start_method(tmp_path):
    """A tools/compare.py stage inherits the 'forkserver' start method (and Python 3.14 makes it
    Linux's default): the loader still forks its workers, which keep the slots' mapping (a worker
    started from a server would import torch again and send every batch the usual way)."""
    manifest, _ = write_shards(tmp_path, [8] * 2)
    before = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method("forkserver", force=True)
    try:
        loader = make_loader(manifest, batch_size=4, img_size=16, train=True, labeled=True,
                             data_cfg=DataConfig(num_workers=2, eval_crop_pct=1.0))
        held = list(loader.epoch(0))
        assert len(held) == 4 and states(loader.stream.slots).count(HELD) == 4
        loader.close()
    finally:
        multiprocessing.set_start_method(before, force=True)
