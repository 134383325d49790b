"""Planners for a LayoutProblem.

- "backtrack": the paper's Algorithm 1 as stated: a depth-first search over the layers in
  topological order, trying every allowed layout of each, with the running cost of the partial
  plan (layer seconds plus the conversions between already-placed layers) cut off by the best
  complete plan so far. Exact, since every cost is >= 0; exponential in the worst case.
- "mincut" (two layouts): an exact s-t minimum cut. A layer on the source side runs in the first
  layout L0, on the sink side in L1. Unary costs are edges s->v (L1's seconds) and v->t (L0's).
  A tensor v paying c01 once when it is L0 and *any* consumer is L1 is not a pairwise term; an
  auxiliary node a with v->a (c01) and a->u (infinite) for every consumer u represents it exactly:
  if v is L0 and some u is L1, a must sit on u's side (else a->u is cut at infinite cost) and
  v->a is cut once; otherwise a joins v's side at no cost. Symmetrically b->v (c10) and u->b
  (infinite) for "v is L1 and any consumer is L0". Every capacity is >= 0, so the energy is
  submodular and the cut is exact. Costs are scaled to integers exactly (floats are binary
  fractions), and the cut value is checked against the plan's cost in exact arithmetic.
- "milp" (any number of layouts): binaries x[v,l] (one per layer), and z[v,s,t] >= x[v,s] +
  x[u,t] - 1 for every consumer u, priced at the conversion s->t of v's tensor: z is 1 exactly
  when the tensor is converted to t at least once. Solved by HiGHS through scipy.optimize.milp
  with a zero relative gap.
- "exact": mincut when the problem has at most two layouts, milp otherwise.
"""
from __future__ import annotations

import itertools
import math
import time
from fractions import Fraction
from typing import Callable

import numpy as np

from maco.core.errors import MacoError

from maco.layouts.problem import LayoutProblem, Name, PlannerTimeout, Solution

METHODS = ("exact", "backtrack", "mincut", "milp")


def solve(problem: LayoutProblem, method: str = "exact", time_limit: float | None = None) -> Solution:
    """The cheapest assignment of `problem` by `method` (see the module docstring). With a
    `time_limit` (seconds), a planner that runs past it raises PlannerTimeout carrying the best
    plan found so far."""
    if not isinstance(problem, LayoutProblem):
        raise MacoError(f"expected a LayoutProblem, got {type(problem).__name__}")
    if method not in METHODS:
        raise MacoError(f"unknown planner method {method!r}; choose one of {', '.join(METHODS)}")
    if time_limit is not None and not time_limit > 0:
        raise MacoError(f"time_limit must be > 0 seconds, got {time_limit!r}")
    if method == "exact":
        method = "mincut" if len(problem.layouts) <= 2 else "milp"
    if method == "mincut":  # a first import takes longer than most plans: not the planner's time
        import networkx  # noqa: F401
    elif method == "milp":
        import scipy.optimize  # noqa: F401
    start = time.perf_counter()
    assignment = {"backtrack": _backtrack, "mincut": _mincut, "milp": _milp}[method](problem, time_limit)
    return Solution(assignment, problem.cost(assignment), method, time.perf_counter() - start)


# -- Algorithm 1: backtracking with the running best as the bound ---------------------------------
def _backtrack(problem: LayoutProblem, time_limit: float | None) -> dict[Name, str]:
    layers = problem.layers
    n = len(layers)
    index = problem.index
    options = [list(problem.layer_cost[v].items()) for v in layers]
    producers = [[index[p] for p in problem.producers[v]] for v in layers]
    convert = [problem.convert_cost.get(v, {}) for v in layers]
    # uses[p][t]: how many placed consumers of p run in t (the conversion is paid by the first)
    uses: list[dict[str, int]] = [{} for _ in layers]
    lay: list[str] = [""] * n
    choice = [-1] * n
    partial = [0.0] * (n + 1)
    best, best_lay = math.inf, None
    deadline = None if time_limit is None else time.perf_counter() + time_limit
    steps, i = 0, 0

    def undo(j: int) -> None:
        t = lay[j]
        for p in producers[j]:
            uses[p][t] -= 1

    while i >= 0:
        if choice[i] >= 0:
            undo(i)
        choice[i] += 1
        if choice[i] == len(options[i]):
            choice[i] = -1
            i -= 1
            continue
        steps += 1
        if deadline is not None and not steps & 1023 and time.perf_counter() > deadline:
            found = None
            if best_lay is not None:
                assignment = dict(zip(layers, best_lay))
                found = Solution(assignment, problem.cost(assignment), "backtrack", time_limit or 0.0,
                                 optimal=False)
            raise PlannerTimeout(f"backtracking over {n} layers passed its time limit of "
                                 f"{time_limit} s after {steps} steps (method='exact' solves it in polynomial time)", found)
        t, cost = options[i][choice[i]]
        lay[i] = t
        for p in producers[i]:
            count = uses[p].get(t, 0)
            if count == 0 and lay[p] != t:
                cost += convert[p][(lay[p], t)]
            uses[p][t] = count + 1
        cost += partial[i]
        if cost >= best:  # the running best bounds the partial plan: prune
            continue
        if i == n - 1:
            best, best_lay = cost, list(lay)
            continue
        partial[i + 1] = cost
        i += 1
    assert best_lay is not None  # every layer allows at least one layout
    return dict(zip(layers, best_lay))


# -- two layouts: s-t minimum cut ----------------------------------------------------------------
def _mincut(problem: LayoutProblem, time_limit: float | None) -> dict[Name, str]:
    """The exact plan of a problem with at most two layouts, from an s-t minimum cut (see the module
    docstring); the cut's value is checked against the plan's cost in exact arithmetic."""
    layouts = problem.layouts
    if len(layouts) > 2:
        raise MacoError(f"mincut handles two layouts, this problem has {len(layouts)}: "
                        f"{', '.join(layouts)}; use method='milp' or 'exact'")
    if len(layouts) == 1:
        return {v: layouts[0] for v in problem.layers}
    import networkx as nx

    l0, l1 = layouts
    scale = _integer_scale(problem)
    graph = _cut_graph(problem, l0, l1, scale)
    cut, (source_side, _) = nx.minimum_cut(graph, _SOURCE, _SINK)
    assignment = {v: (l0 if _node(v) in source_side else l1) for v in problem.layers}
    if Fraction(cut) / scale != problem.cost(assignment, exact=True):
        raise RuntimeError(f"min cut {Fraction(cut) / scale} != plan cost "
                           f"{problem.cost(assignment, exact=True)}: a planner bug, please report")
    return assignment


_SOURCE, _SINK = ("s",), ("t",)  # tuples never collide with the layers' names in node keys


def _node(v: Name) -> tuple:
    """The cut graph's node of layer v (a tuple, so no layer name collides with s, t or an aux)."""
    return ("layer", v)


def _cut_graph(problem: LayoutProblem, l0: str, l1: str, scale: int):
    """The flow network whose minimum s-t cut prices a plan: a layer on the source side runs in
    l0, on the sink side in l1; capacities are the costs times `scale` (integers, so exact)."""
    import networkx as nx

    graph = nx.DiGraph()
    graph.add_nodes_from([_SOURCE, _SINK])
    for v in problem.layers:
        table = problem.layer_cost[v]
        graph.add_node(_node(v))
        # v->t is cut when v is on the source side (runs in L0); infinite when v is pinned to L1
        _add_capacity(graph, _node(v), _SINK, table[l0] if l0 in table else None, scale)
        # s->v is cut when v is on the sink side (runs in L1); infinite when v is pinned to L0
        _add_capacity(graph, _SOURCE, _node(v), table[l1] if l1 in table else None, scale)
    for v in problem.layers:
        _add_conversion_edges(graph, problem, v, l0, l1, scale)
    for a, b, data in graph.edges(data=True):
        data.pop("infinite", None)
    return graph


def _add_conversion_edges(graph, problem: LayoutProblem, v: Name, l0: str, l1: str,
                          scale: int) -> None:
    """Price converting v's tensor once however many consumers need the other layout: a direct
    edge for one such consumer, else an auxiliary node with infinite edges to (from) each."""
    table, conv = problem.layer_cost[v], problem.convert_cost.get(v, {})
    us = problem.consumers.get(v, [])
    to_l1 = [u for u in us if l1 in problem.layer_cost[u]]
    to_l0 = [u for u in us if l0 in problem.layer_cost[u]]
    if l0 in table and to_l1:  # v in L0, some consumer in L1: pay c01 once
        if len(to_l1) == 1:
            _add_capacity(graph, _node(v), _node(to_l1[0]), conv[(l0, l1)], scale)
        else:
            aux = ("to", v, l1)
            _add_capacity(graph, _node(v), aux, conv[(l0, l1)], scale)
            for u in to_l1:
                _add_capacity(graph, aux, _node(u), None, scale)
    if l1 in table and to_l0:  # v in L1, some consumer in L0: pay c10 once
        if len(to_l0) == 1:
            _add_capacity(graph, _node(to_l0[0]), _node(v), conv[(l1, l0)], scale)
        else:
            aux = ("to", v, l0)
            _add_capacity(graph, aux, _node(v), conv[(l1, l0)], scale)
            for u in to_l0:
                _add_capacity(graph, _node(u), aux, None, scale)


def _add_capacity(graph, a: tuple, b: tuple, seconds: float | None, scale: int) -> None:
    """Add capacity to edge a->b, summing parallel terms (None: infinite, networkx's
    missing-capacity convention; an infinite edge stays infinite)."""
    if seconds is None:
        graph.add_edge(a, b)
        graph[a][b].pop("capacity", None)
        graph[a][b]["infinite"] = True
        return
    cap = int(Fraction(seconds) * scale)
    if graph.has_edge(a, b):
        if graph[a][b].get("infinite"):
            return
        graph[a][b]["capacity"] += cap
    else:
        graph.add_edge(a, b, capacity=cap)


def _integer_scale(problem: LayoutProblem) -> int:
    """The least common denominator of the costs (floats are binary fractions: a power of two)."""
    denominators = [Fraction(c).denominator for t in problem.layer_cost.values() for c in t.values()]
    denominators += [Fraction(c).denominator for t in problem.convert_cost.values() for c in t.values()]
    return math.lcm(*denominators) if denominators else 1


# -- any number of layouts: an integer program (HiGHS) -------------------------------------------
def _milp(problem: LayoutProblem, time_limit: float | None) -> dict[Name, str]:
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    costs: list[float] = []
    integral: list[int] = []
    x: dict[tuple[Name, str], int] = {}
    for v in problem.layers:
        for lay, sec in problem.layer_cost[v].items():
            x[(v, lay)] = len(costs)
            costs.append(float(sec))
            integral.append(1)
    rows: list[tuple[list[int], list[float], float, float]] = []  # (cols, coefs, lo, hi)
    for v in problem.layers:
        rows.append(([x[(v, lay)] for lay in problem.layer_cost[v]], [1.0] * len(problem.layer_cost[v]), 1, 1))
    for v in problem.layers:
        us = problem.consumers.get(v, [])
        targets = dict.fromkeys(t for u in us for t in problem.layer_cost[u])
        for s in problem.layer_cost[v]:
            for t in targets:
                if t == s:
                    continue
                z = len(costs)
                costs.append(float(problem.convert_cost[v][(s, t)]))
                integral.append(0)  # x integral forces z to 0 or 1 at the optimum
                for u in us:
                    if t in problem.layer_cost[u]:  # z >= x[v,s] + x[u,t] - 1
                        rows.append(([z, x[(v, s)], x[(u, t)]], [1.0, -1.0, -1.0], -1, math.inf))
    c = np.array(costs)
    # HiGHS stops within an absolute gap of 1e-6: scale the objective so that is negligible.
    total = c.sum()
    c = c * (1e6 / total) if total > 0 else c
    r, cols, vals, lo, hi = [], [], [], [], []
    for i, (cs, coefs, a, b) in enumerate(rows):
        r += [i] * len(cs)
        cols += cs
        vals += coefs
        lo.append(a)
        hi.append(b)
    a_mat = coo_array((vals, (r, cols)), shape=(len(rows), len(costs))).tocsr()
    options: dict[str, float] = {"mip_rel_gap": 0.0}
    if time_limit is not None:
        options["time_limit"] = time_limit
    res = milp(c, integrality=np.array(integral), bounds=Bounds(0, 1),
               constraints=LinearConstraint(a_mat, lo, hi), options=options)
    if res.x is None or res.status != 0:
        if res.status == 1:
            raise PlannerTimeout(f"the integer program passed its time limit of {time_limit} s "
                                 f"({res.message})")
        raise RuntimeError(f"HiGHS failed on a feasible layout problem: {res.message}")
    assignment = {}
    for v in problem.layers:
        lays = list(problem.layer_cost[v])
        assignment[v] = max(lays, key=lambda lay: res.x[x[(v, lay)]])
    return assignment


def brute_force(problem: LayoutProblem, limit: int = 1 << 20) -> Solution:
    """Every assignment, cheapest first found: a reference for small problems only."""
    sizes = [len(problem.layer_cost[v]) for v in problem.layers]
    if math.prod(sizes) > limit:
        raise MacoError(f"brute force over {math.prod(sizes)} assignments exceeds the limit {limit}")
    start = time.perf_counter()
    best: tuple[float, dict[Name, str]] | None = None
    for combo in itertools.product(*[list(problem.layer_cost[v]) for v in problem.layers]):
        assignment = dict(zip(problem.layers, combo))
        cost = problem.cost(assignment)
        if best is None or cost < best[0]:
            best = (cost, assignment)
    assert best is not None
    return Solution(best[1], best[0], "brute", time.perf_counter() - start)


Planner = Callable[[LayoutProblem, float | None], dict[Name, str]]

__all__ = ["METHODS", "solve", "brute_force"]
