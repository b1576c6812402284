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
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import yaml

from mpp import outcomes
from mpp.config import RESULT_NEUTRAL, flatten, read_yaml, same_setting, settings
from mpp.fileio import save_figure, write_atomic
from mpp.gaps import (GAPS, across_pretrain_seeds, added_noise, derive, dev_rank, mean_std, pool_choice,
                      runs_images, significant, sweep_lead)
from mpp.specs import DATA_KEYS, data_key, dev_split, val_key

FAMILIES = ("supervised", "mpp", "scratch")
FAMILY_NAMES = {"supervised": "supervised pre-training", "mpp": "MPP pre-training", "scratch": "from scratch"}
PAPER_SHARE = 0.33  # the paper's ViT-B/16 ImageNet fine-tunes: (79.9 - 77.9) / (84.0 - 77.9)


class ReportError(ValueError):
    """A run directory the report cannot place; the message names it and says what to do."""


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ReportError(f"{path} is missing; is {path.parent} a finished run directory?") from None
    except json.JSONDecodeError as e:
        raise ReportError(f"{path} is not valid JSON ({e}); rerun that step") from None
    if not isinstance(data, dict):
        raise ReportError(f"{path} holds a JSON {type(data).__name__}, not the run's figures (an object); "
                          "rerun that step")
    return data


def _read_config(run_dir: Path) -> dict:
    """A run directory's config.yaml as a mapping (empty for an empty file)."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ReportError(f"{path} is missing; every run directory needs its resolved config.yaml")
    try:
        with open(path) as f:  # a stream names the file in the parser's message
            cfg = read_yaml(f) or {}
    except yaml.YAMLError as e:
        raise ReportError(f"{path} is not valid YAML ({' '.join(str(e).split())}); rerun that step") from None
    if not isinstance(cfg, dict):
        raise ReportError(f"{path} holds a YAML {type(cfg).__name__}, not a config (a mapping); rerun that step")
    return cfg


def _source_family(init: str, run_dir: Path) -> str:
    """The pre-training objective of the run an encoder path points to."""
    # a relative path was relative to where the run was launched: try here, then the run's parents
    found = [b / init for b in (Path.cwd(), *run_dir.resolve().parents) if (b / init).exists()]
    src = found[0] if found else Path(init)
    src = src if src.is_dir() else src.parent
    cfg_file = src / "config.yaml"
    if not cfg_file.is_file():
        raise ReportError(f"{run_dir}: cannot tell which pre-training its encoder {init!r} comes from "
                          f"(no {cfg_file}); add \"role\": \"mpp\"|\"supervised\" to {run_dir}/metrics.json")
    objective = _read_config(src).get("objective")
    if objective not in ("mpp", "supervised"):
        raise ReportError(f"{run_dir}: its encoder's run {src} has objective {objective!r}, not a pre-training; "
                          f"add \"role\" to {run_dir}/metrics.json")
    return objective


def describe_run(run_dir: str | Path) -> dict:
    """{"dir", "kind": pretrain|finetune|probe, "family", "label_fraction", "metrics"} of one run."""
    run_dir = Path(run_dir)
    metrics = _read_json(run_dir / "metrics.json")
    cfg = _read_config(run_dir)
    objective = cfg.get("objective")
    if metrics.get("kind") == "linear_probe":
        kind, source = "probe", (cfg.get("probe") or {}).get("encoder", "")
    elif objective in ("mpp", "supervised"):
        kind, source = "pretrain", None
    elif objective == "classify":
        kind, source = "finetune", (cfg.get("finetune") or {}).get("init", "none")
    else:
        raise ReportError(f"{run_dir}/config.yaml: objective {objective!r} is none of mpp, supervised, classify")
    family = metrics.get("role")
    if family is None:
        if kind == "pretrain":
            family = objective
        elif source in (None, "", "none"):
            family = "scratch"
        else:
            family = _source_family(source, run_dir)
    if family not in FAMILIES:
        raise ReportError(f"{run_dir}/metrics.json: role {family!r} is none of {', '.join(FAMILIES)}")
    if kind == "pretrain" and family == "scratch":
        raise ReportError(f"{run_dir}: a pre-training run cannot have role 'scratch'")
    fraction = float((cfg.get("finetune") or {}).get("label_fraction", 1.0)) if kind == "finetune" else None
    if not isinstance(cfg.get("seed", 0), int) or isinstance(cfg.get("seed"), bool):
        raise ReportError(f"{run_dir}/config.yaml: seed {cfg['seed']!r} is not a whole number; rerun that step")
    return {"dir": str(run_dir), "kind": kind, "family": family, "label_fraction": fraction, "metrics": metrics,
            "seed": cfg.get("seed", 0), "evaluated_on": metrics.get("evaluated_on", "val"), "config": cfg,
            "settings": settings(cfg)}


def _varied(dev_runs: list[dict]) -> list[str]:
    """The config keys in which a cell's development-split runs differ (the swept keys), but for
    the output folder, the seed and keys of speed and logging (RESULT_NEUTRAL), which a comparison
    lets a resumed stage change."""
    return sorted(set().union(*(_differ(dev_runs[0], r) for r in dev_runs[1:])))


def _differ(a: dict, b: dict) -> list[str]:
    """The config keys in which runs `a` and `b` differ, but for those `_varied` leaves out and two
    spellings of one setting (`_same`)."""
    return sorted(k for k in set(a["settings"]) | set(b["settings"]) if k not in ("output_dir", "seed", *RESULT_NEUTRAL)
                  and not _same(k, a["settings"].get(k), b["settings"].get(k)))


def _same(key: str, x, y) -> bool:
    """Whether `x` and `y` are one setting of `key`: as a comparison's resume takes it
    (`mpp.config.same_setting`), or two paths, one of them missing here, the one ending with the
    other (a shard folder and its manifest.json alike). Runs read from a moved copy, or from another
    directory than they were launched in, name paths that the config's rule cannot resolve; where
    both exist it decides, so `a/data` and `b/a/data` stay two data sets."""
    if same_setting(key, x, y):
        return True
    if not (isinstance(x, str) and isinstance(y, str)) or (os.path.exists(x) and os.path.exists(y)):
        return False
    x, y = os.path.normpath(x), os.path.normpath(y)
    if key in DATA_KEYS:
        x, y = x.removesuffix(os.sep + "manifest.json"), y.removesuffix(os.sep + "manifest.json")
    return x == y or x.endswith(os.sep + y) or y.endswith(os.sep + x)


def _values(run: dict, varied: list[str]) -> dict:
    """A run's values of the keys its cell's sweep varied."""
    return {k: run["settings"].get(k) for k in varied}


def _pool(run: dict) -> str | None:
    """The representation a fine-tune used: its finetune.pool, or for a development-split run set
    to auto the one it chose (a comparison's finals set the best sweep stage's choice explicitly)."""
    pool = run["settings"].get("finetune.pool")
    return run["metrics"].get("pool", pool) if pool == "auto" and run["evaluated_on"] == "dev" else pool


def _dev_rank(run: dict) -> tuple:
    """A development-split run's place in its sweep (`mpp.gaps.dev_rank`)."""
    return dev_rank(_accuracy(run["metrics"], "top1", run["dir"]), run["dir"])


def _split_finals(finals: list[dict], dev_runs: list[dict], varied: list[str]) -> tuple[list[dict], list[list[dict]]]:
    """A cell's final runs grouped by their values of the swept keys and their representation: the
    group whose values and representation scored best on the development split is the cell (the
    protocol retrains the best), the others are alternatives (the comparison's runner-up stages:
    the next value, or the best value through the other representation, which ranks right after
    the value's own). One run per seed in each group."""
    def key(r):  # (the swept values, the representation)
        return json.dumps(list(_values(r, varied).values())), _pool(r)

    groups: dict = {}
    for r in finals:
        group = groups.setdefault(key(r), [])
        twin = next((x for x in group if x["seed"] == r["seed"]), None)
        if twin:
            raise ReportError(f"two runs fill the same report cell ({r['family']}, {r['label_fraction']:g} labels, "
                              f"seed {r['seed']}): {twin['dir']} and {r['dir']}; pass one")
        group.append(r)
        differ = _differ(group[0], r)
        if differ:
            raise ReportError(f"the final runs of one report cell ({r['family']}, {r['label_fraction']:g} labels) "
                              f"differ in {', '.join(differ)} ({group[0]['dir']} and {r['dir']}), and a cell's mean "
                              f"± std is over seeds of one setting; pass the finals of one setting, or the "
                              f"development-split runs that chose among them")
    if len(groups) == 1 and not dev_runs:
        return finals, []
    rank: dict = {}  # best dev top-1 first, as the comparison ranks them
    for r in dev_runs:
        k, mine = key(r), _dev_rank(r)
        rank[k] = min(rank.get(k, mine), mine)
    by_values: dict = {}  # the values alone: their finals through another representation come next
    for (values, _), mine in rank.items():
        by_values[values] = min(by_values.get(values, mine), mine)

    def place(g: tuple):
        return (rank[g], 0) if g in rank else (by_values[g[0]], 1) if g[0] in by_values else None
    stray = next((g for g in groups if place(g) is None), None)
    if stray is not None:  # the keys named: the swept ones, or finetune.pool where only the representation differs
        differ = sorted(set().union(*(_differ(groups[stray][0], g[0]) for g in groups.values())))
        raise ReportError(f"{groups[stray][0]['dir']}: the final runs of its cell differ in {', '.join(differ)} "
                          f"and it used values no development-split run tried, so the report cannot tell which runs "
                          f"are the cell; pass the finals of one setting, or the cell's sweep stages too (its "
                          f"development-split runs)")
    order = sorted(groups, key=place)
    best = min(by_values, key=by_values.get)
    if order[0][0] != best:  # only a runner-up's finals: the best value's were left out
        raise ReportError(f"{groups[order[0]][0]['dir']}: the final runs of its cell used {', '.join(varied)} "
                          f"{order[0][0]}, which did not score best on the development split ({best} did), and the "
                          "protocol retrains the best; pass the best value's final runs too (the comparison's seed* "
                          "stages)")
    chosen = min(rank, key=rank.get)[1]  # the representation the best development run read
    if place(order[0])[1] and order[0][1] not in (None, "auto", chosen):  # only the other representation's
        raise ReportError(f"{groups[order[0]][0]['dir']}: the final runs of its cell read finetune.pool "
                          f"{order[0][1]}, but the best development run read {chosen}, and the protocol retrains "
                          "that; pass its final runs too (the comparison's seed* stages)")
    return groups[order[0]], [groups[g] for g in order[1:]]


def _retrained(group: list[dict], varied: list[str], cell: list[dict]) -> dict:
    """Another value's final runs (`kind` value), or the cell's value through the other
    representation (`kind` pool): its values, test top-1 mean and std over its seeds, their dirs."""
    mean, std = mean_std([_accuracy(r["metrics"], "top1", r["dir"]) for r in group])
    values, kind = _values(group[0], varied), "value"
    if values == _values(cell[0], varied) and _pool(group[0]) != _pool(cell[0]):
        values, kind = {**values, "finetune.pool": _pool(group[0])}, "pool"
    return {"values": values, "kind": kind, "top1": mean, "std": std, "n": len(group),
            "dirs": [r["dir"] for r in group]}


def _recipes(dev_runs: list[dict], varied: list[str], finals: list[dict], retrained: list[dict]) -> dict:
    """The sweep of one cell: each dev run's values of the swept keys and its dev top-1, the values
    (plus finetune.pool and head_init) the final runs used, how finetune.pool=auto chose the pool
    (`pool_choice`: the best dev run's, whose choice decides the comparison's other-representation
    retrain), the chosen value's lead, and the other values that were retrained on all the labels
    (`retrained`)."""
    final = _values(finals[0], varied) if finals else {}
    written = flatten(finals[0]["config"]) if finals else {}  # the recipe's other keys, as its config gives them
    dev = [{"values": _values(r, varied), "dev_top1": _accuracy(r["metrics"], "top1", r["dir"])} for r in dev_runs]
    images = [outcomes.read(r["metrics"].get("outcomes")) for r in dev_runs]
    chosen = {**final, **{k: written[k] for k in ("finetune.pool", "finetune.head_init") if k in written}}
    if chosen.get("finetune.pool") == "auto":  # what the run chose (metrics.json), not the setting
        chosen["finetune.pool"] = finals[0]["metrics"].get("pool", "auto")
    # the best dev run first, as the comparison ranks them: its choice is the one the comparison read
    ranked = sorted(dev_runs, key=_dev_rank)
    made = next(filter(None, (pool_choice(r["metrics"]) for r in [*ranked, *finals]
                              if r["metrics"].get("pool") == chosen.get("finetune.pool"))), None)
    return {"dev": dev, "chosen": chosen, "pool_choice": made,
            "lead": sweep_lead(dev, images, {k: chosen[k] for k in varied if k in chosen},
                               [_dev_rank(r) for r in dev_runs]),
            "retrained": retrained}


def _draws_sem(row: dict, k: str) -> tuple[float | None, int]:
    """The standard error of a family's `k`-shot mean over its shot draws and its degrees of
    freedom: from the draws where the probe recorded them, else from the std that probes wrote
    before them (a population std)."""
    if row["fewshot_draws"].get(k) is not None:
        draws = row["fewshot_draws"][k][1]
        return outcomes.sem(draws), len(draws) - 1
    std, n = row["fewshot_std"].get(k), row["fewshot_seeds"] or 0
    return (None if std is None or n < 2 else std / math.sqrt(n - 1)), n - 1


def _ranges(candidates: dict) -> dict:
    """Each fine-tune figure's [low, high] over every combination of the arms' candidate results
    (family -> the chosen value's mean top-1, then those of retrained runner-ups where the choice
    was a toss-up); only the figures an alternative moves. The share's range needs every
    combination to have supervised above scratch."""
    out = {}
    for gap, (a, b) in GAPS.items():
        if None not in (candidates[a][0], candidates[b][0]) and len(candidates[a]) + len(candidates[b]) > 2:
            d = [100.0 * (x - y) for x in candidates[a] for y in candidates[b]]
            out[gap] = [round(min(d), 4), round(max(d), 4)]
    u, m, s = (candidates[f] for f in ("supervised", "mpp", "scratch"))
    combos = [(x, y, z) for x in u for y in m for z in s]
    if len(combos) > 1 and all(None not in c and c[0] > c[2] for c in combos):
        shares = [(y - z) / (x - z) for x, y, z in combos]
        out["recovered_share"] = [round(min(shares), 4), round(max(shares), 4)]
    return out


def collect(runs: list[dict]) -> dict:
    """Table per family: pre-training dir, fine-tune top-1 per label fraction (mean, std and n over
    seeds), linear top-1 with its representation, few-shot; the recipes chosen on development
    splits; the derived figures per column. Two runs in one cell with the same seed is an error."""
    table = {f: {"pretrain": None, "finetune": {}, "finetune_std": {}, "finetune_n": {}, "finetune_start": {},
                 "finetune_added_noise": {}, "finetune_added_t": {},
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

    _check_one_test_set(runs)
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
            row["linear_top1"] = _accuracy(m, "top1", r["dir"])
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
                    row["fewshot"][shots] = _accuracy(m, k, r["dir"])
                    row["fewshot_std"][shots] = m.get(f"{shots}shot_std")
                    row["fewshot_draws"][shots] = _draws(m, shots)
                    per_run[r["family"], f"{shots}shot"] = runs_images(
                        [outcomes.read(e) for e in m.get(f"{shots}shot_outcomes") or []])
    varied = {cell: _varied(runs_) for cell, runs_ in dev.items()}  # the keys each cell's sweep varied
    retrained: dict = {}  # (family, fraction) -> the other values' final runs, summed up
    for (f, key), finals in cells.items():
        swept = varied.get((f, key), [])
        finals, others = _split_finals(finals, dev.get((f, key), []), swept)
        cells[f, key] = finals
        retrained[f, key] = [_retrained(g, swept, finals) for g in others]
        ends = [_accuracy(r["metrics"], "top1", r["dir"]) for r in finals]
        mean, std = mean_std(ends)
        table[f]["finetune"][key], table[f]["finetune_std"][key], table[f]["finetune_n"][key] = mean, std, len(finals)
        per_seed = [outcomes.read(r["metrics"].get("outcomes")) for r in finals]
        per_run[f, key] = runs_images(per_seed)
        if all("start_top1" in r["metrics"] for r in finals):  # LP-FT runs: where each started, on the same images
            starts = [_accuracy(r["metrics"], "start_top1", r["dir"]) for r in finals]
            table[f]["finetune_start"][key] = mean_std(starts)[0]
            added = added_noise(ends, starts, per_seed,
                                 [outcomes.read(r["metrics"].get("start_outcomes")) for r in finals])
            table[f]["finetune_added_noise"][key], table[f]["finetune_added_t"][key] = added or (None, None)
    recipes = {f: {key: _recipes(runs_, varied[g, key], cells.get((f, key), []), retrained.get((f, key), []))
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
        g["range"] = _ranges({f: [table[f]["finetune"].get(fr)] + [x["top1"] for x in retrained.get((f, fr), [])
                                                                   if f in toss[x["kind"]]] for f in FAMILIES})
    probed = [f for f in FAMILIES  # the probe's representation, which its few-shot figures read too
              if (((table[f].get("probe_pool_choice") or {}).get("lead") or {}).get("clear") is False)]
    for g in [derived["linear_top1"], *derived["fewshot"].values()]:
        g["probe_toss_ups"] = probed
    return {"table": table, "derived": derived, "recipes": recipes, "label_fractions": fractions, "shots": shots}


def _draws(metrics: dict, shots: str) -> tuple[str, list[float]] | None:
    """(digest of the training labels the shots were drawn from, each draw's accuracy) of a probe's
    k-shot figure; None when it recorded no draws (then its draws pair with none)."""
    d, v = metrics.get("fewshot_train_labels"), metrics.get(f"{shots}shot_draws")
    if not isinstance(d, str) or not isinstance(v, list) or not all(isinstance(x, (int, float)) for x in v):
        return None
    return d, [float(x) for x in v]


def _accuracy(metrics: dict, key: str, run_dir: str) -> float:
    v = metrics.get(key)
    if not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0 or math.isnan(v):
        raise ReportError(f"{run_dir}/metrics.json: '{key}' is {v!r}; expected an accuracy in [0, 1]")
    return float(v)


def _pct(v) -> str:
    return "—" if v is None else f"{100 * v:.1f}"


def _pp(v) -> str:
    return "—" if v is None else f"{v:+.1f}"


def _pm(v: float | None, noise: float | None) -> str:
    """'+9.3 ± 1.2'; '+9.3' when the noise is unknown."""
    return _pp(v) if v is None or noise is None else f"{v:+.1f} ± {noise:.1f}"


def _with_noise(v: float | None, noise: float | None, t: float | None, seeds_only: bool = False) -> str:
    """'+9.3 ± 1.2', with 'not significant' when under t times its noise; '+9.3' when it is unknown
    (no verdict without t); '+9.3 ± 1.2 (seeds only)', with no verdict, where the noise counts the
    seeds alone (`gaps`: an arm recorded no per-image results, the test images' part unknown)."""
    if seeds_only and noise is not None:
        return _pm(v, noise) + " (seeds only)"
    flag = v is not None and noise is not None and t is not None and not significant(v, noise, t)
    return _pm(v, noise) + (" not significant" if flag else "")


def _gap(g: dict, name: str) -> str:
    return _with_noise(g[name], g["noise"].get(name), g["t"].get(name), seeds_only=g["noise_test"].get(name) is None)


def _range_cell(r: list | None, fmt: str) -> str:
    """' (range +7.7 to +12.0)' for a figure that a toss-up's runner-up moves; '' otherwise."""
    return "" if r is None else f" (range {fmt.format(r[0])} to {fmt.format(r[1])})"


def _seeds_cell(mean: float, std: float | None, n: int) -> str:
    """'62.0 ± 3.0 (n=3)': a mean over seeds, its sample std (none for one seed) and the count."""
    return _pct(mean) + ("" if std is None else f" ± {100 * std:.1f}") + f" (n={n})"


def _finetune_cell(row: dict, fr: str) -> str:
    if fr not in row["finetune"]:
        return "—"
    return _seeds_cell(row["finetune"][fr], row["finetune_std"][fr], row["finetune_n"][fr])


def _lead_cell(lead: dict | None) -> str:
    """'+5.0 ± 1.2', '+0.4 ± 2.0 toss-up', or '+5.0' where the dev runs recorded no outcomes."""
    if lead is None:
        return "—"
    return _pm(lead["points"], lead["noise"]) + (" toss-up" if lead["clear"] is False else "")


def _short(values: dict) -> str:
    return ", ".join(f"{k.rsplit('.', 1)[-1]} {v}" for k, v in values.items()) or "—"


def _check_one_test_set(runs: list[dict]) -> None:
    """Every figure of the table is on one test set: refuse final fine-tunes and probes scored on
    different ones (`mpp.specs.val_key`), whose gaps would compare different images."""
    scored: dict = {}
    for r in runs:
        if r["kind"] == "probe" or (r["kind"] == "finetune" and r["evaluated_on"] != "dev"):
            scored.setdefault(val_key(r["settings"].get("data.val"), r["settings"].get("data.val_num_samples")),
                              r["dir"])
    if len(scored) > 1:
        (a, where_a), (b, where_b) = list(scored.items())[:2]
        raise ReportError(f"{where_a} and {where_b} were scored on different test sets (data.val {a[0]} and "
                          f"{b[0]}), so their gaps would compare other images; report runs of one data.val")


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


def _withheld_note(t: dict, chosen: bool) -> str:
    """What the pre-trainings left out, for the table's intro: the fine-tunes' development splits
    (data.withhold), or, where recipes were `chosen` on such splits, the arms whose pre-training
    read them."""
    kept = [{"mpp": "MPP"}.get(f, f) for f in FAMILIES
            if t[f]["pretrain"] and t[f]["pretrain"].get("read_dev_splits")]
    if not kept or not chosen:
        return (" (the comparison leaves the fine-tunes' development splits out of a pre-training on their training "
                "set, data.withhold, so that no fine-tune's learning rate or representation is chosen on images it "
                "trained on).") if not kept else "."
    many = len(kept) > 1
    return (f". The {' and '.join(kept)} pre-training{'s' if many else ''} read fine-tunes' development splits "
            f"(data.withhold empty or short of them): the learning rates and representations chosen on those splits for "
            f"{'their encoders' if many else 'its encoder'} were chosen on images {'they' if many else 'it'} "
            "trained on.")


def render_markdown(rep: dict) -> str:
    t, d, fracs, shots = rep["table"], rep["derived"], rep["label_fractions"], rep["shots"]
    head = (["", "pre-training"] + [f"fine-tune top-1 @ {100 * float(f):g}% labels" for f in fracs]
            + ["linear top-1 (representation)"] + [f"{k}-shot" for k in shots])
    lines = ["# Self-supervised (MPP) vs supervised pre-training", "",
             "Top-1 accuracy in percent on the held-out test set. Fine-tunes: mean ± sample std over seeds "
             "(n runs); few-shot: mean ± sample std over shot draws. Representation: the one the linear probe chose "
             "on training images its fit left out (below; token: [class] token, avg: mean of the patch tokens). Pre-training: its "
             "steps and the images it read" + _withheld_note(t, any(rep["recipes"].get(f) for f in FAMILIES)), "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for f in FAMILIES:
        row = t[f]
        pre = row["pretrain"]
        steps = (f" ({pre['steps']} steps" + (f" on {pre['images']:,} images" if pre.get("images") else "") + ")"
                 if pre and pre.get("steps") else "")
        pre_cell = "—" if pre is None else f"`{pre['dir']}`{steps}"
        probe = _pct(row["linear_top1"]) + (f" ({row['probe_pool']})" if row.get("probe_pool") else "")
        cells = ([FAMILY_NAMES[f], pre_cell] + [_finetune_cell(row, fr) for fr in fracs] + [probe]
                 + [_pct(row["fewshot"].get(k)) + (f" ± {100 * row['fewshot_std'][k]:.1f}"
                                                   if row["fewshot_std"].get(k) is not None else "") for k in shots])
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Derived figures", "",
              "Gaps in percentage points, ± their standard error from two sources combined: the seeds "
              "(fine-tunes: sqrt(s_a²/n_a + s_b²/n_b); few-shot: the shot draws, paired draw by draw where both "
              "arms drew the same shots; a linear probe's fit has none, and the random-init probe reads one "
              "draw of the initialisation, whose own noise no ± here counts) "
              "and the sampling of the test images (the two arms' per-image results, averaged over seeds or "
              "draws, compared on the same images), less what both hold: how an image's result moves with "
              "the seed or the draw beyond its overall level (counted once, and no more of it than the seeds' "
              "part holds). A gap "
              "under t times its standard error is marked not significant, t being Student's two-sided 95% "
              "quantile at the Welch-Satterthwaite degrees of freedom of those parts (1.96 where the test images "
              "dominate the noise, 4.30 to 12.7 where two seeds per arm do, the more the more one arm's spread "
              "dominates); a gap without ± has unknown noise "
              "(single fine-tunes); a ± marked (seeds only) counts the seeds alone and gives no verdict: an arm "
              "recorded no per-image results, so the test images' part is unknown; arms scored on other "
              "test images count them as two independent samples. "
              "Share = (MPP - scratch) / (supervised - scratch), "
              f"the part of the supervised pre-training gain that MPP recovers; the paper's is {PAPER_SHARE:.2f} "
              "(ViT-B/16 ImageNet fine-tunes); its ± is its standard error from the same two sources, to first "
              "order. Neither counts the pre-training's own seed: these figures come from one pre-training of "
              "each arm" + (", and the section on pre-training seeds below gives each gap over several."
                            if rep.get("pretrain_seeds") else "; the comparison's pretrain_seeds: N repeats the "
                            "pre-trainings and adds each gap over them."), "",
              f"| evaluation | supervised - MPP | MPP - scratch | supervised - scratch | share recovered "
              f"(paper: {PAPER_SHARE:.2f}) |", "|---|---|---|---|---|"]
    rows = ([(f"fine-tune @ {100 * float(fr):g}% labels", d["finetune"][fr]) for fr in fracs]
            + [("linear probe", d["linear_top1"])] + [(f"{k}-shot", d["fewshot"][k]) for k in shots])
    notes, marked, ranged, pooled, probed = [], False, False, False, False
    for name, g in rows:
        share = "—" if g["recovered_share"] is None else f"{g['recovered_share']:.2f}" + (
            "" if g["share_noise"] is None else f" ± {g['share_noise']:.2f}"
            + (" (seeds only)" if g.get("share_noise_seeds_only") else ""))
        if g["recovered_share"] is None and g["mpp_minus_scratch"] is not None:
            notes.append(f"- {name}: {g['note']}")
            share = "undefined"
        elif g["recovered_share"] is not None and g.get("note"):  # a share without ±: why
            notes.append(f"- {name}: share recovered {g['note']}")
        figures = {**{k: _gap(g, k) for k in GAPS}, "recovered_share": share}

        def marks(arms: list[str]) -> set[str]:  # the row's figures (not "—") that involve one of `arms`
            return {k for k, v in figures.items()  # the share involves every arm
                    if v != "—" and set(arms) & set(GAPS.get(k, FAMILIES))}
        # † on every figure of an arm whose recipe, or whose probe's representation, was a toss-up
        dagger = marks(g.get("recipe_toss_ups", []) + g.get("probe_toss_ups", []))
        ranges = g.get("range", {})
        cells = [v + (" †" if k in dagger else "")
                 + _range_cell(ranges.get(k), "{:.2f}" if k == "recovered_share" else "{:+.1f}")
                 for k, v in figures.items()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
        # each footnote only where a figure carries its †
        marked, ranged = marked or bool(marks(g.get("recipe_toss_ups", []))), ranged or bool(ranges)
        pooled = pooled or bool(marks(g.get("pool_toss_ups", [])))
        probed = probed or bool(marks(g.get("probe_toss_ups", [])))
    if notes:
        lines += [""] + notes
    if marked:
        lines += ["", "† an arm of this figure fine-tuned with a recipe its development split could not choose (a "
                  "toss-up in the recipe table below): the ± does not count that choice, and the other value "
                  "may have given another figure."
                  + (" In brackets, the range that choice spans: the figure recomputed with each such arm's "
                     "runner-up value, retrained on all the labels with the same seeds (test top-1 in the recipe "
                     "table), in every combination." if ranged else "")
                  + (" A toss-up of the representation (finetune.pool, chosen by a probe of the cell's own "
                     "training labels) is marked too; where the comparison retrained the chosen value through the "
                     "other representation as well (same seeds), the range spans that too." if pooled else "")]
    if probed:
        lines += ["", "† on the linear-probe and few-shot rows: an arm whose probe chose its representation by a "
                  "lead within its noise (a toss-up in the leads below; the few-shot figures read the same "
                  "representation). The ± does not count that choice, and the other representation, never "
                  "evaluated on the test images, may have given another figure."]
    held = []
    for f in FAMILIES:
        if not (c := t[f].get("probe_pool_choice")):
            continue
        where = "development" if c["on"] == "dev" else "held-out"
        held.append(f"{FAMILY_NAMES[f]}: " + ", ".join(f"{p} {100 * v:.1f}" for p, v in c["top1"].items())
                    + (f" (lead {_lead_cell(c['lead'])} on {c['n']} {where} images)" if c.get("n") and c.get("lead")
                       else f" ({where})"))
    if held:
        lines += ["", "Linear probe, top-1 of each representation on training images its fit left out (development: "
                  "the split of all the labels that the fine-tunes choose on and the pre-trainings withheld, "
                  "probe.dev_split; held-out: a part of the training features; the best is used; its lead ± its "
                  "standard error, paired over those images): " + "; ".join(held) + "."]
    l2s = [(FAMILY_NAMES[f], t[f]["probe_l2"], t[f]["probe_l2_grid"])
           for f in FAMILIES if t[f].get("probe_l2") is not None]
    if l2s:
        edge = [name for name, l2, grid in l2s if len(grid) > 1  # the grid's keys carry 6 digits (:g)
                and any(math.isclose(l2, g, rel_tol=1e-5) for g in (grid[0], grid[-1]))]
        lines += ["", "Linear probe L2 strength, chosen with its representation on the same images: "
                  + "; ".join(f"{name} {l2:g}" for name, l2, _ in l2s) + "."
                  + (f" At the edge of its grid for {', '.join(edge)}: widen probe.l2_grid to check that a value "
                     "beyond it does not do better." if edge else "")]
    lines += _pretrain_seeds_section(rep.get("pretrain_seeds") or {}, _pretrain_seeds(rep))
    starts = [(f, fr) for f in FAMILIES for fr in fracs if fr in t[f]["finetune_start"]]
    if starts:
        lines += ["", "## What fine-tuning added to its start", "",
                  "Each fine-tune's model before its first step (finetune.head_init=probe: the encoder with the "
                  "linear probe fitted on the same training labels) scored on the same test images as at its "
                  "end, mean over the same seeds; what it added ± its standard error (the seeds' gains and the "
                  "test images' sampling, as above).", "",
                  "| fine-tune | labels | start top-1 | end top-1 | added |", "|---|---|---|---|---|"]
        for f, fr in starts:
            start, end = t[f]["finetune_start"][fr], t[f]["finetune"][fr]
            t_added = t[f]["finetune_added_t"][fr]  # None beside a noise: the seeds' part alone (`added_noise`)
            added = _with_noise(100 * (end - start), t[f]["finetune_added_noise"][fr], t_added,
                                seeds_only=t_added is None)
            lines.append(f"| {FAMILY_NAMES[f]} | {100 * float(fr):g}% | {_pct(start)} | {_pct(end)} | {added} |")
    recipes = [(f, fr, r) for f in FAMILIES for fr, r in sorted(rep["recipes"][f].items(), key=lambda x: float(x[0]))]
    if recipes:
        lines += ["", "## Fine-tune recipe chosen on a development split", "",
                  "Each value trained on the labels minus a class-balanced development split and scored on it "
                  "(top-1 %); the best was retrained on all the labels for the table above. Its lead over the "
                  "next value ± the standard error of that difference on the development images: a lead "
                  "under t times it (Student's, at the development images' degrees of freedom: about 2) is a toss-up, "
                  "a choice the split could not make, whose noise the seeds "
                  "do not show.", "",
                  "| fine-tune | labels | chosen | development top-1 per value | lead of the chosen "
                  "| other values retrained (test top-1) |", "|---|---|---|---|---|---|"]
        for f, fr, r in recipes:
            devs = ", ".join(f"{_short(x['values'])}: {_pct(x['dev_top1'])}" for x in r["dev"])
            again = ", ".join(f"{_short(x['values'])}: {_seeds_cell(x['top1'], x['std'], x['n'])}"
                              for x in r["retrained"]) or "—"
            pool = r.get("pool_choice")
            scored = ("development top-1" if pool.get("on") == "dev" else "held-out top-1") if pool else ""
            images = f" on {pool['n']} images" if pool and pool["n"] is not None else ""
            how = (f" (pool by a probe of its training labels, {scored} "
                   f"{', '.join(f'{k} {_pct(v)}' for k, v in pool['top1'].items())}{images}: "
                   f"lead {_lead_cell(pool['lead'])})" if pool else "")
            lines.append(f"| {FAMILY_NAMES[f]} | {100 * float(fr):g}% | {_short(r['chosen'])}{how} | {devs} | "
                         f"{_lead_cell(r.get('lead'))} | {again} |")
    if rep.get("skipped"):
        lines += ["", "## Data skipped", "",
                  "These runs trained or were scored on fewer samples than their data holds (corrupt or "
                  "unreadable data, by kind; training's `padded` samples were repeated to fill a rank):", ""]
        for d, skipped in rep["skipped"].items():
            parts = [f"{'evaluation' if k.startswith('val_') else 'training'} "
                     + ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items())) for k, counts in skipped.items()]
            lines.append(f"- `{d}`: " + "; ".join(parts))
    finals = [r for r in rep["runs"] if r["kind"] != "finetune" or r.get("evaluated_on") != "dev"]
    other = {d: "representation" if x["kind"] == "pool" else "value"
             for f in FAMILIES for r in rep["recipes"][f].values() for x in r["retrained"] for d in x["dirs"]}
    lines += ["", "Runs: " + ", ".join(f"`{r['dir']}` ({r['family']} {r['kind']}"
                                       + (f", another {other[r['dir']]} retrained" if r["dir"] in other else "") + ")"
                                       for r in finals), ""]
    return "\n".join(lines)


def _pretrain_seeds_section(across: dict, seeds: set[tuple]) -> list[str]:
    """The report's lines for `across_pretrain_seeds` (none without repeats); `seeds`: the (arm,
    seed) of this report's own pre-trainings."""
    if not across:
        return []
    own = sorted({s for _, s in seeds})
    said = f" (seed {own[0]})" if len(own) == 1 else (
        " (seeds " + ", ".join(f"{FAMILY_NAMES.get(f, f)} {s}" for f, s in sorted(seeds)) + ")" if own else "")
    lines = ["", f"## Across {across['seeds']} pre-training seeds", "",
             f"The figures above come from one pre-training of each arm{said}, and their ± counts the "
             "fine-tune seeds, shot draws and test images, not the pre-training's own seed. The whole "
             "comparison was repeated with each pre-training seed (the scratch arm, which no pre-training "
             "touches, shared); each gap over the repeats, their mean ± its standard error: the repeats' spread "
             "(at their count less one degree of freedom) and what every repeat shares, the same test images, "
             "shot draws and fine-tune seeds, as each repeat's own ± (which errs large where the spread holds "
             "some of it too); a mean without ± has a repeat whose own noise is unknown, which the spread alone "
             "cannot stand in for. The share's ± is built alike, without a verdict, and left out where a repeat's "
             "supervised - scratch, or its mean over the repeats, is within its noise (a ratio over a gain that "
             "could be 0)."
             + (" The repeats' own reports: " + ", ".join(f"`{d}`" for d in across["repeats"]) + "."
                if across.get("repeats") else ""), "",
             "| evaluation | gap | per pre-training seed | mean over seeds |", "|---|---|---|---|"]
    rows = ([(f"fine-tune @ {100 * float(fr):g}% labels", g) for fr, g in across["finetune"].items()]
            + [("linear probe", across["linear_top1"])] + [(f"{k}-shot", g) for k, g in across["fewshot"].items()])
    names = {"supervised_minus_mpp": "supervised - MPP", "mpp_minus_scratch": "MPP - scratch",
             "supervised_minus_scratch": "supervised - scratch", "recovered_share": "share recovered"}
    for name, g in rows:
        for gap, x in g.items():
            share = gap == "recovered_share"
            fmt = "{:.2f}" if share else "{:+.1f}"
            values = ", ".join("—" if v is None else fmt.format(v) for v in x["values"])
            if x["mean"] is None:  # a repeat lacks it, or could not define the share
                mean = "— (not in every repeat)"
            elif share:
                mean = (f"{x['mean']:.2f}" + ("" if x["noise"] is None else f" ± {x['noise']:.2f}")
                        + (" (seeds only)" if x.get("seeds_only") else ""))
            else:
                mean = _with_noise(x["mean"], x["noise"], x["t"], seeds_only=x.get("seeds_only", False))
            lines.append(f"| {name} | {names[gap]} | {values} | {mean} |")
    return lines


def plot(rep: dict, path: Path) -> None:
    """Grouped bars: one group per evaluation, one bar per family; titled with the share recovered."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t, fracs, shots = rep["table"], rep["label_fractions"], rep["shots"]
    groups = ([(f"fine-tune {100 * float(fr):g}%", lambda row, fr=fr: row["finetune"].get(fr)) for fr in fracs]
              + [("linear", lambda row: row["linear_top1"])]
              + [(f"{k}-shot", lambda row, k=k: row["fewshot"].get(k)) for k in shots])
    spread = [lambda row, fr=fr: row["finetune_std"].get(fr) for fr in fracs] + [lambda row: None] * (1 + len(shots))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(groups) + 2), 4.0))
    width = 0.8 / len(FAMILIES)
    for i, f in enumerate(FAMILIES):
        vals = [get(t[f]) for _, get in groups]
        xs = [g + (i - 1) * width for g in range(len(groups))]
        err = [100 * (get(t[f]) or 0.0) for get in spread]
        bars = ax.bar(xs, [0 if v is None else 100 * v for v in vals], width, label=FAMILY_NAMES[f], yerr=err,
                      capsize=2)
        for b, v in zip(bars, vals):
            if v is not None:
                ax.annotate(f"{100 * v:.1f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)), [name for name, _ in groups])
    ax.set_ylabel("top-1 accuracy (%)")
    shares = [f"{100 * float(fr):g}%: {g['recovered_share']:.2f}" for fr, g in rep["derived"]["finetune"].items()
              if g["recovered_share"] is not None]
    ax.set_title("MPP vs supervised vs scratch" + (" — share recovered " + ", ".join(shares) if shares else ""),
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


FIGURES = {"attention_distance.png": "mean attention distance per head and layer",
           "position_similarity.png": "position-embedding similarity",
           "filters.png": "principal components of the patch-embedding filters"}


def _figures_section(out: Path) -> str:
    """Links to the figures `tools/inspect_encoders.py` drew in OUT/figures, if any."""
    fig = out / "figures"
    if not (fig / "inspect.json").is_file():
        return ""
    try:  # this drawing's grids, not an earlier one's left there
        drawn = json.loads((fig / "inspect.json").read_text()).get("encoders")
    except (OSError, ValueError, AttributeError) as e:  # AttributeError: JSON, but no object
        raise ReportError(f"{fig / 'inspect.json'} is no record of the figures ({type(e).__name__}); delete it: the "
                          "comparison, resumed, draws them again") from None
    grids = {e.get("predictions_png") for e in (drawn.values() if isinstance(drawn, dict) else ()) if isinstance(e, dict)}
    names = [n for n in FIGURES if (fig / n).is_file()] + sorted(
        n for n in grids if isinstance(n, str) and n.startswith("predictions_") and "/" not in n and (fig / n).is_file())
    lines = ["", "## What the encoders learned", ""]
    lines += [f"- {FIGURES.get(n, 'MPP predictions: ' + n[len('predictions_'):-4])}: ![{n}](figures/{n})"
              for n in names]
    return "\n".join(lines) + "\n"


def _plan(path: Path) -> list[Path] | None:
    """The run directories the report in folder `path` was written from (its report.json's `plan`,
    relative to `path`); None where no report records one there. Re-rendering a report's folder
    reads those, not the stages of an earlier comparison plan still below it."""
    file = path / "report.json"
    if (path / "metrics.json").exists() or not file.is_file():
        return None
    plan = _read_json(file).get("plan")
    if plan is not None and not (isinstance(plan, list) and all(isinstance(d, str) for d in plan)):
        raise ReportError(f"{file} holds a 'plan' that is not a list of run directories; rerun the comparison, "
                          "or name the run directories to report")
    return None if plan is None else [_joined(path, d) for d in plan]


def _joined(path: Path, rel: str) -> Path:
    """`path / rel` without its '..' steps (a repeat's plan names 'cmp_seed1/../cmp/...'), or
    resolved where dropping them would pass by a symbolic link (the plan is relative to the
    resolved folder)."""
    whole = path / rel
    short = Path(os.path.normpath(whole))
    return short if short.resolve() == whole.resolve() else whole.resolve()


def _reported(out: Path) -> tuple[set[Path], bool] | None:
    """The runs, resolved, of the report already in folder `out`, and whether it records them (its
    plan) rather than standing for every run below `out`; None where there is none; no runs where
    its plan cannot be read."""
    if (out / "metrics.json").exists() or not (out / "report.json").is_file():
        return None
    try:
        plan = _plan(out)
        if plan is not None:
            return {d.resolve() for d in plan}, True
    except (ReportError, ValueError, OSError):
        return set(), True
    return {d.resolve() for d in _search(out)}, False


def _search(folder: Path) -> list[Path]:
    """Every run directory below `folder` (metrics.json and config.yaml), sorted; none for a run
    itself or a path that is no folder."""
    if (folder / "metrics.json").exists() or not folder.is_dir():
        return []
    return sorted(m.parent for m in folder.rglob("metrics.json") if (m.parent / "config.yaml").is_file())


def find_runs(paths: list[str | Path]) -> tuple[list[Path], bool]:
    """The run directories among `paths`: one holding metrics.json is a run; a directory without
    it stands for the runs the report written there records (`_plan`; those below it that it
    leaves out are named), or, without one, for every run directory below it (a cell's seeds).
    Also whether every run came from a run or a plan named, not from searching a folder: only
    those a report records as its own plan, so a folder searched is searched again next time."""
    found, named = [], True
    for path in map(Path, paths):
        below = _search(path)
        planned = _plan(path)
        if planned is not None:
            if gone := [d for d in planned if not (d / "metrics.json").is_file()]:
                raise ReportError(f"{path / 'report.json'} names in its plan {gone[0]}, which holds no finished run "
                                  "(metrics.json); rerun the comparison, or name the run directories to report")
            kept = {d.resolve() for d in planned}
            if left := [str(d.relative_to(path)) for d in below if d.resolve() not in kept]:
                print(f"[report] {path}: left out {len(left)} run director{'y' if len(left) == 1 else 'ies'} below "
                      f"it that its report.json was not written from (its plan), such as stages of an earlier "
                      f"comparison: {', '.join(left)}; name them to report them", flush=True)
            below = planned
        elif below:
            named = False
        found += below or [path]  # a path with no run below: describe_run says what is missing
    return found, named


def read_repeat(report_dir: str | Path) -> dict:
    """The report.json that a comparison with another pre-training seed wrote to `report_dir`
    (`tools/report.py --repeat`)."""
    path = Path(report_dir) / "report.json"
    if not path.is_file():
        raise ReportError(f"{path} is missing; pass the output_dir of a finished comparison repeated with another "
                          "pre-training seed (OUTPUT_DIR_pretrain_seedN)")
    rep = _read_json(path)
    if not isinstance(rep.get("derived"), dict):
        raise ReportError(f"{report_dir}/report.json holds no derived figures; pass the output_dir of a comparison "
                          "repeated with another pre-training seed (OUTPUT_DIR_pretrain_seedN)")
    return {**rep, "out_dir": str(report_dir)}


def _previous_repeats(out: Path) -> list[dict]:
    """The repeats that the report already in `out` was summed up with (its report.json names
    their folders), so that re-rendering a comparison keeps its section on pre-training seeds."""
    path = out / "report.json"
    across = _read_json(path).get("pretrain_seeds") if path.is_file() else None
    if not across:
        return []
    if not isinstance(across.get("repeats"), list):  # written before the report named its repeats
        print(f"warning: {path} was summed up over {across.get('seeds')} pre-training seeds, but does not name "
              "their folders; pass each with --repeat to keep that section", file=sys.stderr)
        return []
    print(f"[report] over pre-training seeds with the repeats {path} names: {', '.join(across['repeats'])}")
    gone = [out / d for d in across["repeats"] if not (out / d / "report.json").is_file()]
    if gone:  # read_repeat's own error would name a --repeat the user never passed
        raise ReportError(f"{path} names the repeat {gone[0]}, which holds no report.json; pass the repeats to "
                          "keep with --repeat, or write the report elsewhere with --out")
    return [read_repeat(out / d) for d in across["repeats"]]


def _check_distinct(out: Path, rep: dict, repeats: list[dict], named: str) -> None:
    """Refuse a repeat that is this report's folder or another repeat's, or that read one of the
    same pre-training runs: those pre-trainings would count twice in the gaps over the seeds, their
    spread shrunk by a copy of themselves. `named`: where the repeats were named ('--repeat', or a
    report.json re-rendered), for the message."""
    def pretrainings(r: dict) -> set[Path]:  # as recorded (a relative one from where it was rendered)
        return {Path(x["dir"]).resolve() for x in r.get("runs") or [] if isinstance(x, dict)
                and x.get("kind") == "pretrain" and isinstance(x.get("dir"), str)}
    seen, read = {out.resolve(): "the report's own folder"}, {d: "this report" for d in pretrainings(rep)}
    seeded = {k: "this report" for k in _pretrain_seeds(rep)}
    for r in repeats:
        where = Path(r["out_dir"]).resolve()
        if where in seen:
            raise ReportError(f"{named} {r['out_dir']} is {seen[where]}, so its pre-trainings would count twice in "
                              "the gaps over pre-training seeds; name each repeat once, and not the report's folder")
        if both := sorted(pretrainings(r) & read.keys()):
            raise ReportError(f"{named} {r['out_dir']} read the pre-training {both[0]}, as {read[both[0]]} did, so it "
                              "would count twice in the gaps over pre-training seeds; a repeat is the comparison run "
                              "with another pre-training seed (OUTPUT_DIR_pretrain_seedN)")
        if both := sorted(_pretrain_seeds(r) & seeded.keys()):
            family, seed = both[0]
            raise ReportError(f"{named} {r['out_dir']} made its {FAMILY_NAMES.get(family, family)} with seed {seed}, "
                              f"as {seeded[both[0]]} did: a copy, not another pre-training seed, which would "
                              "shrink the gaps' spread over the seeds; a repeat is the comparison run with another "
                              "pre-training seed (pretrain_seeds: N)")
        seen[where] = "a folder named already"
        read.update(dict.fromkeys(pretrainings(r), f"the repeat {r['out_dir']}"))
        seeded.update(dict.fromkeys(_pretrain_seeds(r), f"the repeat {r['out_dir']}"))


def _pretrain_seeds(rep: dict) -> set[tuple]:
    """(arm, seed) of each pre-training a report (or its report.json) records."""
    return {(x.get("family"), x["seed"]) for x in rep.get("runs") or [] if isinstance(x, dict)
            and x.get("kind") == "pretrain" and isinstance(x.get("seed"), int)}


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
    that folder reads the same runs (`_plan`). `repeats`: the
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
    before, mine = _reported(out) if parent else None, {Path(d).resolve() for d in run_dirs}
    if before is not None and before[0] != mine:
        raise ReportError(f"{out / 'report.json'} is the report of other runs, which this one would replace; give "
                          "--out (another folder, or that one to replace it), or name the folder alone to re-render it")
    # a plan for runs named, but none over a report of a folder searched; and one wherever the runs
    # are not every run below `out`, which a report without a plan stands for
    if (named and (before is None or before[1])) or mine != {d.resolve() for d in _search(out)}:
        rep["plan"] = [os.path.relpath(Path(d).resolve(), out.resolve()) for d in run_dirs]
    source = "--repeat"
    if repeats is None:
        repeats, source = _previous_repeats(out), f"{out / 'report.json'} names the repeat"
    _check_distinct(out, rep, repeats, source)
    if repeats:
        rep["pretrain_seeds"] = {**across_pretrain_seeds([rep, *repeats]),
                                 "repeats": [os.path.relpath(r["out_dir"], out) for r in repeats]}
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "report.md", render_markdown(rep) + _figures_section(out))
    write_atomic(out / "report.json", json.dumps(rep, indent=2) + "\n")
    plot(rep, out / "report.png")
    rep["out_dir"] = str(out)
    return rep
