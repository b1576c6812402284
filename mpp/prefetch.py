"""Input overlapped with compute: batches reach the device one step ahead of their use.

`DevicePrefetcher` takes the next host batch as soon as the current one is handed out. On CUDA it
copies it into pinned memory (which frees the loader's shared-memory slot at once) and sends it,
still uint8 (a quarter of float32's bytes; normalisation runs on the device, in the Task), with a
non-blocking copy on a side stream, so the transfer overlaps the step the host has just queued.
The consumer's stream waits on that copy only when it uses the batch (an event, not a host
sync). Elsewhere batches pass through unchanged: the same look-ahead, no copies. `counted` is the
loader's `counters` as they stood when the batch last handed out was read, before the look-ahead:
skip counts that a checkpoint records must not include a batch the resumed run will read again.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch


class DevicePrefetcher:
    """Iterate `batches` (dicts of host tensors) as dicts of tensors on `device`, one batch ahead."""

    def __init__(self, batches: Iterator[dict], device: torch.device | str,
                 counters: Callable[[], dict] = dict):
        self.batches, self.device, self.counters = batches, torch.device(device), counters
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.ahead: dict | None = None
        self.counted: dict = counters()

    def _stage(self) -> dict | None:
        batch = next(self.batches, None)
        if batch is None or self.stream is None:
            return batch
        with torch.cuda.stream(self.stream):
            return {k: v.pin_memory().to(self.device, non_blocking=True) for k, v in batch.items()}

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __next__(self) -> dict:
        batch = self._stage() if self.ahead is None else self.ahead
        if batch is None:
            raise StopIteration
        if self.stream is not None:  # the step's stream waits for the copy; its memory is the step's
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.stream)
            for v in batch.values():
                v.record_stream(current)
        self.counted = self.counters()
        self.ahead = self._stage()
        return batch
