"""The latency data set's file behind the layout predictor: random conv configurations plus every
layer of the built-in networks (random_convs), each timed in each layout (collection), one CSV row
per (spec, layout, device).

The file only ever grows: each row is appended with one O_APPEND write and fsync, so a crash
leaves whole rows and a rerun skips every (spec, layout, device) already present. The
environment that produced a row is kept once in a sidecar JSON (`<file>.env.json`), keyed by
the `env_id` column. A corrupt line is reported (warning and `bad_lines`) and skipped.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from maco.core.errors import MacoError
from maco.core.files import write_atomic
from maco.core.spec import ConvSpec
from maco.core.timing import Timing
from maco.layouts.canary import QUIET_LOAD, SETTLED_LOAD
from maco.layouts.latency import check_layout

SPEC_COLUMNS = ["n", "c", "h", "w", "k", "kh", "kw", "stride_h", "stride_w", "pad_h", "pad_w",
                "dil_h", "dil_w", "groups"]
UNREFERENCED_COLUMNS = ["spec", "layout", "device", "source", *SPEC_COLUMNS, "seconds", "min", "max",
                        "stdev", "repeats", "number", "gflops", "load", "env_id", "time"]
# reference: seconds of REFERENCE in the same rounds (maco.core.timing); ratio: median over rounds of
# seconds / reference, the label that repeats across spells
REFERENCE = "fma"  # the FMA loop doing the conv's flops. Rows name it in their environment (rows
# without a name are "fma" too). A copy of the conv's bytes after the loop ("fma+copy", meant to
# slow with memory-bound convs) made labels repeat worse than plain seconds, so it is not used.
COLUMNS = UNREFERENCED_COLUMNS + ["reference", "ratio"]


@dataclass(frozen=True)
class Row:
    """One conv in one layout on one device, and how long torch took."""

    spec: ConvSpec
    layout: str
    device: str
    source: str  # "random" or "<network>:<layer name>"
    timing: Timing
    env_id: str = ""
    time: float = 0.0
    load: float = 1.0  # the canary's time around this measurement over its quietest (1 = quiet)

    @property
    def key(self) -> tuple[str, str, str]:
        return (str(self.spec), self.layout, self.device)

    @property
    def seconds(self) -> float:
        return self.timing.median

    @property
    def ratio(self) -> float | None:
        """Seconds over the reference timed in the same rounds (None in rows from before it)."""
        return self.timing.ratio

    @property
    def noise(self) -> float:
        """Disagreement of the timing rounds: their medians' stdev over the median."""
        return self.timing.stdev / self.timing.median

    @property
    def quiet(self) -> bool:
        return self.load <= QUIET_LOAD

    def fields(self) -> list[Any]:
        s, t = self.spec, self.timing
        return [str(s), self.layout, self.device, self.source, s.n, s.c, s.h, s.w, s.k, s.kh, s.kw,
                *s.stride, *s.padding, *s.dilation, s.groups, repr(t.median), repr(t.min),
                repr(t.max), repr(t.stdev), t.repeats, t.number,
                f"{s.flops / t.median / 1e9:.4f}" if t.median > 0 else "0", f"{self.load:.3f}",
                self.env_id, f"{self.time:.3f}", repr(t.reference) if t.referenced else "",
                repr(t.ratio) if t.referenced else ""]

    @classmethod
    def from_fields(cls, values: Sequence[str]) -> "Row":
        if len(values) not in (len(COLUMNS), len(UNREFERENCED_COLUMNS)):
            raise ValueError(f"{len(values)} fields, expected {len(COLUMNS)}")
        d = dict(zip(COLUMNS, values))
        i = {name: int(d[name]) for name in SPEC_COLUMNS + ["repeats", "number"]}
        spec = ConvSpec(i["n"], i["c"], i["h"], i["w"], i["k"], i["kh"], i["kw"],
                        (i["stride_h"], i["stride_w"]), (i["pad_h"], i["pad_w"]),
                        (i["dil_h"], i["dil_w"]), i["groups"])
        if str(spec) != d["spec"]:
            raise ValueError(f"spec column {d['spec']!r} disagrees with the shape columns ({spec})")
        reference, ratio = (float(d[k]) if d.get(k) else None for k in ("reference", "ratio"))
        if (reference is None) != (ratio is None) or not all(
                v is None or (math.isfinite(v) and v > 0) for v in (reference, ratio)):
            raise ValueError(f"reference={d.get('reference')!r} and ratio={d.get('ratio')!r} must both "
                             "be positive times, or both empty")
        timing = Timing(float(d["seconds"]), float(d["min"]), float(d["max"]), float(d["stdev"]),
                        i["repeats"], i["number"], reference, ratio)
        if not (math.isfinite(timing.median) and timing.median > 0):
            raise ValueError(f"seconds={d['seconds']!r} is not a positive time")
        return cls(spec, check_layout(d["layout"]), d["device"], d["source"], timing, d["env_id"],
                   float(d["time"]), float(d["load"]))


def _csv_line(values: Sequence[Any]) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(values)
    return buf.getvalue()


class Dataset:
    """A data set file: read it (skipping and reporting corrupt lines) and append rows to it."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.env_path = self.path.with_name(self.path.name + ".env.json")
        self.bad_lines: list[tuple[int, str]] = []  # (line number, reason) found by the last load

    def load(self) -> list[Row]:
        """Every good row; corrupt lines go to `bad_lines` with a warning."""
        self.bad_lines = []
        if not self.path.exists():
            return []
        try:
            text = self.path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise MacoError(f"cannot read data set {str(self.path)!r}: {exc}") from None
        lines = text.splitlines()
        if not lines:
            return []
        header = next(csv.reader([lines[0]]), [])
        if header not in (COLUMNS, UNREFERENCED_COLUMNS):
            raise MacoError(f"{str(self.path)!r} is not a MACO latency data set "
                            f"(header {','.join(header)[:80]!r}, expected {','.join(COLUMNS[:5])},...)")
        rows = []
        for number, line in enumerate(lines[1:], start=2):
            if not line.strip():
                continue
            try:
                rows.append(Row.from_fields(next(csv.reader([line]))))
            except (ValueError, MacoError, StopIteration, csv.Error) as exc:
                self.bad_lines.append((number, str(exc)))
        if self.bad_lines:
            first = self.bad_lines[0]
            warnings.warn(f"{self.path}: skipped {len(self.bad_lines)} corrupt line(s), "
                          f"first at line {first[0]}: {first[1]}", stacklevel=2)
        return rows

    def append(self, rows: Iterable[Row]) -> None:
        """Append whole rows in one write (header first if the file is new)."""
        data = "".join(_csv_line(r.fields()) for r in rows)
        if not data:
            return
        if not self.path.exists() or self.path.stat().st_size == 0:
            write_atomic(self.path, _csv_line(COLUMNS).encode())
        else:
            self._upgrade()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            if _ends_without_newline(self.path):  # a torn last line stays a line of its own
                data = "\n" + data
            os.write(fd, data.encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def _upgrade(self) -> None:
        """A file from before the reference columns gets them (empty in its rows), rewritten whole
        and atomically; every line, corrupt ones too, is kept as it was."""
        with open(self.path, newline="") as fh:
            first = fh.readline()
            if next(csv.reader([first]), []) != UNREFERENCED_COLUMNS:
                return
            rest = fh.read()
        lines = [line + ",," if len(next(csv.reader([line]), [])) == len(UNREFERENCED_COLUMNS) else line
                 for line in rest.split("\n")]
        write_atomic(self.path, (_csv_line(COLUMNS) + "\n".join(lines)).encode())

    def environments(self) -> dict[str, dict[str, Any]]:
        if not self.env_path.exists():
            return {}
        try:
            return json.loads(self.env_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise MacoError(f"cannot read environment file {str(self.env_path)!r}: {exc}") from None

    def record_environment(self, env: dict[str, Any]) -> str:
        """The id of `env`, added to the sidecar JSON if new."""
        env_id = hashlib.sha1(json.dumps(env, sort_keys=True, default=str).encode()).hexdigest()[:10]
        envs = self.environments()
        if env_id not in envs:
            envs[env_id] = env
            write_atomic(self.env_path, json.dumps(envs, indent=1, sort_keys=True, default=str).encode())
        return env_id


def _ends_without_newline(path: Path) -> bool:
    size = path.stat().st_size
    if size == 0:
        return False
    with open(path, "rb") as f:
        f.seek(size - 1)
        return f.read(1) != b"\n"


def best_rows(rows: Iterable[Row]) -> list[Row]:
    """One row per (spec, layout, device): of a key timed more than once (a re-timed row is
    appended, never rewritten), a quiet one before a loaded one, a settled one (canary within
    SETTLED_LOAD) before one in a spell, then the one whose rounds agreed best. Rows timed
    together (one spec's layouts, interleaved in the same rounds) are ranked by their worst
    layout, so every layout of a spec keeps the same measurement: the comparison of its layouts
    is one made in the same rounds."""
    rows = list(rows)
    noise: dict[tuple[Any, ...], dict[str, float]] = {}  # measurement -> layout -> its noise
    for row in rows:
        layouts = noise.setdefault(_measurement(row), {})
        layouts[row.layout] = max(row.noise, layouts.get(row.layout, 0.0))

    def rank(row: Row) -> tuple[bool, bool, float]:
        together = [n for lay, n in noise[_measurement(row)].items() if lay != row.layout]
        return not row.quiet, row.load > SETTLED_LOAD, max([row.noise, *together])

    best: dict[tuple[str, str, str], Row] = {}
    for row in rows:
        old = best.get(row.key)
        if old is None or rank(row) < rank(old):
            best[row.key] = row
    return list(best.values())


def _measurement(row: Row) -> tuple[Any, ...]:
    """What the rows appended together by one measurement share (collect's `keep`)."""
    return str(row.spec), row.device, row.env_id, row.time, row.load


def reference_of(environments: dict[str, dict[str, Any]], row: Row) -> str:
    """What `row`'s ratio is to: REFERENCE, or "fma" in rows collected before it (`environments`:
    its data set's, Dataset.environments(), read once by the caller)."""
    return environments.get(row.env_id, {}).get("reference", "fma")


def cpus_of(path: str | os.PathLike[str], rows: Iterable[Row]) -> list[str]:
    """The CPUs that timed `rows` of the data set at `path` ("unknown" where its environment file
    lacks one): a label, even as a ratio to the FMA loop, is its machine's."""
    envs = Dataset(path).environments()
    return sorted({str(envs.get(r.env_id, {}).get("cpu") or "unknown") for r in rows})


def load_rows(path: str | os.PathLike[str]) -> list[Row]:
    """The good rows of a data set file, one per key (see best_rows); a MacoError if the file
    does not exist."""
    ds = Dataset(path)
    if not ds.path.exists():
        raise MacoError(f"data set {str(path)!r} does not exist; create it with `maco collect`")
    return best_rows(ds.load())


__all__ = ["COLUMNS", "Row", "Dataset", "load_rows", "best_rows", "cpus_of", "REFERENCE", "reference_of"]
