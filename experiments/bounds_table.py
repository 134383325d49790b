"""I/O lower bound vs the optimal tile's dataflow I/O for every conv layer of ResNet-18, AlexNet
and VGG-11 at the host's L1 and L2 (issue 2, section 4), and the network floor of whole networks
at batch 1 beside engines' measured times (issue 40).

    python experiments/bounds_table.py [--batch 1] [--levels L1 L2] [--out results]
        [--floor-networks resnet18,resnet50,mobilenet_v2] [--engines channels_last,maco]
        [--maco-model resnet18=FILE.maco ...] [--floor | --floor-only]

Writes results/bounds_table.csv (one row per layer and level) and bounds_table.png, and prints
the min / median / max ratio per level: dataflow I/O over the best valid bound, and over the
paper's eq. (7) alone. Sizes are fp32 elements; each level is taken at one processor's S/Np.

Network rows (--floor; bounds_network.csv, its .env.json, which names the host, and a plot,
bounds_network.png): the floor of maco.bounds.network with this host's FMA peak and DRAM read
bandwidth measured now in the same rounds (the floor takes the best this host has measured,
fma_gflops and read_gbs; *_now beside); beside it the reach of MACO's kernel families at their
ceilings (maco.bounds.winograd's network_reach: direct at the peak, Winograd and depthwise at the
shares winograd_ceilings and depthwise_ceiling time here, one layer at a time, reach_of_floor), and
each engine's measured time over it (maco.deploy.engines' workers: torch eager NCHW always, beside
every engine of --engines; the median of rounds alternating with eager). MACO is timed from a model
maco.save wrote on this host (--maco-model NET=FILE), or, with "maco" in --engines, one `maco
optimize --budget quick` tunes here first (minutes per network). Run the script under the host's
timing lock (flock); its workers take none themselves.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

from tqdm import tqdm

from maco.bounds.report import analyse_levels
from maco.experiments.common import Figure, num, out_dir, parser, pyplot, save_plot, write_csv, write_env
from maco.layouts.networks import network_convs
from maco.core.target import Target

FIGURE = Figure(
    "bounds", "eq. (8): Q >= kh*kw*C*Ho*Wo*K / (4*sqrt(2*R*S)); optimal tiles x*y = R*z, "
    "x*y*z = S/Np", "exact arithmetic, no measurement: a ratio above 1 is the price of integer, "
    "edge-clipped tiles against a bound that allows any schedule; the network floor (not in the "
    "paper) is measured per host", csv=("bounds_table.csv", "bounds_network.csv", "bounds_network_zen5.csv"), quick=False,
    hosts={"bounds_table.csv": ("1e18664238be84b1", "Intel Xeon (avx512, 2 cores)")})

NETWORKS = ("resnet18", "alexnet", "vgg11")
FLOOR_NETWORKS = "resnet18,resnet50,mobilenet_v2"
NET_COLUMNS = ["network", "engine", "floor_ms", "binds", "compute_ms", "memory_ms", "memory_cold_ms",
               "layers_sum_ms", "engine_ms", "of_floor", "eager_ms", "eager_of_floor", "gflop", "gflop_direct",
               "weights_mb", "max_live_mb", "spill_mb", "S_mib", "fma_gflops", "read_gbs", "fma_gflops_now",
               "read_gbs_now", "fma_spread", "read_spread", "reach_ms", "reach_of_floor", "ceiling_f2x3",
               "ceiling_f4x3", "ceiling_depthwise", "rounds", "note"]
COLUMNS = ["network", "layer", "spec", "level", "S", "processors", "R", "bound_eq7", "bound_best",
           "best_kind", "compulsory", "gemm_leading", "tile_x", "tile_y", "tile_z", "tile_fits",
           "footprint", "dataflow_io", "ratio_best", "ratio_eq7", "cont_x", "cont_y", "cont_z"]


def rows(batch: int, level_names: list[str]) -> list[dict[str, object]]:
    target = Target.host()
    levels = [target.level(name) for name in level_names]
    layers = [(net, name, spec) for net in NETWORKS for name, spec in network_convs(net, batch)]
    out = []
    for net, name, spec in tqdm(layers, desc="bounds", unit="layer"):
        for r in analyse_levels(spec, levels):
            cont = r.tile.continuous or (float("nan"),) * 3
            out.append({"network": net, "layer": name, "spec": str(spec), "level": r.level,
                        "S": r.S, "processors": r.processors, "R": r.bound.R,
                        "bound_eq7": round(r.bound.pebble, 1), "bound_best": round(r.bound.best, 1),
                        "best_kind": r.bound.best_kind, "compulsory": r.bound.compulsory,
                        "gemm_leading": "" if r.bound.gemm_leading is None else round(r.bound.gemm_leading, 1),
                        "tile_x": r.tile.x, "tile_y": r.tile.y, "tile_z": r.tile.z,
                        "tile_fits": r.tile.fits, "footprint": r.footprint, "dataflow_io": r.io,
                        "ratio_best": round(r.ratio, 4),
                        "ratio_eq7": round(r.ratio_eq7, 4) if r.bound.pebble > 0 else "",
                        "cont_x": round(cont[0], 2), "cont_y": round(cont[1], 2), "cont_z": round(cont[2], 2)})
    return out


def summary(data: list[dict[str, object]], level_names: list[str]) -> list[str]:
    lines = []
    for level in level_names:
        for key, label in (("ratio_best", "I/O / best bound"), ("ratio_eq7", "I/O / eq.(7)")):
            vals = [float(r[key]) for r in data if r["level"] == level and r[key] != ""]
            if vals:
                lines.append(f"{level:>3} {label:<17} min {min(vals):8.3f}  median "
                             f"{statistics.median(vals):8.3f}  max {max(vals):8.3f}  ({len(vals)} layers)")
        kinds = [str(r["best_kind"]) for r in data if r["level"] == level]
        lines.append(f"{level:>3} best bound is " + ", ".join(f"{k} for {kinds.count(k)}"
                                                              for k in sorted(set(kinds))))
    return lines


def plot(path: Path, data: list[dict[str, object]], level_names: list[str]) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(len(level_names), 1, figsize=(12, 3.2 * len(level_names)), squeeze=False)
    for ax, level in zip(axes[:, 0], level_names):
        sel = [r for r in data if r["level"] == level]
        xs = range(len(sel))
        ax.bar(xs, [float(r["ratio_best"]) for r in sel], label="I/O / best bound")
        ax.plot(xs, [float(r["ratio_eq7"]) if r["ratio_eq7"] != "" else float("nan") for r in sel],
                "k.", label="I/O / eq.(7)")
        ax.set_yscale("log")
        ax.set_xticks(list(xs), [f"{r['network']}:{r['layer']}" for r in sel], rotation=90, fontsize=6)
        ax.set_ylabel("ratio")
        ax.set_title(f"host {level}: S = {sel[0]['S']} elements")
        ax.axhline(1.0, color="gray", lw=0.5)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_plot(fig, path)


def plot_network(path: Path, rows: list[dict[str, object]]) -> None:
    """Each engine's time over the network floor, a group of bars per network, with the reach of
    MACO's kernel families and 1.5x the floor marked. Each bar is labelled with the engine's
    speedup over torch eager in its own process: engines run one after another, and on a shared
    host the spells they run in can differ more than the engines do."""
    plt = pyplot()
    nets = list(dict.fromkeys(str(r["network"]) for r in rows))
    engines = list(dict.fromkeys(str(r["engine"]) for r in rows if r["engine"] != "floor" and r.get("of_floor")))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.5 * len(nets)), 4.2))
    width = 0.8 / max(1, len(engines))
    for i, engine in enumerate(engines):
        timed = {str(r["network"]): r for r in rows if r["engine"] == engine and r.get("of_floor")}
        xs = [j + (i - (len(engines) - 1) / 2) * width for j in range(len(nets))]
        heights = [float(timed[n]["of_floor"]) if n in timed else float("nan") for n in nets]
        ax.bar(xs, heights, width, label=engine)
        for x, h, n in zip(xs, heights, nets):  # each engine ran in its own spell of the machine: its eager speedup
            if n in timed and timed[n].get("eager_ms"):
                speedup = float(timed[n]["eager_ms"]) / float(timed[n]["engine_ms"])
                ax.text(x, h, f" {speedup:.2f}x", rotation=90, ha="center", va="bottom", fontsize=6)
    floors = {str(r["network"]): r for r in rows if r["engine"] == "floor"}
    reach = [float(floors[n]["reach_of_floor"]) if n in floors and floors[n].get("reach_of_floor") else float("nan")
             for n in nets]
    ax.plot(range(len(nets)), reach, "k_", markersize=28, mew=2, label="MACO's kernel families at their ceilings")
    ax.axhline(1.0, color="black", lw=1)
    ax.axhline(1.5, color="gray", lw=1, ls="--", label="1.5x the floor")
    ax.set_xticks(range(len(nets)), nets, rotation=20, fontsize=8)
    ax.set_ylabel("time / network floor")
    top = max([float(r["of_floor"]) for r in rows if r["engine"] != "floor" and r.get("of_floor")] + [1.5])
    ax.set_ylim(0, 1.3 * top)  # room for the labels and the legend
    ax.set_title("batch-1 inference against the network floor (maco.bounds.network)", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    save_plot(fig, path)


def network_rows(nets: list[str], engines: list[str], maco_models: dict[str, str], rounds: int,
                 batch: int = 1) -> list[dict[str, object]]:
    """One row per (network, engine): the floor on this host and the engine's time over it."""
    from maco.bounds.winograd import network_reach
    from maco.deploy.engines import Job, run_engine
    from maco.kernels.cpu_peak import depthwise_ceiling, measure_ceilings, winograd_ceilings
    from maco.layouts.network_floor import floor_of, network_dag

    target = Target.host()
    shares = winograd_ceilings(target, 5)  # once: MACO's Winograd and depthwise kernels' shares of the peak here
    depthwise = depthwise_ceiling(target, 5)
    out: list[dict[str, object]] = []
    for net in nets:
        ceil = measure_ceilings(target, 5)  # per network: the floor of the moment its engines run in
        peak, bandwidth = ceil["fma_gflops_best"] * 1e9, ceil["read_gbs_best"] * 1e9
        f = floor_of(net, target, batch, peak, bandwidth)
        reach = network_reach(network_dag(net, batch)[0], peak, bandwidth, shares, depthwise_share=depthwise)
        base = {"network": net, "floor_ms": round(f.t * 1e3, 3), "binds": f.binds,
                "compute_ms": round(f.t_compute * 1e3, 3), "memory_ms": round(f.t_memory * 1e3, 3),
                "memory_cold_ms": round(f.t_memory_cold * 1e3, 3), "layers_sum_ms": round(f.t_layers * 1e3, 3),
                "gflop": round(f.flops / 1e9, 4), "gflop_direct": round(f.flops_direct / 1e9, 4),
                "weights_mb": round(f.weights * 4 / 1e6, 2), "max_live_mb": round(f.max_live * 4 / 1e6, 3),
                "spill_mb": round(f.spill * 4 / 1e6, 3), "S_mib": round(f.S * 4 / 2**20, 2),
                "fma_gflops": round(ceil["fma_gflops_best"], 2), "read_gbs": round(ceil["read_gbs_best"], 2),
                "fma_gflops_now": round(ceil["fma_gflops"], 2), "read_gbs_now": round(ceil["read_gbs"], 2),
                "fma_spread": round(ceil["fma_spread"], 3), "read_spread": round(ceil["read_spread"], 3),
                "reach_ms": round(reach * 1e3, 3), "reach_of_floor": round(reach / f.t, 3),
                "ceiling_f2x3": round(shares.get((2, 3), float("nan")), 3),
                "ceiling_f4x3": round(shares.get((4, 3), float("nan")), 3),
                "ceiling_depthwise": round(depthwise, 3)}
        out.append(dict(base, engine="floor", note="the network floor (maco.bounds.network)"))
        for engine in engines:
            job = Job(net, input_shape=(batch, 3, 224, 224), rounds=rounds, patience=10.0)
            if engine == "maco":
                if net in maco_models:
                    job.saved = maco_models[net]
                    note = f"maco.load of {maco_models[net]}"
                else:
                    try:
                        note = _tune_maco(net, job)
                    except Exception as exc:  # noqa: BLE001 -- a failing engine is a row, not a crash
                        out.append(dict(base, engine=engine, note=f"maco optimize failed: {exc}"[:300]))
                        continue
            else:
                note = ""
            print(f"{net} / {engine} ...", flush=True)
            got = run_engine(engine, job)
            row = dict(base, engine=engine, note="; ".join(x for x in (note, str(got.get("note", ""))) if x))
            if got.get("engine_ms"):
                row.update(engine_ms=round(got["engine_ms"], 3), of_floor=round(got["engine_ms"] / 1e3 / f.t, 3),
                           eager_ms=round(got["eager_ms"], 3), eager_of_floor=round(got["eager_ms"] / 1e3 / f.t, 3),
                           rounds=got.get("rounds", ""))
            out.append(row)
    return out


_TUNED: list[object] = []


def _tune_maco(net: str, job: object) -> str:
    """`maco optimize --budget quick` for `net` here, its model saved in a temporary folder kept
    for this run; sets job.saved."""
    import contextlib
    import tempfile

    from maco.deploy.optimize import optimize

    tmp = tempfile.TemporaryDirectory(prefix="bounds_network_")
    _TUNED.append(tmp)
    path = Path(tmp.name)
    with contextlib.redirect_stdout(sys.stderr):
        result = optimize(net, budget="quick", out=path / "out", records=path / "records.jsonl",
                          save=path / "model.maco", log=lambda line: print(line, file=sys.stderr))
    job.saved = str(path / "model.maco")  # type: ignore[attr-defined]
    return f"maco optimize --budget quick handed back '{result.chosen}'"


def _maco_models(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        net, sep, path = item.partition("=")
        if not sep or not Path(path).is_file():
            raise SystemExit(f"--maco-model takes NET=FILE with an existing file, got {item!r}")
        out[net] = path
    return out


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    ap.add_argument("--levels", nargs="+", default=["L1", "L2"], help="host memory levels (default L1 L2)")
    ap.add_argument("--floor-networks", default=FLOOR_NETWORKS, help=f"networks of the floor rows (default {FLOOR_NETWORKS})")
    ap.add_argument("--engines", default="channels_last", help="engines timed beside torch eager against the floor "
                    "(maco.deploy.engines; default channels_last; 'maco' tunes first unless --maco-model, "
                    "which adds it)")
    ap.add_argument("--maco-model", nargs="*", default=[], help="NET=FILE: a model maco.save wrote on this host")
    ap.add_argument("--rounds", type=int, default=5, help="timing rounds per engine (default 5)")
    ap.add_argument("--floor", action="store_true", help="add the network rows (timed: run under the host's lock)")
    ap.add_argument("--floor-only", action="store_true", help="the network rows only")
    args = ap.parse_args(argv)
    out = out_dir(args)
    if args.floor or args.floor_only:
        nets = [n for n in args.floor_networks.split(",") if n]
        engines = [e for e in args.engines.split(",") if e]
        maco_models = _maco_models(args.maco_model)
        if maco_models and "maco" not in engines:
            engines.append("maco")  # a saved model given is a model to time
        net_rows = network_rows(nets, engines, maco_models, args.rounds, args.batch)
        suffix = "" if args.batch == 1 else f"_n{args.batch}"
        net_csv = out / f"bounds_network{suffix}.csv"
        write_csv(net_csv, net_rows, NET_COLUMNS)
        write_env(net_csv, networks=nets, engines=engines, batch=args.batch)
        plot_network(net_csv.with_suffix(".png"), net_rows)
        print("\n".join(network_summary(net_rows)))
        print(f"wrote {net_csv} ({len(net_rows)} rows) and {net_csv.with_suffix('.png')}")
        if args.floor_only:
            return 0
    data = rows(args.batch, args.levels)
    suffix = "" if args.batch == 1 else f"_n{args.batch}"
    csv_path = out / f"bounds_table{suffix}.csv"
    write_csv(csv_path, data, COLUMNS)
    plot(out / f"bounds_table{suffix}.png", data, args.levels)
    print("\n".join(summary(data, args.levels)))
    print(f"wrote {csv_path} ({len(data)} rows) and {csv_path.with_suffix('.png')}")
    return 0


def network_summary(rows: list[dict[str, object]]) -> list[str]:
    lines = []
    for r in rows:
        if r["engine"] == "floor":
            lines.append(f"{r['network']}: floor {r['floor_ms']} ms ({r['binds']} binds: compute {r['compute_ms']} ms "
                         f"at {r['fma_gflops']} GFLOP/s, memory {r['memory_ms']} ms warm / {r['memory_cold_ms']} cold at "
                         f"{r['read_gbs']} GB/s; {r['gflop']} GFLOP of {r['gflop_direct']} direct, "
                         f"{r['weights_mb']} MB weights, largest live set {r['max_live_mb']} MB); MACO's kernel "
                         f"families at their ceilings {r['reach_ms']} ms = {r['reach_of_floor']}x (direct at the "
                         f"peak, F(2x2) at {r['ceiling_f2x3']} of it, F(4x4) at {r['ceiling_f4x3']}"
                         + (f", depthwise at {r['ceiling_depthwise']}" if r.get("ceiling_depthwise") else "") + ")")
        elif r.get("engine_ms"):
            lines.append(f"  {r['engine']}: {r['engine_ms']} ms = {r['of_floor']}x the floor; torch eager "
                         f"{r['eager_ms']} ms = {r['eager_of_floor']}x")
        else:
            lines.append(f"  {r['engine']}: no time ({r.get('note', '')})")
    return lines


def summarise(rows: list[dict[str, str]]) -> str:
    """REPORT.md: the spread of dataflow I/O over the best bound, per memory level; for the
    network rows, each network's floor and each engine's time over it."""
    if rows and "floor_ms" in rows[0]:
        parts = []
        for r in rows:
            if r["engine"] == "floor":
                reach = f", kernels at their ceilings {num(r, 'reach_of_floor'):.2f}x" if r.get("reach_of_floor") else ""
                parts.append(f"{r['network']} floor {num(r, 'floor_ms'):.3g} ms ({r['binds']} binds{reach})")
            elif r.get("of_floor"):
                parts.append(f"{r['network']} {r['engine']} {num(r, 'of_floor'):.2f}x the floor, "
                             f"eager {num(r, 'eager_of_floor'):.2f}x")
        return "network floor at batch 1: " + "; ".join(parts)
    ratios = {lvl: sorted(num(r, "ratio_best") for r in rows if r["level"] == lvl) for lvl in ("L1", "L2")}
    parts = [f"{lvl}: dataflow I/O of the chosen tile / best lower bound min {v[0]:.2f}, median "
             f"{v[len(v) // 2]:.2f}, max {v[-1]:.2f}" for lvl, v in ratios.items() if v]
    return f"{len(rows)} (layer, level) pairs; " + "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
