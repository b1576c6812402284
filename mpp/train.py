"""The training loop: MPP or supervised pre-training and fine-tuning, one code path on CPU, one GPU
or many GPUs and nodes (Accelerate; start with `python`, `accelerate launch` or `torchrun`).

Read top to bottom: setup (accelerator, model, data, optimiser, resume), the loop (micro-batches,
clipping, non-finite steps skipped on the device, schedule, logging, checkpoints, few-shot), the end
(encoder export, fine-tune evaluation, metrics.json).

Host syncs: the hot loop reads nothing from the device. Loss, metrics, gradient norm and the
non-finite counters stay device tensors and are read every `train.log_every` steps (one gather),
before checkpoints and at the end. A non-finite step is skipped by the fused optimiser kernel
(`optimizer.found_inf`, see mpp.optim); the run stops when the longest run of consecutive
non-finite steps reaches `train.max_bad_steps`, noticed at the next log or checkpoint step.
"""
from __future__ import annotations

import contextlib
import json
import math
import pickle
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import yaml
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import gather_object
from torch.utils.tensorboard import SummaryWriter
from tqdm.auto import tqdm

from mpp import rundir
from mpp.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from mpp.compiled import compile_task, use_compile
from mpp.config import Config, ConfigError, save_config, to_dict
from mpp.data import make_loader
from mpp.data.sources import check_same_classes, resolve
from mpp.fileio import write_atomic
from mpp.models import create_encoder, load_encoder, save_encoder
from mpp.objectives import build_task
from mpp.optim import create_optimizer, create_scheduler
from mpp.prefetch import DevicePrefetcher
from mpp.runtime import die_with_launcher, resolve_precision, seed_everything


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient: training stopped."""


def train(cfg: Config) -> dict:
    """Run `cfg` (objective mpp | supervised | classify) and write its run directory; returns
    the figures also written to `OUTPUT_DIR/metrics.json`. The directory is locked meanwhile."""
    try:
        return _train(cfg)
    finally:
        rundir.unlock(cfg.output_dir)


def _train(cfg: Config) -> dict:
    t_begin = time.time()
    accum = cfg.train.grad_accum
    _check_settings(cfg)
    die_with_launcher()

    # ---- accelerator: device, processes, mixed precision (autocast wraps the model's forward)
    AcceleratorState._reset_state()  # a later train() in the same process may use another precision
    # cpu=True on machines without an accelerator: only then does Accelerate treat torchrun /
    # accelerate launch processes as MULTI_CPU (gloo) ranks instead of independent single runs
    on_accelerator = torch.accelerator.is_available()
    precision = resolve_precision(cfg.train.precision, torch.accelerator.current_accelerator().type
                                  if on_accelerator else "cpu")
    accelerator = Accelerator(mixed_precision=precision, cpu=not on_accelerator)
    device, main = accelerator.device, accelerator.is_main_process
    rank, world = accelerator.process_index, accelerator.num_processes
    if cfg.batch_size % (world * accum):
        raise ConfigError(f"batch_size={cfg.batch_size} is not divisible by processes x train.grad_accum = "
                          f"{world} x {accum}; choose a multiple of {world * accum}")
    micro = cfg.batch_size // (world * accum)  # per rank and micro-batch
    out = Path(cfg.output_dir)
    ckpt_root = out / "checkpoints"

    # ---- model: the same initialisation on every rank
    seed_everything(cfg.seed)
    if cfg.objective == "classify" and cfg.finetune.init != "none":
        encoder = load_encoder(cfg.finetune.init, img_size=cfg.img_size, drop_path=cfg.finetune.drop_path,
                               attn=cfg.train.attn)
    else:
        drop_path = cfg.finetune.drop_path if cfg.objective == "classify" else 0.0
        encoder = create_encoder(cfg.model, img_size=cfg.img_size, drop_path=drop_path, attn=cfg.train.attn)
    img_size = encoder.grid_size[0] * encoder.patch_size

    # ---- data: every rank reads its own part (the loader splits shards by rank itself)
    labeled = cfg.objective != "mpp"
    ft = cfg.finetune
    subset = (ft.label_fraction, ft.split_seed, ft.dev_fraction, False) if cfg.objective == "classify" else None
    loader = make_loader(cfg.data.train, batch_size=micro, img_size=img_size, train=True, labeled=labeled,
                         data_cfg=cfg.data, seed=cfg.seed, rank=rank, world_size=world,
                         num_samples=cfg.data.num_samples, subset=subset)
    num_classes = None
    if labeled:
        if not loader.classes:
            raise ConfigError(f"objective={cfg.objective} needs labeled shards whose manifest.json lists "
                              f"'classes'; data.train={cfg.data.train!r} has none")
        num_classes = len(loader.classes)
        if cfg.objective == "classify":
            check_same_classes(cfg.data.train, cfg.data.val, cfg.data.val_num_samples)
    steps = cfg.steps or math.ceil(cfg.epochs * loader.batches_per_epoch / accum)

    # ---- task (encoder + objective head), optimiser, schedule
    task = build_task(cfg, encoder, num_classes).to(device)
    if cfg.objective != "mpp":  # no corruption: the [mask] token gets no gradient (DDP needs all used)
        encoder.mask_token.requires_grad_(False)
    optimizer = create_optimizer(cfg, task)
    scheduler = create_scheduler(cfg, optimizer, steps)
    model, optimizer = accelerator.prepare(task, optimizer)  # not the loader: it splits by rank itself
    forward = compile_task(model) if use_compile(cfg.train.compile, device) else model  # train.compile

    # ---- lock the run directory; resume from the newest checkpoint that loads, or seed this rank's
    # own RNG stream (corruption, drop path). Nothing in the directory changes before this succeeded.
    if main:
        if cfg.train.resume == "none":
            rundir.check_fresh(out)
        rundir.lock(out)
    accelerator.wait_for_everyone()
    resume, state = _resume(cfg, accelerator, ckpt_root, task, optimizer)
    if main:
        if resume and (out / "config.yaml").is_file():
            _warn_changes(yaml.safe_load((out / "config.yaml").read_text()), to_dict(cfg))
        save_config(cfg, out / "config.yaml")
    if not resume:
        seed_everything(int(np.random.SeedSequence([cfg.seed, rank]).generate_state(1)[0]))
        state = {"step": 0, "nonfinite_steps": 0, "elapsed": 0.0, "train_time": 0.0, "data_wait": 0.0, "last": {},
                 "skipped": {}}
    start = state["step"]
    scheduler.step_update(start)

    evaluator = None
    if cfg.fewshot.every > 0:  # built on every rank, so bad few-shot settings fail everywhere; run on main
        from mpp.evaluate import FewshotEvaluator  # only runs that ask for it pay for its import
        evaluator = FewshotEvaluator(cfg, device)
    writer = SummaryWriter(str(out / "tensorboard"), purge_step=start) if main else None
    bar = tqdm(total=steps, initial=start, disable=not main, desc=f"{cfg.objective} {out.name}", dynamic_ncols=True)

    # ---- device-side accumulators, read only at log / checkpoint steps
    zero = torch.zeros((), device=device)
    win = _Window(zero)
    bad_run, bad_max, bad_total = zero + state.get("bad_run", 0), zero.clone(), zero.clone()
    last: dict = state["last"]  # the latest log window's figures
    t_loop, t_win, wait_win, wait_all = time.perf_counter(), time.perf_counter(), 0.0, 0.0

    def totals() -> dict:
        """Run totals over the checkpointed segments plus this process's (plain values)."""
        return {"nonfinite_steps": state["nonfinite_steps"] + int(bad_total.item()),
                "elapsed": state["elapsed"] + time.time() - t_begin,
                "train_time": state["train_time"] + time.perf_counter() - t_loop,
                "data_wait": state["data_wait"] + wait_all + wait_win, "last": last}

    def skipped() -> dict[str, int]:
        """Skipped samples by kind over all ranks and all resumed segments (a collective: every rank)."""
        return dict(Counter(state.get("skipped", {})) + Counter(_skipped(batches.counted)))

    def check_finite(step: int) -> None:
        if bad_max.item() >= cfg.train.max_bad_steps:
            good = list_checkpoints(ckpt_root)
            bar.close()
            if writer:
                writer.close()  # keep the logged scalars that show what happened
            raise NonFiniteError(
                f"training stopped near step {step}: {cfg.train.max_bad_steps} consecutive steps had a non-finite "
                f"loss or gradient (train.max_bad_steps); they were skipped, the weights never saw them; last good "
                f"checkpoint: {good[-1] if good else 'none'}. Lower optim.lr, raise warmup, try "
                f"train.precision=no, or check the data")

    # on the device a step ahead; `batches.counted`: the skips of the batches handed out, not the look-ahead's
    batches = DevicePrefetcher(_batches(loader, start * accum), device, counters=loader.counters)
    shown = None  # the images of the MPP prediction grid (train.image_every)
    model.train()
    for step in range(start, steps):
        # -- forward/backward over grad_accum micro-batches; gradients all-reduced on the last only
        for i in range(accum):
            t0 = time.perf_counter()
            batch = next(batches)
            wait_win += time.perf_counter() - t0
            images, labels = batch["image"], batch.get("label")
            with accelerator.no_sync(model) if i < accum - 1 else contextlib.nullcontext():
                loss, metrics = forward(images, labels) if labeled else forward(images)
                accelerator.backward(loss / accum)
            win.add_micro(loss, metrics)

        # -- clip, then step only if the gradient is finite (decided on the device, no host sync)
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad or math.inf)
        finite = torch.isfinite(grad_norm)
        optimizer.optimizer.found_inf = (~finite).float()  # fused kernels skip the update when set
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step_update(step + 1)
        win.add_step(grad_norm, finite)
        bad_run = torch.where(finite, zero, bad_run + 1)
        bad_max = torch.maximum(bad_max, bad_run)
        bad_total += (~finite).float()
        bar.update(1)
        done = step + 1

        # -- log: one gather of the window's sums every log_every steps
        if done % cfg.train.log_every == 0 or done == steps:
            check_finite(done)
            now = time.perf_counter()
            figures = win.read(accelerator)
            figures.update({"skipped_" + k: n for k, n in skipped().items()})
            figures["lr"] = max(g["lr"] for g in optimizer.param_groups)
            figures["images_per_s"] = win.steps * cfg.batch_size / (now - t_win)
            figures["data_wait_frac"] = wait_win / (now - t_win)
            figures["nonfinite_steps"] = state["nonfinite_steps"] + int(bad_total.item())
            last = figures
            if main:
                for k, v in figures.items():
                    writer.add_scalar(_TAGS.get(k, ("data/" if k.startswith("skipped_") else "train/") + k), v, done)
                bar.set_postfix(loss=f"{figures['loss']:.4f}", lr=f"{figures['lr']:.2e}")
            wait_all += wait_win
            win.reset()
            t_win, wait_win = now, 0.0

        # -- MPP prediction grid of a fixed set of images (the first logged batch's) to TensorBoard
        if main and cfg.train.image_every and done % cfg.train.image_every == 0:
            from mpp.figures.predictions import log_predictions
            shown = images[:8].clone() if shown is None else shown
            log_predictions(writer, task, shown, done)

        # -- checkpoint (also at the end, so a finished run resumes to nothing)
        if (cfg.train.ckpt_every and done % cfg.train.ckpt_every == 0) or done == steps:
            check_finite(done)
            epoch, batch_pos = divmod(done * accum, loader.batches_per_epoch)
            save_checkpoint(accelerator, ckpt_root, done, task, optimizer, scheduler, keep=cfg.train.keep_ckpts,
                            state={"epoch": epoch, "batch": batch_pos, "skipped": skipped(),
                                   "bad_run": int(bad_run.item()), **totals()})

        # -- few-shot evaluation on the main process (the evaluator restores every RNG it touches)
        if main and evaluator is not None and done % cfg.fewshot.every == 0:
            for k, v in evaluator(encoder).items():
                writer.add_scalar("fewshot/" + k, v, done)
    bar.close()
    loader.close()  # stops the data workers (an epoch may be unfinished)
    run = totals()

    # ---- the end: exported encoder (finite, and only when the last step was), evaluation, metrics.json
    _check_export(encoder, int(bad_run.item()), list_checkpoints(ckpt_root))
    if main:
        save_encoder(encoder, out)
        if cfg.objective == "mpp":  # the head too, for mpp.figures (tools/inspect_encoders.py)
            from mpp.figures.predictions import save_mpp_head
            save_mpp_head(task, out)
    results = {
        "objective": cfg.objective, "model": cfg.model, "encoder": encoder.model_spec(), "img_size": img_size,
        "precision": precision,  # train.precision as resolved for this device (auto decides)
        "batch_size": cfg.batch_size, "steps": steps, "epochs": steps * cfg.batch_size / max(loader.num_samples, 1),
        "train_samples": loader.num_samples,
        # the last log window: loss and objective metrics (averaged over its steps and all ranks), grad norm
        **{k: v for k, v in last.items() if k not in ("lr", "images_per_s", "data_wait_frac", "nonfinite_steps")
           and not k.startswith("skipped_")},
        "nonfinite_steps": run["nonfinite_steps"],
        "skipped_samples": skipped(),  # all ranks, all resumed segments
        # end to end over the whole run (all resumed segments; checkpoint and few-shot time included)
        "images_per_s": steps * cfg.batch_size / run["train_time"],
        "data_wait_frac": run["data_wait"] / run["train_time"],
    }
    if cfg.objective == "classify":
        results.update(evaluate_classifier(cfg, accelerator, task, img_size, micro))
        results.update(init=ft.init, label_fraction=ft.label_fraction, dev_fraction=ft.dev_fraction,
                       split_seed=ft.split_seed, seed=cfg.seed, pool=ft.pool, optimizer=cfg.optim.name, lr=cfg.optim.lr)
    results["wall_time_s"] = state["elapsed"] + time.time() - t_begin  # all segments, evaluation included
    if main:
        write_atomic(out / "metrics.json", json.dumps(results, indent=2))  # last: compare's "stage finished"
        writer.close()
    accelerator.wait_for_everyone()
    return results


def main(cfg: Config) -> dict:
    """`train` for the command-line tools: bad input, a diverged run or a full disk end with one line."""
    from mpp.cli import one_line_errors
    with one_line_errors():
        return train(cfg)


@torch.no_grad()
def evaluate_classifier(cfg: Config, accelerator: Accelerator, task: torch.nn.Module, img_size: int,
                        batch_size: int) -> dict:
    """Top-1 / top-5 of a classify task (eval transform), summed over all ranks: on `data.val`, or
    with `finetune.dev_fraction` > 0 on the development split held out of the training labels
    (`evaluated_on` says which)."""
    f = cfg.finetune
    dev = f.dev_fraction > 0
    spec, num_samples = (cfg.data.train, cfg.data.num_samples) if dev else (cfg.data.val, cfg.data.val_num_samples)
    loader = make_loader(spec, batch_size=batch_size, img_size=img_size, train=False, labeled=True,
                         data_cfg=cfg.data, rank=accelerator.process_index, world_size=accelerator.num_processes,
                         num_samples=num_samples,
                         subset=(f.label_fraction, f.split_seed, f.dev_fraction, True) if dev else None)
    device = accelerator.device
    counts = torch.zeros(3, device=device)  # top-1 hits, top-5 hits, samples
    task.eval()
    bar = tqdm(loader.epoch(0), total=loader.batches_per_epoch, desc="evaluate",
               disable=not accelerator.is_main_process, dynamic_ncols=True)
    with accelerator.autocast():
        for batch in bar:
            labels = batch["label"].to(device, non_blocking=True)
            logits = task.logits(batch["image"].to(device, non_blocking=True))
            hits = logits.topk(min(5, logits.shape[1]), dim=1).indices == labels[:, None]
            counts += torch.stack([hits[:, 0].sum(), hits.any(dim=1).sum(), torch.tensor(len(labels), device=device)])
    top1, top5, n = accelerator.reduce(counts, "sum").tolist()
    return {"top1": top1 / max(n, 1), "top5": top5 / max(n, 1), "val_samples": int(n),
            "evaluated_on": "dev" if dev else "val"}


# ---- helpers

_TAGS = {"images_per_s": "perf/images_per_s", "data_wait_frac": "perf/data_wait_frac"}  # others: train/...


class _Window:
    """Device-side sums over the steps since the last log; `read` brings them to the host once."""

    def __init__(self, zero: torch.Tensor):
        self.zero = zero
        self.reset()

    def reset(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.micro = 0
        self.steps = 0
        self.norm, self.finite = self.zero.clone(), self.zero.clone()

    def add_micro(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor]) -> None:
        for k, v in {"loss": loss, **metrics}.items():
            self.sums[k] = self.sums.get(k, self.zero) + v.detach().float()
        self.micro += 1

    def add_step(self, grad_norm: torch.Tensor, finite: torch.Tensor) -> None:
        self.norm = self.norm + torch.where(finite, grad_norm.float(), self.zero)
        self.finite = self.finite + finite.float()
        self.steps += 1

    def read(self, accelerator: Accelerator) -> dict[str, float]:
        """Means over micro-batches and ranks; the gradient norm (the same on every rank) over the
        window's finite steps."""
        names = sorted(self.sums)
        row = torch.stack([self.sums[k] / self.micro for k in names] + [self.norm, self.finite])
        mean = accelerator.gather(row[None]).mean(0).tolist()
        figures = dict(zip(names, mean[:-2]))
        figures["grad_norm"] = mean[-2] / mean[-1] if mean[-1] else float("nan")
        return figures


def _skipped(counted: dict[str, int]) -> dict[str, int]:
    """This rank's skipped-sample counters summed over ranks (each rank has only the kinds it saw)."""
    total: Counter = Counter()
    for counters in gather_object([counted]):
        total.update(counters)
    return dict(total)


def _check_settings(cfg: Config) -> None:
    """Checks of settings the trainer needs, before any work."""
    if not cfg.steps and not cfg.epochs:
        raise ConfigError("set the run length: steps=N (optimiser steps) or epochs=E (passes over data.train)")
    if not cfg.data.train:
        raise ConfigError("config key 'data.train' is empty; give a manifest.json, a shard list or a brace pattern")
    if cfg.objective == "classify" and not cfg.data.val:
        raise ConfigError("objective=classify evaluates on held-out labeled shards; set data.val")
    if cfg.objective == "classify" and cfg.finetune.init != "none" and not Path(cfg.finetune.init).exists():
        raise ConfigError(f"finetune.init={cfg.finetune.init!r} does not exist; give a pre-training run directory, "
                          "an encoder.safetensors (with model.json beside it) or none")
    if cfg.train.precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("train.precision=fp16 needs a GPU (loss scaling); use bf16 or no on CPU")
    # every path the run will need, before any work (not only after hours of training)
    rundir.check_output_dir(cfg.output_dir)
    needed = [(cfg.data.train, cfg.data.num_samples)]
    if cfg.objective == "classify":
        needed.append((cfg.data.val, cfg.data.val_num_samples))
    if cfg.fewshot.every > 0:
        needed += [(cfg.fewshot.train, cfg.fewshot.train_num_samples), (cfg.fewshot.test, cfg.fewshot.test_num_samples)]
    for spec, n in needed:
        resolve(spec, n)


def _check_export(encoder: torch.nn.Module, bad_run: int, checkpoints: list[Path]) -> None:
    """A run never exports non-finite weights, nor ends well when its last steps failed."""
    last = f"last good checkpoint: {checkpoints[-1] if checkpoints else 'none'}"
    if bad_run:
        raise NonFiniteError(f"the last {bad_run} steps had a non-finite loss or gradient: the run did not end well "
                             f"and no encoder was exported ({last}); lower optim.lr or check the data")
    if not all(torch.isfinite(p).all() for p in encoder.parameters()):
        raise NonFiniteError(f"the trained weights are not finite: no encoder was exported ({last}); lower optim.lr")


def _resume(cfg: Config, accelerator: Accelerator, root: Path, task, optimizer) -> tuple[Path | None, dict]:
    """Load the checkpoint to continue from into `task` and `optimizer`: with resume=auto the newest
    that loads on every rank (the others are skipped and named), a given directory, or none.
    Returns it and its saved state ({} when starting afresh)."""
    if cfg.train.resume == "none":
        return None, {}
    if cfg.train.resume == "auto":
        order, skipped = rundir.candidates(root)
    else:
        if not Path(cfg.train.resume, "state.pt").is_file():
            raise ConfigError(f"train.resume={cfg.train.resume!r} is not a checkpoint directory (no state.pt); give "
                              "OUTPUT_DIR/checkpoints/step_NNNNNNN, auto (the newest) or none")
        order, skipped = [Path(cfg.train.resume)], []
    for path in order:
        try:
            state, why = load_checkpoint(accelerator, path, task, optimizer), ""
        except ConfigError:
            raise
        except Exception as e:  # a checkpoint is untrusted input: corrupt, empty, crafted (never unpickled)
            why = ("holds objects other than tensors and plain values: refused, never unpickled"
                   if isinstance(e, pickle.UnpicklingError) else f"{type(e).__name__}: {' '.join(str(e).split())[:100]}")
            state = {}
        whys = [w for w in gather_object([why]) if w]
        if not whys:
            if skipped:
                accelerator.print(f"warning: resume skipped checkpoints that do not load: {'; '.join(skipped)}",
                                  file=sys.stderr)
            accelerator.print(f"resumed from {path} (step {state['step']})")
            return path, state
        skipped.append(f"{path.name} ({whys[0]})")
    if order:
        raise ConfigError(f"no checkpoint in '{root}' loads ({'; '.join(skipped)}); delete them to start afresh, "
                          "or give a good one as train.resume=PATH")
    return None, {}


def _warn_changes(old: dict, new: dict, prefix: str = "") -> None:
    """Print the settings that differ from the interrupted run's config.yaml (the optimiser state,
    e.g. weight decay and betas, comes from the checkpoint; the schedule from the new config)."""
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            _warn_changes(a, b, f"{prefix}{k}.")
        elif a != b and prefix + k != "train.resume":
            print(f"warning: resuming with {prefix}{k}={b!r} (the checkpointed run had {a!r})", file=sys.stderr)


def _batches(loader, start: int):
    """Micro-batches from global position `start` on, across epochs (epoch e, batch k of it)."""
    epoch, k = divmod(start, loader.batches_per_epoch)
    while True:
        yield from loader.epoch(epoch, start_batch=k)
        epoch, k = epoch + 1, 0
