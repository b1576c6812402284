"""Training-step benchmark of the MPP objective: this project against two straightforward ways.

  python benchmarks/train_step.py [--only ti4 s16 b16] [--device cuda] [--json PATH]
  python benchmarks/train_step.py --only ti4 --steps 2 --warmup 1 --no-loader     (a quick check)

Take final figures on a quiet machine and record them in docs/benchmarks.md.

Methods, each a full optimiser step (forward, backward, gradient clipping, AdamW) on the same
in-memory uint8 batch laid out as the loader's, at equal precision (bf16 autocast, or fp32), timed
a block of `--block` steps at a time in turn and summarised by the median step time:
- `mpp`: `build_task` + `create_optimizer` exactly as the trainer builds them (attention path
  "auto", fused AdamW, corruption sampled on the device, the last block's row-wise parts, head
  and loss on the chosen patches only, no host sync), optionally `torch.compile`d;
- `timm+loop`: a timm ViT as created by default (timm's attention choice) with a hand-written MPP
  loss (boolean-mask corruption, head over all tokens, loss on the chosen ones) and
  `torch.optim.AdamW` defaults;
- `mpp+compile`, `timm+compile`: the same steps with the model under `torch.compile` (mpp through
  `mpp.compiled`, as the trainer's `train.compile`); `mpp+cudagraphs`: compiled with
  `train.compile_mode=reduce-overhead` (CUDA graphs);
- `vit-pytorch`: the `vit_pytorch` package's `ViT` + `MPP` at 50% / 80-10-10 (its `cls_token`
  and `pos_embedding` reshaped to the 3-D tensors its MPP expects), `torch.optim.AdamW`.
Model FLOPs of one step are counted with `torch.utils.flop_counter` (matmuls, convolutions,
attention; forward and backward) and set against the machine's matmul peak of each precision
benchmarked, measured here with the largest square product (up to 4096^3) that about a second
allows: `of peak` is model FLOP/s over the bf16 peak (blank without bf16), the `ceiling` column
the images/s the step would reach if all its FLOPs ran at the matmul peak of its precision and
everything else were free. The loader check
(`loader_check`) times the `mpp` step in steady state on batches from `make_loader` over
generated synthetic shards (through `mpp.prefetch`, as the trainer) against the same step on an
in-memory batch. `device`: cpu or cuda (CUDA steps are timed with a synchronize after each block; peak
memory is each method's own: what it holds between steps plus CUDA's allocator peak above that
in one step, with the CUDA graphs' pools, see `peak_memory`; the other methods' weights and
optimiser states, alive beside it, are not counted).
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import timm
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from mpp.cli import ArgumentParser, UsageError, one_line_errors
from mpp.compiled import compile_task
from mpp.config import build_config
from mpp.models import create_encoder
from mpp.objectives import build_task
from mpp.targets import mean_color_targets
from mpp.optim import create_optimizer
from mpp.runtime import autocast

# benchmark name -> preset; per device: the models run by default and each one's default batch
MODELS = {"ti4": "vit_ti4_32", "s16": "vit_s16", "b16": "vit_b16"}
DEFAULT_MODELS = {"cpu": ("ti4", "s16"), "cuda": ("ti4", "s16", "b16")}
DEFAULT_BATCH = {"cpu": {"ti4": 128, "s16": 128, "b16": 32}, "cuda": {"ti4": 1024, "s16": 256, "b16": 256}}
METHODS = ("mpp", "mpp+compile", "mpp+cudagraphs", "timm+loop", "timm+compile", "vit-pytorch")
# compiling takes minutes on CPU; vit-pytorch fails on CUDA
DEFAULT_METHODS = {"cpu": ("mpp", "timm+loop", "vit-pytorch"),
                   "cuda": ("mpp", "mpp+compile", "mpp+cudagraphs", "timm+loop", "timm+compile")}
PRECISIONS = {"bf16": "bf16", "fp32": "no"}
CPU = torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(m: int, k: int, n: int, dtype: torch.dtype = torch.bfloat16, reps: int = 10,
                device: torch.device = CPU, budget_s: float = 1.0) -> float:
    """FLOP/s of the best of up to `reps` (m x k) @ (k x n) matmuls in `dtype`, no rep started after
    `budget_s` seconds of them: a dtype with no fast path here (bf16 on an AVX2 CPU) takes seconds
    a product, and ten of them would hold the benchmark up for minutes."""
    a, b = torch.randn(m, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device)
    a @ b
    best, start = math.inf, time.perf_counter()
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t)
        if time.perf_counter() - start >= budget_s:
            break
    return 2 * m * k * n / best


def matmul_peak(dtype: torch.dtype, max_n: int, device: torch.device = CPU, budget_s: float = 1.0) -> dict:
    """The practical matmul peak in `dtype`: {"flops": FLOP/s, "n": size} of an n x n x n product,
    n doubled from 256 up to `max_n` while the next size's product (8x the last one's time) would
    take at most half of `budget_s`, then timed for `budget_s` (`matmul_rate`). A size that does not
    fill the machine only lowers the peak; the printed size says which one counted."""
    n = 256
    while n < max_n and 8 * 2 * n ** 3 / matmul_rate(n, n, n, dtype, reps=1, device=device) <= budget_s / 2:
        n *= 2
    return {"flops": matmul_rate(n, n, n, dtype, device=device, budget_s=budget_s), "n": n}


def matmul_peaks(precisions=("bf16", "fp32"), device: torch.device = CPU) -> dict[str, dict]:
    """{precision: `matmul_peak`} of the precisions benchmarked only; up to 4096^3 for bf16 (8192^3
    on CUDA, where 4096^3 does not fill the card), half that for fp32."""
    n = 8192 if device.type == "cuda" else 4096
    dtypes = {"bf16": (torch.bfloat16, n), "fp32": (torch.float32, n // 2)}
    return {p: matmul_peak(dtypes[p][0], dtypes[p][1], device) for p in precisions}


def gemm_rates(model: str, batch_size: int = 0, device: torch.device = CPU) -> dict[str, float]:
    """bf16 FLOP/s (`matmul_rate`) of the forward GEMM shapes of a model's linear layers at a batch
    (tokens x dim times dim x {3 dim, dim, mlp}, tokens x mlp times mlp x dim): how close the step's
    own matrix multiplies come to the large-matmul peak."""
    d = _arch(MODELS[model])[2]
    tokens = (batch_size or DEFAULT_BATCH[device.type][model]) * ((d["img"] // d["patch"]) ** 2 + 1)
    shapes = ((d["dim"], 3 * d["dim"]), (d["dim"], d["dim"]), (d["dim"], d["mlp"]), (d["mlp"], d["dim"]))
    return {f"{tokens}x{k}x{n}": matmul_rate(tokens, k, n, device=device) for k, n in shapes}


def add_peaks(rows: list[dict], peaks: dict[str, dict]) -> None:
    """Rows with `flops` get the ceiling (images/s with every model FLOP at the matmul peak of the
    row's precision, nothing else) and, where bf16 was benchmarked, model FLOP/s as a fraction of
    the bf16 matmul peak."""
    for r in rows:
        if "flops" in r:
            r["ceiling_images_per_s"] = r["batch"] * peaks[r["precision"]]["flops"] / r["flops"]
            if "bf16" in peaks:
                r["of_bf16_peak"] = r["flops"] / r["step_s"] / peaks["bf16"]["flops"]


def _arch(preset: str) -> tuple[str, dict, dict]:
    """(timm name, kwargs, resolved dims) of a preset, read from a timm model's own attributes."""
    enc = create_encoder(preset, attn="fused")
    vit = enc.vit
    dims = dict(img=enc.grid_size[0] * enc.patch_size, patch=enc.patch_size, dim=enc.embed_dim,
                depth=len(vit.blocks), heads=vit.blocks[0].attn.num_heads,
                mlp=vit.blocks[0].mlp.fc1.out_features)
    spec = enc.model_spec()
    return spec["name"], spec["kwargs"], dims


def _clip_and_step(params, optimizer) -> None:
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def ours(preset: str, precision: str, compile: str = "", device: torch.device = CPU) -> tuple[Callable, nn.Module]:
    """The trainer's step: Task + fused AdamW; non-finite steps skipped on the device; `compile`:
    eager if empty, else compiled in that `train.compile_mode`."""
    cfg = build_config({"model": preset, "train": {"precision": precision}})
    task = build_task(cfg, create_encoder(preset, attn=cfg.train.attn), None).to(device)
    optimizer = create_optimizer(cfg, task)
    forward = compile_task(task, compile) if compile else task
    params = [p for p in task.parameters() if p.requires_grad]

    def step(images):
        with autocast(device, precision):
            loss, _ = forward(images)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.clip_grad)
        optimizer.found_inf = (~torch.isfinite(norm)).float()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step, task


class PlainMPP(nn.Module):
    """A straightforward timm ViT + hand-written MPP loss (what one writes without this project)."""

    def __init__(self, preset: str):
        super().__init__()
        name, kwargs, _ = _arch(preset)
        self.vit = timm.create_model(name, **kwargs)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, self.vit.embed_dim))
        self.head = nn.Linear(self.vit.embed_dim, 512)

    def forward(self, images):
        x01 = images.float() / 255
        x = (x01 - 0.5) / 0.5
        t = self.vit.patch_embed(x)
        B, N, _ = t.shape
        chosen = torch.rand(B, N, device=t.device).argsort(1).argsort(1) < N // 2
        r = torch.rand(B, N, device=t.device)
        swapped = chosen & (r >= 0.8) & (r < 0.9)
        t = t.clone()
        t[swapped] = t[torch.arange(B, device=t.device)[:, None], torch.randint(0, N, (B, N), device=t.device)][swapped]
        t[chosen & (r < 0.8)] = self.mask_token.to(t.dtype)
        t = self.vit.norm(self.vit.blocks(self.vit._pos_embed(t)))
        logits = self.head(t[:, 1:])
        return F.cross_entropy(logits[chosen].float(),
                               mean_color_targets(x01, self.vit.patch_embed.patch_size[0])[chosen])


def timm_loop(preset: str, precision: str, compile: bool = False,
              device: torch.device = CPU) -> tuple[Callable, nn.Module]:
    model = PlainMPP(preset).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    forward = torch.compile(model) if compile else model

    def step(images):
        with autocast(device, precision):
            loss = forward(images)
        loss.backward()
        _clip_and_step(model.parameters(), optimizer)
    return step, model


def vit_pytorch(preset: str, precision: str, device: torch.device = CPU) -> tuple[Callable, nn.Module]:
    try:
        from vit_pytorch import ViT
        from vit_pytorch.mpp import MPP
    except ImportError:
        raise RuntimeError("the vit-pytorch comparison needs the package: pip install vit-pytorch") from None
    _, _, d = _arch(preset)
    vit = ViT(image_size=d["img"], patch_size=d["patch"], num_classes=1000, dim=d["dim"], depth=d["depth"],
              heads=d["heads"], dim_head=d["dim"] // d["heads"], mlp_dim=d["mlp"])
    vit.cls_token = nn.Parameter(vit.cls_token.data.view(1, 1, -1))  # the MPP class expects 3-D
    vit.pos_embedding = nn.Parameter(vit.pos_embedding.data.unsqueeze(0))
    model = MPP(transformer=vit, patch_size=d["patch"], dim=d["dim"], mask_prob=0.5, replace_prob=0.8,
                random_patch_prob=0.1, mean=[0.5] * 3, std=[0.5] * 3)
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

    def step(images):
        with autocast(device, precision):
            loss = model((images.float() / 255 - 0.5) / 0.5)
        loss.backward()
        _clip_and_step(model.parameters(), optimizer)
    return step, model


BUILDERS = {"mpp": ours, "mpp+compile": functools.partial(ours, compile="default"),
            "mpp+cudagraphs": functools.partial(ours, compile="reduce-overhead"), "timm+loop": timm_loop,
            "timm+compile": functools.partial(timm_loop, compile=True), "vit-pytorch": vit_pytorch}


def time_interleaved(steps: dict[str, Callable], images: torch.Tensor, warmup: int, rounds: int,
                     block: int = 1) -> dict[str, float]:
    """Median seconds per step of each method, timed a block of `block` steps at a time in turn (A,
    B, C, A, B, C, ...) after `warmup` untimed steps each: drift or a burst of other work on the
    machine hits all methods alike, and the median drops the bursts. The device is synchronised at
    a block's ends only: inside it the host queues a step while the device runs the last, as in
    the trainer (a sync after every step would charge the in-memory step with the host's time)."""
    for step in steps.values():
        for _ in range(warmup):
            step(images)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            _sync(images.device)
            start = time.perf_counter()
            for _ in range(block):
                step(images)
            _sync(images.device)
            times[name].append((time.perf_counter() - start) / block)
    return {name: statistics.median(t) for name, t in times.items()}


def batch_like_the_loader(B: int, img: int, device: torch.device) -> torch.Tensor:
    """A random uint8 batch (B, 3, img, img) laid out as the loader's (channels last: it decodes
    HWC images and permutes them), so a compiled step meets the same strides as in training."""
    return torch.randint(0, 256, (B, img, img, 3), dtype=torch.uint8, device=device).permute(0, 3, 1, 2)


def step_flops(step: Callable, images: torch.Tensor) -> int:
    """FLOPs of one training step (forward + backward) as torch's flop counter sees them."""
    with FlopCounterMode(display=False) as counter:
        step(images)
    return counter.get_total_flops()


def allocated(device: torch.device) -> int:
    """CUDA's allocated bytes on `device` (0 elsewhere)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def peak_memory(step: Callable, images: torch.Tensor, held: int, graphs: bool = False) -> int | None:
    """Peak bytes of one step of a method that holds `held` bytes between steps (its weights,
    optimiser state, compiled buffers: what building it and its first step left allocated): that
    plus CUDA's allocator peak above what was allocated before the step, so the other methods
    alive at the same time do not count (None off CUDA). A CUDA-graph step (`graphs`) allocates
    nothing when it replays: its activations live in the graphs' private pools, reserved at
    capture, so the pools' unallocated part counts too."""
    if images.device.type != "cuda":
        return None
    _sync(images.device)
    before = allocated(images.device)
    torch.cuda.reset_peak_memory_stats(images.device)
    step(images)
    peak = held + torch.cuda.max_memory_allocated(images.device) - before
    if graphs:
        pools = [s for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) != (0, 0)]
        peak += sum(s["total_size"] - s["allocated_size"] for s in pools)
    return peak


def run(models=("ti4", "s16"), precisions=("bf16", "fp32"), methods=DEFAULT_METHODS["cpu"], *, steps: int = 5,
        warmup: int = 2, batch_size: int = 0, block: int = 1, device: torch.device = CPU,
        progress: Callable[[str], None] = print) -> list[dict]:
    """One row per (model, precision, method): images/s, speed-up of each `mpp` method over the
    faster other method at the same precision and over each other method (`vs`), the model FLOPs of
    one step (counted on the eager `mpp` step, see `add_peaks`) and the peak memory on CUDA."""
    rows = []
    for key in models:
        preset = MODELS[key]
        B = batch_size or DEFAULT_BATCH[device.type][key]
        img = _arch(preset)[2]["img"]
        images = batch_like_the_loader(B, img, device)
        for prec in precisions:
            built, held = {}, {}
            for method in methods:
                progress(f"{key} {prec} {method}: building")
                torch.manual_seed(0)
                before = allocated(device)
                built[method] = BUILDERS[method](preset, PRECISIONS[prec], device=device)[0]
                built[method](images)  # the first step makes the optimiser state, compiled code, graphs
                _sync(device)
                held[method] = allocated(device) - before
            progress(f"{key} {prec}: timing {', '.join(methods)} in turn")
            seconds = time_interleaved(built, images, warmup, steps, block)
            group = []
            for method, sec in seconds.items():
                row = dict(model=key, preset=preset, batch=B, precision=prec, method=method,
                           step_s=sec, images_per_s=B / sec,
                           peak_bytes=peak_memory(built[method], images, held[method], method.endswith("cudagraphs")))
                progress(f"{key} {prec} {method}: {B / sec:.1f} images/s")
                group.append(row)
            flops = step_flops(built["mpp"] if "mpp" in built else BUILDERS["mpp"](preset, PRECISIONS[prec],
                                                                                   device=device)[0], images)
            del built
            others = {r["method"]: r["images_per_s"] for r in group if not r["method"].startswith("mpp")}
            for r in group:
                if r["method"].startswith("mpp"):
                    r["flops"] = flops
                    r["model_tflops"] = flops / r["step_s"] / 1e12
                    if others:
                        r["speedup"] = r["images_per_s"] / max(others.values())
                        r["vs"] = {m: r["images_per_s"] / v for m, v in others.items()}
            rows += group
    return rows


def run_with_peaks(models=("ti4", "s16"), precisions=("bf16", "fp32"), methods=DEFAULT_METHODS["cpu"],
                   device: torch.device = CPU, **kwargs) -> tuple[list[dict], dict[str, dict]]:
    """`run` plus the matmul peaks of its precisions (measured before and after it, the higher
    counts: other work on the machine only lowers a peak) and the columns that depend on them
    (`add_peaks`)."""
    before = matmul_peaks(precisions, device)
    rows = run(models, precisions, methods, device=device, **kwargs)
    peaks = {k: max(v, before[k], key=lambda p: p["flops"]) for k, v in matmul_peaks(precisions, device).items()}
    add_peaks(rows, peaks)
    return rows, peaks


def loader_check(work_dir: str | Path, model: str = "ti4", *, blocks: int = 5, block_steps: int = 4,
                 warmup: int = 2, batch_size: int = 0, precision: str = "bf16", num_workers: int = 2,
                 shuffle_buffer: int = 2000, compile: str = "", device: torch.device = CPU,
                 progress: Callable[[str], None] = print) -> dict:
    """The `mpp` step fed by `make_loader` over synthetic shards vs the same step on an in-memory
    batch, as a training run feels it: steady state, per-step time including the wait for the batch.

    After `warmup` steps of each kind, `blocks` pairs of blocks of `block_steps` steps alternate
    (memory, loader, memory, loader, ...) so the machine's drift hits both sides alike; the loader
    steps all come from one epoch. The figure is the median over the block pairs of (loader block
    time / memory block time - 1): a burst of other work on the machine spoils one pair, not the
    figure; the mean step times are reported too. The cold start (the wait for the first batch: worker start-up,
    shuffle-buffer fill, first decode; the persistent workers start once per loader, the buffer
    fills every epoch) is timed separately. Caveat: during a memory block
    the idle workers decode up to `num_workers x prefetch_factor` batches ahead, which moves that
    decoding CPU into the memory block; with the default blocks this is a small share of a block."""
    from mpp.data import make_loader
    from mpp.data.synthetic import make_synthetic
    from mpp.prefetch import DevicePrefetcher

    preset = MODELS[model]
    B = batch_size or DEFAULT_BATCH[device.type][model]
    step, task = ours(preset, PRECISIONS[precision], compile=compile, device=device)
    img = task.encoder.grid_size[0] * task.encoder.patch_size
    n = B * (warmup + blocks * block_steps + 1)  # one epoch holds every loader step
    progress(f"loader: writing {n} synthetic images to {work_dir}")
    manifests = make_synthetic(work_dir, train=n, test=0, size=min(img, 64), progress=False)
    assert manifests["train"]["num_samples"] == n
    cfg = build_config({"model": preset, "data": {"num_workers": num_workers, "shuffle_buffer": shuffle_buffer}})
    loader = make_loader(str(Path(work_dir) / "train" / "manifest.json"), batch_size=B, img_size=img,
                         train=True, labeled=False, data_cfg=cfg.data)
    memory = batch_like_the_loader(B, img, device)
    for _ in range(warmup):
        step(memory)
    times: dict[str, list[float]] = {"memory": [], "loader": []}
    waits = []
    # the prefetch thread stops before the loader's workers (exits run in reverse)
    with contextlib.closing(loader), contextlib.closing(DevicePrefetcher(loader.epoch(0), device)) as batches:
        start = time.perf_counter()
        first = next(batches)
        cold = time.perf_counter() - start
        step(first["image"])
        for _ in range(warmup - 1):
            step(next(batches)["image"])
        for b in range(blocks):
            progress(f"loader: block {b + 1}/{blocks}")
            _sync(device)
            start = time.perf_counter()
            for _ in range(block_steps):
                step(memory)
            _sync(device)  # block times: the device runs ahead of the host within a block
            times["memory"].append((time.perf_counter() - start) / block_steps)
            start = time.perf_counter()
            for _ in range(block_steps):
                t = time.perf_counter()
                images = next(batches)["image"]
                waits.append(time.perf_counter() - t)
                step(images)
            _sync(device)
            times["loader"].append((time.perf_counter() - start) / block_steps)
    mean = {k: sum(v) / len(v) for k, v in times.items()}
    per_block = [lo / me - 1 for lo, me in zip(times["loader"], times["memory"])]
    return dict(model=model, batch=B, precision=precision, workers=num_workers, steps=blocks * block_steps,
                blocks=blocks, loader_step_s=mean["loader"], memory_step_s=mean["memory"],
                slowdown=statistics.median(per_block), block_slowdowns=per_block,
                wait_s=sum(waits) / len(waits), cold_start_s=cold)


def format_table(rows: list[dict], peaks: dict[str, dict] | None, loader: dict | None,
                 gemms: dict[str, dict[str, float]] | None = None) -> str:
    lines = []
    if peaks:
        lines.append("matmul peak (best product within about a second): " + ", ".join(
            f"{k} {v['flops'] / 1e12:.3f} TFLOP/s at {v['n']}^3" for k, v in peaks.items())
                     + ("" if "bf16" in peaks else "; bf16 not benchmarked, not measured: no 'of peak'"))
    for model, rates in (gemms or {}).items():
        shapes = ", ".join(f"{k} {v / 1e12:.3f}" for k, v in rates.items())
        lines.append(f"{model} bf16 linear-layer GEMM shapes: {shapes} TFLOP/s")
    lines.append(f"{'model':6} {'prec':5} {'method':12} {'batch':>5} {'step s':>8} {'img/s':>8} "
                 f"{'speed-up':>8} {'TFLOP/s':>8} {'of peak':>7} {'ceiling':>8} {'peak GB':>7}")
    for r in rows:
        sp = f"{r['speedup']:.2f}x" if "speedup" in r else ""
        tf = f"{r['model_tflops']:.3f}" if "model_tflops" in r else ""
        of = f"{100 * r['of_bf16_peak']:.0f}%" if "of_bf16_peak" in r else ""
        ce = f"{r['ceiling_images_per_s']:.1f}" if "ceiling_images_per_s" in r else ""
        mem = f"{r['peak_bytes'] / 2**30:.2f}" if r.get("peak_bytes") else ""
        lines.append(f"{r['model']:6} {r['precision']:5} {r['method']:12} {r['batch']:>5} {r['step_s']:>8.3f} "
                     f"{r['images_per_s']:>8.1f} {sp:>8} {tf:>8} {of:>7} {ce:>8} {mem:>7}")
    for r in rows:
        if "vs" in r:
            lines.append(f"{r['model']} {r['precision']} {r['method']}: " + ", ".join(
                f"{v:.2f}x {m}" for m, v in r["vs"].items()))
    lines.append("speed-up: mpp images/s over the faster of the other methods at the same precision "
                 "(target >= 1.3x); of peak: model FLOP/s over the bf16 matmul peak (target >= 45% for s16); "
                 "ceiling: images/s with every model FLOP at the matmul peak of the row's precision, nothing else")
    if loader:
        blocks = ", ".join(f"{100 * x:+.1f}%" for x in loader["block_slowdowns"])
        lines.append(f"loader ({loader['model']}, batch {loader['batch']}, {loader['precision']}, {loader['workers']} "
                     f"workers, steady state, {loader['steps']} steps each way in {loader['blocks']} interleaved "
                     f"blocks): mean step {loader['loader_step_s']:.3f} s with make_loader (waiting "
                     f"{1000 * loader['wait_s']:.0f} ms for the batch) vs {loader['memory_step_s']:.3f} s in memory; "
                     f"slowdown, median of the blocks: {100 * loader['slowdown']:+.1f}% (trainer / in-memory "
                     f"{1 / (1 + loader['slowdown']):.2f}; target >= 0.90; per block {blocks})")
        lines.append(f"loader cold start: {loader['cold_start_s']:.2f} s until the first batch (worker start-up, "
                     f"once per loader; shuffle-buffer fill, once per epoch), not in the figure above")
    return "\n".join(lines)


@one_line_errors(extra=(RuntimeError, ValueError))
def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(__doc__)
    p.add_argument("--only", nargs="+", choices=list(MODELS),
                   help="models (default: " + "; ".join(f"{d}: {' '.join(m)}" for d, m in DEFAULT_MODELS.items()) + ")")
    p.add_argument("--precision", nargs="+", choices=list(PRECISIONS), default=list(PRECISIONS))
    p.add_argument("--methods", nargs="+", choices=list(METHODS),
                   help="default: " + "; ".join(f"{d}: {' '.join(m)}" for d, m in DEFAULT_METHODS.items()))
    p.add_argument("--device", choices=list(DEFAULT_METHODS), default="cpu")
    p.add_argument("--steps", type=int, default=5,
                   help="timed blocks per method, one at a time in turn with the other methods; "
                        "the median counts (default 5)")
    p.add_argument("--block", type=int, default=0,
                   help="steps per timed block, the device synchronised at its ends only (default: 4 on "
                        "cuda, where the host queues a step while the device runs the last; 1 on cpu)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--batch-size", type=int, default=0, help="0: per model and device, " + "; ".join(
        f"{d}: " + " ".join(f"{m} {b}" for m, b in bs.items()) for d, bs in DEFAULT_BATCH.items()))
    p.add_argument("--no-loader", action="store_true", help="skip the shard-loader check")
    p.add_argument("--loader-model", choices=list(MODELS), default="ti4")
    p.add_argument("--workers", type=int, default=2, help="loader workers for the loader check")
    p.add_argument("--loader-blocks", type=int, default=5,
                   help="loader check: pairs of interleaved blocks, memory then loader (default 5)")
    p.add_argument("--loader-block-steps", type=int, default=4, help="loader check: steps per block (default 4)")
    p.add_argument("--work-dir", default="", help="synthetic shards for the loader check (default: a temp dir)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    a = p.parse_args(argv)
    if min(a.steps, a.loader_blocks, a.loader_block_steps) < 1 or min(a.warmup, a.batch_size, a.workers,
                                                                          a.block) < 0:
        raise UsageError("--steps, --loader-blocks and --loader-block-steps must be >= 1, --warmup, --batch-size, "
                         "--block and --workers >= 0")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but torch sees no CUDA device; use --device cpu")
    device = torch.device(a.device)
    models = a.only or DEFAULT_MODELS[a.device]
    rows, peaks = run_with_peaks(models, a.precision, a.methods or DEFAULT_METHODS[a.device], steps=a.steps,
                                 warmup=a.warmup, batch_size=a.batch_size, device=device,
                                 block=a.block or (4 if device.type == "cuda" else 1),
                                 progress=lambda m: print(m, flush=True))
    gemms = {m: gemm_rates(m, a.batch_size, device) for m in models} if "bf16" in a.precision else {}
    loader = None
    if not a.no_loader:
        with tempfile.TemporaryDirectory() as tmp:
            loader = loader_check(a.work_dir or tmp, a.loader_model, blocks=a.loader_blocks,
                                  block_steps=a.loader_block_steps, warmup=max(a.warmup, 1),
                                  batch_size=a.batch_size, num_workers=a.workers,
                                  precision="bf16" if "bf16" in a.precision else a.precision[0],
                                  compile="default" if device.type == "cuda" else "", device=device)
    print(format_table(rows, peaks, loader, gemms))
    if a.json:
        Path(a.json).write_text(json.dumps({"peak_flops": peaks, "gemm_flops": gemms, "rows": rows, "loader": loader},
                                           indent=1))


if __name__ == "__main__":
    main()
