"""`maco optimize`: the main job (tune, plan layouts, run with MACO kernels, measure end to end)."""
from __future__ import annotations

import argparse

from maco.commands.common import NETWORKS_TEXT
from maco.core.errors import MacoError


def register(sub: argparse._SubParsersAction) -> None:
    from maco.commands.common import add_cluster_argument, positive_int
    from maco.deploy.engines import ENGINES
    from maco.tune.tuning import BUDGET_CAPS, BUDGETS, SEARCH_MIN_SHARE

    p = sub.add_parser(
        "optimize", help="tune a model's convs, plan its layouts and measure it end to end (the main job)",
        description="For each distinct conv layer of the model: tune in the MACO-pruned space "
        "(records reused when present); then plan a layout per layer with the tuned latencies and "
        "measured conversion costs, run the planned model with MACO kernels where they beat torch, "
        "and time it end to end against the model as torch runs it by default. Writes the plan, "
        "records, a per-layer table and plot, and report.md to --out. Kernels are tuned for --batch images and the threads torch uses "
        "(torch.set_num_threads, OMP_NUM_THREADS); both are recorded with the schedules.")
    p.add_argument("model", nargs="?", default="resnet18",
                   help=f"{NETWORKS_TEXT} (default resnet18), or "
                   "path/to/file.py:ClassName (a torch.nn.Module built with no arguments)")
    p.add_argument("--target", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--budget", default="quick", choices=list(BUDGETS),
                   help="measurements per distinct conv: " +
                   ", ".join(f"{k} {v}" + (f" (at most {BUDGET_CAPS[k]} in all)" if k in BUDGET_CAPS else "")
                             for k, v in BUDGETS.items()) + f" (default quick); convs with under {SEARCH_MIN_SHARE * 100:g}%% "
                   "of the network's conv work get their defaults measured, no search")
    p.add_argument("--out", default="maco-out", help="output folder (default maco-out)")
    p.add_argument("--records", default=None, help="tuning records to reuse and extend "
                   "(default OUT/records.jsonl)")
    p.add_argument("--input-shape", default=None,
                   help="input shape for a model file, e.g. 1,3,224,224 (default 1,3,224,224)")
    p.add_argument("--batch", type=positive_int, default=None,
                   help="images per inference the kernels are tuned for (default: the input shape's, 1)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--save", default=None, metavar="FILE",
                   help="write the model handed back to FILE (maco.load(FILE, model) rebuilds it without tuning)")
    p.add_argument("--engines", default="auto",
                   help="other inference engines to time the model handed back beside, each in its own process "
                   "alternating with torch eager: auto (default: ONNX Runtime and OpenVINO where installed, "
                   "pip install 'maco[engines]'), none, or a comma-separated list of "
                   f"{', '.join(e for e in ENGINES if e != 'maco')}")
    p.add_argument("--exact", action="store_true",
                   help="no Winograd kernels: their fp32 error is up to ~10-25x a direct conv's, local to an "
                   "output tile (docs/exactness.md)")
    add_cluster_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from maco.deploy.optimize import optimize

    shape = None
    if args.input_shape:
        try:
            shape = tuple(int(v) for v in args.input_shape.split(","))
        except ValueError:
            raise MacoError(f"--input-shape must be comma-separated ints, got {args.input_shape!r}") from None
        if not shape or any(v < 1 for v in shape):
            raise MacoError(f"--input-shape must be positive ints, got {args.input_shape!r}")
    result = optimize(args.model, target=args.target, budget=args.budget, out=args.out,
                      records=args.records, seed=args.seed, input_shape=shape, batch=args.batch,
                      save=args.save, cluster=args.cluster, engines=engines_to_time(args.engines),
                      exact=args.exact)
    for key, label in (("fused", "fused (BatchNorm folded, epilogues in the conv)"),
                       ("planned_torch", "fused + planned layouts, torch convs"),
                       ("planned_maco", "fused + planned layouts + MACO kernels")):
        e = result.end_to_end.get(key)
        if e:
            print(f"{label}: {e['speedup']:.2f}x over the default model, median of per-round ratios "
                  f"(medians {e['planned_s'] * 1e3:.2f} ms vs {e['default_s'] * 1e3:.2f} ms)"
                  + ("  <- handed back" if e["chosen"] else ""))
    if result.share is not None:
        from maco.deploy.optimize_report import outside_note
        share = result.share
        print(f"the handed-back model spends {100 * share.outside:.0f}%{outside_note(share)} of its time beyond its conv "
              f"kernels timed alone ({share.model_s * 1e3:.2f} ms vs {share.convs_s * 1e3:.2f} ms"
              + (f"; {share.convs_cold_s * 1e3:.2f} ms with their weights in memory, as in the model)"
                 if share.per_conv_cold else ")"))
        if share.per_conv_in_model:
            print(f"inside the model its kernels take {share.convs_in_model_s / share.alone_s:.2f}x their time alone "
                  f"({share.convs_in_model_s * 1e3:.2f} ms vs {share.alone_s * 1e3:.2f} ms, "
                  f"{len(share.per_conv_in_model)} kernels timed in the model's C calls)")
    if result.floor is not None and result.floor.seconds and result.share is not None:
        net = result.floor.network
        print(f"the handed-back model runs at {result.share.model_s / result.floor.seconds:.2f}x its network floor "
              f"({result.floor.seconds * 1e3:.2f} ms at {(net.peak or 0) / 1e9:.0f} GFLOP/s and "
              f"{(net.bandwidth or 0) / 1e9:.1f} GB/s; maco.bounds.network){result.floor.busy_note()}"
              + (f"; MACO's kernel families at their ceilings would run at {result.floor.reach / result.floor.seconds:.2f}x"
                 if result.floor.reach else ""))
    for e in result.engines:
        print(f"{e['engine']}: " + (f"{e['speedup']:.2f}x over torch eager in its own process (medians "
                                    f"{e['engine_ms']:.2f} ms vs {e['eager_ms']:.2f} ms)" if "speedup" in e
                                    else f"not timed: {e.get('note', '')}"))
    if result.engines:
        from maco.deploy.optimize_report import engine_summary

        print(engine_summary(result.engines))
    print(f"report: {result.out / 'report.md'}  ({result.seconds:.0f} s)")
    return 0


def engines_to_time(text: str) -> list[str]:
    """--engines: auto (ONNX Runtime and OpenVINO where installed), none, or a list."""
    from maco.deploy.engines import installed

    if text == "auto":
        return [e for e in ("onnxruntime", "openvino") if installed(e)]
    if text == "none":
        return []
    return [e.strip() for e in text.split(",") if e.strip()]
