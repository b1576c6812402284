"""Reading run directories and finding them: what each run is (`describe_run`: its kind, arm, label
fraction and seed, from its metrics.json and config.yaml), the runs a report reads (`find_runs`:
runs named, a folder's plan, or every run below a folder) and the repeats of a comparison with other
pre-training seeds (`read_repeat`), checked to be other pre-trainings. Apart from `collect`'s
choosing and the rendering, so that what the report reads, and which error a bad run gets, is in one
place.
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import yaml

from mpp.config import read_yaml, settings
from mpp.report import FAMILIES, FAMILY_NAMES, ReportError

# in a comparison's output_dir while its stages run (mpp.compare.run), holding UNFINISHED_NOTE: a
# report written there holds the stages done so far, and says so in the same words
UNFINISHED = "unfinished.txt"
UNFINISHED_NOTE = ("the comparison writing to this folder has not finished its stages; a report of this folder holds "
                   "those done so far. Run the comparison's command again to finish it.")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ReportError(f"{path} is missing; is {path.parent} a finished run directory?") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
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
        with open(path, encoding="utf-8") as f:  # a stream names the file in the parser's message
            cfg = read_yaml(f) or {}
    except yaml.YAMLError as e:
        raise ReportError(f"{path} is not valid YAML ({' '.join(str(e).split())}); rerun that step") from None
    except UnicodeDecodeError as e:
        raise ReportError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); rerun that step") from None
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


def _section(cfg: dict, name: str, run_dir: Path) -> dict:
    """A config.yaml's section (empty where absent), refused where it is no mapping."""
    section = cfg.get(name) or {}
    if not isinstance(section, dict):
        raise ReportError(f"{run_dir}/config.yaml: {name} is a YAML {type(section).__name__}, not a mapping; "
                          "rerun that step")
    return section


def describe_run(run_dir: str | Path) -> dict:
    """{"dir", "kind": pretrain|finetune|probe, "family", "label_fraction", "metrics"} of one run."""
    run_dir = Path(run_dir)
    metrics = _read_json(run_dir / "metrics.json")
    cfg = _read_config(run_dir)
    objective, fraction = cfg.get("objective"), None
    if metrics.get("kind") == "linear_probe":
        kind, source = "probe", _section(cfg, "probe", run_dir).get("encoder", "")
    elif objective in ("mpp", "supervised"):
        kind, source = "pretrain", None
    elif objective == "classify":
        finetune = _section(cfg, "finetune", run_dir)
        kind, source, fraction = "finetune", finetune.get("init", "none"), finetune.get("label_fraction", 1.0)
    else:
        raise ReportError(f"{run_dir}/config.yaml: objective {objective!r} is none of mpp, supervised, classify")
    if source is not None and not isinstance(source, str):
        raise ReportError(f"{run_dir}/config.yaml: the encoder it read, {source!r}, is no path; rerun that step")
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
    if fraction is not None:
        if not isinstance(fraction, (int, float)) or isinstance(fraction, bool):
            raise ReportError(f"{run_dir}/config.yaml: label_fraction {fraction!r} is not a number; rerun that step")
        fraction = float(fraction)
    if not isinstance(cfg.get("seed", 0), int) or isinstance(cfg.get("seed"), bool):
        raise ReportError(f"{run_dir}/config.yaml: seed {cfg['seed']!r} is not a whole number; rerun that step")
    return {"dir": str(run_dir), "kind": kind, "family": family, "label_fraction": fraction, "metrics": metrics,
            "seed": cfg.get("seed", 0), "evaluated_on": metrics.get("evaluated_on", "val"), "config": cfg,
            "settings": settings(cfg)}


def accuracy(metrics: dict, key: str, run_dir: str) -> float:
    v = metrics.get(key)
    if not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0 or math.isnan(v):
        raise ReportError(f"{run_dir}/metrics.json: '{key}' is {v!r}; expected an accuracy in [0, 1]")
    return float(v)


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


def reported(out: Path) -> tuple[set[Path], bool] | None:
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
    return {d.resolve() for d in search(out)}, False


def search(folder: Path) -> list[Path]:
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
        if not path.exists():
            raise ReportError(f"{path} does not exist; name run directories, or the output_dir of a comparison "
                              "(tools/compare.py writes it)")
        below = search(path)
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


def previous_repeats(out: Path) -> list[dict]:
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


def check_distinct(out: Path, rep: dict, repeats: list[dict], named: str) -> None:
    """Refuse a repeat that is this report's folder or another repeat's, or that read one of the
    same pre-training runs: those pre-trainings would count twice in the gaps over the seeds, their
    spread shrunk by a copy of themselves. Refuse one scored on other test images too: the gaps
    over the seeds take the test images as what the repeats share. `named`: where the repeats were
    named ('--repeat', or a report.json re-rendered), for the message."""
    def pretrainings(r: dict) -> set[Path]:  # as recorded (a relative one from where it was rendered)
        return {Path(x["dir"]).resolve() for x in r.get("runs") or [] if isinstance(x, dict)
                and x.get("kind") == "pretrain" and isinstance(x.get("dir"), str)}
    seen, read = {out.resolve(): "the report's own folder"}, {d: "this report" for d in pretrainings(rep)}
    seeded = {k: "this report" for k in pretrain_seeds(rep)}
    for r in repeats:
        where = Path(r["out_dir"]).resolve()
        if where in seen:
            raise ReportError(f"{named} {r['out_dir']} is {seen[where]}, so its pre-trainings would count twice in "
                              "the gaps over pre-training seeds; name each repeat once, and not the report's folder")
        if both := sorted(pretrainings(r) & read.keys()):
            raise ReportError(f"{named} {r['out_dir']} read the pre-training {both[0]}, as {read[both[0]]} did, so it "
                              "would count twice in the gaps over pre-training seeds; a repeat is the comparison run "
                              "with another pre-training seed (OUTPUT_DIR_pretrain_seedN)")
        if both := sorted(pretrain_seeds(r) & seeded.keys()):
            family, seed = both[0]
            raise ReportError(f"{named} {r['out_dir']} made its {FAMILY_NAMES.get(family, family)} with seed {seed}, "
                              f"as {seeded[both[0]]} did: a copy, not another pre-training seed, which would "
                              "shrink the gaps' spread over the seeds; a repeat is the comparison run with another "
                              "pre-training seed (pretrain_seeds: N)")
        if r.get("test_set") and rep.get("test_set") and r["test_set"] != rep["test_set"]:
            raise ReportError(f"{named} {r['out_dir']} was scored on other test images (data.val "
                              f"{r['test_set'][0]}, this report's {rep['test_set'][0]}), so its gaps are not "
                              "this comparison's; a repeat is the same comparison with another pre-training seed")
        seen[where] = "a folder named already"
        read.update(dict.fromkeys(pretrainings(r), f"the repeat {r['out_dir']}"))
        seeded.update(dict.fromkeys(pretrain_seeds(r), f"the repeat {r['out_dir']}"))


def pretrain_seeds(rep: dict) -> set[tuple]:
    """(arm, seed) of each pre-training a report (or its report.json) records."""
    return {(x.get("family"), x["seed"]) for x in rep.get("runs") or [] if isinstance(x, dict)
            and x.get("kind") == "pretrain" and isinstance(x.get("seed"), int)}
