"""`maco reproduce`: run the experiments behind the paper's figures and write REPORT.md."""
from __future__ import annotations

import argparse

from maco.core.errors import MacoError
from maco.core.files import check_writable
from maco.reproduce import names, run_figures, select, write_report


def register(sub: argparse._SubParsersAction) -> None:
    try:
        figures = "Figures: " + ", ".join(names()) + "."
    except MacoError as exc:  # the CLI's other commands work without the experiments
        figures = str(exc)
    p = sub.add_parser(
        "reproduce", help="run the experiments behind the paper's figures and write REPORT.md",
        description="Run the experiment (maco.experiments, experiments/ in a checkout) of each figure "
        "named (GPU figures only where a GPU is usable), each into --out with a log, then write "
        "--out/REPORT.md: every figure's measured summary beside the paper's number; tuning records "
        "in --out/records_cpu.jsonl are passed to the figures that use them. " + figures)
    p.add_argument("figures", nargs="*", default=["all"], metavar="FIGURE",
                   help="figures to run (default all)")
    p.add_argument("--quick", action="store_true", help="smaller, faster runs (minutes, not hours)")
    p.add_argument("--out", default="results", help="output folder (default results)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing; write REPORT.md from the CSVs already in --out")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    figures = select(args.figures)
    out = check_writable(args.out, "--out", folder=True)
    status = {} if args.report_only else run_figures(figures, out, args.quick)
    path = write_report(out, status)
    print(f"report: {path}")
    failed = [name for name, s in status.items() if s.startswith("failed")]
    return 1 if failed else 0
