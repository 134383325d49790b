"""A conv kernel that reads its input in the other layout than it writes (kernels: input_layout),
and the planned model's first NHWC conv reading the model's NCHW input itself, with no conversion
before it (maco_modules.fold_input_conversion, kernel_choice.faster_input_reads): outputs equal
eager torch's, NaN and infinities where torch puts them, the graph without the conversion, saved
models that keep it and refuse a tampered entry."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import maco
from maco import ConvSpec, MacoError, Schedule, kernels
from maco.deploy.deployment import describe, save
from maco.deploy.kernel_choice import faster_input_reads, kernels_everywhere
from maco.kernels.cpu_codegen import CpuPlan
from maco.layouts.maco_modules import MacoConv2d, fold_input_conversion, input_conversion
from maco.layouts.segments import segments_of, use_segments
from tests.targets import AVX2, GENERIC
from tests.test_kernels_cpu import portable_schedules

HOST = kernels.host_target()
needs_avx2 = pytest.mark.skipif(HOST.isa not in ("avx2", "avx512"), reason="host has no AVX2+FMA")
FORMATS = {"NCHW": torch.contiguous_format, "NHWC": torch.channels_last}


def _check(spec: ConvSpec, schedule: Schedule, target, input_layout: str) -> None:
    """The kernel on an input in `input_layout`, with NaN, +inf and -inf in it, against torch."""
    torch.manual_seed(0)
    w, b = torch.randn(spec.k, spec.c_per_group, spec.kh, spec.kw), torch.randn(spec.k)
    x = torch.randn(spec.input_shape)
    x[0, 0, 0, 0], x[0, -1, spec.h // 2, spec.w // 2], x[-1, 0, -1, -1] = float("nan"), float("inf"), -float("inf")
    kernel = kernels.compile(spec, schedule, target, bias=True, activation="relu", input_layout=input_layout)
    y = kernel.bind(w, b).run_tensor(x.contiguous(memory_format=FORMATS[input_layout]))
    want = torch.relu(torch.nn.functional.conv2d(x, w, b, spec.stride, spec.padding, spec.dilation, spec.groups))
    assert y.is_contiguous(memory_format=FORMATS[schedule.layout])
    assert torch.equal(y.isnan(), want.isnan()) and torch.equal(y.isinf(), want.isinf()), (spec, schedule)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4, equal_nan=True)


@pytest.mark.parametrize("spec", ["n1_c3_h40_w40_k16_r3x3_s2_p1", "n2_c5_h17_w13_k16_r3x3_p1",
                                  "n1_c16_h9_w9_k8_r1x1_s2", "n1_c8_h10_w10_k16_r3x3_p1_g2",
                                  "n1_c3_h23_w19_k8_r7x7_s2_p3", "n1_c4_h12_w12_k8_r3x3_p2_d2"])
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_a_kernel_reads_its_input_in_the_other_layout(spec, layout):
    s = ConvSpec.parse(spec)
    _check(s, kernels.default_schedule(s, HOST, layout), HOST, "NCHW" if layout == "NHWC" else "NHWC")


def test_every_vector_axis_reads_the_other_layout_in_portable_c():
    spec, schedules = portable_schedules()
    for schedule in schedules:
        _check(spec, schedule, GENERIC, "NHWC" if schedule.layout == "NCHW" else "NCHW")


@needs_avx2
def test_input_row_vectors_need_an_nchw_input():
    """An "ow" schedule loads input rows as vectors: read in NHWC, it runs the portable C."""
    spec = ConvSpec.parse("n1_c8_h9_w16_k16_r3x3_p1")
    ow = Schedule("cpu", ((1, 1, 1, 1), (1, 1, 1, 1), (2, 1, 2, 4), (3, 1, 3, 1), (1, 1, 1, 16)),
                  ((2, 4), (1, 3), (3, 1)), parallel=4, vector_axis="ow", vector_width=8,
                  layout="NCHW", weight_packing="none")
    assert CpuPlan(spec, ow, AVX2).intrinsics == "avx2"
    assert CpuPlan(spec, ow, AVX2, input_layout="NHWC").intrinsics is None
    _check(spec, ow, AVX2, "NHWC")


def test_an_unknown_input_layout_is_named():
    spec = ConvSpec.parse("n1_c3_h8_w8_k8_r3x3_p1")
    with pytest.raises(MacoError, match="NCHW8c"):
        kernels.compile(spec, kernels.default_schedule(spec, HOST, "NHWC"), HOST, input_layout="NCHW8c")


class Tiny(nn.Module):
    """A stem (3 -> 16, stride 2), a conv on its output and a classifier: no network's shapes."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.conv = nn.Conv2d(16, 24, 3, 1, 1)
        self.fc = nn.Linear(24, 10)

    def forward(self, x):
        x = torch.relu(self.conv(self.stem(x)))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def _planned():
    torch.manual_seed(0)
    model = Tiny().eval()
    with torch.no_grad():  # statistics of a trained net, not the identity
        model.stem[1].running_mean.uniform_(-0.5, 0.5)
        model.stem[1].running_var.uniform_(0.5, 2.0)
    x = torch.randn(1, 3, 38, 30)
    gm, p = kernels_everywhere(model, x, HOST, others=False)
    convs = [path for path, m in gm.named_modules() if isinstance(m, MacoConv2d)]
    assert len(convs) == 2
    return model, x, gm, p, convs


def _conversions(gm) -> int:
    return sum(n.op == "call_method" and n.target == "contiguous"
               and n.kwargs.get("memory_format") is torch.channels_last for n in gm.graph.nodes)


def test_the_first_conv_reads_the_model_input_itself():
    model, x, gm, _, (first, second) = _planned()
    assert input_conversion(gm, first) is not None and input_conversion(gm, second) is None
    with pytest.raises(MacoError, match="no conversion to NHWC feeds conv"):
        fold_input_conversion(gm, second, HOST)
    before = _conversions(gm)
    fold_input_conversion(gm, first, HOST)
    assert _conversions(gm) == before - 1
    assert gm.get_submodule(first).input_layout == "NCHW" and gm.get_submodule(first).layout == "NHWC"
    assert "input_layout=NCHW" in repr(gm.get_submodule(first))
    nan = x.clone()
    nan[0, 1, 5, 7] = float("nan")
    with torch.inference_mode():
        for inp in (x, x.contiguous(memory_format=torch.channels_last), nan):  # NHWC: converted back
            torch.testing.assert_close(gm(inp), model(inp), rtol=1e-4, atol=1e-5, equal_nan=True)
        use_segments(gm, HOST)
        (segment,) = segments_of(gm)
        assert segment._steps[0].ins[0].fmt == torch.contiguous_format
        for inp in (x, x.contiguous(memory_format=torch.channels_last), nan):
            torch.testing.assert_close(gm(inp), model(inp), rtol=1e-4, atol=1e-5, equal_nan=True)


def test_the_fold_is_timed_and_kept_only_where_it_wins():
    model, x, gm, _, (first, _) = _planned()
    ratios = faster_input_reads(gm, x, HOST, rounds=1)
    assert list(ratios) == [first] and ratios[first] > 0
    assert (input_conversion(gm, first) is None) == (ratios[first] >= 1.02)
    with torch.inference_mode():
        torch.testing.assert_close(gm(x), model(x), rtol=1e-4, atol=1e-5)


def test_a_folded_conv_is_saved_and_a_tampered_one_refused(tmp_path):
    model, x, gm, p, (first, second) = _planned()
    fold_input_conversion(gm, first, HOST)
    dep = describe(gm, "planned_maco", x, HOST, p)
    assert dep.convs[first]["input"] == "NCHW" and "input" not in dep.convs[second]
    save(dep, tmp_path / "m.maco")
    loaded = maco.load(tmp_path / "m.maco", model)
    assert loaded.get_submodule(first).input_layout == "NCHW" and _conversions(loaded) == _conversions(gm)
    with torch.inference_mode():
        torch.testing.assert_close(loaded(x), model(x), rtol=1e-4, atol=1e-5)
    for path, layout in ((first, "NHWC"), (first, ["NCHW"]), (second, "NCHW")):
        bad = describe(gm, "planned_maco", x, HOST, p)
        bad.convs[path]["input"] = layout
        save(bad, tmp_path / "bad.maco")
        with pytest.raises(MacoError, match="reads its input in"):
            maco.load(tmp_path / "bad.maco", model)


def test_the_report_says_which_conversions_a_conv_reads_through(tmp_path):
    from maco.core.timing import Timing
    from maco.deploy.optimize_report import OptimizeResult, end_to_end_rows, report_markdown
    from maco.layouts.end_to_end import ModelTimes

    _, x, gm, p, (first, _) = _planned()
    fold_input_conversion(gm, first, HOST)
    rounds = {"default": [2.0, 2.0, 2.0], "planned_maco": [1.0, 1.0, 1.0]}
    times = ModelTimes({k: [Timing(m, m, m, 0.0, 3, 1) for m in v] for k, v in rounds.items()},
                       dict.fromkeys(rounds, 0.0), dict.fromkeys(rounds, 0.0))
    rows = end_to_end_rows(times, pick="planned_maco")
    result = OptimizeResult("tiny", tmp_path, [], p, rows, 1.0, model=gm, chosen="planned_maco", example=x)
    text = report_markdown(result, HOST, tmp_path / "r.jsonl", [first])
    assert f"{len(p.conversions)} conversions (1 of them read through by the conv after them" in text


def test_a_kernel_reading_the_model_input_reads_it_in_order_first():
    """The model's NCHW input comes from DRAM: a kernel reading it walks its items' rows first
    (results/REPORT.md: ResNet-18's first conv 0.78x the time with the caches evicted); the same
    conv on an input in its own layout does not."""
    spec = ConvSpec.parse("n1_c3_h40_w40_k16_r7x7_s2_p3")
    schedule = kernels.default_schedule(spec, HOST, "NHWC")
    assert schedule.parallel > 0
    assert "volatile reads" in CpuPlan(spec, schedule, HOST, input_layout="NCHW").source
    assert "volatile reads" not in CpuPlan(spec, schedule, HOST).source
    _check(spec, schedule, HOST, "NCHW")
