"""An optimized model as one file a deployment can load without tuning: which variant `maco optimize`
handed back, the layout plan, each MACO kernel's schedule, the fusion it rests on, the input shape
and the machine it was tuned on.

    maco.save(result, "resnet18.maco")             # result = maco.deploy.optimize.optimize(...), or a loaded model
    fast = maco.load("resnet18.maco", model)       # the same model class with its weights

The file is JSON and holds no code: a model is rebuilt from the caller's own module by the same
deterministic passes (fuse, plan.apply), and every schedule in it is checked like any other
untrusted schedule before a kernel is generated from it. Kernels come from the build cache, or are
compiled again on a cold one.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from maco.core.errors import MacoError
from maco.core.files import check_writable, load_json_file, short, write_atomic
from maco.kernels import default_schedule, host_target
from maco.layouts.fusion import FusedConv2d, FusedLinear, adds_residual, fuse
from maco.layouts.layout_plan import LayoutPlan
from maco.deploy.kernel_choice import POOLS
from maco.kernels.inverted_residual import SPLITS
from maco.kernels.pool import plan_for
from maco.kernels.winograd import TILE_SIZES
from maco.layouts.cuda_graph import CudaGraphed, unwrap
from maco.layouts.blocks import find_blocks, find_squeeze_excites, use_block, use_squeeze_excite
from maco.layouts.maco_modules import (MacoConv2d, MacoDepthwise2d, MacoInvertedResidual, MacoLinear,
                                       MacoLinearAsConv, MacoPool2d, MacoSqueezeExcite, MacoWinograd2d, block_plan,
                                       call_sites, depthwise_can_run, escapes, fold_input_conversion, input_conversion,
                                       kernel_can_run, squeeze_plan, swap_module, winograd_module_can_run)
from maco.layouts.segments import use_segments
from maco.deploy.optimize_report import OptimizeResult
from maco.core.schedule import Schedule
from maco.core.spec import ConvSpec
from maco.core.target import Target, require_memory

FORMAT = "maco-optimized-model"
VERSION = 1
VARIANTS = ("default", "fused", "planned_torch", "planned_maco")
MAX_BYTES = 16 << 20  # a plan and a few hundred schedules: kilobytes to a few MB


@dataclass
class Deployment:
    """What rebuilds an optimized model from the original one (see the module docstring)."""

    variant: str
    input_shape: list[int]
    target: dict[str, Any]  # Target.fingerprint() of the machine the kernels were tuned on
    threads: int
    fusion: list[str] = field(default_factory=list)  # "name activation residual" of each fused module
    plan: dict[str, Any] | None = None  # LayoutPlan.to_dict()
    # which modules run MACO kernels; whether a kernel writes into a buffer it owns is derived by
    # load from the model's graph (escape analysis), never read from the file ("preallocate" in
    # files of earlier versions is ignored)
    convs: dict[str, dict[str, Any]] = field(default_factory=dict)  # path -> spec, schedule
    linears: dict[str, dict[str, Any]] = field(default_factory=dict)  # path -> batch, or (N, H, W, C) shape
    pools: dict[str, dict[str, Any]] = field(default_factory=dict)  # path -> input shape, layout
    depthwise: dict[str, dict[str, Any]] = field(default_factory=dict)  # path -> spec, layout
    winograd: dict[str, dict[str, Any]] = field(default_factory=dict)  # path -> spec, tile
    # an inverted residual as one kernel: its last conv's path -> its convs' paths, input shape
    blocks: dict[str, dict[str, Any]] = field(default_factory=dict)
    # squeeze-excitation as one kernel: its gate module's path -> pool, fc1, fc2 paths, input shape, layout
    squeeze: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        from maco import __version__

        return {"format": FORMAT, "version": VERSION, "maco": __version__, **asdict(self)}

    @classmethod
    def from_dict(cls, d: Any) -> "Deployment":
        """Every field checked: the file may come from anyone."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise MacoError("not a saved MACO model (no 'format': 'maco-optimized-model')")
        if d.get("version") != VERSION:
            raise MacoError(f"saved MACO model format version {short(d.get('version'))}; this MACO reads {VERSION}")
        d = {k: v for k, v in d.items() if k not in ("format", "version", "maco")}
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise MacoError(f"unknown field(s) in the saved model: {short(sorted(map(str, unknown)))}")
        try:
            dep = cls(**d)
        except TypeError as exc:
            raise MacoError(f"a malformed saved model: {exc}") from None
        if dep.variant not in VARIANTS:
            raise MacoError(f"unknown variant {short(dep.variant)}; one of {VARIANTS}")
        if not (_positive_ints(dep.input_shape) and dep.input_shape):
            raise MacoError(f"input_shape must be positive ints, got {short(dep.input_shape)}")
        if not isinstance(dep.threads, int) or dep.threads < 1:
            raise MacoError(f"threads must be a positive int, got {short(dep.threads)}")
        for name, value in (("target", dep.target), ("convs", dep.convs), ("linears", dep.linears),
                            ("pools", dep.pools), ("depthwise", dep.depthwise), ("winograd", dep.winograd),
                            ("blocks", dep.blocks), ("squeeze", dep.squeeze)):
            if not isinstance(value, dict):
                raise MacoError(f"{name} must be an object, got {short(value)}")
        if not isinstance(dep.fusion, list) or not all(isinstance(f, str) for f in dep.fusion):
            raise MacoError(f"fusion must be a list of strings, got {short(dep.fusion)}")
        if dep.cuda:  # the CUDA pipeline swaps convs alone, each reading its input as planned
            cpu_only = [name for name in ("linears", "pools", "depthwise", "winograd", "blocks", "squeeze")
                        if getattr(dep, name)]
            cpu_only += [f"convs[{short(p)}].input" for p, e in dep.convs.items() if isinstance(e, dict) and "input" in e]
            if cpu_only:
                raise MacoError(f"a saved model tuned for a CUDA GPU holds convs alone, this one also {', '.join(cpu_only)}")
        return dep

    @property
    def cuda(self) -> bool:
        """Whether its kernels were tuned for a CUDA GPU (maco optimize --target cuda)."""
        return self.target.get("kind") == "cuda"


def describe(model: nn.Module, variant: str, example_input: torch.Tensor, target: Target,
             plan: LayoutPlan | None = None) -> Deployment:
    """The Deployment of a model `maco optimize` built (or `load` rebuilt): read off its modules."""
    dep = Deployment(variant, list(example_input.shape), target.fingerprint(), torch.get_num_threads())
    if variant == "default":
        return dep
    dep.fusion = _fusion(model)
    if variant == "fused":
        return dep
    if plan is None:
        raise MacoError(f"the {variant} variant needs its layout plan")
    dep.plan = plan.to_dict()
    inside = set()  # the convs of a block but its last: the graph no longer calls them
    for path, mod in model.named_modules():
        if isinstance(mod, MacoInvertedResidual) and mod.paths is not None:
            expand, depthwise, project = mod.paths
            dep.blocks[path] = {"expand": expand, "depthwise": depthwise, "project": project,
                                "shape": list(mod.shape), "split": "channels" if mod.plan.channel_split else "rows"}
            inside.update(p for p in mod.paths if p is not None and p != path)
        elif isinstance(mod, MacoSqueezeExcite) and mod.paths is not None:
            pool, fc1, fc2, _ = mod.paths
            dep.squeeze[path] = {"pool": pool, "fc1": fc1, "fc2": fc2, "shape": list(mod.shape), "layout": mod.layout}
            inside.update((pool, fc1, fc2))
    for path, mod in model.named_modules():
        if path in inside:
            continue
        if isinstance(mod, MacoConv2d):
            dep.convs[path] = {"spec": str(mod.spec), "schedule": mod._kernel.schedule.to_dict()}
            if mod.input_layout != mod.layout:  # it reads the tensor before its conversion
                dep.convs[path]["input"] = mod.input_layout
        elif isinstance(mod, MacoLinear):
            dep.linears[path] = {"batch": mod.batch}
        elif isinstance(mod, MacoLinearAsConv):
            dep.linears[path] = {"shape": list(mod.shape)}
        elif isinstance(mod, MacoPool2d):
            dep.pools[path] = {"shape": list(mod.shape), "layout": mod.layout}
        elif isinstance(mod, MacoDepthwise2d):
            dep.depthwise[path] = {"spec": str(mod.spec), "layout": mod.layout}
        elif isinstance(mod, MacoWinograd2d):
            dep.winograd[path] = {"spec": str(mod.spec), "tile": mod.m}
    return dep


def save(obj: Any, path: str | os.PathLike[str]) -> None:
    """Write the optimized model of an OptimizeResult, a model `load` returned, or a Deployment
    `describe` made, to one file."""
    obj = unwrap(obj) if isinstance(obj, nn.Module) else obj
    if isinstance(obj, Deployment):
        dep = obj
    elif isinstance(obj, OptimizeResult):
        dep = describe(unwrap(obj.model), obj.chosen, obj.example, obj.target or host_target(), obj.plan)
    elif isinstance(getattr(obj, "meta", None), dict) and isinstance(obj.meta.get("maco"), Deployment):
        dep = obj.meta["maco"]
    else:
        raise MacoError(f"save takes what maco.deploy.optimize returned, a model maco.load built or a Deployment, got {type(obj).__name__}")
    check_writable(path, "saved model")
    try:
        write_atomic(path, json.dumps(dep.to_dict(), indent=1))
    except OSError as exc:  # a full disk: write_atomic leaves the old file as it was, and no temp file
        raise MacoError(f"cannot write saved model {str(path)!r}: {exc.strerror or exc}") from None


def load(path: str | os.PathLike[str], model: nn.Module, *, other_machine: str = "error",
         exact: bool = False, segments: bool = True) -> nn.Module:
    """`model` (the same architecture and weights as when it was optimized) rebuilt as the saved
    optimized model. On a machine other than the one it was tuned on: a MacoError naming both
    (other_machine="error"), or each conv on its bound-derived default schedule ("defaults").
    A file tuned for a CUDA GPU needs one here: `model` is moved to it, its convs run MACO's CUDA
    kernels, and the model it hands back replays from a CUDA graph (layouts.cuda_graph).
    exact=True leaves the saved Winograd convs to torch (docs/exactness.md). segments=False calls
    the kernel modules one by one, not each run of them as one call (maco.layouts.segments)."""
    if other_machine not in ("error", "defaults"):
        raise MacoError(f"other_machine must be 'error' or 'defaults', got {short(other_machine)}")
    if not isinstance(exact, bool):
        raise MacoError(f"exact must be True or False, got {short(exact)}")
    if not isinstance(segments, bool):
        raise MacoError(f"segments must be True or False, got {short(segments)}")
    dep = Deployment.from_dict(load_json_file(path, "saved MACO model", MAX_BYTES))
    require_memory(16 * 4 * math.prod(dep.input_shape), f"the saved input shape {short(dep.input_shape)}")
    host = _target_for(dep)
    foreign = _tuned_elsewhere(path, dep, host, other_machine)
    return rebuild(dep, model, host, source=path, foreign=foreign, exact=exact, segments=segments)


def rebuild(dep: Deployment, model: nn.Module, host: Target, *, source: Any = "the deployment",
            foreign: bool = False, exact: bool = False, segments: bool = True) -> nn.Module:
    """`model` rebuilt as `dep` describes it, with no tuning and no timing: the same deterministic
    passes (fuse, plan.apply), then each kernel from its schedule, checked against this model
    (`source` names where `dep` came from in errors; `foreign`: defaults instead of its schedules)."""
    cuda = host.kind == "cuda"
    model = model.eval().to(host.device) if cuda else model.eval()  # a CPU file leaves the model where it is
    graphed: Callable[[nn.Module], nn.Module] = CudaGraphed if cuda else (lambda m: m)  # as the pipeline hands it back
    if dep.variant == "default":
        return graphed(model)
    # files written before the per-channel scale fold list no folded scale, and those written before
    # the Linear's residual add no such add: rebuilt without them, so that their layout plan fits
    # the graph node for node
    x = torch.zeros(dep.input_shape, device=host.device)
    scaled = any(f.endswith(" scaled") for f in dep.fusion)
    fused = fuse(model, x, fold_scales=scaled)
    if _fusion(fused) != dep.fusion and any(adds_residual(m)
                                            for m in fused.modules() if isinstance(m, FusedLinear)):
        fused = fuse(model, x, fold_scales=scaled, linear_residuals=False)
    if _fusion(fused) != dep.fusion:
        raise MacoError(f"{str(source)!r} was saved for another model: its fused layers differ from this model's")
    if dep.variant == "fused":
        fused.meta["maco"] = dep
        return graphed(fused)
    gm = LayoutPlan.from_dict(dep.plan).apply(fused)
    _swap_in_kernels(gm, dep, source, host, foreign, exact)
    if segments and not cuda:
        use_segments(gm, host)
    gm.meta["maco"] = dep
    return graphed(gm)


def _target_for(dep: Deployment) -> Target:
    """The target whose kernels rebuild `dep` here: this machine's GPU for a file tuned for a CUDA
    GPU (a MacoError where none is usable), else its CPU."""
    if not dep.cuda:
        return host_target()
    from maco.kernels.cuda import require_gpu

    require_gpu("a saved model tuned for a CUDA GPU")
    return Target.h100()


def _tuned_elsewhere(path: Any, dep: Deployment, host: Target, other_machine: str) -> bool:
    """Whether the file was tuned on another machine; a MacoError saying what to do when its
    convs' schedules cannot run here as saved and `other_machine` is "error"."""
    foreign = dep.target != host.fingerprint()
    if foreign and dep.convs and other_machine == "error" and dep.target == Target.host(dep.threads).fingerprint():
        raise MacoError(f"{str(path)!r} was tuned for {dep.threads} threads and torch now uses {host.cores}: call "
                        f"torch.set_num_threads({dep.threads}) first, or pass other_machine='defaults'")
    if foreign and dep.convs and other_machine == "error":
        raise MacoError(f"{str(path)!r} was tuned on {_machine(dep.target)}, this is {_machine(host.fingerprint())}; "
                        "pass other_machine='defaults' to run MACO's default schedules here, or tune again")
    return foreign


def _swap_in_kernels(gm: nn.Module, dep: Deployment, path: Any, host: Target, foreign: bool, exact: bool) -> None:
    """Every module the file names swapped for its MACO kernel, each checked against this model."""
    calls = call_sites(gm)

    def own_output(module_path: str) -> bool:  # as optimize decides it: called once, output stays inside
        sites = calls.get(module_path, [])
        return len(sites) == 1 and not escapes(gm, sites[0])

    for conv_path, entry in dep.convs.items():
        _swap_conv(gm, path, conv_path, entry, host, foreign, own_output)
    for linear_path, entry in dep.linears.items():
        _swap_linear(gm, path, linear_path, entry, host, own_output)
    for pool_path, entry in dep.pools.items():
        _swap_pool(gm, path, pool_path, entry, host, own_output)
    for conv_path, entry in dep.depthwise.items():
        _swap_depthwise(gm, path, conv_path, entry, host, own_output)
    for conv_path, entry in dep.winograd.items():
        _swap_winograd(gm, path, conv_path, entry, host, foreign, exact, own_output)
    if dep.blocks:
        _swap_blocks(gm, dep, path, host, foreign, own_output)
    if dep.squeeze:
        _swap_squeeze(gm, dep, path, host, own_output)
    for conv_path, entry in dep.convs.items():  # last: the other kernels read their input as planned
        if entry.get("input") is not None:
            _fold_input(gm, path, conv_path, entry["input"], host)


def _swap_squeeze(gm: Any, dep: Deployment, path: Any, host: Target, own_output: Callable[[str], bool]) -> None:
    """Each saved squeeze-excitation run as one kernel: its modules must be one of this model's
    graph (layouts.blocks), on the saved input shape and layout."""
    found = {str(se.calls[3].target): se for se in find_squeeze_excites(gm)}
    for gate, entry in dep.squeeze.items():
        se = found.get(gate) if isinstance(gate, str) else None
        if (not isinstance(entry, dict) or se is None
                or se.paths != (entry.get("pool"), entry.get("fc1"), entry.get("fc2"), gate)):
            raise MacoError(f"{str(path)!r}: the saved squeeze-excitation gated by {short(gate)} is no "
                            "squeeze-excitation (pool, fc1, fc2, gate) of this model")
        shape, layout = entry.get("shape"), entry.get("layout")
        mods = [gm.get_submodule(p) for p in se.paths]
        if (not (_positive_ints(shape) and len(shape) == 4) or layout not in ("NCHW", "NHWC")
                or squeeze_plan(*mods, tuple(shape), layout, host) is None):
            raise MacoError(f"{str(path)!r}: no generated kernel runs the squeeze-excitation gated by "
                            f"{short(gate)} on an input of shape {short(shape)} in {short(layout)}")
        use_squeeze_excite(gm, se, MacoSqueezeExcite(*mods, tuple(shape), layout, host, own_output(gate)))


def _swap_blocks(gm: Any, dep: Deployment, path: Any, host: Target, foreign: bool,
                 own_output: Callable[[str], bool]) -> None:
    """Each saved inverted residual run as one kernel: its convs must be a block of this model's
    graph (layouts.blocks), on the saved input shape."""
    found = {str(block.last.target): block for block in find_blocks(gm)}
    for last, entry in dep.blocks.items():
        block = found.get(last) if isinstance(last, str) else None
        if (not isinstance(entry, dict) or block is None
                or block.paths != (entry.get("expand"), entry.get("depthwise"), entry.get("project"))):
            raise MacoError(f"{str(path)!r}: the saved block ending in {short(last)} is no inverted residual "
                            "(expand, depthwise, project convs) of this model")
        shape, split = entry.get("shape"), entry.get("split", "auto")
        if split not in SPLITS:
            raise MacoError(f"{str(path)!r}: the block ending in {short(last)} splits its work by {short(split)}; "
                            f"one of {SPLITS}")
        mods = [None if p is None else gm.get_submodule(p) for p in block.paths]
        # tuned on another machine, whose thread count may not share the channels: else as here
        ways = ((split, "auto") if foreign else (split,)) if _positive_ints(shape) and len(shape) == 4 else ()
        way = next((w for w in ways if block_plan(*mods, tuple(shape), host, w) is not None), None)
        if way is None:
            raise MacoError(f"{str(path)!r}: no generated kernel runs the block ending in {short(last)} "
                            f"on an input of shape {short(shape)}, its work split by {split}")
        use_block(gm, block, MacoInvertedResidual(*mods, tuple(shape), host, own_output(last), way))


def _swap_conv(gm: nn.Module, path: Any, conv_path: str, entry: Any, host: Target, foreign: bool,
               own_output: Callable[[str], bool]) -> None:
    """A generated kernel on the saved schedule (checked), or on the default one for a foreign file."""
    conv = _submodule(gm, conv_path, nn.Conv2d)
    spec = _saved_spec(path, "conv", conv_path, conv, entry)
    if not kernel_can_run(conv, host):
        raise MacoError(f"{str(path)!r}: no generated kernel computes conv {short(conv_path)} with its epilogue")
    schedule = Schedule.from_dict(entry.get("schedule"))
    schedule = default_schedule(spec, host, schedule.layout) if foreign else schedule.validate(spec, host)
    swap_module(gm, conv_path, MacoConv2d(conv, spec, schedule, host, own_output(conv_path)))


def _fold_input(gm: Any, path: Any, conv_path: str, layout: Any, host: Target) -> None:
    """A saved conv that reads the tensor before its conversion to NHWC: that conversion must be
    one this model's plan places before it (maco_modules.input_conversion)."""
    if layout != "NCHW" or input_conversion(gm, conv_path) is None:
        raise MacoError(f"{str(path)!r}: conv {short(conv_path)} reads its input in {short(layout)}, but this "
                        "model's plan places no conversion from NCHW to NHWC before it alone")
    fold_input_conversion(gm, conv_path, host)


def _swap_linear(gm: nn.Module, path: Any, linear_path: str, entry: Any, host: Target,
                 own_output: Callable[[str], bool]) -> None:
    linear = _submodule(gm, linear_path, nn.Linear)
    if isinstance(entry, dict) and "shape" in entry:  # run as a 1x1 conv on (N, H, W, C) inputs
        shape = entry["shape"]
        if not (_positive_ints(shape) and len(shape) == 4 and shape[3] == linear.in_features):
            raise MacoError(f"{str(path)!r}: linear {short(linear_path)} has no valid (N, H, W, "
                            f"{linear.in_features}) input shape: {short(shape)}")
        swap_module(gm, linear_path, MacoLinearAsConv(linear, tuple(shape), host, own_output(linear_path)))
        return
    batch = entry.get("batch") if isinstance(entry, dict) else None
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise MacoError(f"{str(path)!r}: linear {short(linear_path)} has no valid batch")
    swap_module(gm, linear_path, MacoLinear(linear, batch, host, own_output(linear_path)))


def _swap_pool(gm: nn.Module, path: Any, pool_path: str, entry: Any, host: Target,
               own_output: Callable[[str], bool]) -> None:
    pool = _submodule(gm, pool_path, POOLS)
    shape, layout = (entry.get("shape"), entry.get("layout")) if isinstance(entry, dict) else (None, None)
    if not (_positive_ints(shape) and len(shape) == 4):
        raise MacoError(f"{str(path)!r}: pooling {short(pool_path)} has no valid input shape")
    if layout not in ("NCHW", "NHWC") or plan_for(pool, tuple(shape), layout, host.cores) is None:
        raise MacoError(f"{str(path)!r}: no generated kernel runs pooling {short(pool_path)} "
                        f"on {short(shape)} in {short(layout)}")
    swap_module(gm, pool_path, MacoPool2d(pool, tuple(shape), layout, host, own_output(pool_path)))


def _swap_depthwise(gm: nn.Module, path: Any, conv_path: str, entry: Any, host: Target,
                    own_output: Callable[[str], bool]) -> None:
    conv = _submodule(gm, conv_path, nn.Conv2d)
    spec = _saved_spec(path, "depthwise conv", conv_path, conv, entry)
    if entry.get("layout") not in ("NCHW", "NHWC") or not depthwise_can_run(conv, spec):
        raise MacoError(f"{str(path)!r}: no generated kernel runs depthwise conv {short(conv_path)} "
                        f"({spec}) in {short(entry.get('layout'))}")
    swap_module(gm, conv_path, MacoDepthwise2d(conv, spec, entry["layout"], host, own_output(conv_path)))


def _swap_winograd(gm: nn.Module, path: Any, conv_path: str, entry: Any, host: Target, foreign: bool,
                   exact: bool, own_output: Callable[[str], bool]) -> None:
    """A Winograd kernel with the saved tile size; torch keeps the conv in exact mode, and on
    another machine whose vectors the kernel does not fit (as a default would)."""
    conv = _submodule(gm, conv_path, nn.Conv2d)
    spec = _saved_spec(path, "Winograd conv", conv_path, conv, entry)
    tile = entry.get("tile", 2)  # files from before F(4x4) hold no tile size
    if type(tile) is not int or tile not in TILE_SIZES.get(spec.kh, ()):
        raise MacoError(f"{str(path)!r}: Winograd conv {short(conv_path)} has output tiles of {short(tile)}; "
                        f"the kernel knows {TILE_SIZES.get(spec.kh, ())} for {spec.kh}x{spec.kw} filters")
    if exact:
        return
    if not winograd_module_can_run(conv, spec, host):
        if foreign:
            return
        raise MacoError(f"{str(path)!r}: no generated Winograd kernel runs conv {short(conv_path)} ({spec})")
    swap_module(gm, conv_path, MacoWinograd2d(conv, spec, host, own_output(conv_path), tile))


def _fusion(model: nn.Module) -> list[str]:
    """'path activation residual' of each fused layer, whether torch or a MACO kernel runs it,
    ' scaled' added where a per-channel scale was folded into a Linear."""
    out = []
    for path, mod in model.named_modules():
        inner = getattr(mod, "torch_conv", None) or getattr(mod, "torch_linear", None)
        if isinstance(mod, (FusedConv2d, FusedLinear)) and not path.endswith((".torch_conv", ".torch_linear")):
            fused = mod
        elif isinstance(inner, (FusedConv2d, FusedLinear)):
            fused = inner
        else:
            continue
        scaled = " scaled" if getattr(fused, "scaled", False) else ""
        out.append(f"{path} {fused.activation} {getattr(fused, 'residual', 'none')}{scaled}")
    return sorted(out)


def _positive_ints(value: Any) -> bool:
    """A list of positive ints (a shape read from the file)."""
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)


def _saved_spec(path: Any, what: str, conv_path: str, conv: nn.Conv2d, entry: Any) -> ConvSpec:
    """The spec a section of the file saved for `conv`, which must be the conv's own on that input."""
    if not isinstance(entry, dict) or not isinstance(entry.get("spec"), str):
        raise MacoError(f"{str(path)!r}: {what} {short(conv_path)} has no spec")
    spec = ConvSpec.parse(entry["spec"])
    try:
        own = ConvSpec.from_module(conv, spec.input_shape)
    except MacoError:
        own = None
    if spec != own:
        raise MacoError(f"{str(path)!r}: {what} {short(conv_path)} is not the saved {spec}")
    return spec


def _submodule(gm: nn.Module, path: Any, kind: type | tuple[type, ...]) -> nn.Module:
    try:
        mod = gm.get_submodule(path) if isinstance(path, str) else None
    except AttributeError:
        mod = None
    if not isinstance(mod, kind):
        names = "/".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise MacoError(f"the saved model names {short(path)}, which is no {names} of this model")
    return mod


def _machine(fp: dict[str, Any]) -> str:
    return f"{fp.get('model', '?')} ({fp.get('isa', '?')}, {fp.get('cores', '?')} cores)"
