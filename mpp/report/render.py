"""Rendering the report `collect` made: report.md (`render_markdown`: the table, the gaps with their
noise, the recipes, what fine-tuning added, the notes; and the section on pre-training seeds), links
to the encoders' figures (`figures_section`) and report.png (`plot`). Text only: every figure is
computed before (`mpp.report.collect`, `mpp.gaps`).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from mpp.fileio import save_figure
from mpp.gaps import GAPS, significant
from mpp.report import FAMILIES, FAMILY_NAMES, PAPER_SHARE, ReportError
from mpp.report.runs import UNFINISHED_NOTE, pretrain_seeds

# the images a representation was chosen on (mpp.gaps.pool_choice's `on`), as the report names them
SCORED_ON = {"dev": "development", "heldout": "held-out", "cv": "cross-validated"}


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


def _withheld_note(t: dict, recipes: dict) -> str:
    """What the pre-trainings left out, for the table's intro: the fine-tunes' development splits
    (data.withhold), or, where `recipes` were chosen on such splits, the arms whose pre-training
    read them; and the arms whose representation was chosen in folds (finetune.pool_folds) over
    images their pre-training read unlabeled, by a sweep stage or, where none swept, a final."""
    kept = [{"mpp": "MPP"}.get(f, f) for f in FAMILIES
            if t[f]["pretrain"] and t[f]["pretrain"].get("read_dev_splits")]
    folded = [FAMILY_NAMES[f] for f in FAMILIES if t[f].get("finetune_folds")
              or any((r.get("pool_choice") or {}).get("on") == "cv" for r in (recipes.get(f) or {}).values())]
    folds = (f"for {' and '.join(folded)} the representation was chosen by a probe scored in folds over all the "
             "cell's labels, finetune.pool_folds, images that a pre-training may have read, never their labels"
             if folded else "")
    if not kept:
        return (" (the comparison leaves the fine-tunes' development splits out of a pre-training on their training "
                "set, data.withhold, so that no fine-tune's learning rate or representation is chosen on images it "
                "trained on" + (f"; but {folds}" if folds else "") + ").")
    if not any(recipes.get(f) for f in FAMILIES):  # no recipe chosen on the splits read: the folds alone
        return f" ({folds})." if folds else "."
    many = len(kept) > 1
    return (f". The {' and '.join(kept)} pre-training{'s' if many else ''} read fine-tunes' development splits "
            f"(data.withhold empty or short of them): the learning rates and representations chosen on those splits for "
            f"{'their encoders' if many else 'its encoder'} were chosen on images {'they' if many else 'it'} "
            "trained on" + (f" ({folds}, not on those splits)" if folds else "") + ".")


def render_markdown(rep: dict) -> str:
    """report.md but for its links to the figures (`figures_section`): one part per section, in order."""
    return "\n".join(_main_table(rep) + _gaps_table(rep) + _probe_notes(rep["table"])
                     + _pretrain_seeds_section(rep.get("pretrain_seeds") or {}, pretrain_seeds(rep))
                     + _added_section(rep["table"], rep["label_fractions"]) + _recipes_section(rep)
                     + _skipped_section(rep.get("skipped") or {}) + _runs_line(rep))


def _main_table(rep: dict) -> list[str]:
    """The title, what the table shows and the table: one row per arm."""
    t, fracs, shots = rep["table"], rep["label_fractions"], rep["shots"]
    head = (["", "pre-training"] + [f"fine-tune top-1 @ {100 * float(f):g}% labels" for f in fracs]
            + ["linear top-1 (representation)"] + [f"{k}-shot" for k in shots])
    lines = ["# Self-supervised (MPP) vs supervised pre-training", "",
             *([f"**Unfinished:** {UNFINISHED_NOTE}", ""] if rep.get("unfinished") else []),
             "Top-1 accuracy in percent on the held-out test set. Fine-tunes: mean ± sample std over seeds "
             "(n runs); few-shot: mean ± sample std over shot draws. Representation: the one the linear probe chose "
             "on training images its fit left out (below; token: [class] token, avg: mean of the patch tokens). Pre-training: its "
             "steps and the images it read" + _withheld_note(t, rep["recipes"]), "",
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
    return lines


def _gaps_table(rep: dict) -> list[str]:
    """The derived figures: each gap ± its noise and the share recovered per evaluation, then the notes
    on shares left undefined and the footnotes of the figures marked †."""
    d, fracs, shots = rep["derived"], rep["label_fractions"], rep["shots"]
    lines = ["", "## Derived figures", "",
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
                     "labels) is marked too; where the comparison retrained the chosen value through the "
                     "other representation as well (same seeds), the range spans that too." if pooled else "")]
    if probed:
        lines += ["", "† on the linear-probe and few-shot rows: an arm whose probe chose its representation by a "
                  "lead within its noise (a toss-up in the leads below; the few-shot figures read the same "
                  "representation). The ± does not count that choice, and the other representation, never "
                  "evaluated on the test images, may have given another figure."]
    return lines


def _probe_notes(t: dict) -> list[str]:
    """How each linear probe chose its representation and its L2 strength."""
    lines = []
    held = []
    for f in FAMILIES:
        if not (c := t[f].get("probe_pool_choice")):
            continue
        where = SCORED_ON[c["on"]]
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
    return lines


def _added_section(t: dict, fracs: list[str]) -> list[str]:
    """What fine-tuning added to its start, per cell whose runs recorded one."""
    starts = [(f, fr) for f in FAMILIES for fr in fracs if fr in t[f]["finetune_start"]]
    if not starts:
        return []
    lines = ["", "## What fine-tuning added to its start", "",
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
    return lines


def _recipes_section(rep: dict) -> list[str]:
    """The recipe each cell's development split chose, its lead and the runner-ups retrained."""
    recipes = [(f, fr, r) for f in FAMILIES for fr, r in sorted(rep["recipes"][f].items(), key=lambda x: float(x[0]))]
    if not recipes:
        return []
    lines = ["", "## Fine-tune recipe chosen on a development split", "",
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
        scored = f"{SCORED_ON[pool['on']]} top-1" if pool else ""
        images = f" on {pool['n']} images" if pool and pool["n"] is not None else ""
        how = (f" (pool by a probe of its labels, {scored} "
               f"{', '.join(f'{k} {_pct(v)}' for k, v in pool['top1'].items())}{images}: "
               f"lead {_lead_cell(pool['lead'])})" if pool else "")
        edges = [f"{end} {key.rsplit('.', 1)[-1]}" for key, end in (r.get("edges") or {}).items()]
        edge = f" (the {' and '.join(edges)} tried ‡)" if edges else ""
        lines.append(f"| {FAMILY_NAMES[f]} | {100 * float(fr):g}% | {_short(r['chosen'])}{edge}{how} | {devs} | "
                     f"{_lead_cell(r.get('lead'))} | {again} |")
    if any(r.get("edges") for _, _, r in recipes):
        lines += ["", "‡ the chosen value is the largest or the smallest of the three or more the sweep tried: the "
                  "development split says nothing of values beyond it, so the grid may not hold the best; a sweep "
                  "extended past it (sweep.KEY=[...], or fraction_sweep for one label fraction) would bracket it."]
    return lines


def _skipped_section(skipped: dict) -> list[str]:
    """The runs that trained or were scored on fewer samples than their data holds (`skipped`: run dir ->
    its counts by kind)."""
    if not skipped:
        return []
    lines = ["", "## Data skipped", "",
             "These runs trained or were scored on fewer samples than their data holds (corrupt or "
             "unreadable data, by kind; training's `padded` samples were repeated to fill a rank):", ""]
    for d, kinds in skipped.items():
        parts = [f"{'evaluation' if k.startswith('val_') else 'training'} "
                 + ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items())) for k, counts in kinds.items()]
        lines.append(f"- `{d}`: " + "; ".join(parts))
    return lines


def _runs_line(rep: dict) -> list[str]:
    """The runs the table reads, each with its arm and kind (a runner-up's marked)."""
    finals = [r for r in rep["runs"] if r["kind"] != "finetune" or r.get("evaluated_on") != "dev"]
    other = {d: "representation" if x["kind"] == "pool" else "value"
             for f in FAMILIES for r in rep["recipes"][f].values() for x in r["retrained"] for d in x["dirs"]}
    return ["", "Runs: " + ", ".join(f"`{r['dir']}` ({r['family']} {r['kind']}"
                                     + (f", another {other[r['dir']]} retrained" if r["dir"] in other else "") + ")"
                                     for r in finals), ""]



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


def figures_section(out: Path) -> str:
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
