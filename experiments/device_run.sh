#!/usr/bin/env bash
# Issue 39 on a lent GPU machine (H100/H200 with 16 CPU cores), in one call: every part under its
# own time limit, so that a slow part costs only its own results. Run from the repository root:
#   bash experiments/device_run.sh     (carry .whl, the xgboost wheel, and .carry/fig15cubin.tgz, the cubins
#   `fig15_kernels_gpu.py --prebuild-only sm_90 --cubin-dir .cubin/fig15` built here, *.cubin and *.sha256 tarred)
# PARTS (default: all of tests fig15 fig17 tune cpu2 wtiles network cpu16) picks the parts, <PART>_S
# (upper case: TESTS_S, FIG15_S, FIG17_S, WTILES_S, NETWORK_S, CPU16_S) their time limits in seconds; RECORDS names
# CUDA records for the network part (default: the tune part's); CPU_NETWORKS the CPU parts' networks.
# Writes $OUT/log.txt (every part's tail), $OUT/device.tgz (full logs, CSVs, plots, records) and, after the
# network part, $OUT/inductor_cache.tgz (carry it back as .carry/inductor_cache.tgz).
set -u
PARTS=${PARTS:-tests fig15 fig17 tune cpu2 wtiles network cpu16}
OUT=${OUT:-/tmp/device-out}
R=/tmp/dev
mkdir -p "$OUT" "$R/res"
LOG=$OUT/log.txt
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
START=$SECONDS

want() { [[ " $PARTS " == *" $1 "* ]]; }
part() {  # part NAME LIMIT_S COMMAND...: the command's output in $R/NAME.log, its tail in the log
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    want "$name" || return 0
    echo "=== $name (limit ${limit} s, at $((SECONDS - START)) s): $*" | tee -a "$LOG"
    timeout -k 5 "$limit" "$@" > "$R/$name.log" 2>&1
    rc=$?
    tail -c 5000 "$R/$name.log" >> "$LOG"
    echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
    tar czf "$OUT/device.tgz" -C "$R" .  # after every part: a call cut short still brings these back
}

{
    date -u; nvidia-smi -L; nproc; lscpu | grep -E 'Model name|^CPU\(s\)|Flags' | cut -c1-200
    python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__, 'cudnn', torch.backends.cudnn.version())"
    command -v ncu gcc nvcc
} >> "$LOG" 2>&1
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >> "$LOG" 2>&1
    export PYTHONPATH=$PWD:/tmp/site
fi

# Inductor's autotuning results (max-autotune benchmarks each conv shape for minutes): carried in as
# .carry/inductor_cache.tgz where an earlier call brought them back, so that its autotuning resumes
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
mkdir -p "$TORCHINDUCTOR_CACHE_DIR"
if [ -f .carry/inductor_cache.tgz ]; then tar xzf .carry/inductor_cache.tgz -C "$TORCHINDUCTOR_CACHE_DIR"; fi
if [ -f .carry/fig15cubin.tgz ]; then mkdir -p .cubin/fig15 && tar xzf .carry/fig15cubin.tgz -C .cubin/fig15; fi
# on cores 0-1, beside the GPU parts (which take cores 2-15; noted with the results), one after
# the other: part 4 at 2 cores, and issue 40's Winograd tile model on this host's CPU
BG=
if want cpu2 || want wtiles; then
    (if want cpu2; then
        timeout -k 5 240 taskset -c 0-1 python3 experiments/threads_cpu.py --out "$R/res" --networks ${CPU_NETWORKS:-resnet18} \
            --engines onnxruntime,maco --rounds 5 > "$R/cpu2.log" 2>&1; echo "=== cpu2: exit $?" >> "$R/cpu2.log"
     fi
     if want wtiles; then
        timeout -k 5 ${WTILES_S:-300} taskset -c 0-1 python3 experiments/winograd_tiles.py --out "$R/res" > "$R/wtiles.log" 2>&1
        echo "=== wtiles: exit $?" >> "$R/wtiles.log"
     fi) &
    BG=$!
fi
G="taskset -c 2-15"
# part 1: today's code on the GPU
part tests ${TESTS_S:-120} $G python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu tests/test_kernels_cuda.py tests/test_target_schedule.py tests/test_cuda_graph.py tests/test_deployment.py tests/test_compile_backend.py
part fig15 ${FIG15_S:-130} $G python3 experiments/fig15_kernels_gpu.py --out "$R/res" --cubin-dir .cubin/fig15
part fig17 ${FIG17_S:-70} $G python3 experiments/fig17_cache.py --out "$R/res"
# part 2: a whole network on the GPU (a short tuning run first, whose records the network uses)
part tune 55 $G python3 -m maco.cli tune resnet18 --target cuda --trials 44 --round 11 --records "$R/res/records_cuda_resnet18.jsonl"
part network ${NETWORK_S:-150} $G python3 experiments/network_gpu.py --out "$R/res" --records "${RECORDS:-$R/res/records_cuda_resnet18.jsonl}" ${NETWORK_ARGS:-}
if want network && [ -d "$TORCHINDUCTOR_CACHE_DIR/cache" ]; then  # written after each shape: kept even when the part ran out
    tar czf "$OUT/inductor_cache.tgz" -C "$TORCHINDUCTOR_CACHE_DIR" cache
fi
if [ -n "$BG" ]; then
    wait $BG
    for f in cpu2 wtiles; do
        [ -f "$R/$f.log" ] && { echo "=== $f (cores 0-1, beside the GPU parts)" >> "$LOG"; tail -c 3000 "$R/$f.log" >> "$LOG"; }
    done
    tar czf "$OUT/device.tgz" -C "$R" .
fi
# part 4: every CPU core (ONNX Runtime and MACO first: Inductor compiles for a minute)
part cpu16 ${CPU16_S:-100} python3 experiments/threads_cpu.py --out "$R/res" --networks ${CPU_NETWORKS:-resnet18} --engines ${CPU16_ENGINES:-onnxruntime,maco,inductor} --rounds 5

echo "=== done after $((SECONDS - START)) s" | tee -a "$LOG"
tar czf "$OUT/device.tgz" -C "$R" .
