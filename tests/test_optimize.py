"""maco optimize: model loading errors, and the whole job on a small model file (tune, plan,
MACO kernels swapped into the model, outputs unchanged, report written)."""
import json

import pytest
import torch
from torch import nn

from maco import MacoError
from maco.cli import main
from maco.layouts.networks import load_model
from maco.tune.tuning import BUDGETS

MODEL = '''
import torch
from torch import nn

class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.conv2(y) + y)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))

NotAModule = dict
'''


@pytest.fixture()
def model_file(tmp_path):
    path = tmp_path / "small.py"
    path.write_text(MODEL)
    return path


def test_load_model_names_what_is_wrong(model_file, tmp_path):
    name, model = load_model(f"{model_file}:Small")
    assert name == "Small" and isinstance(model, torch.nn.Module)
    with pytest.raises(MacoError, match="does not exist"):
        load_model(f"{tmp_path}/nope.py:Small")
    with pytest.raises(MacoError, match="has no 'Big'"):
        load_model(f"{model_file}:Big")
    with pytest.raises(MacoError, match="not a torch.nn.Module"):
        load_model(f"{model_file}:NotAModule")
    with pytest.raises(MacoError, match="unknown model 'resnet19'"):
        load_model("resnet19")


def test_optimize_a_small_model_end_to_end(model_file, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["optimize", f"{model_file}:Small", "--input-shape", "1,3,20,20", "--batch", "2", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "report:" in printed and "its network floor" in printed and "at their ceilings would run at" in printed
    report = (out / "report.md").read_text()
    assert "## Per conv layer" in report and "## End to end" in report and "**Against the floor**" in report
    floor = json.loads((out / "time_split.json").read_text())["floor"]
    assert floor["network_s"] > 0 and floor["per_conv_s"] and all(t > 0 for t in floor["per_conv_s"].values())
    assert floor["reach_s"] >= floor["network_s"] and "kernel families at their ceilings" in report
    assert f"batch 2, {torch.get_num_threads()} threads" in report
    plan = json.loads((out / "plan.json").read_text())
    assert plan["layers"] and (out / "layers.csv").is_file() and (out / "layers.png").is_file()
    assert (out / "time_split.png").read_bytes().startswith(b"\x89PNG")
    e2e = json.loads((out / "end_to_end.json").read_text())
    for result in e2e.values():
        assert result["max_abs_diff"] < 1e-3 and result["speedup"] > 0
    lines = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    kernels = [line for line in lines if "baseline" not in line]
    assert len(kernels) == 2 * BUDGETS["quick"]  # the quick budget for each of the 2 distinct convs
    assert len(lines) - len(kernels) == 2 * 2  # and torch's conv, each layout, planned with
    for record in lines:  # tuned for the batch and the threads it runs with
        assert record["spec"]["n"] == 2 and record["target"]["cores"] == torch.get_num_threads()
    assert main(["optimize", "--batch", "0"]) == 2
    assert "--batch" in capsys.readouterr().err


def test_a_floor_that_cannot_be_computed_costs_one_line_not_the_job(monkeypatch):
    """The floor is a report line: an error there leaves the model the job found to the user."""
    import maco.deploy.optimize as opt
    from maco.core.target import Target
    from maco.layouts.end_to_end import ConvShare

    def broken(*args, **kwargs):
        raise RuntimeError("cannot trace this graph")

    monkeypatch.setattr(opt, "measure_ceilings", lambda target, rounds: {"fma_gflops_best": 1.0, "read_gbs_best": 1.0})
    monkeypatch.setattr(opt, "model_floor", broken)
    said = []
    share = ConvShare(1e-3, 1e-3, {"conv": 1e-3})
    assert opt._floor(torch.nn.Conv2d(3, 4, 3), torch.randn(1, 3, 8, 8), share, Target.host(), said.append) is None
    assert said == ["      no network floor for this model (RuntimeError: cannot trace this graph)"]


def test_maco_conv_in_a_model_matches_torch(model_file):
    from maco import ConvSpec, Target, kernels
    from maco.layouts.maco_modules import MacoConv2d

    conv = torch.nn.Conv2d(16, 24, 3, stride=2, padding=1)
    spec = ConvSpec.from_module(conv, (1, 16, 15, 15))
    for layout in ("NCHW", "NHWC"):
        mc = MacoConv2d(conv, spec, kernels.default_schedule(spec, Target.host(), layout), Target.host())
        x = torch.randn(1, 16, 15, 15)
        torch.testing.assert_close(mc(x), conv(x), rtol=1e-4, atol=1e-4)
        x2 = torch.randn(2, 16, 15, 15)  # another shape falls back to torch
        torch.testing.assert_close(mc(x2), conv(x2), rtol=1e-4, atol=1e-4)


def test_in_process_check_keeps_fast_kernels_and_flags_slow_ones():
    from maco import ConvSpec, Target, kernels, space
    from maco.deploy.kernel_choice import MIN_GAIN, confirm_in_process

    spec, target = ConvSpec.parse("n1_c32_h28_w28_k32_r3_p1"), Target.host()
    scalar = next(s for s in space.sample_many(spec, target, 200, 0)
                  if s.layout == "NCHW" and s.vector_width == 1)  # one float at a time: slow
    ratios = confirm_in_process({spec: {"NCHW": scalar,
                                        "NHWC": kernels.default_schedule(spec, target, "NHWC")}},
                                target)[spec]
    assert 0 < ratios["NCHW"] < MIN_GAIN and ratios["NHWC"] > ratios["NCHW"]


def test_a_close_call_in_process_is_timed_longer(monkeypatch):
    from maco import ConvSpec, Target, kernels
    from maco.deploy import kernel_choice
    from maco.core.timing import Timing

    calls = []

    def fake_rounds(runs, rounds, **kw):  # torch and MACO alike: ratio 1.0, a close call
        calls.append(rounds)
        one = Timing(1e-3, 1e-3, 1e-3, 0.0, 3, 1)
        return {label: [one] * rounds for label in runs}
    monkeypatch.setattr(kernel_choice, "interleaved_rounds", fake_rounds)
    spec, target = ConvSpec.parse("n1_c32_h28_w28_k32_r3_p1"), Target.host()
    ratios = kernel_choice.confirm_in_process({spec: {"NHWC": kernels.default_schedule(spec, target, "NHWC")}},
                                              target, rounds=3)
    assert calls == [3, 6] and ratios[spec]["NHWC"] == 1.0


def test_a_recorded_gain_that_does_not_hold_in_process_is_not_used():
    from maco import ConvSpec, Schedule, Target
    from maco.deploy.kernel_choice import faster_kernels
    from maco.tune.records import make_record
    from maco.core.timing import Timing

    spec, target = ConvSpec.parse("n1_c32_h28_w28_k32_r3_p1"), Target.host()
    # one scalar accumulator on one thread: far slower than torch on any host (a random scalar
    # schedule of the space can beat torch's NCHW conv, which reorders its input on every call)
    scalar = Schedule(kind="cpu", spatial=((1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 32, 1), (1, 1, 28, 1),
                                           (1, 1, 28, 1)),
                      reduction=((32, 1), (3, 1), (3, 1)), parallel=0, vector_width=1, unroll=0,
                      layout="NCHW").validate(spec, target)
    claim = Timing.from_samples([1e-7], 1)  # far faster than any real conv of this size
    best = {(spec, "NCHW"): make_record(spec, target, scalar, claim)}
    torch_seconds = {(spec, "NCHW"): 1e-4, (spec, "NHWC"): 1e-4}
    table, chosen, ratios = faster_kernels(torch_seconds, best, target)
    assert chosen == {} and ratios[spec]["NCHW"] < 1  # re-timed here, the claim fell
    assert table == torch_seconds  # the planner sees torch's times, not the record's


def test_a_kernel_recorded_in_a_slow_spell_is_still_tried_and_timed_on_this_clock():
    from maco import ConvSpec, Target, kernels
    from maco.deploy.kernel_choice import MIN_GAIN, faster_kernels
    from maco.tune.records import make_record
    from maco.core.timing import Timing

    spec, target = ConvSpec.parse("n1_c32_h28_w28_k32_r3_p1"), Target.host()
    fast = kernels.default_schedule(spec, target, "NHWC")
    slow_claim = Timing.from_samples([1.0], 1)  # recorded far slower than torch
    best = {(spec, "NHWC"): make_record(spec, target, fast, slow_claim)}
    torch_seconds = {(spec, "NHWC"): 1e-4}
    table, chosen, ratios = faster_kernels(torch_seconds, best, target)
    ratio = ratios[spec]["NHWC"]
    assert ratio > 0
    if ratio >= MIN_GAIN:
        assert chosen == {spec: {"NHWC": fast}}
        assert table[(spec, "NHWC")] == pytest.approx(1e-4 / ratio)
    else:
        assert chosen == {} and table == torch_seconds


def test_the_kernel_count_reads_linears_and_pools_off_the_model_handed_on(tmp_path):
    """The [3/4] line counts the linear and pooling layers the handed-on model runs on MACO kernels,
    not the per-layer timings: a linear that tied torch's (ratio under MIN_GAIN) but runs MACO's
    counts, a pool torch still runs does not."""
    from types import SimpleNamespace

    import torch.fx as fx

    from maco import kernels
    from maco.deploy.optimize import _variants_built
    from maco.layouts.maco_modules import MacoLinear

    host = kernels.host_target()
    model = fx.symbolic_trace(nn.Sequential(nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64, 10)))
    model.add_submodule("2", MacoLinear(nn.Linear(64, 10), 1, host))
    built = SimpleNamespace(plan=SimpleNamespace(to_json=lambda: "{}", convs=[]), swapped=[],
                            models={"default": model, "planned_maco": model}, linears={"2": 1.0}, pools={"0": 0.5},
                            depthwise={}, winograd={}, blocks={}, squeeze=0)
    said = []
    _variants_built(built, tmp_path, said.append)
    assert said[0] == "[3/4] 0 of 0 convs, 1 of 1 linear layers, 0 of 1 pooling layers run MACO kernels"
