"""Mean attention distance per head and layer (ViT paper Fig. 7 right).

Attention weights are read by forward hooks on each timm `Attention` module's `qkv` projection:
the hook recomputes softmax(q k^T * scale) from the projection's output, so the forward pass
itself (fused or math attention, the training path) is not changed. For each head, the distance
of a query patch is the attention-weighted mean image-space distance (pixels, between patch
centres) to all patches, its own at distance 0 among them (the paper weights every key by its
attention); the [class] token is left out as query and key, and each query's weights over the
patches are renormalised to sum to 1.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from timm.layers.attention import Attention
from torch import nn


@contextlib.contextmanager
def record_attention(model: nn.Module, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
    """Inside the block, every forward of `model` appends each `Attention` module's weights
    (B, heads, T, T), float32, to the yielded list (in module order: layer 0 first), or with
    `reduce` what it makes of them, so that no more than one layer's weights are held at a time
    (all of a ViT-B/16's take 0.7 GB for a batch of 32)."""
    maps: list[torch.Tensor] = []
    handles = []
    for a in (m for m in model.modules() if isinstance(m, Attention)):
        def hook(_, __, qkv, a=a):
            B, T, _ = qkv.shape
            q, k, _ = qkv.float().reshape(B, T, 3, a.num_heads, a.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
            q, k = a.q_norm(q), a.k_norm(k)
            weights = ((q * a.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
            maps.append(weights if reduce is None else reduce(weights))
        handles.append(a.qkv.register_forward_hook(hook))
    if not handles:
        raise ValueError(f"{type(model).__name__} has no timm Attention modules to read attention from")
    try:
        yield maps
    finally:
        for h in handles:
            h.remove()


def patch_distances(grid: tuple[int, int], patch_size: int) -> torch.Tensor:
    """(N, N) Euclidean distances in pixels between the centres of the patches (row-major order)."""
    rows, cols = torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), indexing="ij")
    centres = torch.stack([rows.flatten(), cols.flatten()], 1).float() * patch_size
    return torch.cdist(centres, centres)


def attention_distance_sum(a: torch.Tensor, distances: torch.Tensor, num_prefix: int) -> torch.Tensor:
    """Per head, the sum over images and query patches of the attention-weighted distance of one
    layer's weights `a` (B, heads, T, T) (heads,); divide by images x patches for the mean."""
    w = a[:, :, num_prefix:, num_prefix:]
    # a query whose patch weights all underflow (every bit on the [class] token) counts as distance 0, not NaN
    w = w / w.sum(-1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)
    return (w * distances.to(w)).sum(-1).sum((0, 2))
