"""mpp.preemption's Sigterm, the loop's SIGTERM handling, as units (the runs that save and resume
on it are in tests/test_train.py and tests/test_rundir.py)."""
from __future__ import annotations

import signal
import types

from mpp.data import stream
from mpp.preemption import Sigterm


def test_the_loops_handler_and_the_workers_shield_last_as_long_as_the_loop():
    """Inside the loop a SIGTERM is noted and the data workers leave it to the trainer; after it the
    handler is the one before, so a SIGTERM in the export or final evaluation stops the run at once
    instead of being noted by a loop that has ended."""
    before = signal.getsignal(signal.SIGTERM)
    with Sigterm() as sigterm:
        assert signal.getsignal(signal.SIGTERM) == sigterm._note and stream._SHIELD.value == 1
    assert signal.getsignal(signal.SIGTERM) is before and stream._SHIELD.value == 0


def test_one_process_stops_after_the_step_a_sigterm_came_in():
    """On one process there is no rank to agree with: the run stops after this step, not at the next
    log window (a scheduler's grace period may end before it)."""
    one = types.SimpleNamespace(num_processes=1)
    sigterm = Sigterm()
    assert sigterm.now(one, window=False) is False
    sigterm.got = True
    assert sigterm.now(one, window=False) is True
