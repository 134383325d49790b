"""torch.compile(model, backend="maco"): outputs equal eager on networks and on a model built here,
records used when given, and what MACO does not handle left to torch with one log line."""
import logging

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from maco import kernels
from maco.core.errors import MacoError
from maco.layouts.networks import build, conv_layers, distinct_convs, example_input
from maco.tune.records import RecordFile, make_record
from maco.core.timing import Timing


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


def test_the_returned_callable_exposes_its_graph():
    """run.model is the optimized graph dynamo calls (the deployment experiment times it alone)."""
    from maco.deploy.compile_backend import maco_backend

    model = _randomize_bn(SmallNet())
    x = torch.randn(1, 3, 32, 32)
    kept = []

    def keeping(gm, inputs):
        kept.append(maco_backend(gm, inputs, options={"tune": "none"}))
        return kept[-1]
    torch._dynamo.reset()
    fast = torch.compile(model, backend=keeping)
    with torch.inference_mode():
        want, got, direct = model(x), fast(x), kept[0].model(x)
    assert len(kept) == 1 and isinstance(kept[0].model, torch.fx.GraphModule)
    direct = direct[0] if isinstance(direct, tuple) else direct
    assert torch.equal(got, direct) and _rel(want, direct) < 1e-4


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


def test_graphs_off_the_cpu_and_a_gpu_are_named():
    """unsupported() names a device MACO has no kernels for, and a graph on a GPU without CuPy."""
    from maco.deploy.compile_backend import unsupported
    from maco.kernels.cuda import gpu_available

    gm = torch.fx.symbolic_trace(SmallNet().eval())
    assert "tensors on meta" in unsupported(gm, [torch.empty(1, 3, 32, 32, device="meta")])
    assert "tensors on" not in unsupported(gm, [torch.randn(1, 3, 32, 32)])
    if torch.cuda.is_available() and not gpu_available():
        assert "no CuPy" in unsupported(gm, [torch.randn(1, 3, 32, 32, device="cuda")])


@pytest.mark.gpu
def test_gpu_graphs_run_maco_cuda_kernels_and_follow_new_weights():
    """On a GPU the backend builds what `maco optimize --target cuda` does: its output equals
    eager's (strict fp32), and after a weight change it still does."""
    from maco.kernels.cuda import gpu_available
    from maco.layouts.cuda_graph import CudaGraphed, unwrap
    from maco.layouts.maco_modules import MacoConv2d

    if not (torch.cuda.is_available() and gpu_available()):
        pytest.skip("no NVIDIA GPU with CuPy here")
    prev = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        model = _randomize_bn(nn.Sequential(*(m for c in (3, 64, 64) for m in (
            nn.Conv2d(c, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU())))).cuda()
        x = torch.randn(1, 3, 56, 56, device="cuda")
        fast = _compiled(model, tune="none")
        with torch.inference_mode():
            assert _rel(model(x), fast(x)) < 1e-4
            model[3].weight.mul_(0.5)
            assert _rel(model(x), fast(x)) < 1e-4
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = prev
    kept = []

    def keeping(gm, inputs):
        from maco.deploy.compile_backend import maco_backend
        kept.append(maco_backend(gm, inputs, options={"tune": "none"}))
        return kept[-1]
    torch._dynamo.reset()
    with torch.inference_mode():
        torch.compile(model, backend=keeping)(x)
    assert isinstance(kept[0].model, CudaGraphed)  # every variant on a GPU; at batch 1 MACO's kernels win (fig15)
    assert any(isinstance(m, MacoConv2d) and m._device == "cuda" for m in unwrap(kept[0].model).modules())


def test_bad_options_are_named():
    from maco.deploy.compile_backend import check_options

    with pytest.raises(MacoError, match="unknown maco backend option"):
        check_options({"turbo": True})
    with pytest.raises(MacoError, match="tune must be one of"):
        check_options({"tune": "forever"})
    with pytest.raises(MacoError, match="layouts must name"):
        check_options({"layouts": "NCWH"})


TWO_CONVS = '''
import torch
from torch import nn

class TwoConvs(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 24, 1)
        self.fc = nn.Linear(24, 10)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.conv2(y))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))
'''


def _records_with_baselines(path, specs, baselines=True):
    """A records file `maco optimize` tunes nothing more in (the quick budget per spec is there)
    and, if `baselines`, torch baselines far apart: conv1 plans NCHW, conv2 NHWC, whatever the
    in-process ratios and conversions."""
    from maco.tune.records import make_baseline
    from maco.tune.tuning import BUDGETS

    host = kernels.host_target()
    records = RecordFile(path)
    for i, spec in enumerate(specs):
        records.append([make_record(spec, host, kernels.default_schedule(spec, host, lay),
                                    Timing(1e-3, 1e-3, 1e-3, 0.0, 3, 10, 1e-3, 1.0))
                        for lay in ("NCHW", "NHWC") for _ in range(BUDGETS["quick"] // 2)])
        if baselines:
            fast, slow = ("NCHW", "NHWC") if i == 0 else ("NHWC", "NCHW")
            records.append([make_baseline(spec, host, fast, Timing(1e-3, 1e-3, 1e-3, 0.0, 3, 10, 1e-3, 1.0)),
                            make_baseline(spec, host, slow, Timing(1e-1, 1e-1, 1e-1, 0.0, 3, 10, 1e-3, 100.0))])


def _spy_backend(monkeypatch):
    """Calls of the in-process torch timing, and the plans the backend builds."""
    import maco.deploy.pipeline as pipeline

    timed, plans = [], []
    real = pipeline.build_variants

    def build(*args, **kw):
        built = real(*args, **kw)
        plans.append(built.plan)
        return built
    monkeypatch.setattr(pipeline, "measure_layouts", lambda *a, **kw: timed.append(a) or pytest.fail("timed torch"))
    monkeypatch.setattr(pipeline, "build_variants", build)
    return timed, plans


def test_with_baselines_the_backend_plans_as_optimize_does(tmp_path, monkeypatch):
    from maco.layouts.networks import load_model
    from maco.deploy.optimize import optimize
    from maco.tune.records import RecordFile as File

    (tmp_path / "two.py").write_text(TWO_CONVS)
    text = f"{tmp_path / 'two.py'}:TwoConvs"
    model = _randomize_bn(load_model(text)[1])
    x = torch.randn(1, 3, 20, 20, generator=torch.Generator().manual_seed(0))
    specs = [s for s, _ in distinct_convs(conv_layers(model, x))]
    path = tmp_path / "records" / "r.jsonl"
    path.parent.mkdir()
    _records_with_baselines(path, specs)
    before = path.read_bytes()
    timed, plans = _spy_backend(monkeypatch)
    # the per-layer plan from the records; whether a kernel in every conv beats it end to end is
    # timing's call (tests/test_pipeline.py checks that comparison)
    monkeypatch.setattr("maco.deploy.pipeline._everywhere_if_faster", lambda *a, **k: None)
    fast = _compiled(model, records=str(path), tune="none")
    with torch.inference_mode():
        assert _rel(model(x), fast(x)) < 1e-4
    assert timed == [] and len(plans) == 1
    result = optimize(text, budget="quick", out=tmp_path / "out", records=path, input_shape=tuple(x.shape),
                      log=lambda s: None)
    assert path.read_bytes() == before  # optimize tuned nothing and timed no torch: all in the records
    layouts = [[(lp.spec, lp.layout) for lp in p.convs] for p in (plans[0], result.plan)]
    assert layouts[0] == layouts[1] == [(str(specs[0]), "NCHW"), (str(specs[1]), "NHWC")]
    assert len(File(path).load_baselines()) == 4


def test_tuning_backend_times_missing_baselines_in_the_worker(tmp_path, monkeypatch):
    """Records tuned before baselines: with tune quick the backend has the tuner's worker time torch
    into the records (as optimize would) instead of timing it in the user's process."""
    from maco.tune.records import baselines_in_files

    model = _randomize_bn(SmallNet())
    x = torch.randn(1, 3, 32, 32)
    specs = [s for s, _ in distinct_convs(conv_layers(model, x))]
    path = tmp_path / "maco_records.jsonl"
    _records_with_baselines(path, specs, baselines=False)
    timed, plans = _spy_backend(monkeypatch)
    fast = _compiled(model, records=str(tmp_path), tune="quick")
    with torch.inference_mode():
        assert _rel(model(x), fast(x)) < 1e-4
    assert timed == [] and len(plans) == 1
    assert set(baselines_in_files([path], kernels.host_target())) == {(s, lay) for s in specs for lay in ("NCHW", "NHWC")}


class Pools(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)

    def forward(self, x):
        y = self.conv(x)
        a = F.max_pool2d(y, 3, 2, 1, ceil_mode=True)
        b = F.avg_pool2d(y, 2, count_include_pad=False, padding=1)
        c, idx = F.max_pool2d(y, 2, return_indices=True)
        return (F.adaptive_avg_pool2d(a, 1) + F.adaptive_max_pool2d(b, (1, 1)) + c.amax((2, 3), keepdim=True)
                + idx.float().mean())


def test_pooling_calls_become_modules_the_pipeline_can_swap():
    from maco.deploy.compile_backend import lift_parameters

    seen = []

    def capture(gm, example_inputs):
        seen.append((gm, example_inputs))
        return gm.forward
    model, x = Pools().eval(), torch.randn(1, 3, 15, 15)
    torch._dynamo.reset()
    with torch.inference_mode():
        torch.compile(model, backend=capture)(x)
        gm, inputs = seen[0]
        lifted, keep = lift_parameters(gm, inputs)
        kinds = sorted(type(m).__name__ for _, m in lifted.named_children())
        assert kinds == ["AdaptiveAvgPool2d", "AdaptiveMaxPool2d", "AvgPool2d", "Conv2d", "MaxPool2d"]  # not the indices
        torch.testing.assert_close(lifted(*[inputs[i] for i in keep])[0], model(x))
        assert _rel(model(x), _compiled(model, tune="none")(x)) < 1e-4
