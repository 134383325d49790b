"""Figure 15: MACO's generated CUDA kernels against cuDNN on every conv layer of ResNet-18,
AlexNet and VGG-11, batch 1 and 8, NCHW and NHWC, strict fp32 (TF32 off).

Contenders per layer: cuDNN's default algorithm, cuDNN with cudnn.benchmark=True (its best),
MACO's default schedule (the model's first choice) and MACO searched (the fastest of the
model's top --candidates schedules, each measured; every one is checked against cuDNN's output
first). Times are medians of interleaved rounds of event-timed runs (maco.tune.gpu_measure); 'cold'
columns flush L2 before each launch. Writes fig15_kernels_gpu_<gpu>.csv / .png under --out.

    python experiments/fig15_kernels_gpu.py --out results
"""
from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from maco import ConvSpec, Target
from maco.core.schedule import UNROLL_STEPS
from maco.experiments.common import Figure, geomean, num, out_dir, parser, pyplot, save_plot, write_csv
from maco.tune.gpu_measure import CudnnConv, GpuTimer, cudnn_version
from maco.kernels import cuda_build
from maco.kernels.cuda import CudaKernel, candidates, prebuild
from maco.kernels.cuda_codegen import CudaPlan
from maco.layouts.networks import distinct_convs, network_convs

FIGURE = Figure(
    "fig15", "MACO kernels 2.24x faster than cuDNN on average", "strict fp32 on an H100 against cuDNN's "
    "best algorithm (benchmark mode); the paper's GPU and cuDNN version differ",
    csv=("fig15_summary*.csv",), gpu=True, quick=False)


def gpu_tag(name: str) -> str:
    m = re.search(r"(H100|H200|A100|L40S?|B200|V100|RTX ?\d+)", name, re.I)
    return (m.group(1) if m else name).lower().replace(" ", "")


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--networks", default="resnet18,alexnet,vgg11")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--layouts", default="NCHW,NHWC")
    ap.add_argument("--candidates", type=int, default=8, help="schedules measured per layer")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5, help="runs per contender per round")
    ap.add_argument("--unrolls", default="",
                    help="also measure every candidate at these unroll steps (e.g. 16: a shorter unrolled "
                         "body, for kernels whose warps stall on instruction fetch)")
    ap.add_argument("--cubin-dir", default=None, help="nvcc build cache (parallel prebuild)")
    ap.add_argument("--prebuild-only", metavar="ARCH", default=None,
                    help="only compile every candidate for ARCH (e.g. sm_90) into --cubin-dir, no GPU "
                         "needed: a GPU run then loads them instead of spending its time in nvcc")
    args = ap.parse_args(argv)
    target = Target.h100()
    configs: list[tuple[ConvSpec, str]] = []
    layers: dict[ConvSpec, list[tuple[str, int, str]]] = {}
    for net in args.networks.split(","):
        for batch in map(int, args.batches.split(",")):
            for spec, names in distinct_convs(network_convs(net, batch)):
                layers.setdefault(spec, []).extend((net, batch, n) for n in names)
    specs = list(layers)
    for spec in specs:
        for layout in args.layouts.split(","):
            configs.append((spec, layout))
    unrolls = [u.strip() for u in filter(None, args.unrolls.split(","))]
    if any(u not in map(str, UNROLL_STEPS) for u in unrolls):
        ap.error(f"--unrolls takes unroll steps from {UNROLL_STEPS}, got {args.unrolls!r}")
    unrolls = [int(u) for u in unrolls]
    plans = {}
    for cfg in configs:
        found = candidates(cfg[0], target, cfg[1], args.candidates)
        found += [replace(s, unroll=u) for u in unrolls for s in found if s.unroll != u]
        plans[cfg] = [CudaPlan(cfg[0], s) for s in found]
    t0 = time.time()
    if args.prebuild_only:
        if not args.cubin_dir:
            ap.error("--prebuild-only needs --cubin-dir")
        done = cuda_build.build([p for ps in plans.values() for p in ps], args.cubin_dir, args.prebuild_only)
        print(f"nvcc built {len(done)} kernels for {args.prebuild_only} in {time.time() - t0:.1f} s "
              f"into {args.cubin_dir}", flush=True)
        return 0
    out = out_dir(args)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    timer = GpuTimer()
    tag = gpu_tag(timer.name)
    peak = target.peak_gflops * 1e9
    print(f"GPU {timer.name} ({tag}), cuDNN {cudnn_version()}, torch {torch.__version__}, "
          f"fp32 peak {peak / 1e12:.1f} TFLOP/s", flush=True)
    built: dict = {}
    if cuda_build.find_nvcc():
        built = prebuild([p for ps in plans.values() for p in ps], args.cubin_dir)
        print(f"nvcc built {len(built)} kernels in {time.time() - t0:.1f} s", flush=True)

    rows = []
    cand_rows = []
    for ci, (spec, layout) in enumerate(configs):
        gen = torch.Generator(device="cuda").manual_seed(ci)
        x = torch.randn(spec.input_shape, device="cuda", generator=gen)
        w = torch.randn(spec.weight_shape, device="cuda", generator=gen) / math.sqrt(
            spec.c_per_group * spec.kh * spec.kw)
        fmt = torch.channels_last if layout == "NHWC" else torch.contiguous_format
        xl = x.contiguous(memory_format=fmt)
        contenders = {"cudnn_default": CudnnConv(spec, layout, False).prepare(x, w),
                      "cudnn_best": CudnnConv(spec, layout, True).prepare(x, w)}
        ref = contenders["cudnn_best"]().float()
        ref64 = torch.nn.functional.conv2d(x.double(), w.double(), None, spec.stride, spec.padding,
                                           spec.dilation, spec.groups)
        cudnn_err = float((ref.double() - ref64).norm() / ref64.norm())
        errs = {}
        for i, p in enumerate(plans[(spec, layout)]):
            conv = CudaKernel(p).bind(w)
            y = conv(xl)
            errs[i] = float((y.double() - ref64).norm() / ref64.norm())
            if not errs[i] < 1e-5:
                print(f"WRONG {spec} {layout} candidate {i}: rel err {errs[i]:.2e}", flush=True)
                continue
            yo = torch.empty_like(y)
            contenders[f"maco_{i}"] = conv.prepare(xl, out=yo)
        samples: dict[str, list[float]] = {k: [] for k in contenders}
        for _ in range(args.rounds):
            for name, fn in contenders.items():
                samples[name].append(timer.time(fn, repeats=args.repeats).median)
        med = {k: statistics.median(v) for k, v in samples.items()}
        for i, p in enumerate(plans[(spec, layout)]):
            b = built.get(p.source_hash)
            cand_rows.append(dict(spec=str(spec), layout=layout, candidate=i,
                                  us=med.get(f"maco_{i}", float("nan")) * 1e6, rel_err=errs.get(i),
                                  cudnn_best_us=med["cudnn_best"] * 1e6, blocks=p.blocks, threads=p.threads,
                                  registers=b.registers if b else "", spill=b.spill_bytes if b else "",
                                  schedule=p.schedule.to_json()))
        write_csv(out / f"fig15_candidates_{tag}.csv", cand_rows)
        maco = {k: v for k, v in med.items() if k.startswith("maco_")}
        best_key = min(maco, key=maco.get) if maco else None
        cold = {}
        for name in ("cudnn_best", "maco_0", best_key):
            if name in contenders and name not in cold:
                cold[name] = timer.time(contenders[name], repeats=7, cold=True).median
        best_plan = plans[(spec, layout)][int(best_key.split("_")[1])] if best_key else None
        info = built.get(best_plan.source_hash) if best_plan else None
        row = dict(spec=str(spec), layout=layout, batch=spec.n, gflop=spec.flops / 1e9,
                   cudnn_default_us=med["cudnn_default"] * 1e6, cudnn_best_us=med["cudnn_best"] * 1e6,
                   maco_default_us=med.get("maco_0", float("nan")) * 1e6,
                   maco_search_us=(maco[best_key] if best_key else float("nan")) * 1e6,
                   best_candidate=best_key, candidates=len(maco),
                   cold_cudnn_best_us=cold.get("cudnn_best", float("nan")) * 1e6,
                   cold_maco_default_us=cold.get("maco_0", float("nan")) * 1e6,
                   cold_maco_search_us=cold.get(best_key, float("nan")) * 1e6,
                   max_rel_err=max(errs.values()) if errs else float("nan"), cudnn_rel_err=cudnn_err,
                   registers=info.registers if info else "", blocks=best_plan.blocks if best_plan else "",
                   threads=best_plan.threads if best_plan else "",
                   schedule=best_plan.schedule.to_json() if best_plan else "")
        for key, base in (("default", "maco_default_us"), ("search", "maco_search_us")):
            row[f"speedup_{key}_vs_cudnn_best"] = row["cudnn_best_us"] / row[base]
            row[f"speedup_{key}_vs_cudnn_default"] = row["cudnn_default_us"] / row[base]
            row[f"peak_frac_{key}"] = spec.flops / (row[base] * 1e-6) / peak
        row["peak_frac_cudnn_best"] = spec.flops / (row["cudnn_best_us"] * 1e-6) / peak
        rows.append(row)
        write_csv(out / f"fig15_configs_{tag}.csv", rows)  # progress, per config
        print(f"[{ci + 1}/{len(configs)}] {spec} {layout}: cuDNN def {row['cudnn_default_us']:.1f} "
              f"best {row['cudnn_best_us']:.1f} | MACO def {row['maco_default_us']:.1f} "
              f"search {row['maco_search_us']:.1f} us ({row['speedup_search_vs_cudnn_best']:.2f}x, "
              f"{row['peak_frac_search'] * 100:.0f}% peak) err {row['max_rel_err']:.1e}", flush=True)

    # one row per conv layer of each network (layers sharing a spec share its numbers)
    by_cfg = {(r["spec"], r["layout"]): r for r in rows}
    layer_rows = []
    for spec, uses in layers.items():
        for net, batch, name in uses:
            for layout in args.layouts.split(","):
                r = by_cfg[(str(spec), layout)]
                layer_rows.append({"gpu": timer.name, "network": net, "layer": name, **r})
    write_csv(out / f"fig15_kernels_gpu_{tag}.csv", layer_rows)
    summary = []
    for net in args.networks.split(","):
        for batch in map(int, args.batches.split(",")):
            for layout in args.layouts.split(","):
                sel = [r for r in layer_rows if r["network"] == net and r["batch"] == batch
                       and r["layout"] == layout]
                summary.append(dict(network=net, batch=batch, layout=layout, layers=len(sel),
                                    default_vs_best=geomean([r["speedup_default_vs_cudnn_best"] for r in sel]),
                                    search_vs_best=geomean([r["speedup_search_vs_cudnn_best"] for r in sel]),
                                    search_vs_default=geomean([r["speedup_search_vs_cudnn_default"] for r in sel]),
                                    peak_search=statistics.mean(r["peak_frac_search"] for r in sel),
                                    peak_cudnn=statistics.mean(r["peak_frac_cudnn_best"] for r in sel)))
    for batch in map(int, args.batches.split(",")):
        sel = [r for r in layer_rows if r["batch"] == batch]
        summary.append(dict(network="all", batch=batch, layout="both", layers=len(sel),
                            default_vs_best=geomean([r["speedup_default_vs_cudnn_best"] for r in sel]),
                            search_vs_best=geomean([r["speedup_search_vs_cudnn_best"] for r in sel]),
                            search_vs_default=geomean([r["speedup_search_vs_cudnn_default"] for r in sel]),
                            peak_search=statistics.mean(r["peak_frac_search"] for r in sel),
                            peak_cudnn=statistics.mean(r["peak_frac_cudnn_best"] for r in sel)))
    write_csv(out / f"fig15_summary_{tag}.csv", summary)
    plot(layer_rows, args, out / f"fig15_kernels_gpu_{tag}.png", timer.name)
    print("\nGeomean speedup over cuDNN (strict fp32), per conv layer:")
    print(f"{'network':10s} {'batch':>5s} {'layout':6s} {'layers':>6s} {'def/best':>9s} "
          f"{'search/best':>11s} {'search/def':>10s} {'peak%':>6s} {'cudnn%':>6s}")
    for s in summary:
        print(f"{s['network']:10s} {s['batch']:5d} {s['layout']:6s} {s['layers']:6d} "
              f"{s['default_vs_best']:9.2f} {s['search_vs_best']:11.2f} {s['search_vs_default']:10.2f} "
              f"{s['peak_search'] * 100:6.1f} {s['peak_cudnn'] * 100:6.1f}")
    return 0


def plot(rows: list[dict], args: argparse.Namespace, path: Path, gpu: str) -> None:
    plt = pyplot()
    nets, batches = args.networks.split(","), [int(b) for b in args.batches.split(",")]
    fig, axes = plt.subplots(len(batches), len(nets), figsize=(6 * len(nets), 3.6 * len(batches)),
                             squeeze=False)
    for i, batch in enumerate(batches):
        for j, net in enumerate(nets):
            ax = axes[i][j]
            for k, layout in enumerate(args.layouts.split(",")):
                sel = [r for r in rows if r["network"] == net and r["batch"] == batch and r["layout"] == layout]
                xs = [m + k * 0.4 for m in range(len(sel))]
                ax.bar(xs, [r["speedup_search_vs_cudnn_best"] for r in sel], width=0.4, label=f"{layout} searched")
                ax.scatter(xs, [r["speedup_default_vs_cudnn_best"] for r in sel], s=10, color="k",
                           zorder=3, label="default" if k == 0 else None)
            ax.axhline(1.0, color="r", lw=0.8)
            ax.set_yscale("log")
            ax.set_title(f"{net}, batch {batch}")
            ax.set_xlabel("conv layer")
            ax.set_ylabel("speedup over cuDNN best")
            ax.legend(fontsize=7)
    fig.suptitle(f"MACO CUDA kernels vs cuDNN (strict fp32), {gpu}")
    fig.tight_layout()
    save_plot(fig, path)


def summarise(rows: list[dict[str, str]]) -> str:
    """REPORT.md: per batch, the geomean speedup over cuDNN's best over every layer and layout."""
    parts = []
    for r in rows:
        if r["network"] == "all":  # the geomean over every layer and layout of that batch
            parts.append(f"batch {r['batch']} ({r['layers']} (layer, layout) pairs): geomean over cuDNN's best "
                         f"{num(r, 'search_vs_best'):.2f}x (default schedule {num(r, 'default_vs_best'):.2f}x)")
    return "; ".join(parts) + " (strict fp32)"


if __name__ == "__main__":
    sys.exit(main())
