"""Per-sample image transforms (PIL -> uint8 CHW tensor) and the per-batch float conversion.

Workers produce uint8 images (4x less to move than float); the model side calls `to_float01` and
`normalize` on the device. The per-sample transforms receive a lazily opened PIL image so they can
ask PIL's JPEG `draft` mode to decode at a reduced size when the crop is much smaller than the
image (a 1/2, 1/4 or 1/8 scale IDCT costs a fraction of a full decode), then crop and resize in one
antialiased PIL `resize(box=...)` call.
"""
from __future__ import annotations

import math
import random
from typing import Sequence

import numpy as np
import torch
from PIL import Image

INTERPOLATION = Image.Resampling.BILINEAR


def to_float01(images: torch.Tensor) -> torch.Tensor:
    """uint8 (B, 3, H, W) -> float32 in [0, 1], on the images' device."""
    return images.to(torch.float32).div_(255.0)


def normalize(images01: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """(images01 - mean) / std per channel; mean/std are 3 numbers (e.g. data.mean, data.std)."""
    m = torch.as_tensor(mean, dtype=images01.dtype, device=images01.device).view(-1, 1, 1)
    s = torch.as_tensor(std, dtype=images01.dtype, device=images01.device).view(-1, 1, 1)
    return (images01 - m) / s


def _draft(img: Image.Image, need_w: float, need_h: float) -> float:
    """Let a JPEG decode at the smallest 1/2^k scale that keeps >= need_w x need_h pixels.

    Returns the exact reduction factor (1.0 when nothing changed); the image is not decoded yet.
    """
    if img.format != "JPEG" or img.width < 2 * need_w or img.height < 2 * need_h:
        return 1.0
    width = img.width
    drafted = img.draft("RGB", (max(1, math.ceil(need_w)), max(1, math.ceil(need_h))))
    return width / drafted[1][2] if drafted else 1.0  # draft's box: the original in new pixels


def _rgb_tensor(img: Image.Image) -> torch.Tensor:
    """Contiguous uint8 CHW (torchvision's pil_to_tensor returns a strided view, which makes the
    batch stack a slow strided copy: ~3x the cost of this numpy transpose at 224 px)."""
    pixels = np.asarray(img if img.mode == "RGB" else img.convert("RGB"))
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))


def crop_box(rng: random.Random, width: int, height: int, scale: Sequence[float],
             ratio: Sequence[float] = (3 / 4, 4 / 3)) -> tuple[float, float, float, float]:
    """Inception crop (left, top, w, h): torchvision RandomResizedCrop.get_params' algorithm, drawn
    from a seeded `random.Random` so augmentation is reproducible per worker without touching
    torch's global RNG (and costs microseconds, not several tensor ops)."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, width - w), rng.randint(0, height - h), w, h
    in_ratio = width / height  # fallback: the whole image centre-cropped to the ratio range
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        w, h = round(height * max(ratio)), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


class TrainTransform:
    """Random resized ("inception") crop to img_size with area scale `scale`, then a horizontal
    flip with probability `hflip` (the paper's pre-training augmentation)."""

    def __init__(self, img_size: int, scale: Sequence[float] = (0.08, 1.0), hflip: float = 0.5):
        self.size, self.scale, self.hflip = img_size, tuple(scale), hflip

    def __call__(self, img: Image.Image, rng: random.Random) -> torch.Tensor:
        left, top, w, h = crop_box(rng, img.width, img.height, self.scale)
        flip = rng.random() < self.hflip
        f = _draft(img, img.width * self.size / w, img.height * self.size / h)
        img = img.convert("RGB") if img.mode != "RGB" else img
        out = img.resize((self.size, self.size), INTERPOLATION,
                         box=(left / f, top / f, (left + w) / f, (top + h) / f))
        if flip:
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return _rgb_tensor(out)


class EvalTransform:
    """Resize the shorter side to floor(img_size / crop_pct), then centre-crop img_size (timm's
    evaluation transform). At crop_pct=1 and native size it returns the pixels unchanged."""

    def __init__(self, img_size: int, crop_pct: float = 0.875):
        self.size = img_size
        self.resize = math.floor(img_size / crop_pct)

    def __call__(self, img: Image.Image, rng: random.Random | None = None) -> torch.Tensor:
        width, height = img.size
        side = min(width, height) * self.size / self.resize  # the centre square, original pixels
        f = _draft(img, width * self.size / side, height * self.size / side)
        img = img.convert("RGB") if img.mode != "RGB" else img
        if f == 1.0 and side == self.size:  # no resize: a plain centre crop (exact pixels)
            left, top = round((width - side) / 2), round((height - side) / 2)
            out = img.crop((left, top, left + self.size, top + self.size))
        else:
            left, top = (width - side) / 2, (height - side) / 2
            out = img.resize((self.size, self.size), INTERPOLATION,
                             box=(left / f, top / f, (left + side) / f, (top + side) / f))
        return _rgb_tensor(out)


def build_transform(img_size: int, train: bool, data_cfg) -> TrainTransform | EvalTransform:
    """The transform for a loader: train augmentation or the evaluation crop (from DataConfig)."""
    if train:
        return TrainTransform(img_size, data_cfg.crop_scale, data_cfg.hflip)
    return EvalTransform(img_size, data_cfg.eval_crop_pct)
