"""Linear probe: multinomial logistic regression on frozen features, its representation and L2
strength chosen jointly on held-out training features (MPP's loss never reaches the [class]
token, so which representation carries an encoder's knowledge differs per encoder and must not be
fixed, nor chosen on test). `Evaluator` adds the few-shot figures of the same representation;
`run_linear_probe` is the probe tool's whole job (tools/linear_probe.py).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
import yaml
from accelerate.utils import set_seed
from safetensors import safe_open
from safetensors.torch import save_file
from timm.utils import accuracy
from tqdm.auto import tqdm

from mpp import outcomes, rundir
from mpp.config import Config, ConfigError, ProbeConfig, read_yaml, save_config, to_dict
from mpp.data import DataError
from mpp.data.sources import check_same_classes, class_count
from mpp.evaluators.features import (candidate_pools, encoder_img_size, extract_features, feature_cache_dir,
                                     feature_cache_key, feature_stats, read_cached)
from mpp.evaluators.fewshot import fewshot_eval
from mpp.fileio import atomic_path, sweep_orphans, write_atomic
from mpp.models import POOLS, encoder_digest, encoder_from, nonfinite, trained_img_size
from mpp.runtime import deterministic, resolve_precision

def _fit_logistic(x, y, num_classes: int, l2: float, init=None, max_iter: int = 2000) -> torch.Tensor:
    """Weights (D + 1, C) of L2-regularised multinomial logistic regression (bias unregularised),
    fitted full-batch with L-BFGS from `init` (warm start) or zeros, to convergence: L-BFGS stops
    when the loss or the gradient stops changing, `max_iter` only caps a fit that never does (the
    weak-L2 fits of ViT features need a few hundred iterations; a refit from zeros stopped short
    would differ from the fit its L2 was chosen with). The gradient is written out ((softmax -
    onehot)^T x / N) rather than autograd's, and the work is class-major (C, N): with C ~ 10 as the
    outer dimension the matmuls run faster at a few thousand samples and no slower at tens of
    thousands (measured: docs/benchmarks.md)."""
    w = (torch.zeros(num_classes, x.shape[1] + 1) if init is None
         else init.T.clone(memory_format=torch.contiguous_format))
    w.requires_grad_(True)  # (C, D + 1), the transpose of what is returned
    xt, onehot_t = x.T.contiguous(), F.one_hot(y, num_classes).T.float()
    opt = torch.optim.LBFGS([w], lr=1.0, max_iter=max_iter, history_size=20, tolerance_grad=1e-6,
                            tolerance_change=1e-9, line_search_fn="strong_wolfe")

    @torch.no_grad()
    def closure():
        logits_t = torch.addmm(w[:, -1:], w[:, :-1], xt)  # (C, N)
        logp_t = logits_t.log_softmax(0)
        loss = -(logp_t * onehot_t).sum() / len(y) + 0.5 * l2 * w[:, :-1].pow(2).sum()
        g_t = (logp_t.exp() - onehot_t) / len(y)
        w.grad = torch.cat([g_t @ x + l2 * w[:, :-1], g_t.sum(1, keepdim=True)], dim=1)
        return loss

    opt.step(closure)
    return w.detach().T.contiguous()


def _topk(logits: torch.Tensor, y: torch.Tensor, k: int) -> float:
    """Top-k accuracy as a fraction (timm's `accuracy` gives percent)."""
    return accuracy(logits, y, topk=(k,))[0].item() / 100


def _fold(w: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights (D + 1, C) of a fit on features standardised by (mean, std) as a head on raw
    features: weight (C, D) and bias (C,) with x @ weight.T + bias the same logits."""
    scaled = w[:-1] / std.T  # (D, C)
    return scaled.T.contiguous(), w[-1] - (mean @ scaled)[0]


def _unfold(weight: torch.Tensor, bias: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """The inverse of `_fold`: a head on raw features as the weights (D + 1, C) of a fit on
    features standardised by (mean, std)."""
    return torch.cat([(weight * std).T, (bias + (weight @ mean.T)[:, 0])[None]])


def fit_linear_head(x: torch.Tensor, y: torch.Tensor, num_classes: int, l2: float,
                    init: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight (C, D) and bias (C,) of the logistic fit on features `x` standardised with their own
    statistics, the standardisation folded in: logits = x @ weight.T + bias on raw features, so
    the pair can also be the weights of an nn.Linear head (finetune.head_init=probe). `init`, a
    head of the same form (`choose_probe`'s), starts the fit where that head's logits are: the
    optimum is the same, but a weak-L2 fit from zeros needs hundreds of iterations more."""
    x = x.float()
    mean, std = feature_stats(x)
    start = None if init is None else _unfold(*init, mean, std)
    return _fold(_fit_logistic((x - mean) / std, y.long(), num_classes, l2, init=start), mean, std)


class ProbeChoice(NamedTuple):
    """What `choose_probe` found: the representation and L2 strength with the best validation top-1,
    every pair's score there ({representation: {L2: top-1}}), that pair's fitted head (weight
    (C, D), bias (C,) on raw features; with folds, the last fold's), the warm start of the refit on
    all the features, and each
    representation's validation outcomes at its best L2 ({representation: mpp.outcomes record}),
    from which a report can tell how sure the choice of representation was. `head_l2s` holds each
    representation's L2 for a fine-tune's starting head (see `choose_probe`); `head_l2` (the chosen
    representation's), its `start_head` and `losses` ({L2: (validation cross-entropy, its standard
    error)} of the chosen representation) are that choice for the chosen one. `on`
    names the validation images: `dev` (a development split), `heldout` (a held-out part of the
    training features) or `cv` (every labeled image, in folds)."""
    pool: str
    l2: float
    scores: dict
    head: tuple[torch.Tensor, torch.Tensor]
    outcomes: dict
    start_head: tuple[torch.Tensor, torch.Tensor]
    losses: dict
    on: str
    head_l2s: dict

    @property
    def head_l2(self) -> float:
        return self.head_l2s[self.pool]


def fold_parts(n: int, folds: int, seed: int) -> list[torch.Tensor]:
    """The row indices of each of `folds` seeded folds of `n` rows, in the order `choose_probe`
    validates them (its training features' rows, then its development split's)."""
    return list(torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tensor_split(folds))


def _splits(train_x: dict, train_y: torch.Tensor, val_fraction: float, seed: int, dev, folds: int):
    """The (fit features, fit labels, validation features, validation labels) that `choose_probe`
    scores, one at a time: one split (`dev`, else a held-out part of the training features), or
    with `folds` k seeded folds of all the labeled images (training and `dev` together), each
    validated once."""
    if folds:
        x = train_x if dev is None else {n: torch.cat([v, dev[0][n]]) for n, v in train_x.items()}
        y = train_y if dev is None else torch.cat([train_y, dev[1].long()])
        if len(y) < folds:
            raise DataError(f"finetune.pool_folds={folds} needs at least {folds} labeled samples, got {len(y)}")
        parts = fold_parts(len(y), folds, seed)
        for i, p in enumerate(parts):
            r = torch.cat([q for j, q in enumerate(parts) if j != i])
            yield {n: v[r] for n, v in x.items()}, y[r], {n: v[p] for n, v in x.items()}, y[p]
    elif dev is not None:
        yield train_x, train_y, dev[0], dev[1].long()
    else:
        perm = torch.randperm(len(train_y), generator=torch.Generator().manual_seed(seed))
        n_val = max(1, int(round(val_fraction * len(train_y))))
        if len(train_y) - n_val < 1:
            raise DataError(f"linear probe needs at least 2 training samples, got {len(train_y)}")
        yield ({n: x[perm[n_val:]] for n, x in train_x.items()}, train_y[perm[n_val:]],
               {n: x[perm[:n_val]] for n, x in train_x.items()}, train_y[perm[:n_val]])


def choose_probe(train_x: dict[str, torch.Tensor], train_y: torch.Tensor, *, num_classes: int,
                 val_fraction: float = 0.1, l2_grid=ProbeConfig.l2_grid, seed: int = 0,
                 dev: tuple[dict[str, torch.Tensor], torch.Tensor] | None = None, folds: int = 0) -> ProbeChoice:
    """Every (representation, L2) pair of {representation: features (N, D)} fitted and scored on
    validation images; the best wins (ties: the stronger L2, then the earlier representation).

    The validation images are `dev` ({representation: features}, labels) where given, a development
    split the fits never saw, and every pair is then fitted on all of `train_x`; else a held-out
    part (val_fraction, one seeded random split) of `train_x`, fitted on the rest. A supervised
    pre-training has fitted the labels of the training features (all of them but the withheld
    development splits), so a held-out part of them flatters what it memorised, in the
    representation and in the L2 alike: a comparison gives every probe a development split.
    With `folds` >= 2 they are every image of `train_x` and `dev` together, in k seeded folds, each
    scored by the fits on the others (`on` cv): a 10% development split of a 10% label subset is
    500 CIFAR images, on which two representations a few points apart swap places (docs/results.md),
    and all the labels are ten times that. Only for an encoder that never fitted these labels.

    A fine-tune's starting head (LP-FT) takes its L2 by another rule, on the chosen representation:
    the strongest whose validation cross-entropy is within one standard error of the lowest (the
    one-standard-error rule). Top-1 is flat over weak L2s where features say little, and for a
    random-init encoder it picked large heads whose gradients, clipped at 1, starved the
    encoder (docs/evaluation.md). Where no L2's validation loss beats a uniform guess's (log C) by
    its standard error, as on a few dozen validation images, the strongest would be a head near
    zero; the start then takes, of the L2s within that standard error, the best validation top-1."""
    train_y, grid = train_y.long(), sorted(set(l2_grid), reverse=True)  # strong to weak: each fit warm-starts the next
    fits: dict[tuple[str, float], torch.Tensor] = {}
    stats, right, ces, val_ys = {}, {}, {}, []
    # a fit takes seconds to minutes on a CPU (hundreds of L-BFGS iterations): shown, as the features are
    bar = tqdm(total=max(folds, 1) * len(train_x) * len(grid), desc="probe fits", unit="fit", leave=False)
    for fit_x, fit_y, val_x, val_y in _splits(train_x, train_y, val_fraction, seed, dev, folds):
        val_ys.append(val_y)
        for name, x in fit_x.items():
            fx, vx = x.float(), val_x[name].float()
            stats[name] = mean, std = feature_stats(fx)
            fx, vx, w = (fx - mean) / std, (vx - mean) / std, None
            for l2 in grid:
                w = fits[name, l2] = _fit_logistic(fx, fit_y, num_classes, l2, init=w)
                bar.update()
                logits = vx @ w[:-1] + w[-1]
                right.setdefault((name, l2), []).append(logits.topk(1, dim=1).indices[:, 0].eq(val_y))
                ces.setdefault((name, l2), []).append(F.cross_entropy(logits, val_y, reduction="none"))
    bar.close()
    val_y = torch.cat(val_ys)  # every validated image once, in the order of the hits and losses
    hits = {k: torch.cat(v) for k, v in right.items()}
    scores = {n: {l2: hits[n, l2].float().mean().item() for l2 in grid} for n in train_x}
    losses = {n: {l2: ((ce := torch.cat(ces[n, l2])).mean().item(), ce.std().item() / len(ce) ** 0.5
                       if len(ce) > 1 else 0.0) for l2 in grid} for n in train_x}
    order = list(train_x)
    rep, best = max(((n, l2) for n in order for l2 in scores[n]),
                    key=lambda p: (scores[p[0]][p[1]], p[1], -order.index(p[0])))
    own = {n: max(scores[n], key=lambda l2: (scores[n][l2], l2)) for n in order}  # each one's best L2, as above
    head_l2s = {}
    for n in order:
        lowest, lowest_se = min(losses[n].values())
        near = [l2 for l2, (loss, _) in losses[n].items() if loss <= lowest + lowest_se]
        if lowest + lowest_se < math.log(num_classes):  # the loss tells some head from a uniform guess
            head_l2s[n] = max(near)
        else:  # it cannot, and its strongest L2 is no head at all: of the heads it cannot tell apart, top-1's
            head_l2s[n] = max(near, key=lambda l2: (scores[n][l2], l2))
    return ProbeChoice(rep, best, scores, _fold(fits[rep, best], *stats[rep]),
                       {n: outcomes.record(hits[n, own[n]].numpy(), val_y.numpy()) for n in order},
                       _fold(fits[rep, head_l2s[rep]], *stats[rep]), losses[rep],
                       "cv" if folds else "heldout" if dev is None else "dev", head_l2s)


def linear_probe(train_x, train_y, test_x, test_y, *, num_classes: int | None = None,
                 val_fraction: float = 0.1, l2_grid=ProbeConfig.l2_grid, seed: int = 0,
                 dev: tuple[dict, torch.Tensor] | None = None) -> dict:
    """Linear top-1 / top-5 on the test features, its L2 strength (and representation) chosen on
    validation images (`choose_probe`: held-out train features, or `dev`), refitted on all
    training features (and `dev`'s) and evaluated once on test (features standardised with
    training statistics).

    `train_x` / `test_x` are features (N, D) or {representation: features} of the same samples.
    With a dict the result also holds `representation` (the chosen one), and each candidate's best
    validation top-1 and its images' outcomes: `heldout_top1` and `heldout_outcomes`, or with
    `dev` ({representation: features}, labels: a development split apart from `train_x`)
    `dev_top1` and `dev_outcomes`. `val_top1`: the chosen representation's top-1 there at each L2.
    `outcomes`: which test samples it got right (mpp.outcomes).
    """
    several = isinstance(train_x, dict)
    trains, tests = (train_x, test_x) if several else ({"": train_x}, {"": test_x})
    train_y, test_y = train_y.long(), test_y.long()
    if num_classes is None:
        num_classes = int(train_y.max()) + 1
    c = choose_probe(trains, train_y, num_classes=num_classes, val_fraction=val_fraction, l2_grid=l2_grid, seed=seed,
                     dev=dev)
    refit_x, refit_y = (trains[c.pool], train_y) if dev is None else (torch.cat([trains[c.pool], dev[0][c.pool]]),
                                                                     torch.cat([train_y, dev[1].long()]))
    weight, bias = fit_linear_head(refit_x, refit_y, num_classes, c.l2, init=c.head)
    logits = tests[c.pool].float() @ weight.T + bias
    right = logits.topk(1, 1).indices[:, 0].eq(test_y)  # top-1 and its record from one pick (ties: topk's)
    out = {"top1": right.float().mean().item(), "top5": _topk(logits, test_y, 5), "l2": c.l2,
           "val_top1": {f"{k:g}": v for k, v in sorted(c.scores[c.pool].items())},
           "outcomes": outcomes.record(right.numpy(), test_y.numpy())}
    if several:
        out.update({"representation": c.pool, f"{c.on}_top1": {n: max(s.values()) for n, s in c.scores.items()},
                    f"{c.on}_outcomes": c.outcomes})
    return out


def _read_head(path: Path, pools: tuple[str, ...], shape: tuple[int, int], on: str) -> dict:
    """A cached probe head, checked as `_read_features` checks features (it is a file on disk:
    damaged, or written by someone else): finite float weight of `shape` (C, D) and bias (C,), and
    the figures `probe_head` writes (validation images `on`), of their types: the chosen
    representation one of `pools`, finite numbers, and per representation of `pools` a number or
    a record of outcomes. ValueError otherwise, which `read_cached` turns into a miss (refitted): a
    NaN head trained every fine-tune sharing the cache to NaN, a missing figure stopped it."""
    with safe_open(str(path), "pt") as f:
        weight, bias, fit = f.get_tensor("weight"), f.get_tensor("bias"), json.loads(f.metadata()["fit"])
    if tuple(weight.shape) != shape or tuple(bias.shape) != shape[:1] or not weight.is_floating_point() or \
            not bias.is_floating_point():
        raise ValueError(f"a {weight.dtype} head of shape {tuple(weight.shape)} for {shape[0]} classes")
    if nonfinite({"weight": weight, "bias": bias}):
        raise ValueError("a head that is NaN or infinite, which probe_head never writes")
    figures = {"pool", "l2", f"{on}_top1", f"{on}_loss", f"pool_{on}_top1", f"pool_{on}_outcomes", "pool_head_l2"}
    if not isinstance(fit, dict) or set(fit) != figures:
        raise ValueError(f"a head whose figures are not {', '.join(sorted(figures))}")

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    def each(v, ok) -> bool:  # {representation: value} of every candidate
        return isinstance(v, dict) and set(v) == set(pools) and all(ok(x) for x in v.values())
    if fit["pool"] not in pools or not all(number(fit[k]) for k in ("l2", f"{on}_top1", f"{on}_loss")) or not (
            each(fit[f"pool_{on}_top1"], number) and each(fit["pool_head_l2"], number)
            and each(fit[f"pool_{on}_outcomes"], lambda r: outcomes.read(r) is not None)):
        raise ValueError("a head whose figures are not of the types probe_head writes")
    return {"weight": weight, "bias": bias, **fit}


def fitted_labels(init: str) -> bool:
    """Whether the encoder a finetune.init names may have trained on labels, so that validating a
    probe on its training images would flatter what it memorised (see `choose_probe`): False for
    none (a random init) and for a run directory, or its encoder.safetensors, whose config.yaml
    says objective: mpp; True for any other (a supervised pre-training, a fine-tune, or unknown)."""
    if init == "none":
        return False
    run = Path(init) if Path(init).is_dir() else Path(init).parent
    try:
        with open(run / "config.yaml", encoding="utf-8") as f:
            saved = read_yaml(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return True
    return not (isinstance(saved, dict) and saved.get("objective") == "mpp")


def folds_apply(cfg: Config) -> bool:
    """Whether finetune.pool_folds reaches a fine-tune's probe: it probes to choose its
    representation (finetune.pool=auto) or its starting head's L2 (head_init=probe without
    head_l2), and its encoder never fitted labels (`fitted_labels`)."""
    f = cfg.finetune
    return (f.pool == "auto" or (f.head_init == "probe" and not f.head_l2)) and not fitted_labels(f.init)


def probe_head(encoder, cfg: Config, *, pool: str, subset: tuple, num_classes: int, device: torch.device,
               precision: str, dev_subset: tuple | None = None) -> dict:
    """The linear probe of frozen `encoder` on its `pool` features (auto: each of POOLS, the best
    chosen on validation top-1) of the labeled `subset` of data.train (as `make_loader` takes it),
    its L2 chosen by the starting-head rule of `choose_probe`, on `dev_subset` (the run's
    development split) where given, else on a held-out part (probe.val_fraction, split by
    finetune.split_seed), or with finetune.pool_folds on every labeled image in folds where the
    encoder never trained on labels (`fitted_labels`), or given as finetune.head_l2: {weight (C, D),
    bias (C,), pool, l2, and with ON dev, heldout or cv: ON_top1 and ON_loss (at that L2),
    pool_ON_top1 and pool_ON_outcomes (each candidate's best and its per-image outcomes),
    pool_head_l2 (each candidate's starting-head L2)}, the starting head of a fine-tune with
    finetune.head_init=probe and the representation of one with finetune.pool=auto. Features and
    the head go through the feature cache: a comparison's sweep points and seeds start from the
    same encoder and labels, and the head is fitted once for all of them (an unreadable cached
    head is fitted again)."""
    cache, p, pools = feature_cache_dir(cfg), cfg.probe, candidate_pools(pool)
    # features of every representation (one forward gives them all), so that the sweep's stages of
    # either representation share one extraction; the head's fit reads only `pools`
    features = feature_cache_key(encoder, cfg.data.train, cfg=cfg, pools=POOLS, img_size=encoder_img_size(encoder),
                                 num_samples=cfg.data.num_samples, precision=precision, device=torch.device(device),
                                 subset=subset)
    rule = "l2: one standard error of the validation loss, top-1 within it if no better than uniform; fit on all"
    grid = (cfg.finetune.head_l2,) if cfg.finetune.head_l2 else p.l2_grid
    folds = cfg.finetune.pool_folds if folds_apply(cfg) else 0
    key = json.dumps([features, list(pools), sorted(grid), p.val_fraction, cfg.finetune.split_seed, num_classes,
                      rule, dev_subset and list(dev_subset)] + ([folds] if folds else []))  # old heads keep their key
    path = cache / f"head-{hashlib.sha256(key.encode()).hexdigest()[:32]}.safetensors"
    on = "cv" if folds else "dev" if dev_subset else "heldout"  # choose_probe's name of the validation images
    if (cached := read_cached(path, lambda f: _read_head(f, pools, (num_classes, encoder.embed_dim), on))) is not None:
        return cached
    x, y, _ = extract_features(encoder, cfg.data.train, cfg=cfg, pools=POOLS, num_samples=cfg.data.num_samples,
                               cache_dir=cache, device=device, precision=precision, subset=subset, key=features)
    x, dev = {n: x[n] for n in pools}, None
    if dev_subset:
        dx, dy, _ = extract_features(encoder, cfg.data.train, cfg=cfg, pools=POOLS, cache_dir=cache,
                                     num_samples=cfg.data.num_samples, device=device, precision=precision,
                                     subset=dev_subset)
        dev = {n: dx[n] for n in pools}, dy
    c = choose_probe(x, y, num_classes=num_classes, val_fraction=p.val_fraction, l2_grid=grid,
                     seed=cfg.finetune.split_seed, dev=dev, folds=folds)
    weight, bias = fit_linear_head(x[c.pool], y, num_classes, c.head_l2, init=c.start_head)
    fit = {"pool": c.pool, "l2": c.head_l2, f"{c.on}_top1": c.scores[c.pool][c.head_l2],
           f"{c.on}_loss": c.losses[c.head_l2][0], f"pool_{c.on}_outcomes": c.outcomes,
           f"pool_{c.on}_top1": {n: max(s.values()) for n, s in c.scores.items()}, "pool_head_l2": c.head_l2s}
    cache.mkdir(parents=True, exist_ok=True)
    sweep_orphans(cache)  # a killed writer's heads and arrays
    with atomic_path(path) as tmp:
        save_file({"weight": weight, "bias": bias}, str(tmp), metadata={"fit": json.dumps(fit)})
    return {"weight": weight, "bias": bias, **fit}


class Evaluator:
    """Linear probe and few-shot figures of a frozen encoder: fitted on `data.train`, tested on
    `data.val`. Features come from (and go to) the cache `probe.cache_dir` (default
    OUTPUT_DIR/../feature_cache). The L2 and, with `probe.pool=auto`, the representation are chosen
    per encoder on held-out training features (see `linear_probe`; `pool_heldout_top1`,
    `pool_heldout_outcomes`), or with `probe.dev_split` on that development split of all the labels,
    fitted on the rest (`pool_dev_top1`, `pool_dev_outcomes`): a comparison's pre-trainings withhold
    it, so no probe chooses on images a supervised pre-training fitted. The few-shot figures use the
    same representation, recorded as `pool`, and draw their shots from all the training labels.
    Images the loader could not read are counted by kind: `skipped_samples` (training, development
    split included) and `val_skipped_samples` (test), as a fine-tune records them."""

    def __init__(self, cfg: Config, device: torch.device | str):
        if not cfg.data.train or not cfg.data.val:
            raise ValueError("the linear probe needs labeled shards in data.train (fit) and data.val (test)")
        check_same_classes(cfg.data.train, cfg.data.val, cfg.data.val_num_samples)
        self.cfg, self.device = cfg, torch.device(device)

    def run(self, encoder) -> dict:
        cfg = self.cfg
        kw = dict(cfg=cfg, pools=candidate_pools(cfg.probe.pool), cache_dir=feature_cache_dir(cfg), device=self.device,
                  precision=resolve_precision(cfg.train.precision, self.device.type))  # the cache key names what ran
        t0 = time.time()
        split, dev = cfg.probe.dev_split, None
        if split:  # the rest, then the split: together every training sample, once
            tr_x, tr_y, skipped = extract_features(encoder, cfg.data.train, num_samples=cfg.data.num_samples,
                                                   subset=(1.0, *split, False), **kw)
            dev = extract_features(encoder, cfg.data.train, num_samples=cfg.data.num_samples,
                                   subset=(1.0, *split, True), **kw)
            skipped = dict(Counter(skipped) + Counter(dev.skipped))
        else:
            tr_x, tr_y, skipped = extract_features(encoder, cfg.data.train, num_samples=cfg.data.num_samples, **kw)
        te_x, te_y, te_skipped = extract_features(encoder, cfg.data.val, num_samples=cfg.data.val_num_samples, **kw)
        t1 = time.time()
        num_classes = class_count(cfg.data.train, cfg.data.num_samples, tr_y)
        lin = linear_probe(tr_x, tr_y, te_x, te_y, num_classes=num_classes, val_fraction=cfg.probe.val_fraction,
                           l2_grid=cfg.probe.l2_grid, seed=cfg.seed, dev=dev)
        if dev:
            tr_x, tr_y = {p: torch.cat([tr_x[p], dev[0][p]]) for p in tr_x}, torch.cat([tr_y, dev[1]])
        t2 = time.time()
        pool = lin["representation"]
        fs = fewshot_eval(tr_x[pool], tr_y, te_x[pool], te_y, shots=cfg.fewshot.shots, seeds=cfg.fewshot.seeds,
                          l2=cfg.fewshot.l2, num_classes=num_classes, draws=True)
        on = "dev" if dev else "heldout"
        return {"top1": lin["top1"], "top5": lin["top5"], **fs, "pool": pool, "pool_setting": cfg.probe.pool,
                f"pool_{on}_top1": lin[f"{on}_top1"], f"pool_{on}_outcomes": lin[f"{on}_outcomes"],
                "probe_l2": lin["l2"], "probe_val_top1": lin["val_top1"],
                "outcomes": lin["outcomes"],
                "fewshot_l2": cfg.fewshot.l2, "fewshot_seeds": cfg.fewshot.seeds, "num_classes": num_classes,
                "num_train": len(tr_y), "num_test": len(te_y), "feature_dim": tr_x[pool].shape[1],
                "skipped_samples": skipped, "val_skipped_samples": te_skipped,
                "img_size": encoder_img_size(encoder), "seconds_features": round(t1 - t0, 2),
                "seconds_probe": round(t2 - t1, 2), "seconds_fewshot": round(time.time() - t2, 2)}


def _warn_resampled(encoder_path, img_size: int) -> None:
    """Warn when an exported encoder is probed at an img_size other than its own: its position
    embeddings were resampled, and a frozen encoder does not adapt to them as a fine-tune does."""
    if not img_size or str(encoder_path) == "none":
        return
    trained = trained_img_size(encoder_path)
    if trained and trained != img_size:
        print(f"warning: probe.encoder={str(encoder_path)!r} was trained at {trained} px and is probed at "
              f"img_size={img_size}: its position embeddings are resampled; leave img_size unset (or give "
              f"img_size={trained}) to probe it at its own", file=sys.stderr)


def run_linear_probe(cfg: Config) -> dict:
    """The probe of `probe.encoder` by `Evaluator`, written to OUT/config.yaml and
    then OUT/metrics.json (`kind: linear_probe`, the figures, `config`); returns the metrics.
    `probe.encoder=none` probes a randomly initialised `model` (seeded by `seed`): the from-scratch
    baseline. Under torchrun only rank 0 works. OUTPUT_DIR is checked first, as training's is: an
    unusable one stops the probe before the features are extracted and cached."""
    if int(os.environ.get("RANK", "0")) != 0:
        return {}
    encoder_path, out = cfg.probe.encoder, Path(cfg.output_dir)
    if not encoder_path:
        raise ConfigError("no encoder to probe: set probe.encoder to a pre-training run dir, its encoder.safetensors, "
                          "or none (a randomly initialised model)")
    rundir.check_output_dir(out)
    rundir.check_probe_dir(out, cfg)
    rundir.lock(out)  # one probe a folder at a time
    try:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        with deterministic(cfg.train.deterministic):  # as training runs under it
            evaluator = Evaluator(cfg, device)
            set_seed(cfg.seed)  # probe.encoder=none: a random init of `model`
            encoder = encoder_from(encoder_path, "probe.encoder", cfg).to(device)
            _warn_resampled(encoder_path, cfg.img_size)
            metrics = {"kind": "linear_probe", "encoder": str(encoder_path),
                       "encoder_sha256": encoder_digest(encoder_path), **evaluator.run(encoder), "config": to_dict(cfg)}
        save_config(cfg, out / "config.yaml")
        write_atomic(out / "metrics.json", json.dumps(metrics, indent=2) + "\n")  # last: compare's "done"
    finally:
        rundir.unlock(out)
    return metrics
