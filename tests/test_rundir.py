"""A run directory holds one run: resume falls back past checkpoints that do not load and says so,
a failed resume changes nothing, every file is written whole with mode 0644, a second run in the
same directory is refused, and a run whose weights went non-finite exports nothing and fails."""
from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cpuonly import cpu_only
from mpp.config import ConfigError, load_config
from mpp.nonfinite import NonFiniteError
from mpp.train import train
from shardutil import write_shards

pytestmark = pytest.mark.slow


def items(data: str, out: Path, **extra) -> list[str]:
    base = {"output_dir": out, "data.train": data, "model": "vit_micro4_32", "batch_size": 8, "steps": 4,
            "data.num_workers": 0, "train.attn": "math", "train.log_every": 1, "train.ckpt_every": 1,
            "train.keep_ckpts": 4, "seed": 1, **extra}
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[str, Path]:
    """A finished 4-step run with a checkpoint after every step, on the CPU: resumed copies of it
    must end bit-identical to it."""
    root = tmp_path_factory.mktemp("rundir")
    data, _ = write_shards(root / "data", [16, 16], classes=None)
    old = os.umask(0o022)
    try:
        with cpu_only():
            train(load_config(None, items(data, root / "run")))
    finally:
        os.umask(old)
    return data, root / "run"


def test_every_file_is_whole_and_0644(run):
    _, out = run
    files = [p for p in out.rglob("*") if p.is_file() and "tensorboard" not in p.parts]
    assert {p.name for p in files} >= {"encoder.safetensors", "model.json", "metrics.json", "config.yaml",
                                      "state.pt", "model.safetensors", "rng_0.pt"}
    modes = {str(p.relative_to(out)): oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
    assert set(modes.values()) == {"0o644"}, modes
    assert not [p for p in out.rglob("*") if ".tmp" in p.name or p.name == ".lock"]


def unfinished(done: Path, out: Path) -> Path:
    """A copy of the finished run `done` as a run killed after its last checkpoint."""
    shutil.copytree(done, out)
    for name in ("metrics.json", "encoder.safetensors"):
        (out / name).unlink()
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux shows the umask in /proc")
def reseal(checkpoint: Path) -> None:
    """Record the files' digests as they are now: a crafted checkpoint can match its digests.json,
    so the checks behind them must hold on their own."""
    from mpp.checkpoint import DIGESTS
    from mpp.fileio import file_sha256
    (checkpoint / DIGESTS).write_text(json.dumps({p.name: file_sha256(p) for p in checkpoint.iterdir()
                                                  if p.name != DIGESTS}))


def flip_a_bit(path: Path, at: float = 0.5) -> None:
    """One bit of the file's bytes at the fraction `at` of its length flipped, its size kept."""
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    path.write_bytes(bytes(data))


def same_encoder(out: Path, done: Path) -> bool:
    a, b = load_file(str(out / "encoder.safetensors")), load_file(str(done / "encoder.safetensors"))
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_flipped_bit_or_a_non_finite_value_makes_a_checkpoint_damaged(run, tmp_path, capfd):
    """Neither safetensors nor torch's zip reader checks its bytes: a bit flipped in the newest
    checkpoint's weights resumed as other weights without a word. Each checkpoint records its
    files' sha256; one that does not match is skipped, and so is one whose weights or optimiser
    moments are not finite even where its digests match (it trained on NaN, every step skipped,
    and its saves rotated the last good checkpoint out). The run ends bit-identical to the run."""
    data, done = run
    out = unfinished(done, tmp_path / "run")
    ck = out / "checkpoints"
    flip_a_bit(ck / "step_0000004/model.safetensors", 0.7)
    flip_a_bit(ck / "step_0000003/rng_0.pt", 0.9)
    weights = load_file(str(ck / "step_0000002/model.safetensors"))
    weights["encoder.vit.blocks.0.attn.qkv.weight"][0, 0] = float("nan")
    save_file(weights, str(ck / "step_0000002/model.safetensors"))
    reseal(ck / "step_0000002")
    with cpu_only():
        train(load_config(None, items(data, out)))
    said = capfd.readouterr()
    err = said.err
    assert "resumed from" in said.out and "step_0000001 (step 1)" in said.out
    assert "step_0000004 (ValueError: model.safetensors is not the file the checkpoint wrote" in err
    assert "step_0000003 (ValueError: rng_0.pt is not the file the checkpoint wrote" in err
    assert "step_0000002 (ValueError: model.safetensors holds non-finite values (encoder.vit.blocks.0.attn.qkv" in err
    assert same_encoder(out, done)

    out = unfinished(done, tmp_path / "moments")
    ck = out / "checkpoints"
    state = torch.load(ck / "step_0000004/state.pt", weights_only=True)
    state["optimizer"]["state"][3]["exp_avg_sq"].view(-1)[0] = float("inf")
    torch.save(state, ck / "step_0000004/state.pt")
    reseal(ck / "step_0000004")
    with cpu_only():
        train(load_config(None, items(data, out)))
    said = capfd.readouterr()
    assert "step_0000003 (step 3)" in said.out
    assert "step_0000004 (ValueError: state.pt's optimizer state exp_avg_sq of parameter 3 is not finite)" in said.err
    assert same_encoder(out, done)


@pytest.mark.parametrize("fault", ["EIO", "out of memory"])
def test_a_read_error_of_the_machine_stops_the_resume_and_skips_nothing(run, tmp_path, monkeypatch, fault):
    """EIO (or a stale NFS handle, no memory) reading the newest checkpoint says nothing of it:
    taken for damage, the resume went back to an older one and its next save removed the newer.
    The run stops with one line instead, every checkpoint left where it was."""
    import errno
    import mpp.checkpoint
    data, done = run
    out = unfinished(done, tmp_path / "run")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    load = torch.load

    def failing(f, *a, **k):
        if Path(f).name == "state.pt":
            raise OSError(errno.EIO, "Input/output error", str(f)) if fault == "EIO" else MemoryError()
        return load(f, *a, **k)
    monkeypatch.setattr(mpp.checkpoint.torch, "load", failing)
    said = r"OSError: \[Errno 5\] Input/output error.*" if fault == "EIO" else r"MemoryError: \)"
    with cpu_only(), pytest.raises(OSError, match=rf"reading checkpoint '.*step_0000004' failed \({said}.*a fault of "
                                                  r"this machine .*nothing was skipped"):
        train(load_config(None, items(data, out)))
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_the_rest_of_a_killed_removal_goes_when_the_run_starts_again(run, tmp_path):
    """A kill while the final save pruned an older checkpoint left `.tmp_removed_step_*`, a whole
    checkpoint; only a later save swept it, and a finished run started again saves none."""
    data, done = run
    out = tmp_path / "run"
    shutil.copytree(done, out)
    shutil.copytree(out / "checkpoints/step_0000001", out / "checkpoints/.tmp_removed_step_0000001")
    with cpu_only():
        train(load_config(None, items(data, out)))
    assert sorted(os.listdir(out / "checkpoints")) == [f"step_000000{s}" for s in (1, 2, 3, 4)]


def test_a_sigterm_outside_the_steps_stops_the_run_in_one_line(run, tmp_path, monkeypatch, capfd):
    """SIGTERM during set-up, a start-up probe, the export or the final evaluation ended the
    process without a word (a preemption looked like a crash): it raises Terminated (exit 143),
    also where it lands inside an `except Exception` (here a checkpoint's load, which would have
    counted it as the checkpoint's damage and gone on from an older one), and touches nothing."""
    import signal
    import mpp.resume
    from mpp.preemption import Terminated
    data, done = run
    out = unfinished(done, tmp_path / "run")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    load = mpp.resume.load_checkpoint

    def preempted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return load(*args, **kwargs)
    monkeypatch.setattr(mpp.resume, "load_checkpoint", preempted)
    handler = signal.getsignal(signal.SIGTERM)
    with cpu_only(), pytest.raises(Terminated, match="SIGTERM outside the training steps .* nothing lost; the same "
                                                     "command resumes"):
        train(load_config(None, items(data, out)))
    assert signal.getsignal(signal.SIGTERM) == handler
    assert "resume skipped" not in capfd.readouterr().err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_checkpoint_of_fewer_processes_is_refused_alike_on_every_rank(run):
    """Every rank must raise the same error before the ranks' agreement on a resume: a rank whose
    rng_R.pt the checkpoint never wrote failed its digest check (damaged) while the others refused
    the process count, and it waited in the collective the others never reached."""
    from types import SimpleNamespace
    from mpp.checkpoint import load_checkpoint
    _, done = run
    for rank in (0, 1):
        with pytest.raises(ConfigError, match="written by 1 processes, this run has 2"):
            load_checkpoint(SimpleNamespace(process_index=rank, num_processes=2, scaler=None),
                            done / "checkpoints/step_0000004", None, None)


def test_the_umask_is_read_without_setting_it(monkeypatch):
    """Files get 0666 minus the umask; reading it by setting it left it 0 for a moment, when a file
    another thread created (TensorBoard's) would have been world-writable."""
    import mpp.fileio
    old = os.umask(0o027)
    try:
        monkeypatch.setattr(mpp.fileio.os, "umask", lambda mask: pytest.fail(f"umask set to {mask:o}"))
        assert mpp.fileio._umask() == 0o027
    finally:
        monkeypatch.undo()
        os.umask(old)


def test_resume_falls_back_to_the_newest_checkpoint_that_loads(run, tmp_path, capfd):
    """Newest checkpoint corrupt, the next with an empty model.safetensors, a `step_*` that is a
    file, a user's copy of an older checkpoint (its longer name sorted as the newest): resume skips
    and names them, continues from step 2 and ends bit-identical to the run."""
    data, done = run
    out = unfinished(done, tmp_path / "run")
    ck = out / "checkpoints"
    (ck / "step_0000004/state.pt").write_bytes((ck / "step_0000004/state.pt").read_bytes()[:200])
    (ck / "step_0000003/model.safetensors").write_bytes(b"")
    (ck / "step_0000009").write_text("not a checkpoint")
    shutil.copytree(ck / "step_0000001", ck / "step_0000001.bak")
    shutil.copytree(ck / "step_0000001", ck / "step_00000001")  # a longer name sorted as the newest too
    with cpu_only():
        train(load_config(None, items(data, out)))
    err = capfd.readouterr()
    assert "resumed from" in err.out + err.err and "step_0000002 (step 2)" in err.out + err.err
    warning = [line for line in err.err.splitlines() if "resume skipped" in line]
    assert len(warning) == 1 and all(s in warning[0] for s in ("step_0000009", "step_0000004", "step_0000003",
                                                               "step_0000001.bak (not a checkpoint name",
                                                               "step_00000001 (not a checkpoint name"))
    a, b = load_file(str(out / "encoder.safetensors")), load_file(str(done / "encoder.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_missing_a_file_is_damaged_and_skipped(run, tmp_path, capfd):
    """A checkpoint without its model.safetensors (FileNotFoundError) is damage, skipped and named,
    not a fault of the machine that stops the run."""
    data, done = run
    out = unfinished(done, tmp_path / "run")
    (out / "checkpoints/step_0000004/model.safetensors").unlink()
    with cpu_only():
        train(load_config(None, items(data, out)))
    err = capfd.readouterr().err
    assert "resume skipped" in err and "step_0000004 (FileNotFoundError" in err and (out / "encoder.safetensors").exists()


def test_a_given_checkpoint_that_does_not_load_is_named_and_nothing_deleted(run, tmp_path):
    """train.resume=PATH of a damaged checkpoint: the message names it and asks for a good one, not
    to delete the run's checkpoints (resume=auto's message where none loads)."""
    data, done = run
    out = unfinished(done, tmp_path / "run")
    given = out / "checkpoints/step_0000002"
    (given / "state.pt").write_bytes(b"")
    with cpu_only(), pytest.raises(ConfigError) as e:
        train(load_config(None, items(data, out, **{"train.resume": given})))
    assert f"train.resume='{given}' does not load" in str(e.value) and "delete" not in str(e.value)


def test_a_run_stopped_early_is_finished_at_its_last_checkpoint(run, tmp_path):
    """steps=N of the newest checkpoint exports and evaluates a run stopped before its steps (as the
    refusal of more steps says): only the run length changed, which a finished run is allowed."""
    data, done = run
    out = unfinished(done, tmp_path / "run")
    shutil.rmtree(out / "checkpoints/step_0000004")  # stopped after step 3 of 4
    with cpu_only():
        metrics = train(load_config(None, items(data, out, steps=3)))
    assert metrics["steps"] == 3 and (out / "encoder.safetensors").exists()


def test_a_crafted_state_is_skipped_and_newer_damaged_checkpoints_never_push_out_new_ones(run, tmp_path, capfd):
    """state.pt files that load but lack a key or misstate the step are skipped like corrupt ones,
    a file named like a checkpoint is replaced when the run gets to its step, and with
    keep_ckpts=1 the run's new checkpoints are kept, not a damaged step_0000009."""
    data, done = run
    out = unfinished(done, tmp_path / "run")
    ck = out / "checkpoints"
    for step, edit in ((4, lambda s: s.pop("last")), (2, lambda s: s.update(step=-3))):
        state = torch.load(ck / f"step_000000{step}/state.pt", weights_only=True)
        edit(state)
        torch.save(state, ck / f"step_000000{step}/state.pt")
        reseal(ck / f"step_000000{step}")
    shutil.copytree(ck / "step_0000004", ck / "step_0000009")
    shutil.rmtree(ck / "step_0000003")
    (ck / "step_0000003").write_text("not a checkpoint")
    with cpu_only():
        train(load_config(None, items(data, out, **{"train.keep_ckpts": 1})))
    err = capfd.readouterr()
    assert "step_0000001 (step 1)" in err.out + err.err
    assert all(f"step_000000{s} (ValueError: state.pt" in err.err for s in (2, 4, 9))
    assert sorted(p.name for p in ck.iterdir()) == ["step_0000004", "step_0000009"]
    a, b = load_file(str(out / "encoder.safetensors")), load_file(str(done / "encoder.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_skipped_as_damaged_takes_no_place_of_the_kept_ones(run, tmp_path):
    """A resume that skipped a damaged step 3 went on from step 2 and, at its next save (step 4),
    counted step 3 among train.keep_ckpts=2: it deleted step 2 and kept one checkpoint that loads.
    Once a newer one is saved the damaged one is removed, and the kept ones all load; one the run
    saved again at the damaged one's step is kept like any other."""
    data, done = run
    out = unfinished(done, tmp_path / "run")
    ck = out / "checkpoints"
    shutil.rmtree(ck / "step_0000004")
    (ck / "step_0000003/state.pt").write_bytes(b"cut short")
    with cpu_only():
        train(load_config(None, items(data, out, **{"train.keep_ckpts": 2, "train.ckpt_every": 2})))
    assert sorted(os.listdir(ck)) == ["step_0000002", "step_0000004"]
    out = unfinished(done, tmp_path / "again")  # the damaged step saved again by the resumed run: that one is good
    ck = out / "checkpoints"
    (ck / "step_0000003/state.pt").write_bytes(b"cut short")
    shutil.rmtree(ck / "step_0000004")
    with cpu_only():
        train(load_config(None, items(data, out, steps=5, **{"train.keep_ckpts": 3})))
    assert sorted(os.listdir(ck)) == ["step_0000003", "step_0000004", "step_0000005"]


def test_a_kill_while_a_replaced_checkpoint_is_deleted_leaves_the_new_one_under_its_name(run, tmp_path,
                                                                                          monkeypatch):
    """A damaged checkpoint saved again at its step was deleted in place before the new one took its
    name: a kill during the deletion left a half checkpoint under the name, and the next start swept
    the complete new one away. The old one is moved aside first."""
    import mpp.checkpoint
    data, done = run
    out = unfinished(done, tmp_path / "run")
    ck = out / "checkpoints"
    (ck / "step_0000003/state.pt").write_bytes(b"cut short")
    shutil.rmtree(ck / "step_0000004")
    real = shutil.rmtree

    def killed(path, *a, **k):  # the kill lands after the first file of the replaced checkpoint is gone
        if Path(path).name.endswith("step_0000003"):
            (Path(path) / "model.safetensors").unlink()
            raise KeyboardInterrupt
        return real(path, *a, **k)
    monkeypatch.setattr(mpp.checkpoint.shutil, "rmtree", killed)
    with cpu_only(), pytest.raises(KeyboardInterrupt):
        train(load_config(None, items(data, out, steps=5, **{"train.keep_ckpts": 3})))
    saved = ck / "step_0000003"  # whole: every file its digests name, as written
    recorded = mpp.checkpoint._read_digests(saved)
    mpp.checkpoint._check_digests(saved, recorded, tuple(recorded))
    assert torch.load(saved / "state.pt", weights_only=True)["step"] == 3


def test_a_checkpoint_of_more_gpus_than_this_process_sees_resumes_and_says_so(run, tmp_path, caplog):
    """rng_0.pt written where the process saw more GPUs (another node shape): the run resumes, its
    CUDA RNG going on from a seed of its own with a warning; torch would fail on the missing devices, and
    every checkpoint would then read as damaged."""
    data, done = run
    out = unfinished(done, tmp_path / "run")
    ck = out / "checkpoints"
    for step in (3, 4):
        shutil.rmtree(ck / f"step_000000{step}")
    rng = torch.load(ck / "step_0000002/rng_0.pt", weights_only=True)
    gpus = torch.cuda.device_count() + 2
    rng["cuda"] = [torch.get_rng_state()] * gpus  # byte tensors like CUDA's; never applied
    torch.save(rng, ck / "step_0000002/rng_0.pt")
    reseal(ck / "step_0000002")
    with cpu_only():
        train(load_config(None, items(data, out)))
    assert f"CUDA RNG states of {gpus} GPUs and this process sees {gpus - 2}" in caplog.text
    a, b = load_file(str(out / "encoder.safetensors")), load_file(str(done / "encoder.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)  # the CPU's RNG and everything else restored


def test_a_cuda_rng_not_restored_is_seeded_per_rank_not_left_at_the_runs_seed(monkeypatch):
    """A checkpoint without this node's CUDA RNG states (a CPU run's, another node shape's) left the
    CUDA RNG at the run's seed, the same on every rank: each rank drew the same corruption. It is
    seeded from the rank's restored CPU RNG: ranks differ, a rank resumed twice draws alike."""
    from mpp.checkpoint import rng_state, set_rng_state
    seeds = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeds.append)
    states = []
    for rank in (0, 1, 0):
        torch.manual_seed(100 + rank)  # each rank's own CPU stream, as a fresh run seeds it
        states.append({**rng_state(), "cuda": []})
    seeds.clear()  # torch.manual_seed seeds CUDA too
    for st in states:
        set_rng_state(st)
    assert len(seeds) == 3 and seeds[0] != seeds[1] and seeds[0] == seeds[2]


def test_resuming_an_older_checkpoint_or_past_the_steps_is_refused(run, tmp_path, capfd):
    """train.resume=PATH older than checkpoints in the output dir would mix two runs (and rotation
    would remove the new ones); a checkpoint past `steps` would export it as a shorter run."""
    data, done = run
    out = tmp_path / "run"
    shutil.copytree(done, out)
    older = out / "checkpoints/step_0000002"
    older_than = r"\(step 2\) is older than step_0000003, step_0000004 in .*another output_dir"
    with pytest.raises(ConfigError, match=older_than):
        train(load_config(None, items(data, out, **{"train.resume": older})))
    with pytest.raises(ConfigError, match="is at step 4, past this run's 2 steps"):
        train(load_config(None, items(data, out, steps=2)))
    assert "resumed from" not in capfd.readouterr().out  # said only of a checkpoint the run goes on from


def test_a_failed_resume_changes_nothing(run, tmp_path):
    data, done = run
    out = tmp_path / "run"
    shutil.copytree(done, out)
    for ck in (out / "checkpoints").iterdir():
        (ck / "state.pt").write_bytes(b"\0" * 64)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match="no checkpoint in .* loads"):
        train(load_config(None, items(data, out, **{"optim.lr": 0.5})))  # a changed setting: config.yaml would change
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_second_run_in_the_same_directory_is_refused(run, tmp_path):
    """Whatever train.resume says: a run that holds checkpoints while it trains is no earlier run
    to delete (resume=none said so, before it looked at the lock)."""
    data, done = run
    shutil.copytree(done / "checkpoints", tmp_path / "run/checkpoints")
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time\n"
                               "f = open(sys.argv[1], 'a+'); fcntl.lockf(f, fcntl.LOCK_EX)\n"
                               "f.write('4242\\n'); f.flush(); print('held', flush=True); time.sleep(120)",
                               str(tmp_path / "run/.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"  # another process holds the lock
        for resume in ("auto", "none"):
            with pytest.raises(ConfigError, match=r"in use by another run \(pid 4242\)"):
                train(load_config(None, items(data, tmp_path / "run", **{"train.resume": resume})))
    finally:
        holder.kill()
        holder.wait()
    assert sorted(os.listdir(tmp_path / "run")) == [".lock", "checkpoints"]  # the holder's files, untouched


# another run's side of the lock, as `rundir.lock`/`unlock` do it (without importing torch):
# open + lockf + pid; on a line from stdin, remove the file, then let go of it
LOCKER = """import fcntl, os, sys, time
f = open(sys.argv[1], "a+"); fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
f.truncate(0); f.write(f"{os.getpid()}\\n"); f.flush(); print("held", flush=True)
if sys.stdin.readline():
    os.unlink(sys.argv[1]); f.close(); print("released", flush=True)
time.sleep(120)
"""


def test_a_writes_leftover_from_a_killed_run_is_removed_when_the_directory_is_next_locked(tmp_path):
    """kill -9 as a run wrote its encoder (or a feature cache entry) left the whole temporary file,
    which nothing removed; the next run of the directory removes those of this machine's dead
    processes, in it and in its folders (profile/, figures/), not a live writer's nor another
    machine's or container's (its own pids)."""
    from mpp import fileio, rundir
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, who, host = int(gone.stdout), *fileio._WHERE.split(".", 1)  # who: the PID namespace and boot
    assert host == socket.gethostname()
    names = {f".encoder.safetensors.tmp{dead}.{who}.{host}": False,
             f".metrics.json.tmp{os.getpid()}.{who}.{host}": True, f".model.json.tmp{dead}.{who}.other-machine": True,
             f".config.yaml.tmp{dead}.{who}1.{host}": True, "encoder.safetensors": True}
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "profile").mkdir()  # a folder of the run's (train.profile's figures): its leftovers too
    (tmp_path / "profile" / f".rank0.json.tmp{dead}.{who}.{host}").write_bytes(b"x")
    rundir.lock(tmp_path)
    try:
        assert {p.name for p in tmp_path.iterdir()} == {n for n, kept in names.items() if kept} | {".lock", "profile"}
        assert not any((tmp_path / "profile").iterdir())
    finally:
        rundir.unlock(tmp_path)


def test_a_lock_holds_its_pid_alone_keeps_a_users_folder_and_is_taken_once(tmp_path):
    """A stale .lock (a run killed -9) held the dead pid before ours ("4242\\n<pid>"), which the
    next run's refusal named; a folder the user made is kept when the run fails before writing; a
    second lock() of the same folder in one process opens no second handle, whose collection
    would close the first and so drop the process's POSIX lock."""
    import gc
    from mpp import rundir
    out = tmp_path / "made"
    out.mkdir()
    (out / ".lock").write_text("4242\n")
    rundir.lock(out)
    try:
        rundir.lock(out)
        gc.collect()
        (tmp_path / "locker.py").write_text(LOCKER)
        other = subprocess.run([sys.executable, str(tmp_path / "locker.py"), str(out / ".lock")], capture_output=True,
                               text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert other.returncode != 0 and "held" not in other.stdout  # still ours
        # read last: closing any handle of the file ends this process's POSIX lock on it
        assert (out / ".lock").read_text() == f"{os.getpid()}\n"
    finally:
        rundir.unlock(out)
    assert out.is_dir() and not any(out.iterdir())  # the user's, though empty


def test_a_lock_released_while_another_run_locks_has_one_holder(tmp_path, monkeypatch):
    """Run A releases (removes .lock) just after run B opened it and before B locks it, and run C
    then creates and locks a new .lock: B must not count the old, removed file as held."""
    from mpp import rundir
    out = tmp_path / "run"
    out.mkdir()
    start = lambda: subprocess.Popen([sys.executable, "-c", LOCKER, str(out / ".lock")],  # noqa: E731
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    procs = [start()]
    real_lockf = rundir.fcntl.lockf

    def slow_lockf(f, flags):  # B between its open and its lock: A lets go, C takes a new file
        if len(procs) == 1:
            a = procs[0]
            a.stdin.write("go\n")
            a.stdin.flush()
            assert a.stdout.readline() == "released\n"
            procs.append(start())
            assert procs[1].stdout.readline() == "held\n"
        return real_lockf(f, flags)

    try:
        assert procs[0].stdout.readline() == "held\n"
        monkeypatch.setattr(rundir.fcntl, "lockf", slow_lockf)
        with pytest.raises(ConfigError, match=r"in use by another run \(pid \d+\)") as refused:
            rundir.lock(out)
        assert f"(pid {procs[1].pid})" in str(refused.value)  # C holds it, and only C
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert str(out) not in rundir._held


def test_resume_none_refuses_an_earlier_run(run, tmp_path, monkeypatch):
    """Before the heavy set-up: no encoder or data is loaded for a run the directory refuses."""
    import mpp.train
    data, done = run

    def no_loader(*a, **k):
        raise AssertionError("the data was loaded before the run directory was checked")
    monkeypatch.setattr(mpp.train, "make_loader", no_loader)
    with pytest.raises(ConfigError, match="holds an earlier run .*step_0000004"):
        train(load_config(None, items(data, done, **{"train.resume": "none"})))
    kept = tmp_path / "kept"  # a finished run whose checkpoints were deleted to save space
    shutil.copytree(done, kept, ignore=shutil.ignore_patterns("checkpoints"))
    with pytest.raises(ConfigError, match=r"holds an earlier run \(.*metrics.json"):
        train(load_config(None, items(data, kept, **{"train.resume": "none"})))
    with pytest.raises(ConfigError, match=r"holds a finished run \(.*\) but no checkpoint to resume it"):
        train(load_config(None, items(data, kept)))  # resume=auto would train it anew and overwrite it


def test_a_run_that_diverged_exports_nothing_and_fails(run, tmp_path):
    """lr 1e30: the first update makes the weights huge, every later step is non-finite and
    skipped; fewer than max_bad_steps, yet the run must not end well nor export them."""
    data, _ = run
    out = tmp_path / "run"
    with pytest.raises(NonFiniteError, match="3 steps since the last finite one had a non-finite"):
        train(load_config(None, items(data, out, **{"optim.lr": 1e30, "optim.clip_grad": 0})))
    assert not (out / "encoder.safetensors").exists() and not (out / "metrics.json").exists()


def test_checkpoints_sort_by_step_past_seven_digits(tmp_path):
    """Names are zero-padded to 7 digits: step 10,000,000 is the newest, not step 9,999,500."""
    from mpp.checkpoint import checkpoint_name, list_checkpoints
    for step in (10_000_000, 9_999_500, 500):
        (tmp_path / checkpoint_name(step)).mkdir()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_0000500", "step_9999500", "step_10000000"]


def test_a_checkpoint_and_its_folder_reach_the_disk(tmp_path, monkeypatch):
    """Each checkpoint file is flushed before it is renamed into place and the checkpoints folder
    after the checkpoint's rename: after a power cut resume=auto finds whole checkpoints."""
    from accelerate import Accelerator
    from mpp.checkpoint import save_checkpoint
    events, fsync, replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), replace(a, b)))
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    final = save_checkpoint(Accelerator(cpu=True), tmp_path, 3, model, optimizer, scheduler, {})
    assert sorted(p.name for p in final.iterdir()) == ["digests.json", "model.safetensors", "rng_0.pt", "state.pt"]
    for name in ("digests.json", "model.safetensors", "rng_0.pt", "state.pt"):  # the content, then the rename, then the folder
        put = next(i for i, (kind, p) in enumerate(events) if kind == "replace" and p.endswith(name))
        assert events[put - 1][0] == "fsync" and Path(events[put - 1][1]).name.startswith(f".{name}.tmp")
        assert events[put + 1] == ("fsync", str((tmp_path / f".tmp_{final.name}").resolve()))
    assert events[-1] == ("fsync", str(tmp_path.resolve()))  # the checkpoint's own rename
    events.clear()
    save_checkpoint(Accelerator(cpu=True), tmp_path / "new", 1, model, optimizer, scheduler, {})
    assert events[0] == ("fsync", str(tmp_path.resolve()))  # a new checkpoints folder's entry in its parent


@pytest.mark.parametrize("edit, key", [
    (lambda s: s.update(skipped=5), "skipped"),
    (lambda s: s.update(skipped={"corrupt_image": -1}), "skipped"),
    (lambda s: s.update(begun={"pool": torch.zeros(2)}), "begun"),
    (lambda s: s.update(origin=["init_sha256"]), "origin"),
    (lambda s: s.update(bad_run="3"), "bad_run"),
    (lambda s: s.update(overflow_run=-1), "overflow_run"),
    # True is an int to Python (and == 1): a bool where a count is meant is damage, not a step or a run of 1
    (lambda s: s.update(step=True), "step"),
    (lambda s: s.update(bad_run=True), "bad_run"),
    (lambda s: s.update(world_size=0), "world_size"),  # no run has 0 processes: damaged, not another run's
    (lambda s: s.update(last={1: 0.5}), "last"),
    (lambda s: s.update(last={"loss": "n/a"}), "last"),  # printed as a number when the run ends
    (lambda s: s.pop("elapsed"), "elapsed"),
    # an fp16 run's loss scale: NaN or 0 makes every step an overflow, for good
    (lambda s: s.update(scaler={"scale": float("nan"), "growth_factor": 2.0, "backoff_factor": 0.5,
                                "growth_interval": 2000, "_growth_tracker": 0}), "scaler"),
    (lambda s: s.update(scaler={"scale": 0.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                "growth_interval": 2000, "_growth_tracker": 0}), "scaler"),
    (lambda s: s.update(scaler={"scale": "65536"}), "scaler"),
])
def test_a_crafted_state_is_refused_whole_before_the_run_reads_it(tmp_path, edit, key):
    """Every plain value a resumed run reads from state.pt (counters, start-up figures, inputs) is
    checked when it loads, so a crafted one is skipped like a corrupt file instead of a traceback
    steps later."""
    from accelerate import Accelerator
    from mpp.checkpoint import load_checkpoint, save_checkpoint
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    state = {"nonfinite_steps": 0, "elapsed": 1.0, "train_time": 1.0, "data_wait": 0.0, "last": {"loss": 2.0},
             "skipped": {"corrupt_image": 1}, "begun": {"pool": "avg"}, "origin": {"init_sha256": None}, "bad_run": 0}
    accelerator = Accelerator(cpu=True)
    path = save_checkpoint(accelerator, tmp_path, 3, model, optimizer, scheduler, state)
    assert load_checkpoint(accelerator, path, model, optimizer)["begun"] == {"pool": "avg"}
    saved = torch.load(path / "state.pt", weights_only=True)
    torch.save({**saved, "scaler": torch.amp.GradScaler("cpu").state_dict()}, path / "state.pt")
    reseal(path)
    load_checkpoint(accelerator, path, model, optimizer)  # an fp16 run's sound scaler state loads
    edit(saved)
    torch.save(saved, path / "state.pt")
    reseal(path)
    with pytest.raises(ValueError, match=f"state.pt lacks, mistypes or misstates {key}$"):
        load_checkpoint(accelerator, path, model, optimizer)


@pytest.mark.parametrize("name", ["model.safetensors", "state.pt", "rng_0.pt"])
def test_a_file_its_digests_json_leaves_out_makes_the_checkpoint_damaged(tmp_path, name):
    """A checkpoint's files load only when digests.json vouches for each: one whose entry is gone (a
    damaged or hand-edited digests.json) would load unverified, flipped bits and all, so the
    checkpoint is refused as damaged (resume=auto goes on to an older one)."""
    from accelerate import Accelerator
    from mpp.checkpoint import DIGESTS, load_checkpoint, save_checkpoint
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    state = {"nonfinite_steps": 0, "elapsed": 1.0, "train_time": 1.0, "data_wait": 0.0, "last": {}}
    accelerator = Accelerator(cpu=True)
    path = save_checkpoint(accelerator, tmp_path, 1, model, optimizer, scheduler, state)
    load_checkpoint(accelerator, path, model, optimizer)  # as written, it loads
    digests = json.loads((path / DIGESTS).read_text())
    del digests[name]
    (path / DIGESTS).write_text(json.dumps(digests))
    with pytest.raises(ValueError, match=f"records no digest of {name}$"):
        load_checkpoint(accelerator, path, model, optimizer)


def test_a_checkpoint_naming_an_unknown_pool_is_refused_in_one_line():
    """finetune.pool=auto takes the pool the run chose at its start from the checkpoint: one that
    names no representation stops the resume with a ConfigError, not a KeyError mid-training."""
    import dataclasses
    from mpp.config import Config
    from mpp.models import create_encoder
    from mpp.objectives import build_task
    cfg = Config(objective="classify")
    cfg = dataclasses.replace(cfg, finetune=dataclasses.replace(cfg.finetune, pool="auto"))
    task = build_task(cfg, create_encoder("vit_micro4_32", attn="math"), 3)
    task.restore({"pool": "avg"})
    assert task.pool == "avg"
    task = build_task(cfg, create_encoder("vit_micro4_32", attn="math"), 3)
    with pytest.raises(ConfigError, match="names pool 'rows', not one of token, avg: it is damaged"):
        task.restore({"pool": "rows"})


@pytest.mark.parametrize("edit", [
    lambda o: o["state"][0].update(exp_avg=torch.zeros(3)),  # a fused kernel would write past its end
    lambda o: o["state"][0].update(step=torch.zeros(2)),
    lambda o: o["state"][0].update(exp_avg=o["state"][0]["exp_avg"].tolist()),  # torch loads it; the step crashed
    lambda o: o["state"][0].update(exp_avg_sq=o["state"][0]["exp_avg_sq"].long()),
    lambda o: o["state"].update({7: o["state"][0]}),
    lambda o: o.pop("param_groups"),
    # the weight's and the bias's ids swapped: torch gives state[k] to the parameter where id k is listed,
    # so each would take the other's moments (a fused step then wrote past the bias's; a crash)
    lambda o: o["param_groups"][0].update(params=[1, 0]),
])
def test_an_optimizer_state_of_other_shapes_is_refused_before_torch_loads_it(tmp_path, edit):
    """torch's load_state_dict takes optimiser state tensors of any shape, and the fused AdamW
    kernel indexes them by the parameter's size: a damaged or crafted state.pt corrupted the heap.
    Each is now refused like a corrupt file (resume=auto goes on to an older checkpoint)."""
    from accelerate import Accelerator
    from mpp.checkpoint import load_checkpoint, save_checkpoint
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    state = {"nonfinite_steps": 0, "elapsed": 1.0, "train_time": 1.0, "data_wait": 0.0, "last": {}}
    accelerator = Accelerator(cpu=True)
    path = save_checkpoint(accelerator, tmp_path, 1, model, optimizer, scheduler, state)
    load_checkpoint(accelerator, path, model, optimizer)  # the state as written loads
    saved = torch.load(path / "state.pt", weights_only=True)
    edit(saved["optimizer"])
    torch.save(saved, path / "state.pt")
    reseal(path)
    with pytest.raises(ValueError, match="state.pt's optimizer (state|groups)"):
        load_checkpoint(accelerator, path, model, optimizer)


def test_checkpoints_past_seven_digits_rotate_and_order_as_steps(tmp_path):
    """Past step 9,999,999 the names grow a digit: rotation keeps the newest by step (not by text,
    where 'step_10000000' < 'step_9999999'), so the 7-digit ones go."""
    from accelerate import Accelerator
    from mpp.checkpoint import checkpoint_order, list_checkpoints, save_checkpoint
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    state = {"nonfinite_steps": 0, "elapsed": 1.0, "train_time": 1.0, "data_wait": 0.0, "last": {}}
    accelerator = Accelerator(cpu=True)
    for step in (9_999_998, 9_999_999, 10_000_001, 10_000_002):
        save_checkpoint(accelerator, tmp_path, step, model, optimizer, scheduler, state, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_10000001", "step_10000002"]
    assert checkpoint_order("step_9999999") < checkpoint_order("step_10000000")


def test_an_older_checkpoint_that_cannot_be_removed_is_warned_of_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    """Rotation runs after the new checkpoint is in place: a removal that fails (a permission, a
    file held open on a network mount), at its rename or after it, must not stop the run that just
    saved, nor the next save (which sweeps the remains), nor a later save of the step whose cut-off
    save left an unremovable folder of its name; each says what to delete, and a later save clears
    it all."""
    import pathlib
    import shutil
    from accelerate import Accelerator
    from mpp.checkpoint import list_checkpoints, save_checkpoint
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    accelerator, rmtree, rename = Accelerator(cpu=True), shutil.rmtree, pathlib.Path.rename

    def save(step):
        caplog.clear()
        with caplog.at_level("WARNING", logger="mpp.checkpoint"):
            final = save_checkpoint(accelerator, tmp_path, step, model, optimizer, scheduler, {}, keep=1)
        assert [p.name for p in list_checkpoints(tmp_path)] == [final.name]
        assert (final / "digests.json").is_file()
        return caplog.text

    def failing(path, *a, **k):  # every leftover's removal fails; a checkpoint's own rename aside works
        if Path(path).name.startswith(".tmp_"):
            raise PermissionError(13, "Permission denied", str(path))
        return rmtree(path, *a, **k)
    save(1)
    monkeypatch.setattr(shutil, "rmtree", failing)
    for step in (2, 3):
        said = save(step)
        assert ".tmp_removed_step_" in said and "delete it by hand" in said
    (tmp_path / ".tmp_step_0000005").mkdir()  # a save of step 5 cut off, its folder unremovable
    (tmp_path / ".tmp_step_0000005/model.safetensors").write_bytes(b"half")
    assert ".tmp_step_0000005" in save(5)
    monkeypatch.setattr(pathlib.Path, "rename", lambda self, target: (_ for _ in ()).throw(
        PermissionError(13, "Permission denied", str(self))) if Path(target).name.startswith(".tmp_removed_")
        else rename(self, target))
    caplog.clear()
    with caplog.at_level("WARNING", logger="mpp.checkpoint"):
        save_checkpoint(accelerator, tmp_path, 6, model, optimizer, scheduler, {}, keep=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_0000005", "step_0000006"]
    assert f"older checkpoint {tmp_path / 'step_0000005'} (PermissionError" in caplog.text
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    monkeypatch.setattr(pathlib.Path, "rename", rename)
    save(7)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000007"]


def test_a_folder_another_run_locks_as_this_one_lets_go_stays_and_hides_no_error(tmp_path, monkeypatch):
    """A failed run removes the folder its lock made; another run that locked it between the
    emptiness check and the removal made the removal raise 'Directory not empty', which replaced
    the failed run's own error. The folder stays to the new run, and the error is the run's."""
    from mpp import rundir
    out, real = tmp_path / "run", Path.rmdir

    def another_run_first(self):
        if self == out:
            (out / ".lock").write_text("4242")  # the other run's lock, taken just now
        real(self)

    rundir.lock(out)
    monkeypatch.setattr(Path, "rmdir", another_run_first)
    with pytest.raises(RuntimeError, match="the run's own"):
        try:
            raise RuntimeError("the run's own")
        finally:
            rundir.unlock(out)
    assert (out / ".lock").read_text() == "4242"


def test_a_run_moved_to_another_folder_has_changed_no_setting(tmp_path):
    """A run's folder moved, copied or spelled otherwise is the same run: a resume from there
    compares every setting but output_dir, and a changed one is named as 'key: then -> now'."""
    from mpp.config import changed_settings, save_config
    base = ["model=vit_micro4_32", "data.train=synthetic/train", "steps=4"]
    save_config(load_config(None, [*base, f"output_dir={tmp_path / 'first'}"]), tmp_path / "config.yaml")
    saved = tmp_path / "config.yaml"
    assert changed_settings(saved, load_config(None, [*base, f"output_dir={tmp_path / 'moved'}"])) == []
    assert changed_settings(saved, load_config(None, [*base[:-1], "steps=5", "output_dir=x"])) == ["steps: 4 -> 5"]


def test_a_one_line_message_names_four_changed_settings_then_says_there_are_more():
    from mpp.config import said
    assert said(["a: 1 -> 2", "b", "c", "d"]) == "a: 1 -> 2; b; c; d"
    assert said(["a", "b", "c", "d", "e", "f"]) == "a; b; c; d; ..."


def test_two_spellings_of_one_data_set_or_encoder_are_one_setting(tmp_path, monkeypatch):
    """A resume given its data relative where the run had it absolute, a shard folder where it had
    its manifest.json, or a run folder where it had its encoder.safetensors ran on the same files:
    refusing it as a changed recipe would make the user retrain for nothing. Other files differ."""
    from mpp.config import same_setting
    for name in ("data/manifest.json", "run/encoder.safetensors", "other/encoder.safetensors"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert same_setting("data.train", "data", str(tmp_path / "data"))
    assert same_setting("data.train", "data", "data/manifest.json")
    assert same_setting("finetune.init", "run", str(tmp_path / "run/encoder.safetensors"))
    assert not same_setting("finetune.init", "run", "other")
    assert not same_setting("steps", "run", "run/encoder.safetensors")


@pytest.mark.parametrize("text", ["steps: -1\n", "no_such_key: 1\n"])
def test_a_saved_config_this_mpp_cannot_build_is_unreadable_not_a_crash(tmp_path, text):
    """A config.yaml of a bad value or a key of another mpp is no config this mpp can read: None,
    which the resume and the comparison turn into their own one-line refusal, not a raised error."""
    from mpp.config import changed_settings
    (tmp_path / "config.yaml").write_text(text)
    assert changed_settings(tmp_path / "config.yaml", load_config(None, ["model=vit_micro4_32"])) is None
