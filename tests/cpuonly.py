"""Test helper: the trainer on the CPU on any machine, for the tests that compare trained weights
bit for bit. A run is bit-exact on one machine's CPU only: CUDA's kernels are not deterministic
(docs/training.md), and on a GPU machine two identical runs differ in the last bits."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch


def cpu_env(**extra: str) -> dict[str, str]:
    """The environment of a subprocess that sees no GPU."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", **extra}


@contextlib.contextmanager
def cpu_only() -> Iterator[None]:
    """The trainer in this process sees no accelerator (mpp.train asks torch.accelerator)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.accelerator, "is_available", lambda: False)
        yield
