"""Soak test (not part of the suite): pre-train on generated shards for a given time, kill -9 the
run at random moments, resume it, and report restarts, steps lost per kill and the process tree's
peak memory over time (it should stay flat). Run through `mpp-soak` (mpp/tools/soak.py)."""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from mpp.launcher import follow_parent

ROOT = Path(__file__).resolve().parents[1]  # holds this mpp package: the runs import the same code
PROGRESS = re.compile(r"(\d+)/(\d+) \[")  # tqdm's "step/total ["
RESUMED = re.compile(r"resumed from .+ \(step (\d+)\)$", re.M)  # a path may hold spaces


def _tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


# the soak's pre-training (a tool's key=value settings come after these)
SETTINGS = ["model=vit_micro4_32", "batch_size=32", "steps=1000000", "train.ckpt_every=20", "train.log_every=10",
            "data.num_workers=2", "train.attn=math"]
WINDOW_S = 30.0  # the report's peak memory is per window of this many seconds


def soak(out: Path, seconds: float, kill_after: tuple[float, float], settings: list[str], seed: int = 0) -> dict:
    """Run `mpp.tools.pretrain` in `out/run` again and again until `seconds` have passed, each run
    killed with SIGKILL after a uniform random time in `kill_after` (seconds); returns the report.
    The settings are checked first, as a run checks them at its start (ConfigError, nothing
    written): a bad one would fail every run, and one without checkpoints to resume from would test
    no recovery."""
    from mpp.config import ConfigError, check_tool, load_config, override_keys
    from mpp.data.synthetic import make_synthetic
    from mpp.runtime import check_run_settings
    if own := sorted({"output_dir", "data.train"} & override_keys(settings), reverse=True):
        # the soak counts what its runs lost in OUT/run's checkpoints, and makes their data there
        raise ConfigError(f"{' and '.join(own)}: the soak's own (its runs in OUT/run, on its synthetic data in "
                          "OUT/data); give the soak another OUT instead")
    overrides = [f"output_dir={out / 'run'}", f"data.train={out / 'data/train/manifest.json'}", *settings]
    cfg = load_config(None, overrides)
    check_tool(cfg, "pretrain")  # as each run checks them at its start
    check_run_settings(cfg)
    every, steps = cfg.train.ckpt_every, cfg.steps
    if not every or steps and every >= steps:  # each restart would begin at step 0: no resume to test
        below = f", not below steps={steps}," if every else ""
        raise ConfigError(f"train.ckpt_every={every}{below} saves no checkpoint before the run's end, so "
                          "no run would resume from one; give a train.ckpt_every of fewer steps than a run trains "
                          "before its kill (the soak's own is 20), or leave it out")
    if cfg.train.resume != "auto":
        raise ConfigError(f"train.resume={cfg.train.resume}: the soak tests resuming from its run's newest checkpoint "
                          "(train.resume=auto); leave it out")
    if (out / "run").exists():  # its runs would resume that soak's run, with its settings, and mix the figures
        raise ConfigError(f"'{out / 'run'}' holds an earlier soak's run; give the soak a new folder, or delete it")
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "data/train/manifest.json").exists():
        make_synthetic(out / "data", train=512, test=64, shards=8, progress=False)
    cmd = [sys.executable, "-m", "mpp.tools.pretrain", *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0, samples, runs = time.time(), [], []
    stopped = signal.signal(signal.SIGTERM, _exit_143)  # a SIGTERM to the soak runs the `finally` below too
    try:
        while time.time() - t0 < seconds:
            log, newest = out / f"run{len(runs)}.log", _newest_checkpoint(out / "run")  # what it should resume
            with open(log, "w") as f:
                proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=follow_parent)  # a soak killed -9 takes its run along
            ps, start = psutil.Process(proc.pid), time.time()
            drawn, left = rng.uniform(*kill_after), seconds - (start - t0)
            life = min(drawn, left)
            try:
                while proc.poll() is None and time.time() - start < life:
                    samples.append((time.time() - t0, _tree_rss(ps)))
                    time.sleep(0.5)
            finally:  # also when the soak itself is stopped (Ctrl-C, SIGTERM): its run, in a session of its own, goes
                killed = proc.poll() is None
                if killed:
                    os.killpg(proc.pid, signal.SIGKILL)  # the run and its data workers
                proc.wait()
            text = log.read_text(errors="replace")
            reached = max([int(m.group(1)) for m in PROGRESS.finditer(text)] or [0])
            resumed = RESUMED.search(text)
            run = {"seconds": round(time.time() - start, 1), "killed": killed, "exit": proc.returncode,
                   "at_deadline": killed and drawn >= left,  # the soak's end, not a fault it injected
                   "newest_at_start": newest,
                   # None: killed before it resumed or trained (starved of CPU, or at the deadline)
                   "resumed_at": int(resumed.group(1)) if resumed else (0 if reached else None),
                   "reached": reached}
            runs.append({**run, "problems": problems(run, text)})
    finally:
        signal.signal(signal.SIGTERM, stopped or signal.SIG_DFL)  # None: a handler set outside Python
    count_lost(runs, _newest_checkpoint(out / "run"))
    buckets: dict[int, int] = {}
    for t, rss in samples:
        buckets[int(t // WINDOW_S)] = max(buckets.get(int(t // WINDOW_S), 0), rss)
    mark_stalls(runs)
    if runs and not any(r["reached"] for r in runs) and not any(r["problems"] for r in runs):
        runs[-1]["problems"].append(f"no run trained a step in {time.time() - t0:.0f} s")  # a short soak's stall
    return {"seconds": round(time.time() - t0), "restarts": len(runs) - 1,
            "kills": sum(r["killed"] and not r["at_deadline"] for r in runs),
            "stopped_at_deadline": any(r["at_deadline"] for r in runs),
            "resumes": sum(bool(r["resumed_at"]) for r in runs),
            "failed_runs": sum(bool(r["problems"]) for r in runs),
            "final_step": max(r["reached"] for r in runs) if runs else 0,
            "steps_lost": sum(r.get("lost", 0) for r in runs),
            "peak_rss_mib_per_window": {f"{int(k * WINDOW_S)}s": round(v / 2**20) for k, v in sorted(buckets.items())},
            "runs": runs}


def verdict(report: dict, out: Path) -> str | None:
    """Why the soak failed, in one line (None: it passed): how many runs failed, and the first one's
    first problem and its log in `out`; or, none failing, that runs restarted after its kills but
    none resumed from a checkpoint, which leaves the recovery the soak is for untested."""
    failed = [i for i, r in enumerate(report["runs"]) if r["problems"]]
    if not failed:
        runs = report["runs"]
        restarted = [nxt for prev, nxt in zip(runs, runs[1:]) if prev["killed"]]
        if restarted and not any(r["resumed_at"] for r in restarted):
            return (f"{len(restarted)} soak run(s) restarted after a kill, but none resumed from a checkpoint "
                    "(each began at step 0, or was killed before it resumed), so recovery went untested; give "
                    "--kill-after a MIN longer than a run takes to its first checkpoint, or a smaller "
                    "train.ckpt_every")
        return None
    first = failed[0]
    return (f"{len(failed)} of {len(report['runs'])} soak runs failed; the first, run{first}: "
            f"{report['runs'][first]['problems'][0]} (see {out / f'run{first}.log'})")


STALL_S = 120  # runs in a row alive this long in all without a step past where each began: stalled


def problems(run: dict, log: str) -> list[str]:
    """What went wrong in one run of the soak, from its record and its log: an error line or a
    traceback; an exit the soak did not cause (a crash, the kernel's OOM kill); a resume that
    skipped checkpoints that do not load (a kill broke a write the checkpoints promise is whole); a
    run that began before the newest checkpoint on disk when it started (it redid saved steps)."""
    found = [ln for ln in log.splitlines() if ln.startswith(("error:", "Traceback"))]
    if not run["killed"] and run["exit"] != 0 and not found:
        found.append(f"exited {run['exit']} without being killed")
    found += [ln for ln in log.splitlines() if ln.startswith("warning: resume skipped checkpoints")]
    if run["resumed_at"] is not None and run["resumed_at"] < run["newest_at_start"]:
        found.append(f"began at step {run['resumed_at']}, not at step {run['newest_at_start']}, the newest checkpoint "
                     "on disk when it started: it trained saved steps again")
    return found


def mark_stalls(runs: list[dict]) -> None:
    """Add a stall to the run with which runs in a row that trained no step past where each began
    (a hang, or a resume that deadlocks, killed before the soak's kill times add up) reach STALL_S
    seconds alive; a run or two starved of CPU at their start stay below it."""
    idle, count = 0.0, 0
    for run in runs:
        if run["reached"] > (run["resumed_at"] or 0):
            idle, count = 0.0, 0
            continue
        idle, count = idle + run["seconds"], count + 1
        if idle >= STALL_S:
            run["problems"].append(f"no step in {idle:.0f} s over {count} run(s) in a row: stalled")
            idle, count = 0.0, 0


def _exit_143(*_) -> None:
    raise SystemExit(128 + signal.SIGTERM)


def count_lost(runs: list[dict], checkpointed: int) -> None:
    """Set each run's `lost`: steps it trained that the next run that got going did not resume from
    (the last run: beyond the newest checkpoint). Runs killed before they resumed lose nothing."""
    going = [r for r in runs if r["resumed_at"] is not None]
    for prev, nxt in zip(going, going[1:]):
        prev["lost"] = max(prev["reached"] - nxt["resumed_at"], 0)
    if going:
        going[-1]["lost"] = max(going[-1]["reached"] - checkpointed, 0)


def _newest_checkpoint(run_dir: Path) -> int:
    from mpp.checkpoint import PREFIX, list_checkpoints
    found = list_checkpoints(run_dir / "checkpoints")
    return int(found[-1].name[len(PREFIX):]) if found else 0


def write_report(report: dict, path: Path) -> None:
    from mpp.fileio import write_atomic
    write_atomic(path, json.dumps(report, indent=1))
