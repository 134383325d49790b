"""Where a loaded MACO model's time goes, and the same model with each run of kernel modules as one
call (maco.layouts.segments) against the modules called one by one (issue 38, item 5).

One process, torch threads = cores, torch.inference_mode, glibc's steady allocator; every label
timed once per round, rounds alternating (maco.core.timing.interleaved_rounds), statistic: the
median over rounds of each round's median; ratios are medians of per-round ratios.

  eager        the model as torch runs it (NCHW)
  one_by_one   maco.load(FILE, model, segments=False): a Python module call per kernel
  segments     maco.load(FILE, model): each run of kernel modules as one C call
  segments_unshared  the same, each value of a run in bytes of its own (no liveness plan): what
               the memory plan adds to the one call
  *_nokernels  the same with every MACO kernel skipped (a module hands back its buffer, a segment
               makes no C call): torch ops, layout conversions and Python, without the kernels
  kernels      the segments' C calls alone (each on its own tables) plus the MACO modules left
               outside segments, each called alone: MACO's kernels and nothing else

    flock /tmp/maco-timing.lock python results/segments_cpu.py --saved /tmp/mnv2.maco --model mobilenet_v2
    flock /tmp/maco-timing.lock python results/segments_cpu.py --model resnet18     # default schedules, NHWC
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

import maco
from maco.core.timing import interleaved_rounds, steady_allocator
from maco.layouts.maco_modules import MacoConv2d, MacoLinear, _GeneratedOp
from maco.layouts.networks import build, example_input
from maco.layouts.segments import segments_of


def _skip_kernels(model: torch.nn.Module) -> Any:
    """A call of `model` with every MACO kernel skipped (its output buffer handed back as it is)."""
    segs = segments_of(model)
    convs = [m for m in model.modules() if isinstance(m, MacoConv2d)]
    others = [m for m in model.modules() if isinstance(m, (_GeneratedOp, MacoLinear))]

    def call(x: torch.Tensor) -> Any:
        saved = [m._kernel for m in others]
        for m in convs:
            m._conv.run_tensor = lambda x, residual=None, out=None, m=m: out if out is not None else m._conv.output()
        for m in others:
            m._kernel = lambda *a: None
        for s in segs:
            s.skip_kernels = True
        try:
            return model(x)
        finally:
            for m in convs:
                del m._conv.run_tensor
            for m, k in zip(others, saved):
                m._kernel = k
            for s in segs:
                s.skip_kernels = False
    return call


def _kernels_alone(model: torch.nn.Module, x: torch.Tensor) -> Any:
    """One call running every MACO kernel of `model` once on the buffers of the last call, and
    nothing else but the calls of the modules left outside segments (their Python included)."""
    segs = segments_of(model)
    inside = {id(m) for s in segs for m in s.modules_in_order}
    loose: list[tuple[torch.nn.Module, tuple]] = []

    def keep(mod: torch.nn.Module, args: tuple) -> None:
        loose.append((mod, tuple(a.clone(memory_format=torch.preserve_format) for a in args)))

    hooks = [m.register_forward_pre_hook(keep) for m in model.modules()
             if isinstance(m, (MacoConv2d, MacoLinear, _GeneratedOp)) and id(m) not in inside]
    with torch.inference_mode():
        model(x)
    for h in hooks:
        h.remove()
    tables = [(s._run, s._tables, len(s._steps)) for s in segs]

    def call() -> None:
        for run, t, n in tables:
            start = 0
            while (stop := run(*t, start, n)) < n:  # a non-finite Winograd step: go on past it
                start = stop + 1
        for mod, args in loose:
            mod(*args)
    return call


def planned_on_defaults(net: str, x: torch.Tensor) -> torch.nn.Module:
    """What `maco optimize` builds for the planned_maco variant without tuning or timing."""
    from maco import kernels
    from maco.deploy.kernel_choice import kernels_everywhere

    return kernels_everywhere(build(net).eval(), x, kernels.host_target())[0]


def per_kernel(model: torch.nn.Module, x: torch.Tensor, rounds: int) -> list[dict[str, Any]]:
    """Each kernel of the model's segments timed alone on its row of the segment's tables (the
    buffers of the model's last call), in interleaved rounds: median ms, GFLOP/s of a conv."""
    rows, runs = [], {}
    with torch.inference_mode():
        model(x)
    for si, s in enumerate(segments_of(model)):
        for j, step in enumerate(s._steps):
            label = f"{si}.{j}"
            runs[label] = lambda s=s, j=j: s._run(*s._tables, j, j + 1)
            spec = getattr(step.module, "spec", None)
            rows.append({"step": label, "kind": type(step.module).__name__,
                         "what": str(spec) if spec is not None else repr(step.module.extra_repr())[:60],
                         "layout": getattr(step.module, "layout", ""),
                         "flops": spec.flops if spec is not None else None})
    per = interleaved_rounds(runs, rounds, repeats=3, min_run_time=0.005, warmup=2)
    for row in rows:
        row["ms"] = statistics.median(t.median for t in per[row["step"]]) * 1e3
        if row["flops"]:
            row["gflops"] = row["flops"] / row["ms"] / 1e6
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--saved", help="a file maco.save wrote (default: planned_on_defaults)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--min-run-time", type=float, default=0.05)
    ap.add_argument("--json")
    ap.add_argument("--per-kernel", action="store_true", help="also time each segment kernel alone")
    args = ap.parse_args(argv)
    torch.set_num_threads(torch.get_num_threads())
    steady_allocator()
    x = example_input(1)
    eager = build(args.model).eval()
    from maco.kernels import host_target
    from maco.layouts.segments import use_segments

    if args.saved:
        seg = maco.load(args.saved, build(args.model))
        plain = maco.load(args.saved, build(args.model), segments=False)
        unshared = maco.load(args.saved, build(args.model), segments=False)
    else:  # no tuned file: the plan and kernels of planned_on_defaults, built three times
        seg, plain, unshared = (planned_on_defaults(args.model, x) for _ in range(3))
        use_segments(seg, host_target())
    use_segments(unshared, host_target(), share_memory=False)
    n_kernels = sum(isinstance(m, (MacoConv2d, MacoLinear, _GeneratedOp)) for m in plain.modules())
    in_segments = sum(len(s._steps) for s in segments_of(seg))
    with torch.inference_mode():
        want = eager(x)
        err = {k: float((want - m(x)).abs().max() / want.abs().max()) for k, m in (("one_by_one", plain), ("segments", seg))}
        runs = {"eager": lambda: eager(x), "one_by_one": lambda: plain(x), "segments": lambda: seg(x),
                "segments_unshared": lambda: unshared(x),
                "one_by_one_nokernels": lambda f=_skip_kernels(plain): f(x),
                "segments_nokernels": lambda f=_skip_kernels(seg): f(x),
                "kernels": _kernels_alone(seg, x)}
        for fn in runs.values():
            fn()
        start = time.time()
        if args.rounds < 1:  # --rounds 0: the outputs and the segments only, nothing timed
            print(json.dumps({"max_rel_err": err, "kernel_modules": n_kernels, "in_segments": in_segments,
                              "segments": [repr(s) for s in segments_of(seg)]}, indent=1))
            return 0
        per = interleaved_rounds(runs, args.rounds, repeats=3, min_run_time=args.min_run_time, warmup=2)
    med = {k: statistics.median(t.median for t in v) * 1e3 for k, v in per.items()}
    ratio = statistics.median(a.median / b.median for a, b in zip(per["one_by_one"], per["segments"]))
    unshared = statistics.median(a.median / b.median for a, b in zip(per["segments_unshared"], per["segments"]))
    out = {"model": args.model, "saved": args.saved, "threads": torch.get_num_threads(), "rounds": args.rounds,
           "median_ms": med, "one_by_one_over_segments": ratio,
           "unshared_over_segments": unshared, "max_rel_err": err,
           "kernel_modules": n_kernels, "in_segments": in_segments, "segments": len(segments_of(seg)),
           "timing_s": round(time.time() - start, 1)}
    if args.per_kernel:
        out["per_kernel"] = sorted(per_kernel(seg, x, 3), key=lambda r: -r["ms"])
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
