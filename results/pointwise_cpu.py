"""The 1x1 convs of ResNet-50 and MobileNetV2 (issue 38; --kernels all: every conv of groups 1): MACO's NHWC kernel on its default
schedule against torch's channels_last conv (oneDNN), warm and with the caches evicted before
each call (the weights then come from memory, as inside a model whose weights outgrow the
caches), and the register-tile variants named by --tiles.

One process, torch threads = cores, glibc's steady allocator; all labels of a layer timed in the
same interleaved rounds (maco.core.timing.interleaved_rounds); statistic: the median over rounds
of each round's fastest call; GFLOP/s from it.

    flock /tmp/maco-timing.lock python results/pointwise_cpu.py [--networks resnet50,mobilenet_v2]
        [--rounds 5] [--tiles k16xow7,k8xow7]
"""
from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from maco import Target, kernels
from maco.core.timing import CacheEvictor, interleaved_rounds, steady_allocator
from maco.kernels import cpu_default
from maco.layouts.networks import distinct_convs, network_convs


def with_tile(spec: Any, target: Target, tile: dict[str, int]) -> Any | None:
    """The default NHWC schedule with its register tile forced to `tile` (None: no such tile)."""
    real = cpu_default._register_tiles

    def only(spec_, target_, layout_):
        return [t for t in real(spec_, target_, layout_) if t[1] == tile]
    cpu_default._register_tiles = only
    try:
        return kernels.default_schedule(spec, target, "NHWC") if only(spec, target, "NHWC") else None
    finally:
        cpu_default._register_tiles = real


def _with_reserve(reserve: int, make: Any) -> Any:
    """make() with `reserve` vector registers kept free of accumulators on every ISA."""
    from maco.core import sketch_cpu
    before = sketch_cpu.REGISTER_RESERVE, sketch_cpu.REGISTER_RESERVE_16
    sketch_cpu.REGISTER_RESERVE = sketch_cpu.REGISTER_RESERVE_16 = reserve
    try:
        return make()
    finally:
        sketch_cpu.REGISTER_RESERVE, sketch_cpu.REGISTER_RESERVE_16 = before


def whole(args: argparse.Namespace, target: Target) -> None:
    """Each network whole: eager, channels_last, and the every-conv MACO model under each reserve."""
    from maco.deploy.kernel_choice import kernels_everywhere
    from maco.layouts.end_to_end import time_models
    from maco.layouts.networks import build, example_input
    from maco.layouts.segments import use_segments

    x = example_input(1)
    for net in args.whole.split(","):
        model = build(net)
        models = {"eager": model, "channels_last": _channels_last(model)}
        for reserve in (args.reserve, args.against_reserve):
            if reserve is None:
                continue
            gm, _ = _with_reserve(reserve, lambda: kernels_everywhere(model, x, target))
            if args.with_winograd:  # and its copy with Winograd where it wins in the model (the pipeline's)
                from maco.deploy.kernel_choice import faster_winograd
                wg, _ = _with_reserve(reserve, lambda: kernels_everywhere(model, x, target))
                won = _with_reserve(reserve, lambda: faster_winograd(wg, x, target))
                print(f"{net}: Winograd won on {sum(r >= 1.02 for r in won.values())} of {len(won)} convs", flush=True)
                use_segments(wg, target)
                models[f"maco reserve {reserve} + winograd"] = wg
            use_segments(gm, target)
            models[f"maco reserve {reserve}"] = gm
        times = time_models(models, x, rounds=args.rounds)
        print(f"{net}: " + ", ".join(f"{label} {times.timing(label).median * 1e3:.2f} ms "
                                     f"({times.speedup(label):.2f}x eager)" for label in models), flush=True)
        for label in models:
            if label.startswith("maco"):
                others = [o for o in models if o.startswith("maco") and o != label]
                for o in others:
                    print(f"  {label} over {o}: {times.speedup(label, o):.3f}x (median of per-round ratios)")


def winograd_rows(args: argparse.Namespace, target: Target) -> None:
    """The Winograd kernel's register rows (tiles x filter vectors accumulated), per layer and tile size."""
    from maco.kernels import winograd

    seen = set()
    for net in args.networks.split(","):
        for spec, _ in distinct_convs(network_convs(net, 1)):
            if spec in seen or not winograd.winograd_can_run(spec, target.simd_width):
                continue
            seen.add(spec)
            g = torch.Generator().manual_seed(0)
            x = torch.randn(spec.input_shape, generator=g).contiguous(memory_format=torch.channels_last)
            w = torch.randn(spec.weight_shape, generator=g)
            with torch.no_grad():
                ref = torch.nn.functional.conv2d(x, w, padding=spec.padding)
            runs = {}
            for m in winograd.TILE_SIZES[spec.kh]:
                for rows in (int(r) for r in args.winograd_rows.split(",")):
                    before, winograd.ROWS = winograd.ROWS, rows
                    try:
                        plan = winograd.WinogradPlan(spec, bias=False, threads=target.cores, lanes=target.simd_width, m=m)
                        kernel = winograd.WinogradKernel(plan, target)
                    finally:
                        winograd.ROWS = before
                    out = torch.empty_like(ref, memory_format=torch.channels_last)
                    u = plan.pack_weight(w.numpy())
                    runs[f"F{m} rows {rows}"] = (lambda k=kernel, u=u, out=out: k(x, u, None, None, out))
                    runs[f"F{m} rows {rows}"]()
                    assert float((out - ref).abs().max() / ref.abs().max()) < 1e-3, (spec, m, rows)
            timed = interleaved_rounds(runs, args.rounds, repeats=5, min_run_time=5e-3, warmup=2)
            best = {label: statistics.median(t.min for t in ts) for label, ts in timed.items()}
            ratios = []
            for m in winograd.TILE_SIZES[spec.kh]:
                labels = [lab for lab in runs if lab.startswith(f"F{m} ")]
                base = labels[0]
                ratios += [f"F{m}: " + ", ".join(
                    f"{lab.split()[-1]} rows {best[lab] * 1e3:.3f} ms "
                    f"({statistics.median(a.min / b.min for a, b in zip(timed[base], timed[lab])):.3f}x)"
                    for lab in labels)]
            print(f"{str(spec):36s} " + "; ".join(ratios), flush=True)


def _channels_last(model: torch.nn.Module) -> Any:
    import copy

    m = copy.deepcopy(model).to(memory_format=torch.channels_last)
    return lambda x: m(x.contiguous(memory_format=torch.channels_last))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--networks", default="resnet50,mobilenet_v2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tiles", default="", help="register tiles to time beside the default, e.g. k16xoh1xow7")
    ap.add_argument("--reserve", type=int, default=None,
                    help="vector registers kept free of accumulators (default maco's REGISTER_RESERVE)")
    ap.add_argument("--against-reserve", type=int, default=None,
                    help="also time the default schedule made with this many registers kept free")
    ap.add_argument("--kernels", default="1x1", help="1x1 (default) or all: which convs (groups 1)")
    ap.add_argument("--whole", default="",
                    help="instead: these networks whole (comma-separated), a MACO kernel in every conv on "
                    "its default schedule (kernel_choice.kernels_everywhere), made with --reserve and with "
                    "--against-reserve, timed in the same rounds as eager and channels_last")
    ap.add_argument("--with-winograd", action="store_true",
                    help="--whole: also each MACO model with Winograd where it beats the direct kernel in the model")
    ap.add_argument("--winograd-rows", default="",
                    help="instead: the Winograd kernel's GEMM with these register rows (e.g. 6,7), F(2x2) and "
                    "F(4x4), on the 3x3 stride-1 convs of --networks, in the same rounds")
    ap.add_argument("--layers", default="", help="only specs containing one of these comma-separated texts")
    args = ap.parse_args()
    if args.reserve is not None:  # free_registers reads both, at each call
        from maco.core import sketch_cpu
        sketch_cpu.REGISTER_RESERVE = sketch_cpu.REGISTER_RESERVE_16 = args.reserve
    target = Target.host()
    torch.set_num_threads(target.cores)
    steady_allocator()
    evict = CacheEvictor.for_target(target)
    if args.whole:
        whole(args, target)
        return
    if args.winograd_rows:
        winograd_rows(args, target)
        return
    tiles = [dict(part.split("=") for part in t.replace("k", "k=").replace("oh", "oh=").replace("ow", "ow=").split("x"))
             for t in args.tiles.split(",") if t]
    tiles = [{k: int(v) for k, v in t.items()} for t in tiles]
    seen = set()
    print(f"{'spec':40s} {'MACO':>7s} {'torch':>7s} {'MACO ev':>8s} {'torch ev':>8s}  GFLOP/s; tile; variants")
    for net in args.networks.split(","):
        for spec, _ in distinct_convs(network_convs(net, 1)):
            if (args.kernels == "1x1" and spec.kh != 1) or spec.groups != 1 or spec in seen:
                continue
            if args.layers and not any(t in str(spec) for t in args.layers.split(",")):
                continue
            seen.add(spec)
            g = torch.Generator().manual_seed(0)
            x = torch.randn(spec.input_shape, generator=g).contiguous(memory_format=torch.channels_last)
            w = torch.randn(spec.weight_shape, generator=g)
            conv = torch.nn.Conv2d(spec.c, spec.k, (spec.kh, spec.kw), spec.stride, spec.padding, spec.dilation,
                                   bias=False).eval()
            conv.weight.data.copy_(w)
            conv = conv.to(memory_format=torch.channels_last)
            with torch.no_grad():
                ref = conv(x)
            schedules = {"default": kernels.default_schedule(spec, target, "NHWC")}
            if args.against_reserve is not None:
                s = _with_reserve(args.against_reserve, lambda: kernels.default_schedule(spec, target, "NHWC"))
                if s != schedules["default"]:
                    schedules[f"reserve{args.against_reserve}"] = s
            for t in tiles:
                s = with_tile(spec, target, {**t})
                if s is not None and s != schedules["default"]:
                    schedules["k%dxoh%dxow%d" % (t["k"], t["oh"], t["ow"])] = s
            runs = {}
            for label, sched in schedules.items():
                out = torch.empty_like(ref, memory_format=torch.channels_last)
                compiled = _with_reserve(0, lambda: kernels.compile(spec, sched, target))  # accepts every tile
                fn = compiled.bind(w).prepare(x, None, out)
                fn()
                err = float((out - ref).abs().max() / ref.abs().max())
                assert err < 1e-4, (spec, label, err)
                runs[label] = fn
            runs["torch"] = lambda: conv(x)
            with torch.inference_mode():
                warm = interleaved_rounds(runs, args.rounds, repeats=5, min_run_time=5e-3, warmup=2)
                cold = interleaved_rounds({k: runs[k] for k in ("default", "torch")}, args.rounds, repeats=5,
                                          min_run_time=5e-3, warmup=1, before=evict)
            gf = 2 * spec.c_per_group * spec.k * spec.kh * spec.kw * spec.out_h * spec.out_w / 1e9

            def rate(timings):
                return gf / statistics.median(t.min for t in timings)
            d = schedules["default"]
            tile = "k%d oh%d ow%d" % (d.factors("k")[3], d.factors("oh")[3], d.factors("ow")[3])
            extra = " ".join(f"{lab} {rate(warm[lab]):.0f}" for lab in schedules if lab != "default")
            print(f"{str(spec):40s} {rate(warm['default']):7.1f} {rate(warm['torch']):7.1f} "
                  f"{rate(cold['default']):8.1f} {rate(cold['torch']):8.1f}  {tile}; {extra}", flush=True)


if __name__ == "__main__":
    main()
