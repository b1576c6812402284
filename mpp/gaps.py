"""The arithmetic of the gap report (mpp.report): each gap between two arms in points, its
standard error and whether it is beyond it, the share of the supervised gain that MPP recovers,
what a fine-tune added to its start, each gap over repeated pre-trainings, and a choice's lead on
the development images it was made on (`choice_lead`, which mpp.compare reads too to decide its
runner-up stages). Numbers in, numbers out: the report reads the runs and renders the tables.

A gap's noise is the standard error of the difference, from two sources combined: the seeds (fine-
tunes: sqrt(s_a^2/n_a + s_b^2/n_b); few-shot: the shot draws, paired draw by draw where both arms
drew the same shots; a probe's fit has none) and the test images' sampling (mpp.outcomes: the per-
image difference of the two arms, paired over the same images, each arm averaged over its seeds or
draws; unpaired where the two scored other images), less the run-by-image variance both parts hold
(`outcomes.seed_image_overlap`, of each arm's runs, or of the paired difference where the few-shot
draws pair). A gap under t times its noise is marked not significant, t being Student's two-sided
95% quantile at the Welch-Satterthwaite degrees of freedom of those parts (`outcomes.critical`):
1.96 where thousands of test images dominate the noise, up to 12.7 where one pair of seeds does. One
whose seed noise is unknown (single fine-tunes) has unknown noise; one whose arms did not both
record their per-image results gets the seeds' part alone (`noise_test` None; its `t` that part's)
and no verdict: its test images' part is unknown, and seeds that tie would make any gap look certain.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from mpp import outcomes

GAPS = {"supervised_minus_mpp": ("supervised", "mpp"), "mpp_minus_scratch": ("mpp", "scratch"),
        "supervised_minus_scratch": ("supervised", "scratch")}


def derive(supervised: float | None, mpp: float | None, scratch: float | None, sem: dict | None = None,
           per_run: dict | None = None, draws: dict | None = None, dof: dict | None = None) -> dict:
    """Gaps in percentage points and the share of the supervised gain that MPP recovers,
    (MPP - scratch) / (supervised - scratch); the share is None (with a note) when undefined, and
    its ± None (with a note) where supervised - scratch is within its noise (the ratio is unbounded)
    or an arm's noise is unknown.
    With `sem` (family -> standard error of its figure over seeds, None when unknown) each gap
    gets its noise in points (`noise`), the multiple of it a significant gap reaches (`t`, from the
    degrees of freedom of its parts: `dof`, family -> those of its `sem`, many where absent; the
    gap's own go to `dof`, None for many or where the noise is unknown) and
    whether the gap reaches it (`significant`, None: unknown); `per_run` (family -> (labels
    digest, per-image scores on the test images of each run or draw: runs x images, 1 x images
    for a probe)) adds the test images' sampling error of the runs' mean (`noise_test`): paired
    where two families scored the same images in the same order, else as two independent
    samples, less the seed-by-image variance that the seeds' part holds too (`_overlap`).
    `draws` (family -> (digest of what was drawn, each draw's figure)) makes the seed part paired
    where two families' digests and draw counts match: the few-shot draws, which use the same
    shots in every arm."""
    out: dict = {}
    acc = {"supervised": supervised, "mpp": mpp, "scratch": scratch}
    sem, draws, dof, per_run = sem or {}, draws or {}, dof or {}, per_run or {}
    per_image = _mean_images(per_run)
    out["noise"], out["noise_test"], out["t"], out["dof"], out["significant"] = {}, {}, {}, {}, {}
    for gap, (a, b) in GAPS.items():
        out[gap] = None if acc[a] is None or acc[b] is None else round(100.0 * (acc[a] - acc[b]), 4)
        test, same = None, False
        if out[gap] is not None and per_image.get(a) and per_image.get(b):
            same = per_image[a][0] == per_image[b][0]
            test = 100.0 * (outcomes.paired_sem if same else outcomes.unpaired_sem)(per_image[a][1], per_image[b][1])
        noise = t = df = None
        if out[gap] is not None and sem.get(a) is not None and sem.get(b) is not None:
            paired = _paired_draws(draws, a, b)
            seeds = ([(100.0 * sem[f], dof.get(f, math.inf)) for f in (a, b)] if paired is None
                     else [(100.0 * outcomes.paired_sem(*paired), len(paired[0]) - 1)])
            if test:  # the seed-by-image variance both parts hold, counted once
                both = _overlap(per_run, {a: 1.0, b: -1.0}, paired is not None and same, sem,
                                None if paired is None else outcomes.paired_sem(*paired))
                test = math.sqrt(max(0.0, test ** 2 - 1e4 * both))
            # degrees of freedom of the test part: the smaller test set's (the same images: one set)
            images = min(len(per_image[a][1]), len(per_image[b][1])) if test else 0
            noise, df = outcomes.combine(*seeds, (test, images - 1) if test else (0.0, math.inf))
            noise, t = round(noise, 4), round(outcomes.critical(df), 4)
        out["noise"][gap], out["noise_test"][gap] = noise, None if test is None else round(test, 4)
        out["t"][gap], out["dof"][gap] = t, None if df is None or math.isinf(df) else round(df, 4)
        out["significant"][gap] = None if noise is None or test is None else significant(out[gap], noise, t)
    out["recovered_share"] = out["share_noise"] = None
    gain = out["supervised_minus_scratch"]
    if gain is None or out["mpp_minus_scratch"] is None:
        out["note"] = "needs supervised, MPP and scratch results"
    elif gain <= 0:
        out["note"] = (f"undefined: supervised pre-training does not beat scratch "
                       f"(supervised - scratch = {gain:+.2f} pp), so there is no gain to recover")
    else:
        out["recovered_share"] = round(out["mpp_minus_scratch"] / gain, 4)
        noise, t = out["noise"]["supervised_minus_scratch"], out["t"]["supervised_minus_scratch"]
        if noise is not None and not significant(gain, noise, t):  # a ratio over a gain that could be 0
            out["note"] = (f"no ±: supervised - scratch ({gain:+.2f} ± {noise:.2f} pp"
                           + (", seeds only" if out["noise_test"]["supervised_minus_scratch"] is None else "")
                           + ") is within its noise, so the share could be any size")
        else:
            out["share_noise"] = _share_noise(acc, sem, per_run, per_image, draws)
            out["share_noise_seeds_only"] = out["share_noise"] is not None and not all(
                per_image.get(f) for f in acc)
            if out["share_noise"] is None:  # an arm's noise is unknown (single fine-tunes)
                whose = "supervised - scratch, the share's denominator," if noise is None else "an arm's figure"
                out["note"] = f"no ±: the noise of {whose} is unknown, so the share's is too"
    return out


def _mean_images(per_run: dict) -> dict:
    """family -> (labels digest, each test image's score averaged over the runs) of `per_run`."""
    return {f: (v[0], np.asarray(v[1], np.float64).mean(0)) for f, v in per_run.items() if v}


def _paired_draws(draws: dict, *families: str) -> list[np.ndarray] | None:
    """The families' per-draw figures when all drew the same (equal digests and counts, >= 2)."""
    got = [draws.get(f) for f in families]
    if not all(got) or len({(d, len(v)) for d, v in got}) > 1 or len(got[0][1]) < 2:
        return None
    return [np.asarray(v, np.float64) for _, v in got]


def _overlap(per_run: dict, weights: dict, paired: bool, sem: dict, paired_sem: float | None) -> float:
    """The seed-by-image variance (`outcomes.seed_image_overlap`) of a weighted sum of families'
    figures: of the weighted sum of their per-run scores where the runs pair (the same draws of
    shots, scored on the same images), else the weighted sum of each family's own. 0 where a
    family has no per-run scores (`derive`'s `per_run`). Each is capped at what the seeds' part
    holds (a family's `sem` squared; where the draws pair, `paired_sem` squared, the part `derive`
    uses then): the estimate can exceed it, and an arm whose seeds tied holds none of it; taking
    out more made a null gap's noise too small to give its t the seeds' degrees of freedom."""
    runs = [per_run.get(f) for f in weights]
    if not all(runs):
        return 0.0
    runs = [x for _, x in runs]
    if not paired:  # each family's own; under draws that pair, no more than their paired part holds in all
        own = sum(w * w * min(outcomes.seed_image_overlap(x), sem[f] ** 2) for (f, w), x in zip(weights.items(), runs))
        return own if paired_sem is None else min(own, paired_sem ** 2)
    if len({x.shape for x in runs}) > 1:
        return 0.0
    return min(outcomes.seed_image_overlap(sum(w * x for w, x in zip(weights.values(), runs))), paired_sem ** 2)


def _share_noise(acc: dict, sem: dict, per_run: dict, per_image: dict, draws: dict) -> float | None:
    """Standard error of the share R = (m - s) / (u - s) (u, m, s: supervised, MPP, scratch), to
    first order (the delta method), from the influence of each unit on R, ((m_i - s_i) - R (u_i -
    s_i)) / (u - s), where a unit is shared by all three arms (a test image, a draw of shots), else
    from each arm's own standard error: the seeds' part, and the test images' part where all three
    arms recorded their per-image results (arms that scored the same images paired image by image,
    the groups of other images independent) (`per_image`: `_mean_images` of `per_run`; less the
    seed-by-image variance the seeds' part holds too, as in `derive`; the seeds' part alone where
    an arm recorded none: `derive` then sets `share_noise_seeds_only`). None when an arm's seed
    noise is unknown."""
    if any(sem.get(f) is None for f in acc):
        return None
    u, m, s = acc["supervised"], acc["mpp"], acc["scratch"]
    gain, share = u - s, (m - s) / (u - s)
    weights = {"mpp": 1 / gain, "supervised": -share / gain, "scratch": (share - 1) / gain}  # dR / d(arm's mean)
    paired = _paired_draws(draws, *weights)
    if paired is None:
        seeds = math.hypot(*(w * sem[f] for f, w in weights.items()))
    else:
        seeds = outcomes.sem(sum(w * d for w, d in zip(weights.values(), paired))) or 0.0
    test = 0.0
    images = [per_image.get(f) for f in weights]
    if all(images):
        groups: dict[str, list] = {}  # arms scored on the same images pair image by image; groups are independent
        for w, (digest, x) in zip(weights.values(), images):  # x: float64 means (`_mean_images`)
            groups.setdefault(digest, []).append(w * x)
        test = math.hypot(*((outcomes.sem(sum(parts)) or 0.0) for parts in groups.values()))
        same = len(groups) == 1
        test = math.sqrt(max(0.0, test ** 2 - _overlap(per_run, weights, paired is not None and same, sem,
                                                       None if paired is None else seeds)))
    return round(math.hypot(seeds, test), 4)


def added_noise(ends: list, starts: list, end_outcomes: list, start_outcomes: list) -> tuple[float, float] | None:
    """Standard error in points of what a cell's fine-tunes added to their start, mean(end) -
    mean(start), and the t its significance needs (as `derive`'s): the spread of the per-seed
    gains and, where start and end were scored image by image on the same images (`outcomes.read`
    of each seed's), the test images' paired sampling, less the seed-by-image variance of the
    gains that the spread holds too; the spread's part alone and t None (no verdict) where they
    were not (the test images' part unknown). None for a single seed."""
    sd = mean_std([e - s for e, s in zip(ends, starts)])[1]
    if sd is None:
        return None
    end, start = runs_images(end_outcomes), runs_images(start_outcomes)
    if not (end and start and end[0] == start[0]):
        return round(100.0 * sd / math.sqrt(len(ends)), 4), None
    gains = end[1] - start[1]  # seeds x images
    held = min(outcomes.seed_image_overlap(gains), (sd / math.sqrt(len(ends))) ** 2)  # no more than the spread holds
    paired = math.sqrt(max(0.0, (outcomes.sem(gains.mean(0)) or 0.0) ** 2 - held))
    noise, df = outcomes.combine((100.0 * sd / math.sqrt(len(ends)), len(ends) - 1),
                                 (100.0 * paired, gains.shape[1] - 1))
    return round(noise, 4), round(outcomes.critical(df), 4)


def across_pretrain_seeds(reps: list[dict]) -> dict:
    """Each derived figure of a comparison repeated with other pre-training seeds (`reps`: the
    reports of seed 0, 1, ...): every repeat's gap, their mean and its standard error. Two parts:
    the repeats' spread (N - 1 degrees of freedom), which holds the pre-training's own seed; and
    what the repeats share, whose noise their spread cannot show: the same test images, shot
    draws and fine-tune seeds in every repeat, taken as each repeat's own ± (root mean square, at
    the fewest degrees of freedom among them). Where the spread holds some of the latter too, it
    counts twice: the ± errs large, never small. Where a repeat's own ± is unknown, so is the
    mean's (no ±, no verdict): the spread alone cannot show what they share; where a repeat's own ±
    counts its seeds alone (`noise_test` None, `share_noise_seeds_only`), the mean's is marked
    `seeds_only`, with no verdict, as `derive` marks it. t and the verdict as `derive`'s. The share
    recovered gets its mean and a ± built alike from its spread and the repeats' own
    `share_noise`, without a verdict. A figure some repeat lacks (or, for the share, could not
    define) keeps its values, None among them, with mean and ± None. {} for fewer than two repeats."""
    if len(reps) < 2:
        return {}

    def over(gs: list[dict]) -> dict:
        out = {}
        for gap in (*GAPS, "recovered_share"):
            values = [g.get(gap) for g in gs]
            share = gap == "recovered_share"
            unknown = {"noise": None, **({} if share else {"t": None, "significant": None})}
            if all(v is None for v in values):
                continue
            if None in values:
                out[gap] = {"values": values, "mean": None, **unknown}
                continue
            mean, sd = mean_std(values)
            spread = (sd / math.sqrt(len(values)), len(values) - 1)
            own = [g.get("share_noise") if share else g["noise"].get(gap) for g in gs]
            if None in own:
                out[gap] = {"values": values, "mean": round(mean, 4), **unknown}
                continue
            gain = out.get("supervised_minus_scratch") or {}
            if share and gain.get("noise") is not None and not significant(gain["mean"], gain["noise"], gain["t"]):
                out[gap] = {"values": values, "mean": round(mean, 4), **unknown,  # a ratio over a gain that could be 0
                            "note": "no ±: supervised - scratch over the seeds is within its noise"}
                continue
            shared = (math.sqrt(sum(x * x for x in own) / len(own)),
                      math.inf if share else min((g.get("dof") or {}).get(gap) or math.inf for g in gs))
            noise, df = outcomes.combine(spread, shared)
            seeds_only = any(g.get("share_noise_seeds_only") if share else (g.get("noise_test") or {}).get(gap) is None
                             for g in gs)
            out[gap] = {"values": values, "mean": round(mean, 4), "noise": round(noise, 4),
                        **({"seeds_only": True} if seeds_only else {})}
            if not share:
                t = outcomes.critical(df)
                out[gap].update(t=round(t, 4), significant=None if seeds_only else significant(mean, noise, t))
        return out

    ds = [r["derived"] for r in reps]
    return {"seeds": len(reps),
            "finetune": {fr: over([d["finetune"].get(fr) or {} for d in ds]) for fr in ds[0]["finetune"]},
            "linear_top1": over([d["linear_top1"] for d in ds]),
            "fewshot": {k: over([d["fewshot"].get(k) or {} for d in ds]) for k in ds[0]["fewshot"]}}


def pool_choice(m: dict) -> dict | None:
    """How a probe chose the representation (a fine-tune's finetune.pool=auto, or the linear
    probe's, from its metrics.json): each candidate's top-1 on the images it was chosen on (`on`:
    dev, the run's development split, heldout, a held-out part of its training labels, or cv, all
    its labels in folds), how many
    images that was, the next best candidate (`other`) and the chosen one's lead over it
    (`choice_lead`, paired over those images). None where the run recorded no such choice."""
    on = next((on for on in ("dev", "cv") if f"pool_{on}_top1" in m), "heldout")
    if not m.get(f"pool_{on}_top1") or not m.get("pool"):
        return None
    top1, records = m[f"pool_{on}_top1"], m.get(f"pool_{on}_outcomes") or {}
    pool = m["pool"]
    other = max((k for k in top1 if k != pool), key=top1.get, default=None)
    lead = None if other is None else choice_lead(top1[pool], top1[other], outcomes.read(records.get(pool)),
                                                  outcomes.read(records.get(other)))
    return {"top1": top1, "on": on, "n": (records.get(pool) or {}).get("n"), "other": other, "lead": lead}


def dev_rank(top1: float, folder) -> tuple:
    """A sweep stage's place among its cell's, as the comparison picks its finals and the report
    finds them: the best top-1 on the development split first, an exact tie to the folder whose
    name sorts first (both see the folders, not the grid's order)."""
    return -top1, Path(folder).name


def sweep_lead(dev: list[dict], images: list, chosen: dict, ranks: list[tuple]) -> dict | None:
    """The chosen value's lead (`choice_lead`) over the best other value of the sweep, an exact tie
    for it broken as the comparison breaks it (`ranks`: each dev run's `dev_rank`), so the lead is
    over the runner-up it retrained. None unless exactly one dev run has the chosen values and
    another exists."""
    mine = [i for i, x in enumerate(dev) if x["values"] == chosen]
    others = [i for i, x in enumerate(dev) if x["values"] != chosen]
    if len(mine) != 1 or not others:
        return None
    a, b = mine[0], min(others, key=lambda i: ranks[i])
    return choice_lead(dev[a]["dev_top1"], dev[b]["dev_top1"], images[a], images[b])


def choice_lead(top1: float, other_top1: float, images, other_images) -> dict:
    """One value's development top-1 minus another's, in points, with the standard error of that
    difference from the development images' sampling (paired: both scored on the same split;
    `images`: each run's mpp.outcomes) and whether the lead reaches t times it (`clear`, t: Student's
    at one less degree of freedom than the images; False: the split could not tell the two apart,
    so the choice is noise that the seeds do not show; None: a run recorded no outcomes)."""
    points = round(100.0 * (top1 - other_top1), 4)
    if not (images and other_images and images[0] == other_images[0]):
        return {"points": points, "noise": None, "t": None, "clear": None}
    noise = round(100.0 * outcomes.paired_sem(images[1], other_images[1]), 4)
    t = round(outcomes.critical(len(images[1]) - 1), 4)
    return {"points": points, "noise": noise, "t": t, "clear": significant(points, noise, t) and points > 0}


def significant(gap: float, noise: float, t: float) -> bool:
    """A gap (points) of at least t times its standard error; 0 ± 0 (the same predictions) is none.
    A Python bool for numpy inputs too: the report's toss-up tests read `clear is False`."""
    return bool(abs(gap) >= max(t * noise, 1e-9))


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for one value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def runs_images(per_seed: list) -> tuple[str, np.ndarray] | None:
    """(labels digest, per-image top-1 of each run: runs x images) of a cell's final runs, a
    probe's few-shot draws or its one fit (`outcomes.read` of each); None unless every run
    recorded outcomes on the same images in the same order."""
    if not per_seed or any(p is None for p in per_seed) or len({(d, len(v)) for d, v in per_seed}) > 1:
        return None
    return per_seed[0][0], np.array([v for _, v in per_seed], np.float64)
