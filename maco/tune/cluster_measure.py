"""The tuner's measurements on a Ray cluster (maco.tune.cluster): a batch's kernels compile as Ray
tasks on every node's cores, each object shipped back with its cache key, then one measuring
actor per machine of the batch's target times them by the worker protocol of maco.tune.measure, one
kernel at a time, as a local run does.

The two phases do not overlap, so no machine compiles while it measures. A builder compiles for
the measuring machine's -march target (cpu_build.resolved_flags, reported by that machine), and
the measuring node installs a shipped object only after cpu_build's digest and key checks: one
built for another ISA or compiler has another key and is rebuilt there, never loaded.
"""
from __future__ import annotations

import hashlib
import json
import time
from typing import Any, Callable, Sequence

import ray

from maco.tune.cluster import Cluster, MachinePool, local_threads
from maco.core.errors import MacoError
from maco.kernels import cpu_build
from maco.kernels.cpu_codegen import CpuPlan
from maco.tune.measure import MeasureConfig, Measurer
from maco.tune.records import Interrupted, TransientError
from maco.core.schedule import Schedule
from maco.core.spec import ConvSpec
from maco.core.target import Target
from maco.core.timing import Timing

Result = tuple  # (Timing | None, error | None, env of the measuring machine)


def group_of(target: Target) -> str:
    """Machines measure a target's tasks when their fingerprint equals the target's."""
    return json.dumps(target.fingerprint(), sort_keys=True)


def label_of(target: Target) -> str:
    return f"{target.model} ({target.isa}, {target.cores} threads)" if target.kind == "cpu" else target.model


def describe(target_dict: dict[str, Any]) -> dict[str, Any]:
    """Run on a node: its own target with the tuned target's threads (the group it measures
    for), and the flags a kernel for it compiles with (-march=native resolved on it)."""
    want = Target.from_dict(target_dict)
    here = Target.h100() if want.kind == "cuda" else Target.host(want.cores)
    return {"group": group_of(here), "label": label_of(here),
            "flags": cpu_build.resolved_flags(cpu_build.flags_for(want)) if want.kind == "cpu" else []}


def build(source: str, flags: list[str], timeout: float) -> tuple[dict[str, Any], bytes]:
    """A Ray task: the object of `source` from this node's cache (built now if missing), with
    its key and digest; or the build error."""
    try:
        so = cpu_build.build(source, flags, timeout=timeout)
        data = cpu_build.shipped(so)
    except cpu_build.NoSpaceError as exc:  # the node's disk, not the kernel: the run stops
        return {"error": str(exc), "no_space": True}, b""
    except MacoError as exc:
        return {"error": str(exc)}, b""
    return {"key": so.name[2:-3], "digest": hashlib.sha256(data).hexdigest()}, data


def measure(state: dict[str, Any], target_dict: dict[str, Any], config: MeasureConfig, job: dict[str, Any],
            shipped: list[Any]) -> tuple[dict[str, Any] | None, str | None, bool, dict[str, Any]]:
    """Run on a machine's actor: install the shipped object (if it is this node's kernel), then
    time one kernel (or torch's conv) with this machine's measuring worker."""
    measurer = _measurer(state, target_dict, config)
    spec = ConvSpec.from_dict(job["spec"])
    if job["op"] == "torch":
        timing, error = measurer.baseline(spec, job["layout"])
    else:
        schedule = Schedule.from_dict(job["schedule"])
        if shipped and job.get("digest"):
            try:
                data = ray.get(shipped[0], timeout=300)
                cpu_build.install(job["source"], job["flags"], data, job["digest"])
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError, MacoError):
                pass  # lost in transit or not this node's: the measurer builds it here
        timing, error = measurer(spec, [schedule], measurer.target)[0]
    return (timing.to_dict() if timing else None, error, isinstance(error, TransientError),
            state["env"])


def _measurer(state: dict[str, Any], target_dict: dict[str, Any], config: MeasureConfig) -> Measurer:
    """This actor's Measurer (its worker lives between jobs), made once; its worker runs with the
    target's threads, as a local run's does (Ray gives actors OMP_NUM_THREADS=1)."""
    if "measurer" not in state:
        target = Target.from_dict(target_dict)
        mine = group_of(Target.h100() if target.kind == "cuda" else Target.host(target.cores))
        if mine != group_of(target):
            raise MacoError(f"this node is not a {label_of(target)}")  # the pool picked by group
        state["env"] = local_threads(target.cores if target.kind == "cpu" else 1)
        state["measurer"] = Measurer(target, config)
    return state["measurer"]


class ClusterMeasurer:
    """A maco.tune.measure.Runner on a Ray cluster; close() (or `with`) stops its actors.
    `on_result(index, result)` sees each trial of a batch as it finishes (tests, progress)."""

    def __init__(self, cluster: Cluster, target: Target, config: MeasureConfig | None = None,
                 on_result: Callable[[int, Any], None] | None = None):
        self.target, self.config, self.on_result = target, config or MeasureConfig(), on_result
        self.pool: MachinePool = cluster.pool(describe, (target.to_dict(),), group_of(target),
                                              label_of(target), per_gpu=target.kind == "cuda")
        self.flags: list[str] = self.pool.info["flags"]
        self._build = cluster.remote(build, num_returns=2, num_cpus=1)
        self.build_seconds = 0.0  # time spent in build phases (the experiment reads it)

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> "ClusterMeasurer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def build_all(self, sources: Sequence[str]) -> list[tuple[dict[str, Any], Any]]:
        """The build phase: every source compiled as a Ray task for the measuring machines'
        flags; per source (info, object ref). Ctrl-C cancels the builds."""
        refs = [self._build.remote(src, self.flags, self.config.build_timeout) for src in sources]
        try:
            infos = ray.get([info for info, _ in refs])
        except KeyboardInterrupt:
            for info, data in refs:
                ray.cancel(info, force=True)
            raise
        return [(info, data) for info, (_, data) in zip(infos, refs)]

    def __call__(self, spec: ConvSpec, schedules: Sequence[Schedule],
                 target: Target | None = None) -> list[Result]:
        target = target or self.target
        if target.fingerprint() != self.target.fingerprint():
            raise MacoError(f"this measurer times on {self.target.name!r}, not {target.name!r}")
        results: list[Result | None] = [None] * len(schedules)
        sources: dict[int, str] = {}
        for i, schedule in enumerate(schedules):
            if target.kind != "cpu":
                continue  # CUDA kernels compile in the measuring worker (NVRTC, cached there)
            try:
                sources[i] = CpuPlan(spec, schedule, target).source
            except MacoError as exc:
                results[i] = (None, str(exc), None)
        try:
            start = time.perf_counter()
            built = dict(zip(sources, self.build_all(list(sources.values()))))
            self.build_seconds += time.perf_counter() - start
        except KeyboardInterrupt:
            raise Interrupted([None] * len(schedules)) from None
        jobs, where = [], []
        for i, schedule in enumerate(schedules):
            if results[i] is not None:
                continue
            info, data = built.get(i, ({}, None))
            if info.get("no_space"):
                raise cpu_build.NoSpaceError(info["error"])
            if "error" in info:
                results[i] = (None, info["error"], None)
                continue
            job = {"op": "kernel", "spec": spec.to_dict(), "schedule": schedule.to_dict()}
            if info:
                job.update(source=sources[i], flags=self.flags, digest=info["digest"])
            jobs.append((self.target.to_dict(), self.config, job, [data] if info else []))
            where.append(i)

        def done(k: int, result: Any) -> None:
            if self.on_result:
                self.on_result(where[k], result)

        try:
            measured = self.pool.run(measure, jobs, lost=self._lost, on_result=done)
        except Interrupted as stop:
            for k, r in zip(where, stop.results):
                results[k] = _result(r) if r else None
            raise Interrupted(results) from None
        for k, r in zip(where, measured):
            results[k] = _result(r)
        return results  # type: ignore[return-value]

    def baseline(self, spec: ConvSpec, layout: str = "NCHW") -> Result:
        """torch's conv2d timed on a machine of the target, as Measurer.baseline, with that
        machine's environment (its baseline record names the node)."""
        job = {"op": "torch", "spec": spec.to_dict(), "layout": layout}
        return _result(self.pool.run(measure, [(self.target.to_dict(), self.config, job, [])],
                                     lost=self._lost)[0])

    @staticmethod
    def _lost(reason: str) -> tuple[None, str, bool, None]:
        return None, f"measuring machine lost: {reason}", True, None


def _result(r: tuple) -> Result:
    timing, error, transient, env = r
    if error is not None and transient:
        error = TransientError(error)
    return (Timing(**timing) if timing else None, error, env)
