"""Inverted residuals and squeeze-excitation in a planned graph, and the rewrites that run each as
a single kernel module.

A block is three call nodes, each the only reader of the one before: a 1x1 expand conv (absent
where the block has none), a depthwise conv and a 1x1 project conv, the project conv reading the
block's input as its residual or nothing else. Where squeeze-excitation reads the depthwise
output (EfficientNet, MobileNetV3), the block's front half, expand -> depthwise, is one. Whether a generated kernel computes it, on the
input the model gives it, is maco_modules.block_plan's question; which blocks run as one is
decided by timing (deploy.kernel_choice.faster_blocks) and saved with the model.

Squeeze-excitation is a multiply x * g whose g comes, through layout conversions only, from a
gate module (Sigmoid, Hardsigmoid) on a 1x1 conv on a 1x1 conv on a global pool of x, each
node the only reader of the one before (maco_modules.squeeze_plan says which a kernel runs).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn

from maco.core.errors import MacoError
from maco.layouts.maco_modules import MacoInvertedResidual, MacoSqueezeExcite, swap_module


@dataclass(frozen=True)
class BlockNodes:
    """The nodes of one block and the module paths they call; without a project conv, the block's
    front half (expand and depthwise), whose output other nodes read (squeeze-excitation)."""

    expand: fx.Node | None
    depthwise: fx.Node
    project: fx.Node | None
    source: fx.Node  # the block's input

    @property
    def last(self) -> fx.Node:
        """The node whose module the block's kernel replaces."""
        return self.depthwise if self.project is None else self.project

    @property
    def paths(self) -> tuple[str | None, str, str | None]:
        return tuple(None if n is None else str(n.target) for n in (self.expand, self.depthwise, self.project))


def _conv(gm: fx.GraphModule, node: object) -> nn.Conv2d | None:
    """The torch conv a call node runs (a MACO kernel module's own), None for any other node."""
    if not isinstance(node, fx.Node) or node.op != "call_module" or node.kwargs:
        return None
    mod = gm.get_submodule(str(node.target))
    conv = getattr(mod, "torch_conv", mod)
    return conv if isinstance(conv, nn.Conv2d) and not isinstance(mod, MacoInvertedResidual) else None


def _only_reader(node: fx.Node, reader: fx.Node) -> bool:
    return list(node.users) == [reader]


def _pointwise(conv: nn.Conv2d | None) -> bool:
    return conv is not None and conv.kernel_size == (1, 1) and conv.groups == 1


def _expand_of(gm: fx.GraphModule, dw_node: fx.Node, taken: set[fx.Node]) -> fx.Node | None:
    """The expand conv's node before a depthwise conv's: a 1x1 conv it alone reads, in no other block."""
    before = dw_node.args[0]
    if (isinstance(before, fx.Node) and before not in taken and _pointwise(_conv(gm, before))
            and len(before.args) == 1 and _only_reader(before, dw_node)):
        return before
    return None


def find_blocks(gm: fx.GraphModule) -> list[BlockNodes]:
    """Every expand -> depthwise -> project chain of call nodes in `gm` (see the module docstring),
    then every expand -> depthwise chain left (a block's front half)."""
    found: list[BlockNodes] = []
    taken: set[fx.Node] = set()  # nodes of a block found: in no other block
    for node in gm.graph.nodes:
        if not _pointwise(_conv(gm, node)) or len(node.args) not in (1, 2):
            continue
        dw_node = node.args[0]
        depthwise = _conv(gm, dw_node)
        if (depthwise is None or depthwise.groups == 1 or len(dw_node.args) != 1 or dw_node in taken
                or not _only_reader(dw_node, node)):
            continue
        expand = _expand_of(gm, dw_node, taken)
        source = dw_node.args[0] if expand is None else expand.args[0]
        if not isinstance(source, fx.Node) or (len(node.args) == 2 and node.args[1] is not source):
            continue
        found.append(BlockNodes(expand, dw_node, node, source))
        taken.update(n for n in (expand, dw_node, node) if n is not None)
    for node in gm.graph.nodes:
        depthwise = _conv(gm, node)
        if depthwise is None or depthwise.groups == 1 or len(node.args) != 1 or node in taken:
            continue
        expand = _expand_of(gm, node, taken)
        if expand is not None and isinstance(expand.args[0], fx.Node):
            found.append(BlockNodes(expand, node, None, expand.args[0]))
            taken.update((expand, node))
    return found


def use_block(gm: fx.GraphModule, block: BlockNodes, module: MacoInvertedResidual) -> None:
    """Put `module` where the block's last conv was and call it on the block's input; the block's
    other calls leave the graph (their modules stay registered at their paths)."""
    if not isinstance(module, MacoInvertedResidual):
        raise MacoError(f"a block runs as a MacoInvertedResidual, got {type(module).__name__}")
    module.paths = block.paths
    swap_module(gm, str(block.last.target), module)
    block.last.args = (block.source,)
    for node in (block.depthwise, block.expand):
        if node is not None and node is not block.last:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


@dataclass(frozen=True)
class SqueezeNodes:
    """The nodes of one squeeze-excitation: its multiply, the module calls before it (pool, fc1,
    fc2, gate), the layout conversions between them and the input x it scales."""

    multiply: fx.Node
    calls: tuple[fx.Node, fx.Node, fx.Node, fx.Node]
    conversions: tuple[fx.Node, ...]
    source: fx.Node

    @property
    def paths(self) -> tuple[str, str, str, str]:
        return tuple(str(n.target) for n in self.calls)


def _before(node: object, reader: fx.Node, conversions: list[fx.Node]) -> tuple[object, fx.Node]:
    """What `node` (read by `reader`) reads past layout conversions (x.contiguous(...)) each read
    only by the next, and the node that reads it; the conversions passed go to `conversions`."""
    while (isinstance(node, fx.Node) and node.op == "call_method" and node.target == "contiguous"
           and len(node.args) == 1 and list(node.users) == [reader]):
        conversions.append(node)
        node, reader = node.args[0], node
    return node, reader


def find_squeeze_excites(gm: fx.GraphModule) -> list[SqueezeNodes]:
    """Every squeeze-excitation of `gm` (see the module docstring): multiply <- gate <- fc2 <- fc1
    <- pool <- x, past layout conversions, each call read only by the next. The chain's shape
    only: whether its modules are a pool, two 1x1 convs and a gate a kernel runs is
    maco_modules.squeeze_plan's question."""
    found = []
    for node in gm.graph.nodes:
        if (node.op != "call_function" or node.target not in (operator.mul, torch.mul) or node.kwargs
                or len(node.args) != 2 or not all(isinstance(a, fx.Node) for a in node.args)):
            continue
        for x, g in (node.args, node.args[::-1]):
            conversions: list[fx.Node] = []
            calls: list[fx.Node] = []
            at, reader = _before(g, node, conversions)
            while len(calls) < 4 and (isinstance(at, fx.Node) and at.op == "call_module" and len(at.args) == 1
                                      and not at.kwargs and list(at.users) == [reader]):
                calls.append(at)
                at, reader = _before(at.args[0], at, conversions)
            if len(calls) == 4 and at is x:
                found.append(SqueezeNodes(node, tuple(reversed(calls)), tuple(conversions), x))
                break
    return found


def use_squeeze_excite(gm: fx.GraphModule, found: SqueezeNodes, module: MacoSqueezeExcite) -> None:
    """Put `module` where the gate module was and call it on x in place of the multiply; the
    other calls and conversions leave the graph (their modules stay registered at their paths)."""
    if not isinstance(module, MacoSqueezeExcite):
        raise MacoError(f"squeeze-excitation runs as a MacoSqueezeExcite, got {type(module).__name__}")
    module.paths = found.paths
    gate = found.calls[3]
    swap_module(gm, str(gate.target), module)
    with gm.graph.inserting_before(found.multiply):
        call = gm.graph.call_module(str(gate.target), (found.source,))
    found.multiply.replace_all_uses_with(call)
    gone = {found.multiply, *found.calls, *found.conversions}
    for node in reversed(list(gm.graph.nodes)):  # each after the node that read it
        if node in gone:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
