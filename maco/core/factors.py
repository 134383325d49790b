"""Divisors and ordered factorisations: the tilings of one loop axis, for the schedule spaces."""
from __future__ import annotations

from functools import lru_cache
from math import comb, prod


@lru_cache(maxsize=4096)
def divisors(n: int) -> tuple[int, ...]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))


def _exponents(n: int) -> list[int]:
    out, p = [], 2
    while p * p <= n:
        e = 0
        while n % p == 0:
            n //= p
            e += 1
        if e:
            out.append(e)
        p += 1
    if n > 1:
        out.append(1)
    return out


def n_factorizations(n: int, parts: int) -> int:
    """Ordered ways to write n as a product of `parts` positive factors (tau_parts(n))."""
    return prod(comb(e + parts - 1, parts - 1) for e in _exponents(n))


@lru_cache(maxsize=4096)
def factorizations(n: int, parts: int) -> tuple[tuple[int, ...], ...]:
    """All ordered `parts`-tuples of positive ints with product n."""
    if parts == 1:
        return ((n,),)
    return tuple((d,) + rest for d in divisors(n) for rest in factorizations(n // d, parts - 1))
