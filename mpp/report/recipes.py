"""Choosing among a cell's runs: the keys its sweep varied (`swept_keys`), which of its final runs are
the cell and which retrain a runner-up (`split_finals`, `runner_up`), what its development split
chose and by how much (`recipe`), and the range a toss-up spans (`ranges`). The protocol's choice
as the report reads it back from the runs (mpp.compare makes it; the lead's arithmetic is
`mpp.gaps`).
"""
from __future__ import annotations

import json
import os

from mpp import outcomes
from mpp.config import RESULT_NEUTRAL, flatten, same_setting
from mpp.gaps import GAPS, dev_rank, mean_std, pool_choice, sweep_lead
from mpp.report import ReportError
from mpp.report.runs import accuracy
from mpp.specs import DATA_KEYS


def swept_keys(dev_runs: list[dict]) -> list[str]:
    """The config keys in which a cell's development-split runs differ (the swept keys), but for
    the output folder, the seed and keys of speed and logging (RESULT_NEUTRAL), which a comparison
    lets a resumed stage change."""
    return sorted(set().union(*(_differ(dev_runs[0], r) for r in dev_runs[1:])))


def _differ(a: dict, b: dict) -> list[str]:
    """The config keys in which runs `a` and `b` differ, but for those `swept_keys` leaves out and two
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
    return dev_rank(accuracy(run["metrics"], "top1", run["dir"]), run["dir"])


def split_finals(finals: list[dict], dev_runs: list[dict], varied: list[str]) -> tuple[list[dict], list[list[dict]]]:
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


def runner_up(group: list[dict], varied: list[str], cell: list[dict]) -> dict:
    """Another value's final runs (`kind` value), or the cell's value through the other
    representation (`kind` pool): its values, test top-1 mean and std over its seeds, their dirs."""
    mean, std = mean_std([accuracy(r["metrics"], "top1", r["dir"]) for r in group])
    values, kind = _values(group[0], varied), "value"
    if values == _values(cell[0], varied) and _pool(group[0]) != _pool(cell[0]):
        values, kind = {**values, "finetune.pool": _pool(group[0])}, "pool"
    return {"values": values, "kind": kind, "top1": mean, "std": std, "n": len(group),
            "dirs": [r["dir"] for r in group]}


def recipe(dev_runs: list[dict], varied: list[str], finals: list[dict], retrained: list[dict]) -> dict:
    """The sweep of one cell: each dev run's values of the swept keys and its dev top-1, the values
    (plus finetune.pool and head_init) the final runs used, how finetune.pool=auto chose the pool
    (`pool_choice`: the best dev run's, whose choice decides the comparison's other-representation
    retrain), the chosen value's lead, and the other values that were retrained on all the labels
    (`retrained`)."""
    final = _values(finals[0], varied) if finals else {}
    written = flatten(finals[0]["config"]) if finals else {}  # the recipe's other keys, as its config gives them
    dev = [{"values": _values(r, varied), "dev_top1": accuracy(r["metrics"], "top1", r["dir"])} for r in dev_runs]
    images = [outcomes.read(r["metrics"].get("outcomes")) for r in dev_runs]
    chosen = {**final, **{k: written[k] for k in ("finetune.pool", "finetune.head_init") if k in written}}
    if chosen.get("finetune.pool") == "auto":  # what the run chose (metrics.json), not the setting
        chosen["finetune.pool"] = finals[0]["metrics"].get("pool", "auto")
    # the best dev run first, as the comparison ranks them: its choice is the one the comparison read
    ranked = sorted(dev_runs, key=_dev_rank)
    made = next(filter(None, (pool_choice(r["metrics"]) for r in [*ranked, *finals]
                              if r["metrics"].get("pool") == chosen.get("finetune.pool"))), None)
    swept = {k: chosen[k] for k in varied if k in chosen}
    return {"dev": dev, "chosen": chosen, "pool_choice": made,
            "lead": sweep_lead(dev, images, swept, [_dev_rank(r) for r in dev_runs]),
            "edges": grid_edges(dev, swept), "retrained": retrained}


def grid_edges(dev: list[dict], chosen: dict) -> dict:
    """The swept numeric keys whose chosen value is the largest or the smallest of three or more
    tried (key -> 'largest' | 'smallest'): the development split says nothing of the values beyond
    it, so the grid may not hold the best, as a rate rising to the grid's top suggests; extending
    the sweep (sweep.KEY=[...]) brackets it. With two values every choice is an end: none named."""
    out = {}
    for key, value in chosen.items():
        tried = {x["values"].get(key) for x in dev}
        if len(tried) < 3 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in tried):
            continue
        if value == max(tried):
            out[key] = "largest"
        elif value == min(tried):
            out[key] = "smallest"
    return out


def ranges(candidates: dict) -> dict:
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
