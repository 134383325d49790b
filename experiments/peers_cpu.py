"""Issue 4 section 6: MACO next to the tuners a user would pick instead of it, on this CPU.

For each conv layer (NCHW, fp32, batch 1) this tunes and times:
  torch-nchw / torch-nhwc   torch.nn.functional.conv2d (oneDNN), contiguous and channels_last
  halide-adams2019          Halide's Adams2019 autoscheduler (cost-model beam search, no
                            measurements), JIT-compiled for the host, on the NCHW conv with a
                            boundary condition; -nhwc: on the layout of Halide's apps/conv_layer
                            (channels innermost, input padded beforehand); also Li2018 and
                            Mullapudi2016 (the other CPU autoschedulers shipped in the wheel)
  halide-hand               the schedule a Halide user writes by hand, after apps/conv_layer's
                            CPU branch (same layout as -nhwc): vec*tile_w output channels by
                            tile_h output columns in registers (vectorised, unrolled), the conv
                            computed at that tile, the reduction unrolled by 2 over the input
                            channels, rows across the cores; tile_w in 1,2,4 and tile_h in
                            2,4,5,7,8,14 (+ the width's divisors) swept with short timings, each
                            tile checked; trials = tiles tried, the sweep's GFLOP/s in `note`
  tvm-ms                    TVM MetaSchedule (tune_tir on topi.nn.conv2d_nchw, XGBoost cost
                            model + evolutionary search, `--trials` measured candidates)
  maco-default              MACO with no search: maco.kernels.default_schedule (bound-derived),
                            both layouts timed, the faster is the row (0 trials)
  maco                      MACO's tuner (maco.tune.tuning.tune_layers, `--trials` measurements)

Every (layer, tuner) runs in its own worker process (a peer that crashes -- TVM can segfault --
becomes a row with an empty gflops and the reason in `note`), under `flock <--lock>` so that
the two shared cores are not measured by two jobs at once. Every kernel is checked against
torch.nn.functional.conv2d and (except MACO, whose own measurer times its kernels in a worker)
re-timed with maco.core.timing.time_callable in the worker, on warm inputs.

tuning_seconds is the wall time from the algorithm description to a callable kernel (schedule
search + measurements + final compile), not counting the correctness check and the timing; for
halide-hand the whole sweep (every tile compiled, checked and timed); for maco-default deriving
and compiling both layouts' schedules with a cold build cache.

Which Halide a user would ship: on the Intel Xeon (AVX-512, 2 cores) of results/peers_cpu.csv
the hand schedule reached 167-432 GFLOP/s after an 8 s sweep, the best autoscheduler (Adams2019
on the same pre-padded, channels-innermost layout) 26-62, so a Halide user would ship the hand
schedule (summarise() says so per layer from the CSV). It has no blocking of the reduction, so on
14x14x256 every 14-pixel row streams the whole filter from L2 (167, torch channels_last 386).

Peers are optional: `pip install halide==21.0.0 apache-tvm==0.27.0.post1 "apache-tvm-ffi<0.1.15"`
(apache-tvm 0.27.0.post1 segfaults in save_json with apache-tvm-ffi 0.1.15.post2).

  python experiments/peers_cpu.py --quick                       # one layer, tiny budgets, < 5 min
  python experiments/peers_cpu.py --trials 64                   # default layers
  python experiments/peers_cpu.py --layers n1_c256_h14_w14_k256_r3_p1 --tuners tvm-ms,maco
  python experiments/peers_cpu.py --tuners torch-nchw,torch-nhwc,halide-hand --merge
  python experiments/peers_cpu.py --runs 2 --merge --lock /tmp/maco-timing.lock \
      --tuners torch-nchw,torch-nhwc,halide-adams2019,halide-adams2019-nhwc,halide-li2018,\
halide-mullapudi2016,halide-hand,maco-default,maco     # results/peers_cpu.csv (tvm-ms rows: an earlier run)

On a machine other people use too, --runs N runs every (layer, tuner) N times, round after
round, and keeps the fastest (another job only ever slows a run down); each note gives every
run's GFLOP/s and the 1-min load average around the run.

Writes <out>/peers_cpu.csv, <out>/peers_cpu.png and <out>/peers_cpu.env.json (--name: another stem).
The zero-trial default against MetaSchedule after 1000 trials (issue 19):

  python experiments/peers_cpu.py --name peers_cpu_ms1000 --tuners maco-default,tvm-ms --trials 1000 \
      --layers n1_c512_h7_w7_k512_r3_p1,n1_c192_h13_w13_k384_r3_p1 --timeout 7200
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from maco.experiments.common import (Figure, num, parser, print_table, pyplot, read_rows, save_plot, write_csv,
                                     write_env)

FIGURE = Figure(
    "peers", "(not in the paper) the tuners a user would pick instead: Halide (its autoschedulers and an "
    "apps/conv_layer-style hand schedule with its tiles swept) and TVM MetaSchedule", "needs `pip install -e .[peers]`; TVM tunes for about two minutes a layer",
    csv=("peers_cpu.csv",), in_all=False)

DEFAULT_LAYERS = [
    "n1_c64_h56_w56_k64_r3_p1",
    "n1_c256_h14_w14_k256_r3_p1",
    "n1_c128_h28_w28_k128_r3_p1",
    "n1_c192_h13_w13_k384_r3_p1",
]
TUNERS = ["torch-nchw", "torch-nhwc", "halide-adams2019", "halide-adams2019-nhwc",
          "halide-li2018", "halide-mullapudi2016", "halide-hand", "tvm-ms", "maco-default", "maco"]
COLUMNS = ["layer", "tuner", "trials", "tuning_seconds", "gflops", "speedup_vs_torch_best", "note"]
LOCK = "/tmp/maco-timing.lock"
TOL = 2e-3  # max |out - torch| relative to max |torch|


# ----------------------------------------------------------------------------- helpers

def _missing(pkg: str, pip_name: str, exc: BaseException) -> RuntimeError:
    return RuntimeError(f"{pkg} not installed ({type(exc).__name__}: {exc}); "
                        f"pip install {pip_name}  (or pip install -e '.[peers]')")


def _inputs(spec, seed: int = 0):
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((spec.n, spec.c, spec.h, spec.w), dtype=np.float32)
    w = rng.standard_normal((spec.k, spec.c // spec.groups, spec.kh, spec.kw), dtype=np.float32)
    ref = torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w), stride=spec.stride,
                                     padding=spec.padding, dilation=spec.dilation,
                                     groups=spec.groups).numpy()
    return x, w, ref


def _check(out, ref) -> float:
    import numpy as np

    err = float(np.abs(out - ref).max() / max(float(np.abs(ref).max()), 1e-30))
    if not err < TOL:
        raise RuntimeError(f"wrong result: max relative error {err:.2e} vs torch")
    return err


def _time(fn, quick: bool) -> float:
    from maco.core.timing import time_callable

    t = time_callable(fn, repeats=5 if quick else 15, min_run_time=0.05 if quick else 0.2, warmup=3)
    return t.median


def _version(dist: str) -> str:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # noqa: BLE001
        return "?"


def _plain_conv(spec, what: str) -> None:
    if spec.groups != 1 or spec.dilation != (1, 1):
        raise RuntimeError(f"{what}: only groups=1, dilation=1 convs are written here")


# ----------------------------------------------------------------------------- tuners
# Each returns dict(trials, tuning_seconds, seconds, note) or raises.

def run_torch(spec, layout: str, trials: int, quick: bool, workdir: Path) -> dict:
    import torch

    x, w, ref = _inputs(spec)
    xt, wt = torch.from_numpy(x), torch.from_numpy(w)
    if layout == "NHWC":
        xt = xt.contiguous(memory_format=torch.channels_last)
        wt = wt.contiguous(memory_format=torch.channels_last)
    conv = torch.nn.functional.conv2d
    args = dict(stride=spec.stride, padding=spec.padding, dilation=spec.dilation, groups=spec.groups)
    with torch.inference_mode():
        _check(conv(xt, wt, **args).contiguous().numpy(), ref)
        secs = _time(lambda: conv(xt, wt, **args), quick)
    return dict(trials=0, tuning_seconds=0.0, seconds=secs,
                note=f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
                     f"mkldnn={torch.backends.mkldnn.is_available()}")


HALIDE_PARAMS = {
    # parallelism = cores for all three; the Adams2019 cost-model weights are the ones baked into
    # the plugin; Mullapudi2016 gets this machine's L2 (its "last level" cache for one core).
    "Adams2019": lambda t: {"parallelism": str(t.cores)},
    "Li2018": lambda t: {"parallelism": str(t.cores)},
    "Mullapudi2016": lambda t: {"parallelism": str(t.cores),
                                "last_level_cache_size": str(_l2_bytes(t))},
}


def _l2_bytes(target) -> int:
    for level in target.levels:
        if level.name == "L2":
            return int(level.capacity)
    return 1 << 20


def run_halide(spec, algo: str, trials: int, quick: bool, workdir: Path,
               layout: str = "NCHW") -> dict:
    """NCHW: the conv as asked (x innermost, zero padding as a boundary condition). NHWC: the
    layout of Halide's own apps/conv_layer -- channels innermost, an input padded beforehand (no
    boundary-condition stage; the pad is not timed), filter (k, rx, ry, c) with output channels
    innermost -- which lets the autoscheduler vectorise over channels."""
    try:
        import halide as hl
    except ImportError as exc:
        raise _missing("halide", "halide==21.0.0", exc) from None
    import numpy as np

    from maco.core.target import Target

    _plain_conv(spec, "halide")
    target = Target.host()
    lib = Path(hl.__file__).parent / "lib64" / f"libautoschedule_{algo.lower()}.so"
    if not lib.exists():
        raise RuntimeError(f"{lib.name} is not in the halide wheel ({lib.parent})")
    hl.load_plugin(str(lib))

    (sh, sw), (ph, pw) = spec.stride, spec.padding
    t0 = time.perf_counter()
    inp = hl.ImageParam(hl.Float(32), 4, "inp")
    wt = hl.ImageParam(hl.Float(32), 4, "wt")
    x, y, k, n = hl.Var("x"), hl.Var("y"), hl.Var("k"), hl.Var("n")
    r = hl.RDom([(0, spec.c), (0, spec.kw), (0, spec.kh)], "r")
    conv = hl.Func("conv")
    out = hl.Func("out")
    if layout == "NCHW":  # inp (x, y, c, n), wt (rx, ry, c, k): numpy NCHW / KCRS
        padded = hl.BoundaryConditions.constant_exterior(inp, 0.0, [(0, spec.w), (0, spec.h)])
        conv[x, y, k, n] = hl.f32(0)
        conv[x, y, k, n] += (wt[r.y, r.z, r.x, k]
                             * padded[x * sw + r.y - pw, y * sh + r.z - ph, r.x, n])
        out[x, y, k, n] = conv[x, y, k, n]
        inp.set_estimates([(0, spec.w), (0, spec.h), (0, spec.c), (0, spec.n)])
        wt.set_estimates([(0, spec.kw), (0, spec.kh), (0, spec.c), (0, spec.k)])
        out.set_estimates([(0, spec.out_w), (0, spec.out_h), (0, spec.k), (0, spec.n)])
    else:  # inp (c, x, y, n) pre-padded, wt (k, rx, ry, c), out (k, x, y, n): NHWC / CRSK / NHWK
        conv[k, x, y, n] = hl.f32(0)
        conv[k, x, y, n] += wt[k, r.y, r.z, r.x] * inp[r.x, x * sw + r.y, y * sh + r.z, n]
        out[k, x, y, n] = conv[k, x, y, n]
        inp.set_estimates([(0, spec.c), (0, spec.w + 2 * pw), (0, spec.h + 2 * ph), (0, spec.n)])
        wt.set_estimates([(0, spec.k), (0, spec.kw), (0, spec.kh), (0, spec.c)])
        out.set_estimates([(0, spec.k), (0, spec.out_w), (0, spec.out_h), (0, spec.n)])
    pipe = hl.Pipeline(out)
    hl_target = hl.get_jit_target_from_environment()
    params = HALIDE_PARAMS[algo](target)
    if quick and algo == "Adams2019":
        params["beam_size"] = "1"  # greedy: the default beam of 32 takes up to ~200 s here
    pipe.apply_autoscheduler(hl_target, hl.AutoschedulerParams(algo, params))
    fn = pipe.compile_to_callable([inp, wt], hl_target)
    tuning = time.perf_counter() - t0

    xs, ws, ref = _inputs(spec)
    if layout == "NHWC":
        xs, ws = _nhwc_padded(spec, xs, ws)
        o = np.zeros((spec.n, spec.out_h, spec.out_w, spec.k), np.float32)
    else:
        o = np.zeros(ref.shape, np.float32)
    bi, bw, bo = hl.Buffer(xs), hl.Buffer(ws), hl.Buffer(o)  # numpy axes reversed: dim 0 last
    fn(bi, bw, bo)
    _check(o.transpose(0, 3, 1, 2) if layout == "NHWC" else o, ref)
    secs = _time(lambda: fn(bi, bw, bo), quick)
    return dict(trials=0, tuning_seconds=tuning, seconds=secs,
                note=f"halide {_version('halide')} {algo} {layout}"
                     f"{' (input pre-padded)' if layout == 'NHWC' else ''} (model-only search, "
                     f"no measurements; {params}), JIT target {hl_target}, "
                     f"HL_NUM_THREADS={os.environ.get('HL_NUM_THREADS', 'default')}")


def _nhwc_padded(spec, xs, ws):
    """numpy NCHW input / KCRS filter -> the input zero-padded and channels-last (N, H+2p, W+2p, C),
    the filter (C, KH, KW, K) with output channels innermost: Halide sees (c, x, y, n) and
    (k, rx, ry, c) since hl.Buffer reverses numpy's axes."""
    import numpy as np

    (ph, pw) = spec.padding
    xp = np.pad(xs, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    return (np.ascontiguousarray(xp.transpose(0, 2, 3, 1)),
            np.ascontiguousarray(ws.transpose(1, 2, 3, 0)))


# The hand schedule a Halide user writes for a conv (the CPU branch of Halide's apps/conv_layer):
# a tile of vec * tile_w output channels by tile_h output columns held in vector registers,
# the reduction over input channels and taps run around it. Swept over these tile sizes (plus
# the divisors of the output width up to 14), keeping the accumulators within the register file.
HAND_TILE_W = (1, 2, 4)
HAND_TILE_H = (2, 4, 5, 7, 8, 14)


def hand_grid(spec, vec: int, vector_registers: int) -> list[tuple[int, int]]:
    """(tile_w, tile_h) pairs worth trying on this layer: the channel tile fits the output
    channels, the column tile the output width, and tile_w * tile_h accumulators leave at least
    four of the vector registers for the filter vectors and the broadcast input."""
    heights = sorted(set(HAND_TILE_H) | {d for d in range(2, 15) if spec.out_w % d == 0})
    return [(tw, th) for tw in HAND_TILE_W for th in heights
            if vec * tw <= spec.k and th <= spec.out_w and tw * th <= vector_registers - 4]


def _vector_registers(hl_target) -> int:
    import halide as hl

    wide = hl_target.has_feature(hl.TargetFeature.AVX512) or (
        hl_target.arch == hl.TargetArch.ARM and hl_target.bits == 64)
    return 32 if wide else 16


def halide_hand(spec, tile_w: int, tile_h: int, hl_target=None):
    """Compile the hand-scheduled conv for `spec`: a callable f(input, filter, output) on
    hl.Buffers of the pre-padded NHWC input, the (C, KH, KW, K) filter and the NHWC output
    (numpy shapes; see _nhwc_padded). Sizes and strides are fixed at compile time, as in
    apps/conv_layer."""
    import halide as hl

    _plain_conv(spec, "halide")
    hl_target = hl_target or hl.get_jit_target_from_environment()
    vec = hl_target.natural_vector_size(hl.Float(32))
    (sh, sw), (ph, pw) = spec.stride, spec.padding
    cin, kout, kh, kw = spec.c, spec.k, spec.kh, spec.kw
    wp, hp = spec.w + 2 * pw, spec.h + 2 * ph

    inp = hl.ImageParam(hl.Float(32), 4, "inp")  # (c, x, y, n), padded
    wt = hl.ImageParam(hl.Float(32), 4, "wt")  # (k, rx, ry, c)
    k, x, y, n = hl.Var("k"), hl.Var("x"), hl.Var("y"), hl.Var("n")
    r = hl.RDom([(0, cin), (0, kw), (0, kh)], "r")  # r.x input channel, r.y / r.z the taps
    conv, out = hl.Func("conv"), hl.Func("out")
    conv[k, x, y, n] = hl.f32(0)
    conv[k, x, y, n] += wt[k, r.y, r.z, r.x] * inp[r.x, x * sw + r.y, y * sh + r.z, n]
    out[k, x, y, n] = conv[k, x, y, n]

    # compile for this layer's exact sizes and dense strides
    for param, dims in ((inp, (cin, wp, hp, spec.n)), (wt, (kout, kw, kh, cin)),
                        (out.output_buffer(), (kout, spec.out_w, spec.out_h, spec.n))):
        stride = 1
        for d, extent in enumerate(dims):
            param.dim(d).set_bounds(0, extent).set_stride(stride)
            stride *= extent
    out.bound(k, 0, kout).bound(x, 0, spec.out_w).bound(y, 0, spec.out_h).bound(n, 0, spec.n)

    ko, ki, xo, xi = hl.Var("ko"), hl.Var("ki"), hl.Var("xo"), hl.Var("xi")
    # output: channel tile (vectorised, unrolled) inside the column tile (unrolled); the rows
    # (and images, and channel tiles) across the cores
    (out.split(k, ko, ki, vec * tile_w).split(x, xo, xi, tile_h)
        .reorder(ki, xi, xo, y, n, ko)
        .vectorize(ki, vec).unroll(ki).unroll(xi)
        .parallel(y).parallel(n).parallel(ko))
    # the accumulators live at the column tile; the reduction runs around the register tile and
    # is unrolled by 2 over the input channels
    (conv.compute_at(out, xo)
        .vectorize(k, vec).unroll(k).unroll(x).unroll(y)
        .update()
        .reorder(k, x, y, r.x, r.y, r.z, n)
        .vectorize(k, vec).unroll(k).unroll(x).unroll(y)
        .unroll(r.x, 2))
    return out.compile_to_callable([inp, wt], hl_target)


def run_halide_hand(spec, trials: int, quick: bool, workdir: Path,
                    grid: list[tuple[int, int]] | None = None) -> dict:
    """The hand schedule swept over `grid` (default hand_grid): each tile compiled, checked
    against torch and timed briefly; the fastest re-timed by the peers' protocol. The sweep's
    wall time is the tuning time; every tile's GFLOP/s goes into the note."""
    try:
        import halide as hl
    except ImportError as exc:
        raise _missing("halide", "halide==21.0.0", exc) from None
    import numpy as np

    from maco.core.timing import time_callable

    _plain_conv(spec, "halide")
    hl_target = hl.get_jit_target_from_environment()
    vec = hl_target.natural_vector_size(hl.Float(32))
    grid = list(grid) if grid is not None else hand_grid(spec, vec, _vector_registers(hl_target))
    if not grid:
        raise RuntimeError(f"no hand tile fits {spec} (vector width {vec})")
    xs, ws, ref = _inputs(spec)
    xs, ws = _nhwc_padded(spec, xs, ws)
    o = np.zeros((spec.n, spec.out_h, spec.out_w, spec.k), np.float32)
    bi, bw, bo = hl.Buffer(xs), hl.Buffer(ws), hl.Buffer(o)  # numpy axes reversed: dim 0 last

    t0 = time.perf_counter()
    swept: dict[tuple[int, int], float] = {}
    fns = {}
    for tile in grid:
        fn = halide_hand(spec, *tile, hl_target)
        o[...] = 0.0
        fn(bi, bw, bo)
        _check(o.transpose(0, 3, 1, 2), ref)  # every tile must be right, not only the winner
        t = time_callable(lambda fn=fn: fn(bi, bw, bo), repeats=3 if quick else 5,
                          min_run_time=0.02 if quick else 0.05, warmup=2)
        swept[tile], fns[tile] = t.median, fn
    best = min(swept, key=swept.get)
    tuning = time.perf_counter() - t0

    fn = fns[best]
    o[...] = 0.0
    fn(bi, bw, bo)
    _check(o.transpose(0, 3, 1, 2), ref)
    secs = _time(lambda: fn(bi, bw, bo), quick)
    sweep = " ".join(f"{tw}x{th}:{spec.flops / s / 1e9:.0f}" for (tw, th), s in swept.items())
    return dict(trials=len(swept), tuning_seconds=tuning, seconds=secs,
                note=f"halide {_version('halide')} hand schedule (apps/conv_layer style, NHWC, input "
                     f"pre-padded), best tile_w {best[0]} tile_h {best[1]} (vector {vec}); sweep "
                     f"tile_wxtile_h:GFLOP/s {sweep}; JIT target {hl_target}, "
                     f"HL_NUM_THREADS={os.environ.get('HL_NUM_THREADS', 'default')}")

def run_tvm(spec, trials: int, quick: bool, workdir: Path) -> dict:
    try:
        import tvm
        from tvm import te, topi
        from tvm.s_tir import meta_schedule as ms
    except ImportError as exc:
        raise _missing("apache-tvm (with tvm.s_tir.meta_schedule)",
                       "apache-tvm==0.27.0.post1 'apache-tvm-ffi<0.1.15'", exc) from None
    import numpy as np

    from maco.core.target import Target

    _plain_conv(spec, "tvm")
    cores = Target.host().cores
    mcpu = tvm.get_global_func("target.llvm_get_system_cpu")()
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": cores})
    t0 = time.perf_counter()
    a = te.placeholder((spec.n, spec.c, spec.h, spec.w), name="data", dtype="float32")
    b = te.placeholder((spec.k, spec.c, spec.kh, spec.kw), name="weight", dtype="float32")
    o = topi.nn.conv2d_nchw(a, b, spec.stride, spec.padding, spec.dilation, out_dtype="float32")
    func = te.create_prim_func([a, b, o])
    wd = workdir / "tvm_ms"
    db = ms.tir_integration.tune_tir(func, target, str(wd), max_trials_global=trials,
                                     num_trials_per_iter=min(32, trials), num_tuning_cores=cores,
                                     seed=0,
                                     # default 30 s build timeout fails every candidate when the
                                     # shared VM is busy; runner timeout kept generous too
                                     builder=ms.builder.LocalBuilder(timeout_sec=180),
                                     runner=ms.runner.LocalRunner(timeout_sec=120))
    sch = ms.tir_integration.compile_tir(db, func, target)
    if sch is None:
        raise RuntimeError(f"MetaSchedule found no valid schedule in {trials} trials")
    lib = tvm.compile(sch.mod, target=target)
    tuning = time.perf_counter() - t0
    measured = sum(1 for _ in db.get_all_tuning_records())
    curve = metaschedule_curve(wd / "database_tuning_record.json", spec.flops)

    xs, ws, ref = _inputs(spec)
    dev = tvm.cpu()
    xa, wa = tvm.runtime.tensor(xs, dev), tvm.runtime.tensor(ws, dev)
    oa = tvm.runtime.tensor(np.zeros(ref.shape, np.float32), dev)
    f = lib["main"]
    f(xa, wa, oa)
    _check(oa.numpy(), ref)
    secs = _time(lambda: f(xa, wa, oa), quick)
    return dict(trials=measured, tuning_seconds=tuning, seconds=secs, curve=curve,
                note=f"tvm {tvm.__version__} MetaSchedule tune_tir, target llvm -mcpu={mcpu} "
                     f"-num-cores {cores}, xgb + evolutionary")


def metaschedule_curve(records: Path, flops: float) -> list[float]:
    """Best-so-far GFLOP/s after each measured candidate, in the order MetaSchedule committed them
    to its JSON database (one line per candidate: [workload, [trace, run_secs, target, args]];
    a failed build or run has no or non-finite run_secs, which counts as a trial without gain)."""
    best, curve = 0.0, []
    for line in records.read_text().splitlines():
        if not line.strip():
            continue
        secs = json.loads(line)[1][1] or []
        secs = [float(t) for t in secs if isinstance(t, (int, float)) and 0 < float(t) < 1e9]
        if secs:
            best = max(best, flops / (sum(secs) / len(secs)) / 1e9)
        curve.append(best)
    return curve


def run_maco(spec, trials: int, quick: bool, workdir: Path) -> dict:
    import maco.kernels as kernels  # noqa: F401  (the CPU backend the tuner needs)

    if not hasattr(kernels, "build_many"):
        raise RuntimeError("maco.kernels.build_many missing: the CPU kernel backend is not there yet")
    from maco.tune.tuning import tune_layers
    from maco.core.target import Target

    # a cold gcc build cache, like TVM's and Halide's compiles: tuning_seconds counts every build
    os.environ["MACO_CACHE"] = str(workdir / "maco_kernel_cache")
    t0 = time.perf_counter()
    res = tune_layers([(str(spec), spec)], Target.host(), trials,
                      records=workdir / "maco_records.jsonl", baselines=False)[0]
    tuning = time.perf_counter() - t0
    if res.best is None or not res.best.ok:
        raise RuntimeError(f"MACO found no valid kernel in {res.trials} trials")
    sched = res.best.schedule
    # re-time the best kernel here, by the same protocol as the peers (MACO's own measurer time
    # goes into the note)
    import torch

    xs, ws, ref = _inputs(spec)
    conv = kernels.compile(spec, sched, target=Target.host()).bind(ws)
    fmt = torch.channels_last if sched.layout == "NHWC" else torch.contiguous_format
    x = torch.from_numpy(xs).contiguous(memory_format=fmt)
    out = torch.empty(ref.shape, dtype=torch.float32, memory_format=fmt)
    fn = conv.prepare(x, None, out)
    fn()
    _check(out.contiguous().numpy(), ref)
    secs = _time(fn, quick)
    desc = sched.to_dict() if hasattr(sched, "to_dict") else str(sched)
    return dict(trials=res.trials, tuning_seconds=tuning, seconds=secs,
                note=f"maco tune_layers (pruned space, NCHW+NHWC, cold build cache), best {sched.layout}; "
                     f"MACO's measurer said {spec.flops / res.best.seconds / 1e9:.1f} GFLOP/s; "
                     f"schedule {json.dumps(desc, separators=(',', ':'))[:120]}")


def run_maco_default(spec, trials: int, quick: bool, workdir: Path) -> dict:
    """MACO with no search: the bound-derived default schedule (maco.kernels.default_schedule)
    in both layouts, each checked and timed by the peers' protocol; the faster layout is the row,
    the other goes into the note. tuning_seconds: deriving both schedules and compiling them
    with a cold build cache."""
    import torch

    from maco import kernels
    from maco.core.target import Target

    os.environ["MACO_CACHE"] = str(workdir / "maco_kernel_cache")
    target = Target.host()
    xs, ws, ref = _inputs(spec)
    t0 = time.perf_counter()
    scheds = {layout: kernels.default_schedule(spec, target, layout) for layout in ("NCHW", "NHWC")}
    convs = {layout: kernels.compile(spec, sched, target=target).bind(ws) for layout, sched in scheds.items()}
    tuning = time.perf_counter() - t0
    secs = {}
    for layout, conv in convs.items():
        fmt = torch.channels_last if layout == "NHWC" else torch.contiguous_format
        x = torch.from_numpy(xs).contiguous(memory_format=fmt)
        out = torch.empty(ref.shape, dtype=torch.float32, memory_format=fmt)
        fn = conv.prepare(x, None, out)
        fn()
        _check(out.contiguous().numpy(), ref)
        secs[layout] = _time(fn, quick)
    best = min(secs, key=secs.get)
    other = "NCHW" if best == "NHWC" else "NHWC"
    return dict(trials=0, tuning_seconds=tuning, seconds=secs[best],
                note=f"maco.kernels.default_schedule (bound-derived, no search), best layout {best}; "
                     f"{other} {spec.flops / secs[other] / 1e9:.1f} GFLOP/s; schedule "
                     f"{scheds[best].describe()}"[:300])

def run_one(tuner: str, spec_text: str, trials: int, quick: bool, workdir: Path) -> dict:
    from maco.core.spec import ConvSpec

    spec = ConvSpec.parse(spec_text)
    if tuner == "torch-nchw":
        return run_torch(spec, "NCHW", trials, quick, workdir)
    if tuner == "torch-nhwc":
        return run_torch(spec, "NHWC", trials, quick, workdir)
    if tuner == "halide-hand":
        return run_halide_hand(spec, trials, quick, workdir)
    if tuner.startswith("halide-"):
        name = tuner.split("-")[1]
        algo = {"adams2019": "Adams2019", "li2018": "Li2018", "mullapudi2016": "Mullapudi2016"}[name]
        layout = "NHWC" if tuner.endswith("-nhwc") else "NCHW"
        return run_halide(spec, algo, trials, quick, workdir, layout)
    if tuner == "tvm-ms":
        return run_tvm(spec, trials, quick, workdir)
    if tuner == "maco":
        return run_maco(spec, trials, quick, workdir)
    if tuner == "maco-default":
        return run_maco_default(spec, trials, quick, workdir)
    raise ValueError(f"unknown tuner {tuner!r} (known: {', '.join(TUNERS)})")


def worker(argv: list[str]) -> int:
    """`--worker TUNER LAYER TRIALS QUICK WORKDIR RESULT_JSON`: one measurement, JSON out."""
    tuner, layer, trials, quick, workdir, result = argv
    load = os.getloadavg()[0]  # the lock keeps other timers out, not other work: say how busy it was
    try:
        out = run_one(tuner, layer, int(trials), quick == "1", Path(workdir))
        out["ok"] = True
        out["note"] += f" [1-min load {load:.1f} -> {os.getloadavg()[0]:.1f}]"
    except Exception as exc:  # noqa: BLE001 -- a failing peer is a row, not a crash
        msg = f"{type(exc).__name__}: {exc}".replace("\n", " ")
        out = {"ok": False, "note": msg[:400]}
    Path(result).write_text(json.dumps(out))
    return 0


# ----------------------------------------------------------------------------- driver

def _run_worker(tuner: str, layer: str, trials: int, quick: bool, lock: str | None,
                timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="peers_cpu_") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", tuner, layer, str(trials),
               "1" if quick else "0", tmp, str(result)]
        if lock and shutil.which("flock"):
            cmd = ["flock", lock] + cmd
        env = dict(os.environ)
        env.setdefault("HL_NUM_THREADS", str(os.cpu_count() or 1))
        log = Path(tmp) / "log.txt"
        try:
            with open(log, "w") as fh:
                proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                      timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            return {"ok": False, "note": f"timed out after {timeout:.0f} s (lock wait included)"}
        except OSError as exc:
            return {"ok": False, "note": f"worker did not start: {exc}"}
        if result.exists():
            return json.loads(result.read_text())
        tail = [ln for ln in log.read_text(errors="replace").splitlines()
                if ln.strip() and not ln.startswith("  File")][-3:]
        return {"ok": False, "note": f"worker died (exit {rc}): {' | '.join(tail)}"[:400]}


def _gflops(spec, seconds) -> float | None:
    return spec.flops / seconds / 1e9 if seconds else None


def finish_rows(rows: list[dict]) -> None:
    """Fill speedup_vs_torch_best (vs the faster of torch NCHW / channels_last per layer)."""
    best: dict[str, float] = {}
    for r in rows:
        if r["tuner"].startswith("torch") and r["gflops"] not in ("", None):
            best[r["layer"]] = max(best.get(r["layer"], 0.0), float(r["gflops"]))
    for r in rows:
        g, b = r["gflops"], best.get(r["layer"])
        r["speedup_vs_torch_best"] = f"{float(g) / b:.2f}" if g not in ("", None) and b else ""


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    tuners = [t for t in TUNERS if any(r["tuner"] == t for r in rows)]
    width = 0.8 / max(len(tuners), 1)
    fig, ax = plt.subplots(figsize=(max(7, 2.6 * len(layers)), 4.8))
    colors = plt.get_cmap("tab10")
    ymax = max([float(r["gflops"]) for r in rows if r["gflops"] not in ("", None)] or [1.0])
    for j, t in enumerate(tuners):
        for i, layer in enumerate(layers):
            r = next((r for r in rows if r["layer"] == layer and r["tuner"] == t), None)
            if r is None:
                continue
            xpos = i - 0.4 + width * (j + 0.5)
            ok = r["gflops"] not in ("", None)
            g = float(r["gflops"]) if ok else 0.0
            earlier = all(r["note"].startswith("earlier run") for r in rows if r["tuner"] == t)
            ax.bar(xpos, g, width, color=colors(j),
                   label=(t + (" (earlier run)" if earlier else "")) if i == 0 else None)
            if not ok:
                label = "failed"
            elif t.startswith("torch"):
                label = ""
            else:
                label = f"{float(r['tuning_seconds']):.0f}s"
            ax.text(xpos, g + ymax * 0.01, label, ha="center", va="bottom", fontsize=6.5,
                    rotation=90)
    ax.set_xticks(range(len(layers)))
    ax.set_xticklabels([layer.replace("_", "\n", 2) for layer in layers], fontsize=8)
    ax.set_ylabel("GFLOP/s (fp32, batch 1)")
    ax.set_ylim(0, ymax * 1.45)
    ax.set_title("Conv tuners on this CPU (label: tuning wall time)", fontsize=10)
    ax.legend(fontsize=7, ncol=4, loc="upper center")
    fig.tight_layout()
    save_plot(fig, path, dpi=140)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    p = parser(__doc__, quick="one layer, tiny budgets (8 trials), short timing: < 5 min")
    p.add_argument("--trials", type=int, default=None,
                   help="measured candidates per layer for tvm-ms and maco (default 64; quick 8)")
    p.add_argument("--layers", default=None,
                   help=f"comma-separated layer specs (default {','.join(DEFAULT_LAYERS)})")
    p.add_argument("--tuners", default=",".join(TUNERS), help="comma-separated subset of tuners")
    p.add_argument("--lock", default=LOCK,
                   help=f"flock file taken around each (layer, tuner) run (default {LOCK}; "
                        "'' for none)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds one (layer, tuner) run may take, lock wait included")
    p.add_argument("--name", default="peers_cpu",
                   help="output file stem (default peers_cpu; e.g. peers_cpu_ms1000 for a long TVM run "
                        "that should not replace the main table's rows)")
    p.add_argument("--merge", action="store_true",
                   help="keep rows of other (layer, tuner) pairs already in the output CSV")
    p.add_argument("--runs", type=int, default=1,
                   help="run every (layer, tuner) this many times, round after round, and keep the "
                        "fastest (other work on a shared machine only slows a run down; the note "
                        "gives every run's GFLOP/s)")
    args = p.parse_args(argv)

    trials = args.trials if args.trials is not None else (8 if args.quick else 64)
    if trials < 1:
        p.error("--trials must be >= 1")
    if args.runs < 1:
        p.error("--runs must be >= 1")
    layers = ([x.strip() for x in args.layers.split(",") if x.strip()] if args.layers
              else DEFAULT_LAYERS[:1] if args.quick else DEFAULT_LAYERS)
    tuners = [t.strip() for t in args.tuners.split(",") if t.strip()]
    bad = [t for t in tuners if t not in TUNERS]
    if bad:
        p.error(f"unknown tuners {bad}; known: {', '.join(TUNERS)}")
    from maco.core.spec import ConvSpec

    specs = {layer: ConvSpec.parse(layer) for layer in layers}  # fails early on a bad spec
    out = Path(args.out)
    if not re.fullmatch(r"[A-Za-z0-9_-]+", args.name):
        p.error(f"--name must be letters, digits, '_' or '-', got {args.name!r}")
    csv_path = out / f"{args.name}.csv"
    png_path = out / f"{args.name}.png"
    rows = read_rows(csv_path) if args.merge and csv_path.exists() else []
    todo = {(layer, t) for layer in layers for t in tuners}
    rows = [r for r in rows if (r["layer"], r["tuner"]) not in todo]

    seen: dict[tuple[str, str], list[str]] = {}  # every run's GFLOP/s per pair
    for run in range(args.runs):
        for layer in layers:
            for tuner in tuners:
                print(f"[peers_cpu] {layer} {tuner}" + (f" (run {run + 1}/{args.runs})" if args.runs > 1 else "")
                      + " ...", flush=True)
                res = _run_worker(tuner, layer, trials, args.quick, args.lock or None, args.timeout)
                g = _gflops(specs[layer], res.get("seconds")) if res.get("ok") else None
                row = dict(layer=layer, tuner=tuner,
                           trials=res.get("trials", "" if res.get("ok") else 0),
                           tuning_seconds=f"{res['tuning_seconds']:.1f}" if res.get("ok") else "",
                           gflops=(f"{g:.1f}" if g >= 10 else f"{g:.3g}") if g else "", note=res.get("note", ""))
                print(f"[peers_cpu]   -> {row['gflops'] or 'FAILED'} GFLOP/s, tuning "
                      f"{row['tuning_seconds'] or '-'} s; {row['note'][:120]}", flush=True)
                runs = seen.setdefault((layer, tuner), [])
                runs.append(row["gflops"] or "failed")
                old = next((r for r in rows if (r["layer"], r["tuner"]) == (layer, tuner)), None)
                if old is None or num(row, "gflops") > num(old, "gflops") or not old["gflops"]:
                    if old is not None:
                        rows.remove(old)
                    rows.append(row)
                    old = row
                if len(runs) > 1:
                    old["note"] = re.sub(r"^fastest of \d+ runs \([^)]*\); ", "", old["note"])
                    old["note"] = f"fastest of {len(runs)} runs ({' / '.join(runs)} GFLOP/s); {old['note']}"
                finish_rows(rows)
                write_csv(csv_path, rows, COLUMNS)  # after every row: a killed run keeps what it measured

    order = {t: i for i, t in enumerate(TUNERS)}
    layer_order = list(dict.fromkeys([r["layer"] for r in rows]))
    rows.sort(key=lambda r: (layer_order.index(r["layer"]), order.get(r["tuner"], 99)))
    finish_rows(rows)
    write_csv(csv_path, rows, COLUMNS)
    try:
        versions = {"halide": _version("halide")} if any(t.startswith("halide") for t in tuners) else {}
        if "tvm-ms" in tuners:
            versions["tvm"] = _version("apache-tvm")
        write_env(csv_path, trials=trials, quick=args.quick, runs=args.runs, tuners=tuners, layers=layers,
                  **versions)
    except Exception as exc:  # noqa: BLE001
        print(f"[peers_cpu] environment not recorded: {exc}", file=sys.stderr)
    try:
        plot(rows, png_path)
    except Exception as exc:  # noqa: BLE001
        print(f"[peers_cpu] plot failed: {exc}", file=sys.stderr)
    print_table("peers on this CPU", ["layer", "tuner", "trials", "tuning s", "GFLOP/s", "vs torch best", "note"],
                [[r["layer"], r["tuner"], r["trials"], r["tuning_seconds"], r["gflops"],
                  r["speedup_vs_torch_best"], (r["note"] or "")[:60]] for r in rows], width=200)
    print(f"[peers_cpu] wrote {csv_path} and {png_path}")
    return 0


def summarise(rows: list[dict[str, str]]) -> str:
    """REPORT.md: per layer, MACO's (tuned and default) and TVM's GFLOP/s beside Halide's hand
    schedule and its best autoscheduler, and which Halide a user would ship (the faster)."""
    parts, ship = [], []
    for layer in dict.fromkeys(r["layer"] for r in rows):
        sub = {r["tuner"]: r for r in rows if r["layer"] == layer and num(r, "gflops") > 0}
        bits = [f"{t} {num(sub[t], 'gflops'):.0f}" + (f" in {num(sub[t], 'tuning_seconds'):.0f} s"
                                                     if num(sub[t], "tuning_seconds") else "")
                for t in ("maco", "maco-default", "tvm-ms") if t in sub]
        auto = max((r for t, r in sub.items() if t.startswith("halide-") and t != "halide-hand"),
                   key=lambda r: num(r, "gflops"), default=None)
        hand = sub.get("halide-hand")
        if hand:
            m = re.search(r"tile_w (\d+) tile_h (\d+)", hand.get("note", ""))
            bits.append(f"Halide hand {num(hand, 'gflops'):.0f}" + (f" (tile {m[1]}x{m[2]}" if m else " (")
                        + f", sweep {num(hand, 'tuning_seconds'):.0f} s)")
        if auto:
            bits.append(f"best Halide autoscheduler {num(auto, 'gflops'):.0f} ({auto['tuner'][7:]})")
        if hand or auto:
            shipped = max((r for r in (hand, auto) if r), key=lambda r: num(r, "gflops"))
            ship.append("hand" if shipped is hand else shipped["tuner"][7:])
        parts.append(f"{layer}: " + ", ".join(bits) + " GFLOP/s")
    text = "; ".join(parts)
    if ship:
        most = max(dict.fromkeys(ship), key=ship.count)
        text += (f". A Halide user would ship the {'hand schedule' if most == 'hand' else most} "
                 f"(fastest Halide on {ship.count(most)} of {len(ship)} layers)")
    return text

if __name__ == "__main__":
    sys.exit(main())
