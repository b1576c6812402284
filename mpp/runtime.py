"""Device, precision, attention and process helpers shared by training and evaluation."""
from __future__ import annotations

import contextlib
import os
import platform
from typing import Callable

import torch

from mpp.config import ConfigError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": None}
PRECISIONS = ("auto", *DTYPES)

# train.attn -> whether timm's Attention takes F.scaled_dot_product_attention on a device type.
# auto: the fused kernels on CUDA; math elsewhere, where the fused path was slower for short
# sequences. A fixed rule, never timed per process: identical runs must take the same path.
ATTENTION = {"auto": lambda device_type: device_type == "cuda",
             "fused": lambda device_type: True,
             "math": lambda device_type: False}


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (x86: AVX512-BF16 or AMX; ARM: its bf16
    instructions, through oneDNN). Without it bf16 matmuls take a slow emulated path, tens of times
    slower than fp32 (AVX2-only CPUs). On x86 torch's `_is_mkldnn_bf16_supported` says yes for any
    AVX-512 CPU (Skylake to Ice Lake servers lack both), so the two are asked for by name there.
    The checks are private to torch: an absent one means no."""
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        names = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(bool(check and check()) for check in (getattr(torch.cpu, name, None) for name in names))
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check and check())


def check_run_settings(cfg, processes: int = 1, machine: bool = True) -> None:
    """The settings a training run checks before any work (and a comparison for each trained stage
    before its first): a run length, a batch that splits over `processes` x train.grad_accum, and,
    `machine`, what this machine must offer (a GPU for fp16's loss scaling)."""
    if not cfg.steps and not cfg.epochs:
        raise ConfigError("set the run length: steps=N (optimiser steps) or epochs=E (passes over data.train)")
    if cfg.steps and cfg.epochs:  # here, not in validate: run dirs saved with both must still load
        raise ConfigError(f"config keys 'steps' ({cfg.steps}) and 'epochs' ({cfg.epochs:g}) both set the run length; "
                          f"give one and 0 for the other (steps=0 epochs={cfg.epochs:g}, or epochs=0)")
    accum = cfg.train.grad_accum
    if cfg.batch_size % (processes * accum):
        raise ConfigError(f"batch_size={cfg.batch_size} is not divisible by processes x train.grad_accum = "
                          f"{processes} x {accum}; choose a multiple of {processes * accum}")
    if machine and cfg.train.precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("train.precision=fp16 needs a GPU (loss scaling); use bf16 or no on CPU")


def check_ranks_fit(local_ranks: int, devices: int, device_type: str) -> None:
    """One rank per device: NCCL refuses two ranks on one GPU, but only at the first collective and
    in words about NCCL ("invalid usage"), after the run has built everything. Say it before."""
    if local_ranks > devices:
        raise ConfigError(f"this node runs {local_ranks} ranks but sees {devices} {device_type} device(s), and ranks "
                          f"cannot share one: launch --nproc_per_node {devices}, or hide the devices "
                          f"(CUDA_VISIBLE_DEVICES=) to train {local_ranks} ranks on the CPU")


def resolve_precision(precision: str, device_type: str) -> str:
    """`train.precision` with auto decided for the device: bf16 on GPUs that support it (else
    fp16) and on CPUs with native bf16; fp32 ("no") elsewhere."""
    if precision != "auto":
        return precision
    if device_type == "cuda":
        # native bf16 only (Ampere on): older GPUs emulate it, far slower than their fp16
        return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    return "bf16" if device_type == "cpu" and cpu_has_bf16() else "no"


def autocast(device: torch.device, precision: str):
    """Mixed-precision context for `precision` (auto | bf16 | fp16 | no) on any device, CPU included."""
    dtype = DTYPES[resolve_precision(precision, device.type)]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


@contextlib.contextmanager
def deterministic(on: bool):
    """`train.deterministic`: within a run or a probe, torch takes deterministic kernels only and
    raises at an op that has none (on CUDA, scatter-adds and some attention backwards are not by
    default); the process's own setting comes back afterwards. cuBLAS reads its workspace setting
    when it starts, so it is set before the run touches the GPU (an existing value is kept) and
    stays set."""
    if not on:
        yield
        return
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def together(accelerator, work: Callable[[], None], what: str, everyone: bool = False) -> None:
    """`work` on the main process (every rank with `everyone`), then all ranks learn whether it
    failed anywhere (one all-reduce, where a barrier stood): a failure (a full disk, an output_dir
    another run holds) stops every rank at once, each with a line, where a barrier or the next
    collective would hold the others until train.dist_timeout. `what`: the work, for their line."""
    error = None
    if everyone or accelerator.is_main_process:
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - raised below, once the other ranks know (a Ctrl-C too)
            error = e
    if accelerator.num_processes > 1:  # "max" (a sum, in accelerate before 1.x's MAX: also non-zero)
        failed = accelerator.reduce(torch.tensor(float(error is not None), device=accelerator.device), "max")
        if failed.item() and error is None:
            raise OSError(f"another process could not {what} (its own error line, or its traceback, says why)")
    if error is not None:
        raise error


def leave_process_group() -> None:
    """End a tool's distributed run: a process group still alive at interpreter exit can abort a
    rank after its work is done ("terminate called without an active exception"). The tools call
    this, not `train`, so a script may still use the group after training."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
