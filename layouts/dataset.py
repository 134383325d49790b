"""The latency data set behind the layout predictor: random conv configurations plus every layer
of the built-in networks, each timed in each layout, one CSV row per (spec, layout, device).

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
import random
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from maco.core.errors import MacoError
from maco.core.files import write_atomic
from maco.kernels.cpu_peak import fma_reference
from maco.layouts.latency import LAYOUTS, check_device, check_layout, conv_callable, measure_layouts
from maco.layouts.networks import NETWORKS, distinct_convs, network_convs
from maco.core.spec import ConvSpec
from maco.core.target import Target
from maco.core.timing import Timing, environment, time_callable

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


# -- what to measure ------------------------------------------------------------------------------
_COMMON_CHANNELS = [8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512, 576, 768, 960,
                    1024, 2048]
_COMMON_SIZES = [7, 13, 14, 27, 28, 55, 56, 112, 224]


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def _channels(rng: random.Random) -> int:
    return rng.choice(_COMMON_CHANNELS) if rng.random() < 0.65 else _log_uniform(rng, 4, 1024)


def _size(rng: random.Random) -> int:
    return rng.choice(_COMMON_SIZES) if rng.random() < 0.65 else _log_uniform(rng, 4, 230)


def random_spec(rng: random.Random, *, max_flops: float = 2e9, max_bytes: int = 64 << 20,
                batches: Sequence[int] = (1, 2, 4, 8),
                batch_weights: Sequence[float] = (0.8, 0.08, 0.07, 0.05)) -> ConvSpec:
    """One conv drawn from shapes CNNs use: common channel counts and feature-map sizes mixed
    with log-uniform ones, kernels 1..11 (a few rectangular), strides 1/2/4, 'same' or zero
    padding, some dilation, grouped and depthwise convs; at most `max_flops` flops and
    `max_bytes` of input plus output, so that no configuration takes long to time."""
    while True:
        n = rng.choices(list(batches), list(batch_weights))[0]
        kernel = rng.choices([1, 3, 5, 7, 11], [0.35, 0.45, 0.1, 0.07, 0.03])[0]
        kh = kw = kernel
        if rng.random() < 0.05:
            kh, kw = rng.choice([(1, 3), (3, 1), (1, 7), (7, 1)])
        h = _size(rng)
        w = h if rng.random() < 0.85 else _size(rng)
        c = 3 if rng.random() < 0.06 else _channels(rng)
        k = _channels(rng)
        r = rng.random()
        groups = 1
        if r < 0.12 and c > 1:  # depthwise, sometimes with a channel multiplier
            groups, k = c, c * rng.choice([1, 1, 1, 2])
            kh = kw = rng.choice([3, 3, 5, 7])
        elif r < 0.2:
            options = [g for g in (2, 4, 8, 16, 32) if c % g == 0 and g < c]
            if options:
                groups = rng.choice(options)
                k = max(groups, k // groups * groups)
        big = max(kh, kw) >= 7
        stride = rng.choices([1, 2, 4], [0.72, 0.25, 0.03 if big else 0.0])[0]
        dilation = 2 if kh == kw == 3 and rng.random() < 0.08 else 1
        pad_kind = rng.choices(["same", "zero", "other"], [0.7, 0.25, 0.05])[0]
        if pad_kind == "same":
            padding = (dilation * (kh - 1) // 2, dilation * (kw - 1) // 2)
        elif pad_kind == "zero":
            padding = (0, 0)
        else:
            p = rng.randint(0, max(kh, kw) // 2 + 1)
            padding = (p, p)
        try:
            spec = ConvSpec(n, c, h, w, k, kh, kw, stride, padding, dilation, groups)
        except MacoError:
            continue
        if spec.flops <= max_flops and spec.input_bytes + spec.output_bytes <= max_bytes:
            return spec


def random_specs(count: int, seed: int = 0, **kwargs: Any) -> list[ConvSpec]:
    """`count` random specs; the first m of count > m equal the m of a shorter call (same seed),
    so a larger --random extends a data set instead of replacing it."""
    if count < 0:
        raise MacoError(f"the number of random configurations must be >= 0, got {count}")
    rng = random.Random(seed)
    return [random_spec(rng, **kwargs) for _ in range(count)]


def network_specs(names: Sequence[str], batch: int = 1) -> list[tuple[str, ConvSpec]]:
    """(source, spec) for every distinct conv layer of the named built-in networks."""
    out = []
    for name in names:
        if name not in NETWORKS:
            raise MacoError(f"unknown network {name!r}; choose from {', '.join(NETWORKS)}")
        out += [(f"{name}:{layers[0]}", spec) for spec, layers in
                distinct_convs(network_convs(name, batch))]
    return out


QUIET_LOAD = 1.5  # a canary slower than this times its quietest says the cores are busy now
# (1.5, not less: on a shared 2-core VM the canary alone wanders 1.0-1.4 from minute to minute)
SETTLED_LOAD = 1.05  # a label whose canary read at most this repeats (issue 20, AMD EPYC VM: labels
# timed twice in new processes minutes apart agreed within 5% for 95-100% of those at <= 1.05 in
# both runs, 75-82% of all; the FMA reference did not see those spells, the canary did)
SETTLE_PASSES = 2  # a spec timed above SETTLED_LOAD is timed again at the end, up to this often,
# each time once the canary reads settled (or `patience` ran out): spells last seconds to minutes,
# longer than the immediate attempts wait.
CANARY = ConvSpec(1, 32, 28, 28, 32, 3, 3, 1, 1)  # ~15 MFLOP: tens of microseconds when quiet


class Canary:
    """A small fixed conv timed around every measurement. Neighbours on a shared machine are
    invisible to this process, and a busy core does not always make the rounds disagree: a
    contended 2-thread oneDNN call can wait for scheduler ticks on every call alike (a 20 us
    conv measured at a steady 8 or 48 ms). Such a slowdown shows in the canary, which is
    compared with its own quietest time."""

    def __init__(self, device: str = "cpu", calls: int = 5):
        self.run = conv_callable(CANARY, "NHWC", device)
        self.best = math.inf
        for _ in range(calls):
            self.load()

    def load(self) -> float:
        """The canary's time now over its quietest so far (1.0 = as quiet as ever seen)."""
        t = time_callable(self.run, repeats=5, min_run_time=5e-4, warmup=1).median
        self.best = min(self.best, t)
        return t / self.best

    def wait_quiet(self, patience: float = 30.0, limit: float = QUIET_LOAD) -> float:
        """Back off while the canary is slow (at most `patience` seconds); the last load."""
        start, pause = time.perf_counter(), 0.25
        while True:
            load = self.load()
            if load <= limit or time.perf_counter() - start >= patience:
                return load
            time.sleep(pause)
            pause = min(pause * 2, 4.0)


@dataclass
class CollectSummary:
    measured: int  # specs timed now (all their layouts)
    skipped: int  # specs whose layouts were all already present (and quiet enough)
    retimed: int  # of `measured`, specs timed again because their rows were noisy or loaded
    deferred: int  # of `measured`, specs timed again at the end, having been timed in a spell
    unsettled: int  # of `measured`, specs never timed settled (canary within SETTLED_LOAD)
    loaded: int  # of `measured`, specs whose best attempt still ran beside a busy neighbour
    rows: int  # distinct (spec, layout, device) rows in the file afterwards
    bad_lines: int
    seconds: float


def _noise(timings: dict[str, Timing]) -> float:
    return max(t.stdev / t.median for t in timings.values())


def collect(path: str | os.PathLike[str], specs: Sequence[tuple[str, ConvSpec]],
            layouts: Sequence[str] = LAYOUTS, device: str = "cpu", *, rounds: int = 3,
            repeats: int = 3, min_run_time: float = 1e-3, tolerance: float = 0.1,
            attempts: int = 3, retime_noisy: bool = False, threads: int | None = None,
            patience: float = 30.0, progress: bool = True, cluster: str | None = None) -> CollectSummary:
    """Time every (source, spec) in every layout (interleaved, see measure_layouts) and append
    the rows; keys already in the file are skipped, so an interrupted run resumes.

    A spec whose timing rounds disagree by more than `tolerance` (stdev / median of the round
    medians), or beside a busy neighbour (see Canary; collection first backs off up to
    `patience` seconds), is timed again, up to `attempts` times, keeping the best attempt; one timed
    in a spell (canary above SETTLED_LOAD) is timed again at the end of the run once the canary
    settles (SETTLE_PASSES passes; a pass stops where a spell outlasts `patience`). With
    `retime_noisy`, specs whose rows in the file are noisy or loaded are timed again too (new
    rows are appended; load_rows keeps the best). `threads` sets torch's intra-op threads.
    `cluster` (a Ray address) times the specs on that cluster's machines of this one's kind, one
    spec at a time per machine, each row naming its machine's environment."""
    start = time.perf_counter()
    layouts = [check_layout(lay) for lay in layouts]
    dev = str(check_device(device))
    if threads is not None:
        if threads <= 0:
            raise MacoError(f"threads must be positive, got {threads}")
        torch.set_num_threads(threads)
    if cluster is not None:
        from maco.tune.cluster import check_address

        cluster = check_address(cluster)
    ds = Dataset(path)
    have = {row.key: row for row in best_rows(ds.load())}
    todo: list[tuple[str, ConvSpec, list[str]]] = []
    seen: set[ConvSpec] = set()
    retimed = 0
    for source, spec in specs:
        if spec in seen:
            continue
        seen.add(spec)
        old = [have.get((str(spec), lay, dev)) for lay in layouts]
        if any(r is None for r in old):
            todo.append((source, spec, layouts))
        elif retime_noisy and any(r.noise > tolerance or not r.quiet for r in old if r):
            todo.append((source, spec, layouts))
            retimed += 1
    skipped = len(seen) - len(todo)
    from tqdm import tqdm

    params = dict(rounds=rounds, repeats=repeats, min_run_time=min_run_time, tolerance=tolerance,
                  attempts=attempts, patience=patience)
    loads: dict[ConvSpec, float] = {}  # per spec, the lowest canary load it was timed at
    again: set[ConvSpec] = set()  # specs timed again at the end, having been timed in a spell
    bar = tqdm(total=len(todo), desc="collect", unit="conv", disable=not progress)

    def keep(source: str, spec: ConvSpec, lays: list[str], timings: dict[str, Timing], load: float,
             env_id: str) -> None:
        loads[spec] = min(load, loads.get(spec, math.inf))
        now = time.time()
        ds.append(Row(spec, lay, dev, source, timings[lay], env_id, now, load) for lay in lays)
        bar.update()

    with bar:
        if cluster is None:
            env_id = ds.record_environment({**environment(), "torch_threads": torch.get_num_threads(),
                                            "reference": REFERENCE})
            canary = Canary(dev) if todo else None
            for source, spec, lays in todo:
                keep(source, spec, lays, *_time_spec(canary, spec, lays, dev, **params), env_id)
            for _ in range(SETTLE_PASSES):
                pending = [item for item in todo if loads[item[1]] > SETTLED_LOAD]
                bar.total += len(pending)
                for n, (source, spec, lays) in enumerate(pending):  # best_rows keeps the settled row
                    timings, load = _time_spec(canary, spec, lays, dev, settle=True, **dict(params, attempts=1))
                    keep(source, spec, lays, timings, load, env_id)
                    again.add(spec)
                    if load > SETTLED_LOAD:  # the spell outlasted `patience`: on to the next pass
                        bar.update(len(pending) - n - 1)
                        break
        elif todo:
            _collect_on_cluster(cluster, ds, todo, dev, params, keep)
    rows = best_rows(ds.load())
    loaded = sum(load > QUIET_LOAD for load in loads.values())
    unsettled = sum(load > SETTLED_LOAD for load in loads.values())
    return CollectSummary(measured=len(todo), skipped=skipped, retimed=retimed, deferred=len(again),
                          unsettled=unsettled, loaded=loaded, rows=len(rows), bad_lines=len(ds.bad_lines),
                          seconds=time.perf_counter() - start)


def _time_spec(canary: Canary, spec: ConvSpec, lays: list[str], dev: str, *, rounds: int, repeats: int,
               min_run_time: float, tolerance: float, attempts: int, patience: float,
               settle: bool = False) -> tuple[dict[str, Timing], float]:
    """One conv in `lays`, timed up to `attempts` times until settled and agreeing; the best
    attempt's timings and the canary's load around it. Each attempt first backs off while the
    canary reads a busy neighbour (QUIET_LOAD), or with `settle` while it reads a spell."""
    best: tuple[tuple[bool, bool, float], dict[str, Timing], float] | None = None
    for _ in range(max(attempts, 1)):
        before = canary.wait_quiet(patience, SETTLED_LOAD if settle else QUIET_LOAD)
        timings = measure_layouts(spec, lays, dev, rounds=rounds, repeats=repeats,
                                  min_run_time=min_run_time, reference=_reference(spec, dev))
        load = max(before, canary.load())
        score = (load > QUIET_LOAD, load > SETTLED_LOAD, _noise(timings))
        if best is None or score < best[0]:
            best = (score, timings, load)
        if not any(best[0][:2]) and best[0][2] <= tolerance:
            break
    return best[1], best[2]


def _reference(spec: ConvSpec, dev: str) -> Any:
    """On the CPU, REFERENCE (the label that repeats is the conv's seconds over it, maco.core.timing);
    on a GPU, none."""
    if dev.startswith("cuda"):
        return None
    return fma_reference(spec.flops, Target.host(torch.get_num_threads()))


def _collect_on_cluster(address: str, ds: Dataset, todo: list[tuple[str, ConvSpec, list[str]]], dev: str,
                        params: dict[str, Any], keep: Any) -> None:
    """`todo` timed on the cluster's machines of this machine's kind (maco.tune.cluster), rows kept
    as each conv finishes; a conv whose machines all died stays missing (a rerun resumes)."""
    from maco.tune.cluster import Cluster
    from maco.tune.cluster_measure import describe, group_of, label_of

    cuda = dev.startswith("cuda")
    target = Target.h100() if cuda else Target.host(torch.get_num_threads())
    jobs = [(target.cores, dev, spec.to_dict(), lays, params) for _, spec, lays in todo]

    def done(i: int, result: tuple[dict[str, dict[str, Any]], float, dict[str, Any]]) -> None:
        timings, load, env = result
        keep(*todo[i], {lay: Timing(**t) for lay, t in timings.items()}, load, ds.record_environment(env))

    with Cluster(address) as cluster:
        pool = cluster.pool(describe, (target.to_dict(),), group_of(target), label_of(target), per_gpu=cuda)
        try:
            pool.run(_time_on_machine, jobs, lost=lambda reason: None, on_result=done)
        finally:
            pool.close()


def _time_on_machine(state: dict[str, Any], threads: int, dev: str, spec: dict[str, Any], lays: list[str],
                     params: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], float, dict[str, Any]]:
    """Run on a machine's actor (maco.tune.cluster): _time_spec with this machine's canary, and the
    environment its rows name."""
    if "canary" not in state:
        from maco.tune.cluster import local_threads

        state["env"] = {**local_threads(threads), "torch_threads": threads, "reference": REFERENCE}
        state["canary"] = Canary(dev)
    timings, load = _time_spec(state["canary"], ConvSpec.from_dict(spec), lays, dev, **params)
    return {lay: t.to_dict() for lay, t in timings.items()}, load, state["env"]


__all__ = ["COLUMNS", "Row", "Dataset", "load_rows", "best_rows", "random_spec", "random_specs",
           "network_specs", "collect", "CollectSummary", "Canary", "QUIET_LOAD", "REFERENCE", "reference_of"]
