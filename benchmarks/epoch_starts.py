"""Epoch-start benchmark: how long a training step waits for data at each epoch start of a small
set read many times (a label-fraction fine-tune), with the workers running on into the next epoch
(the shipped loader) against restarting them at every epoch (the loader before it).

  python benchmarks/epoch_starts.py [--data data/cifar10/train/manifest.json] [--fraction 0.1]

Record the figures in docs/benchmarks.md.

The step is simulated by small fp32 matrix products on the main process (torch's threads, as a
real step; fp32, which every CPU runs fast, so the count sized to `--step-ms` is many), so the
workers share the cores with it as they do in training; the step time it took is printed beside
the table. Each
way reads the same `--epochs` epochs of the class-balanced `--fraction` subset (the in-memory raw
cache on, as shipped); the ways alternate `--repeats` times. Reported per way: the wait for the
first batch of the run (worker start-up and the first pass over the shards, which both ways pay),
the mean wait for the first batch of the later epochs, and the run's total wait as a share of its
time; then the ratio of the later epoch starts' waits, run on / restarted.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from mpp.cli import ArgumentParser, UsageError, one_line_errors
from mpp.config import DataConfig
from mpp.data import make_loader


def busy_step(seconds: float) -> tuple[int, torch.Tensor]:
    """How many fp32 128 x 128 matrix products of the returned operand take about `seconds` here;
    a ValueError if one product alone takes longer (the step would silently be slower than asked)."""
    a = torch.randn(128, 128)
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.5:
        a = (a @ a).clamp(-1, 1)
        n += 1
    per = (time.perf_counter() - t0) / n
    if per > seconds:
        raise ValueError(f"one 128x128 fp32 product takes {1000 * per:.1f} ms here, more than the simulated "
                         f"step of {1000 * seconds:g} ms; give a larger --step-ms")
    return round(seconds / per), a


def run(data: str, *, fraction: float, batch_size: int, workers: int, epochs: int, step_s: float,
        follow: bool) -> dict:
    """One way: waits (s) for the first batch, for each later epoch's first batch, and in total;
    the simulated step's mean time (s)."""
    reps, a = busy_step(step_s)
    loader = make_loader(data, batch_size=batch_size, img_size=32, train=True, labeled=True,
                         data_cfg=DataConfig(num_workers=workers, eval_crop_pct=1.0), subset=(fraction, 0))
    loader.stream.follow = follow  # read by the workers when they are forked, at the first epoch
    starts, total, busy, steps, t_run = [], 0.0, 0.0, 0, time.perf_counter()
    for e in range(epochs):
        batches = loader.epoch(e)
        while True:
            t0 = time.perf_counter()
            batch = next(batches, None)
            wait = time.perf_counter() - t0
            total += wait
            if batch is None:
                break
            if len(starts) == e:
                starts.append(wait)
            t0 = time.perf_counter()
            for _ in range(reps):
                a = (a @ a).clamp(-1, 1)
            busy, steps = busy + time.perf_counter() - t0, steps + 1
    elapsed = time.perf_counter() - t_run
    loader.close()
    return {"first": starts[0], "later": statistics.mean(starts[1:]), "share": total / elapsed, "step": busy / steps}


@one_line_errors(extra=(ValueError,))
def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(__doc__)
    p.add_argument("--data", default="data/cifar10/train/manifest.json", help="labeled shards' manifest.json")
    p.add_argument("--fraction", type=float, default=0.1, help="label fraction read (default 0.1)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--workers", type=int, default=1, help="DataLoader workers (default 1, as the CIFAR configs)")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--step-ms", type=float, default=90.0,
                   help="simulated step time (default 90: the CIFAR fine-tune's)")
    p.add_argument("--repeats", type=int, default=2, help="runs per way, alternating (default 2)")
    a = p.parse_args(argv)
    if not Path(a.data).is_file():
        raise UsageError(f"manifest '{a.data}' not found; write the shards first (tools/make_shards.py) or give --data")
    if min(a.batch_size, a.workers, a.repeats) < 1 or a.epochs < 2 or a.step_ms <= 0:
        raise UsageError("--batch-size, --workers and --repeats must be >= 1, --epochs >= 2, --step-ms > 0")
    rows = {"restarted every epoch": [], "run on (shipped)": []}
    for _ in range(a.repeats):
        for name, follow in (("restarted every epoch", False), ("run on (shipped)", True)):
            rows[name].append(run(a.data, fraction=a.fraction, batch_size=a.batch_size, workers=a.workers,
                                  epochs=a.epochs, step_s=a.step_ms / 1000, follow=follow))
    print("| workers | way | first batch (s) | later epoch starts, mean wait (s) | wait share of the run |")
    print("|---:|---|---:|---:|---:|")
    for name, runs in rows.items():
        print(f"| {a.workers} | {name} | " + " / ".join(f"{r['first']:.3f}" for r in runs) + " | "
              + " / ".join(f"{r['later']:.4f}" for r in runs) + " | "
              + " / ".join(f"{100 * r['share']:.1f}%" for r in runs) + " |")
    print(f"simulated step, asked {a.step_ms:g} ms, took (mean per run): " + "; ".join(
        f"{name} " + " / ".join(f"{1000 * r['step']:.1f} ms" for r in runs) for name, runs in rows.items()))
    ratio = [r["later"] / b["later"] for r, b in zip(rows["run on (shipped)"], rows["restarted every epoch"])]
    print("later epoch starts' wait, run on / restarted: " + " / ".join(f"{x:.2f}" for x in ratio))


if __name__ == "__main__":
    main()
