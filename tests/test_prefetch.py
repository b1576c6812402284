"""mpp.prefetch: a background thread reads batches ahead, in order and unchanged; source errors
reach the consumer; `close()` stops the thread."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from mpp.prefetch import DevicePrefetcher, indexed


def _source(n: int, pulled: list, fail_at: int = -1):
    for i in range(n):
        if i == fail_at:
            raise ValueError(f"bad shard at batch {i}")
        pulled.append(i)
        yield {"image": torch.full((2, 3, 4, 4), i, dtype=torch.uint8), "label": torch.tensor([i, i])}


def _settle(pulled: list, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(pulled) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # and no further


def test_prefetcher_reads_depth_batches_ahead_on_a_thread_and_keeps_order():
    pulled: list[int] = []
    batches = DevicePrefetcher(_source(6, pulled), "cpu", depth=2)
    time.sleep(0.1)
    assert pulled == []  # nothing read before the first batch is asked for
    first = next(batches)
    assert first["image"].dtype == torch.uint8 and int(first["image"].max()) == 0
    _settle(pulled, 4)
    # handed out 1, 2 queued, 1 read and waiting for room: the read-ahead is bounded
    assert pulled == [0, 1, 2, 3]
    rest = list(batches)
    assert [int(b["label"][0]) for b in rest] == [1, 2, 3, 4, 5] and pulled == list(range(6))
    assert next(batches, None) is None  # exhausted stays exhausted
    batches.close()


def test_batches_reach_another_accelerator_on_it():
    """Devices without CUDA streams (mps, xpu; here the meta device stands in) get each batch on
    the device, in order, not the host's tensors."""
    batches = DevicePrefetcher(_source(3, []), "meta")
    got = list(batches)
    assert len(got) == 3 and all(v.device.type == "meta" for b in got for v in b.values())
    assert got[0]["image"].shape == (2, 3, 4, 4) and got[0]["image"].dtype == torch.uint8


def test_counted_is_the_counters_when_the_handed_out_batch_was_read():
    pulled: list[int] = []
    batches = DevicePrefetcher(_source(4, pulled), "cpu", counters=lambda: {"read": len(pulled)})
    assert batches.counted == {"read": 0}
    for i in range(4):
        next(batches)
        _settle(pulled, min(4, i + 4))
        assert batches.counted == {"read": i + 1}  # not the read-ahead's
    batches.close()


def test_a_source_error_is_raised_where_its_batch_was_due_and_ends_the_stream():
    pulled: list[int] = []
    batches = DevicePrefetcher(_source(5, pulled, fail_at=2), "cpu")
    assert [int(next(batches)["label"][0]) for _ in range(2)] == [0, 1]
    with pytest.raises(ValueError, match="bad shard at batch 2"):
        next(batches)
    assert next(batches, None) is None
    batches.close()


def test_close_stops_a_thread_waiting_to_queue_and_reads_no_more():
    pulled: list[int] = []
    batches = DevicePrefetcher(_source(100, pulled), "cpu", depth=1)
    next(batches)
    _settle(pulled, 3)
    thread = batches.thread
    t = time.monotonic()
    batches.close()
    assert not thread.is_alive() and time.monotonic() - t < 2  # it sees the stop within 0.1 s
    assert thread.daemon  # a thread stuck in the loader would keep the interpreter from exiting
    read = len(pulled)
    time.sleep(0.2)
    assert len(pulled) == read < 100 and next(batches, None) is None
    assert not any(t.name == "mpp-prefetch" for t in threading.enumerate())


def test_a_cuda_device_without_an_index_is_the_current_one(monkeypatch):
    """The thread sets the device it copies to, and `torch.cuda.set_device` refuses a bare 'cuda'
    (Accelerate's device on a single GPU)."""
    from torch.cuda._utils import _get_device_index
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert indexed(torch.device("cuda")) == torch.device("cuda", 3)
    assert _get_device_index(indexed(torch.device("cuda"))) == 3
    assert indexed(torch.device("cuda", 1)) == torch.device("cuda", 1) and indexed(torch.device("cpu")).type == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batches_reach_the_gpu_in_order_and_unchanged():
    pulled: list[int] = []
    batches = DevicePrefetcher(_source(5, pulled), "cuda")
    got = [(b["image"].device.type, int(b["image"].float().mean()), b["label"].tolist()) for b in batches]
    assert got == [("cuda", i, [i, i]) for i in range(5)]
    batches.close()


def test_an_error_setting_the_threads_device_reaches_the_consumer(monkeypatch):
    """`torch.cuda.set_device` in the thread can fail (a bad ordinal, a lost device): the consumer
    must get the error, not wait forever for a batch that never comes."""
    batches = DevicePrefetcher(_source(3, []), "cpu")
    batches.reader.stream = object()  # as on CUDA, where the thread sets its device first

    def lost(device):
        raise RuntimeError("CUDA error: invalid device ordinal")
    monkeypatch.setattr(torch.cuda, "set_device", lost)
    got: list = []

    def consume():
        try:
            got.append(next(batches))
        except RuntimeError as e:
            got.append(e)
    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    consumer.join(5)
    assert not consumer.is_alive(), "next() still waits for a thread that has died"
    assert isinstance(got[0], RuntimeError) and "invalid device ordinal" in str(got[0])
    batches.close()


def test_close_lets_go_of_the_batches_read_ahead():
    """Batches queued but never handed out are freed at close(): on CUDA device memory the run's
    final evaluation would otherwise share with them, off CUDA the loader's shared-memory slots."""
    import gc
    made: list = []
    batches = DevicePrefetcher(_weakly_made(made), "cpu", depth=2)
    kept = next(batches)
    _settle(made, 4)
    batches.close()
    gc.collect()
    assert [r() is not None for r in made] == [True, False, False, False] and kept["image"][0] == 0


def test_a_prefetcher_dropped_unclosed_stops_its_thread_and_frees_its_source():
    """The thread holds the source, not the prefetcher: dropping the prefetcher stops the thread,
    which lets go of the source (a loader's epoch and, through it, its workers)."""
    import gc
    import weakref
    pulled: list[int] = []

    class Source:
        def __iter__(self):
            return self

        def __next__(self):
            pulled.append(len(pulled))
            return {"image": torch.zeros(2, 3, 4, 4, dtype=torch.uint8)}
    source = Source()
    gone = weakref.ref(source)
    batches = DevicePrefetcher(source, "cpu")
    del source
    next(batches)
    _settle(pulled, 4)
    thread = batches.thread
    del batches
    gc.collect()
    thread.join(5)
    assert not thread.is_alive() and gone() is None


def _weakly_made(made: list, gate: threading.Event | None = None, before: int = 2):
    """A source of 10 batches, a weak reference to each in `made`; with `gate`, its read of batch
    `before` waits for it (a worker that does not answer)."""
    import weakref

    def make(i: int) -> dict:  # no local of the generator holds the batch it yielded
        t = torch.full((2,), i)
        made.append(weakref.ref(t))
        return {"image": t}
    for i in range(10):
        if gate is not None and i == before:
            gate.wait(30)
        yield make(i)


def test_batches_handed_out_are_not_held_while_the_next_is_read():
    """The thread let go of a host batch only once it read the next: a loader slot held while the
    workers are slow, which a worker without a free slot waits on."""
    import gc
    gate, made = threading.Event(), []
    batches = DevicePrefetcher(_weakly_made(made, gate), "cpu", depth=2)
    assert [int(next(batches)["image"][0]) for _ in range(2)] == [0, 1]  # handed out, then dropped
    time.sleep(0.2)  # the thread waits in the source's read of batch 2
    gc.collect()
    try:
        assert [r() is None for r in made] == [True, True]
    finally:
        gate.set()
        batches.close()


def test_a_thread_that_did_not_stop_is_reported_by_every_close_until_it_does():
    """close() said False once, then True: a second close (a run's clean-up after an error) would
    then close the loader under the thread still reading it."""
    gate = threading.Event()
    batches = DevicePrefetcher(_weakly_made([], gate, before=0), "cpu")
    consumer = threading.Thread(target=lambda: next(batches, None), daemon=True)
    consumer.start()
    time.sleep(0.2)
    with pytest.warns(UserWarning, match="did not stop within 0.2 s"):
        assert batches.close(timeout=0.2) is False
    with pytest.warns(UserWarning, match="did not stop within 0.2 s"):
        assert batches.close(timeout=0.2) is False
    gate.set()  # the read returns: the thread sees the stop
    assert batches.close(timeout=5) is True


def test_an_interrupt_in_the_source_reaches_the_consumer():
    """Not only an Exception: a KeyboardInterrupt or SystemExit raised in the thread's read ended
    the thread with nothing queued, and next() waited forever."""
    def source():
        yield {"image": torch.zeros(2)}
        raise KeyboardInterrupt
    batches = DevicePrefetcher(source(), "cpu")
    got: list = []

    def consume():
        try:
            for _ in batches:
                got.append("batch")
        except BaseException as e:
            got.append(type(e).__name__)
    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    consumer.join(5)
    assert not consumer.is_alive() and got == ["batch", "KeyboardInterrupt"]
    batches.close()
