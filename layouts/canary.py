"""The canary: a small fixed conv timed around every measurement of the latency data set, and the
loads it reads that say whether a timing ran beside a busy neighbour or in a slow spell."""
from __future__ import annotations

import math
import time

from maco.core.spec import ConvSpec
from maco.core.timing import time_callable
from maco.layouts.latency import conv_callable

QUIET_LOAD = 1.5  # a canary slower than this times its quietest says the cores are busy now
# (1.5, not less: on a shared 2-core VM the canary alone wanders 1.0-1.4 from minute to minute)
SETTLED_LOAD = 1.05  # a label whose canary read at most this repeats (issue 20, AMD EPYC VM: labels
# timed twice in new processes minutes apart agreed within 5% for 95-100% of those at <= 1.05 in
# both runs, 75-82% of all; the FMA reference did not see those spells, the canary did)
CANARY = ConvSpec(1, 32, 28, 28, 32, 3, 3, 1, 1)  # ~15 MFLOP: tens of microseconds when quiet


class Canary:
    """A small fixed conv timed around every measurement. Neighbours on a shared machine are
    invisible to this process, and a busy core does not always make the rounds disagree: a
    contended 2-thread oneDNN call can wait for scheduler ticks on every call alike (a 20 us
    conv measured at a steady 8 or 48 ms). Such a slowdown shows in the canary, which is
    compared with its own quietest time."""

    def __init__(self, device: str = "cpu", calls: int = 5):
        self.run = conv_callable(CANARY, "NHWC", device)
        self.best = math.inf
        for _ in range(calls):
            self.load()

    def load(self) -> float:
        """The canary's time now over its quietest so far (1.0 = as quiet as ever seen)."""
        t = time_callable(self.run, repeats=5, min_run_time=5e-4, warmup=1).median
        self.best = min(self.best, t)
        return t / self.best

    def wait_quiet(self, patience: float = 30.0, limit: float = QUIET_LOAD) -> float:
        """Back off while the canary is slow (at most `patience` seconds); the last load."""
        start, pause = time.perf_counter(), 0.25
        while True:
            load = self.load()
            if load <= limit or time.perf_counter() - start >= patience:
                return load
            time.sleep(pause)
            pause = min(pause * 2, 4.0)
