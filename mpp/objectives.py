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

import torch
import torch.nn.functional as F
from timm.layers import trunc_normal_
from torch import nn

from mpp.data.transforms import normalize, to_float01

MPP_TARGETS = ("mean_color", "mean_color_regression", "downsampled", "pixels")
DOWNSAMPLED_CELLS = 4  # the `downsampled` target: a 4x4 downsized patch, one colour class per cell


def patches(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, C, p, p), patches in row-major order (the encoder's token order)."""
    B, C, H, W = images.shape
    p = patch_size
    if H % p or W % p:
        raise ValueError(f"image size {H}x{W} is not a multiple of the patch size {p}")
    x = images.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(B, (H // p) * (W // p), C, p, p)


def quantize(colors: torch.Tensor, bits: int = 3) -> torch.Tensor:
    """Colours (..., 3) in [0, 1] -> class (r << 2*bits) | (g << bits) | b, with per channel
    level = min(floor(value * 2**bits), 2**bits - 1) (values outside [0, 1] are clamped)."""
    levels = (colors * 2 ** bits).floor().clamp(0, 2 ** bits - 1).long()
    return (levels[..., 0] << 2 * bits) | (levels[..., 1] << bits) | levels[..., 2]


def _exact(x: torch.Tensor) -> torch.Tensor:
    """float64 where the device has it: means of float32 pixels are then exact (no class flips at
    level boundaries such as a mean of exactly 1/8)."""
    return x.double() if x.device.type != "mps" else x.float()


def mean_color_targets(images01: torch.Tensor, patch_size: int, bits: int = 3) -> torch.Tensor:
    """The paper's MPP target: images (B, 3, H, W) in [0, 1] -> long (B, N), each patch's mean
    colour quantised to `bits` per channel (512 classes at 3 bits), row-major patch order."""
    with torch.autocast(images01.device.type, enabled=False):
        return quantize(_exact(patches(images01, patch_size)).mean((-1, -2)), bits)


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
    shares = [f * K / (mask + random + keep) for f in (mask, random, keep)]
    base = [math.floor(s) for s in shares]
    cum = [0.0]
    for s, b in zip(shares, base):
        cum.append(cum[-1] + max(s - b, 0.0))
    cum[-1] = float(K - sum(base))  # the whole number of leftover units, free of float error
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
    counts = torch.zeros(num_classes, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float))
    return counts.max() / flat.numel()


class Task(nn.Module):
    """The encoder plus an objective; turns uint8 images into the encoder's normalised input."""

    def __init__(self, encoder: nn.Module, data_cfg):
        super().__init__()
        self.encoder = encoder
        self.mean, self.std = tuple(data_cfg.mean), tuple(data_cfg.std)

    def inputs(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 (B, 3, H, W) -> (pixels in [0, 1], normalised encoder input)."""
        if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be uint8 (B, 3, H, W), got {images.dtype} {tuple(images.shape)}")
        images01 = to_float01(images)
        return images01, normalize(images01, self.mean, self.std)

    def no_weight_decay(self) -> set[str]:
        return {f"encoder.{n}" for n in self.encoder.no_weight_decay()}


class MPPTask(Task):
    """Masked patch prediction with one of MPP_TARGETS; a linear head on the chosen tokens."""

    def __init__(self, encoder: nn.Module, mpp_cfg, data_cfg):
        super().__init__(encoder, data_cfg)
        if mpp_cfg.target not in MPP_TARGETS:
            raise ValueError(f"mpp.target={mpp_cfg.target!r}; choose one of {', '.join(MPP_TARGETS)}")
        self.cfg = mpp_cfg
        self.num_colors = 2 ** (3 * mpp_cfg.bits)
        p = encoder.patch_size
        out = {"mean_color": self.num_colors, "mean_color_regression": 3,
               "downsampled": DOWNSAMPLED_CELLS ** 2 * self.num_colors, "pixels": 3 * p * p}[mpp_cfg.target]
        self.head = _linear(encoder.embed_dim, out)

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None):
        images01, x = self.inputs(images)
        c = self.cfg
        B, N = images.shape[0], self.encoder.num_patches
        corruption = sample_corruption(B, N, c.ratio, c.mask, c.random, c.keep, device=images.device)
        index = corruption.index
        chosen = self.encoder(x, corruption, rows=index + self.encoder.vit.num_prefix_tokens)  # (B, K, D)
        pred = self.head(chosen).float()  # (B, K, out): the loss in fp32
        with torch.autocast(images.device.type, enabled=False):
            pix = patches(images01, self.encoder.patch_size)
            pix = _exact(torch.gather(pix, 1, index.view(B, -1, 1, 1, 1).expand(-1, -1, *pix.shape[2:])))
            colors = pix.mean((-1, -2))  # (B, K, 3)
            classes = quantize(colors, c.bits)
            if c.target == "mean_color":
                loss = F.cross_entropy(pred.flatten(0, 1), classes.flatten())
                guess = pred.argmax(-1)
            elif c.target == "mean_color_regression":
                loss = F.mse_loss(pred, colors.float())
                guess = quantize(pred, c.bits)
            elif c.target == "downsampled":
                cells = F.adaptive_avg_pool2d(pix.flatten(0, 1), DOWNSAMPLED_CELLS)  # (B*K, 3, 4, 4)
                classes = quantize(cells.flatten(2).transpose(1, 2), c.bits).view(B, -1, DOWNSAMPLED_CELLS ** 2)
                pred = pred.view(*classes.shape, self.num_colors)
                loss = F.cross_entropy(pred.flatten(0, 2), classes.flatten())
                guess = pred.argmax(-1)
            else:  # pixels
                loss = F.mse_loss(pred, pix.flatten(2).float())
                guess = quantize(pred.view(B, -1, 3, pix.shape[-1] ** 2).mean(-1), c.bits)
        with torch.no_grad():
            metrics = {"loss": loss.detach(), "acc": (guess == classes).float().mean(),
                       "baseline": _batch_mode_accuracy(classes, self.num_colors)}
        return loss, metrics


class LabelTask(Task):
    """Classification from a pooled token: the supervised pre-training head (one tanh hidden
    layer on the [class] token) and the fine-tuning head (zero-initialised linear, token | avg)."""

    def __init__(self, encoder: nn.Module, data_cfg, head: nn.Module, pool: str, label_smoothing: float):
        super().__init__(encoder, data_cfg)
        if pool not in ("token", "avg"):
            raise ValueError(f"pool={pool!r}; choose token or avg")
        self.head, self.pool, self.label_smoothing = head, pool, label_smoothing

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 images -> float32 class logits (B, num_classes)."""
        tokens = self.encoder(self.inputs(images)[1])
        pooled = tokens[:, 0] if self.pool == "token" else tokens[:, 1:].mean(1)
        return self.head(pooled).float()

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None):
        if labels is None:
            raise ValueError("this objective needs labels: use labeled shards (with 'cls') for data.train")
        logits = self.logits(images)
        loss = F.cross_entropy(logits, labels, label_smoothing=self.label_smoothing)
        with torch.no_grad():
            metrics = {"loss": loss.detach(), "acc": (logits.argmax(-1) == labels).float().mean()}
        return loss, metrics


def build_task(cfg, encoder: nn.Module, num_classes: int | None) -> Task:
    """The Task for `cfg.objective` (mpp | supervised | classify) around `encoder`."""
    if cfg.objective == "mpp":
        return MPPTask(encoder, cfg.mpp, cfg.data)
    if not num_classes or num_classes < 2:
        raise ValueError(f"objective '{cfg.objective}' needs labeled data with >= 2 classes, got num_classes={num_classes}")
    D = encoder.embed_dim
    if cfg.objective == "supervised":
        hidden = cfg.supervised.hidden_dim or D
        head = nn.Sequential(_linear(D, hidden), nn.Tanh(), _linear(hidden, num_classes))
        return LabelTask(encoder, cfg.data, head, "token", cfg.supervised.label_smoothing)
    if cfg.objective == "classify":
        return LabelTask(encoder, cfg.data, _linear(D, num_classes, zero=True), cfg.finetune.pool,
                         cfg.finetune.label_smoothing)
    raise ValueError(f"objective={cfg.objective!r}; choose mpp, supervised or classify")
