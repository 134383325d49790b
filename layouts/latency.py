"""Latency sources for layout planning: one conv in one layout, and one tensor's layout conversion,
measured in-process with torch (oneDNN on CPU, cuDNN on GPU) by the protocol of maco.core.timing, plus a
small model that predicts a conversion's cost from the tensor's size.

Layouts are the two torch memory formats of a 4-D tensor: "NCHW" (contiguous) and "NHWC"
(torch.channels_last). A conv measured in "NHWC" has its input and its weights in channels_last,
as a deployed model that converted its weights ahead of time would.
"""
from __future__ import annotations

import json
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from maco.core.errors import MacoError
from maco.core.files import load_json_file, write_atomic
from maco.kernels.baselines import torch_conv
from maco.core.spec import DTYPE_BYTES, ConvSpec
from maco.core.timing import (Timing, interleaved_rounds, pool_referenced, pool_timings, steady_allocator,
                         time_callable)

LAYOUTS: tuple[str, ...] = ("NCHW", "NHWC")
_FORMATS = {"NCHW": torch.contiguous_format, "NHWC": torch.channels_last}


def check_layout(layout: str) -> str:
    """The layout name, upper-cased, or a MacoError naming it."""
    name = layout.upper() if isinstance(layout, str) else layout
    if name not in _FORMATS:
        raise MacoError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    return name


def memory_format(layout: str) -> torch.memory_format:
    return _FORMATS[check_layout(layout)]


def check_device(device: str | torch.device) -> torch.device:
    """A torch device that exists here, or a MacoError naming the one asked for."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise MacoError(f"unknown device {device!r}; use 'cpu' or 'cuda'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise MacoError(f"device {device!r} asked for but torch sees no CUDA GPU here")
    if dev.type not in ("cpu", "cuda"):
        raise MacoError(f"device {device!r} is not supported; use 'cpu' or 'cuda'")
    return dev


def _sync(dev: torch.device):
    return (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else None


@contextmanager
def strict_cudnn(benchmark: bool) -> Iterator[None]:
    """fp32 without TF32 (the comparison the paper makes), cuDNN's autotuner on or off."""
    saved = (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
             torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.benchmark = benchmark
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
         torch.backends.cuda.matmul.allow_tf32) = saved


def conv_callable(spec: ConvSpec, layout: str, device: str | torch.device = "cpu"):
    """A no-argument function running the conv once, on random data in the given layout."""
    steady_allocator()
    check_layout(layout)
    dev = check_device(device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(spec.input_shape, generator=gen).to(dev)
    return torch_conv(spec, x, torch.randn(spec.weight_shape, generator=gen).to(dev), layout)


def measure_conv(spec: ConvSpec, layout: str, device: str | torch.device = "cpu", *,
                 repeats: int = 5, min_run_time: float = 1e-3, warmup: int = 2,
                 cudnn_benchmark: bool = True) -> Timing:
    """Seconds per call of torch's conv2d for `spec` with input and weights in `layout`."""
    dev = check_device(device)
    run = conv_callable(spec, layout, dev)
    with strict_cudnn(cudnn_benchmark):
        return time_callable(run, repeats=repeats, min_run_time=min_run_time, warmup=warmup,
                             sync=_sync(dev))


def measure_layouts(spec: ConvSpec, layouts: Sequence[str] = LAYOUTS,
                    device: str | torch.device = "cpu", *, rounds: int = 3, repeats: int = 3,
                    min_run_time: float = 1e-3, cudnn_benchmark: bool = True,
                    reference: Callable[[], Any] | None = None) -> dict[str, Timing]:
    """Every layout of one conv, timed in interleaved rounds so that a load change on a shared
    machine hits both layouts alike; each layout's Timing pools its rounds' samples. With a
    `reference` (e.g. kernels.cpu_peak.fma_reference(spec.flops)) timed in every round too, each
    Timing also carries the reference's seconds and the median per-round ratio to it."""
    dev = check_device(device)
    runs = {check_layout(lay): conv_callable(spec, lay, dev) for lay in layouts}
    if reference is not None:
        runs[_REFERENCE] = reference
    with strict_cudnn(cudnn_benchmark):
        for run in runs.values():
            run()  # the first call builds oneDNN/cuDNN primitives: off the clock
        per_round = interleaved_rounds(runs, rounds, repeats=repeats, min_run_time=min_run_time,
                                       sync=_sync(dev))
    ref = per_round.pop(_REFERENCE, None)
    return {lay: pool_referenced(ts, ref) if ref else pool_timings(ts) for lay, ts in per_round.items()}


_REFERENCE = "reference"


# -- layout conversions -------------------------------------------------------------------------
def _check_shape(shape: Sequence[int]) -> tuple[int, int, int, int]:
    shape = tuple(shape)
    if len(shape) != 4 or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                                  and v > 0 for v in shape):
        raise MacoError(f"a tensor shape must be 4 positive ints (n, c, h, w), got {shape!r}")
    return tuple(int(v) for v in shape)  # type: ignore[return-value]


def measure_conversion(shape: Sequence[int], src: str, dst: str,
                       device: str | torch.device = "cpu", *, repeats: int = 5,
                       min_run_time: float = 1e-3) -> Timing:
    """Seconds to copy an fp32 tensor of logical `shape` (n, c, h, w) from layout `src` to `dst`.
    Equal layouts cost nothing (a zero Timing with repeats=0); so does a shape for which both
    layouts are the same memory order (c == 1 or h == w == 1): torch returns the tensor as is."""
    shape, src, dst, dev = _check_shape(shape), check_layout(src), check_layout(dst), check_device(device)
    if src == dst:
        return Timing(0.0, 0.0, 0.0, 0.0, 0, 0)
    steady_allocator()
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dev)
    x = x.contiguous(memory_format=_FORMATS[src])
    fmt = _FORMATS[dst]
    return time_callable(lambda: x.contiguous(memory_format=fmt), repeats=repeats,
                         min_run_time=min_run_time, sync=_sync(dev))


def conversion_bytes(shape: Sequence[int]) -> int:
    return math.prod(_check_shape(shape)) * DTYPE_BYTES


def _trivial(shape: tuple[int, int, int, int]) -> bool:
    """Both memory orders coincide: nothing to move."""
    _, c, h, w = shape
    return c == 1 or h * w == 1


# Activation shapes of typical CNN layers: the default calibration set of a ConversionModel.
CALIBRATION_SHAPES: tuple[tuple[int, int, int, int], ...] = tuple(
    (1, c, s, s) for c in (3, 16, 32, 64, 128, 256, 512, 1024) for s in (7, 14, 28, 56, 112, 224)
    if c * s * s * DTYPE_BYTES <= 16 << 20)


@dataclass
class ConversionModel:
    """Conversion seconds from the tensor's size, per direction: log(seconds) is a piecewise-linear
    function of log(bytes) (hinges at quartiles of the calibration sizes) plus a term in log(c),
    since gathering many channels per pixel (NHWC -> NCHW) runs at half the bandwidth of few.
    Fitted robustly (soft-L1), so a timing spike on a shared machine does not bend the curve.
    Below the smallest calibration size the time is held; beyond the largest it grows as bytes."""

    coefs: dict[str, list[float]] = field(default_factory=dict)  # "NCHW->NHWC": basis weights
    knots: dict[str, list[float]] = field(default_factory=dict)  # log bytes: hinges, then [lo, hi]
    device: str = "cpu"

    @staticmethod
    def key(src: str, dst: str) -> str:
        return f"{check_layout(src)}->{check_layout(dst)}"

    @staticmethod
    def _basis(lb: np.ndarray, lc: np.ndarray, hinges: Sequence[float]) -> np.ndarray:
        cols = [np.ones_like(lb), lb, *[np.maximum(0.0, lb - k) for k in hinges], lc]
        return np.stack(cols, axis=-1)

    @classmethod
    def fit(cls, samples: Sequence[tuple[Sequence[int], str, str, float]],
            device: str = "cpu") -> "ConversionModel":
        """From (shape, src, dst, seconds) samples; trivial and same-layout samples are ignored."""
        from scipy.optimize import least_squares

        by_dir: dict[str, list[tuple[float, float, float]]] = {}
        for shape, src, dst, seconds in samples:
            shape = _check_shape(shape)
            if check_layout(src) == check_layout(dst) or _trivial(shape) or seconds <= 0:
                continue
            by_dir.setdefault(cls.key(src, dst), []).append(
                (math.log(conversion_bytes(shape)), math.log(shape[1]), math.log(seconds)))
        coefs, knots = {}, {}
        for key, pts in by_dir.items():
            arr = np.array(pts)
            lb, lc, lt = arr[:, 0], arr[:, 1], arr[:, 2]
            hinges = [] if len(arr) < 8 else list(np.quantile(lb, [0.25, 0.5, 0.75]))
            a = cls._basis(lb, lc, hinges)
            x0 = np.linalg.lstsq(a, lt, rcond=None)[0]
            res = least_squares(lambda c: a @ c - lt, x0, loss="soft_l1", f_scale=0.1)
            coefs[key] = [float(v) for v in res.x]
            knots[key] = [float(k) for k in hinges] + [float(lb.min()), float(lb.max())]
        if not coefs:
            raise MacoError("no usable conversion samples to fit (all trivial, same-layout or non-positive)")
        return cls(coefs=coefs, knots=knots, device=device)

    @classmethod
    def calibrate(cls, device: str | torch.device = "cpu",
                  shapes: Sequence[Sequence[int]] = CALIBRATION_SHAPES,
                  pairs: Sequence[tuple[str, str]] = (("NCHW", "NHWC"), ("NHWC", "NCHW")),
                  min_run_time: float = 5e-4) -> "ConversionModel":
        """Measure `shapes` in both directions and fit (about a second on a CPU)."""
        samples = [(s, a, b, measure_conversion(s, a, b, device, repeats=5,
                                                min_run_time=min_run_time).median)
                   for s in shapes for a, b in pairs]
        return cls.fit(samples, device=str(device))

    def predict(self, shape: Sequence[int], src: str, dst: str) -> float:
        shape = _check_shape(shape)
        if check_layout(src) == check_layout(dst) or _trivial(shape):
            return 0.0
        key = self.key(src, dst)
        if key not in self.coefs:
            raise MacoError(f"this conversion model has no fit for {key}; it knows {sorted(self.coefs)}")
        *hinges, lo, hi = self.knots[key]
        lb = math.log(conversion_bytes(shape))
        clamped = min(max(lb, lo), hi)
        row = self._basis(np.array([clamped]), np.array([math.log(shape[1])]), hinges)[0]
        return math.exp(float(row @ np.array(self.coefs[key])) + max(0.0, lb - hi))

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "coefs": self.coefs, "knots": self.knots}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ConversionModel":
        try:
            coefs = {str(k): [float(x) for x in v] for k, v in d["coefs"].items()}
            knots = {str(k): [float(x) for x in v] for k, v in d["knots"].items()}
            if set(coefs) != set(knots) or any(len(coefs[k]) != len(knots[k]) + 1 for k in coefs):
                raise ValueError("coefs and knots do not match")
            return cls(coefs=coefs, knots=knots, device=str(d.get("device", "cpu")))
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise MacoError(f"not a conversion model: {exc!r}") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        write_atomic(Path(path), json.dumps(self.to_dict(), indent=1).encode())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "ConversionModel":
        return cls.from_dict(load_json_file(path, "conversion model"))


_DEFAULT_MODELS: dict[str, ConversionModel] = {}


def predict_conversion(shape: Sequence[int], src: str, dst: str, device: str = "cpu",
                       model: ConversionModel | None = None) -> float:
    """Predicted seconds to convert a tensor of `shape` from `src` to `dst`. Without a `model`,
    one is calibrated on this machine on first use (about a second) and kept for the process."""
    if model is None:
        dev = str(check_device(device))
        if dev not in _DEFAULT_MODELS:
            _DEFAULT_MODELS[dev] = ConversionModel.calibrate(dev)
        model = _DEFAULT_MODELS[dev]
    return model.predict(shape, src, dst)


__all__ = ["LAYOUTS", "ConversionModel", "check_layout", "check_device", "conv_callable",
           "measure_conv", "measure_layouts", "measure_conversion", "predict_conversion",
           "conversion_bytes", "memory_format", "CALIBRATION_SHAPES"]
