"""Tuning records: one JSON object per line, appended atomically, so a run can be resumed and
a crash never leaves half a record. A corrupt line is reported and skipped; the rest is kept."""
from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from maco.errors import MacoError
from maco.schedule import Schedule
from maco.spec import ConvSpec
from maco.target import Target
from maco.timing import Timing, environment

FORMAT_VERSION = 1


@dataclass(frozen=True)
class Record:
    """One measured (or failed) schedule of one conv on one target."""

    spec: ConvSpec
    target: dict[str, Any]  # Target.fingerprint()
    schedule: Schedule
    timing: Timing | None = None
    error: str | None = None
    env: dict[str, Any] = field(default_factory=dict, compare=False)
    time: float = field(default_factory=time.time, compare=False)

    @property
    def ok(self) -> bool:
        return self.error is None and self.timing is not None

    @property
    def seconds(self) -> float:
        return self.timing.median if self.ok else float("inf")

    @property
    def gflops(self) -> float:
        return self.spec.flops / self.seconds / 1e9 if self.ok else 0.0

    def to_json(self) -> str:
        return json.dumps({"v": FORMAT_VERSION, "spec": self.spec.to_dict(), "target": self.target,
                           "schedule": self.schedule.to_dict(),
                           "timing": self.timing.to_dict() if self.timing else None,
                           "error": self.error, "env": self.env, "time": self.time},
                          sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> "Record":
        try:
            d = json.loads(line)
            if not isinstance(d, dict) or d.get("v") != FORMAT_VERSION:
                raise MacoError(f"unknown record format version {d.get('v') if isinstance(d, dict) else d!r}")
            return cls(spec=ConvSpec.from_dict(d["spec"]), target=d["target"],
                       schedule=Schedule.from_dict(d["schedule"]),
                       timing=Timing(**d["timing"]) if d.get("timing") else None,
                       error=d.get("error"), env=d.get("env") or {}, time=float(d.get("time", 0.0)))
        except MacoError:
            raise
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise MacoError(f"corrupt record: {exc!r}") from None


def make_record(spec: ConvSpec, target: Target, schedule: Schedule, timing: Timing | None = None,
                error: str | None = None) -> Record:
    return Record(spec, target.fingerprint(), schedule, timing, error, env=environment())


class RecordFile:
    """A JSON-lines file of Records. Each append is a single O_APPEND write of one whole line,
    followed by fsync, so concurrent writers and crashes leave only whole lines."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.bad_lines: list[tuple[int, str]] = []  # (line number, reason) found by the last load

    def append(self, records: Record | Iterable[Record]) -> None:
        batch = [records] if isinstance(records, Record) else list(records)
        if not batch:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = "".join(r.to_json() + "\n" for r in batch).encode()
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size and not self._ends_with_newline(fd):
                data = b"\n" + data  # a torn last line from a crash stays on its own line
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    @staticmethod
    def _ends_with_newline(fd: int) -> bool:
        size = os.fstat(fd).st_size
        return os.pread(fd, 1, size - 1) == b"\n"

    def load(self, warn: bool = True) -> list[Record]:
        """All readable records; unreadable lines go to `bad_lines` and, if `warn`, a warning."""
        self.bad_lines = []
        if not self.path.exists():
            return []
        out = []
        with open(self.path, encoding="utf-8", errors="replace") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    out.append(Record.from_json(line))
                except MacoError as exc:
                    self.bad_lines.append((lineno, str(exc)))
        if warn and self.bad_lines:
            first = self.bad_lines[0]
            warnings.warn(f"{self.path}: skipped {len(self.bad_lines)} corrupt record line(s), "
                          f"first at line {first[0]}: {first[1]}", stacklevel=2)
        return out

    def for_task(self, spec: ConvSpec, target: Target) -> list[Record]:
        fingerprint = target.fingerprint()
        return [r for r in self.load() if r.spec == spec and r.target == fingerprint]

    def best(self, spec: ConvSpec, target: Target, layout: str | None = None) -> Record | None:
        """The fastest successful record of `spec` on `target` (optionally in one layout)."""
        ok = [r for r in self.for_task(spec, target)
              if r.ok and (layout is None or r.schedule.layout == layout)]
        return min(ok, key=lambda r: r.seconds, default=None)
