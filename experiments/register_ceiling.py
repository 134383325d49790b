"""How close can any direct-conv register tile get to the FMA peak on this CPU?

Times the register-tile instruction mix (maco.kernels.cpu_peak.microkernel_source: per input
channel, kv weight-vector loads and `points` input broadcasts feeding kv*points FMAs, every
operand in L1) for several tile shapes beside the bare FMA loop, in the same interleaved rounds,
and reports each shape's median per-round fraction of the FMA loop. A whole conv layer cannot
beat the best shape here, so this is the ceiling for "fraction of peak" targets on this host.
Also fits one number: the cycles each load adds beyond the FMAs' own time, from
fraction = (F/2) / (F/2 + c*L) with F FMAs and L loads per channel step (2 FMA pipes).

    python experiments/register_ceiling.py --out results [--rounds 8]
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from maco import Target
from maco.experiments.common import Figure, num, out_dir, parser, pyplot, save_plot, write_csv, write_env
from maco.kernels.cpu_codegen import ISA
from maco.kernels.cpu_peak import best_gflops, flops_runner

FIGURE = Figure(
    "ceiling", "(not in the paper) how close a direct-conv register tile's loads and FMAs get to the FMA "
    "peak on this CPU, the ceiling of every fraction-of-peak number", "each weight-vector load and input "
    "broadcast adds ~0.15 cycles beyond the FMAs on the Intel Xeon measured here; the ceiling is a "
    "property of a host (93-98% on an AMD Zen 5)", csv=("register_ceiling.csv",), quick=False)

# (weight vectors, input points): 24-28 accumulators; 4x7 needs 33 vector registers (gcc spills one)
SHAPES = [(1, 28), (2, 14), (2, 12), (3, 8), (4, 6), (6, 4), (4, 7)]


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--gflop", type=float, default=2.0, help="work per timed run, GFLOP")
    args = ap.parse_args(argv)
    target = Target.host()
    if target.isa not in ISA:
        print(f"this host's ISA {target.isa!r} has no intrinsics micro-kernel ({', '.join(ISA)})", file=sys.stderr)
        return 2
    if args.rounds < 1 or args.gflop <= 0:
        ap.error(f"--rounds must be >= 1 and --gflop > 0, got {args.rounds} and {args.gflop}")
    runners = {"fma": flops_runner(target, "fma")}
    runners.update({s: flops_runner(target, "microkernel", s) for s in SHAPES})
    flops = args.gflop * 1e9
    gflops: dict[object, list[float]] = {k: [] for k in runners}
    for r in range(args.rounds):
        for key, run in runners.items():
            gflops[key].append(best_gflops(run, flops, 3))
        print(f"round {r + 1}/{args.rounds}: FMA loop {gflops['fma'][-1]:.0f} GFLOP/s", flush=True)
    fma = np.array(gflops["fma"])
    nregs = target.level("registers").elements // target.simd_width
    rows = []
    for kv, points in SHAPES:
        frac = np.array(gflops[(kv, points)]) / fma
        fmas, loads = kv * points, kv + points
        rows.append(dict(weight_vectors=kv, points=points, accumulators=fmas, loads_per_step=loads,
                         fits_registers=fmas + kv + 1 <= nregs,  # accumulators, weights, one broadcast
                         gflops_median=round(float(np.median(gflops[(kv, points)])), 1),
                         fraction_of_fma=round(float(np.median(frac)), 4),
                         fraction_min=round(float(frac.min()), 4), fraction_max=round(float(frac.max()), 4)))
    fitting = [r for r in rows if r["fits_registers"]]
    per_load = np.median([(1 / r["fraction_of_fma"] - 1) * r["accumulators"] / 2 / r["loads_per_step"]
                          for r in fitting])
    out = out_dir(args)
    write_csv(out / "register_ceiling.csv", rows)
    write_env(out / "register_ceiling.csv", fma_loop_gflops_median=float(np.median(fma)),
              cycles_per_load_beyond_fmas=float(per_load))
    for r in rows:
        print(f"{r['weight_vectors']} x {r['points']:2d} ({r['accumulators']} acc, {r['loads_per_step']} loads"
              f"{'' if r['fits_registers'] else ', spills'}): {r['fraction_of_fma']:.1%} of the FMA loop "
              f"[{r['fraction_min']:.1%}, {r['fraction_max']:.1%}]")
    best = max(fitting, key=lambda r: r["fraction_of_fma"])
    print(f"best tile {best['weight_vectors']} x {best['points']}: {best['fraction_of_fma']:.1%} of the FMA loop; "
          f"each load adds ~{per_load:.2f} cycles beyond the FMAs")
    _plot(rows, out / "register_ceiling.png", target)
    return 0


def _plot(rows: list[dict], path: Path, target: Target) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['weight_vectors']}x{r['points']}" + ("" if r["fits_registers"] else "\n(spills)") for r in rows]
    ax.bar(labels, [r["fraction_of_fma"] for r in rows], color="tab:blue",
           yerr=[[r["fraction_of_fma"] - r["fraction_min"] for r in rows],
                 [r["fraction_max"] - r["fraction_of_fma"] for r in rows]], capsize=3)
    ax.set_ylim(0, 1.05)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(0.85, color="tab:red", lw=0.8, ls="--", label="85%: the default schedule's target on 3x3 layers")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_ylabel("fraction of the FMA loop")
    ax.set_xlabel("register tile: weight vectors x input points")
    ax.set_title(f"Register-tile mix vs FMA peak, same rounds ({target.model}, {target.cores} cores)", fontsize=9)
    fig.tight_layout()
    save_plot(fig, path)


def summarise(rows: list[dict[str, str]]) -> str:
    """REPORT.md: the best register tile's fraction of the FMA loop, and every tile's."""
    fits = [r for r in rows if r["fits_registers"] == "True"]
    best = max(fits, key=lambda r: num(r, "fraction_of_fma"))
    shapes = ", ".join(f"{r['weight_vectors']}x{r['points']} {num(r, 'fraction_of_fma'):.0%}" for r in fits)
    return (f"best register tile {best['weight_vectors']}x{best['points']}: {num(best, 'fraction_of_fma'):.1%} "
            f"of the FMA loop in the same rounds ({shapes})")


if __name__ == "__main__":
    sys.exit(main())
