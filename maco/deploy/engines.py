"""A model beside the inference engines a deployment engineer would try instead of MACO, each
timed in its own process alternating round by round with torch eager NCHW there.

Engines (torch eager NCHW is the baseline every other one is divided by):
  channels_last   torch eager, model and input in torch.channels_last
  inductor        torch.compile (Inductor) with torch._inductor.config.freezing = True (folds BN,
                  fuses conv post-ops into oneDNN), mode `inductor_mode`
  onnxruntime     torch.onnx.export -> InferenceSession, ORT_ENABLE_ALL, CPUExecutionProvider,
                  intra-op threads = cores
  openvino        ov.convert_model(model, example_input) -> compile_model("CPU") with
                  INFERENCE_PRECISION_HINT f32 forced (AMX hosts pick bf16 otherwise) and
                  PERFORMANCE_HINT LATENCY
  maco            the model `maco optimize` handed back, from the file `maco.save` wrote
                  (Job.saved), loaded with maco.load

Protocol: each (model, engine) runs in its own subprocess (`python -m maco.deploy.engines`), which builds
torch eager NCHW beside the engine and times the two alternately, round by round
(maco.core.timing.interleaved_rounds, glibc's steady allocator, torch threads = cores, under
torch.inference_mode): engines that keep their own spinning thread pools never share a process.
speedup = median of the per-round ratios eager / engine; eager_ms and engine_ms are the medians
of the round medians. Compilation, export and loading are off the clock (compile_s). The engine's
output is checked against eager's (max_rel_err = max |engine - eager| / max |eager|; outputs_ok:
below RTOL). An engine whose package is missing, that fails, or whose worker dies is a row with a
note, never a crash.

Used by `maco optimize` (its report's engine table) and experiments/engines_cpu.py.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Sequence

ENGINES = ("channels_last", "inductor", "onnxruntime", "openvino", "maco")
PACKAGES = {"onnxruntime": ("onnxruntime", "onnx"), "openvino": ("openvino",)}  # beyond torch
RTOL = 1e-4  # outputs_ok: max |engine - eager| / max |eager| below this

Run = Callable[[], Any]  # one inference on the fixed input; returns the output


@dataclass
class Job:
    """One model and how to time it; a worker gets it as JSON."""

    model: str  # a built-in network or path/to/file.py:ClassName
    input_shape: tuple[int, ...] = (1, 3, 224, 224)
    weights: str | None = None  # a state_dict file (torch.save) loaded into the model; None: as built
    saved: str | None = None  # the maco engine's model: a file maco.save wrote
    rounds: int = 7
    repeats: int = 3
    min_run_time: float = 0.05
    warmup: int = 3
    patience: float = 30.0  # seconds to wait for quiet cores first
    inductor_mode: str = "default"


def installed(engine: str) -> bool:
    """Whether the packages `engine` needs beyond torch can be imported here."""
    return all(importlib.util.find_spec(p) is not None for p in PACKAGES.get(engine, ()))


def version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cores() -> int:
    from maco.core.target import Target

    return Target.host().cores


def _missing(module: str, exc: ImportError) -> RuntimeError:
    return RuntimeError(f"{module} not installed ({exc}); pip install 'maco[engines]'")


def _torch_run(model: Any, x: Any) -> Run:
    """A call under inference_mode, as a deployment would make it (no autograd bookkeeping)."""
    import torch

    def run() -> Any:
        with torch.inference_mode():
            return model(x)

    return run


def build(job: Job) -> Any:
    """The job's model in eval mode, with its weights."""
    import torch

    from maco.layouts.networks import load_model

    _, model = load_model(job.model)
    if job.weights:
        model.load_state_dict(torch.load(job.weights, weights_only=True))
    return model.eval()


def example(job: Job) -> Any:
    """The fixed input every engine and eager get (the one `maco optimize` tunes on)."""
    import torch

    return torch.randn(*job.input_shape, generator=torch.Generator().manual_seed(0))


# -- engines: each returns (run, compile seconds, note) or raises ---------------------------------
def setup_channels_last(job: Job, x: Any, tmp: Path) -> tuple[Run, float, str]:
    import torch

    cl = torch.channels_last
    return (_torch_run(build(job).to(memory_format=cl), x.contiguous(memory_format=cl)), 0.0,
            "torch eager, model and input channels_last")


def setup_inductor(job: Job, x: Any, tmp: Path) -> tuple[Run, float, str]:
    import torch
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True  # weights become constants: BN folded, conv post-ops fused (oneDNN)
    start = time.perf_counter()
    compiled = torch.compile(build(job), mode=job.inductor_mode)
    run = _torch_run(compiled, x)
    run()  # compiles; a second call checks no recompilation is left for the clock
    run()
    return run, time.perf_counter() - start, f"torch.compile mode={job.inductor_mode}, freezing=True"


def export_onnx(job: Job, x: Any, path: Path) -> str:
    """The model as an ONNX file; the TorchScript exporter first (the dynamo one needs
    onnxscript), the dynamo one where that fails. Returns which one wrote it."""
    import torch

    model, failed = build(job), ""
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


def setup_onnxruntime(job: Job, x: Any, tmp: Path) -> tuple[Run, float, str]:
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise _missing("onnxruntime", exc) from None
    start = time.perf_counter()
    exporter = export_onnx(job, x, tmp / "model.onnx")
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.intra_op_num_threads = _cores()
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(tmp / "model.onnx"), opts, providers=["CPUExecutionProvider"])
    feed = {sess.get_inputs()[0].name: x.numpy()}
    run = lambda: sess.run(None, feed)[0]  # noqa: E731
    run()  # the first run allocates its arena
    return run, time.perf_counter() - start, (f"onnxruntime {ort.__version__}, {exporter}, ORT_ENABLE_ALL, "
                                              f"{opts.intra_op_num_threads} intra-op threads")


def setup_openvino(job: Job, x: Any, tmp: Path) -> tuple[Run, float, str]:
    try:
        import openvino as ov
    except ImportError as exc:
        raise _missing("openvino", exc) from None
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = ov.convert_model(build(job), example_input=x)
    config = {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY",
              "INFERENCE_NUM_THREADS": _cores()}
    compiled = ov.Core().compile_model(model, "CPU", config)
    request = compiled.create_infer_request()
    xn = x.numpy()
    run = lambda: request.infer({0: xn}, share_inputs=True)[0]  # noqa: E731
    run()
    precision = compiled.get_property("INFERENCE_PRECISION_HINT")  # what it actually runs in
    precision = getattr(precision, "get_type_name", lambda: precision)()
    return run, time.perf_counter() - start, (f"openvino {version('openvino')} from the PyTorch model, "
                                              f"precision {precision}, PERFORMANCE_HINT LATENCY, {_cores()} threads")


def setup_maco(job: Job, x: Any, tmp: Path) -> tuple[Run, float, str]:
    from maco.deploy.deployment import load

    if not job.saved:
        raise RuntimeError("the maco engine runs a model maco.save wrote: give the job a saved file")
    start = time.perf_counter()
    model = load(job.saved, build(job))
    run = _torch_run(model, x)
    run()
    return run, time.perf_counter() - start, "the model maco optimize handed back (maco.load)"


SETUP: dict[str, Callable[[Job, Any, Path], tuple[Run, float, str]]] = {
    "channels_last": setup_channels_last, "inductor": setup_inductor, "onnxruntime": setup_onnxruntime,
    "openvino": setup_openvino, "maco": setup_maco}


# -- the worker: one (model, engine) beside eager, in this process --------------------------------
def _tensor(out: Any) -> Any:
    import numpy as np
    import torch

    if isinstance(out, (list, tuple)):
        out = out[0]
    if isinstance(out, torch.Tensor):
        return out.detach().float().contiguous().clone()
    return torch.from_numpy(np.array(out, dtype=np.float32))


def measure(engine: str, job: Job) -> dict[str, Any]:
    """Time `engine` against torch eager NCHW on the job's model, alternating round by round."""
    import torch

    from maco.layouts.canary import Canary
    from maco.core.timing import interleaved_rounds, steady_allocator

    if engine not in SETUP:
        raise ValueError(f"unknown engine {engine!r} (known: {', '.join(SETUP)})")
    torch.set_num_threads(_cores())
    steady_allocator()
    x = example(job)
    eager = _torch_run(build(job), x)
    with tempfile.TemporaryDirectory(prefix=f"maco_engine_{engine}_") as tmp:
        run, compile_s, note = SETUP[engine](job, x, Path(tmp))
        torch.set_num_threads(_cores())
        want, got = _tensor(eager()), _tensor(run())
        diff = float((want - got).abs().max()) if want.shape == got.shape else float("inf")
        rel = diff / (float(want.abs().max()) or 1.0)
        for _ in range(job.warmup):  # first calls build primitives and arenas: off the clock
            eager()
            run()
        load = round(Canary().wait_quiet(patience=job.patience), 2)  # the load before timing
        per = interleaved_rounds({"eager": eager, "engine": run}, job.rounds, repeats=job.repeats,
                                 min_run_time=job.min_run_time)
    ratios = [e.median / g.median for e, g in zip(per["eager"], per["engine"])]
    ok = rel < RTOL
    return dict(ok=True, eager_ms=statistics.median(t.median for t in per["eager"]) * 1e3,
                engine_ms=statistics.median(t.median for t in per["engine"]) * 1e3,
                speedup=statistics.median(ratios), speedup_min=min(ratios), speedup_max=max(ratios),
                rounds=len(ratios), compile_s=round(compile_s, 2), max_abs_diff=diff, max_rel_err=rel,
                outputs_ok=ok, load=load,
                note=note + ("" if ok else f"; OUTPUTS DIFFER from eager (relative {rel:.1e} >= {RTOL:g})"))


def run_engine(engine: str, job: Job, *, lock: str | None = None, timeout: float = 3600.0) -> dict[str, Any]:
    """One (model, engine) in its own process (under `flock lock` where given); its row, or why it
    has none."""
    row: dict[str, Any] = {"engine": engine}
    with tempfile.TemporaryDirectory(prefix="maco_engines_") as tmp:
        job_file, result, log = Path(tmp) / "job.json", Path(tmp) / "row.json", Path(tmp) / "log.txt"
        job_file.write_text(json.dumps(asdict(job)))
        cmd = [sys.executable, "-m", "maco.deploy.engines", "--engine", engine, "--job", str(job_file), "--json", str(result)]
        if lock and shutil.which("flock"):
            cmd = ["flock", lock, *cmd]
        try:
            with open(log, "w") as fh:
                rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            return dict(row, note=f"timed out after {timeout:.0f} s (lock wait included)")
        except OSError as exc:
            return dict(row, note=f"worker did not start: {exc}")
        if result.is_file():
            out = json.loads(result.read_text())
            out.pop("ok", None)
            return dict(row, **out)
        tail = [ln.strip() for ln in log.read_text(errors="replace").splitlines()
                if ln.strip() and not ln.startswith("  File")][-3:]
        return dict(row, note=f"worker died (exit {rc}): {' | '.join(tail)}"[:400])


def compare(job: Job, engines: Sequence[str], *, lock: str | None = None, timeout: float = 3600.0,
            log: Callable[[str], Any] = print) -> list[dict[str, Any]]:
    """A row per engine (run_engine), in order."""
    rows = []
    for engine in engines:
        log(f"      {job.model} under {engine} beside torch eager, in its own process ...")
        rows.append(run_engine(engine, job, lock=lock, timeout=timeout))
    return rows


def main(argv: list[str] | None = None) -> int:
    """The worker: `--engine E --job JOB.json --json OUT.json` writes one row (or why it failed)."""
    ap = argparse.ArgumentParser(prog="python -m maco.deploy.engines", description=main.__doc__)
    ap.add_argument("--engine", required=True, choices=list(SETUP))
    ap.add_argument("--job", required=True)
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    try:
        fields = json.loads(Path(args.job).read_text())
        job = Job(**{**fields, "input_shape": tuple(fields.get("input_shape", Job.input_shape))})
        row = measure(args.engine, job)
    except Exception as exc:  # noqa: BLE001 -- a failing engine is a row, not a crash
        row = {"ok": False, "note": f"{type(exc).__name__}: {exc}".replace("\n", " ")[:400]}
    Path(args.json).write_text(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
