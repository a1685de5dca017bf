"""`python -m launcher plot ...` and `python -m launcher status ...`: looking at runs, not
training them. `launcher/__main__.py` sends a first argument `plot` or `status` here."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from launcher import exit_codes
from launcher.status import ReportError, status_main


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plot", help="loss and learning rate by step for one or more runs")
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    p.add_argument("-o", "--output", type=Path, default=Path("loss.png"), help="(loss.png)")
    p = sub.add_parser("status", help="steps, checkpoints, resumes, speed and ETA of a run")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    args = parser.parse_args(argv)
    try:
        if args.command == "plot":
            from launcher.plot import plot_main  # matplotlib only for this command

            return plot_main(args.run_dirs, args.output)
        return status_main(args.run_dir, args.json)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_codes.USAGE
