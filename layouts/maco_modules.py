"""MACO kernels inside a torch model: a Conv2d that runs a compiled kernel, and the swap of a
planned model's convs for them where a tuned schedule won."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from maco import kernels
from maco.schedule import Schedule
from maco.spec import ConvSpec
from maco.target import Target

if TYPE_CHECKING:
    from maco.layouts import LayoutPlan


class MacoConv2d(nn.Module):
    """A Conv2d whose forward runs a compiled MACO kernel for the one input shape it was tuned
    for (any other shape falls back to torch's conv, with the same weights)."""

    def __init__(self, conv: nn.Conv2d, spec: ConvSpec, schedule: Schedule, target: Target):
        super().__init__()
        self.spec, self.layout = spec, schedule.layout
        self.weight, self.bias = conv.weight, conv.bias
        self._kernel = kernels.compile(spec, schedule, target=target, bias=conv.bias is not None)
        self._conv = self._kernel.bind(conv.weight.detach(), None if conv.bias is None else conv.bias.detach())
        self._format = torch.channels_last if self.layout == "NHWC" else torch.contiguous_format

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.spec
        if tuple(x.shape) != (s.n, s.c, s.h, s.w) or x.dtype != torch.float32 or x.device.type != "cpu":
            return torch.nn.functional.conv2d(x, self.weight, self.bias, s.stride, s.padding,
                                              s.dilation, s.groups)
        return self._conv.run_tensor(x.contiguous(memory_format=self._format))

    def extra_repr(self) -> str:
        return f"{self.spec}, layout={self.layout}"


def use_maco_kernels(gm: nn.Module, plan: LayoutPlan, chosen: dict[ConvSpec, dict[str, Schedule]],
                     target: Target) -> list[str]:
    """Swap the planned convs whose layer has a chosen MACO schedule in the plan's layout for
    MacoConv2d modules (in place); returns the module paths swapped."""
    swapped = []
    for layer in plan.convs:
        spec = ConvSpec.parse(layer.spec)
        schedule = chosen.get(spec, {}).get(layer.layout)
        if schedule is None or layer.target in swapped:
            continue
        conv = gm.get_submodule(layer.target)
        parent_name, _, child = layer.target.rpartition(".")
        parent = gm.get_submodule(parent_name) if parent_name else gm
        setattr(parent, child, MacoConv2d(conv, spec, schedule, target))
        swapped.append(layer.target)
    return swapped
