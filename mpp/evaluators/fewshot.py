"""Few-shot accuracy as big_vision's `fewshot_lsr` evaluator: standardised features with a constant
bias column, closed-form ridge regression onto {-1, 1} one-hot targets, k shots per class, several
seeds. `Evaluator` is the same figure during pre-training (`fewshot.every`), without touching the RNG.
"""
from __future__ import annotations

import contextlib
import warnings
from collections import Counter

import numpy as np
import torch
import torch.nn.functional as F

from mpp import outcomes
from mpp.checkpoint import rng_state, set_rng_state
from mpp.config import Config
from mpp.data import make_loader
from mpp.data.sources import check_same_classes, class_count, resolve, warn_shared
from mpp.evaluators.features import (candidate_pools, encode_images, encoder_img_size, eval_batch_size, eval_mode,
                                     standardize)
from mpp.runtime import resolve_precision

BIAS_CONSTANT = 100.0  # big_vision: a large constant bias feature is almost unregularised


def _with_bias(x: torch.Tensor) -> torch.Tensor:
    return F.pad(x, (0, 1), value=BIAS_CONSTANT)


def fewshot_lstsq(x: torch.Tensor, y: torch.Tensor, num_classes: int, l2: float) -> torch.Tensor:
    """Ridge regression weights (D + 1, C) of bias-augmented features `x` onto {-1, 1} one-hot `y`.

    `x` is (N, D + 1) with the bias column already appended; solves min ||x W - Y||^2 + l2 ||W||^2
    in closed form through the smaller of the two Gram matrices (N >= D: primal, else dual).
    """
    x = x.double()
    t = 2.0 * F.one_hot(y.long(), num_classes).double() - 1.0
    n, d = x.shape
    if n >= d:
        return torch.linalg.solve(x.T @ x + l2 * torch.eye(d, dtype=x.dtype), x.T @ t)
    return x.T @ torch.linalg.solve(x @ x.T + l2 * torch.eye(n, dtype=x.dtype), t)


def fewshot_correct(train_x, train_y, test_x, test_y, num_classes: int, l2: float) -> np.ndarray:
    """Which test samples the few-shot least-squares classifier fitted on (train_x, train_y) gets right."""
    tr, te = standardize(train_x.double(), test_x.double())
    w = fewshot_lstsq(_with_bias(tr), train_y, num_classes, l2)
    return (_with_bias(te) @ w).argmax(1).eq(test_y).numpy()


def fewshot_eval(train_x, train_y, test_x, test_y, *, shots, seeds: int, l2: float,
                 num_classes: int | None = None, draws: bool = False) -> dict:
    """`{k}shot_mean` / `{k}shot_std` accuracy over `seeds` draws of k training samples per class
    (sample std; None for one draw).

    As big_vision: seed s permutes each class's indices with numpy's default_rng(s), the k shots
    are the first k of that permutation (nested across k); a class with fewer than k samples
    contributes all it has, with a warning naming it. Uses only its own generators. With `draws`,
    also each draw's accuracy (`{k}shot_draws`) and test outcomes (`{k}shot_outcomes`,
    mpp.outcomes records), and the digest of the training labels the draws came from
    (`fewshot_train_labels`): two encoders' figures with equal digests used the same shots draw by
    draw, so the report pairs them.
    """
    train_y, test_y = train_y.long(), test_y.long()
    if num_classes is None:
        num_classes = int(train_y.max()) + 1
    labels = train_y.numpy()
    correct: dict[int, list[np.ndarray]] = {int(k): [] for k in shots}
    counts = np.bincount(labels, minlength=num_classes)
    if short := {c: int(counts[c]) for c in range(num_classes) if counts[c] < max(correct)}:
        named = ", ".join(f"{c}: {n}" for c, n in list(short.items())[:10]) + (", ..." if len(short) > 10 else "")
        warnings.warn(f"few-shot: {len(short)} of {num_classes} classes have fewer training images than "
                      f"{max(correct)} shots (class: images {named}); their k-shot figures take what they have",
                      stacklevel=2)
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        perms = [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]
        for k in correct:
            idx = torch.from_numpy(np.concatenate([p[:k] for p in perms]))
            correct[k].append(fewshot_correct(train_x[idx], train_y[idx], test_x, test_y, num_classes, l2))
    out: dict = {"fewshot_train_labels": outcomes.labels_digest(labels)} if draws else {}
    for k, c in correct.items():
        a = [float(x.mean()) for x in c]
        out[f"{k}shot_mean"] = float(np.mean(a))
        out[f"{k}shot_std"] = float(np.std(a, ddof=1)) if len(a) > 1 else None  # one draw shows no spread
        if draws:
            out[f"{k}shot_draws"] = a
            out[f"{k}shot_outcomes"] = [outcomes.record(x, test_y.numpy()) for x in c]
    return out


@contextlib.contextmanager
def preserved_rng():
    """Every global RNG (mpp.checkpoint.rng_state) is restored on exit, so whatever runs inside
    (DataLoader seeding) leaves training as is."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


def _read_images(spec, num_samples: int, *, cfg: Config, img_size: int, limit) -> tuple[torch.Tensor, torch.Tensor,
                                                                                      dict]:
    """All images (uint8, eval transform) and labels of labeled shards, in memory, and the samples
    skipped by kind. `limit(n, classes)` gives the most samples to keep; beyond it a class-balanced
    seeded subset is read instead."""
    kw = dict(batch_size=eval_batch_size(cfg), img_size=img_size, train=False, labeled=True, data_cfg=cfg.data,
              num_samples=num_samples, rank=0, world_size=1)
    loader = make_loader(spec, **kw)
    cap = limit(loader.num_samples, loader.classes)
    if cap and loader.num_samples > cap:
        loader = make_loader(spec, subset=(cap / loader.num_samples, cfg.seed), **kw)
    batches = list(loader.epoch(0))
    return (torch.cat([b["image"] for b in batches]), torch.cat([b["label"] for b in batches]).long(),
            loader.counters())


class Evaluator:
    """Few-shot accuracy of an encoder during pre-training (`fewshot.every` steps; the paper chose
    among MPP variants by it). The small labeled sets `fewshot.train` / `fewshot.test` are checked
    at construction, labeled and with the same classes (else they would fail, or score labels
    that mean nothing, only once training began), and decoded once, at the first call and the
    encoder's resolution, into memory (uint8): the test set capped at `fewshot.max_test` images
    and the shot pool at `max(shots) * seeds` images a class on average, both seeded subsets of
    one fraction of every class (on an unbalanced set a small class gets fewer, and its draws
    warn when they run short). Each call puts the encoder in eval mode (restored after), runs it
    without grad under autocast and solves the few-shot problems with fixed seeds; the global RNGs
    are left exactly as they were.

    Call it on the main process with the unwrapped encoder; returns {"{k}shot_mean", "{k}shot_std"},
    under `probe.pool=auto` for every candidate representation ({"token/{k}shot_mean", ...}: no
    choice is made here, the few-shot test images are for watching, not for choosing), and the
    samples of the two sets skipped, by kind ({"skipped_corrupt_image": n, ...}; they were only
    logged once, never recorded).
    """

    def __init__(self, cfg: Config, device: torch.device | str):
        fs = cfg.fewshot
        resolve(fs.train, fs.train_num_samples, "fewshot.train_num_samples")  # bad specs fail now
        test = resolve(fs.test, fs.test_num_samples, "fewshot.test_num_samples")
        check_same_classes(fs.train, fs.test, fs.test_num_samples, names=("fewshot.train", "fewshot.test"))
        if cfg.data.train:  # the encoder watched learns from data.train, with or without its labels
            warn_shared(resolve(cfg.data.train, cfg.data.num_samples or 1), test, ("data.train", "fewshot.test"))
        self.cfg, self.device = cfg, torch.device(device)
        # img_size -> (train images, labels, test images, labels, the samples of both sets skipped by kind)
        self._data: dict[int, tuple] = {}

    def _load(self, img_size: int) -> tuple:
        fs = self.cfg.fewshot
        per_class = max(int(k) for k in fs.shots) * fs.seeds
        *train, skipped = _read_images(fs.train, fs.train_num_samples, cfg=self.cfg, img_size=img_size,
                                       limit=lambda n, classes: per_class * len(classes) if classes else 0)
        *test, test_skipped = _read_images(fs.test, fs.test_num_samples, cfg=self.cfg, img_size=img_size,
                                           limit=lambda n, classes: fs.max_test)
        return self._data.setdefault(img_size, (*train, *test, dict(Counter(skipped) + Counter(test_skipped))))

    def _features(self, encoder, images: torch.Tensor, pools: tuple[str, ...]) -> dict[str, torch.Tensor]:
        bs = eval_batch_size(self.cfg)
        parts = [encode_images(encoder, images[i:i + bs], cfg=self.cfg, pools=pools, device=self.device,
                               precision=self.cfg.train.precision) for i in range(0, len(images), bs)]
        return {p: torch.cat([f[p] for f in parts]) for p in pools}

    def run(self, encoder) -> dict[str, float]:
        fs = self.cfg.fewshot
        img_size = encoder_img_size(encoder)
        with preserved_rng():
            tr_x, tr_y, te_x, te_y, skipped = self._data.get(img_size) or self._load(img_size)
            pools = candidate_pools(self.cfg.probe.pool)
            with eval_mode(encoder):
                tr_f, te_f = self._features(encoder, tr_x, pools), self._features(encoder, te_x, pools)
        out, classes = {}, class_count(fs.train, fs.train_num_samples, tr_y)
        for p in pools:
            if not (torch.isfinite(tr_f[p]).all() and torch.isfinite(te_f[p]).all()):  # an overflow, or divergence:
                # NaN on the watch, not the chance-level figures a NaN solve gives (its argmax says class 0)
                warnings.warn(f"few-shot: the encoder's {p} features are NaN or infinite (precision "
                              f"{resolve_precision(self.cfg.train.precision, self.device.type)}): its figures are "
                              "NaN", stacklevel=2)
                figures = {f"{int(k)}shot_{s}": float("nan") for k in fs.shots for s in ("mean", "std")}
            else:
                figures = fewshot_eval(tr_f[p], tr_y, te_f[p], te_y, shots=fs.shots, seeds=fs.seeds, l2=fs.l2,
                                       num_classes=classes)
            out.update({(f"{p}/{k}" if len(pools) > 1 else k): v for k, v in figures.items()})
        return out | {f"skipped_{kind}": n for kind, n in skipped.items()}
