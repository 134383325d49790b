"""A planned model against the default one, timed end to end in interleaved rounds.

    e2e = compare_end_to_end(model, plan.apply(model), example_input)
    e2e.speedup, e2e.max_abs_diff
"""
from __future__ import annotations

import statistics
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ContextManager, Mapping

import torch
from torch import nn

from maco.layouts.latency import strict_cudnn
from maco.timing import Timing, interleaved_rounds, pool_timings, steady_allocator


@dataclass
class EndToEnd:
    """Default vs planned model, timed in interleaved rounds: each round times both by the
    protocol, so a load change on a shared machine hits both; speedup is the median of the
    rounds' default/planned ratios. `max_abs_diff` compares their outputs on the input."""

    default: Timing
    planned: Timing
    ratios: list[float]
    max_abs_diff: float

    @property
    def speedup(self) -> float:
        return float(statistics.median(self.ratios))


def compare_end_to_end(model: nn.Module, planned: nn.Module, example_input: Any, *, rounds: int = 5,
                       repeats: int = 3, min_run_time: float = 0.02, warmup: int = 3,
                       progress: bool = False) -> EndToEnd:
    """Time `model` (the default layout) against `planned` (e.g. plan.apply(model)) on
    `example_input`, interleaved by rounds, with torch.inference_mode."""
    from tqdm import tqdm  # only for a progress bar

    steady_allocator()  # the allocator's steady state, as the per-layer latencies were measured
    inputs = tuple(example_input) if isinstance(example_input, (tuple, list)) else (example_input,)
    cuda = any(t.is_cuda for t in inputs if isinstance(t, torch.Tensor))
    with torch.inference_mode(), _strict_fp32(cuda):
        want, got = model(*inputs), planned(*inputs)
        diff = max((float((a - b).abs().max()) for a, b in zip(_tensors(want), _tensors(got))), default=0.0)
    runs = {"default": lambda: model(*inputs), "planned": lambda: planned(*inputs)}
    with torch.inference_mode(), _strict_fp32(cuda):
        for _ in range(warmup):  # first calls build oneDNN/cuDNN primitives: keep them off the clock
            for fn in runs.values():
                fn()
        per_round = interleaved_rounds(
            runs, rounds, repeats=repeats, min_run_time=min_run_time,
            sync=torch.cuda.synchronize if cuda else None,
            progress=lambda r: tqdm(r, desc="end to end", unit="round", disable=not progress, leave=False))
    ratios = [d.median / p.median for d, p in zip(per_round["default"], per_round["planned"])]
    return EndToEnd(pool_timings(per_round["default"]), pool_timings(per_round["planned"]), ratios, diff)


def _strict_fp32(cuda: bool) -> ContextManager[None]:
    """On a GPU, time as the per-layer latencies were: fp32 without TF32, cuDNN autotuned."""
    return strict_cudnn(benchmark=True) if cuda else nullcontext()


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, Mapping):
        return [t for o in out.values() for t in _tensors(o)]
    return []


__all__ = ["EndToEnd", "compare_end_to_end"]
