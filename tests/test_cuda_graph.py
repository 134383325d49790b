"""layouts.cuda_graph.CudaGraphed: a model replayed from a CUDA graph hands back what the model
computes, a fresh tensor per call; anything it cannot replay runs the model itself."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from maco.layouts.cuda_graph import CudaGraphed, unwrap


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1)).eval()


def test_cpu_inputs_and_gradients_run_the_model_itself():
    model = _model()
    g = CudaGraphed(model)
    x = torch.randn(2, 3, 9, 9)
    with torch.inference_mode():
        assert torch.equal(g(x), model(x))
    assert g._graph is None  # nothing captured for a CPU tensor
    y = g(x.requires_grad_())  # gradients on: the model itself, so backward works
    y.sum().backward()
    assert unwrap(g) is model and unwrap(model) is model


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU for a CUDA graph")
def test_gpu_replays_equal_the_model_and_never_alias():
    model = _model().cuda()
    g = CudaGraphed(model)
    x1, x2 = torch.randn(2, 3, 9, 9, device="cuda"), torch.randn(2, 3, 9, 9, device="cuda")
    with torch.inference_mode():
        y1 = g(x1)
        y1_copy = y1.clone()
        y2 = g(x2)
        assert g._graph is not None
        torch.testing.assert_close(y1, model(x1))
        torch.testing.assert_close(y2, model(x2))
        assert torch.equal(y1, y1_copy), "the second replay overwrote the first call's output"
        other = torch.randn(1, 3, 11, 11, device="cuda")  # another shape: captured anew
        torch.testing.assert_close(g(other), model(other))
        torch.testing.assert_close(g(x1), model(x1))
