"""Measuring schedules for the tuner: kernels run in a worker process, so that a crash, a hang or
a wrong result becomes a recorded error and never a dead tuner.

The parent builds a batch of kernels first (gcc processes in parallel, cached on disk), then
hands them to the worker one at a time; the worker loads each from the cache, checks it against
torch's conv2d on the same data and times it by the protocol in maco.core.timing: on the CPU in rounds
beside the FMA loop doing the same flops (time_with_reference: the record keeps its ratio to it,
which repeats across spells), on a GPU with CUDA events (maco.tune.gpu_measure). torch baselines are
timed by the same worker, the same way, beside the kernels.
"""
from __future__ import annotations

import multiprocessing as mp
import traceback
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol, Sequence

from maco import kernels
from maco.core.errors import MacoError
from maco.kernels.baselines import torch_conv
from maco.kernels.cpu_build import NoSpaceError
from maco.tune.records import TransientError
from maco.core.schedule import Schedule
from maco.core.spec import ConvSpec
from maco.core.target import Target
from maco.kernels.cpu_peak import fma_reference
from maco.core.timing import Timing, steady_allocator, time_with_reference

CHECK_RTOL = 1e-3  # max |y - ref| over max |ref|: fp32 sums of up to ~10^4 terms in another order


@dataclass
class MeasureConfig:
    repeats: int = 2  # per round on the CPU (beside the reference); in all on a GPU: x rounds
    rounds: int = 3
    min_run_time: float = 2e-3  # seconds per repeat (CPU); the GPU timer grows runs itself
    warmup: int = 2
    timeout: float = 120.0  # seconds one job may take in the worker (data set-up included)
    build_timeout: float = 30.0  # seconds gcc may take on one variant (typical: 0.15-1 s)
    check: bool = True  # compare every kernel's output with torch before timing it

    def __post_init__(self) -> None:
        for name in ("min_run_time", "timeout", "build_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise MacoError(f"MeasureConfig.{name} must be a positive number of seconds, got {value!r}")
        if self.repeats < 1 or self.rounds < 1 or self.warmup < 0:
            raise MacoError(f"MeasureConfig needs repeats >= 1, rounds >= 1 and warmup >= 0, "
                            f"got {self.repeats}, {self.rounds} and {self.warmup}")


class Runner(Protocol):
    """What the tuner times schedules and torch's conv with: this machine's worker (Measurer) or a
    Ray cluster's machines (maco.tune.cluster_measure.ClusterMeasurer). Results are (timing, error)
    pairs, or (timing, error, env) where another machine measured (env: its environment)."""

    target: Target
    config: MeasureConfig

    def __call__(self, spec: ConvSpec, schedules: Sequence[Schedule],
                 target: Target | None = None) -> Sequence[tuple[Any, ...]]: ...

    def baseline(self, spec: ConvSpec, layout: str = "NCHW") -> tuple[Any, ...]: ...

    def close(self) -> None: ...

    def __enter__(self) -> "Runner": ...

    def __exit__(self, *exc: Any) -> None: ...


class Measurer:
    """The Runner on this machine: `(spec, schedules, target) -> [(Timing|None, error|None)]`.
    Use as a context manager (or call close()) to stop the worker."""

    def __init__(self, target: Target, config: MeasureConfig | None = None):
        if target.kind == "cuda":
            from maco.kernels.cuda import require_gpu

            require_gpu(f"measuring on {target.name!r}")
        self.target = target
        self.config = config or MeasureConfig()
        self._ctx = mp.get_context("spawn")  # no fork: torch and OpenMP threads do not survive it
        self._proc: Any = None
        self._conn: Any = None

    # -- worker lifecycle ------------------------------------------------------------------
    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker_main, args=(child, self.target.to_dict()),
                                 daemon=True, name="maco-measure")
        proc.start()  # may raise (e.g. a script without a __main__ guard): nothing to close then
        child.close()
        self._proc, self._conn = proc, parent

    def close(self) -> None:
        if self._proc is not None:
            try:
                self._conn.send(None)
                self._proc.join(5)
            except (OSError, EOFError, BrokenPipeError):
                pass
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._proc = self._conn = None

    def __enter__(self) -> "Measurer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _ask(self, job: dict[str, Any]) -> tuple[Any, str | None]:
        """Run one job in the worker; a timeout or a dead worker becomes an error string."""
        if self._proc is None or not self._proc.is_alive():
            self._start()
        try:
            self._conn.send(job)
            if self._conn.poll(self.config.timeout):
                return self._conn.recv()
            reason = f"timed out after {self.config.timeout:g} s"
        except (EOFError, OSError, BrokenPipeError):
            reason = None
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join()
        code = self._proc.exitcode
        self._proc = self._conn = None
        return None, TransientError(reason or f"worker died (exit code {code})")

    # -- public ----------------------------------------------------------------------------
    def __call__(self, spec: ConvSpec, schedules: Sequence[Schedule],
                 target: Target | None = None) -> list[tuple[Timing | None, str | None]]:
        target = target or self.target
        if target.fingerprint() != self.target.fingerprint():
            raise MacoError(f"this measurer times on {self.target.name!r}, not {target.name!r}")
        built = _prebuild(spec, schedules, target, self.config.build_timeout)
        out: list[tuple[Timing | None, str | None]] = []
        for schedule, build_error in zip(schedules, built):
            if build_error:
                out.append((None, build_error))
                continue
            result, error = self._ask({"op": "kernel", "spec": spec.to_dict(),
                                       "schedule": schedule.to_dict(), **self._protocol()})
            out.append((Timing(**result) if result else None, error))
        return out

    def baseline(self, spec: ConvSpec, layout: str = "NCHW") -> tuple[Timing | None, str | None]:
        """torch's conv2d (oneDNN on CPU, cuDNN with its best algorithm on GPU, strict fp32)."""
        result, error = self._ask({"op": "torch", "spec": spec.to_dict(), "layout": layout,
                                   **self._protocol()})
        return (Timing(**result) if result else None), error

    def _protocol(self) -> dict[str, Any]:
        c = self.config
        return dict(repeats=c.repeats, rounds=c.rounds, min_run_time=c.min_run_time, warmup=c.warmup,
                    check=c.check)


def _prebuild(spec: ConvSpec, schedules: Sequence[Schedule], target: Target,
              timeout: float) -> list[str | None]:
    """Compile a batch in parallel into the kernel cache; per schedule, its build error or None.
    A build that failed for lack of disk space is no fact about its schedule: it stops the batch
    (cpu_build.NoSpaceError, one line naming the folder), and no schedule is recorded as failed."""
    if target.kind != "cpu":
        return [None] * len(schedules)  # CUDA kernels are compiled by the worker (NVRTC, cached)
    built = kernels.build_many(spec, list(schedules), target, timeout=timeout)
    full = next((k for k in built if isinstance(k, NoSpaceError)), None)
    if full is not None:
        raise full
    return [str(k) if isinstance(k, Exception) else None for k in built]


# -- the worker ------------------------------------------------------------------------------
def _worker_main(conn: Any, target_dict: dict[str, Any]) -> None:
    steady_allocator()  # torch's outputs come from the heap, as in a long-running model (no mmap faults)
    target = Target.from_dict(target_dict)
    data: dict[tuple[ConvSpec, str], Any] = {}
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        try:
            conn.send((_run_job(job, target, data), None))
        except Exception as exc:  # noqa: BLE001 - every failure of a candidate is a record
            msg = str(exc) if isinstance(exc, MacoError) else \
                f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
            conn.send((None, msg.strip()))


def _conv_data(spec: ConvSpec, device: str, cache: dict[tuple[ConvSpec, str], Any]) -> Any:
    """Fixed random input and weight for a spec, and torch's output as the reference."""
    import torch

    key = (spec, device)
    if key not in cache:
        cache.clear()  # one spec at a time: big layers must not pile up
        g = torch.Generator().manual_seed(0)
        x = torch.randn(spec.n, spec.c, spec.h, spec.w, generator=g).to(device)
        w = torch.randn(spec.k, spec.c_per_group, spec.kh, spec.kw, generator=g).to(device)
        with torch.no_grad():
            ref = torch.nn.functional.conv2d(x, w, None, spec.stride, spec.padding, spec.dilation,
                                             spec.groups)
        cache[key] = (x, w, ref)
    return cache[key]


@lru_cache(maxsize=1)
def _gpu_timer() -> Any:
    from maco.tune.gpu_measure import GpuTimer

    return GpuTimer()


def _run_job(job: dict[str, Any], target: Target, cache: dict) -> dict[str, Any]:
    import torch

    spec = ConvSpec.from_dict(job["spec"])
    cuda = target.kind == "cuda"
    if cuda:
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    else:
        torch.set_num_threads(target.cores)
    x, w, ref = _conv_data(spec, "cuda" if cuda else "cpu", cache)
    if job["op"] == "torch":
        if cuda:
            from maco.tune.gpu_measure import CudnnConv

            fmt = torch.channels_last if job["layout"] == "NHWC" else torch.contiguous_format
            xl, wl = x.contiguous(memory_format=fmt), w.contiguous(memory_format=fmt)
            fn = CudnnConv(spec, job["layout"], benchmark=True).prepare(xl, wl)
        else:
            fn = torch_conv(spec, x, w, job["layout"])
    else:
        schedule = Schedule.from_dict(job["schedule"])
        conv = kernels.compile(spec, schedule, target=target).bind(w)
        xl = x.contiguous(memory_format=torch.channels_last) if schedule.layout == "NHWC" else x
        out = torch.empty_like(ref, memory_format=torch.channels_last if schedule.layout == "NHWC"
                               else torch.contiguous_format)
        fn = conv.prepare(xl, None, out)
        if job["check"]:
            fn()
            if cuda:
                torch.cuda.synchronize()
            err = float((out - ref).abs().max()) / max(float(ref.abs().max()), 1e-30)
            if not err <= CHECK_RTOL:
                raise MacoError(f"wrong result: max error {err:.3g} of the output's magnitude "
                                f"(limit {CHECK_RTOL:g})")
    rounds = job.get("rounds", 1)
    if cuda:
        timing = _gpu_timer().time(fn, repeats=job["repeats"] * rounds, warmup=job["warmup"])
    else:
        timing = time_with_reference(fn, fma_reference(spec.flops, target), work=spec.flops,
                                     rounds=rounds, repeats=job["repeats"],
                                     min_run_time=job["min_run_time"], warmup=job["warmup"])
    return timing.to_dict()
