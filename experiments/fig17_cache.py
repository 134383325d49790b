"""Figure 17: L1 hit rate (Nsight Compute) of MACO's default CUDA kernels and cuDNN's on a few
conv layers, with the counters that explain the times (L2 hit rate, SM throughput, issue
activity, occupancy, warp stall reasons). Writes fig17_cache_<gpu>.csv / .png and the raw ncu
CSV under --out.

    python experiments/fig17_cache.py --out results        # runs itself under ncu

The worker warms every contender up first (cuDNN autotuning, compilation), then profiles one
launch of each between cudaProfilerStart/Stop; a marker kernel before each contender maps ncu's
kernel list back to (layer, contender), whatever number of kernels cuDNN launches.
"""
from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from maco.experiments.common import Figure, geomean, num, out_dir, parser, pyplot, save_plot, write_csv

FIGURE = Figure(
    "fig17", "MACO kernels hit L1 more often than cuDNN's", "MACO's CUDA kernels stage tiles through "
    "shared memory with cp.async, which bypasses L1: their reuse happens in shared memory (read with "
    "its own counters beside L1) and never counts as an L1 hit, while cuDNN's kernels read through L1", csv=("fig17_cache_*.csv",), gpu=True,
    quick=False)

LAYERS = ["n1_c64_h56_w56_k64_r3x3_p1", "n1_c128_h28_w28_k128_r3x3_p1", "n1_c256_h14_w14_k256_r3x3_p1",
          "n1_c512_h7_w7_k512_r3x3_p1", "n1_c256_h13_w13_k256_r3x3_p1", "n1_c3_h224_w224_k64_r3x3_p1",
          "n8_c256_h28_w28_k512_r3x3_p1", "n1_c64_h56_w56_k64_r3x3_p1@NHWC", "n8_c3_h224_w224_k64_r3x3_p1@NHWC",
          "n8_c3_h224_w224_k64_r3x3_p1"]  # spec[@layout], NCHW when no layout is given
METRICS = ["gpu__time_duration.sum", "l1tex__t_sector_hit_rate.pct", "lts__t_sector_hit_rate.pct",
           "sm__throughput.avg.pct_of_peak_sustained_elapsed",
           "sm__warps_active.avg.pct_of_peak_sustained_active",
           "smsp__issue_active.avg.pct_of_peak_sustained_active",
           "regex:sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
           "regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio",
           "launch__registers_per_thread", "launch__grid_size", "launch__block_size"]
# where MACO's reuse happens: shared memory (its wavefronts and bank conflicts) against the global
# sectors that fed it, by plain loads or cp.async (LDGSTS); regexes, so that a name this ncu lacks
# drops out instead of failing the run (without them the run is retried on METRICS alone)
SHARED = ["regex:l1tex__data_pipe_lsu_wavefronts_mem_shared_op_(ld|st)\\.sum",
          "regex:l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_(ld|st)\\.sum",
          "regex:smsp__inst_executed_op_(shared_ld|shared_st|ldgsts|global_ld)\\.sum",
          "regex:l1tex__t_sectors_pipe_lsu_mem_global_op_(ld|ldgsts)\\.sum"]
SHARED_LD = ("l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum")


def worker(layers: list[str]) -> None:
    import cupy
    import torch

    from maco import ConvSpec
    from maco.tune.gpu_measure import CudnnConv
    from maco.kernels.cuda import compile_cuda

    marker = cupy.RawKernel('extern "C" __global__ void maco_marker(int i) { }', "maco_marker")
    runs = []
    for item in layers:
        text, _, layout = item.partition("@")
        layout = layout or "NCHW"
        spec = ConvSpec.parse(text)
        x = torch.randn(spec.input_shape, device="cuda")
        w = torch.randn(spec.weight_shape, device="cuda")
        fmt = torch.channels_last if layout == "NHWC" else torch.contiguous_format
        conv = compile_cuda(spec, layout=layout).bind(w)
        maco = conv.prepare(x.contiguous(memory_format=fmt))
        cudnn = CudnnConv(spec, layout, True).prepare(x, w)
        for _ in range(5):
            maco()
            cudnn()
        runs += [(item, "maco", maco), (item, "cudnn", cudnn)]
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for i, (_, _, fn) in enumerate(runs):
        marker((1,), (1,), (cupy.int32(i),))
        fn()
    marker((1,), (1,), (cupy.int32(len(runs)),))
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("RUNS", ";".join(f"{t},{c}" for t, c, _ in runs))


def parse_raw(path: Path) -> list[dict[str, str]]:
    """ncu's raw page: a header of metric names, a row of units, then one row per kernel."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
    header, units = rows[start], rows[start + 1]
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
             "second": 1e6, "s": 1e6}
    out = []
    for r in rows[start + 2:]:
        if len(r) != len(header):
            continue
        d = dict(zip(header, r))
        for name, unit in zip(header, units):  # durations in us whatever unit ncu chose
            if name.startswith("gpu__time_duration") and unit in scale and d[name]:
                d[name] = str(float(d[name].replace(",", "")) * scale[unit])
        out.append(d)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args(argv)
    layers = args.layers.split(",")
    if args.worker:
        worker(layers)
        return 0
    ncu = shutil.which("ncu")
    if ncu is None:
        print("ncu (Nsight Compute) not found: fig17 needs it", file=sys.stderr)
        return 2
    out = out_dir(args)
    import torch

    name = torch.cuda.get_device_name(0)
    m = re.search(r"(H100|H200|A100|L40S?|B200|V100)", name, re.I)
    tag = (m.group(1) if m else re.sub(r"[^a-z0-9]", "", name.lower())[:12] or "gpu").lower()
    rep = out / "fig17_ncu"
    for metrics in (METRICS + SHARED, METRICS):
        cmd = [ncu, "--profile-from-start", "off", "--force-overwrite", "--export", str(rep)]
        cmd += ["--metrics", ",".join(metrics)]
        cmd += [sys.executable, __file__, "--worker", "--layers", args.layers]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
        runs_line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RUNS ")]
        if not proc.returncode and runs_line:
            break
        print(f"ncu failed with {len(metrics)} metrics:", proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
    else:
        return 1
    runs = [tuple(item.split(",")) for item in runs_line[0][5:].split(";")]
    raw = Path(f"{rep}_raw.csv")
    with open(raw, "w") as f:
        subprocess.run([ncu, "--import", f"{rep}.ncu-rep", "--csv", "--page", "raw"], stdout=f, check=True)
    kernels = parse_raw(raw)
    # assign kernels to contenders: everything after marker i and before marker i+1
    groups: dict[int, list[dict[str, str]]] = {}
    current = -1
    for k in kernels:
        if "maco_marker" in k.get("Kernel Name", ""):
            current += 1
            continue
        if 0 <= current < len(runs):
            groups.setdefault(current, []).append(k)
    rows: list[dict] = []
    for i, (layer, who) in enumerate(runs):
        ks = groups.get(i, [])
        dur = [float(k.get("gpu__time_duration.sum", "0").replace(",", "") or 0) for k in ks]
        total = sum(dur) or 1.0

        def wavg(metric: str) -> float:
            vals = [(float(k[metric].replace(",", "")), d) for k, d in zip(ks, dur)
                    if k.get(metric, "").replace(",", "").replace(".", "", 1).isdigit()]
            return sum(v * d for v, d in vals) / sum(d for _, d in vals) if vals else float("nan")

        row = {"layer": layer.split("@")[0], "layout": (layer.split("@") + ["NCHW"])[1], "impl": who,
               "kernels": len(ks), "names": "|".join(k.get("Kernel Name", "")[:60] for k in ks),
               "duration_us": total}
        for k in ks[:1]:
            for metric in k:
                if metric.startswith(("l1tex__", "lts__", "sm__", "smsp__", "launch__")):
                    row[metric] = wavg(metric)
        rows.append(row)
    keys = sorted({k for r in rows for k in r}, key=lambda k: (k not in rows[0], k))
    write_csv(out / f"fig17_cache_{tag}.csv", rows, keys)
    print(f"{'layer':37s} {'impl':6s} {'us':>7s} {'L1 hit%':>8s} {'L2 hit%':>8s} {'SM%':>6s} {'issue%':>7s} {'fma%':>6s}")
    for r in rows:
        print(f"{r['layer'] + ' ' + r['layout']:37s} {r['impl']:6s} {r['duration_us']:7.1f} "
              f"{r.get('l1tex__t_sector_hit_rate.pct', float('nan')):8.1f} "
              f"{r.get('lts__t_sector_hit_rate.pct', float('nan')):8.1f} "
              f"{r.get('sm__throughput.avg.pct_of_peak_sustained_elapsed', float('nan')):6.1f} "
              f"{r.get('smsp__issue_active.avg.pct_of_peak_sustained_active', float('nan')):7.1f} "
              f"{r.get('sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active', float('nan')):6.1f}")
    shared = [k for k in keys if k.endswith(".sum") and any(m in k for m in ("mem_shared", "ldgsts", "global_ld"))]
    if shared:  # the reuse L1 cannot see: shared wavefronts per global sector, and bank conflicts
        print("shared memory:", ", ".join(shared))
        for r in rows:
            print(f"  {r['layer'] + ' ' + r['layout']:37s} {r['impl']:6s} "
                  + " ".join(f"{k.split('__', 1)[1].replace('.sum', '')}={r.get(k, float('nan')):.3g}" for k in shared))
    stalls = sorted(k for k in keys if "issue_stalled" in k)
    for r in rows:
        if r["impl"] == "maco":
            top = sorted(((r.get(s, 0) or 0, s) for s in stalls), reverse=True)[:4]
            print(f"  stalls {r['layer']} {r['layout']}: " + ", ".join(
                f"{s.split('stalled_')[1].split('_per')[0]}={v:.2f}" for v, s in top))
    plot(rows, out / f"fig17_cache_{tag}.png", tag)
    return 0


def plot(rows: list[dict], path: Path, tag: str) -> None:
    plt = pyplot()
    layers = list(dict.fromkeys(f"{r['layer']}@{r['layout']}" for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(layers)), 3.8))
    for j, impl in enumerate(("maco", "cudnn")):
        vals = [next((r.get("l1tex__t_sector_hit_rate.pct", float("nan")) for r in rows
                      if f"{r['layer']}@{r['layout']}" == lay and r["impl"] == impl), float("nan"))
                for lay in layers]
        ax.bar([i + 0.4 * j for i in range(len(layers))], vals, width=0.4,
               label="MACO default" if impl == "maco" else "cuDNN best")
    ax.set_xticks([i + 0.2 for i in range(len(layers))])
    ax.set_xticklabels([lay.replace("_", "\n", 2).replace("@", "\n") for lay in layers], fontsize=7)
    ax.set_ylabel("L1 hit rate (%)")
    ax.set_title(f"L1 hit rate, strict fp32 ({tag}; ncu locks clocks to base)")
    ax.legend()
    fig.tight_layout()
    save_plot(fig, path)


def summarise(rows: list[dict[str, str]]) -> str:
    """REPORT.md: mean L1 hit rates of both, and MACO's kernel time over cuDNN's."""
    hit = {impl: [num(r, "l1tex__t_sector_hit_rate.pct") for r in rows if r["impl"] == impl]
           for impl in ("maco", "cudnn")}
    time_ = {impl: [num(r, "duration_us") for r in rows if r["impl"] == impl] for impl in ("maco", "cudnn")}
    if not hit["maco"] or not hit["cudnn"]:
        return f"{len(rows)} profiles"
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    text = (f"{len(hit['maco'])} layers: L1 hit rate MACO {mean(hit['maco']):.0f}% vs cuDNN "
            f"{mean(hit['cudnn']):.0f}% (mean); kernel time MACO/cuDNN geomean "
            f"{geomean([a / b for a, b in zip(time_['maco'], time_['cudnn'])]):.2f}")
    waves, conflicts = SHARED_LD
    if all(r.get(waves) not in (None, "") for r in rows):  # the shared-memory counters were read
        share = {impl: [num(r, conflicts) / max(num(r, waves), 1.0) for r in rows if r["impl"] == impl]
                 for impl in ("maco", "cudnn")}
        worst = max((r for r in rows if r["impl"] == "maco"), key=lambda r: num(r, conflicts) / max(num(r, waves), 1.0))
        text += (f"; shared-memory loads: bank-conflict share of wavefronts MACO {100 * mean(share['maco']):.0f}% vs "
                 f"cuDNN {100 * mean(share['cudnn']):.0f}% (mean), MACO's worst {worst['layer']} "
                 f"{100 * num(worst, conflicts) / max(num(worst, waves), 1.0):.0f}%")
    return text


if __name__ == "__main__":
    sys.exit(main())
