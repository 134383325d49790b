"""Runs of MACO kernel modules as one call (maco.layouts.segments): outputs equal eager torch's
within 1e-4 on the networks and on a net nothing was tuned for, the same checks and fallbacks as
the modules one by one, NaN where torch puts it, outputs that never alias the next call's
buffers, the liveness plan, saved models and the torch.compile backend."""
from __future__ import annotations

import copy
import json
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import maco
from maco import kernels
from maco.core.errors import MacoError
from maco.deploy.deployment import describe
from maco.layouts.end_to_end import conv_share
from maco.layouts.maco_modules import MacoConv2d, MacoDepthwise2d, MacoPool2d, MacoWinograd2d
from maco.layouts.networks import build, example_input
from maco.layouts.segments import find_runs, segments_of, use_segments
from maco.deploy.kernel_choice import kernels_everywhere

HOST = kernels.host_target()


def _planned(model: nn.Module, x: torch.Tensor, winograd: bool = False):
    """A planned model with MACO kernels everywhere one runs (NHWC, default schedules, generated
    depthwise and pooling kernels, Winograd F(2x2) on every other capable conv where asked),
    swapped without timing; and its plan."""
    return kernels_everywhere(model, x, HOST, winograd=(lambda i: i % 2 == 0) if winograd else None)


def _rel(want: torch.Tensor, got: torch.Tensor) -> float:
    return float((want - got).abs().max() / want.abs().max())


class SmallNet(nn.Module):
    """A net of no zoo: strided, depthwise, residual, pooling, a 5x5 and a conv read twice."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6())
        self.dw = nn.Sequential(nn.Conv2d(16, 16, 3, 1, 1, groups=16), nn.BatchNorm2d(16), nn.ReLU())
        self.pw = nn.Sequential(nn.Conv2d(16, 32, 1, bias=False), nn.BatchNorm2d(32))
        self.c5 = nn.Conv2d(32, 32, 5, 1, 2)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.head = nn.Conv2d(32, 64, 3, 1, 1)  # Winograd's filters: whole register blocks on AVX2 and AVX-512
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        x = self.stem(x)
        y = self.pw(self.dw(x))
        z = F.relu(self.c5(y) + y)
        z = self.pool(z)
        h = self.head(z)
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1)), h


def _randomize_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
            m.bias.data.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
    return model.eval()


def _small_net(seed: int) -> tuple[nn.Module, torch.Tensor]:
    """SmallNet with random BatchNorm statistics and an input, both from `seed`."""
    torch.manual_seed(seed)
    model = _randomize_bn(SmallNet())
    return model, torch.randn(1, 3, 32, 32)


def _check(model: nn.Module, x: torch.Tensor, winograd: bool = False):
    gm, p = _planned(model, x, winograd)
    with torch.inference_mode():
        want = model(x)
        before = gm(x)
        names = use_segments(gm, HOST)
        after = gm(x)
        again = gm(x)
    want, before, after, again = ([t] if isinstance(t, torch.Tensor) else list(t) for t in (want, before, after, again))
    for w, b, a, a2 in zip(want, before, after, again):
        assert _rel(w, b) < 1e-4
        assert _rel(w, a) < 1e-4
        assert torch.equal(a, a2)
    return gm, p, names, after


def test_small_net_one_segment_equals_eager_and_keeps_outputs():
    model, x = _small_net(0)
    gm, _, names, outs = _check(model, x, winograd=True)
    assert names, gm.graph
    segs = segments_of(gm)
    assert sum(len(s._steps) for s in segs) >= 4
    # the kernels' modules stay at their paths; the graph calls only the segments
    assert any(isinstance(m, MacoWinograd2d) for m in gm.modules())
    assert any(isinstance(m, MacoConv2d) for m in gm.modules())
    called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    assert not any(isinstance(gm.get_submodule(t), MacoConv2d) for t in called if not t.startswith("maco_segment"))
    # outputs that leave the model are new tensors every call: the first call's stay as they were
    with torch.inference_mode():
        kept = [t.clone() for t in outs]
        gm(torch.randn(1, 3, 32, 32))
    for k, t in zip(kept, outs):
        assert torch.equal(k, t)


def test_outputs_made_ahead_are_each_handed_out_once(monkeypatch):
    """A segment makes its new outputs a few at a time (segments.SPARES): past a refill, every
    call's output is still a tensor of its own that later calls leave as it was."""
    from maco.layouts import segments

    monkeypatch.setattr(segments, "SPARES", 2)
    model, x = _small_net(1)
    gm, _, _, _ = _check(model, x)
    outs, kept = [], []
    with torch.inference_mode():
        for _ in range(5):
            got = gm(torch.randn(1, 3, 32, 32))
            got = [got] if isinstance(got, torch.Tensor) else list(got)
            outs += got
            kept += [t.clone() for t in got]
    assert len({t.data_ptr() for t in outs}) == len(outs)
    for k, t in zip(kept, outs):
        assert torch.equal(k, t)


def test_liveness_plan_reuses_bytes_and_keeps_live_values_apart():
    model = build("mobilenet_v2").eval()
    x = example_input(1)
    gm, _ = _planned(model, x)
    use_segments(gm, HOST)
    seg = max(segments_of(gm), key=lambda s: len(s._steps))
    steps = seg._steps
    internal = [j for j, s in enumerate(steps) if not s.export]
    assert len(internal) > 10
    # the arena is far smaller than all internal values side by side
    assert seg._arena.numel() < 0.5 * sum(steps[j].out.numel for j in internal)
    last = {j: max([j] + [k for k, s in enumerate(steps) for kind, i in s.reads if kind == "step" and i == j])
            for j in internal}
    span = {j: (seg._values[j].data_ptr(), seg._values[j].data_ptr() + 4 * steps[j].out.numel) for j in internal}
    for a in internal:
        for b in internal:
            if a < b <= last[a]:  # b is written while a is still to be read
                assert span[a][1] <= span[b][0] or span[b][1] <= span[a][0], (a, b)


@pytest.mark.parametrize("net", ["mobilenet_v2", "resnet18", "resnet50", "efficientnet_b0", "mobilenet_v3_large"])
def test_networks_equal_eager(net):
    model = _randomize_bn(build(net))
    x = example_input(1)
    gm, _, names, _ = _check(model, x, winograd=net == "resnet18")
    assert names
    n_kernels = sum(isinstance(m, (MacoConv2d, MacoDepthwise2d, MacoWinograd2d, MacoPool2d)) for m in gm.modules())
    in_segments = sum(len(s._steps) for s in segments_of(gm))
    assert in_segments >= 0.5 * n_kernels


def test_other_inputs_run_the_modules_one_by_one():
    model, x = _small_net(1)
    gm, _, _, _ = _check(model, x)
    seg = segments_of(gm)[0]
    calls = []
    def hook(module: nn.Module, args: tuple) -> None:
        calls.append(module)

    hooks = [s.module.register_forward_pre_hook(hook) for s in seg._steps]
    try:
        with torch.inference_mode():
            gm(x)
            assert not calls  # the fast path calls no module
            for other in (torch.randn(2, 3, 32, 32), torch.randn(1, 3, 40, 40), x.transpose(2, 3)):
                got = gm(other)
                want = model(other)
                for w, g in zip(want, got):
                    assert w.shape == g.shape and w.dtype == g.dtype
                    assert _rel(w.float(), g.float()) < 1e-4
            assert calls
            seg = segments_of(gm)[0]
            calls.clear()
            with pytest.raises(RuntimeError):  # another dtype: the modules, then torch, as before
                seg(torch.randn(seg._guards[0][1].shape, dtype=torch.float64))
            assert calls
    finally:
        for h in hooks:
            h.remove()


def test_nan_and_inf_land_where_torch_puts_them():
    model, x = _small_net(2)
    gm, _, _, _ = _check(model, x, winograd=True)
    bad = x.clone()
    bad[0, 1, 5, 7] = float("nan")
    bad[0, 0, 20, 3] = float("inf")
    with torch.inference_mode():
        for w, g in zip(model(bad), gm(bad)):
            assert torch.equal(w.isnan(), g.isnan())
            assert torch.equal(w.isposinf(), g.isposinf()) and torch.equal(w.isneginf(), g.isneginf())
            finite = w.isfinite()
            if finite.any():
                assert float((w[finite] - g[finite]).abs().max()) <= 1e-4 * float(w[finite].abs().max() + 1)


def test_saved_model_loads_with_segments_and_without(tmp_path):
    model = _randomize_bn(build("mobilenet_v2"))
    x = example_input(1)
    gm, p = _planned(model, x)
    dep = describe(gm, "planned_maco", x, HOST, p)
    (tmp_path / "m.maco").write_text(json.dumps(dep.to_dict()))
    seg = maco.load(tmp_path / "m.maco", copy.deepcopy(model))
    one_by_one = maco.load(tmp_path / "m.maco", copy.deepcopy(model), segments=False)
    assert segments_of(seg) and not segments_of(one_by_one)
    with torch.inference_mode():
        want = model(x)
        for got in (seg(x), one_by_one(x)):
            assert _rel(want, got) < 1e-4
    # describe reads the kernels off the segmented model as off the plain one
    dep2 = describe(seg, "planned_maco", x, HOST, p)
    assert dep2.convs == dep.convs and dep2.depthwise == dep.depthwise and dep2.pools == dep.pools
    maco.save(seg, tmp_path / "again.maco")
    assert json.loads((tmp_path / "again.maco").read_text())["convs"] == dep.to_dict()["convs"]
    with pytest.raises(MacoError, match="segments must be"):
        maco.load(tmp_path / "m.maco", build("mobilenet_v2"), segments="yes")


def test_conv_share_sees_the_kernels_inside_segments():
    model, x = _small_net(3)
    gm, _, _, _ = _check(model, x)
    share = conv_share(gm, x, rounds=1, min_run_time=1e-4)
    n_convs = sum(isinstance(m, (MacoConv2d, MacoDepthwise2d, MacoWinograd2d)) or type(m) is nn.Conv2d
                  for m in gm.modules())
    assert len(share.per_conv) >= 3
    assert share.rest_s > 0 and share.model_s > 0
    assert not any(s.per_module or s.skip_kernels for s in segments_of(gm))
    assert n_convs
    # the kernels a segment runs are also timed inside its C call, and the timing is switched off after
    in_segments = {name for name, m in gm.named_modules()
                   if any(m is step for seg in segments_of(gm) for step in seg.modules_in_order)}
    assert share.per_conv_in_model and set(share.per_conv_in_model) <= in_segments & set(share.per_conv)
    assert all(t > 0 for t in share.per_conv_in_model.values())
    assert share.alone_s == sum(share.per_conv[n] for n in share.per_conv_in_model)
    assert all(seg.step_seconds is None for seg in segments_of(gm))
    # each conv timed names the convs it computes, for its floor (maco optimize's report)
    assert set(share.specs) == set(share.per_conv)
    for name, specs in share.specs.items():
        mod = gm.get_submodule(name)
        if hasattr(mod, "spec"):  # a MACO kernel: the spec it was built for
            assert specs == (mod.spec,)
        else:  # a torch conv: its spec on the input it gets in the model
            assert len(specs) == 1 and specs[0].k == mod.out_channels and specs[0].c == mod.in_channels


def test_a_timed_segment_computes_the_same_and_times_each_step():
    model, x = _small_net(4)
    gm, _, _, _ = _check(model, x)
    seg = segments_of(gm)[0]
    with torch.inference_mode():
        want = [t.clone() for t in gm(x)]
        seg.step_seconds = []
        start = time.perf_counter()
        got = gm(x)
        wall = time.perf_counter() - start
    assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True))
    (steps,) = seg.step_seconds
    assert len(steps) == len(seg.modules_in_order) and all(t > 0 for t in steps) and sum(steps) < wall


def test_runs_break_at_torch_ops_and_layout_changes():
    model = build("mobilenet_v2").eval()
    x = example_input(1)
    gm, _ = _planned(model, x)
    runs = find_runs(gm)
    assert runs and all(len(r) >= 2 for r in runs)
    for run in runs:  # consecutive graph nodes
        nodes = list(gm.graph.nodes)
        first = nodes.index(run[0])
        assert nodes[first:first + len(run)] == run


def test_torch_compile_backend_runs_segments():
    torch._dynamo.reset()
    model, x = _small_net(4)
    compiled = torch.compile(model, backend="maco", options={"tune": "none", "layouts": "NHWC"})
    with torch.no_grad():
        want = model(x)
        got = compiled(x)
        got2 = compiled(x)
    for w, g, g2 in zip(want, got, got2):
        assert _rel(w, g) < 1e-4 and torch.equal(g, g2)


class TwoRuns(nn.Module):
    """Two runs of kernels split by a torch op, the second reading an output of the first."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(8, 16, 3, 1, 1)
        self.c2 = nn.Conv2d(16, 16, 1)
        self.c3 = nn.Conv2d(16, 16, 3, 1, 1)
        self.c4 = nn.Conv2d(16, 16, 1)

    def forward(self, x):
        a = self.c1(x)
        b = torch.tanh(self.c2(a))
        return F.relu(self.c4(self.c3(b)) + a)


def test_a_run_reads_an_earlier_runs_output():
    torch.manual_seed(5)
    model = TwoRuns().eval()
    x = torch.randn(1, 8, 20, 20)
    gm, _, names, _ = _check(model, x)
    assert len(names) == 2, gm.code
    first, second = segments_of(gm)
    assert len(first._exports) == 2 and second._n_inputs == 2


def test_unshared_memory_gives_every_value_its_own_bytes():
    model, x = _small_net(6)
    gm, _ = _planned(model, x)
    use_segments(gm, HOST, share_memory=False)
    seg = segments_of(gm)[0]
    internal = [j for j, s in enumerate(seg._steps) if not s.export]
    spans = sorted((seg._values[j].data_ptr(), seg._values[j].data_ptr() + 4 * seg._steps[j].out.numel)
                   for j in internal)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    with torch.inference_mode():
        for w, g in zip(model(x), gm(x)):
            assert _rel(w, g) < 1e-4


def test_a_conv_only_portable_c_computes_stays_torchs():
    """maco optimize's every-conv model (portable=False) leaves to torch a conv whose filters are
    no whole number of the host's vectors (nor of AVX2's half-width ones on AVX-512), which only
    portable C computes; the rest run MACO."""
    from maco.kernels.cpu_codegen import ISA

    if HOST.isa not in ISA:
        pytest.skip(f"no vector intrinsics on this host ({HOST.isa}): every kernel is portable C")
    w = HOST.simd_width
    odd = w + w // 4  # 20 filters on AVX-512, 10 on AVX2
    model = nn.Sequential(nn.Conv2d(16, odd, 1), nn.ReLU(), nn.Conv2d(odd, 2 * w, 1)).eval()
    x = torch.randn(1, 16, 12, 12, generator=torch.Generator().manual_seed(0))
    for portable, maco_convs in ((True, 2), (False, 1)):
        gm, _ = kernels_everywhere(model, x, HOST, portable=portable)
        convs = [m for m in gm.modules() if isinstance(m, MacoConv2d)]
        assert len(convs) == maco_convs and convs[-1].spec.k == 2 * w
        with torch.inference_mode():
            assert _rel(model(x), gm(x)) < 1e-5


class Head(nn.Module):
    """torchvision MobileNetV2's head on two convs: a functional global pool, flatten, dropout, a
    linear; `flat_too` also hands back the flattened pool (a view read outside the run)."""

    def __init__(self, flat_too: bool = False):
        super().__init__()
        self.c1 = nn.Conv2d(8, 32, 3, 1, 1)
        self.c2 = nn.Conv2d(32, 32, 1)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(32, 10))
        self.flat_too = flat_too

    def forward(self, x):
        flat = torch.flatten(F.adaptive_avg_pool2d(F.relu(self.c2(F.relu(self.c1(x)))), 1), 1)
        y = self.classifier(flat)
        return (y, flat) if self.flat_too else y


def _with_maco_linear(gm):
    from maco.layouts.maco_modules import MacoLinear, swap_module

    swap_module(gm, "classifier.1", MacoLinear(gm.get_submodule("classifier.1"), 1, HOST))
    return gm


def test_a_head_of_views_and_a_functional_pool_runs_inside_the_segment():
    from maco.layouts.maco_modules import MacoLinear

    torch.manual_seed(7)
    model = Head().eval()
    x = torch.randn(1, 8, 14, 14)
    gm = _with_maco_linear(_planned(model, x)[0])
    names = use_segments(gm, HOST)
    assert len(names) == 1
    # after the input's conversion, the graph is the segment alone: no pool, flatten, dropout or linear left to torch
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_method", "call_module", "output"], gm.code
    kinds = [type(m) for m in segments_of(gm)[0].modules_in_order]
    assert kinds[-2:] == [MacoPool2d, MacoLinear]
    with torch.inference_mode():
        want, got, again = model(x), gm(x), gm(x)
        assert _rel(want, got) < 1e-4 and torch.equal(got, again)
        # another input size runs the modules one by one, the views between them applied as the graph did
        other = torch.randn(1, 8, 10, 10)
        assert _rel(model(other), gm(other)) < 1e-4


def test_a_view_read_after_the_run_stays_in_the_graph():
    torch.manual_seed(8)
    model = Head(flat_too=True).eval()
    x = torch.randn(1, 8, 14, 14)
    gm = _with_maco_linear(_planned(model, x)[0])
    use_segments(gm, HOST)
    assert any(n.target is torch.flatten for n in gm.graph.nodes), gm.code
    with torch.inference_mode():
        for w, g in zip(model(x), gm(x), strict=True):
            assert _rel(w, g) < 1e-4


class TanhHead(Head):
    """Head with a torch op between the pool and the linear: the linear cannot join the run."""

    def forward(self, x):
        flat = torch.flatten(F.adaptive_avg_pool2d(F.relu(self.c2(F.relu(self.c1(x)))), 1), 1)
        return self.classifier(torch.tanh(flat))


@pytest.mark.parametrize("model, ratio, joins", [(Head(), 1.0, True), (Head(), 0.9, False), (TanhHead(), 1.0, False)])
def test_a_linear_that_ties_torchs_runs_maco_where_it_joins_a_run(model, ratio, joins):
    from maco.deploy.kernel_choice import _ties_inside_runs
    from maco.layouts.maco_modules import MacoLinear

    torch.manual_seed(9)
    model = model.eval()
    x = torch.randn(1, 8, 14, 14)
    gm = _planned(model, x)[0]
    _ties_inside_runs(gm, x, HOST, {"classifier.1": ratio}, lambda lin, t, own: MacoLinear(lin, 1, HOST, own))
    assert isinstance(gm.get_submodule("classifier.1"), MacoLinear) == joins
    use_segments(gm, HOST)
    with torch.inference_mode():
        assert _rel(model(x), gm(x)) < 1e-4


class PoolBetween(nn.Module):
    """conv -> maxpool -> conv: a pool that ties torch's joins the run of the convs around it."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(8, 32, 3, 1, 1)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.c2 = nn.Conv2d(32, 32, 1)

    def forward(self, x):
        return self.c2(self.pool(F.relu(self.c1(x))))


@pytest.mark.parametrize("ratio, joins", [(1.0, True), (0.9, False)])
def test_a_pool_that_ties_torchs_runs_maco_inside_a_run(ratio, joins):
    from maco.deploy.kernel_choice import _ties_inside_runs

    torch.manual_seed(10)
    model = PoolBetween().eval()
    x = torch.randn(1, 8, 16, 16)
    gm = kernels_everywhere(model, x, HOST, others=False)[0]  # the pool left to torch
    assert isinstance(gm.get_submodule("pool"), nn.MaxPool2d)
    _ties_inside_runs(gm, x, HOST, {"pool": ratio},
                      lambda pool, t, own: MacoPool2d(pool, tuple(t.shape), "NHWC", HOST, own))
    assert isinstance(gm.get_submodule("pool"), MacoPool2d) == joins
    names = use_segments(gm, HOST)
    assert len(names) == (1 if joins else 0)
    with torch.inference_mode():
        assert _rel(model(x), gm(x)) < 1e-4
