"""mpp.prefetch: batches come out in order and unchanged, the next one taken as one is handed out."""
from __future__ import annotations

import torch

from mpp.prefetch import DevicePrefetcher


def test_prefetcher_reads_one_batch_ahead_and_keeps_order():
    pulled = []

    def source():
        for i in range(3):
            pulled.append(i)
            yield {"image": torch.full((2, 3, 4, 4), i, dtype=torch.uint8), "label": torch.tensor([i, i])}

    batches = DevicePrefetcher(source(), "cpu")
    assert pulled == []  # nothing read before the first batch is asked for
    first = next(batches)
    assert pulled == [0, 1] and first["image"].dtype == torch.uint8 and int(first["image"].max()) == 0
    rest = list(batches)
    assert [int(b["label"][0]) for b in rest] == [1, 2] and pulled == [0, 1, 2]
    assert next(batches, None) is None  # exhausted stays exhausted
