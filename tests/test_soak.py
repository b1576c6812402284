"""The soak report's accounting of lost steps and its command line (the soak itself is not part of
the suite)."""
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

import mpp.soak
from mpp.soak import count_lost
from mpp.tools.soak import main


def soak_record(resumed_at, reached):
    return {"resumed_at": resumed_at, "reached": reached}


def test_runs_killed_before_they_resumed_lose_nothing_and_hide_no_loss():
    # fresh run to 37 (checkpoint at 20); a run starved before it resumed; a run from 20 to 45;
    # one killed at the deadline before it resumed; the newest checkpoint on disk is 40
    runs = [soak_record(0, 37), soak_record(None, 0), soak_record(20, 45), soak_record(None, 0)]
    count_lost(runs, checkpointed=40)
    assert [r.get("lost") for r in runs] == [17, None, 5, None]


def test_a_run_that_resumed_but_trained_nothing_loses_nothing():
    runs = [soak_record(0, 30), soak_record(20, 0), soak_record(20, 25)]
    count_lost(runs, checkpointed=20)
    assert [r["lost"] for r in runs] == [10, 0, 5]


def test_a_resume_and_the_newest_checkpoint_are_read_whatever_the_folder_names(tmp_path):
    """A run folder whose path holds a space hid every resume (all steps counted lost), and a
    user's copy 'step_0000004.bak' beside the checkpoints stopped the report."""
    log = "mpp run:  0%|\nresumed from /data/my runs/run/checkpoints/step_0000020 (step 20)\nmpp run: 25%|"
    assert mpp.soak.RESUMED.search(log).group(1) == "20"
    for name in ("step_0000004", "step_0000008", "step_0000004.bak"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    assert mpp.soak._newest_checkpoint(tmp_path) == 8


def test_overrides_follow_the_options_and_are_checked_before_anything_is_written(tmp_path, monkeypatch, capsys):
    """The documented `mpp-soak OUT --minutes M key=value` parses; a bad key stops it in one line
    (exit 2) before any data or run, instead of failing every run until the time is up."""
    seen = []
    monkeypatch.setattr(mpp.soak, "soak", lambda out, seconds, kill_after, settings, seed: seen.append(settings)
                        or {"failed_runs": 0, "runs": []})
    main([str(tmp_path), "--minutes", "0.01", "batch_size=16"])
    assert seen[0][-1] == "batch_size=16"
    assert json.loads((tmp_path / "soak.json").read_text()) == {"failed_runs": 0, "runs": []}  # the whole report
    with pytest.raises(SystemExit) as e:  # a kill at once, before any run could start, is no soak
        main([str(tmp_path / "b"), "--kill-after", "-1", "5"])
    assert e.value.code == 2 and "0 <= MIN <= MAX, got 60 and -1 5" in capsys.readouterr().err
    monkeypatch.undo()
    for bad, said in (("stepz=3", "unknown config key 'stepz'"),  # and what a run checks at its start:
                      ("train.grad_accum=5", "batch_size=32 is not divisible"),  # every run failed on it
                      ("objective=classify", "is not what this tool trains"),
                      # the soak read another folder's checkpoints than its runs wrote
                      (f"output_dir={tmp_path / 'else'}", "output_dir: the soak's own"),
                      ("data={train: x}", "data.train: the soak's own"),
                      # every restart began at step 0: the soak passed, recovery never tested
                      ("train.ckpt_every=0", "train.ckpt_every=0 saves no checkpoint before the run's end"),
                      ("train.ckpt_every=1000000", "not below steps=1000000, saves no checkpoint"),
                      ("train.resume=none", "train.resume=none: the soak tests resuming")):
        with pytest.raises(SystemExit) as e:
            main([str(tmp_path / "b"), bad, "--minutes", "0.01"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and said in err, err
        assert not (tmp_path / "b").exists()


def test_the_tool_gives_the_soak_seconds_kill_times_and_seed(tmp_path, monkeypatch):
    """--minutes becomes seconds, --kill-after (default 15 60; a MIN of 0 is taken) and --seed reach
    the soak."""
    seen = []
    monkeypatch.setattr(mpp.soak, "soak", lambda out, seconds, kill_after, settings, seed: seen.append(
        (seconds, kill_after, seed)) or {"failed_runs": 0, "runs": []})
    main([str(tmp_path), "--minutes", "0.01"])
    main([str(tmp_path), "--minutes", "0.01", "--seed", "7", "--kill-after", "0", "5"])
    assert seen == [(pytest.approx(0.6), (15.0, 60.0), 0), (pytest.approx(0.6), (0.0, 5.0), 7)]


def test_a_failed_run_fails_the_soak(tmp_path, monkeypatch):
    """A run that ended in an error makes the soak exit 1 with one line naming it and its log."""
    runs = [{"problems": []}, {"problems": ["error: the disk is full"]}, {"problems": ["error: later"]}]
    monkeypatch.setattr(mpp.soak, "soak", lambda *a, **k: {"failed_runs": 2, "runs": runs})
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path), "--minutes", "0.01"])
    assert e.value.code == f"error: 2 of 3 soak runs failed; the first, run1: error: the disk is full " \
                          f"(see {tmp_path / 'run1.log'})"


def test_a_crash_a_skipped_checkpoint_or_a_stall_is_a_failed_run():
    """Only error lines failed a run: a SIGSEGV or the kernel's OOM kill (no line), a resume that
    skipped a checkpoint a kill broke, and a run that hung until killed all passed as kills."""
    from mpp.soak import problems
    run = dict(killed=True, exit=-9, seconds=30.0, newest_at_start=20, resumed_at=20, reached=35)
    assert problems(run, "resumed from x (step 20)\n") == []  # a kill the soak made
    assert problems({**run, "killed": False, "exit": -11}, "") == ["exited -11 without being killed"]
    assert problems({**run, "killed": False, "exit": 0}, "") == []  # a run that finished
    skipped = "warning: resume skipped checkpoints that do not load (and step_* entries that are none): step_40 (x)"
    assert problems(run, skipped + "\n") == [skipped]
    assert problems({**run, "killed": False, "exit": 1}, "error: bad\n") == ["error: bad"]  # said once
    assert problems(run, "Traceback (most recent call last):\n  File x\n") == ["Traceback (most recent call last):"]
    # a resume that deadlocks, killed each time after 13-49 s: no run alone reaches a minute
    stuck = [dict(run, seconds=t, reached=20, problems=[]) for t in (49.3, 34.2, 13.1, 40.0, 30.0)]
    starved = dict(run, seconds=25.0, resumed_at=None, reached=0, problems=[])  # killed before it began
    runs = [dict(run, problems=[]), starved, dict(run, problems=[]), *stuck]
    mpp.soak.mark_stalls(runs)
    assert [r["problems"] for r in runs] == [[], [], [], [], [], [], ["no step in 137 s over 4 run(s) in a row: stalled"],
                                             []]
    edge = [dict(run, seconds=60.0, reached=20, problems=[]) for _ in range(2)]  # STALL_S to the second
    mpp.soak.mark_stalls(edge)
    assert [r["problems"] for r in edge] == [[], ["no step in 120 s over 2 run(s) in a row: stalled"]]


def test_a_run_that_began_before_the_newest_checkpoint_is_a_failed_run():
    """Only a resume that warned of skipped checkpoints failed a run: one that passed over the
    newest checkpoint silently, or began afresh beside it, counted its redone steps as lost."""
    from mpp.soak import problems
    run = dict(killed=True, exit=-9, seconds=30.0, newest_at_start=40, resumed_at=20, reached=45)
    said = "the newest checkpoint on disk when it started: it trained saved steps again"
    assert problems(run, "resumed from x (step 20)\n") == [f"began at step 20, not at step 40, {said}"]
    assert problems({**run, "resumed_at": 0}, "") == [f"began at step 0, not at step 40, {said}"]
    assert problems({**run, "resumed_at": 40}, "resumed from x (step 40)\n") == []
    assert problems({**run, "resumed_at": None, "reached": 0}, "") == []  # killed before it began


def test_restarts_that_never_resumed_fail_the_soak(tmp_path, monkeypatch):
    """Kills before the first checkpoint (a short --kill-after, a large train.ckpt_every) restarted
    every run at step 0: the soak passed, with 0 failed runs, having tested no recovery."""
    def record(killed, resumed_at):
        return {"killed": killed, "resumed_at": resumed_at, "problems": []}
    never = [record(True, 0), record(True, 0), record(True, None), record(True, 0)]  # the last: at the deadline
    monkeypatch.setattr(mpp.soak, "soak", lambda *a, **k: {"failed_runs": 0, "runs": never})
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path), "--minutes", "0.01"])
    assert e.value.code == ("error: 3 soak run(s) restarted after a kill, but none resumed from a checkpoint (each "
                            "began at step 0, or was killed before it resumed), so recovery went untested; give "
                            "--kill-after a MIN longer than a run takes to its first checkpoint, or a smaller "
                            "train.ckpt_every")
    once = [record(True, 0), record(True, None), record(True, 20), record(True, None)]
    alone = [record(True, 0)]  # a soak shorter than one kill: stopped at its deadline, nothing to resume
    assert mpp.soak.verdict({"runs": once}, tmp_path) is None and mpp.soak.verdict({"runs": alone}, tmp_path) is None
    finished = [record(False, 0), record(True, 0)]  # a run the soak did not kill: the next is no restart after a kill
    assert mpp.soak.verdict({"runs": finished}, tmp_path) is None


def _fake_soak(tmp_path, monkeypatch, scripts: list[str], seconds: float, kill_after: tuple) -> tuple[dict, list]:
    """`mpp.soak.soak` with each run a stand-in (`python -c` of the next script) and a clock that
    moves only in the soak's sleeps; the first start saves a checkpoint of step 20. The report, the
    stand-ins, and the process tree's memory the soak sampled: 10 MiB per second of the clock."""
    (tmp_path / "data/train").mkdir(parents=True)
    (tmp_path / "data/train/manifest.json").write_text("{}")  # the soak makes no data
    started = []

    def popen(cmd, **kw):  # a stand-in run; the soak's clock starts once it printed its log or ended
        started.append(subprocess.Popen([sys.executable, "-c", scripts[len(started)]], **kw))
        while not Path(kw["stdout"].name).read_text() and not os.waitid(  # ended: left for the soak to reap
                os.P_PID, started[-1].pid, os.WEXITED | os.WNOHANG | os.WNOWAIT):
            time.sleep(0.01)
        (tmp_path / "run/checkpoints/step_0000020").mkdir(parents=True, exist_ok=True)  # the first one's save
        return started[-1]
    clock = [0.0]
    monkeypatch.setattr(mpp.soak, "subprocess", types.SimpleNamespace(Popen=popen, STDOUT=subprocess.STDOUT))
    monkeypatch.setattr(mpp.soak, "time", types.SimpleNamespace(time=lambda: clock[0],
                                                                sleep=lambda s: clock.__setitem__(0, clock[0] + s)))
    monkeypatch.setattr(mpp.soak, "_tree_rss", lambda ps: int(clock[0] * 10 * 2**20))
    return mpp.soak.soak(tmp_path, seconds, kill_after, mpp.soak.SETTINGS), started


def _waits(log: str) -> str:
    """A stand-in run that prints `log`, then waits to be killed."""
    return f"import time; print({log!r}, flush=True); time.sleep(60)"


def test_the_report_counts_injected_kills_apart_from_the_deadline_stop(tmp_path, monkeypatch):
    """The kill at the soak's end counted as one of its kills, though no run recovered from it; and
    each run's record holds the newest checkpoint on disk before it started, the one it must resume.
    Each run is killed (kill -9) at its drawn time, the last at the soak's end; the steps lost are
    those past the checkpoint the next run resumed from, and the peak memory is per window."""
    logs = [" 10/1000000 [\r 25/1000000 [", "resumed from x (step 20)\n 31/1000000 [",
            "resumed from x (step 20)\n 22/1000000 ["]
    before = signal.getsignal(signal.SIGTERM)
    report, started = _fake_soak(tmp_path, monkeypatch, [_waits(log) for log in logs], 10, (4, 4))  # kills at 4, 8 s
    assert [p.returncode for p in started] == [-signal.SIGKILL] * 3  # each run killed, none left to end on its own
    assert signal.getsignal(signal.SIGTERM) is before  # the soak's handler is its own while it runs
    assert {k: report[k] for k in ("seconds", "restarts", "kills", "stopped_at_deadline", "resumes", "failed_runs",
                                   "final_step", "steps_lost", "peak_rss_mib_per_window")} == \
        {"seconds": 10, "restarts": 2, "kills": 2, "stopped_at_deadline": True, "resumes": 2, "failed_runs": 0,
         "final_step": 31, "steps_lost": (25 - 20) + (31 - 20) + (22 - 20), "peak_rss_mib_per_window": {"0s": 95}}
    assert [(r["seconds"], r["at_deadline"], r["newest_at_start"], r["resumed_at"], r["reached"])
            for r in report["runs"]] == [(4.0, False, 0, 0, 25), (4.0, False, 20, 20, 31), (2.0, True, 20, 20, 22)]
    assert mpp.soak.verdict(report, tmp_path) is None


def test_runs_that_fail_or_stall_fail_the_soak(tmp_path, monkeypatch):
    """A run's error line and a run that ended of itself (a crash) are failed runs in the report; a
    crash is not waited on until its kill time. Runs that train no step for STALL_S in all, or a
    soak in which none trained, fail it too."""
    resumes = [_waits(f"resumed from x (step 20)\n {n}/1000000 [") for n in (30, 31)]
    report, _ = _fake_soak(tmp_path, monkeypatch, [_waits("error: the disk is full"), "import sys; sys.exit(1)",
                                                   *resumes], 10, (4, 4))
    assert [(r["seconds"], r["killed"], r["problems"]) for r in report["runs"]] == [
        (4.0, True, ["error: the disk is full"]), (0.0, False, ["exited 1 without being killed"]), (4.0, True, []),
        (2.0, True, [])]
    assert report["failed_runs"] == 2
    assert mpp.soak.verdict(report, tmp_path).startswith("2 of 4 soak runs failed; the first, run0: error: the disk")


@pytest.mark.parametrize("seconds, problem", [(130, "no step in 130 s over 3 run(s) in a row: stalled"),
                                              (10, "no run trained a step in 10 s")])
def test_runs_that_train_no_step_fail_the_soak(tmp_path, monkeypatch, seconds, problem):
    """Runs killed at 50 s each that never print a step (a hang, a deadlocked resume) are a stall
    once they add up to STALL_S; a soak shorter than that in which no run trained fails as well."""
    report, _ = _fake_soak(tmp_path, monkeypatch, [_waits("starting")] * 3, seconds, (50, 50))
    assert [r["problems"] for r in report["runs"]][-1] == [problem] and report["failed_runs"] == 1


def test_the_memory_sampled_is_the_whole_process_tree(tmp_path):
    """The soak's peak memory is the run's and its data workers': a worker's growth is a leak too."""
    from mpp.soak import _tree_rss
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; b = b'x' * (200 << 20); print(1, flush=True); "
                              "time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()  # its 200 MiB are written
        import psutil
        me = psutil.Process()
        assert _tree_rss(me) - me.memory_info().rss > 150 * 2**20
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_a_stopped_soak_takes_its_run_with_it(tmp_path, monkeypatch, stop):
    """Ctrl-C or SIGTERM to the soak kills the run it started (in a session of its own, so the
    terminal's signal does not reach it) instead of leaving it to train on, holding its directory's
    lock (a SIGTERM left it: no `finally` ran); the run is also asked to die with the soak (kill -9)."""
    import signal
    import subprocess
    import sys
    import time
    import types

    import psutil
    (tmp_path / "data/train").mkdir(parents=True)
    (tmp_path / "data/train/manifest.json").write_text("{}")  # the soak makes no data
    started = []

    def popen(cmd, **kw):  # a stand-in for the run, started the soak's way
        assert kw["preexec_fn"] is mpp.soak.follow_parent
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], **kw))
        return started[-1]

    def interrupt(_):
        if stop == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        raise KeyboardInterrupt
    monkeypatch.setattr(mpp.soak, "subprocess", types.SimpleNamespace(Popen=popen, STDOUT=subprocess.STDOUT))
    monkeypatch.setattr(mpp.soak, "time", types.SimpleNamespace(time=time.time, sleep=interrupt))
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit if stop == "sigterm" else KeyboardInterrupt) as e:
        mpp.soak.soak(tmp_path, 60, (30, 40), mpp.soak.SETTINGS)
    assert stop != "sigterm" or e.value.code == 143
    assert started and started[0].poll() is not None and not psutil.pid_exists(started[0].pid)
    assert signal.getsignal(signal.SIGTERM) is before  # the soak's handler is its own while it runs
