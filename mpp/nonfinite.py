"""Non-finite steps: a step whose loss or gradient is not finite is skipped on the device, counted,
and stops the run when too many come in a row; a run never exports non-finite weights.

Why on the device: reading the gradient norm back every step would make the host wait for the
device. `skip_unless_finite` makes the fused optimiser kernel skip the update instead, and
`BadSteps` keeps its counters as device tensors, which mpp.train reads only at log and checkpoint
steps (`check_finite`: stop at train.max_bad_steps in a row). Under fp16 the loss scaler's
overflows are counted apart (`scaler_overflow`): they are part of every fp16 run.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator

from mpp.checkpoint import checkpoint_name, checkpoint_order, list_checkpoints

if TYPE_CHECKING:  # annotations only: mpp.train imports this module
    from mpp.train import Run


class NonFiniteError(RuntimeError):
    """Too many steps with a non-finite loss or gradient since the last finite one: training stopped."""


def skip_unless_finite(scaler, optimizer: torch.optim.Optimizer, finite: torch.Tensor) -> None:
    """Make the coming `step` skip the update where the clipped gradient's norm is not finite,
    without a host sync: fused kernels read `optimizer.found_inf`. Under fp16, GradScaler.step
    sets that from what it saw while unscaling, before clipping (finite gradients whose norm
    overflows then stepped, to NaN weights without clipping), so the verdict goes into its record
    too: the step is skipped and the scale lowered."""
    optimizer.found_inf = (~finite).float()
    if scaler is not None:  # unscaled by clip_grad_norm_: GradScaler's record of this optimizer exists
        for found in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
            torch.maximum(found, optimizer.found_inf.to(found.device), out=found)


def scaler_overflow(accelerator: Accelerator, finite: torch.Tensor,
                    losses: list[torch.Tensor]) -> torch.Tensor | None:
    """Whether this step was fp16 loss scaling's overflow: a non-finite gradient norm while every
    rank's loss was finite. The scaler skips such a step and lowers its scale, as it does a few
    times at the start of every fp16 run: counted apart (`scaler_skips`), it neither stops a run
    nor its export as a non-finite step does, unless train.max_bad_steps of them come in a row
    (`BadSteps`: a gradient that stays non-finite is no overflow). None without a scaler (bf16,
    fp32): the step then does no work for it. The ranks' losses are summed in one all-reduce (fp16
    on several processes only), so every rank takes the same verdict."""
    if accelerator.scaler is None:
        return None
    bad_loss = torch.stack([~torch.isfinite(loss).all() for loss in losses]).any().float()
    if accelerator.num_processes > 1:  # the same verdict on every rank, as the gradient norm is
        bad_loss = accelerator.reduce(bad_loss, "sum")
    return ~finite & (bad_loss == 0)


class BadSteps:
    """Device-side counters of non-finite steps (fp16 overflows apart): the current run of them,
    its longest, the total, and the overflows. From the `limit`-th overflow since the last finite
    step on, an overflow counts as a non-finite step: the scale has then halved `limit` times and the
    gradient is still not finite, so something other than the scale is wrong. `run` and
    `overflow_run`: the runs a resumed checkpoint left open, so a resume stops where the
    uninterrupted run would."""

    def __init__(self, zero: torch.Tensor, run: int, limit: int, overflow_run: int = 0):
        self.zero, self.run, self.max, self.limit = zero, zero + run, zero.clone(), limit
        self.total, self.overflows, self.overflow_run = zero.clone(), zero.clone(), zero + overflow_run

    def add(self, finite: torch.Tensor, overflow: torch.Tensor | None = None) -> None:
        """Only a finite step (one that updated the weights) ends a run: an overflow leaves the run
        of failed steps as it was, and a failed step the run of overflows, so the two alternating
        (no step ever finite) still reach the limit."""
        failed = ~finite
        if overflow is not None:  # fp16 loss scaling only
            self.overflow_run = torch.where(overflow, self.overflow_run + 1,
                                            torch.where(finite, self.zero, self.overflow_run))
            skipped = overflow & (self.overflow_run < self.limit)
            self.overflows += skipped.float()
            failed = failed & ~skipped
        self.run = torch.where(finite, self.zero, self.run + failed.float())  # a skip leaves it as it was
        self.max = torch.maximum(self.max, self.run)
        self.total += failed.float()


def check_finite(run: Run, step: int) -> None:
    """Stop when the longest run of consecutive non-finite steps reached train.max_bad_steps."""
    limit = run.cfg.train.max_bad_steps
    if run.bad.max.item() >= limit:
        # one before this step, not a newer one (or this step's, not written yet) that a resume skipped
        # as damaged, which stays on disk
        good = [c for c in list_checkpoints(run.out / "checkpoints")
                if checkpoint_order(c.name) < checkpoint_order(checkpoint_name(step))]
        raise NonFiniteError(
            f"training stopped near step {step}: {limit} steps since the last finite one had a non-finite "
            f"loss or gradient (train.max_bad_steps); they were skipped, the weights never saw them; last good "
            f"checkpoint: {good[-1] if good else 'none'}. Lower optim.lr, raise warmup, try "
            f"train.precision=no, or check the data")


def check_export(encoder: torch.nn.Module, bad_run: int, checkpoints: list[Path]) -> None:
    """A run never exports non-finite weights, nor ends well when its last steps failed."""
    last = f"last good checkpoint: {checkpoints[-1] if checkpoints else 'none'}"
    if bad_run:
        raise NonFiniteError(f"{bad_run} steps since the last finite one had a non-finite loss or gradient (fp16 "
                             f"overflows apart): the run did not end well and no encoder was exported ({last}); "
                             "lower optim.lr or check the data")
    if not all(torch.isfinite(p).all() for p in encoder.parameters()):
        raise NonFiniteError(f"the trained weights are not finite: no encoder was exported ({last}); lower optim.lr")
