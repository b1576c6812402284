"""Preemption: SIGTERM (a scheduler's preemption or time limit, torchrun passing it on) stops a run
with nothing lost, in one line (`Terminated`, exit 143), and the same command resumes it.

In the training steps (`Sigterm`, around mpp.train's loop) the run first saves the step it came in
as a checkpoint: on one process after that step (or, when it came while the process waited for
data, the step it reached: a stalled read would outlast a scheduler's grace period), on several at
the next log window, where the ranks agree on it, so that all save the same step (`terminated`
then stops it). Outside them (`stop_on_sigterm`: set-up, a start-up probe, the export, the final
evaluation) it stops at once, as Ctrl-C does: nothing done there is missing from the last
checkpoint.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import TYPE_CHECKING

import torch

from mpp.checkpoint import checkpoint_name
from mpp.data import shield_workers
from mpp.rundir import resume_command

if TYPE_CHECKING:  # annotations only: mpp.train imports this module
    from mpp.train import Run


class Terminated(RuntimeError):
    """SIGTERM: the run saved a checkpoint and stopped; the same command resumes it. `stalled`: it
    came while the run waited for data, whose reader may be stuck in the read."""

    def __init__(self, message: str, stalled: bool = False):
        super().__init__(message)
        self.stalled = stalled


class Sigterm:
    """While the loop runs (`with`), SIGTERM is noted instead of ending the process at once, and the
    data workers leave it to this process (`mpp.data.shield_workers`); `now` says whether to stop
    after this step: on one process as soon as one came, on several only at a log window (a point
    that waits for the device anyway) and when one came to any rank (one all-reduce there). A rank
    blocked in a collective with a dead one never gets there: torchrun's SIGKILL ends it 30 s
    after its SIGTERM. `waiting` marks a wait for data, which a SIGTERM ends at once."""

    def __init__(self):
        self.got, self.old, self.wait = False, None, False

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            self.old = signal.signal(signal.SIGTERM, self._note) or signal.SIG_DFL  # None: not set from Python
            shield_workers(True)
        return self

    def _note(self, signum, frame) -> None:
        self.got = True
        if self.wait:  # once: a second SIGTERM, during the save that follows, is only noted
            self.wait = False
            raise Preempted

    @contextlib.contextmanager
    def waiting(self, interruptible: bool):
        """Around the wait for a batch: with `interruptible` (one process) a SIGTERM there raises
        `Preempted` at once, as a stalled read would otherwise hold the run for up to data.timeout,
        past a scheduler's grace period, and its SIGKILL lose every step since the last checkpoint;
        so does one noted since the last step's check (in its log, checkpoint or evaluators)."""
        try:
            self.wait = interruptible  # set first: a SIGTERM from here on raises in `_note` or below
            if interruptible and self.got:
                self.wait = False
                raise Preempted(waited=False)
            yield
        finally:
            self.wait = False

    def __exit__(self, *exc) -> None:
        if self.old is not None:
            shield_workers(False)
            signal.signal(signal.SIGTERM, self.old)

    def now(self, accelerator, window: bool) -> bool:
        if accelerator.num_processes == 1:
            return self.got
        return window and accelerator.reduce(
            torch.full((), float(self.got), device=accelerator.device), "max").item() > 0


@contextlib.contextmanager
def stop_on_sigterm(again: str = "the same command"):
    """Outside the loop (set-up, a fine-tune's start-up probe, the export, the final evaluation)
    SIGTERM stops the run at once with one line (exit 143), as Ctrl-C does: nothing is done there
    that the last checkpoint lacks, and `again` (mpp.rundir.resume_command) does it again."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    def stop(signum, frame):
        raise Preempted  # not an Exception: no handler of a damaged file or shard may take it for one
    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    except Preempted:
        raise Terminated("SIGTERM outside the training steps (set-up, start-up probe, export or final evaluation): "
                         f"stopped, nothing lost; {again} resumes from the last checkpoint") from None
    finally:
        signal.signal(signal.SIGTERM, old or signal.SIG_DFL)


class Preempted(BaseException):
    """SIGTERM outside the loop or in a wait for data, raised where it lands, as Ctrl-C's
    KeyboardInterrupt is: an `except Exception` around a checkpoint's load or a shard's read would
    count it as their damage. `waited`: False where it was noted before the wait began."""

    def __init__(self, waited: bool = True):
        super().__init__()
        self.waited = waited


def terminated(run: Run, done: int, during: str = "") -> None:
    """Stop the run after the checkpoint of step `done` that a SIGTERM asked for (`during`: where
    it came, when not after a step). mpp.train closes the progress bar, loader and TensorBoard."""
    came = f"SIGTERM {during}:" if during else "SIGTERM:"
    if not done:
        raise Terminated(f"{came} stopped before the first step, nothing lost; run the same command again to start",
                         stalled=bool(during))
    raise Terminated(f"{came} stopped after step {done} of {run.steps} and saved its checkpoint "
                     f"({checkpoint_name(done)}); run {resume_command(run.cfg.train.resume)} to resume",
                     stalled=bool(during))
