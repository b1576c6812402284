"""The gap report of MPP vs supervised pre-training vs scratch from finished run directories.

Example: python tools/report.py runs/cmp/mpp runs/cmp/sup runs/cmp/ft_mpp_10 ... --out runs/cmp
"""
from __future__ import annotations

import argparse
from pathlib import Path

from mpp.cli import one_line_errors
from mpp.report import write_report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="A run's role comes from its config (objective, finetune.init, "
                                            "probe.encoder, finetune.label_fraction) or a 'role' key in its "
                                            "metrics.json; see mpp/report.py.")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR",
                        help="run directories holding metrics.json and config.yaml")
    parser.add_argument("--out", help="where report.md/.json/.png go (default: the runs' common parent)")
    args = parser.parse_args(argv)
    with one_line_errors():
        rep = write_report(args.runs, args.out)
    print((Path(rep["out_dir"]) / "report.md").read_text())


if __name__ == "__main__":
    main()
