"""The tools' front door: every [project.scripts] entry point answers --help, `python tools/X.py`
runs the same `main` as its `mpp-*` script, usage errors are one line, and the configs the tools
and docs cite exist."""
from __future__ import annotations

import argparse
import importlib
import os
import re
import runpy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from toolrun import call

from mpp import cli
from mpp.config import ConfigError, load_config

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as a package (the dev extra installs it there)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def entry(target: str):
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_entry_point_answers_help(script):
    r = call(entry(SCRIPTS[script]), ["--help"])
    assert r.returncode == 0 and r.stdout.startswith("usage:") and "--help" in r.stdout


def test_every_tool_script_is_an_entry_point():
    """tools/X.py is a shim: it runs the main of the installed script that names mpp.tools.X."""
    shims = {p.stem: p for p in (ROOT / "tools").glob("*.py")}
    targets = {t.split(":")[0].rsplit(".", 1)[1]: t for t in SCRIPTS.values()}
    assert shims.keys() == targets.keys()
    for name, path in shims.items():
        assert runpy.run_path(str(path))["main"] is entry(targets[name]), name


def test_usage_errors_are_one_line():
    r = call(entry(SCRIPTS["mpp-make-shards"]), ["only-one-argument"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert r.stderr.startswith("error: ") and "the following arguments are required: out" in r.stderr


def test_the_compare_tool_without_its_config_is_a_one_line_usage_error():
    r = call(entry(SCRIPTS["mpp-compare"]), ["--dry-run"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert r.stderr.startswith("error: ") and "the following arguments are required: --config" in r.stderr


@pytest.mark.parametrize("parse, least", [(cli.count, 1), (cli.whole, 0), (cli.seed, 0)])
def test_a_count_or_seed_that_is_not_a_whole_number_is_a_usage_error(parse, least):
    """A word, a float or an empty argument is refused as one past the lower bound, not read as
    that bound."""
    assert parse(str(least)) == least and parse(f" {least + 7} ") == least + 7
    for text in ("abc", "1e3", "1.5", "", str(least - 1)):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a whole number"):
            parse(text)


def test_a_seed_that_is_not_a_whole_number_ends_the_tool_with_one_line():
    r = call(entry(SCRIPTS["mpp-make-shards"]), ["no-such-folder", "out", "--seed", "abc"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert r.stderr.startswith("error: ") and "argument --seed: expected a whole number >= 0, got 'abc'" in r.stderr


def test_a_seed_is_taken_up_to_2_to_the_32_minus_1_and_refused_past_it():
    """numpy's seeds are 0..2**32 - 1: the last one is taken, the next refused before any work."""
    assert cli.seed("4294967295") == 2**32 - 1
    for text in ("4294967296", "4294967297"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a seed in 0..4294967295"):
            cli.seed(text)


def test_an_empty_or_blank_path_is_refused():
    """An empty path meant this folder; one of only spaces or a tab is as empty."""
    assert cli.path("runs/a") == "runs/a"
    for text in ("", " ", "  ", "\t"):
        with pytest.raises(argparse.ArgumentTypeError, match="empty path"):
            cli.path(text)


def test_a_bad_key_or_path_answers_at_once_without_importing_torch():
    """A mistyped key, or a report of a folder with no runs, is answered before torch, torchvision
    and timm are imported (the error's own handling imported them: seconds for a one-line answer).
    In a fresh process, as a user's: this one has imported torch long ago."""
    code = textwrap.dedent("""\
        import sys
        for tool, argv in (("pretrain", ["--config", "configs/synthetic_mpp.yaml", "optim.lrr=0.1"]),
                           ("finetune", ["--config", "configs/synthetic_finetune.yaml", "optim.lrr=0.1"]),
                           ("linear_probe", ["--config", "configs/synthetic_probe.yaml", "optim.lrr=0.1"]),
                           ("compare", ["--config", "configs/compare_synthetic.yaml", "lable_fractions=[1.0]"]),
                           ("report", [sys.argv[1]])):
            try:
                __import__(f"mpp.tools.{tool}", fromlist=["main"]).main(argv)
            except SystemExit as e:
                print(tool, e.code, "torch" in sys.modules)""")
    r = subprocess.run([sys.executable, "-c", code, str(ROOT / "nowhere")], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    tools = ("pretrain", "finetune", "linear_probe", "compare", "report")
    assert r.stdout.split("\n")[:5] == [f"{t} 2 False" for t in tools], (r.stdout, r.stderr[-2000:])
    assert r.stderr.count("did you mean 'optim.lr'?") == 3 and "did you mean 'label_fractions'?" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: {ROOT / 'nowhere'}")


def test_cited_configs_exist():
    """Every configs/*.yaml that a tool, the README or a doc cites is there."""
    texts = [*(ROOT / "mpp/tools").glob("*.py"), ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
             *(ROOT / "configs").glob("*.yaml")]
    cited = {m for p in texts for m in re.findall(r"configs/[\w.-]+\.yaml", p.read_text())}
    assert cited and not [c for c in sorted(cited) if not (ROOT / c).is_file()]


@pytest.mark.parametrize("path", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_shipped_configs_pass_their_checks(path, monkeypatch):
    """Every configs/*.yaml loads through the schema and its checks, a comparison's with every
    stage's, and none sets a key its tool never reads."""
    from mpp import compare
    from mpp.config import TOOL_DEFAULTS, check_tool, load_compare_config, load_config
    monkeypatch.chdir(ROOT)  # a comparison names its stages' configs from the repository root
    if path.startswith("compare_"):
        cfg = load_compare_config(ROOT / "configs" / path)
        stages = compare.plan(cfg)
        resolved = compare.validate(cfg, stages)
        assert not {s.name: u for s in stages if (u := check_tool(resolved[s.out], s.tool))}
    else:
        tool = "finetune" if "finetune" in path else "linear_probe" if "probe" in path else "pretrain"
        assert check_tool(load_config(ROOT / "configs" / path, defaults=TOOL_DEFAULTS.get(tool, [])), tool) == []


def test_a_setting_the_tool_never_reads_is_warned_of(capsys):
    """finetune.init given to a pre-training pre-trained from scratch on all the labels, without a
    word; mpp.* given to a fine-tune, optim.* to a probe did nothing either."""
    from mpp.cli import parse_config_args
    for tool, given, said in (("pretrain", ["finetune.init=/x", "finetune.label_fraction=0.1"],
                               "objective=mpp never reads finetune.init=/x, finetune.label_fraction=0.1"),
                              ("finetune", ["mpp.target=hog"], "objective=classify never reads mpp.target=hog"),
                              ("linear_probe", ["optim.lr=0.1"], "this tool never reads optim.lr=0.1")):
        parse_config_args("", given, tool=tool)
        assert capsys.readouterr().err == f"warning: {said}: those settings do nothing here\n"
    parse_config_args("", ["optim.lr=0.1", "fewshot.seeds=2"], tool="pretrain")
    assert capsys.readouterr().err == ""


def test_the_probe_tool_warns_of_an_optim_setting_it_never_reads(monkeypatch):
    """The probe tool names itself to the config parser, which warns that optim.* does nothing."""
    import mpp.evaluators.linear_probe
    monkeypatch.setattr(mpp.evaluators.linear_probe, "run_linear_probe", lambda cfg: {})
    r = call(entry(SCRIPTS["mpp-probe"]), ["--config", str(ROOT / "configs/synthetic_probe.yaml"), "optim.lr=0.5"])
    assert r.returncode == 0, r.stderr
    assert r.stderr == "warning: this tool never reads optim.lr=0.5: those settings do nothing here\n"


def test_a_value_error_of_the_probe_is_one_line_and_exit_1(monkeypatch):
    """The probe's own checks raise ValueError: the user gets its message, not a traceback."""
    import mpp.evaluators.linear_probe

    def refuse(cfg):
        raise ValueError("probe.encoder x: no such run\n  (a second line)")
    monkeypatch.setattr(mpp.evaluators.linear_probe, "run_linear_probe", refuse)
    r = call(entry(SCRIPTS["mpp-probe"]), ["--config", str(ROOT / "configs/synthetic_probe.yaml")])
    assert r.returncode == 1 and r.stderr == "error: probe.encoder x: no such run (a second line)\n"


def test_a_key_the_chosen_option_never_reads_is_warned_of(capsys):
    """Within a section the run reads, optim.momentum did nothing with AdamW, the betas with SGD,
    optim.min_lr with a constant schedule and mpp.bits with the hog target, without a word; a key
    of a section the tool never reads is named once, with its section."""
    from mpp.cli import parse_config_args
    for tool, given, said in (
            ("pretrain", ["optim.momentum=0.5"], "optim.name=adamw never reads optim.momentum=0.5"),
            ("pretrain", ["optim.name=sgd", "optim.beta1=0.5", "optim.schedule=constant", "optim.min_lr=1e-5"],
             "optim.name=sgd never reads optim.beta1=0.5; optim.schedule=constant never reads optim.min_lr=1e-05"),
            ("pretrain", ["mpp.target=hog", "mpp.bits=1", "data.epoch_samples=100"],
             "mpp.target=hog never reads mpp.bits=1; data.resampled=false never reads data.epoch_samples=100"),
            ("finetune", ["mpp.target=hog", "mpp.bits=1", "optim.name=sgd", "optim.beta2=0.9"],
             "objective=classify never reads mpp.bits=1, mpp.target=hog; optim.name=sgd never reads optim.beta2=0.9"),
            ("linear_probe", ["optim.name=sgd", "optim.beta1=0.5"],
             "this tool never reads optim.beta1=0.5, optim.name=sgd")):
        parse_config_args("", given, tool=tool)
        assert capsys.readouterr().err == f"warning: {said}: those settings do nothing here\n"
    for given in (["optim.name=sgd", "optim.momentum=0.5"], ["optim.beta1=0.8", "optim.min_lr=1e-5"],
                  ["mpp.target=hog"], ["mpp.bits=2"], ["train.compile=never"],
                  ["data.resampled=true", "data.epoch_samples=100"]):
        parse_config_args("", given, tool="pretrain")
        assert capsys.readouterr().err == "", given


def test_a_tool_s_defaults_lie_beneath_its_config_file(tmp_path):
    """tools/finetune.py's objective=classify was applied over the file: a pre-training's config ran
    as a from-scratch fine-tune of its recipe. It lies beneath the file now: a file that names no
    objective is a fine-tune, one that names another tool's is refused, naming the file."""
    from mpp.cli import parse_config_args
    from mpp.config import ConfigError
    (tmp_path / "none.yaml").write_text("optim: {lr: 0.01}\n")
    assert parse_config_args("", ["--config", str(tmp_path / "none.yaml")], tool="finetune").objective == "classify"
    (tmp_path / "sup.yaml").write_text("base: none.yaml\nobjective: supervised\n")
    with pytest.raises(ConfigError, match=r"^objective=supervised \(from config file '.*sup.yaml'\) is not what "
                                          r"this tool trains \(classify\); run tools/pretrain.py"):
        parse_config_args("", ["--config", str(tmp_path / "sup.yaml")], tool="finetune")
    assert parse_config_args("", ["--config", str(tmp_path / "sup.yaml"), "objective=classify"],
                             tool="finetune").objective == "classify"  # an override still goes over the file
    with pytest.raises(ConfigError, match=r"^objective=mpp is not"):  # typed: no file to name
        parse_config_args("", ["--config", str(tmp_path / "none.yaml"), "objective=mpp"], tool="finetune")


def test_values_are_read_as_written(tmp_path):
    """Overrides and config files keep the text of a string (YAML 1.1 reads 010 as 8, 12:30 as 750,
    1_000 as 1000, off as false and 2026-12-04 as a date, YAML 1.2 0x10 as 16, a ' #' would start a
    comment, and an override's runs/a: b, - a or #1 is YAML's mapping, list or comment) and read
    numbers in decimal."""
    from mpp.config import load_compare_config, load_config
    for text in ("010", "12:30", "1_000", "off", "runs/a #1", "#1", "2026-12-04", "2026-12-04 10:00:00", "runs/a: b",
                 "- a", "0x10", "0o10", "+7"):
        assert load_config(None, [f"output_dir={text}"]).output_dir == text
    compare = load_compare_config(ROOT / "configs/compare_synthetic.yaml", ["output_dir=runs/a: b"])
    assert compare.output_dir == "runs/a: b"
    cfg = load_config(None, ["steps=010", "optim.lr=1e-3", "data.withhold=[[0.1,0,0.1]]"])
    assert (cfg.steps, cfg.optim.lr, cfg.data.withhold) == (10, 1e-3, ((0.1, 0, 0.1),))
    (tmp_path / "c.yaml").write_text("output_dir: 2026-12-04\nsteps: 2e3\ntrain:\n  precision: no\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert (cfg.output_dir, cfg.steps, cfg.train.precision) == ("2026-12-04", 2000, "no")
    (tmp_path / "c.yaml").write_text("output_dir: 0x1F\nsteps: +7\n")  # a file's too: not '31'; +7 a number
    assert (load_config(tmp_path / "c.yaml").output_dir, load_config(tmp_path / "c.yaml").steps) == ("0x1F", 7)



def test_a_config_that_would_lose_what_it_says_is_refused_and_an_empty_section_is_read(tmp_path):
    """A number for a text key lost its spelling (output_dir=1.10 wrote to '1.1', 1e3 to
    '1000.0'), and so does a file's mapping for one; a key given twice in one mapping dropped the first (a second optim: section the
    first's rate); both are refused in one line. A section whose entries are all commented out
    is an empty one (it was refused), and over a base file it changes nothing."""
    from mpp.config import ConfigError, load_config
    for text in ("1.10", "1e3", ".5"):
        with pytest.raises(ConfigError, match="'output_dir' must be a string, got the number .* quote it"):
            load_config(None, [f"output_dir={text}"])
    assert load_config(None, ["output_dir='1.10'", "finetune.init=7"]).output_dir == "1.10"
    (tmp_path / "map.yaml").write_text("output_dir:\n  runs/a: b\n")  # a file's text read as a mapping
    with pytest.raises(ConfigError, match=r"'output_dir' must be a string, got \{'runs/a': 'b'\}; .* quote it"):
        load_config(tmp_path / "map.yaml")
    (tmp_path / "twice.yaml").write_text("optim: {lr: 0.1}\nseed: 1\noptim: {name: sgd}\n")
    with pytest.raises(ConfigError, match=r"'optim' is given twice in one mapping; give each key once .*line 3"):
        load_config(tmp_path / "twice.yaml")
    (tmp_path / "same.yaml").write_text("optim: {lr: 0.1}\nfraction_overrides: {0.1: [steps=6], 0.10: [steps=8]}\n")
    with pytest.raises(ConfigError, match=r"'0.10' is given twice in one mapping"):  # one value, two spellings
        load_config(tmp_path / "same.yaml")
    (tmp_path / "merge.yaml").write_text("optim: {<<: {lr: 0.1}, name: sgd}\n")  # a YAML merge key is no key twice
    assert load_config(tmp_path / "merge.yaml").optim.lr == 0.1
    (tmp_path / "base.yaml").write_text("optim:\n  lr: 0.01\n")
    (tmp_path / "c.yaml").write_text("base: base.yaml\noptim:\n  # lr: 0.1\nfewshot:\n  # shots: [1]\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert cfg.optim.lr == 0.01 and cfg.fewshot.shots == load_config(None).fewshot.shots



def test_true_or_false_for_a_string_key_is_refused_but_precision_false_means_off():
    """YAML reads an unquoted false as a boolean: for train.precision it means off (no), for any
    other string key it is refused in one line saying how to quote it, never turned into a word."""
    from mpp.config import ConfigError, load_config
    assert load_config(None, ["train.precision=false"]).train.precision == "no"
    for key, value in (("output_dir", "false"), ("model", "true"), ("train.precision", "true")):
        with pytest.raises(ConfigError, match=f"'{key}' must be a string, got {value.title()}; .* quote it: "
                                              f"{key.rsplit('.')[-1]}: '{value}'"):
            load_config(None, [f"{key}={value}"])
    assert load_config(None, ["output_dir='false'"]).output_dir == "false"


def test_true_or_false_for_a_number_key_is_refused():
    """Python's True is the int 1, so a check of the value alone would read data.shift=true as a
    shift of 1 pixel and steps=false as 0 steps: the loader refuses a boolean for every number
    key, inside a list too, in one line naming the key."""
    from mpp.config import ConfigError, load_config
    for override, wanted in (("data.shift=true", "'data.shift' must be a whole number, got True"),
                             ("steps=false", "'steps' must be a whole number, got False"),
                             ("optim.lr=true", "'optim.lr' must be a number, got True"),
                             ("data.randaugment=[true,9]",
                              r"'data.randaugment' must be a list of numbers, got \[True, 9\]")):
        with pytest.raises(ConfigError, match=wanted):
            load_config(None, [override])
    assert load_config(None, ["data.shift=1"]).data.shift == 1


def test_a_launcher_as_init_is_known_by_each_of_its_forms(tmp_path, monkeypatch):
    """A container whose entrypoint (pid 1) is the launcher starts its ranks as init's children:
    `accelerate-launch` and `python -m accelerate.commands.launch` were not known as launchers, so
    every rank exited at start-up saying its launcher had died."""
    from mpp import launcher
    cmdline = tmp_path / "cmdline"
    monkeypatch.setattr(launcher, "INIT_CMDLINE", str(cmdline))
    for args, known in ((["/usr/local/bin/accelerate-launch", "--num_processes", "2", "t.py"], True),
                        (["/usr/bin/python3", "-m", "accelerate.commands.launch", "t.py"], True),
                        (["/usr/bin/python3", "-m", "torch.distributed.run", "t.py"], True),
                        (["torchrun", "--nproc_per_node", "2", "t.py"], True),
                        (["/bin/bash", "-c", "sleep 1"], False)):
        cmdline.write_bytes(b"\0".join(a.encode() for a in args) + b"\0")
        assert launcher._init_is_launcher() is known, args
    monkeypatch.setattr(launcher, "INIT_CMDLINE", str(tmp_path / "absent"))  # unreadable: a rank is not stopped
    assert launcher._init_is_launcher() is True                               # on a guess


def test_a_rank_orphaned_at_start_up_exits_but_not_one_whose_init_is_its_launcher(tmp_path, monkeypatch):
    """A rank whose launcher died in its seconds of start-up belongs to init (parent pid 1): it
    exits with one line instead of training on, orphaned, holding the run directory; under a
    launcher that is itself pid 1 (a container's entrypoint), or with its launcher alive, it runs."""
    from mpp import launcher
    if sys.platform != "linux":
        pytest.skip("a parent's death is asked of the kernel on Linux alone")
    cmdline = tmp_path / "cmdline"
    monkeypatch.setattr(launcher, "INIT_CMDLINE", str(cmdline))
    monkeypatch.setattr(launcher, "follow_parent", lambda: None)  # not this pytest's own death signal
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    cmdline.write_bytes(b"/sbin/init\0")
    monkeypatch.setattr(os, "getppid", lambda: 1)
    with pytest.raises(SystemExit, match="this rank's launcher .* exited while it started; start the job again"):
        launcher.die_with_launcher()
    cmdline.write_bytes(b"\0".join([b"torchrun", b"--nproc_per_node", b"2", b"t.py"]))
    launcher.die_with_launcher()
    cmdline.write_bytes(b"/sbin/init\0")
    monkeypatch.setattr(os, "getppid", lambda: 4242)
    launcher.die_with_launcher()


def test_a_launch_variable_set_empty_is_refused_and_a_rank_without_a_world_size_taken(monkeypatch):
    """WORLD_SIZE= (set, empty: a script's unset variable) is not a whole number, said in one line,
    not read as unset (one process where the script meant many). RANK is checked against
    WORLD_SIZE only where that is set: without it the run is one process, which no stray RANK stops."""
    from mpp.launcher import launch_env
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "3")
    assert launch_env() == {"WORLD_SIZE": 1, "RANK": 3, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": 1, "MASTER_PORT": None}
    for name in ("WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.setenv(name, "")
        with pytest.raises(ConfigError, match=f"^environment variable {name}='' is not a whole number; the launcher"):
            launch_env()
        monkeypatch.delenv(name)


# each setting at the edge of its range (accepted) and just past it (refused, naming the key)
EDGES = [("optim.clip_grad", "0", "-1"), ("finetune.drop_path", "0.99", "1"), ("data.hflip", "1", "1.5"),
         ("data.crop_scale", "[0.5,0.5]", "[0.9,0.5]"), ("optim.layer_decay", "1", "1.5"),
         ("train.keep_ckpts", "1", "0"), ("mpp.ratio", "1", "1.5"), ("mpp.random", "0", "-0.1"),
         ("finetune.label_fraction", "1", "1.5"), ("finetune.dev_fraction", "0.99", "1"),
         ("probe.val_fraction", "0.99", "1"), ("train.grad_accum", "1", "0"), ("data.max_pixels", "1", "0"),
         ("steps", "0", "-1"), ("data.num_workers", "0", "-1"), ("train.image_every", "0", "-1"),
         ("data.resampled", "false", "no"), ("steps", "3", "2.5")]


@pytest.mark.parametrize("key, edge, past", EDGES, ids=[f"{k}={p}" for k, _, p in EDGES])
def test_a_setting_past_its_range_is_refused_before_any_work(key, edge, past):
    """One line naming the key, at load: -1 for clip_grad trained uphill (a negative clip factor),
    keep_ckpts=0 kept every checkpoint, 'no' for a boolean is YAML 1.1's False only by accident,
    2.5 steps is no count; the edge itself is a setting."""
    extra = {"mpp.random": ["mpp.mask=0.9", "mpp.keep=0.1"], "steps": ["epochs=0"]}.get(key, [])
    load_config(None, [f"{key}={edge}", *extra])
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [f"{key}={past}", *extra])


def test_a_setting_that_leaves_another_unread_is_warned_of_each_pair():
    """Each pair of mpp.config.UNREAD_WITH, named one by one: the unread key set away from its
    default is warned of (a recipe that sets it believes it does something), and not once the
    setting that reads it is on."""
    from mpp.config import check_tool
    pairs = [("optim.name=adamw", "optim.momentum=0.5", "optim.name=sgd"),
             ("optim.name=adam", "optim.momentum=0.5", "optim.name=sgd"),
             ("optim.name=sgd", "optim.beta2=0.95", "optim.name=adamw"),
             ("optim.schedule=constant", "optim.min_lr=0.0001", "optim.schedule=cosine"),
             ("mpp.target=hog", "mpp.bits=2", "mpp.target=mean_color"),
             ("train.compile=never", "train.compile_mode=max-autotune", "train.compile=always"),
             ("data.resampled=false", "data.epoch_samples=64", "data.resampled=true"),
             ("data.shuffle_buffer=0", "data.shuffle_mb=7", "data.shuffle_buffer=64")]
    for leaves, unread, reads in pairs:
        assert check_tool(load_config(None, [leaves, unread]), "pretrain") == [f"{leaves} never reads {unread}"]
        assert check_tool(load_config(None, [reads, unread]), "pretrain") == []


def test_the_data_withholds_and_probes_split_seed_is_one_whole_number_however_written():
    """The development split's RNG is seeded with the seed's text: 0.0 and 0 would draw two splits,
    so a pre-training written with [0.1, 0.0, 0.1] would withhold another split than the fine-tune
    with split_seed 0 chooses on."""
    cfg = load_config(None, ["data.withhold=[[0.1,0.0,0.1]]", "probe.dev_split=[2.0,0.1]"])
    assert cfg.data.withhold == ((0.1, 0, 0.1),) and type(cfg.data.withhold[0][1]) is int
    assert tuple(cfg.probe.dev_split) == (2, 0.1) and type(cfg.probe.dev_split[0]) is int


def test_a_comparisons_shard_sources_and_outputs_pair_up(tmp_path):
    """prepare.shards_src and prepare.shards_out are zipped: one source more would be dropped unsaid."""
    from mpp.config import load_compare_config
    path = tmp_path / "c.yaml"
    path.write_text(f"base: {ROOT / 'configs/compare_synthetic.yaml'}\n")
    with pytest.raises(ConfigError, match="prepare.shards_src and prepare.shards_out must have the same length"):
        load_compare_config(path, ["prepare.shards_src=[a.tar,b.tar]", "prepare.shards_out=[data/a]"])


def test_a_fine_tune_given_data_withhold_is_refused_not_silently_ignored():
    """data.withhold leaves development splits out of a pre-training; a fine-tune never reads it (its
    own split is finetune.dev_fraction), so a fine-tune config that sets it is refused at load."""
    load_config(None, ["objective=mpp", "data.withhold=[[0.1,0,0.1]]"])
    with pytest.raises(ConfigError, match="'data.withhold' is for pre-training; a fine-tune holds out its own"):
        load_config(None, ["objective=classify", "data.withhold=[[0.1,0,0.1]]"])


def test_a_value_past_what_a_run_can_use_is_refused_at_load():
    """Each config refused in one line naming its key before any work, beside the edge that is
    taken: batch_size=0 trains on nothing, a floor above optim.lr makes the schedule rise, a
    withheld split with dev_fraction 0 is empty, and few-shot on with one of its two sets stops the
    run at its first evaluation, hours in."""
    cases = [(["batch_size=1"], ["batch_size=0"], r"'batch_size' must be in 1\.\."),
             (["optim.lr=0.001", "optim.min_lr=0.001"], ["optim.lr=0.001", "optim.min_lr=0.002"],
              r"'optim\.min_lr' \(0\.002\) is above optim\.lr \(0\.001\)"),
             (["data.withhold=[[0.1,0,0.01]]"], ["data.withhold=[[0.1,0,0]]"],
              r"'data\.withhold' lists \[0\.1, 0, 0\]: each entry must be"),
             (["fewshot.every=2", "fewshot.train=tr", "fewshot.test=te"], ["fewshot.every=2", "fewshot.train=tr"],
              r"'fewshot\.every' > 0 needs labeled shards in fewshot\.train and fewshot\.test"),
             (["fewshot.every=0", "fewshot.test=te"], ["fewshot.every=2", "fewshot.test=te"],
              r"'fewshot\.every' > 0 needs labeled shards")]
    for taken, refused, says in cases:
        load_config(None, ["objective=mpp", *taken])
        with pytest.raises(ConfigError, match=says):
            load_config(None, ["objective=mpp", *refused])
