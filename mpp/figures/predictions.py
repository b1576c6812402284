"""What the MPP head predicts for the patches it cannot see: a grid with, per image, the input,
the corrupted view the encoder saw (masked patches grey with a red outline, patches replaced by a
random other patch outlined in yellow, chosen patches kept as they are outlined in cyan), the
predicted mean colours painted into every chosen patch, and the true mean colours there. Both are
painted at the centre of their colour class, the class the accuracy scores: a patch predicted in
its true class looks the same in both, one in another class does not.

A run dir keeps its head beside the encoder (`mpp_head.safetensors`: the head and the [mask]
embedding, written by `save_mpp_head`); runs from before that file existed are read from their
newest checkpoint. Both are safetensors: nothing is unpickled.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from mpp.checkpoint import list_checkpoints
from mpp.config import ConfigError, load_config
from mpp.evaluators.features import eval_mode
from mpp.fileio import atomic_path
from mpp.models import load_encoder, mismatched, nonfinite, take_rows
from mpp.corruption import Corruption
from mpp.objectives import MPPTask
from mpp.targets import class_colors, exact, patches, quantize

HEAD_FILE = "mpp_head.safetensors"
MASKED_RGB, RANDOM_RGB, KEPT_RGB = (0.9, 0.1, 0.1), (1.0, 0.85, 0.0), (0.0, 0.8, 1.0)


def save_mpp_head(task: MPPTask, out_dir: str | Path) -> Path:
    """Write the head and the [mask] embedding of `task` to OUT_DIR/mpp_head.safetensors."""
    state = {f"head.{k}": v for k, v in task.head.state_dict().items()}
    state["mask_token"] = task.encoder.mask_token
    path = Path(out_dir) / HEAD_FILE
    with atomic_path(path) as tmp:  # whole or absent, mode 0644 like every file of a run
        save_file({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}, str(tmp))
    return path


def load_mpp_task(run_dir: str | Path, attn: str = "auto") -> MPPTask | None:
    """The MPP task (encoder, [mask] embedding, head) of a pre-training run dir; None when the run
    is not an MPP run or has neither a head file nor a checkpoint. A head file that is no
    safetensors, or whose tensors are not those of the run's `mpp` settings, is refused in one line."""
    run = Path(run_dir)
    if not (run / "config.yaml").is_file():
        return None
    cfg = load_config(run / "config.yaml")
    if cfg.objective != "mpp":
        return None
    if (run / HEAD_FILE).is_file():
        file, prefix = run / HEAD_FILE, ""
    elif ckpts := list_checkpoints(run / "checkpoints"):
        file, prefix = ckpts[-1] / "model.safetensors", "encoder."
    else:
        return None
    try:  # safetensors only: a pickle or a truncated file is refused by the header check, never unpickled
        full = load_file(str(file))
    except Exception as e:
        raise ConfigError(f"{file} is not a readable safetensors file ({' '.join(str(e).split())[:80]}); "
                          "train or export the run again") from None
    state = {k.removeprefix(prefix): v for k, v in full.items()
             if k.startswith("head.") or k == f"{prefix}mask_token"}
    task = MPPTask(load_encoder(run, attn=attn), cfg.mpp, cfg.data)
    want = {f"head.{k}": v for k, v in task.head.state_dict().items()} | {"mask_token": task.encoder.mask_token}
    if odd := mismatched(want, {k: v.shape for k, v in state.items()}):
        raise ConfigError(f"{file}: not the MPP head of this run's mpp.target={cfg.mpp.target}, "
                          f"mpp.bits={cfg.mpp.bits} ({len(odd)} tensors missing, extra or of another shape, e.g. "
                          f"{odd[0]}); train the run again")
    if bad := nonfinite(state):
        raise ConfigError(f"{file}: {len(bad)} of its tensors hold NaN or infinite weights (e.g. {bad[0]}): a "
                          "diverged run; give a finite one")
    task.head.load_state_dict({k.removeprefix("head."): v for k, v in state.items() if k.startswith("head.")})
    with torch.no_grad():
        task.encoder.mask_token.copy_(state["mask_token"])
    return task


@dataclass
class Prediction:
    images01: torch.Tensor    # (B, 3, H, W) the input in [0, 1]
    corrupted: torch.Tensor   # (B, 3, H, W) what the encoder saw (masked patches grey)
    masked: torch.Tensor      # (B, N) bool
    swapped: torch.Tensor     # (B, N) bool: replaced by a random other patch
    chosen: torch.Tensor      # (B, N) bool: the patches the head predicts
    predicted: torch.Tensor   # (B, N, 3) predicted mean colours (zero where not chosen)
    true: torch.Tensor        # (B, N, 3) true mean colours of every patch

    def accuracy(self, bits: int) -> float:
        """Share of the chosen patches whose predicted colour falls in the true colour's class."""
        hit = quantize(self.predicted, bits) == quantize(self.true, bits)
        return hit[self.chosen].float().mean().item()


@torch.no_grad()
def predict(task: MPPTask, images: torch.Tensor, seed: int = 0, corruption: Corruption | None = None) -> Prediction:
    """Corrupt uint8 `images` as in training (a seeded draw: the training RNG is not touched; or
    `corruption`, drawn by the caller) and run the encoder and head on them."""
    enc, c = task.encoder, task.cfg
    if task.target.colors is None:
        raise ValueError(f"mpp.target={c.target} predicts no colours: there is no prediction figure for it")
    images01, x = task.inputs(images)
    B, N, p = images.shape[0], enc.num_patches, enc.patch_size
    if corruption is None:
        corruption = task.corrupt(B, images.device, generator=torch.Generator(device=images.device).manual_seed(seed))
    with eval_mode(task):
        pred = task.predict(x, corruption)
    pix = patches(images01, p)
    seen = take_rows(pix, corruption.src).masked_fill(corruption.masked[..., None, None, None], 0.5)
    predicted = torch.zeros(B, N, 3, device=images.device)
    predicted.scatter_(1, corruption.index[..., None].expand(-1, -1, 3), task.target.colors(pred, c.bits))
    own = torch.arange(N, device=images.device)
    return Prediction(images01=images01, corrupted=_unpatch(seen, enc.grid_size), masked=corruption.masked,
                      swapped=corruption.src != own, chosen=corruption.chosen, predicted=predicted,
                      true=exact(pix).mean((-1, -2)).float())  # as training averages: in float64


def _unpatch(x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """(B, N, C, p, p) patches in row-major order -> (B, C, H, W); the inverse of `patches`."""
    B, N, C, p, _ = x.shape
    return x.reshape(B, *grid, C, p, p).permute(0, 3, 1, 4, 2, 5).reshape(B, C, grid[0] * p, grid[1] * p)


def _paint(images: torch.Tensor, colors: torch.Tensor, where: torch.Tensor, grid, p: int) -> torch.Tensor:
    """`images` with the patches in `where` (B, N) filled with `colors` (B, N, 3)."""
    fill = _unpatch(colors[..., None, None].expand(-1, -1, -1, p, p), grid)
    return torch.where(_unpatch(where[:, :, None, None, None].expand(-1, -1, 1, p, p), grid), fill, images)


def _outline(images: torch.Tensor, where: torch.Tensor, rgb, grid, cell: int) -> torch.Tensor:
    """Draw a 1-pixel outline of colour `rgb` around the patches in `where` (images upscaled so
    that a patch is `cell` pixels)."""
    edge = torch.zeros(cell, cell, dtype=torch.bool, device=images.device)
    edge[[0, -1], :] = edge[:, [0, -1]] = True
    border = _unpatch(where[:, :, None, None, None] & edge, grid)
    colour = torch.tensor(rgb, device=images.device).view(1, 3, 1, 1)
    return torch.where(border, colour, images)


def prediction_grid(pred: Prediction, patch_size: int, bits: int, min_size: int = 96) -> torch.Tensor:
    """One row per image: input | corrupted view | predicted mean colours | true mean colours (the
    centres of their `bits`-a-channel colour classes), as a uint8 (H, W, 3) array; images are
    upscaled (nearest) to at least `min_size` pixels."""
    B, _, H, W = pred.images01.shape
    grid = (H // patch_size, W // patch_size)
    scale = max(1, math.ceil(min_size / H))
    cell = patch_size * scale
    up = lambda x: F.interpolate(x, scale_factor=scale, mode="nearest")  # noqa: E731
    corrupted = _outline(up(pred.corrupted), pred.masked, MASKED_RGB, grid, cell)
    corrupted = _outline(corrupted, pred.swapped, RANDOM_RGB, grid, cell)
    corrupted = _outline(corrupted, pred.chosen & ~pred.masked & ~pred.swapped, KEPT_RGB, grid, cell)
    centre = lambda c: class_colors(quantize(c, bits), bits)  # noqa: E731
    panels = [up(pred.images01), corrupted,
              up(_paint(pred.images01, centre(pred.predicted), pred.chosen, grid, patch_size)),
              up(_paint(pred.images01, centre(pred.true), pred.chosen, grid, patch_size))]
    gap = 2
    rows = F.pad(torch.cat([F.pad(x, (0, gap), value=1.0) for x in panels], -1), (0, 0, 0, gap), value=1.0)
    out = rows.permute(0, 2, 3, 1).reshape(-1, rows.shape[-1], 3)
    return (out.clamp(0, 1) * 255).round().to(torch.uint8).cpu()


def log_predictions(writer, task: MPPTask, images: torch.Tensor, step: int) -> None:
    """Add the prediction grid of `images` to a TensorBoard SummaryWriter at `step`."""
    pred = predict(task, images)
    grid = prediction_grid(pred, task.encoder.patch_size, task.cfg.bits)
    writer.add_image("mpp/predictions", grid.numpy(), step, dataformats="HWC")
