"""The MPP corruption (ViT paper, section 4.6 / B.1.2): which patches each image's loss is
computed on, and how each chosen patch's embedding is corrupted.

Per image exactly K = round(ratio * N) patches are chosen (round half up); of those, the mask /
random-other / keep counts are K times the configured fractions, rounded per image by systematic
stochastic rounding, so each image's counts are the floor or ceiling of K * fraction, always sum
to K, and their expectation is exactly K * fraction (80/10/10 over many draws, with no rounding
bias). The encoder applies a plan (`MaskedEncoder.forward(corruption=)`); the head and loss see
only the K chosen tokens (gathered by index: a fixed count, so no host sync).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

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
        cum.append(cum[-1] + s - b)  # each share's fraction over its floor
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

