"""Whole models timed against each other in interleaved rounds, and a model's time set against the
sum of its conv kernels timed in the same rounds (what runs outside the kernels is the gap a
deployment can still close).

    e2e = compare_end_to_end(model, plan.apply(model), example_input)
    e2e.speedup, e2e.max_abs_diff
    times = time_models({"default": model, "fused": fused}, example_input)
    share = conv_share(fused, example_input)      # share.model_s, share.convs_s, share.outside
"""
from __future__ import annotations

import statistics
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Mapping

import torch
from torch import nn

from maco.kernels.cache_flush import Flush
from maco.layouts.latency import strict_cudnn
from maco.layouts.maco_modules import (MacoConv2d, MacoDepthwise2d, MacoInvertedResidual, MacoLinearAsConv,
                                       MacoSqueezeExcite, MacoWinograd2d)
from maco.layouts.segments import MacoSegment
from maco.core.errors import MacoError
from maco.core.spec import ConvSpec
from maco.core.timing import Timing, interleaved_rounds, pool_timings, steady_allocator, time_callable


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


@dataclass
class ModelTimes:
    """Several models timed in the same interleaved rounds; the first is the reference that the
    others' outputs and times are compared with."""

    rounds: dict[str, list[Timing]]
    max_abs_diff: dict[str, float]  # vs the reference's output
    max_rel_diff: dict[str, float]  # max_abs_diff / max |reference output|

    @property
    def reference(self) -> str:
        return next(iter(self.rounds))

    def timing(self, label: str) -> Timing:
        return pool_timings(self.rounds[label])

    def speedup(self, label: str, over: str | None = None) -> float:
        """Median over rounds of `over`'s time (default: the reference's) / `label`'s in that round."""
        ref = self.rounds[over or self.reference]
        return float(statistics.median(r.median / t.median for r, t in zip(ref, self.rounds[label])))

    def fastest(self, rel_tolerance: float = 1e-4) -> str:
        """The label with the highest speedup among those whose output matches the reference (the
        reference itself when none does)."""
        ok = [label for label in self.rounds if self.max_rel_diff[label] <= rel_tolerance]
        return max(ok, key=self.speedup) if ok else self.reference


def time_models(models: Mapping[str, Callable[..., Any]], example_input: Any, *, rounds: int = 5,
                repeats: int = 3, min_run_time: float = 0.02, warmup: int = 3,
                progress: bool = False) -> ModelTimes:
    """Time every model on `example_input` in interleaved rounds with torch.inference_mode, after
    checking each one's output against the first's."""
    from tqdm import tqdm  # only for a progress bar

    steady_allocator()  # the allocator's steady state, as the per-layer latencies were measured
    inputs = tuple(example_input) if isinstance(example_input, (tuple, list)) else (example_input,)
    cuda = any(t.is_cuda for t in inputs if isinstance(t, torch.Tensor))
    runs = {label: (lambda m=m: m(*inputs)) for label, m in models.items()}
    with torch.inference_mode(), _strict_fp32(cuda):
        outputs = {label: [t.clone() for t in output_tensors(fn())] for label, fn in runs.items()}
        want = outputs[next(iter(outputs))]
        scale = output_scale(want)
        diff = {label: output_diff(want, got) for label, got in outputs.items()}
        for _ in range(warmup):  # first calls build oneDNN/cuDNN primitives: keep them off the clock
            for fn in runs.values():
                fn()
        per_round = interleaved_rounds(
            runs, rounds, repeats=repeats, min_run_time=min_run_time,
            sync=torch.cuda.synchronize if cuda else None,
            progress=lambda r: tqdm(r, desc="end to end", unit="round", disable=not progress, leave=False))
    return ModelTimes(per_round, diff, {label: d / scale for label, d in diff.items()})


def compare_end_to_end(model: nn.Module, planned: nn.Module, example_input: Any, *, rounds: int = 5,
                       repeats: int = 3, min_run_time: float = 0.02, warmup: int = 3,
                       progress: bool = False) -> EndToEnd:
    """Time `model` (the default layout) against `planned` (e.g. plan.apply(model)) on
    `example_input`, interleaved by rounds, with torch.inference_mode."""
    t = time_models({"default": model, "planned": planned}, example_input, rounds=rounds, repeats=repeats,
                    min_run_time=min_run_time, warmup=warmup, progress=progress)
    ratios = [d.median / p.median for d, p in zip(t.rounds["default"], t.rounds["planned"])]
    return EndToEnd(t.timing("default"), t.timing("planned"), ratios, t.max_abs_diff["planned"])


@dataclass
class ConvShare:
    """A model's time beside the sum of its conv kernels alone, and beside the model with its MACO
    kernels skipped (everything else it runs: torch ops, conversions, Python), timed in the same
    rounds."""

    model_s: float
    convs_s: float
    per_conv: dict[str, float]  # module path -> seconds of its kernel alone
    rest_s: float = 0.0  # the model with every MACO kernel call skipped
    per_conv_cold: dict[str, float] = field(default_factory=dict)  # the same, its weights in memory
    per_conv_in_model: dict[str, float] = field(default_factory=dict)  # timed inside the model's C calls
    specs: dict[str, tuple[ConvSpec, ...]] = field(default_factory=dict)  # the convs each one computes

    @property
    def convs_in_model_s(self) -> float:
        """The kernels that run inside the model's C calls (MacoSegment), each timed there."""
        return sum(self.per_conv_in_model.values())

    @property
    def alone_s(self) -> float:
        """The same kernels' sum alone (warm), to compare with convs_in_model_s."""
        return sum(self.per_conv[name] for name in self.per_conv_in_model)

    @property
    def convs_cold_s(self) -> float:
        """The kernels' sum, each run with its weights dropped from the caches first: they come
        from memory and its activations from cache, as in a model whose weights outgrow the
        caches."""
        return sum(self.per_conv_cold.values())

    def to_dict(self) -> dict[str, Any]:
        return {"model_s": self.model_s, "convs_s": self.convs_s, "rest_s": self.rest_s,
                "outside": self.outside, "ratio": self.ratio, "per_conv_s": self.per_conv,
                "convs_cold_s": self.convs_cold_s, "per_conv_cold_s": self.per_conv_cold,
                "convs_in_model_s": self.convs_in_model_s, "per_conv_in_model_s": self.per_conv_in_model}

    @property
    def outside(self) -> float:
        """The share of the model's time spent outside its conv kernels."""
        return 1.0 - self.convs_s / self.model_s

    @property
    def ratio(self) -> float:
        """Model time over the conv kernels' sum (1.0: nothing but the kernels runs)."""
        return self.model_s / self.convs_s


def conv_share(model: nn.Module, example_input: Any, *, rounds: int = 5, min_run_time: float = 5e-3) -> ConvShare:
    """Time `model` and, in the same interleaved rounds, each of its convs alone on the tensors it
    sees in the model (a MACO kernel by its prepared call on its own buffers: the kernel and
    nothing else; a torch conv by its module call), and the model with its MACO kernels skipped.
    Each conv is also timed with its weights dropped from the caches before each call (its
    weights in memory, its activations in cache, as inside a model whose weights outgrow the
    caches: ConvShare.convs_cold_s), and, where a MacoSegment runs it, inside the model's C call
    over model calls back to back (ConvShare.per_conv_in_model)."""
    inputs = tuple(example_input) if isinstance(example_input, (tuple, list)) else (example_input,)
    seen: dict[str, tuple[nn.Module, tuple]] = {}
    def keep(name: str) -> Callable[[nn.Module, tuple], None]:
        def hook(mod: nn.Module, args: tuple) -> None:  # returns None: the call's args stay as they are
            seen.setdefault(name, (mod, args))
        return hook

    hooks = [mod.register_forward_pre_hook(keep(name))
             for name, mod in model.named_modules() if isinstance(mod, (nn.Conv2d,) + MACO_CONVS)
             and not any(isinstance(p, MACO_CONVS) for p in _parents(model, name))]
    steady_allocator()
    segments = [m for m in model.modules() if isinstance(m, MacoSegment)]
    with torch.inference_mode():
        try:
            for segment in segments:  # its modules called one by one: the hooks see their tensors
                segment.per_module = True
            model(*inputs)
        finally:
            for segment in segments:
                segment.per_module = False
            for hook in hooks:
                hook.remove()
        skipped = _Skipping(model)
        runs: dict[str, Callable[[], Any]] = {"model": lambda: model(*inputs), "rest": skipped.run(inputs)}
        for name, (mod, args) in seen.items():
            args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
            if isinstance(mod, MacoConv2d):
                x = args[0].contiguous(memory_format=mod._in_format)
                res = args[1].contiguous(memory_format=mod._format) if len(args) > 1 else None
                runs[name] = mod._conv.prepare(x, res, mod._conv.output())
            elif isinstance(mod, MacoLinearAsConv):  # its (N, H, W, C) tensors are the kernel's NHWC ones
                res = args[1].permute(0, 3, 1, 2) if len(args) > 1 else None
                runs[name] = mod._conv.prepare(args[0].permute(0, 3, 1, 2), res, mod._conv.output())
            elif isinstance(mod, MacoWinograd2d):
                out, res = mod._new_output(), args[1] if len(args) > 1 else None
                runs[name] = lambda mod=mod, x=args[0], res=res, out=out: mod._kernel(
                    x, mod._weight, mod._bias, res, out)
            elif isinstance(mod, MacoInvertedResidual):
                runs[name] = lambda mod=mod, x=args[0], out=mod._new_output(): mod._kernel(x, mod._weight, out)
            else:
                runs[name] = lambda mod=mod, args=args: mod(*args)
        for fn in runs.values():
            fn()
        per_round = interleaved_rounds(runs, rounds, repeats=3, min_run_time=min_run_time, warmup=1)
        on_cpu = all(a.device.type == "cpu" for a in inputs if isinstance(a, torch.Tensor))
        cold = _weights_in_memory(seen, runs, rounds) if on_cpu else {}
        in_model = _inside_the_model(model, inputs, segments, set(seen), calls=3 * rounds)
    medians = {name: pool_timings(ts).median for name, ts in per_round.items()}
    model_s, rest_s = medians.pop("model"), medians.pop("rest")
    specs = {name: _specs(mod, args) for name, (mod, args) in seen.items()}
    return ConvShare(model_s, sum(medians.values()), medians, rest_s, cold, in_model,
                     {name: s for name, s in specs.items() if s})


def _specs(mod: nn.Module, args: tuple) -> tuple[ConvSpec, ...]:
    """The convs `mod` computes on `args`: a block kernel's, a MACO kernel's, or a torch conv's
    (none where its shape is outside ConvSpec's: string padding, another padding mode)."""
    if isinstance(mod, MacoInvertedResidual):
        return mod.specs
    if isinstance(getattr(mod, "spec", None), ConvSpec):
        return (mod.spec,)
    try:
        return (ConvSpec.from_module(mod, tuple(args[0].shape)),)
    except (MacoError, AttributeError, IndexError):
        return ()


def _inside_the_model(model: nn.Module, inputs: tuple, segments: list[MacoSegment], names: set[str],
                      calls: int) -> dict[str, float]:
    """The median seconds of each conv in `names` that a segment runs, timed inside its C call
    over `calls` calls of the model back to back (after one more)."""
    if not segments:
        return {}
    path = {id(mod): name for name, mod in model.named_modules()}
    model(*inputs)
    for segment in segments:
        segment.step_seconds = []
    try:
        for _ in range(calls):
            model(*inputs)
        timed = {segment: segment.step_seconds or [] for segment in segments}
    finally:
        for segment in segments:
            segment.step_seconds = None
    per: dict[str, float] = {}
    for segment, seconds in timed.items():
        for j, mod in enumerate(segment.modules_in_order):
            name = path.get(id(mod))
            if name in names and seconds:
                per[name] = statistics.median(call[j] for call in seconds)
    return per


def _weights_in_memory(seen: Mapping[str, tuple[nn.Module, tuple]], runs: Mapping[str, Callable[[], Any]],
                       rounds: int) -> dict[str, float]:
    """Each conv's median seconds over `rounds` rounds, every call with its module's weights
    dropped from the caches first (kernels.cache_flush) and its inputs where the last call left
    them (conv_share)."""
    cold: dict[str, list[Timing]] = {name: [] for name in seen}
    flushes = {name: Flush(module) for name, (module, _) in seen.items()}
    for _ in range(rounds):
        for name in seen:
            cold[name].append(time_callable(runs[name], repeats=3, warmup=0, min_run_time=0.0, before=flushes[name]))
    return {name: pool_timings(ts).median for name, ts in cold.items()}


# what runs a conv by a MACO kernel: a Linear over channels-last tensors is the 1x1 conv it runs as
MACO_CONVS = (MacoConv2d, MacoWinograd2d, MacoInvertedResidual, MacoDepthwise2d, MacoLinearAsConv)


class _Skipping:
    """Runs a model with every MACO kernel call replaced by handing back its output buffer (a
    segment's kernels skipped, its checks and pointer table kept): what the model costs besides
    its MACO kernels (its outputs are then meaningless)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.convs = [m for m in model.modules() if isinstance(m, (MacoConv2d, MacoLinearAsConv))]
        self.generated = [m for m in model.modules()
                          if isinstance(m, (MacoWinograd2d, MacoInvertedResidual, MacoSqueezeExcite, MacoDepthwise2d))]
        self.segments = [m for m in model.modules() if isinstance(m, MacoSegment)]

    def run(self, inputs: tuple) -> Callable[[], Any]:
        def skip(conv: MacoConv2d | MacoLinearAsConv) -> Callable[..., Any]:
            out = conv._out if conv._out is not None else conv._conv.output()
            return lambda x, residual=None, buffer=None: out

        skips = [skip(c) for c in self.convs]

        def call() -> Any:
            for c, fn in zip(self.convs, skips):
                c._conv.run_tensor = fn  # an instance attribute hides the method
            kernels = [w._kernel for w in self.generated]
            for w in self.generated:
                w._kernel = _no_kernel
            for segment in self.segments:
                segment.skip_kernels = True
            try:
                return self.model(*inputs)
            finally:
                for segment in self.segments:
                    segment.skip_kernels = False
                for c in self.convs:
                    del c._conv.run_tensor
                for w, kernel in zip(self.generated, kernels):
                    w._kernel = kernel
        return call


def _no_kernel(*args: Any) -> None:
    """A skipped generated kernel: its output buffer is handed back as it is."""


def _parents(model: nn.Module, name: str) -> list[nn.Module]:
    parts = name.split(".")
    return [model.get_submodule(".".join(parts[:i])) for i in range(1, len(parts))]


def _strict_fp32(cuda: bool) -> ContextManager[None]:
    """On a GPU, time as the per-layer latencies were: fp32 without TF32, cuDNN autotuned."""
    return strict_cudnn(benchmark=True) if cuda else nullcontext()


def output_diff(want: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    """The largest absolute difference between two models' outputs over the values finite in
    both; inf where shapes differ or NaN, +inf or -inf stand in different places (a kernel must
    keep them where torch does)."""
    if len(got) != len(want) or any(a.shape != b.shape for a, b in zip(want, got)):
        return float("inf")
    diff = 0.0
    for a, b in zip(want, got):
        if not (torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isposinf(), b.isposinf())
                and torch.equal(a.isneginf(), b.isneginf())):
            return float("inf")
        finite = a.isfinite()
        if finite.any():
            diff = max(diff, float((a[finite] - b[finite]).abs().max()))
    return diff


def output_scale(want: list[torch.Tensor]) -> float:
    """The largest finite |value| of a model's outputs (1 where there is none): what output_diff
    is measured against for a relative tolerance."""
    return max((_finite_max(t) for t in want), default=0.0) or 1.0


def _finite_max(t: torch.Tensor) -> float:
    finite = t[t.isfinite()]
    return float(finite.abs().max()) if finite.numel() else 0.0


def output_tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of a model's output (a tensor, or tuples, lists and dicts of them), in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in output_tensors(o)]
    if isinstance(out, Mapping):
        return [t for o in out.values() for t in output_tensors(o)]
    return []


__all__ = ["ConvShare", "EndToEnd", "ModelTimes", "compare_end_to_end", "conv_share", "time_models"]
