"""Drop what a timed call reads from every cache level, so that it reads it from DRAM, as a
layer does inside a model whose weights outgrow the caches.

`Flush(*things)` finds the CPU buffers of its arguments (tensors and numpy arrays, those of
modules, of functions' closures and default arguments, of the objects they hold, a few levels
deep) and, called, writes back and drops every cache line of them (clflushopt, in the runtime
every kernel loads). Flushing only what the call reads costs far less than sweeping a buffer
larger than the last cache (docs/measuring.md), and it leaves alone the per-thread scratch,
which the Winograd kernels of a model share and find in cache.
"""
from __future__ import annotations

import ctypes
import types
from typing import Any

import numpy as np

from maco.kernels import cpu_build

DEPTH = 4  # levels of containers, attributes and closures searched for buffers
SKIP = (str, bytes, int, float, bool, type, types.ModuleType)  # hold no buffers of a call's own


def _span(obj: Any) -> tuple[int, int] | None:
    """(address, bytes) of the memory under a CPU tensor or numpy array: its whole storage or
    base buffer, so that views of one buffer are one span."""
    import torch

    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu" or obj.is_sparse or obj.is_meta:
            return None
        storage = obj.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    base = obj
    while isinstance(base.base, np.ndarray):
        base = base.base
    return base.ctypes.data, base.nbytes


def buffers(*things: Any) -> list[tuple[int, int]]:
    """The distinct (address, bytes) spans of the CPU buffers `things` hold (see the module)."""
    import torch
    from torch import nn

    spans: dict[int, int] = {}
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if obj is None or id(obj) in seen or isinstance(obj, SKIP):
            return
        seen.add(id(obj))
        if isinstance(obj, (torch.Tensor, np.ndarray)):
            span = _span(obj)
            if span is not None and span[1] > 0:
                spans[span[0]] = max(spans.get(span[0], 0), span[1])
            return
        if depth == 0:
            return
        if isinstance(obj, nn.Module):
            for t in (*obj.parameters(), *obj.buffers()):
                visit(t, depth)
        if isinstance(obj, dict):
            children = list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            children = list(obj)
        elif callable(obj) and hasattr(obj, "__code__"):  # a function: what its closure and defaults hold
            children = [c.cell_contents for c in (obj.__closure__ or ()) if _filled(c)]
            children += list(obj.__defaults__ or ()) + list((obj.__kwdefaults__ or {}).values())
        else:
            children = [getattr(obj, "__self__", None)] + list(getattr(obj, "__dict__", {}).values())
        for child in children:
            visit(child, depth - 1)

    for thing in things:
        visit(thing, DEPTH)
    return sorted(spans.items())


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a closure cell not assigned yet
        return False
    return True


class Flush:
    """Called, drops the buffers of `things` (found once, here) from every cache level."""

    def __init__(self, *things: Any):
        self.spans = buffers(*things)
        self._flush = cpu_build.runtime().maco_flush
        self._flush.argtypes = [ctypes.c_void_p, ctypes.c_long]
        self._flush.restype = None

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.spans)

    def __call__(self) -> None:
        for address, nbytes in self.spans:
            self._flush(address, nbytes)
