"""Drawing the figures with matplotlib (Agg backend, PNG files), several encoders side by side."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from mpp.fileio import save_figure


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


TILE_GAP = 1  # pixels between a mosaic's tiles
FILTER_COLS = 7  # tiles a row of the filter figure (4 rows of filters.filter_components' 28)


def mosaic(tiles: np.ndarray, cols: int, fill: float = np.nan) -> np.ndarray:
    """Tiles (n, h, w[, c]) -> one array of ceil(n / cols) x cols tiles, TILE_GAP pixels of `fill` apart."""
    n, h, w, gap = *tiles.shape[:3], TILE_GAP
    rows = math.ceil(n / cols)
    out = np.full((rows * (h + gap) - gap, cols * (w + gap) - gap, *tiles.shape[3:]), fill, dtype=float)
    for i, t in enumerate(tiles):
        r, c = divmod(i, cols)
        out[r * (h + gap):r * (h + gap) + h, c * (w + gap):c * (w + gap) + w] = t
    return out


def attention_distance(distances: dict[str, torch.Tensor], patch_size: dict[str, int], img_size: dict[str, int],
                       path: Path) -> None:
    """Mean attention distance (pixels) of every head against depth, one colour per encoder, on
    one set of axes (ViT paper Fig. 7 right). Pixels, as the paper's, each of the encoder's own
    images: the legend gives each encoder's resolution, as encoders at different ones are not
    on one scale (uniform attention spans about half the image side at any)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    n = len(distances)
    for i, (name, d) in enumerate(distances.items()):
        layers, heads = d.shape
        x = np.repeat(np.arange(1, layers + 1), heads) + (i - (n - 1) / 2) * 0.6 / max(n, 1)
        ax.scatter(x, d.flatten().numpy(), s=14, alpha=0.75, label=f"{name} (patch {patch_size[name]} px of {img_size[name]} px images)")
    ax.set_xlabel("network depth (layer)")
    ax.set_ylabel("mean attention distance (pixels)" if len(set(img_size.values())) == 1 else
                  "mean attention distance\n(pixels of each encoder's own images)")
    ax.set_title("Mean attention distance per head")
    ax.set_xticks(range(1, max(d.shape[0] for d in distances.values()) + 1))
    ax.set_ylim(0, 1.05 * max(d.max().item() for d in distances.values()))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=min(n, 2))  # below: clear of the points
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def position_similarity(sims: dict[str, torch.Tensor], grids: dict[str, tuple[int, int]], path: Path) -> None:
    """Per encoder, a grid of small maps: the map at (row, col) is that position's embedding's
    cosine similarity to every position (ViT paper Fig. 7 centre)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(sims), figsize=(4.6 * len(sims) + 0.8, 4.8), squeeze=False)
    for ax, (name, s) in zip(axes[0], sims.items()):
        gh, gw = grids[name]
        im = ax.imshow(mosaic(s.view(-1, gh, gw).numpy(), cols=gw), cmap="viridis", vmin=-1, vmax=1,
                       interpolation="nearest")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("input patch column")
        ax.set_ylabel("input patch row")
        ax.set_xticks([(c + 0.5) * (gw + 1) - 1 for c in range(gw)], range(1, gw + 1), fontsize=6)
        ax.set_yticks([(r + 0.5) * (gh + 1) - 1 for r in range(gh)], range(1, gh + 1), fontsize=6)
    fig.colorbar(im, ax=axes[0].tolist(), fraction=0.03, label="cosine similarity")
    fig.suptitle("Position embedding similarity")
    save_figure(fig, path, dpi=120)


def filters(components: dict[str, torch.Tensor], path: Path) -> None:
    """Per encoder, the first principal components of the patch-embedding filters as RGB tiles,
    each stretched to [0, 1] on its own (ViT paper Fig. 7 left); the caption says so, and that a
    component's sign is arbitrary: neither contrast nor a colour and its complement compare."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(components), figsize=(4.0 * len(components), 3.2), squeeze=False)
    for ax, (name, c) in zip(axes[0], components.items()):
        lo = c.amin((1, 2, 3), keepdim=True)
        hi = c.amax((1, 2, 3), keepdim=True)
        tiles = ((c - lo) / (hi - lo).clamp_min(1e-12)).permute(0, 2, 3, 1).numpy()
        ax.imshow(mosaic(tiles, cols=FILTER_COLS, fill=1.0), interpolation="nearest")
        ax.set_title(name, fontsize=9)
        ax.axis("off")
    fig.suptitle("RGB embedding filters (first principal components)\nby explained variance, row by row; each "
                 "tile scaled\nto [0, 1] on its own; a component's sign is arbitrary", fontsize=10)
    fig.tight_layout(w_pad=3.0)
    save_figure(fig, path, dpi=120)


def predictions(grid: torch.Tensor, name: str, accuracy: float, rows: int, images: int, path: Path) -> None:
    """The MPP prediction grid (uint8 H x W x 3 from `predictions.prediction_grid`, four panels per
    row, `rows` images) with its column labels and a title giving the colour `accuracy` over
    `images` images: it names that count, as the grid shows only the first few (or, with more rows
    than `images`, images beyond those the accuracy counts)."""
    plt = _pyplot()
    h, w = grid.shape[:2]
    fig, ax = plt.subplots(figsize=(max(7.0, w / 80), h / 80 + 1.0), dpi=100)
    ax.imshow(grid.numpy(), interpolation="nearest")
    labels = ["input", "corrupted\nred: masked\nyellow: other patch\ncyan: kept",
              "predicted\nmean colours\n(class centres)", "true\nmean colours\n(class centres)"]
    ax.set_xticks([(i + 0.5) * w / 4 for i in range(4)], labels, fontsize=8)
    ax.xaxis.tick_top()
    ax.tick_params(length=0)
    ax.set_yticks([])
    for side in ax.spines.values():
        side.set_visible(False)
    shown, counted = (f"{rows} of {images} images", f"all {images}") if rows <= images else \
        (f"{rows} images", f"the first {images} of them")
    ax.set_title(f"{name}: MPP predictions on the chosen patches of the first {shown}\n"
                 f"{100 * accuracy:.0f}% of the chosen patches of {counted} fall in the true colour class",
                 fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)
