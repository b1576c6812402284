"""Device, precision and seeding helpers shared by training and evaluation."""
from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": None}


def autocast(device: torch.device, precision: str):
    """Mixed-precision context for `precision` (bf16 | fp16 | no) on any device, CPU included."""
    dtype = DTYPES[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
