"""Optimiser and learning-rate schedule from the config, built with timm's factory and schedulers.

Optimisers are created with `fused=True`: fused kernels read `optimizer.found_inf` (the hook torch's
GradScaler uses) and leave weights and optimiser state untouched when it is non-zero, so the
trainer can skip a non-finite step on the device without a host sync.
"""
from __future__ import annotations

import logging

import torch
from timm.models import group_parameters
from timm.models.vision_transformer import VisionTransformer
from timm.optim import create_optimizer_v2, param_groups_layer_decay
from timm.scheduler import CosineLRScheduler, PolyLRScheduler, StepLRScheduler

from mpp.config import Config

# optim.name -> (timm optimiser name, its keyword arguments from the optim config). timm's "sgd"
# is Nesterov; the paper's fine-tuning uses plain momentum.
OPTIMIZERS = {
    "adamw": ("adamw", lambda o: dict(betas=(o.beta1, o.beta2))),
    "adam": ("adam", lambda o: dict(betas=(o.beta1, o.beta2))),
    "sgd": ("momentum", lambda o: dict(momentum=o.momentum)),
}
# optim.schedule -> timm scheduler, built from (optimizer, optim config, decay steps, common kwargs)
SCHEDULES = {
    "cosine": lambda opt, o, decay, total, kw: CosineLRScheduler(opt, t_initial=decay, lr_min=o.min_lr, **kw),
    "linear": lambda opt, o, decay, total, kw: PolyLRScheduler(opt, t_initial=decay, power=1.0, lr_min=o.min_lr, **kw),
    "constant": lambda opt, o, decay, total, kw: StepLRScheduler(opt, decay_t=total + 1, decay_rate=1.0, **kw),
}


class _LayerView:
    """A model as timm's layer-decay grouping sees it: the ViT inside keeps timm's layer ids
    (embeddings 0, block i -> i + 1, the final norm with the last block: timm's grouping, where
    BEiT's and MAE's give it the head's rate), the [mask] token joins the embeddings and anything
    outside the ViT (objective heads) comes after the last layer."""

    def __init__(self, model: torch.nn.Module):
        vit_name, vit = next((n, m) for n, m in model.named_modules() if isinstance(m, VisionTransformer))
        prefix = vit_name + "." if vit_name else ""
        layers = group_parameters(vit, vit.group_matcher(coarse=False), reverse=True)
        self._ids = {prefix + name: layer for name, layer in layers.items()}
        self._head = max(layers.values()) + 1
        self.model = model

    def named_parameters(self):
        return self.model.named_parameters()

    def group_matcher(self, coarse: bool = False):
        def layer_of(name: str) -> int:
            if name in self._ids:
                return self._ids[name]
            return 0 if name.rsplit(".", 1)[-1] == "mask_token" else self._head
        return layer_of


def create_optimizer(cfg: Config, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The configured optimiser over `model`'s trainable parameters (already on their device).

    No weight decay on 1-D parameters (norms, biases) nor on `model.no_weight_decay()` (position
    embeddings, [class] and [mask] tokens); optional layer-wise lr decay (`lr_scale` per group,
    applied by the timm schedulers)."""
    o = cfg.optim
    timm_name, kwargs = OPTIMIZERS[o.name]
    params: torch.nn.Module | list = model
    if o.layer_decay:
        params = param_groups_layer_decay(_LayerView(model), weight_decay=o.weight_decay,
                                          no_weight_decay_list=model.no_weight_decay(), layer_decay=o.layer_decay)
    optimizer = create_optimizer_v2(params, timm_name, lr=o.lr, weight_decay=o.weight_decay, fused=True, **kwargs(o))
    if isinstance(optimizer, torch.optim.SGD):
        # Fused SGD allocates momentum buffers uninitialised on its first step and keeps them even
        # when that step is skipped (found_inf); zeros are the same first step (dampening 0) and safe.
        for group in optimizer.param_groups:
            for p in group["params"]:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return optimizer


def warmup_note(cfg: Config, total_steps: int) -> str:
    """What a warmup of at least the run's length does to the schedule (a warning, not an error:
    short smoke runs of a recipe keep its warmup)."""
    o = cfg.optim
    peak = o.lr * (total_steps - 1) / o.warmup_steps  # the last step's (the first is step 0)
    return (f"optim.warmup_steps={o.warmup_steps} is not below the run's {total_steps} steps: the learning rate "
            f"rises to {peak:.3g}, not optim.lr={o.lr:g}, and never decays; give fewer warmup steps")


def create_scheduler(cfg: Config, optimizer: torch.optim.Optimizer, total_steps: int):
    """timm scheduler stepped per optimiser step (`step_update(n)` before step n + 1): linear
    warmup from 0 over `optim.warmup_steps`, then cosine / linear decay over the remaining steps
    towards `optim.min_lr` (times each group's layer-decay scale), which the step after the last
    would take (timm's and big_vision's convention); or constant."""
    o = cfg.optim
    # timm's cosine schedule logs a line of its own (no 'warning:' prefix) for a decay of one step,
    # which a run of at most one step past its warmup has: nothing to act on (`warmup_note` says
    # what a run too short for its warmup means)
    logging.getLogger("timm.scheduler.cosine_lr").setLevel(logging.ERROR)
    common = dict(warmup_t=o.warmup_steps, warmup_lr_init=0.0, warmup_prefix=True, t_in_epochs=False)
    return SCHEDULES[o.schedule](optimizer, o, max(1, total_steps - o.warmup_steps), total_steps, common)
