"""Issue 21: the ways a PyTorch user deploys MACO, on whole networks (fp32, this CPU; not a figure of
the paper). Per network:

  backend_none     torch.compile(model, backend="maco", options={"tune": "none"}): the bound-derived
                   default schedules, nothing tuned
  backend_records  torch.compile(model, backend="maco", options={"records": DIR, "tune": "quick"}):
                   the layers missing from DIR are tuned into it first (quick budget), and torch's
                   conv is timed by the tuner's worker where DIR has no baseline for it
  optimize         maco.deploy.optimize.optimize(net, budget="quick", records=DIR/maco_records.jsonl,
                   save=FILE): the main job on the same records (they count toward its budget);
                   both plan layouts from the same torch baselines in the records
  load             maco.load(FILE, a freshly built model): rebuilt without tuning (warm build cache)

and, to show what torch.compile itself costs per call, dynamo_ms: the same network compiled with a
backend that returns the output computed once, called right after optimize's model, minus
optimize's model alone, per round (median). That is dynamo's guard checks and call as a backend's
graph meets them, after a model has run (colder caches than a loop of bare calls sees); every
torch.compile backend pays it, so it is a gap the backend cannot close to optimize. And
graph_vs_optimize: backend_records' own graph (the module the backend hands dynamo) called
directly, over optimize, per round: what the backend built, without dynamo's call around it.
(The backends are compiled through a wrapper that keeps what maco_backend returns, which is what
backend="maco" with those options calls.)

All four and torch eager NCHW are timed in the same interleaved rounds (maco.layouts.end_to_end.
time_models; torch threads as set, the kernels follow them): speedup = median of per-round ratios
eager / path; vs_optimize = median of per-round ratios optimize / path (the issue's target: the
backend with records within 5% of optimize on ResNet-18). max_rel_err = max |path - eager| /
max |eager| (outputs_ok: below 1e-4). seconds: compile (its tuning included), optimize, or load.
The networks include two defined here that the tests do not name (FireNet: squeeze/expand with
concat; PreActNet: BN-ReLU-conv order, dilated and grouped convs, hardswish and SiLU).

    python experiments/deployment_cpu.py --quick              # ResNet-18
    python experiments/deployment_cpu.py [--networks resnet18,firenet] [--batch 2] [--records DIR]
    python experiments/deployment_cpu.py --networks resnet18 --start-from results/records_cpu.jsonl

Writes <out>/deployment_cpu.csv (a rerun replaces the rows of its networks at its batch size,
keeps the rest), .png and .env.json.
"""
from __future__ import annotations

import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from maco.experiments.common import (Figure, num, out_dir, parser, print_table, pyplot, quiet, read_rows, save_plot,
                                     write_csv, write_env)

FIGURE = Figure(
    "deployment", "(not in the paper: torch.compile backend and saved models are MACO's own)",
    "the torch.compile backend (defaults; tuned records), maco optimize and maco.load of its saved model, "
    "timed in the same rounds against torch eager",
    csv=("deployment_cpu.csv",))

NETWORKS = "resnet18,alexnet,vgg11,mobilenet_v2,resnet50,firenet,preactnet"
PATHS = ("backend_none", "backend_records", "optimize", "load")
COLUMNS = ["network", "batch", "path", "ms", "speedup", "vs_optimize", "seconds", "max_rel_err", "outputs_ok",
           "dynamo_ms", "graph_vs_optimize"]
RTOL = 1e-4
SMALL_INPUT = (3, 64, 64)  # the two networks defined here


class FireNet(nn.Module):
    """SqueezeNet-style: squeeze 1x1, expand 1x1 and 3x3 concatenated, ceil-mode pooling."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.stem = nn.Conv2d(3, 32, 3, stride=2)
        self.fires = nn.ModuleList([self._fire(32, 8, 32), self._fire(64, 16, 48), self._fire(96, 16, 64)])
        self.head = nn.Conv2d(128, 10, 1)

    @staticmethod
    def _fire(c: int, squeeze: int, expand: int) -> nn.ModuleDict:
        return nn.ModuleDict({"s": nn.Conv2d(c, squeeze, 1), "e1": nn.Conv2d(squeeze, expand, 1),
                              "e3": nn.Conv2d(squeeze, expand, 3, padding=1)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.stem(x)), 3, 2, ceil_mode=True)
        for fire in self.fires:
            s = F.relu(fire["s"](x))
            x = torch.cat([F.relu(fire["e1"](s)), F.relu(fire["e3"](s))], 1)
        return F.adaptive_avg_pool2d(F.relu(self.head(x)), 1).flatten(1)


class PreActNet(nn.Module):
    """Pre-activation residual blocks (BN and ReLU before the conv: nothing to fold), a dilated and a
    grouped conv, hardswish and SiLU, BatchNorm with non-trivial statistics."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.Hardswish())
        self.bn1, self.conv1 = nn.BatchNorm2d(32), nn.Conv2d(32, 32, 3, padding=2, dilation=2, bias=False)
        self.bn2, self.conv2 = nn.BatchNorm2d(32), nn.Conv2d(32, 32, 3, padding=1, groups=4, bias=False)
        self.down = nn.Sequential(nn.Conv2d(32, 64, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(64), nn.SiLU())
        self.fc = nn.Linear(64, 10)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.data.uniform_(0.5, 1.5)
                m.bias.data.uniform_(-0.2, 0.2)
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = x + self.conv2(F.relu(self.bn2(self.conv1(F.relu(self.bn1(x))))))
        return self.fc(F.adaptive_avg_pool2d(self.down(x), 1).flatten(1))


LOCAL = {"firenet": FireNet, "preactnet": PreActNet}


def build(net: str) -> nn.Module:
    from maco.layouts.networks import build as build_network

    return LOCAL[net]().eval() if net in LOCAL else build_network(net)


def run_network(net: str, batch: int, records: Path, rounds: int, log: Any = print) -> list[dict]:
    """The four paths on one network, checked and timed against eager in the same rounds."""
    import maco
    from maco.deploy.compile_backend import maco_backend
    from maco.layouts.end_to_end import time_models
    from maco.layouts.networks import example_input
    from maco.deploy.optimize import optimize

    torch._dynamo.reset()
    model = build(net)
    x = torch.randn(batch, *SMALL_INPUT, generator=torch.Generator().manual_seed(0)) if net in LOCAL \
        else example_input(batch)
    records.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Any] = {"eager": model}
    seconds: dict[str, float] = {}
    with torch.inference_mode():
        for label, options in (("backend_none", {"tune": "none"}),
                               ("backend_records", {"records": str(records), "tune": "quick"})):
            log(f"{net} (batch {batch}): {label} ...")
            start = time.perf_counter()
            compiled: list[Any] = []  # what backend="maco" returns per graph dynamo hands over

            def keeping(gm: Any, inputs: Any, options: dict = options) -> Any:
                compiled.append(maco_backend(gm, inputs, options=options))
                return compiled[-1]
            paths[label] = torch.compile(build(net), backend=keeping)
            paths[label](x)  # compiles (and tunes) on the first call
            seconds[label] = time.perf_counter() - start
        if len(compiled) == 1 and hasattr(compiled[0], "model"):  # one graph that MACO took
            paths["backend_graph"] = compiled[0].model
    log(f"{net} (batch {batch}): optimize ...")
    saved = records / f"{net}_b{batch}.maco"
    start = time.perf_counter()
    text = f"{Path(__file__).resolve()}:{LOCAL[net].__name__}" if net in LOCAL else net
    result = optimize(text, budget="quick", out=records / f"{net}_b{batch}", records=records / "maco_records.jsonl",
                      input_shape=tuple(x.shape), save=saved, log=lambda s: None)
    seconds["optimize"] = time.perf_counter() - start
    paths["optimize"] = result.model
    start = time.perf_counter()
    paths["load"] = maco.load(saved, build(net))
    seconds["load"] = time.perf_counter() - start
    with torch.inference_mode():
        outputs = model(x)
        dynamo_only = torch.compile(build(net), backend=lambda gm, inputs: lambda *args: (outputs,))
        dynamo_only(x)
    paths["optimize_then_dynamo"] = lambda x: (paths["optimize"](x), dynamo_only(x))[1]
    log(f"{net} (batch {batch}): timing eager, {', '.join(PATHS)} in {rounds} rounds")
    quiet()
    times = time_models(paths, x, rounds=rounds)
    dynamo_ms = 1e3 * statistics.median(both.median - alone.median for both, alone in
                                        zip(times.rounds["optimize_then_dynamo"], times.rounds["optimize"]))
    return [{"network": net, "batch": batch, "path": label, "ms": times.timing(label).median * 1e3,
             "speedup": times.speedup(label), "vs_optimize": times.speedup(label, over="optimize"),
             "seconds": seconds[label], "max_rel_err": times.max_rel_diff[label],
             "outputs_ok": times.max_rel_diff[label] < RTOL,
             "dynamo_ms": dynamo_ms if label.startswith("backend") else "",
             "graph_vs_optimize": times.speedup("backend_graph", over="optimize")
             if label == "backend_records" and "backend_graph" in paths else ""} for label in PATHS]


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    keys = list(dict.fromkeys((r["network"], str(r["batch"])) for r in rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(keys)), 4.2))
    width = 0.8 / len(PATHS)
    for i, label in enumerate(PATHS):
        for j, key in enumerate(keys):
            r = next((r for r in rows if (r["network"], str(r["batch"])) == key and r["path"] == label), None)
            if r is None or not num(r, "speedup") > 0:
                continue
            ok = str(r["outputs_ok"]) == "True"
            ax.bar(j + (i - (len(PATHS) - 1) / 2) * width, num(r, "speedup"), width, color=f"C{i}",
                   hatch="" if ok else "//", label=label if j == 0 else None)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(range(len(keys)), [f"{n}\nbatch {b}" for n, b in keys], fontsize=8)
    ax.set_ylabel("speedup over torch eager (median of per-round ratios)")
    ax.set_title("torch.compile(backend='maco'), maco optimize and maco.load, same rounds\n"
                 "(hatched: output differs from eager by more than 1e-4)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_plot(fig, path)


def summarise(rows: list[dict[str, str]]) -> str:
    """REPORT.md: per network, each path's speedup over eager, the backend with records beside
    optimize, whether every output matched."""
    parts = []
    for net, batch in dict.fromkeys((r["network"], r["batch"]) for r in rows):
        mine = {r["path"]: r for r in rows if r["network"] == net and r["batch"] == batch}
        cells = ", ".join(f"{p} {num(mine[p], 'speedup'):.2f}x" for p in PATHS if p in mine)
        rec = mine.get("backend_records")
        dynamo = f", torch.compile's own call {num(rec, 'dynamo_ms'):.2f} ms" if rec and rec.get("dynamo_ms") else ""
        if rec and rec.get("graph_vs_optimize"):
            dynamo += f", its graph called directly {num(rec, 'graph_vs_optimize'):.2f}x optimize"
        vs = f"; backend with records {num(rec, 'vs_optimize'):.2f}x optimize{dynamo}" if rec else ""
        bad = [p for p, r in mine.items() if r.get("outputs_ok") != "True"]
        parts.append(f"{net} b{batch}: {cells}{vs}" + (f" (outputs differ: {', '.join(bad)})" if bad else ""))
    return "; ".join(parts) + " (over torch eager, same rounds)"


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, quick="ResNet-18 only, 3 rounds")
    ap.add_argument("--networks", default=NETWORKS, help=f"comma-separated (default {NETWORKS})")
    ap.add_argument("--batch", type=int, default=1, help="images per inference (default 1)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 7, quick 3)")
    ap.add_argument("--records", type=Path, default=None,
                    help="folder for the records, optimize outputs and saved models (default: a temporary one)")
    ap.add_argument("--start-from", type=Path, default=None,
                    help="a records file copied into the records folder first, as its maco_records.jsonl (tuned "
                         "records; the file itself is never written)")
    args = ap.parse_args(argv)
    if args.start_from and not args.start_from.is_file():
        ap.error(f"--start-from {args.start_from} is not a file")
    from maco.layouts.networks import NETWORKS as KNOWN

    nets = ["resnet18"] if args.quick else [n.strip() for n in args.networks.split(",") if n.strip()]
    unknown = [n for n in nets if n not in KNOWN and n not in LOCAL]
    if unknown or args.batch < 1:
        ap.error(f"unknown network(s) {unknown}" if unknown else f"--batch must be positive, got {args.batch}")
    rounds = args.rounds or (3 if args.quick else 7)
    logging.basicConfig(level=logging.WARNING)
    out = out_dir(args)
    path = out / "deployment_cpu.csv"
    redone = {(net, str(args.batch)) for net in nets}  # rows of other networks and batch sizes are kept
    kept = [r for r in read_rows(path) if (r["network"], r["batch"]) not in redone] if path.is_file() else []
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="maco-deployment-") as tmp:
        folder = args.records or Path(tmp)
        if args.start_from:
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(args.start_from, folder / "maco_records.jsonl")
        for net in nets:
            rows += run_network(net, args.batch, folder, rounds)
            write_csv(path, kept + rows, COLUMNS, floats=".5g")  # each network kept as soon as it is done
    write_env(path, rounds=rounds, torch_threads=torch.get_num_threads())
    plot(kept + rows, out / "deployment_cpu.png")
    print_table(f"batch {args.batch}, {rounds} rounds", ["network", "path", "ms", "speedup", "vs optimize", "s",
                "rel err", "dynamo ms"], [[r["network"], r["path"], f"{r['ms']:.2f}", f"{r['speedup']:.2f}",
                                          f"{r['vs_optimize']:.3f}", f"{r['seconds']:.1f}",
                                          f"{r['max_rel_err']:.1e}", f"{r['dynamo_ms']:.3f}" if r["dynamo_ms"] else ""]
                                         for r in rows])
    print(summarise([{k: str(v) for k, v in r.items()} for r in rows]))
    print(f"wrote {path} and {path.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
