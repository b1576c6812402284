"""MPP targets: what the head predicts for each chosen patch, from its true pixels in [0, 1].

The paper's is `mean_color` (B.1.2): the patch's mean colour, 3 bits a channel, one of 512
classes; its alternatives, `downsampled` (a 4x4 downsized patch, a colour class per cell) and
regression of the mean colour or of every pixel; and targets that are not the paper's. Each is a
`Target` in TARGETS, whose names are config's `mpp.target` choices.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

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

