"""Exact red-blue pebbling of a small CDAG by brute force (0-1 breadth-first search over every
state), the independent reference tests/test_network_bound.py checks the network floor against.

The game (Hong and Kung): sources start blue; a move loads (blue -> also red, cost 1), stores
(red -> also blue, cost 1), computes a vertex whose predecessors are all red (it becomes red,
cost 0) or drops a red pebble (cost 0); at most S red pebbles at once; done when every sink is
blue. Options: `once`, every vertex computed at most once (the red-blue-white game); `layers`, a
vertex of layer i is computed only after every vertex of the layers before it; `warm`, any S
sources may start red (what a previous run could leave in the cache).
"""
from __future__ import annotations

from collections import deque
from itertools import combinations
from typing import Sequence

from maco.core.spec import ConvSpec


class CDAG:
    """Vertices 0..n-1 with predecessor lists, a layer index each (-1 for sources), sinks."""

    def __init__(self) -> None:
        self.preds: list[tuple[int, ...]] = []
        self.layer: list[int] = []

    def add(self, preds: Sequence[int] = (), layer: int = -1) -> int:
        self.preds.append(tuple(preds))
        self.layer.append(layer)
        return len(self.preds) - 1

    @property
    def sources(self) -> list[int]:
        return [v for v, p in enumerate(self.preds) if not p]

    @property
    def sinks(self) -> list[int]:
        used = {u for p in self.preds for u in p}
        return [v for v in range(len(self.preds)) if v not in used]


def conv_vertices(g: CDAG, spec: ConvSpec, inputs: list[int], layer: int) -> list[int]:
    """The outputs of one conv (n = 1) in NCHW order, each a vertex reading the inputs under its
    window (padding reads nothing) and the weights of those taps: new weight sources are added."""
    assert spec.n == 1
    weights = {}
    for k in range(spec.k):
        for c in range(spec.c_per_group):
            for i in range(spec.kh):
                for j in range(spec.kw):
                    weights[k, c, i, j] = g.add()
    outs = []
    sh, sw = spec.stride
    ph, pw = spec.padding
    dh, dw = spec.dilation
    for k in range(spec.k):
        grp = k // spec.k_per_group
        for oh in range(spec.out_h):
            for ow in range(spec.out_w):
                preds = []
                for c in range(spec.c_per_group):
                    cin = grp * spec.c_per_group + c
                    for i in range(spec.kh):
                        for j in range(spec.kw):
                            ih, iw = oh * sh - ph + i * dh, ow * sw - pw + j * dw
                            if 0 <= ih < spec.h and 0 <= iw < spec.w:
                                preds += [inputs[(cin * spec.h + ih) * spec.w + iw], weights[k, c, i, j]]
                outs.append(g.add(preds, layer))
    return outs


def min_io(g: CDAG, S: int, *, once: bool = False, layers: bool = False, warm: bool = False,
           limit: int = 3_000_000) -> int:
    """The least loads + stores of any complete pebbling with S red pebbles.

    Three reductions keep it exact: a red pebble is dropped only to make room for the next one (a
    drop at any other time can be postponed to then); a sink is stored as soon as it is computed
    and its red pebble dropped (it must be stored once anyway and nothing reads it); with `once`,
    a vertex whose successors are all computed is dead: its pebbles are dropped."""
    n = len(g.preds)
    pred_mask = [sum(1 << u for u in p) for p in g.preds]
    succ_mask = [0] * n
    for v, p in enumerate(g.preds):
        for u in p:
            succ_mask[u] |= 1 << v
    sources = sum(1 << v for v in g.sources)
    sink_list = g.sinks
    sinks = sum(1 << v for v in sink_list)
    nlayers = max(g.layer) + 1
    layer_mask = [sum(1 << v for v in range(n) if g.layer[v] == i) for i in range(nlayers)]
    before = [sum(layer_mask[:i]) for i in range(nlayers)]
    track = once or layers

    def normal(red: int, blue: int, done: int) -> tuple[int, tuple[int, int, int]]:
        cost = 0
        for v in sink_list:
            if red >> v & 1:
                red &= ~(1 << v)
                if not blue >> v & 1:
                    blue |= 1 << v
                    cost += 1
        if once:
            for v in range(n):
                bit = 1 << v
                if succ_mask[v] and done & succ_mask[v] == succ_mask[v]:
                    red &= ~bit
                    if not sources & bit:
                        blue &= ~bit
        return cost, (red, blue, done)

    starts = [0]
    if warm:
        srcs = g.sources
        starts = [sum(1 << v for v in c) for k in range(1, min(S, len(srcs)) + 1)
                  for c in combinations(srcs, k)] + [0]
    dist: dict[tuple[int, int, int], int] = {}
    dq: deque[tuple[int, tuple[int, int, int]]] = deque()
    for red in starts:
        st = (red, sources, 0)
        dist[st] = 0
        dq.append((0, st))

    while dq:
        d, st = dq.popleft()
        if dist.get(st, 1 << 60) < d:
            continue
        red, blue, done = st
        if blue & sinks == sinks:
            return d
        if len(dist) > limit:
            raise RuntimeError("state space too large for the brute force")
        reds = [v for v in range(n) if red >> v & 1]
        full = len(reds) >= S
        nexts: list[tuple[int, tuple[int, int, int]]] = []
        for v in reds:
            if not blue >> v & 1:
                nexts.append((1, (red, blue | 1 << v, done)))  # store
        for v in range(n):
            bit = 1 << v
            if red & bit:
                continue
            moves = []
            if blue & bit:
                moves.append((1, 0, 0))  # load
            if pred_mask[v] and red & pred_mask[v] == pred_mask[v] and not (once and done & bit) \
                    and not (layers and done & before[g.layer[v]] != before[g.layer[v]]):
                moves.append((0, pred_mask[v], bit if track else 0))  # compute
            for cost, keep, mark in moves:
                evict = [u for u in reds if not keep >> u & 1] if full else [None]
                for u in evict:
                    r = (red & ~(1 << u) if u is not None else red) | bit
                    extra, nst = normal(r, blue, done | mark)
                    nexts.append((cost + extra, nst))
        for cost, nst in nexts:
            nd = d + cost
            if nd < dist.get(nst, 1 << 60):
                dist[nst] = nd
                if cost == 0:
                    dq.appendleft((nd, nst))
                elif cost == 1:
                    dq.append((nd, nst))
                else:
                    raise AssertionError("moves cost 0 or 1")
    raise RuntimeError("no complete pebbling (S too small for some vertex's predecessors)")
