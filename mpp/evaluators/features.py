"""Features of a frozen encoder, shared by the evaluators: one forward pass pools every
candidate representation (mpp.models.POOLS) and, with a cache directory, is stored on disk
(safetensors) under a key made of the encoder weights, the data, the transform and the code, so
the probe, the few-shot figures and a rerun all reuse one pass.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
from pathlib import Path
from typing import Callable, NamedTuple, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from mpp.config import Config
from mpp.data import DataError, make_loader, normalize, to_float01
from mpp.data.sources import resolve
from mpp.fileio import atomic_path, sweep_orphans
from mpp.models import POOLS
from mpp.nonfinite import NonFiniteError
from mpp.runtime import autocast, resolve_precision
from mpp.specs import local_path

log = logging.getLogger(__name__)
T = TypeVar("T")


class Features(NamedTuple):
    """What `extract_features` read: {pool: features (N, D)}, labels (N,), and the images it could
    not read, by kind (`ShardLoader.counters()`), for the metrics to report rather than hide."""
    x: dict[str, torch.Tensor]
    y: torch.Tensor
    skipped: dict[str, int]


def _read_features(path: Path, pools: tuple[str, ...], classes: int | None = None) -> Features:
    """A cache entry, checked (it is a file on disk: damaged, or written by someone else): 2-D
    finite float features with one row per label, integer labels in [0, the data's class count)
    (`classes`, its manifest's; the entry's own record where the data has none), skip counts >= 0.
    ValueError otherwise, which `read_cached` turns into a miss."""
    with safe_open(str(path), "pt") as f:
        x, y = {p: f.get_tensor(f"features.{p}") for p in pools}, f.get_tensor("labels")
        skipped, classes = json.loads(f.metadata()["skipped"]), classes or int(f.metadata()["num_classes"])
    if y.dim() != 1 or y.dtype != torch.int64 or (len(y) and not 0 <= int(y.min()) <= int(y.max()) < classes) or any(
            v.dim() != 2 or len(v) != len(y) or not v.is_floating_point() for v in x.values()):
        raise ValueError("features and labels of other shapes or types than extract_features writes")
    if not all(torch.isfinite(v).all() for v in x.values()):
        raise ValueError("features that are NaN or infinite, which extract_features never writes")
    if not isinstance(skipped, dict) or not all(isinstance(n, int) and n >= 0 for n in skipped.values()):
        raise ValueError("skip counts that are not counts")
    return Features(x, y, skipped)


def encoder_img_size(encoder) -> int:
    """The square input resolution the encoder's position embeddings are built for."""
    return encoder.grid_size[0] * encoder.patch_size


def feature_cache_dir(cfg: Config) -> Path:
    """Where features are cached: probe.cache_dir, else OUTPUT_DIR/../feature_cache (shared by the
    runs of one comparison)."""
    return Path(cfg.probe.cache_dir) if cfg.probe.cache_dir else Path(cfg.output_dir).parent / "feature_cache"


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
    return {p: encoder.pool(tokens, p).float().cpu() for p in pools}


@contextlib.contextmanager
def eval_mode(module: torch.nn.Module):
    """Eval mode inside the block, the previous train/eval mode restored after."""
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)


def eval_batch_size(cfg: Config) -> int:
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


@functools.cache
def code_version() -> str:
    """Hash of the mpp package's source and the versions of the libraries the features go through
    (torch, timm's ViT, Pillow's and libjpeg-turbo's decoding and resizing): what other code (an
    upgrade, a local change) cached in a reused run directory, features or probe heads, is computed
    again."""
    import PIL
    import simplejpeg
    import timm
    root = Path(__file__).resolve().parents[1]
    versions = (torch.__version__, timm.__version__, PIL.__version__, simplejpeg.__version__)
    h = hashlib.sha256(" ".join(versions).encode())
    for path in sorted(root.rglob("*.py")):
        h.update(f"{path.relative_to(root)}\0".encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _data_fingerprint(spec, num_samples: int) -> list:
    """Every shard the spec resolves to, with size and mtime when local (rewritten shards miss the
    cache; a remote one is its URL and count), and the label index's recorded SHA-256 (relabeled
    shards miss it too)."""
    shards = resolve(spec, num_samples)
    out: list = [shards.labels_sha256]
    for url, count in zip(shards.urls, shards.counts):
        p = Path(local_path(url) or url)  # a file: URL is a local file too
        out.append([str(p.resolve()), count, p.stat().st_size, p.stat().st_mtime_ns] if p.is_file() else [url, count])
    return out


def read_cached(path: Path, read: Callable[[Path], T]) -> T | None:
    """`read(path)` of a cache entry, or None when there is none or it is unreadable (truncated,
    damaged): a miss, with a warning naming the file, so the caller computes the entry again and
    writes it over the bad one; else one damaged file would stop every later run sharing the cache."""
    if not path.is_file():
        return None
    try:
        return read(path)
    except (SafetensorError, OSError, KeyError, TypeError, ValueError) as e:
        log.warning("warning: cache entry %s is unreadable (%s); computing it again", path, " ".join(str(e).split()))
        return None


def feature_cache_key(encoder, spec, *, cfg: Config, pools: tuple[str, ...], img_size: int, num_samples: int,
                      precision: str, device: torch.device, subset: tuple | None = None) -> str:
    """Hash of everything the features depend on: architecture, weights, data (and the subset of
    it), transform, pooling, precision, the device's kind and attention kernel (their numerics),
    code, and the data workers' count and, with several, the
    batch, which order the images (workers hand out whole batches in turn), and with them a probe's
    held-out split and few-shot draws."""
    d = cfg.data
    key = dict(model=encoder.model_spec(), weights=_weights_hash(encoder), code=code_version(),
               data=_data_fingerprint(spec, num_samples), subset=list(subset) if subset else None,
               img_size=img_size, pools=list(pools), precision=precision, device=device.type, attn=cfg.train.attn,
               mean=list(d.mean), std=list(d.std), eval_crop_pct=d.eval_crop_pct, max_pixels=d.max_pixels,
               num_workers=d.num_workers, batch=eval_batch_size(cfg) if d.num_workers > 1 else None)
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def extract_features(encoder, spec, *, cfg: Config, pools: tuple[str, ...] = POOLS, num_samples: int = 0,
                     cache_dir: str | Path | None = None, device: torch.device | str = "cpu",
                     precision: str = "auto", progress: bool = True, subset: tuple | None = None,
                     key: str | None = None) -> Features:
    """{pool: features float32 (N, D)}, labels long (N,) and skip counts of every sample of labeled
    shards `spec` (or of its `subset`, as `make_loader` takes it).

    Every representation of `pools` comes from one forward pass. The encoder is frozen (eval mode,
    no grad; its mode is restored after); images get the eval transform at the encoder's
    resolution. With `cache_dir` the result is stored as safetensors under a key of weights + data
    + transform + pools + precision, and a later call with the same key loads it instead of
    running the encoder (an unreadable entry is computed and written again). `key`: the
    `feature_cache_key` of these arguments, when the caller has it already (hashing a large
    encoder's weights takes a while).
    """
    device = torch.device(device)
    img_size = encoder_img_size(encoder)
    path = None
    if cache_dir:
        key = key or feature_cache_key(encoder, spec, cfg=cfg, pools=pools, img_size=img_size,
                                       num_samples=num_samples, precision=precision, device=device, subset=subset)
        path = Path(cache_dir) / f"features-{key}.safetensors"
        def read(f: Path) -> Features:  # on a hit only: the data's classes bound the entry's labels
            return _read_features(f, pools, len(resolve(spec, num_samples).classes or ()) or None)
        if (cached := read_cached(path, read)) is not None:
            return cached
    loader = make_loader(spec, batch_size=eval_batch_size(cfg), img_size=img_size, train=False, labeled=True,
                         data_cfg=cfg.data, num_samples=num_samples, rank=0, world_size=1, subset=subset)
    feats, labels = [], []
    with eval_mode(encoder):
        for batch in tqdm(loader.epoch(0), total=loader.batches_per_epoch, desc="features",
                          unit="batch", disable=not progress, leave=False):
            feats.append(encode_images(encoder, batch["image"], cfg=cfg, pools=pools, device=device,
                                       precision=precision))
            labels.append(batch["label"].long().cpu())
    if not feats:
        raise DataError(f"no labeled samples read from {spec!r}; check the shards and their 'cls' entries")
    features, labels = {p: torch.cat([f[p] for f in feats]) for p in pools}, torch.cat(labels)
    for p, f in features.items():  # an overflow (fp16) or a diverged encoder: refused, never cached
        if rows := int((~torch.isfinite(f).all(1)).sum()):
            ran = resolve_precision(precision, device.type)  # fp32 overflows only where the encoder diverged
            fix = "give a finite encoder" if ran == "no" else "run it at train.precision=no, or give a finite encoder"
            raise NonFiniteError(f"the encoder's {p} features of {rows} of {len(f)} images from {spec!r} are NaN or "
                                 f"infinite (precision {ran}); {fix}")
    skipped = loader.counters()
    num_classes = len(loader.classes) if loader.classes else int(labels.max()) + 1  # the cache's label bound
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        sweep_orphans(path.parent)  # a killed writer's arrays
        with atomic_path(path) as tmp:  # a concurrent reader never sees half a file
            save_file({**{f"features.{p}": f.contiguous() for p, f in features.items()}, "labels": labels.contiguous()},
                      str(tmp),
                      metadata={"spec": json.dumps(spec), "pools": ",".join(pools), "img_size": str(img_size),
                                "skipped": json.dumps(skipped), "num_classes": str(num_classes)})
    return Features(features, labels, skipped)


STD_EPS = 1e-5  # added to each feature's std: a constant feature divides by it, not by zero


def feature_stats(train: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-feature mean and (population) std + STD_EPS of `train` (N, D), each (1, D)."""
    return train.mean(0, keepdim=True), train.std(0, unbiased=False, keepdim=True) + STD_EPS


def standardize(train: torch.Tensor, *others: torch.Tensor) -> list[torch.Tensor]:
    """Whiten with the mean and (population) std of `train`, as big_vision does."""
    mean, std = feature_stats(train)
    return [(x - mean) / std for x in (train, *others)]
