"""The gap report: how much MPP pre-training buys over scratch and how far it trails supervised.

Reads run directories (each with `metrics.json` and `config.yaml`) and writes `report.md` (one
table plus the derived figures), `report.json` and `report.png` (grouped bar chart).

How a run declares what it is (no extra bookkeeping needed for runs made by this package):
- kind: `metrics.json` `"kind": "linear_probe"` -> a linear probe (written by
  `mpp.evaluators.linear_probe.run_linear_probe`); otherwise config `objective` mpp | supervised -> pre-training,
  classify -> fine-tuning.
- family (mpp | supervised | scratch): pre-training: its objective; fine-tuning: `scratch` when
  `finetune.init` is `none`, else the objective of the pre-training run `finetune.init` points to
  (a run dir or the `encoder.safetensors` inside one; a relative path is looked up from the
  current directory, then from the run dir's parents); probe: the same via `probe.encoder`.
  An explicit `"role": "mpp" | "supervised" | "scratch"` in `metrics.json` overrides the lookup
  (for encoders from elsewhere, e.g. a timm checkpoint).
- label fraction of a fine-tune: config `finetune.label_fraction`; its seed: config `seed`.
- a fine-tune evaluated on a development split (`"evaluated_on": "dev"`, a sweep stage of
  mpp.compare) is no table cell: it shows in the recipe section, with the config keys in which the
  sweep stages of its cell differ, the value the final runs used and that value's lead over the
  next on the development images, ± its paired standard error (a toss-up when under t times it,
  as for a gap);
  the gaps table marks (†) each fine-tune figure that involves an arm with a toss-up, and each
  linear-probe and few-shot figure of an arm whose probe's representation was one.
- a cell's final runs that used another swept value than the best on its development split (the
  comparison's runner-up stages) are no cell either: the recipe section lists their test top-1,
  and where the choice was a toss-up each figure of that arm gets its range over both values.
- a fine-tune's `start_top1` (its model before the first step: under finetune.head_init=probe
  the encoder with the probe on the same labels) shows beside its end in "what fine-tuning added".
Fine-tunes of one cell with different seeds are averaged: mean ± sample std (n shown). Each gap,
its noise and verdict, the share recovered and the gaps over pre-training seeds: `mpp.gaps`.
Accuracies in `metrics.json` are fractions in [0, 1]; the report shows percent.

Four parts, one idea each: this module holds what the others and their callers share (`ReportError`,
`FAMILIES` and their names, `PAPER_SHARE`), `collect` (the runs into a table, its recipes and
derived figures) and `write_report`; `mpp.report.runs` reads run directories and finds them
(a folder's plan, its search, a comparison's repeats); `mpp.report.recipes` chooses among a cell's
runs (which of its finals are the cell, what its development split chose and by how much);
`mpp.report.render` writes report.md and draws report.png; `mpp.gaps` does the arithmetic.
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from mpp import outcomes
from mpp.fileio import write_atomic
from mpp.gaps import across_pretrain_seeds, added_noise, derive, mean_std, pool_choice, runs_images
from mpp.specs import data_key, dev_split, two_test_sets, val_key

FAMILIES = ("supervised", "mpp", "scratch")
FAMILY_NAMES = {"supervised": "supervised pre-training", "mpp": "MPP pre-training", "scratch": "from scratch"}
PAPER_SHARE = 0.33  # the paper's ViT-B/16 ImageNet fine-tunes: (79.9 - 77.9) / (84.0 - 77.9)


class ReportError(ValueError):
    """A run directory the report cannot place; the message names it and says what to do."""


# the parts import the names above from here, so they come after them
from mpp.report.recipes import ranges, recipe, runner_up, split_finals, swept_keys  # noqa: E402
from mpp.report.render import figures_section, plot, render_markdown  # noqa: E402
from mpp.report.runs import (UNFINISHED, accuracy, check_distinct, describe_run, find_runs,  # noqa: E402
                             previous_repeats, reported, search)


def _draws_sem(row: dict, k: str) -> tuple[float | None, int]:
    """The standard error of a family's `k`-shot mean over its shot draws and its degrees of
    freedom: from the draws where the probe recorded them, else from the std that probes wrote
    before them (a population std)."""
    if row["fewshot_draws"].get(k) is not None:
        draws = row["fewshot_draws"][k][1]
        return outcomes.sem(draws), len(draws) - 1
    std, n = row["fewshot_std"].get(k), row["fewshot_seeds"] or 0
    return (None if std is None or n < 2 else std / math.sqrt(n - 1)), n - 1


def collect(runs: list[dict]) -> dict:
    """Table per family: pre-training dir, fine-tune top-1 per label fraction (mean, std and n over
    seeds), linear top-1 with its representation, few-shot; the recipes chosen on development
    splits; the derived figures per column. Two runs in one cell with the same seed is an error."""
    table = {f: {"pretrain": None, "finetune": {}, "finetune_std": {}, "finetune_n": {}, "finetune_start": {},
                 "finetune_added_noise": {}, "finetune_added_t": {}, "finetune_folds": [],
                 "linear_top1": None, "probe_pool": None, "probe_pool_choice": None,
                 "fewshot": {},
                 "fewshot_std": {}, "fewshot_seeds": None, "fewshot_draws": {}} for f in FAMILIES}
    # (family, fraction | "probe" | "{k}shot") -> (labels digest, per-image top-1 of each run or draw)
    per_run: dict = {}
    seen: dict = {}
    cells: dict = {}  # (family, fraction) -> final runs
    dev: dict = {}    # (family, fraction) -> dev-split runs

    def place(key, run):
        if key in seen:
            raise ReportError(f"two runs fill the same report cell {key}: {seen[key]} and {run['dir']}; pass one")
        seen[key] = run["dir"]

    test_set = _check_one_test_set(runs)
    for r in runs:
        row, m = table[r["family"]], r["metrics"]
        if r["kind"] == "pretrain":
            place((r["family"], "pretrain"), r)
            row["pretrain"] = {"dir": r["dir"], "steps": m.get("steps"), "loss": m.get("loss"),
                              "images": m.get("train_samples"), "read_dev_splits": _read_dev_splits(r, runs)}
        elif r["kind"] == "finetune":
            key = f"{r['label_fraction']:g}"
            if r["evaluated_on"] == "dev":
                dev.setdefault((r["family"], key), []).append(r)
                continue
            cells.setdefault((r["family"], key), []).append(r)
        else:
            place((r["family"], "probe"), r)
            row["linear_top1"] = accuracy(m, "top1", r["dir"])
            per_run[r["family"], "probe"] = runs_images([outcomes.read(m.get("outcomes"))])
            row["fewshot_seeds"] = m.get("fewshot_seeds") if isinstance(m.get("fewshot_seeds"), int) else None
            row["probe_pool"], row["probe_pool_choice"] = m.get("pool"), pool_choice(m)
            try:
                grid = sorted(map(float, m.get("probe_val_top1") or {}))
            except (TypeError, ValueError):
                raise ReportError(f"{r['dir']}/metrics.json: probe_val_top1 is not a mapping of L2 strengths to "
                                  "scores; rerun that probe") from None
            row["probe_l2"], row["probe_l2_grid"] = m.get("probe_l2"), grid
            for k, v in m.items():
                if k.endswith("shot_mean"):
                    shots = k[: -len("shot_mean")]
                    row["fewshot"][shots] = accuracy(m, k, r["dir"])
                    row["fewshot_std"][shots] = m.get(f"{shots}shot_std")
                    row["fewshot_draws"][shots] = _draws(m, shots)
                    per_run[r["family"], f"{shots}shot"] = runs_images(
                        [outcomes.read(e) for e in m.get(f"{shots}shot_outcomes") or []])
    varied = {cell: swept_keys(runs_) for cell, runs_ in dev.items()}  # the keys each cell's sweep varied
    retrained: dict = {}  # (family, fraction) -> the other values' final runs, summed up
    for (f, key), finals in cells.items():
        swept = varied.get((f, key), [])
        finals, others = split_finals(finals, dev.get((f, key), []), swept)
        cells[f, key] = finals
        retrained[f, key] = [runner_up(g, swept, finals) for g in others]
        ends = [accuracy(r["metrics"], "top1", r["dir"]) for r in finals]
        mean, std = mean_std(ends)
        table[f]["finetune"][key], table[f]["finetune_std"][key], table[f]["finetune_n"][key] = mean, std, len(finals)
        if any((pool_choice(r["metrics"]) or {}).get("on") == "cv" for r in finals):  # chose in folds, swept or not
            table[f]["finetune_folds"].append(key)
        per_seed = [outcomes.read(r["metrics"].get("outcomes")) for r in finals]
        per_run[f, key] = runs_images(per_seed)
        if all("start_top1" in r["metrics"] for r in finals):  # LP-FT runs: where each started, on the same images
            starts = [accuracy(r["metrics"], "start_top1", r["dir"]) for r in finals]
            table[f]["finetune_start"][key] = mean_std(starts)[0]
            added = added_noise(ends, starts, per_seed,
                                 [outcomes.read(r["metrics"].get("start_outcomes")) for r in finals])
            table[f]["finetune_added_noise"][key], table[f]["finetune_added_t"][key] = added or (None, None)
    recipes = {f: {key: recipe(runs_, varied[g, key], cells.get((f, key), []), retrained.get((f, key), []))
                   for (g, key), runs_ in dev.items() if g == f} for f in FAMILIES}
    fractions = sorted({k for f in FAMILIES for k in table[f]["finetune"]}, key=float)
    shots = sorted({k for f in FAMILIES for k in table[f]["fewshot"]}, key=int)

    def runs_of(key: str) -> dict:  # derive's per_run
        return {f: per_run[f, key] for f in FAMILIES if per_run.get((f, key))}

    def seeds_noise(fr: str) -> dict:  # derive's sem and dof of the fine-tunes, over their seeds
        std, n = ({f: table[f][key].get(fr) for f in FAMILIES} for key in ("finetune_std", "finetune_n"))
        return {"sem": {f: None if std[f] is None else std[f] / math.sqrt(n[f]) for f in FAMILIES},
                "dof": {f: n[f] - 1 for f in FAMILIES if n[f] is not None}}

    def draws_noise(k: str) -> dict:  # derive's sem and dof of the k-shot figures
        got = {f: _draws_sem(table[f], k) for f in FAMILIES}
        return {"sem": {f: se for f, (se, _) in got.items()}, "dof": {f: df for f, (_, df) in got.items()}}
    derived = {
        "finetune": {fr: derive(*(table[f]["finetune"].get(fr) for f in FAMILIES), **seeds_noise(fr),
                                per_run=runs_of(fr))
                     for fr in fractions},
        "linear_top1": derive(*(table[f]["linear_top1"] for f in FAMILIES),  # a probe's fit has no seed noise
                              sem={f: 0.0 if per_run.get((f, "probe")) else None for f in FAMILIES},
                              per_run=runs_of("probe")),
        "fewshot": {k: derive(*(table[f]["fewshot"].get(k) for f in FAMILIES), **draws_noise(k),
                              draws={f: table[f]["fewshot_draws"].get(k) for f in FAMILIES},
                              per_run=runs_of(f"{k}shot")) for k in shots},
    }
    for fr, g in derived["finetune"].items():  # arms whose recipe the development split could not choose
        cell = {f: recipes[f].get(fr) or {} for f in FAMILIES}
        lr = [f for f in FAMILIES if (cell[f].get("lead") or {}).get("clear") is False]
        g["pool_toss_ups"] = [f for f in FAMILIES  # the representation, chosen by a probe of the cell's labels
                              if ((cell[f].get("pool_choice") or {}).get("lead") or {}).get("clear") is False]
        g["recipe_toss_ups"] = [f for f in FAMILIES if f in lr or f in g["pool_toss_ups"]]
        toss = {"value": lr, "pool": g["pool_toss_ups"]}
        g["range"] = ranges({f: [table[f]["finetune"].get(fr)] + [x["top1"] for x in retrained.get((f, fr), [])
                                                                   if f in toss[x["kind"]]] for f in FAMILIES})
    probed = [f for f in FAMILIES  # the probe's representation, which its few-shot figures read too
              if (((table[f].get("probe_pool_choice") or {}).get("lead") or {}).get("clear") is False)]
    for g in [derived["linear_top1"], *derived["fewshot"].values()]:
        g["probe_toss_ups"] = probed
    return {"table": table, "derived": derived, "recipes": recipes, "label_fractions": fractions, "shots": shots,
            "test_set": test_set}


def _draws(metrics: dict, shots: str) -> tuple[str, list[float]] | None:
    """(digest of the training labels the shots were drawn from, each draw's accuracy) of a probe's
    k-shot figure; None when it recorded no draws (then its draws pair with none)."""
    d, v = metrics.get("fewshot_train_labels"), metrics.get(f"{shots}shot_draws")
    if not isinstance(d, str) or not isinstance(v, list) or not all(isinstance(x, (int, float)) for x in v):
        return None
    return d, [float(x) for x in v]


def _check_one_test_set(runs: list[dict]) -> list | None:
    """Every figure of the table is on one test set: refuse final fine-tunes and probes scored on
    different ones (`mpp.specs.val_key`), whose gaps would compare different images. Returns that
    set's key, as JSON keeps it (None where no run was scored), which a repeat must share."""
    scored = [(r["settings"].get("data.val"), r["settings"].get("data.val_num_samples"), r["dir"]) for r in runs
              if r["kind"] == "probe" or (r["kind"] == "finetune" and r["evaluated_on"] != "dev")]
    if two := two_test_sets(scored):
        (a, where_a), (b, where_b) = two
        raise ReportError(f"{where_a} and {where_b} were scored on different test sets (data.val {a} and "
                          f"{b}), so their gaps would compare other images; report runs of one data.val")
    return list(val_key(*scored[0][:2])) if scored else None


def _read_dev_splits(pretrain: dict, runs: list[dict]) -> bool:
    """Whether a pre-training trained on a development split that fine-tunes or probes of its data
    chose on: one its data.withhold does not list (a comparison's override can empty or shorten
    it). One on other data has nothing to withhold."""
    if not pretrain["settings"].get("data.train"):
        return False
    mine = data_key(pretrain["settings"]["data.train"])
    withheld = {dev_split(*w) for w in pretrain["settings"].get("data.withhold") or ()}
    return not _chosen_on(mine, runs) <= withheld


def _chosen_on(data: str, runs: list[dict]) -> set[tuple]:
    """The development splits (`dev_split`) of `data` that fine-tunes scored on or probes chose on."""
    splits = set()
    for r in runs:
        s = r["settings"]
        if data_key(s.get("data.train")) != data:
            continue
        if r.get("evaluated_on") == "dev":
            splits.add(dev_split(s["finetune.label_fraction"], s["finetune.split_seed"], s["finetune.dev_fraction"]))
        elif r["kind"] == "probe" and s.get("probe.dev_split"):
            splits.add(dev_split(1.0, *s["probe.dev_split"]))
    return splits


def _skipped(metrics: dict) -> dict:
    """What a run could not use, by kind: samples its training skipped, repeated or dropped
    (`skipped_samples`) and images its evaluation could not score (`val_skipped_samples`)."""
    return {k: metrics[k] for k in ("skipped_samples", "val_skipped_samples") if metrics.get(k)}


def write_report(run_dirs: list[str | Path], out_dir: str | Path | None = None,
                 repeats: list[dict] | None = None) -> dict:
    """Read the runs (`find_runs`), write report.md / report.json / report.png to `out_dir`
    (default: the folder named, where one folder that is not a run is named, else the runs' common
    parent directory, and not over a report of other runs there) and return the report dict. Runs named
    (`find_runs`) are recorded in report.json as `plan`, relative to `out_dir`, so that re-rendering
    that folder reads the same runs (`find_runs`). `repeats`: the
    reports of the same comparison with other pre-training seeds (`read_repeat`), summed up with
    this one's (`across_pretrain_seeds`); None: those the report already in `out_dir` names."""
    if not run_dirs:
        raise ReportError("no run directories given; pass the pre-training, fine-tune and probe run dirs")
    alone = len(run_dirs) == 1 and not (Path(run_dirs[0]) / "metrics.json").exists()  # a folder re-rendered
    parent = out_dir is None and not alone  # the output folder is the runs' common parent
    out_dir = out_dir or (run_dirs[0] if alone else None)
    run_dirs, named = find_runs(run_dirs)
    runs = [describe_run(d) for d in run_dirs]
    rep = collect(runs)
    rep["runs"] = [{k: r[k] for k in ("dir", "kind", "family", "label_fraction", "seed", "evaluated_on")}
                   for r in runs]
    rep["skipped"] = {r["dir"]: skipped for r in runs if (skipped := _skipped(r["metrics"]))}
    out = Path(out_dir) if out_dir else Path(os.path.commonpath([Path(d).resolve().parent for d in run_dirs]))
    before, mine = reported(out) if parent else None, {Path(d).resolve() for d in run_dirs}
    if before is not None and before[0] != mine:
        raise ReportError(f"{out / 'report.json'} is the report of other runs, which this one would replace; give "
                          "--out (another folder, or that one to replace it), or name the folder alone to re-render it")
    # a plan for runs named, but none over a report of a folder searched; and one wherever the runs
    # are not every run below `out`, which a report without a plan stands for
    if (named and (before is None or before[1])) or mine != {d.resolve() for d in search(out)}:
        rep["plan"] = [os.path.relpath(Path(d).resolve(), out.resolve()) for d in run_dirs]
    if (out / UNFINISHED).is_file():  # a comparison whose stages are running, or were stopped
        rep["unfinished"] = True
        print(f"warning: the comparison writing to {out} has not finished its stages ({out / UNFINISHED}): this "
              f"report holds the {len(run_dirs)} runs done so far", file=sys.stderr)
    source = "--repeat"
    if repeats is None:
        repeats, source = previous_repeats(out), f"{out / 'report.json'} names the repeat"
    check_distinct(out, rep, repeats, source)
    if repeats:
        rep["pretrain_seeds"] = {**across_pretrain_seeds([rep, *repeats]),
                                 "repeats": [os.path.relpath(r["out_dir"], out) for r in repeats]}
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "report.md", render_markdown(rep) + figures_section(out))
    write_atomic(out / "report.json", json.dumps(rep, indent=2) + "\n")
    plot(rep, out / "report.png")
    rep["out_dir"] = str(out)
    return rep
