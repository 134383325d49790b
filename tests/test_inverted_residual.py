"""An inverted residual as one generated kernel (kernels.inverted_residual), the graph pass that finds
the blocks (layouts.blocks), the module (MacoInvertedResidual), its timing gate, segments and saved
models: every output checked against eager torch, NaN and infinities where torch puts them."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from maco.core.errors import MacoError
from maco.deploy import deployment, kernel_choice
from maco.deploy.kernel_choice import faster_blocks, kernels_everywhere
from maco.kernels import host_target
from maco.kernels.epilogue import ACTIVATIONS, torch_activation
from maco.kernels.inverted_residual import BlockKernel, BlockPlan
from maco.layouts.blocks import find_blocks
from maco.layouts.maco_modules import MacoInvertedResidual
from maco.layouts.networks import build, example_input, trained_like
from maco.layouts.segments import segments_of, use_segments

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

HOST = host_target()
NAN, INF = float("nan"), float("inf")


def weights(plan: BlockPlan, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(plan.m, plan.c, 1, 1, generator=g) * 0.3, torch.randn(plan.m, generator=g),
            torch.randn(plan.m, 1, plan.r, plan.r, generator=g) * 0.3, torch.randn(plan.m, generator=g),
            torch.randn(plan.k, plan.m, 1, 1, generator=g) * 0.1, torch.randn(plan.k, generator=g)]


def reference(plan: BlockPlan, x: torch.Tensor, w: list[torch.Tensor]) -> torch.Tensor:
    h = torch_activation(plan.act_expand, F.conv2d(x, w[0], w[1])) if plan.expand else x
    h = torch_activation(plan.act_depthwise, F.conv2d(h, w[2], w[3], stride=plan.s, padding=plan.pad, groups=plan.m))
    if not plan.project:
        return h
    y = F.conv2d(h, w[4], w[5])
    return torch_activation(plan.act_project, y + x if plan.residual else y)


def run(plan: BlockPlan, x: torch.Tensor, w: list[torch.Tensor]) -> torch.Tensor:
    packed = plan.pack((w[0], w[1]) if plan.expand else None, (w[2], w[3]), (w[4], w[5]) if plan.project else None)
    y = torch.full(plan.output_shape, 7.0).contiguous(memory_format=torch.channels_last)
    assert BlockKernel(plan, HOST)(x.contiguous(memory_format=torch.channels_last), packed, y)
    return y


def plan_of(**kw) -> BlockPlan:
    kw.setdefault("lanes", HOST.simd_width)
    kw.setdefault("threads", 2)
    return BlockPlan(**kw)


CASES = [
    dict(n=1, c=24, h=56, w=56, m=144, k=24, residual=True),  # MobileNetV2's 56x56 block
    dict(n=1, c=16, h=28, w=20, m=96, k=24, s=2),  # stride 2, odd widths of output
    dict(n=1, c=32, h=30, w=30, m=32, k=16, expand=False),  # expansion 1: no expand conv
    dict(n=2, c=16, h=13, w=11, m=48, k=24, r=5, s=2, act_expand="hardswish", act_depthwise="hardswish"),
    dict(n=3, c=40, h=7, w=9, m=120, k=40, r=5, residual=True, act_expand="silu", act_depthwise="silu",
         threads=3),
    dict(n=1, c=8, h=9, w=7, m=48, k=8, r=7, residual=True, act_expand="gelu", act_depthwise="none",
         act_project="gelu"),
    dict(n=1, c=16, h=12, w=12, m=64, k=16, residual=True, cache_bytes=1),  # G = 1: a row at a time
    dict(n=1, c=16, h=10, w=10, m=32, k=24, lanes=16, registers=32, threads=1),  # AVX-512's tiles, portable
    dict(n=1, c=12, h=6, w=6, m=20, k=12, lanes=4, residual=True, act_expand="relu", act_depthwise="relu"),
    dict(n=2, c=24, h=14, w=14, m=144, k=144, r=5, s=2, project=False, act_expand="silu", act_depthwise="silu"),
    dict(n=1, c=16, h=9, w=9, m=64, k=64, project=False, cache_bytes=1),  # a front half, a row at a time
    dict(n=1, c=96, h=14, w=14, m=576, k=96, residual=True),  # the threads share the channels (auto)
    dict(n=1, c=32, h=9, w=11, m=96, k=40, s=2, threads=3, split="channels", act_project="relu"),
    dict(n=2, c=24, h=10, w=10, m=96, k=96, r=5, project=False, threads=4, split="channels",
         act_expand="hardswish", act_depthwise="hardswish"),
    dict(n=1, c=32, h=8, w=8, m=32, k=16, expand=False, split="channels", cache_bytes=1),
    dict(n=1, c=16, h=7, w=7, m=64, k=16, residual=True, split="rows"),
    # the project's last columns in half a vector (k = 24 or 40 of 16 lanes): columns outer, a
    # smooth activation, and an output plane that does not split into whole vectors (no tail)
    dict(n=1, c=24, h=14, w=14, m=576, k=24, residual=True),
    dict(n=1, c=16, h=12, w=13, m=64, k=40, act_project="silu", split="rows"),
    dict(n=1, c=16, h=11, w=13, m=64, k=40, lanes=16, registers=32),
    # expanded channels past the last whole vector (MobileNetV3's 72, 120, 184): the expand GEMM's and
    # the depthwise conv's last channels in half a vector; with and without a project conv
    dict(n=1, c=24, h=28, w=28, m=72, k=40, r=5, s=2, act_expand="relu", act_depthwise="relu"),
    dict(n=1, c=40, h=14, w=14, m=120, k=40, r=5, residual=True, act_expand="hardswish",
         act_depthwise="hardswish"),
    dict(n=1, c=80, h=14, w=14, m=184, k=184, project=False, act_expand="hardswish", act_depthwise="hardswish"),
    dict(n=1, c=24, h=9, w=9, m=72, k=24, lanes=16, registers=32, threads=3, cache_bytes=1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_the_kernel_equals_torch(case):
    plan = plan_of(**case)
    x = torch.randn(plan.input_shape, generator=torch.Generator().manual_seed(1))
    w = weights(plan)
    want = reference(plan, x, w)
    got = run(plan, x, w)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())), float((got - want).abs().max())


@pytest.mark.parametrize("m, k, lanes, h, vector, tail, m_tail", [
    (144, 24, 16, 56, 16, 8, 0), (96, 40, 16, 14, 16, 8, 0), (144, 24, 8, 56, 8, 0, 0), (64, 8, 16, 12, 16, 8, 0),
    (120, 40, 16, 14, 16, 8, 8), (72, 24, 16, 28, 16, 8, 8),  # MobileNetV3's expanded channels: a tail too
    (64, 40, 16, 11, 8, 0, 0),  # 11 x 11 x 40 outputs: no whole number of 16-lane vectors
    (36, 24, 16, 8, 8, 0, 4),  # 36 channels: 8-lane vectors and half of one
])
def test_half_a_vector_keeps_the_wide_lanes(m, k, lanes, h, vector, tail, m_tail):
    plan = BlockPlan(n=1, c=16, h=h, w=h, m=m, k=k, lanes=lanes)
    assert (plan.vector, plan.tail, plan.m_tail) == (vector, tail, m_tail)
    if tail or m_tail:
        assert "ldh(" in plan.source and "sth(" in plan.source
    else:
        assert "ldh(" not in plan.source


def test_groups_and_bands_cover_every_output_row():
    """A group and a band of every size the plan can take (rows of the ring kept from one group
    to the next) give the same output."""
    for cache, threads in ((1, 1), (40_000, 2), (90_000, 3), (1 << 30, 4)):
        plan = plan_of(n=1, c=8, h=17, w=13, m=32, k=8, residual=True, cache_bytes=cache, threads=threads)
        x = torch.randn(plan.input_shape, generator=torch.Generator().manual_seed(cache))
        w = weights(plan, cache)
        want = reference(plan, x, w)
        assert torch.allclose(run(plan, x, w), want, rtol=1e-4, atol=1e-4), (plan.group, plan.bands)


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_nan_and_infinities_land_where_torch_puts_them(act):
    plan = plan_of(n=1, c=8, h=12, w=12, m=32, k=8, residual=True, act_expand=act, act_depthwise=act)
    x = torch.randn(plan.input_shape, generator=torch.Generator().manual_seed(2))
    x[0, 0, 0, 0], x[0, 3, 6, 6], x[0, 5, 11, 4] = NAN, INF, -INF
    w = weights(plan)
    want, got = reference(plan, x, w), run(plan, x, w)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bad, needle", [
    (dict(r=4), "odd"), (dict(s=3), "stride"), (dict(expand=False, m=64), "without an expand"),
    (dict(residual=True, k=24), "residual"), (dict(act_expand="mish"), "mish"), (dict(threads=0), "threads"),
    (dict(act_expand="silu", act_depthwise="gelu"), "smooth"),
    (dict(project=False, k=16), "without a project"), (dict(split="planes"), "split"),
    (dict(split="channels", threads=3), "cannot share"), (dict(project=False, expand=False, m=16), "depthwise conv"),
])
def test_a_bad_plan_is_one_clear_error(bad, needle):
    kw = dict(n=1, c=16, h=8, w=8, m=64, k=16, lanes=8)
    kw.update(bad)
    with pytest.raises(MacoError, match=needle):
        BlockPlan(**kw)


@pytest.mark.parametrize("net, whole, front", [("mobilenet_v2", 17, 0), ("efficientnet_b0", 0, 15),
                                               ("mobilenet_v3_large", 7, 8)])
def test_blocks_found_whole_or_their_front_half_before_squeeze_excitation(net, whole, front):
    gm, _ = kernels_everywhere(trained_like(build(net)).eval(), example_input(1), HOST, others=False)
    blocks = find_blocks(gm)
    assert sum(b.project is not None for b in blocks) == whole and sum(b.project is None for b in blocks) == front
    nodes = [n for b in blocks for n in (b.expand, b.depthwise, b.project) if n is not None]
    assert len(nodes) == len(set(nodes))  # no conv in two blocks


def test_no_blocks_in_resnet18():
    x = example_input(1)
    gm, _ = kernels_everywhere(build("resnet18").eval(), x, HOST, others=False)
    assert find_blocks(gm) == []


class _Peeked(nn.Module):
    """expand -> depthwise -> project, with the depthwise output also read elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.expand, self.dw, self.project = nn.Conv2d(8, 32, 1), nn.Conv2d(32, 32, 3, padding=1, groups=32), nn.Conv2d(32, 8, 1)

    def forward(self, x):
        d = self.dw(self.expand(x))
        return self.project(d), d.mean()


def test_a_depthwise_output_read_twice_ends_its_block():
    gm, _ = kernels_everywhere(_Peeked().eval(), torch.randn(1, 8, 10, 10), HOST, others=False)
    assert [b.paths for b in find_blocks(gm)] == [("expand", "dw", None)]


@pytest.fixture(scope="module")
def fused_mobilenet():
    """MobileNetV2 with a MACO kernel in every conv and every block as one kernel (the gate's
    threshold set to 0), run as segments."""
    torch.manual_seed(0)
    model = trained_like(build("mobilenet_v2")).eval()
    x = example_input(1)
    gm, plan = kernels_everywhere(model, x, HOST)
    gate = kernel_choice.MIN_GAIN
    kernel_choice.MIN_GAIN = 0.0
    try:
        ratios = faster_blocks(gm, x, HOST, rounds=1)
    finally:
        kernel_choice.MIN_GAIN = gate
    use_segments(gm, HOST)
    return model, x, gm, plan, ratios


def test_every_block_as_one_kernel_equals_eager(fused_mobilenet):
    model, x, gm, _, ratios = fused_mobilenet
    assert len(ratios) == 17 and all(r > 0 for r in ratios.values())
    assert sum(isinstance(m, MacoInvertedResidual) for m in gm.modules()) == 17
    assert len(segments_of(gm)) == 1  # the blocks run inside the one C call
    with torch.inference_mode():
        want, got = model(x), gm(x)
        assert float((got - want).abs().max() / want.abs().max()) < 1e-4
        x2 = x.clone()
        x2[0, 0, 50, 60], x2[0, 2, 3, 3] = NAN, INF
        want, got = model(x2), gm(x2)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(want).any()


def test_a_block_falls_back_to_torch_where_its_kernel_cannot_run(fused_mobilenet):
    model, x, gm, _, _ = fused_mobilenet
    block = next(m for m in gm.modules() if isinstance(m, MacoInvertedResidual))
    xb = torch.randn(block.shape).contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        want = block.torch_chain(xb)
        assert torch.allclose(block(xb.contiguous()), want, atol=1e-5)  # NCHW: torch's convs
        kernel = block._kernel
        block._kernel = lambda *args: False  # its buffers could not be allocated
        try:
            assert torch.allclose(block(xb), want, atol=1e-5)
        finally:
            block._kernel = kernel


def test_saved_blocks_load_as_one_kernel(fused_mobilenet, tmp_path):
    model, x, gm, plan, _ = fused_mobilenet
    path = tmp_path / "mnv2.maco"
    deployment.save(deployment.describe(gm, "planned_maco", x, HOST, plan), path)
    saved = json.loads(path.read_text())
    assert len(saved["blocks"]) == 17
    inside = {p for b in saved["blocks"].values() for p in (b["expand"], b["depthwise"]) if p}
    assert not inside & set(saved["convs"]) and not inside & set(saved["depthwise"])
    loaded = deployment.load(path, model)
    assert sum(isinstance(m, MacoInvertedResidual) for m in loaded.modules()) == 17
    with torch.inference_mode():
        want = model(x)
        assert float((loaded(x) - want).abs().max() / want.abs().max()) < 1e-4


@pytest.mark.parametrize("tamper, needle", [
    (lambda b: b.update(depthwise="fused_0_classifier_1"), "no inverted residual"),
    (lambda b: b.update(shape=[1, 3, 224, 224]), "no generated kernel"),
    (lambda b: b.update(shape="big"), "no generated kernel"),
    (lambda b: b.update(shape=7), "no generated kernel"),
    (lambda b: b.update(split="planes"), "splits its work"),
])
def test_a_tampered_saved_block_is_one_clear_error(fused_mobilenet, tmp_path, tamper, needle):
    model, x, gm, plan, _ = fused_mobilenet
    dep = deployment.describe(gm, "planned_maco", x, HOST, plan)
    tamper(next(iter(dep.blocks.values())))
    path = tmp_path / "bad.maco"
    deployment.save(dep, path)
    with pytest.raises(MacoError, match=needle):
        deployment.load(path, model)


BLOCK_NET = '''
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU6())
        self.expand = nn.Sequential(nn.Conv2d(16, 64, 1), nn.BatchNorm2d(64), nn.ReLU6())
        self.dw = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1, groups=64), nn.BatchNorm2d(64), nn.ReLU6())
        self.project = nn.Sequential(nn.Conv2d(64, 16, 1), nn.BatchNorm2d(16))

    def forward(self, x):
        x = self.stem(x)
        return x + self.project(self.dw(self.expand(x)))
'''


def test_optimize_reports_and_saves_a_block_run_as_one_kernel(tmp_path, monkeypatch):
    """`maco optimize` end to end with a block kept (the gate's threshold at 0): it reports the block,
    and the model it saves runs the block as one kernel where it handed back the MACO variant."""
    from maco.deploy.optimize import optimize
    from maco.layouts.networks import conv_layers, distinct_convs, load_model
    from tests.test_compile_backend import _records_with_baselines

    (tmp_path / "net.py").write_text(BLOCK_NET)
    text = f"{tmp_path / 'net.py'}:Block"
    x = torch.randn(1, 3, 20, 20)
    path = tmp_path / "records.jsonl"
    _records_with_baselines(path, [s for s, _ in distinct_convs(conv_layers(load_model(text)[1], x))])
    monkeypatch.setattr(kernel_choice, "MIN_GAIN", 0.0)
    lines: list[str] = []
    result = optimize(text, out=tmp_path / "out", records=path, input_shape=(1, 3, 20, 20), log=lines.append,
                      save=tmp_path / "net.maco")
    assert any("1 of 1 inverted residuals tried as one kernel" in line for line in lines), lines
    assert (tmp_path / "out" / "report.md").exists()
    saved = json.loads((tmp_path / "net.maco").read_text())
    assert len(saved.get("blocks", {})) == (1 if result.chosen == "planned_maco" else 0)


@pytest.mark.parametrize("net", ["efficientnet_b0", "mobilenet_v3_large"])
def test_front_halves_before_squeeze_excitation_equal_eager(net, monkeypatch, tmp_path):
    """Every block (whole, or expand -> depthwise where squeeze-excitation reads the depthwise
    output) as one kernel: the model equals eager, NaN where eager puts it, and a saved model
    rebuilds the same blocks."""
    torch.manual_seed(0)
    model = trained_like(build(net)).eval()
    x = example_input(1)
    gm, plan = kernels_everywhere(model, x, HOST)
    monkeypatch.setattr(kernel_choice, "MIN_GAIN", 0.0)
    ratios = faster_blocks(gm, x, HOST, rounds=1)
    use_segments(gm, HOST)
    assert len(ratios) == 15 and sum(isinstance(m, MacoInvertedResidual) for m in gm.modules()) == 15
    with torch.inference_mode():
        want = model(x)
        assert float((gm(x) - want).abs().max() / want.abs().max()) < 1e-4
        x2 = x.clone()
        x2[0, 1, 100, 7] = NAN
        assert torch.equal(torch.isnan(gm(x2)), torch.isnan(model(x2)))
        path = tmp_path / "m.maco"
        deployment.save(deployment.describe(gm, "planned_maco", x, HOST, plan), path)
        loaded = deployment.load(path, model)
        assert sum(isinstance(m, MacoInvertedResidual) for m in loaded.modules()) == 15
        assert float((loaded(x) - want).abs().max() / want.abs().max()) < 1e-4


def test_blocks_that_win_alone_but_not_in_the_model_are_undone(monkeypatch):
    """faster_blocks keeps the blocks only if the whole model runs faster with them: otherwise the
    graph and the modules are as they were, and the model still equals eager."""
    torch.manual_seed(0)
    model = trained_like(build("mobilenet_v2")).eval()
    x = example_input(1)
    gm, _ = kernels_everywhere(model, x, HOST)
    before = [(n.op, str(n.target)) for n in gm.graph.nodes]
    modules = dict(gm.named_modules())
    monkeypatch.setattr(kernel_choice, "MIN_GAIN", 0.0)  # every block wins alone
    monkeypatch.setattr(kernel_choice, "_faster_end_to_end", lambda *args: False)
    ratios = faster_blocks(gm, x, HOST, rounds=1)
    assert len(ratios) == 17 and all(r <= 1.0 for r in ratios.values())
    assert [(n.op, str(n.target)) for n in gm.graph.nodes] == before
    assert not any(isinstance(m, MacoInvertedResidual) for m in gm.modules())
    assert all(dict(gm.named_modules())[path] is mod for path, mod in modules.items())
    use_segments(gm, HOST)
    with torch.inference_mode():
        want = model(x)
        assert float((gm(x) - want).abs().max() / want.abs().max()) < 1e-4


@pytest.mark.parametrize("short, more, retimed, kept", [(1.01, 1.10, True, True), (1.04, 0.99, True, False),
                                                        (0.80, 1.10, False, False), (1.20, 0.90, False, True)])
def test_a_close_call_on_a_block_is_timed_over_more_rounds(monkeypatch, short, more, retimed, kept):
    """A block whose gain is timed within CLOSE of MIN_GAIN is timed again over twice the rounds and
    judged on all of them; a clear win or loss is not. The model equals eager either way."""
    from types import SimpleNamespace

    torch.manual_seed(0)
    ns: dict = {}
    exec(BLOCK_NET, ns)
    model = trained_like(ns["Block"]()).eval()
    x = torch.randn(1, 3, 20, 20)
    gm, _ = kernels_everywhere(model, x, HOST)
    calls = []

    def fake(runs, rounds, **kwargs):
        calls.append(rounds)
        ratio = short if len(calls) == 1 else more
        return {name: [SimpleNamespace(min=1.0 if name == "torch" else 1.0 / ratio)] * rounds for name in runs}

    monkeypatch.setattr(kernel_choice, "interleaved_rounds", fake)
    monkeypatch.setattr(kernel_choice, "_faster_end_to_end", lambda *args: True)
    ratios = faster_blocks(gm, x, HOST, rounds=2)
    assert calls == ([2, 4] if retimed else [2])
    assert list(ratios.values()) == [more if retimed else short]  # 2 rounds at `short`, 4 at `more`
    assert any(isinstance(m, MacoInvertedResidual) for m in gm.modules()) == kept
    use_segments(gm, HOST)
    with torch.inference_mode():
        want = model(x)
        assert float((gm(x) - want).abs().max() / want.abs().max()) < 1e-4


def test_wide_weights_stream_ahead_of_the_gemm():
    """A GEMM whose W outgrows half of L1 sweeps it column panel by panel and prefetches each
    panel's rows W_AHEAD ahead (inside a model they come from memory), a small W, read once into
    L1, not; both equal torch (MobileNetV2's 96 -> 576 -> 160 block at 7x7)."""
    big = plan_of(n=1, c=96, h=7, w=7, m=576, k=160, threads=2)
    small = plan_of(n=1, c=16, h=14, w=14, m=64, k=16)
    assert "__builtin_prefetch" in big.source and "__builtin_prefetch" not in small.source
    for plan in (big, small):
        x = torch.randn(plan.input_shape, generator=torch.Generator().manual_seed(3))
        w = weights(plan, 3)
        want = reference(plan, x, w)
        got = run(plan, x, w)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())), float((got - want).abs().max())
