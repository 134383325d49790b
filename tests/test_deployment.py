"""A saved optimized model: written as one JSON file, rebuilt from the caller's model without tuning,
outputs equal to the optimized model's; files from another machine or another model, or tampered
with, are refused with a clear error."""
import json
import math
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import maco
from maco import kernels
from maco.deploy.deployment import describe, load, save
from maco.core.errors import MacoError
from maco.core.spec import ConvSpec
from maco.core.target import Target
from maco.layouts import fuse
from maco.layouts.deploy import plan
from maco.layouts.maco_modules import MacoConv2d, MacoLinear, MacoPool2d, swap_module
from maco.layouts.networks import build, conv_layers, distinct_convs, example_input
from maco.deploy.kernel_choice import faster_linears, faster_pools, kernels_everywhere

HOST = kernels.host_target()


def _planned(model: nn.Module, x: torch.Tensor):
    """The planned_maco GraphModule of `model` on default NHWC schedules (no tuning) and its plan:
    what maco optimize builds before it picks linears and pools (tests/test_deploy_safety.py too)."""
    return kernels_everywhere(model, x, HOST, others=False)


def _optimized(net: str):
    """What maco optimize builds for the planned_maco variant, on the default schedules (no tuning)."""
    model, x = build(net), example_input(1)
    gm, p = _planned(model, x)
    faster_linears(gm, x, HOST, rounds=1)
    faster_pools(gm, x, HOST, rounds=1)
    return model, x, gm, describe(gm, "planned_maco", x, HOST, p)


@pytest.mark.parametrize("net", ["resnet18", "alexnet"])
def test_a_saved_model_loads_to_the_same_outputs(tmp_path, net):
    model, x, gm, dep = _optimized(net)
    save(dep, tmp_path / "m.maco")
    start = time.perf_counter()
    loaded = maco.load(tmp_path / "m.maco", build(net))
    took = time.perf_counter() - start
    assert took < 30  # warm build cache: seconds (the target is < 5 s on an idle machine)
    with torch.inference_mode():
        want, got, again = model(x), gm(x), loaded(x)
    assert float((want - again).abs().max() / want.abs().max()) < 1e-4
    torch.testing.assert_close(got, again, rtol=1e-5, atol=1e-5)
    assert sum(isinstance(m, MacoConv2d) for m in loaded.modules()) == len(dep.convs) > 0
    assert sum(isinstance(m, MacoLinear) for m in loaded.modules()) == len(dep.linears)
    assert sum(isinstance(m, MacoPool2d) for m in loaded.modules()) == len(dep.pools)
    save(loaded, tmp_path / "again.maco")  # a loaded model saves to the same description
    assert json.loads((tmp_path / "again.maco").read_text())["convs"] == json.loads(
        (tmp_path / "m.maco").read_text())["convs"]


def test_another_machine_is_named_or_runs_the_defaults(tmp_path):
    model, x, gm, dep = _optimized("resnet18")
    dep.target = {**dep.target, "model": "Some Other CPU", "cores": 64}
    save(dep, tmp_path / "m.maco")
    with pytest.raises(MacoError, match="Some Other CPU.*this is"):
        load(tmp_path / "m.maco", build("resnet18"))
    loaded = load(tmp_path / "m.maco", build("resnet18"), other_machine="defaults")
    with torch.inference_mode():
        assert float((model(x) - loaded(x)).abs().max() / model(x).abs().max()) < 1e-4


def test_another_thread_count_is_named(tmp_path):
    model, x, gm, dep = _optimized("resnet18")
    save(dep, tmp_path / "m.maco")
    saved = torch.get_num_threads()
    assert dep.threads == saved == dep.target["cores"]
    torch.set_num_threads(saved + 1)
    try:
        assert kernels.host_target().cores == saved + 1
        with pytest.raises(MacoError, match=f"tuned for {saved} threads and torch now uses {saved + 1}"):
            load(tmp_path / "m.maco", build("resnet18"))
    finally:
        torch.set_num_threads(saved)
    assert isinstance(load(tmp_path / "m.maco", build("resnet18")), nn.Module)


def test_another_model_is_refused(tmp_path):
    _, _, _, dep = _optimized("resnet18")
    save(dep, tmp_path / "m.maco")
    with pytest.raises(MacoError, match="another model"):
        load(tmp_path / "m.maco", build("resnet50"))
    other = build("resnet18")
    other.layer1[0].conv1 = nn.Conv2d(64, 64, 3, padding=2, dilation=2, bias=False)  # same shapes, other conv
    with pytest.raises(MacoError, match="not the saved"):
        load(tmp_path / "m.maco", other)


def test_tampered_files_are_refused_and_run_nothing(tmp_path):
    _, _, _, dep = _optimized("resnet18")
    good = dep.to_dict()
    path = next(iter(good["convs"]))
    evil = json.loads(json.dumps(good))
    evil["convs"][path]["schedule"]["extra"] = {"*/ int main; /*": 1}
    bad_tiles = json.loads(json.dumps(good))
    bad_tiles["convs"][path]["schedule"]["tiles"]["k"] = [1, 1, 1, 7]
    cases = {"evil": (evil, "unknown CPU schedule knob"), "tiles": (bad_tiles, "multiply to"),
             "version": ({**good, "version": 99}, "format version"),
             "variant": ({**good, "variant": "turbo"}, "unknown variant"),
             "path": ({**good, "convs": {"os.system": good["convs"][path]}}, "no Conv2d"),
             "nested": (None, "nested too deeply")}
    for name, (doc, words) in cases.items():
        f = tmp_path / f"{name}.maco"
        f.write_text("[" * 100_000 + "]" * 100_000 if doc is None else json.dumps(doc))
        with pytest.raises(MacoError, match=words):
            load(f, build("resnet18"))


def test_optimize_saves_and_the_cli_refuses_an_unwritable_save(tmp_path, capsys):
    from maco.cli import main

    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["optimize", "--save", str(blocker / "m.maco"), "--out", str(tmp_path / "out")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_pooling_kernels_are_saved_and_checked_on_load(tmp_path):
    model, x, gm, _ = _optimized("resnet18")
    p = plan(fuse(model, x), x, latency={(s, lay): (1.0 if lay == "NHWC" else 2.0)
                                          for s, _ in distinct_convs(conv_layers(model, x)) for lay in ("NCHW", "NHWC")},
             conversion=lambda shape, a, b: 1e-9)
    if not isinstance(gm.get_submodule("maxpool"), MacoPool2d):  # faster_pools kept torch's: swap it anyway
        swap_module(gm, "maxpool", MacoPool2d(gm.get_submodule("maxpool"), (1, 64, 112, 112), "NHWC", HOST))
    dep = describe(gm, "planned_maco", x, HOST, p)
    assert {k: dep.pools["maxpool"][k] for k in ("shape", "layout")} == {"shape": [1, 64, 112, 112], "layout": "NHWC"}
    save(dep, tmp_path / "m.maco")
    loaded = load(tmp_path / "m.maco", build("resnet18"))
    assert isinstance(loaded.get_submodule("maxpool"), MacoPool2d)
    with torch.inference_mode():
        assert float((model(x) - loaded(x)).abs().max() / model(x).abs().max()) < 1e-4
    for bad, match in (({"shape": [1, 64, "112", 112], "layout": "NHWC"}, "no valid input shape"),
                       ({"shape": [1, 64, 112, 112], "layout": "NCWH"}, "no generated kernel runs pooling")):
        dep.pools["maxpool"] = bad
        save(dep, tmp_path / "bad.maco")
        with pytest.raises(MacoError, match=match):
            load(tmp_path / "bad.maco", build("resnet18"))
    dep.pools = {"layer1": {"shape": [1, 64, 56, 56], "layout": "NHWC"}}
    save(dep, tmp_path / "bad.maco")
    with pytest.raises(MacoError, match="no MaxPool2d/AvgPool2d"):
        load(tmp_path / "bad.maco", build("resnet18"))


def _with_linears_as_convs(net: str, size: int):
    """`net` on default kernels everywhere, then every Linear that sees an (N, H, W, C) input run as
    a 1x1 NHWC conv (MacoLinearAsConv), whatever the timing says."""
    from maco.deploy.kernel_choice import arguments_seen
    from maco.layouts.maco_modules import MacoLinearAsConv, call_sites

    model = build(net).eval()
    x = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(0))
    gm, p = kernels_everywhere(model, x, HOST)
    calls = call_sites(gm)
    seen = arguments_seen(gm, x, [q for q in calls if isinstance(gm.get_submodule(q), nn.Linear)], copy=False)
    for path, args in seen.items():
        if args[0].dim() == 4:
            swap_module(gm, path, MacoLinearAsConv(gm.get_submodule(path), tuple(args[0].shape), HOST))
    return model, x, gm, p


def test_convnext_mlps_run_as_1x1_convs_and_load_back(tmp_path):
    """ConvNeXt's MLP Linears on channels-last activations are 1x1 NHWC convs in memory (GELU
    fused into the first): the same outputs as eager, and a saved model rebuilds them."""
    from maco.layouts.maco_modules import MacoLinearAsConv

    model, x, gm, p = _with_linears_as_convs("convnext_tiny", 64)
    swapped = [m for m in gm.modules() if isinstance(m, MacoLinearAsConv)]
    blocks = sum(n for _, n in type(model).STAGES)
    assert len(swapped) == 2 * blocks  # two per block, the first with its GELU in the kernel
    assert sum(getattr(m.torch_linear, "activation", "none") == "gelu" for m in swapped) == blocks
    with torch.inference_mode():
        want, got = model(x), gm(x)
    assert float((want - got).abs().max() / want.abs().max()) < 1e-4
    save(describe(gm, "planned_maco", x, HOST, p), tmp_path / "m.maco")
    loaded = maco.load(tmp_path / "m.maco", build("convnext_tiny"))
    assert sum(isinstance(m, MacoLinearAsConv) for m in loaded.modules()) == len(swapped)
    with torch.inference_mode():
        torch.testing.assert_close(loaded(x), got, rtol=1e-5, atol=1e-5)
    saved = json.loads((tmp_path / "m.maco").read_text())
    assert sum(f.endswith(" scaled") for f in saved["fusion"]) == blocks  # the layer scales folded
    assert sum(f.endswith(" none before scaled") for f in saved["fusion"]) == blocks  # and the residual adds
    assert sum(m.residual for m in loaded.modules() if isinstance(m, MacoLinearAsConv)) == blocks
    path = next(k for k, v in saved["linears"].items() if "shape" in v)
    saved["linears"][path]["shape"] = [1, 16, 16, 5]  # not the linear's inputs
    (tmp_path / "bad.maco").write_text(json.dumps(saved))
    with pytest.raises(MacoError, match="no valid \\(N, H, W, .*\\[1, 16, 16, 5\\]"):
        maco.load(tmp_path / "bad.maco", build("convnext_tiny"))


@pytest.mark.parametrize("defaults", [(False, False), (True, False)], ids=["before-scale-fold", "before-residual-fold"])
def test_a_convnext_saved_before_a_linear_fold_still_loads(tmp_path, monkeypatch, defaults):
    """A file written before fuse folded per-channel scales, or the residual adds, into Linears
    lists no such fold: it rebuilds without it, so that its layout plan fits the graph node for
    node."""
    from maco.layouts import fusion
    from maco.layouts.maco_modules import MacoLinearAsConv

    with monkeypatch.context() as m:
        m.setattr(fusion.fuse, "__defaults__", defaults)  # the fuse of earlier versions
        model, x, gm, p = _with_linears_as_convs("convnext_tiny", 64)
        dep = describe(gm, "planned_maco", x, HOST, p)
    assert dep.fusion and any(f.endswith(" scaled") for f in dep.fusion) == defaults[0]
    save(dep, tmp_path / "old.maco")
    loaded = maco.load(tmp_path / "old.maco", build("convnext_tiny"))
    assert not any(m.residual for m in loaded.modules() if isinstance(m, MacoLinearAsConv))
    with torch.inference_mode():
        torch.testing.assert_close(loaded(x), gm(x), rtol=1e-5, atol=1e-5)


def test_a_linear_as_conv_falls_back_on_other_inputs():
    from maco.layouts.fusion import FusedLinear
    from maco.layouts.maco_modules import MacoLinearAsConv

    gen = torch.Generator().manual_seed(3)
    for linear in (nn.Linear(24, 40), FusedLinear(nn.Linear(24, 40), "relu6"), nn.Linear(24, 8, bias=False)):
        mod = MacoLinearAsConv(linear.eval(), (2, 5, 7, 24), HOST, preallocate=True)
        x = torch.randn(2, 5, 7, 24, generator=gen) * 4
        with torch.inference_mode():
            torch.testing.assert_close(mod(x), linear(x), rtol=1e-5, atol=1e-5)
            for other in (x[:, :, :6], x.transpose(1, 2), torch.randn(3, 24, generator=gen)):
                torch.testing.assert_close(mod(other), linear(other), rtol=1e-5, atol=1e-5)
    linear = FusedLinear(nn.Linear(24, 40), "none", residual="before").eval()
    mod = MacoLinearAsConv(linear, (2, 5, 7, 24), HOST, preallocate=True)
    x, r = torch.randn(2, 5, 7, 24, generator=gen), torch.randn(2, 5, 7, 40, generator=gen)
    with torch.inference_mode():
        torch.testing.assert_close(mod(x, r), F.linear(x, linear.weight, linear.bias) + r, rtol=1e-5, atol=1e-5)
        for other in (r.transpose(1, 2).contiguous().transpose(1, 2), r.double()):  # torch's linear and add
            torch.testing.assert_close(mod(x, other), linear(x, other), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mod(x[:, :, :6], r[:, :, :6]), linear(x[:, :, :6], r[:, :, :6]), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mod(x), F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
    with pytest.raises(MacoError, match="on \\(2, 5, 7, 23\\)"):
        MacoLinearAsConv(nn.Linear(24, 8), (2, 5, 7, 23), HOST)


def test_the_kernel_sum_counts_depthwise_convs_and_linears_run_as_convs():
    """conv_share times a depthwise kernel and a Linear run as a 1x1 conv (ConvNeXt's MLP, most of
    its time) as the conv kernels they are, with their specs for the floor, and skips both in the
    model's rest."""
    from maco.layouts.end_to_end import _Skipping, conv_share
    from maco.layouts.maco_modules import MacoDepthwise2d, MacoLinearAsConv
    from maco.layouts.networks import Permute

    dw = nn.Conv2d(32, 32, 7, padding=3, groups=32).eval()
    spec = ConvSpec.from_module(dw, (1, 32, 14, 14))
    model = nn.Sequential(MacoDepthwise2d(dw, spec, "NHWC", HOST, preallocate=True), Permute(0, 2, 3, 1),
                          MacoLinearAsConv(nn.Linear(32, 64).eval(), (1, 14, 14, 32), HOST, preallocate=True)).eval()
    x = torch.randn(spec.input_shape).contiguous(memory_format=torch.channels_last)
    share = conv_share(model, x, rounds=1, min_run_time=1e-4)
    assert set(share.per_conv) == {"0", "2"} and all(t > 0 for t in share.per_conv.values())
    assert share.specs["0"] == (spec,) and share.specs["2"] == (ConvSpec(n=1, c=32, h=14, w=14, k=64, kh=1, kw=1),)
    with torch.inference_mode():
        want = model(x).clone()
        model[0]._out.zero_()
        model[2]._out.zero_()
        assert float(_Skipping(model).run((x,))().abs().max()) == 0.0  # neither kernel ran
        torch.testing.assert_close(model(x), want)  # and both run again after


def _cuda_file(tmp_path, **extra):
    """A small model's saved description as `maco optimize --target cuda` writes one (its CPU
    schedules' fields do not matter: a CUDA file is refused or rebuilt before they are read)."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)).eval()
    x = torch.randn(1, 3, 12, 12)
    gm, p = _planned(model, x)
    dep = describe(gm, "planned_maco", x, HOST, p)
    dep.target = Target.h100().fingerprint()
    for name, value in extra.items():
        setattr(dep, name, value)
    save(dep, tmp_path / "gpu.maco")
    return model, tmp_path / "gpu.maco"


def test_a_cuda_file_holds_convs_alone_and_needs_a_gpu(tmp_path):
    from maco.kernels.cuda import gpu_available

    model, path = _cuda_file(tmp_path, pools={"1": {"shape": [1, 8, 12, 12], "layout": "NCHW"}})
    with pytest.raises(MacoError, match="CUDA GPU holds convs alone, this one also pools"):
        load(path, model)
    model, path = _cuda_file(tmp_path)
    if gpu_available():
        pytest.skip("a GPU is usable here: the GPU test below loads such a file")
    with pytest.raises(MacoError, match="tuned for a CUDA GPU needs an NVIDIA GPU"):
        load(path, model)


def test_a_model_in_a_cuda_graph_saves_what_it_replays(tmp_path):
    """save() reads the model inside a CudaGraphed one (as optimize and load hand it back on a GPU)."""
    from maco.layouts.cuda_graph import CudaGraphed

    model, x, gm, dep = _optimized("alexnet")
    save(dep, tmp_path / "m.maco")
    loaded = load(tmp_path / "m.maco", build("alexnet"))
    save(CudaGraphed(loaded), tmp_path / "graphed.maco")
    assert json.loads((tmp_path / "graphed.maco").read_text()) == json.loads((tmp_path / "m.maco").read_text())


@pytest.mark.gpu
def test_gpu_a_cuda_file_loads_onto_the_gpu(tmp_path):
    """What `maco optimize --target cuda --save` writes (every conv on a default CUDA schedule)
    loads back onto the GPU, in a CUDA graph, to eager's outputs, and saves again unchanged."""
    from maco.kernels.cuda import gpu_available
    from maco.layouts.cuda_graph import CudaGraphed, unwrap
    from maco.layouts.maco_modules import use_maco_kernels

    if not (gpu_available() and torch.cuda.is_available()):
        pytest.skip("no NVIDIA GPU with CuPy here")
    prev = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        gpu = Target.h100()
        model = build("resnet18").cuda().eval()
        x = example_input(1).cuda()
        specs = [s for s, _ in distinct_convs(conv_layers(model, x))]
        fused = fuse(model, x)  # every conv in NHWC, as kernels_everywhere plans a CPU model
        p = plan(fused, x, latency={(s, lay): 1.0 if lay == "NHWC" else 2.0 for s in specs for lay in ("NCHW", "NHWC")},
                 conversion=lambda shape, a, b: 1e-12 * math.prod(shape))
        gm = p.apply(fused)
        chosen = {s: {"NHWC": kernels.default_schedule(s, gpu, "NHWC")} for s in specs}
        assert use_maco_kernels(gm, p, chosen, gpu)
        dep = describe(gm, "planned_maco", x, gpu, p)
        save(dep, tmp_path / "gpu.maco")
        loaded = load(tmp_path / "gpu.maco", build("resnet18"))
        assert isinstance(loaded, CudaGraphed)
        convs = [m for m in unwrap(loaded).modules() if isinstance(m, MacoConv2d)]
        assert len(convs) == len(dep.convs) > 0 and all(m._device == "cuda" for m in convs)
        with torch.inference_mode():
            want, got, again = model(x), loaded(x), loaded(x)
        assert float((want - got).abs().max() / want.abs().max()) < 1e-4
        torch.testing.assert_close(got, again)
        save(loaded, tmp_path / "again.maco")
        assert json.loads((tmp_path / "again.maco").read_text()) == json.loads((tmp_path / "gpu.maco").read_text())
    finally:
        torch.backends.cudnn.allow_tf32 = prev
