"""Tuning records: one JSON object per line, appended atomically, so a run can be resumed and
a crash never leaves half a record. A corrupt line is reported and skipped; the rest is kept.
Besides kernel records, a file holds baseline lines (Baseline: torch's conv timed by the tuner),
which `load` leaves out and `load_baselines` returns. Runs may share a file: `read_new` reads what
the others appended since, and `Claims` keeps two runs from measuring one schedule at once."""
from __future__ import annotations

import errno
import fcntl
import gzip
import hashlib
import json
import math
import os
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from maco.core.errors import MacoError
from maco.core.files import MAX_LINE_BYTES, _check_regular, load_json, short, write_atomic
from maco.core.schedule import LAYOUTS, Schedule
from maco.core.spec import ConvSpec
from maco.core.target import Target
from maco.core.timing import Timing, environment

TIMING_FIELDS = {"median", "min", "max", "stdev", "repeats", "number"}
REFERENCE_FIELDS = {"reference", "ratio"}  # both or neither: records from before them have neither

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
    transient: bool = False  # the error may not recur (timeout, dead worker): retried once
    history: tuple[dict[str, Any], ...] = field(default=(), compare=False)  # earlier timings (--retime)

    @property
    def retryable(self) -> bool:
        return self.transient and not self.ok

    @property
    def ok(self) -> bool:
        return self.error is None and self.timing is not None

    @property
    def seconds(self) -> float:
        return self.timing.median if self.ok else float("inf")

    @property
    def gflops(self) -> float:
        return self.spec.flops / self.seconds / 1e9 if self.ok else 0.0

    @property
    def referenced(self) -> bool:
        """Timed beside the reference in the same rounds (records from before that are not)."""
        return self.ok and self.timing.referenced

    def to_json(self) -> str:
        d = {"v": FORMAT_VERSION, "spec": self.spec.to_dict(), "target": self.target,
             "schedule": self.schedule.to_dict(), "timing": self.timing.to_dict() if self.timing else None,
             "error": self.error, "env": self.env, "time": self.time}
        if self.transient:
            d["transient"] = True
        if self.history:
            d["history"] = list(self.history)
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> "Record":
        """A record checked as strictly as a schedule: spec, schedule (against the spec), target
        fingerprint and timing; anything else is a MacoError saying what is wrong."""
        return cls.from_dict(_load_line(line))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Record":
        unknown = set(d) - RECORD_FIELDS
        if unknown:
            raise MacoError(f"unknown record field(s) {short(sorted(map(str, unknown)))}")
        if "spec" not in d or "schedule" not in d or "target" not in d:
            raise MacoError("a record needs spec, schedule and target")
        spec = ConvSpec.from_dict(d["spec"])
        schedule = Schedule.from_dict(d["schedule"])
        target = _check_fingerprint(d["target"])
        problems = schedule.problems(spec)
        if schedule.kind != target["kind"]:
            problems.append(f"a {schedule.kind} schedule recorded on a {target['kind']} target")
        if problems:
            raise MacoError(f"schedule does not fit {spec}: " + "; ".join(problems))
        error = d.get("error")
        if error is not None and not isinstance(error, str):
            raise MacoError(f"record error must be text, got {short(error)}")
        timing = _check_timing(d.get("timing")) if d.get("timing") is not None else None
        if timing is None and error is None:
            raise MacoError("a record has a timing or an error")
        env, when = _check_env_time(d)
        history = d.get("history", [])
        if not isinstance(history, list) or len(history) > MAX_HISTORY:
            raise MacoError(f"record history must be a list of at most {MAX_HISTORY} timings, got {short(history)}")
        for old in history:
            if not isinstance(old, dict) or set(old) != {"timing", "time"} or not _finite(old["time"]):
                raise MacoError(f"record history entries are {{timing, time}}, got {short(old)}")
            _check_timing(old["timing"])
        return cls(spec=spec, target=target, schedule=schedule, timing=timing, error=error,
                   env=env, time=float(when), transient=bool(d.get("transient", False)),
                   history=tuple(history))


RECORD_FIELDS = {"v", "spec", "target", "schedule", "timing", "error", "env", "time", "transient", "history"}
MAX_HISTORY = 64
FINGERPRINT_TYPES = {"name": str, "kind": str, "model": str, "isa": str, "cores": int, "levels": list}
BASELINE_FIELDS = {"v", "baseline", "spec", "target", "layout", "timing", "env", "time"}
BASELINE_KINDS = ("torch",)  # whose conv a baseline line times


@dataclass(frozen=True)
class Baseline:
    """torch's own conv of one spec in one layout on one target, timed by the tuner's worker the
    way kernels are (beside the same reference): what `maco optimize` and the torch.compile
    backend plan layouts with, so both plan from the same numbers. A line of its own kind
    ({"baseline": "torch", "layout": ..., no "schedule"}), never a Record, so nothing that ranks
    or learns from schedules sees one."""

    spec: ConvSpec
    target: dict[str, Any]  # Target.fingerprint()
    layout: str
    timing: Timing
    env: dict[str, Any] = field(default_factory=dict, compare=False)
    time: float = field(default_factory=time.time, compare=False)
    kind: str = "torch"

    @property
    def seconds(self) -> float:
        return self.timing.median

    def to_json(self) -> str:
        d = {"v": FORMAT_VERSION, "baseline": self.kind, "spec": self.spec.to_dict(), "target": self.target,
             "layout": self.layout, "timing": self.timing.to_dict(), "env": self.env, "time": self.time}
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> "Baseline":
        return cls.from_dict(_load_line(line))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Baseline":
        """Checked as strictly as a record: known fields only, a valid spec and fingerprint, a
        layout torch runs, a timing that can be true; anything else is a MacoError."""
        unknown = set(d) - BASELINE_FIELDS
        if unknown:
            raise MacoError(f"unknown baseline field(s) {short(sorted(map(str, unknown)))}")
        missing = BASELINE_FIELDS - {"env", "time"} - set(d)
        if missing:
            raise MacoError(f"a baseline needs {', '.join(sorted(missing))}")
        if d["baseline"] not in BASELINE_KINDS:
            raise MacoError(f"baseline must be one of {BASELINE_KINDS}, got {short(d['baseline'])}")
        if d["layout"] not in LAYOUTS:
            raise MacoError(f"baseline layout must be one of {LAYOUTS}, got {short(d['layout'])}")
        spec = ConvSpec.from_dict(d["spec"])
        target = _check_fingerprint(d["target"])
        timing = _check_timing(d["timing"])
        env, when = _check_env_time(d)
        return cls(spec, target, d["layout"], timing, env, float(when), d["baseline"])


Entry = Record | Baseline


def parse_line(line: str) -> Entry:
    """One line of a records file: a Baseline if it says so ("baseline" key), else a Record."""
    d = _load_line(line)
    return Baseline.from_dict(d) if "baseline" in d else Record.from_dict(d)


def _load_line(line: str) -> dict[str, Any]:
    d = load_json(line, "record line", MAX_LINE_BYTES)
    if not isinstance(d, dict) or d.get("v") != FORMAT_VERSION:
        raise MacoError(f"unknown record format version {short(d.get('v') if isinstance(d, dict) else d)}")
    return d


def _check_env_time(d: dict[str, Any]) -> tuple[dict[str, Any], float]:
    env, when = d.get("env") or {}, d.get("time", 0.0)
    if not isinstance(env, dict):
        raise MacoError(f"record env must be an object, got {short(env)}")
    if not _finite(when):
        raise MacoError(f"record time must be a number, got {short(when)}")
    return env, when


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_fingerprint(fp: Any) -> dict[str, Any]:
    """A Target.fingerprint() as written: known keys of the right types, levels [name, bytes, n]."""
    if not isinstance(fp, dict) or set(fp) != set(FINGERPRINT_TYPES):
        raise MacoError(f"record target must be a fingerprint with keys {sorted(FINGERPRINT_TYPES)}, "
                        f"got {short(fp)}")
    for key, kind in FINGERPRINT_TYPES.items():
        if not isinstance(fp[key], kind) or isinstance(fp[key], bool):
            raise MacoError(f"record target {key} must be a {kind.__name__}, got {short(fp[key])}")
    if fp["kind"] not in ("cpu", "cuda"):
        raise MacoError(f"record target kind must be cpu or cuda, got {short(fp['kind'])}")
    for level in fp["levels"]:
        if not (isinstance(level, list) and len(level) == 3 and isinstance(level[0], str)
                and all(isinstance(v, int) and not isinstance(v, bool) for v in level[1:])):
            raise MacoError(f"record target level must be [name, bytes, processors], got {short(level)}")
    return fp


def _check_timing(d: Any) -> Timing:
    """Seconds that can be true: positive, finite, min <= median <= max, counts >= 1."""
    if not isinstance(d, dict) or set(d) not in (TIMING_FIELDS, TIMING_FIELDS | REFERENCE_FIELDS):
        raise MacoError(f"record timing must have the fields {sorted(TIMING_FIELDS)} (and both of "
                        f"{sorted(REFERENCE_FIELDS)} or neither), got {short(d)}")
    for key in REFERENCE_FIELDS & set(d):
        if not _finite(d[key]) or d[key] <= 0:
            raise MacoError(f"record timing {key} must be a positive number, got {short(d[key])}")
    for key in ("median", "min", "max", "stdev"):
        if not _finite(d[key]) or d[key] < 0 or (key != "stdev" and d[key] <= 0):
            raise MacoError(f"record timing {key} must be a positive number of seconds, got {short(d[key])}")
    for key in ("repeats", "number"):
        if not isinstance(d[key], int) or isinstance(d[key], bool) or d[key] < 1:
            raise MacoError(f"record timing {key} must be a positive int, got {short(d[key])}")
    if not d["min"] <= d["median"] <= d["max"]:
        raise MacoError(f"record timing needs min <= median <= max, got {d['min']}, {d['median']}, {d['max']}")
    return Timing(**d)


class TransientError(str):
    """A measurement error whose cause may not recur (a timeout, a worker killed by a signal):
    the schedule is retried once in a later round instead of failing for good."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a batch of measurements; `results` holds, per schedule of the batch, its
    finished result or None, so that the caller records what was measured before it stops."""

    def __init__(self, results: list):
        super().__init__()
        self.results = results


def make_record(spec: ConvSpec, target: Target, schedule: Schedule, timing: Timing | None = None,
                error: str | None = None, env: dict[str, Any] | None = None) -> Record:
    """A record of this process's measurement, or of another machine's when `env` (its
    environment) is given (a cluster node)."""
    return Record(spec, target.fingerprint(), schedule, timing, error,
                  env=environment() if env is None else env, transient=isinstance(error, TransientError))


def make_baseline(spec: ConvSpec, target: Target, layout: str, timing: Timing,
                  env: dict[str, Any] | None = None) -> Baseline:
    """A baseline of torch's conv timed by this process's worker (or another machine's: `env`)."""
    return Baseline(spec, target.fingerprint(), layout, timing, environment() if env is None else env)


def _write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is written; a write that makes no progress (a full disk that
    reports a short write instead of ENOSPC) is an OSError."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]


def _whole_lines(fh: Any, offset: int, limit: int) -> Iterator[tuple[int, int, bytes | None]]:
    """(start, end, line) of each whole line of a binary file from `offset` (at most `limit`
    bytes in memory per line; None for a longer one); stops before a line with no newline yet."""
    while True:
        line = fh.readline(limit + 1)
        start, end, long = offset, offset + len(line), False
        while line and not line.endswith(b"\n") and len(line) > limit:
            long = True
            line = fh.readline(limit + 1)
            end += len(line)
        if not line.endswith(b"\n"):
            return
        yield start, end, None if long else line
        offset = end


def _capped_lines(fh: Any, limit: int) -> Iterator[bytes | None]:
    """The lines of a binary file, each read with at most `limit` bytes in memory; None stands
    for a longer line (its rest is skipped), so one huge line cannot exhaust memory."""
    while True:
        line = fh.readline(limit + 1)
        if not line:
            return
        if len(line) > limit and not line.endswith(b"\n"):
            while line and not line.endswith(b"\n"):
                line = fh.readline(limit + 1)
            yield None
        else:
            yield line


class RecordFile:
    """A JSON-lines file of Records. Each append is a single O_APPEND write of one whole line,
    followed by fsync, so concurrent writers and crashes leave only whole lines; an append that
    cannot be written whole (a full disk) is cut off again and is a MacoError."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.bad_lines: list[tuple[int, str]] = []  # (line number, reason) found by the last load
        self._mine: list[tuple[int, int]] = []  # byte ranges this object appended (read_new skips them)
        self._follow: tuple[int, int, int] | None = None  # read_new's (inode, offset, lines) so far

    def following(self) -> "RecordFile":
        """Another handle on this file that has read what this one has: its `read_new` returns only
        what was appended since (a tuner resumes from its caller's read instead of reading again),
        this handle's own appends included."""
        other = RecordFile(self.path)
        other._follow = self._follow
        return other

    def append(self, records: Entry | Iterable[Entry]) -> None:
        batch = [records] if isinstance(records, (Record, Baseline)) else list(records)
        if not batch:
            return
        data = "".join(r.to_json() + "\n" for r in batch).encode()
        fd = self._open_locked()
        try:
            size = os.fstat(fd).st_size
            if size and not self._ends_with_newline(fd):
                data = b"\n" + data  # a torn last line from a crash stays on its own line
            try:
                _write_all(fd, data)
                os.fsync(fd)
            except OSError as exc:
                self._roll_back(fd, size)
                raise MacoError(f"cannot append to records file {str(self.path)!r}: "
                                f"{exc.strerror or exc}; its {size} bytes before are kept, "
                                f"the {len(batch)} new record(s) are not saved") from None
            self._mine.append((size, size + len(data)))
        finally:
            os.close(fd)

    @staticmethod
    def _roll_back(fd: int, size: int) -> None:
        """Cut a partly written append off again (the lock is still held), so the file ends
        where it ended before: never a torn line where the disk filled up."""
        try:
            os.ftruncate(fd, size)
            os.fsync(fd)
        except OSError:
            pass  # a torn line then, which load() reports and skips

    def _open_locked(self) -> int:
        """The file, opened for appending and locked (flock): an in-place rewrite (`replace`)
        holds the same lock while it swaps in the new file, so a writer that waited on the old
        one opens the new one instead of appending to a file no longer there."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            while True:
                fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
                fcntl.flock(fd, fcntl.LOCK_EX)
                try:
                    if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                        return fd
                except FileNotFoundError:
                    pass
                os.close(fd)
        except OSError as exc:
            raise MacoError(f"cannot write records file {str(self.path)!r}: {exc.strerror or exc}") from None

    def replace(self, updates: dict[int, Record]) -> None:
        """Rewrite the file whole and atomically with the records at the given line numbers (as
        `load_numbered` counts them) replaced; every other line, bad ones too, stays as it was."""
        fd = self._open_locked()
        try:
            with open(self.path, "rb") as fh:
                lines = fh.read().split(b"\n")
            for lineno, record in updates.items():
                if not 1 <= lineno <= len(lines):
                    raise MacoError(f"records file {str(self.path)!r} has no line {lineno}")
                lines[lineno - 1] = record.to_json().encode()
            try:
                write_atomic(self.path, b"\n".join(lines))
            except OSError as exc:  # the old file stays whole: write_atomic swaps only a whole new one
                raise MacoError(f"cannot rewrite records file {str(self.path)!r}: {exc.strerror or exc}; "
                                "it is kept as it was") from None
        finally:
            os.close(fd)

    @staticmethod
    def _ends_with_newline(fd: int) -> bool:
        size = os.fstat(fd).st_size
        return os.pread(fd, 1, size - 1) == b"\n"

    def load(self, warn: bool = True) -> list[Record]:
        """All valid records; a line that is unreadable, or a record that fails its checks, goes to
        `bad_lines` with its line number and, if `warn`, a warning. Loading never rewrites the file."""
        return [r for _, r in self.load_numbered(warn)]

    def load_numbered(self, warn: bool = True) -> list[tuple[int, Record]]:
        """load, with each record's line number (baseline lines are counted, not returned)."""
        return [(n, e) for n, e in self.load_entries(warn) if isinstance(e, Record)]

    def load_baselines(self, warn: bool = True) -> list[Baseline]:
        """The valid baseline lines (torch's conv timed by the tuner); bad lines as in `load`."""
        return [e for _, e in self.load_entries(warn) if isinstance(e, Baseline)]

    def load_entries(self, warn: bool = True) -> list[tuple[int, Entry]]:
        """Every valid line, record or baseline, with its line number; bad lines as in `load`.
        A later `read_new` returns only what was appended after this read."""
        self.bad_lines = []
        if self.path.is_dir():
            raise MacoError(f"records file {str(self.path)!r} is a directory; give a .jsonl file")
        out, lineno = [], 0
        try:
            with self._open_regular() as raw, (gzip.open(raw) if self.path.suffix == ".gz" else raw) as fh:
                fcntl.flock(raw.fileno(), fcntl.LOCK_SH)  # no append in flight: read_new goes on from the end
                for lineno, line in enumerate(_capped_lines(fh, MAX_LINE_BYTES), 1):
                    if line is None:
                        self.bad_lines.append((lineno, f"line longer than {MAX_LINE_BYTES} bytes"))
                        continue
                    if not line.strip():
                        continue
                    try:
                        out.append((lineno, parse_line(line.decode("utf-8", errors="replace"))))
                    except MacoError as exc:
                        self.bad_lines.append((lineno, str(exc)))
                self._follow_from(raw, lineno)
        except FileNotFoundError:
            return []
        except (OSError, EOFError) as exc:  # EOFError: a cut .gz
            raise MacoError(f"cannot read records file {str(self.path)!r}: {getattr(exc, 'strerror', None) or exc}"
                            ) from None
        if warn and self.bad_lines:
            first = self.bad_lines[0]
            warnings.warn(f"{self.path}: skipped {len(self.bad_lines)} bad record line(s), "
                          f"first at line {first[0]}: {first[1]}", stacklevel=2)
        return out

    def _open_regular(self) -> Any:
        """The file opened for reading, if it is a regular file: a FIFO would block the read and
        a link to /dev/zero never end it, so either is one MacoError line (as core.files.read_bytes)."""
        _check_regular(os.stat(self.path).st_mode, self.path, "records file")  # a device is never opened
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            _check_regular(os.fstat(fd).st_mode, self.path, "records file")  # what was opened
        except MacoError:
            os.close(fd)
            raise
        return os.fdopen(fd, "rb")

    def _follow_from(self, raw: Any, lines: int) -> None:
        """Where `read_new` goes on after a whole read: the end read so far (a gzipped file is
        never read again). A last line without its newline counts as the line an append's
        leading newline ends."""
        if self.path.suffix == ".gz":
            self._follow = (0, 0, 0)
            return
        end = raw.tell()
        ended = end == 0 or os.pread(raw.fileno(), 1, end - 1) == b"\n"
        self._follow, self._mine = (os.fstat(raw.fileno()).st_ino, end, lines - (not ended)), []

    def read_new(self, warn: bool = True) -> tuple[list[Entry], bool]:
        """What this object has not read of the file yet, and whether it is the whole file. The
        first call (or one after the file was rewritten or cut: `replace`) reads every valid
        line: (entries, True), unless `load_entries` read it already. Later calls read only the
        tail appended since, skipping what this object appended itself: (entries, False); a line
        still being written waits for the next call. So a long run sees what other runs on the same file have measured meanwhile.
        Bad lines as in `load` (a gzipped file is read whole once, then never again)."""
        if self.path.suffix == ".gz":
            if self._follow is not None:
                return [], False
            self._follow = (0, 0, 0)
            return self.load_entries(warn), True
        try:
            fh = self._open_regular()
        except FileNotFoundError:
            self._follow, self._mine = None, []
            return [], True
        except OSError as exc:
            raise MacoError(f"cannot read records file {str(self.path)!r}: {exc.strerror or exc}") from None
        with fh:
            fcntl.flock(fh.fileno(), fcntl.LOCK_SH)  # no append in flight (it may yet be rolled back)
            st = os.fstat(fh.fileno())
            inode, offset, lineno = self._follow or (None, 0, 0)
            whole = inode != st.st_ino or st.st_size < offset
            if whole:
                offset, lineno, self._mine = 0, 0, []
                self.bad_lines = []
            fh.seek(offset)
            out, bad = [], []
            for start, end, line in _whole_lines(fh, offset, MAX_LINE_BYTES):
                lineno += 1
                offset = end
                if any(a <= start < b for a, b in self._mine):
                    continue  # this object's own append
                if line is None:
                    bad.append((lineno, f"line longer than {MAX_LINE_BYTES} bytes"))
                    continue
                if not line.strip():
                    continue
                try:
                    out.append(parse_line(line.decode("utf-8", errors="replace")))
                except MacoError as exc:
                    bad.append((lineno, str(exc)))
            self._follow = (st.st_ino, offset, lineno)
        self._mine = [(a, b) for a, b in self._mine if b > offset]
        self.bad_lines += bad
        if warn and bad:
            warnings.warn(f"{self.path}: skipped {len(bad)} bad record line(s), first at line {bad[0][0]}: "
                          f"{bad[0][1]}", stacklevel=2)
        return out, whole

    def claims(self) -> "Claims":
        """Claims on the schedules this run is about to measure, seen by other runs on this file."""
        return Claims(self.path)

    def for_task(self, spec: ConvSpec, target: Target) -> list[Record]:
        fingerprint = target.fingerprint()
        return [r for r in self.load() if r.spec == spec and r.target == fingerprint]

    def best(self, spec: ConvSpec, target: Target, layout: str | None = None) -> Record | None:
        """The fastest successful record of `spec` on `target` (optionally in one layout)."""
        mine = [r for r in self.for_task(spec, target) if r.ok and layout in (None, r.schedule.layout)]
        return min(zip(normalized(mine), mine), key=lambda x: x[0], default=(0, None))[1]


class Claims:
    """The schedules a run is measuring right now, announced to every other run on the same
    records file, so that two runs never time one schedule twice: a claim is a lock (lockf) on
    one byte of a lock file beside the records (".NAME.lock"), at an offset that hashes the
    schedule with its conv and target. Another run's claim fails; a run that dies drops its
    claims with it. Release a claim only after its record is appended: a run that takes it then
    re-reads the records (RecordFile.read_new) and finds the schedule measured. Without a
    writable lock file nothing is claimed and every `take` succeeds."""

    def __init__(self, records: Path):
        self.path = records.with_name(f".{records.name}.lock")
        self._fd: int | None = None
        self._held: set[int] = set()

    def _key(self, spec: ConvSpec, target: Target, schedule: Schedule) -> int:
        text = json.dumps([spec.to_dict(), target.fingerprint(), schedule.to_dict()], sort_keys=True)
        return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)  # < 2**60: a valid offset

    def take(self, spec: ConvSpec, target: Target, schedule: Schedule) -> bool:
        """Claim `schedule`; False when another run holds its claim."""
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError:
                self._fd = -1
        key = self._key(spec, target, schedule)
        if self._fd < 0 or key in self._held:
            return True
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, key)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EAGAIN):
                return False
            return True  # locks unsupported here (some network file systems): claim nothing
        self._held.add(key)
        return True

    def release(self, spec: ConvSpec, target: Target, schedule: Schedule) -> None:
        key = self._key(spec, target, schedule)
        if key in self._held:
            self._held.discard(key)
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, key)

    def close(self) -> None:
        """Release every claim (closing the file drops this process's locks on it)."""
        if self._fd is not None and self._fd >= 0:
            os.close(self._fd)
        self._fd, self._held = None, set()

    def __enter__(self) -> "Claims":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def normalized(records: Sequence[Record]) -> list[float]:
    """What to rank successful records by, lower is faster, comparable across spells and days: a
    record's ratio to the reference timed in the same rounds; a record from before the reference
    (or whose spec has no referenced record to compare with) its seconds over the median reference
    seconds of its spec's referenced records, or its plain seconds where none of its spec has one.
    Within one spec, every value is then on one scale."""
    refs: dict[ConvSpec, list[float]] = {}
    for r in records:
        if r.referenced:
            refs.setdefault(r.spec, []).append(r.timing.reference)
    scale = {spec: statistics.median(v) for spec, v in refs.items()}
    return [r.timing.ratio if r.referenced else r.seconds / scale.get(r.spec, 1.0) if r.ok else math.inf
            for r in records]


def best_per_layout(records: Iterable[Record], target: Target) -> dict[tuple[ConvSpec, str], Record]:
    """The fastest successful record per (spec, layout) measured on `target` (ranked by
    `normalized`): records of another machine say nothing of this one's kernels."""
    fingerprint = target.fingerprint()
    mine = [r for r in records if r.ok and r.target == fingerprint]
    best: dict[tuple[ConvSpec, str], tuple[float, Record]] = {}
    for rank, r in zip(normalized(mine), mine):
        key = (r.spec, r.schedule.layout)
        if key not in best or rank < best[key][0]:
            best[key] = (rank, r)
    return {key: r for key, (_, r) in best.items()}


def best_in_files(paths: Iterable[str | os.PathLike[str]], target: Target) -> dict[tuple[ConvSpec, str], Record]:
    """best_per_layout over the records of every file in `paths`."""
    return RecordStore(paths, target).best


def latest_baselines(baselines: Iterable[Baseline], target: Target) -> dict[tuple[ConvSpec, str], Baseline]:
    """Per (spec, layout): the newest baseline measured on `target` with the torch running here
    (another torch version's conv says little of this one's). Newest, so a re-measurement
    replaces an old one; one rule, so every reader of the same files picks the same numbers."""
    fingerprint, version = target.fingerprint(), environment().get("torch")
    latest: dict[tuple[ConvSpec, str], Baseline] = {}
    for b in baselines:
        key = (b.spec, b.layout)
        if b.target == fingerprint and b.env.get("torch") == version and (
                key not in latest or b.time >= latest[key].time):
            latest[key] = b
    return latest


def baselines_in_files(paths: Iterable[str | os.PathLike[str]], target: Target) -> dict[tuple[ConvSpec, str], Baseline]:
    """latest_baselines over the baselines of every file in `paths`."""
    return RecordStore(paths, target).baselines


class RecordStore:
    """The records files one run plans from, each read and checked once (bad lines reported as
    `RecordFile.load` does), indexed for `target`: `best` (best_per_layout) and `baselines`
    (latest_baselines) over all files. `refresh` reads only what was appended since, so a run
    that tunes into the files reads them once, plus their new tails."""

    def __init__(self, paths: Iterable[str | os.PathLike[str]], target: Target):
        self.target = target
        self.files = [RecordFile(path) for path in paths]
        self._entries = {file.path: [e for _, e in file.load_entries()] for file in self.files}
        self._index()

    def refresh(self) -> None:
        """Take in what was appended to the files since they were read (all of a rewritten one)."""
        for file in self.files:
            new, whole = file.read_new()
            self._entries[file.path] = new if whole else self._entries[file.path] + new
        self._index()

    def resume(self, path: str | os.PathLike[str]) -> tuple[RecordFile, list[Entry]]:
        """One of the files for a run that appends to it: the entries read so far, and a handle
        that goes on from there (RecordFile.following), so the file is not read again."""
        file = self._file(path)
        return file.following(), list(self._entries[file.path])

    def _file(self, path: str | os.PathLike[str]) -> RecordFile:
        for file in self.files:
            if file.path == Path(path):
                return file
        raise MacoError(f"records file {str(path)!r} is not one of the store's {[str(f.path) for f in self.files]}")

    def baselines_in(self, path: str | os.PathLike[str]) -> dict[tuple[ConvSpec, str], Baseline]:
        """latest_baselines of one of the files."""
        return latest_baselines(_baselines(self._entries[Path(path)]), self.target)

    def _index(self) -> None:
        entries = [e for file in self.files for e in self._entries[file.path]]
        self.best = best_per_layout([e for e in entries if isinstance(e, Record)], self.target)
        self.baselines = latest_baselines(_baselines(entries), self.target)


def _baselines(entries: Iterable[Entry]) -> list[Baseline]:
    return [e for e in entries if isinstance(e, Baseline)]
