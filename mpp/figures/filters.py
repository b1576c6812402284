"""Patch-embedding filters (ViT paper Fig. 7 left): the first principal components of the linear
patch embedding's filters (embed_dim filters of 3 x p x p), as RGB tiles."""
from __future__ import annotations

import torch
from torch import nn


def filter_components(vit: nn.Module, std=(1.0, 1.0, 1.0), k: int = 28) -> tuple[torch.Tensor, torch.Tensor]:
    """The top `k` principal components of the patch-embedding filters, (k, 3, p, p), and the
    share of the filters' variance each explains (k,). A component's sign is arbitrary. The
    filters act on pixels normalised by the per-channel `std` the encoder trained with; divided by
    it they are the filters on raw RGB, whose colours the figure shows."""
    w = vit.patch_embed.proj.weight.detach().float()  # (D, 3, p, p)
    w = w / torch.tensor(std, dtype=w.dtype).view(1, -1, 1, 1)
    flat = w.flatten(1)
    flat = flat - flat.mean(0, keepdim=True)
    _, s, vh = torch.linalg.svd(flat, full_matrices=False)
    k = min(k, vh.shape[0])
    var = s ** 2
    return vh[:k].reshape(k, *w.shape[1:]), var[:k] / var.sum()
