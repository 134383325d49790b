"""The deployment paths never compute silently wrong outputs: the torch.compile backend follows
changed parameters, survives an example input with NaN, keeps its cache option to itself and
offers an exact mode; a saved model's buffers are derived by load, never taken from the file."""
import json
import logging
import os

import pytest
import torch
from torch import nn

from tests.test_deployment import _planned
from maco import kernels
from maco.deploy.compile_backend import check_options, maco_backend
from maco.deploy.deployment import describe, load
from maco.core.errors import MacoError
from maco.layouts.end_to_end import output_diff
from maco.layouts.maco_modules import MacoConv2d, MacoWinograd2d
from maco.layouts.networks import conv_layers, distinct_convs

HOST = kernels.host_target()


def _net() -> nn.Module:
    torch.manual_seed(0)
    # 64 filters: a whole Winograd register block on AVX2 and AVX-512 alike
    return nn.Sequential(nn.Conv2d(16, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1)).eval()


def _compiled(model, built: list | None = None, **options):
    """torch.compile with the maco backend; the graphs it builds are appended to `built`."""
    torch._dynamo.reset()

    def backend(gm, example_inputs):
        run = maco_backend(gm, example_inputs, {"tune": "none", **options})
        if built is not None:
            built.append(getattr(run, "model", None))
        return run
    return torch.compile(model, backend=backend)


@pytest.mark.parametrize("change", ["mul_", "load_state_dict", "new_parameter"])
def test_the_backend_follows_changed_weights(change, caplog):
    model = _net()
    fast = _compiled(model)
    x = torch.randn(1, 16, 20, 20)
    with torch.no_grad():
        assert float((fast(x) - model(x)).abs().max()) < 1e-4
        if change == "mul_":
            model[2].weight.mul_(2)
        elif change == "load_state_dict":
            other = _net()
            with torch.no_grad():
                for p in other.parameters():
                    p.add_(torch.randn_like(p))
            model.load_state_dict(other.state_dict())
        else:
            model[0].weight = nn.Parameter(model[0].weight * -1)
        want = model(x)
        with caplog.at_level(logging.WARNING, logger="maco"):
            got = fast(x)
    assert float((got - want).abs().max()) < 1e-4 * float(want.abs().max())
    assert change == "new_parameter" or any("changed" in r.getMessage() for r in caplog.records)


def test_new_weights_run_on_the_kernels_chosen_before_unless_those_miss_torchs_output(monkeypatch, caplog):
    """The recompile after a weight change rebuilds the first compile's kernels without timing;
    where that rebuild's output is wrong or it cannot be built, the whole pipeline runs again."""
    from maco.deploy import compile_backend
    real_rebuild = compile_backend.rebuild

    def wrong(*a, **k):  # a kernel that now computes something else
        model = real_rebuild(*a, **k)
        return lambda x: [t * 1.01 for t in model(x)]  # the lifted graph returns its outputs as a list

    def unfit(*a, **k):
        raise MacoError("its fused layers differ")

    real_optimized, first = compile_backend._optimized, []
    monkeypatch.setattr(compile_backend, "_optimized", lambda *a: first.append(real_optimized(*a)) or first[0])
    model = _net()
    fast = _compiled(model)
    x = torch.randn(1, 16, 12, 12)
    with torch.no_grad():
        fast(x)
    assert first[0][1] is not None  # what a recompile rebuilds from
    again = []  # the whole pipeline again, here torch's graph with the first compile's kernels to rebuild next
    monkeypatch.setattr(compile_backend, "_optimized", lambda lifted, *_: again.append(1) or (lifted, first[0][1]))
    for rebuild, pipelines in ((real_rebuild, 0), (wrong, 1), (unfit, 2)):
        monkeypatch.setattr(compile_backend, "rebuild", rebuild)
        caplog.clear()
        with torch.no_grad(), caplog.at_level(logging.INFO, logger="maco"):
            model[2].weight.mul_(-3)
            got, want = fast(x), model(x)
        assert float((got - want).abs().max()) < 1e-4 * float(want.abs().max()), rebuild
        assert len(again) == pipelines, rebuild
        assert any("chosen before" in r.getMessage() for r in caplog.records) == (rebuild is real_rebuild)


def test_after_many_changes_the_graph_is_torchs_and_still_right(caplog):
    model = _net()
    fast = _compiled(model)
    x = torch.randn(1, 16, 12, 12)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="maco"):
        for step in range(6):
            model[0].bias.add_(0.5)
            assert float((fast(x) - model(x)).abs().max()) < 1e-4 * float(model(x).abs().max()), step
    assert any("stays torch's now" in r.getMessage() for r in caplog.records)


def test_a_nan_in_the_first_input_compiles_and_keeps_torchs_nan():
    model = _net()
    fast = _compiled(model)
    x = torch.randn(1, 16, 12, 12)
    x[0, 3, 5, 5] = float("nan")
    with torch.inference_mode():
        want, got = model(x), fast(x)
        assert torch.equal(want.isnan(), got.isnan()) and int(want.isnan().sum()) > 0
        y = torch.randn(1, 16, 12, 12)  # and finite inputs stay right after it
        assert float((fast(y) - model(y)).abs().max()) < 1e-4 * float(model(y).abs().max())


def test_output_diff_compares_nan_and_inf_positions():
    a = torch.tensor([1.0, float("nan"), float("inf"), -float("inf")])
    assert output_diff([a], [a.clone()]) == 0.0
    assert output_diff([a], [torch.tensor([1.5, float("nan"), float("inf"), -float("inf")])]) == 0.5
    for wrong in ([1.0, 0.0, float("inf"), -float("inf")], [1.0, float("nan"), float("nan"), -float("inf")],
                  [1.0, float("nan"), -float("inf"), float("inf")]):
        assert output_diff([a], [torch.tensor(wrong)]) == float("inf")


def test_the_cache_option_does_not_change_the_process_environment(tmp_path):
    before = os.environ.get("MACO_CACHE")
    built: list = []
    fast = _compiled(_net(), built, cache=str(tmp_path / "cache"))
    with torch.inference_mode():
        fast(torch.randn(1, 16, 12, 12))
    assert os.environ.get("MACO_CACHE") == before
    if any(isinstance(m, MacoConv2d) for m in built[0].modules()):
        assert any((tmp_path / "cache").glob("k_*.so"))  # the backend's builds went there


def test_exact_mode_runs_no_winograd_and_is_checked():
    with pytest.raises(MacoError, match="exact must be True or False"):
        check_options({"exact": "yes"})
    model = nn.Sequential(nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1)).eval()
    built: list = []
    fast = _compiled(model, built, exact=True, layouts="NHWC")
    x = torch.randn(1, 32, 28, 28)
    with torch.inference_mode():
        assert float((fast(x) - model(x)).abs().max()) < 1e-4 * float(model(x).abs().max())
    assert built and built[0] is not None
    assert not any(isinstance(m, MacoWinograd2d) for m in built[0].modules())


def _saved(model, x):
    """The file's dict of a planned_maco model of `model` on default NHWC schedules (no tuning)."""
    gm, p = _planned(model, x)
    return describe(gm, "planned_maco", x, HOST, p).to_dict()


def test_a_saved_preallocate_flag_is_not_trusted(tmp_path):
    model, x = _net(), torch.randn(1, 16, 14, 14)
    d = _saved(model, x)
    assert d["convs"] and all("preallocate" not in c for c in d["convs"].values())
    for c in d["convs"].values():
        c["preallocate"] = True  # a hostile or old file: the model's output would be overwritten
    (tmp_path / "m.maco").write_text(json.dumps(d))
    loaded = load(tmp_path / "m.maco", _net())
    x2 = torch.randn(1, 16, 14, 14)
    with torch.inference_mode():
        y1 = loaded(x)
        keep = y1.clone()
        loaded(x2)
        assert torch.equal(y1, keep)  # the first output was not a buffer the second call wrote
        assert float((keep - model(x)).abs().max()) < 1e-4 * float(keep.abs().max())
    last = [m for m in loaded.modules() if isinstance(m, MacoConv2d)][-1]
    assert not last.preallocated


class ResidualAfter(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x)) + x  # the residual comes after the activation: no kernel fuses it


def test_a_saved_conv_no_kernel_computes_is_refused_on_load(tmp_path):
    model, x = ResidualAfter().eval(), torch.randn(1, 16, 10, 10)
    d = _saved(model, x)
    assert not d["convs"]  # optimize never swaps it
    spec = str(next(s for s, _ in distinct_convs(conv_layers(model, x))))
    schedule = kernels.default_schedule(next(s for s, _ in distinct_convs(conv_layers(model, x))), HOST, "NHWC")
    fused_path = next(f.split()[0] for f in d["fusion"] if f.endswith(" after"))
    d["convs"][fused_path] = {"spec": spec, "schedule": schedule.to_dict()}
    (tmp_path / "m.maco").write_text(json.dumps(d))
    with pytest.raises(MacoError, match="no generated kernel computes conv"):
        load(tmp_path / "m.maco", ResidualAfter().eval())


def test_a_huge_saved_input_shape_is_refused_before_any_work(tmp_path):
    model, x = _net(), torch.randn(1, 16, 14, 14)
    d = _saved(model, x)
    d["input_shape"] = [1, 16, 10**6, 10**6]
    (tmp_path / "m.maco").write_text(json.dumps(d))
    with pytest.raises(MacoError, match="GiB of memory"):
        load(tmp_path / "m.maco", _net())


def test_load_in_exact_mode_leaves_winograd_to_torch(tmp_path):
    from maco.kernels.winograd import TILE_SIZES

    model, x = _net(), torch.randn(1, 16, 14, 14)
    d = _saved(model, x)
    spec, path = next(iter((c["spec"], p) for p, c in d["convs"].items()))
    d["winograd"] = {path: {"spec": spec, "tile": TILE_SIZES[3][-1]}}
    del d["convs"][path]
    (tmp_path / "m.maco").write_text(json.dumps(d))
    fast = load(tmp_path / "m.maco", _net())
    exact = load(tmp_path / "m.maco", _net(), exact=True)
    assert any(isinstance(m, MacoWinograd2d) for m in fast.modules())
    assert not any(isinstance(m, MacoWinograd2d) for m in exact.modules())
    with torch.inference_mode():
        assert float((exact(x) - model(x)).abs().max()) < 1e-4 * float(model(x).abs().max())


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))) + x)


def _features() -> nn.Module:
    """ResNet-18's stem and first stage, ending on the feature map (no global pooling, so one
    non-finite input stays local and its positions say something)."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                          nn.MaxPool2d(3, 2, 1), Block(64), Block(64))
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
    return model.eval()


def _poisoned() -> list[torch.Tensor]:
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    nan, pinf, ninf = x.clone(), x.clone(), x.clone()
    nan[0, 1, 10, 20] = float("nan")
    pinf[0, 0, 40, 8] = float("inf")
    ninf[0, 2, 30, 50] = -float("inf")
    return [nan, pinf, ninf]


def _same_positions(want: torch.Tensor, got: torch.Tensor) -> None:
    for test in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(test(want), test(got)), test.__name__
    finite = want.isfinite()
    assert (~finite).any() and float((want[finite] - got[finite]).abs().max()) < 1e-4 * float(want[finite].abs().max())


def _maco_handed_back(monkeypatch) -> None:
    """Every conv on a MACO kernel and the planned MACO model handed back, whatever the timings
    say: these tests are about outputs, and on a busy host torch's convs may win every race."""
    from maco.deploy import kernel_choice, pipeline

    monkeypatch.setattr(kernel_choice, "MIN_GAIN", 0.0)
    real = pipeline.fastest
    monkeypatch.setattr(pipeline, "fastest", lambda models, x, rounds=3: ("planned_maco", real(models, x, rounds)[1]))


def test_a_network_keeps_nan_and_inf_where_eager_does_through_the_backend(monkeypatch):
    _maco_handed_back(monkeypatch)
    model = _features()
    built: list = []
    fast = _compiled(model, built, layouts="NHWC")
    with torch.inference_mode():
        fast(torch.randn(1, 3, 64, 64))
        assert any(isinstance(m, (MacoConv2d, MacoWinograd2d)) for m in built[0].modules())
        for x in _poisoned():
            _same_positions(model(x), fast(x))


def test_a_network_keeps_nan_and_inf_where_eager_does_through_load_with_winograd(tmp_path):
    from maco.kernels.winograd import TILE_SIZES

    model, x = _features(), torch.randn(1, 3, 64, 64)
    d = _saved(model, x)
    for path, c in list(d["convs"].items()):
        if "_r3x3" in c["spec"]:  # every 3x3 conv through Winograd, F(4x4)
            d["winograd"][path] = {"spec": c["spec"], "tile": max(TILE_SIZES[3])}
            del d["convs"][path]
    assert len(d["winograd"]) == 4 and d["convs"]
    (tmp_path / "m.maco").write_text(json.dumps(d))
    loaded = load(tmp_path / "m.maco", _features())
    assert sum(isinstance(m, MacoWinograd2d) for m in loaded.modules()) == 4
    with torch.inference_mode():
        for x in _poisoned():
            _same_positions(model(x), loaded(x))


@pytest.mark.parametrize("shape", [(1, 3, 1e30, 8), (1, 3, 8.0, 8), (1, 0, 8, 8)])
def test_optimize_names_a_bad_input_shape(shape, tmp_path):
    from maco.deploy.optimize import optimize

    with pytest.raises(MacoError, match="input_shape must be positive ints"):
        optimize(f"{__file__}:ResidualAfter", input_shape=shape, out=tmp_path / "out", engines=())
