"""Frozen-feature evaluation: feature extraction (cached), linear probe, few-shot least squares.

`extract_features` runs a frozen encoder over labeled shards once, pooling every candidate
representation (`POOLS`: the [class] token and the mean of the patch tokens) from that one pass,
and caches them on disk (safetensors) under a key made of the encoder weights, the data and the
transform, so the probe, the few-shot figures and a rerun all reuse one pass. `linear_probe` fits
a multinomial logistic regression with its representation and L2 strength chosen jointly on
held-out training features (MPP's loss never reaches the [class] token, so which representation
carries an encoder's knowledge differs per encoder and must not be fixed, nor chosen on test). `fewshot_eval`
follows big_vision's `fewshot_lsr` evaluator: standardised features with a constant bias column,
closed-form ridge regression onto {-1, 1} one-hot targets, k shots per class, several seeds.
`FewshotEvaluator` is the same few-shot figure during pre-training, without touching the RNG.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from mpp.config import Config, ConfigError, save_config, to_dict
from mpp.fileio import atomic_path, write_atomic
from mpp.data import make_loader, normalize, to_float01
from mpp.data.sources import check_same_classes
from mpp.data.sources import resolve
from mpp.checkpoint import rng_state, set_rng_state
from mpp.models import create_encoder, load_encoder
from mpp.runtime import autocast, resolve_precision, seed_everything

BIAS_CONSTANT = 100.0  # big_vision: a large constant bias feature is almost unregularised
PROBE_L2_GRID = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)  # on mean cross-entropy, standardised features
POOLS = ("token", "avg")  # candidate representations, in tie-break order


# ----------------------------------------------------------------------------- features

def encoder_img_size(encoder) -> int:
    """The square input resolution the encoder's position embeddings are built for."""
    return encoder.grid_size[0] * encoder.patch_size


def pool_tokens(tokens: torch.Tensor, pool: str, num_prefix: int = 1) -> torch.Tensor:
    """(B, prefix + N, D) tokens -> (B, D): the [class] token or the mean of the patch tokens."""
    if pool == "token":
        return tokens[:, 0]
    if pool == "avg":
        return tokens[:, num_prefix:].mean(dim=1)
    raise ValueError(f"pool must be 'token' or 'avg', got {pool!r}")


def candidate_pools(setting: str) -> tuple[str, ...]:
    """The representations a `probe.pool` setting evaluates: all of POOLS for auto, else the one."""
    return POOLS if setting == "auto" else (setting,)


@torch.no_grad()
def encode_images(encoder, images_uint8: torch.Tensor, *, cfg: Config, pools: tuple[str, ...],
                  device: torch.device, precision: str) -> dict[str, torch.Tensor]:
    """{pool: features float32 (B, D)} of one uint8 batch (normalised as in training), one forward."""
    x = normalize(to_float01(images_uint8.to(device, non_blocking=True)), cfg.data.mean, cfg.data.std)
    with autocast(device, precision):
        tokens = encoder(x)
    return {p: pool_tokens(tokens, p, encoder.vit.num_prefix_tokens).float().cpu() for p in pools}


@contextlib.contextmanager
def eval_mode(module: torch.nn.Module):
    """Eval mode inside the block, the previous train/eval mode restored after."""
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)


def _eval_batch(cfg: Config) -> int:
    """Inference batch size: the training batch, at most 256 (no activations kept, memory is small)."""
    return max(1, min(cfg.batch_size, 256))


def _weights_hash(encoder) -> str:
    """sha256 of the clean encoder weights (not the mask token: unused here, fresh on every load)."""
    h = hashlib.sha256()
    for name, t in sorted(encoder.encoder_state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _data_fingerprint(spec, num_samples: int) -> list:
    """Every shard the spec resolves to, with size and mtime when local (rewritten shards miss the cache)."""
    shards = resolve(spec, num_samples)
    out = []
    for url, count in zip(shards.urls, shards.counts):
        p = Path(url)
        out.append([str(p.resolve()), count, p.stat().st_size, p.stat().st_mtime_ns] if p.is_file() else [url, count])
    return out


def feature_cache_key(encoder, spec, *, cfg: Config, pools: tuple[str, ...], img_size: int, num_samples: int,
                      precision: str) -> str:
    """Hash of everything the features depend on: architecture, weights, data, transform, pooling,
    precision."""
    d = cfg.data
    key = dict(model=encoder.model_spec(), weights=_weights_hash(encoder),
               data=_data_fingerprint(spec, num_samples), img_size=img_size, pools=list(pools), precision=precision,
               mean=list(d.mean), std=list(d.std), eval_crop_pct=d.eval_crop_pct, max_pixels=d.max_pixels)
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def extract_features(encoder, spec, *, cfg: Config, pools: tuple[str, ...] = POOLS, num_samples: int = 0,
                     cache_dir: str | Path | None = None, device: torch.device | str = "cpu",
                     precision: str = "auto", progress: bool = True) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """{pool: features float32 (N, D)} and labels long (N,) of every sample of labeled shards `spec`.

    Every representation of `pools` comes from one forward pass. The encoder is frozen (eval mode,
    no grad; its mode is restored after); images get the eval transform at the encoder's
    resolution. With `cache_dir` the result is stored as safetensors under a key of weights + data
    + transform + pools + precision, and a later call with the same key loads it instead of
    running the encoder.
    """
    device = torch.device(device)
    img_size = encoder_img_size(encoder)
    path = None
    if cache_dir:
        key = feature_cache_key(encoder, spec, cfg=cfg, pools=pools, img_size=img_size,
                                num_samples=num_samples, precision=precision)
        path = Path(cache_dir) / f"features-{key}.safetensors"
        if path.is_file():
            cached = load_file(str(path))
            return {p: cached[f"features.{p}"] for p in pools}, cached["labels"]
    loader = make_loader(spec, batch_size=_eval_batch(cfg), img_size=img_size, train=False, labeled=True,
                         data_cfg=cfg.data, num_samples=num_samples, rank=0, world_size=1)
    feats, labels = [], []
    with eval_mode(encoder):
        for batch in tqdm(loader.epoch(0), total=loader.batches_per_epoch, desc="features",
                          unit="batch", disable=not progress, leave=False):
            feats.append(encode_images(encoder, batch["image"], cfg=cfg, pools=pools, device=device,
                                       precision=precision))
            labels.append(batch["label"].long().cpu())
    if not feats:
        raise ValueError(f"no labeled samples read from {spec!r}; check the shards and their 'cls' entries")
    features, labels = {p: torch.cat([f[p] for f in feats]) for p in pools}, torch.cat(labels)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:  # a concurrent reader never sees half a file
            save_file({**{f"features.{p}": f.contiguous() for p, f in features.items()}, "labels": labels.contiguous()},
                      str(tmp), metadata={"spec": json.dumps(spec), "pools": ",".join(pools), "img_size": str(img_size)})
    return features, labels


# ----------------------------------------------------------------------------- few-shot

def standardize(train: torch.Tensor, *others: torch.Tensor, eps: float = 1e-5) -> list[torch.Tensor]:
    """Whiten with the mean and (population) std of `train`, as big_vision does."""
    mean = train.mean(0, keepdim=True)
    std = train.std(0, unbiased=False, keepdim=True) + eps
    return [(x - mean) / std for x in (train, *others)]


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


def fewshot_accuracy(train_x, train_y, test_x, test_y, num_classes: int, l2: float) -> float:
    """Test accuracy of the few-shot least-squares classifier fitted on (train_x, train_y)."""
    tr, te = standardize(train_x.double(), test_x.double())
    w = fewshot_lstsq(_with_bias(tr), train_y, num_classes, l2)
    return (_with_bias(te) @ w).argmax(1).eq(test_y).double().mean().item()


def fewshot_eval(train_x, train_y, test_x, test_y, *, shots=(1, 5, 10, 25), seeds: int = 3,
                 l2: float = 1.0, num_classes: int | None = None) -> dict[str, float]:
    """`{k}shot_mean` / `{k}shot_std` accuracy over `seeds` draws of k training samples per class.

    As big_vision: seed s permutes each class's indices with numpy's default_rng(s), the k shots
    are the first k of that permutation (nested across k); a class with fewer than k samples
    contributes all it has. Uses only its own generators.
    """
    train_y, test_y = train_y.long(), test_y.long()
    if num_classes is None:
        num_classes = int(max(train_y.max(), test_y.max())) + 1
    labels = train_y.numpy()
    accs: dict[int, list[float]] = {int(k): [] for k in shots}
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        perms = [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]
        for k in accs:
            idx = torch.from_numpy(np.concatenate([p[:k] for p in perms]))
            accs[k].append(fewshot_accuracy(train_x[idx], train_y[idx], test_x, test_y, num_classes, l2))
    out = {}
    for k, a in accs.items():
        out[f"{k}shot_mean"] = float(np.mean(a))
        out[f"{k}shot_std"] = float(np.std(a))
    return out


# ----------------------------------------------------------------------------- linear probe

def _fit_logistic(x, y, num_classes: int, l2: float, init=None, max_iter: int = 100) -> torch.Tensor:
    """Weights (D + 1, C) of L2-regularised multinomial logistic regression (bias unregularised),
    fitted full-batch with L-BFGS from `init` (warm start) or zeros. The gradient is written out
    (x^T (softmax - onehot) / N) rather than autograd's: about 3x faster on CPU."""
    w = init.clone() if init is not None else torch.zeros(x.shape[1] + 1, num_classes)
    w.requires_grad_(True)
    xt, onehot = x.T.contiguous(), F.one_hot(y, num_classes).float()
    opt = torch.optim.LBFGS([w], lr=1.0, max_iter=max_iter, history_size=20, tolerance_grad=1e-6,
                            tolerance_change=1e-9, line_search_fn="strong_wolfe")

    @torch.no_grad()
    def closure():
        logits = x @ w[:-1] + w[-1]
        loss = F.cross_entropy(logits, y) + 0.5 * l2 * w[:-1].pow(2).sum()
        g = (logits.softmax(1) - onehot) / len(y)
        w.grad = torch.cat([xt @ g + l2 * w[:-1], g.sum(0, keepdim=True)])
        return loss

    opt.step(closure)
    return w.detach()


def _topk(logits: torch.Tensor, y: torch.Tensor, k: int) -> float:
    k = min(k, logits.shape[1])
    return logits.topk(k, dim=1).indices.eq(y[:, None]).any(1).float().mean().item()


def linear_probe(train_x, train_y, test_x, test_y, *, num_classes: int | None = None,
                 val_fraction: float = 0.1, l2_grid=PROBE_L2_GRID, seed: int = 0) -> dict:
    """Linear top-1 / top-5 on the test features, its L2 strength (and representation) chosen on
    held-out train features.

    `train_x` / `test_x` are features (N, D) or {representation: features} of the same samples.
    Features are standardised with training statistics. Every (representation, L2 of `l2_grid`)
    pair is fitted on the train part (1 - val_fraction, one seeded random split) and scored on the
    rest; the best (ties: the stronger L2, then the earlier representation) is refitted on all
    training features and evaluated once on test. With a dict the result also holds
    `representation` (the chosen one) and `heldout_top1` (each candidate's best held-out top-1).
    """
    several = isinstance(train_x, dict)
    trains, tests = (train_x, test_x) if several else ({"": train_x}, {"": test_x})
    train_y, test_y = train_y.long(), test_y.long()
    if num_classes is None:
        num_classes = int(max(train_y.max(), test_y.max())) + 1
    perm = torch.randperm(len(train_y), generator=torch.Generator().manual_seed(seed))
    n_val = max(1, int(round(val_fraction * len(train_y))))
    if len(train_y) - n_val < 1:
        raise ValueError(f"linear probe needs at least 2 training samples, got {len(train_y)}")
    fit_idx, val_idx = perm[n_val:], perm[:n_val]
    scores: dict[str, dict[float, float]] = {}
    for name, x in trains.items():
        fx, vx = standardize(x[fit_idx].float(), x[val_idx].float())
        scores[name], w = {}, None
        for l2 in sorted(l2_grid, reverse=True):  # strong to weak: each fit warm-starts the next
            w = _fit_logistic(fx, train_y[fit_idx], num_classes, l2, init=w)
            scores[name][l2] = _topk(vx @ w[:-1] + w[-1], train_y[val_idx], 1)
    order = list(trains)
    rep, best = max(((n, l2) for n in order for l2 in scores[n]),
                    key=lambda p: (scores[p[0]][p[1]], p[1], -order.index(p[0])))
    tx, sx = standardize(trains[rep].float(), tests[rep].float())
    w = _fit_logistic(tx, train_y, num_classes, best)
    logits = sx @ w[:-1] + w[-1]
    out = {"top1": _topk(logits, test_y, 1), "top5": _topk(logits, test_y, 5), "l2": best,
           "val_top1": {f"{k:g}": v for k, v in sorted(scores[rep].items())}}
    if several:
        out["representation"] = rep
        out["heldout_top1"] = {n: max(scores[n].values()) for n in order}
    return out


# ----------------------------------------------------------------------------- during pre-training

@contextlib.contextmanager
def preserved_rng():
    """Every global RNG (mpp.checkpoint.rng_state) is restored on exit, so whatever runs inside
    (DataLoader seeding, attention timing with random tensors) leaves training as is."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


def _read_images(spec, num_samples: int, *, cfg: Config, img_size: int, limit) -> tuple[torch.Tensor, torch.Tensor]:
    """All images (uint8, eval transform) and labels of labeled shards, in memory. `limit(n, classes)`
    gives the most samples to keep; beyond it a class-balanced seeded subset is read instead."""
    kw = dict(batch_size=_eval_batch(cfg), img_size=img_size, train=False, labeled=True, data_cfg=cfg.data,
              num_samples=num_samples, rank=0, world_size=1)
    loader = make_loader(spec, **kw)
    cap = limit(loader.num_samples, loader.classes)
    if cap and loader.num_samples > cap:
        loader = make_loader(spec, subset=(cap / loader.num_samples, cfg.seed), **kw)
    batches = list(loader.epoch(0))
    return torch.cat([b["image"] for b in batches]), torch.cat([b["label"] for b in batches]).long()


class FewshotEvaluator:
    """Few-shot accuracy of an encoder during pre-training (`fewshot.every` steps; the paper chose
    among MPP variants by it). The small labeled sets `fewshot.train` / `fewshot.test` are checked
    at construction and decoded once, at the first call and the encoder's resolution, into memory
    (uint8): the test set capped at `fewshot.max_test` images and the shot pool at
    `max(shots) * seeds` images per class, both class-balanced seeded subsets. Each call puts
    the encoder in eval mode (restored after), runs it without grad under autocast and solves the
    few-shot problems with fixed seeds; the global RNGs are left exactly as they were.

    Call it on the main process with the unwrapped encoder; returns {"{k}shot_mean", "{k}shot_std"},
    under `probe.pool=auto` for every candidate representation ({"token/{k}shot_mean", ...}: no
    choice is made here, the few-shot test images are for watching, not for choosing).
    """

    def __init__(self, cfg: Config, device: torch.device | str):
        fs = cfg.fewshot
        if not fs.train or not fs.test:
            raise ValueError("fewshot.every > 0 needs labeled shards in fewshot.train and fewshot.test "
                             "(e.g. the synthetic train/ and test/ manifests); or set fewshot.every=0")
        resolve(fs.train, fs.train_num_samples), resolve(fs.test, fs.test_num_samples)  # bad specs fail now
        self.cfg, self.device = cfg, torch.device(device)
        self._data: dict[int, tuple] = {}  # img_size -> (train images, labels, test images, labels)

    def _load(self, img_size: int) -> tuple:
        fs = self.cfg.fewshot
        per_class = max(int(k) for k in fs.shots) * fs.seeds
        train = _read_images(fs.train, fs.train_num_samples, cfg=self.cfg, img_size=img_size,
                             limit=lambda n, classes: per_class * len(classes) if classes else 0)
        test = _read_images(fs.test, fs.test_num_samples, cfg=self.cfg, img_size=img_size,
                            limit=lambda n, classes: fs.max_test)
        return self._data.setdefault(img_size, (*train, *test))

    def _features(self, encoder, images: torch.Tensor, pools: tuple[str, ...]) -> dict[str, torch.Tensor]:
        bs = _eval_batch(self.cfg)
        parts = [encode_images(encoder, images[i:i + bs], cfg=self.cfg, pools=pools, device=self.device,
                               precision=self.cfg.train.precision) for i in range(0, len(images), bs)]
        return {p: torch.cat([f[p] for f in parts]) for p in pools}

    def __call__(self, encoder) -> dict[str, float]:
        fs = self.cfg.fewshot
        img_size = encoder_img_size(encoder)
        with preserved_rng():
            tr_x, tr_y, te_x, te_y = self._data.get(img_size) or self._load(img_size)
            pools = candidate_pools(self.cfg.probe.pool)
            with eval_mode(encoder):
                tr_f, te_f = self._features(encoder, tr_x, pools), self._features(encoder, te_x, pools)
        out = {}
        for p in pools:
            figures = fewshot_eval(tr_f[p], tr_y, te_f[p], te_y, shots=fs.shots, seeds=fs.seeds, l2=fs.l2,
                                   num_classes=int(max(tr_y.max(), te_y.max())) + 1)
            out.update({(f"{p}/{k}" if len(pools) > 1 else k): v for k, v in figures.items()})
        return out


# ----------------------------------------------------------------------------- the probe tool

def run_linear_probe(cfg: Config, encoder_path: str | Path | None = None, out_dir: str | Path | None = None) -> dict:
    """Linear probe and few-shot figures of a frozen encoder on `data.train` -> `data.val`.

    `probe.encoder=none` probes a randomly initialised `model` (seeded by `seed`): the from-scratch
    baseline of the probe and few-shot figures. Features come from (and go to) the cache
    `probe.cache_dir` (default OUT/../feature_cache).
    Writes OUT/config.yaml and then OUT/metrics.json (`kind: linear_probe`, `top1`, `top5`,
    `{k}shot_mean/std`, settings); returns the metrics. Under torchrun only rank 0 works.
    `probe.pool=auto` chooses the representation per encoder on held-out training features (see
    `linear_probe`); the few-shot figures use the same choice. metrics.json records it as `pool`
    and every candidate's held-out top-1 as `pool_heldout_top1`.
    """
    if int(os.environ.get("RANK", "0")) != 0:
        return {}
    encoder_path = encoder_path or cfg.probe.encoder
    out = Path(out_dir or cfg.output_dir)
    if not encoder_path:
        raise ValueError("no encoder to probe: set probe.encoder to a pre-training run dir, its encoder.safetensors, "
                         "or none (a randomly initialised model)")
    if not cfg.data.train or not cfg.data.val:
        raise ValueError("the linear probe needs labeled shards in data.train (fit) and data.val (test)")
    if str(encoder_path) != "none" and not Path(encoder_path).exists():
        raise ConfigError(f"probe.encoder={str(encoder_path)!r} does not exist; give a pre-training run directory, "
                          "its encoder.safetensors, or none (a randomly initialised model)")
    check_same_classes(cfg.data.train, cfg.data.val, cfg.data.val_num_samples)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(encoder_path) == "none":
        seed_everything(cfg.seed)
        encoder = create_encoder(cfg.model, img_size=cfg.img_size, attn=cfg.train.attn).to(device)
    else:
        encoder = load_encoder(encoder_path, img_size=cfg.img_size, attn=cfg.train.attn).to(device)
    cache = Path(cfg.probe.cache_dir) if cfg.probe.cache_dir else out.parent / "feature_cache"
    kw = dict(cfg=cfg, pools=candidate_pools(cfg.probe.pool), cache_dir=cache, device=device,
              precision=resolve_precision(cfg.train.precision, device.type))  # the cache key names what ran
    t0 = time.time()
    tr_x, tr_y = extract_features(encoder, cfg.data.train, num_samples=cfg.data.num_samples, **kw)
    te_x, te_y = extract_features(encoder, cfg.data.val, num_samples=cfg.data.val_num_samples, **kw)
    t1 = time.time()
    num_classes = int(max(tr_y.max(), te_y.max())) + 1
    lin = linear_probe(tr_x, tr_y, te_x, te_y, num_classes=num_classes, val_fraction=cfg.probe.val_fraction,
                       seed=cfg.seed)
    t2 = time.time()
    pool = lin["representation"]
    fs = fewshot_eval(tr_x[pool], tr_y, te_x[pool], te_y, shots=cfg.fewshot.shots, seeds=cfg.fewshot.seeds,
                      l2=cfg.fewshot.l2, num_classes=num_classes)
    metrics = {"kind": "linear_probe", "encoder": str(encoder_path), "top1": lin["top1"], "top5": lin["top5"],
               **fs, "pool": pool, "pool_setting": cfg.probe.pool, "pool_heldout_top1": lin["heldout_top1"],
               "probe_l2": lin["l2"], "probe_val_top1": lin["val_top1"],
               "fewshot_l2": cfg.fewshot.l2, "fewshot_seeds": cfg.fewshot.seeds, "num_classes": num_classes,
               "num_train": len(tr_y), "num_test": len(te_y), "feature_dim": tr_x[pool].shape[1],
               "img_size": encoder_img_size(encoder), "seconds_features": round(t1 - t0, 2),
               "seconds_probe": round(t2 - t1, 2), "seconds_fewshot": round(time.time() - t2, 2),
               "config": to_dict(cfg)}
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    write_atomic(out / "metrics.json", json.dumps(metrics, indent=2) + "\n")  # last: compare's "done"
    return metrics
