"""Sharded, distributed, exactly-sized batch streams: `make_loader(...) -> ShardLoader`.

The DataLoader workers persist across epochs (forked once per loader, stopped by
`ShardLoader.close()` or when the loader is freed); the loader tells them the epoch to start at
through shared memory, and a training stream that is not resampled runs on into the next epochs,
so the DataLoader's prefetch holds the next epoch's first batches before the step asks for them
(no stall at every epoch start of a small set read many times).
Each worker streams batches of its share of an epoch's shards (mpp.data.stream: the epoch's plan,
shard reading, the shuffle, decoding into shared-memory slots) with its skip counters; then
the main process re-chunks the worker stream into exactly K batches, K the same on every rank
(K = ceil(largest rank bin total / batch_size), fixed for all epochs): full batches first, the
tail ones smaller; each size is planned from what the rank still expects (its count minus what
was emitted and what workers reported skipped), so per-sample skips shrink the tail batches. A
worker batch that already has the planned size is passed through untouched. If a rank still
runs dry (a truncated or unreadable shard, counts that were only estimated), its last batch is
repeated (counted as `padded`); a surplus beyond its count is `dropped`. So no rank ever waits
for another at an epoch end. An evaluation loader (`train=False`) is held to none of this, as
no step of it waits for another rank: each rank reads its own share whole, in its own number of
batches (none where it has no shard), a surplus over an inexact count included, and repeats
nothing, since a repeat would score its images twice: a rank that runs short ends short, its
skips counted, and its evaluator scores the images it read.
In resampled mode the epoch ends after K batches of the fixed `data.epoch_samples / world_size`
samples per rank.
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
import logging
import math
import sys
import weakref
from typing import Iterator

import torch
from torch.utils.data import DataLoader

from mpp.config import DataConfig
from mpp.data.decode import SAMPLE_SKIPS, SKIP_KINDS, DataError
from mpp.data.slots import BatchSlots
from mpp.data.sources import ShardSet, assign, check_distinct, resolve
from mpp.data.stream import ShardStream
from mpp.data.subset import select_subset, withhold_splits
from mpp.data.transforms import build_transform

log = logging.getLogger(__name__)

# workers are forked where the platform allows it, whatever the process's default start method (a
# stage of tools/compare.py inherits 'forkserver', and Python 3.14 makes it the default on Linux):
# a forked worker inherits the imported modules and the batch slots' mapping, while one started
# from a server imports torch again and sends every batch through a fresh shared-memory segment
WORKER_START = "fork" if sys.platform == "linux" else None

# batch slots per worker: DataLoader's 2 prefetched batches, 1 being filled, and up to 4 held by the
# consumer (the trainer's prefetcher off CUDA: the step's batch, 2 queued, 1 being staged; on CUDA
# it keeps pinned copies and frees the slots at once); with train.grad_accum the step holds all its
# micro-batches, and a batch that finds no free slot travels the usual way (`slots.BatchSlots`).
# Slots take memory only once written to.
SLOTS_PER_WORKER = 7


@functools.cache
def _warn_unwatched() -> None:
    """Once a process: data.timeout asked of a loader with no worker to watch."""
    log.warning("warning: data.timeout needs data.num_workers >= 1: with num_workers=0 the shards are read in this "
                "process, and a shard read that stalls (a hung mount or stream) waits forever; set "
                "data.num_workers >= 1, or data.timeout=0 to say so")


class ShardLoader:
    """Exactly `batches_per_epoch` batches per epoch on every rank; an evaluation's rank reads its
    own share whole, in as many batches as it holds (more than planned where a count was an
    estimate); see the module docstring."""

    def __init__(self, shards: ShardSet, *, batch_size: int, img_size: int, train: bool,
                 labeled: bool, data_cfg, seed: int, rank: int, world_size: int):
        self.shards, self.classes = shards, shards.classes
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        self.resampled = bool(train and data_cfg.resampled)
        workers = max(1, data_cfg.num_workers)
        if not self.resampled:
            if train and len(shards.urls) < world_size:  # an evaluation's rank without a shard scores nothing
                raise DataError(
                    f"{len(shards.urls)} shard(s) cannot feed {world_size} ranks: need at least "
                    f"{world_size * workers} shards ({world_size} ranks x {workers} workers, {world_size} at "
                    "the very least); rewrite the data with more, smaller shards "
                    "(tools/make_shards.py --samples-per-shard)")
            if len(shards.urls) < world_size * workers:  # documented fallback: fewer workers
                workers = max(1, len(shards.urls) // world_size)
                log.info("mpp.data: %d shards for %d ranks x %d workers: using %d worker(s) per rank",
                         len(shards.urls), world_size, data_cfg.num_workers, workers)
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
        if train and (least < self.batches_per_epoch or self.batches_per_epoch == 0):
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
        self.stream = ShardStream(
            shards, build_transform(img_size, train, data_cfg), batch_size=batch_size, labeled=labeled,
            max_pixels=data_cfg.max_pixels, shuffle_buffer=data_cfg.shuffle_buffer if train else 0,
            shuffle_bytes=data_cfg.shuffle_mb << 20, resampled=self.resampled, seed=seed, train=train, rank=rank,
            world_size=world_size, workers=workers,
            cache_bytes=data_cfg.cache_mb << 20 if self.num_workers and train else 0)  # persistent workers keep it
        if not train:  # no step waits for another rank: each reads its own share whole (one batch at least
            own = self.stream.plan(0)  # where its shards' count is an estimate of 0)
            self.batches_per_epoch = max(math.ceil(own.num_samples / batch_size), any(own.bins))
        self._skips: dict[str, int] = {}
        if self.num_workers:  # CUDA too: the trainer pins a copy itself (mpp.prefetch), freeing the slot
            try:  # address space only, until written to; but a huge batch_size cannot have even that
                self.stream.slots = BatchSlots(self.num_workers, SLOTS_PER_WORKER, (batch_size, img_size, img_size, 3))
            except (OSError, OverflowError) as e:
                raise DataError(f"the data workers' batch buffers ({self.num_workers} x {SLOTS_PER_WORKER} batches of "
                                f"{batch_size} images of {img_size} px a rank) cannot be mapped ({e}); lower batch_size "
                                "or data.num_workers") from None
        # persistent workers: forked once, not every epoch (a fork costs start-up time and cold caches);
        # own generator: creating the iterator draws a base seed, which must not come from (and
        # shift) the global torch RNG that training draws from, or a resumed run would diverge
        self.timeout = data_cfg.timeout if self.num_workers else 0  # one process: no worker to wait for
        if data_cfg.timeout and not self.num_workers:
            _warn_unwatched()
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
        owed = dict.fromkeys(active, 0)  # turns each worker still passes (its ticks: its batches are done)
        while active:
            if all(owed[w] for w in active):  # every worker pads: as many whole rounds as they all have
                least = min(owed[w] for w in active)
                owed.update((w, owed[w] - least) for w in active)
                continue
            worker = active[turn]
            if owed[worker]:
                owed[worker] -= 1
                turn = (turn + 1) % len(active)
                continue
            while not self._held[worker]:  # a later epoch's items wait for it
                item = self._next_item()
                self._held[item["worker"]].append(item)
            item = self._held[worker].popleft()
            if "ticks" in item:  # this worker's batches of the epoch are done: its turn passes that often
                owed[worker] = item["ticks"]
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
            if i == k - 1 and not self.stream.train:  # scores every image read, also past an inexact count
                yield last
                for item in items:
                    pieces.append(item)
                    have += len(item["image"])
                while have:
                    last = _take(pieces, min(have, self.batch_size), keys)
                    have -= len(last["image"])
                    yield last
                return
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


# the longest single wait for a worker item (see ShardLoader._next_item); torch looks for workers
# that ended only when a wait ends, so it is also how long a reader waits on a worker that Ctrl-C
# ended (the terminal's SIGINT reaches the workers too): at 60 s a run waiting for data took a
# minute to stop
WATCH_S = 1


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
    if not shards.urls or shards.num_samples == 0:
        raise DataError(f"data {spec!r} holds no samples (its manifest lists {len(shards.urls)} shards of "
                        f"{shards.num_samples} samples); give shards with images (tools/make_shards.py)")
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
