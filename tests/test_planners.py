"""Planners against an independent brute force on random small graphs (branches, skip
connections, multi-consumer tensors, pinned layers, 2 and 3 layouts), and problem validation."""
from __future__ import annotations

import itertools
import random
from fractions import Fraction

import pytest

from maco.core.errors import MacoError
from maco.layouts.planners import brute_force, solve
from maco.layouts.problem import LayoutProblem, PlannerTimeout


def evaluate(problem: LayoutProblem, assignment: dict) -> Fraction:
    """The cost recomputed from the raw tables, written apart from LayoutProblem.cost: for each
    tensor, the set of layouts its consumers read it in, minus its own, each paid once."""
    total = Fraction(0)
    for v in problem.layers:
        total += Fraction(problem.layer_cost[v][assignment[v]])
        wanted = {assignment[u] for u in problem.consumers.get(v, [])} - {assignment[v]}
        total += sum((Fraction(problem.convert_cost[v][(assignment[v], t)]) for t in wanted), Fraction(0))
    return total


def reference_optimum(problem: LayoutProblem) -> Fraction:
    choices = [sorted(problem.layer_cost[v]) for v in problem.layers]
    return min(evaluate(problem, dict(zip(problem.layers, combo))) for combo in itertools.product(*choices))


def random_problem(rng: random.Random, n: int, layouts: list[str], integer: bool) -> LayoutProblem:
    """A DAG: a chain backbone plus random skip edges (so tensors get several consumers), the
    first and last layers pinned to layouts[0] like a network's input and output, some inner
    layers pinned or restricted."""
    names = [f"L{i}" for i in range(n)]
    consumers: dict[str, list[str]] = {v: [] for v in names}
    for i in range(n - 1):
        consumers[names[i]].append(names[i + 1])
        for j in range(i + 2, n):
            if rng.random() < 0.25:
                consumers[names[i]].append(names[j])
    if rng.random() < 0.5:  # a branch that skips the backbone from the input to the output
        consumers[names[0]].append(names[-1])

    def cost() -> float:
        return rng.randint(0, 9) if integer else rng.uniform(0, 1e-3) * rng.choice([1, 1e-2])

    layer_cost = {}
    for i, v in enumerate(names):
        if i in (0, n - 1):
            allowed = [layouts[0]]
        else:
            r = rng.random()
            allowed = ([rng.choice(layouts)] if r < 0.15 else
                       rng.sample(layouts, 2) if r < 0.3 and len(layouts) > 2 else list(layouts))
        layer_cost[v] = {lay: cost() for lay in allowed}
    convert_cost = {v: {(a, b): cost() for a in layouts for b in layouts if a != b} for v in names}
    return LayoutProblem(names, consumers, layer_cost, convert_cost)


@pytest.mark.parametrize("layouts", [["NCHW", "NHWC"], ["NCHW", "NHWC", "NCHW16c"]])
@pytest.mark.parametrize("integer", [True, False])
def test_methods_equal_brute_force(layouts: list[str], integer: bool) -> None:
    rng = random.Random(hash((len(layouts), integer)) & 0xFFFF)
    for trial in range(60):
        problem = random_problem(rng, rng.randint(2, 9 if len(layouts) == 2 else 7), layouts, integer)
        best = reference_optimum(problem)
        for method in ["exact", "backtrack", "milp"] + (["mincut"] if len(layouts) == 2 else []):
            sol = solve(problem, method)
            got = evaluate(problem, sol.assignment)
            assert all(sol.assignment[v] in problem.layer_cost[v] for v in problem.layers)
            if integer or method in ("mincut", "backtrack"):
                assert got == best, (trial, method, got, best)
            else:  # HiGHS works in floating point
                assert float(got) == pytest.approx(float(best), rel=1e-9, abs=1e-15), (trial, method)
            assert sol.cost == pytest.approx(float(got), rel=1e-12)


def test_multi_consumer_tensor_pays_once_per_layout() -> None:
    """One tensor read by three NHWC layers is converted once; a pairwise model would pay three
    conversions and keep everything in NCHW."""
    layers = ["in", "a", "b", "c", "out"]
    consumers = {"in": ["a", "b", "c"], "a": ["out"], "b": ["out"], "c": ["out"]}
    fast = {"NCHW": 5.0, "NHWC": 3.0}
    layer_cost = {"in": {"NCHW": 0.0}, "a": fast, "b": fast, "c": fast, "out": {"NHWC": 0.0}}
    conv = {("NCHW", "NHWC"): 4.0, ("NHWC", "NCHW"): 4.0}
    problem = LayoutProblem(layers, consumers, layer_cost, {v: conv for v in layers})
    # all NHWC: 9 + one input conversion 4 = 13; all NCHW: 15 + three output conversions 12
    for method in ("exact", "backtrack", "milp"):
        sol = solve(problem, method)
        assert sol.cost == 13.0 and sol.assignment["a"] == "NHWC", method
    assert brute_force(problem).cost == 13.0


def test_mixed_targets_each_paid_once() -> None:
    """A tensor read in two other layouts pays both conversions (3 layouts)."""
    layers = ["x", "p", "q", "r"]
    problem = LayoutProblem(layers, {"x": ["p", "q", "r"]},
                            {"x": {"A": 0.0}, "p": {"B": 1.0}, "q": {"C": 1.0}, "r": {"C": 1.0}},
                            {"x": {("A", "B"): 2.0, ("A", "C"): 5.0}})
    assert problem.conversions(solve(problem).assignment)["x"] == ["B", "C"]
    assert solve(problem).cost == 3.0 + 2.0 + 5.0


def test_pinned_single_layout_and_trivial() -> None:
    problem = LayoutProblem(["a", "b"], {"a": ["b"]}, {"a": {"NCHW": 1}, "b": {"NCHW": 2}}, {})
    for method in ("exact", "backtrack", "mincut", "milp"):
        sol = solve(problem, method)
        assert sol.assignment == {"a": "NCHW", "b": "NCHW"} and sol.cost == 3.0


def test_exact_is_fast_on_a_deep_graph() -> None:
    rng = random.Random(5)
    problem = random_problem(rng, 400, ["NCHW", "NHWC"], integer=False)
    sol = solve(problem, "exact")
    assert sol.method == "mincut" and sol.runtime < 10
    assert float(evaluate(problem, sol.assignment)) == pytest.approx(sol.cost)
    milp = solve(problem, "milp")
    assert milp.cost == pytest.approx(sol.cost, rel=1e-9)


def test_backtrack_time_limit_reports_best_so_far() -> None:
    rng = random.Random(1)
    problem = random_problem(rng, 200, ["NCHW", "NHWC"], integer=False)
    with pytest.raises(PlannerTimeout) as info:
        solve(problem, "backtrack", time_limit=0.2)
    best = info.value.best
    assert best is not None and not best.optimal
    assert best.cost >= solve(problem, "exact").cost - 1e-12


@pytest.mark.parametrize("args, needle", [
    ((["a", "b"], {"z": ["b"]}, {"a": {"N": 1}, "b": {"N": 1}}, {}), "'z'"),
    ((["a", "b"], {"a": ["zz"]}, {"a": {"N": 1}, "b": {"N": 1}}, {}), "'zz'"),
    ((["a", "b"], {"b": ["a"]}, {"a": {"N": 1}, "b": {"N": 1}}, {}), "topological"),
    ((["a", "a"], {}, {"a": {"N": 1}}, {}), "twice"),
    ((["a", "b"], {"a": ["b"]}, {"a": {"N": 1}}, {}), "'b' has no layer_cost"),
    ((["a", "b"], {"a": ["b"]}, {"a": {"N": 1}, "b": {}}, {}), "'b' has no layer_cost"),
    ((["a", "b"], {"a": ["b"]}, {"a": {"N": 1}, "b": {"N": 1, "H": 1}}, {}), "('N', 'H')"),
    ((["a", "b"], {"a": ["b"]}, {"a": {"N": 1}, "b": {"H": 1}}, {"a": {("H", "N"): 1}}), "('N', 'H')"),
    ((["a"], {}, {"a": {"N": -1}}, {}), "-1"),
    ((["a"], {}, {"a": {"N": float("nan")}}, {}), "nan"),
    ((["a"], {}, {"a": {"N": 1}}, {"q": {}}), "'q'"),
    ((["a"], {}, {"a": {"N": 1}}, {"a": {"NH": 1}}), "'NH'"),
    (([], {}, {}, {}), "at least one"),
])
def test_validation_names_the_bad_item(args: tuple, needle: str) -> None:
    with pytest.raises(MacoError, match=None) as info:
        LayoutProblem(*args)
    assert needle in str(info.value)


def test_solve_rejects_bad_method_and_assignments() -> None:
    problem = LayoutProblem(["a"], {}, {"a": {"N": 1}}, {})
    with pytest.raises(MacoError, match="'greedy'"):
        solve(problem, "greedy")
    with pytest.raises(MacoError, match="'H'"):
        problem.cost({"a": "H"})
    with pytest.raises(MacoError, match="'a'"):
        problem.cost({})
    three = LayoutProblem(["a"], {}, {"a": {"A": 1, "B": 2, "C": 0}}, {})
    with pytest.raises(MacoError, match="two layouts"):
        solve(three, "mincut")
    assert solve(three).assignment == {"a": "C"}
