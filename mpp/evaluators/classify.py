"""Top-1 / top-5 of a classifier (a classify Task: uint8 images -> logits) on `data.val`, or with
`finetune.dev_fraction` > 0 on the development split held out of the training labels
(`evaluated_on` says which). Every rank evaluates its own part; the counts are summed over ranks.
Each evaluation also records which images it got right (mpp.outcomes), gathered in rank order,
so the gap report can show the noise of the test images and of the choice made on the development split,
and the images it could not score (`val_skipped_samples`, by kind: each image is scored once at most).
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from accelerate import PartialState
from accelerate.utils import gather_object, reduce
from timm.utils import accuracy
from tqdm.auto import tqdm

from mpp import outcomes
from mpp.config import Config, ConfigError
from mpp.data import make_loader
from mpp.data.sources import check_same_classes, resolve
from mpp.evaluators.features import encoder_img_size
from mpp.runtime import autocast


class Evaluator:
    """Built before training, so a missing or mismatched `data.val` fails before any step. Each
    process scores its own share of the images (none where it has no shard), gathered at the end."""

    def __init__(self, cfg: Config, device: torch.device | str):
        if not cfg.data.val:
            raise ConfigError("objective=classify evaluates on held-out labeled shards; set data.val")
        resolve(cfg.data.val, cfg.data.val_num_samples)  # it exists, a shard list or pattern has its count
        check_same_classes(cfg.data.train, cfg.data.val, cfg.data.val_num_samples)
        self.cfg, self.device = cfg, torch.device(device)

    @torch.no_grad()
    def run(self, classifier) -> dict:
        cfg, f, device = self.cfg, self.cfg.finetune, self.device
        state = PartialState()
        dev = f.dev_fraction > 0
        spec, num_samples = (cfg.data.train, cfg.data.num_samples) if dev else (cfg.data.val, cfg.data.val_num_samples)
        loader = make_loader(spec, batch_size=cfg.batch_size // (state.num_processes * cfg.train.grad_accum),
                             img_size=encoder_img_size(classifier.encoder), train=False,
                             labeled=True, data_cfg=cfg.data, rank=state.process_index,
                             world_size=state.num_processes, num_samples=num_samples,
                             subset=(f.label_fraction, f.split_seed, f.dev_fraction, True) if dev else None)
        top5_hits = torch.zeros((), device=device)  # top-1 and the count come from the per-image hits
        hits, seen = [], []  # per image: top-1 right, label (on the device until the end)
        classifier.eval()
        bar = tqdm(loader.epoch(0), total=loader.batches_per_epoch, desc="evaluate",
                   disable=not state.is_main_process, dynamic_ncols=True)
        with autocast(device, cfg.train.precision):
            for batch in bar:
                labels = batch["label"].to(device, non_blocking=True)
                logits = classifier.logits(batch["image"].to(device, non_blocking=True))
                top5_hits += accuracy(logits, labels, topk=(5,))[0] * len(labels) / 100
                hits.append(logits.argmax(-1).eq(labels))
                seen.append(labels)
        top5 = reduce(top5_hits.round(), "sum").item()
        # every rank takes part in the gather, also one that had no batch
        mine = [torch.cat(x).cpu().numpy() if x else np.zeros(0, np.int64) for x in (hits, seen)]
        ranks = gather_object([(mine, loader.counters())])  # rank order
        correct, labels = (np.concatenate(p) for p in zip(*(m for m, _ in ranks)))
        skipped = sum((Counter(counts) for _, counts in ranks), Counter())  # images it could not score, by kind
        n = len(correct)
        return {"top1": float(correct.sum()) / max(n, 1), "top5": top5 / max(n, 1), "val_samples": n,
                "val_skipped_samples": dict(skipped), "evaluated_on": "dev" if dev else "val",
                "outcomes": outcomes.record(correct, labels)}
