"""The training loop: MPP or supervised pre-training and fine-tuning, one code path on CPU, one GPU
or many GPUs and nodes (Accelerate; start with `python`, `accelerate launch` or `torchrun`).

Read top to bottom: `setup` (accelerator, evaluators, model, data, optimiser, resume) builds a `Run`,
`loop` trains it (micro-batches, clipping, non-finite steps skipped on the device, schedule,
logging, checkpoints, periodic evaluators), `finish` exports it (encoder, the Task's own files, its
final evaluation, metrics.json). The objective's Task (mpp.objectives) says what differs.

Host syncs: the hot loop reads nothing from the device. Loss, metrics, gradient norm and the
non-finite counters stay device tensors and are read every `train.log_every` steps (a gather of
the window's sums and one of the skip counters; on several processes the SIGTERM check's
all-reduce too), before checkpoints and at the end. A non-finite step is skipped by the fused optimiser kernel
(`optimizer.found_inf`, see mpp.optim); the run stops when the longest run of consecutive
non-finite steps reaches `train.max_bad_steps`, noticed at the next log or checkpoint step.

Ideas of their own live in their own modules: the checkpoint a run resumes from, and whether it
may (mpp.resume); SIGTERM (a preemption) saves the step it comes in and stops the run, in the loop
or outside it (mpp.preemption); non-finite steps are skipped, counted, and stop the run when too
many come in a row (mpp.nonfinite); the TensorBoard writer whose failures read as the run's own
(mpp.tensorboard).
"""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import InitProcessGroupKwargs, broadcast_object_list, gather_object, set_seed
from tqdm.auto import tqdm

from mpp import evaluators, rundir
from mpp.checkpoint import checkpoint_name, checkpoint_order, list_checkpoints, save_checkpoint, sweep_unfinished
from mpp.compiled import compile_task, use_compile
from mpp.config import Config, ConfigError, save_config
from mpp.data import make_loader
from mpp.data.decode import SAMPLE_SKIPS, SHARD_SKIPS, DataError
from mpp.data.sources import resolve
from mpp.evaluators.features import encoder_img_size
from mpp.fileio import write_atomic
from mpp.launcher import die_with_launcher, launch_env
from mpp.models import save_encoder
from mpp.nonfinite import BadSteps, check_export, check_finite, scaler_overflow, skip_unless_finite
from mpp.objectives import OBJECTIVES, Task, build_task
from mpp.optim import create_optimizer, create_scheduler, warmup_note
from mpp.preemption import Preempted, Sigterm, Terminated, stop_on_sigterm, terminated
from mpp.prefetch import DevicePrefetcher
from mpp.profiling import StepProfiler, phase
from mpp.resume import check_changes, check_origin, resume
from mpp.runtime import check_ranks_fit, check_run_settings, deterministic, resolve_precision, together
from mpp.tensorboard import TensorBoard


def train(cfg: Config) -> dict:
    """Run `cfg` (an objective of mpp.objectives.OBJECTIVES) and write its run directory; returns
    the figures also written to `OUTPUT_DIR/metrics.json`. The directory is locked meanwhile; a run
    stopped by an error or Ctrl-C ends its progress bar's line first, so the error line comes last."""
    try:
        with deterministic(cfg.train.deterministic), stop_on_sigterm(rundir.resume_command(cfg.train.resume)):
            run = setup(cfg)
            try:
                loop(run)
                return finish(run)  # which closes them itself when it ends well
            except BaseException as e:
                _close_after_error(run, e)
                raise
    finally:
        rundir.unlock(cfg.output_dir)


def _close_after_error(run: Run, error: BaseException) -> None:
    """What a run stopped by an error or Ctrl-C leaves open: its progress bar, the prefetch thread
    (first: it reads the loader; after a SIGTERM that came in a wait for data waited for 5 s only,
    as it may be stuck in a stalled read and the scheduler's SIGKILL follows), the data workers,
    TensorBoard's writer thread and file. A failure here is said and the original error still
    raised: a full disk refusing TensorBoard's last flush must not turn a Ctrl-C into an OSError."""
    wait = 5.0 if isinstance(error, Terminated) and error.stalled else 60.0
    closers = [("progress bar", run.bar.close),
               ("data loader", lambda: run.batches.close(wait) and run.loader.close()),
               ("TensorBoard writer", run.writer.close if run.writer else lambda: None)]
    for what, close in closers:
        try:
            close()
        except Exception as e:  # noqa: BLE001 - said, and the run's own error goes on
            print(f"warning: closing the {what} after the error failed: {type(e).__name__}: {e}", file=sys.stderr)


@dataclass
class Run:
    """What `setup` builds and `loop` and `finish` share."""
    cfg: Config
    accelerator: Accelerator
    precision: str             # train.precision as resolved for this device
    task: Task                 # encoder + objective head (unwrapped: exports, evaluators)
    model: torch.nn.Module     # the task as prepared by Accelerate (DDP on several ranks)
    forward: Callable          # the model, or its compiled step (train.compile)
    optimizer: Any
    scheduler: Any
    loader: Any
    batches: DevicePrefetcher  # micro-batches a step ahead on the device
    steps: int
    start: int
    state: dict                # totals of the earlier, checkpointed segments
    damaged: list              # checkpoints the resume skipped as damaged, removed once a newer one is saved
    periodic: list             # (name, every, evaluator) run on the encoder during training
    final: Any                 # the Task's final evaluator, or None
    writer: Any                # TensorBoard (main process only, from the first step: `_record`)
    bar: tqdm
    t_begin: float = field(default_factory=time.time)
    setup_s: float = 0.0       # this segment's `setup` but `begin_s`: device, model, data, resume
    begin_s: float = 0.0       # the Task's work before the first step of a fresh run (`_begin`; 0 on resume)
    t_loop: float = field(default_factory=time.perf_counter)
    t_win: float = field(default_factory=time.perf_counter)
    wait_win: float = 0.0      # seconds waiting for data in this log window / before it
    wait_all: float = 0.0
    images: int = 0            # trained on in this segment's closed log windows, all ranks
    last: dict = field(default_factory=dict)  # the latest log window's figures
    lr: float = 0.0            # the (largest group's) learning rate the latest step used
    win: _Window = None
    bad: BadSteps = None

    @property
    def out(self) -> Path:
        return Path(self.cfg.output_dir)


def unreached(cfg: Config, steps: int) -> str:
    """What a run of `steps` asks for periodically but never reaches (a figure that never comes,
    unsaid, misleads): '' where all is reached."""
    late = [f"{key}={every}" for key, every in (("fewshot.every", cfg.fewshot.every),
                                                ("train.image_every", cfg.train.image_every)) if every > steps]
    first, count = cfg.train.profile
    late += [f"train.profile={[first, count]} (steps {first + 1}..{first + count})"] if count and first >= steps else []
    return f"{', '.join(late)} past the run's {steps} steps: never reached; lower it" if late else ""


def setup(cfg: Config) -> Run:
    """Check, build and resume everything the run needs; nothing in the run directory changes
    but its lock (config.yaml and TensorBoard wait for the first step, see `_record`)."""
    t_begin = time.time()
    _check_settings(cfg)
    die_with_launcher()
    objective = OBJECTIVES[cfg.objective]
    out, accum = Path(cfg.output_dir), cfg.train.grad_accum

    # accelerator: device, processes, mixed precision (autocast wraps the model's forward)
    AcceleratorState._reset_state()  # a later train() in the same process may use another precision
    # cpu=True on machines without an accelerator: only then does Accelerate treat torchrun /
    # accelerate launch processes as MULTI_CPU (gloo) ranks instead of independent single runs
    launch = launch_env()
    on_accelerator = torch.accelerator.is_available()
    device_type = torch.accelerator.current_accelerator().type if on_accelerator else "cpu"
    if on_accelerator:
        check_ranks_fit(launch["LOCAL_WORLD_SIZE"], torch.accelerator.device_count(), device_type)
    precision = resolve_precision(cfg.train.precision, device_type)
    accelerator = Accelerator(mixed_precision=precision, cpu=not on_accelerator, kwargs_handlers=[
        InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=cfg.train.dist_timeout))])
    device, world = accelerator.device, accelerator.num_processes
    check_run_settings(cfg, world)
    # lock the run directory before the heavy set-up: a directory another run holds, or one that
    # train.resume=none may not reuse, stops the run before it loads encoders and data (locked
    # first: what a directory holds is told only of one no live run is writing)
    def claim() -> None:
        rundir.lock(out)
        if cfg.train.resume == "none":
            rundir.check_fresh(out)
        elif cfg.train.resume == "auto":
            rundir.check_unfinished(out)
    together(accelerator, claim, f"take output_dir '{out}'")  # the other ranks stop with it, not at a barrier
    # evaluators check their settings and data now, on every rank; they run on the main process
    periodic = evaluators.periodic(cfg, device)
    final = evaluators.create(objective.final_eval, cfg, device) if objective.final_eval else None

    # model: the same initialisation on every rank; data: every rank reads its own part
    set_seed(cfg.seed)
    encoder = objective.encoder_for(cfg)
    loader = make_loader(cfg.data.train, batch_size=cfg.batch_size // (world * accum),
                         img_size=encoder_img_size(encoder), train=True, labeled=objective.labeled,
                         data_cfg=cfg.data, seed=cfg.seed, rank=accelerator.process_index, world_size=world,
                         num_samples=cfg.data.num_samples, subset=objective.subset(cfg),
                         withhold=cfg.data.withhold)
    if objective.labeled and len(loader.classes or ()) < 2:
        raise ConfigError(f"objective={cfg.objective} needs labeled shards whose manifest.json lists 2 or more "
                          f"'classes'; data.train={cfg.data.train!r} lists {len(loader.classes or ())}")
    steps = cfg.steps or math.ceil(cfg.epochs * loader.batches_per_epoch / accum)
    if 1 <= steps <= cfg.optim.warmup_steps and accelerator.is_main_process:
        print(f"warning: {warmup_note(cfg, steps)}", file=sys.stderr)
    if (late := unreached(cfg, steps)) and accelerator.is_main_process:
        print(f"warning: {late}", file=sys.stderr)
    task = build_task(cfg, encoder, len(loader.classes) if objective.labeled else None).to(device)
    optimizer = create_optimizer(cfg, task)
    scheduler = create_scheduler(cfg, optimizer, steps)
    model, optimizer = accelerator.prepare(task, optimizer)  # not the loader: it splits by rank itself

    # resume from the newest checkpoint that loads, or seed this rank's own RNG stream (corruption,
    # drop path)
    if accelerator.is_main_process:
        sweep_unfinished(out / "checkpoints")
    resumed, state, damaged = resume(cfg, accelerator, out / "checkpoints", task, optimizer)
    if state.get("step", 0) > steps:
        raise ConfigError(f"the checkpoint to resume ({resumed}) is at step {state['step']}, past this run's {steps} "
                          f"steps; give steps of at least {state['step']} (or epochs with steps=0), or "
                          "train.resume=none and another output_dir")
    origin = task.origin(cfg)
    if resumed:
        check_origin(out, state.get("origin", {}), origin)
        check_changes(out, cfg, accelerator, state["step"], steps)
        accelerator.print(f"resumed from {resumed} (step {state['step']})")
    begin_s = 0.0
    if not resumed:
        t = time.time()
        begun = _begin(cfg, accelerator, task, final, precision)
        begin_s = time.time() - t
        set_seed(int(np.random.SeedSequence([cfg.seed, accelerator.process_index]).generate_state(1)[0]))
        state = {"step": 0, "nonfinite_steps": 0, "elapsed": 0.0, "train_time": 0.0, "data_wait": 0.0,
                 "last": {}, "skipped": {}, "begun": begun, "origin": origin}
    state.setdefault("begun", {})  # a checkpoint from before start-up figures were kept
    state.setdefault("origin", origin)  # ... or before the inputs it started from were (unverifiable)
    task.restore(state["begun"])
    start = state["step"]
    scheduler.step_update(start)
    main = accelerator.is_main_process
    zero = torch.zeros((), device=device)
    return Run(
        cfg=cfg, accelerator=accelerator, precision=precision, task=task, model=model,
        forward=compile_task(model, cfg.train.compile_mode) if use_compile(cfg.train.compile, device, steps) else model,
        optimizer=optimizer, scheduler=scheduler, loader=loader,
        # `batches.counted`: the skips of the batches handed out, not the look-ahead's
        batches=DevicePrefetcher(_batches(loader, start * accum), device, counters=loader.counters),
        steps=steps, start=start, state=state, damaged=damaged, periodic=periodic, final=final,
        writer=None,  # opened by `_record` once a step is done
        bar=tqdm(total=steps, initial=start, disable=not main, desc=f"{cfg.objective} {out.name}", dynamic_ncols=True),
        t_begin=t_begin, setup_s=time.time() - t_begin - begin_s, begin_s=begin_s, last=state["last"],
        win=_Window(zero),
        bad=BadSteps(zero, state.get("bad_run", 0), cfg.train.max_bad_steps, state.get("overflow_run", 0)))


def _begin(cfg: Config, accelerator: Accelerator, task: Task, final, precision: str) -> dict:
    """The Task's start-up work of a fresh run, by the main process alone (every rank then starts
    from its weights and its choices), and when it changed weights, the start scored on the final
    evaluation's data (e.g. LP-FT's probe head): the figures metrics.json records."""
    began = task.begin(cfg, accelerator.device, precision) if accelerator.is_main_process else None
    if accelerator.num_processes > 1:
        began = broadcast_object_list([began])[0]
    if began is None:
        return {}
    begun, changed = began
    for p in task.parameters() if changed and accelerator.num_processes > 1 else ():
        torch.distributed.broadcast(p.data, 0)
    task.restore(begun)
    if changed and final is not None:
        start = final.run(task)
        begun = {**begun, "start_top1": start["top1"],
                 **({"start_outcomes": start["outcomes"]} if "outcomes" in start else {})}
    return begun


def loop(run: Run) -> None:
    """Train from `run.start` to `run.steps`: one optimiser step per iteration."""
    cfg, accelerator, model = run.cfg, run.accelerator, run.model
    accum, main = cfg.train.grad_accum, accelerator.is_main_process
    shown = None  # the images of the MPP prediction grid (train.image_every)
    model.train()
    with StepProfiler(cfg.train.profile, run.start, run.steps, accelerator.device, run.out / "profile",
                      accelerator.process_index, report=tqdm.write if main else lambda line: None) as profiler, \
            Sigterm() as sigterm:
        for step in range(run.start, run.steps):
            # -- forward/backward over grad_accum micro-batches; gradients all-reduced on the last only
            micro, losses, counted = [], [], run.batches.counted
            for _ in range(accum):
                micro.append(_next_batch(run, step, counted, sigterm))
            weights = _sample_weights(accelerator, micro)
            for i, batch in enumerate(micro):
                images = batch["image"]
                with accelerator.no_sync(model) if i < accum - 1 else contextlib.nullcontext():
                    with phase("mpp/forward"):
                        loss, metrics = run.forward(images, batch.get("label"))
                    with phase("mpp/backward"):
                        accelerator.backward(loss * weights[i] / accum)
                run.win.add_micro(loss, metrics, len(images))
                losses.append(loss.detach())

            # -- clip, then step only if the gradient is finite (decided on the device, no host sync)
            with phase("mpp/optimizer"):
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad or math.inf)
                finite = torch.isfinite(grad_norm)
                overflow = scaler_overflow(accelerator, finite, losses)
                skip_unless_finite(accelerator.scaler, run.optimizer.optimizer, finite)
                run.optimizer.step()
                run.optimizer.zero_grad(set_to_none=True)
            done = step + 1
            checkpoint_now = _checkpoint_due(run, done)
            # a checkpoint closes the log window too: a run resumed there averages the same windows
            log_now = done % cfg.train.log_every == 0 or checkpoint_now
            stop = sigterm.now(accelerator, log_now)
            checkpoint_now, log_now = checkpoint_now or stop, log_now or stop
            run.lr = max(g["lr"] for g in run.optimizer.param_groups)  # the rate this step used
            run.scheduler.step_update(done)
            run.win.add_step(grad_norm, finite)
            run.bad.add(finite, overflow)
            run.bar.update(1)
            _record(run)

            # -- log: the window's sums gathered every log_every steps
            if log_now:
                _log(run, done)

            # -- MPP prediction grid of a fixed set of images to TensorBoard: this segment's first batch (a
            # resumed run shows others from its resume on)
            if main and cfg.train.image_every and done % cfg.train.image_every == 0:
                from mpp.figures.predictions import log_predictions
                shown = images[:8].clone() if shown is None else shown
                log_predictions(run.writer, run.task, shown, done)

            # -- checkpoint (also at the end, so a finished run resumes to nothing)
            if checkpoint_now:
                _checkpoint(run, done)

            # -- evaluators on the main process (e.g. few-shot; each restores every RNG it touches); a
            # SIGTERM's stop waits for them, the checkpoint saved: its resume starts past this step
            due = [(name, evaluator) for name, every, evaluator in run.periodic if done % every == 0]
            for name, evaluator in due if main else ():
                for k, v in evaluator.run(run.task.encoder).items():
                    if v is not None:  # a std of one draw
                        run.writer.add_scalar(f"{name}/{k}", v, done)
            if stop:
                if due and accelerator.num_processes > 1:  # a rank that exits first has torchrun end the main one
                    accelerator.wait_for_everyone()
                terminated(run, done)
            profiler.step()
        # one that came during the last step's checkpoint or evaluators: that checkpoint is the run's last
        if run.start < run.steps and sigterm.now(accelerator, window=True):
            terminated(run, run.steps)


def finish(run: Run) -> dict:
    """Export the encoder (finite, and only when the last step was) and the Task's own files, run
    the Task's final evaluation and write metrics.json (last: a finished run has one)."""
    cfg, accelerator, task, out = run.cfg, run.accelerator, run.task, run.out
    run.bar.close()
    if run.batches.close():  # its thread reads the loader: stopped first (else it warned; the loader stays open)
        run.loader.close()  # stops the data workers (an epoch may be unfinished)
    _record(run)  # a run resumed at its last step did none
    totals = _totals(run)
    check_export(task.encoder, int(run.bad.run.item()), list_checkpoints(out / "checkpoints"))
    def export() -> None:
        save_encoder(task.encoder, out, cfg.data)  # with the normalisation a fine-tune must use
        task.export(out)
    together(accelerator, export, f"export the encoder to '{out}'")
    encoder = task.encoder
    img_size = encoder_img_size(encoder)
    results = {
        "objective": cfg.objective, "model": cfg.model, "encoder": encoder.model_spec(), "img_size": img_size,
        "precision": run.precision,  # train.precision as resolved for this device (auto decides)
        "batch_size": cfg.batch_size, "steps": run.steps,
        "processes": run.accelerator.num_processes,  # they split the data: another count, another order
        "epochs": totals["images"] / max(run.loader.num_samples, 1), "train_samples": run.loader.num_samples,
        # the last log window: loss and objective metrics (averaged over its samples on all ranks), grad norm
        **{k: v for k, v in run.last.items() if k not in ("lr", "images_per_s", "data_wait_frac", "nonfinite_steps",
                                                          "scaler_skips") and not k.startswith("skipped_")},
        "nonfinite_steps": totals["nonfinite_steps"], "scaler_skips": totals["scaler_skips"],
        "skipped_samples": _skipped(run),  # all ranks, all resumed segments
        # end to end over the whole run (all resumed segments; checkpoint and few-shot time included)
        "images_per_s": totals["images"] / totals["train_time"],  # an epoch's tail batch counts its own size
        "data_wait_frac": totals["data_wait"] / totals["train_time"],
    }
    t_final = time.perf_counter()
    loop_s = t_final - run.t_loop
    if run.final is not None:
        results.update(run.final.run(task))
    # where this process's time went (compare's stage line sets it beside the stage's own wall time):
    # set-up, the Task's begin, the loop (compile and the loader's shutdown included), the final
    # evaluation, all of train()
    results.update(setup_s=run.setup_s, begin_s=run.begin_s, loop_s=loop_s,
                   final_eval_s=time.perf_counter() - t_final, segment_s=time.time() - run.t_begin)
    results.update(task.settings(cfg))
    results.update(run.state["begun"])  # the Task's start-up figures, kept across resumes
    results.update(run.state["origin"])  # what the run started from, checked at every resume
    results["wall_time_s"] = run.state["elapsed"] + time.time() - run.t_begin  # all segments, evaluation included
    def write() -> None:
        if run.writer is not None:  # its files written (or their error raised) before the run counts as finished
            run.writer.close()
        write_atomic(out / "metrics.json", json.dumps(results, indent=2))  # last: compare's "stage finished"
        print(summary(results, out))
    together(accelerator, write, f"write '{out / 'metrics.json'}'")
    return results


def summary(results: dict, out: Path) -> str:
    """The line a finished run prints: its steps and wall time (set-up and final evaluation
    included), its last log window and, for a fine-tune, its top-1 and where it was measured; the
    rest is in metrics.json."""
    parts = [f"steps {results['steps']:,} ({results['epochs']:.1f} epochs of {results['train_samples']:,} images) "
             f"in {results['wall_time_s']:.1f} s",
             "last log window: " + ", ".join(f"{k} {results[k]:.4g}" for k in ("loss", "acc") if k in results)]
    if "top1" in results:
        where = "development split" if results.get("evaluated_on") == "dev" else "data.val"
        parts.append(f"top-1 {100 * results['top1']:.1f}% (top-5 {100 * results['top5']:.1f}%) on "
                     f"{results['val_samples']:,} images of the {where}")
    skipped = results["skipped_samples"]
    samples = sum(n for kind, n in skipped.items() if kind in SAMPLE_SKIPS)
    shards = sum(n for kind, n in skipped.items() if kind in SHARD_SKIPS)
    if samples or shards:
        parts.append(f"{samples:,} samples unreadable or lost" + (f", {shards:,} damaged shard reads" if shards else "")
                     + " (by kind: skipped_samples)")
    return f"{results['objective']} {out}: " + "; ".join(parts) + f"; all figures: {out / 'metrics.json'}"


# ---- the loop's helpers


def _record(run: Run) -> None:
    """Write config.yaml and open TensorBoard (main process, once): after this segment's first
    step, so that a run that fails before it (bad data, start-up) leaves neither. config.yaml then
    always holds the settings the run last trained with, never those of an attempt that trained
    nothing, which the next resume would warn against (and a fresh run's directory is removed)."""
    if run.accelerator.is_main_process and run.writer is None:
        if run.start < run.steps or not (run.out / "config.yaml").is_file():  # not a resume that trained nothing
            save_config(run.cfg, run.out / "config.yaml")
        if run.start < run.steps:  # a finished run started again writes no events (a file of them would be empty)
            # TensorBoard hides an earlier attempt's events from purge_step on: those after the checkpoint
            # resumed from, whose own step closed a log window before it was saved
            run.writer = TensorBoard(run.out / "tensorboard", purge_step=run.start + 1 if run.start else 0)


def _sample_weights(accelerator, micro: list[dict]) -> list:
    """Each micro-batch's weight in the step's gradient, so that every sample of the step counts the
    same: its size x micro-batches x ranks / the step's samples on all ranks. DDP averages the ranks'
    gradients and each loss is a mean over its own micro-batch, so a tail batch that shrank (an
    epoch's end, ranks with unequal shares) would otherwise weigh each of its samples more. 1.0 for
    all when the sizes are equal (then the gradient is bit for bit what it was without weights).
    Plain floats on one process; on several, one all-reduce of the step's sample count, on the
    device (made by a fill, not copied from the host: a copy from pageable memory would wait for
    the device every step)."""
    world, sizes = accelerator.num_processes, [len(b["image"]) for b in micro]
    total = sum(sizes) if world == 1 else accelerator.reduce(
        torch.full((), float(sum(sizes)), device=accelerator.device), "sum")
    return [n * len(micro) * world / total for n in sizes]


_TAGS = {"images_per_s": "perf/images_per_s", "data_wait_frac": "perf/data_wait_frac"}  # others: train/...


def _log(run: Run, done: int) -> None:
    """Gather the window's figures (all ranks), write them to TensorBoard and the progress bar;
    train/lr: the (largest group's) learning rate of the window's last step."""
    check_finite(run, done)
    now = time.perf_counter()
    figures = run.win.read(run.accelerator)
    figures.update({"skipped_" + k: n for k, n in _skipped(run).items()})
    figures["lr"] = run.lr
    images = figures.pop("images")
    run.images += images
    figures["images_per_s"] = images / (now - run.t_win)
    figures["data_wait_frac"] = run.wait_win / (now - run.t_win)
    figures["nonfinite_steps"] = run.state["nonfinite_steps"] + int(run.bad.total.item())
    figures["scaler_skips"] = run.state.get("scaler_skips", 0) + int(run.bad.overflows.item())
    run.last = figures
    if run.accelerator.is_main_process:
        for k, v in figures.items():
            run.writer.add_scalar(_TAGS.get(k, ("data/" if k.startswith("skipped_") else "train/") + k), v, done)
        run.bar.set_postfix(loss=f"{figures['loss']:.4f}", lr=f"{figures['lr']:.2e}")
    run.wait_all += run.wait_win
    run.win.reset()
    run.t_win, run.wait_win = now, 0.0


def _next_batch(run: Run, step: int, counted: dict, sigterm: Sigterm) -> dict:
    """The step's next micro-batch, the wait for it counted as the window's data wait. Where the
    data stop the run (a DataError: a stalled read, a shard changed since it was listed, a label
    out of range) or a SIGTERM comes while it waits for them, one process first saves the step it
    reached, unless a checkpoint holds it, so that the same command resumes there (once the data
    are mended); with the skips counted before this step (`counted`), as the resumed run reads its
    batches again. Ranks cannot: the others wait in the step's all-reduce."""
    t0, alone = time.perf_counter(), run.accelerator.num_processes == 1
    try:
        with phase("mpp/data"), sigterm.waiting(alone):
            batch = next(run.batches)
    except (DataError, Preempted) as e:
        run.wait_win += time.perf_counter() - t0  # a stall's data.timeout too
        if not alone:
            raise
        held = step == run.start or _checkpoint_due(run, step)  # nothing trained since, or saved
        if isinstance(e, Preempted):
            if not held:
                _save_reached(run, step, counted)
            terminated(run, step, "while it waited for data" if e.waited else "before the next batch")
        if held:
            raise
        try:
            _save_reached(run, step, counted)
        except Exception as saving:  # noqa: BLE001 - the data's error is the one to tell
            raise DataError(f"{e} (saving a checkpoint of step {step} first failed too: {type(saving).__name__}: "
                            f"{saving})") from None
        raise DataError(f"{e} (the run saved its checkpoint of step {step} first: once the data are mended, "
                        f"{rundir.resume_command(run.cfg.train.resume)} resumes there)") from None
    run.wait_win += time.perf_counter() - t0
    return batch


def _save_reached(run: Run, step: int, counted: dict) -> None:
    """Checkpoint the `step` steps done when a micro-batch of the next never came, with the skips as
    they stood before it (`counted`). The steps since the last log are logged first, as a stop in
    the loop logs them: their figures are not lost."""
    run.batches.counted = counted
    if run.win.images:
        _log(run, step)
    _checkpoint(run, step)


def _checkpoint_due(run: Run, done: int) -> bool:
    """Whether the loop checkpoints step `done`: every train.ckpt_every steps and at the end."""
    every = run.cfg.train.ckpt_every
    return bool(every) and done % every == 0 or done == run.steps


def _checkpoint(run: Run, done: int) -> None:
    check_finite(run, done)
    save_checkpoint(run.accelerator, run.out / "checkpoints", done, run.task, run.optimizer, run.scheduler,
                    keep=run.cfg.train.keep_ckpts, superseded=run.damaged,
                    state={"skipped": _skipped(run), "begun": run.state["begun"], "origin": run.state["origin"],
                           "bad_run": int(run.bad.run.item()), "overflow_run": int(run.bad.overflow_run.item()),
                           **_totals(run)})
    # removed, or (this step's) replaced by the checkpoint just written: a good one, never to be removed
    run.damaged = [p for p in run.damaged if checkpoint_order(p.name) > checkpoint_order(checkpoint_name(done))]


def _totals(run: Run) -> dict:
    """Run totals over the checkpointed segments plus this process's (plain values)."""
    s = run.state
    return {"nonfinite_steps": s["nonfinite_steps"] + int(run.bad.total.item()),
            "scaler_skips": s.get("scaler_skips", 0) + int(run.bad.overflows.item()),
            "elapsed": s["elapsed"] + time.time() - run.t_begin,
            "train_time": s["train_time"] + time.perf_counter() - run.t_loop,
            "data_wait": s["data_wait"] + run.wait_all + run.wait_win, "last": run.last,
            # a checkpoint from before images were counted: its steps as full batches
            "images": s.get("images", s["step"] * run.cfg.batch_size) + run.images}


def _skipped(run: Run) -> dict[str, int]:
    """Skipped samples by kind over all ranks and all resumed segments (a collective: every rank;
    each rank has only the kinds it saw)."""
    total = Counter(run.state.get("skipped", {}))
    for counters in gather_object([run.batches.counted]):
        total.update(counters)
    return dict(total)


class _Window:
    """Device-side sums over the steps since the last log; `read` brings them to the host once."""

    def __init__(self, zero: torch.Tensor):
        self.zero = zero
        self.reset()

    def reset(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.images = 0  # this rank's, counted on the host (an epoch's tail batch is smaller)
        self.norm, self.finite = self.zero.clone(), self.zero.clone()

    def add_micro(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor], images: int) -> None:
        """A micro-batch's mean loss and metrics, weighed by its size `images`; a 1-d metric is
        class counts, added as they are."""
        for k, v in {"loss": loss, **metrics}.items():
            v = v.detach().float()
            self.sums[k] = self.sums.get(k, self.zero) + (v if v.dim() else v * images)
        self.images += images

    def add_step(self, grad_norm: torch.Tensor, finite: torch.Tensor) -> None:
        self.norm = self.norm + torch.where(finite, grad_norm.float(), self.zero)
        self.finite = self.finite + finite.float()

    def read(self, accelerator: Accelerator) -> dict[str, float]:
        """Means over the window's samples, on all ranks (an epoch's smaller tail step weighs its
        samples, not a step's share); for class counts, the share of the window's most frequent
        class on all ranks; the gradient norm (the same on every rank) over the window's finite
        steps; `images`: the window's images on all ranks."""
        names = sorted(self.sums)
        images = torch.full((1,), float(self.images), device=self.zero.device)  # a fill: no copy from the host
        parts = [self.sums[k].reshape(-1) for k in names] + [self.norm[None], self.finite[None], images]
        total = accelerator.gather(torch.cat(parts)[None]).sum(0).tolist()
        figures, at = {}, 0
        for k in names:
            v, at = total[at:at + self.sums[k].numel()], at + self.sums[k].numel()
            figures[k] = max(v) / sum(v) if self.sums[k].dim() else v[0] / total[-1]
        figures["grad_norm"] = total[-3] / total[-2] if total[-2] else float("nan")
        figures["images"] = round(total[-1])
        return figures


def _check_settings(cfg: Config) -> None:
    """Checks of settings the trainer itself needs, before any work (the Task and the evaluators
    check their own when built)."""
    check_run_settings(cfg)
    if not cfg.data.train:
        raise ConfigError("config key 'data.train' is empty; give a manifest.json, a shard list or a brace pattern")
    rundir.check_output_dir(cfg.output_dir)
    resolve(cfg.data.train, cfg.data.num_samples)


def _batches(loader, start: int):
    """Micro-batches from global position `start` on, across epochs (epoch e, batch k of it)."""
    epoch, k = divmod(start, loader.batches_per_epoch)
    while True:
        yield from loader.epoch(epoch, start_batch=k)
        epoch, k = epoch + 1, 0
