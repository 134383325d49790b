"""Runs of MACO kernel modules in a planned graph as one call each: no per-module Python inside.

A planned model with MACO kernels calls one Python module per kernel: the module call, its shape,
dtype and layout checks and a ctypes call, ~10-20 us each, for every conv, depthwise conv and pool.
`use_segments` finds each run of consecutive MACO kernel modules in the graph (one feeding the
next, or reading what an earlier one wrote, with the shapes and memory formats they take) and
puts in its place one MacoSegment: a module whose forward checks the run's inputs from outside
once, with the same checks its modules make, and then makes one C call (kernels.sequence) that
runs the kernels' function pointers in order on a static table of pointers. A run takes in the
views between its kernels (dropout and identity modules, flatten(1) of a value dense in NCHW, a
contiguous() that moves nothing) and a functional global average pool on one of its values
(torchvision's MobileNetV2 head) as a pooling kernel it holds itself, so that a network's head runs
in the same call: the first torch op after a long C call pays for torch's dispatch coming back
into the caches.

Memory plan: a value that only the run reads lives in one arena the segment owns, at an offset
planned by liveness (two values share bytes only where neither is live while the other is), so the
run's working set is what is live, not every layer's output; a value read after the run gets a
buffer of its own (the module's preallocated output where it had one), and a value that reaches
the model's output (maco_modules.escapes) a new tensor every call, so the tensors a call hands
back never alias a buffer the next call overwrites. Such a model runs one call at a time, as
before.

What stays as it was: any input of another shape, dtype, device or memory format than the run's
kernels take runs the modules one by one, each of which then falls back to torch as before; a
Winograd step whose outputs were not all finite stops the C call, is recomputed by torch's direct
conv (kernels.winograd.direct), and the call goes on from the next step, so NaN and infinities
land where eager torch puts them; a fused inverted residual whose buffers could not be allocated
is computed by its torch convs the same way. The modules stay where they were in the model (saved models
and reports find them by their paths); only the graph calls the segment instead.
"""
from __future__ import annotations

import ctypes
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn
from torch.nn import functional as F

from maco.kernels.sequence import ARGS, CHECKED5, PYTHON, VOID2, VOID4, VOID5, address, sequence_function
from maco.kernels.winograd import direct
from maco.layouts.maco_modules import (MacoConv2d, MacoDepthwise2d, MacoInvertedResidual, MacoLinear, MacoPool2d,
                                       MacoSqueezeExcite, MacoWinograd2d, escapes)
from maco.kernels.pool import plan_for
from maco.core.target import Target

MIN_STEPS = 2  # a run of one module gains nothing from a segment
ALIGN = 16  # floats: arena offsets on 64-byte lines
STEP_MODULES = (MacoConv2d, MacoDepthwise2d, MacoPool2d, MacoLinear, MacoWinograd2d, MacoInvertedResidual,
                MacoSqueezeExcite)
NCHW, NHWC = torch.contiguous_format, torch.channels_last
SPARES, SPARE_BYTES = 32, 1 << 20  # a segment's new outputs made ahead: at most this many, and bytes


@dataclass(frozen=True)
class Port:
    """A tensor a kernel reads or writes: its logical shape and memory format."""

    shape: tuple[int, ...]
    fmt: torch.memory_format

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def holds(self, other: "Port") -> bool:
        """Whether a dense tensor of this port is one `other`'s kernel reads as it is."""
        if self.shape != other.shape:
            return False
        return self.fmt == other.fmt or _empty(self).is_contiguous(memory_format=other.fmt)

    def accepts(self, t: Any) -> bool:
        """Whether `t` is a tensor the kernel reads as it is (shape, dtype, device, memory format).
        Each attribute read is a call into torch, and after a model's kernels have swept the
        caches each costs 10-45 us: the fewest and cheapest (is_cpu, not device.type)."""
        return (isinstance(t, torch.Tensor) and t.dtype is torch.float32 and t.is_cpu
                and t.shape == self.shape and t.is_contiguous(memory_format=self.fmt))


def _empty(port: Port) -> torch.Tensor:
    return torch.empty(port.shape, memory_format=port.fmt) if len(port.shape) == 4 else torch.empty(port.shape)


def ports(module: nn.Module, nargs: int) -> tuple[list[Port], Port] | None:
    """The ports a MACO kernel module reads (input, then residual) and writes, when called with
    `nargs` tensors; None where a call like that does not run its kernel."""
    if isinstance(module, MacoConv2d):
        s, fmt = module.spec, module._format
        if nargs != 1 + module._kernel.residual:
            return None
        ins = [Port(s.input_shape, module._in_format)] + ([Port(s.output_shape, fmt)] if nargs == 2 else [])
        return ins, Port(s.output_shape, fmt)
    if isinstance(module, MacoWinograd2d):
        s = module.spec
        if nargs != 1 + module._plan.residual:
            return None
        ins = [Port(s.input_shape, NHWC)] + ([Port(s.output_shape, NHWC)] if nargs == 2 else [])
        return ins, Port(s.output_shape, NHWC)
    if isinstance(module, MacoDepthwise2d) and nargs == 1:
        return [Port(module.spec.input_shape, module._format)], Port(module.spec.output_shape, module._format)
    if isinstance(module, MacoInvertedResidual) and nargs == 1:
        return [Port(module.shape, NHWC)], Port(module.plan.output_shape, NHWC)
    if isinstance(module, MacoPool2d) and nargs == 1:
        return [Port(module.shape, module._format)], Port(module._out_shape, module._format)
    if isinstance(module, MacoSqueezeExcite) and nargs == 1:
        return [Port(module.shape, module._format)], Port(module.shape, module._format)
    if isinstance(module, MacoLinear) and nargs == 1:
        return [Port(module._shape, NCHW)], Port((module.batch, module.torch_linear.out_features), NCHW)
    return None


@dataclass
class Step:
    """One kernel module of a segment: what it reads (("in", i): the segment's input i;
    ("step", j): what step j wrote) and the graph's views of each read on the way, its ports and
    where its output goes."""

    module: nn.Module
    reads: list[tuple[str, int]]
    views: list[tuple[Callable[[Any], Any], ...]]  # per read, applied in order
    ins: list[Port]
    out: Port
    export: bool = False  # read after the segment
    fresh: bool = False  # reaches the model's output: a new tensor every call

    def read(self, inputs: tuple, values: list) -> list[Any]:
        """What the step's module reads, as the graph hands it over (the views between applied)."""
        got = []
        for (kind, k), views in zip(self.reads, self.views, strict=True):
            t = inputs[k] if kind == "in" else values[k]
            for view in views:
                t = view(t)
            got.append(t)
        return got


class MacoSegment(nn.Module):
    """A run of MACO kernel modules called as one (see the module docstring). `per_module` runs
    them one by one (as the graph did before), `skip_kernels` runs no kernel at all (what the
    model costs besides its kernels: end_to_end.conv_share); a list in `step_seconds` gets each
    call's seconds per step, timed inside the C call (a step run in Python counts 0)."""

    maco_leaf = True

    def __init__(self, steps: list[Step], guards: list[tuple[int, Port]], n_inputs: int, target: Target,
                 share_memory: bool = True):
        super().__init__()
        self._share_memory = share_memory  # False: each value its own bytes (to measure what sharing gains)
        self._steps = steps  # a plain list: the modules stay registered where the model has them
        self._n_inputs = n_inputs
        self._guards = guards
        self._exports = [j for j, step in enumerate(steps) if step.export]
        self.per_module = False
        self.skip_kernels = False
        self.step_seconds: list[list[float]] | None = None
        self._target = target
        self._run = sequence_function(target)
        self._run_timed: Any = None  # built when first timed
        n = len(steps)
        self._fns = (ctypes.c_void_p * n)()
        self._kinds = (ctypes.c_long * n)()
        self._args = (ctypes.c_void_p * (ARGS * n))()
        self._tables = (ctypes.addressof(self._fns), ctypes.addressof(self._kinds), ctypes.addressof(self._args))
        self._arena, offsets = self._plan_memory()
        self._values: list[torch.Tensor | None] = [self._buffer(j, offsets) for j in range(n)]
        self._input_slots: list[list[int]] = [[] for _ in range(n_inputs)]
        self._fresh_slots: dict[int, list[int]] = {j: [] for j, s in enumerate(steps) if s.fresh}
        self._spares: dict[int, list[tuple[torch.Tensor, int]]] = {j: [] for j in self._fresh_slots}
        for j, step in enumerate(steps):
            self._fill(j, step)

    # -- building --------------------------------------------------------------------------------
    def _plan_memory(self) -> tuple[torch.Tensor, dict[int, int]]:
        """Offsets (floats) in one arena of the values only the segment reads, placed greedily,
        largest first, at the lowest aligned offset clear of every value live at the same time."""
        last = {j: j for j, s in enumerate(self._steps) if not s.export}
        for j, step in enumerate(self._steps):
            for kind, k in step.reads:
                if kind == "step" and k in last:
                    last[k] = max(last[k], j)
        placed: list[tuple[int, int, int, int]] = []  # offset, size, first step, last step
        offsets = {}
        for j in sorted(last, key=lambda j: (-self._steps[j].out.numel, j)):
            size = self._steps[j].out.numel
            off = 0
            live = [p for p in placed if not self._share_memory or (p[2] <= last[j] and j <= p[3])]
            for o, s, lo, hi in sorted(live):
                if off + size <= o:
                    break
                off = max(off, -(-(o + s) // ALIGN) * ALIGN)
            placed.append((off, size, j, last[j]))
            offsets[j] = off
        total = max((o + s for o, s, _, _ in placed), default=0)
        return torch.empty(max(total, 1), dtype=torch.float32), offsets

    def _buffer(self, j: int, offsets: dict[int, int]) -> torch.Tensor | None:
        """Where step j writes: its arena view, the module's own preallocated output, a buffer of
        its own, or None (a new tensor every call)."""
        step = self._steps[j]
        if step.fresh:
            return None
        port = step.out
        if j in offsets:
            flat = self._arena[offsets[j]:offsets[j] + port.numel]
            if len(port.shape) == 4 and port.fmt == NHWC:
                n, c, h, w = port.shape
                return flat.view(n, h, w, c).permute(0, 3, 1, 2)
            return flat.view(port.shape)
        own = getattr(step.module, "_out", None)
        if isinstance(own, torch.Tensor) and port.accepts(own):
            return own
        return _empty(port)

    def _fill(self, j: int, step: Step) -> None:
        """Step j's row of the tables: function, kind and pointer arguments (inputs from outside
        and new outputs are patched in every call)."""
        mod, base = step.module, ARGS * j
        reads: list[int | None] = []
        for r, (kind, k) in enumerate(step.reads):
            if kind == "in":
                self._input_slots[k].append(base + (r if r == 0 else 3))
                reads.append(None)
            else:
                value = self._values[k]
                if value is None:
                    self._fresh_slots[k].append(base + (r if r == 0 else 3))
                reads.append(None if value is None else value.data_ptr())
        x, res = reads[0], reads[1] if len(reads) > 1 else None
        y = None if self._values[j] is None else self._values[j].data_ptr()
        if step.fresh:
            self._fresh_slots[j].append(base + _out_slot(mod))
        if isinstance(mod, MacoConv2d):
            fn, kind = mod._kernel.function(), VOID5
            args = [x, mod._conv.weight.ctypes.data, _np_ptr(mod._conv.bias), res, y]
        elif isinstance(mod, MacoWinograd2d):
            fn, kind = mod._kernel.function, CHECKED5 if mod._finite else PYTHON
            args = [x, mod._weight.ctypes.data, _np_ptr(mod._bias), res, y]
        elif isinstance(mod, MacoDepthwise2d):
            fn, kind = mod._kernel.function, VOID4
            args = [x, mod._weight.ctypes.data, _np_ptr(mod._bias), y, None]
        elif isinstance(mod, MacoInvertedResidual):
            fn, kind = mod._kernel.function, CHECKED5
            args = [x, mod._weight.ctypes.data, None, None, y]
        elif isinstance(mod, MacoPool2d):
            fn, kind = mod._kernel.function, VOID2
            args = [x, y, None, None, None]
        elif isinstance(mod, MacoSqueezeExcite):
            fn, kind = mod._kernel.function, VOID4
            args = [x, mod._weight.ctypes.data, mod._bias.ctypes.data, y, None]
        else:  # MacoLinear
            fn, kind = mod._kernel.function, VOID4
            args = [x, mod._weight.data_ptr(), None if mod._bias is None else mod._bias.data_ptr(), y, None]
        self._fns[j] = address(fn)
        self._kinds[j] = kind
        for i, a in enumerate(args):
            self._args[base + i] = a

    # -- running ---------------------------------------------------------------------------------
    def forward(self, *inputs: Any) -> Any:
        if self.per_module or not self._fits(inputs):
            return self._one_by_one(inputs)
        args = self._args
        for slots, t in zip(self._input_slots, inputs):
            p = t.data_ptr()
            for s in slots:
                args[s] = p
        values = self._values
        if self._fresh_slots:
            values = list(values)
            for j, slots in self._fresh_slots.items():
                t, p = self._fresh(j)
                values[j] = t
                for s in slots:
                    args[s] = p
        if self.step_seconds is not None:
            self._timed_kernels(inputs, values)
        elif not self.skip_kernels:
            self._kernels(self._run, inputs, values)
        if len(self._exports) == 1:
            return values[self._exports[0]]
        return tuple(values[j] for j in self._exports)

    def _fresh(self, j: int) -> tuple[torch.Tensor, int]:
        """A new tensor for step j's output, never handed out before, and its address. Made
        SPARE_BYTES at a time: torch.empty and data_ptr, called on caches the kernels have just
        swept, take ~70 us a call, a third of a small model's Python."""
        spares = self._spares[j]
        if not spares:
            port = self._steps[j].out
            count = max(1, min(SPARES, SPARE_BYTES // (4 * max(1, port.numel))))
            spares.extend((t, t.data_ptr()) for t in (_empty(port) for _ in range(count)))
        return spares.pop()

    def _kernels(self, run: Any, inputs: tuple, values: list, *extra: int) -> None:
        """Every step through the dispatcher `run` (its `extra` arguments after start and n), each
        step it stops at handled in Python before it goes on from the next."""
        n, start = len(self._steps), 0
        while (stop := run(*self._tables, start, n, *extra)) < n:
            self._in_python(stop, inputs, values)
            start = stop + 1

    def _timed_kernels(self, inputs: tuple, values: list) -> None:
        """The kernels as forward runs them, each step's time appended to step_seconds."""
        if self._run_timed is None:
            self._run_timed = sequence_function(self._target, timed=True)
        ns = (ctypes.c_longlong * len(self._steps))()
        self._kernels(self._run_timed, inputs, values, ctypes.addressof(ns))
        self.step_seconds.append([t * 1e-9 for t in ns])

    def _fits(self, inputs: tuple) -> bool:
        """The checks each module makes before its kernel runs, made once on the inputs from outside
        (what the segment's own kernels write fits by construction)."""
        return len(inputs) == self._n_inputs and all(port.accepts(inputs[i]) for i, port in self._guards)

    def _in_python(self, j: int, inputs: tuple, values: list) -> None:
        """Step j that the C call stopped at: a Winograd conv whose outputs were not all finite (or
        whose weights are not), recomputed by torch's direct conv into its output; a block whose
        kernel could not allocate its buffers, computed by its torch convs."""
        step, mod = self._steps[j], self._steps[j].module
        got = step.read(inputs, values)
        if isinstance(mod, MacoInvertedResidual):
            values[j].copy_(mod.torch_chain(got[0]))
            return
        direct(mod._plan, got[0], mod._torch_weight, mod._torch_bias, got[1] if len(got) > 1 else None, values[j])

    def _one_by_one(self, inputs: tuple) -> Any:
        """The modules called in order, as the graph called them before."""
        values: list[Any] = []
        for step in self._steps:
            values.append(step.module(*step.read(inputs, values)))
        if len(self._exports) == 1:
            return values[self._exports[0]]
        return tuple(values[j] for j in self._exports)

    @property
    def modules_in_order(self) -> list[nn.Module]:
        return [step.module for step in self._steps]

    def extra_repr(self) -> str:
        internal = sum(1 for s in self._steps if not s.export)
        return (f"{len(self._steps)} kernels, {len(self._exports)} outputs, {internal} values in a "
                f"{self._arena.numel() * 4 / 1024:.0f} KiB arena")


def _out_slot(mod: nn.Module) -> int:
    """The argument position of a kernel module's output."""
    if isinstance(mod, (MacoConv2d, MacoWinograd2d, MacoInvertedResidual)):
        return 4
    if isinstance(mod, MacoPool2d):
        return 1
    return 3


def _np_ptr(a: Any) -> int | None:
    return None if a is None else a.ctypes.data


# -- the graph pass ------------------------------------------------------------------------------
@dataclass
class _Scan:
    """What find_runs learns of a graph: the runs, each kernel node's (module, ports read, port
    written), and each view node's (source, port, replay)."""

    runs: list[list[fx.Node]]
    calls: dict[fx.Node, tuple[nn.Module, list[Port], Port]]
    views: dict[fx.Node, tuple[fx.Node, Port, Callable[[Any], Any]]]


def _kernel_call(gm: fx.GraphModule, node: fx.Node) -> tuple[nn.Module, list[Port], Port] | None:
    if node.op != "call_module" or node.kwargs or not all(isinstance(a, fx.Node) for a in node.args):
        return None
    mod = gm.get_submodule(str(node.target))
    if not isinstance(mod, STEP_MODULES):
        return None
    found = ports(mod, len(node.args))
    return None if found is None else (mod, *found)


def _view(gm: fx.GraphModule, node: fx.Node, port: dict[fx.Node, Port]) -> tuple[fx.Node, Port, Callable] | None:
    """(source, port, replay) where `node` hands on a value of the run as the same bytes read as
    another port: a dropout or identity module (inference), contiguous() where the value already is
    (an (N, C, 1, 1) tensor is in both layouts), flatten(1) of a value dense in NCHW; else None."""
    src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if src not in port:
        return None
    have = port[src]
    if node.op == "call_module" and len(node.args) == 1 and not node.kwargs:
        mod = gm.get_submodule(str(node.target))
        if isinstance(mod, nn.Identity) or (isinstance(mod, nn.Dropout) and not mod.training):
            return src, have, mod
        return None
    if node.op == "call_method" and node.target == "contiguous" and len(node.args) == 1:
        fmt = node.kwargs.get("memory_format", NCHW)
        if set(node.kwargs) <= {"memory_format"} and fmt in (NCHW, NHWC) and have.holds(Port(have.shape, fmt)):
            return src, Port(have.shape, fmt), lambda t: t.contiguous(memory_format=fmt)
        return None
    flatten = ((node.op == "call_function" and node.target is torch.flatten)
               or (node.op == "call_method" and node.target == "flatten"))
    dims = tuple(node.args[1:]) + tuple(node.kwargs.get(k) for k in ("start_dim", "end_dim") if k in node.kwargs)
    if (flatten and dims in ((1,), (1, -1)) and len(have.shape) == 4
            and set(node.kwargs) <= {"start_dim", "end_dim"} and have.holds(Port(have.shape, NCHW))):
        return src, Port((have.shape[0], math.prod(have.shape[1:])), NCHW), lambda t: torch.flatten(t, 1)
    return None


def _global_pool(node: fx.Node, port: dict[fx.Node, Port],
                 target: Target | None) -> tuple[nn.Module, list[Port], Port] | None:
    """A generated pooling kernel for F.adaptive_avg_pool2d(x, size) on a value of the run, which
    the graph calls as a function (torchvision's MobileNetV2 head): built here, held by the segment."""
    if (target is None or node.op != "call_function" or node.target is not F.adaptive_avg_pool2d
            or len(node.args) + len(node.kwargs) != 2 or node.args[0] not in port):
        return None
    have = port[node.args[0]]
    size = node.args[1] if len(node.args) == 2 else node.kwargs.get("output_size")
    pool = nn.AdaptiveAvgPool2d(size)
    layout = "NHWC" if have.fmt == NHWC else "NCHW"
    if len(have.shape) != 4 or plan_for(pool, have.shape, layout, target.cores) is None:
        return None
    mod = MacoPool2d(pool, have.shape, layout, target)
    return mod, [Port(have.shape, have.fmt)], Port(mod._out_shape, have.fmt)


def _scan(gm: fx.GraphModule, target: Target | None) -> _Scan:
    """Walk the graph once: runs of consecutive kernel nodes (with the views between them), each
    reading what an earlier one of its run wrote only in the shape and memory format it takes."""
    scan = _Scan([], {}, {})
    run: list[fx.Node] = []
    port: dict[fx.Node, Port] = {}  # what each node of the current run writes

    def close() -> None:
        scan.runs.append(_trimmed(run, scan.views))
        run.clear()
        port.clear()

    for node in gm.graph.nodes:
        view = _view(gm, node, port) if run else None
        if view is not None:
            scan.views[node] = view
            run.append(node)
            port[node] = view[1]
            continue
        call = _kernel_call(gm, node) or _global_pool(node, port, target)
        if call is None:
            close()
            continue
        _, ins, out = call
        if any(a in port and not port[a].holds(p) for a, p in zip(node.args, ins)):
            close()
        scan.calls[node] = call
        run.append(node)
        port[node] = out
    close()
    scan.runs = [r for r in scan.runs if sum(n in scan.calls for n in r) >= MIN_STEPS]
    return scan


def _trimmed(run: list[fx.Node], views: dict[fx.Node, Any]) -> list[fx.Node]:
    """The run up to its first view that something outside it reads, without views at its end
    (a view stays in the graph, reading the segment's output, unless only the run reads it)."""
    members = set(run)
    for i, node in enumerate(run):
        if node in views and any(user not in members for user in node.users):
            run = run[:i]
            break
    while run and run[-1] in views:
        run = run[:-1]
    return list(run)


def find_runs(gm: fx.GraphModule, target: Target | None = None) -> list[list[fx.Node]]:
    """Runs of consecutive graph nodes that call MACO kernel modules, each reading what an earlier
    one of its run wrote only in the shape and memory format it takes; views between them
    (flatten, dropout, a contiguous() that moves nothing) belong to the run. With a `target`, a
    functional global average pool on a value of the run is a kernel of it too."""
    return _scan(gm, target).runs


def use_segments(gm: fx.GraphModule, target: Target, *, share_memory: bool = True) -> list[str]:
    """Replace (in place) each run of MACO kernel modules in `gm` (find_runs) by one MacoSegment
    call; returns the new modules' names. The modules stay registered at their paths.
    share_memory=False gives every value of a run bytes of its own (no liveness plan)."""
    scan = _scan(gm, target)
    plans = [_segment_of(gm, run, scan, target, share_memory) for run in scan.runs]  # escapes: the graph as it was
    names = []
    now: dict[fx.Node, fx.Node] = {}  # an output of an earlier run -> what stands for it now
    for run, (segment, inputs, exports) in zip(scan.runs, plans):
        name = _free_name(gm, f"maco_segment_{len(names)}")
        gm.add_submodule(name, segment)
        with gm.graph.inserting_before(run[0]):
            call = gm.graph.call_module(name, tuple(now.get(node, node) for node in inputs))
        members = set(run)
        outside = lambda user: user not in members  # noqa: E731
        if len(exports) == 1:
            exports[0].replace_all_uses_with(call, delete_user_cb=outside)
            now[exports[0]] = call
        else:
            with gm.graph.inserting_after(call):
                for i, node in reversed(list(enumerate(exports))):
                    item = gm.graph.call_function(operator.getitem, (call, i))
                    node.replace_all_uses_with(item, delete_user_cb=outside)
                    now[node] = item
        for node in reversed(run):
            gm.graph.erase_node(node)
        names.append(name)
    if names:
        gm.graph.lint()
        gm.recompile()
    return names


def _segment_of(gm: fx.GraphModule, run: list[fx.Node], scan: _Scan, target: Target,
                share_memory: bool) -> tuple[MacoSegment, list[fx.Node], list[fx.Node]]:
    """The segment for one run, the nodes it reads from outside and the nodes read after it."""
    members = set(run)
    kernels = [node for node in run if node in scan.calls]
    index = {node: j for j, node in enumerate(kernels)}
    inputs: list[fx.Node] = []
    guards: list[tuple[int, Port]] = []
    steps = []
    for node in kernels:
        mod, ins, out = scan.calls[node]
        reads, views = [], []
        for arg, port in zip(node.args, ins):
            replay: list[Callable] = []
            while arg in scan.views and arg in members:
                arg, _, how = scan.views[arg]
                replay.insert(0, how)
            views.append(tuple(replay))
            if arg in index:
                reads.append(("step", index[arg]))
                continue
            if arg not in inputs:
                inputs.append(arg)
            i = inputs.index(arg)
            reads.append(("in", i))
            guards.append((i, port))
        export = any(user not in members for user in node.users)
        steps.append(Step(mod, reads, views, ins, out, export, export and escapes(gm, node)))
    exports = [node for node, step in zip(kernels, steps) if step.export]
    if not exports:  # nothing reads the run: keep its last output as its result
        steps[-1].export = True
        exports = [kernels[-1]]
    return MacoSegment(steps, guards, len(inputs), target, share_memory), inputs, exports


def _free_name(gm: nn.Module, name: str) -> str:
    taken = dict(gm.named_children())
    k, free = 0, name
    while free in taken:
        k += 1
        free = f"{name}_{k}"
    return free


def segments_of(model: nn.Module) -> list[MacoSegment]:
    return [m for m in model.modules() if isinstance(m, MacoSegment)]
