"""mpp.outcomes: per-image results in metrics.json, and the test images' noise in the gap report."""
from __future__ import annotations

import json

import numpy as np
import pytest

from mpp import outcomes
from mpp.gaps import added_noise, derive, significant
from mpp.report import write_report
from mpp.report.recipes import ranges
from test_report import _run



def one_run(per_image: dict) -> dict:
    """`derive`'s per_run for one run a family: each (labels digest, per-image scores) as 1 x images."""
    return {f: (d, np.asarray(v)[None]) for f, (d, v) in per_image.items()}

def test_record_round_trips_and_rejects_malformed_entries():
    rng = np.random.default_rng(0)
    correct, labels = rng.random(1001) < 0.4, rng.integers(0, 10, 1001)  # not a multiple of 8 bits
    entry = json.loads(json.dumps(outcomes.record(correct, labels)))
    digest, back = outcomes.read(entry)
    assert digest == outcomes.labels_digest(labels) != outcomes.labels_digest(labels[::-1])
    assert back.dtype == bool and np.array_equal(back, correct)
    for bad in (None, "x", {}, {**entry, "n": 2000}, {**entry, "n": 0}, {**entry, "correct": "%%%"},
                {**entry, "labels": 3}, {**entry, "n": "1001"}):
        assert outcomes.read(bad) is None
    with pytest.raises(ValueError, match="predictions"):
        outcomes.record(correct[:-1], labels)


def test_the_labels_digest_of_recorded_runs_never_changes():
    """Runs recorded by an older version pair with new ones only while the digest of the same labels
    is the same hex string: a change (another dtype, hash or length) would silently drop the test
    noise from every report that mixes them. The value is pinned, whatever integer type the labels come in."""
    labels = [3, 1, 4, 1, 5, 9, 2, 6]
    for same in (labels, np.array(labels, np.int32), np.array(labels, np.uint8), np.array(labels, np.int64)):
        assert outcomes.labels_digest(same) == "81236c01802732b2"


def test_read_refuses_entries_whose_bits_do_not_fit_their_count():
    """A damaged or hand-edited `correct` field must read as no per-image result (None), not as
    other bits: characters outside base64 (which a lax decoder drops), more bytes than n images
    need, or no image at all (n=0 with no bytes, an empty result the report cannot pair)."""
    correct = np.array([1, 0, 1, 1, 0, 0, 1, 0, 1], bool)
    entry = outcomes.record(correct, np.arange(9))
    assert np.array_equal(outcomes.read(entry)[1], correct)
    text = entry["correct"]
    for bad in ({**entry, "correct": text[:2] + "!" + text[2:]}, {**entry, "correct": text[:2] + " \n" + text[2:]},
                {**entry, "n": 8}, {**entry, "n": 3},  # 16 bits where 8 fit
                {**entry, "n": 0, "correct": ""}):
        assert outcomes.read(bad) is None, bad


def test_paired_sem_is_the_standard_error_of_the_per_image_difference():
    a = np.array([1, 1, 0, 1, 0, 1, 1, 0], bool)
    b = np.array([1, 0, 0, 1, 1, 1, 0, 0], bool)
    d = a.astype(float) - b
    assert outcomes.paired_sem(a, b) == pytest.approx(np.std(d, ddof=1) / np.sqrt(8))
    assert outcomes.paired_sem(a, a) == 0.0  # the same predictions: no sampling noise in their gap


def test_a_difference_over_one_image_has_no_standard_error_rather_than_none():
    """One image gives no spread to estimate: its part of a gap's noise is 0 (which `derive` then
    leaves out), paired or not, whichever side has the single image; never None."""
    assert outcomes.paired_sem([True], [False]) == 0.0
    assert outcomes.unpaired_sem([1.0], [0.0, 1.0, 1.0]) == 0.0 == outcomes.unpaired_sem([0.0, 1.0, 1.0], [1.0])


def test_derive_adds_test_noise_only_for_the_same_images():
    rng = np.random.default_rng(1)
    n = 1000
    sup, mpp = rng.random(n) < 0.6, rng.random(n) < 0.55
    same, other = "d1", "d2"
    sem = {"supervised": 0.003, "mpp": 0.004, "scratch": None}
    g = derive(sup.mean(), mpp.mean(), None, sem=sem, per_run=one_run({"supervised": (same, sup), "mpp": (same, mpp)}))
    test = 100 * outcomes.paired_sem(sup, mpp)
    assert 1.5 < test < 4  # two independent 0/1 vectors over 1,000 images: ~2.2 points
    assert g["noise_test"]["supervised_minus_mpp"] == pytest.approx(test, abs=1e-3)
    assert g["noise"]["supervised_minus_mpp"] == pytest.approx(np.hypot(np.hypot(0.3, 0.4), test), abs=1e-3)
    g2 = derive(sup.mean(), mpp.mean(), None, sem=sem,
                per_run=one_run({"supervised": (same, sup), "mpp": (other, mpp)}))
    unpaired = 100 * outcomes.unpaired_sem(sup, mpp)  # other images or order: two independent samples
    assert unpaired == pytest.approx(100 * np.sqrt(sup.var(ddof=1) / n + mpp.var(ddof=1) / n))
    assert g2["noise_test"]["supervised_minus_mpp"] == pytest.approx(unpaired, abs=1e-3)
    assert g2["noise"]["supervised_minus_mpp"] == pytest.approx(np.hypot(0.5, unpaired), abs=1e-3)
    seeds = derive(sup.mean(), mpp.mean(), None, sem={"supervised": 0.015, "mpp": 0.02},
                   per_run=one_run({"supervised": (same, sup), "mpp": (same, mpp)}),
                   dof={"supervised": 2, "mpp": 2})  # three seeds each: the seed parts' 2 degrees weigh in
    welch = outcomes.combine((1.5, 2), (2.0, 2), (test, n - 1))
    assert seeds["noise"]["supervised_minus_mpp"] == pytest.approx(welch[0], abs=1e-3)
    assert seeds["t"]["supervised_minus_mpp"] == pytest.approx(outcomes.critical(welch[1]), abs=1e-3)
    assert 2.1 < seeds["t"]["supervised_minus_mpp"] < 4.3  # between the images' 1.96 and the seeds' 4.30
    assert 1.96 < g["t"]["supervised_minus_mpp"] < outcomes.critical(n - 1)  # no dof: the seeds' count as many
    same_runs = derive(0.5, 0.5, 0.5, sem=dict.fromkeys(sem, 0.0), per_run=one_run(dict.fromkeys(sem, (same, sup))))
    assert same_runs["noise"]["mpp_minus_scratch"] == 0.0
    assert same_runs["significant"]["mpp_minus_scratch"] is False  # 0 ± 0 is no gap


def test_a_gap_on_few_test_images_takes_their_degrees_of_freedom():
    """Two probes (no seed noise) on the same 4 test images: the gap's noise is the images' paired
    sampling alone, at 4 - 1 = 3 degrees of freedom: Student's 3.182, not the 2.776 of 4."""
    a, b = np.array([1, 1, 1, 0], bool), np.array([1, 0, 0, 0], bool)
    g = derive(a.mean(), b.mean(), None, sem={"supervised": 0.0, "mpp": 0.0},
               per_run=one_run({"supervised": ("d", a), "mpp": ("d", b)}))
    d = a.astype(float) - b
    assert g["noise"]["supervised_minus_mpp"] == pytest.approx(100 * np.std(d, ddof=1) / 2, abs=1e-3)
    assert g["dof"]["supervised_minus_mpp"] == 3 and g["t"]["supervised_minus_mpp"] == pytest.approx(3.182, abs=1e-3)


def test_critical_is_students_t_and_combine_weighs_parts_by_their_degrees_of_freedom():
    table = {1: 12.706, 2: 4.303, 4: 2.776, 10: 2.228, 30: 2.042, 1e9: 1.960}  # two-sided 95%
    for dof, t in table.items():
        assert outcomes.critical(dof) == pytest.approx(t, abs=1e-3)
    # Welch's degrees are fractional: |Z| / sqrt(chi2_1.5 / 1.5) by Monte Carlo (2e7 draws) puts 95% at 6.017
    assert outcomes.critical(1.5) == pytest.approx(6.017, abs=5e-3)
    assert outcomes.critical(1, 0.999) == pytest.approx(636.62, rel=1e-4)  # the heaviest tail, far out
    assert outcomes.critical(0.5) == outcomes.critical(1)  # under one degree counts as one
    with pytest.raises(ValueError, match="dof=nan"):
        outcomes.critical(float("nan"))
    for level in (0.0, 1.0, 1.5, -0.95):  # a quantile needs 0 < level < 1
        with pytest.raises(ValueError, match="level"):
            outcomes.critical(4, level)
    # two seeds' spreads of one degree each: Welch-Satterthwaite gives 2; a precise part adds weight
    assert outcomes.combine((1.0, 1), (1.0, 1)) == pytest.approx((2 ** 0.5, 2.0))
    se, dof = outcomes.combine((1.0, 1), (1.0, 9999))
    assert se == pytest.approx(2 ** 0.5) and 3.9 < dof < 4.0
    assert outcomes.combine((0.0, 1), (0.5, 999)) == pytest.approx((0.5, 999))  # a zero part weighs nothing
    assert outcomes.combine((0.0, 1), (0.0, 5)) == (0.0, float("inf"))


def test_critical_matches_students_t_to_six_digits_at_any_degrees_and_level():
    """The gap report's significance rests on these quantiles: Student's t (scipy.stats.t.ppf's values)
    to 1e-6 relative, for fractional and moderate degrees (50 is 2.0086, not the normal 1.96) and far
    into the tail (99.9%), where a coarse integration is off in the fourth digit."""
    table = {(1.5, 0.95): 6.016663, (1.5, 0.99): 17.820311, (2, 0.999): 31.599055, (3, 0.95): 3.182446,
             (5, 0.95): 2.570582, (5, 0.999): 6.868827, (50, 0.95): 2.008559, (100, 0.999): 3.390491,
             (1000, 0.99): 2.580755}
    for (dof, level), t in table.items():
        assert outcomes.critical(dof, level) == pytest.approx(t, rel=1e-6), (dof, level)


def test_a_gap_resting_on_two_seeds_needs_students_t_not_twice_its_noise(tmp_path):
    """MPP 50/52, scratch 47/49 over two seeds each, every run right on the same test images (the
    test images' part 0): a 3-point gap ± 1.41, over twice its noise but under Student's 4.30 at
    its 2 degrees of freedom: not significant. The same spreads over six seeds each (10 degrees)
    make it significant. Without per-image results the same ± gets no verdict."""
    root = tmp_path / "runs"
    mpp = _run(root, "mpp", {"objective": "mpp"}, {"steps": 1})
    runs = [mpp]
    for n_seeds, name in ((2, "two"), (6, "six")):
        for fam, init, tops in (("mpp", str(mpp), (0.50, 0.52)), ("scratch", "none", (0.47, 0.49))):
            for seed in range(n_seeds):
                runs.append(_run(root, f"{name}/{fam}/seed{seed}", {
                    "objective": "classify", "seed": seed, "finetune": {"init": init, "label_fraction": 0.1}},
                    {"top1": tops[seed % 2], "outcomes": outcomes.record(np.arange(50) < 25, np.arange(50) % 10)}))
    two = write_report(runs[:5], tmp_path / "out")["derived"]["finetune"]["0.1"]
    assert two["mpp_minus_scratch"] == pytest.approx(3.0) and two["noise"]["mpp_minus_scratch"] == pytest.approx(
        2 ** 0.5, abs=1e-3)
    assert two["t"]["mpp_minus_scratch"] == pytest.approx(4.303, abs=1e-3)
    assert two["significant"]["mpp_minus_scratch"] is False
    assert "| +3.0 ± 1.4 not significant |" in (tmp_path / "out" / "report.md").read_text()
    six = write_report([mpp, *runs[5:]], tmp_path / "out6")["derived"]["finetune"]["0.1"]
    assert six["t"]["mpp_minus_scratch"] == pytest.approx(2.228, abs=1e-2)  # 2 x 5 degrees, equal spreads: 10
    assert six["significant"]["mpp_minus_scratch"] is True
    for r in runs[1:5]:
        m = json.loads((r / "metrics.json").read_text())
        (r / "metrics.json").write_text(json.dumps({k: v for k, v in m.items() if k != "outcomes"}))
    unknown = write_report(runs[:5], tmp_path / "out_none")["derived"]["finetune"]["0.1"]
    assert unknown["noise"]["mpp_minus_scratch"] == pytest.approx(2 ** 0.5, abs=1e-3)
    assert unknown["significant"]["mpp_minus_scratch"] is None
    assert "| +3.0 ± 1.4 (seeds only) |" in (tmp_path / "out_none" / "report.md").read_text()


def test_gaps_between_equal_arms_are_called_significant_at_most_5_percent_of_the_time():
    """Calibration: two arms with the same true accuracy, two seeds each, the seed spread the only
    noise (both right on the same test images). The report's verdict flags about 2% of such null
    gaps (Welch's t is conservative with so few degrees), within the 5% it aims at; the fixed
    twice-the-noise rule of earlier versions flagged 19%."""
    rng = np.random.default_rng(0)
    flagged, twice = 0, 0
    same = ("d", np.ones((2, 20)))
    for _ in range(2000):
        a, b = rng.normal(0.5, 0.01, 2), rng.normal(0.5, 0.02, 2)
        g = derive(a.mean(), b.mean(), None, sem={"supervised": a.std(ddof=1) / 2 ** 0.5,
                                                  "mpp": b.std(ddof=1) / 2 ** 0.5}, dof={"supervised": 1, "mpp": 1},
                   per_run={"supervised": same, "mpp": same})
        flagged += g["significant"]["supervised_minus_mpp"]
        twice += abs(g["supervised_minus_mpp"]) >= 2 * g["noise"]["supervised_minus_mpp"]
    assert 0.01 < flagged / 2000 < 0.06 and twice / 2000 > 0.12


def test_a_gap_of_exactly_t_times_its_noise_is_significant():
    """'At least t times its noise', on either side of zero."""
    assert significant(3.0, 1.5, 2.0) and significant(-3.0, 1.5, 2.0)
    assert not significant(2.999, 1.5, 2.0) and not significant(-2.999, 1.5, 2.0)
    assert significant(np.float64(2.0), np.float64(1.5), 2.0) is False  # numpy's False is not False


def _probe(root, name, encoder, correct, labels):
    return _run(root, name, {"objective": "mpp", "probe": {"encoder": str(encoder)}},
                {"kind": "linear_probe", "top1": float(np.mean(correct)), "pool": "avg",
                 "outcomes": outcomes.record(correct, labels)})


def test_report_marks_a_probe_gap_within_the_test_noise(tmp_path):
    """Probes of three encoders on the same 400 test images: a 1-point gap (6 images won, 2 lost)
    is within the sampling noise, a 20-point gap is not; a probe without outcomes leaves its gaps' noise
    unknown rather than zero. Fine-tunes over seeds add the test noise to the seeds' part."""
    root, n = tmp_path / "runs", 400
    labels = np.arange(n) % 10
    sup_run = _run(root, "sup", {"objective": "supervised"}, {"steps": 1})
    mpp_run = _run(root, "mpp", {"objective": "mpp"}, {"steps": 1})
    scratch = np.arange(n) < 160                       # 40%
    mpp = scratch.copy()
    mpp[160:166], mpp[:2] = True, False                # 41%: +1 point, 6 images won and 2 lost
    sup = np.arange(n) < 244                           # 61%
    runs = [sup_run, mpp_run, _probe(root, "probe_sup", sup_run, sup, labels),
            _probe(root, "probe_mpp", mpp_run, mpp, labels), _probe(root, "probe_scratch", "none", scratch, labels)]
    for arm, init, base in (("supervised", sup_run, sup), ("mpp", mpp_run, mpp), ("scratch", "none", scratch)):
        for seed in (0, 1):
            c = base.copy()
            c[n - 1] = bool(seed)                      # the seeds differ by one image
            runs.append(_run(root, f"ft_{arm}_{seed}", {"objective": "classify", "seed": seed, "finetune": {
                "init": str(init), "label_fraction": 1.0}},
                {"top1": float(c.mean()), "outcomes": outcomes.record(c, labels)}))
    rep = write_report(runs, tmp_path / "out")
    lin, ft = rep["derived"]["linear_top1"], rep["derived"]["finetune"]["1"]
    assert lin["mpp_minus_scratch"] == pytest.approx(1.0)
    assert lin["noise"]["mpp_minus_scratch"] == pytest.approx(100 * outcomes.paired_sem(mpp, scratch), abs=1e-3)
    assert lin["significant"] == {"supervised_minus_mpp": True, "mpp_minus_scratch": False,
                                  "supervised_minus_scratch": True}
    sem = np.std([0.0, 0.0025], ddof=1) / np.sqrt(2)  # each arm: 2 seeds 0.25 points apart
    seeds_part = 100 * np.hypot(sem, sem)
    assert ft["noise"]["mpp_minus_scratch"] > ft["noise_test"]["mpp_minus_scratch"] > 0
    assert ft["noise"]["mpp_minus_scratch"] == pytest.approx(
        np.hypot(seeds_part, ft["noise_test"]["mpp_minus_scratch"]), abs=1e-3)
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| linear probe | +20.0 ± 2.0 | +1.0 ± 0.7 not significant |" in md
    # the same probes without per-image results: noise unknown, not zero
    for name in ("probe_mpp", "probe_scratch"):
        m = json.loads((root / name / "metrics.json").read_text())
        del m["outcomes"]
        (root / name / "metrics.json").write_text(json.dumps(m))
    lin = write_report(runs, tmp_path / "out2")["derived"]["linear_top1"]
    assert lin["noise"]["mpp_minus_scratch"] is None and lin["significant"]["mpp_minus_scratch"] is None


def test_what_fine_tuning_added_gets_its_noise(tmp_path):
    """Two seeds start from the same probe head (40% of 400 images) and end at 45% and 46%: the gain
    (+5.5) carries the seeds' spread and the images' paired sampling, less the seed-by-image part
    both hold (the 4 images the seeds disagree on; `outcomes.seed_image_overlap`); a cell whose fine-tunes won
    1 image and lost 1 is marked within its noise; one whose two seeds gained 3 and 7 points
    (+5.0 ± 2.2, mostly their spread) is too, over twice its noise but under Student's t."""
    root, n = tmp_path / "runs", 400
    labels = np.arange(n) % 10
    sup = _run(root, "sup", {"objective": "supervised"}, {"steps": 1})
    start = np.arange(n) < 160
    runs = [sup]
    for frac, ends in ((0.1, (180, 184)), (1.0, (160, 160)), (0.5, (172, 188))):
        for seed, top in enumerate(ends):
            end = np.arange(n) < top
            if frac == 1.0:
                end[0], end[200] = False, True             # one image lost, one won: +0.0
            runs.append(_run(root, f"ft_{frac}_{seed}", {"objective": "classify", "seed": seed, "finetune": {
                "init": str(sup), "label_fraction": frac}}, {
                "top1": float(end.mean()), "outcomes": outcomes.record(end, labels),
                "start_top1": float(start.mean()), "start_outcomes": outcomes.record(start, labels)}))
    rep = write_report(runs, tmp_path / "out")
    noise = rep["table"]["supervised"]["finetune_added_noise"]
    gains = np.array([180, 184]) / n - 0.4
    ends = [(np.arange(n) < t).astype(float) for t in (180, 184)]

    def images_part(ends):  # the paired sampling of the mean gain, less the seed-by-image variance of the gains
        both = outcomes.seed_image_overlap([np.asarray(e, float) - start for e in ends])
        return np.sqrt(outcomes.paired_sem(np.mean(ends, 0), start) ** 2 - both)
    assert outcomes.seed_image_overlap([e - start for e in ends]) > 0
    expected = 100 * np.hypot(np.std(gains, ddof=1) / np.sqrt(2), images_part(ends))
    assert noise["0.1"] == pytest.approx(expected, abs=1e-3) and noise["0.1"] > 100 * np.std(gains, ddof=1) / 2 ** 0.5
    md = (tmp_path / "out" / "report.md").read_text().split("What fine-tuning added")[1]
    assert f"| supervised pre-training | 10% | 40.0 | 45.5 | +5.5 ± {noise['0.1']:.1f} |" in md
    assert "| supervised pre-training | 100% | 40.0 | 40.0 | +0.0 ± 0.4 not significant |" in md
    t = rep["table"]["supervised"]["finetune_added_t"]  # the seeds' 1 degree and the images' 399, by Welch
    spread = 100 * np.std(np.array([172, 188]) / n - 0.4, ddof=1) / 2 ** 0.5
    test = 100 * images_part([np.arange(n) < e for e in (172, 188)])
    assert t["0.5"] == pytest.approx(outcomes.critical(outcomes.combine((spread, 1), (test, n - 1))[1]), abs=1e-3)
    assert 2 * noise["0.5"] < 5.0 < t["0.5"] * noise["0.5"]
    for r in runs[1:]:  # starts scored on other images (another labels digest): the seeds' part alone
        m = json.loads((r / "metrics.json").read_text())
        (r / "metrics.json").write_text(json.dumps({**m, "start_outcomes": outcomes.record(start, labels[::-1])}))
    alone = write_report(runs, tmp_path / "other")["table"]["supervised"]["finetune_added_noise"]
    assert alone["0.1"] == pytest.approx(100 * np.std(gains, ddof=1) / 2 ** 0.5, abs=1e-3)
    assert f"| supervised pre-training | 50% | 40.0 | 45.0 | +5.0 ± {noise['0.5']:.1f} not significant |" in md


def test_what_fine_tuning_added_on_few_images_takes_their_degrees_of_freedom():
    """Two seeds that each won the same one of 6 images from the same start: no spread between the
    seeds, so the gain's noise is the images' paired sampling alone, at 6 - 1 = 5 degrees of
    freedom (Student's 2.571, not the 2.447 of 6)."""
    start, end = np.array([1, 1, 0, 0, 0, 0], bool), np.array([1, 1, 1, 0, 0, 0], bool)
    noise, t = added_noise([end.mean()] * 2, [start.mean()] * 2, [("d", end)] * 2, [("d", start)] * 2)
    gain = end.astype(float) - start
    assert noise == pytest.approx(100 * np.std(gain, ddof=1) / np.sqrt(6), abs=1e-3)
    assert t == pytest.approx(2.571, abs=1e-3)


def test_what_fine_tuning_added_by_seeds_that_tie_on_other_images_keeps_the_images_whole_part():
    """Two seeds each +10.0 points from the same start on 100 images, partly other ones: their gains
    tie, so the spread holds none of the seed-by-image variance and none comes out of the images'
    part (taking it out left 2.0 where the images alone give 2.6)."""
    start, e0, e1 = np.zeros(100), np.zeros(100), np.zeros(100)
    e0[:10], e1[5:15] = 1, 1
    gains = np.array([e0, e1]) - start
    assert outcomes.seed_image_overlap(gains) > 0
    noise, _ = added_noise([0.1, 0.1], [0.0, 0.0], [("d", e0), ("d", e1)], [("d", start)] * 2)
    assert noise == pytest.approx(100 * outcomes.sem(gains.mean(0)), abs=1e-3)
    assert noise > 100 * np.sqrt(outcomes.sem(gains.mean(0)) ** 2 - outcomes.seed_image_overlap(gains)) + 0.5


def test_fewshot_gaps_carry_the_shot_draws_standard_error(tmp_path):
    """Few-shot figures of a probe that recorded no draws (written before they were) are a mean over
    `fewshot_seeds` draws with their population std: a gap's noise is the two means' standard
    errors combined, each of n - 1 degrees of freedom, with no verdict (the test images' part is
    unknown without per-image results); without the draw count it is unknown."""
    root = tmp_path / "runs"
    mpp = _run(root, "mpp", {"objective": "mpp"}, {"steps": 1})
    sup = _run(root, "sup", {"objective": "supervised"}, {"steps": 1})
    runs = [mpp, sup]
    for name, enc, mean, std in (("probe_mpp", mpp, 0.30, 0.02), ("probe_sup", sup, 0.36, 0.04)):
        runs.append(_run(root, name, {"objective": "mpp", "probe": {"encoder": str(enc)}},
                         {"kind": "linear_probe", "top1": 0.5, "5shot_mean": mean, "5shot_std": std,
                          "fewshot_seeds": 5}))
    g = write_report(runs, tmp_path / "out")["derived"]["fewshot"]["5"]
    assert g["noise"]["supervised_minus_mpp"] == pytest.approx(100 * np.hypot(0.02 / 2, 0.04 / 2), abs=1e-3)
    assert g["t"]["supervised_minus_mpp"] == pytest.approx(outcomes.critical(25 / 4.25), abs=1e-3)  # Welch: 5.9
    assert g["significant"]["supervised_minus_mpp"] is None  # 6 points against 2.45 x 2.24, but the images unknown
    for r in runs[2:]:
        m = json.loads((r / "metrics.json").read_text())
        (r / "metrics.json").write_text(json.dumps({**m, "fewshot_seeds": "5"}))  # not a count: unknown
    assert write_report(runs, tmp_path / "out2")["derived"]["fewshot"]["5"]["noise"]["supervised_minus_mpp"] is None



def _interaction(x) -> float:
    """The run-by-image variance of a mean over runs and images, from the two-way layout (runs x
    images, one score a cell): its residual mean square, sum (x_ij - run_i - image_j + mean)^2 /
    ((n - 1)(N - 1)), over n N."""
    x = np.asarray(x, np.float64)
    n, images = x.shape
    r = x - x.mean(1, keepdims=True) - x.mean(0) + x.mean()
    return float((r ** 2).sum() / ((n - 1) * (images - 1)) / (n * images))


def test_seed_image_overlap_is_the_run_by_image_interactions_mean_square():
    """On a few seeds and images (where N / (N - 1) and the seed means' degrees of freedom show):
    the two-way layout's residual mean square over n N; 0 for one seed or one image."""
    rng = np.random.default_rng(7)
    for shape in ((2, 5), (3, 4), (4, 50)):
        x = (rng.random(shape) < 0.6).astype(float)
        assert outcomes.seed_image_overlap(x) == pytest.approx(_interaction(x), rel=1e-9)
        assert outcomes.seed_image_overlap(x[:1]) == 0.0 == outcomes.seed_image_overlap(x[:, :1])


def test_seed_image_overlap_is_never_negative():
    """Where every seed shifts every image alike there is no seed-by-image variance: the estimate is
    0 (within - between is then 0 up to rounding, here -1e-17), never below, or the report would add
    that much to a gap's noise when it takes the overlap out of the images' part."""
    x = np.array([[0.7], [0.2]]) + np.array([0.0, 0.1, 0.2])  # seed means 0.8 and 0.3, no interaction
    assert outcomes.seed_image_overlap(x) == 0.0


@pytest.mark.parametrize("paired", [False, True], ids=["seeds", "shared-draws"])
def test_a_gaps_noise_counts_the_seed_by_image_variance_once(paired):
    """Simulated scores that move with the run beyond its overall level (3 runs an arm, 2,000
    images): over 200 repeats of the experiment (new runs, new test images) the squared noise
    `derive` gives a gap, and the share's, average to no less than their true variances (the
    share's to first order) and well under what counting the run-by-image variance in both the
    seeds' and the images' part gives (by 0.42-0.45 of the true variance here), whether each arm
    has its own seeds (fine-tunes) or all draw the same shots (few-shot: the draws pair, and what
    they share cancels). What is left above the truth (0.14 here, where the runs' own spread is
    tiny) is the seeds' variance truncated at 0 where the seeds' part came out under the
    interaction's share of it."""
    rng = np.random.default_rng(0)
    n, images, arm, seed, inter = 3, 2000, 0.5, 0.01, 0.8  # standard deviations of each arm's own parts
    one_mean = arm ** 2 / images + seed ** 2 / n + inter ** 2 / (n * images)  # an arm's figure, less what pairs out
    true = 2 * one_mean
    share = 0.1 / 0.5  # (mpp - scratch) / (supervised - scratch); its weights on the means: 1, share - 1, -share
    share_true = (1 + (1 - share) ** 2 + share ** 2) * one_mean / 0.5 ** 2
    gaps, shares = {"once": [], "twice": []}, {"once": [], "twice": []}
    for _ in range(200):
        common = rng.normal(0.0, 1.0, images)  # what makes an image hard for every arm: paired out
        if paired:  # the same shots: a draw's effect on the whole set and on each image, shared
            common = common + rng.normal(0.0, 0.05, (n, 1)) + rng.normal(0.0, 0.6, (n, images))
        runs = {f: lift + common + rng.normal(0.0, arm, images) + rng.normal(0.0, seed, (n, 1))
                + rng.normal(0.0, inter, (n, images))
                for f, lift in (("supervised", 0.5), ("mpp", 0.1), ("scratch", 0.0))}
        given = dict(sem={f: x.mean(1).std(ddof=1) / np.sqrt(n) for f, x in runs.items()},
                     dof={f: n - 1 for f in runs},
                     draws={f: ("shots", list(x.mean(1))) for f, x in runs.items()} if paired else None)
        acc = [runs[f].mean() for f in ("supervised", "mpp", "scratch")]
        twice = one_run({f: ("same", x.mean(0)) for f, x in runs.items()})  # the runs' mean alone: no overlap known
        for key, per_run in (("once", {f: ("same", x) for f, x in runs.items()}), ("twice", twice)):
            g = derive(*acc, **given, per_run=per_run)
            gaps[key].append((g["noise"]["mpp_minus_scratch"] / 100) ** 2)
            shares[key].append(g["share_noise"] ** 2)
    for got in (np.mean(gaps["once"]) / true, np.mean(shares["once"]) / share_true):
        assert 1.0 < got < 1.2
    assert np.mean(gaps["twice"]) / true > np.mean(gaps["once"]) / true + 0.25
    assert np.mean(shares["twice"]) / share_true > np.mean(shares["once"]) / share_true + 0.25


def test_shared_draws_scored_on_other_images_take_each_arms_own_overlap():
    """Draws that pair (the same shots) but were scored on other test images: the images' part is
    two independent samples, and so is what it shares with the draws' part: each arm's own
    draw-by-image variance, not that of a difference image by image, and no more of it than the
    draws' paired part holds (all of it where the draws tie: none comes out)."""
    rng = np.random.default_rng(3)
    runs = {f: (rng.random((3, 500)) < p).astype(float)
            for f, p in (("supervised", 0.7), ("mpp", 0.5), ("scratch", 0.4))}
    given = dict(sem={f: x.mean(1).std(ddof=1) / np.sqrt(3) for f, x in runs.items()},
                 per_run={f: (f, x) for f, x in runs.items()},  # every arm its own images
                 draws={f: ("shots", list(x.mean(1))) for f, x in runs.items()})
    g = derive(*(runs[f].mean() for f in ("supervised", "mpp", "scratch")), **given)
    a, b = runs["mpp"], runs["scratch"]
    own = outcomes.seed_image_overlap(a) + outcomes.seed_image_overlap(b)
    assert own != pytest.approx(outcomes.seed_image_overlap(a - b))  # the two readings differ here
    own = sum(min(outcomes.seed_image_overlap(runs[f]), given["sem"][f] ** 2) for f in ("mpp", "scratch"))
    paired = outcomes.paired_sem(a.mean(1), b.mean(1))  # the draws' part: no more than it holds comes out
    assert own > paired ** 2 > 0
    want = 100 * np.sqrt(outcomes.unpaired_sem(a.mean(0), b.mean(0)) ** 2 - min(own, paired ** 2))
    assert g["noise_test"]["mpp_minus_scratch"] == pytest.approx(want, abs=1e-3)
    # draws that pair and tie: the seeds' part (paired) is 0 and holds none of it, whatever each arm's own holds
    tied = {**given["draws"], "scratch": ("shots", list(a.mean(1) - 0.1))}
    g = derive(*(runs[f].mean() for f in ("supervised", "mpp", "scratch")), **{**given, "draws": tied})
    assert g["noise"]["mpp_minus_scratch"] == pytest.approx(100 * outcomes.unpaired_sem(a.mean(0), b.mean(0)), abs=1e-3)


def test_an_arm_whose_seeds_tie_takes_no_seed_by_image_variance_out_of_the_images_part():
    """Two seeds an arm on 1,000 images: A's score 50.0 both times, on partly other images; B's
    48.0 both times. Their seeds' parts are 0 and hold none of the seed-by-image variance, so none comes out
    of the images' part: the gap's noise is the paired images' own (it was 0.0, significant at
    t 1.96, where taking the estimate out left nothing). A seed part above the estimate gives it
    all back (the gap as before)."""
    rng = np.random.default_rng(1)
    a, b = np.zeros((2, 1000)), np.zeros((2, 1000))
    a[0, :500], a[1, 100:600] = 1, 1  # 50.0% each, 200 images scored by one seed only
    b[0, rng.permutation(1000)[:480]], b[1, rng.permutation(1000)[:480]] = 1, 1
    per_run = {"mpp": ("d", a), "scratch": ("d", b)}
    g = derive(None, 0.5, 0.48, sem={"mpp": 0.0, "scratch": 0.0}, dof={"mpp": 1, "scratch": 1}, per_run=per_run)
    images = 100 * outcomes.paired_sem(a.mean(0), b.mean(0))
    assert outcomes.seed_image_overlap(a) > 0 and g["mpp_minus_scratch"] == pytest.approx(2.0)
    assert g["noise"]["mpp_minus_scratch"] == pytest.approx(images, abs=1e-3) and images > 1.0
    big = {"mpp": 0.05, "scratch": 0.05}  # seed parts far above the estimates: each taken out whole
    g = derive(None, 0.5, 0.48, sem=big, dof={"mpp": 1, "scratch": 1}, per_run=per_run)
    both = outcomes.seed_image_overlap(a) + outcomes.seed_image_overlap(b)
    assert 0 < g["noise_test"]["mpp_minus_scratch"] == pytest.approx(100 * np.sqrt(images ** 2 / 1e4 - both), abs=1e-3)


def test_arms_with_their_own_seeds_on_the_same_images_take_each_arms_own_overlap():
    """Fine-tunes: each arm its own three seeds, all scored on the same test images (the images
    pair, the runs do not): what the images' part shares with the seeds' part is each arm's own
    seed-by-image variance, in a gap and in the share (delta method: weights 1 / gain on MPP,
    -share / gain on supervised, (share - 1) / gain on scratch); not that of the runs'
    differences image by image, which pairs runs that share nothing and is far smaller here,
    where run i of every arm flips the same images."""
    rng = np.random.default_rng(0)
    n, images = 3, 600
    latent, flip = rng.random(images), rng.random((n, images)) < 0.05
    runs = {f: ((latent < p) ^ flip).astype(float) for f, p in zip(ARMS, (0.7, 0.5, 0.4))}
    sem = {f: x.mean(1).std(ddof=1) / np.sqrt(n) for f, x in runs.items()}
    acc = [runs[f].mean() for f in ARMS]
    g = derive(*acc, sem=sem, dof=dict.fromkeys(ARMS, n - 1), per_run={f: ("d", x) for f, x in runs.items()})
    a, b = runs["mpp"], runs["scratch"]
    assert _interaction(a - b) < 0.5 * (_interaction(a) + _interaction(b))  # the two readings differ here
    paired = np.std(a.mean(0) - b.mean(0), ddof=1) / np.sqrt(images)
    test = 100 * np.sqrt(paired ** 2 - _interaction(a) - _interaction(b))
    assert g["noise_test"]["mpp_minus_scratch"] == pytest.approx(test, abs=1e-3)
    u, m, s = acc
    share = (m - s) / (u - s)
    w = {"supervised": -share / (u - s), "mpp": 1 / (u - s), "scratch": (share - 1) / (u - s)}
    influence = sum(w[f] * runs[f].mean(0) for f in ARMS)
    test2 = np.var(influence, ddof=1) / images - sum(w[f] ** 2 * _interaction(runs[f]) for f in ARMS)
    assert test2 > 0
    seeds2 = sum((w[f] * sem[f]) ** 2 for f in ARMS)
    assert g["share_noise"] == pytest.approx(np.sqrt(seeds2 + test2), abs=2e-4)


def test_share_noise_matches_resampling():
    """The share's standard error (delta method) against brute force: resampling the test images
    (per-image results of three arms on 2,000 images) and, separately, drawing each arm's mean
    from its seeds' standard error; both within 3%."""
    rng = np.random.default_rng(3)
    n = 2000
    latent = rng.random(n)  # how hard each image is: the arms' results are correlated through it
    u, m, s = (latent < p for p in (0.62, 0.45, 0.38))
    u, m, s = (x ^ (rng.random(n) < 0.1) for x in (u, m, s))
    per_image = {f: ("d", v) for f, v in zip(("supervised", "mpp", "scratch"), (u, m, s))}
    g = derive(u.mean(), m.mean(), s.mean(), sem=dict.fromkeys(per_image, 0.0), per_run=one_run(per_image))
    idx = rng.integers(0, n, (4000, n))
    boot = (m[idx].mean(1) - s[idx].mean(1)) / (u[idx].mean(1) - s[idx].mean(1))
    assert g["share_noise"] == pytest.approx(boot.std(), rel=0.03)
    sem = {"supervised": 0.01, "mpp": 0.015, "scratch": 0.012}
    g = derive(0.6, 0.45, 0.35, sem=sem)
    draws = {f: rng.normal(mu, sem[f], 200_000) for f, mu in (("supervised", 0.6), ("mpp", 0.45), ("scratch", 0.35))}
    mc = (draws["mpp"] - draws["scratch"]) / (draws["supervised"] - draws["scratch"])
    assert g["recovered_share"] == pytest.approx(0.4) and g["share_noise"] == pytest.approx(mc.std(), rel=0.03)
    assert derive(0.6, 0.45, 0.35, sem={**sem, "mpp": None})["share_noise"] is None


def _probe_figures(root, name, enc, features, y, xt, yt):
    """A probe run whose few-shot figures come from `fewshot_eval` on the given features."""
    import torch
    from mpp.evaluators.fewshot import fewshot_eval
    fs = fewshot_eval(torch.from_numpy(features), torch.from_numpy(y), torch.from_numpy(xt), torch.from_numpy(yt),
                      shots=(2,), seeds=4, l2=1.0, draws=True)
    return _run(root, name, {"objective": "mpp", "probe": {"encoder": str(enc)}},
                {"kind": "linear_probe", "top1": 0.5, "fewshot_seeds": 4, **fs}), fs


def test_fewshot_gaps_pair_the_same_shots_and_test_images(tmp_path):
    """Every arm's few-shot draws use the same shots, scored on the same test images: a gap's noise is
    the paired standard error over draws combined with the paired one over images (less the
    draw-by-image variance of the differences, which both hold), not the two arms' draw spreads
    added as if independent (which overstates it here, where the draws move both arms alike)."""
    rng = np.random.default_rng(5)
    centers = rng.normal(0, 1.5, (5, 8))
    y, yt = np.repeat(np.arange(5), 40), np.repeat(np.arange(5), 200)
    x, xt = centers[y] + rng.normal(0, 1, (200, 8)), centers[yt] + rng.normal(0, 1, (1000, 8))
    root = tmp_path / "runs"
    mpp = _run(root, "mpp", {"objective": "mpp"}, {"steps": 1})
    sup = _run(root, "sup", {"objective": "supervised"}, {"steps": 1})
    (p_mpp, a), (p_sup, b) = (_probe_figures(root, f"probe_{n}", enc, x * s + rng.normal(0, 0.1, x.shape),
                                             y, xt * s, yt) for n, enc, s in (("mpp", mpp, 1.0), ("sup", sup, 2.0)))
    g = write_report([mpp, sup, p_mpp, p_sup], tmp_path / "out")["derived"]["fewshot"]["2"]
    da, db = np.array(a["2shot_draws"]), np.array(b["2shot_draws"])
    xa, xb = (np.array([outcomes.read(e)[1] for e in m["2shot_outcomes"]], float) for m in (a, b))
    ia, ib = xa.mean(0), xb.mean(0)
    both = outcomes.seed_image_overlap(xb - xa)
    assert both > 0
    images_part = 100 * np.sqrt(outcomes.paired_sem(ib, ia) ** 2 - both)
    paired = np.hypot(100 * np.std(db - da, ddof=1) / 2, images_part)
    assert g["noise"]["supervised_minus_mpp"] == pytest.approx(paired, abs=1e-3)
    assert g["noise_test"]["supervised_minus_mpp"] == pytest.approx(images_part, abs=1e-3)
    test = (images_part, len(ia) - 1)  # 4 paired draws: 3 degrees
    assert g["t"]["supervised_minus_mpp"] == pytest.approx(
        outcomes.critical(outcomes.combine((100 * np.std(db - da, ddof=1) / 2, 3), test)[1]), abs=1e-3)
    unpaired = 100 * np.hypot(np.std(da, ddof=1), np.std(db, ddof=1)) / 2
    assert np.std(db - da, ddof=1) / 2 < unpaired / 100 / 2  # the draws move both arms alike
    m = json.loads((p_sup / "metrics.json").read_text())  # shots drawn from other labels: not paired
    (p_sup / "metrics.json").write_text(json.dumps({**m, "fewshot_train_labels": "other"}))
    g = write_report([mpp, sup, p_mpp, p_sup], tmp_path / "out2")["derived"]["fewshot"]["2"]
    # unpaired draws: each arm's own draw-by-image variance, here more than the paired images' part holds (the
    # draws do move both arms alike), which leaves that part at 0 and the noise no lower than paired above
    own = sum(map(outcomes.seed_image_overlap, (xa, xb)))
    assert own > outcomes.paired_sem(ib, ia) ** 2
    test = (0.0, len(ia) - 1)
    assert g["noise"]["supervised_minus_mpp"] == pytest.approx(np.hypot(unpaired, test[0]), abs=1e-3)
    assert g["noise"]["supervised_minus_mpp"] > paired
    assert g["t"]["supervised_minus_mpp"] == pytest.approx(outcomes.critical(outcomes.combine(  # 3 degrees each
        (100 * np.std(da, ddof=1) / 2, 3), (100 * np.std(db, ddof=1) / 2, 3), test)[1]), abs=1e-3)


def test_share_noise_counts_arms_scored_on_other_images():
    """Three arms on three different test sets: the share's test part is each arm's own sampling
    error through the delta method (it used to be left out: a probe's share read ± 0.00), and
    matches resampling each arm's images independently within 5%."""
    rng = np.random.default_rng(0)
    per_image = {f: (d, rng.random(n) < p) for f, d, p, n in
                 (("supervised", "A", 0.7, 500), ("mpp", "B", 0.5, 800), ("scratch", "C", 0.4, 600))}
    acc = {f: v.mean() for f, (_, v) in per_image.items()}
    g = derive(acc["supervised"], acc["mpp"], acc["scratch"], sem=dict.fromkeys(per_image, 0.0),
               per_run=one_run(per_image))
    boot = {f: v[rng.integers(0, v.size, (4000, v.size))].mean(1) for f, (_, v) in per_image.items()}
    share = (boot["mpp"] - boot["scratch"]) / (boot["supervised"] - boot["scratch"])
    assert g["share_noise"] > 0 and g["share_noise"] == pytest.approx(share.std(), rel=0.05)


ARMS = ("supervised", "mpp", "scratch")


def test_single_seed_fine_tunes_get_no_noise_even_with_per_image_results():
    """Seed noise unknown (one fine-tune per arm): the test images alone would understate the
    gap's noise, so the report gives neither a ± nor a verdict."""
    rng = np.random.default_rng(0)
    a, b = rng.random(1000) < 0.6, rng.random(1000) < 0.5
    g = derive(0.6, 0.5, None, sem=dict.fromkeys(ARMS), per_run=one_run({"supervised": ("d", a), "mpp": ("d", b)}))
    assert g["noise"]["supervised_minus_mpp"] is None and g["significant"]["supervised_minus_mpp"] is None


def test_share_noise_adds_the_seeds_and_the_test_images_in_quadrature():
    rng = np.random.default_rng(1)
    v = {f: rng.random(2000) < p for f, p in zip(ARMS, (0.62, 0.45, 0.38))}
    acc, images = [x.mean() for x in v.values()], {f: ("d", x) for f, x in v.items()}
    sem = {"supervised": 0.01, "mpp": 0.015, "scratch": 0.012}
    both = derive(*acc, sem=sem, per_run=one_run(images))["share_noise"]
    seeds, test = (derive(*acc, sem=sem)["share_noise"],
                   derive(*acc, sem=dict.fromkeys(ARMS, 0.0), per_run=one_run(images)))
    assert both == pytest.approx(np.hypot(seeds, test["share_noise"]), abs=2e-4)


def test_share_noise_pairs_the_same_shot_draws():
    """Eight draws of shots that move every arm alike: the share's seed part is the delta method
    over the per-draw influences, far below the arms' draw spreads taken as independent."""
    rng = np.random.default_rng(2)
    common = rng.normal(0, 0.03, 8)
    d = {f: mu + common + rng.normal(0, 0.002, 8) for f, mu in zip(ARMS, (0.6, 0.45, 0.35))}
    u, m, s = (d[f].mean() for f in ARMS)
    g = derive(u, m, s, sem={f: outcomes.sem(d[f]) for f in ARMS}, draws={f: ("x", list(d[f])) for f in ARMS})
    share = (m - s) / (u - s)
    influence = (d["mpp"] - d["scratch"]) - share * (d["supervised"] - d["scratch"])
    assert g["share_noise"] == pytest.approx(np.std(influence, ddof=1) / np.sqrt(8) / (u - s), abs=2e-4)
    assert g["share_noise"] < 0.3 * derive(u, m, s, sem={f: outcomes.sem(d[f]) for f in ARMS})["share_noise"]


def test_share_noise_of_arms_scored_on_other_images_weighs_each_arm():
    """Three arms on 200, 800 and 5,000 other images: each arm's sampling error enters with the
    share's derivative in its accuracy (1 / gain, share / gain, (share - 1) / gain)."""
    rng = np.random.default_rng(3)
    per = {"supervised": ("A", rng.random(200) < 0.7), "mpp": ("B", rng.random(800) < 0.5),
           "scratch": ("C", rng.random(5000) < 0.4)}
    u, m, s = (per[f][1].mean() for f in ARMS)
    g = derive(u, m, s, sem=dict.fromkeys(ARMS, 0.0), per_run=one_run(per))
    r, gain, se = (m - s) / (u - s), u - s, {f: outcomes.sem(per[f][1]) for f in ARMS}
    assert g["share_noise"] == pytest.approx(np.linalg.norm([se["mpp"] / gain, r * se["supervised"] / gain,
                                                             (r - 1) * se["scratch"] / gain]), abs=2e-4)


def test_share_noise_pairs_the_arms_that_share_images_and_takes_the_others_as_independent():
    """Supervised and MPP probes on the same 1,000 images, scratch's on other ones: the share's
    test part pairs supervised and MPP image by image (their covariance counts) and adds scratch's
    own sampling error, never pairing scratch's images with the others' by position."""
    rng = np.random.default_rng(4)
    latent = rng.random(1000)
    per = {"supervised": ("A", latent < 0.7), "mpp": ("A", latent < 0.5), "scratch": ("B", rng.random(1000) < 0.4)}
    u, m, s = (per[f][1].mean() for f in ARMS)
    g = derive(u, m, s, sem=dict.fromkeys(ARMS, 0.0), per_run=one_run(per))
    r, gain = (m - s) / (u - s), u - s
    paired = per["mpp"][1] / gain - r * per["supervised"][1] / gain  # the per-image influence of the pair
    own = (r - 1) / gain * np.std(per["scratch"][1], ddof=1) / np.sqrt(1000)
    assert g["share_noise"] == pytest.approx(np.hypot(np.std(paired, ddof=1) / np.sqrt(1000), own), abs=2e-4)
    independent = np.linalg.norm([np.std(per[f][1], ddof=1) / np.sqrt(1000) * w for f, w in
                                  (("mpp", 1 / gain), ("supervised", r / gain), ("scratch", (r - 1) / gain))])
    assert g["share_noise"] < independent - 0.005  # the pair's positive covariance lowers it here


def test_draws_of_other_counts_are_not_paired():
    """Two probes with the same shots' digest but 5 and 4 draws (one cut short): unpaired, the two
    means' standard errors combined, with 4 and 3 degrees of freedom."""
    rng = np.random.default_rng(4)
    a, b = list(rng.normal(0.5, 0.01, 4)), list(rng.normal(0.6, 0.01, 5))
    g = derive(np.mean(b), np.mean(a), None, sem={"supervised": outcomes.sem(b), "mpp": outcomes.sem(a)},
               dof={"supervised": 4, "mpp": 3}, draws={"supervised": ("x", b), "mpp": ("x", a)})
    se_a, se_b = 100 * outcomes.sem(a), 100 * outcomes.sem(b)
    assert g["noise"]["supervised_minus_mpp"] == pytest.approx(np.hypot(se_a, se_b), abs=1e-3)
    assert g["t"]["supervised_minus_mpp"] == pytest.approx(
        outcomes.critical(outcomes.combine((se_b, 4), (se_a, 3))[1]), abs=1e-3)
    assert outcomes.sem(np.array([0.0, 1.0])) == pytest.approx(0.5)  # two values already have a standard error


def test_draws_pair_only_where_both_arms_recorded_two_or_more():
    """One draw of the same shots each (no spread to pair), or draws recorded by one arm only (a
    probe written before they were): each arm keeps its own standard error."""
    sem = {"supervised": 0.01, "mpp": 0.02}
    for draws in ({"supervised": ("x", [0.6]), "mpp": ("x", [0.5])},
                  {"supervised": ("x", [0.59, 0.61]), "mpp": None}, {"supervised": None, "mpp": ("x", [0.49, 0.51])}):
        g = derive(0.6, 0.5, None, sem=sem, draws=draws)
        assert g["noise"]["supervised_minus_mpp"] == pytest.approx(100 * np.hypot(0.01, 0.02), abs=1e-3)


def test_a_share_range_skips_combinations_without_a_supervised_gain():
    """A runner-up that puts supervised level with scratch leaves the share undefined in that
    combination, so the share gets no range (rather than a division by zero); where every
    combination has a gain the range spans them."""
    assert "recovered_share" not in ranges({"supervised": [0.5, 0.6], "mpp": [0.45], "scratch": [0.5]})
    assert ranges({"supervised": [0.6, 0.7], "mpp": [0.55], "scratch": [0.5]})["recovered_share"] == pytest.approx(
        [0.25, 0.5])


def test_arms_scored_on_other_test_sets_take_the_smaller_ones_degrees_whichever_comes_first():
    """Unpaired test parts: the gap's degrees of freedom come from the smaller test set, not from
    whichever arm the gap names first (12 images against 10,000: 11 degrees both ways)."""
    rng = np.random.default_rng(0)
    big, small = ("a", rng.random((1, 10_000)) < 0.6), ("b", rng.random((1, 12)) < 0.5)
    sem = {"supervised": 0.0, "mpp": 0.0}
    one = derive(0.6, 0.5, None, sem=sem, per_run={"supervised": big, "mpp": small})
    two = derive(0.5, 0.6, None, sem=sem, per_run={"supervised": small, "mpp": big})
    assert one["dof"]["supervised_minus_mpp"] == two["dof"]["supervised_minus_mpp"] == pytest.approx(11)
    assert one["t"]["supervised_minus_mpp"] == pytest.approx(outcomes.critical(11), abs=1e-4)


def test_share_noise_under_paired_draws_takes_no_overlap_across_arms_scored_on_other_images():
    """The arms drew the same shots (paired draws) but scored other test images (other label digests):
    the share's test part takes out each arm's own seed-by-image variance, never that of a sum over
    images that do not match, so how one arm's unrelated images are ordered cannot move its ±."""
    rng = np.random.default_rng(6)
    hard, shift = rng.random(400), rng.normal(0, 0.25, (4, 400))  # 4 draws of shots x 400 images
    runs = {f: (hard + shift + rng.normal(0, 0.05, (4, 1))) < p for f, p in zip(ARMS, (0.7, 0.5, 0.35))}
    acc, sem = {f: runs[f].mean() for f in ARMS}, {f: outcomes.sem(runs[f].mean(1)) for f in ARMS}
    draws = {f: ("shots", list(runs[f].mean(1))) for f in ARMS}

    def share_noise(scratch: np.ndarray) -> float:
        per_run = {"supervised": ("A", runs["supervised"]), "mpp": ("B", runs["mpp"]), "scratch": ("C", scratch)}
        return derive(*acc.values(), sem=sem, per_run=per_run, draws=draws)["share_noise"]

    u, m, s = acc.values()
    r, gain = (m - s) / (u - s), u - s
    w = {"supervised": -r / gain, "mpp": 1 / gain, "scratch": (r - 1) / gain}
    seeds = outcomes.sem(sum(w[f] * runs[f].mean(1) for f in ARMS))  # the draws pair
    test = sum((w[f] * outcomes.sem(runs[f].mean(0))) ** 2 for f in ARMS)  # the images do not
    own = min(sum(w[f] ** 2 * min(outcomes.seed_image_overlap(runs[f]), sem[f] ** 2) for f in ARMS), seeds ** 2)
    assert share_noise(runs["scratch"]) == pytest.approx(np.hypot(seeds, np.sqrt(test - own)), abs=2e-4)
    assert share_noise(runs["scratch"][:, rng.permutation(400)]) == share_noise(runs["scratch"])
