"""The gap report on hand-written run directories: roles, table cells and derived figures."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from mpp import outcomes
from mpp.gaps import choice_lead, derive
from mpp.report import ReportError, write_report
from mpp.report.runs import read_repeat
from toolrun import run_tool

ROOT = Path(__file__).resolve().parents[1]


def _run(root: Path, name: str, config: dict, metrics: dict) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump(config))
    (d / "metrics.json").write_text(json.dumps(metrics))
    return d


def _paper_runs(root: Path, seed: int = 0) -> list[Path]:
    """The paper's ViT-B/16 ImageNet figures (84.0 / 79.9 / 77.9) at 100% labels, plus a 10% column
    and probes; the pre-trainings of `seed`."""
    mpp = _run(root, "mpp", {"objective": "mpp", "seed": seed}, {"steps": 100, "loss": 3.2})
    sup = _run(root, "sup", {"objective": "supervised", "seed": seed}, {"steps": 100})
    runs = [mpp, sup]
    for fam, init, top1 in (("mpp", mpp, (0.799, 0.60)), ("sup", sup / "encoder.safetensors", (0.840, 0.70)),
                            ("scratch", "none", (0.779, 0.50))):
        for frac, acc in zip((1.0, 0.1), top1):
            runs.append(_run(root, f"ft_{fam}_{frac:g}", {"objective": "classify",
                                                          "finetune": {"init": str(init), "label_fraction": frac}},
                             {"top1": acc, "top5": 0.95}))
    runs.append(_run(root, "probe_mpp", {"objective": "mpp", "probe": {"encoder": str(mpp)}},
                     {"kind": "linear_probe", "top1": 0.40, "5shot_mean": 0.30, "5shot_std": 0.01}))
    runs.append(_run(root, "probe_sup", {"objective": "mpp", "probe": {"encoder": str(sup)}},
                     {"kind": "linear_probe", "top1": 0.65, "5shot_mean": 0.55, "5shot_std": 0.02}))
    return runs


def test_a_rerender_keeps_the_repeats_its_report_names_and_says_when_it_cannot(tmp_path, capsys):
    runs = _paper_runs(tmp_path / "runs")
    write_report(_paper_runs(tmp_path / "runs1", seed=1), tmp_path / "seed1", [])
    first = write_report(runs, tmp_path / "out", [read_repeat(tmp_path / "seed1")])
    assert first["pretrain_seeds"]["repeats"] == ["../seed1"]
    assert "from one pre-training of each arm (seed 0)" in (tmp_path / "out" / "report.md").read_text()
    assert write_report(runs, tmp_path / "out")["pretrain_seeds"] == first["pretrain_seeds"]
    assert "../seed1" in capsys.readouterr().out
    (tmp_path / "seed1" / "report.json").rename(tmp_path / "moved.json")
    with pytest.raises(ReportError, match="names the repeat .*seed1.* --repeat"):  # not an error about --repeat's
        write_report(runs, tmp_path / "out")
    assert "pretrain_seeds" not in write_report(runs, tmp_path / "out", [])  # told: none
    old = {k: v for k, v in first["pretrain_seeds"].items() if k != "repeats"}  # a report from before it named them
    (tmp_path / "out" / "report.json").write_text(json.dumps({"pretrain_seeds": old}))
    assert "pretrain_seeds" not in write_report(runs, tmp_path / "out")
    err = capsys.readouterr().err
    assert "2 pre-training seeds" in err and "--repeat" in err and err.count("\n") == 1


def test_the_tool_reads_every_repeat_it_is_given(tmp_path, monkeypatch):
    """Two --repeat folders: both are read and both reach the report."""
    import mpp.report
    import mpp.report.runs
    seen = []
    monkeypatch.setattr(mpp.report.runs, "read_repeat", lambda d: ("repeat", d))
    (tmp_path / "report.md").write_text("# the report")
    monkeypatch.setattr(mpp.report, "write_report", lambda runs, out, repeats: seen.append(repeats) or {
        "out_dir": str(tmp_path)})
    r = run_tool("report", tmp_path / "runs", "--repeat", tmp_path / "seed1", "--repeat", tmp_path / "seed2")
    assert r.returncode == 0, r.stderr
    assert seen == [[("repeat", str(tmp_path / "seed1")), ("repeat", str(tmp_path / "seed2"))]]


def test_a_repeat_passed_twice_or_of_the_same_pre_trainings_is_refused(tmp_path):
    """A repeat named twice, the report's own folder, a report of the same pre-training runs, or
    one of other runs pre-trained with the same seed (a copy of the comparison) would count one
    pre-training twice in the gaps over pre-training seeds and shrink their spread with a copy of
    itself; a re-render whose report.json names one so says where it was named."""
    runs = _paper_runs(tmp_path / "runs")
    write_report(_paper_runs(tmp_path / "runs1", seed=1), tmp_path / "seed1", [])  # other pre-training runs
    write_report(_paper_runs(tmp_path / "runs0"), tmp_path / "seed0", [])  # other runs, the same seed
    write_report(runs, tmp_path / "copy", [])  # the same runs, reported elsewhere
    write_report(runs, tmp_path / "out", [])
    (tmp_path / "x").mkdir()  # the same folder spelled another way
    for repeats, what in (([tmp_path / "seed1", tmp_path / "x" / ".." / "seed1"], "is a folder named already"),
                          ([tmp_path / "out"], "is the report's own folder"),
                          ([tmp_path / "copy"], f"read the pre-training {tmp_path / 'runs'}/(mpp|sup), as this"),
                          ([tmp_path / "seed0"], "made its MPP pre-training with seed 0, as this report did")):
        with pytest.raises(ReportError, match=f"^--repeat .*{what}"):
            write_report(runs, tmp_path / "out", [read_repeat(d) for d in repeats])
    assert write_report(runs, tmp_path / "out", [read_repeat(tmp_path / "seed1")])["pretrain_seeds"]["repeats"] == \
        ["../seed1"]
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    saved["pretrain_seeds"]["repeats"] *= 2
    (tmp_path / "out" / "report.json").write_text(json.dumps(saved))
    with pytest.raises(ReportError, match="report.json names the repeat .*seed1 is a folder named already"):
        write_report(runs, tmp_path / "out")


def test_a_report_of_an_unfinished_comparison_says_so_and_of_a_missing_folder_refuses(tmp_path, capsys):
    """A report of a comparison's folder while its stages run (or after they stopped) was written
    as any other, its missing cells '—', with nothing to say the comparison was unfinished; and a
    folder that does not exist was called an unfinished run directory."""
    runs = tmp_path / "runs"
    _paper_runs(runs)
    (runs / "unfinished.txt").write_text("tools/compare.py has not finished\n")
    assert write_report([runs])["unfinished"] is True
    assert f"warning: the comparison writing to {runs} has not finished its stages" in capsys.readouterr().err
    assert "**Unfinished:** the comparison writing to this folder" in (runs / "report.md").read_text()
    (runs / "unfinished.txt").unlink()
    assert "unfinished" not in write_report([runs])
    assert "Unfinished" not in (runs / "report.md").read_text() and not capsys.readouterr().err
    with pytest.raises(ReportError, match=f"^{tmp_path / 'gone'} does not exist; name run directories, or the output"):
        write_report([tmp_path / "gone"])


def test_a_repeat_scored_on_other_test_images_is_refused(tmp_path):
    """The gaps over pre-training seeds take the test images as what the repeats share; a repeat
    scored on another data.val was summed up with the report as if it were the same comparison.
    The same test set spelled another way is a repeat."""
    def scored_on(root, seed, val):
        runs = _paper_runs(root, seed)
        for r in runs[2:]:
            cfg = yaml.safe_load((r / "config.yaml").read_text())
            (r / "config.yaml").write_text(yaml.safe_dump({**cfg, "data": {"val": val}}))
        return runs
    test = tmp_path / "test"
    runs = scored_on(tmp_path / "runs", 0, str(test))
    write_report(scored_on(tmp_path / "runs1", 1, str(tmp_path / "other")), tmp_path / "other1", [])
    write_report(scored_on(tmp_path / "runs2", 2, f"{tmp_path}/x/../test"), tmp_path / "same2", [])
    with pytest.raises(ReportError, match=f"^--repeat {tmp_path / 'other1'} was scored on other test images"):
        write_report(runs, tmp_path / "out", [read_repeat(tmp_path / "other1")])
    assert write_report(runs, tmp_path / "out", [read_repeat(tmp_path / "same2")])["pretrain_seeds"]["seeds"] == 2


def test_runs_scored_on_different_test_sets_are_refused(tmp_path):
    """A gap between fine-tunes or probes scored on different data.val compares other images (it
    was printed as any other); the same set spelled another way, or dev-split runs, are fine."""
    runs = _paper_runs(tmp_path / "runs")
    for r in runs[2:]:
        cfg = yaml.safe_load((r / "config.yaml").read_text())
        (r / "config.yaml").write_text(yaml.safe_dump({**cfg, "data": {"val": str(tmp_path / "test")}}))
    assert write_report(runs, tmp_path / "same")
    scratch = tmp_path / "runs" / "ft_scratch_1"
    cfg = yaml.safe_load((scratch / "config.yaml").read_text())
    (scratch / "config.yaml").write_text(yaml.safe_dump({**cfg, "data": {"val": str(tmp_path / "test") + "/",
                                                                          "val_num_samples": 7}}))
    assert write_report(runs, tmp_path / "spelled")  # a manifest's count is its own: val_num_samples unread
    (scratch / "config.yaml").write_text(yaml.safe_dump({**cfg, "data": {"val": str(tmp_path / "other")}}))
    with pytest.raises(ReportError, match="ft_scratch_1 were scored on different test sets|ft_scratch_1 and .* were "
                                          "scored on different test sets"):
        write_report(runs, tmp_path / "other")


def test_paper_figures_give_a_third(tmp_path):
    rep = write_report(_paper_runs(tmp_path / "runs"), tmp_path / "out")
    full = rep["derived"]["finetune"]["1"]
    assert full["supervised_minus_mpp"] == pytest.approx(4.1)
    assert full["mpp_minus_scratch"] == pytest.approx(2.0)
    assert full["recovered_share"] == pytest.approx(2.0 / 6.1, abs=1e-3)  # ~0.328
    assert rep["derived"]["finetune"]["0.1"]["recovered_share"] == pytest.approx(0.5)
    assert rep["derived"]["linear_top1"]["supervised_minus_mpp"] == pytest.approx(25.0)
    assert rep["derived"]["linear_top1"]["recovered_share"] is None  # no scratch probe
    assert rep["derived"]["fewshot"]["5"]["supervised_minus_mpp"] == pytest.approx(25.0)
    t = rep["table"]
    assert t["scratch"]["finetune"] == {"1": 0.779, "0.1": 0.5}
    assert t["mpp"]["pretrain"]["dir"].endswith("mpp") and t["scratch"]["pretrain"] is None
    md = (tmp_path / "out" / "report.md").read_text()
    assert "79.9" in md and "84.0" in md
    rows = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| fine-tune @ ")}
    assert rows["fine-tune @ 100% labels"].rstrip(" |").endswith("| 0.33")  # the share cell itself, not its header
    assert rows["fine-tune @ 10% labels"].rstrip(" |").endswith("| 0.50")
    assert ("- fine-tune @ 100% labels: share recovered no ±: the noise of supervised - scratch, the share's "
            "denominator, is unknown") in md  # one seed per arm: a bare share, said why
    assert "Neither counts the pre-training's own seed" in md and "pretrain_seeds: N repeats" in md  # its scope
    assert "recovers; the paper's is 0.33 (ViT-B/16 ImageNet fine-tunes)" in md  # the intro's yardstick, to 2 digits
    assert json.loads((tmp_path / "out" / "report.json").read_text())["derived"] == rep["derived"]
    assert (tmp_path / "out" / "report.png").stat().st_size > 1000


def test_data_a_run_could_not_use_is_reported(tmp_path):
    """A run that skipped training samples or test images says so in the report; clean runs add nothing."""
    runs = _paper_runs(tmp_path / "runs")
    assert write_report(runs, tmp_path / "clean")["skipped"] == {}
    assert "Data skipped" not in (tmp_path / "clean" / "report.md").read_text()
    m = json.loads((runs[2] / "metrics.json").read_text())
    (runs[2] / "metrics.json").write_text(json.dumps({**m, "skipped_samples": {"corrupt_image": 3},
                                                      "val_skipped_samples": {"corrupt_tar": 1}}))
    rep = write_report(runs, tmp_path / "out")
    assert rep["skipped"] == {str(runs[2]): {"skipped_samples": {"corrupt_image": 3},
                                             "val_skipped_samples": {"corrupt_tar": 1}}}
    md = (tmp_path / "out" / "report.md").read_text()
    assert f"- `{runs[2]}`: training corrupt_image 3; evaluation corrupt_tar 1" in md


def test_undefined_share_is_explained():
    assert derive(0.5, 0.6, 0.5)["recovered_share"] is None
    assert "does not beat scratch" in derive(0.5, 0.6, 0.5)["note"]
    assert "does not beat scratch" in derive(0.4, 0.6, 0.5)["note"]
    assert derive(0.6, 0.45, 0.5)["recovered_share"] == pytest.approx(-0.5)  # MPP below scratch: negative


def test_an_undefined_share_says_why_in_the_report(tmp_path):
    """Supervised pre-training below scratch at 10% labels leaves the share without a denominator:
    its cell reads 'undefined' and a note under the table says why, so that a reader does not take
    a blank for a missing run."""
    runs = _paper_runs(tmp_path / "runs")
    (tmp_path / "runs" / "ft_sup_0.1" / "metrics.json").write_text(json.dumps({"top1": 0.45, "top5": 0.95}))
    rep = write_report(runs, tmp_path / "out")
    g = rep["derived"]["finetune"]["0.1"]
    assert g["recovered_share"] is None and "does not beat scratch" in g["note"]
    md = (tmp_path / "out" / "report.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| fine-tune @ 10% labels |"))
    assert row.rstrip(" |").endswith("| undefined")
    assert f"- fine-tune @ 10% labels: {g['note']}" in md.splitlines()


def test_a_share_over_a_gain_within_its_noise_gets_no_plus_minus(tmp_path):
    """Supervised 2.4 points over scratch, within that gap's noise: the share (4.3) is printed
    without a first-order ± (its denominator could be 0), and the report says why; a clear gain
    keeps its ±. An arm's unknown noise gives no ±, said so too."""
    def gaps(supervised: float) -> dict:
        rng = np.random.default_rng(0)
        per_run = {f: ("same", (rng.random((3, 1000)) < p).astype(float))
                   for f, p in (("supervised", supervised), ("mpp", 0.603), ("scratch", 0.50))}
        acc = {f: float(x.mean()) for f, (_, x) in per_run.items()}
        sem = {f: float(x.mean(1).std(ddof=1) / np.sqrt(3)) for f, (_, x) in per_run.items()}
        return derive(acc["supervised"], acc["mpp"], acc["scratch"], sem, per_run)
    g = gaps(0.524)
    assert g["significant"]["supervised_minus_scratch"] is False and g["recovered_share"] > 1
    assert g["share_noise"] is None and "within its noise" in g["note"]
    clear = gaps(0.80)
    assert clear["significant"]["supervised_minus_scratch"] and clear["share_noise"] > 0 and "note" not in clear
    # seeds alone (no per-image results, so no verdict): the same rule on the ± they give
    alone = derive(0.524, 0.603, 0.50, {"supervised": 0.02, "mpp": 0.02, "scratch": 0.02})
    assert alone["significant"]["supervised_minus_scratch"] is None and alone["share_noise"] is None
    assert "2.83 pp, seeds only) is within its noise" in alone["note"]
    assert derive(0.80, 0.603, 0.50, {"supervised": 0.02, "mpp": 0.02, "scratch": 0.02})["share_noise"] > 0
    # an unknown noise (single fine-tunes): no ±, said so, whether the denominator's or another arm's
    single = derive(0.80, 0.603, 0.50, {"supervised": 0.02, "mpp": None, "scratch": 0.02})
    assert single["share_noise"] is None
    assert single["note"] == "no ±: the noise of an arm's figure is unknown, so the share's is too"
    assert "supervised - scratch, the share's denominator, is unknown" in derive(0.80, 0.603, 0.50)["note"]


def test_a_probe_gap_between_other_test_images_counts_their_sampling():
    """Probes have no seed noise, only the test images' sampling: two probes that scored other
    test images (another labels digest) get it unpaired, not a significant gap of ± 0."""
    hits = np.arange(1000) % 3 == 0
    same = {"supervised": ("d1", hits[None]), "mpp": ("d1", ~hits[None])}  # one fit each: 1 x images
    apart = {"supervised": ("d1", hits[None]), "mpp": ("d2", ~hits[None])}
    sem = {"supervised": 0.0, "mpp": 0.0, "scratch": None}
    assert derive(0.501, 0.5, None, sem=sem, per_run=same)["noise"]["supervised_minus_mpp"] > 0
    g = derive(0.501, 0.5, None, sem=sem, per_run=apart)
    assert g["noise"]["supervised_minus_mpp"] == pytest.approx(100 * np.sqrt(2 * hits.var(ddof=1) / 1000), abs=1e-3)
    assert g["significant"]["supervised_minus_mpp"] is False


def test_role_override_and_clear_errors(tmp_path):
    ext = _run(tmp_path, "ft_timm", {"objective": "classify", "finetune": {"init": "/elsewhere/vit.safetensors"}},
               {"top1": 0.5})
    with pytest.raises(ReportError, match="role"):
        write_report([ext], tmp_path / "out")
    (ext / "metrics.json").write_text(json.dumps({"top1": 0.5, "role": "supervised"}))
    assert write_report([ext], tmp_path / "out")["table"]["supervised"]["finetune"] == {"1": 0.5}
    a = _run(tmp_path, "a", {"objective": "classify"}, {"top1": 0.5})
    b = _run(tmp_path, "b", {"objective": "classify"}, {"top1": 0.6})
    with pytest.raises(ReportError, match="same report cell"):
        write_report([a, b], tmp_path / "out")
    pct = _run(tmp_path, "pct", {"objective": "classify"}, {"top1": 79.9})
    with pytest.raises(ReportError, match=r"in \[0, 1\]"):
        write_report([pct], tmp_path / "out")
    zero = _run(tmp_path, "zero", {"objective": "classify"}, {"top1": 0.0})  # a diverged run still reports
    assert write_report([zero], tmp_path / "out")["table"]["scratch"]["finetune"] == {"1": 0.0}
    pre = _run(tmp_path, "pre", {"objective": "mpp"}, {"steps": 1, "role": "scratch"})
    with pytest.raises(ReportError, match="pre-training run cannot have role 'scratch'"):
        write_report([pre], tmp_path / "out")


def test_relative_init_paths_resolve_from_elsewhere(tmp_path, monkeypatch):
    """Runs launched from tmp_path with relative paths, reported from another directory."""
    monkeypatch.chdir(tmp_path)
    _run(tmp_path, "exp/pre", {"objective": "supervised"}, {"steps": 5})
    _run(tmp_path, "exp/ft", {"objective": "classify", "finetune": {"init": "exp/pre"}}, {"top1": 0.5})
    monkeypatch.chdir(ROOT)
    rep = write_report([tmp_path / "exp/pre", tmp_path / "exp/ft"], tmp_path / "out")
    assert rep["table"]["supervised"]["finetune"] == {"1": 0.5}
    # the same relative path under the current directory comes first (where the runs were launched)
    _run(tmp_path / "here", "exp/pre", {"objective": "mpp"}, {"steps": 5})
    monkeypatch.chdir(tmp_path / "here")
    assert write_report([tmp_path / "exp/ft"], tmp_path / "out2")["table"]["mpp"]["finetune"] == {"1": 0.5}


def test_tool_prints_table_and_fails_in_one_line(tmp_path):
    runs = _paper_runs(tmp_path / "runs")
    ok = run_tool("report", *runs)
    assert ok.returncode == 0, ok.stderr
    assert "share recovered" in ok.stdout and (tmp_path / "runs" / "report.md").is_file()
    (tmp_path / "runs" / "ft_mpp_1" / "feature_cache").mkdir()  # no run: skipped when searching
    whole = run_tool("report", tmp_path / "runs", "--out", tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr  # a directory of runs stands for every run below it
    same = [json.loads((tmp_path / d / "report.json").read_text()) for d in ("whole", "runs")]
    assert same[0]["table"] == same[1]["table"] and same[0]["derived"] == same[1]["derived"]
    assert sorted(r["dir"] for r in same[0]["runs"]) == sorted(map(str, runs))
    bad = run_tool("report", tmp_path / "nope")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "nope does not exist" in bad.stderr
    (tmp_path / "empty").mkdir()
    bad = run_tool("report", tmp_path / "empty")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "metrics.json" in bad.stderr


def _md_table(md: str, first_header: str) -> dict:
    """The markdown table whose header row starts with `first_header`: {row name: {header: cell}}."""
    lines = md.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    head = [c.strip() for c in lines[at].strip("|").split("|")]
    rows = {}
    for line in lines[at + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(head[1:], cells[1:]))
    return rows


def test_each_figure_sits_under_its_header_with_its_own_noise_and_verdict(tmp_path):
    """The report's tables read cell by cell: each fine-tune fraction, the probe and the few-shot
    figure under its own header (its ± in points); a gap within its noise marked not significant
    and one beyond it not; the share's ± its own noise, not the share again."""
    root = tmp_path / "runs"
    runs = [*_paper_runs(root), _run(root, "probe_scratch", {"objective": "mpp", "probe": {"encoder": "none"}},
                                     {"kind": "linear_probe", "top1": 0.395})]
    labels = np.arange(1000) % 10
    for r in runs[-3:]:  # the probes: per-image results, so their gaps have test noise (scratch right on others)
        m = json.loads((r / "metrics.json").read_text())
        order = (np.arange(1000) + (500 if r.name == "probe_scratch" else 0)) % 1000
        (r / "metrics.json").write_text(json.dumps({**m, "outcomes": outcomes.record(
            order < round(1000 * m["top1"]), labels)}))
    rep = write_report(runs, tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    table = _md_table(md, "")
    assert table["supervised pre-training"] == {
        "pre-training": f"`{root / 'sup'}` (100 steps)", "fine-tune top-1 @ 10% labels": "70.0 (n=1)",
        "fine-tune top-1 @ 100% labels": "84.0 (n=1)", "linear top-1 (representation)": "65.0", "5-shot": "55.0 ± 2.0"}
    assert table["from scratch"]["linear top-1 (representation)"] == "39.5"
    probe = _md_table(md, "evaluation")["linear probe"]
    g = rep["derived"]["linear_top1"]
    assert probe["supervised - MPP"] == f"+25.0 ± {g['noise']['supervised_minus_mpp']:.1f}"  # far beyond its noise
    assert probe["MPP - scratch"] == f"+0.5 ± {g['noise']['mpp_minus_scratch']:.1f} not significant"
    assert probe["share recovered (paper: 0.33)"] == f"{g['recovered_share']:.2f} ± {g['share_noise']:.2f}"
    assert g["share_noise"] > 0.01


def test_seeds_give_mean_std_noise_and_significance_and_the_sweep_shows(tmp_path):
    """Three seeds per cell plus the dev-split sweep stages of mpp.compare's layout: cells are
    mean ± sample std (n=3), a gap's noise is the standard error of the difference, a gap under
    twice its noise is marked, dev runs are no cell but show with the value the finals used."""
    root = tmp_path / "runs"
    mpp = _run(root, "mpp", {"objective": "mpp"}, {"steps": 10})
    sup = _run(root, "sup", {"objective": "supervised"}, {"steps": 10})
    runs = [mpp, sup]
    tops = {"supervised": (0.60, 0.62, 0.64), "mpp": (0.59, 0.62, 0.65), "scratch": (0.40, 0.41, 0.42)}
    inits = {"supervised": str(sup), "mpp": str(mpp), "scratch": "none"}
    held, idx = np.arange(40) % 10, np.arange(40)  # pool=auto's development images: token right on 2 more
    chose = {"pool": "token", "pool_dev_top1": {"token": 0.5, "avg": 0.45},
             "pool_dev_outcomes": {"token": outcomes.record(idx < 20, held), "avg": outcomes.record(idx < 18, held)},
             "pool_heldout_top1": {"token": 0.3, "avg": 0.6}}  # the training part's, not what chose
    for fam, accs in tops.items():
        for lr, dev in ((0.01, 0.5), (0.03, 0.55)):
            runs.append(_run(root, f"ft_{fam}/sweep_lr{lr}", {
                "objective": "classify", "seed": 0, "optim": {"lr": lr},
                "finetune": {"init": inits[fam], "label_fraction": 0.1, "dev_fraction": 0.1, "pool": "avg"}},
                {"top1": dev, "evaluated_on": "dev"}))
        pool = "auto" if fam == "scratch" else "avg"  # scratch's finals chose their own (finetune.pool=auto)
        for seed, acc in enumerate(accs):
            runs.append(_run(root, f"ft_{fam}/seed{seed}", {
                "objective": "classify", "seed": seed, "optim": {"lr": 0.03},
                "finetune": {"init": inits[fam], "label_fraction": 0.1, "dev_fraction": 0.0, "pool": pool}},
                {"top1": acc, "evaluated_on": "val", **(chose if pool == "auto" else {"pool": pool})}))
    runs.append(_run(root, "probe_mpp", {"objective": "mpp", "probe": {"encoder": str(mpp)}},
                     {"kind": "linear_probe", "top1": 0.45, "pool": "avg", "probe_l2": 1 / 30000,
                      "probe_val_top1": {"3.33333e-05": 0.46, "0.01": 0.44, "1": 0.3},  # keys as :g writes them
                      "pool_heldout_top1": {"token": 0.37, "avg": 0.46},
                      "pool_heldout_outcomes": {"token": outcomes.record(np.arange(100) < 37, np.arange(100) % 10),
                                                "avg": outcomes.record(np.arange(100) < 46, np.arange(100) % 10)}}))
    runs.append(_run(root, "probe_sup", {"objective": "mpp", "probe": {"encoder": str(sup)}},
                     {"kind": "linear_probe", "top1": 0.6, "pool": "token", "probe_l2": 0.01,
                      "probe_val_top1": {"0.0001": 0.58, "0.01": 0.6, "1": 0.5},
                      "pool_heldout_top1": {"token": 0.7, "avg": 0.5},  # chosen on probe.dev_split: not these
                      "pool_dev_top1": {"token": 0.6, "avg": 0.55},
                      "pool_dev_outcomes": {"token": outcomes.record(np.arange(100) < 60, np.arange(100) % 10),
                                            "avg": outcomes.record(np.arange(100) < 55, np.arange(100) % 10)}}))
    rep = write_report(runs, tmp_path / "out")
    t, g = rep["table"], rep["derived"]["finetune"]["0.1"]
    assert t["mpp"]["finetune"]["0.1"] == pytest.approx(0.62) and t["mpp"]["finetune_n"]["0.1"] == 3
    assert t["mpp"]["finetune_std"]["0.1"] == pytest.approx(0.03) and t["supervised"]["finetune_std"]["0.1"] == \
        pytest.approx(0.02)
    # supervised - MPP = 0 ± sqrt(2^2/3 + 3^2/3) = 2.08 points from the seeds; these finals recorded
    # no per-image results, so the test images' part is unknown: the seeds' part alone, and no
    # verdict (tests/test_outcomes.py give the verdicts)
    assert g["supervised_minus_mpp"] == pytest.approx(0.0, abs=1e-6)
    assert g["noise"]["supervised_minus_mpp"] == pytest.approx((4 / 3 + 9 / 3) ** 0.5, abs=1e-3)
    assert set(g["significant"].values()) == set(g["noise_test"].values()) == {None}
    assert rep["recipes"]["mpp"]["0.1"]["chosen"] == {"optim.lr": 0.03, "finetune.pool": "avg"}
    assert rep["recipes"]["scratch"]["0.1"]["chosen"]["finetune.pool"] == "token"  # what auto chose, and how
    assert rep["recipes"]["mpp"]["0.1"]["pool_choice"] is None
    assert [x["dev_top1"] for x in rep["recipes"]["mpp"]["0.1"]["dev"]] == [0.5, 0.55]
    md = (tmp_path / "out" / "report.md").read_text()
    assert "62.0 ± 3.0 (n=3)" in md and "not significant" in md and "paper: 0.33" in md
    # the seeds' part alone: marked so, and no verdict on it
    assert _md_table(md, "evaluation")["fine-tune @ 10% labels"]["supervised - MPP"] == \
        f"+0.0 ± {g['noise']['supervised_minus_mpp']:.1f} (seeds only)"
    assert "45.0 (avg)" in md and "lr 0.03: 55.0" in md
    probe_noise = 100 * outcomes.paired_sem(np.arange(100) < 46, np.arange(100) < 37)
    assert f"MPP pre-training: token 37.0, avg 46.0 (lead +9.0 ± {probe_noise:.1f} on 100 held-out images)" in md
    dev_noise = 100 * outcomes.paired_sem(np.arange(100) < 60, np.arange(100) < 55)
    assert f"supervised pre-training: token 60.0, avg 55.0 (lead +5.0 ± {dev_noise:.1f} on 100 " \
           "development images)" in md
    noise = 100 * outcomes.paired_sem(idx < 20, idx < 18)  # 5 points' lead, under twice its noise
    assert "pool token (pool by a probe of its labels, development top-1 token 50.0, avg 45.0 on 40 images: " \
           f"lead +5.0 ± {noise:.1f} toss-up)" in md and 5 < 2 * noise
    assert rep["recipes"]["scratch"]["0.1"]["pool_choice"]["lead"]["clear"] is False  # the report's own verdict
    # dev runs without outcomes: no learning-rate toss-up claimed (no lead's noise known); scratch's
    # representation, a toss-up, marks its figures, with no range (its other choice was not retrained)
    g = rep["derived"]["finetune"]["0.1"]
    assert g["recipe_toss_ups"] == g["pool_toss_ups"] == ["scratch"] and not g["range"]
    row = next(line for line in md.splitlines() if line.startswith("| fine-tune @ 10% labels"))
    assert [c.strip().endswith("†") for c in row.strip("| ").split(" | ")[1:]] == [False, True, True, True]
    assert "A toss-up of the representation" in md and "In brackets" not in md
    # an L2 chosen at the grid's edge is flagged (MPP: the weakest), one inside it is not
    assert "supervised pre-training 0.01; MPP pre-training 3.33333e-05." in md
    assert "edge of its grid for MPP pre-training:" in md
    probe_sup = next(r for r in runs if r.name == "probe_sup")
    m = json.loads((probe_sup / "metrics.json").read_text())
    (probe_sup / "metrics.json").write_text(json.dumps({**m, "probe_l2": 1.0}))  # the strongest edge: flagged too
    write_report(runs, tmp_path / "edge")
    assert ("edge of its grid for supervised pre-training, MPP pre-training:"
            in (tmp_path / "edge" / "report.md").read_text())
    (probe_sup / "metrics.json").write_text(json.dumps(m))
    assert "sweep_lr" not in md.split("Runs:")[1]  # dev runs are not listed as table runs
    # pre-trainings that withheld nothing from the data the sweeps split (an override can empty
    # data.withhold): the intro said they withheld the splits; one on other data had none to withhold
    assert "leaves the fine-tunes' development splits out" in md
    def data(run: Path, section: dict) -> None:
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        (run / "config.yaml").write_text(yaml.safe_dump({**cfg, "data": {**cfg.get("data", {}), **section}}))
    for run in runs:
        if run.name.startswith("sweep_lr") or run in (mpp, sup):
            data(run, {"train": "/data/cifar10/train"})
    data(mpp, {"train": "/data/imagenet/train"})
    write_report(runs, tmp_path / "read")
    read = (tmp_path / "read" / "report.md").read_text()
    assert "The supervised pre-training read fine-tunes' development splits (data.withhold empty or short" in read
    data(sup, {"withhold": [[0.1, 0, 0.1]]})
    write_report(runs, tmp_path / "held")
    held = (tmp_path / "held" / "report.md").read_text()
    assert "leaves the fine-tunes' development splits out" in held and "pre-training read" not in held
    # a withheld list short of the splits chosen on (another seed's) is no withholding of them
    data(sup, {"withhold": [[0.1, 1, 0.1], [0.5, 0, 0.1]]})
    write_report(runs, tmp_path / "short")
    assert "The supervised pre-training read fine-tunes' development splits" in (
        tmp_path / "short" / "report.md").read_text()
    with pytest.raises(ReportError, match="same report cell"):  # one seed twice in a cell
        write_report(runs + [_run(root, "ft_mpp/again", {"objective": "classify", "seed": 1, "optim": {"lr": 0.03},
                                                          "finetune": {"init": str(mpp), "label_fraction": 0.1,
                                                                       "pool": "avg"}},
                                  {"top1": 0.6})], tmp_path / "out2")
    with pytest.raises(ReportError, match="no development-split run tried"):  # finals of a value never swept
        write_report(runs + [_run(root, "ft_mpp/stray", {"objective": "classify", "seed": 1, "optim": {"lr": 0.3},
                                                          "finetune": {"init": str(mpp), "label_fraction": 0.1}},
                                  {"top1": 0.6})], tmp_path / "out3")


def test_recipe_lead_says_when_the_development_split_could_not_choose(tmp_path):
    """Both cells choose lr 0.03 by 55.0 against 50.0 on the same 400 development images. Where the
    two values disagree on 20 images the 5-point lead is clear; where they disagree on 380 it is
    under twice its paired standard error: a toss-up. Dev runs without outcomes show the lead alone."""
    root = tmp_path / "runs"
    mpp = _run(root, "mpp", {"objective": "mpp"}, {"steps": 10})
    sup = _run(root, "sup", {"objective": "supervised"}, {"steps": 10})
    labels, idx = np.arange(400) % 10, np.arange(400)
    dev_hits = {"mpp": {0.01: idx < 200, 0.03: idx < 220},           # the 0.03 run adds 20 images
                "supervised": {0.01: idx >= 200, 0.03: idx < 220},   # the two agree on 20 of 400
                "scratch": {0.01: None, 0.03: None}}                 # runs written before dev outcomes
    runs = [mpp, sup]
    for fam, init in (("mpp", mpp), ("supervised", sup), ("scratch", "none")):
        for lr, hits in dev_hits[fam].items():
            top1 = {0.01: 0.5, 0.03: 0.55}[lr]
            runs.append(_run(root, f"ft_{fam}/sweep_lr{lr}", {
                "objective": "classify", "seed": 0, "optim": {"lr": lr},
                "finetune": {"init": str(init), "label_fraction": 0.1, "dev_fraction": 0.1}},
                {"top1": top1, "evaluated_on": "dev",
                 **({} if hits is None else {"outcomes": outcomes.record(hits, labels)})}))
        runs.append(_run(root, f"ft_{fam}/seed0", {"objective": "classify", "seed": 0, "optim": {"lr": 0.03},
                                                    "finetune": {"init": str(init), "label_fraction": 0.1}},
                         {"top1": 0.6, "evaluated_on": "val"}))
    rep = write_report(runs, tmp_path / "out")
    lead = {f: rep["recipes"][f]["0.1"]["lead"] for f in ("mpp", "supervised", "scratch")}
    clear_se = 100 * outcomes.paired_sem(dev_hits["mpp"][0.03], dev_hits["mpp"][0.01])
    tossup_se = 100 * outcomes.paired_sem(dev_hits["supervised"][0.03], dev_hits["supervised"][0.01])
    t = pytest.approx(outcomes.critical(399), abs=1e-3)  # Student's t at 400 development images - 1
    assert lead["mpp"] == {"points": pytest.approx(5.0), "noise": pytest.approx(clear_se, abs=1e-3), "t": t,
                           "clear": True}
    assert lead["supervised"] == {"points": pytest.approx(5.0), "noise": pytest.approx(tossup_se, abs=1e-3),
                                  "t": t, "clear": False}
    assert 2 * clear_se < 5.0 < outcomes.critical(399) * tossup_se
    assert lead["scratch"] == {"points": pytest.approx(5.0), "noise": None, "t": None, "clear": None}
    md = (tmp_path / "out" / "report.md").read_text()
    assert f"+5.0 ± {clear_se:.1f} |" in md and f"+5.0 ± {tossup_se:.1f} toss-up |" in md
    assert "| from scratch | 10% | lr 0.03 | lr 0.01: 50.0, lr 0.03: 55.0 | +5.0 |" in md
    # the gaps table marks every figure with a toss-up arm (supervised), not the others
    assert rep["derived"]["finetune"]["0.1"]["recipe_toss_ups"] == ["supervised"]
    row = next(line for line in md.splitlines() if line.startswith("| fine-tune @ 10% labels"))
    assert [c.strip().endswith("†") for c in row.strip("| ").split(" | ")[1:]] == [True, False, True, True]
    assert "† an arm of this figure" in md
    # the toss-up's cell alone: no figure to mark, so no footnote for one
    write_report([r for r in runs if r.parent.name == "ft_supervised"], tmp_path / "alone")
    alone = (tmp_path / "alone" / "report.md").read_text()
    assert "toss-up" in alone and "†" not in alone
    # finals of the value the split ranked second alone are no cell of the protocol, which retrains the best
    other = _run(root, "ft_mpp/seed0_lr0.01", {"objective": "classify", "seed": 0, "optim": {"lr": 0.01},
                                               "finetune": {"init": str(mpp), "label_fraction": 0.1}},
                 {"top1": 0.6, "evaluated_on": "val"})
    runs = [r for r in runs if r != root / "ft_mpp/seed0"] + [other]
    with pytest.raises(ReportError, match=r"seed0_lr0.01: the final runs of its cell used optim.lr \[0.01\], which "
                                          r"did not score best on the development split \(\[0.03\] did\)"):
        write_report(runs, tmp_path / "out2")


def test_the_shares_range_needs_supervised_above_scratch_in_every_combination():
    """The share recovered, (MPP - scratch) / (supervised - scratch), means nothing where a runner-up
    puts scratch level with or above supervised (a division by zero, or a flipped sign): the gaps
    get their ranges, the share none; where every combination keeps supervised above, it gets one."""
    from mpp.report.recipes import ranges
    for scratch in ([0.55, 0.60], [0.55, 0.65]):
        got = ranges({"supervised": [0.60], "mpp": [0.58], "scratch": scratch})
        assert got["mpp_minus_scratch"] == pytest.approx([100 * (0.58 - scratch[1]), 3.0])
        assert "recovered_share" not in got
    got = ranges({"supervised": [0.60], "mpp": [0.58], "scratch": [0.50, 0.55]})
    assert got["recovered_share"] == pytest.approx([0.6, 0.8])


def test_a_toss_ups_retrained_runner_up_gives_its_figures_a_range(tmp_path):
    """The comparison's runner-up stages: finals of the value the development split ranked second,
    beside the chosen value's. The report keeps the chosen value's runs as the cell whatever order
    the runs come in, lists the other value's test top-1 in the recipe table, and where the choice
    was a toss-up (supervised here, not MPP) gives each figure of that arm its range over both."""
    root = tmp_path / "runs"
    mpp = _run(root, "mpp", {"objective": "mpp"}, {"steps": 10})
    sup = _run(root, "sup", {"objective": "supervised"}, {"steps": 10})
    labels, idx = np.arange(400) % 10, np.arange(400)
    dev_hits = {"mpp": {0.01: idx < 200, 0.03: idx < 220}, "supervised": {0.01: idx >= 200, 0.03: idx < 220}}
    finals = {"supervised": {0.03: (0.70, 0.72), 0.01: (0.60, 0.62)}, "mpp": {0.03: (0.50, 0.52), 0.01: (0.40, 0.40)},
              "scratch": {0.03: (0.30, 0.32)}}
    runs = [mpp, sup]
    for fam, init in (("mpp", mpp), ("supervised", sup), ("scratch", "none")):
        for lr in (0.01, 0.03):
            hits = dev_hits.get(fam, {}).get(lr)
            runs.append(_run(root, f"ft_{fam}/sweep_lr{lr}", {
                "objective": "classify", "seed": 0, "optim": {"lr": lr},
                "finetune": {"init": str(init), "label_fraction": 0.1, "dev_fraction": 0.1}},
                {"top1": {0.01: 0.5, 0.03: 0.55}[lr], "evaluated_on": "dev",
                 **({} if hits is None else {"outcomes": outcomes.record(hits, labels)})}))
        for lr, tops in sorted(finals[fam].items()):  # the runner-up's runs come first
            for seed, top1 in enumerate(tops):
                runs.append(_run(root, f"ft_{fam}/lr{lr}_seed{seed}", {
                    "objective": "classify", "seed": seed, "optim": {"lr": lr},
                    "finetune": {"init": str(init), "label_fraction": 0.1}}, {"top1": top1, "evaluated_on": "val"}))
    rep = write_report(runs, tmp_path / "out")
    t, g = rep["table"], rep["derived"]["finetune"]["0.1"]
    assert [t[f]["finetune"]["0.1"] for f in ("supervised", "mpp", "scratch")] == pytest.approx([0.71, 0.51, 0.31])
    assert rep["recipes"]["supervised"]["0.1"]["chosen"]["optim.lr"] == 0.03
    assert rep["recipes"]["supervised"]["0.1"]["retrained"] == [
        {"values": {"optim.lr": 0.01}, "kind": "value", "top1": pytest.approx(0.61),
         "std": pytest.approx(0.01 * 2 ** 0.5), "n": 2,
         "dirs": [str(root / f"ft_supervised/lr0.01_seed{s}") for s in (0, 1)]}]
    assert g["recipe_toss_ups"] == ["supervised"]  # MPP's lead is clear: its runner-up moves no figure
    assert g["range"] == {"supervised_minus_mpp": pytest.approx([10.0, 20.0]),
                          "supervised_minus_scratch": pytest.approx([30.0, 40.0]),
                          "recovered_share": pytest.approx([0.5, 2 / 3], abs=1e-4)}
    md = (tmp_path / "out" / "report.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| fine-tune @ 10% labels"))
    cells = row.strip("| ").split(" | ")[1:]
    assert cells[0].endswith("† (range +10.0 to +20.0)") and "range" not in cells[1]
    assert cells[3].endswith("† (range 0.50 to 0.67)") and "In brackets, the range" in md
    assert "| lr 0.01: 61.0 ± 1.4 (n=2) |" in md and "| lr 0.01: 40.0 ± 0.0 (n=2) |" in md
    assert f"`{root / 'ft_mpp/lr0.01_seed1'}` (mpp finetune, another value retrained)" in md
    assert f"`{root / 'ft_mpp/lr0.03_seed1'}` (mpp finetune)" in md


def test_what_fine_tuning_added_to_its_start(tmp_path):
    """Fine-tunes that record their start (start_top1, LP-FT's probe on the same labels) show it
    beside their end, averaged over the same seeds; a cell where a seed lacks it shows none."""
    root = tmp_path / "runs"
    sup = _run(root, "sup", {"objective": "supervised"}, {"steps": 100})
    runs = [sup]
    for seed, (start, end) in enumerate(((0.50, 0.54), (0.52, 0.56))):
        runs.append(_run(root, f"ft_sup_{seed}", {"objective": "classify", "seed": seed,
                                                  "finetune": {"init": str(sup), "label_fraction": 0.1}},
                         {"top1": end, "start_top1": start}))
    for seed in (0, 1):
        runs.append(_run(root, f"ft_scratch_{seed}", {"objective": "classify", "seed": seed,
                                                      "finetune": {"init": "none", "label_fraction": 0.1}},
                         {"top1": 0.3, **({"start_top1": 0.2} if seed else {})}))
    rep = write_report(runs, tmp_path / "out")
    assert rep["table"]["supervised"]["finetune_start"] == {"0.1": pytest.approx(0.51)}
    assert rep["table"]["scratch"]["finetune_start"] == {}
    md = (tmp_path / "out" / "report.md").read_text()
    # both seeds gained 4.0: a spread of 0, and no per-image results to say how much the test
    # images alone could move it, so no verdict (a tie of two seeds made any gain look certain)
    assert "| supervised pre-training | 10% | 51.0 | 55.0 | +4.0 ± 0.0 (seeds only) |" in md
    assert "| from scratch | 10%" not in md.split("What fine-tuning added")[1]


@pytest.mark.parametrize("on, scored", [("heldout", "held-out"), ("cv", "cross-validated")])
def test_a_representation_toss_ups_other_pool_gives_its_figures_a_range(tmp_path, on, scored):
    """The comparison's other-representation stages: the chosen value's finals through the pool
    the best sweep stage did not choose, beside the chosen pool's. The chosen pool's runs stay the
    cell (whatever order the runs come in); where that choice was a toss-up on the cell's held-out
    training labels, or on all its labels in folds (MPP here), each figure of the arm gets its
    range over both representations."""
    root = tmp_path / "runs"
    mpp = _run(root, "mpp", {"objective": "mpp"}, {"steps": 10})
    sup = _run(root, "sup", {"objective": "supervised"}, {"steps": 10})
    held, h = np.arange(100) % 10, np.arange(100)
    toss = {"pool": "avg", f"pool_{on}_top1": {"avg": 0.6, "token": 0.5},  # disagree on 90 of 100: a toss-up
            f"pool_{on}_outcomes": {"avg": outcomes.record(h < 60, held), "token": outcomes.record(h >= 50, held)}}
    finals = {"supervised": {"token": (0.70, 0.72)}, "mpp": {"token": (0.40, 0.42), "avg": (0.50, 0.52)},
              "scratch": {"avg": (0.30, 0.32)}}
    chosen = {"supervised": "token", "mpp": "avg", "scratch": "avg"}
    runs = [mpp, sup]
    for fam, init in (("mpp", mpp), ("supervised", sup), ("scratch", "none")):
        for lr, top1 in ((0.01, 0.5), (0.03, 0.55)):
            runs.append(_run(root, f"ft_{fam}/sweep_lr{lr}", {
                "objective": "classify", "seed": 0, "optim": {"lr": lr},
                "finetune": {"init": str(init), "label_fraction": 0.1, "dev_fraction": 0.1, "pool": "auto"}},
                {"top1": top1, "evaluated_on": "dev",
                 **(toss if fam == "mpp" else {"pool": chosen[fam]})}))
        for pool, tops in sorted(finals[fam].items(), key=lambda kv: kv[0] == chosen[fam]):  # the other pool first
            for seed, top1 in enumerate(tops):
                runs.append(_run(root, f"ft_{fam}/{pool}_seed{seed}", {
                    "objective": "classify", "seed": seed, "optim": {"lr": 0.03},
                    "finetune": {"init": str(init), "label_fraction": 0.1, "pool": pool}},
                    {"top1": top1, "evaluated_on": "val", "pool": pool}))
    rep = write_report(runs, tmp_path / "out")
    t, g = rep["table"], rep["derived"]["finetune"]["0.1"]
    assert [t[f]["finetune"]["0.1"] for f in ("supervised", "mpp", "scratch")] == pytest.approx([0.71, 0.51, 0.31])
    assert rep["recipes"]["mpp"]["0.1"]["retrained"] == [
        {"values": {"optim.lr": 0.03, "finetune.pool": "token"}, "kind": "pool", "top1": pytest.approx(0.41),
         "std": pytest.approx(0.01 * 2 ** 0.5), "n": 2, "dirs": [str(root / f"ft_mpp/token_seed{s}") for s in (0, 1)]}]
    assert g["pool_toss_ups"] == g["recipe_toss_ups"] == ["mpp"]
    assert g["range"] == {"supervised_minus_mpp": pytest.approx([20.0, 30.0]),
                          "mpp_minus_scratch": pytest.approx([10.0, 20.0]),
                          "recovered_share": pytest.approx([0.25, 0.5], abs=1e-4)}
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| lr 0.03, pool token: 41.0 ± 1.4 (n=2) |" in md and "the range spans that too" in md
    assert f"(pool by a probe of its labels, {scored} top-1 avg 60.0, token 50.0 on 100 images: lead" in md
    folds = "but for MPP pre-training the representation was chosen by a probe scored in folds over all the cell's"
    assert (folds in md) is (on == "cv")  # the intro's "never chosen on images it trained on" qualified
    assert f"`{root / 'ft_mpp/token_seed1'}` (mpp finetune, another representation retrained)" in md


def test_the_intro_names_the_arms_chosen_in_folds_also_where_a_pre_training_read_the_splits():
    """Where a pre-training read the fine-tunes' development splits the intro said only that the
    choices on those splits were made on images it trained on, and no longer named the arms whose
    representation was chosen in folds instead (MPP's and scratch's 10% cells)."""
    from mpp.report.render import _withheld_note
    cv = {"0.1": {"pool_choice": {"on": "cv"}}, "1.0": {"pool_choice": {"on": "dev"}}}
    recipes = {"supervised": {"0.1": {"pool_choice": {"on": "dev"}}}, "mpp": cv, "scratch": cv}
    for read in (False, True):
        t = {"supervised": {"pretrain": {}}, "mpp": {"pretrain": {"read_dev_splits": read}},
             "scratch": {"pretrain": None}}
        note = _withheld_note(t, recipes)
        assert ("The MPP pre-training read fine-tunes' development splits" in note) is read
        assert "for MPP pre-training and from scratch the representation was chosen by a probe scored in folds" in note


def test_the_intro_names_folds_that_chose_a_final_without_a_sweep(tmp_path):
    """A comparison without a sweep has no recipes: its finals choose their own representation
    (finetune.pool=auto), in folds over the images MPP's pre-training read where pool_folds reaches
    them. The intro named the folds only from a sweep's choice, so there it said nothing of them."""
    root = tmp_path / "runs"
    runs = _paper_runs(root)
    m = root / "ft_mpp_0.1" / "metrics.json"
    written = json.loads(m.read_text())
    for on in ("dev", "cv"):
        m.write_text(json.dumps({**written, "pool": "avg", f"pool_{on}_top1": {"avg": 0.5, "token": 0.4}}))
        rep = write_report(runs, tmp_path / on)
        assert rep["table"]["mpp"]["finetune_folds"] == (["0.1"] if on == "cv" else [])
        md = (tmp_path / on / "report.md").read_text()
        assert ("for MPP pre-training the representation was chosen by a probe scored in folds" in md) is (on == "cv")


def test_the_intro_names_folds_that_chose_a_final_without_a_sweep_where_a_pre_training_read_a_split(tmp_path):
    """Without a sweep (no recipes), an MPP pre-training that read its probe's development split
    (data.withhold emptied) made the intro drop its note on the final chosen in folds
    (finetune.pool_folds): it ended in '.' alone, as if nothing were chosen over images it read."""
    root = tmp_path / "runs"
    runs = _paper_runs(root)
    for name, extra in (("mpp", {}), ("probe_mpp", {"probe": {"encoder": str(root / "mpp"), "dev_split": [0, 0.1]}})):
        cfg = yaml.safe_load((root / name / "config.yaml").read_text())
        cfg = {**cfg, "data": {"train": str(tmp_path / "d")}, **extra}
        (root / name / "config.yaml").write_text(yaml.safe_dump(cfg))
    m = root / "ft_mpp_0.1" / "metrics.json"
    written = json.loads(m.read_text())
    for on in ("dev", "cv"):
        m.write_text(json.dumps({**written, "pool": "avg", f"pool_{on}_top1": {"avg": 0.5, "token": 0.4}}))
        rep = write_report(runs, tmp_path / on)
        assert rep["table"]["mpp"]["pretrain"]["read_dev_splits"] and rep["recipes"]["mpp"] in ({}, None)
        md = (tmp_path / on / "report.md").read_text()
        said = "the images it read (for MPP pre-training the representation was chosen by a probe scored in folds"
        assert (said in md) is (on == "cv") and ("the images it read." in md) is (on == "dev")


def test_a_probes_representation_toss_up_marks_its_probe_and_few_shot_figures(tmp_path):
    """The linear-probe and few-shot rows read the representation each probe chose on its
    development images. Where that lead was within its noise (MPP's here: 1 point, the two
    disagreeing on 2 of 200 images) the arm's probe and few-shot figures get †, as a fine-tune's
    toss-up does, with a legend; a clear lead (supervised's 30 points) marks nothing, and neither
    touches the fine-tune rows."""
    root = tmp_path / "runs"
    runs = [*_paper_runs(root), _run(root, "probe_scratch", {"objective": "mpp", "probe": {"encoder": "none"}},
                                     {"kind": "linear_probe", "top1": 0.30, "5shot_mean": 0.20, "5shot_std": 0.01})]
    labels, idx = np.arange(200) % 10, np.arange(200)

    def report(mpp_avg_right: int) -> str:
        for name, avg_right in (("probe_mpp", mpp_avg_right), ("probe_sup", 60), ("probe_scratch", 60)):
            m = root / name / "metrics.json"  # the [class] token chosen: right on the first 120 of 200
            m.write_text(json.dumps({**json.loads(m.read_text()), "pool": "token",
                                     "pool_dev_top1": {"token": 0.6, "avg": avg_right / 200},
                                     "pool_dev_outcomes": {"token": outcomes.record(idx < 120, labels),
                                                           "avg": outcomes.record(idx < avg_right, labels)}}))
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
        write_report(runs, tmp_path / "out")
        return (tmp_path / "out" / "report.md").read_text()

    rows = lambda md: {line.split(" | ")[0]: line for line in md.splitlines()  # noqa: E731
                       if line.startswith(("| linear probe |", "| 5-shot |", "| fine-tune @"))}
    md = report(118)
    assert "toss-up" in md.split("Linear probe, top-1 of each representation")[1].split("\n")[0]
    assert rows(md)["| linear probe"].startswith("| linear probe | +25.0 † | +10.0 † | +35.0 | 0.29 † |")
    assert rows(md)["| 5-shot"].startswith("| 5-shot | +25.0 † | +10.0 † | +35.0 |")
    assert not any("†" in line for name, line in rows(md).items() if name.startswith("| fine-tune"))
    assert "† on the linear-probe and few-shot rows" in md
    md = report(60)  # MPP's lead now as clear as supervised's
    assert not any("†" in line for line in rows(md).values()) and "† on the linear-probe" not in md


def _lr_sweep(root: Path, dev_hits: dict, *, dev_pool: str | None = None, final_pool: str | None = None,
              final_metrics: dict | None = None) -> list[Path]:
    """A `_cell` of one development-split run per learning rate (`dev_hits`: lr -> which of 400
    development images it got right) and one final run at lr 0.03."""
    labels = np.arange(400) % 10
    dev = [(f"sweep_lr{lr}", lr, 0, dev_pool, {"top1": float(hits.mean()), "outcomes": outcomes.record(hits, labels)})
           for lr, hits in dev_hits.items()]
    return _cell(root, dev, [("seed0", 0.03, 0, final_pool, {"top1": 0.6, **(final_metrics or {})})])


def test_the_recipe_lead_is_over_the_runner_up_of_three_values(tmp_path):
    """With three swept values the chosen one's lead is over the next best (55 vs 54, the two
    disagreeing on most images: a toss-up), not over the worst (55 vs 50, nested: a clear lead),
    which would hide the toss-up."""
    idx = np.arange(400)
    hits = {0.01: idx < 200, 0.03: idx < 220, 0.1: idx >= 184}
    lead = write_report(_lr_sweep(tmp_path / "runs", hits), tmp_path / "out")["recipes"]["supervised"]["0.1"]["lead"]
    assert lead["points"] == pytest.approx(1.0) and lead["clear"] is False
    assert lead["noise"] == pytest.approx(100 * outcomes.paired_sem(idx < 220, idx >= 184), abs=1e-3)
    assert choice_lead(0.55, 0.5, ("d", idx < 220), ("d", idx < 200))["clear"] is True  # over the worst: clear


def test_a_choice_at_the_grids_end_is_marked_and_one_inside_it_is_not(tmp_path):
    """A rate chosen at the top (or the bottom) of three or more tried may have a better one beyond
    the grid: the recipe names the end and the table marks it ‡; a value inside the grid, or one
    of two (always an end), is not marked."""
    idx = np.arange(400)
    cases = {"largest": {0.003: idx < 180, 0.01: idx < 200, 0.03: idx < 220},
             "smallest": {0.03: idx < 220, 0.1: idx < 200, 0.3: idx < 180},
             None: {0.01: idx < 200, 0.03: idx < 220, 0.1: idx < 180}, "two": {0.01: idx < 200, 0.03: idx < 220}}
    for end, hits in cases.items():
        out = tmp_path / f"out_{end}"
        rep = write_report(_lr_sweep(tmp_path / f"runs_{end}", hits), out)
        md = (out / "report.md").read_text()
        if end in ("largest", "smallest"):
            assert rep["recipes"]["supervised"]["0.1"]["edges"] == {"optim.lr": end}
            assert f"lr 0.03 (the {end} lr tried ‡)" in md and "‡ the chosen value is the largest or the smallest" in md
        else:
            assert rep["recipes"]["supervised"]["0.1"]["edges"] == {} and "‡" not in md


def test_the_recipe_lead_holds_when_the_finals_name_their_representation(tmp_path):
    """The comparison's finals set finetune.pool; the lead of the swept value must still be found
    (the representation is no swept key): here a toss-up, which marks the cell's figures."""
    idx = np.arange(400)
    runs = _lr_sweep(tmp_path / "runs", {0.01: idx >= 200, 0.03: idx < 220}, dev_pool="avg", final_pool="avg")
    rep = write_report(runs, tmp_path / "out")
    lead = rep["recipes"]["supervised"]["0.1"]["lead"]
    assert lead is not None and lead["points"] == pytest.approx(5.0) and lead["clear"] is False
    assert rep["derived"]["finetune"]["0.1"]["recipe_toss_ups"] == ["supervised"]


def test_a_representation_choice_without_held_out_outcomes_is_no_toss_up(tmp_path):
    """finetune.pool=auto finals that recorded held-out scores but no per-image outcomes: the
    lead's noise is unknown, so the report claims no toss-up and marks nothing."""
    idx = np.arange(400)
    runs = _lr_sweep(tmp_path / "runs", {0.01: idx >= 200, 0.03: idx < 260}, dev_pool="avg", final_pool="auto",
                     final_metrics={"pool": "avg", "pool_heldout_top1": {"avg": 0.6, "token": 0.5}})
    rep = write_report(runs, tmp_path / "out")
    assert rep["recipes"]["supervised"]["0.1"]["pool_choice"]["lead"] == {"points": pytest.approx(10.0),
                                                                          "noise": None, "t": None, "clear": None}
    assert rep["derived"]["finetune"]["0.1"]["pool_toss_ups"] == [] == rep["derived"]["finetune"]["0.1"][
        "recipe_toss_ups"]


def test_a_lead_pairs_only_runs_scored_on_the_same_split():
    """Two development runs scored on other images (other label digests) have no paired noise:
    no verdict, rather than a paired standard error of unrelated vectors."""
    idx = np.arange(400)
    assert choice_lead(0.55, 0.5, ("d1", idx < 220), ("d2", idx < 200)) == {
        "points": pytest.approx(5.0), "noise": None, "t": None, "clear": None}


def test_a_leads_verdict_takes_students_t_at_one_less_degree_than_the_images():
    """Four development images, three won and none lost: a 75-point lead at 3.0 times its paired
    standard error (25 points), short of Student's 3.182 at 4 - 1 degrees: not clear (at the
    2.776 of 4 degrees it would be)."""
    lead = choice_lead(0.75, 0.0, ("d", np.array([1, 1, 1, 0], bool)), ("d", np.zeros(4, bool)))
    assert lead["noise"] == pytest.approx(100 * np.std([1, 1, 1, 0], ddof=1) / 2, abs=1e-3)
    assert lead["t"] == pytest.approx(3.182, abs=1e-3) and lead["clear"] is False


def test_the_lead_is_over_the_runner_up_the_comparison_retrained_when_two_tie_for_it(tmp_path):
    """lr 0.0003 wins (55); lr 0.001 and lr 0.0001 tie for second (50), given in grid order. The
    comparison breaks the tie by folder name and retrains sweep_lr0.0001, which disagrees with the
    winner on most images (a toss-up); the lead is over that one, not over lr 0.001 (nested in the
    winner: a clear lead), whichever order the runs come in."""
    idx, labels = np.arange(400), np.arange(400) % 10
    dev = [(f"sweep_lr{lr}", lr, 0, None, {"top1": float(h.mean()), "outcomes": outcomes.record(h, labels)})
           for lr, h in ((0.001, idx < 200), (0.0003, idx < 220), (0.0001, idx >= 200))]
    runs = _cell(tmp_path / "runs", dev, [("seed0", 0.0003, 0, None, {"top1": 0.6}),
                                          ("runner_up_seed0", 0.0001, 0, None, {"top1": 0.58})])
    for order in (runs, sorted(runs)):
        rep = write_report(order, tmp_path / "out")
        lead = rep["recipes"]["supervised"]["0.1"]["lead"]
        assert lead["points"] == pytest.approx(5.0) and lead["clear"] is False
        assert rep["derived"]["finetune"]["0.1"]["recipe_toss_ups"] == ["supervised"]


def test_a_config_the_schema_cannot_read_still_gets_the_defaults_it_leaves_out():
    """A run's settings as the report reads them: the schema's defaults under what its config.yaml
    gives, also for a config of a key this mpp does not know (a newer mpp's), so such a run differs
    from its cell's others in nothing it did not set."""
    from mpp.config import settings
    known, unknown = settings({"optim": {"lr": 0.1}}), settings({"optim": {"lr": 0.1}, "newer": {"key": 1}})
    assert known["optim.lr"] == unknown["optim.lr"] == 0.1 and unknown["newer.key"] == 1
    assert {k: v for k, v in unknown.items() if k != "newer.key"} == known


def test_a_setting_of_speed_or_logging_or_a_default_left_out_is_no_swept_key(tmp_path):
    """Sweep stages that differ in train.log_every (a resumed stage may change it) and in a key one
    config leaves at its default and the other writes out (an older mpp's config.yaml) still differ
    only in the learning rate: the finals are the cell, the lead a toss-up."""
    root, idx, labels = tmp_path / "runs", np.arange(400), np.arange(400) % 10
    sup = _run(root, "sup", {"objective": "supervised"}, {"steps": 1})
    ft = {"init": str(sup), "label_fraction": 0.1}

    def run(name, lr, extra, metrics):
        return _run(root, name, {"objective": "classify", "seed": 0, "optim": {"lr": lr, **extra.get("optim", {})},
                                 "train": extra.get("train", {}),
                                 "finetune": {**ft, **({} if metrics["evaluated_on"] == "val" else
                                                       {"dev_fraction": 0.1})}}, metrics)
    runs = [sup, run("sweep_lr0.01", 0.01, {"train": {"log_every": 10}, "optim": {"momentum": 0.9}},
                     {"evaluated_on": "dev", "top1": 0.55, "outcomes": outcomes.record(idx < 220, labels)}),
            run("sweep_lr0.03", 0.03, {"train": {"log_every": 50}},
                {"evaluated_on": "dev", "top1": 0.5, "outcomes": outcomes.record(idx >= 200, labels)}),
            run("seed0", 0.01, {"train": {"log_every": 50}}, {"evaluated_on": "val", "top1": 0.6}),
            run("runner_up_seed0", 0.03, {"train": {"log_every": 10}}, {"evaluated_on": "val", "top1": 0.58})]
    rep = write_report(runs, tmp_path / "out")
    recipe = rep["recipes"]["supervised"]["0.1"]
    assert [x["values"] for x in recipe["dev"]] == [{"optim.lr": 0.01}, {"optim.lr": 0.03}]
    assert rep["table"]["supervised"]["finetune"]["0.1"] == pytest.approx(0.6)
    assert recipe["lead"]["clear"] is False and rep["derived"]["finetune"]["0.1"]["recipe_toss_ups"] == ["supervised"]


def _cell(root: Path, dev: list[tuple], finals: list[tuple]) -> list[Path]:
    """A supervised encoder and one 10%-label cell: `dev` (name, lr, seed, pool, metrics) runs on
    the development split, `finals` (name, lr, seed, pool, metrics) scored on test."""
    sup = _run(root, "sup", {"objective": "supervised"}, {"steps": 1})
    runs = [sup]
    for where, group in (("dev", dev), ("val", finals)):
        for name, lr, seed, pool, metrics in group:
            ft = {"init": str(sup), "label_fraction": 0.1, **({"dev_fraction": 0.1} if where == "dev" else {}),
                  **({"pool": pool} if pool else {})}
            runs.append(_run(root, name, {"objective": "classify", "seed": seed, "optim": {"lr": lr}, "finetune": ft},
                             {"evaluated_on": where, **metrics}))
    return runs


def test_the_cell_is_the_value_whose_best_development_run_won(tmp_path):
    """Two development runs of lr 0.03 (seeds 0 and 1: 56 and 40) against lr 0.01 (55): the seed
    is no swept key, a value ranks by its best run, so lr 0.03's finals are the cell and lr
    0.01's a retrained alternative."""
    runs = _cell(tmp_path / "runs",
                 dev=[("d03s0", 0.03, 0, None, {"top1": 0.56}), ("d03s1", 0.03, 1, None, {"top1": 0.40}),
                      ("d01", 0.01, 0, None, {"top1": 0.55})],
                 finals=[("f03", 0.03, 0, None, {"top1": 0.7}), ("f01", 0.01, 0, None, {"top1": 0.6})])
    rep = write_report(runs, tmp_path / "out")
    assert rep["table"]["supervised"]["finetune"]["0.1"] == pytest.approx(0.7)
    recipe = rep["recipes"]["supervised"]["0.1"]
    assert recipe["chosen"]["optim.lr"] == 0.03 and [x["dev_top1"] for x in recipe["dev"]] == [0.56, 0.40, 0.55]
    assert [(x["values"], x["kind"]) for x in recipe["retrained"]] == [({"optim.lr": 0.01}, "value")]
    assert recipe["lead"] is None  # two development runs of the chosen value: no one lead to show


def test_finals_that_chose_their_representation_stay_one_cell(tmp_path):
    """finetune.pool=auto finals whose seeds chose differently (token, avg, token) are one cell of
    three seeds, not three cells split by what each chose."""
    chose = [{"top1": t, "pool": p, "pool_heldout_top1": {"token": 0.5, "avg": 0.5}}
             for t, p in ((0.60, "token"), (0.62, "avg"), (0.64, "token"))]
    runs = _cell(tmp_path / "runs", dev=[("d03", 0.03, 0, None, {"top1": 0.56}), ("d01", 0.01, 0, None, {"top1": 0.5})],
                 finals=[(f"f{s}", 0.03, s, "auto", chose[s]) for s in range(3)])
    rep = write_report(runs, tmp_path / "out")
    assert rep["table"]["supervised"]["finetune_n"]["0.1"] == 3
    assert rep["table"]["supervised"]["finetune"]["0.1"] == pytest.approx(0.62)
    assert rep["recipes"]["supervised"]["0.1"]["retrained"] == []


def test_a_cells_seeds_of_other_settings_are_refused_not_averaged(tmp_path):
    """Two finals of one cell trained at other rates, with no development-split runs to tell the
    cell from an alternative, would be one mean ± std of two recipes: refused, naming the key (the
    representation too, where it alone differs); seeds that differ only in seed, folder and
    logging are one cell."""
    finals = [("f0", 0.01, 0, None, {"top1": 0.52}), ("f1", 0.3, 1, None, {"top1": 0.18})]
    with pytest.raises(ReportError, match=r"final runs of one report cell \(supervised, 0.1 labels\) differ in optim.lr"):
        write_report(_cell(tmp_path / "a", dev=[], finals=finals), tmp_path / "out")
    pools = [("f0", 0.01, 0, "token", {"top1": 0.52}), ("p0", 0.01, 0, "avg", {"top1": 0.50})]  # a cell's other
    with pytest.raises(ReportError, match=r"differ in finetune.pool and .*; pass the finals of one setting, or the "
                                          r"cell's sweep stages too"):  # representation alone: named (was no key)
        write_report(_cell(tmp_path / "p", dev=[], finals=pools), tmp_path / "out")
    same = _cell(tmp_path / "b", dev=[], finals=[("f0", 0.01, 0, None, {"top1": 0.52}),
                                                 ("f1", 0.01, 1, None, {"top1": 0.48})])
    cfg = yaml.safe_load((same[-1] / "config.yaml").read_text())  # logging, and the encoder's path spelled relative
    cfg["finetune"]["init"] = str(Path(cfg["finetune"]["init"]).relative_to(tmp_path))
    (same[-1] / "config.yaml").write_text(yaml.safe_dump({**cfg, "train": {"log_every": 7}}))
    assert write_report(same, tmp_path / "out2")["table"]["supervised"]["finetune_n"]["0.1"] == 2


def test_a_runner_up_value_and_the_other_representation_are_each_an_alternative(tmp_path):
    """The cell (lr 0.03 through the patch mean) beside two alternatives: lr 0.01 through the
    [class] token (another value, whatever its representation) and lr 0.03 through the [class]
    token (the other representation). Each is listed with its own kind, the other representation
    first (it ranks with its value's best development run, 56, ahead of lr 0.01's 50); the
    representation's choice, made by the winning development run, is reported from that run, not
    from the lr 0.01 run listed before it."""
    labels, idx = np.arange(400) % 10, np.arange(400)
    held = {p: outcomes.record(idx < k, labels) for p, k in (("avg", 240), ("token", 200))}
    won = {"top1": 0.56, "pool": "avg", "pool_heldout_top1": {"avg": 0.60, "token": 0.50},
           "pool_heldout_outcomes": held}
    lost = {"top1": 0.50, "pool": "token", "pool_heldout_top1": {"avg": 0.40, "token": 0.45},
            "pool_heldout_outcomes": {"avg": outcomes.record(idx < 160, labels),
                                      "token": outcomes.record(idx < 180, labels)}}
    runs = _cell(tmp_path / "runs", dev=[("d01", 0.01, 0, "auto", lost), ("d03", 0.03, 0, "auto", won)],
                 finals=[("cell", 0.03, 0, "avg", {"top1": 0.70}), ("other_pool", 0.03, 0, "token", {"top1": 0.66}),
                         ("runner_up", 0.01, 0, "token", {"top1": 0.60})])
    rep = write_report(runs, tmp_path / "out")
    recipe = rep["recipes"]["supervised"]["0.1"]
    assert rep["table"]["supervised"]["finetune"]["0.1"] == pytest.approx(0.70)
    assert [(x["kind"], x["top1"]) for x in recipe["retrained"]] == [("pool", 0.66), ("value", 0.60)]
    assert recipe["pool_choice"]["top1"] == {"avg": 0.60, "token": 0.50} and recipe["pool_choice"]["lead"]["clear"]
    # without the cell's own finals the other representation's are no cell (they were taken as one)
    with pytest.raises(ReportError, match="other_pool: the final runs of its cell read finetune.pool token, but the "
                                          "best development run read avg"):
        write_report([r for r in runs if r.name != "cell"], tmp_path / "out2")


def test_across_pretrain_seeds_counts_the_spread_of_the_repeats():
    """A gap that each repeat measures to ± 0.5 but that moves from +1 to +9 with the pre-training
    seed: over the seeds it is +5 ± (its spread's standard error, with what the repeats share:
    each one's own ±), not significant at the one degree of freedom of two repeats; a gap steady
    across them stays one, and keeps its own ± (the repeats share its test images and draws). The
    share's ± is built alike; where a repeat's own ± is unknown, so is the mean's: no ±, no verdict
    from the spread alone. A repeat that recorded no degrees of freedom has unknown ones (many)."""
    from mpp.gaps import across_pretrain_seeds

    def rep(moving: float, own: float | None = 0.5, dof: float = 40.0) -> dict:
        g = {"supervised_minus_mpp": 20.0, "mpp_minus_scratch": moving, "supervised_minus_scratch": 20.0 + moving,
             "recovered_share": moving / (20.0 + moving), "share_noise": None if own is None else own / 25,
             "noise": dict.fromkeys(("supervised_minus_mpp", "mpp_minus_scratch", "supervised_minus_scratch"), own),
             "noise_test": dict.fromkeys(("supervised_minus_mpp", "mpp_minus_scratch", "supervised_minus_scratch"),
                                         own),
             "dof": {"supervised_minus_mpp": dof, "mpp_minus_scratch": None, "supervised_minus_scratch": None}}
        return {"derived": {"finetune": {"0.1": g}, "linear_top1": g, "fewshot": {}}}
    assert across_pretrain_seeds([rep(1.0)]) == {}
    unequal = across_pretrain_seeds([rep(1.0, 0.3, 40.0), rep(9.0, 0.4, 20.0)])["finetune"]["0.1"]
    assert unequal["supervised_minus_mpp"]["noise"] == pytest.approx(np.sqrt((0.3**2 + 0.4**2) / 2), abs=1e-4)  # RMS
    assert unequal["supervised_minus_mpp"]["t"] == pytest.approx(outcomes.critical(20.0), abs=1e-4)  # the fewest
    a = across_pretrain_seeds([rep(1.0), rep(9.0)])
    x = a["finetune"]["0.1"]["mpp_minus_scratch"]
    noise, df = outcomes.combine((np.std([1.0, 9.0], ddof=1) / np.sqrt(2), 1), (0.5, np.inf))
    assert x["values"] == [1.0, 9.0] and x["mean"] == 5.0 and x["noise"] == pytest.approx(noise, abs=1e-4)
    assert x["t"] == pytest.approx(outcomes.critical(df), abs=1e-4) and x["significant"] is False
    steady = a["finetune"]["0.1"]["supervised_minus_mpp"]
    assert steady["noise"] == pytest.approx(0.5) and steady["significant"] is True  # what the repeats share
    assert steady["t"] == pytest.approx(outcomes.critical(40.0), abs=1e-4)  # at its own degrees of freedom
    # supervised - scratch (21 and 29) is within its noise over two seeds (t at 1 degree of freedom):
    # the share, a ratio over a gain that could be 0, gets no ±; over three steady ones it gets its own
    assert a["linear_top1"]["supervised_minus_scratch"]["significant"] is False
    share = a["linear_top1"]["recovered_share"]
    assert share["noise"] is None and "no ±" in share["note"]
    steady3 = across_pretrain_seeds([rep(4.0), rep(5.0), rep(6.0)])["linear_top1"]["recovered_share"]
    assert steady3["noise"] == pytest.approx(outcomes.combine(
        (np.std([4 / 24, 5 / 25, 6 / 26], ddof=1) / np.sqrt(3), 2), (0.02, np.inf))[0], abs=1e-4)
    unknown = across_pretrain_seeds([rep(1.0), rep(9.0, None)])["finetune"]["0.1"]
    assert all(unknown[g]["noise"] is None and unknown[g]["significant"] is None
               for g in unknown if g != "recovered_share")
    assert unknown["recovered_share"]["noise"] is None and unknown["mpp_minus_scratch"]["mean"] == 5.0
    three = across_pretrain_seeds([rep(4.0), rep(5.0), rep(6.0)])["finetune"]["0.1"]["mpp_minus_scratch"]
    assert three["significant"] is True  # three steady repeats: the spread's 2 degrees of freedom suffice
    old = rep(9.0)  # a repeat reported before mpp recorded the degrees of freedom (a KeyError): unknown, as None
    del old["derived"]["finetune"]["0.1"]["dof"]
    unknown = rep(9.0)
    unknown["derived"]["finetune"]["0.1"]["dof"] = dict.fromkeys(unknown["derived"]["finetune"]["0.1"]["dof"])
    assert across_pretrain_seeds([rep(1.0), old]) == across_pretrain_seeds([rep(1.0), unknown])


def test_across_pretrain_seeds_marks_noise_of_the_seeds_alone_and_keeps_a_figure_a_repeat_lacks(tmp_path):
    """A repeat whose gap's ± counts its seeds alone (no per-image results: `noise_test` None, the
    share's `share_noise_seeds_only`) makes the mean's ± seeds-only: marked so, with no verdict, as
    the main table marks it. A share one repeat could not define stays in the section, said so."""
    from mpp.gaps import across_pretrain_seeds
    from mpp.report.render import render_markdown

    def rep(moving: float, test_part: float | None, share: float | None = 0.3) -> dict:
        gaps = ("supervised_minus_mpp", "mpp_minus_scratch", "supervised_minus_scratch")
        g = {"supervised_minus_mpp": 20.0, "mpp_minus_scratch": moving, "supervised_minus_scratch": 20.0 + moving,
             "recovered_share": share, "share_noise": 0.02, "share_noise_seeds_only": test_part is None,
             "noise": dict.fromkeys(gaps, 0.1), "noise_test": dict.fromkeys(gaps, test_part),
             "dof": dict.fromkeys(gaps, 40.0)}
        return {"derived": {"finetune": {"0.1": g}, "linear_top1": g, "fewshot": {}}}
    known = across_pretrain_seeds([rep(9.8, 0.1), rep(10.0, 0.1)])["finetune"]["0.1"]["mpp_minus_scratch"]
    assert known["significant"] is True and "seeds_only" not in known
    a = across_pretrain_seeds([rep(9.8, 0.1), rep(10.0, None)])
    seeds = a["finetune"]["0.1"]["mpp_minus_scratch"]
    assert seeds["seeds_only"] is True and seeds["significant"] is None and seeds["noise"] is not None
    assert a["finetune"]["0.1"]["recovered_share"]["seeds_only"] is True
    undefined = across_pretrain_seeds([rep(9.8, 0.1), rep(10.0, 0.1, share=None)])["linear_top1"]["recovered_share"]
    assert undefined["values"] == [0.3, None] and undefined["mean"] is None
    report = write_report(_paper_runs(tmp_path / "runs"), tmp_path / "out")
    for across, want in ((a, "| fine-tune @ 10% labels | MPP - scratch | +9.8, +10.0 | +9.9 ± "),
                         (across_pretrain_seeds([rep(9.8, 0.1), rep(10.0, 0.1, share=None)]),
                          "| linear probe | share recovered | 0.30, — | — (not in every repeat) |")):
        md = render_markdown({**report, "pretrain_seeds": {**across, "repeats": []}})
        line = next((x for x in md.splitlines() if x.startswith(want)), None)
        assert line is not None, md
        assert line.endswith("(seeds only) |") or "MPP - scratch" not in want, line


def test_run_directories_from_elsewhere_cannot_blow_up_or_crash_the_report(tmp_path):
    """A run directory is a file tree anyone may hand over: a config.yaml of nested aliases (each
    level ten times the last: 355 bytes made a 294 MB report), a seed that is no number, a probe's
    L2 grid that is no grid: each a one-line ReportError naming the file, nothing built."""
    runs = _paper_runs(tmp_path / "runs")
    cfg = runs[2] / "config.yaml"
    good = cfg.read_text()
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdef", "bcdefg")) + "seed: *g\n"
    import yaml
    from mpp.config import read_yaml

    def with_finetune(section) -> str:
        return yaml.safe_dump({**read_yaml(good), "finetune": section})
    for text, match in ((bomb, r"config.yaml is not valid YAML .*\*a stands for a list or mapping"),
                        (good + "seed: [1, 2]\n", "seed \\[1, 2\\] is not a whole number"),
                        ("steps: " + "[" * 2000 + "]" * 2000 + "\n", "config.yaml is not valid YAML .*nested too deeply"),
                        (good.encode() + b"\xff\xfe\n", "config.yaml is not UTF-8 text"),
                        (with_finetune([1]), "finetune is a YAML list, not a mapping"),
                        (with_finetune({"label_fraction": "abc"}), "label_fraction 'abc' is not a number"),
                        (with_finetune({"init": 5}), "the encoder it read, 5, is no path")):
        cfg.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(ReportError, match=match):
            write_report(runs, tmp_path / "out")
    cfg.write_text(good)
    m = runs[2] / "metrics.json"
    kept = m.read_bytes()
    m.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ReportError, match="metrics.json is not valid JSON"):
        write_report(runs, tmp_path / "out")
    m.write_bytes(kept)
    probe = next(r for r in runs if (r / "metrics.json").read_text().count("linear_probe"))
    m = json.loads((probe / "metrics.json").read_text())
    (probe / "metrics.json").write_text(json.dumps({**m, "probe_val_top1": {"abc": 0.5}}))
    with pytest.raises(ReportError, match="probe_val_top1 is not a mapping of L2 strengths"):
        write_report(runs, tmp_path / "out")
    assert read_yaml("lr: &lr 0.1\nmin_lr: *lr\n") == {"lr": 0.1, "min_lr": 0.1}  # a scalar's alias stays fine


def test_a_reports_folder_re_renders_from_its_plan_and_names_the_runs_it_leaves_out(tmp_path):
    """A report records the runs it was written from (`plan`): re-rendering its folder reads those,
    not a stage of an earlier plan left below it (here a fine-tune that would move the MPP cell),
    and a repeat's report keeps the scratch runs that live in the main folder."""
    runs = _paper_runs(tmp_path / "cmp")
    first = write_report(runs, tmp_path / "cmp", [])
    assert first["plan"] == [p.name for p in runs]
    _run(tmp_path / "cmp", "ft_mpp_0.1_old_lr", {"objective": "classify", "seed": 1,
                                                 "finetune": {"init": str(runs[0]), "label_fraction": 0.1}},
         {"top1": 0.10, "top5": 0.5})
    scratch = [r for r in runs if r.name.startswith("ft_scratch")]
    seed1 = [r for r in _paper_runs(tmp_path / "cmp_seed1") if not r.name.startswith("ft_scratch")]
    write_report([*seed1, *scratch], tmp_path / "cmp_seed1", [])  # as a comparison lays a repeat out
    (tmp_path / "cmp_seed1" / "report.md").unlink()
    for _ in range(2):  # the re-render records the plan again
        again = run_tool("report", tmp_path / "cmp")
        assert again.returncode == 0, again.stderr
        assert "left out 1 run directory below" in again.stdout and "ft_mpp_0.1_old_lr" in again.stdout
        rep = json.loads((tmp_path / "cmp" / "report.json").read_text())
        assert rep["table"] == first["table"] and rep["plan"] == first["plan"]
    again = run_tool("report", tmp_path / "cmp_seed1")
    assert again.returncode == 0, again.stderr  # written in the repeat's folder, not the runs' common parent
    assert (tmp_path / "cmp_seed1" / "report.md").is_file() and not (tmp_path / "report.md").exists()
    rep = json.loads((tmp_path / "cmp_seed1" / "report.json").read_text())
    assert rep["table"]["scratch"]["finetune"] == first["table"]["scratch"]["finetune"]
    assert sorted(d for d in rep["plan"] if d.startswith("..")) == sorted(f"../cmp/{r.name}" for r in scratch)
    assert {r["dir"] for r in rep["runs"]} >= {str(r) for r in scratch}  # named as the main report names them
    assert json.loads((tmp_path / "cmp" / "report.json").read_text())["plan"] == first["plan"]
    every = run_tool("report", tmp_path / "cmp", tmp_path / "cmp" / "ft_mpp_0.1_old_lr", "--out", tmp_path / "all")
    assert every.returncode == 0, every.stderr  # named, it counts (a seed of the MPP cell)
    assert json.loads((tmp_path / "all" / "report.json").read_text())["table"]["mpp"] != first["table"]["mpp"]
    for out in (tmp_path / "cmp", tmp_path / "named"):  # runs named with --out: that folder re-renders from them
        named = run_tool("report", *runs, "--out", out)
        assert named.returncode == 0, named.stderr
        plan = json.loads((out / "report.json").read_text())["plan"]
        assert plan == [os.path.relpath(r.resolve(), out.resolve()) for r in runs]
        again = run_tool("report", out)
        assert again.returncode == 0, again.stderr
        assert json.loads((out / "report.json").read_text())["table"] == first["table"]  # the same runs, as named
    (tmp_path / "view").mkdir()  # reached through a link, the repeat's '../cmp' runs are the same runs
    (tmp_path / "view" / "seed1").symlink_to(tmp_path / "cmp_seed1")
    linked = write_report([tmp_path / "view" / "seed1"])
    assert linked["table"]["scratch"] == first["table"]["scratch"] and linked["out_dir"] == str(tmp_path / "view/seed1")
    shutil.rmtree(tmp_path / "cmp" / "ft_scratch_0.1")
    gone = run_tool("report", tmp_path / "cmp_seed1")
    assert gone.returncode == 2 and gone.stderr.count("\n") == 1 and "ft_scratch_0.1" in gone.stderr
    assert "plan" in gone.stderr
    (tmp_path / "cmp" / "report.json").write_text(json.dumps({"plan": "ft_mpp_1"}))
    bad = run_tool("report", tmp_path / "cmp")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "plan" in bad.stderr


def test_a_searched_folder_is_searched_again_and_no_report_replaces_one_of_other_runs(tmp_path, monkeypatch):
    """A report of a folder searched for its runs records no plan, so the next one finds the runs
    added since (here a second MPP seed); a report whose output folder was not given does not
    replace one there of other runs (a run named alone, whose parent is a comparison's folder)."""
    runs = _paper_runs(tmp_path / "cell")
    assert "plan" not in write_report([tmp_path / "cell"])
    _run(tmp_path / "cell", "ft_mpp_0.1_seed1", {"objective": "classify", "seed": 1,
                                                 "finetune": {"init": str(runs[0]), "label_fraction": 0.1}},
         {"top1": 0.10, "top5": 0.5})
    again = write_report([tmp_path / "cell"])
    assert len(again["runs"]) == len(runs) + 1 and (tmp_path / "cell" / "report.json").is_file()
    with pytest.raises(ReportError, match="report.json is the report of other runs"):  # its runs, not a plan
        write_report([runs[2]])
    assert len(write_report([tmp_path / "cell"])["runs"]) == len(runs) + 1  # still every run below
    monkeypatch.chdir(tmp_path / "cell")  # every run below named one by one, from elsewhere: the same report,
    every = sorted(d.name for d in (tmp_path / "cell").iterdir() if d.is_dir())  # still no plan
    assert "plan" not in write_report(every) and len(write_report(["."])["runs"]) == len(runs) + 1
    _run(tmp_path / "two" / "a", "mpp", {"objective": "mpp"}, {"steps": 1})  # two folders searched, beside a third
    _run(tmp_path / "two" / "b", "sup", {"objective": "supervised"}, {"steps": 1})
    _run(tmp_path / "two" / "c", "sup", {"objective": "supervised", "seed": 3}, {"steps": 1})
    for _ in range(2):  # the same command twice: the report names its runs, so the second is no other runs'
        assert write_report([tmp_path / "two" / "a", tmp_path / "two" / "b"])["plan"] == ["a/mpp", "b/sup"]
    cmp = _paper_runs(tmp_path / "cmp")
    write_report(cmp, tmp_path / "cmp", [])  # as a comparison writes it, with its plan
    with pytest.raises(ReportError, match="report.json is the report of other runs, .*give --out"):
        write_report([cmp[0]])
    assert json.loads((tmp_path / "cmp" / "report.json").read_text())["plan"] == [r.name for r in cmp]
    assert write_report([cmp[0]], tmp_path / "cmp")["plan"] == ["mpp"]  # asked for by name
    (tmp_path / "cmp" / "report.json").write_text('{"plan": 3}')  # a damaged report there is still not replaced
    with pytest.raises(ReportError, match="report.json is the report of other runs"):
        write_report(cmp)


def test_runs_differ_in_their_data_only_when_the_shards_differ(tmp_path, monkeypatch):
    """A comparison's resume takes a shard folder and its manifest.json as one data set (mpp.compare),
    so the report must too: else seeds finished either side of the re-spelling stopped the report
    as finals that differ in data.train. Other paths keep the manifest's name as a difference.
    Paths that exist here are one setting as the resume has it (a run folder and its encoder
    too); a path ending with another is the same only where one is missing here (a moved copy)."""
    from mpp.report.recipes import _differ
    folder, manifest = {"data.train": "data/c10/train"}, {"data.train": "/w/data/c10/train/manifest.json"}
    assert _differ({"settings": folder}, {"settings": manifest}) == []
    assert _differ({"settings": folder}, {"settings": {"data.train": "data/c100/train"}}) == ["data.train"]
    init = {"finetune.init": "runs/a/manifest.json"}
    assert _differ({"settings": {"finetune.init": "runs/a"}}, {"settings": init}) == ["finetune.init"]
    for d in ("a/data", "b/a/data", "run"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "run/encoder.safetensors").touch()
    monkeypatch.chdir(tmp_path)

    def differ(key: str, x: str, y: str) -> list[str]:
        return _differ({"settings": {key: x}}, {"settings": {key: y}})
    assert differ("data.train", "a/data", str(tmp_path / "b/a/data")) == ["data.train"]  # two data sets here
    assert differ("data.train", "a/data", str(tmp_path / "gone/a/data")) == []  # one moved: gone/a/data is a/data now
    assert differ("finetune.init", "run", str(tmp_path / "run/encoder.safetensors")) == []


def test_a_recipes_pool_choice_is_the_best_dev_runs_whatever_order_the_runs_come_in():
    """Several sweep stages chose finetune.pool=auto's representation, each on its own dev images: the
    recipe reports the choice (its top-1s and lead) of the run that scored best on the development
    split, whose choice the comparison's finals used, not of the first run it was given."""
    from mpp.gaps import pool_choice
    from mpp.report.recipes import recipe

    images = np.arange(50) % 5

    def dev_run(lr: float, top1: float, token: float, avg: float) -> dict:
        chose = {"pool": "token", "pool_dev_top1": {"token": token, "avg": avg},
                 "pool_dev_outcomes": {"token": outcomes.record(np.arange(50) < 50 * token, images),
                                       "avg": outcomes.record(np.arange(50) < 50 * avg, images)}}
        return {"dir": f"runs/sweep_lr{lr}", "evaluated_on": "dev", "metrics": {"top1": top1, **chose},
                "settings": {"optim.lr": lr, "finetune.pool": "auto"}}

    worse, best = dev_run(0.01, 0.5, token=0.52, avg=0.5), dev_run(0.03, 0.6, token=0.8, avg=0.4)
    final = {"dir": "runs/seed0", "evaluated_on": "val", "settings": {"optim.lr": 0.03, "finetune.pool": "token"},
             "config": {"optim": {"lr": 0.03}, "finetune": {"pool": "token"}},
             "metrics": {"top1": 0.7, "pool": "token"}}
    got = recipe([worse, best], ["optim.lr"], [final], [])
    assert got["chosen"] == {"optim.lr": 0.03, "finetune.pool": "token"}
    assert got["pool_choice"] == pool_choice(best["metrics"]) != pool_choice(worse["metrics"])
    assert got["pool_choice"]["top1"] == {"token": 0.8, "avg": 0.4} and got["pool_choice"]["lead"]["points"] == 40.0
