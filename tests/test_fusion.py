"""The inference graph pass (BatchNorm folded, conv epilogues fused) and the lean MACO runtime, each
checked against eager PyTorch: on the built-in networks, and on small models built to catch the
cases that are easy to get wrong (values with several consumers, in-place adds, broadcasting)."""
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from maco import ConvSpec, Target, kernels
from maco.layouts import fuse
from maco.layouts.deploy import plan
from maco.layouts.fusion import FusedConv2d
from maco.layouts.graph import symbolic_trace
from maco.layouts.maco_modules import MacoConv2d, use_maco_kernels
from maco.layouts.networks import build, conv_layers, distinct_convs, example_input
from tests.targets import GENERIC

HOST = Target.host()


def _randomize_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    for mod in model.modules():
        if isinstance(mod, nn.BatchNorm2d):
            n = mod.num_features
            mod.running_mean.copy_(torch.rand(n, generator=g) - 0.5)
            mod.running_var.copy_(torch.rand(n, generator=g) + 0.5)
            mod.weight.data.copy_(torch.rand(n, generator=g) + 0.5)
            mod.bias.data.copy_(torch.rand(n, generator=g) - 0.5)
    return model.eval()


def _kinds(gm) -> dict[str, int]:
    out: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            key = type(gm.get_submodule(node.target)).__name__
        elif node.op in ("call_function", "call_method"):
            key = getattr(node.target, "__name__", str(node.target))
        else:
            continue
        out[key] = out.get(key, 0) + 1
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max())


@pytest.mark.parametrize("net,fused_convs", [("resnet18", 20), ("resnet50", 53), ("mobilenet_v2", 52),
                                             ("alexnet", 5), ("vgg11", 8)])
def test_networks_fuse_to_equal_outputs(net, fused_convs):
    model = _randomize_bn(build(net))
    x = example_input(1)
    gm = fuse(model, x)
    with torch.no_grad():
        assert _rel(model(x), gm(x)) < 1e-5
    kinds = _kinds(gm)
    assert kinds.get("FusedConv2d") == fused_convs and "Conv2d" not in kinds
    assert "BatchNorm2d" not in kinds and "add" not in kinds and "iadd" not in kinds
    if net.startswith("resnet"):  # every ReLU lands in a conv's epilogue
        assert "ReLU" not in kinds and "relu" not in kinds


def test_resnet_residuals_go_to_the_main_path_with_its_relu():
    gm = fuse(_randomize_bn(build("resnet18")), example_input(1))
    epilogues = {name: (m.activation, m.residual) for name, m in gm.named_modules() if isinstance(m, FusedConv2d)}
    assert sum(e == ("relu", "before") for e in epilogues.values()) == 8  # conv2 of each block
    assert all(e == ("none", "none") for n, e in epilogues.items() if "downsample" in n)


def test_bn_folding_is_exact_algebra():
    conv = nn.Conv2d(4, 6, 3, padding=1, bias=True)
    bn = _randomize_bn(nn.Sequential(nn.BatchNorm2d(6)))[0]
    from maco.layouts.fusion import fold_batchnorm

    w, b = fold_batchnorm(conv, bn)
    x = torch.randn(2, 4, 7, 7)
    with torch.no_grad():
        torch.testing.assert_close(F.conv2d(x, w, b, padding=1), bn(conv(x)), rtol=1e-5, atol=1e-5)


class _Branches(nn.Module):
    """Values with several consumers at every step of the chain, in-place ops, a broadcast add."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c3 = nn.Conv2d(8, 8, 1)
        self.c4 = nn.Conv2d(8, 8, 3, padding=1)
        self.c5 = nn.Conv2d(8, 8, 1)
        self.c6 = nn.Conv2d(8, 8, 1)
        self.shift = nn.Parameter(torch.randn(8, 1, 1))
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        a = self.b1(self.c1(x))          # bn output read twice: the chain stops at bn
        p = self.relu(a.clone())
        b = self.b2(self.c2(p))
        s = b + a                        # the sum is read twice: the chain stops at the add
        r = F.relu(s)
        t = s * 2
        c = self.c3(r)
        c += r                           # in place into the conv's own output: fused, "before"
        d = self.c4(c)
        e = torch.relu(d) + c            # residual after the activation
        f = self.c5(e)
        e.add_(f)                        # in place into the other operand: e is the result, no fusion
        g = self.c6(e) + self.shift      # a broadcast add is no residual
        return g + t + e


def test_values_with_several_consumers_keep_what_each_consumer_saw():
    model = _randomize_bn(_Branches())
    x = torch.randn(1, 3, 10, 10)
    gm = fuse(model, x)
    with torch.no_grad():
        assert _rel(model(x), gm(x)) < 1e-5
    fused = {name: (m.activation, m.residual) for name, m in gm.named_modules() if isinstance(m, FusedConv2d)}
    by_conv = {name.split("_", 2)[2]: e for name, e in fused.items()}
    assert by_conv["c1"] == ("none", "none")      # bn folded, then two consumers
    assert by_conv["c2"] == ("none", "before")    # bn + the add; the sum has two consumers
    assert by_conv["c3"] == ("none", "before")    # c += r
    assert by_conv["c4"] == ("relu", "after")     # relu(d) + c
    assert "c5" not in by_conv and "c6" not in by_conv  # e.add_(f), broadcast + shift
    assert _kinds(gm).get("relu") == 1            # F.relu(s): s has another consumer


@pytest.mark.parametrize("act,name", [(nn.ReLU6(), "relu6"), (nn.Hardtanh(0.0, 6.0), "relu6"),
                                      (nn.SiLU(), "silu"), (nn.Hardswish(), "hardswish"), (nn.GELU(), "gelu"),
                                      (nn.GELU(approximate="tanh"), None), (nn.Hardtanh(-1.0, 1.0), None)])
def test_activations(act, name):
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), act)
    _randomize_bn(model)
    x = torch.randn(1, 3, 9, 9) * 4
    gm = fuse(model, x)
    with torch.no_grad():
        assert _rel(model(x), gm(x)) < 1e-5
    fused = [m for m in gm.modules() if isinstance(m, FusedConv2d)]
    assert len(fused) == 1 and fused[0].activation == (name or "none")


def test_a_fused_graph_traces_back_as_one_op_per_fused_conv():
    gm = fuse(_randomize_bn(build("resnet18")), example_input(1))
    again = symbolic_trace(gm)
    assert _kinds(again) == _kinds(gm)


def _maco_model(model: nn.Module, x: torch.Tensor, layout: str = "NHWC"):
    """fuse -> plan (every conv in `layout`) -> MACO kernels with the default schedules."""
    specs = [s for s, _ in distinct_convs(conv_layers(model, x))]
    gm = fuse(model, x)
    table = {(s, lay): (1.0 if lay == layout else 2.0) for s in specs for lay in ("NCHW", "NHWC")}
    p = plan(gm, x, latency=table, conversion=lambda shape, a, b: 1e-9)
    out = p.apply(gm)
    chosen = {s: {layout: kernels.default_schedule(s, HOST, layout)} for s in specs}
    return out, use_maco_kernels(out, p, chosen, HOST)


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_maco_kernels_with_fused_epilogues_match_eager(layout):
    model = _randomize_bn(build("resnet18"))
    x = example_input(1)
    gm, swapped = _maco_model(model, x, layout)
    assert len(swapped) == 20
    macos = [m for m in gm.modules() if isinstance(m, MacoConv2d)]
    assert all(m.preallocated for m in macos)  # nothing escapes: the classifier ends the model
    with torch.inference_mode():
        want = model(x)
        first = gm(x)
        kept = first.clone()
        second = gm(torch.randn_like(x))
        again = gm(x)
    assert _rel(want, first) < 1e-4 and _rel(want, again) < 1e-4
    assert torch.equal(first, kept) and not torch.equal(first, second)  # outputs never alias buffers


class _EndsInConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 16, 3, padding=1)
        self.b = nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x):
        y = torch.relu(self.a(x))
        return self.b(y), y.flatten(1)  # both the last conv and a view of the first leave the model


def test_buffers_that_leave_the_model_are_not_preallocated():
    model = _EndsInConv().eval()
    x = torch.randn(1, 3, 12, 12)
    gm, swapped = _maco_model(model, x)
    assert len(swapped) == 2
    assert not any(m.preallocated for m in gm.modules() if isinstance(m, MacoConv2d))
    with torch.inference_mode():
        a1, b1 = (t.clone() for t in gm(x))
        out2 = gm(torch.randn_like(x))
        a3, b3 = gm(x)
        want = model(x)
    assert _rel(want[0], a1) < 1e-4 and torch.equal(a1, a3) and not torch.equal(out2[0], a1)
    assert _rel(want[1], b1) < 1e-4 and torch.equal(b1, b3)


def test_other_shapes_fall_back_to_the_fused_torch_conv():
    model = _randomize_bn(build("resnet18"))
    gm, _ = _maco_model(model, example_input(1))
    x2 = torch.randn(2, 3, 64, 64)
    with torch.inference_mode():
        assert _rel(model(x2), gm(x2)) < 1e-4


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("target", [HOST, GENERIC], ids=["intrinsics", "portable"])
def test_relu6_epilogue_in_generated_kernels(layout, target):
    spec = ConvSpec.parse("n1_c16_h9_w9_k32_r3_p1")
    sch = kernels.default_schedule(spec, target, layout)
    k = kernels.compile(spec, sch, target, bias=True, residual=True, activation="relu6")
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(spec.input_shape, generator=g) * 3, torch.randn(spec.weight_shape, generator=g)
    b, r = torch.randn(spec.k, generator=g), torch.randn(spec.output_shape, generator=g) * 3
    fmt = torch.channels_last if layout == "NHWC" else torch.contiguous_format
    y = k.bind(w, b)(x.contiguous(memory_format=fmt), r.contiguous(memory_format=fmt))
    want = F.hardtanh(F.conv2d(x, w, b, padding=1) + r, 0.0, 6.0)
    assert (want == 6.0).any() and (want == 0.0).any()
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(Exception, match="unknown activation"):
        kernels.compile(spec, sch, activation="mish")


@pytest.mark.parametrize("batch,inp,out,act", [(1, 9216, 64, "relu"), (3, 37, 1001, "relu6"), (2, 512, 7, "none"),
                                               (2, 100, 13, "silu"), (1, 64, 9, "hardswish"), (3, 48, 11, "gelu")])
def test_generated_linear_kernels_match_torch(batch, inp, out, act):
    from maco.kernels.epilogue import torch_activation
    from maco.kernels.linear import compile_linear

    g = torch.Generator().manual_seed(2)
    x, w, b = (torch.randn(batch, inp, generator=g) * 3, torch.randn(out, inp, generator=g),
               torch.randn(out, generator=g))
    y = torch.empty(batch, out)
    compile_linear(batch, inp, out, activation=act)(x, w, b, y)
    want = torch_activation(act, F.linear(x, w, b))
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-3)


def test_linears_take_the_activation_only_they_feed():
    from maco.layouts.fusion import FusedLinear

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8)

        def forward(self, x):
            h = torch.relu(self.a(x))
            g = self.b(h)            # read by the relu and by the sum: not fused
            return self.c(F.relu(g)) + g.sum()

    model = Head().eval()
    x = torch.randn(2, 16)
    gm = fuse(model, x)
    fused = [m for m in gm.modules() if isinstance(m, FusedLinear)]
    assert len(fused) == 1 and fused[0].activation == "relu" and fused[0].out_features == 32
    with torch.no_grad():
        assert _rel(model(x), gm(x)) < 1e-6


def test_a_per_channel_scale_after_a_linear_is_folded_into_it():
    """ConvNeXt's `x + layer_scale * permute(linear(h))`: the scale goes into the Linear's weight
    and bias and the multiply leaves the graph; not where the factor is read elsewhere, is not one
    per output feature, or the output is permuted otherwise; fold_scales=False keeps it."""
    import operator

    from maco.layouts.fusion import FusedLinear

    class Block(nn.Module):
        def __init__(self, dims=(0, 3, 1, 2), scale_shape=(8, 1, 1), reuse=False):
            super().__init__()
            self.fc, self.dims, self.reuse = nn.Linear(6, 8), dims, reuse
            self.scale = nn.Parameter(torch.rand(scale_shape, generator=torch.Generator().manual_seed(1)) + 0.5)

        def forward(self, x):
            y = self.scale * self.fc(x.permute(0, 2, 3, 1)).permute(*self.dims)
            return x[:, :1].sum() * y + (self.scale.sum() if self.reuse else 0)

    x = torch.randn(2, 6, 5, 5)
    muls = lambda gm: sum(n.op == "call_function" and n.target is operator.mul for n in gm.graph.nodes)  # noqa: E731
    model = Block().eval()
    gm = fuse(model, x)
    folded = [m for m in gm.modules() if isinstance(m, FusedLinear)]
    assert len(folded) == 1 and folded[0].scaled and folded[0].activation == "none"
    assert muls(gm) == muls(fuse(model, x, fold_scales=False)) - 1
    with torch.no_grad():
        assert _rel(model(x), gm(x)) < 1e-6
    for other in (Block(reuse=True), Block(scale_shape=(8, 1, 5)), Block(dims=(0, 3, 2, 1))):
        other = other.eval()
        assert not [m for m in fuse(other, x).modules() if isinstance(m, FusedLinear)]
    net = build("convnext_tiny").eval()
    x = example_input(1)
    gm = fuse(net, x)
    assert sum(getattr(m, "scaled", False) for m in gm.modules()) == sum(n for _, n in type(net).STAGES)
    with torch.no_grad():
        assert _rel(net(x), gm(x)) < 1e-5


def test_the_residual_add_after_a_linear_goes_into_it():
    """ConvNeXt's `x + permute(linear(h))`: the add goes into the Linear (its residual, the other
    operand read channels last) and leaves the graph; not where the permuted output is read
    elsewhere, is permuted otherwise, or the other operand broadcasts; a Linear with an
    activation keeps the add; linear_residuals=False keeps it too."""
    import operator

    from maco.layouts.fusion import FusedLinear

    class Block(nn.Module):
        def __init__(self, dims=(0, 3, 1, 2), other=(2, 8, 5, 5), reuse=False, act=False):
            super().__init__()
            self.fc, self.dims, self.reuse, self.act = nn.Linear(6, 8), dims, reuse, act
            self.broadcast = other[0] == 1
            self.other = nn.Parameter(torch.randn(other, generator=torch.Generator().manual_seed(2)))

        def forward(self, x):
            h = self.fc(x.permute(0, 2, 3, 1))
            y = (torch.relu(h) if self.act else h).permute(*self.dims)
            r = self.other if self.broadcast else x[:, :1] * self.other  # computed after the Linear
            out = r + y
            return out + y.sum() if self.reuse else out

    x = torch.randn(2, 6, 5, 5)
    adds = lambda gm: sum(n.op == "call_function" and n.target is operator.add for n in gm.graph.nodes)  # noqa: E731
    model = Block().eval()
    gm = fuse(model, x)
    fused = [m for m in gm.modules() if isinstance(m, FusedLinear)]
    assert len(fused) == 1 and fused[0].residual == "before" and not fused[0].scaled
    assert adds(gm) == adds(fuse(model, x, linear_residuals=False)) - 1 == 0
    with torch.no_grad():
        assert _rel(model(x), gm(x)) < 1e-6
    for other in (Block(reuse=True), Block(dims=(0, 3, 2, 1)), Block(other=(1, 8, 1, 1)), Block(act=True)):
        other = other.eval()
        assert not [m for m in fuse(other, x).modules() if getattr(m, "residual", "none") != "none"
                    and isinstance(m, FusedLinear)]
        with torch.no_grad():
            assert _rel(other(x), fuse(other, x)(x)) < 1e-6
    net = build("convnext_tiny").eval()
    for mod in net.modules():  # layer scales of 1e-6 would hide a wrong residual
        if hasattr(mod, "layer_scale"):
            mod.layer_scale.data.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(4))
    x = example_input(1)
    gm = fuse(net, x)
    fused = [m for m in gm.modules() if isinstance(m, FusedLinear) and m.residual != "none"]
    assert len(fused) == sum(n for _, n in type(net).STAGES) and all(m.scaled for m in fused)
    with torch.no_grad():
        assert _rel(net(x), gm(x)) < 1e-5


def test_maco_linears_in_a_network_match_eager_and_keep_outputs_their_own():
    from maco.layouts.maco_modules import MacoLinear, call_sites, escapes, swap_module

    model = build("alexnet")
    x = example_input(1)
    gm = fuse(model, x)
    calls = call_sites(gm)
    linears = [p for p in calls if isinstance(gm.get_submodule(p), nn.Linear)]
    for path in linears:
        swap_module(gm, path, MacoLinear(gm.get_submodule(path), 1, HOST,
                                         preallocate=not escapes(gm, calls[path][0])))
    macos = {p: gm.get_submodule(p) for p in linears}
    assert [m.preallocated for m in macos.values()] == [True, True, False]  # the last one is the output
    with torch.inference_mode():
        want, got = model(x), gm(x)
        kept = got.clone()
        gm(torch.randn_like(x))
    assert _rel(want, got) < 1e-4 and torch.equal(got, kept)
