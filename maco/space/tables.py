"""What the CPU and GPU space tables share: exact weighted draws, the inner orders and kh/kw
extents a prune plan keeps, and its level rules as masks over a grid of tiles."""
from __future__ import annotations

import random
from itertools import permutations
from typing import Sequence

import numpy as np

from maco.core.axes import REDUCTION_AXES
from maco.core.errors import MacoError
from maco.core.factors import divisors
from maco.core.spec import ConvSpec
from maco.space import prune

INNER_ORDERS = tuple(permutations(REDUCTION_AXES))


def choice_index(weights: np.ndarray, rng: random.Random) -> int:
    """Index drawn with probability weights[i] / sum (exact integer arithmetic)."""
    cs = np.cumsum(weights.astype(np.int64).ravel())
    total = int(cs[-1]) if cs.size else 0
    if total <= 0:
        raise MacoError("internal: sampling from an empty part of the space")
    return int(np.searchsorted(cs, rng.randrange(total), side="right"))


def inner_orders(rules, kind: str, layout: str) -> tuple[tuple[str, ...], ...]:
    return tuple(o for o in INNER_ORDERS
                 if rules is None or not rules.alpha_one or prune.alpha_order_ok(o, kind, layout))


def window_extents(extent: int, rules) -> tuple[int, ...]:
    """Allowed inner extents of kh/kw (the full window only when alpha = 1)."""
    return (extent,) if rules is not None and rules.alpha_one else divisors(extent)


def broadcast_grid(values: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Per-axis 1-D arrays reshaped to broadcast over a 5-D grid."""
    return [v.reshape([-1 if i == j else 1 for j in range(len(values))]) for i, v in enumerate(values)]


def level_mask(rules, tile: str, spec: ConvSpec, axes: list[np.ndarray], chunk: int,
               window: tuple = (None, None)) -> np.ndarray | bool:
    """Where the level rules on this tile level hold (maco.space.prune.LevelRule), for one pass: `chunk`
    channels by `window` (kh1, kw1) taps (None: the whole window)."""
    if rules is None:
        return True
    mask = True
    for rule in rules.levels:
        if rule.tile == tile:
            mask = mask & rule.ok(spec, *axes, chunk, *window)
    return mask

