"""What the latency data set measures: random convs drawn from the shapes CNNs use, and the
distinct conv layers of the built-in networks."""
from __future__ import annotations

import math
import random
from typing import Any, Sequence

from maco.core.errors import MacoError
from maco.core.spec import ConvSpec
from maco.layouts.networks import NETWORKS, distinct_convs, network_convs

_COMMON_CHANNELS = [8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512, 576, 768, 960,
                    1024, 2048]
_COMMON_SIZES = [7, 13, 14, 27, 28, 55, 56, 112, 224]


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def _channels(rng: random.Random) -> int:
    return rng.choice(_COMMON_CHANNELS) if rng.random() < 0.65 else _log_uniform(rng, 4, 1024)


def _size(rng: random.Random) -> int:
    return rng.choice(_COMMON_SIZES) if rng.random() < 0.65 else _log_uniform(rng, 4, 230)


def random_spec(rng: random.Random, *, max_flops: float = 2e9, max_bytes: int = 64 << 20,
                batches: Sequence[int] = (1, 2, 4, 8),
                batch_weights: Sequence[float] = (0.8, 0.08, 0.07, 0.05)) -> ConvSpec:
    """One conv drawn from shapes CNNs use: common channel counts and feature-map sizes mixed
    with log-uniform ones, kernels 1..11 (a few rectangular), strides 1/2/4, 'same' or zero
    padding, some dilation, grouped and depthwise convs; at most `max_flops` flops and
    `max_bytes` of input plus output, so that no configuration takes long to time."""
    while True:
        n = rng.choices(list(batches), list(batch_weights))[0]
        kernel = rng.choices([1, 3, 5, 7, 11], [0.35, 0.45, 0.1, 0.07, 0.03])[0]
        kh = kw = kernel
        if rng.random() < 0.05:
            kh, kw = rng.choice([(1, 3), (3, 1), (1, 7), (7, 1)])
        h = _size(rng)
        w = h if rng.random() < 0.85 else _size(rng)
        c = 3 if rng.random() < 0.06 else _channels(rng)
        k = _channels(rng)
        r = rng.random()
        groups = 1
        if r < 0.12 and c > 1:  # depthwise, sometimes with a channel multiplier
            groups, k = c, c * rng.choice([1, 1, 1, 2])
            kh = kw = rng.choice([3, 3, 5, 7])
        elif r < 0.2:
            options = [g for g in (2, 4, 8, 16, 32) if c % g == 0 and g < c]
            if options:
                groups = rng.choice(options)
                k = max(groups, k // groups * groups)
        big = max(kh, kw) >= 7
        stride = rng.choices([1, 2, 4], [0.72, 0.25, 0.03 if big else 0.0])[0]
        dilation = 2 if kh == kw == 3 and rng.random() < 0.08 else 1
        pad_kind = rng.choices(["same", "zero", "other"], [0.7, 0.25, 0.05])[0]
        if pad_kind == "same":
            padding = (dilation * (kh - 1) // 2, dilation * (kw - 1) // 2)
        elif pad_kind == "zero":
            padding = (0, 0)
        else:
            p = rng.randint(0, max(kh, kw) // 2 + 1)
            padding = (p, p)
        try:
            spec = ConvSpec(n, c, h, w, k, kh, kw, stride, padding, dilation, groups)
        except MacoError:
            continue
        if spec.flops <= max_flops and spec.input_bytes + spec.output_bytes <= max_bytes:
            return spec


def random_specs(count: int, seed: int = 0, **kwargs: Any) -> list[ConvSpec]:
    """`count` random specs; the first m of count > m equal the m of a shorter call (same seed),
    so a larger --random extends a data set instead of replacing it."""
    if count < 0:
        raise MacoError(f"the number of random configurations must be >= 0, got {count}")
    rng = random.Random(seed)
    return [random_spec(rng, **kwargs) for _ in range(count)]


def network_specs(names: Sequence[str], batch: int = 1) -> list[tuple[str, ConvSpec]]:
    """(source, spec) for every distinct conv layer of the named built-in networks."""
    out = []
    for name in names:
        if name not in NETWORKS:
            raise MacoError(f"unknown network {name!r}; choose from {', '.join(NETWORKS)}")
        out += [(f"{name}:{layers[0]}", spec) for spec, layers in
                distinct_convs(network_convs(name, batch))]
    return out
