"""MACO: memory-aware automatic code optimisation of CNN convolutions.

The core types load eagerly; the heavier subpackages (bounds, kernels, layouts, search, ...)
load on first use, so `import maco` stays fast and never needs CuPy.
"""
from __future__ import annotations

import importlib
from typing import Any

from maco.errors import MacoError
from maco.schedule import Schedule
from maco.spec import ConvSpec
from maco.target import MemoryLevel, Target

__version__ = "0.1.0"
__all__ = ["ConvSpec", "MacoError", "MemoryLevel", "Schedule", "Target", "__version__"]

_LAZY = {"bounds", "kernels", "layouts", "space", "prune", "search", "cost_model", "records",
         "measure", "cli"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return importlib.import_module(f"maco.{name}")
    if name in ("save", "load"):  # maco.save / maco.load: an optimized model as one file
        return getattr(importlib.import_module("maco.deployment"), name)
    raise AttributeError(f"module 'maco' has no attribute {name!r}")
