"""`maco plan`: plan a layout per layer of a built-in network, print the per-layer table
(layout, predicted and measured seconds, conversions), and time the planned model against the
default NCHW one end to end with torch."""
from __future__ import annotations

import argparse
from typing import Any

from maco.commands.common import NETWORKS_TEXT, nonnegative_int, positive_float, positive_int, print_table
from maco.core.errors import MacoError
from maco.core.files import check_writable


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="plan NCHW/NHWC layouts for a network and time it end to end",
                       description="Trace a built-in network with torch.fx, plan a layout per layer "
                       "(conv latency measured with torch or predicted by a trained predictor, layout "
                       "conversions priced per tensor), print the per-layer plan, and time the planned "
                       "model against the default NCHW model end to end, interleaved.")
    p.add_argument("network", help=NETWORKS_TEXT)
    p.add_argument("--latency", choices=["measure", "predict"], default="measure",
                   help="where conv latencies come from (default measure)")
    p.add_argument("--predictor", default=None,
                   help="trained predictor directory (default $MACO_PREDICTOR, else the one shipped with MACO)")
    p.add_argument("--method", choices=["exact", "backtrack", "mincut", "milp"], default="exact",
                   help="planner (default exact: min cut for two layouts)")
    p.add_argument("--layouts", default="NCHW,NHWC", help="layouts to choose from (default NCHW,NHWC)")
    p.add_argument("--batch", type=positive_int, default=1, help="batch size (default 1)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--json", default=None, metavar="FILE", help="save the plan as JSON (atomically)")
    p.add_argument("--rounds", type=nonnegative_int, default=5,
                   help="interleaved end-to-end timing rounds (default 5; 0 skips the timing)")
    p.add_argument("--time-limit", type=positive_float, default=60.0,
                   help="planner time limit in seconds (default 60; backtracking can be exponential)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f}"


def _other_column(args: argparse.Namespace, convs: list[Any], specs: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The latencies the plan was not made from: predicted for a measured plan (when a trained
    predictor is at hand), measured for a predicted one."""
    from maco.layouts import load_predictor
    from maco.layouts.latency_sources import at_speed_now

    if args.latency == "measure":
        try:
            pred = at_speed_now(load_predictor(args.predictor))
        except MacoError:
            return {}
        pairs = [(layer.name, layer.layout) for layer in convs]
        secs = pred.predict_many([specs[n] for n, _ in pairs], [lay for _, lay in pairs])
        return {n: {lay: float(s)} for (n, lay), s in zip(pairs, secs)}
    from tqdm import tqdm

    from maco.layouts.latency import measure_layouts

    by_spec: dict[Any, dict[str, float]] = {}
    for spec in tqdm(list(dict.fromkeys(specs.values())), desc="measuring convs", unit="conv",
                     disable=args.no_progress, leave=False):
        by_spec[spec] = {lay: t.median for lay, t in
                         measure_layouts(spec, device=args.device, rounds=2, repeats=3).items()}
    return {n: by_spec[s] for n, s in specs.items()}


def run(args: argparse.Namespace) -> int:
    import torch

    from maco.layouts import compare_end_to_end, plan
    from maco.layouts.graph import trace
    from maco.layouts.networks import build, example_input

    from maco.layouts.latency import check_device

    if args.json:
        check_writable(args.json, "--json")
    device = check_device(args.device)
    model, x = build(args.network).to(device), example_input(args.batch).to(device)
    layouts = [v.strip() for v in args.layouts.split(",") if v.strip()]
    p = plan(model, x, layouts=layouts, latency=args.latency, predictor=args.predictor,
             method=args.method, progress=not args.no_progress, time_limit=args.time_limit)
    specs = {layer.name: layer.spec for layer in trace(model, x).convs() if layer.spec is not None}
    other = _other_column(args, p.convs, specs)
    rows = []
    for layer in p.layers:
        if layer.kind != "conv" and not layer.converts:
            continue
        mine = layer.seconds if layer.kind == "conv" else None
        theirs = other.get(layer.name, {}).get(layer.layout)
        predicted, measured = (theirs, mine) if args.latency == "measure" else (mine, theirs)
        converts = ", ".join(f"->{t} {_us(s)}us" for t, s in layer.converts.items())
        rows.append((layer.name, layer.kind, "x".join(map(str, layer.shape or [])), layer.layout,
                     _us(predicted), _us(measured), converts or ""))
    print_table(f"{args.network}: layout plan ({p.method}, latency {p.latency})",
                ["layer", "op", "out", "layout", "predicted us", "measured us", "conversions"], rows)
    n_nhwc = sum(layer.layout != "NCHW" for layer in p.convs)
    print(f"convs in a non-NCHW layout: {n_nhwc}/{len(p.convs)}; conversions: {len(p.conversions)}; "
          f"planner {p.planner_seconds * 1e3:.1f} ms")
    if p.default_cost:
        print(f"planned cost {p.cost * 1e3:.3f} ms vs all-NCHW {p.default_cost * 1e3:.3f} ms "
              f"(planner's estimate: {p.default_cost / p.cost:.2f}x)")
    if args.json:
        p.save(args.json)
        print(f"saved {args.json}")
    if args.rounds:
        planned = p.apply(model)
        e2e = compare_end_to_end(model, planned, x, rounds=args.rounds, progress=not args.no_progress)
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
        print(f"end to end (torch {torch.__version__}, {where}, "
              f"{args.rounds} interleaved rounds): default {e2e.default.median * 1e3:.2f} ms, "
              f"planned {e2e.planned.median * 1e3:.2f} ms, speedup {e2e.speedup:.2f}x "
              f"(rounds {min(e2e.ratios):.2f}-{max(e2e.ratios):.2f}); "
              f"max |output difference| {e2e.max_abs_diff:.2e}")
    return 0
