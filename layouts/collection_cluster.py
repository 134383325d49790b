"""The latency data set's convs timed on a Ray cluster (maco.tune.cluster): one conv at a time
per machine of this machine's kind, each with its own canary, each row naming its machine's
environment."""
from __future__ import annotations

from typing import Any

import torch

from maco.core.spec import ConvSpec
from maco.core.target import Target
from maco.core.timing import Timing
from maco.layouts.canary import Canary
from maco.layouts.conv_timing import time_spec
from maco.layouts.dataset import REFERENCE, Dataset


def collect_on_cluster(address: str, ds: Dataset, todo: list[tuple[str, ConvSpec, list[str]]], dev: str,
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
    """Run on a machine's actor (maco.tune.cluster): time_spec with this machine's canary, and the
    environment its rows name."""
    if "canary" not in state:
        from maco.tune.cluster import local_threads

        state["env"] = {**local_threads(threads), "torch_threads": threads, "reference": REFERENCE}
        state["canary"] = Canary(dev)
    timings, load = time_spec(state["canary"], ConvSpec.from_dict(spec), lays, dev, **params)
    return {lay: t.to_dict() for lay, t in timings.items()}, load, state["env"]
