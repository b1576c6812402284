"""The trainer end to end on small synthetic shards: MPP and supervised runs learn, the run
directory is complete and loads into plain timm, kill -9 + resume=auto is bit-exact on the CPU
(with the few-shot hook on, which must not disturb training), two torchrun ranks stay identical,
non-finite steps never reach the weights, fine-tuning loads its init, and bad settings fail before
any work."""
from __future__ import annotations

import hashlib
import re
import json
import math
import os
import signal
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import timm
import torch
import yaml
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import mpp.objectives
import mpp.resume
import mpp.train
from colours import write_colours
from cpuonly import cpu_env, cpu_only
from mpp import outcomes
from mpp.checkpoint import checkpoint_name, list_checkpoints
from mpp.cli import RESUMABLE
from mpp.config import ConfigError, build_config, load_config
from mpp.data import DataError
from mpp.data.synthetic import make_synthetic
from mpp.models import load_encoder
from mpp.nonfinite import NonFiniteError
from mpp.preemption import Terminated
from mpp.runtime import check_ranks_fit
from mpp.train import train
from toolrun import run_tool

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synthetic")
    make_synthetic(out, train=256, test=64, shards=4, progress=False)
    return out


@pytest.fixture(scope="module")
def colours(tmp_path_factory) -> Path:
    """256 noisy images whose class is their dominant colour channel: learnable in a few steps."""
    return write_colours(tmp_path_factory.mktemp("colours"))


def settings(data: Path, out: Path, **extra) -> list[str]:
    """key=value settings of a small run (micro ViT, explicit attention path: bit-exact reruns)."""
    base = dict(output_dir=out, model="vit_micro4_32", batch_size=16, steps=24, seed=3,
                **{"data.train": data / "train/manifest.json", "data.num_workers": 1, "data.shuffle_buffer": 64,
                   "optim.lr": 2e-3, "optim.warmup_steps": 2, "train.log_every": 4, "train.ckpt_every": 8,
                   "train.attn": "math"})
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def config(items: list[str]):
    return load_config(None, items)


def scalars(run: Path, tag: str) -> list[float]:
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    return [e.value for e in events.Scalars(tag)]


def scalar_steps(run: Path, tag: str = "train/loss") -> list[int]:
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    return [e.step for e in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


@pytest.fixture(scope="module")
def mpp_run(data, tmp_path_factory) -> Path:
    """The uninterrupted run that resumed and profiled runs must equal bit for bit: on the CPU."""
    out = tmp_path_factory.mktemp("runs") / "mpp"
    with cpu_only():
        train(config(settings(data, out)))
    return out


def test_mpp_run_learns_and_writes_its_run_dir(mpp_run):
    losses = scalars(mpp_run, "train/loss")
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.3, losses
    for tag in ("train/lr", "train/grad_norm", "train/acc", "train/baseline", "perf/images_per_s",
                "perf/data_wait_frac", "train/nonfinite_steps"):
        assert scalars(mpp_run, tag), tag
    lrs = scalars(mpp_run, "train/lr")  # the rate each logged step used: the last is not the schedule's end (0)
    assert 0 < lrs[-1] < lrs[0] and lrs == sorted(lrs, reverse=True)
    metrics = json.loads((mpp_run / "metrics.json").read_text())
    assert metrics["steps"] == 24 and metrics["nonfinite_steps"] == 0 and metrics["loss"] == pytest.approx(losses[-1])
    assert metrics["images_per_s"] > 0 and 0 <= metrics["data_wait_frac"] < 1
    parts = [metrics[k] for k in ("setup_s", "begin_s", "loop_s", "final_eval_s")]  # where the process's time went
    assert parts[0] > 0 and 0 <= parts[1] < 0.05 and parts[2] > 0 and parts[3] >= 0  # MPP does nothing before step 1
    assert sum(parts) <= metrics["segment_s"] <= metrics["wall_time_s"]
    assert build_config(yaml.safe_load((mpp_run / "config.yaml").read_text())).steps == 24
    # atomic, rotated checkpoints: the last two (keep_ckpts=2), no temporary leftovers
    assert sorted(p.name for p in (mpp_run / "checkpoints").iterdir()) == ["step_0000016", "step_0000024"]


def test_exported_encoder_loads_into_plain_timm(mpp_run):
    spec = json.loads((mpp_run / "model.json").read_text())
    assert (spec["mean"], spec["std"]) == ([0.5] * 3, [0.5] * 3)  # the normalisation it trained on
    vit = timm.create_model(spec["name"], checkpoint_path=str(mpp_run / "encoder.safetensors"), **spec["kwargs"])
    ours = load_encoder(mpp_run, attn="math").eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(vit.eval().forward_features(x), ours(x), rtol=1e-5, atol=1e-5)
    # the exported encoder is the trained one: equal to the task's encoder in the last checkpoint
    task = load_file(str(mpp_run / "checkpoints/step_0000024/model.safetensors"))
    assert_same(weights(mpp_run / "encoder.safetensors"),
                {k.removeprefix("encoder.vit."): v for k, v in task.items() if k.startswith("encoder.vit.")})


def test_a_profiled_run_says_where_its_steps_went_and_trains_the_same(data, mpp_run, tmp_path):
    with cpu_only():
        train(config(settings(data, tmp_path, **{"train.profile": "[9,3]"})))
    figures = json.loads((tmp_path / "profile/rank0.json").read_text())
    assert figures["steps"] == [10, 12] and figures["forward_ms"] > 0 and figures["data_ms"] >= 0
    assert figures["loader_ms"] > 0  # the prefetch thread's reads, recorded from its own thread
    assert (tmp_path / "profile/rank0.trace.json.gz").stat().st_size > 0
    assert_same(weights(tmp_path / "encoder.safetensors"), weights(mpp_run / "encoder.safetensors"))


def test_supervised_run_learns(colours, tmp_path):
    train(config(settings(colours, tmp_path, objective="supervised", steps=16, **{
        "train.grad_accum": 2, "optim.lr": 3e-3})))
    losses, acc = scalars(tmp_path, "train/loss"), scalars(tmp_path, "train/acc")
    assert losses[-1] < losses[0] - 0.3 and acc[-1] > 0.6, (losses, acc)


def run_script(args: list[str], env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """A tool in a subprocess, importing this checkout's mpp (not an installed one)."""
    env = {**(env or os.environ), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=env, **kw)


def test_kill_and_resume_reach_the_uninterrupted_weights(data, mpp_run, tmp_path):
    """Kill -9 after the first checkpoint, resume=auto: bit-identical final weights to `mpp_run`.
    The resumed run also evaluates few-shot every 4 steps, which must not change training."""
    out = tmp_path / "killed"
    cmd = [sys.executable, "tools/pretrain.py", *settings(data, out)]
    log = open(tmp_path / "killed.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=log, env=cpu_env(PYTHONPATH=str(ROOT)))
    deadline = time.time() + 120
    while not (out / "checkpoints/step_0000008").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-2000:]
    assert not (out / "metrics.json").exists()
    fewshot = {"fewshot.every": 4, "fewshot.train": data / "train/manifest.json",
               "fewshot.test": data / "test/manifest.json", "fewshot.shots": "[1,2]", "fewshot.seeds": 1}
    done = run_script(["tools/pretrain.py", *settings(data, out, **fewshot)], env=cpu_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout + done.stderr
    assert_same(weights(out / "encoder.safetensors"), weights(mpp_run / "encoder.safetensors"))
    metrics = json.loads((out / "metrics.json").read_text())  # the time split is the resuming process's own
    assert metrics["setup_s"] + metrics["loop_s"] <= metrics["segment_s"] < metrics["wall_time_s"]
    assert scalars(out, "fewshot/avg/1shot_mean") and scalars(out, "fewshot/token/1shot_mean")  # probe.pool=auto: both


def test_ctrl_c_ends_a_run_in_one_line_and_it_resumes(data, tmp_path):
    """Ctrl-C (the terminal's SIGINT to the run and its data workers) mid-run: exit 130, the last
    line says how to go on, no traceback, the lock released; the same command then resumes. The
    shards come slowly (a second each), so the Ctrl-C lands while the prefetch thread waits on a
    worker that it ends: the run stops at once, where it took a minute (mpp.data.loader.WATCH_S)."""
    out = tmp_path / "interrupted"
    slow = {"data.train": "[" + ", ".join(f"'pipe:sleep 1; cat {shard}'" for shard in
                                          sorted((data / "train").glob("*.tar"))) + "]", "data.num_samples": 256}
    proc = subprocess.Popen([sys.executable, "tools/pretrain.py", *settings(data, out, steps=100000, **slow)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)},  # Ctrl-C as from a terminal, even where
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # pytest ignores it
    deadline = time.time() + 120
    while not (out / "checkpoints/step_0000008").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    sent = time.time()
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert time.time() - sent < 20, f"{time.time() - sent:.1f} s from Ctrl-C to the end"
    assert err.splitlines()[-1] == f"error: {RESUMABLE}" and "Ctrl-C saves none, SIGTERM saves one first" in err
    assert not (out / ".lock").exists()
    step = int(sorted((out / "checkpoints").glob("step_*"))[-1].name.split("_")[1])
    done = run_script(["tools/pretrain.py", *settings(data, out, steps=step, **slow)])  # the newest: finished
    assert done.returncode == 0 and f"(step {step})" in done.stdout, done.stderr[-3000:]


def test_sigterm_saves_a_checkpoint_and_the_same_command_resumes_to_the_same_weights(data, mpp_run, tmp_path):
    """SIGTERM to the run and its data workers (a scheduler's preemption) after its first step:
    the run saves the step it is in as a checkpoint (none is due before step 8), says so in one
    line and exits 143; the same command resumes there and ends bit-identical to `mpp_run`, and
    TensorBoard keeps what the stopped segment logged beside the uninterrupted run's later logs."""
    out = tmp_path / "stopped"
    proc = subprocess.Popen([sys.executable, "tools/pretrain.py", *settings(data, out)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=cpu_env(PYTHONPATH=str(ROOT)))
    deadline = time.time() + 120
    while not (out / "config.yaml").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)  # config.yaml: written after the first step
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "Traceback" not in err, err[-3000:]
    step = int(re.search(r"stopped after step (\d+) of 24", err.splitlines()[-1]).group(1))
    assert step < 24 and [p.name for p in list_checkpoints(out / "checkpoints")][-1] == checkpoint_name(step)
    assert not (out / ".lock").exists() and not (out / "metrics.json").exists()
    before = scalar_steps(out)
    done = run_script(["tools/pretrain.py", *settings(data, out)], env=cpu_env())
    assert done.returncode == 0 and f"(step {step})" in done.stdout, done.stderr[-3000:]
    assert_same(weights(out / "encoder.safetensors"), weights(mpp_run / "encoder.safetensors"))
    # TensorBoard: the stopped segment's logs (its last at the step it stopped after), then the
    # uninterrupted run's past the step resumed from
    assert scalar_steps(out) == before + [s for s in scalar_steps(mpp_run) if s > step]


def test_a_sigterm_during_the_last_checkpoint_stops_before_the_export(data, tmp_path, monkeypatch):
    """A SIGTERM that comes after the last step was judged (here during its checkpoint) still
    stops the run before its export and final work, and leaves SIGTERM's handler as it found it;
    the same command then finishes from that checkpoint."""
    real, before = mpp.train._checkpoint, signal.getsignal(signal.SIGTERM)

    def checkpoint_then_sigterm(run, done):
        real(run, done)
        if done == run.steps:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(mpp.train, "_checkpoint", checkpoint_then_sigterm)
    out = tmp_path / "run"
    with pytest.raises(Terminated, match="stopped after step 4 of 4"):
        train(config(settings(data, out, steps=4)))
    assert signal.getsignal(signal.SIGTERM) == before
    assert not (out / "metrics.json").exists() and not (out / "encoder.safetensors").exists()
    monkeypatch.undo()
    assert train(config(settings(data, out, steps=4)))["steps"] == 4


def test_a_sigterm_between_log_steps_logs_its_step_and_the_resume_keeps_that_log(data, tmp_path, monkeypatch):
    """A SIGTERM acted on in the loop at step 3 (log_every 4) closes the log window there; the
    resumed run (TensorBoard's purge_step) hides only the events past step 3 of the stopped
    attempt, so train/loss holds step 3 and then the uninterrupted run's steps 4 and 8."""
    real, calls = mpp.train._sample_weights, []

    def sigterm_in_step_3(accelerator, micro):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(accelerator, micro)

    monkeypatch.setattr(mpp.train, "_sample_weights", sigterm_in_step_3)
    out = tmp_path / "run"
    with pytest.raises(Terminated, match="stopped after step 3 of 8"):
        train(config(settings(data, out, steps=8)))
    assert scalar_steps(out) == [3]
    monkeypatch.undo()
    train(config(settings(data, out, steps=8)))
    assert scalar_steps(out) == [3, 4, 8]


def test_a_sigterm_at_an_evaluators_step_keeps_its_evaluation(data, tmp_path, monkeypatch):
    """A SIGTERM acted on at a step that is a multiple of fewshot.every stopped the run after the
    step's checkpoint, before its evaluators; the resumed run starts past that step, so its
    few-shot figures were never computed. The stop waits for them. The finished run started again
    added an empty events file each time; it adds none."""
    real, calls = mpp.train._sample_weights, []

    def sigterm_in_step_4(accelerator, micro):
        calls.append(1)
        if len(calls) == 4:  # the scheduler's, during step 4's forward
            os.kill(os.getpid(), signal.SIGTERM)
        return real(accelerator, micro)

    monkeypatch.setattr(mpp.train, "_sample_weights", sigterm_in_step_4)
    out = tmp_path / "run"
    fewshot = {"steps": 8, "fewshot.every": 4, "fewshot.train": data / "train/manifest.json",
               "fewshot.test": data / "test/manifest.json", "fewshot.shots": "[1]", "fewshot.seeds": 1}
    with pytest.raises(Terminated, match="stopped after step 4 of 8"):
        train(config(settings(data, out, **fewshot)))
    monkeypatch.undo()
    train(config(settings(data, out, **fewshot)))
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("fewshot/avg/1shot_mean")] == [4, 8]
    files = sorted((out / "tensorboard").iterdir())
    assert train(config(settings(data, out, **fewshot)))["steps"] == 8
    assert sorted((out / "tensorboard").iterdir()) == files


def test_identical_runs_in_two_processes_are_bit_identical(data, tmp_path):
    """Same machine, same settings (attn=auto, bf16), separate processes: the same encoder bits."""
    for name in ("a", "b"):
        done = run_script(["tools/pretrain.py", *settings(data, tmp_path / name, steps=4, **{"train.attn": "auto"})],
                        env=cpu_env())
        assert done.returncode == 0, done.stderr[-3000:]
    assert_same(weights(tmp_path / "a/encoder.safetensors"), weights(tmp_path / "b/encoder.safetensors"))


def test_train_deterministic_holds_for_the_run_alone_and_keeps_the_cpu_numbers(data, mpp_run, tmp_path, monkeypatch):
    """train.deterministic: every step runs under torch's deterministic mode, which the process
    gets back after the run; on the CPU, deterministic already, the weights stay bit for bit."""
    seen = []
    forward = mpp.objectives.MPPTask.forward

    def recorded(self, *args, **kwargs):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return forward(self, *args, **kwargs)
    monkeypatch.setattr(mpp.objectives.MPPTask, "forward", recorded)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # recorded first, so that teardown also undoes the run's value
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    with cpu_only():
        train(config(settings(data, tmp_path / "on", **{"train.deterministic": "true"})))
    assert seen and all(seen) and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert not torch.are_deterministic_algorithms_enabled()
    assert_same(weights(tmp_path / "on/encoder.safetensors"), weights(mpp_run / "encoder.safetensors"))
    seen.clear()
    with cpu_only():
        train(config(settings(data, tmp_path / "off", steps=2)))
    assert seen and not any(seen)


def test_two_torchrun_ranks_end_with_identical_weights(data, tmp_path):
    """Two gloo ranks: MPP pre-training, then (same processes) a fine-tune from it, its head and its
    representation (finetune.pool=auto) taken from the main process's linear probe, whose
    evaluation counts every test image once across the ranks; both ranks end with the same weights."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent("""
        import sys
        import torch.distributed as dist
        from safetensors.torch import save_model
        import mpp.train
        from mpp.config import load_config
        tasks = []
        build = mpp.train.build_task
        mpp.train.build_task = lambda *a: tasks.append(build(*a)) or tasks[-1]
        cfg = load_config(None, sys.argv[1:])
        mpp.train.train(cfg)
        ft = load_config(None, sys.argv[1:] + ["objective=classify", f"finetune.init={cfg.output_dir}",
                                               "finetune.head_init=probe", "finetune.pool=auto",
                                               f"output_dir={cfg.output_dir}/ft"])
        mpp.train.train(ft)
        for task, out in zip(tasks, (cfg.output_dir, ft.output_dir)):
            save_model(task, f"{out}/rank{dist.get_rank()}.safetensors")
    """))
    cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           *settings(data, tmp_path, steps=6, batch_size=32, **{"train.log_every": 2, "train.ckpt_every": 3,
                                                                "data.val": data / "test/manifest.json"})]
    gloo = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # CPU ranks on any machine
    done = run_script(cmd, env=gloo, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for run in (tmp_path, tmp_path / "ft"):
        assert_same(weights(run / "rank0.safetensors"), weights(run / "rank1.safetensors"))
    ckpt = tmp_path / "checkpoints/step_0000006"
    rng = [torch.load(ckpt / f"rng_{r}.pt", weights_only=True)["torch"] for r in (0, 1)]
    assert not torch.equal(*rng), "ranks must draw different corruptions"
    pre = json.loads((tmp_path / "metrics.json").read_text())
    assert (pre["steps"], pre["processes"]) == (6, 2)  # the count a comparison's resume checks (mpp.compare)
    ft = json.loads((tmp_path / "ft/metrics.json").read_text())
    assert ft["val_samples"] == 64 and ft["head_init"] == "probe" and "head_probe_l2" in ft
    assert ft["pool"] in ("token", "avg")
    _, correct = outcomes.read(ft["outcomes"])  # both ranks' images, gathered
    assert len(correct) == 64 and correct.mean() == pytest.approx(ft["top1"])


def test_train_compile_settings_choose_the_step(data, tmp_path, monkeypatch):
    """train.compile decides whether the step is compiled, train.compile_mode how (mpp.compiled)."""
    modes = []

    def recorded(model, mode):
        modes.append(mode)
        return model  # eager: the compiled step's numerics are tests/test_compiled.py's business
    monkeypatch.setattr(mpp.train, "compile_task", recorded)
    extra = {"steps": 2, "train.compile": "always", "train.compile_mode": "reduce-overhead"}
    train(config(settings(data, tmp_path / "graphs", **extra)))
    train(config(settings(data, tmp_path / "eager", **{**extra, "train.compile": "never"})))
    assert modes == ["reduce-overhead"]


def test_compile_auto_weighs_the_whole_runs_steps_also_when_resumed(data, tmp_path, monkeypatch):
    """`auto` compiles only runs long enough to win the compile back (mpp.compiled): the trainer
    asks with the run's whole step count, not the steps left (2 here), so a run resumed with its
    own steps decides as it did when it started."""
    asked, use_compile = [], mpp.train.use_compile

    def recorded(setting, device, steps):
        asked.append((setting, steps))
        return use_compile(setting, device, steps)
    monkeypatch.setattr(mpp.train, "use_compile", recorded)
    out = tmp_path / "run"
    train(config(settings(data, out, steps=4, **{"train.ckpt_every": 2})))
    (out / "metrics.json").unlink()  # as a run stopped at its checkpoint of step 4
    train(config(settings(data, out, steps=6, **{"train.ckpt_every": 2, "train.resume": "auto"})))
    assert asked == [("auto", 4), ("auto", 6)]


def nan_after(calls: int):
    """build_task patched so that every forward from call `calls` on returns a NaN loss."""
    build = mpp.train.build_task

    def patched(*args):
        task = build(*args)
        forward, count = task.forward, [0]

        def nan_forward(*a, **kw):
            loss, metrics = forward(*a, **kw)
            count[0] += 1
            return (loss * float("nan") if count[0] > calls else loss), metrics
        task.forward = nan_forward
        return task
    return patched


def test_nonfinite_steps_are_skipped_then_stop_training(data, tmp_path, monkeypatch):
    monkeypatch.setattr(mpp.train, "build_task", nan_after(8))
    cfg = config(settings(data, tmp_path, steps=20, **{"train.log_every": 2, "train.max_bad_steps": 3}))
    with pytest.raises(NonFiniteError, match=r"3 steps since the last finite one had a non-finite .*step_0000008"):
        train(cfg)
    # steps 9.. were skipped: the run stopped at its next log step (10 would be 2 bad, 12 is 4), no
    # checkpoint after the last good one, and the weights at the stop are finite
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_0000008"]
    assert not (tmp_path / "encoder.safetensors").exists()
    assert scalars(tmp_path, "train/nonfinite_steps") == [0, 0, 0, 0, 2]
    # resumed past a damaged newer checkpoint (skipped, and kept on disk): the stop names the newest
    # checkpoint this run could go back to, not that one
    (tmp_path / "checkpoints/step_0000012").mkdir()  # at the step the run stops at
    (tmp_path / "checkpoints/step_0000012/state.pt").write_bytes(b"damaged")
    monkeypatch.setattr(mpp.train, "build_task", nan_after(0))
    with pytest.raises(NonFiniteError, match=r"last good checkpoint: \S*step_0000008\."):
        train(cfg)


def test_a_few_nonfinite_steps_leave_the_weights_alone(data, tmp_path, monkeypatch):
    # calls 1-2 fine, then NaN forever: with max_bad_steps large the loop runs to the end, every step
    # after the second skipped, so the weights equal a 2-step run's (no update, no optimiser state
    # change). The run's last steps failed, so it must not end well nor export an encoder.
    with cpu_only():  # the two runs' weights are compared bit for bit
        monkeypatch.setattr(mpp.train, "build_task", nan_after(2))
        items = dict(steps=6, **{"train.log_every": 3, "train.max_bad_steps": 100, "optim.schedule": "constant",
                                 "optim.warmup_steps": 0, "data.num_workers": 0})
        with pytest.raises(NonFiniteError, match="4 steps since the last finite one had a non-finite"):
            train(config(settings(data, tmp_path / "nan", **items)))
        assert not (tmp_path / "nan/encoder.safetensors").exists() and not (tmp_path / "nan/metrics.json").exists()
        monkeypatch.undo()
        with pytest.raises(NonFiniteError, match="^4 steps since the last finite one"):  # resuming the finished run fails the same way
            train(config(settings(data, tmp_path / "nan", **items)))
        train(config(settings(data, tmp_path / "short", **{**items, "steps": 2})))
        task = load_file(str(tmp_path / "nan/checkpoints/step_0000006/model.safetensors"))
        assert_same({k.removeprefix("encoder.vit."): v for k, v in task.items() if k.startswith("encoder.vit.")},
                    weights(tmp_path / "short/encoder.safetensors"))


def test_an_fp16_overflow_is_the_scalers_skip_not_a_failed_step():
    """Under fp16 loss scaling a non-finite gradient norm with finite losses is the scaler's
    overflow (it skips the step and lowers its scale); a non-finite loss is a failed step; without
    a scaler (bf16, fp32) every non-finite norm is one."""
    from types import SimpleNamespace
    from mpp.nonfinite import BadSteps, scaler_overflow
    fp16, bf16 = SimpleNamespace(scaler=object(), num_processes=1), SimpleNamespace(scaler=None, num_processes=1)
    inf, one, nan = torch.tensor(float("inf")), torch.tensor(1.0), torch.tensor(float("nan"))
    assert scaler_overflow(fp16, torch.isfinite(inf), [one, one])
    assert not scaler_overflow(fp16, torch.isfinite(inf), [one, nan])  # one micro-batch's loss is NaN
    assert not scaler_overflow(fp16, torch.isfinite(one), [one])
    assert not scaler_overflow(bf16, torch.isfinite(inf), [one])
    bad = BadSteps(torch.zeros(()), 0, limit=20)
    for norm, loss in ((inf, one), (inf, one), (one, one), (inf, nan), (inf, nan), (inf, one)):
        bad.add(torch.isfinite(norm), scaler_overflow(fp16, torch.isfinite(norm), [loss]))
    # the last overflow leaves the two failed steps' run open: no step since them updated the weights
    assert (bad.run.item(), bad.max.item(), bad.total.item(), bad.overflows.item()) == (2, 2, 2, 3)
    # a gradient that stays non-finite is no overflow: from the limit-th in a row on, each is a failed step
    bad = BadSteps(torch.zeros(()), 0, limit=3)
    for _ in range(6):
        bad.add(torch.isfinite(inf), scaler_overflow(fp16, torch.isfinite(inf), [one]))
    assert (bad.overflows.item(), bad.total.item(), bad.run.item()) == (2, 4, 4)
    # failed steps and overflows in turn, no step finite: each kept the other's run open, so neither
    # limit was reached, every step was skipped and the untrained weights were exported
    bad = BadSteps(torch.zeros(()), 0, limit=3)
    for loss in (nan, one) * 3:
        bad.add(torch.isfinite(inf), scaler_overflow(fp16, torch.isfinite(inf), [loss]))
    assert (bad.overflows.item(), bad.total.item(), bad.max.item()) == (2, 4, 4)
    # train.max_bad_steps counts failed steps in a row: a finite step ends the run
    bad = BadSteps(torch.zeros(()), 0, limit=3)
    for norm in (inf, one, inf, one, inf):
        bad.add(torch.isfinite(norm))
    assert (bad.run.item(), bad.max.item(), bad.total.item()) == (1, 1, 3)


def test_isolated_fp16_overflows_never_add_up_and_another_ranks_nan_loss_is_no_overflow():
    """A finite step ends the run of overflows: an fp16 run overflows now and then all along, and
    those must never add up to train.max_bad_steps. On several processes the ranks' loss verdicts
    are summed, so a NaN loss on another rank makes this rank's non-finite norm a failed step too."""
    from mpp.nonfinite import BadSteps, scaler_overflow
    fp16 = SimpleNamespace(scaler=object(), num_processes=1)
    inf, one = torch.tensor(float("inf")), torch.tensor(1.0)
    bad = BadSteps(torch.zeros(()), 0, limit=3)
    for norm in (inf, one) * 10:
        bad.add(torch.isfinite(norm), scaler_overflow(fp16, torch.isfinite(norm), [one]))
    assert (bad.overflows.item(), bad.total.item(), bad.max.item()) == (10, 0, 0)
    other_nan = SimpleNamespace(scaler=object(), num_processes=2, reduce=lambda t, op: t + 1)  # one rank's NaN
    all_finite = SimpleNamespace(scaler=object(), num_processes=2, reduce=lambda t, op: t)
    assert not scaler_overflow(other_nan, torch.isfinite(inf), [one])
    assert scaler_overflow(all_finite, torch.isfinite(inf), [one])


def test_max_bad_steps_failed_steps_in_a_row_stop_the_run_naming_the_newest_good_checkpoint(tmp_path):
    """Exactly train.max_bad_steps failed steps in a row stop the run at its next check, even when a
    finite step came between them and the check (the streak is kept, not only the open run); the
    message names the newest checkpoint before the stop as the one to go back to."""
    from mpp.nonfinite import BadSteps, check_finite
    for name in ("step_0000002", "step_0000004", "step_0000010"):  # the last: after the stop, a damaged one
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    inf, one = torch.tensor(float("inf")), torch.tensor(1.0)
    run = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(max_bad_steps=3)), out=tmp_path,
                          bad=BadSteps(torch.zeros(()), 0, limit=3))
    for norm in (inf, inf, one):
        run.bad.add(torch.isfinite(norm))
    check_finite(run, 5)  # two in a row: goes on
    for norm in (inf, inf, inf, one):
        run.bad.add(torch.isfinite(norm))
    with pytest.raises(NonFiniteError, match=r"near step 9: 3 steps .* last good checkpoint: \S*step_0000004\."):
        check_finite(run, 9)


def test_a_log_windows_figures_weigh_each_sample_once_with_a_smaller_tail_step():
    """The logged loss and metrics are means over the window's samples on all ranks: an epoch's
    tail step of 4 images weighs 4 samples, where it used to weigh as much as a step of 16."""
    from types import SimpleNamespace
    from mpp.train import _Window
    win = _Window(torch.zeros(()))
    for images, loss in ((16, 1.0), (4, 2.0)):  # a full step, then the epoch's tail step
        win.add_micro(torch.tensor(loss), {"acc": torch.tensor(loss / 4)}, images)
        win.add_step(torch.tensor(3.0), torch.tensor(True))
    figures = win.read(SimpleNamespace(gather=lambda t: torch.cat([t, t])))  # two ranks alike
    assert figures["loss"] == pytest.approx(1.2) and figures["acc"] == pytest.approx(0.3)
    assert (figures["grad_norm"], figures["images"]) == (3.0, 40)


def test_a_log_windows_grad_norm_is_the_mean_over_its_finite_steps_only():
    """A skipped non-finite step adds nothing to the logged gradient norm: a window of an infinite
    norm (skipped) and a finite one of 3.0 logs 3.0, not inf."""
    from mpp.train import _Window
    win = _Window(torch.zeros(()))
    for norm in (float("inf"), 3.0):
        win.add_micro(torch.tensor(1.0), {}, 4)
        win.add_step(torch.tensor(norm), torch.isfinite(torch.tensor(norm)))
    figures = win.read(SimpleNamespace(gather=lambda t: t))
    assert figures["grad_norm"] == 3.0


def test_a_checkpoints_totals_add_this_segment_to_the_earlier_segments():
    """The totals a checkpoint saves (and metrics.json's wall_time_s, images_per_s and
    data_wait_frac read) are the earlier, checkpointed segments' plus this one's: a run resumed
    twice reports its whole wall time, not the last two segments'."""
    from mpp.nonfinite import BadSteps
    from mpp.train import _totals
    earlier = {"step": 8, "nonfinite_steps": 1, "scaler_skips": 2, "elapsed": 100.0, "train_time": 80.0,
               "data_wait": 5.0, "images": 128}
    run = SimpleNamespace(state=earlier, bad=BadSteps(torch.zeros(()), 0, limit=3), t_begin=time.time() - 2.0,
                          t_loop=time.perf_counter() - 1.0, wait_all=0.25, wait_win=0.25, last={}, images=64,
                          cfg=SimpleNamespace(batch_size=16))
    run.bad.add(torch.tensor(False))
    totals = _totals(run)
    assert 102.0 <= totals["elapsed"] < 110.0 and 81.0 <= totals["train_time"] < 89.0
    assert (totals["data_wait"], totals["images"], totals["nonfinite_steps"], totals["scaler_skips"]) == (5.5, 192, 2, 2)


def test_a_run_whose_last_step_overflowed_ends_well_and_counts_it(data, tmp_path, monkeypatch):
    """An fp16 run whose last step was the scaler's overflow (weights untouched, finite) exports its
    encoder and counts the step in scaler_skips, not in nonfinite_steps: about 1 fp16 run in 2,000
    used to exit 1 here. The overflow is simulated: the last step's gradient is made non-finite and
    reported as the scaler's, as `mpp.nonfinite.scaler_overflow` does on a GPU under fp16."""
    monkeypatch.setattr(mpp.train, "build_task", nan_after(3))
    monkeypatch.setattr(mpp.train, "scaler_overflow", lambda accelerator, finite, losses: ~finite)
    metrics = train(config(settings(data, tmp_path, steps=4, **{"train.log_every": 2})))
    assert (metrics["scaler_skips"], metrics["nonfinite_steps"]) == (1, 0)
    assert (tmp_path / "encoder.safetensors").is_file()
    assert scalars(tmp_path, "train/scaler_skips") == [0, 1]


@pytest.mark.parametrize("overflows, stops", [(False, r"near step 4: 3 steps .*step_0000002"),
                                               (True, r"near step 6: .*step_0000004")])
def test_a_resume_keeps_the_run_of_failed_steps_the_checkpoint_left_open(data, tmp_path, monkeypatch, overflows,
                                                                         stops):
    """Every gradient non-finite, train.max_bad_steps=3; the run is stopped by a SIGTERM during its
    checkpoint of step 2, two failed steps into the run, and the resumed run stops where the whole
    run does, not later as one that counted afresh would. Plain failed steps: at the check of step
    4 (steps 1-3 failed in a row), not 6. fp16 overflows (reported as the scaler's): from the
    max_bad_steps-th in a row on an overflow is a failed step, so near step 6, not 8; a checkpoint
    once did not keep how many overflows were in a row."""
    monkeypatch.setattr(mpp.train, "build_task", nan_after(0))
    if overflows:
        monkeypatch.setattr(mpp.train, "scaler_overflow", lambda accelerator, finite, losses: ~finite)
    items = dict(steps=8, **{"train.log_every": 2, "train.ckpt_every": 2, "train.max_bad_steps": 3})
    with pytest.raises(NonFiniteError, match=stops):
        train(config(settings(data, tmp_path / "whole", **items)))
    real = mpp.train._checkpoint

    def checkpoint_then_sigterm(run, done):
        real(run, done)
        if done == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    with monkeypatch.context() as m:
        m.setattr(mpp.train, "_checkpoint", checkpoint_then_sigterm)
        with pytest.raises(Terminated, match="before the next batch: stopped after step 2 of 8"):
            train(config(settings(data, tmp_path / "resumed", **items)))
    with pytest.raises(NonFiniteError, match=stops):
        train(config(settings(data, tmp_path / "resumed", **items)))


def test_finetune_loads_the_pretrained_encoder(data, mpp_run, tmp_path):
    done = run_tool("finetune", *settings(data, tmp_path, steps=1, **{
        "finetune.init": mpp_run, "finetune.label_fraction": 0.5, "data.val": data / "test/manifest.json",
        "optim.name": "sgd", "optim.weight_decay": 0, "optim.warmup_steps": 0}))
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["objective"] == "classify" and metrics["init"] == str(mpp_run)
    assert 100 < metrics["train_samples"] < 160 and metrics["val_samples"] == 64  # half of 256
    assert 0 <= metrics["top1"] <= metrics["top5"] <= 1
    said = done.stdout.strip().splitlines()[-1]  # the run's one line of results (the rest: metrics.json)
    assert said.startswith(f"classify {tmp_path}: steps 1 (") and said.endswith(f"figures: {tmp_path}/metrics.json")
    top1, top5 = 100 * metrics["top1"], 100 * metrics["top5"]
    assert f"top-1 {top1:.1f}% (top-5 {top5:.1f}%) on 64 images of the data.val" in said
    # the head starts at zero, so the first step leaves the encoder exactly as pre-trained
    assert_same(weights(tmp_path / "encoder.safetensors"), weights(mpp_run / "encoder.safetensors"))


def test_finetune_from_scratch_beats_chance_on_held_out_data(colours, tmp_path):
    metrics = train(config(settings(colours, tmp_path, objective="classify", steps=16, **{
        "data.val": colours / "val/manifest.json", "optim.name": "sgd", "optim.lr": 0.05,
        "optim.weight_decay": 0, "data.eval_crop_pct": 1.0})))
    assert metrics["val_samples"] == 96 and metrics["top1"] > 0.6, metrics  # chance: 1/3


def test_bad_settings_fail_before_any_work(data, tmp_path):
    done = run_script(["tools/pretrain.py", f"output_dir={tmp_path / 'x'}", "optim.lrr=0.1"])
    assert done.returncode == 2
    assert "unknown config key 'optim.lrr'; did you mean 'optim.lr'?" in done.stderr
    with pytest.raises(ConfigError, match="'resume'; did you mean 'train.resume'"):  # right name, no section
        config(settings(data, tmp_path / "x", resume="auto"))
    with pytest.raises(ConfigError, match="'zzz'; valid keys: output_dir, objective"):  # no near miss: the list
        config(settings(data, tmp_path / "x", zzz=1))
    assert not (tmp_path / "x").exists()
    with pytest.raises(ConfigError, match="not divisible"):
        train(config(settings(data, tmp_path / "y", batch_size=10, **{"train.grad_accum": 4})))
    with pytest.raises(ConfigError, match="steps=N"):
        train(config(settings(data, tmp_path / "z", steps=0)))
    assert not (tmp_path / "y").exists() and not (tmp_path / "z").exists()



def test_more_ranks_than_gpus_fail_before_any_work(data, tmp_path, monkeypatch):
    """Two torchrun ranks on a one-GPU node: NCCL would fail at the first collective ("invalid
    usage", after everything was built); the trainer says it, with the fix, before any work."""
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"2 ranks but sees 1 cuda device.*--nproc_per_node 1.*CUDA_VISIBLE_DEVICES="):
        train(config(settings(data, tmp_path / "x")))
    assert not (tmp_path / "x").exists()
    for ranks, devices in ((1, 1), (2, 2), (1, 8)):  # a rank a device, or fewer ranks, pass
        check_ranks_fit(ranks, devices, "cuda")

def test_a_checkpoint_of_another_model_is_named_and_its_run_kept(data, mpp_run, tmp_path):
    """resume=auto in a run of another model, and train.resume=PATH of one into a new output_dir: one
    error naming that checkpoint and its run's config (not the new output_dir, never 'delete them');
    nothing changes in the old run, nothing is made for the new one."""
    ckpt = sorted((mpp_run / "checkpoints").glob("step_*"))[-1]
    before = {p: p.stat().st_mtime_ns for p in mpp_run.rglob("*") if p.is_file()}
    for out, extra in ((mpp_run, {}), (tmp_path / "new", {"train.resume": ckpt})):
        with pytest.raises(ConfigError) as e:
            train(config(settings(data, out, model="vit_mini8_32", **extra)))
        assert str(e.value).startswith(f"checkpoint '{ckpt}' is of another model or objective than this run")
        assert f"({mpp_run / 'config.yaml'})" in str(e.value) and "delete" not in str(e.value)
    assert {p: p.stat().st_mtime_ns for p in mpp_run.rglob("*") if p.is_file()} == before
    assert not (tmp_path / "new").exists()


def test_a_finished_run_resumes_to_nothing_and_keeps_its_figures(mpp_run, tmp_path):
    run = shutil.copytree(mpp_run, tmp_path / "run")  # not the shared run the other tests read
    before = json.loads((run / "metrics.json").read_text())
    encoder = weights(run / "encoder.safetensors")
    with cpu_only():
        after = train(load_config(run / "config.yaml", [f"output_dir={run}"]))
    assert after["loss"] == before["loss"] and after["steps"] == 24
    assert_same(weights(run / "encoder.safetensors"), encoder)


class _Payload:
    """Unpickled, it runs a shell command that writes a file: the proof a checkpoint file ran code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoints_rng_file_is_never_unpickled(mpp_run, tmp_path, capsys):
    """Every file of a checkpoint is read without unpickling: a run folder from elsewhere whose newest
    checkpoint's rng_0.pt is a pickle that would run a command is skipped and named (its code never
    runs), and the run resumes from the checkpoint before it. Without digests.json (read unchecked,
    as a checkpoint written before them), so no digest refuses the file first."""
    run = shutil.copytree(mpp_run, tmp_path / "run")
    (run / "metrics.json").unlink()  # as stopped at its last step
    marker = tmp_path / "owned"
    torch.save({"state": _Payload(marker)}, run / "checkpoints/step_0000024/rng_0.pt")
    (run / "checkpoints/step_0000024/digests.json").unlink()
    with cpu_only():
        train(load_config(run / "config.yaml", [f"output_dir={run}"]))
    assert not marker.exists()
    assert "step_0000024" in capsys.readouterr().err


def test_a_run_that_fails_before_its_first_step_leaves_nothing(data, mpp_run, tmp_path):
    """A run stopped before its first step (every image corrupt: the first batch fails) writes no
    config.yaml or TensorBoard events: a fresh one leaves no directory (nor a checkpoint of step 0,
    also when train.ckpt_every=0 makes no periodic checkpoint due there), and a resume keeps the
    config.yaml of the steps its checkpoints trained, which the next resume compares against (it
    was overwritten, and that resume warned of 'changes' from settings that never trained)."""
    from shardutil import write_shards
    bad, _ = write_shards(tmp_path / "bad", [8, 8], extra=lambda s, j: {"png": b"not an image"})
    for every in (8, 0):
        with pytest.raises(DataError, match="decoded no samples"):
            train(config(settings(data, tmp_path / "fresh", **{"data.train": bad, "train.ckpt_every": every})))
        assert not (tmp_path / "fresh").exists(), every
    run = shutil.copytree(mpp_run, tmp_path / "run")  # finished at step 24
    (run / "metrics.json").unlink()  # as stopped there: a finished run is refused more steps
    before = {p: p.read_bytes() for p in [run / "config.yaml", *(run / "tensorboard").iterdir()]}
    with pytest.raises(DataError, match="decoded no samples"):
        train(config(settings(data, run, steps=32, **{"data.train": bad, "optim.lr": 1e-3})))
    assert {p: p.read_bytes() for p in [run / "config.yaml", *(run / "tensorboard").iterdir()]} == before


@pytest.fixture
def waits(monkeypatch) -> list:
    """The loop's waits for a micro-batch, one entry as each begins (`Sigterm.waiting`)."""
    begun = []

    class Watched(mpp.train.Sigterm):
        def waiting(self, interruptible):
            begun.append(interruptible)
            return super().waiting(interruptible)
    monkeypatch.setattr(mpp.train, "Sigterm", Watched)
    return begun


def stalling(real, at: int, waits: list, then):
    """`mpp.train._batches` whose micro-batch `at` stalls: the reader (whose look-ahead reaches it
    steps early) waits until the loop waits for it, then calls `then` there."""
    def batches(loader, start):
        for i, batch in enumerate(real(loader, start), start):
            if i == at:
                while len(waits) <= at:
                    time.sleep(0.01)
                time.sleep(0.3)  # the loop blocked in its wait
                then()
            yield batch
    return batches


def stopped_run_items(tmp_path, accum, **extra):
    """A run of 8 micro-batches of 8 over shards with a corrupt sample in every five, checkpointed
    every 4 steps (3 under grad_accum=2): micro-batch 5 falls between two checkpoints."""
    from shardutil import write_shards
    shards, _ = write_shards(tmp_path / "d", [40, 40], extra=lambda s, j: {"png": b"bad"} if j % 5 == 0 else {})
    def items(out, resume="auto"):
        return config(settings(tmp_path, out, steps=8 // accum, batch_size=8, **{
            "data.train": shards, "data.shuffle_buffer": 0, "train.grad_accum": accum, "train.ckpt_every": 4 if accum == 1 else 3,
            "train.log_every": 2 // accum, "optim.warmup_steps": 1, "train.resume": resume, **extra}))
    return items


@pytest.mark.parametrize("accum, resume", [(1, "auto"), (2, "none")])
def test_a_run_stopped_by_its_data_saves_the_step_it_reached_and_resumes_there(tmp_path, monkeypatch, waits, accum,
                                                                                 resume):
    """A data error mid-run (a stalled read, a shard changed since it was listed) lost the steps
    since the last checkpoint: one process saves the step it reached first, between two periodic
    checkpoints and mid-step under grad_accum, logging the steps since the last log (their figures
    were lost), and the same command resumes there to the weights,
    images and skip counts of a run never stopped (the micro-batch read before the error, whose
    corrupt samples were counted, is read again); the wait for the batch that never came (a stall's
    data.timeout) is data wait in its checkpoint (read in this process, no worker start-up to wait
    for). A run started with train.resume=none (which would refuse the folder the second time) is
    told to resume with train.resume=auto."""
    items = stopped_run_items(tmp_path, accum, **{"data.num_workers": 0, "data.timeout": 0})
    with cpu_only():
        whole = train(items(tmp_path / "whole"))
        real = mpp.train._batches
        def fail():
            time.sleep(1.5)
            raise DataError("shard 000001.tar changed since it was listed")
        monkeypatch.setattr(mpp.train, "_batches", stalling(real, 5, waits, fail))  # step 5, or step 2's second half
        waits.clear()
        step, how = 5 // accum, "the same command" if resume == "auto" else "the same command with train.resume=auto"
        with pytest.raises(DataError, match=rf"changed since it was listed \(the run saved its checkpoint of step "
                                            rf"{step} first: once the data are mended, {how} resumes there"):
            train(items(tmp_path / "run", resume))
        saved = list_checkpoints(tmp_path / "run/checkpoints")[-1]
        assert saved.name == checkpoint_name(step)
        assert torch.load(saved / "state.pt", weights_only=True)["data_wait"] >= 1.5
        # the steps since the last log were logged at the step saved (under accum 1: step 5 of log_every 2)
        logged = scalar_steps(tmp_path / "run")
        assert logged == [s for s in scalar_steps(tmp_path / "whole") if s < step] + [step]
        monkeypatch.setattr(mpp.train, "_batches", real)
        again = train(items(tmp_path / "run"))
        assert scalar_steps(tmp_path / "run") == logged + [s for s in scalar_steps(tmp_path / "whole") if s > step]
    assert again["skipped_samples"] == whole["skipped_samples"] and whole["skipped_samples"]
    assert again["epochs"] == whole["epochs"]
    assert_same(weights(tmp_path / "run/encoder.safetensors"), weights(tmp_path / "whole/encoder.safetensors"))


@pytest.mark.parametrize("accum, resume", [(1, "none"), (2, "auto")])
def test_a_sigterm_while_the_run_waits_for_data_saves_the_step_it_reached_at_once(tmp_path, monkeypatch, waits, accum,
                                                                                   resume):
    """A SIGTERM while the run waits for a stalled read was only noted: the run waited out the
    stall (up to data.timeout) and the scheduler's SIGKILL lost every step since the last
    checkpoint. It now stops the wait, saves the step reached (between two periodic checkpoints,
    mid-step under grad_accum) and exits in one line (telling a run started with
    train.resume=none to resume with train.resume=auto), long before the stall would end; the
    same command resumes there to the weights and skip counts of a run never stopped. One before
    the first step saves nothing."""
    items, stall = stopped_run_items(tmp_path, accum), threading.Event()
    with cpu_only():
        whole = train(items(tmp_path / "whole"))
        real = mpp.train._batches
        def sigterm_then_stall():
            os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's
            stall.wait(60)
        how = "the same command" if resume == "auto" else "the same command with train.resume=auto"
        for at, said in ((0, "stopped before the first step, nothing lost"),
                         (5, f"stopped after step {5 // accum} of {8 // accum} and saved its checkpoint "
                             f"\\(step_000000{5 // accum}\\); run {how} to resume")):
            monkeypatch.setattr(mpp.train, "_batches", stalling(real, at, waits, sigterm_then_stall))
            waits.clear()
            t0 = time.perf_counter()
            with pytest.raises(Terminated, match=f"SIGTERM while it waited for data: {said}"), \
                    pytest.warns(UserWarning, match="did not stop within 5 s"):  # the reader, in the stalled read
                train(items(tmp_path / "run", resume))
            assert time.perf_counter() - t0 < 30, "the run waited for the stalled read"
            stall.set()  # the stalled reader thread ends
            stall.clear()
            if at == 0:
                assert not (tmp_path / "run").exists()
        assert list_checkpoints(tmp_path / "run/checkpoints")[-1].name == checkpoint_name(5 // accum)
        monkeypatch.setattr(mpp.train, "_batches", real)
        again = train(items(tmp_path / "run"))
    assert again["skipped_samples"] == whole["skipped_samples"] and again["epochs"] == whole["epochs"]
    assert_same(weights(tmp_path / "run/encoder.safetensors"), weights(tmp_path / "whole/encoder.safetensors"))


def test_a_sigterm_after_a_steps_check_does_not_wait_out_the_next_stalled_read(tmp_path, monkeypatch, waits):
    """A SIGTERM that came after a step's check (in its log, checkpoint or evaluators) was only
    noted, and the next wait for a stalled read ran to data.timeout. The wait now stops at once and
    the run saves the step it reached."""
    items, stall = stopped_run_items(tmp_path, 1), threading.Event()
    real_log = mpp.train._log

    def log(run, done):
        real_log(run, done)
        if done == 2:  # no checkpoint due (ckpt_every 4)
            os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(mpp.train, "_log", log)
    monkeypatch.setattr(mpp.train, "_batches", stalling(mpp.train._batches, 2, waits, lambda: stall.wait(60)))
    t0 = time.perf_counter()
    with cpu_only(), pytest.raises(Terminated, match=r"SIGTERM before the next batch: stopped after step 2 of 8 and "
                                                     r"saved its checkpoint"), \
            pytest.warns(UserWarning, match="did not stop within 5 s"):  # the reader, in the stalled read
        train(items(tmp_path / "run"))
    stall.set()
    assert time.perf_counter() - t0 < 30, "the run waited for the stalled read"
    assert list_checkpoints(tmp_path / "run/checkpoints")[-1].name == checkpoint_name(2)


def test_a_fine_tune_resumes_only_from_the_encoder_it_started_from(data, mpp_run, tmp_path):
    """A fine-tune records the sha256 of its encoder file at its fresh start and keeps it across
    resumes: an interrupted fine-tune whose encoder has since been trained again is refused (its
    checkpoints continue a fine-tune of the old one; metrics.json would have named the new). So is
    one resumed on another label subset or development split, and a pre-training resumed with
    other withheld splits: both only warned, and then scored on, or withheld, images trained on;
    and one resumed with other normalisation statistics (only warned; model.json took the new)."""
    encoder = shutil.copytree(mpp_run, tmp_path / "encoder")
    digest = hashlib.sha256((encoder / "encoder.safetensors").read_bytes()).hexdigest()
    items = settings(data, tmp_path / "ft", steps=8, objective="classify", **{
        "finetune.init": encoder, "data.val": data / "test/manifest.json", "train.ckpt_every": 4})
    first = train(config(items))
    assert first["init_sha256"] == digest
    (tmp_path / "ft/metrics.json").unlink()  # as stopped at step 8: a finished run is refused more steps
    again = train(config(items + ["steps=12"]))  # the same encoder: resumes at step 8
    assert again["init_sha256"] == digest and again["steps"] == 12 and again["label_split"] == [1.0, 0, 0.0]
    # finished, started again naming the same encoder by its file: no other setting, exported again
    assert train(config(items + ["steps=12", f"finetune.init={encoder / 'encoder.safetensors'}"]))["steps"] == 12
    with pytest.raises(ConfigError, match=r"other inputs \(label_split: \[1.0, 0, 0.0\] then, \[0.5, 3, 0.2\] now"):
        train(config(items + ["steps=16", "finetune.label_fraction=0.5", "finetune.split_seed=3",
                              "finetune.dev_fraction=0.2"]))  # it would score on images it trained on
    with pytest.raises(ConfigError, match=r"other inputs \(withheld_splits: \[\] then, \[\[0.5, 0, 0.2\]\] now"):
        train(config(settings(data, encoder, steps=28, **{"data.withhold": "[[0.5,0,0.2]]"})))  # it trained on them
    with pytest.raises(ConfigError, match=r"other inputs \(normalisation: \[\[0.5, 0.5, 0.5\], \[0.5, 0.5, 0.5\]\] then"):
        train(config(settings(data, encoder, steps=28, **{"data.std": "[0.25,0.25,0.25]"})))  # model.json took it
    (encoder / "metrics.json").unlink()
    train(config(settings(data, encoder, steps=28)))  # the encoder trained further, in place
    with pytest.raises(ConfigError, match=f"started from other inputs \\(init_sha256: '{digest}' then"):
        train(config(items + ["steps=16"]))


def test_resumed_run_counts_skipped_samples_once(tmp_path, capsys):
    """Skip counters survive a crash: a run resumed from its first checkpoint reports the same
    skipped-sample counts as the uninterrupted run (the replayed batches are not counted twice)."""
    from shardutil import write_shards
    bad = lambda s, j: {"png": b"not an image"} if j % 5 == 2 else {}  # noqa: E731
    manifest, _ = write_shards(tmp_path / "data", [40, 40, 40, 40], extra=bad)
    out = tmp_path / "run"
    items = settings(tmp_path, out, **{"data.train": manifest, "batch_size": 8, "steps": 20,
                                       "train.ckpt_every": 6, "train.keep_ckpts": 5})
    whole = train(config(items))["skipped_samples"]
    assert whole["corrupt_image"] >= 20 * 8 // 5  # 20 steps of 8 read >= 160 of the 1-in-5 bad samples
    said = capsys.readouterr().out
    assert f"; {whole['corrupt_image']:,} samples unreadable or lost (by kind: skipped_samples);" in said
    for ckpt in sorted((out / "checkpoints").iterdir())[1:]:  # "crash" after the first checkpoint
        shutil.rmtree(ckpt)
    (out / "metrics.json").unlink()
    resumed = train(config(items))
    assert resumed["skipped_samples"] == whole


def test_optimizer_groups_and_schedule():
    """No weight decay on norms, biases, position embeddings and tokens, with layer-wise lr decay or
    without (the default); each optimiser's settings reach it; the warmup and cosine schedule."""
    from mpp.models import create_encoder
    from mpp.objectives import build_task
    from mpp.optim import create_optimizer, create_scheduler
    for layer_decay in (0.0, 0.5):
        cfg = build_config({"model": "vit_micro4_32", "optim": {"layer_decay": layer_decay, "warmup_steps": 2,
                                                                "min_lr": 1e-5, "beta2": 0.95}})
        task = build_task(cfg, create_encoder(cfg.model, attn="math"), None)
        opt = create_optimizer(cfg, task)
        names = {id(p): n for n, p in task.named_parameters()}
        group = {names[id(p)]: g for g in opt.param_groups for p in g["params"]}
        assert len(group) == len(names)
        for n in ("encoder.mask_token", "encoder.vit.pos_embed", "encoder.vit.cls_token", "encoder.vit.norm.weight",
                  "encoder.vit.blocks.0.norm1.bias", "encoder.vit.blocks.0.attn.qkv.bias", "head.bias"):
            assert group[n]["weight_decay"] == 0, (layer_decay, n)
        assert group["encoder.vit.blocks.1.mlp.fc1.weight"]["weight_decay"] == 0.1
        assert group["head.weight"]["betas"] == (0.9, 0.95)
    # layer-wise lr decay through the wrappers: embeddings + [mask] 0.5^3, blocks 0.5^2, 0.5^1, head 1
    scale = {n: group[n]["lr_scale"] for n in group}
    assert scale["encoder.mask_token"] == scale["encoder.vit.patch_embed.proj.weight"] == 0.125
    assert scale["encoder.vit.blocks.0.attn.qkv.weight"] == 0.25 and scale["encoder.vit.blocks.1.mlp.fc2.weight"] == 0.5
    assert scale["head.weight"] == 1.0
    sched = create_scheduler(cfg, opt, total_steps=12)
    lrs = []
    for step in range(13):
        sched.step_update(step)
        lrs.append(group["head.weight"]["lr"])
    assert lrs[0] == 0 and lrs[1] == pytest.approx(1e-4) and lrs[2] == pytest.approx(2e-4)  # linear warmup
    assert all(a > b for a, b in zip(lrs[2:-1], lrs[3:])) and lrs[-1] == pytest.approx(1e-5)  # cosine to min_lr
    sgd = create_optimizer(build_config({"model": "vit_micro4_32", "optim": {"name": "sgd"}}), task)
    assert not sgd.param_groups[0]["nesterov"] and sgd.param_groups[0]["momentum"] == 0.9
    sgd = create_optimizer(build_config({"model": "vit_micro4_32", "optim": {"name": "sgd", "momentum": 0.8}}), task)
    assert {g["momentum"] for g in sgd.param_groups} == {0.8}


def test_sgds_first_step_skipped_leaves_its_momentum_zero():
    """Fused SGD allocates its momentum buffers on its first step, uninitialised, and keeps them
    when that step is skipped (a non-finite gradient, an fp16 overflow): whatever memory held then
    entered every later step. They start as zeros, so a skipped first step changes nothing."""
    from mpp.nonfinite import skip_unless_finite
    from mpp.optim import create_optimizer
    model = torch.nn.Linear(64, 64)
    opt = create_optimizer(build_config({"model": "vit_micro4_32", "optim": {"name": "sgd", "lr": 0.1}}), model)
    assert all(torch.equal(opt.state[p]["momentum_buffer"], torch.zeros_like(p)) for p in model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    skip_unless_finite(None, opt, torch.tensor(False))
    opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(torch.equal(opt.state[p]["momentum_buffer"], torch.zeros_like(p)) for p in model.parameters())


def test_every_sample_of_a_step_weighs_the_same(data, tmp_path, monkeypatch):
    """A step over micro-batches of 6 and 2 images (grad_accum 2, as when an epoch's tail batch
    shrank) moves the weights as one batch of the same 8 images does, and logs the same loss: each
    micro-batch's mean loss is weighted by its size, not counted once."""
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8, generator=gen)
    labels = torch.arange(8) % 10

    def fixed(parts):
        def batches(loader, start):
            while True:
                for a, b in parts:
                    yield {"image": images[a:b].contiguous(memory_format=torch.channels_last), "label": labels[a:b]}
        return batches
    encoders = []
    for name, parts, accum in (("one", [(0, 8)], 1), ("two", [(0, 6), (6, 8)], 2)):
        monkeypatch.setattr(mpp.train, "_batches", fixed(parts))
        out = tmp_path / name
        train(config(settings(data, out, objective="supervised", steps=1, batch_size=8, **{
            "train.grad_accum": accum, "train.precision": "no", "optim.name": "sgd", "optim.lr": 0.5,
            "optim.warmup_steps": 0, "optim.clip_grad": 0, "optim.weight_decay": 0, "train.log_every": 1})))
        encoders.append(load_file(str(out / "encoder.safetensors")))
    for k in encoders[0]:
        torch.testing.assert_close(encoders[1][k], encoders[0][k], rtol=1e-5, atol=1e-6)
    assert scalars(tmp_path / "two", "train/loss") == pytest.approx(scalars(tmp_path / "one", "train/loss"), rel=1e-5)


def test_sample_weights_sum_the_step_over_all_ranks():
    """On several ranks each micro-batch's weight divides by the step's samples summed over the
    ranks (an all-reduce "sum"), not their mean: micro-batches of 4 and 4 beside another rank's 8
    weigh 1.0 each; a lone 2 beside another rank's 4 weighs 2 x 1 x 2 / 6."""
    class Fake:
        num_processes, device = 2, "cpu"

        def __init__(self, other):
            self.other = other

        def reduce(self, t, op):
            return {"sum": t + self.other, "mean": (t + self.other) / 2}[op]

    def micro(*sizes):
        return [{"image": torch.zeros(n, 3, 4, 4)} for n in sizes]
    assert [float(w) for w in mpp.train._sample_weights(Fake(8.0), micro(4, 4))] == pytest.approx([1.0, 1.0])
    assert [float(w) for w in mpp.train._sample_weights(Fake(4.0), micro(2))] == pytest.approx([2 * 1 * 2 / 6])


def test_each_step_uses_its_own_gradient_only(data, tmp_path, monkeypatch):
    """Plain SGD over batches X then Y: the second step moves the weights of the first step's
    checkpoint by exactly lr x the gradient of Y there, recomputed by hand; the first step's
    gradient (of X) was cleared, not added to it."""
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8, generator=gen)
    labels = torch.arange(16) % 10

    def batches(loader, start):
        for k in range(start, 2):
            part = slice(8 * k, 8 * k + 8)
            yield {"image": images[part].contiguous(memory_format=torch.channels_last), "label": labels[part]}
    monkeypatch.setattr(mpp.train, "_batches", batches)
    out, lr = tmp_path / "run", 0.5
    cfg = config(settings(data, out, objective="supervised", steps=2, batch_size=8, **{
        "train.precision": "no", "optim.name": "sgd", "optim.momentum": 0, "optim.lr": lr, "optim.warmup_steps": 0,
        "optim.schedule": "constant", "optim.clip_grad": 0, "optim.weight_decay": 0, "train.ckpt_every": 1,
        "train.keep_ckpts": 2, "data.num_workers": 0}))
    train(cfg)
    first, second = (load_file(str(out / f"checkpoints/{checkpoint_name(k)}/model.safetensors")) for k in (1, 2))
    task = mpp.objectives.build_task(cfg, mpp.objectives.OBJECTIVES["supervised"].encoder_for(cfg), 10)
    task.load_state_dict(first)
    task.train()
    task(images[8:].contiguous(memory_format=torch.channels_last), labels[8:])[0].backward()
    moved = 0
    for name, p in task.named_parameters():
        expected = first[name] - lr * p.grad if p.requires_grad else first[name]
        torch.testing.assert_close(second[name], expected, rtol=1e-5, atol=1e-6, msg=name)
        moved += p.requires_grad and not torch.equal(second[name], first[name])
    assert moved


def test_a_step_is_clipped_at_optim_clip_grad_and_the_last_step_is_always_checkpointed(data, tmp_path, monkeypatch):
    """The first SGD step moves the weights by lr x the gradient clipped to norm optim.clip_grad: two
    runs from the same start with clip_grad 1e-3 and 2e-3 end at most lr x 1e-3 apart (the encoder's
    share of the whole gradient), and apart. Their last step is checkpointed though train.ckpt_every
    (500, or 0: only at the end) does not divide it: a crash in the export would lose it otherwise."""
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8, generator=gen)

    def batches(loader, start):
        while True:
            yield {"image": images.contiguous(memory_format=torch.channels_last), "label": torch.arange(8) % 10}
    monkeypatch.setattr(mpp.train, "_batches", batches)
    encoders = []
    for clip, every in ((1e-3, 500), (2e-3, 0)):
        out = tmp_path / f"clip{clip:g}"
        train(config(settings(data, out, objective="supervised", steps=1, batch_size=8, **{
            "train.precision": "no", "optim.name": "sgd", "optim.lr": 0.5, "optim.warmup_steps": 0,
            "optim.clip_grad": clip, "optim.weight_decay": 0, "train.ckpt_every": every})))
        assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_0000001"]
        encoders.append(load_file(str(out / "encoder.safetensors")))
    apart = torch.cat([(encoders[0][k] - encoders[1][k]).flatten() for k in encoders[0]]).norm().item()
    assert 0 < apart <= 0.5 * 1e-3 * (1 + 1e-4)


def test_a_resume_warns_of_changed_settings_but_not_of_speed_and_logging(tmp_path, capsys):
    """A resumed run names the settings that differ from its config.yaml, not those of speed and
    logging alone (mpp.config.RESULT_NEUTRAL), which a run changes on resume as a matter of course,
    nor its output_dir (a run folder moved or copied)."""
    from mpp.config import save_config
    save_config(config(["train.log_every=10", "train.ckpt_every=500", "data.num_workers=2", "output_dir=a"]),
                tmp_path / "config.yaml")
    mpp.resume.check_changes(tmp_path, config(["train.log_every=1", "train.ckpt_every=5", "train.resume=none",
                                               "data.num_workers=4", "output_dir=b"]),
                             SimpleNamespace(is_main_process=True, num_processes=1), 3, 5)
    assert capsys.readouterr().err == ("warning: resuming with data.num_workers: 2 -> 4 (the shards are split over the "
                                       "workers anew: the rest of this epoch trains some of its samples a second time "
                                       "and leaves as many out)\n")
    assert mpp.resume._reordered("data.num_workers: 1 -> 0") == ""  # one worker's order either way


def test_a_run_ends_when_the_prefetch_thread_is_stuck_in_the_loader(data, tmp_path, monkeypatch):
    """The thread reads past the run's last batch; when that read hangs (a stuck shard read or
    worker), `finish` must not close the loader under it ('generator already executing') but
    warn and still export the run."""
    import threading

    import mpp.data.stream
    import mpp.prefetch
    gate, calls, decode = threading.Event(), [], mpp.data.stream.decode_batch

    def decode_hanging_after_the_runs_batches(*args, **kwargs):
        if threading.current_thread().name == "mpp-prefetch":
            calls.append(1)
            if len(calls) > 2:  # the look-ahead beyond the run's 2 batches
                gate.wait(60)
        return decode(*args, **kwargs)
    close = mpp.prefetch.DevicePrefetcher.close
    monkeypatch.setattr(mpp.data.stream, "decode_batch", decode_hanging_after_the_runs_batches)
    monkeypatch.setattr(mpp.prefetch.DevicePrefetcher, "close", lambda self, timeout=1.0: close(self, timeout))
    out = tmp_path / "run"
    try:
        with pytest.warns(UserWarning, match="prefetch thread did not stop"):
            results = train(config(settings(data, out, steps=2, **{"data.num_workers": 0})))
    finally:
        gate.set()
    assert results["steps"] == 2 and (out / "metrics.json").is_file()


def test_a_run_resumed_at_any_checkpoint_reports_what_the_whole_run_reports(tmp_path):
    """Shards named by a brace pattern with a smaller num_samples (inexact counts: the surplus is
    dropped at each epoch's end), 1 sample in 5 corrupt, an epoch of 15 steps, checkpoints every 5
    and logs every 8 (checkpoint 20 inside the last log window, 17-24): resumed from each
    checkpoint, the epoch boundary's one included, a run reports the whole run's skip counts and
    last-window loss (a checkpoint closes a log window)."""
    from shardutil import write_shards
    bad = lambda s, j: {"png": b"not an image"} if j % 5 == 2 else {}  # noqa: E731
    write_shards(tmp_path / "data", [40, 40, 40, 40], extra=bad)
    out = tmp_path / "run"
    items = settings(tmp_path, out, **{"data.train": f"{tmp_path}/data/{{000000..000003}}.tar",
                                       "data.num_samples": 120, "batch_size": 8, "steps": 24,
                                       "train.ckpt_every": 5, "train.log_every": 8, "train.keep_ckpts": 6})
    whole = train(config(items))
    assert whole["skipped_samples"].get("dropped", 0) > 0  # the surplus counted at the epoch's end
    saved = out.with_name("saved")
    shutil.copytree(out, saved)
    for step in (5, 10, 15, 20):
        shutil.rmtree(out)
        shutil.copytree(saved, out)
        for ckpt in (out / "checkpoints").iterdir():
            if int(ckpt.name.split("_")[1]) > step:
                shutil.rmtree(ckpt)
        (out / "metrics.json").unlink()
        resumed = train(config(items))
        assert resumed["skipped_samples"] == whole["skipped_samples"], step
        assert resumed["loss"] == whole["loss"], step


def test_images_a_second_and_epochs_count_an_epochs_smaller_tail_batch(tmp_path, data):
    """256 images in batches of 24: an epoch is 10 full batches and a tail of 16, so 14 steps
    train 328 images, not 14 x 24; the count survives a resume from the checkpoint past the tail,
    and TensorBoard keeps the log window that checkpoint closed (step 12) with the resumed run's."""
    out = tmp_path / "run"
    items = settings(data, out, batch_size=24, steps=14, **{"train.ckpt_every": 12})
    whole = train(config(items))
    assert whole["epochs"] == (10 * 24 + 16 + 3 * 24) / 256
    for ckpt in list_checkpoints(out / "checkpoints")[1:]:  # "crash" after step 12
        shutil.rmtree(ckpt)
    (out / "metrics.json").unlink()
    assert train(config(items))["epochs"] == whole["epochs"]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [4, 8, 12, 14]


def test_a_resume_trains_with_the_optimiser_settings_it_warns_of_and_refuses_another_grouping(tmp_path, data,
                                                                                               monkeypatch):
    """Resumed with another weight decay, the run warns of it and its optimiser uses it (the
    checkpoint's param groups brought the old one back, while config.yaml recorded the new); a
    checkpoint of another parameter grouping (layer decay) is refused as such, not as damaged."""
    import mpp.train as trainer
    out, seen, resume = tmp_path / "run", [], trainer.resume

    def spy(cfg, accelerator, root, task, optimizer):
        got = resume(cfg, accelerator, root, task, optimizer)
        seen.append(sorted({g["weight_decay"] for g in optimizer.param_groups}))
        return got
    monkeypatch.setattr(trainer, "resume", spy)
    train(config(settings(data, out, steps=2, **{"optim.weight_decay": 0.05})))
    (out / "metrics.json").unlink()
    train(config(settings(data, out, steps=4, **{"optim.weight_decay": 0.5})))
    assert seen == [[0.0, 0.05], [0.0, 0.5]]
    (out / "metrics.json").unlink()
    with pytest.raises(ConfigError, match="another optimiser or parameter grouping .*resume with the optim settings"):
        train(config(settings(data, out, steps=6, **{"optim.weight_decay": 0.5, "optim.layer_decay": 0.75})))


def test_a_finished_run_started_again_with_other_settings_is_refused(tmp_path, data, capsys):
    """A finished run started again trains nothing and only exports and evaluates again: with other
    settings its metrics.json (say, of another test set) and model.json (another normalisation)
    told of settings that its weights and config.yaml (kept) do not. Refused, naming them; with its own it
    exports again, also moved to another folder, and a config.yaml that cannot be read is said
    (a resume of it was a traceback)."""
    out = tmp_path / "run"
    train(config(settings(data, out, steps=4)))
    files = ("config.yaml", "model.json", "metrics.json", "encoder.safetensors")
    before = {n: (out / n).read_bytes() for n in files}
    with pytest.raises(ConfigError, match=r"holds a finished run of other settings \(optim.lr: 0.002 -> 0.005; "
                                          r"optim.weight_decay: 0.1 -> 0.2\); give it its own"):
        train(config(settings(data, out, steps=4, **{"optim.lr": 5e-3, "optim.weight_decay": 0.2})))
    with pytest.raises(ConfigError, match=r"other inputs \(normalisation: "):  # as any resume (model.json took it)
        train(config(settings(data, out, steps=4, **{"data.mean": "[0.4,0.4,0.4]"})))
    assert {n: (out / n).read_bytes() for n in files} == before
    moved = Path(shutil.move(out, tmp_path / "moved"))
    capsys.readouterr()
    assert train(config(settings(data, moved, steps=4)))["loss"] == json.loads(before["metrics.json"])["loss"]
    assert "warning: resuming" not in capsys.readouterr().err
    (moved / "config.yaml").write_text("[1, 2")
    train(config(settings(data, moved, steps=4)))
    assert "config.yaml cannot be read, so the settings changed since it cannot be named" in capsys.readouterr().err


def test_a_finished_run_is_refused_more_steps(tmp_path, data):
    """The same command run again without the steps it was given (the config's longer default)
    trained a finished run on: its learning rate back near its peak, its checkpoint rotated out,
    its metrics.json then of a run no schedule gives. Refused, naming the steps it finished at;
    a run stopped before it finished (no metrics.json) may still be given more."""
    out = tmp_path / "run"
    train(config(settings(data, out, steps=2, **{"train.keep_ckpts": 1})))
    files = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and "tensorboard" not in p.parts}
    with pytest.raises(ConfigError, match=r"holds a run that finished at step 2: 4 steps would train it on, its "
                                          r"learning-rate schedule begun anew; give steps=2 to export"):
        train(config(settings(data, out, steps=4, **{"train.keep_ckpts": 1})))
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()
            and "tensorboard" not in p.parts} == files
    (out / "metrics.json").unlink()  # a run stopped early: no metrics.json
    assert train(config(settings(data, out, steps=4, **{"train.keep_ckpts": 1})))["steps"] == 4
    # its newest checkpoint damaged, the steps it was given resume an older one and train to its end
    again = tmp_path / "again"
    train(config(settings(data, again, steps=4, **{"train.ckpt_every": 2})))
    (again / "checkpoints/step_0000004/state.pt").write_bytes(b"damaged")
    assert train(config(settings(data, again, steps=4, **{"train.ckpt_every": 2})))["steps"] == 4


def test_a_run_stopped_by_an_error_leaves_no_data_worker_or_writer_thread(data, tmp_path, monkeypatch):
    """Ctrl-C (or an error) in the loop left the data worker and TensorBoard's writer thread, its
    file open, behind: one more of each per failed train() in a long-lived process."""
    import multiprocessing
    import threading
    import mpp.train as T

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(T, "_log", interrupt)
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(KeyboardInterrupt) as held:  # held: the run's frames stay alive, as in a caller's handler
        T.train(config(settings(data, tmp_path / "run")))
    assert not multiprocessing.active_children()
    assert [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()] == []
    from tensorboard.summary.writer.record_writer import RecordWriter
    flush, calls = RecordWriter.flush, []

    def full(self):  # the disk fills after the writer's first flush: its last fails, the Ctrl-C still stops the run
        calls.append(1)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        flush(self)
    monkeypatch.setattr(RecordWriter, "flush", full)
    with pytest.raises(KeyboardInterrupt):
        T.train(config(settings(data, tmp_path / "full")))
    del held
