"""kernels.cache_flush: what a timed call reads is found (the packed weights of MACO's modules,
torch's parameters, a closure's tensors) and dropped from the caches without changing a value."""
import numpy as np
import pytest
import torch
from torch import nn

from maco import kernels
from maco.core.spec import ConvSpec
from maco.kernels.baselines import torch_conv
from maco.kernels.cache_flush import Flush, buffers
from maco.layouts.maco_modules import MacoConv2d, MacoWinograd2d

HOST = kernels.host_target()
SPEC = ConvSpec(1, 16, 10, 10, 64, 3, 3, 1, 1)


def _spans_cover(spans, array) -> bool:
    if isinstance(array, np.ndarray):
        start, size = array.ctypes.data, array.nbytes
    else:
        start, size = array.data_ptr(), array.numel() * array.element_size()
    return any(a <= start and start + size <= a + n for a, n in spans)


def test_the_buffers_of_maco_modules_torch_modules_and_closures_are_found():
    conv = nn.Conv2d(16, 64, 3, padding=1).eval()
    x = torch.randn(SPEC.input_shape).contiguous(memory_format=torch.channels_last)
    winograd = MacoWinograd2d(conv, SPEC, HOST, m=2)
    spans = buffers(winograd)
    assert _spans_cover(spans, winograd._weight)  # U, 16/9 the weights
    assert sum(n for _, n in spans) >= winograd._weight.nbytes
    direct = MacoConv2d(conv, SPEC, kernels.default_schedule(SPEC, HOST, "NHWC"), HOST)
    assert sum(n for _, n in buffers(direct)) >= conv.weight.numel() * 4  # its packed copy
    assert _spans_cover(buffers(conv), conv.weight) and _spans_cover(buffers(conv), conv.bias)

    def closure():
        return winograd(x)
    assert _spans_cover(buffers(closure), winograd._weight) and _spans_cover(buffers(closure), x)
    by_default = lambda module=conv, args=(x,): module(*args)  # noqa: E731: as kernel_choice builds its runs
    assert _spans_cover(buffers(by_default), conv.weight) and _spans_cover(buffers(by_default), x)
    assert buffers(torch_conv(SPEC, x, conv.weight.detach(), "NHWC"))  # the converted copies it closes over


def test_views_of_one_buffer_are_one_span_and_other_things_none():
    a = np.arange(1000, dtype=np.float32)
    t = torch.arange(1000, dtype=torch.float32)
    assert buffers(a[10:20], a, a.reshape(10, 100)) == [(a.ctypes.data, a.nbytes)]
    assert buffers(t[5:], t.view(10, 100)) == [(t.untyped_storage().data_ptr(), 4000)]
    assert buffers(None, 3, "text", np, torch.empty(0), [], {}) == []
    loop: list = []
    loop.append(loop)  # a cycle ends
    assert buffers(loop, {"a": (t,)}) == [(t.untyped_storage().data_ptr(), 4000)]


@pytest.mark.parametrize("offset", [0, 1, 63, 64, 4093])
def test_flushing_keeps_every_value(offset):
    raw = np.random.default_rng(offset).standard_normal(3 << 18).astype(np.float32)  # 3 MiB
    view = raw.view(np.uint8)[offset:]
    want = view.copy()
    flush = Flush(view, torch.from_numpy(raw))
    assert flush.bytes == raw.nbytes  # both are the one base buffer
    flush()
    flush()
    assert np.array_equal(view, want)
    Flush()()  # nothing to flush


def test_a_flushed_kernel_computes_what_it_did():
    conv = nn.Conv2d(16, 64, 3, padding=1).eval()
    x = torch.randn(SPEC.input_shape).contiguous(memory_format=torch.channels_last)
    winograd = MacoWinograd2d(conv, SPEC, HOST, m=4)
    flush = Flush(winograd, x)
    with torch.inference_mode():
        first = winograd(x)
        flush()
        assert torch.equal(winograd(x), first)
