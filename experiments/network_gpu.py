"""Issue 39 part 2: a whole network on the GPU with MACO's CUDA kernels (BatchNorm folded,
epilogues fused, layouts planned), strict fp32 (TF32 off everywhere), against what a PyTorch
user would run instead:

  eager            torch eager, cuDNN benchmark mode
  eager_graph      the same replayed from a CUDA graph (maco.layouts.cuda_graph)
  maco             the variant maco.deploy.pipeline.run_pipeline hands back, replayed from a CUDA
                   graph: each conv on a MACO kernel (its best record of --records, e.g. from
                   `maco tune resnet18 --target cuda`, else its default schedule) where that kernel
                   beats cuDNN's timed here, cuDNN elsewhere; layouts planned
  maco_every       the same plan with every conv on a MACO kernel, whether or not it beats cuDNN,
                   called module by module (the Python of each call shows); maco_every_graph the
                   same replayed from a CUDA graph
  compiled         torch.compile(mode="max-autotune"): Triton's templates where they apply, CUDA
                   graphs of its own; timed last, with every contender again, at --compile-batches
                   (it compiles for minutes)

One process, interleaved rounds (maco.layouts.end_to_end.time_models); statistic: the median
over rounds; speedups: the median of per-round ratios over eager. Every contender's output is
checked against eager's first: max |diff| / max |eager| within 1e-4.

    python experiments/network_gpu.py --out results [--records r.jsonl] [--batches 1,8]

Writes <out>/network_gpu_<gpu>.csv, row by row (column timed: without / with torch.compile).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from maco.core.spec import ConvSpec
from maco.core.target import Target
from maco.deploy.pipeline import run_pipeline
from maco.experiments.common import Figure, num, out_dir, parser, write_csv
from maco.experiments.fig15_kernels_gpu import gpu_tag
from maco.kernels.cuda import default_schedule
from maco.layouts.cuda_graph import CudaGraphed, unwrap
from maco.layouts.end_to_end import time_models
from maco.layouts.maco_modules import use_maco_kernels
from maco.layouts.networks import example_input, load_model
from maco.tune.records import RecordStore

RTOL = 1e-4

FIGURE = Figure(
    "network_gpu", "(not in the paper: it timed kernels, not networks, on its GPU)",
    "ResNet-18 whole on the GPU, strict fp32, against torch eager with cuDNN benchmark mode, eager under "
    "a CUDA graph and torch.compile max-autotune, in the same rounds", csv=("network_gpu_*.csv",),
    gpu=True, quick=False)


def contenders(net: str, x: torch.Tensor, store: RecordStore, log: Callable[[str], Any]) -> dict[str, Any]:
    """Every contender but torch.compile, built and checked to run once."""
    _, model = load_model(net)
    model = model.eval().cuda()
    run = run_pipeline(model, x, Target.h100(), store, device="cuda", log=log)
    maco = run.built.models[run.pick]
    log(f"  MACO variant {run.pick}: {len(run.built.swapped)} of {len(run.built.plan.convs)} convs on "
        f"MACO kernels; pipeline's own times (ms): "
        + ", ".join(f"{k} {run.times.timing(k).median * 1e3:.3f}" for k in run.times.rounds))
    every = every_conv_on_maco(run, store)
    return {"eager": model, "eager_graph": CudaGraphed(model), "maco": maco, "maco_every": every,
            "maco_every_graph": CudaGraphed(every)}


def every_conv_on_maco(run: Any, store: RecordStore) -> Any:
    """The planned model with every conv a MACO kernel can run on one, whether or not it beats
    cuDNN: its best record where the records hold one, else its default schedule."""
    target = Target.h100()
    plan = run.built.plan
    model = plan.apply(unwrap(run.built.models["fused"]))
    chosen: dict[ConvSpec, dict[str, Any]] = {}
    for lp in plan.convs:
        spec = ConvSpec.parse(lp.spec)
        rec = store.best.get((spec, lp.layout))
        chosen.setdefault(spec, {})[lp.layout] = rec.schedule if rec else default_schedule(spec, target, lp.layout)
    swapped = use_maco_kernels(model, plan, chosen, target)
    print(f"  maco_every: {len(swapped)} of {len(plan.convs)} convs on MACO kernels", flush=True)
    return model


def rows_of(net: str, batch: int, runs: dict[str, Any], x: torch.Tensor, rounds: int,
            session: str) -> list[dict[str, Any]]:
    times = time_models(runs, x, rounds=rounds, repeats=5, min_run_time=0.05)
    return [dict(network=net, batch=batch, timed=session, engine=label, median_ms=times.timing(label).median * 1e3,
                 speedup_vs_eager=times.speedup(label), max_rel_diff=times.max_rel_diff[label],
                 output_ok=times.max_rel_diff[label] <= RTOL, rounds=rounds) for label in runs]


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--networks", default="resnet18")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--records", type=Path, default=None, help="tuning records for the CUDA target")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--compile-batches", default="1",
                    help="batches that torch.compile max-autotune is timed at too, after all else ('' for none)")
    args = ap.parse_args(argv)
    out = out_dir(args)
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    tag = gpu_tag(torch.cuda.get_device_name(0))
    path = out / f"network_gpu_{tag}.csv"
    log = lambda m: print(m, flush=True)  # noqa: E731
    have = args.records is not None and args.records.is_file()
    if args.records is not None and not have:
        log(f"no records at {args.records}: every conv on its default schedule")
    store = RecordStore([args.records] if have else [], Target.h100())
    rows: list[dict[str, Any]] = []
    built: dict[tuple[str, int], tuple[dict[str, Any], torch.Tensor]] = {}
    for net in args.networks.split(","):
        for batch in map(int, args.batches.split(",")):
            x = example_input(batch).cuda()
            log(f"{net} batch {batch} on {torch.cuda.get_device_name(0)}")
            runs = contenders(net, x, store, log)
            built[(net, batch)] = runs, x
            new = rows_of(net, batch, runs, x, args.rounds, "without torch.compile")
            rows += new
            write_csv(path, rows)
            _print(new, log)
    for net in args.networks.split(","):  # last: max-autotune compiles for minutes
        for batch in map(int, filter(None, args.compile_batches.split(","))):
            runs, x = built[(net, batch)]
            t0 = time.time()
            runs["compiled"] = torch.compile(runs["eager"], mode="max-autotune")
            with torch.inference_mode():
                runs["compiled"](x)
            log(f"{net} batch {batch}: torch.compile max-autotune compiled in {time.time() - t0:.0f} s")
            new = rows_of(net, batch, runs, x, args.rounds, "with torch.compile")
            rows += new
            write_csv(path, rows)
            _print(new, log)
    return 0


def summarise(rows: list[dict[str, str]]) -> str:
    """REPORT.md: per network and batch, MACO's time and its speedup over each other contender."""
    parts = []
    for key in dict.fromkeys((r["network"], r["batch"]) for r in rows):
        mine = {r["engine"]: r for r in rows if (r["network"], r["batch"]) == key}  # the last timing wins
        if "maco" not in mine:
            continue
        maco = num(mine["maco"], "median_ms")
        others = ", ".join(f"{e} {num(r, 'median_ms'):.3f} ms ({num(r, 'median_ms') / maco:.2f}x)"
                           for e, r in mine.items() if e in ("eager", "eager_graph", "compiled"))
        ok = all(r.get("output_ok") == "True" for r in mine.values())
        parts.append(f"{key[0]} batch {key[1]}: MACO {maco:.3f} ms; {others}"
                     + ("" if ok else " (an output differs)"))
    return "; ".join(parts) + " (MACO's speedup over each, same rounds)"


def _print(rows: list[dict[str, Any]], log: Callable[[str], Any]) -> None:
    for r in rows:
        log(f"  {r['engine']:12s} {r['median_ms']:8.3f} ms  {r['speedup_vs_eager']:5.2f}x eager  "
            f"rel diff {r['max_rel_diff']:.1e}{'' if r['output_ok'] else '  OUTPUT DIFFERS'}")


if __name__ == "__main__":
    sys.exit(main())
