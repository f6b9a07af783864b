"""Orthonormal Hadamard matrices, built exactly in float64 and then cast.

Contract: ``hadamard(n)`` is an n x n matrix H with entries +-1/sqrt(n) and H @ H.T = I (to
float64 rounding), the same for the same n on every call. The constructions:

- Sylvester: order 2^m, H_{2k} = [[H_k, H_k], [H_k, -H_k]].
- Paley I: q prime, q = 3 (mod 4): order q + 1 (q = 11 gives 12).
- Paley II: q prime, q = 1 (mod 4): order 2(q + 1) (q = 17 gives 36).
- Kronecker products: a Paley matrix of order k times a Sylvester matrix of order 2^m gives
  order k * 2^m (SmolLM2's hidden 576 = 36 * 16, intermediate 1536 = 12 * 128).

``hadamard_order(n)`` says whether n is an order these reach (``orders_of``). Where it is not,
``block_hadamard(n)`` is block-diagonal: n / b copies of ``hadamard(b)`` for the largest
constructible b that divides n (still orthonormal, but it mixes channels only within each block
of b consecutive channels; for odd n that is b = 1, the identity, which callers that must
rotate refuse).
"""

from __future__ import annotations

import math
from enum import Enum
from functools import lru_cache

import torch

from lowbit.errors import QuantizationError


def _is_prime(q: int) -> bool:
    if q < 2:
        return False
    return all(q % d for d in range(2, math.isqrt(q) + 1))


class Paley(Enum):
    ONE = 1  # Paley I: order q + 1, q prime, q = 3 (mod 4)
    TWO = 2  # Paley II: order 2(q + 1), q prime, q = 1 (mod 4)


def _paley_base(k: int) -> Paley | None:
    """Which of Paley's constructions builds order k, or None."""
    if k % 4 == 0 and _is_prime(k - 1) and (k - 1) % 4 == 3:
        return Paley.ONE
    if k % 4 == 0 and _is_prime(k // 2 - 1) and (k // 2 - 1) % 4 == 1:
        return Paley.TWO
    return None


def orders_of(n: int) -> tuple[int, int] | None:
    """(k, 2^m) with n = k * 2^m, k = 1 or a Paley order, choosing the smallest Paley base; None
    when no Hadamard matrix of order n is constructible here."""
    if n < 1:
        return None
    p = 1
    candidates = []
    while n % p == 0:
        k = n // p
        if k == 1 or _paley_base(k) is not None:
            candidates.append((k, p))
        p *= 2
    return min(candidates) if candidates else None


def hadamard_order(n: int) -> bool:
    """Whether ``hadamard(n)`` exists (see the module docstring)."""
    return orders_of(n) is not None


def _legendre(a: int, q: int) -> int:
    a %= q
    if a == 0:
        return 0
    return 1 if pow(a, (q - 1) // 2, q) == 1 else -1


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[i, j] = legendre(j - i, q), a q x q matrix of 0, +-1."""
    i = torch.arange(q).reshape(-1, 1)
    j = torch.arange(q).reshape(1, -1)
    chi = torch.tensor([_legendre(a, q) for a in range(q)], dtype=torch.float64)
    return chi[(j - i) % q]


def _paley1(q: int) -> torch.Tensor:
    """Order q + 1 (+-1 entries): I + S with S = [[0, 1^T], [-1, Q]] skew-symmetric."""
    s = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    s[0, 1:] = 1.0
    s[1:, 0] = -1.0
    s[1:, 1:] = _jacobsthal(q)
    return s + torch.eye(q + 1, dtype=torch.float64)


def _paley2(q: int) -> torch.Tensor:
    """Order 2(q + 1) (+-1 entries) from the symmetric conference matrix C = [[0, 1^T], [1, Q]]:
    each 0 becomes [[1, -1], [-1, -1]], each +-1 becomes +-[[1, 1], [1, -1]]."""
    c = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    c[0, 1:] = 1.0
    c[1:, 0] = 1.0
    c[1:, 1:] = _jacobsthal(q)
    one = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    zero = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    return torch.kron(c, one) + torch.kron(torch.eye(q + 1, dtype=torch.float64), zero)


def _sylvester(p: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < p:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@lru_cache(maxsize=32)
def _hadamard64(n: int) -> torch.Tensor:
    found = orders_of(n)
    if found is None:
        raise QuantizationError(f"no Hadamard matrix of order {n} is constructible here "
                                f"(orders k * 2^m with k = 1, q + 1 for a prime q = 3 mod 4, or 2(q + 1) for a "
                                f"prime q = 1 mod 4); use block_hadamard({n})")
    k, p = found
    base = torch.ones(1, 1, dtype=torch.float64)
    if k > 1:
        base = _paley1(k - 1) if _paley_base(k) is Paley.ONE else _paley2(k // 2 - 1)
    return torch.kron(base, _sylvester(p)) / math.sqrt(n)


def hadamard(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The orthonormal Hadamard matrix of order ``n`` in ``dtype`` (a QuantizationError naming n
    when the order is not constructible: ``hadamard_order``)."""
    return _hadamard64(n).to(dtype)


def block_size(n: int) -> int:
    """The largest constructible Hadamard order that divides ``n`` (``n`` itself when
    ``hadamard_order(n)``; 1 for odd n)."""
    return max(b for b in range(1, n + 1) if n % b == 0 and hadamard_order(b))


def block_hadamard(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``hadamard(n)`` when constructible, else block-diagonal with ``n / block_size(n)`` copies of
    ``hadamard(block_size(n))`` (module docstring). Orthonormal either way."""
    b = block_size(n)
    return torch.block_diag(*([_hadamard64(b)] * (n // b))).to(dtype)
