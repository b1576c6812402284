"""Batch buffers that DataLoader workers reuse: shared memory that stays mapped between batches.

PyTorch sends each batch from a worker in a fresh shared-memory segment that the worker writes page
by page and the main process unmaps and frees after use, so the kernel zeroes and maps every 4 KiB
page of every batch anew (a cost comparable to decoding; docs/benchmarks.md). Here the loader maps
`per_worker` batch-sized slots per worker once (an anonymous shared mapping that the forked workers
inherit); a worker stacks its batch into a free slot of its own and sends only the slot's number.
The main process hands out a tensor over the slot and marks the slot free again when that tensor and
every view of it are garbage (a finalizer on the numpy array under it): a consumer may keep batches
as long as it likes, the slot is not reused meanwhile. When all of a worker's slots are taken, or
the workers were not forked (the `spawn`/`forkserver` start methods pickle the data set, and the
mapping with it is dropped), batches travel the usual way.
"""
from __future__ import annotations

import math
import mmap
import weakref

import numpy as np
import torch

FREE, FILLING, HELD = 0, 1, 2  # a slot's state: free, being filled or sent by a worker, given out


class BatchSlots:
    """`workers` x `per_worker` uint8 buffers of `shape` (batch, H, W, 3) in shared memory."""

    def __init__(self, workers: int, per_worker: int, shape: tuple[int, ...]):
        self.per_worker, self.shape = per_worker, tuple(shape)
        self.nbytes = math.prod(self.shape)
        self.mem: mmap.mmap | None = mmap.mmap(-1, workers * per_worker * self.nbytes)  # MAP_SHARED
        self.state = mmap.mmap(-1, workers * per_worker)

    def __getstate__(self) -> dict:  # pickled for a spawned worker: no slots there
        return {**self.__dict__, "mem": None, "state": None}

    def acquire(self, worker: int) -> tuple[int, torch.Tensor] | None:
        """Worker side: a free slot of this worker, marked as being filled, and a tensor over it;
        None when there is none."""
        if self.mem is None:
            return None
        for i in range(worker * self.per_worker, (worker + 1) * self.per_worker):
            if self.state[i] == FREE:
                self.state[i] = FILLING
                return i, torch.frombuffer(self.mem, dtype=torch.uint8, count=self.nbytes,
                                           offset=i * self.nbytes).view(self.shape)
        return None

    def receive(self, slot: int, n: int) -> torch.Tensor:
        """Main side: the first n entries of a filled slot; the slot is free again once they are
        garbage."""
        self.state[slot] = HELD
        array = np.frombuffer(self.mem, np.uint8, count=self.nbytes, offset=slot * self.nbytes)
        weakref.finalize(array, self.state.__setitem__, slot, FREE).atexit = False
        return torch.from_numpy(array).view(self.shape)[:n]

    def reclaim(self, worker: int) -> None:
        """Worker side, as it starts an epoch: free its slots still marked as being filled. Their
        batches were never received: the DataLoader drops what an abandoned epoch left unread
        before a worker's next epoch reaches the main process."""
        if self.mem is None:
            return
        for i in range(worker * self.per_worker, (worker + 1) * self.per_worker):
            if self.state[i] == FILLING:
                self.state[i] = FREE
