"""The gap report of MPP vs supervised pre-training vs scratch from finished run directories.

  mpp-report runs/compare_cifar10                      # the runs of a comparison's plan
  mpp-report runs/cmp/mpp runs/cmp/sup runs/cmp/ft_mpp_10 ... --out runs/cmp
  mpp-report runs/compare_cifar10 --repeat runs/compare_cifar10_pretrain_seed1   # pretrain_seeds: 2
"""
from __future__ import annotations

from pathlib import Path

from mpp.cli import ArgumentParser, one_line_errors, path


@one_line_errors()
def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(__doc__, epilog="A run's role comes from its config (objective, finetune.init, "
                                            "probe.encoder, finetune.label_fraction) or a 'role' key in its "
                                            "metrics.json; see mpp/report/__init__.py.")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", type=path,
                        help="run directories holding metrics.json and config.yaml, or directories to search "
                             "for them (a folder a report was written to: the runs its report.json's plan names)")
    parser.add_argument("--out", type=path,
                        help="where report.md/.json/.png go, over any report there (default: the folder named, "
                             "where one folder that is not a run is named, else the runs' common parent; not over "
                             "a report of other runs)")
    parser.add_argument("--repeat", action="append", default=[], metavar="REPORT_DIR", type=path,
                        help="the output_dir of the same comparison with another pre-training seed (its report.json; "
                             "compare's pretrain_seeds writes OUTPUT_DIR_pretrain_seedN): the report adds each gap "
                             "over the pre-training seeds; repeat for each (default: the repeats that the report "
                             "already in the output folder names)")
    args = parser.parse_args(argv)
    from mpp.report import write_report
    from mpp.report.runs import read_repeat
    rep = write_report(args.runs, args.out, [read_repeat(d) for d in args.repeat] or None)
    print((Path(rep["out_dir"]) / "report.md").read_text())


if __name__ == "__main__":
    main()
