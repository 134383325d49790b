"""MACO: memory-aware automatic code optimisation of CNN convolutions.

The layers, one folder each, in import order: core, bounds, space, kernels, tune, layouts, deploy,
then commands and cli (experiments on top). The core types load eagerly; the subpackages load on
first use, so `import maco` stays fast and never needs CuPy.
"""
from __future__ import annotations

import importlib
from typing import Any

from maco.core.errors import MacoError
from maco.core.schedule import Schedule
from maco.core.spec import ConvSpec
from maco.core.target import MemoryLevel, Target

__version__ = "0.1.0"
__all__ = ["ConvSpec", "MacoError", "MemoryLevel", "Schedule", "Target", "__version__"]

_LAZY = {"core", "bounds", "space", "kernels", "tune", "layouts", "deploy", "cli"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return importlib.import_module(f"maco.{name}")
    if name in ("save", "load"):  # maco.save / maco.load: an optimized model as one file
        return getattr(importlib.import_module("maco.deploy.deployment"), name)
    raise AttributeError(f"module 'maco' has no attribute {name!r}")
