"""Entry point: `python -m launcher` or `torchrun ... -m launcher`; `python -m launcher plot`
and `python -m launcher status` look at runs instead of training (launcher/report.py)."""

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["plot"] or sys.argv[1:2] == ["status"]:
        # Before importing the trainer: these commands need neither torch nor datasets.
        from launcher.report import main as report_main

        sys.exit(report_main(sys.argv[1:]))
    from launcher.main import main

    sys.exit(main())
