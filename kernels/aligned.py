"""float32 arrays that start on a cache line, for the weights the generated kernels read as vectors.

numpy only promises 16 bytes: the weight vectors of a misaligned packing each straddle two lines,
and the same kernel measured up to 9% slower in one process than in the next (AlexNet's 5x5
layer); a block kernel's filter vectors, loaded once per input channel, 6-13% slower."""
from __future__ import annotations

from typing import Any

import numpy as np

LINE_BYTES = 64
LINE_FLOATS = LINE_BYTES // 4  # the fp32 values of one line: what one prefetch fetches
L1_BYTES = 32 << 10  # the L1 data cache of the CPUs MACO meets (Zen 3/4: 32 KiB; Intel: 32-48 KiB)


def aligned_empty(shape: tuple[int, ...], align: int = LINE_BYTES) -> np.ndarray:
    """An uninitialised float32 array of `shape` starting on an `align`-byte boundary."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * 4
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + nbytes].view(np.float32).reshape(shape)


def aligned_copy(a: Any) -> np.ndarray:
    """`a` as a C-contiguous float32 array starting on a cache line (a new array)."""
    a = np.asarray(a, dtype=np.float32)
    out = aligned_empty(a.shape)
    out[...] = a
    return out
