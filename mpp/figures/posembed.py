"""Position-embedding similarity (ViT paper Fig. 7 centre): the cosine similarity of each patch
position's learned embedding to every other position's (the [class] token's row left out)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def position_similarity(vit: nn.Module) -> torch.Tensor:
    """(N, N) cosine similarities between the patch positions' embeddings of a timm ViT."""
    if getattr(vit, "pos_embed", None) is None:
        raise ValueError(f"{type(vit).__name__} has no learned position embeddings (pos_embed)")
    prefix = 0 if getattr(vit, "no_embed_class", False) else vit.num_prefix_tokens
    pos = F.normalize(vit.pos_embed.detach().float()[0, prefix:], dim=-1)
    return pos @ pos.T
