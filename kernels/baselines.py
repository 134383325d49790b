"""The vendor baseline every MACO kernel is compared with: torch's conv2d (oneDNN on CPU, cuDNN on
GPU) in either layout, its input and weight converted once, outside the timed call."""
from __future__ import annotations

import functools
from typing import Any, Callable

from maco.core.errors import MacoError
from maco.core.spec import ConvSpec


def torch_conv(spec: ConvSpec, x: Any, w: Any, layout: str) -> Callable[[], Any]:
    """A no-argument function running torch's conv2d of `spec` on x and w in `layout`."""
    import torch

    fmt = torch.channels_last if layout == "NHWC" else torch.contiguous_format
    xl, wl = x.contiguous(memory_format=fmt), w.contiguous(memory_format=fmt)

    def fn() -> Any:
        with torch.no_grad():
            return torch.nn.functional.conv2d(xl, wl, None, spec.stride, spec.padding, spec.dilation,
                                              spec.groups)
    return fn


@functools.lru_cache(maxsize=65536)
def torch_backend(spec: ConvSpec, layout: str) -> str:
    """Which of its CPU implementations torch's conv2d picks for `spec` in `layout` (as torch_conv
    calls it): "Mkldnn" (oneDNN), "Slow2d" (im2col and a GEMM), "SlowDilated2d", ... A shape just
    past one of torch's thresholds runs another library, so its time is not its neighbours'."""
    import torch

    fmt = torch.channels_last if layout == "NHWC" else torch.contiguous_format
    x = torch.empty(spec.input_shape, memory_format=fmt)  # never touched: no pages are written
    w = torch.empty(spec.weight_shape, memory_format=fmt)
    select = getattr(torch._C, "_select_conv_backend", None)
    if select is None:
        raise MacoError(f"torch {torch.__version__} does not say which conv backend it picks")
    picked = select(x, w, None, list(spec.stride), list(spec.padding), list(spec.dilation), False, [0, 0],
                    spec.groups, None)
    return str(picked).rsplit(".", 1)[-1]
