"""The axes of a conv's loop nest, which every sketch tiles, and their extents for one conv.

Spatial n (batch), g (group), k (filter within the group), oh, ow; reduction c (channel within
the group), kh, kw.
"""
from __future__ import annotations

from maco.core.spec import ConvSpec

SPATIAL_AXES = ("n", "g", "k", "oh", "ow")
REDUCTION_AXES = ("c", "kh", "kw")
ALL_AXES = SPATIAL_AXES + REDUCTION_AXES
WEIGHT_AXES = ("g", "k", "c", "kh", "kw")  # the axes a weight block depends on
INPUT_AXES = ("n", "g", "c", "kh", "kw", "oh", "ow")  # the axes an input window depends on


def axis_extents(spec: ConvSpec) -> dict[str, int]:
    """Loop extents of the sketch's axes for one conv."""
    return {"n": spec.n, "g": spec.groups, "k": spec.k_per_group, "oh": spec.out_h,
            "ow": spec.out_w, "c": spec.c_per_group, "kh": spec.kh, "kw": spec.kw}
