"""`maco bound`: I/O lower bounds of a conv, the optimal tile at every memory level, and how far
the tile's dataflow is from the bound."""
from __future__ import annotations

import argparse
import json
import re
from typing import Any

from maco.commands.common import positive_float, positive_int, print_table, resolve_layers
from maco.core.errors import MacoError
from maco.core.spec import ConvSpec
from maco.core.target import MemoryLevel, Target

SHAPE_FLAGS = ("c", "h", "w", "k")


def _int_or_pair(text: str) -> int | tuple[int, int]:
    m = re.fullmatch(r"(\d+)(?:x(\d+))?", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"expected N or HxW, got {text!r}")
    return int(m.group(1)) if m.group(2) is None else (int(m.group(1)), int(m.group(2)))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bound", help="I/O lower bounds, optimal tiles per memory level, dataflow I/O vs bound",
        description="Print the symbolic I/O lower bound of direct convolution (the paper's "
        "eq. 7/8), its value, and at every memory level the I/O-optimal output tile x*y*z "
        "(x along ow, y along oh, z filters), the exact loads + stores of the alpha=1 dataflow with "
        "that tile, and its ratio to the best valid lower bound. All sizes are fp32 elements; each "
        "level is taken at one processor's share S/Np. Give a network (one row per distinct "
        "layer), a layer spec, or the shape flags.",
        epilog="examples:  maco bound --c 64 --h 56 --w 56 --k 64 --kernel 3 --padding 1\n"
               "           maco bound resnet18 --target host\n"
               "           maco bound n1_c64_h56_w56_k64_r3_p1 --S 8192 --json\n"
               "           maco bound resnet50 --network          (the whole network's floor on this host)\n"
               "           maco bound resnet18 --network --peak 96 --bandwidth 20",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("layer", nargs="?", help="network name (resnet18, alexnet, vgg11, resnet50, "
                   "mobilenet_v2, efficientnet_b0, mobilenet_v3_large, convnext_tiny) or layer spec "
                   "such as n1_c64_h56_w56_k64_r3_p1")
    shape = p.add_argument_group("shape (instead of LAYER)")
    shape.add_argument("--c", type=positive_int, help="input channels")
    shape.add_argument("--h", type=positive_int, help="input height")
    shape.add_argument("--w", type=positive_int, help="input width")
    shape.add_argument("--k", type=positive_int, help="output channels (filters)")
    shape.add_argument("--kernel", type=_int_or_pair, default=3, help="kernel size, N or HxW (default 3)")
    shape.add_argument("--padding", type=_int_or_pair, default=0, help="zero padding, N or HxW (default 0)")
    shape.add_argument("--stride", type=_int_or_pair, default=1, help="stride, N or HxW (default 1)")
    shape.add_argument("--dilation", type=_int_or_pair, default=1, help="dilation, N or HxW (default 1)")
    shape.add_argument("--groups", type=positive_int, default=1, help="groups (default 1; = c for depthwise)")
    p.add_argument("--n", "--batch", dest="n", type=positive_int, default=1, help="batch size (default 1)")
    mem = p.add_mutually_exclusive_group()
    mem.add_argument("--S", dest="S", type=positive_int, help="one fast memory of S fp32 elements instead of a target")
    mem.add_argument("--target", default="host", help="memory hierarchy: host (this CPU, from the OS) "
                     "or h100 (default host)")
    p.add_argument("--np", dest="np", type=positive_int, default=1, help="processors sharing the --S memory (default 1)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    net = p.add_argument_group("network floor (--network)")
    net.add_argument("--network", action="store_true", help="the floor of the whole network NET at "
                     "batch --n (maco.bounds.network): the red-blue pebble game over its DAG with every "
                     "cache together as the fast memory (or --S) and DRAM as the slow one; per layer its "
                     "weights, activations, live set, flops of the cheapest algorithm and which floor "
                     "binds; the floor in time from the FMA peak and DRAM read bandwidth, measured now in "
                     "the same rounds unless --peak and --bandwidth are given")
    net.add_argument("--peak", type=positive_float, help="FMA peak in GFLOP/s instead of measuring it")
    net.add_argument("--bandwidth", type=positive_float, help="DRAM read bandwidth in GB/s instead of measuring it")
    net.add_argument("--rounds", type=positive_int, default=5, help="rounds of the measurement (default 5)")
    net.add_argument("--direct", action="store_true", help="count direct-conv flops only (no Winograd)")
    p.set_defaults(func=run)


def _layers(args: argparse.Namespace) -> list[tuple[str, ConvSpec]]:
    given = [f for f in SHAPE_FLAGS if getattr(args, f) is not None]
    if args.layer is not None:
        if given:
            raise MacoError(f"give either LAYER ({args.layer!r}) or the shape flags, not both "
                            f"(got --{', --'.join(given)})")
        return resolve_layers(args.layer, args.n)
    missing = [f"--{f}" for f in SHAPE_FLAGS if getattr(args, f) is None]
    if missing:
        raise MacoError(f"give a network, a layer spec, or all of --c --h --w --k (missing {' '.join(missing)})")
    kh, kw = args.kernel if isinstance(args.kernel, tuple) else (args.kernel, args.kernel)
    spec = ConvSpec(args.n, args.c, args.h, args.w, args.k, kh, kw, args.stride, args.padding,
                    args.dilation, args.groups)
    return [(str(spec), spec)]


def _levels(args: argparse.Namespace) -> tuple[str, list[MemoryLevel]]:
    if args.S is not None:
        return f"S = {args.S} elements", [MemoryLevel("S", args.S * 4, args.np, 1)]
    target = Target.named(args.target)
    return f"target {target.name} ({target.model})", list(target.levels)


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.3g}"


def _mb(elements: int | None) -> str:
    return "" if elements is None else f"{elements * 4 / 1e6:.3g}"


def _predicted_tiles(f: object, peak: float, bandwidth: float,
                     ceilings: dict[tuple[int, int], float] | None) -> dict[str, str]:
    from maco.bounds.network import tile_label, winograd_applies
    from maco.bounds.winograd import predict_tile

    out = {}
    for lf in f.layers:  # type: ignore[attr-defined]
        if lf.spec is not None and winograd_applies(lf.spec):
            m = predict_tile(lf.spec, peak, bandwidth, ceilings)[0]
            out[lf.name] = tile_label(m, lf.spec.kh)
    return out


def run_network(args: argparse.Namespace) -> int:
    """`maco bound NET --network`: the network floor, per layer and in total."""
    from maco.bounds.network import WINOGRAD_TILES, tile_label
    from maco.layouts.network_floor import fast_memory, floor_of
    from maco.layouts.networks import NETWORKS

    if args.layer not in NETWORKS:
        raise MacoError(f"--network needs a built-in network ({', '.join(NETWORKS)}), got {args.layer!r}")
    given = [f for f in SHAPE_FLAGS if getattr(args, f) is not None]
    if given:
        raise MacoError(f"--network takes a network, not the shape flags (got --{', --'.join(given)})")
    target = Target.named(args.target) if args.S is None else Target.host()
    S = args.S if args.S is not None else fast_memory(target)
    peak, bw, measured = _network_ceilings(args, target)
    f = floor_of(args.layer, target, args.n, peak * 1e9, bw * 1e9, S, {} if args.direct else WINOGRAD_TILES)
    where = (f"S = {S} elements ({S * 4 / 2**20:.3g} MiB: " +
             ("--S" if args.S is not None else f"every cache of {target.name} ({target.model})") + ")")
    # the tile sizes' shares of the peak, timed here where the peak is (given ceilings: ideal kernels)
    shares = None
    if measured and not args.direct:
        from maco.kernels.cpu_peak import winograd_ceilings
        shares = winograd_ceilings(target, args.rounds)
    tiles = {} if args.direct else _predicted_tiles(f, peak * 1e9, bw * 1e9, shares)
    s_core = args.S if args.S is not None else target.level_bytes("L2", 1 << 20) // 4
    blocks = _chains(args.layer, args.n, s_core, peak * 1e9, bw * 1e9)
    if args.json:
        print(json.dumps({"network": args.layer, "batch": args.n, "where": where, "peak_gflops": peak,
                          "read_gbs": bw, "measured": measured or None, "floor": f.to_dict(),
                          "winograd_tile_model": tiles,
                          "winograd_ceilings": {tile_label(m, r): e for (m, r), e in (shares or {}).items()},
                          "fused_blocks_S": s_core, "fused_blocks": blocks}, indent=1))
        return 0
    source = ("given" if not measured else
              f"the best this host has measured; now, in {int(measured['rounds'])} rounds: "
              f"{measured['fma_gflops']:.4g} GFLOP/s and {measured['read_gbs']:.4g} GB/s, spreads "
              f"{measured['fma_spread']:.2f} / {measured['read_spread']:.2f}"
              + (" (busy: figures low)" if max(measured["fma_spread"], measured["read_spread"]) > 1.3 else ""))
    ceiling_note = ("" if not shares else "; Winograd tile model: multiplies at " + ", ".join(
        f"{tile_label(m, r)} {100 * e:.0f}%" for (m, r), e in shares.items()) + " of the peak")
    _print_network(args.layer, f, tiles, f"{args.layer}, batch {args.n}: {where}; FMA peak {peak:.4g} GFLOP/s, "
                   f"DRAM reads {bw:.4g} GB/s ({source}){ceiling_note}")
    _print_chains(args.layer, blocks, s_core)
    return 0


def _chains(name: str, batch: int, S: int, peak: float, bandwidth: float) -> list[dict[str, Any]]:
    """The chain bound (maco.bounds.chain) of each fusable block of the network at S elements,
    its fused tile priced at the FMA peak and DRAM bandwidth (flop/s, bytes/s)."""
    from maco.bounds.chain import chain_bound, chains
    from maco.layouts.network_floor import network_dag

    if batch != 1:
        return []
    layers, _ = network_dag(name, batch)
    out = []
    for run in chains(layers):
        b = chain_bound([layer.spec for layer in run], S, [layer.name for layer in run], peak=peak,
                        bandwidth=bandwidth)
        out.append(dict(block=" + ".join(b.names), kind=b.kind, separate=b.q_separate, unfused=b.q_unfused,
                        fused_floor=b.q_fused_floor, tile=list(b.tile) if b.tile else None, tiled=b.q_tiled,
                        weights_resident=b.weights_resident, recompute_share=(b.recompute_flops / b.flops
                                                                              if b.tile else None),
                        saved_us=b.saved_s * 1e6 if b.saved_s is not None else None, pays=b.pays))
    return out


def _print_chains(name: str, blocks: list[dict[str, Any]], S: int) -> None:
    if not blocks:
        return
    rows = [(b["block"], b["kind"], _mb(b["separate"]), _mb(b["unfused"]), _mb(b["fused_floor"]),
             "x".join(map(str, b["tile"])) if b["tile"] else "none fits", _mb(b["tiled"]),
             {True: "yes", False: "per tile", None: "-"}[b["weights_resident"]],
             f"{100 * b['recompute_share']:.1f}" if b["recompute_share"] is not None else "-",
             f"{b['saved_us']:.1f}" if b["saved_us"] is not None else "-", "yes" if b["pays"] else "no")
            for b in blocks]
    print_table(f"{name}: fused blocks (maco.bounds.chain) at S = {S} elements ({S * 4 / 2**20:.3g} MiB, one "
                "core's L2 unless --S)", ["block", "convs", "separate MB", "unfused floor MB", "fused floor MB",
                                          "fused tile", "tiled MB", "weights kept", "recompute %", "saved us", "pays"], rows)
    print("separate: kernels that keep no intermediate on chip; unfused floor: any one-kernel-at-a-time "
          "schedule; fused floor: any schedule; fused tile: least traffic/bandwidth + recompute/peak; tiled: its "
          "traffic (achievable); recompute %: the halos' extra flops; saved: the traffic time it saves against "
          "separate kernels less its recompute time; pays: saved > 0")


def _network_ceilings(args: argparse.Namespace, target: Target) -> tuple[float, float, dict[str, float]]:
    """(FMA GFLOP/s, DRAM GB/s, what was measured): as given, else the best this CPU host has
    measured (kernels.cpu_peak.measure_ceilings, timed now in the same rounds)."""
    peak, bw = args.peak, args.bandwidth
    if peak is not None and bw is not None:
        return peak, bw, {}
    if target.kind != "cpu":
        raise MacoError(f"give --peak and --bandwidth for target {target.name}: only a CPU host is measured")
    from maco.kernels.cpu_peak import measure_ceilings

    measured = measure_ceilings(target, args.rounds)
    return (peak if peak is not None else measured["fma_gflops_best"],
            bw if bw is not None else measured["read_gbs_best"], measured)


def _print_network(name: str, f: Any, tiles: dict[str, int], header: str) -> None:
    """The floor's formula, `header`, its per-layer table and its totals."""
    from maco.bounds.network import derive_network

    d = derive_network()
    print(f"floor: t >= {d.t_floor}   Q_warm = {d.q_warm}, Q_cold = {d.q_cold}")
    print(header)
    rows = []
    for lf in f.layers:
        if lf.spec is None:
            continue
        rows.append((lf.name, str(lf.spec), _mb(lf.weights), _mb(lf.act_in), _mb(lf.act_out),
                     _mb(lf.live), "" if lf.resident is None else ("yes" if lf.resident else f"no: {_mb(lf.spill)} MB spill"),
                     lf.algorithm, tiles.get(lf.name, ""), f"{lf.flops / 1e6:.4g}", _ms(lf.t_compute),
                     _ms(lf.t_memory), lf.binds))
    print_table("per layer (MB of fp32; live: the activations held before it; its floors in ms, cold: "
                "its weights from DRAM)",
                ["layer", "spec", "weights MB", "in MB", "out MB", "live MB", "resident", "algorithm",
                 "tile model", "MFLOP", "compute ms", "memory ms", "binds"], rows)
    print("algorithm: the fewest multiplies MACO's kernels can do (the floor's); tile model: the "
          "Winograd tile of least modelled time, U from DRAM (maco.bounds.winograd, not a bound)")
    total = [
        ("weights (read once)", _mb(f.weights)), ("image + output", _mb(f.image + f.output)),
        ("largest live set", f"{_mb(f.max_live)} ({'fits' if f.max_live <= f.S else 'spills'} in S)"),
        ("live sets spilled (written + read)", _mb(2 * f.spill)),
        ("DRAM traffic floor, cold / warm (S kept from the last run)", f"{_mb(f.q_cold)} / {_mb(f.q_warm)}"),
        ("GFLOP direct / cheapest", f"{f.flops_direct / 1e9:.4g} / {f.flops / 1e9:.4g}"),
        ("compute floor ms (flops / peak)", _ms(f.t_compute)),
        ("memory floor ms, warm / cold (bytes / bandwidth)", f"{_ms(f.t_memory)} / {_ms(f.t_memory_cold)}"),
        ("network floor ms (memory overlapping compute)", f"{_ms(f.t)} ({f.binds} binds)"),
        ("sum of per-layer floors ms (no overlap across layers)", _ms(f.t_layers)),
    ]
    print_table(f"{name}: the network floor", ["name", "value"], total)


def run(args: argparse.Namespace) -> int:
    from maco.bounds import derive_conv

    if args.network:
        return run_network(args)
    from maco.bounds.report import analyse_levels

    layers = _layers(args)
    where, levels = _levels(args)
    d = derive_conv()
    symbolic = {"Q_lower": f"S*(|V|/T(2S) - 1), T(S) = {d.T}",
                "V": str(d.V), "leading": str(d.Q_leading),
                "dataflow": str(d.Q_dataflow),
                "conditions": [f"{c.lhs} = {c.rhs}" for c in d.conditions]}
    results = [(name, spec, analyse_levels(spec, levels)) for name, spec in layers]
    if args.json:
        print(json.dumps({"where": where, "symbolic": symbolic, "layers": [
            {"name": name, "spec": spec.to_dict(), "R": rows[0].bound.R,
             "levels": [r.to_dict() for r in rows]} for name, spec, rows in results]}, indent=1))
        return 0
    print(f"Q >= {symbolic['Q_lower']}")
    print(f"   ~ {symbolic['leading']}   (eq. 8, leading term)")
    print(f"dataflow: Q(x, y, z) = {symbolic['dataflow']}, least where "
          f"{', '.join(symbolic['conditions'])}")
    print("bounds in fp32 elements (loads + stores); best = max(eq. 7, compulsory, GEMM for 1x1)")
    for i, lvl in enumerate(levels):
        rows = []
        for name, spec, res in results:
            r = res[i]
            rows.append((name, str(spec), r.bound.R, r.bound.pebble, f"{r.bound.best:.4g} ({r.bound.best_kind})",
                         str(r.tile) + ("" if r.tile.fits else " (does not fit)"), r.footprint, r.io,
                         r.ratio, r.ratio_eq7))
        print_table(f"{where}, {lvl.name}: S/Np = {lvl.elements_per_processor} elements "
                    f"({lvl.capacity} bytes, {lvl.processors} processor(s))",
                    ["layer", "spec", "R", "eq.7 bound", "best bound", "tile x*y*z", "footprint",
                     "dataflow I/O", "I/O / best", "I/O / eq.7"], rows)
    return 0
