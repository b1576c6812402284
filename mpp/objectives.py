"""Training objectives on top of the encoder: MPP (masked patch prediction), supervised, classify.

A `Task` (from `build_task`) holds the encoder and the objective's head; `forward(images_uint8,
labels=None) -> (loss, metrics)` with metrics as 0-d tensors (nothing here forces a host sync).
Inputs are normalised for the encoder inside the Task (mean/std from the data config); MPP
targets come from the true pixels in [0, 1].

MPP (ViT paper, section 4.6 / B.1.2): per image exactly K = round(ratio * N) patches are chosen
(round half up); of those, the mask / random-other / keep counts are K times the configured
fractions, rounded per image by systematic stochastic rounding, so each image's counts are the
floor or ceiling of K * fraction, always sum to K, and their expectation is exactly K * fraction
(80/10/10 over many draws, with no rounding bias). The head and loss see only the K chosen
tokens (gathered by index: a fixed count, so no host sync and K/N of the head's cost), and the
encoder's last block computes its row-wise parts for them alone (`MaskedEncoder.forward(rows=)`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from timm.layers import trunc_normal_
from torch import nn

from mpp.config import ConfigError
from mpp.data.transforms import normalize, to_float01
from mpp.models import POOLS, create_encoder, encoder_digest, encoder_from

DOWNSAMPLED_CELLS = 4  # the `downsampled` target: a 4x4 downsized patch, one colour class per cell
HOG_CELLS, HOG_BINS = 2, 9  # the `hog` target: 2x2 cells per patch, 9 orientations over 0-180 degrees


def patches(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, C, p, p), patches in row-major order (the encoder's token order)."""
    B, C, H, W = images.shape
    p = patch_size
    if H % p or W % p:
        raise ValueError(f"image size {H}x{W} is not a multiple of the patch size {p}")
    x = images.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(B, (H // p) * (W // p), C, p, p)


def _color_levels(colors: torch.Tensor, bits: int) -> torch.Tensor:
    """Each channel's level, min(floor(value * 2**bits), 2**bits - 1), values clamped to [0, 1]."""
    return (colors * 2 ** bits).floor().clamp(0, 2 ** bits - 1).long()


def _pack(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """Channel levels (..., 3) -> colour class (r << 2*bits) | (g << bits) | b."""
    return (levels[..., 0] << 2 * bits) | (levels[..., 1] << bits) | levels[..., 2]


def quantize(colors: torch.Tensor, bits: int = 3) -> torch.Tensor:
    """Colours (..., 3) in [0, 1] -> class (r << 2*bits) | (g << bits) | b, with per channel
    level = min(floor(value * 2**bits), 2**bits - 1) (values outside [0, 1] are clamped)."""
    return _pack(_color_levels(colors, bits), bits)


def exact(x: torch.Tensor) -> torch.Tensor:
    """float64 where the device has it: means of float32 pixels are then exact (no class flips at
    level boundaries such as a mean of exactly 1/8)."""
    return x.double() if x.device.type != "mps" else x.float()


def mean_color_targets(images01: torch.Tensor, patch_size: int, bits: int = 3) -> torch.Tensor:
    """The paper's MPP target: images (B, 3, H, W) in [0, 1] -> long (B, N), each patch's mean
    colour quantised to `bits` per channel (512 classes at 3 bits), row-major patch order."""
    with torch.autocast(images01.device.type, enabled=False):
        return _mean_classes(exact(patches(images01, patch_size)), bits)  # the MPP task's own


def _level_centres(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """Channel levels -> the centres of their value ranges in [0, 1]."""
    return (levels.float() + 0.5) / 2 ** bits


def class_colors(classes: torch.Tensor, bits: int) -> torch.Tensor:
    """Colour classes (as `quantize` makes them) -> the centres of their levels (..., 3) in [0, 1]."""
    m = 2 ** bits - 1
    return _level_centres(torch.stack([(classes >> 2 * bits) & m, (classes >> bits) & m, classes & m], -1), bits)


# ---- MPP targets: each is one `Target` in TARGETS (config's mpp.target choices come from it)

@dataclass(frozen=True)
class Target:
    """What the MPP head predicts for each chosen patch. `outputs(bits, patch_size)`: the head's
    width at `bits` a colour channel; `loss(pred, pix, bits) -> (loss, predicted classes, true classes)` from the fp32
    head output (B, K, out) and the chosen patches' true pixels (B, K, 3, p, p); `colors(pred,
    bits)`: the predicted mean colour of each patch (B, K, 3), for the prediction figures (None for
    a target that predicts no colour)."""
    outputs: Callable[[int, int], int]
    loss: Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    colors: Callable[[torch.Tensor, int], torch.Tensor] | None


def _mean_classes(pix, bits):
    """Each chosen patch's mean-colour class (B, K), the class a colour accuracy scores (the
    regression quantises the colours its loss needs; downsampled scores its cells' classes)."""
    return quantize(pix.mean((-1, -2)), bits)


def _mean_color_loss(pred, pix, bits):
    classes = _mean_classes(pix, bits)
    return F.cross_entropy(pred.flatten(0, 1), classes.flatten()), pred.argmax(-1), classes


def _regression_loss(pred, pix, bits):
    colors = pix.mean((-1, -2))
    return F.mse_loss(pred, colors.float()), quantize(pred, bits), quantize(colors, bits)


def _cells(pix):
    """The mean colour of each cell of the downsized patch: (B, K, 3, p, p) -> (B, K, 16, 3). At a
    patch size that 4 does not divide (vit_h14) adaptive pooling's cells overlap by a pixel."""
    cells = F.adaptive_avg_pool2d(pix.flatten(0, 1), DOWNSAMPLED_CELLS)  # (B*K, 3, 4, 4)
    return cells.flatten(2).transpose(1, 2).view(*pix.shape[:2], DOWNSAMPLED_CELLS ** 2, 3)


def _downsampled_loss(pred, pix, bits):
    classes = quantize(_cells(pix), bits)
    pred = pred.view(*classes.shape, -1)
    return F.cross_entropy(pred.flatten(0, 2), classes.flatten()), pred.argmax(-1), classes


def _channel_levels(pred, bits):
    """The channels head's output (B, K, 16 * 3 * 2^bits) -> logits (B, K, 16, 3, 2^bits)."""
    return pred.view(*pred.shape[:2], DOWNSAMPLED_CELLS ** 2, 3, 2 ** bits)


def _downsampled_channels_loss(pred, pix, bits):
    """Each cell's channels as separate level classes; the accuracy scores the joint colour class."""
    levels = _color_levels(_cells(pix), bits)
    logits = _channel_levels(pred, bits)
    return F.cross_entropy(logits.flatten(0, 3), levels.flatten()), _pack(logits.argmax(-1), bits), _pack(levels, bits)


def _color_histogram_loss(pred, pix, bits):
    px = quantize(pix.flatten(3).transpose(2, 3), bits)  # (B, K, p*p): each pixel's colour class
    hist = torch.zeros_like(pred).scatter_add_(-1, px, torch.full_like(px, 1.0 / px.shape[-1], dtype=pred.dtype))
    guess = quantize(_histogram_mean(pred.detach(), bits), bits)  # a metric: no graph for it
    return F.cross_entropy(pred.flatten(0, 1), hist.flatten(0, 1)), guess, _mean_classes(pix, bits)


def _histogram_mean(pred, bits):
    """The mean colour of the predicted distribution over colour classes (B, K, 3)."""
    return pred.softmax(-1) @ class_colors(torch.arange(pred.shape[-1], device=pred.device), bits)


def hog(pix: torch.Tensor) -> torch.Tensor:
    """Histograms of oriented gradients of each patch alone (MaskFeat's target, Wei et al. 2022):
    (B, K, 3, p, p) in [0, 1] -> (B, K, HOG_BINS * HOG_CELLS**2). Central differences of the grey
    image (edge pixels repeated at the patch's border), each pixel's magnitude split linearly
    between its two nearest of HOG_BINS unsigned orientations, averaged over each of the
    HOG_CELLS x HOG_CELLS cells, the vector L2-normalised per patch (a flat patch stays zero)."""
    B, K, _, p, _ = pix.shape
    grey = pix.float().mean(2).reshape(B * K, 1, p, p)
    gx = F.pad(grey, (1, 1, 0, 0), mode="replicate")
    gy = F.pad(grey, (0, 0, 1, 1), mode="replicate")
    gx, gy = gx[..., 2:] - gx[..., :-2], gy[..., 2:, :] - gy[..., :-2, :]
    magnitude = torch.hypot(gx, gy)
    position = torch.remainder(torch.atan2(gy, gx), math.pi) / math.pi * HOG_BINS
    low = position.floor()
    frac = position - low
    low = low.long() % HOG_BINS
    hist = torch.zeros(B * K, HOG_BINS, p, p, device=pix.device)
    hist.scatter_add_(1, low, magnitude * (1 - frac)).scatter_add_(1, (low + 1) % HOG_BINS, magnitude * frac)
    h = F.avg_pool2d(hist, p // HOG_CELLS).reshape(B, K, -1)  # (bin, cell row, cell column) order
    return h / (h.norm(dim=-1, keepdim=True) + 1e-3)


def _hog_loss(pred, pix, bits):
    """Squared error summed over the histogram; the `acc` metric: the strongest bin found."""
    true = hog(pix)
    return F.mse_loss(pred, true, reduction="none").sum(-1).mean(), pred.detach().argmax(-1), true.argmax(-1)


def _pixels_loss(pred, pix, bits):
    guess = quantize(pred.view(*pix.shape[:3], -1).mean(-1), bits)
    return F.mse_loss(pred, pix.flatten(2).float()), guess, _mean_classes(pix, bits)


TARGETS: dict[str, Target] = {
    "mean_color": Target(  # the paper's: one of 2^(3 bits) colour classes
        outputs=lambda bits, p: 2 ** (3 * bits), loss=_mean_color_loss,
        colors=lambda pred, bits: class_colors(pred.argmax(-1), bits)),
    "mean_color_regression": Target(  # the mean colour itself, L2
        outputs=lambda bits, p: 3, loss=_regression_loss, colors=lambda pred, bits: pred.clamp(0, 1)),
    "downsampled": Target(  # a colour class for each cell of a 4x4 downsized patch
        outputs=lambda bits, p: DOWNSAMPLED_CELLS ** 2 * 2 ** (3 * bits), loss=_downsampled_loss,
        colors=lambda pred, bits: class_colors(
            pred.view(*pred.shape[:2], DOWNSAMPLED_CELLS ** 2, -1).argmax(-1), bits).mean(2)),
    "downsampled_channels": Target(  # not the paper's: downsampled with each channel's level its own class
        outputs=lambda bits, p: DOWNSAMPLED_CELLS ** 2 * 3 * 2 ** bits,  # 2^bits levels a channel
        loss=_downsampled_channels_loss,
        colors=lambda pred, bits: _level_centres(_channel_levels(pred, bits).argmax(-1), bits).mean(2)),
    "color_histogram": Target(  # not the paper's: the share of the patch's pixels in each colour class
        outputs=lambda bits, p: 2 ** (3 * bits), loss=_color_histogram_loss, colors=_histogram_mean),
    "hog": Target(  # not the paper's (MaskFeat's): the patch's gradient-orientation histograms, L2
        outputs=lambda bits, p: HOG_CELLS ** 2 * HOG_BINS, loss=_hog_loss, colors=None),
    "pixels": Target(  # every pixel, L2
        outputs=lambda bits, p: 3 * p * p, loss=_pixels_loss,
        colors=lambda pred, bits: pred.view(*pred.shape[:2], 3, -1).mean(-1).clamp(0, 1)),
}


@dataclass
class Corruption:
    """Which patches the MPP objective corrupts, and how (all (B, N) unless noted)."""
    chosen: torch.Tensor   # bool: the loss is computed on these
    masked: torch.Tensor   # bool: patch embedding replaced by the [mask] embedding
    src: torch.Tensor      # long: take the patch embedding of this index (own index if unchanged)
    index: torch.Tensor    # long (B, K): the chosen positions, K = round(ratio * N) for every image


def sample_corruption(B: int, N: int, ratio: float = 0.5, mask: float = 0.8, random: float = 0.1,
                      keep: float = 0.1, device: torch.device | str = "cpu",
                      generator: torch.Generator | None = None) -> Corruption:
    """Draw a corruption plan on `device` (vectorised, no host sync); see the module docstring."""
    K = math.floor(ratio * N + 0.5)
    if not 1 <= K <= N:
        raise ValueError(f"mpp.ratio={ratio} chooses {K} of {N} patches; it must choose at least one")
    if random > 0 and N < 2:
        raise ValueError("mpp.random > 0 needs at least 2 patches per image (a random OTHER patch)")
    # rounded: a sum like 0.7 + 0.2 + 0.1 = 0.9999999999999999 would leave a whole share (7) a hair
    # above itself, and a draw of u = 0 would then give it one patch more than its ceiling
    shares = [round(f * K / (mask + random + keep), 9) for f in (mask, random, keep)]
    base = [math.floor(s) for s in shares]
    cum = [0.0]
    for s, b in zip(shares, base):
        cum.append(cum[-1] + max(s - b, 0.0))
    # generator only when given: torch.compile fails on generator=None with a symbolic batch size
    rng = {"device": device} | ({"generator": generator} if generator is not None else {})
    # systematic sampling: leftover units at u, u+1, ... land in share j with probability frac_j
    u = torch.rand(B, 1, **rng)
    extra = [torch.ceil(cum[j + 1] - u) - torch.ceil(cum[j] - u) for j in range(2)]
    n_mask = base[0] + extra[0]
    n_masked_or_random = n_mask + base[1] + extra[1]

    perm = torch.rand(B, N, **rng).argsort(dim=1)
    positions = torch.arange(N, device=device).expand(B, N)
    rank = torch.empty_like(perm).scatter_(1, perm, positions)  # rank of each patch in a random order
    masked = rank < n_mask
    swapped = (rank >= n_mask) & (rank < n_masked_or_random)
    other = (positions + torch.randint(1, max(N, 2), (B, N), **rng)) % N
    return Corruption(chosen=rank < K, masked=masked, src=torch.where(swapped, other, positions),
                      index=perm[:, :K])


def _linear(dim_in: int, dim_out: int, zero: bool = False) -> nn.Linear:
    """A head layer: zeros (fine-tuning head, as the paper) or timm's trunc-normal(.02) init."""
    layer = nn.Linear(dim_in, dim_out)
    if zero:
        nn.init.zeros_(layer.weight)
    else:
        trunc_normal_(layer.weight, std=0.02)
    nn.init.zeros_(layer.bias)
    return layer


def _batch_mode_accuracy(classes: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Accuracy of always predicting the batch's most frequent class (bincount without a sync)."""
    flat = classes.reshape(-1)
    counts = torch.zeros(num_classes, device=flat.device).scatter_add_(0, flat,
                                                                       torch.ones_like(flat, dtype=torch.float))
    return counts.max() / flat.numel()


class Task(nn.Module):
    """The encoder plus an objective; turns uint8 images into the encoder's normalised input.

    A Task class also says what its run needs, so the trainer asks it instead of testing the
    objective's name: `labeled` (whether forward needs labels), `encoder_for(cfg)` (the encoder it
    starts from), `origin(cfg)` (what it starts from beyond its settings, checked on resume),
    `subset(cfg)` (the training samples it reads), `begin(cfg, device, precision)` and `restore`
    (work and choices before the first step of a fresh run), `final_eval` (the evaluator of
    mpp.evaluators run on it at the end), `export(out)` and `settings(cfg)` (what it adds to the
    run directory and to metrics.json)."""
    labeled = False
    final_eval: str | None = None

    def __init__(self, encoder: nn.Module, data_cfg):
        super().__init__()
        self.encoder = encoder
        # data.mean and data.std on the model's device, as it moves: numbers copied to a GPU at every step
        # would wait there for all the work queued on it. Not in checkpoints, nor broadcast by DDP.
        self.register_buffer("norm_mean", torch.tensor(tuple(data_cfg.mean)), persistent=False)
        self.register_buffer("norm_std", torch.tensor(tuple(data_cfg.std)), persistent=False)
        self._ddp_params_and_buffers_to_ignore = ["norm_mean", "norm_std"]

    @classmethod
    def encoder_for(cls, cfg) -> nn.Module:
        """A fresh encoder of preset `cfg.model`."""
        return create_encoder(cfg.model, img_size=cfg.img_size, attn=cfg.train.attn)

    @classmethod
    def subset(cls, cfg) -> tuple | None:
        """The loader's `subset` of data.train (None: all of it)."""
        return None

    def begin(self, cfg, device: torch.device, precision: str) -> tuple[dict, bool] | None:
        """Work before the first step of a fresh run (not on resume), on the device, in the main
        process only. Returns None when it did nothing; else the figures to record in metrics.json
        (handed to every rank's `restore`, which takes up the choices among them) and whether it
        changed weights (then the trainer copies them to every rank and records the start's score)."""
        return None

    def restore(self, begun: dict) -> None:
        """Take up the choices `begin` recorded among its figures (on every rank, and again when
        the run resumes, where `begin` does not run; none)."""

    def export(self, out_dir: Path) -> None:
        """Files beyond the encoder that the finished run leaves in its directory (none)."""

    def settings(self, cfg) -> dict:
        """Settings recorded in metrics.json beside the figures (none)."""
        return {}

    def origin(self, cfg) -> dict:
        """What the run starts from beyond the settings a resume may change: recorded at the fresh
        start, and a resume from other inputs is refused (its checkpoints continue a run of the old
        ones). A pre-training's: the development splits withheld from its images, which a resume
        with others would have trained on before it withheld them, and its inputs' normalisation."""
        return {"withheld_splits": [list(w) for w in cfg.data.withhold], **normalisation(cfg)}

    def inputs(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 (B, 3, H, W) -> (pixels in [0, 1], normalised encoder input)."""
        if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be uint8 (B, 3, H, W), got {images.dtype} {tuple(images.shape)}")
        images01 = to_float01(images)
        return images01, normalize(images01, self.norm_mean, self.norm_std)

    def no_weight_decay(self) -> set[str]:
        return {f"encoder.{n}" for n in self.encoder.no_weight_decay()}


class MPPTask(Task):
    """Masked patch prediction with one of TARGETS; a linear head on the chosen tokens. Exports
    its head and [mask] embedding (mpp_head.safetensors, for mpp.figures)."""

    def __init__(self, encoder: nn.Module, mpp_cfg, data_cfg):
        super().__init__(encoder, data_cfg)
        if mpp_cfg.target not in TARGETS:
            raise ValueError(f"mpp.target={mpp_cfg.target!r}; choose one of {', '.join(TARGETS)}")
        self.cfg, self.target = mpp_cfg, TARGETS[mpp_cfg.target]
        self.num_colors = 2 ** (3 * mpp_cfg.bits)
        self.head = _linear(encoder.embed_dim, self.target.outputs(mpp_cfg.bits, encoder.patch_size))

    @classmethod
    def from_config(cls, cfg, encoder: nn.Module, num_classes: int | None) -> MPPTask:
        return cls(encoder, cfg.mpp, cfg.data)

    def export(self, out_dir: Path) -> None:
        from mpp.figures.predictions import save_mpp_head  # only a finished MPP run pays for its import
        save_mpp_head(self, out_dir)

    def corrupt(self, batch: int, device: torch.device, generator: torch.Generator | None = None) -> Corruption:
        """Which patches of each image the head predicts and how each is corrupted (mpp.ratio, the
        80/10/10 split of mpp.mask / random / keep)."""
        c = self.cfg
        return sample_corruption(batch, self.encoder.num_patches, c.ratio, c.mask, c.random, c.keep,
                                 device=device, generator=generator)

    def predict(self, x: torch.Tensor, corruption: Corruption) -> torch.Tensor:
        """The head's outputs (B, K, out) for the chosen patches of normalised images `x`, in fp32:
        with bf16 logits the colour task learns less (docs/results.md)."""
        chosen = self.encoder(x, corruption, rows=corruption.index + self.encoder.vit.num_prefix_tokens)  # (B, K, D)
        with torch.autocast(x.device.type, enabled=False):
            return self.head(chosen.float())

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None):
        images01, x = self.inputs(images)
        c, B = self.cfg, images.shape[0]
        corruption = self.corrupt(B, images.device)
        pred, index = self.predict(x, corruption), corruption.index
        with torch.autocast(images.device.type, enabled=False):  # the loss in fp32, as the head
            pix = patches(images01, self.encoder.patch_size)
            pix = exact(torch.gather(pix, 1, index.view(B, -1, 1, 1, 1).expand(-1, -1, *pix.shape[2:])))
            loss, guess, classes = self.target.loss(pred, pix, c.bits)
        with torch.no_grad():
            metrics = {"loss": loss.detach(), "acc": (guess == classes).float().mean(),
                       # hog's classes are its 36 bins, more than the colours at mpp.bits=1
                       "baseline": _batch_mode_accuracy(classes, max(self.num_colors, HOG_CELLS ** 2 * HOG_BINS))}
        return loss, metrics


class LabelTask(Task):
    """Classification from a pooled token (`pool`: token | avg, see mpp.models.POOLS). Nothing is
    corrupted, so the [mask] embedding is frozen (DDP needs every trained parameter used)."""
    labeled = True

    def __init__(self, encoder: nn.Module, data_cfg, head: nn.Module, pool: str, label_smoothing: float):
        super().__init__(encoder, data_cfg)
        if pool not in (*POOLS, "auto"):  # auto: chosen by `begin` before the first step
            raise ValueError(f"pool={pool!r}; choose one of {', '.join(POOLS)} or auto")
        self.head, self.pool, self.label_smoothing = head, pool, label_smoothing
        encoder.mask_token.requires_grad_(False)

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 images -> float32 class logits (B, num_classes)."""
        return self.classify(self.inputs(images)[1])

    def classify(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised images -> float32 class logits. The head runs in fp32 outside autocast: bf16
        logits tie often (docs/results.md), and a tie's winner is then the lowest class index, not
        the model's choice."""
        pooled = self.encoder.pool(self.encoder(x), self.pool)
        with torch.autocast(x.device.type, enabled=False):
            return self.head(pooled.float())

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None):
        if labels is None:
            raise ValueError("this objective needs labels: use labeled shards (with 'cls') for data.train")
        logits = self.logits(images)
        loss = F.cross_entropy(logits, labels, label_smoothing=self.label_smoothing)
        with torch.no_grad():
            metrics = {"loss": loss.detach(), "acc": (logits.argmax(-1) == labels).float().mean()}
        return loss, metrics


class SupervisedTask(LabelTask):
    """Supervised pre-training: one tanh hidden layer on the [class] token, as the paper."""

    @classmethod
    def from_config(cls, cfg, encoder: nn.Module, num_classes: int) -> SupervisedTask:
        D = encoder.embed_dim
        hidden = cfg.supervised.hidden_dim or D
        head = nn.Sequential(_linear(D, hidden), nn.Tanh(), _linear(hidden, num_classes))
        return cls(encoder, cfg.data, head, "token", cfg.supervised.label_smoothing)


class ClassifyTask(LabelTask):
    """Fine-tuning: a linear head on an encoder loaded from `finetune.init` (or fresh), trained on a
    label fraction of data.train and evaluated at the end (top-1/5). The head starts at zero (the
    paper) or, with finetune.head_init=probe, at the encoder's linear probe on the same training
    labels (LP-FT, Kumar et al. 2022: fine-tuning then starts where the probe ends instead of
    first distorting the features to fit a blank head). finetune.pool=auto chooses the
    representation the way the linear probe does, but on this run's own labels only (a 10%-label
    fine-tune must not lean on a probe of all the labels): a probe of its training part, scored on
    its development split where it has one (which a comparison's pre-trainings never saw), else on
    a held-out part of its training labels. The probe head's L2 is chosen on the same images."""
    final_eval = "classify"

    @classmethod
    def from_config(cls, cfg, encoder: nn.Module, num_classes: int) -> ClassifyTask:
        f = cfg.finetune
        return cls(encoder, cfg.data, _linear(encoder.embed_dim, num_classes, zero=True), f.pool, f.label_smoothing)

    def begin(self, cfg, device: torch.device, precision: str) -> tuple[dict, bool] | None:
        f = cfg.finetune
        if f.head_init != "probe" and f.pool != "auto":
            return None
        from mpp.evaluators.linear_probe import probe_head  # only a run that probes pays for its import
        dev = (*self.subset(cfg)[:3], True) if f.dev_fraction > 0 else None  # its development split
        fit = probe_head(self.encoder, cfg, pool=f.pool, subset=self.subset(cfg), num_classes=self.head.out_features,
                         device=device, precision=precision, dev_subset=dev)
        weight, bias, chosen = fit.pop("weight"), fit.pop("bias"), fit.pop("pool")
        choice = {"pool": chosen, **{k: fit.pop(k) for k in [k for k in fit if k.startswith("pool_")]}}
        figures = choice if f.pool == "auto" else {}
        if f.head_init == "probe":
            with torch.no_grad():
                self.head.weight.copy_(weight)
                self.head.bias.copy_(bias)
            figures.update({f"head_probe_{k}": v for k, v in fit.items()})  # its L2, its top-1 and loss where chosen
        return figures, f.head_init == "probe"

    def restore(self, begun: dict) -> None:
        if self.pool == "auto":
            if "pool" not in begun:
                raise ConfigError("finetune.pool=auto, but the checkpoint to resume was trained through the pool its "
                                  "run's config.yaml names (finetune.pool); resume with that, or start afresh in "
                                  "another output_dir")
            if begun["pool"] not in POOLS:  # a checkpoint is untrusted input
                raise ConfigError(f"the checkpoint to resume names pool {begun['pool']!r}, not one of "
                                  f"{', '.join(POOLS)}: it is damaged; start afresh in another output_dir")
            self.pool = begun["pool"]

    @classmethod
    def encoder_for(cls, cfg) -> nn.Module:
        return encoder_from(cfg.finetune.init, "finetune.init", cfg, drop_path=cfg.finetune.drop_path)

    @classmethod
    def subset(cls, cfg) -> tuple:
        f = cfg.finetune
        return f.label_fraction, f.split_seed, f.dev_fraction, False

    def settings(self, cfg) -> dict:
        f = cfg.finetune
        return dict(init=f.init, label_fraction=f.label_fraction, dev_fraction=f.dev_fraction,
                    split_seed=f.split_seed, seed=cfg.seed, pool=self.pool, optimizer=cfg.optim.name, lr=cfg.optim.lr,
                    head_init=f.head_init)

    def origin(self, cfg) -> dict:
        """The encoder file's digest (null from scratch), and the label subset and development split
        ([label_fraction, split_seed, dev_fraction]): a resume on another split would score on
        images it had trained on; and its inputs' normalisation."""
        f = cfg.finetune
        return {"init_sha256": encoder_digest(f.init), "label_split": [f.label_fraction, f.split_seed, f.dev_fraction],
                **normalisation(cfg)}


def normalisation(cfg) -> dict:
    """The statistics a run's inputs are normalised by (data.mean, data.std), part of every run's
    origin: weights trained on inputs of one scale would go on with another, and the encoder's
    model.json would record only the last."""
    return {"normalisation": [list(cfg.data.mean), list(cfg.data.std)]}


HEAD_INITS = ("zero", "probe")  # finetune.head_init: the paper's zero head | the linear probe's (LP-FT)


# objective -> its Task: config's `objective` choices come from this table
OBJECTIVES: dict[str, type[Task]] = {"mpp": MPPTask, "supervised": SupervisedTask, "classify": ClassifyTask}


def build_task(cfg, encoder: nn.Module, num_classes: int | None) -> Task:
    """The Task for `cfg.objective` around `encoder` (`num_classes`: of the labels, when it needs them)."""
    cls = OBJECTIVES[cfg.objective]
    if cls.labeled and (not num_classes or num_classes < 2):
        raise ValueError(f"objective '{cfg.objective}' needs labeled data with >= 2 classes, "
                         f"got num_classes={num_classes}")
    return cls.from_config(cfg, encoder, num_classes)
