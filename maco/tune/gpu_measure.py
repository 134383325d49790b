"""Timing on the GPU by the MACO protocol, with CUDA events through CuPy, and cuDNN baselines.

Why a spin kernel: batch-1 convolutions run for microseconds, less than Python needs to launch
them, so events around back-to-back launches would time the host. Each run therefore starts
with a kernel that busy-waits long enough for the host to queue all its launches; the events
then see the GPU alone. `cold=True` flushes L2 before every single launch (weights and inputs
come from HBM, as for a layer whose data was evicted); warm runs leave them in L2, as for a layer
whose input was just written by the previous one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from maco.core.errors import MacoError
from maco.core.spec import ConvSpec
from maco.core.timing import Timing

_SPIN = r"""
extern "C" __global__ void maco_spin(long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) { }
}
"""
HOST_LAUNCH_SECONDS = 40e-6  # generous upper bound of one launch from Python (torch or CuPy)


class GpuTimer:
    """Events-based timer on CuPy's current stream (the legacy default stream that torch uses too)."""

    def __init__(self) -> None:
        from maco.kernels.cuda import cupy_module

        self.cp = cp = cupy_module()
        dev = cp.cuda.Device()
        attrs = dev.attributes
        self.clock_hz = attrs.get("ClockRate", 1_980_000) * 1e3
        l2 = attrs.get("L2CacheSize", 50 << 20)
        self.flush_buf = cp.empty(max(2 * l2, 64 << 20) // 4, dtype=cp.float32)
        self._spin = cp.RawKernel(_SPIN, "maco_spin")
        self.name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()

    def spin(self, seconds: float) -> None:
        self._spin((1,), (1,), (self.cp.int64(int(seconds * self.clock_hz)),))

    def flush(self) -> None:
        self.flush_buf.fill(0)

    def _elapsed(self, fn: Callable[[], Any], number: int, cold: bool) -> float:
        cp = self.cp
        start, end = cp.cuda.Event(), cp.cuda.Event()
        self.spin(number * HOST_LAUNCH_SECONDS + 50e-6)
        if cold:
            self.flush()
        start.record()
        for _ in range(number):
            fn()
        end.record()
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end) * 1e-3 / number

    def time(self, fn: Callable[[], Any], *, repeats: int = 15, warmup: int = 3,
             min_run_time: float = 3e-4, max_number: int = 200, cold: bool = False) -> Timing:
        """Seconds per call: median of `repeats` runs. Warm runs hold `number` back-to-back
        calls with `number` grown until a run lasts `min_run_time`; cold runs time one call
        after an L2 flush."""
        for _ in range(warmup):
            fn()
        self.cp.cuda.runtime.deviceSynchronize()
        number = 1
        if not cold:
            one = self._elapsed(fn, 3, False)
            number = max(1, min(max_number, math.ceil(min_run_time / max(one, 1e-7))))
        samples = [self._elapsed(fn, number, cold) for _ in range(repeats)]
        return Timing.from_samples(samples, number)


@dataclass
class CudnnConv:
    """torch's conv2d on the GPU in strict fp32 (TF32 off), cuDNN's default algorithm or, with
    benchmark=True, the fastest it finds; NCHW or channels_last (NHWC)."""

    spec: ConvSpec
    layout: str = "NCHW"
    benchmark: bool = False

    def prepare(self, x: Any, w: Any) -> Callable[[], Any]:
        import torch

        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.enabled = True
        if self.layout not in ("NCHW", "NHWC"):
            raise MacoError(f"layout must be NCHW or NHWC, got {self.layout!r}")
        fmt = torch.channels_last if self.layout == "NHWC" else torch.contiguous_format
        x = x.contiguous(memory_format=fmt)
        w = w.contiguous(memory_format=fmt)
        s, bench = self.spec, self.benchmark
        conv = torch.nn.functional.conv2d

        def run() -> Any:
            torch.backends.cudnn.benchmark = bench
            return conv(x, w, None, s.stride, s.padding, s.dilation, s.groups)

        return run


def cudnn_version() -> int | None:
    import torch

    return torch.backends.cudnn.version()
