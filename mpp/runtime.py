"""Device, precision, seeding and process helpers shared by training and evaluation."""
from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import sys

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


def die_with_launcher() -> None:
    """Under torchrun / accelerate launch (Linux): ask the kernel to kill this rank when its launcher
    dies. Otherwise a kill -9 of the launcher leaves the ranks training on, orphaned, until a
    collective times out, and a restarted job finds the run directory locked by them."""
    if "TORCHELASTIC_RUN_ID" in os.environ and sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
