"""The compute-in-memory target: space counting and sampling against brute force, the
weight-update bound against every schedule of small layers, the template and MACO's default."""
from __future__ import annotations

import random
from collections import Counter
from itertools import permutations, product
from math import factorial

import numpy as np
import pytest
import sympy as sp
from scipy.stats import chisquare

from maco.space import schedules as space
from maco.bounds.cim import cim_weight_bound, derive_cim
from maco.core.errors import MacoError
from maco.core.factors import factorizations
from maco.kernels.cim_cost import cim_cost
from maco.kernels.cim_default import default_schedule, reduction_block, template_schedule
from maco.kernels.cim_sim import simulate
from maco.layouts.networks import NETWORKS, distinct_convs, network_convs
from maco.space.prune_cim import cim_reasons, cim_rules
from maco.core.axes import ALL_AXES, REDUCTION_AXES, SPATIAL_AXES, axis_extents
from maco.core.schedule import Schedule
from maco.core import sketch_cim
from maco.core.spec import ConvSpec
from maco.core.target import CimArch, Target

SMALL = Target.cim(cores=2, crossbars=4, rows=8, columns=8, psum_buffer=64, input_buffer=64)
SMALL_LAYERS = [ConvSpec(n=1, c=4, h=4, w=4, k=4, kh=1, kw=1),
                ConvSpec(n=2, c=2, h=2, w=2, k=2, kh=2, kw=2, padding=1),
                ConvSpec(n=1, c=4, h=6, w=4, k=4, kh=2, kw=1, stride=2, groups=2),
                ConvSpec(n=1, c=8, h=4, w=4, k=4, kh=3, kw=3, padding=1)]


def canonical_schedules(spec: ConvSpec):
    """Every schedule of the space up to the placement of loops with one trip (which changes
    nothing), with the number of full orders it stands for."""
    ext = axis_extents(spec)
    for spatial in product(*[factorizations(ext[a], 3) for a in SPATIAL_AXES]):
        for reduction in product(*[factorizations(ext[a], 2) for a in REDUCTION_AXES]):
            trips = sketch_cim.trips(Schedule(kind="cim", spatial=spatial, reduction=reduction,
                                              loop_order=ALL_AXES))
            active = [a for a in ALL_AXES if trips[a] > 1]
            rest = tuple(a for a in ALL_AXES if trips[a] == 1)
            for perm in permutations(active):
                for layout in ("NCHW", "NHWC"):
                    yield (Schedule(kind="cim", spatial=spatial, reduction=reduction, layout=layout,
                                    loop_order=tuple(perm) + rest),
                           factorial(len(ALL_AXES)) // factorial(len(active)))


@pytest.mark.parametrize("spec", SMALL_LAYERS[:3], ids=str)
def test_space_size_matches_brute_force(spec: ConvSpec) -> None:
    for pruned in (False, True):
        brute = sum(w for s, w in canonical_schedules(spec)
                    if not space.why_not(s, spec, SMALL, pruned=pruned))
        assert space.space_size(spec, SMALL, pruned=pruned) == brute > 0


def test_the_count_does_not_depend_on_where_one_trip_loops_sit() -> None:
    """The brute force above counts one placement of the loops with one trip: any other
    placement must be valid exactly when it is."""
    spec, rng = SMALL_LAYERS[1], random.Random(3)
    checked = 0
    for s, _ in canonical_schedules(spec):
        if rng.random() > 0.02:
            continue
        trips = sketch_cim.trips(s)
        order = list(s.loop_order)
        rng.shuffle(order)
        active = iter([a for a in s.loop_order if trips[a] > 1])
        moved = tuple(next(active) if trips[a] > 1 else a for a in order)
        other = Schedule(kind="cim", spatial=s.spatial, reduction=s.reduction, layout=s.layout,
                         loop_order=moved)
        for pruned in (False, True):
            assert bool(space.why_not(s, spec, SMALL, pruned=pruned)) == \
                bool(space.why_not(other, spec, SMALL, pruned=pruned))
        checked += 1
    assert checked > 50


@pytest.mark.parametrize("pruned", [False, True])
def test_draws_are_uniform(pruned: bool) -> None:
    spec = SMALL_LAYERS[0]
    expected = Counter()
    for s, w in canonical_schedules(spec):
        if not space.why_not(s, spec, SMALL, pruned=pruned):
            expected[(s.spatial, s.reduction)] += w
    rng = random.Random(7)
    draws = 6000
    seen = Counter((s.spatial, s.reduction) for s in
                   space.sample_many(spec, SMALL, draws, rng, pruned=pruned))
    keys = sorted(expected)
    total = sum(expected.values())
    assert set(seen) <= set(keys)
    stat = chisquare([seen[k] for k in keys], [draws * expected[k] / total for k in keys])
    assert stat.pvalue > 1e-4, stat


@pytest.mark.parametrize("network", ["resnet18", "alexnet", "vgg11", "mobilenet_v2"])
def test_network_draws_are_valid_and_the_pruned_space_holds_the_default(network: str) -> None:
    rng = random.Random(1)
    for target in (Target.cim(), Target.cim(psum_buffer=4096, input_buffer=16384)):
        for spec, _ in distinct_convs(network_convs(network)):
            default = default_schedule(spec, target)
            assert space.contains(default, spec, target, pruned=True), space.why_not(
                default, spec, target, pruned=True)
            assert space.space_size(spec, target, pruned=True) < space.space_size(spec, target)
            for s in space.sample_many(spec, target, 3, rng, pruned=True):
                assert not space.why_not(s, spec, target, pruned=True)
                cim_cost(spec, s, target)


def test_the_bound_in_sympy() -> None:
    d = derive_cim()
    M, K, R, S_w, S_p = sp.symbols("M K R S_w S_p", positive=True)
    assert sp.simplify(d.compulsory - K * R) == 0
    values = {M: 3136, K: 256, R: 1152, S_w: 576, S_p: 1024}
    assert d.Q.subs(values) == max(256 * 1152, sp.Rational(3136 * 256 * (1152 - 576), 1024))
    assert d.psum_limited.subs({**values, S_w: 2000}) == 0  # a whole column fits: no reload forced


@pytest.mark.parametrize("spec", SMALL_LAYERS, ids=str)
@pytest.mark.parametrize("psum_buffer", [64, 256])
def test_bound_is_never_above_a_schedule_and_pruning_keeps_the_best(spec: ConvSpec, psum_buffer: int) -> None:
    target = Target.cim(cores=2, crossbars=4, rows=8, columns=8, psum_buffer=psum_buffer,
                        input_buffer=256)
    bound = cim_weight_bound(spec, target.cim_arch)
    best_full = best_pruned = None
    for s, _ in canonical_schedules(spec):
        if s.layout == "NHWC" or s.problems(spec, target):
            continue
        cells = cim_cost(spec, s, target).weight_cells
        assert cells >= bound, s.describe()
        best_full = cells if best_full is None else min(best_full, cells)
        if not space.why_not(s, spec, target, pruned=True):
            best_pruned = cells if best_pruned is None else min(best_pruned, cells)
    assert best_pruned == best_full
    assert cim_cost(spec, default_schedule(spec, target), target).weight_cells == best_full


def test_the_bound_is_tight_where_each_weight_is_written_once() -> None:
    spec = ConvSpec(n=1, c=128, h=28, w=28, k=256, kh=3, kw=3, padding=1)  # the example layer
    target = Target.cim()
    bound = cim_weight_bound(spec, target.cim_arch)
    assert bound == 256 * 128 * 9 * target.cim_arch.cells_per_weight
    assert cim_cost(spec, default_schedule(spec, target), target).weight_cells == bound


def test_weight_updates_fall_by_90_percent_against_the_template() -> None:
    target = Target.cim()
    for network in ("resnet18", "alexnet", "vgg11"):
        template = maco_total = 0
        for _, spec in network_convs(network):
            template += cim_cost(spec, template_schedule(spec, target), target).weight_cells
            maco_total += cim_cost(spec, default_schedule(spec, target), target).weight_cells
        assert maco_total <= 0.1 * template, network


def test_template_rewrites_at_every_pixel_when_the_reduction_spans_blocks() -> None:
    spec = ConvSpec(n=1, c=128, h=28, w=28, k=256, kh=3, kw=3, padding=1)
    target = Target.cim()
    s = template_schedule(spec, target)
    assert sketch_cim.block(s)["k"] == 64 and s.factors("k")[0] == 4  # MVM-unit blocks over 4 cores
    blocks = 128 // sketch_cim.block(s)["c"]
    cost = cim_cost(spec, s, target)
    assert cost.weight_loads == 4 * 28 * 28 * blocks  # 4 cores, each: pixels x channel blocks


def test_prune_rules_name_what_they_remove() -> None:
    spec = ConvSpec(n=1, c=128, h=28, w=28, k=256, kh=3, kw=3, padding=1)
    target = Target.cim()
    rules = cim_rules(spec, target)
    template = template_schedule(spec, target)
    assert cim_reasons(template, rules) == ["the output sweep runs in 784 chunks, each writing every "
                                            "block again; the psum buffer needs only 1"]
    interleaved = Schedule(kind="cim", spatial=((1, 1, 1), (1, 1, 1), (4, 4, 16), (1, 28, 1), (1, 1, 28)),
                           reduction=((2, 64), (1, 3), (1, 3)),
                           loop_order=("k", "oh", "c", "kh", "n", "g", "ow", "kw"))
    assert any("image or pixel loop runs between weight loops" in r
               for r in cim_reasons(interleaved, rules))
    replicated = Schedule(kind="cim", spatial=((1, 1, 1), (1, 1, 1), (1, 16, 16), (4, 1, 7), (1, 1, 28)),
                          reduction=((2, 64), (1, 3), (1, 3)), loop_order=ALL_AXES)
    assert any("cores bound to oh" in r for r in cim_reasons(replicated, rules))


def test_reduction_block_fills_the_crossbars() -> None:
    arch = CimArch()
    assert reduction_block(ConvSpec(n=1, c=128, h=8, w=8, k=8, kh=3, kw=3), arch, 16) == (64, 3, 3)
    assert reduction_block(ConvSpec(n=1, c=3, h=32, w=32, k=8, kh=11, kw=11), arch, 16) == (3, 11, 11)
    with pytest.raises(MacoError, match="do not fit"):
        reduction_block(ConvSpec(n=1, c=3, h=8, w=8, k=8, kh=3, kw=3), arch, 16 * 10)


def test_targets_and_schedules_refuse_bad_cim_values() -> None:
    with pytest.raises(MacoError, match="crossbars must be a positive int"):
        Target.cim(crossbars=0)
    with pytest.raises(MacoError, match="unknown CIM size"):
        Target.cim(buffer=3)
    with pytest.raises(MacoError, match="takes 4 cells of 2 bits .* or 8 .* not 5"):
        CimArch(cell_bits=2, weight_bits=8, cells_per_weight=5)
    assert CimArch(cells_per_weight=8).weight_columns == 8  # a differential pair: 64x8 per crossbar
    spec = SMALL_LAYERS[0]
    s = default_schedule(spec, SMALL)
    assert Schedule.from_json(s.to_json()) == s
    bad = s.to_dict()
    bad["loop_order"] = ["n", "g", "k", "oh", "ow", "c", "kh", "kh"]
    with pytest.raises(MacoError, match="permutation"):
        Schedule.from_dict(bad)
    with pytest.raises(MacoError, match="psum buffer"):
        Schedule(kind="cim", spatial=((1, 1, 1), (1, 1, 1), (1, 1, 4), (1, 1, 4), (1, 1, 4)),
                 reduction=((4, 1), (1, 1), (1, 1)),
                 loop_order=ALL_AXES).validate(spec, Target.cim(psum_buffer=32))
    assert s.problems(spec, Target.h100()) == ["a cim schedule cannot run on the cuda target 'h100'"]
    cpu = Schedule(kind="cpu", spatial=((1, 1, 1, 1),) * 2 + ((1, 1, 1, 4), (1, 1, 1, 4), (1, 1, 1, 4)),
                   reduction=((4, 1), (1, 1), (1, 1)))
    assert "a cpu schedule cannot run on the cim target 'cim'" in cpu.problems(spec, SMALL)


def test_every_network_has_a_default_and_a_template() -> None:
    target = Target.cim()
    for network in NETWORKS:
        for spec, _ in distinct_convs(network_convs(network)):
            for s in (default_schedule(spec, target), template_schedule(spec, target)):
                assert not s.problems(spec, target)


def test_closed_form_counts_equal_the_simulator() -> None:
    """kernels/cim_cost.py counts in closed form what kernels/cim_sim.py counts by executing every
    iteration: they must agree on every field, on random layers and uniform draws of the space."""
    rng = random.Random(11)
    fields = ("weight_loads", "weight_cells", "crossbar_writes", "input_loads", "input_elements",
              "input_transactions", "output_elements", "output_transactions", "mvms",
              "peak_input_bytes", "peak_psums")
    checked = 0
    for trial in range(60):
        g = rng.choice((1, 1, 2))
        try:
            spec = ConvSpec(n=rng.choice((1, 2)), c=g * rng.choice((1, 2, 3, 4)), h=rng.randint(3, 7),
                            w=rng.randint(3, 7), k=g * rng.choice((1, 2, 4)), kh=rng.choice((1, 2, 3)),
                            kw=rng.choice((1, 3)), stride=rng.choice((1, 2)), padding=rng.randint(0, 2),
                            dilation=rng.choice((1, 1, 2)), groups=g)
        except MacoError:  # a kernel wider than the padded input
            continue
        target = Target.cim(cores=rng.choice((1, 2, 4)), crossbars=rng.choice((2, 4)), rows=rng.choice((4, 8)),
                            columns=8, cell_bits=2, weight_bits=4, psum_buffer=rng.choice((64, 256)),
                            input_buffer=rng.choice((32, 512)), dma_burst=rng.choice((4, 16)))
        if not space.space_size(spec, target):
            continue
        x = np.random.default_rng(trial).integers(-127, 128, spec.input_shape)
        w = np.random.default_rng(trial + 1).integers(-7, 8, spec.weight_shape)
        for s in space.sample_many(spec, target, 4, rng, pruned=trial % 2 == 1):
            counts = simulate(spec, s, target, x, w).counts
            cost = cim_cost(spec, s, target)
            assert {f: getattr(cost, f) for f in fields} == {f: getattr(counts, f) for f in fields}, \
                (str(spec), s.describe())
            checked += 1
    assert checked > 100


def test_the_simulator_runs_the_template_and_the_default_exactly() -> None:
    """Both schedules of a layer shaped like ResNet-18's (scaled to run fast) on the default chip:
    the same integer output as a quantised reference, and the closed-form counts."""
    import torch

    spec = ConvSpec(n=1, c=80, h=10, w=10, k=96, kh=3, kw=3, padding=1)  # 720 rows: 2 blocks
    target = Target.cim(psum_buffer=1024)
    rng = np.random.default_rng(5)
    x, w = rng.integers(-128, 128, spec.input_shape), rng.integers(-128, 128, spec.weight_shape)
    ref = torch.nn.functional.conv2d(torch.tensor(x, dtype=torch.float64), torch.tensor(w, dtype=torch.float64),
                                     padding=1).round().to(torch.int64).numpy()
    for s in (template_schedule(spec, target), default_schedule(spec, target)):
        res = simulate(spec, s, target, x, w)
        assert np.array_equal(res.output, ref), s.describe()
        cost = cim_cost(spec, s, target)
        assert (res.counts.weight_cells, res.counts.input_transactions, res.counts.peak_psums) == \
            (cost.weight_cells, cost.input_transactions, cost.peak_psums)


def test_cli_reports_a_network_and_writes_json(tmp_path, capsys) -> None:
    import json

    from maco.cli import main

    out = tmp_path / "cim.json"
    assert main(["cim", "alexnet", "--psum-buffer", "4096", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "psum buffer 4096 B" in text and "features.3" in text and "fewer" in text
    data = json.loads(out.read_text())
    assert data["target"]["cim_arch"]["psum_buffer"] == 4096 and len(data["layers"]) == 5
    assert all(row["maco_cells"] >= row["bound_cells"] for row in data["layers"])
    model = tmp_path / "net.py"
    model.write_text("import torch.nn as nn\nclass Net(nn.Sequential):\n"
                     "    def __init__(self):\n        super().__init__(nn.Conv2d(3, 8, 3, padding=1), "
                     "nn.ReLU(), nn.Conv2d(8, 4, 1))\n")
    assert main(["cim", f"{model}:Net"]) == 0
    # every weight once: (3*9*8 + 8*4) weights of 4 cells, the template too (one block each)
    assert "total: template 992 cells, MACO 992" in capsys.readouterr().out
    assert main(["cim", "n1_c4_h8_w8_k4_r3_p1", "--rows", "0"]) == 2
    assert "--rows: must be >= 1" in capsys.readouterr().err
    assert main(["cim", "alexnet", "--cells-per-weight", "3"]) == 2
    assert "not 3" in capsys.readouterr().err


def test_the_mapped_bound_lies_between_the_bound_and_every_schedule_of_the_space() -> None:
    target = Target.cim(cores=2, crossbars=2, rows=8, columns=8, psum_buffer=16, input_buffer=256)
    spec = SMALL_LAYERS[3]  # 72 reduction rows: more than the 16 rows of two crossbars; 4 psums
    arch = target.cim_arch
    bound, mapped = cim_weight_bound(spec, arch), cim_weight_bound(spec, arch, mapped=True)
    assert bound < mapped  # the psum term with 16 rows of a column resident instead of 32 weights
    best = min(cim_cost(spec, s, target).weight_cells for s, _ in canonical_schedules(spec)
               if s.layout == "NCHW" and not s.problems(spec, target))
    assert mapped <= best


def test_a_layer_too_large_to_count_is_one_line_naming_the_value_and_the_cap(capsys) -> None:
    """h = 1e9 walked every output row in the schedules' checks and the closed forms (hours); now it
    is refused at once, and a layer at the cap still counts within seconds."""
    import signal

    from maco.cli import main
    from maco.kernels.cim_cost import MAX_PIXELS, MAX_SIDE

    def too_slow(*_):
        raise TimeoutError("maco cim took over 60 s")

    old = signal.signal(signal.SIGALRM, too_slow)
    signal.alarm(60)
    try:
        assert main(["cim", "n1_c64_h1000000000_w56_k64_r3x3_p1"]) == 2
        err = capsys.readouterr().err
        assert f"h = 1000000000 is over the CIM model's cap of {MAX_SIDE} input rows" in err
        assert len(err.strip().splitlines()) == 1
        assert main(["cim", "n1_c64_h56_w100000_k64_r3x3_p1"]) == 2
        assert f"w = 100000 is over the CIM model's cap of {MAX_SIDE} input columns" in capsys.readouterr().err
        side = MAX_SIDE // 2
        assert main(["cim", f"n1_c64_h{side}_w{side}_k64_r3x3_p1"]) == 2
        assert f"h x w = {side * side} is over the CIM model's cap of {MAX_PIXELS}" in capsys.readouterr().err
        assert main(["cim", f"n1_c64_h{MAX_SIDE}_w{MAX_PIXELS // MAX_SIDE}_k64_r3x3_p1"]) == 0  # at the cap
        assert "total: template" in capsys.readouterr().out
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    big = ConvSpec.parse("n1_c64_h1000000000_w56_k64_r3x3_p1")
    for count in (template_schedule, default_schedule):
        with pytest.raises(MacoError, match="over the CIM model's cap"):
            count(big, Target.cim())
    with pytest.raises(MacoError, match="over the CIM model's cap"):
        cim_cost(big, template_schedule(ConvSpec.parse("n1_c64_h56_w56_k64_r3x3_p1"), Target.cim()), Target.cim())
