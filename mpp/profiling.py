"""Where a training step's time goes: `train.profile=[first, count]` records the steps first+1 ..
first+count (the progress bar's count) with `torch.profiler`, host and device.

The loop marks its phases (`PHASES`: waiting for the batch, forward, backward, clipping with the
optimiser step) with `phase`, torch's `record_function`, which costs next to nothing while no
profiler records, and the prefetch thread its own (`THREAD_PHASES`: reading a batch from the
loader, pinning and copying it): the profiler records every thread and every device kernel and
copy. After the last recorded step every rank writes, under `OUTPUT_DIR/profile/`,
`rank{r}.json` (per phase the host's milliseconds per step, the step's, and the device's busy
milliseconds per step), `rank{r}.txt` (the same in words, then torch's operator table) and
`rank{r}.trace.json.gz`, a Chrome / Perfetto trace of the steps.
So a trainer that leaves the GPU idle says why: a data wait, the host queueing kernels, or gaps.
The step before the window warms the profiler up (its first recorded step would be slow); a
resumed run records what is left of the window after that warm-up step, a run that ends inside it
the steps it ran, and a loop that raises inside it only stops the profiler (no half-recorded
figures).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, record_function

from mpp.fileio import write_atomic

PHASES = ("mpp/data", "mpp/forward", "mpp/backward", "mpp/optimizer")  # the loop's thread
THREAD_PHASES = ("mpp/loader", "mpp/stage")  # the prefetch thread (mpp.prefetch), a batch ahead


def phase(name: str) -> record_function:
    """A named range (one of PHASES or THREAD_PHASES) in the profile."""
    return record_function(name)


def _all_threads():
    """The profiler setting that records every thread (the prefetch thread's phases too); None on
    a torch without it (tests/test_pinned.py pins it for the supported ones): the loop's alone."""
    try:
        from torch.profiler import _ExperimentalConfig
        return _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):
        return None


class StepProfiler:
    """Context manager around the loop; `step()` after every step. Records nothing (and costs
    nothing) when the window is empty or already behind a resumed run."""

    def __init__(self, window: Sequence[int], start: int, end: int, device: torch.device, out_dir: Path, rank: int,
                 report: Callable[[str], None] = print):
        first, count = window
        self.begin = max(first, start + 1)  # the loop index of the first recorded step
        self.steps = min(first + count, end) - self.begin  # a run that ends inside the window: what it ran
        self.failed = False
        self.device, self.out_dir, self.rank, self.report = device, Path(out_dir), rank, report
        self.prof = None
        if count and self.steps > 0:
            cuda = [ProfilerActivity.CUDA] if device.type == "cuda" else []
            # Kineto's start-up messages (a failed GPU probe on a CUDA build without a GPU) mean nothing here
            self.quieted = not cuda and "KINETO_LOG_LEVEL" not in os.environ  # unset again at the end
            if self.quieted:
                os.environ["KINETO_LOG_LEVEL"] = "6"
            self.prof = torch.profiler.profile(
                activities=[ProfilerActivity.CPU, *cuda], on_trace_ready=self._write,
                acc_events=True,  # one cycle either way; torch 2.11 warns without it
                experimental_config=_all_threads(),
                schedule=torch.profiler.schedule(skip_first=self.begin - start - 1, wait=0, warmup=1,
                                                 active=self.steps, repeat=1))

    def __enter__(self) -> StepProfiler:
        if self.prof is not None:
            self.prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.prof is not None:
            self.failed = exc[0] is not None  # stop the profiler, but report no half-recorded window
            try:
                self.prof.__exit__(*exc)
            finally:
                if self.quieted:  # the process's later runs and children see what they saw before
                    os.environ.pop("KINETO_LOG_LEVEL", None)

    def step(self) -> None:
        if self.prof is not None:
            self.prof.step()

    def _write(self, prof: torch.profiler.profile) -> None:
        if self.failed:
            return
        events = prof.key_averages()
        per_step = lambda us: us / self.steps / 1e3  # noqa: E731  (microseconds in all -> ms a step)
        spent = {name.removeprefix("mpp/"): per_step(sum(e.cpu_time_total for e in events if e.key == name))
                 for name in PHASES + THREAD_PHASES}  # data, forward, ..., loader, stage
        figures = {
            "steps": [self.begin + 1, self.begin + self.steps], "device": str(self.device),
            "step_ms": per_step(sum(e.cpu_time_total for e in events if e.key.startswith("ProfilerStep"))),
            "device_busy_ms": per_step(sum(e.self_device_time_total for e in events  # kernels and copies
                                           if e.device_type != DeviceType.CPU
                                           and not getattr(e, "is_user_annotation", False))),
            **{f"{k}_ms": v for k, v in spent.items()}}
        listed = lambda names: ", ".join(  # noqa: E731
            f"{k} {spent[k]:.2f}" for k in (n.removeprefix("mpp/") for n in names))
        line = (f"profiled steps {self.begin + 1}-{self.begin + self.steps} on {self.device}, rank {self.rank}: a step "
                f"took {figures['step_ms']:.2f} ms on the host: {listed(PHASES)}; the prefetch thread, per step: "
                f"{listed(THREAD_PHASES)}" + (f"; the device was busy {figures['device_busy_ms']:.2f} ms a step "
                                              "(kernels and copies summed)" if self.device.type == "cuda" else ""))
        sort = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        self.out_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.out_dir / f"rank{self.rank}.json", json.dumps(figures, indent=1))
        write_atomic(self.out_dir / f"rank{self.rank}.txt", line + "\n\n" + events.table(sort_by=sort, row_limit=40))
        prof.export_chrome_trace(str(self.out_dir / f"rank{self.rank}.trace.json.gz"))
        self.report(line + f" ({self.out_dir})")
