"""Do builds scale through a Ray cluster? The build phase of a 64-trial tuning round on a local
two-node cluster (one CPU each, this machine) against one build process, and against the local
tuner's own parallel build (one gcc per core), interleaved round by round.

Each round samples 64 schedules of a ResNet-18 layer from the pruned space and builds them in
each mode, the order rotated from round to round; every mode's sources carry a comment naming
the round and mode, so no build hits the cache. The cluster's time is ClusterMeasurer's build
phase as the tuner runs it: Ray tasks on every node, each object shipped back with its key.
Per-trial measurement times (kernels already built) come from the local worker and the cluster,
and with them the speed-up of 8 identical nodes is estimated on paper.

    flock /tmp/maco-timing.lock python experiments/cluster_builds.py --out results [--rounds 4]
"""
from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from maco import ConvSpec, space
from maco.experiments.common import Figure, num, out_dir, parser, pyplot, save_plot, write_csv, write_env
from maco.kernels import cpu_build, host_target
from maco.kernels.cpu_codegen import CpuPlan

FIGURE = Figure(
    "cluster", "(not in the paper) the build phase of a 64-trial tuning round on a local two-node Ray "
    "cluster against one build process", csv=("cluster_build_scaling.csv",), in_all=False)

SPEC = ConvSpec.parse("n1_c64_h56_w56_k64_r3x3_p1")  # ResNet-18 layer1 (~2 s of gcc per kernel)
TRIALS = 64
MODES = ("cluster", "one_process", "local_parallel")


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, quick="2 rounds, 16 trials measured")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    rounds = 2 if args.quick else args.rounds
    try:
        import ray
        from ray.cluster_utils import Cluster as LocalCluster
    except ImportError:
        print("needs Ray: pip install 'maco[cluster]'", file=sys.stderr)
        return 2
    from maco.tune.cluster import Cluster
    from maco.tune.cluster_measure import ClusterMeasurer
    from maco.tune.measure import Measurer

    os.environ["MACO_CACHE"] = tempfile.mkdtemp(prefix="maco-cluster-builds-")  # the nodes inherit it
    target = host_target()
    local = LocalCluster(initialize_head=True, head_node_args={"num_cpus": 1})
    local.add_node(num_cpus=1)
    local.wait_for_nodes()
    rows = []
    try:
        with Cluster(local.address) as conn, ClusterMeasurer(conn, target) as remote:
            flags = cpu_build.flags_for(target)
            for r in range(rounds):
                schedules = _sample(target, random.Random(r))
                sources = [CpuPlan(SPEC, s, target).source for s in schedules]
                times = {}
                for mode in MODES[r % 3:] + MODES[:r % 3]:
                    salted = [f"{src}\n/* round {r} {mode} */\n" for src in sources]
                    start = time.perf_counter()
                    if mode == "cluster":
                        built = remote.build_all(salted)
                        failed = sum("error" in info for info, _ in built)
                    else:
                        out = cpu_build.build_parallel([(s, flags) for s in salted],
                                                       workers=1 if mode == "one_process" else None)
                        failed = sum(isinstance(o, Exception) for o in out)
                    times[mode] = time.perf_counter() - start
                    rows.append(dict(round=r, mode=mode, trials=len(salted), failed=failed,
                                     seconds=round(times[mode], 3)))
                print(f"round {r + 1}/{rounds}: cluster {times['cluster']:.1f} s, one process "
                      f"{times['one_process']:.1f} s ({times['cluster'] / times['one_process']:.2f}x), "
                      f"one gcc per core {times['local_parallel']:.1f} s", flush=True)
            measured = _sample(target, random.Random(99))[:16 if args.quick else 32]
            cpu_build.build_parallel([(CpuPlan(SPEC, s, target).source, flags) for s in measured])
            per_trial = {}
            with Measurer(target) as worker:
                for name, measurer in (("local", worker), ("cluster", remote)):
                    measurer(SPEC, measured[:2], target)  # the worker starts (torch import) outside the clock
                    start = time.perf_counter()
                    measurer(SPEC, measured, target)
                    per_trial[name] = (time.perf_counter() - start) / len(measured)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        local.shutdown()
    out = out_dir(args)
    write_csv(out / "cluster_build_scaling.csv", rows)
    summary = _estimate(rows, per_trial)
    write_env(out / "cluster_build_scaling.csv", spec=str(SPEC), nodes=2, cpus_per_node=1, **summary)
    for key, value in summary.items():
        print(f"{key}: {value}")
    _plot(rows, out / "cluster_build_scaling.png")
    return 0


def _sample(target, rng: random.Random) -> list:
    out: dict = {}
    while len(out) < TRIALS:
        out[space.sample(SPEC, target, rng, pruned=True)] = None
    return list(out)


def _estimate(rows: list[dict], per_trial: dict[str, float]) -> dict[str, float]:
    """Median per-round ratios, per-trial build and measure times, and on paper: a round of 64
    trials on one such 2-core machine (its own parallel build, then measuring) against 8 such
    machines (64 builds over 16 cores plus the measured per-round overhead of the cluster, then
    8 measuring in parallel)."""
    by = {(row["round"], row["mode"]): row["seconds"] for row in rows}
    rounds = sorted({row["round"] for row in rows})
    ratio = statistics.median(by[r, "cluster"] / by[r, "one_process"] for r in rounds)
    ratio_parallel = statistics.median(by[r, "cluster"] / by[r, "local_parallel"] for r in rounds)
    build = statistics.median(by[r, "one_process"] for r in rounds) / TRIALS  # one gcc, seconds per trial
    cluster = statistics.median(by[r, "cluster"] for r in rounds)
    overhead = max(cluster - TRIALS * build / 2, 0.0)  # what two builders lose to Ray per round
    one_machine = statistics.median(by[r, "local_parallel"] for r in rounds) + TRIALS * per_trial["local"]
    eight = TRIALS * build / 16 + overhead + TRIALS * per_trial["cluster"] / 8
    return dict(median_ratio_cluster_vs_one_process=round(ratio, 3),
                median_ratio_cluster_vs_local_parallel=round(ratio_parallel, 3),
                build_seconds_per_trial_one_gcc=round(build, 4),
                measure_seconds_per_trial_local=round(per_trial["local"], 4),
                measure_seconds_per_trial_cluster=round(per_trial["cluster"], 4),
                cluster_overhead_seconds_per_round=round(overhead, 3),
                round_seconds_one_machine=round(one_machine, 2),
                round_seconds_8_nodes_estimate=round(eight, 2),
                speedup_8_nodes_estimate=round(one_machine / eight, 2))


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    rounds = sorted({row["round"] for row in rows})
    width = 0.27
    for k, mode in enumerate(MODES):
        ax.bar([r + (k - 1) * width for r in rounds],
               [next(row["seconds"] for row in rows if row["round"] == r and row["mode"] == mode) for r in rounds],
               width, label={"cluster": "Ray cluster, 2 nodes x 1 CPU", "one_process": "one build process",
                             "local_parallel": "local, one gcc per core (2)"}[mode])
    ax.set_xlabel("round (64 fresh kernels per mode)")
    ax.set_ylabel("build phase, seconds")
    ax.set_xticks(rounds)
    ax.legend(fontsize=8)
    ax.set_title(f"Build phase of a {TRIALS}-trial round: {SPEC}", fontsize=9)
    fig.tight_layout()
    save_plot(fig, path)


def summarise(rows: list[dict[str, str]]) -> str:
    """REPORT.md: the median per-round ratio of the cluster's build phase to one build process."""
    rounds = sorted({r["round"] for r in rows})
    by = {(r["round"], r["mode"]): num(r, "seconds") for r in rows}
    ratios = [by[r, "cluster"] / by[r, "one_process"] for r in rounds]
    return (f"build phase of a 64-trial round on 2 local Ray nodes: {statistics.median(ratios):.2f}x the time "
            f"of one build process (median of {len(ratios)} rounds, {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    sys.exit(main())
