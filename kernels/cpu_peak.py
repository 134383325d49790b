"""Measured fp32 ceilings of a CPU, timed in C on every core. Nominal peaks use the base clock;
these are what the cores really sustain:

* "fma": independent vector FMAs and nothing else, the machine's peak;
* "microkernel": the instruction mix of a direct-conv register tile with its operands in L1
  (per input channel: 2 weight-vector loads and 14 input broadcasts feeding 28 FMAs into 28
  accumulators). No conv kernel of this shape can beat it, so it tells how much of the gap to
  the FMA peak is the loads' share of the core rather than the kernel's memory traffic;
* reads (`read_bandwidth`, `measure_ceilings`): the rate a level, or DRAM, delivers loads to
  every core, STREAM-style; `measure_ceilings` times DRAM reads and the FMA peak in the same
  rounds, the two ceilings of maco.bounds.network's floor in time."""
from __future__ import annotations

import ctypes
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from functools import lru_cache

from maco.core.errors import MacoError
from maco.core.files import load_json_file, write_atomic
from maco.kernels import cpu_build
from maco.kernels.cpu_codegen import ISA
from maco.core.target import Target

CHAINS = 24  # independent accumulators: > latency x pipes on every x86 core


def source(target: Target) -> str:
    isa = target.isa if target.isa in ISA else None
    if isa:
        vt, lanes, zero, _, set1, fma = ISA[isa][:6]
        decl = f"const {vt} x = {set1}(1.0000001f), y = {set1}(0.9999999f);"
        init = " ".join(f"{vt} a{j} = {set1}({j}.f);" for j in range(CHAINS))
        step = " ".join(f"a{j} = {fma}(a{j}, x, y);" for j in range(CHAINS))
        total = " ".join(f"s = {ISA[isa][8]}(s, a{j});" for j in range(CHAINS))
        sink = (f"float t[{lanes}]; {vt} s = {zero}; {total} {ISA[isa][6]}(t, s); "
                "sink[omp_get_thread_num()] = t[0];")
        head = "#include <immintrin.h>\n"
    else:
        lanes = target.simd_width
        decl = f"float a[{CHAINS}][{lanes}]; const float x = 1.0000001f, y = 0.9999999f;"
        init = f"for (int j = 0; j < {CHAINS}; j++) for (int l = 0; l < {lanes}; l++) a[j][l] = j;"
        step = (f"for (int j = 0; j < {CHAINS}; j++)\n#pragma omp simd\n"
                f"for (int l = 0; l < {lanes}; l++) a[j][l] = a[j][l] * x + y;")
        sink = "float s = 0; for (int j = 0; j < %d; j++) s += a[j][0]; sink[omp_get_thread_num()] = s;" % CHAINS
        head = ""
    return f"""{head}#include <omp.h>
/* flops per thread per iteration: {CHAINS} * {lanes} * 2 */
void maco_run(long iters, int threads, float *sink) {{
  #pragma omp parallel num_threads(threads)
  {{
    {decl}
    {init}
    for (long i = 0; i < iters; i++) {{
      {step}
    }}
    {sink}
  }}
}}
"""


MICRO = (2, 14)  # weight vectors x input points of the register tile: 28 accumulators


def microkernel_source(target: Target, shape: tuple[int, int] = MICRO) -> str:
    """The register-tile mix of `shape` (weight vectors, input points) over a 64-channel,
    L1-resident input block (one broadcast per point and channel, as the generated NHWC kernels do)."""
    vt, lanes, zero, loadu, set1, fma, storeu, _, add = ISA[target.isa]
    kv, points = shape
    accs = kv * points
    init = " ".join(f"{vt} a{j} = {zero};" for j in range(accs))
    loads = " ".join(f"const {vt} b{v} = {loadu}(wq + {v * lanes});" for v in range(kv))
    fmas = " ".join(f"{{ const {vt} x = {set1}(ip[{p * 64}]); " +
                    " ".join(f"a{v * points + p} = {fma}(x, b{v}, a{v * points + p});" for v in range(kv)) + " }"
                    for p in range(points))
    total = " ".join(f"s = {add}(s, a{j});" for j in range(accs))
    return f"""#include <immintrin.h>
#include <omp.h>
/* flops per thread per iteration: {accs} * {lanes} * 2 (iters a multiple of 64) */
void maco_run(long iters, int threads, float *sink) {{
  #pragma omp parallel num_threads(threads)
  {{
    float in[{points} * 64] __attribute__((aligned(64))), w[64 * {kv * lanes}] __attribute__((aligned(64)));
    for (int i = 0; i < {points} * 64; i++) in[i] = 1e-3f * (i % 7);
    for (int i = 0; i < 64 * {kv * lanes}; i++) w[i] = 1e-3f * (i % 5);
    {init}
    for (long i = 0; i < iters; i += 64) {{
      const float *ip = in, *wq = w;
      #pragma GCC unroll 1
      for (int c = 0; c < 64; c++, ip++, wq += {kv * lanes}) {{
        {loads}
        {fmas}
      }}
    }}
    float t[{lanes}]; {vt} s = {zero}; {total} {storeu}(t, s); sink[omp_get_thread_num()] = t[0];
  }}
}}
"""


def _cache_file(target: Target) -> str:
    return str(cpu_build.cache_dir() / "peak.json")


def _check_kind(target: Target, kind: str) -> None:
    if kind not in ("fma", "microkernel"):
        raise MacoError(f"unknown peak kind {kind!r}; choose fma or microkernel")
    if kind == "microkernel" and target.isa not in ISA:
        raise MacoError(f"the microkernel ceiling needs an ISA with intrinsics ({', '.join(ISA)}), "
                        f"not {target.isa!r}")


def flops_runner(target: Target, kind: str = "fma",
                 shape: tuple[int, int] = MICRO) -> Callable[[float], None]:
    """run(flops): that many flops of the "fma" or "microkernel" loop (register tile `shape`) on
    target.cores threads. Timed beside a kernel doing the same flops, it gives the kernel's
    fraction of the ceiling in the same spell of the machine (rounded up to whole loop iterations)."""
    _check_kind(target, kind)
    if min(shape) < 1:
        raise MacoError(f"register tile shape must be positive (weight vectors, points), got {shape}")
    text = source(target) if kind == "fma" else microkernel_source(target, shape)
    lib = ctypes.CDLL(str(cpu_build.build(text, cpu_build.flags_for(target))))
    lib.maco_run.restype = None
    lib.maco_run.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p]
    sink = (ctypes.c_float * 256)()
    lanes = ISA[target.isa][1] if target.isa in ISA else target.simd_width
    per_iter = target.cores * (CHAINS if kind == "fma" else shape[0] * shape[1]) * lanes * 2

    def run(flops: float) -> None:
        lib.maco_run(-(-int(flops) // (per_iter * 64)) * 64, target.cores, ctypes.addressof(sink))
    return run


def fma_reference(flops: float, target: Target) -> Callable[[], None]:
    """The reference every CPU measurement is timed beside (maco.core.timing.time_with_reference): the
    FMA loop doing `flops` on target.cores threads. It reads only registers, so it tracks the
    core's clock and the share of it this VM gets, not the caches or memory; candidate seconds over
    its seconds is the inverse of the fraction of the FMA peak, comparable across spells and days."""
    run = _fma_runner(target)
    return lambda: run(flops)


BUSY_SPREAD = 1.3  # slowest over fastest of the reference's rounds beside a figure: above, the machine was busy
PEAK_NOISE = 0.1  # a share of the FMA peak timed in the same rounds may read this far over 100%; beyond: impossible


def spread(seconds: Sequence[float]) -> float:
    """Slowest over fastest of a timer's rounds (1.0 when they agree; inf when one took no time)."""
    fastest = min(seconds, default=0.0)
    return max(seconds) / fastest if fastest > 0 else math.inf


def peak_share_note(share: float | None, reference_spread: float | None = None, *,
                    spread_of: str = "reference") -> str:
    """What to print beside a fraction of the FMA peak: "" where the figure can stand bare, else why
    it cannot, in brackets with a leading space: a share over 100% (plus PEAK_NOISE) is impossible,
    and the rounds it came from were busy where the reference's times (or, with `spread_of`, what
    spread instead) lay more than BUSY_SPREAD apart."""
    why = []
    if share is not None and share > 1 + PEAK_NOISE:
        why.append(f"impossible: over {1 + PEAK_NOISE:.0%} of the peak")
    if reference_spread is not None and reference_spread > BUSY_SPREAD:
        why.append(f"the machine was busy: {spread_of} spread {reference_spread:.1f}x")
    return f" ({'; '.join(why)}; figure unreliable)" if why else ""


@lru_cache(maxsize=4)
def _fma_runner(target: Target) -> Callable[[float], None]:
    return flops_runner(target, "fma")


def best_gflops(run: Callable[[float], None], flops: float, repeats: int) -> float:
    """GFLOP/s of the fastest of `repeats` runs of a flops_runner (a busy machine measures low)."""
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(flops)
        best = max(best, flops / (time.perf_counter() - t0) / 1e9)
    return best


RECHECK = 1.05  # a quick run this much above the cached peak: the cached one was measured busy
QUICK_FLOPS = 1e9  # per core, one quick run (~10-20 ms on 2 cores)


def _peak_key(target: Target) -> str:
    """The peak cache's key for `target` on this machine: CPU model, ISA and thread count."""
    return f"{Target.host().model}|{target.isa}|{target.cores}"


def _load_peaks(path: str) -> dict[str, float]:
    try:
        known = load_json_file(path, "peak cache", 1 << 20)
    except MacoError:
        known = {}  # missing or damaged: measure again
    if not isinstance(known, dict):
        known = {}
    return {k: float(v) for k, v in known.items() if isinstance(v, (int, float)) and 0 < v < 1e9}


@lru_cache(maxsize=8)
def measure_peak(target: Target, fresh: bool = False, kind: str = "fma") -> float:
    """GFLOP/s of back-to-back FMAs ("fma") or of the register-tile mix ("microkernel", ISAs
    with intrinsics only) on target.cores threads (best of 5 runs of ~0.1 s), cached on disk
    per CPU model, ISA, thread count and kind; the highest measurement is kept (a busy machine
    measures low, never high).

    A value measured while the host was busy would otherwise stay forever (one host kept 34
    GFLOP/s where its FMA loop runs at 85-96), so a cached value is checked once per process by
    a quick run (best of 3 of ~10 ms): where the quick run beats it by more than RECHECK, the
    cache was low, and the full measurement runs again. A quick run below the cache changes
    nothing (that moment is the busy one). This costs ~50 ms per process and key, and never
    lowers the cache; `fresh` always measures in full."""
    _check_kind(target, kind)
    key = _peak_key(target) + ("" if kind == "fma" else f"|{kind}")
    path = _cache_file(target)
    known = _load_peaks(path)
    run = flops_runner(target, kind)
    cached = known.get(key)
    if cached is not None and not fresh:
        quick = best_gflops(run, QUICK_FLOPS * target.cores, 3)
        if quick <= cached * RECHECK:
            return cached
        fresh = True
    best = best_gflops(run, 2.5e10 * target.cores, 5)  # ~0.1 s per run
    gf = max(best, cached or 0.0)
    known = _load_peaks(path)  # another process may have written meanwhile: keep the highest
    known[key] = max(gf, known.get(key, 0.0))
    try:
        write_atomic(path, json.dumps(known, indent=1))
    except OSError:
        pass  # an unwritable cache only costs measuring again next time
    return known[key]


def read_source(target: Target) -> str:
    """Each thread sums its own buffer of n floats `reps` times with 8 independent vector adds per
    step (no add latency chain), so the loop runs at the rate the buffer's level delivers loads.
    Each thread times its own loop (seconds[thread]), after its buffer is allocated and touched;
    -1 where the buffer could not be mapped. The buffers (up to GBs) are mapped and unmapped
    outside malloc's heap, which steady_allocator keeps from ever shrinking."""
    if target.isa not in ISA:
        raise MacoError(f"the bandwidth probe needs an ISA with intrinsics ({', '.join(ISA)}), not {target.isa!r}")
    vt, lanes, zero, loadu, _, _, storeu, _, add = ISA[target.isa]
    init = " ".join(f"{vt} a{j} = {zero};" for j in range(8))
    step = " ".join(f"a{j} = {add}(a{j}, {loadu}(p + i + {j * lanes}));" for j in range(8))
    total = " ".join(f"a0 = {add}(a0, a{j});" for j in range(1, 8))
    return f"""#include <immintrin.h>
#include <sys/mman.h>
#include <omp.h>
/* n: floats per thread, a multiple of {8 * lanes} */
void maco_run(long n, long reps, int threads, float *sink, double *seconds) {{
  #pragma omp parallel num_threads(threads)
  {{
    float *p = mmap(NULL, n * sizeof(float), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    int mapped = p != MAP_FAILED;
    long m = mapped ? n : 0;  /* this thread's floats: none where the mapping failed */
    for (long i = 0; i < m; i++) p[i] = 1e-3f * (i % 11);
    {init}
    #pragma omp barrier
    double t0 = omp_get_wtime();
    for (long r = 0; r < reps; r++)
      for (long i = 0; i < m; i += {8 * lanes}) {{ {step} }}
    seconds[omp_get_thread_num()] = mapped ? omp_get_wtime() - t0 : -1.0;
    {total}
    float t[{lanes}]; {storeu}(t, a0); sink[omp_get_thread_num()] = t[0];
    if (mapped) munmap(p, n * sizeof(float));
  }}
}}
"""


def read_bandwidth(target: Target, bytes_per_core: int, seconds: float = 0.05, repeats: int = 5) -> float:
    """Elements (fp32) per second that all target.cores threads load together from a buffer of
    `bytes_per_core` each (half a level's share: that level's bandwidth), best of `repeats`
    (a busy machine measures low); the loops are timed inside, so the buffers' allocation and first
    touch do not count (a 2 GB buffer's first touch varies by more than two passes over it)."""
    lanes = ISA[target.isa][1] if target.isa in ISA else target.simd_width
    lib = ctypes.CDLL(str(cpu_build.build(read_source(target), cpu_build.flags_for(target))))
    lib.maco_run.restype = None
    lib.maco_run.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    sink = (ctypes.c_float * 256)()
    elapsed = (ctypes.c_double * 256)()
    n = max(8 * lanes, bytes_per_core // 4 // (8 * lanes) * (8 * lanes))

    def per_pass(reps: int) -> float:
        lib.maco_run(n, reps, target.cores, ctypes.addressof(sink), ctypes.addressof(elapsed))
        if min(elapsed[:target.cores]) < 0:
            raise MacoError(f"could not map {bytes_per_core} bytes per core to time reads: out of memory")
        return max(elapsed[:target.cores]) / reps  # the slowest thread ends the pass

    reps = max(1, int(seconds / max(per_pass(1), 1e-7)))
    best = 0.0
    for _ in range(repeats):
        t = per_pass(reps)
        if t > 0:
            best = max(best, n * target.cores / t)
    if best <= 0:
        raise MacoError(f"could not time reads of {bytes_per_core} bytes per core: the machine is too busy")
    return best


def machine_balance(target: Target) -> dict[str, float]:
    """Per cache level: the multiply-adds per element that must cross its outer boundary for the
    cores to run at the FMA peak (maco.bounds.hierarchy, statement 2): the peak's MACs per second
    over the rate the next level out delivers loads (its buffers half its per-core share; beyond
    the last cache, DRAM). Measured here, on every core, each time: never carried between hosts."""
    macs = measure_peak(target) * 1e9 / 2
    caches = [lvl for lvl in target.levels if lvl.name != "registers"]
    out = {}
    for inner, outer in zip(caches, caches[1:] + [None]):
        share = (outer.capacity // outer.processors // 2) if outer else 4 * inner.capacity
        out[inner.name] = macs / read_bandwidth(target, share)
    return out


def dram_bytes_per_core(target: Target) -> int:
    """A per-core buffer whose total is 8x every cache of `target` together (at least 64 MiB per
    core): reads of it come from DRAM, whatever the caches keep."""
    caches = sum(lvl.capacity * max(1, target.cores // max(1, lvl.processors))
                 for lvl in target.levels if lvl.name != "registers")
    return max(64 << 20, 8 * caches // max(1, target.cores))


def measure_ceilings(target: Target, rounds: int = 5) -> dict[str, float]:
    """The FMA peak and the DRAM read bandwidth, timed in the same rounds (one FMA run of ~0.1 s,
    then one STREAM-style pass over `dram_bytes_per_core` per core: summed with 8 independent
    vector adds per step, so loads are all it waits for): each the best of its rounds, beside
    the spread of its rounds (slowest over fastest; above BUSY_SPREAD the machine was busy).

    Returns {"fma_gflops", "read_gbs", "fma_spread", "read_spread", "rounds", "read_bytes",
    "fma_gflops_best", "read_gbs_best"}: the read bandwidth in GB/s of 1e9 bytes over all cores
    together; the *_best are the highest this host ever measured (kept in measure_peak's cache,
    which only rises: a busy moment measures low, never high). A floor in time takes the best:
    with a peak or bandwidth measured low, the "floor" would sit above a quiet run's time."""
    _check_rounds(rounds)
    run = flops_runner(target, "fma")
    flops = 4e9 * target.cores  # ~0.1 s per run at 80 GFLOP/s per core
    per_core = dram_bytes_per_core(target)
    fma, reads = [], []
    for _ in range(rounds):
        fma.append(best_gflops(run, flops, 1))
        reads.append(read_bandwidth(target, per_core, seconds=0.05, repeats=1) * 4 / 1e9)
    key = _peak_key(target)
    path = _cache_file(target)
    known = _load_peaks(path)
    known[key] = max(max(fma), known.get(key, 0.0))
    known[key + "|dram_read_gbs"] = max(max(reads), known.get(key + "|dram_read_gbs", 0.0))
    try:
        write_atomic(path, json.dumps(known, indent=1))
    except OSError:
        pass
    return {"fma_gflops": max(fma), "read_gbs": max(reads), "fma_spread": spread([1 / f for f in fma]),
            "read_spread": spread([1 / r for r in reads]), "rounds": float(rounds),
            "read_bytes": float(per_core * target.cores), "fma_gflops_best": known[key],
            "read_gbs_best": known[key + "|dram_read_gbs"]}


def best_prices(target: Target) -> tuple[float, float]:
    """(FMA peak in flop/s, DRAM read bandwidth in bytes/s): the best this host has shown, from
    measure_peak's cache (checked by its quick run), the bandwidth measured where the cache has
    none yet (measure_ceilings). What the tuner prices Winograd's tile sizes with: cheap where
    the cache is warm, and never a busy moment's low value."""
    read = _load_peaks(_cache_file(target)).get(_peak_key(target) + "|dram_read_gbs")
    if read is None:
        ceilings = measure_ceilings(target, 3)
        return ceilings["fma_gflops_best"] * 1e9, ceilings["read_gbs_best"] * 1e9
    return measure_peak(target) * 1e9, read * 1e9


# Winograd's reference convs, per filter size r: (C, H = W, K), compute-bound with U in the last
# cache, and none of them a layer of the built-in networks the tile model is checked on
WINOGRAD_REFERENCE = {3: (128, 56, 128), 5: (64, 28, 128)}
DEPTHWISE_REFERENCE = (128, 56, 3)  # channels, side and filter size of the depthwise ceiling's conv (no network's)


def winograd_ceilings(target: Target, rounds: int = 5) -> dict[tuple[int, int], float]:
    """{(m, r): the share of the FMA peak Winograd F(m x m, r x r)'s multiplies reach}, timed warm
    on WINOGRAD_REFERENCE[r] (`shares_of_peak`). A property of this host and of MACO's generated
    kernel, like the register-tile ceiling: larger tiles spend more of the core on their transforms
    and hold fewer tiles per block, so they reach less of the peak (maco.bounds.winograd prices it)."""
    import numpy as np
    import torch

    from maco.bounds.winograd import winograd_cost
    from maco.core.spec import ConvSpec
    from maco.kernels.winograd import TILE_SIZES, WinogradKernel, WinogradPlan, winograd_can_run

    _check_rounds(rounds)
    kernels: dict[str, tuple[Callable[[], None], float]] = {}
    keys: dict[str, tuple[int, int]] = {}
    rng = np.random.default_rng(0)
    for r, (c, side, k) in WINOGRAD_REFERENCE.items():
        spec = ConvSpec(1, c, side, side, k, r, r, 1, r // 2)
        if not winograd_can_run(spec, target.simd_width):
            continue
        x = torch.randn(spec.input_shape).contiguous(memory_format=torch.channels_last)
        y = torch.empty(spec.output_shape).contiguous(memory_format=torch.channels_last)
        for m in TILE_SIZES[r]:
            plan = WinogradPlan(spec, bias=False, threads=target.cores, lanes=target.simd_width, m=m)
            kernel = WinogradKernel(plan, target)
            u = plan.pack_weight(rng.standard_normal(spec.weight_shape, dtype=np.float32))
            keys[f"F({m}x{m},{r}x{r})"] = (m, r)
            kernels[f"F({m}x{m},{r}x{r})"] = (lambda kernel=kernel, u=u, x=x, y=y: kernel(x, u, None, None, y),
                                              2.0 * winograd_cost(spec, m).macs)
    return {keys[label]: share for label, share in shares_of_peak(kernels, target, rounds).items()}


def depthwise_ceiling(target: Target, rounds: int = 5) -> float:
    """The share of the FMA peak MACO's depthwise kernel (kernels.depthwise, NHWC) reaches, timed
    warm on DEPTHWISE_REFERENCE (`shares_of_peak`): each output takes r * r multiplies of its own
    inputs and weights, so the kernel waits on loads where a GEMM reuses each one across a register
    tile, and reaches a fraction of the peak that the network reach has to price."""
    import numpy as np
    import torch

    from maco.core.spec import ConvSpec
    from maco.kernels.depthwise import DepthwiseKernel, DepthwisePlan

    _check_rounds(rounds)
    c, side, r = DEPTHWISE_REFERENCE
    spec = ConvSpec(1, c, side, side, c, r, r, 1, r // 2, groups=c)
    plan = DepthwisePlan(spec, "NHWC", bias=False, threads=target.cores, lanes=target.simd_width)
    kernel = DepthwiseKernel(plan, target)
    w = plan.pack_weight(np.random.default_rng(0).standard_normal(spec.weight_shape, dtype=np.float32))
    x = torch.randn(spec.input_shape).contiguous(memory_format=torch.channels_last)
    y = torch.empty(spec.output_shape).contiguous(memory_format=torch.channels_last)
    return shares_of_peak({"depthwise": (lambda: kernel(x, w, None, y), 2.0 * spec.macs)}, target, rounds)["depthwise"]


def shares_of_peak(kernels: dict[str, tuple[Callable[[], None], float]], target: Target,
                   rounds: int) -> dict[str, float]:
    """{label: the share of the FMA peak a kernel reaches}: each (call, flops) timed warm beside the
    FMA loop doing the same flops in the same round, the median of per-round ratios."""
    from maco.core.timing import interleaved_rounds

    fma = flops_runner(target, "fma")
    runs: dict[str, Callable[[], None]] = {}
    for label, (call, flops) in kernels.items():
        runs[label] = call
        runs[f"fma {label}"] = lambda flops=flops: fma(flops)
    timed = interleaved_rounds(runs, rounds, repeats=3, min_run_time=5e-3, warmup=2)
    out = {}
    for label in kernels:
        share = statistics.median(f.min / w.min for f, w in zip(timed[f"fma {label}"], timed[label]))
        out[label] = min(share, 1.0)  # above 1 only where a busy core slowed the FMA loop: noise
    return out


def _check_rounds(rounds: int) -> None:
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise MacoError(f"rounds must be a positive int, got {rounds!r}")
