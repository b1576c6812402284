"""Input overlapped with compute: batches are fetched by a thread and reach the device ahead of use.

`DevicePrefetcher` reads the host batches on a background thread, `depth` batches ahead of the step,
so the main thread (which on a GPU spends its time queueing the step's kernels) never does the
loader's host work: receiving worker batches, re-chunking them, pinning. On CUDA the thread copies
each batch into pinned memory (which frees the loader's shared-memory slot at once) and sends it,
still uint8 (a quarter of float32's bytes; normalisation runs on the device, in the Task), with a
non-blocking copy on a side stream; the consumer's stream waits on that batch's copy only when it
uses the batch (an event, not a host sync). On the CPU batches pass through unchanged: the same
look-ahead, no copies; another accelerator (mps, xpu) gets a plain copy. The order of the batches is
the source's. `counted` is the loader's `counters` as they stood when the batch last handed out was
read, before the look-ahead: skip counts that a checkpoint records must not include a batch the
resumed run will read again. An error of the source is raised by the `next` that would have returned
its batch.
"""
from __future__ import annotations

import queue
import threading
import warnings
import weakref
from typing import Callable, Iterator

import torch

from mpp.profiling import phase

_END = object()  # the source is exhausted


def indexed(device: torch.device) -> torch.device:
    """A CUDA device with its index (`cuda` means the current one): the thread must set it, as
    the current device is per thread and `torch.cuda.set_device` takes no device without one."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class _Reader:
    """The thread's side: read, stage and queue batches until the source ends, fails or is
    stopped. It holds no reference to its DevicePrefetcher, so a prefetcher dropped unclosed is
    collected, and its finalizer stops the thread."""

    def __init__(self, batches: Iterator[dict], device: torch.device, counters: Callable[[], dict], depth: int):
        self.batches, self.device, self.counters = batches, device, counters
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ready: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()

    def _stage(self, batch: dict) -> tuple[dict, torch.cuda.Event | None]:
        if self.stream is None:  # the CPU's batches as they are; another accelerator's (mps, xpu) copied
            return (batch if self.device.type == "cpu" else {k: v.to(self.device) for k, v in batch.items()}), None
        with torch.cuda.stream(self.stream):
            batch = {k: v.pin_memory().to(self.device, non_blocking=True) for k, v in batch.items()}
            return batch, self.stream.record_event()

    def run(self) -> None:
        try:  # everything: a thread that ended without queueing its end would leave `next` waiting forever
            if self.stream is not None:
                torch.cuda.set_device(self.device)  # the current device is per thread
            while True:
                with phase("mpp/loader"):  # in a profile (mpp.profiling): the wait for the data workers
                    batch = next(self.batches, _END)
                if batch is _END:
                    break
                with phase("mpp/stage"):
                    item = (*self._stage(batch), self.counters())
                del batch  # host batches not held while the next is read: their loader slots free
                if not self._put(item):
                    return
                del item
            self._put((_END, None, None))
        except BaseException as e:  # handed to the consumer, which raises it
            self._put((e, None, None))

    def _put(self, item: tuple) -> bool:
        while not self.stop.is_set():
            try:
                self.ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False


class DevicePrefetcher:
    """Iterate `batches` (dicts of host tensors) as dicts of tensors on `device`, `depth` batches
    ahead, read by a background thread that starts with the first `next`; `close()` stops it (so
    does dropping the prefetcher)."""

    def __init__(self, batches: Iterator[dict], device: torch.device | str,
                 counters: Callable[[], dict] = dict, depth: int = 2):
        self.device = indexed(torch.device(device))
        self.reader = _Reader(batches, self.device, counters, depth)
        weakref.finalize(self, self.reader.stop.set)
        self.thread: threading.Thread | None = None
        self.done = False
        self.counted: dict = counters()

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __next__(self) -> dict:
        if self.done:
            raise StopIteration
        if self.thread is None:  # kept once started: `close` joins it (an interrupted start leaves none to join)
            thread = threading.Thread(target=self.reader.run, name="mpp-prefetch", daemon=True)
            thread.start()
            self.thread = thread
        batch, copied, counted = self.reader.ready.get()
        if batch is _END or isinstance(batch, BaseException):
            self.done = True
            if batch is _END:
                raise StopIteration
            raise batch
        if copied is not None:  # the step's stream waits for the copy; its memory is the step's
            current = torch.cuda.current_stream(self.device)
            current.wait_event(copied)
            for v in batch.values():
                v.record_stream(current)
        self.counted = counted
        return batch

    def close(self, timeout: float = 60.0) -> bool:
        """Stop the thread (it finishes the batch it is reading), so the source can be closed;
        False when it did not stop in time: it is still inside the source, which must then be
        left alone (closing a generator another thread runs raises); so does every close after it while
        the thread is still there."""
        self.reader.stop.set()
        self.done = True
        stopped = True
        if self.thread is not None:
            self.thread.join(timeout)  # a thread waiting to queue a batch sees the flag within 0.1 s
            stopped = not self.thread.is_alive()
            if not stopped:
                warnings.warn(f"the batch prefetch thread did not stop within {timeout:g} s (a data "
                              "worker that does not answer?); leaving the loader open under it")
        while True:  # the batches read ahead and never handed out: device memory, loader slots
            try:
                self.reader.ready.get_nowait()
            except queue.Empty:
                break
        return stopped
