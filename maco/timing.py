"""The measurement protocol shared by every timer in MACO: warm up, repeat runs that each last
long enough, keep the median and the spread, and record the environment beside the numbers."""
from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any, Callable


@dataclass(frozen=True)
class Timing:
    """Seconds per call: median over `repeats` runs of `number` calls each, with the spread."""

    median: float
    min: float
    max: float
    stdev: float
    repeats: int
    number: int

    @property
    def spread(self) -> float:
        """(max - min) / median: how far apart the repeats were."""
        return (self.max - self.min) / self.median if self.median > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_samples(cls, samples: list[float], number: int) -> "Timing":
        if not samples:
            raise ValueError("no timing samples")
        return cls(median=statistics.median(samples), min=min(samples), max=max(samples),
                   stdev=statistics.pstdev(samples), repeats=len(samples), number=number)


def time_callable(fn: Callable[[], Any], *, repeats: int = 7, min_run_time: float = 1e-3,
                  warmup: int = 2, sync: Callable[[], Any] | None = None,
                  max_number: int = 10_000) -> Timing:
    """Time `fn()` by the protocol: `warmup` calls, then `repeats` runs of `number` calls, where
    `number` is chosen so that one run lasts at least `min_run_time` seconds. `sync` (e.g. a
    device synchronise) is called after each run before the clock stops."""
    sync = sync or (lambda: None)
    for _ in range(max(warmup, 1)):
        fn()
    sync()
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


@lru_cache(maxsize=1)
def environment() -> dict[str, Any]:
    """What produced a number: CPU, threads, compiler, library versions (GPU when torch sees one)."""
    from maco.target import Target

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
    from maco import __version__

    env["maco"] = __version__
    return env
