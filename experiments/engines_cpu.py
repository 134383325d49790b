"""Issue 18 part 5: the model MACO hands back beside the engines a deployment engineer would try
instead, whole networks at batch 1, fp32, on this CPU (not a figure of the paper).

Engines (torch eager NCHW is the baseline every other one is divided by):
  channels_last   torch eager, model and input in torch.channels_last
  inductor        torch.compile (Inductor) with torch._inductor.config.freezing = True (folds BN,
                  fuses conv post-ops into oneDNN), --inductor-mode default or max-autotune-no-cudagraphs
  onnxruntime     torch.onnx.export -> InferenceSession, ORT_ENABLE_ALL, CPUExecutionProvider,
                  intra-op threads = cores
  openvino        ov.convert_model(model, example_input) -> compile_model("CPU") with
                  INFERENCE_PRECISION_HINT f32 forced (AMX hosts pick bf16 otherwise) and
                  PERFORMANCE_HINT LATENCY
  maco            maco.optimize.optimize(net, budget=--budget): the model it hands back
                  (result.model); tuning records from --records are copied, never appended to

Protocol: every (network, engine) runs in its own subprocess (`--engine E --network N --json F`),
which builds torch eager NCHW beside the engine and times the two alternately, round by round
(maco.timing.interleaved_rounds, glibc's steady allocator, torch threads = cores, everything
under torch.inference_mode). speedup = median of the per-round ratios eager / engine; eager_ms
and engine_ms are the medians of the round medians. Compilation, export and MACO's tuning are
off the clock and reported as compile_s. The engine's output is checked against eager's
(max_rel_err = max |engine - eager| / max |eager|; outputs_ok: below 1e-4). An engine whose
package is missing, that fails, or whose worker dies is a row with a note, never a crash.
Each worker runs under `flock --lock` so that two timing jobs never share the cores.

    pip install -e '.[engines]'      # ONNX Runtime, ONNX and OpenVINO
    python experiments/engines_cpu.py --quick                   # ResNet-18, 3 rounds
    python experiments/engines_cpu.py [--networks resnet18,vgg11] [--engines inductor,maco]
                                      [--records results/records_cpu.jsonl] [--rounds 7]

Writes <out>/engines_cpu.csv, .png and .env.json (engine versions).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from maco.experiments.common import (RESULTS, Figure, num, out_dir, parser, print_table, pyplot, quiet, save_plot,
                                     write_csv, write_env)

FIGURE = Figure(
    "engines", "(not in the paper: it compares MACO with cuDNN/oneDNN kernels, not with inference engines)",
    "whole networks at batch 1 on this CPU against torch.compile, ONNX Runtime and OpenVINO "
    "(`pip install -e .[engines]`; a missing engine is a row with a note)",
    csv=("engines_cpu.csv",), records=True)

NETWORKS = "resnet18,alexnet,vgg11,resnet50,mobilenet_v2"
ENGINES = ("channels_last", "inductor", "onnxruntime", "openvino", "maco")
COLUMNS = ["network", "engine", "eager_ms", "engine_ms", "speedup", "speedup_min", "speedup_max", "rounds",
           "compile_s", "max_abs_diff", "max_rel_err", "outputs_ok", "load", "note"]
LOCK = "/tmp/maco-bench.lock"
RTOL = 1e-4  # outputs_ok: max |engine - eager| / max |eager| below this
DEFAULT_RECORDS = RESULTS / "records_cpu.jsonl"
VERSIONS = ("torch", "onnxruntime", "onnx", "openvino")

Run = Callable[[], Any]  # one inference on the fixed input; returns the output


def _cores() -> int:
    from maco.target import Target

    return Target.host().cores


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _missing(module: str, exc: ImportError) -> RuntimeError:
    return RuntimeError(f"{module} not installed ({exc}); pip install -e '.[engines]'")


def _torch_run(model: Any, x: Any) -> Run:
    """A call under inference_mode, as a deployment would make it (no autograd bookkeeping)."""
    import torch

    def run() -> Any:
        with torch.inference_mode():
            return model(x)

    return run


# -- engines: each returns (run, compile seconds, note) or raises ---------------------------------
def setup_channels_last(net: str, x: Any, args: argparse.Namespace, tmp: Path) -> tuple[Run, float, str]:
    import torch

    from maco.layouts.networks import build

    cl = torch.channels_last
    return _torch_run(build(net).to(memory_format=cl), x.contiguous(memory_format=cl)), 0.0, \
        "torch eager, model and input channels_last"


def setup_inductor(net: str, x: Any, args: argparse.Namespace, tmp: Path) -> tuple[Run, float, str]:
    import torch
    import torch._inductor.config as inductor_config
    from maco.layouts.networks import build

    inductor_config.freezing = True  # weights become constants: BN folded, conv post-ops fused (oneDNN)
    start = time.perf_counter()
    compiled = torch.compile(build(net), mode=args.inductor_mode)
    run = _torch_run(compiled, x)
    run()  # compiles; a second call checks no recompilation is left for the clock
    run()
    return run, time.perf_counter() - start, f"torch.compile mode={args.inductor_mode}, freezing=True"


def export_onnx(net: str, x: Any, path: Path) -> str:
    """The network as an ONNX file; the TorchScript exporter first (the dynamo one needs
    onnxscript), the dynamo one where that fails. Returns which one wrote it."""
    import torch

    from maco.layouts.networks import build

    model, failed = build(net), ""
    for dynamo in (False, True):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(model, (x,), str(path), dynamo=dynamo, input_names=["x"], output_names=["y"],
                                  **({} if dynamo else {"opset_version": 17}))
            return "dynamo exporter" if dynamo else "TorchScript exporter, opset 17"
        except Exception as exc:  # noqa: BLE001 -- try the other exporter
            failed += f"{'dynamo' if dynamo else 'TorchScript'} exporter: {type(exc).__name__}: {exc}; "
    raise RuntimeError(f"torch.onnx.export failed: {failed}")


def setup_onnxruntime(net: str, x: Any, args: argparse.Namespace, tmp: Path) -> tuple[Run, float, str]:
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise _missing("onnxruntime", exc) from None
    start = time.perf_counter()
    exporter = export_onnx(net, x, tmp / f"{net}.onnx")
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.intra_op_num_threads = _cores()
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(tmp / f"{net}.onnx"), opts, providers=["CPUExecutionProvider"])
    feed = {sess.get_inputs()[0].name: x.numpy()}
    run = lambda: sess.run(None, feed)[0]
    run()  # the first run allocates its arena
    return run, time.perf_counter() - start, (f"onnxruntime {ort.__version__}, {exporter}, ORT_ENABLE_ALL, "
                                              f"{opts.intra_op_num_threads} intra-op threads")


def setup_openvino(net: str, x: Any, args: argparse.Namespace, tmp: Path) -> tuple[Run, float, str]:
    try:
        import openvino as ov
    except ImportError as exc:
        raise _missing("openvino", exc) from None
    from maco.layouts.networks import build

    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = ov.convert_model(build(net), example_input=x)
    config = {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY",
              "INFERENCE_NUM_THREADS": _cores()}
    compiled = ov.Core().compile_model(model, "CPU", config)
    request = compiled.create_infer_request()
    xn = x.numpy()
    run = lambda: request.infer({0: xn}, share_inputs=True)[0]
    run()
    precision = compiled.get_property("INFERENCE_PRECISION_HINT")  # what it actually runs in
    precision = getattr(precision, "get_type_name", lambda: precision)()
    return run, time.perf_counter() - start, (f"openvino {_version('openvino')} from the PyTorch model, "
                                              f"precision {precision}, PERFORMANCE_HINT LATENCY, {_cores()} threads")


def setup_maco(net: str, x: Any, args: argparse.Namespace, tmp: Path) -> tuple[Run, float, str]:
    import torch

    from maco.optimize import optimize

    records = tmp / "records_cpu.jsonl"
    if args.records and Path(args.records).is_file():
        shutil.copyfile(args.records, records)  # tuning appends: never to the file given
        given = f"records copied from {args.records}"
    else:
        given = "no records given: tuned from scratch"
    start = time.perf_counter()
    result = optimize(net, budget=args.budget, out=tmp / "maco-out", records=records,
                      log=lambda line: print(line, file=sys.stderr))
    seconds = time.perf_counter() - start
    model = getattr(result, "model", None)
    if model is None:
        raise RuntimeError("optimize() handed back no model (result.model is None)")
    torch.set_num_threads(_cores())  # whatever tuning left behind
    run = _torch_run(model, x)
    run()
    return run, seconds, f"maco optimize --budget {args.budget} handed back '{result.chosen}'; {given}"


SETUP: dict[str, Callable[[str, Any, argparse.Namespace, Path], tuple[Run, float, str]]] = {
    "channels_last": setup_channels_last, "inductor": setup_inductor, "onnxruntime": setup_onnxruntime,
    "openvino": setup_openvino, "maco": setup_maco}


# -- the worker: one (network, engine) beside eager, in this process ------------------------------
def _tensor(out: Any) -> Any:
    import numpy as np
    import torch

    if isinstance(out, (list, tuple)):
        out = out[0]
    if isinstance(out, torch.Tensor):
        return out.detach().float().contiguous().clone()
    return torch.from_numpy(np.array(out, dtype=np.float32))


def measure(engine: str, net: str, args: argparse.Namespace) -> dict[str, Any]:
    """Time `engine` against torch eager NCHW on `net`, alternating round by round."""
    import torch

    from maco.layouts.networks import build, example_input
    from maco.timing import interleaved_rounds, steady_allocator

    if engine not in SETUP:
        raise ValueError(f"unknown engine {engine!r} (known: {', '.join(SETUP)})")
    torch.set_num_threads(_cores())
    steady_allocator()
    x = example_input(1)
    eager = _torch_run(build(net), x)
    with tempfile.TemporaryDirectory(prefix=f"engines_{engine}_") as tmp:
        run, compile_s, note = SETUP[engine](net, x, args, Path(tmp))
        torch.set_num_threads(_cores())
        want, got = _tensor(eager()), _tensor(run())
        diff = float((want - got).abs().max()) if want.shape == got.shape else float("inf")
        rel = diff / (float(want.abs().max()) or 1.0)
        for _ in range(args.warmup):  # first calls build primitives and arenas: off the clock
            eager()
            run()
        load = quiet(args.patience)
        per = interleaved_rounds({"eager": eager, "engine": run}, args.rounds, repeats=args.repeats,
                                 min_run_time=args.min_run_time)
    ratios = [e.median / g.median for e, g in zip(per["eager"], per["engine"])]
    ok = rel < RTOL
    return dict(ok=True, eager_ms=statistics.median(t.median for t in per["eager"]) * 1e3,
                engine_ms=statistics.median(t.median for t in per["engine"]) * 1e3,
                speedup=statistics.median(ratios), speedup_min=min(ratios), speedup_max=max(ratios),
                rounds=len(ratios), compile_s=round(compile_s, 2), max_abs_diff=diff, max_rel_err=rel,
                outputs_ok=ok, load=load,
                note=note + ("" if ok else f"; OUTPUTS DIFFER from eager (relative {rel:.1e} >= {RTOL:g})"))


def worker(args: argparse.Namespace) -> int:
    """`--engine E --network N --json F`: one row as JSON in F; a failing engine writes its reason."""
    try:
        row = measure(args.engine, args.network, args)
    except Exception as exc:  # noqa: BLE001 -- a failing engine is a row, not a crash
        row = {"ok": False, "note": f"{type(exc).__name__}: {exc}".replace("\n", " ")[:400]}
    Path(args.json).write_text(json.dumps(row))
    return 0


# -- the driver ----------------------------------------------------------------------------------
def _worker_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--rounds", str(args.rounds), "--repeats", str(args.repeats), "--min-run-time",
            str(args.min_run_time), "--warmup", str(args.warmup), "--patience", str(args.patience),
            "--budget", args.budget, "--inductor-mode", args.inductor_mode]
    return argv + (["--records", str(args.records)] if args.records else [])


def run_engine(engine: str, net: str, args: argparse.Namespace) -> dict[str, Any]:
    """One (network, engine) in its own process, under the lock; its row (or why it has none)."""
    row: dict[str, Any] = {"network": net, "engine": engine}
    with tempfile.TemporaryDirectory(prefix="engines_cpu_") as tmp:
        result, log = Path(tmp) / "row.json", Path(tmp) / "log.txt"
        cmd = [sys.executable, "-m", "maco.experiments.engines_cpu", "--engine", engine, "--network", net,
               "--json", str(result), *_worker_argv(args)]
        if args.lock and shutil.which("flock"):
            cmd = ["flock", args.lock, *cmd]
        try:
            with open(log, "w") as fh:
                rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=args.timeout,
                                    check=False).returncode
        except subprocess.TimeoutExpired:
            return dict(row, note=f"timed out after {args.timeout:.0f} s (lock wait included)")
        except OSError as exc:
            return dict(row, note=f"worker did not start: {exc}")
        if result.is_file():
            out = json.loads(result.read_text())
            out.pop("ok", None)
            return dict(row, **out)
        tail = [ln.strip() for ln in log.read_text(errors="replace").splitlines()
                if ln.strip() and not ln.startswith("  File")][-3:]
        return dict(row, note=f"worker died (exit {rc}): {' | '.join(tail)}"[:400])


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Grouped bars: each engine's speedup over torch eager NCHW, per network."""
    plt = pyplot()
    nets = list(dict.fromkeys(r["network"] for r in rows))
    seen = list(dict.fromkeys(r["engine"] for r in rows))
    engines = [e for e in ENGINES if e in seen] + [e for e in seen if e not in ENGINES]
    width = 0.8 / max(len(engines), 1)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.9 * len(nets) + 2), 4.6))
    top = max([num(r, "speedup") for r in rows if num(r, "speedup") > 0] + [1.0])
    for j, engine in enumerate(engines):
        for i, net in enumerate(nets):
            r = next((r for r in rows if r["network"] == net and r["engine"] == engine), None)
            if r is None:
                continue
            s = num(r, "speedup")
            ok = s > 0
            xpos = i - 0.4 + width * (j + 0.5)
            ax.bar(xpos, s if ok else 0.0, width, color=plt.get_cmap("tab10")(j), label=engine if i == 0 else None,
                   hatch="" if str(r.get("outputs_ok")) in ("True", "") else "//")
            ax.text(xpos, (s if ok else 0.0) + top * 0.01, f"{s:.2f}" if ok else "n/a", ha="center",
                    va="bottom", fontsize=7, rotation=90)
    ax.axhline(1.0, color="k", lw=0.8, ls="--", label="torch eager NCHW")
    eager = {n: statistics.median(ms) for n in nets
             if (ms := [num(r, "eager_ms") for r in rows if r["network"] == n and num(r, "eager_ms") > 0])}
    ax.set_xticks(range(len(nets)), [f"{n}\n{eager[n]:.1f} ms eager" if n in eager else n for n in nets])
    ax.set_ylabel("speedup over torch eager NCHW (median of per-round ratios)")
    ax.set_ylim(0, top * 1.35)
    ax.set_title("Inference engines, batch 1, fp32, this CPU (hatched: outputs differ from eager)", fontsize=10)
    ax.legend(fontsize=7, ncol=3, loc="upper left")
    fig.tight_layout()
    save_plot(fig, path)


def summarise(rows: list[dict[str, str]]) -> str:
    """REPORT.md: per network, each engine's speedup over eager NCHW, the fastest, MACO's rank."""
    parts = []
    for net in dict.fromkeys(r["network"] for r in rows):
        mine = [r for r in rows if r["network"] == net]
        timed = sorted((r for r in mine if num(r, "speedup") > 0), key=lambda r: -num(r, "speedup"))
        cells = [f"{r['engine']} {num(r, 'speedup'):.2f}x" + ("" if r.get("outputs_ok") == "True" else " (outputs differ)")
                 for r in timed] + [f"{r['engine']} failed" for r in mine if r not in timed]
        text = f"{net}: " + ", ".join(cells)
        if timed:
            text += f"; fastest {timed[0]['engine']}"
        rank = next((i for i, r in enumerate(timed, 1) if r["engine"] == "maco"), None)
        if rank:
            text += f", MACO {rank} of {len(timed)}"
        parts.append(text)
    return "; ".join(parts) + " (speedup over torch eager NCHW, same rounds)"


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, quick="ResNet-18 only, 3 rounds")
    ap.add_argument("--networks", default=NETWORKS, help=f"comma-separated (default {NETWORKS})")
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated (default all)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 7, quick 3)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per engine and round (default 3)")
    ap.add_argument("--min-run-time", type=float, default=0.05, help="seconds one timed run lasts at least")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls of each before the rounds")
    ap.add_argument("--patience", type=float, default=30.0, help="seconds to wait for quiet cores first")
    ap.add_argument("--records", type=Path, default=DEFAULT_RECORDS if DEFAULT_RECORDS.is_file() else None,
                    help="tuning records copied for MACO (default results/records_cpu.jsonl where present)")
    ap.add_argument("--budget", default="quick", help="MACO's tuning budget (default quick)")
    ap.add_argument("--inductor-mode", default="default", choices=["default", "max-autotune-no-cudagraphs"])
    ap.add_argument("--lock", default=LOCK, help=f"flock file around each worker (default {LOCK}; '' for none)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per worker (default 3600)")
    ap.add_argument("--engine", help=argparse.SUPPRESS)  # worker mode
    ap.add_argument("--network", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.rounds = args.rounds or (3 if args.quick else 7)
    if args.engine:
        if not (args.network and args.json):
            ap.error("--engine needs --network and --json")
        return worker(args)
    if args.records and not Path(args.records).is_file():
        ap.error(f"records file not found: {args.records}")
    nets = ["resnet18"] if args.quick else [n.strip() for n in args.networks.split(",") if n.strip()]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in SETUP]
    if unknown:
        ap.error(f"unknown engine(s) {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    out = out_dir(args)
    rows = []
    for net in nets:
        for engine in engines:
            print(f"{net} / {engine} ...", flush=True)
            rows.append(run_engine(engine, net, args))
    path = out / "engines_cpu.csv"
    write_csv(path, rows, COLUMNS, floats=".5g")
    write_env(path, engines=engines, rounds=args.rounds, inductor_mode=args.inductor_mode, budget=args.budget,
              records=str(args.records or ""), **{f"{d}_version": _version(d) for d in VERSIONS})
    plot(rows, out / "engines_cpu.png")
    print_table(f"speedup over torch eager NCHW ({args.rounds} rounds)", ["network", "engine", "eager ms",
                "engine ms", "speedup", "compile s", "rel err", "note"],
                [[r["network"], r["engine"], _fmt(r.get("eager_ms")), _fmt(r.get("engine_ms")),
                  _fmt(r.get("speedup"), ".2f"), _fmt(r.get("compile_s"), ".1f"), _fmt(r.get("max_rel_err"), ".1e"),
                  r.get("note", "")] for r in rows])
    print(summarise([{k: str(v) for k, v in r.items()} for r in rows]))
    print(f"wrote {path}, {path.with_suffix('.png').name} and {path.with_suffix('.env.json').name}")
    return 0


def _fmt(value: Any, spec: str = ".2f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


if __name__ == "__main__":
    raise SystemExit(main())
