"""mpp.data streaming: round trip, rank/worker splitting, exact batch counts, determinism, resume,
resampled mode, subsets, input specs and transforms. Shards come from tests/shardutil.py."""
from __future__ import annotations

import functools
import http.server
import io
import json
import multiprocessing
import os
import shutil
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mpp.config import DataConfig
from mpp.data import DataError, make_loader, normalize, to_float01
from mpp.data.decode import open_image
from mpp.data.sources import ShardSet
from mpp.data.loader import first_batch
from mpp.data.stream import shuffle
from mpp.data.subset import select_subset
from mpp.data.transforms import TORCH_RESIZE_FROM, EvalTransform, TrainTransform, _load, resized_crop, stack
from shardutil import encode, write_shards

UNEVEN = [9, 3, 14, 6, 11, 5, 8]


def cfg(**kw) -> DataConfig:
    kw.setdefault("num_workers", 2)
    kw.setdefault("eval_crop_pct", 1.0)
    return DataConfig(**kw)


def lookup(source: dict) -> dict:
    """Pixel bytes (HWC) -> key, to identify samples in eval batches at native size."""
    return {px.tobytes(): key for key, (_, px) in source.items()}


def batch_keys(batch, table) -> list[str]:
    return [table[img.permute(1, 2, 0).numpy().tobytes()] for img in batch["image"]]


def test_round_trip_pixels_labels_counts(tmp_path):
    manifest, source = write_shards(tmp_path, UNEVEN)
    loader = make_loader(manifest, batch_size=8, img_size=16, train=False, labeled=True, data_cfg=cfg())
    assert loader.num_samples == sum(UNEVEN) and loader.classes == ["c0", "c1", "c2"]
    batches = list(loader.epoch(0))
    assert len(batches) == loader.batches_per_epoch == len(loader)
    table, seen = lookup(source), []
    for b in batches:
        assert b["image"].dtype == torch.uint8 and b["image"].shape[1:] == (3, 16, 16)
        assert b["image"].is_contiguous(memory_format=torch.channels_last)  # re-chunked ones too
        assert b["label"].dtype == torch.long and len(b["label"]) == len(b["image"]) <= 8
        keys = batch_keys(b, table)
        assert b["label"].tolist() == [source[k][0] for k in keys]
        seen += keys
    assert sorted(seen) == sorted(source)
    assert loader.counters() == {}


def test_jpeg_pixels_equal_pil_decode(tmp_path):
    rng = np.random.default_rng(1)
    px = rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)
    data = encode(px, "jpeg", quality=90)
    manifest, _ = write_shards(tmp_path, [2], extra=lambda s, j: {"jpg": data, "png": None})
    loader = make_loader(manifest, batch_size=2, img_size=24, train=False, labeled=False,
                         data_cfg=cfg(num_workers=0))
    (batch,) = loader.epoch(0)
    want = torch.from_numpy(np.array(Image.open(io.BytesIO(data)).convert("RGB"))).permute(2, 0, 1)
    assert "label" not in batch
    assert torch.equal(batch["image"][0], want) and torch.equal(batch["image"][1], want)


@pytest.mark.parametrize("train", [False, True])
def test_two_ranks_two_workers_disjoint_complete_equal(tmp_path, train):
    """Two ranks read disjoint samples, all of them; training's in the same number of batches on
    every rank (an all-reduce each step), an evaluation's in each rank's own (it waits for none)."""
    manifest, source = write_shards(tmp_path, UNEVEN)
    table = lookup(source)
    for epoch in (0, 1):
        seen, counts, planned = [], [], []
        for rank in range(2):
            loader = make_loader(manifest, batch_size=4, img_size=16, train=train, labeled=True,
                                 data_cfg=cfg(crop_scale=(1.0, 1.0), hflip=0.0), seed=3, rank=rank,
                                 world_size=2)
            try:
                batches = list(loader.epoch(epoch))
            finally:
                loader.close()
            counts.append(len(batches))
            planned.append(loader.batches_per_epoch)
            assert all(1 <= len(b["image"]) <= 4 for b in batches)
            seen += [k for b in batches for k in batch_keys(b, table)]
        assert counts == planned and (counts[0] == counts[1] or not train)
        assert sorted(seen) == sorted(source)  # disjoint across ranks and complete


def test_epoch_shuffle_deterministic_and_changes(tmp_path):
    manifest, _ = write_shards(tmp_path, [10] * 6)

    def run(epoch, seed=0):
        loader = make_loader(manifest, batch_size=6, img_size=8, train=True, labeled=True,
                             data_cfg=cfg(shuffle_buffer=8), seed=seed)
        return [b["image"] for b in loader.epoch(epoch)]

    a, b, c = run(1), run(1), run(2)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and len(a) == len(b) == 10
    assert not torch.equal(torch.cat(a), torch.cat(c))


def test_one_loader_streams_each_epoch_it_is_asked_for(tmp_path):
    """Persistent workers learn the epoch from their loader: one loader gives epochs 1, 2, 1 as
    fresh loaders do, also after an epoch abandoned midway; a new epoch ends an unfinished one."""
    manifest, _ = write_shards(tmp_path, [10] * 6)

    def loader():
        return make_loader(manifest, batch_size=6, img_size=8, train=True, labeled=True,
                           data_cfg=cfg(shuffle_buffer=8))

    one = loader()
    unfinished = one.epoch(1)
    next(unfinished)
    runs = [torch.cat([b["image"] for b in one.epoch(e)]) for e in (1, 2, 1)]
    assert list(unfinished) == []
    fresh = [torch.cat([b["image"] for b in loader().epoch(e)]) for e in (1, 2)]
    assert torch.equal(runs[0], fresh[0]) and torch.equal(runs[2], fresh[0]) and torch.equal(runs[1], fresh[1])
    assert not torch.equal(runs[0], runs[1])


def test_close_stops_the_persistent_workers_at_once(tmp_path):
    manifest, _ = write_shards(tmp_path, [10] * 4)
    loader = make_loader(manifest, batch_size=4, img_size=8, train=True, labeled=True, data_cfg=cfg())
    epoch0 = loader.epoch(0)
    first = [next(epoch0)["image"]]
    workers = {p.pid for p in multiprocessing.active_children()}
    first += [b["image"] for b in epoch0]
    unfinished = loader.epoch(1)
    next(unfinished)
    assert len(workers) == 2 and {p.pid for p in multiprocessing.active_children()} == workers  # not forked again
    start = time.perf_counter()
    loader.close()
    assert multiprocessing.active_children() == [] and time.perf_counter() - start < 2
    assert list(unfinished) == []
    assert all(torch.equal(a, b["image"]) for a, b in zip(first, loader.epoch(0), strict=True))  # new workers


def test_resume_start_batch_equals_uninterrupted(tmp_path):
    manifest, _ = write_shards(tmp_path, UNEVEN)
    loader = make_loader(manifest, batch_size=5, img_size=8, train=True, labeled=True,
                         data_cfg=cfg(shuffle_buffer=10), seed=7)
    full = list(loader.epoch(2))
    resumed = list(loader.epoch(2, start_batch=4))
    assert len(resumed) == loader.batches_per_epoch - 4
    for x, y in zip(full[4:], resumed):
        assert torch.equal(x["image"], y["image"]) and torch.equal(x["label"], y["label"])
    assert list(loader.epoch(2, start_batch=loader.batches_per_epoch)) == []


def test_resumed_epoch_does_not_count_the_replayed_skips_again(tmp_path):
    """A run that checkpoints after batch k and resumes with start_batch=k must end with the counts
    of an uninterrupted epoch: skips in the replayed batches were counted before the checkpoint."""
    bad = lambda s, j: {"png": b"not an image"} if j % 4 == 1 else {}  # noqa: E731
    manifest, _ = write_shards(tmp_path, UNEVEN, extra=bad)
    def loader():
        return make_loader(manifest, batch_size=5, img_size=8, train=True, labeled=True,
                           data_cfg=cfg(shuffle_buffer=10), seed=7)
    whole = loader()
    list(whole.epoch(0))
    first = loader()  # the run that was killed after its batch 4 (the counts its checkpoint saved)
    for i, _ in enumerate(first.epoch(0)):
        if i == 3:
            break
    second = loader()  # the resumed run: replays batches 0-3, then the rest of the epoch
    list(second.epoch(0, start_batch=4))
    total = whole.counters()["corrupt_image"]
    assert total == sum((n + 2) // 4 for n in UNEVEN)
    assert 0 < first.counters()["corrupt_image"] < total
    assert first.counters()["corrupt_image"] + second.counters().get("corrupt_image", 0) == total


def test_resampled_fixed_epoch_length(tmp_path):
    manifest, _ = write_shards(tmp_path, [5, 3])
    loader = make_loader(manifest, batch_size=4, img_size=8, train=True, labeled=True, seed=1,
                         data_cfg=cfg(resampled=True, epoch_samples=46, shuffle_buffer=4),
                         rank=1, world_size=2)
    assert loader.num_samples == 46 and loader.batches_per_epoch == 6  # 23 per rank
    sizes = [len(b["image"]) for b in loader.epoch(0)]
    assert sum(sizes) == 23 and len(sizes) == 6


def test_resampled_ranks_and_workers_draw_their_own_shards(tmp_path):
    """Resampled shards are drawn per rank and per worker: with one seed for all, every rank (and
    every worker of a rank) would train on the same samples in the same order."""
    import itertools
    manifest, _ = write_shards(tmp_path, [2] * 16)

    def drawn(rank: int, worker: int) -> list[str]:
        loader = make_loader(manifest, batch_size=4, img_size=8, train=True, labeled=True, seed=1, rank=rank,
                             world_size=2, data_cfg=cfg(resampled=True, epoch_samples=64, shuffle_buffer=0))
        return [s["__key__"] for s in itertools.islice(loader.stream._raw(0, worker, {}), 20)]
    first = drawn(0, 0)
    assert drawn(0, 0) == first and drawn(1, 0) != first and drawn(0, 1) != first


def test_shards_go_to_ranks_by_their_sample_counts():
    """Ranks and workers get shards by sample count (largest first, each to the emptiest bin), so
    their shares stay even: by the number of shards, one large shard and nine small ones would
    split 14 against 5."""
    from mpp.data.sources import assign
    counts = [10, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    bins = assign(counts, list(range(10)), 2)
    assert sorted(sum(counts[i] for i in b) for b in bins) == [9, 10] and sorted(sum(bins, [])) == list(range(10))


def test_the_shard_order_changes_with_the_epoch(tmp_path):
    """Each epoch shuffles the shards (and their split over ranks) anew, not only the samples in the
    shuffle buffer."""
    manifest, _ = write_shards(tmp_path, [4] * 8)
    loader = make_loader(manifest, batch_size=4, img_size=8, train=True, labeled=True, seed=0,
                         data_cfg=cfg(num_workers=1, shuffle_buffer=0))
    orders = [loader.stream.plan(e).bins[0] for e in (0, 1, 0)]
    assert orders[0] == orders[2] != orders[1] and sorted(orders[1]) == list(range(8))


def test_an_evaluation_reads_in_shard_order(tmp_path):
    """An evaluation is not shuffled, whatever data.shuffle_buffer says: it reads each shard in turn
    (no buffer held, the same order every time)."""
    manifest, source = write_shards(tmp_path, [5, 7, 4])
    loader = make_loader(manifest, batch_size=4, img_size=16, train=False, labeled=True,
                         data_cfg=cfg(num_workers=0, shuffle_buffer=64), seed=3)
    table = lookup(source)
    assert [k for b in loader.epoch(0) for k in batch_keys(b, table)] == list(source)


def test_subset_class_balanced_exact(tmp_path):
    manifest, source = write_shards(tmp_path, [15, 15, 15, 15], classes=3)  # 20 per class
    loader = make_loader(manifest, batch_size=4, img_size=16, train=False, labeled=True,
                         data_cfg=cfg(), subset=(0.1, 5))
    assert loader.num_samples == 6
    labels = torch.cat([b["label"] for b in loader.epoch(0)])
    assert Counter(labels.tolist()) == {0: 2, 1: 2, 2: 2}
    again = make_loader(manifest, batch_size=4, img_size=16, train=False, labeled=True,
                        data_cfg=cfg(), subset=(0.1, 5))
    table = lookup(source)
    assert ({k for b in loader.epoch(0) for k in batch_keys(b, table)}
            == {k for b in again.epoch(0) for k in batch_keys(b, table)})
    whole = make_loader(manifest, batch_size=4, img_size=16, train=False, labeled=True,
                        data_cfg=cfg(), subset=(1.0, 5))  # (fraction, seed) with all the labels
    assert whole.num_samples == 60
    with pytest.raises(DataError, match="class 0 has 1 sample.* would take them all"):  # 1 a class: none to train on
        make_loader(manifest, batch_size=1, img_size=16, train=True, labeled=True, data_cfg=cfg(),
                    subset=(0.05, 5, 0.1, False))


def test_a_pretraining_withholds_exactly_the_finetunes_development_splits(tmp_path):
    """data.withhold: an unlabeled (MPP) training stream reads every sample but the development
    splits that fine-tunes at 10% and 100% of the labels choose their recipes on, each epoch alike,
    with the batch count of what is left."""
    manifest, source = write_shards(tmp_path, [15, 15, 15, 15, 20], classes=2)  # 40 per class
    splits = [(0.5, 3, 0.25), (1.0, 3, 0.25)]
    dev = set()
    for fraction, seed, d in splits:
        part = make_loader(manifest, batch_size=1, img_size=16, train=False, labeled=True, data_cfg=cfg(),
                           subset=(fraction, seed, d, True))
        dev |= {k for b in part.epoch(0) for k in batch_keys(b, lookup(source))}
    assert 20 < len(dev) < 30  # 5 + 10 per class, overlapping by chance
    loader = make_loader(manifest, batch_size=4, img_size=16, train=True, labeled=False,
                         data_cfg=cfg(crop_scale=(1.0, 1.0), hflip=0.0), withhold=splits)
    assert loader.num_samples == 80 - len(dev) and len(loader) == (80 - len(dev)) // 4
    table = lookup(source)
    for epoch in (0, 1):
        seen = [k for b in loader.epoch(epoch) for k in batch_keys(b, table)]
        assert not set(seen) & dev and len(seen) == len(set(seen)) == 4 * len(loader)
    with pytest.raises(ValueError, match="not both"):
        make_loader(manifest, batch_size=4, img_size=16, train=True, labeled=True, data_cfg=cfg(),
                    subset=(0.5, 3), withhold=splits)


def test_a_subset_scan_that_cannot_read_a_shard_stops_in_one_line(tmp_path):
    """Shards without a label index are scanned for their labels on every rank: one that cannot be
    read is an error, not a subset drawn from what one rank happened to read."""
    manifest, _ = write_shards(tmp_path, [15, 15, 15], classes=3)
    shard = tmp_path / "000001.tar"
    shard.write_bytes(shard.read_bytes()[:15 * 1024])  # cut, though still as long as 15 samples can be
    with pytest.raises(DataError, match="the labels of shard .*000001.tar' could not be read .*make_shards"):
        make_loader(manifest, batch_size=4, img_size=16, train=False, labeled=True, data_cfg=cfg(), subset=(0.5, 0))


def test_a_key_twice_in_a_scanned_shard_is_refused_in_one_line(tmp_path):
    """A subset keeps samples by key: a shard (not from make_shards) that holds one key twice, with
    other labels, put both samples in the development split and in the training part alike."""
    manifest, _ = write_shards(tmp_path, [12, 12], classes=2,
                               extra=lambda s, j: {"__key__": "s1_0", "cls": b"1"} if (s, j) == (1, 11) else {})
    for dev in (True, False):
        with pytest.raises(DataError, match=r"shard '.*000001.tar' holds two samples of key 's1_0'.*unique keys"):
            make_loader(manifest, batch_size=4, img_size=16, train=True, labeled=True, data_cfg=cfg(),
                        subset=(1, 0, 0.5, dev))


def test_labeled_loader_on_unlabeled_shards_errors(tmp_path):
    manifest, _ = write_shards(tmp_path / "a", [4, 4], classes=None)
    with pytest.raises(DataError, match="unlabeled"):
        make_loader(manifest, batch_size=2, img_size=8, train=True, labeled=True, data_cfg=cfg())
    # a manifest with classes, one sample without cls: skipped and counted like a bad label
    one = write_shards(tmp_path / "one", [4, 4], extra=lambda s, j: {"cls": None} if (s, j) == (1, 2) else {})[0]
    loader = make_loader(one, batch_size=2, img_size=8, train=True, labeled=True, data_cfg=cfg())
    assert sum(len(b["label"]) for b in loader.epoch(0)) == 7 and loader.counters() == {"missing_label": 1}
    # no sample has cls: every one is skipped, which stops the epoch with one line
    manifest, _ = write_shards(tmp_path / "b", [4, 4], extra=lambda s, j: {"cls": None})
    loader = make_loader(manifest, batch_size=2, img_size=8, train=True, labeled=True, data_cfg=cfg())
    with pytest.raises(DataError, match=r"decoded no samples .*\{'missing_label': 8\}\); check the shards$"):
        list(loader.epoch(0))
    # every image larger than data.max_pixels: the message names the setting beside the shards
    loader = make_loader(manifest, batch_size=2, img_size=8, train=True, labeled=False, data_cfg=cfg(max_pixels=10))
    with pytest.raises(DataError, match=r"corrupt_image': 8.*check the shards, and data.max_pixels=10: a larger"):
        list(loader.epoch(0))
    # unlabeled loaders are fine with them
    loader = make_loader(manifest, batch_size=2, img_size=8, train=True, labeled=False, data_cfg=cfg())
    assert len(list(loader.epoch(0))) == 4


def test_too_few_shards(tmp_path):
    manifest, _ = write_shards(tmp_path, [8])
    with pytest.raises(DataError, match="need at least 4 shards"):
        make_loader(manifest, batch_size=2, img_size=8, train=True, labeled=True, data_cfg=cfg(),
                    rank=0, world_size=2)
    # fewer shards than ranks x workers: documented fallback to fewer workers
    manifest, _ = write_shards(tmp_path / "two", [8, 8])
    loader = make_loader(manifest, batch_size=2, img_size=8, train=True, labeled=True, data_cfg=cfg(),
                         rank=1, world_size=2)
    assert loader.num_workers == 1 and len(list(loader.epoch(0))) == 4
    # shards so uneven that one rank cannot fill the batch count the other needs
    manifest, _ = write_shards(tmp_path / "uneven", [14, 1])
    with pytest.raises(DataError, match="equal batch counts"):
        make_loader(manifest, batch_size=7, img_size=8, train=True, labeled=True, data_cfg=cfg(),
                    rank=0, world_size=2)


def test_an_evaluation_reads_each_ranks_share_whole_whatever_the_shards(tmp_path):
    """No step of an evaluation waits for another rank, so it is held to no equal batch count: over
    shards of 9 and 1 images, or fewer shards than ranks, each rank reads its own share (none
    without a shard) and together they score every image once (a fine-tune stopped at its final
    evaluation, after all its training, on such a test set under two processes); and a shard
    pattern whose count is an estimate has every image it holds scored (a rank held more than the
    estimate dropped the rest under several processes, so top-1 moved with the process count)."""
    def read(spec, ranks, **kw):
        seen = []
        for rank in range(ranks):
            loader = make_loader(spec, batch_size=4, img_size=8, train=False, labeled=True,
                                 data_cfg=DataConfig(num_workers=1), rank=rank, world_size=ranks, **kw)
            batches = list(loader.epoch(0))
            loader.close()
            assert len(batches) <= loader.batches_per_epoch or kw, (rank, batches)
            assert not loader.counters()
            seen.append(sorted(x for b in batches for x in b["label"].tolist()))
        return seen
    for counts, ranks in (([9, 1], 2), ([7], 2), ([6], 3), ([9, 5, 4], 2)):
        manifest, source = write_shards(tmp_path / f"{counts}_{ranks}", counts, classes=100)
        seen = read(manifest, ranks)
        assert sorted(x for s in seen for x in s) == sorted(lab for lab, _ in source.values()), (counts, ranks)
        assert [] in seen or len(counts) >= ranks
    _, source = write_shards(tmp_path / "pattern", [9, 5, 4], classes=100)
    seen = read(str(tmp_path / "pattern" / "{000000..000002}.tar"), 2, num_samples=18)
    assert sorted(x for s in seen for x in s) == sorted(lab for lab, _ in source.values()) and len(seen[0]) == 13
    # an estimate that gives a rank's shards no sample at all (1 over 2 shards): it reads them anyway
    _, source = write_shards(tmp_path / "low", [3, 3], classes=100)
    seen = read(str(tmp_path / "low" / "{000000..000001}.tar"), 2, num_samples=1)
    assert sorted(x for s in seen for x in s) == sorted(lab for lab, _ in source.values())


def test_specs_brace_list_urls_pipe(tmp_path):
    manifest, source = write_shards(tmp_path, [6, 6, 6])
    n = len(source)
    specs = [str(tmp_path / "{000000..000002}.tar"),
             [f"file:{tmp_path}/00000{i}.tar" for i in range(3)],
             [f"pipe:cat {tmp_path}/00000{i}.tar" for i in range(3)]]
    for spec in specs:
        loader = make_loader(spec, batch_size=4, img_size=16, train=False, labeled=True,
                             data_cfg=cfg(), num_samples=n)
        assert sum(len(b["image"]) for b in loader.epoch(0)) == n and loader.counters() == {}
    loader = make_loader(specs[0], batch_size=4, img_size=16, train=True, labeled=True, data_cfg=cfg(),
                         num_samples=n - 1)  # 17 over 3 shards: 6, 6 and 5 assumed, the remainder kept
    assert loader.num_samples == n - 1 and sum(len(b["image"]) for b in loader.epoch(0)) == n - 1
    with pytest.raises(DataError, match="sample count"):
        make_loader(specs[0], batch_size=4, img_size=16, train=False, labeled=True, data_cfg=cfg())
    with pytest.raises(DataError, match="does not exist"):
        make_loader(str(tmp_path / "nope.json"), batch_size=4, img_size=16, train=False, labeled=True,
                    data_cfg=cfg())
    loader = make_loader(str(tmp_path), batch_size=4, img_size=16, train=False, labeled=True,
                         data_cfg=cfg())  # a directory means its manifest.json
    assert loader.num_samples == n


def test_inexact_counts_still_exact_batch_count(tmp_path):
    """Without a manifest, counts are assumed even: a rank's surplus is dropped, a shortfall fills
    the last batches with repeats; both counted, the batch count stays exact."""
    write_shards(tmp_path, [10, 2])
    for claimed, dropped in ((8, 4), (12, 0), (20, 0)):
        loader = make_loader(str(tmp_path / "{000000..000001}.tar"), batch_size=3, img_size=8,
                             train=True, labeled=True, data_cfg=cfg(num_workers=0), num_samples=claimed)
        batches = list(loader.epoch(0))
        assert len(batches) == loader.batches_per_epoch == -(-claimed // 3)
        counts = loader.counters()
        assert sum(len(b["image"]) for b in batches) == 12 - dropped + counts.get("padded", 0)
        assert counts.get("dropped", 0) == dropped and (claimed <= 12) == ("padded" not in counts)


def batch_plan(n: int, k: int, batch_size: int) -> list[int]:
    """The k batch sizes `first_batch` gives one after another for n samples."""
    plan = []
    for i in range(k):
        plan.append(first_batch(n - sum(plan), k - i, batch_size))
    return plan


def test_batches_are_full_first_and_the_remainder_spread_over_the_last():
    assert batch_plan(10, 3, 4) == [4, 4, 2]
    assert batch_plan(12, 3, 4) == [4, 4, 4]
    assert batch_plan(10, 7, 4) == [4, 1, 1, 1, 1, 1, 1]
    assert batch_plan(22, 7, 4) == [4, 4, 4, 4, 4, 1, 1]
    assert batch_plan(11, 4, 4) == [4, 4, 2, 1]
    for b in range(1, 9):
        for k in range(1, 12):
            for n in range(k, k * b + 1):
                p = batch_plan(n, k, b)
                assert sum(p) == n and all(1 <= s <= b for s in p), (n, k, b, p)
                rest = [s for s in p if s < b]
                assert p == sorted(p, reverse=True) and (not rest or rest[0] - rest[-1] <= 1), (n, k, b, p)


def test_float_and_normalize():
    x = torch.tensor([0, 255, 51], dtype=torch.uint8).view(1, 3, 1, 1)
    f = to_float01(x)
    assert f.dtype == torch.float32 and torch.allclose(f.flatten(), torch.tensor([0.0, 1.0, 0.2]))
    n = normalize(f, (0.5, 0.5, 0.5), (0.5, 0.5, 0.25))
    assert torch.allclose(n.flatten(), torch.tensor([-1.0, 1.0, -1.2]))


def test_transforms_shapes_and_reduced_scale_jpeg_decode():
    import random
    y, x = np.mgrid[0:600, 0:800]
    smooth = np.stack([x * 255 // 800, y * 255 // 600, (x + y) * 255 // 1400], -1).astype(np.uint8)
    data = encode(smooth, "jpeg", quality=95)
    scales = []
    for transform in (EvalTransform(64, 0.875), TrainTransform(64, (0.08, 1.0), hflip=0.5)):
        for seed in range(3):
            jpeg = open_image(data, 10**8)  # libjpeg-turbo, at 1/r scale when the crop has r x 64 px
            box, _ = transform.params(jpeg, random.Random(seed))
            r = max(r for r in (1, 2, 4, 8) if r == 1 or min(box[2], box[3]) >= r * 64)
            decoded, scaled_box = _load(jpeg, box, 64)
            assert decoded.shape == (3, -(-600 // r), -(-800 // r)) and min(scaled_box[2:]) >= 63
            scales.append(r)
            fast = transform.batch([jpeg], random.Random(seed))[0]
            exact = transform.batch([Image.open(io.BytesIO(data))], random.Random(seed))[0]  # PIL: full scale
            assert fast.shape == (3, 64, 64) and fast.dtype == torch.uint8
            assert (fast.float() - exact.float()).abs().mean() < 1.0  # same geometry
    assert max(scales) == 8 and min(scales) < 8
    # a flip-only train transform at full scale mirrors the image
    img = Image.open(io.BytesIO(encode(smooth[:256, :256], "png")))
    t = TrainTransform(256, (1.0, 1.0), hflip=1.0).batch([img], random.Random(0))[0]
    assert torch.equal(t, torch.from_numpy(np.ascontiguousarray(smooth[:256, :256, :][:, ::-1])).permute(2, 0, 1))


@pytest.mark.parametrize("size", [32, TORCH_RESIZE_FROM, 224])
def test_resized_crop_matches_pil(size):
    """Both resize engines (PIL for PIL images below TORCH_RESIZE_FROM, torch from it and for
    decoded tensors) give PIL's antialiased bilinear crop + resize, up- and downscaling, within +-1
    (torch's uint8 kernel rounds like PIL's) except on the 2-pixel rim of a crop (PIL's filter also
    reads pixels just outside the box), and `stack` makes a channels-last batch of them."""
    rng = np.random.default_rng(0)
    smooth = np.asarray(Image.fromarray(rng.integers(0, 256, (40, 50, 3), np.uint8)).resize((300, 260), Image.BICUBIC))
    img = Image.fromarray(np.ascontiguousarray(smooth))
    outs = []
    for box in [(10, 20, 150, 120), (0, 0, 300, 260), (5, 7, size // 2, size // 3), (3, 4, size, size)]:
        left, top, w, h = box
        ref = np.array(img.resize((size, size), Image.BILINEAR, box=(left, top, left + w, top + h)))
        ref = torch.from_numpy(ref).permute(2, 0, 1)
        out = resized_crop(img, box, size)
        assert out.shape == (3, size, size) and out.dtype == torch.uint8
        diff = (out.int() - ref.int()).abs()
        rim = 0 if (w, h) == img.size else 2
        assert diff[:, rim:size - rim, rim:size - rim].max() <= 1 and diff.float().mean() < 0.5, box
        assert torch.equal(resized_crop(img, box, size, flip=True), out.flip(-1))
        decoded = torch.from_numpy(smooth.copy()).permute(2, 0, 1)  # decoded (3, H, W): torch resizes
        from_tensor = resized_crop(decoded, box, size)
        assert from_tensor.stride()[0] == 1  # (H, W, 3) pixels
        assert torch.equal(resized_crop(decoded, box, size, True), from_tensor.flip(-1))
        diff = (from_tensor.int() - ref.int()).abs()
        assert diff[:, rim:size - rim, rim:size - rim].max() <= 1 and diff.float().mean() < 0.5, box
        outs.append(out)
    if (w, h) == (size, size):
        assert torch.equal(out, ref)  # no resize: the exact pixels
    batch = stack(outs)
    assert batch.is_contiguous(memory_format=torch.channels_last) and torch.equal(batch, torch.stack(outs))


@pytest.mark.skipif(shutil.which("curl") is None, reason="webdataset's gopen reads http with curl")
def test_http_manifest_and_shards(tmp_path):
    manifest, source = write_shards(tmp_path, [5, 5, 5])
    handler = functools.partial(_QuietHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        for spec, n in ((f"{url}/manifest.json", 0), (url + "/{000000..000002}.tar", 15)):
            loader = make_loader(spec, batch_size=4, img_size=16, train=False, labeled=True,
                                 data_cfg=cfg(), num_samples=n)
            table = lookup(source)
            assert sorted(k for b in loader.epoch(0) for k in batch_keys(b, table)) == sorted(source)
    finally:
        server.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_workers_cache_a_small_set_and_replay_it_unchanged(tmp_path):
    manifest, _ = write_shards(tmp_path / "d", [15, 15, 15, 15], classes=3)

    def loader(cache_mb):
        return make_loader(manifest, batch_size=4, img_size=16, train=True, labeled=True,
                           data_cfg=cfg(cache_mb=cache_mb), subset=(0.5, 5))

    plain, cached = loader(0), loader(1)
    expected = [list(plain.epoch(e)) for e in range(3)]
    assert [len(b["image"]) for b in expected[0]] == [4] * 7 + [2]
    first = list(cached.epoch(0))  # reads the shards and keeps the subset's raw samples
    (tmp_path / "d").rename(tmp_path / "gone")  # later epochs must not read the shards at all
    for e, batches in enumerate([first, list(cached.epoch(1)), list(cached.epoch(2))]):
        assert all(torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"])
                   for a, b in zip(batches, expected[e], strict=True))
    assert cached.counters() == {}
    (tmp_path / "gone").rename(tmp_path / "d")
    small = loader(1)
    small.stream.cache_limit = 100  # bytes: the set outgrows it, so nothing is kept
    list(small.epoch(0))
    (tmp_path / "d").rename(tmp_path / "gone")
    with pytest.raises(DataError):  # epoch 1's first batches may have been read ahead, not epoch 2's
        list(small.epoch(1))
        list(small.epoch(2))


def test_a_worker_holds_no_more_raw_samples_than_its_cache_allows(tmp_path):
    """A worker reads its shards sample by sample: with the cache off (cache_mb=0, as in every
    evaluation) or outgrown, it holds about one raw sample at a time, not a whole shard (here 32
    members of 1 MiB); with room, it keeps the shard."""
    import tarfile
    import tracemalloc
    path = tmp_path / "big.tar"
    with tarfile.open(path, "w") as tar:
        for i in range(32):
            info = tarfile.TarInfo(f"{i:06d}.jpg")
            info.size = 1 << 20
            tar.addfile(info, io.BytesIO(np.random.default_rng(i).bytes(info.size)))

    def peak_mib(cache_mb):
        loader = make_loader(str(path), batch_size=4, img_size=8, train=True, labeled=False,
                             data_cfg=cfg(cache_mb=cache_mb, shuffle_buffer=0), num_samples=32)
        tracemalloc.start()
        try:
            assert sum(1 for _ in loader.stream._raw(0, 0, {})) == 32
            return tracemalloc.get_traced_memory()[1] / 2 ** 20, loader.stream.cache
        finally:
            tracemalloc.stop()

    off, cache = peak_mib(0)
    assert cache is None and off < 8
    outgrown, cache = peak_mib(16)  # the 32 MiB shard does not fit 16 MiB
    assert cache is None and outgrown < 16 + 8
    kept, cache = peak_mib(64)
    assert len(cache[0]) == 32 and kept > 32


def test_the_shuffle_is_webdatasets_until_its_bytes_bound_binds():
    """Under its byte bound the shuffle draws webdataset's order exactly (the figures of runs made
    with webdataset's shuffle stand); over it, large samples stop the buffer growing at the bound
    while every sample still goes out once."""
    import random
    from webdataset.filters import shuffle as wds_shuffle
    small = [{"__key__": f"{i:04d}", "png": bytes(10)} for i in range(300)]
    for size in (1, 7, 100, 1000):
        ours = [x["__key__"] for x in shuffle(iter(small), size, 1 << 20, random.Random("s"))]
        theirs = [x["__key__"] for x in wds_shuffle(size, initial=size, rng=random.Random("s"))(iter(small))]
        assert ours == theirs, size
    held, peak = 0, 0

    def read(sizes):  # samples of these sizes, counting the bytes read but not yet handed out
        nonlocal held, peak
        for i, n in enumerate(sizes):
            held += n
            peak = max(peak, held)
            yield {"__key__": f"{i:04d}", "jpg": bytes(n)}

    for sizes, size in (([1 << 20] * 64, 2000),  # large from the start: the buffer stops at the bound
                        ([10_000] * 300 + [1 << 20] * 64, 200)):  # filled by count, then large ones come
        held, peak, out = 0, 0, []
        for x in shuffle(read(sizes), size, 8 << 20, random.Random(0)):
            held -= len(x["jpg"])
            out.append(x["__key__"])
        assert sorted(out) == [f"{i:04d}" for i in range(len(sizes))] and out != sorted(out)
        assert 8 << 20 <= peak <= 9 << 20, peak  # the bound, and the one sample read past it


def test_a_shard_that_counted_a_skip_is_read_and_counted_every_epoch_while_the_rest_stays_cached(tmp_path):
    """The cache keeps only shards that read cleanly: a shard cut short is read again every epoch,
    so its skip is counted every epoch (a cached copy would replay it silently), and it does not
    switch the cache off for the shards that did read cleanly."""
    import tarfile
    manifest, _ = write_shards(tmp_path / "d", [6, 6], classes=3)
    stream = make_loader(manifest, batch_size=4, img_size=16, train=True, labeled=True,
                         data_cfg=cfg(cache_mb=1, shuffle_buffer=0, num_workers=1)).stream
    clean, cut = (Path(u) for u in stream.shards.urls)
    with tarfile.open(cut) as tar:
        end = tar.getmembers()[-1].offset_data  # the last member's header stays, its data goes
    cut.write_bytes(cut.read_bytes()[:end])
    for epoch in range(3):
        skips: dict[str, int] = {}
        assert sum(1 for _ in stream._raw(epoch, 0, skips)) == 6 + 5, epoch  # the cut sample dropped
        assert skips == {"truncated_tar": 1, "lost_samples": 1} and set(stream.cache or ()) == {0}, (epoch, skips)
        if epoch == 0:
            clean.unlink()  # from now on served from the cache alone


def test_images_decoded_while_a_shard_is_read_leave_its_own_counts_and_caching_alone(tmp_path):
    """Decoding runs between a shard's reads and counts into the same epoch's skips: a corrupt image
    decoded then is not the shard's. So a shard that reads to its end is cached, and one that holds
    fewer samples than its manifest says, without breaking, counts no lost samples (the loader pads
    the batch count instead), whether or not an image failed meanwhile."""
    manifest, _ = write_shards(tmp_path / "d", [6, 6], classes=3,
                               extra=lambda s, j: {"png": b"not a png"} if (s, j) == (1, 1) else {})
    m = json.loads(Path(manifest).read_text())
    m["shards"][1]["num_samples"], m["num_samples"] = 7, 13  # shard 1 holds one sample fewer
    Path(manifest).write_text(json.dumps(m))
    stream = make_loader(manifest, batch_size=4, img_size=16, train=True, labeled=True,
                         data_cfg=cfg(cache_mb=1, shuffle_buffer=0, num_workers=1)).stream
    for epoch in range(2):  # the second from the cache: the corrupt image decoded and counted again
        assert list(stream._epoch(epoch, 0))[-1]["skips"] == {"corrupt_image": 1}, epoch
        assert set(stream.cache or ()) == {0, 1}, epoch


def test_a_worker_reads_a_broken_shard_of_another_worker_once_to_fill_its_cache(tmp_path, monkeypatch):
    """At an epoch's end each worker reads the rank's shards it does not hold into its cache; a
    shard that broke is never cached, so it is read there once, not again every epoch."""
    import mpp.data.stream as stream_module
    manifest, _ = write_shards(tmp_path / "d", [6, 6, 6, 6], classes=3)
    stream = make_loader(manifest, batch_size=4, img_size=16, train=True, labeled=True,
                         data_cfg=cfg(cache_mb=1, shuffle_buffer=0, num_workers=2)).stream
    cut = Path(stream.shards.urls[1])
    cut.write_bytes(cut.read_bytes()[:cut.stat().st_size // 2])
    reads = Counter()

    def read_shard(url, skips):
        reads[url] += 1
        return real(url, skips)

    real = stream_module.read_shard
    monkeypatch.setattr(stream_module, "read_shard", read_shard)
    for epoch in range(4):
        reads.clear()
        items = list(stream._epoch(epoch, 0))
        mine = [stream.shards.urls[s] for s in stream.plan(epoch).bins[0]]
        assert set(stream.cache) == {0, 2, 3}, epoch
        if epoch == 0:
            assert sorted(reads) == sorted(stream.shards.urls), reads  # its own, then the fill
        else:  # its own broken shard, read again for its counts; nothing else
            assert reads == Counter({str(cut): 1} if str(cut) in mine else {}), (epoch, reads, mine)
        assert ("truncated_tar" in items[-1]["skips"]) == (str(cut) in mine), epoch


def test_a_data_worker_leaves_sigterm_to_the_trainer_only_while_shielded(tmp_path):
    """A worker's SIGTERM handler: while the trainer shields its process's workers (any loader's,
    also one forked before), a worker lives on (the trainer handles a process group's SIGTERM and
    saves a checkpoint first); unshielded, it ends of it as by default, as torch's shutdown
    expects of a worker that does not stop."""
    from mpp.data import shield_workers
    from mpp.data.stream import _worker_sigterm
    manifest, _ = write_shards(tmp_path, [4])
    shield = make_loader(manifest, batch_size=2, img_size=8, train=False, labeled=True, data_cfg=cfg()).stream.shield
    ready = multiprocessing.get_context("fork").Event()

    def worker():
        signal.signal(signal.SIGTERM, functools.partial(_worker_sigterm, shield))
        ready.set()
        time.sleep(60)

    proc = multiprocessing.get_context("fork").Process(target=worker)
    proc.start()
    try:
        assert ready.wait(30)
        shield_workers(True)  # after the fork, as for a loader made before the trainer's loop
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(1)
        assert proc.is_alive()
        shield_workers(False)
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(30)
        assert proc.exitcode == -signal.SIGTERM
    finally:
        shield_workers(False)
        proc.kill()


def test_workers_read_the_next_epoch_ahead_and_a_restart_reads_the_same(tmp_path):
    """Training workers run on into the next epoch before it is asked for (no stall at an epoch
    start); the batches are still those of a loader that starts at that epoch (a resumed run),
    with uneven shards, so the workers end their epochs at different points of the round robin."""
    manifest, _ = write_shards(tmp_path, [10, 7, 13, 5, 9])

    def loader():
        return make_loader(manifest, batch_size=4, img_size=16, train=True, labeled=True,
                           data_cfg=cfg(shuffle_buffer=8), seed=1)

    ran_on = loader()
    for _ in ran_on.epoch(0):  # each batch dropped at once: its slot is free for the read-ahead
        pass
    state = ran_on.stream.slots.state
    deadline = time.monotonic() + 20
    while 1 not in state[:] and time.monotonic() < deadline:  # a slot being filled (FILLING): epoch 1
        time.sleep(0.01)
    assert 1 in state[:], "the workers did not start the next epoch on their own"
    for e in (1, 2):
        restarted = loader()
        assert all(torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"])
                   for a, b in zip(ran_on.epoch(e), restarted.epoch(e), strict=True))
        restarted.close()
    ran_on.close()


def test_unequal_rank_shares_are_warned_about(tmp_path, caplog):
    """Three equal shards on two ranks: 32 and 16 samples a rank, so the smaller rank's batches
    shrink and its samples weigh double in the averaged gradient; two shards split evenly."""
    uneven, _ = write_shards(tmp_path / "three", [16, 16, 16])
    even, _ = write_shards(tmp_path / "two", [16, 16])
    warned = []
    for manifest in (uneven, even):
        caplog.clear()
        with caplog.at_level("WARNING", logger="mpp.data"):
            make_loader(manifest, batch_size=4, img_size=16, train=True, labeled=True, data_cfg=cfg(num_workers=0),
                        rank=0, world_size=2)
        warned.append(any("shares of the training data differ (16 to 32" in r.getMessage() for r in caplog.records))
    assert warned == [True, False]



def test_a_timeout_without_workers_to_watch_is_warned_about_once(tmp_path, caplog):
    """data.timeout watches the data workers: with num_workers=0 a stalled read waits forever, which
    docs/data.md's stall error never said; warned about once, not where a timeout is 0 or workers read."""
    from mpp.data import loader as loader_module
    loader_module._warn_unwatched.cache_clear()  # an earlier test may have had it said
    manifest, _ = write_shards(tmp_path, [8, 8], size=8)
    said = []
    for workers, timeout in ((1, 600), (0, 0), (0, 600), (0, 600)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="mpp.data"):
            make_loader(manifest, batch_size=4, img_size=8, train=True, labeled=True,
                        data_cfg=cfg(num_workers=workers, timeout=timeout))
        said.append(any("data.timeout needs data.num_workers >= 1" in r.getMessage() for r in caplog.records))
    assert said == [False, False, True, False]


def test_a_training_batch_larger_than_a_ranks_data_is_warned_about(tmp_path, caplog):
    """32 samples a rank cut every step of batch_size 64 to 32 (it went unsaid); a batch that fits,
    or an evaluation loader, says nothing."""
    manifest, _ = write_shards(tmp_path / "d", [16, 16])
    said = []
    for batch_size, train in ((64, True), (32, True), (64, False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="mpp.data"):
            make_loader(manifest, batch_size=batch_size, img_size=16, train=train, labeled=True,
                        data_cfg=cfg(num_workers=0))
        said.append(any("batch of 64 (batch_size over processes and train.grad_accum) is more than the 32 training "
                        "samples" in r.getMessage() for r in caplog.records))
    assert said == [True, False, False]


@pytest.mark.parametrize("spec", ["manifest", "pattern, exact count", "pattern, count too small"])
def test_a_worker_with_fewer_batches_does_not_run_ahead_epoch_after_epoch(tmp_path, spec):
    """Equal shards that split unevenly over the workers (2 and 1): the DataLoader takes items from
    its workers strictly in turn, so the short worker's batches must not pile up in the main
    process by an epoch's difference every epoch (memory and shared-memory files without bound);
    nor where the counts are estimates (a pattern and num_samples), which a worker can exceed."""
    manifest, _ = write_shards(tmp_path, [16, 16, 16], size=8)
    data, n = {"manifest": (manifest, None), "pattern, exact count": (f"{tmp_path}/{{000000..000002}}.tar", 48),
               "pattern, count too small": (f"{tmp_path}/{{000000..000002}}.tar", 36)}[spec]
    loader = make_loader(data, num_samples=n, batch_size=4, img_size=8, train=True, labeled=True,
                         data_cfg=cfg(shuffle_buffer=0, cache_mb=0, crop_scale=(1.0, 1.0), hflip=0.0), seed=0)
    assert sorted(len(b) for b in loader.stream.plan(0).bins) == [1, 2]
    held = []
    for e in range(8):
        images = torch.cat([b["image"] for b in loader.epoch(e)])
        assert len(images) == (n or 48)
        if n != 36:  # every sample once: none of the longer worker's dropped, none repeated to fill
            assert len({img.numpy().tobytes() for img in images}) == 48
        held.append(sum(len(q) for q in loader._held.values()))
    loader.close()
    assert max(held) <= 2 * loader.workers, held


def test_a_manifest_that_undercounts_a_shard_drops_the_surplus_and_holds_nothing(tmp_path):
    """A manifest (hand-written, or from another tool) that says 16 samples for a shard of 24: its
    counts are taken as exact, so its worker must stop at its share of the epoch's batches, the
    surplus dropped and counted, instead of running ahead epoch after epoch while the main process
    holds ever more of its batches."""
    manifest, _ = write_shards(tmp_path, [24, 16, 16], size=8)
    m = json.loads(Path(manifest).read_text())
    m["shards"][0]["num_samples"], m["num_samples"] = 16, 48
    Path(manifest).write_text(json.dumps(m))
    loader = make_loader(manifest, batch_size=4, img_size=8, train=True, labeled=True,
                         data_cfg=cfg(shuffle_buffer=0, cache_mb=0), seed=0)
    held = []
    for e in range(6):
        assert sum(len(b["image"]) for b in loader.epoch(e)) == 48
        held.append(sum(len(q) for q in loader._held.values()))
    loader.close()
    assert max(held) <= 2 * loader.workers, held
    assert loader.counters() == {"dropped": 6 * 8}


def test_a_manifest_that_overcounts_a_shard_a_millionfold_is_refused_or_padded_at_once(tmp_path, monkeypatch):
    """A manifest (untrusted data) that says 10^9 samples for a shard of 10: a plain local tar
    cannot hold them in its size, refused in one line; where the size bounds nothing (a compressed
    shard, a remote one) the epoch is padded (counted) at once, not with one item a missing batch,
    which kept the loader from the step loop (and a SIGTERM) for hours."""
    import gzip
    import itertools

    from mpp.data import stream
    manifest, _ = write_shards(tmp_path, [10, 10], size=8)
    m = json.loads(Path(manifest).read_text())
    m["shards"][0]["num_samples"] = 10**9
    m["num_samples"] = 10**9 + 10
    Path(manifest).write_text(json.dumps(m))
    with pytest.raises(DataError, match=r"shard 000000.tar is said to hold 1000000000 samples, more than its \d+ "
                                        "bytes can"):
        make_loader(manifest, batch_size=4, img_size=8, train=True, labeled=True, data_cfg=cfg())
    shard = tmp_path / "000000.tar"
    shard.write_bytes(gzip.compress(shard.read_bytes()))
    m["shards"][0]["bytes"] = shard.stat().st_size
    Path(manifest).write_text(json.dumps(m))
    monkeypatch.setattr(stream, "TICK_ITEMS", 8, raising=False)  # the workers fork later
    loader = make_loader(manifest, batch_size=4, img_size=8, train=True, labeled=True,
                         data_cfg=cfg(shuffle_buffer=0, cache_mb=0))
    items, next_item = itertools.count(), loader._next_item
    monkeypatch.setattr(loader, "_next_item", lambda: next(items) < 1000 and next_item() or pytest.fail(
        "the workers sent over 1000 items for 10 batches"))
    batches = list(itertools.islice(loader.epoch(0), 10))
    loader.close()
    assert len(batches) == 10 and sum(len(b["image"]) for b in batches) == 20 + loader.counters()["padded"]


def test_a_shard_listed_twice_is_refused(tmp_path):
    """Overlapping brace ranges, or one shard by two names: ranks and workers would read it twice."""
    write_shards(tmp_path, [4, 4, 4, 4], size=8)
    for spec in ([f"{tmp_path}/{{000000..000002}}.tar", f"{tmp_path}/{{000002..000003}}.tar"],
                 [f"{tmp_path}/000000.tar", f"file:{tmp_path}/sub/../000000.tar"]):
        (tmp_path / "sub").mkdir(exist_ok=True)
        with pytest.raises(DataError, match=r"names shard '.*\.tar' twice"):
            make_loader(spec, num_samples=16, batch_size=4, img_size=8, train=True, labeled=True, data_cfg=cfg())
    # a resampled stream draws shards at random: a shard named twice is drawn twice as often, on purpose
    loader = make_loader(spec, num_samples=16, batch_size=4, img_size=8, train=True, labeled=True,
                         data_cfg=cfg(resampled=True, epoch_samples=16))
    assert sum(len(b["image"]) for b in loader.epoch(0)) == 16


def test_a_list_of_manifests_is_refused_in_one_line(tmp_path):
    """A list names shards: a manifest in it would be read as a tar and called corrupt."""
    a, _ = write_shards(tmp_path / "a", [4, 4], size=8)
    b, _ = write_shards(tmp_path / "b", [4, 4], size=8)
    for n in (0, 16):
        with pytest.raises(DataError, match="a manifest: a list names shards; give one manifest.json"):
            make_loader([a, b], num_samples=n, batch_size=4, img_size=8, train=True, labeled=True, data_cfg=cfg())


def _indexed(tmp_path, sizes: dict[int, int], shards: int = 2):
    """A ShardSet whose label index lists `sizes[c]` samples of class c over `shards` shards; the
    shards themselves are never read (a subset is drawn from the index alone)."""
    items = [(f"s{c}_{i:04d}", c) for c, n in sorted(sizes.items()) for i in range(n)]
    index = [[list(kv) for kv in items[s::shards]] for s in range(shards)]
    (tmp_path / "labels.json").write_text(json.dumps(index))
    return ShardSet([str(tmp_path / f"{s:06d}.tar") for s in range(shards)], [len(e) for e in index],
                    [f"c{c}" for c in sorted(sizes)], labels=str(tmp_path / "labels.json"))


def _subset_keys(shards) -> set:
    return {k for ks in shards.keys for k in ks}


def test_a_rare_class_keeps_one_label_in_a_small_subset(tmp_path):
    """A class whose share of a 1% subset rounds to nothing still gets one label: a fine-tune on a
    long-tailed set never trains without a class it is tested on."""
    got = _subset_keys(select_subset(_indexed(tmp_path, {0: 200, 1: 200, 2: 20}), 0.01, seed=0))
    assert {c: sum(k.startswith(f"s{c}_") for k in got) for c in range(3)} == {0: 2, 1: 2, 2: 1}


def test_the_split_seed_draws_another_subset(tmp_path):
    """finetune.split_seed draws the subset itself, not only its development split: another seed,
    another class-balanced subset; the same seed, the same one."""
    shards = _indexed(tmp_path, {0: 40, 1: 40})
    a, b = (_subset_keys(select_subset(shards, 0.5, seed=s)) for s in (0, 1))
    assert len(a) == len(b) == 40 and a != b and a == _subset_keys(select_subset(shards, 0.5, seed=0))


def test_a_negative_label_in_the_index_is_refused(tmp_path):
    shards = _indexed(tmp_path, {0: 4, 1: 4})
    index = json.loads((tmp_path / "labels.json").read_text())
    index[0][0][1] = -1
    (tmp_path / "labels.json").write_text(json.dumps(index))
    with pytest.raises(DataError, match="gives label -1"):
        select_subset(shards, 0.5, seed=0)


def test_each_worker_item_carries_the_skip_counts_as_of_that_item(tmp_path):
    """The loader counts a skip as the difference between two items' counts: an item whose counts went
    on changing after it was sent (shared with the stream, not a copy) would hide every skip made after
    it; torch's default_convert happens to copy them now, so the stream's own items are checked too."""
    manifest, _ = write_shards(tmp_path, [8], extra=lambda s, j: {"png": b"not a png"} if j in (5, 6) else {})
    loader = make_loader(manifest, batch_size=3, img_size=8, train=False, labeled=True, data_cfg=cfg(num_workers=0))
    assert sum(len(b["image"]) for b in loader.epoch(0)) == 6
    assert loader.counters() == {"corrupt_image": 2}
    items = list(loader.stream)
    assert [(len(i.get("image", ())), i["skips"]) for i in items] == [(3, {}), (3, {"corrupt_image": 2}),
                                                                       (0, {"corrupt_image": 2})]


def test_a_long_healthy_resampled_run_never_counts_as_shards_that_give_no_sample(tmp_path):
    """Resampled mode raises after too many shard draws in a row without a decoded sample; the count
    restarts at every draw that gives one, so a healthy run drawing one-sample shards far more often
    than that limit goes on."""
    write_shards(tmp_path, [1, 1])
    data = cfg(num_workers=0, resampled=True, epoch_samples=160, shuffle_buffer=0)
    loader = make_loader(str(tmp_path / "{000000..000001}.tar"), batch_size=8, img_size=8, train=True,
                         labeled=True, data_cfg=data, num_samples=2)
    assert 160 > loader.stream.dry_limit
    assert [len(b["image"]) for b in loader.epoch(0)] == [8] * 20 and loader.counters() == {}


def test_shards_with_estimated_counts_give_every_sample_in_training(tmp_path):
    """Without a manifest the counts are estimates (even shares): a worker whose shard holds more than
    its estimate still sends all of it, so real samples fill the epoch instead of being dropped for
    padded repeats."""
    _, source = write_shards(tmp_path, [10, 2])
    loader = make_loader(str(tmp_path / "{000000..000001}.tar"), batch_size=3, img_size=8, train=True,
                         labeled=True, data_cfg=cfg(num_workers=2, shuffle_buffer=0), num_samples=12)
    for epoch in (0, 1):
        labels = [int(x) for b in loader.epoch(epoch) for x in b["label"]]
        assert sorted(labels) == sorted(label for label, _ in source.values())
    loader.close()
    assert loader.counters() == {}


def test_augmentation_draws_other_crops_every_epoch(tmp_path):
    """The same images in the same order in two epochs (one shard, no shuffle buffer) are cropped and
    flipped anew each epoch: a run that saw the same augmentation every epoch would lose its benefit."""
    write_shards(tmp_path, [4], size=32)
    loader = make_loader(str(tmp_path / "manifest.json"), batch_size=4, img_size=16, train=True, labeled=True,
                         data_cfg=cfg(num_workers=0, shuffle_buffer=0))
    a, b, again = (next(iter(loader.epoch(e))) for e in (0, 1, 0))
    assert torch.equal(a["label"], b["label"]) and torch.equal(a["image"], again["image"])
    assert all(not torch.equal(x, y) for x, y in zip(a["image"], b["image"]))


def test_as_many_samples_left_as_batches_give_one_sample_a_batch(tmp_path):
    """A training stream that runs short of an estimated count with exactly as many samples left as
    batches to make gives each batch one of them, rather than one batch all and repeats after it."""
    write_shards(tmp_path, [4, 3])
    loader = make_loader(str(tmp_path / "{000000..000001}.tar"), batch_size=4, img_size=8, train=True,
                         labeled=True, data_cfg=cfg(num_workers=0, shuffle_buffer=0), num_samples=16)
    assert [len(b["image"]) for b in loader.epoch(0)] == [4, 1, 1, 1]
    assert "padded" not in loader.counters()


def test_an_evaluation_over_an_underestimated_count_keeps_its_batches_to_batch_size(tmp_path):
    """An evaluation scores every image past an estimated count that was too low, but still in batches
    of batch_size at most: one batch of the whole surplus could exhaust the evaluator's memory."""
    _, source = write_shards(tmp_path, [10, 10])
    loader = make_loader(str(tmp_path / "{000000..000001}.tar"), batch_size=3, img_size=16, train=False,
                         labeled=True, data_cfg=cfg(num_workers=0), num_samples=4)
    batches = list(loader.epoch(0))
    keys = [k for b in batches for k in batch_keys(b, lookup(source))]
    assert sorted(keys) == sorted(source) and max(len(b["image"]) for b in batches) == 3


def test_an_evaluation_reads_its_shards_afresh_every_time(tmp_path):
    """Evaluation workers keep no cache of the raw validation set (each would hold all of it in memory):
    shards rewritten between two evaluations are read as they are now."""
    manifest, old = write_shards(tmp_path, [4, 4])
    loader = make_loader(manifest, batch_size=4, img_size=16, train=False, labeled=True, data_cfg=cfg())
    assert sorted(k for b in loader.epoch(0) for k in batch_keys(b, lookup(old))) == sorted(old)
    _, new = write_shards(tmp_path, [4, 4], seed=1)
    assert sorted(k for b in loader.epoch(1) for k in batch_keys(b, lookup(new))) == sorted(new)
    loader.close()


def test_a_training_stream_runs_on_into_the_next_epochs_without_a_restart(tmp_path, monkeypatch):
    """A training stream over exact counts is started once and runs on from epoch to epoch: a restart
    at every epoch would drop what the workers read ahead and wait for them to start over."""
    from torch.utils.data import DataLoader
    manifest, _ = write_shards(tmp_path, [5, 7])
    starts = []
    start = DataLoader.__iter__
    monkeypatch.setattr(DataLoader, "__iter__", lambda self: starts.append(1) or start(self))
    loader = make_loader(manifest, batch_size=3, img_size=8, train=True, labeled=True, data_cfg=cfg(num_workers=0))
    for epoch in range(3):
        assert sum(len(b["image"]) for b in loader.epoch(epoch)) == 12
    assert len(starts) == 1


def test_a_manifest_whose_total_disagrees_with_its_shards_is_refused(tmp_path):
    """A manifest whose num_samples is not the sum of its shards' counts does not describe its shards
    (edited, or a mixed-up copy): refused in one line before any work."""
    manifest, _ = write_shards(tmp_path, [5, 7])
    m = json.loads(Path(manifest).read_text())
    m["num_samples"] = 13
    Path(manifest).write_text(json.dumps(m))
    with pytest.raises(DataError, match="num_samples is 13 but its shards hold 12"):
        make_loader(manifest, batch_size=3, img_size=8, train=True, labeled=True, data_cfg=cfg(num_workers=0))


def test_a_manifest_that_counts_more_samples_than_two_blocks_each_fit_is_refused(tmp_path):
    """A plain tar sample takes a header and a data block (1024 bytes) at the least: a manifest that
    says a shard holds one sample more than its size allows so does not describe it (every epoch
    would pad with missing samples), refused in one line."""
    manifest, _ = write_shards(tmp_path, [5, 7])
    m = json.loads(Path(manifest).read_text())
    m["shards"][0]["num_samples"] = (tmp_path / "000000.tar").stat().st_size // 1024 + 1
    m["num_samples"] = m["shards"][0]["num_samples"] + 7
    Path(manifest).write_text(json.dumps(m))
    with pytest.raises(DataError, match="more than its .* bytes can"):
        make_loader(manifest, batch_size=3, img_size=8, train=True, labeled=True, data_cfg=cfg(num_workers=0))
