"""Conv geometry every layer of MACO shares: the input window a run of outputs reads, what a tile
holds with alpha = 1, and the two averaged reuses (the exact maximal reuse, which needs the
bounds' per-axis counts, is maco.bounds.max_reuse). All work on ints and on numpy arrays."""
from __future__ import annotations

from typing import Any

from maco.core.spec import ConvSpec


def input_extent(outputs: Any, taps: Any, stride: int, dilation: int) -> Any:
    """Input positions from the first to the last one that `outputs` consecutive outputs read with
    `taps` kernel taps: (outputs - 1) * stride + (taps - 1) * dilation + 1."""
    return (outputs - 1) * stride + (taps - 1) * dilation + 1


def input_window(spec: ConvSpec, rows: Any, cols: Any, kh: Any = None, kw: Any = None) -> tuple[Any, Any]:
    """(rows, cols) of the input patch that a rows x cols block of outputs reads, over kh x kw
    taps of the window (the whole window by default)."""
    kh = spec.kh if kh is None else kh
    kw = spec.kw if kw is None else kw
    return (input_extent(rows, kh, spec.stride[0], spec.dilation[0]),
            input_extent(cols, kw, spec.stride[1], spec.dilation[1]))


def footprint(spec: ConvSpec, x: Any, y: Any, z: Any, channels: Any = 1, images: Any = 1,
              groups: Any = 1) -> Any:
    """Elements a tile of x (ow) by y (oh) by z (filters) outputs per image and group holds while
    it slides over `channels` input channels at a time: its outputs, the x' by y' input patch of
    those channels, and their weights. With channels = 1 it is the paper's x*y*z + x'*y' + z*kh*kw."""
    yin, xin = input_window(spec, y, x)
    return groups * (images * x * y * z + images * channels * xin * yin + z * channels * spec.kh * spec.kw)


def paper_reuse(spec: ConvSpec) -> float:
    """The paper's R = kh*kw/stride^2: the average reuse of an input element of a dense layer."""
    return spec.kh * spec.kw / (spec.stride[0] * spec.stride[1])


def tile_reuse(spec: ConvSpec) -> float:
    """R of the tile-shape condition x*y = R*z: taps per input element read, for a large tile.

    Along one axis with k taps, stride s and dilation d, the outputs of a long tile read the inputs
    whose index mod s is one of {i*d mod s : i < k}, so a tile of x outputs reads ~ x * |that set|
    inputs for x*k products: R_axis = k / |{i*d mod s}|. For dense windows it is paper_reuse; it
    is 1 for a strided 1x1 conv (no input is read twice, and the skipped ones are not loaded), and
    dilation counts where it makes a strided window skip inputs. The exact maximal reuse, which
    the lower bound needs (4 instead of 2.25 for 3x3 stride 2), would put the bound's own
    I/O-optimal tiles outside the pruning's tolerance band."""
    def axis(k: int, s: int, d: int) -> float:
        return k / len({(i * d) % s for i in range(k)})

    return axis(spec.kh, spec.stride[0], spec.dilation[0]) * axis(spec.kw, spec.stride[1], spec.dilation[1])


def input_span(spec: ConvSpec, axis: str, out_start: int, outputs: int, tap_start: int,
               taps: int) -> tuple[int, int]:
    """[lo, hi) of the input rows (axis "h") or columns ("w") that `outputs` outputs from
    `out_start` read over `taps` kernel taps from `tap_start`, clipped to the input (padding
    is not stored, so a window at the border is smaller; hi <= lo when it reads only padding)."""
    i = 0 if axis == "h" else 1
    size = spec.h if axis == "h" else spec.w
    lo = out_start * spec.stride[i] - spec.padding[i] + tap_start * spec.dilation[i]
    hi = lo + input_extent(outputs, taps, spec.stride[i], spec.dilation[i])
    return max(lo, 0), min(hi, size)


def max_input_span(spec: ConvSpec, axis: str, outputs: int, taps: int) -> int:
    """The widest clipped span over every block of `outputs` outputs (from multiples of it) and
    `taps` taps (from multiples of them) along `axis`: what a buffer must hold for that axis."""
    n_out = spec.out_h if axis == "h" else spec.out_w
    n_taps = spec.kh if axis == "h" else spec.kw
    return max(max(0, hi - lo) for o in range(0, n_out, outputs) for t in range(0, n_taps, taps)
               for lo, hi in [input_span(spec, axis, o, outputs, t, taps)])
