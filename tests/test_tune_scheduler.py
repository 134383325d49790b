"""The task scheduler and the search's mutation operators, on their own."""
import math
import random

from maco import ConvSpec
from maco.tune.search import _move_factor, crossover, mutate_tile
from maco.core.schedule import Schedule
from maco.tune.tuning import Task, TaskScheduler

SPEC = ConvSpec(1, 8, 10, 10, 16, 3, 3, padding=1)


def test_every_task_gets_a_first_round_then_the_heaviest_slowest_wins():
    tasks = [Task("a", SPEC, 1), Task("b", SPEC, 4), Task("c", SPEC, 1)]
    sched = TaskScheduler()
    sched.record(0, 16, 1e-3)
    assert sched.next_task(tasks) == 1  # b never ran
    sched.record(1, 16, 1e-3)
    assert sched.next_task(tasks) == 2
    sched.record(2, 16, 1e-3)
    assert sched.next_task(tasks) == 1  # same latency and trials, 4x the weight


def test_recent_gain_attracts_rounds():
    tasks = [Task("flat", SPEC), Task("improving", SPEC)]
    sched = TaskScheduler(alpha=0.9, window=2)
    for t, (g0, g1) in enumerate([(1.0, 1.0), (1.0, 0.8), (1.0, 0.6), (1.0, 0.4)]):
        sched.record(0, 16 * (t + 1), g0 * 1e-3)
        sched.record(1, 16 * (t + 1), g1 * 1e-3)
    assert sched.gradient(1, tasks[1]) < sched.gradient(0, tasks[0])
    assert sched.next_task(tasks) == 1


def test_move_factor_keeps_the_product_and_changes_two_levels():
    rng = random.Random(0)
    for factors in [(1, 2, 4, 8), (3, 1, 1, 5), (7, 1, 1, 1), (1, 1, 1, 1)]:
        for _ in range(20):
            out = _move_factor(factors, rng)
            assert math.prod(out) == math.prod(factors) and len(out) == len(factors)
            assert sum(a != b for a, b in zip(out, factors)) in ((0,) if math.prod(factors) == 1 else (2,))


def test_mutation_and_crossover_keep_tilings_perfect():
    rng = random.Random(1)
    a = Schedule(kind="cpu", spatial=((1, 1, 1, 1), (1, 1, 1, 1), (2, 1, 1, 8), (1, 2, 5, 1), (2, 1, 1, 5)),
                 reduction=((2, 4), (1, 3), (3, 1)))
    b = Schedule(kind="cpu", spatial=((1, 1, 1, 1), (1, 1, 1, 1), (1, 2, 1, 8), (5, 2, 1, 1), (1, 1, 5, 2)),
                 reduction=((8, 1), (3, 1), (1, 3)), layout="NHWC", unroll=64)
    for _ in range(100):
        for child in (mutate_tile(a, rng), crossover(a, b, rng)):
            assert not any("multiply to" in p for p in child.problems(SPEC)), child
