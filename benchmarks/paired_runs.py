"""A lever screened against its baseline over several development splits: each pair is two runs'
metrics.json (a fine-tune scored on the same images, e.g. the same finetune.split_seed), and the
figure is the mean over the pairs of the top-1 difference, with its standard error from each
pair's images (paired per image, `mpp.outcomes.paired_sem`; the splits' errors add in quadrature).
That error counts the images' sampling only: beside it the script prints the spread of the pairs'
differences (their standard deviation over the square root of their number, n - 1 degrees of
freedom), which also holds each run's training noise; read the larger. The levers of
docs/results.md are screened this way.

  python benchmarks/paired_runs.py runs/base_s0:runs/lever_s0 runs/base_s1:runs/lever_s1 ...

Prints each pair's top-1, start top-1 and final training accuracy, then the mean difference.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from mpp import outcomes
from mpp.cli import ArgumentParser, UsageError, one_line_errors


def scored(run: Path) -> tuple[dict, str, object]:
    """A run's metrics, the digest of the labels it was scored on and its per-image outcomes."""
    try:
        metrics = json.loads((run / "metrics.json").read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{run}: no readable metrics.json ({type(e).__name__}: {e}): give finished runs") from None
    read = outcomes.read(metrics.get("outcomes")) if isinstance(metrics, dict) else None
    if read is None:
        raise UsageError(f"{run}/metrics.json records no per-image outcomes: give runs of mpp's fine-tune tool")
    return metrics, *read


def pair(base: Path, lever: Path) -> tuple[float, float, str, str]:
    """(difference, its standard error, a line) of one pair, in points, and the digest of the
    images both were scored on."""
    (mb, db, ob), (ml, dl, ol) = scored(base), scored(lever)
    if db != dl:
        raise UsageError(f"{base} and {lever} were scored on other images (label digests {db}, {dl}): pair runs of "
                         "the same development split")
    diff, se = 100 * (ol.mean() - ob.mean()), 100 * outcomes.paired_sem(ol, ob)
    line = "  ".join(f"{o.mean() * 100:5.1f} (start {_points(m, 'start_top1')}, train {_points(m, 'acc')}%)"
                     for m, o in ((mb, ob), (ml, ol)))
    return diff, se, f"{base.name} -> {lever.name}: {line}  {diff:+.1f} ± {se:.1f}", db


def _points(metrics: dict, key: str) -> str:
    value = metrics.get(key)
    return f"{value * 100:4.1f}" if isinstance(value, (int, float)) else "  - "


@one_line_errors()
def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(__doc__)
    p.add_argument("pairs", nargs="+", metavar="BASE:LEVER", help="two run folders scored on the same images")
    a = p.parse_args(argv)
    split = [s.split(":") for s in a.pairs]
    if any(len(p) != 2 or not all(p) or p[0] == p[1] for p in split):
        raise UsageError("each pair is BASE:LEVER, two different run folders joined by one ':'")
    diffs, ses, seen = [], [], set()
    for base, lever in split:
        diff, se, line, images = pair(Path(base), Path(lever))
        if images in seen:
            raise UsageError(f"{base}: a second pair scored on the same images (the same split): the pairs' "
                             "errors add as independent ones only over other splits")
        seen.add(images)
        print(line)
        diffs.append(diff)
        ses.append(se)
    n, spread = len(diffs), outcomes.sem(diffs)  # the pairs' sd / sqrt(n); None for one pair
    said = "" if spread is None else f"; spread of the pairs ± {spread:.1f} ({n - 1} degrees of freedom)"
    print(f"mean over {n} pair(s): {sum(diffs) / n:+.1f} ± {math.hypot(*ses) / n:.1f} points (images){said}")


if __name__ == "__main__":
    main()
