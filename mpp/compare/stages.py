"""A stage's process: forked from a server that imported the training code once (`run_stage`,
`_tool_main`), or started by the comparison's `launcher` (torchrun); it dies with the comparison,
gets the comparison's SIGTERM passed on so that its trainer saves a checkpoint
(`StageTerminated`), and on Ctrl-C is stopped in steps (`_stop`). Also what a stage's end tells
the comparison's lines: the signal that killed it (`killed`) and where its time went
(`time_split`, `seconds`). Kept apart from the plan and the checks: this part handles signals
and processes, they read configs and files.
"""
from __future__ import annotations

import contextlib
import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import runpy
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil

from mpp.cli import QUIET_INTERRUPT
from mpp.launcher import follow_parent

def _tool_main(module: str, argv: list[str]) -> None:
    """In a stage's process: run a tool module as `python -m module argv...` would, and die with the
    comparison (the process is the forkserver's child, so nothing else ends it when the comparison
    is killed: it trained on, orphaned, holding its run directory). Ctrl-C ends it quietly (exit 130,
    `QUIET_INTERRUPT`): the comparison's line names the stage and how to resume."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the forkserver's SIG_IGN (`start_server`) is not the stage's
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_die_with, args=(parent.sentinel,), daemon=True).start()
    sys.argv = [module, *argv]
    os.environ[QUIET_INTERRUPT] = "1"  # its Ctrl-C line would say less than the comparison's
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except KeyboardInterrupt:
        raise SystemExit(130) from None


def _die_with(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])  # ready when the comparison's process has ended
    os.kill(os.getpid(), signal.SIGKILL)  # checkpoints and metrics.json are written atomically


def start_server() -> None:
    """Start Python's forkserver, once, with the training and evaluation code to import; the
    comparison calls it before it plans, so that the server's seconds of imports overlap its own
    (the first stage waited for them). SIGTERM is ignored there (kept across its exec): a
    scheduler's SIGTERM to the whole process group ended it, the comparison then read the stage it
    had served as ended (exit 255), stopped, and took the stage down before its checkpoint. Each
    stage restores the default (`_tool_main`); the server still ends with the comparison (its pipe
    closes)."""
    multiprocessing.set_forkserver_preload(["mpp.train", "mpp.evaluators.linear_probe"])
    old = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGTERM, old)


def run_stage(cmd: list[str], launcher: str) -> int:
    """Run one stage's command in a process of its own; its exit code. Without a launcher the
    process is forked from a server that imported the training and evaluation code once (Python's
    forkserver), so a stage does not pay the seconds of importing torch, timm and accelerate again;
    the server runs no torch operation, so each stage still starts from a clean state. A SIGTERM to
    the comparison goes on to the stage, whose trainer saves a checkpoint and stops (`mpp.train`);
    the stage's end then raises `StageTerminated`."""
    if launcher:  # the launcher (torchrun) gets SIGTERM when the comparison dies, and stops its ranks
        with subprocess.Popen(cmd, preexec_fn=lambda: follow_parent(signal.SIGTERM),
                              env={**os.environ, QUIET_INTERRUPT: "1"}) as proc, \
                _passing_sigterm(proc) as passed:
            try:
                code = proc.wait()
            except BaseException:  # Ctrl-C: a terminal's reached the launcher too, a lone kill -INT did not
                _stop(proc)
                raise
    else:
        ctx = multiprocessing.get_context("forkserver")
        start_server()
        proc = ctx.Process(target=_tool_main, args=(cmd[2], cmd[3:]))  # cmd: python -m module ...
        proc.start()
        try:
            with _passing_sigterm(proc) as passed:
                proc.join()
        except KeyboardInterrupt:  # a terminal's Ctrl-C reached the stage too: it ends first, so its last
            proc.join(timeout=5)  # lines come first; a lone kill -INT did not: SIGTERM, and its trainer saves
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=STOP_GRACE_S)
            if proc.is_alive():
                proc.kill()
            raise
        code = proc.exitcode
    if passed:
        raise StageTerminated(code)
    return code


def killed(code: int) -> str:
    """What a stage's exit code says beyond its own output: a stage killed by a signal (a negative
    code) printed no cause, and its cut-off progress bar holds the line, which is ended here."""
    if code >= 0:
        return ""
    print(file=sys.stderr, flush=True)
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f" (killed by {name}{', as the out-of-memory killer does' if -code == signal.SIGKILL else ''})"


STOP_GRACE_S = 30.0  # from a stage's SIGTERM to its SIGKILL (`_stop`)


def _stop(launcher: subprocess.Popen, first: float = 5.0) -> None:
    """End a stage's launcher and its ranks: `first` seconds to end on its own (a terminal's
    Ctrl-C reached it too), then SIGTERM (torchrun and accelerate pass it on, and the trainers save
    a checkpoint), then, STOP_GRACE_S on, SIGKILL; a rank left behind (a launcher that does not
    pass it on, as accelerate's one-process launch before 1.x) gets the same, where a SIGKILL at
    once would leave it training on, orphaned. Another Ctrl-C meanwhile kills them at once."""
    try:
        ranks = psutil.Process(launcher.pid).children(recursive=True)
    except psutil.Error:  # it has ended already
        ranks = []
    print(f"stopping the stage's launcher and its ranks (up to {first + 2 * STOP_GRACE_S:.0f} s; "
          "Ctrl-C again kills them)",
          file=sys.stderr, flush=True)
    try:
        try:
            launcher.wait(timeout=first)
        except subprocess.TimeoutExpired:
            launcher.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                launcher.wait(timeout=STOP_GRACE_S)
        left = [r for r in ranks if r.is_running()]
        for rank in left:
            with contextlib.suppress(psutil.Error):
                rank.terminate()
        psutil.wait_procs(left, timeout=STOP_GRACE_S)
    except KeyboardInterrupt:
        pass
    for proc in ranks:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    launcher.kill()
    launcher.wait()


class StageTerminated(Exception):
    """The comparison got a SIGTERM, passed it on to its stage, and the stage ended (`code`: 143
    when its trainer saved a checkpoint, `mpp.train.Terminated`)."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


@contextlib.contextmanager
def _passing_sigterm(proc):
    """While the stage `proc` runs, a SIGTERM to the comparison is sent on to it (the comparison
    waits for it to end, instead of ending at once and taking it down before its checkpoint);
    yields a list that records each one passed on."""
    passed: list[int] = []
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield passed
        return

    def pass_on(signum, frame):
        passed.append(signum)
        if getattr(proc, "exitcode", None) is None:  # a forked stage's exit read first: its pid may be reused
            proc.terminate()  # SIGTERM (a Popen reads its own exit first)

    old = signal.signal(signal.SIGTERM, pass_on)
    try:
        yield passed
    finally:
        signal.signal(signal.SIGTERM, old or signal.SIG_DFL)


SPLIT = ("set-up", "begin", "training loop", "final evaluation", "export", "process start and exit")


def time_split(out: Path, took: float) -> list[float] | None:
    """A trained stage's `took` seconds split (SPLIT) as its process timed them in metrics.json:
    set-up (device, model, data), begin (the Task's work before the first step: a fine-tune's probe
    head, fitted or read from the cache, and its start's score), training loop, final evaluation,
    the rest of training (the export), and outside it the process's start and exit (what a stage
    pays for being a process of its own). None for a stage without those figures (a probe)."""
    try:
        m = json.loads((out / "metrics.json").read_text())
        parts = [m["setup_s"], m["begin_s"], m["loop_s"], m["final_eval_s"]]
        return [*parts, m["segment_s"] - sum(parts), took - m["segment_s"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def seconds(took: float, split: list[float] | None) -> str:
    """'3.5 s (set-up 0.4, begin 1.0, training loop 1.9, ... s)', or '3.5 s' without a split."""
    parts = "" if split is None else " (" + ", ".join(f"{n} {v:.1f}" for n, v in zip(SPLIT, split)) + " s)"
    return f"{took:.1f} s{parts}"

