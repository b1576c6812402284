"""Soak test (not a test of the suite): pre-train on generated shards for --minutes, kill -9 the
run at random moments and resume it, then report restarts, steps lost and peak memory over time.

  nice mpp-soak runs/soak --minutes 60 [key=value ...]     (report: runs/soak/soak.json)

The settings are checked before any run (they must checkpoint before a run's end, and resume with
train.resume=auto); the exit is 1 when a run failed: an error, an exit the soak did not cause (a
crash), a resume that skipped damaged checkpoints or began before the newest one, or a stall (runs
in a row without a step for two minutes in all; or none in the whole soak); and when runs restarted
after its kills but none resumed from a checkpoint (recovery untested). The report's `kills` are
the faults it injected; the run it stops at the end is `stopped_at_deadline`.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from mpp.cli import ArgumentParser, one_line_errors, path, seed

@one_line_errors()
def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(__doc__)
    p.add_argument("out", type=path, help="working directory (data/, run/, logs, soak.json)")
    p.add_argument("--minutes", type=float, default=60.0,
                   help="how long to soak, in wall-clock minutes (default 60); the run in progress is killed "
                        "at the end (not one of the report's kills), so the report covers exactly this time")
    p.add_argument("--kill-after", type=float, nargs=2, default=(15.0, 60.0), metavar=("MIN", "MAX"),
                   help="seconds before each kill -9, drawn uniformly (default 15 60)")
    p.add_argument("--seed", type=seed, default=0, help="seeds the kill times (default 0)")
    p.add_argument("overrides", nargs="*", default=[], metavar="key=value",  # default: optional when intermixed
                   help="pre-training settings (after the defaults)")
    a = p.parse_intermixed_args(argv)  # overrides after the options too, as in the usage above
    low, high = a.kill_after
    if not (math.isfinite(a.minutes) and a.minutes > 0 and math.isfinite(high) and 0 <= low <= high):
        p.error(f"--minutes must be a finite number > 0 and --kill-after MIN MAX finite with 0 <= MIN <= MAX, got "
                f"{a.minutes:g} and {low:g} {high:g}")
    from mpp.soak import SETTINGS, soak, verdict, write_report
    report = soak(Path(a.out), a.minutes * 60, (low, high), SETTINGS + a.overrides, seed=a.seed)
    write_report(report, Path(a.out) / "soak.json")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    if failure := verdict(report, Path(a.out)):  # the soak found a fault: its exit says so, not only soak.json
        raise SystemExit(f"error: {failure}")


if __name__ == "__main__":
    main()
