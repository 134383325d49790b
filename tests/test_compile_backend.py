"""torch.compile(model, backend="maco"): outputs equal eager on networks and on a model built here,
records used when given, and what MACO does not handle left to torch with one log line."""
import logging

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from maco import kernels
from maco.errors import MacoError
from maco.layouts.networks import build, conv_layers, distinct_convs, example_input
from maco.records import RecordFile, make_record
from maco.timing import Timing


class SmallNet(nn.Module):
    """Not a network the library knows: BN, a residual, a grouped conv, hardtanh, a classifier."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.a = nn.Conv2d(16, 16, 3, padding=1, groups=4)
        self.bn = nn.BatchNorm2d(16)
        self.b = nn.Conv2d(16, 32, 1, stride=2)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        s = self.stem(x)
        y = F.relu(self.bn(self.a(s)) + s)
        z = F.hardtanh(self.b(y), 0.0, 6.0)
        return self.fc(F.adaptive_avg_pool2d(z, 1).flatten(1))


def _randomize_bn(model):
    g = torch.Generator().manual_seed(3)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.rand(m.num_features, generator=g) - 0.5)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    return model.eval()


def _compiled(model, **options):
    torch._dynamo.reset()
    return torch.compile(model, backend="maco", options=options)


def _rel(a, b):
    return float((a - b).abs().max() / a.abs().max())


@pytest.mark.parametrize("name", ["resnet18", "small"])
def test_outputs_equal_eager_with_the_defaults(name, caplog):
    model = _randomize_bn(SmallNet() if name == "small" else build(name))
    x = torch.randn(1, 3, 32, 32) if name == "small" else example_input(1)
    fast = _compiled(model, tune="none")
    with caplog.at_level(logging.INFO, logger="maco"), torch.inference_mode():
        want, got = model(x), fast(x)
    assert _rel(want, got) < 1e-4
    assert any("maco: " in r.message and "x the graph" in r.message for r in caplog.records)
    with torch.inference_mode():  # a new input shape: one more graph, still equal
        x2 = torch.randn(2, *x.shape[1:])
        assert _rel(model(x2), fast(x2)) < 1e-4


def test_records_are_used(tmp_path, caplog):
    model = _randomize_bn(SmallNet())
    x = torch.randn(1, 3, 32, 32)
    host = kernels.host_target()
    specs = [s for s, _ in distinct_convs(conv_layers(model, x))]
    records = RecordFile(tmp_path / "r.jsonl")
    for spec in specs:
        records.append(make_record(spec, host, kernels.default_schedule(spec, host, "NHWC"),
                                   Timing(1e-6, 1e-6, 1e-6, 0.0, 3, 10)))
    fast = _compiled(model, records=str(tmp_path), tune="none", layouts="NHWC")
    with caplog.at_level(logging.INFO, logger="maco"), torch.inference_mode():
        assert _rel(model(x), fast(x)) < 1e-4
    assert len(records.load()) == len(specs)  # tune none: nothing appended


def test_what_maco_does_not_handle_stays_torch_with_one_log_line(caplog):
    model = SmallNet()
    x = torch.randn(1, 3, 32, 32)
    cases = [(model.train(), x, {}, "training mode"),
             (SmallNet().eval().double(), x.double(), {}, "not float32"),
             (SmallNet().eval(), x, {"dynamic": True}, "dynamic shapes")]
    for mod, inp, kw, words in cases:
        torch._dynamo.reset()
        fast = torch.compile(mod, backend="maco", options={"tune": "none"}, **kw)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="maco"):
            out = fast(inp)
        assert torch.allclose(out, mod(inp), rtol=1e-4, atol=1e-5)
        assert any(words in r.message for r in caplog.records), [r.message for r in caplog.records]


def test_bad_options_are_named():
    from maco.compile_backend import check_options

    with pytest.raises(MacoError, match="unknown maco backend option"):
        check_options({"turbo": True})
    with pytest.raises(MacoError, match="tune must be one of"):
        check_options({"tune": "forever"})
    with pytest.raises(MacoError, match="layouts must name"):
        check_options({"layouts": "NCWH"})
