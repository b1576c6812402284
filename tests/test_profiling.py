"""`train.profile`: the window of steps it records (also after a resume), the figures and files
it writes, and its settings checked before any work."""
from __future__ import annotations

import gzip
import json
import os
import time
from pathlib import Path

import pytest
import torch
from torch.profiler import record_function

from mpp.config import ConfigError, load_config
from mpp.profiling import PHASES, StepProfiler, phase


def loop(out: Path, window, start: int, end: int, device: str = "cpu", fail_at: int = -1, wait: float = 0.0,
         report=lambda line: None) -> None:
    """A stand-in training loop with the trainer's phases, each step marked `step{index}`; it
    raises at loop index `fail_at`, and waits `wait` seconds for each batch."""
    w = torch.randn(64, 64, device=device, requires_grad=True)
    with StepProfiler(window, start, end, torch.device(device), out, rank=0, report=report) as profiler:
        for step in range(start, end):
            if step == fail_at:
                raise FloatingPointError("a failing step")
            with phase("mpp/data"), record_function(f"step{step}"):
                time.sleep(wait)
                x = torch.randn(32, 64).to(device, non_blocking=True)
            with phase("mpp/forward"):
                loss = (x @ w).square().mean()
            with phase("mpp/backward"):
                loss.backward()
            with phase("mpp/optimizer"):
                w.data.add_(w.grad, alpha=-0.1)
                w.grad = None
            profiler.step()


def traced(out: Path, name: str) -> int:
    with gzip.open(out / "rank0.trace.json.gz", "rt") as f:
        return sum(e.get("name") == name for e in json.load(f)["traceEvents"])


def test_the_window_holds_its_own_steps_in_milliseconds_a_step_and_says_so(tmp_path, monkeypatch):
    """The steps recorded are the window's, after one warm-up step (not the warm-up itself); the
    figures are per step, not the window's sums; a line says them, with no device time on a CPU;
    Kineto is quieted on a CPU while the profiler starts."""
    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    real, levels, lines = torch.profiler.profile, [], []
    monkeypatch.setattr(torch.profiler, "profile", lambda **kw: levels.append(os.environ.get("KINETO_LOG_LEVEL"))
                        or real(**kw))
    loop(tmp_path, (4, 4), start=0, end=10, wait=0.02, report=lines.append)
    assert levels == ["6"] and "KINETO_LOG_LEVEL" not in os.environ
    assert [traced(tmp_path, f"step{i}") for i in range(10)] == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0]
    figures = json.loads((tmp_path / "rank0.json").read_text())
    assert 20 <= figures["data_ms"] < 60 and figures["step_ms"] >= figures["data_ms"]  # 20 ms of waiting a step
    assert len(lines) == 1 and lines[0].startswith("profiled steps 5-8 on cpu, rank 0: a step took ")
    assert "; the prefetch thread, per step: loader " in lines[0] and "device was busy" not in lines[0]
    assert lines[0].endswith(f" ({tmp_path})")


def test_the_window_records_its_steps_and_what_is_left_of_it_after_a_resume(tmp_path):
    loop(tmp_path / "fresh", (4, 3), start=0, end=10)  # the loop's indices 4..6: steps 5..7 in the bar's count
    figures = json.loads((tmp_path / "fresh" / "rank0.json").read_text())
    assert figures["steps"] == [5, 7] and traced(tmp_path / "fresh", "mpp/forward") == 3
    for name in PHASES:
        assert figures[name.split("/")[1] + "_ms"] > 0, name
    assert figures["step_ms"] >= sum(figures[n.split("/")[1] + "_ms"] for n in PHASES) * 0.99
    assert "mpp/backward" in (tmp_path / "fresh" / "rank0.txt").read_text()
    loop(tmp_path / "resumed", (4, 3), start=4, end=10)  # resumed at the window: it warms up there, records the rest
    assert json.loads((tmp_path / "resumed" / "rank0.json").read_text())["steps"] == [6, 7]
    assert traced(tmp_path / "resumed", "mpp/forward") == 2
    loop(tmp_path / "behind", (4, 3), start=6, end=10)  # resumed at its last step: nothing left after the warm-up
    loop(tmp_path / "off", (4, 0), start=0, end=10)
    assert not (tmp_path / "behind").exists() and not (tmp_path / "off").exists()


def test_a_run_that_ends_inside_the_window_reports_the_steps_it_ran(tmp_path, monkeypatch):
    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    loop(tmp_path, (4, 3), start=0, end=6)
    assert "KINETO_LOG_LEVEL" not in os.environ  # quieted while it recorded, not for the process's later runs
    assert json.loads((tmp_path / "rank0.json").read_text())["steps"] == [5, 6]
    assert traced(tmp_path, "mpp/forward") == 2


def test_a_step_that_raises_inside_the_window_leaves_no_profile_and_its_own_error(tmp_path):
    with pytest.raises(FloatingPointError, match="a failing step"):
        loop(tmp_path, (4, 3), start=0, end=10, fail_at=5)
    assert not tmp_path.joinpath("rank0.json").exists()
    assert not torch.autograd.profiler._is_profiler_enabled  # stopped, not left recording


def test_a_window_or_a_figure_past_the_runs_end_is_said():
    """Periodic figures and a profile window a run never reaches (its steps known only once the data
    are read, with epochs=) are warned about; those it reaches, or a window it ends inside, not."""
    from mpp.train import unreached
    cfg = load_config(None, ["output_dir=x", "train.profile=[10,5]", "train.image_every=20", "fewshot.every=8",
                             "fewshot.train=a", "fewshot.test=b"])
    assert unreached(cfg, 7) == ("fewshot.every=8, train.image_every=20, train.profile=[10, 5] (steps 11..15) past "
                                 "the run's 7 steps: never reached; lower it")
    assert unreached(cfg, 10).startswith("train.image_every=20, train.profile=[10, 5] (steps 11..15) past")
    assert unreached(cfg, 11) == "train.image_every=20 past the run's 11 steps: never reached; lower it"
    assert unreached(cfg, 20) == ""


@pytest.mark.parametrize("window", ["[0,3]", "[2]", "[-1,2]", "[1.5,2]"])
def test_a_bad_window_is_refused_before_any_work(window):
    with pytest.raises(ConfigError, match="train.profile"):
        load_config(None, ["output_dir=x", f"train.profile={window}"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_device_time_is_the_kernels_and_copies_once(tmp_path):
    loop(tmp_path, (2, 4), start=0, end=8, device="cuda")
    figures = json.loads((tmp_path / "rank0.json").read_text())
    table = (tmp_path / "rank0.txt").read_text()
    # torch's table gives the same sum as its total ("Self CUDA time total: ..."), in its own units
    total = next(line for line in table.splitlines() if line.startswith("Self CUDA time total"))
    value, unit = total.split(":")[1].strip()[:-2], total.strip()[-2:]
    scale = {"us": 1e-3, "ms": 1.0}[unit]
    assert figures["device_busy_ms"] * 4 == pytest.approx(float(value) * scale, rel=0.01)
    assert 0 < figures["device_busy_ms"]
