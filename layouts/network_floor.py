"""A network as the plain DAG maco.bounds.network takes (convs and linears with their ConvSpec,
light ops as weightless nodes, element-wise ops folded into what they read), and the host's fast
memory for its floor. `maco bound NET --network`, experiments/bounds_table.py and `maco optimize`
call this.

Folding: an op with one data input and as many output elements as input elements (BatchNorm,
activations, dropout, reshape, permute, LayerNorm) is the same tensor as its input, as engines
that fuse epilogues compute it; ops that combine tensors (add, mul, cat) or resize them (pool)
stay as nodes without weights or flops. Fewer tensors and boundaries only lower the live sets,
so the floor of the folded DAG is also a floor for an engine that runs every op on its own.
`maco optimize` reports its model against that floor and each kernel against its own (ModelFloor).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from maco.bounds.network import INPUT, NetLayer, NetworkFloor, WINOGRAD_TILES, conv_floor, network_floor
from maco.bounds.winograd import network_reach
from maco.core.errors import MacoError
from maco.core.spec import ConvSpec
from maco.core.target import Target
from maco.kernels.cpu_peak import BUSY_SPREAD
from maco.layouts.graph import META_KINDS, trace_module
from maco.layouts.networks import INPUT_SHAPE, NETWORKS, build


def _elems(shape: tuple[int, ...] | None) -> int:
    return math.prod(shape) if shape is not None else 0


def dag_of(model: nn.Module, example: torch.Tensor) -> tuple[list[NetLayer], int]:
    """(layers in the traced order, image elements) of a torch model."""
    gm, graph = trace_module(model, example)
    alias: dict[str, str] = {}
    out: list[NetLayer] = []
    for name, layer in graph.layers.items():
        if layer.op == "placeholder":
            alias[name] = INPUT
            continue
        if layer.op == "output" or layer.kind in META_KINDS or layer.kind == "attr":
            continue
        data = [alias[src] for src in dict.fromkeys(layer.inputs) if src in alias]
        data = list(dict.fromkeys(data))
        if layer.kind == "conv" and layer.spec is not None:
            out.append(NetLayer(name, tuple(data), layer.spec.output_elems, layer.spec, "conv"))
            alias[name] = name
        elif layer.kind == "linear" and layer.shape:
            mod = gm.get_submodule(layer.target)
            rows = _elems(layer.shape) // mod.out_features
            spec = ConvSpec(rows, mod.in_features, 1, 1, mod.out_features, 1, 1)
            out.append(NetLayer(name, tuple(data), spec.output_elems, spec, "linear"))
            alias[name] = name
        elif not data:
            continue  # a constant
        elif len(data) == 1 and _elems(layer.shape) == _elems(_shape_of(graph, data[0], example)):
            alias[name] = data[0]  # element-wise or a view: the same tensor
        else:
            out.append(NetLayer(name, tuple(data), _elems(layer.shape), None, layer.kind))
            alias[name] = name
    return out, example.numel()


def _shape_of(graph: Any, name: str, example: torch.Tensor) -> tuple[int, ...] | None:
    return tuple(example.shape) if name == INPUT else graph.layers[name].shape


def network_dag(name: str, batch: int = 1) -> tuple[list[NetLayer], int]:
    """The DAG of a built-in network at a batch size (traced on torch's meta device)."""
    if name not in NETWORKS:
        raise MacoError(f"unknown network {name!r}; choose one of {', '.join(NETWORKS)}")
    return dag_of(build(name).to("meta"), torch.empty(batch, *INPUT_SHAPE[1:], device="meta"))


def fast_memory(target: Target) -> int:
    """S for the network floor: every cache of the host together, in fp32 elements (a victim L3,
    as AMD's, holds data the L2s do not, so the last level alone could undercount what stays on
    chip; more S only lowers the floor)."""
    total = 0
    for lvl in target.levels:
        if lvl.name == "registers":
            continue
        total += lvl.capacity * max(1, target.cores // max(1, lvl.processors))
    if total <= 0:
        raise MacoError(f"target {target.name} lists no cache levels")
    return total // 4


def floor_of(name: str, target: Target, batch: int = 1, peak: float | None = None,
             bandwidth: float | None = None, S: int | None = None,
             winograd: Any = WINOGRAD_TILES) -> NetworkFloor:
    """The network floor of a built-in network on `target` (peak in flop/s, bandwidth in bytes/s)."""
    layers, image = network_dag(name, batch)
    return network_floor(layers, S if S is not None else fast_memory(target), image,
                         winograd=winograd, peak=peak, bandwidth=bandwidth)


BUSY_SHARE = 0.9  # a ceiling's median under this share of its best on the host: the machine was busy


@dataclass
class ModelFloor:
    """A model's network floor (maco.bounds.network) and each of its conv kernels' own floor
    (bounds.network.conv_floor, a block kernel's the sum of its convs'), on one host's peak and
    bandwidth: how far the model and each kernel run from what the host allows."""

    network: NetworkFloor
    per_conv: dict[str, float]  # module path -> seconds
    algorithms: dict[str, str]  # module path -> the cheapest algorithm of each of its convs, joined by "+"
    peak_now: float | None = None  # flop/s: the FMA loop's median, timed beside the model
    bandwidth_now: float | None = None  # bytes/s: the DRAM read's median, timed beside the model
    spread_now: float | None = None  # slowest over fastest of those rounds, the larger of the two
    # seconds: MACO's kernel families at their measured ceilings, one layer at a time
    # (bounds.winograd.network_reach), None where their shares of the peak were not timed
    reach: float | None = None

    @property
    def seconds(self) -> float:
        return self.network.t or 0.0

    def busy_note(self) -> str:
        """Why a time over this floor reads high, in brackets with a leading space, or "": the
        floor takes the host's best FMA peak and DRAM read, and where either, timed beside the
        model, ran below BUSY_SHARE of its best, or their rounds lay more than BUSY_SPREAD apart,
        the machine was busy."""
        rates = (("the FMA loop", self.peak_now, self.network.peak),
                 ("DRAM reads", self.bandwidth_now, self.network.bandwidth))
        why = []
        for name, now, best in rates:
            if now and best and now / best < BUSY_SHARE:
                why.append(f"{name} at {now / best:.0%} of its best")
        if self.spread_now is not None and self.spread_now > BUSY_SPREAD:
            why.append(f"their rounds {self.spread_now:.1f}x apart")
        return f" (a busy machine: {', '.join(why)}; the ratio reads high)" if why else ""

    def to_dict(self) -> dict[str, Any]:
        return {"network_s": self.seconds, "binds": self.network.binds, "peak": self.network.peak,
                "bandwidth": self.network.bandwidth, "flops": self.network.flops,
                "per_conv_s": self.per_conv, "algorithms": self.algorithms, "peak_now": self.peak_now,
                "bandwidth_now": self.bandwidth_now, "spread_now": self.spread_now, "reach_s": self.reach}


def model_floor(model: nn.Module, example: torch.Tensor, specs: Mapping[str, tuple[ConvSpec, ...]],
                target: Target, peak: float, bandwidth: float,
                shares: Mapping[tuple[int, int], float] | None = None,
                depthwise_share: float | None = None) -> ModelFloor:
    """The floor of `model` (as given: its DAG before MACO's rewrites) on `example` with the
    target's caches as fast memory, peak in flop/s and bandwidth in bytes/s, and the floor of
    each module in `specs` (path -> the convs it computes); with `shares` (Winograd's, as
    kernels.cpu_peak.winograd_ceilings times them) and `depthwise_share`, the reach of MACO's
    kernel families too."""
    layers, image = dag_of(model, example)
    network = network_floor(layers, fast_memory(target), image, peak=peak, bandwidth=bandwidth)
    reach = (None if shares is None else
             network_reach(layers, peak, bandwidth, shares, depthwise_share=depthwise_share or 1.0))
    per_conv, algorithms = {}, {}
    for path, convs in specs.items():
        floors = [conv_floor(spec, peak, bandwidth) for spec in convs]
        per_conv[path] = sum(t for _, t in floors)
        algorithms[path] = "+".join(a for a, _ in floors)
    return ModelFloor(network, per_conv, algorithms, reach=reach)
