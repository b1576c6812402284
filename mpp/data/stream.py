"""Sharded, distributed, exactly-sized batch streams: `make_loader(...) -> ShardLoader`.

The DataLoader workers persist across epochs (forked once per loader, stopped by
`ShardLoader.close()` or when the loader is freed); the loader tells them the epoch to start at
through shared memory, and a training stream that is not resampled runs on into the next epochs,
so the DataLoader's prefetch holds the next epoch's first batches before the step asks for them
(no stall at every epoch start of a small set read many times). Per epoch e (identical
computation on every rank and worker):
1. shards are shuffled with a seed of (seed, e) (train only) and packed into one bin per rank by
   largest-first greedy (`sources.assign`): the bin totals depend only on the shard counts, so they
   are the same every epoch; in training the rank bins are then permuted with the same seed. A
   rank's shards are split over its DataLoader workers greedily in the shuffled order. Fewer shards
   than ranks x workers: fewer workers per rank (logged); fewer shards than ranks: an error;
2. each DataLoader worker reads its bin's shards (a train set that fits `data.cache_mb` per worker
   is kept raw in every worker's memory from the first epoch's end on, so small sets read many
   times skip the shard reading at every epoch start), drops samples outside a subset, shuffles raw
   (undecoded) samples in a buffer bounded in count and bytes (`shuffle`), decodes them a batch at
   a time (`decode.decode_batch`) and
   yields uint8 batches of `batch_size` (channels-last memory format, `transforms.stack`), in
   shared-memory slots it reuses (`slots.BatchSlots`; batches for CUDA are pinned by the consumer,
   `mpp.prefetch`), together with its cumulative skip counters;
3. the main process re-chunks the worker stream into exactly K batches, K the same on every rank
   (K = ceil(largest rank bin total / batch_size), fixed for all epochs): full batches first, the
   tail ones smaller; each size is planned from what the rank still expects (its count minus what
   was emitted and what workers reported skipped), so per-sample skips shrink the tail batches. A
   worker batch that already has the planned size is passed through untouched. If a rank still
   runs dry (a truncated or unreadable shard, counts that were only estimated), its last batch is
   repeated (counted as `padded`); a surplus beyond its count is `dropped`. So no rank ever waits
   for another at an epoch end. An evaluation loader (`train=False`) repeats nothing, since a
   repeat would score its images twice: it ends short, its skips counted, and its evaluator
   scores the images it read.
Resampled mode: each worker draws shards with replacement, forever; the epoch ends after K batches
of the fixed `data.epoch_samples / world_size` samples per rank. A worker whose draws stop giving
samples that decode (100 + 10 per shard + the shuffle buffer's size of them in a row) raises a
DataError rather than wait forever.
`epoch(e, start_batch=k)` replays epoch e and discards its first k batches, so resuming yields
exactly what an uninterrupted epoch would (the run is deterministic given seed, epoch, rank and
worker count: the loader takes an epoch's worker batches in the round-robin order of a fresh
DataLoader start whether the workers start at that epoch or run on into it, and shuffling and
augmentation use Python RNGs seeded from (seed, epoch, rank, worker)). The price: a resume in
the middle of an epoch re-reads and decodes that epoch's first k batches (no model compute).
Starting an epoch other than the one the workers run on into (or after an unfinished one)
restarts them there (the workers are shared).
"""
from __future__ import annotations

import collections
import functools
import itertools
import logging
import math
import multiprocessing
import os
import random
import signal
import sys
import warnings
import weakref
from typing import Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from mpp.config import DataConfig
from mpp.data.decode import SAMPLE_SKIPS, SKIP_KINDS, DataError, decode_batch
from mpp.data.slots import BatchSlots
from mpp.data.sources import ShardSet, assign, check_distinct, read_shard, resolve
from mpp.data.subset import select_subset, withhold_splits
from mpp.data.transforms import build_transform, stack

log = logging.getLogger(__name__)

# workers are forked where the platform allows it, whatever the process's default start method (a
# stage of tools/compare.py inherits 'forkserver', and Python 3.14 makes it the default on Linux):
# a forked worker inherits the imported modules and the batch slots' mapping, while one started
# from a server imports torch again and sends every batch through a fresh shared-memory segment
WORKER_START = "fork" if sys.platform == "linux" else None

# set while a trainer's loop handles SIGTERM: every data worker of this process (the training
# loader's, an evaluator's) then leaves it to the trainer (`_worker_sigterm`)
_SHIELD = multiprocessing.RawValue("b", 0)


def shield_workers(on: bool) -> None:
    """While on, this process's data workers ignore SIGTERM: the trainer's loop handles it."""
    _SHIELD.value = int(on)


def _worker_sigterm(shield, signum, frame) -> None:
    """A data worker's SIGTERM: left to the trainer while its loop handles it (`shield_workers`: a
    scheduler signals the whole process group, and a worker it ended would stop the trainer
    before its checkpoint, mpp.train); otherwise the worker ends of it as by default (torch stops a
    worker that does not finish with SIGTERM). A handler, not SIG_IGN, which would outlast the
    loop; so the commands a worker starts (pipe:, curl) have the default action: a group's
    SIGTERM ends them, and the shards they were reading count as cut short."""
    if not shield.value:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


# batch slots per worker: DataLoader's 2 prefetched batches, 1 being filled, and up to 4 held by the
# consumer (the trainer's prefetcher off CUDA: the step's batch, 2 queued, 1 being staged; on CUDA
# it keeps pinned copies and frees the slots at once). Slots take memory only once written to.
SLOTS_PER_WORKER = 7


def raw_bytes(sample: dict) -> int:
    """The bytes a raw sample holds (its members' contents)."""
    return sum(len(v) for v in sample.values() if isinstance(v, bytes))


def shuffle(samples: Iterator[dict], size: int, max_bytes: int, rng: random.Random) -> Iterator[dict]:
    """webdataset's sample shuffle (a buffer of `size` raw samples, filled before the first goes
    out, then one random pick per sample read: the same draws, so the same order) with the
    buffer's bytes bounded too: past `max_bytes` it stops growing and hands out samples until it is
    under the bound again, so that large images (a 4 MB photo, 256 MiB members) hold fewer samples
    instead of exhausting memory."""
    buf, held = [], 0

    def pick() -> dict:
        nonlocal held
        k = rng.randint(0, len(buf) - 1)
        buf[k], buf[-1] = buf[-1], buf[k]
        held -= raw_bytes(buf[-1])
        return buf.pop()

    for sample in samples:
        buf.append(sample)
        held += raw_bytes(sample)
        if len(buf) < size and held < max_bytes:  # grows by two a step until full, as webdataset's
            if (more := next(samples, None)) is not None:
                buf.append(more)
                held += raw_bytes(more)
        while buf and (len(buf) >= size or held >= max_bytes):  # one a step, more while over the bytes
            yield pick()
    while buf:
        yield pick()


class _EpochPlan:
    """Which shards each of this rank's workers reads in one epoch, and their sample count."""

    def __init__(self, shards: ShardSet, epoch: int, *, seed: int, train: bool, rank: int,
                 world_size: int, workers: int):
        order = list(range(len(shards.urls)))
        rng = random.Random(f"{seed}:{epoch}:shards")
        if train:
            rng.shuffle(order)
        ranks = assign(shards.counts, order, world_size)
        if train:
            rng.shuffle(ranks)  # permuting whole rank bins keeps their totals (and so K) intact
        position = {s: i for i, s in enumerate(order)}
        mine = sorted(ranks[rank], key=position.__getitem__)  # this epoch's shuffled order
        self.bins = assign(shards.counts, mine, workers, largest_first=False)
        self.num_samples = sum(shards.counts[i] for i in mine)


class _ShardStream(IterableDataset):
    """One rank's worker side: per worker, its shards -> raw shuffle -> decode -> uint8 batches."""

    def __init__(self, shards: ShardSet, transform, *, batch_size: int, labeled: bool,
                 max_pixels: int, shuffle_buffer: int, shuffle_bytes: int, resampled: bool, seed: int,
                 train: bool, rank: int, world_size: int, workers: int, cache_bytes: int = 0):
        self.shards, self.transform = shards, transform
        self.batch_size, self.labeled, self.max_pixels = batch_size, labeled, max_pixels
        self.shuffle_buffer, self.shuffle_bytes = shuffle_buffer, shuffle_bytes
        self.resampled, self.seed, self.train = resampled, seed, train
        self.rank, self.world_size, self.workers = rank, world_size, workers
        # each epoch streams into the next (see __iter__); only where the counts are exact, as a worker
        # that makes more batches than they say would run ahead by the surplus every epoch (see _ticks)
        self.follow = train and not resampled and shards.exact
        # the epoch to start from: set by ShardLoader before it (re)starts its persistent workers
        self.epoch = multiprocessing.RawValue("q", 0)
        self.beats = multiprocessing.RawValue("Q", 0)  # moved by the workers at every shard and sample they read
        self.shield = _SHIELD  # shared with the workers, set by `shield_workers`
        self.slots: BatchSlots | None = None  # set by ShardLoader when its workers may use slots
        # raw samples by shard id, kept by each persistent worker across epochs (see _read_keep)
        self.cache: dict[int, list[dict]] | None = {} if cache_bytes > 0 else None
        self.cache_limit, self.cache_bytes = cache_bytes, 0
        # resampled mode draws forever: shard draws since a sample last decoded, and how many in a
        # row mean that none will (every shard corrupt, unreadable or without labels), an error then
        # instead of a run that waits forever for its first batch
        self.dry, self.dry_limit = 0, 100 + 10 * len(shards.urls) + shuffle_buffer

    def plan(self, epoch: int) -> _EpochPlan:
        return _EpochPlan(self.shards, epoch, seed=self.seed, train=self.train, rank=self.rank,
                          world_size=self.world_size, workers=self.workers)

    def _shard_ids(self, epoch: int, worker: int, rng: random.Random) -> Iterator[int]:
        if self.resampled:
            while True:
                yield rng.randrange(len(self.shards.urls))
        yield from self.plan(epoch).bins[worker]

    def _raw(self, epoch: int, worker: int, skips: dict) -> Iterator[dict]:
        rng = random.Random(f"{self.seed}:{epoch}:{self.rank}:{worker}:order")
        for s in self._shard_ids(epoch, worker, rng):
            if self.resampled:
                self.dry += 1
                if self.dry > self.dry_limit:
                    raise DataError(f"{self.dry_limit} shard draws in a row gave no sample that decodes ({skips}); "
                                    "check the shards")
            if self.cache is not None and s in self.cache:
                yield from self.cache[s]
                continue
            yield from self._read_keep(s, skips)
        if self.cache is not None:  # the rank's other shards too, as the shuffle hands them to every
            for s in itertools.chain(*self.plan(epoch).bins):  # worker in turn (first epoch's end only)
                if self.cache is not None and s not in self.cache:
                    for _ in self._read_keep(s, {}):
                        pass

    def _read(self, shard: int, skips: dict) -> Iterator[dict]:
        """The raw samples of a shard that belong to the subset (all without one). A shard that
        breaks (`read_shard` counts it) loses the samples after the break: counted as `lost_samples`
        where the manifest's counts are exact."""
        keys = self.shards.keys[shard] if self.shards.keys is not None else None
        before, read = dict(skips), 0
        self.beats.value += 1  # alive, for the main process's watchdog (`ShardLoader._next_item`)
        for sample in read_shard(self.shards.urls[shard], skips):
            self.beats.value += 1
            if keys is None or sample["__key__"] in keys:
                read += 1
                yield sample
        if skips != before and self.shards.exact:
            held = len(keys) if keys is not None else self.shards.counts[shard]
            if held > read:
                skips["lost_samples"] = skips.get("lost_samples", 0) + held - read

    def _read_keep(self, shard: int, skips: dict) -> Iterator[dict]:
        """`_read`, caching a completely read shard's raw samples in this worker while the worker's
        total stays within data.cache_mb; a set that outgrows it is not cached at all (the cache is
        for small sets read many times, where each epoch would re-read the shards: a 10% label
        subset reads all of them), and what it held is freed at once, so that a worker holds no
        more than the cache's limit on top of its shuffle buffer. A shard that counted a skip is
        read again next time, so its counters repeat."""
        kept, size, before = [], 0, dict(skips)
        for sample in self._read(shard, skips):
            if kept is not None and self.cache is not None:
                kept.append(sample)
                size += raw_bytes(sample)
                if self.cache_bytes + size > self.cache_limit or skips != before:
                    kept = None  # not cached: free what was kept now
            yield sample
        if self.cache is not None and skips == before:
            if kept is None:
                self.cache = None  # the set does not fit: free what was kept, stop caching
            else:
                self.cache[shard] = kept
                self.cache_bytes += size

    def __iter__(self):
        """This worker's items from the epoch set in `self.epoch` on: its batches, then an end item
        with the epoch's final skip counts; every item names its worker and epoch. A training
        stream that is not resampled goes on into the next epochs (`follow`), so the DataLoader's
        prefetch already holds the next epoch's first batches when the main process reaches them."""
        info = get_worker_info()
        worker = info.id if info is not None else 0
        if info is not None:  # a worker process: corrupt images are counted, not warned about by PIL
            warnings.filterwarnings("ignore", module="PIL")
            signal.signal(signal.SIGTERM, functools.partial(_worker_sigterm, self.shield))
        if self.slots is not None:  # what this worker sent in an abandoned epoch was dropped unread
            self.slots.reclaim(worker)
        epoch = self.epoch.value
        while (yield from self._epoch(epoch, worker)) and self.follow:
            epoch += 1

    def _epoch(self, epoch: int, worker: int) -> Iterator[dict]:
        """One epoch of this worker's items (see `__iter__`); returns False after an error item."""
        skips: dict[str, int] = {}
        rng = random.Random(f"{self.seed}:{epoch}:{self.rank}:{worker}:augment")
        samples = self._raw(epoch, worker, skips)
        if self.shuffle_buffer > 0:
            samples = shuffle(samples, self.shuffle_buffer, self.shuffle_bytes,
                              random.Random(f"{self.seed}:{epoch}:{self.rank}:{worker}:buffer"))
        num_classes = len(self.shards.classes) if self.shards.classes else None
        # a following worker sends no more than its ticks (see _ticks): where a manifest undercounts
        # its shards, the surplus is dropped and counted, not held by the main process ever longer
        most = self._ticks(epoch) if self.follow else math.inf
        images, labels, sent = [], [], 0
        try:  # decode only as many samples as the batch still needs: batches stay in stream order
            while chunk := list(itertools.islice(samples, self.batch_size - len(images))):
                if sent == most:
                    skips["dropped"] = skips.get("dropped", 0) + len(chunk) + sum(1 for _ in samples)
                    break
                got = decode_batch(chunk, self.transform, rng, labeled=self.labeled, num_classes=num_classes,
                                   max_pixels=self.max_pixels, skips=skips)
                images += got[0]
                labels += got[1]
                self.dry = 0 if got[0] else self.dry
                if len(images) == self.batch_size:
                    yield self._batch(images, labels, worker, epoch, skips)
                    images, labels, sent = [], [], sent + 1
        except DataError as e:  # sent as an item so the main process raises it with a clean message
            yield {"worker": worker, "epoch": epoch, "skips": dict(skips), "error": str(e)}
            return False
        if images:
            yield self._batch(images, labels, worker, epoch, skips)
            sent += 1
        if self.follow:
            for _ in range(most - sent):
                yield {"worker": worker, "epoch": epoch, "tick": True}
        yield {"worker": worker, "epoch": epoch, "skips": dict(skips), "end": True}  # the final counts
        return True

    def _ticks(self, epoch: int) -> int:
        """How many items every worker of a following stream sends in `epoch` before its end item:
        the most batches any of this rank's workers can make, a worker with fewer filling up with
        empty ticks. The DataLoader takes items from its workers strictly in turn, so a worker with
        fewer batches would otherwise run ahead into later epochs by that many items every epoch,
        and the main process would hold ever more of its batches (memory, shared-memory files)."""
        counts = self.shards.counts
        return max(math.ceil(sum(counts[s] for s in b) / self.batch_size) for b in self.plan(epoch).bins)

    def _batch(self, images, labels, worker, epoch, skips) -> dict:
        out = {"worker": worker, "epoch": epoch, "skips": dict(skips)}
        slot = self.slots.acquire(worker) if self.slots is not None else None
        if slot is None:
            out["image"] = stack(images)
        else:  # stacked into a reused shared-memory slot: only its number travels
            stack(images, slot[1])
            out["slot"], out["size"] = slot[0], len(images)
        if self.labeled:  # a list: pickled inline, while each tensor costs the main process a
            out["label"] = labels  # shared-memory file to receive
        return out


class ShardLoader:
    """Exactly `batches_per_epoch` batches per epoch on every rank; see the module docstring."""

    def __init__(self, shards: ShardSet, *, batch_size: int, img_size: int, train: bool,
                 labeled: bool, data_cfg, seed: int, rank: int, world_size: int):
        self.shards, self.classes = shards, shards.classes
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        self.resampled = bool(train and data_cfg.resampled)
        workers = max(1, data_cfg.num_workers)
        if not self.resampled:
            if len(shards.urls) < world_size:
                raise DataError(
                    f"{len(shards.urls)} shard(s) cannot feed {world_size} ranks: need at least "
                    f"{world_size * workers} shards ({world_size} ranks x {workers} workers, {world_size} at "
                    "the very least); rewrite the data with more, smaller shards "
                    "(tools/make_shards.py --samples-per-shard)")
            if len(shards.urls) < world_size * workers:  # documented fallback: fewer workers
                log.info("mpp.data: %d shards for %d ranks x %d workers: using %d worker(s) per rank",
                         len(shards.urls), world_size, workers, len(shards.urls) // world_size)
                workers = len(shards.urls) // world_size
        self.workers = workers
        self.num_workers = workers if data_cfg.num_workers > 0 else 0
        if self.resampled:
            per_rank = data_cfg.epoch_samples // world_size
            self.num_samples = data_cfg.epoch_samples
            most = least = per_rank
        else:
            self.num_samples = shards.num_samples
            totals = [sum(shards.counts[i] for i in b)
                      for b in assign(shards.counts, list(range(len(shards.urls))), world_size)]
            most, least = max(totals), min(totals)
        self.batches_per_epoch = math.ceil(most / batch_size)
        if least < self.batches_per_epoch or self.batches_per_epoch == 0:
            raise DataError(
                f"{self.num_samples} samples cannot give {world_size} rank(s) equal batch counts at batch_size "
                f"{batch_size}: the largest rank share ({most}) needs {self.batches_per_epoch} batches but the "
                f"smallest has {least} samples; use more (evenly sized) shards, fewer ranks or a smaller batch")
        if train and rank == 0 and most - least >= batch_size:
            log.warning("mpp.data: the ranks' shares of the training data differ (%d to %d samples a rank): the "
                        "smaller ones' batches shrink to keep the batch count equal, so many steps train on fewer "
                        "samples than batch_size; evenly sized shards, as many as a multiple of ranks x workers, "
                        "avoid it", least, most)
        if train and rank == 0 and most < batch_size:
            log.warning("mpp.data: a rank's batch of %d (batch_size over processes and train.grad_accum) is more "
                        "than the %d training samples a rank holds (after any label_fraction, dev_fraction or "
                        "withheld split): each of its batches holds those %d; lower batch_size, or raise "
                        "data.epoch_samples where the data is resampled", batch_size, most, most)
        self.stream = _ShardStream(
            shards, build_transform(img_size, train, data_cfg), batch_size=batch_size, labeled=labeled,
            max_pixels=data_cfg.max_pixels, shuffle_buffer=data_cfg.shuffle_buffer if train else 0,
            shuffle_bytes=data_cfg.shuffle_mb << 20, resampled=self.resampled, seed=seed, train=train, rank=rank,
            world_size=world_size, workers=workers,
            cache_bytes=data_cfg.cache_mb << 20 if self.num_workers and train else 0)  # persistent workers keep it
        self._skips: dict[str, int] = {}
        if self.num_workers:  # CUDA too: the trainer pins a copy itself (mpp.prefetch), freeing the slot
            self.stream.slots = BatchSlots(self.num_workers, SLOTS_PER_WORKER, (batch_size, img_size, img_size, 3))
        # persistent workers: forked once, not every epoch (a fork costs start-up time and cold caches);
        # own generator: creating the iterator draws a base seed, which must not come from (and
        # shift) the global torch RNG that training draws from, or a resumed run would diverge
        self.timeout = data_cfg.timeout if self.num_workers else 0  # one process: no worker to wait for
        self._dataloader = functools.partial(
            DataLoader, self.stream, batch_size=None, num_workers=self.num_workers,
            timeout=self.timeout,  # a restart's wait (`_worker_items`); each item's is a watch (`_next_item`)
            persistent_workers=self.num_workers > 0, generator=torch.Generator(),
            multiprocessing_context=WORKER_START if self.num_workers else None)
        self._loader = self._dataloader()
        # the workers' running stream, the items it gave ahead of their epoch by worker, and the
        # epoch it continues with (None: the next epoch restarts it)
        self._items, self._held, self._next = None, {}, None
        # the epoch being streamed, weakly: a strong reference would make a cycle through self, and
        # a loader freed by the garbage collector stops its workers only after a 5 s timeout each
        self._current = lambda: None

    def __len__(self) -> int:
        return self.batches_per_epoch

    def close(self) -> None:
        """End the epoch being streamed and stop the workers now (they persist across epochs until
        this, or until the loader is freed); a later `epoch()` starts new ones."""
        self._end_epoch()
        self._loader = self._dataloader()  # the old DataLoader, freed, shuts its workers down
        self._items, self._held, self._next = None, {}, None

    def _end_epoch(self) -> None:
        current = self._current()
        if current is not None:
            current.close()

    def counters(self) -> dict[str, int]:
        """Skipped (and padded/dropped) samples by kind on this rank, cumulative over epochs; the
        batches an `epoch(e, start_batch=k)` replays and discards do not count (a resumed run
        counted them before its checkpoint)."""
        return dict(self._skips)

    def _count(self, kind: str, n: int) -> None:
        if n <= 0:
            return
        if kind not in self._skips:
            log.warning("mpp.data: %s: %s (rank %d); further ones are only counted "
                        "(ShardLoader.counters())", kind, SKIP_KINDS.get(kind, kind), self.rank)
        self._skips[kind] = self._skips.get(kind, 0) + n

    def _next_item(self) -> dict:
        """The next worker item. The wait is cut into watches of up to WATCH_S seconds: one in
        which no worker read anything (`beats` did not move) counts towards data.timeout, one in
        which they did (a worker filling its cache from every shard at its first epoch's end, a
        slow first shuffle buffer) does not; a process suspended meanwhile loses one watch."""
        idle = 0.0
        while True:
            beats = self.stream.beats.value
            try:
                return next(self._items)
            except RuntimeError as e:
                if not _timed_out(e):
                    raise
            idle = 0.0 if self.stream.beats.value != beats else idle + min(self.timeout, WATCH_S)
            if idle >= self.timeout:
                raise _stalled(self.timeout)

    def _worker_items(self, epoch: int, tally: dict[str, int]) -> Iterator[dict]:
        """The rank's worker items of `epoch` in the order a fresh start of the DataLoader gives
        (round robin over the workers, each left out once it ended), whether the workers start
        here (re-iterating the DataLoader restarts its persistent workers' streams, dropping what
        an abandoned epoch left unread) or run on from the epoch read before (`follow`): a resumed
        run reads what an uninterrupted one did. Skip counters are folded into `counters()` and
        this epoch's `tally`; worker errors are raised here."""
        if self._next != epoch:
            self.stream.epoch.value = epoch
            if self._items is not None and self.timeout:  # persistent workers answer a restart once they
                self._items._timeout = self.timeout          # have sent what they were asked for: the whole time
            try:
                self._items, self._held = iter(self._loader), collections.defaultdict(collections.deque)
            except RuntimeError as e:
                if not _timed_out(e):
                    raise
                raise _stalled(self.timeout) from None
            if self.timeout:  # torch's iterator reads it at every wait: watches from here on
                self._items._timeout = min(self.timeout, WATCH_S)
        self._next = None  # until this epoch is read to its end
        slots, seen = self.stream.slots, {}
        active, turn = list(range(self.workers)), 0
        while active:
            worker = active[turn]
            while not self._held[worker]:  # a later epoch's items wait for it
                item = self._next_item()
                self._held[item["worker"]].append(item)
            item = self._held[worker].popleft()
            if item.get("tick"):  # this worker's batches of the epoch are done: its turn passes
                turn = (turn + 1) % len(active)
                continue
            last = seen.get(worker, {})
            for kind, n in item["skips"].items():
                self._count(kind, n - last.get(kind, 0))
                tally[kind] = tally.get(kind, 0) + n - last.get(kind, 0)
            seen[worker] = item["skips"]
            if "error" in item:
                raise DataError(item["error"])
            if item.get("end"):
                active.pop(turn)
                turn = turn if turn < len(active) else 0
                continue
            turn = (turn + 1) % len(active)
            if "slot" in item:
                item["image"] = slots.receive(item.pop("slot"), item.pop("size")).permute(0, 3, 1, 2)
            if "label" in item:
                item["label"] = torch.tensor(item["label"], dtype=torch.long)
            yield item
        self._next = epoch + 1 if self.stream.follow else None

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[dict]:
        """Batches `start_batch`.. of epoch `epoch`: dicts {'image': uint8 (B,3,H,W) (channels-last
        memory format)[, 'label']}."""
        if not 0 <= start_batch <= self.batches_per_epoch:
            raise ValueError(f"start_batch must be in [0, {self.batches_per_epoch}], got {start_batch}")
        if start_batch == self.batches_per_epoch:
            return
        before = dict(self._skips)  # a resumed run counted the replayed batches' skips already
        self._end_epoch()  # the workers are shared: a new epoch ends the one before
        batches = self._rechunk(epoch)
        self._current = weakref.ref(batches)
        for i, batch in enumerate(batches):
            if i >= start_batch:
                yield batch
            elif i == start_batch - 1:
                self._skips = before

    def _rechunk(self, epoch: int) -> Iterator[dict]:
        """Exactly batches_per_epoch batches from the worker stream (see the module docstring).

        Each batch size comes from the plan for what is still expected (the rank's count minus what
        was emitted and what workers reported skipped so far), so skips shrink the tail batches
        instead of leaving the rank short."""
        if self.resampled:
            expected = self.num_samples // self.world_size
        else:
            expected = self.stream.plan(epoch).num_samples
        keys = ("image", "label") if self.stream.labeled else ("image",)
        tally: dict[str, int] = {}
        items = self._worker_items(epoch, tally)
        pieces: list[dict] = []  # pending worker batches (the first possibly partly used)
        have, last, ended, k = 0, None, False, self.batches_per_epoch
        for i in range(k):
            while True:
                # skips shrink what is left to come, but not of an endless (resampled) stream
                left = expected - (0 if self.resampled else sum(tally.get(kind, 0) for kind in SAMPLE_SKIPS))
                size = first_batch(max(left, k - i), k - i, self.batch_size)
                if have >= size or ended:
                    break
                item = next(items, None)
                if item is None:
                    ended = True
                else:
                    pieces.append(item)
                    have += len(item["image"])
            if have < size:  # the stream ended early (lost shard data, inexact counts)
                if have >= k - i:
                    size = first_batch(have, k - i, self.batch_size)
                elif have > 0:
                    size = have  # the leftovers, then (training only) repeats of them
                elif last is None:
                    counted = self.counters()
                    raise DataError(f"rank {self.rank} decoded no samples in epoch {epoch}: all were "
                                    f"skipped ({counted}); check the shards"
                                    + (f", and data.max_pixels={self.stream.max_pixels}: a larger image counts as "
                                       "corrupt_image" if "corrupt_image" in counted else ""))
                elif not self.stream.train:  # an evaluation scores each image once
                    return
                else:
                    self._count("padded", len(last["image"]))
                    if i == k - 1:
                        self._end_counts(items, have)
                    yield last
                    continue
            last = _take(pieces, size, keys)
            have -= size
            expected -= size
            if i == k - 1:
                self._end_counts(items, have)
            yield last

    def _end_counts(self, items: Iterator[dict], have: int) -> None:
        """Before an epoch's last batch goes out: the workers' final counters read and any surplus
        samples counted (`dropped`), so a checkpoint taken at the epoch's end holds them; after it,
        a run resumed there would never count them (it starts at the next epoch)."""
        if not self.resampled:
            self._count("dropped", have + sum(len(item["image"]) for item in items))


def first_batch(n: int, k: int, batch_size: int) -> int:
    """The size of the next of k batches (each <= batch_size) that n samples fill (k <= n <=
    k * batch_size): full batches first, the remainder spread evenly over the last ones, so the
    epoch's k batches are always met and none is empty."""
    return batch_size if n - k >= batch_size - 1 else -(-n // k)


def _take(pieces: list[dict], n: int, keys) -> dict:
    """The next n samples from the pending pieces; a piece of exactly n is passed through."""
    if len(pieces[0]["image"]) == n:
        whole = pieces.pop(0)
        return {k: whole[k] for k in keys}
    parts, got = [], 0
    while got < n:
        p = pieces[0]
        m = min(len(p["image"]), n - got)
        parts.append({k: p[k][:m] for k in keys})
        if m == len(p["image"]):
            pieces.pop(0)
        else:
            pieces[0] = {k: p[k][m:] for k in keys}
        got += m
    return {k: torch.cat([p[k] for p in parts]) for k in keys}


WATCH_S = 60  # the longest single wait for a worker item (see ShardLoader._next_item)


def _timed_out(e: RuntimeError) -> bool:
    """Whether torch's DataLoader gave up waiting for a worker item (its `timeout`)."""
    return str(e).startswith("DataLoader timed out")


def _stalled(seconds: float) -> DataError:
    return DataError(f"the data workers read nothing and gave no batch in data.timeout={seconds:g} s: a shard read "
                     "stalls (a hung network mount or stream, a pipe that never ends); check the storage of the "
                     "shards, or raise data.timeout")


def make_loader(spec, *, batch_size: int, img_size: int, train: bool, labeled: bool, data_cfg=None,
                seed: int = 0, rank: int | None = None, world_size: int | None = None,
                num_samples: int = 0, subset: tuple | None = None, withhold=()) -> ShardLoader:
    """A ShardLoader over `spec` (manifest.json, shard list/URLs, or brace pattern + num_samples).

    batch_size is per rank. rank/world_size default to torch.distributed's when it is initialised
    (else 0/1). train: augmentation + shuffling; else evaluation crop, shard order, every sample
    once. labeled: batches carry 'label' (unlabeled shards are an error). subset=(fraction, seed):
    a class-balanced seeded subset of a labeled set; (fraction, seed, dev_fraction, dev): its
    development split (dev true) or the rest (see `select_subset`). withhold: (fraction, seed,
    dev_fraction) triples whose development splits are left out (see `withhold_splits`). data_cfg: a `DataConfig` (workers, shuffle
    buffer, augmentation, resampling, pixel cap; None: its defaults).
    """
    data_cfg = data_cfg if data_cfg is not None else DataConfig()
    if rank is None or world_size is None:
        dist = torch.distributed.is_available() and torch.distributed.is_initialized()
        rank = (torch.distributed.get_rank() if dist else 0) if rank is None else rank
        world_size = (torch.distributed.get_world_size() if dist else 1) if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    if batch_size < 1 or img_size < 1:
        raise ValueError(f"batch_size and img_size must be >= 1, got {batch_size} and {img_size}")
    shards = select_shards(spec, num_samples, labeled, subset, withhold, repeats=train and data_cfg.resampled)
    return ShardLoader(shards, batch_size=batch_size, img_size=img_size, train=train, labeled=labeled,
                       data_cfg=data_cfg, seed=seed, rank=rank, world_size=world_size)


def select_shards(spec, num_samples: int = 0, labeled: bool = False, subset: tuple | None = None,
                  withhold=(), repeats: bool = False) -> ShardSet:
    """The shards and samples a loader over `spec` reads (`make_loader`'s arguments of the same
    names): resolved, each shard once (`repeats`: a resampled stream may repeat one), labeled where
    asked, restricted to a label subset or with withheld development splits left out. DataError
    where they cannot be."""
    shards = resolve(spec, num_samples)
    if not repeats:
        check_distinct(spec, shards)
    if labeled and shards.exact and not shards.classes:
        raise DataError(f"data {spec!r} has no 'classes' in its manifest, but a labeled loader was asked "
                        "for: these shards look unlabeled; use labeled shards or an unlabeled objective (mpp)")
    if subset is not None and (subset[0] != 1 or len(subset) > 2 and subset[2] > 0):
        shards = select_subset(shards, *subset)  # (all labels and no dev split need no label pass)
    if withhold:
        if subset is not None:
            raise ValueError("a loader takes a label subset or withheld development splits, not both")
        shards = withhold_splits(shards, withhold)
    return shards
