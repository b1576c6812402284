"""The checks before any stage starts: `validate` resolves every stage's config as its tool will and
refuses what would fail or mislead hours in (two stages in one folder, an arm's wrong objective, two
test sets, an encoder fed other inputs than it was trained on, what each trainer checks at its own
start over the launcher's processes); `check_data` reads every data set once it is made; and on a
resume `check_unchanged`, `check_processes` and `check_encoder` refuse a finished stage whose
settings, process count or encoder are not those planned now. Each error names its stage, so that a
comparison fails in its first seconds rather than after its pre-trainings.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
from pathlib import Path

from mpp.compare.planning import Stage, dev_splits, metrics, probe_dev, probe_split
from mpp.config import (CompareConfig, Config, ConfigError, as_list, changed_settings, flatten, parse_overrides, said,
                        to_dict, unread)
from mpp.specs import data_key, dev_split, two_test_sets

# a tool's key naming the encoder its stage starts from, and the metrics.json key of that file's sha256
STARTS_FROM = {"linear_probe": ("probe.encoder", "encoder_sha256"), "finetune": ("finetune.init", "init_sha256")}


def validate(cfg: CompareConfig, stages: list[Stage], machine: bool = True) -> dict[Path, Config]:
    """Resolve every stage config now as its tool will (mpp-finetune's defaults included), so a bad
    key fails before hours of work; check that no two stages share a folder, what each trainer
    would check at its start (`_check_training`), that each pre-training trains its arm's
    objective, that each fine-tune has test images, that the probes and final fine-tunes are scored
    on one test set (`mpp.specs.val_key`, as the report requires), and that each probe and
    fine-tune normalises its inputs as its encoder's pre-training did. The data are checked once
    made (`check_data`).
    `machine` False (a dry run, which may plan for another machine) leaves out what this machine
    must offer: the launcher's command, a GPU for fp16. Returns each stage's resolved config, by
    its folder (run-time choices as their placeholders)."""
    for key in ("overrides", "pretrain_overrides"):
        unparsed = next((o for o in as_list(getattr(cfg, key)) if o.lstrip().startswith(("[", "{"))), None)
        if unparsed is not None:
            raise ConfigError(f"compare config key '{key}' did not read as a YAML list ({unparsed!r}); quote each item "
                              f"that holds braces or commas, e.g. '{key}=[\"data.val=d/{{000000..000009}}.tar\"]'")
        try:
            parse_overrides(as_list(getattr(cfg, key)))
        except ConfigError as e:
            raise ConfigError(f"compare config key '{key}': {e}") from None
    resolved, named = {}, {}
    for s in stages:
        if s.out in named:
            raise ConfigError(f"stages '{named[s.out]}' and '{s.name}' would both write to {s.out}; give label_fractions "
                              "and sweep values that differ (in the folder names they give too)")
        named[s.out] = s.name
        try:
            resolved[s.out] = s.settings(resolved=False)
        except ConfigError as e:
            raise ConfigError(f"stage '{s.name}' ({s.config}): {e}") from None
    _check_training(cfg, stages, resolved, machine)
    points: dict[tuple, str] = {}
    for s in stages:  # two spellings of one value ('0.01', 0.010) would train one recipe twice, a false toss-up
        if s.out.name.startswith("sweep_"):
            same = {k: v for k, v in flatten(to_dict(resolved[s.out])).items() if k != "output_dir"}
            key = (s.out.parent, json.dumps(same, sort_keys=True, default=str))
            if key in points:
                raise ConfigError(f"stages '{points[key]}' and '{s.name}' resolve to the same settings: the sweep "
                                  "names one value twice; give each value once")
            points[key] = s.name
    _check_swept_keys_read(cfg, stages, resolved)
    for s in stages:  # each stage trains what its arm needs, and a fine-tune has test images
        c, need = resolved[s.out], {"pretrain": s.arm, "finetune": "classify"}.get(s.tool)
        if need and c.objective != need:
            raise ConfigError(f"stage '{s.name}' ({s.config}) resolves to objective={c.objective}, not {need}; give "
                              f"the compare config's '{s.arm if s.tool == 'pretrain' else 'finetune'}' a config of "
                              f"objective {need}, and no objective= in its overrides")
        if s.tool in ("finetune", "linear_probe") and not c.data.val:
            raise ConfigError(f"stage '{s.name}' ({s.config}) has no data.val, the test images its "
                              f"{'final fine-tunes are' if s.tool == 'finetune' else 'probe is'} scored on; set data.val")
        if s.tool == "finetune" and cfg.sweep and c.finetune.dev_fraction == 0 and c.finetune.pool == "auto":
            raise ConfigError(f"stage '{s.name}' ({s.config}) resolves to finetune.pool=auto, so it would choose its "
                              "representation on its own training labels, which a supervised pre-training fitted; "
                              "set the compare config's finetune_pool: auto (chosen on the development split), sweep "
                              "finetune.pool over token and avg, or give finetune.pool token or avg")
    # the probes and final fine-tunes: the report refuses gaps between other test images
    if two := two_test_sets((resolved[s.out].data.val, resolved[s.out].data.val_num_samples, s.name) for s in stages
                            if s.tool == "linear_probe"
                            or (s.tool == "finetune" and resolved[s.out].finetune.dev_fraction == 0)):
        (a, first), (b, second) = two
        raise ConfigError(f"stages '{first}' and '{second}' would be scored on different test sets (data.val {a} "
                          f"and {b}), and the report refuses gaps between other images; give every probe and "
                          "fine-tune one data.val")
    if not cfg.sweep:  # a final may choose on its own labels; a sweep of one value chooses on a withheld split
        _warn_own_label_choices(stages, resolved)
    _warn_short_withhold(cfg, stages, resolved)
    for s in stages:  # an encoder fed other inputs than it was trained on would stop its stage hours in
        c = resolved[s.out]
        up = resolved.get(Path(flatten(to_dict(c))[STARTS_FROM[s.tool][0]])) if s.tool in STARTS_FROM else None
        if up is not None and (tuple(up.data.mean), tuple(up.data.std)) != (tuple(c.data.mean), tuple(c.data.std)):
            raise ConfigError(f"stage '{s.name}' ({s.config}) normalises its inputs with data.mean={list(c.data.mean)} "
                              f"data.std={list(c.data.std)}, but its encoder is pre-trained with data.mean="
                              f"{list(up.data.mean)} data.std={list(up.data.std)}; give both configs the same")
    return resolved


def _warn_short_withhold(cfg: CompareConfig, stages: list[Stage], resolved: dict[Path, Config]) -> None:
    """Warn where `pretrain_overrides` gave a pre-training a data.withhold that lists some of the
    development splits its comparison chooses on but not all: those recipes would be chosen on
    images it trained on (an empty list is a plain choice, which the report states)."""
    probe = probe_dev(cfg, probe_split(cfg))
    chosen = dev_splits(cfg) | ({probe} if probe else set())
    for s in stages:
        c = resolved[s.out]
        if s.tool != "pretrain" or not c.data.withhold:
            continue
        given = {dev_split(*w) for w in c.data.withhold}
        short = sorted(split for key, *drawn in chosen if key == data_key(c.data.train)
                       and (split := dev_split(*drawn)) not in given)
        if short:
            print(f"warning: stage '{s.name}' withholds data.withhold={[list(w) for w in c.data.withhold]} but not the "
                  f"development split(s) {[list(w) for w in short]} that fine-tunes or probes choose on: recipes "
                  "chosen there are chosen on images it trained on; give every split, or leave data.withhold to the "
                  "comparison", file=sys.stderr)


def _check_swept_keys_read(cfg: CompareConfig, stages: list[Stage], resolved: dict[Path, Config]) -> None:
    """A sweep key that a setting of the fine-tunes leaves unread (SGD's momentum under AdamW:
    `mpp.config.unread`) is refused where no sweep stage reads it: its points would train one recipe
    and tie, a false toss-up. Where only some do (a grid over optim.name too, another optimiser in
    one label fraction's overrides), the others' points that differ there alone are warned of."""
    unread_at: dict[str, tuple[str, str]] = {}  # a sweep key -> the first sweep stage not reading it, and why
    read = set()
    for s in (s for s in stages if s.out.name.startswith("sweep_")):
        missed = {k: who for who, keys in unread(resolved[s.out], s.tool).items() for k in keys}
        for k in cfg.sweep:
            if k in missed:
                unread_at.setdefault(k, (s.name, missed[k]))
            else:
                read.add(k)
    for k, (name, who) in unread_at.items():
        if k not in read:
            raise ConfigError(f"the sweep names {k}, which no sweep stage reads ({who}, e.g. stage '{name}'): its "
                              "points would train the same recipe and tie; drop it from the sweep")
        print(f"warning: the sweep names {k}, which some sweep stages never read ({who}, e.g. stage '{name}'): their "
              "points that differ in it alone train the same recipe, and tie; a comparison of its own for the "
              "settings that read it saves those runs", file=sys.stderr)


def _warn_own_label_choices(stages: list[Stage], resolved: dict[Path, Config]) -> None:
    """Without a sweep, warn where a supervised arm's final fine-tune chooses its representation or
    its starting head's L2 on its own training labels, which that arm's pre-training fitted."""
    fitted = {data_key(resolved[s.out].data.train) for s in stages if s.tool == "pretrain" and s.arm == "supervised"}
    for s in stages:
        c = resolved[s.out]
        if s.tool == "finetune" and s.arm == "supervised" and data_key(c.data.train) in fitted and (
                c.finetune.pool == "auto" or (c.finetune.head_init == "probe" and c.finetune.head_l2 == 0)):
            print(f"warning: stage '{s.name}' chooses its representation (finetune.pool=auto) or its starting "
                  "head's L2 (finetune.head_init=probe) on a held-out part of its own training labels, which the "
                  "supervised pre-training fitted; give a sweep, of one value if need be (e.g. 'sweep={optim.lr: "
                  f"[{c.optim.lr:g}]}}'), to choose them on a development split the pre-trainings "
                  "withhold", file=sys.stderr)
            return


# what torchrun's --nproc_per_node and --nnodes and accelerate launch's --num_processes take
COUNTS = {"nproc_per_node": r"\d+|auto|cpu|gpu|xpu", "nnodes": r"\d+(:\d+)?", "num_processes": r"\d+"}


def launcher_words(launcher: str, machine: bool = True) -> list[str]:
    """The command a stage runs under ([] for this Python): `launcher` split as a shell would, its
    variables ($NAME, ${NAME}, quoted or not) expanded from this environment (stages run without a
    shell). One that does not split, uses another $ form, or (`machine`) whose command is not on
    this machine's PATH or that names a variable not set here, is a ConfigError (without
    `machine`, as for a dry run, an unset one is left as written)."""
    try:
        words = shlex.split(launcher)
    except ValueError as e:
        raise ConfigError(f"compare config key 'launcher' ({launcher!r}) does not split into words ({e}); "
                          "close its quotes") from None
    def expand(m: re.Match) -> str:
        name = m[1] or m[2]
        if not name:
            raise ConfigError(f"compare config key 'launcher' has {m.string!r}: only $NAME and ${{NAME}} are expanded "
                              "(stages run without a shell); give the value itself")
        if machine and name not in os.environ:
            raise ConfigError(f"compare config key 'launcher' names ${name}, a variable not set here; run the "
                              "comparison where it is set (inside the job) or give its value")
        return os.environ.get(name, m[0])
    words = [re.sub(r"\$(?:(\w+)|\{(\w+)\}|)", expand, w) for w in words]
    if machine and words and shutil.which(words[0]) is None:
        raise ConfigError(f"compare config key 'launcher' names {words[0]!r}, which is no command on PATH; give one "
                          "such as 'torchrun --nproc_per_node 2', or '' for this Python")
    for flag, value in _counts(words).items():  # else every stage would end in the launcher's own traceback
        if "$" not in value and not re.fullmatch(COUNTS[flag], value):
            raise ConfigError(f"compare config key 'launcher' gives --{flag} {value!r}: give a whole number"
                              + (" (or auto, cpu, gpu, xpu)" if flag == "nproc_per_node" else
                                 " (or MIN:MAX)" if flag == "nnodes" else ""))
    return words


def _counts(words: list[str]) -> dict[str, str]:
    """The values a launcher's `words` give its count flags (--flag=V or --flag V; dashes in a
    name read as underscores): torchrun's --nnodes and --nproc_per_node, accelerate launch's
    --num_processes."""
    given = {}
    for i, word in enumerate(words):
        flag, _, value = word.partition("=")
        name = flag.lstrip("-").replace("-", "_")
        if flag.startswith("-") and name in ("num_processes", "nproc_per_node", "nnodes"):
            given[name] = value or (words[i + 1] if i + 1 < len(words) else "")
    return given


def _processes(words: list[str]) -> int:
    """The processes a launcher's `words` start per stage, where they say as numbers (all machines
    together); 1 otherwise (this Python, or counts the launcher decides at run time)."""
    given = {k: int(v) for k, v in _counts(words).items() if v.isdigit()}
    if "num_processes" in given:
        return max(given["num_processes"], 1)
    return max(given.get("nnodes", 1) * given.get("nproc_per_node", 1), 1)


def stated_processes(words: list[str]) -> int | None:
    """`_processes` where the launcher's `words` state every count they give as a number (or are
    none: this Python, one process); None where it decides at run time (`--nproc_per_node gpu`, an
    accelerate config file, `--nnodes $SLURM_NNODES` unexpanded)."""
    if not words:
        return 1
    given = _counts(words)
    return _processes(words) if given and all(v.isdigit() for v in given.values()) else None


def _check_training(cfg: CompareConfig, stages: list[Stage], resolved: dict[Path, Config], machine: bool) -> None:
    """What each trained stage's trainer checks at its own start (`mpp.runtime.check_run_settings`,
    over the launcher's processes; `machine`: with what this machine offers), checked before the
    first; and the scratch arm built as the pre-trained encoders are (else it is no baseline for
    them). A warmup as long as a stage's run is worth a warning (`mpp.optim.warmup_note`)."""
    from mpp.models import preset_geometry
    from mpp.runtime import check_run_settings  # here: it imports torch, planning does not
    procs = _processes(launcher_words(cfg.launcher, machine))
    models = {}
    for s in stages:
        c = resolved[s.out]
        if s.tool == "pretrain":
            models.setdefault(s.pretrain_seed, (s.name, c.model, preset_geometry(c.model, c.img_size)[0]))
        if s.tool in ("pretrain", "finetune"):
            try:
                check_run_settings(c, procs, machine)
            except ConfigError as e:
                raise ConfigError(f"stage '{s.name}' ({s.config}): {e}") from None
    for s in stages:
        c = resolved[s.out]
        first, model, size = models.get(s.pretrain_seed, ("", c.model, 0))
        if s.tool != "pretrain" and s.arm != "scratch":
            continue  # loads a pre-trained encoder, at its own resolution unless img_size is given
        if c.model != model:
            raise ConfigError(f"stage '{s.name}' ({s.config}) builds model={c.model}, but '{first}' pre-trains "
                              f"model={model}; every arm must train the same encoder: give the stage configs the same "
                              "model")
        built = preset_geometry(c.model, c.img_size)[0]
        if size and built != size and (s.tool == "pretrain" or not c.img_size):
            raise ConfigError(f"stage '{s.name}' ({s.config}) builds its encoder at {built} px, but '{first}' "
                              f"pre-trains at {size} px, which the pre-trained arms' stages keep; every arm must see "
                              f"images of one size: give the stage configs img_size={size}, or the pre-trainings "
                              f"img_size={built}")
    late = next(((s, c) for s in stages if s.tool in ("pretrain", "finetune")
                 and 1 <= (c := resolved[s.out]).steps <= c.optim.warmup_steps), None)
    if late is not None:
        from mpp.optim import warmup_note  # here: it imports torch
        print(f"warning: stage '{late[0].name}': {warmup_note(late[1], late[1].steps)} (pretrain_overrides or "
              "fraction_overrides reach only the stages that train; overrides reach the probes too)", file=sys.stderr)


def check_data(stages: list[Stage], resolved: dict[Path, Config]) -> None:
    """After the data are made and before the first stage: every data set a stage will read
    resolves (it exists, a shard list or pattern has its count), and each trained stage's samples
    can be drawn as its loader will draw them (a fine-tune's label subset and development split, a
    pre-training's withheld splits), so that a typo in a probe's or fine-tune's data, or in the
    few-shot sets a trained stage watches (fewshot.every), fails now, not after the pre-trainings.
    `resolved`: `validate`'s configs of the stages."""
    from mpp.data.decode import DataError
    from mpp.data.sources import check_same_classes
    from mpp.data.loader import select_shards
    from mpp.evaluators.fewshot import Evaluator as FewshotEvaluator
    from mpp.objectives import OBJECTIVES  # here: it imports torch, planning does not
    done = set()
    for s in stages:
        c = resolved[s.out]
        trained = OBJECTIVES[c.objective] if s.tool in ("pretrain", "finetune") else None
        # data.train as the stage's loader reads it: (labeled, subset, withhold, repeats)
        if trained:
            how = (trained.labeled, trained.subset(c), c.data.withhold, c.data.resampled)
        elif s.tool == "linear_probe" and c.probe.dev_split:  # the probe's development split
            how = (True, (1.0, *c.probe.dev_split, True), (), False)
        else:
            how = (False, None, (), False)
        reads = [(c.data.train, c.data.num_samples, *how)]
        # data.val: the test images of probes and fine-tunes, and the figures' images (the first MPP pre-training's)
        if c.data.val and (s.tool != "pretrain" or (s.arm == "mpp" and s.pretrain_seed == 0)):
            reads.append((c.data.val, c.data.val_num_samples, False, None, (), False))
        try:
            for spec, n, labeled, subset, withhold, repeats in reads:
                key = json.dumps([spec, n, labeled, subset, withhold, repeats])
                if key not in done:
                    select_shards(spec, n, labeled, subset, withhold, repeats)
                    done.add(key)
            if s.tool in ("linear_probe", "finetune"):  # as each checks its test images' classes at its start
                check_same_classes(c.data.train, c.data.val, c.data.val_num_samples)
            if trained and c.fewshot.every:  # the trainer's few-shot evaluator: its sets, as it checks them
                FewshotEvaluator(c, "cpu")
        except (DataError, ValueError) as e:
            raise DataError(f"stage '{s.name}' ({s.config}): {e}") from None
    _check_shards_apart(stages, resolved)


def _check_shards_apart(stages: list[Stage], resolved: dict[Path, Config]) -> None:
    """What the shards each stage names must keep apart, once the data are made: no stage learns
    from a shard that a fine-tune or probe is tested on (a typo would report figures of training
    images as test figures, a supervised pre-training on them would fit the test labels); and a
    pre-training withholds the development splits drawn from the data it names the same way
    (`data_key`), so one that reads those shards under another name (a brace pattern over a
    manifest's tars) would train on them, and is refused."""
    from mpp.data.decode import DataError
    from mpp.data.sources import resolve, shard_names

    read: dict[str, set[str]] = {}

    def files(spec, n: int) -> set[str]:  # the shards a data spec names, each data read once
        key = data_key(spec)
        if key not in read:
            read[key] = shard_names(resolve(spec, n or 1))
        return read[key]
    tests = {data_key(c.data.val): (s, c) for s in stages if s.tool in ("finetune", "linear_probe")
             for c in [resolved[s.out]] if c.data.val}
    for s in stages:
        c = resolved[s.out]
        for t, tc in tests.values():
            if files(c.data.train, c.data.num_samples) & files(tc.data.val, tc.data.val_num_samples):
                raise DataError(f"stage '{s.name}' ({s.config}) learns from data.train {c.data.train!r}, which holds "
                                f"test images of stage '{t.name}' (data.val {tc.data.val!r}); test on shards that no "
                                "stage trains on")
    chosen = {data_key(c.data.train): c for s in stages for c in [resolved[s.out]]
              if (s.tool == "finetune" and c.finetune.dev_fraction > 0) or (s.tool == "linear_probe" and c.probe.dev_split)}
    for s in (s for s in stages if s.tool == "pretrain"):
        c = resolved[s.out]
        for key, dev in chosen.items():
            if key != data_key(c.data.train) and (files(c.data.train, c.data.num_samples)
                                                  & files(dev.data.train, dev.data.num_samples)):
                raise DataError(f"stage '{s.name}' ({s.config}) trains on data.train {c.data.train!r}, the shards of "
                                f"{dev.data.train!r} under another name, so the development splits drawn from those "
                                "cannot be withheld from it; name both data the same way (the manifest)")


def check_unchanged(stage: Stage, finished: bool = True) -> None:
    """A finished stage (or, `finished` False, an interrupted one about to resume from its
    checkpoint) must have run with the settings planned now (its run-time choices read from the
    finished stages before it); else resuming would report a result of other settings, or train on
    from weights trained with them (`mpp.config.changed_settings`: keys of speed and logging alone
    may differ)."""
    from mpp.evaluators.linear_probe import folds_apply  # here: it imports torch, planning does not
    state = "finished" if finished else "was interrupted"
    now = stage.settings()
    changed = changed_settings(stage.out / "config.yaml", now)
    if changed is None:
        raise ConfigError(f"stage '{stage.name}': {stage.out} has a {'metrics.json' if finished else 'checkpoint'} "
                          f"but no config.yaml this mpp can read, so what it ran is unknown; delete {stage.out} "
                          "to run it again")
    if changed and stage.tool == "finetune" and not folds_apply(now):  # a supervised init's, a final's
        changed = [c for c in changed if not c.startswith("finetune.pool_folds:")]
    if changed:
        raise ConfigError(f"stage '{stage.name}' {state} earlier in {stage.out} with other settings ("
                          f"{said(changed)}): delete {stage.out} and "
                          "the stages that used it to run them with these, or set another output_dir")


def check_processes(stage: Stage, processes: int | None) -> None:
    """A finished trained stage must have run on as many processes as the launcher starts now
    (`processes`; None: a count it decides at run time, unchecked): they split each batch and the
    data, so another count trains on another order (as a checkpoint's resume refuses). A
    metrics.json of an older mpp records none and is reused."""
    ran = metrics(stage.out).get("processes") if stage.tool in ("pretrain", "finetune") else None
    if processes is not None and isinstance(ran, int) and ran != processes:
        raise ConfigError(f"stage '{stage.name}' finished earlier in {stage.out} on {ran} process(es); the launcher "
                          f"now starts {processes}, which would split its data otherwise: give the launcher it ran "
                          f"with, or delete {stage.out} and the stages that used it to run them on {processes}")


def checkpointed(out: Path) -> bool:
    """Whether an interrupted stage left a checkpoint that its `train.resume=auto` would train on from."""
    from mpp.checkpoint import list_checkpoints  # here: it imports torch, planning does not
    return bool(list_checkpoints(out / "checkpoints"))


def saved_since(out: Path, t0: float) -> str | None:
    """The newest checkpoint of stage `out` written since `t0` (its start), if any: a launcher such
    as torchrun exits 1 where its ranks saved one and exited 143 on a SIGTERM."""
    from mpp.checkpoint import list_checkpoints
    found = [p for p in list_checkpoints(out / "checkpoints") if p.stat().st_mtime >= t0]
    return found[-1].name if found else None


def check_encoder(stage: Stage, digests: dict[Path, str]) -> None:
    """A finished probe or fine-tune must have started from the encoder file there now, else
    resuming would report it as the result of an encoder trained again since (its stage deleted
    and run again). Checked when the stage is reached, after the stages before it have made their
    encoders; `digests` keeps each file's sha256, so that it is read once per comparison. A stage
    whose metrics.json records no digest (made by an older mpp) is reused with a warning."""
    if stage.tool not in STARTS_FROM:
        return
    from mpp.models import encoder_digest, encoder_file  # here: mpp.models imports torch, planning does not
    key, recorded = STARTS_FROM[stage.tool]
    path = flatten(to_dict(stage.settings()))[key]
    if path == "none":  # a random init
        return
    m = metrics(stage.out)
    if recorded not in m:
        print(f"warning: stage '{stage.name}' ({stage.out}) records no digest of its encoder, so it cannot be verified "
              f"to have started from {encoder_file(path)}; delete {stage.out} to run it again", file=sys.stderr)
        return
    file = encoder_file(path).resolve()
    if not file.is_file():
        raise ConfigError(f"stage '{stage.name}' finished earlier in {stage.out} from {file}, which is gone: delete "
                          f"the stage that made it ({Path(path)}) and the stages that started from it, "
                          "to run them again")
    if file not in digests:
        digests[file] = encoder_digest(file)
    if m[recorded] != digests[file]:
        raise ConfigError(f"stage '{stage.name}' finished earlier in {stage.out} from another encoder than {file} "
                          f"now (its sha256 differs): delete {stage.out}, and the other stages that started from that "
                          "encoder, to run them again from this one")
