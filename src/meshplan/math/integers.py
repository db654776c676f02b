"""Divisors by trial division up to sqrt(n): bounded by construction (at most 2**20 trials for n <= 2**40)."""

from __future__ import annotations

from functools import lru_cache

from meshplan.errors import MeshplanError

# 2**40 chips, layers or sequences is far beyond any real system (meshplan.validate.MAX_CHIPS is 2**20); the bound
# keeps the trial division under ~2**20 steps.
MAX_FACTORED = 1 << 40


@lru_cache(maxsize=4096)
def divisors(n: int) -> tuple[int, ...]:
    """Every positive divisor of n, ascending."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise MeshplanError(f"cannot take the divisors of {n!r}: need a positive integer")
    if n > MAX_FACTORED:
        raise MeshplanError(f"{n} is too large to factor into a layout (at most 2**40)")
    primes: dict[int, int] = {}
    rest, p = n, 2
    while p * p <= rest:
        while rest % p == 0:
            primes[p] = primes.get(p, 0) + 1
            rest //= p
        p += 1 if p == 2 else 2
    if rest > 1:
        primes[rest] = primes.get(rest, 0) + 1
    out = [1]
    for prime, power in primes.items():
        out = [d * prime**k for d in out for k in range(power + 1)]
    return tuple(sorted(out))
