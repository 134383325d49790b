"""The vendor baseline every MACO kernel is compared with: torch's conv2d (oneDNN on CPU, cuDNN on
GPU) in either layout, its input and weight converted once, outside the timed call."""
from __future__ import annotations

from typing import Any, Callable

from maco.spec import ConvSpec


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
