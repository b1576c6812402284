"""The soak report's accounting of lost steps (the soak itself is not part of the suite)."""
from mpp.soak import count_lost


def run(resumed_at, reached):
    return {"resumed_at": resumed_at, "reached": reached}


def test_runs_killed_before_they_resumed_lose_nothing_and_hide_no_loss():
    # fresh run to 37 (checkpoint at 20); a run starved before it resumed; a run from 20 to 45;
    # one killed at the deadline before it resumed; the newest checkpoint on disk is 40
    runs = [run(0, 37), run(None, 0), run(20, 45), run(None, 0)]
    count_lost(runs, checkpointed=40)
    assert [r.get("lost") for r in runs] == [17, None, 5, None]


def test_a_run_that_resumed_but_trained_nothing_loses_nothing():
    runs = [run(0, 30), run(20, 0), run(20, 25)]
    count_lost(runs, checkpointed=20)
    assert [r["lost"] for r in runs] == [10, 0, 5]
