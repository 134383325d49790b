"""Inverted residuals in a planned graph, and the rewrite that runs one as a single kernel module.

A block is three call nodes, each the only reader of the one before: a 1x1 expand conv (absent
where the block has none), a depthwise conv and a 1x1 project conv, the project conv reading the
block's input as its residual or nothing else. Whether a generated kernel computes it, on the
input the model gives it, is maco_modules.block_plan's question; which blocks run as one is
decided by timing (deploy.kernel_choice.faster_blocks) and saved with the model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx
from torch import nn

from maco.core.errors import MacoError
from maco.layouts.maco_modules import MacoInvertedResidual, swap_module


@dataclass(frozen=True)
class BlockNodes:
    """The nodes of one block and the module paths they call."""

    expand: fx.Node | None
    depthwise: fx.Node
    project: fx.Node
    source: fx.Node  # the block's input

    @property
    def paths(self) -> tuple[str | None, str, str]:
        return (None if self.expand is None else str(self.expand.target), str(self.depthwise.target),
                str(self.project.target))


def _conv(gm: fx.GraphModule, node: object) -> nn.Conv2d | None:
    """The torch conv a call node runs (a MACO kernel module's own), None for any other node."""
    if not isinstance(node, fx.Node) or node.op != "call_module" or node.kwargs:
        return None
    mod = gm.get_submodule(str(node.target))
    conv = getattr(mod, "torch_conv", mod)
    return conv if isinstance(conv, nn.Conv2d) and not isinstance(mod, MacoInvertedResidual) else None


def _only_reader(node: fx.Node, reader: fx.Node) -> bool:
    return list(node.users) == [reader]


def find_blocks(gm: fx.GraphModule) -> list[BlockNodes]:
    """Every expand -> depthwise -> project chain of call nodes in `gm` (see the module docstring)."""
    found: list[BlockNodes] = []
    projects: set[fx.Node] = set()  # a project conv is no later block's expand conv
    for node in gm.graph.nodes:
        project = _conv(gm, node)
        if project is None or project.kernel_size != (1, 1) or project.groups != 1 or len(node.args) not in (1, 2):
            continue
        dw_node = node.args[0]
        depthwise = _conv(gm, dw_node)
        if depthwise is None or depthwise.groups == 1 or len(dw_node.args) != 1 or not _only_reader(dw_node, node):
            continue
        before = dw_node.args[0]
        expand = _conv(gm, before)
        expand_node = None
        if (expand is not None and before not in projects and expand.kernel_size == (1, 1) and expand.groups == 1 and len(before.args) == 1
                and _only_reader(before, dw_node)):
            expand_node, source = before, before.args[0]
        else:
            source = before
        if not isinstance(source, fx.Node) or (len(node.args) == 2 and node.args[1] is not source):
            continue
        found.append(BlockNodes(expand_node, dw_node, node, source))
        projects.add(node)
    return found


def use_block(gm: fx.GraphModule, block: BlockNodes, module: MacoInvertedResidual) -> None:
    """Put `module` where the block's project conv was and call it on the block's input; the
    expand and depthwise calls leave the graph (their modules stay registered at their paths)."""
    if not isinstance(module, MacoInvertedResidual):
        raise MacoError(f"a block runs as a MacoInvertedResidual, got {type(module).__name__}")
    module.paths = block.paths
    swap_module(gm, str(block.project.target), module)
    block.project.args = (block.source,)
    gm.graph.erase_node(block.depthwise)
    if block.expand is not None:
        gm.graph.erase_node(block.expand)
    gm.graph.lint()
    gm.recompile()
