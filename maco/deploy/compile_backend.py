"""torch.compile(model, backend="maco"): the graph dynamo hands over gets what `maco optimize` does,
without a separate run: BatchNorm folded, epilogues fused, layouts planned, MACO kernels swapped in
where they beat torch in this process, and the fastest variant kept.

    fast = torch.compile(model.eval(), backend="maco", options={"tune": "none"})
    options: records  a records file or folder (tuned schedules and torch baselines; a folder:
                      every *.jsonl in it)
             tune     none (the bound-derived defaults where no record has the layer), quick or
                      normal (tune the missing layers first, into the records file, and time
                      torch's conv in the tuner's worker where the records have no baseline)
             layouts  the layouts the planner may choose, e.g. "NHWC" (default NCHW,NHWC)
             cache    the kernel cache folder for this backend's builds and tuning (default
                      $MACO_CACHE or ~/.cache/maco/kernels); the process's environment is restored
             exact    True: no Winograd kernels (their fp32 error is up to ~10-25x torch's direct
                      conv's, and local to an output tile), only direct and generated kernels
                      whose sums are torch's

Dynamo passes parameters as graph inputs. MACO reads them at compile time (folds BatchNorm, packs
the weights for its kernels) and checks on every call that each is the same tensor at the same
version: after `weight.mul_(2)` or `load_state_dict` it compiles again from the new values (one
log line), on the kernels it chose the first time where the output still equals torch's (no
timing), and after MAX_RECOMPILES such changes the graph stays torch's. What MACO does not
handle stays torch's, with one log line saying why: training mode, tensors that are not fp32,
tensors on a GPU where CuPy is missing or the graph takes more than one input, dynamic shapes, a
graph without a conv, parameters made under inference_mode (they carry no version to check). On a
CUDA GPU the convs run MACO's CUDA kernels where they beat cuDNN, and the graph replays from a CUDA
graph, as `maco optimize --target cuda` builds it. A new input shape makes dynamo compile one more
graph, with kernels from the records or the defaults. An example input with NaN or Inf is optimized on a finite input
of its shape: the kernels keep NaN and Inf where torch does, but an output check on NaN proves
little.
"""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.nn import functional as F

from maco import kernels
from maco.core.errors import MacoError
from maco.core.files import short
from maco.core.target import Target
from maco.deploy.deployment import Deployment, describe, rebuild
from maco.deploy.kernel_choice import MIN_GAIN, OUTPUT_RTOL
from maco.deploy.pipeline import Tuning, run_pipeline
from maco.layouts.cuda_graph import unwrap
from maco.layouts.end_to_end import output_diff, output_scale, output_tensors
from maco.tune.records import RecordStore

log = logging.getLogger("maco")
TUNES = ("none", "quick", "normal")
OPTIONS = ("records", "tune", "layouts", "cache", "exact")
MAX_RECOMPILES = 3  # parameter changes a graph follows by compiling again; past them it stays torch's
CONV_FUNCTIONS = {torch.conv2d, F.conv2d}
WEIGHT_USES = {torch.conv2d: (1, 2), F.conv2d: (1, 2), F.batch_norm: (1, 2, 3, 4), F.linear: (1, 2)}


def maco_backend(gm: fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None,
                 **_: Any) -> Callable[..., Any]:
    """The dynamo backend (registered as "maco" through the torch_dynamo_backends entry point)."""
    opts = check_options(options)
    why = unsupported(gm, example_inputs)
    if why:
        log.warning("maco: this graph stays torch's: %s", why)
        return gm.forward
    lifted, keep = lift_parameters(gm, example_inputs)
    if lifted is None:
        log.warning("maco: this graph stays torch's: %s", keep)
        return gm.forward
    weights = [i for i in range(len(example_inputs)) if i not in keep]
    if _on_gpu(example_inputs) and len(keep) != 1:
        log.warning("maco: this graph stays torch's: on a GPU MACO replays a graph of one input from a CUDA "
                    "graph, and this one takes %d", len(keep))
        return gm.forward
    if any(example_inputs[i].is_inference() for i in weights):
        log.warning("maco: this graph stays torch's: its parameters were made under torch.inference_mode() and "
                    "carry no version, so a change to them could not be seen; build the model outside it")
        return gm.forward
    with _cache_folder(opts.get("cache")):
        model, dep = _optimized(lifted, [example_inputs[i] for i in keep], opts)
    state = {"model": model, "dep": dep, "seen": _versions(example_inputs, weights), "recompiles": 0}

    def run(*args: Any) -> Any:
        if state["model"] is not None and _versions(args, weights) != state["seen"]:
            _follow_parameters(gm, args, keep, weights, opts, state)
        if state["model"] is None:
            return gm.forward(*args)
        return state["model"](*[args[i] for i in keep])
    run.model = model  # the optimized graph itself, to inspect or time without dynamo's call around it
    return run


def _versions(args: Any, weights: list[int]) -> list[tuple[int, int, int]]:
    """Identity, storage and version of each parameter input: any change means new values."""
    return [(id(args[i]), args[i].data_ptr(), args[i]._version) for i in weights]


def _follow_parameters(gm: fx.GraphModule, args: Any, keep: list[int], weights: list[int],
                       opts: dict[str, Any], state: dict[str, Any]) -> None:
    """The parameters changed since MACO read them: compile again from the new ones, or, after
    MAX_RECOMPILES changes, leave the graph to torch (it reads the parameters on every call)."""
    state["seen"] = _versions(args, weights)
    state["recompiles"] += 1
    if state["recompiles"] > MAX_RECOMPILES:
        log.warning("maco: the parameters changed %d times since compiling; this graph stays torch's now",
                    state["recompiles"])
        state["model"] = None
        return
    log.warning("maco: the parameters changed since they were read (in-place update or load_state_dict); "
                "compiling again from the new values")
    lifted, _ = lift_parameters(gm, list(args))
    inputs = [args[i] for i in keep]
    with _cache_folder(opts.get("cache")):
        state["model"] = _same_kernels(lifted, inputs, state["dep"], opts)
        if state["model"] is None:
            state["model"], state["dep"] = _optimized(lifted, inputs, opts)


def _same_kernels(lifted: fx.GraphModule, inputs: list[torch.Tensor], dep: Deployment | None,
                  opts: dict[str, Any]) -> nn.Module | None:
    """The graph rebuilt from new parameter values with the kernels, plan and variant chosen the
    first time (they were timed on these shapes; values do not change their speed), if its output
    on a finite input still equals torch's to OUTPUT_RTOL; else None (compile from scratch)."""
    if dep is None:
        return None
    try:
        model = rebuild(dep, lifted, _target(inputs), exact=opts["exact"])
    except MacoError as exc:
        log.info("maco: the first compile's kernels do not fit the new parameters (%s)", exc)
        return None
    x = _random_like(inputs[0], torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want, got = output_tensors(lifted(x)), output_tensors(model(x))
    if output_diff(want, got) > OUTPUT_RTOL * output_scale(want):
        log.info("maco: with the new parameters the first compile's kernels miss torch's output; timing again")
        return None
    log.info("maco: the new parameters run on the kernels chosen before (no timing)")
    return model


@contextmanager
def _cache_folder(folder: Any) -> Iterator[None]:
    """MACO_CACHE set to the backend's `cache` option while it builds (its tuning workers inherit
    it), and restored after: the option belongs to this backend, not to the whole process."""
    if not folder:
        yield
        return
    before = os.environ.get("MACO_CACHE")
    os.environ["MACO_CACHE"] = str(folder)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("MACO_CACHE", None)
        else:
            os.environ["MACO_CACHE"] = before


def check_options(options: dict[str, Any] | None) -> dict[str, Any]:
    opts = dict(options or {})
    unknown = set(opts) - set(OPTIONS)
    if unknown:
        raise MacoError(f"unknown maco backend option(s) {sorted(unknown)}; known: {', '.join(OPTIONS)}")
    tune = opts.setdefault("tune", "none")
    if tune not in TUNES:
        raise MacoError(f"maco backend option tune must be one of {TUNES}, got {short(tune)}")
    layouts = opts.get("layouts", ("NCHW", "NHWC"))
    layouts = tuple(v.strip() for v in layouts.split(",")) if isinstance(layouts, str) else tuple(layouts)
    if not layouts or any(v not in ("NCHW", "NHWC") for v in layouts):
        raise MacoError(f"maco backend option layouts must name NCHW and/or NHWC, got {short(opts['layouts'])}")
    opts["layouts"] = layouts
    records = opts.get("records")
    if records is not None:
        path = Path(records)
        files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
        if tune != "none":
            files = files or [path / "maco_records.jsonl"]
        opts["records"] = files
    if not isinstance(opts.setdefault("exact", False), bool):
        raise MacoError(f"maco backend option exact must be True or False, got {short(opts['exact'])}")
    return opts


def unsupported(gm: fx.GraphModule, example_inputs: list[Any]) -> str:
    """Why MACO leaves this graph to torch ("" when it takes it)."""
    if any(not isinstance(t, torch.Tensor) for t in example_inputs):
        return "dynamic shapes (a symbolic size among the inputs)"
    if any(isinstance(d, torch.SymInt) for t in example_inputs for d in t.shape):
        return "dynamic shapes"
    devices = {t.device.type for t in example_inputs}
    if devices not in (set(), {"cpu"}, {"cuda"}):
        return f"tensors on {' and '.join(sorted(devices))} (MACO runs a graph on the CPU or on one CUDA GPU)"
    if devices == {"cuda"}:
        from maco.kernels.cuda import gpu_available

        if len({t.device for t in example_inputs}) > 1:
            return "tensors on several GPUs"
        if not gpu_available():
            return "CUDA tensors, and no CuPy here for MACO's CUDA kernels (pip install maco[cuda])"
    if any(t.dtype != torch.float32 for t in example_inputs if t.is_floating_point()):
        return "tensors that are not float32"
    if torch.is_grad_enabled() and any(t.requires_grad for t in example_inputs):
        return "training mode (gradients are on): call the model under torch.no_grad() or inference_mode()"
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is F.batch_norm and _arg(node, 5, "training", False):
            return "training mode (BatchNorm uses batch statistics): call model.eval() first"
        if node.op == "call_function" and node.target is F.dropout and _arg(node, 2, "training", False):
            return "training mode (dropout is on): call model.eval() first"
    if not any(n.op == "call_function" and n.target in CONV_FUNCTIONS for n in gm.graph.nodes):
        return "no conv2d in this graph"
    return ""


def lift_parameters(gm: fx.GraphModule, example_inputs: list[Any]) -> tuple[fx.GraphModule | None, Any]:
    """The graph with each conv2d / batch_norm / linear on parameter inputs turned back into a
    Conv2d / BatchNorm2d / Linear module holding those tensors (shared, not copied), each pooling
    call turned into its module (as `maco optimize` sees a model), and the
    positions of the inputs left (the activations). (None, why) when a parameter is also used
    some other way."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ShapeProp(gm).propagate(*example_inputs)
    value = dict(zip(placeholders, example_inputs))
    weights = {n for n in placeholders if isinstance(value[n], nn.Parameter) or "_buffers_" in n.name}
    for n in weights:
        for user in n.users:
            uses = WEIGHT_USES.get(user.target) if user.op == "call_function" else None
            if uses is None or not any(_arg(user, i, None, None) is n for i in uses):
                return None, f"parameter {n.name} is used by {user.format_node()}, not as a weight"
    graph, env = fx.Graph(), {}
    root = nn.Module()
    count = 0
    for node in gm.graph.nodes:
        if node in weights:
            continue
        module = _as_module(node, value, weights)
        if module is None:
            env[node] = graph.node_copy(node, lambda n: env[n])
            continue
        count += 1
        name = f"{_kind(node)}_{count}"
        root.add_module(name, module)
        env[node] = graph.call_module(name, (env[node.args[0]],))
        env[node].meta = dict(node.meta)
    keep = [i for i, n in enumerate(placeholders) if n not in weights]
    lifted = fx.GraphModule(root, graph, "MacoLifted")
    lifted.eval()
    return lifted, keep


def _as_module(node: fx.Node, value: dict[fx.Node, Any], weights: set[fx.Node]) -> nn.Module | None:
    if node.op == "call_function" and node.target in POOL_FUNCTIONS:
        return _as_pool(node)
    if node.op != "call_function" or node.target not in WEIGHT_USES:
        return None
    args = [_arg(node, i, k, d) for i, (k, d) in enumerate(_SIGNATURES[node.target])]
    params = [a for a in args[1:] if isinstance(a, fx.Node)]
    if not params or any(p not in weights for p in params):
        return None  # computed weights: torch runs the call as it is
    get = lambda a: value[a].detach() if isinstance(a, fx.Node) else a  # noqa: E731
    if node.target in CONV_FUNCTIONS:
        _, w, b, stride, padding, dilation, groups = args
        if isinstance(padding, str):
            return None
        w = get(w)
        conv = nn.Conv2d(w.shape[1] * groups, w.shape[0], tuple(w.shape[2:]), stride, padding, dilation,
                         groups, bias=b is not None)
        conv.weight = nn.Parameter(w, requires_grad=False)
        if b is not None:
            conv.bias = nn.Parameter(get(b), requires_grad=False)
        return conv.eval()
    if node.target is F.batch_norm:
        _, mean, var, w, b, training, momentum, eps = args
        shape = getattr(node.meta.get("tensor_meta"), "shape", ())
        if training or len(shape) != 4 or mean is None:
            return None
        bn = nn.BatchNorm2d(shape[1], eps, momentum or 0.1, affine=w is not None)
        bn.running_mean, bn.running_var = get(mean), get(var)
        if w is not None:
            bn.weight, bn.bias = nn.Parameter(get(w), requires_grad=False), nn.Parameter(get(b), requires_grad=False)
        return bn.eval()
    _, w, b = args
    w = get(w)
    linear = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
    linear.weight = nn.Parameter(w, requires_grad=False)
    if b is not None:
        linear.bias = nn.Parameter(get(b), requires_grad=False)
    return linear.eval()


_SIGNATURES = {
    torch.conv2d: [("input", None), ("weight", None), ("bias", None), ("stride", 1), ("padding", 0),
                   ("dilation", 1), ("groups", 1)],
    F.batch_norm: [("input", None), ("running_mean", None), ("running_var", None), ("weight", None),
                   ("bias", None), ("training", False), ("momentum", 0.1), ("eps", 1e-5)],
    F.linear: [("input", None), ("weight", None), ("bias", None)],
}
_SIGNATURES[F.conv2d] = _SIGNATURES[torch.conv2d]


# pooling calls become the modules `maco optimize` sees in a model, so that the pipeline can swap
# in MACO's pooling kernels here too (kernel_choice.faster_pools looks for modules)
POOL_FUNCTIONS = {
    F.max_pool2d: [("input", None), ("kernel_size", None), ("stride", None), ("padding", 0), ("dilation", 1),
                   ("ceil_mode", False), ("return_indices", False)],
    F.avg_pool2d: [("input", None), ("kernel_size", None), ("stride", None), ("padding", 0), ("ceil_mode", False),
                   ("count_include_pad", True), ("divisor_override", None)],
    F.adaptive_avg_pool2d: [("input", None), ("output_size", None)],
    F.adaptive_max_pool2d: [("input", None), ("output_size", None), ("return_indices", False)],
}


def _as_pool(node: fx.Node) -> nn.Module | None:
    args = [_arg(node, i, k, d) for i, (k, d) in enumerate(POOL_FUNCTIONS[node.target])][1:]
    if not node.args or any(isinstance(a, fx.Node) for a in args) or (
            node.target in (F.max_pool2d, F.adaptive_max_pool2d) and args[-1]):
        return None  # computed sizes, or indices asked for: torch runs the call as it is
    if node.target is F.max_pool2d:
        kernel, stride, padding, dilation, ceil_mode, _ = args
        return nn.MaxPool2d(kernel, stride, padding, dilation, ceil_mode=ceil_mode)
    if node.target is F.avg_pool2d:
        return nn.AvgPool2d(*args)
    return (nn.AdaptiveAvgPool2d if node.target is F.adaptive_avg_pool2d else nn.AdaptiveMaxPool2d)(args[0])


def _arg(node: fx.Node, index: int, name: str | None, default: Any) -> Any:
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get(name, default) if name else default


def _kind(node: fx.Node) -> str:
    return {F.batch_norm: "bn", F.linear: "fc"}.get(node.target, "pool" if node.target in POOL_FUNCTIONS else "conv")


def _optimized(model: fx.GraphModule, inputs: list[torch.Tensor],
               opts: dict[str, Any]) -> tuple[nn.Module, Deployment | None]:
    """The pipeline on the lifted graph: candidates from the records (or the defaults, or a quick
    or normal tuning of the missing layers), torch's seconds from the records' baselines (timed
    here only where they have none), the fastest variant kept; with its Deployment."""
    target = _target(inputs)
    if not all(bool(t.isfinite().all()) for t in inputs if t.is_floating_point()):
        log.info("maco: the example input holds NaN or Inf; optimizing on a finite input of its shape")
        gen = torch.Generator().manual_seed(0)
        inputs = [_random_like(t, gen) if t.is_floating_point() else t for t in inputs]
    x = inputs[0] if len(inputs) == 1 else tuple(inputs)
    files = opts.get("records") or []
    tuning = Tuning(opts["tune"], files[0]) if opts["tune"] != "none" and files else None
    run = run_pipeline(model, x, target, RecordStore(files, target), tuning=tuning, layouts=opts["layouts"],
                       device=target.device, exact=opts["exact"], log=log.info)
    built, pick = run.built, run.pick
    log.info("maco: %s, %.2fx the graph as torch runs it (%d MACO convs, %d MACO linear layers)", pick,
             run.times.speedup(pick), len(built.swapped) if pick == "planned_maco" else 0,
             sum(r >= MIN_GAIN for r in built.linears.values()) if pick == "planned_maco" else 0)
    model = built.models[pick]
    # what rebuilds it from new parameter values (one input tensor, as a saved model has)
    dep = describe(unwrap(model), pick, x, target, built.plan) if isinstance(x, torch.Tensor) else None
    return model, dep


def _on_gpu(tensors: list[Any]) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors)


def _target(inputs: list[torch.Tensor]) -> Target:
    """MACO's CUDA target for a graph on a GPU (unsupported() has checked CuPy), else this CPU."""
    return Target.h100() if _on_gpu(inputs) else kernels.host_target()


def _random_like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A finite standard-normal input of t's shape, device and memory format (drawn on the CPU, so
    that a seed gives the same values on either device)."""
    return torch.randn(t.shape, generator=gen).to(t.device, memory_format=_format(t))


def _format(t: torch.Tensor) -> torch.memory_format:
    return torch.channels_last if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(
        memory_format=torch.channels_last) else torch.contiguous_format
