"""What the layout predictor sees of a conv in a layout: its shape numbers and sizes (logs of the
large ones), channel padding to vendor blocks, and which of torch's CPU convs runs it."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from maco.core.errors import MacoError
from maco.core.spec import ConvSpec
from maco.kernels.baselines import torch_backend
from maco.layouts.latency import LAYOUTS, check_layout

FEATURES = ["layout", "n", "c", "h", "w", "k", "kh", "kw", "stride_h", "stride_w", "pad_h",
            "pad_w", "dil_h", "dil_w", "groups", "flops", "input_bytes", "weight_bytes",
            "output_bytes", "c_per_group", "k_per_group", "out_h", "out_w", "depthwise",
            "c_pad8", "c_pad16", "k_pad8", "k_pad16", "padded_flops", "out_pixels",
            "torch_onednn", "torch_im2col", "torch_dilated"]
# torch_*: which CPU implementation torch's conv2d picks (kernels.baselines.torch_backend): oneDNN,
# or its own im2col + GEMM paths; torch switches on size thresholds the other features only approximate.
_BACKENDS = {"torch_onednn": "Mkldnn", "torch_im2col": "Slow2d", "torch_dilated": "SlowDilated2d"}
# Sizes that span orders of magnitude enter the MLP as logs; small integers stay as they are.
_LOGGED = {"n", "c", "h", "w", "k", "groups", "flops", "input_bytes", "weight_bytes",
           "output_bytes", "c_per_group", "k_per_group", "out_h", "out_w", "padded_flops", "out_pixels"}


def _pad(v: int, block: int) -> float:
    """How much a channel count grows when padded to `block`: vendor libraries (oneDNN's nChw16c,
    cuDNN's vector loads) work in channel blocks, and a ragged count pays for the full block."""
    return math.ceil(v / block) * block / v


def layout_id(layout: str) -> int:
    return LAYOUTS.index(check_layout(layout))


def features(specs: Sequence[ConvSpec], layouts: Sequence[str], log: bool = True) -> np.ndarray:
    """(N, len(FEATURES)) float64: the conv's shape numbers and sizes, logs of the large ones
    when `log` (the MLP's input), raw values otherwise (the paper's baselines)."""
    if len(specs) != len(layouts):
        raise MacoError(f"{len(specs)} specs but {len(layouts)} layouts")
    out = np.empty((len(specs), len(FEATURES)))
    for i, (s, lay) in enumerate(zip(specs, layouts)):
        vals = {"layout": layout_id(lay), "n": s.n, "c": s.c, "h": s.h, "w": s.w, "k": s.k,
                "kh": s.kh, "kw": s.kw, "stride_h": s.stride[0], "stride_w": s.stride[1],
                "pad_h": s.padding[0], "pad_w": s.padding[1], "dil_h": s.dilation[0],
                "dil_w": s.dilation[1], "groups": s.groups, "flops": s.flops,
                "input_bytes": s.input_bytes, "weight_bytes": s.weight_bytes,
                "output_bytes": s.output_bytes, "c_per_group": s.c_per_group,
                "k_per_group": s.k_per_group, "out_h": s.out_h, "out_w": s.out_w,
                "depthwise": int(s.is_depthwise), "c_pad8": _pad(s.c_per_group, 8),
                "c_pad16": _pad(s.c_per_group, 16), "k_pad8": _pad(s.k_per_group, 8),
                "k_pad16": _pad(s.k_per_group, 16), "out_pixels": s.n * s.out_h * s.out_w,
                "padded_flops": s.flops * _pad(s.c_per_group, 16) * _pad(s.k_per_group, 16)}
        try:
            backend = torch_backend(s, lay)
        except RuntimeError:  # torch allocates the (untouched) input and weights to choose
            raise MacoError(f"cannot predict {s}: torch cannot hold its {s.input_bytes / 2**30:.4g} GiB input "
                            f"and {s.weight_bytes / 2**30:.4g} GiB weights to say which conv it runs") from None
        vals.update({name: float(backend == picked) for name, picked in _BACKENDS.items()})
        out[i] = [math.log(vals[f]) if log and f in _LOGGED else float(vals[f]) for f in FEATURES]
    return out
