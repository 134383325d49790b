"""The evolutionary search and the cost model on a synthetic landscape (the bound-based analytic
time with noise), so that the logic is tested apart from compilers and timers."""
import random
from dataclasses import replace

import numpy as np
import pytest

from maco import ConvSpec, space
from maco.tune.cost_model import CostModel, analytic_score, analytic_seconds, features, register_intensity
from maco.tune.records import RecordFile, make_record
from maco.core.schedule import Schedule
from maco.tune.search import (SearchConfig, TaskState, crossover, evolve, mutate_annotation, mutate_tile,
                              register_reshapes, search_round)
from maco.core.timing import Timing
from maco.tune.tuning import Task, tune
from tests.targets import AVX2, AVX512

SPEC = ConvSpec.parse("n1_c32_h28_w28_k64_r3_p1")


def synthetic(fail_every: int = 0):
    """A measurer whose 'time' is the analytic estimate with 5% noise; every `fail_every`-th
    schedule fails, as a crashed kernel would."""
    rng, calls = random.Random(1), [0]

    def measure(spec, schedules, target):
        out = []
        for s in schedules:
            calls[0] += 1
            if fail_every and calls[0] % fail_every == 0:
                out.append((None, "worker died (exit code -11)"))
                continue
            t = analytic_seconds(spec, target, s) * rng.uniform(0.95, 1.05)
            out.append((Timing.from_samples([t], 1), None))
        return out
    return measure


def test_mutations_and_crossover_keep_perfect_tilings():
    rng = random.Random(0)
    config = SearchConfig()
    pop = space.sample_many(SPEC, AVX2, 40, 0)
    for _ in range(300):
        a, b = rng.sample(pop, 2)
        for child in (mutate_tile(a, rng), mutate_annotation(a, rng, AVX2, config), crossover(a, b, rng)):
            tiling_problems = [p for p in child.problems(SPEC) if "factors" in p]
            assert tiling_problems == []


def test_evolution_stays_inside_the_pruned_space():

    rng = random.Random(0)
    config = SearchConfig(population=32, generations=2)
    init = space.sample_many(SPEC, AVX2, 32, 0, pruned=True)
    out = evolve(SPEC, AVX2, init, lambda pop: [1.0] * len(pop), rng, config)
    assert len(out) > len(init)
    assert all(space.contains(s, SPEC, AVX2, pruned=True) and not s.problems(SPEC, AVX2) for s in out)


def test_a_layout_change_keeps_a_pruned_schedule_in_the_pruned_space():
    """alpha = 1 wants c first in NCHW and last in NHWC: switching layout moves c with it, and
    leaves an order that never met the rule (unpruned search) as it was."""
    from dataclasses import replace

    from maco.tune.search import with_layout

    for s in space.sample_many(SPEC, AVX2, 20, 3, pruned=True):
        other = with_layout(s, "NHWC" if s.layout == "NCHW" else "NCHW")
        assert other.layout != s.layout and space.contains(other, SPEC, AVX2, pruned=True), other
        assert [a for a in other.inner_order if a != "c"] == [a for a in s.inner_order if a != "c"]
    odd = replace(space.sample_many(SPEC, AVX2, 1, 4, pruned=True)[0], layout="NCHW", inner_order=("kh", "c", "kw"))
    assert with_layout(odd, "NHWC").inner_order == ("kh", "c", "kw")


def test_cost_model_learns_the_ranking():
    train = space.sample_many(SPEC, AVX2, 200, 1)
    test = space.sample_many(SPEC, AVX2, 100, 2)
    measure = synthetic()
    recs = [make_record(SPEC, AVX2, s, t, e) for s, (t, e) in zip(train, measure(SPEC, train, AVX2))]
    model = CostModel(AVX2).fit(recs)
    assert model.booster is not None
    score = model.predict(SPEC, test)
    truth = np.array([1 / analytic_seconds(SPEC, AVX2, s) for s in test])
    rank = lambda v: np.argsort(np.argsort(v))  # noqa: E731
    assert np.corrcoef(rank(score), rank(truth))[0, 1] > 0.6
    assert len(features(SPEC, AVX2, test[0])) == model.booster.num_features()


def test_cost_model_ranks_an_unseen_conv_by_the_analytic_estimate():
    """Trained on one conv only, the model must not rank another conv it has no data for."""
    other = ConvSpec.parse("n1_c3_h56_w56_k16_r7_s2_p3")
    train = space.sample_many(other, AVX2, 60, 1)
    recs = [make_record(other, AVX2, s, t, e) for s, (t, e) in zip(train, synthetic()(other, train, AVX2))]
    model = CostModel(AVX2).fit(recs)
    assert model.booster is not None and model.trained_on == {other}
    test = space.sample_many(SPEC, AVX2, 30, 2)
    assert list(model.predict(SPEC, test)) == [analytic_score(SPEC, AVX2, s) for s in test]
    assert list(model.predict(other, test[:1])) != [analytic_score(other, AVX2, test[0])]


def test_analytic_score_breaks_roofline_ties_by_the_register_tiles_reuse_per_pass():
    """Two schedules the roofline cannot tell apart: the one whose register tile reduces more
    channels per pass (its accumulators cross to L1 less often) ranks first, and the tie-break
    never reorders schedules the roofline does separate."""
    from dataclasses import replace

    deep = next(s for s in space.sample_many(SPEC, AVX2, 400, 5) if s.factors("c")[1] >= 8)
    c0, c1 = deep.factors("c")
    shallow = replace(deep, reduction=tuple((c0 * c1, 1) if i == 0 else f for i, f in enumerate(deep.reduction)))
    assert shallow.factors("c") == (c0 * c1, 1)
    assert analytic_seconds(SPEC, AVX2, shallow) == analytic_seconds(SPEC, AVX2, deep)
    assert register_intensity(SPEC, deep) > register_intensity(SPEC, shallow)
    assert analytic_score(SPEC, AVX2, deep) > analytic_score(SPEC, AVX2, shallow)
    for s in space.sample_many(SPEC, AVX2, 40, 6):
        a, b = 1 / analytic_seconds(SPEC, AVX2, s), 1 / analytic_seconds(SPEC, AVX2, deep)
        if abs(a / b - 1) > 0.01:
            assert (analytic_score(SPEC, AVX2, s) > analytic_score(SPEC, AVX2, deep)) == (a > b)


def test_analytic_estimate_counts_a_portable_micro_kernel_as_scalar():
    from dataclasses import replace

    from maco.kernels.cpu_codegen import intrinsics_isa

    fast = next(s for s in space.sample_many(SPEC, AVX2, 200, 4)
                if s.vector_axis == "k" and intrinsics_isa(SPEC, s, AVX2))
    portable = replace(fast, weight_packing="none")
    assert intrinsics_isa(SPEC, portable, AVX2) is None
    assert analytic_seconds(SPEC, AVX2, portable) > analytic_seconds(SPEC, AVX2, fast)


def test_tuning_improves_records_failures_and_resumes(tmp_path):
    path = tmp_path / "records.jsonl"
    seed_schedule = space.sample(SPEC, AVX2, 7)
    task = Task("conv", SPEC, seeds=(seed_schedule,))
    config = SearchConfig(batch=8, population=48, generations=2)
    result = tune([task], AVX2, 40, synthetic(fail_every=7), records=path, config=config, seed=3)
    recs = RecordFile(path).load()
    assert result.trials == 40 == len(recs)
    assert recs[0].schedule == seed_schedule  # the seed goes first
    assert sum(not r.ok for r in recs) == 5 and all("exit code" in r.error for r in recs if not r.ok)
    first, best = recs[1].seconds, min(r.seconds for r in recs)
    assert best < first
    again = tune([task], AVX2, 40, synthetic(), records=path, config=config, seed=3)
    assert again.trials == 0 and len(RecordFile(path).load()) == 40  # resumed: nothing to do
    more = tune([task], AVX2, 48, synthetic(), records=path, config=config, seed=3)
    assert more.trials == 8 and more.best(0).seconds <= best


def test_task_scheduler_spreads_trials_by_weight(tmp_path):
    small = ConvSpec.parse("n1_c16_h14_w14_k16_r3_p1")
    tasks = [Task("big", SPEC, weight=4), Task("small", small, weight=1)]
    result = tune(tasks, AVX2, 64, synthetic(), config=SearchConfig(batch=8, population=32,
                                                                    generations=1), seed=0)
    counts = [len(s.records) for s in result.states]
    assert sum(counts) == 64 and min(counts) >= 8 and counts[0] > counts[1]


def test_bad_config_is_named():
    from maco import MacoError

    with pytest.raises(MacoError, match="eps_greedy"):
        SearchConfig(eps_greedy=2.0)
    with pytest.raises(MacoError, match="trials must be >= 0, got -1"):
        tune([Task("c", SPEC)], AVX2, -1, synthetic())


def test_a_budget_smaller_than_a_batch_per_task_still_measures_every_task():
    specs = [ConvSpec.parse(f"n1_c16_h14_w14_k{k}_r3_p1") for k in (16, 32, 48, 64, 80)]
    tasks = [Task(f"t{i}", s) for i, s in enumerate(specs)]
    result = tune(tasks, AVX2, 15, synthetic(), config=SearchConfig(batch=16, population=16,
                                                                    generations=1), seed=0)
    counts = [len(s.records) for s in result.states]
    assert sum(counts) == 15 and counts == [3, 3, 3, 3, 3]


def test_a_conv_with_a_negligible_share_of_the_work_gets_its_seeds_and_no_search(tmp_path):
    """An SE block's 1x1 conv on a 1x1 map (2 kFLOP beside 29 MFLOP) would take a search's
    rounds for a kernel of microseconds; it gets its seeds, the big conv all the rest."""
    tiny = ConvSpec.parse("n1_c64_h1_w1_k16_r1")
    seed = space.sample(tiny, AVX2, 0)
    tasks = [Task("big", SPEC), Task("tiny", tiny, seeds=(seed,))]
    path = tmp_path / "records.jsonl"
    config = SearchConfig(batch=8, population=32, generations=1)
    result = tune(tasks, AVX2, 40, synthetic(), records=path, config=config, seed=0)
    assert [len(s.records) for s in result.states] == [39, 1]
    assert result.states[1].records[0].schedule == seed
    again = tune(tasks, AVX2, 48, synthetic(), records=path, config=config, seed=0)  # resumed
    assert [len(s.records) for s in again.states] == [47, 1]


def test_budget_trials_caps_the_quick_budget_only():
    from maco import MacoError
    from maco.tune.tuning import BUDGET_CAPS, BUDGETS, budget_trials

    assert budget_trials("quick", 2) == 2 * BUDGETS["quick"]
    assert budget_trials("quick", 46) == BUDGET_CAPS["quick"] < 46 * BUDGETS["quick"]
    assert budget_trials("thorough", 46) == 46 * BUDGETS["thorough"]
    with pytest.raises(MacoError, match="unknown budget 'fast'"):
        budget_trials("fast", 3)


POINTWISE = ConvSpec.parse("n1_c1024_h14_w14_k256_r1x1")
WIDE = Schedule(kind="cpu", spatial=((1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 8, 32), (2, 7, 1, 1), (1, 1, 1, 14)),
                reduction=((1, 1024), (1, 1), (1, 1)), parallel=4, vector_axis="k", vector_width=16,
                inner_order=("kh", "kw", "c"), layout="NHWC", weight_packing="blocked")


def test_register_reshapes_split_the_same_accumulators_another_way():
    (tall,) = register_reshapes(WIDE)  # 14 pixels x 2 filter vectors -> 7 x 4; 28 x 1 needs ow's outer level
    assert tall.register_tile()["ow"] == 7 and tall.register_tile()["k"] == 64
    assert tall.accumulators == WIDE.accumulators == 28
    for axis in ("k", "ow"):  # the tiles around the register tile stay
        assert tall.tile(axis, 2) == WIDE.tile(axis, 2) and tall.factors(axis)[:2] == WIDE.factors(axis)[:2]
    assert not tall.problems(POINTWISE, AVX512) and space.contains(tall, POINTWISE, AVX512, pruned=True)
    assert WIDE in register_reshapes(tall)  # and back
    assert register_reshapes(replace(WIDE, kind="cuda")) == []


def test_a_search_round_measures_the_reshapes_of_the_best_schedule():
    seen = []

    def measure(spec, schedules, target):
        seen.extend(schedules)
        return [(Timing.from_samples([1e-3], 1), None) for _ in schedules]

    class Flat:
        def predict(self, spec, schedules):
            return [0.0] * len(schedules)

    state = TaskState(POINTWISE, [make_record(POINTWISE, AVX512, WIDE, Timing.from_samples([1e-3], 1), None)])
    search_round(state, AVX512, Flat(), measure, random.Random(0), SearchConfig(population=8, generations=1), n=4)
    assert register_reshapes(WIDE)[0] in seen[:1]
