"""What the experiment scripts share: each one's entry in `maco reproduce`'s report (its Figure and
the summary of its CSV), the --out/--quick arguments, and results written whole (CSV, JSON, PNG).

`maco reproduce` imports this and every experiment to read their figures, so it stays light:
heavy libraries (torch, matplotlib) are imported where they are used.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Iterable, Mapping, Sequence

from maco.core.files import write_atomic
from maco.core.timing import environment

ROOT = Path(__file__).resolve().parents[1]  # the checkout, or site-packages/maco once installed
RESULTS = ROOT / "results"  # the results kept in a checkout: the report falls back on them
CHECKOUT: Path | None = ROOT if (ROOT / "pyproject.toml").is_file() else None


@dataclass(frozen=True)
class Figure:
    """One row of REPORT.md: what the paper reports, why our number differs, and how to run it."""

    name: str
    paper: str  # what the paper reports for it
    why: str = ""  # why our number differs from the paper's, where it does
    csv: tuple[str, ...] = ()  # the CSV files (glob patterns) summarised, the preferred first
    gpu: bool = False
    quick: bool = True  # the script takes --quick
    in_all: bool = True  # `all` runs it (peers needs the optional extra and an hour)
    records: bool = False  # gets --records OUT/records_cpu.jsonl when that file exists
    # the .env.json that names the machine of a CSV (path relative to its folder) whose script
    # writes it under another name than NAME.env.json / NAME.csv.env.json beside it
    env: Mapping[str, str] = field(default_factory=dict, compare=False)
    # the machine of a committed CSV whose run wrote no .env.json: (sha256 prefix of that file, host);
    # it names the host only while the file is the one committed
    hosts: Mapping[str, tuple[str, str]] = field(default_factory=dict, compare=False)


# -- the report: each experiment's summarise(rows) reads its own CSV ----------------------------
def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def num(row: Mapping[str, str] | None, key: str) -> float:
    """A CSV cell as a float; NaN where it is missing or not a number."""
    try:
        return float(row[key])  # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        return float("nan")


def geomean(values: Sequence[float]) -> float:
    """Geometric mean of the positive, finite values (NaN if none)."""
    kept = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(map(math.log, kept)) / len(kept)) if kept else float("nan")


def find(folders: Sequence[Path], patterns: Sequence[str]) -> Path | None:
    """The first file matching a pattern, folder by folder."""
    for folder in folders:
        for pattern in patterns:
            hits = sorted(folder.glob(pattern)) if folder.is_dir() else []
            if hits:
                return hits[0]
    return None


def _cpu(name: Any) -> str:
    """A CPU model as people say it: "Intel(R) Xeon(R) Processor" -> "Intel Xeon"."""
    text = str(name).replace("(R)", "").replace("(TM)", "").replace(" Processor", "")
    return " ".join(text.split())


def host_label(env: Mapping[str, Any]) -> str | None:
    """The machine an .env.json names: CPU model (ISA, cores), the GPU first where there is one;
    a data set's sidecar (fingerprint -> environment) names each of its machines."""
    if "cpu" not in env and "gpu" not in env:
        inner = sorted({label for v in env.values() if isinstance(v, dict) and (label := host_label(v))})
        return " and ".join(inner) or None
    details = [str(env["isa"])] if env.get("isa") else []
    details += [f"{env['cores']} cores"] if env.get("cores") else []
    label = _cpu(env.get("cpu") or "unknown CPU") + (f" ({', '.join(details)})" if details else "")
    if env.get("measured_on") and _cpu(env["measured_on"]) != _cpu(env.get("cpu")):  # re-analysed elsewhere
        label = f"{_cpu(env['measured_on'])}, analysed on {label}"
    return f"{env['gpu']}, host {label}" if env.get("gpu") else label


def host_of(fig: Figure, path: Path, folder: Path) -> str | None:
    """The machine that measured `path`: its .env.json (beside it, or the one FIGURE.env names),
    else FIGURE.hosts while the file is the committed one; None when nothing records it."""
    rel = path.relative_to(folder).as_posix()
    sidecars = ([folder / fig.env[rel]] if rel in fig.env else []) + [
        path.with_suffix(".env.json"), path.with_name(path.name + ".env.json")]
    for sidecar in sidecars:
        try:
            label = host_label(json.loads(sidecar.read_text()))
        except (OSError, ValueError, AttributeError):
            continue
        if label:
            return label
    if rel in fig.hosts:
        digest, host = fig.hosts[rel]
        if hashlib.sha256(path.read_bytes()).hexdigest().startswith(digest):
            return host
    return None


def summaries(experiment: ModuleType, out: Path) -> list[tuple[str | None, str, str]]:
    """(host, what was measured, from which file), one per machine, for one experiment module:
    the CSVs in `out`, else those kept in the checkout's results/. Per host the first file of
    FIGURE.csv's patterns counts; a file that cannot be read says so."""
    fig = experiment.FIGURE
    for folder in (out, RESULTS):
        hits = [p for pattern in fig.csv for p in (sorted(folder.glob(pattern)) if folder.is_dir() else [])]
        if hits:
            break
    else:
        return []
    found: dict[str | None, tuple[str, str]] = {}
    for path in dict.fromkeys(hits):
        host = host_of(fig, path, folder)
        if host in found:
            continue
        where = str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.relative_to(folder))
        try:
            rows = read_rows(path)
            found[host] = ((experiment.summarise(rows) if rows else "the file is empty"), where)
        except (KeyError, ValueError, IndexError, ZeroDivisionError) as exc:
            found[host] = (f"unreadable ({type(exc).__name__}: {exc})", where)
    return [(host, measured, where) for host, (measured, where) in found.items()]


def summary(experiment: ModuleType, out: Path) -> tuple[str, str]:
    """(what was measured, from which file) for one experiment module: the first of summaries()."""
    found = summaries(experiment, out)
    return found[0][1:] if found else ("not measured yet", "")


# -- running a script ---------------------------------------------------------------------------
def parser(doc: str | None, quick: str | None = None) -> argparse.ArgumentParser:
    """The arguments every script takes: --out (default results) and, where `quick` says what it
    cuts, --quick (`maco reproduce --quick` passes it)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("results"), help="output folder (default results)")
    if quick is not None:
        ap.add_argument("--quick", action="store_true", help=quick)
    return ap


def out_dir(args: argparse.Namespace) -> Path:
    """--out, created."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def quiet(patience: float = 30.0) -> float:
    """Wait (up to `patience` s) for the shared cores to be quiet; the canary's load before timing."""
    from maco.layouts.canary import Canary

    global _CANARY
    if _CANARY is None:
        _CANARY = Canary()
    return round(_CANARY.wait_quiet(patience=patience), 2)


_CANARY: Any = None


def outputs_equal(model: Any, planned: Any, x: Any) -> bool:
    """Whether a planned model computes what the original does (fp32 tolerance)."""
    import torch

    with torch.inference_mode():
        want, got = model(x), planned(x)
    return bool(torch.allclose(want, got, rtol=1e-4, atol=1e-5 * float(want.abs().max())))


# -- results, written whole or not at all -------------------------------------------------------
def write_csv(path: Path, rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None,
              floats: str | None = None) -> None:
    """Rows of dicts as CSV (columns: the first row's keys unless given; cells a row lacks are
    empty, keys not in `columns` dropped); `floats` formats float cells, e.g. ".5g"."""
    columns = list(columns if columns is not None else rows[0])
    buf = io.StringIO()
    w = csv.DictWriter(buf, columns, restval="", extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({k: format(v, floats) if floats and isinstance(v, float) else v for k, v in r.items()})
    write_atomic(path, buf.getvalue())


def write_table(path: Path, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A header and rows of lists as CSV."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(header)
    w.writerows(rows)
    write_atomic(path, buf.getvalue())


def write_env(csv_path: Path, **extra: Any) -> Path:
    """NAME.env.json beside NAME.csv: the machine and libraries that made it, plus `extra`."""
    path = csv_path.with_suffix(".env.json")
    write_atomic(path, json.dumps(dict(environment(), **extra), indent=1, default=str))
    return path


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]], width: int = 160) -> None:
    """A rich table on the terminal (plain text when piped)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*[str(v) for v in row])
    Console(width=width).print(table)


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(fig: Any, path: Path, dpi: int = 120) -> None:
    """Save a matplotlib figure as PNG, whole or not at all, and close it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    pyplot().close(fig)
    write_atomic(path, buf.getvalue())


def layer_bars(rows: Sequence[Mapping[str, Any]], bars: Sequence[tuple[str, str]], title: str,
               ylabel: str = "GFLOP/s", width: float = 0.55) -> tuple[Any, Any, Any]:
    """A figure with one group of bars per conv layer (`bars`: column, label) and the FMA peak timed
    in the same rounds as a tick above each group; returns (figure, axes, x) for what a plot adds."""
    import numpy as np

    x = np.arange(len(rows))
    fig, ax = pyplot().subplots(figsize=(max(8, width * len(rows)), 4.5))
    step = 0.8 / len(bars)
    for i, (col, label) in enumerate(bars):
        ax.bar(x + (i - (len(bars) - 1) / 2) * step, [r[col] for r in rows], step, label=label)
    ax.plot(x, [r["peak_gflops"] for r in rows], "k_", ms=12, label="FMA peak, same rounds")
    ax.set_xticks(x, [f"{r['network']}:{r['layer']}" for r in rows], rotation=70, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return fig, ax, x
