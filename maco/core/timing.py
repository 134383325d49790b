"""The measurement protocol shared by every timer in MACO: warm up, repeat runs that each last
long enough, keep the median and the spread, and record the environment beside the numbers.

The VMs MACO runs on drift 10-20% over minutes and hours, with spells of seconds at half speed,
so a time taken alone is not comparable with one taken in another hour. `time_with_reference`
times a candidate in rounds beside a fixed reference (the tuner uses the FMA loop sized to the
candidate's flops: kernels.cpu_peak.flops_runner), re-measures a round in which the reference
reads slow by more than a margin against the fastest this process has seen, and keeps the
reference's seconds and the median per-round ratio in the Timing. The ratio (candidate over
reference; for the FMA loop, the inverse of the fraction of peak) is what records are ranked by
across spells and days."""
from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from importlib import metadata
from typing import Any, Callable, Iterable, Mapping

from maco.core.target import Target


@dataclass(frozen=True)
class Timing:
    """Seconds per call: median over `repeats` runs of `number` calls each, with the spread."""

    median: float
    min: float
    max: float
    stdev: float
    repeats: int
    number: int
    reference: float | None = None  # median seconds of the reference in the same rounds
    ratio: float | None = None  # median over rounds of (this / the reference) in that round

    @property
    def referenced(self) -> bool:
        return self.reference is not None and self.ratio is not None

    @property
    def spread(self) -> float:
        """(max - min) / median: how far apart the repeats were."""
        return (self.max - self.min) / self.median if self.median > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if not self.referenced:  # plain timings keep their old form (records, data sets)
            del d["reference"], d["ratio"]
        return d

    @classmethod
    def from_samples(cls, samples: list[float], number: int) -> "Timing":
        if not samples:
            raise ValueError("no timing samples")
        return cls(median=statistics.median(samples), min=min(samples), max=max(samples),
                   stdev=statistics.pstdev(samples), repeats=len(samples), number=number)


def time_callable(fn: Callable[[], Any], *, repeats: int = 7, min_run_time: float = 1e-3,
                  warmup: int = 2, sync: Callable[[], Any] | None = None,
                  max_number: int = 10_000, before: Callable[[], Any] | None = None) -> Timing:
    """Time `fn()` by the protocol: `warmup` calls, then `repeats` runs of `number` calls, where
    `number` is chosen so that one run lasts at least `min_run_time` seconds. `sync` (e.g. a
    device synchronise) is called after each run before the clock stops. With `before` (e.g.
    kernels.cache_flush.Flush), each of max(repeats, min_run_time's worth) calls is timed alone,
    `before` called first, off the clock."""
    sync = sync or (lambda: None)
    for _ in range(max(warmup, 1)):
        fn()
    sync()
    if before is not None:
        samples: list[float] = []
        while len(samples) < repeats or sum(samples) < min_run_time:
            before()
            start = time.perf_counter()
            fn()
            sync()
            samples.append(time.perf_counter() - start)
        return Timing.from_samples(samples, 1)
    number = 1
    while True:  # grow `number` until a run is long enough
        start = time.perf_counter()
        for _ in range(number):
            fn()
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= min_run_time or number >= max_number:
            break
        number = min(max_number, max(number * 2, int(number * min_run_time / max(elapsed, 1e-9) * 1.2)))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / number)
    return Timing.from_samples(samples, number)


_STEADY: bool | None = None


def steady_allocator() -> bool:
    """Make glibc malloc serve every block from the heap and keep freed memory (no mmap, no
    trimming), once per process; True where that worked (glibc). Affects the whole process:
    it is what timing functions call, never plain model code.

    Why: by default a block over the mmap threshold (128 KiB rising to at most 32 MiB as big
    blocks are freed) is mmap'ed on every allocation and page-faulted in as it is written, so a
    conv's time depends on its output size against a threshold that depends on what the
    process did before. Measured here: one conv took 2.7 ms in one process and 18 ms in a fresh
    one; a 38 MB-output conv took 24.6 ms mmap'ed and 6.4 ms from the heap. Served from the
    heap, every measurement (data set, re-measurement, plan, end to end) sees the steady state
    of a long-running process that reuses its memory, and repeats."""
    global _STEADY
    if _STEADY is None:
        import ctypes
        import ctypes.util

        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            m_trim_threshold, m_mmap_max = -1, -4
            _STEADY = bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))
        except (OSError, AttributeError):
            _STEADY = False
    return _STEADY


def pool_timings(timings: list[Timing]) -> Timing:
    """One Timing from several rounds: the median of the rounds' medians, the extremes of all
    repeats, the spread of the round medians, and the total repeat count."""
    meds = [t.median for t in timings]
    return Timing(median=float(statistics.median(meds)), min=min(t.min for t in timings),
                  max=max(t.max for t in timings), stdev=float(statistics.pstdev(meds)),
                  repeats=sum(t.repeats for t in timings), number=max(t.number for t in timings))


def interleaved_rounds(runs: Mapping[str, Callable[[], Any]], rounds: int, *, repeats: int = 1,
                       min_run_time: float = 1e-3, warmup: int = 1,
                       sync: Callable[[], Any] | None = None, before: Callable[[], Any] | None = None,
                       progress: Callable[[range], Iterable[int]] = iter) -> dict[str, list[Timing]]:
    """Each of `runs` timed by the protocol once per round, round after round: the machine's
    spells (seconds at half speed on these VMs) then hit every candidate of a round alike, so
    per-round ratios between candidates are steady where each one's times are not. `progress`
    wraps the rounds (e.g. in a tqdm bar)."""
    out: dict[str, list[Timing]] = {label: [] for label in runs}
    for _ in progress(range(max(rounds, 1))):
        for label, fn in runs.items():
            out[label].append(time_callable(fn, repeats=repeats, min_run_time=min_run_time,
                                            warmup=warmup, sync=sync, before=before))
    return out


SLOW_MARGIN = 0.15  # a round whose reference runs this much slower than the best seen is re-measured
SLOW_RETRIES = 2
_BEST_RATE: dict[str, float] = {}  # per reference name: the fastest work per second seen here


def time_with_reference(fn: Callable[[], Any], reference: Callable[[], Any], *, work: float,
                        name: str = "fma", rounds: int = 3, repeats: int = 3,
                        min_run_time: float = 1e-3, warmup: int = 1,
                        sync: Callable[[], Any] | None = None) -> Timing:
    """`fn` timed in `rounds` rounds, each beside `reference` (which does `work` units, e.g.
    flops, so that its rate is comparable between references of different sizes). A round in
    which the reference's rate falls more than SLOW_MARGIN below the best this process has seen
    for `name` is measured again (at most SLOW_RETRIES times). The Timing pools the rounds
    (pool_timings) and carries the reference's median seconds and the median per-round ratio."""
    if not work > 0:
        raise ValueError(f"work must be positive, got {work!r}")
    kept: list[tuple[Timing, Timing]] = []
    for _ in range(max(rounds, 1)):
        for attempt in range(SLOW_RETRIES + 1):
            ref = time_callable(reference, repeats=repeats, min_run_time=min_run_time, warmup=warmup,
                                sync=sync)
            got = time_callable(fn, repeats=repeats, min_run_time=min_run_time, warmup=warmup, sync=sync)
            rate = work / ref.median
            best = max(_BEST_RATE.get(name, 0.0), rate)
            _BEST_RATE[name] = best
            if rate >= best / (1 + SLOW_MARGIN) or attempt == SLOW_RETRIES:
                break
        kept.append((got, ref))
    return pool_referenced([g for g, _ in kept], [r for _, r in kept])


def pool_referenced(rounds: list[Timing], reference: list[Timing]) -> Timing:
    """pool_timings of a candidate's rounds, with the reference's median seconds over the same
    rounds and the median of the per-round ratios (candidate / reference)."""
    pooled = pool_timings(rounds)
    return Timing(pooled.median, pooled.min, pooled.max, pooled.stdev, pooled.repeats, pooled.number,
                  reference=float(statistics.median(r.median for r in reference)),
                  ratio=float(statistics.median(g.median / r.median for g, r in zip(rounds, reference))))


@lru_cache(maxsize=1)
def environment() -> dict[str, Any]:
    """What produced a number: CPU, threads, compiler, library versions (GPU when torch sees one)."""
    env: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine()}
    host = Target.host()
    env.update(cpu=host.model, isa=host.isa, cores=host.cores,
               omp_num_threads=os.environ.get("OMP_NUM_THREADS"))
    try:
        env["gcc"] = subprocess.run(["gcc", "-dumpfullversion"], capture_output=True, text=True,
                                    timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        env["gcc"] = None
    try:
        import torch

        env["torch"] = torch.__version__
        env["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["cudnn"] = torch.backends.cudnn.version()
    except ImportError:
        env["torch"] = None
    try:
        env["maco"] = metadata.version("maco")
    except metadata.PackageNotFoundError:
        env["maco"] = None
    return env
