"""A model replayed from a CUDA graph: at batch 1 a network's GPU time is mostly the Python and
the launches of its ~50 calls, and a MACO kernel call converts its tensors in Python besides;
one replay of a captured graph pays neither."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


class CudaGraphed(nn.Module):
    """`model` captured in a CUDA graph on its first call with a CUDA input under inference
    (torch.inference_mode or no_grad), then replayed for every input of the same shape, dtype
    and device, and its output handed back as a fresh tensor (the graph's own output buffer is
    overwritten by the next replay: handing it back would alias the results of two calls).
    Any other call (another shape, a CPU tensor, gradients on) runs `model` itself."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self._graph: Any = None
        self._key: tuple[Any, ...] | None = None
        self._static_in: torch.Tensor | None = None
        self._static_out: Any = None

    def forward(self, x: torch.Tensor) -> Any:
        if not (isinstance(x, torch.Tensor) and x.is_cuda) or torch.is_grad_enabled():
            return self.model(x)
        key = (tuple(x.shape), x.stride(), x.dtype, x.device, torch.is_inference_mode_enabled())
        if self._graph is None or key != self._key:
            self._capture(x, key)
        self._static_in.copy_(x)
        self._graph.replay()
        return _clone(self._static_out)

    def _capture(self, x: torch.Tensor, key: tuple[Any, ...]) -> None:
        static_in = x.clone()
        side = torch.cuda.Stream(device=x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up off the graph: cuDNN's algorithm search, lazy allocations
                self.model(static_in)
        torch.cuda.current_stream(x.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = self.model(static_in)
        self._graph, self._key, self._static_in, self._static_out = graph, key, static_in, static_out


def _clone(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_clone(o) for o in out)
    return out


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a CudaGraphed one (the one whose modules a saved model describes)."""
    return model.model if isinstance(model, CudaGraphed) else model


__all__ = ["CudaGraphed", "unwrap"]
