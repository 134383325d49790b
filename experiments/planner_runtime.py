"""Planner run time: the exact planners (s-t min cut, HiGHS MILP) against the paper's Algorithm 1
(backtracking with the running best as the bound) on the traced graphs of ResNet-18, AlexNet and
VGG-11 and on deep random residual graphs of growing depth, each backtracking run capped by a
time limit. Where backtracking finishes, every method must reach the same cost.

    python experiments/planner_runtime.py [--quick] [--out results] [--time-limit 20] [--max-depth 1024]

Conv costs: the measured seconds of results/dataset_cpu.csv (`maco collect`) where it has the
layer, else a synthetic FLOP-rate model; conversions: bytes / 10 GB/s + 5 us (the run time of a
planner barely depends on the values, only on the graph and on how well backtracking prunes).
Writes planner_runtime.csv and planner_runtime.png under --out.
"""
from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Any

from maco.experiments.common import Figure, num, out_dir, parser, print_table, pyplot, save_plot, write_csv

FIGURE = Figure(
    "planners", "(not in the paper) Algorithm 1's backtracking against the exact planners",
    "backtracking is exponential in the free layers; the exact planners stay in milliseconds",
    csv=("planner_runtime.csv",), hosts={"planner_runtime.csv": ("85a8f3711adf44a8", "Intel Xeon (avx512, 2 cores)")})

NETWORKS = ("resnet18", "alexnet", "vgg11")
COLUMNS = ["graph", "depth", "layers", "free", "edges", "layouts", "method", "seconds", "status",
           "cost", "agrees"]


def conversion_seconds(shape: tuple[int, ...], src: str, dst: str) -> float:
    return math.prod(shape) * 4 / 10e9 + 5e-6


def network_problem(name: str, dataset: dict[tuple[str, str], float]):
    from maco.layouts import build_problem
    from maco.layouts.graph import trace_module
    from maco.layouts.networks import build, example_input

    gm, graph = trace_module(build(name), example_input())
    rng = random.Random(name)
    conv_seconds = {}
    for layer in graph.convs():
        spec = layer.spec
        conv_seconds[layer.name] = {
            lay: dataset.get((str(spec), lay), spec.flops / (rng.uniform(100, 400) * 1e9))
            for lay in ("NCHW", "NHWC")}
    problem, _ = build_problem(gm, graph, ["NCHW", "NHWC"], conv_seconds, conversion_seconds)
    return problem


def residual_problem(depth: int, layouts: list[str], seed: int):
    """A ResNet-like chain: `depth` conv layers in blocks of two, each block's input also feeding
    the add after it (a skip connection), with an NCHW-pinned input and output."""
    from maco.layouts.problem import LayoutProblem

    rng = random.Random(seed)
    layers, consumers, cost = ["input"], {}, {"input": {"NCHW": 0.0}}
    prev, block_in = "input", "input"
    for i in range(depth):
        name = f"conv{i}"
        layers.append(name)
        consumers.setdefault(prev, []).append(name)
        cost[name] = {lay: rng.uniform(1e-4, 1e-3) for lay in layouts}
        prev = name
        if i % 2 == 1:
            add = f"add{i}"
            layers.append(add)
            consumers.setdefault(prev, []).append(add)
            consumers.setdefault(block_in, []).append(add)
            cost[add] = {lay: 0.0 for lay in layouts}
            prev = block_in = add
    layers.append("output")
    consumers.setdefault(prev, []).append("output")
    cost["output"] = {"NCHW": 0.0}
    convert = {v: {(a, b): rng.uniform(2e-5, 2e-4) for a in layouts for b in layouts if a != b}
               for v in layers}
    return LayoutProblem(layers, consumers, cost, convert)


def run_methods(problem: Any, graph: str, depth: int | None, time_limit: float,
                skip_backtrack: bool) -> list[dict]:
    from maco.layouts.planners import solve
    from maco.layouts.problem import PlannerTimeout

    k = len(problem.layouts)
    methods = (["mincut"] if k == 2 else []) + ["milp", "backtrack"]
    common = dict(graph=graph, depth=depth if depth is not None else "", layers=len(problem.layers),
                  free=sum(len(problem.layer_cost[v]) > 1 for v in problem.layers),
                  edges=sum(len(us) for us in problem.consumers.values()), layouts=k)
    rows, costs = [], {}
    for method in methods:
        if method == "backtrack" and skip_backtrack:
            rows.append(dict(common, method=method, seconds="", status="skipped", cost="", agrees=""))
            continue
        start = time.perf_counter()
        try:
            sol = solve(problem, method, time_limit=time_limit)
            status, cost = "optimal", sol.cost
            costs[method] = cost
        except PlannerTimeout as exc:
            status, cost = "timeout", (exc.best.cost if exc.best else "")
        rows.append(dict(common, method=method, seconds=f"{time.perf_counter() - start:.6f}",
                         status=status, cost=f"{cost:.9g}" if cost != "" else "", agrees=""))
    agree = len({round(c, 12) for c in costs.values()}) <= 1 if costs else ""
    for row in rows:
        row["agrees"] = agree
    return rows


def load_dataset() -> dict[tuple[str, str], float]:
    try:
        from maco.layouts.dataset import load_rows

        return {(str(r.spec), r.layout): r.seconds for r in load_rows("results/dataset_cpu.csv")
                if r.device == "cpu"}
    except Exception:  # no data set here: synthetic costs only
        return {}


def measure(time_limit: float, max_depth: int) -> list[dict]:
    from tqdm import tqdm

    from maco.layouts.planners import solve
    from maco.layouts.problem import LayoutProblem

    solve(LayoutProblem(["a", "b"], {"a": ["b"]}, {"a": {"A": 1}, "b": {"A": 1, "B": 0}},
                        {"a": {("A", "B"): 1}}), "mincut")  # import networkx/scipy outside the clock
    solve(LayoutProblem(["a"], {}, {"a": {"A": 1, "B": 0, "C": 2}}), "milp")
    dataset = load_dataset()
    rows: list[dict] = []
    for name in tqdm(NETWORKS, desc="networks", unit="net"):
        rows += run_methods(network_problem(name, dataset), name, None, time_limit, False)
    depths = [d for d in (4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 64, 96, 128, 256, 512, 1024, 2048)
              if d <= max_depth]
    jobs = [(k, d) for k in (2, 3) for d in depths]
    given_up = set()
    for k, depth in tqdm(jobs, desc="random residual graphs", unit="graph"):
        layouts = ["NCHW", "NHWC", "NCHW16c"][:k]
        problem = residual_problem(depth, layouts, seed=depth * 10 + k)
        got = run_methods(problem, f"residual-{k}", depth, time_limit, k in given_up)
        if any(r["method"] == "backtrack" and r["status"] == "timeout" for r in got):
            given_up.add(k)  # deeper graphs only take longer: skip them
        rows += got
    return rows


def plot(rows: list[dict], path: Path, time_limit: float) -> None:
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    styles = {"mincut": "o-", "milp": "s-", "backtrack": "^-"}
    for k, dash in ((2, "-"), (3, ":")):
        for method, style in styles.items():
            pts = [(int(r["depth"]), float(r["seconds"])) for r in rows
                   if r["graph"] == f"residual-{k}" and r["method"] == method and r["status"] == "optimal"]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, style[:-1] + dash, label=f"{method}, {k} layouts")
            out = [int(r["depth"]) for r in rows if r["graph"] == f"residual-{k}" and r["method"] == method
                   and r["status"] == "timeout"]
            if out:
                ax.plot(out, [time_limit] * len(out), "rx", ms=10)
    ax.axhline(time_limit, color="r", lw=0.8, ls="--", label=f"time limit {time_limit:g} s (x: timed out)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("conv layers in a random residual graph")
    ax.set_ylabel("planner run time (s)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    nets = [r for r in rows if r["graph"] in NETWORKS]
    labels = list(dict.fromkeys(r["graph"] for r in nets))
    for j, method in enumerate(styles):
        vals = []
        for net in labels:
            r = next((r for r in nets if r["graph"] == net and r["method"] == method), None)
            vals.append(float(r["seconds"]) if r and r["seconds"] else 0.0)
        xs = [i + 0.27 * (j - 1) for i in range(len(labels))]
        bx.bar(xs, vals, 0.27, label=method)
        for x, net in zip(xs, labels):
            if any(r["graph"] == net and r["method"] == method and r["status"] == "timeout" for r in nets):
                bx.text(x, time_limit * 1.1, "timeout", ha="center", fontsize=7, color="r")
    bx.axhline(time_limit, color="r", lw=0.8, ls="--")
    bx.set_xticks(range(len(labels)), [f"{n}\n({next(r['layers'] for r in nets if r['graph'] == n)} nodes)"
                                       for n in labels])
    bx.set_yscale("log")
    bx.set_ylabel("planner run time (s)")
    bx.set_title("traced network graphs, 2 layouts")
    bx.legend(fontsize=8)
    fig.tight_layout()
    save_plot(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, quick="graphs up to 64 convs, 2 s cap")
    p.add_argument("--time-limit", type=float, default=None, help="cap per planner run (s; default 20, quick 2)")
    p.add_argument("--max-depth", type=int, default=None, help="deepest random graph (default 1024, quick 64)")
    args = p.parse_args(argv)
    if args.time_limit is None:
        args.time_limit = 2.0 if args.quick else 20.0
    if args.max_depth is None:
        args.max_depth = 64 if args.quick else 1024
    rows = measure(args.time_limit, args.max_depth)
    out = out_dir(args)
    write_csv(out / "planner_runtime.csv", rows, COLUMNS)
    plot(rows, out / "planner_runtime.png", args.time_limit)
    shown = ("graph", "depth", "layers", "free", "layouts", "method", "seconds", "status", "agrees")
    print_table("planner run time (s)", shown, [[r[c] for c in shown] for r in rows])
    print(f"wrote {out / 'planner_runtime.csv'} and {out / 'planner_runtime.png'}")
    return 0


def summarise(rows: list[dict[str, str]]) -> str:
    """REPORT.md: the exact planner's time per network, and where backtracking gives up."""
    nets = [f"{g} {1e3 * num(r, 'seconds'):.0f} ms" for g in ("resnet18", "alexnet", "vgg11")
            for r in rows if r["graph"] == g and r["method"] == "mincut"]
    text = "exact min cut on " + ", ".join(nets)
    back = {r["graph"]: r for r in rows if r["graph"] == "resnet18" and r["method"] == "backtrack"}
    if back:
        text += f" (backtracking on resnet18: {back['resnet18']['status']})"
    for graph in sorted({r["graph"] for r in rows if r["depth"]}):
        runs = [r for r in rows if r["graph"] == graph and r["method"] == "backtrack"]
        solved = [int(r["depth"]) for r in runs if r["status"] == "optimal"]
        timeout = [int(r["depth"]) for r in runs if r["status"] == "timeout"]
        text += (f"; {graph}: backtracking solves depth <= {max(solved, default=0)}" +
                 (f", times out at {min(timeout)}" if timeout else ""))
    agree = all(r["agrees"] == "True" for r in rows)
    return text + ("; every finished method agrees" if agree else "; METHODS DISAGREE")


if __name__ == "__main__":
    raise SystemExit(main())
