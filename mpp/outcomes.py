"""Which test images a model got right, kept in `metrics.json` so that the gap report can measure
the test set's own noise: two encoders scored on the same 1,000 or 10,000 images differ by
sampling as well as by what they learned, and seeds alone do not show it (every seed sees the
same images). `record` packs the outcomes (a bit per image, base64) with a hash of the labels in
the order they were scored; the report pairs two runs' outcomes only when those hashes match.
Plain JSON, nothing executable: a metrics file from elsewhere is data.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import math
from statistics import NormalDist

import numpy as np


def labels_digest(labels) -> str:
    """sha256 (16 hex digits) of the labels in scoring order: two runs with equal digests scored
    the same images in the same order (the loader's order is deterministic for a given data spec
    and world size)."""
    return hashlib.sha256(np.asarray(labels, dtype=np.int64).tobytes()).hexdigest()[:16]


def record(correct, labels) -> dict:
    """{"n", "labels", "correct"} of a run's final evaluation: the count, the labels' digest and
    one bit per image (1: top-1 right) in scoring order."""
    correct = np.asarray(correct, dtype=bool)
    if correct.shape != np.shape(labels) or correct.ndim != 1:
        raise ValueError(f"outcomes: {correct.shape} predictions for labels of shape {np.shape(labels)}")
    return {"n": int(correct.size), "labels": labels_digest(labels),
            "correct": base64.b64encode(np.packbits(correct).tobytes()).decode("ascii")}


def read(entry) -> tuple[str, np.ndarray] | None:
    """(labels digest, bool array) of a `record` entry; None when it is absent or malformed
    (the report then shows no test noise for that run rather than a wrong one)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("n"), int) or entry["n"] < 1:
        return None
    try:
        bits = np.unpackbits(np.frombuffer(base64.b64decode(entry["correct"], validate=True), np.uint8))
    except (KeyError, TypeError, ValueError, binascii.Error):
        return None
    if len(bits) != (entry["n"] + 7) // 8 * 8 or not isinstance(entry.get("labels"), str):
        return None
    return entry["labels"], bits[: entry["n"]].astype(bool)


def paired_sem(a: np.ndarray, b: np.ndarray) -> float:
    """Standard error, as a fraction, of mean(a) - mean(b) from the test images' sampling: a and b
    are per-image scores (0/1, or a mean over seeds) of two models on the same images in the
    same order; the images are the sampled unit, so the difference is paired."""
    return sem(np.asarray(a, np.float64) - np.asarray(b, np.float64)) or 0.0


def sem(a: np.ndarray) -> float | None:
    """Standard error, as a fraction, of mean(a) over the sampled images; None under 2 images."""
    a = np.asarray(a, np.float64)
    return float(a.std(ddof=1) / np.sqrt(a.size)) if a.size > 1 else None


def seed_image_overlap(per_seed) -> float:
    """The variance, as a fraction squared, that a mean over n seeds and N images owes to the
    seed-by-image interaction (an image's score moving with the seed beyond the seed's overall
    level), s2 / (n N). A gap's two noise parts both hold it: the seeds' spread (the spread of
    seed means holds s2 / N) and each image's mean over seeds (s2 / n), so the report takes it
    out of the images' part once. Estimated from per-seed scores (seeds x images): the mean
    within-image variance over seeds estimates seed variance + s2, the variance of the seed means
    seed variance + s2 / N. 0 under two seeds or two images."""
    x = np.asarray(per_seed, np.float64)
    n, images = x.shape
    if n < 2 or images < 2:
        return 0.0
    within, between = x.var(axis=0, ddof=1).mean(), x.mean(axis=1).var(ddof=1)
    return max(0.0, float(within - between) * images / (images - 1)) / (n * images)


def unpaired_sem(a: np.ndarray, b: np.ndarray) -> float:
    """Standard error, as a fraction, of mean(a) - mean(b) when a and b were scored on other
    images (or the same in another order, which this overstates): two independent samples."""
    sa, sb = sem(a), sem(b)
    return 0.0 if sa is None or sb is None else math.hypot(sa, sb)


def combine(*parts: tuple[float, float]) -> tuple[float, float]:
    """(standard error, degrees of freedom) of a sum of independent estimates from each one's
    (standard error, degrees of freedom): the errors add in quadrature, the degrees of freedom by
    Welch-Satterthwaite, so a part estimated from two seeds weighs as the one-degree estimate it is."""
    se = math.sqrt(sum(s * s for s, _ in parts))
    spread = sum(s ** 4 / d for s, d in parts if s > 0 and math.isfinite(d))
    return se, (math.inf if spread == 0 else max(1.0, se ** 4 / spread))


def critical(dof: float, level: float = 0.95) -> float:
    """Two-sided quantile of Student's t at `level` for `dof` degrees of freedom (a Welch
    combination's are fractional; under 1 counts as 1): 12.71 for one, 2.78 for four, 1.96 for
    many. With t = sqrt(dof) tan(a), the density in a is proportional to cos(a)^(dof - 1), smooth
    and bounded on [0, pi/2) however heavy the tail: Simpson's rule integrates it and Newton's
    method finds the quantile (no scipy dependency). The mass is concave in a (v >= 1), so Newton
    from the normal quantile, which lies below, climbs to it without overshooting; a bracket
    catches a step that leaves it all the same."""
    if math.isnan(dof) or not 0 < level < 1:
        raise ValueError(f"critical: dof={dof}, level={level}; need a number of degrees and 0 < level < 1")
    z = NormalDist().inv_cdf(0.5 + level / 2)
    if dof > 1e5:
        return z
    v = max(dof, 1.0)
    norm = math.exp(math.lgamma((v + 1) / 2) - math.lgamma(v / 2)) / math.sqrt(math.pi)

    def mass(a: float) -> float:  # P(0 <= T <= sqrt(v) tan(a))
        x = np.linspace(0.0, a, 2001)
        y = norm * np.cos(x) ** (v - 1)
        return float((x[1] - x[0]) / 3 * (y[0] + y[-1] + 4 * y[1:-1:2].sum() + 2 * y[2:-1:2].sum()))

    lo, hi, a = 0.0, math.pi / 2, math.atan(z / math.sqrt(v))
    for _ in range(60):
        miss = mass(a) - level / 2
        lo, hi = (a, hi) if miss < 0 else (lo, a)
        density = norm * math.cos(a) ** (v - 1)
        after = a - miss / density if density > 0 else math.nan  # no slope (far out in a heavy tail)
        after = after if lo < after < hi else (lo + hi) / 2  # outside the bracket: bisect instead
        if abs(after - a) <= 1e-15:
            break
        a = after
    return math.sqrt(v) * math.tan(a)
