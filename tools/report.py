"""The gap report of MPP vs supervised pre-training vs scratch from finished run directories.

Example: python tools/report.py runs/cmp/mpp runs/cmp/sup runs/cmp/ft_mpp_10 ... --out runs/cmp
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mpp.report import ReportError, write_report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="A run's role comes from its config (objective, finetune.init, "
                                            "probe.encoder, finetune.label_fraction) or a 'role' key in its "
                                            "metrics.json; see mpp/report.py.")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR",
                        help="run directories holding metrics.json and config.yaml")
    parser.add_argument("--out", help="where report.md/.json/.png go (default: the runs' common parent)")
    args = parser.parse_args(argv)
    try:
        rep = write_report(args.runs, args.out)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    print((Path(rep["out_dir"]) / "report.md").read_text())


if __name__ == "__main__":
    main()
