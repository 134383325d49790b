"""`maco reproduce`: run the experiments behind the paper's figures and write REPORT.md,
each figure's measured summary beside the paper's number for it.

The experiments are the package maco.experiments (experiments/ in a checkout), which the library
never imports: this module finds them at run time, by name. The package's FIGURES maps each figure
to its module, in the report's order; each module declares FIGURE (the paper's number, why ours
differs, how to run it) and summarise(rows), its line of the report from the CSV it writes. So
changing an experiment never touches this file. Each summary names the machine that measured it
(the CSV's .env.json); a figure with CSVs from several machines gets one summary per machine.

Each runs as `python -m maco.experiments.<module>` in a subprocess (one failing figure does not
stop the others; each one's output goes to a log beside its CSV). GPU figures run only where a
GPU is usable; otherwise the report cites the GPU results already in the folder.
"""
from __future__ import annotations

import functools
import importlib
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Callable, Protocol

from maco.core.errors import MacoError
from maco.core.files import read_text, write_atomic

PACKAGE = "maco.experiments"
RECORDS = "records_cpu.jsonl"  # tuning records in --out, passed to the figures that take them


class Figure(Protocol):
    """What reproduce reads of an experiment's FIGURE (a maco.experiments.common.Figure)."""

    name: str
    paper: str  # what the paper reports
    why: str  # why our number differs
    gpu: bool
    quick: bool  # the script takes --quick
    in_all: bool  # `all` runs it
    records: bool  # it takes --records


def _import(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            raise MacoError(f"{name} is not installed: reinstall MACO (pip install .) from a "
                            "checkout that has experiments/") from None
        raise


def names() -> list[str]:
    """The figures' names in the report's order (cheap: no experiment is imported)."""
    return list(_import(PACKAGE).FIGURES)


@functools.cache
def experiments() -> dict[str, ModuleType]:
    """Figure name -> its experiment module, in the report's order."""
    modules = {name: _import(f"{PACKAGE}.{module}") for name, module in _import(PACKAGE).FIGURES.items()}
    for name, module in modules.items():
        if module.FIGURE.name != name:
            raise MacoError(f"{module.__name__}.FIGURE is named {module.FIGURE.name!r}, listed as {name!r}")
    return modules


def figures() -> list[Figure]:
    return [module.FIGURE for module in experiments().values()]


def select(wanted: list[str]) -> list[Figure]:
    """The figures named (all: every one but those left out of all, unless named too)."""
    every = figures()
    if not wanted or "all" in wanted:
        return [f for f in every if f.in_all] + [f for f in every if not f.in_all and f.name in wanted]
    known = [f.name for f in every]
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise MacoError(f"unknown figure(s) {', '.join(unknown)}; choose from {', '.join(known)} or all")
    return [f for f in every if f.name in wanted]


def run_figures(figures: list[Figure], out: Path, quick: bool, log: Callable[[str], None] = print,
                gpu: bool | None = None) -> dict[str, str]:
    """Run each figure's script; returns name -> status ("ok", "failed (rc N)", "skipped: ...")."""
    if gpu is None:
        from maco.kernels.cuda import gpu_available

        gpu = gpu_available()
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    records = out / RECORDS  # records of another machine are ignored by target
    # a checkout's scripts read data under results/ relative to it, as when run by hand there
    cwd = _import(f"{PACKAGE}.common").CHECKOUT
    status: dict[str, str] = {}
    for i, fig in enumerate(figures, 1):
        if fig.gpu and not gpu:
            status[fig.name] = "skipped: no usable GPU here (the report cites earlier GPU results if any)"
            log(f"[{i}/{len(figures)}] {fig.name}: {status[fig.name]}")
            continue
        module = experiments()[fig.name].__name__
        args = [sys.executable, "-m", module, "--out", str(out)] + (["--quick"] if quick and fig.quick else [])
        if fig.records and records.is_file():
            args += ["--records", str(records)]
        log(f"[{i}/{len(figures)}] {fig.name}: {' '.join(args[1:])}")
        start = time.perf_counter()
        with open(out / f"reproduce_{fig.name}.log", "w") as fh:
            rc = subprocess.run(args, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT).returncode
        status[fig.name] = "ok" if rc == 0 else f"failed (exit code {rc}, see reproduce_{fig.name}.log)"
        log(f"      {status[fig.name]} in {time.perf_counter() - start:.0f} s")
    return status


NOTES = "<!-- notes: maco reproduce keeps everything from this line on as it is -->"


def _kept_notes(path: Path) -> list[str]:
    """The hand-written notes of an existing report: from the NOTES line to the end (a report that
    exists but cannot be read is an error, not notes lost)."""
    if not os.path.lexists(path):
        return []
    text = read_text(path, "the report", 16 << 20)
    at = text.find(NOTES)
    return text[at:].rstrip("\n").split("\n") + [""] if at >= 0 else []


def write_report(out: Path, status: dict[str, str], path: Path | None = None) -> Path:
    """REPORT.md in `out` (or `path`): per figure, the paper's number, ours, why they differ;
    the notes below the NOTES line of the report already there are kept."""
    from maco.core.timing import environment

    summaries = _import(f"{PACKAGE}.common").summaries
    env = environment()
    lines = ["# MACO: reproduced figures", "",
             f"Written by `maco reproduce` on {time.strftime('%Y-%m-%d %H:%M')} on {env.get('cpu')} "
             f"({env.get('isa')}, {env.get('cores')} cores, torch {env.get('torch')}, gcc {env.get('gcc')}, "
             f"MACO {env.get('maco')}" + (f", GPU {env['gpu']}" if env.get("gpu") else ", no GPU") + "), "
             "which measured only the figures marked ok under \"run now\".", "",
             "Each row summarises the CSV named under it: this run's when it wrote one, else the one kept "
             "in results/. Each summary starts with the machine that measured it (from the `.env.json` "
             "written beside the CSV); where several machines have a result for a figure, each gets its "
             "own summary (absolute GFLOP/s and milliseconds differ between machines; compare ratios).", "",
             "| figure | the paper | measured | why it differs | run now |", "|---|---|---|---|---|"]
    for name, module in experiments().items():
        fig = module.FIGURE
        found = summaries(module, out)
        cell = "<br><br>".join(
            f"{'**' + host + '**' if host else '**host not recorded** (no .env.json)'}: {measured}<br>`{where}`"
            for host, measured, where in found) or "not measured yet"
        lines.append(f"| {name} | {fig.paper} | {cell} | {fig.why} | {status.get(name, 'not run now')} |")
    lines.append("")
    path = path or out / "REPORT.md"
    lines += _kept_notes(path)
    write_atomic(path, "\n".join(lines))
    return path
